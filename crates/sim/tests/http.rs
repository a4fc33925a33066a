//! kvroute-sim over real HTTP and a real ZMQ socket.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_protocol::kv_events::{decode_batch, decode_seq, KvEvent};
use kvroute_sim::{SimArgs, SimServer};
use kvroute_tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv};

struct Sim {
    url: String,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Sim {
    async fn start(extra: &[&str]) -> Sim {
        let mut argv = vec!["kvroute-sim", "--speedup", "1000"];
        argv.extend_from_slice(extra);
        let args = <SimArgs as clap::Parser>::parse_from(argv);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let shutdown = CancellationToken::new();
        let server = SimServer::new(args, Arc::new(Tokenizer::fallback()));
        let task = tokio::spawn(server.serve(listener, shutdown.clone()));
        Sim {
            url,
            shutdown,
            task,
        }
    }

    /// Starts a sim publishing KV events on a free port, retrying when another test took the
    /// port between picking and binding (the sim binds it itself). Ready when it answers.
    async fn start_publishing(extra: &[&str]) -> (Sim, String) {
        for _ in 0..20 {
            let endpoint = format!("tcp://127.0.0.1:{}", free_port());
            let mut argv = vec!["--kv-events-endpoint", endpoint.as_str()];
            argv.extend_from_slice(extra);
            let sim = Sim::start(&argv).await;
            loop {
                if sim.task.is_finished() {
                    break;
                }
                let req = http::Request::get(format!("{}/health", sim.url))
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                if client().request(req).await.is_ok_and(|r| r.status() == 200) {
                    return (sim, endpoint);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        panic!("no sim could bind a KV-event port");
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("stops")
            .unwrap()
            .unwrap();
    }
}

fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

async fn call(url: &str, path: &str, headers: &[(&str, &str)], body: Value) -> (u16, Bytes) {
    let mut req =
        http::Request::post(format!("{url}{path}")).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client()
        .request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

async fn post_json(url: &str, path: &str, body: Value) -> (u16, Value) {
    let (status, bytes) = call(url, path, &[], body).await;
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn get_text(url: &str) -> String {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap()
}

fn metric(text: &str, name: &str, labels: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']) && l.contains(labels)
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

fn prompt_of(len: usize, seed: u8) -> String {
    (0..len)
        .map(|i| (b'a' + ((i * 7 + seed as usize) % 26) as u8) as char)
        .collect()
}

#[tokio::test]
async fn completions_report_cached_tokens_and_exact_lengths() {
    let sim = Sim::start(&[]).await;
    let prompt = prompt_of(100, 1);
    let body = json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 5});
    let (status, first) = post_json(&sim.url, "/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["usage"]["prompt_tokens"], 100);
    assert_eq!(first["usage"]["completion_tokens"], 5);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(first["choices"][0]["text"].as_str().unwrap().len(), 5);
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    let (_, second) = post_json(&sim.url, "/v1/completions", body).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );
    // Without max_tokens: 16, as vLLM's completions.
    let (_, third) = post_json(&sim.url, "/v1/completions", json!({"prompt": "short"})).await;
    assert_eq!(third["usage"]["completion_tokens"], 16);
    // Token-id prompts are taken as they are.
    let (_, ids) = post_json(
        &sim.url,
        "/v1/completions",
        json!({"prompt": [1, 2, 3], "max_tokens": 1}),
    )
    .await;
    assert_eq!(ids["usage"]["prompt_tokens"], 3);

    let m = get_text(&format!("{}/metrics", sim.url)).await;
    let l = r#"engine="0""#;
    assert_eq!(
        metric(&m, "vllm:prefix_cache_queries_total", l),
        Some(208.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "vllm:prefix_cache_hits_total", l),
        Some(96.0),
        "{m}"
    );
    assert_eq!(metric(&m, "vllm:num_requests_running", l), Some(0.0), "{m}");
    assert!(m.contains(r#"vllm:cache_config_info{model_name="kvroute-sim",engine="0",block_size="16",num_gpu_blocks="16384"} 1"#), "{m}");
    assert_eq!(
        metric(&m, "vllm:time_to_first_token_seconds_count", l),
        Some(4.0),
        "{m}"
    );
    assert!(metric(&m, "vllm:inter_token_latency_seconds_count", l).unwrap() > 0.0);
    sim.stop().await;
}

#[tokio::test]
async fn chat_streams_token_by_token_with_usage() {
    let sim = Sim::start(&[]).await;
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": true});
    let (status, bytes) = call(&sim.url, "/v1/chat/completions", &[], body.clone()).await;
    assert_eq!(status, 200);
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 1 + 4 + 1 + 1, "{text}");
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let chunk = |i: usize| -> Value {
        serde_json::from_str(events[i].strip_prefix("data: ").unwrap()).unwrap()
    };
    assert_eq!(chunk(0)["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunk(1)["object"], "chat.completion.chunk");
    assert_eq!(chunk(4)["choices"][0]["finish_reason"], "length");
    assert_eq!(chunk(3)["choices"][0]["finish_reason"], Value::Null);
    // The fallback chat rendering: "user: hello\nassistant: " is 23 bytes.
    assert_eq!(chunk(5)["usage"]["prompt_tokens"], 23);
    assert_eq!(chunk(5)["usage"]["completion_tokens"], 4);
    let (_, render) = post_json(&sim.url, "/v1/chat/completions/render", body).await;
    assert_eq!(render["token_ids"].as_array().unwrap().len(), 23);
    sim.stop().await;
}

#[tokio::test]
async fn bad_requests_get_vllm_errors() {
    let sim = Sim::start(&["--num-gpu-blocks", "8", "--data-parallel-size", "2"]).await;
    let (status, body) = post_json(
        &sim.url,
        "/v1/completions",
        json!({"model": "other", "prompt": "x"}),
    )
    .await;
    assert_eq!(status, 404);
    assert!(body["error"]["message"].as_str().unwrap().contains("other"));
    let (status, _) = call(&sim.url, "/v1/completions", &[], json!("not an object")).await;
    assert_eq!(status, 400);
    let (status, body) = post_json(
        &sim.url,
        "/v1/completions",
        json!({"prompt": prompt_of(200, 0)}),
    )
    .await;
    assert_eq!(status, 400, "128 tokens of KV cannot hold 200 + 16");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("exceeds"));
    let (status, _) = post_json(&sim.url, "/v1/completions", json!({"prompt": ["a", "b"]})).await;
    assert_eq!(status, 400);
    let (status, _) = call(
        &sim.url,
        "/v1/completions",
        &[("x-data-parallel-rank", "2")],
        json!({"prompt": "x"}),
    )
    .await;
    assert_eq!(status, 400);
    let (status, _) = call(
        &sim.url,
        "/v1/completions",
        &[("x-data-parallel-rank", "1")],
        json!({"prompt": "x", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
    let m = get_text(&format!("{}/metrics", sim.url)).await;
    assert_eq!(
        metric(&m, "vllm:prefix_cache_queries_total", r#"engine="1""#),
        Some(1.0),
        "{m}"
    );
    sim.stop().await;
}

#[tokio::test]
async fn a_dropped_stream_is_aborted_and_frees_its_blocks() {
    let sim = Sim::start(&["--speedup", "1"]).await;
    let body = json!({"prompt": prompt_of(64, 3), "max_tokens": 100000, "stream": true});
    let req = http::Request::post(format!("{}/v1/completions", sim.url))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let mut stream = resp.into_body();
    stream.frame().await.unwrap().unwrap();
    let m = get_text(&format!("{}/metrics", sim.url)).await;
    assert_eq!(
        metric(&m, "vllm:num_requests_running", r#"engine="0""#),
        Some(1.0)
    );
    drop(stream);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let m = get_text(&format!("{}/metrics", sim.url)).await;
        if metric(&m, "vllm:num_requests_running", r#"engine="0""#) == Some(0.0)
            && metric(&m, "vllm:kv_cache_usage_perc", r#"engine="0""#) == Some(0.0)
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the request was not aborted: {m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sim.stop().await;
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn kv_events_arrive_on_a_real_zmq_socket() {
    for format in ["map", "array"] {
        let (sim, endpoint) =
            Sim::start_publishing(&["--kv-events-format", format, "--kv-events-topic", "kv"]).await;
        let mut sub = zeromq::SubSocket::new();
        sub.connect(&endpoint).await.unwrap();
        sub.subscribe("").await.unwrap();
        // A SUB socket joins asynchronously: send probes until one's events arrive.
        let mut probe = 0u8;
        let first = loop {
            post_json(
                &sim.url,
                "/v1/completions",
                json!({"prompt": prompt_of(20, probe), "max_tokens": 1}),
            )
            .await;
            probe += 1;
            assert!(probe < 200, "no KV event arrived");
            if let Ok(msg) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
                break msg.unwrap();
            }
        };
        let frames = first.into_vec();
        assert_eq!(frames.len(), 3);
        assert_eq!(&frames[0][..], b"kv");
        let mut last_seq = decode_seq(&frames[1]).unwrap().unwrap();
        // Drain what the probes left, then a request of 3 full blocks + 2 tokens.
        post_json(&sim.url, "/reset_prefix_cache", json!({})).await;
        let prompt = prompt_of(50, 200);
        post_json(
            &sim.url,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
        let mut cleared = false;
        let stored = loop {
            let msg = tokio::time::timeout(Duration::from_secs(10), sub.recv())
                .await
                .expect("events")
                .unwrap();
            let frames = msg.into_vec();
            let seq = decode_seq(&frames[1]).unwrap().unwrap();
            assert_eq!(seq, last_seq + 1, "sequence numbers increase by one");
            last_seq = seq;
            let batch = decode_batch(&frames[2]).unwrap();
            assert_eq!(batch.dp_rank, Some(0));
            match &batch.events[..] {
                [KvEvent::AllBlocksCleared] => cleared = true,
                [KvEvent::BlockStored(s)] if cleared => break s.clone(),
                _ => {}
            }
        };
        assert_eq!(stored.block_hashes.len(), 3, "{format}");
        assert_eq!(stored.parent_block_hash, None);
        assert_eq!(stored.block_size, 16);
        assert_eq!(stored.medium.as_deref(), Some("GPU"));
        let expected: Vec<u32> = prompt.bytes().take(48).map(u32::from).collect();
        assert_eq!(stored.token_ids, expected);
        // A longer prompt sharing the prefix stores one more block, chained to the third.
        let longer = format!("{}{}", &prompt[..48], prompt_of(20, 9));
        post_json(
            &sim.url,
            "/v1/completions",
            json!({"prompt": longer, "max_tokens": 1}),
        )
        .await;
        let msg = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .expect("events")
            .unwrap();
        let batch = decode_batch(&msg.into_vec()[2]).unwrap();
        match &batch.events[..] {
            [KvEvent::BlockStored(s)] => {
                assert_eq!(s.block_hashes.len(), 1);
                assert_eq!(s.parent_block_hash.as_ref(), Some(&stored.block_hashes[2]));
            }
            other => panic!("{other:?}"),
        }
        sim.stop().await;
    }
}
