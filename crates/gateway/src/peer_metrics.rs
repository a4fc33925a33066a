//! `--metrics-compat`: the peers' metric names, read from kvroute's own counts at scrape time.
//!
//! [`PeerMetrics`] is a Prometheus collector registered only when a peer is named. Each
//! scrape reads the workers' series (the same atomics `kvroute_*` exports) and writes them
//! under vllm-router's, smg's or llm-d's endpoint picker's names, label names and value
//! spellings (and, for llm-d, the `inference_pool_*` names that llm-d-router still writes and
//! GIE's Grafana dashboard reads), so the two views never disagree and nothing is counted
//! twice. The worker label is the worker's URL as given (llm-d's `model_server_endpoint` is
//! the worker's id, the endpoint's name in EPP mode). A family kvroute has no count for is not
//! exported (`docs/observability.md`, "Peers' metric names", lists them).

use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use crate::config::{MetricsCompat, MetricsPeer, Settings, WorkerRole};
use crate::metrics::GatewayMetrics;
use crate::workers::{Worker, WorkerSet};

type Labels = Vec<(&'static str, String)>;
type Counters = Family<Labels, Counter>;
type Gauges = Family<Labels, Gauge<f64, AtomicU64>>;

/// The peers' families over kvroute's counts (see the module docs).
#[derive(Debug)]
pub struct PeerMetrics {
    compat: MetricsCompat,
    workers: Arc<WorkerSet>,
    metrics: GatewayMetrics,
    /// The routing policy, as `kvroute_policy_decisions_total` names it.
    policy: &'static str,
    /// Disaggregated serving: the P/D families are exported.
    pd: bool,
    /// llm-d's `name` label: the InferencePool's name, empty without one.
    pool: String,
}

impl PeerMetrics {
    /// Registers the collector when `--metrics-compat` names a peer; otherwise nothing.
    pub fn register(
        settings: &Settings,
        workers: &Arc<WorkerSet>,
        metrics: &GatewayMetrics,
        registry: &mut prometheus_client::registry::Registry,
    ) {
        if settings.metrics_compat.peers.is_empty() {
            return;
        }
        let pool = match settings.epp.as_ref().map(|e| &e.endpoints) {
            Some(crate::config::EppEndpoints::Pool(p)) => p.name.clone(),
            _ => String::new(),
        };
        metrics.count_by_route();
        registry.register_collector(Box::new(PeerMetrics {
            compat: settings.metrics_compat.clone(),
            workers: workers.clone(),
            metrics: metrics.clone(),
            policy: settings.policy.name(),
            pd: settings.pd.is_some(),
            pool,
        }));
    }
}

/// One worker's values at the scrape.
struct Reading {
    url: String,
    id: String,
    role: WorkerRole,
    /// smg's `worker_type`: regular, prefill or decode.
    worker_type: &'static str,
    models: Vec<String>,
    processed: u64,
    /// Times the router chose it: a prefill worker's prefill halves, others' decisions.
    selections: u64,
    pd_prefill: u64,
    pd_decode: u64,
    active: f64,
    healthy: f64,
    circuit: f64,
    /// The engine's waiting requests (summed over its ranks) and KV-cache use (their mean),
    /// when a fresh reading has them.
    waiting: Option<f64>,
    running: Option<f64>,
    kv_usage: Option<f64>,
}

impl Reading {
    fn of(w: &Worker, now: Instant) -> Self {
        let loads: Vec<_> = w.ranks.iter().map(|r| r.engine.load(now)).collect();
        let waiting = loads.iter().map(|l| l.waiting).sum::<Option<f64>>();
        let running = loads.iter().map(|l| l.running).sum::<Option<f64>>();
        let kv_usage = loads
            .iter()
            .map(|l| l.kv_usage)
            .sum::<Option<f64>>()
            .map(|s| s / loads.len().max(1) as f64);
        Reading {
            url: w.url.clone(),
            id: w.id.as_str().to_owned(),
            role: w.role,
            worker_type: match w.role {
                WorkerRole::Prefill => "prefill",
                WorkerRole::Decode => "decode",
                WorkerRole::Both => "regular",
            },
            models: w.model_ids().iter().map(|m| m.to_string()).collect(),
            processed: w.series.processed.get(),
            selections: match w.role {
                WorkerRole::Prefill => w.series.pd_prefill.get(),
                _ => w.series.decisions.get(),
            },
            pd_prefill: w.series.pd_prefill.get(),
            pd_decode: w.series.pd_decode.get(),
            active: w.series.active.get() as f64,
            healthy: w.series.healthy.get() as f64,
            circuit: w.series.circuit.get() as f64,
            waiting,
            running,
            kv_usage,
        }
    }
}

/// Writes one family under `name` (a counter's `_total` is added by the encoder).
fn emit<M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: &M,
) -> fmt::Result {
    metric.encode(enc.encode_descriptor(name, help, None, metric.metric_type())?)
}

/// A family of one counter per worker, labelled `worker` with its URL.
fn per_worker_counter(rs: &[Reading], value: impl Fn(&Reading) -> u64) -> Counters {
    let f = Counters::default();
    for r in rs {
        f.get_or_create(&vec![("worker", r.url.clone())])
            .inc_by(value(r));
    }
    f
}

fn per_worker_gauge(rs: &[Reading], value: impl Fn(&Reading) -> f64) -> Gauges {
    let f = Gauges::default();
    for r in rs {
        f.get_or_create(&vec![("worker", r.url.clone())])
            .set(value(r));
    }
    f
}

impl PeerMetrics {
    fn vllm_router(&self, enc: &mut DescriptorEncoder, rs: &[Reading]) -> fmt::Result {
        // vllm-router counts a P/D request's prefill worker as processed and decided too
        // (`selections`: a prefill worker's prefill halves).
        let processed = per_worker_counter(rs, |r| match r.role {
            WorkerRole::Prefill => r.pd_prefill,
            _ => r.processed,
        });
        emit(
            enc,
            "vllm_router_processed_requests",
            "Total requests processed by each worker",
            &processed,
        )?;
        let decisions = Counters::default();
        for r in rs {
            decisions
                .get_or_create(&vec![
                    ("policy", self.policy.to_owned()),
                    ("worker", r.url.clone()),
                ])
                .inc_by(r.selections);
        }
        emit(
            enc,
            "vllm_router_policy_decisions",
            "Total routing policy decisions by policy and worker",
            &decisions,
        )?;
        if self.pd {
            // Each family over the workers of its role only, as vllm-router writes them;
            // and no `requests`, `active_workers` or `cb_state`: vllm-router 0.1.17 writes
            // none of them in P/D mode.
            let of_role = |role: WorkerRole| -> Vec<&Reading> {
                rs.iter()
                    .filter(|r| r.role == role || r.role == WorkerRole::Both)
                    .collect()
            };
            let prefill = Counters::default();
            for r in of_role(WorkerRole::Prefill) {
                prefill
                    .get_or_create(&vec![("worker", r.url.clone())])
                    .inc_by(r.pd_prefill);
            }
            emit(
                enc,
                "vllm_router_pd_prefill_requests",
                "Total prefill requests per worker",
                &prefill,
            )?;
            let decode = Counters::default();
            for r in of_role(WorkerRole::Decode) {
                decode
                    .get_or_create(&vec![("worker", r.url.clone())])
                    .inc_by(r.pd_decode);
            }
            emit(
                enc,
                "vllm_router_pd_decode_requests",
                "Total decode requests per worker",
                &decode,
            )?;
            let health = per_worker_gauge(rs, |r| r.healthy);
            return emit(
                enc,
                "vllm_router_worker_health",
                "Worker health status (1=healthy, 0=unhealthy)",
                &health,
            );
        }
        let requests = Counters::default();
        for (route, n) in self.metrics.requests_by_route() {
            requests
                .get_or_create(&vec![("route", route.to_owned())])
                .inc_by(n);
        }
        emit(
            enc,
            "vllm_router_requests",
            "Total number of requests by route and method",
            &requests,
        )?;
        let health = per_worker_gauge(rs, |r| r.healthy);
        emit(
            enc,
            "vllm_router_worker_health",
            "Worker health status (1=healthy, 0=unhealthy)",
            &health,
        )?;
        let active_workers: Gauge<f64, AtomicU64> = Gauge::default();
        active_workers.set(rs.len() as f64);
        emit(
            enc,
            "vllm_router_active_workers",
            "Number of currently active workers",
            &active_workers,
        )?;
        let cb = per_worker_gauge(rs, |r| r.circuit);
        emit(
            enc,
            "vllm_router_cb_state",
            "Circuit breaker state per worker (0=closed, 1=open, 2=half_open)",
            &cb,
        )
    }

    fn smg(&self, enc: &mut DescriptorEncoder, rs: &[Reading]) -> fmt::Result {
        let p = &self.compat.smg_prefix;
        let active = per_worker_gauge(rs, |r| r.active);
        emit(
            enc,
            &format!("{p}_worker_requests_active"),
            "Currently running requests per worker",
            &active,
        )?;
        // A worker serving several models cannot split its count by model: left out.
        let selection = Counters::default();
        for r in rs.iter().filter(|r| r.models.len() == 1) {
            selection
                .get_or_create(&vec![
                    ("worker_type", r.worker_type.to_owned()),
                    ("connection_mode", "http".to_owned()),
                    ("model", r.models[0].clone()),
                    ("policy", self.policy.to_owned()),
                ])
                .inc_by(r.selections);
        }
        emit(
            enc,
            &format!("{p}_worker_selection"),
            "Worker selection events by worker_type, connection_mode, model, policy",
            &selection,
        )?;
        // smg counts every registered worker, healthy or not, in each model it serves.
        let pool_size = Gauges::default();
        for r in rs {
            for model in &r.models {
                pool_size
                    .get_or_create(&vec![
                        ("worker_type", r.worker_type.to_owned()),
                        ("connection_mode", "http".to_owned()),
                        ("model", model.clone()),
                    ])
                    .inc();
            }
        }
        emit(
            enc,
            &format!("{p}_worker_pool_size"),
            "Current worker pool size by worker_type, connection_mode, model",
            &pool_size,
        )?;
        let health = per_worker_gauge(rs, |r| r.healthy);
        emit(
            enc,
            &format!("{p}_worker_health"),
            "Worker health status (1=healthy, 0=unhealthy)",
            &health,
        )?;
        let cb = per_worker_gauge(rs, |r| r.circuit);
        emit(
            enc,
            &format!("{p}_worker_cb_state"),
            "Circuit breaker state per worker (0=closed, 1=open, 2=half_open)",
            &cb,
        )
    }

    fn llm_d(&self, enc: &mut DescriptorEncoder, rs: &[Reading]) -> fmt::Result {
        // An engine not read yet (or not scraped: round robin needs no engine metrics) is
        // NaN, "unknown", never a made-up 0.
        let queue = Gauges::default();
        for r in rs {
            queue
                .get_or_create(&vec![
                    ("name", self.pool.clone()),
                    ("model_server_endpoint", r.id.clone()),
                ])
                .set(r.waiting.unwrap_or(f64::NAN));
        }
        emit(
            enc,
            "llm_d_epp_per_endpoint_queue_size",
            "The total number of requests pending in the model server queue for each underlying endpoint.",
            &queue,
        )?;
        let per_pod = Gauges::default();
        for r in rs {
            per_pod
                .get_or_create(&vec![
                    ("name", self.pool.clone()),
                    ("model_server_pod", r.id.clone()),
                ])
                .set(r.waiting.unwrap_or(f64::NAN));
        }
        emit(
            enc,
            "inference_pool_per_pod_queue_size",
            "The total number of requests pending in the model server queue for each underlying pod.",
            &per_pod,
        )?;
        self.pool_gauges(enc, rs)?;
        // The time spent choosing an endpoint: `kvroute_routing_seconds`, with its buckets
        // (1 µs to 16 ms), not llm-d's (100 µs to 100 ms).
        emit(
            enc,
            "llm_d_epp_scheduler_e2e_duration_seconds",
            "End-to-end scheduling latency distribution in seconds.",
            &self.metrics.routing_seconds,
        )?;
        if self.pd {
            let disagg = Counters::default();
            let remote = self.metrics.disagg_remote.get();
            let local = self.metrics.disagg_decode_only.get();
            for (kind, n) in [("prefill-decode", remote), ("decode-only", local)] {
                disagg
                    .get_or_create(&vec![("decision_type", kind.to_owned())])
                    .inc_by(n);
            }
            emit(
                enc,
                "llm_d_epp_disagg_decision",
                "Total number of disaggregation routing decisions made",
                &disagg,
            )?;
        }
        Ok(())
    }

    /// The pool's gauges, each under llm-d's name and under GIE's `inference_pool_*` name,
    /// which llm-d-router still writes (deprecated) and GIE's Grafana dashboard reads. An
    /// average is left out while no endpoint has a fresh engine reading.
    fn pool_gauges(&self, enc: &mut DescriptorEncoder, rs: &[Reading]) -> fmt::Result {
        let pool = |v: f64| {
            let g = Gauges::default();
            g.get_or_create(&vec![("name", self.pool.clone())]).set(v);
            g
        };
        let mean = |v: Vec<f64>| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        let ready = rs.iter().filter(|r| r.healthy > 0.0).count() as f64;
        let gauges = [
            (
                [
                    "average_kv_cache_utilization",
                    "average_kv_cache_utilization",
                ],
                ["The average kv cache utilization for an inference server pool."; 2],
                mean(rs.iter().filter_map(|r| r.kv_usage).collect()),
            ),
            (
                ["average_queue_size", "average_queue_size"],
                ["The average number of requests pending in the model server queue."; 2],
                mean(rs.iter().filter_map(|r| r.waiting).collect()),
            ),
            (
                ["average_running_requests", "average_running_requests"],
                ["The average number of running requests across model servers in the pool."; 2],
                mean(rs.iter().filter_map(|r| r.running).collect()),
            ),
            (
                ["ready_endpoints", "ready_pods"],
                [
                    "The number of ready endpoints in the inference server pool.",
                    "The number of ready pods in the inference server pool.",
                ],
                Some(ready),
            ),
        ];
        for ([llm_d, gie], [llm_d_help, gie_help], value) in gauges {
            let Some(v) = value else { continue };
            emit(enc, &format!("llm_d_epp_{llm_d}"), llm_d_help, &pool(v))?;
            emit(enc, &format!("inference_pool_{gie}"), gie_help, &pool(v))?;
        }
        Ok(())
    }
}

impl Collector for PeerMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let now = Instant::now();
        let rs: Vec<Reading> = self
            .workers
            .workers()
            .iter()
            .map(|w| Reading::of(w, now))
            .collect();
        for peer in &self.compat.peers {
            match peer {
                MetricsPeer::VllmRouter => self.vllm_router(&mut enc, &rs)?,
                MetricsPeer::Smg => self.smg(&mut enc, &rs)?,
                MetricsPeer::LlmD => self.llm_d(&mut enc, &rs)?,
            }
        }
        Ok(())
    }
}
