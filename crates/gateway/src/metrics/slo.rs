//! SLO attainment: `kvroute_slo_requests_total{slo,outcome}`, and the watch that decides each
//! request's outcome from its answer's timings.
//!
//! Each request with a target counts once per target (`slo`: `ttft`, `tpot`), with one
//! `outcome`:
//! - `shed`: refused with 503 `slo_unattainable` (`--slo-shed`);
//! - `unattainable`: routed although no candidate was predicted to meet its targets;
//! - `met` / `missed`: its measured time against the target. TTFT is the router's (arrival to
//!   the answer's first body frame, as `kvroute_time_to_first_token_seconds` measures it; for
//!   a request that does not stream, the first frame is the whole answer). TPOT is a
//!   stream's mean gap between data frames, from the first to the last (a request that does
//!   not stream, or streams one frame, has no TPOT and is not counted for it).
//!
//! An attempt that fails before its first byte is not counted (a retry counts once it
//! answers); so `met + missed + unattainable + shed` is the requests with that target that
//! were answered or shed.

use std::time::Instant;

use kvroute_core::slo::{Slo, SloChoice, SloTargets, Verdict};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SloLabels {
    pub slo: &'static str,
    pub outcome: &'static str,
}

/// How one target of one request ended (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SloOutcome {
    Met,
    Missed,
    Unattainable,
    Shed,
}

impl SloOutcome {
    pub const ALL: [SloOutcome; 4] = [
        SloOutcome::Met,
        SloOutcome::Missed,
        SloOutcome::Unattainable,
        SloOutcome::Shed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SloOutcome::Met => "met",
            SloOutcome::Missed => "missed",
            SloOutcome::Unattainable => "unattainable",
            SloOutcome::Shed => "shed",
        }
    }
}

/// `kvroute_slo_requests_total{slo,outcome}`.
#[derive(Debug, Clone, Default)]
pub struct SloMetrics {
    requests: Family<SloLabels, Counter>,
}

impl SloMetrics {
    pub(super) fn register(&self, registry: &mut Registry) {
        // Every series from the start, at 0.
        for slo in [Slo::Ttft, Slo::Tpot] {
            for outcome in SloOutcome::ALL {
                let _ = self.requests.get_or_create(&labels(slo, outcome));
            }
        }
        registry.register(
            "kvroute_slo_requests",
            "Requests with a latency target (SLO header), by target (ttft, tpot) and outcome (met, missed, unattainable, shed)",
            self.requests.clone(),
        );
    }

    pub fn count(&self, slo: Slo, outcome: SloOutcome) {
        self.requests.get_or_create(&labels(slo, outcome)).inc();
    }

    /// A request with `targets` refused (`--slo-shed`).
    pub fn shed(&self, targets: &SloTargets) {
        if targets.ttft_ms.is_some() {
            self.count(Slo::Ttft, SloOutcome::Shed);
        }
        if targets.tpot_ms.is_some() {
            self.count(Slo::Tpot, SloOutcome::Shed);
        }
    }
}

fn labels(slo: Slo, outcome: SloOutcome) -> SloLabels {
    SloLabels {
        slo: slo.as_str(),
        outcome: outcome.as_str(),
    }
}

/// Watches one attempt's answer and counts its targets' outcomes: TTFT at the first frame,
/// TPOT when it is dropped (the answer ended, or the client left).
#[derive(Debug)]
pub struct SloWatch {
    metrics: SloMetrics,
    targets: SloTargets,
    /// The router's verdicts on the chosen candidate (none: the policy predicts nothing).
    ttft: Option<Verdict>,
    tpot: Option<Verdict>,
    arrived: Instant,
    stream: bool,
    first: Option<Instant>,
    last: Option<Instant>,
    frames: u64,
}

impl SloWatch {
    /// A watch for a request with `targets` that arrived at `arrived`, routed by `choice`
    /// (when the policy chose by headroom); `None` without targets.
    pub fn new(
        metrics: &SloMetrics,
        targets: SloTargets,
        choice: Option<&SloChoice>,
        arrived: Instant,
        stream: bool,
    ) -> Option<Self> {
        let verdicts = (choice.and_then(|c| c.ttft), choice.and_then(|c| c.tpot));
        Self::with_verdicts(metrics, targets, verdicts, arrived, stream)
    }

    /// As [`SloWatch::new`], given the routing's verdicts on the TTFT and TPOT targets (a
    /// disaggregated request's come from its two halves).
    pub fn with_verdicts(
        metrics: &SloMetrics,
        targets: SloTargets,
        (ttft, tpot): (Option<Verdict>, Option<Verdict>),
        arrived: Instant,
        stream: bool,
    ) -> Option<Self> {
        targets.is_set().then(|| Self {
            metrics: metrics.clone(),
            targets,
            ttft,
            tpot,
            arrived,
            stream,
            first: None,
            last: None,
            frames: 0,
        })
    }

    /// The answer's first byte (once): the TTFT's outcome.
    pub fn first_frame(&mut self, now: Instant) {
        if self.first.is_some() {
            return;
        }
        self.first = Some(now);
        if let Some(target) = self.targets.ttft_ms {
            let ms = now.saturating_duration_since(self.arrived).as_secs_f64() * 1e3;
            self.metrics
                .count(Slo::Ttft, outcome(self.ttft, ms <= target));
        }
    }

    /// A data frame of the answer.
    pub fn data_frame(&mut self, now: Instant) {
        self.first_frame(now);
        self.frames += 1;
        self.last = Some(now);
    }

    /// A stream's mean gap between data frames (ms), when it has two or more.
    pub fn tpot_ms(&self) -> Option<f64> {
        let (first, last) = (self.first?, self.last?);
        (self.stream && self.frames >= 2).then(|| {
            last.saturating_duration_since(first).as_secs_f64() * 1e3 / (self.frames - 1) as f64
        })
    }
}

/// A target's outcome: `unattainable` when the router predicted so, else the measurement's.
fn outcome(verdict: Option<Verdict>, met: bool) -> SloOutcome {
    match (verdict, met) {
        (Some(Verdict::Unattainable), _) => SloOutcome::Unattainable,
        (_, true) => SloOutcome::Met,
        (_, false) => SloOutcome::Missed,
    }
}

impl Drop for SloWatch {
    fn drop(&mut self) {
        let Some(target) = self.targets.tpot_ms else {
            return;
        };
        if self.first.is_none() {
            return;
        }
        match (self.tpot, self.tpot_ms()) {
            (Some(Verdict::Unattainable), _) => {
                self.metrics.count(Slo::Tpot, SloOutcome::Unattainable)
            }
            (_, Some(ms)) => self.metrics.count(Slo::Tpot, outcome(None, ms <= target)),
            (_, None) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn counts(m: &SloMetrics) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = [Slo::Ttft, Slo::Tpot]
            .into_iter()
            .flat_map(|s| SloOutcome::ALL.map(|o| (s, o)))
            .map(|(s, o)| {
                let n = m.requests.get_or_create(&labels(s, o)).get();
                (format!("{}/{}", s.as_str(), o.as_str()), n)
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        v.sort();
        v
    }

    fn targets(ttft: f64, tpot: f64) -> SloTargets {
        SloTargets {
            ttft_ms: Some(ttft),
            tpot_ms: Some(tpot),
        }
    }

    #[test]
    fn measured_times_decide_met_and_missed() {
        let m = SloMetrics::default();
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        // TTFT 100 ms against 150: met; gaps of 20 ms against 30: met.
        let mut w = SloWatch::new(&m, targets(150.0, 30.0), None, t0, true).unwrap();
        for at in [100, 120, 140, 160] {
            w.data_frame(ms(at));
        }
        assert_eq!(w.tpot_ms(), Some(20.0));
        drop(w);
        // TTFT 200 ms against 150: missed; gaps of 40 ms against 30: missed.
        let mut w = SloWatch::new(&m, targets(150.0, 30.0), None, t0, true).unwrap();
        for at in [200, 240, 280] {
            w.data_frame(ms(at));
        }
        drop(w);
        assert_eq!(
            counts(&m),
            [
                ("tpot/met".into(), 1),
                ("tpot/missed".into(), 1),
                ("ttft/met".into(), 1),
                ("ttft/missed".into(), 1)
            ]
        );
    }

    #[test]
    fn unattainable_failed_and_unmeasurable_answers() {
        let m = SloMetrics::default();
        let t0 = Instant::now();
        assert!(SloWatch::new(&m, SloTargets::default(), None, t0, true).is_none());
        // Predicted to miss both: unattainable, whatever it measured.
        let choice = SloChoice {
            index: 0,
            ttft: Some(Verdict::Unattainable),
            tpot: Some(Verdict::Unattainable),
            headroom: Vec::new(),
        };
        let mut w = SloWatch::new(&m, targets(1e9, 1e9), Some(&choice), t0, true).unwrap();
        w.data_frame(t0);
        w.data_frame(t0);
        drop(w);
        // Failed before its first byte: not counted.
        drop(SloWatch::new(&m, targets(1.0, 1.0), None, t0, true).unwrap());
        // Not a stream: TTFT (the whole answer) counts, TPOT does not.
        let mut w = SloWatch::new(&m, targets(1e9, 1e9), None, t0, false).unwrap();
        w.data_frame(t0);
        w.data_frame(t0);
        drop(w);
        m.shed(&targets(1.0, 1.0));
        assert_eq!(
            counts(&m),
            [
                ("tpot/shed".into(), 1),
                ("tpot/unattainable".into(), 1),
                ("ttft/met".into(), 1),
                ("ttft/shed".into(), 1),
                ("ttft/unattainable".into(), 1)
            ]
        );
    }
}
