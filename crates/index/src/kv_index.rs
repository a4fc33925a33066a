//! [`KvIndex`]: the exact index, fed by engine KV events.
//!
//! # Layout
//! - A block table over router block hashes as runs of blocks (a radix tree whose nodes hold
//!   up to 64 blocks stored one after another; rules in `kv_index/table.rs`). A block's
//!   *place* (run and offset) never moves while it is held; a query walks the runs comparing
//!   hashes, with one lookup per branch taken, not per block, and a replica's blocks in a run
//!   are its leading bits there (one 64-bit set per replica and tier holding the run).
//! - Per replica, a hash map from engine hash to an 8-byte record in the map's own entry: the
//!   router block's place where the engine's block size is the router's (the common case,
//!   whole in the entry), else the position of its mapping in a side arena; and the tiers
//!   holding it. Removal and `AllBlocksCleared` go through it (to the place directly, no
//!   lookup), so clearing a replica costs time proportional to what it holds. From the first
//!   event whose block size differs from the router's, the table also finds every block by
//!   hash (those records keep no places).
//! - An event's blocks are applied in passes: its records' entries claimed first (their
//!   cache misses overlap), then its router hashes computed, then the changes. Before them,
//!   the lines the event will read are asked for at once with prefetch instructions: its
//!   parent's and blocks' records (the map knows where its table lies since its last
//!   insertion) and its tokens. A batch of removals prefetches its records the same way.
//!
//! # Mapping engine blocks to router blocks (re-blocking)
//! Let `B` be the router's block size and `E` the event's. The chain of router hashes of a
//! stored block continues from the router chain of its parent (looked up by the parent's
//! engine hash in the replica's map; no parent = a sequence's start; a parent the replica does
//! not hold is [`IndexError::UnknownParent`]).
//! - `E == B`: each engine block is one router block.
//! - `E == k·B`: each engine block is `k` router blocks, hashed in order; a child continues
//!   from the last. Removing the engine block removes all `k`.
//! - `B == k·E` (SGLang's one-token pages): `k` consecutive engine blocks make one router
//!   block, hashed when its last piece arrives, with the salt of that piece's event. Each piece
//!   of a not yet complete router block remembers that block as it stood when the piece was
//!   stored (its tokens and pieces so far, in immutable nodes shared by the pieces of one
//!   event), so a later event whose parent is the last piece continues it, and an event whose
//!   parent is any piece (a branch inside a router block) starts a sibling router block from
//!   the same pieces, even if an earlier piece was stored again differently since; each of
//!   those pieces must still be held. Each
//!   piece maps to every router block completed through it; removing any piece removes those
//!   router blocks (the prefix is broken there), while the other pieces stay until removed.
//! - Otherwise, or `E == 0`, [`IndexError::BlockSizeMismatch`]; also when an event with
//!   `E >= B` continues from a partial router block (a chain that changed block size).
//!
//! # Holdings
//! A replica holds a router block in tier `t` as many times as engine blocks stored in `t`
//! map to it as their own (two 64-token engine blocks sharing their first 16 tokens both
//! hold the first router block). Storing an engine block the replica already holds in that
//! tier changes nothing (a replayed event); storing it in another tier adds that tier
//! (offloading); storing it with a different mapping replaces the old one. Removing an engine
//! block from a tier takes one holding, in that tier, of every router block it maps to (its
//! own, and for pieces those completed through it), never below zero; an engine block held
//! in no tier is forgotten.
//!
//! # Bounded memory
//! [`KvIndex::with_max_blocks`] bounds the engine blocks remembered, all replicas together
//! (each maps to at most `E/B` router blocks, so the router blocks are bounded too). When a
//! store goes over, the least recently stored engine blocks are removed from every tier, as if
//! their engines had evicted them, until the bound holds. This keeps memory bounded when
//! removal events are lost; with a bound that is never reached, nothing is ever evicted. The
//! same eviction keeps the block table's runs under its limit (2^25 less a margin), which
//! only an unusual order of removals (a chain's blocks before its continuation's, many
//! times over) could otherwise reach within the bound. The order of stores is a queue beside
//! the records (`kv_index/queue.rs`), which knows its live entries by a bit per stamp.
//!
//! # No event holds the index for long
//! The maps that grow with what the index holds resize a step at a time (`kv_index/gradual.rs`),
//! and the bounded index's queue of stores is compacted and renumbered by sweeps of a few
//! entries a store, not at once: at a million blocks no event takes more than about 2 ms (a
//! new table's allocation), where a map's doubling took 20 ms, the queue's compaction 51 ms and
//! its renumbering 87 ms (BENCHMARKS, "No event holds the index for long").

mod gradual;
mod queue;
mod record;
mod record_map;
mod records;
mod store;
mod table;

use crate::slots::Slots;
use crate::{
    BlockHash, EngineHash, IndexError, KvIndexer, OverlapScores, ReplicaId, StorageTier,
    StoredBlocks, TierCounts,
};
use queue::{Queue, Sweeping};
use record::{tier_bits, Kind};
use records::{Record, Records};
use table::Held;
pub(crate) use table::{BlockTable, Change};

/// The exact KV-block index; see the [module docs](self) for its rules.
pub struct KvIndex {
    block_size: usize,
    slots: Slots,
    table: BlockTable,
    /// Per slot, the replica's engine blocks.
    records: Records,
    /// Per slot, its engine blocks in each tier (kept as records change).
    tier_counts: Vec<[u32; 4]>,
    /// Engine blocks remembered, all replicas together.
    engine_blocks: usize,
    /// Heap bytes behind the records (multi-block and piece records).
    record_heap: usize,
    next_stamp: u64,
    /// When bounded, its bound and the engine blocks in the order they were last stored
    /// (boxed: an unbounded index keeps its hot fields on fewer lines).
    queue: Option<Box<Queue>>,
    unknown_removals: u64,
    evicted: u64,
    scratch: store::Scratch,
}

impl std::fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndex")
            .field("block_size", &self.block_size)
            .field("blocks", &self.table.distinct())
            .field("engine_blocks", &self.engine_blocks)
            .field(
                "max_blocks",
                &self.queue.as_ref().map(|queue| queue.bound()),
            )
            .finish_non_exhaustive()
    }
}

impl KvIndex {
    /// An empty, unbounded index for router blocks of `block_size` tokens.
    ///
    /// # Panics
    /// If `block_size` is 0.
    pub fn new(block_size: usize) -> Self {
        assert!(block_size > 0, "the router's block size must be positive");
        Self {
            block_size,
            slots: Slots::default(),
            table: BlockTable::default(),
            records: Records::default(),
            tier_counts: Vec::new(),
            engine_blocks: 0,
            record_heap: 0,
            next_stamp: 0,
            queue: None,
            unknown_removals: 0,
            evicted: 0,
            scratch: store::Scratch::default(),
        }
    }

    /// An index that remembers at most `max_blocks` engine blocks, all replicas together,
    /// evicting the least recently stored beyond that (see the module docs).
    ///
    /// # Panics
    /// If `block_size` is 0, or `max_blocks` is over [`MAX_BOUND`].
    pub fn with_max_blocks(block_size: usize, max_blocks: usize) -> Self {
        assert!(
            max_blocks <= MAX_BOUND,
            "a bound of at most 2^27 engine blocks, not {max_blocks}"
        );
        Self {
            queue: Some(Box::new(Queue::new(max_blocks))),
            ..Self::new(block_size)
        }
    }

    /// Exchanges the index's block table with `table`: a mirrored shard keeps the tables its
    /// readers see outside the index and lends one to it for each change (see
    /// [`crate::sharded`]).
    pub(crate) fn exchange_table(&mut self, table: &mut BlockTable) {
        std::mem::swap(&mut self.table, table);
    }

    pub(crate) fn table_mut(&mut self) -> &mut BlockTable {
        &mut self.table
    }

    pub(crate) fn slots(&self) -> &Slots {
        &self.slots
    }

    /// Engine blocks remembered, all replicas together.
    pub fn num_engine_blocks(&self) -> usize {
        self.engine_blocks
    }

    /// Replicas holding at least one engine block.
    pub fn num_replicas(&self) -> usize {
        self.records.slots_in_use()
    }

    /// The engine blocks `replica` holds, per tier (a block in two tiers counts in both).
    pub fn replica_blocks(&self, replica: ReplicaId) -> TierCounts {
        let counts = self
            .slots
            .get(replica)
            .and_then(|s| self.tier_counts.get(s as usize))
            .copied()
            .unwrap_or_default();
        TierCounts {
            device: counts[0],
            host: counts[1],
            disk: counts[2],
            external: counts[3],
        }
    }

    /// Engine hashes removed that the replica did not hold in that tier, since creation.
    pub fn unknown_removals(&self) -> u64 {
        self.unknown_removals
    }

    /// Engine blocks evicted by the capacity bound, since creation.
    pub fn evicted_blocks(&self) -> u64 {
        self.evicted
    }

    /// Removes `hash` from tier `tier` of `slot`; false when it was not held there.
    #[inline]
    fn remove_tier(&mut self, slot: u32, hash: EngineHash, tier: usize) -> bool {
        match self.records.locate(slot, hash) {
            Some(entry) => self.remove_located(slot, hash, entry, tier),
            None => false,
        }
    }

    /// [`Self::remove_tier`] for `hash`, which [`Records::locate`] found at `entry` with no
    /// insertion since.
    #[inline]
    fn remove_located(&mut self, slot: u32, hash: EngineHash, entry: usize, tier: usize) -> bool {
        let Some((record, gone)) = self.records.take_tier(slot, hash, entry, tier) else {
            return false;
        };
        let kind = self.records.kind(&record);
        dec_blocks(&mut self.table, &record, kind, slot, tier);
        self.tier_counts[slot as usize][tier] -= 1;
        if gone {
            retire(&mut self.queue, record.stamp(), self.next_stamp);
            self.engine_blocks -= 1;
            if let Some(kind) = self.records.release(&record) {
                self.record_heap -= kind.heap_bytes();
            }
        }
        true
    }

    /// Removes `hash` of `slot` from every tier.
    fn remove_record(&mut self, slot: u32, hash: EngineHash) {
        let tiers = self
            .records
            .get(slot, hash)
            .map_or(0, |record| record.tiers());
        for tier in tier_bits(tiers) {
            self.remove_tier(slot, hash, tier);
        }
    }

    /// Evicts least recently stored engine blocks until the bound holds.
    fn enforce_bound(&mut self) {
        let Some(max) = self.queue.as_ref().map(|queue| queue.bound()) else {
            return;
        };
        while self.engine_blocks > max || self.table.runs() > MAX_LIVE_RUNS {
            let queue = self.queue.as_deref_mut();
            let Some((slot, hash)) = queue.and_then(|q| q.pop_live(self.next_stamp)) else {
                break;
            };
            debug_assert!(self.records.contains(slot, hash), "a live entry's record");
            self.remove_record(slot, hash);
            self.evicted += 1;
        }
    }

    /// Notes that `hash` of `slot` was stored with `stamp`, which its record now has (bounded
    /// indexes: see `kv_index/queue.rs`).
    #[inline]
    fn enqueue(&mut self, slot: u32, hash: EngineHash, stamp: u64) {
        let Some(queue) = self.queue.as_deref_mut() else {
            return;
        };
        let index = Sweeping {
            records: &mut self.records,
            next_stamp: &mut self.next_stamp,
            engine_blocks: self.engine_blocks,
        };
        queue.push(slot, hash, stamp, index);
    }

    #[cfg(test)]
    fn slot_is_clean(&self, slot: u32) -> bool {
        !self.table.any_bit_of(slot)
    }
}

/// Notes that the record stamped `stamp` took another stamp or went, where the index is bounded
/// (see [`Queue::retire`]).
#[inline]
fn retire(queue: &mut Option<Box<Queue>>, stamp: u64, next_stamp: u64) {
    if let Some(queue) = queue {
        queue.retire(stamp, next_stamp);
    }
}

/// The most engine blocks [`KvIndex::with_max_blocks`] bounds: 2^27 (a record's stamp keeps
/// 28 bits, see `records::STAMP_BITS`).
pub const MAX_BOUND: usize = 1 << 27;

/// Runs of the block table a bounded index keeps at most (evicting as for its bound): below
/// the table's 2^25 by more than any event adds. Runs are at most the blocks held, except
/// where a chain's blocks went before its continuation's (the runs between stay, empty).
#[cfg(not(test))]
const MAX_LIVE_RUNS: usize = (1 << 25) - (1 << 20);
#[cfg(test)]
const MAX_LIVE_RUNS: usize = 64;

/// One holding fewer, in `tier`, of every router block that `record` of `slot` covers
/// (`kind`: its kind, if boxed).
#[inline]
fn dec_blocks(
    table: &mut BlockTable,
    record: &Record,
    kind: Option<&Kind>,
    slot: u32,
    tier: usize,
) {
    match (record.place(), kind) {
        (Some(at), _) => table.dec(Held::At(at), slot, tier),
        (None, Some(kind)) => {
            for block in kind.covered() {
                table.dec(Held::Hash(block), slot, tier);
            }
        }
        (None, None) => unreachable!("a boxed record has its kind"),
    }
}

/// Asks for the cache line of `value` without waiting for it. A prefetch instruction, not a
/// load: a load that misses holds its instruction until the line arrives, and the index's
/// passes over a batch of keys stalled there (events applied 8-10% faster with it, build and
/// churn, `examples/query_latency`, 2026-12-04).
#[inline]
pub(crate) fn prefetch<T>(value: &T) {
    prefetch_at(value as *const T);
}

/// [`prefetch`] of an address that need not hold a `T` (nothing is read from it).
#[inline]
pub(crate) fn prefetch_at<T>(at: *const T) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: `_mm_prefetch` only hints the cache (it needs SSE, which every x86-64 has); it
    // reads nothing the program sees and cannot fault, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(at.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::hint::black_box(at);
}

pub(crate) fn tier_index(tier: StorageTier) -> usize {
    match tier {
        StorageTier::Device => 0,
        StorageTier::Host => 1,
        StorageTier::Disk => 2,
        StorageTier::External => 3,
    }
}

impl KvIndexer for KvIndex {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn apply_stored(
        &mut self,
        replica: ReplicaId,
        event: &StoredBlocks<'_>,
    ) -> Result<(), IndexError> {
        self.store(replica, event)?;
        self.enforce_bound();
        Ok(())
    }

    fn apply_removed(
        &mut self,
        replica: ReplicaId,
        tier: StorageTier,
        engine_hashes: &[EngineHash],
    ) {
        let Some(slot) = self.slots.get(replica) else {
            self.unknown_removals += engine_hashes.len() as u64;
            return;
        };
        // In batches: the records' entries are looked up together (their misses overlap), then
        // each block's record is taken in one access to its entry and the block removed.
        let (tier, mut found) = (tier_index(tier), [None; 32]);
        for batch in engine_hashes.chunks(32) {
            self.records
                .locate_all(slot, batch, &mut found[..batch.len()]);
            for (&hash, found) in batch.iter().zip(&found) {
                let removed =
                    found.is_some_and(|entry| self.remove_located(slot, hash, entry, tier));
                if !removed {
                    self.unknown_removals += 1;
                }
            }
        }
    }

    fn clear_replica(&mut self, replica: ReplicaId) {
        let Some(slot) = self.slots.get(replica) else {
            return;
        };
        let taken = self.records.take_slot(slot);
        self.tier_counts[slot as usize] = [0; 4];
        self.engine_blocks -= taken.len();
        for (record, kind) in taken {
            retire(&mut self.queue, record.stamp(), self.next_stamp);
            self.record_heap -= kind.as_ref().map_or(0, Kind::heap_bytes);
            for tier in tier_bits(record.tiers()) {
                dec_blocks(&mut self.table, &record, kind.as_ref(), slot, tier);
            }
        }
        self.slots.release(replica);
    }

    fn find_matches(&self, hashes: &[BlockHash]) -> OverlapScores {
        self.table.find(hashes, &self.slots)
    }

    fn num_blocks(&self) -> usize {
        self.table.distinct()
    }

    fn memory_bytes(&self) -> usize {
        self.table.memory_bytes()
            + self.slots.memory_bytes()
            + self.records.memory_bytes()
            + self.record_heap
            + self.queue.as_ref().map_or(0, |queue| queue.memory_bytes())
            + self.scratch.memory_bytes()
    }
}

#[cfg(test)]
mod tests;
