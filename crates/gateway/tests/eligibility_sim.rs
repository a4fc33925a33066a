//! Eligibility, busy thresholds and session affinity against kvroute-sim replicas: load is
//! held by real streams (a replica overloaded by the decode-blocks threshold).

mod support;

use std::time::Duration;

use kvroute_core::affinity::AffinityMode;
use kvroute_core::PolicyKind;
use kvroute_gateway::{Settings, WorkerSpec};
use serde_json::json;
use support::*;
use tokio_util::sync::CancellationToken;

/// Replica "a" (one rank) and "b" (two ranks, taint gpu), both kvroute-sim at real speed.
/// The router believes each rank has 100 KV blocks, so a stream of a 640-token prompt (41
/// blocks) overloads its rank at a decode threshold of 0.2.
async fn cluster(tweak: impl FnOnce(&mut Settings)) -> (TestRouter, CancellationToken) {
    let shutdown = CancellationToken::new();
    let mut specs = Vec::new();
    for (id, dp) in [("a", 1), ("b", 2)] {
        let url = serve_sim(&["--data-parallel-size", &dp.to_string()], &shutdown).await;
        specs.push(WorkerSpec {
            id: Some(id.into()),
            num_gpu_blocks: Some(100),
            dp_size: (dp > 1).then_some(dp),
            taints: if id == "b" {
                vec!["gpu".into()]
            } else {
                vec![]
            },
            ..WorkerSpec::url(url)
        });
    }
    let mut s = Settings::with_workers(specs).unwrap();
    s.policy = PolicyKind::KvAware;
    s.busy.active_decode_blocks = Some(0.2);
    tweak(&mut s);
    (TestRouter::start(s).await, shutdown)
}

fn body(prompt: &str) -> String {
    json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 1}).to_string()
}

/// Holds a long stream on (worker, rank) and returns it (dropping it releases the load).
async fn hold(
    r: &TestRouter,
    worker: &str,
    rank: Option<u32>,
) -> http::Response<hyper::body::Incoming> {
    let b = json!({"model": "kvroute-sim", "prompt": text(640, 77), "max_tokens": 100000, "stream": true}).to_string();
    let rank = rank.map(|k| k.to_string());
    let mut headers = vec![("x-kvroute-worker", worker)];
    if let Some(k) = &rank {
        headers.push(("x-kvroute-dp-rank", k));
    }
    let resp = open_stream_with(&r.url, "/v1/completions", &headers, &b).await;
    assert_eq!(resp.status(), 200);
    resp
}

#[tokio::test]
async fn every_filter_and_error_class_on_simulated_replicas() {
    let (r, stop) = cluster(|_| {}).await;
    // Allow-list, pin with rank, required taints.
    for i in 0..4 {
        let allowed = [("x-kvroute-allowed-workers", "a")];
        r.assert_routed(&allowed, [body(&format!("{i}"))], "a")
            .await;
        let gpu = [("x-kvroute-required-taints", "gpu")];
        r.assert_routed(&gpu, [body(&format!("t{i}"))], "b").await;
    }
    let pin = [("x-kvroute-worker", "b"), ("x-kvroute-dp-rank", "1")];
    let reply = r.complete(&pin, &body("pinned")).await;
    assert_eq!(reply.placed(), ("b".to_owned(), Some("1".to_owned())));
    for (headers, status, code) in [
        (vec![("x-kvroute-worker", "c")], 400, "invalid_pin"),
        (
            vec![("x-kvroute-worker", "b"), ("x-kvroute-dp-rank", "2")],
            400,
            "invalid_pin",
        ),
        (
            vec![
                ("x-kvroute-worker", "a"),
                ("x-kvroute-allowed-workers", "b"),
            ],
            400,
            "invalid_pin",
        ),
        (
            vec![("x-kvroute-required-taints", "tpu")],
            503,
            "no_endpoint",
        ),
        (
            vec![("x-kvroute-preferred-taints", "gpu=x")],
            400,
            "invalid_hint",
        ),
    ] {
        let reply = r.complete(&headers, &body("x")).await;
        assert_eq!(
            (reply.status.as_u16(), reply.error_code().as_str()),
            (status, code),
            "{headers:?}"
        );
    }
    // Overload: a's only rank busy -> everything to b; a pinned -> pinned_worker_overloaded.
    let held_a = hold(&r, "a", None).await;
    r.assert_routed(&[], (0..4).map(|i| body(&format!("o{i}"))), "b")
        .await;
    let reply = r.complete(&[("x-kvroute-worker", "a")], &body("x")).await;
    reply.assert_error(503, "pinned_worker_overloaded");
    // b stays eligible while one of its ranks is free; with both busy, all are overloaded.
    let held_b0 = hold(&r, "b", Some(0)).await;
    let reply = r.complete(&[], &body("y")).await;
    assert_eq!(reply.placed(), ("b".to_owned(), Some("1".to_owned())));
    let held_b1 = hold(&r, "b", Some(1)).await;
    let reply = r.complete(&[], &body("z")).await;
    reply.assert_error(503, "all_workers_overloaded");
    assert_eq!(reply.headers["retry-after"], "1");
    // Releasing a's stream makes it eligible again.
    drop(held_a);
    r.wait_in_flight("a", |n| n == 0).await;
    r.assert_routed(&[], [body("free again")], "a").await;
    drop((held_b0, held_b1));
    r.stop().await;
    stop.cancel();
}

#[tokio::test]
async fn busy_thresholds_change_at_run_time() {
    let (r, stop) = cluster(|s| s.busy.active_decode_blocks = None).await;
    let held = hold(&r, "a", None).await;
    // No threshold: a stays a candidate (its cost may still lose to b's; send a pinned one).
    let pin_a = [("x-kvroute-worker", "a")];
    assert_eq!(r.complete(&pin_a, &body("p")).await.status, 200);
    let threshold = json!({"model": "kvroute-sim", "active_decode_blocks_threshold": 0.2});
    let set = r.post("/busy_threshold", &[], &threshold.to_string()).await;
    assert_eq!(set.status, 200, "{:?}", set.body);
    let reply = r.complete(&pin_a, &body("p2")).await;
    reply.assert_error(503, "pinned_worker_overloaded");
    r.assert_routed(&[], (0..4).map(|i| body(&format!("q{i}"))), "b")
        .await;
    drop(held);
    r.stop().await;
    stop.cancel();
}

#[tokio::test]
async fn session_affinity_soft_and_hard() {
    for mode in [AffinityMode::Soft, AffinityMode::Hard] {
        let (r, stop) =
            cluster(|s| s.session_affinity = Some((mode, Duration::from_secs(600)))).await;
        let session = [("x-session-id", "s1")];
        let (home, rank) = r.complete(&session, &body("first")).await.placed();
        for i in 0..6 {
            let reply = r.complete(&session, &body(&format!("n{i}"))).await;
            assert_eq!(reply.placed(), (home.clone(), rank.clone()), "{mode:?}");
        }
        let held = hold(&r, &home, rank.as_deref().map(|k| k.parse().unwrap())).await;
        let reply = r.complete(&session, &body("while busy")).await;
        match mode {
            AffinityMode::Soft => {
                assert_eq!(reply.status, 200);
                assert_ne!(
                    reply.placed(),
                    (home.clone(), rank.clone()),
                    "soft: another rank"
                );
            }
            AffinityMode::Hard => reply.assert_error(503, "pinned_worker_overloaded"),
        }
        drop(held);
        r.stop().await;
        stop.cancel();
    }
}

/// Kvroute-sim engines "small" and "large", of 16 and 1,024 blocks of 16 tokens (contexts of
/// 256 and 16,384 tokens), both healthy, behind a router with `tweak`.
async fn two_contexts(tweak: impl FnOnce(&mut Settings)) -> (TestRouter, CancellationToken) {
    let shutdown = CancellationToken::new();
    let mut specs = Vec::new();
    for (id, blocks) in [("small", "16"), ("large", "1024")] {
        let url = serve_sim(&["--num-gpu-blocks", blocks], &shutdown).await;
        specs.push(WorkerSpec {
            id: Some(id.into()),
            ..WorkerSpec::url(url)
        });
    }
    let mut s = Settings::with_workers(specs).unwrap();
    tweak(&mut s);
    let r = TestRouter::start(s).await;
    r.wait_healthy("small").await;
    r.wait_healthy("large").await;
    (r, shutdown)
}

/// Engines of two context lengths (kvroute-sim's `max_model_len` in `/v1/models` is its KV
/// capacity): a prompt longer than the small one takes goes to the large one under every
/// policy (those that read no tokens count them for a body this long), and a prompt no
/// engine takes gets the engine's own error.
#[tokio::test]
async fn a_long_prompt_goes_to_the_engine_whose_context_holds_it() {
    let policies = [
        PolicyKind::LlmD,
        PolicyKind::KvAware,
        PolicyKind::RoundRobin,
        PolicyKind::CacheAware,
    ];
    for policy in policies {
        let (r, shutdown) = two_contexts(|s| s.policy = policy).await;
        let workers = r.get_json("/workers").await;
        let contexts: Vec<_> = workers["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| (w["id"].clone(), w["max_model_len"].clone()))
            .collect();
        assert!(
            contexts.contains(&(json!("small"), json!(256))),
            "{workers}"
        );
        assert!(
            contexts.contains(&(json!("large"), json!(16384))),
            "{workers}"
        );
        // 300 tokens (and 4 to answer) fit only the large engine; without the filter, every
        // policy here sends some of these distinct prompts to the small engine, which
        // refuses them.
        let long = |i: u64| json!({"prompt": text(300, 1000 + i), "max_tokens": 4}).to_string();
        r.assert_routed(&[], (0..8).map(long), "large").await;
        // Short prompts still go to either.
        let short = |i: u64| json!({"prompt": text(40, 2000 + i), "max_tokens": 4}).to_string();
        let counts = r.tally_routes("/v1/completions", (0..16).map(short)).await;
        assert_eq!(counts.values().sum::<usize>(), 16, "{policy:?}: {counts:?}");
        // The answer counts: 250 tokens of prompt fit the small engine alone, not with 10 more.
        let body = json!({"prompt": text(250, 3000), "max_tokens": 10}).to_string();
        assert_eq!(r.complete(&[], &body).await.worker(), "large", "{policy:?}");
        // Beyond every engine: routed anyway, and the engine's own refusal comes back whole.
        let huge = json!({"prompt": text(20_000, 4000), "max_tokens": 4}).to_string();
        let reply = r.complete(&[], &huge).await;
        assert_eq!(reply.status, 400, "{policy:?}");
        let message = reply.json()["error"]["message"].to_string();
        assert!(
            message.contains("exceeds the KV cache capacity"),
            "{message}"
        );
        shutdown.cancel();
    }
}

/// A hard session binding (which the router made) yields to a context its engine does not
/// take: the session's long turn goes to the engine that takes it and stays bound there.
#[tokio::test]
async fn a_session_outgrowing_its_engine_moves_to_one_that_holds_it() {
    let (r, shutdown) = two_contexts(|s| {
        s.policy = PolicyKind::RoundRobin;
        s.session_affinity = Some((AffinityMode::Hard, Duration::from_secs(600)));
    })
    .await;
    let body = |tokens: usize, seed: u64| {
        json!({"prompt": text(tokens, seed), "max_tokens": 4}).to_string()
    };
    // The first turn is bound to the small engine (its only allowed worker).
    let first = [
        ("x-session-id", "s1"),
        ("x-kvroute-allowed-workers", "small"),
    ];
    r.assert_routed(&first, [body(40, 1)], "small").await;
    let session = [("x-session-id", "s1")];
    r.assert_routed(&session, [body(40, 2), body(60, 3)], "small")
        .await;
    // 300 tokens do not fit it: the turn goes to the large engine, and the session with it.
    let reply = r.complete(&session, &body(300, 4)).await;
    assert_eq!((reply.status.as_u16(), reply.worker()), (200, "large"));
    r.assert_routed(&session, [body(40, 5), body(40, 6)], "large")
        .await;
    // A client's own pin is kept: the small engine answers with its refusal.
    let pinned = [("x-kvroute-worker", "small")];
    assert_eq!(r.complete(&pinned, &body(300, 7)).await.status, 400);
    shutdown.cancel();
}
