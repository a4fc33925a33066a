//! Worker overload protection as smg does it: a worker whose engine reports too many
//! waiting requests or too full a KV cache is passed over while another is not.
//!
//! A worker is **overloaded** when either holds (both inclusive, as smg):
//!
//! - its engine's waiting requests, summed over its data-parallel ranks, are at least
//!   `waiting_requests` (`vllm:num_requests_waiting`);
//! - its engine's KV usage, the mean over the ranks that report it, is at least
//!   `token_usage` (`vllm:kv_cache_usage_perc`, in [0, 1]).
//!
//! A worker whose engine reports neither is never overloaded. When every worker is, the
//! request goes to the one with the fewest requests in flight through the router (ties at
//! random), or, with `shed`, is refused.
//!
//! This is separate from the busy thresholds of [`crate::eligibility`] (Dynamo's), which read
//! the router's own load accounting per rank and refuse when every rank is busy.

use rand::RngCore;

use crate::policy::least_at_random;

/// The thresholds; protection is off when both are `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OverloadProtection {
    pub waiting_requests: Option<u64>,
    pub token_usage: Option<f64>,
    /// Refuse when every worker is overloaded, instead of using the least loaded.
    pub shed: bool,
}

/// smg's thresholds, for `--worker-overload-protection` alone.
pub const SMG_WAITING_REQUESTS: u64 = 8;
pub const SMG_TOKEN_USAGE: f64 = 0.8;

/// What the engine of one worker reports, over all its ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkerPressure {
    /// Waiting requests summed over the ranks that report them (`None`: none does).
    pub waiting: Option<f64>,
    /// The mean KV usage of the ranks that report it (`None`: none does).
    pub kv_usage: Option<f64>,
    /// Requests in flight through the router, over all ranks.
    pub in_flight: u64,
}

/// Accumulates a [`WorkerPressure`] over a worker's ranks.
#[derive(Debug, Clone, Copy, Default)]
pub struct PressureSum {
    waiting: Option<f64>,
    kv_sum: f64,
    kv_ranks: u32,
    in_flight: u64,
}

impl PressureSum {
    /// Folds one rank's report in.
    pub fn add_rank(&mut self, waiting: Option<f64>, kv_usage: Option<f64>, in_flight: u64) {
        if let Some(w) = waiting {
            *self.waiting.get_or_insert(0.0) += w;
        }
        if let Some(u) = kv_usage {
            self.kv_sum += u;
            self.kv_ranks += 1;
        }
        self.in_flight += in_flight;
    }

    pub fn finish(self) -> WorkerPressure {
        WorkerPressure {
            waiting: self.waiting,
            kv_usage: (self.kv_ranks > 0).then(|| self.kv_sum / f64::from(self.kv_ranks)),
            in_flight: self.in_flight,
        }
    }
}

/// The verdict over a request's workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Protected {
    /// These workers (indexes into the slice given) may take the request.
    Keep(Vec<usize>),
    /// Every worker is overloaded and `shed` is set.
    Shed,
}

impl OverloadProtection {
    pub fn is_on(&self) -> bool {
        self.waiting_requests.is_some() || self.token_usage.is_some()
    }

    /// Whether a worker with this pressure is overloaded.
    pub fn overloaded(&self, p: &WorkerPressure) -> bool {
        let waiting = match (self.waiting_requests, p.waiting) {
            (Some(limit), Some(w)) => w >= limit as f64,
            _ => false,
        };
        let usage = match (self.token_usage, p.kv_usage) {
            (Some(limit), Some(u)) => u >= limit,
            _ => false,
        };
        waiting || usage
    }

    /// The workers that may take a request: those not overloaded; when every one is, the
    /// least loaded (by requests in flight, ties at random) or [`Protected::Shed`]. With
    /// protection off, or no worker, all of them.
    pub fn protect(&self, workers: &[WorkerPressure], rng: &mut dyn RngCore) -> Protected {
        if !self.is_on() || workers.is_empty() {
            return Protected::Keep((0..workers.len()).collect());
        }
        let free: Vec<usize> = (0..workers.len())
            .filter(|&i| !self.overloaded(&workers[i]))
            .collect();
        if !free.is_empty() {
            return Protected::Keep(free);
        }
        if self.shed {
            return Protected::Shed;
        }
        let least = least_at_random(workers.iter().map(|w| w.in_flight), rng);
        Protected::Keep(least.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    use super::*;

    fn p(waiting: Option<f64>, kv: Option<f64>, in_flight: u64) -> WorkerPressure {
        WorkerPressure {
            waiting,
            kv_usage: kv,
            in_flight,
        }
    }

    const SMG: OverloadProtection = OverloadProtection {
        waiting_requests: Some(SMG_WAITING_REQUESTS),
        token_usage: Some(SMG_TOKEN_USAGE),
        shed: false,
    };

    #[test]
    fn both_thresholds_are_inclusive_and_unknown_is_never_overloaded() {
        assert!(SMG.overloaded(&p(Some(8.0), None, 0)));
        assert!(!SMG.overloaded(&p(Some(7.0), None, 0)));
        assert!(SMG.overloaded(&p(None, Some(0.8), 0)));
        assert!(!SMG.overloaded(&p(None, Some(0.79), 0)));
        assert!(!SMG.overloaded(&p(None, None, 1000)));
        let waiting_only = OverloadProtection {
            token_usage: None,
            ..SMG
        };
        assert!(!waiting_only.overloaded(&p(Some(1.0), Some(1.0), 0)));
    }

    #[test]
    fn ranks_sum_waiting_and_average_usage() {
        let mut s = PressureSum::default();
        s.add_rank(Some(5.0), Some(0.9), 2);
        s.add_rank(Some(4.0), Some(0.5), 1);
        s.add_rank(None, None, 0);
        let w = s.finish();
        assert_eq!(w.waiting, Some(9.0));
        assert!((w.kv_usage.unwrap() - 0.7).abs() < 1e-12);
        assert_eq!(w.in_flight, 3);
        // 9 waiting over the ranks is over 8, though no rank is alone.
        assert!(SMG.overloaded(&w));
        assert_eq!(PressureSum::default().finish(), WorkerPressure::default());
    }

    #[test]
    fn overloaded_workers_are_passed_over_while_one_is_free() {
        let mut rng = SmallRng::seed_from_u64(1);
        let workers = [
            p(Some(9.0), Some(0.1), 0),
            p(Some(0.0), Some(0.2), 50),
            p(Some(1.0), Some(0.95), 0),
            p(None, None, 7),
        ];
        assert_eq!(SMG.protect(&workers, &mut rng), Protected::Keep(vec![1, 3]));
    }

    #[test]
    fn all_overloaded_goes_to_the_least_in_flight_or_sheds() {
        let mut rng = SmallRng::seed_from_u64(2);
        let workers = [
            p(Some(9.0), None, 4),
            p(Some(20.0), None, 2),
            p(None, Some(0.9), 3),
        ];
        assert_eq!(SMG.protect(&workers, &mut rng), Protected::Keep(vec![1]));
        let shed = OverloadProtection { shed: true, ..SMG };
        assert_eq!(shed.protect(&workers, &mut rng), Protected::Shed);
        // Ties spread.
        let tied = [p(Some(9.0), None, 1), p(Some(9.0), None, 1)];
        let mut seen = [0; 2];
        for _ in 0..200 {
            let Protected::Keep(k) = SMG.protect(&tied, &mut rng) else {
                panic!("shed without shed")
            };
            seen[k[0]] += 1;
        }
        assert!(seen[0] > 50 && seen[1] > 50, "{seen:?}");
    }

    #[test]
    fn off_keeps_everything() {
        let mut rng = SmallRng::seed_from_u64(3);
        let off = OverloadProtection::default();
        assert!(!off.is_on());
        let workers = [p(Some(100.0), Some(1.0), 0), p(Some(100.0), Some(1.0), 0)];
        assert_eq!(off.protect(&workers, &mut rng), Protected::Keep(vec![0, 1]));
        assert_eq!(SMG.protect(&[], &mut rng), Protected::Keep(vec![]));
    }
}
