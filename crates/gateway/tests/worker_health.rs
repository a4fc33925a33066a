//! smg's health flags end to end: `--remove-unhealthy-workers`,
//! `--worker-startup-timeout-secs` and `--health-check-port`.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::*;

fn ids(router: &TestRouter) -> Vec<String> {
    let mut ids: Vec<String> = router
        .gateway
        .workers()
        .statuses()
        .into_iter()
        .map(|w| w.id)
        .collect();
    ids.sort();
    ids
}

/// Whether the router counts the worker `id` healthy (`None`: it has no such worker).
fn healthy(router: &TestRouter, id: &str) -> Option<bool> {
    let statuses = router.gateway.workers().statuses();
    statuses.iter().find(|w| w.id == id).map(|w| w.healthy)
}

fn checked_often(mut s: kvroute_gateway::Settings) -> kvroute_gateway::Settings {
    s.health.interval = Duration::from_millis(20);
    s.health.failure_threshold = 2;
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_worker_is_removed_only_when_asked() {
    let [a, b] = mocks(["a", "b"]).await;
    let mut s = checked_often(settings(&[&a, &b]));
    // Static workers: kept by default (smg removes by default only under discovery).
    assert!(!s.health.remove_unhealthy);
    let kept = TestRouter::start(s.clone()).await;
    s.health.remove_unhealthy = true;
    let removing = TestRouter::start(s).await;
    a.healthy.store(false, std::sync::atomic::Ordering::SeqCst);
    wait_until("a removed", || ids(&removing) == [b.url.clone()]).await;
    // The other router still has a, unhealthy, and routes around it.
    wait_until("a unhealthy", || healthy(&kept, &a.url) == Some(false)).await;
    assert_eq!(ids(&kept).len(), 2);
    for r in [&kept, &removing] {
        let reply = post(
            &r.url,
            "/v1/completions",
            &[],
            r#"{"model":"m","prompt":"x"}"#,
        )
        .await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.worker(), b.url);
    }
    // Healthy again: the keeping router takes it back; the other forgot it.
    a.healthy.store(true, std::sync::atomic::Ordering::SeqCst);
    wait_until("a healthy again", || healthy(&kept, &a.url) == Some(true)).await;
    assert_eq!(ids(&removing), vec![b.url.clone()]);
    kept.stop().await;
    removing.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_starts_is_removed_after_the_startup_timeout() {
    let [a] = mocks(["a"]).await;
    let dead = closed_url().await;
    let mut s = settings(&[&a]);
    s.workers
        .push(kvroute_gateway::WorkerSpec::url(dead.clone()));
    s.health.startup_timeout = Some(Duration::from_millis(300));
    let router = TestRouter::start_unready(s).await;
    assert_eq!(ids(&router).len(), 2);
    wait_until("the dead worker removed", || {
        ids(&router) == [a.url.clone()]
    })
    .await;
    // The live one, which answered its first probe, stays past the timeout and serves.
    let reply = post(
        &router.url,
        "/v1/completions",
        &[],
        r#"{"model":"m","prompt":"x"}"#,
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.worker(), a.url);
    assert_eq!(ids(&router), vec![a.url.clone()]);
    router.stop().await;
}

#[tokio::test]
async fn the_health_check_port_serves_the_probes_and_nothing_else() {
    let port = free_port();
    let (_child, url, _) = kvroute_process(&["--health-check-port", &port.to_string()]).await;
    let probes = format!("http://127.0.0.1:{port}");
    for path in ["/health", "/liveness", "/readiness"] {
        let (status, _, body) = get_url(&format!("{probes}{path}")).await;
        assert_eq!(status, StatusCode::OK, "{path}: {body:?}");
    }
    let (_, _, body) = get_url(&format!("{probes}/readiness")).await;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["status"], "ready");
    assert_eq!(v["healthy_workers"], 4, "the embedded engines: {v}");
    let (status, _, _) = get_url(&format!("{probes}/v1/models")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // The main port has /liveness too.
    let (status, _, _) = get_url(&format!("{url}/liveness")).await;
    assert_eq!(status, StatusCode::OK);
}

/// Health checks and metrics scrapes are spread over their interval (each worker at a phase
/// of its own), but a new worker is probed and scraped at once: readiness and the load the
/// policies read do not wait for the interval, however long it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_worker_is_probed_and_scraped_at_once_however_long_the_interval() {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let url = serve_sim(&["--speedup", "100"], &shutdown).await;
    let mut s = sim_settings(&[url], kvroute_core::PolicyKind::KvAware);
    s.health.interval = Duration::from_secs(3600);
    s.metrics_refresh = Duration::from_secs(3600);
    // Ready within `start`'s bound, not an hour: the first probe came at once.
    let router = TestRouter::start(s).await;
    assert_eq!(healthy(&router, "sim0"), Some(true));
    wait_until_async("the engine's first scrape", || async {
        debug_route(&router, "hello").await["candidates"][0]["engine"]["running"] == 0.0
    })
    .await;
    router.stop().await;
    shutdown.cancel();
}
