//! Request migration: a stream whose worker fails after the client has been sent its first
//! bytes goes on from another worker, and the client sees one uninterrupted stream.
//!
//! A failure is the connection cut or reset, an end without `[DONE]`, no bytes for
//! `--migration-stall-timeout-secs`, or an error event with a 5xx code. Then, up to
//! `--migration-limit` times per request, the request is sent afresh (a new decision of the
//! policy, every worker it failed on excluded) with what was delivered so far appended
//! ([`stream::continuation`]), and the new worker's chunks are stitched on
//! ([`stream::Editor`]). The failed worker's in-flight count is released at once (its guard
//! is dropped) and its circuit counts the failure. A request that cannot go on (`n > 1`,
//! logprobs, a prompt that is not text, no worker left, the limit reached) ends as before:
//! the tokens sent, then an error event and no `[DONE]`.
//!
//! What is not promised: the continuation re-tokenises the delivered text, so token
//! identity across the cut is not kept, nor a stop string that spans it.

use std::time::Duration;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;
use http::Response;
use http_body_util::BodyExt;
use kvroute_protocol::WorkerId;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde_json::Value;

use crate::error::GatewayError;
use crate::metrics::MigrationLabels;
use crate::proxy::TrackedBody;

pub mod stream;

use stream::{continuation, Api, Editor, UsageWanted};

/// A request sent to a worker that answered: its response and who it was.
#[derive(Debug)]
pub struct Sent {
    pub response: Response<TrackedBody>,
    pub worker: WorkerId,
    /// Pinned (a hint or hard affinity): never moved elsewhere.
    pub pinned: bool,
}

/// Sends a continuation (its body) to a worker other than the excluded ones.
pub type Resend =
    Box<dyn FnMut(Bytes, Vec<WorkerId>) -> BoxFuture<'static, Result<Sent, GatewayError>> + Send>;

/// `kvroute_request_migrations_total{outcome}`: `migrated`, `limit_reached`, `no_worker`,
/// `not_migratable`, `completed` (nothing was left to generate).
pub type MigrationMetrics = Family<MigrationLabels, Counter>;

fn count(metrics: &MigrationMetrics, outcome: &'static str) {
    metrics.get_or_create(&MigrationLabels { outcome }).inc();
}

/// The settings a stream migrates under.
#[derive(Debug, Clone)]
pub struct Migration {
    pub api: Api,
    /// The client's request, as it sent it (parsed only when the stream fails).
    pub original: Bytes,
    /// Migrations left; `Err(why)` when this request may not migrate (a pin).
    pub allowed: Result<u32, &'static str>,
    /// The usage the client asked for, when the router asked for more (what it did not ask
    /// for is stripped); `None` when the request went as it came (usage passes through).
    pub wanted: Option<UsageWanted>,
    pub stall: Duration,
    pub metrics: MigrationMetrics,
    /// The request's trace span, counting its migrations.
    pub span: Option<std::sync::Arc<crate::otlp::RequestSpan>>,
}

/// The body of a migrating stream.
struct Migrating {
    m: Migration,
    editor: Editor,
    body: Option<TrackedBody>,
    worker: WorkerId,
    failed: Vec<WorkerId>,
    resend: Resend,
    /// A failure seen after bytes that were still to be sent.
    pending: Option<String>,
    ended: bool,
}

/// Wraps `sent`'s body so that the stream migrates when its worker fails.
pub fn migrating(m: Migration, sent: Sent, resend: Resend) -> Response<Body> {
    let wanted = m.wanted.unwrap_or(UsageWanted {
        last: true,
        every: true,
    });
    let (parts, mut body) = sent.response.into_parts();
    body.raw_errors();
    let state = Migrating {
        editor: Editor::new(m.api, wanted),
        m,
        body: Some(body),
        worker: sent.worker,
        failed: Vec::new(),
        resend,
        pending: None,
        ended: false,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        s.next().await.map(|frame| (frame, s))
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

impl Migrating {
    async fn next(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        loop {
            if self.ended {
                return None;
            }
            if let Some(reason) = self.pending.take() {
                if let Some(last) = self.recover(reason).await {
                    return Some(Ok(last));
                }
                continue;
            }
            let body = self.body.as_mut()?;
            let mut out = BytesMut::new();
            let failure = match tokio::time::timeout(self.m.stall, body.frame()).await {
                Err(_) => {
                    body.worker()
                        .circuit
                        .record(false, std::time::Instant::now());
                    Some(format!("no bytes for {} s", self.m.stall.as_secs()))
                }
                Ok(None) if self.editor.is_done() => {
                    self.ended = true;
                    return None;
                }
                Ok(None) => {
                    body.worker()
                        .circuit
                        .record(false, std::time::Instant::now());
                    Some("the stream ended before [DONE]".to_owned())
                }
                // The body has counted it against the circuit.
                Ok(Some(Err(error))) => Some(error.to_string()),
                Ok(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => match self.editor.feed(&data, &mut out) {
                        Ok(()) => None,
                        Err(failure) => {
                            body.worker()
                                .circuit
                                .record(false, std::time::Instant::now());
                            Some(failure.0)
                        }
                    },
                    Err(_) => None,
                },
            };
            match failure {
                None if out.is_empty() => continue,
                None => return Some(Ok(out.freeze())),
                Some(reason) if out.is_empty() => {
                    if let Some(last) = self.recover(reason).await {
                        return Some(Ok(last));
                    }
                }
                Some(reason) => {
                    self.pending = Some(reason);
                    return Some(Ok(out.freeze()));
                }
            }
        }
    }

    /// Carries the request on elsewhere after its worker failed for `reason`; the last
    /// event when it cannot (the stream then ends).
    async fn recover(&mut self, reason: String) -> Option<Bytes> {
        // Release the failed worker at once.
        self.body = None;
        let from = self.worker.clone();
        self.failed.push(from.clone());
        let mut left = match self.m.allowed {
            Ok(left) => left,
            Err(why) => return Some(self.give_up(&from, &reason, "not_migratable", why)),
        };
        // The client's request, parsed now that it is needed.
        let original = match serde_json::from_slice::<Value>(&self.m.original) {
            Ok(v) => v,
            Err(_) => {
                let why = "the request is not JSON";
                return Some(self.give_up(&from, &reason, "not_migratable", why));
            }
        };
        if let Some(why) = stream::unmigratable(self.m.api, &original) {
            return Some(self.give_up(&from, &reason, "not_migratable", why));
        }
        loop {
            if left == 0 {
                return Some(self.give_up(
                    &from,
                    &reason,
                    "limit_reached",
                    "migration limit reached",
                ));
            }
            let delivered = (self.editor.text(), self.editor.tokens());
            let Some(next) = continuation(self.m.api, &original, delivered.0, delivered.1) else {
                // Every token asked for was delivered: the stream is complete.
                count(&self.m.metrics, "completed");
                self.ended = true;
                return Some(Bytes::from_static(b"data: [DONE]\n\n"));
            };
            let (body, _) = stream::with_usage_stats(self.m.api, &Bytes::from(next.to_string()));
            left -= 1;
            self.m.allowed = Ok(left);
            let sent = (self.resend)(body, self.failed.clone()).await;
            match sent {
                Ok(sent) if sent.response.status().is_success() => {
                    tracing::warn!(from = %from, to = %sent.worker, reason, delivered_tokens = delivered.1, "Stream migrated to another worker");
                    count(&self.m.metrics, "migrated");
                    if let Some(span) = &self.m.span {
                        span.add("kvroute.migrations", 1);
                    }
                    self.editor.continue_elsewhere();
                    let mut body = sent.response.into_body();
                    body.raw_errors();
                    self.body = Some(body);
                    self.worker = sent.worker;
                    return None;
                }
                Ok(sent) => {
                    tracing::warn!(worker = %sent.worker, status = sent.response.status().as_u16(), "Continuation refused; trying another worker");
                    self.failed.push(sent.worker);
                }
                Err(error) => {
                    let why = format!("no worker to continue on: {error}");
                    return Some(self.give_up(&from, &reason, "no_worker", &why));
                }
            }
        }
    }

    fn give_up(
        &mut self,
        worker: &WorkerId,
        reason: &str,
        outcome: &'static str,
        why: &str,
    ) -> Bytes {
        count(&self.m.metrics, outcome);
        self.ended = true;
        tracing::warn!(worker = %worker, reason, why, "Worker failed mid-stream; not migrated");
        let event = serde_json::json!({"error": {
            "message": format!("worker {worker} failed mid-stream: {reason} (not migrated: {why})"),
            "type": "server_error",
            "code": "upstream_error",
        }});
        Bytes::from(format!("data: {event}\n\n"))
    }
}
