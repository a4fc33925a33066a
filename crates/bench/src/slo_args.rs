//! Per-request TTFT targets over a simulated cluster's requests (`simulate` and `goodput`).

use clap::{Args, ValueEnum};
use kvroute_bench::simulate::{SloConfig, SloMix, SloRouting};

/// `--slo-headers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SloHeaders {
    /// Each request tells the router its target (x-kvroute-slo-ttft-ms): kv_aware routes by
    /// headroom.
    Send,
    /// The router never sees the targets; they are only measured.
    Drop,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "SLO targets")]
pub struct SloArgs {
    /// Give each request a TTFT target from a mix of classes FRACTION:MS, comma-separated,
    /// fractions summing to 1 (`0.3:1000,0.7:10000`); each class's attainment is reported.
    #[arg(long, value_name = "MIX")]
    slo_mix: Option<SloMix>,
    /// Whether the requests send their targets to the router.
    #[arg(long, value_enum, default_value_t = SloHeaders::Send, requires = "slo_mix")]
    slo_headers: SloHeaders,
}

impl SloArgs {
    pub fn config(&self) -> Option<SloConfig> {
        Some(SloConfig {
            mix: self.slo_mix.clone()?,
            routing: match self.slo_headers {
                SloHeaders::Send => SloRouting::Headers,
                SloHeaders::Drop => SloRouting::Blind,
            },
        })
    }
}
