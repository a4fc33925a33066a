//! Virtual-time cluster simulation: a trace through the real routing core (any policy) and N
//! copies of kvroute-sim's engine core, in one process, deterministic for a seed.
//!
//! Events are request arrivals (at their trace times, scaled), engine step ends and KV
//! transfers landing. At an arrival the request is tokenised (trace hash ids -> token blocks),
//! hashed into the router's blocks, scored by the policy over the engines (KV overlap from an
//! index fed by the engines' own cache events, the router's load accounting, the engines'
//! stats as their `/metrics` would show them) and queued on the chosen engine. An idle engine
//! with work starts a step; its outputs (tokens, cache events) take effect when the step ends.
//!
//! **Prefill/decode disaggregation** ([`Cluster::Disaggregated`]) follows the gateway's flow
//! (see the `route` module): a request is either decode-only (its decode engine computes the
//! prompt) or split: a prefill (`max_tokens` 1) on a prefill engine, and when its token
//! appears, the request on the decode engine with [`PromptKv::Transfer`]. The prefill half's
//! load is counted from the arrival to the prefill's end; the decode half's from the prefill's
//! end to the answer's. A split request's TTFT is what its client sees: from the arrival to
//! the decode engine's first token (prefill, transfer, first decode step); its cache hits are
//! the prefill engine's (the decode engine's only shorten the transfer).
//!
//! [`reference`] is the yardstick printed beside the policies: each request alone on an idle
//! engine of the same configuration, with what one LRU cache of the cluster's whole capacity
//! would hold (see the `reference` module).

pub mod reference;
mod route;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvroute_core::{PolicyConfig, PolicyKind, RequestLoad};
use kvroute_index::{
    block_hashes, EngineHash, KvIndex, KvIndexer, ReplicaId, StorageTier, StoredBlocks,
};
use kvroute_sim::engine::{
    CacheEvent, EngineConfig, EngineCore, EngineRequest, PromptKv, RequestId, StepOutput,
};
use rand::SeedableRng;
use serde::Serialize;

use crate::trace::{prompt_tokens, TraceRequest};
pub use reference::{reference, Reference};
use route::{Arrival, Placement, Router};

/// What a simulation runs.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub cluster: Cluster,
    /// Every engine's configuration (prefill and decode engines alike).
    pub engine: EngineConfig,
    /// Tokens per trace hash id.
    pub hash_block: usize,
    pub vocab: u32,
    /// Divides inter-arrival times (2 = twice the trace's rate).
    pub rate_scale: f64,
    pub seed: u64,
}

/// The engines and how requests are routed over them.
#[derive(Debug, Clone)]
// One value per simulation run, never in a collection on a hot path: the size gap between
// one policy's parameters and a P/D cluster's two is not worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Cluster {
    /// `workers` engines that each prefill and decode, under one policy.
    Aggregated {
        workers: usize,
        policy: PolicyKind,
        policy_config: PolicyConfig,
    },
    /// Prefill engines and decode engines (see the module docs).
    Disaggregated(PdCluster),
}

/// A prefill/decode cluster, with the gateway's knobs.
#[derive(Debug, Clone)]
pub struct PdCluster {
    pub prefill_workers: usize,
    pub decode_workers: usize,
    pub prefill_policy: PolicyKind,
    pub prefill_config: PolicyConfig,
    pub decode_policy: PolicyKind,
    pub decode_config: PolicyConfig,
    /// Decode-only below this many prompt tokens uncached on the decode engine (0: always
    /// split).
    pub min_uncached_tokens: u64,
}

impl PdCluster {
    /// The gateway's defaults: kv_aware on both halves, the decode half as
    /// [`decode_policy`](kvroute_core::policy::decode_policy) makes it from `decode` (by
    /// default scoring load only), always split; `base` is the parameters given.
    pub fn new(
        prefill_workers: usize,
        decode_workers: usize,
        base: &PolicyConfig,
        decode: Option<PolicyKind>,
    ) -> Self {
        let (decode_policy, decode_config) = kvroute_core::policy::decode_policy(decode, base);
        Self {
            prefill_workers,
            decode_workers,
            prefill_policy: PolicyKind::KvAware,
            prefill_config: base.clone(),
            decode_policy,
            decode_config,
            min_uncached_tokens: 0,
        }
    }
}

impl Cluster {
    /// How many engines it has (as the router builds them: at least one per pool).
    pub fn engines(&self) -> usize {
        match self {
            Cluster::Aggregated { workers, .. } => (*workers).max(1),
            Cluster::Disaggregated(pd) => pd.prefill_workers.max(1) + pd.decode_workers.max(1),
        }
    }

    /// The name of a run, for tables and plots: the policy, or `pd:<prefill>/<decode>` with
    /// the decode-only threshold when set.
    pub fn name(&self) -> String {
        match self {
            Cluster::Aggregated { policy, .. } => policy.name().to_owned(),
            Cluster::Disaggregated(pd) => {
                let mut s = format!("pd:{}/{}", pd.prefill_policy, pd.decode_policy);
                if pd.min_uncached_tokens > 0 {
                    s.push_str(&format!(",min{}", pd.min_uncached_tokens));
                }
                s
            }
        }
    }
}

/// p50, p90, p99 in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

/// Nearest-rank percentiles of `v` (sorted in place).
pub fn percentiles(v: &mut [f64]) -> Percentiles {
    if v.is_empty() {
        return Percentiles {
            p50: 0.0,
            p90: 0.0,
            p99: 0.0,
        };
    }
    v.sort_by(f64::total_cmp);
    Percentiles {
        p50: nearest_rank(v, 0.5),
        p90: nearest_rank(v, 0.9),
        p99: nearest_rank(v, 0.99),
    }
}

/// The nearest-rank `p` quantile of `sorted` (not empty).
pub fn nearest_rank(sorted: &[f64], p: f64) -> f64 {
    sorted[((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// One policy's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyResult {
    pub policy: String,
    pub requests: usize,
    pub rejected: usize,
    pub ttft_ms: Percentiles,
    /// Every served request's TTFT in milliseconds, ascending (for the plot; not in the JSON).
    #[serde(skip)]
    pub ttft_sorted_ms: Vec<f64>,
    pub e2e_ms: Percentiles,
    pub throughput_rps: f64,
    pub output_tokens_per_s: f64,
    /// Prompt tokens served from the prefix caches of the engines that computed the prompts,
    /// over all prompt tokens.
    pub hit_share: f64,
    /// Requests answered by each engine (disaggregated: each decode engine).
    pub requests_per_worker: Vec<usize>,
    pub preemptions: u64,
    /// A disaggregated cluster's figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pd: Option<PdResult>,
}

/// What each half of a disaggregated cluster did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdResult {
    pub prefill_policy: String,
    pub decode_policy: String,
    pub min_uncached_tokens: u64,
    /// Prefills (split requests) per prefill engine.
    pub prefill_requests_per_worker: Vec<usize>,
    /// Requests per decode engine, split or decode-only.
    pub decode_requests_per_worker: Vec<usize>,
    /// Requests whose decode engine computed the prompt itself.
    pub decode_only: usize,
    /// Requests prefilled on a prefill engine and decoded after a KV transfer.
    pub split: usize,
    /// Tokens of KV the decode engines received.
    pub kv_transfer_tokens: u64,
}

/// A request on an engine.
struct Live {
    arrival: Duration,
    load: RequestLoad,
    role: Role,
}

enum Role {
    /// Its tokens are the client's; `computes_prompt` says whether its engine's cache hits
    /// count (not when the prompt's KV was received).
    Answer {
        answered: bool,
        computes_prompt: bool,
    },
    /// A split request's prefill: when it ends the request goes to `decode`.
    Prefill {
        decode: usize,
        decode_load: RequestLoad,
        request: EngineRequest,
    },
}

/// Characters standing for tokens, for the text-keyed policies (cache_aware, prefix_hash).
fn text_of(tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|&t| char::from_u32(0x4E00 + t % 20000).unwrap_or('?'))
        .collect()
}

fn apply_events(index: &mut KvIndex, replica: ReplicaId, events: &[CacheEvent], block_size: usize) {
    for e in events {
        match e {
            CacheEvent::Stored {
                hashes,
                parent,
                token_ids,
            } => {
                let engine_hashes: Vec<EngineHash> =
                    hashes.iter().map(|&h| EngineHash(h)).collect();
                let _ = index.apply_stored(
                    replica,
                    &StoredBlocks {
                        parent: parent.map(EngineHash),
                        engine_hashes: &engine_hashes,
                        token_ids,
                        block_size,
                        tier: StorageTier::Device,
                        salt: 0,
                    },
                );
            }
            CacheEvent::Removed { hash } => {
                index.apply_removed(replica, StorageTier::Device, &[EngineHash(*hash)])
            }
            CacheEvent::Cleared => index.clear_replica(replica),
        }
    }
}

/// Running totals.
#[derive(Default)]
struct Tally {
    ttft: Vec<f64>,
    e2e: Vec<f64>,
    prompt: u64,
    cached: u64,
    output: u64,
    rejected: usize,
    /// Requests answered per engine (all engines; the decode ones are reported).
    answered_by: Vec<usize>,
    prefills_on: Vec<usize>,
    tokens_by: Vec<u64>,
    decode_only: usize,
    split: usize,
}

/// Runs `trace` through a cluster (see the module docs).
pub fn simulate(trace: &[TraceRequest], cfg: &SimConfig) -> PolicyResult {
    run(trace, cfg).result
}

/// A finished run, with its engines (the tests read them).
#[cfg_attr(not(test), allow(dead_code))]
struct Run {
    result: PolicyResult,
    engines: Vec<EngineCore>,
    /// Tokens each engine produced (a prefill's one included).
    tokens_by: Vec<u64>,
}

fn run(trace: &[TraceRequest], cfg: &SimConfig) -> Run {
    let bs = cfg.engine.block_size;
    let mut router = Router::new(&cfg.cluster, bs, cfg.engine.num_gpu_blocks);
    let n = router.engines();
    let mut engines: Vec<EngineCore> = (0..n)
        .map(|i| {
            EngineCore::new(EngineConfig {
                seed: cfg.seed.wrapping_add(i as u64),
                ..cfg.engine.clone()
            })
        })
        .collect();
    let mut pending: Vec<Option<(Duration, StepOutput)>> = (0..n).map(|_| None).collect();
    let mut index = KvIndex::new(bs);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(cfg.seed);
    let base = Instant::now();
    // Keyed by engine: a split request has the same id on both of its engines.
    let mut live: HashMap<(usize, RequestId), Live> = HashMap::new();
    let mut tally = Tally {
        answered_by: vec![0; n],
        prefills_on: vec![0; n],
        tokens_by: vec![0; n],
        ..Tally::default()
    };
    let mut next = 0usize;
    let mut now = Duration::ZERO;
    let arrival_of =
        |r: &TraceRequest| Duration::from_secs_f64(r.timestamp as f64 / 1000.0 / cfg.rate_scale);

    loop {
        let t_arrival = trace.get(next).map(arrival_of);
        let t_engine = pending.iter().flatten().map(|(end, _)| *end).min();
        // An idle engine waiting only for KV wakes when the first transfer lands.
        let t_transfer = engines
            .iter()
            .zip(&pending)
            .filter(|(_, slot)| slot.is_none())
            .filter_map(|(e, _)| e.next_transfer_done())
            .min();
        now = match [t_arrival, t_engine, t_transfer]
            .into_iter()
            .flatten()
            .min()
        {
            Some(t) => t,
            None => break,
        };
        // Steps ending now take effect first.
        for (e, slot) in pending.iter_mut().enumerate() {
            if slot.as_ref().is_none_or(|(end, _)| *end > now) {
                continue;
            }
            let (end, out) = slot.take().expect("checked");
            apply_events(&mut index, ReplicaId(e as u32), &out.events, bs);
            tally.tokens_by[e] += out.tokens.len() as u64;
            for t in &out.tokens {
                let key = (e, t.id);
                let Some(l) = live.get_mut(&key) else {
                    continue;
                };
                match &mut l.role {
                    Role::Answer {
                        answered,
                        computes_prompt,
                    } => {
                        if !*answered {
                            *answered = true;
                            tally.ttft.push((end - l.arrival).as_secs_f64() * 1e3);
                            if *computes_prompt {
                                tally.cached += t.cached_tokens as u64;
                            }
                            router.loads[e].first_token(&l.load);
                        }
                        tally.output += 1;
                        if t.finished {
                            let l = live.remove(&key).expect("live");
                            tally.e2e.push((end - l.arrival).as_secs_f64() * 1e3);
                            router.loads[e].finish(&l.load, false);
                        }
                    }
                    Role::Prefill { .. } => {
                        // One token: the prefill is done; the decode half goes out.
                        tally.cached += t.cached_tokens as u64;
                        let l = live.remove(&key).expect("live");
                        router.loads[e].first_token(&l.load);
                        router.loads[e].finish(&l.load, false);
                        let Role::Prefill {
                            decode,
                            decode_load,
                            request,
                        } = l.role
                        else {
                            unreachable!("matched above");
                        };
                        let id = request.id;
                        if engines[decode]
                            .add_request_from(request, PromptKv::Transfer)
                            .is_err()
                        {
                            tally.rejected += 1;
                            continue;
                        }
                        router.loads[decode].start(&decode_load);
                        tally.answered_by[decode] += 1;
                        live.insert(
                            (decode, id),
                            Live {
                                arrival: l.arrival,
                                load: decode_load,
                                role: Role::Answer {
                                    answered: false,
                                    computes_prompt: false,
                                },
                            },
                        );
                    }
                }
            }
        }
        // Arrivals now.
        while let Some(r) = trace.get(next).filter(|r| arrival_of(r) <= now) {
            let id = RequestId(next as u64);
            next += 1;
            let tokens = prompt_tokens(r, cfg.hash_block, cfg.vocab);
            let hashes = block_hashes(&tokens, bs, 0);
            let scores = if router.needs_overlaps() {
                index.find_matches(&hashes)
            } else {
                Default::default()
            };
            let text = if router.needs_text() {
                text_of(&tokens)
            } else {
                String::new()
            };
            let placement = router.place(
                &Arrival {
                    tokens: &tokens,
                    hashes: &hashes,
                    text: &text,
                    now: base + now,
                },
                &scores,
                &engines,
                &mut rng,
            );
            tally.prompt += tokens.len() as u64;
            let request = EngineRequest {
                id,
                prompt: tokens,
                max_tokens: r.output_length.max(1),
                salt: 0,
            };
            let (engine, load, role) = match placement {
                Placement::Whole { engine, load } => {
                    let role = Role::Answer {
                        answered: false,
                        computes_prompt: true,
                    };
                    if engines[engine].add_request(request).is_err() {
                        tally.rejected += 1;
                        continue;
                    }
                    tally.answered_by[engine] += 1;
                    if router.halves().is_some() {
                        tally.decode_only += 1;
                    }
                    (engine, load, role)
                }
                Placement::Split {
                    prefill,
                    prefill_load,
                    decode,
                    decode_load,
                } => {
                    let prefill_request = EngineRequest {
                        max_tokens: 1,
                        ..request.clone()
                    };
                    if engines[prefill].add_request(prefill_request).is_err() {
                        tally.rejected += 1;
                        continue;
                    }
                    tally.prefills_on[prefill] += 1;
                    tally.split += 1;
                    let role = Role::Prefill {
                        decode,
                        decode_load,
                        request,
                    };
                    (prefill, prefill_load, role)
                }
            };
            router.loads[engine].start(&load);
            live.insert(
                (engine, id),
                Live {
                    arrival: now,
                    load,
                    role,
                },
            );
        }
        // Idle engines with work start a step; one that only admits or lands KV computes
        // nothing, and its cache events take effect at once.
        for (e, (slot, engine)) in pending.iter_mut().zip(engines.iter_mut()).enumerate() {
            if slot.is_none() && engine.has_work() {
                let out = engine.step(now);
                if out.is_idle() {
                    apply_events(&mut index, ReplicaId(e as u32), &out.events, bs);
                } else {
                    *slot = Some((now + out.duration, out));
                }
            }
        }
    }
    let makespan = now.as_secs_f64().max(1e-9);
    let ttft_ms = percentiles(&mut tally.ttft);
    let pd = match (&cfg.cluster, router.halves()) {
        (Cluster::Disaggregated(c), Some((prefill, decode))) => Some(PdResult {
            prefill_policy: c.prefill_policy.name().to_owned(),
            decode_policy: c.decode_policy.name().to_owned(),
            min_uncached_tokens: c.min_uncached_tokens,
            prefill_requests_per_worker: tally.prefills_on[prefill].to_vec(),
            decode_requests_per_worker: tally.answered_by[decode.clone()].to_vec(),
            decode_only: tally.decode_only,
            split: tally.split,
            kv_transfer_tokens: engines[decode]
                .iter()
                .map(|e| e.stats().kv_transfer_tokens_received)
                .sum(),
        }),
        _ => None,
    };
    let requests_per_worker = match &pd {
        Some(pd) => pd.decode_requests_per_worker.clone(),
        None => tally.answered_by,
    };
    let result = PolicyResult {
        policy: cfg.cluster.name(),
        requests: requests_per_worker.iter().sum(),
        rejected: tally.rejected,
        ttft_ms,
        ttft_sorted_ms: tally.ttft,
        e2e_ms: percentiles(&mut tally.e2e),
        throughput_rps: tally.e2e.len() as f64 / makespan,
        output_tokens_per_s: tally.output as f64 / makespan,
        hit_share: tally.cached as f64 / tally.prompt.max(1) as f64,
        requests_per_worker,
        preemptions: engines.iter().map(|e| e.stats().preemptions).sum(),
        pd,
    };
    Run {
        result,
        engines,
        tokens_by: tally.tokens_by,
    }
}

#[cfg(test)]
mod tests;
