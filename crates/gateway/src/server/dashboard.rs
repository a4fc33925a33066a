//! The live dashboard, on the metrics port: `GET /dashboard` is one page embedded in the
//! binary (no CDN, no build step), which polls `GET /dashboard/state` once a second.
//!
//! The feed is the router's own state, read when asked: each worker and rank's load, health,
//! circuit, engine readings and the blocks the index holds per tier; the policy as the flag
//! spells it; the last decisions with every candidate's terms ([`crate::recent`]); each
//! tenant's requests and tokens and its share of them (`kvroute_tenant_*`). Rates and
//! quantiles over the last minute, and the charts' history, come from a sampler that reads
//! the registry's counters once a second into a five-minute ring. With an admin key set the
//! feed needs it (`Authorization: Bearer`), as the other admin reads do; the page asks for it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use prometheus_client::registry::Registry;
use serde_json::{json, Value};

use super::admin::check_admin;
use crate::context::AppState;

const PAGE: &str = include_str!("dashboard.html");
/// Samples kept: five minutes at one a second.
const KEEP: usize = 301;
/// The window rates and quantiles are taken over.
const WINDOW: Duration = Duration::from_secs(60);

/// One second's cumulative readings of the series the dashboard derives from.
#[derive(Debug, Default, Clone)]
struct Sample {
    at: Option<Instant>,
    requests: f64,
    errors: f64,
    retries: f64,
    /// TTFT histogram: (upper bound, cumulative count).
    ttft: Vec<(f64, f64)>,
    hit: (f64, f64),
    /// Per worker: (requests sent, in flight, prompt tokens, cached tokens).
    workers: BTreeMap<String, [f64; 4]>,
    queue: BTreeMap<String, f64>,
    pd: BTreeMap<String, f64>,
    sync: [f64; 3],
    /// Per tenant label: (requests answered, prompt tokens, completion tokens).
    tenants: BTreeMap<String, [f64; 3]>,
}

/// The value of label `name` in a series' label text.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let at = labels.find(&format!("{name}=\""))? + name.len() + 2;
    labels[at..].split('"').next()
}

impl Sample {
    /// Reads the registry's text encoding (what `/metrics` serves).
    fn read(registry: &Registry) -> Self {
        let mut text = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut text, registry);
        let mut s = Sample {
            at: Some(Instant::now()),
            ..Sample::default()
        };
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(v) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            let worker = || label(labels, "worker").unwrap_or("").to_owned();
            match name {
                "kvroute_requests_total" => {
                    s.requests += v;
                    if label(labels, "status").is_some_and(|c| c.starts_with('5')) {
                        s.errors += v;
                    }
                }
                "kvroute_request_retries_total" => s.retries += v,
                "kvroute_time_to_first_token_seconds_bucket" => {
                    let le = label(labels, "le").and_then(|l| l.parse().ok());
                    s.ttft.push((le.unwrap_or(f64::INFINITY), v));
                }
                "kvroute_kv_hit_ratio_sum" => s.hit.0 += v,
                "kvroute_kv_hit_ratio_count" => s.hit.1 += v,
                "kvroute_processed_requests_total" => {
                    s.workers.entry(worker()).or_default()[0] += v
                }
                "kvroute_worker_requests_active" => s.workers.entry(worker()).or_default()[1] += v,
                "kvroute_worker_prompt_tokens_total" => {
                    s.workers.entry(worker()).or_default()[2] += v
                }
                "kvroute_worker_cached_tokens_total" => {
                    s.workers.entry(worker()).or_default()[3] += v
                }
                "kvroute_queue_pending" => {
                    let class = label(labels, "class").unwrap_or("default").to_owned();
                    s.queue.insert(class, v);
                }
                "kvroute_disagg_decision_total" => {
                    let kind = label(labels, "decision_type").unwrap_or("").to_owned();
                    s.pd.insert(kind, v);
                }
                "kvroute_tenant_requests_total" => s.tenant(labels)[0] += v,
                "kvroute_tenant_tokens_total" => match label(labels, "kind") {
                    Some("prompt") => s.tenant(labels)[1] += v,
                    Some("completion") => s.tenant(labels)[2] += v,
                    _ => {}
                },
                "kvroute_replica_peers" => s.sync[0] = v,
                "kvroute_replica_sync_lag_seconds" => s.sync[1] = v,
                "kvroute_replica_sync_connected" => s.sync[2] = v,
                _ => {}
            }
        }
        s
    }
}

impl Sample {
    fn tenant(&mut self, labels: &str) -> &mut [f64; 3] {
        let tenant = label(labels, "tenant").unwrap_or("").to_owned();
        self.tenants.entry(tenant).or_default()
    }
}

/// Each tenant's requests and tokens since the start with its share of all tenants', and
/// its requests per second over the window; the busiest first.
fn tenants(now: &Sample, old: &Sample, dt: f64) -> Vec<Value> {
    let total = |i: usize| now.tenants.values().map(|t| t[i]).sum::<f64>();
    let (requests, tokens) = (total(0), total(1) + total(2));
    let share = |n: f64, all: f64| (all > 0.0).then(|| n / all);
    let mut rows: Vec<(f64, Value)> = now
        .tenants
        .iter()
        .map(|(tenant, n)| {
            let o = old.tenants.get(tenant).copied().unwrap_or_default();
            let rate = if dt > 0.0 {
                (n[0] - o[0]).max(0.0) / dt
            } else {
                0.0
            };
            let row = json!({
                "tenant": tenant,
                "requests": n[0],
                "request_share": share(n[0], requests),
                "tokens": n[1] + n[2],
                "token_share": share(n[1] + n[2], tokens),
                "requests_per_s": rate,
            });
            (n[0], row)
        })
        .collect();
    rows.sort_by(|a, b| b.0.total_cmp(&a.0));
    rows.into_iter().map(|(_, row)| row).collect()
}

/// The `q` quantile of the observations between two cumulative histograms, interpolated
/// within its bucket as Prometheus' `histogram_quantile` does; `None` without observations.
fn quantile(new: &[(f64, f64)], old: &[(f64, f64)], q: f64) -> Option<f64> {
    let counts: Vec<(f64, f64)> = new
        .iter()
        .map(|&(le, n)| {
            let before = old.iter().find(|(l, _)| *l == le).map_or(0.0, |p| p.1);
            (le, n - before)
        })
        .collect();
    let total = counts.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, n) in &counts {
        if n >= rank {
            if le.is_infinite() {
                return Some(lower.0);
            }
            let share = if n > lower.1 {
                (rank - lower.1) / (n - lower.1)
            } else {
                1.0
            };
            return Some(lower.0 + (le - lower.0) * share);
        }
        lower = (le, n);
    }
    None
}

/// The dashboard's state: the router's, and the sampler's ring.
#[derive(Debug)]
pub(super) struct Dashboard {
    state: Arc<AppState>,
    registry: Arc<Registry>,
    samples: Mutex<VecDeque<Sample>>,
    policy: String,
}

impl Dashboard {
    pub(super) fn new(state: Arc<AppState>, registry: Arc<Registry>, policy: String) -> Arc<Self> {
        Arc::new(Self {
            state,
            registry,
            samples: Mutex::new(VecDeque::with_capacity(KEEP)),
            policy,
        })
    }

    fn samples(&self) -> std::sync::MutexGuard<'_, VecDeque<Sample>> {
        self.samples.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes one sample now (the sampler calls this once a second).
    pub(super) fn sample(&self) {
        let s = Sample::read(&self.registry);
        let mut samples = self.samples();
        if samples.len() == KEEP {
            samples.pop_front();
        }
        samples.push_back(s);
    }

    /// Samples once a second until shutdown.
    pub(super) fn spawn_sampler(self: &Arc<Self>) {
        let (me, stop) = (self.clone(), self.state.shutdown.clone());
        self.state.tasks.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => me.sample(),
                }
            }
        });
    }

    fn feed(&self) -> Value {
        let now = Sample::read(&self.registry);
        let samples = self.samples();
        let t = now.at.unwrap_or_else(Instant::now);
        let old = samples
            .iter()
            .find(|s| s.at.is_some_and(|a| t.duration_since(a) <= WINDOW))
            .cloned()
            .unwrap_or_default();
        let dt = old.at.map_or(0.0, |a| t.duration_since(a).as_secs_f64());
        let rate = |n: f64, o: f64| if dt > 0.0 { (n - o).max(0.0) / dt } else { 0.0 };
        let ratio = |a: f64, b: f64| (b > 0.0).then(|| a / b);
        let ms = |s: Option<f64>| s.map(|v| (v * 1e4).round() / 10.0);
        let ttft_hist: Vec<Value> = now
            .ttft
            .iter()
            .scan(0.0, |prev, &(le, n)| {
                let before = old.ttft.iter().find(|(l, _)| *l == le).map_or(0.0, |p| p.1);
                let count = n - before;
                let bucket = count - *prev;
                *prev = count;
                Some(json!({"le_ms": if le.is_finite() { Some(le * 1e3) } else { None }, "count": bucket.max(0.0)}))
            })
            .collect();
        let cluster = json!({
            "requests_per_s": rate(now.requests, old.requests),
            "errors_per_s": rate(now.errors, old.errors),
            "retries_per_s": rate(now.retries, old.retries),
            "requests_total": now.requests,
            "hit_ratio": ratio(now.hit.0 - old.hit.0, now.hit.1 - old.hit.1),
            "ttft_p50_ms": ms(quantile(&now.ttft, &old.ttft, 0.5)),
            "ttft_p90_ms": ms(quantile(&now.ttft, &old.ttft, 0.9)),
            "ttft_histogram": ttft_hist,
            "queue": now.queue,
            "pd_decisions": now.pd,
            "sync": {"peers": now.sync[0], "lag_s": now.sync[1], "connected": now.sync[2] > 0.0},
            "window_s": dt,
        });
        let history = history(&samples, &now);
        drop(samples);
        json!({
            "policy": {"name": self.state.settings.policy.name(), "description": self.policy},
            "cluster": cluster,
            "workers": self.workers(&now, &old, dt),
            "tenants": tenants(&now, &old, dt),
            "decisions": self.state.recent.json(self.state.kv.block_size),
            "history": history,
        })
    }

    fn workers(&self, now: &Sample, old: &Sample, dt: f64) -> Vec<Value> {
        let when = Instant::now();
        let statuses = self.state.workers.statuses();
        let workers = self.state.workers.workers();
        statuses
            .into_iter()
            .map(|st| {
                let mut v = serde_json::to_value(&st).unwrap_or_default();
                let (n, o) = (
                    now.workers.get(&st.id).copied().unwrap_or_default(),
                    old.workers.get(&st.id).copied().unwrap_or_default(),
                );
                v["requests_per_s"] = (if dt > 0.0 { (n[0] - o[0]).max(0.0) / dt } else { 0.0 }).into();
                let prompt = n[2] - o[2];
                v["hit_ratio"] = (prompt > 0.0).then(|| (n[3] - o[3]) / prompt).into();
                if let Some(w) = workers.iter().find(|w| w.id.as_str() == st.id) {
                    for (i, rank) in w.ranks.iter().enumerate() {
                        // The worker may have changed between the two reads: skip, never panic.
                        let Some(r) = v["ranks"].get_mut(i) else {
                            continue;
                        };
                        let e = rank.engine.load(when);
                        let b = self.state.kv.replica_blocks(rank.replica);
                        r["engine"] =
                            json!({"kv_usage": e.kv_usage, "waiting": e.waiting, "running": e.running});
                        r["blocks"] = json!({
                            "device": b.device, "host": b.host, "disk": b.disk, "external": b.external,
                        });
                        let sp = rank.speed();
                        r["speed"] = json!({
                            "step_over_reference": sp.decode,
                            "prefill_ms_per_1k_tokens": sp.prefill[1],
                            "prefill_factor": sp.prefill_factor,
                            "decode_factor": sp.decode_factor,
                            "observations": sp.prefill_observations + sp.decode_observations,
                            "adapter_load_ms": sp.adapter_load_ms,
                            "adapter_load_observations": sp.adapter_load_observations,
                        });
                    }
                }
                v
            })
            .collect()
    }
}

/// Per second over the ring: requests per second, in-flight per worker, hit ratio.
fn history(samples: &VecDeque<Sample>, now: &Sample) -> Value {
    let t0 = now.at.unwrap_or_else(Instant::now);
    let mut times = Vec::new();
    let mut rps = Vec::new();
    let mut hit = Vec::new();
    let mut in_flight: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for pair in samples.iter().collect::<Vec<_>>().windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let (Some(ta), Some(tb)) = (a.at, b.at) else {
            continue;
        };
        let dt = tb.duration_since(ta).as_secs_f64().max(1e-3);
        times.push(-(t0.duration_since(tb).as_secs_f64()));
        rps.push((b.requests - a.requests).max(0.0) / dt);
        let n = b.hit.1 - a.hit.1;
        hit.push((n > 0.0).then(|| (b.hit.0 - a.hit.0) / n));
        for id in now.workers.keys() {
            let v = b.workers.get(id).map_or(0.0, |w| w[1]);
            in_flight.entry(id.as_str()).or_default().push(v);
        }
    }
    json!({"t_s": times, "requests_per_s": rps, "hit_ratio": hit, "in_flight": in_flight})
}

/// The dashboard's routes, for the metrics app.
pub(super) fn routes(dashboard: Arc<Dashboard>) -> Router {
    Router::new()
        .route("/dashboard", get(|| async { Html(PAGE) }))
        .route("/dashboard/state", get(feed))
        .with_state(dashboard)
}

async fn feed(State(d): State<Arc<Dashboard>>, req: Request) -> Response {
    if let Err(e) = check_admin(&d.state, &req, false).await {
        return e.into_response();
    }
    let mut response = Json(d.feed()).into_response();
    response.headers_mut().insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-store"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_the_bucket_of_the_windows_observations() {
        let old = [(0.1, 10.0), (0.2, 10.0), (f64::INFINITY, 10.0)];
        let new = [(0.1, 10.0), (0.2, 20.0), (f64::INFINITY, 20.0)];
        // The 10 new observations all fell in (0.1, 0.2]: the median is halfway through it.
        assert!((quantile(&new, &old, 0.5).unwrap() - 0.15).abs() < 1e-9);
        assert_eq!(quantile(&old, &old, 0.5), None);
    }

    #[test]
    fn labels_are_read_by_name() {
        let l = r#"worker="http://127.0.0.1:9",dp_rank="0"}"#;
        assert_eq!(label(l, "worker"), Some("http://127.0.0.1:9"));
        assert_eq!(label(l, "dp_rank"), Some("0"));
        assert_eq!(label(l, "status"), None);
    }
}
