//! `--health-check-port`: `/health`, `/liveness` and `/readiness` on a listener of their
//! own, served by a thread with its own single-threaded runtime, so that a main runtime
//! saturated by traffic cannot starve the orchestrator's probes (smg's design). The main
//! port keeps serving the same routes.

use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use tokio_util::sync::CancellationToken;

use super::{health, readiness};
use crate::context::AppState;

/// The probe routes over the router's state.
fn probe_app(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/liveness", get(health))
        .route("/readiness", get(readiness))
        .with_state(state)
}

/// Serves the probe routes on `listener` from a thread of their own until `shutdown`.
pub(super) fn spawn(
    state: Arc<AppState>,
    listener: std::net::TcpListener,
    shutdown: CancellationToken,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("kvroute-probes".to_owned())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(error) => {
                        tracing::error!(%error, "Cannot serve the health-check port");
                        return;
                    }
                };
                let serve = axum::serve(listener, probe_app(state))
                    .with_graceful_shutdown(async move { shutdown.cancelled().await });
                if let Err(error) = serve.await {
                    tracing::error!(%error, "The health-check port failed");
                }
            })
        })
}
