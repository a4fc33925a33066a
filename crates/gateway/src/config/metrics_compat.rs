//! `--metrics-compat PEER...` and `--metrics-prefix`: which peers' metric names kvroute also
//! exports (see `peer_metrics`), validated once.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use super::ConfigError;

/// A peer whose metric names kvroute can also export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MetricsPeer {
    /// vllm-router's `vllm_router_*` families.
    VllmRouter,
    /// smg's `smg_*` families (or `--metrics-prefix`'s).
    Smg,
    /// llm-d's endpoint picker's `llm_d_epp_*` families.
    LlmD,
}

/// The peers' families to export beside kvroute's own; none by default.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MetricsCompat {
    pub peers: Vec<MetricsPeer>,
    /// The prefix of smg's families (`smg` unless `--metrics-prefix` says otherwise).
    pub smg_prefix: String,
}

impl MetricsCompat {
    pub fn has(&self, peer: MetricsPeer) -> bool {
        self.peers.contains(&peer)
    }

    /// The peers named (duplicates dropped) and the prefix, which needs `smg` and must be a
    /// Prometheus name.
    pub fn new(peers: &[MetricsPeer], prefix: Option<&str>) -> Result<Self, ConfigError> {
        let mut named: Vec<MetricsPeer> = Vec::new();
        for p in peers {
            if !named.contains(p) {
                named.push(*p);
            }
        }
        if let Some(prefix) = prefix {
            if !named.contains(&MetricsPeer::Smg) {
                return Err(ConfigError::Invalid {
                    name: "metrics_prefix",
                    reason: "is the prefix of smg's families: give it with --metrics-compat smg",
                });
            }
            if !is_metric_name(prefix) {
                return Err(ConfigError::Invalid {
                    name: "metrics_prefix",
                    reason: "must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)",
                });
            }
        }
        Ok(Self {
            peers: named,
            smg_prefix: prefix.unwrap_or("smg").to_owned(),
        })
    }
}

fn is_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_needs_smg_and_a_metric_name() {
        let m = MetricsCompat::new(&[MetricsPeer::Smg, MetricsPeer::Smg], Some("gw")).unwrap();
        assert_eq!(m.peers, vec![MetricsPeer::Smg]);
        assert_eq!(m.smg_prefix, "gw");
        assert!(MetricsCompat::new(&[MetricsPeer::VllmRouter], Some("gw")).is_err());
        assert!(MetricsCompat::new(&[MetricsPeer::Smg], Some("1x")).is_err());
        assert!(MetricsCompat::new(&[MetricsPeer::Smg], Some("a-b")).is_err());
        assert_eq!(
            MetricsCompat::new(&[], None).unwrap(),
            MetricsCompat::default_smg()
        );
    }

    impl MetricsCompat {
        fn default_smg() -> Self {
            Self {
                peers: vec![],
                smg_prefix: "smg".into(),
            }
        }
    }
}
