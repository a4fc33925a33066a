//! What the router knows of each engine's own gauges (`waiting`, `running`, `kv_usage`, the
//! adapters of `vllm:lora_requests_info`): read at the moment of each decision, or, with
//! `SimConfig::metrics_refresh` (`--metrics-refresh-ms`), as the gateway's scrapes of the
//! engines' `/metrics` last showed them.
//!
//! With an interval, engine `i` is scraped at `phase_i + k * interval` (`phase_i` drawn from
//! the seed in `[0, interval)`, as the gateway spreads a fleet's scrapes over the interval),
//! and a decision reads the last scrape's gauges. A reading older than the gateway's
//! `STALE_AFTER` reads as unknown, as there. Each scrape is taken lazily and exactly: an
//! engine's gauges change only when the simulation changes the engine (a request added, a
//! step started), so [`Scrapes::catch_up`], called before each such change, reads the engine
//! as it stood at every scrape due since the last change; a decision reads an engine with a
//! scrape due since its last change as it is (nothing changed it since), and any other as
//! its last caught-up scrape read it. The network time of a scrape is not modelled.

use std::borrow::Cow;
use std::time::Duration;

use kvroute_sim::engine::{EngineCore, LoraState};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// A reading older than this reads as unknown: the gateway's `engine_metrics::STALE_AFTER`
/// (a test checks that they agree).
pub(super) const STALE_AFTER: Duration = Duration::from_secs(2);

/// One engine's gauges as a scrape reads them.
#[derive(Debug, Clone, Default)]
pub(super) struct Gauges {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub lora: LoraState,
}

impl Gauges {
    fn of(engine: &EngineCore) -> Self {
        Self {
            lora: engine.lora_state(),
            ..Self::of_load(engine)
        }
    }

    /// The load gauges alone (no adapters).
    fn of_load(engine: &EngineCore) -> Self {
        let s = engine.stats();
        Self {
            running: s.running,
            waiting: s.waiting,
            kv_usage: s.kv_usage,
            lora: LoraState::default(),
        }
    }
}

/// See the module docs.
pub(super) struct Scrapes {
    interval: Option<Duration>,
    /// Each engine's next scrape.
    next: Vec<Duration>,
    /// Each engine's last scrape: when, and what it read.
    seen: Vec<(Duration, Gauges)>,
}

impl Scrapes {
    /// The scrapes of `engines` engines every `interval` (`None`: none, every decision reads
    /// the engines as they are).
    pub fn new(interval: Option<Duration>, engines: usize, seed: u64) -> Self {
        let interval = interval.filter(|i| !i.is_zero());
        // No state at all without scrapes.
        let scraped = interval.map_or(0, |_| engines);
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x5c4a_9e5f);
        let phase = interval.unwrap_or_default();
        Self {
            interval,
            next: (0..scraped).map(|_| phase.mul_f64(rng.random())).collect(),
            // Before the first scrape, the gauges of an idle engine (the gateway's first
            // scrape comes at once, on an engine that has served nothing yet).
            seen: vec![(Duration::ZERO, Gauges::default()); scraped],
        }
    }

    /// Engine `e` is about to change, or be read, at `now`: the last scrape due by `now`
    /// reads it as it stands (unchanged since that scrape).
    pub fn catch_up(&mut self, e: usize, engine: &EngineCore, now: Duration) {
        let Some(interval) = self.interval else {
            return;
        };
        if let Some(last) = self.last_due(e, interval, now) {
            self.seen[e] = (last, Gauges::of(engine));
            self.next[e] = last + interval;
        }
    }

    /// Engine `e`'s last scrape due by `now` since it was last caught up, if one is.
    fn last_due(&self, e: usize, interval: Duration, now: Duration) -> Option<Duration> {
        let next = self.next[e];
        // `next + k * interval` <= `now` < the one after.
        let k = ((now.checked_sub(next)?).as_nanos() / interval.as_nanos()) as u32;
        Some(next + interval * k)
    }

    /// The engines as a decision at `at` sees them.
    pub fn view<'a>(&'a self, engines: &'a [EngineCore], at: Duration) -> View<'a> {
        View {
            engines,
            scrapes: self,
            at,
        }
    }

    /// What a decision at `now` reads of engine `e`: `None` where stale.
    fn reading(&self, e: usize, now: Duration) -> Option<Reading<'_>> {
        let Some(interval) = self.interval else {
            return Some(Reading::Live);
        };
        // A scrape due since the last change read the engine as it is now.
        let (at, reading) = match self.last_due(e, interval, now) {
            Some(last) => (last, Reading::Live),
            None => (self.seen[e].0, Reading::Scraped(&self.seen[e].1)),
        };
        (now.saturating_sub(at) <= STALE_AFTER).then_some(reading)
    }
}

/// An engine's gauges as a decision reads them.
enum Reading<'a> {
    /// As the engine stands.
    Live,
    /// As a scrape before its last change read it.
    Scraped(&'a Gauges),
}

/// The engines as one decision sees them: their configurations as they are, their gauges as
/// last scraped.
pub(super) struct View<'a> {
    pub engines: &'a [EngineCore],
    scrapes: &'a Scrapes,
    at: Duration,
}

impl View<'_> {
    /// Engine `e`'s waiting and running requests and KV usage; `None` where stale.
    pub fn load(&self, e: usize) -> Option<(usize, usize, f64)> {
        let of = |g: &Gauges| (g.waiting, g.running, g.kv_usage);
        match self.scrapes.reading(e, self.at)? {
            Reading::Live => Some(of(&Gauges::of_load(&self.engines[e]))),
            Reading::Scraped(gauges) => Some(of(gauges)),
        }
    }

    /// Engine `e`'s adapters; `None` where stale.
    pub fn lora(&self, e: usize) -> Option<Cow<'_, LoraState>> {
        match self.scrapes.reading(e, self.at)? {
            Reading::Live => Some(Cow::Owned(self.engines[e].lora_state())),
            Reading::Scraped(gauges) => Some(Cow::Borrowed(&gauges.lora)),
        }
    }
}

#[cfg(test)]
mod tests {
    use kvroute_sim::engine::{EngineConfig, EngineRequest, RequestId};

    use super::*;

    fn request(id: u64) -> EngineRequest {
        EngineRequest {
            id: RequestId(id),
            prompt: (0..64).map(|t| t + id as u32 * 1000).collect(),
            max_tokens: 4,
            salt: 0,
            lora: None,
            priority: 0,
        }
    }

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    /// Adds a request to `engine` at `at`, as the simulation does: caught up first.
    fn add(scrapes: &mut Scrapes, engine: &mut [EngineCore], id: u64, at: Duration) {
        scrapes.catch_up(0, &engine[0], at);
        engine[0].add_request(request(id)).unwrap();
    }

    fn waiting(scrapes: &Scrapes, engine: &[EngineCore], at: Duration) -> Option<usize> {
        scrapes
            .view(engine, at)
            .load(0)
            .map(|(waiting, _, _)| waiting)
    }

    #[test]
    fn a_decision_reads_the_engine_as_its_last_scrape_found_it() {
        let mut engine = vec![EngineCore::new(EngineConfig::default())];
        let mut scrapes = Scrapes::new(Some(ms(100)), 1, 7);
        let phase = scrapes.next[0];
        assert!(
            phase < ms(100),
            "the first scrape within one interval: {phase:?}"
        );
        // Two requests before the first scrape, one after it: the scrape saw two.
        add(&mut scrapes, &mut engine, 1, phase - phase.min(ms(1)));
        add(&mut scrapes, &mut engine, 2, phase.saturating_sub(ms(1)));
        assert_eq!(waiting(&scrapes, &engine, phase), Some(2));
        add(&mut scrapes, &mut engine, 3, phase + ms(10));
        assert_eq!(waiting(&scrapes, &engine, phase + ms(99)), Some(2));
        // Three scrapes are due by +350 ms with no change between: the last reads three, and
        // is the one the next change keeps.
        assert_eq!(waiting(&scrapes, &engine, phase + ms(350)), Some(3));
        scrapes.catch_up(0, &engine[0], phase + ms(350));
        assert_eq!(scrapes.seen[0].0, phase + ms(300));
        assert_eq!(scrapes.next[0], phase + ms(400));
        // Without scrapes, every decision reads the engine as it is.
        let mut live = Scrapes::new(None, 1, 7);
        add(&mut live, &mut engine, 4, phase + ms(351));
        assert_eq!(waiting(&live, &engine, phase + ms(351)), Some(4));
    }

    #[test]
    fn a_reading_older_than_the_gateways_stale_limit_is_unknown() {
        // The gateway's limit, which the gateway is not a dependency to import.
        assert_eq!(STALE_AFTER, Duration::from_secs(2));
        let mut engine = vec![EngineCore::new(EngineConfig::default())];
        let mut scrapes = Scrapes::new(Some(ms(5_000)), 1, 3);
        let phase = scrapes.next[0];
        add(&mut scrapes, &mut engine, 1, Duration::ZERO);
        assert_eq!(waiting(&scrapes, &engine, phase), Some(1));
        assert_eq!(waiting(&scrapes, &engine, phase + STALE_AFTER), Some(1));
        assert_eq!(
            waiting(&scrapes, &engine, phase + STALE_AFTER + ms(1)),
            None
        );
        let view = scrapes.view(&engine, phase + STALE_AFTER + ms(1));
        assert!(view.lora(0).is_none());
    }

    #[test]
    fn the_scrapes_of_a_fleet_are_spread_over_the_interval() {
        let scrapes = Scrapes::new(Some(ms(1_000)), 1_000, 11);
        let mut tenths = [0; 10];
        for next in &scrapes.next {
            tenths[(next.as_millis() / 100) as usize] += 1;
        }
        assert!(
            tenths.iter().all(|&n| (60..=140).contains(&n)),
            "{tenths:?}"
        );
    }
}
