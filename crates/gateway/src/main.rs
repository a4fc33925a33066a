//! `kvroute`: the router binary.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use kvroute_gateway::{Args, Gateway, Settings};
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let args = Args::parse();
    let settings = match args.load() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvroute: {e}");
            return ExitCode::from(2);
        }
    };
    init_tracing(&settings);
    if settings.workers.is_empty() {
        eprintln!(
            "kvroute: no workers: give --worker-urls URL [URL ...] or a --config file with a workers: list"
        );
        return ExitCode::from(2);
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
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

async fn run(settings: Settings) -> anyhow::Result<()> {
    let api_addr = format!("{}:{}", settings.host, settings.port);
    let metrics_addr = format!("{}:{}", settings.prometheus_host, settings.prometheus_port);
    let listener = tokio::net::TcpListener::bind(&api_addr)
        .await
        .with_context(|| format!("cannot listen on {api_addr}"))?;
    let metrics_listener = tokio::net::TcpListener::bind(&metrics_addr)
        .await
        .with_context(|| format!("cannot serve metrics on {metrics_addr}"))?;
    let mut registry = prometheus_client::registry::Registry::default();
    let workers = settings.workers.len();
    let gateway = Gateway::new(settings, &mut registry);
    tracing::info!("policy: {}", gateway.policy_description());
    tracing::info!(addr = %api_addr, metrics = %metrics_addr, workers, "kvroute listening");

    let shutdown = CancellationToken::new();
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("Shutting down");
        on_signal.cancel();
    });
    gateway
        .serve(listener, metrics_listener, Arc::new(registry), shutdown)
        .await
        .context("server failed")
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
