//! The endpoint picker's settings (`--epp`): where it serves Envoy's ext_proc and gRPC
//! health, how (TLS or h2c), and where its endpoints come from; validated here from their
//! flags (llm-d's names and defaults).

use std::path::{Path, PathBuf};

use super::ConfigError;

/// `--epp`, implied by `--pool-name` or `--endpoint-selector`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EppSettings {
    /// `--grpc-port` (9002): Envoy's `ExternalProcessor/Process`.
    pub grpc_port: u16,
    /// `--grpc-health-port` (9003): `grpc.health.v1.Health`.
    pub grpc_health_port: u16,
    /// `--secure-serving` (default true) and `--cert-path`.
    pub serving: EppServing,
    /// Where the endpoints come from.
    pub endpoints: EppEndpoints,
    /// `--kv-events-socket-port` (llm-d's precise prefix cache,
    /// `kvEventsConfig.podDiscoveryConfig.socketPort`): an endpoint without a `kv_events`
    /// address of its own publishes its KV events on `tcp://IP:PORT+rank`. None: its
    /// cache is approximated from the picker's own decisions.
    pub kv_events_port: Option<u16>,
}

/// How the ext_proc port is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EppServing {
    /// TLS (ALPN h2) with a self-signed certificate made at start.
    SelfSigned,
    /// TLS with `tls.crt` and `tls.key` from `--cert-path DIR`.
    CertDir(PathBuf),
    /// `--secure-serving=false`: HTTP/2 over cleartext.
    H2c,
}

/// The endpoints the picker chooses among.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EppEndpoints {
    /// `--worker-urls`, the config file's workers, the admin API: the endpoint is the URL's
    /// `host:port`.
    Static,
    /// `--pool-name`: the pods an InferencePool selects, one endpoint per pod and target port.
    Pool(PoolRef),
    /// `--endpoint-selector` with `--endpoint-target-ports` (llm-d's standalone mode).
    Selector {
        /// Kubernetes' label-selector syntax, passed to the API server as it is.
        selector: String,
        target_ports: Vec<u16>,
        namespace: String,
        /// An explicit kubeconfig (`--kubeconfig`); else in-cluster or the usual places.
        kubeconfig: Option<PathBuf>,
    },
}

/// The InferencePool watched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRef {
    pub name: String,
    /// `--pool-namespace`; default the `NAMESPACE` environment variable, else `default`.
    pub namespace: String,
    /// `--pool-group` (`inference.networking.k8s.io`).
    pub group: String,
    /// An explicit kubeconfig (`--kubeconfig`); else in-cluster or the usual places.
    pub kubeconfig: Option<PathBuf>,
}

/// The llm-d group of the InferencePool (`--pool-group`'s default).
pub const DEFAULT_POOL_GROUP: &str = "inference.networking.k8s.io";

/// The endpoint picker's flags, as merged (command line over the config files).
#[derive(Debug, Default)]
pub(super) struct EppFlags<'a> {
    pub epp: bool,
    pub grpc_port: Option<u16>,
    pub grpc_health_port: Option<u16>,
    pub secure_serving: Option<bool>,
    pub cert_path: Option<PathBuf>,
    pub pool_name: Option<String>,
    pub pool_namespace: Option<String>,
    pub pool_group: Option<String>,
    pub endpoint_selector: Option<String>,
    pub endpoint_target_ports: Vec<u16>,
    pub kv_events_socket_port: Option<u16>,
    /// `--kubeconfig`, shared with Kubernetes discovery.
    pub kubeconfig: Option<&'a Path>,
    /// The `NAMESPACE` environment variable (passed in, so tests need not set it).
    pub namespace_env: Option<String>,
}

impl super::Args {
    /// The picker's settings from its flags (taken out of `self`).
    pub(super) fn take_epp(&mut self) -> Result<Option<EppSettings>, ConfigError> {
        EppFlags {
            epp: self.epp,
            grpc_port: self.grpc_port,
            grpc_health_port: self.grpc_health_port,
            secure_serving: self.secure_serving,
            cert_path: self.cert_path.take(),
            pool_name: self.pool_name.take(),
            pool_namespace: self.pool_namespace.take(),
            pool_group: self.pool_group.take(),
            endpoint_selector: self.endpoint_selector.take(),
            endpoint_target_ports: std::mem::take(&mut self.endpoint_target_ports),
            kv_events_socket_port: self.kv_events_socket_port,
            kubeconfig: self.kubeconfig.as_deref(),
            namespace_env: std::env::var("NAMESPACE").ok(),
        }
        .settings()
    }
}

/// The gateway sends a request to one endpoint: a prefill/decode pair is the proxy's.
pub(super) fn refuse_pd(epp: Option<&EppSettings>, pd_on: bool) -> Result<(), ConfigError> {
    if pd_on && epp.is_some() {
        return Err(ConfigError::Invalid {
            name: "epp",
            reason: "prefill/decode disaggregation is the proxy's: not in endpoint-picker mode",
        });
    }
    Ok(())
}

/// `--engine-priority` writes the request's body, which in endpoint-picker mode is the
/// gateway's to send: refused there rather than ignored.
pub(super) fn refuse_engine_priority(
    epp: Option<&EppSettings>,
    engine_priority: Option<super::EnginePriorityArg>,
) -> Result<(), ConfigError> {
    let on = engine_priority.is_some_and(|p| p != super::EnginePriorityArg::Off);
    if on && epp.is_some() {
        return Err(ConfigError::Invalid {
            name: "engine_priority",
            reason: "the proxy writes the body's priority: not in endpoint-picker mode",
        });
    }
    Ok(())
}

/// A static picker needs endpoints from the proxy's sources (`has_endpoints`: workers or
/// discovery): the embedded simulated engines are the proxy's demo, and a picker without
/// endpoints has nothing to pick.
pub(super) fn needs_endpoints(
    epp: Option<&EppSettings>,
    has_endpoints: bool,
) -> Result<(), ConfigError> {
    if epp.is_some_and(|e| e.endpoints == EppEndpoints::Static) && !has_endpoints {
        return Err(ConfigError::Invalid {
            name: "epp",
            reason: "no endpoints: give --pool-name, --endpoint-selector, --worker-urls, \
                     the config file's workers or a discovery source",
        });
    }
    Ok(())
}

impl EppFlags<'_> {
    /// Whether the endpoint picker is on: `--epp`, or a pool or selector to pick from.
    pub fn on(&self) -> bool {
        self.epp || self.pool_name.is_some() || self.endpoint_selector.is_some()
    }

    /// The flags that mean something only to the endpoint picker, by config-file name.
    fn epp_only(&self) -> [(&'static str, bool); 8] {
        [
            ("grpc_port", self.grpc_port.is_some()),
            ("grpc_health_port", self.grpc_health_port.is_some()),
            ("secure_serving", self.secure_serving.is_some()),
            ("cert_path", self.cert_path.is_some()),
            ("pool_namespace", self.pool_namespace.is_some()),
            ("pool_group", self.pool_group.is_some()),
            (
                "endpoint_target_ports",
                !self.endpoint_target_ports.is_empty(),
            ),
            (
                "kv_events_socket_port",
                self.kv_events_socket_port.is_some(),
            ),
        ]
    }

    /// The endpoint picker's settings; `None` when it is off (and then none of its flags
    /// may be given).
    pub fn settings(self) -> Result<Option<EppSettings>, ConfigError> {
        if !self.on() {
            if let Some((name, _)) = self.epp_only().into_iter().find(|(_, set)| *set) {
                return Err(ConfigError::Invalid {
                    name,
                    reason: "only in endpoint-picker mode (--epp, --pool-name or \
                             --endpoint-selector)",
                });
            }
            return Ok(None);
        }
        let grpc_port = self.grpc_port.unwrap_or(9002);
        let grpc_health_port = self.grpc_health_port.unwrap_or(9003);
        if grpc_port == grpc_health_port && grpc_port != 0 {
            return Err(ConfigError::Invalid {
                name: "grpc_health_port",
                reason: "must differ from grpc_port",
            });
        }
        let serving = match (self.secure_serving.unwrap_or(true), self.cert_path) {
            (true, None) => EppServing::SelfSigned,
            (true, Some(dir)) => {
                for file in ["tls.crt", "tls.key"] {
                    let path = dir.join(file);
                    if let Err(source) = std::fs::File::open(&path) {
                        return Err(ConfigError::CertPath { path, source });
                    }
                }
                EppServing::CertDir(dir)
            }
            (false, None) => EppServing::H2c,
            (false, Some(_)) => {
                return Err(ConfigError::Invalid {
                    name: "cert_path",
                    reason: "needs secure serving (--secure-serving=false turns TLS off)",
                })
            }
        };
        let namespace = self
            .pool_namespace
            .or(self.namespace_env)
            .filter(|ns| !ns.is_empty())
            .unwrap_or_else(|| "default".to_owned());
        let ports_given = !self.endpoint_target_ports.is_empty();
        let endpoints = match (self.pool_name, self.endpoint_selector) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::Invalid {
                    name: "endpoint_selector",
                    reason: "give --pool-name or --endpoint-selector, not both",
                })
            }
            (Some(name), None) if name.is_empty() => {
                return Err(ConfigError::Invalid {
                    name: "pool_name",
                    reason: "must not be empty",
                })
            }
            (_, Some(selector)) if selector.trim().is_empty() => {
                return Err(ConfigError::Invalid {
                    name: "endpoint_selector",
                    reason: "must not be empty",
                })
            }
            (Some(name), None) => EppEndpoints::Pool(PoolRef {
                name,
                namespace,
                group: self
                    .pool_group
                    .unwrap_or_else(|| DEFAULT_POOL_GROUP.to_owned()),
                kubeconfig: self.kubeconfig.map(Path::to_owned),
            }),
            (None, Some(selector)) => EppEndpoints::Selector {
                selector,
                target_ports: target_ports(self.endpoint_target_ports)?,
                namespace,
                kubeconfig: self.kubeconfig.map(Path::to_owned),
            },
            (None, None) => EppEndpoints::Static,
        };
        if ports_given && !matches!(endpoints, EppEndpoints::Selector { .. }) {
            return Err(ConfigError::Invalid {
                name: "endpoint_target_ports",
                reason: "goes with --endpoint-selector (a pool names its own ports)",
            });
        }
        Ok(Some(EppSettings {
            grpc_port,
            grpc_health_port,
            serving,
            endpoints,
            kv_events_port: self.kv_events_socket_port,
        }))
    }
}

/// `--endpoint-target-ports`: 1 to 8 ports (llm-d's bound), duplicates dropped, none 0.
fn target_ports(mut ports: Vec<u16>) -> Result<Vec<u16>, ConfigError> {
    let mut seen = std::collections::HashSet::new();
    ports.retain(|p| seen.insert(*p));
    let reason = if ports.is_empty() {
        "--endpoint-selector needs at least one target port"
    } else if ports.len() > 8 {
        "at most 8 ports"
    } else if ports.contains(&0) {
        "a port must not be 0"
    } else {
        return Ok(ports);
    };
    Err(ConfigError::Invalid {
        name: "endpoint_target_ports",
        reason,
    })
}

/// The metrics port: llm-d's `--metrics-port` or kvroute's `--prometheus-port` (one of
/// them); by default llm-d's 9090 in endpoint-picker mode, kvroute's 29000 otherwise.
pub(super) fn metrics_port(
    metrics_port: Option<u16>,
    prometheus_port: Option<u16>,
    epp: bool,
) -> Result<u16, ConfigError> {
    match (metrics_port, prometheus_port) {
        (Some(_), Some(_)) => Err(ConfigError::Invalid {
            name: "metrics_port",
            reason: "--metrics-port and --prometheus-port set the same port; give one",
        }),
        (Some(port), None) | (None, Some(port)) => Ok(port),
        (None, None) if epp => Ok(9090),
        (None, None) => Ok(29000),
    }
}

#[cfg(test)]
mod tests;
