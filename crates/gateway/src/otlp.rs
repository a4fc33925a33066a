//! OpenTelemetry traces: one server span per routed request, a client span per upstream
//! attempt, exported over OTLP off the request path.
//!
//! A request is traced when its `traceparent` says its parent was sampled, or, with no
//! parent, when its fresh trace id falls under `--otlp-sampling-ratio` (parent-based, ratio
//! for roots, as OpenTelemetry's `ParentBased(TraceIdRatioBased)`); a parent that was not
//! sampled is not traced, and its `traceparent` is forwarded untouched. A traced request
//! forwards a `traceparent` naming its attempt's span, so an engine with tracing on (vLLM's
//! `--otlp-traces-endpoint`) continues the trace.
//!
//! Spans are handed to the exporter over a bounded channel with `try_send`: when the
//! collector is away and the queue is full, spans are dropped and counted
//! (`kvroute_otlp_spans_dropped_total{reason}`), never waited for. The exporter
//! ([`export`]) sends them in batches over OTLP/HTTP protobuf or OTLP/gRPC.

use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::HeaderValue;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;

pub mod export;
mod proto;
#[cfg(test)]
mod tests;

use proto::{KeyValue, Value};

/// Where spans go, from `--otlp-traces-endpoint`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// OTLP over HTTP with protobuf bodies, POSTed to this URL.
    Http(http::Uri),
    /// OTLP over gRPC (HTTP/2 without TLS) to `host:port`.
    Grpc(http::uri::Authority),
}

/// smg's default collector, used by `--enable-trace` without an endpoint.
pub const DEFAULT_ENDPOINT: &str = "localhost:4317";

impl Endpoint {
    /// `http(s)://host[:port][/path]` (to `/v1/traces` when no path is given) or a bare
    /// `host:port` for gRPC.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.starts_with("http://") || s.starts_with("https://") {
            let uri: http::Uri = s.parse().map_err(|e| format!("{s:?} is not a URL: {e}"))?;
            if uri.host().is_none_or(str::is_empty) {
                return Err(format!("{s:?} has no host"));
            }
            let path = uri.path();
            if path.is_empty() || path == "/" {
                let base = s.trim_end_matches('/');
                let with_path: http::Uri = format!("{base}/v1/traces")
                    .parse()
                    .map_err(|e| format!("{s:?}: {e}"))?;
                return Ok(Self::Http(with_path));
            }
            return Ok(Self::Http(uri));
        }
        if s.contains("://") {
            return Err(format!(
                "{s:?}: the scheme must be http:// or https:// (OTLP/HTTP), or none for gRPC (host:port)"
            ));
        }
        let authority: http::uri::Authority = s
            .parse()
            .map_err(|e| format!("{s:?} is not host:port: {e}"))?;
        if authority.port_u16().is_none() || authority.host().is_empty() || s.contains('/') {
            return Err(format!("{s:?}: an OTLP/gRPC endpoint is host:port"));
        }
        Ok(Self::Grpc(authority))
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Http(uri) => write!(f, "{uri} (OTLP/HTTP)"),
            Self::Grpc(a) => write!(f, "{a} (OTLP/gRPC)"),
        }
    }
}

/// The validated trace settings; tracing is off without them.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSettings {
    pub endpoint: Endpoint,
    /// The share of root requests traced, in [0, 1].
    pub sampling_ratio: f64,
    /// The resource's `service.name` (`OTEL_SERVICE_NAME`, else `kvroute`).
    pub service_name: String,
}

/// Spans waiting for the exporter, at most (OpenTelemetry's batch processor's default).
const QUEUE: usize = 2048;

/// `kvroute_otlp_spans_{exported,dropped}_total`.
#[derive(Debug, Clone)]
pub struct TraceMetrics {
    pub exported: Counter,
    pub dropped: Family<DropLabels, Counter>,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct DropLabels {
    /// `queue_full` (the exporter is behind) or `export_failed` (the collector refused or is
    /// away).
    pub reason: &'static str,
}

impl TraceMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            exported: Counter::default(),
            dropped: Family::default(),
        };
        registry.register(
            "kvroute_otlp_spans_exported",
            "Spans the OTLP collector accepted",
            m.exported.clone(),
        );
        registry.register(
            "kvroute_otlp_spans_dropped",
            "Spans dropped: the export queue was full, or the collector refused or was away",
            m.dropped.clone(),
        );
        for reason in ["queue_full", "export_failed"] {
            let _ = m.dropped.get_or_create(&DropLabels { reason });
        }
        m
    }
}

/// Starts request spans and queues finished ones for the exporter.
#[derive(Debug)]
pub struct Tracer {
    /// Roots are sampled when their trace id's low 64 bits are under this.
    bound: u64,
    always: bool,
    tx: mpsc::Sender<proto::Span>,
    /// Taken by the exporter task when serving starts.
    rx: Mutex<Option<mpsc::Receiver<proto::Span>>>,
    pub settings: TraceSettings,
    pub metrics: TraceMetrics,
}

/// A W3C trace context: `traceparent`'s ids and flags, and the `tracestate` beside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

impl Parent {
    /// A `traceparent` header (`00-<32 hex>-<16 hex>-<2 hex>`, any version but `ff`, ids not
    /// all zero), or `None` when it is malformed: then the request starts a new trace.
    pub fn parse(value: &[u8]) -> Option<Self> {
        let s = std::str::from_utf8(value).ok()?.trim();
        let mut parts = s.split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version.len() != 2 || version.eq_ignore_ascii_case("ff") || flags.len() != 2 {
            return None;
        }
        // Version 00 has exactly four fields; later ones may add more.
        if version == "00" && parts.next().is_some() {
            return None;
        }
        let _ = u8::from_str_radix(version, 16).ok()?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        let trace_id: [u8; 16] = hex(trace)?;
        let span_id: [u8; 8] = hex(span)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(Self {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
        })
    }
}

fn hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Lowercase hex, as `traceparent` writes ids.
pub fn to_hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(2 * bytes.len()), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn new_span_id() -> [u8; 8] {
    loop {
        let id: [u8; 8] = rand::random();
        if id != [0; 8] {
            return id;
        }
    }
}

impl Tracer {
    pub fn new(settings: TraceSettings, metrics: TraceMetrics) -> Self {
        let ratio = settings.sampling_ratio.clamp(0.0, 1.0);
        let (tx, rx) = mpsc::channel(QUEUE);
        Self {
            bound: (ratio * u64::MAX as f64) as u64,
            always: ratio >= 1.0,
            tx,
            rx: Mutex::new(Some(rx)),
            settings,
            metrics,
        }
    }

    /// The span of a request, when it is sampled: continuing `parent` (the client's
    /// `traceparent`, with its `tracestate`) or starting a trace. `name` is called only for a
    /// sampled request.
    pub fn start(
        self: &Arc<Self>,
        name: impl FnOnce() -> String,
        parent: Option<&Parent>,
        trace_state: Option<&HeaderValue>,
    ) -> Option<Arc<RequestSpan>> {
        let (trace_id, parent_span) = match parent {
            Some(p) if !p.sampled => return None,
            Some(p) => (p.trace_id, Some(p.span_id)),
            None => {
                let id: [u8; 16] = loop {
                    let id: [u8; 16] = rand::random();
                    if id != [0; 16] {
                        break id;
                    }
                };
                let low = u64::from_be_bytes(id[8..].try_into().expect("8 bytes"));
                if !self.always && low >= self.bound {
                    return None;
                }
                (id, None)
            }
        };
        Some(Arc::new(RequestSpan {
            tracer: self.clone(),
            trace_id,
            span_id: new_span_id(),
            parent: parent_span,
            trace_state: trace_state
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned(),
            name: name(),
            start: unix_nanos(),
            started: Instant::now(),
            fields: Mutex::new(Fields::default()),
        }))
    }

    /// Queues a finished span, or drops it (counted) when the queue is full.
    fn send(&self, span: proto::Span) {
        if self.tx.try_send(span).is_err() {
            self.metrics
                .dropped
                .get_or_create(&DropLabels {
                    reason: "queue_full",
                })
                .inc();
        }
    }

    /// The receiving end, for the exporter (once).
    pub fn take_receiver(&self) -> Option<mpsc::Receiver<proto::Span>> {
        self.rx.lock().expect("not poisoned").take()
    }
}

/// What a request span learns as the request goes.
#[derive(Debug, Default)]
struct Fields {
    attributes: Vec<KeyValue>,
    error: Option<String>,
    ttft_set: bool,
    ended: bool,
}

impl Fields {
    fn set(&mut self, key: &'static str, value: Value) {
        match self.attributes.iter_mut().find(|kv| kv.key == key) {
            Some(kv) => kv.value = Some(proto::AnyValue { value: Some(value) }),
            None => self.attributes.push(KeyValue::new(key, value)),
        }
    }
}

/// A traced request's server span; ended (and queued for export) by [`RequestSpan::end`],
/// which the response body calls when it ends or is dropped.
#[derive(Debug)]
pub struct RequestSpan {
    tracer: Arc<Tracer>,
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent: Option<[u8; 8]>,
    trace_state: String,
    name: String,
    start: u64,
    started: Instant,
    fields: Mutex<Fields>,
}

impl RequestSpan {
    fn fields(&self) -> std::sync::MutexGuard<'_, Fields> {
        self.fields.lock().expect("not poisoned")
    }

    /// The trace id, as `traceparent` writes it.
    pub fn trace_id(&self) -> String {
        to_hex(&self.trace_id)
    }

    pub fn set_str(&self, key: &'static str, value: impl Into<String>) {
        self.fields().set(key, Value::String(value.into()));
    }

    pub fn set_int(&self, key: &'static str, value: i64) {
        self.fields().set(key, Value::Int(value));
    }

    pub fn set_double(&self, key: &'static str, value: f64) {
        self.fields().set(key, Value::Double(value));
    }

    /// Adds `n` to an integer attribute (0 when unset).
    pub fn add(&self, key: &'static str, n: i64) {
        let mut f = self.fields();
        let now = f
            .attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| match kv.value.as_ref()?.value {
                Some(Value::Int(i)) => Some(i),
                _ => None,
            })
            .unwrap_or(0);
        f.set(key, Value::Int(now + n));
    }

    /// Marks the span failed.
    pub fn error(&self, message: impl Into<String>) {
        self.fields().error = Some(message.into());
    }

    /// The time to the first byte of the answer's body, once.
    pub fn first_byte(&self) {
        let mut f = self.fields();
        if !f.ttft_set {
            f.ttft_set = true;
            let ms = self.started.elapsed().as_secs_f64() * 1e3;
            f.set("kvroute.ttft_ms", Value::Double(ms));
        }
    }

    /// Ends the span (once) and queues it.
    pub fn end(&self) {
        let span = {
            let mut f = self.fields();
            if f.ended {
                return;
            }
            f.ended = true;
            proto::Span {
                trace_id: self.trace_id.to_vec(),
                span_id: self.span_id.to_vec(),
                trace_state: self.trace_state.clone(),
                parent_span_id: self.parent.map(|p| p.to_vec()).unwrap_or_default(),
                name: self.name.clone(),
                kind: proto::SPAN_KIND_SERVER,
                start_time_unix_nano: self.start,
                end_time_unix_nano: self.start + self.started.elapsed().as_nanos() as u64,
                attributes: std::mem::take(&mut f.attributes),
                status: f.error.take().map(|message| proto::Status {
                    message,
                    code: proto::STATUS_ERROR,
                }),
                // Sampled; bit 8 says whether bit 9 (a remote parent) is known.
                flags: 0x01 | 0x100 | if self.parent.is_some() { 0x200 } else { 0 },
            }
        };
        self.tracer.send(span);
    }

    /// A child span for one upstream attempt to `worker`.
    pub fn attempt(self: &Arc<Self>, worker: &str, dp_rank: Option<u32>, n: u32) -> AttemptSpan {
        let mut attributes = vec![
            KeyValue::new("kvroute.worker", Value::String(worker.to_owned())),
            KeyValue::new("kvroute.attempt", Value::Int(n.into())),
        ];
        if let Some(rank) = dp_rank {
            attributes.push(KeyValue::new("kvroute.dp_rank", Value::Int(rank.into())));
        }
        AttemptSpan {
            request: self.clone(),
            name: String::from("upstream"),
            span_id: new_span_id(),
            start: unix_nanos(),
            started: Instant::now(),
            attributes,
            error: None,
        }
    }
}

/// One upstream attempt's client span, ended when it is dropped (with the attempt's answer
/// body, or at its failure).
#[derive(Debug)]
pub struct AttemptSpan {
    request: Arc<RequestSpan>,
    name: String,
    span_id: [u8; 8],
    start: u64,
    started: Instant,
    attributes: Vec<KeyValue>,
    error: Option<String>,
}

impl AttemptSpan {
    /// Names the span (`prefill`, `decode`; `upstream` by default).
    pub fn named(mut self, name: &str) -> Self {
        name.clone_into(&mut self.name);
        self
    }

    /// The `traceparent` the worker gets: this span as its parent, sampled.
    pub fn traceparent(&self) -> HeaderValue {
        let value = format!(
            "00-{}-{}-01",
            to_hex(&self.request.trace_id),
            to_hex(&self.span_id)
        );
        HeaderValue::from_str(&value).expect("hex is a valid header value")
    }

    pub fn status(&mut self, status: u16) {
        self.attributes.push(KeyValue::new(
            "http.response.status_code",
            Value::Int(status.into()),
        ));
        if status >= 500 {
            self.error = Some(format!("the worker answered {status}"));
        }
    }

    pub fn error(&mut self, message: String) {
        self.error = Some(message);
    }
}

impl Drop for AttemptSpan {
    fn drop(&mut self) {
        let r = &self.request;
        let span = proto::Span {
            trace_id: r.trace_id.to_vec(),
            span_id: self.span_id.to_vec(),
            trace_state: r.trace_state.clone(),
            parent_span_id: r.span_id.to_vec(),
            name: std::mem::take(&mut self.name),
            kind: proto::SPAN_KIND_CLIENT,
            start_time_unix_nano: self.start,
            end_time_unix_nano: self.start + self.started.elapsed().as_nanos() as u64,
            attributes: std::mem::take(&mut self.attributes),
            status: self.error.take().map(|message| proto::Status {
                message,
                code: proto::STATUS_ERROR,
            }),
            flags: 0x01 | 0x100,
        };
        r.tracer.send(span);
    }
}

/// A response body that ends its request's span when it ends, fails or is dropped, and
/// records the time to its first data frame.
#[derive(Debug)]
pub struct Traced<B> {
    inner: B,
    span: Arc<RequestSpan>,
}

impl<B> Traced<B> {
    pub fn new(inner: B, span: Arc<RequestSpan>) -> Self {
        Self { inner, span }
    }
}

impl<B> http_body::Body for Traced<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, B::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(Some(Ok(frame))) if frame.is_data() => self.span.first_byte(),
            std::task::Poll::Ready(Some(Err(e))) => self.span.error(format!("body failed: {e}")),
            std::task::Poll::Ready(None) => self.span.end(),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for Traced<B> {
    fn drop(&mut self) {
        self.span.end();
    }
}
