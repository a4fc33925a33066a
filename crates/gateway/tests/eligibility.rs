//! Routing hints, eligibility, busy thresholds and their error classes, over HTTP.

mod support;

use std::time::Duration;

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

fn body(prompt: &str) -> String {
    json!({"model": "m", "prompt": prompt, "max_tokens": 1}).to_string()
}

#[tokio::test]
async fn hints_filter_in_order_and_bad_ones_are_400() {
    let a = MockWorker::start("a", &["m"]).await;
    let b = MockWorker::start("b", &["m"]).await;
    let r = router(&a, &b, |_| {}).await;
    for i in 0..6 {
        let reply = post(
            &r.url,
            "/v1/completions",
            &[("x-kvroute-allowed-workers", "a")],
            &body(&format!("{i}")),
        )
        .await;
        assert_eq!(reply.worker(), "a");
    }
    let reply = post(
        &r.url,
        "/v1/completions",
        &[("x-kvroute-worker", "b"), ("x-kvroute-dp-rank", "1")],
        &body("x"),
    )
    .await;
    assert_eq!(
        (
            reply.worker(),
            reply.headers["x-kvroute-dp-rank"].to_str().unwrap()
        ),
        ("b", "1")
    );
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
        let reply = post(&r.url, "/v1/completions", &headers, &body("x")).await;
        assert_eq!(reply.status, 400, "{headers:?}");
        assert_eq!(reply.error_code(), code, "{headers:?}");
    }
    let reply = post(
        &r.url,
        "/v1/completions",
        &[("x-kvroute-dp-rank", "one")],
        &body("x"),
    )
    .await;
    assert!(reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("x-kvroute-dp-rank"));
    // Required taints: only b has gpu; nobody has tpu.
    for i in 0..6 {
        let reply = post(
            &r.url,
            "/v1/completions",
            &[("x-kvroute-required-taints", "gpu")],
            &body(&format!("t{i}")),
        )
        .await;
        assert_eq!(reply.worker(), "b");
    }
    let reply = post(
        &r.url,
        "/v1/completions",
        &[("x-kvroute-required-taints", "gpu,tpu")],
        &body("x"),
    )
    .await;
    assert_eq!(
        (reply.status.as_u16(), reply.error_code().as_str()),
        (503, "no_endpoint")
    );
    // Preferred taints multiply kv_aware's cost by exp(-tanh(w)): b wins every tie.
    for i in 0..6 {
        let reply = post(
            &r.url,
            "/v1/completions",
            &[("x-kvroute-preferred-taints", "zone-a=2,other")],
            &body(&format!("p{i}")),
        )
        .await;
        assert_eq!(reply.worker(), "b");
    }
    r.stop().await;
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
    let url = r.url.clone();
    let worker = worker.to_owned();
    tokio::spawn(async move {
        let b =
            json!({"model": "m", "prompt": format!("{} hang", "x".repeat(500)), "mode": "hang"})
                .to_string();
        let mut headers = vec![("x-kvroute-worker", worker.as_str())];
        if let Some(rank) = &rank {
            headers.push(("x-kvroute-dp-rank", rank.as_str()));
        }
        post(&url, "/v1/completions", &headers, &b).await
    })
}

#[tokio::test]
async fn busy_thresholds_filter_and_name_the_overload() {
    let a = MockWorker::start("a", &["m"]).await;
    let b = MockWorker::start("b", &["m"]).await;
    let r = router(&a, &b, |s| {
        s.busy.active_prefill_tokens = Some(100);
        s.request_timeout = Duration::from_secs(60);
    })
    .await;
    let held_a = hold(&r, "a").await;
    let gw = r.gateway.clone();
    wait_until("a busy", || {
        gw.workers()
            .statuses()
            .iter()
            .any(|w| w.id == "a" && w.in_flight == 1)
    })
    .await;
    for i in 0..6 {
        assert_eq!(
            post(&r.url, "/v1/completions", &[], &body(&format!("{i}")))
                .await
                .worker(),
            "b"
        );
    }
    let reply = post(
        &r.url,
        "/v1/completions",
        &[("x-kvroute-worker", "a")],
        &body("x"),
    )
    .await;
    assert_eq!(
        (reply.status.as_u16(), reply.error_code().as_str()),
        (503, "pinned_worker_overloaded")
    );
    // b's two ranks: a worker is overloaded only when all its ranks are.
    let held_b0 = {
        let url = r.url.clone();
        tokio::spawn(async move {
            let b = json!({"model": "m", "prompt": format!("{} hang", "y".repeat(500)), "mode": "hang"}).to_string();
            post(
                &url,
                "/v1/completions",
                &[("x-kvroute-worker", "b"), ("x-kvroute-dp-rank", "0")],
                &b,
            )
            .await
        })
    };
    let gw = r.gateway.clone();
    wait_until("b0 busy", || {
        gw.workers()
            .statuses()
            .iter()
            .any(|w| w.id == "b" && w.in_flight == 1)
    })
    .await;
    let reply = post(&r.url, "/v1/completions", &[], &body("z")).await;
    assert_eq!(
        (
            reply.worker(),
            reply.headers["x-kvroute-dp-rank"].to_str().unwrap()
        ),
        ("b", "1")
    );
    let held_b1 = hold(&r, "b").await;
    let gw = r.gateway.clone();
    wait_until("b1 busy", || {
        gw.workers()
            .statuses()
            .iter()
            .any(|w| w.id == "b" && w.in_flight == 2)
    })
    .await;
    let reply = post(&r.url, "/v1/completions", &[], &body("w")).await;
    assert_eq!(
        (reply.status.as_u16(), reply.error_code().as_str()),
        (503, "all_workers_overloaded")
    );
    assert_eq!(reply.headers["retry-after"], "1");
    for h in [held_a, held_b0, held_b1] {
        h.abort();
    }
    r.stop().await;
}

#[tokio::test]
async fn post_busy_threshold_changes_routing_at_once() {
    let a = MockWorker::start("a", &["m"]).await;
    let b = MockWorker::start("b", &["m"]).await;
    let r = router(&a, &b, |s| s.request_timeout = Duration::from_secs(60)).await;
    let held = hold(&r, "a").await;
    let gw = r.gateway.clone();
    wait_until("a busy", || {
        gw.workers()
            .statuses()
            .iter()
            .any(|w| w.id == "a" && w.in_flight == 1)
    })
    .await;
    let (_, _, got) = get_url(&format!("{}/busy_threshold", r.url)).await;
    let got: serde_json::Value = serde_json::from_slice(&got).unwrap();
    assert_eq!(got["thresholds"][0]["model"], "m");
    assert!(got["thresholds"][0]["active_prefill_tokens_threshold"].is_null());
    let set = post(
        &r.url,
        "/busy_threshold",
        &[],
        &json!({"model": "m", "active_prefill_tokens_threshold": 100}).to_string(),
    )
    .await;
    assert_eq!(set.status, 200, "{:?}", set.body);
    assert_eq!(set.json()["active_prefill_tokens_threshold"], 100);
    for i in 0..8 {
        assert_eq!(
            post(&r.url, "/v1/completions", &[], &body(&format!("{i}")))
                .await
                .worker(),
            "b"
        );
    }
    let bad = post(
        &r.url,
        "/busy_threshold",
        &[],
        &json!({"model": "m", "active_decode_blocks_threshold": 1.5}).to_string(),
    )
    .await;
    assert_eq!(bad.status, 400);
    let unknown = post(
        &r.url,
        "/busy_threshold",
        &[],
        &json!({"model": "nope", "active_prefill_tokens_threshold": 1}).to_string(),
    )
    .await;
    assert_eq!(unknown.status, 404);
    // Omitted fields are a read: the threshold stays.
    let read = post(
        &r.url,
        "/busy_threshold",
        &[],
        &json!({"model": "m"}).to_string(),
    )
    .await;
    assert_eq!(read.json()["active_prefill_tokens_threshold"], 100);
    held.abort();
    r.stop().await;
}

#[tokio::test]
async fn admin_changes_need_the_admin_key_when_one_is_set() {
    let a = MockWorker::start("a", &["m"]).await;
    let b = MockWorker::start("b", &["m"]).await;
    let r = router(&a, &b, |s| {
        s.admin_api_key = kvroute_gateway::auth::Secret::new("s3cret".into())
    })
    .await;
    let update = json!({"model": "m", "active_prefill_tokens_threshold": 5}).to_string();
    let denied = post(&r.url, "/busy_threshold", &[], &update).await;
    assert_eq!(
        (denied.status.as_u16(), denied.error_code().as_str()),
        (401, "unauthorized")
    );
    let wrong = post(
        &r.url,
        "/busy_threshold",
        &[("authorization", "Bearer nope")],
        &update,
    )
    .await;
    assert_eq!(wrong.status, 401);
    let ok = post(
        &r.url,
        "/busy_threshold",
        &[("authorization", "Bearer s3cret")],
        &update,
    )
    .await;
    assert_eq!(ok.status, 200);
    r.stop().await;
}

#[tokio::test]
async fn soft_affinity_keeps_a_session_unless_its_worker_is_overloaded() {
    let a = MockWorker::start("a", &["m"]).await;
    let b = MockWorker::start("b", &["m"]).await;
    let r = router(&a, &b, |s| {
        s.session_affinity = Some((
            kvroute_core::affinity::AffinityMode::Soft,
            Duration::from_secs(600),
        ));
        s.busy.active_prefill_tokens = Some(100);
        s.request_timeout = Duration::from_secs(60);
    })
    .await;
    let session = [("x-session-id", "alice")];
    let (home, rank) = post(&r.url, "/v1/completions", &session, &body("first"))
        .await
        .placed();
    for i in 0..10 {
        let reply = post(
            &r.url,
            "/v1/completions",
            &session,
            &body(&format!("unrelated {i}")),
        )
        .await;
        assert_eq!(
            reply.placed(),
            (home.clone(), rank.clone()),
            "the session stays"
        );
    }
    // Its rank is overloaded: soft affinity lets the policy choose another, and rebinds.
    let held = hold_rank(&r, &home, rank.clone()).await;
    let gw = r.gateway.clone();
    let h = home.clone();
    wait_until("home busy", || {
        gw.workers()
            .statuses()
            .iter()
            .any(|w| w.id == h && w.in_flight >= 1)
    })
    .await;
    let moved = post(&r.url, "/v1/completions", &session, &body("while busy"))
        .await
        .placed();
    assert_ne!(moved, (home.clone(), rank.clone()));
    held.abort();
    let gw = r.gateway.clone();
    wait_until("home idle", || {
        gw.workers().statuses().iter().all(|w| w.in_flight == 0)
    })
    .await;
    assert_eq!(
        post(&r.url, "/v1/completions", &session, &body("after"))
            .await
            .placed(),
        moved,
        "rebound"
    );
    r.stop().await;
}

#[tokio::test]
async fn hard_affinity_is_a_pin() {
    let a = MockWorker::start("a", &["m"]).await;
    let b = MockWorker::start("b", &["m"]).await;
    let r = router(&a, &b, |s| {
        s.session_affinity = Some((
            kvroute_core::affinity::AffinityMode::Hard,
            Duration::from_secs(600),
        ));
        s.busy.active_prefill_tokens = Some(100);
        s.request_timeout = Duration::from_secs(60);
    })
    .await;
    let session = [("x-session-id", "bob")];
    let (home, rank) = post(&r.url, "/v1/completions", &session, &body("first"))
        .await
        .placed();
    let held = hold_rank(&r, &home, rank.clone()).await;
    let gw = r.gateway.clone();
    let h = home.clone();
    wait_until("home busy", || {
        gw.workers()
            .statuses()
            .iter()
            .any(|w| w.id == h && w.in_flight == 1)
    })
    .await;
    let reply = post(&r.url, "/v1/completions", &session, &body("while busy")).await;
    assert_eq!(
        reply.status.as_u16(),
        503,
        "{:?} home {home} {rank:?}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.error_code(), "pinned_worker_overloaded");
    // Other sessions are unaffected: they go to the ranks that are not busy.
    let other = post(
        &r.url,
        "/v1/completions",
        &[("x-session-id", "carol")],
        &body("x"),
    )
    .await;
    assert_eq!(other.status, 200);
    assert_ne!(other.placed(), (home.clone(), rank.clone()));
    held.abort();
    r.stop().await;
}
