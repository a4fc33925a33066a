//! Requests' prompts as token ids and block hashes: the tokenizer the engines use, through a
//! bounded prefix cache (`--tokenizer-cache-l1-max-memory`), so that a conversation that grows
//! by a turn pays only for the new turn.
//!
//! The cache is the tokenizer crate's [`PrefixCache`]: it cuts a rendered prompt only where
//! the tokenizer provably tokenises both sides apart as together, so its ids always equal a
//! fresh tokenisation's, and it keeps each cached prefix's block hashes. The fallback
//! tokenizer (bytes as ids) is cheaper than a lookup and never uses it. Filling the cache is
//! not routing state: `POST /debug/route` fills it too.

use kvroute_index::{block_hash, BlockHash};
use kvroute_tokenizer::{
    BlockChain, ChatOptions, Encoded, Lookup, PrefixCache, Tokenizer, TokenizerError,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::Value as Json;
use std::sync::Arc;

/// A prompt's token ids and the hashes of its full blocks (empty for policies that do not
/// tokenise).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tokens {
    pub ids: Vec<u32>,
    pub hashes: Vec<BlockHash>,
    /// Under a policy that reads no tokens, how many the prompt has, where counted (for the
    /// context rule: see `routing::tokens_for`); 0 otherwise.
    pub counted: usize,
}

impl Tokens {
    /// Only the count of a prompt's tokens.
    pub fn counted_only(n: usize) -> Self {
        Self {
            counted: n,
            ..Self::default()
        }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The prompt's tokens, from its ids or its count (0 where neither was taken).
    pub fn count(&self) -> usize {
        self.ids.len().max(self.counted)
    }
}

/// The tokenizer, its prefix cache and the cache's series.
pub struct Prompts {
    pub tokenizer: Arc<Tokenizer>,
    block_size: usize,
    cache: Option<PrefixCache>,
    hits: Counter,
    misses: Counter,
    bytes: Gauge,
}

impl std::fmt::Debug for Prompts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prompts")
            .field("tokenizer", &!self.tokenizer.is_fallback())
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

/// The chain of the index's block hashes (no salt), as the cache computes them.
fn chain(block_size: usize) -> BlockChain {
    BlockChain {
        block_size,
        hash: |parent, block| block_hash(parent.map(BlockHash), 0, block).0,
    }
}

impl Prompts {
    /// A cache of `cache_bytes` (none for 0 or the fallback), its series in `registry`.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        block_size: usize,
        cache_bytes: usize,
        registry: &mut Registry,
    ) -> Self {
        let cache = (cache_bytes > 0 && !tokenizer.is_fallback())
            .then(|| PrefixCache::new(cache_bytes, Some(chain(block_size))));
        let (hits, misses, bytes) = (Counter::default(), Counter::default(), Gauge::default());
        registry.register(
            "kvroute_tokenizer_cache_hits",
            "Prompts whose tokenisation went on from a cached prefix",
            hits.clone(),
        );
        registry.register(
            "kvroute_tokenizer_cache_misses",
            "Prompts the prefix cache could cut but held no prefix of",
            misses.clone(),
        );
        registry.register(
            "kvroute_tokenizer_cache_bytes",
            "Bytes held by the tokenizer prefix cache (bounded by --tokenizer-cache-l1-max-memory)",
            bytes.clone(),
        );
        Self {
            tokenizer,
            block_size,
            cache,
            hits,
            misses,
            bytes,
        }
    }

    /// A completion prompt's tokens, with the tokenizer's special tokens.
    pub fn encode_prompt(&self, text: &str) -> Result<Tokens, TokenizerError> {
        match &self.cache {
            Some(cache) => Ok(self.counted(self.tokenizer.encode_cached(text, true, cache)?)),
            None => Ok(self.hashed(self.tokenizer.encode_prompt(text)?)),
        }
    }

    /// A chat's tokens: its template rendered, the text tokenised.
    pub fn encode_chat(
        &self,
        messages: &Json,
        options: &ChatOptions<'_>,
    ) -> Result<Tokens, TokenizerError> {
        match &self.cache {
            Some(cache) => Ok(self.counted(
                self.tokenizer
                    .encode_chat_cached(messages, options, cache)?,
            )),
            None => Ok(self.hashed(self.tokenizer.encode_chat(messages, options)?)),
        }
    }

    /// Token ids given as such (no tokenising), hashed.
    pub fn hashed(&self, ids: Vec<u32>) -> Tokens {
        let hashes = kvroute_index::block_hashes(&ids, self.block_size, 0);
        Tokens {
            ids,
            hashes,
            counted: 0,
        }
    }

    fn counted(&self, encoded: Encoded) -> Tokens {
        match encoded.lookup {
            Lookup::Hit => self.hits.inc(),
            Lookup::Miss => self.misses.inc(),
            Lookup::Bypassed => 0,
        };
        // A hit can insert too (the prompt's new last cut): the size after either.
        if let (Some(cache), Lookup::Hit | Lookup::Miss) = (&self.cache, encoded.lookup) {
            self.bytes.set(cache.bytes() as i64);
        }
        Tokens {
            ids: encoded.ids,
            hashes: encoded.hashes.into_iter().map(BlockHash).collect(),
            counted: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> Arc<Tokenizer> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/tiny-llama");
        Arc::new(Tokenizer::load(std::path::Path::new(dir)).unwrap())
    }

    #[test]
    fn cached_tokens_and_hashes_equal_fresh_ones_as_a_chat_grows() {
        let mut registry = Registry::default();
        let cached = Prompts::new(tiny(), 16, 1 << 20, &mut registry);
        let fresh = Prompts::new(tiny(), 16, 0, &mut Registry::default());
        let opts = ChatOptions {
            add_generation_prompt: true,
            ..ChatOptions::default()
        };
        let mut messages = Vec::new();
        for turn in 0..6usize {
            let role = if turn.is_multiple_of(2) {
                "user"
            } else {
                "assistant"
            };
            let content = format!("Turn {turn}.\n{}", "Some words on a line.\n".repeat(30));
            messages.push(json!({"role": role, "content": content}));
            let m = Json::Array(messages.clone());
            let got = cached.encode_chat(&m, &opts).unwrap();
            assert_eq!(got, fresh.encode_chat(&m, &opts).unwrap(), "turn {turn}");
            assert_eq!(got.hashes.len(), got.ids.len() / 16);
            let prompt = format!("{}\nand more", "A completion prompt.\n".repeat(40 + turn));
            assert_eq!(
                cached.encode_prompt(&prompt).unwrap(),
                fresh.encode_prompt(&prompt).unwrap()
            );
        }
        // The first chat and the first prompt missed; every later one went on from a prefix.
        assert_eq!((cached.hits.get(), cached.misses.get()), (10, 2));
        assert!(cached.bytes.get() > 0);
        assert_eq!((fresh.hits.get(), fresh.misses.get()), (0, 0));
    }

    #[test]
    fn the_fallback_has_no_cache() {
        let prompts = Prompts::new(
            Arc::new(Tokenizer::fallback()),
            16,
            1 << 20,
            &mut Registry::default(),
        );
        assert!(prompts.cache.is_none());
        let text = "x\n".repeat(600);
        assert_eq!(prompts.encode_prompt(&text).unwrap().ids.len(), 1200);
    }
}
