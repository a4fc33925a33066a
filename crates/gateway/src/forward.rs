//! A routed request: admission, routing, forwarding, and retries on another worker.
//!
//! A request is retried on another eligible worker when its attempt fails before the first
//! response byte (connection error, timeout, 502/503/504), with jittered exponential
//! backoff; never after a response started, never when it is pinned. Every attempt feeds
//! the worker's circuit breaker.

use std::time::Instant;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use http_body_util::{BodyExt, Limited};
use kvroute_core::PolicyKind;
use kvroute_protocol::{RoutingFields, WorkerId};

use crate::auth;
use crate::context::AppState;
use crate::error::GatewayError;
use crate::proxy::{self, Admitted, Forward, InFlight};
use crate::routing;
use crate::workers::Pool;

/// Reads a request body of at most `limit` bytes (413 beyond it, also when the declared
/// `content-length` says so before reading).
pub(crate) async fn read_body(
    body: Body,
    limit: usize,
    headers: &HeaderMap,
) -> Result<Bytes, GatewayError> {
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(GatewayError::PayloadTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(GatewayError::PayloadTooLarge { limit })
        }
        Err(e) => Err(GatewayError::BodyRead(e)),
    }
}

/// Admits a request under `--max-concurrent-requests` (429 beyond it).
fn admit(state: &AppState) -> Result<Admitted, GatewayError> {
    let permit = match &state.limit {
        Some(limit) => Some(limit.clone().try_acquire_owned().map_err(|_| {
            GatewayError::TooManyRequests(state.settings.max_concurrent_requests.unwrap_or(0))
        })?),
        None => None,
    };
    Ok(Admitted::new(permit, state.metrics.in_router.clone()))
}

/// Routes that are disaggregated when prefill/decode disaggregation is on.
const PD_ROUTES: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/generate"];

/// Routes one request and forwards it, retrying as the module doc says; P/D routes go
/// through [`crate::pd::route`].
pub(crate) async fn route_and_forward(
    state: &AppState,
    route: &'static str,
    req: Request,
    request_id: &HeaderValue,
) -> Result<Response, GatewayError> {
    let arrived = Instant::now();
    let (parts, body) = req.into_parts();
    auth::check_client(state.settings.client_api_key.as_ref(), &parts.headers)
        .map_err(|r| GatewayError::Unauthorized(r.message(false)))?;
    let admitted = admit(state)?;
    let body = read_body(body, state.settings.max_payload_size, &parts.headers).await?;
    let fields = RoutingFields::from_json(&body).map_err(GatewayError::InvalidJson)?;
    let started = Instant::now();
    let pd = state
        .settings
        .pd
        .as_ref()
        .filter(|_| PD_ROUTES.contains(&route));
    let tokenize_as = match pd {
        // The decode-only decision needs the prompt's tokens whatever the policies.
        Some(pd) if pd.min_uncached_tokens > 0 => PolicyKind::KvAware,
        Some(pd) if pd.decode_policy == PolicyKind::KvAware => PolicyKind::KvAware,
        Some(pd) => pd.prefill_policy,
        None => state.settings.policy,
    };
    let tokens = routing::tokens_for(&state.kv, tokenize_as, &body).await;

    let hints = routing::parse_hints(&parts.headers)?;
    if pd.is_some() {
        let arrived_at = arrived;
        return crate::pd::route(
            state,
            crate::pd::PdRequest {
                parts: &parts,
                body: body.clone(),
                fields: &fields,
                tokens,
                hints: &hints,
                request_id,
                arrived: arrived_at,
            },
            admitted,
        )
        .await;
    }
    let mut released = None;
    let mut class = None;
    if let Some(queue) = &state.queue {
        // Admission: wait while every eligible rank is saturated with prefill. Requests
        // with no eligible worker fail at once.
        let c = queue.class_of(
            parts
                .headers
                .get("x-kvroute-class")
                .and_then(|v| v.to_str().ok()),
        )?;
        class = Some(c);
        let (ranks, cost) = {
            let table = state.workers.table();
            let pool = table.resolve(fields.model.as_deref())?;
            let busy = queue.thresholds(c, state.busy.get(pool.model.as_str()));
            let ranks = routing::eligible_ranks(pool, &hints, &busy, started)?;
            // The cost for ordering and DRR: uncached tokens as the index sees them now.
            let hashes = kvroute_index::block_hashes(&tokens, state.kv.block_size, 0);
            let overlaps = state.kv.overlaps(&hashes, started);
            let best = ranks
                .iter()
                .map(|(w, r)| state.kv.counts(&overlaps, w, w.ranks[*r].replica).total())
                .max()
                .unwrap_or(0) as usize;
            let cached = best * state.kv.block_size;
            (ranks, tokens.len().saturating_sub(cached) as u64)
        };
        released = Some(queue.admit(c, ranks, cost).await?);
    }
    let max_retries = state.settings.retry.max_retries;
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |pq| pq.as_str());
    let mut tried: Vec<WorkerId> = Vec::new();
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
        }
        let now = Instant::now();
        let table = state.workers.table();
        let pool = table.resolve(fields.model.as_deref())?;
        let untried;
        let pool = if tried.is_empty() {
            pool
        } else {
            untried = Pool {
                model: pool.model.clone(),
                workers: pool
                    .workers
                    .iter()
                    .filter(|w| !tried.contains(&w.id))
                    .cloned()
                    .collect(),
                policy: pool.policy.clone(),
            };
            &untried
        };
        let mut busy = state.busy.get(pool.model.as_str());
        if let (Some(queue), Some(c)) = (&state.queue, class) {
            busy = queue.thresholds(c, busy);
        }
        let plan = match routing::plan(
            &state.kv,
            pool,
            &parts.headers,
            &hints,
            &busy,
            state.affinity.as_deref(),
            &fields,
            &tokens,
            now,
            false,
        ) {
            Ok(plan) => plan,
            // Nowhere left to retry: the last failure is the answer.
            Err(e) => return Err(last_error.unwrap_or(e)),
        };
        if attempt == 0 {
            state
                .metrics
                .routing_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        let choice = plan.choice().clone();
        let rank = &choice.worker.ranks[choice.rank];
        let load = plan.request_load(state.kv.block_size);
        let synced_model = state.sync.get().map(|_| pool.model.as_str().to_owned());
        let policy = plan.policy;
        drop(table);
        tracing::debug!(worker = %choice.worker.id, dp_rank = ?rank.dp_rank, attempt, "Routed");
        choice.worker.series.decisions.inc();
        choice.worker.series.processed.inc();

        let mut guard = InFlight::new(
            choice.worker.clone(),
            choice.rank,
            load,
            state.queue.clone(),
        )
        .with_sync(state.sync.get(), || {
            let key = routing::session_key(&parts.headers, &fields).map(str::to_owned);
            let text = if policy == PolicyKind::CacheAware {
                fields.routing_text().into_owned()
            } else {
                String::new()
            };
            crate::sync::Learnt {
                model: synced_model.unwrap_or_default(),
                half: None,
                session_key: key,
                bind: state.affinity.is_some(),
                text,
                // llm_d keys on tokens: a peer needs them to learn this decision.
                tokens: if policy == PolicyKind::LlmD {
                    tokens.clone()
                } else {
                    Vec::new()
                },
            }
        });
        // Its load is counted: the queue may consider the next request.
        released.take();
        if fields.stream {
            guard = guard.with_ttft(arrived, state.metrics.ttft_seconds.clone());
        }
        let result = proxy::forward(
            &state.client,
            guard,
            Forward {
                method: parts.method.clone(),
                path_and_query,
                headers: &parts.headers,
                body: body.clone(),
                request_id,
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
        if plan.policy == PolicyKind::KvAware && plan.prompt_tokens > 0 {
            let cached = choice.kv.overlap.total() as f64 * state.kv.block_size as f64;
            state
                .metrics
                .kv_hit_ratio
                .observe((cached / plan.prompt_tokens as f64).min(1.0));
            if !state.kv.uses_events(&choice.worker) {
                state
                    .kv
                    .record_routed(choice.worker.ranks[choice.rank].replica, &plan.hashes, now);
            }
        }
        let mut response = result?;
        response.body_mut().hold(admitted);
        return Ok(response.map(Body::new));
    }
    Err(last_error.unwrap_or(GatewayError::NoEndpoint("no worker left to try")))
}
