//! The workers, and the routing table readers take as a snapshot.
//!
//! [`WorkerSet`] owns every configured [`Worker`] and publishes a [`RoutingTable`] (model ->
//! [`Pool`] of workers plus that model's policy instance) through an `ArcSwap`: the request
//! path loads it without a lock and never holds anything across an `.await`. The table is
//! rebuilt when a worker's models or health change. Each model pool has its own policy
//! instance, so a round-robin counter or a sticky map is per model.
//!
//! Each worker is watched by [`WorkerSet::watch`] (started by the server for each worker,
//! also for workers added at run time): it probes the worker until it answers once (`GET
//! /v1/models` for a worker whose model is not configured: its models are what it lists,
//! LoRA adapters included; `GET /health` for one whose model is), then checks its health
//! endpoint every interval (see `health`), re-reading the models it lists after each check
//! that passes (adapters come and go at run time; see `monitor`). The router is ready when every worker has been
//! probed at least once and every model has a healthy worker.
//!
//! Workers come and go at run time ([`WorkerSet::add`], [`WorkerSet::remove`]): a removed
//! worker leaves the table at once, its in-flight requests finish (their guards hold it),
//! its background tasks stop, and its policy state is forgotten. Replica ids are never
//! reused, so nothing learnt about a removed worker can be credited to a new one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use kvroute_core::{Policy, PolicyConfig, PolicyKind, RankLoad};
use kvroute_index::ReplicaId;
use kvroute_protocol::{ModelId, WorkerId};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::auth::Secret;
use crate::config::{CircuitSettings, HealthSettings, PdSettings, Settings, WorkerSpec};
use crate::engine_metrics::EngineGauges;
use crate::error::GatewayError;
use crate::health::Circuit;
use crate::metrics::GatewayMetrics;

mod monitor;

pub use monitor::Watched;
mod published;
mod sampling;
mod table;
mod worker;

pub use sampling::{ActiveFirsts, Sampling, CLUSTER_REFRESH};
pub use table::{Half, Pool, RankStatus, RoutingTable, WorkerStatus};
pub(crate) use worker::LatencySample;
pub use worker::{Rank, Worker};

const PROBE_RETRY_MIN: Duration = Duration::from_millis(500);
const PROBE_RETRY_MAX: Duration = Duration::from_secs(10);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Every worker, and the routing table built from them.
#[derive(Debug)]
pub struct WorkerSet {
    workers: ArcSwap<Vec<Arc<Worker>>>,
    /// Serialises changes of the worker list.
    changes: Mutex<()>,
    /// Serialises rebuilds of the routing table: two probes finishing at once must not store
    /// their tables in the other order (the older one, missing a worker, last).
    rebuilds: Mutex<()>,
    next_replica: AtomicU32,
    /// `--router-sample-ranks`, and the active requests' first blocks its decisions read
    /// (`None`: never sampled, `--router-sample-ranks 0`).
    sample_ranks: Option<usize>,
    firsts: Option<Arc<ActiveFirsts>>,
    table: ArcSwap<RoutingTable>,
    policy: PolicyKind,
    policy_config: PolicyConfig,
    policies: Mutex<HashMap<ModelId, Arc<dyn Policy>>>,
    /// With disaggregation: each model's prefill and decode policies.
    pd: Option<PdSettings>,
    pd_policies: Mutex<HashMap<(ModelId, Half), Arc<dyn Policy>>>,
    ready: watch::Sender<bool>,
    metrics: GatewayMetrics,
    circuit: Option<CircuitSettings>,
    health: HealthSettings,
    /// `Authorization` for the workers' probes (`--api-key`).
    api_key: Option<http::HeaderValue>,
    /// The gateway's shutdown; each worker's tasks token is a child of it.
    shutdown: CancellationToken,
}

impl WorkerSet {
    pub fn new(settings: &Settings, metrics: &GatewayMetrics) -> Self {
        let set = Self {
            workers: ArcSwap::from_pointee(Vec::new()),
            changes: Mutex::new(()),
            rebuilds: Mutex::new(()),
            next_replica: AtomicU32::new(0),
            sample_ranks: settings.sample_ranks,
            firsts: (settings.sample_ranks != Some(0)).then(Arc::default),
            table: ArcSwap::from_pointee(RoutingTable::default()),
            policy: settings.policy,
            policy_config: settings.policy_config.clone(),
            policies: Mutex::new(HashMap::new()),
            pd: settings.pd.clone(),
            pd_policies: Mutex::new(HashMap::new()),
            ready: watch::channel(false).0,
            metrics: metrics.clone(),
            circuit: settings.circuit,
            health: settings.health.clone(),
            api_key: settings.api_key.as_ref().and_then(Secret::bearer),
            shutdown: CancellationToken::new(),
        };
        let workers = settings.workers.iter().map(|s| set.build(s)).collect();
        set.workers.store(Arc::new(workers));
        set.rebuild();
        set
    }

    fn build(&self, s: &WorkerSpec) -> Arc<Worker> {
        let id = s.id.clone().unwrap_or_else(|| s.url.clone());
        let ranks = s
            .ranks()
            .into_iter()
            .map(|dp_rank| {
                let engine = Arc::new(EngineGauges::new());
                engine.set_num_gpu_blocks(s.num_gpu_blocks);
                Rank {
                    dp_rank,
                    replica: ReplicaId(self.next_replica.fetch_add(1, Ordering::Relaxed)),
                    in_flight: AtomicU64::new(0),
                    load: Mutex::new(RankLoad::default()),
                    series: self.metrics.rank_series(&id, dp_rank),
                    engine,
                    busy_latch: AtomicBool::new(false),
                    latency: Mutex::new(Default::default()),
                    recent_adapters: Mutex::default(),
                    published: Default::default(),
                    firsts: self.firsts.clone(),
                }
            })
            .collect();
        let series = self.metrics.worker_series(&id, self.policy.name());
        series.healthy.set(0);
        Arc::new(Worker {
            circuit: Circuit::new(self.circuit, series.circuit.clone()),
            series,
            id: WorkerId::new(id),
            url: s.url.clone(),
            ranks,
            taints: s.taints.clone(),
            max_num_batched_tokens: s.max_num_batched_tokens,
            role: s.role,
            bootstrap_port: s.bootstrap_port,
            kv_events: s.kv_events.clone(),
            kv_events_replay: s.kv_events_replay.clone(),
            configured_model: s.model.as_deref().map(ModelId::new),
            spec: s.clone(),
            models: Mutex::new(Vec::new()),
            context: AtomicU64::new(0),
            probed: AtomicBool::new(false),
            last_error: Mutex::new(None),
            healthy: watch::channel(false).0,
            healthy_now: AtomicBool::new(false),
            in_flight: AtomicU64::new(0),
            tasks: self.shutdown.child_token(),
        })
    }

    /// Adds a worker (its spec validated by the caller); the caller starts its tasks.
    pub fn add(&self, spec: &WorkerSpec) -> Result<Arc<Worker>, GatewayError> {
        let _change = lock(&self.changes);
        let id = spec.id.clone().unwrap_or_else(|| spec.url.clone());
        let current = self.workers.load_full();
        if current.iter().any(|w| w.id.as_str() == id) {
            return Err(GatewayError::WorkerExists(id));
        }
        let worker = self.build(spec);
        let mut next = current.as_ref().clone();
        next.push(worker.clone());
        self.workers.store(Arc::new(next));
        self.rebuild();
        tracing::info!(worker = %worker.id, url = %worker.url, "Worker added");
        Ok(worker)
    }

    /// Removes a worker: out of the table at once, its tasks stopped, its policy state
    /// forgotten. Its in-flight requests finish; the caller forgets its KV blocks.
    pub fn remove(&self, id: &str) -> Result<Arc<Worker>, GatewayError> {
        let _change = lock(&self.changes);
        let current = self.workers.load_full();
        let Some(worker) = current.iter().find(|w| w.id.as_str() == id).cloned() else {
            return Err(GatewayError::UnknownWorker(id.to_owned()));
        };
        let next: Vec<Arc<Worker>> = current
            .iter()
            .filter(|w| w.id.as_str() != id)
            .cloned()
            .collect();
        self.workers.store(Arc::new(next));
        worker.tasks.cancel();
        self.rebuild();
        for p in self.all_policies() {
            p.forget_worker(&worker.id);
        }
        let ranks: Vec<Option<u32>> = worker.ranks.iter().map(|r| r.dp_rank).collect();
        self.metrics
            .forget_worker(worker.id.as_str(), self.policy.name(), &ranks);
        tracing::info!(worker = %worker.id, in_flight = worker.in_flight(), "Worker removed; its in-flight requests finish");
        Ok(worker)
    }

    /// The gateway's shutdown: cancelling it stops every worker's tasks too.
    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// The current routing table (lock-free).
    pub fn table(&self) -> arc_swap::Guard<Arc<RoutingTable>> {
        self.table.load()
    }

    /// The current workers (a snapshot).
    pub fn workers(&self) -> Arc<Vec<Arc<Worker>>> {
        self.workers.load_full()
    }

    pub fn get(&self, id: &str) -> Option<Arc<Worker>> {
        self.workers
            .load()
            .iter()
            .find(|w| w.id.as_str() == id)
            .cloned()
    }

    /// Periodic upkeep of every model's policy (cache_aware's eviction).
    pub fn maintain(&self, now: std::time::Instant) {
        for p in self.all_policies() {
            p.maintain(now);
        }
    }

    /// Every policy instance: each model's, and each disaggregated half's.
    fn all_policies(&self) -> Vec<Arc<dyn Policy>> {
        let mut policies: Vec<Arc<dyn Policy>> = lock(&self.policies).values().cloned().collect();
        policies.extend(lock(&self.pd_policies).values().cloned());
        policies
    }

    /// Marks a worker healthy or not (probes and health checks; benchmarks set it directly).
    pub fn set_healthy(&self, id: &str, healthy: bool) {
        for w in self.workers.load().iter().filter(|w| w.id.as_str() == id) {
            w.set_health(healthy);
            w.probed.store(true, Ordering::Relaxed);
        }
        self.rebuild();
    }

    pub fn statuses(&self) -> Vec<WorkerStatus> {
        self.workers
            .load()
            .iter()
            .map(|w| WorkerStatus {
                id: w.id.to_string(),
                url: w.url.clone(),
                models: w.model_ids().iter().map(|m| m.to_string()).collect(),
                max_model_len: w.max_model_len(),
                healthy: w.is_healthy(),
                circuit: w.circuit.state().name(),
                probed: w.probed.load(Ordering::Relaxed),
                last_error: w.last_error(),
                in_flight: w.in_flight(),
                ranks: w
                    .ranks
                    .iter()
                    .map(|r| {
                        let (prefill, decode) =
                            r.with_load(|l| (l.prefill_tokens(), l.decode_blocks()));
                        RankStatus {
                            dp_rank: r.dp_rank,
                            in_flight: r.in_flight(),
                            active_prefill_tokens: prefill,
                            active_decode_blocks: decode,
                        }
                    })
                    .collect(),
                source: w.spec.source.name(),
                pod: w.spec.source.pod().map(str::to_owned),
            })
            .collect()
    }

    /// Receives `true` once the router is ready (see the module docs).
    pub fn subscribe_ready(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }
}
