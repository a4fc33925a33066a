//! A routed request, top to bottom:
//!
//! 1. **admission**: the caller's tenant (its key or token; resolved by the front door,
//!    `server`, with [`crate::pick::tenant_of`]), the router's concurrency limit ([`admit`]),
//!    the body, the tenant's rate limits ([`reserve`]), and for a single request the router
//!    queue ([`queue_admission`]);
//! 2. **the plan's shape**: single (one worker), or prefill/decode on a P/D route;
//! 3. **dispatch**: a single request goes through [`attempts`], each a policy's pick
//!    ([`pick`]) and a forward, retried on another eligible worker when it fails before the
//!    first response byte (connection error, timeout, 502/503/504), with jittered exponential
//!    backoff, never when it is pinned; every attempt feeds the worker's circuit breaker. A
//!    pair's halves go out through [`crate::pd`], which plans the pair and sends them;
//! 4. **the response**: held by the admission until its body ends; its usage, read on the
//!    way ([`crate::usage`]), settles the rate limits' reservation. A stream on an inference
//!    route is wrapped by [`crate::migrate`], which sends the continuation through the same
//!    dispatch when its worker fails mid-way; a single non-streaming answer there is read
//!    whole, so one cut mid-body is retried.
//!
//! Nothing below calls back up: [`crate::pd`] and [`crate::pick`] know nothing of this module.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use http_body_util::BodyExt;
use kvroute_core::PolicyKind;
use kvroute_protocol::{RoutingFields, WorkerId};

use crate::auth::Tenant;
use crate::context::AppState;
use crate::error::GatewayError;
use crate::http::WORKER_HEADER;
use crate::migrate::stream::{Api, UsageWanted};
use crate::migrate::{self, Migration, Sent};
use crate::otlp::RequestSpan;
use crate::pd::{PdAnswer, PREFILL_WORKER_HEADER};
use crate::pick::{
    admit, charge_output_on, count_tokens_on, learn, pick, queue_admission, reserve, Attempt,
    Picked, QueueAdmission, QueueAsk, Reserved,
};
use crate::proxy::{self, read_body, Admitted, Forward};
use crate::queue::Released;
use crate::routing;
use crate::usage::{self, Subscribers};

/// Routes that are disaggregated when prefill/decode disaggregation is on.
const PD_ROUTES: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/generate"];

/// The shape of a request's plan, and so of its dispatch.
#[derive(Debug, Clone, Copy)]
enum Shape {
    /// One worker, through [`attempts`], in its queue class if any.
    Single { class: Option<usize> },
    /// A prefill/decode pair ([`crate::pd`]).
    Disaggregated,
}

impl Shape {
    /// The queue's policy class (single requests only).
    fn class(self) -> Option<usize> {
        match self {
            Shape::Single { class } => class,
            Shape::Disaggregated => None,
        }
    }

    /// The policy whose tokens the request needs.
    fn tokenize_as(disaggregated: bool, state: &AppState) -> PolicyKind {
        match state.settings.pd.as_ref().filter(|_| disaggregated) {
            // The decode-only decision needs the prompt's tokens whatever the policies.
            Some(pd) if pd.min_uncached_tokens > 0 => PolicyKind::KvAware,
            Some(pd) if pd.decode_policy == PolicyKind::KvAware => PolicyKind::KvAware,
            Some(pd) => pd.prefill_policy,
            None => state.settings.policy,
        }
    }
}

/// Routes one request and forwards it, top to bottom: admission, the plan's shape (single,
/// or prefill/decode on a P/D route), its dispatch, the response (a stream that may migrate).
pub(crate) async fn route_and_forward(
    state: &Arc<AppState>,
    route: &'static str,
    req: Request,
    request_id: &HeaderValue,
    span: Option<&Arc<RequestSpan>>,
    tenant: &Tenant,
) -> Result<Response, GatewayError> {
    // Admission (the front door resolved the caller's tenant): the concurrency limit, the body.
    let arrived = Instant::now();
    let (parts, body) = req.into_parts();
    let admitted = admit(state).await?;
    let body = read_body(body, state.settings.max_payload_size, &parts.headers).await?;
    // Anthropic's Messages: routed on the chat request vLLM makes of it, forwarded as sent.
    let chat;
    let routing_body = if routing::ANTHROPIC_ROUTES.contains(&route) {
        chat = routing::messages_as_chat(&body)?;
        &chat
    } else {
        &body
    };
    let fields = RoutingFields::from_json(routing_body).map_err(GatewayError::InvalidJson)?;
    if let (Some(span), Some(model)) = (span, fields.model.as_deref()) {
        span.set_str("kvroute.model", model);
    }
    let started = Instant::now();

    // The plan's shape; a single request waits its turn in the router queue.
    let disaggregated = state.settings.pd.is_some() && PD_ROUTES.contains(&route);
    let tokenize_as = Shape::tokenize_as(disaggregated, state);
    let shortest = state.workers.table().shortest_context();
    let tokens = routing::tokens_for(&state.kv, tokenize_as, routing_body, shortest).await;
    let count_only = route == "/v1/messages/count_tokens";
    let reserved = reserve(state, tenant, &fields, (routing_body, &tokens), count_only).await?;
    let hints = routing::parse_hints(&parts.headers, &state.settings.workers, &fields)?;
    let (shape, queued) = if disaggregated {
        (Shape::Disaggregated, QueueAdmission::default())
    } else {
        let class_name = parts
            .headers
            .get("x-kvroute-class")
            .and_then(|v| v.to_str().ok());
        let ask = QueueAsk {
            class_name,
            headers: &parts.headers,
            tenant,
        };
        let queued = queue_admission(state, ask, &fields, &hints, &tokens, started, span).await?;
        (
            Shape::Single {
                class: queued.class,
            },
            queued,
        )
    };
    let attempt = Attempt {
        parts: &parts,
        fields: &fields,
        tokens: &tokens,
        hints: &hints,
        request_id,
        tenant,
        arrived,
        class: shape.class(),
        span,
    };

    // Its place in the engine's queue, when the router writes it (`--engine-priority`).
    let (sent, admitted) = match &state.engine_levels {
        Some(levels) => {
            let (sent, in_flight) = levels.send(
                route,
                body.clone(),
                tenant,
                queued.tier,
                tokens.len() as u64,
            );
            (sent, admitted.holding(in_flight))
        }
        None => (body.clone(), admitted),
    };

    // The dispatch, and the response; preempted, it ends there (its upstream request dropped).
    // Its usage settles the rate limits' reservation.
    let answer = respond(
        state,
        route,
        shape,
        &attempt,
        sent,
        queued.released,
        admitted,
    );
    let response = match queued.preemptible {
        Some(p) => tokio::select! {
            answer = answer => answer,
            () = p.preempted() => Err(GatewayError::Preempted),
        },
        None => answer.await,
    }?;
    Ok(read_usage(state, &attempt, reserved, response))
}

/// The response, its usage read on its way to the client (`crate::usage`) for whoever needs
/// it: the rate limits' reservation, VTC's output charge, the tenant's token counts. Only a
/// success is read; a response nobody needs the usage of is not wrapped at all. The tokens are
/// counted whenever the usage is read anyway, or tenants are configured (keys, JWT, a
/// trusted header).
fn read_usage(
    state: &AppState,
    attempt: &Attempt<'_>,
    reserved: Option<Reserved>,
    response: Response,
) -> Response {
    if !response.status().is_success() {
        // A reservation dropped unsettled gives its tokens back.
        return response;
    }
    let mut subscribers = Subscribers::default();
    let prompt = match reserved {
        Some(reserved) => reserved.settle_on(&mut subscribers),
        None => attempt.tokens.len() as u64,
    };
    charge_output_on(state, attempt, &mut subscribers);
    let tenants =
        state.access.requires_credentials() || state.settings.tenancy.tenant_header.is_some();
    if tenants || !subscribers.is_empty() {
        count_tokens_on(state, attempt, &mut subscribers);
    }
    if subscribers.is_empty() {
        return response;
    }
    usage::tap(response, prompt, subscribers)
}

/// Dispatches the request as its shape says, and makes its response: a stream that may
/// migrate, an answer read whole, or the response as it comes.
async fn respond(
    state: &Arc<AppState>,
    route: &'static str,
    shape: Shape,
    attempt: &Attempt<'_>,
    body: Bytes,
    released: Option<Released<'_>>,
    admitted: Admitted,
) -> Result<Response, GatewayError> {
    let api = Api::of(route).filter(|_| state.settings.migration.limit > 0);
    match (api, shape) {
        (Some(api), _) if attempt.fields.stream => {
            migrating_stream(state, api, shape, attempt, body, released, admitted).await
        }
        (Some(_), Shape::Single { .. }) => {
            whole_answer(state, attempt, body, released, admitted).await
        }
        _ => {
            let sent = dispatch(state, shape, attempt, body, Vec::new(), released);
            Ok(sent.await?.into_response(admitted))
        }
    }
}

/// What a dispatch sent: the response with who answers it, or an answer that ends the
/// request (a failed prefill's).
enum Dispatched {
    Sent(Box<Sent>),
    Answered(Response),
}

impl Dispatched {
    /// The client's response, the admission held until its body ends.
    fn into_response(self, admitted: Admitted) -> Response {
        match self {
            Dispatched::Sent(mut sent) => {
                sent.response.body_mut().hold(admitted);
                sent.response.map(Body::new)
            }
            Dispatched::Answered(response) => response,
        }
    }
}

/// Sends the request as its plan's shape says, to no worker in `tried`: through
/// [`attempts`], or as the halves of a pair (the prefill worker named in the response).
async fn dispatch(
    state: &AppState,
    shape: Shape,
    a: &Attempt<'_>,
    body: Bytes,
    tried: Vec<WorkerId>,
    released: Option<Released<'_>>,
) -> Result<Dispatched, GatewayError> {
    if let Shape::Single { .. } = shape {
        let sent = attempts(state, a, body, tried, released).await?;
        return Ok(Dispatched::Sent(Box::new(sent)));
    }
    Ok(
        match Box::pin(crate::pd::halves(state, a, body, &tried)).await? {
            PdAnswer::Decode {
                mut response,
                worker,
                prefill,
            } => {
                if let Some(p) = prefill {
                    response.headers_mut().insert(PREFILL_WORKER_HEADER, p);
                }
                Dispatched::Sent(Box::new(Sent {
                    response: *response,
                    worker,
                    pinned: false,
                }))
            }
            PdAnswer::Answered(response) => Dispatched::Answered(response),
        },
    )
}

/// A stream that may migrate: the worker is asked for its usage on every chunk, and a failure
/// mid-stream goes on from a worker (or a pair) chosen afresh.
async fn migrating_stream(
    state: &Arc<AppState>,
    api: Api,
    shape: Shape,
    a: &Attempt<'_>,
    body: Bytes,
    released: Option<Released<'_>>,
    admitted: Admitted,
) -> Result<Response, GatewayError> {
    let (allowed, sent_body, wanted) = stream_request(state, api, &body, &a.parts.headers);
    let mut sent = match dispatch(state, shape, a, sent_body, Vec::new(), released).await? {
        Dispatched::Sent(sent) => *sent,
        Dispatched::Answered(response) => return Ok(response),
    };
    sent.response.body_mut().hold(admitted);
    if !sent.response.status().is_success() {
        return Ok(sent.response.map(Body::new));
    }
    // Pinned by hard session affinity, known once routed.
    let migration = migration(state, api, body, allowed, wanted, sent.pinned, a.span);
    let resend = resender(state, a, shape);
    Ok(migrate::migrating(migration, sent, resend))
}

/// A stream's request as sent, when it may migrate: whether it may move (and how often), the
/// body sent (asking for usage on every chunk when it may move) and the usage its client
/// asked for. A routing hint pinning the worker keeps it in place and the body as it came.
fn stream_request(
    state: &AppState,
    api: Api,
    body: &Bytes,
    headers: &HeaderMap,
) -> (Result<u32, &'static str>, Bytes, Option<UsageWanted>) {
    if headers.contains_key(WORKER_HEADER) {
        return (Err(PINNED), body.clone(), None);
    }
    let (sent, wanted) = migrate::stream::with_usage_stats(api, body);
    (Ok(state.settings.migration.limit), sent, Some(wanted))
}

const PINNED: &str = "the request is pinned to its worker";

/// How a stream migrates; `pinned` when routing pinned it (then it stays).
fn migration(
    state: &AppState,
    api: Api,
    original: Bytes,
    allowed: Result<u32, &'static str>,
    wanted: Option<UsageWanted>,
    pinned: bool,
    span: Option<&Arc<RequestSpan>>,
) -> Migration {
    Migration {
        api,
        original,
        wanted,
        allowed: allowed.and_then(|n| if pinned { Err(PINNED) } else { Ok(n) }),
        stall: state.settings.migration.stall,
        metrics: state.metrics.migrations.clone(),
        span: span.cloned(),
    }
}

/// Sends a continuation of this request as its shape says, routed afresh with the failed
/// workers excluded.
fn resender(state: &Arc<AppState>, a: &Attempt<'_>, shape: Shape) -> migrate::Resend {
    let (parts, request_id, arrived, span) = (a.parts, a.request_id, a.arrived, a.span);
    let (mut owned, ()) = http::Request::new(()).into_parts();
    owned.method = parts.method.clone();
    owned.uri = parts.uri.clone();
    owned.headers = parts.headers.clone();
    let (state, parts, request_id) = (state.clone(), Arc::new(owned), request_id.clone());
    let (span, tenant) = (span.cloned(), a.tenant.clone());
    Box::new(move |body: Bytes, tried: Vec<WorkerId>| {
        let (state, parts, request_id) = (state.clone(), parts.clone(), request_id.clone());
        let (span, tenant) = (span.clone(), tenant.clone());
        Box::pin(async move {
            let fields = RoutingFields::from_json(&body).map_err(GatewayError::InvalidJson)?;
            let disaggregated = matches!(shape, Shape::Disaggregated);
            let tokenize_as = Shape::tokenize_as(disaggregated, &state);
            let shortest = state.workers.table().shortest_context();
            let tokens = routing::tokens_for(&state.kv, tokenize_as, &body, shortest).await;
            let hints = routing::parse_hints(&parts.headers, &state.settings.workers, &fields)?;
            let attempt = Attempt {
                parts: &parts,
                fields: &fields,
                tokens: &tokens,
                hints: &hints,
                request_id: &request_id,
                tenant: &tenant,
                arrived,
                class: shape.class(),
                span: span.as_ref(),
            };
            match dispatch(&state, shape, &attempt, body.clone(), tried, None).await? {
                Dispatched::Sent(sent) => Ok(*sent),
                Dispatched::Answered(_) => Err(GatewayError::NoEndpoint(
                    "the prefill half of the continuation failed",
                )),
            }
        })
    })
}

/// A non-streaming answer, read whole before the client sees it: a body cut mid-way is
/// retried on another worker like a failure before the first byte (the client has seen
/// nothing).
async fn whole_answer(
    state: &AppState,
    attempt: &Attempt<'_>,
    body: Bytes,
    mut released: Option<Released<'_>>,
    admitted: Admitted,
) -> Result<Response, GatewayError> {
    let mut tried = Vec::new();
    loop {
        let sent = attempts(state, attempt, body.clone(), tried.clone(), released.take()).await?;
        let (parts, tracked) = sent.response.into_parts();
        let worker = tracked.worker().clone();
        match tracked.collect().await {
            Ok(whole) => {
                drop(admitted);
                let whole = whole.to_bytes();
                return Ok(Response::from_parts(parts, Body::from(whole)));
            }
            Err(error) => {
                tracing::warn!(worker = %worker.id, %error, "Answer cut mid-way; retrying the request whole");
                worker.circuit.record(false, Instant::now());
                if sent.pinned || tried.len() as u32 >= state.settings.retry.max_retries {
                    return Err(GatewayError::Upstream {
                        worker: worker.id.clone(),
                        source: error.into(),
                    });
                }
                tried.push(worker.id.clone());
                state.metrics.retries.inc();
                if let Some(span) = attempt.span {
                    span.add("kvroute.retries", 1);
                }
            }
        }
    }
}

/// Sends the request to a worker chosen by the policy, retrying on another (never one in
/// `tried`) while attempts fail before their first byte.
async fn attempts(
    state: &AppState,
    a: &Attempt<'_>,
    body: Bytes,
    mut tried: Vec<WorkerId>,
    mut released: Option<Released<'_>>,
) -> Result<Sent, GatewayError> {
    let started = Instant::now();
    let first = tried.is_empty();
    let max_retries = state.settings.retry.max_retries;
    let mut last_error = None;
    for attempt in 0..=max_retries {
        if attempt > 0 {
            let retry = &state.settings.retry;
            tokio::time::sleep(crate::health::jittered(
                retry.backoff(attempt),
                retry.jitter,
            ))
            .await;
            state.metrics.retries.inc();
            if let Some(span) = a.span {
                span.add("kvroute.retries", 1);
            }
        }
        let measured = (attempt == 0 && first).then_some(started);
        let picked = match pick(state, a, &tried, &mut released, measured) {
            Ok(picked) => picked,
            // Nowhere left to retry: the last failure is the answer.
            Err(e) => return Err(last_error.unwrap_or(e)),
        };
        let Picked {
            plan,
            mut guard,
            model,
            now,
        } = picked;
        let choice = plan.choice().clone();
        if let Some(span) = a.span {
            let n = tried.len() as u32 + 1;
            let rank = &choice.worker.ranks[choice.rank];
            guard = guard.with_span(span.attempt(choice.worker.id.as_str(), rank.dp_rank, n));
        }
        let result = proxy::forward(
            &state.client,
            guard,
            Forward {
                method: a.parts.method.clone(),
                path_and_query: a.path_and_query(),
                headers: &a.parts.headers,
                body: body.clone(),
                request_id: a.request_id,
                timeout: state.settings.request_timeout,
                auth: &state.worker_auth,
            },
        )
        .await;
        let worker = &choice.worker;
        let retryable = match &result {
            Err(GatewayError::Upstream { .. } | GatewayError::UpstreamTimeout { .. }) => true,
            Ok(r) => matches!(r.status().as_u16(), 502..=504),
            Err(_) => false,
        };
        // A pinned request (by hint or hard session affinity) is never moved elsewhere.
        if retryable && !plan.pinned && attempt < max_retries {
            let error = match result {
                Err(e) => e,
                Ok(r) => GatewayError::UpstreamStatus {
                    worker: worker.id.clone(),
                    status: r.status().as_u16(),
                },
            };
            tracing::warn!(worker = %worker.id, attempt = attempt + 1, error = %error, "Attempt failed before the first byte; retrying on another worker");
            tried.push(worker.id.clone());
            last_error = Some(error);
            continue;
        }
        // The attempt that answers is the one the router learns from.
        let (response, pinned) = (result?, plan.pinned);
        learn(state, &model, plan, now);
        return Ok(Sent {
            response,
            worker: worker.id.clone(),
            pinned,
        });
    }
    Err(last_error.unwrap_or(GatewayError::NoEndpoint("no worker left to try")))
}
