//! The usage tap: what a response cost in tokens, reported to whoever subscribed once the
//! response is over.
//!
//! [`tap`] wraps a response's body. The body goes through untouched (each frame passed on as
//! it comes); on the side, a [`Meter`] reads it:
//! - **an event stream** (`text/event-stream`): each `data:` line's `usage` when it has one
//!   (OpenAI's `prompt_tokens`/`completion_tokens`, running with vLLM's
//!   `continuous_usage_stats`; Anthropic's `message_start.message.usage.input_tokens` and
//!   `message_delta.usage.output_tokens`), the latest winning; and the content chunks it
//!   counts (a chunk with `choices`, or Anthropic's `content_block_delta`), one token each;
//! - **anything else**: the body as one JSON document (up to [`MAX_JSON`]) with its `usage`
//!   (either API's names).
//!
//! When the body ends, or is dropped before its end (a client gone, an upstream cut), every
//! subscriber gets the same [`Usage`] once: the prompt as reported, else the router's own
//! count given to [`tap`]; the completion as reported, else the chunks counted.
//!
//! Subscribing is a boxed `FnOnce` pushed on a list ([`Subscribers`]); a response nobody
//! subscribed to is not wrapped at all. The tap knows nothing of its subscribers (rate
//! limits today; fair-share charging and per-tenant token counts can hook the same one).

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use serde_json::Value;

/// The most of a non-streamed body the meter keeps to read its usage.
pub const MAX_JSON: usize = 8 << 20;

/// What a response cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens: as the engine reported them, else the router's count.
    pub prompt: u64,
    /// Completion tokens: as reported, else the content chunks counted.
    pub completion: u64,
    /// Whether the engine reported its usage (else both are the router's estimates).
    pub reported: bool,
    /// Whether the body reached its end (else it was dropped early).
    pub ended: bool,
}

impl Usage {
    pub fn total(&self) -> u64 {
        self.prompt + self.completion
    }
}

/// One subscriber: called once with the response's usage.
pub type Subscriber = Box<dyn FnOnce(&Usage) + Send>;

/// The subscribers of one response's tap.
#[derive(Default)]
pub struct Subscribers(Vec<Subscriber>);

impl std::fmt::Debug for Subscribers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Subscribers({})", self.0.len())
    }
}

impl Subscribers {
    pub fn add(&mut self, f: impl FnOnce(&Usage) + Send + 'static) {
        self.0.push(Box::new(f));
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn report(&mut self, usage: &Usage) {
        for f in self.0.drain(..) {
            f(usage);
        }
    }
}

/// How a body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Server-sent events, one JSON document per `data:` line.
    Sse,
    /// One JSON document.
    Json,
}

impl Framing {
    /// The framing of a response with these headers.
    pub fn of(headers: &http::HeaderMap) -> Framing {
        let sse = headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if sse {
            Framing::Sse
        } else {
            Framing::Json
        }
    }
}

/// Reads the usage of a body given to it piece by piece; see the module docs.
#[derive(Debug)]
pub struct Meter {
    framing: Framing,
    prompt: Option<u64>,
    completion: Option<u64>,
    chunks: u64,
    /// The event stream's unfinished line, or the JSON body so far.
    pending: Vec<u8>,
    /// The JSON body outgrew [`MAX_JSON`]: its usage is not read.
    overflow: bool,
}

impl Meter {
    pub fn new(framing: Framing) -> Self {
        Self {
            framing,
            prompt: None,
            completion: None,
            chunks: 0,
            pending: Vec::new(),
            overflow: false,
        }
    }

    /// Reads the next piece of the body.
    pub fn observe(&mut self, bytes: &[u8]) {
        match self.framing {
            Framing::Json if self.overflow => {}
            Framing::Json if self.pending.len() + bytes.len() > MAX_JSON => {
                self.overflow = true;
                self.pending = Vec::new();
            }
            Framing::Json => self.pending.extend_from_slice(bytes),
            Framing::Sse => {
                let mut rest = bytes;
                while let Some(i) = memchr::memchr(b'\n', rest) {
                    if self.pending.is_empty() {
                        self.line(&rest[..i]);
                    } else {
                        self.pending.extend_from_slice(&rest[..i]);
                        let line = std::mem::take(&mut self.pending);
                        self.line(&line);
                    }
                    rest = &rest[i + 1..];
                }
                self.pending.extend_from_slice(rest);
            }
        }
    }

    /// The usage so far: `prompt_estimate` stands in for a prompt never reported.
    pub fn usage(&mut self, prompt_estimate: u64, ended: bool) -> Usage {
        if self.framing == Framing::Json && !self.pending.is_empty() {
            if let Ok(v) = serde_json::from_slice::<Value>(&self.pending) {
                self.read_usage(&v["usage"]);
            }
            self.pending = Vec::new();
        }
        Usage {
            prompt: self.prompt.unwrap_or(prompt_estimate),
            completion: self.completion.unwrap_or(self.chunks),
            reported: self.prompt.is_some() || self.completion.is_some(),
            ended,
        }
    }

    /// One line of the event stream.
    fn line(&mut self, line: &[u8]) {
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        if memchr::memmem::find(data, b"\"content_block_delta\"").is_some() || has_choices(data) {
            self.chunks += 1;
        }
        if memchr::memmem::find(data, b"\"usage\"").is_none() {
            return;
        }
        let Ok(v) = serde_json::from_slice::<Value>(data) else {
            return;
        };
        // Anthropic's message_start carries the usage inside its message.
        self.read_usage(&v["message"]["usage"]);
        self.read_usage(&v["usage"]);
    }

    /// A `usage` object, in either API's names.
    fn read_usage(&mut self, u: &Value) {
        let n = |k: &str| u.get(k).and_then(Value::as_u64);
        if let Some(p) = n("prompt_tokens").or(n("input_tokens")) {
            self.prompt = Some(p);
        }
        if let Some(c) = n("completion_tokens").or(n("output_tokens")) {
            self.completion = Some(c);
        }
    }
}

/// Whether an OpenAI chunk has a non-empty `choices` list.
fn has_choices(data: &[u8]) -> bool {
    const KEY: &[u8] = b"\"choices\"";
    let Some(at) = memchr::memmem::find(data, KEY) else {
        return false;
    };
    let rest = data[at + KEY.len()..].trim_ascii_start();
    let rest = rest.strip_prefix(b":").unwrap_or(rest).trim_ascii_start();
    rest.starts_with(b"[") && !rest[1..].trim_ascii_start().starts_with(b"]")
}

/// Wraps `response`'s body so that `subscribers` get its usage once it is over;
/// `prompt_estimate` is the router's count of the prompt. Without subscribers, the response
/// is returned as it is.
pub fn tap(response: Response, prompt_estimate: u64, subscribers: Subscribers) -> Response {
    if subscribers.is_empty() {
        return response;
    }
    let meter = Meter::new(Framing::of(response.headers()));
    response.map(|inner| {
        Body::new(Tapped {
            inner,
            meter,
            prompt_estimate,
            subscribers,
        })
    })
}

/// A body read by a [`Meter`] on its way through.
struct Tapped {
    inner: Body,
    meter: Meter,
    prompt_estimate: u64,
    subscribers: Subscribers,
}

impl Tapped {
    fn report(&mut self, ended: bool) {
        if !self.subscribers.is_empty() {
            let usage = self.meter.usage(self.prompt_estimate, ended);
            self.subscribers.report(&usage);
        }
    }
}

impl HttpBody for Tapped {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.meter.observe(data);
                }
            }
            Poll::Ready(None) => self.report(true),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Tapped {
    fn drop(&mut self) {
        self.report(false);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use http_body_util::BodyExt;

    use super::*;

    fn metered(framing: Framing, pieces: &[&str], estimate: u64) -> Usage {
        let mut m = Meter::new(framing);
        for p in pieces {
            m.observe(p.as_bytes());
        }
        m.usage(estimate, true)
    }

    #[test]
    fn openai_streams_take_the_latest_usage_else_count_chunks() {
        let chunk = r#"data: {"id":"a","choices":[{"index":0,"delta":{"content":"x"}}]}"#;
        let usage =
            r#"data: {"id":"a","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}"#;
        // Split mid-line, across pieces.
        let text = format!("{chunk}\n\n{chunk}\n\n{usage}\n\ndata: [DONE]\n\n");
        let (a, b) = text.split_at(30);
        let u = metered(Framing::Sse, &[a, b], 99);
        assert_eq!((u.prompt, u.completion, u.reported), (7, 3, true));
        // No usage: the chunks counted, the prompt estimated.
        let text = format!("{chunk}\n\n{chunk}\n\ndata: {{\"choices\": [ ]}}\n\ndata: [DONE]\n\n");
        let u = metered(Framing::Sse, &[&text], 99);
        assert_eq!((u.prompt, u.completion, u.reported), (99, 2, false));
    }

    #[test]
    fn anthropic_streams_and_both_apis_whole_answers() {
        let text = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":12,\"output_tokens\":1}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"a\"}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":5}}\n\n",
        );
        let u = metered(Framing::Sse, &[text], 0);
        assert_eq!((u.prompt, u.completion), (12, 5));
        let openai = r#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":6}}"#;
        let (a, b) = openai.split_at(10);
        assert_eq!(metered(Framing::Json, &[a, b], 0).total(), 10);
        let anthropic = r#"{"type":"message","usage":{"input_tokens":2,"output_tokens":3}}"#;
        assert_eq!(metered(Framing::Json, &[anthropic], 0).total(), 5);
        let u = metered(Framing::Json, &["not json"], 8);
        assert_eq!((u.prompt, u.completion, u.reported), (8, 0, false));
    }

    fn subscribed() -> (Subscribers, Arc<Mutex<Vec<Usage>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut subs = Subscribers::default();
        for _ in 0..2 {
            let seen = seen.clone();
            subs.add(move |u| seen.lock().unwrap().push(*u));
        }
        (subs, seen)
    }

    #[tokio::test]
    async fn every_subscriber_hears_once_at_the_end_or_when_dropped() {
        let sse = |body: &'static str| {
            http::Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from(body))
                .unwrap()
        };
        let (subs, seen) = subscribed();
        let body = "data: {\"choices\":[{\"delta\":{}}]}\n\n";
        let tapped = tap(sse(body), 5, subs);
        let bytes = tapped.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(bytes, body, "the body goes through untouched");
        let expected = Usage {
            prompt: 5,
            completion: 1,
            reported: false,
            ended: true,
        };
        assert_eq!(*seen.lock().unwrap(), vec![expected; 2]);

        let (subs, seen) = subscribed();
        drop(tap(sse(body), 5, subs));
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 2);
        assert!(!seen[0].ended);
        assert_eq!(seen[0].completion, 0, "nothing was read");
    }
}
