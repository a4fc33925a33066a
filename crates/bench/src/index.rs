//! `kvroute-bench index`: replays a file of KV events ([`events`]) against the indexer and
//! prints block events per second, query latency percentiles and memory per block, for one
//! ingest thread (one [`KvIndex`]) and for N (a [`ShardedKvIndex`]: sharded by replica over
//! mirrored shards, each line's events under one write as the router applies an engine's
//! message, with hit queries timed while the writers run). It also writes such a file from
//! the synthetic workload of `kvroute-index`'s `query_latency` example (`--write`): one event
//! a line, or as vLLM publishes them (`--vllm-batches`: a chain's stored events in one line, a
//! removal as one `BlockRemoved` a block). `--max-indexed-blocks N` bounds the index as the
//! router bounds it by default.

use std::fs::File;
use std::hint::black_box;
use std::io::{BufReader, BufWriter};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use kvroute_index::{BlockHash, KvIndex, KvIndexer, OverlapScores, ShardedKvIndex};

pub mod events;
pub mod queries;

#[path = "../../index/benches/support/workload.rs"]
mod workload;

use events::{Op, Replay};
use queries::Queries;

/// `kvroute-bench index`'s flags.
#[derive(Debug, Args)]
pub struct IndexArgs {
    /// The replay file: JSON lines `{"worker": ID, "dp_rank": R, "events": [...]}`.
    #[arg(value_name = "FILE.jsonl", required_unless_present = "write")]
    pub file: Option<PathBuf>,
    /// Write the synthetic workload of `query_latency` (build, then churn: conversations
    /// stored and removed again) to this file, and stop.
    #[arg(long, value_name = "FILE.jsonl")]
    pub write: Option<PathBuf>,
    /// With --write: distinct blocks the workload builds.
    #[arg(long, default_value_t = 1_000_000)]
    pub blocks: usize,
    /// With --write: lines as vLLM publishes its events, each a batch: a chain's stored
    /// events in one line, and its removal as one `BlockRemoved` a block (as vLLM evicts), in
    /// one line [default: one event a line, a chain's removal one event]
    #[arg(long, requires = "write")]
    pub vllm_batches: bool,
    /// The router's block size.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Ingest thread counts to measure, each on a fresh index.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    /// Bound the index to this many engine blocks, as the router's
    /// `--router-max-indexed-blocks` does (its default is 4194304), evicting the least
    /// recently stored; unbounded if absent, as Dynamo's trees are.
    #[arg(long, value_name = "N", value_parser = parse_bound)]
    pub max_indexed_blocks: Option<usize>,
    /// Hit and miss queries drawn from the file.
    #[arg(long, default_value_t = 1024)]
    pub queries: usize,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

impl IndexArgs {
    pub fn run(&self) -> anyhow::Result<()> {
        if let Some(path) = &self.write {
            let lines = write_synthetic(path, self.blocks, self.seed, self.vllm_batches)?;
            println!("wrote {lines} lines to {}", path.display());
            return Ok(());
        }
        let path = self.file.as_ref().context("a replay file")?;
        let start = Instant::now();
        let file = File::open(path).with_context(|| format!("{}", path.display()))?;
        let replay = events::read(BufReader::new(file))?;
        let queries = queries::derive(&replay, self.block_size, self.queries, self.seed);
        println!(
            "{}: {} events, {} block events, {} replicas; {} hit and {} miss queries of {} blocks (read in {:.1?})",
            path.display(),
            replay.ops.len(),
            replay.block_events,
            replay.replicas.len(),
            queries.hit.len(),
            queries.miss.len(),
            queries::QUERY_BLOCKS,
            start.elapsed()
        );
        let mut single = 0.0;
        for &threads in &self.threads {
            let bound = self.max_indexed_blocks;
            let rate = if threads <= 1 {
                single_thread(&replay, &queries, new_index(self.block_size, bound))
            } else {
                sharded(&replay, &queries, self.block_size, threads, bound)
            };
            if threads <= 1 {
                single = rate;
            } else if single > 0.0 {
                println!("  {threads} threads: {:.2}x one thread", rate / single);
            }
        }
        Ok(())
    }
}

/// Writes the synthetic workload as a replay file; returns the lines. One event a line, or
/// with `vllm_batches` as vLLM publishes them: a replica's consecutive stored events (a chain)
/// in one line, and each removal as one `BlockRemoved` a block, in one line.
pub fn write_synthetic(
    path: &PathBuf,
    blocks: usize,
    seed: u64,
    vllm_batches: bool,
) -> anyhow::Result<usize> {
    let load = workload::build(blocks, seed);
    let mut out =
        BufWriter::new(File::create(path).with_context(|| format!("{}", path.display()))?);
    let mut lines = 0;
    let stored: Vec<&workload::Stored> = load.build.iter().chain(&load.churn).collect();
    let groups: Vec<&[&workload::Stored]> = match vllm_batches {
        true => stored.chunk_by(|a, b| a.replica == b.replica).collect(),
        false => stored.chunks(1).collect(),
    };
    for group in groups {
        let events: Vec<_> = (group.iter())
            .map(|s| events::stored_event(s.parent, &s.hashes, &s.tokens))
            .collect();
        events::write_line(&mut out, u64::from(group[0].replica.0), &events)?;
        lines += 1;
    }
    for (replica, hashes) in &load.churn_removed {
        let events: Vec<_> = match vllm_batches {
            true => hashes.chunks(1).map(events::removed_event).collect(),
            false => vec![events::removed_event(hashes)],
        };
        events::write_line(&mut out, u64::from(replica.0), &events)?;
        lines += 1;
    }
    std::io::Write::flush(&mut out)?;
    Ok(lines)
}

/// Applies every event to `index`; returns the events it refused.
pub fn replay_into<I: KvIndexer>(index: &mut I, replay: &Replay) -> usize {
    replay
        .ops
        .iter()
        .filter(|op| op.apply(index).is_err())
        .count()
}

/// `--max-indexed-blocks`: from 1 to the index's most, 2^27.
fn parse_bound(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if (1..=kvroute_index::kv_index::MAX_BOUND).contains(&n) => Ok(n),
        _ => Err(format!(
            "{value:?}: a count of engine blocks from 1 to {}",
            kvroute_index::kv_index::MAX_BOUND
        )),
    }
}

/// A `KvIndex` for `block_size`, bounded at `bound` engine blocks if given (at most
/// `kvroute_index::kv_index::MAX_BOUND`).
pub fn new_index(block_size: usize, bound: Option<usize>) -> KvIndex {
    match bound {
        Some(bound) => KvIndex::with_max_blocks(block_size, bound),
        None => KvIndex::new(block_size),
    }
}

/// One thread, one `KvIndex`; returns block events per second.
fn single_thread(replay: &Replay, queries: &Queries, mut index: KvIndex) -> f64 {
    let start = Instant::now();
    let refused = replay_into(&mut index, replay);
    let rate = rate(replay.block_events, start.elapsed());
    println!(
        "1 thread: {:.2} M block events/s ({refused} refused, {} evicted); {} blocks, {:.1} bytes/block ({:.1} MiB)",
        rate / 1e6,
        index.evicted_blocks(),
        index.num_blocks(),
        index.memory_bytes() as f64 / index.num_blocks().max(1) as f64,
        index.memory_bytes() as f64 / (1 << 20) as f64,
    );
    for (kind, list) in [("hit", &queries.hit), ("miss", &queries.miss)] {
        let times = time_queries(|q| index.find_matches(q), list, 5);
        println!("  {kind:<4} {}", percentiles(times));
    }
    rate
}

/// `threads` ingest threads over as many shards (bounded at `bound` engine blocks in all, if
/// given), hit queries timed alongside on this thread; returns block events per second.
fn sharded(
    replay: &Replay,
    queries: &Queries,
    block_size: usize,
    threads: usize,
    bound: Option<usize>,
) -> f64 {
    let index = match bound {
        // Split between the shards, as the router splits it.
        Some(bound) => ShardedKvIndex::with_max_blocks(block_size, threads, bound),
        None => ShardedKvIndex::new(block_size, threads),
    };
    // Each writer's lines, taken apart before the clock starts.
    let mut parts: Vec<Vec<&[Op]>> = vec![Vec::new(); index.shards()];
    for line in &replay.lines {
        let ops = &replay.ops[line.clone()];
        parts[index.shard_of(ops[0].replica())].push(ops);
    }
    let done = AtomicBool::new(false);
    let mut during = Vec::new();
    let start = Instant::now();
    let elapsed = std::thread::scope(|scope| {
        let writers: Vec<_> = parts
            .into_iter()
            .map(|part| {
                let index = &index;
                scope.spawn(move || {
                    part.into_iter()
                        .map(|ops| apply_line(index, ops))
                        .sum::<usize>()
                })
            })
            .collect();
        let clock = scope.spawn(|| {
            let refused: usize = writers.into_iter().map(|w| w.join().expect("writer")).sum();
            let elapsed = start.elapsed();
            done.store(true, Ordering::Release);
            (elapsed, refused)
        });
        let mut i = 0;
        while !done.load(Ordering::Acquire) && !queries.hit.is_empty() {
            let query = &queries.hit[i % queries.hit.len()];
            let begin = Instant::now();
            black_box(index.matches(black_box(query)));
            during.push(begin.elapsed());
            i += 1;
        }
        clock.join().expect("clock")
    });
    let (elapsed, refused) = elapsed;
    let rate = rate(replay.block_events, elapsed);
    println!(
        "{threads} threads (sharded by replica, mirrored): {:.2} M block events/s ({refused} refused), hit queries alongside; {} shard blocks, {:.1} MiB",
        rate / 1e6,
        index.blocks(),
        index.heap_bytes() as f64 / (1 << 20) as f64,
    );
    if !during.is_empty() {
        println!(
            "  hit during ingest ({} queries) {}",
            during.len(),
            percentiles(during)
        );
    }
    for (kind, list) in [("hit", &queries.hit), ("miss", &queries.miss)] {
        let times = time_queries(|q| index.matches(q), list, 5);
        println!("  {kind:<4} {}", percentiles(times));
    }
    rate
}

/// Applies one line's events (one replica's) under one write of its shard, as the router
/// applies a message of an engine's events; returns the events refused.
fn apply_line(index: &ShardedKvIndex, ops: &[Op]) -> usize {
    index.batch(ops[0].replica(), |events| {
        ops.iter().filter(|op| events.apply(op).is_err()).count()
    })
}

fn rate(block_events: usize, elapsed: Duration) -> f64 {
    block_events as f64 / elapsed.as_secs_f64().max(1e-9)
}

/// Times every query `rounds` times, in a shuffled order each round.
fn time_queries(
    find: impl Fn(&[BlockHash]) -> OverlapScores,
    queries: &[Vec<BlockHash>],
    rounds: usize,
) -> Vec<Duration> {
    let mut times = Vec::with_capacity(queries.len() * rounds);
    for round in 0..rounds {
        for i in 0..queries.len() {
            let query = &queries[(i * 389 + round * 97) % queries.len()];
            let start = Instant::now();
            black_box(find(black_box(query)));
            times.push(start.elapsed());
        }
    }
    times
}

/// `p50 … p90 … p99 … max …`; empty input prints dashes.
pub fn percentiles(mut times: Vec<Duration>) -> String {
    if times.is_empty() {
        return "-".to_owned();
    }
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
