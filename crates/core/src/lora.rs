//! LoRA adapters on a candidate: where the request's adapter stands there, from what the
//! engine reports (vLLM's `vllm:lora_requests_info`: the adapters of its running and of its
//! waiting requests, and its slots, `max_lora`).
//!
//! An engine runs at most `max_lora` adapters in one step and loads an adapter into a free
//! slot (or the slot of an idle one) before the step that needs it. So a request whose
//! adapter already runs there costs no load; one whose adapter does not, on an engine with a
//! slot to spare, costs one load; on an engine whose slots are all taken it waits until one
//! frees, then loads. [`AdapterFit`] names these cases in llm-d's order (its
//! `lora-affinity-scorer`); [`AdapterFit::expected_loads`] is what `kv_aware` charges, and
//! [`predicted_adapter_load_ms`] the same in milliseconds.

use crate::Candidate;

/// Where a request's adapter stands on a candidate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AdapterFit {
    /// The request names no adapter, or the engine does not report its adapters.
    #[default]
    None,
    /// The adapter runs there.
    Running,
    /// It does not run there, and the engine has a slot to spare (its running and waiting
    /// adapters number fewer than its slots).
    FreeSlot,
    /// Requests of the adapter wait there for a slot.
    Waiting,
    /// Every slot is taken by other adapters.
    Full,
}

impl AdapterFit {
    /// The fit of `adapter` on an engine running `running` and waiting for `waiting`
    /// (distinct adapters each) with `max_lora` slots: the first case that holds, in llm-d's
    /// order (running, a slot to spare, waiting, full).
    pub fn of<T: PartialEq>(adapter: &T, running: &[T], waiting: &[T], max_lora: usize) -> Self {
        if running.contains(adapter) {
            AdapterFit::Running
        } else if running.len() + waiting.len() < max_lora {
            AdapterFit::FreeSlot
        } else if waiting.contains(adapter) {
            AdapterFit::Waiting
        } else {
            AdapterFit::Full
        }
    }

    /// llm-d's `lora-affinity-scorer`: 1 running, 0.8 a slot to spare, 0.6 waiting, 0 full
    /// (and 0 with no adapter: the scorer then does not separate the candidates).
    pub fn llm_d_score(self) -> f64 {
        match self {
            AdapterFit::Running => 1.0,
            AdapterFit::FreeSlot => 0.8,
            AdapterFit::Waiting => 0.6,
            AdapterFit::Full | AdapterFit::None => 0.0,
        }
    }

    /// Adapter loads the request is expected to cost there, in load times: none where it
    /// runs; one where a slot is free; one where it waits (its wait for a slot); two where
    /// every slot is taken (the wait for a slot to free, then the load).
    pub fn expected_loads(self) -> f64 {
        match self {
            AdapterFit::None | AdapterFit::Running => 0.0,
            AdapterFit::FreeSlot | AdapterFit::Waiting => 1.0,
            AdapterFit::Full => 2.0,
        }
    }
}

/// The predicted adapter-load latency of the request on `candidate`, in milliseconds, for an
/// engine that loads an adapter in `load_ms` (for a cost model in milliseconds).
pub fn predicted_adapter_load_ms(candidate: &Candidate<'_>, load_ms: f64) -> f64 {
    candidate.adapter.expected_loads() * load_ms
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_follows_llm_ds_order() {
        let fit = |a: u32, running: &[u32], waiting: &[u32]| AdapterFit::of(&a, running, waiting, 2);
        assert_eq!(fit(1, &[1, 2], &[3]), AdapterFit::Running);
        assert_eq!(fit(1, &[2], &[]), AdapterFit::FreeSlot);
        assert_eq!(fit(1, &[], &[1]), AdapterFit::FreeSlot);
        assert_eq!(fit(1, &[2], &[1]), AdapterFit::Waiting);
        assert_eq!(fit(1, &[2, 3], &[]), AdapterFit::Full);
        let scores: Vec<f64> = [fit(1, &[1], &[]), fit(1, &[2], &[1]), fit(1, &[2, 3], &[])]
            .iter()
            .map(|f| f.llm_d_score())
            .collect();
        assert_eq!(scores, [1.0, 0.6, 0.0]);
    }

    #[test]
    fn loads_are_predicted_in_milliseconds() {
        let id = kvroute_protocol::WorkerId::new("w");
        let mut c = Candidate::new(&id, 0);
        assert_eq!(predicted_adapter_load_ms(&c, 50.0), 0.0);
        c.adapter = AdapterFit::FreeSlot;
        assert_eq!(predicted_adapter_load_ms(&c, 50.0), 50.0);
        c.adapter = AdapterFit::Full;
        assert_eq!(predicted_adapter_load_ms(&c, 50.0), 100.0);
    }
}
