//! The HTTP server: the axum app, its handlers, and the serve loop.
//!
//! [`Gateway::app`] is the whole API as a `Router` that tests drive with `oneshot`;
//! [`Gateway::serve`] runs it on listeners the caller bound (tests bind port 0), with the
//! metrics app on its own listener, until the shutdown token fires: then it stops
//! accepting, lets in-flight requests finish for up to the grace period, and joins every
//! background task it started (each worker's health checks, KV-event subscription and
//! metric scraper, also for workers added at run time).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use http::{HeaderValue, StatusCode};
use kvroute_tokenizer::Tokenizer;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::auth;
use crate::config::{ConfigError, Settings, WorkerSource, WorkerSpec};
use crate::context::AppState;
use crate::discovery;
use crate::error::GatewayError;
use crate::forward::route_and_forward;
use crate::http::REQUEST_ID_HEADER;
use crate::pick::tenant_of;
use crate::tls::TlsError;
use crate::workers::{Worker, WorkerSet};

mod admin;
mod background;
mod dashboard;
mod probes;

use admin::{add_worker, debug_route, get_busy, remove_worker, set_busy, workers};
#[cfg(unix)]
use background::spawn_reload_on_hangup;
use background::{serve_api, spawn_discovery, spawn_upkeep, start_worker};

/// Routes whose requests are routed by the policy and forwarded to a worker.
const ROUTED: [&str; 9] = [
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/completions",
    "/generate",
    "/v1/embeddings",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
];

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
        Self {
            state: Arc::new(AppState::new(settings, registry, tokenizer)),
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
            .route("/liveness", get(health))
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
        let spec = spec
            .validated()
            .map_err(|e| GatewayError::InvalidAdmin(e.to_string()))?;
        let worker = self.state.workers.add(&spec)?;
        start_worker(&self.state, worker.clone());
        Ok(worker)
    }

    /// Serves `/health`, `/liveness` and `/readiness` on `listener` from a thread of their
    /// own until the gateway shuts down (`--health-check-port`).
    pub fn serve_probes(
        &self,
        listener: std::net::TcpListener,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        probes::spawn(self.state.clone(), listener, self.state.shutdown.clone())
    }

    /// Removes a worker: no new request goes to it, its in-flight requests finish, its
    /// tasks stop and its KV blocks are forgotten.
    pub fn remove_worker(&self, id: &str) -> Result<Arc<Worker>, GatewayError> {
        background::remove_worker(&self.state, id)
    }

    /// Re-reads the config file's workers (under the command line's worker flags, merged
    /// as at start) and applies the difference: new ids added, missing ids removed, changed
    /// ones replaced.
    pub fn reload(&self) -> Result<(usize, usize), ConfigError> {
        let Some((path, wanted)) = discovery::config_file_workers(&self.state.settings)? else {
            return Ok((0, 0));
        };
        if wanted.is_empty() && !self.state.settings.discovers() {
            tracing::warn!(path = %path.display(), "The reloaded config lists no worker: keeping the current ones");
            return Ok((0, 0));
        }
        let (added, removed) = discovery::reconcile(
            self,
            |s| matches!(s, WorkerSource::Static | WorkerSource::Config),
            wanted,
        );
        tracing::info!(path = %path.display(), added, removed, "Config reloaded");
        Ok((added, removed))
    }

    /// Re-reads the API's certificate and key files (what SIGHUP does): connections accepted
    /// from now on use them, open ones keep theirs. On an error the current certificate
    /// stays. `Ok(false)` when the API does not serve TLS.
    pub fn reload_tls(&self) -> Result<bool, TlsError> {
        let (Some(files), Some(current)) = (&self.state.settings.tls.api, &self.state.api_tls)
        else {
            return Ok(false);
        };
        current.store(files.reload()?);
        tracing::info!(cert = %files.cert_path.display(), "API certificate reloaded: new connections use it");
        Ok(true)
    }

    /// Serves as the endpoint picker (`--epp`) on `listeners` until the router shuts down:
    /// call it before [`Gateway::serve`].
    pub fn serve_epp(
        &self,
        listeners: crate::epp::serve::EppListeners,
    ) -> Result<(), crate::epp::serve::EppError> {
        // Without `--epp` (a test serving both ways), the picker serves h2c.
        let serving = match &self.state.settings.epp {
            Some(epp) => epp.serving.clone(),
            None => crate::config::EppServing::H2c,
        };
        crate::epp::serve::spawn(&self.state, &serving, listeners)
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
        if let Some(config) = &state.settings.replica_sync {
            let handle = crate::sync::transport::spawn(
                config.clone(),
                crate::sync::transport::Local {
                    workers: state.workers.clone(),
                    kv: state.kv.clone(),
                    affinity: state.affinity.clone(),
                    rate_limits: state.rate_limits.clone(),
                },
                state.sync_metrics.clone(),
                &state.tasks,
                state.shutdown.clone(),
            );
            if let Some(limits) = &state.rate_limits {
                let handle = handle.clone();
                limits.share(Box::new(move |c| {
                    handle.send(crate::sync::Message::RateCharged {
                        tenant: c.tenant.as_str().to_owned(),
                        rule: c.rule,
                        tokens: c.tokens,
                        requests: c.requests,
                    })
                }));
            }
            let _ = state.sync.set(handle);
        }
        spawn_upkeep(&state);
        spawn_discovery(&self);
        state.access.start(&state.tasks, state.shutdown.clone());
        // The exporter outlives the grace period: the last requests' spans go out too.
        let export_stop = CancellationToken::new();
        if let Some(tracer) = &state.tracer {
            tracing::info!(endpoint = %tracer.settings.endpoint, ratio = tracer.settings.sampling_ratio, "Tracing to an OTLP collector");
            state.tasks.spawn(crate::otlp::export::run(
                tracer.clone(),
                state.client.clone(),
                export_stop.clone(),
            ));
        }
        #[cfg(unix)]
        if state.settings.config_path.is_some() || state.api_tls.is_some() {
            spawn_reload_on_hangup(self.clone());
        }
        let dashboard =
            dashboard::Dashboard::new(state.clone(), registry.clone(), self.policy_description());
        dashboard.spawn_sampler();
        let metrics_routes = metrics_app(registry).merge(dashboard::routes(dashboard));
        let metrics_stop = state.shutdown.clone();
        let metrics = tokio::spawn(async move {
            axum::serve(metrics_listener, metrics_routes)
                .with_graceful_shutdown(metrics_stop.cancelled_owned())
                .await
        });
        let served = serve_api(
            listener,
            self.app(),
            state.api_tls.as_ref(),
            state.settings.header_read_timeout,
            state.settings.shutdown_grace,
            &state.shutdown,
        )
        .await;
        state.shutdown.cancel();
        export_stop.cancel();
        let metrics = metrics.await.unwrap_or(Ok(()));
        state.tasks.close();
        state.tasks.wait().await;
        served.and(metrics)
    }
}

/// Discovery sources change the set through the gateway, which starts and stops each
/// worker's tasks.
impl discovery::Workers for Gateway {
    fn set(&self) -> &WorkerSet {
        &self.state.workers
    }

    fn add(&self, spec: WorkerSpec) -> Result<(), GatewayError> {
        self.add_worker(spec).map(drop)
    }

    fn remove(&self, id: &str) -> bool {
        self.remove_worker(id).is_ok()
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
    let parent = req
        .headers()
        .get("traceparent")
        .and_then(|v| crate::otlp::Parent::parse(v.as_bytes()));
    let span = state.tracer.as_ref().and_then(|t| {
        let span = t.start(
            || format!("{} {route}", req.method()),
            parent.as_ref(),
            req.headers().get("tracestate"),
        )?;
        span.set_str("kvroute.route", route);
        span.set_str("http.request.method", req.method().as_str());
        Some(span)
    });
    // At info level when logging JSON, so that each of the request's lines carries its ids.
    let trace_hex = match (&span, &parent) {
        (Some(span), _) => Some(span.trace_id()),
        (None, Some(p)) => Some(crate::otlp::to_hex(&p.trace_id)),
        (None, None) => None,
    };
    let trace_id = trace_hex.as_deref();
    let log_span = if state.settings.log_json {
        tracing::info_span!(
            "request",
            route,
            request_id = request_id.to_str().unwrap_or_default(),
            trace_id
        )
    } else {
        tracing::debug_span!(
            "request",
            route,
            request_id = request_id.to_str().unwrap_or_default(),
            trace_id
        )
    };
    // The front door resolves the caller's tenant; the request path takes it from here.
    let mut tenant = None;
    let forwarded = async {
        let caller = auth::Caller {
            headers: req.headers(),
            peer: auth::peer(req.extensions()),
            fairness_id: None,
        };
        let known = tenant.insert(tenant_of(&state, &caller, span.as_ref()).await?);
        route_and_forward(&state, route, req, &request_id, span.as_ref(), known).await
    };
    let mut response = match forwarded.instrument(log_span).await {
        Ok(response) => response,
        Err(error) => {
            if let Some(span) = &span {
                span.error(error.to_string());
            }
            if crate::routing::ANTHROPIC_ROUTES.contains(&route) {
                error.into_anthropic_response()
            } else {
                error.into_response()
            }
        }
    };
    response
        .headers_mut()
        .entry(REQUEST_ID_HEADER)
        .or_insert(request_id);
    let status = response.status();
    state.metrics.request(route, status.as_u16());
    if let Some(tenant) = &tenant {
        state.metrics.tenants.request(tenant, status.as_u16());
    }
    match span {
        Some(span) => {
            span.set_int("http.response.status_code", status.as_u16().into());
            if status.is_server_error() {
                span.error(format!("answered {status}"));
            }
            response.map(|body| Body::new(crate::otlp::Traced::new(body, span)))
        }
        None => response,
    }
}

async fn models(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let caller = auth::Caller {
        headers: req.headers(),
        peer: auth::peer(req.extensions()),
        fairness_id: None,
    };
    if let Err(r) = state.access.client(&caller).await {
        state.metrics.request("/v1/models", 401);
        return GatewayError::refused(r, false).into_response();
    }
    let table = state.workers.table();
    let body = serde_json::json!({"object": "list", "data": table.model_cards()});
    state.metrics.request("/v1/models", 200);
    Json(body).into_response()
}

async fn health() -> &'static str {
    "ok"
}

async fn readiness(State(state): State<Arc<AppState>>) -> Response {
    // With replica sync, also once the peers' snapshot is in.
    let synced = state.settings.replica_sync.is_none()
        || state
            .sync
            .get()
            .is_some_and(|s| s.synced.load(std::sync::atomic::Ordering::Relaxed));
    let ready = synced && state.workers.is_ready();
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

async fn not_found(req: Request) -> Response {
    GatewayError::NotFound(format!("{} {}", req.method(), req.uri().path())).into_response()
}
