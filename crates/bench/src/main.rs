//! `kvroute-bench`: trace replay, virtual-time simulation and SLO goodput; the flags are parsed
//! here, the work is the library's.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand};
use kvroute_bench::commands::{self, Setup};
use kvroute_bench::simulate::{Cluster, EngineShapes, OutputTracking, PdCluster};
use kvroute_bench::sweep::Percentile;
use kvroute_bench::synthetic::{SyntheticArgs, SyntheticKind};
use kvroute_bench::trace::{self, TraceRequest};
use kvroute_core::{CostModel, KvAwareConfig, MemoryCost, PolicyConfig, PolicyKind};
use kvroute_sim::engine::{EngineConfig, SchedulingPolicy, TimingModel};
use kvroute_sim::TimingArgs;

mod goodput_args;
mod lora_args;
mod queue_args;
mod replay_args;
mod slo_args;
use goodput_args::GoodputArgs;
use lora_args::LoraArgs;
use queue_args::{QueueArgs, TenantArgs};
use replay_args::ReplayArgs;
use slo_args::SloArgs;

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

/// Where the requests come from: exactly one of a trace and a generator.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
struct Source {
    /// A Mooncake JSONL trace.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// A generated workload instead of a trace (its flags are listed below).
    #[arg(long, value_enum)]
    synthetic: Option<SyntheticKind>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum CostModelArg {
    Weighted,
    Predicted,
    Calibrated,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum MemoryCostArg {
    Linear,
    Utilisation,
}

/// `kv_aware`'s cost weights, with the gateway's flag names; unset ones keep the gateway's
/// defaults.
#[derive(Debug, Args)]
#[command(next_help_heading = "kv_aware (as the gateway's flags)")]
struct KvAwareArgs {
    /// What kv_aware minimises: weighted (the weighted sum of blocks; the weight flags below
    /// apply to it), calibrated (that sum with each engine's terms priced at the speed its
    /// timings show) or predicted (milliseconds from latency models each engine's timings
    /// train) [default: calibrated].
    #[arg(long, value_enum)]
    router_cost_model: Option<CostModelArg>,
    /// Credit per prefix block cached on the device [default: 2.0; Dynamo's: 1.0].
    #[arg(long)]
    router_kv_overlap_score_credit: Option<f64>,
    /// Weight of the prefill term [default: 4.0; Dynamo's: 1.0].
    #[arg(long)]
    router_prefill_load_scale: Option<f64>,
    /// How the memory term counts KV blocks: linear (Dynamo's) or utilisation (weighted by the
    /// engine's KV utilisation after the request) [default: linear].
    #[arg(long, value_enum)]
    router_kv_memory_cost: Option<MemoryCostArg>,
    /// Weight of the prefill-interference term (uncached blocks x requests decoding there;
    /// 0: Dynamo's model) [default: 0.25].
    #[arg(long)]
    router_prefill_interference_weight: Option<f64>,
    /// Weight of the KV-overflow term (blocks beyond 90% of an engine's KV, as prefill; 0:
    /// Dynamo's model) [default: 4].
    #[arg(long)]
    router_kv_overflow_weight: Option<f64>,
    /// Weight of the request's own decode at each engine's learned speed (calibrated model;
    /// 0: off) [default: 3000].
    #[arg(long)]
    router_own_decode_weight: Option<f64>,
    /// Weight of each active request [default: 0].
    #[arg(long)]
    router_decode_active_request_weight: Option<f64>,
    /// Sample from a softmax over costs at this temperature; 0 picks the cheapest [default: 0].
    #[arg(long)]
    router_temperature: Option<f64>,
    /// Count a decode block each time an answer needs one more as it generates (Dynamo's).
    #[arg(long, alias = "track-output-blocks")]
    router_track_output_blocks: bool,
    /// Each request carries `nvext.agent_hints.osl`, its true output length (the upper bound
    /// of the hint): its exclusive blocks decay toward it.
    #[arg(long, requires = "router_track_output_blocks")]
    agent_hints_osl: bool,
}

impl KvAwareArgs {
    fn config(&self) -> anyhow::Result<KvAwareConfig> {
        let d = KvAwareConfig::default();
        let weight = |name: &str, v: Option<f64>, default: f64| match v {
            Some(x) if !x.is_finite() || x < 0.0 => {
                anyhow::bail!("--{name} must be a finite number >= 0, got {x}")
            }
            Some(x) => Ok(x),
            None => Ok(default),
        };
        Ok(KvAwareConfig {
            overlap_score_credit: weight(
                "router-kv-overlap-score-credit",
                self.router_kv_overlap_score_credit,
                d.overlap_score_credit,
            )?,
            prefill_load_scale: weight(
                "router-prefill-load-scale",
                self.router_prefill_load_scale,
                d.prefill_load_scale,
            )?,
            decode_active_request_weight: weight(
                "router-decode-active-request-weight",
                self.router_decode_active_request_weight,
                d.decode_active_request_weight,
            )?,
            temperature: weight("router-temperature", self.router_temperature, d.temperature)?,
            memory_cost: match self.router_kv_memory_cost {
                Some(MemoryCostArg::Linear) => MemoryCost::Linear,
                Some(MemoryCostArg::Utilisation) => MemoryCost::Utilisation,
                None => d.memory_cost,
            },
            prefill_interference_weight: weight(
                "router-prefill-interference-weight",
                self.router_prefill_interference_weight,
                d.prefill_interference_weight,
            )?,
            kv_overflow_weight: weight(
                "router-kv-overflow-weight",
                self.router_kv_overflow_weight,
                d.kv_overflow_weight,
            )?,
            own_decode_weight: weight(
                "router-own-decode-weight",
                self.router_own_decode_weight,
                d.own_decode_weight,
            )?,
            cost_model: match self.router_cost_model {
                Some(CostModelArg::Weighted) => CostModel::Weighted,
                Some(CostModelArg::Predicted) => CostModel::Predicted,
                Some(CostModelArg::Calibrated) => CostModel::Calibrated,
                None => d.cost_model,
            },
            answers_counted: self.router_track_output_blocks,
            ..d
        })
    }
}

/// A prefill/decode cluster instead of `--workers`, with the gateway's flags and defaults.
#[derive(Debug, Args)]
#[command(next_help_heading = "Prefill/decode disaggregation")]
struct PdArgs {
    /// Prefill engines: with --decode-workers, a disaggregated cluster.
    #[arg(long, value_name = "P", requires = "decode_workers", conflicts_with_all = ["workers", "policies"])]
    prefill_workers: Option<usize>,
    /// Decode engines.
    #[arg(long, value_name = "D", requires = "prefill_workers")]
    decode_workers: Option<usize>,
    /// The prefill half's policy [default: kv_aware].
    #[arg(long, requires = "prefill_workers")]
    prefill_policy: Option<PolicyKind>,
    /// The decode half's policy [default: kv_aware scoring load only (overlap credit 0)].
    #[arg(long, requires = "prefill_workers")]
    decode_policy: Option<PolicyKind>,
    /// Decode-only (no remote prefill) when the decode engine holds all but fewer than N
    /// prompt tokens; 0 always disaggregates.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        requires = "prefill_workers"
    )]
    pd_min_uncached_tokens: u64,
    /// Bytes of KV per token, for the transfer time (Llama-3-8B fp16).
    #[arg(long, default_value_t = TimingModel::default().kv_bytes_per_token)]
    kv_bytes_per_token: u64,
    /// The KV transfer link between prefill and decode engines, in Gb/s.
    #[arg(long, default_value_t = TimingModel::default().kv_transfer_gbps)]
    kv_transfer_gbps: f64,
}

impl PdArgs {
    /// The disaggregated cluster asked for, if any; `base` is the kv_aware weights given.
    fn cluster(&self, base: &PolicyConfig) -> anyhow::Result<Option<PdCluster>> {
        let (Some(p), Some(d)) = (self.prefill_workers, self.decode_workers) else {
            return Ok(None);
        };
        if p == 0 || d == 0 {
            anyhow::bail!("--prefill-workers and --decode-workers must be at least 1");
        }
        let mut pd = PdCluster::new(p, d, base, self.decode_policy);
        pd.prefill_policy = self.prefill_policy.unwrap_or(PolicyKind::KvAware);
        pd.min_uncached_tokens = self.pd_min_uncached_tokens;
        Ok(Some(pd))
    }

    /// `base` with this link.
    fn timing(&self, base: TimingModel) -> anyhow::Result<TimingModel> {
        if !(self.kv_transfer_gbps.is_finite() && self.kv_transfer_gbps > 0.0) {
            anyhow::bail!("--kv-transfer-gbps must be a positive number");
        }
        Ok(TimingModel {
            kv_bytes_per_token: self.kv_bytes_per_token,
            kv_transfer_gbps: self.kv_transfer_gbps,
            ..base
        })
    }
}

/// The requests to send.
#[derive(Debug, Args)]
#[command(next_help_heading = "Workload")]
struct Workload {
    #[command(flatten)]
    source: Source,
    /// Tokens per trace hash id.
    #[arg(long, default_value_t = 512)]
    hash_block_size: usize,
    /// Leave out the first N requests (the rest keep their spacing, the first sent at once).
    #[arg(long, value_name = "N", default_value_t = 0)]
    skip: usize,
    /// Only the first N requests (after --skip).
    #[arg(long, value_name = "N")]
    max_requests: Option<usize>,
    /// K copies of the workload, interleaved in time and disjoint in prefix: K times its
    /// rate over the same span (`trace::copies`).
    #[arg(long, value_name = "K", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    copies: u32,
    /// Seeds the synthetic workload (and in `simulate` the engines and the policies).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write the workload's requests, as run, to FILE as Mooncake JSONL (for `--trace`,
    /// or Dynamo's replay).
    #[arg(long, value_name = "FILE")]
    write_trace: Option<std::path::PathBuf>,
    #[command(flatten)]
    generator: SyntheticArgs,
}

impl Workload {
    /// A name for the workload (for titles) and its requests; a generator flag that does not
    /// fit ends the program with a usage error of `command`.
    fn load(&self, command: &str) -> anyhow::Result<(String, Vec<TraceRequest>)> {
        let (name, mut requests) = match (&self.source.trace, self.source.synthetic) {
            (Some(path), _) => (
                path.file_name()
                    .unwrap_or(path.as_os_str())
                    .to_string_lossy()
                    .into_owned(),
                trace::load(path)?,
            ),
            (None, Some(kind)) => {
                let spec = self.generator.resolve(kind).unwrap_or_else(|e| {
                    let mut cli = Cli::command();
                    cli.build();
                    let mut sub = cli.find_subcommand(command).cloned().unwrap_or(cli);
                    sub.error(clap::error::ErrorKind::ArgumentConflict, e)
                        .exit()
                });
                if let Some(note) = spec.sharing_note(self.hash_block_size) {
                    eprintln!("{note}");
                }
                let requests = spec.generate(self.hash_block_size, self.seed);
                (spec.to_string(), requests)
            }
            (None, None) => unreachable!("clap requires --trace or --synthetic"),
        };
        trace::skip(&mut requests, self.skip);
        if let Some(m) = self.max_requests {
            requests.truncate(m);
        }
        if self.copies > 1 {
            requests = trace::copies(&requests, self.copies as usize);
        }
        if let Some(path) = &self.write_trace {
            trace::save(path, &requests)?;
        }
        Ok((format!("{name}, {} requests", requests.len()), requests))
    }
}

/// The simulated cluster, its engines and the workload (`simulate` and `goodput`).
#[derive(Debug, Args)]
struct ClusterArgs {
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Comma-separated policy names.
    #[arg(long, default_value = "kv_aware,round_robin")]
    policies: String,
    /// KV blocks per engine: one count for all, or one per engine (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "16384",
        value_name = "N[,N...]"
    )]
    num_gpu_blocks: Vec<usize>,
    /// Each engine's speed factor (its step times are divided by it): one for all, or one
    /// per engine (comma-separated). The router is not told them.
    #[arg(long, value_delimiter = ',', value_name = "X[,X...]")]
    worker_speed: Vec<f64>,
    /// Tell the router each engine's `--worker-speed` (as speed factors with the evidence
    /// they need, and prefill and decode fits at that speed) instead of letting it learn
    /// them from the timings: how far learning the speeds is from knowing them.
    #[arg(long)]
    router_told_speeds: bool,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// kv_aware decides as the router's `--router-sample-ranks N` does: among the N engines
    /// holding the longest cached prefix of the prompt, N of those holding it in their active
    /// requests and N others drawn at random, the cluster's terms over every engine (0: every
    /// engine) [default: as the router's, 64 with 256 engines or more, else every engine].
    #[arg(long, value_name = "N")]
    sample_ranks: Option<usize>,
    /// The router reads the engines' gauges (waiting and running requests, KV usage,
    /// adapters) as its scrapes of their `/metrics` every MS milliseconds last showed them,
    /// each engine at its own phase, as the gateway's `--metrics-refresh-ms` does (0: as they
    /// are at each decision) [default: 0]
    #[arg(long, value_name = "MS", default_value_t = 0)]
    metrics_refresh_ms: u64,
    /// Also runs the TTFT oracle, after the policies: each request goes to the engine where
    /// it costs the least first-token time (its own TTFT and the delay it adds to the first
    /// tokens waiting there), found by running copies of the engines ahead with and without
    /// it; no later arrival seen. A yardstick, not a policy, named `ttft_oracle` in the
    /// results (aggregated clusters)
    #[arg(long)]
    ttft_oracle: bool,
    #[command(flatten)]
    workload: Workload,
    #[command(flatten)]
    kv_aware: KvAwareArgs,
    #[command(flatten)]
    pd: PdArgs,
    #[command(flatten)]
    queue: QueueArgs,
    #[command(flatten)]
    tenants: TenantArgs,
    #[command(flatten)]
    loras: LoraArgs,
    #[command(flatten)]
    slo: SloArgs,
    #[command(flatten)]
    timing: TimingArgs,
}

impl ClusterArgs {
    fn setup(&self, command: &str) -> anyhow::Result<Setup> {
        self.timing.validate()?;
        let policy_config = PolicyConfig {
            kv_aware: self.kv_aware.config()?,
            ..PolicyConfig::default()
        };
        let pd_cluster = self.pd.cluster(&policy_config)?;
        let queue = self.queue.config(pd_cluster.is_some())?;
        let (name, requests) = self.workload.load(command)?;
        let (name, requests, tenants) = self.tenants.apply(name, requests)?;
        let (loras, lora) = self.loras.config()?;
        let clusters: Vec<Cluster> = match &pd_cluster {
            Some(c) => vec![Cluster::Disaggregated(c.clone())],
            None => self
                .policies
                .split(',')
                .map(|p| p.trim().parse::<PolicyKind>())
                .map(|k| {
                    k.map(|policy| Cluster::Aggregated {
                        workers: self.workers,
                        policy,
                        policy_config: policy_config.clone(),
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        let shapes = EngineShapes {
            speed: self.worker_speed.clone(),
            told: self.router_told_speeds,
            num_gpu_blocks: match self.num_gpu_blocks.as_slice() {
                [_] => Vec::new(),
                many => many.to_vec(),
            },
        };
        let engines = clusters.first().map_or(self.workers, Cluster::engines);
        shapes.validate(engines)?;
        let base_blocks = self.num_gpu_blocks.first().copied().unwrap_or(16384);
        let scheduling = match self.queue.engine_priority {
            true => ", engines scheduling by priority",
            false => "",
        };
        let workers = match &pd_cluster {
            Some(c) => format!(
                "{} prefill + {} decode workers",
                c.prefill_workers, c.decode_workers
            ),
            None => format!("{} workers", self.workers),
        };
        Ok(Setup {
            name,
            requests,
            clusters,
            shape: if shapes.is_uniform() {
                format!(
                    "{workers} x {base_blocks} blocks of {}, timing model {}{scheduling}",
                    self.block_size, self.timing.timing_model
                )
            } else {
                format!(
                    "{workers} ({}), blocks of {}, timing model {}{scheduling}",
                    shapes.describe(),
                    self.block_size,
                    self.timing.timing_model
                )
            },
            engine: EngineConfig {
                num_gpu_blocks: base_blocks,
                block_size: self.block_size,
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                timing: self.pd.timing(self.timing.model())?,
                scheduler: self.timing.timing_model.scheduler(),
                lora,
                policy: match self.queue.engine_priority {
                    true => SchedulingPolicy::Priority,
                    false => SchedulingPolicy::Fcfs,
                },
                ..EngineConfig::default()
            },
            hash_block: self.workload.hash_block_size,
            seed: self.workload.seed,
            queue,
            tenants,
            shapes,
            loras,
            slo: self.slo.config(),
            sample_ranks: self.sample_ranks,
            metrics_refresh: (self.metrics_refresh_ms > 0)
                .then(|| Duration::from_millis(self.metrics_refresh_ms)),
            oracle: (self.ttft_oracle && pd_cluster.is_none()).then(|| Cluster::Aggregated {
                workers: self.workers,
                policy: PolicyKind::KvAware,
                policy_config: policy_config.clone(),
            }),
            output_blocks: match (
                self.kv_aware.router_track_output_blocks,
                self.kv_aware.agent_hints_osl,
            ) {
                (false, _) => None,
                (true, false) => Some(OutputTracking::Blocks),
                (true, true) => Some(OutputTracking::ExactOsl),
            },
        })
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A trace or a synthetic workload replayed in real time against an OpenAI-compatible
    /// endpoint, streaming.
    Replay(ReplayArgs),
    /// KV events from a file replayed against the indexer: events/s, query latency, memory.
    Index(kvroute_bench::index::IndexArgs),
    /// KV events published as N engines publish them (ZMQ, vLLM's wire format) at a set rate,
    /// for a router to absorb (bench/firehose.sh).
    Firehose(kvroute_bench::firehose::FirehoseArgs),
    /// A trace or a synthetic workload through the real routing core and N simulated engines,
    /// in virtual time.
    Simulate {
        #[command(flatten)]
        cluster: ClusterArgs,
        #[arg(long, default_value_t = 1.0)]
        rate_scale: f64,
        /// Write the figures as JSON (the reference under "reference").
        #[arg(long)]
        json: Option<PathBuf>,
        /// Draw the TTFT CDFs, one line per policy and the reference's, as SVG.
        #[arg(long, value_name = "FILE.svg")]
        plot: Option<PathBuf>,
    },
    /// SLO goodput: for each policy, the highest rate scale at which the simulated cluster
    /// meets a latency objective (bisection; the same cluster and workload flags as simulate).
    Goodput {
        #[command(flatten)]
        cluster: ClusterArgs,
        #[command(flatten)]
        goodput: GoodputArgs,
        /// Write the brackets as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// TTFT against load, a line per router: reads runs at several rate scales (`simulate
    /// --json` files, and Dynamo replay lines from bench/dynamo_replay_requests.py) and draws
    /// one SVG (bench/ttft_vs_load.sh runs the sweep and this).
    PlotLoad {
        /// The runs, in any order.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
        /// The SVG to write.
        #[arg(long, value_name = "FILE.svg")]
        plot: PathBuf,
        /// The TTFT percentile on y.
        #[arg(long, value_enum, default_value = "p90")]
        percentile: Percentile,
        /// [default: "TTFT <percentile> against load: <trace>"]
        #[arg(long)]
        title: Option<String>,
        /// [default: "virtual time, <the runs' cluster>"]
        #[arg(long)]
        subtitle: Option<String>,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Replay(args) => args.run()?,
        Command::Index(args) => args.run()?,
        Command::Firehose(args) => args.run()?,
        Command::Simulate {
            cluster,
            rate_scale,
            json,
            plot,
        } => commands::simulate_command(&cluster.setup("simulate")?, rate_scale, json, plot)?,
        Command::Goodput {
            cluster,
            goodput,
            json,
        } => {
            let (objective, search) = (goodput.objective()?, goodput.search()?);
            let setup = cluster.setup("goodput")?;
            commands::goodput_command(&setup, &objective, &search, json)?;
        }
        Command::PlotLoad {
            files,
            plot,
            percentile,
            title,
            subtitle,
        } => commands::plot_load_command(
            &files,
            percentile,
            &plot,
            title.as_deref(),
            subtitle.as_deref(),
        )?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::error::ErrorKind;
    use kvroute_bench::goodput::{Objective, Slo};
    use kvroute_bench::simulate::{QueueConfig, TenantFairness};
    use kvroute_core::queue::QueueOrder;
    use kvroute_sim::engine::TimingFamily;

    use super::*;

    fn parse(args: &str) -> Result<Cli, ErrorKind> {
        Cli::try_parse_from(args.split_whitespace()).map_err(|e| e.kind())
    }

    #[test]
    fn the_cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn exactly_one_of_trace_and_synthetic() {
        for command in [
            "simulate",
            "replay --url http://x",
            "goodput --slo-ttft-p90-ms 2000",
        ] {
            assert_eq!(
                parse(&format!("b {command}")).err(),
                Some(ErrorKind::MissingRequiredArgument)
            );
            assert_eq!(
                parse(&format!("b {command} --trace t --synthetic multi-turn")).err(),
                Some(ErrorKind::ArgumentConflict)
            );
            assert_eq!(
                parse(&format!("b {command} --trace t --turns 3")).err(),
                Some(ErrorKind::ArgumentConflict),
                "generator flags need --synthetic"
            );
            assert!(parse(&format!("b {command} --trace t")).is_ok());
            assert!(parse(&format!("b {command} --synthetic shared-prefix --groups 3")).is_ok());
            assert!(parse(&format!("b {command} --synthetic agentic --sessions 3")).is_ok());
        }
    }

    #[test]
    fn simulate_takes_a_prefill_decode_cluster() {
        assert_eq!(
            parse("b simulate --trace t --prefill-workers 2").err(),
            Some(ErrorKind::MissingRequiredArgument)
        );
        assert_eq!(
            parse("b simulate --trace t --pd-min-uncached-tokens 5").err(),
            Some(ErrorKind::MissingRequiredArgument)
        );
        assert_eq!(
            parse("b simulate --trace t --prefill-workers 2 --decode-workers 2 --workers 4").err(),
            Some(ErrorKind::ArgumentConflict)
        );
        let cli = Cli::try_parse_from(
            "b simulate --trace t --prefill-workers 3 --decode-workers 2 --pd-min-uncached-tokens 512 --router-kv-overlap-score-credit 2"
                .split_whitespace(),
        )
        .unwrap();
        let Command::Simulate {
            cluster: ClusterArgs { kv_aware, pd, .. },
            ..
        } = cli.command
        else {
            panic!("not simulate");
        };
        let base = PolicyConfig {
            kv_aware: kv_aware.config().unwrap(),
            ..PolicyConfig::default()
        };
        let c = pd.cluster(&base).unwrap().expect("disaggregated");
        assert_eq!((c.prefill_workers, c.decode_workers), (3, 2));
        assert_eq!(c.min_uncached_tokens, 512);
        // The gateway's defaults: the decode half scores load only unless named.
        assert_eq!(
            (c.prefill_policy, c.decode_policy),
            (PolicyKind::KvAware, PolicyKind::KvAware)
        );
        assert_eq!(c.prefill_config.kv_aware.overlap_score_credit, 2.0);
        assert_eq!(c.decode_config.kv_aware.overlap_score_credit, 0.0);
        assert_eq!(c.decode_config.kv_aware.prefill_interference_weight, 0.0);
        assert_eq!(c.prefill_config.kv_aware.prefill_interference_weight, 0.25);
        let named = PdArgs {
            decode_policy: Some(PolicyKind::KvAware),
            ..pd
        };
        let c = named.cluster(&base).unwrap().expect("disaggregated");
        assert_eq!(c.decode_config.kv_aware.overlap_score_credit, 2.0);
    }

    #[test]
    fn goodput_takes_simulates_cluster_flags_and_needs_an_slo() {
        assert_eq!(
            parse("b goodput --trace t").err(),
            Some(ErrorKind::MissingRequiredArgument)
        );
        let cli = Cli::try_parse_from(
            "b goodput --trace t --slo-ttft-p90-ms 2000 --slo-e2e-p90-ms 9000 --workers 4 --num-gpu-blocks 99 --policies llm_d --router-kv-overlap-score-credit 2 --max-rate-scale 8"
                .split_whitespace(),
        )
        .unwrap();
        let Command::Goodput {
            cluster, goodput, ..
        } = cli.command
        else {
            panic!("not goodput");
        };
        assert_eq!((cluster.workers, cluster.num_gpu_blocks), (4, vec![99]));
        assert_eq!(cluster.kv_aware.config().unwrap().overlap_score_credit, 2.0);
        assert_eq!(
            goodput.objective(),
            Ok(Objective::Percentiles(Slo {
                ttft_p90_ms: 2000.0,
                e2e_p90_ms: Some(9000.0)
            }))
        );
        let search = goodput.search().unwrap();
        assert_eq!(search.max, Some(8.0));
        assert_eq!((search.tolerance, search.max_steps), (0.02, 8));
        assert!(parse(
            "b goodput --trace t --slo-ttft-p90-ms 1 --prefill-workers 2 --decode-workers 2"
        )
        .is_ok());
    }

    #[test]
    fn goodput_takes_exactly_one_of_a_percentile_and_a_mix() {
        let goodput = |args: &str| match Cli::try_parse_from(
            format!("b goodput --trace t {args}").split_whitespace(),
        )
        .map(|c| c.command)
        {
            Ok(Command::Goodput {
                cluster, goodput, ..
            }) => Ok((cluster.slo.config(), goodput.objective())),
            Ok(_) => panic!("not goodput"),
            Err(e) => Err(e.kind()),
        };
        // Neither, both.
        assert_eq!(goodput("").err(), Some(ErrorKind::MissingRequiredArgument));
        assert_eq!(
            goodput("--slo-ttft-p90-ms 2000 --slo-mix 0.3:1000,0.7:10000").err(),
            Some(ErrorKind::ArgumentConflict)
        );
        // A mix: per-class attainment, 0.9 unless given.
        let (mix, objective) = goodput("--slo-mix 0.3:1000,0.7:10000 --slo-headers drop").unwrap();
        assert_eq!(objective, Ok(Objective::Attainment(0.9)));
        let mix = mix.unwrap();
        assert_eq!(mix.routing, kvroute_bench::simulate::SloRouting::Blind);
        assert_eq!(mix.mix.classes().len(), 2);
        let (_, objective) = goodput("--slo-mix 1:500 --slo-attainment 0.99").unwrap();
        assert_eq!(objective, Ok(Objective::Attainment(0.99)));
        // An attainment out of (0, 1], or without a mix; an E2E objective without the TTFT one.
        for bad in ["0", "1.5", "-0.2", "NaN"] {
            let (_, objective) =
                goodput(&format!("--slo-mix 1:500 --slo-attainment={bad}")).unwrap();
            assert_eq!(
                objective.unwrap_err().to_string(),
                format!("--slo-attainment must be a fraction in (0, 1], got {bad}")
            );
        }
        for mixed in [
            "--slo-ttft-p90-ms 2000 --slo-attainment 0.9",
            "--slo-ttft-p90-ms 2000 --slo-headers send",
            "--slo-mix 1:500 --slo-e2e-p90-ms 9000",
        ] {
            assert_eq!(
                goodput(mixed).err(),
                Some(ErrorKind::ArgumentConflict),
                "{mixed}"
            );
        }
        assert_eq!(
            goodput("--slo-attainment 0.9").err(),
            Some(ErrorKind::MissingRequiredArgument)
        );
    }

    #[test]
    fn simulate_takes_the_sims_timing_flags() {
        let timing =
            |args: &str| match Cli::try_parse_from(args.split_whitespace()).map(|c| c.command) {
                Ok(Command::Simulate {
                    cluster: ClusterArgs { timing, pd, .. },
                    ..
                }) => Ok(pd.timing(timing.model()).unwrap()),
                Ok(_) => panic!("not simulate"),
                Err(e) => Err(e.kind()),
            };
        assert_eq!(
            timing("b simulate --trace t").unwrap(),
            TimingModel::default()
        );
        let dynamo = timing("b simulate --trace t --timing-model dynamo").unwrap();
        assert_eq!(dynamo, TimingFamily::Dynamo.timing());
        let t = timing(
            "b simulate --trace t --timing-model dynamo --prefill-context 1e-6 --decode-quadratic -3 --kv-transfer-gbps 400",
        )
        .unwrap();
        assert_eq!(t.family, TimingFamily::Dynamo);
        assert_eq!((t.prefill_context, t.decode_quadratic), (1e-6, -3.0));
        assert_eq!((t.decode_per_seq, t.kv_transfer_gbps), (0.0, 400.0));
        assert_eq!(
            timing("b simulate --trace t --timing-model fast").err(),
            Some(ErrorKind::InvalidValue)
        );
        assert_eq!(
            timing("b replay --url http://x --trace t --timing-model dynamo").err(),
            Some(ErrorKind::UnknownArgument),
            "replay has no engine"
        );
    }

    #[test]
    fn plot_load_takes_files_and_a_percentile() {
        assert_eq!(
            parse("b plot-load --plot o.svg").err(),
            Some(ErrorKind::MissingRequiredArgument)
        );
        assert_eq!(
            parse("b plot-load --plot o.svg --percentile p95 a.json").err(),
            Some(ErrorKind::InvalidValue)
        );
        let parsed = Cli::try_parse_from("b plot-load --plot o.svg a.json b.jsonl".split(' '));
        match parsed.map(|c| c.command) {
            Ok(Command::PlotLoad {
                files, percentile, ..
            }) => {
                assert_eq!(files, [PathBuf::from("a.json"), PathBuf::from("b.jsonl")]);
                assert_eq!(percentile, Percentile::P90);
            }
            other => panic!("{other:?}"),
        }
    }

    /// The simulation `args` set up.
    fn setup_of(args: &str) -> Setup {
        match Cli::try_parse_from(args.split_whitespace())
            .unwrap()
            .command
        {
            Command::Simulate { cluster, .. } | Command::Goodput { cluster, .. } => {
                cluster.setup("simulate").unwrap()
            }
            _ => panic!("not a simulation"),
        }
    }

    #[test]
    fn the_router_is_told_the_speeds_only_when_asked() {
        let told = |args: &str| setup_of(args).shapes.told_speeds(2);
        let mixed =
            "b simulate --synthetic shared-prefix --groups 2 --workers 2 --worker-speed 2,0.5";
        assert_eq!(told(mixed), None);
        assert_eq!(
            told(&format!("{mixed} --router-told-speeds")),
            Some(vec![2.0, 0.5])
        );
    }

    #[test]
    fn the_ttft_oracle_runs_after_the_policies_only_when_asked() {
        let runs = |args: &str| {
            let setup = setup_of(args);
            setup.runs(1.0).map(|c| c.name()).collect::<Vec<_>>()
        };
        let plain = "b simulate --synthetic shared-prefix --groups 2 --workers 2 --policies llm_d";
        assert_eq!(runs(plain), ["llm_d"]);
        assert_eq!(
            runs(&format!("{plain},round_robin --ttft-oracle")),
            ["llm_d", "round_robin", "ttft_oracle"]
        );
        let pd = "b simulate --synthetic shared-prefix --groups 2 --prefill-workers 1 \
            --decode-workers 1 --ttft-oracle";
        assert_eq!(runs(pd).len(), 1, "no oracle for a disaggregated cluster");
    }

    #[test]
    fn simulate_and_goodput_take_the_gateways_queue_flags() {
        let queue = |args: &str| {
            let cluster = match Cli::try_parse_from(args.split_whitespace())
                .map_err(|e| e.kind().to_string())?
                .command
            {
                Command::Simulate { cluster, .. } | Command::Goodput { cluster, .. } => cluster,
                Command::Replay(_)
                | Command::Index(_)
                | Command::Firehose(_)
                | Command::PlotLoad { .. } => {
                    panic!("not a simulation")
                }
            };
            // The queue's flags are refused before the trace is read.
            let setup = cluster.setup("simulate").map(|_| ());
            let err = setup.err().map(|e| e.to_string()).unwrap_or_default();
            match cluster.queue.config(cluster.pd.prefill_workers.is_some()) {
                Ok(q) => Ok(q),
                Err(e) => {
                    assert_eq!(err, e.to_string(), "setup fails with the queue's error");
                    Err(err)
                }
            }
        };
        assert_eq!(queue("b simulate --trace t"), Ok(None));
        let q = queue("b simulate --trace t --router-queue-threshold 1.5").unwrap();
        assert_eq!(
            q,
            Some(QueueConfig::new(1.5, QueueOrder::Fcfs, Duration::from_secs(60)).unwrap())
        );
        let q = queue(
            "b goodput --trace t --slo-ttft-p90-ms 1 --router-queue-threshold 2 --router-queue-policy wspt --router-queue-timeout-secs 5",
        )
        .unwrap();
        assert_eq!(
            q,
            Some(QueueConfig::new(2.0, QueueOrder::Wspt, Duration::from_secs(5)).unwrap())
        );
        let q =
            queue("b simulate --trace t --router-queue-threshold 1 --router-queue-fairness vtc");
        assert_eq!(q.unwrap().unwrap().fairness, TenantFairness::Vtc);
        let parsed = parse("b simulate --trace t --router-queue-fairness vtc");
        assert_eq!(parsed.err(), Some(ErrorKind::MissingRequiredArgument));
        let parsed = parse("b simulate --trace t --heavy-tenant-scale 10");
        assert_eq!(parsed.err(), Some(ErrorKind::MissingRequiredArgument));
        assert!(parse(
            "b goodput --trace t --slo-ttft-p90-ms 1 --tenants 2 --heavy-tenant-scale 10"
        )
        .is_ok());
        assert_eq!(
            queue("b simulate --trace t --router-queue-threshold 0"),
            Err("--router-queue-threshold must be a positive number, got 0".into())
        );
        assert_eq!(
            queue("b simulate --trace t --router-queue-threshold NaN"),
            Err("--router-queue-threshold must be a positive number, got NaN".into())
        );
        assert_eq!(
            queue("b simulate --trace t --router-queue-threshold 1 --router-queue-timeout-secs 0"),
            Err("--router-queue-timeout-secs must be positive".into())
        );
        assert!(queue(
            "b simulate --trace t --router-queue-threshold 1 --prefill-workers 1 --decode-workers 1"
        )
        .unwrap_err()
        .contains("not supported with prefill/decode disaggregation"));
        // clap's errors: an unknown order, and an order or timeout without a threshold.
        assert_eq!(
            parse("b simulate --trace t --router-queue-threshold 1 --router-queue-policy lifo")
                .err(),
            Some(ErrorKind::InvalidValue)
        );
        for flag in [
            "--router-queue-policy fcfs",
            "--router-queue-timeout-secs 9",
        ] {
            assert_eq!(
                parse(&format!("b simulate --trace t {flag}")).err(),
                Some(ErrorKind::MissingRequiredArgument)
            );
        }
    }

    #[test]
    fn simulate_takes_an_slo_mix() {
        let cli = Cli::try_parse_from(
            "b simulate --trace t --slo-mix 0.3:1000,0.7:10000 --slo-headers drop"
                .split_whitespace(),
        )
        .unwrap();
        let Command::Simulate { cluster, .. } = cli.command else {
            panic!("not simulate");
        };
        let slo = cluster.slo.config().unwrap();
        assert_eq!(slo.routing, kvroute_bench::simulate::SloRouting::Blind);
        assert_eq!(slo.mix.classes().len(), 2);
        assert_eq!(
            parse("b simulate --trace t --slo-headers send").err(),
            Some(ErrorKind::MissingRequiredArgument)
        );
        assert_eq!(
            parse("b simulate --trace t --slo-mix 0.3:1000,0.6:10000").err(),
            Some(ErrorKind::ValueValidation)
        );
        assert_eq!(
            parse("b simulate --trace t --slo-mix 1:500 --slo-attainment 0.9").err(),
            Some(ErrorKind::UnknownArgument),
            "the attainment is goodput's"
        );
    }

    #[test]
    fn simulate_passes_kv_aware_weights_through() {
        let cli = Cli::try_parse_from(
            "b simulate --trace t --router-cost-model weighted --router-kv-overlap-score-credit 1 --router-prefill-load-scale 1 --router-kv-memory-cost linear --router-prefill-interference-weight 0 --router-kv-overflow-weight 0"
                .split_whitespace(),
        )
        .unwrap();
        let Command::Simulate {
            cluster: ClusterArgs { kv_aware, .. },
            ..
        } = cli.command
        else {
            panic!("not simulate");
        };
        // Dynamo's model, flag by flag.
        assert_eq!(kv_aware.config().unwrap(), KvAwareConfig::dynamo());
        let bad = KvAwareArgs {
            router_prefill_interference_weight: Some(-1.0),
            ..kv_aware
        };
        assert!(bad.config().is_err());
        let bad = KvAwareArgs {
            router_prefill_interference_weight: None,
            router_temperature: Some(-1.0),
            ..bad
        };
        assert!(bad.config().is_err());
        assert!(Cli::try_parse_from(
            "b simulate --trace t --router-kv-memory-cost quadratic".split_whitespace()
        )
        .is_err());
    }
}
