//! The tokenizer prefix cache end to end: a router with the tiny tokenizer in front of a
//! kvroute-sim that tokenises with it too. A conversation growing turn by turn is routed on
//! ids equal to the engine's own count, and the cache's counters say what happened.

mod support;

use std::sync::Arc;

use kvroute_tokenizer::{ChatOptions, Tokenizer};
use serde_json::{json, Value};
use support::*;
use tokio_util::sync::CancellationToken;

fn tiny() -> Arc<Tokenizer> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/tiny-llama");
    Arc::new(Tokenizer::load(std::path::Path::new(dir)).unwrap())
}

fn turn(i: usize) -> Value {
    let role = if i.is_multiple_of(2) {
        "user"
    } else {
        "assistant"
    };
    let code = format!("```\nfn step{i}() {{\n    println!(\"{i}\");\n}}\n```\n");
    json!({"role": role, "content": format!("Turn {i}.\n{code}{}", "Words, and more words.\n".repeat(12))})
}

fn chat(turns: usize) -> Value {
    json!({"model": "kvroute-sim", "max_tokens": 2, "messages": (0..turns).map(turn).collect::<Vec<_>>()})
}

/// The ids the engine's tokenizer gives, without any cache.
fn fresh_len(tokenizer: &Tokenizer, body: &Value) -> usize {
    let opts = ChatOptions {
        add_generation_prompt: true,
        ..ChatOptions::default()
    };
    tokenizer
        .encode_chat(&body["messages"], &opts)
        .unwrap()
        .len()
}

async fn counts(router: &TestRouter) -> (f64, f64) {
    let m = router.metrics().await;
    (
        metric_sum(&m, "kvroute_tokenizer_cache_hits_total", ""),
        metric_sum(&m, "kvroute_tokenizer_cache_misses_total", ""),
    )
}

async fn start(cache_bytes: usize) -> (TestRouter, CancellationToken) {
    let tokenizer = tiny();
    let shutdown = CancellationToken::new();
    let engine = serve_sim_with(&["--speedup", "1000"], tokenizer.clone(), &shutdown).await;
    let mut settings =
        kvroute_gateway::Settings::with_workers(vec![named_spec("sim", "kvroute-sim", engine)])
            .unwrap();
    settings.tokenizer_cache_bytes = cache_bytes;
    (TestRouter::start_with(settings, tokenizer).await, shutdown)
}

#[tokio::test]
async fn a_growing_conversation_is_routed_on_the_engines_ids_through_the_cache() {
    let tokenizer = tiny();
    let (router, shutdown) = start(1 << 20).await;
    for turns in 1..=5 {
        let body = chat(turns);
        let reply = router
            .post("/v1/chat/completions", &[], &body.to_string())
            .await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let expected = fresh_len(&tokenizer, &body);
        assert_eq!(
            reply.json()["usage"]["prompt_tokens"],
            expected,
            "turn {turns}"
        );
        // The debug answer is the same decision, on the same ids, and fills the cache too.
        let debug = router.post("/debug/route", &[], &body.to_string()).await;
        assert_eq!(debug.json()["prompt_tokens"], expected, "turn {turns}");
    }
    // The first chat, under MIN_CACHED_BYTES, is tokenised whole; the second missed; each
    // later request (and each debug call) went on from a prefix.
    assert!(chat(1).to_string().len() < kvroute_tokenizer::MIN_CACHED_BYTES);
    assert_eq!(counts(&router).await, (7.0, 1.0));
    let bytes = metric_sum(&router.metrics().await, "kvroute_tokenizer_cache_bytes", "");
    assert!(bytes > 0.0 && bytes <= (1 << 20) as f64, "{bytes}");
    router.stop().await;
    shutdown.cancel();
}

#[tokio::test]
async fn a_cache_of_zero_bytes_is_off() {
    let tokenizer = tiny();
    let (router, shutdown) = start(0).await;
    for turns in 1..=3 {
        let body = chat(turns);
        let debug = router.post("/debug/route", &[], &body.to_string()).await;
        assert_eq!(debug.json()["prompt_tokens"], fresh_len(&tokenizer, &body));
    }
    assert_eq!(counts(&router).await, (0.0, 0.0));
    router.stop().await;
    shutdown.cancel();
}
