//! Prefill/decode disaggregation: one request, two workers.
//!
//! The decode worker is chosen first, by the decode policy over the model's decode workers
//! (`x-kvroute-worker` pins it); when it already holds all but fewer than
//! `--pd-min-uncached-tokens` prompt tokens, the request goes to it alone ("decode-only",
//! llm-d's decider). Otherwise the prefill worker is chosen by the prefill policy over the
//! prefill workers (`x-kvroute-prefill-worker` pins it) and the two halves go out in the
//! engines' protocol:
//!
//! - vLLM (NIXL): the prompt to the prefill worker with `max_tokens` 1, `stream` false and
//!   `kv_transfer_params: {"do_remote_decode": true, ...}`; then the original request to the
//!   decode worker with the `kv_transfer_params` the prefill answered. A failed prefill is the
//!   client's answer and the decode half is never sent.
//! - SGLang (bootstrap): `bootstrap_host`, `bootstrap_port` and a random `bootstrap_room`
//!   added to the body, sent to both at once; the decode answer is the client's, unless the
//!   prefill fails first.
//!
//! Each half holds its own in-flight guard (the prefill half's load is the prompt, the decode
//! half's the blocks it decodes over), released on every outcome. A prefill half that fails
//! before any byte is retried on another prefill worker (SGLang's: both halves sent again with
//! a new bootstrap room); a decode half that fails
//! mid-stream migrates ([`crate::migrate`]) to a new pair chosen for the prompt and the text so
//! far, the failed workers excluded.

use std::time::Instant;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::HeaderValue;
use http_body_util::BodyExt;
use kvroute_core::eligibility::Hints;
use kvroute_core::{PolicyKind, RequestLoad};
use kvroute_protocol::{RoutingFields, WorkerId};

use crate::config::PdProtocol;
use crate::context::AppState;
use crate::error::GatewayError;
use crate::prompts::Tokens;
use crate::proxy::{self, Admitted, Forward, InFlight};
use crate::routing::{self, Choice, Plan};
use crate::workers::{Half, Pool};

/// Names the prefill worker of a disaggregated request (hint in, header out).
pub const PREFILL_WORKER_HEADER: http::HeaderName =
    http::HeaderName::from_static("x-kvroute-prefill-worker");

/// The largest prefill answer read (it is one token).
const PREFILL_ANSWER_LIMIT: usize = 16 << 20;

/// One disaggregated request.
pub(crate) struct PdRequest<'a> {
    pub parts: &'a http::request::Parts,
    pub body: Bytes,
    pub fields: &'a RoutingFields<'a>,
    pub tokens: Tokens,
    pub hints: &'a Hints,
    pub request_id: &'a HeaderValue,
    pub arrived: Instant,
    /// Workers this request failed on (a migrated stream): neither half goes there.
    pub excluded: &'a [WorkerId],
    /// The request's trace span, when it is traced.
    pub span: Option<&'a std::sync::Arc<crate::otlp::RequestSpan>>,
}

/// What the halves answered: the decode worker's response, or an answer that ends the
/// request (a failed prefill's).
pub(crate) enum PdAnswer {
    Decode {
        response: Box<http::Response<proxy::TrackedBody>>,
        worker: WorkerId,
        prefill: Option<HeaderValue>,
    },
    Answered(Response),
}

pub(crate) async fn route(
    state: &AppState,
    req: PdRequest<'_>,
    admitted: Admitted,
) -> Result<Response, GatewayError> {
    Ok(match halves(state, &req).await? {
        PdAnswer::Decode {
            response, prefill, ..
        } => finish(*response, admitted, prefill),
        PdAnswer::Answered(response) => response,
    })
}

/// Sends the halves of `req`: the decode worker's response, or the answer that ends it.
pub(crate) async fn halves(
    state: &AppState,
    req: &PdRequest<'_>,
) -> Result<PdAnswer, GatewayError> {
    // SGLang's halves go out together: a prefill that fails before any byte sends both again,
    // with another prefill worker (vLLM's prefill is retried alone, in `prefill_retried`).
    let mut excluded = req.excluded.to_vec();
    let max_retries = state.settings.retry.max_retries;
    for attempt in 0..=max_retries {
        let this = PdRequest {
            excluded: &excluded,
            ..req.clone_parts()
        };
        match halves_once(state, &this).await? {
            Once::Done(answer) => return Ok(answer),
            Once::RetryPrefill(worker) if attempt < max_retries => {
                tracing::warn!(%worker, attempt = attempt + 1, "Prefill half failed before any byte; sending both halves again with another prefill worker");
                state.metrics.retries.inc();
                if let Some(span) = req.span {
                    span.add("kvroute.retries", 1);
                }
                excluded.push(worker);
            }
            Once::RetryPrefill(worker) => {
                return Err(GatewayError::UpstreamStatus {
                    worker,
                    status: 502,
                })
            }
        }
    }
    unreachable!("the last attempt returns")
}

/// One try of the halves: their answer, or a prefill worker to leave out and try again.
enum Once {
    Done(PdAnswer),
    RetryPrefill(WorkerId),
}

async fn halves_once(state: &AppState, req: &PdRequest<'_>) -> Result<Once, GatewayError> {
    let pd = state
        .settings
        .pd
        .as_ref()
        .expect("called with disaggregation on");
    let now = Instant::now();
    let model = req.fields.model.as_deref();
    let bs = state.kv.block_size;

    // The decode half first: it decides whether a remote prefill is worth it.
    let (decode, decode_load, cached) = {
        let table = state.workers.table();
        let pool = table.resolve_half(Half::Decode, model)?;
        let plan = plan_half(state, pool, req, req.hints, true, now)?;
        if let Some(span) = req.span {
            routing::trace_decision(span, &plan, bs);
        }
        let choice = plan.choice().clone();
        // What the decode worker holds matters only for --pd-min-uncached-tokens; kv_aware's
        // plan has already looked it up.
        let cached_blocks = if pd.min_uncached_tokens == 0 {
            0
        } else if plan.policy == PolicyKind::KvAware {
            choice.kv.overlap.total()
        } else {
            let overlaps = state.kv.overlaps(&req.tokens.hashes, now);
            let replica = choice.worker.ranks[choice.rank].replica;
            state.kv.counts(&overlaps, &choice.worker, replica).total()
        };
        let cached = (cached_blocks as usize * bs).min(req.tokens.len());
        let load = plan.request_load(bs);
        (choice, load, cached)
    };
    let uncached = (req.tokens.len() - cached) as u64;
    if pd.min_uncached_tokens > 0 && uncached < pd.min_uncached_tokens {
        state.metrics.disagg_decode_only.inc();
        decode.worker.series.pd_decode.inc();
        tracing::debug!(worker = %decode.worker.id, uncached, "Decode-only: the decode worker holds the prompt");
        let response = send_decode(state, req, &decode, decode_load, req.body.clone()).await?;
        return Ok(Once::Done(PdAnswer::Decode {
            response: Box::new(response),
            worker: decode.worker.id.clone(),
            prefill: None,
        }));
    }
    state.metrics.disagg_remote.inc();

    let prefill = {
        let table = state.workers.table();
        let pool = table.resolve_half(Half::Prefill, model)?;
        let hints = Hints {
            pinned_worker: routing::prefill_pin(&req.parts.headers, req.fields)?,
            pinned_rank: None,
            ..req.hints.clone()
        };
        let plan = plan_half(state, pool, req, &hints, false, now)?;
        let choice = plan.choice().clone();
        if plan.policy == PolicyKind::KvAware && !state.kv.uses_events(&choice.worker) {
            state
                .kv
                .record_routed(choice.worker.ranks[choice.rank].replica, &plan.hashes, now);
        }
        (choice, plan.request_load(bs))
    };
    let (prefill, prefill_load) = prefill;
    prefill.worker.series.pd_prefill.inc();
    decode.worker.series.pd_decode.inc();
    tracing::debug!(prefill = %prefill.worker.id, decode = %decode.worker.id, "Disaggregated");
    // The decode worker receives the prompt's KV instead of computing it.
    let decode_load = RequestLoad {
        prefill_tokens: 0,
        ..decode_load
    };
    let prefill_name = HeaderValue::from_str(prefill.worker.id.as_str()).ok();

    let mut body: serde_json::Value =
        serde_json::from_slice(&req.body).map_err(GatewayError::InvalidJson)?;
    let Some(object) = body.as_object_mut() else {
        return Err(GatewayError::InvalidAdmin(
            "the request body must be a JSON object".into(),
        ));
    };
    match pd.protocol {
        PdProtocol::Vllm => {
            let mut first = object.clone();
            first.insert("max_tokens".into(), 1.into());
            if first.contains_key("max_completion_tokens") {
                first.insert("max_completion_tokens".into(), 1.into());
            }
            first.insert("stream".into(), false.into());
            first.remove("stream_options");
            first.insert(
                "kv_transfer_params".into(),
                serde_json::json!({
                    "do_remote_decode": true,
                    "do_remote_prefill": false,
                    "remote_engine_id": null,
                    "remote_block_ids": null,
                    "remote_host": null,
                    "remote_port": null,
                }),
            );
            let first = Bytes::from(serde_json::to_vec(&first).expect("a JSON object"));
            let (params, prefill_name) =
                match prefill_retried(state, req, prefill, prefill_load, first).await? {
                    Ok(done) => done,
                    // The prefill's own error is the client's answer.
                    Err(response) => return Ok(Once::Done(PdAnswer::Answered(response))),
                };
            object.insert("kv_transfer_params".into(), params);
            let second = Bytes::from(serde_json::to_vec(&body).expect("a JSON value"));
            let response = send_decode(state, req, &decode, decode_load, second).await?;
            Ok(Once::Done(PdAnswer::Decode {
                response: Box::new(response),
                worker: decode.worker.id.clone(),
                prefill: prefill_name,
            }))
        }
        PdProtocol::Sglang => {
            let host = host_of(&prefill.worker.url);
            object.insert("bootstrap_host".into(), host.into());
            object.insert(
                "bootstrap_port".into(),
                match prefill.worker.bootstrap_port {
                    Some(p) => p.into(),
                    None => serde_json::Value::Null,
                },
            );
            object.insert("bootstrap_room".into(), (rand::random::<u64>() >> 1).into());
            // Both halves get the same body.
            let both = Bytes::from(serde_json::to_vec(&body).expect("a JSON value"));
            // Spawned: the prefill must run to its end even when the decode answers first
            // (an engine aborts a request whose client went away).
            let mut prefill_half = tokio::spawn(prefill_task(
                state,
                req,
                &prefill,
                prefill_load,
                both.clone(),
            ));
            let decode_half = send_decode(state, req, &decode, decode_load, both);
            tokio::pin!(decode_half);
            // Whichever ends first; a failed prefill stops the decode half.
            let response = tokio::select! {
                prefilled = &mut prefill_half => {
                    let prefilled = prefilled.map_err(|e| GatewayError::Upstream {
                        worker: prefill.worker.id.clone(),
                        source: e.into(),
                    })?;
                    let retry = Once::RetryPrefill(prefill.worker.id.clone());
                    match prefilled {
                        Ok(Ok(_)) => decode_half.await?,
                        Ok(Err(response)) if matches!(response.status().as_u16(), 502..=504) => {
                            return Ok(retry)
                        }
                        Ok(Err(response)) => return Ok(Once::Done(PdAnswer::Answered(response))),
                        Err(GatewayError::Upstream { .. } | GatewayError::UpstreamTimeout { .. }) => {
                            return Ok(retry)
                        }
                        Err(error) => return Err(error),
                    }
                }
                // The prefill half goes on in its task, with its guard.
                decoded = &mut decode_half => decoded?,
            };
            Ok(Once::Done(PdAnswer::Decode {
                response: Box::new(response),
                worker: decode.worker.id.clone(),
                prefill: prefill_name,
            }))
        }
    }
}

/// The plan of one half over `pool`.
fn plan_half(
    state: &AppState,
    pool: &Pool,
    req: &PdRequest<'_>,
    hints: &Hints,
    decode: bool,
    now: Instant,
) -> Result<Plan, GatewayError> {
    let busy = state.busy.get(pool.model.as_str());
    let kept;
    let pool = if req.excluded.is_empty() {
        pool
    } else {
        kept = Pool {
            model: pool.model.clone(),
            workers: pool
                .workers
                .iter()
                .filter(|w| !req.excluded.contains(&w.id))
                .cloned()
                .collect(),
            policy: pool.policy.clone(),
        };
        &kept
    };
    routing::plan(
        &state.kv,
        pool,
        routing::session_key(
            &state.settings.routing_key_headers,
            &req.parts.headers,
            req.fields,
        ),
        hints,
        &routing::Limits {
            busy,
            overload: state.settings.overload,
        },
        if decode {
            state.affinity.as_deref()
        } else {
            None
        },
        req.fields,
        &req.tokens,
        now,
        false,
    )
}

/// The vLLM prefill half, retried on another prefill worker while it fails before any byte
/// reached the client (connection errors, timeouts, 502-504), as single requests are: its
/// `kv_transfer_params` and the prefill worker that gave them, or the failed answer.
async fn prefill_retried(
    state: &AppState,
    req: &PdRequest<'_>,
    first: Choice,
    first_load: RequestLoad,
    body: Bytes,
) -> Result<Result<(serde_json::Value, Option<HeaderValue>), Response>, GatewayError> {
    let (mut prefill, mut load) = (first, first_load);
    let mut tried: Vec<WorkerId> = req.excluded.to_vec();
    let max_retries = state.settings.retry.max_retries;
    for attempt in 0..=max_retries {
        let answer = prefill_task(state, req, &prefill, load, body.clone()).await;
        let retryable = match &answer {
            Err(GatewayError::Upstream { .. } | GatewayError::UpstreamTimeout { .. }) => true,
            Ok(Err(r)) => matches!(r.status().as_u16(), 502..=504),
            _ => false,
        };
        if !retryable || attempt == max_retries {
            let name = HeaderValue::from_str(prefill.worker.id.as_str()).ok();
            return Ok(answer?.map(|params| (params, name)));
        }
        tracing::warn!(worker = %prefill.worker.id, attempt = attempt + 1, "Prefill half failed before any byte; retrying on another prefill worker");
        state.metrics.retries.inc();
        if let Some(span) = req.span {
            span.add("kvroute.retries", 1);
        }
        tried.push(prefill.worker.id.clone());
        let next = {
            let table = state.workers.table();
            let pool = table.resolve_half(Half::Prefill, req.fields.model.as_deref())?;
            let retry = PdRequest {
                excluded: &tried,
                ..req.clone_parts()
            };
            let hints = Hints {
                pinned_worker: None,
                pinned_rank: None,
                ..req.hints.clone()
            };
            match plan_half(state, pool, &retry, &hints, false, Instant::now()) {
                Ok(plan) => Some((
                    plan.choice().clone(),
                    plan.request_load(state.kv.block_size),
                )),
                Err(_) => None,
            }
        };
        match next {
            Some((choice, l)) => {
                choice.worker.series.pd_prefill.inc();
                prefill = choice;
                load = l;
            }
            // No other prefill worker: the last failure is the answer.
            None => {
                let name = HeaderValue::from_str(prefill.worker.id.as_str()).ok();
                return Ok(answer?.map(|params| (params, name)));
            }
        }
    }
    unreachable!("the last attempt returns")
}

impl<'a> PdRequest<'a> {
    /// The same request (its body shared).
    fn clone_parts(&self) -> PdRequest<'a> {
        PdRequest {
            parts: self.parts,
            body: self.body.clone(),
            fields: self.fields,
            tokens: self.tokens.clone(),
            hints: self.hints,
            request_id: self.request_id,
            arrived: self.arrived,
            excluded: self.excluded,
            span: self.span,
        }
    }
}

fn host_of(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    match authority.rsplit_once(':') {
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host.to_owned(),
        _ => authority.to_owned(),
    }
}

/// The prefill half, as a future that owns what it needs (SGLang's is spawned): the
/// `kv_transfer_params` the prefill returned (null when none), or its failed answer for the
/// client.
fn prefill_task(
    state: &AppState,
    req: &PdRequest<'_>,
    prefill: &Choice,
    load: RequestLoad,
    body: Bytes,
) -> impl std::future::Future<Output = Result<Result<serde_json::Value, Response>, GatewayError>>
       + Send
       + 'static {
    let mut guard = InFlight::new(prefill.worker.clone(), prefill.rank, load, None)
        .with_sync(state.sync.get(), || synced(state, req, Half::Prefill));
    if let Some(span) = req.span {
        let rank = prefill.worker.ranks[prefill.rank].dp_rank;
        span.set_str("kvroute.prefill_worker", prefill.worker.id.as_str());
        let attempt = span.attempt(prefill.worker.id.as_str(), rank, 1);
        guard = guard.with_span(attempt.named("prefill"));
    }
    let client = state.client.clone();
    let auth = state.worker_auth.clone();
    let timeout = state.settings.request_timeout;
    let method = req.parts.method.clone();
    let path = req
        .parts
        .uri
        .path_and_query()
        .map_or(req.parts.uri.path(), |pq| pq.as_str())
        .to_owned();
    let headers = req.parts.headers.clone();
    let request_id = req.request_id.clone();
    let worker = prefill.worker.id.clone();
    async move {
        let response = proxy::forward(
            &client,
            guard,
            Forward {
                method,
                path_and_query: &path,
                headers: &headers,
                body,
                request_id: &request_id,
                timeout,
                auth: &auth,
            },
        )
        .await?;
        let status = response.status();
        let (parts, body) = response.into_parts();
        let bytes = http_body_util::Limited::new(body, PREFILL_ANSWER_LIMIT)
            .collect()
            .await
            .map_err(|e| GatewayError::Upstream {
                worker: worker.clone(),
                source: e,
            })?
            .to_bytes();
        if !status.is_success() {
            tracing::warn!(%worker, %status, "Prefill half failed; decode half not sent");
            return Ok(Err(
                http::Response::from_parts(parts, Body::from(bytes)).into_response()
            ));
        }
        let params = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|mut v| v.get_mut("kv_transfer_params").map(serde_json::Value::take))
            .unwrap_or(serde_json::Value::Null);
        Ok(Ok(params))
    }
}

async fn send_decode(
    state: &AppState,
    req: &PdRequest<'_>,
    decode: &Choice,
    load: RequestLoad,
    body: Bytes,
) -> Result<http::Response<proxy::TrackedBody>, GatewayError> {
    let mut guard = InFlight::new(decode.worker.clone(), decode.rank, load, None)
        .with_sync(state.sync.get(), || synced(state, req, Half::Decode));
    if req.fields.stream {
        guard = guard.with_ttft(req.arrived, state.metrics.ttft_seconds.clone());
    }
    if let Some(span) = req.span {
        let rank = decode.worker.ranks[decode.rank].dp_rank;
        let attempt = span.attempt(decode.worker.id.as_str(), rank, 1);
        guard = guard.with_span(attempt.named("decode"));
    }
    decode.worker.series.decisions.inc();
    decode.worker.series.processed.inc();
    forward(state, req, guard, body).await
}

async fn forward(
    state: &AppState,
    req: &PdRequest<'_>,
    guard: InFlight,
    body: Bytes,
) -> Result<http::Response<proxy::TrackedBody>, GatewayError> {
    let path_and_query = req
        .parts
        .uri
        .path_and_query()
        .map_or(req.parts.uri.path(), |pq| pq.as_str());
    proxy::forward(
        &state.client,
        guard,
        Forward {
            method: req.parts.method.clone(),
            path_and_query,
            headers: &req.parts.headers,
            body,
            request_id: req.request_id,
            timeout: state.settings.request_timeout,
            auth: &state.worker_auth,
        },
    )
    .await
}

fn finish(
    mut response: http::Response<proxy::TrackedBody>,
    admitted: Admitted,
    prefill: Option<HeaderValue>,
) -> Response {
    response.body_mut().hold(admitted);
    if let Some(p) = prefill {
        response.headers_mut().insert(PREFILL_WORKER_HEADER, p);
    }
    response.map(Body::new)
}

/// What a peer replica learns from a disaggregated half: the model and the session key (the
/// halves' policies key on tokens and load, not text).
fn synced(state: &AppState, req: &PdRequest<'_>, half: Half) -> crate::sync::Learnt {
    crate::sync::Learnt {
        model: req.fields.model.as_deref().unwrap_or_default().to_owned(),
        session_key: routing::session_key(
            &state.settings.routing_key_headers,
            &req.parts.headers,
            req.fields,
        )
        .map(str::to_owned),
        // Sessions are bound to the decode half (see `plan_half`).
        bind: half == Half::Decode && state.affinity.is_some(),
        half: Some(half),
        ..Default::default()
    }
}
