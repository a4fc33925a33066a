//! The HTTP face of the simulator: vLLM's API over one engine core per data-parallel rank.
//!
//! [`SimServer::new`] builds the state (no I/O); [`SimServer::serve`] binds the KV-event
//! sockets, starts one [`driver::Driver`] per rank and a publisher per socket, serves the
//! API on the listener it is given until the shutdown token fires (or the engine crashes,
//! see [`faults`]), and joins them all. [`SimInstance`] runs one on a task, for tests that
//! crash and restart engines.

mod driver;
mod faults;
mod instance;
mod kv_publisher;
mod metrics;
mod openai;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
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

use crate::config::SimArgs;
use crate::engine::{EngineCore, EngineRequest, RequestId};
use driver::{Command, Delivery, Driver};
use faults::{CrashListener, Faults};
use openai::{Api, ResponseMeta};

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
            ranks,
            args.block_size,
            args.num_gpu_blocks,
        );
        let faults = Arc::new(Faults::new(args.faults, args.seed, &mut registry));
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

    /// Binds the KV-event sockets: what can fail before the engine runs.
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
        Ok(Bound {
            server: self,
            pending,
            publishers,
        })
    }
}

/// A server with its KV-event sockets bound.
struct Bound {
    server: SimServer,
    pending: Pending,
    publishers: Vec<Option<kv_publisher::Publisher>>,
}

impl Bound {
    async fn run(self, listener: TcpListener, shutdown: CancellationToken) -> anyhow::Result<()> {
        let state = self.server.state.clone();
        let stopping = state.stopping.clone();
        let mut tasks = tokio::task::JoinSet::new();
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
    kind: &'static str,
    message: String,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
        }
    }

    fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: message.into(),
        }
    }

    fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "ServiceUnavailableError",
            message: message.into(),
        }
    }

    /// A failure injected by `fail_rate`.
    fn injected(status: StatusCode) -> Self {
        Self {
            status,
            kind: faults::error_type(status),
            message: "injected fault (kvroute-sim fail_rate)".to_owned(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = openai::error_body(self.status.as_u16(), self.kind, &self.message);
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
        Api::Completion,
        prompt,
        max_tokens,
        body.stream.unwrap_or(false),
        salt_of(body.cache_salt.as_deref()),
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
        Api::Chat,
        prompt,
        max_tokens,
        body.stream.unwrap_or(false),
        salt_of(body.cache_salt.as_deref()),
    )
    .await
}

/// Sends an abort to the engine if the request's answer is dropped before it finished.
struct AbortOnDrop {
    id: RequestId,
    tx: mpsc::UnboundedSender<Command>,
    done: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(Command::Abort(self.id));
        }
    }
}

async fn generate(
    state: &AppState,
    headers: &HeaderMap,
    api: Api,
    prompt: Vec<u32>,
    max_tokens: usize,
    stream: bool,
    salt: u64,
) -> Result<Response, ApiError> {
    let rank = state.rank(headers)?;
    let id = RequestId(state.next_id.fetch_add(1, Ordering::Relaxed));
    let meta = ResponseMeta {
        api,
        id: format!(
            "{}-{:016x}",
            if api == Api::Chat { "chatcmpl" } else { "cmpl" },
            rand::random::<u64>()
        ),
        created: state.created,
        model: state.args.model.clone(),
        fingerprint: state.args.instance_id.clone(),
        prompt_tokens: prompt.len(),
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let request = EngineRequest {
        id,
        prompt,
        max_tokens,
        salt,
    };
    if state.ranks[rank]
        .send(Command::Add { request, tx })
        .is_err()
    {
        return Err(ApiError::unavailable("engine stopped"));
    }
    let mut guard = AbortOnDrop {
        id,
        tx: state.ranks[rank].clone(),
        done: false,
    };
    // The first delivery says whether the engine took the request.
    let first = match rx.recv().await {
        Some(Delivery::Rejected(e)) => {
            guard.done = true;
            return Err(bad_request(e.to_string()));
        }
        Some(d) => d,
        None => {
            return Err(ApiError::unavailable("engine stopped"));
        }
    };
    // The request that `crash_after_requests` makes the last: it dies after its first token.
    let last = state.faults.accept();
    if last && !stream {
        state.faults.crash();
        return Err(ApiError::unavailable("engine crashed"));
    }
    let tokenizer = state.tokenizer.clone();
    if !stream {
        let mut tokens = Vec::with_capacity(max_tokens);
        let mut next = Some(first);
        while let Some(Delivery::Token {
            token,
            finished,
            cached_tokens,
            ..
        }) = next
        {
            tokens.push(token);
            if finished {
                guard.done = true;
                let text = tokenizer.decode(&tokens).unwrap_or_default();
                return Ok(Json(openai::full_response(
                    &meta,
                    &text,
                    tokens.len(),
                    cached_tokens,
                ))
                .into_response());
            }
            next = rx.recv().await;
        }
        return Err(ApiError::unavailable("engine stopped"));
    }
    // Streaming: one SSE event per token, then the usage chunk and [DONE].
    let mut prelude = String::new();
    if api == Api::Chat {
        prelude.push_str(&openai::sse(&openai::role_chunk(&meta)));
    }
    struct StreamState {
        rx: mpsc::UnboundedReceiver<Delivery>,
        first: Option<Delivery>,
        prelude: Option<String>,
        guard: AbortOnDrop,
        meta: ResponseMeta,
        chunk: openai::ChunkTemplate,
        tokenizer: Arc<Tokenizer>,
        count: usize,
        ended: bool,
        /// Crash the engine once the first token is sent (`crash_after_requests`).
        crash: Option<Arc<Faults>>,
    }
    let st = StreamState {
        rx,
        first: Some(first),
        prelude: Some(prelude),
        guard,
        chunk: openai::ChunkTemplate::new(&meta),
        meta,
        tokenizer,
        count: 0,
        ended: false,
        crash: last.then(|| state.faults.clone()),
    };
    // One body frame per wake-up: the tokens that arrived since the last one (one token when
    // the client keeps pace, several in one write when it lags). A stream whose engine stops
    // before its end fails, so the connection is cut without the final chunk: a truncated
    // answer never looks complete.
    let body = futures_util::stream::unfold(st, |mut st| async move {
        if st.ended {
            return None;
        }
        if st.count > 0 {
            if let Some(faults) = st.crash.take() {
                // Yield once so hyper writes the first token out, then die.
                tokio::task::yield_now().await;
                faults.crash();
                st.ended = true;
                return Some((Err(std::io::Error::other("engine crashed")), st));
            }
        }
        let mut out = st.prelude.take().unwrap_or_default();
        let mut next = match st.first.take() {
            Some(d) => Some(d),
            None => st.rx.recv().await,
        };
        let mut any = false;
        while let Some(Delivery::Token {
            token,
            finished,
            cached_tokens,
            ..
        }) = next
        {
            any = true;
            st.count += 1;
            let text = st.tokenizer.decode(&[token]).unwrap_or_default();
            if st.crash.is_some() {
                // The first token only, never the end.
                st.chunk.push(&mut out, &text, false);
                break;
            }
            st.chunk.push(&mut out, &text, finished);
            if finished {
                st.guard.done = true;
                st.ended = true;
                out.push_str(&openai::sse(&openai::usage_chunk(
                    &st.meta,
                    st.count,
                    cached_tokens,
                )));
                out.push_str("data: [DONE]\n\n");
                break;
            }
            next = st.rx.try_recv().ok();
        }
        if !any {
            st.ended = true;
            return Some((Err(std::io::Error::other("engine stopped")), st));
        }
        Some((Ok(Bytes::from(out)), st))
    });
    Ok(Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(body))
        .expect("valid response"))
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
