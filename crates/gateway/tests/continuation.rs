//! A migrated chat's continuation (the messages, then an assistant message holding the text
//! so far, with `continue_final_message: true` and `add_generation_prompt: false`, vLLM's
//! parameters) is tokenised alike by the router and by kvroute-sim, with the fallback
//! tokenizer and with a real one (testdata/tiny-llama): the ids the router routes on are the
//! ids the engine caches.

mod support;

use std::path::Path;
use std::sync::Arc;

use kvroute_gateway::prompts::Prompts;
use kvroute_gateway::{routing, Settings};
use kvroute_protocol::RoutingFields;
use kvroute_tokenizer::Tokenizer;
use prometheus_client::registry::Registry;
use serde_json::{json, Value};
use support::*;
use tokio_util::sync::CancellationToken;

/// A chat, and the continuations of it a migration may send.
fn chats() -> Vec<Value> {
    let messages = json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "tell me about routers, please"}
    ]);
    let so_far = "Routers pick, for each request, the engine";
    let mut continued = messages.as_array().unwrap().clone();
    continued.push(json!({"role": "assistant", "content": so_far}));
    let mut in_parts = messages.as_array().unwrap().clone();
    in_parts.push(json!({"role": "assistant", "content": [{"type": "text", "text": so_far}]}));
    vec![
        json!({"messages": messages, "max_tokens": 8, "stream": true}),
        json!({"messages": continued, "max_tokens": 4, "stream": true,
               "continue_final_message": true, "add_generation_prompt": false}),
        json!({"messages": in_parts, "max_tokens": 4,
               "continue_final_message": true, "add_generation_prompt": false}),
        json!({"messages": continued, "max_tokens": 4,
               "chat_template_kwargs": {"continue_final_message": true,
                                        "add_generation_prompt": false}}),
        json!({"messages": continued, "add_generation_prompt": false}),
    ]
}

/// The ids the router derives for `body` (what it routes and indexes on), through its
/// prefix cache as the router does.
fn router_ids(prompts: &Prompts, body: &Value) -> Vec<u32> {
    let bytes = body.to_string().into_bytes();
    let fields = RoutingFields::from_json(&bytes).unwrap();
    routing::prompt_tokens(prompts, &bytes, &fields)
        .expect("the router tokenises the chat")
        .ids
}

async fn check_same_ids(tokenizer: Tokenizer) -> Vec<Vec<u32>> {
    let tokenizer = Arc::new(tokenizer);
    let shutdown = CancellationToken::new();
    let engine = serve_sim_with(&["--speedup", "1000"], tokenizer.clone(), &shutdown).await;
    // The default policy, kv_aware, in front of the engine.
    let settings =
        Settings::with_workers(vec![named_spec("sim", "kvroute-sim", engine.as_str())]).unwrap();
    let r = TestRouter::start_with(settings, tokenizer.clone()).await;
    let router = r.url.clone();
    let mut all = Vec::new();
    let prompts = Prompts::new(tokenizer.clone(), 16, 1 << 20, &mut Registry::default());
    for body in chats() {
        let ids = router_ids(&prompts, &body);
        let tokenized = post(&engine, "/tokenize", &[], &body.to_string()).await;
        assert_eq!(tokenized.status, 200, "{body}: {:?}", tokenized.body);
        assert_eq!(tokenized.json()["tokens"], json!(ids), "{body}");
        let render = post(
            &engine,
            "/v1/chat/completions/render",
            &[],
            &body.to_string(),
        )
        .await;
        assert_eq!(render.json()["token_ids"], json!(ids), "{body}");
        // End to end: the router's own count, and the engine's, for the request itself.
        let debug = post(&router, "/debug/route", &[], &body.to_string()).await;
        assert_eq!(debug.status, 200, "{:?}", debug.body);
        assert_eq!(debug.json()["prompt_tokens"], ids.len(), "{body}");
        let mut once = body.clone();
        once["stream"] = json!(false);
        let reply = post(&router, "/v1/chat/completions", &[], &once.to_string()).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        assert_eq!(reply.json()["usage"]["prompt_tokens"], ids.len(), "{body}");
        all.push(ids);
    }
    r.stop().await;
    shutdown.cancel();
    all
}

#[tokio::test]
async fn router_and_sim_agree_on_a_continuation_with_the_fallback() {
    let ids = check_same_ids(Tokenizer::fallback()).await;
    // The continuation extends the original prompt's ids up to its generation prompt
    // (`assistant: `, the last 11 bytes), so the engine's cached blocks are reused.
    let (original, continuation) = (&ids[0], &ids[1]);
    assert_eq!(&continuation[..original.len()], &original[..]);
    assert_eq!(
        kvroute_protocol::fallback::decode(&continuation[original.len()..]),
        "Routers pick, for each request, the engine"
    );
    assert_eq!(ids[2], ids[1], "a final message given in parts");
    assert_eq!(ids[3], ids[1], "the options given as chat_template_kwargs");
}

#[tokio::test]
async fn router_and_sim_agree_on_a_continuation_with_a_real_tokenizer() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/tiny-llama");
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let decode = Tokenizer::load(&dir).unwrap();
    let ids = check_same_ids(tokenizer).await;
    assert_eq!(
        decode.decode(&ids[1]).unwrap(),
        "system: be brief\nuser: tell me about routers, please\n\
         assistant: Routers pick, for each request, the engine"
    );
    assert_eq!(ids[3], ids[1], "the options given as chat_template_kwargs");
}
