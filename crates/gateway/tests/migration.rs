//! Migration: a stream whose engine dies goes on from another, and the client's stream is
//! whole. Real kvroute-sim engines crashed mid-stream, and scripted engines for the error
//! events and cut bodies the sim does not produce.

mod support;

use std::time::Duration;

use http_body_util::BodyExt;
use kvroute_core::PolicyKind;
use kvroute_gateway::config::PdProtocol;
use kvroute_gateway::{Settings, WorkerSpec};
use kvroute_sim::{SimArgs, SimInstance};
use serde_json::{json, Value};
use support::*;
use tokio::net::TcpListener;

async fn sims(n: u64) -> Vec<SimInstance> {
    sims_at(n, 1.0).await
}

/// `n` engines whose simulated time runs `speedup` times as fast as real time (below 1: slower).
async fn sims_at(n: u64, speedup: f64) -> Vec<SimInstance> {
    let mut out = Vec::new();
    for seed in 0..n {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let args = SimArgs {
            seed,
            speedup,
            ..SimArgs::default()
        };
        let tokenizer = std::sync::Arc::new(kvroute_tokenizer::Tokenizer::fallback());
        out.push(SimInstance::start(args, tokenizer, listener).await.unwrap());
    }
    out
}

fn router_settings(urls: Vec<String>, tweak: impl FnOnce(&mut Settings)) -> Settings {
    let specs = urls.into_iter().map(WorkerSpec::url).collect();
    let mut s = Settings::with_workers(specs).unwrap();
    s.policy = PolicyKind::RoundRobin;
    s.retry.initial_backoff = Duration::from_millis(1);
    tweak(&mut s);
    s
}

/// The `data:` events of an SSE body, `[DONE]` as the string.
fn events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or(Value::String(d.to_owned())))
        .collect()
}

/// The text of a stream's chunks (a completion's `text`, a chat's `delta.content`), and how
/// many carried some.
fn completion_text(events: &[Value]) -> (String, usize) {
    let mut text = String::new();
    let mut chunks = 0;
    for e in events {
        let choice = &e["choices"][0];
        let t = choice["text"]
            .as_str()
            .or(choice["delta"]["content"].as_str());
        if let Some(t) = t.filter(|t| !t.is_empty()) {
            text.push_str(t);
            chunks += 1;
        }
    }
    (text, chunks)
}

/// How many chunks of a stream carried text.
fn text_chunks(seen: &str) -> usize {
    completion_text(&events(seen)).1
}

/// Reads `body` into `seen` until `want` text chunks arrived.
async fn read(body: &mut hyper::body::Incoming, want: usize, seen: &mut String) {
    while text_chunks(seen) < want {
        let frame = body.frame().await.expect("a frame").expect("no error");
        if let Ok(data) = frame.into_data() {
            seen.push_str(&String::from_utf8_lossy(&data));
        }
    }
}

/// Reads `body` until `chunks` text chunks arrived; what was read.
async fn read_until(body: &mut hyper::body::Incoming, chunks: usize) -> String {
    let mut seen = String::new();
    read(body, chunks, &mut seen).await;
    seen
}

/// `n` engines slowed tenfold (each stream is still going when its engine is killed), behind
/// a round-robin router.
async fn slow_cluster(n: u64) -> (Vec<SimInstance>, TestRouter) {
    let sims = sims_at(n, 0.1).await;
    let urls = sims.iter().map(|s| s.url()).collect();
    let r = TestRouter::start(router_settings(urls, |_| {})).await;
    (sims, r)
}

fn migrations(m: &str, outcome: &str) -> f64 {
    metric_value(
        m,
        "kvroute_request_migrations_total",
        &format!("outcome=\"{outcome}\""),
    )
    .unwrap_or(0.0)
}

/// The sim that served the stream (by the router's header), and the others.
fn split<'a>(sims: &'a [SimInstance], worker: &str) -> (&'a SimInstance, Vec<&'a SimInstance>) {
    let victim = sims
        .iter()
        .find(|s| s.url() == worker)
        .expect("a sim served it");
    (victim, sims.iter().filter(|s| s.url() != worker).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_mid_stream_is_migrated_and_the_stream_is_whole() {
    let (sims, r) = slow_cluster(2).await;
    let body = json!({"model": "kvroute-sim", "prompt": text(200, 1), "max_tokens": 24,
                      "stream": true, "stream_options": {"include_usage": true}})
    .to_string();
    let resp = open_stream(&r.url, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let (victim, others) = split(&sims, resp.headers()["x-kvroute-worker"].to_str().unwrap());
    let before = others[0].faults().requests_accepted();
    let mut body = resp.into_body();
    let mut seen = read_until(&mut body, 3).await;
    victim.crash();
    let rest = body
        .collect()
        .await
        .expect("the stream ends cleanly")
        .to_bytes();
    seen.push_str(&String::from_utf8_lossy(&rest));
    let events = events(&seen);
    assert_eq!(
        events.last(),
        Some(&Value::String("[DONE]".into())),
        "{seen}"
    );
    assert!(!seen.contains("\"error\""), "{seen}");
    // Every token asked for, once: the continuation asked for what was left.
    assert_eq!(completion_text(&events).1, 24, "{seen}");
    let ids: std::collections::BTreeSet<&str> =
        events.iter().filter_map(|e| e["id"].as_str()).collect();
    assert_eq!(ids.len(), 1, "one id for the whole stream: {ids:?}");
    let usage = events
        .iter()
        .find(|e| e["usage"].is_object())
        .expect("the usage asked for");
    assert_eq!(usage["usage"]["completion_tokens"], 24);
    assert_eq!(
        others[0].faults().requests_accepted(),
        before + 1,
        "the continuation"
    );
    let m = r.metrics().await;
    assert_eq!(migrations(&m, "migrated"), 1.0);
    r.stop_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_killed_in_turn_and_the_second_migration_works_too() {
    let (sims, r) = slow_cluster(3).await;
    let body =
        json!({"model": "kvroute-sim", "messages": [{"role": "user", "content": text(100, 2)}],
                      "max_tokens": 40, "stream": true})
        .to_string();
    let resp = open_stream(&r.url, "/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    let (first, _) = split(&sims, resp.headers()["x-kvroute-worker"].to_str().unwrap());
    let mut body = resp.into_body();
    let mut seen = String::new();
    read(&mut body, 3, &mut seen).await;
    first.crash();
    // The continuation streams from one of the two others: kill it too.
    read(&mut body, 8, &mut seen).await;
    let first_url = first.url();
    let serving = |gw: &kvroute_gateway::Gateway| {
        gw.workers()
            .statuses()
            .into_iter()
            .find(|w| w.url != first_url && w.in_flight == 1)
    };
    let gw = r.gateway.clone();
    wait_until("the stream moved", || serving(&gw).is_some()).await;
    let second_url = serving(&r.gateway).unwrap().url;
    split(&sims, &second_url).0.crash();
    let rest = body.collect().await.unwrap().to_bytes();
    seen.push_str(&String::from_utf8_lossy(&rest));
    assert!(seen.trim_end().ends_with("data: [DONE]"), "{seen}");
    assert!(!seen.contains("\"error\""), "{seen}");
    assert_eq!(text_chunks(&seen), 40, "{seen}");
    let m = r.metrics().await;
    assert_eq!(migrations(&m, "migrated"), 2.0);
    r.stop_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_logprobs_is_not_migrated_and_says_so() {
    let (sims, r) = slow_cluster(2).await;
    let body = json!({"model": "kvroute-sim", "prompt": text(100, 3), "max_tokens": 40,
                      "stream": true, "logprobs": 1})
    .to_string();
    let resp = open_stream(&r.url, "/v1/completions", &body).await;
    let (victim, others) = split(&sims, resp.headers()["x-kvroute-worker"].to_str().unwrap());
    let before = others[0].faults().requests_accepted();
    let mut body = resp.into_body();
    let mut seen = read_until(&mut body, 2).await;
    victim.crash();
    seen.push_str(&String::from_utf8_lossy(
        &body.collect().await.unwrap().to_bytes(),
    ));
    assert!(seen.contains("\"code\":\"upstream_error\""), "{seen}");
    assert!(seen.contains("not migrated: logprobs requested"), "{seen}");
    assert!(!seen.contains("[DONE]"), "{seen}");
    assert_eq!(others[0].faults().requests_accepted(), before);
    assert_eq!(migrations(&r.metrics().await, "not_migratable"), 1.0);
    r.stop_idle().await;
}

const SSE_HEAD: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_5xx_error_event_is_migrated_and_a_4xx_one_passed_through() {
    const DIED: &str = concat!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
        "data: {\"id\":\"cmpl-1\",\"created\":1,\"model\":\"kvroute-sim\",\"choices\":[{\"index\":0,\"text\":\"ab\"}]}\n\n",
        "data: {\"error\":{\"object\":\"error\",\"message\":\"EngineDeadError\",\"type\":\"InternalServerError\",\"code\":500}}\n\n",
        "data: [DONE]\n\n"
    );
    const REFUSED: &str = concat!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
        "data: {\"error\":{\"object\":\"error\",\"message\":\"bad stop\",\"type\":\"BadRequestError\",\"code\":400}}\n\n",
        "data: [DONE]\n\n"
    );
    let _ = SSE_HEAD;
    let sims = sims(1).await;
    for (script, migrated) in [(DIED, true), (REFUSED, false)] {
        let engine = scripted(script).await;
        let r =
            TestRouter::start(router_settings(vec![engine.clone(), sims[0].url()], |_| {})).await;
        let body = json!({"model": "kvroute-sim", "prompt": "x", "max_tokens": 5, "stream": true})
            .to_string();
        // Round robin: one of two requests lands on the scripted engine.
        let mut found = false;
        for _ in 0..2 {
            let resp = open_stream(&r.url, "/v1/completions", &body).await;
            let on_script = resp.headers()["x-kvroute-worker"] == engine.as_str();
            let text =
                String::from_utf8_lossy(&resp.into_body().collect().await.unwrap().to_bytes())
                    .into_owned();
            if !on_script {
                continue;
            }
            found = true;
            assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
            if migrated {
                assert!(!text.contains("error"), "{text}");
                let (delivered, chunks) = completion_text(&events(&text));
                assert!(delivered.starts_with("ab"), "{delivered}");
                assert_eq!(chunks, 1 + 4, "ab, then the 4 tokens left: {text}");
            } else {
                assert!(text.contains("\"code\":400"), "{text}");
            }
            break;
        }
        assert!(found);
        let m = r.metrics().await;
        assert_eq!(migrations(&m, "migrated"), if migrated { 1.0 } else { 0.0 });
        r.stop_idle().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streaming_answer_cut_mid_way_is_retried_whole() {
    const CUT: &str = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 400\r\nconnection: close\r\n\r\n{\"id\":\"cmpl-1\",\"choi";
    let engine = scripted(CUT).await;
    let sims = sims(1).await;
    let r = TestRouter::start(router_settings(vec![engine.clone(), sims[0].url()], |_| {})).await;
    for i in 0..4 {
        let reply = r
            .complete(
                &[],
                &json!({"model": "kvroute-sim", "prompt": format!("p{i}"), "max_tokens": 2})
                    .to_string(),
            )
            .await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        assert_eq!(reply.json()["usage"]["completion_tokens"], 2);
    }
    r.stop_idle().await;
}

/// A kvroute-sim with a P/D role (`prefill` or `decode`), slowed down, as a worker spec.
async fn pd_engine(role: &str, seed: u64) -> (SimInstance, WorkerSpec) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let bootstrap = free_port().to_string();
    let mut argv = vec!["kvroute-sim", "--role", role, "--speedup", "0.1"];
    if role == "prefill" {
        argv.extend(["--bootstrap-port", &bootstrap]);
    }
    let args = SimArgs {
        seed,
        ..<SimArgs as clap::Parser>::parse_from(argv)
    };
    let tokenizer = std::sync::Arc::new(kvroute_tokenizer::Tokenizer::fallback());
    let sim = SimInstance::start(args, tokenizer, listener).await.unwrap();
    let spec = WorkerSpec {
        bootstrap_port: sim.args().bootstrap_port,
        role: if role == "prefill" {
            kvroute_gateway::config::WorkerRole::Prefill
        } else {
            kvroute_gateway::config::WorkerRole::Decode
        },
        ..WorkerSpec::url(sim.url())
    };
    (sim, spec)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_half_killed_mid_stream_goes_on_from_a_new_pair() {
    let (p0, s0) = pd_engine("prefill", 0).await;
    let (d0, s1) = pd_engine("decode", 1).await;
    let (d1, s2) = pd_engine("decode", 2).await;
    let mut s = Settings::with_workers(vec![s0, s1, s2]).unwrap();
    s.retry.initial_backoff = Duration::from_millis(1);
    let r = TestRouter::start(s).await;
    // Both halves healthy first: ready needs one healthy worker a pool, and a slowed engine's
    // first probe can fail under a loaded test run (seen once: a 503 here).
    for engine in [&p0, &d0, &d1] {
        r.wait_healthy(engine.url().as_str()).await;
    }
    let body =
        json!({"model": "kvroute-sim", "prompt": text(200, 4), "max_tokens": 24, "stream": true})
            .to_string();
    let resp = open_stream(&r.url, "/v1/completions", &body).await;
    if resp.status() != 200 {
        let status = resp.status();
        let text = resp.into_body().collect().await.unwrap().to_bytes();
        panic!("{status}: {}", String::from_utf8_lossy(&text));
    }
    assert_eq!(
        resp.headers()["x-kvroute-prefill-worker"],
        p0.url().as_str()
    );
    let decoder = resp.headers()["x-kvroute-worker"]
        .to_str()
        .unwrap()
        .to_owned();
    let (victim, other) = if decoder == d0.url() {
        (&d0, &d1)
    } else {
        (&d1, &d0)
    };
    let prefills = p0.faults().requests_accepted();
    let mut body = resp.into_body();
    let mut seen = read_until(&mut body, 3).await;
    victim.crash();
    seen.push_str(&String::from_utf8_lossy(
        &body.collect().await.unwrap().to_bytes(),
    ));
    let events = events(&seen);
    assert_eq!(
        events.last(),
        Some(&Value::String("[DONE]".into())),
        "{seen}"
    );
    assert!(!seen.contains("\"error\""), "{seen}");
    assert_eq!(completion_text(&events).1, 24, "{seen}");
    // The continuation was prefilled again and decoded by the other decode worker.
    assert_eq!(p0.faults().requests_accepted(), prefills + 1);
    assert!(other.faults().requests_accepted() >= 1);
    assert_eq!(migrations(&r.metrics().await, "migrated"), 1.0);
    r.stop_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_half_that_fails_before_any_byte_is_retried_on_another_prefill_worker() {
    for protocol in [PdProtocol::Vllm, PdProtocol::Sglang] {
        prefill_retried(protocol).await;
    }
}

async fn prefill_retried(protocol: PdProtocol) {
    let (p0, s0) = pd_engine("prefill", 0).await;
    let (p1, s1) = pd_engine("prefill", 1).await;
    let (_d0, s2) = pd_engine("decode", 2).await;
    let mut s = Settings::with_workers(vec![s0, s1, s2]).unwrap();
    s.retry.initial_backoff = Duration::from_millis(1);
    let pd = s.pd.as_mut().unwrap();
    pd.prefill_policy = PolicyKind::RoundRobin;
    pd.protocol = protocol;
    let r = TestRouter::start(s).await;
    p0.crash();
    for i in 0..4 {
        let reply = r
            .complete(
                &[],
                &json!({"model": "kvroute-sim", "prompt": format!("q{i}"), "max_tokens": 2})
                    .to_string(),
            )
            .await;
        assert_eq!(reply.status, 200, "{protocol:?}: {:?}", reply.body);
        assert_eq!(reply.headers["x-kvroute-prefill-worker"], p1.url().as_str());
    }
    let m = r.metrics().await;
    assert_metric_at_least(&m, "kvroute_request_retries_total", "", 1.0);
    r.stop_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generate_stream_cut_mid_way_goes_on_with_its_cumulative_text() {
    // SGLang's /generate: every chunk carries the whole text so far.
    const CUT: &str = concat!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
        "data: {\"text\":\"ab\",\"meta_info\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n"
    );
    const REST: &str = concat!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
        "data: {\"text\":\"c\",\"meta_info\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\n",
        "data: {\"text\":\"cd\",\"meta_info\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n",
        "data: [DONE]\n\n"
    );
    let cut = scripted(CUT).await;
    let (rest, bodies) = scripted_recording(REST).await;
    let r = TestRouter::start(router_settings(vec![cut.clone(), rest.clone()], |_| {})).await;
    let body = json!({"text": "hi!", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "stream": true})
        .to_string();
    // Round robin: one of two requests starts on the engine that cuts (more tries, in case
    // a probe on a loaded machine kept it out of a turn).
    let mut found = false;
    for _ in 0..8 {
        let resp = open_stream(&r.url, "/generate", &body).await;
        let on_cut = resp.headers()["x-kvroute-worker"] == cut.as_str();
        let text = String::from_utf8_lossy(&resp.into_body().collect().await.unwrap().to_bytes())
            .into_owned();
        if !on_cut {
            continue;
        }
        found = true;
        let events = events(&text);
        let texts: Vec<&str> = events.iter().filter_map(|e| e["text"].as_str()).collect();
        assert_eq!(texts, ["ab", "abc", "abcd"], "{text}");
        assert_eq!(events[2]["meta_info"]["completion_tokens"], 4);
        assert_eq!(events[2]["meta_info"]["prompt_tokens"], 3);
        assert_eq!(events.last(), Some(&Value::String("[DONE]".into())));
        let sent: Value = serde_json::from_str(bodies.lock().unwrap().last().unwrap()).unwrap();
        assert_eq!(sent["text"], "hi!ab");
        assert_eq!(sent["sampling_params"]["max_new_tokens"], 2);
        assert_eq!(sent["sampling_params"]["temperature"], 0);
        break;
    }
    assert!(found);
    assert_eq!(migrations(&r.metrics().await, "migrated"), 1.0);
    r.stop_idle().await;
}
