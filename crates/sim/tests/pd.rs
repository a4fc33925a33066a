//! Prefill/decode disaggregation over real HTTP and ZMQ sockets: prefill engines answer
//! vLLM's `kv_transfer_params` and serve bootstrap rooms, decode engines receive the KV
//! instead of computing it, and both publish their KV events.
//!
//! No assertion depends on timing: work is told apart by counters (tokens computed,
//! transfers received), and waits poll a condition until a generous deadline.

mod support;

use kvroute_protocol::kv_events::{decode_batch, BlockHashValue, KvEvent};
use serde_json::{json, Value};
use support::{
    completion, free_port, metric, metrics, post_json, post_raw, post_waiting_for_room, prompt_of,
    start_binding, subscribe, waiting_for_rooms, PATIENCE,
};
use tokio::time::timeout;
use zeromq::SocketRecv;

/// What a request produced: its text and its usage, streamed or not.
#[derive(Debug)]
struct Answer {
    body: Value,
    text: String,
    usage: Value,
}

async fn generate(url: &str, path: &str, body: &Value) -> Answer {
    let (status, raw) = post_raw(url, path, body).await;
    answer(body, status, &raw)
}

/// The answer to `body` (streamed or not, as it asked), which must have succeeded.
fn answer(body: &Value, status: u16, raw: &str) -> Answer {
    assert_eq!(status, 200, "{raw}");
    if body["stream"] != true {
        let body: Value = serde_json::from_str(raw).unwrap();
        let choice = &body["choices"][0];
        let text = choice["text"]
            .as_str()
            .or(choice["message"]["content"].as_str())
            .unwrap()
            .to_owned();
        let usage = body["usage"].clone();
        return Answer { body, text, usage };
    }
    let mut text = String::new();
    let mut usage = Value::Null;
    let mut done = false;
    for event in raw.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").unwrap();
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        if let Some(choice) = chunk["choices"].get(0) {
            let piece = choice["text"]
                .as_str()
                .or(choice["delta"]["content"].as_str());
            text.push_str(piece.unwrap_or_default());
        }
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
    }
    assert!(done, "{raw}");
    Answer {
        body: Value::Null,
        text,
        usage,
    }
}

async fn transfers(url: &str, direction: &str) -> (f64, f64) {
    let m = metrics(url).await;
    let d = format!(r#"direction="{direction}""#);
    (
        metric(&m, "kvroute_sim_kv_transfers_total", &[&d]),
        metric(&m, "kvroute_sim_kv_transfer_tokens_total", &[&d]),
    )
}

async fn computed(url: &str) -> f64 {
    metric(
        &metrics(url).await,
        "kvroute_sim_prefill_tokens_computed_total",
        &[r#"engine="0""#],
    )
}

fn chat(content: &str, max_tokens: usize, stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": stream})
}

/// What a vLLM P/D router sends the prefill engine: one token, not streamed, a remote decode.
fn for_prefill(original: &Value) -> Value {
    let mut body = original.clone();
    body["max_tokens"] = json!(1);
    body["stream"] = json!(false);
    body["kv_transfer_params"] = json!({"do_remote_decode": true});
    body
}

#[tokio::test]
async fn a_prefill_engine_answers_kv_transfer_params_naming_its_blocks() {
    let (prefill, _) =
        start_binding(&["--role", "prefill", "--instance-id", "p1"], false, false).await;
    let url = prefill.url();
    let original = completion(&prompt_of(100, 1), 16, true);
    let first = generate(&url, "/v1/completions", &for_prefill(&original)).await;
    assert_eq!(first.usage["completion_tokens"], 1);
    let params = &first.body["kv_transfer_params"];
    assert_eq!(params["do_remote_prefill"], true, "{params}");
    assert_eq!(params["do_remote_decode"], false);
    // 100 tokens in blocks of 16: 7 blocks.
    let blocks = params["remote_block_ids"].as_array().unwrap();
    assert_eq!(blocks.len(), 7, "{params}");
    assert!(blocks.iter().all(Value::is_u64));
    assert_eq!(params["remote_engine_id"], "p1_dp0");
    assert_eq!(params["remote_request_id"], first.body["id"]);
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], prefill.addr().port());
    assert_eq!(params["tp_size"], 1);
    assert_eq!(params["remote_prefill_cached_tokens"], 0);
    // The same prompt again: its full blocks come from the prefix cache, and say so.
    let again = generate(&url, "/v1/completions", &for_prefill(&original)).await;
    assert_eq!(
        again.body["kv_transfer_params"]["remote_prefill_cached_tokens"],
        96
    );
    assert_eq!(again.usage["prompt_tokens_details"]["cached_tokens"], 96);
    // Chats too.
    let c = generate(
        &url,
        "/v1/chat/completions",
        &for_prefill(&chat("hello", 8, false)),
    )
    .await;
    assert_eq!(c.body["kv_transfer_params"]["do_remote_prefill"], true);
    // A request without the field is served as by any engine, without params.
    let plain = generate(
        &url,
        "/v1/completions",
        &completion(&prompt_of(40, 2), 5, false),
    )
    .await;
    assert_eq!(plain.usage["completion_tokens"], 5);
    assert!(
        plain.body.get("kv_transfer_params").is_none(),
        "{}",
        plain.body
    );
    assert_eq!(transfers(&url, "sent").await, (3.0, 223.0));
    assert_eq!(transfers(&url, "received").await, (0.0, 0.0));
    let m = metrics(&url).await;
    assert_eq!(
        metric(&m, "kvroute_sim_role_info", &[r#"role="prefill""#]),
        1.0
    );
    assert_eq!(metric(&m, "vllm:prefix_cache_hits_total", &[]), 96.0);
    prefill.stop().await.unwrap();
}

#[tokio::test]
async fn a_decode_engine_given_kv_transfer_params_receives_instead_of_computing() {
    let (prefill, _) = start_binding(&["--role", "prefill"], false, false).await;
    let (decode, _) = start_binding(&["--role", "decode"], false, false).await;
    let cases = [
        ("/v1/completions", completion(&prompt_of(100, 3), 5, false)),
        ("/v1/completions", completion(&prompt_of(100, 4), 5, true)),
        ("/v1/chat/completions", chat(&prompt_of(60, 5), 5, false)),
        ("/v1/chat/completions", chat(&prompt_of(60, 6), 5, true)),
    ];
    for (i, (path, original)) in cases.iter().enumerate() {
        let p = generate(&prefill.url(), path, &for_prefill(original)).await;
        let mut body = original.clone();
        body["kv_transfer_params"] = p.body["kv_transfer_params"].clone();
        let d = generate(&decode.url(), path, &body).await;
        assert_eq!(d.usage["completion_tokens"], 5, "{path} {body}");
        assert_eq!(d.text.len(), 5, "{d:?}");
        assert_eq!(d.usage["prompt_tokens"], p.usage["prompt_tokens"]);
        // The prefill engine's cache hit (none: fresh prompts), as vLLM 0.31 reports it.
        assert_eq!(d.usage["prompt_tokens_details"]["cached_tokens"], 0);
        assert!(d.body.get("kv_transfer_params").is_none());
        assert_eq!(transfers(&decode.url(), "received").await.0, (i + 1) as f64);
    }
    assert_eq!(computed(&decode.url()).await, 0.0, "no prompt computed");
    assert!(computed(&prefill.url()).await > 0.0);
    // Without remote_prefill_cached_tokens, the whole prompt counts as cached (earlier vLLM).
    let original = completion(&prompt_of(50, 7), 3, false);
    let mut body = original.clone();
    body["kv_transfer_params"] =
        json!({"do_remote_prefill": true, "remote_block_ids": [1, 2, 3, 4]});
    let d = generate(&decode.url(), "/v1/completions", &body).await;
    assert_eq!(d.usage["prompt_tokens_details"]["cached_tokens"], 50);
    assert_eq!(computed(&decode.url()).await, 0.0);
    // The prompt's blocks are now in the decode engine's cache: the same prompt computes
    // nothing but its last token, and a transfer of it carries nothing already there.
    let again = generate(&decode.url(), "/v1/completions", &original).await;
    assert_eq!(again.usage["prompt_tokens_details"]["cached_tokens"], 48);
    assert_eq!(computed(&decode.url()).await, 2.0);
    // A request without transfer params is computed where it lands (decode-only path).
    let local = generate(
        &decode.url(),
        "/v1/completions",
        &completion(&prompt_of(40, 8), 4, true),
    )
    .await;
    assert_eq!(local.usage["completion_tokens"], 4);
    assert_eq!(computed(&decode.url()).await, 42.0);
    let received = transfers(&decode.url(), "received").await;
    assert_eq!(received.0, 5.0);
    let m = metrics(&decode.url()).await;
    assert_eq!(
        metric(&m, "kvroute_sim_role_info", &[r#"role="decode""#]),
        1.0
    );
    assert_eq!(metric(&m, "vllm:num_requests_running", &[]), 0.0);
    assert_eq!(
        metric(&m, "vllm:time_to_first_token_seconds_count", &[]),
        7.0
    );
    prefill.stop().await.unwrap();
    decode.stop().await.unwrap();
}

/// The body an SGLang P/D router sends both engines.
fn with_room(original: &Value, port: u16, room: u64) -> Value {
    let mut body = original.clone();
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = json!(port);
    body["bootstrap_room"] = json!(room);
    body
}

#[tokio::test]
async fn bootstrap_rooms_make_the_decode_engine_wait_for_the_prefill() {
    let (prefill, _) = start_binding(&["--role", "prefill"], false, true).await;
    let port = prefill.args().bootstrap_port.unwrap();
    let (decode, _) = start_binding(&["--role", "decode"], false, false).await;
    let original = completion(&prompt_of(100, 9), 6, true);
    for (round, room) in [(0, 11u64), (1, 12)] {
        let body = with_room(&original, port, room);
        // The router sends both at once; here the decode engine is asked first, and the
        // prefill is held back until the decode engine waits for the room.
        let d =
            post_waiting_for_room(&decode.url(), "/v1/completions", &body, &prefill.url()).await;
        let p = generate(&prefill.url(), "/v1/completions", &body).await;
        let (status, raw) = timeout(PATIENCE, d)
            .await
            .expect("the decode ends")
            .unwrap();
        let d = answer(&body, status, &raw);
        assert_eq!(waiting_for_rooms(&prefill.url()).await, 0.0);
        assert_eq!(
            p.usage["completion_tokens"], 1,
            "SGLang's prefill answers one token"
        );
        assert_eq!(d.usage["completion_tokens"], 6);
        // The prefill engine's cache hit, told through the room: 96 the second time.
        let hit = if round == 0 { 0 } else { 96 };
        assert_eq!(p.usage["prompt_tokens_details"]["cached_tokens"], hit);
        assert_eq!(d.usage["prompt_tokens_details"]["cached_tokens"], hit);
    }
    assert_eq!(transfers(&prefill.url(), "sent").await, (2.0, 200.0));
    // The second transfer carried only what the decode engine's cache lacked.
    assert_eq!(transfers(&decode.url(), "received").await, (2.0, 104.0));
    assert_eq!(computed(&decode.url()).await, 0.0);

    // A prefill that fails fails its decode: the prefill engine cannot hold this prompt.
    let (small, _) =
        start_binding(&["--role", "prefill", "--num-gpu-blocks", "8"], false, true).await;
    let small_port = small.args().bootstrap_port.unwrap();
    let body = with_room(&completion(&prompt_of(300, 10), 4, false), small_port, 13);
    let d = post_waiting_for_room(&decode.url(), "/v1/completions", &body, &small.url()).await;
    let (status, _) = post_json(&small.url(), "/v1/completions", &body).await;
    assert_eq!(status, 400);
    let (status, raw) = timeout(PATIENCE, d).await.unwrap().unwrap();
    assert_eq!(status, 503, "{raw}");
    let error: Value = serde_json::from_str(&raw).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("room 13"),
        "{error}"
    );

    // No bootstrap server at the port: the decode engine does not wait.
    let nobody = free_port();
    let body = with_room(&completion(&prompt_of(80, 11), 3, false), nobody, 14);
    let d = generate(&decode.url(), "/v1/completions", &body).await;
    assert_eq!(d.usage["completion_tokens"], 3);
    assert_eq!(transfers(&decode.url(), "received").await.0, 3.0);
    assert_eq!(computed(&decode.url()).await, 0.0);
    small.stop().await.unwrap();
    prefill.stop().await.unwrap();
    decode.stop().await.unwrap();
}

#[tokio::test]
async fn an_aggregated_engine_ignores_disaggregation_fields() {
    let (both, _) = start_binding(&[], false, false).await;
    let url = both.url();
    let p = generate(
        &url,
        "/v1/completions",
        &for_prefill(&completion(&prompt_of(40, 12), 4, false)),
    )
    .await;
    assert!(p.body.get("kv_transfer_params").is_none());
    let mut body = completion(&prompt_of(40, 13), 4, false);
    body["kv_transfer_params"] = json!({"do_remote_prefill": true});
    generate(&url, "/v1/completions", &body).await;
    let d = generate(&url, "/v1/completions", &with_room(&body, free_port(), 1)).await;
    assert_eq!(d.usage["completion_tokens"], 4);
    // The third prompt is the second's: 2 of its blocks were cached.
    assert_eq!(computed(&url).await, 40.0 + 40.0 + 8.0);
    assert_eq!(transfers(&url, "received").await.0, 0.0);
    assert_eq!(transfers(&url, "sent").await.0, 0.0);
    assert_eq!(
        metric(
            &metrics(&url).await,
            "kvroute_sim_role_info",
            &[r#"role="both""#]
        ),
        1.0
    );
    both.stop().await.unwrap();
}

/// Reads messages until one stores blocks whose first 16 tokens are `first_block`; returns
/// every block hash stored from there until `count` blocks are seen.
async fn stored_from(
    sub: &mut zeromq::SubSocket,
    first_block: &[u32],
    count: usize,
) -> Vec<BlockHashValue> {
    let mut hashes: Vec<BlockHashValue> = Vec::new();
    while hashes.len() < count {
        let msg = timeout(PATIENCE, sub.recv())
            .await
            .expect("events")
            .unwrap();
        let batch = decode_batch(&msg.into_vec()[2]).unwrap();
        for event in batch.events {
            if let KvEvent::BlockStored(s) = event {
                if !hashes.is_empty() || s.token_ids.get(..16) == Some(first_block) {
                    hashes.extend(s.block_hashes);
                }
            }
        }
    }
    hashes
}

#[tokio::test]
async fn prefill_and_decode_engines_each_publish_the_blocks_they_hold() {
    let (prefill, p_events) = start_binding(&["--role", "prefill"], true, false).await;
    let (decode, d_events) = start_binding(&["--role", "decode"], true, false).await;
    let mut p_sub = subscribe(&p_events.unwrap(), &prefill.url(), 1000).await;
    let mut d_sub = subscribe(&d_events.unwrap(), &decode.url(), 2000).await;
    let prompt = prompt_of(100, 14);
    let original = completion(&prompt, 4, false);
    let p = generate(&prefill.url(), "/v1/completions", &for_prefill(&original)).await;
    let mut body = original.clone();
    body["kv_transfer_params"] = p.body["kv_transfer_params"].clone();
    generate(&decode.url(), "/v1/completions", &body).await;
    // Both hold the prompt's 6 full blocks, under the same hashes.
    let first: Vec<u32> = prompt.bytes().take(16).map(u32::from).collect();
    let on_prefill = stored_from(&mut p_sub, &first, 6).await;
    let on_decode = stored_from(&mut d_sub, &first, 6).await;
    assert_eq!(on_prefill.len(), 6);
    assert_eq!(on_prefill, on_decode);
    assert_eq!(transfers(&decode.url(), "received").await, (1.0, 100.0));
    prefill.stop().await.unwrap();
    decode.stop().await.unwrap();
}
