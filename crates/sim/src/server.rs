//! The HTTP face of the simulator: vLLM's API over one engine core per data-parallel rank.
//!
//! [`SimServer::new`] builds the state (no I/O); [`SimServer::serve`] binds the KV-event
//! sockets (and a prefill engine's bootstrap port), starts one `driver::Driver` per rank, a
//! publisher per socket and the bootstrap server, serves the API on the listener it is
//! given until the shutdown token fires (or the engine crashes, see the `faults` module), and joins
//! them all. [`SimInstance`] runs one on a task, for tests that crash and restart engines.
//! Prefill/decode disaggregation (`--role`) is in the `pd` module.

mod bootstrap;
mod driver;
mod faults;
mod generate;
mod instance;
mod kv_publisher;
mod metrics;
mod openai;
mod pd;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvroute_tokenizer::{ChatOptions, Tokenizer};
use prometheus_client::registry::Registry;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::config::{Role, SimArgs};
use crate::engine::EngineCore;
use driver::{Command, Driver};
use faults::{CrashListener, Faults};
use generate::{generate, Generate};
use openai::Api;

pub use faults::{Crashed, FaultHandle};
pub use instance::SimInstance;
pub use kv_publisher::rank_endpoint;

/// vLLM's header naming the data-parallel rank a request should run on.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

struct Pending {
    cores: Vec<EngineCore>,
    receivers: Vec<mpsc::UnboundedReceiver<Command>>,
    series: Vec<metrics::EngineSeries>,
}

struct AppState {
    args: SimArgs,
    tokenizer: Arc<Tokenizer>,
    ranks: Vec<mpsc::UnboundedSender<Command>>,
    next_rank: AtomicUsize,
    next_id: AtomicU64,
    created: u64,
    registry: Registry,
    faults: Arc<Faults>,
    /// Cancelled when the server stops or crashes (a child of the crash token).
    stopping: CancellationToken,
    /// A prefill engine's bootstrap rooms.
    rooms: Arc<bootstrap::Rooms>,
    /// Per rank: the prefills served for decode engines.
    sent: Vec<metrics::TransferCounters>,
    /// The HTTP listener's address, once serving.
    http_addr: OnceLock<SocketAddr>,
}

/// A simulated vLLM server.
pub struct SimServer {
    state: Arc<AppState>,
    pending: Mutex<Option<Pending>>,
}

impl std::fmt::Debug for SimServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimServer")
            .field("model", &self.state.args.model)
            .field("ranks", &self.state.ranks.len())
            .finish()
    }
}

/// Token ids the engines sample outputs from: ids that decode to short plain text.
fn output_tokens(tokenizer: &Tokenizer) -> Vec<u32> {
    if tokenizer.is_fallback() {
        return (b'a'..=b'z').chain([b' ']).map(u32::from).collect();
    }
    let ids: Vec<u32> = (0..tokenizer.vocab_size())
        .filter(|&id| {
            let s = tokenizer.decode(&[id]).unwrap_or_default();
            !s.trim().is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == ' ')
        })
        .collect();
    if ids.is_empty() {
        (0..tokenizer.vocab_size().max(1)).collect()
    } else {
        ids
    }
}

impl SimServer {
    /// Builds the server and its engines. Does no I/O and spawns nothing.
    pub fn new(args: SimArgs, tokenizer: Arc<Tokenizer>) -> Self {
        let mut registry = Registry::default();
        let ranks = args.data_parallel_size.max(1);
        let series = metrics::register(
            &mut registry,
            &args.model,
            args.role,
            ranks,
            args.block_size,
            args.num_gpu_blocks,
        );
        let sent = series.iter().map(|s| s.sent.clone()).collect();
        let faults = Arc::new(Faults::new(args.faults, args.seed, &mut registry));
        let rooms = Arc::new(bootstrap::Rooms::default());
        registry.register(
            "kvroute_sim_bootstrap_waiting",
            "Decode engines waiting for the prefill of one of this engine's bootstrap rooms",
            rooms.waiting(),
        );
        let stopping = faults.crash_token().child_token();
        let outputs = output_tokens(&tokenizer);
        let mut senders = Vec::new();
        let mut receivers = Vec::new();
        let mut cores = Vec::new();
        for rank in 0..ranks {
            let (tx, rx) = mpsc::unbounded_channel();
            senders.push(tx);
            receivers.push(rx);
            cores.push(EngineCore::new(args.engine_config(rank, outputs.clone())));
        }
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Self {
            state: Arc::new(AppState {
                args,
                tokenizer,
                ranks: senders,
                next_rank: AtomicUsize::new(0),
                next_id: AtomicU64::new(0),
                created,
                registry,
                faults,
                stopping,
                rooms,
                sent,
                http_addr: OnceLock::new(),
            }),
            pending: Mutex::new(Some(Pending {
                cores,
                receivers,
                series,
            })),
        }
    }

    /// Controls this engine's faults, and crashes it; valid before and after `serve`.
    pub fn faults(&self) -> FaultHandle {
        FaultHandle(self.state.faults.clone())
    }

    /// The API, without a socket.
    pub fn app(&self) -> Router {
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat))
            .route("/v1/completions/render", post(render_completion))
            .route("/v1/chat/completions/render", post(render_chat))
            .route("/v1/models", get(models))
            .route("/health", get(|| async { StatusCode::OK }))
            .route("/tokenize", post(tokenize))
            .route("/detokenize", post(detokenize))
            .route("/reset_prefix_cache", post(reset_prefix_cache))
            .route("/server_info", get(server_info))
            .route("/get_server_info", get(server_info))
            .route("/model_info", get(model_info))
            .route("/get_model_info", get(model_info))
            .route("/metrics", get(metrics_text))
            .route("/fault", get(faults::get_faults).post(faults::post_faults))
            .with_state(self.state.clone())
    }

    /// Runs the engines and serves the API until `shutdown`. Can be called once.
    ///
    /// Returns an error holding [`Crashed`] when the engine crashed (fault injection), once
    /// its listener and KV-event sockets are closed: a restart may bind the same ports.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        self.bind().await?.run(listener, shutdown).await
    }

    /// Binds the KV-event sockets and the bootstrap port: what can fail before the engine
    /// runs.
    async fn bind(self) -> anyhow::Result<Bound> {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| anyhow::anyhow!("SimServer::serve called twice"))?;
        let args = &self.state.args;
        let mut publishers = Vec::with_capacity(pending.cores.len());
        for rank in 0..pending.cores.len() {
            publishers.push(match &args.kv_events_endpoint {
                Some(endpoint) => Some(
                    kv_publisher::Publisher::bind(
                        endpoint,
                        rank,
                        &args.kv_events_topic,
                        args.kv_events_format,
                        args.block_size,
                    )
                    .await?,
                ),
                None => None,
            });
        }
        let bootstrap = match (args.role, args.bootstrap_port) {
            (Role::Prefill, Some(port)) => {
                let listener = TcpListener::bind((args.host.as_str(), port))
                    .await
                    .map_err(|e| {
                        anyhow::anyhow!("cannot bind the bootstrap port {}:{port}: {e}", args.host)
                    })?;
                tracing::info!(host = %args.host, port, "Serving bootstrap rooms");
                Some(listener)
            }
            _ => None,
        };
        Ok(Bound {
            server: self,
            pending,
            publishers,
            bootstrap,
        })
    }
}

/// A server with its KV-event sockets and bootstrap port bound.
struct Bound {
    server: SimServer,
    pending: Pending,
    publishers: Vec<Option<kv_publisher::Publisher>>,
    bootstrap: Option<TcpListener>,
}

impl Bound {
    async fn run(self, listener: TcpListener, shutdown: CancellationToken) -> anyhow::Result<()> {
        let state = self.server.state.clone();
        let stopping = state.stopping.clone();
        if let Ok(addr) = listener.local_addr() {
            let _ = state.http_addr.set(addr);
        }
        let mut tasks = tokio::task::JoinSet::new();
        if let Some(bootstrap) = self.bootstrap {
            tasks.spawn(bootstrap::serve(
                bootstrap,
                state.rooms.clone(),
                stopping.clone(),
            ));
        }
        for (((core, commands), series), publisher) in self
            .pending
            .cores
            .into_iter()
            .zip(self.pending.receivers)
            .zip(self.pending.series)
            .zip(self.publishers)
        {
            let events = publisher.map(|publisher| {
                let (tx, rx) = mpsc::unbounded_channel();
                tasks.spawn(publisher.run(rx, state.faults.clone(), stopping.clone()));
                tx
            });
            let driver = Driver {
                core,
                commands,
                series,
                events,
            };
            tasks.spawn(driver.run(stopping.clone()));
        }
        let app = self.server.app();
        let listener = CrashListener::new(listener, state.faults.clone());
        let signal = {
            let stopping = stopping.clone();
            async move {
                tokio::select! {
                    _ = shutdown.cancelled() => stopping.cancel(),
                    _ = stopping.cancelled() => {}
                }
            }
        };
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(signal)
            .await;
        stopping.cancel();
        while tasks.join_next().await.is_some() {}
        if state.faults.is_crashed() {
            return Err(Crashed.into());
        }
        served.map_err(Into::into)
    }
}

/// An error answer, in vLLM's shape; the one place errors become responses.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// A failure injected by `fail_rate`.
    fn injected(status: StatusCode) -> Self {
        Self::new(status, "injected fault (kvroute-sim fail_rate)")
    }

    /// The error's `type`, named after its status (see [`openai::error_type`]).
    fn kind(&self) -> &'static str {
        openai::error_type(self.status)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = openai::error_body(self.status.as_u16(), self.kind(), &self.message);
        (self.status, Json(body)).into_response()
    }
}

fn bad_request(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

async fn json_body<T: serde::de::DeserializeOwned>(
    req: Request,
) -> Result<(HeaderMap, T), ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, 64 * 1024 * 1024)
        .await
        .map_err(|e| bad_request(format!("cannot read body: {e}")))?;
    let value =
        serde_json::from_slice(&bytes).map_err(|e| bad_request(format!("invalid request: {e}")))?;
    Ok((parts.headers, value))
}

impl AppState {
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.args.model => Err(ApiError::not_found(format!(
                "The model `{m}` does not exist."
            ))),
            _ => Ok(()),
        }
    }

    fn rank(&self, headers: &HeaderMap) -> Result<usize, ApiError> {
        match headers.get(DP_RANK_HEADER) {
            Some(v) => {
                let rank = v
                    .to_str()
                    .ok()
                    .and_then(|s| s.trim().parse::<usize>().ok())
                    .ok_or_else(|| bad_request(format!("invalid {DP_RANK_HEADER} header")))?;
                if rank >= self.ranks.len() {
                    return Err(bad_request(format!(
                        "data parallel rank {rank} out of range (size {})",
                        self.ranks.len()
                    )));
                }
                Ok(rank)
            }
            None => Ok(self.next_rank.fetch_add(1, Ordering::Relaxed) % self.ranks.len()),
        }
    }

    fn completion_tokens(&self, prompt: &Value) -> Result<Vec<u32>, ApiError> {
        match prompt {
            Value::String(s) => self.encode_prompt(s),
            Value::Array(items) if items.len() == 1 && items[0].is_string() => {
                self.encode_prompt(items[0].as_str().unwrap_or_default())
            }
            Value::Array(items) if items.iter().all(Value::is_u64) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|id| u32::try_from(id).ok())
                        .ok_or_else(|| bad_request("token id out of range"))
                })
                .collect(),
            Value::Array(_) => Err(bad_request(
                "kvroute-sim takes one prompt per request (a string or token ids)",
            )),
            _ => Err(bad_request(
                "prompt must be a string or a list of token ids",
            )),
        }
    }

    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.tokenizer
            .encode_prompt(text)
            .map_err(|e| bad_request(format!("cannot tokenize the prompt: {e}")))
    }

    fn chat_tokens(&self, messages: &Value) -> Result<Vec<u32>, ApiError> {
        if !messages.is_array() {
            return Err(bad_request("messages must be a list"));
        }
        self.tokenizer
            .encode_chat(messages, &ChatOptions::default())
            .map_err(|e| bad_request(format!("cannot render the chat: {e}")))
    }
}

fn salt_of(cache_salt: Option<&str>) -> u64 {
    cache_salt.map_or(0, |s| kvroute_protocol::stable_hash(s.as_bytes()))
}

async fn completions(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    state.faults.before_inference(&state.stopping).await?;
    let (headers, body) = json_body::<openai::CompletionRequest>(req).await?;
    state.check_model(body.model.as_deref())?;
    let prompt = state.completion_tokens(&body.prompt)?;
    let max_tokens = body.max_tokens.unwrap_or(openai::DEFAULT_MAX_TOKENS);
    generate(
        &state,
        &headers,
        Generate {
            api: Api::Completion,
            prompt,
            max_tokens,
            stream: body.stream.unwrap_or(false),
            salt: salt_of(body.cache_salt.as_deref()),
            disagg: body.disagg,
        },
    )
    .await
}

async fn chat(State(state): State<Arc<AppState>>, req: Request) -> Result<Response, ApiError> {
    state.faults.before_inference(&state.stopping).await?;
    let (headers, body) = json_body::<openai::ChatRequest>(req).await?;
    state.check_model(body.model.as_deref())?;
    let prompt = state.chat_tokens(&body.messages)?;
    let max_tokens = body
        .max_completion_tokens
        .or(body.max_tokens)
        .unwrap_or(openai::DEFAULT_MAX_TOKENS);
    generate(
        &state,
        &headers,
        Generate {
            api: Api::Chat,
            prompt,
            max_tokens,
            stream: body.stream.unwrap_or(false),
            salt: salt_of(body.cache_salt.as_deref()),
            disagg: body.disagg,
        },
    )
    .await
}

async fn render_completion(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    let (_, body) = json_body::<openai::CompletionRequest>(req).await?;
    let ids = state.completion_tokens(&body.prompt)?;
    Ok(Json(json!({"token_ids": ids})).into_response())
}

async fn render_chat(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    let (_, body) = json_body::<openai::ChatRequest>(req).await?;
    let ids = state.chat_tokens(&body.messages)?;
    Ok(Json(json!({"token_ids": ids})).into_response())
}

async fn tokenize(State(state): State<Arc<AppState>>, req: Request) -> Result<Response, ApiError> {
    let (_, body) = json_body::<Value>(req).await?;
    let tokens = if let Some(messages) = body.get("messages") {
        state.chat_tokens(messages)?
    } else if let Some(prompt) = body.get("prompt") {
        state.completion_tokens(prompt)?
    } else {
        return Err(bad_request("give prompt or messages"));
    };
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": state.args.num_gpu_blocks * state.args.block_size,
        "tokens": tokens,
        "token_strs": null,
    }))
    .into_response())
}

async fn detokenize(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    struct Detokenize {
        tokens: Vec<u32>,
    }
    let (_, body) = json_body::<Detokenize>(req).await?;
    let text = state
        .tokenizer
        .decode(&body.tokens)
        .map_err(|e| bad_request(format!("cannot detokenize: {e}")))?;
    Ok(Json(json!({"prompt": text})).into_response())
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let a = &state.args;
    Json(json!({"object": "list", "data": [{
        "id": a.model, "object": "model", "created": state.created, "owned_by": "vllm",
        "root": a.model, "parent": null, "max_model_len": a.num_gpu_blocks * a.block_size,
    }]}))
    .into_response()
}

async fn server_info(State(state): State<Arc<AppState>>) -> Response {
    let a = &state.args;
    Json(json!({
        "model_path": a.model, "served_model_name": a.model, "tokenizer_path": a.tokenizer,
        "is_generation": true, "tp_size": 1, "dp_size": state.ranks.len(),
        "page_size": a.block_size, "max_total_num_tokens": a.num_gpu_blocks * a.block_size,
        "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
        "engine": "kvroute-sim",
        // SGLang's names for the role ("null": aggregated) and the bootstrap port.
        "disaggregation_mode": match a.role {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "null",
        },
        "disaggregation_bootstrap_port": a.bootstrap_port,
    }))
    .into_response()
}

async fn model_info(State(state): State<Arc<AppState>>) -> Response {
    let a = &state.args;
    Json(json!({"model_path": a.model, "tokenizer_path": a.tokenizer, "is_generation": true}))
        .into_response()
}

async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> Result<StatusCode, ApiError> {
    let mut all = true;
    for tx in &state.ranks {
        let (reply, rx) = oneshot::channel();
        if tx.send(Command::Reset(reply)).is_err() {
            all = false;
            continue;
        }
        all &= rx.await.unwrap_or(false);
    }
    if all {
        Ok(StatusCode::OK)
    } else {
        Err(ApiError::unavailable(
            "the prefix cache can only be reset when no request is running",
        ))
    }
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, &state.registry) {
        Ok(()) => (
            [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
            text,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}
