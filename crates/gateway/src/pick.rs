//! The stages every front door shares, in order: the caller's tenant ([`tenant_of`]),
//! admission under the router's concurrency limit ([`admit`]), the tenant's rate limits
//! ([`reserve`]), the router queue ([`queue_admission`]), the policy's choice with the
//! request counted on its worker and rank ([`pick`]), and what the router learns from it
//! ([`learn`]). The proxy ([`crate::forward`]) forwards to the pick and retries; the endpoint
//! picker ([`crate::epp`]) names it to the gateway.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::HeaderValue;
use kvroute_core::eligibility::Hints;
use kvroute_core::PolicyKind;
use kvroute_protocol::{ModelId, RoutingFields, WorkerId};

use crate::auth::{Caller, Tenant};
use crate::context::AppState;
use crate::error::GatewayError;
use crate::metrics::TokenKind;
use crate::otlp::RequestSpan;
use crate::prompts::Tokens;
use crate::proxy::{Admitted, InFlight};
use crate::queue::Released;
use crate::rate_limit::{Refused, Reservation};
use crate::routing;
use crate::usage::Subscribers;
use crate::workers::Pool;

/// The request's tenant, or its refusal (401; see [`crate::auth::access`]); recorded on
/// its trace span as `kvroute.tenant`.
pub(crate) async fn tenant_of(
    state: &AppState,
    caller: &Caller<'_>,
    span: Option<&Arc<RequestSpan>>,
) -> Result<Tenant, GatewayError> {
    let tenant =
        (state.access.client(caller).await).map_err(|r| GatewayError::refused(r, false))?;
    if let Some(span) = span {
        span.set_str("kvroute.tenant", tenant.as_str());
    }
    Ok(tenant)
}

/// Admits a request (see [`crate::admission`]).
pub(crate) async fn admit(state: &AppState) -> Result<Admitted, GatewayError> {
    let permit = match &state.admission {
        Some(admission) => admission.admit().await?,
        None => None,
    };
    Ok(Admitted::new(permit, state.metrics.in_router.clone()))
}

/// A request's reservation under its tenant's rate limits, and its prompt as counted.
pub(crate) struct Reserved {
    reservation: Reservation,
    prompt: u64,
    /// Anthropic's `count_tokens`: a request, no token, nothing to settle.
    count_only: bool,
}

impl Reserved {
    /// Settles the reservation from the response's usage, read by `subscribers`' tap (a
    /// reservation not subscribed, or whose response is not tapped, is dropped, which gives
    /// its tokens back). Returns the prompt as the reservation counted it.
    pub(crate) fn settle_on(self, subscribers: &mut Subscribers) -> u64 {
        if !self.count_only {
            let reservation = self.reservation;
            subscribers.add(move |u| reservation.settle(u.total(), Instant::now()));
        }
        self.prompt
    }
}

/// The tenant's rate limits, when on (see [`crate::rate_limit`]): reserves the prompt's
/// tokens (the router's count; the prompt is tokenised here when the policy did not need
/// it) plus the answer's `max_completion_tokens` or `max_tokens`, and one request, on the
/// tenant's scope and its model's rule; else 429, counted in
/// `kvroute_tenant_rate_limited_total`. A `count_only` call (Anthropic's `count_tokens`)
/// takes a request and no token.
pub(crate) async fn reserve(
    state: &AppState,
    tenant: &Tenant,
    fields: &RoutingFields<'_>,
    (body, tokens): (&Bytes, &Tokens),
    count_only: bool,
) -> Result<Option<Reserved>, GatewayError> {
    let Some(limits) = &state.rate_limits else {
        return Ok(None);
    };
    let prompt = match tokens.count() {
        _ if count_only => 0,
        0 => routing::tokens_for(&state.kv, PolicyKind::KvAware, body, None)
            .await
            .len(),
        n => n,
    } as u64;
    let answer = match count_only {
        true => 0,
        false => (fields.max_completion_tokens.or(fields.max_tokens)).unwrap_or(0),
    };
    // The rules match the model the request is served as (the only one, when it names none).
    let model = {
        let table = state.workers.table();
        let pool = table.resolve(fields.model.as_deref()).ok();
        pool.map(|p| p.model.as_str().to_owned())
    };
    let model = model.as_deref().or(fields.model.as_deref());
    match limits.reserve(tenant, model, prompt + answer, Instant::now()) {
        Ok(reservation) => Ok(Some(Reserved {
            reservation,
            prompt,
            count_only,
        })),
        Err(refused) => {
            state.metrics.tenants.rate_limited(tenant);
            Err(GatewayError::TenantRateLimited {
                retry_after: match refused {
                    Refused::Wait(secs) => Some(secs),
                    Refused::OverCapacity => None,
                },
            })
        }
    }
}

/// What every attempt of one request shares.
pub(crate) struct Attempt<'a> {
    /// The client's method, URI and headers.
    pub(crate) parts: &'a http::request::Parts,
    pub(crate) fields: &'a RoutingFields<'a>,
    pub(crate) tokens: &'a Tokens,
    pub(crate) hints: &'a Hints,
    pub(crate) request_id: &'a HeaderValue,
    /// Who it is for, resolved once at admission.
    pub(crate) tenant: &'a Tenant,
    pub(crate) arrived: Instant,
    /// The queue's policy class, when the queue is on.
    pub(crate) class: Option<usize>,
    /// The request's trace span, when it is traced.
    pub(crate) span: Option<&'a Arc<RequestSpan>>,
}

impl Attempt<'_> {
    pub(crate) fn path_and_query(&self) -> &str {
        let uri = &self.parts.uri;
        uri.path_and_query().map_or(uri.path(), |pq| pq.as_str())
    }
}

/// What the router queue reads of a request besides its routing fields.
pub(crate) struct QueueAsk<'a> {
    /// Its policy class's name (`x-kvroute-class`, GIE's objective), if any.
    pub(crate) class_name: Option<&'a str>,
    /// Its headers (`x-smg-priority`).
    pub(crate) headers: &'a http::HeaderMap,
    pub(crate) tenant: &'a Tenant,
}

/// The router queue's admission (when it is on): waits while every eligible rank is
/// saturated with prefill; a request with no eligible worker fails at once. Returns the
/// request's policy class and its place, released once its load is counted.
pub(crate) async fn queue_admission<'s>(
    state: &'s AppState,
    ask: QueueAsk<'_>,
    fields: &RoutingFields<'_>,
    hints: &Hints,
    tokens: &Tokens,
    started: Instant,
    span: Option<&Arc<RequestSpan>>,
) -> Result<QueueAdmission<'s>, GatewayError> {
    let Some(queue) = &state.queue else {
        return Ok(QueueAdmission::default());
    };
    let c = queue.class_of(ask.class_name)?;
    let tenant = ask.tenant.as_str();
    let standing =
        crate::queue::standing(queue.priority(), ask.headers, fields.nvext.as_ref(), tenant);
    if let Some(span) = span {
        span.set_str("kvroute.priority", standing.class.as_str());
    }
    let (ranks, cost) = {
        let table = state.workers.table();
        let pool = table.resolve(fields.model.as_deref())?;
        let busy = queue.thresholds(c, state.busy.get(pool.model.as_str()));
        let ranks = routing::eligible_ranks(pool, hints, &busy, started)?;
        // The cost for ordering and DRR: uncached tokens as the index sees them now.
        let overlaps = state.kv.overlaps(&tokens.hashes, started);
        let best = ranks
            .iter()
            .map(|(w, r)| state.kv.counts(&overlaps, w, w.ranks[*r].replica).total())
            .max()
            .unwrap_or(0) as usize;
        let cached = best * state.kv.block_size;
        (ranks, tokens.len().saturating_sub(cached) as u64)
    };
    let queued = Instant::now();
    let req = crate::queue::Queued {
        class: c,
        standing,
        tenant,
        cost,
    };
    let workers = match queue.priority() {
        Some(_) => ranks.iter().map(|(w, _)| w.id.clone()).collect(),
        None => Vec::new(),
    };
    let below_share = (state.engine_levels.as_ref()).is_some_and(|l| l.below_share(ask.tenant));
    let released = queue.admit(req, ranks, below_share).await?;
    let preemptible = queue.preemptible(standing.class, workers);
    if let Some(span) = span {
        span.set_double(
            "kvroute.queue_wait_ms",
            queued.elapsed().as_secs_f64() * 1e3,
        );
    }
    Ok(QueueAdmission {
        class: Some(c),
        released: Some(released),
        preemptible,
        tier: queue.priority().map(|_| standing.class.tier()),
    })
}

/// What the router queue's admission gives a request.
#[derive(Default)]
pub(crate) struct QueueAdmission<'s> {
    /// Its policy class, when the queue is on.
    pub(crate) class: Option<usize>,
    /// Its place, until its load is counted.
    pub(crate) released: Option<Released<'s>>,
    /// With the priority scheduler, its preemption until its first byte.
    pub(crate) preemptible: Option<crate::queue::Preemptible<'s>>,
    /// With the priority scheduler, its priority class's tier (0 the highest).
    pub(crate) tier: Option<usize>,
}

/// Charges `a`'s tenant with the output tokens it is served (VTC's output charge, weighted
/// in the queue) from the response's usage, when it went through the router queue.
pub(crate) fn charge_output_on(state: &AppState, a: &Attempt<'_>, subscribers: &mut Subscribers) {
    if let (Some(queue), Some(class)) = (&state.queue, a.class) {
        let (queue, tenant) = (queue.clone(), a.tenant.clone());
        subscribers.add(move |u| queue.charge_output(class, tenant.as_str(), u.completion));
    }
}

/// Counts the tokens `a`'s tenant is served (`kvroute_tenant_tokens_total`) from the
/// response's usage.
pub(crate) fn count_tokens_on(state: &AppState, a: &Attempt<'_>, subscribers: &mut Subscribers) {
    let (metrics, tenant) = (state.metrics.tenants.clone(), a.tenant.clone());
    subscribers.add(move |u| {
        metrics.tokens(&tenant, TokenKind::Prompt, u.prompt);
        metrics.tokens(&tenant, TokenKind::Completion, u.completion);
    });
}

/// A request's worker and rank, chosen by the policy, with its in-flight guard: its load is
/// counted from here. The proxy forwards to it; the endpoint picker names it to the gateway.
pub(crate) struct Picked {
    pub plan: routing::Plan,
    pub guard: InFlight,
    pub model: ModelId,
    /// When it was chosen.
    pub now: Instant,
}

/// Chooses a worker and rank for `a` among the pool's workers not in `tried`, and counts the
/// request there (a pick and a decision on the worker, its load on the rank, the replicas
/// told); `released` lets the queue consider the next request once that load is counted.
/// `measured`: when routing started, for `kvroute_routing_seconds` (first attempts only).
pub(crate) fn pick(
    state: &AppState,
    a: &Attempt<'_>,
    tried: &[WorkerId],
    released: &mut Option<Released<'_>>,
    measured: Option<Instant>,
) -> Result<Picked, GatewayError> {
    let now = Instant::now();
    let table = state.workers.table();
    let pool = table.resolve(a.fields.model.as_deref())?;
    let untried;
    let pool = if tried.is_empty() {
        pool
    } else {
        untried = Pool::new(
            pool.model.clone(),
            (pool.workers.iter())
                .filter(|w| !tried.contains(&w.id))
                .cloned()
                .collect(),
            pool.policy.clone(),
        );
        &untried
    };
    let mut busy = state.busy.get(pool.model.as_str());
    if let (Some(queue), Some(c)) = (&state.queue, a.class) {
        busy = queue.thresholds(c, busy);
    }
    let keys = &state.settings.routing_key_headers;
    let plan = routing::plan(
        &state.kv,
        pool,
        routing::session_key(keys, &a.parts.headers, a.fields),
        a.hints,
        &routing::Limits {
            busy,
            overload: state.settings.overload,
            slo_shed: state.settings.slo_shed,
        },
        state.affinity.as_deref(),
        a.fields,
        a.tokens,
        now,
        false,
    )
    .inspect_err(|e| count_shed(state, a, e))?;
    if let Some(started) = measured {
        state
            .metrics
            .routing_seconds
            .observe(started.elapsed().as_secs_f64());
    }
    let choice = plan.choice();
    let rank = &choice.worker.ranks[choice.rank];
    let track = state.settings.track_output_blocks;
    let load = plan.answer_load(state.kv.block_size, track, a.fields);
    let synced_model = state.sync.get().map(|_| pool.model.as_str().to_owned());
    let model = pool.model.clone();
    let policy = plan.policy;
    drop(table);
    tracing::debug!(worker = %choice.worker.id, dp_rank = ?rank.dp_rank, "Routed");
    choice.worker.series.decisions.inc();
    choice.worker.series.processed.inc();

    let mut guard = InFlight::new(
        choice.worker.clone(),
        choice.rank,
        load,
        state.queue.clone(),
    )
    .with_sync(state.sync.get(), || {
        let key = routing::session_key(keys, &a.parts.headers, a.fields).map(str::to_owned);
        let text = if policy == PolicyKind::CacheAware {
            a.fields.routing_text().into_owned()
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
                a.tokens.ids.clone()
            } else {
                Vec::new()
            },
        }
    });
    // Its load is counted: the queue may consider the next request.
    released.take();
    guard = guard.with_slo(slo_watch(state, a, &plan));
    if a.fields.stream {
        guard = guard.with_ttft(a.arrived, state.metrics.ttft_seconds.clone());
        // A stream's timings teach its rank's latency models (kv_aware).
        if let Some(p) = plan.predictions.as_ref().map(|p| p[plan.chosen]) {
            guard = guard.with_timing(p.features);
        }
    }
    if let Some(span) = a.span {
        routing::trace_decision(span, &plan, state.kv.block_size);
    }
    Ok(Picked {
        plan,
        guard,
        model,
        now,
    })
}

/// A request refused for its latency targets (`--slo-shed`) is counted `shed`.
fn count_shed(state: &AppState, a: &Attempt<'_>, e: &GatewayError) {
    if let GatewayError::SloUnattainable(_) = e {
        state.metrics.slo.shed(&a.hints.slo);
    }
}

/// The watch that counts the outcomes of `a`'s latency targets, when it has some.
fn slo_watch(
    state: &AppState,
    a: &Attempt<'_>,
    plan: &routing::Plan,
) -> Option<crate::metrics::SloWatch> {
    let (targets, choice) = (a.hints.slo, plan.slo.as_ref());
    crate::metrics::SloWatch::new(
        &state.metrics.slo,
        targets,
        choice,
        a.arrived,
        a.fields.stream,
    )
}

/// What the router learns from a request that went to its pick: kv_aware's hit ratio and
/// the worker's cached tokens, the routed prefix without KV events, the recent decisions.
pub(crate) fn learn(state: &AppState, model: &ModelId, plan: routing::Plan, now: Instant) {
    let choice = plan.choice();
    if plan.reads_kv_index && plan.prompt_tokens > 0 {
        let cached =
            (choice.kv.overlap.total() as usize * state.kv.block_size).min(plan.prompt_tokens);
        state
            .metrics
            .kv_hit_ratio
            .observe(cached as f64 / plan.prompt_tokens as f64);
        choice
            .worker
            .series
            .prompt_tokens
            .inc_by(plan.prompt_tokens as u64);
        choice.worker.series.cached_tokens.inc_by(cached as u64);
        if !state.kv.uses_events(&choice.worker) {
            state
                .kv
                .record_routed(choice.worker.ranks[choice.rank].replica, &plan.hashes, now);
        }
    }
    state.recent.record(model, plan);
}
