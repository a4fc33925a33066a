//! Per-request latency targets (SLOs) and the choice among candidates by headroom.
//!
//! A request may name a TTFT target and a TPOT target (time per output token), in
//! milliseconds. Each candidate's **headroom** against them is the target minus the
//! prediction of the rank's latency models ([`crate::policy::predict`]):
//!
//! ```text
//! ttft_headroom_i = ttft_target - predicted TTFT_i        (queueing + own prefill)
//! tpot_headroom_i = tpot_target - predicted step_i        (decode step with the request added)
//! meets_i         = ttft_headroom_i >= 0 and tpot_headroom_i >= 0   (a missing target is met)
//! ```
//!
//! **The choice** ([`choose`]):
//! 1. Some candidates meet every target (the request is **attainable**): the one of them with
//!    the **lowest policy cost** (kv_aware's own choice whenever that one meets the targets);
//!    ties go to the **best fit**, the least TTFT headroom (then the first). The targets are
//!    a filter on the policy's ranking: a TPOT target on the decode load, a TTFT target on
//!    queueing and prefill.
//! 2. None does (the request is **unattainable**): among the candidates that meet the TPOT
//!    target (all of them when none does, or when it has none), the one with the lowest
//!    predicted TTFT (with no TTFT target, the lowest predicted step). The caller routes it
//!    there, or refuses it (`--slo-shed`).
//!
//! Why the lowest cost rather than the best fit (the one that meets the target with the least
//! to spare, llm-d's default `headroomSelectionStrategy: least`): best fit leaves the fast,
//! idle engines to tight targets by packing loose requests onto the engines that still meet
//! them, but a loose target (10 s) is met by nearly every engine, so loose requests left their
//! cached prefixes for the busiest engine and piled up there until its queue neared 10 s.
//! Measured in virtual time on the Mooncake trace (8 engines, 30% of requests at 1 s and 70%
//! at 10 s), best fit took the prefix hit rate from 23% to 6% and attainment from 96% to 89%
//! (x1) and 81% (x2), tight class included (docs/policies.md, "SLO targets"). The lowest cost
//! keeps kv_aware's placement, and moves a request only when that placement is predicted to
//! miss its target; the best fit still breaks ties, so an idle cluster (equal costs) keeps
//! its fastest engine free for the next tight target.
//!
//! The verdict is per target, on the chosen candidate: [`Verdict::Meets`] when it is predicted
//! to meet the target, else [`Verdict::Unattainable`].

/// The targets a request carries (milliseconds; `None`: no target).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SloTargets {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

impl SloTargets {
    /// Whether the request names any target.
    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.tpot_ms.is_some()
    }

    /// The targets one half of a disaggregated request answers for: the prefill half for
    /// the first token (its queue and its prefill; the KV transfer and the decode's first
    /// step are not predicted), the decode half for the time per output token.
    pub fn of_half(self, decode: bool) -> Self {
        if decode {
            Self {
                ttft_ms: None,
                ..self
            }
        } else {
            Self {
                tpot_ms: None,
                ..self
            }
        }
    }
}

/// Which target, as the metrics label it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Slo {
    Ttft,
    Tpot,
}

impl Slo {
    pub fn as_str(self) -> &'static str {
        match self {
            Slo::Ttft => "ttft",
            Slo::Tpot => "tpot",
        }
    }
}

/// What the router predicts for one target on the candidate it chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Predicted to meet it.
    Meets,
    /// No candidate was predicted to meet every target and the chosen one misses this one.
    Unattainable,
}

/// One candidate's predicted latencies, as the choice reads them (ms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Predicted {
    pub ttft_ms: f64,
    /// The decode step with the request running there: its time per output token.
    pub step_ms: f64,
}

impl From<&crate::policy::predict::Prediction> for Predicted {
    fn from(p: &crate::policy::predict::Prediction) -> Self {
        Self {
            ttft_ms: p.ttft_ms,
            step_ms: p.step_ms,
        }
    }
}

/// One candidate's headroom against each target (ms; `None`: no such target).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Headroom {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

impl Headroom {
    fn of(targets: &SloTargets, p: &Predicted) -> Self {
        Self {
            ttft_ms: targets.ttft_ms.map(|t| t - p.ttft_ms),
            tpot_ms: targets.tpot_ms.map(|t| t - p.step_ms),
        }
    }

    fn meets_ttft(&self) -> bool {
        self.ttft_ms.is_none_or(|h| h >= 0.0)
    }

    fn meets_tpot(&self) -> bool {
        self.tpot_ms.is_none_or(|h| h >= 0.0)
    }

    /// Meets every target.
    pub fn meets(&self) -> bool {
        self.meets_ttft() && self.meets_tpot()
    }
}

/// The candidate chosen for a request's targets, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct SloChoice {
    /// Index into the candidates.
    pub index: usize,
    /// The verdict on each target the request has.
    pub ttft: Option<Verdict>,
    pub tpot: Option<Verdict>,
    /// Every candidate's headroom, in the candidates' order.
    pub headroom: Vec<Headroom>,
}

impl SloChoice {
    /// Whether the chosen candidate is predicted to meet every target (when one can, the
    /// choice is one that does).
    pub fn attainable(&self) -> bool {
        self.headroom[self.index].meets()
    }

    /// The verdict on `slo`, when the request has that target.
    pub fn verdict(&self, slo: Slo) -> Option<Verdict> {
        match slo {
            Slo::Ttft => self.ttft,
            Slo::Tpot => self.tpot,
        }
    }
}

/// The candidate for a request with `targets`, from each candidate's predictions and the
/// policy's costs (lower is better; `None`: all equal). `None` when the request has no
/// target or there is no candidate. See the module docs for the rule.
pub fn choose(
    targets: &SloTargets,
    predicted: &[Predicted],
    costs: Option<&[f64]>,
) -> Option<SloChoice> {
    if !targets.is_set() || predicted.is_empty() {
        return None;
    }
    let headroom: Vec<Headroom> = predicted.iter().map(|p| Headroom::of(targets, p)).collect();
    let cost = |i: usize| costs.and_then(|c| c.get(i)).copied().unwrap_or(0.0);
    // The smallest key wins; ties go to the lower cost, then the first.
    let best = |set: &mut dyn Iterator<Item = usize>, key: &dyn Fn(usize) -> f64| {
        set.min_by(|&a, &b| {
            key(a)
                .total_cmp(&key(b))
                .then(cost(a).total_cmp(&cost(b)))
                .then(a.cmp(&b))
        })
    };
    let fit = |i: usize| headroom[i].ttft_ms.unwrap_or(0.0);
    let n = predicted.len();
    let meeting = |i: &usize| headroom[*i].meets();
    let index = if (0..n).any(|i| meeting(&i)) {
        // The lowest cost; ties to the least TTFT headroom (the best fit).
        (0..n).filter(meeting).min_by(|&a, &b| {
            cost(a)
                .total_cmp(&cost(b))
                .then(fit(a).total_cmp(&fit(b)))
                .then(a.cmp(&b))
        })
    } else {
        let tpot_ok = (0..n).any(|i| headroom[i].meets_tpot());
        let mut set = (0..n).filter(|&i| !tpot_ok || headroom[i].meets_tpot());
        match targets.ttft_ms {
            Some(_) => best(&mut set, &|i| predicted[i].ttft_ms),
            None => best(&mut set, &|i| predicted[i].step_ms),
        }
    }
    .expect("a non-empty set");
    let h = headroom[index];
    let verdict = |met: bool| match met {
        true => Verdict::Meets,
        false => Verdict::Unattainable,
    };
    Some(SloChoice {
        index,
        ttft: targets.ttft_ms.map(|_| verdict(h.meets_ttft())),
        tpot: targets.tpot_ms.map(|_| verdict(h.meets_tpot())),
        headroom,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_half_keeps_its_own_target() {
        let both = SloTargets {
            ttft_ms: Some(500.0),
            tpot_ms: Some(40.0),
        };
        assert_eq!(both.of_half(false).ttft_ms, Some(500.0));
        assert_eq!(both.of_half(false).tpot_ms, None);
        assert_eq!(both.of_half(true).ttft_ms, None);
        assert_eq!(both.of_half(true).tpot_ms, Some(40.0));
    }

    fn p(ttft_ms: f64, step_ms: f64) -> Predicted {
        Predicted { ttft_ms, step_ms }
    }

    fn ttft(ms: f64) -> SloTargets {
        SloTargets {
            ttft_ms: Some(ms),
            tpot_ms: None,
        }
    }

    #[test]
    fn no_target_or_no_candidate_leaves_the_choice_to_the_policy() {
        assert_eq!(choose(&SloTargets::default(), &[p(1.0, 1.0)], None), None);
        assert_eq!(choose(&ttft(100.0), &[], None), None);
    }

    #[test]
    fn the_lowest_cost_that_meets_the_target_and_the_best_fit_on_ties() {
        // A middling engine (600 ms), a fast one (100 ms), a slow one (3 s).
        let c = [p(600.0, 10.0), p(100.0, 10.0), p(3000.0, 10.0)];
        // The policy prefers the slow one, then the middling one.
        let costs = [2.0, 3.0, 1.0];
        // Only the fast engine meets a tight target.
        let tight = choose(&ttft(300.0), &c, Some(&costs)).unwrap();
        assert_eq!((tight.index, tight.ttft), (1, Some(Verdict::Meets)));
        assert_eq!(tight.headroom[1].ttft_ms, Some(200.0));
        assert_eq!(tight.headroom[0].ttft_ms, Some(-300.0));
        // 1 s is met by the fast and the middling ones: the cheaper, the middling one.
        assert_eq!(choose(&ttft(1000.0), &c, Some(&costs)).unwrap().index, 0);
        // 10 s is met by all: the policy's own choice.
        let loose = choose(&ttft(10_000.0), &c, Some(&costs)).unwrap();
        assert_eq!(loose.index, 2);
        assert!(loose.attainable());
        // Equal costs (an idle cluster): the best fit leaves the fast engine free.
        assert_eq!(choose(&ttft(10_000.0), &c, None).unwrap().index, 2);
        assert_eq!(choose(&ttft(1000.0), &c, None).unwrap().index, 0);
        assert_eq!(choose(&ttft(300.0), &c, None).unwrap().index, 1);
    }

    #[test]
    fn unattainable_goes_to_the_lowest_predicted_ttft() {
        let c = [p(600.0, 10.0), p(100.0, 10.0), p(3000.0, 10.0)];
        let c = choose(&ttft(50.0), &c, None).unwrap();
        assert_eq!(
            (c.index, c.ttft, c.tpot),
            (1, Some(Verdict::Unattainable), None)
        );
        assert!(!c.attainable());
    }

    #[test]
    fn ties_go_to_the_first() {
        let c = [p(100.0, 10.0), p(100.0, 10.0), p(100.0, 10.0)];
        let costs = [5.0, 3.0, 3.0];
        assert_eq!(choose(&ttft(500.0), &c, Some(&costs)).unwrap().index, 1);
        assert_eq!(choose(&ttft(500.0), &c, None).unwrap().index, 0);
        // Unattainable: the lowest TTFT, then the lower cost.
        assert_eq!(choose(&ttft(50.0), &c, Some(&costs)).unwrap().index, 1);
    }

    #[test]
    fn a_tpot_target_filters_on_the_decode_step() {
        // The fastest TTFT decodes slowly (a busy batch).
        let c = [p(100.0, 80.0), p(400.0, 20.0), p(900.0, 15.0)];
        let both = SloTargets {
            ttft_ms: Some(1000.0),
            tpot_ms: Some(30.0),
        };
        let b = choose(&both, &c, Some(&[1.0, 4.0, 3.0])).unwrap();
        // The cheaper of the two that decode fast enough, though the first is cheaper still.
        assert_eq!(b.index, 2);
        assert_eq!(choose(&both, &c, None).unwrap().index, 2);
        assert_eq!(
            (b.ttft, b.tpot),
            (Some(Verdict::Meets), Some(Verdict::Meets))
        );
        assert_eq!(b.headroom[0].tpot_ms, Some(-50.0));
        // TPOT alone: the lowest cost among those that meet it.
        let tpot = SloTargets {
            ttft_ms: None,
            tpot_ms: Some(30.0),
        };
        let costs = [1.0, 7.0, 5.0];
        assert_eq!(choose(&tpot, &c, Some(&costs)).unwrap().index, 2);
        // TTFT unattainable: the fastest TTFT among those that meet the TPOT target.
        let tight = SloTargets {
            ttft_ms: Some(50.0),
            tpot_ms: Some(30.0),
        };
        let t = choose(&tight, &c, None).unwrap();
        assert_eq!(t.index, 1);
        assert_eq!(
            (t.ttft, t.tpot),
            (Some(Verdict::Unattainable), Some(Verdict::Meets))
        );
        // Both unattainable: the fastest TTFT of all.
        let none = SloTargets {
            ttft_ms: Some(50.0),
            tpot_ms: Some(5.0),
        };
        let n = choose(&none, &c, None).unwrap();
        assert_eq!(n.index, 0);
        assert_eq!(n.tpot, Some(Verdict::Unattainable));
        // TPOT alone, unattainable: the fastest step.
        let tpot = SloTargets {
            ttft_ms: None,
            tpot_ms: Some(5.0),
        };
        assert_eq!(choose(&tpot, &c, None).unwrap().index, 2);
    }
}
