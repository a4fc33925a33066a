//! Worker health: the per-worker circuit breaker fed by request outcomes, the active
//! health checks' counting, and one probe of an engine (`probe`: its health endpoint or its
//! `/v1/models`). The loop that probes each worker and changes the worker set is the
//! state layer's (`workers`).
//!
//! The circuit opens after `failure_threshold` consecutive failed attempts (connection
//! errors, timeouts, 5xx; a 4xx is the client's fault and counts as a success of the
//! worker). While open the worker is not a candidate; after `timeout` one probe request at a
//! time goes through (half-open); `success_threshold` successes close it, one failure opens
//! it again. Health checks are separate: `failure_threshold` failed checks make a worker
//! unhealthy (not a candidate, its KV-event subscription and index entries dropped),
//! `success_threshold` passed checks make it healthy again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;

use crate::config::CircuitSettings;

mod probe;

pub(crate) use probe::probe;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    Closed,
    Open,
    HalfOpen,
}

impl CircuitState {
    /// Its name in `GET /workers`.
    pub fn name(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::Open => "open",
            CircuitState::HalfOpen => "half_open",
        }
    }

    /// The value of `kvroute_worker_circuit_state`.
    pub fn gauge_value(self) -> i64 {
        match self {
            CircuitState::Closed => 0,
            CircuitState::Open => 1,
            CircuitState::HalfOpen => 2,
        }
    }
}

#[derive(Debug)]
struct Inner {
    state: CircuitState,
    /// Consecutive failures while closed; successes while half-open.
    count: u32,
    opened_at: Instant,
    probe_in_flight: bool,
}

/// One worker's circuit breaker. With no settings (disabled) it always allows.
#[derive(Debug)]
pub struct Circuit {
    settings: Option<CircuitSettings>,
    inner: Mutex<Inner>,
    /// Closed with no failure counted: the request path's answer without the lock (every
    /// candidate of every request asks `allows`, every attempt calls `record`).
    clean: AtomicBool,
    gauge: Gauge,
}

impl Circuit {
    pub fn new(settings: Option<CircuitSettings>, gauge: Gauge) -> Self {
        gauge.set(0);
        Self {
            settings,
            inner: Mutex::new(Inner {
                state: CircuitState::Closed,
                count: 0,
                opened_at: Instant::now(),
                probe_in_flight: false,
            }),
            clean: AtomicBool::new(true),
            gauge,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn state(&self) -> CircuitState {
        self.lock().state
    }

    /// Whether a request may be sent to the worker now.
    pub fn allows(&self, now: Instant) -> bool {
        let Some(s) = self.settings else { return true };
        if self.clean.load(Ordering::Relaxed) {
            return true;
        }
        let inner = self.lock();
        match inner.state {
            CircuitState::Closed => true,
            CircuitState::Open => now.saturating_duration_since(inner.opened_at) >= s.timeout,
            CircuitState::HalfOpen => !inner.probe_in_flight,
        }
    }

    /// A request is being sent: an open circuit past its timeout turns half-open, and the
    /// request is its probe.
    pub fn on_send(&self, now: Instant) {
        let Some(s) = self.settings else { return };
        if self.clean.load(Ordering::Relaxed) {
            return;
        }
        let mut inner = self.lock();
        match inner.state {
            CircuitState::Closed => {}
            CircuitState::Open => {
                if now.saturating_duration_since(inner.opened_at) >= s.timeout {
                    inner.state = CircuitState::HalfOpen;
                    inner.count = 0;
                    inner.probe_in_flight = true;
                    self.gauge.set(inner.state.gauge_value());
                }
            }
            CircuitState::HalfOpen => inner.probe_in_flight = true,
        }
    }

    /// The outcome of an attempt: `ok` unless the worker failed (connection error, timeout,
    /// 5xx).
    pub fn record(&self, ok: bool, now: Instant) {
        let Some(s) = self.settings else { return };
        if ok && self.clean.load(Ordering::Relaxed) {
            return;
        }
        let mut inner = self.lock();
        let before = inner.state;
        match (inner.state, ok) {
            (CircuitState::Closed, true) => inner.count = 0,
            (CircuitState::Closed, false) => {
                inner.count += 1;
                if inner.count >= s.failure_threshold {
                    inner.state = CircuitState::Open;
                    inner.opened_at = now;
                    inner.count = 0;
                }
            }
            (CircuitState::HalfOpen, true) => {
                inner.probe_in_flight = false;
                inner.count += 1;
                if inner.count >= s.success_threshold {
                    inner.state = CircuitState::Closed;
                    inner.count = 0;
                }
            }
            (CircuitState::HalfOpen, false) => {
                inner.probe_in_flight = false;
                inner.state = CircuitState::Open;
                inner.opened_at = now;
                inner.count = 0;
            }
            // An answer to a request sent before the circuit opened: no news.
            (CircuitState::Open, _) => {}
        }
        self.clean.store(
            inner.state == CircuitState::Closed && inner.count == 0,
            Ordering::Relaxed,
        );
        if inner.state != before {
            self.gauge.set(inner.state.gauge_value());
            match inner.state {
                CircuitState::Open => tracing::warn!("Circuit opened"),
                CircuitState::Closed => tracing::info!("Circuit closed"),
                CircuitState::HalfOpen => {}
            }
        }
    }

    /// Back to closed (a worker that passed its health checks again, or was re-added).
    pub fn reset(&self) {
        let mut inner = self.lock();
        inner.state = CircuitState::Closed;
        inner.count = 0;
        inner.probe_in_flight = false;
        self.clean.store(true, Ordering::Relaxed);
        self.gauge.set(0);
    }
}

/// Counts consecutive check results into health transitions.
#[derive(Debug, Clone, Copy)]
pub struct HealthCounter {
    failure_threshold: u32,
    success_threshold: u32,
    failures: u32,
    successes: u32,
}

impl HealthCounter {
    pub fn new(failure_threshold: u32, success_threshold: u32) -> Self {
        Self {
            failure_threshold: failure_threshold.max(1),
            success_threshold: success_threshold.max(1),
            failures: 0,
            successes: 0,
        }
    }

    /// Feeds one check; returns the new health when it changes.
    pub fn observe(&mut self, healthy_now: bool, passed: bool) -> Option<bool> {
        if passed {
            self.failures = 0;
            self.successes += 1;
            (!healthy_now && self.successes >= self.success_threshold).then_some(true)
        } else {
            self.successes = 0;
            self.failures += 1;
            (healthy_now && self.failures >= self.failure_threshold).then_some(false)
        }
    }
}

/// Where in `interval` a worker's periodic work (health checks, metrics scrapes) falls:
/// `unit` (in `[0, 1)`, drawn once per worker) of it. Workers added together (at start, or by
/// one discovery update) would otherwise check and scrape in step, every interval, a burst of
/// N requests; with a uniform phase each falls at its own point of the interval, N / interval
/// a second. The first probe or scrape of a new worker is not delayed: the phase is the wait
/// after it.
pub fn phase(interval: Duration, unit: f64) -> Duration {
    interval.mul_f64(unit.clamp(0.0, 1.0))
}

/// [`phase`] with a random unit.
pub fn random_phase(interval: Duration) -> Duration {
    phase(interval, rand::random::<f64>())
}

/// A jittered delay (±`share`) around `base`, so checks of many workers do not align.
pub fn jittered(base: Duration, share: f64) -> Duration {
    let unit: f64 = rand::random::<f64>() * 2.0 - 1.0;
    base.mul_f64((1.0 + share * unit).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn circuit() -> Circuit {
        Circuit::new(
            Some(CircuitSettings {
                failure_threshold: 3,
                success_threshold: 2,
                timeout: Duration::from_secs(10),
            }),
            Gauge::default(),
        )
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let c = circuit();
        let t = Instant::now();
        c.record(false, t);
        c.record(false, t);
        c.record(true, t);
        c.record(false, t);
        c.record(false, t);
        assert_eq!(c.state(), CircuitState::Closed);
        c.record(false, t);
        assert_eq!(c.state(), CircuitState::Open);
        assert_eq!(c.gauge.get(), 1);
        assert!(!c.allows(t + Duration::from_secs(9)));
        assert!(c.allows(t + Duration::from_secs(10)));
    }

    #[test]
    fn half_open_lets_one_probe_through_and_closes_after_successes() {
        let c = circuit();
        let t = Instant::now();
        for _ in 0..3 {
            c.record(false, t);
        }
        let later = t + Duration::from_secs(11);
        c.on_send(later);
        assert_eq!(c.state(), CircuitState::HalfOpen);
        assert!(!c.allows(later), "one probe at a time");
        c.record(true, later);
        assert!(c.allows(later));
        c.on_send(later);
        c.record(true, later);
        assert_eq!(c.state(), CircuitState::Closed);
        assert_eq!(c.gauge.get(), 0);
    }

    #[test]
    fn a_failed_probe_reopens() {
        let c = circuit();
        let t = Instant::now();
        for _ in 0..3 {
            c.record(false, t);
        }
        let later = t + Duration::from_secs(11);
        c.on_send(later);
        c.record(false, later);
        assert_eq!(c.state(), CircuitState::Open);
        assert!(!c.allows(later + Duration::from_secs(1)));
        assert!(c.allows(later + Duration::from_secs(10)));
    }

    #[test]
    fn disabled_always_allows() {
        let c = Circuit::new(None, Gauge::default());
        let t = Instant::now();
        for _ in 0..100 {
            c.record(false, t);
        }
        assert!(c.allows(t));
    }

    #[test]
    fn phases_spread_over_the_interval() {
        let interval = Duration::from_secs(10);
        assert_eq!(phase(interval, 0.0), Duration::ZERO);
        assert_eq!(phase(interval, 0.25), Duration::from_millis(2_500));
        assert_eq!(phase(interval, 7.0), interval);
        // 1,024 workers' random phases fill the interval: every tenth of it has some, none
        // a burst (expected 102 each).
        let mut tenths = [0usize; 10];
        for _ in 0..1024 {
            let p = random_phase(interval);
            assert!(p < interval);
            tenths[(p.as_secs_f64() as usize).min(9)] += 1;
        }
        assert!(
            tenths.iter().all(|&n| (40..=200).contains(&n)),
            "{tenths:?}"
        );
    }

    #[test]
    fn health_needs_consecutive_results() {
        let mut h = HealthCounter::new(3, 2);
        assert_eq!(h.observe(true, false), None);
        assert_eq!(h.observe(true, false), None);
        assert_eq!(h.observe(true, true), None);
        assert_eq!(h.observe(true, false), None);
        assert_eq!(h.observe(true, false), None);
        assert_eq!(h.observe(true, false), Some(false));
        assert_eq!(h.observe(false, true), None);
        assert_eq!(h.observe(false, true), Some(true));
    }
}
