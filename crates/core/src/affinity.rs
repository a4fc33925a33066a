//! Session affinity (Dynamo's): a session key's requests go to the (worker, rank) its
//! session used last, if that was within the TTL.
//!
//! In `Hard` mode the binding is a pin (validated like any pin; an overloaded pinned worker
//! is an error, never rerouted); in `Soft` mode the bound (worker, rank) is taken when it is
//! eligible, else the policy chooses. Bindings expire after the TTL (swept at most once a
//! minute) and at most `max_sessions` are kept: a new key that finds the map full is routed
//! without being bound.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvroute_protocol::WorkerId;

use crate::policy::{newest_within, Observation, Observed};

/// How a session binding is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AffinityMode {
    Hard,
    Soft,
}

#[derive(Debug, Clone)]
struct Binding {
    worker: String,
    dp_rank: Option<u32>,
    last_used: Instant,
}

#[derive(Debug)]
struct State {
    map: HashMap<String, Binding>,
    last_sweep: Option<Instant>,
}

/// The session bindings of one router.
#[derive(Debug)]
pub struct Affinity {
    pub mode: AffinityMode,
    ttl: Duration,
    max_sessions: usize,
    state: Mutex<State>,
}

const SWEEP_EVERY: Duration = Duration::from_secs(60);

impl Affinity {
    pub fn new(mode: AffinityMode, ttl: Duration, max_sessions: usize) -> Self {
        Self {
            mode,
            ttl,
            max_sessions,
            state: Mutex::new(State {
                map: HashMap::new(),
                last_sweep: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The (worker, rank) `key` is bound to, if the binding is live.
    pub fn get(&self, key: &str, now: Instant) -> Option<(String, Option<u32>)> {
        let s = self.lock();
        let b = s.map.get(key)?;
        (now.saturating_duration_since(b.last_used) < self.ttl)
            .then(|| (b.worker.clone(), b.dp_rank))
    }

    /// Binds `key` to (worker, rank) as of `now`.
    pub fn bind(&self, key: &str, worker: &str, dp_rank: Option<u32>, now: Instant) {
        let mut s = self.lock();
        if s.last_sweep
            .is_none_or(|t| now.saturating_duration_since(t) >= SWEEP_EVERY)
        {
            let ttl = self.ttl;
            s.map
                .retain(|_, b| now.saturating_duration_since(b.last_used) < ttl);
            s.last_sweep = Some(now);
        }
        let binding = Binding {
            worker: worker.to_owned(),
            dp_rank,
            last_used: now,
        };
        if let Some(b) = s.map.get_mut(key) {
            *b = binding;
        } else if s.map.len() < self.max_sessions {
            s.map.insert(key.to_owned(), binding);
        }
    }

    /// The live bindings as of `now` (a starting replica's snapshot): the most recent
    /// whose keys fit in `max_bytes`, oldest first.
    pub fn snapshot(&self, now: Instant, max_bytes: usize) -> Vec<Observation> {
        let s = self.lock();
        let live = s
            .map
            .iter()
            .filter(|(_, b)| now.saturating_duration_since(b.last_used) < self.ttl)
            .map(|(k, b)| {
                let o = Observation {
                    worker: WorkerId::new(b.worker.as_str()),
                    dp_rank: b.dp_rank,
                    age: now.saturating_duration_since(b.last_used),
                    learnt: Observed::Session(k.clone()),
                };
                (b.last_used, k.len(), o)
            })
            .collect();
        newest_within(live, max_bytes)
    }

    /// Binds what a peer's [`Affinity::snapshot`] holds, as of `now`, unless expired.
    pub fn restore(&self, observations: &[Observation], now: Instant) {
        for o in observations {
            if let (Observed::Session(key), true) = (&o.learnt, o.age < self.ttl) {
                self.bind(key, o.worker.as_str(), o.dp_rank, o.at(now));
            }
        }
    }

    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bindings_expire_and_are_bounded() {
        let a = Affinity::new(AffinityMode::Soft, Duration::from_secs(10), 2);
        let t0 = Instant::now();
        a.bind("s1", "w1", Some(3), t0);
        assert_eq!(
            a.get("s1", t0 + Duration::from_secs(9)),
            Some(("w1".into(), Some(3)))
        );
        assert_eq!(a.get("s1", t0 + Duration::from_secs(10)), None);
        a.bind("s2", "w2", None, t0);
        a.bind("s3", "w3", None, t0);
        assert_eq!(a.len(), 2, "bounded");
        assert_eq!(a.get("s3", t0), None);
        // Rebinding moves the session and refreshes it.
        a.bind("s1", "w9", None, t0 + Duration::from_secs(5));
        assert_eq!(
            a.get("s1", t0 + Duration::from_secs(14)),
            Some(("w9".into(), None))
        );
        // The sweep drops expired bindings.
        a.bind("s4", "w4", None, t0 + Duration::from_secs(120));
        assert_eq!(a.len(), 1);
    }

    #[test]
    fn a_snapshot_restores_live_bindings_with_their_age() {
        let a = Affinity::new(AffinityMode::Soft, Duration::from_secs(10), 100);
        let t0 = Instant::now();
        a.bind("old", "w1", Some(0), t0);
        a.bind("new", "w2", None, t0 + Duration::from_secs(8));
        let now = t0 + Duration::from_secs(9);
        let snap = a.snapshot(now, 1 << 20);
        assert_eq!(snap.len(), 2);
        assert!(
            snap.windows(2).all(|w| w[0].age >= w[1].age),
            "oldest first"
        );
        let b = Affinity::new(AffinityMode::Soft, Duration::from_secs(10), 100);
        let later = Instant::now() + Duration::from_secs(100);
        b.restore(&snap, later);
        assert_eq!(b.get("new", later), Some(("w2".into(), None)));
        assert_eq!(b.get("old", later), Some(("w1".into(), Some(0))));
        // Ages carry over: "old" (9 s) expires a second later, "new" (1 s) does not.
        let after = later + Duration::from_secs(2);
        assert_eq!(b.get("old", after), None);
        assert_eq!(b.get("new", after), Some(("w2".into(), None)));
        // The budget keeps the most recent.
        let small = a.snapshot(now, 3);
        assert_eq!(small.len(), 1);
        assert_eq!(small[0].learnt, Observed::Session("new".into()));
    }
}
