//! Routing hints, eligibility, busy thresholds and their error classes, over HTTP.

mod support;

use std::time::Duration;

use kvroute_core::affinity::AffinityMode;
use kvroute_core::PolicyKind;
use kvroute_gateway::{Settings, WorkerSpec};
use serde_json::json;
use support::*;

async fn router(a: &MockWorker, b: &MockWorker, tweak: impl FnOnce(&mut Settings)) -> TestRouter {
    let mut s = Settings::with_workers(vec![
        WorkerSpec {
            id: Some("a".into()),
            ..WorkerSpec::url(a.url.clone())
        },
        WorkerSpec {
            id: Some("b".into()),
            taints: vec!["gpu".into(), "zone-a".into()],
            dp_size: Some(2),
            ..WorkerSpec::url(b.url.clone())
        },
    ])
    .unwrap();
    s.policy = PolicyKind::KvAware;
    tweak(&mut s);
    TestRouter::start(s).await
}

/// [`router`] with session affinity in `mode`, a busy threshold of 100 prefill tokens, and
/// time for held requests.
async fn affine_router(a: &MockWorker, b: &MockWorker, mode: AffinityMode) -> TestRouter {
    router(a, b, |s| {
        s.session_affinity = Some((mode, Duration::from_secs(600)));
        s.busy.active_prefill_tokens = Some(100);
        s.request_timeout = Duration::from_secs(60);
    })
    .await
}

fn body(prompt: &str) -> String {
    json!({"model": "m", "prompt": prompt, "max_tokens": 1}).to_string()
}

#[tokio::test]
async fn hints_filter_in_order_and_bad_ones_are_400() {
    let [a, b] = mocks(["a", "b"]).await;
    let r = router(&a, &b, |_| {}).await;
    let allowed = [("x-kvroute-allowed-workers", "a")];
    r.assert_routed(&allowed, bodies("", 6), "a").await;
    let reply = r.complete(&pin("b", "1"), &body("x")).await;
    assert_eq!(reply.placed(), ("b".to_owned(), Some("1".to_owned())));
    // The rank reaches the engine as vLLM's header.
    assert_eq!(reply.json()["headers"]["x-data-parallel-rank"], "1");
    for (headers, code) in [
        (vec![("x-kvroute-worker", "zz")], "invalid_pin"),
        (
            vec![("x-kvroute-worker", "a"), ("x-kvroute-dp-rank", "0")],
            "invalid_pin",
        ),
        (
            vec![("x-kvroute-worker", "b"), ("x-kvroute-dp-rank", "5")],
            "invalid_pin",
        ),
        (
            vec![
                ("x-kvroute-worker", "a"),
                ("x-kvroute-allowed-workers", "b"),
            ],
            "invalid_pin",
        ),
        (vec![("x-kvroute-dp-rank", "one")], "invalid_hint"),
        (vec![("x-kvroute-allowed-workers", "a,,b")], "invalid_hint"),
        (
            vec![("x-kvroute-preferred-taints", "gpu=-1")],
            "invalid_hint",
        ),
    ] {
        let reply = r.complete(&headers, &body("x")).await;
        assert_eq!(reply.status, 400, "{headers:?}");
        assert_eq!(reply.error_code(), code, "{headers:?}");
    }
    let reply = r
        .complete(&[("x-kvroute-dp-rank", "one")], &body("x"))
        .await;
    assert!(reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("x-kvroute-dp-rank"));
    // Required taints: only b has gpu; nobody has tpu.
    let gpu = [("x-kvroute-required-taints", "gpu")];
    r.assert_routed(&gpu, bodies("t", 6), "b").await;
    let tpu = [("x-kvroute-required-taints", "gpu,tpu")];
    r.complete(&tpu, &body("x"))
        .await
        .assert_error(503, "no_endpoint");
    // Preferred taints multiply kv_aware's cost by exp(-tanh(w)): b wins every tie.
    let zone_a = [("x-kvroute-preferred-taints", "zone-a=2,other")];
    r.assert_routed(&zone_a, bodies("p", 6), "b").await;
    r.stop().await;
}

/// `n` completion bodies with prompts `{prefix}0`, `{prefix}1`, ...
fn bodies(prefix: &str, n: usize) -> impl Iterator<Item = String> + '_ {
    (0..n).map(move |i| body(&format!("{prefix}{i}")))
}

/// The hints that pin a request to `worker`'s `rank`.
fn pin<'a>(worker: &'a str, rank: &'a str) -> [(&'static str, &'a str); 2] {
    [("x-kvroute-worker", worker), ("x-kvroute-dp-rank", rank)]
}

/// A request that never answers (its prompt of `filler`s is 500 tokens or more, past the
/// busy threshold of 100).
fn held_body(filler: &str) -> String {
    hanging(&format!("{} hang", filler.repeat(500)))
}

/// Holds a request on `worker` (the mock never answers a prompt containing "hang").
async fn hold(r: &TestRouter, worker: &str) -> tokio::task::JoinHandle<Reply> {
    hold_rank(r, worker, None).await
}

/// Holds a request on `worker`'s `rank` (any rank when `None`).
async fn hold_rank(
    r: &TestRouter,
    worker: &str,
    rank: Option<String>,
) -> tokio::task::JoinHandle<Reply> {
    let mut headers = vec![("x-kvroute-worker", worker)];
    if let Some(rank) = &rank {
        headers.push(("x-kvroute-dp-rank", rank.as_str()));
    }
    r.spawn_complete(&headers, held_body("x"))
}

#[tokio::test]
async fn busy_thresholds_filter_and_name_the_overload() {
    let [a, b] = mocks(["a", "b"]).await;
    let r = router(&a, &b, |s| {
        s.busy.active_prefill_tokens = Some(100);
        s.request_timeout = Duration::from_secs(60);
    })
    .await;
    let held_a = hold(&r, "a").await;
    r.wait_in_flight("a", |n| n == 1).await;
    r.assert_routed(&[], bodies("", 6), "b").await;
    let reply = r.complete(&[("x-kvroute-worker", "a")], &body("x")).await;
    reply.assert_error(503, "pinned_worker_overloaded");
    // b's two ranks: a worker is overloaded only when all its ranks are.
    let held_b0 = r.spawn_complete(&pin("b", "0"), held_body("y"));
    r.wait_in_flight("b", |n| n == 1).await;
    let reply = r.complete(&[], &body("z")).await;
    assert_eq!(reply.placed(), ("b".to_owned(), Some("1".to_owned())));
    let held_b1 = hold(&r, "b").await;
    r.wait_in_flight("b", |n| n == 2).await;
    let reply = r.complete(&[], &body("w")).await;
    reply.assert_error(503, "all_workers_overloaded");
    assert_eq!(reply.headers["retry-after"], "1");
    for h in [held_a, held_b0, held_b1] {
        h.abort();
    }
    r.stop().await;
}

/// `POST /busy_threshold` with `update`.
async fn set_threshold(r: &TestRouter, update: serde_json::Value) -> Reply {
    r.post("/busy_threshold", &[], &update.to_string()).await
}

#[tokio::test]
async fn post_busy_threshold_changes_routing_at_once() {
    let [a, b] = mocks(["a", "b"]).await;
    let r = router(&a, &b, |s| s.request_timeout = Duration::from_secs(60)).await;
    let held = hold(&r, "a").await;
    r.wait_in_flight("a", |n| n == 1).await;
    let (_, _, got) = r.get("/busy_threshold").await;
    let got: serde_json::Value = serde_json::from_slice(&got).unwrap();
    assert_eq!(got["thresholds"][0]["model"], "m");
    assert!(got["thresholds"][0]["active_prefill_tokens_threshold"].is_null());
    let set = set_threshold(
        &r,
        json!({"model": "m", "active_prefill_tokens_threshold": 100}),
    )
    .await;
    assert_eq!(set.status, 200, "{:?}", set.body);
    assert_eq!(set.json()["active_prefill_tokens_threshold"], 100);
    r.assert_routed(&[], bodies("", 8), "b").await;
    let bad = set_threshold(
        &r,
        json!({"model": "m", "active_decode_blocks_threshold": 1.5}),
    )
    .await;
    assert_eq!(bad.status, 400);
    let unknown = set_threshold(
        &r,
        json!({"model": "nope", "active_prefill_tokens_threshold": 1}),
    )
    .await;
    assert_eq!(unknown.status, 404);
    // Omitted fields are a read: the threshold stays.
    let read = set_threshold(&r, json!({"model": "m"})).await;
    assert_eq!(read.json()["active_prefill_tokens_threshold"], 100);
    held.abort();
    r.stop().await;
}

#[tokio::test]
async fn admin_changes_need_the_admin_key_when_one_is_set() {
    let [a, b] = mocks(["a", "b"]).await;
    let r = router(&a, &b, |s| {
        s.admin_api_key = kvroute_gateway::auth::Secret::new("s3cret".into())
    })
    .await;
    let update = json!({"model": "m", "active_prefill_tokens_threshold": 5}).to_string();
    let denied = r.post("/busy_threshold", &[], &update).await;
    denied.assert_error(401, "unauthorized");
    for (key, status) in [("Bearer nope", 401), ("Bearer s3cret", 200)] {
        let reply = r
            .post("/busy_threshold", &[("authorization", key)], &update)
            .await;
        assert_eq!(reply.status, status, "{key}");
    }
    r.stop().await;
}

#[tokio::test]
async fn soft_affinity_keeps_a_session_unless_its_worker_is_overloaded() {
    let [a, b] = mocks(["a", "b"]).await;
    let r = affine_router(&a, &b, AffinityMode::Soft).await;
    let session = [("x-session-id", "alice")];
    let (home, rank) = r.complete(&session, &body("first")).await.placed();
    for i in 0..10 {
        let reply = r.complete(&session, &body(&format!("unrelated {i}"))).await;
        assert_eq!(
            reply.placed(),
            (home.clone(), rank.clone()),
            "the session stays"
        );
    }
    // Its rank is overloaded: soft affinity lets the policy choose another, and rebinds.
    let held = hold_rank(&r, &home, rank.clone()).await;
    r.wait_in_flight(&home, |n| n >= 1).await;
    let moved = r.complete(&session, &body("while busy")).await.placed();
    assert_ne!(moved, (home.clone(), rank.clone()));
    held.abort();
    r.wait_none_in_flight().await;
    let after = r.complete(&session, &body("after")).await.placed();
    assert_eq!(after, moved, "rebound");
    r.stop().await;
}

#[tokio::test]
async fn hard_affinity_is_a_pin() {
    let [a, b] = mocks(["a", "b"]).await;
    let r = affine_router(&a, &b, AffinityMode::Hard).await;
    let session = [("x-session-id", "bob")];
    let (home, rank) = r.complete(&session, &body("first")).await.placed();
    let held = hold_rank(&r, &home, rank.clone()).await;
    r.wait_in_flight(&home, |n| n == 1).await;
    let reply = r.complete(&session, &body("while busy")).await;
    reply.assert_error(503, "pinned_worker_overloaded");
    // Other sessions are unaffected: they go to the ranks that are not busy.
    let other = r.complete(&[("x-session-id", "carol")], &body("x")).await;
    assert_eq!(other.status, 200);
    assert_ne!(other.placed(), (home.clone(), rank.clone()));
    held.abort();
    r.stop().await;
}
