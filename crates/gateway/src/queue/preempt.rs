//! smg's preemption, in the router queue: a request of a class with `can_preempt` that must
//! wait cancels one request of a lower class that was let go but has not produced its first
//! byte, so that capacity frees for it.
//!
//! The victim is, as in smg, one of the lowest class below the arrival's, the one let go
//! last among those (the least work lost); kvroute adds that it must share an eligible
//! worker with the arrival, so that what it frees can serve the arrival. Its cancellation drops its upstream request (the
//! engine aborts it when the connection goes) and answers it 503 `scheduler_preempted` with
//! `Retry-After: 1` and `X-SMG-Preempted: true`. One arrival preempts at most one request.
//!
//! A request is preemptible from the moment the queue lets it go until its response head
//! comes back from its engine, or for an answer the router reads whole (non-streaming
//! inference), until that answer is read: the client has had nothing of it yet.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use kvroute_protocol::WorkerId;

use crate::config::PriorityClass;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabel {
    class: &'static str,
}

#[derive(Debug)]
struct Candidate {
    id: u64,
    class: PriorityClass,
    /// The workers it was eligible for.
    workers: Vec<WorkerId>,
    cancel: CancellationToken,
}

/// The requests that may be preempted, and the count of those that were.
#[derive(Debug)]
pub(super) struct Preemption {
    candidates: Mutex<Vec<Candidate>>,
    next: AtomicU64,
    preempted: Family<ClassLabel, Counter>,
}

impl Preemption {
    pub(super) fn register(registry: &mut Registry) -> Preemption {
        let preempted = Family::<ClassLabel, Counter>::default();
        registry.register(
            "kvroute_preemptions",
            "Requests preempted before their first byte for a higher priority class, by the preempted request's class",
            preempted.clone(),
        );
        Preemption {
            candidates: Mutex::new(Vec::new()),
            next: AtomicU64::new(0),
            preempted,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Candidate>> {
        self.candidates.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a request of `class` let go: preemptible until the guard drops.
    pub(super) fn enter(&self, class: PriorityClass, workers: Vec<WorkerId>) -> Preemptible<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let cancel = CancellationToken::new();
        self.lock().push(Candidate {
            id,
            class,
            workers,
            cancel: cancel.clone(),
        });
        Preemptible {
            preemption: self,
            id,
            cancel,
        }
    }

    /// Cancels the request a `class` arrival eligible for `workers` may preempt, if any: of
    /// the lowest class below `class` among those sharing a worker with it, the one let go
    /// last. Whether one was.
    pub(super) fn preempt_for(&self, class: PriorityClass, workers: &[WorkerId]) -> bool {
        let victim = {
            let mut candidates = self.lock();
            let usable =
                |c: &Candidate| c.class < class && c.workers.iter().any(|w| workers.contains(w));
            // Let go in id order: among the lowest class, the last such is the newest.
            let lowest = candidates
                .iter()
                .filter(|c| usable(c))
                .map(|c| c.class)
                .min();
            let Some(lowest) = lowest else {
                return false;
            };
            let at = candidates
                .iter()
                .rposition(|c| c.class == lowest && usable(c))
                .expect("a candidate of the lowest class");
            candidates.remove(at)
        };
        tracing::info!(
            victim = victim.class.as_str(),
            preemptor = class.as_str(),
            "Preempting a request before its first byte"
        );
        self.preempted
            .get_or_create(&ClassLabel {
                class: victim.class.as_str(),
            })
            .inc();
        victim.cancel.cancel();
        true
    }
}

/// A request that may be preempted, until dropped (its first byte came, or it ended).
#[derive(Debug)]
pub struct Preemptible<'a> {
    preemption: &'a Preemption,
    id: u64,
    cancel: CancellationToken,
}

impl Preemptible<'_> {
    /// Resolves when the request is preempted.
    pub async fn preempted(&self) {
        self.cancel.cancelled().await;
    }
}

impl Drop for Preemptible<'_> {
    fn drop(&mut self) {
        let id = self.id;
        self.preemption.lock().retain(|c| c.id != id);
    }
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;

    fn w(id: &str) -> Vec<WorkerId> {
        vec![WorkerId::new(id)]
    }

    #[test]
    fn a_victim_shares_a_worker_with_the_arrival() {
        let p = Preemption::register(&mut Registry::default());
        let elsewhere = p.enter(PriorityClass::Bulk, w("b"));
        assert!(!p.preempt_for(PriorityClass::System, &w("a")));
        assert!(elsewhere.preempted().now_or_never().is_none());
        let both = [WorkerId::new("a"), WorkerId::new("b")];
        assert!(p.preempt_for(PriorityClass::System, &both));
        assert!(elsewhere.preempted().now_or_never().is_some());
    }

    #[test]
    fn the_victim_is_of_the_lowest_class_below_and_let_go_last() {
        let p = Preemption::register(&mut Registry::default());
        let bulk_old = p.enter(PriorityClass::Bulk, w("a"));
        let default = p.enter(PriorityClass::Default, w("a"));
        let bulk_new = p.enter(PriorityClass::Bulk, w("a"));
        let interactive = p.enter(PriorityClass::Interactive, w("a"));
        assert!(
            !p.preempt_for(PriorityClass::Bulk, &w("a")),
            "nothing is below bulk"
        );
        assert!(p.preempt_for(PriorityClass::Interactive, &w("a")));
        assert!(bulk_new.preempted().now_or_never().is_some());
        assert!(bulk_old.preempted().now_or_never().is_none());
        assert!(p.preempt_for(PriorityClass::Interactive, &w("a")));
        assert!(bulk_old.preempted().now_or_never().is_some());
        assert!(p.preempt_for(PriorityClass::System, &w("a")));
        assert!(default.preempted().now_or_never().is_some());
        drop(interactive);
        assert!(
            !p.preempt_for(PriorityClass::System, &w("a")),
            "the interactive one has left"
        );
    }
}
