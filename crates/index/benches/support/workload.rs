//! The benchmark workload, shared by `benches/indexer.rs` and `examples/query_latency.rs`.
//!
//! 64 replicas (vLLM-like: 16-token engine blocks, as the router's) each hold 6 of 32
//! system prompts (64 to 448 blocks long), each up to a prefix of its own length (half to
//! all of it), and conversations continuing them (16 to 128 blocks), stored as chained
//! `BlockStored` events of 1 to 32 blocks, until the index holds the target number of
//! distinct blocks. Queries are 512 blocks (8k tokens):
//! - `hit`: a stored conversation plus new tokens: a dozen replicas holding its system prompt
//!   match up to a few hundred blocks, the one holding the conversation matches all of it;
//! - `system`: a system prompt plus new tokens;
//! - `miss`: new tokens only.
//!
//! `churn` is a separate set of conversations with the `BlockRemoved` lists that undo them,
//! for steady-state event throughput at full size.

#![allow(dead_code)]

use kvroute_index::{block_hashes, BlockHash, EngineHash, ReplicaId, StorageTier, StoredBlocks};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

pub const BS: usize = 16;
pub const REPLICAS: u32 = 64;
pub const QUERY_BLOCKS: usize = 512;
const SYSTEM_PROMPTS: usize = 32;
const PER_REPLICA: usize = 6;
const QUERIES: usize = 1024;

/// One `BlockStored` event of one replica.
pub struct Stored {
    pub replica: ReplicaId,
    pub parent: Option<EngineHash>,
    pub hashes: Vec<EngineHash>,
    pub tokens: Vec<u32>,
}

impl Stored {
    pub fn event(&self) -> StoredBlocks<'_> {
        StoredBlocks {
            parent: self.parent,
            engine_hashes: &self.hashes,
            token_ids: &self.tokens,
            block_size: BS,
            tier: StorageTier::Device,
            salt: 0,
        }
    }
}

pub struct Workload {
    /// Events that build the index, in order.
    pub build: Vec<Stored>,
    /// Block events in `build`.
    pub build_blocks: usize,
    pub hit: Vec<Vec<BlockHash>>,
    pub system: Vec<Vec<BlockHash>>,
    pub miss: Vec<Vec<BlockHash>>,
    /// The tokens of `hit`, `system` and `miss` (for indexers that hash blocks their own way).
    pub hit_tokens: Vec<Vec<u32>>,
    pub system_tokens: Vec<Vec<u32>>,
    pub miss_tokens: Vec<Vec<u32>>,
    /// Conversations stored then removed again (`churn_removed`): a steady state.
    pub churn: Vec<Stored>,
    pub churn_removed: Vec<(ReplicaId, Vec<EngineHash>)>,
    pub churn_blocks: usize,
}

fn engine_hashes(tokens: &[u32]) -> Vec<EngineHash> {
    block_hashes(tokens, BS, 0x00E0_E0E0)
        .into_iter()
        .map(|h| EngineHash(h.0))
        .collect()
}

fn random_tokens(rng: &mut SmallRng, blocks: usize) -> Vec<u32> {
    (0..blocks * BS)
        .map(|_| rng.random_range(0..128_000))
        .collect()
}

/// Splits blocks `from..tokens.len()/BS` of a chain into events of 1 to 32 blocks.
fn events(
    rng: &mut SmallRng,
    replica: ReplicaId,
    tokens: &[u32],
    from: usize,
    out: &mut Vec<Stored>,
) -> usize {
    let hashes = engine_hashes(tokens);
    let mut start = from;
    while start < hashes.len() {
        let end = (start + rng.random_range(1..=32)).min(hashes.len());
        out.push(Stored {
            replica,
            parent: start.checked_sub(1).map(|i| hashes[i]),
            hashes: hashes[start..end].to_vec(),
            tokens: tokens[start * BS..end * BS].to_vec(),
        });
        start = end;
    }
    hashes.len() - from
}

/// A query's tokens: `prefix` (at most `QUERY_BLOCKS` blocks of it) then new tokens.
fn query(rng: &mut SmallRng, prefix: &[u32]) -> Vec<u32> {
    let mut tokens = prefix[..prefix.len().min(QUERY_BLOCKS * BS)].to_vec();
    let rest = QUERY_BLOCKS - tokens.len() / BS;
    tokens.extend(random_tokens(rng, rest));
    tokens
}

fn hashed(queries: &[Vec<u32>]) -> Vec<Vec<BlockHash>> {
    queries.iter().map(|t| block_hashes(t, BS, 0)).collect()
}

/// Conversations continuing the system prompts replicas hold, until `blocks` blocks.
fn conversations(
    rng: &mut SmallRng,
    systems: &[Vec<u32>],
    held: &[Vec<(usize, usize)>],
    blocks: usize,
    out: &mut Vec<Stored>,
    mut sample: impl FnMut(ReplicaId, &[u32], usize),
) -> usize {
    let mut stored = 0;
    let mut replica = 0;
    while stored < blocks {
        let (s, len) = held[replica][rng.random_range(0..PER_REPLICA)];
        let mut tokens = systems[s][..len * BS].to_vec();
        let new_blocks = rng.random_range(16..=128);
        tokens.extend(random_tokens(rng, new_blocks));
        let id = ReplicaId(replica as u32);
        stored += events(rng, id, &tokens, len, out);
        sample(id, &tokens, len);
        replica = (replica + 1) % REPLICAS as usize;
    }
    stored
}

pub fn build(target_blocks: usize, seed: u64) -> Workload {
    let mut rng = SmallRng::seed_from_u64(seed);
    let systems: Vec<Vec<u32>> = (0..SYSTEM_PROMPTS)
        .map(|_| {
            let blocks = rng.random_range(64..=448);
            random_tokens(&mut rng, blocks)
        })
        .collect();
    // Each replica: 6 system prompts, each held up to a prefix of half to all of it.
    let mut held = Vec::new();
    let mut build = Vec::new();
    let mut build_blocks = 0;
    let mut longest = [0usize; SYSTEM_PROMPTS];
    for r in 0..REPLICAS {
        let mut mine: Vec<(usize, usize)> = Vec::new();
        while mine.len() < PER_REPLICA {
            let s = rng.random_range(0..SYSTEM_PROMPTS);
            if mine.iter().all(|(other, _)| *other != s) {
                let blocks = systems[s].len() / BS;
                let len = rng.random_range(blocks / 2..=blocks);
                longest[s] = longest[s].max(len);
                build_blocks += events(
                    &mut rng,
                    ReplicaId(r),
                    &systems[s][..len * BS],
                    0,
                    &mut build,
                );
                mine.push((s, len));
            }
        }
        held.push(mine);
    }
    let distinct_system: usize = longest.iter().sum();
    let mut samples = Vec::new();
    let target = target_blocks.saturating_sub(distinct_system);
    // Query samples spread over all conversations (72 blocks each on average).
    let step = (target / 72 / QUERIES).max(1);
    let mut seen = 0;
    build_blocks += conversations(
        &mut rng,
        &systems,
        &held,
        target,
        &mut build,
        |_, tokens, _| {
            if seen % step == 0 {
                samples.push(tokens.to_vec());
            }
            seen += 1;
        },
    );
    let hit_tokens: Vec<Vec<u32>> = samples
        .iter()
        .take(QUERIES)
        .map(|t| query(&mut rng, t))
        .collect();
    drop(samples);
    let system_tokens: Vec<Vec<u32>> = (0..QUERIES)
        .map(|i| query(&mut rng, &systems[i % SYSTEM_PROMPTS]))
        .collect();
    let miss_tokens: Vec<Vec<u32>> = (0..QUERIES).map(|_| query(&mut rng, &[])).collect();
    let mut churn = Vec::new();
    let mut churn_removed = Vec::new();
    // Conversations stored then removed, newest block first (engines evict leaves first).
    let churn_blocks = conversations(
        &mut rng,
        &systems,
        &held,
        16_384,
        &mut churn,
        |replica, tokens, from| {
            let mut hashes = engine_hashes(tokens).split_off(from);
            hashes.reverse();
            churn_removed.push((replica, hashes));
        },
    );
    Workload {
        build,
        build_blocks,
        hit: hashed(&hit_tokens),
        system: hashed(&system_tokens),
        miss: hashed(&miss_tokens),
        hit_tokens,
        system_tokens,
        miss_tokens,
        churn,
        churn_removed,
        churn_blocks,
    }
}
