//! The weighted and calibrated costs from a candidate's numbers ([`KvAware::priced`]), for
//! [`KvAware::cost_in`] and for a caller that scores a thousand ranks without building a
//! candidate for each (the gateway's lean decision): both compute the same `f64`.

use super::calibrated::{beyond_share, memory_priced, own_decode_excess};
use super::{Cluster, CostModel, KvAware, MemoryCost};
use crate::latency::SpeedFactors;
use crate::{EngineLoad, KvTerms, RouteRequest};

/// What the cost reads of a request: its size in blocks, once per decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PromptTerms {
    /// The block size, at least 1, as a count and as an `f64`.
    block_size: usize,
    block_size_f64: f64,
    /// The prompt's blocks, the last one partial.
    prompt_blocks: u64,
    /// The prompt's tokens over the block size.
    prompt: f64,
}

impl PromptTerms {
    pub fn of(request: &RouteRequest<'_>) -> Self {
        let block_size = request.block_size.max(1);
        Self {
            block_size,
            block_size_f64: block_size as f64,
            prompt_blocks: request.prompt_tokens.div_ceil(block_size) as u64,
            prompt: request.prompt_tokens as f64 / block_size as f64,
        }
    }
}

impl KvAware {
    /// The weighted or calibrated cost (the module docs' formula, before the preferred
    /// taints' discount) of a rank with terms `kv`, engine gauges `engine`, speed `speed`
    /// and `adapter_loads` expected adapter loads, among the ranks `cluster` describes.
    pub fn priced(
        &self,
        request: &PromptTerms,
        cluster: &Cluster,
        kv: &KvTerms,
        engine: &EngineLoad,
        speed: &SpeedFactors,
        adapter_loads: f64,
    ) -> f64 {
        let k = &self.config;
        let o = kv.overlap;
        let prompt_blocks = request.prompt_blocks;
        // Blocks held by the rank's active requests that the overlap does not report yet.
        let pending = prompt_blocks
            .saturating_sub(kv.new_blocks)
            .saturating_sub(u64::from(o.total()));
        let credit = k.overlap_score_credit * (f64::from(o.device) + pending as f64)
            + k.host_cache_hit_weight * f64::from(o.host)
            + k.disk_cache_hit_weight * f64::from(o.disk)
            + k.shared_cache_multiplier * f64::from(o.external);
        let prompt = request.prompt;
        let prefill_blocks = kv.prefill_tokens as f64 / request.block_size_f64 + prompt;
        // The request's blocks not resident on the rank (see the module docs).
        let new_blocks = kv
            .new_blocks
            .min(prompt_blocks.saturating_sub(u64::from(o.device)));
        let memory = (kv.decode_blocks + new_blocks) as f64;
        let memory = match (k.memory_cost, engine.num_gpu_blocks) {
            (MemoryCost::Utilisation, Some(capacity)) if capacity > 0 => {
                memory * memory / capacity as f64
            }
            _ => memory,
        };
        // The blocks this request's prefill computes, and the requests decoding beside it.
        let uncached = prompt_blocks.saturating_sub(u64::from(o.total()) + pending) as f64;
        let decoding = kv.active_requests.saturating_sub(kv.prefilling_requests) as f64;
        // The overflow term, where some candidate has room to send the request to.
        let overflow_weight = if cluster.kv_room {
            k.kv_overflow_weight
        } else {
            0.0
        };
        // The calibrated model's prices of prefill and decode work and its KV share.
        let (p, d, share) = match k.cost_model {
            CostModel::Calibrated => {
                let (p, d) = cluster.prices_of(speed, kv.active_requests == 0);
                (p, d, cluster.share_of(engine))
            }
            _ => (1.0, 1.0, 1.0),
        };
        let overflow = beyond_share(engine, kv.decode_blocks, new_blocks);
        p * k.prefill_load_scale * (prefill_blocks - credit).max(0.0)
            + p * k.prefill_load_scale * cluster.saturation * (prompt - credit).max(0.0)
            + share * memory_priced(memory, kv.decode_blocks + new_blocks, new_blocks, d)
            + p * k.prefill_interference_weight * uncached * decoding
            + d * k.decode_active_request_weight * kv.active_requests as f64
            + k.lora_load_cost * adapter_loads
            + p * k.prefill_load_scale * overflow_weight * overflow
            + k.own_decode_weight * own_decode_excess(p, d)
    }
}
