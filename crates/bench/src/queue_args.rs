//! The router queue's flags and the tenants' (`simulate` and `goodput`).

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kvroute_bench::simulate::{InvalidQueue, QueueConfig, TenantFairness};
use kvroute_bench::tenants::{split, TenantSplit};
use kvroute_bench::trace::TraceRequest;
use kvroute_core::queue::QueueOrder;

/// The order within the router queue, with the gateway's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum QueueOrderArg {
    /// Arrival order.
    Fcfs,
    /// Fewest uncached tokens first.
    Wspt,
}

/// The gateway's router queue, with its flags and defaults (aggregated clusters only).
#[derive(Debug, Args)]
#[command(next_help_heading = "Router queue (as the gateway's flags)")]
pub struct QueueArgs {
    /// Hold a request while every engine has more active prefill tokens than this fraction of
    /// --max-num-batched-tokens (off when absent).
    #[arg(long, value_name = "F")]
    router_queue_threshold: Option<f64>,
    /// Order of the waiting requests [default: fcfs].
    #[arg(long, value_enum, requires = "router_queue_threshold")]
    router_queue_policy: Option<QueueOrderArg>,
    /// The longest a request may wait in the queue; then it gets no answer [default: 60].
    #[arg(long, value_name = "S", requires = "router_queue_threshold")]
    router_queue_timeout_secs: Option<u64>,
    /// How the queue orders tenants (see --tenants): `fcfs` ignores them, `vtc` lets the
    /// tenant with the fewest tokens served go first [default: fcfs].
    #[arg(long, value_enum, requires = "router_queue_threshold")]
    router_queue_fairness: Option<FairnessArg>,
    /// The engines schedule by priority (vLLM's `--scheduling-policy priority`) and the
    /// router writes each request's level, as the gateway's `--engine-priority vllm`: a
    /// tenant below its share of the prompt tokens in flight goes first in the engine.
    #[arg(long)]
    pub engine_priority: bool,
}

/// `--router-queue-fairness`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FairnessArg {
    /// Tenants ignored.
    Fcfs,
    /// Virtual token counters.
    Vtc,
}

impl QueueArgs {
    /// The queue asked for, if any, before a disaggregated cluster when `pd`.
    pub fn config(&self, pd: bool) -> Result<Option<QueueConfig>, InvalidQueue> {
        let Some(threshold) = self.router_queue_threshold else {
            return Ok(None);
        };
        if pd {
            return Err(InvalidQueue::Disaggregated);
        }
        let order = match self.router_queue_policy {
            Some(QueueOrderArg::Wspt) => QueueOrder::Wspt,
            Some(QueueOrderArg::Fcfs) | None => QueueOrder::Fcfs,
        };
        let timeout = self
            .router_queue_timeout_secs
            .map_or(QueueConfig::DEFAULT_TIMEOUT, Duration::from_secs);
        let fairness = match self.router_queue_fairness {
            Some(FairnessArg::Vtc) => TenantFairness::Vtc,
            Some(FairnessArg::Fcfs) | None => TenantFairness::Fcfs,
        };
        QueueConfig::new(threshold, order, timeout).map(|q| Some(q.with_fairness(fairness)))
    }
}

/// A workload's name, its requests and each request's tenant (when split).
type Tenanted = (String, Vec<TraceRequest>, Option<Arc<[u32]>>);

/// Tenants in the workload (see `kvroute_bench::tenants`).
#[derive(Debug, Args)]
#[command(next_help_heading = "Tenants")]
pub struct TenantArgs {
    /// Give each request one of N tenants, by its prefix group, and report each tenant's
    /// figures.
    #[arg(long, value_name = "N")]
    tenants: Option<u32>,
    /// Make tenant 0 a flood: K copies of each of its requests over the trace's span (0
    /// leaves the other tenants alone) [default: 1].
    #[arg(long, value_name = "K", requires = "tenants")]
    heavy_tenant_scale: Option<u32>,
}

impl TenantArgs {
    /// The workload with its tenants, when asked for: its name says how they were made.
    pub fn apply(&self, name: String, requests: Vec<TraceRequest>) -> anyhow::Result<Tenanted> {
        let Some(tenants) = self.tenants else {
            return Ok((name, requests, None));
        };
        if tenants == 0 {
            anyhow::bail!("--tenants must be at least 1");
        }
        let heavy_scale = self.heavy_tenant_scale.unwrap_or(1);
        let (requests, of) = split(
            &requests,
            TenantSplit {
                tenants,
                heavy_scale,
            },
        );
        let name = format!(
            "{name}, {tenants} tenants, tenant 0 x{heavy_scale} ({} requests)",
            requests.len()
        );
        Ok((name, requests, Some(of.into())))
    }
}
