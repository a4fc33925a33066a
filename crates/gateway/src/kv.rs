//! What the router knows of the engines' KV caches: the event-fed index, the approximate
//! index of its own decisions, and the prompts' tokens and block hashes ([`Prompts`]).
//!
//! A worker's blocks come from its KV events when it has `kv_events` configured and the
//! router runs with events (the default); otherwise the router approximates: each routing
//! decision records the request's blocks on the chosen rank for `--router-ttl-secs`.
//! Both indexes are synchronous structures behind short locks that are never held across
//! an `.await`.

use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use kvroute_index::{
    ApproxIndex, ApproxIndexer, BlockHash, EngineHash, IndexError, KvIndex, KvIndexer,
    OverlapScores, ReplicaEvents, ReplicaId, ShardedKvIndex, StorageTier, StoredBlocks, TierCounts,
};
use prometheus_client::metrics::gauge::Gauge;

use crate::config::{KvEventsMode, Settings};
use crate::kv_events::RankEvents;
use crate::prompts::Prompts;
use crate::workers::Worker;

/// The router's view of every engine's KV cache.
pub struct KvState {
    pub block_size: usize,
    pub mode: KvEventsMode,
    /// The tokenizer and its prefix cache.
    pub prompts: Prompts,
    index: EventIndex,
    approx: Mutex<ApproxIndex>,
    size: (Gauge, Gauge),
}

impl std::fmt::Debug for KvState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvState")
            .field("block_size", &self.block_size)
            .field("mode", &self.mode)
            .field("prompts", &self.prompts)
            .finish()
    }
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl KvState {
    /// `size` receives the index's block count and heap bytes as they change.
    pub fn new(settings: &Settings, prompts: Prompts, size: (Gauge, Gauge)) -> Self {
        Self {
            block_size: settings.block_size,
            mode: settings.kv_events,
            prompts,
            index: EventIndex::new(settings),
            approx: Mutex::new(ApproxIndex::with_max_entries(
                settings.router_ttl,
                settings.max_indexed_blocks,
            )),
            size,
        }
    }

    fn report(&self, (blocks, bytes): (usize, usize)) {
        self.size.0.set(blocks as i64);
        self.size.1.set(bytes as i64);
    }

    /// Whether `worker`'s cache is learnt from its events (else approximated).
    pub fn uses_events(&self, worker: &Worker) -> bool {
        self.mode == KvEventsMode::Events && worker.kv_events.is_some()
    }

    /// The overlaps of a request's blocks: from events, and from the router's own decisions.
    pub fn overlaps(&self, hashes: &[BlockHash], now: Instant) -> (OverlapScores, OverlapScores) {
        if hashes.is_empty() {
            return Default::default();
        }
        let events = self.index.find_matches(hashes);
        let approx = lock(&self.approx).find_matches(hashes, now);
        (events, approx)
    }

    /// `worker`'s rank `replica` in `overlaps` (from [`KvState::overlaps`]), from the index
    /// its worker feeds: its KV events, or the router's own decisions.
    pub fn counts(
        &self,
        overlaps: &(OverlapScores, OverlapScores),
        worker: &Worker,
        replica: ReplicaId,
    ) -> TierCounts {
        if self.uses_events(worker) {
            overlaps.0.get(replica)
        } else {
            overlaps.1.get(replica)
        }
    }

    /// Approximate mode: the chosen rank now holds the request's blocks.
    pub fn record_routed(&self, replica: ReplicaId, hashes: &[BlockHash], now: Instant) {
        if !hashes.is_empty() {
            let mut approx = lock(&self.approx);
            approx.expire(now);
            approx.record(replica, hashes, now);
        }
    }

    /// Approximate mode: the live records, oldest first, for a starting replica's snapshot
    /// (see [`ApproxIndex::records`]).
    pub fn routed_records(
        &self,
        now: Instant,
        max_blocks: usize,
    ) -> Vec<(ReplicaId, std::time::Duration, Vec<BlockHash>)> {
        let mut approx = lock(&self.approx);
        approx.expire(now);
        approx.records(now, max_blocks)
    }

    pub fn stored(&self, replica: ReplicaId, event: &StoredBlocks<'_>) -> Result<(), IndexError> {
        let (result, size) = self.index.write(replica, |events| events.stored(event));
        self.report(size);
        result
    }

    pub fn removed(&self, replica: ReplicaId, tier: StorageTier, hashes: &[EngineHash]) {
        let ((), size) = self
            .index
            .write(replica, |events| events.removed(tier, hashes));
        self.report(size);
    }

    /// A batch of one replica's events, which `apply` gives in order: applied under one write
    /// of the event-fed index (queries see all of them or none), the size reported once.
    pub fn batch(&self, replica: ReplicaId, apply: &mut dyn FnMut(&mut dyn RankEvents)) {
        let mut cleared = false;
        let ((), size) = self.index.write(replica, |events| {
            apply(&mut Applying {
                events,
                cleared: &mut cleared,
            })
        });
        self.report(size);
        if cleared {
            lock(&self.approx).clear_replica(replica);
        }
    }

    /// Forgets what a replica holds, in both indexes.
    pub fn clear(&self, replica: ReplicaId) {
        let ((), size) = self.index.write(replica, |events| events.cleared());
        self.report(size);
        lock(&self.approx).clear_replica(replica);
    }

    /// The engine blocks a replica holds per tier, in the event-fed index.
    pub fn replica_blocks(&self, replica: ReplicaId) -> TierCounts {
        match &self.index {
            EventIndex::One(index) => read(index).replica_blocks(replica),
            EventIndex::Sharded(index) => index.replica_blocks(replica),
        }
    }

    /// (indexed blocks, approximate bytes) of the event-fed index.
    pub fn index_size(&self) -> (usize, usize) {
        match &self.index {
            EventIndex::One(index) => size(&*read(index)),
            EventIndex::Sharded(index) => (index.blocks(), index.heap_bytes()),
        }
    }
}

fn size(index: &impl KvIndexer) -> (usize, usize) {
    (index.num_blocks(), index.memory_bytes())
}

/// The event-fed index: one `KvIndex` behind a lock (`--router-event-threads 1`, the
/// default), or sharded by replica over mirrored shards, whose queries never wait on a
/// writer and whose shards take events from several threads at once.
enum EventIndex {
    One(Box<RwLock<KvIndex>>),
    Sharded(ShardedKvIndex),
}

impl EventIndex {
    fn new(settings: &Settings) -> Self {
        let (bs, max) = (settings.block_size, settings.max_indexed_blocks);
        match settings.event_threads {
            0 | 1 => Self::One(Box::new(RwLock::new(KvIndex::with_max_blocks(bs, max)))),
            n => Self::Sharded(ShardedKvIndex::with_max_blocks(bs, n, max)),
        }
    }

    /// Applies `apply`'s events for `replica` under one write (the single index's lock, or
    /// one flip of the replica's shard), and returns the index's size after them (read under
    /// the same write lock for the single one).
    fn write<R>(
        &self,
        replica: ReplicaId,
        apply: impl FnOnce(&mut ReplicaEvents<'_>) -> R,
    ) -> (R, (usize, usize)) {
        match self {
            Self::One(index) => {
                let mut index = write(index);
                let result = apply(&mut ReplicaEvents::new(&mut index, replica));
                (result, size(&*index))
            }
            Self::Sharded(index) => (
                index.batch(replica, apply),
                (index.blocks(), index.heap_bytes()),
            ),
        }
    }

    fn find_matches(&self, hashes: &[BlockHash]) -> OverlapScores {
        match self {
            Self::One(index) => read(index).find_matches(hashes),
            Self::Sharded(index) => index.matches(hashes),
        }
    }
}

/// Feeds one worker's KV events into the index, mapping each event's data-parallel rank to
/// that rank's replica (a worker without ranks takes every event itself).
#[derive(Debug)]
pub struct WorkerSink {
    kv: Arc<KvState>,
    worker: Arc<Worker>,
}

impl WorkerSink {
    pub fn new(kv: Arc<KvState>, worker: Arc<Worker>) -> Self {
        Self { kv, worker }
    }

    fn replica(&self, dp_rank: u32) -> Option<ReplicaId> {
        match self.worker.ranks.as_slice() {
            [only] if only.dp_rank.is_none() => Some(only.replica),
            ranks => ranks
                .iter()
                .find(|r| r.dp_rank == Some(dp_rank))
                .map(|r| r.replica),
        }
    }
}

impl crate::kv_events::EventSink for WorkerSink {
    fn stored(&self, dp_rank: u32, event: &StoredBlocks<'_>) -> Result<(), IndexError> {
        match self.replica(dp_rank) {
            Some(replica) => self.kv.stored(replica, event),
            None => Ok(()),
        }
    }

    fn removed(&self, dp_rank: u32, tier: StorageTier, hashes: &[EngineHash]) {
        if let Some(replica) = self.replica(dp_rank) {
            self.kv.removed(replica, tier, hashes);
        }
    }

    fn cleared(&self, dp_rank: u32) {
        if let Some(replica) = self.replica(dp_rank) {
            self.kv.clear(replica);
        }
    }

    fn batch(&self, dp_rank: u32, apply: &mut dyn FnMut(&mut dyn RankEvents)) {
        match self.replica(dp_rank) {
            Some(replica) => self.kv.batch(replica, apply),
            None => apply(&mut Unserved),
        }
    }
}

/// A batch's events applied to one replica's index; a clear is noted, for the router's own
/// index, once the batch is done.
struct Applying<'e, 'i> {
    events: &'e mut ReplicaEvents<'i>,
    cleared: &'e mut bool,
}

impl RankEvents for Applying<'_, '_> {
    fn stored(&mut self, event: &StoredBlocks<'_>) -> Result<(), IndexError> {
        self.events.stored(event)
    }

    fn removed(&mut self, tier: StorageTier, hashes: &[EngineHash]) {
        self.events.removed(tier, hashes);
    }

    fn cleared(&mut self) {
        self.events.cleared();
        *self.cleared = true;
    }
}

/// The events of a rank the worker does not serve (as the per-event methods: ignored).
struct Unserved;

impl RankEvents for Unserved {
    fn stored(&mut self, _: &StoredBlocks<'_>) -> Result<(), IndexError> {
        Ok(())
    }

    fn removed(&mut self, _: StorageTier, _: &[EngineHash]) {}

    fn cleared(&mut self) {}
}

#[cfg(test)]
mod tests {
    use kvroute_tokenizer::Tokenizer;
    use prometheus_client::registry::Registry;

    use super::*;

    const BLOCK: usize = 16;

    fn state(event_threads: usize) -> KvState {
        let mut settings = Settings::with_workers(Vec::new()).unwrap();
        settings.block_size = BLOCK;
        settings.event_threads = event_threads;
        let mut registry = Registry::default();
        let prompts = Prompts::new(Arc::new(Tokenizer::fallback()), BLOCK, 0, &mut registry);
        KvState::new(&settings, prompts, (Gauge::default(), Gauge::default()))
    }

    #[test]
    fn a_batch_applies_in_order_and_a_clear_in_it_reaches_the_routers_own_index() {
        for threads in [1, 2] {
            let kv = state(threads);
            let (replica, other) = (ReplicaId(3), ReplicaId(4));
            let tokens: Vec<u32> = (0..4 * BLOCK as u32).collect();
            let hashes = kvroute_index::block_hashes(&tokens, BLOCK, 0);
            let engine: Vec<EngineHash> = (1..=4).map(EngineHash).collect();
            let stored = StoredBlocks {
                parent: None,
                engine_hashes: &engine,
                token_ids: &tokens,
                block_size: BLOCK,
                tier: StorageTier::Device,
                salt: 0,
            };
            let device = |kv: &KvState, r| {
                let (events, approx) = kv.overlaps(&hashes, Instant::now());
                (events.get(r).device, approx.get(r).device)
            };
            // In order: stored, then its last block removed; a refused event changes nothing.
            let mut refused = false;
            kv.batch(replica, &mut |events| {
                let orphan = StoredBlocks {
                    parent: Some(EngineHash(99)),
                    ..stored
                };
                refused = events.stored(&orphan).is_err();
                events.stored(&stored).unwrap();
                events.removed(StorageTier::Device, &engine[3..]);
            });
            assert!(refused, "{threads} threads");
            kv.stored(other, &stored).unwrap();
            kv.record_routed(replica, &hashes, Instant::now());
            assert_eq!(device(&kv, replica), (3, 4), "{threads} threads");
            assert_eq!(kv.replica_blocks(replica).device, 3);
            // A clear forgets the replica in both indexes, and no other replica.
            kv.batch(replica, &mut |events| events.cleared());
            assert_eq!(device(&kv, replica), (0, 0), "{threads} threads");
            assert_eq!(device(&kv, other).0, 4, "{threads} threads");
            assert_eq!(kv.index_size().0, 4, "{threads} threads");
        }
    }
}
