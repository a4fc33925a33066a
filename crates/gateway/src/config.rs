//! Configuration: one clap struct that is also the config file's schema, merged then
//! validated once into [`Settings`].
//!
//! Every knob is a field of [`Args`], which both clap (flags, `--kebab-case`) and serde
//! (the `--config` file, `snake_case`, YAML or JSON whatever the extension) read. The
//! command line wins over the file; defaults are applied once, in [`Args::into_settings`].

use std::path::PathBuf;

mod args;
mod certs;
mod discovery;
mod dump;
mod epp;
mod kv_aware;
mod llmd;
mod load;
mod merge;
mod metrics_compat;
pub mod peers;
mod priority;
mod rate_limits;
mod service;
mod settings;
mod slo;
mod tenancy;
mod validate;
mod values;

pub use args::{
    AffinityModeArg, Args, AssignmentModeArg, CostModelArg, LogLevel, MemoryCostArg, QueueOrderArg,
};
pub use discovery::{DiscoveryProvider, DiscoverySettings, KubernetesDiscovery, Selector};
pub use epp::{EppEndpoints, EppServing, EppSettings, PoolRef, DEFAULT_POOL_GROUP};
pub use llmd::LlmDConfigError;
pub use load::CliWorkers;
pub use metrics_compat::{MetricsCompat, MetricsPeer};
pub use priority::{
    ClassSettings, EnginePriorityArg, PriorityClass, PrioritySettings, QueueSharing, TenantOrder,
};
pub use rate_limits::{
    load as load_rate_limits, Limits, ModelRule, RateLimitFileError, RateLimitPolicy, TenantPolicy,
};
pub use settings::{
    AdmissionSettings, CircuitSettings, HealthSettings, KvEventsMode, MigrationSettings,
    PdProtocol, PdSettings, PolicyClassSpec, QueueSettings, RetrySettings, Settings, SyncConfig,
    WorkerRole, WorkerSource, WorkerSpec,
};
pub use slo::SloArgs;

/// Errors in the configuration; `kvroute` exits with status 2 on any of them.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_yaml_ng::Error,
    },
    #[error("invalid worker url '{url}': {reason}")]
    WorkerUrl { url: String, reason: &'static str },
    #[error("duplicate worker id '{0}'")]
    DuplicateWorker(String),
    #[error("invalid value for {name}: {reason}")]
    Invalid {
        name: &'static str,
        reason: &'static str,
    },
    #[error("--priority-scheduler-config {path}: {entry}: {reason}")]
    PriorityFile {
        path: PathBuf,
        entry: String,
        reason: String,
    },
    #[error("invalid value for otlp_traces_endpoint: {0}")]
    OtlpEndpoint(String),
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error("--cert-path: cannot read {path}: {source}")]
    CertPath {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    RateLimits(#[from] RateLimitFileError),
    #[error(transparent)]
    LlmD(#[from] llmd::LlmDConfigError),
    #[error("cannot write --dump-config-to {path}: {source}")]
    Dump {
        path: PathBuf,
        source: std::io::Error,
    },
}

#[cfg(test)]
mod tests;
