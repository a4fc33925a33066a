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
//!
//! The gauge lists only the adapters that have requests there: an adapter whose requests are
//! done stays loaded (an engine evicts the least recently used idle adapter only when it needs
//! the slot), but the gauge no longer shows it, and every engine with a free slot looks the
//! same. So the router also remembers the adapters it sent to each engine, the `max_lora`
//! most recent ([`RecentAdapters`]): one of those that the engine does not run, on an engine
//! whose running adapters leave its slot (and that it does not wait for), is
//! [`AdapterFit::Resident`], and costs no load.

use std::collections::VecDeque;

use crate::Candidate;

/// Where a request's adapter stands on a candidate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AdapterFit {
    /// The request names no adapter, or the engine does not report its adapters.
    #[default]
    None,
    /// The adapter runs there.
    Running,
    /// Requests of it wait there and a slot is to spare (running and waiting adapters fewer
    /// than the slots): its load is under way.
    Queued,
    /// It does not run there but was among the last `max_lora` adapters sent there, and no
    /// other adapter has needed its slot since: it is most likely still loaded.
    Resident,
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
    /// (distinct adapters each) with `max_lora` slots, `recent` saying whether the router
    /// sent it there lately ([`RecentAdapters`]): the first case that holds, in llm-d's order
    /// (running, a slot to spare, waiting, full); a slot to spare where it waits is queued,
    /// and one sent there lately is resident while no other adapter needs its slot.
    ///
    /// An adapter in both lists takes one slot: vLLM 0.32 writes every adapter that has
    /// requests into both labels, so counting the lists' lengths would halve its slots.
    pub fn of<T: PartialEq>(
        adapter: &T,
        running: &[T],
        waiting: &[T],
        max_lora: usize,
        recent: bool,
    ) -> Self {
        let only_waiting = waiting.iter().filter(|a| !running.contains(a)).count();
        let spare = running.len() + only_waiting < max_lora;
        if running.contains(adapter) {
            AdapterFit::Running
        } else if spare && waiting.contains(adapter) {
            AdapterFit::Queued
        } else if recent && running.len() < max_lora && !waiting.contains(adapter) {
            AdapterFit::Resident
        } else if spare {
            AdapterFit::FreeSlot
        } else if waiting.contains(adapter) {
            AdapterFit::Waiting
        } else {
            AdapterFit::Full
        }
    }

    /// Its name, as `/debug/route` shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            AdapterFit::None => "none",
            AdapterFit::Running => "running",
            AdapterFit::Resident => "resident",
            AdapterFit::Queued => "queued",
            AdapterFit::FreeSlot => "free_slot",
            AdapterFit::Waiting => "waiting",
            AdapterFit::Full => "full",
        }
    }

    /// llm-d's `lora-affinity-scorer`: 1 running, 0.8 a slot to spare, 0.6 waiting, 0 full
    /// (and 0 with no adapter: the scorer then does not separate the candidates). llm-d does
    /// not know resident adapters: one scores as a free slot, as llm-d would see it.
    pub fn llm_d_score(self) -> f64 {
        match self {
            AdapterFit::Running => 1.0,
            AdapterFit::FreeSlot | AdapterFit::Resident | AdapterFit::Queued => 0.8,
            AdapterFit::Waiting => 0.6,
            AdapterFit::Full | AdapterFit::None => 0.0,
        }
    }

    /// Adapter loads the request is expected to cost there, in load times: none where it
    /// runs, is resident or is being loaded (queued); one where a slot is free; one where it waits (its wait for a slot); two where
    /// every slot is taken (the wait for a slot to free, then the load).
    pub fn expected_loads(self) -> f64 {
        match self {
            AdapterFit::None | AdapterFit::Running | AdapterFit::Resident | AdapterFit::Queued => {
                0.0
            }
            AdapterFit::FreeSlot | AdapterFit::Waiting => 1.0,
            AdapterFit::Full => 2.0,
        }
    }
}

/// The adapters a router sent to one engine, most recent first, at most `max_lora` of them:
/// what the engine most likely holds (it evicts the least recently used).
#[derive(Debug, Clone)]
pub struct RecentAdapters<T> {
    recent: VecDeque<T>,
}

impl<T> Default for RecentAdapters<T> {
    fn default() -> Self {
        Self {
            recent: VecDeque::new(),
        }
    }
}

impl<T: PartialEq> RecentAdapters<T> {
    /// A request of `adapter` was sent there; the engine has `max_lora` slots.
    pub fn routed(&mut self, adapter: T, max_lora: usize) {
        if let Some(i) = self.recent.iter().position(|a| *a == adapter) {
            self.recent.remove(i);
        }
        self.recent.push_front(adapter);
        self.recent.truncate(max_lora.max(1));
    }

    pub fn contains(&self, adapter: &T) -> bool {
        self.recent.contains(adapter)
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
        let fit = |a: u32, running: &[u32], waiting: &[u32]| {
            AdapterFit::of(&a, running, waiting, 2, false)
        };
        assert_eq!(fit(1, &[1, 2], &[3]), AdapterFit::Running);
        assert_eq!(fit(1, &[2], &[]), AdapterFit::FreeSlot);
        assert_eq!(fit(1, &[], &[1]), AdapterFit::Queued);
        assert_eq!(fit(1, &[2], &[1]), AdapterFit::Waiting);
        assert_eq!(fit(1, &[2, 3], &[]), AdapterFit::Full);
        let scores: Vec<f64> = [fit(1, &[1], &[]), fit(1, &[2], &[1]), fit(1, &[2, 3], &[])]
            .iter()
            .map(|f| f.llm_d_score())
            .collect();
        assert_eq!(scores, [1.0, 0.6, 0.0]);
    }

    #[test]
    fn an_adapter_listed_both_running_and_waiting_takes_one_slot() {
        // vLLM 0.32 lists each adapter that has requests in both labels.
        let fit =
            |a: u32, listed: &[u32], max_lora| AdapterFit::of(&a, listed, listed, max_lora, false);
        assert_eq!(fit(1, &[1], 1), AdapterFit::Running);
        assert_eq!(fit(2, &[1], 1), AdapterFit::Full);
        assert_eq!(fit(2, &[1], 2), AdapterFit::FreeSlot);
        assert_eq!(fit(3, &[1, 2], 3), AdapterFit::FreeSlot);
        assert_eq!(fit(3, &[1, 2], 2), AdapterFit::Full);
    }

    #[test]
    fn a_recently_sent_adapter_is_resident_while_its_slot_is_free() {
        let mut recent = RecentAdapters::default();
        for a in [1, 2, 3, 1] {
            recent.routed(a, 2);
        }
        // 1 then 3 most recent; 2 evicted.
        assert!(recent.contains(&1) && recent.contains(&3) && !recent.contains(&2));
        let fit = |running: &[u32], waiting: &[u32]| {
            AdapterFit::of(&1, running, waiting, 2, recent.contains(&1))
        };
        assert_eq!(fit(&[], &[]), AdapterFit::Resident);
        assert_eq!(fit(&[3], &[]), AdapterFit::Resident);
        assert_eq!(fit(&[3, 4], &[]), AdapterFit::Full);
        assert_eq!(fit(&[3], &[1]), AdapterFit::Waiting);
        assert_eq!(AdapterFit::Resident.expected_loads(), 0.0);
        assert_eq!(AdapterFit::Resident.llm_d_score(), 0.8);
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
