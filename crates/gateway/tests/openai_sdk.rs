//! The `openai` Python SDK (PyPI) as a real client, through every policy, against
//! kvroute-sim engines: models, chat whole and streamed, completions, and an unknown
//! model's error as the SDK reads it.

mod support;

use std::sync::Arc;

use kvroute_core::PolicyKind;
use kvroute_tokenizer::Tokenizer;
use serde_json::Value;
use support::*;
use tokio_util::sync::CancellationToken;

async fn sdk(url: &str) -> Value {
    let args = vec![url.to_owned(), "kvroute-sim".to_owned()];
    python_json(
        "openai_client.py",
        args,
        "the openai SDK (pip install openai)",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_works_through_every_policy() {
    let tokenizer = Arc::new(Tokenizer::fallback());
    let shutdown = CancellationToken::new();
    let mut urls = Vec::new();
    for _ in 0..2 {
        urls.push(serve_sim_with(&["--speedup", "100"], tokenizer.clone(), &shutdown).await);
    }
    for policy in PolicyKind::ALL {
        if policy == PolicyKind::Manual {
            continue; // routes only with a routing key; covered by the hints tests
        }
        let router = TestRouter::start(sim_settings(&urls, policy)).await;
        let out = sdk(&router.url).await;
        assert_eq!(
            out["models"],
            serde_json::json!(["kvroute-sim"]),
            "{policy}: {out}"
        );
        let chat = &out["chat"];
        assert_eq!(chat["completion_tokens"], 4, "{policy}: {out}");
        assert_eq!(chat["finish_reason"], "length");
        assert!(!chat["text"].as_str().unwrap().is_empty());
        assert!(chat["worker"].as_str().unwrap().starts_with("sim"));
        let stream = &out["stream"];
        assert_eq!(stream["finish_reason"], "length", "{policy}: {out}");
        assert!(!stream["text"].as_str().unwrap().is_empty());
        assert_eq!(out["completion"]["completion_tokens"], 3, "{policy}: {out}");
        let e = &out["unknown_model"];
        assert_eq!(e["status"], 404, "{policy}: {out}");
        assert_eq!(e["class"], "NotFoundError");
        assert_eq!(e["code"], "model_not_found");
        router.stop().await;
    }
    shutdown.cancel();
}
