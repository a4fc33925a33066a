//! smg's load-driven routing end to end: worker overload protection and the `least_load`
//! policy, over engines whose `/metrics` say how loaded they are (mock engines serving
//! vLLM's gauge names), scraped by the router as in production.
//!
//! No sleeps: each test waits (with a deadline) until `/debug/route` shows the router has
//! read the engines' new numbers, then checks where real requests go.

mod support;

use kvroute_core::overload::OverloadProtection;
use kvroute_core::PolicyKind;

use support::*;

const BODY: &str = r#"{"model":"m","prompt":"hello"}"#;

/// An engine's `/metrics` with these numbers (vLLM's names, one engine).
fn engine(waiting: u32, kv_usage: f64) -> String {
    format!(
        "# TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} 0\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {kv_usage}\n"
    )
}

fn set(worker: &MockWorker, text: String) {
    *worker.metrics.lock().unwrap() = text;
}

/// The dry-run decision: its status, chosen worker and candidates.
async fn decision(router: &TestRouter) -> (u16, String, Vec<Seen>) {
    let r = post(&router.url, "/debug/route", &[], BODY).await;
    if r.status != 200 {
        return (r.status.as_u16(), r.error_code(), Vec::new());
    }
    let v = r.json();
    let candidates = v["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Seen {
            worker: c["worker"].as_str().unwrap().to_owned(),
            waiting: c["engine"]["waiting"].as_f64(),
            kv_usage: c["engine"]["kv_usage"].as_f64(),
        })
        .collect();
    (200, v["worker"].as_str().unwrap().to_owned(), candidates)
}

/// A candidate of the dry-run decision, with the engine numbers the router read for it.
#[derive(Debug, PartialEq)]
struct Seen {
    worker: String,
    waiting: Option<f64>,
    kv_usage: Option<f64>,
}

/// A candidate `worker` whose engine was read as `waiting` requests and `kv_usage`.
fn seen(worker: &MockWorker, waiting: u32, kv_usage: f64) -> Seen {
    Seen {
        worker: worker.url.clone(),
        waiting: Some(waiting.into()),
        kv_usage: Some(kv_usage),
    }
}

async fn wait_candidates(router: &TestRouter, want: &[Seen]) {
    wait_until_async("the router to read the engines' load", || async {
        decision(router).await.2 == want
    })
    .await;
}

/// Where `n` requests went, each routed while the dry-run decision showed exactly the
/// candidates `want`, with the engine numbers of each, before and after it, and not retried.
/// The numbers matter: when every worker is overloaded the decision keeps one (the least
/// loaded, ties at random), so a candidate list alone can match by chance while an engine's
/// new numbers are still unread. On a starved machine an engine's gauges can go stale (after
/// 2 s without a scrape) and read as unknown, which makes an overloaded engine a candidate
/// again until the next scrape; and a request whose worker failed before its first byte (a
/// pooled connection the mock closed) is retried on the others, the overloaded included when
/// no other is left. Such a request says nothing of the protection, so it is not counted and
/// the test waits for fresh gauges again.
async fn routed_among(router: &TestRouter, want: &[Seen], n: usize) -> Vec<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let retries = || async { metric_sum(&router.metrics().await, RETRIES, "") };
    let mut seen = Vec::new();
    while seen.len() < n {
        assert!(std::time::Instant::now() < deadline, "gauges never held");
        wait_candidates(router, want).await;
        let before = retries().await;
        let r = post(&router.url, "/v1/completions", &[], BODY).await;
        assert_eq!(r.status, 200, "{:?}", r.body);
        if decision(router).await.2 == want && retries().await == before {
            seen.push(r.worker().to_owned());
        }
    }
    seen
}

const RETRIES: &str = "kvroute_request_retries_total";

async fn routed_to(router: &TestRouter, n: usize) -> Vec<String> {
    let mut seen = Vec::new();
    for _ in 0..n {
        let r = post(&router.url, "/v1/completions", &[], BODY).await;
        assert_eq!(r.status, 200, "{:?}", r.body);
        seen.push(r.worker().to_owned());
    }
    seen
}

const SMG: OverloadProtection = OverloadProtection {
    waiting_requests: Some(8),
    token_usage: Some(0.8),
    shed: false,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overloaded_workers_are_passed_over_by_waiting_requests_and_kv_usage() {
    let [a, b] = mocks(["a", "b"]).await;
    set(&a, engine(9, 0.1));
    set(&b, engine(0, 0.1));
    let mut s = settings(&[&a, &b]);
    s.overload = SMG;
    let router = TestRouter::start(s).await;
    // 9 waiting >= 8: round robin would alternate, protection sends all to b.
    let only_b = routed_among(&router, &[seen(&b, 0, 0.1)], 6).await;
    assert!(only_b.iter().all(|w| *w == b.url), "{only_b:?}");
    // Now b's cache is 85% full (>= 0.8) and a has drained.
    set(&a, engine(0, 0.1));
    set(&b, engine(0, 0.85));
    let only_a = routed_among(&router, &[seen(&a, 0, 0.1)], 6).await;
    assert!(only_a.iter().all(|w| *w == a.url), "{only_a:?}");
    // Both under: round robin over both again.
    set(&b, engine(7, 0.79));
    let both = routed_among(&router, &[seen(&a, 0, 0.1), seen(&b, 7, 0.79)], 6).await;
    assert!(both.contains(&a.url) && both.contains(&b.url), "{both:?}");
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_overloaded_goes_to_the_least_loaded_or_is_shed() {
    let [a, b] = mocks(["a", "b"]).await;
    set(&a, engine(20, 0.5));
    set(&b, engine(0, 0.95));
    let mut s = settings(&[&a, &b]);
    s.overload = SMG;
    let router = TestRouter::start(s).await;
    // One stream held open on a: b has fewer requests in flight through the router.
    let stream = open_stream_with(
        &router.url,
        "/v1/completions",
        &[("x-kvroute-worker", &a.url)],
        r#"{"model":"m","prompt":"held","stream":true,"max_tokens":2}"#,
    )
    .await;
    assert_eq!(stream.status(), 200);
    let only_b = routed_among(&router, &[seen(&b, 0, 0.95)], 4).await;
    assert!(only_b.iter().all(|w| *w == b.url), "{only_b:?}");
    a.release.add_permits(1);
    drop(stream);
    router.stop().await;
    let reached = a.requests() + b.requests();

    let mut s = settings(&[&a, &b]);
    s.overload = OverloadProtection { shed: true, ..SMG };
    let router = TestRouter::start(s).await;
    wait_until_async("a shed decision", || async {
        decision(&router).await.0 == 503
    })
    .await;
    let r = post(&router.url, "/v1/completions", &[], BODY).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.error_code(), "worker_overload_protection_shed");
    assert!(r.headers.contains_key("retry-after"));
    // Nothing reached an engine.
    assert_eq!(a.requests() + b.requests(), reached);
    // One recovers: it takes the traffic.
    set(&a, engine(1, 0.5));
    let only_a = routed_among(&router, &[seen(&a, 1, 0.5)], 3).await;
    assert!(only_a.iter().all(|w| *w == a.url), "{only_a:?}");
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_load_sends_to_the_shortest_expected_wait() {
    let [a, b] = mocks(["a", "b"]).await;
    // a: 6 waiting x 1024 tokens / 2000 tok/s = 3.07 s; b: 1 waiting = 0.51 s plus
    // 0.15 x 0.9 / 0.1 = 1.35 s of KV pressure.
    set(&a, engine(6, 0.1));
    set(&b, engine(1, 0.9));
    let mut s = settings(&[&a, &b]);
    s.policy = PolicyKind::LeastLoad;
    let router = TestRouter::start(s).await;
    wait_until_async("b chosen", || async { decision(&router).await.1 == b.url }).await;
    let r = post(&router.url, "/debug/route", &[], BODY).await.json();
    assert_eq!(r["policy"], "least_load");
    let costs: Vec<f64> = r["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["cost"].as_f64().unwrap())
        .collect();
    assert!(
        (costs[0] - 6.0 * 1024.0 / 2000.0 - 0.15 * 0.1 / 0.9).abs() < 1e-9,
        "{r}"
    );
    assert!(routed_to(&router, 4).await.iter().all(|w| *w == b.url));
    // b's cache at 99%: 14.85 s of pressure; a is now the shorter wait.
    set(&b, engine(1, 0.99));
    wait_until_async("a chosen", || async { decision(&router).await.1 == a.url }).await;
    assert!(routed_to(&router, 4).await.iter().all(|w| *w == a.url));
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_sends_everything_to_the_first_worker() {
    let [a, b] = mocks(["a", "b"]).await;
    let mut s = settings(&[&a, &b]);
    s.policy = PolicyKind::Passthrough;
    let router = TestRouter::start(s).await;
    let first = routed_to(&router, 1).await.remove(0);
    assert!(routed_to(&router, 8).await.iter().all(|w| *w == first));
    router.stop().await;
}
