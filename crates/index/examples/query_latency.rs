//! Per-query latency percentiles (p50, p90, p99) of `find_matches`, events per second and
//! memory per block, for `KvIndex` (unbounded, then bounded as the router builds it by
//! default) and the reference model on the same workload (see
//! `benches/support/workload.rs`), in one run; then `ShardedKvIndex` on N ingest threads
//! (`--threads N,M`, 2 by default, 0 for none): build and churn with hit queries timed
//! alongside on this thread.
//!
//! ```text
//! cargo run --release -p kvroute-index --example query_latency [-- BLOCKS [--no-reference] [--threads 2,4]]
//! ```

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvroute_index::reference::ReferenceIndex;
use std::sync::atomic::{AtomicBool, Ordering};

use kvroute_index::{BlockHash, KvIndex, KvIndexer, ShardedKvIndex, StorageTier};

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
    // As the router builds it by default (`--router-max-indexed-blocks`): bounded at 2^22
    // engine blocks, with its queue of stores.
    let bounded = KvIndex::with_max_blocks(workload::BS, 1 << 22);
    run("KvIndex bounded", bounded, &load);
    if with_reference {
        run("reference", ReferenceIndex::new(workload::BS), &load);
    }
    let threads = args
        .iter()
        .position(|a| a == "--threads")
        .and_then(|i| args.get(i + 1))
        .map_or("2", String::as_str);
    for n in threads.split(',').filter_map(|n| n.parse::<usize>().ok()) {
        if n > 0 {
            run_threads(n, &load);
        }
    }
}

/// `ShardedKvIndex` with `n` shards, shard `i`'s events applied by thread `i`: the build, then
/// the churn at full size with hit queries running alongside on this thread. An ingest thread
/// applies every round of its shard (started once, as the router's are).
fn run_threads(n: usize, load: &workload::Workload) {
    let name = format!("KvIndex x{n} (sharded, mirrored)");
    let index = ShardedKvIndex::new(workload::BS, n);
    let ingest = |churn: bool, rounds: usize| {
        std::thread::scope(|scope| {
            for shard in 0..n {
                let index = &index;
                scope.spawn(move || {
                    let mine = |r| index.shard_of(r) == shard;
                    let events = if churn { &load.churn } else { &load.build };
                    for _ in 0..rounds {
                        for stored in events.iter().filter(|s| mine(s.replica)) {
                            index
                                .stored(stored.replica, &stored.event())
                                .expect("valid");
                        }
                        for (replica, hashes) in
                            load.churn_removed.iter().filter(|(r, _)| churn && mine(*r))
                        {
                            index.removed(*replica, StorageTier::Device, hashes);
                        }
                    }
                });
            }
        })
    };
    let start = Instant::now();
    ingest(false, 1);
    let build = start.elapsed();
    println!(
        "{name}: build {:.2?} = {:.2} M block events/s; {} shard blocks, {:.1} MiB (both copies)",
        build,
        load.build_blocks as f64 / build.as_secs_f64() / 1e6,
        index.blocks(),
        index.heap_bytes() as f64 / (1 << 20) as f64,
    );
    const ROUNDS: usize = 10;
    let done = AtomicBool::new(false);
    let mut during = Vec::new();
    let start = Instant::now();
    let churn = std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            ingest(true, ROUNDS);
            let elapsed = start.elapsed();
            done.store(true, Ordering::Release);
            elapsed
        });
        let mut i = 0;
        while !done.load(Ordering::Acquire) {
            i = (i + 389) % load.hit.len();
            let begin = Instant::now();
            black_box(index.matches(black_box(&load.hit[i])));
            during.push(begin.elapsed());
        }
        writer.join().expect("writers")
    });
    println!(
        "{name}: churn at full size {:.2} M block events/s (stored + removed), with {} hit queries alongside: {}",
        (ROUNDS * 2 * load.churn_blocks) as f64 / churn.as_secs_f64() / 1e6,
        during.len(),
        percentiles(during)
    );
    let (after, _) = time_queries(&index, &load.hit, 20, false);
    println!("{name}: hit    {}", percentiles(after));
}
