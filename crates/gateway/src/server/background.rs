//! The gateway's background work: each worker's tasks, policy upkeep, the config and
//! certificate reload on SIGHUP, and the API's accept loop (plain or TLS).

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::Router;
use kvroute_core::PolicyKind;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::Gateway;
use crate::config::{EppEndpoints, Settings};
use crate::context::AppState;
use crate::discovery;
use crate::engine_metrics::ScrapeTiming;
use crate::error::GatewayError;
use crate::kv::WorkerSink;
use crate::kv_events::KvEventSubscriber;
use crate::metrics::DiscoveryMetrics;
#[cfg(unix)]
use crate::metrics::ReloadLabels;
use crate::workers::{Watched, Worker};

/// Starts a worker's background tasks: health checks, the KV-event subscription (while it
/// is healthy) and the engine-metrics scraper (for the policies that read it).
pub(super) fn start_worker(state: &Arc<AppState>, worker: Arc<Worker>) {
    let watch = state
        .workers
        .clone()
        .watch(worker.clone(), state.client.clone());
    let watching = state.clone();
    let id = worker.id.clone();
    state.tasks.spawn(async move {
        let why = match watch.await {
            Watched::Stopped => return,
            Watched::Unhealthy => "unhealthy",
            Watched::NeverStarted => "never started",
        };
        // Gone already if an admin call or discovery removed it meanwhile.
        if remove_worker(&watching, id.as_str()).is_ok() {
            tracing::warn!(worker = %id, why, "Worker removed");
        }
    });
    if reads_engine_metrics(&state.settings) {
        let timing = ScrapeTiming {
            interval: state.settings.metrics_refresh,
            ..ScrapeTiming::default()
        };
        match worker.metrics_scraper(timing) {
            Ok(scraper) => {
                let scraper = scraper.paced(state.scrape_pace.clone());
                let run = scraper.run(state.client.clone(), worker.tasks.clone());
                state.tasks.spawn(run);
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

/// Removes a worker: no new request goes to it, its in-flight requests finish, its tasks
/// stop and its KV blocks are forgotten.
pub(super) fn remove_worker(state: &AppState, id: &str) -> Result<Arc<Worker>, GatewayError> {
    let worker = state.workers.remove(id)?;
    for rank in &worker.ranks {
        state.kv.clear(rank.replica);
    }
    Ok(worker)
}

/// Subscribes to a worker's KV events while it is healthy; when it turns unhealthy or is
/// removed, the subscription stops and its blocks are forgotten (rebuilt when it returns).
pub(super) async fn follow_kv_events(state: Arc<AppState>, worker: Arc<Worker>) {
    let Some(config) = worker.kv_subscriber_config(state.kv.block_size) else {
        return;
    };
    let mut health = worker.subscribe_health();
    // The worker's tasks token: cancelled when it is removed or the gateway shuts down.
    let stopped = || worker.tasks.is_cancelled();
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
        let token = worker.tasks.child_token();
        let run = tokio::spawn(subscriber.run(token.clone()));
        // Until unhealthy or stopped.
        loop {
            if !*health.borrow_and_update() || stopped() {
                break;
            }
            tokio::select! {
                changed = health.changed() => if changed.is_err() { break },
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

/// Policy upkeep every second; the queue re-examined every 100 ms (thresholds may change
/// at run time).
pub(super) fn spawn_upkeep(state: &AppState) {
    let workers = state.workers.clone();
    let queue = state.queue.clone();
    let stop = state.shutdown.clone();
    state.tasks.spawn(async move {
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

/// Starts the discovery sources in force: the watched file, the Kubernetes watch and the
/// endpoint picker's pool or selector (each once its client is configured; retried every
/// interval until then).
pub(super) fn spawn_discovery(gateway: &Gateway) {
    let state = &gateway.state;
    let discovery = &state.settings.discovery;
    let metrics = state.metrics.discovery.clone();
    if let Some(path) = &discovery.file {
        state.tasks.spawn(discovery::file::run(
            Arc::new(gateway.clone()),
            path.clone(),
            discovery.interval,
            metrics.clone(),
            state.shutdown.clone(),
        ));
    }
    if let Some(settings) = discovery.kubernetes.clone() {
        let (target, interval) = (Arc::new(gateway.clone()), discovery.interval);
        let (metrics, stop) = (metrics.clone(), state.shutdown.clone());
        state.tasks.spawn(async move {
            let kubeconfig = settings.kubeconfig.as_deref();
            let Some(client) = kube_client(kubeconfig, interval, &metrics, &stop).await else {
                return;
            };
            tracing::info!(
                selectors = ?settings.selectors.iter().map(|s| s.query()).collect::<Vec<_>>(),
                namespace = settings.namespace.as_deref().unwrap_or("(all)"),
                port = settings.port,
                "Watching Kubernetes pods for workers"
            );
            discovery::kubernetes::run(target, client, settings, interval, metrics, stop).await
        });
    }
    let endpoints = state
        .settings
        .epp
        .as_ref()
        .map(|e| (e.endpoints.clone(), e.kv_events_port));
    if let Some((endpoints, kv_events_port)) =
        endpoints.filter(|(e, _)| !matches!(e, EppEndpoints::Static))
    {
        let (target, interval) = (Arc::new(gateway.clone()), discovery.interval);
        let stop = state.shutdown.clone();
        state.tasks.spawn(async move {
            let kubeconfig = match &endpoints {
                EppEndpoints::Pool(pool) => pool.kubeconfig.clone(),
                EppEndpoints::Selector { kubeconfig, .. } => kubeconfig.clone(),
                EppEndpoints::Static => None,
            };
            let Some(client) = kube_client(kubeconfig.as_deref(), interval, &metrics, &stop).await
            else {
                return;
            };
            tracing::info!(endpoints = ?endpoints, "Watching Kubernetes for the endpoint picker's endpoints");
            discovery::pool::run(
                target,
                client,
                endpoints,
                kv_events_port,
                interval,
                metrics,
                stop,
            )
            .await
        });
    }
}

/// The Kubernetes client, once it is configured (retried every `interval` until then);
/// `None` on shutdown.
async fn kube_client(
    kubeconfig: Option<&std::path::Path>,
    interval: Duration,
    metrics: &DiscoveryMetrics,
    stop: &CancellationToken,
) -> Option<kube::Client> {
    loop {
        match discovery::kubernetes::client(kubeconfig).await {
            Ok(client) => return Some(client),
            Err(error) => {
                metrics.error("config");
                tracing::error!(%error, "Cannot configure the Kubernetes client; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = stop.cancelled() => return None,
                }
            }
        }
    }
}

/// On every SIGHUP, until the gateway stops: re-reads the config file's workers, and the
/// API's certificate files.
#[cfg(unix)]
pub(super) fn spawn_reload_on_hangup(gateway: Gateway) {
    let state = gateway.state.clone();
    let stop = state.shutdown.clone();
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(mut hup) => {
            state.tasks.spawn(async move {
                loop {
                    tokio::select! {
                        _ = hup.recv() => {
                            let mut result = "ok";
                            if let Err(error) = gateway.reload() {
                                tracing::error!(%error, "Config reload failed; nothing changed");
                                result = "error";
                            }
                            if let Err(error) = gateway.reload_tls() {
                                tracing::error!(%error, "API certificate reload failed; keeping the current one");
                                result = "error";
                            }
                            gateway
                                .state
                                .metrics
                                .reloads
                                .get_or_create(&ReloadLabels { result })
                                .inc();
                        }
                        _ = stop.cancelled() => return,
                    }
                }
            });
        }
        Err(error) => tracing::warn!(%error, "Cannot listen for SIGHUP"),
    }
}

/// The API's accept loop: HTTP/1.1 with a header read timeout, over TLS with `tls`'s
/// configuration as it is when each connection is accepted (a reload changes it for the
/// next ones); a failed handshake ends that connection only. On `shutdown`, stops accepting,
/// closes idle connections, and waits up to `grace` for in-flight requests.
pub(super) async fn serve_api(
    listener: TcpListener,
    app: Router,
    tls: Option<&ArcSwap<rustls::ServerConfig>>,
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
    // Cancelled when the grace period is over: the connections still open are dropped.
    let close = CancellationToken::new();
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
        let acceptor = tls.map(|config| TlsAcceptor::from(config.load_full()));
        let app = app.clone();
        let service =
            hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                let mut app = app.clone();
                async move { tower_service::Service::call(&mut app, req.map(Body::new)).await }
            });
        let http1 = builder.clone();
        let stop = shutdown.clone();
        let close = close.clone();
        connections.spawn(async move {
            let io = match acceptor {
                None => Either::Left(tcp),
                Some(acceptor) => {
                    // The client has as long for its handshake as for its headers.
                    let handshake = tokio::select! {
                        done = tokio::time::timeout(header_read_timeout, acceptor.accept(tcp)) => done,
                        _ = stop.cancelled() => return,
                    };
                    match handshake {
                        Ok(Ok(tls)) => Either::Right(tls),
                        Ok(Err(error)) => {
                            tracing::debug!(%peer, %error, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    }
                }
            };
            let conn = http1.serve_connection(TokioIo::new(io), service);
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
            tokio::select! {
                _ = conn => {}
                _ = close.cancelled() => {}
            }
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
        close.cancel();
        connections.wait().await;
    }
    Ok(())
}

/// Whether a policy in force reads the engines' own load (`llm_d`'s queue and KV usage,
/// `kv_aware`'s saturation term, `least_load`'s expected wait, the decode busy threshold,
/// overload protection).
fn reads_engine_metrics(settings: &Settings) -> bool {
    let reads = |p: PolicyKind| {
        matches!(
            p,
            PolicyKind::LlmD | PolicyKind::KvAware | PolicyKind::LeastLoad
        )
    };
    reads(settings.policy)
        || settings.busy.active_decode_blocks.is_some()
        || settings.overload.is_on()
        || settings
            .pd
            .as_ref()
            .is_some_and(|pd| reads(pd.prefill_policy) || reads(pd.decode_policy))
}
