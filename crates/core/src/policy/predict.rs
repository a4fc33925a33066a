//! `kv_aware`'s predicted cost (`--router-cost-model predicted`): each candidate's cost is
//! what the request would spend and make others spend there, in milliseconds, from the
//! rank's latency models ([`crate::latency`]; the prior when the caller has no fit).
//!
//! For a request of `ISL` prompt tokens on a candidate holding `cached` of them (device,
//! host, disk, external and pending hits, as the weighted model counts them) with `P`
//! prompt tokens still prefilling, `D` requests decoding, `R` running, KV utilisation `u`
//! now and `u'` with this request's new blocks:
//!
//! ```text
//! uncached     = max(0, ISL - cached)
//! ttft         = TTFT model(W = P + uncached, D, u')              (queueing + own prefill)
//!                + L * c                                          (L expected adapter loads)
//! prefill      = a1 * uncached / 1000                             (own prefill, marginal)
//! queue        = max(0, ttft - prefill)
//! decode       = O * step model(R + 1, u')                        (own decode, O tokens)
//! interference = D * prefill                                      (each decode waits for it)
//! cost         = ttft + decode + (S + k_i * D) * prefill
//! ```
//!
//! with `k_i` = [`INTERFERENCE_SHARE`] (1/4) and `S` the cluster's saturation (the fewest requests waiting on
//! any candidate, as in the weighted model: that many will wait behind this prefill wherever
//! it goes). `O` is the rank's observed mean output length (the prior: 200). A slow rank
//! has a larger `a1` and step, so it costs more for the same work; a rank short of KV
//! reaches the hinge of the TTFT model sooner. `L` is the request's expected adapter loads
//! on the candidate ([`crate::AdapterFit::expected_loads`]: 0 without an adapter or where it
//! runs, 1 for a load, 2 when every slot is taken), each `c` ms: the rank's fitted load time
//! ([`FittedSpeed::adapter_load_ms`], learned from the TTFTs of requests that loaded; the
//! prior [`ADAPTER_LOAD_MS`] until they have).

use crate::latency::{DecodeFeatures, FittedSpeed, PrefillFeatures};
use crate::{Candidate, RouteRequest};

/// The share of the decodes' summed wait for this request's prefill that counts in its
/// cost. Each of the `D` decoding requests waits once for the chunked prefill; counted
/// whole, that sum (the cluster's total latency) outweighs the request's own TTFT on busy
/// ranks, so a quarter of it counts.
pub const INTERFERENCE_SHARE: f64 = 0.25;

/// One LoRA adapter load before the step that needs it, in milliseconds, before a rank has
/// learned its own (the load model's prior, see [`crate::latency`]: kvroute-sim's
/// `--lora-load-ms` default; vLLM loads an adapter from host memory in tens of them).
pub const ADAPTER_LOAD_MS: f64 = crate::latency::ADAPTER_LOAD_PRIOR_MS;

/// A candidate's predicted latencies for one request, in milliseconds, and the features
/// the prediction used (record them to feed the TTFT model the observed answer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Predicted time to first token: `queue_ms + prefill_ms`.
    pub ttft_ms: f64,
    /// Of which waiting for the work ahead (its adapter's loads included).
    pub queue_ms: f64,
    /// Of the queue, the expected loads of its adapter there.
    pub adapter_ms: f64,
    /// Of which computing this request's uncached prompt.
    pub prefill_ms: f64,
    /// This request's decode: its expected output tokens at the predicted step.
    pub decode_ms: f64,
    /// The predicted decode step with this request running there: its time per output
    /// token (what a TPOT target is held against, see [`crate::slo`]).
    pub step_ms: f64,
    /// The decoding requests' summed wait for this prefill.
    pub interference_ms: f64,
    /// What the policy minimises (see the module docs).
    pub cost_ms: f64,
    pub features: PrefillFeatures,
    /// The fit the prediction used (the prior when the candidate had none).
    pub speed: FittedSpeed,
}

/// The prediction for `request` on `c`; `saturation` is `KvAware::saturation` of all the
/// candidates (0 for one alone).
pub fn predict(c: &Candidate<'_>, request: &RouteRequest<'_>, saturation: f64) -> Prediction {
    let speed = c.speed.unwrap_or_default();
    let bs = request.block_size.max(1);
    let prompt_blocks = request.prompt_tokens.div_ceil(bs) as u64;
    let o = c.kv.overlap;
    let held = u64::from(o.total());
    let pending = prompt_blocks
        .saturating_sub(c.kv.new_blocks)
        .saturating_sub(held);
    let cached_tokens = ((held + pending) as usize * bs).min(request.prompt_tokens);
    let uncached = (request.prompt_tokens - cached_tokens) as f64;
    let new_blocks =
        c.kv.new_blocks
            .min(prompt_blocks.saturating_sub(u64::from(o.device)));
    let (kv_now, kv_after) = match c.engine.num_gpu_blocks.filter(|&n| n > 0) {
        Some(n) => (
            c.kv.decode_blocks as f64 / n as f64,
            (c.kv.decode_blocks + new_blocks) as f64 / n as f64,
        ),
        None => {
            let u = c.engine.kv_usage.unwrap_or(0.0);
            (u, u)
        }
    };
    let decoding =
        c.kv.active_requests
            .saturating_sub(c.kv.prefilling_requests) as f64;
    let features = PrefillFeatures {
        tokens: c.kv.prefill_tokens as f64 + uncached,
        decoding,
        kv_after,
        adapter_loads: c.adapter.expected_loads(),
    };
    let adapter_ms = crate::predicted_adapter_load_ms(c, speed.adapter_load_ms);
    let ttft_ms = speed.ttft_ms(&features) + adapter_ms;
    let prefill_ms = speed.prefill_ms(uncached).min(ttft_ms);
    let running = c.engine.running.unwrap_or(c.kv.active_requests as f64);
    let step = speed.step_ms(&DecodeFeatures {
        running: running + 1.0,
        kv_usage: kv_after.max(kv_now),
    });
    let decode_ms = speed.output_tokens * step;
    let interference_ms = decoding * prefill_ms;
    let cost_ms =
        ttft_ms + decode_ms + (saturation.max(0.0) + INTERFERENCE_SHARE * decoding) * prefill_ms;
    Prediction {
        ttft_ms,
        queue_ms: ttft_ms - prefill_ms,
        adapter_ms,
        prefill_ms,
        decode_ms,
        step_ms: step,
        interference_ms,
        cost_ms,
        features,
        speed,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::latency::LatencyModel;
    use crate::policy::test_support::ids;
    use crate::{AdapterFit, KvTerms, Overlap};

    fn req(prompt_tokens: usize) -> RouteRequest<'static> {
        RouteRequest {
            prompt_tokens,
            block_size: 16,
            ..RouteRequest::simple(None, "", Instant::now())
        }
    }

    #[test]
    fn parts_add_up_and_cached_blocks_are_not_computed() {
        let ids = ids(1);
        let kv = KvTerms {
            prefill_tokens: 2000,
            new_blocks: 100,
            active_requests: 3,
            ..KvTerms::default()
        };
        let cold = Candidate {
            kv,
            ..Candidate::new(&ids[0], 3)
        };
        let warm = Candidate {
            kv: KvTerms {
                overlap: Overlap {
                    device: 50,
                    ..Overlap::default()
                },
                ..kv
            },
            ..cold
        };
        let r = req(1600);
        let (c, w) = (predict(&cold, &r, 0.0), predict(&warm, &r, 0.0));
        assert_eq!(c.features.tokens, 3600.0);
        assert_eq!(w.features.tokens, 2800.0);
        assert_eq!(c.features.decoding, 3.0);
        assert!((c.queue_ms + c.prefill_ms - c.ttft_ms).abs() < 1e-9);
        assert!((c.interference_ms - 3.0 * c.prefill_ms).abs() < 1e-9);
        assert!(w.ttft_ms < c.ttft_ms && w.prefill_ms < c.prefill_ms);
        assert!(w.cost_ms < c.cost_ms);
        // Saturation counts the own prefill once more per waiting request.
        let s = predict(&cold, &r, 2.0);
        assert!((s.cost_ms - c.cost_ms - 2.0 * c.prefill_ms).abs() < 1e-9);
    }

    #[test]
    fn an_adapter_load_adds_its_time_to_the_ttft_and_the_cost() {
        let ids = ids(1);
        let at = |adapter| Candidate {
            adapter,
            ..Candidate::new(&ids[0], 0)
        };
        let r = req(1600);
        let running = predict(&at(AdapterFit::Running), &r, 0.0);
        assert_eq!(running.adapter_ms, 0.0);
        for (fit, loads) in [(AdapterFit::FreeSlot, 1.0), (AdapterFit::Full, 2.0)] {
            let p = predict(&at(fit), &r, 0.0);
            let extra = loads * ADAPTER_LOAD_MS;
            assert_eq!(p.adapter_ms, extra);
            assert!((p.ttft_ms - running.ttft_ms - extra).abs() < 1e-9);
            assert!((p.queue_ms - running.queue_ms - extra).abs() < 1e-9);
            assert!((p.cost_ms - running.cost_ms - extra).abs() < 1e-9);
        }
    }

    #[test]
    fn the_ranks_fitted_load_time_replaces_the_prior() {
        let ids = ids(1);
        let mut m = LatencyModel::default();
        let f = |loads| PrefillFeatures {
            tokens: 1000.0,
            adapter_loads: loads,
            ..PrefillFeatures::default()
        };
        for i in 0..400 {
            let loads = f64::from(i % 2);
            let base = m.speed().ttft_ms(&f(0.0));
            m.observe_ttft(&f(loads), base + 300.0 * loads);
        }
        let learned = m.speed().adapter_load_ms;
        assert!((learned - 300.0).abs() < 15.0, "{learned}");
        let c = Candidate {
            adapter: AdapterFit::Full,
            speed: Some(m.speed()),
            ..Candidate::new(&ids[0], 0)
        };
        let p = predict(&c, &req(1600), 0.0);
        assert_eq!(p.adapter_ms, 2.0 * learned);
        // The features carry the expected loads, for the load model to learn from.
        assert_eq!(p.features.adapter_loads, 2.0);
    }

    #[test]
    fn a_slower_fitted_rank_costs_more_for_the_same_work() {
        let ids = ids(2);
        let mut slow = LatencyModel::default();
        let f = |t: f64, d: f64| PrefillFeatures {
            tokens: t,
            decoding: d,
            kv_after: 0.1,
            adapter_loads: 0.0,
        };
        for i in 0..500 {
            let (t, d) = (f64::from(i % 20) * 1000.0, f64::from(i % 7) * 10.0);
            slow.observe_ttft(
                &f(t, d),
                3.0 * (25.0 + 20.0 * t / 1000.0 + 10.0 * d / 100.0),
            );
        }
        let kv = KvTerms {
            new_blocks: 100,
            ..KvTerms::default()
        };
        let fast = Candidate {
            kv,
            ..Candidate::new(&ids[0], 0)
        };
        let slow = Candidate {
            speed: Some(slow.speed()),
            ..Candidate::new(&ids[1], 0)
        };
        let slow = Candidate { kv, ..slow };
        let (a, b) = (
            predict(&fast, &req(1600), 0.0),
            predict(&slow, &req(1600), 0.0),
        );
        assert!(b.ttft_ms > 2.5 * a.ttft_ms, "{} {}", a.ttft_ms, b.ttft_ms);
        assert!(b.cost_ms > a.cost_ms);
    }
}
