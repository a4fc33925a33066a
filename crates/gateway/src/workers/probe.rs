//! Watching a worker: the first probe (its models), then health checks.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_protocol::ModelId;

use super::{lock, Worker, WorkerSet, PROBE_RETRY_MAX, PROBE_RETRY_MIN};
use crate::health::{jittered, HealthCounter};
use crate::http::HttpClient;
use http::HeaderValue;

impl WorkerSet {
    /// Watches one worker until it is removed or the gateway shuts down (its tasks token):
    /// probes it until it answers once (with backoff), then checks its health every
    /// interval.
    pub async fn watch(self: Arc<Self>, worker: Arc<Worker>, client: HttpClient) {
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
            match probe(&client, &worker, None, key, timeout).await {
                Ok(models) => {
                    tracing::info!(worker = %worker.id, models = ?models.iter().map(|m| m.0.as_str()).collect::<Vec<_>>(), "Worker ready");
                    if worker.configured_model.is_none() {
                        *lock(&worker.models) = models;
                    }
                    worker.probed.store(true, Ordering::Relaxed);
                    worker.set_health(true);
                    self.rebuild();
                    break;
                }
                Err(error) => {
                    tracing::warn!(worker = %worker.id, %error, retry_in = ?delay, "Worker probe failed");
                    worker.probed.store(true, Ordering::Relaxed);
                    self.rebuild();
                }
            }
            if !sleep(delay).await {
                return;
            }
            delay = (delay * 2).min(PROBE_RETRY_MAX);
        }
        let mut counter =
            HealthCounter::new(self.health.failure_threshold, self.health.success_threshold);
        let endpoint = self.health.endpoint.as_str();
        loop {
            if !sleep(jittered(self.health.interval, 0.1)).await {
                return;
            }
            let result = probe(&client, &worker, Some(endpoint), key, timeout).await;
            if let Err(error) = &result {
                tracing::debug!(worker = %worker.id, %error, "Health check failed");
            }
            if let Some(healthy) = counter.observe(worker.is_healthy(), result.is_ok()) {
                if healthy {
                    tracing::info!(worker = %worker.id, "Worker healthy again");
                } else {
                    tracing::warn!(worker = %worker.id, failures = self.health.failure_threshold, "Worker unhealthy: no longer a candidate");
                }
                worker.set_health(healthy);
                self.rebuild();
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum ProbeError {
    #[error("request failed: {0}")]
    Http(#[from] hyper_util::client::legacy::Error),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("answered HTTP {0}")]
    Status(http::StatusCode),
    #[error("cannot read the answer: {0}")]
    Body(#[from] hyper::Error),
    #[error("invalid /v1/models answer: {0}")]
    Models(&'static str),
}

/// One probe of `path`, or of the discovery path (`/v1/models` when the worker's model is
/// not configured, else `/health`): the worker's models when it was `/v1/models`.
async fn probe(
    client: &HttpClient,
    worker: &Worker,
    path: Option<&str>,
    auth: Option<&HeaderValue>,
    timeout: Duration,
) -> Result<Vec<(ModelId, serde_json::Value)>, ProbeError> {
    let models = path.is_none() && worker.configured_model.is_none();
    let path = path.unwrap_or(if models { "/v1/models" } else { "/health" });
    let mut req = http::Request::get(format!("{}{}", worker.url, path));
    if let Some(auth) = auth {
        req = req.header(http::header::AUTHORIZATION, auth);
    }
    let req = req
        .body(Full::new(Bytes::new()))
        .map_err(|_| ProbeError::Models("bad url"))?;
    let resp = tokio::time::timeout(timeout, client.request(req))
        .await
        .map_err(|_| ProbeError::Timeout(timeout))??;
    if !resp.status().is_success() {
        return Err(ProbeError::Status(resp.status()));
    }
    let body = tokio::time::timeout(timeout, resp.into_body().collect())
        .await
        .map_err(|_| ProbeError::Timeout(timeout))??
        .to_bytes();
    if !models {
        return Ok(Vec::new());
    }
    parse_models(&body)
}

fn parse_models(body: &[u8]) -> Result<Vec<(ModelId, serde_json::Value)>, ProbeError> {
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<serde_json::Value>,
    }
    let list: List = serde_json::from_slice(body)
        .map_err(|_| ProbeError::Models("expected {\"data\": [...]}"))?;
    let models: Vec<_> = list
        .data
        .into_iter()
        .filter_map(|card| {
            let id = card.get("id")?.as_str()?.to_owned();
            Some((ModelId::new(id), card))
        })
        .collect();
    if models.is_empty() {
        return Err(ProbeError::Models("the worker lists no model"));
    }
    Ok(models)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_list_is_parsed_and_empty_lists_rejected() {
        let m = parse_models(
            br#"{"object":"list","data":[{"id":"a","parent":null},{"id":"lora1","parent":"a"}]}"#,
        )
        .unwrap();
        assert_eq!(
            m.iter().map(|x| x.0.as_str()).collect::<Vec<_>>(),
            ["a", "lora1"]
        );
        assert_eq!(m[1].1["parent"], "a");
        assert!(parse_models(br#"{"data":[]}"#).is_err());
        assert!(parse_models(b"not json").is_err());
    }
}
