//! The router's admission queue: priority tiers, weighted deficit round robin (DRR) over
//! policy classes within a tier, and virtual token counters (VTC) between tenants within a
//! class.
//!
//! Requests that cannot be placed yet wait here, each with its [`PolicyClass`], its priority
//! tier and its tenant (an [`Arrival`]). When capacity frees, the caller asks
//! [`DrrQueue::pop_at`] which request goes next; `pop_at` calls the caller's
//! `can_dispatch(class, head)` to learn whether a head has capacity on its eligible workers.
//! The queue is pure and synchronous: no clock (the caller passes `now`, a [`Duration`] since
//! an epoch of its choosing; timeouts are the caller's, who [`remove`](DrrQueue::remove)s the
//! ticket), no I/O, no choice of worker.
//!
//! # Which tier goes next
//! Tiers are numbered from 0, the highest ([`Sharing::smg`]: `system` 0, `interactive` 1,
//! `default` 2, `bulk` 3). A pop serves the highest tier that has a *ready* head (one
//! `can_dispatch` allows); a lower tier goes only when every higher tier is empty or blocked,
//! so tiers order the queue and never leave capacity unused (work-conserving).
//! `can_dispatch` is asked about a lane's head only, as before tiers and tenants: a blocked
//! head blocks its lane (head-of-line, as under FCFS), never the other lanes.
//!
//! **Starvation.** A tier may have a threshold `s`. At `pop_at(now)`, every request of that
//! tier pushed at `t` with `now - t > s` (strictly) is *promoted*: it moves, for good, into
//! tier 0 in its class, keeping its tenant and its place in the order (its key), and competes
//! there as any tier-0 request. Push times are made non-decreasing (a push earlier than the
//! previous one counts at the previous one's time).
//!
//! # Which tenant goes next within a class
//! With [`Fairness::Vtc`], the head of a (tier, class) lane is the first request of the tenant
//! with the lowest virtual token counter among the tenants with requests in that lane, the
//! earlier arrival (of those tenants' first requests) among equal counters. The counters, the
//! lift of a new or returning tenant to the class's virtual time and the weights are [`vtc`]'s.
//! They belong to the class, shared by its tiers. [`Fairness::Off`] (the default) puts every
//! request under one tenant: the order is exactly the one below.
//!
//! # Order within a tenant
//! [`QueueOrder::Fcfs`]: arrival order. [`QueueOrder::Wspt`]: fewest cost first, arrival as
//! the tie-break. A request may carry a head start ([`Arrival::head_start`], Dynamo's
//! `agent_hints.priority` in seconds): under FCFS it counts as having arrived that much
//! earlier, under WSPT its cost counts `1 + seconds` times less. A request's cost is its
//! uncached tokens as given at push, a snapshot that never changes while it waits.
//!
//! # Which class goes next within a tier
//! Each tier runs its own DRR, with its own deficits and turn. The classes are visited in a fixed circular order. A visit to class `i` that is *ready*
//! (non-empty, and `can_dispatch` true for its head) credits one quantum, its weight `w_i`, to
//! its deficit `d_i`; the class then keeps the turn, dispatching heads and subtracting each
//! head's cost from `d_i`, while `d_i` covers its next head and that head may dispatch. A
//! class that is not ready is skipped and earns nothing in that round.
//!
//! Bulk credit: instead of looping over rounds in which nobody can dispatch, `pop` computes
//! for each ready class, with head cost `c_i`, the visits it needs,
//! `r_i = max(1, ceil((c_i - d_i) / w_i))`, and the position of its `r_i`-th visit,
//! `s_i = (r_i - 1) * n + p_i` (`n` classes, `p_i` its position after the class that had the
//! turn). The class with the smallest `s_i` wins; every ready class `j` is credited the visits
//! it gets up to that point, `floor((s - p_j) / n) + 1` quanta when `p_j <= s`, exactly as if
//! the rounds had been looped. An oversized head therefore waits the rounds it needs and is
//! never skipped forever.
//!
//! # Invariants
//! - An empty (tier, class) lane has deficit zero (reset when its last item is dispatched,
//!   removed or promoted).
//! - Deficit is earned only by ready classes, one quantum per visit; a blocked class keeps what
//!   it has and earns nothing, so it does not come back with accumulated credit.
//! - A visit credits the fewest quanta (at least one) that cover the head, so after crediting
//!   `d_i < max(d_i before, c_i) + w_i`.
//! - A `pop` that returns `None` (queue empty, or every non-empty class blocked) changes no
//!   DRR state and no counter; only the promotions that `now` calls for take place.
//!   `can_dispatch` is called at most once per (tier, class) per `pop`, only on a head.
//! - Each pushed item leaves exactly once: by `pop` or by `remove` with its ticket (a
//!   promoted item's ticket still finds it).
//! - A tier's ready head goes before any lower tier's; a blocked tier never holds back a lower
//!   one.
//! - A tenant's counter only grows; a class's virtual time never decreases.
//!
//! Over a long run with every class of a tier backlogged, class `i`'s share of dispatched
//! cost tends to `w_i / sum(w)`: the error is bounded by one head plus one quantum per class.
//!
//! When a request waits at all (its ranks saturated with prefill) is [`saturation`]'s.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

mod config;
mod drr;
pub mod engine_priority;
mod lane;
pub mod reserve;
mod saturation;
pub mod vtc;
pub use saturation::{must_wait, saturated, valid_threshold, DEFAULT_BATCH_TOKENS};

use config::validate;
pub use config::{Fairness, PriorityTier, Sharing, VtcConfig};
use drr::Level;
use lane::Entry;
use vtc::Counters;

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_sharing;

/// A policy class: a named lane of the queue with its DRR weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyClass {
    /// The name clients ask for (e.g. through `x-kvroute-class`).
    pub name: String,
    /// The DRR quantum, in uncached tokens, earned per round; must be positive.
    pub weight: u64,
    /// The most requests the class may hold (all tiers together); `None` for no bound.
    pub max_queued: Option<usize>,
}

/// The order of requests within one tenant of one class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueOrder {
    /// First come, first served: arrival order.
    #[default]
    Fcfs,
    /// Weighted shortest processing time: fewest cost first, arrival order among equals.
    Wspt,
}

/// An invalid queue configuration, found by [`DrrQueue::new`] or [`DrrQueue::with_sharing`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QueueConfigError {
    /// The queue needs at least one class.
    #[error("the queue needs at least one policy class")]
    NoClasses,
    /// A class's weight (its quantum) is zero.
    #[error("policy class '{class}' has weight 0; weights must be positive")]
    ZeroWeight { class: String },
    /// Two classes share a name.
    #[error("policy class '{class}' is defined more than once")]
    DuplicateClass { class: String },
    /// The queue needs at least one priority tier.
    #[error("the queue needs at least one priority tier")]
    NoTiers,
    /// Two tiers share a name.
    #[error("priority tier '{tier}' is defined more than once")]
    DuplicateTier { tier: String },
    /// A VTC weight that is not a positive finite number.
    #[error("{what} must be a positive number, got {value}")]
    BadWeight { what: String, value: f64 },
}

/// A request the queue refused at push.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    /// The class already holds its `max_queued` requests.
    #[error("policy class {class} is full")]
    Full { class: usize },
    /// No class has this index.
    #[error("no policy class has index {class}")]
    UnknownClass { class: usize },
    /// No tier has this index.
    #[error("no priority tier has index {tier}")]
    UnknownTier { tier: usize },
}

/// Where and when a request enters the queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival<'a> {
    pub class: usize,
    pub tier: usize,
    /// The tenant's key (smg's canonical `auth:<id>`, `header:<id>`, `ip:<addr>`, ...).
    pub tenant: &'a str,
    /// Uncached prompt tokens: the DRR cost and the VTC charge at dispatch.
    pub cost: u64,
    /// The caller's clock.
    pub now: Duration,
    /// Within its tenant, the request counts as having arrived this much earlier (Dynamo's
    /// `agent_hints.priority`); under WSPT its cost counts `1 + seconds` times less.
    pub head_start: Duration,
}

/// A handle on one queued request, for [`DrrQueue::remove`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    tier: usize,
    class: usize,
    key: Key,
}

impl Ticket {
    /// The class the request waits in.
    pub fn class(&self) -> usize {
        self.class
    }

    /// The tier it was pushed in (it may have been promoted since).
    pub fn tier(&self) -> usize {
        self.tier
    }
}

/// The order key within a tenant: `(rank, arrival)`, rank being the cost under WSPT and the
/// virtual arrival time under FCFS (see [`rank`]); arrival numbers are unique within a queue.
type Key = (u64, u64);

/// The queue; see the module docs for the algorithm.
#[derive(Debug)]
pub struct DrrQueue<T> {
    classes: Vec<PolicyClass>,
    sharing: Sharing,
    order: QueueOrder,
    /// One DRR per tier.
    levels: Vec<Level<T>>,
    /// One set of counters per class.
    counters: Vec<Counters>,
    /// Per tier with a starvation threshold: its pushes in time order (some may have left).
    pushed: Vec<VecDeque<(Duration, usize, Key)>>,
    class_len: Vec<usize>,
    next_arrival: u64,
    len: usize,
    /// The latest time seen at a push or pop.
    latest: Duration,
    scratch: Vec<Option<u64>>,
    /// The single tenant of [`Fairness::Off`].
    anyone: Arc<str>,
}

impl<T> DrrQueue<T> {
    /// A queue over `classes` (indexed in the given order), ordered within a class by
    /// `order`, with one tier and no fairness between tenants ([`Sharing::default`]).
    pub fn new(classes: Vec<PolicyClass>, order: QueueOrder) -> Result<Self, QueueConfigError> {
        Self::with_sharing(classes, order, Sharing::default())
    }

    /// A queue over `classes` with `sharing`'s tiers and fairness.
    pub fn with_sharing(
        classes: Vec<PolicyClass>,
        order: QueueOrder,
        sharing: Sharing,
    ) -> Result<Self, QueueConfigError> {
        validate(&classes, &sharing)?;
        let n = classes.len();
        Ok(Self {
            levels: sharing.tiers.iter().map(|_| Level::new(n)).collect(),
            counters: (0..n).map(|_| Counters::default()).collect(),
            pushed: sharing.tiers.iter().map(|_| VecDeque::new()).collect(),
            class_len: vec![0; n],
            scratch: vec![None; n],
            classes,
            sharing,
            order,
            next_arrival: 0,
            len: 0,
            latest: Duration::ZERO,
            anyone: Arc::from(""),
        })
    }

    /// The classes, by index.
    pub fn classes(&self) -> &[PolicyClass] {
        &self.classes
    }

    /// The index of the class called `name`.
    pub fn class_index(&self, name: &str) -> Option<usize> {
        self.classes.iter().position(|c| c.name == name)
    }

    /// The tiers, by index (0 the highest).
    pub fn tiers(&self) -> &[PriorityTier] {
        &self.sharing.tiers
    }

    /// The index of the tier called `name`.
    pub fn tier_index(&self, name: &str) -> Option<usize> {
        self.sharing.tiers.iter().position(|t| t.name == name)
    }

    /// The tier [`push`](Self::push) uses: the one called `default`, else the lowest.
    pub fn default_tier(&self) -> usize {
        self.tier_index("default")
            .unwrap_or(self.sharing.tiers.len() - 1)
    }

    /// The order within a tenant.
    pub fn order(&self) -> QueueOrder {
        self.order
    }

    /// Requests waiting, all classes and tiers together.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no request waits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Requests waiting in `class`, all tiers; zero for an unknown class.
    pub fn class_len(&self, class: usize) -> usize {
        self.class_len.get(class).copied().unwrap_or(0)
    }

    /// Requests waiting in `class` in `tier` (promoted ones count in tier 0).
    pub fn lane_len(&self, tier: usize, class: usize) -> usize {
        self.lane(tier, class).map_or(0, lane::Lane::len)
    }

    /// The DRR deficit of `class` in the default tier, in cost units.
    pub fn deficit(&self, class: usize) -> u64 {
        self.tier_deficit(self.default_tier(), class)
    }

    /// The DRR deficit of `class` in `tier`; zero for an unknown one.
    pub fn tier_deficit(&self, tier: usize, class: usize) -> u64 {
        self.lane(tier, class).map_or(0, |l| l.deficit)
    }

    fn lane(&self, tier: usize, class: usize) -> Option<&lane::Lane<T>> {
        self.levels.get(tier)?.lanes.get(class)
    }

    /// `tenant`'s virtual token counter in `class`: what it has while it waits there, what it
    /// would start at otherwise (see [`vtc`]); zero with fairness off or an unknown class.
    pub fn counter(&self, class: usize, tenant: &str) -> f64 {
        match (&self.sharing.fairness, self.counters.get(class)) {
            (Fairness::Vtc(_), Some(c)) => c.counter(tenant),
            _ => 0.0,
        }
    }

    /// Tenants `class` remembers (backlogged, or ahead of its virtual time).
    pub fn known_tenants(&self, class: usize) -> usize {
        self.counters.get(class).map_or(0, Counters::known)
    }

    /// Reports `tokens` output tokens served to `tenant` in `class`: its counter grows by
    /// `output_weight * tokens / weight`. Nothing with fairness off or an unknown class.
    pub fn charge(&mut self, class: usize, tenant: &str, tokens: u64) {
        let Fairness::Vtc(vtc) = &self.sharing.fairness else {
            return;
        };
        let amount = vtc.output_weight * tokens as f64 / weight_of(vtc, tenant);
        if let Some(c) = self.counters.get_mut(class) {
            c.charge(tenant, amount);
        }
    }

    /// Reports `tokens` prompt tokens served to `tenant` in `class` without waiting in the
    /// queue: its counter grows by `tokens / weight`, as at a dispatch. Nothing with fairness
    /// off or an unknown class.
    pub fn charge_prompt(&mut self, class: usize, tenant: &str, tokens: u64) {
        let Fairness::Vtc(vtc) = &self.sharing.fairness else {
            return;
        };
        let amount = tokens as f64 / weight_of(vtc, tenant);
        if let Some(c) = self.counters.get_mut(class) {
            c.charge(tenant, amount);
        }
    }

    /// Enqueues `item` in `class`, default tier, as the one tenant `""`, at the latest time
    /// seen; `cost` its uncached tokens (a snapshot).
    pub fn push(&mut self, class: usize, item: T, cost: u64) -> Result<Ticket, QueueError> {
        let arrival = Arrival {
            class,
            tier: self.default_tier(),
            tenant: "",
            cost,
            now: self.latest,
            head_start: Duration::ZERO,
        };
        self.push_with(&arrival, item)
    }

    /// Enqueues `item` as `arrival` says.
    pub fn push_with(&mut self, arrival: &Arrival<'_>, item: T) -> Result<Ticket, QueueError> {
        let Arrival {
            class, tier, cost, ..
        } = *arrival;
        let spec = self
            .classes
            .get(class)
            .ok_or(QueueError::UnknownClass { class })?;
        if tier >= self.levels.len() {
            return Err(QueueError::UnknownTier { tier });
        }
        if spec
            .max_queued
            .is_some_and(|max| self.class_len[class] >= max)
        {
            return Err(QueueError::Full { class });
        }
        let tenant = match self.sharing.fairness {
            Fairness::Off => self.anyone.clone(),
            Fairness::Vtc(_) => Arc::from(arrival.tenant),
        };
        self.latest = self.latest.max(arrival.now);
        let rank = rank(self.order, self.latest, cost, arrival.head_start);
        let key = (rank, self.next_arrival);
        self.next_arrival += 1;
        self.counters[class].enter(&tenant);
        let entry = Entry { item, cost, tenant };
        self.levels[tier].lanes[class].insert(key, entry);
        if tier > 0 && self.sharing.tiers[tier].starvation.is_some() {
            self.pushed[tier].push_back((self.latest, class, key));
        }
        self.class_len[class] += 1;
        self.len += 1;
        Ok(Ticket { tier, class, key })
    }

    /// Takes a waiting request out (its client left or it timed out); `None` if it already
    /// left the queue.
    pub fn remove(&mut self, ticket: Ticket) -> Option<T> {
        let Ticket { tier, class, key } = ticket;
        let level = self.levels.get_mut(tier)?;
        let entry = match level.lanes.get_mut(class)?.take(&key) {
            Some(e) => Some(e),
            // Promoted since.
            None => self.levels[0].lanes[class].take(&key),
        }?;
        self.counters[class].leave(&entry.tenant, 0.0);
        self.class_len[class] -= 1;
        self.len -= 1;
        Some(entry.item)
    }

    /// [`pop_at`](Self::pop_at) at the latest time seen.
    pub fn pop(&mut self, can_dispatch: impl FnMut(usize, &T) -> bool) -> Option<(usize, T)> {
        self.pop_at(self.latest, can_dispatch)
    }

    /// The dispatch step at `now`: starved requests are promoted, then the highest tier with
    /// a ready head gives its DRR's pick, or `None` when every non-empty lane is blocked.
    /// `can_dispatch(class, head)` says whether a head has capacity now. The pick's cost is
    /// charged to its tenant's counter.
    pub fn pop_at(
        &mut self,
        now: Duration,
        mut can_dispatch: impl FnMut(usize, &T) -> bool,
    ) -> Option<(usize, T)> {
        self.pop_tiered_at(now, |_, class, head| can_dispatch(class, head))
    }

    /// [`pop_at`](Self::pop_at), with `can_dispatch(tier, class, head)` told the tier the
    /// head is in now: tier 0 for a request promoted by starvation.
    pub fn pop_tiered_at(
        &mut self,
        now: Duration,
        mut can_dispatch: impl FnMut(usize, usize, &T) -> bool,
    ) -> Option<(usize, T)> {
        self.latest = self.latest.max(now);
        if self.len == 0 {
            return None;
        }
        self.promote(self.latest);
        for (tier, level) in self.levels.iter_mut().enumerate() {
            let Some((class, entry)) = level.pop(
                &self.classes,
                &self.counters,
                &mut self.scratch,
                &mut |class, head| can_dispatch(tier, class, head),
            ) else {
                continue;
            };
            let served = match &self.sharing.fairness {
                Fairness::Off => 0.0,
                Fairness::Vtc(vtc) => entry.cost as f64 / weight_of(vtc, &entry.tenant),
            };
            self.counters[class].leave(&entry.tenant, served);
            self.class_len[class] -= 1;
            self.len -= 1;
            return Some((class, entry.item));
        }
        None
    }

    /// Moves every request that waited past its tier's threshold at `now` into tier 0.
    fn promote(&mut self, now: Duration) {
        for tier in 1..self.levels.len() {
            let Some(limit) = self.sharing.tiers[tier].starvation else {
                continue;
            };
            while let Some(&(time, class, key)) = self.pushed[tier].front() {
                if now.saturating_sub(time) <= limit {
                    break;
                }
                self.pushed[tier].pop_front();
                if let Some(entry) = self.levels[tier].lanes[class].take(&key) {
                    self.levels[0].lanes[class].insert(key, entry);
                }
            }
        }
    }
}

/// The first part of a request's key: under FCFS its virtual arrival in microseconds (its
/// push time less its head start, offset by 2^62 so that any head start stays positive), under
/// WSPT its cost divided by `1 + head start in seconds` (Dynamo's `(1 + jump) / cost` score).
/// Push times never decrease, so without head starts the FCFS order is the arrival order.
fn rank(order: QueueOrder, now: Duration, cost: u64, head_start: Duration) -> u64 {
    match order {
        QueueOrder::Fcfs => {
            let at = (1u64 << 62).saturating_add(now.as_micros().min(1 << 61) as u64);
            at.saturating_sub(head_start.as_micros().min(1 << 61) as u64)
        }
        QueueOrder::Wspt if head_start.is_zero() => cost,
        QueueOrder::Wspt => (cost as f64 / (1.0 + head_start.as_secs_f64())).ceil() as u64,
    }
}

/// A tenant's VTC weight: its own, else 1.
fn weight_of(vtc: &VtcConfig, tenant: &str) -> f64 {
    vtc.tenant_weights.get(tenant).copied().unwrap_or(1.0)
}
