//! Test support: real HTTP workers on 127.0.0.1:0, a router serving on real sockets, and a
//! small HTTP client. Nothing here sleeps to synchronise; `wait_until` polls a condition
//! with a deadline, as a readiness probe would.
//!
//! - [`mock`]: fake engines ([`MockWorker`]).
//! - [`sim`]: kvroute-sim replicas and the router's KV-index credit.
//! - [`envoy`]: a real Envoy in front of the endpoint picker ([`Envoy`]).
//! - [`jwt`]: real JWT keys and an OIDC issuer serving its JWKS ([`Key`], [`Issuer`]).
//! - [`kube_api`]: a Kubernetes API server's pod list and watch ([`FakeApi`]).
//! - [`nats`]: a real nats-server ([`Nats`]).
//! - [`requests`]: the requests and waits the tests repeat, as [`TestRouter`] methods.
//! - [`tls`]: certificates made in the test, and https clients.

#![allow(dead_code)]

mod envoy;
mod jwt;
mod kube_api;
mod mock;
mod nats;
mod requests;
mod sim;
mod tls;

#[allow(unused_imports)]
pub use envoy::*;
#[allow(unused_imports)]
pub use jwt::*;
#[allow(unused_imports)]
pub use kube_api::*;
#[allow(unused_imports)]
pub use mock::*;
#[allow(unused_imports)]
pub use nats::*;
#[allow(unused_imports)]
pub use requests::*;
#[allow(unused_imports)]
pub use sim::*;
#[allow(unused_imports)]
pub use tls::*;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_gateway::{Gateway, Settings, WorkerSpec};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

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
        Self::start_unready_with(settings, Arc::new(kvroute_tokenizer::Tokenizer::fallback())).await
    }

    /// A ready router that tokenises with `tokenizer`.
    pub async fn start_with(
        settings: Settings,
        tokenizer: Arc<kvroute_tokenizer::Tokenizer>,
    ) -> TestRouter {
        let r = Self::start_unready_with(settings, tokenizer).await;
        tokio::time::timeout(Duration::from_secs(20), r.gateway.wait_ready())
            .await
            .expect("router ready");
        r
    }

    pub async fn start_unready_with(
        settings: Settings,
        tokenizer: Arc<kvroute_tokenizer::Tokenizer>,
    ) -> TestRouter {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let scheme = if settings.tls.api.is_some() {
            "https"
        } else {
            "http"
        };
        let url = format!("{scheme}://{}", listener.local_addr().unwrap());
        let metrics_url = format!("http://{}", metrics_listener.local_addr().unwrap());
        let mut registry = prometheus_client::registry::Registry::default();
        let gateway = Gateway::with_tokenizer(settings, &mut registry, tokenizer);
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

    /// A router started from `flags`, as the binary parses its command line (without the
    /// program's name; no config file).
    pub async fn from_flags(flags: &[&str]) -> TestRouter {
        let argv = std::iter::once("kvroute").chain(flags.iter().copied());
        let settings = <kvroute_gateway::Args as clap::Parser>::try_parse_from(argv)
            .unwrap()
            .into_settings()
            .unwrap();
        TestRouter::start(settings).await
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

/// The worker at `url`, known as `id` and serving `model` under that name.
pub fn named_spec(id: &str, model: &str, url: impl Into<String>) -> WorkerSpec {
    WorkerSpec {
        id: Some(id.to_owned()),
        model: Some(model.to_owned()),
        ..WorkerSpec::url(url)
    }
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
    send_via(&client(), url, method, path, headers, body).await
}

/// [`send`] with `client` (an https one, say).
pub async fn send_via<C>(
    client: &Client<C, Full<Bytes>>,
    url: &str,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Reply
where
    C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
{
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("{url}{path}"))
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client
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

/// Asserts that the metric line `name{labels}` of `text` reads `value` (`None`: there is no
/// such line).
#[track_caller]
pub fn assert_metric(text: &str, name: &str, labels: &str, value: Option<f64>) {
    assert_eq!(
        metric_value(text, name, labels),
        value,
        "{name}{{{labels}}} in\n{text}"
    );
}

/// Asserts that the metric line `name{labels}` of `text` is there and reads `min` or more.
#[track_caller]
pub fn assert_metric_at_least(text: &str, name: &str, labels: &str, min: f64) {
    let value = metric_value(text, name, labels);
    assert!(
        value.is_some_and(|v| v >= min),
        "{name}{{{labels}}} is {value:?}, not {min} or more, in\n{text}"
    );
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
    url.trim_start_matches("http://")
        .trim_start_matches("https://")
        .parse()
        .unwrap()
}

/// Posts `body` and returns the response with its body unread (for streams).
pub async fn open_stream(
    url: &str,
    path: &str,
    body: &str,
) -> http::Response<hyper::body::Incoming> {
    open_stream_with(url, path, &[], body).await
}

/// [`open_stream`] with `headers`.
pub async fn open_stream_with(
    url: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> http::Response<hyper::body::Incoming> {
    let mut req =
        http::Request::post(format!("{url}{path}")).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body.to_owned()))).unwrap();
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
/// A `kvroute` process run with `args` on free ports, once its `/readiness` answers: the
/// process, its API URL and its metrics URL.
/// A process that exits before it is ready fails the test with its status and its log.
pub async fn kvroute_process(args: &[&str]) -> (ChildGuard, String, String) {
    // Two listeners held at once: the two ports differ.
    let (a, b) = (
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
    );
    let (port, metrics_port) = (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    );
    drop((a, b));
    let log = std::env::temp_dir().join(format!("kvroute-test-{port}.log"));
    let mut child = ChildGuard(
        std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["--port", &port.to_string()])
            .args(["--prometheus-port", &metrics_port.to_string()])
            .args(args)
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let url = format!("http://127.0.0.1:{port}");
    let ready = format!("{url}/readiness");
    let up = holds_within(Duration::from_secs(60), || {
        let exited = child.0.try_wait().ok().flatten();
        let (ready, log) = (ready.clone(), log.as_path());
        async move {
            if let Some(status) = exited {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                panic!("kvroute exited before it was ready ({status}):\n{text}");
            }
            answers(&ready).await
        }
    })
    .await;
    assert!(
        up,
        "kvroute not ready within 60 s:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    (child, url, format!("http://127.0.0.1:{metrics_port}"))
}

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

/// The Python the tests' real clients and receivers run with (the `anthropic` SDK,
/// `opentelemetry-proto`): `$KVROUTE_PYTHON`, else `target/ci-tools/bin/python` (where
/// `.ci/run` installs them), else `python3`.
/// Runs `script` (under `tests/support/`) with the test Python and `args`, and parses the
/// one JSON object it prints; a failing script fails the test with its output. `needs` names
/// the packages it imports, for the message when Python cannot start it.
pub async fn python_json(script: &str, args: Vec<String>, needs: &str) -> serde_json::Value {
    let path = format!("{}/tests/support/{script}", env!("CARGO_MANIFEST_DIR"));
    let mut cmd = std::process::Command::new(test_python());
    cmd.arg(path).args(&args);
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("python with {needs}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{script} {args:?} (needs Python with {needs}: .ci/run installs them into \
         target/ci-tools, or set KVROUTE_PYTHON): {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

pub fn test_python() -> String {
    if let Ok(p) = std::env::var("KVROUTE_PYTHON") {
        return p;
    }
    let venv = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../target/ci-tools/bin/python"
    );
    if std::path::Path::new(venv).exists() {
        return venv.to_owned();
    }
    "python3".to_owned()
}

/// Each candidate's adapter fit in a `/debug/route` answer, by worker ("-" without one).
pub fn adapter_fits(decision: &serde_json::Value) -> Vec<(String, String)> {
    let mut fits: Vec<(String, String)> = decision["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let fit = c["adapter"].as_str().unwrap_or("-").to_owned();
            (c["worker"].as_str().unwrap().to_owned(), fit)
        })
        .collect();
    fits.sort();
    fits
}
