//! Fault injection over real sockets: failed requests, stalls, crashes and restarts on the
//! same ports, and KV events withheld then resumed with a gap in their sequence numbers.
//!
//! No assertion depends on timing except as a generous bound: a stall is asserted by a
//! client timeout far shorter than the stall, waits poll a condition until a deadline.

mod support;

use std::time::Duration;

use http_body_util::BodyExt;
use kvroute_protocol::kv_events::{decode_batch, decode_seq, KvEvent};
use kvroute_sim::{Crashed, FaultSettings};
use serde_json::{json, Value};
use support::{
    client, completion, get, metric, metrics, one_block_completions, post, post_json, prompt_of,
    start, start_publishing, subscribe, wait_until, PATIENCE,
};
use tokio::time::timeout;
use zeromq::SocketRecv;

async fn faults_injected(url: &str, kind: &str) -> f64 {
    metric(
        &metrics(url).await,
        "kvroute_sim_faults_injected_total",
        &[&format!(r#"kind="{kind}""#)],
    )
}

#[tokio::test]
async fn fail_rate_one_answers_every_inference_request_with_the_status() {
    let sim = start(&["--fail-rate", "1", "--fail-status", "500"]).await;
    let url = sim.url();
    let (status, body) = post_json(&url, "/v1/completions", &completion("hi", 4, false)).await;
    assert_eq!(status, 500);
    assert_eq!(body["error"]["type"], "InternalServerError", "{body}");
    assert_eq!(body["error"]["code"], 500);
    assert!(body["error"]["message"].as_str().unwrap().contains("fault"));
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true});
    let (status, body) = post_json(&url, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 500, "streams fail before they start: {body}");
    // Never the health, metrics, models or admin endpoints.
    assert_eq!(get(&url, "/health").await.0, 200);
    assert_eq!(get(&url, "/v1/models").await.0, 200);
    assert_eq!(faults_injected(&url, "error_status").await, 2.0);
    assert_eq!(faults_injected(&url, "stall").await, 0.0);

    // Changed at runtime: 503 by default, then no failure at all.
    let (status, set) = post_json(&url, "/fault", &json!({"fail_status": 503})).await;
    assert_eq!(status, 200, "{set}");
    assert_eq!(
        (set["fail_rate"].as_f64(), set["fail_status"].as_u64()),
        (Some(1.0), Some(503))
    );
    let (status, body) = post_json(&url, "/v1/completions", &completion("hi", 4, false)).await;
    assert_eq!(
        (status, body["error"]["type"].as_str()),
        (503, Some("ServiceUnavailableError"))
    );
    post_json(&url, "/fault", &json!({"fail_rate": 0.0})).await;
    let (status, body) = post_json(&url, "/v1/completions", &completion("hi", 4, false)).await;
    assert_eq!(status, 200, "{body}");
    let (status, text) = get(&url, "/fault").await;
    let now: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_value::<FaultSettings>(json!({
            "fail_rate": now["fail_rate"], "fail_status": now["fail_status"],
            "stall_ms": now["stall_ms"], "crash_after_requests": now["crash_after_requests"],
            "drop_kv_events": now["drop_kv_events"],
        }))
        .unwrap(),
        sim.faults().settings()
    );
    assert_eq!(now["requests_accepted"], 1);
    // A bad setting is refused and changes nothing.
    let (status, body) = post_json(&url, "/fault", &json!({"fail_rate": 3})).await;
    assert_eq!(status, 400, "{body}");
    let (status, _) = post_json(&url, "/fault", &json!({"fail_sometimes": true})).await;
    assert_eq!(status, 400);
    assert_eq!(sim.faults().settings().fail_rate, 0.0);
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn a_stall_holds_back_the_headers_until_it_is_lifted() {
    let sim = start(&["--stall-ms", "60000"]).await;
    let url = sim.url();
    let stalled = client().request(post(&url, "/v1/completions", &completion("hi", 2, true)));
    assert!(
        timeout(Duration::from_millis(500), stalled).await.is_err(),
        "no headers within 0.5 s of a 60 s stall"
    );
    // Only inference requests stall.
    assert_eq!(get(&url, "/health").await.0, 200);
    assert_eq!(faults_injected(&url, "stall").await, 1.0);
    let (status, _) = post_json(&url, "/fault", &json!({"stall_ms": 0})).await;
    assert_eq!(status, 200);
    let (status, body) = post_json(&url, "/v1/completions", &completion("hi", 2, false)).await;
    assert_eq!(status, 200, "{body}");
    // The stalled request does not hold the shutdown back.
    timeout(PATIENCE, sim.stop()).await.expect("stops").unwrap();
}

/// Reads a response body to its end: the bytes, and whether it ended with an error
/// (the connection cut) rather than cleanly.
async fn read_body(mut body: axum::body::Body) -> (String, bool) {
    let mut text = String::new();
    loop {
        match timeout(PATIENCE, body.frame())
            .await
            .expect("the stream moves")
        {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    text.push_str(std::str::from_utf8(&data).unwrap());
                }
            }
            Some(Err(_)) => return (text, true),
            None => return (text, false),
        }
    }
}

#[tokio::test]
async fn crash_after_requests_cuts_every_stream_and_closes_the_port() {
    let mut sim = start(&["--crash-after-requests", "2", "--speedup", "1"]).await;
    let url = sim.url();
    // The first request streams (slowly: it would take minutes) on its own connection.
    let long = client()
        .request(post(
            &url,
            "/v1/completions",
            &completion(&prompt_of(40, 1), 100_000, true),
        ))
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    let mut long = long.into_body();
    let first = timeout(PATIENCE, long.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(first.into_data().unwrap().starts_with(b"data: "));
    assert!(!sim.faults().is_crashed());
    // The second is the last: cut after its first token, with no [DONE].
    let chat = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1000, "stream": true});
    let last = client()
        .request(post(&url, "/v1/chat/completions", &chat))
        .await
        .unwrap();
    assert_eq!(last.status(), 200);
    let (text, cut) = read_body(axum::body::Body::new(last.into_body())).await;
    assert!(cut, "the stream ends with an error, not cleanly: {text}");
    let chunks: Vec<Value> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    assert!(chunks.len() >= 2, "the role and at least one token: {text}");
    assert!(
        chunks[1]["choices"][0]["delta"]["content"].is_string(),
        "{text}"
    );
    assert!(chunks
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));
    assert!(!text.contains("[DONE]"));
    // The other stream is cut too.
    let (rest, cut) = read_body(axum::body::Body::new(long)).await;
    assert!(cut && !rest.contains("[DONE]"), "{rest}");
    // The engine ends; its port refuses connections.
    let ended = timeout(PATIENCE, sim.wait()).await.expect("ends");
    assert!(ended.unwrap_err().is::<Crashed>());
    let refused = tokio::net::TcpStream::connect(sim.addr())
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);

    // Restarted on the same port without the fault, it serves again.
    let mut healthy = sim.args().clone();
    healthy.faults.crash_after_requests = None;
    let sim = sim.restart_with(healthy).await.unwrap();
    assert_eq!(sim.url(), url);
    let (status, body) = post_json(&url, "/v1/completions", &completion("again", 3, false)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(get(&url, "/health").await.0, 200);
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn a_non_streaming_last_request_gets_no_answer() {
    let mut sim = start(&["--crash-after-requests", "1"]).await;
    let url = sim.url();
    let answer = timeout(
        PATIENCE,
        client().request(post(&url, "/v1/completions", &completion("hi", 8, false))),
    )
    .await
    .expect("the connection closes");
    assert!(answer.is_err(), "{answer:?}");
    assert!(timeout(PATIENCE, sim.wait())
        .await
        .unwrap()
        .unwrap_err()
        .is::<Crashed>());
}

/// Sends a request with `prompt` (one full block) and reads messages until its block is
/// stored; returns that message's sequence number and the sequence numbers seen before it.
async fn mark(sub: &mut zeromq::SubSocket, url: &str, prompt: &str) -> (u64, Vec<u64>) {
    let (status, _) = post_json(url, "/v1/completions", &completion(prompt, 1, false)).await;
    assert_eq!(status, 200);
    let block: Vec<u32> = prompt.bytes().take(16).map(u32::from).collect();
    let mut before = Vec::new();
    loop {
        let msg = timeout(PATIENCE, sub.recv())
            .await
            .expect("events")
            .unwrap();
        let frames = msg.into_vec();
        let seq = decode_seq(&frames[1]).unwrap().unwrap();
        let batch = decode_batch(&frames[2]).unwrap();
        let stored = batch.events.iter().any(|e| match e {
            KvEvent::BlockStored(s) => s.token_ids == block,
            _ => false,
        });
        if stored {
            return (seq, before);
        }
        before.push(seq);
    }
}

#[tokio::test]
async fn dropped_kv_events_leave_a_gap_in_the_sequence() {
    let (sim, endpoint) = start_publishing(&[]).await;
    let url = sim.url();
    let mut sub = subscribe(&endpoint, &url, 0).await;
    let (before, _) = mark(&mut sub, &url, &prompt_of(20, 500)).await;
    let (status, set) = post_json(&url, "/fault", &json!({"drop_kv_events": true})).await;
    assert_eq!((status, set["drop_kv_events"].as_bool()), (200, Some(true)));
    // Three requests, one stored block (one message) each, all withheld.
    one_block_completions(&url, 600..603).await;
    wait_until("the messages are withheld", || async {
        faults_injected(&url, "kv_events_dropped").await >= 3.0
    })
    .await;
    sim.faults()
        .set(FaultSettings {
            drop_kv_events: false,
            ..sim.faults().settings()
        })
        .unwrap();
    let (after, between) = mark(&mut sub, &url, &prompt_of(20, 700)).await;
    assert!(
        between.is_empty(),
        "nothing published while dropped: {between:?}"
    );
    assert_eq!(
        after,
        before + 1 + 3,
        "the subscriber sees a gap of the 3 withheld"
    );
    assert_eq!(faults_injected(&url, "kv_events_dropped").await, 3.0);
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn a_crashed_engine_restarts_on_the_same_ports_with_an_empty_cache() {
    let (sim, endpoint) = start_publishing(&[]).await;
    let url = sim.url();
    let mut sub = subscribe(&endpoint, &url, 0).await;
    let prompt = prompt_of(64, 3);
    post_json(&url, "/v1/completions", &completion(&prompt, 1, false)).await;
    let (_, body) = post_json(&url, "/v1/completions", &completion(&prompt, 1, false)).await;
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 48);
    // Enough messages that the restarted engine's sequence cannot have caught up below.
    one_block_completions(&url, 1000..1100).await;
    let (last_seq, _) = mark(&mut sub, &url, &prompt_of(20, 2000)).await;
    assert!(last_seq > 100);

    sim.crash();
    let sim = timeout(PATIENCE, sim.restart())
        .await
        .expect("restarts")
        .unwrap();
    assert_eq!(sim.url(), url);
    assert_eq!(
        sim.args().kv_events_endpoint.as_deref(),
        Some(endpoint.as_str())
    );
    // The old subscriber's connection closed; a new one hears the new engine, numbered
    // from 0 again (at most one message per probe so far, at most 200 probes).
    let mut sub = subscribe(&endpoint, &url, 5000).await;
    let (seq, _) = mark(&mut sub, &url, &prompt_of(20, 6000)).await;
    assert!(seq <= 201 && seq < last_seq, "{seq} after {last_seq}");
    let (_, body) = post_json(&url, "/v1/completions", &completion(&prompt, 1, false)).await;
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "empty cache"
    );
    let (_, body) = post_json(&url, "/v1/completions", &completion(&prompt, 1, false)).await;
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 48);
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn the_speed_changes_at_run_time_and_bad_values_are_refused() {
    let sim = start(&[]).await;
    let url = sim.url();
    let (status, body) = post_json(&url, "/speed", &json!({"speedup": 0.5})).await;
    assert_eq!(
        (status, body["speedup"].as_f64()),
        (200, Some(0.5)),
        "{body}"
    );
    let (status, body) = post_json(&url, "/v1/completions", &completion("hi", 2, false)).await;
    assert_eq!(status, 200, "{body}");
    for bad in [
        json!({"speedup": 0}),
        json!({"speedup": -1.0}),
        json!({"speed": 2}),
    ] {
        let (status, body) = post_json(&url, "/speed", &bad).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let (_, body) = post_json(&url, "/speed", &json!({"speedup": 0})).await;
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("speedup must be a finite number > 0"));
}
