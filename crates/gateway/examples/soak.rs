//! Soak: many concurrent streaming clients, closed loop, through a running kvroute, until a
//! request count; then checks that nothing was lost and nothing is left in flight, and
//! prints the router's resident memory over the run. Run by `bench/soak.sh`.
//!
//!     cargo run --release -p kvroute-gateway --example soak -- URL METRICS_URL PID \
//!         [CLIENTS [REQUESTS [MAX_SECONDS]]]
//!
//! Each request is a streaming chat: one of 200 shared 1,000-character prefixes and a
//! unique suffix (so prefix trees and indexes keep growing unless bounded), 8 output
//! tokens. A request is "ok" when its stream ends with `data: [DONE]`, an "error" when it
//! got an error status or a broken stream; "lost" would be a request with neither.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[derive(Default)]
struct Counts {
    sent: AtomicU64,
    ok: AtomicU64,
    error_status: AtomicU64,
    broken: AtomicU64,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let url = args.first().expect("URL").clone();
    let metrics_url = args.get(1).expect("METRICS_URL").clone();
    let pid: u32 = args.get(2).expect("PID").parse().expect("PID");
    let clients: u64 = args.get(3).map_or(1000, |s| s.parse().unwrap());
    let requests: u64 = args.get(4).map_or(200_000, |s| s.parse().unwrap());
    let max_secs: u64 = args.get(5).map_or(1800, |s| s.parse().unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(url, metrics_url, pid, clients, requests, max_secs));
}

async fn run(
    url: String,
    metrics_url: String,
    pid: u32,
    clients: u64,
    requests: u64,
    max_secs: u64,
) {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(clients as usize)
        .build(connector);
    let prefixes: Arc<Vec<String>> =
        Arc::new((0..200).map(|i| kvroute_sim::text(1000, i)).collect());
    let counts = Arc::new(Counts::default());
    let start = Instant::now();
    let deadline = start + Duration::from_secs(max_secs);
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..clients {
        let (client, counts, prefixes, url) = (
            client.clone(),
            counts.clone(),
            prefixes.clone(),
            url.clone(),
        );
        tasks.spawn(async move {
            loop {
                let n = counts.sent.fetch_add(1, Ordering::Relaxed);
                if n >= requests || Instant::now() > deadline {
                    counts.sent.fetch_sub(1, Ordering::Relaxed);
                    return;
                }
                let content = format!(
                    "{} {}",
                    prefixes[((n * 7 + c) % 200) as usize],
                    kvroute_sim::text(32, n + 1_000_000)
                );
                let body = serde_json::json!({
                    "model": "kvroute-sim",
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": 8,
                    "stream": true,
                })
                .to_string();
                let req = http::Request::post(format!("{url}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .unwrap();
                match client.request(req).await {
                    Ok(resp) if resp.status() == 200 => {
                        match resp.into_body().collect().await.map(|b| b.to_bytes()) {
                            Ok(b) if b.ends_with(b"data: [DONE]\n\n") => {
                                counts.ok.fetch_add(1, Ordering::Relaxed);
                            }
                            _ => {
                                counts.broken.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Ok(resp) => {
                        let _ = resp.into_body().collect().await;
                        counts.error_status.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        counts.broken.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
    }
    println!("t_s,done,req_per_s,rss_mib");
    let mut samples = Vec::new();
    let mut last = (0u64, Instant::now());
    while !tasks.is_empty() {
        tokio::select! {
            _ = tasks.join_next() => {}
            _ = tokio::time::sleep(Duration::from_secs(5)) => {
                let done = counts.ok.load(Ordering::Relaxed)
                    + counts.error_status.load(Ordering::Relaxed)
                    + counts.broken.load(Ordering::Relaxed);
                let rate = (done - last.0) as f64 / last.1.elapsed().as_secs_f64();
                last = (done, Instant::now());
                let rss = rss_kib(pid).unwrap_or(0) as f64 / 1024.0;
                samples.push(rss);
                println!("{:.0},{done},{rate:.0},{rss:.1}", start.elapsed().as_secs_f64());
            }
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let sent = counts.sent.load(Ordering::Relaxed);
    let ok = counts.ok.load(Ordering::Relaxed);
    let error_status = counts.error_status.load(Ordering::Relaxed);
    let broken = counts.broken.load(Ordering::Relaxed);
    let scrape = || async {
        let req = http::Request::get(format!("{metrics_url}/metrics"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        match client.request(req).await {
            Ok(r) => String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes())
                .into_owned(),
            Err(e) => format!("# cannot scrape: {e}"),
        }
    };
    let sum = |text: &str, name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    // The router's bookkeeping ends just after the clients' last bytes: read its gauges once
    // nothing is left in it, or as they are after 10 s (what is left then is a leak).
    let settle = std::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = scrape().await;
        if sum(&text, "kvroute_requests_in_router") == 0.0 || std::time::Instant::now() > settle {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let gauge_sum = |name: &str| sum(&text, name);
    let active = gauge_sum("kvroute_worker_requests_active");
    let in_router = gauge_sum("kvroute_requests_in_router");
    let prefill = gauge_sum("kvroute_worker_active_prefill_tokens");
    let decode = gauge_sum("kvroute_worker_active_decode_blocks");
    let q = |f: f64| {
        samples
            .get(((samples.len() as f64 - 1.0) * f) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    println!(
        "clients {clients}, sent {sent}, ok {ok}, error status {error_status}, broken {broken}, lost {}; {:.0} s, {:.0} req/s",
        sent - ok - error_status - broken,
        elapsed,
        sent as f64 / elapsed
    );
    println!(
        "after: in flight {active}, in router {in_router}, prefill tokens {prefill}, decode blocks {decode}; RSS MiB at 10% {:.1}, 50% {:.1}, 90% {:.1}, end {:.1}",
        q(0.1),
        q(0.5),
        q(0.9),
        rss_kib(pid).unwrap_or(0) as f64 / 1024.0
    );
}
