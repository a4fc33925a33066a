//! Hash-based policies: `consistent_hash`, `rendezvous_hash`, `prefix_hash`.
//!
//! **Ring.** Each candidate owns `virtual_nodes` points `stable_hash("{worker}#{i}")` on a
//! 64-bit ring; a key goes to the owner of the first point at or after `stable_hash(key)`,
//! wrapping around. A ring over the candidates is the same as a ring over all workers
//! walked past the ineligible ones, so when a worker leaves only its own keys move. The
//! ring is cached per policy and rebuilt only when the candidate list changes (detected by
//! a fingerprint of the candidates' precomputed id hashes, O(n) per request).
//!
//! **Keys.** `consistent_hash` and `rendezvous_hash` key on the session key, else on the
//! prompt text, so keyless requests spread by content (the same prompt, the same worker)
//! instead of all landing on one worker. `prefix_hash` keys on the first
//! `prefix_token_count` characters of the prompt text.

use std::sync::{Arc, RwLock};

use kvroute_protocol::{mix64, stable_hash};
use rand::RngCore;

use super::load::least_loaded;
use super::{Policy, PolicyKind};
use crate::{Candidate, Decision, RouteRequest};

struct Ring {
    fingerprint: u64,
    /// (point, candidate index), sorted by point.
    points: Vec<(u64, u32)>,
}

impl Ring {
    fn build(candidates: &[Candidate<'_>], virtual_nodes: u32, fingerprint: u64) -> Self {
        let mut points = Vec::with_capacity(candidates.len() * virtual_nodes as usize);
        let mut buf = String::new();
        for (i, c) in candidates.iter().enumerate() {
            for v in 0..virtual_nodes {
                buf.clear();
                use std::fmt::Write;
                let _ = write!(buf, "{}#{}", c.worker, v);
                points.push((stable_hash(buf.as_bytes()), i as u32));
            }
        }
        points.sort_unstable();
        Self {
            fingerprint,
            points,
        }
    }

    fn lookup(&self, key_hash: u64) -> usize {
        let at = self.points.partition_point(|&(p, _)| p < key_hash);
        let (_, index) = self.points[at % self.points.len()];
        index as usize
    }
}

fn fingerprint(candidates: &[Candidate<'_>]) -> u64 {
    candidates.iter().fold(candidates.len() as u64, |acc, c| {
        mix64(acc, c.worker.hash64())
    })
}

/// A hash ring over the candidates, rebuilt when they change.
struct RingCache {
    virtual_nodes: u32,
    ring: RwLock<Option<Arc<Ring>>>,
}

impl RingCache {
    fn new(virtual_nodes: u32) -> Self {
        Self {
            virtual_nodes: virtual_nodes.max(1),
            ring: RwLock::new(None),
        }
    }

    fn lookup(&self, candidates: &[Candidate<'_>], key_hash: u64) -> usize {
        let fp = fingerprint(candidates);
        let cached = self.ring.read().unwrap_or_else(|e| e.into_inner()).clone();
        let ring = match cached {
            Some(ring) if ring.fingerprint == fp => ring,
            _ => {
                let ring = Arc::new(Ring::build(candidates, self.virtual_nodes, fp));
                *self.ring.write().unwrap_or_else(|e| e.into_inner()) = Some(ring.clone());
                ring
            }
        };
        ring.lookup(key_hash)
    }
}

fn routing_key<'a>(request: &RouteRequest<'a>) -> &'a str {
    request.session_key.unwrap_or(request.text)
}

/// `consistent_hash`: the ring owner of the session key (else of the prompt text).
pub struct ConsistentHash {
    ring: RingCache,
}

impl ConsistentHash {
    pub fn new(virtual_nodes: u32) -> Self {
        Self {
            ring: RingCache::new(virtual_nodes),
        }
    }
}

impl std::fmt::Debug for ConsistentHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsistentHash")
            .field("virtual_nodes", &self.ring.virtual_nodes)
            .finish()
    }
}

impl Policy for ConsistentHash {
    fn kind(&self) -> PolicyKind {
        PolicyKind::ConsistentHash
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
        _: &mut dyn RngCore,
    ) -> Option<Decision> {
        if candidates.is_empty() {
            return None;
        }
        let key = stable_hash(routing_key(request).as_bytes());
        Some(Decision {
            index: self.ring.lookup(candidates, key),
        })
    }
}

/// `rendezvous_hash`: the candidate with the highest `mix64(hash(key), hash(worker id))`.
#[derive(Debug, Default)]
pub struct RendezvousHash;

impl Policy for RendezvousHash {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RendezvousHash
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
        _: &mut dyn RngCore,
    ) -> Option<Decision> {
        let key = stable_hash(routing_key(request).as_bytes());
        candidates
            .iter()
            .enumerate()
            .max_by_key(|(_, c)| mix64(key, c.worker.hash64()))
            .map(|(index, _)| Decision { index })
    }
}

/// `prefix_hash`: the ring owner of the prompt's first `prefix_token_count` characters,
/// unless its in-flight count exceeds `load_factor` x the candidates' mean, in which case
/// the least-loaded candidate.
pub struct PrefixHash {
    ring: RingCache,
    prefix_token_count: usize,
    load_factor: f64,
}

impl PrefixHash {
    pub fn new(virtual_nodes: u32, prefix_token_count: usize, load_factor: f64) -> Self {
        Self {
            ring: RingCache::new(virtual_nodes),
            prefix_token_count,
            load_factor,
        }
    }
}

impl std::fmt::Debug for PrefixHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixHash")
            .field("prefix_token_count", &self.prefix_token_count)
            .field("load_factor", &self.load_factor)
            .field("virtual_nodes", &self.ring.virtual_nodes)
            .finish()
    }
}

fn char_prefix(text: &str, chars: usize) -> &str {
    match text.char_indices().nth(chars) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

impl Policy for PrefixHash {
    fn kind(&self) -> PolicyKind {
        PolicyKind::PrefixHash
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        if candidates.is_empty() {
            return None;
        }
        let prefix = char_prefix(request.text, self.prefix_token_count);
        let target = self.ring.lookup(candidates, stable_hash(prefix.as_bytes()));
        let total: u64 = candidates.iter().map(|c| c.in_flight).sum();
        let mean = total as f64 / candidates.len() as f64;
        let index = if candidates[target].in_flight as f64 > mean * self.load_factor {
            least_loaded(candidates, rng)?
        } else {
            target
        };
        Some(Decision { index })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Instant;

    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    use super::*;
    use crate::policy::test_support::{cands, ids, req};

    fn pick(p: &dyn Policy, c: &[Candidate<'_>], key: Option<&str>, text: &str) -> usize {
        let mut rng = SmallRng::seed_from_u64(0);
        p.select(c, &req(key, text, Instant::now()), &mut rng)
            .unwrap()
            .index
    }

    #[test]
    fn consistent_hash_is_sticky_and_spreads_keys() {
        let ids = ids(4);
        let c = cands(&ids, &[0; 4]);
        let p = ConsistentHash::new(160);
        let mut counts = [0; 4];
        for s in 0..400 {
            let key = format!("session-{s}");
            let first = pick(&p, &c, Some(&key), "x");
            assert_eq!(pick(&p, &c, Some(&key), "other text"), first);
            counts[first] += 1;
        }
        // 160 virtual nodes keep the split within a loose band around 100 each.
        assert!(counts.iter().all(|&n| n > 50), "{counts:?}");
        // Without a session key the prompt text is the key: spread by content.
        let by_text: std::collections::HashSet<_> = (0..50)
            .map(|i| pick(&p, &c, None, &format!("prompt {i}")))
            .collect();
        assert!(by_text.len() > 1);
    }

    #[test]
    fn removing_a_worker_moves_only_its_keys() {
        let ids = ids(4);
        let all = cands(&ids, &[0; 4]);
        let fewer: Vec<_> = all
            .iter()
            .copied()
            .filter(|c| c.worker != &ids[2])
            .collect();
        for p in [
            &ConsistentHash::new(160) as &dyn Policy,
            &RendezvousHash as &dyn Policy,
        ] {
            for s in 0..300 {
                let key = format!("k{s}");
                let before = all[pick(p, &all, Some(&key), "")].worker;
                let after = fewer[pick(p, &fewer, Some(&key), "")].worker;
                if before != &ids[2] {
                    assert_eq!(before, after, "{p:?} moved key {key}");
                }
            }
        }
    }

    #[test]
    fn rendezvous_is_sticky_and_spreads() {
        let ids = ids(3);
        let c = cands(&ids, &[0; 3]);
        let mut counts: HashMap<usize, usize> = HashMap::new();
        for s in 0..300 {
            let key = format!("user-{s}");
            let i = pick(&RendezvousHash, &c, Some(&key), "");
            assert_eq!(pick(&RendezvousHash, &c, Some(&key), "zz"), i);
            *counts.entry(i).or_default() += 1;
        }
        assert_eq!(counts.len(), 3);
        assert!(counts.values().all(|&n| n > 60), "{counts:?}");
    }

    #[test]
    fn prefix_hash_keys_on_the_prefix_and_sheds_load() {
        let ids = ids(4);
        let p = PrefixHash::new(160, 256, 1.25);
        let system = "s".repeat(256);
        let c = cands(&ids, &[0; 4]);
        let target = pick(&p, &c, None, &format!("{system} question one"));
        assert_eq!(
            pick(&p, &c, None, &format!("{system} question two")),
            target
        );
        // Target loaded above 1.25 x the mean: go to the least loaded instead.
        let mut loads = [4u64; 4];
        loads[target] = 10;
        loads[(target + 1) % 4] = 1;
        let c = cands(&ids, &loads);
        assert_eq!(pick(&p, &c, None, &format!("{system} q")), (target + 1) % 4);
        // Exactly at the limit stays: mean 5, target 6 <= 6.25.
        let mut loads = [5u64, 5, 5, 5];
        loads[target] = 6;
        loads[(target + 1) % 4] = 4;
        let c = cands(&ids, &loads);
        assert_eq!(pick(&p, &c, None, &format!("{system} q")), target);
    }

    #[test]
    fn char_prefix_counts_characters_not_bytes() {
        assert_eq!(char_prefix("héllo", 2), "hé");
        assert_eq!(char_prefix("ab", 5), "ab");
    }

    #[test]
    fn ring_is_rebuilt_when_candidates_change() {
        let ids = ids(2);
        let p = ConsistentHash::new(16);
        let both = cands(&ids, &[0, 0]);
        let only_second = cands(&ids[1..], &[0]);
        for s in 0..20 {
            let k = format!("{s}");
            assert!(pick(&p, &both, Some(&k), "") < 2);
            assert_eq!(pick(&p, &only_second, Some(&k), ""), 0);
        }
    }
}
