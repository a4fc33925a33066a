//! Criterion benchmarks of the indexer, each beside the reference model in the same run:
//! block events applied per second, and `find_matches` latency at a million blocks over 64
//! replicas with 512-block queries (workload in `support/workload.rs`). Percentiles (p50,
//! p99) come from `cargo run --release -p kvroute-index --example query_latency`.
//!
//! ```text
//! cargo bench -p kvroute-index --bench indexer -- --warm-up-time 1 --measurement-time 3
//! ```

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use kvroute_index::reference::ReferenceIndex;
use kvroute_index::{KvIndex, KvIndexer, StorageTier};

#[path = "support/workload.rs"]
mod workload;

use workload::{Workload, BS};

fn build<I: KvIndexer>(mut index: I, load: &Workload) -> I {
    for stored in &load.build {
        index
            .apply_stored(stored.replica, &stored.event())
            .expect("valid event");
    }
    index
}

fn churn<I: KvIndexer>(index: &mut I, load: &Workload) {
    for stored in &load.churn {
        index
            .apply_stored(stored.replica, &stored.event())
            .expect("valid event");
    }
    for (replica, hashes) in &load.churn_removed {
        index.apply_removed(*replica, StorageTier::Device, hashes);
    }
}

fn events(c: &mut Criterion) {
    let small = workload::build(200_000, 11);
    let mut group = c.benchmark_group("store_into_empty_200k");
    group.throughput(Throughput::Elements(small.build_blocks as u64));
    group.sample_size(10);
    group.bench_function("KvIndex", |b| {
        b.iter_batched(
            || KvIndex::new(BS),
            |index| build(index, &small),
            BatchSize::PerIteration,
        )
    });
    group.bench_function("reference", |b| {
        b.iter_batched(
            || ReferenceIndex::new(BS),
            |index| build(index, &small),
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

fn at_a_million(c: &mut Criterion) {
    let load = workload::build(1_000_000, 7);
    let mut real = build(KvIndex::new(BS), &load);
    let mut reference = build(ReferenceIndex::new(BS), &load);
    eprintln!(
        "1M workload: KvIndex {} blocks, {:.1} bytes/block; reference {:.1} bytes/block",
        real.num_blocks(),
        real.memory_bytes() as f64 / real.num_blocks() as f64,
        reference.memory_bytes() as f64 / reference.num_blocks() as f64,
    );

    let mut group = c.benchmark_group("churn_at_1M");
    group.throughput(Throughput::Elements(2 * load.churn_blocks as u64));
    group.sample_size(10);
    group.bench_function("KvIndex", |b| b.iter(|| churn(&mut real, &load)));
    group.bench_function("reference", |b| b.iter(|| churn(&mut reference, &load)));
    group.finish();

    let mut group = c.benchmark_group("find_matches_1M_512_blocks");
    for (kind, queries) in [
        ("hit", &load.hit),
        ("system", &load.system),
        ("miss", &load.miss),
    ] {
        let mut i = 0;
        group.bench_with_input(BenchmarkId::new("KvIndex", kind), queries, |b, queries| {
            b.iter(|| {
                i = (i + 389) % queries.len();
                black_box(real.find_matches(black_box(&queries[i])))
            })
        });
        group.bench_with_input(
            BenchmarkId::new("reference", kind),
            queries,
            |b, queries| {
                b.iter(|| {
                    i = (i + 389) % queries.len();
                    black_box(reference.find_matches(black_box(&queries[i])))
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, events, at_a_million);
criterion_main!(benches);
