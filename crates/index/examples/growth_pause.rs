//! How long one event can take while a replica's records grow: one replica stores a chain of
//! `BLOCKS` blocks (1,000,000 by default) in events of 16, into an empty `KvIndex`, and the
//! time of each event is taken. A replica's records are one hash map, which doubles when full
//! and moves every entry then: the slowest events are those doublings, each taken under the
//! index's write (the single index's lock: every query waits for it).
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
    let tokens: Vec<u32> = (0..(blocks * BS) as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 128_000)
        .collect();
    let hashes: Vec<EngineHash> = (block_hashes(&tokens, BS, 7).into_iter())
        .map(|h| EngineHash(h.0))
        .collect();
    let mut index = KvIndex::new(BS);
    let mut times = Vec::with_capacity(blocks / PER_EVENT + 1);
    for (i, chunk) in hashes.chunks(PER_EVENT).enumerate() {
        let first = i * PER_EVENT;
        let event = StoredBlocks {
            parent: first.checked_sub(1).map(|p| hashes[p]),
            engine_hashes: chunk,
            token_ids: &tokens[first * BS..(first + chunk.len()) * BS],
            block_size: BS,
            tier: StorageTier::Device,
            salt: 0,
        };
        let start = Instant::now();
        index
            .apply_stored(ReplicaId(0), &event)
            .expect("a valid chain");
        times.push(start.elapsed());
    }
    let total: Duration = times.iter().sum();
    let slow = times
        .iter()
        .filter(|t| **t > Duration::from_micros(100))
        .count();
    times.sort_unstable();
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    println!(
        "one replica, {blocks} blocks in {} events of {PER_EVENT}: mean {:.2?}, p99 {:.2?}, p99.9 {:.2?}, max {:.2?}; {slow} events over 100 µs",
        times.len(),
        total / times.len() as u32,
        at(0.99),
        at(0.999),
        at(1.0),
    );
}
