//! Does one kvroute-sim process keep pace with 64 concurrent streams at `--speedup 100`?
//!
//!     cargo run --release -p kvroute-sim --example stream_load [-- URL [STREAMS [SECONDS]]]
//!
//! Runs STREAMS (default 64) closed-loop streaming clients (512-token prompts, 64 output
//! tokens, the next request as soon as one ends) for SECONDS (default 10) against URL, or,
//! without a URL, against an in-process server at speedup 100 on its own 2-thread runtime.
//! Then replays the same closed loop through the engine core in virtual time and prints
//! both output-token rates, and the time the server's engine fell behind the step-time
//! model (`kvroute_sim_lag_forgiven_seconds_total`; 0 means the engine kept the model's
//! pace, whatever the clients managed to read).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_sim::engine::{EngineCore, EngineRequest, RequestId};
use kvroute_sim::SimArgs;

const PROMPT_LEN: usize = 512;
const MAX_TOKENS: usize = 64;
const SPEEDUP: f64 = 100.0;

fn prompt(n: u64) -> String {
    kvroute_sim::text(PROMPT_LEN, n)
}

fn model_rate(streams: usize, seconds: f64) -> f64 {
    let args = SimArgs {
        speedup: SPEEDUP,
        ..SimArgs::default()
    };
    let outputs: Vec<u32> = (b'a'..=b'z').map(u32::from).collect();
    let mut core = EngineCore::new(args.engine_config(0, outputs));
    let mut next = 0u64;
    let mut add = |core: &mut EngineCore| {
        let p = prompt(next).bytes().map(u32::from).collect();
        core.add_request(EngineRequest {
            id: RequestId(next),
            prompt: p,
            max_tokens: MAX_TOKENS,
            salt: 0,
            lora: None,
            priority: 0,
        })
        .expect("fits");
        next += 1;
    };
    for _ in 0..streams {
        add(&mut core);
    }
    let (mut now, mut tokens) = (Duration::ZERO, 0u64);
    while now.as_secs_f64() < seconds {
        let out = core.step(now);
        now += out.duration;
        tokens += out.tokens.len() as u64;
        for t in out.tokens.iter().filter(|t| t.finished) {
            let _ = t;
            add(&mut core);
        }
    }
    tokens as f64 / now.as_secs_f64()
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let url = args.next().filter(|a| a != "-");
    let streams: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(64);
    let seconds: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(10.0);

    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let url = match url {
        Some(u) => u,
        None => {
            let listener = server_rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
            let url = format!("http://{}", listener.local_addr()?);
            let args = SimArgs {
                speedup: SPEEDUP,
                ..SimArgs::default()
            };
            let server = kvroute_sim::SimServer::new(
                args,
                Arc::new(kvroute_tokenizer::Tokenizer::fallback()),
            );
            server_rt.spawn(server.serve(listener, tokio_util::sync::CancellationToken::new()));
            url
        }
    };

    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let tokens = Arc::new(AtomicU64::new(0));
    let requests = Arc::new(AtomicU64::new(0));
    let counter = Arc::new(AtomicU64::new(1_000_000));
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    client_rt.block_on(async {
        let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let mut tasks = Vec::new();
        for _ in 0..streams {
            let (client, url, tokens, requests, counter) =
                (client.clone(), url.clone(), tokens.clone(), requests.clone(), counter.clone());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < deadline {
                    let n = counter.fetch_add(1, Ordering::Relaxed);
                    let body = serde_json::json!({"prompt": prompt(n), "max_tokens": MAX_TOKENS, "stream": true});
                    let req = http::Request::post(format!("{url}/v1/completions"))
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(body.to_string())))
                        .expect("request");
                    let Ok(resp) = client.request(req).await else { continue };
                    let mut body = resp.into_body();
                    while let Some(Ok(frame)) = body.frame().await {
                        if Instant::now() >= deadline {
                            return;
                        }
                        if let Ok(data) = frame.into_data() {
                            let n = data.windows(6).filter(|w| w == b"\"text\"").count();
                            tokens.fetch_add(n as u64, Ordering::Relaxed);
                        }
                    }
                    requests.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        for t in tasks {
            let _ = t.await;
        }
    });
    let lag = client_rt.block_on(async {
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let req = http::Request::get(format!("{url}/metrics"))
            .body(Full::new(Bytes::new()))
            .expect("request");
        let text = match client.request(req).await {
            Ok(resp) => String::from_utf8_lossy(
                &resp
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default(),
            )
            .into_owned(),
            Err(_) => String::new(),
        };
        text.lines()
            .filter(|l| l.starts_with("kvroute_sim_lag_forgiven_seconds_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .fold(0.0, |a, b| a + b)
    });
    let wall = started.elapsed().as_secs_f64().min(seconds);
    let served = tokens.load(Ordering::Relaxed) as f64 / wall;
    let model = model_rate(streams, seconds);
    println!(
        "streams={streams} seconds={seconds} speedup={SPEEDUP} served={served:.0} tok/s model={model:.0} tok/s ratio={:.2} engine_lag_forgiven={lag:.3}s requests={}",
        served / model,
        requests.load(Ordering::Relaxed)
    );
    Ok(())
}
