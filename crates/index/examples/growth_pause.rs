//! How long one event can take while a replica's records grow, and then while they churn at
//! full size. One replica stores a chain of `BLOCKS` blocks (1,000,000 by default) in events
//! of 16 into an empty `KvIndex`, bounded as the router bounds it by default; then, for three
//! times as many blocks, each event evicts 16 blocks (the chain's end first, then the oldest
//! new prompts) and stores 16 new ones (a new prompt). The time of each event is taken.
//!
//! The index's large maps (a replica's records, the runs by first hash) resize a step at a
//! time from 8,192 buckets (hashbrown alone moved every entry inside one event, under the
//! index's write: the single index's lock, which every query takes), and the queue of stores a
//! bounded index evicts from is swept a few entries a store (it was swept at once).
//!
//! ```text
//! cargo run --release -p kvroute-index --example growth_pause [-- BLOCKS]
//! ```

use std::time::{Duration, Instant};

use kvroute_index::{
    block_hashes, EngineHash, KvIndex, KvIndexer, ReplicaId, StorageTier, StoredBlocks,
};

const BS: usize = 16;
const PER_EVENT: usize = 16;

fn main() {
    let blocks: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("BLOCKS is a number"))
        .unwrap_or(1_000_000);
    let (tokens, hashes) = chain(blocks, 7);
    let mut index = KvIndex::with_max_blocks(BS, 1 << 22);
    let mut times = Vec::with_capacity(blocks / PER_EVENT + 1);
    for (i, chunk) in hashes.chunks(PER_EVENT).enumerate() {
        let first = i * PER_EVENT;
        let event = stored(
            first.checked_sub(1).map(|p| hashes[p]),
            chunk,
            &tokens[first * BS..(first + chunk.len()) * BS],
        );
        let start = Instant::now();
        index
            .apply_stored(ReplicaId(0), &event)
            .expect("a valid chain");
        times.push(start.elapsed());
    }
    report(&format!("one replica growing to {blocks} blocks"), times);

    // At full size: the chain's end evicted, then the oldest new prompts, 16 blocks an event,
    // as 16 new blocks (a new prompt) are stored, for three times the blocks held.
    let (new_tokens, new_hashes) = chain(3 * blocks, 11);
    let mut times = Vec::with_capacity(3 * blocks / PER_EVENT + 1);
    let mut end = hashes.len();
    let mut oldest_new = 0;
    for (i, chunk) in new_hashes.chunks(PER_EVENT).enumerate() {
        let first = i * PER_EVENT;
        let evicted: Vec<EngineHash> = if end > 0 {
            let from = end.saturating_sub(PER_EVENT);
            let tail = hashes[from..end].iter().rev().copied().collect();
            end = from;
            tail
        } else {
            oldest_new += PER_EVENT;
            new_hashes[oldest_new - PER_EVENT..oldest_new].to_vec()
        };
        // Each new prompt a chain of its own (its first block with no parent).
        let event = stored(
            None,
            chunk,
            &new_tokens[first * BS..(first + chunk.len()) * BS],
        );
        let start = Instant::now();
        index.apply_removed(ReplicaId(0), StorageTier::Device, &evicted);
        index
            .apply_stored(ReplicaId(0), &event)
            .expect("a valid chain");
        times.push(start.elapsed());
    }
    report(
        &format!("then churning at {blocks} blocks (16 evicted and 16 stored an event)"),
        times,
    );
}

/// `blocks` blocks of tokens drawn from `seed` (no two blocks alike), and their engine hashes
/// (a chain).
fn chain(blocks: usize, seed: u64) -> (Vec<u32>, Vec<EngineHash>) {
    let tokens: Vec<u32> = (0..(blocks * BS) as u64)
        .map(|i| (kvroute_protocol::mix64(seed, i) % 128_000) as u32)
        .collect();
    let hashes = (block_hashes(&tokens, BS, seed).into_iter())
        .map(|h| EngineHash(h.0))
        .collect();
    (tokens, hashes)
}

fn stored<'a>(
    parent: Option<EngineHash>,
    hashes: &'a [EngineHash],
    tokens: &'a [u32],
) -> StoredBlocks<'a> {
    StoredBlocks {
        parent,
        engine_hashes: hashes,
        token_ids: tokens,
        block_size: BS,
        tier: StorageTier::Device,
        salt: 0,
    }
}

fn report(what: &str, mut times: Vec<Duration>) {
    let total: Duration = times.iter().sum();
    let slow = times
        .iter()
        .filter(|t| **t > Duration::from_micros(100))
        .count();
    times.sort_unstable();
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    println!(
        "{what}, {} events: mean {:.2?}, p99 {:.2?}, p99.9 {:.2?}, max {:.2?}; {slow} events over 100 µs",
        times.len(),
        total / times.len() as u32,
        at(0.99),
        at(0.999),
        at(1.0),
    );
}
