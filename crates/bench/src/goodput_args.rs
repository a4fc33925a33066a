//! `goodput`'s objective and search flags (the cluster's are `simulate`'s).

use clap::{ArgGroup, Args};
use kvroute_bench::goodput::{InvalidGoodput, Objective, Search, Slo};

#[derive(Debug, Args)]
#[command(group(
    ArgGroup::new("objective")
        .required(true)
        .args(["slo_ttft_p90_ms", "slo_mix"])
))]
pub struct GoodputArgs {
    /// The objective: TTFT p90 at most this many milliseconds (or --slo-mix).
    // clap waives `requires` on an argument whose target conflicts with one given: the
    // conflicts below refuse a mix's flags beside the percentile, and the reverse.
    #[arg(long, value_name = "MS", conflicts_with_all = ["slo_headers", "slo_attainment"])]
    pub slo_ttft_p90_ms: Option<f64>,
    /// And E2E p90 at most this many milliseconds.
    #[arg(
        long,
        value_name = "MS",
        requires = "slo_ttft_p90_ms",
        conflicts_with = "slo_mix"
    )]
    pub slo_e2e_p90_ms: Option<f64>,
    /// With --slo-mix in place of --slo-ttft-p90-ms, the objective: every class meets its own
    /// TTFT target for at least this fraction of its requests (0.9: each class's p90).
    #[arg(long, value_name = "P", default_value_t = 0.9, requires = "slo_mix")]
    pub slo_attainment: f64,
    /// Start the search at this rate scale [default: doubling or halving from x1].
    #[arg(long, value_name = "X")]
    pub min_rate_scale: Option<f64>,
    /// And this one.
    #[arg(long, value_name = "X")]
    pub max_rate_scale: Option<f64>,
    /// Stop when the bracket is this narrow, relative to its passing end.
    #[arg(long, default_value_t = Search::default().tolerance)]
    pub tolerance: f64,
    /// Or after this many bisections.
    #[arg(long, value_name = "N", default_value_t = Search::default().max_steps)]
    pub max_steps: usize,
}

impl GoodputArgs {
    /// The objective, validated: clap has seen to it that exactly one of
    /// `--slo-ttft-p90-ms` and `--slo-mix` is given.
    pub fn objective(&self) -> Result<Objective, InvalidGoodput> {
        let objective = match self.slo_ttft_p90_ms {
            Some(ttft_p90_ms) => Objective::Percentiles(Slo {
                ttft_p90_ms,
                e2e_p90_ms: self.slo_e2e_p90_ms,
            }),
            None => Objective::Attainment(self.slo_attainment),
        };
        objective.validate()?;
        Ok(objective)
    }

    /// The search, validated.
    pub fn search(&self) -> Result<Search, InvalidGoodput> {
        let search = Search {
            min: self.min_rate_scale,
            max: self.max_rate_scale,
            tolerance: self.tolerance,
            max_steps: self.max_steps,
        };
        search.validate()?;
        Ok(search)
    }
}
