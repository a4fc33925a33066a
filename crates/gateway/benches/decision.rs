//! Criterion benchmark of one kv_aware decision ([`routing::plan`], what a request costs the
//! router between its tokens and its worker: the index lookup, every candidate's terms, the
//! policy's choice), tokenising excluded, at 16, 256 and 1,024 workers.
//!
//! ```text
//! cargo bench -p kvroute-gateway --bench decision -- --warm-up-time 1 --measurement-time 3
//! COST_MODEL=weighted cargo bench -p kvroute-gateway --bench decision     # another cost model
//! FULL=1 cargo bench -p kvroute-gateway --bench decision     # every candidate built (no lean path)
//! SAMPLE=0 cargo bench -p kvroute-gateway --bench decision  # --router-sample-ranks 0: every rank
//! SAMPLE=32 cargo bench -p kvroute-gateway --bench decision  # --router-sample-ranks 32
//! FIXED_HOLDERS=1 cargo bench -p kvroute-gateway --bench decision  # the query held by 8 workers
//! ```
//!
//! A decision is a request's (not a dry run's): from 64 workers on, a plain request takes the
//! lean path (`routing/lean.rs`); `FULL=1` measures the full path, `POST /debug/route`'s.
//!
//! Each worker is healthy, publishes KV events (so the index, not the approximation, answers)
//! and holds 16 prompts of 64 blocks in the index: 8 under 8 of 64 shared 32-block system
//! prompts, 8 of its own. Four requests of 64 blocks are in flight on each (their blocks in
//! its load accounting). The query is a held prompt's system prompt and a new tail: a hit of
//! 32 blocks on the 1/8 of the workers that hold that system prompt (with `FIXED_HOLDERS`, on
//! the first 8 workers only, at every size: a prefix that does not spread with the fleet). A
//! worker count that the decision's cost grows with shows as a slope between the three.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvroute_core::eligibility::Hints;
use kvroute_core::policy::sample_size;
use kvroute_core::RequestLoad;
use kvroute_gateway::kv::{KvState, WorkerSink};
use kvroute_gateway::kv_events::EventSink;
use kvroute_gateway::metrics::GatewayMetrics;
use kvroute_gateway::prompts::{Prompts, Tokens};
use kvroute_gateway::proxy::InFlight;
use kvroute_gateway::routing::{self, Limits};
use kvroute_gateway::workers::WorkerSet;
use kvroute_gateway::{Settings, WorkerSpec};
use kvroute_index::{EngineHash, StorageTier, StoredBlocks};
use kvroute_protocol::RoutingFields;
use kvroute_tokenizer::Tokenizer;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

const BLOCK: usize = 16;
const SYSTEMS: usize = 64;

/// `blocks` blocks of token ids from `seed`.
fn tokens(seed: u64, blocks: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..blocks * BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 30_000) as u32
        })
        .collect()
}

/// A prompt of system prompt `system` (32 blocks) and a tail of 32 blocks from `tail`.
fn prompt(system: u64, tail: u64) -> Vec<u32> {
    let mut ids = tokens(system, 32);
    ids.extend(tokens(1_000_000 + tail, 32));
    ids
}

struct Cluster {
    kv: Arc<KvState>,
    workers: Arc<WorkerSet>,
    query: Tokens,
    _in_flight: Vec<InFlight>,
}

fn cluster(n: usize) -> Cluster {
    let specs: Vec<WorkerSpec> = (0..n)
        .map(|i| WorkerSpec {
            id: Some(format!("w{i}")),
            model: Some("m".into()),
            kv_events: Some(format!("tcp://127.0.0.1:{}", 20_000 + i)),
            ..WorkerSpec::url(format!("http://127.0.0.1:{}", 10_000 + i))
        })
        .collect();
    let mut settings = Settings::with_workers(specs.clone()).unwrap();
    // COST_MODEL=weighted|calibrated|predicted measures another cost model (A/B in one build).
    if let Ok(model) = std::env::var("COST_MODEL") {
        settings.policy_config.kv_aware.cost_model = model.parse().expect("a cost model");
    }
    settings.sample_ranks = sample();
    let mut registry = Registry::default();
    let metrics = GatewayMetrics::register(&mut registry);
    let workers = Arc::new(WorkerSet::new(&settings, &metrics));
    let prompts = Prompts::new(Arc::new(Tokenizer::fallback()), BLOCK, 0, &mut registry);
    let kv = Arc::new(KvState::new(
        &settings,
        prompts,
        (Gauge::default(), Gauge::default()),
    ));
    let mut in_flight = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let worker = workers.get(spec.id.as_deref().unwrap()).unwrap();
        workers.set_healthy(spec.id.as_deref().unwrap(), true);
        let sink = WorkerSink::new(kv.clone(), worker.clone());
        // 16 prompts: 8 under shared system prompts, 8 of its own; with `FIXED_HOLDERS`, the
        // first 8 workers hold one more, the query's.
        let fixed = (fixed_holders() && i < 8).then_some((FIXED_SYSTEM, 16));
        let own = (0..16u64).map(|p| {
            let system = if p < 8 {
                (i as u64 + p) % SYSTEMS as u64
            } else {
                100_000 + i as u64
            };
            (system, p)
        });
        for (system, p) in own.chain(fixed) {
            let ids = prompt(system, (i as u64) << 8 | p);
            let engine: Vec<EngineHash> = (0..64)
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
        for r in 0..4u64 {
            let ids = prompt(200_000 + (i as u64) * 4 + r, r);
            let hashes = kv.prompts.hashed(ids.clone()).hashes;
            let load =
                RequestLoad::for_prompt(hashes.iter().map(|h| h.0).collect(), ids.len(), 0, BLOCK);
            in_flight.push(InFlight::new(worker.clone(), 0, load, None));
        }
    }
    let system = if fixed_holders() { FIXED_SYSTEM } else { 7 };
    let query = kv.prompts.hashed(prompt(system, 999_999));
    Cluster {
        kv,
        workers,
        query,
        _in_flight: in_flight,
    }
}

/// The system prompt only the first 8 workers hold, with `FIXED_HOLDERS`.
const FIXED_SYSTEM: u64 = 500_000;

/// `FIXED_HOLDERS`: the query's system prompt held by the first 8 workers, not 1/8 of them.
fn fixed_holders() -> bool {
    std::env::var_os("FIXED_HOLDERS").is_some()
}

/// `SAMPLE=N`: `--router-sample-ranks N` (0: off); unset, the default (64 from 256 ranks).
fn sample() -> Option<usize> {
    std::env::var("SAMPLE")
        .ok()
        .map(|n| n.parse().expect("SAMPLE: a rank count"))
}

fn decision(c: &mut Criterion) {
    let mut group = c.benchmark_group("kv_aware_decision");
    let fields = RoutingFields::default();
    let (hints, limits) = (Hints::default(), Limits::default());
    let dry_run = std::env::var_os("FULL").is_some();
    for n in [16, 256, 1024] {
        let cluster = cluster(n);
        let table = cluster.workers.table();
        let pool = table.resolve(Some("m")).unwrap();
        let plan = |now| {
            routing::plan(
                &cluster.kv,
                pool,
                None,
                &hints,
                &limits,
                None,
                &fields,
                &cluster.query,
                now,
                dry_run,
            )
            .unwrap()
        };
        // The query hits its system prompt's holders: 32 blocks.
        let p = plan(Instant::now());
        let size = sample_size(sample(), n);
        let sampled = size > 0 && n >= 64 && !dry_run;
        if sampled {
            // The workers that hold the system prompt (at most N of them), and the sample.
            assert!(p.ranks_scored <= 3 * size, "{}", p.ranks_scored);
        } else {
            assert_eq!(p.ranks_scored, n);
        }
        assert_eq!(p.choice().kv.overlap.device, 32, "a holder wins");
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| black_box(plan(Instant::now()).chosen))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3));
    targets = decision
}
criterion_main!(benches);
