//! Tenants in a workload: each request of a trace is given a tenant, and one tenant can be
//! made a flood, so that `simulate` and `goodput` measure how the router queue shares the
//! cluster (`--tenants`, `--heavy-tenant-scale`, `--router-queue-fairness`).
//!
//! - **Who.** A request's tenant is `splitmix64(g) mod N`, `g` its prefix group (its first
//!   hash id), or its index in the trace when it has no hash ids. Requests that share a
//!   prefix therefore share a tenant, as one team's requests share its system prompt.
//! - **The flood.** `--heavy-tenant-scale K` replaces tenant 0's requests by K copies of each:
//!   copy `c` (0-based) arrives at `(t + c * span / K) mod span` (`span` the trace's length),
//!   so tenant 0 arrives K times as often over the same span, and its hash ids are moved by
//!   `c * 2^40`, so each copy is a different prompt with the trace's prefix structure. K 1
//!   leaves the trace as it is; K 0 removes tenant 0 (the others alone).

use serde::Serialize;

use crate::trace::TraceRequest;

/// How requests get their tenants.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TenantSplit {
    /// N, at least 1.
    pub tenants: u32,
    /// K: copies of each of tenant 0's requests.
    pub heavy_scale: u32,
}

/// The key kvroute-core's queue sees for tenant `t`.
pub fn tenant_key(t: u32) -> String {
    format!("tenant-{t}")
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The trace with tenant 0 scaled, sorted by arrival, and each request's tenant.
pub fn split(requests: &[TraceRequest], split: TenantSplit) -> (Vec<TraceRequest>, Vec<u32>) {
    let n = u64::from(split.tenants.max(1));
    let span = requests.iter().map(|r| r.timestamp).max().unwrap_or(0) + 1;
    let k = u64::from(split.heavy_scale);
    let mut out: Vec<(TraceRequest, u32)> = Vec::new();
    for (i, r) in requests.iter().enumerate() {
        let group = r.hash_ids.first().copied().unwrap_or(i as u64);
        let tenant = (splitmix64(group) % n) as u32;
        if tenant != 0 {
            out.push((r.clone(), tenant));
            continue;
        }
        for c in 0..k {
            let mut copy = r.clone();
            copy.timestamp = (r.timestamp + c * span / k) % span;
            for h in &mut copy.hash_ids {
                *h = h.wrapping_add(c << 40);
            }
            out.push((copy, 0));
        }
    }
    out.sort_by_key(|(r, _)| r.timestamp);
    out.into_iter().unzip()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace() -> Vec<TraceRequest> {
        (0..200u64)
            .map(|i| TraceRequest {
                timestamp: i * 10,
                input_length: 1024,
                output_length: 4,
                hash_ids: vec![i % 17, 1000 + i],
            })
            .collect()
    }

    #[test]
    fn a_prefix_group_has_one_tenant_and_scale_one_keeps_the_trace() {
        let t = trace();
        let (same, of) = split(
            &t,
            TenantSplit {
                tenants: 3,
                heavy_scale: 1,
            },
        );
        assert_eq!(same, t);
        for (a, b) in t.iter().zip(&t) {
            let (ia, ib) = (a.timestamp as usize / 10, b.timestamp as usize / 10);
            if a.hash_ids[0] == b.hash_ids[0] {
                assert_eq!(of[ia], of[ib]);
            }
        }
        assert!((0..3).all(|x| of.contains(&x)), "every tenant has requests");
    }

    #[test]
    fn the_heavy_tenant_is_copied_k_times_within_the_span() {
        let t = trace();
        let (_, of) = split(
            &t,
            TenantSplit {
                tenants: 2,
                heavy_scale: 1,
            },
        );
        let heavy = of.iter().filter(|&&x| x == 0).count();
        let (scaled, of10) = split(
            &t,
            TenantSplit {
                tenants: 2,
                heavy_scale: 10,
            },
        );
        assert_eq!(of10.iter().filter(|&&x| x == 0).count(), 10 * heavy);
        assert_eq!(scaled.len(), t.len() + 9 * heavy);
        assert!(scaled.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        assert!(scaled
            .iter()
            .all(|r| r.timestamp <= t.last().unwrap().timestamp));
        let (alone, of0) = split(
            &t,
            TenantSplit {
                tenants: 2,
                heavy_scale: 0,
            },
        );
        assert_eq!(alone.len(), t.len() - heavy);
        assert!(of0.iter().all(|&x| x == 1));
    }
}
