//! The router's side of a simulated cluster: the policies, the load accounting and where each
//! arriving request goes, as the gateway decides it (`routing::plan` over one worker set;
//! `pd::route` for prefill/decode disaggregation).
//!
//! Disaggregated, the decode engine is chosen first, by the decode policy over the decode
//! engines. When `min_uncached_tokens` > 0 and that engine's cache (as the index sees it)
//! holds all but fewer than `min_uncached_tokens` prompt tokens, the request goes to it alone
//! (decode-only). Otherwise the prefill policy chooses a prefill engine, which computes the
//! prompt (`max_tokens` 1); when that ends the request goes to the decode engine, whose load
//! counts its blocks but no prefill tokens.

use std::borrow::Cow;
use std::ops::Range;
use std::time::Instant;

use kvroute_core::eligibility::retain_fitting;
use kvroute_core::latency::{FittedSpeed, LatencyModel, PrefillFeatures};
use kvroute_core::policy::predict::predict;
use kvroute_core::policy::{sample_ranks, sample_size, SPEED_EVIDENCE};
use kvroute_core::slo::{Predicted, SloTargets};
use kvroute_core::{
    build_policy, AdapterFit, Candidate, EngineLoad, Overlap, Policy, PolicyConfig, PolicyKind,
    RankLoad, RecentAdapters, RequestLoad, RouteRequest,
};
use kvroute_index::{BlockHash, OverlapScores, ReplicaId};
use kvroute_protocol::WorkerId;
use kvroute_sim::engine::{EngineCore, LoraId, LoraState};
use rand::RngCore;

use super::scrapes::View;
use super::{Cluster, OutputTracking};

/// Where an arriving request goes.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Placement {
    /// One engine computes the prompt and answers (an aggregated cluster; P/D decode-only).
    Whole {
        engine: usize,
        load: RequestLoad,
        features: PrefillFeatures,
    },
    /// The prompt on `prefill` (`max_tokens` 1), then the answer on `decode`, which receives
    /// the prompt's KV.
    Split {
        prefill: usize,
        prefill_load: RequestLoad,
        prefill_features: PrefillFeatures,
        decode: usize,
        decode_load: RequestLoad,
    },
}

/// What the router sees of an arriving request.
#[derive(Clone, Copy)]
pub(super) struct Arrival<'a> {
    pub tokens: &'a [u32],
    pub hashes: &'a [BlockHash],
    /// Characters standing for the tokens, for the text-keyed policies.
    pub text: &'a str,
    /// Its LoRA adapter, if any.
    pub lora: Option<LoraId>,
    /// Its latency targets, when it tells the router (see the `slo` module).
    pub slo: Option<SloTargets>,
    /// Its output length (its `max_tokens`): the `osl` hint under `OutputTracking::ExactOsl`.
    pub output_tokens: u32,
    pub now: Instant,
    /// The engine the TTFT oracle chose (`SimConfig::ttft_oracle`): the policy's choice is
    /// replaced by it, its load and features counted as the policy counts them.
    pub oracle: Option<usize>,
}

/// A set of engines with its policy.
struct Pool {
    engines: Range<usize>,
    kind: PolicyKind,
    policy: Box<dyn Policy>,
}

impl Pool {
    fn new(engines: Range<usize>, kind: PolicyKind, config: &PolicyConfig) -> Self {
        Self {
            engines,
            kind,
            policy: build_policy(kind, config),
        }
    }
}

enum Mode {
    Aggregated(Pool),
    Disaggregated {
        prefill: Pool,
        decode: Pool,
        min_uncached_tokens: u64,
    },
}

/// The routing state of a simulated cluster; engine `i` is replica `i` of the index.
pub(super) struct Router {
    ids: Vec<WorkerId>,
    /// The router's in-flight accounting per engine.
    pub loads: Vec<RankLoad>,
    /// Each engine's latency models, learned from the timings observed (see `State`).
    pub models: Vec<LatencyModel>,
    /// The adapters sent to each engine lately.
    recent: Vec<RecentAdapters<LoraId>>,
    mode: Mode,
    block_size: usize,
    /// Each engine's KV blocks.
    num_gpu_blocks: Vec<u64>,
    /// Output-block tracking, when on.
    pub output_blocks: Option<OutputTracking>,
    /// `SimConfig::sample_ranks`: kv_aware chooses among [`sampled`] candidates, with the
    /// cluster's terms over every engine (`Some(0)`: every engine; `None`: as the router by
    /// default, [`sample_size`]).
    pub sample_ranks: Option<usize>,
    /// Each engine's speed when the router is told them (`EngineShapes::told_speeds`):
    /// its candidates carry them in place of the fitted ones ([`told`]).
    pub told_speeds: Option<Vec<f64>>,
}

/// A rank's fitted speed `learned` as the router would have it told its speed factor `s`
/// (twice as fast: 2): its factors `1 / s` with the evidence they need to count, and its
/// prefill and decode fits the prior's at that speed. Its output length and adapter load time
/// stay learned. Factors count relative to the cluster's mean, so the engine model's own scale
/// does not matter.
fn told(learned: FittedSpeed, s: f64) -> FittedSpeed {
    let prior = FittedSpeed::prior();
    let evidence = |seen: u64| seen.max(SPEED_EVIDENCE);
    FittedSpeed {
        prefill: prior.prefill.map(|a| a / s),
        decode: prior.decode / s,
        prefill_factor: 1.0 / s,
        decode_factor: 1.0 / s,
        prefill_observations: evidence(learned.prefill_observations),
        decode_observations: evidence(learned.decode_observations),
        ..learned
    }
}

impl Router {
    /// The router of `cluster`: aggregated engines `w0..`, or prefill engines `p0..` then
    /// decode engines `d0..`; `num_gpu_blocks` has each engine's.
    pub fn new(cluster: &Cluster, block_size: usize, num_gpu_blocks: Vec<u64>) -> Self {
        let (ids, mode): (Vec<WorkerId>, Mode) = match cluster {
            Cluster::Aggregated {
                workers,
                policy,
                policy_config,
            } => {
                let n = (*workers).max(1);
                (
                    (0..n).map(|i| WorkerId::new(format!("w{i}"))).collect(),
                    Mode::Aggregated(Pool::new(0..n, *policy, policy_config)),
                )
            }
            Cluster::Disaggregated(pd) => {
                let (p, d) = (pd.prefill_workers.max(1), pd.decode_workers.max(1));
                let ids = (0..p)
                    .map(|i| WorkerId::new(format!("p{i}")))
                    .chain((0..d).map(|i| WorkerId::new(format!("d{i}"))))
                    .collect();
                (
                    ids,
                    Mode::Disaggregated {
                        prefill: Pool::new(0..p, pd.prefill_policy, &pd.prefill_config),
                        decode: Pool::new(p..p + d, pd.decode_policy, &pd.decode_config),
                        min_uncached_tokens: pd.min_uncached_tokens,
                    },
                )
            }
        };
        Self {
            loads: vec![RankLoad::default(); ids.len()],
            models: vec![LatencyModel::default(); ids.len()],
            recent: vec![RecentAdapters::default(); ids.len()],
            ids,
            mode,
            block_size,
            num_gpu_blocks,
            output_blocks: None,
            sample_ranks: None,
            told_speeds: None,
        }
    }

    /// Engine `e`'s speed as its candidates carry it: fitted, or told.
    fn speed_of(&self, e: usize) -> FittedSpeed {
        let learned = self.models[e].speed();
        match self.told_speeds.as_ref().and_then(|s| s.get(e)) {
            Some(&s) => told(learned, s),
            None => learned,
        }
    }

    /// A request of `lora` went to `engine`, whose slots are `engines[engine]`'s.
    pub fn adapter_routed(&mut self, engine: &EngineCore, index: usize, lora: Option<LoraId>) {
        if let Some(id) = lora {
            self.recent[index].routed(id, engine.config().lora.max_loras);
        }
    }

    /// The prefill engines and the decode engines, when disaggregated.
    pub fn halves(&self) -> Option<(Range<usize>, Range<usize>)> {
        match &self.mode {
            Mode::Aggregated(_) => None,
            Mode::Disaggregated {
                prefill, decode, ..
            } => Some((prefill.engines.clone(), decode.engines.clone())),
        }
    }

    /// Whether the index's overlaps are needed (a kv_aware pool, or the decode-only test).
    pub fn needs_overlaps(&self) -> bool {
        match &self.mode {
            Mode::Aggregated(pool) => pool.kind == PolicyKind::KvAware,
            Mode::Disaggregated { .. } => true,
        }
    }

    /// Whether a policy keys on the prompt's text (requests carry no session key here).
    pub fn needs_text(&self) -> bool {
        let text = |k: PolicyKind| k.needs_text(None);
        match &self.mode {
            Mode::Aggregated(pool) => text(pool.kind),
            Mode::Disaggregated {
                prefill, decode, ..
            } => text(prefill.kind) || text(decode.kind),
        }
    }

    /// Decides where `req` goes; applies nothing (the caller starts the loads).
    pub fn place(
        &self,
        req: &Arrival<'_>,
        scores: &OverlapScores,
        engines: &View<'_>,
        rng: &mut dyn RngCore,
    ) -> Placement {
        match &self.mode {
            Mode::Aggregated(pool) => {
                let (engine, load, features) = self.choose(pool, req, scores, engines, rng);
                Placement::Whole {
                    engine,
                    load: self.answer(load, req),
                    features,
                }
            }
            Mode::Disaggregated {
                prefill,
                decode,
                min_uncached_tokens,
            } => {
                // Each half answers for its part of the latency, as in the gateway's P/D
                // plan (a decode-only request is placed on its decode targets).
                let half = |decode: bool| Arrival {
                    slo: req.slo.map(|t| t.of_half(decode)),
                    ..*req
                };
                let (d, decode_load, features) =
                    self.choose(decode, &half(true), scores, engines, rng);
                let decode_load = self.answer(decode_load, req);
                let held = scores.get(ReplicaId(d as u32)).total() as usize * self.block_size;
                let uncached = (req.tokens.len() - held.min(req.tokens.len())) as u64;
                if *min_uncached_tokens > 0 && uncached < *min_uncached_tokens {
                    return Placement::Whole {
                        engine: d,
                        load: decode_load,
                        features,
                    };
                }
                let (p, prefill_load, prefill_features) =
                    self.choose(prefill, &half(false), scores, engines, rng);
                Placement::Split {
                    prefill: p,
                    prefill_load,
                    prefill_features,
                    decode: d,
                    decode_load: RequestLoad {
                        prefill_tokens: 0,
                        ..decode_load
                    },
                }
            }
        }
    }

    /// `load` of an answer to `req`, tracking its output blocks when the router does.
    fn answer(&self, load: RequestLoad, req: &Arrival<'_>) -> RequestLoad {
        let osl = match self.output_blocks {
            None => return load,
            Some(OutputTracking::Blocks) => None,
            Some(OutputTracking::ExactOsl) => Some(req.output_tokens),
        };
        load.tracking_output(req.tokens.len(), self.block_size, osl)
    }

    /// `pool`'s policy's choice, the request's load on it and the features its TTFT model
    /// will be fed.
    fn choose(
        &self,
        pool: &Pool,
        req: &Arrival<'_>,
        scores: &OverlapScores,
        engines: &View<'_>,
        rng: &mut dyn RngCore,
    ) -> (usize, RequestLoad, PrefillFeatures) {
        let bs = self.block_size;
        let blocks = req.hashes.iter().map(|h| h.0).collect();
        let request_load = RequestLoad::for_prompt(blocks, req.tokens.len(), 0, bs);
        let kv_aware = pool.kind == PolicyKind::KvAware;
        let ids = fitting(pool, req, engines.engines);
        let candidates: Vec<Candidate<'_>> = (ids.iter().copied())
            .map(|e| {
                let seen = engines.load(e);
                let load = &self.loads[e];
                // The engines' caches are their devices; capped as the gateway caps them.
                let overlap = if kv_aware {
                    Overlap {
                        device: scores.get(ReplicaId(e as u32)).device,
                        ..Overlap::default()
                    }
                    .capped(req.tokens.len(), bs)
                } else {
                    Overlap::default()
                };
                Candidate {
                    worker: &self.ids[e],
                    dp_rank: None,
                    in_flight: load.active_requests(),
                    kv: load.kv_terms(overlap, &request_load, 0.0),
                    engine: EngineLoad {
                        waiting: seen.map(|(waiting, _, _)| waiting as f64),
                        running: seen.map(|(_, running, _)| running as f64),
                        kv_usage: seen.map(|(_, _, kv_usage)| kv_usage),
                        num_gpu_blocks: Some(self.num_gpu_blocks[e]),
                    },
                    speed: Some(self.speed_of(e)),
                    adapter: adapter_fit(req.lora, || engines.lora(e), &self.recent[e]),
                }
            })
            .collect();
        let request = RouteRequest {
            session_key: None,
            text: req.text,
            prompt_tokens: req.tokens.len(),
            tokens: req.tokens,
            block_size: bs,
            has_preferred_taints: false,
            dry_run: false,
            now: req.now,
        };
        let by_headroom = req
            .slo
            .and_then(|t| by_headroom(pool, &candidates, &request, &t));
        let sampling = (pool.policy.kv_aware()).filter(|k| kv_aware && k.decides_on_load());
        let n = sample_size(self.sample_ranks, candidates.len());
        // The TTFT oracle's choice stands in for the policy's (which is then not asked).
        let oracle = (req.oracle).and_then(|e| ids.iter().position(|&i| i == e));
        let chosen = match oracle.or(by_headroom) {
            Some(index) => index,
            // The gateway samples on its lean path: a cost read from load alone.
            None if n > 0 && sampling.is_some() => {
                let k = sampling.expect("checked");
                let kept = sampled(&candidates, req.hashes.len(), n, rng);
                let sample: Vec<Candidate<'_>> = kept.iter().map(|&i| candidates[i]).collect();
                // The cluster's terms over every engine, as the gateway's pool sums them.
                let cluster = k.cluster(&candidates);
                let costs: Vec<f64> = (sample.iter())
                    .map(|c| k.cost_in(c, &request, &cluster))
                    .collect();
                let decision = pool
                    .policy
                    .select_costed(&sample, &request, Some(&costs), rng);
                decision.map_or(kept[0], |d| kept[d.index])
            }
            None => (pool.policy.select(&candidates, &request, rng)).map_or(0, |d| d.index),
        };
        let features = predict(&candidates[chosen], &request, 0.0).features;
        let device = candidates[chosen].kv.overlap.device as usize;
        // Its device-cached blocks are not computed.
        let load = RequestLoad {
            prefill_tokens: request_load
                .prefill_tokens
                .saturating_sub((device * bs) as u64),
            ..request_load
        };
        (ids[chosen], load, features)
    }
}

/// The engines of `pool` whose context takes `req` (its prompt plus its answer), as the
/// gateway's eligibility keeps them: every engine when none does.
fn fitting(pool: &Pool, req: &Arrival<'_>, engines: &[EngineCore]) -> Vec<usize> {
    let need = req.tokens.len() + (req.output_tokens as usize).max(1);
    let mut ids: Vec<usize> = pool.engines.clone().collect();
    retain_fitting(&mut ids, |&e| need <= engines[e].capacity_tokens());
    ids
}

/// The candidates a sampled decision reads (`Router::sample_ranks`), by the rule the gateway's
/// `--router-sample-ranks` reads them ([`sample_ranks`]): of those that hold some of a prompt
/// of `prompt_blocks` full blocks, the `others` with the longest cached prefix and `others` of
/// those holding it only in their active requests (fewer new blocks than the prompt's), then
/// `others` more drawn at random. In the order read.
pub(super) fn sampled(
    candidates: &[Candidate<'_>],
    prompt_blocks: usize,
    others: usize,
    rng: &mut dyn RngCore,
) -> Vec<usize> {
    let depth = |i: usize| candidates[i].kv.overlap.total();
    let cached = (0..candidates.len())
        .filter(|&i| depth(i) > 0)
        .map(|i| (depth(i), i))
        .collect();
    let active = (0..candidates.len())
        .filter(|&i| depth(i) == 0 && candidates[i].kv.new_blocks < prompt_blocks as u64)
        .collect();
    let mut kept = Vec::new();
    let mut seen = vec![false; candidates.len()];
    let take = |i: usize| {
        if seen[i] {
            return false;
        }
        seen[i] = true;
        kept.push(i);
        true
    };
    sample_ranks(cached, active, candidates.len(), others, rng, take);
    kept
}

/// The choice by headroom against the request's `targets`, as the gateway makes it for a
/// kv_aware pool (`routing::plan`): `None` for another policy, or without targets.
fn by_headroom(
    pool: &Pool,
    candidates: &[Candidate<'_>],
    request: &RouteRequest<'_>,
    targets: &SloTargets,
) -> Option<usize> {
    if pool.kind != PolicyKind::KvAware || !targets.is_set() {
        return None;
    }
    let saturation = kvroute_core::policy::KvAware::saturation(candidates);
    let predicted: Vec<Predicted> = candidates
        .iter()
        .map(|c| (&predict(c, request, saturation)).into())
        .collect();
    let costs = pool.policy.target_costs(candidates, request);
    kvroute_core::slo::choose(targets, &predicted, costs.as_deref()).map(|c| c.index)
}

/// Where `lora` stands on an engine, from what its `vllm:lora_requests_info` shows (`state`;
/// `None` when stale: as the gateway, no fit).
fn adapter_fit<'a>(
    lora: Option<LoraId>,
    state: impl FnOnce() -> Option<Cow<'a, LoraState>>,
    recent: &RecentAdapters<LoraId>,
) -> AdapterFit {
    let Some(id) = lora else {
        return AdapterFit::None;
    };
    let Some(s) = state() else {
        return AdapterFit::None;
    };
    AdapterFit::of(
        &id,
        &s.running,
        &s.waiting,
        s.max_loras,
        recent.contains(&id),
    )
}
