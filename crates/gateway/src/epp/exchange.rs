//! One ext_proc stream: one HTTP request through the gateway, and its answer.
//!
//! In the processing mode GIE's gateways configure (headers `SEND`, bodies
//! `FULL_DUPLEX_STREAMED`, trailers `SEND`), the messages go:
//! 1. request headers: kept; no answer yet (the destination needs the body);
//! 2. request body pieces: buffered until `end_of_stream`; then the request is routed and
//!    kvroute answers a `HeadersResponse` (the destination header, `clear_route_cache`, the
//!    GIE headers stripped) with the destination in the dynamic metadata, then the body
//!    back as `StreamedBodyResponse` pieces of at most [`super::wire::BODY_PIECE`] bytes;
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
use http::{HeaderMap, HeaderValue};
use http_body_util::BodyExt;
use kvroute_protocol::{RoutingFields, WorkerId};

use super::pb::ext_proc::{
    body_mutation, common_response, processing_request, processing_response, BodyMutation,
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse,
};
use super::pb::mode::processing_mode::BodySendMode;
use super::wire::{
    answer, common, destination_metadata, endpoint_of, first, head_of, header, rename_model,
    rewrite_model, set, set_bytes, streamed, subset_hint, with_metadata, Head,
};
use super::DESTINATION_HEADER;
use crate::context::AppState;
use crate::error::GatewayError;
use crate::http::{ENGINE_DP_RANK_HEADER, WORKER_HEADER};
use crate::pick::{self, Attempt};
use crate::proxy::{Admitted, InFlight};
use crate::routing;

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
        // GIE's fairness id names the tenant of a caller who proved nothing (stripped below).
        let fairness_id = first(&head.headers, &FAIRNESS_ID);
        let caller = crate::auth::Caller {
            headers: &head.headers,
            peer: None,
            fairness_id: fairness_id.as_deref(),
        };
        let tenant = pick::tenant_of(&state, &caller, None).await?;
        let admitted = pick::admit(&state).await?;
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
        let shortest = state.workers.table().shortest_context();
        let tokens =
            routing::tokens_for(&state.kv, state.settings.policy, routing_body, shortest).await;
        let mut hints = routing::parse_hints(&head.headers, &state.settings.workers, &fields)?;
        if let Some(subset) = &self.subset {
            restrict_to_subset(&state, &mut hints, subset)?;
        }
        let class_name = policy_class_name(&state, &head.headers);
        let (mut parts, ()) = http::Request::new(()).into_parts();
        parts.method = head.method.clone();
        parts.uri = head.path.parse().unwrap_or_default();
        parts.headers = head.headers.clone();
        let request_id = head
            .headers
            .get(crate::http::REQUEST_ID_HEADER)
            .cloned()
            .unwrap_or_else(|| HeaderValue::from_static("epp"));
        let ask = pick::QueueAsk {
            class_name: class_name.as_deref(),
            headers: &head.headers,
            tenant: &tenant,
        };
        // Envoy forwards the request, not kvroute: it cannot be preempted (its guard goes).
        let queued =
            pick::queue_admission(&state, ask, &fields, &hints, &tokens, arrived, None).await?;
        let (class, mut released) = (queued.class, queued.released);
        let attempt = Attempt {
            parts: &parts,
            fields: &fields,
            tokens: &tokens,
            hints: &hints,
            request_id: &request_id,
            tenant: &tenant,
            arrived,
            class,
            span: None,
        };
        let picked = pick::pick(&state, &attempt, &[], &mut released, Some(arrived))?;
        let choice = picked.plan.choice();
        let worker = choice.worker.clone();
        let dp_rank = worker.ranks[choice.rank].dp_rank;
        pick::learn(&state, &picked.model, picked.plan, picked.now);
        let endpoint = endpoint_of(&worker.url).ok_or(GatewayError::NoEndpoint(
            "the chosen worker's URL names no host and port",
        ))?;
        tracing::debug!(worker = %worker.id, %endpoint, "Picked");

        let sent = rewrite.as_ref().map(|_| body.clone());
        let mutation = destination(&head.headers, &endpoint, dp_rank, sent.as_ref());
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

/// The policy class a request names: `x-kvroute-class`, else an inference objective when a
/// policy class of that name is configured.
fn policy_class_name(state: &AppState, headers: &http::HeaderMap) -> Option<String> {
    headers
        .get("x-kvroute-class")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| {
            first(headers, &OBJECTIVE).filter(|name| {
                state
                    .settings
                    .queue
                    .as_ref()
                    .is_some_and(|q| q.classes.iter().any(|c| c.name == *name))
            })
        })
}

/// The header mutation that sends a request to `endpoint` (and its rank): the destination,
/// GIE's and our request headers removed, and the length of a rewritten body.
fn destination(
    headers: &HeaderMap,
    endpoint: &str,
    dp_rank: Option<u32>,
    sent: Option<&Bytes>,
) -> HeaderMutation {
    let mut mutation = HeaderMutation::default();
    mutation.set_headers.push(set(DESTINATION_HEADER, endpoint));
    if let Some(rank) = dp_rank {
        mutation
            .set_headers
            .push(set(ENGINE_DP_RANK_HEADER.as_str(), &rank.to_string()));
    }
    for name in OBJECTIVE.iter().chain(&FAIRNESS_ID).chain(&MODEL_REWRITE) {
        if headers.contains_key(*name) {
            mutation.remove_headers.push((*name).to_owned());
        }
    }
    if let Some(sent) = sent {
        mutation
            .set_headers
            .push(set("content-length", &sent.len().to_string()));
    }
    mutation
}
