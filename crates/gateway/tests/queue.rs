//! Queue backpressure over HTTP: held, drained one at a time, full, timed out.

mod support;

use std::time::Duration;

use kvroute_core::queue::{PolicyClass, QueueOrder};
use kvroute_core::PolicyKind;
use kvroute_gateway::config::QueueSettings;
use kvroute_gateway::{Settings, WorkerSpec};
use serde_json::json;
use support::*;
use tokio_util::sync::CancellationToken;

fn queue(threshold: f64, classes: Vec<PolicyClass>, timeout: Duration) -> Option<QueueSettings> {
    Some(QueueSettings {
        threshold,
        order: QueueOrder::Fcfs,
        timeout,
        class_thresholds: vec![Default::default(); classes.len()],
        sharing: Default::default(),
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

/// A kv_aware router over one mock worker, queueing at a threshold of 0.01 (any held request
/// saturates the worker) in `classes`, for `wait` at most; requests time out after `timeout`.
async fn queued(
    classes: Vec<PolicyClass>,
    wait: Duration,
    timeout: Duration,
) -> (MockWorker, TestRouter) {
    let w = MockWorker::start("w", &["m"]).await;
    let mut s = settings(&[&w]);
    s.policy = PolicyKind::KvAware;
    s.request_timeout = timeout;
    s.queue = queue(0.01, classes, wait);
    (w, TestRouter::start(s).await)
}

/// A completion of `prompt` for the mock workers.
fn prompt(prompt: &str) -> String {
    json!({"model": "m", "prompt": prompt}).to_string()
}

/// Holds a request that never answers, of 500 tokens: it saturates its rank.
fn hold(r: &TestRouter) -> tokio::task::JoinHandle<Reply> {
    r.spawn_complete(&[], hanging(&"x".repeat(500)))
}

#[tokio::test]
async fn a_burst_is_held_and_drained_with_nothing_dropped() {
    let shutdown = CancellationToken::new();
    let mut workers = Vec::new();
    for i in 0..2 {
        workers.push(WorkerSpec {
            id: Some(format!("w{i}")),
            max_num_batched_tokens: Some(512),
            ..WorkerSpec::url(serve_sim(&["--speedup", "2"], &shutdown).await)
        });
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
        let body = json!({"model": "kvroute-sim", "prompt": text(2000, 500 + i), "max_tokens": 2});
        tasks.push(r.spawn_complete(&[], body.to_string()));
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
    assert_metric_at_least(&m, "kvroute_queue_wait_seconds_count", "", 8.0);
    assert_metric(&m, "kvroute_queue_pending", r#"class="default""#, Some(0.0));
    // Scored once each, when leaving the queue.
    assert_metric(&m, "kvroute_routing_seconds_count", "", Some(16.0));
    r.stop().await;
    shutdown.cancel();
}

#[tokio::test]
async fn a_full_class_and_a_long_wait_are_errors() {
    let classes = vec![class("default", 1, None), class("small", 1, Some(1))];
    let (w, r) = queued(classes, Duration::from_secs(1), Duration::from_secs(60)).await;
    // A request that never answers saturates the only rank (500 tokens > 0.01 x 8192).
    let held = hold(&r);
    r.wait_in_flight(&w.url, |n| n == 1).await;
    // One waits in "small" (and times out after 1 s); the next finds it full.
    let small = [("x-kvroute-class", "small")];
    let waiting = r.spawn_complete(&small, prompt("a"));
    r.wait_metric("kvroute_queue_pending", r#"class="small""#, Some(1.0))
        .await;
    let full = r.complete(&small, &prompt("b")).await;
    full.assert_error(429, "queue_full");
    let unknown = r
        .complete(&[("x-kvroute-class", "vip")], &prompt("b"))
        .await;
    unknown.assert_error(400, "invalid_hint");
    let timed_out = waiting.await.unwrap();
    timed_out.assert_error(503, "queue_timeout");
    let m = r.metrics().await;
    assert_metric(&m, "kvroute_queue_pending", r#"class="small""#, Some(0.0));
    assert_metric(
        &m,
        "kvroute_queue_refused_total",
        r#"reason="full""#,
        Some(1.0),
    );
    assert_metric(
        &m,
        "kvroute_queue_refused_total",
        r#"reason="timeout""#,
        Some(1.0),
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
    let held = hold(&r);
    r.wait_in_flight(&w.url, |n| n == 1).await;
    let strict = r
        .complete(&[("x-kvroute-class", "strict")], &prompt("a"))
        .await;
    strict.assert_error(503, "all_workers_overloaded");
    let default = r.complete(&[], &prompt("a")).await;
    assert_eq!(default.status, 200);
    held.abort();
    r.stop().await;
}

#[tokio::test]
async fn a_client_that_leaves_leaves_the_queue() {
    let classes = vec![class("default", 1, None)];
    let (w, r) = queued(classes, Duration::from_secs(120), Duration::from_secs(120)).await;
    let held = hold(&r);
    r.wait_in_flight(&w.url, |n| n == 1).await;
    let waiting = r.spawn_complete(&[], prompt("a"));
    let (pending, default) = ("kvroute_queue_pending", r#"class="default""#);
    r.wait_metric(pending, default, Some(1.0)).await;
    // The client gives up: its connection closes, and the router drops the request.
    waiting.abort();
    r.wait_metric(pending, default, Some(0.0)).await;
    assert_eq!(w.requests(), 1, "it never reached the worker");
    held.abort();
    r.stop().await;
}

#[tokio::test]
async fn a_rank_that_frees_up_takes_only_what_keeps_it_unsaturated() {
    let [a, b] = mocks(["a", "b"]).await;
    let spec = |w: &MockWorker, id: &str| WorkerSpec {
        id: Some(id.into()),
        max_num_batched_tokens: Some(1000),
        ..w.spec()
    };
    let mut s = Settings::with_workers(vec![spec(&a, "a"), spec(&b, "b")]).unwrap();
    s.policy = PolicyKind::KvAware;
    s.request_timeout = Duration::from_secs(120);
    s.queue = queue(
        1.0,
        vec![class("default", 1, None)],
        Duration::from_secs(120),
    );
    let r = TestRouter::start(s).await;
    // Both saturated: 1,500 prefill tokens each (> 1.0 x 1,000), held until aborted.
    let pin = |id: &'static str| [("x-kvroute-worker", id)];
    let held_a = r.spawn_complete(&pin("a"), hanging(&"a".repeat(1500)));
    let held_b = r.spawn_complete(&pin("b"), hanging(&"b".repeat(1500)));
    r.wait_in_flight("a", |n| n == 1).await;
    r.wait_in_flight("b", |n| n == 1).await;
    // Four requests of 400 tokens wait, in this order.
    let (pending, default) = ("kvroute_queue_pending", r#"class="default""#);
    let mut waiting = Vec::new();
    for (i, c) in ["c", "d", "e", "f"].into_iter().enumerate() {
        waiting.push(r.spawn_complete(&[], hanging(&c.repeat(400))));
        r.wait_metric(pending, default, Some(i as f64 + 1.0)).await;
    }
    // a frees up. Each request let go is routed there and counted before the next is
    // considered: 400 and 800 tokens leave it unsaturated, 1,200 does not. The fourth waits.
    held_a.abort();
    r.wait_in_flight("a", |n| n >= 3).await;
    let m = r.metrics().await;
    assert_metric(&m, pending, default, Some(1.0));
    assert_eq!(in_flight(&r, &a.url), 3);
    wait_until("a to receive its three", || a.requests() == 4).await;
    assert_eq!(b.requests(), 1);
    // One of those on a ends (400 tokens fewer): the fourth goes, and a is full again.
    waiting.remove(0).abort();
    r.wait_metric(pending, default, Some(0.0)).await;
    wait_until("a to receive the fourth", || a.requests() == 5).await;
    assert_eq!(b.requests(), 1);
    held_b.abort();
    for w in waiting {
        w.abort();
    }
    r.stop().await;
}
