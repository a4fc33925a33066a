//! Prefill/decode disaggregation against real HTTP engines that speak the two protocols:
//! what each half receives, what the client gets, pins, failures, counters.

mod support;

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Router;
use http::StatusCode;
use http_body_util::BodyExt;
use kvroute_core::PolicyKind;
use kvroute_gateway::config::{PdProtocol, WorkerRole};
use kvroute_gateway::{Settings, WorkerSpec};
use serde_json::{json, Value};
use support::*;
use tokio::net::TcpListener;

/// An engine that records every body it receives. A body asking for a remote decode gets a
/// one-token answer with `kv_transfer_params` naming this engine; others get an echo (or a
/// short SSE stream).
#[derive(Clone)]
struct Engine {
    name: String,
    url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
    fail: Arc<std::sync::atomic::AtomicU16>,
}

impl Engine {
    async fn start(name: &str) -> Engine {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let e = Engine {
            name: name.into(),
            url: format!("http://{}", listener.local_addr().unwrap()),
            bodies: Arc::default(),
            fail: Arc::default(),
        };
        let app = Router::new()
            .route("/health", axum::routing::get(|| async { "ok" }))
            .route(
                "/v1/models",
                axum::routing::get(|| async { axum::Json(json!({"data": [{"id": "m"}]})) }),
            )
            .fallback(engine_post)
            .with_state(e.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        e
    }

    fn spec(&self, role: WorkerRole) -> WorkerSpec {
        WorkerSpec {
            id: Some(self.name.clone()),
            model: Some("m".into()),
            role,
            bootstrap_port: (role == WorkerRole::Prefill).then_some(8998),
            ..WorkerSpec::url(self.url.clone())
        }
    }

    fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().clone()
    }
}

async fn engine_post(State(e): State<Engine>, req: Request) -> Response {
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let body: Value = serde_json::from_slice(&body).unwrap();
    e.bodies.lock().unwrap().push(body.clone());
    let fail = e.fail.load(std::sync::atomic::Ordering::SeqCst);
    if fail != 0 {
        return (
            StatusCode::from_u16(fail).unwrap(),
            axum::Json(json!({"error": {"message": format!("{} failed", e.name)}})),
        )
            .into_response();
    }
    if body["kv_transfer_params"]["do_remote_decode"] == true {
        return axum::Json(json!({
            "choices": [{"text": "x"}],
            "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": e.name, "remote_block_ids": [1, 2]},
        }))
        .into_response();
    }
    if body["stream"] == true {
        let chunks = format!(
            "data: {{\"from\":\"{}\"}}\n\ndata: {{\"from\":\"{}\"}}\n\ndata: [DONE]\n\n",
            e.name, e.name
        );
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from(chunks))
            .unwrap();
    }
    axum::Json(json!({"from": e.name})).into_response()
}

struct Cluster {
    prefill: Vec<Engine>,
    decode: Vec<Engine>,
    router: TestRouter,
}

async fn cluster(protocol: PdProtocol, tweak: impl FnOnce(&mut Settings)) -> Cluster {
    let prefill = vec![Engine::start("p0").await, Engine::start("p1").await];
    let decode = vec![Engine::start("d0").await, Engine::start("d1").await];
    let specs = prefill
        .iter()
        .map(|e| e.spec(WorkerRole::Prefill))
        .chain(decode.iter().map(|e| e.spec(WorkerRole::Decode)))
        .collect();
    let mut s = Settings::with_workers(specs).unwrap();
    let pd = s.pd.as_mut().expect("roles turn disaggregation on");
    pd.protocol = protocol;
    pd.prefill_policy = PolicyKind::RoundRobin;
    pd.decode_policy = PolicyKind::RoundRobin;
    tweak(&mut s);
    let router = TestRouter::start(s).await;
    Cluster {
        prefill,
        decode,
        router,
    }
}

const BODY: &str = r#"{"model":"m","prompt":"hello there","max_tokens":20}"#;

#[tokio::test]
async fn vllm_protocol_prefills_then_decodes_with_the_transfer_params() {
    let c = cluster(PdProtocol::Vllm, |_| {}).await;
    for _ in 0..4 {
        let r = c.router.complete(&[], BODY).await;
        assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
        let decode = r.worker().to_owned();
        let prefill = r.headers["x-kvroute-prefill-worker"]
            .to_str()
            .unwrap()
            .to_owned();
        assert_eq!(r.json()["from"], decode.as_str());
        // The decode engine got the original request plus the prefill's parameters.
        let d = c.decode.iter().find(|e| e.name == decode).unwrap();
        let got = d.bodies().pop().unwrap();
        assert_eq!(got["max_tokens"], 20);
        assert_eq!(
            got["kv_transfer_params"]["remote_engine_id"],
            prefill.as_str()
        );
        assert_eq!(got["kv_transfer_params"]["do_remote_prefill"], true);
    }
    // Each prefill engine got the prompt with one token, no stream, a remote decode.
    for p in &c.prefill {
        let bodies = p.bodies();
        assert_eq!(bodies.len(), 2, "round robin over the prefill workers");
        for b in bodies {
            assert_eq!(b["max_tokens"], 1);
            assert_eq!(b["stream"], false);
            assert_eq!(b["prompt"], "hello there");
            assert_eq!(b["kv_transfer_params"]["do_remote_decode"], true);
        }
    }
    for d in &c.decode {
        assert_eq!(d.bodies().len(), 2, "round robin over the decode workers");
    }
    let m = c.router.metrics().await;
    for (w, half) in [
        ("p0", "prefill"),
        ("p1", "prefill"),
        ("d0", "decode"),
        ("d1", "decode"),
    ] {
        let name = format!("kvroute_pd_{half}_requests_total");
        assert_metric(&m, &name, &format!("worker=\"{w}\""), Some(2.0));
    }
    assert_metric(
        &m,
        "kvroute_disagg_decision_total",
        "decision_type=\"prefill-decode\"",
        Some(4.0),
    );
    c.router.stop().await;
}

#[tokio::test]
async fn a_streamed_request_streams_from_the_decode_worker() {
    let c = cluster(PdProtocol::Vllm, |_| {}).await;
    let resp = open_stream(
        &c.router.url,
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}"#,
    )
    .await;
    assert_eq!(resp.status(), 200);
    let decode = resp.headers()["x-kvroute-worker"]
        .to_str()
        .unwrap()
        .to_owned();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains(&format!("\"from\":\"{decode}\"")) && text.contains("[DONE]"));
    let prefilled: Vec<Value> = c.prefill.iter().flat_map(|p| p.bodies()).collect();
    assert_eq!(prefilled.len(), 1);
    assert_eq!(prefilled[0]["stream"], false);
    assert!(prefilled[0].get("stream_options").is_none());
    let d = c.decode.iter().find(|e| e.name == decode).unwrap();
    assert_eq!(d.bodies()[0]["stream"], true);
    c.router.stop_idle().await;
}

#[tokio::test]
async fn a_failed_prefill_is_the_answer_and_no_decode_starts() {
    let c = cluster(PdProtocol::Vllm, |_| {}).await;
    for p in &c.prefill {
        p.fail.store(500, std::sync::atomic::Ordering::SeqCst);
    }
    let r = c.router.complete(&[], BODY).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(String::from_utf8_lossy(&r.body).contains("failed"));
    assert!(c.decode.iter().all(|d| d.bodies().is_empty()));
    wait_all_idle(&c.router).await;
    let m = c.router.metrics().await;
    // The failed half counts against its worker, as any attempt does (the circuit breaker
    // and the attempt metrics see disaggregated requests too).
    let failed: f64 = ["p0", "p1"]
        .iter()
        .filter_map(|p| {
            metric_value(
                &m,
                "kvroute_upstream_attempts_total",
                &format!("worker=\"{p}\",outcome=\"server_error\""),
            )
        })
        .sum();
    assert_eq!(failed, 1.0);
    c.router.stop().await;
}

#[tokio::test]
async fn hints_pin_each_half() {
    let c = cluster(PdProtocol::Vllm, |_| {}).await;
    for _ in 0..3 {
        let r = c
            .router
            .complete(
                &[
                    ("x-kvroute-prefill-worker", "p1"),
                    ("x-kvroute-worker", "d0"),
                ],
                BODY,
            )
            .await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.worker(), "d0");
        assert_eq!(r.headers["x-kvroute-prefill-worker"], "p1");
    }
    assert_eq!(c.prefill[1].bodies().len(), 3);
    assert!(c.prefill[0].bodies().is_empty());
    // A prefill pin that is not a prefill worker is refused.
    let r = c
        .router
        .complete(&[("x-kvroute-prefill-worker", "d1")], BODY)
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.body);
    c.router.stop().await;
}

#[tokio::test]
async fn sglang_protocol_sends_both_halves_the_same_bootstrap_room() {
    let c = cluster(PdProtocol::Sglang, |_| {}).await;
    let r = c
        .router
        .post("/generate", &[], r#"{"text":"hello","model":"m"}"#)
        .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let decode = r.worker().to_owned();
    assert_eq!(r.json()["from"], decode.as_str());
    let prefill = r.headers["x-kvroute-prefill-worker"]
        .to_str()
        .unwrap()
        .to_owned();
    let p = c.prefill.iter().find(|e| e.name == prefill).unwrap();
    let d = c.decode.iter().find(|e| e.name == decode).unwrap();
    wait_until("the prefill half arrived", || !p.bodies().is_empty()).await;
    let (pb, db) = (p.bodies()[0].clone(), d.bodies()[0].clone());
    assert_eq!(pb["bootstrap_room"], db["bootstrap_room"]);
    assert!(pb["bootstrap_room"].as_u64().is_some());
    assert_eq!(pb["bootstrap_host"], "127.0.0.1");
    assert_eq!(pb["bootstrap_port"], 8998);
    assert_eq!(db["text"], "hello");
    c.router.stop().await;
}

#[tokio::test]
async fn a_reload_keeps_the_prefill_and_decode_workers_of_the_command_line() {
    let (p, d, e, f) = (
        Engine::start("p").await,
        Engine::start("d").await,
        Engine::start("e").await,
        Engine::start("f").await,
    );
    let dir = std::env::temp_dir().join(format!("kvroute-pd-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.yaml");
    let file = |url: &str| format!("workers:\n  - url: {url}\n    role: decode\n");
    std::fs::write(&path, file(&e.url)).unwrap();
    // `--prefill P --decode D --config FILE`, the file naming one more decode worker.
    let settings = kvroute_gateway::Args {
        config: Some(path.clone()),
        prefill: vec![p.url.clone()],
        decode: vec![d.url.clone()],
        ..Default::default()
    }
    .load()
    .unwrap();
    let router = TestRouter::start(settings).await;
    let urls = || {
        let mut u: Vec<String> = router
            .gateway
            .workers()
            .workers()
            .iter()
            .map(|w| w.url.clone())
            .collect();
        u.sort();
        u
    };
    let mut all = vec![p.url.clone(), d.url.clone(), e.url.clone()];
    all.sort();
    assert_eq!(urls(), all);
    // An unchanged file changes nothing; a changed one swaps the file's worker only.
    assert_eq!(router.gateway.reload().unwrap(), (0, 0));
    assert_eq!(urls(), all);
    std::fs::write(&path, file(&f.url)).unwrap();
    assert_eq!(router.gateway.reload().unwrap(), (1, 1));
    let mut now = vec![p.url.clone(), d.url.clone(), f.url.clone()];
    now.sort();
    assert_eq!(urls(), now);
    // Any change to a worker's spec replaces it (here a field the engine scrape may not give).
    std::fs::write(&path, file(&f.url) + "    num_gpu_blocks: 100\n").unwrap();
    assert_eq!(router.gateway.reload().unwrap(), (1, 1));
    assert_eq!(urls(), now);
    let _ = std::fs::remove_dir_all(&dir);
}
