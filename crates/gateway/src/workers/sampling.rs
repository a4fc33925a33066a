//! What a sampled kv_aware decision (`--router-sample-ranks`, `routing/lean.rs`) reads of a
//! pool without a pass over its ranks: which ranks have active requests that start with a
//! prompt's first block ([`ActiveFirsts`]), where each rank sits in the pool, and the cluster's
//! terms, refreshed at most every [`CLUSTER_REFRESH`].
//!
//! The index answers which ranks hold a prompt's blocks in their caches; a rank also holds
//! them while a request routed there with the same prefix runs (its load accounting counts
//! them: Dynamo's active blocks). Block hashes being chained, such a request starts with the
//! prompt's first block, so the ranks to read are those [`ActiveFirsts`] lists for it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, TryLockError};
use std::time::{Duration, Instant};

use kvroute_core::policy::{Cluster, KvAware};
use kvroute_index::ReplicaId;
use kvroute_protocol::hashers::IdentityMap;

use super::{lock, Worker};

const SHARDS: usize = 16;

/// One shard: first block -> (rank, active requests starting with it there).
type Shard = IdentityMap<u64, Vec<(ReplicaId, u32)>>;

/// Per first block of the active requests, the ranks they run on with how many: every rank
/// of a [`WorkerSet`](super::WorkerSet) with sampling on reports its requests' starts and ends,
/// once a pool samples ([`Self::activate`]; sampling is on by default, but only pools of 256
/// ranks or more sample, so a small fleet never pays a lock a request for it).
#[derive(Debug, Default)]
pub struct ActiveFirsts {
    /// Sharded by the hash's top bits (router block hashes are uniform).
    shards: [Mutex<Shard>; SHARDS],
    /// Set for good when a pool first samples: requests already running are not counted, those
    /// started since are (an earlier one's end may take one off a later one's count of the
    /// same rank and first block: the map only says which ranks a decision reads).
    active: AtomicBool,
}

impl ActiveFirsts {
    /// From now on, starts and ends are counted.
    pub fn activate(&self) {
        self.active.store(true, Ordering::Relaxed);
    }

    fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    fn shard(&self, first: u64) -> std::sync::MutexGuard<'_, Shard> {
        lock(&self.shards[(first >> 60) as usize % SHARDS])
    }

    /// A request whose first block is `first` started on `replica`.
    pub fn started(&self, first: u64, replica: ReplicaId) {
        if !self.is_active() {
            return;
        }
        let mut shard = self.shard(first);
        let ranks = shard.entry(first).or_default();
        match ranks.iter_mut().find(|(r, _)| *r == replica) {
            Some((_, n)) => *n += 1,
            None => ranks.push((replica, 1)),
        }
    }

    /// A request whose first block is `first` ended on `replica` (one started there).
    pub fn finished(&self, first: u64, replica: ReplicaId) {
        if !self.is_active() {
            return;
        }
        let mut shard = self.shard(first);
        let Some(ranks) = shard.get_mut(&first) else {
            return;
        };
        if let Some(i) = ranks.iter().position(|(r, _)| *r == replica) {
            ranks[i].1 -= 1;
            if ranks[i].1 == 0 {
                ranks.swap_remove(i);
            }
        }
        if ranks.is_empty() {
            shard.remove(&first);
        }
    }

    /// Appends to `out` the ranks running a request whose first block is `first`.
    pub fn ranks_of(&self, first: u64, out: &mut Vec<ReplicaId>) {
        if let Some(ranks) = self.shard(first).get(&first) {
            out.extend(ranks.iter().map(|(r, _)| *r));
        }
    }

    /// Distinct first blocks held (for tests and memory checks).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How long the cluster's terms of a sampled decision may be reused: the engines' gauges
/// they read are scraped every 50 ms by default.
pub const CLUSTER_REFRESH: Duration = Duration::from_millis(50);

/// A pool's side of a sampled decision.
#[derive(Debug)]
pub struct Sampling {
    /// Ranks costed besides the prompt's holders, drawn at random.
    pub others: usize,
    /// Every rank of the pool, as (worker, rank) indexes, in pool order.
    pub pairs: Vec<(u32, u32)>,
    /// Each rank's index in `pairs`, at its replica's id (replica ids are dense: a
    /// [`WorkerSet`](super::WorkerSet) numbers its ranks from 0); `u32::MAX` for none.
    positions: Vec<u32>,
    pub firsts: Arc<ActiveFirsts>,
    /// The cluster's terms over every available rank, and when they were summed.
    cluster: RwLock<Option<(Instant, Cluster)>>,
    /// Held by the one caller summing them again.
    summing: Mutex<()>,
}

impl Sampling {
    pub fn new(workers: &[Arc<Worker>], others: usize, firsts: Arc<ActiveFirsts>) -> Self {
        let pairs: Vec<(u32, u32)> = (workers.iter().enumerate())
            .flat_map(|(w, worker)| (0..worker.ranks.len()).map(move |r| (w as u32, r as u32)))
            .collect();
        let replica = |&(w, r): &(u32, u32)| workers[w as usize].ranks[r as usize].replica.0;
        let size = pairs
            .iter()
            .map(replica)
            .max()
            .map_or(0, |m| m as usize + 1);
        let mut positions = vec![u32::MAX; size];
        for (i, pair) in pairs.iter().enumerate() {
            positions[replica(pair) as usize] = i as u32;
        }
        firsts.activate();
        Self {
            others,
            pairs,
            positions,
            firsts,
            cluster: RwLock::new(None),
            summing: Mutex::new(()),
        }
    }

    /// The index in [`Self::pairs`] of the rank `replica`, if it is in the pool.
    pub fn position(&self, replica: ReplicaId) -> Option<usize> {
        let at = *self.positions.get(replica.0 as usize)?;
        (at != u32::MAX).then_some(at as usize)
    }

    /// The cluster's terms as of at most [`CLUSTER_REFRESH`] ago, summed over the pool's
    /// `workers` again when older (by one caller; the others meanwhile take the last sum).
    pub fn cluster(&self, policy: &KvAware, workers: &[Arc<Worker>], now: Instant) -> Cluster {
        let last = *self.cluster.read().unwrap_or_else(|e| e.into_inner());
        if let Some((at, c)) = last {
            if now.saturating_duration_since(at) < CLUSTER_REFRESH {
                return c;
            }
        }
        let _summing = match self.summing.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            // Another caller is summing: the last sum meanwhile.
            Err(TryLockError::WouldBlock) => match last {
                Some((_, c)) => return c,
                None => return sum(policy, workers, now),
            },
        };
        let c = sum(policy, workers, now);
        *self.cluster.write().unwrap_or_else(|e| e.into_inner()) = Some((now, c));
        c
    }
}

/// [`KvAware::cluster_of`] every rank of the available `workers`, from their published
/// numbers (as the lean decision sums them without sampling).
fn sum(policy: &KvAware, workers: &[Arc<Worker>], now: Instant) -> Cluster {
    let available = workers.iter().filter(|w| w.available(now));
    policy.cluster_of(available.flat_map(|w| w.ranks.iter()).map(|rank| {
        let summary = rank.load_summary();
        (
            rank.engine.load(now),
            rank.published_factors(),
            summary.decode_blocks,
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_counted_until_a_pool_samples() {
        let firsts = ActiveFirsts::default();
        firsts.started(7, ReplicaId(1));
        assert!(firsts.is_empty(), "no pool samples: no lock a request");
        firsts.finished(7, ReplicaId(1));
        firsts.activate();
        firsts.started(7, ReplicaId(1));
        let mut ranks = Vec::new();
        firsts.ranks_of(7, &mut ranks);
        assert_eq!(ranks, [ReplicaId(1)]);
        firsts.finished(7, ReplicaId(1));
        assert!(firsts.is_empty());
    }
}
