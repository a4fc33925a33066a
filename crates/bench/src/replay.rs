//! Real-time replay: a trace sent at its own pace (scaled) to any OpenAI-compatible endpoint,
//! streaming, with per-request timings.
//!
//! Each hash id becomes a fixed pseudo-random block of `hash_block_size` lowercase letters
//! (one token each through kvroute-sim's fallback tokenizer; fewer through a BPE tokenizer,
//! but equal ids still mean equal prefixes through any tokenizer), cut to the request's
//! input length. Requests are streamed completions with usage, so the engine-reported
//! `cached_tokens` comes back; the worker that served each one is read from
//! `x-kvroute-worker` when the endpoint is kvroute, or from Dynamo's `nvext.worker_id` when
//! the request asked for it (`extra_body`).
//!
//! TTFT is the first chunk that carries a choice, whatever its text; output tokens are the
//! usage's `completion_tokens` where reported, else the chunks counted. A server may send fewer
//! chunks than tokens (Dynamo's frontend withholds a token whose text decodes empty, so a
//! stream of such tokens arrives as one chunk at the end): such requests are counted in
//! `short_streams`, since their TTFT is not the first token's.
//!
//! With tenants ([`crate::tenants`]), each request carries its tenant's key (`tenant-<t>`) in
//! `ReplayConfig::tenant_header` (smg's trusted `x-smg-tenant-id` by default, which kvroute
//! reads with `--trust-tenant-header`), and each tenant's requests and TTFT are reported.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use tokio::sync::Semaphore;

use crate::simulate::{percentiles, Percentiles};
use crate::trace::{prompt_text, TraceRequest};

/// What a replay sends.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// The endpoints' base URLs, without a trailing `/`; several (router replicas behind no
    /// load balancer): each request goes to one, picked by its arrival time. At least one.
    pub urls: Vec<String>,
    pub model: Option<String>,
    /// Fields added to every request's body (a server's extensions, e.g. Dynamo's `nvext`);
    /// they replace the replay's own fields of the same name.
    pub extra_body: serde_json::Map<String, serde_json::Value>,
    pub hash_block: usize,
    pub rate_scale: f64,
    pub max_concurrency: usize,
    /// Stop sending new requests after this long.
    pub duration: Option<Duration>,
    /// Print progress to stderr every second.
    pub progress: bool,
    /// Each request's tenant, by its index in the trace (see [`crate::tenants`]); `None`: no
    /// tenant header, and no per-tenant figures.
    pub tenants: Option<Arc<[u32]>>,
    /// The header that carries a request's tenant key.
    pub tenant_header: String,
}

impl ReplayConfig {
    /// smg's trusted tenant header (kvroute's `--tenant-header-name` default).
    pub const DEFAULT_TENANT_HEADER: &'static str = "x-smg-tenant-id";
}

/// The figures of a replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayResult {
    pub requests: usize,
    pub errors: usize,
    pub ttft_ms: Percentiles,
    /// Every served request's TTFT in milliseconds, ascending (for the plot; not in the JSON).
    #[serde(skip)]
    pub ttft_sorted_ms: Vec<f64>,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub throughput_rps: f64,
    pub output_tokens_per_s: f64,
    /// Engine-reported cached prompt tokens over prompt tokens.
    pub hit_share: f64,
    /// Served requests whose stream carried fewer chunks than the tokens their usage reports:
    /// their TTFT is a later chunk's than the first token's.
    pub short_streams: usize,
    pub requests_per_worker: BTreeMap<String, usize>,
    /// Each tenant's figures, by tenant number, when the requests have tenants.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantTtft>,
}

/// One tenant's figures in a replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TenantTtft {
    /// Its key, as sent in the tenant header.
    pub tenant: String,
    /// Requests sent.
    pub requests: usize,
    /// Of those, the ones that got a first token.
    pub answered: usize,
    pub ttft_ms: Percentiles,
}

#[derive(Default)]
struct Outcome {
    /// The request's tenant, when it has one.
    tenant: Option<u32>,
    ok: bool,
    ttft: Option<f64>,
    itl: Vec<f64>,
    e2e: f64,
    /// Chunks that carried a choice.
    chunks: u64,
    /// The usage's `completion_tokens`, where reported.
    completion_tokens: Option<u64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    worker: Option<String>,
}

/// Which of `n` URLs `r` goes to: spread by the request's arrival time (and length).
fn pick(r: &TraceRequest, n: usize) -> usize {
    let seed = r.timestamp.wrapping_add(r.input_length as u64);
    (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33) as usize % n
}

/// The body `cfg` sends for `r`.
fn request_body(cfg: &ReplayConfig, r: &TraceRequest) -> serde_json::Value {
    let mut body = serde_json::json!({
        "prompt": prompt_text(r, cfg.hash_block),
        "max_tokens": r.output_length.max(1),
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(m) = &cfg.model {
        body["model"] = m.clone().into();
    }
    for (k, v) in &cfg.extra_body {
        body[k] = v.clone();
    }
    body
}

impl Outcome {
    /// Reads one streamed chunk; whether it carried a choice (a token, or several).
    fn read_chunk(&mut self, v: &serde_json::Value) -> bool {
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
            self.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            self.completion_tokens = u["completion_tokens"].as_u64();
        }
        if self.worker.is_none() {
            let id = &v["nvext"]["worker_id"]["decode_worker_id"];
            self.worker = id.as_u64().map(|id| id.to_string());
        }
        let choice = v["choices"].as_array().is_some_and(|c| !c.is_empty());
        self.chunks += u64::from(choice);
        choice
    }

    fn output_tokens(&self) -> u64 {
        self.completion_tokens.unwrap_or(self.chunks)
    }

    fn short_stream(&self) -> bool {
        self.completion_tokens.is_some_and(|t| t > self.chunks)
    }
}

/// The request `cfg` sends for `r`, of `tenant` when it has one.
fn request(
    cfg: &ReplayConfig,
    r: &TraceRequest,
    tenant: Option<u32>,
) -> Result<http::Request<Full<Bytes>>, http::Error> {
    let base = &cfg.urls[pick(r, cfg.urls.len())];
    let mut req = http::Request::post(format!("{base}/v1/completions"))
        .header("content-type", "application/json");
    if let Some(t) = tenant {
        req = req.header(cfg.tenant_header.as_str(), crate::tenants::tenant_key(t));
    }
    req.body(Full::new(Bytes::from(request_body(cfg, r).to_string())))
}

async fn one(
    client: &Client<HttpConnector, Full<Bytes>>,
    cfg: &ReplayConfig,
    r: &TraceRequest,
    tenant: Option<u32>,
) -> Outcome {
    let failed = Outcome {
        tenant,
        ..Outcome::default()
    };
    let Ok(req) = request(cfg, r, tenant) else {
        return failed;
    };
    let start = Instant::now();
    let Ok(resp) = client.request(req).await else {
        return failed;
    };
    let mut out = Outcome {
        tenant,
        worker: resp
            .headers()
            .get("x-kvroute-worker")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        ..Outcome::default()
    };
    if !resp.status().is_success() {
        return out;
    }
    let mut body = resp.into_body();
    let mut last: Option<Instant> = None;
    let mut buf = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { return out };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        // Complete SSE events only.
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(json) = text.trim().strip_prefix("data: ") else {
                continue;
            };
            if json == "[DONE]" {
                continue;
            }
            let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else {
                continue;
            };
            if out.read_chunk(&v) {
                let now = Instant::now();
                match last {
                    None => out.ttft = Some(now.duration_since(start).as_secs_f64() * 1e3),
                    Some(l) => out.itl.push(now.duration_since(l).as_secs_f64() * 1e3),
                }
                last = Some(now);
            }
        }
    }
    out.e2e = start.elapsed().as_secs_f64() * 1e3;
    out.ok = out.ttft.is_some();
    out
}

/// Replays `trace` against `cfg.urls` in real time.
///
/// # Panics
/// If `cfg.urls` is empty.
pub async fn replay(trace: &[TraceRequest], cfg: &ReplayConfig) -> ReplayResult {
    assert!(!cfg.urls.is_empty(), "replay: no URL to send to");
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let limit = Arc::new(Semaphore::new(cfg.max_concurrency.max(1)));
    let start = Instant::now();
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let progress = cfg.progress.then(|| {
        let done = done.clone();
        let total = trace.len();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                eprint!(
                    "\r{} / {total} requests done",
                    done.load(std::sync::atomic::Ordering::Relaxed)
                );
            }
        })
    });
    let mut tasks = Vec::new();
    for (i, r) in trace.iter().enumerate() {
        let at = start + Duration::from_secs_f64(r.timestamp as f64 / 1000.0 / cfg.rate_scale);
        if cfg.duration.is_some_and(|d| at > start + d) {
            break;
        }
        tokio::time::sleep_until(at.into()).await;
        let Ok(permit) = limit.clone().acquire_owned().await else {
            break;
        };
        let (client, cfg2, r2, done) = (client.clone(), cfg.clone(), r.clone(), done.clone());
        let tenant = cfg.tenants.as_ref().and_then(|t| t.get(i).copied());
        tasks.push(tokio::spawn(async move {
            let o = one(&client, &cfg2, &r2, tenant).await;
            drop(permit);
            done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            o
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.unwrap_or_default());
    }
    let tenants = tenant_figures(&outcomes);
    if let Some(p) = progress {
        p.abort();
        eprintln!();
    }
    let elapsed = start.elapsed().as_secs_f64().max(1e-9);
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
    let mut per_worker = BTreeMap::new();
    for o in &ok {
        *per_worker
            .entry(o.worker.clone().unwrap_or_else(|| "?".into()))
            .or_insert(0) += 1;
    }
    let prompt: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|o| o.ttft).collect();
    ReplayResult {
        requests: outcomes.len(),
        errors: outcomes.len() - ok.len(),
        ttft_ms: percentiles(&mut ttft),
        ttft_sorted_ms: ttft,
        itl_ms: percentiles(
            &mut ok
                .iter()
                .flat_map(|o| o.itl.iter().copied())
                .collect::<Vec<_>>(),
        ),
        e2e_ms: percentiles(&mut ok.iter().map(|o| o.e2e).collect::<Vec<_>>()),
        throughput_rps: ok.len() as f64 / elapsed,
        output_tokens_per_s: ok.iter().map(|o| o.output_tokens()).sum::<u64>() as f64 / elapsed,
        hit_share: ok.iter().map(|o| o.cached_tokens).sum::<u64>() as f64 / prompt.max(1) as f64,
        short_streams: ok.iter().filter(|o| o.short_stream()).count(),
        requests_per_worker: per_worker,
        tenants,
    }
}

/// Each tenant's figures, by tenant number; none when no request had a tenant.
fn tenant_figures(outcomes: &[Outcome]) -> Vec<TenantTtft> {
    let mut by_tenant: BTreeMap<u32, (usize, Vec<f64>)> = BTreeMap::new();
    for o in outcomes {
        if let Some(t) = o.tenant {
            let (sent, ttft) = by_tenant.entry(t).or_default();
            *sent += 1;
            ttft.extend(o.ttft.filter(|_| o.ok));
        }
    }
    by_tenant
        .into_iter()
        .map(|(t, (requests, mut ttft))| TenantTtft {
            tenant: crate::tenants::tenant_key(t),
            requests,
            answered: ttft.len(),
            ttft_ms: percentiles(&mut ttft),
        })
        .collect()
}

/// A `--url` entry: non-empty, without its trailing `/`.
pub fn base_url(s: &str) -> Result<String, String> {
    let url = s.trim().trim_end_matches('/');
    if url.is_empty() {
        return Err("empty URL".into());
    }
    Ok(url.to_owned())
}

/// `--extra-body`: a JSON object.
pub fn json_object(s: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(s) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err("not a JSON object".into()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_spread_over_every_url() {
        let at = |ms| TraceRequest {
            timestamp: ms,
            input_length: 100,
            output_length: 1,
            hash_ids: vec![],
        };
        for n in 1..=4 {
            let mut hits = vec![0; n];
            for ms in 0..200 {
                hits[pick(&at(ms * 37), n)] += 1;
            }
            assert!(hits.iter().all(|&h| h > 0), "{n} URLs: {hits:?}");
        }
    }

    #[test]
    fn extra_body_fields_join_and_replace_the_replays_own() {
        let cfg = ReplayConfig {
            urls: vec!["http://x".into()],
            model: Some("tiny".into()),
            extra_body:
                serde_json::json!({"nvext": {"extra_fields": ["worker_id"]}, "max_tokens": 2})
                    .as_object()
                    .unwrap()
                    .clone(),
            hash_block: 4,
            rate_scale: 1.0,
            max_concurrency: 1,
            duration: None,
            progress: false,
            tenants: None,
            tenant_header: ReplayConfig::DEFAULT_TENANT_HEADER.into(),
        };
        let r = TraceRequest {
            timestamp: 0,
            input_length: 6,
            output_length: 9,
            hash_ids: vec![1, 2],
        };
        let body = request_body(&cfg, &r);
        assert_eq!(body["model"], "tiny");
        assert_eq!(body["nvext"]["extra_fields"][0], "worker_id");
        assert_eq!(body["max_tokens"], 2);
        assert_eq!(body["stream"], true);
    }

    #[test]
    fn a_tenants_request_carries_its_key_in_the_tenant_header() {
        let cfg = ReplayConfig {
            urls: vec!["http://x".into()],
            model: None,
            extra_body: Default::default(),
            hash_block: 4,
            rate_scale: 1.0,
            max_concurrency: 1,
            duration: None,
            progress: false,
            tenants: None,
            tenant_header: "x-team".into(),
        };
        let r = TraceRequest {
            timestamp: 0,
            input_length: 6,
            output_length: 1,
            hash_ids: vec![1],
        };
        let req = request(&cfg, &r, Some(3)).unwrap();
        assert_eq!(req.headers()["x-team"], "tenant-3");
        assert_eq!(req.uri(), "http://x/v1/completions");
        let req = request(&cfg, &r, None).unwrap();
        assert!(!req.headers().contains_key("x-team"));
        let bad = ReplayConfig {
            tenant_header: "not a header".into(),
            ..cfg
        };
        assert!(request(&bad, &r, Some(0)).is_err());
    }

    #[test]
    fn each_tenants_figures_count_its_requests_and_answered_ttfts() {
        let o = |tenant, ttft: Option<f64>| Outcome {
            tenant,
            ok: ttft.is_some(),
            ttft,
            ..Outcome::default()
        };
        let outcomes = [
            o(Some(1), Some(10.0)),
            o(Some(0), Some(300.0)),
            o(Some(1), Some(30.0)),
            o(Some(1), None),
            o(Some(0), Some(100.0)),
            o(Some(1), Some(20.0)),
        ];
        let t = tenant_figures(&outcomes);
        assert_eq!(t.len(), 2);
        assert_eq!(
            (t[0].tenant.as_str(), t[0].requests, t[0].answered),
            ("tenant-0", 2, 2)
        );
        assert_eq!(
            (t[1].tenant.as_str(), t[1].requests, t[1].answered),
            ("tenant-1", 4, 3)
        );
        assert_eq!((t[1].ttft_ms.p50, t[1].ttft_ms.p99), (20.0, 30.0));
        assert_eq!(t[0].ttft_ms.p90, 300.0);
        assert!(tenant_figures(&[o(None, Some(1.0))]).is_empty());
    }

    #[test]
    fn tokens_come_from_usage_and_a_withheld_stream_is_counted() {
        // Dynamo's frontend, tokens decoding to empty text: one chunk at the end, then usage.
        let mut o = Outcome::default();
        assert!(o.read_chunk(&serde_json::json!(
            {"choices": [{"text": "", "finish_reason": "length"}], "usage": null}
        )));
        assert!(!o.read_chunk(&serde_json::json!({"choices": [], "usage":
            {"prompt_tokens": 22, "completion_tokens": 4,
             "prompt_tokens_details": {"audio_tokens": null, "cached_tokens": 16}}})));
        assert_eq!(
            (o.output_tokens(), o.prompt_tokens, o.cached_tokens),
            (4, 22, 16)
        );
        assert!(o.short_stream());
        assert_eq!(o.worker, None);

        // Asked for nvext's worker_id: a chunk per token, each naming the worker.
        let mut o = Outcome::default();
        for _ in 0..2 {
            assert!(o.read_chunk(&serde_json::json!({"choices": [{"text": ""}],
                "nvext": {"worker_id": {"decode_worker_id": 99u64, "prefill_worker_id": 99u64}}})));
        }
        o.read_chunk(&serde_json::json!({"choices": [], "usage": {"completion_tokens": 2}}));
        assert_eq!((o.output_tokens(), o.short_stream()), (2, false));
        assert_eq!(o.worker.as_deref(), Some("99"));

        // No usage: the chunks counted.
        let mut o = Outcome::default();
        o.read_chunk(&serde_json::json!({"choices": [{"text": "a"}]}));
        assert_eq!((o.output_tokens(), o.short_stream()), (1, false));
    }
}
