//! Priority scheduling against a real vLLM (opt-in).
//!
//!     ../shared/peers/setup_peers.sh vllm model
//!     ../shared/peers/run_vllm_cpu.sh 8100 5557 --scheduling-policy priority --max-num-seqs 1 &
//!     KVROUTE_VLLM_PRIORITY_URL=http://127.0.0.1:8100 \
//!         cargo test -p kvroute-sim --test vllm_priority -- --nocapture
//!
//! One scenario, run on that vLLM and on kvroute-sim started the same way
//! (`--scheduling-policy priority --max-num-seqs 1`): a long stream holds the engine, a
//! request of priority 5 queues, then one of priority -1; the stream's client leaves. Both
//! engines must serve the queue in the same order, the lower value first, which is what
//! `kvroute --engine-priority vllm` relies on. Without the environment variable it says so
//! and checks nothing.

mod support;

use std::time::Duration;

use serde_json::json;
use support::{metrics, post_raw, prompt_of, start, wait_until};
use tokio::time::Instant;

/// `vllm:num_requests_{what}` of the engine at `url` (summed over its series).
async fn requests(url: &str, what: &str) -> f64 {
    let text = metrics(url).await;
    let name = format!("vllm:num_requests_{what}");
    text.lines()
        .filter(|l| l.starts_with(&name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The order (`"low"`, `"high"`) in which the engine at `url` serving `model` finishes the
/// two queued requests.
async fn order(url: &str, model: &str) -> Vec<&'static str> {
    let holder_body = json!({"model": model, "prompt": prompt_of(16, 1), "max_tokens": 900,
                             "stream": true, "ignore_eos": true});
    let holder = {
        let url = url.to_owned();
        tokio::spawn(async move { post_raw(&url, "/v1/completions", &holder_body).await })
    };
    wait_until("the holder runs", || async {
        requests(url, "running").await == 1.0
    })
    .await;
    let send = |name: &'static str, priority: i64, seed: usize| {
        let body = json!({"model": model, "prompt": prompt_of(16, seed), "max_tokens": 2,
                          "priority": priority});
        let url = url.to_owned();
        tokio::spawn(async move {
            let (status, text) = post_raw(&url, "/v1/completions", &body).await;
            assert_eq!(status, 200, "{name}: {text}");
            (Instant::now(), name)
        })
    };
    let low = send("low", 5, 2);
    wait_until("the low one waits", || async {
        requests(url, "waiting").await == 1.0
    })
    .await;
    let high = send("high", -1, 3);
    wait_until("both wait", || async {
        requests(url, "waiting").await == 2.0
    })
    .await;
    holder.abort();
    let mut done = vec![low.await.unwrap(), high.await.unwrap()];
    done.sort();
    done.into_iter().map(|(_, name)| name).collect()
}

#[tokio::test]
async fn the_same_priority_order_as_vllm() {
    let Ok(vllm_url) = std::env::var("KVROUTE_VLLM_PRIORITY_URL") else {
        eprintln!("vllm_priority: KVROUTE_VLLM_PRIORITY_URL not set; nothing compared");
        return;
    };
    let vllm_model = std::env::var("KVROUTE_VLLM_MODEL").unwrap_or_else(|_| "tiny".to_owned());
    let vllm = tokio::time::timeout(Duration::from_secs(120), order(&vllm_url, &vllm_model))
        .await
        .expect("vLLM answered within 120 s");
    let sim = start(&[
        "--scheduling-policy",
        "priority",
        "--max-num-seqs",
        "1",
        "--speedup",
        "1",
    ])
    .await;
    let sim_order = order(&sim.url(), "kvroute-sim").await;
    eprintln!("vLLM served {vllm:?}, kvroute-sim {sim_order:?}");
    assert_eq!(vllm, ["high", "low"], "vLLM served the lower value first");
    assert_eq!(sim_order, vllm);
}
