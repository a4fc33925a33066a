//! Active-load accounting per (worker, data-parallel rank), as `kv_aware` reads it.
//!
//! A routed request adds its uncached prompt tokens to the rank's *prefill tokens* until
//! its first token, and its KV blocks to the rank's *decode blocks* until it finishes.
//! Blocks are counted by hash, once however many in-flight requests share them (a shared
//! system prompt occupies its blocks once); the request's partial last block is its own.
//! Block hashes are chained (a block's hash commits to its whole prefix), so two prompts
//! share a leading run of blocks and nothing after it.
//! The caller applies these changes from its decisions and releases them in every outcome.
//! With output-block tracking a request also adds blocks as it generates ([`output`]).

use kvroute_protocol::hashers::IdentityMap;

pub mod output;
mod summary;
pub use output::{OutputBlocks, OutputStep};
pub use summary::LoadSummary;

/// What one request adds to its rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestLoad {
    /// Prompt tokens the engine must compute (the prompt minus its cached prefix).
    pub prefill_tokens: u64,
    /// Hashes of the prompt's full blocks.
    pub blocks: Vec<u64>,
    /// Blocks only this request holds (its partial last block).
    pub own_blocks: u64,
    /// Its output blocks, when they are tracked (`--router-track-output-blocks`).
    pub output: Option<OutputBlocks>,
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
            output: None,
        }
    }

    /// The same, also counting output blocks as it generates, toward `expected` tokens.
    pub fn tracking_output(
        mut self,
        prompt_tokens: usize,
        block_size: usize,
        expected: Option<u32>,
    ) -> Self {
        self.output = Some(OutputBlocks::new(prompt_tokens, block_size, expected));
        self
    }
}

/// The active load of one (worker, rank).
#[derive(Debug, Clone)]
pub struct RankLoad {
    prefill_tokens: u64,
    requests: u64,
    prefilling: u64,
    /// Keyed by router block hash (XXH3, uniform: hashed by identity).
    shared: IdentityMap<u64, u32>,
    own_blocks: u64,
    /// Output blocks of the active requests (tracked ones only).
    output_blocks: u64,
    /// Prompt blocks whose weight decayed below 1 (see [`output`]), with their weight.
    decayed: IdentityMap<u64, f64>,
    /// The weight the decay took off the blocks counted here: `sum(1 - w)`.
    discount: f64,
    /// Active requests counted by the bucket of their first block (its hash's top 6 bits).
    /// With chained hashes only a request that starts with a prompt's first block holds it,
    /// so an empty bucket answers [`Self::new_blocks`] without reading `shared` (a cache miss
    /// per candidate, most of a decision's time at 1,024 workers).
    firsts: [u32; FIRST_BUCKETS],
    /// Bit `b` set while `firsts[b] > 0` (what [`Self::summary`] publishes).
    first_mask: u64,
}

const FIRST_BUCKETS: usize = 64;

fn first_bucket(hash: u64) -> usize {
    (hash >> 58) as usize
}

impl Default for RankLoad {
    fn default() -> Self {
        Self {
            prefill_tokens: 0,
            requests: 0,
            prefilling: 0,
            shared: IdentityMap::default(),
            own_blocks: 0,
            output_blocks: 0,
            decayed: IdentityMap::default(),
            discount: 0.0,
            firsts: [0; FIRST_BUCKETS],
            first_mask: 0,
        }
    }
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

    /// Distinct blocks held by the rank's active requests, with their output blocks; with an
    /// expected output length, the weighted count (rounded).
    pub fn decode_blocks(&self) -> u64 {
        let blocks = self.shared.len() as u64 + self.own_blocks + self.output_blocks;
        if self.discount == 0.0 {
            return blocks;
        }
        self.decode_weight().round() as u64
    }

    /// The weighted count of [`Self::decode_blocks`], before rounding.
    pub fn decode_weight(&self) -> f64 {
        let blocks = self.shared.len() as u64 + self.own_blocks + self.output_blocks;
        (blocks as f64 - self.discount).max(0.0)
    }

    /// Output blocks of the active requests, unweighted.
    pub fn output_blocks(&self) -> u64 {
        self.output_blocks
    }

    /// `tokens` more were generated by `load`, active here: counts its new output blocks and
    /// decays its exclusive blocks (see [`output`]). Untracked requests change nothing.
    pub fn output_tokens(&mut self, load: &mut RequestLoad, tokens: u64) {
        if let Some(step) = load.output.as_mut().and_then(|o| o.advance(tokens)) {
            self.output_step(load, &step);
        }
    }

    /// Applies a step of `load`'s output blocks (see [`OutputBlocks::advance`]).
    pub fn output_step(&mut self, load: &RequestLoad, step: &OutputStep) {
        self.output_blocks += step.added;
        let own = load.own_blocks as f64;
        let before = (own + step.before as f64) * (1.0 - step.from);
        let after = (own + (step.before + step.added) as f64) * (1.0 - step.to);
        self.discount += after - before;
        if !step.decays {
            return;
        }
        // Its exclusive prompt suffix: the trailing blocks no other request holds.
        for h in load.blocks.iter().rev() {
            if self.shared.get(h) != Some(&1) {
                break;
            }
            let old = self.decayed.insert(*h, step.to).unwrap_or(1.0);
            self.discount += old - step.to;
        }
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
            Some(first)
                if self.firsts[first_bucket(*first)] > 0 && self.shared.contains_key(first) =>
            {
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
        if let Some(&first) = load.blocks.first() {
            self.firsts[first_bucket(first)] += 1;
            self.first_mask |= 1 << first_bucket(first);
        }
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
        if let Some(&first) = load.blocks.first() {
            let count = &mut self.firsts[first_bucket(first)];
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.first_mask &= !(1 << first_bucket(first));
            }
        }
        if let Some(o) = &load.output {
            self.output_blocks = self.output_blocks.saturating_sub(o.blocks());
            self.discount -= (load.own_blocks + o.blocks()) as f64 * (1.0 - o.weight());
        }
        for h in &load.blocks {
            if let Some(n) = self.shared.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.shared.remove(h);
                    if let Some(w) = self.decayed.remove(h) {
                        self.discount -= 1.0 - w;
                    }
                }
            }
        }
        if self.requests == 0 || self.discount.abs() < 1e-9 {
            // Nothing decayed is left: drop the rounding the sums gathered.
            self.discount = 0.0;
        }
    }

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

    /// The numbers [`LoadSummary::terms_apart`] reads.
    pub fn summary(&self) -> LoadSummary {
        LoadSummary {
            prefill_tokens: self.prefill_tokens,
            decode_blocks: self.decode_blocks(),
            active_requests: self.requests,
            prefilling_requests: self.prefilling,
            first_buckets: self.first_mask,
        }
    }

    /// Whether nothing is accounted (every request released).
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
    fn the_first_block_buckets_answer_as_the_map_does() {
        // Uniform chained hashes (as the router's), prompts from 40 first blocks, started and
        // finished in a pseudo-random order: new_blocks must equal the map's own answer.
        let chain = |first: u64, len: usize| -> Vec<u64> {
            let mut h = kvroute_protocol::mix64(first, 7);
            (0..len)
                .map(|i| {
                    h = kvroute_protocol::mix64(h, i as u64 % 3);
                    h
                })
                .collect()
        };
        let load = |first: u64, len: usize| RequestLoad {
            prefill_tokens: 0,
            blocks: chain(first, len),
            own_blocks: 0,
            output: None,
        };
        let unfiltered = |r: &RankLoad, q: &RequestLoad| -> u64 {
            let held = match q.blocks.first() {
                Some(f) if r.shared.contains_key(f) => {
                    q.blocks.partition_point(|h| r.shared.contains_key(h))
                }
                _ => 0,
            };
            (q.blocks.len() - held) as u64
        };
        let mut r = RankLoad::default();
        let mut active: Vec<RequestLoad> = Vec::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let (mut skipped, mut answered) = (0, 0);
        for step in 0..3000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x.is_multiple_of(3) && !active.is_empty() {
                let gone = active.swap_remove((x >> 8) as usize % active.len());
                r.finish(&gone, false);
            } else {
                let l = load(x % 40, 4 + (x >> 20) as usize % 12);
                r.start(&l);
                active.push(l);
            }
            for first in 0..40 {
                let q = load(first, 16);
                assert_eq!(
                    r.new_blocks(&q),
                    unfiltered(&r, &q),
                    "step {step} first {first}"
                );
                skipped += usize::from(r.firsts[first_bucket(q.blocks[0])] == 0);
                // The summary answers exactly when the bucket is empty, as the lock would.
                let apart = r.summary().terms_apart(&q, 0.5);
                let locked = r.kv_terms(crate::Overlap::default(), &q, 0.5);
                match apart {
                    Some(terms) => assert_eq!(terms, locked, "step {step} first {first}"),
                    None => assert!(r.firsts[first_bucket(q.blocks[0])] > 0),
                }
                answered += usize::from(apart.is_some());
                let counted = (r.firsts.iter().enumerate())
                    .filter(|(_, &n)| n > 0)
                    .fold(0u64, |mask, (b, _)| mask | 1 << b);
                assert_eq!(r.summary().first_buckets, counted);
            }
        }
        assert!(skipped > 0, "some answers came from an empty bucket");
        assert_eq!(
            answered, skipped,
            "the summary answers for every empty bucket"
        );
        for l in active.drain(..) {
            r.finish(&l, false);
        }
        assert!(r.firsts.iter().all(|&n| n == 0) && r.shared.is_empty());
        assert_eq!(r.first_mask, 0);
    }

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
            output: None,
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
            output: None,
        };
        let b = RequestLoad {
            prefill_tokens: 40,
            blocks: vec![1, 2, 9],
            own_blocks: 1,
            output: None,
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

    /// A prompt of 3 full blocks and 5 tokens (53 tokens in blocks of 16).
    fn prompt(blocks: Vec<u64>) -> RequestLoad {
        RequestLoad::for_prompt(blocks, 53, 0, 16)
    }

    #[test]
    fn output_blocks_are_counted_as_generated_and_released() {
        let mut r = RankLoad::default();
        let mut a = prompt(vec![1, 2, 3]).tracking_output(53, 16, None);
        r.start(&a);
        assert_eq!(r.decode_blocks(), 4, "3 full blocks and the partial one");
        r.output_tokens(&mut a, 11);
        assert_eq!(r.decode_blocks(), 4, "64 tokens fill the 4th block");
        r.output_tokens(&mut a, 1);
        assert_eq!((r.decode_blocks(), r.output_blocks()), (5, 1));
        r.output_tokens(&mut a, 32);
        assert_eq!((r.decode_blocks(), r.output_blocks()), (7, 3));
        // An untracked request adds nothing as it generates.
        let mut b = prompt(vec![1, 2, 9]);
        r.start(&b);
        r.output_tokens(&mut b, 100);
        assert_eq!(
            r.decode_blocks(),
            9,
            "b adds its block 9 and its partial one"
        );
        r.finish(&a, true);
        assert_eq!((r.decode_blocks(), r.output_blocks()), (4, 0));
        r.finish(&b, true);
        assert!(r.is_idle());
    }

    #[test]
    fn an_expected_length_decays_only_the_exclusive_blocks() {
        let mut r = RankLoad::default();
        // Expects 16 tokens: when the 12th starts a new block, 1/4 of them are to come.
        let mut a = prompt(vec![1, 2, 3]).tracking_output(53, 16, Some(16));
        let b = prompt(vec![1, 2, 9]);
        r.start(&a);
        r.start(&b);
        r.output_tokens(&mut a, 12);
        // Blocks 1, 2, 9 and b's partial one weigh 1; a's block 3, its partial block and its
        // output block weigh 1/4 each.
        assert_eq!(r.decode_weight(), 4.0 + 3.0 * 0.25);
        assert_eq!(r.decode_blocks(), 5);
        // A later request sharing the decayed block 3 does not restore it (Dynamo's tree).
        let c = prompt(vec![1, 2, 3]);
        r.start(&c);
        assert_eq!(
            r.decode_weight(),
            4.0 + 3.0 * 0.25 + 1.0,
            "c's partial block"
        );
        r.finish(&a, true);
        assert_eq!(
            r.decode_weight(),
            5.0 + 0.25,
            "block 3 keeps its weight while held"
        );
        r.finish(&b, true);
        r.finish(&c, true);
        assert!(r.is_idle());
        assert_eq!(r.decode_weight(), 0.0);
    }

    #[test]
    fn decay_follows_the_request_to_zero() {
        let mut r = RankLoad::default();
        let mut a = prompt(vec![1, 2, 3]).tracking_output(53, 16, Some(44));
        r.start(&a);
        r.output_tokens(&mut a, 12);
        assert_eq!(r.decode_weight(), 5.0 * (1.0 - 12.0 / 44.0));
        r.output_tokens(&mut a, 32);
        // 44 of 44 tokens: every block is the request's own and weighs nothing.
        assert_eq!(r.decode_weight(), 0.0);
        assert_eq!(r.output_blocks(), 3);
        r.finish(&a, true);
        assert!(r.is_idle());
    }
}
