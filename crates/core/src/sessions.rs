//! A bounded map from session key to a binding that expires when idle: what `manual`'s sticky
//! sessions and session affinity share.
//!
//! A binding is live while it was used less than `idle` ago. Idle bindings are swept at most
//! once a minute (when the map is locked); at most `max_sessions` are kept, and a new key
//! that finds the map full is not bound, so memory stays bounded whatever the traffic.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvroute_protocol::WorkerId;

use crate::policy::{Observation, Observed};

const SWEEP_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug)]
struct Entry<T> {
    value: T,
    last_used: Instant,
}

#[derive(Debug)]
struct State<T> {
    map: HashMap<Box<str>, Entry<T>>,
    last_sweep: Option<Instant>,
}

/// Session key -> binding `T`; see the [module docs](self).
#[derive(Debug)]
pub struct SessionMap<T> {
    idle: Duration,
    max_sessions: usize,
    state: Mutex<State<T>>,
}

/// The map, locked (one lookup and one binding under the same lock).
#[derive(Debug)]
pub struct Locked<'a, T> {
    state: MutexGuard<'a, State<T>>,
    idle: Duration,
    max_sessions: usize,
}

impl<T: Clone> SessionMap<T> {
    pub fn new(idle: Duration, max_sessions: usize) -> Self {
        Self {
            idle,
            max_sessions,
            state: Mutex::new(State {
                map: HashMap::new(),
                last_sweep: None,
            }),
        }
    }

    /// The map as of `now`, swept of idle bindings if a minute has passed.
    pub fn lock(&self, now: Instant) -> Locked<'_, T> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state
            .last_sweep
            .is_none_or(|t| now.saturating_duration_since(t) >= SWEEP_EVERY)
        {
            let idle = self.idle;
            state
                .map
                .retain(|_, e| now.saturating_duration_since(e.last_used) < idle);
            state.last_sweep = Some(now);
        }
        Locked {
            state,
            idle: self.idle,
            max_sessions: self.max_sessions,
        }
    }

    /// How long an unused binding lives.
    pub fn idle(&self) -> Duration {
        self.idle
    }

    pub fn max_sessions(&self) -> usize {
        self.max_sessions
    }

    /// Bindings held (idle ones included until swept).
    pub fn len(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The live bindings as of `now` (a starting replica's snapshot), each as the (worker,
    /// rank) `target` gives: the most recent whose keys fit in `max_bytes`, oldest first.
    pub fn snapshot(
        &self,
        now: Instant,
        max_bytes: usize,
        target: impl Fn(&T) -> (WorkerId, Option<u32>),
    ) -> Vec<Observation> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let live = s
            .map
            .iter()
            .filter(|(_, e)| now.saturating_duration_since(e.last_used) < self.idle)
            .map(|(k, e)| {
                let (worker, dp_rank) = target(&e.value);
                let o = Observation {
                    worker,
                    dp_rank,
                    age: now.saturating_duration_since(e.last_used),
                    learnt: Observed::Session(k.to_string()),
                };
                (e.last_used, k.len(), o)
            })
            .collect();
        newest_within(live, max_bytes)
    }

    /// Binds what a peer's [`SessionMap::snapshot`] holds, as of `now` and with their ages,
    /// each to the binding `value` makes of it; expired ones are skipped.
    pub fn restore(
        &self,
        observations: &[Observation],
        now: Instant,
        value: impl Fn(&Observation) -> T,
    ) {
        let mut s = self.lock(now);
        for o in observations {
            if let (Observed::Session(key), true) = (&o.learnt, o.age < self.idle) {
                s.bind(key, value(o), o.at(now));
            }
        }
    }
}

impl<T> Locked<'_, T> {
    /// The live binding of `key` at `now`.
    pub fn get(&self, key: &str, now: Instant) -> Option<&T> {
        self.state
            .map
            .get(key)
            .filter(|e| now.saturating_duration_since(e.last_used) < self.idle)
            .map(|e| &e.value)
    }

    /// Binds `key` to `value` as of `now` (a new key only if there is room).
    pub fn bind(&mut self, key: &str, value: T, now: Instant) {
        let entry = Entry {
            value,
            last_used: now,
        };
        if let Some(e) = self.state.map.get_mut(key) {
            *e = entry;
        } else if self.state.map.len() < self.max_sessions {
            self.state.map.insert(key.into(), entry);
        }
    }
}

/// The most recent of `items` (last used, bytes, item) whose bytes add up to at most
/// `max_bytes`, oldest first (a snapshot's order).
fn newest_within<T>(mut items: Vec<(Instant, usize, T)>, max_bytes: usize) -> Vec<T> {
    items.sort_unstable_by_key(|(at, _, _)| std::cmp::Reverse(*at));
    let mut bytes = 0usize;
    let mut out: Vec<T> = items
        .into_iter()
        .take_while(|(_, n, _)| {
            bytes += n;
            bytes <= max_bytes
        })
        .map(|(_, _, item)| item)
        .collect();
    out.reverse();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bindings_expire_and_are_bounded() {
        let m: SessionMap<u32> = SessionMap::new(Duration::from_secs(10), 2);
        let t0 = Instant::now();
        m.lock(t0).bind("s1", 1, t0);
        assert_eq!(m.lock(t0).get("s1", t0 + Duration::from_secs(9)), Some(&1));
        assert_eq!(m.lock(t0).get("s1", t0 + Duration::from_secs(10)), None);
        m.lock(t0).bind("s2", 2, t0);
        m.lock(t0).bind("s3", 3, t0);
        assert_eq!(m.len(), 2, "bounded");
        assert_eq!(m.lock(t0).get("s3", t0), None);
        // Rebinding moves the session and refreshes it.
        m.lock(t0).bind("s1", 9, t0 + Duration::from_secs(5));
        assert_eq!(m.lock(t0).get("s1", t0 + Duration::from_secs(14)), Some(&9));
        // The sweep, a minute on, drops the idle bindings.
        m.lock(t0 + Duration::from_secs(120))
            .bind("s4", 4, t0 + Duration::from_secs(120));
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn a_snapshot_restores_live_bindings_with_their_age() {
        let target = |w: &u32| (WorkerId::new(format!("w{w}")), Some(*w));
        let a: SessionMap<u32> = SessionMap::new(Duration::from_secs(10), 100);
        let t0 = Instant::now();
        a.lock(t0).bind("old", 1, t0);
        a.lock(t0).bind("new", 2, t0 + Duration::from_secs(8));
        let now = t0 + Duration::from_secs(9);
        let snap = a.snapshot(now, 1 << 20, target);
        assert_eq!(snap.len(), 2);
        assert!(
            snap.windows(2).all(|w| w[0].age >= w[1].age),
            "oldest first"
        );
        let b: SessionMap<u32> = SessionMap::new(Duration::from_secs(10), 100);
        let later = now + Duration::from_secs(100);
        b.restore(&snap, later, |o| o.dp_rank.unwrap());
        assert_eq!(b.lock(later).get("new", later), Some(&2));
        assert_eq!(b.lock(later).get("old", later), Some(&1));
        // Ages carry over: "old" (9 s) expires a second later, "new" (1 s) does not.
        let after = later + Duration::from_secs(2);
        assert_eq!(b.lock(later).get("old", after), None);
        assert_eq!(b.lock(later).get("new", after), Some(&2));
        // The budget keeps the most recent.
        let small = a.snapshot(now, 3, target);
        assert_eq!(small.len(), 1);
        assert_eq!(small[0].learnt, Observed::Session("new".into()));
    }
}
