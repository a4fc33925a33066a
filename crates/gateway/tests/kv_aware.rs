//! kv_aware end to end: real kvroute-sim replicas publishing real ZMQ KV events.

mod support;

use std::time::Duration;

use kvroute_gateway::{Settings, WorkerSpec};
use kvroute_sim::SimInstance;
use serde_json::{json, Value};
use support::*;

/// A kvroute-sim replica on loopback, publishing KV events (stopped when dropped).
struct Engine {
    sim: SimInstance,
    events: String,
}

impl Engine {
    async fn start(extra: &[&str]) -> Engine {
        let (sim, events) = sim_with_events(|events| {
            let mut argv = vec!["kvroute-sim", "--kv-events-endpoint", events];
            argv.extend_from_slice(extra);
            <kvroute_sim::SimArgs as clap::Parser>::parse_from(argv)
        })
        .await;
        Engine { sim, events }
    }

    fn url(&self) -> String {
        self.sim.url()
    }

    fn spec(&self, id: &str) -> WorkerSpec {
        WorkerSpec {
            id: Some(id.to_owned()),
            kv_events: Some(self.events.clone()),
            ..WorkerSpec::url(self.url())
        }
    }
}

/// A two-token completion of `prompt` through `r`, which must answer 200.
async fn complete_ok(r: &TestRouter, prompt: &str) -> Reply {
    let reply = r
        .complete(&[], &json!({"prompt": prompt, "max_tokens": 2}).to_string())
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    reply
}

async fn two_engines(extra: &[&str]) -> (Engine, Engine, TestRouter) {
    let a = Engine::start(extra).await;
    let b = Engine::start(extra).await;
    let s = Settings::with_workers(vec![a.spec("a"), b.spec("b")]).unwrap();
    let r = TestRouter::start(s).await;
    joined(&r, &a.url(), "a").await;
    joined(&r, &b.url(), "b").await;
    (a, b, r)
}

#[tokio::test]
async fn a_shared_prefix_goes_where_it_is_cached_and_is_credited_exactly() {
    let (_a, _b, r) = two_engines(&["--speedup", "100"]).await;
    let prefix = text(1600, 1); // 100 blocks of 16 bytes-as-tokens
    let first = complete_ok(&r, &prefix).await;
    let home = first.worker().to_owned();
    wait_overlap(&r, &format!("{prefix} tail"), &home, |o| o == Some(100)).await;
    let follow = format!("{prefix} and a different question");
    let debug = debug_route(&r, &follow).await;
    assert_eq!(debug["policy"], "kv_aware");
    assert_eq!(debug["worker"], home.as_str(), "{debug}");
    let credited = device_overlap(&debug, &home).unwrap();
    let reply = complete_ok(&r, &follow).await;
    assert_eq!(reply.worker(), home);
    let cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(
        cached,
        credited * 16,
        "the router credited what the engine had cached"
    );
    // The other candidate had nothing cached and a higher cost.
    let other = debug["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["worker"] != home.as_str())
        .unwrap()
        .clone();
    assert_eq!(other["overlap_blocks"]["device"], 0);
    // Nothing in flight: no request prefilling (the interference term's count is explained).
    assert_eq!(other["prefilling_requests"], 0, "{other}");
    let cost = |w: &str| {
        debug["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["worker"] == w)
            .unwrap()["cost"]
            .as_f64()
            .unwrap()
    };
    assert!(cost(&home) < cost(other["worker"].as_str().unwrap()));
    let m = r.metrics().await;
    assert_metric_at_least(&m, "kvroute_kv_index_blocks", "", 100.0);
    assert!(
        metric_value(&m, "kvroute_kv_index_bytes", "").unwrap() > 0.0,
        "{m}"
    );
    let stored = format!(r#"worker="{home}",event="stored",status="ok""#);
    assert_metric_at_least(&m, "kvroute_kv_events_total", &stored, 1.0);
    r.stop().await;
}

#[tokio::test]
async fn a_reset_cache_is_no_longer_credited() {
    let (a, b, r) = two_engines(&["--speedup", "100"]).await;
    let prefix = text(800, 2);
    let home = complete_ok(&r, &prefix).await.worker().to_owned();
    // 50 blocks stored; a prompt of exactly 50 blocks can reuse 49 (its last token is
    // always computed), and the router credits what the engine will reuse.
    wait_overlap(&r, &prefix, &home, |o| o == Some(49)).await;
    wait_overlap(&r, &format!("{prefix}!"), &home, |o| o == Some(50)).await;
    let url = if home == "a" { a.url() } else { b.url() };
    let reply = post(&url, "/reset_prefix_cache", &[], "{}").await;
    assert_eq!(reply.status, 200);
    wait_overlap(&r, &prefix, &home, |o| o == Some(0)).await;
    r.stop().await;
}

#[tokio::test]
async fn with_two_event_threads_the_sharded_index_credits_and_forgets_per_replica() {
    let (a, b) = (
        Engine::start(&["--speedup", "100"]).await,
        Engine::start(&["--speedup", "100"]).await,
    );
    let mut s = Settings::with_workers(vec![a.spec("a"), b.spec("b")]).unwrap();
    s.event_threads = 2;
    let r = TestRouter::start(s).await;
    joined(&r, &a.url(), "a").await;
    joined(&r, &b.url(), "b").await;
    // One prefix through the router, another sent to the other engine directly: both engines'
    // events reach the index, in different shards (one replica each).
    let (first, second) = (text(1600, 11), text(1600, 12));
    let home = complete_ok(&r, &first).await.worker().to_owned();
    let (other, other_url) = if home == "a" {
        ("b", b.url())
    } else {
        ("a", a.url())
    };
    let body = json!({"prompt": second, "max_tokens": 2}).to_string();
    assert_eq!(
        post(&other_url, "/v1/completions", &[], &body).await.status,
        200
    );
    wait_overlap(&r, &format!("{first} tail"), &home, |o| o == Some(100)).await;
    wait_overlap(&r, &format!("{second} tail"), other, |o| o == Some(100)).await;
    let debug = debug_route(&r, &format!("{second} and a question")).await;
    assert_eq!(debug["worker"], other, "{debug}");
    assert_eq!(device_overlap(&debug, &home), Some(0), "{debug}");
    let m = r.metrics().await;
    assert_metric_at_least(&m, "kvroute_kv_index_blocks", "", 200.0);
    // A reset clears one replica's shard only.
    let home_url = if home == "a" { a.url() } else { b.url() };
    assert_eq!(
        post(&home_url, "/reset_prefix_cache", &[], "{}")
            .await
            .status,
        200
    );
    wait_overlap(&r, &format!("{first} tail"), &home, |o| o == Some(0)).await;
    let debug = debug_route(&r, &format!("{second} tail")).await;
    assert_eq!(device_overlap(&debug, other), Some(100), "{debug}");
    r.stop().await;
}

#[tokio::test]
async fn a_burst_on_one_prefix_spreads_once_the_home_is_loaded() {
    let (_a, _b, r) = two_engines(&["--speedup", "1"]).await;
    let prefix = text(2048, 3);
    let home = complete_ok(&r, &prefix).await.worker().to_owned();
    wait_overlap(&r, &format!("{prefix}x"), &home, |o| o == Some(128)).await;
    // 40 streams sharing the prefix, each with its own 320-token question, held open until
    // all are routed: each adds ~21 decode blocks to its replica.
    let mut streams = Vec::new();
    let mut counts = std::collections::HashMap::<String, usize>::new();
    for i in 0..40 {
        let body = json!({"prompt": format!("{prefix}{}", text(320, 100 + i)), "max_tokens": 500, "stream": true}).to_string();
        let resp = open_stream(&r.url, "/v1/completions", &body).await;
        assert_eq!(resp.status(), 200);
        *counts
            .entry(
                resp.headers()["x-kvroute-worker"]
                    .to_str()
                    .unwrap()
                    .to_owned(),
            )
            .or_default() += 1;
        streams.push(resp);
    }
    assert_eq!(
        counts.len(),
        2,
        "every request piled onto one replica: {counts:?}"
    );
    assert!(
        counts[&home] >= counts.values().copied().min().unwrap(),
        "the home replica takes the most: {counts:?}"
    );
    let (_, _, body) = get_url(&format!("{}/workers", r.url)).await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    let active: u64 = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["ranks"][0]["active_decode_blocks"].as_u64().unwrap())
        .sum();
    assert!(active > 0);
    drop(streams);
    wait_all_idle(&r).await;
    let m = r.metrics().await;
    assert_metric(
        &m,
        "kvroute_worker_active_prefill_tokens",
        r#"worker="a""#,
        Some(0.0),
    );
    assert_metric(
        &m,
        "kvroute_worker_active_decode_blocks",
        r#"worker="b""#,
        Some(0.0),
    );
    assert_metric_at_least(&m, "kvroute_time_to_first_token_seconds_count", "", 40.0);
    assert_metric_at_least(&m, "kvroute_kv_hit_ratio_count", "", 41.0);
    r.stop().await;
}

#[tokio::test]
async fn approximate_mode_remembers_its_own_decisions() {
    let a = MockWorker::start("a", &["m"]).await;
    let b = MockWorker::start("b", &["m"]).await;
    let mut s = settings(&[&a, &b]);
    s.policy = kvroute_core::PolicyKind::KvAware;
    let r = TestRouter::start(s).await;
    let prefix = text(1000, 4);
    let body = |q: usize| json!({"model": "m", "prompt": format!("{prefix} q{q}")}).to_string();
    let home = r.complete(&[], &body(0)).await.worker().to_owned();
    for q in 1..10 {
        assert_eq!(r.complete(&[], &body(q)).await.worker(), home);
    }
    let d = debug_route(&r, &format!("{prefix} q")).await;
    assert_eq!(device_overlap(&d, &home), Some(62));
    r.stop().await;
}

#[tokio::test]
async fn data_parallel_ranks_are_candidates_and_are_named() {
    let e = Engine::start(&["--speedup", "100", "--data-parallel-size", "2"]).await;
    let spec = WorkerSpec {
        dp_size: Some(2),
        ..e.spec("dp")
    };
    let r = TestRouter::start(Settings::with_workers(vec![spec]).unwrap()).await;
    joined(&r, &e.url(), "dp").await;
    let prefix = text(640, 5);
    let first = complete_ok(&r, &prefix).await;
    let rank: u32 = first.headers["x-kvroute-dp-rank"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // The engine ran it on that rank: its events (published on port + rank) credit that rank.
    let on = |d: &Value, k: u32| {
        let c = d["candidates"].as_array().unwrap();
        assert_eq!(c.len(), 2);
        c.iter().find(|x| x["dp_rank"] == k).unwrap()["overlap_blocks"]["device"]
            .as_u64()
            .unwrap()
    };
    wait_until_async("the rank that ran it is credited", || async {
        on(&debug_route(&r, &prefix).await, rank) == 39
    })
    .await;
    let d = debug_route(&r, &prefix).await;
    assert_eq!(on(&d, rank), 39, "{d}");
    assert_eq!(on(&d, 1 - rank), 0, "{d}");
    assert_eq!(d["dp_rank"], rank);
    let again = complete_ok(&r, &format!("{prefix}!")).await;
    assert_eq!(
        again.headers["x-kvroute-dp-rank"],
        rank.to_string().as_str()
    );
    assert!(
        again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 39 * 16
    );
    r.stop().await;
}

#[tokio::test]
async fn non_streaming_requests_hold_their_prefill_until_the_answer() {
    let w = MockWorker::start("w", &["m"]).await;
    let mut s = settings(&[&w]);
    s.policy = kvroute_core::PolicyKind::KvAware;
    s.request_timeout = Duration::from_secs(60);
    let r = TestRouter::start(s).await;
    let router = r.url.clone();
    let prompt = format!("hang {}", text(200, 6));
    let body = json!({"model": "m", "prompt": prompt, "mode": "hang"}).to_string();
    let pending = tokio::spawn(async move { post(&router, "/v1/completions", &[], &body).await });
    let gw = r.gateway.clone();
    wait_until("the request is in flight", || {
        gw.workers().statuses()[0].in_flight == 1
    })
    .await;
    let st = &r.gateway.workers().statuses()[0];
    assert_eq!(
        st.ranks[0].active_prefill_tokens, 205,
        "the whole prompt is still to prefill"
    );
    pending.abort();
    let gw = r.gateway.clone();
    wait_until("released", || {
        let s = &gw.workers().statuses()[0];
        s.in_flight == 0
            && s.ranks[0].active_prefill_tokens == 0
            && s.ranks[0].active_decode_blocks == 0
    })
    .await;
    r.stop().await;
}
