//! Reliability and security against real HTTP workers: retries, the circuit breaker,
//! health checks, workers added and removed at run time, the concurrency limit, client and
//! worker keys, admin access. Every test ends with nothing in flight.

mod support;

use std::sync::atomic::Ordering;

use axum::body::Body;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use kvroute_gateway::Settings;
use support::*;

/// Settings for these workers (whose answers and health the tests set), each named by its
/// name and serving `m`, with round robin and quick retries.
fn named_settings(workers: &[&MockWorker]) -> Settings {
    let specs = workers
        .iter()
        .map(|w| named_spec(&w.name, "m", w.url.clone()))
        .collect();
    let mut s = Settings::with_workers(specs).unwrap();
    s.policy = kvroute_core::PolicyKind::RoundRobin;
    s.retry.initial_backoff = std::time::Duration::from_millis(1);
    s
}

/// [`named_settings`] for `w` with the client key `client-key`.
fn client_keyed(w: &MockWorker) -> Settings {
    let mut s = named_settings(&[w]);
    s.client_api_key = kvroute_gateway::auth::Secret::new("client-key".into());
    s
}

const BODY: &str = r#"{"model":"m","prompt":"hello"}"#;

/// Sends `n` completions through `router`: each must be answered, by the worker named `name`.
async fn assert_served_by(router: &TestRouter, n: usize, name: &str) {
    for _ in 0..n {
        let r = router.complete(&[], BODY).await;
        assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
        assert_eq!(r.json()["worker"], name);
    }
}

#[tokio::test]
async fn a_failed_attempt_is_retried_on_another_worker() {
    let [bad, good] = mocks(["bad", "good"]).await;
    bad.status.store(503, Ordering::SeqCst);
    let router = TestRouter::start(named_settings(&[&bad, &good])).await;
    assert_served_by(&router, 6, "good").await;
    assert!(
        bad.requests() >= 1,
        "round robin sent some to the bad worker"
    );
    let m = router.metrics().await;
    let retries = metric_value(&m, "kvroute_request_retries_total", "").unwrap();
    assert_eq!(retries as usize, bad.requests());
    assert_metric(
        &m,
        "kvroute_upstream_attempts_total",
        "worker=\"bad\",outcome=\"server_error\"",
        Some(bad.requests() as f64),
    );
    router.stop_idle().await;
}

#[tokio::test]
async fn a_dropped_connection_is_retried_and_a_4xx_is_not() {
    let broken = broken_worker("m").await;
    let good = MockWorker::start("good", &["m"]).await;
    let mut settings = named_settings(&[&good]);
    settings.workers.push(named_spec("broken", "m", broken));
    let router = TestRouter::start(settings).await;
    assert_served_by(&router, 4, "good").await;
    // A client error is the answer: not retried.
    good.status.store(400, Ordering::SeqCst);
    let before = good.requests();
    let r = router
        .complete(&[("x-kvroute-allowed-workers", "good,broken")], BODY)
        .await;
    // Whichever worker came first (the broken one is retried), the 400 is the answer, sent
    // once: retrying it would end on the broken worker with a 502.
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.headers["x-kvroute-worker"], "good");
    assert_eq!(good.requests(), before + 1);
    router.stop_idle().await;
}

#[tokio::test]
async fn hard_session_affinity_pins_bound_sessions_only() {
    let [bad, good] = mocks(["bad", "good"]).await;
    let mut settings = named_settings(&[&bad, &good]);
    settings.session_affinity = Some((
        kvroute_core::affinity::AffinityMode::Hard,
        std::time::Duration::from_secs(600),
    ));
    let router = TestRouter::start(settings).await;
    // Bind a session to the bad worker while it still answers.
    let mut session = None;
    for i in 0..8 {
        let key = format!("s{i}");
        let r = router.complete(&[("x-session-id", &key)], BODY).await;
        if r.json()["worker"] == "bad" {
            session = Some(key);
            break;
        }
    }
    let session = session.expect("round robin binds some session to the bad worker");
    bad.status.store(503, Ordering::SeqCst);
    // Requests without a session are retried elsewhere, as without affinity.
    assert_served_by(&router, 4, "good").await;
    // The bound session is pinned: the bad worker's answer, not a move.
    let before = good.requests();
    let r = router.complete(&[("x-session-id", &session)], BODY).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(good.requests(), before);
    router.stop_idle().await;
}

#[tokio::test]
async fn a_pinned_request_is_never_moved_and_retries_give_up() {
    let [a, b] = mocks(["a", "b"]).await;
    a.status.store(503, Ordering::SeqCst);
    let mut settings = named_settings(&[&a, &b]);
    settings.retry.max_retries = 1;
    let router = TestRouter::start(settings).await;
    // Pinned to the failing worker: its answer, once, nowhere else.
    let r = router.complete(&[("x-kvroute-worker", "a")], BODY).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.worker(), "a");
    assert_eq!((a.requests(), b.requests()), (1, 0));
    // Both failing, one retry allowed: two attempts, then the last answer.
    b.status.store(502, Ordering::SeqCst);
    let r = router.complete(&[], BODY).await;
    assert!(r.status.is_server_error(), "{}", r.status);
    assert_eq!(a.requests() + b.requests(), 3);
    router.stop_idle().await;
}

#[tokio::test]
async fn the_circuit_opens_on_failures_and_closes_after_a_probe() {
    let [a, b] = mocks(["a", "b"]).await;
    a.status.store(500, Ordering::SeqCst);
    let mut settings = named_settings(&[&a, &b]);
    settings.retry.max_retries = 0;
    settings.circuit = Some(kvroute_gateway::config::CircuitSettings {
        failure_threshold: 3,
        success_threshold: 1,
        timeout: std::time::Duration::from_secs(1),
    });
    let router = TestRouter::start(settings).await;
    while a.requests() < 3 {
        router.complete(&[], BODY).await;
    }
    let m = router.metrics().await;
    assert_metric(
        &m,
        "kvroute_worker_circuit_state",
        "worker=\"a\"",
        Some(1.0),
    );
    // Open: everything goes to b (until the timeout lets a probe through).
    assert_eq!(router.circuit("a"), "open");
    let r = router.complete(&[], BODY).await;
    assert_eq!(r.json()["worker"], "b");
    // a recovers; after the timeout one probe goes to it and closes the circuit.
    a.status.store(0, Ordering::SeqCst);
    wait_until_async("the probe to reach the recovered worker", || async {
        let r = router.complete(&[], BODY).await;
        assert_eq!(r.status, StatusCode::OK);
        r.json()["worker"] == "a"
    })
    .await;
    assert_eq!(router.circuit("a"), "closed");
    router.stop_idle().await;
}

#[tokio::test]
async fn an_unhealthy_worker_leaves_and_returns() {
    let [a, b] = mocks(["a", "b"]).await;
    let mut settings = named_settings(&[&a, &b]);
    settings.health.interval = std::time::Duration::from_millis(50);
    settings.health.failure_threshold = 2;
    settings.health.success_threshold = 2;
    let router = TestRouter::start(settings).await;
    a.healthy.store(false, Ordering::SeqCst);
    wait_until("a unhealthy", || !router.is_healthy("a")).await;
    let before = a.requests();
    assert_served_by(&router, 6, "b").await;
    assert_eq!(a.requests(), before);
    let m = router.metrics().await;
    assert_metric(&m, "kvroute_worker_healthy", "worker=\"a\"", Some(0.0));
    a.healthy.store(true, Ordering::SeqCst);
    wait_until("a healthy again", || router.is_healthy("a")).await;
    let mut workers = std::collections::HashSet::new();
    for _ in 0..4 {
        let r = router.complete(&[], BODY).await;
        workers.insert(r.json()["worker"].as_str().unwrap().to_owned());
    }
    assert!(workers.contains("a"), "{workers:?}");
    router.stop().await;
}

#[tokio::test]
async fn beyond_the_concurrency_limit_with_no_queue_requests_get_429() {
    let w = MockWorker::start("w", &["m"]).await;
    let mut settings = settings(&[&w]);
    settings.admission = Some(kvroute_gateway::config::AdmissionSettings {
        limit: Some(1),
        queue_size: 0,
        queue_timeout: std::time::Duration::from_secs(60),
        rate: None,
    });
    let router = TestRouter::start(settings).await;
    let stream = open_stream(
        &router.url,
        "/v1/completions",
        r#"{"model":"m","prompt":"x","stream":true,"max_tokens":1}"#,
    )
    .await;
    assert_eq!(stream.status(), StatusCode::OK);
    let r = router.complete(&[], BODY).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.error_code(), "too_many_requests");
    assert!(r.headers.contains_key("retry-after"));
    // The stream finishes; its place is free again.
    w.release.add_permits(1);
    let body = stream.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("[DONE]"));
    wait_idle(&router, &w.url).await;
    let r = router.complete(&[], BODY).await;
    assert_eq!(r.status, StatusCode::OK);
    router.stop_idle().await;
}

#[tokio::test]
async fn the_client_key_guards_inference_and_the_worker_key_replaces_it() {
    let w = MockWorker::start("w", &["m"]).await;
    let router = TestRouter::start(client_keyed(&w)).await;
    for headers in [vec![], vec![("authorization", "Bearer nope")]] {
        let r = router.complete(&headers, BODY).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
        assert_eq!(r.error_code(), "unauthorized");
        assert!(!String::from_utf8_lossy(&r.body).contains("client-key"));
    }
    let (status, _, _) = router.get("/v1/models").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = router.get("/health").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(w.requests(), 0);
    let r = router
        .complete(&[("authorization", "Bearer client-key")], BODY)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    // The client's key is not the workers' business.
    assert_eq!(
        r.json()["headers"]["authorization"],
        serde_json::Value::Null
    );
    router.stop().await;

    let mut settings = client_keyed(&w);
    settings.api_key = kvroute_gateway::auth::Secret::new("worker-key".into());
    let router = TestRouter::start(settings).await;
    let r = router
        .complete(&[("authorization", "Bearer client-key")], BODY)
        .await;
    assert_eq!(r.json()["headers"]["authorization"], "Bearer worker-key");
    let m = router.metrics().await;
    assert!(!m.contains("worker-key") && !m.contains("client-key"));
    router.stop().await;
}

/// Drives the app directly with a chosen peer address.
async fn admin_call(
    gateway: &kvroute_gateway::Gateway,
    method: Method,
    path: &str,
    peer: &str,
    key: Option<&str>,
    body: &str,
) -> StatusCode {
    let mut req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let mut req = req.body(Body::from(body.to_owned())).unwrap();
    req.extensions_mut()
        .insert(axum::extract::ConnectInfo::<std::net::SocketAddr>(
            peer.parse().unwrap(),
        ));
    let mut app = gateway.app();
    tower_service::Service::call(&mut app, req)
        .await
        .unwrap()
        .status()
}

/// One admin call: method, path, peer, key, body, and the status it must get.
type AdminCall<'a> = (
    &'a Method,
    &'a str,
    &'a str,
    Option<&'a str>,
    &'a str,
    StatusCode,
);

/// Makes each call in turn, asserting its status.
async fn assert_admin<const N: usize>(
    gateway: &kvroute_gateway::Gateway,
    calls: [AdminCall<'_>; N],
) {
    for (method, path, peer, key, body, want) in calls {
        let got = admin_call(gateway, method.clone(), path, peer, key, body).await;
        assert_eq!(got, want, "{method} {path} from {peer} with key {key:?}");
    }
}

#[tokio::test]
async fn admin_changes_need_loopback_or_the_admin_key() {
    let [w, extra] = mocks(["w", "extra"]).await;
    let router = TestRouter::start(named_settings(&[&w])).await;
    let gw = &router.gateway;
    let add = serde_json::json!({"id": "extra", "url": extra.url, "model": "m"}).to_string();
    let far = "10.1.2.3:5000";
    let near = "127.0.0.1:5000";
    let (post, get, delete) = (Method::POST, Method::GET, Method::DELETE);
    let (refused, ok, created) = (
        StatusCode::UNAUTHORIZED,
        StatusCode::OK,
        StatusCode::CREATED,
    );
    assert_admin(
        gw,
        [
            (&post, "/workers", far, None, &*add, refused),
            (&delete, "/workers/w", far, None, "", refused),
            (&get, "/workers", far, None, "", ok),
            (&post, "/workers", near, None, &add, created),
            (&post, "/workers", near, None, &add, StatusCode::CONFLICT),
        ],
    )
    .await;
    router.stop().await;

    let mut settings = named_settings(&[&w]);
    settings.admin_api_key = kvroute_gateway::auth::Secret::new("adm".into());
    let router = TestRouter::start(settings).await;
    let gw = &router.gateway;
    for key in [None, Some("wrong")] {
        for peer in [near, far] {
            assert_admin(
                gw,
                [
                    (&post, "/workers", peer, key, &*add, refused),
                    (&get, "/workers", peer, key, "", refused),
                ],
            )
            .await;
        }
    }
    let adm = Some("adm");
    assert_admin(
        gw,
        [
            (&post, "/workers", far, adm, &*add, created),
            (&delete, "/workers/extra", far, adm, "", ok),
        ],
    )
    .await;
    router.stop().await;
}

#[tokio::test]
async fn workers_come_and_go_at_run_time_without_losing_requests() {
    let [a, b] = mocks(["a", "b"]).await;
    let router = TestRouter::start(settings(&[&a])).await;
    let add = serde_json::json!({"id": "b", "url": b.url}).to_string();
    let r = router.post("/workers", &[], &add).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    router.wait_healthy("b").await;
    let gw = router.gateway.clone();
    // A stream on b, open while b is removed.
    let mut stream = None;
    for _ in 0..4 {
        let s = open_stream(
            &router.url,
            "/v1/completions",
            r#"{"model":"m","prompt":"x","stream":true,"max_tokens":2}"#,
        )
        .await;
        if s.headers()["x-kvroute-worker"] == "b" {
            stream = Some(s);
            break;
        }
        a.release.add_permits(1);
        s.into_body().collect().await.unwrap();
    }
    let stream = stream.expect("round robin reaches b");
    let r = send(&router.url, Method::DELETE, "/workers/b", &[], "").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["draining"], 1);
    // No new request goes to b; the open stream completes.
    for _ in 0..4 {
        let r = router.complete(&[], BODY).await;
        assert_eq!(r.worker(), a.url);
    }
    b.release.add_permits(1);
    let body = stream.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("[DONE]"));
    assert!(gw.workers().statuses().iter().all(|w| w.id != "b"));
    let m = router.metrics().await;
    assert!(
        !m.contains("worker=\"b\""),
        "series of a removed worker stay"
    );
    let r = send(&router.url, Method::DELETE, "/workers/b", &[], "").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.error_code(), "worker_not_found");
    let r = router.post("/workers", &[], r#"{"url":"ftp://x"}"#).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    router.stop_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_limit_requests_wait_in_a_bounded_queue_and_time_out() {
    let w = MockWorker::start("w", &["m"]).await;
    let argv = [
        "kvroute",
        "--worker-urls",
        &w.url,
        "--max-concurrent-requests",
        "1",
        "--queue-size",
        "1",
        "--queue-timeout-secs",
        "2",
    ];
    let settings = <kvroute_gateway::Args as clap::Parser>::parse_from(argv)
        .load()
        .unwrap();
    let router = TestRouter::start(settings).await;
    let waiting = || async {
        let m = router.metrics().await;
        metric_value(&m, "kvroute_admission_waiting", "")
    };
    let stream_body = r#"{"model":"m","prompt":"x","stream":true,"max_tokens":1}"#;
    // The stream holds the one place; the next request waits for it.
    let stream = open_stream(&router.url, "/v1/completions", stream_body).await;
    assert_eq!(stream.status(), StatusCode::OK);
    let url = router.url.clone();
    let queued = tokio::spawn(async move { post(&url, "/v1/completions", &[], BODY).await });
    wait_until_async("one request waiting", || async {
        waiting().await == Some(1.0)
    })
    .await;
    // The queue (of 1) is full: one more is refused at once.
    let r = router.complete(&[], BODY).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.error_code(), "too_many_requests");
    // The stream ends: the waiting request goes through.
    w.release.add_permits(1);
    let body = stream.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("[DONE]"));
    let r = queued.await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(waiting().await, Some(0.0));

    // Held again, a wait past --queue-timeout-secs is a 503 of its own.
    let stream = open_stream(&router.url, "/v1/completions", stream_body).await;
    let r = router.complete(&[], BODY).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.error_code(), "admission_timeout");
    w.release.add_permits(1);
    drop(stream.into_body().collect().await);
    router.stop_idle().await;
}
