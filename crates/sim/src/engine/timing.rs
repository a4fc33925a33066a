//! How long a step takes: a published model with every coefficient a flag.
//!
//! A step that prefills `T` new tokens in all, attending to `P` (new token, earlier context
//! token) pairs, and decodes `D` sequences while a fraction `u` of the KV blocks is in use,
//! takes
//!
//! ```text
//! prefill_ms = 4.209989e-7 * T^2 + 1.518344e-2 * T + 16.50142 + 8.42e-7 * P     (when T > 0)
//! decode_ms  = max(1, -25.74 * u^2 + 54.01 * u + 5.74) + 0.1 * D                 (when D > 0)
//! step       = (prefill_ms + decode_ms) / speedup
//! ```
//!
//! The prefill polynomial and the decode curve over KV utilisation are NVIDIA Dynamo's mocker
//! fits (a Llama-class 8B model on one H100-class GPU). Two terms are ours: cached context is
//! not free (each new token attends to every earlier token of its sequence, at the same cost
//! per pair as the fit's quadratic term implies for pairs among new tokens: 2 x 4.21e-7 ms),
//! and decode grows with the batch (0.1 ms per running sequence: sampling and per-sequence
//! kernel work). A mixed step (chunked prefill beside decodes) costs the sum.
//!
//! A KV transfer of `T` tokens (prefill/decode disaggregation) takes
//!
//! ```text
//! transfer_s = T * kv_bytes_per_token * 8 / (kv_transfer_gbps * 1e9) / speedup
//! ```
//!
//! a link at full rate, no setup cost. The defaults: 131072 bytes per token, Llama-3-8B's
//! KV in fp16 (2 tensors, K and V, x 32 layers x 8 KV heads x 128 dims x 2 bytes), over
//! 100 Gb/s (one RDMA NIC of the class NIXL drives): 10.5 ms for 1000 tokens.

use std::time::Duration;

/// The step-time model's coefficients (milliseconds).
#[derive(Debug, Clone, PartialEq)]
pub struct TimingModel {
    pub prefill_quadratic: f64,
    pub prefill_linear: f64,
    pub prefill_constant: f64,
    /// Per (new token, earlier context token) pair.
    pub prefill_context: f64,
    pub decode_quadratic: f64,
    pub decode_linear: f64,
    pub decode_constant: f64,
    /// Per sequence decoded in the step.
    pub decode_per_seq: f64,
    /// Bytes of KV per token, for transfers.
    pub kv_bytes_per_token: u64,
    /// The transfer link's rate, in gigabits per second.
    pub kv_transfer_gbps: f64,
    /// Divides every time.
    pub speedup: f64,
}

impl Default for TimingModel {
    fn default() -> Self {
        Self {
            prefill_quadratic: 4.209989e-7,
            prefill_linear: 1.518344e-2,
            prefill_constant: 16.50142,
            prefill_context: 8.42e-7,
            decode_quadratic: -25.74,
            decode_linear: 54.01,
            decode_constant: 5.74,
            decode_per_seq: 0.1,
            kv_bytes_per_token: 131_072,
            kv_transfer_gbps: 100.0,
            speedup: 1.0,
        }
    }
}

/// What a step computes, for its timing.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepWork {
    pub prefill_tokens: usize,
    pub context_pairs: u64,
    pub decode_seqs: usize,
    pub kv_utilisation: f64,
}

impl TimingModel {
    pub fn prefill_ms(&self, tokens: usize, context_pairs: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        self.prefill_quadratic * t * t
            + self.prefill_linear * t
            + self.prefill_constant
            + self.prefill_context * context_pairs as f64
    }

    pub fn decode_ms(&self, seqs: usize, kv_utilisation: f64) -> f64 {
        if seqs == 0 {
            return 0.0;
        }
        let u = kv_utilisation.clamp(0.0, 1.0);
        let curve = self.decode_quadratic * u * u + self.decode_linear * u + self.decode_constant;
        curve.max(1.0) + self.decode_per_seq * seqs as f64
    }

    /// How long the KV of `tokens` tokens takes to arrive.
    pub fn transfer_time(&self, tokens: usize) -> Duration {
        let bits = tokens as f64 * self.kv_bytes_per_token as f64 * 8.0;
        let seconds = bits / (self.kv_transfer_gbps * 1e9) / self.speedup.max(f64::MIN_POSITIVE);
        Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX)
    }

    pub fn step_time(&self, work: &StepWork) -> Duration {
        let ms = self.prefill_ms(work.prefill_tokens, work.context_pairs)
            + self.decode_ms(work.decode_seqs, work.kv_utilisation);
        Duration::from_secs_f64((ms / self.speedup.max(f64::MIN_POSITIVE)) / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_grow_with_work() {
        let m = TimingModel::default();
        assert!(m.prefill_ms(2000, 0) > m.prefill_ms(1000, 0));
        assert!(m.prefill_ms(1000, 1_000_000) > m.prefill_ms(1000, 0));
        assert!(m.decode_ms(64, 0.2) > m.decode_ms(8, 0.2));
        assert!(m.decode_ms(8, 0.5) > m.decode_ms(8, 0.1));
        assert_eq!(m.step_time(&StepWork::default()), Duration::ZERO);
        // A small decode batch at moderate KV use takes tens of milliseconds.
        let ms = m.decode_ms(16, 0.25);
        assert!((10.0..40.0).contains(&ms), "{ms}");
        let fast = TimingModel {
            speedup: 100.0,
            ..m.clone()
        };
        let w = StepWork {
            prefill_tokens: 512,
            ..StepWork::default()
        };
        let ratio = m.step_time(&w).as_secs_f64() / fast.step_time(&w).as_secs_f64();
        assert!((ratio - 100.0).abs() < 1e-3, "{ratio}");
    }

    #[test]
    fn transfers_take_bytes_over_the_link_rate() {
        let m = TimingModel::default();
        // 1000 tokens x 128 KiB x 8 bits / 100 Gb/s = 10.48576 ms.
        let t = m.transfer_time(1000).as_secs_f64();
        assert!((t - 0.010_485_76).abs() < 1e-9, "{t}");
        assert_eq!(m.transfer_time(0), Duration::ZERO);
        let fast = TimingModel {
            speedup: 10.0,
            kv_transfer_gbps: 400.0,
            ..m.clone()
        };
        let ratio = m.transfer_time(1000).as_secs_f64() / fast.transfer_time(1000).as_secs_f64();
        assert!((ratio - 40.0).abs() < 1e-6, "{ratio}");
    }
}
