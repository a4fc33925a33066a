//! The endpoint picker's settings (`--epp`): where it serves Envoy's ext_proc and gRPC
//! health, how (TLS or h2c), and where its endpoints come from.

use std::path::PathBuf;

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
