//! Which (worker, rank) pairs may take a request at all, before any policy scores them.
//!
//! One function, [`eligible`], used alike by selection, pin validation and queue admission.
//! The filters run in this order, and the first that leaves nothing decides the error:
//!
//! 1. **allow-list** (`x-kvroute-allowed-workers`): only the listed workers; a pinned worker
//!    must be listed too, else the pin is invalid;
//! 2. **pin** (`x-kvroute-worker`, `x-kvroute-dp-rank`): the worker must exist and own the
//!    rank, else [`Ineligible::InvalidPin`];
//! 3. **dp-rank bounds**: an unpinned worker expands into exactly its ranks;
//! 4. **health** and **required taints** (`x-kvroute-required-taints`): a worker missing one
//!    is out. Nothing left here is [`Ineligible::NoEndpoint`];
//! 5. **context length**: where the request's context is known (`Hints::context_tokens`),
//!    an unpinned worker whose engine says it takes less (`max_model_len`) is out, unless
//!    that leaves none: then every worker stays, and the engine answers with its own error
//!    (the router's token count may differ from the engine's; nothing is refused here);
//! 6. **overload** (the busy thresholds, per rank): overloaded ranks are out; a worker is out
//!    only when all its ranks are. Compatible ranks that are all overloaded are
//!    [`Ineligible::AllOverloaded`] — or [`Ineligible::PinnedOverloaded`] for a pin, which
//!    is never rerouted.

use std::collections::HashSet;

/// A worker as eligibility sees it.
#[derive(Debug, Clone, Copy)]
pub struct WorkerView<'a> {
    pub id: &'a str,
    /// Its data-parallel ranks (`[None]` without ranks).
    pub ranks: &'a [Option<u32>],
    /// For each rank, whether its busy thresholds say it is overloaded.
    pub overloaded: &'a [bool],
    pub healthy: bool,
    pub taints: &'a [String],
    /// The longest context (prompt plus answer, in tokens) its engine takes, when known.
    pub max_model_len: Option<u64>,
}

/// The routing hints of one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hints {
    pub allowed_workers: Option<HashSet<String>>,
    pub pinned_worker: Option<String>,
    pub pinned_rank: Option<u32>,
    pub required_taints: Vec<String>,
    /// Taint and weight (1 when not given).
    pub preferred_taints: Vec<(String, f64)>,
    /// The request's latency targets (read by the choice, not by eligibility: see
    /// [`crate::slo`]).
    pub slo: crate::slo::SloTargets,
    /// The context the request needs on an engine, in tokens (its prompt as the router
    /// counted it, plus its `max_tokens`, at least 1): set by routing, not by a header.
    pub context_tokens: Option<u64>,
}

impl Hints {
    /// The summed weights of the preferred taints `taints` has.
    pub fn preferred_weight(&self, taints: &[String]) -> f64 {
        self.preferred_taints
            .iter()
            .filter(|(t, _)| taints.iter().any(|x| x == t))
            .map(|(_, w)| w)
            .sum()
    }
}

/// Why no (worker, rank) may take the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ineligible {
    InvalidPin(String),
    NoEndpoint,
    AllOverloaded,
    PinnedOverloaded,
}

/// Step 5's rule: keeps the items a request's context `fits`, unless it fits none, when
/// every item stays (the engine then answers with its own error). Shared with the simulator.
pub fn retain_fitting<T>(items: &mut Vec<T>, fits: impl Fn(&T) -> bool) {
    if items.iter().any(&fits) {
        items.retain(fits);
    }
}

/// The eligible (worker index, rank index) pairs, in the order of `workers` and their ranks.
pub fn eligible(
    workers: &[WorkerView<'_>],
    hints: &Hints,
) -> Result<Vec<(usize, usize)>, Ineligible> {
    if let (Some(pin), Some(allowed)) = (&hints.pinned_worker, &hints.allowed_workers) {
        if !allowed.contains(pin) {
            return Err(Ineligible::InvalidPin(format!(
                "pinned worker '{pin}' is not in the allowed workers"
            )));
        }
    }
    if hints.pinned_rank.is_some() && hints.pinned_worker.is_none() {
        return Err(Ineligible::InvalidPin(
            "a dp rank pin needs a pinned worker".to_owned(),
        ));
    }
    let mut compatible = Vec::new();
    for (w, view) in workers.iter().enumerate() {
        if let Some(allowed) = &hints.allowed_workers {
            if !allowed.contains(view.id) {
                continue;
            }
        }
        if let Some(pin) = &hints.pinned_worker {
            if view.id != pin {
                continue;
            }
            if let Some(rank) = hints.pinned_rank {
                if !view.ranks.contains(&Some(rank)) {
                    return Err(Ineligible::InvalidPin(format!(
                        "worker '{pin}' does not own dp rank {rank}"
                    )));
                }
            }
        }
        if !view.healthy {
            continue;
        }
        if !hints
            .required_taints
            .iter()
            .all(|t| view.taints.iter().any(|x| x == t))
        {
            continue;
        }
        for (r, rank) in view.ranks.iter().enumerate() {
            if let (Some(pinned), Some(_)) = (hints.pinned_rank, hints.pinned_worker.as_ref()) {
                if *rank != Some(pinned) {
                    continue;
                }
            }
            compatible.push((w, r));
        }
    }
    if let Some(pin) = &hints.pinned_worker {
        if !workers.iter().any(|v| v.id == pin) {
            return Err(Ineligible::InvalidPin(format!("no worker '{pin}'")));
        }
    }
    if compatible.is_empty() {
        return Err(Ineligible::NoEndpoint);
    }
    if let (Some(need), None) = (hints.context_tokens, &hints.pinned_worker) {
        let fits = |&(w, _): &(usize, usize)| workers[w].max_model_len.is_none_or(|n| need <= n);
        retain_fitting(&mut compatible, fits);
    }
    let free: Vec<(usize, usize)> = compatible
        .iter()
        .copied()
        .filter(|&(w, r)| !workers[w].overloaded.get(r).copied().unwrap_or(false))
        .collect();
    if free.is_empty() {
        return Err(if hints.pinned_worker.is_some() {
            Ineligible::PinnedOverloaded
        } else {
            Ineligible::AllOverloaded
        });
    }
    Ok(free)
}

/// Busy thresholds of one model (Dynamo's): a rank is overloaded when any is exceeded.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BusyThresholds {
    /// Active prefill tokens above this.
    pub active_prefill_tokens: Option<u64>,
    /// Active prefill tokens above this fraction of the engine's `max_num_batched_tokens`.
    pub active_prefill_tokens_frac: Option<f64>,
    /// Active decode blocks (or the engine's KV blocks in use) above this fraction of its
    /// total blocks, in [0, 1].
    pub active_decode_blocks: Option<f64>,
}

/// What the thresholds read of one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankPressure {
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    /// The engine's reported KV usage in [0, 1], when known.
    pub engine_kv_usage: Option<f64>,
    pub num_gpu_blocks: Option<u64>,
    pub max_num_batched_tokens: Option<u64>,
}

impl BusyThresholds {
    /// Whether the rank is overloaded. `latched` is the decode threshold's previous verdict:
    /// once exceeded, it clears only when both the router's decode blocks and the engine's
    /// KV use are back under.
    pub fn overloaded(&self, p: &RankPressure, latched: &mut bool) -> bool {
        let prefill = self
            .active_prefill_tokens
            .is_some_and(|n| p.prefill_tokens > n);
        let frac = match (self.active_prefill_tokens_frac, p.max_num_batched_tokens) {
            (Some(f), Some(budget)) => p.prefill_tokens as f64 > f * budget as f64,
            _ => false,
        };
        let decode = match (self.active_decode_blocks, p.num_gpu_blocks) {
            (Some(f), Some(total)) => {
                let router = p.decode_blocks as f64 > f * total as f64;
                let engine = p.engine_kv_usage.is_some_and(|u| u > f);
                if router || engine {
                    *latched = true;
                } else if *latched {
                    *latched = false;
                }
                *latched
            }
            _ => {
                *latched = false;
                false
            }
        };
        prefill || frac || decode
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<'a>(
        id: &'a str,
        ranks: &'a [Option<u32>],
        overloaded: &'a [bool],
        taints: &'a [String],
    ) -> WorkerView<'a> {
        WorkerView {
            id,
            ranks,
            overloaded,
            healthy: true,
            taints,
            max_model_len: None,
        }
    }

    #[test]
    fn the_filters_in_order() {
        let none: Vec<String> = vec![];
        let gpu = vec!["gpu".to_string()];
        let ranks = [Some(0), Some(1)];
        let single = [None];
        let w = [
            view("a", &single, &[false], &none),
            view("b", &ranks, &[false, false], &gpu),
        ];
        assert_eq!(
            eligible(&w, &Hints::default()).unwrap(),
            vec![(0, 0), (1, 0), (1, 1)]
        );
        // Allow-list.
        let h = Hints {
            allowed_workers: Some(["b".to_string()].into()),
            ..Hints::default()
        };
        assert_eq!(eligible(&w, &h).unwrap(), vec![(1, 0), (1, 1)]);
        // Pin: worker, rank; unknown worker, rank not owned, pin outside the allow-list.
        let h = Hints {
            pinned_worker: Some("b".into()),
            pinned_rank: Some(1),
            ..Hints::default()
        };
        assert_eq!(eligible(&w, &h).unwrap(), vec![(1, 1)]);
        let h = Hints {
            pinned_worker: Some("z".into()),
            ..Hints::default()
        };
        assert!(matches!(eligible(&w, &h), Err(Ineligible::InvalidPin(_))));
        let h = Hints {
            pinned_worker: Some("b".into()),
            pinned_rank: Some(7),
            ..Hints::default()
        };
        assert!(matches!(eligible(&w, &h), Err(Ineligible::InvalidPin(_))));
        let h = Hints {
            pinned_worker: Some("a".into()),
            allowed_workers: Some(["b".to_string()].into()),
            ..Hints::default()
        };
        assert!(matches!(eligible(&w, &h), Err(Ineligible::InvalidPin(_))));
        // Required taints.
        let h = Hints {
            required_taints: vec!["gpu".into()],
            ..Hints::default()
        };
        assert_eq!(eligible(&w, &h).unwrap(), vec![(1, 0), (1, 1)]);
        let h = Hints {
            required_taints: vec!["tpu".into()],
            ..Hints::default()
        };
        assert_eq!(eligible(&w, &h), Err(Ineligible::NoEndpoint));
    }

    #[test]
    fn a_request_goes_where_its_context_fits_unless_it_fits_nowhere() {
        let none: &[String] = &[];
        let ranks = &[Some(0), Some(1)];
        let single = &[None];
        fn with(v: WorkerView<'_>, n: Option<u64>) -> WorkerView<'_> {
            WorkerView {
                max_model_len: n,
                ..v
            }
        }
        let w = [
            with(view("small", single, &[false], none), Some(4096)),
            with(view("large", ranks, &[false, false], none), Some(32768)),
            with(view("unknown", single, &[false], none), None),
        ];
        let need = |n: u64| Hints {
            context_tokens: Some(n),
            ..Hints::default()
        };
        let all = vec![(0, 0), (1, 0), (1, 1), (2, 0)];
        assert_eq!(eligible(&w, &Hints::default()).unwrap(), all);
        // Exactly the context fits; one token more does not (an engine that does not say
        // is never filtered out).
        assert_eq!(eligible(&w, &need(4096)).unwrap(), all);
        assert_eq!(
            eligible(&w, &need(4097)).unwrap(),
            vec![(1, 0), (1, 1), (2, 0)]
        );
        // Fits nowhere known: the unknown engine only; with it gone too, every worker stays.
        assert_eq!(eligible(&w, &need(40_000)).unwrap(), vec![(2, 0)]);
        assert_eq!(
            eligible(&w[..2], &need(40_000)).unwrap(),
            vec![(0, 0), (1, 0), (1, 1)]
        );
        // A pin is kept whatever it takes; overload still applies after the filter.
        let pinned = Hints {
            pinned_worker: Some("small".into()),
            ..need(8192)
        };
        assert_eq!(eligible(&w, &pinned).unwrap(), vec![(0, 0)]);
        let busy = [
            w[0],
            with(view("large", ranks, &[true, true], none), Some(32768)),
        ];
        assert_eq!(eligible(&busy, &need(8192)), Err(Ineligible::AllOverloaded));
    }

    #[test]
    fn overload_classes() {
        let none: Vec<String> = vec![];
        let ranks = [Some(0), Some(1)];
        let single = [None];
        let w = [
            view("a", &single, &[true], &none),
            view("b", &ranks, &[true, false], &none),
        ];
        // A worker is out only when all its ranks are.
        assert_eq!(eligible(&w, &Hints::default()).unwrap(), vec![(1, 1)]);
        let all = [
            view("a", &single, &[true], &none),
            view("b", &ranks, &[true, true], &none),
        ];
        assert_eq!(
            eligible(&all, &Hints::default()),
            Err(Ineligible::AllOverloaded)
        );
        let h = Hints {
            pinned_worker: Some("a".into()),
            ..Hints::default()
        };
        assert_eq!(eligible(&w, &h), Err(Ineligible::PinnedOverloaded));
        // Health comes before overload: nothing healthy is no_endpoint.
        let sick = [WorkerView {
            healthy: false,
            ..view("a", &single, &[true], &none)
        }];
        assert_eq!(
            eligible(&sick, &Hints::default()),
            Err(Ineligible::NoEndpoint)
        );
    }

    #[test]
    fn thresholds_and_the_decode_latch() {
        let t = BusyThresholds {
            active_prefill_tokens: Some(1000),
            active_prefill_tokens_frac: Some(0.5),
            active_decode_blocks: Some(0.8),
        };
        let mut latch = false;
        let p = RankPressure {
            prefill_tokens: 900,
            max_num_batched_tokens: Some(8192),
            num_gpu_blocks: Some(100),
            ..Default::default()
        };
        assert!(!t.overloaded(&p, &mut latch));
        assert!(t.overloaded(
            &RankPressure {
                prefill_tokens: 1001,
                ..p
            },
            &mut latch
        ));
        let frac = BusyThresholds {
            active_prefill_tokens_frac: Some(0.1),
            ..Default::default()
        };
        assert!(frac.overloaded(&p, &mut latch), "900 > 0.1 * 8192");
        assert!(
            !frac.overloaded(
                &RankPressure {
                    max_num_batched_tokens: None,
                    ..p
                },
                &mut latch
            ),
            "unknown budget: skipped"
        );
        // Decode: set by either signal, cleared only when both are back under.
        let d = BusyThresholds {
            active_decode_blocks: Some(0.8),
            ..Default::default()
        };
        let mut latch = false;
        let base = RankPressure {
            num_gpu_blocks: Some(100),
            ..Default::default()
        };
        assert!(!d.overloaded(
            &RankPressure {
                decode_blocks: 80,
                ..base
            },
            &mut latch
        ));
        assert!(d.overloaded(
            &RankPressure {
                decode_blocks: 81,
                ..base
            },
            &mut latch
        ));
        assert!(d.overloaded(
            &RankPressure {
                decode_blocks: 10,
                engine_kv_usage: Some(0.9),
                ..base
            },
            &mut latch
        ));
        assert!(!d.overloaded(
            &RankPressure {
                decode_blocks: 10,
                engine_kv_usage: Some(0.5),
                ..base
            },
            &mut latch
        ));
        assert!(d.overloaded(
            &RankPressure {
                engine_kv_usage: Some(0.95),
                ..base
            },
            &mut latch
        ));
    }

    #[test]
    fn preferred_weights_sum_what_the_worker_has() {
        let h = Hints {
            preferred_taints: vec![("a".into(), 0.5), ("b".into(), 1.0), ("c".into(), 2.0)],
            ..Hints::default()
        };
        assert_eq!(h.preferred_weight(&["a".into(), "c".into()]), 2.5);
        assert_eq!(h.preferred_weight(&[]), 0.0);
    }
}
