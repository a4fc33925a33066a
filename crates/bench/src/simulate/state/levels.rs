//! The priorities the router writes into requests when the engines schedule by priority
//! (`kvroute-bench simulate --engine-priority`, vLLM's `--scheduling-policy priority`): a
//! request's level as `kvroute_core::queue::engine_priority` decides it, with one tier (a
//! trace names no class) and every tenant of weight 1, as the gateway's
//! `--engine-priority vllm` sends it.

use std::collections::HashMap;

use kvroute_core::queue::engine_priority::{level, InFlight};
use kvroute_sim::engine::{RequestId, SchedulingPolicy};

use super::SimConfig;

/// The tokens in flight per tenant, when the engines schedule by priority.
pub(super) struct Levels {
    in_flight: Option<InFlight<u32>>,
    /// Each request in flight: its tenant and prompt tokens.
    sent: HashMap<RequestId, (u32, u64)>,
}

impl Levels {
    pub(super) fn new(cfg: &SimConfig) -> Self {
        let on = cfg.engine.policy == SchedulingPolicy::Priority;
        Self {
            in_flight: on.then(InFlight::default),
            sent: HashMap::new(),
        }
    }

    /// The priority of request `id` of `tenant`, `tokens` long, sent now (0 when the engines
    /// do not schedule by priority); it counts in flight until [`Self::end`].
    pub(super) fn send(&mut self, id: RequestId, tenant: u32, tokens: u64) -> i64 {
        let Some(in_flight) = &mut self.in_flight else {
            return 0;
        };
        let over = in_flight.over(&tenant, 1.0);
        in_flight.start(tenant, 1.0, tokens);
        self.sent.insert(id, (tenant, tokens));
        i64::from(level(0, over))
    }

    /// Whether `tenant` is below its share of the tokens in flight, with the engines
    /// scheduling by priority: its request would be first in any engine's queue, so the
    /// router queue does not hold it (`kvroute_core::queue::engine_priority`).
    pub(super) fn below_share(&self, tenant: u32) -> bool {
        self.in_flight
            .as_ref()
            .is_some_and(|f| !f.over(&tenant, 1.0))
    }

    /// Request `id` ended (answered or refused).
    pub(super) fn end(&mut self, id: RequestId) {
        if let (Some(in_flight), Some((tenant, tokens))) =
            (&mut self.in_flight, self.sent.remove(&id))
        {
            in_flight.end(&tenant, tokens);
        }
    }
}
