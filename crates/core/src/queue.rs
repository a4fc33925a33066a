//! The router's admission queue: weighted deficit round robin (DRR) over policy classes.
//!
//! Requests that cannot be placed yet wait here, each in its [`PolicyClass`]. When capacity
//! frees, the caller asks [`DrrQueue::pop`] which request goes next; `pop` calls the caller's
//! `can_dispatch(class, head)` to learn whether a class's head has capacity on its eligible
//! workers. The queue is pure and synchronous: no clock (timeouts are the caller's, who
//! [`remove`](DrrQueue::remove)s the ticket), no I/O, no choice of worker.
//!
//! # Order within a class
//! [`QueueOrder::Fcfs`]: arrival order. [`QueueOrder::Wspt`]: fewest cost first, arrival as
//! the tie-break. A request's cost is its uncached tokens as given at [`push`](DrrQueue::push),
//! a snapshot that never changes while it waits.
//!
//! # Which class goes next
//! The classes are visited in a fixed circular order. A visit to class `i` that is *ready*
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
//! - An empty class has deficit zero (reset when its last item is dispatched or removed).
//! - Deficit is earned only by ready classes, one quantum per visit; a blocked class keeps what
//!   it has and earns nothing, so it does not come back with accumulated credit.
//! - A visit credits the fewest quanta (at least one) that cover the head, so after crediting
//!   `d_i < max(d_i before, c_i) + w_i`.
//! - A `pop` that returns `None` (queue empty, or every non-empty class blocked) changes no
//!   state. `can_dispatch` is called at most once per class per `pop`, only on a head.
//! - Each pushed item leaves exactly once: by `pop` or by `remove` with its ticket.
//!
//! Over a long run with every class backlogged, class `i`'s share of dispatched cost tends to
//! `w_i / sum(w)`: the error is bounded by one head plus one quantum per class.
//!
//! When a request waits at all (its ranks saturated with prefill) is [`saturation`]'s.

use std::collections::BTreeMap;

mod saturation;
pub use saturation::{must_wait, saturated, valid_threshold, DEFAULT_BATCH_TOKENS};

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;

/// A policy class: a named lane of the queue with its DRR weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyClass {
    /// The name clients ask for (e.g. through `x-kvroute-class`).
    pub name: String,
    /// The DRR quantum, in uncached tokens, earned per round; must be positive.
    pub weight: u64,
    /// The most requests the class may hold; `None` for no bound.
    pub max_queued: Option<usize>,
}

/// The order of requests within one class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueOrder {
    /// First come, first served: arrival order.
    #[default]
    Fcfs,
    /// Weighted shortest processing time: fewest cost first, arrival order among equals.
    Wspt,
}

/// An invalid set of policy classes, found by [`DrrQueue::new`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
}

/// A request the queue refused at [`DrrQueue::push`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    /// The class already holds its `max_queued` requests.
    #[error("policy class {class} is full")]
    Full { class: usize },
    /// No class has this index.
    #[error("no policy class has index {class}")]
    UnknownClass { class: usize },
}

/// A handle on one queued request, for [`DrrQueue::remove`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    class: usize,
    key: Key,
}

impl Ticket {
    /// The class the request waits in.
    pub fn class(&self) -> usize {
        self.class
    }
}

/// The order key within a class: `(rank, arrival)`, rank being the cost under WSPT and zero
/// under FCFS; arrival numbers are unique within a queue.
type Key = (u64, u64);

#[derive(Debug)]
struct Entry<T> {
    item: T,
    cost: u64,
}

#[derive(Debug)]
struct Lane<T> {
    items: BTreeMap<Key, Entry<T>>,
    deficit: u64,
}

/// The weighted DRR queue of policy classes; see the module docs for the algorithm.
#[derive(Debug)]
pub struct DrrQueue<T> {
    classes: Vec<PolicyClass>,
    lanes: Vec<Lane<T>>,
    order: QueueOrder,
    next_arrival: u64,
    len: usize,
    /// The class that has the turn (if `in_turn`) or is visited next.
    cursor: usize,
    /// Whether `cursor` has already been credited for its current visit.
    in_turn: bool,
    /// Per position in the current `pop`'s visit order: the visits a ready class needs.
    scratch: Vec<Option<u64>>,
}

impl<T> DrrQueue<T> {
    /// A queue over `classes` (indexed in the given order), ordered within a class by `order`.
    pub fn new(classes: Vec<PolicyClass>, order: QueueOrder) -> Result<Self, QueueConfigError> {
        if classes.is_empty() {
            return Err(QueueConfigError::NoClasses);
        }
        for (i, class) in classes.iter().enumerate() {
            if class.weight == 0 {
                return Err(QueueConfigError::ZeroWeight {
                    class: class.name.clone(),
                });
            }
            if classes[..i].iter().any(|c| c.name == class.name) {
                return Err(QueueConfigError::DuplicateClass {
                    class: class.name.clone(),
                });
            }
        }
        let lanes = classes
            .iter()
            .map(|_| Lane {
                items: BTreeMap::new(),
                deficit: 0,
            })
            .collect();
        let scratch = vec![None; classes.len()];
        Ok(Self {
            classes,
            lanes,
            order,
            next_arrival: 0,
            len: 0,
            cursor: 0,
            in_turn: false,
            scratch,
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

    /// The order within a class.
    pub fn order(&self) -> QueueOrder {
        self.order
    }

    /// Requests waiting, all classes together.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no request waits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Requests waiting in `class`; zero for an unknown class.
    pub fn class_len(&self, class: usize) -> usize {
        self.lanes.get(class).map_or(0, |l| l.items.len())
    }

    /// The DRR deficit of `class`, in cost units; zero for an unknown class.
    pub fn deficit(&self, class: usize) -> u64 {
        self.lanes.get(class).map_or(0, |l| l.deficit)
    }

    /// Enqueues `item` in `class` with its `cost` (uncached tokens, a snapshot).
    pub fn push(&mut self, class: usize, item: T, cost: u64) -> Result<Ticket, QueueError> {
        let spec = self
            .classes
            .get(class)
            .ok_or(QueueError::UnknownClass { class })?;
        let lane = &mut self.lanes[class];
        if spec.max_queued.is_some_and(|max| lane.items.len() >= max) {
            return Err(QueueError::Full { class });
        }
        let rank = match self.order {
            QueueOrder::Fcfs => 0,
            QueueOrder::Wspt => cost,
        };
        let key = (rank, self.next_arrival);
        self.next_arrival += 1;
        lane.items.insert(key, Entry { item, cost });
        self.len += 1;
        Ok(Ticket { class, key })
    }

    /// Takes a waiting request out (its client left or it timed out); `None` if it already
    /// left the queue.
    pub fn remove(&mut self, ticket: Ticket) -> Option<T> {
        let lane = self.lanes.get_mut(ticket.class)?;
        let entry = lane.items.remove(&ticket.key)?;
        if lane.items.is_empty() {
            lane.deficit = 0;
        }
        self.len -= 1;
        Some(entry.item)
    }

    /// The dispatch step: the class DRR picks and its head, or `None` (changing nothing) when
    /// the queue is empty or every non-empty class is blocked. `can_dispatch(class, head)`
    /// says whether a head has capacity now.
    pub fn pop(&mut self, mut can_dispatch: impl FnMut(usize, &T) -> bool) -> Option<(usize, T)> {
        if self.len == 0 {
            return None;
        }
        let n = self.lanes.len();
        // The class in turn keeps it while its deficit covers its next head.
        let mut known = None;
        let mut start = self.cursor;
        if self.in_turn {
            let c = self.cursor;
            let lane = &self.lanes[c];
            if let Some((_, head)) = lane.items.first_key_value() {
                let ready = can_dispatch(c, &head.item);
                if ready && lane.deficit >= head.cost {
                    return Some(self.dispatch(c));
                }
                known = Some((c, ready));
            }
            start = (c + 1) % n;
        }
        // The next visits: each ready class's visits needed; the earliest last visit wins.
        let mut winner: Option<(u128, usize)> = None;
        for p in 0..n {
            let c = (start + p) % n;
            let lane = &self.lanes[c];
            let visits = lane.items.first_key_value().and_then(|(_, head)| {
                let ready = match known {
                    Some((k, ready)) if k == c => ready,
                    _ => can_dispatch(c, &head.item),
                };
                ready.then(|| {
                    let short = head.cost.saturating_sub(lane.deficit);
                    short.div_ceil(self.classes[c].weight).max(1)
                })
            });
            self.scratch[p] = visits;
            if let Some(r) = visits {
                let step = u128::from(r - 1) * n as u128 + p as u128;
                if winner.is_none_or(|(s, _)| step < s) {
                    winner = Some((step, c));
                }
            }
        }
        let (step, won) = winner?;
        // Credit every visit up to the winning one, as if the rounds had been looped.
        for p in 0..n {
            let c = (start + p) % n;
            if self.scratch[p].is_some() && p as u128 <= step {
                let visits = u64::try_from((step - p as u128) / n as u128 + 1).unwrap_or(u64::MAX);
                let lane = &mut self.lanes[c];
                let credit = visits.saturating_mul(self.classes[c].weight);
                lane.deficit = lane.deficit.saturating_add(credit);
            }
        }
        self.cursor = won;
        self.in_turn = true;
        Some(self.dispatch(won))
    }

    /// Dispatches the head of `class`, which must be non-empty and covered by its deficit.
    fn dispatch(&mut self, class: usize) -> (usize, T) {
        let lane = &mut self.lanes[class];
        let (_, head) = lane
            .items
            .pop_first()
            .expect("dispatch is called on a non-empty class");
        debug_assert!(lane.deficit >= head.cost, "deficit covers the head");
        lane.deficit = lane.deficit.saturating_sub(head.cost);
        if lane.items.is_empty() {
            lane.deficit = 0;
        }
        self.len -= 1;
        (class, head.item)
    }
}
