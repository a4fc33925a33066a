//! The HTTP face of the simulator: vLLM's API over one engine core per data-parallel rank.
//!
//! [`SimServer::new`] builds the state (no I/O); [`SimServer::serve`] binds the KV-event
//! sockets (and a prefill engine's bootstrap port), starts one `driver::Driver` per rank, a
//! publisher per socket and the bootstrap server, serves the API on the listener it is
//! given until the shutdown token fires (or the engine crashes, see the `faults` module),
//! and joins them all. With the TLS flags the API is https only (the `tls` module).
//! [`SimInstance`] runs one on a task, for tests that crash and restart engines.
//! Prefill/decode disaggregation (`--role`) is in the `pd` module.
//!
//! The routes are in [`SimServer::app`]; their handlers live by what they serve: `completions`
//! (the endpoints that take a prompt), `messages` (Anthropic's Messages API), `admin` (model and server info, `/metrics`, the cache
//! reset) and `faults` (`/fault`). Errors become responses in one place, `error`.

mod adapters;
mod admin;
mod bootstrap;
mod completions;
mod driver;
mod error;
mod faults;
mod generate;
mod instance;
mod kv_publisher;
mod messages;
mod metrics;
mod openai;
mod pd;
mod speed;
mod tls;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use kvroute_tokenizer::Tokenizer;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::{Role, SimArgs};
use crate::engine::EngineCore;
use admin::{metrics_text, model_info, models, reset_prefix_cache, server_info};
use completions::{chat, completions, detokenize, render_chat, render_completion, tokenize};
use driver::{Command, Driver};
use faults::{CrashListener, Faults};

pub use faults::{Crashed, FaultHandle};
pub use instance::SimInstance;
pub use kv_publisher::rank_endpoint;

/// vLLM's header naming the data-parallel rank a request should run on.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

struct Pending {
    cores: Vec<EngineCore>,
    receivers: Vec<mpsc::UnboundedReceiver<Command>>,
    series: Vec<metrics::EngineSeries>,
    /// With https, its handshakes' counters.
    handshakes: Option<tls::Handshakes>,
}

struct AppState {
    args: SimArgs,
    /// The LoRA adapters it serves.
    adapters: Arc<adapters::Adapters>,
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
        let adapters = Arc::new(adapters::Adapters::new(&args.lora, &args.model));
        let lora_info = adapters.enabled().then(|| {
            metrics::LoraInfo::register(&mut registry, adapters.clone(), args.lora.max_loras)
        });
        let series: Vec<metrics::EngineSeries> = metrics::register(
            &mut registry,
            &args.model,
            args.role,
            ranks,
            args.block_size,
            args.num_gpu_blocks,
        )
        .into_iter()
        .map(|s| s.with_lora(lora_info.clone()))
        .collect();
        let sent = series.iter().map(|s| s.sent.clone()).collect();
        let faults = Arc::new(Faults::new(args.faults, args.seed, &mut registry));
        let rooms = Arc::new(bootstrap::Rooms::default());
        registry.register(
            "kvroute_sim_bootstrap_waiting",
            "Decode engines waiting for the prefill of one of this engine's bootstrap rooms",
            rooms.waiting(),
        );
        let handshakes = args
            .tls_cert_path
            .is_some()
            .then(|| tls::Handshakes::register(&mut registry));
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
                adapters,
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
                handshakes,
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
            .route("/v1/messages", post(messages::messages))
            .route("/v1/messages/count_tokens", post(messages::count_tokens))
            .route("/v1/completions/render", post(render_completion))
            .route("/v1/chat/completions/render", post(render_chat))
            .route("/v1/models", get(models))
            .route("/v1/load_lora_adapter", post(adapters::load_adapter))
            .route("/v1/unload_lora_adapter", post(adapters::unload_adapter))
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
            .route("/speed", post(speed::post_speed))
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

    /// Reads the TLS files and binds the KV-event sockets and the bootstrap port: what can
    /// fail before the engine runs.
    async fn bind(self) -> anyhow::Result<Bound> {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| anyhow::anyhow!("SimServer::serve called twice"))?;
        let args = &self.state.args;
        let tls = tls::server_config(args)?;
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
                        self.state.adapters.clone(),
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
            tls,
        })
    }
}

/// A server with its KV-event sockets and bootstrap port bound.
struct Bound {
    server: SimServer,
    pending: Pending,
    publishers: Vec<Option<kv_publisher::Publisher>>,
    bootstrap: Option<TcpListener>,
    /// The https configuration, when the API is served over TLS.
    tls: Option<Arc<rustls::ServerConfig>>,
}

impl Bound {
    async fn run(self, listener: TcpListener, shutdown: CancellationToken) -> anyhow::Result<()> {
        let state = self.server.state.clone();
        let stopping = state.stopping.clone();
        if let Ok(addr) = listener.local_addr() {
            let _ = state.http_addr.set(addr);
        }
        let handshakes = self.pending.handshakes.clone().unwrap_or_default();
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
        let signal = {
            let stopping = stopping.clone();
            async move {
                tokio::select! {
                    _ = shutdown.cancelled() => stopping.cancel(),
                    _ = stopping.cancelled() => {}
                }
            }
        };
        let served = match self.tls {
            None => {
                let listener = CrashListener::new(listener, state.faults.clone());
                axum::serve(listener, app)
                    .with_graceful_shutdown(signal)
                    .await
            }
            Some(config) => {
                let faults = state.faults.clone();
                let (listener, accept) =
                    tls::listen(listener, config, faults, handshakes, stopping.clone())?;
                tasks.spawn(accept);
                axum::serve(listener, app)
                    .with_graceful_shutdown(signal)
                    .await
            }
        };
        stopping.cancel();
        while tasks.join_next().await.is_some() {}
        if state.faults.is_crashed() {
            return Err(Crashed.into());
        }
        served.map_err(Into::into)
    }
}
