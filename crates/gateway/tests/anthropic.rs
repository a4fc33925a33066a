//! Anthropic's Messages API end to end, with the `anthropic` SDK (PyPI) as the client
//! (`support/anthropic_client.py`), kvroute in front of kvroute-sim engines: every policy,
//! streaming and not, count_tokens, a conversation that stays where its prefix is cached, a
//! malformed body, and the client key sent as `x-api-key`.

mod support;

use std::sync::Arc;

use kvroute_core::PolicyKind;
use kvroute_tokenizer::{ChatOptions, Tokenizer};
use serde_json::{json, Value};
use support::*;
use tokio_util::sync::CancellationToken;

/// Runs one scenario of the SDK client against `url`: what it printed.
async fn sdk(url: &str, scenario: &str, key: Option<&str>) -> Value {
    let mut args = vec![
        url.to_owned(),
        "kvroute-sim".to_owned(),
        scenario.to_owned(),
    ];
    args.extend(key.map(str::to_owned));
    python_json(
        "anthropic_client.py",
        args,
        "the anthropic SDK (pip install anthropic)",
    )
    .await
}

fn tiny() -> Arc<Tokenizer> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/tiny-llama");
    Arc::new(Tokenizer::load(std::path::Path::new(dir)).unwrap())
}

async fn sims(n: usize, tokenizer: &Arc<Tokenizer>, shutdown: &CancellationToken) -> Vec<String> {
    let mut urls = Vec::new();
    for _ in 0..n {
        urls.push(serve_sim_with(&["--speedup", "100"], tokenizer.clone(), shutdown).await);
    }
    urls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_works_through_every_policy_whole_and_streamed() {
    let tokenizer = Arc::new(Tokenizer::fallback());
    let shutdown = CancellationToken::new();
    let urls = sims(2, &tokenizer, &shutdown).await;
    for policy in PolicyKind::ALL {
        if policy == PolicyKind::Manual {
            continue; // routes only with a routing key; covered by the hints tests
        }
        let router = TestRouter::start(sim_settings(&urls, policy)).await;
        let out = sdk(&router.url, "basic", None).await;
        let m = &out["message"];
        assert_eq!(m["type"], "message", "{policy}: {out}");
        assert_eq!(m["role"], "assistant");
        assert_eq!(m["stop_reason"], "max_tokens");
        assert!(m["id"].as_str().unwrap().starts_with("msg"));
        assert_eq!(m["usage"]["output_tokens"], 6);
        let u = &m["usage"];
        assert!(u["input_tokens"].as_u64().unwrap() > 0, "{policy}: {u}");
        assert_eq!(u["cache_creation_input_tokens"], 0);
        let s = &out["stream"];
        assert!(!s["text"].as_str().unwrap().is_empty(), "{policy}: {s}");
        assert_eq!(s["text"], s["final_text"]);
        assert_eq!(s["stop_reason"], "max_tokens");
        assert_eq!(s["usage"]["output_tokens"], 5);
        let events: Vec<&str> = s["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap())
            .collect();
        assert_eq!(events.first(), Some(&"message_start"), "{events:?}");
        assert_eq!(events.last(), Some(&"message_stop"), "{events:?}");
        for kind in [
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
        ] {
            assert!(events.contains(&kind), "{policy}: {events:?}");
        }
        assert_eq!(
            events
                .iter()
                .filter(|e| **e == "content_block_delta")
                .count(),
            5
        );
        // count_tokens counts what the message was billed: the same prompt, less the system
        // prompt the message had.
        assert!(out["count"].as_u64().unwrap() > 0);
        router.stop().await;
    }
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_stays_on_its_worker_with_its_prefix_cached_and_ids_as_the_chat_routes() {
    let tokenizer = tiny();
    let shutdown = CancellationToken::new();
    let urls = sims(3, &tokenizer, &shutdown).await;
    let router =
        TestRouter::start_with(sim_settings(&urls, PolicyKind::KvAware), tokenizer.clone()).await;
    let out = sdk(&router.url, "conversation", None).await;
    let turns = out["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 4);
    let first = turns[0]["worker"].as_str().unwrap();
    for (i, t) in turns.iter().enumerate() {
        assert_eq!(t["worker"], first, "turn {i} moved: {out}");
        let cached = t["usage"]["cache_read_input_tokens"].as_u64().unwrap();
        if i > 0 {
            assert!(cached > 0, "turn {i} found nothing cached: {out}");
        }
    }
    // The router routed on as many tokens as the engine was billed for, turn by turn.
    let billed: u64 = turns
        .iter()
        .map(|t| {
            t["usage"]["input_tokens"].as_u64().unwrap()
                + t["usage"]["cache_read_input_tokens"].as_u64().unwrap()
        })
        .sum();
    let m = router.metrics().await;
    assert_eq!(
        metric_sum(&m, "kvroute_worker_prompt_tokens_total", ""),
        billed as f64
    );
    router.stop().await;

    // The same conversation on the chat route gives the same ids: the engine's
    // count_tokens against the tokenizer's own chat rendering of vLLM's conversion.
    let messages = json!([
        {"role": "user", "content": "What does this do?"},
        {"role": "assistant", "content": [{"type": "text", "text": "It loops."}]},
        {"role": "user", "content": [{"type": "text", "text": "And then?"}]},
    ]);
    let body = json!({"model": "kvroute-sim", "system": "Be exact.", "messages": messages});
    let counted = post(
        &urls[0],
        "/v1/messages/count_tokens",
        &[],
        &body.to_string(),
    )
    .await;
    assert_eq!(counted.status, 200, "{:?}", counted.body);
    let chat = json!([
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "What does this do?"},
        {"role": "assistant", "content": "It loops."},
        {"role": "user", "content": "And then?"},
    ]);
    let opts = ChatOptions {
        add_generation_prompt: true,
        ..ChatOptions::default()
    };
    let ids = tokenizer.encode_chat(&chat, &opts).unwrap();
    assert_eq!(counted.json()["input_tokens"], ids.len());
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_body_is_a_clear_anthropic_400_and_x_api_key_is_the_client_key() {
    let tokenizer = Arc::new(Tokenizer::fallback());
    let shutdown = CancellationToken::new();
    let urls = sims(1, &tokenizer, &shutdown).await;
    let mut settings = sim_settings(&urls, PolicyKind::KvAware);
    settings.client_api_key = kvroute_gateway::auth::Secret::new("sk-client".into());
    let router = TestRouter::start(settings).await;

    let out = sdk(&router.url, "malformed", Some("sk-client")).await;
    let e = &out["error"];
    assert_eq!(e["status"], 400, "{out}");
    assert_eq!(e["class"], "BadRequestError");
    assert_eq!(e["body"]["type"], "error");
    assert_eq!(e["body"]["error"]["type"], "invalid_request_error");
    assert!(
        e["body"]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("messages: must be a list"),
        "{out}"
    );

    let ok = sdk(&router.url, "auth", Some("sk-client")).await;
    assert_eq!(ok["ok"], "message", "{ok}");
    let refused = sdk(&router.url, "auth", Some("sk-wrong")).await;
    let e = &refused["error"];
    assert_eq!(e["status"], 401, "{refused}");
    assert_eq!(e["class"], "AuthenticationError");
    assert_eq!(e["body"]["error"]["type"], "authentication_error");
    router.stop().await;
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_dying_mid_stream_ends_the_stream_with_an_anthropic_error_event() {
    // One event in a chunked body, then the connection closes mid-body.
    const CUT: &str = concat!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
        "24\r\nevent: ping\ndata: {\"type\": \"ping\"}\n\n\r\n",
    );
    let engine = scripted(CUT).await;
    let router = TestRouter::start(sim_settings(&[engine], PolicyKind::RoundRobin)).await;
    let body = json!({"model": "kvroute-sim", "max_tokens": 4, "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]});
    let r = post(&router.url, "/v1/messages", &[], &body.to_string()).await;
    assert_eq!(r.status, 200);
    let text = String::from_utf8_lossy(&r.body);
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let (event, data) = last
        .split_once('\n')
        .expect("an event line and a data line");
    assert_eq!(event, "event: error", "{text}");
    let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(data["type"], "error");
    assert_eq!(data["error"]["type"], "api_error");
    assert!(data["error"]["message"]
        .as_str()
        .unwrap()
        .contains("failed mid-stream"));
    router.stop().await;
}
