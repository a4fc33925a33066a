//! `kvroute-bench`: trace replay tools.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvroute_bench::simulate::{simulate, SimConfig};
use kvroute_bench::trace;
use kvroute_core::{PolicyConfig, PolicyKind};
use kvroute_sim::engine::EngineConfig;

#[derive(Debug, Parser)]
#[command(
    name = "kvroute-bench",
    version,
    about = "Measure routing quality on a trace"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A trace replayed in real time against an OpenAI-compatible endpoint, streaming.
    Replay {
        #[arg(long)]
        trace: PathBuf,
        #[arg(long)]
        url: String,
        /// The `model` field to send (omit for a router serving one model).
        #[arg(long)]
        model: Option<String>,
        #[arg(long, default_value_t = 512)]
        hash_block_size: usize,
        #[arg(long, default_value_t = 1.0)]
        rate_scale: f64,
        #[arg(long)]
        max_requests: Option<usize>,
        #[arg(long, default_value_t = 256)]
        max_concurrency: usize,
        /// Stop sending after this many seconds.
        #[arg(long)]
        duration: Option<f64>,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// A trace through the real routing core and N simulated engines, in virtual time.
    Simulate {
        #[arg(long)]
        trace: PathBuf,
        #[arg(long, default_value_t = 8)]
        workers: usize,
        /// Comma-separated policy names.
        #[arg(long, default_value = "kv_aware,round_robin")]
        policies: String,
        /// Tokens per trace hash id.
        #[arg(long, default_value_t = 512)]
        hash_block_size: usize,
        #[arg(long, default_value_t = 1.0)]
        rate_scale: f64,
        #[arg(long)]
        max_requests: Option<usize>,
        #[arg(long, default_value_t = 16384)]
        num_gpu_blocks: usize,
        #[arg(long, default_value_t = 16)]
        block_size: usize,
        #[arg(long, default_value_t = 256)]
        max_num_seqs: usize,
        #[arg(long, default_value_t = 8192)]
        max_num_batched_tokens: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write the figures as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Replay {
            trace: path,
            url,
            model,
            hash_block_size,
            rate_scale,
            max_requests,
            max_concurrency,
            duration,
            json,
        } => {
            let mut requests = trace::load(&path)?;
            if let Some(m) = max_requests {
                requests.truncate(m);
            }
            let cfg = kvroute_bench::replay::ReplayConfig {
                url: url.trim_end_matches('/').to_owned(),
                model,
                hash_block: hash_block_size,
                rate_scale,
                max_concurrency,
                duration: duration.map(std::time::Duration::from_secs_f64),
                progress: true,
            };
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let r = runtime.block_on(kvroute_bench::replay::replay(&requests, &cfg));
            println!(
                "{} requests, {} errors; TTFT ms p50/p90/p99 {:.0}/{:.0}/{:.0}; ITL ms {:.1}/{:.1}/{:.1}; E2E ms {:.0}/{:.0}/{:.0}; {:.2} req/s, {:.0} out tok/s; cached {:.1}% of prompt tokens; per worker {:?}",
                r.requests, r.errors, r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99, r.itl_ms.p50, r.itl_ms.p90,
                r.itl_ms.p99, r.e2e_ms.p50, r.e2e_ms.p90, r.e2e_ms.p99, r.throughput_rps, r.output_tokens_per_s,
                r.hit_share * 100.0, r.requests_per_worker
            );
            if let Some(out) = json {
                let doc = serde_json::json!({"trace": path.display().to_string(), "url": cfg.url, "policies": [r]});
                std::fs::write(&out, serde_json::to_string_pretty(&doc)?)
                    .with_context(|| format!("cannot write {}", out.display()))?;
            }
        }
        Command::Simulate {
            trace: path,
            workers,
            policies,
            hash_block_size,
            rate_scale,
            max_requests,
            num_gpu_blocks,
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
            seed,
            json,
        } => {
            let mut requests = trace::load(&path)?;
            if let Some(m) = max_requests {
                requests.truncate(m);
            }
            let kinds: Vec<PolicyKind> = policies
                .split(',')
                .map(|p| p.trim().parse::<PolicyKind>())
                .collect::<Result<_, _>>()?;
            let bound = trace::hit_bound(&requests, hash_block_size);
            println!(
                "trace {} ({} requests), {workers} workers x {num_gpu_blocks} blocks of {block_size}, rate x{rate_scale}; unbounded-cache hit bound {:.1}%",
                path.display(),
                requests.len(),
                bound * 100.0
            );
            println!(
                "{:<16} {:>22} {:>22} {:>8} {:>9} {:>7} {:>7}",
                "policy",
                "TTFT ms p50/p90/p99",
                "E2E ms p50/p90/p99",
                "req/s",
                "out tok/s",
                "hit %",
                "preempt"
            );
            let mut results = Vec::new();
            for kind in kinds {
                let started = std::time::Instant::now();
                let r = simulate(
                    &requests,
                    &SimConfig {
                        workers,
                        engine: EngineConfig {
                            num_gpu_blocks,
                            block_size,
                            max_num_seqs,
                            max_num_batched_tokens,
                            ..EngineConfig::default()
                        },
                        policy: kind,
                        policy_config: PolicyConfig::default(),
                        hash_block: hash_block_size,
                        vocab: 32000,
                        rate_scale,
                        seed,
                    },
                );
                println!(
                    "{:<16} {:>22} {:>22} {:>8.2} {:>9.0} {:>7.1} {:>7}   ({:.1}s; per worker {:?})",
                    r.policy,
                    format!("{:.0}/{:.0}/{:.0}", r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99),
                    format!("{:.0}/{:.0}/{:.0}", r.e2e_ms.p50, r.e2e_ms.p90, r.e2e_ms.p99),
                    r.throughput_rps,
                    r.output_tokens_per_s,
                    r.hit_share * 100.0,
                    r.preemptions,
                    started.elapsed().as_secs_f64(),
                    r.requests_per_worker
                );
                results.push(r);
            }
            if let Some(out) = json {
                let doc = serde_json::json!({
                    "trace": path.display().to_string(),
                    "workers": workers,
                    "hit_bound": bound,
                    "policies": results,
                });
                std::fs::write(&out, serde_json::to_string_pretty(&doc)?)
                    .with_context(|| format!("cannot write {}", out.display()))?;
            }
        }
    }
    Ok(())
}
