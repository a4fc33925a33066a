//! Test support shared by the integration tests: engines on free ports, a small HTTP
//! client, request bodies, `/metrics` reading and KV-event subscribers. Nothing here sleeps
//! to synchronise: every wait is bounded by [`PATIENCE`].

#![allow(dead_code)]

use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_sim::{SimArgs, SimInstance};
use kvroute_tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};
use zeromq::{Socket, SocketRecv};

/// The bound on anything that should take milliseconds.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// The engine's args for `extra` flags, at 1000x speed unless they say otherwise.
pub fn args(extra: &[&str]) -> SimArgs {
    let mut argv = vec!["kvroute-sim", "--speedup", "1000"];
    argv.extend_from_slice(extra);
    <SimArgs as clap::Parser>::parse_from(argv)
}

/// A port free when asked (another test may take it before it is bound).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An engine with `extra` flags serving HTTP on a free port.
pub async fn start(extra: &[&str]) -> SimInstance {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    SimInstance::start(args(extra), Arc::new(Tokenizer::fallback()), listener)
        .await
        .unwrap()
}

/// An engine with `extra` flags that binds ports of its own on free ports: a KV-event
/// socket when `kv_events`, a bootstrap port when `bootstrap`. Retries when another test
/// took a port between picking and binding. Returns the engine and its KV-event endpoint.
pub async fn start_binding(
    extra: &[&str],
    kv_events: bool,
    bootstrap: bool,
) -> (SimInstance, Option<String>) {
    for _ in 0..20 {
        let mut a = args(extra);
        a.kv_events_endpoint = kv_events.then(|| format!("tcp://127.0.0.1:{}", free_port()));
        if bootstrap {
            a.bootstrap_port = Some(free_port());
        }
        let endpoint = a.kv_events_endpoint.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        if let Ok(sim) = SimInstance::start(a, Arc::new(Tokenizer::fallback()), listener).await {
            return (sim, endpoint);
        }
    }
    panic!("no engine could bind its ports");
}

/// An engine with `extra` flags publishing KV events on a free port, and that endpoint.
pub async fn start_publishing(extra: &[&str]) -> (SimInstance, String) {
    let (sim, endpoint) = start_binding(extra, true, false).await;
    (sim, endpoint.expect("a KV-event endpoint"))
}

/// Polls `condition` until it holds; panics, saying `what`, after [`PATIENCE`].
pub async fn wait_until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + PATIENCE;
    while !condition().await {
        assert!(Instant::now() < deadline, "not within {PATIENCE:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// A JSON POST of `body` to `url` + `path`.
pub fn post(url: &str, path: &str, body: &Value) -> http::Request<Full<Bytes>> {
    http::Request::post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

/// Sends `req`; its status and whole body, each within [`PATIENCE`].
pub async fn send(req: http::Request<Full<Bytes>>) -> (u16, String) {
    let resp = timeout(PATIENCE, client().request(req))
        .await
        .expect("an answer")
        .unwrap();
    let status = resp.status().as_u16();
    let bytes = timeout(PATIENCE, resp.into_body().collect())
        .await
        .expect("a whole body")
        .unwrap()
        .to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

/// A JSON POST with extra `headers`: the status and the body's text.
pub async fn post_with(
    url: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> (u16, String) {
    let mut req = post(url, path, body);
    for (k, v) in headers {
        req.headers_mut().insert(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            http::HeaderValue::from_str(v).unwrap(),
        );
    }
    send(req).await
}

/// A JSON POST: the status and the body's text.
pub async fn post_raw(url: &str, path: &str, body: &Value) -> (u16, String) {
    send(post(url, path, body)).await
}

/// A JSON POST: the status and the body as JSON (`Null` when it is not JSON).
pub async fn post_json(url: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = post_raw(url, path, body).await;
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// A GET: the status and the body's text.
pub async fn get(url: &str, path: &str) -> (u16, String) {
    let req = http::Request::get(format!("{url}{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    send(req).await
}

/// The engine's `/metrics` text.
pub async fn metrics(url: &str) -> String {
    let (status, text) = get(url, "/metrics").await;
    assert_eq!(status, 200, "{text}");
    text
}

/// The value of the series `name` whose labels include every one of `labels`; panics
/// when there is none.
pub fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            l.starts_with(name)
                && l[name.len()..].starts_with(['{', ' '])
                && labels.iter().all(|x| l.contains(x))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"))
}

/// `len` tokens (bytes, with the fallback tokenizer), the first block distinct per `seed`.
pub fn prompt_of(len: usize, seed: usize) -> String {
    let letters = (0..len).map(|i| (b'a' + ((i * 7 + seed) % 26) as u8) as char);
    format!("{seed:08}-")
        .chars()
        .chain(letters)
        .take(len)
        .collect()
}

/// A completion request's body.
pub fn completion(prompt: &str, max_tokens: usize, stream: bool) -> Value {
    json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
}

/// One-token completions at `url`, one after another, of a distinct 20-token prompt per seed
/// in `seeds`: one block each, so one stored-block message each on a publishing engine.
pub async fn one_block_completions(url: &str, seeds: Range<usize>) {
    for seed in seeds {
        post_json(
            url,
            "/v1/completions",
            &completion(&prompt_of(20, seed), 1, false),
        )
        .await;
    }
}

/// Decode engines waiting at the bootstrap port of the prefill engine at `url`.
pub async fn waiting_for_rooms(url: &str) -> f64 {
    metric(&metrics(url).await, "kvroute_sim_bootstrap_waiting", &[])
}

/// POSTs `body` to the decode engine at `url` + `path` on a task, and returns the task once
/// the prefill engine at `prefill_url` has it waiting for a bootstrap room, still unanswered.
/// The task gives the status and the body's text.
pub async fn post_waiting_for_room(
    url: &str,
    path: &str,
    body: &Value,
    prefill_url: &str,
) -> JoinHandle<(u16, String)> {
    let task = tokio::spawn(send(post(url, path, body)));
    wait_until("the decode engine waits for the room", || async {
        waiting_for_rooms(prefill_url).await == 1.0
    })
    .await;
    assert!(
        !task.is_finished(),
        "the decode engine answered before the prefill was sent"
    );
    task
}

/// A subscriber to `endpoint` that has seen a message (so it is joined): probes, one
/// distinct one-block prompt each from `probe_seed` on, go to `url` until one's events
/// arrive.
pub async fn subscribe(endpoint: &str, url: &str, probe_seed: usize) -> zeromq::SubSocket {
    let mut sub = zeromq::SubSocket::new();
    sub.connect(endpoint).await.unwrap();
    sub.subscribe("").await.unwrap();
    for probe in 0..200 {
        let body = completion(&prompt_of(20, probe_seed + probe), 1, false);
        post_json(url, "/v1/completions", &body).await;
        if timeout(Duration::from_millis(100), sub.recv())
            .await
            .is_ok()
        {
            return sub;
        }
    }
    panic!("no KV event arrived");
}
