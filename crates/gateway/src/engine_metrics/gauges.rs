//! [`EngineGauges`]: the last reading of one engine rank, shared lock-free between the
//! scraper that writes it and the requests that read it.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use kvroute_core::EngineLoad;

use super::parse::{LoraReading, RankReading};

/// A reading older than this is unknown.
pub const STALE_AFTER: Duration = Duration::from_secs(2);

const NEVER: i64 = i64::MIN;

/// The last good reading of one (worker, data-parallel rank).
///
/// Each value is an atomic holding an `f64`'s bits (NaN: the last reading did not have
/// it), with the reading's time beside them; a reader may see one reading's values mixed
/// with the next's (each value is whole), which is harmless for gauges read 50 ms apart.
/// `num_gpu_blocks` is static: once known (from the worker's config, which wins, or from
/// `vllm:cache_config_info`) it is reported whatever the age of the last reading.
#[derive(Debug)]
pub struct EngineGauges {
    /// Times are kept as signed nanoseconds from this instant.
    epoch: Instant,
    read_at: AtomicI64,
    waiting: AtomicU64,
    running: AtomicU64,
    kv_usage: AtomicU64,
    /// 0: unknown.
    configured_blocks: AtomicU64,
    scraped_blocks: AtomicU64,
    engine_block_size: AtomicU64,
    /// The engine's adapters and when they were read (a lock: a reading is a few names).
    lora: RwLock<Option<(Arc<LoraReading>, Instant)>>,
}

impl Default for EngineGauges {
    fn default() -> Self {
        Self::new()
    }
}

impl EngineGauges {
    /// Gauges with no reading yet (every value unknown).
    pub fn new() -> Self {
        let nan = f64::NAN.to_bits();
        Self {
            epoch: Instant::now(),
            read_at: AtomicI64::new(NEVER),
            waiting: AtomicU64::new(nan),
            running: AtomicU64::new(nan),
            kv_usage: AtomicU64::new(nan),
            configured_blocks: AtomicU64::new(0),
            scraped_blocks: AtomicU64::new(0),
            engine_block_size: AtomicU64::new(0),
            lora: RwLock::new(None),
        }
    }

    /// Stores the engine's adapters, read at `at`.
    pub fn record_lora(&self, lora: Arc<LoraReading>, at: Instant) {
        *self.lora.write().unwrap_or_else(|e| e.into_inner()) = Some((lora, at));
    }

    /// The engine's adapters as of `now`, unless the reading is older than [`STALE_AFTER`].
    pub fn lora(&self, now: Instant) -> Option<Arc<LoraReading>> {
        let lora = self.lora.read().unwrap_or_else(|e| e.into_inner());
        let (reading, at) = lora.as_ref()?;
        (now.saturating_duration_since(*at) <= STALE_AFTER).then(|| reading.clone())
    }

    /// What the engine reported, as of `now`: the values of the last good reading if it is
    /// at most [`STALE_AFTER`] old, else `None` (and `None` for a series the reading lacked).
    pub fn load(&self, now: Instant) -> EngineLoad {
        let blocks = self.num_gpu_blocks();
        let fresh = self
            .last_reading()
            .is_some_and(|at| now.saturating_duration_since(at) <= STALE_AFTER);
        if !fresh {
            return EngineLoad {
                num_gpu_blocks: blocks,
                ..EngineLoad::default()
            };
        }
        let value =
            |a: &AtomicU64| Some(f64::from_bits(a.load(Ordering::Relaxed))).filter(|v| !v.is_nan());
        EngineLoad {
            waiting: value(&self.waiting),
            running: value(&self.running),
            kv_usage: value(&self.kv_usage),
            num_gpu_blocks: blocks,
        }
    }

    /// Stores a good reading taken at `at`.
    pub fn record(&self, reading: &RankReading, at: Instant) {
        let bits = |v: Option<f64>| v.unwrap_or(f64::NAN).to_bits();
        self.waiting.store(bits(reading.waiting), Ordering::Relaxed);
        self.running.store(bits(reading.running), Ordering::Relaxed);
        self.kv_usage
            .store(bits(reading.kv_usage), Ordering::Relaxed);
        if let Some(n) = reading.num_gpu_blocks {
            self.scraped_blocks.store(n, Ordering::Relaxed);
        }
        if let Some(n) = reading.block_size {
            self.engine_block_size.store(n, Ordering::Relaxed);
        }
        self.read_at.store(self.offset(at), Ordering::Release);
    }

    /// Sets the engine's KV block count from the worker's config (`None` clears it); it
    /// wins over the scraped value.
    pub fn set_num_gpu_blocks(&self, blocks: Option<u64>) {
        self.configured_blocks
            .store(blocks.unwrap_or(0), Ordering::Relaxed);
    }

    /// The engine's KV block count: the configured one, else the last scraped.
    pub fn num_gpu_blocks(&self) -> Option<u64> {
        let known = |a: &AtomicU64| Some(a.load(Ordering::Relaxed)).filter(|&n| n > 0);
        known(&self.configured_blocks).or_else(|| known(&self.scraped_blocks))
    }

    /// Tokens per engine KV block, when the engine reported it.
    pub fn engine_block_size(&self) -> Option<u64> {
        Some(self.engine_block_size.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    /// When the last good reading was taken.
    pub fn last_reading(&self) -> Option<Instant> {
        match self.read_at.load(Ordering::Acquire) {
            NEVER => None,
            nanos if nanos >= 0 => self.epoch.checked_add(Duration::from_nanos(nanos as u64)),
            nanos => self
                .epoch
                .checked_sub(Duration::from_nanos(nanos.unsigned_abs())),
        }
    }

    fn offset(&self, at: Instant) -> i64 {
        let clamp = |d: Duration| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX);
        match at.checked_duration_since(self.epoch) {
            Some(after) => clamp(after),
            None => (-clamp(self.epoch.duration_since(at))).max(NEVER + 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(waiting: f64, kv: Option<f64>) -> RankReading {
        RankReading {
            waiting: Some(waiting),
            running: Some(1.0),
            kv_usage: kv,
            num_gpu_blocks: None,
            block_size: None,
        }
    }

    #[test]
    fn a_reading_is_fresh_for_two_seconds_then_unknown() {
        let g = EngineGauges::new();
        let t0 = Instant::now();
        assert_eq!(g.load(t0), EngineLoad::default(), "never read");
        g.record(&reading(3.0, Some(0.5)), t0);
        let fresh = EngineLoad {
            waiting: Some(3.0),
            running: Some(1.0),
            kv_usage: Some(0.5),
            num_gpu_blocks: None,
        };
        assert_eq!(g.load(t0), fresh);
        assert_eq!(g.load(t0 + STALE_AFTER), fresh);
        assert_eq!(
            g.load(t0 + STALE_AFTER + Duration::from_millis(1)),
            EngineLoad::default()
        );
        // A series the last reading lacked is unknown.
        g.record(&reading(4.0, None), t0 + Duration::from_secs(5));
        let l = g.load(t0 + Duration::from_secs(5));
        assert_eq!((l.waiting, l.kv_usage), (Some(4.0), None));
    }

    #[test]
    fn times_before_the_epoch_round_trip() {
        let before = Instant::now();
        let g = EngineGauges::new();
        g.record(&reading(1.0, None), before);
        assert_eq!(g.last_reading(), Some(before));
        assert_eq!(g.load(before + Duration::from_secs(1)).waiting, Some(1.0));
        assert_eq!(g.load(before + Duration::from_secs(3)).waiting, None);
    }

    #[test]
    fn block_counts_do_not_go_stale_and_the_config_wins() {
        let g = EngineGauges::new();
        let t0 = Instant::now();
        let mut r = reading(0.0, None);
        r.num_gpu_blocks = Some(100);
        r.block_size = Some(16);
        g.record(&r, t0);
        let late = t0 + Duration::from_secs(3600);
        assert_eq!(g.load(late).num_gpu_blocks, Some(100));
        assert_eq!(g.load(late).waiting, None);
        assert_eq!(g.engine_block_size(), Some(16));
        g.set_num_gpu_blocks(Some(64));
        assert_eq!(g.load(late).num_gpu_blocks, Some(64));
        g.set_num_gpu_blocks(None);
        assert_eq!(g.load(late).num_gpu_blocks, Some(100));
        let only_config = EngineGauges::new();
        only_config.set_num_gpu_blocks(Some(7));
        assert_eq!(only_config.load(t0).num_gpu_blocks, Some(7));
    }
}
