//! kvroute's `KvIndex` beside dynamo-kv-router 1.6.1's indexers, on the same events and
//! queries (query_latency's workload: 64 replicas, system prompts and conversations, 512-block
//! queries; `BLOCKS` distinct blocks, 1,000,000 by default), in one criterion run:
//!
//! ```text
//! cd bench/indexer-vs-dynamo && BLOCKS=1000000 cargo bench --bench compare
//! ```
//!
//! Per structure: `build` (every build event on an empty index), `churn` (at full size,
//! conversations stored then removed, so each iteration ends where it began) and `hit`,
//! `system`, `miss` queries (time per query, cycling through 1,024). Throughput is in block
//! events. Structures, each driven as Dynamo's own code drives it:
//! - `Dynamo tokens_hash`: not an index, the cost of the local hashes Dynamo's event path
//!   computes from the tokens before its indexer sees an event (KvIndex hashes the tokens
//!   itself, inside `apply_stored`); add it to Dynamo's build and churn rows for a like-for-like
//!   comparison;
//! - `KvIndex` (kvroute, one thread), and `KvIndex bounded`, as the router builds it by
//!   default (at most 2^22 engine blocks, the least recently stored evicted first: a queue of
//!   stores beside the index);
//! - `Runs (probe)`: not an index kvroute ships, the design probe of `indexer_vs_dynamo::runs`
//!   (runs of blocks, one thread; it leaves out tiers, re-blocking and the bound), to measure
//!   that layout against the others;
//! - `RadixTree` (Dynamo's single-threaded tree, `apply_event` / `find_matches`);
//! - `PositionalIndexer` alone (`apply_event` with its worker-blocks map, on this thread);
//! - `CRTC+TP1`, `CRTC+TP2`: `ConcurrentRadixTreeCompressed` in `ThreadPoolIndexer` with 1 and
//!   2 threads (its events are applied only by a pool thread's loop: `enqueue_event`, then
//!   `flush`; queries run inline on the caller, as the pool does);
//! - `Positional+TP2`: the `PositionalIndexer` in `ThreadPoolIndexer` with 2 threads;
//! - `KvIndex x2`: kvroute's `ShardedKvIndex`, sharded by replica over 2 ingest threads, each
//!   shard mirrored (its records once, two copies of its block table: queries read one while
//!   the shard's writer changes the other, and never wait for it; queries read both shards).
//!   Each event is one write. The ingest threads live as long as the subject, as a pool's do,
//!   and the caller hands them the events and waits for them, as for a pool's `flush`;
//! - `KvIndex x2 batched`: the same, each run of consecutive events of one replica (here a
//!   conversation's) one write, as the router applies an engine's message.
//!
//! Then, once each, not as criterion figures (`ALONGSIDE=0` skips them): `KvIndex x2`,
//! `KvIndex x2 batched`, `CRTC+TP2` and `Positional+TP2`, at full size, apply the churn events
//! 100 times while this thread runs hit queries alongside, back to back and then one every
//! 20 µs; `alongside:` lines give the rate and the queries' p50 / p99. Three busy threads on a
//! 2-core machine share it as the scheduler decides, and the split moves between runs; so each
//! line also gives the CPU time the writers and the queries had (Linux's per-thread
//! `schedstat`) and the rates per CPU-second, which do not depend on the split.

use std::hint::black_box;
use std::panic::AssertUnwindSafe;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use dynamo_kv_router::indexer::{
    concurrent_radix_tree_compressed::ConcurrentRadixTreeCompressed, positional::PositionalIndexer,
    RadixTree, SyncIndexer, ThreadPoolIndexer,
};
use dynamo_kv_router::protocols::{LocalBlockHash, RouterEvent};
use indexer_vs_dynamo::runs::RunIndex;
use indexer_vs_dynamo::{local_hashes, Converter};
use kvroute_index::{BlockHash, KvIndex, KvIndexer, OverlapScores, ShardedKvIndex, StorageTier};

#[path = "../../../crates/index/benches/support/workload.rs"]
mod workload;

use workload::{Workload, BS};

/// The workload in Dynamo's form.
struct Dyn {
    build: Vec<RouterEvent>,
    churn: Vec<RouterEvent>,
    hit: Vec<Vec<LocalBlockHash>>,
    system: Vec<Vec<LocalBlockHash>>,
    miss: Vec<Vec<LocalBlockHash>>,
}

fn convert(load: &Workload) -> Dyn {
    let mut c = Converter::default();
    let hashes = |h: &[kvroute_index::EngineHash]| h.iter().map(|h| h.0).collect::<Vec<_>>();
    let mut stored = |s: &workload::Stored| {
        let parent = s.parent.map(|p| p.0);
        c.stored(
            u64::from(s.replica.0),
            parent,
            &hashes(&s.hashes),
            &s.tokens,
            BS as u32,
        )
    };
    let build = load.build.iter().map(&mut stored).collect();
    let mut churn: Vec<RouterEvent> = load.churn.iter().map(&mut stored).collect();
    for (replica, removed) in &load.churn_removed {
        churn.push(c.removed(u64::from(replica.0), &hashes(removed)));
    }
    let locals = |qs: &[Vec<u32>]| qs.iter().map(|t| local_hashes(t, BS as u32)).collect();
    Dyn {
        build,
        churn,
        hit: locals(&load.hit_tokens),
        system: locals(&load.system_tokens),
        miss: locals(&load.miss_tokens),
    }
}

/// One indexer under test, at full size once built.
trait Subject {
    fn name(&self) -> String;
    fn apply(&mut self, events: Events<'static>);
    /// Blocks matched by the best replica (so the answer is used).
    fn query(&self, kv: &[BlockHash], dynamo: &[LocalBlockHash]) -> u32;
    /// Whether it answers queries (the hashing row does not).
    fn answers(&self) -> bool {
        true
    }
}

/// Not an index: Dynamo's `tokens_hash` of every stored block, which its event path computes
/// before the indexer sees the event (KvIndex hashes tokens inside `apply_stored`), so that a
/// reader can add it to Dynamo's rows.
struct Hashing;

impl Subject for Hashing {
    fn name(&self) -> String {
        "Dynamo tokens_hash".into()
    }
    fn apply(&mut self, events: Events<'static>) {
        let stored = match events {
            Events::Build(load, _) => &load.build,
            Events::Churn(load, _) => &load.churn,
        };
        for s in stored {
            black_box(local_hashes(black_box(&s.tokens), BS as u32));
        }
    }
    fn query(&self, _: &[BlockHash], _: &[LocalBlockHash]) -> u32 {
        0
    }
    fn answers(&self) -> bool {
        false
    }
}

/// The same events in both forms; each subject reads its own.
#[derive(Clone, Copy)]
enum Events<'a> {
    Build(&'a Workload, &'a [RouterEvent]),
    Churn(&'a Workload, &'a [RouterEvent]),
}

fn kv_apply(index: &mut impl KvIndexer, events: Events<'_>) {
    match events {
        Events::Build(load, _) => {
            for s in &load.build {
                index.apply_stored(s.replica, &s.event()).expect("valid");
            }
        }
        Events::Churn(load, _) => {
            for s in &load.churn {
                index.apply_stored(s.replica, &s.event()).expect("valid");
            }
            for (replica, hashes) in &load.churn_removed {
                index.apply_removed(*replica, StorageTier::Device, hashes);
            }
        }
    }
}

fn dynamo_events<'a>(events: Events<'a>) -> &'a [RouterEvent] {
    match events {
        Events::Build(_, e) | Events::Churn(_, e) => e,
    }
}

fn best(scores: &OverlapScores) -> u32 {
    scores
        .scores
        .iter()
        .map(|(_, c)| c.total())
        .max()
        .unwrap_or(0)
}

fn dyn_best(scores: &dynamo_kv_router::protocols::OverlapScores) -> u32 {
    scores.scores.values().copied().max().unwrap_or(0)
}

/// kvroute's `KvIndex` unbounded, or (`bounded`) as the router builds it by default: at most
/// 2^22 engine blocks (`--router-max-indexed-blocks`), with its queue of stores.
struct Kv(KvIndex, bool);

impl Kv {
    fn new(bounded: bool) -> Self {
        match bounded {
            true => Self(KvIndex::with_max_blocks(BS, 1 << 22), true),
            false => Self(KvIndex::new(BS), false),
        }
    }
}

impl Subject for Kv {
    fn name(&self) -> String {
        match self.1 {
            true => "KvIndex bounded".into(),
            false => "KvIndex".into(),
        }
    }
    fn apply(&mut self, events: Events<'static>) {
        kv_apply(&mut self.0, events);
    }
    fn query(&self, kv: &[BlockHash], _: &[LocalBlockHash]) -> u32 {
        best(&self.0.find_matches(kv))
    }
}

/// kvroute's `ShardedKvIndex` over N threads: shard `i`'s events applied by ingest thread `i`,
/// each event one write, or (`batched`) each run of consecutive events of one replica one write,
/// as the router applies an engine's message (a vLLM step's events: one write per message).
/// The ingest threads live as long as the subject (as a pool's, and as the router's): `apply`
/// hands them the events and waits for them (as a pool's `flush`).
struct KvShards {
    index: Arc<ShardedKvIndex>,
    batched: bool,
    jobs: Vec<mpsc::Sender<Events<'static>>>,
    done: Mutex<mpsc::Receiver<bool>>,
}

impl KvShards {
    fn new(shards: usize, batched: bool) -> Self {
        let index = Arc::new(ShardedKvIndex::new(BS, shards));
        let (finished, done) = mpsc::channel();
        let jobs = (0..shards)
            .map(|shard| {
                let (job, events) = mpsc::channel::<Events<'static>>();
                let (index, finished) = (Arc::clone(&index), finished.clone());
                std::thread::spawn(move || {
                    for events in events {
                        // A panic is reported to the waiting caller, not left to hang it.
                        let apply = || apply_shard(&index, shard, events, batched);
                        let applied = std::panic::catch_unwind(AssertUnwindSafe(apply));
                        finished.send(applied.is_ok()).expect("the subject waits");
                    }
                });
                job
            })
            .collect();
        Self {
            index,
            batched,
            jobs,
            done: Mutex::new(done),
        }
    }

    fn ingest(&self, events: Events<'static>) {
        let done = self.done.lock().expect("one ingest at a time");
        for job in &self.jobs {
            job.send(events).expect("ingest threads running");
        }
        for _ in &self.jobs {
            let applied = done.recv().expect("ingest threads running");
            assert!(applied, "an ingest thread failed (see its panic above)");
        }
    }
}

/// Applies shard `shard`'s events of `events` (see [`KvShards`]).
fn apply_shard(index: &ShardedKvIndex, shard: usize, events: Events<'_>, batched: bool) {
    let mine = |r: kvroute_index::ReplicaId| index.shard_of(r) == shard;
    let store = |stored: &[workload::Stored]| {
        let runs = stored.chunk_by(|a, b| batched && a.replica == b.replica);
        for run in runs.filter(|run| mine(run[0].replica)) {
            index.batch(run[0].replica, |events| {
                for s in run {
                    events.stored(&s.event()).expect("valid");
                }
            });
        }
    };
    match events {
        Events::Build(load, _) => store(&load.build),
        Events::Churn(load, _) => {
            store(&load.churn);
            let removed = &load.churn_removed;
            let runs = removed.chunk_by(|a, b| batched && a.0 == b.0);
            for run in runs.filter(|run| mine(run[0].0)) {
                index.batch(run[0].0, |events| {
                    for (_, hashes) in run {
                        events.removed(StorageTier::Device, hashes);
                    }
                });
            }
        }
    }
}

impl Subject for KvShards {
    fn name(&self) -> String {
        let batched = if self.batched { " batched" } else { "" };
        format!("KvIndex x{}{batched}", self.index.shards())
    }
    fn apply(&mut self, events: Events<'static>) {
        self.ingest(events);
    }
    fn query(&self, kv: &[BlockHash], _: &[LocalBlockHash]) -> u32 {
        best(&self.index.matches(kv))
    }
}

/// The run-based design probe (`indexer_vs_dynamo::runs`), not an index kvroute ships.
struct Runs(RunIndex);

impl Subject for Runs {
    fn name(&self) -> String {
        "Runs (probe)".into()
    }
    fn apply(&mut self, events: Events<'static>) {
        let stored = |index: &mut RunIndex, s: &workload::Stored| {
            index.stored(s.replica.0, s.parent, &s.hashes, &s.tokens, BS);
        };
        match events {
            Events::Build(load, _) => load.build.iter().for_each(|s| stored(&mut self.0, s)),
            Events::Churn(load, _) => {
                load.churn.iter().for_each(|s| stored(&mut self.0, s));
                for (replica, hashes) in &load.churn_removed {
                    self.0.removed(replica.0, hashes);
                }
            }
        }
    }
    fn query(&self, kv: &[BlockHash], _: &[LocalBlockHash]) -> u32 {
        (self.0.find_matches(kv).iter().map(|m| m.1))
            .max()
            .unwrap_or(0)
    }
}

struct Radix(RadixTree);

impl Subject for Radix {
    fn name(&self) -> String {
        "RadixTree".into()
    }
    fn apply(&mut self, events: Events<'static>) {
        for e in dynamo_events(events) {
            self.0.apply_event(e.clone()).expect("valid");
        }
    }
    fn query(&self, _: &[BlockHash], dynamo: &[LocalBlockHash]) -> u32 {
        dyn_best(&self.0.find_matches(dynamo.to_vec(), false))
    }
}

struct Positional {
    index: PositionalIndexer,
    workers: std::collections::HashMap<
        dynamo_kv_router::protocols::WorkerWithDpRank,
        dynamo_kv_router::indexer::positional::LevelIndex,
        rustc_hash::FxBuildHasher,
    >,
}

impl Subject for Positional {
    fn name(&self) -> String {
        "PositionalIndexer".into()
    }
    fn apply(&mut self, events: Events<'static>) {
        for e in dynamo_events(events) {
            self.index
                .apply_event(&mut self.workers, e.clone(), None)
                .expect("valid");
        }
    }
    fn query(&self, _: &[BlockHash], dynamo: &[LocalBlockHash]) -> u32 {
        dyn_best(&self.index.find_matches(dynamo, false))
    }
}

struct Pool<T: SyncIndexer> {
    name: &'static str,
    pool: ThreadPoolIndexer<T>,
    threads: usize,
    runtime: tokio::runtime::Runtime,
}

impl<T: SyncIndexer> Pool<T> {
    fn new(name: &'static str, backend: T, threads: usize) -> Self {
        Self {
            name,
            pool: ThreadPoolIndexer::new(backend, threads, BS as u32),
            threads,
            runtime: tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime"),
        }
    }
}

impl<T: SyncIndexer> Pool<T> {
    fn ingest(&self, events: Events<'static>) {
        for e in dynamo_events(events) {
            self.pool.enqueue_event(e.clone()).expect("pool running");
        }
        self.runtime.block_on(self.pool.flush());
    }
}

impl<T: SyncIndexer> Subject for Pool<T> {
    fn name(&self) -> String {
        format!("{}+TP{}", self.name, self.threads)
    }
    fn apply(&mut self, events: Events<'static>) {
        self.ingest(events);
    }
    fn query(&self, _: &[BlockHash], dynamo: &[LocalBlockHash]) -> u32 {
        dyn_best(&self.pool.backend().find_matches(dynamo, false))
    }
}

fn subjects() -> Vec<Box<dyn Fn() -> Box<dyn Subject>>> {
    vec![
        Box::new(|| Box::new(Kv::new(false))),
        Box::new(|| Box::new(Kv::new(true))),
        Box::new(|| Box::new(Hashing)),
        Box::new(|| Box::new(Runs(RunIndex::default()))),
        Box::new(|| Box::new(Radix(RadixTree::new()))),
        Box::new(|| {
            Box::new(Positional {
                index: PositionalIndexer::new(32),
                workers: Default::default(),
            })
        }),
        Box::new(|| Box::new(Pool::new("CRTC", ConcurrentRadixTreeCompressed::new(), 1))),
        Box::new(|| Box::new(Pool::new("CRTC", ConcurrentRadixTreeCompressed::new(), 2))),
        Box::new(|| Box::new(Pool::new("Positional", PositionalIndexer::new(32), 2))),
        Box::new(|| Box::new(KvShards::new(2, false))),
        Box::new(|| Box::new(KvShards::new(2, true))),
    ]
}

fn compare(c: &mut Criterion) {
    let blocks = std::env::var("BLOCKS")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(1_000_000);
    // For the whole run: the ingest threads of `KvIndex x2` live as long as their subject, as
    // a pool's do.
    let load: &'static Workload = Box::leak(Box::new(workload::build(blocks, 7)));
    let dynamo: &'static Dyn = Box::leak(Box::new(convert(load)));
    let churn_blocks = 2 * load.churn_blocks as u64;
    eprintln!(
        "workload: {} build block events, {churn_blocks} churn block events",
        load.build_blocks
    );
    for make in subjects() {
        let name = make().name();
        let mut group = c.benchmark_group(name.clone());
        group.sample_size(10);
        group.warm_up_time(Duration::from_millis(500));
        group.measurement_time(Duration::from_secs(3));
        group.throughput(Throughput::Elements(load.build_blocks as u64));
        group.bench_function("build", |b| {
            b.iter_batched(
                &make,
                |mut s| {
                    s.apply(Events::Build(load, &dynamo.build));
                    s
                },
                BatchSize::PerIteration,
            )
        });
        let mut full = make();
        full.apply(Events::Build(load, &dynamo.build));
        group.throughput(Throughput::Elements(churn_blocks));
        group.bench_function("churn", |b| {
            b.iter(|| full.apply(Events::Churn(load, &dynamo.churn)))
        });
        group.throughput(Throughput::Elements(1));
        if !full.answers() {
            group.finish();
            continue;
        }
        for (kind, kv, dy) in [
            ("hit", &load.hit, &dynamo.hit),
            ("system", &load.system, &dynamo.system),
            ("miss", &load.miss, &dynamo.miss),
        ] {
            let mut i = 0;
            group.bench_function(kind, |b| {
                b.iter(|| {
                    i = (i + 389) % kv.len();
                    black_box(full.query(black_box(&kv[i]), black_box(&dy[i])))
                })
            });
            let matched: u64 = (0..kv.len())
                .map(|i| u64::from(full.query(&kv[i], &dy[i])))
                .sum();
            eprintln!(
                "{name}: {kind} best match {:.1} blocks on average",
                matched as f64 / kv.len() as f64
            );
        }
        group.finish();
    }
    if std::env::var("ALONGSIDE").map_or(true, |v| v != "0") {
        alongside(load, dynamo);
    }
}

/// At full size, the churn events applied 100 times on 2 threads with hit queries running
/// alongside on this thread, once each (not a criterion figure): block events/s and the
/// queries' p50 / p99 while the writers run. First with the queries back to back, then paced at
/// one every 20 µs (50,000 a second: a router answering that many requests is busy; a late
/// wake is caught up), so that the writers of every subject meet the same query load.
fn alongside(load: &'static Workload, dynamo: &'static Dyn) {
    for pace in [None, Some(Duration::from_micros(20))] {
        run_alongside(pace, load, dynamo, &KvShards::new(2, false));
        run_alongside(pace, load, dynamo, &KvShards::new(2, true));
        let crtc = Pool::new("CRTC", ConcurrentRadixTreeCompressed::new(), 2);
        run_alongside(pace, load, dynamo, &crtc);
        let positional = Pool::new("Positional", PositionalIndexer::new(32), 2);
        run_alongside(pace, load, dynamo, &positional);
    }
}

/// A subject whose events are applied through a shared reference, from another thread than
/// its queries.
trait Concurrent: Subject + Sync {
    fn ingest(&self, events: Events<'static>);
}

impl Concurrent for KvShards {
    fn ingest(&self, events: Events<'static>) {
        KvShards::ingest(self, events);
    }
}

impl<T: SyncIndexer> Concurrent for Pool<T> {
    fn ingest(&self, events: Events<'static>) {
        Pool::ingest(self, events);
    }
}

fn run_alongside(
    pace: Option<Duration>,
    load: &'static Workload,
    dynamo: &'static Dyn,
    subject: &impl Concurrent,
) {
    const ROUNDS: usize = 100;
    let name = subject.name();
    subject.ingest(Events::Build(load, &dynamo.build));
    let done = std::sync::atomic::AtomicBool::new(false);
    let mut times = Vec::new();
    let (process, this) = (process_cpu(), thread_cpu());
    let start = std::time::Instant::now();
    let (elapsed, feeder) = std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let cpu = thread_cpu();
            for _ in 0..ROUNDS {
                subject.ingest(Events::Churn(load, &dynamo.churn));
            }
            let elapsed = start.elapsed();
            done.store(true, std::sync::atomic::Ordering::Release);
            (
                elapsed,
                thread_cpu().zip(cpu).map(|(after, before)| after - before),
            )
        });
        let mut i = 0;
        let paced = std::time::Instant::now();
        while !done.load(std::sync::atomic::Ordering::Acquire) {
            if let Some(pace) = pace {
                // The queries due by now, one a `pace`: sleeps while none is, and catches up
                // after a late wake (a sleep is often longer than `pace`), so that every
                // subject meets the same number of queries a second.
                let due = paced.elapsed().as_nanos() / pace.as_nanos();
                if times.len() as u128 >= due {
                    std::thread::sleep(pace);
                    continue;
                }
            }
            i = (i + 389) % load.hit.len();
            let t = std::time::Instant::now();
            black_box(subject.query(&load.hit[i], &dynamo.hit[i]));
            times.push(t.elapsed());
        }
        writer.join().expect("writer")
    });
    // The writers' CPU: the threads alive before and after (the ingest threads) but this
    // one, and the thread that fed them their events (a pool's producer clones and sends
    // every event; kvroute's hands each shard thread the whole round), which has exited.
    let cpu = process_cpu()
        .zip(process)
        .zip(thread_cpu().zip(this))
        .zip(feeder)
        .map(|(((p1, p0), (t1, t0)), feeder)| (p1 - p0 - (t1 - t0) + feeder, t1 - t0));
    if times.is_empty() {
        return;
    }
    times.sort_unstable();
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    let label = match pace {
        Some(pace) => format!("alongside, a query every {pace:?}"),
        None => "alongside".to_string(),
    };
    let events = (ROUNDS * 2 * load.churn_blocks) as f64;
    let per_cpu = cpu.map_or(String::new(), |(writers, queries)| {
        format!(
            "; CPU: writers {writers:.2} s ({:.2} M block events per CPU-second), queries \
             {queries:.2} s ({:.0} per CPU-second)",
            events / writers / 1e6,
            times.len() as f64 / queries
        )
    });
    eprintln!(
        "{label}: {name}: churn at full size {:.2} M block events/s with {} hit queries alongside ({:.0}/s): p50 {:.2?} p99 {:.2?}{per_cpu}",
        events / elapsed.as_secs_f64() / 1e6,
        times.len(),
        times.len() as f64 / elapsed.as_secs_f64(),
        at(0.5),
        at(0.99)
    );
}

/// Seconds of CPU the kernel has given this process's threads alive now (Linux; `None`
/// elsewhere). Every subject's threads live as long as it does.
fn process_cpu() -> Option<f64> {
    let tasks = std::fs::read_dir("/proc/self/task").ok()?;
    tasks
        .map(|task| cpu_seconds(&task.ok()?.path().join("schedstat")))
        .sum()
}

/// Seconds of CPU the kernel has given this thread (Linux; `None` elsewhere).
fn thread_cpu() -> Option<f64> {
    cpu_seconds(std::path::Path::new("/proc/thread-self/schedstat"))
}

/// The first field of a `schedstat` file: nanoseconds on a CPU.
fn cpu_seconds(schedstat: &std::path::Path) -> Option<f64> {
    let text = std::fs::read_to_string(schedstat).ok()?;
    let nanos: u64 = text.split_whitespace().next()?.parse().ok()?;
    Some(nanos as f64 / 1e9)
}

criterion_group!(benches, compare);
criterion_main!(benches);
