//! `--engine-priority`: the router writes each request's place in its engine's own queue.
//! One kvroute-sim engine scheduling by priority (vLLM's `--scheduling-policy priority`)
//! runs one sequence at a time, and no router queue holds anything back: every request
//! waits in the engine's queue, in the order the priorities the router wrote give it.
//! Orders are asserted, never durations.

mod support;

use std::sync::{Arc, Mutex};

use serde_json::json;
use support::*;
use tokio_util::sync::CancellationToken;

/// The engine's `vllm:num_requests_{what}`.
async fn engine(sim: &str, what: &str) -> f64 {
    let text = scrape(sim).await;
    metric_sum(&text, &format!("vllm:num_requests_{what}"), "")
}

fn completion(seed: u64, extra: serde_json::Value) -> String {
    let mut body = json!({"model": "kvroute-sim", "prompt": text(64, seed), "max_tokens": 2});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_light_tenant_goes_ahead_of_a_heavy_tenants_requests_already_queued_in_the_engine() {
    let shutdown = CancellationToken::new();
    let sim_flags = [
        "--scheduling-policy",
        "priority",
        "--max-num-seqs",
        "1",
        "--speedup",
        "1",
    ];
    let sim = serve_sim(&sim_flags, &shutdown).await;
    let r = TestRouter::from_flags(&[
        "--worker-urls",
        &sim,
        "--policy",
        "round_robin",
        "--trust-tenant-header",
        "--engine-priority",
        "vllm",
    ])
    .await;
    let heavy = [("x-smg-tenant-id", "heavy")];
    // The heavy tenant's first request holds the engine: a stream that would run for hours.
    let holding = json!({"model": "kvroute-sim", "prompt": text(64, 1), "max_tokens": 200_000, "stream": true});
    let holder = open_stream_with(&r.url, "/v1/completions", &heavy, &holding.to_string()).await;
    assert_eq!(holder.status(), 200);
    wait_until_async("the holder runs", || async {
        engine(&sim, "running").await == 1.0
    })
    .await;

    let finished = Arc::new(Mutex::new(Vec::new()));
    let send = |name: &'static str, tenant: &'static str, body: String| {
        let (url, finished) = (r.url.clone(), finished.clone());
        tokio::spawn(async move {
            let reply = post(
                &url,
                "/v1/completions",
                &[("x-smg-tenant-id", tenant)],
                &body,
            )
            .await;
            assert_eq!(reply.status, 200, "{name}: {:?}", reply.body);
            finished.lock().unwrap().push(name);
        })
    };
    // Two more of the heavy tenant's queue in the engine; each asks for priority -100,
    // which the router replaces: with --engine-priority the router owns the engine's order.
    let mut tasks = Vec::new();
    for (i, name) in ["heavy-1", "heavy-2"].into_iter().enumerate() {
        tasks.push(send(
            name,
            "heavy",
            completion(10 + i as u64, json!({"priority": -100})),
        ));
        let queued = i as f64 + 1.0;
        wait_until_async("the heavy tenant's request waits in the engine", || async {
            engine(&sim, "waiting").await == queued
        })
        .await;
    }
    // The light tenant arrives last, with nothing in flight: it goes first.
    tasks.push(send("light", "light", completion(20, json!({}))));
    wait_until_async("all three wait", || async {
        engine(&sim, "waiting").await == 3.0
    })
    .await;
    // The holder's client goes away: the engine drops it and serves its queue in order.
    drop(holder);
    for t in tasks {
        t.await.unwrap();
    }
    let order = finished.lock().unwrap().clone();
    assert_eq!(order, ["light", "heavy-1", "heavy-2"]);
    r.stop().await;
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_engine_priority_the_body_goes_as_it_came() {
    // The engine schedules first come, first served, and refuses a priority (as vLLM does):
    // the router writes none of its own, and passes the client's on.
    let shutdown = CancellationToken::new();
    let sim = serve_sim(&[], &shutdown).await;
    let r = TestRouter::from_flags(&["--worker-urls", &sim, "--trust-tenant-header"]).await;
    let tenant = [("x-smg-tenant-id", "a")];
    let plain = post(
        &r.url,
        "/v1/completions",
        &tenant,
        &completion(1, json!({})),
    )
    .await;
    assert_eq!(plain.status, 200, "{:?}", plain.body);
    let asked = post(
        &r.url,
        "/v1/completions",
        &tenant,
        &completion(2, json!({"priority": 3})),
    )
    .await;
    assert_eq!(
        asked.status, 400,
        "the client's priority reached the engine"
    );
    r.stop().await;
    shutdown.cancel();
}
