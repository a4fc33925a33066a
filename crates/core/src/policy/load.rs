//! Policies that look only at the candidates and their load: `random`, `round_robin`,
//! `power_of_two`, and the least-loaded choice the others fall back on.

use std::sync::atomic::{AtomicUsize, Ordering};

use rand::{Rng, RngCore};

use super::{Policy, PolicyKind};
use crate::{Candidate, Decision, RouteRequest};

/// Uniform over the candidates.
#[derive(Debug, Default)]
pub struct Random;

impl Policy for Random {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Random
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        _: &RouteRequest<'_>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        (!candidates.is_empty()).then(|| Decision {
            index: rng.random_range(0..candidates.len()),
        })
    }
}

/// The next candidate in turn. The counter is shared by all requests of the policy
/// instance (one instance per model pool), so N requests over N candidates hit each once.
#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl std::fmt::Debug for RoundRobin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RoundRobin")
    }
}

impl Policy for RoundRobin {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
        _: &mut dyn RngCore,
    ) -> Option<Decision> {
        if candidates.is_empty() {
            return None;
        }
        let turn = if request.dry_run {
            self.next.load(Ordering::Relaxed)
        } else {
            self.next.fetch_add(1, Ordering::Relaxed)
        };
        Some(Decision {
            index: turn % candidates.len(),
        })
    }
}

/// Two distinct candidates at random; the one with fewer requests in flight (the first
/// drawn on a tie). With one candidate, that one.
#[derive(Debug, Default)]
pub struct PowerOfTwo;

impl Policy for PowerOfTwo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::PowerOfTwo
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        _: &RouteRequest<'_>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let n = candidates.len();
        match n {
            0 => None,
            1 => Some(Decision { index: 0 }),
            _ => {
                let a = rng.random_range(0..n);
                let b = (a + rng.random_range(1..n)) % n;
                let index = if candidates[b].in_flight < candidates[a].in_flight {
                    b
                } else {
                    a
                };
                Some(Decision { index })
            }
        }
    }
}

/// The candidate with the fewest requests in flight; ties broken uniformly at random.
pub(crate) fn least_loaded(candidates: &[Candidate<'_>], rng: &mut dyn RngCore) -> Option<usize> {
    least_at_random(candidates.iter().map(|c| c.in_flight), rng)
}

/// The index of the least of `keys`, ties broken uniformly at random; `None` when there
/// are none (or none compares, as NaN).
pub(crate) fn least_at_random<K: PartialOrd + Copy>(
    keys: impl Iterator<Item = K> + Clone,
    rng: &mut dyn RngCore,
) -> Option<usize> {
    let min = keys.clone().reduce(|a, b| if b < a { b } else { a })?;
    let mut chosen = None;
    let mut ties = 0u32;
    for (i, k) in keys.enumerate() {
        if k == min {
            ties += 1;
            // Reservoir sampling: the k-th tie replaces the choice with probability 1/k.
            if rng.random_range(0..ties) == 0 {
                chosen = Some(i);
            }
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    use super::*;
    use crate::policy::test_support::{cands, ids, req};

    #[test]
    fn round_robin_cycles_evenly() {
        let ids = ids(3);
        let c = cands(&ids, &[5, 0, 9]);
        let p = RoundRobin::default();
        let mut rng = SmallRng::seed_from_u64(0);
        let r = req(None, "", Instant::now());
        let mut counts = [0; 3];
        for _ in 0..30 {
            counts[p.select(&c, &r, &mut rng).unwrap().index] += 1;
        }
        assert_eq!(counts, [10, 10, 10]);
    }

    #[test]
    fn random_covers_all_candidates() {
        let ids = ids(4);
        let c = cands(&ids, &[0; 4]);
        let mut rng = SmallRng::seed_from_u64(7);
        let r = req(None, "", Instant::now());
        let mut counts = [0; 4];
        for _ in 0..400 {
            counts[Random.select(&c, &r, &mut rng).unwrap().index] += 1;
        }
        assert!(counts.iter().all(|&n| n > 50), "{counts:?}");
    }

    #[test]
    fn power_of_two_never_picks_the_most_loaded_of_two() {
        let ids = ids(2);
        let c = cands(&ids, &[3, 1]);
        let mut rng = SmallRng::seed_from_u64(1);
        let r = req(None, "", Instant::now());
        for _ in 0..50 {
            assert_eq!(PowerOfTwo.select(&c, &r, &mut rng).unwrap().index, 1);
        }
        // Of three, the most loaded can never win: it loses to whichever other is drawn.
        let ids3 = crate::policy::test_support::ids(3);
        let c = cands(&ids3, &[0, 9, 0]);
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[PowerOfTwo.select(&c, &r, &mut rng).unwrap().index] += 1;
        }
        assert_eq!(seen[1], 0);
        assert!(seen[0] > 0 && seen[2] > 0);
    }

    #[test]
    fn least_loaded_breaks_ties_at_random() {
        let ids = ids(3);
        let c = cands(&ids, &[2, 1, 1]);
        let mut rng = SmallRng::seed_from_u64(3);
        let mut seen = [0; 3];
        for _ in 0..200 {
            seen[least_loaded(&c, &mut rng).unwrap()] += 1;
        }
        assert_eq!(seen[0], 0);
        assert!(seen[1] > 50 && seen[2] > 50, "{seen:?}");
        assert_eq!(least_loaded(&[], &mut rng), None);
    }
}
