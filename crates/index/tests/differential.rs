//! Differential tests: seeded random event streams applied to the real indexes and to the
//! reference models, compared on every answer.
//!
//! The streams store chains of shared documents (some sharing prefixes, cut at any token, so
//! one-token pages branch inside router blocks) with random parents taken from blocks the
//! replica stored at some point (so some parents are gone: unknown-parent errors), in random
//! tiers, on replicas whose engine block sizes are 1, 16, 32 or 64 against the router's 16;
//! they remove random blocks (and unknown ones), replay old events, clear replicas, and send
//! a few malformed events. After every operation both answer the same random queries.

mod support;

use std::time::{Duration, Instant};

use kvroute_index::reference::{ReferenceApprox, ReferenceIndex};
use kvroute_index::{
    ApproxIndex, ApproxIndexer, BlockHash, EngineHash, KvIndex, KvIndexer, ReplicaId,
    ShardedKvIndex, StorageTier,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use support::{engine_hashes, router_hashes, Event, BS};

const DOC_TOKENS: usize = 192;
const REPLICAS: u32 = 4;

struct Doc {
    tokens: Vec<u32>,
    salt: u64,
}

fn docs(rng: &mut SmallRng) -> Vec<Doc> {
    let mut docs: Vec<Doc> = Vec::new();
    for i in 0..8 {
        let salt = if i >= 6 { 99 } else { 0 };
        let mut tokens = Vec::with_capacity(DOC_TOKENS);
        let same_salt: Vec<&Doc> = docs.iter().filter(|d| d.salt == salt).collect();
        if !same_salt.is_empty() && rng.random_bool(0.7) {
            let from = same_salt[rng.random_range(0..same_salt.len())];
            tokens.extend_from_slice(&from.tokens[..rng.random_range(1..DOC_TOKENS)]);
        }
        while tokens.len() < DOC_TOKENS {
            tokens.push(rng.random_range(0..1000));
        }
        docs.push(Doc { tokens, salt });
    }
    docs
}

fn tier(rng: &mut SmallRng) -> StorageTier {
    match rng.random_range(0..20) {
        0..14 => StorageTier::Device,
        14..17 => StorageTier::Host,
        17..19 => StorageTier::Disk,
        _ => StorageTier::External,
    }
}

/// A position a replica stored at some point: `end` engine blocks of document `doc`.
#[derive(Clone, Copy, Debug)]
struct Position {
    doc: usize,
    end: usize,
}

struct Stream {
    rng: SmallRng,
    docs: Vec<Doc>,
    engine_bs: Vec<usize>,
    stored: Vec<Vec<Position>>,
    events: Vec<Vec<Event>>,
}

enum Op {
    Store(ReplicaId, Event),
    Remove(ReplicaId, StorageTier, Vec<EngineHash>),
    Clear(ReplicaId),
}

impl Stream {
    fn new(seed: u64) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed);
        let docs = docs(&mut rng);
        // One seed in three: every engine at the router's block size (the index's fast path,
        // whose blocks are found after their parents; any other size turns it off for good).
        let sizes: &[usize] = if seed.is_multiple_of(3) {
            &[16]
        } else {
            &[1, 16, 32, 64, 1, 16, 32]
        };
        let engine_bs = (0..REPLICAS)
            .map(|_| sizes[rng.random_range(0..sizes.len())])
            .collect();
        Self {
            rng,
            docs,
            engine_bs,
            stored: vec![Vec::new(); REPLICAS as usize],
            events: vec![Vec::new(); REPLICAS as usize],
        }
    }

    fn next_op(&mut self) -> Op {
        let r = self.rng.random_range(0..REPLICAS) as usize;
        let ebs = self.engine_bs[r];
        let roll = self.rng.random_range(0..100);
        if roll < 2 {
            self.stored[r].clear();
            return Op::Clear(ReplicaId(r as u32));
        }
        if roll < 25 && !self.stored[r].is_empty() {
            let tier = if self.rng.random_bool(0.6) {
                StorageTier::Device
            } else {
                tier(&mut self.rng)
            };
            let mut hashes = Vec::new();
            for _ in 0..self.rng.random_range(1..4) {
                let pos = self.stored[r][self.rng.random_range(0..self.stored[r].len())];
                let doc = &self.docs[pos.doc];
                let all = engine_hashes(&doc.tokens, ebs, doc.salt);
                let back = self.rng.random_range(0..pos.end.min(3));
                hashes.push(all[pos.end - 1 - back]);
            }
            if self.rng.random_bool(0.1) {
                hashes.push(EngineHash(self.rng.random()));
            }
            return Op::Remove(ReplicaId(r as u32), tier, hashes);
        }
        if roll < 30 && !self.events[r].is_empty() {
            let old = self.events[r][self.rng.random_range(0..self.events[r].len())].clone();
            return Op::Store(ReplicaId(r as u32), old);
        }
        // Store a continuation of a position this replica stored once, or a new start.
        let (doc, start) = if !self.stored[r].is_empty() && self.rng.random_bool(0.75) {
            let pos = self.stored[r][self.rng.random_range(0..self.stored[r].len())];
            (pos.doc, pos.end)
        } else {
            (self.rng.random_range(0..self.docs.len()), 0)
        };
        let blocks = DOC_TOKENS / ebs;
        let most = if ebs == 1 { 24 } else { 4 };
        let end = (start + self.rng.random_range(1..=most)).min(blocks);
        if start >= end {
            return Op::Clear(ReplicaId(r as u32));
        }
        let doc_ref = &self.docs[doc];
        let mut event = Event::new(
            &doc_ref.tokens,
            ebs,
            start..end,
            tier(&mut self.rng),
            doc_ref.salt,
        );
        match self.rng.random_range(0..100) {
            0 => {
                event.tokens.pop();
            }
            1 => event.engine_bs = 24,
            _ => {
                self.stored[r].push(Position { doc, end });
                self.events[r].push(event.clone());
            }
        }
        Op::Store(ReplicaId(r as u32), event)
    }

    fn query(&mut self) -> Vec<BlockHash> {
        let doc = &self.docs[self.rng.random_range(0..self.docs.len())];
        let len = self.rng.random_range(0..=DOC_TOKENS);
        let salt = if self.rng.random_bool(0.05) {
            1
        } else {
            doc.salt
        };
        router_hashes(&doc.tokens[..len], salt)
    }
}

fn apply(index: &mut impl KvIndexer, op: &Op) -> String {
    match op {
        Op::Store(r, event) => format!("{:?}", event.apply(index, *r)),
        Op::Remove(r, tier, hashes) => {
            index.apply_removed(*r, *tier, hashes);
            String::new()
        }
        Op::Clear(r) => {
            index.clear_replica(*r);
            String::new()
        }
    }
}

fn describe(op: &Op) -> String {
    match op {
        Op::Store(r, e) => format!(
            "store r{} parent={:?} n={} ebs={} tier={:?}",
            r.0,
            e.parent.map(|p| p.0 % 10000),
            e.hashes.len(),
            e.engine_bs,
            e.tier
        ),
        Op::Remove(r, tier, hashes) => format!(
            "remove r{} {:?} {:?}",
            r.0,
            tier,
            hashes.iter().map(|h| h.0 % 10000).collect::<Vec<_>>()
        ),
        Op::Clear(r) => format!("clear r{}", r.0),
    }
}

#[test]
fn kv_index_agrees_with_the_reference_on_random_streams() {
    for seed in 0..300 {
        let mut stream = Stream::new(seed);
        let mut real = KvIndex::new(BS);
        let mut reference = ReferenceIndex::new(BS);
        let mut bounded = KvIndex::with_max_blocks(BS, 40);
        let mut sharded = ShardedKvIndex::new(BS, 3);
        let mut log = Vec::new();
        for step in 0..250 {
            let op = stream.next_op();
            log.push(describe(&op));
            let (a, b) = (apply(&mut real, &op), apply(&mut reference, &op));
            apply(&mut bounded, &op);
            let c = apply(&mut sharded, &op);
            let sizes = stream.engine_bs.clone();
            let context = || {
                format!(
                    "seed {seed} step {step} sizes {sizes:?}\n{}",
                    log.join("\n")
                )
            };
            assert_eq!(a, b, "result differs: {}", context());
            assert_eq!(a, c, "sharded result differs: {}", context());
            assert!(bounded.num_engine_blocks() <= 40, "{}", context());
            for _ in 0..3 {
                let query = stream.query();
                let expected = reference.find_matches(&query);
                assert_eq!(
                    sharded.find_matches(&query),
                    expected,
                    "sharded, query of {} blocks: {}",
                    query.len(),
                    context()
                );
                assert_eq!(
                    real.find_matches(&query),
                    expected,
                    "query of {} blocks: {}",
                    query.len(),
                    context()
                );
            }
            assert_eq!(
                real.num_blocks(),
                reference.num_blocks(),
                "num_blocks: {}",
                context()
            );
        }
    }
}

#[test]
fn approx_index_agrees_with_the_reference_on_random_streams() {
    let ttl = Duration::from_secs(30);
    for seed in 0..200 {
        let mut stream = Stream::new(seed);
        let mut real = ApproxIndex::new(ttl);
        let mut reference = ReferenceApprox::new(ttl);
        let mut bounded = ApproxIndex::with_max_entries(ttl, 50);
        let t0 = Instant::now();
        let mut now = t0;
        for step in 0..300 {
            now += Duration::from_millis(stream.rng.random_range(0..3000));
            let r = ReplicaId(stream.rng.random_range(0..70));
            match stream.rng.random_range(0..100) {
                0..3 => {
                    real.clear_replica(r);
                    reference.clear_replica(r);
                    bounded.clear_replica(r);
                }
                3..15 => {
                    real.expire(now);
                    reference.expire(now);
                    bounded.expire(now);
                    assert_eq!(
                        real.num_blocks(),
                        reference.num_blocks(),
                        "seed {seed} step {step}"
                    );
                }
                _ => {
                    let query = stream.query();
                    let len = stream.rng.random_range(0..=query.len());
                    real.record(r, &query[..len], now);
                    reference.record(r, &query[..len], now);
                    bounded.record(r, &query[..len], now);
                }
            }
            assert!(bounded.num_entries() <= 50);
            for _ in 0..3 {
                let query = stream.query();
                let at = now + Duration::from_millis(stream.rng.random_range(0..2000));
                assert_eq!(
                    real.find_matches(&query, at),
                    reference.find_matches(&query, at),
                    "seed {seed} step {step}"
                );
            }
        }
    }
}

/// Past the sizes from which the index's maps resize a step at a time (8,192 buckets: a
/// replica's records past 7,168 blocks, the runs past 7,168 first blocks): one replica stores
/// 12,000 prompts of four blocks on two engines' worth of records, evicting old ones as it
/// goes (tombstones, so resizes to the same size too), and every answer, asked while resizes
/// are under way, agrees with the reference's.
#[test]
fn kv_index_agrees_with_the_reference_past_gradual_resizes() {
    let mut rng = SmallRng::seed_from_u64(7);
    let mut real = KvIndex::new(BS);
    let mut sharded = ShardedKvIndex::new(BS, 2);
    let mut reference = ReferenceIndex::new(BS);
    let prompts: Vec<Vec<u32>> = (0..12_000u32)
        .map(|p| (0..4 * BS as u32).map(|t| p * 1_000 + t).collect())
        .collect();
    let replica = |p: usize| ReplicaId(u32::from(p.is_multiple_of(5)));
    for (p, tokens) in prompts.iter().enumerate() {
        let event = Event::new(tokens, BS, 0..4, StorageTier::Device, 0);
        for index in [
            &mut real as &mut dyn KvIndexer,
            &mut sharded,
            &mut reference,
        ] {
            index
                .apply_stored(replica(p), &event.stored())
                .expect("a valid event");
        }
        // Evict a random older prompt's last blocks now and then.
        if p > 100 && rng.random_bool(0.3) {
            let old = rng.random_range(0..p);
            let hashes = engine_hashes(&prompts[old], BS, 0);
            let cut = rng.random_range(0..4);
            for index in [
                &mut real as &mut dyn KvIndexer,
                &mut sharded,
                &mut reference,
            ] {
                index.apply_removed(replica(old), StorageTier::Device, &hashes[cut..]);
            }
        }
        if p % 7 == 0 {
            let asked = &prompts[rng.random_range(0..=p)];
            let query = router_hashes(asked, 0);
            let expected = reference.find_matches(&query);
            assert_eq!(real.find_matches(&query), expected, "prompt {p}");
            assert_eq!(
                sharded.find_matches(&query),
                expected,
                "prompt {p}, sharded"
            );
        }
    }
    assert_eq!(real.num_blocks(), reference.num_blocks());
    for tokens in prompts.iter().step_by(97) {
        let query = router_hashes(tokens, 0);
        assert_eq!(real.find_matches(&query), reference.find_matches(&query));
    }
}
