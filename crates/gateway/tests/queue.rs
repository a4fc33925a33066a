//! Queue backpressure over HTTP: held, drained, full, timed out.

mod support;

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::queue::{PolicyClass, QueueOrder};
use kvroute_core::PolicyKind;
use kvroute_gateway::config::QueueSettings;
use kvroute_gateway::{Settings, WorkerSpec};
use kvroute_tokenizer::Tokenizer;
use serde_json::json;
use support::*;
use tokio_util::sync::CancellationToken;

fn queue(threshold: f64, classes: Vec<PolicyClass>, timeout: Duration) -> Option<QueueSettings> {
    Some(QueueSettings {
        threshold,
        order: QueueOrder::Fcfs,
        timeout,
        class_thresholds: vec![Default::default(); classes.len()],
        classes,
    })
}

fn class(name: &str, weight: u64, max_queued: Option<usize>) -> PolicyClass {
    PolicyClass {
        name: name.into(),
        weight,
        max_queued,
    }
}

#[tokio::test]
async fn a_burst_is_held_and_drained_with_nothing_dropped() {
    let shutdown = CancellationToken::new();
    let mut workers = Vec::new();
    for i in 0..2 {
        let args =
            <kvroute_sim::SimArgs as clap::Parser>::parse_from(["kvroute-sim", "--speedup", "2"]);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        workers.push(WorkerSpec {
            id: Some(format!("w{i}")),
            max_num_batched_tokens: Some(512),
            ..WorkerSpec::url(format!("http://{}", listener.local_addr().unwrap()))
        });
        let server = kvroute_sim::SimServer::new(args, Arc::new(Tokenizer::fallback()));
        tokio::spawn(server.serve(listener, shutdown.clone()));
    }
    let mut s = Settings::with_workers(workers).unwrap();
    s.policy = PolicyKind::KvAware;
    s.queue = queue(
        1.0,
        vec![class("default", 1, None)],
        Duration::from_secs(120),
    );
    let r = TestRouter::start(s).await;
    // 16 requests of 2,000 uncached tokens: each saturates a rank (2000 > 1.0 x 512) until
    // its first token, so at most one per rank is let through at a time.
    let mut tasks = Vec::new();
    for i in 0..16 {
        let url = r.url.clone();
        tasks.push(tokio::spawn(async move {
            let body =
                json!({"model": "kvroute-sim", "prompt": text(2000, 500 + i), "max_tokens": 2})
                    .to_string();
            post(&url, "/v1/completions", &[], &body).await
        }));
    }
    let mut max_pending = 0.0f64;
    let mut done = 0;
    for t in tasks {
        let m = r.metrics().await;
        max_pending = max_pending
            .max(metric_value(&m, "kvroute_queue_pending", r#"class="default""#).unwrap_or(0.0));
        let reply = t.await.unwrap();
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        done += 1;
    }
    assert_eq!(done, 16);
    let m = r.metrics().await;
    assert!(
        max_pending > 0.0
            || metric_value(&m, "kvroute_queue_wait_seconds_count", "").unwrap() > 0.0,
        "the burst was queued"
    );
    assert!(
        metric_value(&m, "kvroute_queue_wait_seconds_count", "").unwrap() >= 8.0,
        "{m}"
    );
    assert_eq!(
        metric_value(&m, "kvroute_queue_pending", r#"class="default""#),
        Some(0.0)
    );
    // Scored once each, when leaving the queue.
    assert_eq!(
        metric_value(&m, "kvroute_routing_seconds_count", ""),
        Some(16.0),
        "{m}"
    );
    r.stop().await;
    shutdown.cancel();
}

#[tokio::test]
async fn a_full_class_and_a_long_wait_are_errors() {
    let w = MockWorker::start("w", &["m"]).await;
    let mut s = settings(&[&w]);
    s.policy = PolicyKind::KvAware;
    s.request_timeout = Duration::from_secs(60);
    s.queue = queue(
        0.01,
        vec![class("default", 1, None), class("small", 1, Some(1))],
        Duration::from_secs(1),
    );
    let r = TestRouter::start(s).await;
    // A request that never answers saturates the only rank (500 tokens > 0.01 x 8192).
    let url = r.url.clone();
    let held = tokio::spawn(async move {
        post(
            &url,
            "/v1/completions",
            &[],
            &json!({"model": "m", "prompt": "x".repeat(500), "mode": "hang"}).to_string(),
        )
        .await
    });
    let gw = r.gateway.clone();
    wait_until("saturated", || gw.workers().statuses()[0].in_flight == 1).await;
    // One waits in "small" (and times out after 1 s); the next finds it full.
    let url = r.url.clone();
    let waiting = tokio::spawn(async move {
        post(
            &url,
            "/v1/completions",
            &[("x-kvroute-class", "small")],
            &json!({"model": "m", "prompt": "a"}).to_string(),
        )
        .await
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let m = r.metrics().await;
        if metric_value(&m, "kvroute_queue_pending", r#"class="small""#) == Some(1.0) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let full = post(
        &r.url,
        "/v1/completions",
        &[("x-kvroute-class", "small")],
        &json!({"model": "m", "prompt": "b"}).to_string(),
    )
    .await;
    assert_eq!(
        (full.status.as_u16(), full.error_code().as_str()),
        (429, "queue_full")
    );
    let unknown = post(
        &r.url,
        "/v1/completions",
        &[("x-kvroute-class", "vip")],
        &json!({"model": "m", "prompt": "b"}).to_string(),
    )
    .await;
    assert_eq!(
        (unknown.status.as_u16(), unknown.error_code().as_str()),
        (400, "invalid_hint")
    );
    let timed_out = waiting.await.unwrap();
    assert_eq!(
        (timed_out.status.as_u16(), timed_out.error_code().as_str()),
        (503, "queue_timeout")
    );
    let m = r.metrics().await;
    assert_eq!(
        metric_value(&m, "kvroute_queue_pending", r#"class="small""#),
        Some(0.0)
    );
    held.abort();
    r.stop().await;
}

#[tokio::test]
async fn a_class_may_have_its_own_busy_thresholds() {
    let file = "router_queue_threshold: 100\npolicy_classes:\n  - {name: default, weight: 1}\n  - {name: strict, weight: 1, active_prefill_tokens_threshold: 100}\n";
    let parsed = kvroute_gateway::Args::from_text(file).unwrap();
    let w = MockWorker::start("w", &["m"]).await;
    let mut s = kvroute_gateway::Args {
        worker_urls: vec![w.url.clone()],
        ..parsed
    }
    .into_settings()
    .unwrap();
    s.request_timeout = Duration::from_secs(60);
    assert_eq!(
        s.queue.as_ref().unwrap().class_thresholds[1].active_prefill_tokens,
        Some(100)
    );
    let r = TestRouter::start(s).await;
    let url = r.url.clone();
    let held = tokio::spawn(async move {
        post(
            &url,
            "/v1/completions",
            &[],
            &json!({"model": "m", "prompt": "x".repeat(500), "mode": "hang"}).to_string(),
        )
        .await
    });
    let gw = r.gateway.clone();
    wait_until("busy", || gw.workers().statuses()[0].in_flight == 1).await;
    let strict = post(
        &r.url,
        "/v1/completions",
        &[("x-kvroute-class", "strict")],
        &json!({"model": "m", "prompt": "a"}).to_string(),
    )
    .await;
    assert_eq!(
        (strict.status.as_u16(), strict.error_code().as_str()),
        (503, "all_workers_overloaded")
    );
    let default = post(
        &r.url,
        "/v1/completions",
        &[],
        &json!({"model": "m", "prompt": "a"}).to_string(),
    )
    .await;
    assert_eq!(default.status, 200);
    held.abort();
    r.stop().await;
}

#[tokio::test]
async fn a_client_that_leaves_leaves_the_queue() {
    let w = MockWorker::start("w", &["m"]).await;
    let mut s = settings(&[&w]);
    s.policy = PolicyKind::KvAware;
    s.request_timeout = Duration::from_secs(120);
    s.queue = queue(
        0.01,
        vec![class("default", 1, None)],
        Duration::from_secs(120),
    );
    let r = TestRouter::start(s).await;
    let url = r.url.clone();
    let held = tokio::spawn(async move {
        post(
            &url,
            "/v1/completions",
            &[],
            &json!({"model": "m", "prompt": "x".repeat(500), "mode": "hang"}).to_string(),
        )
        .await
    });
    let gw = r.gateway.clone();
    wait_until("saturated", || gw.workers().statuses()[0].in_flight == 1).await;
    let url = r.url.clone();
    let waiting = tokio::spawn(async move {
        post(
            &url,
            "/v1/completions",
            &[],
            &json!({"model": "m", "prompt": "a"}).to_string(),
        )
        .await
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while metric_value(
        &r.metrics().await,
        "kvroute_queue_pending",
        r#"class="default""#,
    ) != Some(1.0)
    {
        assert!(tokio::time::Instant::now() < deadline, "never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The client gives up: its connection closes, and the router drops the request.
    waiting.abort();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while metric_value(
        &r.metrics().await,
        "kvroute_queue_pending",
        r#"class="default""#,
    ) != Some(0.0)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the abandoned request stayed queued"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        w.requests.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "it never reached the worker"
    );
    held.abort();
    r.stop().await;
}
