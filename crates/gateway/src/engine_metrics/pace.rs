//! The pace of a fleet's scrapes: every worker's scraper asks it for its interval before each
//! scrape. The interval is `--metrics-refresh-ms`, stretched in a large fleet so that all the
//! scrapers together make at most `--metrics-scrapes-per-sec` scrapes a second: `workers /
//! budget` seconds when that is longer. It never stretches past [`MAX_STRETCH`] (half of
//! [`STALE_AFTER`](super::STALE_AFTER), so that a reading is replaced well before it reads as
//! unknown); past that the fleet exceeds the budget. It follows the fleet as workers come and
//! go: a scraper counts from its start until it is dropped.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The longest a budget stretches an interval to.
pub const MAX_STRETCH: Duration = Duration::from_secs(1);

/// See the module docs.
#[derive(Debug)]
pub struct ScrapePace {
    /// `--metrics-refresh-ms`.
    base: Duration,
    /// `--metrics-scrapes-per-sec`; `None`: no budget.
    budget: Option<NonZeroU32>,
    /// Scrapers running.
    scrapers: AtomicUsize,
    /// The interval now, in seconds (`kvroute_engine_metrics_interval_seconds`).
    interval: Gauge<f64, AtomicU64>,
}

impl ScrapePace {
    /// A pace of `base` under `budget` scrapes a second (`None`: every `base`).
    pub fn new(base: Duration, budget: Option<NonZeroU32>) -> Arc<Self> {
        let pace = Self {
            base: base.max(Duration::from_millis(1)),
            budget,
            scrapers: AtomicUsize::new(0),
            interval: Gauge::default(),
        };
        pace.interval.set(pace.base.as_secs_f64());
        Arc::new(pace)
    }

    /// Registers `kvroute_engine_metrics_interval_seconds`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kvroute_engine_metrics_interval_seconds",
            "The interval between two scrapes of a worker's /metrics: --metrics-refresh-ms, \
             stretched to keep the fleet's scrapes under --metrics-scrapes-per-sec",
            self.interval.clone(),
        );
    }

    /// The interval for a fleet of `scrapers` (see the module docs).
    pub fn interval_for(&self, scrapers: usize) -> Duration {
        let Some(budget) = self.budget else {
            return self.base;
        };
        let spread = Duration::from_secs_f64(scrapers as f64 / f64::from(budget.get()));
        self.base.max(spread.min(MAX_STRETCH))
    }

    /// The interval now.
    pub fn interval(&self) -> Duration {
        self.interval_for(self.scrapers.load(Ordering::Relaxed))
    }

    /// A scraper starts; it counts until the returned guard is dropped.
    pub fn join(self: &Arc<Self>) -> Scraping {
        let n = self.scrapers.fetch_add(1, Ordering::Relaxed) + 1;
        self.interval.set(self.interval_for(n).as_secs_f64());
        Scraping(self.clone())
    }
}

/// A running scraper's place in its [`ScrapePace`].
#[derive(Debug)]
pub struct Scraping(Arc<ScrapePace>);

impl Drop for Scraping {
    fn drop(&mut self) {
        let pace = &self.0;
        let n = pace.scrapers.fetch_sub(1, Ordering::Relaxed) - 1;
        pace.interval.set(pace.interval_for(n).as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn the_interval_stretches_with_the_fleet_up_to_the_most_it_may() {
        let pace = ScrapePace::new(ms(50), NonZeroU32::new(2_000));
        assert_eq!(pace.interval(), ms(50));
        assert_eq!(pace.interval_for(100), ms(50));
        assert_eq!(pace.interval_for(256), ms(128));
        assert_eq!(pace.interval_for(1_024), ms(512));
        assert_eq!(pace.interval_for(100_000), MAX_STRETCH);
        // Never shorter than the refresh interval asked for.
        let slow = ScrapePace::new(ms(5_000), NonZeroU32::new(2_000));
        assert_eq!(slow.interval_for(100_000), ms(5_000));
        let unbounded = ScrapePace::new(ms(50), None);
        assert_eq!(unbounded.interval_for(100_000), ms(50));
    }

    #[test]
    fn scrapers_count_from_their_start_until_they_are_dropped() {
        let pace = ScrapePace::new(ms(1), NonZeroU32::new(1_000));
        let scrapers: Vec<Scraping> = (0..300).map(|_| pace.join()).collect();
        assert_eq!(pace.interval(), ms(300));
        assert_eq!(pace.interval.get(), 0.3);
        drop(scrapers);
        assert_eq!(pace.interval(), ms(1));
        assert_eq!(pace.interval.get(), 0.001);
    }
}
