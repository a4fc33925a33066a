//! The KV-block indexer: which replica (worker, dp_rank) holds which prefix blocks of KV
//! cache, in which storage tier, and how many leading blocks of a request each one holds.
//!
//! # What it owns
//! - The router's block hash ([`block_hashes`]): a prompt's tokens are cut into full blocks of
//!   the router's block size `B`, and block `i`'s hash chains every token before it:
//!
//!   ```text
//!   h_0 = XXH3-64( le64(ROOT_HASH_SEED) ‖ le64(salt) ‖ le32(t_0) ‖ … ‖ le32(t_{B-1}) )
//!   h_i = XXH3-64( le64(h_{i-1})        ‖ le64(salt) ‖ le32(t_{iB}) ‖ … ‖ le32(t_{iB+B-1}) )
//!   ```
//!
//!   (XXH3-64 with seed 0, [`kvroute_protocol::stable_hash`]; `salt` folds the LoRA name and
//!   extra keys, 0 for none; a trailing partial block has no hash). The router hashes token ids
//!   itself, so engine hash seeds never matter. Golden tests pin the values.
//! - [`KvIndex`], the exact index fed by engine KV events ([`KvIndexer`]): `BlockStored`
//!   events name blocks by the engine's hashes ([`EngineHash`]) and carry their tokens; the
//!   index maps each engine block onto router blocks per replica, re-blocking when the
//!   engine's block size differs from the router's (rules in [`kv_index`]'s docs).
//! - [`ShardedKvIndex`], the same index sharded by replica over mirrored shards for N ingest
//!   threads: its queries never wait for a writer (see [`sharded`]'s docs).
//! - [`ApproxIndex`], the approximate index for replicas without events ([`ApproxIndexer`]):
//!   the blocks the router sent to a replica, remembered for a TTL.
//! - [`reference`](mod@reference): deliberately naive models of both, the oracles of the differential tests
//!   and the baseline of the benchmarks.
//!
//! # Invariants
//! - A replica holds a router block in a tier while at least one live engine block stored in
//!   that tier maps onto it; `find_matches` counts, per replica, the leading blocks of the
//!   query it holds in some tier, stopping at the first it does not hold, each block counted
//!   once in the best tier holding it (device > host > disk > external). Only replicas
//!   holding the first block appear, sorted by [`ReplicaId`].
//! - A failed `apply_stored` changes nothing.
//! - Memory is reported ([`KvIndexer::memory_bytes`]) and can be bounded
//!   ([`KvIndex::with_max_blocks`], [`ApproxIndex::with_max_entries`]).
//! - Time only comes in as a parameter (`now`); nothing here reads a clock.
//!
//! # What it does not do
//! No I/O, no threads, no clock, no metrics: `KvIndex` is a synchronous structure that the
//! caller owns (and shares behind its own lock or snapshot); only [`ShardedKvIndex`] holds
//! locks, its shards' own. It does not decode wire events
//! (`kvroute_protocol::kv_events` does), does not fold LoRA names or extra keys into a salt,
//! does not detect sequence gaps (the subscriber does, and calls
//! [`KvIndexer::clear_replica`]) and does not score candidates (the routing core does).

use std::time::Instant;

pub use kvroute_protocol::kv_events::StorageTier;

pub mod approx;
mod hash;
mod hasher;
pub mod kv_index;
pub mod reference;
pub mod sharded;
mod slots;

pub use approx::ApproxIndex;
pub use hash::{block_hash, block_hashes, ROOT_HASH_SEED};
pub use kv_index::KvIndex;
pub use sharded::{ReplicaEvents, ShardedKvIndex};

/// The router's hash of a block: chains every token of the prefix up to and including it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// An engine's hash of one of its blocks, as its events name it (folded to 64 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

impl EngineHash {
    /// An event's block hashes, folded to 64 bits.
    pub fn all(hashes: &[kvroute_protocol::kv_events::BlockHashValue]) -> Vec<EngineHash> {
        hashes.iter().map(|h| EngineHash(h.to_u64())).collect()
    }

    /// [`EngineHash::all`] into `out`, cleared first: one buffer for many events.
    pub fn all_into(
        hashes: &[kvroute_protocol::kv_events::BlockHashValue],
        out: &mut Vec<EngineHash>,
    ) {
        out.clear();
        out.extend(hashes.iter().map(|h| EngineHash(h.to_u64())));
    }
}

/// One (worker, dp_rank), by a dense id the caller assigns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaId(pub u32);

/// Leading blocks of a request a replica holds, counted once each in the best tier that
/// holds it (device > host > disk > external).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounts {
    pub device: u32,
    pub host: u32,
    pub disk: u32,
    pub external: u32,
}

impl TierCounts {
    /// All leading blocks held, whatever the tier.
    pub fn total(&self) -> u32 {
        self.device + self.host + self.disk + self.external
    }

    /// Adds `blocks` blocks counted in `tier`.
    pub fn add(&mut self, tier: StorageTier, blocks: u32) {
        match tier {
            StorageTier::Device => self.device += blocks,
            StorageTier::Host => self.host += blocks,
            StorageTier::Disk => self.disk += blocks,
            StorageTier::External => self.external += blocks,
        }
    }
}

/// The answer to an overlap query: every replica holding at least the first block, sorted
/// by [`ReplicaId`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    pub scores: Vec<(ReplicaId, TierCounts)>,
}

impl OverlapScores {
    /// The counts of `replica`; all zero when it holds not even the first block.
    pub fn get(&self, replica: ReplicaId) -> TierCounts {
        // Sorted by replica: a binary search (a decision asks once per candidate).
        self.scores
            .binary_search_by_key(&replica, |(r, _)| *r)
            .map_or_else(|_| TierCounts::default(), |i| self.scores[i].1)
    }
}

/// A `BlockStored` event, as the index needs it.
#[derive(Debug, Clone, Copy)]
pub struct StoredBlocks<'a> {
    /// The engine's hash of the block before the first one; `None` at a sequence's start.
    pub parent: Option<EngineHash>,
    pub engine_hashes: &'a [EngineHash],
    /// `engine_hashes.len() * block_size` tokens.
    pub token_ids: &'a [u32],
    /// The engine's block size.
    pub block_size: usize,
    pub tier: StorageTier,
    /// Mixed into every block's hash: the LoRA name and extra keys, folded (0 for none).
    pub salt: u64,
}

impl<'a> StoredBlocks<'a> {
    /// An engine's `BlockStored` event as the index reads it, its block hashes converted into
    /// `hashes` (which the result borrows; cleared first, so that a caller can reuse one
    /// buffer for every event). The LoRA name is the salt; per-block `extra_keys` are not
    /// folded in yet.
    pub fn from_event(
        stored: &'a kvroute_protocol::kv_events::BlockStored,
        hashes: &'a mut Vec<EngineHash>,
    ) -> Self {
        EngineHash::all_into(&stored.block_hashes, hashes);
        Self {
            parent: stored
                .parent_block_hash
                .as_ref()
                .map(|h| EngineHash(h.to_u64())),
            engine_hashes: hashes,
            token_ids: &stored.token_ids,
            block_size: stored.block_size as usize,
            tier: stored.tier(),
            salt: stored
                .lora_name
                .as_deref()
                .map_or(0, |name| kvroute_protocol::stable_hash(name.as_bytes())),
        }
    }
}

/// Why an event could not be applied. The event is then skipped whole: nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// The engine's block size neither divides nor is a multiple of the router's (or is 0),
    /// or the event continues a chain at a point its block size cannot continue from.
    #[error(
        "engine block size {engine} is neither a divisor nor a multiple of the router's {router}"
    )]
    BlockSizeMismatch { engine: usize, router: usize },
    #[error("event carries {tokens} tokens for {blocks} blocks of {block_size}")]
    TokenCount {
        tokens: usize,
        blocks: usize,
        block_size: usize,
    },
    /// The parent (or a block of the partial router block it ends) is not held by the replica:
    /// an event was lost, or the block was removed meanwhile.
    #[error("parent block {0:?} is unknown to this replica")]
    UnknownParent(EngineHash),
}

/// The indexer's operations; every backend passes the same test suite.
pub trait KvIndexer: Send + Sync {
    /// The router's block size.
    fn block_size(&self) -> usize;
    /// Applies a `BlockStored` event of `replica`; on error nothing changed.
    fn apply_stored(
        &mut self,
        replica: ReplicaId,
        event: &StoredBlocks<'_>,
    ) -> Result<(), IndexError>;
    /// Applies a `BlockRemoved` event: `replica` no longer holds these engine blocks in
    /// `tier`. Hashes the replica does not hold in that tier are ignored.
    fn apply_removed(
        &mut self,
        replica: ReplicaId,
        tier: StorageTier,
        engine_hashes: &[EngineHash],
    );
    /// Forgets everything a replica holds (`AllBlocksCleared`, worker removed).
    fn clear_replica(&mut self, replica: ReplicaId);
    /// For each replica holding `hashes[0]`, the leading blocks of `hashes` it holds.
    fn find_matches(&self, hashes: &[BlockHash]) -> OverlapScores;
    /// Distinct router blocks indexed.
    fn num_blocks(&self) -> usize;
    /// Approximate heap bytes held.
    fn memory_bytes(&self) -> usize;
}

/// Approximate mode: blocks the router sent to a replica, remembered until they expire.
pub trait ApproxIndexer: Send + Sync {
    /// `replica` holds `hashes` (device tier) until `now + ttl`.
    fn record(&mut self, replica: ReplicaId, hashes: &[BlockHash], now: Instant);
    /// Frees the entries expired at `now` (an entry expires at `now >= deadline`).
    fn expire(&mut self, now: Instant);
    fn clear_replica(&mut self, replica: ReplicaId);
    /// As [`KvIndexer::find_matches`], ignoring entries expired at `now`; all counts are device.
    fn find_matches(&self, hashes: &[BlockHash], now: Instant) -> OverlapScores;
    /// Distinct blocks held by some replica (expired entries included until `expire`).
    fn num_blocks(&self) -> usize;
}

/// A xorshift stream from `seed` (not 0), for the unit tests: each call the next number.
#[cfg(test)]
pub(crate) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// [`xorshift`], each call a number below its argument.
#[cfg(test)]
pub(crate) fn below(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut next = xorshift(seed);
    move |n| next() % n
}
