//! vLLM's `/metrics` names, labelled `model_name` and `engine` (the data-parallel rank).
//!
//! Gauges and counters are read from each engine's stats when scraped (the driver
//! publishes a copy after every step); the latency histograms are observed by the drivers
//! as tokens are delivered.
//!
//! Beside vLLM's: `kvroute_sim_role_info{role}` (1), `kvroute_sim_prefill_tokens_computed_total`
//! (tokens whose KV the engine computed), and, for prefill/decode disaggregation,
//! `kvroute_sim_kv_transfers_total{direction}` with `kvroute_sim_kv_transfer_tokens_total
//! {direction}`: `sent`, the prefills a prefill engine served for a decode engine and their
//! prompt tokens; `received`, the transfers that landed on a decode engine and the tokens
//! they carried (prompts less the decode engine's own cache hits); and
//! `kvroute_sim_bootstrap_waiting`, the decode engines waiting at a prefill engine's
//! bootstrap port for the prefill of a room.
//!
//! With LoRA adapters served, vLLM's `vllm:lora_requests_info{max_lora, waiting_lora_adapters,
//! running_lora_adapters}`: one series per state seen (adapter names comma-separated), whose
//! value is the Unix time in seconds at which the engine was last in that state, as vLLM sets
//! it; the newest series is the current state.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::adapters::Adapters;
use crate::config::Role;
use crate::engine::{EngineStats, LoraState};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineLabels {
    pub model_name: String,
    pub engine: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheConfigLabels {
    pub model_name: String,
    pub engine: String,
    pub block_size: String,
    pub num_gpu_blocks: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransferLabels {
    pub model_name: String,
    pub engine: String,
    pub direction: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoleLabels {
    pub model_name: String,
    pub role: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoraLabels {
    pub max_lora: String,
    pub waiting_lora_adapters: String,
    pub running_lora_adapters: String,
}

/// `vllm:lora_requests_info`, with the names of the adapters its labels list.
#[derive(Debug, Clone)]
pub struct LoraInfo {
    family: Family<LoraLabels, Gauge<f64, AtomicU64>>,
    adapters: Arc<Adapters>,
    max_lora: String,
}

impl LoraInfo {
    pub fn register(registry: &mut Registry, adapters: Arc<Adapters>, max_loras: usize) -> Self {
        let family = Family::default();
        registry.register(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            family.clone(),
        );
        let info = Self {
            family,
            adapters,
            max_lora: max_loras.to_string(),
        };
        // Idle from the start, as a router may read before the first request.
        info.update(&LoraState {
            max_loras,
            ..LoraState::default()
        });
        info
    }

    /// Stamps the series of `state` with the current time.
    fn update(&self, state: &LoraState) {
        let labels = LoraLabels {
            max_lora: self.max_lora.clone(),
            waiting_lora_adapters: self.adapters.joined(&state.waiting),
            running_lora_adapters: self.adapters.joined(&state.running),
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.family.get_or_create(&labels).set(now);
    }
}

/// One rank's count of KV transfers in one direction.
#[derive(Debug, Clone, Default)]
pub struct TransferCounters {
    transfers: Counter,
    tokens: Counter,
}

impl TransferCounters {
    pub fn count(&self, tokens: usize) {
        self.transfers.inc();
        self.tokens.inc_by(tokens as u64);
    }
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0,
    ]
    .into_iter()
}

/// One engine's series.
#[derive(Debug, Clone)]
pub struct EngineSeries {
    running: Gauge,
    waiting: Gauge,
    kv_usage: Gauge<f64, AtomicU64>,
    queries: Counter,
    hits: Counter,
    preemptions: Counter,
    prefill_tokens: Counter,
    received: TransferCounters,
    /// Prefills served for decode engines (counted by the server, not the engine).
    pub sent: TransferCounters,
    pub ttft: Histogram,
    pub itl: Histogram,
    /// Seconds the engine fell behind the model's pace and skipped (0 while it keeps up).
    pub lag_forgiven: Counter<f64, AtomicU64>,
    /// The counters' values as last exported, to add only the difference.
    exported: Arc<Mutex<EngineStats>>,
    lora: Option<LoraInfo>,
}

impl EngineSeries {
    /// The same series, exporting the adapters' state to `lora` (when adapters are served).
    pub fn with_lora(self, lora: Option<LoraInfo>) -> Self {
        Self { lora, ..self }
    }

    /// Brings `vllm:lora_requests_info` up to `state`.
    pub fn update_lora(&self, state: impl FnOnce() -> LoraState) {
        if let Some(lora) = &self.lora {
            lora.update(&state());
        }
    }

    /// Brings the series up to `stats`.
    pub fn update(&self, stats: &EngineStats) {
        self.running.set(stats.running as i64);
        self.waiting.set(stats.waiting as i64);
        self.kv_usage.set(stats.kv_usage);
        let mut last = self.exported.lock().unwrap_or_else(|e| e.into_inner());
        self.queries
            .inc_by(stats.prefix_cache_queries - last.prefix_cache_queries);
        self.hits
            .inc_by(stats.prefix_cache_hits - last.prefix_cache_hits);
        self.preemptions
            .inc_by(stats.preemptions - last.preemptions);
        self.prefill_tokens
            .inc_by(stats.prefill_tokens_computed - last.prefill_tokens_computed);
        self.received
            .transfers
            .inc_by(stats.kv_transfers_received - last.kv_transfers_received);
        self.received
            .tokens
            .inc_by(stats.kv_transfer_tokens_received - last.kv_transfer_tokens_received);
        *last = stats.clone();
    }
}

/// Registers every engine's series.
pub fn register(
    registry: &mut Registry,
    model: &str,
    role: Role,
    ranks: usize,
    block_size: usize,
    num_gpu_blocks: usize,
) -> Vec<EngineSeries> {
    let families = Families::default();
    families.register_vllm(registry);
    families.register_sim(registry);
    families
        .role_info
        .get_or_create(&RoleLabels {
            model_name: model.to_owned(),
            role: role.as_str(),
        })
        .set(1);
    (0..ranks)
        .map(|rank| families.engine(model, rank, block_size, num_gpu_blocks))
        .collect()
}

type HistogramFamily = Family<EngineLabels, Histogram, fn() -> Histogram>;

/// The metric families, holding one series per engine each.
struct Families {
    running: Family<EngineLabels, Gauge>,
    waiting: Family<EngineLabels, Gauge>,
    kv_usage: Family<EngineLabels, Gauge<f64, AtomicU64>>,
    queries: Family<EngineLabels, Counter>,
    hits: Family<EngineLabels, Counter>,
    preemptions: Family<EngineLabels, Counter>,
    cache_info: Family<CacheConfigLabels, Gauge>,
    lag: Family<EngineLabels, Counter<f64, AtomicU64>>,
    prefill_tokens: Family<EngineLabels, Counter>,
    transfers: Family<TransferLabels, Counter>,
    transfer_tokens: Family<TransferLabels, Counter>,
    role_info: Family<RoleLabels, Gauge>,
    ttft: HistogramFamily,
    itl: HistogramFamily,
}

impl Default for Families {
    fn default() -> Self {
        Self {
            running: Family::default(),
            waiting: Family::default(),
            kv_usage: Family::default(),
            queries: Family::default(),
            hits: Family::default(),
            preemptions: Family::default(),
            cache_info: Family::default(),
            lag: Family::default(),
            prefill_tokens: Family::default(),
            transfers: Family::default(),
            transfer_tokens: Family::default(),
            role_info: Family::default(),
            ttft: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
            itl: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
        }
    }
}

impl Families {
    /// vLLM's names.
    fn register_vllm(&self, registry: &mut Registry) {
        registry.register(
            "vllm:num_requests_running",
            "Requests in the running batch",
            self.running.clone(),
        );
        registry.register(
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled",
            self.waiting.clone(),
        );
        registry.register(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV blocks in use (1 = 100%)",
            self.kv_usage.clone(),
        );
        registry.register(
            "vllm:prefix_cache_queries",
            "Prompt tokens queried in the prefix cache",
            self.queries.clone(),
        );
        registry.register(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            self.hits.clone(),
        );
        registry.register(
            "vllm:num_preemptions",
            "Preempted requests",
            self.preemptions.clone(),
        );
        registry.register(
            "vllm:cache_config_info",
            "KV cache configuration",
            self.cache_info.clone(),
        );
        registry.register(
            "vllm:time_to_first_token_seconds",
            "Time to first token",
            self.ttft.clone(),
        );
        registry.register(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens",
            self.itl.clone(),
        );
    }

    /// The simulator's own (see the module docs).
    fn register_sim(&self, registry: &mut Registry) {
        registry.register(
            "kvroute_sim_role_info",
            "This engine's part in prefill/decode disaggregation (--role)",
            self.role_info.clone(),
        );
        registry.register(
            "kvroute_sim_prefill_tokens_computed",
            "Tokens whose KV this engine computed (not found in its prefix cache, not received)",
            self.prefill_tokens.clone(),
        );
        registry.register(
            "kvroute_sim_kv_transfers",
            "KV transfers: prefills served for decode engines (sent), prompts' KV received",
            self.transfers.clone(),
        );
        registry.register(
            "kvroute_sim_kv_transfer_tokens",
            "Tokens of KV in those transfers",
            self.transfer_tokens.clone(),
        );
    }

    /// Rank `rank`'s series, its cache configuration set.
    fn engine(
        &self,
        model: &str,
        rank: usize,
        block_size: usize,
        num_gpu_blocks: usize,
    ) -> EngineSeries {
        let l = EngineLabels {
            model_name: model.to_owned(),
            engine: rank.to_string(),
        };
        self.cache_info
            .get_or_create(&CacheConfigLabels {
                model_name: model.to_owned(),
                engine: rank.to_string(),
                block_size: block_size.to_string(),
                num_gpu_blocks: num_gpu_blocks.to_string(),
            })
            .set(1);
        EngineSeries {
            running: self.running.get_or_create(&l).clone(),
            waiting: self.waiting.get_or_create(&l).clone(),
            kv_usage: self.kv_usage.get_or_create(&l).clone(),
            queries: self.queries.get_or_create(&l).clone(),
            hits: self.hits.get_or_create(&l).clone(),
            preemptions: self.preemptions.get_or_create(&l).clone(),
            ttft: self.ttft.get_or_create(&l).clone(),
            itl: self.itl.get_or_create(&l).clone(),
            lag_forgiven: self.lag.get_or_create(&l).clone(),
            prefill_tokens: self.prefill_tokens.get_or_create(&l).clone(),
            received: transfer_counters(&self.transfers, &self.transfer_tokens, &l, "received"),
            sent: transfer_counters(&self.transfers, &self.transfer_tokens, &l, "sent"),
            exported: Arc::new(Mutex::new(EngineStats::default())),
            lora: None,
        }
    }
}

fn transfer_counters(
    transfers: &Family<TransferLabels, Counter>,
    tokens: &Family<TransferLabels, Counter>,
    engine: &EngineLabels,
    direction: &'static str,
) -> TransferCounters {
    let l = TransferLabels {
        model_name: engine.model_name.clone(),
        engine: engine.engine.clone(),
        direction,
    };
    TransferCounters {
        transfers: transfers.get_or_create(&l).clone(),
        tokens: tokens.get_or_create(&l).clone(),
    }
}
