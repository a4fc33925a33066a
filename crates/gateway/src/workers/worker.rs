//! One engine replica as the router sees it: its ranks with their load, its health and
//! circuit, and what it serves.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kvroute_core::eligibility::{BusyThresholds, RankPressure};
use kvroute_core::latency::{
    DecodeFeatures, FittedSpeed, LatencyModel, PrefillFeatures, SpeedFactors,
};
use kvroute_core::{AdapterFit, LoadSummary, RankLoad, RecentAdapters, RequestLoad};
use kvroute_index::ReplicaId;
use kvroute_protocol::{ModelId, WorkerId};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::lock;
use crate::config::{WorkerRole, WorkerSpec};
use crate::engine_metrics::EngineGauges;
use crate::health::Circuit;
use crate::metrics::{RankSeries, WorkerSeries};

/// One data-parallel rank of a worker (the whole worker when it has no ranks): the unit
/// `kv_aware` scores, with its active load.
#[derive(Debug)]
pub struct Rank {
    /// vLLM's data-parallel rank, sent as `X-data-parallel-rank`; `None` without ranks.
    pub dp_rank: Option<u32>,
    /// The rank's id in the KV indexes.
    pub replica: ReplicaId,
    pub(super) in_flight: AtomicU64,
    pub(super) load: Mutex<RankLoad>,
    pub(super) series: RankSeries,
    /// What the engine reports of this rank (scraped when the policy needs it).
    pub engine: Arc<EngineGauges>,
    /// The decode busy threshold's latch (see `BusyThresholds::overloaded`).
    pub(super) busy_latch: AtomicBool,
    /// Its latency models, fed by its streams' timings (kv_aware's predicted cost).
    pub(super) latency: Mutex<LatencyModel>,
    /// The LoRA adapters routed here lately (see `kvroute_core::lora`).
    pub(super) recent_adapters: Mutex<RecentAdapters<String>>,
    /// Its load summary and speed factors, for reads without its locks.
    pub(super) published: super::published::Published,
    /// With sampling on, where its requests' first blocks are told.
    pub(super) firsts: Option<Arc<super::ActiveFirsts>>,
}

impl Rank {
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Reads the rank's load accounting under its lock (no copy: the block map can be large).
    pub fn with_load<R>(&self, f: impl FnOnce(&RankLoad) -> R) -> R {
        f(&lock(&self.load))
    }

    fn update(&self, f: impl FnOnce(&mut RankLoad)) {
        let mut load = lock(&self.load);
        f(&mut load);
        self.series.prefill_tokens.set(load.prefill_tokens() as i64);
        self.series.decode_blocks.set(load.decode_blocks() as i64);
        self.published.store_load(&load.summary());
    }

    /// Its load summary as last published (no lock; see `workers/published.rs`).
    pub fn load_summary(&self) -> LoadSummary {
        self.published.load()
    }

    /// Its speed factors as last published (no lock; all that `KvAware::decides_on_load`
    /// costs read of a speed).
    pub fn published_factors(&self) -> SpeedFactors {
        self.published.factors()
    }

    /// Whether `thresholds` call this rank overloaded now (updates the decode latch).
    pub fn overloaded(
        &self,
        thresholds: &BusyThresholds,
        max_num_batched_tokens: Option<u64>,
        now: std::time::Instant,
    ) -> bool {
        if *thresholds == BusyThresholds::default() {
            return false;
        }
        let (prefill_tokens, decode_blocks) =
            self.with_load(|l| (l.prefill_tokens(), l.decode_blocks()));
        let engine = self.engine.load(now);
        let pressure = RankPressure {
            prefill_tokens,
            decode_blocks,
            engine_kv_usage: engine.kv_usage,
            num_gpu_blocks: engine.num_gpu_blocks,
            max_num_batched_tokens,
        };
        let mut latch = self.busy_latch.load(Ordering::Relaxed);
        let overloaded = thresholds.overloaded(&pressure, &mut latch);
        self.busy_latch.store(latch, Ordering::Relaxed);
        overloaded
    }

    /// Where `adapter` stands on this rank: from its engine's `vllm:lora_requests_info` (as
    /// of `now`) and the adapters routed here lately; `None` when the engine reports none.
    pub fn adapter_fit(&self, adapter: &str, now: std::time::Instant) -> AdapterFit {
        let Some(lora) = self.engine.lora(now) else {
            return AdapterFit::None;
        };
        let recent = lock(&self.recent_adapters).contains(&adapter.to_owned());
        let owned = adapter.to_owned();
        AdapterFit::of(&owned, &lora.running, &lora.waiting, lora.max_lora, recent)
    }

    /// A request of `adapter` was routed here.
    pub fn adapter_routed(&self, adapter: &str, now: std::time::Instant) {
        let slots = self.engine.lora(now).map_or(1, |l| l.max_lora);
        lock(&self.recent_adapters).routed(adapter.to_owned(), slots);
    }

    pub(crate) fn start(&self, load: &RequestLoad) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.update(|l| l.start(load));
        if let (Some(firsts), Some(&first)) = (&self.firsts, load.blocks.first()) {
            firsts.started(first, self.replica);
        }
    }

    pub(crate) fn first_token(&self, load: &RequestLoad) {
        self.update(|l| l.first_token(load));
    }

    /// `tokens` more were generated by `load` (tracked): its output blocks, when it needs more.
    pub(crate) fn output_tokens(&self, load: &mut RequestLoad, tokens: u64) {
        if let Some(step) = load.output.as_mut().and_then(|o| o.advance(tokens)) {
            self.update(|l| l.output_step(load, &step));
        }
    }

    /// The rank's fitted latency models (the prior until its streams have fed them).
    pub fn speed(&self) -> FittedSpeed {
        lock(&self.latency).speed()
    }

    /// One of its streams: the first token after `ttft_ms` (routed with `features`), or a
    /// gap of `gap_ms` between two tokens, or the end after `tokens` tokens.
    pub(crate) fn observe(&self, sample: LatencySample) {
        let mut m = lock(&self.latency);
        match sample {
            LatencySample::Ttft { features, ms } => m.observe_ttft(&features, ms),
            LatencySample::Gap { features, ms } => m.observe_gap(&features, ms),
            LatencySample::Output { tokens } => m.observe_output(tokens),
        }
        self.published.store_speed(&m.speed());
    }

    pub(crate) fn finish(&self, load: &RequestLoad, prefilling: bool) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.update(|l| l.finish(load, prefilling));
        if let (Some(firsts), Some(&first)) = (&self.firsts, load.blocks.first()) {
            firsts.finished(first, self.replica);
        }
    }
}

/// A timing observed on a rank's stream (see [`Rank::observe`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum LatencySample {
    Ttft { features: PrefillFeatures, ms: f64 },
    Gap { features: DecodeFeatures, ms: f64 },
    Output { tokens: f64 },
}

/// One engine replica.
#[derive(Debug)]
pub struct Worker {
    pub id: WorkerId,
    /// Base URL, without a trailing slash.
    pub url: String,
    /// Its data-parallel ranks (one entry, rank `None`, when it has none).
    pub ranks: Vec<Rank>,
    /// Labels requests can require or prefer.
    pub taints: Vec<String>,
    /// The engine's max_num_batched_tokens, when configured.
    pub max_num_batched_tokens: Option<u64>,
    /// Its part in prefill/decode disaggregation.
    pub role: WorkerRole,
    /// Its bootstrap port (SGLang's disaggregation), when a prefill worker has one.
    pub bootstrap_port: Option<u16>,
    /// Its KV-event publisher and replay socket, if configured.
    pub kv_events: Option<String>,
    pub kv_events_replay: Option<String>,
    pub(super) configured_model: Option<ModelId>,
    /// The (validated) spec it was built from, which a config reload compares.
    pub(crate) spec: WorkerSpec,
    /// The `/v1/models` entries it serves, once probed.
    pub(super) models: Mutex<Vec<(ModelId, serde_json::Value)>>,
    /// The largest `max_model_len` its `/v1/models` entries give (vLLM's, kvroute-sim's);
    /// 0 while unknown. Kept as the entries change.
    pub(super) context: AtomicU64,
    pub(super) probed: AtomicBool,
    /// Why its last probe or health check failed, until one passes (`GET /workers`).
    pub(super) last_error: Mutex<Option<String>>,
    /// Passes its health checks (sends on change: the KV-event subscription follows it).
    pub(super) healthy: watch::Sender<bool>,
    /// The same, for readers on the request path (the watch's read takes a lock).
    pub(super) healthy_now: AtomicBool,
    pub(super) in_flight: AtomicU64,
    pub(crate) series: WorkerSeries,
    /// Opened by failed requests.
    pub circuit: Circuit,
    /// Cancelled when the worker is removed: stops its health checks and subscriptions.
    pub tasks: CancellationToken,
}

impl Worker {
    /// The scraper of its engine's `/metrics`, feeding its ranks' gauges.
    pub fn metrics_scraper(
        &self,
        timing: crate::engine_metrics::ScrapeTiming,
    ) -> Result<crate::engine_metrics::EngineMetricsScraper, crate::engine_metrics::ScrapeError>
    {
        let ranks = self
            .ranks
            .iter()
            .map(|r| (r.dp_rank, r.engine.clone()))
            .collect();
        crate::engine_metrics::EngineMetricsScraper::new(
            self.id.to_string(),
            &self.url,
            ranks,
            timing,
        )
    }

    /// Where to subscribe to its KV events, when it publishes them.
    pub fn kv_subscriber_config(
        &self,
        router_block_size: usize,
    ) -> Option<crate::kv_events::SubscriberConfig> {
        Some(crate::kv_events::SubscriberConfig {
            worker: self.id.to_string(),
            endpoint: self.kv_events.clone()?,
            replay_endpoint: self.kv_events_replay.clone(),
            dp_start_rank: self.ranks[0].dp_rank.unwrap_or(0),
            dp_size: self.ranks.len() as u32,
            router_block_size,
        })
    }

    /// Its rank `dp_rank`.
    pub fn rank(&self, dp_rank: Option<u32>) -> Option<&Rank> {
        self.ranks.iter().find(|r| r.dp_rank == dp_rank)
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy_now.load(Ordering::Relaxed)
    }

    /// Why its last probe or health check failed; `None` once one passed.
    pub fn last_error(&self) -> Option<String> {
        lock(&self.last_error).clone()
    }

    pub(super) fn set_last_error(&self, error: Option<String>) {
        *lock(&self.last_error) = error;
    }

    /// Changes of its health (the current value first).
    pub fn subscribe_health(&self) -> watch::Receiver<bool> {
        self.healthy.subscribe()
    }

    pub(super) fn set_health(&self, healthy: bool) {
        self.series.healthy.set(i64::from(healthy));
        self.healthy_now.store(healthy, Ordering::Relaxed);
        if self.healthy.send_replace(healthy) != healthy && healthy {
            self.circuit.reset();
        }
    }

    /// Whether it may take a request now: healthy, and its circuit lets one through.
    pub fn available(&self, now: std::time::Instant) -> bool {
        self.is_healthy() && self.circuit.allows(now)
    }

    pub(crate) fn begin_request(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.series.active.inc();
    }

    pub(crate) fn end_request(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.series.active.dec();
    }

    /// Takes `models` as what it lists now (its `/v1/models`); returns the models (adapters
    /// included) it added and dropped, both empty when the ids and parents are unchanged (the
    /// cards' other fields, such as `created`, may change at every read), and whether the
    /// longest context they give changed (pools keep their shortest: a change rebuilds them).
    pub(super) fn replace_models(
        &self,
        models: Vec<(ModelId, serde_json::Value)>,
    ) -> (Vec<ModelId>, Vec<ModelId>, bool) {
        let key = |(m, card): &(ModelId, serde_json::Value)| (m.clone(), card["parent"].clone());
        let mut current = lock(&self.models);
        let before: Vec<_> = current.iter().map(key).collect();
        let after: Vec<_> = models.iter().map(key).collect();
        let added = after.iter().filter(|k| !before.contains(k));
        let dropped = before.iter().filter(|k| !after.contains(k));
        let (added, dropped) = (
            added.map(|k| k.0.clone()).collect(),
            dropped.map(|k| k.0.clone()).collect(),
        );
        let context = context_of(&models);
        let context_changed = self.context.swap(context, Ordering::Relaxed) != context;
        *current = models;
        (added, dropped, context_changed)
    }

    /// The longest context (prompt plus answer, in tokens) its engine takes: its config's
    /// `max_model_len`, else the largest of its `/v1/models` entries; `None` while unknown
    /// (a configured model without it, not yet probed, or an engine that does not say).
    pub fn max_model_len(&self) -> Option<u64> {
        let listed = Some(self.context.load(Ordering::Relaxed)).filter(|&n| n > 0);
        self.spec.max_model_len.or(listed)
    }

    /// Whether `model` is a LoRA adapter here: its `/v1/models` entry names a `parent`.
    pub fn serves_adapter(&self, model: &str) -> bool {
        lock(&self.models)
            .iter()
            .any(|(m, card)| m.as_str() == model && card["parent"].is_string())
    }

    /// The models it serves: its configured one, else those it listed when last read.
    pub fn model_ids(&self) -> Vec<ModelId> {
        match &self.configured_model {
            Some(m) => vec![m.clone()],
            None => lock(&self.models).iter().map(|(m, _)| m.clone()).collect(),
        }
    }
}

/// The largest `max_model_len` of `/v1/models` entries, 0 when none gives one.
fn context_of(models: &[(ModelId, serde_json::Value)]) -> u64 {
    let lens = models
        .iter()
        .filter_map(|(_, card)| card["max_model_len"].as_u64());
    lens.max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::config::Settings;
    use crate::metrics::GatewayMetrics;
    use crate::workers::WorkerSet;

    #[test]
    fn a_new_list_reports_the_models_added_and_dropped_not_fresh_cards() {
        let settings = Settings::with_workers(vec![WorkerSpec::url("http://w:1")]).unwrap();
        let metrics = GatewayMetrics::register(&mut Default::default());
        let set = WorkerSet::new(&settings, &metrics);
        let w = set.workers()[0].clone();
        let card = |id: &str, parent: Option<&str>, created: u64| {
            let c = json!({"id": id, "parent": parent, "created": created});
            (ModelId::new(id), c)
        };
        let ids = |v: Vec<ModelId>| v.iter().map(|m| m.to_string()).collect::<Vec<_>>();
        let (added, dropped, _) = w.replace_models(vec![card("base", None, 1)]);
        assert_eq!(
            (ids(added), ids(dropped)),
            (vec!["base".to_owned()], vec![])
        );
        // vLLM stamps `created` at every read: not a change.
        let (added, dropped, context) = w.replace_models(vec![card("base", None, 2)]);
        assert!(added.is_empty() && dropped.is_empty() && !context);
        let (added, _, _) =
            w.replace_models(vec![card("base", None, 3), card("sql", Some("base"), 3)]);
        assert_eq!(ids(added), ["sql"]);
        assert!(w.serves_adapter("sql"));
        let (added, dropped, _) = w.replace_models(vec![card("base", None, 4)]);
        assert_eq!((ids(added), ids(dropped)), (vec![], vec!["sql".to_owned()]));
        assert!(!w.serves_adapter("sql"));
        assert_eq!(ids(w.model_ids()), ["base"]);
        // A context length that changes is reported apart from the models.
        assert_eq!(w.max_model_len(), None);
        let sized = |len: u64| {
            let c = json!({"id": "base", "parent": null, "max_model_len": len});
            (ModelId::new("base"), c)
        };
        assert_eq!(w.replace_models(vec![sized(4096)]), (vec![], vec![], true));
        assert_eq!(w.max_model_len(), Some(4096));
        assert_eq!(w.replace_models(vec![sized(4096)]), (vec![], vec![], false));
        let (added, _, context) = w.replace_models(vec![sized(8192), card("sql", Some("base"), 5)]);
        assert_eq!((ids(added), context), (vec!["sql".to_owned()], true));
        assert_eq!(w.max_model_len(), Some(8192));
        assert!(w.replace_models(vec![card("base", None, 6)]).2);
        assert_eq!(w.max_model_len(), None);
        // The config's value wins over what the engine lists.
        let spec = WorkerSpec {
            max_model_len: Some(2048),
            ..WorkerSpec::url("http://w:2")
        };
        let settings = Settings::with_workers(vec![spec]).unwrap();
        let w = WorkerSet::new(&settings, &metrics).workers()[0].clone();
        assert_eq!(w.max_model_len(), Some(2048));
        w.replace_models(vec![sized(8192)]);
        assert_eq!(w.max_model_len(), Some(2048));
    }
}
