//! `least_load` (smg's): the candidate with the shortest expected wait, and `passthrough`
//! (smg's): the first candidate, for a gateway in front of one engine.
//!
//! A candidate whose engine reports its load (its `/metrics`, scraped by the gateway) scores
//!
//! ```text
//! wait = (waiting x mean_prefill + unseen x mean_prefill) / throughput
//!        + kv_pressure_weight x k / (1 - k)
//! ```
//!
//! - `waiting`: the engine's waiting requests (`vllm:num_requests_waiting`);
//! - `unseen`: requests the router has in flight there that the engine does not report yet,
//!   `in_flight - (running + waiting)` floored at 0. smg counts the requests sent since the
//!   last load poll; kvroute's polls come every `--metrics-refresh-ms`, and this difference
//!   stands for them without keeping per-poll state;
//! - `mean_prefill`: `--least-load-mean-prefill-tokens`, each request's assumed prefill
//!   (vLLM's `/metrics` gives no waiting-token count, so smg uses the same mean for it);
//! - `throughput`: `--least-load-default-throughput` tokens per second (vLLM reports no
//!   generation throughput gauge; smg falls back to the same default);
//! - `k`: the engine's KV usage, clamped to [0, 0.999], weighted in seconds by
//!   `--least-load-kv-pressure-weight`.
//!
//! A candidate without a report while others have one scores
//! `in_flight x mean_prefill / throughput`. When no candidate has a report, the policy is
//! join-the-shortest-queue on the router's in-flight counts. The lowest score wins; exact
//! ties are broken at random. With `--least-load-max-waiting-requests N` (> 0), a reported
//! candidate whose `waiting + unseen` reaches N is skipped; when every candidate is skipped
//! the policy chooses none.

use rand::RngCore;

use super::{least_at_random, Policy, PolicyKind};
use crate::{Candidate, Decision, RouteRequest};

/// `least_load`'s parameters (smg's names and defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct LeastLoadConfig {
    /// Seconds added per unit of `k / (1 - k)` of KV usage.
    pub kv_pressure_weight: f64,
    /// Tokens per second an engine is assumed to prefill.
    pub default_throughput: f64,
    /// Prefill tokens assumed per request.
    pub mean_prefill_tokens: u64,
    /// Skip a candidate with this many waiting requests; 0: never.
    pub max_waiting_requests: u64,
}

impl Default for LeastLoadConfig {
    fn default() -> Self {
        Self {
            kv_pressure_weight: 0.15,
            default_throughput: 2000.0,
            mean_prefill_tokens: 1024,
            max_waiting_requests: 0,
        }
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct LeastLoad {
    config: LeastLoadConfig,
}

impl LeastLoad {
    pub fn new(config: LeastLoadConfig) -> Self {
        Self { config }
    }

    /// Requests routed there that the engine's report does not show yet.
    fn unseen(c: &Candidate<'_>) -> f64 {
        let seen = c.engine.running.unwrap_or(0.0) + c.engine.waiting.unwrap_or(0.0);
        (c.in_flight as f64 - seen).max(0.0)
    }

    /// Each candidate's expected wait in seconds (`None`: skipped by the waiting cap).
    pub fn scores(&self, candidates: &[Candidate<'_>]) -> Vec<Option<f64>> {
        let cfg = &self.config;
        let reported = |c: &Candidate<'_>| c.engine.waiting.is_some();
        if !candidates.iter().any(reported) {
            return candidates
                .iter()
                .map(|c| Some(c.in_flight as f64))
                .collect();
        }
        let mean = cfg.mean_prefill_tokens as f64;
        let throughput = cfg.default_throughput;
        candidates
            .iter()
            .map(|c| {
                let Some(waiting) = c.engine.waiting else {
                    return Some(c.in_flight as f64 * mean / throughput);
                };
                let unseen = Self::unseen(c);
                if cfg.max_waiting_requests > 0
                    && waiting + unseen >= cfg.max_waiting_requests as f64
                {
                    return None;
                }
                let k = c.engine.kv_usage.unwrap_or(0.0).clamp(0.0, 0.999);
                Some(
                    (waiting + unseen) * mean / throughput + cfg.kv_pressure_weight * k / (1.0 - k),
                )
            })
            .collect()
    }
}

impl Policy for LeastLoad {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LeastLoad
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        _: &RouteRequest<'_>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let scores = self.scores(candidates);
        // Skipped candidates score infinity: chosen only when every one is skipped, which
        // chooses none.
        let keys = scores.iter().map(|s| s.unwrap_or(f64::INFINITY));
        let index = least_at_random(keys, rng)?;
        scores[index].map(|_| Decision { index })
    }

    fn costs(&self, candidates: &[Candidate<'_>], _: &RouteRequest<'_>) -> Option<Vec<f64>> {
        Some(
            self.scores(candidates)
                .into_iter()
                .map(|s| s.unwrap_or(f64::INFINITY))
                .collect(),
        )
    }
}

/// The first candidate: a gateway in front of one engine (with several, the first
/// eligible in the pool's order takes everything).
#[derive(Debug, Default)]
pub struct Passthrough;

impl Policy for Passthrough {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Passthrough
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        _: &RouteRequest<'_>,
        _: &mut dyn RngCore,
    ) -> Option<Decision> {
        (!candidates.is_empty()).then_some(Decision { index: 0 })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    use super::*;
    use crate::policy::test_support::{cands, ids, req};
    use crate::EngineLoad;

    fn engine(waiting: f64, running: f64, kv: f64) -> EngineLoad {
        EngineLoad {
            waiting: Some(waiting),
            running: Some(running),
            kv_usage: Some(kv),
            num_gpu_blocks: None,
        }
    }

    #[test]
    fn the_score_follows_the_formula() {
        let ids = ids(3);
        let mut c = cands(&ids, &[0, 5, 3]);
        c[0].engine = engine(2.0, 1.0, 0.5);
        // 5 in flight, 3 shown: 2 unseen.
        c[1].engine = engine(0.0, 3.0, 0.0);
        // Not reported while others are.
        let policy = LeastLoad::new(LeastLoadConfig::default());
        let s = policy.scores(&c);
        let expect0 = 2.0 * 1024.0 / 2000.0 + 0.15 * 0.5 / 0.5;
        assert!((s[0].unwrap() - expect0).abs() < 1e-12, "{s:?}");
        assert!((s[1].unwrap() - 2.0 * 1024.0 / 2000.0).abs() < 1e-12);
        assert!((s[2].unwrap() - 3.0 * 1024.0 / 2000.0).abs() < 1e-12);
        // A full cache is clamped, not infinite.
        c[0].engine = engine(0.0, 0.0, 1.0);
        assert!(policy.scores(&c)[0].unwrap().is_finite());
    }

    #[test]
    fn the_shortest_expected_wait_wins_and_kv_pressure_counts() {
        let ids = ids(3);
        let mut c = cands(&ids, &[1, 1, 1]);
        c[0].engine = engine(4.0, 1.0, 0.1);
        c[1].engine = engine(1.0, 1.0, 0.95);
        c[2].engine = engine(2.0, 1.0, 0.1);
        let policy = LeastLoad::new(LeastLoadConfig::default());
        let mut rng = SmallRng::seed_from_u64(1);
        let r = req(None, "", Instant::now());
        // 1 waiting but 95% full costs 0.51 + 2.85 s; 2 waiting at 10% costs 1.02 + 0.017.
        assert_eq!(policy.select(&c, &r, &mut rng).unwrap().index, 2);
        let no_pressure = LeastLoad::new(LeastLoadConfig {
            kv_pressure_weight: 0.0,
            ..LeastLoadConfig::default()
        });
        assert_eq!(no_pressure.select(&c, &r, &mut rng).unwrap().index, 1);
    }

    #[test]
    fn without_reports_it_joins_the_shortest_queue_with_random_ties() {
        let ids = ids(3);
        let c = cands(&ids, &[2, 1, 1]);
        let policy = LeastLoad::new(LeastLoadConfig::default());
        let mut rng = SmallRng::seed_from_u64(2);
        let r = req(None, "", Instant::now());
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[policy.select(&c, &r, &mut rng).unwrap().index] += 1;
        }
        assert_eq!(seen[0], 0);
        assert!(seen[1] > 100 && seen[2] > 100, "{seen:?}");
    }

    #[test]
    fn the_waiting_cap_skips_and_can_leave_none() {
        let ids = ids(2);
        let mut c = cands(&ids, &[3, 0]);
        c[0].engine = engine(1.0, 0.0, 0.0); // 1 waiting + 2 unseen = 3
        c[1].engine = engine(2.0, 0.0, 0.0);
        let policy = LeastLoad::new(LeastLoadConfig {
            max_waiting_requests: 3,
            ..LeastLoadConfig::default()
        });
        let mut rng = SmallRng::seed_from_u64(3);
        let r = req(None, "", Instant::now());
        assert_eq!(policy.scores(&c)[0], None);
        assert_eq!(policy.select(&c, &r, &mut rng).unwrap().index, 1);
        c[1].engine = engine(3.0, 0.0, 0.0);
        assert_eq!(policy.select(&c, &r, &mut rng), None);
        let costs = policy.costs(&c, &r).unwrap();
        assert!(costs.iter().all(|c| c.is_infinite()));
    }

    #[test]
    fn passthrough_takes_the_first() {
        let ids = ids(3);
        let c = cands(&ids, &[9, 0, 0]);
        let mut rng = SmallRng::seed_from_u64(4);
        let r = req(None, "", Instant::now());
        assert_eq!(Passthrough.select(&c, &r, &mut rng).unwrap().index, 0);
        assert_eq!(Passthrough.select(&[], &r, &mut rng), None);
    }
}
