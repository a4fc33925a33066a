//! `kvroute`: the router binary.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use kvroute_gateway::config::peers;
use kvroute_gateway::{Gateway, Settings};
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    // The peer routers' flags first: a no-op one is taken out (and logged once logging is
    // set up), a mapped one rewritten, one kvroute does not take refused by name with why.
    let pre = match peers::pre_parse(std::env::args_os()) {
        Ok(pre) => pre,
        Err(refused) => {
            eprintln!("kvroute: {refused}");
            return ExitCode::from(2);
        }
    };
    let noops = pre.noops.clone();
    let args = pre.parse().unwrap_or_else(|e| e.exit());
    let settings = match args.load() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvroute: {e}");
            return ExitCode::from(2);
        }
    };
    init_tracing(&settings);
    for noop in noops {
        tracing::info!(
            flag = noop.flag,
            why = noop.why,
            "Peer flag accepted as a no-op"
        );
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "kvroute stopped");
            eprintln!("kvroute: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(settings: &Settings) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!(
            "kvroute_gateway={0},kvroute={0},warn",
            settings.log_level.as_filter()
        ))
    });
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A closed stderr must not bring the server down (eprintln! would panic).
        .log_internal_errors(false);
    if settings.log_json {
        // The request's span (route, request id, trace id) on each of its lines.
        fmt.json()
            .with_current_span(true)
            .with_span_list(false)
            .init();
    } else {
        fmt.init();
    }
}

/// Simulated engines started in-process when no worker is given.
const EMBEDDED_ENGINES: usize = 4;

/// Starts `EMBEDDED_ENGINES` kvroute-sim servers on loopback ports, each publishing KV
/// events, and returns them as workers.
async fn start_embedded_engines(
    timing: kvroute_sim::engine::TimingFamily,
    tokenizer: &Arc<kvroute_tokenizer::Tokenizer>,
    shutdown: &CancellationToken,
    tasks: &mut tokio::task::JoinSet<anyhow::Result<()>>,
) -> anyhow::Result<Vec<kvroute_gateway::WorkerSpec>> {
    let mut workers = Vec::with_capacity(EMBEDDED_ENGINES);
    for i in 0..EMBEDDED_ENGINES {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot start an embedded engine")?;
        // A free port for the engine's KV-event socket.
        let events_port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let events = format!("tcp://127.0.0.1:{events_port}");
        let args = kvroute_sim::SimArgs {
            seed: i as u64,
            kv_events_endpoint: Some(events.clone()),
            timing: kvroute_sim::TimingArgs::from_family(timing),
            ..kvroute_sim::SimArgs::default()
        };
        workers.push(kvroute_gateway::WorkerSpec {
            kv_events: Some(events),
            ..kvroute_gateway::WorkerSpec::url(format!("http://{}", listener.local_addr()?))
        });
        let engine = kvroute_sim::SimServer::new(args, tokenizer.clone());
        tasks.spawn(engine.serve(listener, shutdown.clone()));
    }
    Ok(workers)
}

/// The tokenizer the engines use (`--tokenizer`), else the fallback.
fn load_tokenizer(settings: &Settings) -> anyhow::Result<Arc<kvroute_tokenizer::Tokenizer>> {
    Ok(match &settings.tokenizer {
        Some(path) => {
            let t = kvroute_tokenizer::Tokenizer::load(path)
                .with_context(|| format!("cannot load the tokenizer {}", path.display()))?;
            tracing::info!(path = %path.display(), "Tokenizer loaded: requests are tokenised as the engines do");
            Arc::new(t)
        }
        None => {
            tracing::info!("No --tokenizer: using the fallback tokenizer (bytes as tokens), as kvroute-sim does; KV overlap with real engines needs their tokenizer");
            Arc::new(kvroute_tokenizer::Tokenizer::fallback())
        }
    })
}

/// Every socket the router serves on, bound before it starts (a port in use stops the start).
struct Listeners {
    api: tokio::net::TcpListener,
    metrics: tokio::net::TcpListener,
    /// `--health-check-port`.
    probes: Option<std::net::TcpListener>,
    /// The endpoint picker's ext_proc and gRPC health ports (`--epp`).
    epp: Option<kvroute_gateway::epp::serve::EppListeners>,
}

impl Listeners {
    async fn bind(settings: &Settings) -> anyhow::Result<Self> {
        let bind = |port: u16, what: &'static str| {
            let addr = format!("{}:{port}", settings.host);
            async move {
                tokio::net::TcpListener::bind(&addr)
                    .await
                    .with_context(|| format!("cannot serve {what} on {addr}"))
            }
        };
        let metrics_addr = format!("{}:{}", settings.prometheus_host, settings.prometheus_port);
        let metrics = tokio::net::TcpListener::bind(&metrics_addr)
            .await
            .with_context(|| format!("cannot serve metrics on {metrics_addr}"))?;
        let epp = match &settings.epp {
            Some(epp) => Some(kvroute_gateway::epp::serve::EppListeners {
                grpc: bind(epp.grpc_port, "ext_proc").await?,
                health: bind(epp.grpc_health_port, "gRPC health").await?,
            }),
            None => None,
        };
        let probes = match settings.health_check_port {
            Some(port) => {
                let addr = format!("{}:{port}", settings.host);
                let listener = std::net::TcpListener::bind(&addr)
                    .with_context(|| format!("cannot serve health checks on {addr}"))?;
                Some(listener)
            }
            None => None,
        };
        let api_addr = format!("{}:{}", settings.host, settings.port);
        let api = tokio::net::TcpListener::bind(&api_addr)
            .await
            .with_context(|| format!("cannot listen on {api_addr}"))?;
        Ok(Self {
            api,
            metrics,
            probes,
            epp,
        })
    }
}

async fn run(mut settings: Settings) -> anyhow::Result<()> {
    let tokenizer = load_tokenizer(&settings)?;
    let shutdown = CancellationToken::new();
    // Embedded engines stop after the router drained its in-flight requests.
    let engines_stop = CancellationToken::new();
    let mut engines = tokio::task::JoinSet::new();
    // Any discovery source turns the embedded engines off, even before it finds a worker.
    // The endpoint picker never makes up engines: the gateway's model servers are its own.
    if settings.workers.is_empty() && !settings.discovers() && settings.epp.is_none() {
        let workers = start_embedded_engines(
            settings.timing_model,
            &tokenizer,
            &engines_stop,
            &mut engines,
        )
        .await?;
        tracing::info!(
            engines = EMBEDDED_ENGINES,
            timing_model = %settings.timing_model,
            urls = ?workers.iter().map(|w| w.url.as_str()).collect::<Vec<_>>(),
            "No worker given: serving from embedded simulated engines (kvroute-sim, model kvroute-sim, KV events on)"
        );
        settings.workers = workers;
    }
    let api_addr = format!("{}:{}", settings.host, settings.port);
    let metrics_addr = format!("{}:{}", settings.prometheus_host, settings.prometheus_port);
    let listeners = Listeners::bind(&settings).await?;
    let mut registry = prometheus_client::registry::Registry::default();
    let workers = settings.workers.len();
    if settings.overload.is_on() {
        let o = settings.overload;
        tracing::info!(
            waiting_requests = ?o.waiting_requests,
            token_usage = ?o.token_usage,
            shed = o.shed,
            "Worker overload protection on"
        );
    }
    let scheme = if settings.tls.api.is_some() {
        "https"
    } else {
        "http"
    };
    let gateway = Gateway::with_tokenizer(settings, &mut registry, tokenizer);
    let probes = match listeners.probes {
        Some(listener) => {
            tracing::info!(addr = %listener.local_addr()?, "Health checks served on their own port");
            Some(gateway.serve_probes(listener)?)
        }
        None => None,
    };
    if let Some(epp) = listeners.epp {
        gateway
            .serve_epp(epp)
            .context("cannot serve as the endpoint picker")?;
    }
    tracing::info!("policy: {}", gateway.policy_description());
    tracing::info!(addr = %api_addr, scheme, metrics = %metrics_addr, workers, "kvroute listening");

    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("Shutting down");
        on_signal.cancel();
    });
    let served = gateway
        .serve(
            listeners.api,
            listeners.metrics,
            Arc::new(registry),
            shutdown.clone(),
        )
        .await
        .context("server failed");
    shutdown.cancel();
    if let Some(probes) = probes {
        // The gateway's shutdown stopped it.
        let _ = tokio::task::spawn_blocking(move || probes.join()).await;
    }
    engines_stop.cancel();
    while let Some(engine) = engines.join_next().await {
        if let Ok(Err(e)) = engine {
            tracing::warn!(error = format!("{e:#}"), "Embedded engine failed");
        }
    }
    served
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
