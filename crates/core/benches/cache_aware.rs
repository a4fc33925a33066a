//! Criterion benchmarks of `cache_aware`'s radix tree, per request of an 8k-character
//! prompt, with 8 workers holding 1M characters each: the read-only match, the insert, and
//! `select` (match + insert, what a request costs the router). Memory per stored character
//! is printed at setup, for this workload and for a worst case of short, branching texts.
//! Then the replica-sync snapshot of the whole tree: building it, and replaying it into an
//! empty tree.
//!
//! ```text
//! cargo bench -p kvroute-core --bench cache_aware -- --warm-up-time 1 --measurement-time 3
//! ```
//!
//! Prompts are ASCII: one of 16 shared 2,000-character system prompts followed by 6,000
//! characters of their own. Queries:
//! - `extend`: a held prompt plus a 200-character new turn (8,000 of 8,200 matched: a hit);
//! - `new_tail`: a system prompt and a new tail (2,000 of 8,000 matched: a miss);
//! - `unrelated`: text no worker holds.
//!
//! Inserting benchmarks add new text at every iteration; `max_tree_size` is 1M, so each
//! tree grows to 2M characters and is evicted back to 1M by the insert that crosses it
//! (the bound kept without `maintain`): the eviction's cost is amortised in the figures.
//! Building each query string (an 8k copy) is included; `build_query` measures it alone.
//! The inserting benchmarks send query `i` to worker `i mod 8` (`insert`) or where
//! `select` chooses; the held prompt an `extend` query continues is usually another
//! worker's, so the insert also adds that worker to the prompt's 8,000-character path.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvroute_core::policy::{CacheAware, CacheAwareConfig, Policy};
use kvroute_core::{Candidate, RouteRequest};
use kvroute_protocol::WorkerId;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const WORKERS: usize = 8;
const PER_WORKER: usize = 1_000_000;
const SYSTEM: usize = 2_000;
const TAIL: usize = 6_000;
const TURN: usize = 200;

fn text(rng: &mut SmallRng, len: usize) -> String {
    const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyz      etaoin";
    (0..len)
        .map(|_| LETTERS[rng.random_range(0..LETTERS.len())] as char)
        .collect()
}

struct Workload {
    ids: Vec<WorkerId>,
    systems: Vec<String>,
    tails: Vec<String>,
    /// The prompts held, with the worker holding each.
    held: Vec<(usize, String)>,
    unrelated: Vec<String>,
}

fn workload() -> Workload {
    let mut rng = SmallRng::seed_from_u64(42);
    let ids = (0..WORKERS)
        .map(|i| WorkerId::new(format!("http://w{i}:8000")))
        .collect();
    let systems: Vec<String> = (0..16).map(|_| text(&mut rng, SYSTEM)).collect();
    let tails: Vec<String> = (0..64).map(|_| text(&mut rng, TAIL)).collect();
    let per_worker = PER_WORKER.div_ceil(TAIL);
    let held = (0..WORKERS * per_worker)
        .map(|i| {
            let s = &systems[rng.random_range(0..systems.len())];
            (i % WORKERS, format!("{s}{}", text(&mut rng, TAIL)))
        })
        .collect();
    let unrelated = (0..64).map(|_| text(&mut rng, SYSTEM + TAIL)).collect();
    Workload {
        ids,
        systems,
        tails,
        held,
        unrelated,
    }
}

fn filled(load: &Workload, t0: Instant) -> CacheAware {
    let p = CacheAware::new(CacheAwareConfig {
        max_tree_size: PER_WORKER,
        ..CacheAwareConfig::default()
    });
    for (i, (w, prompt)) in load.held.iter().enumerate() {
        p.insert(
            &load.ids[*w],
            None,
            prompt,
            t0 + Duration::from_millis(i as u64),
        );
    }
    p
}

/// The `i`-th query of `kind`. New text is cut from the pool of tails at an offset that
/// depends on `i`, so it is new text (not a counter) that branches off the held prompts.
fn query(load: &Workload, kind: &str, i: usize) -> String {
    let n = load.tails.len();
    let (a, b, off) = (i % n, (i / n + 1) % n, (i * 7919) % (TAIL - TURN));
    match kind {
        "extend" => {
            let (_, prompt) = &load.held[(i * 389) % load.held.len()];
            format!("{prompt}{}", &load.tails[a][off..off + TURN])
        }
        "new_tail" => {
            let system = &load.systems[i % load.systems.len()];
            format!("{system}{}{}", &load.tails[a][off..], &load.tails[b][..off])
        }
        _ => load.unrelated[i % load.unrelated.len()].clone(),
    }
}

fn report_memory(name: &str, p: &CacheAware) {
    let (bytes, chars) = (p.memory_bytes(), p.total_chars());
    eprintln!(
        "{name}: {chars} characters stored, {bytes} bytes, {:.2} bytes/char",
        bytes as f64 / chars as f64
    );
}

fn worst_case_memory() {
    // Short texts over a 4-letter alphabet: nearly every node holds a character or two.
    let mut rng = SmallRng::seed_from_u64(7);
    let ids: Vec<WorkerId> = (0..WORKERS)
        .map(|i| WorkerId::new(format!("w{i}")))
        .collect();
    let p = CacheAware::new(CacheAwareConfig::default());
    let t0 = Instant::now();
    for i in 0..200_000 {
        let t: String = (0..24)
            .map(|_| ['a', 'c', 'g', 't'][rng.random_range(0..4)])
            .collect();
        p.insert(&ids[i % WORKERS], None, &t, t0);
    }
    report_memory(
        "worst case (200k random 24-char DNA strings, 8 workers)",
        &p,
    );
}

fn benches(c: &mut Criterion) {
    let load = workload();
    let t0 = Instant::now();
    let base = filled(&load, t0);
    for id in &load.ids {
        assert!(base.tree_size(id, None) >= PER_WORKER);
    }
    report_memory("8 workers x 1M characters of 8k prompts", &base);
    worst_case_memory();
    let candidates: Vec<Candidate<'_>> = load.ids.iter().map(|id| Candidate::new(id, 0)).collect();

    let mut group = c.benchmark_group("cache_aware_8k_at_1M_per_worker");
    group.throughput(Throughput::Elements(1));
    let mut i = 0;
    group.bench_function("build_query", |b| {
        b.iter(|| {
            i += 1;
            black_box(query(&load, "new_tail", i))
        })
    });
    for kind in ["extend", "new_tail", "unrelated"] {
        let queries: Vec<String> = (0..256).map(|i| query(&load, kind, i)).collect();
        let mut i = 0;
        group.bench_function(format!("match/{kind}"), |b| {
            b.iter(|| {
                i = (i + 1) % queries.len();
                black_box(base.matched_chars(&candidates, black_box(&queries[i])))
            })
        });
    }
    for kind in ["extend", "new_tail"] {
        let p = filled(&load, t0);
        let mut i = 0;
        group.bench_function(format!("insert/{kind}"), |b| {
            b.iter(|| {
                i += 1;
                let q = query(&load, kind, i);
                let now = t0 + Duration::from_millis(i as u64);
                p.insert(&load.ids[i % WORKERS], None, &q, now);
            })
        });
        let p = filled(&load, t0);
        let mut rng = SmallRng::seed_from_u64(1);
        let mut i = 0;
        group.bench_function(format!("select/{kind}"), |b| {
            b.iter(|| {
                i += 1;
                let q = query(&load, kind, i);
                let now = t0 + Duration::from_millis(i as u64);
                let request = RouteRequest::simple(None, &q, now);
                black_box(p.select(&candidates, &request, &mut rng))
            })
        });
        report_memory(&format!("after select/{kind}"), &p);
    }
    group.finish();

    // A starting replica's snapshot of the whole tree (8 x 1M characters): what the peer
    // spends building it (under the tree's lock) and the new replica replaying it.
    let mut group = c.benchmark_group("cache_aware_snapshot_8x1M");
    group.sample_size(10);
    let now = t0 + Duration::from_secs(1);
    let snapshot = base.snapshot(now, usize::MAX);
    let bytes: usize = snapshot.iter().map(|o| o.learnt.bytes()).sum();
    eprintln!(
        "snapshot of 8 x 1M characters: {} texts, {:.1} MB",
        snapshot.len(),
        bytes as f64 / 1e6
    );
    group.bench_function("snapshot", |b| {
        b.iter(|| black_box(base.snapshot(now, usize::MAX)))
    });
    group.bench_function("restore", |b| {
        b.iter_batched(
            || CacheAware::new(CacheAwareConfig::default()),
            |fresh| {
                fresh.restore(&snapshot, now);
                fresh
            },
            criterion::BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group!(cache_aware, benches);
criterion_main!(cache_aware);
