//! [`KvIndex`]: the exact index, fed by engine KV events.
//!
//! # Layout
//! - A block table keyed by the router block hash (already uniform, so used as its own hash)
//!   holding, per storage tier, a 64-bit mask of the replicas holding the block (replicas get
//!   dense internal slots; more than 64 replicas use one table entry per group of 64). Its
//!   entries are nodes of an arena in store order, so the blocks of a chain stored together
//!   lie side by side: a query steps to the next node, and looks a block up only where the
//!   chain was not stored in one piece, with the still-matching replicas as a mask. Only the
//!   first node of each such run is in the table's hash index (a *head*); the others
//!   (*tails*) are found as the successor of their parent's node, so storing a run of blocks
//!   inserts one index entry, not one a block; and where the table can tell that a block
//!   stored after its parent's node is new (no other chain branches there), it does not look
//!   it up either (rules in `kv_index/flat.rs`).
//! - Per replica, an index from engine hash to a record of the router blocks the engine block
//!   maps to, their nodes where the engine's block size is the router's, and the tiers
//!   holding it (the records of all replicas in one arena, in store order). Removal and
//!   `AllBlocksCleared` go through it (to the node directly, no lookup), so clearing a replica
//!   costs time proportional to what it holds. The first event whose block size differs
//!   from the router's turns tails off for good (every node a head, looked up by key): those
//!   records do not keep nodes.
//! - An event's blocks are applied in passes: their hashes first, then the entries they will
//!   touch are loaded together, so that their cache misses overlap, then the changes.
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
//! removal events are lost; with a bound that is never reached, nothing is ever evicted.

mod flat;
mod record;
mod records;
mod store;
mod table;
mod tags;

use std::collections::VecDeque;

use crate::slots::Slots;
use crate::{
    BlockHash, EngineHash, IndexError, KvIndexer, OverlapScores, ReplicaId, StorageTier,
    StoredBlocks, TierCounts,
};
use record::tier_bits;
use records::Records;
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
    max_blocks: Option<usize>,
    /// (slot, engine block, stamp) in store order, when bounded; stale entries are skipped.
    fifo: VecDeque<(u32, EngineHash, u64)>,
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
            .field("max_blocks", &self.max_blocks)
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
            max_blocks: None,
            fifo: VecDeque::new(),
            unknown_removals: 0,
            evicted: 0,
            scratch: store::Scratch::default(),
        }
    }

    /// This (empty) index, counting in [`KvIndexer::num_blocks`] the entries of (block, group
    /// of 64 replicas) rather than distinct blocks: the same up to 64 replicas, a block held
    /// by replicas of `k` groups counted `k` times past them. Keeping the distinct count
    /// across groups costs a map lookup each time a group gains or loses a block (a quarter
    /// of a 1,024-replica simulation); for a caller that never reads the count.
    pub fn counting_entries(mut self) -> Self {
        self.table.count_entries_only();
        self
    }

    /// An index that remembers at most `max_blocks` engine blocks, all replicas together,
    /// evicting the least recently stored beyond that (see the module docs).
    ///
    /// # Panics
    /// If `block_size` is 0.
    pub fn with_max_blocks(block_size: usize, max_blocks: usize) -> Self {
        Self {
            max_blocks: Some(max_blocks),
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
            Some((entry, at)) => self.remove_located(slot, entry, at, tier),
            None => false,
        }
    }

    /// [`Self::remove_tier`] for the record at arena position `at`, index entry `entry`.
    #[inline]
    fn remove_located(&mut self, slot: u32, entry: usize, at: u32, tier: usize) -> bool {
        let groups = self.slots.groups();
        let record = self.records.at_mut(at);
        if record.tiers() & (1 << tier) == 0 {
            return false;
        }
        record.set_tiers(record.tiers() & !(1 << tier));
        self.tier_counts[slot as usize][tier] -= 1;
        for (block, at) in record.kind.covered_at() {
            self.table.dec(block, at, slot, tier, groups);
        }
        if record.tiers() == 0 {
            let record = self.records.remove_entry(slot, entry);
            self.engine_blocks -= 1;
            self.record_heap -= record.kind.heap_bytes();
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
        let Some(max) = self.max_blocks else {
            return;
        };
        while self.engine_blocks > max {
            let Some((slot, hash, stamp)) = self.fifo.pop_front() else {
                break;
            };
            let live = self
                .records
                .get(slot, hash)
                .is_some_and(|record| record.stamp() == stamp);
            if live {
                self.remove_record(slot, hash);
                self.evicted += 1;
            }
        }
    }

    /// Notes that `hash` of `slot` was stored with `stamp`.
    fn push_fifo(&mut self, slot: u32, hash: EngineHash, stamp: u64) {
        if self.max_blocks.is_none() {
            return;
        }
        self.fifo.push_back((slot, hash, stamp));
        if self.fifo.len() > 2 * self.engine_blocks + 1024 {
            let records = &self.records;
            self.fifo.retain(|(slot, hash, stamp)| {
                records
                    .get(*slot, *hash)
                    .is_some_and(|record| record.stamp() == *stamp)
            });
        }
    }

    #[cfg(test)]
    fn slot_is_clean(&self, slot: u32) -> bool {
        !self.table.any_bit_of(slot)
    }
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
        // In batches: the records, then the table entries they name, are brought into cache
        // together (their misses overlap), then the blocks are removed, each where its lookup
        // found it (checked: removing one record may shift another's index entry back).
        let mut found = [None; 32];
        for batch in engine_hashes.chunks(32) {
            for &hash in batch {
                self.records.touch(slot, hash);
            }
            for (&hash, found) in batch.iter().zip(&mut found) {
                *found = self.records.locate(slot, hash);
                if let Some((_, at)) = *found {
                    for (block, node) in self.records.at(at).kind.covered_at() {
                        self.table.touch(block, node, slot);
                    }
                }
            }
            for (&hash, found) in batch.iter().zip(&found) {
                let located = found.and_then(|found| self.records.relocate(slot, hash, found));
                let removed = located.is_some_and(|(entry, at)| {
                    self.remove_located(slot, entry, at, tier_index(tier))
                });
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
        let groups = self.slots.groups();
        let taken = self.records.take_slot(slot);
        self.tier_counts[slot as usize] = [0; 4];
        self.engine_blocks -= taken.len();
        for record in taken {
            self.record_heap -= record.kind.heap_bytes();
            for tier in tier_bits(record.tiers()) {
                for (block, at) in record.kind.covered_at() {
                    self.table.dec(block, at, slot, tier, groups);
                }
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
            + self.fifo.capacity() * std::mem::size_of::<(u32, EngineHash, u64)>()
            + self.scratch.memory_bytes()
    }
}

#[cfg(test)]
mod tests;
