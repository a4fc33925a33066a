//! A peer's operations applied to this replica: its rank loads, its policies' learning and
//! its session bindings, and its charges to the tenants' rate limits.

use std::time::Instant;

use kvroute_index::BlockHash;

use super::Local;
use crate::sync::LoadOp;
use crate::workers::{Half, Pool, RoutingTable};

/// The pool whose policy made a peer's decision.
pub(super) fn pool_of<'a>(
    table: &'a RoutingTable,
    model: &str,
    half: Option<Half>,
) -> Option<&'a Pool> {
    let named = (!model.is_empty()).then_some(model);
    match half {
        None => table.resolve(named).ok(),
        Some(half) => table.resolve_half(half, named).ok(),
    }
}

pub(super) fn apply(local: &Local, op: LoadOp) {
    if let LoadOp::Many(ops) = op {
        for op in ops {
            apply(local, op);
        }
        return;
    }
    if let LoadOp::Charge(charge) = op {
        if let Some(limits) = &local.rate_limits {
            limits.charge(&charge, Instant::now());
        }
        return;
    }
    let (worker, dp_rank) = match &op {
        LoadOp::Many(_) | LoadOp::Charge(_) => return,
        LoadOp::Start {
            worker, dp_rank, ..
        }
        | LoadOp::FirstToken {
            worker, dp_rank, ..
        }
        | LoadOp::Finish {
            worker, dp_rank, ..
        } => (worker, *dp_rank),
    };
    let Some(w) = local.workers.get(worker) else {
        return;
    };
    let Some(rank) = w.rank(dp_rank) else {
        return;
    };
    let kv = &local.kv;
    match &op {
        LoadOp::Start { load, learnt, .. } => {
            rank.start(load);
            let now = Instant::now();
            if !kv.uses_events(&w) {
                let hashes: Vec<BlockHash> = load.blocks.iter().map(|&h| BlockHash(h)).collect();
                kv.record_routed(rank.replica, &hashes, now);
            }
            let Some(l) = learnt else { return };
            if let (true, Some(a), Some(key)) = (l.bind, &local.affinity, &l.session_key) {
                a.bind(key, w.id.as_str(), rank.dp_rank, now);
            }
            let table = local.workers.table();
            if let Some(pool) = pool_of(&table, &l.model, l.half) {
                let request = kvroute_core::RouteRequest {
                    session_key: l.session_key.as_deref(),
                    text: &l.text,
                    prompt_tokens: l.tokens.len(),
                    tokens: &l.tokens,
                    block_size: kv.block_size,
                    has_preferred_taints: false,
                    dry_run: false,
                    now,
                };
                pool.policy.observe(&w.id, rank.dp_rank, &request);
            }
        }
        LoadOp::FirstToken { load, .. } => rank.first_token(load),
        LoadOp::Finish {
            load, prefilling, ..
        } => rank.finish(load, *prefilling),
        LoadOp::Many(_) | LoadOp::Charge(_) => {}
    }
}
