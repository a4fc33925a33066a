//! Per-query latency percentiles (p50, p90, p99) of `find_matches`, events per second and
//! memory per block, for `KvIndex` and the reference model on the same workload (see
//! `benches/support/workload.rs`), in one run:
//!
//! ```text
//! cargo run --release -p kvroute-index --example query_latency [-- BLOCKS [--no-reference]]
//! ```

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvroute_index::reference::ReferenceIndex;
use kvroute_index::{BlockHash, KvIndex, KvIndexer};

#[path = "../benches/support/workload.rs"]
mod workload;

fn percentiles(mut times: Vec<Duration>) -> String {
    times.sort_unstable();
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    format!(
        "p50 {:>9.2?}  p90 {:>9.2?}  p99 {:>9.2?}  max {:>9.2?}",
        at(0.5),
        at(0.9),
        at(0.99),
        at(1.0)
    )
}

fn run<I: KvIndexer>(name: &str, mut index: I, load: &workload::Workload) {
    let start = Instant::now();
    for stored in &load.build {
        index
            .apply_stored(stored.replica, &stored.event())
            .expect("valid event");
    }
    let build = start.elapsed();
    println!(
        "{name}: build {:.2?} = {:.2} M block events/s; {} blocks, {:.1} bytes/block ({:.1} MiB)",
        build,
        load.build_blocks as f64 / build.as_secs_f64() / 1e6,
        index.num_blocks(),
        index.memory_bytes() as f64 / index.num_blocks() as f64,
        index.memory_bytes() as f64 / (1 << 20) as f64,
    );
    // Steady state at full size: store conversations, then remove them again.
    let start = Instant::now();
    for stored in &load.churn {
        index
            .apply_stored(stored.replica, &stored.event())
            .expect("valid event");
    }
    for (replica, hashes) in &load.churn_removed {
        index.apply_removed(*replica, kvroute_index::StorageTier::Device, hashes);
    }
    let churn = start.elapsed();
    println!(
        "{name}: churn at full size {:.2} M block events/s (stored + removed)",
        2.0 * load.churn_blocks as f64 / churn.as_secs_f64() / 1e6
    );
    for (kind, queries) in [
        ("hit", &load.hit),
        ("system", &load.system),
        ("miss", &load.miss),
    ] {
        let rounds = if name == "reference" { 3 } else { 20 };
        let (times, matched) = time_queries(&index, queries, rounds, false);
        println!("{name}: {kind:<6} {}  ({matched})", percentiles(times));
    }
    let (times, _) = time_queries(&index, &load.hit[..256], 1, true);
    println!("{name}: hit with cold caches {}", percentiles(times));
}

/// Reads 64 MiB, more than the last-level cache, to evict the index from it.
fn evict_caches(buffer: &mut [u64]) {
    let mut sum = 0u64;
    for (i, word) in buffer.iter_mut().enumerate().step_by(8) {
        *word = word.wrapping_add(i as u64);
        sum = sum.wrapping_add(*word);
    }
    black_box(sum);
}

/// Times every query `rounds` times, in a shuffled order each round (after evicting the
/// caches before each when `cold`).
fn time_queries<I: KvIndexer>(
    index: &I,
    queries: &[Vec<BlockHash>],
    rounds: usize,
    cold: bool,
) -> (Vec<Duration>, String) {
    let mut buffer = vec![0u64; if cold { 8 << 20 } else { 0 }];
    let mut times = Vec::with_capacity(queries.len() * rounds);
    let (mut replicas, mut best, mut blocks) = (0usize, 0u64, 0u64);
    for round in 0..rounds {
        for i in 0..queries.len() {
            let query = &queries[(i * 389 + round * 97) % queries.len()];
            if cold {
                evict_caches(&mut buffer);
            }
            let start = Instant::now();
            let scores = black_box(index.find_matches(black_box(query)));
            times.push(start.elapsed());
            replicas += scores.scores.len();
            best += scores
                .scores
                .iter()
                .map(|(_, c)| u64::from(c.total()))
                .max()
                .unwrap_or(0);
            blocks += scores
                .scores
                .iter()
                .map(|(_, c)| u64::from(c.total()))
                .sum::<u64>();
        }
    }
    let n = times.len() as f64;
    let matched = format!(
        "on average {:.1} replicas match, the best {:.0} blocks, {:.0} blocks in all",
        replicas as f64 / n,
        best as f64 / n,
        blocks as f64 / n
    );
    (times, matched)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let blocks = args
        .get(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let with_reference = !args.iter().any(|a| a == "--no-reference");
    let start = Instant::now();
    let load = workload::build(blocks, 7);
    println!(
        "workload: {} block events in {} events over {} replicas, queries of {} blocks (built in {:.1?})",
        load.build_blocks,
        load.build.len(),
        workload::REPLICAS,
        workload::QUERY_BLOCKS,
        start.elapsed()
    );
    run("KvIndex", KvIndex::new(workload::BS), &load);
    if with_reference {
        run("reference", ReferenceIndex::new(workload::BS), &load);
    }
}
