//! Per-request TTFT targets over a simulated cluster (`--slo-mix`), and their attainment.
//!
//! A mix is a list of classes `fraction:ttft_ms` (`0.3:1000,0.7:10000`: 30% of the requests
//! must see their first token within 1 s, 70% within 10 s). Request `i` of the trace belongs
//! to the class where `u_i = splitmix(i) / 2^64` falls in the fractions' running sum: the
//! same request has the same target in every run, whatever the seed or the policy.
//!
//! With [`SloRouting::Headers`] each request carries its target to the router, as a client
//! sends `x-kvroute-slo-ttft-ms`, and a kv_aware pool chooses by headroom exactly as the
//! gateway does (`kvroute_core::slo::choose` over `policy::predict`'s predictions, the
//! policy's costs breaking ties). With [`SloRouting::Blind`] the router never sees the
//! targets: the same requests, measured against the same targets.
//!
//! A class's attainment is its requests whose TTFT met the target over all of its requests
//! (one rejected or never answered misses); the run's goodput is the requests that met their
//! target per second of the run.

use std::str::FromStr;

use kvroute_core::slo::SloTargets;
use serde::Serialize;

use super::result::{percentiles, Percentiles};

/// One class of a mix.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SloClass {
    pub fraction: f64,
    pub ttft_ms: f64,
}

/// Classes whose fractions sum to 1.
#[derive(Debug, Clone, PartialEq)]
pub struct SloMix {
    classes: Vec<SloClass>,
}

impl FromStr for SloMix {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let classes = s
            .split(',')
            .map(|item| {
                let (f, t) = item
                    .trim()
                    .split_once(':')
                    .ok_or_else(|| format!("'{item}' is not fraction:ttft_ms"))?;
                let number = |v: &str| v.trim().parse::<f64>().ok().filter(|x| x.is_finite());
                let fraction = number(f)
                    .filter(|f| *f > 0.0 && *f <= 1.0)
                    .ok_or_else(|| format!("'{f}' is not a fraction in (0, 1]"))?;
                let ttft_ms = number(t)
                    .filter(|t| *t > 0.0)
                    .ok_or_else(|| format!("'{t}' is not a positive number of milliseconds"))?;
                Ok(SloClass { fraction, ttft_ms })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let sum: f64 = classes.iter().map(|c| c.fraction).sum();
        if (sum - 1.0).abs() > 1e-6 {
            return Err(format!("the fractions sum to {sum}, not 1"));
        }
        Ok(Self { classes })
    }
}

impl SloMix {
    pub fn classes(&self) -> &[SloClass] {
        &self.classes
    }

    /// The class of request `i` (see the module docs).
    pub fn class_of(&self, i: u64) -> usize {
        let u = (kvroute_protocol::mix64(i, 0x510_5eed) >> 11) as f64 / (1u64 << 53) as f64;
        let mut sum = 0.0;
        for (c, class) in self.classes.iter().enumerate() {
            sum += class.fraction;
            if u < sum {
                return c;
            }
        }
        self.classes.len() - 1
    }
}

/// Whether the router sees the requests' targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SloRouting {
    /// Each request carries its target (an SLO header).
    Headers,
    /// The router never sees them.
    Blind,
}

/// A run's targets (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct SloConfig {
    pub mix: SloMix,
    pub routing: SloRouting,
}

impl SloConfig {
    /// What request `i` tells the router.
    pub fn targets(&self, i: u64) -> SloTargets {
        match self.routing {
            SloRouting::Headers => SloTargets {
                ttft_ms: Some(self.mix.classes[self.mix.class_of(i)].ttft_ms),
                tpot_ms: None,
            },
            SloRouting::Blind => SloTargets::default(),
        }
    }
}

/// One class's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SloClassResult {
    pub ttft_slo_ms: f64,
    pub fraction: f64,
    /// Requests of the class that arrived.
    pub requests: usize,
    /// Of those, the ones whose TTFT met the target.
    pub met: usize,
    /// `met / requests`.
    pub attainment: f64,
    pub ttft_ms: Percentiles,
}

/// A run's SLO figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SloResult {
    /// Whether the router saw the targets.
    pub routed_on_targets: bool,
    pub classes: Vec<SloClassResult>,
    /// Requests that met their target over all requests.
    pub attainment: f64,
    /// Requests that met their target per second of the run.
    pub goodput_rps: f64,
}

/// The running totals of each class.
#[derive(Debug, Default)]
pub(super) struct SloTally {
    arrived: Vec<usize>,
    ttft: Vec<Vec<f64>>,
}

impl SloTally {
    /// Request `i` arrived.
    pub fn arrived(&mut self, cfg: Option<&SloConfig>, i: u64) {
        if let Some(cfg) = cfg {
            let n = cfg.mix.classes.len();
            self.arrived.resize(n, 0);
            self.ttft.resize(n, Vec::new());
            self.arrived[cfg.mix.class_of(i)] += 1;
        }
    }

    /// Request `i` saw its first token after `ttft_ms`.
    pub fn answered(&mut self, cfg: Option<&SloConfig>, i: u64, ttft_ms: f64) {
        if let Some(cfg) = cfg {
            self.ttft[cfg.mix.class_of(i)].push(ttft_ms);
        }
    }

    /// The figures of a run of `makespan_s` seconds.
    pub fn result(mut self, cfg: Option<&SloConfig>, makespan_s: f64) -> Option<SloResult> {
        let cfg = cfg?;
        let mut all = (0, 0);
        let classes = (cfg.mix.classes.iter().enumerate())
            .map(|(c, class)| {
                let requests = self.arrived.get(c).copied().unwrap_or(0);
                let ttft = self.ttft.get_mut(c).map(std::mem::take).unwrap_or_default();
                let met = ttft.iter().filter(|t| **t <= class.ttft_ms).count();
                all = (all.0 + met, all.1 + requests);
                let mut ttft = ttft;
                SloClassResult {
                    ttft_slo_ms: class.ttft_ms,
                    fraction: class.fraction,
                    requests,
                    met,
                    attainment: met as f64 / requests.max(1) as f64,
                    ttft_ms: percentiles(&mut ttft),
                }
            })
            .collect();
        Some(SloResult {
            routed_on_targets: cfg.routing == SloRouting::Headers,
            classes,
            attainment: all.0 as f64 / all.1.max(1) as f64,
            goodput_rps: all.0 as f64 / makespan_s.max(1e-9),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mix_parses_and_assigns_its_fractions_deterministically() {
        let mix: SloMix = "0.3:1000, 0.7:10000".parse().unwrap();
        assert_eq!(
            mix.classes(),
            [
                SloClass {
                    fraction: 0.3,
                    ttft_ms: 1000.0
                },
                SloClass {
                    fraction: 0.7,
                    ttft_ms: 10000.0
                }
            ]
        );
        let tight = (0..10_000).filter(|&i| mix.class_of(i) == 0).count();
        assert!((2800..3200).contains(&tight), "{tight}");
        assert_eq!(mix.class_of(17), mix.class_of(17));
        for bad in [
            "",
            "0.3",
            "0.3:1000",
            "0.5:1000,0.5:-1",
            "1.5:10",
            "0.5:10,0.5:x",
            "0:1,1:1",
        ] {
            assert!(bad.parse::<SloMix>().is_err(), "{bad}");
        }
    }

    #[test]
    fn attainment_counts_the_unanswered_as_misses() {
        let cfg = SloConfig {
            mix: "1:100".parse().unwrap(),
            routing: SloRouting::Blind,
        };
        assert_eq!(cfg.targets(3), SloTargets::default());
        let headers = SloConfig {
            routing: SloRouting::Headers,
            ..cfg.clone()
        };
        assert_eq!(headers.targets(3).ttft_ms, Some(100.0));
        let mut t = SloTally::default();
        for i in 0..4 {
            t.arrived(Some(&cfg), i);
        }
        t.answered(Some(&cfg), 0, 50.0);
        t.answered(Some(&cfg), 1, 100.0);
        t.answered(Some(&cfg), 2, 150.0);
        let r = t.result(Some(&cfg), 2.0).unwrap();
        assert_eq!((r.classes[0].requests, r.classes[0].met), (4, 2));
        assert_eq!((r.attainment, r.goodput_rps), (0.5, 1.0));
        assert!(!r.routed_on_targets);
        assert!(SloTally::default().result(None, 1.0).is_none());
    }
}
