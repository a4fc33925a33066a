//! The settings tree the gateway runs with, validated once from [`super::Args`], and the
//! config file's worker and class descriptions.

use std::path::PathBuf;
use std::time::Duration;

use clap::ValueEnum;
use kvroute_core::affinity::AffinityMode;
use kvroute_core::eligibility::BusyThresholds;
use kvroute_core::overload::OverloadProtection;
use kvroute_core::queue::{PolicyClass, QueueOrder};
use kvroute_core::{PolicyConfig, PolicyKind};
use serde::Deserialize;

use super::{Args, CliWorkers, ConfigError, DiscoverySettings, LogLevel, RateLimitPolicy};
use crate::auth::Secret;
use crate::tls::TlsSettings;

/// A policy class as the config file describes it.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyClassSpec {
    pub name: String,
    pub weight: u64,
    #[serde(default)]
    pub max_queued: Option<usize>,
    /// The class's own busy thresholds, over the model's where set.
    #[serde(default)]
    pub active_prefill_tokens_threshold: Option<u64>,
    #[serde(default)]
    pub active_prefill_tokens_threshold_frac: Option<f64>,
    #[serde(default)]
    pub active_decode_blocks_threshold: Option<f64>,
}

/// The queue's configuration, when it is on.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueSettings {
    pub threshold: f64,
    pub order: QueueOrder,
    pub timeout: Duration,
    pub classes: Vec<PolicyClass>,
    /// Per class (same order), its own busy thresholds; unset fields follow the model's.
    pub class_thresholds: Vec<BusyThresholds>,
    /// Tenants and priority classes.
    pub sharing: super::QueueSharing,
}

/// A worker as the config file describes it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    /// Defaults to the url.
    #[serde(default)]
    pub id: Option<String>,
    pub url: String,
    /// The model it serves; else read from its `GET /v1/models`.
    #[serde(default)]
    pub model: Option<String>,
    /// The engine's KV-event publisher (vLLM `--kv-events-config` endpoint), `tcp://HOST:PORT`.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// The engine's KV-event replay socket, if it has one.
    #[serde(default)]
    pub kv_events_replay: Option<String>,
    /// Data-parallel ranks `[dp_start_rank, dp_start_rank + dp_size)`; none when absent.
    #[serde(default)]
    pub dp_size: Option<u32>,
    #[serde(default)]
    pub dp_start_rank: Option<u32>,
    /// The engine's KV blocks (vLLM does not always export them); else from its metrics.
    #[serde(default)]
    pub num_gpu_blocks: Option<u64>,
    /// The longest context (prompt plus answer, in tokens) the engine takes; else the
    /// `max_model_len` its `/v1/models` lists (not read for a worker with a `model`).
    #[serde(default)]
    pub max_model_len: Option<u64>,
    /// The engine's `--max-num-batched-tokens` (vLLM does not export it); without it the
    /// `-frac` prefill threshold skips this worker.
    #[serde(default)]
    pub max_num_batched_tokens: Option<u64>,
    /// Labels requests can require (`x-kvroute-required-taints`) or prefer.
    #[serde(default)]
    pub taints: Vec<String>,
    /// Its part in prefill/decode disaggregation [default: both].
    #[serde(default)]
    pub role: WorkerRole,
    /// A prefill worker's bootstrap port (SGLang's disaggregation protocol).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// Where the worker came from (not part of the schema: set by whoever adds it).
    #[serde(skip)]
    pub source: WorkerSource,
}

/// Where a worker came from, as `GET /workers` shows it. Each source reconciles only its
/// own workers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum WorkerSource {
    /// `--worker-urls`, `--prefill`, `--decode` (or their config-file keys).
    Static,
    /// The config file's `workers:` list.
    #[default]
    Config,
    /// `POST /workers`.
    Admin,
    /// A Kubernetes pod, `namespace/name`.
    Kubernetes { pod: String },
    /// The `--discovery-file`.
    File,
    /// The endpoint picker's pods (an InferencePool's, or `--endpoint-selector`'s), one
    /// worker per pod and target port; `namespace/name`.
    Epp { pod: String },
}

impl WorkerSource {
    /// Every source's name, as the `source` label and `GET /workers` write it.
    pub const NAMES: [&'static str; 6] = ["static", "config", "admin", "kubernetes", "file", "epp"];

    pub fn name(&self) -> &'static str {
        match self {
            WorkerSource::Static => "static",
            WorkerSource::Config => "config",
            WorkerSource::Admin => "admin",
            WorkerSource::Kubernetes { .. } => "kubernetes",
            WorkerSource::File => "file",
            WorkerSource::Epp { .. } => "epp",
        }
    }

    /// The pod, for a discovered one.
    pub fn pod(&self) -> Option<&str> {
        match self {
            WorkerSource::Kubernetes { pod } | WorkerSource::Epp { pod } => Some(pod),
            _ => None,
        }
    }
}

/// A worker's part in prefill/decode disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerRole {
    Prefill,
    Decode,
    #[default]
    Both,
}

impl WorkerRole {
    pub fn prefills(self) -> bool {
        self != WorkerRole::Decode
    }

    pub fn decodes(self) -> bool {
        self != WorkerRole::Prefill
    }
}

/// How the two halves of a disaggregated request reach the engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PdProtocol {
    /// vLLM (NIXL): prefill with `max_tokens` 1 and `kv_transfer_params`, then decode with
    /// the parameters the prefill returned.
    #[default]
    Vllm,
    /// SGLang: `bootstrap_host`, `bootstrap_port`, `bootstrap_room` sent to both at once.
    Sglang,
}

/// Prefill/decode disaggregation, when on.
#[derive(Debug, Clone, PartialEq)]
pub struct PdSettings {
    pub protocol: PdProtocol,
    pub prefill_policy: PolicyKind,
    pub prefill_config: PolicyConfig,
    pub decode_policy: PolicyKind,
    pub decode_config: PolicyConfig,
    /// Below this many uncached prompt tokens on the chosen decode worker, skip the remote
    /// prefill (0: always disaggregate).
    pub min_uncached_tokens: u64,
}

impl WorkerSpec {
    /// A worker known by its URL only.
    pub fn url(url: impl Into<String>) -> Self {
        Self {
            id: None,
            url: url.into(),
            model: None,
            kv_events: None,
            kv_events_replay: None,
            dp_size: None,
            dp_start_rank: None,
            num_gpu_blocks: None,
            max_model_len: None,
            max_num_batched_tokens: None,
            taints: Vec::new(),
            role: WorkerRole::Both,
            bootstrap_port: None,
            source: WorkerSource::Static,
        }
    }

    /// The worker's data-parallel ranks, or `[None]` when it has none.
    pub fn ranks(&self) -> Vec<Option<u32>> {
        match self.dp_size {
            Some(n) => {
                let start = self.dp_start_rank.unwrap_or(0);
                (start..start + n.max(1)).map(Some).collect()
            }
            None => vec![None],
        }
    }
}

/// Active health checks of the workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthSettings {
    pub interval: Duration,
    pub timeout: Duration,
    pub failure_threshold: u32,
    pub success_threshold: u32,
    pub endpoint: String,
    /// A worker that turns unhealthy is removed (a discovery source adds it back when it
    /// still lists it), instead of kept and probed (`--remove-unhealthy-workers`).
    pub remove_unhealthy: bool,
    /// A worker that has not answered its first probe this long after it was added is
    /// removed (`--worker-startup-timeout-secs`); `None`: probed until it answers.
    pub startup_timeout: Option<Duration>,
}

/// Retries of requests that failed before their first response byte.
#[derive(Debug, Clone, PartialEq)]
pub struct RetrySettings {
    pub max_retries: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    pub multiplier: f64,
    pub jitter: f64,
}

impl RetrySettings {
    /// The wait before retry `n` (1-based), before jitter (±`jitter` of it).
    pub fn backoff(&self, n: u32) -> Duration {
        let base =
            self.initial_backoff.as_secs_f64() * self.multiplier.powi(n.saturating_sub(1) as i32);
        Duration::from_secs_f64(base.min(self.max_backoff.as_secs_f64()))
    }
}

/// Migration of streams whose worker fails mid-way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationSettings {
    /// The most times one request moves; 0: off.
    pub limit: u32,
    /// A stream silent this long has failed.
    pub stall: Duration,
}

/// The per-worker circuit breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CircuitSettings {
    pub failure_threshold: u32,
    pub success_threshold: u32,
    pub timeout: Duration,
}

/// Where the router learns what each engine caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEventsMode {
    /// From the engines' KV events, for workers that publish them (`kv_events`); the
    /// others are approximated.
    Events,
    /// From the router's own decisions only (`--no-router-kv-events`).
    Approximate,
}

/// The validated configuration the gateway runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub host: String,
    pub port: u16,
    pub prometheus_host: String,
    pub prometheus_port: u16,
    /// `--metrics-compat`: the peers' families exported beside kvroute's.
    pub metrics_compat: super::MetricsCompat,
    pub workers: Vec<WorkerSpec>,
    pub policy: PolicyKind,
    pub policy_config: PolicyConfig,
    pub max_payload_size: usize,
    pub request_timeout: Duration,
    pub log_level: LogLevel,
    /// One JSON object per log line.
    pub log_json: bool,
    /// The headers a session key is read from, in order (`--routing-key-headers`).
    pub routing_key_headers: Vec<http::HeaderName>,
    /// OpenTelemetry traces, when on.
    pub trace: Option<crate::otlp::TraceSettings>,
    pub block_size: usize,
    /// `--router-track-output-blocks`: streams add decode blocks as they generate.
    pub track_output_blocks: bool,
    pub kv_events: KvEventsMode,
    pub router_ttl: Duration,
    pub max_indexed_blocks: usize,
    /// `--router-event-threads`: >1 shards the KV index by replica (mirrored shards).
    pub event_threads: usize,
    /// `--router-sample-ranks`: a lean kv_aware decision costs the prompt's holders and this
    /// many other ranks drawn at random (0: every rank; unset: 64 in pools of 256 ranks or
    /// more, [`kvroute_core::policy::sample_size`]; see `routing/lean.rs`).
    pub sample_ranks: Option<usize>,
    /// How often engine metrics are scraped (when the policy uses them).
    pub metrics_refresh: Duration,
    /// The most scrapes a second of the whole fleet's `/metrics` (`--metrics-scrapes-per-sec`):
    /// each worker's interval stretches from `metrics_refresh` to keep under it; `None`: no
    /// limit.
    pub metrics_scrapes_per_sec: Option<std::num::NonZeroU32>,
    /// The busy thresholds every model starts with (`POST /busy_threshold` changes them).
    pub busy: BusyThresholds,
    /// `--health-check-port`: a listener of its own for /health, /liveness and /readiness.
    pub health_check_port: Option<u16>,
    /// smg's worker overload protection (off unless a threshold is given).
    pub overload: OverloadProtection,
    /// `--slo-shed`: refuse a request whose latency targets no worker is predicted to meet.
    pub slo_shed: bool,
    pub admin_api_key: Option<Secret>,
    pub client_api_key: Option<Secret>,
    /// Tenant keys, the trusted tenant header, JWT/OIDC.
    pub tenancy: crate::auth::TenancySettings,
    /// Per-tenant rate limits (`--tenant-rate-limit-enabled`), when on.
    pub rate_limits: Option<RateLimitPolicy>,
    /// Tenants with their own metric label (`--priority-scheduler-tenant-metric-top-n`).
    pub tenant_metric_top_n: usize,
    /// The key sent to the workers.
    pub api_key: Option<Secret>,
    /// TLS to https workers (trust, mTLS identity) and the API's certificate.
    pub tls: TlsSettings,
    pub health: HealthSettings,
    /// Retries; `max_retries` 0 when disabled.
    pub retry: RetrySettings,
    /// Migration of failed streams.
    pub migration: MigrationSettings,
    /// The circuit breaker, unless disabled.
    pub circuit: Option<CircuitSettings>,
    /// Admission control, when a concurrency limit or a rate is set.
    pub admission: Option<AdmissionSettings>,
    pub shutdown_grace: Duration,
    pub header_read_timeout: Duration,
    /// Prefill/decode disaggregation, when on.
    pub pd: Option<PdSettings>,
    /// Replica sync, when on.
    pub replica_sync: Option<SyncConfig>,
    /// The config file, re-read on SIGHUP.
    pub config_path: Option<PathBuf>,
    /// The command line's worker flags (they stay over the file's across reloads).
    pub cli_workers: CliWorkers,
    /// Session affinity's mode and TTL, when on.
    pub session_affinity: Option<(AffinityMode, Duration)>,
    /// The admission queue, when `--router-queue-threshold` is set.
    pub queue: Option<QueueSettings>,
    /// `--engine-priority`: the engines' `priority` field written, or not.
    pub engine_priority: kvroute_core::queue::engine_priority::EnginePriority,
    pub tokenizer: Option<PathBuf>,
    /// The tokenizer prefix cache's bound in bytes (0: off).
    pub tokenizer_cache_bytes: usize,
    /// Kubernetes and file discovery.
    pub discovery: DiscoverySettings,
    /// The embedded simulated engines' step-time model.
    pub timing_model: kvroute_sim::engine::TimingFamily,
    /// The endpoint picker (`--epp`), when on: then kvroute decides and Envoy proxies.
    pub epp: Option<super::EppSettings>,
}

impl Settings {
    /// Settings with every default and the given workers: what tests start from.
    pub fn with_workers(workers: Vec<WorkerSpec>) -> Result<Self, ConfigError> {
        Args {
            workers,
            ..Args::default()
        }
        .into_settings()
    }

    /// Whether a source may add workers at run time: discovery, or the endpoint picker's
    /// pool or selector (then no engine is simulated, and an empty reloaded config is fine).
    pub fn discovers(&self) -> bool {
        self.discovery.any()
            || self
                .epp
                .as_ref()
                .is_some_and(|e| !matches!(e.endpoints, super::EppEndpoints::Static))
    }
}

/// `--max-concurrent-requests`, `--queue-size`, `--queue-timeout-secs` and
/// `--rate-limit-tokens-per-second` (see the `admission` module).
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionSettings {
    /// Requests in the router at once; unlimited when `None`.
    pub limit: Option<usize>,
    pub queue_size: usize,
    pub queue_timeout: Duration,
    /// Admissions per second, when rate limited.
    pub rate: Option<f64>,
}

/// Replica sync: where the peers meet (NATS) and how long a start-up snapshot may take.
#[derive(Debug, Clone)]
pub struct SyncConfig {
    pub url: String,
    pub prefix: String,
    pub timeout: Duration,
}
