//! When a request waits in the router's queue (Dynamo's `--router-queue-threshold`).
//!
//! A rank is *saturated* when its active prefill tokens (the router's accounting: uncached
//! prompt tokens of its requests that have not produced a first token) exceed
//! `threshold x max_num_batched_tokens`, the engine's budget per step, vLLM's default 8192
//! when it is not known:
//!
//! `saturated = prefill_tokens > threshold * max_num_batched_tokens`
//!
//! An arriving request waits when every rank it may go to is saturated, or when others
//! already wait (it does not overtake them). A waiting head may leave when one of its ranks
//! is not saturated; [`DrrQueue::pop`](super::DrrQueue::pop) decides which head goes first.
//! Both the gateway (in real time) and `kvroute-bench simulate` (in virtual time) decide with
//! these functions.

/// vLLM's default `max_num_batched_tokens`, for engines whose budget is not known.
pub const DEFAULT_BATCH_TOKENS: u64 = 8192;

/// Whether `threshold` may be a queue threshold: a positive, finite number.
pub fn valid_threshold(threshold: f64) -> bool {
    threshold.is_finite() && threshold > 0.0
}

/// Whether a rank with `prefill_tokens` active prefill tokens is saturated at `threshold`,
/// its engine's budget being `max_num_batched_tokens` ([`DEFAULT_BATCH_TOKENS`] if unknown).
pub fn saturated(prefill_tokens: u64, max_num_batched_tokens: Option<u64>, threshold: f64) -> bool {
    let budget = max_num_batched_tokens.unwrap_or(DEFAULT_BATCH_TOKENS) as f64;
    prefill_tokens as f64 > threshold * budget
}

/// Whether an arriving request waits: every rank it may go to is saturated, or others
/// already wait.
pub fn must_wait(all_saturated: bool, others_waiting: bool) -> bool {
    all_saturated || others_waiting
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_is_saturated_above_the_threshold_times_its_budget() {
        assert!(
            !saturated(1024, Some(1024), 1.0),
            "at the budget: not above"
        );
        assert!(saturated(1025, Some(1024), 1.0));
        assert!(!saturated(2048, Some(1024), 2.0));
        assert!(saturated(2049, Some(1024), 2.0));
        assert!(saturated(600, Some(1024), 0.5));
        // Unknown budgets are vLLM's default.
        assert!(!saturated(DEFAULT_BATCH_TOKENS, None, 1.0));
        assert!(saturated(DEFAULT_BATCH_TOKENS + 1, None, 1.0));
        assert!(!saturated(0, Some(0), 1.0), "an idle rank never is");
    }

    #[test]
    fn thresholds_are_positive_finite_numbers() {
        assert!(valid_threshold(1.0) && valid_threshold(0.01));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(!valid_threshold(bad), "{bad}");
        }
    }

    #[test]
    fn a_request_waits_behind_others_even_with_capacity() {
        assert!(!must_wait(false, false));
        assert!(must_wait(true, false));
        assert!(must_wait(false, true));
    }
}
