//! What a rank publishes on every change, for decisions that read a thousand ranks without
//! taking a lock on each: its load summary and its speed factors, as atomics.
//!
//! Each number is read on its own (relaxed), so a reader may see a change half applied: one
//! request's start counted in the active requests and not yet in the blocks. A decision
//! taken under the rank's lock a moment earlier or later would differ as much; it only
//! ever misjudges a rank by the request in flight.

use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_core::latency::{FittedSpeed, SpeedFactors};
use kvroute_core::LoadSummary;

#[derive(Debug)]
pub(crate) struct Published {
    /// `LoadSummary`'s fields, in its order.
    load: [AtomicU64; 5],
    /// Prefill and decode factors (as `f64` bits), then their observations.
    speed: [AtomicU64; 4],
}

impl Default for Published {
    fn default() -> Self {
        let published = Self {
            load: Default::default(),
            speed: Default::default(),
        };
        published.store_speed(FittedSpeed::prior());
        published
    }
}

impl Published {
    pub(crate) fn store_load(&self, s: &LoadSummary) {
        let values = [
            s.prefill_tokens,
            s.decode_blocks,
            s.active_requests,
            s.prefilling_requests,
            s.first_buckets,
        ];
        for (cell, value) in self.load.iter().zip(values) {
            cell.store(value, Ordering::Relaxed);
        }
    }

    pub(crate) fn load(&self) -> LoadSummary {
        let [prefill_tokens, decode_blocks, active_requests, prefilling_requests, first_buckets] =
            self.load
                .each_ref()
                .map(|cell| cell.load(Ordering::Relaxed));
        LoadSummary {
            prefill_tokens,
            decode_blocks,
            active_requests,
            prefilling_requests,
            first_buckets,
        }
    }

    pub(crate) fn store_speed(&self, s: &FittedSpeed) {
        let values = [
            s.prefill_factor.to_bits(),
            s.decode_factor.to_bits(),
            s.prefill_observations,
            s.decode_observations,
        ];
        for (cell, value) in self.speed.iter().zip(values) {
            cell.store(value, Ordering::Relaxed);
        }
    }

    /// The published factors and their observations: all that the weighted and calibrated
    /// costs read of a speed
    /// ([`KvAware::decides_on_load`](kvroute_core::policy::KvAware::decides_on_load)).
    pub(crate) fn factors(&self) -> SpeedFactors {
        let [prefill, decode, prefill_observations, decode_observations] = self
            .speed
            .each_ref()
            .map(|cell| cell.load(Ordering::Relaxed));
        SpeedFactors {
            prefill_factor: f64::from_bits(prefill),
            decode_factor: f64::from_bits(decode),
            prefill_observations,
            decode_observations,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_stored_is_read_back() {
        let p = Published::default();
        assert_eq!(p.factors(), FittedSpeed::prior().factors());
        let s = LoadSummary {
            prefill_tokens: 1,
            decode_blocks: 2,
            active_requests: 3,
            prefilling_requests: 4,
            first_buckets: 1 << 63,
        };
        p.store_load(&s);
        assert_eq!(p.load(), s);
        let fitted = FittedSpeed {
            prefill_factor: 2.5,
            decode_factor: 0.5,
            prefill_observations: 30,
            decode_observations: 40,
            ..*FittedSpeed::prior()
        };
        p.store_speed(&fitted);
        assert_eq!(p.factors(), fitted.factors());
    }
}
