//! Fidelity against a real vLLM (opt-in).
//!
//!     ../shared/peers/setup_peers.sh vllm model
//!     ../shared/peers/run_vllm_cpu.sh 8100 5557 --enable-prompt-tokens-details &
//!     KVROUTE_VLLM_URL=http://127.0.0.1:8100 KVROUTE_VLLM_KV_EVENTS=tcp://127.0.0.1:5557 \
//!         cargo test -p kvroute-sim --test vllm_fidelity -- --nocapture
//!
//! Sends the same request sequence (completions and chats sharing prefixes, a chat's
//! continuation with `continue_final_message`, one output token each, nothing evicted) to that vLLM and to kvroute-sim with the same tokenizer
//! (testdata/tiny-llama, vLLM's tiny model) and block size (32), then requires the same
//! `cached_tokens` for every request and the same sequence of stored blocks (token ids and
//! parent links). Without the environment variables it says so and checks nothing.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_protocol::kv_events::{decode_batch, KvEvent};
use kvroute_sim::{SimArgs, SimServer};
use kvroute_tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv};

async fn post(url: &str, path: &str, body: &Value) -> Value {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let req = http::Request::post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(
        status.is_success(),
        "{url}{path}: {status} {}",
        String::from_utf8_lossy(&bytes)
    );
    serde_json::from_slice(&bytes).unwrap()
}

/// A subscriber that has seen at least one message (so it is joined).
async fn subscribe(endpoint: &str, url: &str, model: &str) -> zeromq::SubSocket {
    let mut sub = zeromq::SubSocket::new();
    sub.connect(endpoint).await.unwrap();
    sub.subscribe("").await.unwrap();
    for i in 0..100 {
        let warm = json!({"model": model, "prompt": format!("warm up {i} {} ", nonce()).repeat(8), "max_tokens": 1});
        post(url, "/v1/completions", &warm).await;
        if tokio::time::timeout(Duration::from_millis(300), sub.recv())
            .await
            .is_ok()
        {
            drain(&mut sub).await;
            return sub;
        }
    }
    panic!("no KV events from {endpoint}");
}

/// Every stored block, in order, as the full token prefix it closes (so parent links are
/// compared by what they point at, not by engine-specific hash values).
async fn drain(sub: &mut zeromq::SubSocket) -> Vec<Vec<u32>> {
    let mut chains: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut out = Vec::new();
    while let Ok(msg) = tokio::time::timeout(Duration::from_millis(1500), sub.recv()).await {
        let frames = msg.unwrap().into_vec();
        let batch = decode_batch(&frames[2]).unwrap();
        for event in batch.events {
            if let KvEvent::BlockStored(s) = event {
                let bs = s.block_size as usize;
                let mut chain = match &s.parent_block_hash {
                    Some(p) => chains
                        .get(&p.to_u64())
                        .cloned()
                        .unwrap_or_else(|| vec![u32::MAX]),
                    None => Vec::new(),
                };
                for (i, h) in s.block_hashes.iter().enumerate() {
                    chain.extend_from_slice(&s.token_ids[i * bs..(i + 1) * bs]);
                    chains.insert(h.to_u64(), chain.clone());
                    out.push(chain.clone());
                }
            }
        }
    }
    out
}

fn nonce() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

fn requests(model: &str) -> Vec<(&'static str, Value)> {
    let n = nonce();
    let a = format!("run {n}: the quick brown fox jumps over the lazy dog while the router watches the cache fill up block by block ");
    let story = a.repeat(3);
    let system = format!("run {n}: you are a careful assistant who answers in one word and never repeats the question. ").repeat(2);
    let chat = |msgs: Value| json!({"model": model, "messages": msgs, "max_tokens": 1});
    let user = |t: &str| json!({"role": "user", "content": t});
    let sys = json!({"role": "system", "content": system});
    vec![
        (
            "/v1/completions",
            json!({"model": model, "prompt": story, "max_tokens": 1}),
        ),
        (
            "/v1/completions",
            json!({"model": model, "prompt": story, "max_tokens": 1}),
        ),
        (
            "/v1/completions",
            json!({"model": model, "prompt": format!("{story} and then some more words to extend the prompt past another block boundary or two"), "max_tokens": 1}),
        ),
        (
            "/v1/completions",
            json!({"model": model, "prompt": format!("run {n}: a different story altogether"), "max_tokens": 1}),
        ),
        (
            "/v1/chat/completions",
            chat(json!([sys, user("what is the capital of france?")])),
        ),
        (
            "/v1/chat/completions",
            chat(json!([sys, user("what is the capital of spain?")])),
        ),
        (
            "/v1/chat/completions",
            chat(json!([sys, user("what is the capital of france?"),
            {"role": "assistant", "content": "paris"}, user("and of italy, if you please, in one word?")])),
        ),
        // A migrated chat's continuation: the first chat's prompt, then the text so far.
        (
            "/v1/chat/completions",
            json!({"model": model, "max_tokens": 1,
                   "messages": [sys, user("what is the capital of france?"),
                                {"role": "assistant", "content": "The capital of France is"}],
                   "continue_final_message": true, "add_generation_prompt": false}),
        ),
    ]
}

#[tokio::test]
async fn same_cached_tokens_and_stored_blocks_as_vllm() {
    let (Ok(vllm_url), Ok(vllm_events)) = (
        std::env::var("KVROUTE_VLLM_URL"),
        std::env::var("KVROUTE_VLLM_KV_EVENTS"),
    ) else {
        eprintln!(
            "vllm_fidelity: KVROUTE_VLLM_URL and KVROUTE_VLLM_KV_EVENTS not set; nothing compared"
        );
        return;
    };
    let vllm_model = std::env::var("KVROUTE_VLLM_MODEL").unwrap_or_else(|_| "tiny".to_owned());

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sim_events = format!("tcp://127.0.0.1:{port}");
    let tokenizer_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/tiny-llama");
    let args = <SimArgs as clap::Parser>::parse_from([
        "kvroute-sim",
        "--model",
        "tiny",
        "--block-size",
        "32",
        "--speedup",
        "1000",
        "--kv-events-endpoint",
        &sim_events,
    ]);
    let tokenizer = Arc::new(Tokenizer::load(&tokenizer_dir).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sim_url = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(SimServer::new(args, tokenizer).serve(listener, shutdown.clone()));

    let mut vllm_sub = subscribe(&vllm_events, &vllm_url, &vllm_model).await;
    let mut sim_sub = subscribe(&sim_events, &sim_url, "tiny").await;

    let mut report = Vec::new();
    for (path, body) in requests(&vllm_model) {
        let v = post(&vllm_url, path, &body).await;
        let mut sim_body = body.clone();
        sim_body["model"] = json!("tiny");
        let s = post(&sim_url, path, &sim_body).await;
        let cached = |r: &Value| r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        let prompt = |r: &Value| r["usage"]["prompt_tokens"].as_u64();
        report.push((path, prompt(&v), prompt(&s), cached(&v), cached(&s)));
    }
    let vllm_blocks = drain(&mut vllm_sub).await;
    let sim_blocks = drain(&mut sim_sub).await;
    for r in &report {
        eprintln!(
            "{:<22} prompt vllm={:?} sim={:?}  cached vllm={:?} sim={:?}",
            r.0, r.1, r.2, r.3, r.4
        );
    }
    eprintln!(
        "stored blocks: vllm={} sim={}",
        vllm_blocks.len(),
        sim_blocks.len()
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
    for (path, vp, sp, vc, sc) in &report {
        assert_eq!(vp, sp, "{path}: prompt tokens differ");
        assert_eq!(vc, sc, "{path}: cached tokens differ");
    }
    assert_eq!(
        vllm_blocks.len(),
        sim_blocks.len(),
        "number of stored blocks"
    );
    for (i, (v, s)) in vllm_blocks.iter().zip(&sim_blocks).enumerate() {
        assert_eq!(v, s, "stored block {i} differs");
    }
}
