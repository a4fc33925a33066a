//! Configuration: one clap struct that is also the config file's schema, merged then
//! validated once into [`Settings`].
//!
//! Every knob is a field of [`Args`], which both clap (flags, `--kebab-case`) and serde
//! (the `--config` file, `snake_case`, YAML or JSON whatever the extension) read. The
//! command line wins over the file; defaults are applied once, in [`Args::into_settings`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, ValueEnum};
use kvroute_core::affinity::AffinityMode;
use kvroute_core::eligibility::BusyThresholds;
use kvroute_core::queue::{PolicyClass, QueueOrder};
use kvroute_core::{
    AssignmentMode, CacheAwareConfig, KvAwareConfig, LlmDConfig, PolicyConfig, PolicyKind,
};
use serde::{Deserialize, Deserializer};

use crate::auth::Secret;

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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    #[value(alias = "warning")]
    #[serde(alias = "warning")]
    Warn,
    Error,
}

impl LogLevel {
    pub fn as_filter(self) -> &'static str {
        match self {
            LogLevel::Trace => "trace",
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AssignmentModeArg {
    MinLoad,
    Random,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueOrderArg {
    Fcfs,
    Wspt,
}

/// A policy class as the config file describes it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AffinityModeArg {
    Hard,
    Soft,
}

/// A worker as the config file describes it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Deserialize)]
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
            max_num_batched_tokens: None,
            taints: Vec::new(),
            role: WorkerRole::Both,
            bootstrap_port: None,
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
    /// The wait before retry `n` (1-based), jittered by `unit` in [-1, 1].
    pub fn backoff(&self, n: u32, unit: f64) -> Duration {
        let base =
            self.initial_backoff.as_secs_f64() * self.multiplier.powi(n.saturating_sub(1) as i32);
        let capped = base.min(self.max_backoff.as_secs_f64());
        Duration::from_secs_f64((capped * (1.0 + self.jitter * unit.clamp(-1.0, 1.0))).max(0.0))
    }
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

/// The command line of `kvroute`, and the schema of its config file.
#[derive(Debug, Default, Parser, Deserialize)]
#[command(
    name = "kvroute",
    version,
    about = "KV-cache-aware router for OpenAI-compatible LLM engines (vLLM, SGLang)"
)]
#[serde(default, deny_unknown_fields)]
pub struct Args {
    /// Config file (YAML or JSON); the command line wins over it.
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,

    /// Address to serve the API on [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Port to serve the API on [default: 30000].
    #[arg(long)]
    pub port: Option<u16>,
    /// Address to serve Prometheus metrics on [default: the --host].
    #[arg(long)]
    pub prometheus_host: Option<String>,
    /// Port to serve Prometheus metrics on [default: 29000].
    #[arg(long)]
    pub prometheus_port: Option<u16>,

    /// Worker base URLs; each one's id is its URL, its models come from its /v1/models.
    #[arg(long, num_args = 1.., value_name = "URL")]
    pub worker_urls: Vec<String>,
    /// Workers with an id and a model (config file only).
    #[arg(skip)]
    pub workers: Vec<WorkerSpec>,

    /// Prefill/decode disaggregation: requests are prefilled on a prefill worker and
    /// decoded on a decode worker (on by itself when workers have roles).
    #[arg(long, alias = "vllm-pd-disaggregation")]
    pub pd_disaggregation: bool,
    /// A prefill worker, with its bootstrap port for SGLang's protocol (repeatable).
    #[arg(long, num_args = 1..=2, value_names = ["URL", "BOOTSTRAP_PORT"], action = clap::ArgAction::Append)]
    pub prefill: Vec<String>,
    /// A decode worker (repeatable).
    #[arg(long, value_name = "URL", action = clap::ArgAction::Append)]
    pub decode: Vec<String>,
    /// Policy choosing the prefill worker [default: kv_aware].
    #[arg(long, value_parser = parse_policy)]
    #[serde(deserialize_with = "de_policy")]
    pub prefill_policy: Option<PolicyKind>,
    /// Policy choosing the decode worker [default: kv_aware with overlap credit 0, i.e. by
    /// load only].
    #[arg(long, value_parser = parse_policy)]
    #[serde(deserialize_with = "de_policy")]
    pub decode_policy: Option<PolicyKind>,
    /// How the halves reach the engines: vllm (NIXL kv_transfer_params) or sglang
    /// (bootstrap) [default: vllm].
    #[arg(long, value_enum)]
    pub pd_protocol: Option<PdProtocol>,
    /// Skip the remote prefill when the chosen decode worker already holds all but fewer
    /// than this many prompt tokens [default: 0, always disaggregate].
    #[arg(long)]
    pub pd_min_uncached_tokens: Option<u64>,

    /// Routing policy [default: kv_aware].
    #[arg(long, value_parser = parse_policy)]
    #[serde(deserialize_with = "de_policy")]
    pub policy: Option<PolicyKind>,
    /// prefix_hash: characters of the prompt hashed [default: 256].
    #[arg(long)]
    pub prefix_token_count: Option<usize>,
    /// prefix_hash: leave the hashed worker when its load exceeds this x the mean [default: 1.25].
    #[arg(long)]
    pub prefix_hash_load_factor: Option<f64>,
    /// manual: forget a session key idle this long [default: 14400].
    #[arg(long)]
    pub max_idle_secs: Option<u64>,
    /// manual: how a new session key is placed [default: min_load].
    #[arg(long, value_enum)]
    pub assignment_mode: Option<AssignmentModeArg>,

    /// cache_aware: route by the tree when the matched share of the prompt exceeds this [default: 0.3].
    #[arg(long)]
    pub cache_threshold: Option<f64>,
    /// cache_aware: the load is imbalanced when max - min exceeds this... [default: 64].
    #[arg(long)]
    pub balance_abs_threshold: Option<u64>,
    /// cache_aware: ...and max exceeds this times min [default: 1.5].
    #[arg(long)]
    pub balance_rel_threshold: Option<f64>,
    /// cache_aware: seconds between tree evictions [default: 120].
    #[arg(long, alias = "eviction-interval")]
    #[serde(alias = "eviction_interval")]
    pub eviction_interval_secs: Option<u64>,
    /// cache_aware: characters each worker's tree may hold [default: 67108864].
    #[arg(long)]
    pub max_tree_size: Option<usize>,
    /// llm_d: weight of the prefix-cache scorer [default: 3].
    #[arg(long)]
    pub llm_d_prefix_weight: Option<f64>,
    /// llm_d: weight of the queue scorer [default: 2].
    #[arg(long)]
    pub llm_d_queue_weight: Option<f64>,
    /// llm_d: weight of the KV-cache utilisation scorer [default: 2].
    #[arg(long)]
    pub llm_d_kv_weight: Option<f64>,
    /// How often each engine's /metrics is read, when the policy uses engine metrics [default: 50].
    #[arg(long)]
    pub metrics_refresh_ms: Option<u64>,
    /// The router's KV block size in tokens [default: 16].
    #[arg(long)]
    pub block_size: Option<usize>,
    /// kv_aware: credit per prefix block cached on the device [default: 1.0].
    #[arg(long)]
    pub router_kv_overlap_score_credit: Option<f64>,
    /// kv_aware: weight of the prefill term [default: 1.0].
    #[arg(long)]
    pub router_prefill_load_scale: Option<f64>,
    /// kv_aware: weight of each active request [default: 0].
    #[arg(long)]
    pub router_decode_active_request_weight: Option<f64>,
    /// kv_aware: sample from a softmax over costs at this temperature; 0 picks the cheapest [default: 0].
    #[arg(long)]
    pub router_temperature: Option<f64>,
    /// kv_aware: credit per prefix block cached in host memory [default: 0.75].
    #[arg(long)]
    pub router_host_cache_hit_weight: Option<f64>,
    /// kv_aware: credit per prefix block cached on disk [default: 0.25].
    #[arg(long)]
    pub router_disk_cache_hit_weight: Option<f64>,
    /// kv_aware: credit per prefix block in a shared external cache [default: 0].
    #[arg(long)]
    pub shared_cache_multiplier: Option<f64>,
    /// Ignore engines' KV events: approximate their caches from the router's own decisions.
    #[arg(long)]
    #[serde(default)]
    pub no_router_kv_events: bool,
    /// The most KV blocks the router indexes; the least recently stored go first [default: 4194304].
    #[arg(long)]
    pub router_max_indexed_blocks: Option<usize>,
    /// Approximate mode: how long a routed prefix is assumed cached [default: 120].
    #[arg(long)]
    pub router_ttl_secs: Option<u64>,
    /// A model directory (tokenizer.json, tokenizer_config.json) or a tokenizer.json, to
    /// tokenise like the engines; without it, the fallback shared with kvroute-sim.
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,

    /// A rank is busy with more active prefill tokens than this.
    #[arg(long)]
    pub active_prefill_tokens_threshold: Option<u64>,
    /// A rank is busy with more active prefill tokens than this fraction of its engine's
    /// max_num_batched_tokens (workers without it in the config are skipped).
    #[arg(long)]
    pub active_prefill_tokens_threshold_frac: Option<f64>,
    /// A rank is busy with more active decode blocks (or engine KV use) than this fraction of
    /// its KV blocks, in [0, 1].
    #[arg(long)]
    pub active_decode_blocks_threshold: Option<f64>,
    /// Queue a request while every eligible rank has active prefill tokens above this
    /// fraction of its max_num_batched_tokens (off when absent).
    #[arg(long)]
    pub router_queue_threshold: Option<f64>,
    /// Order within a policy class: fcfs (arrival) or wspt (fewest uncached tokens first).
    #[arg(long, value_enum)]
    pub router_queue_policy: Option<QueueOrderArg>,
    /// The longest a request may wait in the queue [default: 60].
    #[arg(long)]
    pub router_queue_timeout_secs: Option<u64>,
    /// Policy classes of the queue (config file only): name, weight (a quantum in uncached
    /// tokens), optional max_queued.
    #[arg(skip)]
    pub policy_classes: Vec<PolicyClassSpec>,
    /// Session affinity: a session's requests go to the (worker, rank) it used last, if
    /// within this many seconds (off when absent).
    #[arg(long)]
    pub session_affinity_ttl_secs: Option<u64>,
    /// hard: the binding is a pin; soft: the policy may choose another when the bound worker
    /// is ineligible or overloaded [default: soft].
    #[arg(long, value_enum)]
    pub session_affinity_mode: Option<AffinityModeArg>,
    /// The key admin calls must carry (`Authorization: Bearer KEY`); without it, changes
    /// through the admin API are accepted from loopback only.
    #[arg(long, env = "KVROUTE_ADMIN_API_KEY", hide_env_values = true)]
    pub admin_api_key: Option<String>,
    /// The key clients must present (`Authorization: Bearer KEY`) on inference and model
    /// calls; 401 otherwise (off when absent).
    #[arg(long, env = "KVROUTE_CLIENT_API_KEY", hide_env_values = true)]
    pub client_api_key: Option<String>,
    /// The key sent to the workers as `Authorization: Bearer KEY`, as the peers' --api-key.
    #[arg(long, env = "KVROUTE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// Seconds between health checks of each worker [default: 60].
    #[arg(long)]
    pub health_check_interval_secs: Option<u64>,
    /// A health check's timeout [default: 5].
    #[arg(long)]
    pub health_check_timeout_secs: Option<u64>,
    /// Consecutive failed checks that make a worker unhealthy [default: 3].
    #[arg(long)]
    pub health_failure_threshold: Option<u32>,
    /// Consecutive passed checks that make it healthy again [default: 2].
    #[arg(long)]
    pub health_success_threshold: Option<u32>,
    /// The path checked [default: /health].
    #[arg(long)]
    pub health_check_endpoint: Option<String>,

    /// Retries of a request that failed before its first response byte, each on another
    /// worker [default: 5].
    #[arg(long)]
    pub retry_max_retries: Option<u32>,
    /// First backoff between attempts [default: 50].
    #[arg(long)]
    pub retry_initial_backoff_ms: Option<u64>,
    /// Longest backoff [default: 30000].
    #[arg(long)]
    pub retry_max_backoff_ms: Option<u64>,
    /// Backoff growth per attempt [default: 1.5].
    #[arg(long)]
    pub retry_backoff_multiplier: Option<f64>,
    /// Random share of each backoff, up or down [default: 0.2].
    #[arg(long)]
    pub retry_jitter_factor: Option<f64>,
    /// No retries: a failed attempt is the client's answer.
    #[arg(long)]
    pub disable_retries: bool,

    /// Consecutive failures that open a worker's circuit [default: 10].
    #[arg(long)]
    pub cb_failure_threshold: Option<u32>,
    /// Successes of the half-open circuit that close it again [default: 3].
    #[arg(long)]
    pub cb_success_threshold: Option<u32>,
    /// Seconds an open circuit waits before letting a probe request through [default: 60].
    #[arg(long)]
    pub cb_timeout_duration_secs: Option<u64>,
    /// No circuit breaker.
    #[arg(long)]
    pub disable_circuit_breaker: bool,

    /// Requests in the router at once; more are refused with 429 [default: unlimited].
    #[arg(long)]
    pub max_concurrent_requests: Option<usize>,
    /// On SIGTERM, how long in-flight requests may take to finish [default: 180].
    #[arg(long)]
    pub shutdown_grace_period_secs: Option<u64>,
    /// Longest a client may take to send its request headers [default: 30].
    #[arg(long)]
    pub header_read_timeout_secs: Option<u64>,

    /// Largest request body accepted, in bytes [default: 536870912].
    #[arg(long)]
    pub max_payload_size: Option<usize>,
    /// Longest wait for a worker's response headers [default: 1800].
    #[arg(long)]
    pub request_timeout_secs: Option<u64>,
    /// Log level: trace, debug, info, warn (or warning), error [default: info].
    #[arg(long, value_enum)]
    pub log_level: Option<LogLevel>,
}

fn parse_policy(s: &str) -> Result<PolicyKind, String> {
    s.parse::<PolicyKind>().map_err(|e| e.to_string())
}

fn de_policy<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PolicyKind>, D::Error> {
    let Some(name) = Option::<String>::deserialize(d)? else {
        return Ok(None);
    };
    name.parse().map(Some).map_err(serde::de::Error::custom)
}

/// The validated configuration the gateway runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub host: String,
    pub port: u16,
    pub prometheus_host: String,
    pub prometheus_port: u16,
    pub workers: Vec<WorkerSpec>,
    pub policy: PolicyKind,
    pub policy_config: PolicyConfig,
    pub max_payload_size: usize,
    pub request_timeout: Duration,
    pub log_level: LogLevel,
    pub block_size: usize,
    pub kv_events: KvEventsMode,
    pub router_ttl: Duration,
    pub max_indexed_blocks: usize,
    /// How often engine metrics are scraped (when the policy uses them).
    pub metrics_refresh: Duration,
    /// The busy thresholds every model starts with (`POST /busy_threshold` changes them).
    pub busy: BusyThresholds,
    pub admin_api_key: Option<Secret>,
    pub client_api_key: Option<Secret>,
    /// The key sent to the workers.
    pub api_key: Option<Secret>,
    pub health: HealthSettings,
    /// Retries; `max_retries` 0 when disabled.
    pub retry: RetrySettings,
    /// The circuit breaker, unless disabled.
    pub circuit: Option<CircuitSettings>,
    pub max_concurrent_requests: Option<usize>,
    pub shutdown_grace: Duration,
    pub header_read_timeout: Duration,
    /// Prefill/decode disaggregation, when on.
    pub pd: Option<PdSettings>,
    /// The config file, re-read on SIGHUP.
    pub config_path: Option<PathBuf>,
    /// `--worker-urls` as given on the command line (they stay across reloads).
    pub cli_worker_urls: Vec<String>,
    /// Session affinity's mode and TTL, when on.
    pub session_affinity: Option<(AffinityMode, Duration)>,
    /// The admission queue, when `--router-queue-threshold` is set.
    pub queue: Option<QueueSettings>,
    pub tokenizer: Option<PathBuf>,
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
}

impl Args {
    /// Reads the `--config` file, if any, under the command line.
    pub fn load(self) -> Result<Settings, ConfigError> {
        let cli_worker_urls = self.worker_urls.clone();
        let mut settings = match self.config.clone() {
            Some(path) => self.merge(Args::from_file(&path)?).into_settings(),
            None => self.into_settings(),
        }?;
        settings.cli_worker_urls = cli_worker_urls;
        Ok(settings)
    }

    pub fn from_file(path: &Path) -> Result<Args, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Args::from_text(&text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })
    }

    /// Parses a config file's text. YAML is a superset of JSON, so one parser reads both.
    pub fn from_text(text: &str) -> Result<Args, serde_yaml_ng::Error> {
        if text.trim().is_empty() {
            return Ok(Args::default());
        }
        serde_yaml_ng::from_str(text)
    }

    /// `self` (the command line) over `file`.
    pub fn merge(self, file: Args) -> Args {
        Args {
            config: self.config,
            host: self.host.or(file.host),
            port: self.port.or(file.port),
            prometheus_host: self.prometheus_host.or(file.prometheus_host),
            prometheus_port: self.prometheus_port.or(file.prometheus_port),
            worker_urls: if self.worker_urls.is_empty() {
                file.worker_urls
            } else {
                self.worker_urls
            },
            workers: file.workers,
            pd_disaggregation: self.pd_disaggregation || file.pd_disaggregation,
            prefill: if self.prefill.is_empty() {
                file.prefill
            } else {
                self.prefill
            },
            decode: if self.decode.is_empty() {
                file.decode
            } else {
                self.decode
            },
            prefill_policy: self.prefill_policy.or(file.prefill_policy),
            decode_policy: self.decode_policy.or(file.decode_policy),
            pd_protocol: self.pd_protocol.or(file.pd_protocol),
            pd_min_uncached_tokens: self.pd_min_uncached_tokens.or(file.pd_min_uncached_tokens),
            policy: self.policy.or(file.policy),
            prefix_token_count: self.prefix_token_count.or(file.prefix_token_count),
            prefix_hash_load_factor: self
                .prefix_hash_load_factor
                .or(file.prefix_hash_load_factor),
            max_idle_secs: self.max_idle_secs.or(file.max_idle_secs),
            assignment_mode: self.assignment_mode.or(file.assignment_mode),
            cache_threshold: self.cache_threshold.or(file.cache_threshold),
            balance_abs_threshold: self.balance_abs_threshold.or(file.balance_abs_threshold),
            balance_rel_threshold: self.balance_rel_threshold.or(file.balance_rel_threshold),
            eviction_interval_secs: self.eviction_interval_secs.or(file.eviction_interval_secs),
            max_tree_size: self.max_tree_size.or(file.max_tree_size),
            llm_d_prefix_weight: self.llm_d_prefix_weight.or(file.llm_d_prefix_weight),
            llm_d_queue_weight: self.llm_d_queue_weight.or(file.llm_d_queue_weight),
            llm_d_kv_weight: self.llm_d_kv_weight.or(file.llm_d_kv_weight),
            metrics_refresh_ms: self.metrics_refresh_ms.or(file.metrics_refresh_ms),
            block_size: self.block_size.or(file.block_size),
            router_kv_overlap_score_credit: self
                .router_kv_overlap_score_credit
                .or(file.router_kv_overlap_score_credit),
            router_prefill_load_scale: self
                .router_prefill_load_scale
                .or(file.router_prefill_load_scale),
            router_decode_active_request_weight: self
                .router_decode_active_request_weight
                .or(file.router_decode_active_request_weight),
            router_temperature: self.router_temperature.or(file.router_temperature),
            router_host_cache_hit_weight: self
                .router_host_cache_hit_weight
                .or(file.router_host_cache_hit_weight),
            router_disk_cache_hit_weight: self
                .router_disk_cache_hit_weight
                .or(file.router_disk_cache_hit_weight),
            shared_cache_multiplier: self
                .shared_cache_multiplier
                .or(file.shared_cache_multiplier),
            no_router_kv_events: self.no_router_kv_events || file.no_router_kv_events,
            router_ttl_secs: self.router_ttl_secs.or(file.router_ttl_secs),
            router_max_indexed_blocks: self
                .router_max_indexed_blocks
                .or(file.router_max_indexed_blocks),
            tokenizer: self.tokenizer.or(file.tokenizer),
            active_prefill_tokens_threshold: self
                .active_prefill_tokens_threshold
                .or(file.active_prefill_tokens_threshold),
            active_prefill_tokens_threshold_frac: self
                .active_prefill_tokens_threshold_frac
                .or(file.active_prefill_tokens_threshold_frac),
            active_decode_blocks_threshold: self
                .active_decode_blocks_threshold
                .or(file.active_decode_blocks_threshold),
            admin_api_key: self.admin_api_key.or(file.admin_api_key),
            client_api_key: self.client_api_key.or(file.client_api_key),
            api_key: self.api_key.or(file.api_key),
            health_check_interval_secs: self
                .health_check_interval_secs
                .or(file.health_check_interval_secs),
            health_check_timeout_secs: self
                .health_check_timeout_secs
                .or(file.health_check_timeout_secs),
            health_failure_threshold: self
                .health_failure_threshold
                .or(file.health_failure_threshold),
            health_success_threshold: self
                .health_success_threshold
                .or(file.health_success_threshold),
            health_check_endpoint: self.health_check_endpoint.or(file.health_check_endpoint),
            retry_max_retries: self.retry_max_retries.or(file.retry_max_retries),
            retry_initial_backoff_ms: self
                .retry_initial_backoff_ms
                .or(file.retry_initial_backoff_ms),
            retry_max_backoff_ms: self.retry_max_backoff_ms.or(file.retry_max_backoff_ms),
            retry_backoff_multiplier: self
                .retry_backoff_multiplier
                .or(file.retry_backoff_multiplier),
            retry_jitter_factor: self.retry_jitter_factor.or(file.retry_jitter_factor),
            disable_retries: self.disable_retries || file.disable_retries,
            cb_failure_threshold: self.cb_failure_threshold.or(file.cb_failure_threshold),
            cb_success_threshold: self.cb_success_threshold.or(file.cb_success_threshold),
            cb_timeout_duration_secs: self
                .cb_timeout_duration_secs
                .or(file.cb_timeout_duration_secs),
            disable_circuit_breaker: self.disable_circuit_breaker || file.disable_circuit_breaker,
            max_concurrent_requests: self
                .max_concurrent_requests
                .or(file.max_concurrent_requests),
            shutdown_grace_period_secs: self
                .shutdown_grace_period_secs
                .or(file.shutdown_grace_period_secs),
            header_read_timeout_secs: self
                .header_read_timeout_secs
                .or(file.header_read_timeout_secs),
            router_queue_threshold: self.router_queue_threshold.or(file.router_queue_threshold),
            router_queue_policy: self.router_queue_policy.or(file.router_queue_policy),
            router_queue_timeout_secs: self
                .router_queue_timeout_secs
                .or(file.router_queue_timeout_secs),
            policy_classes: file.policy_classes,
            session_affinity_ttl_secs: self
                .session_affinity_ttl_secs
                .or(file.session_affinity_ttl_secs),
            session_affinity_mode: self.session_affinity_mode.or(file.session_affinity_mode),
            max_payload_size: self.max_payload_size.or(file.max_payload_size),
            request_timeout_secs: self.request_timeout_secs.or(file.request_timeout_secs),
            log_level: self.log_level.or(file.log_level),
        }
    }

    /// Applies the defaults and validates.
    pub fn into_settings(self) -> Result<Settings, ConfigError> {
        let defaults = PolicyConfig::default();
        let mut workers: Vec<WorkerSpec> =
            self.worker_urls.into_iter().map(WorkerSpec::url).collect();
        // `--prefill URL [PORT]` occurrences arrive flattened: a number is the bootstrap port
        // of the URL before it.
        for value in &self.prefill {
            match value.parse::<u16>() {
                Ok(port) => match workers.last_mut() {
                    Some(w) if w.role == WorkerRole::Prefill && w.bootstrap_port.is_none() => {
                        w.bootstrap_port = Some(port)
                    }
                    _ => {
                        return Err(ConfigError::Invalid {
                            name: "prefill",
                            reason: "expected URL [BOOTSTRAP_PORT]",
                        })
                    }
                },
                Err(_) => workers.push(WorkerSpec {
                    role: WorkerRole::Prefill,
                    ..WorkerSpec::url(value.clone())
                }),
            }
        }
        for url in &self.decode {
            workers.push(WorkerSpec {
                role: WorkerRole::Decode,
                ..WorkerSpec::url(url.clone())
            });
        }
        workers.extend(self.workers);
        let mut seen = std::collections::HashSet::new();
        for w in &mut workers {
            w.url = normalize_url(&w.url)?;
            let id = w.id.get_or_insert_with(|| w.url.clone());
            if !seen.insert(id.clone()) {
                return Err(ConfigError::DuplicateWorker(id.clone()));
            }
        }
        let load_factor = self
            .prefix_hash_load_factor
            .unwrap_or(defaults.prefix_hash_load_factor);
        if !(load_factor.is_finite() && load_factor > 0.0) {
            return Err(ConfigError::Invalid {
                name: "prefix_hash_load_factor",
                reason: "must be a positive number",
            });
        }
        let max_payload_size = self.max_payload_size.unwrap_or(512 * 1024 * 1024);
        if max_payload_size == 0 {
            return Err(ConfigError::Invalid {
                name: "max_payload_size",
                reason: "must be positive",
            });
        }
        let request_timeout_secs = self.request_timeout_secs.unwrap_or(1800);
        if request_timeout_secs == 0 {
            return Err(ConfigError::Invalid {
                name: "request_timeout_secs",
                reason: "must be positive",
            });
        }
        let host = self.host.unwrap_or_else(|| "127.0.0.1".to_owned());
        let block_size = self.block_size.unwrap_or(16);
        if block_size == 0 {
            return Err(ConfigError::Invalid {
                name: "block_size",
                reason: "must be positive",
            });
        }
        let kv = KvAwareConfig::default();
        let weight = |name: &'static str, v: Option<f64>, default: f64| match v {
            Some(x) if !(x.is_finite() && x >= 0.0) => Err(ConfigError::Invalid {
                name,
                reason: "must be a non-negative number",
            }),
            Some(x) => Ok(x),
            None => Ok(default),
        };
        let kv_aware = KvAwareConfig {
            overlap_score_credit: weight(
                "router_kv_overlap_score_credit",
                self.router_kv_overlap_score_credit,
                kv.overlap_score_credit,
            )?,
            prefill_load_scale: weight(
                "router_prefill_load_scale",
                self.router_prefill_load_scale,
                kv.prefill_load_scale,
            )?,
            decode_active_request_weight: weight(
                "router_decode_active_request_weight",
                self.router_decode_active_request_weight,
                kv.decode_active_request_weight,
            )?,
            temperature: weight(
                "router_temperature",
                self.router_temperature,
                kv.temperature,
            )?,
            host_cache_hit_weight: weight(
                "router_host_cache_hit_weight",
                self.router_host_cache_hit_weight,
                kv.host_cache_hit_weight,
            )?,
            disk_cache_hit_weight: weight(
                "router_disk_cache_hit_weight",
                self.router_disk_cache_hit_weight,
                kv.disk_cache_hit_weight,
            )?,
            shared_cache_multiplier: weight(
                "shared_cache_multiplier",
                self.shared_cache_multiplier,
                kv.shared_cache_multiplier,
            )?,
        };
        let ca = CacheAwareConfig::default();
        let cache_aware = CacheAwareConfig {
            cache_threshold: match self.cache_threshold {
                Some(t) if !(0.0..=1.0).contains(&t) => {
                    return Err(ConfigError::Invalid {
                        name: "cache_threshold",
                        reason: "must be between 0 and 1",
                    })
                }
                Some(t) => t,
                None => ca.cache_threshold,
            },
            balance_abs_threshold: self
                .balance_abs_threshold
                .unwrap_or(ca.balance_abs_threshold),
            balance_rel_threshold: weight(
                "balance_rel_threshold",
                self.balance_rel_threshold,
                ca.balance_rel_threshold,
            )?,
            eviction_interval_secs: self
                .eviction_interval_secs
                .unwrap_or(ca.eviction_interval_secs),
            max_tree_size: self.max_tree_size.unwrap_or(ca.max_tree_size),
        };
        let busy = BusyThresholds {
            active_prefill_tokens: self.active_prefill_tokens_threshold,
            active_prefill_tokens_frac: self
                .active_prefill_tokens_threshold_frac
                .map(|f| weight("active_prefill_tokens_threshold_frac", Some(f), 0.0))
                .transpose()?,
            active_decode_blocks: match self.active_decode_blocks_threshold {
                Some(f) if !(0.0..=1.0).contains(&f) => {
                    return Err(ConfigError::Invalid {
                        name: "active_decode_blocks_threshold",
                        reason: "must be between 0 and 1",
                    })
                }
                other => other,
            },
        };
        let ld = LlmDConfig::default();
        let llm_d = LlmDConfig {
            prefix_weight: weight(
                "llm_d_prefix_weight",
                self.llm_d_prefix_weight,
                ld.prefix_weight,
            )?,
            queue_weight: weight(
                "llm_d_queue_weight",
                self.llm_d_queue_weight,
                ld.queue_weight,
            )?,
            kv_weight: weight("llm_d_kv_weight", self.llm_d_kv_weight, ld.kv_weight)?,
            block_size: ld.block_size.max(block_size),
        };
        let positive = |name: &'static str, v: Option<u64>, default: u64| match v {
            Some(0) => Err(ConfigError::Invalid {
                name,
                reason: "must be positive",
            }),
            Some(x) => Ok(x),
            None => Ok(default),
        };
        let health = HealthSettings {
            interval: Duration::from_secs(positive(
                "health_check_interval_secs",
                self.health_check_interval_secs,
                60,
            )?),
            timeout: Duration::from_secs(positive(
                "health_check_timeout_secs",
                self.health_check_timeout_secs,
                5,
            )?),
            failure_threshold: positive(
                "health_failure_threshold",
                self.health_failure_threshold.map(u64::from),
                3,
            )? as u32,
            success_threshold: positive(
                "health_success_threshold",
                self.health_success_threshold.map(u64::from),
                2,
            )? as u32,
            endpoint: match self.health_check_endpoint {
                Some(p) if !p.starts_with('/') => {
                    return Err(ConfigError::Invalid {
                        name: "health_check_endpoint",
                        reason: "must be a path starting with /",
                    })
                }
                Some(p) => p,
                None => "/health".to_owned(),
            },
        };
        let multiplier = self.retry_backoff_multiplier.unwrap_or(1.5);
        if !(multiplier.is_finite() && multiplier >= 1.0) {
            return Err(ConfigError::Invalid {
                name: "retry_backoff_multiplier",
                reason: "must be a number of at least 1",
            });
        }
        let jitter = self.retry_jitter_factor.unwrap_or(0.2);
        if !(0.0..=1.0).contains(&jitter) {
            return Err(ConfigError::Invalid {
                name: "retry_jitter_factor",
                reason: "must be between 0 and 1",
            });
        }
        let retry = RetrySettings {
            max_retries: if self.disable_retries {
                0
            } else {
                self.retry_max_retries.unwrap_or(5)
            },
            initial_backoff: Duration::from_millis(self.retry_initial_backoff_ms.unwrap_or(50)),
            max_backoff: Duration::from_millis(self.retry_max_backoff_ms.unwrap_or(30_000)),
            multiplier,
            jitter,
        };
        let circuit = (!self.disable_circuit_breaker)
            .then(|| -> Result<CircuitSettings, ConfigError> {
                Ok(CircuitSettings {
                    failure_threshold: positive(
                        "cb_failure_threshold",
                        self.cb_failure_threshold.map(u64::from),
                        10,
                    )? as u32,
                    success_threshold: positive(
                        "cb_success_threshold",
                        self.cb_success_threshold.map(u64::from),
                        3,
                    )? as u32,
                    timeout: Duration::from_secs(positive(
                        "cb_timeout_duration_secs",
                        self.cb_timeout_duration_secs,
                        60,
                    )?),
                })
            })
            .transpose()?;
        let pd_on = self.pd_disaggregation || workers.iter().any(|w| w.role != WorkerRole::Both);
        let pd = if pd_on {
            let complete = workers.iter().any(|w| w.role.prefills())
                && workers.iter().any(|w| w.role.decodes());
            if !workers.is_empty() && !complete {
                return Err(ConfigError::Invalid {
                    name: "pd_disaggregation",
                    reason: "needs at least one prefill and one decode worker",
                });
            }
            let base = PolicyConfig {
                kv_aware: kv_aware.clone(),
                cache_aware: cache_aware.clone(),
                llm_d: llm_d.clone(),
                ..PolicyConfig::default()
            };
            let decode_policy = self.decode_policy.unwrap_or(PolicyKind::KvAware);
            let mut decode_config = base.clone();
            if self.decode_policy.is_none() {
                // Dynamo's decode half: load only.
                decode_config.kv_aware.overlap_score_credit = 0.0;
            }
            Some(PdSettings {
                protocol: self.pd_protocol.unwrap_or_default(),
                prefill_policy: self.prefill_policy.unwrap_or(PolicyKind::KvAware),
                prefill_config: base,
                decode_policy,
                decode_config,
                min_uncached_tokens: self.pd_min_uncached_tokens.unwrap_or(0),
            })
        } else {
            None
        };
        for w in &workers {
            if w.dp_size == Some(0) {
                return Err(ConfigError::Invalid {
                    name: "dp_size",
                    reason: "must be at least 1",
                });
            }
            if let Some(endpoint) = w.kv_events.iter().chain(&w.kv_events_replay).next() {
                if !endpoint.starts_with("tcp://") || endpoint.rsplit_once(':').is_none() {
                    return Err(ConfigError::Invalid {
                        name: "kv_events",
                        reason: "must be tcp://HOST:PORT",
                    });
                }
            }
        }
        Ok(Settings {
            prometheus_host: self.prometheus_host.unwrap_or_else(|| host.clone()),
            host,
            port: self.port.unwrap_or(30000),
            prometheus_port: self.prometheus_port.unwrap_or(29000),
            workers,
            policy: self.policy.unwrap_or(PolicyKind::KvAware),
            policy_config: PolicyConfig {
                prefix_token_count: self
                    .prefix_token_count
                    .unwrap_or(defaults.prefix_token_count),
                prefix_hash_load_factor: load_factor,
                max_idle: self
                    .max_idle_secs
                    .map_or(defaults.max_idle, Duration::from_secs),
                assignment_mode: match self.assignment_mode {
                    Some(AssignmentModeArg::Random) => AssignmentMode::Random,
                    Some(AssignmentModeArg::MinLoad) | None => AssignmentMode::MinLoad,
                },
                kv_aware,
                cache_aware,
                llm_d,
                ..defaults
            },
            max_payload_size,
            request_timeout: Duration::from_secs(request_timeout_secs),
            log_level: self.log_level.unwrap_or(LogLevel::Info),
            block_size,
            kv_events: if self.no_router_kv_events {
                KvEventsMode::Approximate
            } else {
                KvEventsMode::Events
            },
            router_ttl: Duration::from_secs(self.router_ttl_secs.unwrap_or(120)),
            max_indexed_blocks: self.router_max_indexed_blocks.unwrap_or(1 << 22).max(1),
            metrics_refresh: Duration::from_millis(self.metrics_refresh_ms.unwrap_or(50).max(1)),
            busy,
            admin_api_key: self.admin_api_key.and_then(Secret::new),
            client_api_key: self.client_api_key.and_then(Secret::new),
            api_key: self.api_key.and_then(Secret::new),
            health,
            retry,
            circuit,
            max_concurrent_requests: match self.max_concurrent_requests {
                Some(0) => {
                    return Err(ConfigError::Invalid {
                        name: "max_concurrent_requests",
                        reason: "must be positive",
                    })
                }
                n => n,
            },
            shutdown_grace: Duration::from_secs(self.shutdown_grace_period_secs.unwrap_or(180)),
            header_read_timeout: Duration::from_secs(
                self.header_read_timeout_secs.unwrap_or(30).max(1),
            ),
            pd,
            config_path: self.config,
            cli_worker_urls: Vec::new(),
            queue: match self.router_queue_threshold {
                None => None,
                Some(t) if !(t.is_finite() && t > 0.0) => {
                    return Err(ConfigError::Invalid {
                        name: "router_queue_threshold",
                        reason: "must be a positive number",
                    })
                }
                Some(threshold) => {
                    let mut class_thresholds = Vec::new();
                    let mut classes: Vec<PolicyClass> = Vec::new();
                    for c in self.policy_classes {
                        if c.active_decode_blocks_threshold
                            .is_some_and(|f| !(0.0..=1.0).contains(&f))
                        {
                            return Err(ConfigError::Invalid {
                                name: "policy_classes.active_decode_blocks_threshold",
                                reason: "must be between 0 and 1",
                            });
                        }
                        class_thresholds.push(BusyThresholds {
                            active_prefill_tokens: c.active_prefill_tokens_threshold,
                            active_prefill_tokens_frac: c.active_prefill_tokens_threshold_frac,
                            active_decode_blocks: c.active_decode_blocks_threshold,
                        });
                        classes.push(PolicyClass {
                            name: c.name,
                            weight: c.weight,
                            max_queued: c.max_queued,
                        });
                    }
                    if classes.is_empty() {
                        classes.push(PolicyClass {
                            name: "default".into(),
                            weight: 1,
                            max_queued: None,
                        });
                        class_thresholds.push(BusyThresholds::default());
                    }
                    let order = match self.router_queue_policy {
                        Some(QueueOrderArg::Wspt) => QueueOrder::Wspt,
                        Some(QueueOrderArg::Fcfs) | None => QueueOrder::Fcfs,
                    };
                    if let Err(e) = kvroute_core::queue::DrrQueue::<()>::new(classes.clone(), order)
                    {
                        tracing::error!(error = %e, "invalid policy classes");
                        return Err(ConfigError::Invalid {
                            name: "policy_classes",
                            reason: "need distinct names and positive weights",
                        });
                    }
                    Some(QueueSettings {
                        threshold,
                        order,
                        timeout: Duration::from_secs(
                            self.router_queue_timeout_secs.unwrap_or(60).max(1),
                        ),
                        classes,
                        class_thresholds,
                    })
                }
            },
            session_affinity: self.session_affinity_ttl_secs.map(|secs| {
                let mode = match self.session_affinity_mode {
                    Some(AffinityModeArg::Hard) => AffinityMode::Hard,
                    Some(AffinityModeArg::Soft) | None => AffinityMode::Soft,
                };
                (mode, Duration::from_secs(secs))
            }),
            tokenizer: self.tokenizer,
        })
    }
}

/// Checks a worker base URL (`http://host:port[/prefix]`) and drops a trailing slash.
fn normalize_url(url: &str) -> Result<String, ConfigError> {
    let bad = |reason| ConfigError::WorkerUrl {
        url: url.to_owned(),
        reason,
    };
    let uri: http::Uri = url.parse().map_err(|_| bad("not a URL"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => return Err(bad("https workers are not supported yet; use http")),
        _ => return Err(bad("must start with http://")),
    }
    if uri.authority().is_none() {
        return Err(bad("has no host"));
    }
    if uri.query().is_some() {
        return Err(bad("must not have a query"));
    }
    Ok(url.trim_end_matches('/').to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_json_files_read_the_same() {
        let yaml = "policy: consistent_hash\nport: 8080\nlog_level: warning\nworkers:\n  - id: a\n    url: http://10.0.0.1:8000/\n    model: llama\n  - url: http://10.0.0.2:8000\n";
        let json = r#"{"policy":"consistent_hash","port":8080,"log_level":"warning","workers":[
            {"id":"a","url":"http://10.0.0.1:8000/","model":"llama"},{"url":"http://10.0.0.2:8000"}]}"#;
        for text in [yaml, json] {
            let s = Args::from_text(text).unwrap().into_settings().unwrap();
            assert_eq!(s.policy, PolicyKind::ConsistentHash);
            assert_eq!(s.port, 8080);
            assert_eq!(s.log_level, LogLevel::Warn);
            assert_eq!(s.workers[0].id.as_deref(), Some("a"));
            assert_eq!(s.workers[0].url, "http://10.0.0.1:8000");
            assert_eq!(s.workers[0].model.as_deref(), Some("llama"));
            assert_eq!(s.workers[1].id.as_deref(), Some("http://10.0.0.2:8000"));
        }
    }

    #[test]
    fn command_line_wins_over_file_and_defaults_apply() {
        let cli = Args::try_parse_from(["kvroute", "--port", "9", "--policy", "random"]).unwrap();
        let file = Args::from_text("port: 8\nhost: 0.0.0.0\npolicy: manual\n").unwrap();
        let s = cli.merge(file).into_settings().unwrap();
        assert_eq!(s.port, 9);
        assert_eq!(s.host, "0.0.0.0");
        assert_eq!(s.prometheus_host, "0.0.0.0");
        assert_eq!(s.policy, PolicyKind::Random);
        assert_eq!(s.prometheus_port, 29000);
        assert_eq!(s.max_payload_size, 512 * 1024 * 1024);
        let s = Args::default().into_settings().unwrap();
        assert_eq!((s.host.as_str(), s.port), ("127.0.0.1", 30000));
        assert_eq!(s.policy, PolicyKind::KvAware);
        assert_eq!(s.block_size, 16);
        assert_eq!(s.kv_events, KvEventsMode::Events);
        assert_eq!(s.policy_config.kv_aware, KvAwareConfig::default());
        let s = Args::try_parse_from([
            "kvroute",
            "--no-router-kv-events",
            "--router-temperature",
            "0.5",
            "--block-size",
            "32",
        ])
        .unwrap()
        .into_settings()
        .unwrap();
        assert_eq!(s.kv_events, KvEventsMode::Approximate);
        assert_eq!(s.policy_config.kv_aware.temperature, 0.5);
        assert_eq!(s.block_size, 32);
        let w = Args::from_text(
            "workers: [{url: 'http://a:1', kv_events: 'tcp://a:5557', dp_size: 2, dp_start_rank: 4}]",
        )
        .unwrap()
        .into_settings()
        .unwrap();
        assert_eq!(w.workers[0].ranks(), vec![Some(4), Some(5)]);
        assert_eq!(w.workers[0].kv_events.as_deref(), Some("tcp://a:5557"));
        assert_eq!(w.workers[0].role, WorkerRole::Both);
        let full = Args::from_text(
            "workers:\n  - {id: a, url: 'http://a:1', model: m, taints: [gpu-h100, zone-a], role: decode, max_num_batched_tokens: 8192, num_gpu_blocks: 16384}",
        )
        .unwrap()
        .into_settings()
        .unwrap();
        let a = &full.workers[0];
        assert_eq!(
            (a.role, a.max_num_batched_tokens, a.num_gpu_blocks),
            (WorkerRole::Decode, Some(8192), Some(16384))
        );
        assert_eq!(a.taints, ["gpu-h100", "zone-a"]);
        assert!(Args::from_text("workers: [{url: 'http://a:1', role: sideways}]").is_err());
        assert!(Args::from_text("router_temperature: -1")
            .unwrap()
            .into_settings()
            .is_err());
        assert!(
            Args::from_text("workers: [{url: 'http://a:1', kv_events: 'a:1'}]")
                .unwrap()
                .into_settings()
                .is_err()
        );
    }

    #[test]
    fn bad_configs_are_clear_errors() {
        let e = Args::from_text("policy: nope\n").unwrap_err().to_string();
        assert!(
            e.contains("valid policies") && e.contains("round_robin"),
            "{e}"
        );
        let e = Args::from_text("polcy: random\n").unwrap_err().to_string();
        assert!(e.contains("polcy"), "{e}");
        assert!(Args::from_text("workers: [{id: a}]").is_err());
        assert!(Args::from_text("port: [1]").is_err());
        let dup = Args::from_text("workers: [{url: 'http://a:1'}, {url: 'http://a:1/'}]").unwrap();
        assert!(matches!(
            dup.into_settings(),
            Err(ConfigError::DuplicateWorker(_))
        ));
        for url in ["a:1", "ftp://a:1", "https://a:1", "http://a:1/?x=1"] {
            let e = Args {
                worker_urls: vec![url.into()],
                ..Args::default()
            }
            .into_settings();
            assert!(matches!(e, Err(ConfigError::WorkerUrl { .. })), "{url}");
        }
        let e = Args::try_parse_from(["kvroute", "--policy", "nope"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("power_of_two"), "{e}");
        assert!(Args::try_parse_from(["kvroute", "--log-level", "warning"]).is_ok());
    }
}
