//! The waiting queue's order and preemption: FCFS, or vLLM's priority scheduling.
//!
//! **Priority scheduling** ([`SchedulingPolicy::Priority`], vLLM's `--scheduling-policy
//! priority`): the waiting queue is ordered by the request's priority
//! ([`EngineRequest::priority`](super::EngineRequest::priority)), then its arrival, lowest
//! first, a preempted sequence going back to its place in that order; the running batch keeps
//! its admission order, and the sequence preempted for blocks is the running one last in that
//! order (the lowest priority, then the latest arrival), whose tokens already scheduled in the
//! step are given back, as vLLM v1 does. Nothing running is preempted for a waiting request.

use super::{EngineCore, PromptSource, Sequence, StepOutput};

/// vLLM's `--scheduling-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SchedulingPolicy {
    /// First come, first served; a request's priority is ignored (as vLLM 0.32 does).
    #[default]
    Fcfs,
    /// By [`EngineRequest::priority`](super::EngineRequest::priority), lowest first, then by
    /// arrival.
    Priority,
}

impl EngineCore {
    /// Preempts `running[idx]`: its blocks are freed and it goes back to the queue, to be
    /// recomputed.
    pub(super) fn preempt(&mut self, idx: usize, out: &mut StepOutput) {
        let mut seq = self.running.remove(idx);
        self.pool.release(&seq.blocks);
        seq.blocks.clear();
        seq.computed = 0;
        seq.registered = 0;
        // Recomputed here, as vLLM does: the prefill engine's KV is gone.
        seq.prompt_kv = PromptSource::Compute;
        self.stats.preemptions += 1;
        out.preempted.push(seq.id);
        self.requeue(seq);
    }

    /// The running sequence to preempt for blocks: the newest, or under
    /// [`SchedulingPolicy::Priority`] the last by (priority, arrival).
    pub(super) fn victim(&self) -> usize {
        match self.config.policy {
            SchedulingPolicy::Fcfs => self.running.len() - 1,
            SchedulingPolicy::Priority => (0..self.running.len())
                .max_by_key(|&i| self.running[i].order())
                .expect("a sequence is running"),
        }
    }

    /// Queues a new sequence: last, or under [`SchedulingPolicy::Priority`] in its order.
    pub(super) fn enqueue(&mut self, seq: Sequence) {
        match self.config.policy {
            SchedulingPolicy::Fcfs => self.waiting.push_back(seq),
            SchedulingPolicy::Priority => self.insert_ordered(seq),
        }
    }

    /// Queues a sequence that was admitted before (preempted, or its KV landed): first, or
    /// under [`SchedulingPolicy::Priority`] in its order.
    pub(super) fn requeue(&mut self, seq: Sequence) {
        match self.config.policy {
            SchedulingPolicy::Fcfs => self.waiting.push_front(seq),
            SchedulingPolicy::Priority => self.insert_ordered(seq),
        }
    }

    fn insert_ordered(&mut self, seq: Sequence) {
        let at = self.waiting.partition_point(|s| s.order() < seq.order());
        self.waiting.insert(at, seq);
    }
}

/// Takes the preempted `running[victim]` out of the step's `scheduled` (indices into
/// `running`, which shift down past it): the tokens it had been given.
pub(super) fn unschedule(scheduled: &mut Vec<(usize, usize)>, victim: usize) -> usize {
    let mut given = 0;
    scheduled.retain(|&(idx, n)| {
        if idx == victim {
            given = n;
        }
        idx != victim
    });
    for entry in scheduled.iter_mut().filter(|e| e.0 > victim) {
        entry.0 -= 1;
    }
    given
}
