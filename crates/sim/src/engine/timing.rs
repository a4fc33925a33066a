//! How long a step takes: a published model with every coefficient a flag, in two families
//! ([`TimingFamily`], `--timing-model`).
//!
//! A step that prefills `T` new tokens in all, attending to `P` (new token, earlier context
//! token) pairs, and decodes `D` sequences while the KV cache is a fraction `u` full, takes
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
//! **The two families** differ in those two terms and in what `T`, `D` and `u` count:
//!
//! | | `kvroute` (default) | `dynamo` (Dynamo 1.6.1's mocker, exactly) |
//! |---|---|---|
//! | context term, per-sequence term | 8.42e-7, 0.1 | 0, 0 |
//! | `T` | every token computed that is not a decode, a preempted sequence's recomputed outputs included | `n x (mean prompt end - mean prompt start)` over the `n` sequences computing prompt tokens (integer means); recomputed outputs are free |
//! | `D` | sequences computing one token after an output (or a received prompt) | every sequence sampling a token except those whose first token this step's prefill produced (a preempted sequence's last recompute chunk is a decode) |
//! | `u` | KV blocks in use / all blocks, at the step's start (after scheduling) | tokens of the `D` sequences (prompt and outputs so far, shared blocks counted per sequence) / (blocks x block size), at most 1 |
//!
//! With `dynamo` the scheduler also admits and caches as Dynamo's mocker does ([`Scheduler`]).
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

/// Whose step-time model a simulated engine follows (see the module docs): its coefficient
/// defaults, how a step's work is counted, and its scheduler rules ([`Scheduler`]).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TimingFamily {
    /// kvroute's: Dynamo's fits plus a context term and a per-sequence decode term, over
    /// vLLM v1's scheduler.
    #[default]
    Kvroute,
    /// NVIDIA Dynamo 1.6.1's mocker: its fits alone, its counting and its scheduler rules.
    Dynamo,
}

impl TimingFamily {
    /// The family's model with its default coefficients.
    pub fn timing(self) -> TimingModel {
        match self {
            TimingFamily::Kvroute => TimingModel::default(),
            TimingFamily::Dynamo => TimingModel {
                family: TimingFamily::Dynamo,
                prefill_context: 0.0,
                decode_per_seq: 0.0,
                ..TimingModel::default()
            },
        }
    }

    /// The family's scheduler rules.
    pub fn scheduler(self) -> Scheduler {
        match self {
            TimingFamily::Kvroute => Scheduler::Kvroute,
            TimingFamily::Dynamo => Scheduler::Dynamo,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TimingFamily::Kvroute => "kvroute",
            TimingFamily::Dynamo => "dynamo",
        }
    }
}

impl std::fmt::Display for TimingFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The scheduler's rules where kvroute's engine and Dynamo's mocker differ: what must fit in
/// the free KV blocks for a waiting sequence to start (cached blocks no running sequence
/// holds count as free; those it reuses count against it), and when computed blocks join the
/// prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scheduler {
    /// A sequence starts when the blocks of this step's chunk fit (its cached prefix and the
    /// tokens the budget lets it compute now; later chunks take blocks as they run,
    /// preempting if they must), as vLLM v1 does (`allocate_slots` for the scheduled tokens
    /// only). Full blocks are cached when the step ends.
    #[default]
    Kvroute,
    /// A sequence starts when the blocks of its whole known sequence fit (prompt, and the
    /// outputs of a preempted one), though only the chunk's are taken now. Full blocks are
    /// cached as soon as they are scheduled, so a sequence admitted later in the same step
    /// reuses them, as vLLM v1 does (`allocate_slots` caches them). Dynamo's mocker.
    Dynamo,
}

/// The step-time model's coefficients (milliseconds).
#[derive(Debug, Clone, PartialEq)]
pub struct TimingModel {
    /// How a step's work is counted (see the module docs).
    pub family: TimingFamily,
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
            family: TimingFamily::Kvroute,
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

/// What a step computes, counted as its family counts it (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepWork {
    /// Tokens whose KV the step computes, prefill and decode alike, however timed.
    pub scheduled_tokens: usize,
    /// `T`: prefill tokens, as timed.
    pub prefill_tokens: usize,
    /// `P`: (new token, earlier context token) pairs of the prefills.
    pub context_pairs: u64,
    /// `D`: sequences decoded.
    pub decode_seqs: usize,
    /// `u`: the KV utilisation the decode curve reads.
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
    fn the_dynamo_family_is_dynamos_fits_alone() {
        let m = TimingFamily::Dynamo.timing();
        for t in [1usize, 512, 8192] {
            let x = t as f64;
            let want = 4.209989e-07 * x * x + 1.518344e-02 * x + 16.50142;
            assert!((m.prefill_ms(t, 1_000_000) - want).abs() < 1e-9, "{t}");
        }
        assert_eq!(m.prefill_ms(0, 0), 0.0);
        for (seqs, p) in [(1, 0.0), (200, 0.5), (7, 1.0)] {
            let want = f64::max(-25.74 * p * p + 54.01 * p + 5.74, 1.0);
            assert!((m.decode_ms(seqs, p) - want).abs() < 1e-9, "{p}");
        }
        assert_eq!(m.decode_ms(0, 0.5), 0.0);
        let w = StepWork {
            scheduled_tokens: 1003,
            prefill_tokens: 1000,
            decode_seqs: 3,
            kv_utilisation: 0.25,
            ..StepWork::default()
        };
        let fast = TimingModel {
            speedup: 2.0,
            ..m.clone()
        };
        let want = (m.prefill_ms(1000, 0) + m.decode_ms(3, 0.25)) / 2.0;
        assert!((fast.step_time(&w).as_secs_f64() * 1e3 - want).abs() < 1e-6);
        assert_eq!(TimingFamily::Kvroute.timing(), TimingModel::default());
        assert_eq!(TimingFamily::Dynamo.scheduler(), Scheduler::Dynamo);
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
