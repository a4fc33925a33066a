//! The weighted and calibrated costs from a candidate's numbers ([`KvAware::priced`]), for
//! [`KvAware::cost_in`] and for a caller that scores a thousand ranks without building a
//! candidate for each (the gateway's lean decision): both compute the same `f64`.
//!
//! **Memory by utilisation** (`memory_cost` utilisation, opt-in). Counted linearly, one long
//! conversation still decoding on a rank (2,500 blocks of 16,384) outweighs a 160-block prefix
//! hit there (worth 1,280 at credit 2 / scale 4), and an idle cluster sends the next turn to a
//! cold rank. Weighting each block by the utilisation it brings the rank to (`M * M / C`)
//! charges that rank 380 blocks instead, and a nearly full rank nearly all of them. On the
//! Mooncake trace in Dynamo's engine model it gains a few percent at 1x and 5x the trace's
//! rate; but a decode step reads every block in the batch however empty the engine is, and with
//! room to spare it lets a burst of long streams on one prefix pile onto one rank while another
//! idles. So linear is the default. Without the engine's block count (`num_gpu_blocks`, from
//! its metrics or the worker's config) the term is linear either way.
//!
//! **Surplus credit.** With a credit above 1 a long cached prefix can be worth more than the
//! whole prefill the rank would do for the request, the queue ahead of it included
//! (`credit > (P + ISL)/B`). That surplus is taken off the cost, up to what the rank's other
//! requests add to the memory term (their `decode_blocks`, or under utilisation
//! `decode_blocks^2 / C`): it holds the request on its prefix's rank against that
//! rank's decode load, in proportion to the prefix, and no further. Clamped at 0, as it was,
//! the surplus counted for nothing exactly where a prefix is longest: an agent session's next
//! step, its 7,000-token context cached on a rank decoding eight other sessions (2,237 blocks),
//! cost 2,345 there against 2,323 on an idle rank, which took it and prefilled the whole
//! context again (23% of the steps of agent sessions on twelve mixed engines moved so, 5,500
//! tokens each on average). The surplus counts only where the rank has room: no requests
//! waiting (a queue is the wait the surplus would add to) and its KV under 90% with the request
//! (the overflow term, in [`super`]'s docs, is 0); without the first, at five times an agentic
//! workload's rate on identical engines in Dynamo's engine model, TTFT p99 rose up to 3.8x
//! (4.6x without either). Under the calibrated model it also waits until every candidate has
//! its speed evidence (`Cluster::settled`): before, a prefix held its requests against the idle
//! unseen ranks the calibrated model prices at the fastest rank's speed so that they get tried,
//! and on a quiet cluster the two fastest engines never served. Without the bound by
//! `decode_blocks` it held sessions on idle slow ranks against the own-decode term: end-to-end
//! 29% longer for agent sessions on a nearly idle mixed cluster. It is not priced by the rank's
//! speed (the bound is, by the rank's KV share): it stands for a prefill saved elsewhere, not
//! work done here. With a credit of 1 or less (Dynamo's model) there is none. Measured in
//! BENCHMARKS.md ("Surplus credit").

use super::calibrated::{beyond_share, memory_priced, own_decode_excess};
use super::{waiting, Cluster, CostModel, KvAware, MemoryCost};
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
        // Blocks as the memory term counts them (linear, or by the utilisation they bring).
        let counted = |blocks: u64| match (k.memory_cost, engine.num_gpu_blocks) {
            (MemoryCost::Utilisation, Some(capacity)) if capacity > 0 => {
                blocks as f64 * blocks as f64 / capacity as f64
            }
            _ => blocks as f64,
        };
        let memory = counted(kv.decode_blocks + new_blocks);
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
        // The prefill term, less a surplus credit on a rank with room, up to what its other
        // requests add to the memory term (see "Surplus credit" in the module docs; not priced
        // by speed).
        let prefill = prefill_blocks - credit;
        let prefill_term = if prefill >= 0.0 {
            p * k.prefill_load_scale * prefill
        } else if k.overlap_score_credit > 1.0
            && cluster.settled
            && overflow == 0.0
            && waiting(engine) <= 0.0
        {
            (k.prefill_load_scale * prefill).max(-share * counted(kv.decode_blocks))
        } else {
            0.0
        };
        prefill_term
            + p * k.prefill_load_scale * cluster.saturation * (prompt - credit).max(0.0)
            + share * memory_priced(memory, kv.decode_blocks + new_blocks, new_blocks, d)
            + p * k.prefill_interference_weight * uncached * decoding
            + d * k.decode_active_request_weight * kv.active_requests as f64
            + k.lora_load_cost * adapter_loads
            + p * k.prefill_load_scale * overflow_weight * overflow
            + k.own_decode_weight * own_decode_excess(p, d)
    }
}
