//! The command line of `kvroute`, which is also the config file's schema (read by `load`).

use std::path::PathBuf;

use clap::Parser;
use kvroute_core::PolicyKind;
use kvroute_sim::engine::TimingFamily;
use serde::{Deserialize, Serialize};

use super::load::{de_policy, parse_go_bool, parse_policy, parse_whole_secs, ser_policy};
pub use super::values::{
    AffinityModeArg, AssignmentModeArg, CostModelArg, LogLevel, MemoryCostArg, QueueOrderArg,
};
use super::{DiscoveryProvider, MetricsPeer, PdProtocol, PolicyClassSpec, WorkerSpec};

/// The command line of `kvroute`, and the schema of its config file.
#[derive(Debug, Default, Parser, Deserialize, Serialize)]
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
    #[arg(alias = "http-host", long)]
    pub host: Option<String>,
    /// Port to serve the API on [default: 30000].
    #[arg(alias = "http-port", long)]
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
    /// Find workers among Kubernetes pods by label selector (`--selector`).
    #[arg(long)]
    #[serde(default)]
    pub service_discovery: bool,
    /// smg's discovery source: kubernetes (as --service-discovery) or file (--discovery-file).
    #[arg(long, value_enum)]
    pub discovery_provider: Option<DiscoveryProvider>,
    /// Pods whose labels match all of these are workers (`key=value`).
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub selector: Vec<String>,
    /// Pods matching all of these are prefill workers (disaggregation).
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub prefill_selector: Vec<String>,
    /// Pods matching all of these are decode workers (disaggregation).
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub decode_selector: Vec<String>,
    /// The port the engines listen on in their pods [default: 80].
    #[arg(long)]
    pub service_discovery_port: Option<u16>,
    /// The namespace whose pods are watched [default: all namespaces].
    #[arg(long)]
    pub service_discovery_namespace: Option<String>,
    /// The API's kubeconfig; else the in-cluster config, $KUBECONFIG or ~/.kube/config.
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// Workers listed in this file (the config file's `workers:`), watched for changes.
    #[arg(long, value_name = "PATH")]
    pub discovery_file: Option<PathBuf>,
    /// Seconds between full re-lists of pods (and discovery file re-reads) [default: 30].
    #[arg(long)]
    pub discovery_check_interval_secs: Option<u64>,

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
    #[serde(deserialize_with = "de_policy", serialize_with = "ser_policy")]
    pub prefill_policy: Option<PolicyKind>,
    /// Policy choosing the decode worker [default: kv_aware by load only (credit 0)].
    #[arg(long, value_parser = parse_policy)]
    #[serde(deserialize_with = "de_policy", serialize_with = "ser_policy")]
    pub decode_policy: Option<PolicyKind>,
    /// How halves reach engines: vllm (NIXL kv_transfer_params), sglang (bootstrap) [vllm].
    #[arg(long, value_enum)]
    pub pd_protocol: Option<PdProtocol>,
    /// Skip the remote prefill when the chosen decode worker already holds all but fewer
    /// than this many prompt tokens [default: 0, always disaggregate].
    #[arg(long)]
    pub pd_min_uncached_tokens: Option<u64>,
    /// Routing policy [default: kv_aware].
    #[arg(long, value_parser = parse_policy)]
    #[serde(deserialize_with = "de_policy", serialize_with = "ser_policy")]
    pub policy: Option<PolicyKind>,
    /// prefix_hash: characters of the prompt hashed [default: 256].
    #[arg(long)]
    pub prefix_token_count: Option<usize>,
    /// prefix_hash: leave the hashed worker when its load exceeds this x the mean [default: 1.25].
    #[arg(long)]
    pub prefix_hash_load_factor: Option<f64>,
    /// manual: forget a session key idle this long [default: 14400].
    #[arg(alias = "sticky-key-idle-secs", long)]
    pub max_idle_secs: Option<u64>,
    /// manual: how a new session key is placed [default: min_load].
    #[arg(long, value_enum)]
    pub assignment_mode: Option<AssignmentModeArg>,
    /// cache_aware: route by the tree when the matched share of the prompt exceeds this [default: 0.3].
    #[arg(alias = "cache-match-threshold", long)]
    pub cache_threshold: Option<f64>,
    /// cache_aware: the load is imbalanced when max - min exceeds this... [default: 64].
    #[arg(alias = "spill-abs-threshold", long)]
    pub balance_abs_threshold: Option<u64>,
    /// cache_aware: ...and max exceeds this times min [default: 1.5].
    #[arg(alias = "spill-rel-threshold", long)]
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
    /// llm_d: weight of llm-d's LoRA-affinity scorer [default: 0, off].
    #[arg(long)]
    pub llm_d_lora_weight: Option<f64>,
    /// llm_d: score the prefix from the engines' KV events (the KV index), as llm-d's
    /// `precise-prefix-cache-producer`, not from the policy's own record of its decisions.
    #[arg(long)]
    #[serde(default)]
    pub llm_d_precise_prefix: bool,
    /// least_load: seconds of expected wait per unit of `k / (1 - k)` of an engine's KV
    /// usage k [default: 0.15]. smg's.
    #[arg(long)]
    pub least_load_kv_pressure_weight: Option<f64>,
    /// least_load: tokens per second an engine is assumed to prefill [default: 2000].
    #[arg(long)]
    pub least_load_default_throughput: Option<f64>,
    /// least_load: prefill tokens assumed per waiting request [default: 1024].
    #[arg(long)]
    pub least_load_mean_prefill_tokens: Option<u64>,
    /// least_load: skip a worker with this many waiting requests; 0: never [default: 0].
    #[arg(long)]
    pub least_load_max_waiting_requests: Option<u64>,
    /// Overload protection: pass over a worker whose engine reports at least this many
    /// waiting requests (summed over its ranks); turns protection on. smg's.
    #[arg(long)]
    pub worker_overload_waiting_requests: Option<u64>,
    /// Overload protection: pass over a worker whose engine's KV usage (the mean over its
    /// ranks) is at least this, in (0, 1]; turns protection on. smg's.
    #[arg(long)]
    pub worker_overload_token_usage: Option<f64>,
    /// Overload protection on, with smg's thresholds (8 waiting, 0.8 KV usage) if not given.
    #[arg(long)]
    #[serde(default)]
    pub worker_overload_protection: bool,
    /// Overload protection off (smg's flag; kvroute's default).
    #[arg(long, conflicts_with_all = ["worker_overload_protection", "worker_overload_waiting_requests", "worker_overload_token_usage", "worker_overload_shed"])]
    #[serde(default)]
    pub disable_worker_overload_protection: bool,
    /// Every worker overloaded: answer 503 `worker_overload_protection_shed`, not the least loaded.
    #[arg(long)]
    #[serde(default)]
    pub worker_overload_shed: bool,
    /// Per-request latency targets: `--slo-shed`.
    #[command(flatten)]
    #[serde(flatten)]
    pub slo: super::slo::SloArgs,
    /// How often each engine's /metrics is read, when the policy uses engine metrics [default: 50].
    #[arg(long)]
    pub metrics_refresh_ms: Option<u64>,
    /// The most scrapes of the workers' /metrics a second, all workers together: in a larger
    /// fleet each worker's interval stretches from --metrics-refresh-ms (up to 1 s) to keep
    /// under it; 0: no limit [default: 2000; no limit under llm_d and least_load, which
    /// decide on the engines' queues].
    #[arg(long)]
    pub metrics_scrapes_per_sec: Option<u32>,
    /// The router's KV block size in tokens [default: 16].
    #[arg(aliases = ["kv-event-block-size", "kv-cache-block-size"], long)]
    pub block_size: Option<usize>,
    /// kv_aware's cost model and weights: `--router-*`, `--shared-cache-multiplier`.
    #[command(flatten)]
    #[serde(flatten)]
    pub kv_aware: super::kv_aware::KvAwareArgs,
    /// Ignore engines' KV events: approximate their caches from the router's own decisions.
    #[arg(alias = "no-kv-events", long)]
    #[serde(default)]
    pub no_router_kv_events: bool,
    /// The most KV blocks the router indexes (at most 2^27); the least recently stored go first [default: 4194304].
    #[arg(long)]
    pub router_max_indexed_blocks: Option<usize>,
    /// KV-event threads: >1 shards the index by replica, mirrored; queries never wait [default: 1].
    #[arg(long)]
    pub router_event_threads: Option<usize>,
    /// kv_aware in pools of 64+ workers: cost the prompt's holders and N other ranks drawn at random, not every rank (0: every rank) [default: 64 in pools of 256+ ranks, else every rank].
    #[arg(long)]
    pub router_sample_ranks: Option<usize>,
    /// Approximate mode: how long a routed prefix is assumed cached, whole seconds or Dynamo's float `120.0` [default: 120].
    #[arg(long, value_parser = parse_whole_secs)]
    pub router_ttl_secs: Option<u64>,
    /// A model directory (tokenizer.json, tokenizer_config.json) or a tokenizer.json, to tokenise like the engines; without it, the fallback shared with kvroute-sim.
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// Bytes the tokenizer's prefix cache may hold; 0 turns it off [default: 268435456].
    #[arg(long, value_name = "BYTES")]
    pub tokenizer_cache_l1_max_memory: Option<usize>,
    /// smg's flag, accepted: exact repeats are served by the one prefix cache.
    #[arg(long)]
    #[serde(default)]
    pub tokenizer_cache_enable_l0: bool,
    /// smg's flag, accepted: the prefix cache is on unless its memory is 0.
    #[arg(long)]
    #[serde(default)]
    pub tokenizer_cache_enable_l1: bool,
    /// The step-time model of the embedded simulated engines (started when no worker is given): kvroute's own, or Dynamo 1.6.1's mocker exactly [default: kvroute].
    #[arg(long, value_enum)]
    pub timing_model: Option<TimingFamily>,
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
    /// How the router queue orders tenants within a class: vtc (the tenant served the fewest
    /// tokens goes next) or fcfs (tenants ignored) [default: vtc].
    #[arg(long, value_enum)]
    pub router_queue_fairness: Option<super::TenantOrder>,
    /// smg's priority scheduler: x-smg-priority classes order the router queue.
    #[arg(long)]
    #[serde(default)]
    pub priority_scheduler_enabled: bool,
    /// smg's priority-scheduler YAML (classes, tenant_policies.<key>.max_class).
    #[arg(long, value_name = "FILE")]
    pub priority_scheduler_config: Option<PathBuf>,
    /// The highest class of a tenant the priority file does not list [default: default].
    #[arg(long, value_enum)]
    pub priority_scheduler_default_max_class: Option<super::PriorityClass>,
    /// Write each request's engine `priority` (class, then tenant share) [default: off].
    #[arg(long, value_enum)]
    pub engine_priority: Option<super::EnginePriorityArg>,
    /// Policy classes of the queue (config file only): name, weight (a quantum in uncached
    /// tokens), optional max_queued.
    #[arg(skip)]
    pub policy_classes: Vec<PolicyClassSpec>,
    /// Session affinity: a session goes back to its last (worker, rank) within this many seconds.
    #[arg(aliases = ["kv-aware-session-affinity-ttl-secs", "router-session-affinity-ttl-secs"], long)]
    pub session_affinity_ttl_secs: Option<u64>,
    /// hard: the binding is a pin; soft: the policy may choose another when the bound worker
    /// is ineligible or overloaded [default: soft].
    #[arg(alias = "router-session-affinity-mode", long, value_enum)]
    pub session_affinity_mode: Option<AffinityModeArg>,
    /// The key admin calls must carry (`Authorization: Bearer KEY`); without it, changes
    /// through the admin API are accepted from loopback only.
    #[arg(long, env = "KVROUTE_ADMIN_API_KEY", hide_env_values = true)]
    #[serde(skip_serializing)]
    pub admin_api_key: Option<String>,
    /// The key clients must present (`Authorization: Bearer KEY`) on inference and model
    /// calls; 401 otherwise (off when absent).
    #[arg(long, env = "KVROUTE_CLIENT_API_KEY", hide_env_values = true)]
    #[serde(skip_serializing)]
    pub client_api_key: Option<String>,
    /// The key sent to the workers as `Authorization: Bearer KEY`, as the peers' --api-key.
    #[arg(long, env = "KVROUTE_API_KEY", hide_env_values = true)]
    #[serde(skip_serializing)]
    pub api_key: Option<String>,
    /// smg's per-tenant client keys, `ID:KEY` (repeatable): a call with KEY as its bearer
    /// token (or `x-api-key`) is tenant `auth:ID`; with any set, other keys are refused.
    #[arg(long, value_name = "ID:KEY", action = clap::ArgAction::Append)]
    #[serde(skip_serializing)]
    pub tenant_api_key: Vec<String>,
    /// Take an unauthenticated call's tenant from --tenant-header-name (`header:<id>`).
    #[arg(long)]
    #[serde(default)]
    pub trust_tenant_header: bool,
    /// The trusted tenant header [default: x-smg-tenant-id].
    #[arg(long, value_name = "NAME")]
    pub tenant_header_name: Option<String>,
    /// Per-tenant token and request rate limits, from --tenant-rate-limit-config
    /// (docs/tenants.md).
    #[arg(long)]
    #[serde(default)]
    pub tenant_rate_limit_enabled: bool,
    /// smg's rate-limit YAML: `default_policy`, `tenants[]` with their model rules.
    #[arg(long, value_name = "FILE")]
    pub tenant_rate_limit_config: Option<PathBuf>,
    /// Tenants with a label of their own in the per-tenant metrics (the first N seen; the
    /// rest are `other`) [default: 32].
    #[arg(long, value_name = "N")]
    pub priority_scheduler_tenant_metric_top_n: Option<usize>,
    /// JWT/OIDC: the issuer (its `iss`); tokens are checked on the inference and admin APIs.
    #[arg(long, env = "JWT_ISSUER", value_name = "URL")]
    pub jwt_issuer: Option<String>,
    /// JWT: the audience a token's `aud` must hold (required with --jwt-issuer).
    #[arg(long, env = "JWT_AUDIENCE")]
    pub jwt_audience: Option<String>,
    /// JWT: the JWKS's URL [default: the issuer's .well-known/openid-configuration's].
    #[arg(long, value_name = "URL")]
    pub jwt_jwks_uri: Option<String>,
    /// JWT: the IdP's roles or groups as kvroute's roles, `IDP_ROLE=admin|user`; admin may
    /// call the admin API.
    #[arg(long, num_args = 1.., value_name = "IDP_ROLE=ROLE")]
    pub jwt_role_mapping: Vec<String>,
    /// TLS to workers: CA certificates (PEM files, one or more certificates each) trusted
    /// for `https://` workers, besides the system's roots.
    #[arg(long, num_args = 1.., value_name = "FILE")]
    pub ca_cert_paths: Vec<PathBuf>,
    /// mTLS to workers: the certificate (PEM, with its chain) presented to https workers;
    /// with --client-key-path.
    #[arg(long, value_name = "FILE")]
    pub client_cert_path: Option<PathBuf>,
    /// mTLS to workers: the private key (PEM) of --client-cert-path.
    #[arg(long, value_name = "FILE")]
    pub client_key_path: Option<PathBuf>,
    /// Serve the API over https with this certificate (PEM, with its chain); with
    /// --tls-key-path. Both files are re-read on SIGHUP.
    #[arg(long, value_name = "FILE")]
    pub tls_cert_path: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert-path.
    #[arg(long, value_name = "FILE")]
    pub tls_key_path: Option<PathBuf>,

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
    /// Remove a worker that turns unhealthy instead of keeping and probing it; a discovery
    /// source adds it back while it still lists it [default: on with discovery]. smg's.
    #[arg(
        long,
        alias = "worker-auto-recovery",
        conflicts_with = "no_remove_unhealthy_workers"
    )]
    #[serde(default)]
    pub remove_unhealthy_workers: bool,
    /// Keep unhealthy workers (probed until healthy again), even under discovery.
    #[arg(long, alias = "no-worker-auto-recovery")]
    #[serde(default)]
    pub no_remove_unhealthy_workers: bool,
    /// Remove a worker that has not answered a probe this many seconds after it was added
    /// [default: none, probed until it answers]. The peers' flag.
    #[arg(long)]
    pub worker_startup_timeout_secs: Option<u64>,
    /// Also serve /health, /liveness and /readiness on this port, from a thread of its own
    /// that load on the main port cannot starve [default: none]. smg's.
    #[arg(long)]
    pub health_check_port: Option<u16>,

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
    /// Times a stream whose worker fails after its first bytes is carried on by another
    /// worker, with what was generated so far; 0 turns migration off [default: 3].
    #[arg(long)]
    pub migration_limit: Option<u32>,
    /// A stream silent this long counts as its worker failing (migration) [default: 120].
    #[arg(long)]
    pub migration_stall_timeout_secs: Option<u64>,

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

    /// Router replicas in sync over NATS (`nats://HOST:PORT`): each replica's load is
    /// every replica's (off when absent).
    #[arg(long, value_name = "URL")]
    pub replica_sync: Option<String>,
    /// Subject prefix of the sync messages [default: kvroute].
    #[arg(long)]
    pub replica_sync_subject_prefix: Option<String>,
    /// A peer replica silent this long is gone, with its load [default: 10].
    #[arg(long)]
    pub replica_timeout_secs: Option<u64>,
    /// Requests in the router at once; more wait in the admission queue (--queue-size).
    /// 0: no limit; -1: 1024 per core, at least 4096 (smg's "derived") [default: no limit].
    #[arg(long, allow_negative_numbers = true)]
    pub max_concurrent_requests: Option<i64>,
    /// Requests that may wait for admission (under --max-concurrent-requests or the rate);
    /// one more is refused with 429. 0: refuse at once [default: 100]. smg's.
    #[arg(long)]
    pub queue_size: Option<usize>,
    /// The longest a request waits for admission, then 503 `admission_timeout`
    /// [default: 60]. smg's.
    #[arg(long)]
    pub queue_timeout_secs: Option<u64>,
    /// Sustained admissions per second, bursting up to --max-concurrent-requests (or one
    /// second's worth without it); 0: no rate limit [default: none]. smg's.
    #[arg(long, value_name = "RATE", allow_negative_numbers = true)]
    pub rate_limit_tokens_per_second: Option<f64>,
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
    /// Log level: trace, debug, info, warn (or warning), error (or critical) [default: info].
    #[arg(long, value_enum)]
    pub log_level: Option<LogLevel>,
    /// The headers a session key is read from, in order: the first present with a value
    /// wins, then the body's `user` [default: x-session-id x-smg-routing-key x-user-id].
    /// smg's flag.
    #[arg(long, num_args = 1.., value_name = "HEADER")]
    #[serde(default)]
    pub routing_key_headers: Vec<String>,
    /// Logs as one JSON object per line, each request's lines with its request id (and the
    /// trace id of its `traceparent`, when it has one). smg's flag.
    #[arg(long)]
    #[serde(default)]
    pub log_json: bool,

    /// Sends OpenTelemetry traces to this collector (turns tracing on): an
    /// `http(s)://host[:port][/path]` URL is OTLP over HTTP/protobuf (to `/v1/traces` when no
    /// path is given); a bare `host:port` is OTLP/gRPC. smg's flag.
    #[arg(long, value_name = "ENDPOINT")]
    pub otlp_traces_endpoint: Option<String>,
    /// Turns tracing on; with no --otlp-traces-endpoint, to smg's default `localhost:4317`
    /// (gRPC). smg's flag.
    #[arg(long)]
    #[serde(default)]
    pub enable_trace: bool,
    /// The share of requests without a sampled `traceparent` that are traced, 0 to 1; a
    /// client's sampled `traceparent` is always traced [default: 1.0].
    #[arg(long, value_name = "RATIO")]
    pub otlp_sampling_ratio: Option<f64>,

    /// Endpoint-picker mode: kvroute picks the endpoint for Envoy (Gateway API Inference
    /// Extension's ext_proc) instead of proxying; implied by --pool-name and
    /// --endpoint-selector.
    #[arg(long)]
    #[serde(default)]
    pub epp: bool,
    /// EPP: the port of Envoy's ext_proc service [default: 9002].
    #[arg(long)]
    pub grpc_port: Option<u16>,
    /// EPP: the port of the gRPC health service [default: 9003].
    #[arg(long)]
    pub grpc_health_port: Option<u16>,
    /// EPP: TLS on the ext_proc port, as llm-d's Go flag: `--secure-serving`,
    /// `--secure-serving=false` [default: true].
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub secure_serving: Option<bool>,
    /// EPP: the directory holding tls.crt and tls.key for the ext_proc port [default: a
    /// self-signed certificate made at start].
    #[arg(long, value_name = "DIR")]
    pub cert_path: Option<PathBuf>,
    /// EPP: the InferencePool whose pods are the endpoints.
    #[arg(long)]
    pub pool_name: Option<String>,
    /// EPP: the namespace of the pool, or of the --endpoint-selector's pods [default: the
    /// NAMESPACE environment variable, else default].
    #[arg(long)]
    pub pool_namespace: Option<String>,
    /// EPP: the API group of the InferencePool [default: inference.networking.k8s.io].
    #[arg(long)]
    pub pool_group: Option<String>,
    /// EPP without a pool (llm-d's standalone mode): the pods matching this Kubernetes label
    /// selector are the endpoints; with --endpoint-target-ports.
    #[arg(long, value_name = "SELECTOR")]
    pub endpoint_selector: Option<String>,
    /// EPP: the ports of the --endpoint-selector's pods, one endpoint each (comma-separated,
    /// repeatable).
    #[arg(long, value_delimiter = ',', value_name = "PORT", action = clap::ArgAction::Append)]
    pub endpoint_target_ports: Vec<u16>,
    /// llm-d's name for the metrics port: in EPP mode it defaults to 9090; otherwise the same
    /// as --prometheus-port (give one of the two).
    #[arg(long, conflicts_with = "prometheus_port")]
    pub metrics_port: Option<u16>,
    /// EPP: each endpoint's KV events are read from `tcp://IP:PORT+rank` (llm-d's
    /// `kvEventsConfig.podDiscoveryConfig.socketPort`) [default: none, approximated].
    #[arg(long, value_name = "PORT")]
    pub kv_events_socket_port: Option<u16>,
    /// Also export these peers' metric names, for the counts kvroute has [default: none].
    #[arg(long, num_args = 1.., value_name = "PEER")]
    pub metrics_compat: Vec<MetricsPeer>,
    /// With --metrics-compat smg: the prefix of smg's families [default: smg].
    #[arg(long, value_name = "PREFIX")]
    pub metrics_prefix: Option<String>,
    /// llm-d's EndpointPickerConfig file (YAML): its scorers' weights become the llm_d
    /// policy's; kvroute's flags and --config win over it.
    #[arg(long, value_name = "FILE", conflicts_with = "config_text")]
    pub config_file: Option<PathBuf>,
    /// llm-d's EndpointPickerConfig as text, instead of --config-file.
    #[arg(long, value_name = "YAML")]
    pub config_text: Option<String>,

    /// Writes the settings (this command line over the --config file) to PATH as JSON in
    /// the config file's schema, secrets left out, then starts (Dynamo's flag).
    #[arg(long, value_name = "PATH")]
    #[serde(skip)]
    pub dump_config_to: Option<PathBuf>,
    /// The peers' flags accepted as no-ops on the command line (set from
    /// [`super::peers::pre_parse`]; in the dump for the record).
    #[arg(skip)]
    pub peer_noop_flags: Vec<String>,
}
