//! Router replicas in sync over a real nats-server: each replica's view of a worker's load is
//! the sum of every replica's requests. Needs `nats-server` on the PATH (`.ci/run` installs it).

mod support;

use std::process::{Command, Stdio};

use http_body_util::BodyExt;
use support::*;

fn rank_in_flight(r: &TestRouter) -> u64 {
    r.gateway.workers().statuses()[0].ranks[0].in_flight
}

fn rank_prefill(r: &TestRouter) -> u64 {
    r.gateway.workers().statuses()[0].ranks[0].active_prefill_tokens
}

/// Waits until each of `routers` counts `n` requests in flight on the worker's rank.
async fn wait_load(what: &str, routers: &[&TestRouter], n: u64) {
    wait_until(what, || routers.iter().all(|r| rank_in_flight(r) == n)).await;
}

/// Waits until every one of `routers` counts `n` peers, all at once.
async fn wait_peers(routers: &[&TestRouter], n: f64) {
    wait_until_async("the replicas' peer counts", || async {
        for r in routers {
            if metric_value(&r.metrics().await, "kvroute_replica_peers", "") != Some(n) {
                return false;
            }
        }
        true
    })
    .await;
}

/// A completion the mock worker answers at once.
const BODY: &str = r#"{"model":"m","prompt":"x"}"#;

/// A stream the mock worker holds open until released.
const STREAM: &str = r#"{"model":"m","prompt":"x","stream":true,"max_tokens":1}"#;

#[tokio::test]
async fn each_replica_sees_the_load_of_both() {
    let nats = nats().await;
    let w = MockWorker::start("w", &["m"]).await;
    let a = TestRouter::start(synced(&nats, "sum", &[&w])).await;
    let b = TestRouter::start(synced(&nats, "sum", &[&w])).await;
    wait_peers(&[&a, &b], 1.0).await;
    let mut streams = Vec::new();
    for url in [&a.url, &a.url, &b.url] {
        streams.push(open_stream(url, "/v1/completions", STREAM).await);
    }
    wait_load("both see three", &[&a, &b], 3).await;
    let m = a.metrics().await;
    assert_metric(
        &m,
        "kvroute_replica_sync_messages_total",
        "direction=\"out\",kind=\"routed\"",
        Some(2.0),
    );
    assert_metric(
        &m,
        "kvroute_replica_sync_messages_total",
        "direction=\"in\",kind=\"routed\"",
        Some(1.0),
    );
    assert_metric(&m, "kvroute_replica_sync_connected", "", Some(1.0));
    assert!(metric_value(&m, "kvroute_replica_sync_lag_seconds", "").is_some());
    w.release.add_permits(3);
    for s in streams {
        s.into_body().collect().await.unwrap();
    }
    wait_load("both see none", &[&a, &b], 0).await;
    a.stop().await;
    b.stop().await;
}

/// A `kvroute` process in sync on `nats`, serving `worker`.
async fn replica_process(nats: &str, prefix: &str, worker: &str) -> (ChildGuard, String) {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["--port", &port.to_string(), "--prometheus-port", "0"])
        .args(["--worker-urls", worker, "--policy", "round_robin"])
        .args([
            "--replica-sync",
            nats,
            "--replica-sync-subject-prefix",
            prefix,
        ])
        .args(["--replica-timeout-secs", "2"])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let ready = format!("{url}/readiness");
    wait_until_async("the replica is ready", || answers(&ready)).await;
    (ChildGuard(child), url)
}

/// Settings for `workers` with replica sync on `nats` under `prefix`.
fn synced(nats: &Nats, prefix: &str, workers: &[&MockWorker]) -> kvroute_gateway::Settings {
    let mut s = settings(workers);
    s.replica_sync = Some(sync_config(nats.1.clone(), prefix));
    s
}

/// Sync on the NATS at `url` under `prefix`, peers forgotten after 2 s of silence.
fn sync_config(url: String, prefix: &str) -> kvroute_gateway::config::SyncConfig {
    kvroute_gateway::config::SyncConfig {
        url,
        prefix: prefix.into(),
        timeout: std::time::Duration::from_secs(2),
    }
}

#[tokio::test]
async fn a_killed_replicas_load_is_gone_within_the_timeout() {
    let nats = nats().await;
    let w = MockWorker::start("w", &["m"]).await;
    let a = TestRouter::start(synced(&nats, "kill", &[&w])).await;
    let (mut b, b_url) = replica_process(&nats.1, "kill", &w.url).await;
    // The replicas hear each other, then B's stream shows on A.
    wait_peers(&[&a], 1.0).await;
    let held = open_stream(&b_url, "/v1/completions", STREAM).await;
    wait_until("A sees B's stream", || rank_in_flight(&a) == 1).await;
    b.0.kill().unwrap();
    let _ = b.0.wait();
    drop(held);
    // No phantom load once B is silent past the timeout; A serves on.
    wait_until("B's load dropped", || rank_in_flight(&a) == 0).await;
    assert_eq!(a.complete(&[], BODY).await.status, 200);
    w.release.add_permits(8);
    a.stop().await;
}

#[tokio::test]
async fn replicas_serve_without_nats_and_resync_when_it_returns() {
    let mut nats = nats().await;
    let port: u16 = nats.1.rsplit(':').next().unwrap().parse().unwrap();
    let w = MockWorker::start("w", &["m"]).await;
    let a = TestRouter::start(synced(&nats, "outage", &[&w])).await;
    let b = TestRouter::start(synced(&nats, "outage", &[&w])).await;
    wait_peers(&[&a], 1.0).await;
    let _ = nats.0.kill();
    let _ = nats.0.wait();
    // Both serve on their own state.
    for r in [&a, &b] {
        assert_eq!(r.complete(&[], BODY).await.status, 200);
    }
    // A forgets silent B.
    wait_peers(&[&a], 0.0).await;
    // NATS returns on the same port: the replicas reconnect and share load again.
    let _restarted = nats_on(port).await;
    wait_peers(&[&a, &b], 1.0).await;
    let held = open_stream(&b.url, "/v1/completions", STREAM).await;
    wait_until("A sees B's load again", || rank_in_flight(&a) == 1).await;
    w.release.add_permits(1);
    held.into_body().collect().await.unwrap();
    wait_load("both see none", &[&a, &b], 0).await;
    a.stop().await;
    b.stop().await;
}

/// Starts a router and waits for its `/readiness` (with sync on: once its snapshot is in).
async fn start_ready(settings: kvroute_gateway::Settings) -> TestRouter {
    let r = TestRouter::start_unready(settings).await;
    let ready = format!("{}/readiness", r.url);
    wait_until_async("the replica ready", || answers(&ready)).await;
    r
}

/// Starts a router, ready and connected to NATS.
async fn start_synced(settings: kvroute_gateway::Settings) -> TestRouter {
    let r = start_ready(settings).await;
    r.wait_metric("kvroute_replica_sync_connected", "", Some(1.0))
        .await;
    r
}

/// The settings of a learning case.
fn case_settings(
    nats: &Nats,
    prefix: &str,
    workers: &[&MockWorker],
    case: Case,
) -> kvroute_gateway::Settings {
    let mut s = synced(nats, prefix, workers);
    case(&mut s);
    s
}

/// Sets one learning case up.
type Case = fn(&mut kvroute_gateway::Settings);

/// What replicas learn from each decision, one case each: the prefix trees of cache_aware
/// and llm_d, manual's sessions, kv_aware's approximate index, and session-affinity bindings
/// (over a random policy, so only the binding can agree).
fn learning_cases() -> Vec<(&'static str, Case)> {
    vec![
        ("cache_aware", |s| {
            s.policy = kvroute_core::PolicyKind::CacheAware
        }),
        ("llm_d", |s| s.policy = kvroute_core::PolicyKind::LlmD),
        ("manual", |s| s.policy = kvroute_core::PolicyKind::Manual),
        // The mock workers publish no KV events: kv_aware approximates their caches.
        ("kv_aware_approximate", |s| {
            s.policy = kvroute_core::PolicyKind::KvAware
        }),
        ("affinity", |s| {
            s.policy = kvroute_core::PolicyKind::Random;
            s.session_affinity = Some((
                kvroute_core::affinity::AffinityMode::Soft,
                std::time::Duration::from_secs(600),
            ));
        }),
    ]
}

/// Prompt `i` of the learning tests, with its session header.
fn learnt_request(i: u64) -> (String, String) {
    let body = serde_json::json!({"model": "m", "prompt": text(400, 900 + i)}).to_string();
    (body, format!("session-{i}"))
}

/// Whether `router` sends request `i` to `worker` eight dry runs in a row (a dry run breaks
/// ties at random: eight in a row rule out luck).
async fn routes_to(router: &TestRouter, i: u64, worker: &str) -> bool {
    let (body, session) = learnt_request(i);
    let headers = [("x-session-id", session.as_str())];
    for _ in 0..8 {
        let d = post(&router.url, "/debug/route", &headers, &body)
            .await
            .json();
        if d["worker"] != worker {
            return false;
        }
    }
    true
}

/// Sends requests 0..6 through `router`: where each went.
async fn route_six(router: &TestRouter) -> Vec<String> {
    let mut chosen = Vec::new();
    for i in 0..6 {
        let (body, session) = learnt_request(i);
        let headers = [("x-session-id", session.as_str())];
        let reply = post(&router.url, "/v1/completions", &headers, &body).await;
        assert_eq!(reply.status, 200);
        chosen.push(reply.worker().to_owned());
    }
    chosen
}

async fn four_workers() -> [MockWorker; 4] {
    mocks(["w0", "w1", "w2", "w3"]).await
}

#[tokio::test]
async fn replicas_learn_each_others_prefix_trees_and_sessions() {
    let nats = nats().await;
    let workers = four_workers().await;
    let refs: Vec<&MockWorker> = workers.iter().collect();
    for (name, case) in learning_cases() {
        let mk = || case_settings(&nats, &format!("learn-{name}"), &refs, case);
        let a = TestRouter::start(mk()).await;
        let b = TestRouter::start(mk()).await;
        wait_peers(&[&b], 1.0).await;
        for (i, chosen) in route_six(&a).await.into_iter().enumerate() {
            // B, which never saw this prompt or session, routes it where A did.
            wait_until_async(&format!("{name}: B learnt A's decision"), || {
                routes_to(&b, i as u64, &chosen)
            })
            .await;
        }
        a.stop().await;
        b.stop().await;
    }
}

#[tokio::test]
async fn a_starting_replica_takes_the_learnt_state_before_it_is_ready() {
    let nats = nats().await;
    let workers = four_workers().await;
    let refs: Vec<&MockWorker> = workers.iter().collect();
    for (name, case) in learning_cases() {
        let mk = || case_settings(&nats, &format!("state-{name}"), &refs, case);
        let a = start_synced(mk()).await;
        let chosen = route_six(&a).await;
        // B starts after A's requests are over: only the snapshot can tell it what A learnt,
        // and it must know as soon as it says it is ready.
        let b = start_ready(mk()).await;
        for (i, worker) in chosen.iter().enumerate() {
            assert!(
                routes_to(&b, i as u64, worker).await,
                "{name}: B routes request {i} to {worker} as A did"
            );
        }
        a.stop().await;
        b.stop().await;
    }
}

#[tokio::test]
async fn a_starting_replica_takes_a_snapshot_before_it_is_ready() {
    let nats = nats().await;
    let w = MockWorker::start("w", &["m"]).await;
    // kv_aware, so that a request's prompt tokens count as prefill load until its first token.
    let kv = || kvroute_gateway::Settings {
        policy: kvroute_core::PolicyKind::KvAware,
        ..synced(&nats, "snapshot", &[&w])
    };
    let a = start_synced(kv()).await;
    let mut held = open_stream(&a.url, "/v1/completions", STREAM).await;
    // Its first token has come: A counts it as decoding, no longer prefilling.
    held.body_mut().frame().await.unwrap().unwrap();
    wait_until("A's prefill done", || rank_prefill(&a) == 0).await;
    // B starts after A's request: it must know of it as soon as it says it is ready, and
    // that its prefill is done.
    let b = start_ready(kv()).await;
    assert_eq!(rank_in_flight(&b), 1, "B is ready with A's load in view");
    assert_eq!(
        rank_prefill(&b),
        0,
        "B knows A's request has its first token"
    );
    w.release.add_permits(1);
    held.into_body().collect().await.unwrap();
    wait_load("both see none", &[&a, &b], 0).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn garbage_and_foreign_messages_on_the_sync_subjects_are_counted_and_ignored() {
    use futures_util::StreamExt;
    use kvroute_gateway::sync::{encode, snapshot, Envelope, Message};

    let nats = nats().await;
    let w = MockWorker::start("w", &["m"]).await;
    let a = start_synced(synced(&nats, "garbage", &[&w])).await;
    let raw = async_nats::connect(nats.1.as_str()).await.unwrap();
    let foreign = |body| {
        encode(&Envelope {
            sender: 42,
            seq: 0,
            sent_ms: 0,
            body,
        })
    };
    // Not MessagePack; a load message for a worker A does not have; one for A's worker.
    raw.publish("garbage.load", "\u{1}not a message".into())
        .await
        .unwrap();
    let routed = |request, worker: &str| Message::Routed {
        request,
        model: "m".into(),
        half: None,
        worker: worker.into(),
        dp_rank: None,
        session_key: None,
        bind: false,
        text: String::new(),
        tokens: Vec::new(),
        prefill_tokens: 10,
        blocks: vec![1, 2],
        own_blocks: 0,
    };
    raw.publish(
        "garbage.load",
        foreign(routed(1, "http://nowhere:1")).into(),
    )
    .await
    .unwrap();
    raw.publish("garbage.load", foreign(routed(2, &w.url)).into())
        .await
        .unwrap();
    // A snapshot ask that is garbage gets no answer; a well-formed one does.
    let inbox = raw.new_inbox();
    let mut answers = raw.subscribe(inbox.clone()).await.unwrap();
    raw.publish_with_reply("garbage.snapshot", inbox.clone(), "junk".into())
        .await
        .unwrap();
    let ask = snapshot::Ask {
        sender: 42,
        state_from: None,
    };
    raw.publish_with_reply(
        "garbage.snapshot",
        inbox,
        rmp_serde::to_vec_named(&ask).unwrap().into(),
    )
    .await
    .unwrap();
    let first = tokio::time::timeout(std::time::Duration::from_secs(10), answers.next())
        .await
        .expect("an answer")
        .unwrap();
    let answer = snapshot::decode(&first.payload).expect("a snapshot answer");
    assert!(
        matches!(answer.part, snapshot::Part::End { state: false }),
        "A has nothing in flight: {answer:?}"
    );
    // A counts the two malformed messages.
    let malformed = r#"direction="in",kind="malformed""#;
    a.wait_metric("kvroute_replica_sync_messages_total", malformed, Some(2.0))
        .await;
    // The well-formed foreign request counts on A's worker; then its sender falls silent
    // (no heartbeat) and it is taken back. A serves throughout.
    wait_until("the foreign request counts", || rank_in_flight(&a) == 1).await;
    assert_eq!(a.complete(&[], BODY).await.status, 200);
    wait_until("the silent sender's request is taken back", || {
        rank_in_flight(&a) == 0
    })
    .await;
    a.stop().await;
}

#[tokio::test]
async fn a_replica_started_without_nats_is_ready_and_syncs_once_nats_comes() {
    let port = free_port();
    let w = MockWorker::start("w", &["m"]).await;
    let mut s = settings(&[&w]);
    s.replica_sync = Some(sync_config(format!("nats://127.0.0.1:{port}"), "late"));
    // Nothing listens on the port: A routes on its own state, and says it is ready.
    let a = start_ready(s).await;
    assert_eq!(a.complete(&[], BODY).await.status, 200);
    assert_metric(
        &a.metrics().await,
        "kvroute_replica_sync_connected",
        "",
        Some(0.0),
    );
    // NATS comes up and a second replica joins: they find each other.
    let nats = nats_on(port).await;
    let b = TestRouter::start(synced(&nats, "late", &[&w])).await;
    wait_peers(&[&a, &b], 1.0).await;
    a.wait_metric("kvroute_replica_sync_connected", "", Some(1.0))
        .await;
    a.stop().await;
    b.stop().await;
}
