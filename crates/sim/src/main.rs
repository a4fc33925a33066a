//! `kvroute-sim`: a simulated vLLM replica.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use kvroute_sim::{Crashed, Fleet, SimArgs, SimServer};
use kvroute_tokenizer::Tokenizer;
use tokio_util::sync::CancellationToken;

/// The exit code after an injected crash (`--crash-after-requests`).
const CRASH_EXIT_CODE: u8 = 3;

fn main() -> ExitCode {
    let args = SimArgs::parse();
    if let Err(e) = args.validate() {
        eprintln!("kvroute-sim: {e}");
        return ExitCode::from(2);
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!("kvroute_sim={},warn", args.log_level))
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A closed stderr must not bring the server down (eprintln! would panic).
        .log_internal_errors(false)
        .init();
    let tokenizer = match &args.tokenizer {
        Some(path) => match Tokenizer::load(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("kvroute-sim: {e}");
                return ExitCode::from(2);
            }
        },
        None => Tokenizer::fallback(),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-sim: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args, Arc::new(tokenizer))) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<Crashed>() => {
            eprintln!("kvroute-sim: {e}");
            ExitCode::from(CRASH_EXIT_CODE)
        }
        Err(e) => {
            eprintln!("kvroute-sim: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: SimArgs, tokenizer: Arc<Tokenizer>) -> anyhow::Result<()> {
    if args.engines > 1 {
        return run_fleet(args, tokenizer).await;
    }
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    tracing::info!(
        %addr,
        model = %args.model,
        role = args.role.as_str(),
        ranks = args.data_parallel_size,
        num_gpu_blocks = args.num_gpu_blocks,
        block_size = args.block_size,
        speedup = args.speedup,
        "kvroute-sim listening"
    );
    let shutdown = CancellationToken::new();
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        on_signal.cancel();
    });
    SimServer::new(args, tokenizer)
        .serve(listener, shutdown)
        .await
}

/// `--engines N`: every engine on this runtime, until a signal or the first engine to end.
async fn run_fleet(args: SimArgs, tokenizer: Arc<Tokenizer>) -> anyhow::Result<()> {
    let fleet = Fleet::start(&args, tokenizer).await?;
    let urls = fleet.urls();
    tracing::info!(
        engines = urls.len(),
        first = %urls[0],
        last = %urls[urls.len() - 1],
        kv_events_endpoint = ?args.kv_events_endpoint,
        speedup = args.speedup,
        "kvroute-sim engines listening"
    );
    let shutdown = CancellationToken::new();
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        on_signal.cancel();
    });
    fleet.serve(shutdown).await
}
