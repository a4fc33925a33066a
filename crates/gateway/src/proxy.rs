//! Forwarding one request to one worker, and streaming its answer back.
//!
//! The request body is sent as the bytes that came in. The answer's body is passed through
//! frame by frame as the worker produces it (an SSE stream is never buffered), wrapped in
//! [`TrackedBody`], which owns the request's in-flight guard ([`InFlight`]): the worker's
//! count and the rank's load drop when the body ends, when the client goes away (hyper
//! drops the body) and when the worker fails mid-stream.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;

use kvroute_core::latency::{DecodeFeatures, PrefillFeatures};
use kvroute_core::RequestLoad;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::OwnedSemaphorePermit;

use crate::auth::WorkerAuth;
use crate::error::GatewayError;
use crate::http::{
    HttpClient, PooledBody, DP_RANK_HEADER, ENGINE_DP_RANK_HEADER, REQUEST_ID_HEADER, WORKER_HEADER,
};
use crate::metrics::Outcome;
use crate::queue::AdmissionQueue;
use crate::workers::{LatencySample, Worker};

/// smg's name for the routed worker, beside [`WORKER_HEADER`].
pub const SMG_ROUTED_HEADER: HeaderName = HeaderName::from_static("x-smg-routed-worker-id");

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// Hop-by-hop headers (RFC 9110 7.6.1) and the ones the proxy sets itself.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    name == header::CONNECTION
        || name == header::TRANSFER_ENCODING
        || name == header::TE
        || name == header::TRAILER
        || name == header::UPGRADE
        || name == header::PROXY_AUTHORIZATION
        || name == header::PROXY_AUTHENTICATE
        || name == header::HOST
        || name == header::CONTENT_LENGTH
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// The tokens in a chunk of an event stream: its `data:` lines but `[DONE]`, as engines
/// stream a token an event (a role-only or usage-only event counts one too).
fn sse_tokens(chunk: &[u8]) -> u64 {
    chunk
        .split(|&b| b == b'\n')
        .filter_map(|line| line.strip_prefix(b"data:"))
        .filter(|data| !data.trim_ascii().starts_with(b"[DONE]"))
        .count() as u64
}

/// Counts one request in flight on a worker and rank, with its prefill and decode load,
/// for as long as it lives. The prefill load ends at the first body frame (for a
/// non-streaming request, the whole answer: its prefill count is held until then).
#[derive(Debug)]
pub struct InFlight {
    worker: Arc<Worker>,
    rank: usize,
    load: RequestLoad,
    first_frame_seen: bool,
    /// For streaming requests: when the request arrived, and where its TTFT goes.
    ttft: Option<(Instant, Histogram)>,
    /// Told when this request frees capacity (first token, end).
    queue: Option<Arc<AdmissionQueue>>,
    /// Router replicas told of its load (replica sync), with its id among this replica's.
    sync: Option<(crate::sync::transport::SyncHandle, u64)>,
    /// The attempt's trace span, when the request is traced; ends with the guard.
    span: Option<crate::otlp::AttemptSpan>,
    /// A stream's timings, for its rank's latency models.
    timing: Option<StreamTiming>,
    /// The request's latency targets, when it has some: their outcomes are counted.
    slo: Option<crate::metrics::SloWatch>,
}

/// What a stream's timings feed its rank's latency models with: the TTFT from the dispatch
/// (with the features the router saw), each gap between data frames (a frame per token, as
/// engines stream), and the tokens in all.
#[derive(Debug)]
struct StreamTiming {
    /// `None`: the gaps only (a disaggregated decode half, whose first token is not its
    /// own prefill's).
    features: Option<PrefillFeatures>,
    /// Whether its gaps and length teach the decode model (not a prefill half's answer).
    decodes: bool,
    sent: Instant,
    last: Option<Instant>,
    frames: u64,
}

impl InFlight {
    pub fn new(
        worker: Arc<Worker>,
        rank: usize,
        load: RequestLoad,
        queue: Option<Arc<AdmissionQueue>>,
    ) -> Self {
        worker.begin_request();
        worker.ranks[rank].start(&load);
        Self {
            worker,
            rank,
            load,
            first_frame_seen: false,
            ttft: None,
            queue,
            sync: None,
            span: None,
            timing: None,
            slo: None,
        }
    }

    /// Counts the outcomes of the request's latency targets from this attempt's answer.
    pub fn with_slo(mut self, watch: Option<crate::metrics::SloWatch>) -> Self {
        self.slo = watch;
        self
    }

    /// Feeds the rank's latency models from this stream (routed with `features`).
    pub fn with_timing(self, features: PrefillFeatures) -> Self {
        self.timed(Some(features), true)
    }

    /// Feeds the rank's decode model from this stream's gaps, not its TTFT model.
    pub fn with_gap_timing(self) -> Self {
        self.timed(None, true)
    }

    /// Feeds the rank's TTFT model from the answer's first byte only (a disaggregated
    /// prefill half: its answer is one token).
    pub fn with_ttft_timing(self, features: PrefillFeatures) -> Self {
        self.timed(Some(features), false)
    }

    fn timed(mut self, features: Option<PrefillFeatures>, decodes: bool) -> Self {
        self.timing = Some(StreamTiming {
            features,
            decodes,
            sent: Instant::now(),
            last: None,
            frames: 0,
        });
        self
    }

    /// A data frame of the answer: the first ends the prefill; each feeds the timings.
    pub(crate) fn data_frame(&mut self) {
        self.first_frame();
        let now = Instant::now();
        if let Some(w) = &mut self.slo {
            w.data_frame(now);
        }
        let Some(t) = &mut self.timing else {
            return;
        };
        let rank = &self.worker.ranks[self.rank];
        let sample = match (t.last, t.features) {
            (None, Some(features)) => Some(LatencySample::Ttft {
                features,
                ms: (now - t.sent).as_secs_f64() * 1e3,
            }),
            (None, None) => None,
            (Some(_), _) if !t.decodes => None,
            (Some(last), _) => {
                let engine = rank.engine.load(now);
                Some(LatencySample::Gap {
                    features: DecodeFeatures {
                        running: engine.running.unwrap_or(rank.in_flight() as f64),
                        kv_usage: engine.kv_usage.unwrap_or(0.0),
                    },
                    ms: (now - last).as_secs_f64() * 1e3,
                })
            }
        };
        t.last = Some(now);
        t.frames += 1;
        if let Some(sample) = sample {
            rank.observe(sample);
        }
    }

    /// A chunk of the answer's event stream: with output-block tracking, its tokens (see
    /// [`sse_tokens`]) grow the request's decode load.
    pub(crate) fn output(&mut self, chunk: &[u8]) {
        if self.load.output.is_some() {
            let tokens = sse_tokens(chunk);
            self.worker.ranks[self.rank].output_tokens(&mut self.load, tokens);
        }
    }

    /// Traces this attempt: its `traceparent` goes to the worker.
    pub fn with_span(mut self, span: crate::otlp::AttemptSpan) -> Self {
        self.span = Some(span);
        self
    }

    /// Tells the peer replicas about this request's load, now and as it changes.
    pub fn with_sync(
        mut self,
        sync: Option<&crate::sync::transport::SyncHandle>,
        learnt: impl FnOnce() -> crate::sync::Learnt,
    ) -> Self {
        if let Some(handle) = sync {
            let request = handle.request_id();
            let rank = &self.worker.ranks[self.rank];
            let l = learnt();
            handle.send(crate::sync::Message::Routed {
                request,
                model: l.model,
                half: l.half,
                worker: self.worker.id.to_string(),
                dp_rank: rank.dp_rank,
                session_key: l.session_key,
                bind: l.bind,
                text: l.text,
                tokens: l.tokens,
                prefill_tokens: self.load.prefill_tokens,
                blocks: self.load.blocks.clone(),
                own_blocks: self.load.own_blocks,
            });
            self.sync = Some((handle.clone(), request));
        }
        self
    }

    /// Records the time to the first body frame of a streaming request.
    pub fn with_ttft(mut self, arrived: Instant, histogram: Histogram) -> Self {
        self.ttft = Some((arrived, histogram));
        self
    }

    /// The worker the request is counted on.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }

    /// The first byte of the answer: the prefill is over (the TTFT, the queue and the
    /// replicas hear of it once).
    pub(crate) fn first_frame(&mut self) {
        if !self.first_frame_seen {
            self.first_frame_seen = true;
            self.worker.ranks[self.rank].first_token(&self.load);
            if let Some((arrived, histogram)) = &self.ttft {
                histogram.observe(arrived.elapsed().as_secs_f64());
            }
            if let Some(w) = &mut self.slo {
                w.first_frame(Instant::now());
            }
            if let Some(q) = &self.queue {
                q.dispatch();
            }
            if let Some((handle, request)) = &self.sync {
                handle.send(crate::sync::Message::FirstToken { request: *request });
            }
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(t) = self.timing.as_ref().filter(|t| t.frames > 1 && t.decodes) {
            // The last frame of an OpenAI stream is `[DONE]`, usage may be another.
            let tokens = t.frames.saturating_sub(2).max(1) as f64;
            self.worker.ranks[self.rank].observe(LatencySample::Output { tokens });
        }
        self.worker.ranks[self.rank].finish(&self.load, !self.first_frame_seen);
        self.worker.end_request();
        if let Some(q) = &self.queue {
            q.dispatch();
        }
        if let Some((handle, request)) = &self.sync {
            handle.send(crate::sync::Message::Finished { request: *request });
        }
    }
}

/// A request admitted into the router: its place under `--max-concurrent-requests` and
/// its count in `kvroute_requests_in_router`, until its answer is complete.
#[derive(Debug)]
pub struct Admitted {
    _permit: Option<OwnedSemaphorePermit>,
    gauge: Gauge,
    /// Its tokens in flight for `--engine-priority`, until the response ends.
    _in_flight: Option<crate::engine_priority::InFlightGuard>,
}

impl Admitted {
    pub fn new(permit: Option<OwnedSemaphorePermit>, gauge: Gauge) -> Self {
        gauge.inc();
        Self {
            _permit: permit,
            gauge,
            _in_flight: None,
        }
    }

    /// The same, also holding the request's tokens in flight until its response ends.
    pub fn holding(mut self, in_flight: Option<crate::engine_priority::InFlightGuard>) -> Self {
        self._in_flight = in_flight;
        self
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// A worker's response body, carrying the request's in-flight guard.
///
/// When the worker fails in the middle of an event stream (`text/event-stream`), the client
/// gets a last `data: {"error": ...}` event and a clean end of stream instead of a cut
/// connection, and the failure counts against the worker's circuit. Other bodies are cut.
#[derive(Debug)]
pub struct TrackedBody {
    inner: PooledBody,
    guard: InFlight,
    admitted: Option<Admitted>,
    sse: bool,
    /// An Anthropic Messages stream: its error event is Anthropic's.
    anthropic: bool,
    ended: bool,
    /// Migration reads the worker's failure itself: no error event in its place.
    raw_errors: bool,
}

impl TrackedBody {
    /// The worker answering.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.guard.worker
    }

    /// A failure mid-response is returned as the error it is (migration decides what the
    /// client sees), not turned into an error event.
    pub fn raw_errors(&mut self) {
        self.raw_errors = true;
    }

    /// Keeps the request's admission until the body ends.
    pub fn hold(&mut self, admitted: Admitted) {
        self.admitted = Some(admitted);
    }
}

impl Body for TrackedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) if frame.is_data() => {
                self.guard.data_frame();
                if self.sse {
                    if let Some(data) = frame.data_ref() {
                        self.guard.output(data);
                    }
                }
            }
            Poll::Ready(Some(Err(error))) => {
                let worker = self.guard.worker.clone();
                worker.circuit.record(false, Instant::now());
                tracing::warn!(worker = %worker.id, %error, "Worker failed mid-response");
                if self.sse && !self.raw_errors {
                    self.ended = true;
                    let message = format!("worker {} failed mid-stream: {error}", worker.id);
                    let text = if self.anthropic {
                        let event = serde_json::json!({"type": "error", "error": {
                            "type": "api_error", "message": message,
                        }});
                        format!("event: error\ndata: {event}\n\n")
                    } else {
                        let event = serde_json::json!({"error": {
                            "message": message, "type": "server_error", "code": "upstream_error",
                        }});
                        format!("data: {event}\n\n")
                    };
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(text)))));
                }
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Reads a request body of at most `limit` bytes (413 beyond it, also when the declared
/// `content-length` says so before reading).
pub(crate) async fn read_body(
    body: axum::body::Body,
    limit: usize,
    headers: &http::HeaderMap,
) -> Result<Bytes, crate::error::GatewayError> {
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(crate::error::GatewayError::PayloadTooLarge { limit });
    }
    match http_body_util::BodyExt::collect(http_body_util::Limited::new(body, limit)).await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(crate::error::GatewayError::PayloadTooLarge { limit })
        }
        Err(e) => Err(crate::error::GatewayError::BodyRead(e)),
    }
}

/// One request to forward.
#[derive(Debug)]
pub struct Forward<'a> {
    pub method: Method,
    pub path_and_query: &'a str,
    pub headers: &'a HeaderMap,
    pub body: Bytes,
    pub request_id: &'a HeaderValue,
    pub timeout: Duration,
    pub auth: &'a WorkerAuth,
}

/// Sends `fwd` to `guard`'s worker; the answer's body keeps the guard.
pub async fn forward(
    client: &HttpClient,
    guard: InFlight,
    fwd: Forward<'_>,
) -> Result<Response<TrackedBody>, GatewayError> {
    let worker = guard.worker.clone();
    worker.circuit.on_send(Instant::now());
    let result = send(client, guard, fwd).await;
    let outcome = outcome_of(&result);
    worker.series.attempts[outcome as usize].inc();
    worker
        .circuit
        .record(outcome == Outcome::Ok, Instant::now());
    result
}

/// How an attempt ended, for the metrics and the circuit breaker (a 4xx is the client's
/// fault, not the worker's).
fn outcome_of(result: &Result<Response<TrackedBody>, GatewayError>) -> Outcome {
    match result {
        Ok(r) if r.status().is_server_error() => Outcome::ServerError,
        Ok(_) => Outcome::Ok,
        Err(GatewayError::UpstreamTimeout { .. }) => Outcome::Timeout,
        Err(_) => Outcome::ConnectError,
    }
}

async fn send(
    client: &HttpClient,
    mut guard: InFlight,
    fwd: Forward<'_>,
) -> Result<Response<TrackedBody>, GatewayError> {
    let worker = &guard.worker;
    let dp_rank = worker.ranks[guard.rank].dp_rank;
    let mut uri = String::with_capacity(worker.url.len() + fwd.path_and_query.len());
    uri.push_str(&worker.url);
    uri.push_str(fwd.path_and_query);
    let mut req = Request::builder()
        .method(fwd.method)
        .uri(uri)
        .body(Full::new(fwd.body))
        .map_err(|e| GatewayError::Upstream {
            worker: worker.id.clone(),
            source: e.into(),
        })?;
    let headers = req.headers_mut();
    headers.reserve(fwd.headers.len() + 1);
    let pass_auth = matches!(fwd.auth, WorkerAuth::PassThrough);
    for (name, value) in fwd.headers {
        if !is_hop_by_hop(name)
            && name != REQUEST_ID_HEADER
            && (pass_auth || (name != header::AUTHORIZATION && name != crate::auth::API_KEY_HEADER))
        {
            headers.append(name.clone(), value.clone());
        }
    }
    if let WorkerAuth::Set(key) = fwd.auth {
        headers.insert(header::AUTHORIZATION, key.clone());
    }
    headers.insert(REQUEST_ID_HEADER, fwd.request_id.clone());
    if let Some(rank) = dp_rank {
        headers.insert(ENGINE_DP_RANK_HEADER, HeaderValue::from(rank));
    }
    if let Some(span) = &guard.span {
        headers.insert(TRACEPARENT, span.traceparent());
    }

    let response = match tokio::time::timeout(fwd.timeout, client.request(req)).await {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            let error = GatewayError::Upstream {
                worker: worker.id.clone(),
                source: e.into(),
            };
            if let Some(span) = &mut guard.span {
                span.error(error.to_string());
            }
            return Err(error);
        }
        Err(_) => {
            let error = GatewayError::UpstreamTimeout {
                worker: worker.id.clone(),
                secs: fwd.timeout.as_secs(),
            };
            if let Some(span) = &mut guard.span {
                span.error(error.to_string());
            }
            return Err(error);
        }
    };
    if let Some(span) = &mut guard.span {
        span.status(response.status().as_u16());
    }
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if let Ok(v) = HeaderValue::from_str(worker.id.as_str()) {
        parts.headers.insert(WORKER_HEADER, v);
    }
    // smg's: the worker's URL, with `@RANK` for a data-parallel rank.
    let routed = match dp_rank {
        Some(rank) => HeaderValue::from_str(&format!("{}@{rank}", worker.url)),
        None => HeaderValue::from_str(&worker.url),
    };
    if let Ok(v) = routed {
        parts.headers.insert(SMG_ROUTED_HEADER, v);
    }
    if let Some(rank) = dp_rank {
        parts
            .headers
            .insert(DP_RANK_HEADER, HeaderValue::from(rank));
    }
    parts
        .headers
        .entry(REQUEST_ID_HEADER)
        .or_insert_with(|| fwd.request_id.clone());
    Ok(Response::from_parts(
        parts,
        TrackedBody {
            inner: body,
            guard,
            admitted: None,
            sse,
            anthropic: fwd.path_and_query.starts_with("/v1/messages"),
            ended: false,
            raw_errors: false,
        },
    ))
}

/// Drops hop-by-hop headers from a worker's response, keeping its content-length.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let hop: Vec<HeaderName> = headers
        .keys()
        .filter(|n| is_hop_by_hop(n) && *n != header::CONTENT_LENGTH)
        .cloned()
        .collect();
    for name in hop {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::sse_tokens;

    #[test]
    fn an_event_stream_chunk_counts_its_data_events_but_done() {
        let chunk = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"x\":\"data: no\"}\n\n";
        assert_eq!(
            sse_tokens(chunk),
            2,
            "a data: inside the JSON is not an event"
        );
        assert_eq!(sse_tokens(b"data: [DONE]\n\n"), 0);
        assert_eq!(sse_tokens(b"event: ping\n: comment\n\n"), 0);
        assert_eq!(sse_tokens(b"data:{}\r\n\r\n"), 1);
    }
}
