//! [`ShardedKvIndex`]: the exact index for N ingest threads, whose queries never wait on a
//! writer.
//!
//! # Layout
//! Replica `r` lives in shard `r % N`, a [`KvIndex`] of its own, so writers of different
//! shards never meet. Each shard is *mirrored* (the left-right scheme of `evmap`): two copies
//! of its `KvIndex`, one that readers use and one that its writer changes.
//! - A write takes the shard's writer lock, then the write lock of the copy readers do not
//!   use; it first replays there the operations the other copy applied last time, then
//!   applies its own, releases the copy and makes it the one readers use (an atomic store).
//!   Its operation is kept, owned, for the next write to replay on the other copy.
//! - A read loads which copy is current and takes its read lock with `try_read`. That copy is
//!   never write-locked, except when a writer flipped and took it between the load and the
//!   `try_read`; then the read loads again and finds the other one. So a query never waits for
//!   a writer; a writer may wait for the queries that began on its copy before the last flip
//!   (a query's length).
//! - A query reads every shard in turn and concatenates the answers (each replica lives in one
//!   shard), sorted by replica as [`KvIndexer::find_matches`] promises. Reads are monotone: a
//!   later query sees every change an earlier one saw.
//!
//! # Costs
//! Every operation is applied twice and every block is held twice (two copies), and a block
//! held by replicas of several shards once per shard: memory is `2 x` a [`KvIndex`]'s per
//! shard. A query walks its prefix once per shard. A change is visible to queries when its
//! write returns.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard, TryLockError};

use crate::{
    BlockHash, EngineHash, IndexError, KvIndex, KvIndexer, OverlapScores, ReplicaId, StorageTier,
    StoredBlocks, TierCounts,
};

/// One event of one replica, owned (a mirrored shard replays it on its second copy).
#[derive(Debug, Clone)]
pub enum Op {
    Stored(Stored),
    Removed {
        replica: ReplicaId,
        tier: StorageTier,
        hashes: Vec<EngineHash>,
    },
    Cleared(ReplicaId),
}

/// A `BlockStored` event of one replica, owned.
#[derive(Debug, Clone)]
pub struct Stored {
    pub replica: ReplicaId,
    pub parent: Option<EngineHash>,
    pub hashes: Vec<EngineHash>,
    pub tokens: Vec<u32>,
    pub block_size: usize,
    pub tier: StorageTier,
    pub salt: u64,
}

impl Stored {
    pub fn new(replica: ReplicaId, event: &StoredBlocks<'_>) -> Self {
        Self {
            replica,
            parent: event.parent,
            hashes: event.engine_hashes.to_vec(),
            tokens: event.token_ids.to_vec(),
            block_size: event.block_size,
            tier: event.tier,
            salt: event.salt,
        }
    }

    pub fn event(&self) -> StoredBlocks<'_> {
        StoredBlocks {
            parent: self.parent,
            engine_hashes: &self.hashes,
            token_ids: &self.tokens,
            block_size: self.block_size,
            tier: self.tier,
            salt: self.salt,
        }
    }
}

impl Op {
    pub fn replica(&self) -> ReplicaId {
        match self {
            Op::Stored(s) => s.replica,
            Op::Removed { replica, .. } | Op::Cleared(replica) => *replica,
        }
    }

    /// Block events: a stored or removed block counts one, a clear counts one.
    pub fn blocks(&self) -> usize {
        match self {
            Op::Stored(s) => s.hashes.len(),
            Op::Removed { hashes, .. } => hashes.len(),
            Op::Cleared(_) => 1,
        }
    }

    /// Applies the event to `index`; on error nothing changed.
    pub fn apply<I: KvIndexer>(&self, index: &mut I) -> Result<(), IndexError> {
        match self {
            Op::Stored(stored) => index.apply_stored(stored.replica, &stored.event()),
            Op::Removed {
                replica,
                tier,
                hashes,
            } => {
                index.apply_removed(*replica, *tier, hashes);
                Ok(())
            }
            Op::Cleared(replica) => {
                index.clear_replica(*replica);
                Ok(())
            }
        }
    }
}

/// One shard: two copies of its index, one for readers and one for its writer.
#[derive(Debug)]
struct Mirror {
    copies: [RwLock<KvIndex>; 2],
    /// The copy readers use; changed only under `behind`'s lock.
    current: AtomicUsize,
    /// The writer lock, holding what the copy readers use has applied and the other not yet.
    behind: Mutex<Vec<Op>>,
}

impl Mirror {
    fn new(make: impl Fn() -> KvIndex) -> Self {
        Self {
            copies: [RwLock::new(make()), RwLock::new(make())],
            current: AtomicUsize::new(0),
            behind: Mutex::new(Vec::new()),
        }
    }

    fn write(&self, op: Op) -> Result<(), IndexError> {
        let mut behind = self.behind.lock().unwrap_or_else(|e| e.into_inner());
        let next = 1 - self.current.load(Ordering::Acquire);
        let mut copy = self.copies[next].write().unwrap_or_else(|e| e.into_inner());
        for old in behind.drain(..) {
            // Deterministic: it did the same on the other copy (an error changed nothing).
            let _ = old.apply(&mut *copy);
        }
        let result = op.apply(&mut *copy);
        drop(copy);
        self.current.store(next, Ordering::Release);
        behind.push(op);
        result
    }

    fn read(&self) -> RwLockReadGuard<'_, KvIndex> {
        loop {
            let current = self.current.load(Ordering::Acquire);
            match self.copies[current].try_read() {
                Ok(guard) => return guard,
                Err(TryLockError::Poisoned(e)) => return e.into_inner(),
                // A writer flipped and took this copy since the load: the other is current.
                Err(TryLockError::WouldBlock) => std::hint::spin_loop(),
            }
        }
    }

    /// The current copy's heap bytes, twice: the other copy holds the same changes but the
    /// last write's (read without waiting, as a query).
    fn memory_bytes(&self) -> usize {
        2 * self.read().memory_bytes()
    }
}

/// The exact index sharded by replica over mirrored shards; see the [module docs](self).
/// Every method takes `&self`: share it between ingest threads and queries.
#[derive(Debug)]
pub struct ShardedKvIndex {
    block_size: usize,
    shards: Vec<Mirror>,
}

impl ShardedKvIndex {
    /// `shards` shards (at least one), unbounded.
    pub fn new(block_size: usize, shards: usize) -> Self {
        Self::build(block_size, shards, || KvIndex::new(block_size))
    }

    /// As [`KvIndex::with_max_blocks`], the bound split evenly between the shards.
    pub fn with_max_blocks(block_size: usize, shards: usize, max_blocks: usize) -> Self {
        let per = max_blocks.div_ceil(shards.max(1));
        Self::build(block_size, shards, || {
            KvIndex::with_max_blocks(block_size, per)
        })
    }

    fn build(block_size: usize, shards: usize, make: impl Fn() -> KvIndex) -> Self {
        Self {
            block_size,
            shards: (0..shards.max(1)).map(|_| Mirror::new(&make)).collect(),
        }
    }

    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// The shard holding `replica`'s blocks: an ingest thread per shard never waits on another.
    pub fn shard_of(&self, replica: ReplicaId) -> usize {
        replica.0 as usize % self.shards.len()
    }

    /// Applies one event; on error nothing changed.
    pub fn apply(&self, op: Op) -> Result<(), IndexError> {
        self.shards[self.shard_of(op.replica())].write(op)
    }

    pub fn stored(&self, replica: ReplicaId, event: &StoredBlocks<'_>) -> Result<(), IndexError> {
        self.apply(Op::Stored(Stored::new(replica, event)))
    }

    pub fn removed(&self, replica: ReplicaId, tier: StorageTier, hashes: &[EngineHash]) {
        let hashes = hashes.to_vec();
        let _ = self.apply(Op::Removed {
            replica,
            tier,
            hashes,
        });
    }

    pub fn cleared(&self, replica: ReplicaId) {
        let _ = self.apply(Op::Cleared(replica));
    }

    /// As [`KvIndexer::find_matches`], over every shard.
    pub fn matches(&self, hashes: &[BlockHash]) -> OverlapScores {
        if let [shard] = self.shards.as_slice() {
            return shard.read().find_matches(hashes);
        }
        let mut scores = Vec::new();
        for shard in &self.shards {
            scores.extend(shard.read().find_matches(hashes).scores);
        }
        scores.sort_unstable_by_key(|(replica, _)| *replica);
        OverlapScores { scores }
    }

    /// Router blocks indexed, summed over shards (a block in two shards counts twice).
    pub fn blocks(&self) -> usize {
        self.shards.iter().map(|s| s.read().num_blocks()).sum()
    }

    /// The engine blocks `replica` holds per tier, as [`KvIndex::replica_blocks`].
    pub fn replica_blocks(&self, replica: ReplicaId) -> TierCounts {
        self.shards[self.shard_of(replica)]
            .read()
            .replica_blocks(replica)
    }

    /// Heap bytes of both copies of every shard (each counted as twice the current copy).
    pub fn heap_bytes(&self) -> usize {
        self.shards.iter().map(Mirror::memory_bytes).sum()
    }
}

impl KvIndexer for ShardedKvIndex {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn apply_stored(
        &mut self,
        replica: ReplicaId,
        event: &StoredBlocks<'_>,
    ) -> Result<(), IndexError> {
        self.stored(replica, event)
    }

    fn apply_removed(&mut self, replica: ReplicaId, tier: StorageTier, hashes: &[EngineHash]) {
        self.removed(replica, tier, hashes);
    }

    fn clear_replica(&mut self, replica: ReplicaId) {
        self.cleared(replica);
    }

    fn find_matches(&self, hashes: &[BlockHash]) -> OverlapScores {
        self.matches(hashes)
    }

    fn num_blocks(&self) -> usize {
        self.blocks()
    }

    fn memory_bytes(&self) -> usize {
        self.heap_bytes()
    }
}
