//! The router against two real vLLM engines serving LoRA adapters (opt-in).
//!
//!     P=/tmp/kvroute-peers    # ../shared/peers/setup_peers.sh vllm model, then pip install peft
//!     for a in sql:1 chat:2; do
//!         $P/venv-vllm/bin/python crates/gateway/tests/support/make_lora_adapter.py \
//!             $P/tiny-llama $P/lora-${a%%:*} ${a##*:}
//!     done
//!     for i in 1 2; do
//!         ../shared/peers/run_vllm_cpu.sh 810$i 557$i --enable-lora --max-loras 1 \
//!             --max-lora-rank 8 --lora-modules sql=$P/lora-sql chat=$P/lora-chat &
//!     done
//!     KVROUTE_VLLM_LORA_URLS=http://127.0.0.1:8101,http://127.0.0.1:8102 \
//!     KVROUTE_VLLM_LORA_ADAPTERS=sql,chat \
//!         cargo test -p kvroute-gateway --test vllm_lora -- --nocapture
//!
//! The engines must be idle (nothing else sending them requests). Without the environment
//! variables the test says so and checks nothing.
//!
//! What vLLM 0.32 exports, and so what the test can check: `/v1/models` lists each adapter
//! of `--lora-modules` with `parent` the base model (how the router tells an adapter from a
//! model). `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`
//! names only the adapters that have requests on the engine: an adapter whose requests are
//! done stays in its slot, but a new series with both labels empty is then the newest. (Each
//! adapter with a request is written into both labels, so an adapter that runs is also listed
//! as waiting; a request deferred for a slot is listed only once it is scheduled.) The family
//! has no series at all until the engine's first request. So "the engine that has the adapter
//! loaded" is visible to the router only while the engine runs a request of it; once it is
//! idle, the router knows only where it sent the adapter itself.
//!
//! So, for each engine in turn (a fresh router each time, so it has sent nothing anywhere):
//! a long streamed request of the first adapter sent to that engine directly (not through the
//! router) runs there; the router must read it from that engine's metrics (`/debug/route`:
//! `running` there, `free_slot` on the other; the second adapter `full` there, one slot of
//! one taken) and send the first adapter's requests there and the second's to the other
//! engine. Nothing else separates the two: the router has no request of its own in flight,
//! the prompts share no prefix, and the busy engine's extra running request counts against
//! it if anything; with the adapter fits ignored the eight decisions would be coin flips.
//! Once the long request is cut, the engine's newest series lists nothing, and the router
//! keeps the adapter where it sent it from its own memory (`resident`).

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use kvroute_gateway::{Settings, WorkerSpec};
use kvroute_tokenizer::Tokenizer;
use serde_json::json;
use support::*;

/// Each candidate's adapter fit for a completion with `model`, by worker id.
async fn fits(r: &TestRouter, model: &str) -> Vec<(String, String)> {
    let body = json!({"model": model, "prompt": "where would this go"}).to_string();
    let reply = r.post("/debug/route", &[], &body).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    adapter_fits(&reply.json())
}

/// Whether the router's fits of `model` are `want` (by worker, sorted).
async fn fits_are(r: &TestRouter, model: &str, want: &[(&str, &str)]) -> bool {
    let got = fits(r, model).await;
    got.iter()
        .map(|(w, f)| (w.as_str(), f.as_str()))
        .eq(want.iter().copied())
}

/// The newest `vllm:lora_requests_info` line of an engine's metrics.
async fn lora_info(engine: &str) -> String {
    let text = scrape(engine).await;
    let stamp = |l: &str| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
    text.lines()
        .filter(|l| l.starts_with("vllm:lora_requests_info{"))
        .max_by(|a, b| stamp(a).total_cmp(&stamp(b)))
        .unwrap_or("(no series)")
        .to_owned()
}

/// A router over the engines `a` and `b`, scraping their metrics every 20 ms.
async fn router(urls: &[String]) -> TestRouter {
    let specs = ["a", "b"]
        .iter()
        .zip(urls)
        .map(|(id, url)| WorkerSpec {
            id: Some((*id).into()),
            ..WorkerSpec::url(url.clone())
        })
        .collect();
    let mut settings = Settings::with_workers(specs).unwrap();
    settings.block_size = 32;
    settings.metrics_refresh = Duration::from_millis(20);
    let tokenizer =
        Tokenizer::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/tiny-llama"))
            .unwrap();
    TestRouter::start_with(settings, Arc::new(tokenizer)).await
}

#[tokio::test]
async fn an_adapters_requests_go_to_the_vllm_engine_that_runs_it() {
    let (Ok(urls), Ok(adapters)) = (
        std::env::var("KVROUTE_VLLM_LORA_URLS"),
        std::env::var("KVROUTE_VLLM_LORA_ADAPTERS"),
    ) else {
        eprintln!(
            "vllm_lora: KVROUTE_VLLM_LORA_URLS and KVROUTE_VLLM_LORA_ADAPTERS not set; nothing checked"
        );
        return;
    };
    let urls: Vec<String> = urls.split(',').map(str::to_owned).collect();
    let adapters: Vec<&str> = adapters.split(',').collect();
    let ([_, _], [sql, chat]) = (urls.as_slice(), adapters.as_slice()) else {
        panic!("two engine URLs and two adapter names, comma-separated");
    };
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    for (home, other) in [(0, 1), (1, 0)] {
        let ids = ["a", "b"];
        let (home_id, other_id) = (ids[home], ids[other]);
        let r = router(&urls).await;
        // Both engines list the adapters (with a parent) and report their adapters idle.
        wait_until_async("the router reads both engines' adapters", || {
            fits_are(&r, sql, &[("a", "free_slot"), ("b", "free_slot")])
        })
        .await;

        // A long request of `sql` straight to the home engine, running once it streams.
        let body = json!({
            "model": sql, "prompt": format!("hold {nonce} {home}"), "max_tokens": 1000,
            "ignore_eos": true, "stream": true,
        });
        let reply = open_stream(&urls[home], "/v1/completions", &body.to_string()).await;
        assert_eq!(reply.status(), 200);
        let mut stream = reply.into_body();
        stream.frame().await.expect("a first chunk").unwrap();
        let holder = tokio::spawn(async move { while stream.frame().await.is_some() {} });

        let mut want = [("a", ""), ("b", "")];
        want[home].1 = "running";
        want[other].1 = "free_slot";
        wait_until_async("the router reads the running adapter", || {
            fits_are(&r, sql, &want)
        })
        .await;
        eprintln!(
            "engine {home_id} runs {sql}: {}",
            lora_info(&urls[home]).await
        );
        // One slot, taken by `sql`: another adapter must wait there for it, then load.
        want[home].1 = "full";
        assert!(
            fits_are(&r, chat, &want).await,
            "{:?}",
            fits(&r, chat).await
        );

        for i in 0..6 {
            let prompt = format!("request {i} of {sql} in run {nonce}.{home}");
            let body = json!({"model": sql, "prompt": prompt, "max_tokens": 2});
            let reply = r.complete(&[], &body.to_string()).await;
            assert_eq!(reply.status, 200, "{:?}", reply.body);
            assert_eq!(reply.json()["model"], *sql);
            assert_eq!(reply.worker(), home_id, "{sql} request {i}");
        }
        for i in 0..2 {
            let prompt = format!("request {i} of {chat} in run {nonce}.{home}");
            let body = json!({"model": chat, "prompt": prompt, "max_tokens": 2});
            let reply = r.complete(&[], &body.to_string()).await;
            assert_eq!(reply.status, 200, "{:?}", reply.body);
            assert_eq!(reply.worker(), other_id, "{chat} request {i}");
        }
        // The decisions above were taken while the long request ran.
        assert!(
            !holder.is_finished(),
            "the long request ended before the checks did (a slow machine?)"
        );
        holder.abort();
        let _ = holder.await;
        let cut = std::time::Instant::now();

        // Cut, the engine reports no adapter (its newest series is empty), and the router
        // keeps `sql` where it sent it from its own memory.
        let mut want = [("a", ""), ("b", "")];
        want[home].1 = "resident";
        want[other].1 = "free_slot";
        wait_until_async("the router reads the engine idle", || {
            fits_are(&r, sql, &want)
        })
        .await;
        eprintln!(
            "engine {home_id} idle {:?} after the cut: {}",
            cut.elapsed(),
            lora_info(&urls[home]).await
        );
        r.stop_idle().await;
    }
}
