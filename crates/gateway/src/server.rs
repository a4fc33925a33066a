//! The HTTP server: the axum app, its handlers, and the serve loop.
//!
//! [`Gateway::app`] is the whole API as a `Router` that tests drive with `oneshot`;
//! [`Gateway::serve`] runs it on listeners the caller bound (tests bind port 0), with the
//! metrics app on its own listener, until the shutdown token fires, and joins every
//! background task it started.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body_util::{BodyExt, Limited};
use kvroute_core::{EngineLoad, PolicyKind};
use kvroute_protocol::RoutingFields;
use kvroute_tokenizer::Tokenizer;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::busy::{BusyControl, ThresholdsBody};
use crate::config::Settings;
use crate::engine_metrics::{EngineMetricsScraper, ScrapeTiming};
use crate::error::GatewayError;
use crate::kv::{KvState, WorkerSink};
use crate::kv_events::{KvEventMetrics, KvEventSubscriber, SubscriberConfig};
use crate::metrics::GatewayMetrics;
use crate::proxy::{self, Forward, HttpClient, InFlight, REQUEST_ID_HEADER};
use crate::queue::AdmissionQueue;
use crate::routing;
use crate::workers::WorkerSet;
use kvroute_core::affinity::Affinity;

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
struct AppState {
    queue: Option<Arc<AdmissionQueue>>,
    busy: BusyControl,
    affinity: Option<Affinity>,
    settings: Settings,
    kv: Arc<KvState>,
    kv_event_metrics: KvEventMetrics,
    workers: Arc<WorkerSet>,
    client: HttpClient,
    metrics: GatewayMetrics,
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
        let workers = Arc::new(WorkerSet::new(
            &settings.workers,
            settings.policy,
            settings.policy_config.clone(),
            &metrics,
        ));
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
            .route("/workers", get(workers))
            .route("/debug/route", post(debug_route))
            .route("/busy_threshold", get(get_busy).post(set_busy))
            .fallback(not_found)
            .with_state(self.state.clone())
    }

    /// Serves the API on `listener` and the metrics on `metrics_listener` until `shutdown`,
    /// then drains in-flight requests and joins the background tasks.
    pub async fn serve(
        self,
        listener: TcpListener,
        metrics_listener: TcpListener,
        registry: Arc<Registry>,
        shutdown: CancellationToken,
    ) -> std::io::Result<()> {
        let discovery = tokio::spawn(
            self.state
                .workers
                .clone()
                .discover(self.state.client.clone(), shutdown.child_token()),
        );
        let upkeep = {
            let workers = self.state.workers.clone();
            let queue = self.state.queue.clone();
            let shutdown = shutdown.child_token();
            tokio::spawn(async move {
                // Policy upkeep every second; the queue re-examined every 100 ms (thresholds
                // may change at run time).
                let mut tick = tokio::time::interval(std::time::Duration::from_millis(100));
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
                        _ = shutdown.cancelled() => return,
                    }
                }
            })
        };
        let mut subscribers = tokio::task::JoinSet::new();
        if self
            .state
            .settings
            .busy
            .active_prefill_tokens_frac
            .is_some()
        {
            for w in self.state.workers.workers() {
                if w.max_num_batched_tokens.is_none() {
                    tracing::warn!(worker = %w.id, "No max_num_batched_tokens in the config: --active-prefill-tokens-threshold-frac skips this worker");
                }
            }
        }
        // Engine metrics, only for policies that read them.
        if self.state.settings.policy == PolicyKind::LlmD
            || self.state.settings.busy.active_decode_blocks.is_some()
        {
            let timing = ScrapeTiming {
                interval: self.state.settings.metrics_refresh,
                ..ScrapeTiming::default()
            };
            for worker in self.state.workers.workers() {
                let ranks = worker
                    .ranks
                    .iter()
                    .map(|r| (r.dp_rank, r.engine.clone()))
                    .collect();
                match EngineMetricsScraper::new(worker.id.to_string(), &worker.url, ranks, timing) {
                    Ok(scraper) => {
                        let client = self.state.client.clone();
                        subscribers.spawn(scraper.run(client, shutdown.child_token()));
                    }
                    Err(error) => {
                        tracing::error!(worker = %worker.id, %error, "Cannot scrape engine metrics")
                    }
                }
            }
        }
        for worker in self.state.workers.workers() {
            if !self.state.kv.uses_events(worker) {
                continue;
            }
            let Some(endpoint) = worker.kv_events.clone() else {
                continue;
            };
            let first = worker.ranks[0].dp_rank.unwrap_or(0);
            let config = SubscriberConfig {
                worker: worker.id.to_string(),
                endpoint,
                replay_endpoint: worker.kv_events_replay.clone(),
                dp_start_rank: first,
                dp_size: worker.ranks.len() as u32,
                router_block_size: self.state.kv.block_size,
            };
            let sink = Arc::new(WorkerSink::new(self.state.kv.clone(), worker.clone()));
            match KvEventSubscriber::new(config, sink, &self.state.kv_event_metrics) {
                Ok(subscriber) => {
                    subscribers.spawn(subscriber.run(shutdown.child_token()));
                }
                Err(error) => {
                    tracing::error!(worker = %worker.id, %error, "Cannot subscribe to KV events; approximating this worker's cache");
                }
            }
        }
        let api = axum::serve(
            axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            }),
            self.app()
                .into_make_service_with_connect_info::<std::net::SocketAddr>(),
        )
        .with_graceful_shutdown(shutdown.clone().cancelled_owned());
        let metrics = axum::serve(metrics_listener, metrics_app(registry))
            .with_graceful_shutdown(shutdown.clone().cancelled_owned());
        let result = tokio::try_join!(async { api.await }, async { metrics.await });
        shutdown.cancel();
        let _ = discovery.await;
        let _ = upkeep.await;
        while subscribers.join_next().await.is_some() {}
        result.map(|_| ())
    }
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
    let mut response = match route_and_forward(&state, req, &request_id)
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

async fn route_and_forward(
    state: &AppState,
    req: Request,
    request_id: &HeaderValue,
) -> Result<Response, GatewayError> {
    let arrived = Instant::now();
    let (parts, body) = req.into_parts();
    let body = read_body(body, state.settings.max_payload_size, &parts.headers).await?;
    let fields = RoutingFields::from_json(&body).map_err(GatewayError::InvalidJson)?;
    let started = Instant::now();
    let tokens = routing::tokens_for(&state.kv, state.settings.policy, &body).await;

    let hints = routing::parse_hints(&parts.headers)?;
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
    let table = state.workers.table();
    let pool = table.resolve(fields.model.as_deref())?;
    let mut busy = state.busy.get(pool.model.as_str());
    if let (Some(queue), Some(c)) = (&state.queue, class) {
        busy = queue.thresholds(c, busy);
    }
    let plan = routing::plan(
        &state.kv,
        pool,
        &parts.headers,
        &hints,
        &busy,
        state.affinity.as_ref(),
        &fields,
        tokens,
        started,
        false,
    )?;
    state
        .metrics
        .routing_seconds
        .observe(started.elapsed().as_secs_f64());
    let choice = plan.choice().clone();
    let rank = &choice.worker.ranks[choice.rank];
    if plan.policy == PolicyKind::KvAware && plan.prompt_tokens > 0 {
        let cached = choice.kv.overlap.total() as f64 * state.kv.block_size as f64;
        state
            .metrics
            .kv_hit_ratio
            .observe((cached / plan.prompt_tokens as f64).min(1.0));
        if !state.kv.uses_events(&choice.worker) {
            state.kv.record_routed(rank.replica, &plan.hashes, started);
        }
    }
    let load = plan.request_load(state.kv.block_size);
    let stream = fields.stream;
    drop(fields);
    drop(table);
    tracing::debug!(worker = %choice.worker.id, dp_rank = ?rank.dp_rank, "Routed");
    choice.worker.series.decisions.inc();
    choice.worker.series.processed.inc();

    let mut guard = InFlight::new(
        choice.worker.clone(),
        choice.rank,
        load,
        state.queue.clone(),
    );
    // Its load is counted: the queue may consider the next request.
    drop(released);
    if stream {
        guard = guard.with_ttft(arrived, state.metrics.ttft_seconds.clone());
    }
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |pq| pq.as_str());
    let response = proxy::forward(
        &state.client,
        guard,
        Forward {
            method: parts.method,
            path_and_query,
            headers: &parts.headers,
            body,
            request_id,
            timeout: state.settings.request_timeout,
        },
    )
    .await?;
    Ok(response.map(Body::new))
}

/// `POST /debug/route`: the decision the router would make for this request, with every
/// candidate's terms, without sending it or changing any state.
async fn debug_route(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let result = async {
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

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let table = state.workers.table();
    let body = serde_json::json!({"object": "list", "data": table.model_cards()});
    state.metrics.request("/v1/models", 200);
    Json(body).into_response()
}

/// Admin calls: with `--admin-api-key`, the key as a bearer token; without, changes only
/// from loopback (reads from anywhere).
fn check_admin(state: &AppState, req: &Request, mutating: bool) -> Result<(), GatewayError> {
    match &state.settings.admin_api_key {
        Some(key) => {
            let given = req
                .headers()
                .get(http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if given == Some(key.as_str()) {
                Ok(())
            } else {
                Err(GatewayError::Unauthorized(
                    "admin calls need Authorization: Bearer <admin key>",
                ))
            }
        }
        None if !mutating => Ok(()),
        None => {
            let peer = req
                .extensions()
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|c| c.0.ip());
            if peer.is_some_and(|ip| ip.is_loopback()) {
                Ok(())
            } else {
                Err(GatewayError::Unauthorized(
                    "without --admin-api-key, admin changes are accepted from loopback only",
                ))
            }
        }
    }
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

async fn workers(State(state): State<Arc<AppState>>) -> Response {
    Json(serde_json::json!({"workers": state.workers.statuses()})).into_response()
}

async fn not_found(req: Request) -> Response {
    GatewayError::NotFound(format!("{} {}", req.method(), req.uri().path())).into_response()
}
