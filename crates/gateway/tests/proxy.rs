//! The gateway end to end: real workers, a real router, real sockets.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use http::{Method, StatusCode};
use http_body_util::BodyExt;
use kvroute_gateway::{Settings, WorkerSpec};
use support::*;

#[tokio::test]
async fn body_is_forwarded_as_received_with_request_id() {
    let w = MockWorker::start("w0", &["m"]).await;
    let r = TestRouter::start(settings(&[&w])).await;
    // Unknown fields, odd spacing and key order survive byte for byte.
    let body = r#"{ "zeta": [1, {"x": null}], "model":"m","messages":[{"role":"user","content":"hi"}] , "extra_body": {"a": 1}}"#;
    let reply = r
        .post("/v1/chat/completions", &[("x-request-id", "req-123")], body)
        .await;
    assert_eq!(reply.status, StatusCode::OK);
    let echo = reply.json();
    assert_eq!(echo["body"], body);
    assert_eq!(echo["path"], "/v1/chat/completions");
    assert_eq!(echo["request_id"], "req-123");
    assert_eq!(reply.headers["x-request-id"], "req-123");
    assert_eq!(reply.worker(), w.url);
    assert_eq!(reply.headers["x-mock-worker"], "w0");

    // Without an id the router makes one, forwards it and returns it.
    let reply = r.complete(&[], r#"{"model":"m","prompt":"x"}"#).await;
    let made = reply.headers["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(made.len(), 32);
    assert_eq!(reply.json()["request_id"], made);
    r.stop().await;
}

#[tokio::test]
async fn every_routed_path_is_forwarded_and_model_may_be_omitted() {
    let w = MockWorker::start("w0", &["only"]).await;
    let r = TestRouter::start(settings(&[&w])).await;
    for (path, body) in [
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"a"}]}"#,
        ),
        ("/v1/completions", r#"{"prompt":"a"}"#),
        (
            "/generate",
            r#"{"text":"a","sampling_params":{"max_new_tokens":2}}"#,
        ),
        ("/v1/embeddings", r#"{"model":"only","input":"a"}"#),
        ("/v1/responses", r#"{"model":"only","input":"a"}"#),
        ("/tokenize", r#"{"model":"only","prompt":"a"}"#),
        ("/detokenize", r#"{"model":"only","tokens":[1,2]}"#),
    ] {
        let reply = r.post(path, &[], body).await;
        assert_eq!(reply.status, StatusCode::OK, "{path}");
        assert_eq!(reply.json()["path"], path);
        assert_eq!(reply.worker(), w.url);
    }
    // Query strings are kept.
    let reply = r
        .post("/v1/completions?foo=bar", &[], r#"{"prompt":"a"}"#)
        .await;
    assert_eq!(reply.status, StatusCode::OK);
    r.stop().await;
}

#[tokio::test]
async fn models_are_the_union_and_pick_the_pool() {
    let a = MockWorker::start("a", &["llama", "llama-lora"]).await;
    let b = MockWorker::start("b", &["qwen"]).await;
    let c = MockWorker::start("c", &["llama"]).await;
    let r = TestRouter::start(settings(&[&a, &b, &c])).await;
    assert_eq!(r.model_ids().await, ["llama", "llama-lora", "qwen"]);

    for _ in 0..6 {
        let reply = r
            .post("/v1/chat/completions", &[], &chat("qwen", "x"))
            .await;
        assert_eq!(reply.worker(), b.url);
        let reply = r
            .post("/v1/chat/completions", &[], &chat("llama", "x"))
            .await;
        assert!(reply.worker() == a.url || reply.worker() == c.url);
        let reply = r
            .post("/v1/chat/completions", &[], &chat("llama-lora", "x"))
            .await;
        assert_eq!(reply.worker(), a.url);
    }
    // Several models: the model field is required.
    let reply = r.complete(&[], r#"{"prompt":"x"}"#).await;
    reply.assert_error(400, "model_required");
    let reply = r.complete(&[], r#"{"model":"gpt-9","prompt":"x"}"#).await;
    reply.assert_error(404, "model_not_found");
    assert_eq!(reply.json()["error"]["type"], "invalid_request_error");
    assert!(reply.headers.get("x-request-id").is_some());

    let v = r.get_json("/workers").await;
    let workers = v["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 3);
    assert_eq!(workers[0]["id"], a.url);
    assert_eq!(
        workers[0]["models"],
        serde_json::json!(["llama", "llama-lora"])
    );
    assert_eq!(workers[0]["healthy"], true);
    assert_eq!(workers[0]["in_flight"], 0);
    r.stop().await;
}

#[tokio::test]
async fn config_workers_have_ids_and_models() {
    let w = MockWorker::start("w", &["served-name"]).await;
    let s = Settings::with_workers(vec![named_spec("gpu-0", "alias", w.url.clone())]).unwrap();
    let r = TestRouter::start(s).await;
    let reply = r.complete(&[], r#"{"model":"alias","prompt":"x"}"#).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.worker(), "gpu-0");
    let reply = r
        .complete(&[], r#"{"model":"served-name","prompt":"x"}"#)
        .await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
    r.stop().await;
}

#[tokio::test]
async fn health_and_readiness() {
    let w = MockWorker::start("w", &["m"]).await;
    let dead = closed_url().await;
    let mut s = settings(&[&w]);
    s.workers.push(named_spec("dead", "other", dead));
    let r = TestRouter::start_unready(s).await;
    let (status, _, _) = r.get("/health").await;
    assert_eq!(status, StatusCode::OK);
    // The dead worker is probed (and fails): model "other" has no healthy worker.
    let gw = r.gateway.clone();
    wait_until("both workers probed", || {
        gw.workers().statuses().iter().all(|w| w.probed)
    })
    .await;
    let (status, _, body) = r.get("/readiness").await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        String::from_utf8_lossy(&body)
    );
    // Its model is known but has no healthy worker: 503 no_endpoint.
    let reply = r.complete(&[], r#"{"model":"other","prompt":"x"}"#).await;
    reply.assert_error(503, "no_endpoint");
    assert_eq!(reply.json()["error"]["type"], "server_error");
    // The healthy model still serves.
    let reply = r.complete(&[], r#"{"model":"m","prompt":"x"}"#).await;
    assert_eq!(reply.status, StatusCode::OK);
    r.stop().await;

    let r = TestRouter::start(settings(&[&w])).await;
    let (status, _, _) = r.get("/readiness").await;
    assert_eq!(status, StatusCode::OK);
    r.stop().await;
}

#[tokio::test]
async fn malformed_and_oversized_requests_are_rejected() {
    let w = MockWorker::start("w", &["m"]).await;
    let mut s = settings(&[&w]);
    s.max_payload_size = 1024;
    let r = TestRouter::start(s).await;
    for bad in ["{", "[1,2]", r#"{"model": 5}"#, r#"{"messages": "hi"}"#, ""] {
        let reply = r.post("/v1/chat/completions", &[], bad).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(reply.error_code(), "invalid_json", "{bad}");
        assert!(reply.headers.get("x-kvroute-worker").is_none());
    }
    let big = chat("m", &"x".repeat(2000));
    let reply = r.post("/v1/chat/completions", &[], &big).await;
    reply.assert_error(413, "payload_too_large");
    // Unknown paths: a JSON 404.
    let reply = send(&r.url, Method::GET, "/v2/nothing", &[], "").await;
    reply.assert_error(404, "not_found");
    assert_eq!(
        w.requests.load(Ordering::SeqCst),
        0,
        "nothing bad reached the worker"
    );
    // The router is unharmed.
    let reply = r.post("/v1/chat/completions", &[], &chat("m", "ok")).await;
    assert_eq!(reply.status, StatusCode::OK);
    r.stop().await;
}

#[tokio::test]
async fn upstream_failure_is_502_and_timeout_is_504() {
    let broken = broken_worker("m").await;
    let r = TestRouter::start(
        Settings::with_workers(vec![WorkerSpec {
            id: None,
            model: None,
            ..WorkerSpec::url(broken.clone())
        }])
        .unwrap(),
    )
    .await;
    let reply = r.complete(&[], r#"{"model":"m","prompt":"x"}"#).await;
    reply.assert_error(502, "upstream_error");
    assert_eq!(reply.worker(), broken);
    assert_eq!(in_flight(&r, &broken), 0);
    r.stop().await;

    let w = MockWorker::start("w", &["m"]).await;
    let mut s = settings(&[&w]);
    s.request_timeout = Duration::from_millis(300);
    let r = TestRouter::start(s).await;
    let reply = r.complete(&[], r#"{"model":"m","prompt":"hang"}"#).await;
    reply.assert_error(504, "upstream_timeout");
    assert_eq!(reply.worker(), w.url);
    assert_eq!(in_flight(&r, &w.url), 0);
    let m = r.metrics().await;
    assert_metric(&m, "kvroute_requests_total", r#"status="504""#, Some(1.0));
    r.stop().await;
}

#[tokio::test]
async fn streams_pass_through_chunk_by_chunk() {
    let w = MockWorker::start("w", &["m"]).await;
    let r = TestRouter::start(settings(&[&w])).await;
    let body =
        r#"{"model":"m","stream":true,"max_tokens":3,"messages":[{"role":"user","content":"s"}]}"#;
    let resp = open_stream(&r.url, "/v1/chat/completions", body).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert_eq!(resp.headers()["x-kvroute-worker"], w.url.as_str());
    let mut body = resp.into_body();
    // The worker holds the rest of the stream until released: the first chunk can only
    // arrive here if the router forwards it without waiting for the end.
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(
        first.starts_with(b"data: {\"worker\":\"w\",\"chunk\":0}"),
        "{first:?}"
    );
    assert_eq!(in_flight(&r, &w.url), 1);
    let m = r.metrics().await;
    assert_metric(&m, "kvroute_worker_requests_active", &w.url, Some(1.0));
    w.release.add_permits(1);
    let mut rest = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            rest.extend_from_slice(&data);
        }
    }
    let rest = String::from_utf8(rest).unwrap();
    assert_eq!(
        rest,
        "data: {\"chunk\":1}\n\ndata: {\"chunk\":2}\n\ndata: {\"chunk\":3}\n\ndata: [DONE]\n\n"
    );
    wait_idle(&r, &w.url).await;
    r.stop().await;
}

#[tokio::test]
async fn in_flight_returns_to_zero_when_the_client_drops_a_stream() {
    let w = MockWorker::start("w", &["m"]).await;
    let r = TestRouter::start(settings(&[&w])).await;
    // A long stream: 100000 chunks after release, so only the disconnect can end it.
    let body = r#"{"model":"m","stream":true,"max_tokens":100000,"prompt":"s"}"#;
    let resp = open_stream(&r.url, "/v1/completions", body).await;
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    assert_eq!(in_flight(&r, &w.url), 1);
    w.release.add_permits(1);
    body.frame().await.unwrap().unwrap();
    drop(body);
    wait_idle(&r, &w.url).await;
    let streams = w.streams_open.clone();
    wait_until("the worker's stream closed", || {
        streams.load(Ordering::SeqCst) == 0
    })
    .await;
    let m = r.metrics().await;
    assert_metric(&m, "kvroute_worker_requests_active", &w.url, Some(0.0));
    r.stop().await;
}

#[tokio::test]
async fn metrics_count_requests_decisions_and_routing_time() {
    let a = MockWorker::start("a", &["m"]).await;
    let b = MockWorker::start("b", &["m"]).await;
    let r = TestRouter::start(settings(&[&a, &b])).await;
    for i in 0..4 {
        r.post("/v1/chat/completions", &[], &chat("m", &format!("{i}")))
            .await;
    }
    r.post("/v1/chat/completions", &[], "{").await;
    let m = r.metrics().await;
    let route = r#"route="/v1/chat/completions""#;
    assert_metric(
        &m,
        "kvroute_requests_total",
        &format!(r#"{route},status="200""#),
        Some(4.0),
    );
    assert_metric(
        &m,
        "kvroute_requests_total",
        &format!(r#"{route},status="400""#),
        Some(1.0),
    );
    for w in [&a, &b] {
        let worker = format!(r#"worker="{}""#, w.url);
        assert_metric(&m, "kvroute_processed_requests_total", &worker, Some(2.0));
        assert_metric(
            &m,
            "kvroute_policy_decisions_total",
            &format!(r#"policy="round_robin",{worker}"#),
            Some(2.0),
        );
        assert_metric(&m, "kvroute_worker_requests_active", &worker, Some(0.0));
    }
    assert_metric(&m, "kvroute_routing_seconds_count", "", Some(4.0));
    r.stop().await;
}
