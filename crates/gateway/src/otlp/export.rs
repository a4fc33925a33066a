//! The exporter: a background task that batches finished spans and sends them to the
//! collector, over OTLP/HTTP (protobuf, through the workers' HTTP client, so `https://` uses
//! the same trust) or OTLP/gRPC (HTTP/2 without TLS, unary `TraceService/Export`).
//!
//! A batch goes when it holds [`BATCH`] spans or [`DELAY`] after its first span. A batch
//! the collector refuses, or that cannot reach it within [`TIMEOUT`], is dropped and counted:
//! the request path never waits for the collector, and a collector that is away costs at
//! most the queue's memory. On shutdown what is queued is sent once more.

use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{header, Request};
use http_body_util::{BodyExt, Full};
use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::proto::{self, KeyValue, Value};
use super::{DropLabels, Endpoint, Tracer};
use crate::http::HttpClient;

/// Spans per export, at most (OpenTelemetry's batch processor's default).
pub const BATCH: usize = 512;
/// The longest a span waits for its batch.
pub const DELAY: Duration = Duration::from_secs(1);
/// The longest one export may take.
pub const TIMEOUT: Duration = Duration::from_secs(10);

const GRPC_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// Runs the exporter until `shutdown`, then sends what is queued once more.
pub async fn run(tracer: Arc<Tracer>, client: HttpClient, shutdown: CancellationToken) {
    let Some(mut rx) = tracer.take_receiver() else {
        return;
    };
    let mut transport = Transport::new(&tracer.settings.endpoint, client);
    let resource = resource(&tracer.settings.service_name);
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        let open = tokio::select! {
            biased;
            () = shutdown.cancelled() => false,
            open = fill(&mut rx, &mut batch) => open,
        };
        if !open || shutdown.is_cancelled() {
            while let Ok(span) = rx.try_recv() {
                batch.push(span);
            }
            for chunk in batch.chunks(BATCH) {
                export(&tracer, &mut transport, &resource, chunk.to_vec()).await;
            }
            return;
        }
        let spans = std::mem::replace(&mut batch, Vec::with_capacity(BATCH));
        export(&tracer, &mut transport, &resource, spans).await;
    }
}

/// Waits for a first span, then takes more until the batch is full or [`DELAY`] has
/// passed. `false` once every sender is gone.
async fn fill(rx: &mut mpsc::Receiver<proto::Span>, batch: &mut Vec<proto::Span>) -> bool {
    match rx.recv().await {
        Some(span) => batch.push(span),
        None => return false,
    }
    let deadline = tokio::time::sleep(DELAY);
    tokio::pin!(deadline);
    while batch.len() < BATCH {
        tokio::select! {
            () = &mut deadline => break,
            span = rx.recv() => match span {
                Some(span) => batch.push(span),
                None => return false,
            },
        }
    }
    true
}

fn resource(service_name: &str) -> proto::Resource {
    proto::Resource {
        attributes: vec![
            KeyValue::new("service.name", Value::String(service_name.to_owned())),
            KeyValue::new(
                "service.version",
                Value::String(env!("CARGO_PKG_VERSION").to_owned()),
            ),
        ],
    }
}

/// One batch as an `ExportTraceServiceRequest`.
fn encode(resource: &proto::Resource, spans: Vec<proto::Span>) -> Vec<u8> {
    proto::ExportTraceServiceRequest {
        resource_spans: vec![proto::ResourceSpans {
            resource: Some(resource.clone()),
            scope_spans: vec![proto::ScopeSpans {
                scope: Some(proto::InstrumentationScope {
                    name: "kvroute".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                }),
                spans,
            }],
            schema_url: String::new(),
        }],
    }
    .encode_to_vec()
}

async fn export(
    tracer: &Tracer,
    transport: &mut Transport,
    resource: &proto::Resource,
    spans: Vec<proto::Span>,
) {
    if spans.is_empty() {
        return;
    }
    let n = spans.len() as u64;
    let body = Bytes::from(encode(resource, spans));
    let result = tokio::time::timeout(TIMEOUT, transport.send(body))
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {}s", TIMEOUT.as_secs())));
    let m = &tracer.metrics;
    match result {
        Ok(rejected) => {
            let rejected = rejected.min(n);
            m.exported.inc_by(n - rejected);
            if rejected > 0 {
                drop_spans(tracer, rejected);
            }
        }
        Err(error) => {
            tracing::warn!(endpoint = %tracer.settings.endpoint, %error, spans = n, "Trace export failed; spans dropped");
            transport.reset();
            drop_spans(tracer, n);
        }
    }
}

fn drop_spans(tracer: &Tracer, n: u64) {
    tracer
        .metrics
        .dropped
        .get_or_create(&DropLabels {
            reason: "export_failed",
        })
        .inc_by(n);
}

/// The collector's partial success: how many spans it rejected.
fn rejected(answer: &[u8]) -> u64 {
    proto::ExportTraceServiceResponse::decode(answer)
        .ok()
        .and_then(|r| r.partial_success)
        .map_or(0, |p| p.rejected_spans.max(0) as u64)
}

type Grpc = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

enum Transport {
    Http {
        uri: http::Uri,
        client: HttpClient,
    },
    Grpc {
        authority: http::uri::Authority,
        connection: Option<Grpc>,
    },
}

impl Transport {
    fn new(endpoint: &Endpoint, client: HttpClient) -> Self {
        match endpoint {
            Endpoint::Http(uri) => Self::Http {
                uri: uri.clone(),
                client,
            },
            Endpoint::Grpc(authority) => Self::Grpc {
                authority: authority.clone(),
                connection: None,
            },
        }
    }

    /// After a failure, the next export connects afresh.
    fn reset(&mut self) {
        if let Self::Grpc { connection, .. } = self {
            *connection = None;
        }
    }

    /// Sends one encoded request; the spans the collector rejected, or why it failed.
    async fn send(&mut self, body: Bytes) -> Result<u64, String> {
        match self {
            Self::Http { uri, client } => {
                let req = Request::post(uri.clone())
                    .header(header::CONTENT_TYPE, "application/x-protobuf")
                    .body(Full::new(body))
                    .map_err(|e| e.to_string())?;
                let response = client.request(req).await.map_err(|e| e.to_string())?;
                let status = response.status();
                let answer = response
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                if !status.is_success() {
                    let text = String::from_utf8_lossy(&answer[..answer.len().min(200)]);
                    return Err(format!("the collector answered {status}: {text}"));
                }
                Ok(rejected(&answer))
            }
            Self::Grpc {
                authority,
                connection,
            } => {
                let sender = match connection {
                    Some(sender) if !sender.is_closed() => sender,
                    _ => connection.insert(grpc_connect(authority).await?),
                };
                sender.ready().await.map_err(|e| e.to_string())?;
                let mut framed = BytesMut::with_capacity(5 + body.len());
                framed.put_u8(0);
                framed.put_u32(body.len() as u32);
                framed.put_slice(&body);
                let req = Request::post(format!("http://{authority}{GRPC_PATH}"))
                    .header(header::CONTENT_TYPE, "application/grpc")
                    .header(header::TE, "trailers")
                    .body(Full::new(framed.freeze()))
                    .map_err(|e| e.to_string())?;
                let response = sender.send_request(req).await.map_err(|e| e.to_string())?;
                let (parts, body) = response.into_parts();
                if !parts.status.is_success() {
                    return Err(format!("the collector answered HTTP {}", parts.status));
                }
                let collected = body.collect().await.map_err(|e| e.to_string())?;
                // A trailers-only answer carries its status in the headers.
                let trailers = collected.trailers().cloned().unwrap_or_default();
                let status = trailers
                    .get("grpc-status")
                    .or_else(|| parts.headers.get("grpc-status"))
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                if status != "0" {
                    let message = trailers
                        .get("grpc-message")
                        .or_else(|| parts.headers.get("grpc-message"))
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("");
                    return Err(format!("gRPC status {status:?}: {message}"));
                }
                let answer = collected.to_bytes();
                Ok(answer.get(5..).map_or(0, rejected))
            }
        }
    }
}

async fn grpc_connect(authority: &http::uri::Authority) -> Result<Grpc, String> {
    let tcp = tokio::net::TcpStream::connect(authority.as_str())
        .await
        .map_err(|e| format!("cannot connect to {authority}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let (sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .map_err(|e| format!("HTTP/2 handshake with {authority} failed: {e}"))?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "The collector's connection ended with an error");
        }
    });
    Ok(sender)
}
