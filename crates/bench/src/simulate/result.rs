//! What a simulation reports: a policy's figures, as printed and written as JSON.

use serde::Serialize;

pub use super::queue::QueueResult;

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
    /// LoRA adapters the engines loaded into a slot.
    pub lora_loads: u64,
    /// With adapters: the router's fitted time of one adapter load on each engine (ms; its
    /// latency model's, learned from the TTFTs of the requests it expected to load).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fitted_lora_load_ms: Vec<f64>,
    /// A disaggregated cluster's figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pd: Option<PdResult>,
    /// The router queue's figures, when it is on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueResult>,
    /// Each tenant's figures, when the requests have tenants (`--tenants`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantResult>,
    /// Attainment of the requests' TTFT targets, with `--slo-mix`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slo: Option<super::SloResult>,
}

/// One tenant's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TenantResult {
    pub tenant: String,
    /// Requests that arrived.
    pub requests: usize,
    /// Of those, the ones that got a first token.
    pub answered: usize,
    pub ttft_ms: Percentiles,
    /// Time in the router queue of its routed requests (0 for those routed on arrival): the
    /// part of the TTFT the queue's order decides.
    pub router_wait_ms: Percentiles,
    /// Its share of the tokens the cluster served (prompt tokens when routed, output tokens
    /// as produced) up to the last arrival, while every tenant still had requests coming.
    pub token_share: f64,
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
