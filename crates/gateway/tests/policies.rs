//! Each policy's distribution, through the real router and real workers.

mod support;

use kvroute_core::PolicyKind;
use support::*;

async fn two_workers(policy: PolicyKind) -> (MockWorker, MockWorker, TestRouter) {
    let [a, b] = mocks(["a", "b"]).await;
    let mut s = settings(&[&a, &b]);
    s.policy = policy;
    let r = TestRouter::start(s).await;
    (a, b, r)
}

async fn worker_of(r: &TestRouter, headers: &[(&str, &str)], body: &str) -> String {
    let reply = r.post("/v1/chat/completions", headers, body).await;
    assert_eq!(reply.status, http::StatusCode::OK, "{:?}", reply.body);
    reply.worker().to_owned()
}

/// The workers of chats with these contents, in order.
async fn workers_of(r: &TestRouter, contents: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut seen = Vec::new();
    for content in contents {
        seen.push(worker_of(r, &[], &chat("m", &content)).await);
    }
    seen
}

/// How many distinct workers `seen` names.
fn distinct_workers(seen: &[String]) -> usize {
    tally(seen).len()
}

#[tokio::test]
async fn round_robin_splits_evenly() {
    let (a, b, r) = two_workers(PolicyKind::RoundRobin).await;
    let seen = workers_of(&r, (0..20).map(|i| format!("{i}"))).await;
    let c = tally(&seen);
    assert_eq!((c[a.url.as_str()], c[b.url.as_str()]), (10, 10));
    // Strict alternation.
    assert!(seen.windows(2).all(|w| w[0] != w[1]));
    r.stop().await;
}

#[tokio::test]
async fn random_uses_every_worker() {
    let (_, _, r) = two_workers(PolicyKind::Random).await;
    let seen = workers_of(&r, (0..60).map(|i| format!("{i}"))).await;
    // P(one worker gets none of 60) = 2^-59.
    assert_eq!(distinct_workers(&seen), 2);
    r.stop().await;
}

#[tokio::test]
async fn power_of_two_avoids_the_loaded_worker() {
    let (a, b, r) = two_workers(PolicyKind::PowerOfTwo).await;
    // Hold a stream open on one worker.
    let body = r#"{"model":"m","stream":true,"max_tokens":1,"prompt":"hold"}"#;
    let resp = open_stream(&r.url, "/v1/completions", body).await;
    let busy = resp.headers()["x-kvroute-worker"]
        .to_str()
        .unwrap()
        .to_owned();
    let idle = if busy == a.url { &b.url } else { &a.url };
    for i in 0..10 {
        assert_eq!(&worker_of(&r, &[], &chat("m", &format!("{i}"))).await, idle);
    }
    a.release.add_permits(1);
    b.release.add_permits(1);
    drop(resp);
    r.stop().await;
}

async fn check_sticky_and_spread(policy: PolicyKind) {
    let (_, _, r) = two_workers(policy).await;
    // One session sticks to one worker, whatever the prompt.
    let first = worker_of(&r, &[("x-session-id", "alice")], &chat("m", "p0")).await;
    for i in 1..10 {
        let w = worker_of(
            &r,
            &[("x-session-id", "alice")],
            &chat("m", &format!("p{i}")),
        )
        .await;
        assert_eq!(w, first, "{policy}");
    }
    // SGLang's routing key and the body's `user` are session keys too.
    let k = worker_of(&r, &[("x-smg-routing-key", "bob")], &chat("m", "a")).await;
    let body = serde_json::json!({"model": "m", "user": "carol", "messages": [{"role": "user", "content": "a"}]}).to_string();
    let u = worker_of(&r, &[], &body).await;
    for i in 0..5 {
        assert_eq!(
            worker_of(
                &r,
                &[("x-smg-routing-key", "bob")],
                &chat("m", &format!("{i}"))
            )
            .await,
            k
        );
        let body = serde_json::json!({"model": "m", "user": "carol", "messages": [{"role": "user", "content": format!("{i}")}]}).to_string();
        assert_eq!(worker_of(&r, &[], &body).await, u);
    }
    // Many sessions use both workers.
    let mut seen = Vec::new();
    for s in 0..40 {
        seen.push(worker_of(&r, &[("x-session-id", &format!("s{s}"))], &chat("m", "x")).await);
    }
    assert_eq!(distinct_workers(&seen), 2, "{policy}");
    r.stop().await;
}

#[tokio::test]
async fn consistent_hash_keeps_sessions() {
    check_sticky_and_spread(PolicyKind::ConsistentHash).await;
}

#[tokio::test]
async fn rendezvous_hash_keeps_sessions() {
    check_sticky_and_spread(PolicyKind::RendezvousHash).await;
}

#[tokio::test]
async fn manual_keeps_sessions() {
    check_sticky_and_spread(PolicyKind::Manual).await;
}

#[tokio::test]
async fn keyless_traffic_spreads_under_every_policy() {
    // passthrough is one worker's gateway by definition (smg_load.rs tests it).
    for policy in PolicyKind::ALL
        .into_iter()
        .filter(|&p| p != PolicyKind::Passthrough)
    {
        let (_, _, r) = two_workers(policy).await;
        let contents = (0..40).map(|i| {
            let text = format!("{i} {}", "q".repeat(300));
            if policy == PolicyKind::PrefixHash {
                format!("{i} {text}")
            } else {
                text
            }
        });
        let seen = workers_of(&r, contents).await;
        assert_eq!(
            distinct_workers(&seen),
            2,
            "{policy} sent all keyless traffic to one worker"
        );
        r.stop().await;
    }
}

#[tokio::test]
async fn prefix_hash_groups_by_prefix() {
    let (_, _, r) = two_workers(PolicyKind::PrefixHash).await;
    let system = "You are a helpful assistant. ".repeat(10);
    assert!(system.len() > 256);
    let first = worker_of(&r, &[], &chat("m", &format!("{system} question 0"))).await;
    for i in 1..10 {
        let w = worker_of(&r, &[], &chat("m", &format!("{system} question {i}"))).await;
        assert_eq!(w, first);
    }
    let seen = workers_of(&r, (0..30).map(|g| format!("group {g}: {system}"))).await;
    assert_eq!(distinct_workers(&seen), 2);
    r.stop().await;
}

#[tokio::test]
async fn debug_route_changes_no_policy_state() {
    for policy in [
        PolicyKind::RoundRobin,
        PolicyKind::CacheAware,
        PolicyKind::Manual,
    ] {
        let (_, _, r) = two_workers(policy).await;
        // A first real request, so that the next decision is not a coin toss (cache_aware's
        // empty trees tie); then a longer, unrelated prompt: a dry run that inserted it
        // would make its worker's tree the larger one and flip the next answer.
        worker_of(&r, &[("x-session-id", "s")], &chat("m", "a short seed")).await;
        let body = chat("m", &"an unrelated longer prompt ".repeat(40));
        let ask = || async {
            let d = r
                .post("/debug/route", &[("x-session-id", "s")], &body)
                .await
                .json();
            d["worker"].as_str().unwrap().to_owned()
        };
        let first = ask().await;
        for _ in 0..5 {
            assert_eq!(ask().await, first, "{policy}: a dry run moved the policy");
        }
        // The real request goes where the dry run said.
        assert_eq!(
            worker_of(&r, &[("x-session-id", "s")], &body).await,
            first,
            "{policy}"
        );
        r.stop().await;
    }
}
