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

/// The order the requests of this scenario finish in, behind a router with `flags`: the
/// heavy tenant's first request holds the engine; two more
/// of its requests follow (the second waits in the router queue when `queued`), then the
/// light tenant's; then the holder's client leaves and the engine serves its queue.
async fn finishing_order(flags: &[&str], queued: bool) -> Vec<&'static str> {
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
    let mut argv = vec![
        "--worker-urls",
        &sim,
        "--policy",
        "kv_aware",
        "--trust-tenant-header",
    ];
    argv.extend_from_slice(flags);
    let r = TestRouter::from_flags(&argv).await;
    let heavy = [("x-smg-tenant-id", "heavy")];
    // A stream that would run for hours.
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
    // Each asks for priority -100, which the router replaces: with --engine-priority the
    // router owns the engine's order.
    let mut tasks = vec![send(
        "heavy-1",
        "heavy",
        completion(10, json!({"priority": -100})),
    )];
    wait_until_async("heavy-1 waits in the engine", || async {
        engine(&sim, "waiting").await == 1.0
    })
    .await;
    tasks.push(send(
        "heavy-2",
        "heavy",
        completion(11, json!({"priority": -100})),
    ));
    if queued {
        wait_until_async("heavy-2 waits in the router queue", || async {
            metric_value(
                &r.metrics().await,
                "kvroute_queue_pending",
                r#"class="default""#,
            ) == Some(1.0)
        })
        .await;
    } else {
        wait_until_async("heavy-2 waits in the engine", || async {
            engine(&sim, "waiting").await == 2.0
        })
        .await;
    }
    // The light tenant arrives last, with nothing in flight: straight to the engine.
    tasks.push(send("light", "light", completion(20, json!({}))));
    let waiting = if queued { 2.0 } else { 3.0 };
    wait_until_async("the light one waits in the engine", || async {
        engine(&sim, "waiting").await == waiting
    })
    .await;
    drop(holder);
    for t in tasks {
        t.await.unwrap();
    }
    r.stop().await;
    shutdown.cancel();
    let order = finished.lock().unwrap().clone();
    order
}

const ENGINE_PRIORITY: [&str; 2] = ["--engine-priority", "vllm"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_light_tenant_goes_ahead_of_a_heavy_tenants_requests_already_queued_in_the_engine() {
    let order = finishing_order(&ENGINE_PRIORITY, false).await;
    assert_eq!(order, ["light", "heavy-1", "heavy-2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_below_its_share_skips_the_router_queue_for_the_engines() {
    // The engine is saturated (64 prefill tokens over 0.001 x 8,192) once heavy-1 waits in
    // it: heavy-2 waits in the router queue. The light tenant's request skips it and goes
    // first in the engine; held in the router queue it would have come after heavy-1.
    let mut flags = vec!["--router-queue-threshold", "0.001"];
    flags.extend(ENGINE_PRIORITY);
    assert_eq!(
        finishing_order(&flags, true).await,
        ["light", "heavy-1", "heavy-2"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_engine_priority_the_clients_priority_goes_as_it_came() {
    // The heavy tenant's `priority: -100` reaches the engine: its requests go first.
    let order = finishing_order(&[], false).await;
    assert_eq!(order, ["heavy-1", "heavy-2", "light"]);
}
