//! The gateway's Prometheus metrics, registered into a registry passed down from `main`.
//!
//! Names as exported (prometheus-client appends `_total` to counters):
//! `kvroute_requests_total{route,status}`, `kvroute_processed_requests_total{worker}`,
//! `kvroute_policy_decisions_total{policy,worker}`, `kvroute_worker_requests_active{worker}`,
//! `kvroute_routing_seconds` (histogram of the time spent choosing a worker),
//! `kvroute_worker_active_prefill_tokens{worker,dp_rank}`,
//! `kvroute_worker_active_decode_blocks{worker,dp_rank}`, `kvroute_time_to_first_token_seconds`,
//! `kvroute_kv_hit_ratio`, `kvroute_worker_circuit_state{worker}` (0 closed, 1 open, 2
//! half-open), `kvroute_worker_healthy{worker}`, `kvroute_upstream_attempts_total{worker,outcome}`
//! (every attempt, retries included), `kvroute_request_retries_total`,
//! `kvroute_requests_in_router`, `kvroute_discovered_workers{source}`,
//! `kvroute_discovery_errors_total{reason}`, `kvroute_request_migrations_total{outcome}`,
//! `kvroute_slo_requests_total{slo,outcome}` ([`slo`]), and the per-tenant series of
//! [`tenants`].
//! Label values are bounded: routes are the fixed set of proxied paths, workers are
//! configured ids.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, RwLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

pub mod slo;
pub mod tenants;

pub use slo::{SloMetrics, SloOutcome, SloWatch};
pub use tenants::{TenantMetrics, TokenKind};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub route: &'static str,
    pub status: u32,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    pub worker: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub policy: &'static str,
    pub worker: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RankLabels {
    pub worker: String,
    pub dp_rank: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabels {
    pub worker: String,
    pub outcome: &'static str,
}

/// How an attempt to a worker ended (before the response body). `outcome as usize` is its
/// index in [`Outcome::ALL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A response that is not a server error.
    Ok = 0,
    /// Connection refused, reset, or closed before the response.
    ConnectError,
    /// No response headers within the request timeout.
    Timeout,
    /// A 5xx response from the engine.
    ServerError,
}

impl Outcome {
    pub const ALL: [Outcome; 4] = [
        Outcome::Ok,
        Outcome::ConnectError,
        Outcome::Timeout,
        Outcome::ServerError,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::ConnectError => "connect_error",
            Outcome::Timeout => "timeout",
            Outcome::ServerError => "server_error",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    pub result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MigrationLabels {
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    pub source: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DiscoveryErrorLabels {
    pub reason: &'static str,
}

/// Discovery: `kvroute_discovered_workers{source}` (the workers of each source now) and
/// `kvroute_discovery_errors_total{reason}` (failed API calls and unreadable files).
#[derive(Debug, Clone, Default)]
pub struct DiscoveryMetrics {
    pub workers: Family<SourceLabels, Gauge>,
    pub errors: Family<DiscoveryErrorLabels, Counter>,
}

impl DiscoveryMetrics {
    pub fn error(&self, reason: &'static str) {
        self.errors
            .get_or_create(&DiscoveryErrorLabels { reason })
            .inc();
    }

    fn register(&self, registry: &mut Registry) {
        registry.register(
            "kvroute_discovered_workers",
            "Workers in the set, by where they came from (static, config, admin, kubernetes, file, epp)",
            self.workers.clone(),
        );
        registry.register(
            "kvroute_discovery_errors",
            "Failed discovery calls and reads, by reason (unreachable, forbidden, unauthorized, gone, invalid, api, config, file)",
            self.errors.clone(),
        );
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DisaggLabels {
    pub decision_type: &'static str,
}

#[derive(Debug, Clone)]
pub struct GatewayMetrics {
    pd_prefill: Family<WorkerLabels, Counter>,
    pd_decode: Family<WorkerLabels, Counter>,
    /// Disaggregated requests: "prefill-decode" (remote prefill) and "decode-only".
    pub disagg_remote: Counter,
    pub disagg_decode_only: Counter,
    circuit: Family<WorkerLabels, Gauge>,
    healthy: Family<WorkerLabels, Gauge>,
    model_list_failures: Family<WorkerLabels, Counter>,
    attempts: Family<AttemptLabels, Counter>,
    /// Attempts after the first, over all requests.
    pub retries: Counter,
    /// Reloads on SIGHUP (the config file's workers, the API's certificate), by result: ok,
    /// error (either failed).
    pub reloads: Family<ReloadLabels, Counter>,
    pub discovery: DiscoveryMetrics,
    /// Per tenant: requests, tokens, rate-limit refusals.
    pub tenants: TenantMetrics,
    /// SLO attainment of requests with latency targets.
    pub slo: SloMetrics,
    /// Streams carried on by another worker after theirs failed, by outcome.
    pub migrations: Family<MigrationLabels, Counter>,
    /// Requests inside the router (admitted, not yet answered in full).
    pub in_router: Gauge,
    rank_prefill: Family<RankLabels, Gauge>,
    rank_decode: Family<RankLabels, Gauge>,
    /// Streaming requests: arrival to the first body frame.
    pub ttft_seconds: Histogram,
    /// Share of the prompt found cached on the chosen worker (kv_aware).
    pub kv_hit_ratio: Histogram,
    /// Distinct blocks in the event-fed KV index, and its approximate heap bytes.
    pub kv_index_blocks: Gauge,
    pub kv_index_bytes: Gauge,
    requests: Family<RequestLabels, Counter>,
    /// The same requests by route alone, once [`GatewayMetrics::count_by_route`] asked for
    /// them (not exported: read by `peer_metrics`); until then a request pays one atomic load.
    by_route: Arc<OnceLock<RwLock<BTreeMap<&'static str, Counter>>>>,
    processed: Family<WorkerLabels, Counter>,
    decisions: Family<DecisionLabels, Counter>,
    active: Family<WorkerLabels, Gauge>,
    prompt_tokens: Family<WorkerLabels, Counter>,
    cached_tokens: Family<WorkerLabels, Counter>,
    pub routing_seconds: Histogram,
}

/// One (worker, rank)'s load gauges.
#[derive(Debug, Clone)]
pub struct RankSeries {
    pub prefill_tokens: Gauge,
    pub decode_blocks: Gauge,
}

/// One worker's series, looked up once when the worker is added so the request path only
/// touches atomics.
#[derive(Debug, Clone)]
pub struct WorkerSeries {
    /// Prefill and decode halves of disaggregated requests sent to it.
    pub pd_prefill: Counter,
    pub pd_decode: Counter,
    pub circuit: Gauge,
    pub healthy: Gauge,
    /// Re-reads of its `/v1/models` that failed (its last good list kept).
    pub model_list_failures: Counter,
    /// One counter per [`Outcome`], in `Outcome::ALL`'s order.
    pub attempts: [Counter; 4],
    pub processed: Counter,
    pub decisions: Counter,
    pub active: Gauge,
    /// kv_aware: prompt tokens routed here, and those found cached (its hit ratio).
    pub prompt_tokens: Counter,
    pub cached_tokens: Counter,
}

impl GatewayMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        // One statement per series: a family's guard lives to the end of its statement.
        let disagg: Family<DisaggLabels, Counter> = Family::default();
        let disagg_remote = disagg
            .get_or_create(&DisaggLabels {
                decision_type: "prefill-decode",
            })
            .clone();
        let disagg_decode_only = disagg
            .get_or_create(&DisaggLabels {
                decision_type: "decode-only",
            })
            .clone();
        let m = Self {
            pd_prefill: Family::default(),
            pd_decode: Family::default(),
            disagg_remote,
            disagg_decode_only,
            circuit: Family::default(),
            healthy: Family::default(),
            model_list_failures: Family::default(),
            attempts: Family::default(),
            retries: Counter::default(),
            reloads: Family::default(),
            discovery: DiscoveryMetrics::default(),
            tenants: TenantMetrics::default(),
            slo: SloMetrics::default(),
            migrations: Family::default(),
            in_router: Gauge::default(),
            rank_prefill: Family::default(),
            rank_decode: Family::default(),
            ttft_seconds: Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 18),
            ),
            kv_hit_ratio: Histogram::new([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]),
            kv_index_blocks: Gauge::default(),
            kv_index_bytes: Gauge::default(),
            requests: Family::default(),
            by_route: Arc::default(),
            processed: Family::default(),
            decisions: Family::default(),
            active: Family::default(),
            prompt_tokens: Family::default(),
            cached_tokens: Family::default(),
            // 1 µs .. ~16 ms in powers of two.
            routing_seconds: Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(1e-6, 2.0, 15),
            ),
        };
        m.register_routing(registry);
        m.register_load(registry);
        m.register_pd(registry, disagg);
        m.register_resilience(registry);
        m.tenants.register(registry);
        m.slo.register(registry);
        m
    }

    /// Routing: requests, decisions and the per-worker load the policies read.
    fn register_routing(&self, registry: &mut Registry) {
        registry.register(
            "kvroute_requests",
            "Requests answered, by route and HTTP status",
            self.requests.clone(),
        );
        registry.register(
            "kvroute_processed_requests",
            "Requests sent to each worker",
            self.processed.clone(),
        );
        registry.register(
            "kvroute_policy_decisions",
            "Routing decisions, by policy and chosen worker",
            self.decisions.clone(),
        );
        registry.register(
            "kvroute_worker_requests_active",
            "Requests in flight on each worker",
            self.active.clone(),
        );
        registry.register(
            "kvroute_worker_prompt_tokens",
            "kv_aware: prompt tokens routed to each worker",
            self.prompt_tokens.clone(),
        );
        registry.register(
            "kvroute_worker_cached_tokens",
            "kv_aware: prompt tokens routed to each worker that it held cached",
            self.cached_tokens.clone(),
        );
    }

    /// Per-rank load, latency and the KV index.
    fn register_load(&self, registry: &mut Registry) {
        registry.register(
            "kvroute_worker_active_prefill_tokens",
            "Prompt tokens routed to each (worker, rank) that have no first token yet",
            self.rank_prefill.clone(),
        );
        registry.register(
            "kvroute_worker_active_decode_blocks",
            "Distinct KV blocks of the requests still generating on each (worker, rank)",
            self.rank_decode.clone(),
        );
        registry.register(
            "kvroute_time_to_first_token_seconds",
            "Streaming requests: arrival at the router to the first body frame",
            self.ttft_seconds.clone(),
        );
        registry.register(
            "kvroute_kv_hit_ratio",
            "Share of the prompt's blocks cached on the chosen worker (kv_aware)",
            self.kv_hit_ratio.clone(),
        );
        registry.register(
            "kvroute_kv_index_blocks",
            "Distinct KV blocks in the event-fed index",
            self.kv_index_blocks.clone(),
        );
        registry.register(
        "kvroute_kv_index_bytes",
        "Approximate heap bytes of the event-fed KV index (bounded by --router-max-indexed-blocks)",
        self.kv_index_bytes.clone(),
    );
        registry.register(
            "kvroute_routing_seconds",
            "Time spent choosing a worker",
            self.routing_seconds.clone(),
        );
    }

    /// Prefill/decode disaggregation.
    fn register_pd(&self, registry: &mut Registry, disagg: Family<DisaggLabels, Counter>) {
        registry.register(
            "kvroute_pd_prefill_requests",
            "Prefill halves of disaggregated requests sent to each worker",
            self.pd_prefill.clone(),
        );
        registry.register(
        "kvroute_pd_decode_requests",
        "Decode halves of disaggregated requests sent to each worker (decode-only ones included)",
        self.pd_decode.clone(),
    );
        registry.register(
            "kvroute_disagg_decision",
            "Disaggregation decisions: prefill-decode (remote prefill) or decode-only",
            disagg,
        );
    }

    /// Health, retries, reloads, discovery and migration.
    fn register_resilience(&self, registry: &mut Registry) {
        registry.register(
            "kvroute_worker_circuit_state",
            "Each worker's circuit breaker: 0 closed, 1 open, 2 half-open",
            self.circuit.clone(),
        );
        registry.register(
            "kvroute_worker_healthy",
            "Whether each worker passes its health checks (1) or not (0)",
            self.healthy.clone(),
        );
        registry.register(
            "kvroute_worker_model_list_failures",
            "Re-reads of each worker's /v1/models that failed or were malformed (its last good list is kept)",
            self.model_list_failures.clone(),
        );
        registry.register(
            "kvroute_upstream_attempts",
            "Attempts to send a request to a worker, retries included, by outcome",
            self.attempts.clone(),
        );
        registry.register(
        "kvroute_config_reloads",
        "Re-readings of the config file and the API certificate on SIGHUP, by result (ok, error)",
        self.reloads.clone(),
    );
        registry.register(
            "kvroute_request_retries",
            "Attempts after a request's first (each on another worker)",
            self.retries.clone(),
        );
        registry.register(
            "kvroute_requests_in_router",
            "Requests inside the router (admitted and not yet answered in full)",
            self.in_router.clone(),
        );
        self.discovery.register(registry);
        registry.register(
        "kvroute_request_migrations",
        "Streams whose worker failed mid-way, by outcome (migrated, limit_reached, no_worker, not_migratable, completed)",
        self.migrations.clone(),
    );
    }

    /// Drops a removed worker's series (label values stay bounded as workers come and go).
    pub fn forget_worker(&self, worker: &str, policy: &'static str, dp_ranks: &[Option<u32>]) {
        let w = WorkerLabels {
            worker: worker.to_owned(),
        };
        self.circuit.remove(&w);
        self.pd_prefill.remove(&w);
        self.pd_decode.remove(&w);
        self.healthy.remove(&w);
        self.model_list_failures.remove(&w);
        self.processed.remove(&w);
        self.active.remove(&w);
        self.prompt_tokens.remove(&w);
        self.cached_tokens.remove(&w);
        self.decisions.remove(&DecisionLabels {
            policy,
            worker: worker.to_owned(),
        });
        for outcome in Outcome::ALL {
            self.attempts.remove(&AttemptLabels {
                worker: worker.to_owned(),
                outcome: outcome.label(),
            });
        }
        for r in dp_ranks {
            let l = RankLabels {
                worker: worker.to_owned(),
                dp_rank: r.unwrap_or(0).to_string(),
            };
            self.rank_prefill.remove(&l);
            self.rank_decode.remove(&l);
        }
    }

    pub fn request(&self, route: &'static str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                route,
                status: status.into(),
            })
            .inc();
        let Some(by_route) = self.by_route.get() else {
            return;
        };
        let known = by_route.read().ok().and_then(|m| m.get(route).cloned());
        match known {
            Some(c) => {
                c.inc();
            }
            None => {
                if let Ok(mut m) = by_route.write() {
                    m.entry(route).or_default().inc();
                }
            }
        }
    }

    /// Counts requests by route from now on (for [`GatewayMetrics::requests_by_route`]).
    pub fn count_by_route(&self) {
        self.by_route.get_or_init(RwLock::default);
    }

    /// Requests answered since [`GatewayMetrics::count_by_route`], by route (every status).
    pub fn requests_by_route(&self) -> Vec<(&'static str, u64)> {
        self.by_route
            .get()
            .and_then(|m| m.read().ok())
            .map(|m| m.iter().map(|(r, c)| (*r, c.get())).collect())
            .unwrap_or_default()
    }

    pub fn rank_series(&self, worker: &str, dp_rank: Option<u32>) -> RankSeries {
        let l = RankLabels {
            worker: worker.to_owned(),
            dp_rank: dp_rank.unwrap_or(0).to_string(),
        };
        RankSeries {
            prefill_tokens: self.rank_prefill.get_or_create(&l).clone(),
            decode_blocks: self.rank_decode.get_or_create(&l).clone(),
        }
    }

    pub fn worker_series(&self, worker: &str, policy: &'static str) -> WorkerSeries {
        let w = WorkerLabels {
            worker: worker.to_owned(),
        };
        WorkerSeries {
            pd_prefill: self.pd_prefill.get_or_create(&w).clone(),
            pd_decode: self.pd_decode.get_or_create(&w).clone(),
            circuit: self.circuit.get_or_create(&w).clone(),
            healthy: self.healthy.get_or_create(&w).clone(),
            model_list_failures: self.model_list_failures.get_or_create(&w).clone(),
            attempts: Outcome::ALL.map(|outcome| {
                self.attempts
                    .get_or_create(&AttemptLabels {
                        worker: worker.to_owned(),
                        outcome: outcome.label(),
                    })
                    .clone()
            }),
            processed: self.processed.get_or_create(&w).clone(),
            active: self.active.get_or_create(&w).clone(),
            prompt_tokens: self.prompt_tokens.get_or_create(&w).clone(),
            cached_tokens: self.cached_tokens.get_or_create(&w).clone(),
            decisions: self
                .decisions
                .get_or_create(&DecisionLabels {
                    policy,
                    worker: worker.to_owned(),
                })
                .clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_counted_by_route_only_once_asked() {
        let m = GatewayMetrics::register(&mut Registry::default());
        m.request("/v1/completions", 200);
        assert!(m.requests_by_route().is_empty());
        m.count_by_route();
        m.request("/v1/completions", 200);
        m.request("/v1/completions", 503);
        m.request("/v1/models", 200);
        assert_eq!(
            m.requests_by_route(),
            vec![("/v1/completions", 2), ("/v1/models", 1)]
        );
    }
}
