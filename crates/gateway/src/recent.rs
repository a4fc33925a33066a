//! The last routing decisions, for the dashboard, and the one JSON shape a decision is shown
//! in (also `POST /debug/route`'s): the chosen worker and rank, and every candidate's terms.
//!
//! The request path hands each decision that answered to [`Recent::record`]: one short lock
//! and a push into a bounded ring; the JSON is built only when the dashboard asks.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use kvroute_core::policy::predict::Prediction;
use kvroute_core::EngineLoad;
use kvroute_protocol::ModelId;
use serde_json::{json, Value};

use crate::routing::Plan;

/// How many decisions the ring keeps.
pub const RECENT_DECISIONS: usize = 100;

#[derive(Debug)]
struct Decided {
    id: u64,
    unix_ms: u64,
    model: ModelId,
    plan: Plan,
}

/// The last [`RECENT_DECISIONS`] decisions, newest last.
#[derive(Debug, Default)]
pub struct Recent {
    ring: Mutex<(u64, VecDeque<Decided>)>,
}

impl Recent {
    /// Keeps `plan` (its block hashes dropped) as the newest decision.
    pub fn record(&self, model: &ModelId, mut plan: Plan) {
        plan.hashes = Vec::new();
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.0 += 1;
        let id = ring.0;
        if ring.1.len() == RECENT_DECISIONS {
            ring.1.pop_front();
        }
        ring.1.push_back(Decided {
            id,
            unix_ms,
            model: model.clone(),
            plan,
        });
    }

    /// The decisions kept, newest first, as JSON: `id`, `time_ms`, `model`, then
    /// [`plan_json`]'s fields.
    pub fn json(&self, block_size: usize) -> Vec<Value> {
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.1
            .iter()
            .rev()
            .map(|d| {
                let mut v = plan_json(&d.plan, block_size);
                v["id"] = d.id.into();
                v["time_ms"] = d.unix_ms.into();
                v["model"] = d.model.as_str().into();
                v
            })
            .collect()
    }
}

/// A candidate's predicted latencies (ms) and its rank's fitted speeds and adapter load time.
fn predicted_json(p: &Prediction) -> Value {
    let s = &p.speed;
    json!({
        "ttft_ms": p.ttft_ms, "queue_ms": p.queue_ms, "adapter_ms": p.adapter_ms,
        "prefill_ms": p.prefill_ms,
        "decode_ms": p.decode_ms, "interference_ms": p.interference_ms, "cost_ms": p.cost_ms,
        "fitted": {
            "ttft_base_ms": s.prefill[0], "prefill_ms_per_1k_tokens": s.prefill[1],
            "ttft_ms_per_100_decoding": s.prefill[2], "ttft_ms_at_full_kv": s.prefill[3],
            "step_over_reference": s.decode, "output_tokens": s.output_tokens,
            "adapter_load_ms": s.adapter_load_ms,
            "ttft_observations": s.prefill_observations,
            "gap_observations": s.decode_observations,
            "adapter_load_observations": s.adapter_load_observations,
            "prefill_factor": s.prefill_factor, "decode_factor": s.decode_factor,
        },
    })
}

/// A decision: policy, chosen worker and rank, prompt tokens, the chosen candidate's overlap
/// and cost, and every candidate's terms.
pub fn plan_json(plan: &Plan, block_size: usize) -> Value {
    let kv_aware = plan.reads_kv_index;
    let candidates: Vec<Value> = plan
        .choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({
                "worker": c.worker.id.as_str(),
                "dp_rank": c.worker.ranks[c.rank].dp_rank,
                "eligible": true,
                "active_requests": c.in_flight,
            });
            if kv_aware {
                let o = c.kv.overlap;
                v["overlap_blocks"] = json!({
                    "device": o.device, "host": o.host, "disk": o.disk, "external": o.external,
                });
                v["prefill_tokens"] = c.kv.prefill_tokens.into();
                v["decode_blocks"] = c.kv.decode_blocks.into();
                v["new_blocks"] = c.kv.new_blocks.into();
                v["prefilling_requests"] = c.kv.prefilling_requests.into();
                // Of the decode blocks, those its streams added (--router-track-output-blocks).
                let output = c.worker.ranks[c.rank].with_load(|l| l.output_blocks());
                v["output_blocks"] = output.into();
            }
            if let Some(costs) = &plan.costs {
                v["cost"] = costs[i].into();
            }
            if let Some(p) = plan.predictions.as_ref().map(|p| &p[i]) {
                v["predicted"] = predicted_json(p);
            }
            if let Some(h) = plan.slo.as_ref().map(|s| s.headroom[i]) {
                v["headroom"] =
                    json!({"ttft_ms": h.ttft_ms, "tpot_ms": h.tpot_ms, "meets": h.meets()});
            }
            if c.adapter != kvroute_core::AdapterFit::None {
                v["adapter"] = c.adapter.as_str().into();
            }
            let e = c.engine;
            if e != EngineLoad::default() {
                v["engine"] = json!({
                    "waiting": e.waiting, "running": e.running, "kv_usage": e.kv_usage,
                    "num_gpu_blocks": e.num_gpu_blocks,
                });
            }
            v
        })
        .collect();
    let chosen = plan.choice();
    let mut v = json!({
        "policy": plan.policy.name(),
        "worker": chosen.worker.id.as_str(),
        "dp_rank": chosen.worker.ranks[chosen.rank].dp_rank,
        "prompt_tokens": plan.prompt_tokens,
        "block_size": block_size,
        "candidates": candidates,
        "ranks_scored": plan.ranks_scored,
    });
    if kv_aware {
        v["overlap_blocks"] = chosen.kv.overlap.total().into();
    }
    if let Some(costs) = &plan.costs {
        v["cost"] = costs[plan.chosen].into();
    }
    if plan.slo_targets.is_set() {
        v["slo"] = slo_json(plan);
    }
    v
}

/// The request's latency targets, and the verdicts of the choice by headroom (`null` when
/// the policy predicts no latency: the targets are then only counted).
fn slo_json(plan: &Plan) -> Value {
    let t = plan.slo_targets;
    let verdict = |v: Option<kvroute_core::slo::Verdict>| {
        v.map(|v| match v {
            kvroute_core::slo::Verdict::Meets => "meets",
            kvroute_core::slo::Verdict::Unattainable => "unattainable",
        })
    };
    let s = plan.slo.as_ref();
    json!({
        "ttft_ms": t.ttft_ms, "tpot_ms": t.tpot_ms,
        "attainable": s.map(|s| s.attainable()),
        "ttft": verdict(s.and_then(|s| s.ttft)),
        "tpot": verdict(s.and_then(|s| s.tpot)),
    })
}
