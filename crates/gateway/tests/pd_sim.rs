//! Prefill/decode disaggregation end to end: kvroute in front of kvroute-sim replicas with
//! `--role prefill` and `--role decode`, both protocols, streaming and not, the decode-only
//! decision, and a failing prefill half.

mod support;

use http_body_util::BodyExt;
use kvroute_gateway::config::PdProtocol;
use kvroute_gateway::{Settings, WorkerSpec};
use kvroute_sim::{FaultSettings, SimInstance};
use serde_json::{json, Value};
use support::*;

struct Engine {
    sim: SimInstance,
    id: String,
}

async fn engine(id: &str, role: &str, seed: u64) -> (Engine, WorkerSpec) {
    let (sim, spec) = pd_engine(id, role, "10", seed).await;
    (Engine { sim, id: id.into() }, spec)
}

async fn cluster(protocol: PdProtocol, min_uncached: u64) -> (Vec<Engine>, TestRouter) {
    let mut engines = Vec::new();
    let mut specs = Vec::new();
    for (i, (id, role)) in [
        ("p0", "prefill"),
        ("p1", "prefill"),
        ("d0", "decode"),
        ("d1", "decode"),
    ]
    .into_iter()
    .enumerate()
    {
        let (e, s) = engine(id, role, i as u64).await;
        engines.push(e);
        specs.push(s);
    }
    let mut settings = Settings::with_workers(specs).unwrap();
    let pd = settings.pd.as_mut().unwrap();
    pd.protocol = protocol;
    pd.min_uncached_tokens = min_uncached;
    let router = TestRouter::start(settings).await;
    (engines, router)
}

/// A counter of a sim's metrics, summed over its label sets matching `labels`.
async fn sim_metric(e: &Engine, name: &str, labels: &str) -> f64 {
    metric_sum(&scrape(&e.sim.url()).await, name, labels)
}

fn by_id<'a>(engines: &'a [Engine], id: &str) -> &'a Engine {
    engines.iter().find(|e| e.id == id).unwrap()
}

async fn check_both_halves(protocol: PdProtocol) {
    let (engines, r) = cluster(protocol, 0).await;
    let chat = |stream: bool| {
        json!({"model": "kvroute-sim", "messages": [{"role": "user", "content": text(300, 5)}],
               "max_tokens": 6, "stream": stream, "stream_options": {"include_usage": true}})
        .to_string()
    };
    // Not streamed.
    let reply = r.post("/v1/chat/completions", &[], &chat(false)).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let decode = reply.worker().to_owned();
    let prefill = reply.headers["x-kvroute-prefill-worker"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(decode.starts_with('d') && prefill.starts_with('p'));
    assert_eq!(reply.json()["usage"]["completion_tokens"], 6);
    wait_until_async("the transfer received", || async {
        sim_metric(
            by_id(&engines, &decode),
            "kvroute_sim_kv_transfers_total",
            "received",
        )
        .await
            == 1.0
    })
    .await;
    assert_eq!(
        sim_metric(
            by_id(&engines, &decode),
            "kvroute_sim_prefill_tokens_computed_total",
            ""
        )
        .await,
        0.0,
        "the decode engine received the prompt instead of computing it"
    );
    // Streamed.
    let resp = open_stream(&r.url, "/v1/chat/completions", &chat(true)).await;
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("[DONE]"), "{text}");
    let usage: Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v["usage"].is_object())
        .expect("a usage chunk");
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    let m = r.metrics().await;
    assert_eq!(metric_sum(&m, "kvroute_pd_prefill_requests_total", ""), 2.0);
    assert_eq!(metric_sum(&m, "kvroute_pd_decode_requests_total", ""), 2.0);
    r.stop_idle().await;
}

#[tokio::test]
async fn vllm_protocol_end_to_end() {
    check_both_halves(PdProtocol::Vllm).await;
}

#[tokio::test]
async fn sglang_protocol_end_to_end() {
    check_both_halves(PdProtocol::Sglang).await;
}

#[tokio::test]
async fn a_decode_worker_that_holds_the_prompt_skips_the_remote_prefill() {
    let (engines, r) = cluster(PdProtocol::Vllm, 64).await;
    let prompt = text(640, 9);
    let body = json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 2}).to_string();
    let first = r.complete(&[("x-kvroute-worker", "d0")], &body).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    // The decode engine stored the transferred blocks and published them: the router learns
    // that d0 holds the prompt.
    wait_overlap(&r, &prompt, "d0", |o| o.is_some_and(|o| o >= 39)).await;
    let again = r.complete(&[("x-kvroute-worker", "d0")], &body).await;
    assert_eq!(again.status, 200);
    assert!(again.headers.get("x-kvroute-prefill-worker").is_none());
    let m = r.metrics().await;
    assert_metric(
        &m,
        "kvroute_disagg_decision_total",
        "decision_type=\"decode-only\"",
        Some(1.0),
    );
    assert_metric(
        &m,
        "kvroute_disagg_decision_total",
        "decision_type=\"prefill-decode\"",
        Some(1.0),
    );
    let prefills = sim_metric(
        by_id(&engines, "p0"),
        "kvroute_sim_kv_transfers_total",
        "sent",
    )
    .await
        + sim_metric(
            by_id(&engines, "p1"),
            "kvroute_sim_kv_transfers_total",
            "sent",
        )
        .await;
    assert_eq!(prefills, 1.0);
    r.stop_idle().await;
}

#[tokio::test]
async fn a_failing_prefill_half_is_reported_and_leaves_nothing_in_flight() {
    let (engines, r) = cluster(PdProtocol::Vllm, 0).await;
    for id in ["p0", "p1"] {
        let f = by_id(&engines, id).sim.faults();
        f.set(FaultSettings {
            fail_rate: 1.0,
            fail_status: 503,
            ..f.settings()
        })
        .unwrap();
    }
    let body = json!({"model": "kvroute-sim", "prompt": "hello", "max_tokens": 2}).to_string();
    let reply = r.complete(&[], &body).await;
    assert_eq!(reply.status, 503, "{:?}", reply.body);
    for id in ["d0", "d1"] {
        assert_eq!(by_id(&engines, id).sim.faults().requests_accepted(), 0);
    }
    r.stop_idle().await;
}
