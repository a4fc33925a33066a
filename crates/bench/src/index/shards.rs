//! N ingest threads: the index sharded by replica. Shard `r % N` holds replica `r`'s blocks
//! in a [`KvIndex`] of its own behind a read-write lock; ingest thread `i` applies shard `i`'s
//! events, taking the write lock for one event at a time, so a query waits at most one event
//! per shard. A query reads every shard in turn and concatenates the answers (each replica
//! lives in one shard), sorted by replica as [`KvIndexer::find_matches`] promises.
//!
//! A block held by replicas of several shards is indexed once per shard: memory grows with
//! the shard count, and a query walks its prefix once per shard.

use std::sync::RwLock;

use kvroute_index::{BlockHash, KvIndex, KvIndexer, OverlapScores, ReplicaId};

use super::events::Op;

/// `KvIndex` sharded by replica.
#[derive(Debug)]
pub struct Shards {
    shards: Vec<RwLock<KvIndex>>,
}

impl Shards {
    pub fn new(count: usize, block_size: usize) -> Self {
        Self {
            shards: (0..count.max(1))
                .map(|_| RwLock::new(KvIndex::new(block_size)))
                .collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.shards.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    pub fn shard_of(&self, replica: ReplicaId) -> usize {
        replica.0 as usize % self.shards.len()
    }

    /// Applies one event under its shard's write lock; false when the index refused it.
    pub fn apply(&self, op: &Op) -> bool {
        let shard = &self.shards[self.shard_of(op.replica())];
        apply(&mut *shard.write().expect("no writer panics"), op)
    }

    pub fn find_matches(&self, hashes: &[BlockHash]) -> OverlapScores {
        let mut scores = Vec::new();
        for shard in &self.shards {
            let answer = shard.read().expect("no writer panics").find_matches(hashes);
            scores.extend(answer.scores);
        }
        scores.sort_unstable_by_key(|(replica, _)| *replica);
        OverlapScores { scores }
    }

    /// Blocks indexed, summed over shards (a block in two shards counts twice).
    pub fn num_blocks(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.read().expect("no writer panics").num_blocks())
            .sum()
    }

    pub fn memory_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.read().expect("no writer panics").memory_bytes())
            .sum()
    }
}

/// Applies one event to an index; false when it refused the event (nothing changed then).
pub fn apply<I: KvIndexer>(index: &mut I, op: &Op) -> bool {
    match op {
        Op::Stored(stored) => index.apply_stored(stored.replica, &stored.event()).is_ok(),
        Op::Removed {
            replica,
            tier,
            hashes,
        } => {
            index.apply_removed(*replica, *tier, hashes);
            true
        }
        Op::Cleared(replica) => {
            index.clear_replica(*replica);
            true
        }
    }
}
