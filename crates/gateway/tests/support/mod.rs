//! Test support: real HTTP workers on 127.0.0.1:0, a router serving on real sockets, and a
//! small HTTP client. Nothing here sleeps to synchronise; `wait_until` polls a condition
//! with a deadline, as a readiness probe would.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post as post_route};
use axum::Router;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_gateway::{Gateway, Settings, WorkerSpec};
use kvroute_sim::{SimArgs, SimInstance};
use kvroute_tokenizer::Tokenizer;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// A fake OpenAI-compatible engine.
///
/// - `GET /v1/models` lists its models; `GET /health` answers ok, or 503 while `healthy` is
///   false.
/// - A POST answers with the status in `status` when that is not 0 (an `injected` error).
/// - Else a POST answers JSON echoing what it received: `{"worker", "path", "body",
///   "request_id", "headers"}`.
/// - A POST with `"stream": true` answers SSE: one chunk at once, then waits for a permit
///   from `release`, then `max_tokens` more chunks 5 ms apart, then `data: [DONE]`.
/// - A POST whose body contains `"hang"` never answers.
#[derive(Clone)]
pub struct MockWorker {
    pub name: String,
    pub url: String,
    pub release: Arc<Semaphore>,
    pub requests: Arc<AtomicUsize>,
    pub streams_open: Arc<AtomicUsize>,
    /// 0: answer as above; else answer every POST with this status.
    pub status: Arc<AtomicU16>,
    pub healthy: Arc<AtomicBool>,
    models: Arc<Vec<String>>,
}

impl MockWorker {
    pub async fn start(name: &str, models: &[&str]) -> MockWorker {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mock = MockWorker {
            name: name.to_owned(),
            url: format!("http://{addr}"),
            release: Arc::new(Semaphore::new(0)),
            requests: Arc::new(AtomicUsize::new(0)),
            streams_open: Arc::new(AtomicUsize::new(0)),
            status: Arc::new(AtomicU16::new(0)),
            healthy: Arc::new(AtomicBool::new(true)),
            models: Arc::new(models.iter().map(|m| m.to_string()).collect()),
        };
        let app = Router::new()
            .route("/v1/models", get(mock_models))
            .route("/health", get(mock_health))
            .fallback(post_route(mock_post))
            .with_state(mock.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        mock
    }

    pub fn spec(&self) -> WorkerSpec {
        WorkerSpec::url(self.url.clone())
    }

    /// The POSTs it received.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

async fn mock_health(State(m): State<MockWorker>) -> StatusCode {
    if m.healthy.load(Ordering::SeqCst) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn mock_models(State(m): State<MockWorker>) -> Response {
    let data: Vec<_> = m
        .models
        .iter()
        .map(|id| serde_json::json!({"id": id, "object": "model", "owned_by": m.name}))
        .collect();
    axum::Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

struct StreamGuard(Arc<AtomicUsize>);
impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn mock_post(State(m): State<MockWorker>, req: Request) -> Response {
    m.requests.fetch_add(1, Ordering::SeqCst);
    let (parts, body) = req.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    let status = m.status.load(Ordering::SeqCst);
    if status != 0 {
        let error = serde_json::json!({"error": {"message": "injected", "code": status}});
        return (StatusCode::from_u16(status).unwrap(), axum::Json(error)).into_response();
    }
    let text = String::from_utf8_lossy(&body).into_owned();
    if text.contains("\"hang\"") {
        std::future::pending::<()>().await;
    }
    let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    if parsed["stream"] == true {
        let more = parsed["max_tokens"].as_u64().unwrap_or(3);
        let release = m.release.clone();
        m.streams_open.fetch_add(1, Ordering::SeqCst);
        let guard = StreamGuard(m.streams_open.clone());
        let stream = async_stream(m.name.clone(), more, release, guard);
        return Response::builder()
            .header("content-type", "text/event-stream")
            .header("x-mock-worker", &m.name)
            .body(Body::from_stream(stream))
            .unwrap();
    }
    let headers: serde_json::Map<String, serde_json::Value> = parts
        .headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").into()))
        .collect();
    let echo = serde_json::json!({
        "worker": m.name,
        "path": parts.uri.path(),
        "body": text,
        "request_id": parts.headers.get("x-request-id").and_then(|v| v.to_str().ok()),
        "headers": headers,
    });
    ([("x-mock-worker", m.name.clone())], axum::Json(echo)).into_response()
}

fn async_stream(
    name: String,
    more: u64,
    release: Arc<Semaphore>,
    guard: StreamGuard,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
    // The guard travels in the state, so it drops when the stream ends or is dropped.
    futures_util::stream::unfold((0u64, guard), move |(i, guard)| {
        let name = name.clone();
        let release = release.clone();
        async move {
            let chunk = if i == 0 {
                format!("data: {{\"worker\":\"{name}\",\"chunk\":0}}\n\n")
            } else {
                if i == 1 {
                    release.acquire().await.unwrap().forget();
                } else {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                match i.cmp(&(more + 1)) {
                    std::cmp::Ordering::Less => format!("data: {{\"chunk\":{i}}}\n\n"),
                    std::cmp::Ordering::Equal => "data: [DONE]\n\n".to_owned(),
                    std::cmp::Ordering::Greater => return None,
                }
            };
            Some((Ok(Bytes::from(chunk)), (i + 1, guard)))
        }
    })
}

/// A worker that lists a model, then closes the connection on every POST without answering.
pub async fn broken_worker(model: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let models = format!(r#"{{"object":"list","data":[{{"id":"{model}"}}]}}"#);
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let models = models.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut seen = Vec::new();
                loop {
                    let n = match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    seen.extend_from_slice(&buf[..n]);
                    if seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                if seen.starts_with(b"GET") {
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{}",
                        models.len(),
                        models
                    );
                    let _ = sock.write_all(resp.as_bytes()).await;
                }
                // POST: drop the socket without a response.
            });
        }
    });
    url
}

/// A URL where nothing listens.
pub async fn closed_url() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

/// A router serving on real sockets.
pub struct TestRouter {
    pub url: String,
    pub metrics_url: String,
    pub gateway: Gateway,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl TestRouter {
    pub async fn start(settings: Settings) -> TestRouter {
        let router = Self::start_unready(settings).await;
        tokio::time::timeout(Duration::from_secs(20), router.gateway.wait_ready())
            .await
            .expect("router ready");
        router
    }

    pub async fn start_unready(settings: Settings) -> TestRouter {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let metrics_url = format!("http://{}", metrics_listener.local_addr().unwrap());
        let mut registry = prometheus_client::registry::Registry::default();
        let gateway = Gateway::new(settings, &mut registry);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(gateway.clone().serve(
            listener,
            metrics_listener,
            Arc::new(registry),
            shutdown.clone(),
        ));
        TestRouter {
            url,
            metrics_url,
            gateway,
            shutdown,
            task,
        }
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("router stops")
            .unwrap()
            .unwrap();
    }

    pub async fn metrics(&self) -> String {
        scrape(&self.metrics_url).await
    }
}

/// `GET {base}/metrics`: the Prometheus text of a router or an engine.
pub async fn scrape(base: &str) -> String {
    let (status, _, body) = get_url(&format!("{base}/metrics")).await;
    assert_eq!(status, StatusCode::OK);
    String::from_utf8(body.to_vec()).unwrap()
}

/// Settings for these workers with `round_robin` (tests of other policies set theirs).
pub fn settings(workers: &[&MockWorker]) -> Settings {
    let mut s = Settings::with_workers(workers.iter().map(|w| w.spec()).collect()).unwrap();
    s.policy = kvroute_core::PolicyKind::RoundRobin;
    s
}

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    pub fn worker(&self) -> &str {
        self.headers
            .get("x-kvroute-worker")
            .expect("x-kvroute-worker header")
            .to_str()
            .unwrap()
    }

    /// The worker and data-parallel rank the router named.
    pub fn placed(&self) -> (String, Option<String>) {
        let rank = self
            .headers
            .get("x-kvroute-dp-rank")
            .map(|v| v.to_str().unwrap().to_owned());
        (self.worker().to_owned(), rank)
    }

    pub fn error_code(&self) -> String {
        self.json()["error"]["code"].as_str().unwrap().to_owned()
    }
}

pub async fn send(
    url: &str,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Reply {
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("{url}{path}"))
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client()
        .request(req.body(Full::new(body.into())).unwrap())
        .await
        .unwrap();
    let (parts, body) = resp.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

pub async fn post(url: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    send(url, Method::POST, path, headers, body.to_owned()).await
}

pub async fn get_url(url: &str) -> (StatusCode, HeaderMap, Bytes) {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

pub fn chat(model: &str, content: &str) -> String {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": content}]})
        .to_string()
}

/// Polls `cond` until it holds, failing after 20 s.
pub async fn wait_until<F: FnMut() -> bool>(what: &str, mut cond: F) {
    wait_until_async(what, || std::future::ready(cond())).await;
}

/// The metric lines `name{labels} value` or `name value` whose labels contain `labels` (as a
/// substring), as their values.
fn metric_values<'a>(
    text: &'a str,
    name: &'a str,
    labels: &'a str,
) -> impl Iterator<Item = f64> + 'a {
    text.lines()
        .filter(move |l| {
            !l.starts_with('#')
                && l.starts_with(name)
                && l[name.len()..].starts_with(['{', ' '])
                && l.contains(labels)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The value of a metric line `name{labels} value` (labels matched as a substring).
pub fn metric_value(text: &str, name: &str, labels: &str) -> Option<f64> {
    metric_values(text, name, labels).next()
}

/// The sum of the metric lines `name{labels} value` whose labels contain `labels` (`""`: all
/// of the metric's label sets).
pub fn metric_sum(text: &str, name: &str, labels: &str) -> f64 {
    metric_values(text, name, labels).sum()
}

pub fn in_flight(router: &TestRouter, worker_url: &str) -> u64 {
    router
        .gateway
        .workers()
        .statuses()
        .into_iter()
        .find(|w| w.url == worker_url)
        .unwrap()
        .in_flight
}

pub fn addr_of(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

/// Posts `body` and returns the response with its body unread (for streams).
pub async fn open_stream(
    url: &str,
    path: &str,
    body: &str,
) -> http::Response<hyper::body::Incoming> {
    let req = http::Request::post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    client().request(req).await.unwrap()
}

/// Waits until the router counts no request in flight on the worker at `worker_url`.
pub async fn wait_idle(router: &TestRouter, worker_url: &str) {
    let gw = router.gateway.clone();
    wait_until("in-flight back to 0", || {
        gw.workers()
            .statuses()
            .iter()
            .all(|s| s.url != worker_url || s.in_flight == 0)
    })
    .await;
}

/// `len` pseudo-random lowercase letters, the same for the same seed (prompts that share or do
/// not share prefixes on purpose).
pub use kvroute_sim::text;

/// Whether a GET of `url` answers 200 (false while nothing listens there).
pub async fn answers(url: &str) -> bool {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    matches!(client().request(req).await, Ok(resp) if resp.status() == StatusCode::OK)
}

/// Waits until nothing is in flight anywhere in the router: every worker's requests, every
/// rank's prefill tokens and decode blocks, and `kvroute_requests_in_router`.
pub async fn wait_all_idle(router: &TestRouter) {
    let gw = router.gateway.clone();
    wait_until("nothing in flight", || {
        gw.workers().statuses().iter().all(|w| {
            w.in_flight == 0
                && w.ranks
                    .iter()
                    .all(|k| k.active_prefill_tokens == 0 && k.active_decode_blocks == 0)
        })
    })
    .await;
    let m = router.metrics().await;
    assert_eq!(
        metric_value(&m, "kvroute_requests_in_router", ""),
        Some(0.0)
    );
}

/// A loopback port free at the time of asking.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls an async condition until it holds, failing after 20 s.
pub async fn wait_until_async<F, Fut>(what: &str, cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    assert!(
        holds_within(Duration::from_secs(20), cond).await,
        "timed out waiting for {what}"
    );
}

/// Polls an async condition (every 10 ms) until it holds or `within` has passed: whether it
/// held.
pub async fn holds_within<F, Fut>(within: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if cond().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A child process killed when dropped, so a failing test leaves none behind.
pub struct ChildGuard(pub std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A kvroute-sim replica serving on a port of its own and publishing KV events on a free one:
/// `args` makes its arguments from that endpoint (`tcp://127.0.0.1:PORT`). Returns once the
/// replica has bound its sockets, with the endpoint. The replica binds the event port (and any
/// other it is given) itself, so another test may take one first: then it is started again
/// with fresh ports.
pub async fn sim_with_events(mut args: impl FnMut(&str) -> SimArgs) -> (SimInstance, String) {
    let mut error = None;
    for _ in 0..20 {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let events = format!("tcp://127.0.0.1:{}", free_port());
        match SimInstance::start(args(&events), Arc::new(Tokenizer::fallback()), listener).await {
            Ok(sim) => return (sim, events),
            Err(e) => error = Some(e),
        }
    }
    panic!("no engine could bind its ports: {error:?}");
}

/// `POST /debug/route` for `prompt`: the router's decision and its candidates.
pub async fn debug_route(r: &TestRouter, prompt: &str) -> Value {
    let body = serde_json::json!({ "prompt": prompt }).to_string();
    let reply = post(&r.url, "/debug/route", &[], &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    reply.json()
}

/// The device blocks a `/debug/route` answer credits `worker` with (its first rank listed);
/// `None` when `worker` is not a candidate.
pub fn device_overlap(debug: &Value, worker: &str) -> Option<u64> {
    debug["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["worker"] == worker)
        .map(|c| c["overlap_blocks"]["device"].as_u64().unwrap())
}

/// The device blocks the router's index credits `worker` with for `prompt`; `None` when
/// `worker` is not a candidate.
pub async fn overlap(r: &TestRouter, prompt: &str, worker: &str) -> Option<u64> {
    device_overlap(&debug_route(r, prompt).await, worker)
}

/// Waits until the device blocks the router credits `worker` with for `prompt` satisfy `cond`
/// (`None`: `worker` is not a candidate).
pub async fn wait_overlap(
    r: &TestRouter,
    prompt: &str,
    worker: &str,
    cond: impl Fn(Option<u64>) -> bool,
) {
    let what = format!("the router's credit to {worker} for the prompt");
    wait_until_async(&what, || async { cond(overlap(r, prompt, worker).await) }).await;
}

/// Waits until the router hears the KV events of worker `id`, the engine at `engine_url`: a
/// ZMQ subscriber joins asynchronously, and what the engine published before it did is lost.
/// Probes go straight to the engine until the index credits each of the worker's ranks with
/// one of them.
pub async fn joined(r: &TestRouter, engine_url: &str, id: &str) {
    let heard = std::cell::RefCell::new(std::collections::HashSet::new());
    for i in 0..400u64 {
        let probe = format!("probe {id} {i} {}", text(64, 1000 + i));
        let body = serde_json::json!({"prompt": probe, "max_tokens": 1}).to_string();
        let reply = post(engine_url, "/v1/completions", &[], &body).await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        // The probe's events reach the index a moment later, or never (published before the
        // subscriber joined): then the next probe tries again.
        let all_heard = std::cell::Cell::new(false);
        holds_within(Duration::from_millis(100), || async {
            let d = debug_route(r, &probe).await;
            let ranks: Vec<&Value> = d["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|c| c["worker"] == id)
                .collect();
            let Some(c) = ranks
                .iter()
                .find(|c| c["overlap_blocks"]["device"].as_u64().unwrap() > 0)
            else {
                return false;
            };
            let mut heard = heard.borrow_mut();
            heard.insert(c["dp_rank"].to_string());
            all_heard.set(heard.len() == ranks.len());
            true
        })
        .await;
        if all_heard.get() {
            return;
        }
    }
    panic!("the router never received {id}'s KV events");
}
