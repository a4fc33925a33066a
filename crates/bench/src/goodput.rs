//! SLO goodput: the highest rate scale at which a simulated cluster meets a latency SLO.
//!
//! The [`Objective`] is one of:
//! - **percentiles** ([`Slo`], `--slo-ttft-p90-ms`): a run passes when its TTFT p90 is at most
//!   the SLO's (and its E2E p90, when the SLO has one), and its router queue (when on) timed no
//!   request out;
//! - **per-class attainment** (`--slo-mix` with `--slo-attainment P`): each request has the
//!   TTFT target of its class (`crate::simulate`'s `slo` module), and a run passes when every
//!   class met its target for at least `P` of its requests, `met / arrived >= P` (a request
//!   rejected, timed out in the queue or never answered misses). At `P = 0.9` that is each
//!   class's nearest-rank TTFT p90 within its own target, counting the unanswered as late.
//!   A class the run drew no request for passes.
//!
//! Passing is assumed monotone in the rate: if a rate passes, every lower one does.
//! [`search`] finds a bracket, a passing rate `pass` and a failing rate `fail` above it:
//!
//! 1. The start: `--min-rate-scale` and `--max-rate-scale` when given (each is run; a failing
//!    minimum or a passing maximum ends the search there). Otherwise x1, then doubling while it
//!    passes (halving while it fails), at most [`MAX_EXPANSIONS`] times.
//! 2. Bisection at the midpoint, `(pass + fail) / 2`, until `(fail - pass) / pass` is at most
//!    the tolerance (2%) or after `max_steps` (8) bisections, whichever comes first. From a
//!    doubling bracket, 2% takes 6 steps.
//!
//! The rate scale divides the trace's inter-arrival times, so the goodput in requests per
//! second is the trace's rate times `pass` (the run at `pass` reports what it served).
//! Simulations are deterministic for a seed, so the bracket is too.

use serde::Serialize;

use crate::simulate::{simulate, PolicyResult, SimConfig};
use crate::trace::TraceRequest;

/// Doublings (or halvings) from x1 before giving up on finding the other end.
pub const MAX_EXPANSIONS: usize = 10;

/// The latency objective.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_p90_ms: f64,
    pub e2e_p90_ms: Option<f64>,
}

/// A flag of `goodput` that makes no sense.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidGoodput {
    #[error("--{flag} must be a positive number, got {value}")]
    NotPositive { flag: &'static str, value: f64 },
    #[error("--min-rate-scale ({min}) must be below --max-rate-scale ({max})")]
    EmptyRange { min: f64, max: f64 },
    #[error("--slo-attainment must be a fraction in (0, 1], got {0}")]
    Attainment(f64),
}

fn positive(flag: &'static str, value: Option<f64>) -> Result<(), InvalidGoodput> {
    match value {
        Some(value) if !(value.is_finite() && value > 0.0) => {
            Err(InvalidGoodput::NotPositive { flag, value })
        }
        _ => Ok(()),
    }
}

impl Slo {
    pub fn validate(&self) -> Result<(), InvalidGoodput> {
        positive("slo-ttft-p90-ms", Some(self.ttft_p90_ms))?;
        positive("slo-e2e-p90-ms", self.e2e_p90_ms)
    }

    /// Whether `r` meets the objective; a run whose router queue timed a request out does
    /// not (that client got an error, which no percentile shows).
    pub fn met_by(&self, r: &PolicyResult) -> bool {
        r.ttft_ms.p90 <= self.ttft_p90_ms
            && self.e2e_p90_ms.is_none_or(|e| r.e2e_ms.p90 <= e)
            && r.queue.as_ref().is_none_or(|q| q.timed_out == 0)
    }
}

/// What a run must meet to pass (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Objective {
    /// TTFT p90 (and E2E p90) over all the run's requests.
    Percentiles(Slo),
    /// Every class of the run's `--slo-mix` met its TTFT target for at least this fraction of
    /// its requests.
    Attainment(f64),
}

impl Objective {
    pub fn validate(&self) -> Result<(), InvalidGoodput> {
        match *self {
            Self::Percentiles(slo) => slo.validate(),
            Self::Attainment(p) if p > 0.0 && p <= 1.0 => Ok(()),
            Self::Attainment(p) => Err(InvalidGoodput::Attainment(p)),
        }
    }

    /// Whether `r` meets the objective; a run without a mix meets no attainment.
    pub fn met_by(&self, r: &PolicyResult) -> bool {
        match *self {
            Self::Percentiles(slo) => slo.met_by(r),
            Self::Attainment(p) => r
                .slo
                .as_ref()
                .is_some_and(|s| (s.classes.iter()).all(|c| c.requests == 0 || c.attainment >= p)),
        }
    }
}

/// How the bracket is searched (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Search {
    pub min: Option<f64>,
    pub max: Option<f64>,
    /// Stop when `(fail - pass) / pass` is at most this.
    pub tolerance: f64,
    /// At most this many bisections.
    pub max_steps: usize,
}

impl Search {
    pub fn validate(&self) -> Result<(), InvalidGoodput> {
        positive("min-rate-scale", self.min)?;
        positive("max-rate-scale", self.max)?;
        positive("tolerance", Some(self.tolerance))?;
        match (self.min, self.max) {
            (Some(min), Some(max)) if min >= max => Err(InvalidGoodput::EmptyRange { min, max }),
            _ => Ok(()),
        }
    }
}

impl Default for Search {
    fn default() -> Self {
        Self {
            min: None,
            max: None,
            tolerance: 0.02,
            max_steps: 8,
        }
    }
}

/// The highest rate found to pass and the lowest found to fail (None: none was found, the
/// search stopped at its range's end).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bracket {
    pub pass: Option<f64>,
    pub fail: Option<f64>,
    /// Every rate run, in order, and whether it passed.
    pub runs: Vec<(f64, bool)>,
    /// Of those, the bisections.
    pub bisections: usize,
}

/// Which kind of run a rate is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Step {
    Min,
    Max,
    One,
    Expand,
    Bisect,
}

/// The search as a state machine: ask [`next_rate`](Self::next_rate), run it, tell
/// [`record`](Self::record) whether it passed; the bracket grows as it goes.
#[derive(Debug, Clone)]
pub struct Bisection {
    search: Search,
    bracket: Bracket,
    /// The starting rates not run yet.
    start: Vec<(f64, Step)>,
    expansions: usize,
    done: bool,
    asked: Option<(f64, Step)>,
}

impl Bisection {
    pub fn new(search: Search) -> Self {
        let mut start: Vec<(f64, Step)> = [(search.min, Step::Min), (search.max, Step::Max)]
            .into_iter()
            .filter_map(|(x, step)| x.map(|x| (x, step)))
            .collect();
        if start.is_empty() {
            start.push((1.0, Step::One));
        }
        start.reverse();
        Self {
            search,
            bracket: Bracket {
                pass: None,
                fail: None,
                runs: Vec::new(),
                bisections: 0,
            },
            start,
            expansions: 0,
            done: false,
            asked: None,
        }
    }

    /// The next rate to run, or None when the search is over.
    pub fn next_rate(&mut self) -> Option<f64> {
        if self.done {
            return None;
        }
        let b = &self.bracket;
        let expand = self.expansions < MAX_EXPANSIONS;
        let next = match (self.start.last(), b.pass, b.fail) {
            (Some(&start), _, _) => start,
            (None, Some(p), None) if expand => (p * 2.0, Step::Expand),
            (None, None, Some(f)) if expand => (f / 2.0, Step::Expand),
            (None, Some(p), Some(f))
                if b.bisections < self.search.max_steps && (f - p) / p > self.search.tolerance =>
            {
                ((p + f) / 2.0, Step::Bisect)
            }
            _ => return None,
        };
        self.asked = Some(next);
        Some(next.0)
    }

    /// Whether the rate [`next_rate`](Self::next_rate) gave passed.
    pub fn record(&mut self, passed: bool) {
        let (x, step) = self.asked.take().expect("record follows next_rate");
        let b = &mut self.bracket;
        b.runs.push((x, passed));
        if passed {
            b.pass = Some(b.pass.map_or(x, |p| p.max(x)));
        } else {
            b.fail = Some(b.fail.map_or(x, |f| f.min(x)));
        }
        match step {
            Step::Min | Step::Max | Step::One => {
                self.start.pop();
                // Below a failing minimum or above a passing maximum there is nothing to find.
                self.done = (step == Step::Min && !passed) || (step == Step::Max && passed);
            }
            Step::Expand => self.expansions += 1,
            Step::Bisect => b.bisections += 1,
        }
    }

    pub fn bracket(&self) -> &Bracket {
        &self.bracket
    }
}

/// Brackets the highest rate at which `passes` holds (see the module docs).
pub fn search(s: &Search, mut passes: impl FnMut(f64) -> bool) -> Bracket {
    let mut b = Bisection::new(*s);
    while let Some(x) = b.next_rate() {
        b.record(passes(x));
    }
    b.bracket
}

/// One simulation of the search.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Probe {
    pub rate_scale: f64,
    pub passes: bool,
    #[serde(flatten)]
    pub result: PolicyResult,
}

/// A cluster's goodput: the bracket's two ends with their runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Goodput {
    pub policy: String,
    /// The highest rate scale that met the SLO, with its run.
    pub pass: Option<Probe>,
    /// The lowest that did not.
    pub fail: Option<Probe>,
    /// Simulations run.
    pub runs: usize,
    pub bisections: usize,
}

/// Searches the goodput of `cfg`'s cluster (its `rate_scale` is what the search sets) on
/// `trace`; `progress` gets every simulation as it ends. An [`Objective::Attainment`] reads
/// the classes of `cfg.slo`.
pub fn goodput(
    trace: &[TraceRequest],
    cfg: &SimConfig,
    objective: &Objective,
    s: &Search,
    mut progress: impl FnMut(&Probe, &Bracket),
) -> Goodput {
    let mut probes: Vec<Probe> = Vec::new();
    let mut search = Bisection::new(*s);
    while let Some(rate_scale) = search.next_rate() {
        let result = simulate(
            trace,
            &SimConfig {
                rate_scale,
                ..cfg.clone()
            },
        );
        let probe = Probe {
            rate_scale,
            passes: objective.met_by(&result),
            result,
        };
        search.record(probe.passes);
        progress(&probe, search.bracket());
        probes.push(probe);
    }
    let bracket = search.bracket;
    let at = |x: Option<f64>| x.and_then(|x| probes.iter().find(|p| p.rate_scale == x).cloned());
    Goodput {
        policy: cfg.name(),
        pass: at(bracket.pass),
        fail: at(bracket.fail),
        runs: bracket.runs.len(),
        bisections: bracket.bisections,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::{Percentiles, SloClassResult, SloResult};

    fn threshold(t: f64) -> impl FnMut(f64) -> bool {
        move |x| x <= t
    }

    #[test]
    fn doubling_then_bisection_brackets_the_threshold_within_two_percent() {
        for t in [1.0, 1.37, 2.9, 3.0, 5.5, 17.2, 0.3, 0.011] {
            let b = search(&Search::default(), threshold(t));
            let (p, f) = (b.pass.unwrap(), b.fail.unwrap());
            assert!(p <= t && t < f, "{t}: [{p}, {f}]");
            assert!((f - p) / p <= 0.02 || b.bisections == 8, "{t}: {b:?}");
            assert!(b.bisections <= 8);
            // Every run is on the right side of the threshold, and the ends are runs.
            assert!(b.runs.iter().all(|&(x, ok)| ok == (x <= t)));
            assert!(b.runs.contains(&(p, true)) && b.runs.contains(&(f, false)));
        }
    }

    #[test]
    fn eight_bisections_at_most_when_two_percent_is_not_reached() {
        let s = Search {
            tolerance: 0.0001,
            ..Search::default()
        };
        let b = search(&s, threshold(2.5));
        assert_eq!(b.bisections, 8);
        // From [2, 4]: 2 / 2^8 wide.
        let (p, f) = (b.pass.unwrap(), b.fail.unwrap());
        assert!((f - p - 2.0 / 256.0).abs() < 1e-12, "[{p}, {f}]");
        assert!(p <= 2.5 && 2.5 < f);
        // Doubling from x1: 1, 2, 4, then the bisections.
        assert_eq!(b.runs[..3], [(1.0, true), (2.0, true), (4.0, false)]);
        assert_eq!(b.runs.len(), 3 + 8);
    }

    #[test]
    fn a_given_range_is_used_and_its_ends_can_end_the_search() {
        let s = |min, max| Search {
            min,
            max,
            ..Search::default()
        };
        let b = search(&s(Some(2.0), Some(3.0)), threshold(2.5));
        assert_eq!(b.runs[..2], [(2.0, true), (3.0, false)]);
        assert!(b.pass.unwrap() <= 2.5 && 2.5 < b.fail.unwrap());
        assert!((b.fail.unwrap() - b.pass.unwrap()) / b.pass.unwrap() <= 0.02);
        // A failing minimum: nothing passes.
        let b = search(&s(Some(3.0), Some(9.0)), threshold(2.5));
        assert_eq!((b.pass, b.fail, b.runs.len()), (None, Some(3.0), 1));
        // A passing maximum: nothing fails.
        let b = search(&s(Some(1.0), Some(2.0)), threshold(2.5));
        assert_eq!((b.pass, b.fail, b.runs.len()), (Some(2.0), None, 2));
        // Only a maximum that fails: halving from it.
        let b = search(&s(None, Some(8.0)), threshold(2.5));
        assert_eq!(b.runs[..3], [(8.0, false), (4.0, false), (2.0, true)]);
        assert!(b.pass.unwrap() <= 2.5 && 2.5 < b.fail.unwrap());
    }

    #[test]
    fn nonsense_flags_are_refused() {
        let slo = |ttft, e2e| Slo {
            ttft_p90_ms: ttft,
            e2e_p90_ms: e2e,
        };
        assert!(slo(2000.0, Some(9000.0)).validate().is_ok());
        assert!(slo(0.0, None).validate().is_err());
        assert!(slo(2000.0, Some(f64::NAN)).validate().is_err());
        let range = |min, max| Search {
            min,
            max,
            ..Search::default()
        };
        assert!(range(Some(0.5), Some(4.0)).validate().is_ok());
        assert_eq!(
            range(Some(4.0), Some(2.0)).validate(),
            Err(InvalidGoodput::EmptyRange { min: 4.0, max: 2.0 })
        );
        assert!(range(Some(-1.0), None).validate().is_err());
        let tolerance = Search {
            tolerance: 0.0,
            ..Search::default()
        };
        assert!(tolerance.validate().is_err());
    }

    /// A run with these classes' attainments (`(requests, met)` each), every other figure 0.
    fn with_classes(classes: &[(usize, usize)]) -> PolicyResult {
        let zero = Percentiles {
            p50: 0.0,
            p90: 0.0,
            p99: 0.0,
        };
        let slo = SloResult {
            routed_on_targets: false,
            classes: (classes.iter())
                .map(|&(requests, met)| SloClassResult {
                    ttft_slo_ms: 100.0,
                    fraction: 1.0 / classes.len() as f64,
                    requests,
                    met,
                    attainment: met as f64 / requests.max(1) as f64,
                    ttft_ms: zero,
                })
                .collect(),
            attainment: 0.0,
            goodput_rps: 0.0,
        };
        PolicyResult {
            policy: "kv_aware".into(),
            requests: 0,
            rejected: 0,
            ttft_ms: zero,
            ttft_sorted_ms: Vec::new(),
            e2e_ms: zero,
            throughput_rps: 0.0,
            output_tokens_per_s: 0.0,
            hit_share: 0.0,
            requests_per_worker: Vec::new(),
            preemptions: 0,
            lora_loads: 0,
            fitted_lora_load_ms: Vec::new(),
            pd: None,
            queue: None,
            tenants: Vec::new(),
            slo: Some(slo),
        }
    }

    #[test]
    fn attainment_needs_every_class_with_requests() {
        let p90 = Objective::Attainment(0.9);
        assert!(p90.met_by(&with_classes(&[(10, 9), (100, 95)])));
        assert!(!p90.met_by(&with_classes(&[(10, 8), (100, 100)])));
        // A class the run drew no request for does not fail it.
        assert!(p90.met_by(&with_classes(&[(0, 0), (10, 10)])));
        // Without a mix there is nothing to attain.
        let no_mix = PolicyResult {
            slo: None,
            ..with_classes(&[])
        };
        assert!(!p90.met_by(&no_mix));
        assert!(Objective::Attainment(1.0).validate().is_ok());
        for bad in [0.0, -0.5, 1.01, f64::NAN] {
            assert!(Objective::Attainment(bad).validate().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_threshold_out_of_reach_reports_one_end() {
        let b = search(&Search::default(), |_| true);
        assert_eq!((b.pass, b.fail), (Some(1024.0), None));
        let b = search(&Search::default(), |_| false);
        assert_eq!((b.pass, b.fail), (None, Some(1.0 / 1024.0)));
    }
}
