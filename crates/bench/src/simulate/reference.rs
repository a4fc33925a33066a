//! The pooled-LRU reference: an estimate of ideal routing, printed beside the policies.
//!
//! Every request finds, as its cached prefix, what **one LRU cache of the cluster's whole
//! capacity** would hold at its arrival, and runs **alone on an idle engine**:
//!
//! - The pooled cache counts in the trace's own hash blocks (`hash_block` tokens, 512 for the
//!   Mooncake trace): it holds `engines x num_gpu_blocks x block_size / hash_block` of them,
//!   one copy of each. Requests pass through it in arrival order. At an arrival, its leading
//!   hash ids are looked up: a cached block is reused as far as an earlier request had it (a
//!   partial last block counts its earlier length) and the reuse stops after a block reused
//!   short or missing, as [`crate::trace::hit_bound`] counts. Then every hash id of the request
//!   is used, first to last (its first block is least recently used), and the least recently
//!   used blocks are evicted down to the capacity. This is the computation behind the table of
//!   `shared/data/README.md` (24.1% of prompt tokens for 8 x 262,144 tokens).
//! - The engine is the simulated workers' own core, configuration and timing model, run for
//!   that one request: a fresh cache that holds exactly the reused prefix (a warm-up request
//!   of those tokens computes it), then the request. Its TTFT and E2E are the steps' times
//!   from its admission; its cache hit is what the engine reports (the reused prefix's full
//!   engine blocks, leaving one prompt token to compute), so the hit share is measured as the
//!   policies' is: the engines' cached prompt tokens over all prompt tokens.
//!
//! It is not a strict bound: a router could beat it on a request whose blocks one LRU cache
//! evicted but a replica kept, and an engine may batch several prefills at once. It is the
//! yardstick for what routing alone can still gain.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use kvroute_sim::engine::{AddError, EngineConfig, EngineCore, EngineRequest, RequestId};
use serde::Serialize;

use super::{percentiles, Percentiles, SimConfig};
use crate::trace::{prompt_tokens, TraceRequest};

/// The row's name in tables and plots.
pub const NAME: &str = "pooled-LRU reference";

/// One LRU cache of hash blocks (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct PooledLru {
    capacity: usize,
    clock: u64,
    /// Hash id -> (the most tokens of it seen, when it was last used).
    blocks: HashMap<u64, (usize, u64)>,
    /// Last use -> hash id, oldest first.
    by_use: BTreeMap<u64, u64>,
}

impl PooledLru {
    /// An empty cache of `capacity` hash blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The prompt tokens of `r` the cache holds at its arrival (`hash_block` tokens per id);
    /// then `r`'s blocks are used and the cache evicts down to its capacity.
    pub fn arrive(&mut self, r: &TraceRequest, hash_block: usize) -> usize {
        let len_of = |i: usize| hash_block.min(r.input_length.saturating_sub(i * hash_block));
        let mut reused = 0;
        for (i, id) in r.hash_ids.iter().enumerate() {
            let (len, had) = (len_of(i), self.blocks.get(id).map_or(0, |b| b.0));
            reused += len.min(had);
            if had < len {
                break;
            }
        }
        for (i, &id) in r.hash_ids.iter().enumerate() {
            let len = len_of(i);
            if len == 0 {
                break;
            }
            self.clock += 1;
            let entry = self.blocks.entry(id).or_insert((0, 0));
            if entry.1 > 0 {
                self.by_use.remove(&entry.1);
            }
            *entry = (entry.0.max(len), self.clock);
            self.by_use.insert(self.clock, id);
            while self.blocks.len() > self.capacity {
                let (_, oldest) = self.by_use.pop_first().expect("a block per entry");
                self.blocks.remove(&oldest);
            }
        }
        reused
    }
}

/// The reference's figures, beside the policies' (`PolicyResult`'s fields of the same names).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reference {
    pub name: String,
    /// The pooled cache's capacity, in the trace's hash blocks.
    pub capacity_hash_blocks: usize,
    pub hash_block: usize,
    pub requests: usize,
    pub rejected: usize,
    pub ttft_ms: Percentiles,
    /// Every served request's TTFT in milliseconds, ascending (for the plot; not in the JSON).
    #[serde(skip)]
    pub ttft_sorted_ms: Vec<f64>,
    /// Alone on an idle engine: the prefill, then `max_tokens` decode steps.
    pub e2e_ms: Percentiles,
    /// Prompt tokens the engine served from its cache, over all prompt tokens.
    pub hit_share: f64,
    /// Prompt tokens the pooled cache held, over all prompt tokens (in hash blocks, before
    /// the engine's block rounding).
    pub pooled_share: f64,
}

/// One request alone on an idle engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Alone {
    pub ttft: Duration,
    pub e2e: Duration,
    /// Prompt tokens the engine found cached.
    pub cached_tokens: usize,
}

/// The pooled cache's capacity for `cfg`'s cluster, in hash blocks.
pub fn capacity_hash_blocks(cfg: &SimConfig) -> usize {
    cfg.cluster.engines() * cfg.engine.num_gpu_blocks * cfg.engine.block_size
        / cfg.hash_block.max(1)
}

/// The pooled-LRU reference for `trace` on `cfg`'s cluster and engines (see the module docs);
/// `cfg.rate_scale` plays no part (each request runs alone).
pub fn reference(trace: &[TraceRequest], cfg: &SimConfig) -> Reference {
    let capacity = capacity_hash_blocks(cfg);
    let mut prompt = 0u64;
    let mut pooled = 0u64;
    let runs = run(trace, cfg, capacity, |reused, len| {
        pooled += reused as u64;
        prompt += len as u64;
    });
    let (mut ttft, mut e2e, mut cached) = (Vec::new(), Vec::new(), 0u64);
    for a in runs.iter().flatten() {
        ttft.push(a.ttft.as_secs_f64() * 1e3);
        e2e.push(a.e2e.as_secs_f64() * 1e3);
        cached += a.cached_tokens as u64;
    }
    let ttft_ms = percentiles(&mut ttft);
    Reference {
        name: NAME.to_owned(),
        capacity_hash_blocks: capacity,
        hash_block: cfg.hash_block,
        requests: e2e.len(),
        rejected: runs.len() - e2e.len(),
        ttft_ms,
        ttft_sorted_ms: ttft,
        e2e_ms: percentiles(&mut e2e),
        hit_share: cached as f64 / prompt.max(1) as f64,
        pooled_share: pooled as f64 / prompt.max(1) as f64,
    }
}

/// Each request of `trace` alone on an idle engine with the prefix a pooled LRU cache of
/// `capacity` hash blocks holds (None: the engine rejected it); `seen` gets each request's
/// pooled-cache tokens and prompt length.
pub(crate) fn run(
    trace: &[TraceRequest],
    cfg: &SimConfig,
    capacity: usize,
    mut seen: impl FnMut(usize, usize),
) -> Vec<Option<Alone>> {
    let mut lru = PooledLru::new(capacity);
    let mut engine = EngineCore::new(EngineConfig {
        seed: cfg.seed,
        ..cfg.engine.clone()
    });
    trace
        .iter()
        .map(|r| {
            let reused = lru.arrive(r, cfg.hash_block);
            let prompt = prompt_tokens(r, cfg.hash_block, cfg.vocab);
            seen(reused.min(prompt.len()), prompt.len());
            alone(&mut engine, prompt, reused, r.output_length.max(1)).ok()
        })
        .collect()
}

/// Runs `prompt` alone on `engine` (idle, its cache cleared, then holding `prompt[..cached]`).
pub(crate) fn alone(
    engine: &mut EngineCore,
    prompt: Vec<u32>,
    cached: usize,
    max_tokens: usize,
) -> Result<Alone, AddError> {
    let capacity = engine.capacity_tokens();
    if prompt.len() + max_tokens > capacity {
        return Err(AddError::TooLong {
            prompt: prompt.len(),
            max_tokens,
            capacity,
        });
    }
    let cleared = engine.reset_prefix_cache();
    debug_assert!(cleared, "the engine is idle between requests");
    let cached = cached.min(prompt.len());
    if cached >= engine.config().block_size {
        engine.add_request(EngineRequest {
            id: RequestId(0),
            prompt: prompt[..cached].to_vec(),
            max_tokens: 1,
            salt: 0,
            lora: None,
            priority: 0,
        })?;
        drain(engine, |_| {});
    }
    engine.add_request(EngineRequest {
        id: RequestId(1),
        prompt,
        max_tokens,
        salt: 0,
        lora: None,
        priority: 0,
    })?;
    let mut first = None;
    let e2e = drain(engine, |t| {
        first.get_or_insert(t);
    });
    let (ttft, cached_tokens) = first.expect("a request yields a first token");
    Ok(Alone {
        ttft,
        e2e,
        cached_tokens,
    })
}

/// Steps `engine` until it has no work, from time 0; `on_token` gets the time of every token
/// (its step's end) with the request's cached tokens. Returns the last step's end.
fn drain(engine: &mut EngineCore, mut on_token: impl FnMut((Duration, usize))) -> Duration {
    let mut now = Duration::ZERO;
    while engine.has_work() {
        let out = engine.step(now);
        if out.is_idle() {
            debug_assert!(false, "no KV transfer here, so a step always computes");
            break;
        }
        now += out.duration;
        for t in &out.tokens {
            on_token((now, t.cached_tokens));
        }
    }
    engine.take_events();
    now
}

#[cfg(test)]
mod tests {
    use kvroute_core::{PolicyConfig, PolicyKind};

    use super::*;
    use crate::simulate::Cluster;

    fn req(ts: u64, input_length: usize, hash_ids: Vec<u64>) -> TraceRequest {
        TraceRequest {
            timestamp: ts,
            input_length,
            output_length: 4,
            hash_ids,
        }
    }

    /// Hash blocks of 32 tokens, engine blocks of 16: two engine blocks per hash block.
    fn cfg(workers: usize, num_gpu_blocks: usize) -> SimConfig {
        SimConfig {
            cluster: Cluster::Aggregated {
                workers,
                policy: PolicyKind::RoundRobin,
                policy_config: PolicyConfig::default(),
            },
            engine: EngineConfig {
                num_gpu_blocks,
                block_size: 16,
                ..EngineConfig::default()
            },
            hash_block: 32,
            vocab: 32000,
            rate_scale: 1.0,
            seed: 1,
            queue: None,
            tenants: None,
            shapes: Default::default(),
            loras: 0,
            slo: None,
            output_blocks: None,
            sample_ranks: None,
            ttft_oracle: false,
            metrics_refresh: None,
        }
    }

    #[test]
    fn the_pooled_cache_reuses_leading_blocks_and_evicts_the_least_recently_used() {
        let mut lru = PooledLru::new(2);
        assert_eq!(lru.arrive(&req(0, 64, vec![1, 2]), 32), 0);
        // 1 is reused; using 3 evicts 2 (1 was used after it).
        assert_eq!(lru.arrive(&req(1, 64, vec![1, 3]), 32), 32);
        assert_eq!(lru.len(), 2);
        assert_eq!(lru.arrive(&req(2, 64, vec![1, 2]), 32), 32);
        // A cache of no blocks reuses nothing and holds nothing.
        let mut none = PooledLru::new(0);
        assert_eq!(none.arrive(&req(0, 64, vec![1, 2]), 32), 0);
        assert_eq!(none.arrive(&req(1, 64, vec![1, 2]), 32), 0);
        assert!(none.is_empty());
    }

    #[test]
    fn a_partial_block_is_reused_as_far_as_it_was_seen() {
        let mut lru = PooledLru::new(8);
        // A chat: 40 tokens (block 2 holds 8), then 80 extending them.
        assert_eq!(lru.arrive(&req(0, 40, vec![1, 2]), 32), 0);
        assert_eq!(lru.arrive(&req(1, 80, vec![1, 2, 3]), 32), 40);
        assert_eq!(lru.arrive(&req(2, 80, vec![1, 2, 3]), 32), 80);
        // A shorter prompt ending inside a block reuses its part of it.
        assert_eq!(lru.arrive(&req(3, 50, vec![1, 2]), 32), 50);
    }

    /// Three prompts of 64, 64 and 50 tokens: [1, 2], [1, 3], [1, 2].
    fn tiny_trace() -> Vec<TraceRequest> {
        vec![
            req(0, 64, vec![1, 2]),
            req(10, 64, vec![1, 3]),
            req(20, 50, vec![1, 2]),
        ]
    }

    #[test]
    fn the_hit_share_is_the_engines_cached_tokens_over_all_prompt_tokens() {
        // Room for everything (2 workers x 64 blocks x 16 = 64 hash blocks): the second
        // request hits block 1 (32 tokens); the third all 50 tokens of the pooled cache, of
        // which the engine serves its 3 full blocks (48 tokens, leaving one to compute).
        let r = reference(&tiny_trace(), &cfg(2, 64));
        assert_eq!(r.capacity_hash_blocks, 64);
        assert_eq!((r.requests, r.rejected), (3, 0));
        assert!((r.pooled_share - (32.0 + 50.0) / 178.0).abs() < 1e-12);
        assert!((r.hit_share - (32.0 + 48.0) / 178.0).abs() < 1e-12);
        // Room for 2 hash blocks: the second request's block 3 evicts block 2, so the third
        // hits block 1 only.
        let runs = run(&tiny_trace(), &cfg(2, 64), 2, |_, _| {});
        let cached: Vec<usize> = runs.iter().map(|a| a.unwrap().cached_tokens).collect();
        assert_eq!(cached, [0, 32, 32]);
    }

    #[test]
    fn the_reference_is_never_slower_than_an_idle_worker_without_a_cache() {
        let trace: Vec<TraceRequest> = (0..40u64)
            .map(|i| TraceRequest {
                timestamp: i * 5,
                input_length: 200 + (i as usize % 9) * 150,
                output_length: 1 + i as usize % 5,
                hash_ids: vec![i % 3, 10 + i % 4, 100 + i % 7, 1000 + i % 11, 5000 + i],
            })
            .collect();
        let mut c = cfg(4, 256);
        c.hash_block = 512;
        c.engine.max_num_batched_tokens = 512;
        let with = run(&trace, &c, capacity_hash_blocks(&c), |_, _| {});
        let without = run(&trace, &c, 0, |_, _| {});
        let mut hits = 0;
        for (a, b) in with.iter().zip(&without) {
            let (a, b) = (a.unwrap(), b.unwrap());
            assert_eq!(b.cached_tokens, 0);
            assert!(a.ttft <= b.ttft && a.e2e <= b.e2e, "{a:?} vs {b:?}");
            hits += usize::from(a.cached_tokens > 0);
        }
        assert!(hits > 10, "the trace shares prefixes: {hits}");
        let r = reference(&trace, &c);
        assert!(r.ttft_ms.p50 <= percentiles(&mut ms(&without)).p50);
        assert_eq!(reference(&trace, &c), r, "deterministic");
    }

    fn ms(runs: &[Option<Alone>]) -> Vec<f64> {
        runs.iter()
            .flatten()
            .map(|a| a.ttft.as_secs_f64() * 1e3)
            .collect()
    }

    #[test]
    fn a_request_too_long_for_an_engine_is_rejected() {
        // 4 blocks of 16 = 64 tokens per engine: a 64-token prompt and 4 outputs do not fit.
        let r = reference(&tiny_trace(), &cfg(2, 4));
        assert_eq!((r.requests, r.rejected), (1, 2));
    }
}
