//! The `simulate` and `goodput` commands, given their resolved [`Setup`] (the binary parses
//! the flags): they run the simulations, print the tables of [`crate::report`] (progress on
//! stderr) and write the JSON and the plot asked for.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use kvroute_sim::engine::EngineConfig;

use crate::goodput::{goodput, Objective, Search};
use crate::plot::load::LoadSeries;
use crate::plot::{self, Series};
use crate::report;
use crate::simulate::{
    reference, simulate, Cluster, EngineShapes, OutputTracking, QueueConfig, SimConfig, SloConfig,
    SloRouting,
};
use crate::sweep::{self, Percentile};
use crate::trace::{self, TraceRequest};

/// A simulated cluster's workload, policies and engines, resolved from the flags.
#[derive(Debug, Clone)]
pub struct Setup {
    /// The workload's name.
    pub name: String,
    pub requests: Vec<TraceRequest>,
    /// One per policy, or the disaggregated cluster.
    pub clusters: Vec<Cluster>,
    /// `8 workers`, or `4 prefill + 4 decode workers`, with the engines' cache.
    pub shape: String,
    /// Every engine's.
    pub engine: EngineConfig,
    pub hash_block: usize,
    pub seed: u64,
    /// The router queue, when on.
    pub queue: Option<QueueConfig>,
    /// Each request's tenant (`--tenants`), when split.
    pub tenants: Option<Arc<[u32]>>,
    /// Each engine's speed and KV blocks, when they differ.
    pub shapes: EngineShapes,
    /// LoRA adapters over the requests (0: none).
    pub loras: u32,
    /// Per-request TTFT targets (`--slo-mix`), when set.
    pub slo: Option<SloConfig>,
    /// Output-block tracking in the router, when on.
    pub output_blocks: Option<OutputTracking>,
    /// [`SimConfig::sample_ranks`].
    pub sample_ranks: Option<usize>,
    /// [`SimConfig::metrics_refresh`].
    pub metrics_refresh: Option<Duration>,
    /// The TTFT oracle's cluster ([`SimConfig::ttft_oracle`]: kv_aware's load accounting), run
    /// after the policies' when asked.
    pub oracle: Option<Cluster>,
}

impl Setup {
    /// The simulation of `cluster` at `rate_scale`.
    pub fn config(&self, cluster: &Cluster, rate_scale: f64) -> SimConfig {
        SimConfig {
            cluster: cluster.clone(),
            engine: self.engine.clone(),
            hash_block: self.hash_block,
            vocab: 32000,
            rate_scale,
            seed: self.seed,
            queue: self.queue,
            tenants: self.tenants.clone(),
            shapes: self.shapes.clone(),
            loras: self.loras,
            slo: self.slo.clone(),
            output_blocks: self.output_blocks,
            sample_ranks: self.sample_ranks,
            ttft_oracle: false,
            metrics_refresh: self.metrics_refresh,
        }
    }

    /// Every run: each policy's cluster, then the TTFT oracle's when asked.
    pub fn runs(&self, rate_scale: f64) -> impl Iterator<Item = SimConfig> + '_ {
        let policies = self
            .clusters
            .iter()
            .map(move |c| self.config(c, rate_scale));
        let oracle = self.oracle.iter().map(move |c| SimConfig {
            ttft_oracle: true,
            ..self.config(c, rate_scale)
        });
        policies.chain(oracle)
    }
}

/// `simulate`: every cluster, then the pooled-LRU reference, as a table.
pub fn simulate_command(
    setup: &Setup,
    rate_scale: f64,
    json: Option<PathBuf>,
    plot: Option<PathBuf>,
) -> anyhow::Result<()> {
    let Setup {
        name,
        requests,
        shape,
        ..
    } = setup;
    let bound = trace::hit_bound(requests, setup.hash_block);
    println!(
        "{name}; {shape}, rate x{rate_scale}; unbounded-cache hit bound {:.1}%",
        bound * 100.0
    );
    println!("{}", report::simulate_header());
    let mut results = Vec::new();
    for cfg in setup.runs(rate_scale) {
        let started = Instant::now();
        let r = simulate(requests, &cfg);
        println!(
            "{}",
            report::policy_row(&r, started.elapsed().as_secs_f64())
        );
        results.push(r);
    }
    let started = Instant::now();
    let engines = setup.clusters.first().map_or(1, Cluster::engines);
    let reference = setup
        .clusters
        .first()
        .map(|c| reference(requests, &setup.config(c, rate_scale)));
    if let Some(r) = &reference {
        println!(
            "{}",
            report::reference_row(r, started.elapsed().as_secs_f64())
        );
    }
    if let Some(out) = json {
        let doc = serde_json::json!({
            "trace": name,
            "workers": engines,
            "shape": shape,
            "rate_scale": rate_scale,
            "hit_bound": bound,
            "policies": results,
            "reference": reference,
        });
        std::fs::write(&out, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    if let Some(out) = plot {
        let subtitle = format!("virtual time, {shape} tokens (simulated), rate x{rate_scale}");
        let series: Vec<Series<'_>> = results
            .iter()
            .map(|r| Series {
                label: &r.policy,
                ttft_ms: &r.ttft_sorted_ms,
            })
            .chain(reference.iter().map(|r| Series {
                label: &r.name,
                ttft_ms: &r.ttft_sorted_ms,
            }))
            .collect();
        write_plot(&out, &format!("TTFT: {name}"), &subtitle, &series)?;
    }
    Ok(())
}

/// `goodput`: each cluster's bracket, a line per simulation on stderr, then a table.
pub fn goodput_command(
    setup: &Setup,
    objective: &Objective,
    search: &Search,
    json: Option<PathBuf>,
) -> anyhow::Result<()> {
    let Setup {
        name,
        requests,
        shape,
        ..
    } = setup;
    let span_s = requests.last().map_or(0, |r| r.timestamp) as f64 / 1e3;
    let (described, slo) = describe_objective(objective, setup.slo.as_ref())?;
    println!(
        "{name} ({:.2} req/s at x1); {shape}; SLO: {described}",
        requests.len() as f64 / span_s.max(1e-3)
    );
    let mut results = Vec::new();
    for cfg in setup.runs(1.0) {
        let policy = cfg.name();
        let mut last = Instant::now();
        let g = goodput(requests, &cfg, objective, search, |p, b| {
            eprintln!(
                "{}",
                report::goodput_progress(&policy, p, b, last.elapsed().as_secs_f64())
            );
            last = Instant::now();
        });
        results.push(g);
    }
    println!("{}", report::goodput_table(&results));
    if let Some(out) = json {
        let doc = serde_json::json!({
            "trace": name,
            "workers": setup.clusters.first().map_or(1, Cluster::engines),
            "slo": slo,
            "tolerance": search.tolerance,
            "max_steps": search.max_steps,
            "policies": results,
        });
        std::fs::write(&out, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    Ok(())
}

/// The objective in words, and as the JSON's `"slo"`: the percentiles' SLO, or the
/// attainment with the mix's classes and whether the router saw them.
fn describe_objective(
    objective: &Objective,
    mix: Option<&SloConfig>,
) -> anyhow::Result<(String, serde_json::Value)> {
    Ok(match (objective, mix) {
        (Objective::Percentiles(slo), _) => (
            match slo.e2e_p90_ms {
                Some(e2e) => format!("TTFT p90 <= {} ms and E2E p90 <= {e2e} ms", slo.ttft_p90_ms),
                None => format!("TTFT p90 <= {} ms", slo.ttft_p90_ms),
            },
            serde_json::to_value(slo)?,
        ),
        (Objective::Attainment(p), Some(mix)) => {
            let classes: Vec<String> = (mix.mix.classes().iter())
                .map(|c| format!("{}% at {} ms", c.fraction * 100.0, c.ttft_ms))
                .collect();
            let headers = match mix.routing {
                SloRouting::Headers => "send",
                SloRouting::Blind => "drop",
            };
            (
                format!(
                    "every class within its TTFT target for >= {}% of its requests ({}; targets: {headers})",
                    p * 100.0,
                    classes.join(", ")
                ),
                serde_json::json!({
                    "attainment": p,
                    "classes": mix.mix.classes(),
                    "headers": headers,
                }),
            )
        }
        (Objective::Attainment(_), None) => anyhow::bail!("--slo-attainment needs --slo-mix"),
    })
}

/// Writes the TTFT figure, saying where.
pub fn write_plot(
    path: &Path,
    title: &str,
    subtitle: &str,
    series: &[Series<'_>],
) -> anyhow::Result<()> {
    plot::write_ttft_cdf(path, title, subtitle, series)?;
    eprintln!("TTFT CDF written to {}", path.display());
    Ok(())
}

/// `plot-load`: the runs in `files` (see [`sweep`]) as one figure of TTFT `percentile` against
/// load, a line per router, written to `out`.
pub fn plot_load_command(
    files: &[PathBuf],
    percentile: Percentile,
    out: &Path,
    title: Option<&str>,
    subtitle: Option<&str>,
) -> anyhow::Result<()> {
    let texts = files
        .iter()
        .map(|f| {
            std::fs::read_to_string(f)
                .map(|t| (f.display().to_string(), t))
                .with_context(|| format!("cannot read {}", f.display()))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (lines, context) = sweep::gather(&texts, percentile)?;
    let p = percentile.name();
    let title = match (title, &context.trace) {
        (Some(t), _) => t.to_owned(),
        (None, Some(trace)) => format!("TTFT {p} against load: {trace}"),
        (None, None) => format!("TTFT {p} against load"),
    };
    let subtitle = match (subtitle, &context.shape) {
        (Some(s), _) => s.to_owned(),
        (None, Some(shape)) => format!("virtual time, {shape}"),
        (None, None) => String::new(),
    };
    let series: Vec<LoadSeries<'_>> = lines
        .iter()
        .map(|l| LoadSeries {
            label: &l.label,
            router: l.router,
            points: &l.points,
        })
        .collect();
    let y_desc = format!("TTFT {p} (ms, log scale)");
    plot::write_ttft_load(out, &title, &subtitle, &y_desc, &series)?;
    for l in &lines {
        let points: Vec<String> = l
            .points
            .iter()
            .map(|(x, y)| format!("x{x}: {y:.0}"))
            .collect();
        println!("{}: {}", l.label, points.join(", "));
    }
    eprintln!("TTFT {p} against load written to {}", out.display());
    Ok(())
}
