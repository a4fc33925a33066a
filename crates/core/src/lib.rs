//! The routing brain of kvroute: pure, synchronous selection over a snapshot.
//!
//! A routing decision is `policy.select(candidates, request, rng)`: the caller (the gateway)
//! builds the [`Candidate`] list from its current snapshot of the workers that serve the
//! request's model and are eligible, describes the request with a [`RouteRequest`], and
//! passes a random source in. The policy returns a [`Decision`] naming one candidate.
//!
//! Owns: every policy ([`PolicyKind`] lists them), their parameters ([`PolicyConfig`]) and
//! their small internal state (a round-robin counter, a cached hash ring, `manual`'s sticky
//! map). Invariants: selection never blocks on I/O, never spawns, and reads time only from
//! [`RouteRequest::now`]; with the same inputs and the same rng state a policy makes the
//! same choice. Also owns the router queue's order ([`queue`]: priority tiers, weighted DRR
//! over policy classes, virtual token counters between tenants), with time passed in. Does
//! not own: HTTP, metrics, health checks or load accounting's
//! increments (the caller applies those from the decision).

pub mod affinity;
mod candidate;
pub mod eligibility;
pub mod latency;
pub mod load;
pub mod lora;
pub mod overload;
pub mod policy;
pub mod queue;
pub mod sessions;
pub mod slo;

pub use candidate::{Candidate, Decision, EngineLoad, KvTerms, Overlap, RouteRequest};
pub use load::{LoadSummary, RankLoad, RequestLoad};
pub use lora::{predicted_adapter_load_ms, AdapterFit, RecentAdapters};
pub use policy::{
    build_policy, AssignmentMode, CacheAwareConfig, CostModel, KvAwareConfig, LeastLoadConfig,
    LlmDConfig, MemoryCost, Observation, Observed, Policy, PolicyConfig, PolicyKind, UnknownPolicy,
};
