//! `cache_aware`: the classic SGLang router's policy (vllm-router forked the same code), an
//! approximate radix tree over request text that guesses which replica holds a prompt's
//! prefix in its KV cache.
//!
//! # State
//! One tree per policy instance (the gateway builds one instance per model pool), over the
//! request text with characters (Unicode scalar values) as the unit. The text is what
//! `RoutingFields::routing_text` gives: a completion's prompt, or a chat's message contents
//! joined with spaces (SGLang's way). A *tenant* is a candidate's (worker, dp_rank) pair;
//! each tree node records which tenants have sent text through it and when (the latest
//! request `now` among them, so a request arriving late never makes a node look older). `size(t)` is the number of characters tenant `t` holds (shared prefixes count
//! once per tenant).
//!
//! # Choice
//! With `load(c)` the candidate's requests in flight, `max`/`min` over the candidates:
//!
//! 1. **Imbalance.** If `max - min > balance_abs_threshold` **and**
//!    `max > balance_rel_threshold * min`, the request goes to the least-loaded candidate
//!    (ties at random) and the tree is not consulted.
//! 2. **Cache hit.** Otherwise let `m` be the longest prefix of the text held by any
//!    candidate's tenant, in characters, and `n` the text's length. If
//!    `m / n > cache_threshold` (strictly; an empty text is a miss), the request goes to the
//!    candidate whose tenant holds those `m` characters; when several do, the least loaded
//!    of them, ties at random.
//! 3. **Miss.** Otherwise it goes to the candidate with the smallest tree: minimal
//!    `(size(tenant), load)`, ties at random. Unrelated prompts thus spread over the
//!    replicas while a shared prefix sticks to one. (sglang-router 0.3.2 sends misses to
//!    the least-loaded worker instead, which under serial traffic, all loads being 0, always
//!    picks the same one; kvroute keeps the classic rule.)
//!
//! In every case the text is then inserted for the chosen tenant, setting its last-use
//! time to `now` on every node of the path.
//!
//! # Memory bound
//! [`Policy::maintain`] (the gateway calls it every second) evicts once every
//! `eviction_interval_secs`, counted from the first request or call: for each tenant with
//! `size(t) > max_tree_size`, its least recently used leaves are removed one at a time
//! (the tenant leaves the node; a node no tenant holds is freed) until
//! `size(t) <= max_tree_size`. Should `maintain` not be called, an insert that takes a
//! tenant above `2 * max_tree_size` evicts that tenant down to `max_tree_size` at once, so
//! the tree never holds more than `2 * max_tree_size` characters per tenant, and one node
//! per stored character at most, however long the router runs.
//! [`Policy::forget_worker`] drops every rank of a removed worker.
//!
//! All state sits behind one mutex, held for a match and an insert (no I/O, no threads).
//!
//! # Cost
//! Measured by `benches/cache_aware.rs` (8 workers holding 1M characters each, 8,000-
//! character prompts): a match takes 0.2-0.5 us, a whole `select` (match and insert) 2-4 us;
//! the tree takes about 1.05 bytes per stored character for long prompts, and about 25 for
//! short, densely branching texts (each node costs ~100 bytes besides its text).

mod tenants;
mod tree;

#[cfg(test)]
mod differential;
#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvroute_protocol::WorkerId;
use rand::{Rng, RngCore};

use self::tenants::Tenants;
use self::tree::Tree;
use super::load::least_loaded;
use super::{Observation, Observed, Policy, PolicyKind};
use crate::{Candidate, Decision, RouteRequest};

/// An insert that takes a tenant above this multiple of `max_tree_size` evicts at once.
const LAZY_EVICTION_FACTOR: usize = 2;

/// `cache_aware`'s parameters (SGLang's flags and defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct CacheAwareConfig {
    pub cache_threshold: f64,
    pub balance_abs_threshold: u64,
    pub balance_rel_threshold: f64,
    pub eviction_interval_secs: u64,
    pub max_tree_size: usize,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval_secs: 120,
            max_tree_size: 67_108_864,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    tree: Tree,
    tenants: Tenants,
    /// The instant tick 0 stands for (the first `now` seen).
    epoch: Option<Instant>,
    last_eviction: Option<Instant>,
}

impl State {
    fn tick(&mut self, now: Instant) -> u64 {
        self.epoch.get_or_insert(now);
        self.tick_at(now).expect("the epoch is set")
    }

    /// `now` as a tick, once there is an epoch.
    fn tick_at(&self, now: Instant) -> Option<u64> {
        let epoch = self.epoch?;
        Some(u64::try_from(now.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX))
    }
}

/// The `cache_aware` policy (see the module docs for the rules).
pub struct CacheAware {
    config: CacheAwareConfig,
    state: Mutex<State>,
}

impl CacheAware {
    pub fn new(config: CacheAwareConfig) -> Self {
        Self {
            config,
            state: Mutex::new(State::default()),
        }
    }

    pub fn config(&self) -> &CacheAwareConfig {
        &self.config
    }

    /// Characters (`worker`, `dp_rank`) holds in the tree.
    pub fn tree_size(&self, worker: &WorkerId, dp_rank: Option<u32>) -> usize {
        let s = self.lock();
        s.tenants.get(worker, dp_rank).map_or(0, |t| s.tree.size(t))
    }

    /// Characters stored in the tree, each shared prefix counted once.
    pub fn total_chars(&self) -> usize {
        self.lock().tree.total_chars()
    }

    /// An estimate of the bytes the tree and its tenant table use.
    pub fn memory_bytes(&self) -> usize {
        let s = self.lock();
        s.tree.memory_bytes() + s.tenants.memory_bytes()
    }

    /// The longest prefix of `text`, in characters, that one of `candidates` holds
    /// (read only: no timestamp changes).
    pub fn matched_chars(&self, candidates: &[Candidate<'_>], text: &str) -> usize {
        let s = self.lock();
        let (_, allowed) = candidate_tenants(&s.tenants, candidates);
        s.tree.match_prefix(text, &allowed).chars
    }

    /// Records that (`worker`, `dp_rank`) served `text` at `now`, as `select` does for its
    /// choice.
    pub fn insert(&self, worker: &WorkerId, dp_rank: Option<u32>, text: &str, now: Instant) {
        self.insert_locked(&mut self.lock(), worker, dp_rank, text, now);
    }

    fn insert_locked(
        &self,
        s: &mut State,
        worker: &WorkerId,
        dp_rank: Option<u32>,
        text: &str,
        now: Instant,
    ) {
        s.last_eviction.get_or_insert(now);
        let tick = s.tick(now);
        let t = s.tenants.get_or_add(worker, dp_rank);
        s.tree.insert(text, t, tick);
        let max = self.config.max_tree_size;
        if s.tree.size(t) > max.saturating_mul(LAZY_EVICTION_FACTOR) {
            s.tree.evict(t, max);
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rule 1: `max - min > abs` and `max > rel * min`.
    fn imbalanced(&self, candidates: &[Candidate<'_>]) -> bool {
        let loads = candidates.iter().map(|c| c.in_flight);
        let (Some(min), Some(max)) = (loads.clone().min(), loads.max()) else {
            return false;
        };
        max - min > self.config.balance_abs_threshold
            && max as f64 > self.config.balance_rel_threshold * min as f64
    }

    /// Rules 2 and 3, for a balanced load.
    fn by_cache(
        &self,
        s: &State,
        candidates: &[Candidate<'_>],
        text: &str,
        rng: &mut dyn RngCore,
    ) -> Option<usize> {
        let (tenants, allowed) = candidate_tenants(&s.tenants, candidates);
        let m = s.tree.match_prefix(text, &allowed);
        let text_chars = text.chars().count();
        let hit =
            text_chars > 0 && m.chars as f64 / text_chars as f64 > self.config.cache_threshold;
        if hit {
            let mut matched = vec![false; allowed.len()];
            for t in s.tree.holders(m.node) {
                matched[t as usize] = allowed.get(t as usize).copied().unwrap_or(false);
            }
            let holders = tenants.iter().enumerate().filter_map(|(i, t)| {
                let t = (*t)? as usize;
                matched[t].then_some((i, candidates[i].in_flight))
            });
            return pick_min(holders, rng);
        }
        let sizes = tenants.iter().enumerate().map(|(i, t)| {
            let size = t.map_or(0, |t| s.tree.size(t));
            (i, (size, candidates[i].in_flight))
        });
        pick_min(sizes, rng)
    }
}

/// Each candidate's tenant (`None` if the tree has never seen it) and the table of tenants
/// among the candidates.
fn candidate_tenants(
    tenants: &Tenants,
    candidates: &[Candidate<'_>],
) -> (Vec<Option<u32>>, Vec<bool>) {
    let ids: Vec<Option<u32>> = candidates
        .iter()
        .map(|c| tenants.get(c.worker, c.dp_rank))
        .collect();
    let mut allowed = vec![false; tenants.bound()];
    for &t in ids.iter().flatten() {
        allowed[t as usize] = true;
    }
    (ids, allowed)
}

/// The item with the smallest key; ties broken uniformly at random (reservoir sampling).
fn pick_min<K: Ord>(
    items: impl Iterator<Item = (usize, K)>,
    rng: &mut dyn RngCore,
) -> Option<usize> {
    let mut best: Option<(K, usize)> = None;
    let mut ties = 0u32;
    for (i, key) in items {
        match &best {
            Some((b, _)) if key > *b => {}
            Some((b, _)) if key == *b => {
                ties += 1;
                if rng.random_range(0..ties) == 0 {
                    best = Some((key, i));
                }
            }
            _ => {
                best = Some((key, i));
                ties = 1;
            }
        }
    }
    best.map(|(_, i)| i)
}

impl fmt::Debug for CacheAware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("CacheAware")
            .field("cache_threshold", &c.cache_threshold)
            .field("balance_abs_threshold", &c.balance_abs_threshold)
            .field("balance_rel_threshold", &c.balance_rel_threshold)
            .field("eviction_interval_secs", &c.eviction_interval_secs)
            .field("max_tree_size", &c.max_tree_size)
            .finish()
    }
}

impl Policy for CacheAware {
    fn kind(&self) -> PolicyKind {
        PolicyKind::CacheAware
    }

    fn observe(&self, worker: &WorkerId, dp_rank: Option<u32>, request: &RouteRequest<'_>) {
        if !request.text.is_empty() {
            self.insert(worker, dp_rank, request.text, request.now);
        }
    }

    /// Each tenant's texts: the path to each node it last used more recently than anything
    /// below (its leaves, and where a shorter text ended), with its age.
    fn snapshot(&self, now: Instant, max_bytes: usize) -> Vec<Observation> {
        let s = self.lock();
        let Some(now_tick) = s.tick_at(now) else {
            return Vec::new();
        };
        let mut ends: Vec<(u64, &WorkerId, Option<u32>, u32)> = s
            .tenants
            .iter()
            .flat_map(|(worker, dp_rank, t)| {
                s.tree
                    .ends(t)
                    .into_iter()
                    .map(move |(tick, node)| (tick, worker, dp_rank, node))
            })
            .collect();
        // The most recent first, while the budget lasts; then oldest first.
        ends.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
        let mut out = Vec::new();
        let mut bytes = 0usize;
        for (tick, worker, dp_rank, node) in ends {
            let text = s.tree.text_of(node);
            bytes += text.len();
            if bytes > max_bytes {
                break;
            }
            out.push(Observation {
                worker: worker.clone(),
                dp_rank,
                age: Duration::from_nanos(now_tick.saturating_sub(tick)),
                learnt: Observed::Text(text),
            });
        }
        out.reverse();
        out
    }

    fn restore(&self, observations: &[Observation], now: Instant) {
        let mut s = self.lock();
        for o in observations {
            if let Observed::Text(text) = &o.learnt {
                let at = o.at(now);
                self.insert_locked(&mut s, &o.worker, o.dp_rank, text, at);
            }
        }
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        if candidates.is_empty() {
            return None;
        }
        let imbalanced = self.imbalanced(candidates);
        let mut s = self.lock();
        let index = if imbalanced {
            least_loaded(candidates, rng)?
        } else {
            self.by_cache(&s, candidates, request.text, rng)?
        };
        let chosen = &candidates[index];
        if !request.dry_run {
            self.insert_locked(
                &mut s,
                chosen.worker,
                chosen.dp_rank,
                request.text,
                request.now,
            );
        }
        Some(Decision { index })
    }

    /// Evicts every tenant down to `max_tree_size` characters if `eviction_interval_secs`
    /// have passed since the last eviction (or since the first request or call).
    fn maintain(&self, now: Instant) {
        let mut s = self.lock();
        let interval = Duration::from_secs(self.config.eviction_interval_secs);
        let last = *s.last_eviction.get_or_insert(now);
        if now.saturating_duration_since(last) < interval {
            return;
        }
        s.last_eviction = Some(now);
        for t in 0..s.tenants.bound() {
            s.tree.evict(t as u32, self.config.max_tree_size);
        }
    }

    /// Removes every rank of `worker` from the tree.
    fn forget_worker(&self, worker: &WorkerId) {
        let mut s = self.lock();
        for t in s.tenants.remove_worker(worker) {
            s.tree.remove_tenant(t);
            s.tenants.recycle(t);
        }
    }
}
