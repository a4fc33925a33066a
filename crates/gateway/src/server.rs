//! The HTTP server: the axum app, its handlers, and the serve loop.
//!
//! [`Gateway::app`] is the whole API as a `Router` that tests drive with `oneshot`;
//! [`Gateway::serve`] runs it on listeners the caller bound (tests bind port 0), with the
//! metrics app on its own listener, until the shutdown token fires: then it stops
//! accepting, lets in-flight requests finish for up to the grace period, and joins every
//! background task it started (each worker's health checks, KV-event subscription and
//! metric scraper, also for workers added at run time).
//!
//! A routed request is retried on another eligible worker when its attempt fails before
//! the first response byte (connection error, timeout, 502/503/504), with jittered
//! exponential backoff; never after a response started, never when it is pinned. Every
//! attempt feeds the worker's circuit breaker.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{ConnectInfo, Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body_util::{BodyExt, Limited};
use kvroute_core::{EngineLoad, PolicyKind};
use kvroute_protocol::RoutingFields;
use kvroute_tokenizer::Tokenizer;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::auth;
use crate::busy::{BusyControl, ThresholdsBody};
use crate::config::{Args, ConfigError, Settings, WorkerSpec};
use crate::engine_metrics::{EngineMetricsScraper, ScrapeTiming};
use crate::error::GatewayError;
use crate::kv::{KvState, WorkerSink};
use crate::kv_events::{KvEventMetrics, KvEventSubscriber, SubscriberConfig};
use crate::metrics::{GatewayMetrics, Outcome};
use crate::proxy::{
    self, Admitted, Forward, HttpClient, InFlight, TrackedBody, WorkerAuth, REQUEST_ID_HEADER,
};
use crate::queue::AdmissionQueue;
use crate::routing;
use crate::workers::{Pool, Worker, WorkerSet};
use kvroute_core::affinity::{Affinity, AffinityMode};
use kvroute_protocol::WorkerId;

/// Routes whose requests are routed by the policy and forwarded to a worker.
const ROUTED: [&str; 7] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/v1/embeddings",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
];

#[derive(Debug)]
pub(crate) struct AppState {
    pub(crate) queue: Option<Arc<AdmissionQueue>>,
    pub(crate) busy: BusyControl,
    pub(crate) affinity: Option<Affinity>,
    pub(crate) settings: Settings,
    pub(crate) kv: Arc<KvState>,
    pub(crate) kv_event_metrics: KvEventMetrics,
    pub(crate) workers: Arc<WorkerSet>,
    pub(crate) client: HttpClient,
    pub(crate) metrics: GatewayMetrics,
    /// `--max-concurrent-requests`.
    pub(crate) limit: Option<Arc<Semaphore>>,
    pub(crate) worker_auth: WorkerAuth,
    /// Background tasks (per worker, upkeep); joined when serving ends.
    pub(crate) tasks: TaskTracker,
    /// Cancelled when serving ends: stops every background task.
    pub(crate) shutdown: CancellationToken,
}

/// The router: configuration, workers, the upstream client and the metrics.
#[derive(Debug, Clone)]
pub struct Gateway {
    state: Arc<AppState>,
}

impl Gateway {
    /// Builds the gateway with the fallback tokenizer and registers its metrics. Does no
    /// I/O and spawns nothing.
    pub fn new(settings: Settings, registry: &mut Registry) -> Self {
        Self::with_tokenizer(settings, registry, Arc::new(Tokenizer::fallback()))
    }

    /// Builds the gateway with the tokenizer the engines use (loaded by the caller).
    pub fn with_tokenizer(
        settings: Settings,
        registry: &mut Registry,
        tokenizer: Arc<Tokenizer>,
    ) -> Self {
        let metrics = GatewayMetrics::register(registry);
        let workers = Arc::new(WorkerSet::new(&settings, &metrics));
        let worker_auth = match (&settings.api_key, &settings.client_api_key) {
            (Some(key), _) => {
                let mut v = HeaderValue::from_str(&format!("Bearer {}", key.expose()))
                    .unwrap_or_else(|_| HeaderValue::from_static(""));
                v.set_sensitive(true);
                WorkerAuth::Set(v)
            }
            (None, Some(_)) => WorkerAuth::Strip,
            (None, None) => WorkerAuth::PassThrough,
        };
        let kv = Arc::new(KvState::new(
            &settings,
            tokenizer,
            (
                metrics.kv_index_blocks.clone(),
                metrics.kv_index_bytes.clone(),
            ),
        ));
        let kv_event_metrics = KvEventMetrics::register(registry);
        Self {
            state: Arc::new(AppState {
                queue: settings.queue.as_ref().map(|q| {
                    Arc::new(
                        AdmissionQueue::new(
                            q.threshold,
                            q.timeout,
                            q.classes.clone(),
                            q.class_thresholds.clone(),
                            q.order,
                            registry,
                        )
                        .expect("classes validated with the settings"),
                    )
                }),
                busy: BusyControl::new(settings.busy),
                affinity: settings
                    .session_affinity
                    .map(|(mode, ttl)| Affinity::new(mode, ttl, 1 << 20)),
                limit: settings
                    .max_concurrent_requests
                    .map(|n| Arc::new(Semaphore::new(n))),
                worker_auth,
                tasks: TaskTracker::new(),
                shutdown: CancellationToken::new(),
                settings,
                kv,
                kv_event_metrics,
                workers,
                client: proxy::build_client(),
                metrics,
            }),
        }
    }

    /// The policy as the startup log names it, with its parameters.
    pub fn policy_description(&self) -> String {
        let s = &self.state.settings;
        format!(
            "{:?}",
            kvroute_core::build_policy(s.policy, &s.policy_config)
        )
    }

    pub fn workers(&self) -> &Arc<WorkerSet> {
        &self.state.workers
    }

    /// Resolves once the router is ready (every worker probed, every model served).
    pub async fn wait_ready(&self) {
        let mut rx = self.state.workers.subscribe_ready();
        // The sender lives in the worker set, which `self` keeps alive.
        let _ = rx.wait_for(|ready| *ready).await;
    }

    /// The API, without a socket.
    pub fn app(&self) -> Router {
        let mut router = Router::new();
        for route in ROUTED {
            router = router.route(
                route,
                post(move |state: State<Arc<AppState>>, req: Request| routed(state, route, req)),
            );
        }
        router
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/readiness", get(readiness))
            .route("/workers", get(workers).post(add_worker))
            .route("/workers/{*id}", delete(remove_worker))
            .route("/debug/route", post(debug_route))
            .route("/busy_threshold", get(get_busy).post(set_busy))
            .fallback(not_found)
            .with_state(self.state.clone())
    }

    /// Adds a worker at run time and starts its health checks, KV-event subscription and
    /// metric scraping.
    pub fn add_worker(&self, spec: WorkerSpec) -> Result<Arc<Worker>, GatewayError> {
        let spec = Settings::with_workers(vec![spec])
            .map_err(|e| GatewayError::InvalidAdmin(e.to_string()))?
            .workers
            .pop()
            .ok_or_else(|| GatewayError::InvalidAdmin("no worker given".into()))?;
        let worker = self.state.workers.add(&spec)?;
        start_worker(&self.state, worker.clone());
        Ok(worker)
    }

    /// Removes a worker: no new request goes to it, its in-flight requests finish, its
    /// tasks stop and its KV blocks are forgotten.
    pub fn remove_worker(&self, id: &str) -> Result<Arc<Worker>, GatewayError> {
        let worker = self.state.workers.remove(id)?;
        for rank in &worker.ranks {
            self.state.kv.clear(rank.replica);
        }
        Ok(worker)
    }

    /// Re-reads the config file's workers (the command line's `--worker-urls` stay) and
    /// applies the difference: new ids added, missing ids removed, changed ones replaced.
    pub fn reload(&self) -> Result<(usize, usize), ConfigError> {
        let Some(path) = &self.state.settings.config_path else {
            return Ok((0, 0));
        };
        let file = Args::from_file(path)?;
        let urls = if self.state.settings.cli_worker_urls.is_empty() {
            file.worker_urls
        } else {
            self.state.settings.cli_worker_urls.clone()
        };
        let wanted = Args {
            worker_urls: urls,
            workers: file.workers,
            ..Args::default()
        }
        .into_settings()?
        .workers;
        if wanted.is_empty() {
            tracing::warn!(path = %path.display(), "The reloaded config lists no worker: keeping the current ones");
            return Ok((0, 0));
        }
        let current = self.state.workers.workers();
        let (mut added, mut removed) = (0, 0);
        for w in current.iter() {
            let keep = wanted
                .iter()
                .any(|s| s.id.as_deref() == Some(w.id.as_str()) && w.same_spec(s));
            if !keep && self.remove_worker(w.id.as_str()).is_ok() {
                removed += 1;
            }
        }
        for spec in wanted {
            let id = spec.id.clone().unwrap_or_default();
            if self.state.workers.get(&id).is_none() {
                match self.add_worker(spec) {
                    Ok(_) => added += 1,
                    Err(error) => tracing::warn!(worker = %id, %error, "Cannot add worker"),
                }
            }
        }
        tracing::info!(path = %path.display(), added, removed, "Config reloaded");
        Ok((added, removed))
    }

    /// Serves the API on `listener` and the metrics on `metrics_listener` until `shutdown`,
    /// then stops accepting, lets in-flight requests finish for up to the grace period, and
    /// joins the background tasks.
    pub async fn serve(
        self,
        listener: TcpListener,
        metrics_listener: TcpListener,
        registry: Arc<Registry>,
        shutdown: CancellationToken,
    ) -> std::io::Result<()> {
        let state = self.state.clone();
        {
            let (outer, inner) = (shutdown.clone(), state.shutdown.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = outer.cancelled() => inner.cancel(),
                    _ = inner.cancelled() => {}
                }
            });
        }
        if state.settings.busy.active_prefill_tokens_frac.is_some() {
            for w in state.workers.workers().iter() {
                if w.max_num_batched_tokens.is_none() {
                    tracing::warn!(worker = %w.id, "No max_num_batched_tokens in the config: --active-prefill-tokens-threshold-frac skips this worker");
                }
            }
        }
        for worker in state.workers.workers().iter() {
            start_worker(&state, worker.clone());
        }
        {
            let workers = state.workers.clone();
            let queue = state.queue.clone();
            let stop = state.shutdown.clone();
            state.tasks.spawn(async move {
                // Policy upkeep every second; the queue re-examined every 100 ms (thresholds
                // may change at run time).
                let mut tick = tokio::time::interval(Duration::from_millis(100));
                let mut n = 0u32;
                loop {
                    tokio::select! {
                        _ = tick.tick() => {
                            n = n.wrapping_add(1);
                            if n.is_multiple_of(10) {
                                workers.maintain(Instant::now());
                            }
                            if let Some(q) = &queue {
                                q.dispatch();
                            }
                        }
                        _ = stop.cancelled() => return,
                    }
                }
            });
        }
        #[cfg(unix)]
        if state.settings.config_path.is_some() {
            let gateway = self.clone();
            let stop = state.shutdown.clone();
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
                Ok(mut hup) => {
                    state.tasks.spawn(async move {
                        loop {
                            tokio::select! {
                                _ = hup.recv() => {
                                    if let Err(error) = gateway.reload() {
                                        tracing::error!(%error, "Config reload failed; nothing changed");
                                    }
                                }
                                _ = stop.cancelled() => return,
                            }
                        }
                    });
                }
                Err(error) => tracing::warn!(%error, "Cannot listen for SIGHUP"),
            }
        }
        let metrics_stop = state.shutdown.clone();
        let metrics = tokio::spawn(async move {
            axum::serve(metrics_listener, metrics_app(registry))
                .with_graceful_shutdown(metrics_stop.cancelled_owned())
                .await
        });
        let served = serve_api(
            listener,
            self.app(),
            state.settings.header_read_timeout,
            state.settings.shutdown_grace,
            &state.shutdown,
        )
        .await;
        state.shutdown.cancel();
        let metrics = metrics.await.unwrap_or(Ok(()));
        state.tasks.close();
        state.tasks.wait().await;
        served.and(metrics)
    }
}

/// Starts a worker's background tasks: health checks, the KV-event subscription (while it
/// is healthy) and the engine-metrics scraper (for the policies that read it).
fn start_worker(state: &Arc<AppState>, worker: Arc<Worker>) {
    state.tasks.spawn(state.workers.clone().watch(
        worker.clone(),
        state.client.clone(),
        state.shutdown.clone(),
    ));
    if state.settings.policy == PolicyKind::LlmD
        || state.settings.busy.active_decode_blocks.is_some()
    {
        let timing = ScrapeTiming {
            interval: state.settings.metrics_refresh,
            ..ScrapeTiming::default()
        };
        let ranks = worker
            .ranks
            .iter()
            .map(|r| (r.dp_rank, r.engine.clone()))
            .collect();
        match EngineMetricsScraper::new(worker.id.to_string(), &worker.url, ranks, timing) {
            Ok(scraper) => {
                let stop = state.shutdown.child_token();
                let tasks = worker.tasks.clone();
                let client = state.client.clone();
                state.tasks.spawn(async move {
                    let scrape = scraper.run(client, stop.clone());
                    tokio::select! {
                        _ = scrape => {}
                        _ = tasks.cancelled() => stop.cancel(),
                    }
                });
            }
            Err(error) => {
                tracing::error!(worker = %worker.id, %error, "Cannot scrape engine metrics")
            }
        }
    }
    if state.kv.uses_events(&worker) && worker.kv_events.is_some() {
        state.tasks.spawn(follow_kv_events(state.clone(), worker));
    }
}

/// Subscribes to a worker's KV events while it is healthy; when it turns unhealthy or is
/// removed, the subscription stops and its blocks are forgotten (rebuilt when it returns).
async fn follow_kv_events(state: Arc<AppState>, worker: Arc<Worker>) {
    let Some(endpoint) = worker.kv_events.clone() else {
        return;
    };
    let config = SubscriberConfig {
        worker: worker.id.to_string(),
        endpoint,
        replay_endpoint: worker.kv_events_replay.clone(),
        dp_start_rank: worker.ranks[0].dp_rank.unwrap_or(0),
        dp_size: worker.ranks.len() as u32,
        router_block_size: state.kv.block_size,
    };
    let mut health = worker.subscribe_health();
    let stopped = || state.shutdown.is_cancelled() || worker.tasks.is_cancelled();
    loop {
        // Wait until healthy.
        loop {
            if stopped() {
                return;
            }
            if *health.borrow_and_update() {
                break;
            }
            tokio::select! {
                changed = health.changed() => if changed.is_err() { return },
                _ = state.shutdown.cancelled() => return,
                _ = worker.tasks.cancelled() => return,
            }
        }
        let sink = Arc::new(WorkerSink::new(state.kv.clone(), worker.clone()));
        let subscriber = match KvEventSubscriber::new(config.clone(), sink, &state.kv_event_metrics)
        {
            Ok(s) => s,
            Err(error) => {
                tracing::error!(worker = %worker.id, %error, "Cannot subscribe to KV events; approximating this worker's cache");
                return;
            }
        };
        let token = state.shutdown.child_token();
        let run = tokio::spawn(subscriber.run(token.clone()));
        // Until unhealthy or stopped.
        loop {
            if !*health.borrow_and_update() || stopped() {
                break;
            }
            tokio::select! {
                changed = health.changed() => if changed.is_err() { break },
                _ = state.shutdown.cancelled() => break,
                _ = worker.tasks.cancelled() => break,
            }
        }
        token.cancel();
        let _ = run.await;
        for rank in &worker.ranks {
            state.kv.clear(rank.replica);
        }
        if !stopped() {
            tracing::warn!(worker = %worker.id, "Worker unhealthy: KV-event subscription stopped and its blocks forgotten until it returns");
        }
    }
}

/// The API's accept loop: HTTP/1.1 with a header read timeout; on `shutdown`, stops
/// accepting, closes idle connections, and waits up to `grace` for in-flight requests.
async fn serve_api(
    listener: TcpListener,
    app: Router,
    header_read_timeout: Duration,
    grace: Duration,
    shutdown: &CancellationToken,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout)
        .keep_alive(true);
    let connections = TaskTracker::new();
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(error) => {
                    // Out of file descriptors and the like: wait, do not spin.
                    tracing::warn!(%error, "Accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        let _ = tcp.set_nodelay(true);
        let app = app.clone();
        let service =
            hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                let mut app = app.clone();
                async move { tower_service::Service::call(&mut app, req.map(Body::new)).await }
            });
        let conn = builder.serve_connection(TokioIo::new(tcp), service);
        let stop = shutdown.clone();
        connections.spawn(async move {
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(error) = result {
                        tracing::debug!(%error, "Connection ended with an error");
                    }
                    return;
                }
                _ = stop.cancelled() => {}
            }
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        });
    }
    drop(listener);
    connections.close();
    let open = connections.len();
    if open > 0 {
        tracing::info!(connections = open, grace = ?grace, "Not accepting; waiting for in-flight requests");
    }
    if tokio::time::timeout(grace, connections.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            connections = connections.len(),
            "Grace period over: closing the remaining connections"
        );
    }
    Ok(())
}

/// The metrics app: `GET /metrics` in the Prometheus text format.
pub fn metrics_app(registry: Arc<Registry>) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let registry = registry.clone();
            async move {
                let mut text = String::new();
                match prometheus_client::encoding::text::encode(&mut text, &registry) {
                    Ok(()) => (
                        [(
                            http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        text,
                    )
                        .into_response(),
                    Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
                }
            }
        }),
    )
}

fn new_request_id() -> HeaderValue {
    let id: u128 = rand::random();
    HeaderValue::from_str(&format!("{id:032x}")).expect("hex is a valid header value")
}

/// A proxied route: choose a worker, forward, answer with its response or our error.
async fn routed(State(state): State<Arc<AppState>>, route: &'static str, req: Request) -> Response {
    let request_id = req
        .headers()
        .get(REQUEST_ID_HEADER)
        .cloned()
        .unwrap_or_else(new_request_id);
    let span = tracing::debug_span!("request", route, request_id = ?request_id);
    let mut response = match route_and_forward(&state, route, req, &request_id)
        .instrument(span)
        .await
    {
        Ok(response) => response,
        Err(error) => error.into_response(),
    };
    response
        .headers_mut()
        .entry(REQUEST_ID_HEADER)
        .or_insert(request_id);
    state.metrics.request(route, response.status().as_u16());
    response
}

async fn read_body(body: Body, limit: usize, headers: &HeaderMap) -> Result<Bytes, GatewayError> {
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(GatewayError::PayloadTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(GatewayError::PayloadTooLarge { limit })
        }
        Err(e) => Err(GatewayError::BodyRead(e)),
    }
}

/// Admits a request under `--max-concurrent-requests` (429 beyond it).
fn admit(state: &AppState) -> Result<Admitted, GatewayError> {
    let permit = match &state.limit {
        Some(limit) => Some(limit.clone().try_acquire_owned().map_err(|_| {
            GatewayError::TooManyRequests(state.settings.max_concurrent_requests.unwrap_or(0))
        })?),
        None => None,
    };
    Ok(Admitted::new(permit, state.metrics.in_router.clone()))
}

/// Routes that are disaggregated when prefill/decode disaggregation is on.
const PD_ROUTES: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/generate"];

async fn route_and_forward(
    state: &AppState,
    route: &'static str,
    req: Request,
    request_id: &HeaderValue,
) -> Result<Response, GatewayError> {
    let arrived = Instant::now();
    let (parts, body) = req.into_parts();
    auth::check_client(state.settings.client_api_key.as_ref(), &parts.headers)
        .map_err(|r| GatewayError::Unauthorized(r.message(false)))?;
    let admitted = admit(state)?;
    let body = read_body(body, state.settings.max_payload_size, &parts.headers).await?;
    let fields = RoutingFields::from_json(&body).map_err(GatewayError::InvalidJson)?;
    let started = Instant::now();
    let pd = state
        .settings
        .pd
        .as_ref()
        .filter(|_| PD_ROUTES.contains(&route));
    let tokenize_as = match pd {
        // The decode-only decision needs the prompt's tokens whatever the policies.
        Some(pd) if pd.min_uncached_tokens > 0 => PolicyKind::KvAware,
        Some(pd) if pd.decode_policy == PolicyKind::KvAware => PolicyKind::KvAware,
        Some(pd) => pd.prefill_policy,
        None => state.settings.policy,
    };
    let mut tokens = routing::tokens_for(&state.kv, tokenize_as, &body).await;

    let hints = routing::parse_hints(&parts.headers)?;
    if pd.is_some() {
        let arrived_at = arrived;
        return crate::pd::route(
            state,
            crate::pd::PdRequest {
                parts: &parts,
                body: body.clone(),
                fields: &fields,
                tokens,
                hints: &hints,
                request_id,
                arrived: arrived_at,
            },
            admitted,
        )
        .await;
    }
    let mut released = None;
    let mut class = None;
    if let Some(queue) = &state.queue {
        // Admission: wait while every eligible rank is saturated with prefill. Requests
        // with no eligible worker fail at once.
        let c = queue.class_of(
            parts
                .headers
                .get("x-kvroute-class")
                .and_then(|v| v.to_str().ok()),
        )?;
        class = Some(c);
        let (ranks, cost) = {
            let table = state.workers.table();
            let pool = table.resolve(fields.model.as_deref())?;
            let busy = queue.thresholds(c, state.busy.get(pool.model.as_str()));
            let ranks = routing::eligible_ranks(pool, &hints, &busy, started)?;
            // The cost for ordering and DRR: uncached tokens as the index sees them now.
            let hashes = kvroute_index::block_hashes(&tokens, state.kv.block_size, 0);
            let (events, approx) = state.kv.overlaps(&hashes, started);
            let best = ranks
                .iter()
                .map(|(w, r)| {
                    let replica = w.ranks[*r].replica;
                    if state.kv.uses_events(w) {
                        events.get(replica).total()
                    } else {
                        approx.get(replica).total()
                    }
                })
                .max()
                .unwrap_or(0) as usize;
            let cached = best * state.kv.block_size;
            (ranks, tokens.len().saturating_sub(cached) as u64)
        };
        released = Some(queue.admit(c, ranks, cost).await?);
    }
    // A pinned request (by hint or hard session affinity) is never moved to another worker.
    let pinned = hints.pinned_worker.is_some()
        || state
            .affinity
            .as_ref()
            .is_some_and(|a| a.mode == AffinityMode::Hard);
    let max_retries = if pinned {
        0
    } else {
        state.settings.retry.max_retries
    };
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |pq| pq.as_str());
    let mut tried: Vec<WorkerId> = Vec::new();
    let mut last_error = None;
    for attempt in 0..=max_retries {
        if attempt > 0 {
            let unit = rand::random::<f64>() * 2.0 - 1.0;
            tokio::time::sleep(state.settings.retry.backoff(attempt, unit)).await;
            state.metrics.retries.inc();
        }
        let now = Instant::now();
        let table = state.workers.table();
        let pool = table.resolve(fields.model.as_deref())?;
        let untried;
        let pool = if tried.is_empty() {
            pool
        } else {
            untried = Pool {
                model: pool.model.clone(),
                workers: pool
                    .workers
                    .iter()
                    .filter(|w| !tried.contains(&w.id))
                    .cloned()
                    .collect(),
                policy: pool.policy.clone(),
            };
            &untried
        };
        let mut busy = state.busy.get(pool.model.as_str());
        if let (Some(queue), Some(c)) = (&state.queue, class) {
            busy = queue.thresholds(c, busy);
        }
        let plan = match routing::plan(
            &state.kv,
            pool,
            &parts.headers,
            &hints,
            &busy,
            state.affinity.as_ref(),
            &fields,
            if attempt < max_retries {
                tokens.clone()
            } else {
                std::mem::take(&mut tokens)
            },
            now,
            false,
        ) {
            Ok(plan) => plan,
            // Nowhere left to retry: the last failure is the answer.
            Err(e) => return Err(last_error.unwrap_or(e)),
        };
        if attempt == 0 {
            state
                .metrics
                .routing_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        let choice = plan.choice().clone();
        let rank = &choice.worker.ranks[choice.rank];
        if plan.policy == PolicyKind::KvAware && plan.prompt_tokens > 0 {
            let cached = choice.kv.overlap.total() as f64 * state.kv.block_size as f64;
            state
                .metrics
                .kv_hit_ratio
                .observe((cached / plan.prompt_tokens as f64).min(1.0));
            if !state.kv.uses_events(&choice.worker) {
                state.kv.record_routed(rank.replica, &plan.hashes, now);
            }
        }
        let load = plan.request_load(state.kv.block_size);
        drop(table);
        tracing::debug!(worker = %choice.worker.id, dp_rank = ?rank.dp_rank, attempt, "Routed");
        choice.worker.series.decisions.inc();
        choice.worker.series.processed.inc();

        let mut guard = InFlight::new(
            choice.worker.clone(),
            choice.rank,
            load,
            state.queue.clone(),
        );
        // Its load is counted: the queue may consider the next request.
        released.take();
        if fields.stream {
            guard = guard.with_ttft(arrived, state.metrics.ttft_seconds.clone());
        }
        choice.worker.circuit.on_send(now);
        let result = proxy::forward(
            &state.client,
            guard,
            Forward {
                method: parts.method.clone(),
                path_and_query,
                headers: &parts.headers,
                body: body.clone(),
                request_id,
                timeout: state.settings.request_timeout,
                auth: &state.worker_auth,
            },
        )
        .await;
        let outcome = outcome_of(&result);
        let worker = &choice.worker;
        worker.series.attempts[Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0)].inc();
        worker
            .circuit
            .record(outcome == Outcome::Ok, Instant::now());
        let retryable = match &result {
            Err(GatewayError::Upstream { .. } | GatewayError::UpstreamTimeout { .. }) => true,
            Ok(r) => matches!(r.status().as_u16(), 502..=504),
            Err(_) => false,
        };
        if retryable && attempt < max_retries {
            let error = match result {
                Err(e) => e,
                Ok(r) => GatewayError::UpstreamStatus {
                    worker: worker.id.clone(),
                    status: r.status().as_u16(),
                },
            };
            tracing::warn!(worker = %worker.id, attempt = attempt + 1, error = %error, "Attempt failed before the first byte; retrying on another worker");
            tried.push(worker.id.clone());
            last_error = Some(error);
            continue;
        }
        let mut response = result?;
        response.body_mut().hold(admitted);
        return Ok(response.map(Body::new));
    }
    Err(last_error.unwrap_or(GatewayError::NoEndpoint("no worker left to try")))
}

/// How an attempt ended, for the metrics and the circuit breaker (a 4xx is the client's
/// fault, not the worker's).
fn outcome_of(result: &Result<http::Response<TrackedBody>, GatewayError>) -> Outcome {
    match result {
        Ok(r) if r.status().is_server_error() => Outcome::ServerError,
        Ok(_) => Outcome::Ok,
        Err(GatewayError::UpstreamTimeout { .. }) => Outcome::Timeout,
        Err(_) => Outcome::ConnectError,
    }
}

/// `POST /debug/route`: the decision the router would make for this request, with every
/// candidate's terms, without sending it or changing any state.
async fn debug_route(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let result = async {
        check_admin(&state, &req, false)?;
        let (parts, body) = req.into_parts();
        let body = read_body(body, state.settings.max_payload_size, &parts.headers).await?;
        let fields = RoutingFields::from_json(&body).map_err(GatewayError::InvalidJson)?;
        let tokens = routing::tokens_for(&state.kv, state.settings.policy, &body).await;
        let hints = routing::parse_hints(&parts.headers)?;
        let table = state.workers.table();
        let pool = table.resolve(fields.model.as_deref())?;
        let busy = state.busy.get(pool.model.as_str());
        let plan = routing::plan(
            &state.kv,
            pool,
            &parts.headers,
            &hints,
            &busy,
            state.affinity.as_ref(),
            &fields,
            tokens,
            Instant::now(),
            true,
        )?;
        let kv_aware = plan.policy == PolicyKind::KvAware;
        let candidates: Vec<serde_json::Value> = plan
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = serde_json::json!({
                    "worker": c.worker.id.as_str(),
                    "dp_rank": c.worker.ranks[c.rank].dp_rank,
                    "eligible": true,
                    "active_requests": c.in_flight,
                });
                if kv_aware {
                    let o = c.kv.overlap;
                    v["overlap_blocks"] = serde_json::json!({
                        "device": o.device, "host": o.host, "disk": o.disk, "external": o.external,
                    });
                    v["prefill_tokens"] = c.kv.prefill_tokens.into();
                    v["decode_blocks"] = c.kv.decode_blocks.into();
                    v["new_blocks"] = c.kv.new_blocks.into();
                }
                if let Some(costs) = &plan.costs {
                    v["cost"] = costs[i].into();
                }
                let e = c.engine;
                if e != EngineLoad::default() {
                    v["engine"] = serde_json::json!({
                        "waiting": e.waiting, "running": e.running, "kv_usage": e.kv_usage,
                        "num_gpu_blocks": e.num_gpu_blocks,
                    });
                }
                v
            })
            .collect();
        let chosen = plan.choice();
        Ok::<_, GatewayError>(Json(serde_json::json!({
            "policy": plan.policy.name(),
            "worker": chosen.worker.id.as_str(),
            "dp_rank": chosen.worker.ranks[chosen.rank].dp_rank,
            "prompt_tokens": plan.prompt_tokens,
            "block_size": state.kv.block_size,
            "candidates": candidates,
        })))
    }
    .await;
    match result {
        Ok(json) => json.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(r) = auth::check_client(state.settings.client_api_key.as_ref(), &headers) {
        state.metrics.request("/v1/models", 401);
        return GatewayError::Unauthorized(r.message(false)).into_response();
    }
    let table = state.workers.table();
    let body = serde_json::json!({"object": "list", "data": table.model_cards()});
    state.metrics.request("/v1/models", 200);
    Json(body).into_response()
}

/// Admin calls: with `--admin-api-key`, the key as a bearer token; without, changes only
/// from loopback (reads from anywhere).
fn check_admin(state: &AppState, req: &Request, mutating: bool) -> Result<(), GatewayError> {
    let peer = req
        .extensions()
        .get::<ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip());
    auth::check_admin(
        state.settings.admin_api_key.as_ref(),
        req.headers(),
        peer,
        mutating,
    )
    .map_err(|r| GatewayError::Unauthorized(r.message(true)))
}

/// `POST /workers`: adds a worker (the config file's worker schema, as JSON).
async fn add_worker(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let result = async {
        check_admin(&state, &req, true)?;
        let (parts, body) = req.into_parts();
        let body = read_body(body, 1 << 20, &parts.headers).await?;
        let spec: WorkerSpec =
            serde_json::from_slice(&body).map_err(|e| GatewayError::InvalidAdmin(e.to_string()))?;
        let worker = Gateway {
            state: state.clone(),
        }
        .add_worker(spec)?;
        Ok::<_, GatewayError>(
            (
                StatusCode::CREATED,
                Json(serde_json::json!({"id": worker.id.as_str(), "url": worker.url})),
            )
                .into_response(),
        )
    }
    .await;
    result.unwrap_or_else(|e| e.into_response())
}

/// `DELETE /workers/{id}`: removes a worker; its in-flight requests finish.
async fn remove_worker(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    let result = check_admin(&state, &req, true).and_then(|()| {
        let worker = Gateway {
            state: state.clone(),
        }
        .remove_worker(&id)?;
        Ok(Json(serde_json::json!({
            "id": worker.id.as_str(),
            "removed": true,
            "draining": worker.in_flight(),
        }))
        .into_response())
    });
    result.unwrap_or_else(|e| e.into_response())
}

/// `GET /busy_threshold`: the thresholds in force for every model.
async fn get_busy(State(state): State<Arc<AppState>>, req: Request) -> Response {
    if let Err(e) = check_admin(&state, &req, false) {
        return e.into_response();
    }
    let table = state.workers.table();
    let thresholds: Vec<_> = table
        .models()
        .map(|m| BusyControl::body(m, &state.busy.get(m)))
        .collect();
    Json(serde_json::json!({"thresholds": thresholds})).into_response()
}

/// `POST /busy_threshold`: sets the given fields for one model; omitted fields are a read.
async fn set_busy(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let result = async {
        check_admin(&state, &req, true)?;
        let (parts, body) = req.into_parts();
        let body = read_body(body, 1 << 20, &parts.headers).await?;
        let update: ThresholdsBody =
            serde_json::from_slice(&body).map_err(|e| GatewayError::InvalidAdmin(e.to_string()))?;
        if update
            .active_decode_blocks_threshold
            .is_some_and(|f| !(0.0..=1.0).contains(&f))
        {
            return Err(GatewayError::InvalidAdmin(
                "active_decode_blocks_threshold must be between 0 and 1".into(),
            ));
        }
        if update
            .active_prefill_tokens_threshold_frac
            .is_some_and(|f| !(f.is_finite() && f >= 0.0))
        {
            return Err(GatewayError::InvalidAdmin(
                "active_prefill_tokens_threshold_frac must be a non-negative number".into(),
            ));
        }
        if !state.workers.table().models().any(|m| m == update.model) {
            return Err(GatewayError::UnknownModel(update.model));
        }
        let now = state.busy.set(&update);
        tracing::info!(model = %update.model, thresholds = ?now, "Busy thresholds set");
        Ok(Json(BusyControl::body(&update.model, &now)))
    }
    .await;
    match result {
        Ok(json) => json.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn health() -> &'static str {
    "ok"
}

async fn readiness(State(state): State<Arc<AppState>>) -> Response {
    let ready = state.workers.is_ready();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let workers = state.workers.statuses();
    let healthy = workers.iter().filter(|w| w.healthy).count();
    let body = serde_json::json!({
        "status": if ready { "ready" } else { "not_ready" },
        "workers": workers.len(),
        "healthy_workers": healthy,
    });
    (status, Json(body)).into_response()
}

async fn workers(State(state): State<Arc<AppState>>, req: Request) -> Response {
    if let Err(e) = check_admin(&state, &req, false) {
        return e.into_response();
    }
    Json(serde_json::json!({"workers": state.workers.statuses()})).into_response()
}

async fn not_found(req: Request) -> Response {
    GatewayError::NotFound(format!("{} {}", req.method(), req.uri().path())).into_response()
}
