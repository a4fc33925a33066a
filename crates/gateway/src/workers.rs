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
//! endpoint every interval (see `health`). The router is ready when every worker has been
//! probed at least once and every model has a healthy worker.
//!
//! Workers come and go at run time ([`WorkerSet::add`], [`WorkerSet::remove`]): a removed
//! worker leaves the table at once, its in-flight requests finish (their guards hold it),
//! its background tasks stop, and its policy state is forgotten. Replica ids are never
//! reused, so nothing learnt about a removed worker can be credited to a new one.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use kvroute_core::eligibility::{BusyThresholds, RankPressure};
use kvroute_core::{build_policy, Policy, PolicyConfig, PolicyKind, RankLoad, RequestLoad};
use kvroute_index::ReplicaId;
use kvroute_protocol::{ModelId, WorkerId};
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::auth::Secret;
use crate::config::{
    CircuitSettings, HealthSettings, PdSettings, Settings, WorkerRole, WorkerSpec,
};
use crate::engine_metrics::EngineGauges;
use crate::error::GatewayError;
use crate::health::Circuit;
use crate::metrics::{GatewayMetrics, RankSeries, WorkerSeries};

mod probe;

const PROBE_RETRY_MIN: Duration = Duration::from_millis(500);
const PROBE_RETRY_MAX: Duration = Duration::from_secs(10);

/// One data-parallel rank of a worker (the whole worker when it has no ranks): the unit
/// `kv_aware` scores, with its active load.
#[derive(Debug)]
pub struct Rank {
    /// vLLM's data-parallel rank, sent as `X-data-parallel-rank`; `None` without ranks.
    pub dp_rank: Option<u32>,
    /// The rank's id in the KV indexes.
    pub replica: ReplicaId,
    in_flight: AtomicU64,
    load: Mutex<RankLoad>,
    series: RankSeries,
    /// What the engine reports of this rank (scraped when the policy needs it).
    pub engine: Arc<EngineGauges>,
    /// The decode busy threshold's latch (see `BusyThresholds::overloaded`).
    busy_latch: AtomicBool,
}

impl Rank {
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Reads the rank's load accounting under its lock (no copy: the block map can be large).
    pub fn with_load<R>(&self, f: impl FnOnce(&RankLoad) -> R) -> R {
        f(&lock(&self.load))
    }

    fn update(&self, f: impl FnOnce(&mut RankLoad)) {
        let mut load = lock(&self.load);
        f(&mut load);
        self.series.prefill_tokens.set(load.prefill_tokens() as i64);
        self.series.decode_blocks.set(load.decode_blocks() as i64);
    }

    /// Whether `thresholds` call this rank overloaded now (updates the decode latch).
    pub fn overloaded(
        &self,
        thresholds: &BusyThresholds,
        max_num_batched_tokens: Option<u64>,
        now: std::time::Instant,
    ) -> bool {
        if *thresholds == BusyThresholds::default() {
            return false;
        }
        let (prefill_tokens, decode_blocks) =
            self.with_load(|l| (l.prefill_tokens(), l.decode_blocks()));
        let engine = self.engine.load(now);
        let pressure = RankPressure {
            prefill_tokens,
            decode_blocks,
            engine_kv_usage: engine.kv_usage,
            num_gpu_blocks: engine.num_gpu_blocks,
            max_num_batched_tokens,
        };
        let mut latch = self.busy_latch.load(Ordering::Relaxed);
        let overloaded = thresholds.overloaded(&pressure, &mut latch);
        self.busy_latch.store(latch, Ordering::Relaxed);
        overloaded
    }

    pub(crate) fn start(&self, load: &RequestLoad) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.update(|l| l.start(load));
    }

    pub(crate) fn first_token(&self, load: &RequestLoad) {
        self.update(|l| l.first_token(load));
    }

    pub(crate) fn finish(&self, load: &RequestLoad, prefilling: bool) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.update(|l| l.finish(load, prefilling));
    }
}

/// One engine replica.
#[derive(Debug)]
pub struct Worker {
    pub id: WorkerId,
    /// Base URL, without a trailing slash.
    pub url: String,
    /// Its data-parallel ranks (one entry, rank `None`, when it has none).
    pub ranks: Vec<Rank>,
    /// Labels requests can require or prefer.
    pub taints: Vec<String>,
    /// The engine's max_num_batched_tokens, when configured.
    pub max_num_batched_tokens: Option<u64>,
    /// Its part in prefill/decode disaggregation.
    pub role: WorkerRole,
    /// Its bootstrap port (SGLang's disaggregation), when a prefill worker has one.
    pub bootstrap_port: Option<u16>,
    /// Its KV-event publisher and replay socket, if configured.
    pub kv_events: Option<String>,
    pub kv_events_replay: Option<String>,
    configured_model: Option<ModelId>,
    /// The (validated) spec it was built from, which a config reload compares.
    pub(crate) spec: WorkerSpec,
    /// The `/v1/models` entries it serves, once probed.
    models: Mutex<Vec<(ModelId, serde_json::Value)>>,
    probed: AtomicBool,
    /// Passes its health checks (sends on change: the KV-event subscription follows it).
    healthy: watch::Sender<bool>,
    in_flight: AtomicU64,
    pub(crate) series: WorkerSeries,
    /// Opened by failed requests.
    pub circuit: Circuit,
    /// Cancelled when the worker is removed: stops its health checks and subscriptions.
    pub tasks: CancellationToken,
}

impl Worker {
    /// The scraper of its engine's `/metrics`, feeding its ranks' gauges.
    pub fn metrics_scraper(
        &self,
        timing: crate::engine_metrics::ScrapeTiming,
    ) -> Result<crate::engine_metrics::EngineMetricsScraper, crate::engine_metrics::ScrapeError>
    {
        let ranks = self
            .ranks
            .iter()
            .map(|r| (r.dp_rank, r.engine.clone()))
            .collect();
        crate::engine_metrics::EngineMetricsScraper::new(
            self.id.to_string(),
            &self.url,
            ranks,
            timing,
        )
    }

    /// Where to subscribe to its KV events, when it publishes them.
    pub fn kv_subscriber_config(
        &self,
        router_block_size: usize,
    ) -> Option<crate::kv_events::SubscriberConfig> {
        Some(crate::kv_events::SubscriberConfig {
            worker: self.id.to_string(),
            endpoint: self.kv_events.clone()?,
            replay_endpoint: self.kv_events_replay.clone(),
            dp_start_rank: self.ranks[0].dp_rank.unwrap_or(0),
            dp_size: self.ranks.len() as u32,
            router_block_size,
        })
    }

    /// Its rank `dp_rank`.
    pub fn rank(&self, dp_rank: Option<u32>) -> Option<&Rank> {
        self.ranks.iter().find(|r| r.dp_rank == dp_rank)
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn is_healthy(&self) -> bool {
        *self.healthy.borrow()
    }

    /// Changes of its health (the current value first).
    pub fn subscribe_health(&self) -> watch::Receiver<bool> {
        self.healthy.subscribe()
    }

    fn set_health(&self, healthy: bool) {
        self.series.healthy.set(i64::from(healthy));
        if self.healthy.send_replace(healthy) != healthy && healthy {
            self.circuit.reset();
        }
    }

    /// Whether it may take a request now: healthy, and its circuit lets one through.
    pub fn available(&self, now: std::time::Instant) -> bool {
        self.is_healthy() && self.circuit.allows(now)
    }

    pub(crate) fn begin_request(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.series.active.inc();
    }

    pub(crate) fn end_request(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.series.active.dec();
    }

    fn model_ids(&self) -> Vec<ModelId> {
        match &self.configured_model {
            Some(m) => vec![m.clone()],
            None => lock(&self.models).iter().map(|(m, _)| m.clone()).collect(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The workers serving one model, and that model's policy.
#[derive(Debug)]
pub struct Pool {
    pub model: ModelId,
    pub workers: Vec<Arc<Worker>>,
    pub policy: Arc<dyn Policy>,
}

/// One half of a disaggregated request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Half {
    Prefill,
    Decode,
}

/// Model -> pool, as of the last change.
#[derive(Debug, Default)]
pub struct RoutingTable {
    pools: BTreeMap<ModelId, Pool>,
    /// With disaggregation: each model's prefill and decode workers, with their policies.
    prefill: BTreeMap<ModelId, Pool>,
    decode: BTreeMap<ModelId, Pool>,
    /// The union of the workers' `/v1/models` entries, one per model.
    cards: Vec<serde_json::Value>,
    /// Whether every worker had been probed when the table was built.
    complete: bool,
}

impl RoutingTable {
    /// The pool for the request's `model`: that model's, or the only one when the request
    /// names none.
    pub fn resolve(&self, model: Option<&str>) -> Result<&Pool, GatewayError> {
        self.resolve_in(&self.pools, model)
    }

    /// The prefill or decode pool of the request's model (disaggregation).
    pub fn resolve_half(&self, half: Half, model: Option<&str>) -> Result<&Pool, GatewayError> {
        let pools = match half {
            Half::Prefill => &self.prefill,
            Half::Decode => &self.decode,
        };
        let pool = self.resolve(model)?;
        pools
            .get(&pool.model)
            .ok_or(GatewayError::NoEndpoint(match half {
                Half::Prefill => "no prefill worker serves this model",
                Half::Decode => "no decode worker serves this model",
            }))
    }

    fn resolve_in<'a>(
        &'a self,
        pools: &'a BTreeMap<ModelId, Pool>,
        model: Option<&str>,
    ) -> Result<&'a Pool, GatewayError> {
        match model {
            Some(name) => pools.get(name).ok_or_else(|| {
                if self.complete {
                    GatewayError::UnknownModel(name.to_owned())
                } else {
                    GatewayError::NoEndpoint("workers are still being probed for their models")
                }
            }),
            None => {
                let mut pools = pools.values();
                match (pools.next(), pools.next()) {
                    (Some(only), None) => Ok(only),
                    (None, _) => Err(GatewayError::NoEndpoint("no worker serves any model yet")),
                    (Some(_), Some(_)) => Err(GatewayError::ModelRequired {
                        models: self
                            .pools
                            .keys()
                            .map(ModelId::as_str)
                            .collect::<Vec<_>>()
                            .join(", "),
                    }),
                }
            }
        }
    }

    /// Every pool with its role: each model's own (`None`), and with disaggregation its
    /// prefill and decode pools.
    pub fn every_pool(&self) -> impl Iterator<Item = (Option<Half>, &Pool)> {
        let own = self.pools.values().map(|p| (None, p));
        let prefill = self.prefill.values().map(|p| (Some(Half::Prefill), p));
        let decode = self.decode.values().map(|p| (Some(Half::Decode), p));
        own.chain(prefill).chain(decode)
    }

    /// The models served.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.pools.keys().map(ModelId::as_str)
    }

    pub fn model_cards(&self) -> &[serde_json::Value] {
        &self.cards
    }
}

/// A worker as `GET /workers` shows it.
#[derive(Debug, Serialize)]
pub struct WorkerStatus {
    pub id: String,
    pub url: String,
    pub models: Vec<String>,
    pub healthy: bool,
    /// The circuit breaker: closed, open or half_open.
    pub circuit: &'static str,
    pub probed: bool,
    pub in_flight: u64,
    pub ranks: Vec<RankStatus>,
}

/// A rank as `GET /workers` shows it.
#[derive(Debug, Serialize)]
pub struct RankStatus {
    pub dp_rank: Option<u32>,
    pub in_flight: u64,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
}

/// Every worker, and the routing table built from them.
#[derive(Debug)]
pub struct WorkerSet {
    workers: ArcSwap<Vec<Arc<Worker>>>,
    /// Serialises changes of the worker list.
    changes: Mutex<()>,
    next_replica: AtomicU32,
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
            next_replica: AtomicU32::new(0),
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
            probed: AtomicBool::new(false),
            healthy: watch::channel(false).0,
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
                healthy: w.is_healthy(),
                circuit: w.circuit.state().name(),
                probed: w.probed.load(Ordering::Relaxed),
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

    fn rebuild(&self) {
        let workers = self.workers.load_full();
        let mut members: BTreeMap<ModelId, Vec<Arc<Worker>>> = BTreeMap::new();
        let mut cards: BTreeMap<ModelId, serde_json::Value> = BTreeMap::new();
        for w in workers.iter() {
            for m in w.model_ids() {
                members.entry(m).or_default().push(w.clone());
            }
            if let Some(m) = &w.configured_model {
                cards
                    .entry(m.clone())
                    .or_insert_with(|| default_card(m.as_str()));
            }
            for (m, card) in lock(&w.models).iter() {
                cards.entry(m.clone()).or_insert_with(|| card.clone());
            }
        }
        let mut policies = lock(&self.policies);
        let pools: BTreeMap<ModelId, Pool> = members
            .into_iter()
            .map(|(model, workers)| {
                let policy = policies
                    .entry(model.clone())
                    .or_insert_with(|| build_policy(self.policy, &self.policy_config).into())
                    .clone();
                let pool = Pool {
                    model: model.clone(),
                    workers,
                    policy,
                };
                (model, pool)
            })
            .collect();
        drop(policies);
        let (mut prefill, mut decode) = (BTreeMap::new(), BTreeMap::new());
        if let Some(pd) = &self.pd {
            let mut pd_policies = lock(&self.pd_policies);
            for (model, pool) in &pools {
                for (half, kind, config, out) in [
                    (
                        Half::Prefill,
                        pd.prefill_policy,
                        &pd.prefill_config,
                        &mut prefill,
                    ),
                    (
                        Half::Decode,
                        pd.decode_policy,
                        &pd.decode_config,
                        &mut decode,
                    ),
                ] {
                    let members: Vec<Arc<Worker>> = pool
                        .workers
                        .iter()
                        .filter(|w| match half {
                            Half::Prefill => w.role.prefills(),
                            Half::Decode => w.role.decodes(),
                        })
                        .cloned()
                        .collect();
                    if members.is_empty() {
                        continue;
                    }
                    let policy = pd_policies
                        .entry((model.clone(), half))
                        .or_insert_with(|| build_policy(kind, config).into())
                        .clone();
                    out.insert(
                        model.clone(),
                        Pool {
                            model: model.clone(),
                            workers: members,
                            policy,
                        },
                    );
                }
            }
        }
        let complete = workers.iter().all(|w| w.probed.load(Ordering::Relaxed));
        let ready = complete
            && !pools.is_empty()
            && pools
                .values()
                .all(|p| p.workers.iter().any(|w| w.is_healthy()));
        self.table.store(Arc::new(RoutingTable {
            pools,
            prefill,
            decode,
            cards: cards.into_values().collect(),
            complete,
        }));
        self.ready.send_replace(ready);
    }
}

fn default_card(model: &str) -> serde_json::Value {
    serde_json::json!({"id": model, "object": "model", "created": 0, "owned_by": "kvroute"})
}
