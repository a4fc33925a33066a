//! `replay`'s flags and its run: the workload (with its tenants) sent in real time to an
//! endpoint, the figures printed, the JSON and the plot written.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvroute_bench::plot::Series;
use kvroute_bench::replay::{self, ReplayConfig};
use kvroute_bench::{commands, report};

use crate::queue_args::TenantArgs;
use crate::Workload;

/// `replay`'s flags.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The endpoint's base URL; several, comma-separated (or --url repeated): router
    /// replicas, each request sent to one of them.
    #[arg(
        long = "url",
        value_name = "URL",
        required = true,
        value_delimiter = ',',
        value_parser = replay::base_url
    )]
    pub urls: Vec<String>,
    /// The `model` field to send (omit for a router serving one model).
    #[arg(long)]
    model: Option<String>,
    /// A JSON object whose fields are added to every request's body, e.g. Dynamo's
    /// '{"nvext":{"extra_fields":["worker_id"]}}' (which also makes its frontend send a
    /// chunk per token, and name the worker).
    #[arg(long, value_name = "JSON", value_parser = replay::json_object)]
    pub extra_body: Option<serde_json::Map<String, serde_json::Value>>,
    #[arg(long, default_value_t = 1.0)]
    rate_scale: f64,
    #[arg(long, default_value_t = 256)]
    max_concurrency: usize,
    /// Stop sending after this many seconds.
    #[arg(long)]
    duration: Option<f64>,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw the TTFT CDF as SVG.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Names the line in --plot [default: the URL].
    #[arg(long)]
    label: Option<String>,
    #[command(flatten)]
    workload: Workload,
    #[command(flatten)]
    tenants: TenantArgs,
    /// The header that carries each request's tenant, `tenant-<t>` (smg's trusted header;
    /// kvroute reads it with --trust-tenant-header) [default: x-smg-tenant-id].
    #[arg(long, value_name = "NAME", requires = "tenants", value_parser = header_name)]
    pub tenant_header: Option<String>,
}

/// `--tenant-header`: a valid HTTP header name.
fn header_name(s: &str) -> Result<String, String> {
    http::HeaderName::from_bytes(s.as_bytes())
        .map(|h| h.as_str().to_owned())
        .map_err(|_| "not a valid HTTP header name".into())
}

impl ReplayArgs {
    /// Replays the workload and reports.
    pub fn run(self) -> anyhow::Result<()> {
        let (name, requests) = self.workload.load("replay")?;
        let (name, requests, tenants) = self.tenants.apply(name, requests)?;
        let cfg = ReplayConfig {
            urls: self.urls,
            model: self.model,
            extra_body: self.extra_body.unwrap_or_default(),
            hash_block: self.workload.hash_block_size,
            rate_scale: self.rate_scale,
            max_concurrency: self.max_concurrency,
            duration: self.duration.map(Duration::from_secs_f64),
            progress: true,
            tenants,
            tenant_header: self
                .tenant_header
                .unwrap_or_else(|| ReplayConfig::DEFAULT_TENANT_HEADER.into()),
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let r = runtime.block_on(replay::replay(&requests, &cfg));
        let url = cfg.urls.join(",");
        println!(
            "{} requests, {} errors; TTFT ms p50/p90/p99 {:.0}/{:.0}/{:.0}; ITL ms {:.1}/{:.1}/{:.1}; E2E ms {:.0}/{:.0}/{:.0}; {:.2} req/s, {:.0} out tok/s; cached {:.1}% of prompt tokens; per worker {:?}",
            r.requests, r.errors, r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99, r.itl_ms.p50, r.itl_ms.p90,
            r.itl_ms.p99, r.e2e_ms.p50, r.e2e_ms.p90, r.e2e_ms.p99, r.throughput_rps, r.output_tokens_per_s,
            r.hit_share * 100.0, r.requests_per_worker
        );
        if !r.tenants.is_empty() {
            println!("{}", report::replay_tenant_rows(&r.tenants));
        }
        if r.short_streams > 0 {
            eprintln!(
                "warning: {} streams carried fewer chunks than their usage's tokens: their TTFT is a later token's (Dynamo's frontend: --extra-body '{{\"nvext\":{{\"extra_fields\":[\"worker_id\"]}}}}')",
                r.short_streams
            );
        }
        if let Some(out) = self.json {
            let doc = serde_json::json!({"trace": name, "url": url, "policies": [r]});
            std::fs::write(&out, serde_json::to_string_pretty(&doc)?)
                .with_context(|| format!("cannot write {}", out.display()))?;
        }
        if let Some(out) = self.plot {
            let label = self.label.as_deref().unwrap_or(&url);
            let series = Series {
                label,
                ttft_ms: &r.ttft_sorted_ms,
            };
            let subtitle = format!("real time via {url}, rate x{}", self.rate_scale);
            commands::write_plot(&out, &format!("TTFT: {name}"), &subtitle, &[series])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;
    use clap::Parser;

    use super::*;
    use crate::{Cli, Command};

    fn replay_args(args: &[&str]) -> Result<ReplayArgs, ErrorKind> {
        let mut all = vec!["b", "replay", "--trace", "t", "--url", "http://a"];
        all.extend_from_slice(args);
        match Cli::try_parse_from(all).map(|c| c.command) {
            Ok(Command::Replay(r)) => Ok(r),
            Ok(_) => panic!("not replay"),
            Err(e) => Err(e.kind()),
        }
    }

    #[test]
    fn replay_takes_several_urls_each_trimmed() {
        let urls =
            |args: &str| match Cli::try_parse_from(args.split_whitespace()).map(|c| c.command) {
                Ok(Command::Replay(r)) => Ok(r.urls),
                Ok(_) => panic!("not replay"),
                Err(e) => Err(e.kind()),
            };
        assert_eq!(
            urls("b replay --trace t --url http://a:1/,http://b:2").unwrap(),
            ["http://a:1", "http://b:2"]
        );
        assert_eq!(
            urls("b replay --trace t --url http://a:1// --url http://b:2/").unwrap(),
            ["http://a:1", "http://b:2"]
        );
        assert_eq!(
            urls("b replay --trace t --url http://a:1,"),
            Err(ErrorKind::ValueValidation)
        );
        assert_eq!(
            urls("b replay --trace t"),
            Err(ErrorKind::MissingRequiredArgument)
        );
    }

    #[test]
    fn replay_extra_body_is_a_json_object() {
        let extra = |args: &[&str]| replay_args(args).map(|r| r.extra_body);
        let m = extra(&[
            "--extra-body",
            r#"{"nvext":{"extra_fields":["worker_id"]}}"#,
        ])
        .unwrap();
        assert_eq!(m.unwrap()["nvext"]["extra_fields"][0], "worker_id");
        assert_eq!(extra(&[]), Ok(None));
        for bad in ["[1]", "{"] {
            assert_eq!(
                extra(&["--extra-body", bad]),
                Err(ErrorKind::ValueValidation)
            );
        }
    }

    #[test]
    fn replay_takes_simulates_tenants_and_a_tenant_header() {
        let r = replay_args(&["--tenants", "2", "--heavy-tenant-scale", "10"]).unwrap();
        assert_eq!(r.tenant_header, None, "x-smg-tenant-id unless named");
        let r = replay_args(&["--tenants", "2", "--tenant-header", "X-Team"]).unwrap();
        assert_eq!(r.tenant_header.as_deref(), Some("x-team"));
        assert_eq!(
            replay_args(&["--tenants", "2", "--tenant-header", "a b"]).err(),
            Some(ErrorKind::ValueValidation)
        );
        for without_tenants in ["--heavy-tenant-scale", "--tenant-header"] {
            assert_eq!(
                replay_args(&[without_tenants, "1"]).err(),
                Some(ErrorKind::MissingRequiredArgument)
            );
        }
        assert_eq!(
            replay_args(&["--router-queue-fairness", "vtc"]).err(),
            Some(ErrorKind::UnknownArgument),
            "the queue is the router's, not the replay's"
        );
    }
}
