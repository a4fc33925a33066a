//! The requests, assertions and waits the tests repeat: a completion through a router, a
//! request held open on a worker, "these all went to `w`", "this is error `code`", and waits
//! on the router's view of its workers and on its metrics.

use std::collections::HashMap;

use axum::body::Bytes;
use http::{HeaderMap, StatusCode};
use serde_json::json;
use tokio::task::JoinHandle;

use super::{
    get_url, metric_value, post, wait_all_idle, wait_until, wait_until_async, Reply, TestRouter,
};

impl TestRouter {
    /// `POST {path}` on the router.
    pub async fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
        post(&self.url, path, headers, body).await
    }

    /// Waits until nothing is in flight anywhere in the router ([`wait_all_idle`]), then
    /// stops it.
    pub async fn stop_idle(self) {
        wait_all_idle(&self).await;
        self.stop().await;
    }

    /// `POST /v1/completions` on the router.
    pub async fn complete(&self, headers: &[(&str, &str)], body: &str) -> Reply {
        self.post("/v1/completions", headers, body).await
    }

    /// `GET {path}` on the router.
    pub async fn get(&self, path: &str) -> (StatusCode, HeaderMap, Bytes) {
        get_url(&format!("{}{path}", self.url)).await
    }

    /// `GET {path}` on the router, which must answer 200 with JSON: the JSON.
    pub async fn get_json(&self, path: &str) -> serde_json::Value {
        let (status, _, body) = self.get(path).await;
        assert_eq!(status, StatusCode::OK, "{path}: {body:?}");
        serde_json::from_slice(&body).unwrap()
    }

    /// The model ids the router's `GET /v1/models` lists, sorted.
    pub async fn model_ids(&self) -> Vec<String> {
        let v = self.get_json("/v1/models").await;
        let mut ids: Vec<String> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    }

    /// `POST /v1/completions` in a task of its own (for requests that never answer, held
    /// until the handle is aborted).
    pub fn spawn_complete(&self, headers: &[(&str, &str)], body: String) -> JoinHandle<Reply> {
        let url = self.url.clone();
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        tokio::spawn(async move {
            let headers: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            post(&url, "/v1/completions", &headers, &body).await
        })
    }

    /// Sends each of `bodies` to `/v1/completions` with `headers` and asserts that the router
    /// placed every one on `worker`.
    pub async fn assert_routed(
        &self,
        headers: &[(&str, &str)],
        bodies: impl IntoIterator<Item = String>,
        worker: &str,
    ) {
        for body in bodies {
            let reply = self.complete(headers, &body).await;
            assert_eq!(reply.worker(), worker, "{headers:?} {body}");
        }
    }

    /// Posts each of `bodies` to `path`: how many went to each worker (each must be answered
    /// 200).
    pub async fn tally_routes(
        &self,
        path: &str,
        bodies: impl IntoIterator<Item = String>,
    ) -> HashMap<String, usize> {
        let mut workers = Vec::new();
        for body in bodies {
            let reply = self.post(path, &[], &body).await;
            assert_eq!(reply.status, StatusCode::OK, "{body}: {:?}", reply.body);
            workers.push(reply.worker().to_owned());
        }
        tally(workers)
    }

    /// Waits until the router counts, on worker `id`, a number of requests in flight that
    /// satisfies `cond`.
    pub async fn wait_in_flight(&self, id: &str, cond: impl Fn(u64) -> bool) {
        let gw = self.gateway.clone();
        wait_until(&format!("{id}'s requests in flight"), || {
            gw.workers()
                .statuses()
                .iter()
                .any(|w| w.id == id && cond(w.in_flight))
        })
        .await;
    }

    /// Waits until the router counts no request in flight on any worker.
    pub async fn wait_none_in_flight(&self) {
        let gw = self.gateway.clone();
        wait_until("no request in flight", || {
            gw.workers().statuses().iter().all(|w| w.in_flight == 0)
        })
        .await;
    }

    /// Waits until the router has worker `id`, healthy.
    pub async fn wait_healthy(&self, id: &str) {
        let gw = self.gateway.clone();
        wait_until(&format!("{id} healthy"), || {
            gw.workers()
                .statuses()
                .iter()
                .any(|w| w.id == id && w.healthy)
        })
        .await;
    }

    /// Worker `id`'s circuit breaker as the router shows it: closed, open or half_open.
    pub fn circuit(&self, id: &str) -> &'static str {
        let statuses = self.gateway.workers().statuses();
        statuses.into_iter().find(|w| w.id == id).unwrap().circuit
    }

    /// Whether the router counts worker `id` healthy.
    pub fn is_healthy(&self, id: &str) -> bool {
        let statuses = self.gateway.workers().statuses();
        statuses.into_iter().find(|w| w.id == id).unwrap().healthy
    }

    /// Waits until the router's metric `name{labels}` reads `value` (`None`: no such line).
    pub async fn wait_metric(&self, name: &str, labels: &str, value: Option<f64>) {
        let what = format!("{name}{{{labels}}} to read {value:?}");
        wait_until_async(&what, || async {
            metric_value(&self.metrics().await, name, labels) == value
        })
        .await;
    }
}

impl Reply {
    /// Asserts that this is the router's error `code` with `status`.
    #[track_caller]
    pub fn assert_error(&self, status: u16, code: &str) {
        let json: serde_json::Value = serde_json::from_slice(&self.body).unwrap_or_default();
        assert_eq!(
            (self.status.as_u16(), json["error"]["code"].as_str()),
            (status, Some(code)),
            "{}",
            String::from_utf8_lossy(&self.body)
        );
    }
}

/// A completion body for the mock workers that never answers (its `"hang"`), with `prompt`
/// as the prompt the router counts.
pub fn hanging(prompt: &str) -> String {
    json!({"model": "m", "prompt": prompt, "mode": "hang"}).to_string()
}

/// How many times each worker appears in `workers`.
pub fn tally<S: AsRef<str>>(workers: impl IntoIterator<Item = S>) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for w in workers {
        *counts.entry(w.as_ref().to_owned()).or_insert(0) += 1;
    }
    counts
}

/// Asserts that `counts` (requests a worker) split as `shares`, in whichever order.
#[track_caller]
pub fn assert_spread(counts: &HashMap<String, usize>, shares: &[usize]) {
    let mut got: Vec<usize> = counts.values().copied().collect();
    got.sort();
    let mut want = shares.to_vec();
    want.sort();
    assert_eq!(got, want, "{counts:?}");
}
