//! The weighted DRR over the policy classes of one priority tier (the module docs of
//! [`super`] give the algorithm).

use super::lane::{Entry, Lane};
use super::vtc::Counters;
use super::PolicyClass;

/// One tier: a lane per class and the DRR's turn.
#[derive(Debug)]
pub(super) struct Level<T> {
    pub lanes: Vec<Lane<T>>,
    /// The class that has the turn (if `in_turn`) or is visited next.
    pub cursor: usize,
    /// Whether `cursor` has already been credited for its current visit.
    pub in_turn: bool,
}

impl<T> Level<T> {
    pub fn new(classes: usize) -> Self {
        Self {
            lanes: (0..classes).map(|_| Lane::default()).collect(),
            cursor: 0,
            in_turn: false,
        }
    }

    /// The DRR step in this tier: the class that goes and its head, taken out with its cost
    /// paid from the deficit; `None` (changing nothing) when no class is ready.
    /// `scratch` holds one slot per class.
    pub fn pop(
        &mut self,
        classes: &[PolicyClass],
        counters: &[Counters],
        scratch: &mut [Option<u64>],
        can_dispatch: &mut impl FnMut(usize, &T) -> bool,
    ) -> Option<(usize, Entry<T>)> {
        let n = self.lanes.len();
        // The class in turn keeps it while its deficit covers its next head.
        let mut known = None;
        let mut start = self.cursor;
        if self.in_turn {
            let c = self.cursor;
            let lane = &self.lanes[c];
            if let Some((key, head)) = lane.head(&counters[c]) {
                let ready = can_dispatch(c, &head.item);
                if ready && lane.deficit >= head.cost {
                    return Some(self.dispatch(c, key));
                }
                known = Some((c, ready));
            }
            start = (c + 1) % n;
        }
        // The next visits: each ready class's visits needed; the earliest last visit wins.
        let mut winner: Option<(u128, usize, super::Key)> = None;
        for (p, slot) in scratch.iter_mut().enumerate().take(n) {
            let c = (start + p) % n;
            let lane = &self.lanes[c];
            let visits = lane.head(&counters[c]).and_then(|(key, head)| {
                let ready = match known {
                    Some((k, ready)) if k == c => ready,
                    _ => can_dispatch(c, &head.item),
                };
                ready.then(|| {
                    let short = head.cost.saturating_sub(lane.deficit);
                    (short.div_ceil(classes[c].weight).max(1), key)
                })
            });
            *slot = visits.map(|(r, _)| r);
            if let Some((r, key)) = visits {
                let step = u128::from(r - 1) * n as u128 + p as u128;
                if winner.is_none_or(|(s, _, _)| step < s) {
                    winner = Some((step, c, key));
                }
            }
        }
        let (step, won, key) = winner?;
        // Credit every visit up to the winning one, as if the rounds had been looped.
        for (p, slot) in scratch.iter().enumerate().take(n) {
            let c = (start + p) % n;
            if slot.is_some() && p as u128 <= step {
                let visits = u64::try_from((step - p as u128) / n as u128 + 1).unwrap_or(u64::MAX);
                let lane = &mut self.lanes[c];
                let credit = visits.saturating_mul(classes[c].weight);
                lane.deficit = lane.deficit.saturating_add(credit);
            }
        }
        self.cursor = won;
        self.in_turn = true;
        Some(self.dispatch(won, key))
    }

    /// Takes the head `key` of `class`, which its deficit covers, paying its cost.
    fn dispatch(&mut self, class: usize, key: super::Key) -> (usize, Entry<T>) {
        let lane = &mut self.lanes[class];
        let deficit = lane.deficit;
        let head = lane.take(&key).expect("dispatch takes a present head");
        debug_assert!(deficit >= head.cost, "deficit covers the head");
        if lane.len() > 0 {
            lane.deficit = deficit.saturating_sub(head.cost);
        }
        (class, head)
    }
}
