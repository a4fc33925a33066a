//! The plan of a disaggregated request: a decode worker, and a prefill worker unless the
//! decode worker already holds (nearly) the whole prompt.

use std::time::Instant;

use kvroute_core::eligibility::Hints;
use kvroute_core::latency::PrefillFeatures;
use kvroute_core::slo::Verdict;
use kvroute_core::{PolicyKind, RequestLoad};
use kvroute_protocol::WorkerId;

use crate::context::AppState;
use crate::error::GatewayError;
use crate::pick::Attempt;
use crate::routing::{self, Choice, Plan};
use crate::workers::{Half, Pool};

/// The workers of one disaggregated request, each with the load its half puts on its rank.
pub(super) struct Pair {
    pub decode: Choice,
    pub decode_load: RequestLoad,
    /// None: decode-only, the decode worker computes the prompt itself.
    pub prefill: Option<Prefill>,
    /// The routing's verdicts on the request's TTFT target (the prefill half's choice) and
    /// TPOT target (the decode half's), for counting their outcomes.
    pub verdicts: (Option<Verdict>, Option<Verdict>),
}

/// The prefill half of a pair.
pub(super) struct Prefill {
    pub choice: Choice,
    pub load: RequestLoad,
    /// What its TTFT was predicted from (kv_aware): its answer's time teaches the rank's
    /// TTFT model, as a single request's first token does.
    pub features: Option<PrefillFeatures>,
}

impl Prefill {
    fn of(plan: &Plan, block_size: usize) -> Self {
        Self {
            choice: plan.choice().clone(),
            load: plan.request_load(block_size),
            features: (plan.predictions.as_ref()).map(|p| p[plan.chosen].features),
        }
    }
}

/// Plans the pair for `a`, no worker in `excluded`: the decode half first, since it decides
/// whether a remote prefill is worth it. Counts the decision (`disagg_*`, the workers'
/// `pd_*` series).
pub(super) fn pair(
    state: &AppState,
    a: &Attempt<'_>,
    excluded: &[WorkerId],
) -> Result<Pair, GatewayError> {
    let pd = state
        .settings
        .pd
        .as_ref()
        .expect("called with disaggregation on");
    let now = Instant::now();
    let model = a.fields.model.as_deref();
    let bs = state.kv.block_size;

    let (decode, decode_load, cached, tpot) = {
        let table = state.workers.table();
        let pool = table.resolve_half(Half::Decode, model)?;
        let plan = half(state, pool, a, excluded, a.hints, true, now)?;
        let tpot = plan.slo.as_ref().and_then(|s| s.tpot);
        if let Some(span) = a.span {
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
            let overlaps = state.kv.overlaps(&a.tokens.hashes, now);
            let replica = choice.worker.ranks[choice.rank].replica;
            state.kv.counts(&overlaps, &choice.worker, replica).total()
        };
        let cached = (cached_blocks as usize * bs).min(a.tokens.len());
        let load = plan.answer_load(bs, state.settings.track_output_blocks, a.fields);
        (choice, load, cached, tpot)
    };
    let uncached = (a.tokens.len() - cached) as u64;
    if pd.min_uncached_tokens > 0 && uncached < pd.min_uncached_tokens {
        state.metrics.disagg_decode_only.inc();
        decode.worker.series.pd_decode.inc();
        tracing::debug!(worker = %decode.worker.id, uncached, "Decode-only: the decode worker holds the prompt");
        return Ok(Pair {
            decode,
            decode_load,
            prefill: None,
            verdicts: (None, tpot),
        });
    }
    state.metrics.disagg_remote.inc();

    let (prefill, ttft) = {
        let table = state.workers.table();
        let pool = table.resolve_half(Half::Prefill, model)?;
        let hints = Hints {
            pinned_worker: routing::prefill_pin(&a.parts.headers, a.fields)?,
            pinned_rank: None,
            ..a.hints.clone()
        };
        let plan = half(state, pool, a, excluded, &hints, false, now)?;
        let prefill = Prefill::of(&plan, bs);
        let worker = &prefill.choice.worker;
        if plan.policy == PolicyKind::KvAware && !state.kv.uses_events(worker) {
            let replica = worker.ranks[prefill.choice.rank].replica;
            state.kv.record_routed(replica, &plan.hashes, now);
        }
        (prefill, plan.slo.as_ref().and_then(|s| s.ttft))
    };
    let prefill_worker = &prefill.choice.worker;
    prefill_worker.series.pd_prefill.inc();
    decode.worker.series.pd_decode.inc();
    tracing::debug!(prefill = %prefill_worker.id, decode = %decode.worker.id, "Disaggregated");
    // The decode worker receives the prompt's KV instead of computing it.
    let decode_load = RequestLoad {
        prefill_tokens: 0,
        ..decode_load
    };
    Ok(Pair {
        decode,
        decode_load,
        prefill: Some(prefill),
        verdicts: (ttft, tpot),
    })
}

/// Another prefill worker for `a`, none in `tried` and no pin (a vLLM prefill half that failed
/// before any byte), counted on its `pd_prefill` series; None when there is none.
pub(super) fn next_prefill(
    state: &AppState,
    a: &Attempt<'_>,
    tried: &[WorkerId],
) -> Result<Option<Prefill>, GatewayError> {
    let table = state.workers.table();
    let pool = table.resolve_half(Half::Prefill, a.fields.model.as_deref())?;
    let hints = Hints {
        pinned_worker: None,
        pinned_rank: None,
        ..a.hints.clone()
    };
    let Ok(plan) = half(state, pool, a, tried, &hints, false, Instant::now()) else {
        return Ok(None);
    };
    let prefill = Prefill::of(&plan, state.kv.block_size);
    prefill.choice.worker.series.pd_prefill.inc();
    Ok(Some(prefill))
}

/// The plan of one half over `pool`, its workers in `excluded` left out.
fn half(
    state: &AppState,
    pool: &Pool,
    a: &Attempt<'_>,
    excluded: &[WorkerId],
    hints: &Hints,
    decode: bool,
    now: Instant,
) -> Result<Plan, GatewayError> {
    let busy = state.busy.get(pool.model.as_str());
    let kept;
    let pool = if excluded.is_empty() {
        pool
    } else {
        kept = Pool::new(
            pool.model.clone(),
            (pool.workers.iter())
                .filter(|w| !excluded.contains(&w.id))
                .cloned()
                .collect(),
            pool.policy.clone(),
        );
        &kept
    };
    let slo = hints.slo.of_half(decode);
    let hints = &Hints {
        slo,
        ..hints.clone()
    };
    let planned = routing::plan(
        &state.kv,
        pool,
        routing::session_key(
            &state.settings.routing_key_headers,
            &a.parts.headers,
            a.fields,
        ),
        hints,
        &routing::Limits {
            busy,
            overload: state.settings.overload,
            slo_shed: state.settings.slo_shed,
        },
        // Sessions are bound to the decode half.
        if decode {
            state.affinity.as_deref()
        } else {
            None
        },
        a.fields,
        a.tokens,
        now,
        false,
    );
    // Refused for one half's target: the request's targets are all shed.
    if let Err(GatewayError::SloUnattainable(_)) = &planned {
        state.metrics.slo.shed(&a.hints.slo);
    }
    planned
}
