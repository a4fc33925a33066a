//! Virtual-time cluster simulation: a trace through the real routing core (any policy) and N
//! copies of kvroute-sim's engine core, in one process, deterministic for a seed.
//!
//! Events are request arrivals (at their trace times, scaled) and engine step ends. At an
//! arrival the request is tokenised (trace hash ids -> token blocks), hashed into the
//! router's blocks, scored by the policy over every engine (KV overlap from an index fed by
//! the engines' own cache events, the router's load accounting, the engines' stats as their
//! `/metrics` would show them) and queued on the chosen engine. An idle engine with work
//! starts a step; its outputs (tokens, cache events) take effect when the step ends.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvroute_core::{
    build_policy, Candidate, EngineLoad, KvTerms, Overlap, PolicyConfig, PolicyKind, RankLoad,
    RequestLoad, RouteRequest,
};
use kvroute_index::{
    block_hashes, EngineHash, KvIndex, KvIndexer, ReplicaId, StorageTier, StoredBlocks,
};
use kvroute_protocol::WorkerId;
use kvroute_sim::engine::{
    CacheEvent, EngineConfig, EngineCore, EngineRequest, RequestId, StepOutput,
};
use rand::SeedableRng;
use serde::Serialize;

use crate::trace::{prompt_tokens, TraceRequest};

/// What a simulation runs.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub workers: usize,
    pub engine: EngineConfig,
    pub policy: PolicyKind,
    pub policy_config: PolicyConfig,
    /// Tokens per trace hash id.
    pub hash_block: usize,
    pub vocab: u32,
    /// Divides inter-arrival times (2 = twice the trace's rate).
    pub rate_scale: f64,
    pub seed: u64,
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
    let at = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Percentiles {
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
    }
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
    /// Prompt tokens served from the engines' prefix caches over all prompt tokens.
    pub hit_share: f64,
    pub requests_per_worker: Vec<usize>,
    pub preemptions: u64,
}

struct Live {
    engine: usize,
    arrival: Duration,
    first: Option<Duration>,
    load: RequestLoad,
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

/// Runs `trace` through a cluster (see the module docs).
pub fn simulate(trace: &[TraceRequest], cfg: &SimConfig) -> PolicyResult {
    let n = cfg.workers.max(1);
    let bs = cfg.engine.block_size;
    let mut engines: Vec<EngineCore> = (0..n)
        .map(|i| {
            EngineCore::new(EngineConfig {
                seed: cfg.seed.wrapping_add(i as u64),
                ..cfg.engine.clone()
            })
        })
        .collect();
    let mut pending: Vec<Option<(Duration, StepOutput)>> = (0..n).map(|_| None).collect();
    let ids: Vec<WorkerId> = (0..n).map(|i| WorkerId::new(format!("w{i}"))).collect();
    let mut loads: Vec<RankLoad> = vec![RankLoad::default(); n];
    let mut index = KvIndex::new(bs);
    let policy = build_policy(cfg.policy, &cfg.policy_config);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(cfg.seed);
    let base = Instant::now();
    let mut live: HashMap<RequestId, Live> = HashMap::new();
    let (mut ttft, mut e2e) = (Vec::new(), Vec::new());
    let (mut prompt_total, mut cached_total, mut output_total) = (0u64, 0u64, 0u64);
    let mut per_worker = vec![0usize; n];
    let mut rejected = 0;
    let mut next = 0usize;
    let mut now = Duration::ZERO;
    let arrival_of =
        |r: &TraceRequest| Duration::from_secs_f64(r.timestamp as f64 / 1000.0 / cfg.rate_scale);

    loop {
        let t_arrival = trace.get(next).map(arrival_of);
        let t_engine = pending.iter().flatten().map(|(end, _)| *end).min();
        now = match (t_arrival, t_engine) {
            (None, None) => break,
            (Some(a), Some(e)) => a.min(e),
            (Some(a), None) => a,
            (None, Some(e)) => e,
        };
        // Steps ending now take effect first.
        for (e, slot) in pending.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(|(end, _)| *end <= now) {
                let (end, out) = slot.take().expect("checked");
                apply_events(&mut index, ReplicaId(e as u32), &out.events, bs);
                for t in &out.tokens {
                    let Some(l) = live.get_mut(&t.id) else {
                        continue;
                    };
                    if l.first.is_none() {
                        l.first = Some(end);
                        ttft.push((end - l.arrival).as_secs_f64() * 1e3);
                        cached_total += t.cached_tokens as u64;
                        loads[l.engine].first_token(&l.load);
                    }
                    output_total += 1;
                    if t.finished {
                        let l = live.remove(&t.id).expect("live");
                        e2e.push((end - l.arrival).as_secs_f64() * 1e3);
                        loads[l.engine].finish(&l.load, false);
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
            let scores = if cfg.policy == PolicyKind::KvAware {
                index.find_matches(&hashes)
            } else {
                Default::default()
            };
            let text = if matches!(
                cfg.policy,
                PolicyKind::CacheAware
                    | PolicyKind::PrefixHash
                    | PolicyKind::ConsistentHash
                    | PolicyKind::RendezvousHash
            ) {
                text_of(&tokens)
            } else {
                String::new()
            };
            let request_load = RequestLoad {
                prefill_tokens: 0,
                blocks: hashes.iter().map(|h| h.0).collect(),
                own_blocks: u64::from(!tokens.len().is_multiple_of(bs)),
            };
            let cap = ((tokens.len().saturating_sub(1)) / bs) as u32;
            let candidates: Vec<Candidate<'_>> = (0..n)
                .map(|e| {
                    let s = engines[e].stats();
                    let device = scores.get(ReplicaId(e as u32)).device.min(cap);
                    Candidate {
                        worker: &ids[e],
                        dp_rank: None,
                        in_flight: loads[e].active_requests(),
                        kv: KvTerms {
                            overlap: Overlap {
                                device,
                                ..Overlap::default()
                            },
                            prefill_tokens: loads[e].prefill_tokens(),
                            decode_blocks: loads[e].decode_blocks(),
                            new_blocks: loads[e].new_blocks(&request_load),
                            active_requests: loads[e].active_requests(),
                            preferred_taint_weight: 0.0,
                        },
                        engine: EngineLoad {
                            waiting: Some(s.waiting as f64),
                            running: Some(s.running as f64),
                            kv_usage: Some(s.kv_usage),
                            num_gpu_blocks: Some(cfg.engine.num_gpu_blocks as u64),
                        },
                    }
                })
                .collect();
            let request = RouteRequest {
                session_key: None,
                text: &text,
                prompt_tokens: tokens.len(),
                tokens: &tokens,
                block_size: bs,
                has_preferred_taints: false,
                dry_run: false,
                now: base + now,
            };
            let chosen = policy
                .select(&candidates, &request, &mut rng)
                .map_or(0, |d| d.index);
            let device = candidates[chosen].kv.overlap.device as usize;
            drop(candidates);
            let load = RequestLoad {
                prefill_tokens: tokens.len().saturating_sub(device * bs) as u64,
                ..request_load
            };
            prompt_total += tokens.len() as u64;
            let added = engines[chosen].add_request(EngineRequest {
                id,
                prompt: tokens,
                max_tokens: r.output_length.max(1),
                salt: 0,
            });
            if added.is_err() {
                rejected += 1;
                continue;
            }
            loads[chosen].start(&load);
            per_worker[chosen] += 1;
            live.insert(
                id,
                Live {
                    engine: chosen,
                    arrival: now,
                    first: None,
                    load,
                },
            );
        }
        // Idle engines with work start a step.
        for (slot, engine) in pending.iter_mut().zip(engines.iter_mut()) {
            if slot.is_none() && engine.has_work() {
                let out = engine.step(now);
                if !out.is_idle() {
                    *slot = Some((now + out.duration, out));
                }
            }
        }
    }
    let makespan = now.as_secs_f64().max(1e-9);
    let ttft_ms = percentiles(&mut ttft);
    PolicyResult {
        policy: cfg.policy.name().to_owned(),
        requests: per_worker.iter().sum(),
        rejected,
        ttft_ms,
        ttft_sorted_ms: ttft,
        e2e_ms: percentiles(&mut e2e),
        throughput_rps: e2e.len() as f64 / makespan,
        output_tokens_per_s: output_total as f64 / makespan,
        hit_share: cached_total as f64 / prompt_total.max(1) as f64,
        requests_per_worker: per_worker,
        preemptions: engines.iter().map(|e| e.stats().preemptions).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_trace() -> Vec<TraceRequest> {
        (0..120u64)
            .map(|i| TraceRequest {
                timestamp: i * 40,
                input_length: 1500 + (i as usize % 7) * 100,
                output_length: 8,
                hash_ids: vec![i % 5, 100 + i % 3, 1000 + i],
            })
            .collect()
    }

    fn cfg(policy: PolicyKind) -> SimConfig {
        SimConfig {
            workers: 4,
            engine: EngineConfig {
                num_gpu_blocks: 2048,
                ..EngineConfig::default()
            },
            policy,
            policy_config: PolicyConfig::default(),
            hash_block: 512,
            vocab: 32000,
            rate_scale: 1.0,
            seed: 3,
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(
            percentiles(&mut v),
            Percentiles {
                p50: 50.0,
                p90: 90.0,
                p99: 99.0
            }
        );
        assert_eq!(percentiles(&mut [7.0]).p99, 7.0);
        assert_eq!(percentiles(&mut []).p50, 0.0);
    }

    #[test]
    fn a_seed_gives_the_same_run_and_every_request_completes() {
        for policy in [
            PolicyKind::KvAware,
            PolicyKind::RoundRobin,
            PolicyKind::CacheAware,
        ] {
            let a = simulate(&small_trace(), &cfg(policy));
            let b = simulate(&small_trace(), &cfg(policy));
            assert_eq!(a, b, "{policy}");
            assert_eq!(a.requests, 120);
            assert_eq!(a.rejected, 0);
            assert!(a.ttft_ms.p50 > 0.0);
        }
    }

    #[test]
    fn kv_aware_reuses_more_than_round_robin_on_shared_prefixes() {
        let kv = simulate(&small_trace(), &cfg(PolicyKind::KvAware));
        let rr = simulate(&small_trace(), &cfg(PolicyKind::RoundRobin));
        assert!(
            kv.hit_share > rr.hit_share,
            "kv_aware {} vs round_robin {}",
            kv.hit_share,
            rr.hit_share
        );
    }
}
