//! Queries drawn from a replay file: `hit` queries are the full prefixes that sampled
//! `BlockStored` events completed (their tokens gathered back along the parent chain, at
//! most [`QUERY_BLOCKS`] router blocks, then new tokens up to that length), so the replica
//! that stored one matches all of its prefix unless it removed blocks later; `miss` queries
//! are new tokens only.

use std::collections::HashMap;

use kvroute_index::{block_hashes, BlockHash, EngineHash, ReplicaId};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::events::{Op, Replay};

/// Router blocks per query (8k tokens at 16 per block).
pub const QUERY_BLOCKS: usize = 512;

/// Queries as the router hashes them, with the tokens they came from.
#[derive(Debug, Default)]
pub struct Queries {
    pub hit: Vec<Vec<BlockHash>>,
    pub miss: Vec<Vec<BlockHash>>,
    pub hit_tokens: Vec<Vec<u32>>,
    /// The replica that stored each hit query's prefix, and the prefix's length in tokens.
    pub hit_source: Vec<(ReplicaId, usize)>,
}

/// `count` hit and `count` miss queries for a router of `block_size`, seeded.
pub fn derive(replay: &Replay, block_size: usize, count: usize, seed: u64) -> Queries {
    let mut rng = SmallRng::seed_from_u64(seed);
    // Where each (replica, engine block) was stored: its event and its position in it.
    let mut at: HashMap<(ReplicaId, EngineHash), (usize, usize)> = HashMap::new();
    let mut stored = Vec::new();
    for (i, op) in replay.ops.iter().enumerate() {
        if let Op::Stored(s) = op {
            for (j, hash) in s.hashes.iter().enumerate() {
                at.insert((s.replica, *hash), (i, j));
            }
            if !s.hashes.is_empty() {
                stored.push(i);
            }
        }
    }
    let len = QUERY_BLOCKS * block_size;
    let mut queries = Queries::default();
    let step = (stored.len() / count.max(1)).max(1);
    for &i in stored.iter().step_by(step).take(count) {
        let Op::Stored(s) = &replay.ops[i] else {
            continue;
        };
        let mut prefix = chain(replay, &at, s.replica, (i, s.hashes.len() - 1));
        prefix.truncate(len / block_size * block_size);
        let full = prefix.len() - prefix.len() % block_size;
        queries.hit_source.push((s.replica, full));
        prefix.extend((prefix.len()..len).map(|_| rng.random_range(0..128_000)));
        queries.hit.push(block_hashes(&prefix, block_size, 0));
        queries.hit_tokens.push(prefix);
    }
    for _ in 0..count {
        let tokens: Vec<u32> = (0..len).map(|_| rng.random_range(0..128_000)).collect();
        queries.miss.push(block_hashes(&tokens, block_size, 0));
    }
    queries
}

/// The tokens of every block from the chain's start up to `(event, block)`, walking back
/// along parents; the walk stops at the chain's start, at a parent the file never stored,
/// or after a million blocks (a file whose hashes loop cannot hang it).
fn chain(
    replay: &Replay,
    at: &HashMap<(ReplicaId, EngineHash), (usize, usize)>,
    replica: ReplicaId,
    mut cursor: (usize, usize),
) -> Vec<u32> {
    let mut blocks: Vec<&[u32]> = Vec::new();
    while let Op::Stored(s) = &replay.ops[cursor.0] {
        let tokens = &s.tokens[cursor.1 * s.block_size..(cursor.1 + 1) * s.block_size];
        blocks.push(tokens);
        let parent = match cursor.1 {
            0 => s.parent,
            j => Some(s.hashes[j - 1]),
        };
        match parent.and_then(|p| at.get(&(replica, p))) {
            Some(&next) if blocks.len() < 1_000_000 => cursor = next,
            _ => break,
        }
    }
    blocks.reverse();
    blocks.concat()
}
