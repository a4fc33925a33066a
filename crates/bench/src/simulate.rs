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
//! **The router queue** (`--router-queue-threshold`, see the `queue` module), when on, holds
//! an arriving request while every engine is saturated with prefill, as the gateway does, and
//! lets it go to be scored when capacity frees; its TTFT counts the wait. With tenants
//! (`SimConfig::tenants`), the queue orders them as `--router-queue-fairness` says, output
//! tokens are charged to their tenant as they are produced, and each tenant's figures are
//! reported.
//!
//! **LoRA adapters** (`SimConfig::loras` = N > 0): each request runs with adapter
//! `hash_ids[0] mod N`, so the requests of one prefix group (a Mooncake trace's first hash id;
//! a generated workload's system prompt or conversation) share one; its blocks are hashed
//! with the adapter's salt, as the engines and the router's index hash them. The engines serve
//! adapters as `EngineConfig::lora` says; the router sees each engine's running and waiting
//! adapters as its `vllm:lora_requests_info` would show them. `lora_loads` counts the adapter
//! loads of all engines; `fitted_lora_load_ms` is each engine's load time as the router's
//! latency model learned it (from the TTFTs of the requests it expected to load, as the
//! gateway's: `kvroute_core::latency`).
//!
//! **Output blocks** (`SimConfig::output_blocks`, `--router-track-output-blocks`): the
//! router's decode load grows with each token an answer produces, as the gateway's does with a
//! stream (`kvroute_core::load::output`); with [`OutputTracking::ExactOsl`] each request also
//! carries `nvext.agent_hints.osl` = its true output length, the hint's upper bound.
//!
//! [`reference`] is the yardstick printed beside the policies: each request alone on an idle
//! engine of the same configuration, with what one LRU cache of the cluster's whole capacity
//! would hold (see the `reference` module).

mod queue;
pub mod reference;
mod result;
mod route;
mod scrapes;
mod shapes;
mod slo;
mod state;

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{PolicyConfig, PolicyKind};
use kvroute_sim::engine::{EngineConfig, EngineCore, RequestId};

use crate::trace::TraceRequest;
pub use queue::TenantFairness;
pub use queue::{InvalidQueue, QueueConfig};
pub use reference::{reference, Reference};
pub use result::{
    nearest_rank, percentiles, PdResult, Percentiles, PolicyResult, QueueResult, TenantResult,
};
pub use shapes::{EngineShapes, InvalidShapes};
pub use slo::{SloClass, SloClassResult, SloConfig, SloMix, SloResult, SloRouting};
use state::State;

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
    /// The router queue, when on (aggregated clusters only).
    pub queue: Option<QueueConfig>,
    /// Each request's tenant, by its index in the trace (see [`crate::tenants`]); `None`: one
    /// tenant, and no per-tenant figures.
    pub tenants: Option<Arc<[u32]>>,
    /// Each engine's speed and KV capacity, when they differ (see the `shapes` module).
    pub shapes: EngineShapes,
    /// LoRA adapters over the requests (0: none; see the module docs).
    pub loras: u32,
    /// Per-request TTFT targets (`--slo-mix`), when set: their attainment is reported, and
    /// the router sees them or not (see the `slo` module).
    pub slo: Option<SloConfig>,
    /// Output-block tracking in the router, when on (see the module docs).
    pub output_blocks: Option<OutputTracking>,
    /// kv_aware chooses as the router's `--router-sample-ranks` does (`--sample-ranks`; see
    /// the `route` module's `sampled`): `None` as the router by default (64 from 256
    /// engines), `Some(0)` every engine.
    pub sample_ranks: Option<usize>,
    /// Each request goes to the engine where it costs the least first-token time, found by
    /// running copies of the engines ahead (`--ttft-oracle`; aggregated clusters; see the
    /// `state` module's `oracle`): a yardstick, named `ttft_oracle` in the results.
    pub ttft_oracle: bool,
    /// The router reads the engines' gauges (waiting, running, KV usage, adapters) as its
    /// scrapes of their `/metrics` every this long last showed them (`--metrics-refresh-ms`;
    /// see the `scrapes` module); `None`: as they are at each decision.
    pub metrics_refresh: Option<Duration>,
}

impl SimConfig {
    /// The name of its run: its cluster's, or `ttft_oracle`.
    pub fn name(&self) -> String {
        match self.ttft_oracle {
            true => "ttft_oracle".to_owned(),
            false => self.cluster.name(),
        }
    }
}

/// What the router counts of an answer's output (`--router-track-output-blocks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputTracking {
    /// A block each time an answer needs one more, at full weight (no `osl` hint).
    Blocks,
    /// The same, each request's exclusive blocks decayed toward its true output length.
    ExactOsl,
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
    /// The requests in the order they were routed, and when.
    routed: Vec<(RequestId, Duration)>,
    /// Each engine's latency models as the router fitted them by the end.
    speeds: Vec<kvroute_core::latency::FittedSpeed>,
}

fn run(trace: &[TraceRequest], cfg: &SimConfig) -> Run {
    let arrival_of =
        |r: &TraceRequest| Duration::from_secs_f64(r.timestamp as f64 / 1000.0 / cfg.rate_scale);
    let last_arrival = trace.last().map_or(Duration::ZERO, arrival_of);
    let mut state = State::new(cfg, last_arrival);
    let mut next = 0usize;
    let mut now = Duration::ZERO;
    while let Some(t) = state.next_event(trace.get(next).map(arrival_of)) {
        now = t;
        // Steps ending now take effect first; the load they release may let queued
        // requests go, before any wait runs out at the same instant.
        state.end_steps(now);
        state.dispatch(now);
        state.expire(now);
        while let Some(r) = trace.get(next).filter(|r| arrival_of(r) <= now) {
            state.arrive(RequestId(next as u64), r, now);
            next += 1;
        }
        state.start_steps(now);
    }
    state.finish(now)
}

#[cfg(test)]
mod tests;
