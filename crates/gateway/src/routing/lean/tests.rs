use std::sync::Arc;
use std::time::Instant;

use kvroute_core::eligibility::Hints;
use kvroute_core::latency::PrefillFeatures;
use kvroute_core::{CostModel, PolicyKind, RequestLoad};
use kvroute_index::{EngineHash, StorageTier, StoredBlocks};
use kvroute_protocol::RoutingFields;
use kvroute_tokenizer::Tokenizer;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{LEAN_FROM_WORKERS, SHOWN};
use crate::engine_metrics::RankReading;
use crate::kv::{KvState, WorkerSink};
use crate::kv_events::EventSink;
use crate::metrics::GatewayMetrics;
use crate::prompts::{Prompts, Tokens};
use crate::proxy::InFlight;
use crate::routing::{plan, Limits, Plan};
use crate::workers::{LatencySample, WorkerSet};
use crate::{Settings, WorkerSpec};

const BLOCK: usize = 16;

/// `blocks` blocks of token ids of prefix `group` then of `tail`.
fn tokens(group: u64, tail: u64, blocks: usize) -> Vec<u32> {
    let head = blocks / 2;
    (0..blocks * BLOCK)
        .map(|i| {
            let (seed, at) = if i < head * BLOCK {
                (group, i)
            } else {
                (1_000 + tail, i)
            };
            (seed.wrapping_mul(7919).wrapping_add(at as u64 * 31) % 30_000) as u32
        })
        .collect()
}

/// `n` workers `w0..` serving model `m`, with KV events when `events` (else approximated).
fn specs(n: usize, events: bool) -> Vec<WorkerSpec> {
    (0..n)
        .map(|i| WorkerSpec {
            id: Some(format!("w{i}")),
            model: Some("m".into()),
            kv_events: events.then(|| format!("tcp://127.0.0.1:{}", 20_000 + i)),
            ..WorkerSpec::url(format!("http://127.0.0.1:{}", 10_000 + i))
        })
        .collect()
}

/// A router's workers and KV state for `specs`, under kv_aware with `model`.
fn router(specs: &[WorkerSpec], model: CostModel) -> (Arc<WorkerSet>, Arc<KvState>) {
    sampled_router(specs, model, Some(0))
}

/// [`router`] with `--router-sample-ranks sample` (`None`: the default).
fn sampled_router(
    specs: &[WorkerSpec],
    model: CostModel,
    sample: Option<usize>,
) -> (Arc<WorkerSet>, Arc<KvState>) {
    let mut settings = Settings::with_workers(specs.to_vec()).unwrap();
    settings.sample_ranks = sample;
    settings.policy = PolicyKind::KvAware;
    settings.policy_config.kv_aware.cost_model = model;
    let mut registry = Registry::default();
    let metrics = GatewayMetrics::register(&mut registry);
    let workers = Arc::new(WorkerSet::new(&settings, &metrics));
    let prompts = Prompts::new(Arc::new(Tokenizer::fallback()), BLOCK, 0, &mut registry);
    let gauges = (Gauge::default(), Gauge::default());
    (workers, Arc::new(KvState::new(&settings, prompts, gauges)))
}

struct Cluster {
    kv: Arc<KvState>,
    workers: Arc<WorkerSet>,
    _in_flight: Vec<InFlight>,
}

/// `n` workers in random states: prompts of 8 groups in the index of some, requests in
/// flight (some on the query's group), engine queues, and speeds taught to some ranks.
fn cluster(n: usize, model: CostModel, seed: u64) -> Cluster {
    sampled_cluster(n, model, seed, Some(0))
}

/// [`cluster`] with `--router-sample-ranks sample` (`None`: the default).
fn sampled_cluster(n: usize, model: CostModel, seed: u64, sample: Option<usize>) -> Cluster {
    let mut rng = SmallRng::seed_from_u64(seed);
    let specs: Vec<WorkerSpec> = (specs(n, true).into_iter().enumerate())
        .map(|(i, spec)| WorkerSpec {
            num_gpu_blocks: Some(if i % 3 == 0 { 2_000 } else { 4_000 }),
            ..spec
        })
        .collect();
    let (workers, kv) = sampled_router(&specs, model, sample);
    let now = Instant::now();
    let mut in_flight = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let id = spec.id.as_deref().unwrap();
        let worker = workers.get(id).unwrap();
        workers.set_healthy(id, rng.random_bool(0.95));
        let sink = WorkerSink::new(kv.clone(), worker.clone());
        for p in 0..rng.random_range(0..3u64) {
            let ids = tokens(rng.random_range(0..8), i as u64, 8);
            let engine: Vec<EngineHash> = (0..8)
                .map(|b| EngineHash((i as u64) << 32 | p << 16 | b))
                .collect();
            let stored = StoredBlocks {
                parent: None,
                engine_hashes: &engine,
                token_ids: &ids,
                block_size: BLOCK,
                tier: StorageTier::Device,
                salt: 0,
            };
            sink.stored(0, &stored).unwrap();
        }
        for _ in 0..rng.random_range(0..4) {
            let tail = u64::from(rng.random::<u32>());
            let ids = tokens(rng.random_range(0..16), tail, rng.random_range(1..40));
            let hashes = kv.prompts.hashed(ids.clone()).hashes;
            let load =
                RequestLoad::for_prompt(hashes.iter().map(|h| h.0).collect(), ids.len(), 0, BLOCK);
            let mut request = InFlight::new(worker.clone(), 0, load, None);
            if rng.random_bool(0.5) {
                request.data_frame();
            }
            in_flight.push(request);
        }
        let rank = &worker.ranks[0];
        if rng.random_bool(0.7) {
            let reading = RankReading {
                waiting: Some(rng.random_range(0..3) as f64),
                ..RankReading::default()
            };
            rank.engine.record(&reading, now);
        }
        // A third of the ranks taught a speed: twice as slow, or twice as fast.
        if i % 3 != 1 {
            let slow = if i % 3 == 0 { 2.0 } else { 0.5 };
            for _ in 0..30 {
                let features = PrefillFeatures {
                    tokens: 1_000.0,
                    decoding: 0.0,
                    kv_after: 0.0,
                    adapter_loads: 0.0,
                };
                let ms = slow * kvroute_core::latency::FittedSpeed::prior().ttft_ms(&features);
                rank.observe(LatencySample::Ttft { features, ms });
            }
        }
    }
    Cluster {
        kv,
        workers,
        _in_flight: in_flight,
    }
}

fn decide(c: &Cluster, query: &Tokens, dry_run: bool, now: Instant) -> Plan {
    let table = c.workers.table();
    let pool = table.resolve(Some("m")).unwrap();
    let fields = RoutingFields::default();
    let (hints, limits) = (Hints::default(), Limits::default());
    plan(
        &c.kv, pool, None, &hints, &limits, None, &fields, query, now, dry_run,
    )
    .unwrap()
}

#[test]
fn the_lean_decision_is_the_full_decisions_cheapest() {
    let mut leaner = 0;
    for model in [CostModel::Weighted, CostModel::Calibrated] {
        for seed in 0..12 {
            let c = cluster(LEAN_FROM_WORKERS + 16, model, seed);
            for q in 0..8 {
                let query = c.kv.prompts.hashed(tokens(q, 99_999, 6 + q as usize));
                // dry_run takes the full path: every candidate and its cost.
                let now = Instant::now();
                let full = decide(&c, &query, true, now);
                let lean = decide(&c, &query, false, now);
                let full_costs = full.costs.as_ref().unwrap();
                let min = full_costs.iter().copied().fold(f64::INFINITY, f64::min);
                let lean_cost = lean.costs.as_ref().unwrap()[lean.chosen];
                assert_eq!(lean_cost, min, "{model:?} seed {seed} query {q}");
                // The same rank costs the same on the full path: it is one of its cheapest.
                let chosen = lean.choice();
                let i = (full.choices.iter())
                    .position(|f| Arc::ptr_eq(&f.worker, &chosen.worker))
                    .unwrap();
                assert_eq!(full_costs[i], min, "{model:?} seed {seed} query {q}");
                assert_eq!(full.choices[i].kv, chosen.kv);
                assert_eq!(lean.ranks_scored, full.choices.len());
                assert!(lean.choices.len() <= full.choices.len());
                // At most the SHOWN cheapest of the locked ranks, in order, and the winner.
                let costs = lean.costs.as_ref().unwrap();
                assert!(costs.len() <= SHOWN + 1, "{costs:?}");
                let shown = &costs[..costs.len().min(SHOWN)];
                assert!(shown.is_sorted(), "{costs:?}");
                leaner += usize::from(lean.choices.len() < full.choices.len() / 2);
            }
        }
    }
    assert!(
        leaner > 100,
        "most decisions read few ranks under their lock: {leaner}"
    );
}

#[test]
fn ties_among_idle_ranks_are_drawn_at_random() {
    let specs = specs(LEAN_FROM_WORKERS, false);
    let (workers, kv) = router(&specs, CostModel::Calibrated);
    for s in &specs {
        workers.set_healthy(s.id.as_deref().unwrap(), true);
    }
    let c = Cluster {
        kv,
        workers,
        _in_flight: Vec::new(),
    };
    let query = c.kv.prompts.hashed(tokens(1, 2, 4));
    let chosen: std::collections::HashSet<String> = (0..300)
        .map(|_| decide(&c, &query, false, Instant::now()))
        .inspect(|p| assert_eq!(p.ranks_scored, LEAN_FROM_WORKERS))
        .map(|p| p.choice().worker.id.to_string())
        .collect();
    // 300 uniform draws from 64 miss about 0.6 of them; the first always winning gives 1.
    assert!(chosen.len() > 40, "{} distinct", chosen.len());
}

/// The ranks of a full plan that hold some of the prompt: in the index, or through an active
/// request sharing its blocks (fewer new blocks than a rank that holds none).
fn holders(full: &Plan) -> Vec<usize> {
    let all_new = (full.choices.iter())
        .map(|c| c.kv.new_blocks)
        .max()
        .unwrap();
    (0..full.choices.len())
        .filter(|&i| {
            let kv = &full.choices[i].kv;
            kv.overlap.total() > 0 || kv.new_blocks < all_new
        })
        .collect()
}

#[test]
fn a_sampled_decision_reads_the_longest_holders_and_n_others() {
    let (mut read, mut all) = (0, 0);
    for seed in 0..8 {
        for sample in [2, 8] {
            let c = sampled_cluster(
                2 * LEAN_FROM_WORKERS,
                CostModel::Calibrated,
                seed,
                Some(sample),
            );
            for q in 0..8 {
                let query = c.kv.prompts.hashed(tokens(q, 99_999, 6 + q as usize));
                let now = Instant::now();
                let full = decide(&c, &query, true, now);
                let sampled = decide(&c, &query, false, now);
                let held = holders(&full);
                let costs = full.costs.as_ref().unwrap();
                let cost = sampled.costs.as_ref().unwrap()[sampled.chosen];
                let what = format!("seed {seed} sample {sample} query {q}");
                // At most `sample` of each kind: cached holders, active holders, others.
                assert!(sampled.ranks_scored <= 3 * sample, "{what}");
                assert!(sampled.ranks_scored >= held.len().min(sample), "{what}");
                // No better than every rank read; as good when the cheapest rank holds the
                // longest cached prefix and no more than `sample` ranks hold that long.
                let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
                assert!(cost >= min, "{what}");
                let depth = |i: usize| full.choices[i].kv.overlap.total();
                let longest = (0..costs.len()).map(depth).max().unwrap();
                let deepest = (0..costs.len()).filter(|&i| depth(i) == longest).count();
                let best = (0..costs.len()).find(|&i| costs[i] == min).unwrap();
                if longest > 0 && depth(best) == longest && deepest <= sample {
                    assert_eq!(cost, min, "{what}");
                }
                // A rank costs the same whichever way it is read.
                let chosen = sampled.choice();
                if let Some(i) =
                    (full.choices.iter()).position(|f| Arc::ptr_eq(&f.worker, &chosen.worker))
                {
                    assert_eq!(costs[i], cost, "{what}");
                }
                (read, all) = (read + sampled.ranks_scored, all + full.choices.len());
            }
        }
    }
    assert!(read < all / 4, "{read} ranks read of {all}");
}

#[test]
fn a_sampled_decision_finds_a_prompt_held_only_by_an_active_request() {
    let n = 2 * LEAN_FROM_WORKERS;
    let specs = specs(n, false);
    let (workers, kv) = sampled_router(&specs, CostModel::Calibrated, Some(1));
    let prompt = |group, tail| kv.prompts.hashed(tokens(group, tail, 32));
    let load = |p: &Tokens| {
        let blocks = p.hashes.iter().map(|h| h.0).collect();
        RequestLoad::for_prompt(blocks, p.ids.len(), 0, BLOCK)
    };
    // Every rank decodes a request of its own; w77's shares the query's first 16 blocks (it
    // is in no engine's cache yet: no KV event came).
    let mut in_flight = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let id = s.id.as_deref().unwrap();
        workers.set_healthy(id, true);
        let own = if i == 77 {
            prompt(3, 1)
        } else {
            prompt(100 + i as u64, 2)
        };
        let mut request = InFlight::new(workers.get(id).unwrap(), 0, load(&own), None);
        request.data_frame();
        in_flight.push(request);
    }
    let c = Cluster {
        kv: kv.clone(),
        workers,
        _in_flight: in_flight,
    };
    let query = prompt(3, 2);
    let full = decide(&c, &query, true, Instant::now());
    assert_eq!(
        full.choice().worker.id.as_str(),
        "w77",
        "the exact decision"
    );
    for _ in 0..20 {
        let sampled = decide(&c, &query, false, Instant::now());
        assert_eq!(sampled.choice().worker.id.as_str(), "w77");
        assert!(sampled.ranks_scored <= 2, "{}", sampled.ranks_scored);
    }
}

#[test]
fn active_firsts_count_each_ranks_requests_until_they_end() {
    let specs = specs(2, false);
    let (workers, kv) = sampled_router(&specs, CostModel::Calibrated, Some(4));
    let [a, b] = ["w0", "w1"].map(|id| workers.get(id).unwrap());
    let load = |group| {
        let hashes = kv.prompts.hashed(tokens(group, 5, 4)).hashes;
        RequestLoad::for_prompt(hashes.iter().map(|h| h.0).collect(), 4 * BLOCK, 0, BLOCK)
    };
    let first = load(1).blocks[0];
    let firsts = workers
        .table()
        .resolve(Some("m"))
        .unwrap()
        .sampling
        .clone()
        .unwrap()
        .firsts
        .clone();
    let ranks = || {
        let mut out = Vec::new();
        firsts.ranks_of(first, &mut out);
        out.sort();
        out
    };
    let one = InFlight::new(a.clone(), 0, load(1), None);
    let two = InFlight::new(a.clone(), 0, load(1), None);
    let three = InFlight::new(b.clone(), 0, load(1), None);
    let other = InFlight::new(b.clone(), 0, load(2), None);
    assert_eq!(ranks(), [a.ranks[0].replica, b.ranks[0].replica]);
    drop(three);
    drop(one);
    assert_eq!(ranks(), [a.ranks[0].replica], "a still runs one");
    drop(two);
    assert_eq!(ranks(), []);
    assert_eq!(firsts.len(), 1, "the other prompt's");
    drop(other);
    assert!(firsts.is_empty(), "nothing left behind");
}

#[test]
fn a_sampled_decision_reads_the_longest_of_many_holders() {
    let n = 2 * LEAN_FROM_WORKERS;
    let specs = specs(n, true);
    let (workers, kv) = sampled_router(&specs, CostModel::Calibrated, Some(4));
    let ids = tokens(5, 1, 64);
    // 40 idle ranks hold the query's first 32 blocks, w90 its first 48.
    for (i, s) in specs.iter().enumerate() {
        let id = s.id.as_deref().unwrap();
        workers.set_healthy(id, true);
        let blocks = match i {
            90 => 48,
            _ if i % 3 == 0 => 32,
            _ => continue,
        };
        let engine: Vec<EngineHash> = (0..blocks as u64).map(|b| EngineHash(b + 1)).collect();
        let stored = StoredBlocks {
            parent: None,
            engine_hashes: &engine,
            token_ids: &ids[..blocks * BLOCK],
            block_size: BLOCK,
            tier: StorageTier::Device,
            salt: 0,
        };
        WorkerSink::new(kv.clone(), workers.get(id).unwrap())
            .stored(0, &stored)
            .unwrap();
    }
    let c = Cluster {
        kv: kv.clone(),
        workers,
        _in_flight: Vec::new(),
    };
    let query = kv.prompts.hashed(ids);
    assert_eq!(
        decide(&c, &query, true, Instant::now())
            .choice()
            .worker
            .id
            .as_str(),
        "w90"
    );
    for _ in 0..20 {
        let sampled = decide(&c, &query, false, Instant::now());
        assert_eq!(sampled.choice().worker.id.as_str(), "w90");
        // 4 of the 44 holders (w90 first) and 4 others.
        assert!(sampled.ranks_scored <= 8, "{}", sampled.ranks_scored);
    }
}

#[test]
fn pools_of_256_ranks_or_more_sample_by_default() {
    use kvroute_core::policy::{AUTO_SAMPLE_FROM_RANKS, AUTO_SAMPLE_RANKS};
    let cases = [
        (AUTO_SAMPLE_FROM_RANKS - 1, None, None),
        (AUTO_SAMPLE_FROM_RANKS, None, Some(AUTO_SAMPLE_RANKS)),
        (AUTO_SAMPLE_FROM_RANKS, Some(0), None),
        (16, Some(4), Some(4)),
    ];
    for (n, setting, expected) in cases {
        let mut settings = Settings::with_workers(specs(n, true)).unwrap();
        settings.sample_ranks = setting;
        settings.policy = PolicyKind::KvAware;
        let mut registry = Registry::default();
        let workers = WorkerSet::new(&settings, &GatewayMetrics::register(&mut registry));
        let table = workers.table();
        let others = table
            .resolve(Some("m"))
            .unwrap()
            .sampling
            .as_ref()
            .map(|s| s.others);
        assert_eq!(
            others, expected,
            "{n} workers, --router-sample-ranks {setting:?}"
        );
    }
    // A default decision at 256 workers reads the prompt's holders and a sample, not all.
    let c = sampled_cluster(AUTO_SAMPLE_FROM_RANKS, CostModel::Calibrated, 1, None);
    let query = c.kv.prompts.hashed(tokens(1, 5, 4));
    let p = decide(&c, &query, false, Instant::now());
    // (3 x 64 = 192 of the 256.)
    assert!(
        p.ranks_scored <= 3 * AUTO_SAMPLE_RANKS,
        "{} ranks read",
        p.ranks_scored
    );
}
