//! Where discovered workers come from: Kubernetes pods by label selector, and a watched file.

use std::path::PathBuf;
use std::time::Duration;

use clap::ValueEnum;
use serde::Deserialize;

use super::{Args, ConfigError, WorkerRole};

/// smg's `--discovery-provider`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DiscoveryProvider {
    /// Pods by label selector (the same as `--service-discovery`).
    Kubernetes,
    /// The `--discovery-file`.
    File,
}

/// One label selector and the role of the pods it selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    /// `(key, value)` pairs, all of which must match.
    pub labels: Vec<(String, String)>,
    /// `Both` for `--selector`, where a pod's `kvroute.io/role` annotation may narrow it.
    pub role: WorkerRole,
}

impl Selector {
    /// The selector as the Kubernetes API takes it: `k=v,k2=v2`.
    pub fn query(&self) -> String {
        let pairs: Vec<String> = self
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        pairs.join(",")
    }

    /// Whether a pod with these labels is selected.
    pub fn matches<'a>(&self, mut label: impl FnMut(&str) -> Option<&'a str>) -> bool {
        self.labels
            .iter()
            .all(|(k, v)| label(k).is_some_and(|have| have == v))
    }
}

/// Kubernetes service discovery, when on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesDiscovery {
    /// The prefill and decode selectors first: a pod two selectors match takes the first.
    pub selectors: Vec<Selector>,
    /// The workers' port on their pods.
    pub port: u16,
    /// The namespace watched; all namespaces when `None`.
    pub namespace: Option<String>,
    /// An explicit kubeconfig; else in-cluster, `KUBECONFIG` or `~/.kube/config`.
    pub kubeconfig: Option<PathBuf>,
}

/// The discovery sources in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoverySettings {
    pub kubernetes: Option<KubernetesDiscovery>,
    pub file: Option<PathBuf>,
    /// Between full re-lists of the pods and re-reads of the file.
    pub interval: Duration,
}

impl DiscoverySettings {
    /// Whether any source may add workers at run time (then no engine is simulated).
    pub fn any(&self) -> bool {
        self.kubernetes.is_some() || self.file.is_some()
    }
}

fn parse_selector(values: &[String], role: WorkerRole) -> Result<Option<Selector>, ConfigError> {
    if values.is_empty() {
        return Ok(None);
    }
    let mut labels = Vec::with_capacity(values.len());
    for value in values {
        // `k=v` pairs, one per value or comma-separated as kubectl writes them.
        for pair in value.split(',').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some((k, v)) if !k.is_empty() && !k.contains('!') => {
                    labels.push((k.trim().to_owned(), v.trim().to_owned()))
                }
                _ => {
                    return Err(ConfigError::Invalid {
                        name: "selector",
                        reason: "expected label=value pairs",
                    })
                }
            }
        }
    }
    Ok(Some(Selector { labels, role }))
}

impl Args {
    /// Validates the discovery flags.
    pub(super) fn discovery_settings(&self) -> Result<DiscoverySettings, ConfigError> {
        if self.service_discovery && self.discovery_provider.is_some() {
            return Err(ConfigError::Invalid {
                name: "discovery_provider",
                reason: "give --service-discovery or --discovery-provider, not both",
            });
        }
        let kubernetes = self.service_discovery
            || self.discovery_provider == Some(DiscoveryProvider::Kubernetes);
        if self.discovery_provider == Some(DiscoveryProvider::File) && self.discovery_file.is_none()
        {
            return Err(ConfigError::Invalid {
                name: "discovery_provider",
                reason: "the file provider needs --discovery-file",
            });
        }
        let interval = match self.discovery_check_interval_secs {
            Some(0) => {
                return Err(ConfigError::Invalid {
                    name: "discovery_check_interval_secs",
                    reason: "must be positive",
                })
            }
            Some(secs) => Duration::from_secs(secs),
            None => Duration::from_secs(30),
        };
        let selectors: Vec<Selector> = [
            parse_selector(&self.prefill_selector, WorkerRole::Prefill)?,
            parse_selector(&self.decode_selector, WorkerRole::Decode)?,
            parse_selector(&self.selector, WorkerRole::Both)?,
        ]
        .into_iter()
        .flatten()
        .collect();
        let kubernetes = if kubernetes {
            if selectors.is_empty() {
                return Err(ConfigError::Invalid {
                    name: "selector",
                    reason: "service discovery needs --selector (or --prefill-selector and --decode-selector)",
                });
            }
            if self.service_discovery_port == Some(0) {
                return Err(ConfigError::Invalid {
                    name: "service_discovery_port",
                    reason: "must be positive",
                });
            }
            Some(KubernetesDiscovery {
                selectors,
                port: self.service_discovery_port.unwrap_or(80),
                namespace: self
                    .service_discovery_namespace
                    .clone()
                    .filter(|ns| !ns.is_empty()),
                kubeconfig: self.kubeconfig.clone(),
            })
        } else if !selectors.is_empty() {
            return Err(ConfigError::Invalid {
                name: "selector",
                reason: "selectors need --service-discovery",
            });
        } else {
            None
        };
        Ok(DiscoverySettings {
            kubernetes,
            file: self.discovery_file.clone(),
            interval,
        })
    }
}
