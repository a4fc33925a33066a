//! One ext_proc stream: one HTTP request through the gateway, and its answer.
//!
//! In the processing mode GIE's gateways configure (headers `SEND`, bodies
//! `FULL_DUPLEX_STREAMED`, trailers `SEND`), the messages go:
//! 1. request headers: kept; no answer yet (the destination needs the body);
//! 2. request body pieces: buffered until `end_of_stream`; then the request is routed and
//!    kvroute answers a `HeadersResponse` (the destination header, `clear_route_cache`, the
//!    GIE headers stripped) with the destination in the dynamic metadata, then the body
//!    back as `StreamedBodyResponse` pieces of at most [`BODY_PIECE`] bytes;
//! 3. response headers: passed with `x-kvroute-worker` added;
//! 4. response body pieces: echoed at once, so a stream stays a stream; the first ends the
//!    request's prefill on its rank, the last releases the request;
//! 5. trailers either way: passed.
//!
//! With `BUFFERED` bodies (the first message's `protocol_config` says so), the request
//! headers are answered at once and the destination goes with the body's answer, as a
//! header mutation. A request with no body is routed on its headers. Any failure to route
//! is an `ImmediateResponse` with the proxy's status and JSON error body. The request's
//! in-flight count lives in [`Exchange`]: it is released when the answer ends, and when the
//! stream ends or is cancelled (a client gone, the gateway reset).

use std::sync::Arc;
use std::time::Instant;

use axum::response::IntoResponse;
use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use http_body_util::BodyExt;
use kvroute_protocol::{RoutingFields, WorkerId};
use prost_types::value::Kind;

use super::pb::core::{self as core_pb, header_value_option::HeaderAppendAction};
use super::pb::ext_proc::{
    body_mutation, common_response, processing_request, processing_response, BodyMutation,
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse,
};
use super::pb::mode::processing_mode::BodySendMode;
use super::{DESTINATION_HEADER, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE};
use crate::context::AppState;
use crate::error::GatewayError;
use crate::forward::{self, Attempt};
use crate::http::{ENGINE_DP_RANK_HEADER, WORKER_HEADER};
use crate::proxy::{Admitted, InFlight};
use crate::routing;

/// The largest body piece sent back to the gateway (GIE's limit, under gRPC's 64 KiB frame).
pub const BODY_PIECE: usize = 62_000;

/// GIE's request headers, each with llm-d's older name; stripped before the request goes on.
const OBJECTIVE: [&str; 2] = [
    "x-gateway-inference-objective",
    "x-llm-d-inference-objective",
];
const FAIRNESS_ID: [&str; 2] = [
    "x-gateway-inference-fairness-id",
    "x-llm-d-inference-fairness-id",
];
const MODEL_REWRITE: [&str; 2] = ["x-gateway-model-name-rewrite", "x-llm-d-model-name-rewrite"];

/// The request as its headers describe it.
#[derive(Debug)]
struct Head {
    method: Method,
    path: String,
    headers: HeaderMap,
}

/// The request once routed: the chosen worker's guard (its load, its in-flight count),
/// its place under the router's admission limit, and how its answer is rewritten.
#[derive(Debug)]
struct Routed {
    guard: InFlight,
    _admitted: Admitted,
    worker: WorkerId,
    /// The model name the client sent, when the gateway rewrote it: `(sent, served)`.
    rewrite: Option<(String, String)>,
    first_chunk_seen: bool,
}

/// The state of one ext_proc stream.
#[derive(Debug)]
pub struct Exchange {
    state: Arc<AppState>,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    head: Option<Head>,
    body: BytesMut,
    /// The gateway's subset hint, when it sent one: the `ip:port`s allowed.
    subset: Option<Vec<String>>,
    routed: Option<Routed>,
    /// An immediate response went out: the stream is over.
    pub finished: bool,
}

impl Exchange {
    pub(crate) fn new(state: Arc<AppState>) -> Self {
        Self {
            state,
            request_mode: BodySendMode::FullDuplexStreamed,
            response_mode: BodySendMode::FullDuplexStreamed,
            head: None,
            body: BytesMut::new(),
            subset: None,
            routed: None,
            finished: false,
        }
    }

    /// Answers one message from the gateway (none, one or several answers, in order).
    pub async fn on(&mut self, message: ProcessingRequest) -> Vec<ProcessingResponse> {
        if let Some(config) = &message.protocol_config {
            self.request_mode =
                BodySendMode::try_from(config.request_body_mode).unwrap_or(BodySendMode::None);
            self.response_mode =
                BodySendMode::try_from(config.response_body_mode).unwrap_or(BodySendMode::None);
        }
        if let Some(metadata) = &message.metadata_context {
            if let Some(subset) = subset_hint(metadata) {
                self.subset = Some(subset);
            }
        }
        use processing_request::Request;
        match message.request {
            Some(Request::RequestHeaders(h)) => self.request_headers(h).await,
            Some(Request::RequestBody(b)) => self.request_body(b).await,
            Some(Request::RequestTrailers(_)) => vec![answer(
                processing_response::Response::RequestTrailers(TrailersResponse::default()),
            )],
            Some(Request::ResponseHeaders(h)) => self.response_headers(h),
            Some(Request::ResponseBody(b)) => self.response_body(b),
            Some(Request::ResponseTrailers(_)) => {
                self.routed = None;
                vec![answer(processing_response::Response::ResponseTrailers(
                    TrailersResponse::default(),
                ))]
            }
            None => Vec::new(),
        }
    }

    async fn request_headers(&mut self, h: HttpHeaders) -> Vec<ProcessingResponse> {
        let head = head_of(h.headers.unwrap_or_default());
        self.head = Some(head);
        if h.end_of_stream {
            // No body: routed on the headers alone, answered now.
            return match self.route(Bytes::new()).await {
                Ok((mutation, metadata, _)) => vec![with_metadata(
                    answer(processing_response::Response::RequestHeaders(
                        HeadersResponse {
                            response: Some(common(mutation)),
                        },
                    )),
                    metadata,
                )],
                Err(e) => self.fail(e).await,
            };
        }
        if self.request_mode == BodySendMode::FullDuplexStreamed {
            // The answer waits for the body.
            return Vec::new();
        }
        vec![answer(processing_response::Response::RequestHeaders(
            HeadersResponse::default(),
        ))]
    }

    async fn request_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        let limit = self.state.settings.max_payload_size;
        if self.body.len() + b.body.len() > limit {
            return self.fail(GatewayError::PayloadTooLarge { limit }).await;
        }
        self.body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            if self.request_mode == BodySendMode::Streamed {
                // Piece by piece: each is answered, and kept back until the end.
                return vec![answer(processing_response::Response::RequestBody(
                    BodyResponse::default(),
                ))];
            }
            return Vec::new();
        }
        let body = std::mem::take(&mut self.body).freeze();
        let (mutation, metadata, sent) = match self.route(body.clone()).await {
            Ok(routed) => routed,
            Err(e) => return self.fail(e).await,
        };
        if self.request_mode != BodySendMode::FullDuplexStreamed {
            // Buffered: the destination goes with the body's answer.
            let mut response = common(mutation);
            if let Some(sent) = sent {
                response.status = common_response::ResponseStatus::Continue as i32;
                response.body_mutation = Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::Body(sent.to_vec())),
                });
            }
            return vec![with_metadata(
                answer(processing_response::Response::RequestBody(BodyResponse {
                    response: Some(response),
                })),
                metadata,
            )];
        }
        let body = sent.unwrap_or(body);
        let mut out = vec![with_metadata(
            answer(processing_response::Response::RequestHeaders(
                HeadersResponse {
                    response: Some(common(mutation)),
                },
            )),
            metadata,
        )];
        out.extend(streamed(body, processing_response::Response::RequestBody));
        out
    }

    fn response_headers(&mut self, h: HttpHeaders) -> Vec<ProcessingResponse> {
        let mut mutation = HeaderMutation::default();
        if let Some(routed) = &self.routed {
            mutation
                .set_headers
                .push(set(WORKER_HEADER.as_str(), routed.worker.as_str()));
            if routed.rewrite.is_some() {
                // The model's name changes length: the body's length is unknown.
                mutation.remove_headers.push("content-length".to_owned());
            }
            let status = h
                .headers
                .as_ref()
                .and_then(|m| header(m, ":status"))
                .and_then(|v| std::str::from_utf8(&v).ok()?.parse::<u16>().ok());
            if let Some(status) = status {
                routed
                    .guard
                    .worker()
                    .circuit
                    .record(status < 500, Instant::now());
            }
        }
        if h.end_of_stream {
            self.routed = None;
        }
        vec![answer(processing_response::Response::ResponseHeaders(
            HeadersResponse {
                response: Some(common(mutation)),
            },
        ))]
    }

    fn response_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        let mut chunk = b.body;
        if let Some(routed) = &mut self.routed {
            if !routed.first_chunk_seen && !chunk.is_empty() {
                routed.first_chunk_seen = true;
                routed.guard.first_frame();
            }
            if let Some((sent, served)) = &routed.rewrite {
                chunk = rename_model(&chunk, served, sent);
            }
        }
        if b.end_of_stream {
            self.routed = None;
        }
        if self.response_mode == BodySendMode::FullDuplexStreamed {
            let piece = StreamedBodyResponse {
                body: chunk,
                end_of_stream: b.end_of_stream,
                ..Default::default()
            };
            return vec![answer(processing_response::Response::ResponseBody(
                BodyResponse {
                    response: Some(CommonResponse {
                        body_mutation: Some(BodyMutation {
                            mutation: Some(body_mutation::Mutation::StreamedResponse(piece)),
                        }),
                        ..Default::default()
                    }),
                },
            ))];
        }
        let mut response = CommonResponse::default();
        if self.routed_rewrites() {
            response.body_mutation = Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::Body(chunk)),
            });
        }
        vec![answer(processing_response::Response::ResponseBody(
            BodyResponse {
                response: Some(response),
            },
        ))]
    }

    fn routed_rewrites(&self) -> bool {
        self.routed.as_ref().is_some_and(|r| r.rewrite.is_some())
    }

    /// Routes the request: the header mutation naming the destination, the dynamic
    /// metadata, and the body as it goes on when the gateway asked for a model rewrite.
    async fn route(
        &mut self,
        body: Bytes,
    ) -> Result<(HeaderMutation, prost_types::Struct, Option<Bytes>), GatewayError> {
        let head = self
            .head
            .as_ref()
            .expect("routed after the request headers");
        let state = self.state.clone();
        let arrived = Instant::now();
        crate::auth::check_client(state.settings.client_api_key.as_ref(), &head.headers)
            .map_err(|r| GatewayError::Unauthorized(r.message(false)))?;
        let admitted = forward::admit(&state).await?;
        let (body, rewrite) = match first(&head.headers, &MODEL_REWRITE) {
            Some(target) if !body.is_empty() => rewrite_model(&body, &target)?,
            _ => (body, None),
        };
        let route = head.path.split('?').next().unwrap_or_default();
        let chat;
        let routing_body: &Bytes = if routing::ANTHROPIC_ROUTES.contains(&route) {
            chat = routing::messages_as_chat(&body)?;
            &chat
        } else {
            &body
        };
        let empty = Bytes::from_static(b"{}");
        let routing_body = if routing_body.is_empty() {
            &empty
        } else {
            routing_body
        };
        let fields = RoutingFields::from_json(routing_body).map_err(GatewayError::InvalidJson)?;
        let tokens = routing::tokens_for(&state.kv, state.settings.policy, routing_body).await;
        let mut hints = routing::parse_hints(&head.headers, &state.settings.workers, &fields)?;
        if let Some(subset) = &self.subset {
            restrict_to_subset(&state, &mut hints, subset)?;
        }
        // An inference objective names a policy class when one of that name is configured.
        let class_name = head
            .headers
            .get("x-kvroute-class")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .or_else(|| {
                first(&head.headers, &OBJECTIVE).filter(|name| {
                    state
                        .settings
                        .queue
                        .as_ref()
                        .is_some_and(|q| q.classes.iter().any(|c| c.name == *name))
                })
            });
        let (mut parts, ()) = http::Request::new(()).into_parts();
        parts.method = head.method.clone();
        parts.uri = head.path.parse().unwrap_or_default();
        parts.headers = head.headers.clone();
        let request_id = head
            .headers
            .get(crate::http::REQUEST_ID_HEADER)
            .cloned()
            .unwrap_or_else(|| HeaderValue::from_static("epp"));
        let (class, mut released) = forward::queue_admission(
            &state,
            class_name.as_deref(),
            &fields,
            &hints,
            &tokens,
            arrived,
            None,
        )
        .await?;
        let attempt = Attempt {
            parts: &parts,
            fields: &fields,
            tokens: &tokens,
            hints: &hints,
            request_id: &request_id,
            arrived,
            class,
            span: None,
        };
        let picked = forward::pick(&state, &attempt, &[], &mut released, Some(arrived))?;
        let choice = picked.plan.choice();
        let worker = choice.worker.clone();
        let dp_rank = worker.ranks[choice.rank].dp_rank;
        forward::learn(&state, &picked.model, picked.plan, picked.now);
        let endpoint = endpoint_of(&worker.url).ok_or(GatewayError::NoEndpoint(
            "the chosen worker's URL names no host and port",
        ))?;
        tracing::debug!(worker = %worker.id, %endpoint, "Picked");

        let mut mutation = HeaderMutation::default();
        mutation
            .set_headers
            .push(set(DESTINATION_HEADER, &endpoint));
        if let Some(rank) = dp_rank {
            mutation
                .set_headers
                .push(set(ENGINE_DP_RANK_HEADER.as_str(), &rank.to_string()));
        }
        for name in OBJECTIVE.iter().chain(&FAIRNESS_ID).chain(&MODEL_REWRITE) {
            if head.headers.contains_key(*name) {
                mutation.remove_headers.push((*name).to_owned());
            }
        }
        let sent = rewrite.as_ref().map(|_| body.clone());
        if let Some(sent) = &sent {
            mutation
                .set_headers
                .push(set("content-length", &sent.len().to_string()));
        }
        self.routed = Some(Routed {
            guard: picked.guard,
            _admitted: admitted,
            worker: worker.id.clone(),
            rewrite,
            first_chunk_seen: false,
        });
        Ok((mutation, destination_metadata(&endpoint), sent))
    }

    /// The error as the proxy would answer it, immediately; the stream is over.
    async fn fail(&mut self, error: GatewayError) -> Vec<ProcessingResponse> {
        self.finished = true;
        self.routed = None;
        let anthropic = self.head.as_ref().is_some_and(|h| {
            routing::ANTHROPIC_ROUTES.contains(&h.path.split('?').next().unwrap_or_default())
        });
        let code = error.code();
        let response = if anthropic {
            error.into_anthropic_response()
        } else {
            error.into_response()
        };
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let mut headers = HeaderMutation::default();
        for (name, value) in &parts.headers {
            headers
                .set_headers
                .push(set_bytes(name.as_str(), value.as_bytes()));
        }
        vec![answer(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(super::pb::envoy::r#type::v3::HttpStatus {
                    code: i32::from(parts.status.as_u16()),
                }),
                headers: Some(headers),
                body: body.to_vec(),
                details: code.to_owned(),
                ..Default::default()
            },
        ))]
    }
}

/// A response carrying `response`.
fn answer(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

fn with_metadata(
    mut response: ProcessingResponse,
    metadata: prost_types::Struct,
) -> ProcessingResponse {
    response.dynamic_metadata = Some(metadata);
    response
}

/// A common response applying `mutation`, asking the gateway to route again on it.
fn common(mutation: HeaderMutation) -> CommonResponse {
    let clear_route_cache = !mutation.set_headers.is_empty();
    CommonResponse {
        header_mutation: Some(mutation),
        clear_route_cache,
        ..Default::default()
    }
}

/// `body` as `StreamedBodyResponse` pieces of at most [`BODY_PIECE`] bytes, the last with
/// `end_of_stream` (one empty piece for an empty body).
fn streamed(
    body: Bytes,
    wrap: fn(BodyResponse) -> processing_response::Response,
) -> Vec<ProcessingResponse> {
    let n = body.len().div_ceil(BODY_PIECE).max(1);
    (0..n)
        .map(|i| {
            let piece = body.slice(i * BODY_PIECE..((i + 1) * BODY_PIECE).min(body.len()));
            answer(wrap(BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(body_mutation::Mutation::StreamedResponse(
                            StreamedBodyResponse {
                                body: piece.to_vec(),
                                end_of_stream: i + 1 == n,
                                ..Default::default()
                            },
                        )),
                    }),
                    ..Default::default()
                }),
            }))
        })
        .collect()
}

/// Sets a header, overwriting whatever the client sent.
fn set(name: &str, value: &str) -> core_pb::HeaderValueOption {
    set_bytes(name, value.as_bytes())
}

fn set_bytes(name: &str, value: &[u8]) -> core_pb::HeaderValueOption {
    core_pb::HeaderValueOption {
        header: Some(core_pb::HeaderValue {
            key: name.to_owned(),
            raw_value: value.to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// A header's value as the gateway sent it (`raw_value`, else `value`).
fn header(map: &core_pb::HeaderMap, name: &str) -> Option<Vec<u8>> {
    map.headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| raw(h).to_vec())
}

fn raw(h: &core_pb::HeaderValue) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

/// The request's method, path and headers (pseudo-headers out of the map).
fn head_of(map: core_pb::HeaderMap) -> Head {
    let mut head = Head {
        method: Method::POST,
        path: "/".to_owned(),
        headers: HeaderMap::with_capacity(map.headers.len()),
    };
    for h in &map.headers {
        let value = raw(h);
        match h.key.as_str() {
            ":method" => {
                if let Ok(m) = Method::from_bytes(value) {
                    head.method = m;
                }
            }
            ":path" => head.path = String::from_utf8_lossy(value).into_owned(),
            k if k.starts_with(':') => {}
            k => {
                if let (Ok(name), Ok(v)) = (
                    HeaderName::from_bytes(k.as_bytes()),
                    HeaderValue::from_bytes(value),
                ) {
                    head.headers.append(name, v);
                }
            }
        }
    }
    head
}

/// The first of `names` the request carries, as text.
fn first(headers: &HeaderMap, names: &[&str]) -> Option<String> {
    names
        .iter()
        .find_map(|n| headers.get(*n)?.to_str().ok())
        .map(str::to_owned)
}

/// The chosen endpoint as the gateway dials it: the worker URL's `host:port`.
pub fn endpoint_of(url: &str) -> Option<String> {
    let uri: http::Uri = url.parse().ok()?;
    let authority = uri.authority()?;
    if authority.port().is_some() {
        return Some(authority.as_str().rsplit('@').next()?.to_owned());
    }
    let port = if uri.scheme_str() == Some("https") {
        443
    } else {
        80
    };
    Some(format!("{}:{port}", authority.host()))
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": endpoint}}`.
fn destination_metadata(endpoint: &str) -> prost_types::Struct {
    let inner = prost_types::Struct {
        fields: [(
            DESTINATION_HEADER.to_owned(),
            prost_types::Value {
                kind: Some(Kind::StringValue(endpoint.to_owned())),
            },
        )]
        .into(),
    };
    prost_types::Struct {
        fields: [(
            LB_NAMESPACE.to_owned(),
            prost_types::Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

/// The gateway's subset hint: a list of `ip:port` (or one comma-separated string).
fn subset_hint(metadata: &core_pb::Metadata) -> Option<Vec<String>> {
    let hint = metadata.filter_metadata.get(SUBSET_NAMESPACE)?;
    let value = hint.fields.get(SUBSET_KEY)?;
    let mut out = Vec::new();
    match value.kind.as_ref()? {
        Kind::ListValue(list) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    out.push(s.trim().to_owned());
                }
            }
        }
        Kind::StringValue(s) => out.extend(s.split(',').map(|e| e.trim().to_owned())),
        _ => return None,
    }
    Some(out)
}

/// Narrows the eligible workers to the subset's endpoints; none of them is 503.
fn restrict_to_subset(
    state: &AppState,
    hints: &mut kvroute_core::eligibility::Hints,
    subset: &[String],
) -> Result<(), GatewayError> {
    let ids: std::collections::HashSet<String> = state
        .workers
        .workers()
        .iter()
        .filter(|w| endpoint_of(&w.url).is_some_and(|e| subset.contains(&e)))
        .map(|w| w.id.to_string())
        .collect();
    let allowed = match hints.allowed_workers.take() {
        Some(before) => before.intersection(&ids).cloned().collect(),
        None => ids,
    };
    if allowed.is_empty() {
        return Err(GatewayError::NoEndpoint(
            "no endpoint of the gateway's subset hint is known",
        ));
    }
    hints.allowed_workers = Some(allowed);
    Ok(())
}

/// The body with `model` set to `target`, and the model it named (`(sent, target)`).
fn rewrite_model(
    body: &Bytes,
    target: &str,
) -> Result<(Bytes, Option<(String, String)>), GatewayError> {
    let mut value: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(body).map_err(GatewayError::InvalidJson)?;
    let sent = value
        .get("model")
        .and_then(|m| m.as_str())
        .unwrap_or_default()
        .to_owned();
    value.insert("model".to_owned(), serde_json::Value::from(target));
    let rewritten = serde_json::to_vec(&value).map_err(GatewayError::InvalidJson)?;
    Ok((Bytes::from(rewritten), Some((sent, target.to_owned()))))
}

/// A response chunk with the served model's name given back as the client sent it.
fn rename_model(chunk: &[u8], served: &str, sent: &str) -> Vec<u8> {
    let mut out = chunk.to_vec();
    for (from, to) in [
        (
            format!("\"model\":{}", json_str(served)),
            format!("\"model\":{}", json_str(sent)),
        ),
        (
            format!("\"model\": {}", json_str(served)),
            format!("\"model\": {}", json_str(sent)),
        ),
    ] {
        out = replace_all(&out, from.as_bytes(), to.as_bytes());
    }
    out
}

fn json_str(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

fn replace_all(haystack: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len());
    let mut rest = haystack;
    while let Some(at) = memchr::memmem::find(rest, from) {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(to);
        rest = &rest[at + from.len()..];
    }
    out.extend_from_slice(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn endpoints_are_host_and_port() {
        assert_eq!(
            endpoint_of("http://10.0.0.1:8000").as_deref(),
            Some("10.0.0.1:8000")
        );
        assert_eq!(
            endpoint_of("http://10.0.0.1").as_deref(),
            Some("10.0.0.1:80")
        );
        assert_eq!(
            endpoint_of("https://engine.local").as_deref(),
            Some("engine.local:443")
        );
        assert_eq!(
            endpoint_of("http://[fd00::1]:8000/v1").as_deref(),
            Some("[fd00::1]:8000")
        );
        assert_eq!(endpoint_of("not a url"), None);
    }

    #[test]
    fn bodies_go_back_in_pieces_of_at_most_62000_bytes() {
        let body = Bytes::from(vec![b'x'; 150_001]);
        let pieces = streamed(body, processing_response::Response::RequestBody);
        let sizes: Vec<(usize, bool)> = pieces
            .iter()
            .map(|p| match &p.response {
                Some(processing_response::Response::RequestBody(b)) => {
                    match b.response.as_ref().and_then(|r| r.body_mutation.as_ref()) {
                        Some(BodyMutation {
                            mutation: Some(body_mutation::Mutation::StreamedResponse(s)),
                        }) => (s.body.len(), s.end_of_stream),
                        other => panic!("not a streamed body: {other:?}"),
                    }
                }
                other => panic!("not a request body answer: {other:?}"),
            })
            .collect();
        assert_eq!(
            sizes,
            vec![(62_000, false), (62_000, false), (26_001, true)]
        );
        let empty = streamed(Bytes::new(), processing_response::Response::RequestBody);
        assert_eq!(empty.len(), 1, "an empty body is one last piece");
    }

    #[test]
    fn the_model_is_rewritten_and_named_back() {
        let (body, rewrite) =
            rewrite_model(&Bytes::from_static(br#"{"model":"chat","x":1}"#), "llama-3").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["model"], "llama-3");
        assert_eq!(v["x"], 1);
        assert_eq!(rewrite, Some(("chat".to_owned(), "llama-3".to_owned())));
        let back = rename_model(br#"data: {"id":"1","model":"llama-3"}"#, "llama-3", "chat");
        assert_eq!(back, br#"data: {"id":"1","model":"chat"}"#.to_vec());
        assert!(rewrite_model(&Bytes::from_static(b"[1]"), "m").is_err());
    }

    #[test]
    fn the_subset_hint_reads_a_list_or_a_string() {
        let list = prost_types::Value {
            kind: Some(Kind::ListValue(prost_types::ListValue {
                values: vec![prost_types::Value {
                    kind: Some(Kind::StringValue("10.0.0.1:8000".into())),
                }],
            })),
        };
        let metadata = |v: prost_types::Value| core_pb::Metadata {
            filter_metadata: HashMap::from([(
                SUBSET_NAMESPACE.to_owned(),
                prost_types::Struct {
                    fields: [(SUBSET_KEY.to_owned(), v)].into(),
                },
            )]),
            ..Default::default()
        };
        assert_eq!(
            subset_hint(&metadata(list)),
            Some(vec!["10.0.0.1:8000".to_owned()])
        );
        let text = prost_types::Value {
            kind: Some(Kind::StringValue("a:1, b:2".into())),
        };
        assert_eq!(
            subset_hint(&metadata(text)),
            Some(vec!["a:1".to_owned(), "b:2".to_owned()])
        );
        assert_eq!(subset_hint(&core_pb::Metadata::default()), None);
    }

    #[test]
    fn the_head_keeps_the_path_and_the_raw_values() {
        let map = core_pb::HeaderMap {
            headers: vec![
                core_pb::HeaderValue {
                    key: ":path".into(),
                    raw_value: b"/v1/chat/completions".to_vec(),
                    ..Default::default()
                },
                core_pb::HeaderValue {
                    key: ":method".into(),
                    value: "GET".into(),
                    ..Default::default()
                },
                core_pb::HeaderValue {
                    key: "x-kvroute-worker".into(),
                    raw_value: b"a".to_vec(),
                    ..Default::default()
                },
            ],
        };
        let head = head_of(map);
        assert_eq!(head.path, "/v1/chat/completions");
        assert_eq!(head.method, Method::GET);
        assert_eq!(head.headers["x-kvroute-worker"], "a");
    }
}
