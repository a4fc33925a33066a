//! Chaos client: REQUESTS streaming chats, CONCURRENCY at a time, through a running kvroute
//! whose engines are being killed (by `bench/chaos.sh`); then one table of what the clients
//! got, and what the router counted.
//!
//!     cargo run --release -p kvroute-gateway --example chaos -- URL METRICS_URL \
//!         [REQUESTS [CONCURRENCY [SEED]]]
//!
//! The workload is synthetic and multi-turn: each client runs conversations of up to four
//! turns on one of eight shared 800-character system prompts; a turn sends the history (the
//! answers as received) and a new question, asking for 16 to 128 tokens. A conversation whose
//! turn failed starts afresh.
//!
//! Each request ends one way: **completed** (status 200, the stream ends with `[DONE]`, no
//! error event), **failed with an error event** (a `data: {"error": ...}` event), or **failed
//! otherwise** (an error status, a refused connection, a stream cut without `[DONE]`). Tokens
//! delivered are the bytes of the streamed content: with kvroute-sim's fallback tokenizer a
//! token is one byte. How many completed requests were migrated the client cannot see (the
//! headers were sent before); the router's `kvroute_request_migrations_total` says, read
//! before and after the run.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Completed,
    ErrorEvent,
    Failed,
}

#[derive(Debug)]
struct Answer {
    outcome: Outcome,
    asked: u64,
    delivered: u64,
    text: String,
    /// The first error event's `error.code` or `error.type`, or why the request failed.
    why: Option<String>,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let url = args.first().expect("URL").clone();
    let metrics_url = args.get(1).expect("METRICS_URL").clone();
    let requests: u64 = args.get(2).map_or(2000, |s| s.parse().expect("REQUESTS"));
    let concurrency: u64 = args.get(3).map_or(32, |s| s.parse().expect("CONCURRENCY"));
    let seed: u64 = args.get(4).map_or(0, |s| s.parse().expect("SEED"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(url, metrics_url, requests, concurrency, seed));
}

async fn run(url: String, metrics_url: String, requests: u64, concurrency: u64, seed: u64) {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(concurrency as usize)
        .build(connector);
    let before = scrape(&client, &metrics_url).await;
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..concurrency {
        let (client, url, next) = (client.clone(), url.clone(), next.clone());
        tasks.spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1_000_003) + c);
            let mut answers = Vec::new();
            let mut history: Vec<Value> = Vec::new();
            loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n >= requests {
                    return answers;
                }
                if history.is_empty() || history.len() >= 9 {
                    let system = kvroute_sim::text(800, rng.random_range(0..8));
                    history = vec![json!({"role": "system", "content": system})];
                }
                let question = kvroute_sim::text(rng.random_range(40..200), 1_000_000 + n);
                history.push(json!({"role": "user", "content": question}));
                let asked = rng.random_range(16..=128);
                let body = json!({
                    "model": "kvroute-sim", "messages": history,
                    "max_tokens": asked, "stream": true,
                });
                let answer = chat(&client, &url, &body, asked).await;
                if answer.outcome == Outcome::Completed {
                    history.push(json!({"role": "assistant", "content": answer.text}));
                } else {
                    history.clear();
                }
                answers.push(answer);
            }
        });
    }
    let mut answers = Vec::new();
    while let Some(done) = tasks.join_next().await {
        answers.extend(done.expect("a client task"));
    }
    let elapsed = start.elapsed().as_secs_f64();
    let after = settled(&client, &metrics_url).await;
    report(&answers, elapsed, &before, &after);
}

/// One streamed chat, read to its end.
async fn chat(client: &HttpClient, url: &str, body: &Value, asked: u64) -> Answer {
    let mut answer = Answer {
        outcome: Outcome::Failed,
        asked,
        delivered: 0,
        text: String::new(),
        why: None,
    };
    let req = http::Request::post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = match client.request(req).await {
        Ok(resp) => resp,
        Err(e) => {
            answer.why = Some(format!("connection: {e}"));
            return answer;
        }
    };
    if resp.status() != 200 {
        answer.why = Some(format!("status {}", resp.status().as_u16()));
        let _ = resp.into_body().collect().await;
        return answer;
    }
    let mut body = resp.into_body();
    let (mut buffer, mut done, mut error_event) = (Vec::<u8>::new(), false, false);
    loop {
        match body.frame().await {
            None => break,
            Some(Err(e)) => {
                answer.why.get_or_insert(format!("stream cut: {e}"));
                break;
            }
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                buffer.extend_from_slice(&data);
                while let Some(at) = buffer.windows(2).position(|w| w == b"\n\n") {
                    let event: Vec<u8> = buffer.drain(..at + 2).collect();
                    let event = String::from_utf8_lossy(&event);
                    let Some(data) = event.trim().strip_prefix("data: ") else {
                        continue;
                    };
                    if data == "[DONE]" {
                        done = true;
                        continue;
                    }
                    let Ok(chunk) = serde_json::from_str::<Value>(data) else {
                        continue;
                    };
                    if let Some(error) = chunk.get("error") {
                        error_event = true;
                        let code = error.get("code").or(error.get("type"));
                        answer.why.get_or_insert(format!(
                            "error event: {}",
                            code.map_or("?".to_owned(), Value::to_string)
                        ));
                    }
                    if let Some(text) = chunk["choices"][0]["delta"]["content"].as_str() {
                        answer.delivered += text.len() as u64;
                        answer.text.push_str(text);
                    }
                }
            }
        }
    }
    answer.outcome = match (error_event, done) {
        (true, _) => Outcome::ErrorEvent,
        (false, true) => Outcome::Completed,
        (false, false) => {
            answer.why.get_or_insert("no [DONE]".to_owned());
            Outcome::Failed
        }
    };
    answer
}

async fn scrape(client: &HttpClient, metrics_url: &str) -> String {
    let req = http::Request::get(format!("{metrics_url}/metrics"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    match client.request(req).await {
        Ok(r) => match r.into_body().collect().await {
            Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
            Err(e) => format!("# cannot scrape: {e}"),
        },
        Err(e) => format!("# cannot scrape: {e}"),
    }
}

/// The router's metrics once nothing is left in it, or as they are after 10 s (what is left
/// then is a leak).
async fn settled(client: &HttpClient, metrics_url: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = scrape(client, metrics_url).await;
        let idle = sum(&text, "kvroute_requests_in_router", "") == 0.0
            && sum(&text, "kvroute_worker_requests_active", "") == 0.0;
        if idle || Instant::now() > deadline {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The sum of the samples of `name` whose labels contain `label`.
fn sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{']) && rest.contains(label))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn report(answers: &[Answer], elapsed: f64, before: &str, after: &str) {
    let count = |o: Outcome| answers.iter().filter(|a| a.outcome == o).count();
    let (completed, error_event, failed) = (
        count(Outcome::Completed),
        count(Outcome::ErrorEvent),
        count(Outcome::Failed),
    );
    let migrations = |label: &str| {
        let name = "kvroute_request_migrations_total";
        sum(after, name, label) - sum(before, name, label)
    };
    let has_migrations = after.contains("kvroute_request_migrations");
    let migrated_ok = migrations("outcome=\"migrated\"");
    let migrated = if has_migrations {
        format!("{migrated_ok:.0}")
    } else {
        "- (no kvroute_request_migrations_total)".to_owned()
    };
    let exact = answers.iter().filter(|a| a.delivered == a.asked).count();
    let short = answers.iter().filter(|a| a.delivered < a.asked).count();
    let over = answers.iter().filter(|a| a.delivered > a.asked).count();
    let asked: u64 = answers.iter().map(|a| a.asked).sum();
    let delivered: u64 = answers.iter().map(|a| a.delivered).sum();
    let completed_short = answers
        .iter()
        .filter(|a| a.outcome == Outcome::Completed && a.delivered != a.asked)
        .count();
    println!(
        "{} requests in {elapsed:.1} s ({:.0} req/s)",
        answers.len(),
        answers.len() as f64 / elapsed
    );
    println!("| outcome | requests |");
    println!("|---|---|");
    println!(
        "| completed normally | {:.0} |",
        (completed as f64 - migrated_ok).max(0.0)
    );
    println!("| completed after a migration (router's count) | {migrated} |");
    println!("| failed with an error event | {error_event} |");
    println!("| failed otherwise | {failed} |");
    println!(
        "| got exactly max_tokens | {exact} of {} (fewer {short}, more {over}; completed but not exact {completed_short}) |",
        answers.len()
    );
    println!("| tokens delivered / asked | {delivered} / {asked} |");
    if has_migrations {
        let outcomes: Vec<String> = after
            .lines()
            .filter(|l| l.starts_with("kvroute_request_migrations_total{"))
            .filter_map(|l| {
                let labels = &l[l.find('{')? + 1..l.find('}')?];
                Some(format!("{labels} +{:.0}", migrations(labels)))
            })
            .collect();
        println!("migrations by outcome: {}", outcomes.join(", "));
    }
    let mut reasons: std::collections::BTreeMap<&str, usize> = Default::default();
    for a in answers.iter().filter(|a| a.outcome != Outcome::Completed) {
        *reasons.entry(a.why.as_deref().unwrap_or("?")).or_default() += 1;
    }
    if !reasons.is_empty() {
        let reasons: Vec<String> = reasons.iter().map(|(r, n)| format!("{n} {r}")).collect();
        println!("why failed: {}", reasons.join("; "));
    }
    println!(
        "in flight after the run: kvroute_requests_in_router {}, kvroute_worker_requests_active {}",
        sum(after, "kvroute_requests_in_router", ""),
        sum(after, "kvroute_worker_requests_active", "")
    );
}
