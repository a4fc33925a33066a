//! Fake engines: [`MockWorker`], one whose connections break, a scripted one that answers
//! raw HTTP, and a URL where nothing listens.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post as post_route};
use axum::Router;
use http::StatusCode;
use http_body_util::BodyExt;
use kvroute_gateway::WorkerSpec;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

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
/// - `GET /metrics` answers the text in `metrics` (Prometheus text, as an engine's), or 404
///   while it is empty.
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
    pub metrics: Arc<Mutex<String>>,
    models: Arc<Vec<String>>,
}

impl MockWorker {
    pub async fn start(name: &str, models: &[&str]) -> MockWorker {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::start_on(listener, name, models)
    }

    /// A mock serving on `listener` (an address of the test's choosing).
    pub fn start_on(listener: TcpListener, name: &str, models: &[&str]) -> MockWorker {
        let addr = listener.local_addr().unwrap();
        let mock = MockWorker {
            name: name.to_owned(),
            url: format!("http://{addr}"),
            release: Arc::new(Semaphore::new(0)),
            requests: Arc::new(AtomicUsize::new(0)),
            streams_open: Arc::new(AtomicUsize::new(0)),
            status: Arc::new(AtomicU16::new(0)),
            healthy: Arc::new(AtomicBool::new(true)),
            metrics: Arc::new(Mutex::new(String::new())),
            models: Arc::new(models.iter().map(|m| m.to_string()).collect()),
        };
        let app = Router::new()
            .route("/v1/models", get(mock_models))
            .route("/health", get(mock_health))
            .route("/metrics", get(mock_metrics))
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

async fn mock_metrics(State(m): State<MockWorker>) -> Response {
    let text = m.metrics.lock().unwrap().clone();
    if text.is_empty() {
        StatusCode::NOT_FOUND.into_response()
    } else {
        text.into_response()
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

/// Mock workers named `names`, each serving model `m`.
pub async fn mocks<const N: usize>(names: [&str; N]) -> [MockWorker; N] {
    let mut workers = Vec::new();
    for name in names {
        workers.push(MockWorker::start(name, &["m"]).await);
    }
    match workers.try_into() {
        Ok(workers) => workers,
        Err(_) => unreachable!("one worker a name"),
    }
}

/// An engine that answers every POST with `reply` (raw HTTP, the connection closed after
/// it) and lists `kvroute-sim` on any GET.
pub async fn scripted(reply: &'static str) -> String {
    scripted_recording(reply).await.0
}

/// [`scripted`], with the bodies of the POSTs it received.
pub async fn scripted_recording(
    reply: &'static str,
) -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let bodies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen_bodies = bodies.clone();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let bodies = seen_bodies.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = vec![0u8; 65536];
                // Headers, then the body its content-length announces.
                loop {
                    let n = match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    seen.extend_from_slice(&buf[..n]);
                    let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
                    let length = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if seen.len() >= end + 4 + length {
                        if seen.starts_with(b"POST") {
                            let body = String::from_utf8_lossy(&seen[end + 4..]).into_owned();
                            bodies.lock().unwrap().push(body);
                        }
                        break;
                    }
                }
                let resp = if seen.starts_with(b"GET") {
                    let models = r#"{"object":"list","data":[{"id":"kvroute-sim"}]}"#;
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{models}",
                        models.len()
                    )
                } else {
                    reply.to_owned()
                };
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    });
    (url, bodies)
}
