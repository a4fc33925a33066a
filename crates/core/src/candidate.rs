//! The inputs and output of a routing decision.

use std::time::Instant;

use kvroute_protocol::WorkerId;

use crate::latency::FittedSpeed;
use crate::AdapterFit;

/// Leading blocks of the request a candidate already holds, per storage tier (each block
/// counted once, in the best tier holding it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overlap {
    pub device: u32,
    pub host: u32,
    pub disk: u32,
    /// A shared, external cache (LMCache, a storage tier outside the engine).
    pub external: u32,
}

impl Overlap {
    pub fn total(&self) -> u32 {
        self.device + self.host + self.disk + self.external
    }

    /// The overlap as the router counts it for a prompt of `prompt_tokens`: at least one
    /// prompt token is left to compute, so at most `(prompt_tokens - 1) / block_size` blocks
    /// count, taken from the best tiers (the excess comes off external, then disk, host,
    /// device).
    pub fn capped(self, prompt_tokens: usize, block_size: usize) -> Overlap {
        let cap = (prompt_tokens.saturating_sub(1) / block_size.max(1)) as u32;
        let mut excess = self.total().saturating_sub(cap);
        let mut take = |n: u32| {
            let t = n.min(excess);
            excess -= t;
            n - t
        };
        let external = take(self.external);
        let disk = take(self.disk);
        let host = take(self.host);
        let device = take(self.device);
        Overlap {
            device,
            host,
            disk,
            external,
        }
    }
}

/// The KV terms of one candidate for one request (used by `kv_aware`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvTerms {
    pub overlap: Overlap,
    /// Prompt tokens routed to this (worker, rank) that have not produced a first token.
    pub prefill_tokens: u64,
    /// Distinct KV blocks of the requests still generating there.
    pub decode_blocks: u64,
    /// Blocks of this request not already among `decode_blocks`.
    pub new_blocks: u64,
    /// Requests in flight there.
    pub active_requests: u64,
    /// Of those, the ones that have not produced a first token.
    pub prefilling_requests: u64,
    /// Sum of the weights of the request's preferred taints this worker has (0 for none).
    pub preferred_taint_weight: f64,
}

/// What the engine itself reports (its `/metrics`, scraped by the gateway); `None` when
/// unknown or stale.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineLoad {
    /// `vllm:num_requests_waiting`.
    pub waiting: Option<f64>,
    /// `vllm:num_requests_running`.
    pub running: Option<f64>,
    /// `vllm:kv_cache_usage_perc`, in [0, 1].
    pub kv_usage: Option<f64>,
    /// KV blocks of the engine (`vllm:cache_config_info`, or the worker's config).
    pub num_gpu_blocks: Option<u64>,
}

/// One (worker, data-parallel rank) that may take the request, with what policies read.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub worker: &'a WorkerId,
    /// The data-parallel rank, for workers that have ranks.
    pub dp_rank: Option<u32>,
    /// Requests the router has in flight on this candidate.
    pub in_flight: u64,
    pub kv: KvTerms,
    pub engine: EngineLoad,
    /// The rank's fitted latency models, when the caller learns them (`None`: the prior;
    /// read by `kv_aware`'s predicted cost).
    pub speed: Option<FittedSpeed>,
    /// Where the request's LoRA adapter stands there.
    pub adapter: AdapterFit,
}

impl<'a> Candidate<'a> {
    pub fn new(worker: &'a WorkerId, in_flight: u64) -> Self {
        Self {
            worker,
            dp_rank: None,
            in_flight,
            kv: KvTerms::default(),
            engine: EngineLoad::default(),
            speed: None,
            adapter: AdapterFit::None,
        }
    }
}

/// What policies may read about a request.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The session key (`x-session-id`, `x-smg-routing-key`, `x-user-id`, or the body's
    /// `user`), if the request has one.
    pub session_key: Option<&'a str>,
    /// The prompt text (see `RoutingFields::routing_text`).
    pub text: &'a str,
    /// Prompt length in tokens (0 when the router did not tokenise).
    pub prompt_tokens: usize,
    /// The prompt's token ids, for policies that hash them (empty when not tokenised).
    pub tokens: &'a [u32],
    /// The router's KV block size.
    pub block_size: usize,
    /// Whether the request names preferred taints (only then is the taint factor applied).
    pub has_preferred_taints: bool,
    /// A decision asked for without sending the request (`/debug/route`): policies must
    /// not change their state (trees, sticky maps, counters).
    pub dry_run: bool,
    pub now: Instant,
}

impl<'a> RouteRequest<'a> {
    /// A request described by its key and text only.
    pub fn simple(session_key: Option<&'a str>, text: &'a str, now: Instant) -> Self {
        Self {
            session_key,
            text,
            prompt_tokens: 0,
            tokens: &[],
            block_size: 16,
            has_preferred_taints: false,
            dry_run: false,
            now,
        }
    }
}

/// The chosen candidate, as an index into the slice given to `select`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub index: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_is_capped_below_the_whole_prompt_from_the_lowest_tier() {
        let o = Overlap {
            device: 3,
            host: 1,
            disk: 1,
            external: 0,
        };
        let tiers = |o: Overlap| (o.device, o.host, o.disk, o.external);
        assert_eq!(tiers(o.capped(81, 16)), (3, 1, 1, 0));
        assert_eq!(tiers(o.capped(80, 16)), (3, 1, 0, 0));
        assert_eq!(tiers(o.capped(33, 16)), (2, 0, 0, 0));
        assert_eq!(o.capped(0, 16), Overlap::default());
    }
}
