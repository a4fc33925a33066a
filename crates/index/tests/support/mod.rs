//! Helpers shared by the integration tests: content-addressed engine hashes and events.

#![allow(dead_code)]

use kvroute_index::{
    block_hashes, BlockHash, EngineHash, IndexError, KvIndexer, ReplicaId, StorageTier,
    StoredBlocks,
};

pub const BS: usize = 16;

/// The engine's hashes of `tokens`' blocks of `engine_bs`, chained over the content (as real
/// engines do), distinct from the router's.
pub fn engine_hashes(tokens: &[u32], engine_bs: usize, salt: u64) -> Vec<EngineHash> {
    block_hashes(
        tokens,
        engine_bs,
        salt ^ 0xE0E0 ^ ((engine_bs as u64) << 32),
    )
    .into_iter()
    .map(|h| EngineHash(h.0))
    .collect()
}

/// Router hashes of `tokens` at the router's block size.
pub fn router_hashes(tokens: &[u32], salt: u64) -> Vec<BlockHash> {
    block_hashes(tokens, BS, salt)
}

/// One stored event: engine blocks `blocks` of `tokens` (of `engine_bs`), parent the block
/// before them.
#[derive(Debug, Clone)]
pub struct Event {
    pub parent: Option<EngineHash>,
    pub hashes: Vec<EngineHash>,
    pub tokens: Vec<u32>,
    pub engine_bs: usize,
    pub tier: StorageTier,
    pub salt: u64,
}

impl Event {
    pub fn new(
        tokens: &[u32],
        engine_bs: usize,
        blocks: std::ops::Range<usize>,
        tier: StorageTier,
        salt: u64,
    ) -> Self {
        let all = engine_hashes(tokens, engine_bs, salt);
        Self {
            parent: blocks.start.checked_sub(1).map(|i| all[i]),
            hashes: all[blocks.clone()].to_vec(),
            tokens: tokens[blocks.start * engine_bs..blocks.end * engine_bs].to_vec(),
            engine_bs,
            tier,
            salt,
        }
    }

    pub fn stored(&self) -> StoredBlocks<'_> {
        StoredBlocks {
            parent: self.parent,
            engine_hashes: &self.hashes,
            token_ids: &self.tokens,
            block_size: self.engine_bs,
            tier: self.tier,
            salt: self.salt,
        }
    }

    pub fn apply(&self, index: &mut impl KvIndexer, replica: ReplicaId) -> Result<(), IndexError> {
        index.apply_stored(replica, &self.stored())
    }
}

/// Stores the whole of `tokens`' full engine blocks on the device in one event.
pub fn store_all(index: &mut impl KvIndexer, replica: u32, tokens: &[u32], engine_bs: usize) {
    let blocks = tokens.len() / engine_bs;
    Event::new(tokens, engine_bs, 0..blocks, StorageTier::Device, 0)
        .apply(index, ReplicaId(replica))
        .expect("store");
}

/// `n` tokens starting at `start`: distinct prompts for distinct starts.
pub fn tokens(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}
