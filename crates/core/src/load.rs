//! Active-load accounting per (worker, data-parallel rank), as `kv_aware` reads it.
//!
//! A routed request adds its uncached prompt tokens to the rank's *prefill tokens* until
//! its first token, and its KV blocks to the rank's *decode blocks* until it finishes.
//! Blocks are counted by hash, once however many in-flight requests share them (a shared
//! system prompt occupies its blocks once); the request's partial last block is its own.
//! Block hashes are chained (a block's hash commits to its whole prefix), so two prompts
//! share a leading run of blocks and nothing after it.
//! The caller applies these changes from its decisions and releases them in every outcome.

use std::collections::HashMap;

/// What one request adds to its rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestLoad {
    /// Prompt tokens the engine must compute (the prompt minus its cached prefix).
    pub prefill_tokens: u64,
    /// Hashes of the prompt's full blocks.
    pub blocks: Vec<u64>,
    /// Blocks only this request holds (its partial last block).
    pub own_blocks: u64,
}

impl RequestLoad {
    /// The load of a prompt of `prompt_tokens` with full-block hashes `blocks`, of which the
    /// first `cached_blocks` are in the rank's device cache.
    pub fn for_prompt(
        blocks: Vec<u64>,
        prompt_tokens: usize,
        cached_blocks: usize,
        block_size: usize,
    ) -> Self {
        Self {
            prefill_tokens: prompt_tokens.saturating_sub(cached_blocks * block_size) as u64,
            blocks,
            own_blocks: u64::from(!prompt_tokens.is_multiple_of(block_size.max(1))),
        }
    }
}

/// The active load of one (worker, rank).
#[derive(Debug, Default, Clone)]
pub struct RankLoad {
    prefill_tokens: u64,
    requests: u64,
    prefilling: u64,
    shared: HashMap<u64, u32>,
    own_blocks: u64,
}

impl RankLoad {
    pub fn prefill_tokens(&self) -> u64 {
        self.prefill_tokens
    }

    pub fn active_requests(&self) -> u64 {
        self.requests
    }

    /// Requests routed here that have not produced a first token.
    pub fn prefilling_requests(&self) -> u64 {
        self.prefilling
    }

    /// Distinct blocks held by the rank's active requests.
    pub fn decode_blocks(&self) -> u64 {
        self.shared.len() as u64 + self.own_blocks
    }

    /// Blocks of `load` the rank does not already hold for another request.
    ///
    /// Block hashes are a chain (each commits to every block before it), the request's as
    /// every active request's, so the blocks held here are a leading run of the request's:
    /// a binary search finds its end in `log2(blocks)` lookups. Counting block by block cost
    /// a lookup per prompt block per candidate: at 1,024 candidates and 1,000-block prompts, a
    /// million lookups a decision (two thirds of `kvroute-bench simulate`'s time at 256
    /// workers).
    pub fn new_blocks(&self, load: &RequestLoad) -> u64 {
        // A rank that lacks the first block (most ranks, for most requests) lacks them all.
        let held = match load.blocks.first() {
            Some(first) if self.shared.contains_key(first) => {
                load.blocks.partition_point(|h| self.shared.contains_key(h))
            }
            _ => 0,
        };
        (load.blocks.len() - held) as u64 + load.own_blocks
    }

    /// A request was routed here.
    pub fn start(&mut self, load: &RequestLoad) {
        self.requests += 1;
        self.prefilling += 1;
        self.prefill_tokens += load.prefill_tokens;
        self.own_blocks += load.own_blocks;
        for &h in &load.blocks {
            *self.shared.entry(h).or_insert(0) += 1;
        }
    }

    /// The request produced its first token: its prefill is done.
    pub fn first_token(&mut self, load: &RequestLoad) {
        self.prefilling = self.prefilling.saturating_sub(1);
        self.prefill_tokens = self.prefill_tokens.saturating_sub(load.prefill_tokens);
    }

    /// The request ended (finished, failed or abandoned). `prefilling` says whether its
    /// prefill tokens are still counted (no first token seen).
    pub fn finish(&mut self, load: &RequestLoad, prefilling: bool) {
        if prefilling {
            self.first_token(load);
        }
        self.requests = self.requests.saturating_sub(1);
        self.own_blocks = self.own_blocks.saturating_sub(load.own_blocks);
        for h in &load.blocks {
            if let Some(n) = self.shared.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.shared.remove(h);
                }
            }
        }
    }

    /// Whether nothing is accounted (every request released).
    /// `kv_aware`'s terms of a candidate rank with this load, for a request whose blocks are
    /// `request` and whose overlap there is `overlap`.
    pub fn kv_terms(
        &self,
        overlap: crate::Overlap,
        request: &RequestLoad,
        preferred_taint_weight: f64,
    ) -> crate::KvTerms {
        crate::KvTerms {
            overlap,
            prefill_tokens: self.prefill_tokens(),
            decode_blocks: self.decode_blocks(),
            new_blocks: self.new_blocks(request),
            active_requests: self.active_requests(),
            prefilling_requests: self.prefilling_requests(),
            preferred_taint_weight,
        }
    }

    pub fn is_idle(&self) -> bool {
        self.requests == 0
            && self.prefilling == 0
            && self.prefill_tokens == 0
            && self.decode_blocks() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_blocks_counts_what_the_rank_lacks_of_a_chained_prompt() {
        // Chained hashes: a block's hash names its whole prefix.
        let chain = |prefix: &[u64]| -> Vec<u64> {
            (1..=prefix.len())
                .map(|n| {
                    prefix[..n]
                        .iter()
                        .fold(17u64, |h, &b| h.wrapping_mul(31).wrapping_add(b))
                })
                .collect()
        };
        let load = |tokens: &[u64]| RequestLoad {
            prefill_tokens: 0,
            blocks: chain(tokens),
            own_blocks: 0,
        };
        let mut r = RankLoad::default();
        let query = load(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(r.new_blocks(&query), 8);
        for held in [&[1, 2, 3][..], &[1, 2, 3, 4, 5, 9], &[2, 3, 4]] {
            r.start(&load(held));
        }
        // Held here: the query's first 5 blocks (the longest active prefix), nothing later.
        let linear = query
            .blocks
            .iter()
            .filter(|h| !r.shared.contains_key(h))
            .count();
        assert_eq!(r.new_blocks(&query), 3);
        assert_eq!(linear, 3);
        assert_eq!(r.new_blocks(&load(&[2, 3, 4, 1])), 1);
        assert_eq!(r.new_blocks(&load(&[7])), 1);
    }

    #[test]
    fn shared_blocks_count_once_and_everything_is_released() {
        let mut r = RankLoad::default();
        let a = RequestLoad {
            prefill_tokens: 100,
            blocks: vec![1, 2, 3],
            own_blocks: 1,
        };
        let b = RequestLoad {
            prefill_tokens: 40,
            blocks: vec![1, 2, 9],
            own_blocks: 1,
        };
        assert_eq!(r.new_blocks(&a), 4);
        r.start(&a);
        assert_eq!(r.new_blocks(&b), 2, "blocks 1 and 2 are already held");
        r.start(&b);
        assert_eq!(
            (r.prefill_tokens(), r.decode_blocks(), r.active_requests()),
            (140, 6, 2)
        );
        assert_eq!(r.prefilling_requests(), 2);
        r.first_token(&a);
        assert_eq!(r.prefill_tokens(), 40);
        assert_eq!(r.prefilling_requests(), 1, "a decodes, b still prefills");
        assert_eq!(
            r.kv_terms(Default::default(), &a, 0.0).prefilling_requests,
            1
        );
        r.finish(&a, false);
        assert_eq!(
            (r.prefill_tokens(), r.decode_blocks(), r.active_requests()),
            (40, 4, 1)
        );
        r.finish(&b, true);
        assert_eq!(r.prefilling_requests(), 0);
        assert!(r.is_idle());
    }
}
