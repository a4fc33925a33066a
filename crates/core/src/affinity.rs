//! Session affinity (Dynamo's): a session key's requests go to the (worker, rank) its
//! session used last, if that was within the TTL.
//!
//! In `Hard` mode the binding is a pin (validated like any pin; an overloaded pinned worker
//! is an error, never rerouted); in `Soft` mode the bound (worker, rank) is taken when it is
//! eligible, else the policy chooses. The bindings are a [`SessionMap`] whose idle time is the
//! TTL: swept at most once a minute, at most `max_sessions` kept (a new key that finds the
//! map full is routed without being bound).

use std::time::{Duration, Instant};

use kvroute_protocol::WorkerId;

use crate::policy::Observation;
use crate::sessions::SessionMap;

/// How a session binding is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AffinityMode {
    Hard,
    Soft,
}

/// The session bindings of one router: key -> (worker, rank).
#[derive(Debug)]
pub struct Affinity {
    pub mode: AffinityMode,
    sessions: SessionMap<(String, Option<u32>)>,
}

impl Affinity {
    pub fn new(mode: AffinityMode, ttl: Duration, max_sessions: usize) -> Self {
        Self {
            mode,
            sessions: SessionMap::new(ttl, max_sessions),
        }
    }

    /// The (worker, rank) `key` is bound to, if the binding is live.
    pub fn get(&self, key: &str, now: Instant) -> Option<(String, Option<u32>)> {
        self.sessions.lock(now).get(key, now).cloned()
    }

    /// Binds `key` to (worker, rank) as of `now`.
    pub fn bind(&self, key: &str, worker: &str, dp_rank: Option<u32>, now: Instant) {
        self.sessions
            .lock(now)
            .bind(key, (worker.to_owned(), dp_rank), now);
    }

    /// The live bindings as of `now` (a starting replica's snapshot): the most recent
    /// whose keys fit in `max_bytes`, oldest first.
    pub fn snapshot(&self, now: Instant, max_bytes: usize) -> Vec<Observation> {
        self.sessions.snapshot(now, max_bytes, |(worker, dp_rank)| {
            (WorkerId::new(worker.as_str()), *dp_rank)
        })
    }

    /// Binds what a peer's [`Affinity::snapshot`] holds, as of `now`, unless expired.
    pub fn restore(&self, observations: &[Observation], now: Instant) {
        self.sessions.restore(observations, now, |o| {
            (o.worker.as_str().to_owned(), o.dp_rank)
        });
    }

    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bindings_travel_with_their_rank() {
        let a = Affinity::new(AffinityMode::Soft, Duration::from_secs(10), 10);
        let t0 = Instant::now();
        a.bind("s", "w1", Some(3), t0);
        a.bind("t", "w2", None, t0);
        let b = Affinity::new(AffinityMode::Hard, Duration::from_secs(10), 10);
        b.restore(&a.snapshot(t0, usize::MAX), t0);
        assert_eq!(b.get("s", t0), Some(("w1".into(), Some(3))));
        assert_eq!(b.get("t", t0), Some(("w2".into(), None)));
        assert_eq!(b.len(), 2);
    }
}
