//! The plan of a disaggregated request: a decode worker, and a prefill worker unless the
//! decode worker already holds (nearly) the whole prompt.

use std::time::Instant;

use kvroute_core::eligibility::Hints;
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
    pub prefill: Option<(Choice, RequestLoad)>,
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

    let (decode, decode_load, cached) = {
        let table = state.workers.table();
        let pool = table.resolve_half(Half::Decode, model)?;
        let plan = half(state, pool, a, excluded, a.hints, true, now)?;
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
        (choice, load, cached)
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
        });
    }
    state.metrics.disagg_remote.inc();

    let (prefill, prefill_load) = {
        let table = state.workers.table();
        let pool = table.resolve_half(Half::Prefill, model)?;
        let hints = Hints {
            pinned_worker: routing::prefill_pin(&a.parts.headers, a.fields)?,
            pinned_rank: None,
            ..a.hints.clone()
        };
        let plan = half(state, pool, a, excluded, &hints, false, now)?;
        let choice = plan.choice().clone();
        if plan.policy == PolicyKind::KvAware && !state.kv.uses_events(&choice.worker) {
            state
                .kv
                .record_routed(choice.worker.ranks[choice.rank].replica, &plan.hashes, now);
        }
        (choice, plan.request_load(bs))
    };
    prefill.worker.series.pd_prefill.inc();
    decode.worker.series.pd_decode.inc();
    tracing::debug!(prefill = %prefill.worker.id, decode = %decode.worker.id, "Disaggregated");
    // The decode worker receives the prompt's KV instead of computing it.
    let decode_load = RequestLoad {
        prefill_tokens: 0,
        ..decode_load
    };
    Ok(Pair {
        decode,
        decode_load,
        prefill: Some((prefill, prefill_load)),
    })
}

/// Another prefill worker for `a`, none in `tried` and no pin (a vLLM prefill half that failed
/// before any byte), counted on its `pd_prefill` series; None when there is none.
pub(super) fn next_prefill(
    state: &AppState,
    a: &Attempt<'_>,
    tried: &[WorkerId],
) -> Result<Option<(Choice, RequestLoad)>, GatewayError> {
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
    let choice = plan.choice().clone();
    choice.worker.series.pd_prefill.inc();
    Ok(Some((choice, plan.request_load(state.kv.block_size))))
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
        kept = Pool {
            model: pool.model.clone(),
            workers: pool
                .workers
                .iter()
                .filter(|w| !excluded.contains(&w.id))
                .cloned()
                .collect(),
            policy: pool.policy.clone(),
        };
        &kept
    };
    // Latency targets are not routed on in a disaggregated cluster (yet): each half's
    // prediction is only part of the TTFT.
    let hints = &Hints {
        slo: Default::default(),
        ..hints.clone()
    };
    routing::plan(
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
            slo_shed: false,
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
    )
}
