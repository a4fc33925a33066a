//! `--engine-priority`: each request tells its engine where it goes in the engine's own
//! queue, for engines that schedule by priority (vLLM's `--scheduling-policy priority`,
//! SGLang's `--enable-priority-scheduling`).
//!
//! The level is `kvroute_core::queue::engine_priority`'s: the request's priority class
//! first (smg's four with the priority scheduler, else one), then whether its tenant already
//! has its share of the prompt tokens in flight (weights from the priority file). It is
//! written as the body's `priority` field, in the engine's convention, replacing any the
//! client sent: with the flag on, the router owns the engine's order. Only the OpenAI routes
//! carry it (vLLM's Anthropic and SGLang's native routes take no `priority`). A request
//! counts in flight from the moment it is sent until its response ends, whatever the outcome.
//!
//! A request whose tenant is below its share does not wait in the router queue either
//! ([`EngineLevels::below_share`]): it would be first in any engine's queue, and the router
//! queue is there to keep the engines' queues short, not to hold back who they put first.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvroute_core::queue::engine_priority::{level, EnginePriority, InFlight};

use crate::auth::Tenant;
use crate::config::{PriorityClass, Settings};

/// The routes whose body takes a `priority`.
const ROUTES: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

/// The tokens in flight per tenant and how to write a level (one per gateway).
#[derive(Debug)]
pub struct EngineLevels {
    kind: EnginePriority,
    /// 4 with the priority scheduler, else 1.
    tiers: usize,
    weights: BTreeMap<String, f64>,
    in_flight: Mutex<InFlight<Arc<str>>>,
}

impl EngineLevels {
    /// The levels `settings` ask for, `None` when `--engine-priority` is off.
    pub fn new(settings: &Settings) -> Option<Arc<Self>> {
        if settings.engine_priority == EnginePriority::Off {
            return None;
        }
        let sharing = settings.queue.as_ref().map(|q| &q.sharing);
        let prioritised = sharing.is_some_and(|s| s.priority.is_some());
        Some(Arc::new(Self {
            kind: settings.engine_priority,
            tiers: if prioritised {
                PriorityClass::TIERS.len()
            } else {
                1
            },
            weights: sharing.map(|s| s.weights.clone()).unwrap_or_default(),
            in_flight: Mutex::new(InFlight::default()),
        }))
    }

    fn weight(&self, tenant: &str) -> f64 {
        self.weights.get(tenant).copied().unwrap_or(1.0)
    }

    /// Whether `tenant` is below its share of the tokens in flight: its next request would
    /// be first in its engine's queue, so the router queue does not hold it.
    pub fn below_share(&self, tenant: &Tenant) -> bool {
        let in_flight = self.in_flight.lock().expect("not poisoned");
        !in_flight.over(tenant.as_str(), self.weight(tenant.as_str()))
    }

    /// The body to send on `route` for `tenant`'s request of `tier` (its priority class's,
    /// when the priority scheduler is on) with `tokens` prompt tokens, and its count in
    /// flight, which ends when the [`InFlightGuard`] drops. A body that is not a JSON
    /// object, or a route without `priority`, goes as it came.
    pub fn send(
        self: &Arc<Self>,
        route: &str,
        body: Bytes,
        tenant: &Tenant,
        tier: Option<usize>,
        tokens: u64,
    ) -> (Bytes, Option<InFlightGuard>) {
        if !ROUTES.contains(&route) {
            return (body, None);
        }
        let Ok(serde_json::Value::Object(mut object)) = serde_json::from_slice(&body) else {
            return (body, None);
        };
        let tenant: Arc<str> = Arc::from(tenant.as_str());
        let weight = self.weight(&tenant);
        let over = {
            let mut in_flight = self.in_flight.lock().expect("not poisoned");
            let over = in_flight.over(&*tenant, weight);
            in_flight.start(tenant.clone(), weight, tokens);
            over
        };
        let tier = tier.unwrap_or(0).min(self.tiers - 1);
        let levels = u32::try_from(self.tiers * 2).unwrap_or(u32::MAX);
        let guard = InFlightGuard {
            levels: self.clone(),
            tenant,
            tokens,
        };
        let Some(value) = self.kind.value(level(tier, over), levels) else {
            return (body, Some(guard));
        };
        object.insert("priority".into(), value.into());
        let body = serde_json::to_vec(&object).map_or(body, Bytes::from);
        (body, Some(guard))
    }
}

/// A request's prompt tokens in flight, until it drops.
#[derive(Debug)]
pub struct InFlightGuard {
    levels: Arc<EngineLevels>,
    tenant: Arc<str>,
    tokens: u64,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let mut in_flight = self.levels.in_flight.lock().expect("not poisoned");
        in_flight.end(&*self.tenant, self.tokens);
    }
}
