//! [`ShardedKvIndex`]: the exact index for N ingest threads, whose queries never wait on a
//! writer.
//!
//! # Layout
//! Replica `r` lives in shard `r % N`, so writers of different shards never meet. A shard has
//! one writer side, a [`KvIndex`]'s records of its replicas (engine hash to router blocks and
//! places, tier counts, the capacity bound's queue), which queries never read, and two copies
//! of the one part queries read, the block table (with the replicas' slots): the left-right
//! scheme of `evmap`, on the table alone.
//! - A write takes the shard's writer lock, then the write lock of the copy readers do not
//!   use. It replays there the table changes the other copy received last time (a log of
//!   `inc`/`dec` calls, each with the place it names), lends that copy's table to the index,
//!   applies its event (hashing, records, and the table changes, logged), takes the table
//!   back, copies the slots if they changed, releases the copy and makes it the one readers
//!   use (an atomic store). The log is kept for the next write to replay on the other copy.
//!   A replay is deterministic: the same changes in the same order on a table in the same
//!   state assign the same places, so the records' places hold for both copies.
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
//! The table's changes are applied twice and the table is held twice; the hashing and the
//! records, most of an event's work, once. A block held by replicas of several shards is in
//! each of those shards' tables. A query walks its prefix once per shard. A change is visible
//! to queries when its write returns.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};

use crate::kv_index::{BlockTable, Change};
use crate::slots::Slots;
use crate::{
    BlockHash, EngineHash, IndexError, KvIndex, KvIndexer, OverlapScores, ReplicaId, StorageTier,
    StoredBlocks, TierCounts,
};

/// Tries for a copy's write lock before sleeping on it (a query's length is a few hundred).
const SPINS: usize = 512;

/// One event of one replica, owned (for callers that queue events before applying them).
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

/// One replica's events applied to an index: a batch, under one write of it
/// ([`ShardedKvIndex::batch`], or a caller's lock of one [`KvIndex`]).
///
/// Consecutive removals of one tier reach the index as one: an engine sends each evicted block
/// as an event of its own (vLLM does), and the index looks the blocks of one removal up
/// together, so that their cache misses overlap. They are applied before any other event of
/// the batch, and when it ends (as this is dropped), in order.
#[derive(Debug)]
pub struct ReplicaEvents<'a> {
    index: &'a mut KvIndex,
    replica: ReplicaId,
    /// Removals not applied yet, all of `removing_tier` (the buffer is kept for the batch).
    removing: Vec<EngineHash>,
    removing_tier: StorageTier,
}

impl<'a> ReplicaEvents<'a> {
    pub fn new(index: &'a mut KvIndex, replica: ReplicaId) -> Self {
        Self {
            index,
            replica,
            removing: Vec::new(),
            removing_tier: StorageTier::Device,
        }
    }

    /// As [`KvIndexer::apply_stored`]; on error nothing changed.
    pub fn stored(&mut self, event: &StoredBlocks<'_>) -> Result<(), IndexError> {
        self.remove();
        self.index.apply_stored(self.replica, event)
    }

    pub fn removed(&mut self, tier: StorageTier, hashes: &[EngineHash]) {
        if tier != self.removing_tier {
            self.remove();
            self.removing_tier = tier;
        }
        self.removing.extend_from_slice(hashes);
    }

    pub fn cleared(&mut self) {
        self.remove();
        self.index.clear_replica(self.replica);
    }

    /// An owned event of this replica (a queued one); on error nothing changed.
    pub fn apply(&mut self, op: &Op) -> Result<(), IndexError> {
        debug_assert_eq!(op.replica(), self.replica, "another replica's event");
        match op {
            Op::Stored(stored) => self.stored(&stored.event()),
            Op::Removed { tier, hashes, .. } => {
                self.removed(*tier, hashes);
                Ok(())
            }
            Op::Cleared(_) => {
                self.cleared();
                Ok(())
            }
        }
    }

    /// Applies the removals gathered so far.
    fn remove(&mut self) {
        if !self.removing.is_empty() {
            (self.index).apply_removed(self.replica, self.removing_tier, &self.removing);
            self.removing.clear();
        }
    }
}

impl Drop for ReplicaEvents<'_> {
    fn drop(&mut self) {
        self.remove();
    }
}

/// What a shard's readers see: a copy of its block table and of its replicas' slots.
#[derive(Debug)]
struct View {
    table: BlockTable,
    slots: Slots,
}

/// The writer's side of a shard.
#[derive(Debug)]
struct Writer {
    /// The shard's replicas' records; the copy being changed lends it its table per write.
    index: KvIndex,
    /// The table changes the copy readers use has applied and the other not yet.
    behind: Vec<Change>,
}

/// One shard: its writer, and two copies of its block table, one for readers and one that
/// the writer changes.
#[derive(Debug)]
struct Mirror {
    copies: [RwLock<View>; 2],
    /// The copy readers use; changed only under `writer`'s lock.
    current: AtomicUsize,
    writer: Mutex<Writer>,
    /// The shard's heap bytes (both copies and the writer's side) and distinct blocks, as
    /// the last write left them: read without a lock after every event.
    bytes: AtomicUsize,
    blocks: AtomicUsize,
}

impl Mirror {
    fn new(make: impl Fn() -> KvIndex) -> Self {
        // Each copy starts as an index's own empty table (configured as `make` configures it).
        let view = |index: &mut KvIndex| {
            let mut table = BlockTable::default();
            index.exchange_table(&mut table);
            RwLock::new(View {
                table,
                slots: Slots::default(),
            })
        };
        let mut index = make();
        Self {
            copies: [view(&mut index), view(&mut make())],
            current: AtomicUsize::new(0),
            writer: Mutex::new(Writer {
                index,
                behind: Vec::new(),
            }),
            bytes: AtomicUsize::new(0),
            blocks: AtomicUsize::new(0),
        }
    }

    /// Applies `change` to the shard's index, on the copy readers do not use, then makes that
    /// copy theirs.
    fn write<R>(&self, change: impl FnOnce(&mut KvIndex) -> R) -> R {
        let mut writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let Writer { index, behind } = &mut *writer;
        let next = 1 - self.current.load(Ordering::Acquire);
        let mut copy = self.take_for_writing(next);
        // Deterministic: the same changes, in the same order, on a table in the same state as
        // the one that made them.
        copy.table.replay(behind);
        index.exchange_table(&mut copy.table);
        index.table_mut().log_into(std::mem::take(behind));
        let result = change(index);
        *behind = index.table_mut().take_log();
        index.exchange_table(&mut copy.table);
        if copy.slots.version() != index.slots().version() {
            copy.slots.clone_from(index.slots());
        }
        let bytes = index.memory_bytes()
            + behind.capacity() * std::mem::size_of::<Change>()
            + 2 * (copy.table.memory_bytes() + copy.slots.memory_bytes());
        self.bytes.store(bytes, Ordering::Relaxed);
        self.blocks.store(copy.table.distinct(), Ordering::Relaxed);
        drop(copy);
        self.current.store(next, Ordering::Release);
        result
    }

    /// The write lock of copy `next`, which only queries that began before the last flip may
    /// still hold, for a query's length: spun for before sleeping (a sleeping writer costs the
    /// query that wakes it a system call).
    fn take_for_writing(&self, next: usize) -> RwLockWriteGuard<'_, View> {
        for _ in 0..SPINS {
            match self.copies[next].try_write() {
                Ok(guard) => return guard,
                Err(TryLockError::Poisoned(e)) => return e.into_inner(),
                Err(TryLockError::WouldBlock) => std::hint::spin_loop(),
            }
        }
        self.copies[next].write().unwrap_or_else(|e| e.into_inner())
    }

    fn read(&self) -> RwLockReadGuard<'_, View> {
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

    fn shard(&self, replica: ReplicaId) -> &Mirror {
        &self.shards[self.shard_of(replica)]
    }

    /// Applies one event; on error nothing changed.
    pub fn apply(&self, op: Op) -> Result<(), IndexError> {
        self.shard(op.replica()).write(|index| op.apply(index))
    }

    pub fn stored(&self, replica: ReplicaId, event: &StoredBlocks<'_>) -> Result<(), IndexError> {
        self.shard(replica)
            .write(|index| index.apply_stored(replica, event))
    }

    pub fn removed(&self, replica: ReplicaId, tier: StorageTier, hashes: &[EngineHash]) {
        self.shard(replica)
            .write(|index| index.apply_removed(replica, tier, hashes));
    }

    pub fn cleared(&self, replica: ReplicaId) {
        self.shard(replica)
            .write(|index| index.clear_replica(replica));
    }

    /// Applies the events `apply` gives for `replica`, in order, under one write of its shard:
    /// queries see all of them or none, and the shard flips once (an engine's step sends a
    /// batch of events, an evicted block often one of them each).
    pub fn batch<R>(
        &self,
        replica: ReplicaId,
        apply: impl FnOnce(&mut ReplicaEvents<'_>) -> R,
    ) -> R {
        self.shard(replica)
            .write(|index| apply(&mut ReplicaEvents::new(index, replica)))
    }

    /// As [`KvIndexer::find_matches`], over every shard.
    pub fn matches(&self, hashes: &[BlockHash]) -> OverlapScores {
        if let [shard] = self.shards.as_slice() {
            let view = shard.read();
            return view.table.find(hashes, &view.slots);
        }
        let mut scores = Vec::new();
        for shard in &self.shards {
            let view = shard.read();
            scores.extend(view.table.find(hashes, &view.slots).scores);
        }
        scores.sort_unstable_by_key(|(replica, _)| *replica);
        OverlapScores { scores }
    }

    /// Router blocks indexed, summed over shards (a block in two shards counts twice).
    pub fn blocks(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.blocks.load(Ordering::Relaxed))
            .sum()
    }

    /// The engine blocks `replica` holds per tier, as [`KvIndex::replica_blocks`] (the
    /// writer's count: waits for a write under way in the replica's shard).
    pub fn replica_blocks(&self, replica: ReplicaId) -> TierCounts {
        let writer = self.shard(replica).writer.lock();
        let writer = writer.unwrap_or_else(|e| e.into_inner());
        writer.index.replica_blocks(replica)
    }

    /// Heap bytes of every shard: both copies of its table and its writer's records.
    pub fn heap_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.bytes.load(Ordering::Relaxed))
            .sum()
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
