//! Forwarding one request to one worker, and streaming its answer back.
//!
//! The request body is sent as the bytes that came in. The answer's body is passed through
//! frame by frame as the worker produces it (an SSE stream is never buffered), wrapped in
//! [`TrackedBody`], which owns the worker's in-flight guard: the count drops when the body
//! ends, when the client goes away (hyper drops the body) and when the worker fails
//! mid-stream.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::error::GatewayError;
use crate::workers::Worker;

pub const WORKER_HEADER: HeaderName = HeaderName::from_static("x-kvroute-worker");
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The one pooled keep-alive HTTP/1.1 client to the workers.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn build_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_keepalive(Some(Duration::from_secs(60)));
    connector.set_connect_timeout(Some(Duration::from_secs(10)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .build(connector)
}

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

/// Counts one request in flight on a worker for as long as it lives.
#[derive(Debug)]
pub struct InFlight {
    worker: Arc<Worker>,
}

impl InFlight {
    pub fn new(worker: Arc<Worker>) -> Self {
        worker.begin_request();
        Self { worker }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.worker.end_request();
    }
}

/// A worker's response body, carrying the request's in-flight guard.
#[derive(Debug)]
pub struct TrackedBody {
    inner: Incoming,
    _guard: InFlight,
}

impl Body for TrackedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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
}

/// Sends `fwd` to `guard`'s worker; the answer's body keeps the guard.
pub async fn forward(
    client: &HttpClient,
    guard: InFlight,
    fwd: Forward<'_>,
) -> Result<Response<TrackedBody>, GatewayError> {
    let worker = &guard.worker;
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
    for (name, value) in fwd.headers {
        if !is_hop_by_hop(name) && name != REQUEST_ID_HEADER {
            headers.append(name.clone(), value.clone());
        }
    }
    headers.insert(REQUEST_ID_HEADER, fwd.request_id.clone());

    let response = match tokio::time::timeout(fwd.timeout, client.request(req)).await {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            return Err(GatewayError::Upstream {
                worker: worker.id.clone(),
                source: e.into(),
            })
        }
        Err(_) => {
            return Err(GatewayError::UpstreamTimeout {
                worker: worker.id.clone(),
                secs: fwd.timeout.as_secs(),
            })
        }
    };
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    if let Ok(v) = HeaderValue::from_str(worker.id.as_str()) {
        parts.headers.insert(WORKER_HEADER, v);
    }
    parts
        .headers
        .entry(REQUEST_ID_HEADER)
        .or_insert_with(|| fwd.request_id.clone());
    Ok(Response::from_parts(
        parts,
        TrackedBody {
            inner: body,
            _guard: guard,
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
