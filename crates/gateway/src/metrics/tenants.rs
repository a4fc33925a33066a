//! Per-tenant series: `kvroute_tenant_requests_total{tenant,status}` (requests answered, by
//! HTTP status), `kvroute_tenant_tokens_total{tenant,kind}` (`prompt`: the prompt's tokens as
//! the router counted them when it sent the request; `completion`: the output tokens the
//! answer reported) and `kvroute_tenant_rate_limited_total{tenant}`.
//!
//! The tenant label is bounded as smg bounds the labels its clients control
//! (`--priority-scheduler-tenant-metric-top-n`, 32 by default): the first N tenants seen keep
//! their own label for the process's life, and every later one is counted as `other`. A
//! label is never given to another tenant: a counter whose series changed tenant would make
//! `rate()` over it meaningless.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::auth::Tenant;

/// smg's default for `--priority-scheduler-tenant-metric-top-n`.
pub const DEFAULT_TOP_N: usize = 32;

/// The label every tenant past the first N shares.
pub const OTHER: &str = "other";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    tenant: String,
    status: u32,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    tenant: String,
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

/// The labels given so far, at most `top_n` of them.
#[derive(Debug)]
struct Labels {
    top_n: usize,
    given: HashMap<Tenant, String>,
}

impl Labels {
    fn of(&mut self, tenant: &Tenant) -> String {
        if let Some(label) = self.given.get(tenant) {
            return label.clone();
        }
        if self.given.len() >= self.top_n {
            return OTHER.to_owned();
        }
        let label = tenant.as_str().to_owned();
        self.given.insert(tenant.clone(), label.clone());
        label
    }
}

/// What kind of tokens [`TenantMetrics::tokens`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    Prompt,
    Completion,
}

impl TokenKind {
    fn label(self) -> &'static str {
        match self {
            Self::Prompt => "prompt",
            Self::Completion => "completion",
        }
    }
}

/// The per-tenant families and the labels they may use.
#[derive(Debug, Clone)]
pub struct TenantMetrics {
    labels: Arc<Mutex<Labels>>,
    requests: Family<StatusLabels, Counter>,
    tokens: Family<KindLabels, Counter>,
    rate_limited: Family<TenantLabel, Counter>,
}

impl Default for TenantMetrics {
    fn default() -> Self {
        Self::new(DEFAULT_TOP_N)
    }
}

impl TenantMetrics {
    /// Families whose tenant label takes at most `top_n` values besides `other`.
    pub fn new(top_n: usize) -> Self {
        Self {
            labels: Arc::new(Mutex::new(Labels {
                top_n,
                given: HashMap::new(),
            })),
            requests: Family::default(),
            tokens: Family::default(),
            rate_limited: Family::default(),
        }
    }

    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "kvroute_tenant_requests",
            "Requests answered, by tenant (the first N seen; then \"other\") and HTTP status",
            self.requests.clone(),
        );
        registry.register(
            "kvroute_tenant_tokens",
            "Tokens served, by tenant and kind: prompt (as routed), completion (as the answer reported)",
            self.tokens.clone(),
        );
        registry.register(
            "kvroute_tenant_rate_limited",
            "Requests refused by a tenant rate limit, by tenant",
            self.rate_limited.clone(),
        );
    }

    /// Caps the tenant labels at `top_n` (`--priority-scheduler-tenant-metric-top-n`); set
    /// at start, before any request is counted.
    pub fn set_top_n(&self, top_n: usize) {
        self.labels.lock().unwrap_or_else(|e| e.into_inner()).top_n = top_n;
    }

    /// The tenant's label: its own, or `other` once N others have theirs.
    pub fn label(&self, tenant: &Tenant) -> String {
        self.labels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .of(tenant)
    }

    /// A request of `tenant`'s answered with `status`.
    pub fn request(&self, tenant: &Tenant, status: u16) {
        let tenant = self.label(tenant);
        let status = status.into();
        self.requests
            .get_or_create(&StatusLabels { tenant, status })
            .inc();
    }

    /// `n` tokens of `kind` served to `tenant`.
    pub fn tokens(&self, tenant: &Tenant, kind: TokenKind, n: u64) {
        if n == 0 {
            return;
        }
        let tenant = self.label(tenant);
        let kind = kind.label();
        self.tokens
            .get_or_create(&KindLabels { tenant, kind })
            .inc_by(n);
    }

    /// A request of `tenant`'s refused by its rate limit.
    pub fn rate_limited(&self, tenant: &Tenant) {
        let tenant = self.label(tenant);
        self.rate_limited
            .get_or_create(&TenantLabel { tenant })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(m: &TenantMetrics) -> String {
        let mut registry = Registry::default();
        m.register(&mut registry);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        out
    }

    #[test]
    fn the_first_n_tenants_keep_their_label_and_the_rest_are_other() {
        let m = TenantMetrics::new(2);
        let (a, b, c, d) = (
            Tenant::authenticated("a"),
            Tenant::header("b"),
            Tenant::authenticated("c"),
            Tenant::anonymous(),
        );
        for t in [&a, &b, &c, &d, &a, &c] {
            m.request(t, 200);
        }
        m.request(&b, 429);
        m.tokens(&a, TokenKind::Prompt, 100);
        m.tokens(&d, TokenKind::Completion, 7);
        m.tokens(&c, TokenKind::Completion, 5);
        m.tokens(&c, TokenKind::Prompt, 0);
        m.rate_limited(&b);
        let out = text(&m);
        for line in [
            r#"kvroute_tenant_requests_total{tenant="auth:a",status="200"} 2"#,
            r#"kvroute_tenant_requests_total{tenant="header:b",status="200"} 1"#,
            r#"kvroute_tenant_requests_total{tenant="header:b",status="429"} 1"#,
            r#"kvroute_tenant_requests_total{tenant="other",status="200"} 3"#,
            r#"kvroute_tenant_tokens_total{tenant="auth:a",kind="prompt"} 100"#,
            r#"kvroute_tenant_tokens_total{tenant="other",kind="completion"} 12"#,
            r#"kvroute_tenant_rate_limited_total{tenant="header:b"} 1"#,
        ] {
            assert!(out.contains(line), "missing {line} in\n{out}");
        }
        // No label beyond the first two and `other`; a tenant of no tokens makes no series.
        assert!(
            !out.contains("auth:c") && !out.contains("anonymous"),
            "{out}"
        );
        assert!(!out.contains(r#"tenant="other",kind="prompt""#), "{out}");
    }

    #[test]
    fn with_no_labels_allowed_every_tenant_is_other() {
        let m = TenantMetrics::new(0);
        m.request(&Tenant::authenticated("a"), 200);
        assert_eq!(m.label(&Tenant::authenticated("a")), OTHER);
        assert!(
            text(&m).contains(r#"kvroute_tenant_requests_total{tenant="other",status="200"} 1"#)
        );
    }
}
