//! The calibrated cost model's pricing (see "Calibrated" and "KV overflow" in
//! [`super`]'s docs): each rank's speed against the cluster's, its share of the cluster's KV,
//! and the blocks beyond nine tenths of its KV.

use crate::latency::{SpeedFactors, FACTOR_EARLY};
use crate::EngineLoad;

/// kvroute's weight of the own-decode term (see "Own decode" in the module docs).
pub const DEFAULT_OWN_DECODE_WEIGHT: f64 = 3000.0;
/// kvroute's weight of the KV-overflow term.
pub const DEFAULT_KV_OVERFLOW_WEIGHT: f64 = 4.0;
/// The share of an engine's KV blocks beyond which the overflow term counts.
pub const KV_OVERFLOW_SHARE: f64 = 0.9;

/// Differences in speed factor within this share (in log terms) of the cluster's mean are
/// taken as noise: eight identical engines measured within about ±10% of each other.
pub const SPEED_NOISE: f64 = 0.1;
/// `exp(SPEED_NOISE)`: the ratio of speed factors at the edge of the noise band.
pub(super) const NOISE_BAND: f64 = 1.105_170_918_075_647_7;

/// The KV blocks an engine (`engine`) holds for its active requests as the router best
/// knows it: its own count (`decode_blocks`) or the engine's reported utilisation times its
/// blocks, whichever is more. Without output blocks tracked the router's count misses the
/// answers' blocks, which the engine's figure holds; the router's count holds the requests
/// routed there that the engine has not admitted yet (or reported).
fn kv_in_use(engine: &EngineLoad, decode_blocks: u64, capacity: u64) -> f64 {
    let reported = engine.kv_usage.map_or(0.0, |u| u.clamp(0.0, 1.0)) * capacity as f64;
    (decode_blocks as f64).max(reported)
}

/// The blocks an engine holding `decode_blocks` for the router would hold beyond
/// [`KV_OVERFLOW_SHARE`] of its KV with `new_blocks` more (0 when its capacity is unknown).
pub(super) fn beyond_share(engine: &EngineLoad, decode_blocks: u64, new_blocks: u64) -> f64 {
    match engine.num_gpu_blocks {
        Some(n) if n > 0 => {
            let held = kv_in_use(engine, decode_blocks, n);
            (held + new_blocks as f64 - KV_OVERFLOW_SHARE * n as f64).max(0.0)
        }
        _ => 0.0,
    }
}

/// Whether an engine holds no more than [`KV_OVERFLOW_SHARE`] of its KV (or does not say how
/// much it has): a place the overflow term can send a request to.
pub(super) fn has_kv_room(engine: &EngineLoad, decode_blocks: u64) -> bool {
    beyond_share(engine, decode_blocks, 0) == 0.0
}

/// The memory term with the request's own blocks at the decode price `d`: the blocks already
/// there count as they are (memory held is memory held on any GPU), the request's new ones
/// as the decode work it brings (see "Calibrated" in the module docs).
pub(super) fn memory_priced(memory: f64, blocks: u64, new_blocks: u64, d: f64) -> f64 {
    if d == 1.0 || blocks == 0 {
        return memory;
    }
    // The request's share of the blocks (`memory` is `blocks`, or `blocks^2 / C` under
    // utilisation: either way the share of it that is the request's).
    let own = new_blocks.min(blocks) as f64 / blocks as f64;
    memory * (1.0 + (d - 1.0) * own)
}

/// The own-decode term's price less 1 for a rank of prefill price `p` and decode price `d`
/// (see "Own decode" in the module docs): `d` brought one more [`SPEED_NOISE`] toward 1, where
/// `p` is beyond its band on the same side; else 0.
pub(super) fn own_decode_excess(p: f64, d: f64) -> f64 {
    let excess = if d > NOISE_BAND {
        d / NOISE_BAND - 1.0
    } else if d * NOISE_BAND < 1.0 {
        d * NOISE_BAND - 1.0
    } else {
        0.0
    };
    if (p - 1.0) * excess > 0.0 {
        excess
    } else {
        0.0
    }
}

/// A rank's speed factor counts from this many observations (its first reading then: the
/// quantile of those seen, [`FACTOR_EARLY`] on); before, the rank is priced at the cluster's
/// mean, or, while it is idle, at its fastest rank's ([`Cluster::prices_of`]): an engine the
/// router has not seen work is not taken as slow, which would keep it from ever being seen.
/// At 20 (the factor's own warm-up) mixed clusters' slow engines kept their prompts longer:
/// TTFT p90 over the best other policy 0.801 / 0.951 / 0.864 on three, 0.800 / 0.963 / 0.837
/// at 10; at 4, identical engines' agent sessions moved by up to 14% (BENCHMARKS.md).
pub const SPEED_EVIDENCE: u64 = 10;

/// What each candidate's cost reads from all the candidates ([`KvAware::cluster`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cluster {
    /// `S` (see the module docs).
    pub saturation: f64,
    /// The candidates' mean prefill and decode speed factors
    /// ([`FittedSpeed`](crate::latency::FittedSpeed)).
    pub prefill_factor: f64,
    pub decode_factor: f64,
    /// The smallest prefill and decode factors among the candidates with evidence (the
    /// mean's where none has): the price of a rank without evidence (see [`Self::prices_of`]).
    pub prefill_best: f64,
    pub decode_best: f64,
    /// The mean KV capacity in blocks of the candidates that report one (0: none does).
    pub capacity: f64,
    /// Whether some candidate has KV room ([`has_kv_room`]); without, the overflow term is 0.
    pub kv_room: bool,
    /// Whether every candidate has [`SPEED_EVIDENCE`] for its prefill factor (always under
    /// the weighted model): the surplus credit counts only then (see "Surplus credit" in the
    /// module docs).
    pub settled: bool,
}

impl Cluster {
    /// Candidates all at the reference speed.
    pub fn uniform(saturation: f64) -> Self {
        Self {
            saturation,
            prefill_factor: 1.0,
            decode_factor: 1.0,
            prefill_best: 1.0,
            decode_best: 1.0,
            capacity: 0.0,
            kv_room: true,
            settled: true,
        }
    }

    /// What one block of the memory term counts on `engine`: the share of its KV it takes,
    /// against the mean engine's (1 where either is unknown).
    pub fn share_of(&self, engine: &EngineLoad) -> f64 {
        match engine.num_gpu_blocks {
            Some(n) if n > 0 && self.capacity > 0.0 => self.capacity / n as f64,
            _ => 1.0,
        }
    }

    /// The prices of a rank's prefill and decode work at speed `s`, relative to the
    /// cluster's mean, with differences within [`SPEED_NOISE`] taken as none. A rank without
    /// [`SPEED_EVIDENCE`] is priced at the mean, or, while it is `idle` and some rank's
    /// prefill is faster than the mean beyond the noise, at the fastest rank's prices (so that
    /// it is tried: at the mean it could sit idle for ever beside a fast rank), or at its own
    /// first reading ([`FACTOR_EARLY`] observations on) where that is slower.
    pub fn prices_of(&self, s: &SpeedFactors, idle: bool) -> (f64, f64) {
        let band = NOISE_BAND;
        let explore = idle && self.prefill_best * band < self.prefill_factor;
        // exp(sign(l) * max(0, |l| - noise)) with l = ln(ratio), without a log or an exp: 1
        // inside the band, the ratio brought back by the band's edge outside it.
        let price = |factor: f64, best: f64, mean: f64, seen: u64| {
            let ratio = if seen >= SPEED_EVIDENCE {
                factor / mean
            } else if explore {
                // The fastest rank's price, unless a first reading says this one is slower.
                if seen >= FACTOR_EARLY as u64 {
                    factor.max(best) / mean
                } else {
                    best / mean
                }
            } else {
                1.0
            };
            if !(ratio.is_finite() && ratio > 0.0) {
                1.0
            } else if ratio > band {
                ratio / band
            } else if ratio * band < 1.0 {
                ratio * band
            } else {
                1.0
            }
        };
        (
            price(
                s.prefill_factor,
                self.prefill_best,
                self.prefill_factor,
                s.prefill_observations,
            ),
            price(
                s.decode_factor,
                self.decode_best,
                self.decode_factor,
                s.decode_observations,
            ),
        )
    }
}
