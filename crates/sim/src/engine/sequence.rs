//! A sequence's state in the engine, and the block hash of the prefix cache.

use super::blocks::{BlockId, BlockPool};
use super::{CacheEvent, LoraId, PromptKv, RequestId};

/// Where a sequence's prompt KV comes from, and whether a transfer of it has landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PromptSource {
    /// Computed here, less what the prefix cache holds.
    Compute,
    /// To be received from a prefill engine, less what the prefix cache holds.
    Transfer,
    /// Received: blocks held for the whole prompt, all but its last token computed (the
    /// last runs as a decode).
    Received,
}

impl From<PromptKv> for PromptSource {
    fn from(kv: PromptKv) -> Self {
        match kv {
            PromptKv::Compute => Self::Compute,
            PromptKv::Transfer => Self::Transfer,
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct Sequence {
    pub(super) id: RequestId,
    /// Prompt, then generated tokens.
    pub(super) tokens: Vec<u32>,
    pub(super) prompt_len: usize,
    pub(super) max_tokens: usize,
    pub(super) salt: u64,
    pub(super) lora: Option<LoraId>,
    /// Tokens whose KV is computed.
    pub(super) computed: usize,
    pub(super) blocks: Vec<BlockId>,
    /// Hashes of the full blocks of `tokens` computed so far (a prefix of them).
    pub(super) hashes: Vec<u64>,
    /// Leading blocks already registered in (or taken from) the prefix cache.
    pub(super) registered: usize,
    pub(super) cached_tokens: Option<usize>,
    /// Where the prompt's KV comes from; `Compute` once preempted.
    pub(super) prompt_kv: PromptSource,
    /// Its priority (lower first) and arrival order, under priority scheduling.
    pub(super) priority: i64,
    pub(super) arrival: u64,
}

impl Sequence {
    /// Its place in priority order: lower first.
    pub(super) fn order(&self) -> (i64, u64) {
        (self.priority, self.arrival)
    }

    pub(super) fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Whether its next token is a decode: one token left to compute, after an output or a
    /// received prompt.
    pub(super) fn is_decoding(&self) -> bool {
        self.tokens.len() - self.computed == 1
            && (self.output_len() > 0 || self.prompt_kv == PromptSource::Received)
    }

    /// Registers the full blocks of the first `through` tokens not registered yet in the
    /// prefix cache, with one `Stored` event per run of newly cached blocks.
    pub(super) fn cache_blocks_through(
        &mut self,
        through: usize,
        pool: &mut BlockPool,
        block_size: usize,
    ) {
        let bs = block_size;
        let full = through / bs;
        if full <= self.registered {
            return;
        }
        self.hash_blocks(full, bs);
        let mut stored: Option<CacheEvent> = None;
        for b in self.registered..full {
            if pool.register(self.blocks[b], self.hashes[b]) {
                match &mut stored {
                    Some(CacheEvent::Stored {
                        hashes, token_ids, ..
                    }) => {
                        hashes.push(self.hashes[b]);
                        token_ids.extend_from_slice(&self.tokens[b * bs..(b + 1) * bs]);
                    }
                    _ => {
                        stored = Some(CacheEvent::Stored {
                            hashes: vec![self.hashes[b]],
                            parent: b.checked_sub(1).map(|p| self.hashes[p]),
                            token_ids: self.tokens[b * bs..(b + 1) * bs].to_vec(),
                            lora: self.lora,
                        });
                    }
                }
            } else if let Some(ev) = stored.take() {
                // A block already cached elsewhere breaks the run of new ones.
                pool.push_event(ev);
            }
        }
        if let Some(ev) = stored {
            pool.push_event(ev);
        }
        self.registered = full;
    }

    /// Extends `hashes` to cover the first `full` blocks of `tokens`.
    pub(super) fn hash_blocks(&mut self, full: usize, block_size: usize) {
        while self.hashes.len() < full {
            let i = self.hashes.len();
            let parent = i.checked_sub(1).map(|p| self.hashes[p]);
            let chunk = &self.tokens[i * block_size..(i + 1) * block_size];
            self.hashes.push(block_hash(parent, chunk, self.salt));
        }
    }
}

impl super::EngineCore {
    /// Whether request `id` is queued, running or receiving its KV.
    pub fn contains(&self, id: RequestId) -> bool {
        self.running
            .iter()
            .chain(self.waiting.iter())
            .chain(self.receiving.iter().map(|r| &r.seq))
            .any(|s| s.id == id)
    }

    /// Drops a request (its client went away); frees its blocks. Returns whether it existed.
    pub fn abort(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.pool.release(&seq.blocks);
            return true;
        }
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let seq = self.waiting.remove(i).expect("index in range");
            self.pool.release(&seq.blocks);
            return true;
        }
        if let Some(i) = self.receiving.iter().position(|r| r.seq.id == id) {
            let r = self.receiving.remove(i);
            self.pool.release(&r.seq.blocks);
            return true;
        }
        false
    }
}

/// The engine's block hash: XXH3 over the parent hash, the salt and the tokens.
pub fn block_hash(parent: Option<u64>, tokens: &[u32], salt: u64) -> u64 {
    let mut buf = Vec::with_capacity(16 + tokens.len() * 4);
    buf.extend_from_slice(&parent.unwrap_or(0x6b76_726f_7574_6521).to_le_bytes());
    buf.extend_from_slice(&salt.to_le_bytes());
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    kvroute_protocol::stable_hash(&buf)
}
