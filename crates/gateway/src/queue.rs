//! Queue backpressure: a request whose eligible ranks are all saturated with prefill waits
//! in the router, in its policy class, until capacity frees; it is scored only when it
//! leaves the queue, on fresh load and cache state.
//!
//! A rank is saturated when its active prefill tokens exceed `--router-queue-threshold` x its
//! engine's `max_num_batched_tokens` (from the worker's config, else vLLM's default 8192);
//! the test and the rule for waiting are `kvroute_core::queue`'s (`saturated`, `must_wait`).
//! Which class's head goes next is `kvroute_core::queue::DrrQueue`'s weighted deficit round
//! robin, in uncached tokens. Capacity is re-examined whenever a request produces its first
//! token or ends, and every 100 ms. A full class answers `queue_full`; a request waiting
//! longer than `--router-queue-timeout-secs` gets `queue_timeout`; a client that goes away
//! leaves the queue.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_core::eligibility::BusyThresholds;
use kvroute_core::queue::{must_wait, DrrQueue, PolicyClass, QueueError, QueueOrder, Ticket};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;

use crate::error::GatewayError;
use crate::workers::Worker;

pub use kvroute_core::queue::DEFAULT_BATCH_TOKENS;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabel {
    class: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// A waiting request: the ranks it may go to, and how to wake it.
struct Waiter {
    ranks: Vec<(Arc<Worker>, usize)>,
    wake: oneshot::Sender<()>,
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("ranks", &self.ranks.len())
            .finish()
    }
}

/// The router's admission queue.
#[derive(Debug)]
pub struct AdmissionQueue {
    threshold: f64,
    timeout: Duration,
    classes: Vec<PolicyClass>,
    class_thresholds: Vec<BusyThresholds>,
    default_class: usize,
    queue: Mutex<DrrQueue<Waiter>>,
    /// A request let go that has not started yet (its load is not counted): no other is
    /// let go until it has, so each decision sees the load of the previous one.
    in_transit: AtomicBool,
    pending: Vec<Gauge>,
    waited: Histogram,
    /// Requests refused by the queue because their class was full, or their wait too long.
    refused_full: Counter,
    refused_timeout: Counter,
}

/// Held by a request the queue let go, until its load is counted (or it failed); dropping
/// it lets the next one be considered.
#[derive(Debug)]
pub struct Released<'a> {
    queue: Option<&'a AdmissionQueue>,
}

impl Drop for Released<'_> {
    fn drop(&mut self) {
        if let Some(q) = self.queue {
            q.in_transit.store(false, Ordering::Release);
            q.dispatch();
        }
    }
}

/// Whether the rank is saturated with prefill at `threshold`.
fn saturated(worker: &Worker, rank: usize, threshold: f64) -> bool {
    let prefill = worker.ranks[rank].with_load(|l| l.prefill_tokens());
    kvroute_core::queue::saturated(prefill, worker.max_num_batched_tokens, threshold)
}

impl AdmissionQueue {
    pub fn new(
        threshold: f64,
        timeout: Duration,
        classes: Vec<PolicyClass>,
        class_thresholds: Vec<BusyThresholds>,
        order: QueueOrder,
        registry: &mut Registry,
    ) -> Result<Self, kvroute_core::queue::QueueConfigError> {
        let queue = DrrQueue::new(classes.clone(), order)?;
        let family = Family::<ClassLabel, Gauge>::default();
        registry.register(
            "kvroute_queue_pending",
            "Requests waiting in the router's queue, by policy class",
            family.clone(),
        );
        let waited = Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
            0.001, 2.0, 16,
        ));
        registry.register(
            "kvroute_queue_wait_seconds",
            "Time requests spent in the router's queue",
            waited.clone(),
        );
        let refused_family = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "kvroute_queue_refused",
            "Requests the router's queue refused: full (429) or timed out (503)",
            refused_family.clone(),
        );
        let [refused_full, refused_timeout] = ["full", "timeout"].map(|reason| {
            refused_family
                .get_or_create(&ReasonLabel { reason })
                .clone()
        });
        let pending = classes
            .iter()
            .map(|c| {
                family
                    .get_or_create(&ClassLabel {
                        class: c.name.clone(),
                    })
                    .clone()
            })
            .collect();
        let default_class = classes
            .iter()
            .position(|c| c.name == "default")
            .unwrap_or(0);
        Ok(Self {
            threshold,
            timeout,
            classes,
            class_thresholds,
            default_class,
            queue: Mutex::new(queue),
            in_transit: AtomicBool::new(false),
            pending,
            waited,
            refused_full,
            refused_timeout,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, DrrQueue<Waiter>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The class named by `x-kvroute-class`, else the default one.
    pub fn class_of(&self, name: Option<&str>) -> Result<usize, GatewayError> {
        match name {
            None => Ok(self.default_class),
            Some(n) => self
                .classes
                .iter()
                .position(|c| c.name == n)
                .ok_or_else(|| GatewayError::InvalidHint {
                    header: "x-kvroute-class",
                    reason: format!("no policy class '{n}'"),
                }),
        }
    }

    /// The busy thresholds of requests of `class`: the class's own fields over `model`'s.
    pub fn thresholds(&self, class: usize, model: BusyThresholds) -> BusyThresholds {
        let own = self
            .class_thresholds
            .get(class)
            .copied()
            .unwrap_or_default();
        BusyThresholds {
            active_prefill_tokens: own.active_prefill_tokens.or(model.active_prefill_tokens),
            active_prefill_tokens_frac: own
                .active_prefill_tokens_frac
                .or(model.active_prefill_tokens_frac),
            active_decode_blocks: own.active_decode_blocks.or(model.active_decode_blocks),
        }
    }

    /// Waits, if every one of `ranks` is saturated, until the queue lets the request go.
    /// Keep the returned token until the request's load is counted.
    pub async fn admit(
        &self,
        class: usize,
        ranks: Vec<(Arc<Worker>, usize)>,
        cost: u64,
    ) -> Result<Released<'_>, GatewayError> {
        let full = ranks.iter().all(|(w, r)| saturated(w, *r, self.threshold));
        if !must_wait(full, !self.is_empty()) && !self.in_transit.load(Ordering::Acquire) {
            return Ok(Released { queue: None });
        }
        let (wake, woken) = oneshot::channel();
        let ticket = {
            let mut q = self.lock();
            match q.push(class, Waiter { ranks, wake }, cost) {
                Ok(t) => t,
                Err(QueueError::Full { .. }) => {
                    self.refused_full.inc();
                    return Err(GatewayError::QueueFull(self.classes[class].name.clone()));
                }
                Err(QueueError::UnknownClass { .. }) => {
                    return Err(GatewayError::NoEndpoint("unknown policy class"))
                }
            }
        };
        self.pending[class].inc();
        let mut leave = Leave {
            queue: self,
            ticket: Some(ticket),
            class,
        };
        self.dispatch();
        let started = Instant::now();
        let outcome = tokio::time::timeout(self.timeout, woken).await;
        self.waited.observe(started.elapsed().as_secs_f64());
        match outcome {
            Ok(Ok(())) => {
                leave.ticket = None;
                Ok(Released { queue: Some(self) })
            }
            _ => {
                self.refused_timeout.inc();
                Err(GatewayError::QueueTimeout(self.timeout.as_secs()))
            }
        }
    }

    /// Lets go every head whose ranks have capacity now, class by class (weighted DRR).
    pub fn dispatch(&self) {
        let threshold = self.threshold;
        let mut q = self.lock();
        while let Some((class, waiter)) = q.pop(|_, w| {
            !w.ranks
                .iter()
                .all(|(worker, r)| saturated(worker, *r, threshold))
        }) {
            self.pending[class].dec();
            // A waiter whose client left is dropped here; nothing to wake.
            let _ = waiter.wake.send(());
        }
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Takes a request out of the queue if it leaves before being let go (timeout, client gone).
struct Leave<'a> {
    queue: &'a AdmissionQueue,
    ticket: Option<Ticket>,
    class: usize,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            if self.queue.lock().remove(ticket).is_some() {
                self.queue.pending[self.class].dec();
            }
        }
    }
}
