//! kvroute-sim over real HTTP and a real ZMQ socket.

mod support;

use http_body_util::BodyExt;
use kvroute_protocol::kv_events::{decode_batch, decode_seq, KvEvent};
use serde_json::{json, Value};
use support::{
    client, metric, metrics, post, post_json, post_raw, post_with, prompt_of, start,
    start_publishing, subscribe, wait_until, PATIENCE,
};
use tokio::time::timeout;
use zeromq::SocketRecv;

#[tokio::test]
async fn completions_report_cached_tokens_and_exact_lengths() {
    let sim = start(&[]).await;
    let url = sim.url();
    let prompt = prompt_of(100, 1);
    let body = json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 5});
    let (status, first) = post_json(&url, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["usage"]["prompt_tokens"], 100);
    assert_eq!(first["usage"]["completion_tokens"], 5);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(first["choices"][0]["text"].as_str().unwrap().len(), 5);
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    let (_, second) = post_json(&url, "/v1/completions", &body).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );
    // Without max_tokens: 16, as vLLM's completions.
    let (_, third) = post_json(&url, "/v1/completions", &json!({"prompt": "short"})).await;
    assert_eq!(third["usage"]["completion_tokens"], 16);
    // Token-id prompts are taken as they are.
    let (_, ids) = post_json(
        &url,
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 1}),
    )
    .await;
    assert_eq!(ids["usage"]["prompt_tokens"], 3);

    let m = metrics(&url).await;
    let l = &[r#"engine="0""#];
    assert_eq!(metric(&m, "vllm:prefix_cache_queries_total", l), 208.0);
    assert_eq!(metric(&m, "vllm:prefix_cache_hits_total", l), 96.0);
    assert_eq!(metric(&m, "vllm:num_requests_running", l), 0.0);
    assert!(m.contains(r#"vllm:cache_config_info{model_name="kvroute-sim",engine="0",block_size="16",num_gpu_blocks="16384"} 1"#), "{m}");
    assert_eq!(metric(&m, "vllm:time_to_first_token_seconds_count", l), 4.0);
    assert!(metric(&m, "vllm:inter_token_latency_seconds_count", l) > 0.0);
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn chat_streams_token_by_token_with_usage() {
    let sim = start(&[]).await;
    let url = sim.url();
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": true});
    let (status, text) = post_raw(&url, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
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
    let (_, render) = post_json(&url, "/v1/chat/completions/render", &body).await;
    assert_eq!(render["token_ids"].as_array().unwrap().len(), 23);
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn bad_requests_get_vllm_errors() {
    let sim = start(&["--num-gpu-blocks", "8", "--data-parallel-size", "2"]).await;
    let url = sim.url();
    let (status, body) = post_json(
        &url,
        "/v1/completions",
        &json!({"model": "other", "prompt": "x"}),
    )
    .await;
    assert_eq!(status, 404);
    assert!(body["error"]["message"].as_str().unwrap().contains("other"));
    let (status, _) = post_raw(&url, "/v1/completions", &json!("not an object")).await;
    assert_eq!(status, 400);
    let (status, body) = post_json(
        &url,
        "/v1/completions",
        &json!({"prompt": prompt_of(200, 0)}),
    )
    .await;
    assert_eq!(status, 400, "128 tokens of KV cannot hold 200 + 16");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("exceeds"));
    let (status, _) = post_json(&url, "/v1/completions", &json!({"prompt": ["a", "b"]})).await;
    assert_eq!(status, 400);
    let (status, _) = post_with(
        &url,
        "/v1/completions",
        &[("x-data-parallel-rank", "2")],
        &json!({"prompt": "x"}),
    )
    .await;
    assert_eq!(status, 400);
    let (status, _) = post_with(
        &url,
        "/v1/completions",
        &[("x-data-parallel-rank", "1")],
        &json!({"prompt": "x", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
    let m = metrics(&url).await;
    assert_eq!(
        metric(&m, "vllm:prefix_cache_queries_total", &[r#"engine="1""#]),
        1.0
    );
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn a_dropped_stream_is_aborted_and_frees_its_blocks() {
    let sim = start(&["--speedup", "1"]).await;
    let url = sim.url();
    let body = json!({"prompt": prompt_of(64, 3), "max_tokens": 100000, "stream": true});
    let resp = timeout(
        PATIENCE,
        client().request(post(&url, "/v1/completions", &body)),
    )
    .await
    .expect("an answer")
    .unwrap();
    let mut stream = resp.into_body();
    timeout(PATIENCE, stream.frame())
        .await
        .expect("a first token")
        .unwrap()
        .unwrap();
    let l = &[r#"engine="0""#];
    let m = metrics(&url).await;
    assert_eq!(metric(&m, "vllm:num_requests_running", l), 1.0);
    drop(stream);
    wait_until("the request is aborted and its blocks freed", || async {
        let m = metrics(&url).await;
        metric(&m, "vllm:num_requests_running", l) == 0.0
            && metric(&m, "vllm:kv_cache_usage_perc", l) == 0.0
    })
    .await;
    sim.stop().await.unwrap();
}

#[tokio::test]
async fn kv_events_arrive_on_a_real_zmq_socket() {
    for format in ["map", "array"] {
        let (sim, endpoint) =
            start_publishing(&["--kv-events-format", format, "--kv-events-topic", "kv"]).await;
        let url = sim.url();
        let mut sub = subscribe(&endpoint, &url, 0).await;
        // Drain what the probes left, then a request of 3 full blocks + 2 tokens.
        post_json(&url, "/reset_prefix_cache", &json!({})).await;
        let prompt = prompt_of(50, 200);
        post_json(
            &url,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
        let mut last_seq = None;
        let mut cleared = false;
        let stored = loop {
            let msg = timeout(PATIENCE, sub.recv())
                .await
                .expect("events")
                .unwrap();
            let frames = msg.into_vec();
            assert_eq!(frames.len(), 3);
            assert_eq!(&frames[0][..], b"kv");
            let seq = decode_seq(&frames[1]).unwrap().unwrap();
            if let Some(last) = last_seq {
                assert_eq!(seq, last + 1, "sequence numbers increase by one");
            }
            last_seq = Some(seq);
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
            &url,
            "/v1/completions",
            &json!({"prompt": longer, "max_tokens": 1}),
        )
        .await;
        let msg = timeout(PATIENCE, sub.recv())
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
        sim.stop().await.unwrap();
    }
}
