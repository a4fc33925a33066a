//! Queue backpressure: a request whose eligible ranks are all saturated with prefill waits
//! in the router, in its policy class, until capacity frees; it is scored only when it
//! leaves the queue, on fresh load and cache state.
//!
//! A rank is saturated when its active prefill tokens exceed `--router-queue-threshold` x its
//! engine's `max_num_batched_tokens` (from the worker's config, else vLLM's default 8192);
//! the test and the rule for waiting are `kvroute_core::queue`'s (`saturated`, `must_wait`).
//! With the priority scheduler on, a request sees the threshold less the shares its higher
//! classes reserve (smg's `reserved_floor` and `reserved_per_slot`, over 64 slots per rank:
//! `kvroute_core::queue::reserve`), so a lower class leaves room that a higher one takes at once.
//! Which head goes next is `kvroute_core::queue::DrrQueue`'s: the highest priority tier
//! first (smg's classes, [`standing`]), then weighted deficit round robin over policy
//! classes, in uncached tokens, then the tenant with the lowest virtual token counter (VTC,
//! `--router-queue-fairness`), then arrival (less any head start). A request that does not
//! wait is charged its uncached tokens as one let go is; output tokens are charged through
//! [`AdmissionQueue::charge_output`]. With `can_preempt`, an arrival that must wait may
//! cancel a lower-class request that has not produced its first byte ([`Preemptible`]).
//! Capacity is re-examined whenever a request produces its first
//! token or ends, and every 100 ms. A full class answers `queue_full`; a request waiting
//! longer than `--router-queue-timeout-secs` gets `queue_timeout`; a client that goes away
//! leaves the queue.
//!
//! Requests leave the queue one at a time (as Dynamo's router queue lets them go): the one
//! let go is *in transit* until it is routed and its prefill tokens are counted on its rank
//! ([`Released`] is dropped), and only then is the next head considered, against that load.
//! Letting go every head the load allows at one instant would route the whole backlog on the
//! same stale load, onto the one rank that just freed. Every end of a transit (counted,
//! failed before routing, its client gone or its wait over on the instant it was let go)
//! clears it and re-examines the queue, so the queue never stalls behind a lost request.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_core::eligibility::BusyThresholds;
use kvroute_core::queue::{
    must_wait, reserve, Arrival, DrrQueue, Fairness, PolicyClass, QueueError, Sharing, Ticket,
    VtcConfig,
};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;

use crate::config::{PrioritySettings, QueueSettings, QueueSharing, TenantOrder};
use crate::error::GatewayError;
use crate::workers::Worker;
use kvroute_protocol::WorkerId;

mod preempt;
mod priority;
pub use kvroute_core::queue::DEFAULT_BATCH_TOKENS;
pub use preempt::Preemptible;
pub use priority::{standing, Standing, PRIORITY_HEADER};

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

/// A request asking the queue for its turn.
#[derive(Debug, Clone, Copy)]
pub struct Queued<'a> {
    /// Its policy class ([`AdmissionQueue::class_of`]).
    pub class: usize,
    /// Its priority class and head start ([`standing`]).
    pub standing: Standing,
    /// Its tenant's key.
    pub tenant: &'a str,
    /// Its uncached prompt tokens: the DRR cost, and its VTC charge at dispatch.
    pub cost: u64,
}

/// The core queue's tiers and fairness: smg's four classes (with their starvation thresholds
/// when the priority scheduler is on), tenants by VTC or ignored.
fn core_sharing(sharing: &QueueSharing) -> Sharing {
    let fairness = match sharing.fairness {
        TenantOrder::Fcfs => Fairness::Off,
        TenantOrder::Vtc => Fairness::Vtc(VtcConfig {
            tenant_weights: sharing.weights.clone(),
            ..VtcConfig::default()
        }),
    };
    let starvation = match &sharing.priority {
        Some(p) => p.classes.map(|c| Some(c.starvation_threshold)),
        None => [None; 4],
    };
    Sharing::smg(starvation, fairness)
}

/// The router's admission queue.
#[derive(Debug)]
pub struct AdmissionQueue {
    threshold: f64,
    timeout: Duration,
    priority: Option<PrioritySettings>,
    preemption: preempt::Preemption,
    classes: Vec<PolicyClass>,
    class_thresholds: Vec<BusyThresholds>,
    default_class: usize,
    queue: Mutex<DrrQueue<Waiter>>,
    /// The queue's clock starts here (`DrrQueue` takes time as a `Duration` since it).
    epoch: Instant,
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
            q.end_transit();
        }
    }
}

/// Whether the rank is saturated with prefill at `threshold`.
fn saturated(worker: &Worker, rank: usize, threshold: f64) -> bool {
    let prefill = worker.ranks[rank].with_load(|l| l.prefill_tokens());
    kvroute_core::queue::saturated(prefill, worker.max_num_batched_tokens, threshold)
}

/// Whether every one of `ranks` is saturated for a request of priority `tier`: at the
/// queue's threshold, less what the tiers above it reserve (`kvroute_core::queue::reserve`,
/// smg's 64 slots for each rank the request may use).
fn all_saturated(
    ranks: &[(Arc<Worker>, usize)],
    threshold: f64,
    priority: Option<&PrioritySettings>,
    tier: usize,
) -> bool {
    let threshold = match priority {
        Some(p) => {
            let capacity = reserve::SLOTS_PER_RANK.saturating_mul(ranks.len() as u32);
            let floor = p.classes.map(|c| c.reserved_floor);
            let per_slot = p.classes.map(|c| c.reserved_per_slot);
            let shares = reserve::reserved_shares(&floor, &per_slot, capacity);
            threshold * reserve::usable_fraction(&shares, tier)
        }
        None => threshold,
    };
    ranks.iter().all(|(w, r)| saturated(w, *r, threshold))
}

impl AdmissionQueue {
    pub fn new(
        settings: &QueueSettings,
        registry: &mut Registry,
    ) -> Result<Self, kvroute_core::queue::QueueConfigError> {
        let classes = settings.classes.clone();
        let sharing = core_sharing(&settings.sharing);
        let queue = DrrQueue::with_sharing(classes.clone(), settings.order, sharing)?;
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
            threshold: settings.threshold,
            timeout: settings.timeout,
            priority: settings.sharing.priority.clone(),
            preemption: preempt::Preemption::register(registry),
            classes,
            class_thresholds: settings.class_thresholds.clone(),
            default_class,
            queue: Mutex::new(queue),
            epoch: Instant::now(),
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

    /// The priority scheduler's settings, when it is on.
    pub fn priority(&self) -> Option<&PrioritySettings> {
        self.priority.as_ref()
    }

    /// With the priority scheduler on, records a request of `class` the queue let go (or
    /// that did not wait): it may be preempted until the returned guard drops.
    /// `workers`: those it was eligible for.
    pub fn preemptible(
        &self,
        class: crate::config::PriorityClass,
        workers: Vec<WorkerId>,
    ) -> Option<Preemptible<'_>> {
        self.priority
            .as_ref()
            .map(|_| self.preemption.enter(class, workers))
    }

    /// Reports `tokens` output tokens served to `tenant` in `class` (VTC's output charge).
    pub fn charge_output(&self, class: usize, tenant: &str, tokens: u64) {
        self.lock().charge(class, tenant, tokens);
    }

    /// Waits, if every one of `ranks` is saturated, until the queue lets the request go.
    /// Keep the returned token until the request's load is counted. A request that does not
    /// wait is charged its cost at once, as the queue charges one it lets go. One whose
    /// tenant is `below_share` of the work in flight, with `--engine-priority`, never waits:
    /// its engine puts it first in its own queue.
    pub async fn admit(
        &self,
        req: Queued<'_>,
        ranks: Vec<(Arc<Worker>, usize)>,
        below_share: bool,
    ) -> Result<Released<'_>, GatewayError> {
        let Queued { class, cost, .. } = req;
        let tier = req.standing.class.tier();
        let full = all_saturated(&ranks, self.threshold, self.priority.as_ref(), tier);
        let free = !must_wait(full, !self.is_empty()) && !self.in_transit.load(Ordering::Acquire);
        if free || below_share {
            self.lock().charge_prompt(class, req.tenant, cost);
            return Ok(Released { queue: None });
        }
        let class_of = req.standing.class;
        // Only when its engines are full: a request that waits behind others while an engine
        // has room frees nothing by preempting.
        let preempt =
            full && (self.priority.as_ref()).is_some_and(|p| p.class(class_of).can_preempt);
        let workers: Vec<WorkerId> = match preempt {
            true => ranks.iter().map(|(w, _)| w.id.clone()).collect(),
            false => Vec::new(),
        };
        let (wake, woken) = oneshot::channel();
        let ticket = self.push(&req, Waiter { ranks, wake })?;
        if preempt {
            self.preemption.preempt_for(class_of, &workers);
        }
        self.pending[class].inc();
        let mut waiting = Waiting {
            queue: self,
            ticket: Some(ticket),
            class,
            woken,
        };
        self.dispatch();
        let timeout = match &self.priority {
            Some(p) => p.class(req.standing.class).queue_timeout,
            None => self.timeout,
        };
        let started = Instant::now();
        let outcome = tokio::time::timeout(timeout, &mut waiting.woken).await;
        self.waited.observe(started.elapsed().as_secs_f64());
        match outcome {
            Ok(Ok(())) => {
                waiting.ticket = None;
                Ok(Released { queue: Some(self) })
            }
            _ => {
                self.refused_timeout.inc();
                Err(GatewayError::QueueTimeout(timeout.as_secs()))
            }
        }
    }

    /// Puts `req` in the queue, in its tier; refused when its policy class is full, or its
    /// priority class holds its `queue_size` already.
    fn push(&self, req: &Queued<'_>, waiter: Waiter) -> Result<Ticket, GatewayError> {
        let tier = req.standing.class.tier();
        let mut q = self.lock();
        if let Some(p) = &self.priority {
            let held: usize = (0..self.classes.len()).map(|c| q.lane_len(tier, c)).sum();
            if held >= p.class(req.standing.class).queue_size as usize {
                self.refused_full.inc();
                return Err(GatewayError::QueueFull(
                    req.standing.class.as_str().to_owned(),
                ));
            }
        }
        let arrival = Arrival {
            class: req.class,
            tier,
            tenant: req.tenant,
            cost: req.cost,
            now: self.epoch.elapsed(),
            head_start: req.standing.head_start,
        };
        match q.push_with(&arrival, waiter) {
            Ok(t) => Ok(t),
            Err(QueueError::Full { .. }) => {
                self.refused_full.inc();
                Err(GatewayError::QueueFull(
                    self.classes[req.class].name.clone(),
                ))
            }
            Err(QueueError::UnknownClass { .. } | QueueError::UnknownTier { .. }) => {
                Err(GatewayError::NoEndpoint("unknown policy class"))
            }
        }
    }

    /// Lets go the next head (weighted DRR) whose ranks have capacity now, unless one let go
    /// is still in transit: its load is not counted yet, so the load read now is stale.
    pub fn dispatch(&self) {
        let (threshold, priority) = (self.threshold, self.priority.as_ref());
        let mut q = self.lock();
        // Set and tested under the queue's lock: two dispatches cannot both let one go.
        if self.in_transit.load(Ordering::Acquire) {
            return;
        }
        let now = self.epoch.elapsed();
        while let Some((class, waiter)) = q.pop_tiered_at(now, |tier, _, w| {
            !all_saturated(&w.ranks, threshold, priority, tier)
        }) {
            self.pending[class].dec();
            if waiter.wake.send(()).is_ok() {
                self.in_transit.store(true, Ordering::Release);
                return;
            }
            // Nobody to wake (a waiter leaves the queue before its receiver drops, so this
            // does not happen); the next head may go instead.
        }
    }

    /// The request in transit is counted, or will never be: the next may be considered.
    fn end_transit(&self) {
        self.in_transit.store(false, Ordering::Release);
        self.dispatch();
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A request in the queue, until it is let go and takes that up. Dropped before then (timeout,
/// client gone), it leaves the queue; let go on the instant it was dropped, it ends its
/// transit, which nobody else would.
struct Waiting<'a> {
    queue: &'a AdmissionQueue,
    /// `None` once the request took up its release (then [`Released`] ends the transit).
    ticket: Option<Ticket>,
    class: usize,
    woken: oneshot::Receiver<()>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        // The receiver lives until this returns, so a dispatch that pops this request
        // (before the lock below) also wakes it and puts it in transit.
        if self.queue.lock().remove(ticket).is_some() {
            self.queue.pending[self.class].dec();
        } else if self.woken.try_recv().is_ok() {
            self.queue.end_transit();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::Pin;

    use futures_util::FutureExt;
    use kvroute_core::RequestLoad;

    use super::*;
    use crate::config::{Settings, WorkerSpec};
    use crate::metrics::GatewayMetrics;
    use crate::workers::WorkerSet;

    /// A queue at threshold 1 before one worker of 1,000 tokens a step, saturated by a
    /// request of 1,500 prefill tokens.
    fn saturated_queue() -> (AdmissionQueue, Arc<Worker>) {
        let mut registry = Registry::default();
        let spec = WorkerSpec {
            max_num_batched_tokens: Some(1000),
            ..WorkerSpec::url("http://127.0.0.1:1")
        };
        let settings = Settings::with_workers(vec![spec]).unwrap();
        let metrics = GatewayMetrics::register(&mut registry);
        let worker = WorkerSet::new(&settings, &metrics).workers()[0].clone();
        let default = PolicyClass {
            name: "default".into(),
            weight: 1,
            max_queued: None,
        };
        let settings = QueueSettings {
            threshold: 1.0,
            order: kvroute_core::queue::QueueOrder::Fcfs,
            timeout: Duration::from_secs(60),
            classes: vec![default],
            class_thresholds: vec![BusyThresholds::default()],
            sharing: QueueSharing::default(),
        };
        let queue = AdmissionQueue::new(&settings, &mut registry).unwrap();
        worker.ranks[0].start(&load(1500));
        (queue, worker)
    }

    fn request() -> Queued<'static> {
        Queued {
            class: 0,
            standing: Standing::default(),
            tenant: "",
            cost: 400,
        }
    }

    fn load(prefill_tokens: u64) -> RequestLoad {
        RequestLoad {
            prefill_tokens,
            blocks: Vec::new(),
            own_blocks: 0,
            output: None,
        }
    }

    type Admit<'a> = Pin<Box<dyn Future<Output = Result<Released<'a>, GatewayError>> + 'a>>;

    /// `n` requests that find the worker saturated and wait.
    fn queue_up<'a>(q: &'a AdmissionQueue, w: &Arc<Worker>, n: usize) -> Vec<Admit<'a>> {
        let mut waiting: Vec<Admit<'a>> = (0..n)
            .map(|_| Box::pin(q.admit(request(), vec![(w.clone(), 0)], false)) as Admit<'a>)
            .collect();
        for admit in &mut waiting {
            assert!(admit.as_mut().now_or_never().is_none(), "it waits");
        }
        assert_eq!(q.len(), n);
        waiting
    }

    /// Whether `admit` was let go (polls it once).
    fn let_go<'a>(admit: &mut Admit<'a>) -> Option<Released<'a>> {
        admit.as_mut().now_or_never().map(|r| r.expect("let go"))
    }

    #[tokio::test(start_paused = true)]
    async fn requests_leave_one_at_a_time_each_on_the_load_of_the_last() {
        let (q, w) = saturated_queue();
        let mut waiting = queue_up(&q, &w, 4);
        // The worker frees up: one request is let go, not the whole backlog.
        w.ranks[0].finish(&load(1500), true);
        q.dispatch();
        let first = let_go(&mut waiting[0]).expect("the head goes");
        assert!(
            let_go(&mut waiting[1]).is_none(),
            "not before the first is counted"
        );
        assert_eq!(q.len(), 3);
        // Each routed request's 400 tokens are counted before the next is considered: 400,
        // then 800, keep the worker under 1,000; 1,200 saturates it.
        w.ranks[0].start(&load(400));
        drop(first);
        let second = let_go(&mut waiting[1]).expect("400 < 1,000");
        w.ranks[0].start(&load(400));
        drop(second);
        let third = let_go(&mut waiting[2]).expect("800 < 1,000");
        w.ranks[0].start(&load(400));
        drop(third);
        assert!(let_go(&mut waiting[3]).is_none(), "1,200 > 1,000: it waits");
        assert_eq!(q.len(), 1);
        // Capacity frees again: the last one goes.
        w.ranks[0].finish(&load(400), true);
        q.dispatch();
        assert!(let_go(&mut waiting[3]).is_some());
        assert!(q.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_let_go_that_fails_to_route_does_not_stall_the_queue() {
        let (q, w) = saturated_queue();
        let mut waiting = queue_up(&q, &w, 2);
        w.ranks[0].finish(&load(1500), true);
        q.dispatch();
        let first = let_go(&mut waiting[0]).expect("the head goes");
        assert!(let_go(&mut waiting[1]).is_none());
        // Routing fails (or its client leaves) before its load is counted.
        drop(first);
        assert!(let_go(&mut waiting[1]).is_some(), "the next one goes");
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_whose_client_left_as_it_was_let_go_does_not_stall_the_queue() {
        let (q, w) = saturated_queue();
        let mut waiting = queue_up(&q, &w, 2);
        w.ranks[0].finish(&load(1500), true);
        q.dispatch();
        // Let go, but its client leaves before the request takes that up.
        drop(waiting.remove(0));
        assert!(let_go(&mut waiting[0]).is_some(), "the next one goes");
        assert!(q.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_times_out_leaves_the_queue_without_stalling_it() {
        let (q, w) = saturated_queue();
        let mut waiting = queue_up(&q, &w, 2);
        tokio::time::advance(Duration::from_secs(61)).await;
        let timed_out = waiting[0]
            .as_mut()
            .now_or_never()
            .expect("its wait is over");
        assert!(matches!(timed_out, Err(GatewayError::QueueTimeout(60))));
        drop(waiting.remove(0));
        // The other one's wait is over too; a new one arrives when the worker is free.
        drop(waiting.remove(0));
        assert!(q.is_empty());
        w.ranks[0].finish(&load(1500), true);
        let mut next: Admit<'_> = Box::pin(q.admit(request(), vec![(w.clone(), 0)], false));
        assert!(let_go(&mut next).is_some(), "nothing is in transit");
    }
}
