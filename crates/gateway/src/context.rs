//! The request path's shared context: everything a routed request reads, built once.
//!
//! [`AppState`] holds the settings, the worker set, the KV state, the admission queue, the
//! pooled client and the metrics. The server builds it and owns it; the request path
//! (forwarding, P/D, the admin API's dry runs) borrows it.

use std::sync::Arc;

use kvroute_core::affinity::Affinity;
use kvroute_tokenizer::Tokenizer;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::WorkerAuth;
use crate::busy::BusyControl;
use crate::config::Settings;
use crate::http::{build_client_with, HttpClient};
use crate::kv::KvState;
use crate::kv_events::KvEventMetrics;
use crate::metrics::GatewayMetrics;
use crate::queue::AdmissionQueue;
use crate::sync::transport::{SyncHandle, SyncMetrics};
use crate::workers::WorkerSet;

/// What every request handler shares; one per gateway, behind an `Arc`.
#[derive(Debug)]
pub(crate) struct AppState {
    pub(crate) queue: Option<Arc<AdmissionQueue>>,
    pub(crate) busy: BusyControl,
    pub(crate) affinity: Option<Arc<Affinity>>,
    pub(crate) settings: Settings,
    pub(crate) kv: Arc<KvState>,
    pub(crate) kv_event_metrics: KvEventMetrics,
    /// The pace of the workers' `/metrics` scrapes (`--metrics-scrapes-per-sec`).
    pub(crate) scrape_pace: Arc<crate::engine_metrics::ScrapePace>,
    pub(crate) workers: Arc<WorkerSet>,
    pub(crate) client: HttpClient,
    pub(crate) metrics: GatewayMetrics,
    /// `--max-concurrent-requests`, its queue and rate.
    pub(crate) admission: Option<crate::admission::Admission>,
    pub(crate) worker_auth: WorkerAuth,
    /// Who may call, as which tenant (keys, trusted header, JWT).
    pub(crate) access: crate::auth::Access,
    /// Per-tenant rate limits, when on.
    pub(crate) rate_limits: Option<Arc<crate::rate_limit::RateLimiter>>,
    /// Background tasks (per worker, upkeep); joined when serving ends.
    pub(crate) tasks: TaskTracker,
    /// Cancelled when serving ends: stops every background task.
    pub(crate) shutdown: CancellationToken,
    /// The API's TLS configuration, swapped by a certificate reload; plain HTTP when `None`.
    pub(crate) api_tls: Option<arc_swap::ArcSwap<rustls::ServerConfig>>,
    /// Replica sync, once serving started with it.
    pub(crate) sync: std::sync::OnceLock<SyncHandle>,
    pub(crate) sync_metrics: SyncMetrics,
    /// `--engine-priority`'s tokens in flight per tenant, when on.
    pub(crate) engine_levels: Option<Arc<crate::engine_priority::EngineLevels>>,
    /// The last routing decisions, for the dashboard.
    pub(crate) recent: crate::recent::Recent,
    /// OpenTelemetry traces, when on.
    pub(crate) tracer: Option<Arc<crate::otlp::Tracer>>,
}

impl AppState {
    /// Builds the state and registers its metrics. Does no I/O and spawns nothing.
    pub(crate) fn new(
        settings: Settings,
        registry: &mut Registry,
        tokenizer: Arc<Tokenizer>,
    ) -> Self {
        let metrics = GatewayMetrics::register(registry);
        metrics.tenants.set_top_n(settings.tenant_metric_top_n);
        let workers = Arc::new(WorkerSet::new(&settings, &metrics));
        crate::peer_metrics::PeerMetrics::register(&settings, &workers, &metrics, registry);
        let client = build_client_with(settings.tls.workers.clone());
        let access = crate::auth::Access::new(
            &settings.tenancy,
            settings.client_api_key.as_ref(),
            client.clone(),
        );
        // A credential the router checks is the router's: it never reaches a worker.
        let worker_auth = match (&settings.api_key, access.requires_credentials()) {
            (Some(key), _) => WorkerAuth::Set(key.bearer().expect("checked by the settings")),
            (None, true) => WorkerAuth::Strip,
            (None, false) => WorkerAuth::PassThrough,
        };
        let prompts = crate::prompts::Prompts::new(
            tokenizer,
            settings.block_size,
            settings.tokenizer_cache_bytes,
            registry,
        );
        let kv = Arc::new(KvState::new(
            &settings,
            prompts,
            (
                metrics.kv_index_blocks.clone(),
                metrics.kv_index_bytes.clone(),
            ),
        ));
        let kv_event_metrics = KvEventMetrics::register(registry);
        let scrape_pace = crate::engine_metrics::ScrapePace::new(
            settings.metrics_refresh,
            settings.metrics_scrapes_per_sec,
        );
        scrape_pace.register(registry);
        Self {
            queue: settings.queue.as_ref().map(|q| {
                Arc::new(
                    AdmissionQueue::new(q, registry).expect("classes validated with the settings"),
                )
            }),
            busy: BusyControl::new(settings.busy),
            affinity: settings
                .session_affinity
                .map(|(mode, ttl)| Arc::new(Affinity::new(mode, ttl, 1 << 20))),
            admission: settings.admission.clone().map(|a| {
                let waiting = prometheus_client::metrics::gauge::Gauge::default();
                registry.register(
                    "kvroute_admission_waiting",
                    "Requests waiting for admission (--max-concurrent-requests, --queue-size)",
                    waiting.clone(),
                );
                crate::admission::Admission::new(a, tokio::time::Instant::now(), waiting)
            }),
            worker_auth,
            access,
            rate_limits: (settings.rate_limits.clone())
                .map(|policy| Arc::new(crate::rate_limit::RateLimiter::new(policy))),
            tasks: TaskTracker::new(),
            shutdown: workers.shutdown().clone(),
            api_tls: settings
                .tls
                .api
                .as_ref()
                .map(|api| arc_swap::ArcSwap::new(api.config.clone())),
            sync: std::sync::OnceLock::new(),
            sync_metrics: SyncMetrics::register(registry),
            recent: Default::default(),
            engine_levels: crate::engine_priority::EngineLevels::new(&settings),
            tracer: settings.trace.clone().map(|t| {
                Arc::new(crate::otlp::Tracer::new(
                    t,
                    crate::otlp::TraceMetrics::register(registry),
                ))
            }),
            settings,
            kv,
            kv_event_metrics,
            scrape_pace,
            workers,
            client,
            metrics,
        }
    }
}
