//! The KV-block indexer (API skeleton; implementation in progress).
//!
//! The router hashes blocks itself: a request's prompt tokens are cut into full blocks of
//! the router's block size and each block's [`BlockHash`] chains the previous one
//! ([`block_hashes`]), so engine hash seeds never matter. Engine events name blocks by the
//! engine's hashes ([`EngineHash`]); the index maps them back to router hashes per replica.

use std::time::Instant;

pub use kvroute_protocol::kv_events::StorageTier;

/// The router's hash of a block: chains every token of the prefix up to and including it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// An engine's hash of one of its blocks, as its events name it (folded to 64 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

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
    pub fn total(&self) -> u32 {
        self.device + self.host + self.disk + self.external
    }
}

/// The answer to an overlap query: every replica holding at least the first block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    pub scores: Vec<(ReplicaId, TierCounts)>,
}

impl OverlapScores {
    pub fn get(&self, replica: ReplicaId) -> TierCounts {
        self.scores
            .iter()
            .find(|(r, _)| *r == replica)
            .map(|(_, c)| *c)
            .unwrap_or_default()
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

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    #[error("engine block size {engine} is neither a divisor nor a multiple of the router's {router}")]
    BlockSizeMismatch { engine: usize, router: usize },
    #[error("event carries {tokens} tokens for {blocks} blocks of {block_size}")]
    TokenCount {
        tokens: usize,
        blocks: usize,
        block_size: usize,
    },
    #[error("parent block {0:?} is unknown to this replica")]
    UnknownParent(EngineHash),
}

/// Router block hashes of `tokens`' full blocks.
pub fn block_hashes(tokens: &[u32], block_size: usize, salt: u64) -> Vec<BlockHash> {
    let _ = (tokens, block_size, salt);
    Vec::new()
}

/// The indexer's operations; every backend passes the same test suite.
pub trait KvIndexer: Send + Sync {
    /// The router's block size.
    fn block_size(&self) -> usize;
    fn apply_stored(&mut self, replica: ReplicaId, event: &StoredBlocks<'_>) -> Result<(), IndexError>;
    fn apply_removed(&mut self, replica: ReplicaId, tier: StorageTier, engine_hashes: &[EngineHash]);
    /// Forgets everything a replica holds (`AllBlocksCleared`, worker removed).
    fn clear_replica(&mut self, replica: ReplicaId);
    fn find_matches(&self, hashes: &[BlockHash]) -> OverlapScores;
    /// Distinct router blocks indexed.
    fn num_blocks(&self) -> usize;
    /// Approximate heap bytes held.
    fn memory_bytes(&self) -> usize;
}

/// Approximate mode: blocks the router sent to a replica, remembered until they expire.
pub trait ApproxIndexer: Send + Sync {
    fn record(&mut self, replica: ReplicaId, hashes: &[BlockHash], now: Instant);
    fn expire(&mut self, now: Instant);
    fn clear_replica(&mut self, replica: ReplicaId);
    fn find_matches(&self, hashes: &[BlockHash], now: Instant) -> OverlapScores;
    fn num_blocks(&self) -> usize;
}
