//! kv_aware's predicted and calibrated costs in real time: each rank's latency models and
//! speed factors learn from its streams' timings, and a kvroute-sim engine made slower at run
//! time (`POST /speed`) gets less traffic. Counts are asserted, never times.

mod support;

use std::collections::HashMap;

use kvroute_core::CostModel;
use kvroute_gateway::{Settings, WorkerSpec};
use kvroute_sim::SimInstance;
use serde_json::{json, Value};
use support::*;

/// Two engines, "a" and "b", behind a router with kv_aware's `model`.
async fn two_engines(model: CostModel) -> (SimInstance, SimInstance, TestRouter) {
    let (a, a_events) = engine().await;
    let (b, b_events) = engine().await;
    let spec = |id: &str, sim: &SimInstance, events: &str| WorkerSpec {
        id: Some(id.to_owned()),
        kv_events: Some(events.to_owned()),
        ..WorkerSpec::url(sim.url())
    };
    let mut s =
        Settings::with_workers(vec![spec("a", &a, &a_events), spec("b", &b, &b_events)]).unwrap();
    s.policy_config.kv_aware.cost_model = model;
    let r = TestRouter::start(s).await;
    joined(&r, &a.url(), "a").await;
    joined(&r, &b.url(), "b").await;
    (a, b, r)
}

async fn engine() -> (SimInstance, String) {
    sim_with_events(|events| {
        <kvroute_sim::SimArgs as clap::Parser>::parse_from([
            "kvroute-sim",
            "--kv-events-endpoint",
            events,
            "--speedup",
            "4",
        ])
    })
    .await
}

/// A streamed completion of a prompt no other request shares; the worker that answered.
async fn stream(r: &TestRouter, i: u64) -> String {
    stream_tokens(r, i, 4).await
}

async fn stream_tokens(r: &TestRouter, i: u64, max_tokens: u32) -> String {
    let prompt = format!("{i} {}", text(2000, 5000 + i));
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true}).to_string();
    let reply = r.complete(&[], &body).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    reply.worker().to_owned()
}

fn fitted(debug: &Value, worker: &str) -> Value {
    debug["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["worker"] == worker)
        .unwrap()["predicted"]
        .clone()
}

#[tokio::test]
async fn a_worker_made_slower_at_run_time_gets_less_traffic() {
    let (_a, b, r) = two_engines(CostModel::Predicted).await;
    for i in 0..10 {
        stream(&r, i).await;
    }
    // b becomes 40 times slower than a.
    let reply = post(&b.url(), "/speed", &[], r#"{"speedup": 0.1}"#).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let mut count: HashMap<String, usize> = HashMap::new();
    for i in 100..140 {
        *count.entry(stream(&r, i).await).or_default() += 1;
    }
    let on_b = count.get("b").copied().unwrap_or(0);
    assert!(on_b <= 10, "the slow worker kept its share: {count:?}");
    // /debug/route shows each candidate's prediction, its parts and its rank's fit.
    let debug = debug_route(&r, &text(2000, 9999)).await;
    let (pa, pb) = (fitted(&debug, "a"), fitted(&debug, "b"));
    for p in [&pa, &pb] {
        let parts = p["queue_ms"].as_f64().unwrap() + p["prefill_ms"].as_f64().unwrap();
        assert!((parts - p["ttft_ms"].as_f64().unwrap()).abs() < 1e-6, "{p}");
        assert!(
            p["fitted"]["ttft_observations"].as_u64().unwrap() > 0,
            "{p}"
        );
    }
    assert!(
        pb["ttft_ms"].as_f64().unwrap() > pa["ttft_ms"].as_f64().unwrap(),
        "a {pa}, b {pb}"
    );
    assert!(pb["cost_ms"].as_f64().unwrap() > pa["cost_ms"].as_f64().unwrap());
    r.stop().await;
}

#[tokio::test]
async fn calibrated_prices_a_worker_made_slower_at_run_time_out_of_the_traffic() {
    let (a, b, r) = two_engines(CostModel::Calibrated).await;
    // Identical engines, each stream's 127 gaps feeding its rank's decode factor: both are
    // priced alike and share the streams.
    let mut warm: HashMap<String, usize> = HashMap::new();
    for i in 0..20 {
        *warm.entry(stream_tokens(&r, i, 128).await).or_default() += 1;
    }
    assert_eq!(
        warm.len(),
        2,
        "identical engines share the traffic: {warm:?}"
    );
    // b becomes 10 times slower than a. Its decode factor (a low quantile, rising 0.4% a
    // gap) passes a's within a few of its streams; from then on b costs more.
    let reply = post(&b.url(), "/speed", &[], r#"{"speedup": 0.4}"#).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let mut late: HashMap<String, usize> = HashMap::new();
    for i in 100..140 {
        let worker = stream_tokens(&r, i, 128).await;
        if i >= 120 {
            *late.entry(worker).or_default() += 1;
        }
    }
    let on_b = late.get("b").copied().unwrap_or(0);
    assert!(on_b <= 2, "the slow worker kept its share: {late:?}");
    let debug = debug_route(&r, &text(2000, 9999)).await;
    let (fa, fb) = (
        &fitted(&debug, "a")["fitted"],
        &fitted(&debug, "b")["fitted"],
    );
    assert!(
        fb["decode_factor"].as_f64().unwrap() > 1.2 * fa["decode_factor"].as_f64().unwrap(),
        "a {fa}, b {fb}"
    );
    drop(a);
    r.stop().await;
}
