//! The router against a real vLLM's KV events (opt-in).
//!
//!     ../shared/peers/run_vllm_cpu.sh 8100 5557 --enable-prompt-tokens-details &
//!     KVROUTE_VLLM_URL=http://127.0.0.1:8100 KVROUTE_VLLM_KV_EVENTS=tcp://127.0.0.1:5557 \
//!         cargo test -p kvroute-gateway --test vllm_kv -- --nocapture
//!
//! The router tokenises with the engine's tokenizer (testdata/tiny-llama, the model that
//! script serves), subscribes to vLLM's ZMQ events and must credit the prefix vLLM cached:
//! the overlap `/debug/route` reports equals the `cached_tokens` vLLM then returns.
//! Without the environment variables it says so and checks nothing.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvroute_gateway::{Gateway, Settings, WorkerSpec};
use kvroute_tokenizer::Tokenizer;
use serde_json::json;
use support::*;

#[tokio::test]
async fn the_router_credits_the_prefix_vllm_cached() {
    let (Ok(url), Ok(events)) = (
        std::env::var("KVROUTE_VLLM_URL"),
        std::env::var("KVROUTE_VLLM_KV_EVENTS"),
    ) else {
        eprintln!("vllm_kv: KVROUTE_VLLM_URL and KVROUTE_VLLM_KV_EVENTS not set; nothing checked");
        return;
    };
    let mut settings = Settings::with_workers(vec![WorkerSpec {
        id: Some("vllm".into()),
        kv_events: Some(events),
        ..WorkerSpec::url(url)
    }])
    .unwrap();
    settings.block_size = 32;
    let tokenizer =
        Tokenizer::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/tiny-llama"))
            .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let router = format!("http://{}", listener.local_addr().unwrap());
    let mut registry = prometheus_client::registry::Registry::default();
    let gateway = Gateway::with_tokenizer(settings, &mut registry, Arc::new(tokenizer));
    let shutdown = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(gateway.clone().serve(
        listener,
        metrics_listener,
        Arc::new(registry),
        shutdown.clone(),
    ));
    tokio::time::timeout(Duration::from_secs(60), gateway.wait_ready())
        .await
        .expect("ready");

    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    // The subscriber joins asynchronously: send fresh prompts until one is credited.
    let mut i = 0;
    let (prompt, credited) = loop {
        let prompt = format!("run {nonce} probe {i}: ").repeat(12)
            + "the router should remember this prefix";
        let first = post(
            &router,
            "/v1/completions",
            &[],
            &json!({"prompt": prompt, "max_tokens": 1}).to_string(),
        )
        .await;
        assert_eq!(first.status, 200, "{:?}", first.body);
        let check_until = tokio::time::Instant::now() + Duration::from_secs(2);
        let mut credited = 0;
        while tokio::time::Instant::now() < check_until && credited == 0 {
            let d = post(
                &router,
                "/debug/route",
                &[],
                &json!({"prompt": format!("{prompt} and more")}).to_string(),
            )
            .await
            .json();
            credited = d["candidates"][0]["overlap_blocks"]["device"]
                .as_u64()
                .unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if credited > 0 {
            break (prompt, credited);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the router never credited vLLM's cache"
        );
        i += 1;
    };
    let follow = post(
        &router,
        "/v1/completions",
        &[],
        &json!({"prompt": format!("{prompt} and more"), "max_tokens": 1}).to_string(),
    )
    .await;
    let cached = follow.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    eprintln!("credited {credited} blocks of 32; vLLM reported {cached} cached tokens");
    assert_eq!(cached, credited * 32);
    shutdown.cancel();
    task.await.unwrap().unwrap();
}
