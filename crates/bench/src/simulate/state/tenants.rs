//! Each tenant's running totals in a run, and its figures at the end.

use super::super::result::{percentiles, TenantResult};
use super::SimConfig;

/// How many tenants `cfg`'s requests have (1 without tenants).
pub(super) fn tenant_count(cfg: &SimConfig) -> usize {
    cfg.tenants
        .as_ref()
        .and_then(|of| of.iter().max())
        .map_or(1, |&m| m as usize + 1)
}

/// The figures of each tenant that had requests.
pub(super) fn tenant_results(by_tenant: &mut [TenantTally]) -> Vec<TenantResult> {
    let total: u64 = by_tenant.iter().map(|t| t.tokens).sum();
    by_tenant
        .iter_mut()
        .enumerate()
        .filter(|(_, t)| t.arrived > 0)
        .map(|(i, t)| TenantResult {
            tenant: crate::tenants::tenant_key(i as u32),
            requests: t.arrived,
            answered: t.ttft.len(),
            ttft_ms: percentiles(&mut t.ttft),
            router_wait_ms: percentiles(&mut t.waits),
            token_share: t.tokens as f64 / total.max(1) as f64,
        })
        .collect()
}

/// One tenant's running totals.
#[derive(Default)]
pub(super) struct TenantTally {
    pub(super) arrived: usize,
    pub(super) ttft: Vec<f64>,
    /// Each routed request's wait in the router queue (0 when routed on arrival).
    pub(super) waits: Vec<f64>,
    /// Tokens served up to the last arrival.
    pub(super) tokens: u64,
}
