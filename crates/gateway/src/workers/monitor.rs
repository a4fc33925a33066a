//! Watching a worker: probed at once and until it answers once (its models), then
//! health-checked every interval from a phase of its own ([`crate::health::phase`], so a
//! thousand workers added together are not checked in one burst); each answer changes the
//! worker set.
//!
//! A worker whose models are read from it (no configured model) has its `GET /v1/models`
//! re-read after each health check that passes, so the models and LoRA adapters it lists
//! follow what the engine serves (vLLM loads and unloads adapters at run time with
//! `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`): one more GET per worker and
//! interval. A re-read that fails or is malformed keeps the last good list, is logged and
//! counted (`kvroute_worker_model_list_failures_total`), and changes neither the worker's
//! health nor its models: the health checks judge the worker, and a garbled answer must not
//! take every model off it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;

use super::{Worker, WorkerSet, PROBE_RETRY_MAX, PROBE_RETRY_MIN};
use crate::health::{jittered, probe, random_phase, HealthCounter};
use crate::http::HttpClient;

/// Why watching a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Watched {
    /// It was removed, or the gateway is shutting down.
    Stopped,
    /// It turned unhealthy and `remove_unhealthy` is on: the caller removes it.
    Unhealthy,
    /// It did not answer a probe within `startup_timeout`: the caller removes it.
    NeverStarted,
}

impl WorkerSet {
    /// Watches one worker until it is removed or the gateway shuts down (its tasks token):
    /// probes it until it answers once (with backoff), then checks its health every
    /// interval. Ends early, for the caller to remove the worker, when it does not start in
    /// time or turns unhealthy under `remove_unhealthy`.
    pub async fn watch(self: Arc<Self>, worker: Arc<Worker>, client: HttpClient) -> Watched {
        let added = tokio::time::Instant::now();
        let stop = worker.tasks.clone();
        let sleep = |d: Duration| {
            let stop = stop.clone();
            async move {
                tokio::select! {
                    _ = stop.cancelled() => false,
                    _ = tokio::time::sleep(d) => true,
                }
            }
        };
        let key = self.api_key.as_ref();
        let timeout = self.health.timeout;
        let mut delay = PROBE_RETRY_MIN;
        loop {
            // The first probe reads the models of a worker whose model is not configured.
            let lists = worker.configured_model.is_none();
            let path = if lists { "/v1/models" } else { "/health" };
            match probe(&client, &worker.url, path, lists, key, timeout).await {
                Ok(models) => {
                    tracing::info!(worker = %worker.id, models = ?models.iter().map(|m| m.0.as_str()).collect::<Vec<_>>(), "Worker ready");
                    if worker.configured_model.is_none() {
                        worker.replace_models(models);
                    }
                    worker.probed.store(true, Ordering::Relaxed);
                    worker.set_last_error(None);
                    worker.set_health(true);
                    self.rebuild();
                    break;
                }
                Err(error) => {
                    tracing::warn!(worker = %worker.id, %error, retry_in = ?delay, "Worker probe failed");
                    worker.set_last_error(Some(error.to_string()));
                    worker.probed.store(true, Ordering::Relaxed);
                    self.rebuild();
                }
            }
            if let Some(limit) = self.health.startup_timeout {
                if added.elapsed() >= limit {
                    tracing::warn!(worker = %worker.id, waited = ?limit, "Worker did not start in time: removing it");
                    return Watched::NeverStarted;
                }
                delay = delay.min(limit.saturating_sub(added.elapsed()));
            }
            if !sleep(delay).await {
                return Watched::Stopped;
            }
            delay = (delay * 2).min(PROBE_RETRY_MAX);
        }
        let mut counter =
            HealthCounter::new(self.health.failure_threshold, self.health.success_threshold);
        let endpoint = self.health.endpoint.as_str();
        // The first check after readiness at this worker's phase of the interval, so the
        // checks of workers added together spread over it; then every interval (jittered).
        let mut wait = random_phase(self.health.interval);
        loop {
            if !sleep(std::mem::replace(
                &mut wait,
                jittered(self.health.interval, 0.1),
            ))
            .await
            {
                return Watched::Stopped;
            }
            let result = probe(&client, &worker.url, endpoint, false, key, timeout).await;
            match &result {
                Ok(_) => worker.set_last_error(None),
                Err(error) => {
                    tracing::debug!(worker = %worker.id, %error, "Health check failed");
                    worker.set_last_error(Some(error.to_string()));
                }
            }
            if let Some(healthy) = counter.observe(worker.is_healthy(), result.is_ok()) {
                if healthy {
                    tracing::info!(worker = %worker.id, "Worker healthy again");
                } else {
                    let error = worker.last_error().unwrap_or_default();
                    tracing::warn!(worker = %worker.id, failures = self.health.failure_threshold, %error, "Worker unhealthy: no longer a candidate");
                }
                worker.set_health(healthy);
                self.rebuild();
                if !healthy && self.health.remove_unhealthy {
                    return Watched::Unhealthy;
                }
            }
            if result.is_ok() && worker.configured_model.is_none() {
                self.reread_models(&worker, &client, key, timeout).await;
            }
        }
    }

    /// Re-reads the models `worker` lists (see the module docs): the table is rebuilt when
    /// they changed; a failed or malformed answer keeps the last good list.
    async fn reread_models(
        &self,
        worker: &Worker,
        client: &HttpClient,
        key: Option<&HeaderValue>,
        timeout: Duration,
    ) {
        match probe(client, &worker.url, "/v1/models", true, key, timeout).await {
            Ok(models) => {
                let (added, dropped, context) = worker.replace_models(models);
                if !(added.is_empty() && dropped.is_empty()) {
                    tracing::info!(worker = %worker.id, ?added, ?dropped, "Worker models changed");
                }
                if context {
                    let max_model_len = worker.max_model_len();
                    tracing::info!(worker = %worker.id, ?max_model_len, "Worker context changed");
                }
                if context || !(added.is_empty() && dropped.is_empty()) {
                    self.rebuild();
                }
            }
            Err(error) => {
                worker.series.model_list_failures.inc();
                tracing::warn!(worker = %worker.id, %error, "Worker models re-read failed: keeping its last list");
            }
        }
    }
}
