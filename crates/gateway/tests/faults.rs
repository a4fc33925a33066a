//! Faults against kvroute-sim replicas: an engine killed mid-stream, one that refuses
//! connections, one that stalls, one restarted, and a KV-event stream cut with a gap. Each
//! test checks that every accepted request completed or got a clear error, and that nothing
//! is left in flight.

mod support;

use std::time::Duration;

use http_body_util::BodyExt;
use kvroute_core::PolicyKind;
use kvroute_gateway::{Settings, WorkerSpec};
use kvroute_sim::{FaultSettings, SimArgs, SimInstance};
use serde_json::json;
use support::*;

/// A kvroute-sim replica publishing KV events, and their endpoint.
async fn sim(seed: u64) -> (SimInstance, String) {
    sim_with_events(|events| SimArgs {
        seed,
        kv_events_endpoint: Some(events.to_owned()),
        ..SimArgs::default()
    })
    .await
}

fn spec(id: &str, sim: &SimInstance, events: &str) -> WorkerSpec {
    WorkerSpec {
        id: Some(id.to_owned()),
        kv_events: Some(events.to_owned()),
        ..WorkerSpec::url(sim.url())
    }
}

async fn cluster(
    policy: PolicyKind,
    tweak: impl FnOnce(&mut Settings),
) -> (SimInstance, SimInstance, TestRouter) {
    let (a, ea) = sim(1).await;
    let (b, eb) = sim(2).await;
    let mut s = Settings::with_workers(vec![spec("a", &a, &ea), spec("b", &b, &eb)]).unwrap();
    s.policy = policy;
    s.retry.initial_backoff = Duration::from_millis(1);
    tweak(&mut s);
    let r = TestRouter::start(s).await;
    (a, b, r)
}

fn completion(prompt: &str) -> String {
    json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 2}).to_string()
}

/// Asserts that nothing is left in flight (the router's counts and the active-request
/// gauges), then stops the router.
async fn stop_with_nothing_in_flight(r: TestRouter) {
    wait_all_idle(&r).await;
    let m = r.metrics().await;
    for w in ["a", "b"] {
        let active = metric_value(
            &m,
            "kvroute_worker_requests_active",
            &format!("worker=\"{w}\""),
        );
        assert!(matches!(active, Some(0.0) | None), "{w}: {active:?}");
    }
    r.stop().await;
}

/// Whether the router credits a worker with some blocks of a prompt.
fn credited(overlap: Option<u64>) -> bool {
    overlap.is_some_and(|o| o > 0)
}

/// Sends `prompt` to `worker` through the router (allow-list hint) and expects success.
async fn on(r: &TestRouter, worker: &str, prompt: &str) {
    let reply = r
        .complete(
            &[("x-kvroute-allowed-workers", worker)],
            &completion(prompt),
        )
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(reply.worker(), worker);
}

/// Sends `n` fresh prompts through the router: each must be answered, by `worker` when given.
async fn answered(r: &TestRouter, n: u64, worker: Option<&str>) {
    for i in 0..n {
        let reply = r.complete(&[], &completion(&text(50, i))).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        if let Some(worker) = worker {
            assert_eq!(reply.worker(), worker);
        }
    }
}

/// Changes the faults `sim` injects.
fn set_faults(sim: &SimInstance, change: impl FnOnce(&mut FaultSettings)) {
    let faults = sim.faults();
    let mut settings = faults.settings();
    change(&mut settings);
    faults.set(settings).unwrap();
}

/// Sends `prompt` to `worker` through the router and waits until the router credits `worker`
/// with its blocks.
async fn cached_on(r: &TestRouter, worker: &str, prompt: &str) {
    on(r, worker, prompt).await;
    wait_overlap(r, prompt, worker, credited).await;
}

#[tokio::test]
async fn without_migration_an_engine_killed_mid_stream_ends_the_stream_with_an_error_event() {
    // --migration-limit 0: the behaviour before migration (tests/migration.rs has it on).
    let (a, b, r) = cluster(PolicyKind::KvAware, |s| s.migration.limit = 0).await;
    let body = json!({"model": "kvroute-sim", "prompt": text(200, 1), "max_tokens": 100000, "stream": true})
        .to_string();
    let resp = open_stream(&r.url, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let on_a = resp.headers()["x-kvroute-worker"] == "a";
    let (victim, other) = if on_a { (&a, &b) } else { (&b, &a) };
    let other_before = other.faults().requests_accepted();
    let mut body = resp.into_body();
    let mut seen = String::new();
    // At least one token, then the engine dies.
    while !seen.contains("\"text\"") {
        let frame = body.frame().await.expect("a frame").expect("no error yet");
        if let Ok(data) = frame.into_data() {
            seen.push_str(&String::from_utf8_lossy(&data));
        }
    }
    victim.crash();
    let rest = body
        .collect()
        .await
        .expect("the stream ends cleanly")
        .to_bytes();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("\"code\":\"upstream_error\""), "{rest}");
    assert!(!rest.contains("[DONE]"), "{rest}");
    // The broken stream was not replayed elsewhere.
    assert_eq!(other.faults().requests_accepted(), other_before);
    // Later requests find the live engine.
    answered(&r, 6, None).await;
    stop_with_nothing_in_flight(r).await;
}

#[tokio::test]
async fn an_engine_that_refuses_connections_loses_no_request() {
    let (a, _b, r) = cluster(PolicyKind::RoundRobin, |_| {}).await;
    a.crash();
    answered(&r, 8, Some("b")).await;
    let m = r.metrics().await;
    let refused = metric_value(
        &m,
        "kvroute_upstream_attempts_total",
        "worker=\"a\",outcome=\"connect_error\"",
    )
    .unwrap();
    assert!(refused >= 1.0, "round robin tried a");
    assert_metric(&m, "kvroute_request_retries_total", "", Some(refused));
    stop_with_nothing_in_flight(r).await;
}

#[tokio::test]
async fn an_engine_that_stalls_times_out_and_the_request_goes_elsewhere() {
    let (a, _b, r) = cluster(PolicyKind::RoundRobin, |s| {
        s.request_timeout = Duration::from_millis(300);
    })
    .await;
    set_faults(&a, |f| f.stall_ms = 60_000);
    answered(&r, 4, Some("b")).await;
    let m = r.metrics().await;
    let timeouts = r#"worker="a",outcome="timeout""#;
    assert_metric_at_least(&m, "kvroute_upstream_attempts_total", timeouts, 1.0);
    // Pinned to the stalled engine: a clear timeout, not a hang.
    let reply = r
        .complete(&[("x-kvroute-worker", "a")], &completion("pinned"))
        .await;
    assert_eq!(reply.status, 504);
    assert_eq!(reply.error_code(), "upstream_timeout");
    stop_with_nothing_in_flight(r).await;
}

#[tokio::test]
async fn a_restarted_engine_resumes_its_events_without_stale_credit() {
    let (a, _b, r) = cluster(PolicyKind::KvAware, |s| {
        s.health.interval = Duration::from_millis(100);
        s.health.failure_threshold = 1;
        s.health.success_threshold = 1;
    })
    .await;
    joined(&r, &a.url(), "a").await;
    let before = text(400, 42);
    cached_on(&r, "a", &before).await;
    // Restarted with an empty cache: the router must not credit it with what it lost (while
    // it restarts it may also not be a candidate at all).
    let a = a.restart().await.unwrap();
    wait_overlap(&r, &before, "a", |o| o.unwrap_or(0) == 0).await;
    // Its new events reach the index again.
    joined(&r, &a.url(), "a").await;
    let after = text(400, 43);
    cached_on(&r, "a", &after).await;
    assert_eq!(overlap(&r, &before, "a").await, Some(0));
    stop_with_nothing_in_flight(r).await;
}

#[tokio::test]
async fn a_gap_in_the_kv_event_stream_is_detected_and_recovered() {
    let (a, _b, r) = cluster(PolicyKind::KvAware, |_| {}).await;
    joined(&r, &a.url(), "a").await;
    let first = text(400, 7);
    cached_on(&r, "a", &first).await;
    set_faults(&a, |f| f.drop_kv_events = true);
    let unseen = text(400, 8);
    on(&r, "a", &unseen).await;
    set_faults(&a, |f| f.drop_kv_events = false);
    let last = text(400, 9);
    on(&r, "a", &last).await;
    // The gap is noticed: what the router knew of a is dropped (it cannot know what it
    // missed), and the events after the gap are applied.
    let gap = r#"worker="a",event="batch",status="gap""#;
    wait_until_async("a gap in a's KV events counted", || async {
        metric_sum(&r.metrics().await, "kvroute_kv_events_total", gap) > 0.0
    })
    .await;
    wait_overlap(&r, &last, "a", credited).await;
    assert_eq!(overlap(&r, &first, "a").await, Some(0));
    assert_eq!(overlap(&r, &unseen, "a").await, Some(0));
    stop_with_nothing_in_flight(r).await;
}

#[tokio::test]
async fn a_worker_added_at_run_time_is_indexed_and_forgotten_when_removed() {
    let (_a, _b, r) = cluster(PolicyKind::KvAware, |_| {}).await;
    let (c, ec) = sim(3).await;
    let add = json!({"id": "c", "url": c.url(), "kv_events": ec}).to_string();
    let reply = r.post("/workers", &[], &add).await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    r.wait_healthy("c").await;
    // Its events reach the index.
    joined(&r, &c.url(), "c").await;
    let prompt = text(800, 77);
    cached_on(&r, "c", &prompt).await;
    let blocks = |m: &str| metric_value(m, "kvroute_kv_index_blocks", "").unwrap();
    let before = blocks(&r.metrics().await);
    let reply = send(&r.url, http::Method::DELETE, "/workers/c", &[], "").await;
    assert_eq!(reply.status, 200);
    // Gone from the candidates, and its blocks from the index.
    let d = debug_route(&r, &prompt).await;
    assert_eq!(device_overlap(&d, "c"), None, "{d}");
    let after = blocks(&r.metrics().await);
    assert!(after + 50.0 <= before, "index blocks {before} -> {after}");
    stop_with_nothing_in_flight(r).await;
}
