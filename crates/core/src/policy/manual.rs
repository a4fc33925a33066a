//! `manual`: a sticky map from session key to worker (SGLang's manual policy).
//!
//! A request with a session key goes to the worker its key is bound to, if that worker is
//! still a candidate; otherwise (a new key, or its worker gone or unhealthy) the key is
//! bound to a worker chosen by the [`AssignmentMode`] (least loaded by default) and the
//! request goes there. A request without a key goes to the least-loaded candidate and
//! binds nothing. The bindings are a [`SessionMap`]: idle for `max_idle` (4 h), forgotten;
//! at most `max_sessions` kept, and a new key that finds the map full is routed without
//! being bound, so memory stays bounded whatever the traffic.

use std::fmt;
use std::time::{Duration, Instant};

use kvroute_protocol::WorkerId;
use rand::{Rng, RngCore};

use super::load::least_loaded;
use super::{Observation, Policy, PolicyKind};
use crate::sessions::SessionMap;
use crate::{Candidate, Decision, RouteRequest};

/// How a new session key is placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AssignmentMode {
    /// The candidate with the fewest requests in flight (ties at random).
    MinLoad,
    /// A uniformly random candidate.
    Random,
}

pub struct Manual {
    mode: AssignmentMode,
    sessions: SessionMap<WorkerId>,
}

impl Manual {
    pub fn new(max_idle: Duration, max_sessions: usize, mode: AssignmentMode) -> Self {
        Self {
            mode,
            sessions: SessionMap::new(max_idle, max_sessions),
        }
    }

    /// Number of session keys currently bound.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    fn assign(&self, candidates: &[Candidate<'_>], rng: &mut dyn RngCore) -> Option<usize> {
        match self.mode {
            AssignmentMode::MinLoad => least_loaded(candidates, rng),
            AssignmentMode::Random => {
                (!candidates.is_empty()).then(|| rng.random_range(0..candidates.len()))
            }
        }
    }
}

impl fmt::Debug for Manual {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Manual")
            .field("max_idle_secs", &self.sessions.idle().as_secs())
            .field("max_sessions", &self.sessions.max_sessions())
            .field("assignment_mode", &self.mode)
            .finish()
    }
}

impl Policy for Manual {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Manual
    }

    fn observe(&self, worker: &WorkerId, _dp_rank: Option<u32>, request: &RouteRequest<'_>) {
        if let Some(key) = request.session_key {
            let now = request.now;
            self.sessions.lock(now).bind(key, worker.clone(), now);
        }
    }

    /// The live bindings, most recent within the budget, oldest first.
    fn snapshot(&self, now: Instant, max_bytes: usize) -> Vec<Observation> {
        self.sessions
            .snapshot(now, max_bytes, |worker| (worker.clone(), None))
    }

    fn restore(&self, observations: &[Observation], now: Instant) {
        self.sessions
            .restore(observations, now, |o| o.worker.clone());
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let Some(key) = request.session_key else {
            return least_loaded(candidates, rng).map(|index| Decision { index });
        };
        if candidates.is_empty() {
            return None;
        }
        let now = request.now;
        let mut s = self.sessions.lock(now);
        let bound = s.get(key, now).cloned();
        if let Some(worker) = bound {
            if let Some(index) = candidates.iter().position(|c| c.worker == &worker) {
                if !request.dry_run {
                    s.bind(key, worker, now);
                }
                return Some(Decision { index });
            }
        }
        let index = self.assign(candidates, rng)?;
        if !request.dry_run {
            s.bind(key, candidates[index].worker.clone(), now);
        }
        Some(Decision { index })
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    use super::*;
    use crate::policy::test_support::{cands, ids, req};

    fn manual() -> Manual {
        Manual::new(Duration::from_secs(4 * 3600), 1000, AssignmentMode::MinLoad)
    }

    #[test]
    fn a_key_sticks_to_its_worker_whatever_the_load() {
        let ids = ids(3);
        let p = manual();
        let mut rng = SmallRng::seed_from_u64(0);
        let t0 = Instant::now();
        let first = p
            .select(&cands(&ids, &[1, 0, 1]), &req(Some("a"), "", t0), &mut rng)
            .unwrap()
            .index;
        assert_eq!(first, 1, "a new key goes to the least loaded");
        for i in 0..10 {
            let c = cands(&ids, &[0, 50 + i, 0]);
            let at = t0 + Duration::from_secs(60 * i);
            assert_eq!(
                p.select(&c, &req(Some("a"), "", at), &mut rng)
                    .unwrap()
                    .index,
                1
            );
        }
    }

    #[test]
    fn gone_worker_rebinds_and_idle_keys_expire() {
        let ids = ids(2);
        let p = manual();
        let mut rng = SmallRng::seed_from_u64(0);
        let t0 = Instant::now();
        let both = cands(&ids, &[0, 5]);
        assert_eq!(
            p.select(&both, &req(Some("k"), "", t0), &mut rng)
                .unwrap()
                .index,
            0
        );
        // Worker 0 leaves: the key moves to worker 1 and stays there after 0 returns.
        let only1 = cands(&ids[1..], &[5]);
        let d = p.select(&only1, &req(Some("k"), "", t0), &mut rng).unwrap();
        assert_eq!(only1[d.index].worker, &ids[1]);
        assert_eq!(
            p.select(&both, &req(Some("k"), "", t0), &mut rng)
                .unwrap()
                .index,
            1
        );
        // Idle past 4 h: forgotten, re-placed by load.
        let later = t0 + Duration::from_secs(4 * 3600 + 1);
        assert_eq!(
            p.select(&both, &req(Some("k"), "", later), &mut rng)
                .unwrap()
                .index,
            0
        );
        // The sweep drops other idle keys.
        p.select(&both, &req(Some("old"), "", t0), &mut rng);
        let much_later = later + Duration::from_secs(4 * 3600 + 60);
        p.select(&both, &req(Some("new"), "", much_later), &mut rng);
        assert_eq!(p.sessions(), 1);
    }

    #[test]
    fn keyless_requests_spread_and_the_map_is_bounded() {
        let ids = ids(2);
        let p = Manual::new(Duration::from_secs(3600), 2, AssignmentMode::MinLoad);
        let mut rng = SmallRng::seed_from_u64(9);
        let t0 = Instant::now();
        let c = cands(&ids, &[0, 0]);
        let mut seen = [0; 2];
        for _ in 0..40 {
            seen[p.select(&c, &req(None, "", t0), &mut rng).unwrap().index] += 1;
        }
        assert!(seen[0] > 5 && seen[1] > 5, "{seen:?}");
        for k in 0..10 {
            let key = format!("k{k}");
            assert!(p.select(&c, &req(Some(&key), "", t0), &mut rng).is_some());
        }
        assert_eq!(p.sessions(), 2);
    }
}
