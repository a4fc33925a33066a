//! `kv_aware`: NVIDIA Dynamo's KV router cost model. Lower cost wins.
//!
//! For a request of `ISL` prompt tokens in blocks of `B` tokens, each candidate
//! (worker, rank) costs
//!
//! ```text
//! credit = overlap_score_credit * device + host_cache_hit_weight * host
//!        + disk_cache_hit_weight * disk + shared_cache_multiplier * external
//! cost   = prefill_load_scale * max(0, (P + ISL) / B - credit)
//!        + (decode_blocks + min(new_blocks, ceil(ISL / B) - device))
//!        + decode_active_request_weight * active_requests
//! ```
//!
//! where `device`, `host`, `disk`, `external` are the leading blocks of the prompt the
//! candidate holds in each tier, `P` the prompt tokens routed there that have not produced
//! a first token, `decode_blocks` the distinct blocks of its requests still generating and
//! `new_blocks` the request's blocks not already among them. When the request names
//! preferred taints, the cost is multiplied by `exp(-tanh(w))`, `w` the summed weights of
//! those the worker has. Exact ties are broken uniformly at random. With `temperature > 0`
//! the choice is sampled from `softmax(-(cost - min) / ((max - min) * temperature))`.
//!
//! The two terms estimate what the request adds to the rank: compute (the prefill term:
//! the work queued ahead of it plus its own uncached prompt) and KV memory (the load term:
//! the blocks its active requests hold plus the blocks this request would add). A block is
//! added only if the rank does not already hold it, either for another active request (a
//! shared prefix) or in its device prefix cache (`device`): a prefix-cache hit pins a block
//! that is already resident instead of allocating, filling and later evicting a copy. So
//! `min(new_blocks, ceil(ISL / B) - device)` (the two sets are both leading runs of the
//! prompt's hash chain, so the resident blocks are the longer of the two). Counting the
//! cached prefix as new memory, as Dynamo's formula does, charges the warm rank for memory
//! it does not spend; on decode-heavy traffic, where the ranks' `decode_blocks` differ by
//! more than a whole prompt, it made the load term drown the overlap and spread
//! conversations over every rank (half the prefix reuse of `cache_aware` on multi-turn
//! chats). Host, disk and external hits still allocate device blocks and are counted.

use rand::{Rng, RngCore};

use super::{Policy, PolicyKind};
use crate::{Candidate, Decision, RouteRequest};

/// The cost model's weights (Dynamo's flags and defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct KvAwareConfig {
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    pub decode_active_request_weight: f64,
    pub temperature: f64,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub shared_cache_multiplier: f64,
}

impl Default for KvAwareConfig {
    fn default() -> Self {
        Self {
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            decode_active_request_weight: 0.0,
            temperature: 0.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            shared_cache_multiplier: 0.0,
        }
    }
}

/// The `kv_aware` policy.
#[derive(Clone, Default)]
pub struct KvAware {
    pub config: KvAwareConfig,
}

impl std::fmt::Debug for KvAware {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let k = &self.config;
        f.debug_struct("KvAware")
            .field("overlap_score_credit", &k.overlap_score_credit)
            .field("prefill_load_scale", &k.prefill_load_scale)
            .field(
                "decode_active_request_weight",
                &k.decode_active_request_weight,
            )
            .field("temperature", &k.temperature)
            .field("host_cache_hit_weight", &k.host_cache_hit_weight)
            .field("disk_cache_hit_weight", &k.disk_cache_hit_weight)
            .field("shared_cache_multiplier", &k.shared_cache_multiplier)
            .finish()
    }
}

impl KvAware {
    pub fn new(config: KvAwareConfig) -> Self {
        Self { config }
    }

    /// The cost of one candidate (see the module docs).
    pub fn cost(&self, c: &Candidate<'_>, request: &RouteRequest<'_>) -> f64 {
        let k = &self.config;
        let o = c.kv.overlap;
        let credit = k.overlap_score_credit * f64::from(o.device)
            + k.host_cache_hit_weight * f64::from(o.host)
            + k.disk_cache_hit_weight * f64::from(o.disk)
            + k.shared_cache_multiplier * f64::from(o.external);
        let block_size = request.block_size.max(1);
        let prefill_blocks =
            (c.kv.prefill_tokens as f64 + request.prompt_tokens as f64) / block_size as f64;
        // The request's blocks not resident on the rank (see the module docs).
        let prompt_blocks = request.prompt_tokens.div_ceil(block_size) as u64;
        let new_blocks =
            c.kv.new_blocks
                .min(prompt_blocks.saturating_sub(u64::from(o.device)));
        let mut cost = k.prefill_load_scale * (prefill_blocks - credit).max(0.0)
            + (c.kv.decode_blocks + new_blocks) as f64
            + k.decode_active_request_weight * c.kv.active_requests as f64;
        if request.has_preferred_taints {
            cost *= (-c.kv.preferred_taint_weight.tanh()).exp();
        }
        cost
    }
}

impl Policy for KvAware {
    fn kind(&self) -> PolicyKind {
        PolicyKind::KvAware
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let costs = self.costs(candidates, request)?;
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let t = self.config.temperature;
        let index = if t > 0.0 && max > min {
            // Softmax over normalised negative costs.
            let weights: Vec<f64> = costs
                .iter()
                .map(|c| (-(c - min) / ((max - min) * t)).exp())
                .collect();
            let total: f64 = weights.iter().sum();
            let mut x = rng.random::<f64>() * total;
            let mut chosen = weights.len() - 1;
            for (i, w) in weights.iter().enumerate() {
                if x < *w {
                    chosen = i;
                    break;
                }
                x -= w;
            }
            chosen
        } else {
            let mut chosen = 0;
            let mut ties = 0u32;
            for (i, &c) in costs.iter().enumerate() {
                if c == min {
                    ties += 1;
                    if rng.random_range(0..ties) == 0 {
                        chosen = i;
                    }
                }
            }
            chosen
        };
        Some(Decision { index })
    }

    fn costs(&self, candidates: &[Candidate<'_>], request: &RouteRequest<'_>) -> Option<Vec<f64>> {
        if candidates.is_empty() {
            return None;
        }
        Some(candidates.iter().map(|c| self.cost(c, request)).collect())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    use super::*;
    use crate::policy::test_support::ids;
    use crate::{KvTerms, Overlap};

    fn req(prompt_tokens: usize) -> RouteRequest<'static> {
        RouteRequest {
            prompt_tokens,
            block_size: 16,
            ..RouteRequest::simple(None, "", Instant::now())
        }
    }

    fn cand<'a>(id: &'a kvroute_protocol::WorkerId, kv: KvTerms) -> Candidate<'a> {
        Candidate {
            kv,
            ..Candidate::new(id, kv.active_requests)
        }
    }

    #[test]
    fn the_cost_formula() {
        let ids = ids(1);
        let p = KvAware::default();
        let c = cand(
            &ids[0],
            KvTerms {
                overlap: Overlap {
                    device: 10,
                    host: 4,
                    disk: 4,
                    external: 8,
                },
                prefill_tokens: 320,
                decode_blocks: 50,
                new_blocks: 7,
                active_requests: 3,
                preferred_taint_weight: 0.0,
            },
        );
        // (320 + 1600)/16 = 120 blocks; credit 10 + 3 + 1 + 0 = 14; 106 + 57.
        assert!((p.cost(&c, &req(1600)) - 163.0).abs() < 1e-9);
        let p = KvAware::new(KvAwareConfig {
            decode_active_request_weight: 2.0,
            shared_cache_multiplier: 0.5,
            prefill_load_scale: 2.0,
            ..KvAwareConfig::default()
        });
        // credit 18; 2 * 102 + 57 + 6.
        assert!((p.cost(&c, &req(1600)) - 267.0).abs() < 1e-9);
        // Credit never makes the prefill term negative.
        let big = cand(
            &ids[0],
            KvTerms {
                overlap: Overlap {
                    device: 1000,
                    ..Overlap::default()
                },
                ..KvTerms::default()
            },
        );
        assert_eq!(KvAware::default().cost(&big, &req(160)), 0.0);
    }

    #[test]
    fn overlap_wins_until_load_outweighs_it() {
        let ids = ids(2);
        let p = KvAware::default();
        let mut rng = SmallRng::seed_from_u64(0);
        let warm = KvTerms {
            overlap: Overlap {
                device: 60,
                ..Overlap::default()
            },
            ..KvTerms::default()
        };
        let cold = KvTerms::default();
        let c = [cand(&ids[0], cold), cand(&ids[1], warm)];
        assert_eq!(p.select(&c, &req(1024), &mut rng).unwrap().index, 1);
        // The warm worker is busy prefilling 2000 tokens and decoding: the cold one wins.
        let busy = KvTerms {
            prefill_tokens: 2000,
            decode_blocks: 100,
            ..warm
        };
        let c = [cand(&ids[0], cold), cand(&ids[1], busy)];
        assert_eq!(p.select(&c, &req(1024), &mut rng).unwrap().index, 0);
    }

    #[test]
    fn blocks_cached_on_the_device_are_not_new_memory() {
        let ids = ids(2);
        let p = KvAware::default();
        // 1000 tokens: 63 blocks, the last partial; 40 of them cached on the device.
        let r = req(1000);
        let warm = KvTerms {
            overlap: Overlap {
                device: 40,
                ..Overlap::default()
            },
            new_blocks: 63,
            ..KvTerms::default()
        };
        // Prefill 62.5 - 40; new memory 63 - 40.
        assert!((p.cost(&cand(&ids[0], warm), &r) - 45.5).abs() < 1e-9);
        // Blocks shared with an active request count once, whichever set is larger.
        let shared = KvTerms {
            decode_blocks: 50,
            new_blocks: 13,
            ..warm
        };
        assert!((p.cost(&cand(&ids[0], shared), &r) - (22.5 + 50.0 + 13.0)).abs() < 1e-9);
        // Host hits are loaded into fresh device blocks: still new memory.
        let host = KvTerms {
            overlap: Overlap {
                host: 40,
                ..Overlap::default()
            },
            new_blocks: 63,
            ..KvTerms::default()
        };
        assert!((p.cost(&cand(&ids[1], host), &r) - (32.5 + 63.0)).abs() < 1e-9);
        // Never below zero, even for inconsistent inputs.
        let over = KvTerms {
            overlap: Overlap {
                device: 100,
                ..Overlap::default()
            },
            new_blocks: 63,
            ..KvTerms::default()
        };
        assert_eq!(p.cost(&cand(&ids[1], over), &r), 0.0);
    }

    #[test]
    fn a_conversation_stays_where_its_prefix_is_despite_a_little_more_decode_load() {
        // A later turn: 75 blocks, 31 cached on the warm rank, which decodes 35 blocks more
        // than the cold one. Warm: 44 to prefill, 260 + 44 blocks held (348); cold: 75 +
        // 225 + 75 (375). Counting the cached prefix as new memory (44 + 260 + 75 = 379)
        // would move the conversation.
        let ids = ids(2);
        let p = KvAware::default();
        let r = req(75 * 16);
        let warm = KvTerms {
            overlap: Overlap {
                device: 31,
                ..Overlap::default()
            },
            decode_blocks: 260,
            new_blocks: 75,
            ..KvTerms::default()
        };
        let cold = KvTerms {
            decode_blocks: 225,
            new_blocks: 75,
            ..KvTerms::default()
        };
        let c = [cand(&ids[0], cold), cand(&ids[1], warm)];
        let mut rng = SmallRng::seed_from_u64(4);
        assert_eq!(p.select(&c, &r, &mut rng).unwrap().index, 1);
        // A much busier warm rank still loses.
        let busy = KvTerms {
            decode_blocks: 400,
            ..warm
        };
        let c = [cand(&ids[0], cold), cand(&ids[1], busy)];
        assert_eq!(p.select(&c, &r, &mut rng).unwrap().index, 0);
    }

    #[test]
    fn ties_are_broken_at_random_and_temperature_samples() {
        let ids = ids(3);
        let p = KvAware::default();
        let c: Vec<_> = ids.iter().map(|id| cand(id, KvTerms::default())).collect();
        let mut rng = SmallRng::seed_from_u64(1);
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[p.select(&c, &req(100), &mut rng).unwrap().index] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
        // With temperature, the costlier candidate is chosen sometimes, the cheap one mostly.
        let hot = KvAware::new(KvAwareConfig {
            temperature: 1.0,
            ..KvAwareConfig::default()
        });
        let c = [
            cand(
                &ids[0],
                KvTerms {
                    overlap: Overlap {
                        device: 6,
                        ..Overlap::default()
                    },
                    ..KvTerms::default()
                },
            ),
            cand(&ids[1], KvTerms::default()),
        ];
        let mut seen = [0; 2];
        for _ in 0..1000 {
            seen[hot.select(&c, &req(100), &mut rng).unwrap().index] += 1;
        }
        assert!(seen[0] > seen[1] && seen[1] > 100, "{seen:?}");
        // Without temperature, always the cheapest.
        assert!((0..50).all(|_| p.select(&c, &req(100), &mut rng).unwrap().index == 0));
    }

    #[test]
    fn debug_names_every_parameter() {
        assert_eq!(
            format!("{:?}", KvAware::default()),
            "KvAware { overlap_score_credit: 1.0, prefill_load_scale: 1.0, decode_active_request_weight: 0.0, temperature: 0.0, host_cache_hit_weight: 0.75, disk_cache_hit_weight: 0.25, shared_cache_multiplier: 0.0 }"
        );
    }

    #[test]
    fn preferred_taints_scale_the_cost() {
        let ids = ids(2);
        let p = KvAware::default();
        let mut r = req(320);
        r.has_preferred_taints = true;
        let plain = cand(&ids[0], KvTerms::default());
        let tainted = cand(
            &ids[1],
            KvTerms {
                preferred_taint_weight: 1.0,
                ..KvTerms::default()
            },
        );
        let ratio = p.cost(&tainted, &r) / p.cost(&plain, &r);
        assert!((ratio - (-(1.0f64).tanh()).exp()).abs() < 1e-12);
        let mut rng = SmallRng::seed_from_u64(2);
        assert_eq!(p.select(&[plain, tainted], &r, &mut rng).unwrap().index, 1);
    }
}
