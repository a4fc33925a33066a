//! Priority classes and fair sharing in the router queue, end to end from the flags: one
//! kvroute-sim engine that one long prompt saturates, so the router lets requests go one at
//! a time, in the queue's order. A flood tenant keeps 32 long prompts in flight; what else
//! arrives meanwhile goes ahead of the flood's queued ones, or behind them, by its class and
//! its tenant. Orders and outcomes are asserted, never durations.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use futures_util::FutureExt;
use serde_json::{json, Value};
use support::*;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The priority file of the flood tests: the flood tenant may ask up to `interactive`, the
/// capped one only `bulk`; bulk never starves within a test; nothing preempts (the flood
/// tests are about order; preemption has its own test).
const PRIORITY_FILE: &str = "\
classes:
  interactive:
    can_preempt: false
  bulk:
    reserved_floor: 0
    queue_size: 1024
    queue_timeout_secs: 300
    starvation_threshold_secs: 3600
    can_preempt: false
tenant_policies:
  \"header:flood\":
    max_class: interactive
  \"header:capped\":
    max_class: bulk
";

fn write_file(name: &str, text: &str) -> String {
    let dir = std::env::temp_dir().join(format!("kvroute-priority-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

/// A router from `flags` over one kvroute-sim engine, slowed 4x so that a flood lasts.
async fn router(flags: &[&str], shutdown: &CancellationToken) -> TestRouter {
    let sim = serve_sim(&["--speedup", "0.25"], shutdown).await;
    let file = write_file("priority.yaml", PRIORITY_FILE);
    let mut argv = vec!["kvroute", "--worker-urls", &sim, "--policy", "kv_aware"];
    // 0.2 x 8,192 tokens: one prompt of 3,000 saturates the engine.
    argv.extend(["--router-queue-threshold", "0.2", "--trust-tenant-header"]);
    argv.extend([
        "--priority-scheduler-enabled",
        "--priority-scheduler-config",
        &file,
    ]);
    argv.extend_from_slice(flags);
    TestRouter::from_flags(&argv[1..]).await
}

/// A long completion (3,000 prompt tokens), unique by `seed`, with `extra` fields.
fn long(seed: u64, extra: Value) -> String {
    let mut body = json!({"model": "kvroute-sim", "prompt": text(3000, seed), "max_tokens": 2});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body.to_string()
}

/// The flood: 32 long prompts of `header:flood`, counted in `done` as each is answered.
struct Flood {
    done: Arc<AtomicUsize>,
    tasks: Vec<JoinHandle<Reply>>,
}

impl Flood {
    async fn start(r: &TestRouter) -> Flood {
        let done = Arc::new(AtomicUsize::new(0));
        let tasks = (0..32)
            .map(|i| {
                let (url, done) = (r.url.clone(), done.clone());
                tokio::spawn(async move {
                    let tenant = [("x-smg-tenant-id", "flood")];
                    let reply = post(&url, "/v1/completions", &tenant, &long(i, json!({}))).await;
                    done.fetch_add(1, Ordering::SeqCst);
                    reply
                })
            })
            .collect();
        // Most of the flood waits in the router queue before anything else is sent.
        wait_until_async("the flood is queued", || async {
            metric_value(
                &r.metrics().await,
                "kvroute_queue_pending",
                r#"class="default""#,
            )
            .is_some_and(|n| n >= 24.0)
        })
        .await;
        Flood { done, tasks }
    }

    /// Sends one request beside the flood: how many flood requests were answered before it.
    fn beside(
        &self,
        r: &TestRouter,
        tenant: &str,
        headers: &[(&str, &str)],
        body: String,
    ) -> JoinHandle<(Reply, usize)> {
        let (url, done) = (r.url.clone(), self.done.clone());
        let mut hs: Vec<(String, String)> = vec![("x-smg-tenant-id".into(), tenant.into())];
        hs.extend(headers.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        tokio::spawn(async move {
            let hs: Vec<(&str, &str)> = hs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let reply = post(&url, "/v1/completions", &hs, &body).await;
            (reply, done.load(Ordering::SeqCst))
        })
    }

    async fn finish(self) {
        for t in self.tasks {
            assert_eq!(t.await.unwrap().status, 200);
        }
    }
}

/// Answered 200 with at most 8 of the flood's 32 answered before it: it cut ahead of the
/// flood's queue (in arrival order it would have come after at least 24).
async fn assert_cut_ahead(what: &str, task: JoinHandle<(Reply, usize)>) {
    let (reply, before) = task.await.unwrap();
    eprintln!("{what}: answered after {before} of the flood's 32");
    assert_eq!(reply.status, 200, "{what}: {:?}", reply.body);
    assert!(
        before <= 8,
        "{what}: {before} flood requests were answered first"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenant_cuts_ahead_of_a_flood_and_a_capped_tenant_waits_behind_it() {
    let shutdown = CancellationToken::new();
    let r = router(&[], &shutdown).await;
    let flood = Flood::start(&r).await;
    let light = flood.beside(&r, "light", &[], long(100, json!({})));
    // Asks interactive, is clamped to bulk (its max_class): it goes after the whole flood.
    let capped = flood.beside(
        &r,
        "capped",
        &[("x-smg-priority", "interactive")],
        long(101, json!({})),
    );
    assert_cut_ahead("another tenant, same class", light).await;
    let (reply, before) = capped.await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(
        before, 32,
        "the capped tenant's request went before the flood's"
    );
    flood.finish().await;
    r.stop().await;
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flood_tenants_own_interactive_and_hinted_requests_cut_ahead_of_its_default_ones() {
    let shutdown = CancellationToken::new();
    let r = router(&[], &shutdown).await;
    let flood = Flood::start(&r).await;
    let interactive = [("x-smg-priority", "interactive")];
    let header = flood.beside(&r, "flood", &interactive, long(100, json!({})));
    let strict = json!({"nvext": {"agent_hints": {"strict_priority": 1}}});
    let strict = flood.beside(&r, "flood", &[], long(101, strict));
    // Dynamo's soft priority: a head start of 1,000 s within the default class.
    let soft = json!({"nvext": {"agent_hints": {"latency_sensitivity": 1000.0}}});
    let soft = flood.beside(&r, "flood", &[], long(102, soft));
    assert_cut_ahead("x-smg-priority: interactive", header).await;
    assert_cut_ahead("strict_priority 1", strict).await;
    assert_cut_ahead("a head start", soft).await;
    flood.finish().await;
    r.stop().await;
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_fcfs_fairness_another_tenant_waits_its_turn() {
    let shutdown = CancellationToken::new();
    let r = router(&["--router-queue-fairness", "fcfs"], &shutdown).await;
    let flood = Flood::start(&r).await;
    let light = flood.beside(&r, "light", &[], long(100, json!({})));
    let (reply, before) = light.await.unwrap();
    eprintln!("another tenant under fcfs: answered after {before} of the flood's 32");
    assert_eq!(reply.status, 200);
    assert!(
        before >= 24,
        "only {before} flood requests were answered first"
    );
    flood.finish().await;
    r.stop().await;
    shutdown.cancel();
}

/// A kv_aware router over the engine at `sim` with the priority file `text` (written as
/// `name`), the router queue at `threshold`, and every tenant allowed up to `interactive`.
async fn scheduling_router(sim: &str, name: &str, text: &str, threshold: &str) -> TestRouter {
    let file = write_file(name, text);
    TestRouter::from_flags(&[
        "--worker-urls",
        sim,
        "--policy",
        "kv_aware",
        "--router-queue-threshold",
        threshold,
        "--trust-tenant-header",
        "--priority-scheduler-enabled",
        "--priority-scheduler-config",
        &file,
        "--priority-scheduler-default-max-class",
        "interactive",
    ])
    .await
}

/// What the engine at `url` has running or waiting.
async fn engine_requests(url: &str) -> f64 {
    let (_, _, body) = get_url(&format!("{url}/metrics")).await;
    let text = String::from_utf8_lossy(&body);
    metric_sum(&text, "vllm:num_requests_running", "")
        + metric_sum(&text, "vllm:num_requests_waiting", "")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interactive_arrival_preempts_a_bulk_request_before_its_first_byte() {
    let shutdown = CancellationToken::new();
    // Slowed 10x: the bulk request would decode for minutes.
    let sim = serve_sim(&["--speedup", "0.1"], &shutdown).await;
    // smg's defaults: interactive may preempt.
    let r = scheduling_router(&sim, "preempt.yaml", "classes: {}\n", "0.2").await;
    let bulk = [("x-smg-tenant-id", "batch"), ("x-smg-priority", "bulk")];
    let body = json!({"model": "kvroute-sim", "prompt": text(3000, 1), "max_tokens": 8000});
    let victim = r.spawn_complete(&bulk, body.to_string());
    wait_until_async("the bulk request runs", || {
        engine_requests(&sim).map(|n| n == 1.0)
    })
    .await;
    // It saturates the engine: the interactive request must wait, and preempts it.
    let vip = [
        ("x-smg-tenant-id", "vip"),
        ("x-smg-priority", "interactive"),
    ];
    let body = json!({"model": "kvroute-sim", "prompt": text(100, 2), "max_tokens": 2});
    let preemptor = r.spawn_complete(&vip, body.to_string());
    let victim = victim.await.unwrap();
    victim.assert_error(503, "scheduler_preempted");
    assert_eq!(victim.headers["retry-after"], "1");
    assert_eq!(victim.headers["x-smg-preempted"], "true");
    assert_eq!(preemptor.await.unwrap().status, 200);
    // The engine stopped working on the preempted request: nothing is left running there.
    wait_until_async("the engine to drop the preempted request", || {
        engine_requests(&sim).map(|n| n == 0.0)
    })
    .await;
    let m = r.metrics().await;
    assert_metric(
        &m,
        "kvroute_preemptions_total",
        r#"class="bulk""#,
        Some(1.0),
    );
    r.stop().await;
    shutdown.cancel();
}

/// `interactive` reserves half of the capacity (`reserved_per_slot: 0.5` of one rank's 64
/// slots), nothing else reserves: a `default` request sees half the threshold, an
/// `interactive` one all of it.
const RESERVING_FILE: &str = "\
classes:
  system:
    reserved_floor: 0
  interactive:
    reserved_floor: 0
    reserved_per_slot: 0.5
    can_preempt: false
  default:
    reserved_per_slot: 0
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_class_takes_the_capacity_it_reserves_while_a_lower_one_waits() {
    let shutdown = CancellationToken::new();
    // Slowed 500x: no prompt here finishes its prefill within the test.
    let sim = serve_sim(&["--speedup", "0.002"], &shutdown).await;
    // 8,192 prefill tokens; default requests see 4,096.
    let r = scheduling_router(&sim, "reserving.yaml", RESERVING_FILE, "1").await;
    let default = [("x-smg-tenant-id", "team")];
    let prompt =
        |seed| json!({"model": "kvroute-sim", "prompt": text(3000, seed), "max_tokens": 2});
    // The router's count of the engine's prefill tokens, and its queue.
    let prefill = || async {
        let m = r.metrics().await;
        metric_sum(&m, "kvroute_worker_active_prefill_tokens", "")
    };
    let pending = || async {
        metric_value(
            &r.metrics().await,
            "kvroute_queue_pending",
            r#"class="default""#,
        )
    };
    // Two default prompts of 3,000 tokens go: 0, then 3,000 in prefill, under 4,096.
    let mut tasks = Vec::new();
    for seed in [1, 2] {
        tasks.push(r.spawn_complete(&default, prompt(seed).to_string()));
        wait_until_async("the default request is let go", || async {
            prefill().await >= 3000.0 * seed as f64
        })
        .await;
    }
    // 6,000 in prefill: a third default request waits.
    tasks.push(r.spawn_complete(&default, prompt(3).to_string()));
    wait_until_async("the third default request waits", || async {
        pending().await == Some(1.0)
    })
    .await;
    // An interactive one, arriving after it, goes at once: 6,000 is under its 8,192.
    let interactive = [
        ("x-smg-tenant-id", "team"),
        ("x-smg-priority", "interactive"),
    ];
    let body = json!({"model": "kvroute-sim", "prompt": text(100, 4), "max_tokens": 2});
    tasks.push(r.spawn_complete(&interactive, body.to_string()));
    wait_until_async("the interactive request is let go", || async {
        prefill().await >= 6100.0
    })
    .await;
    assert_eq!(
        pending().await,
        Some(1.0),
        "the default request still waits: nothing left the engine's prefill"
    );
    assert!(
        prefill().await < 9000.0,
        "the third default request was let go too"
    );
    for t in tasks {
        t.abort();
    }
    shutdown.cancel();
    r.stop().await;
}

#[test]
fn a_bad_priority_file_exits_2_naming_the_entry() {
    let cases = [
        ("classes:\n  urgent:\n    queue_size: 1\n", "urgent"),
        (
            "classes:\n  bulk:\n    queue_timeout_secs: 0\n",
            "classes.bulk.queue_timeout_secs",
        ),
        (
            "classes:\n  default:\n    starvation_threshold_secs: 0\n",
            "classes.default.starvation_threshold_secs",
        ),
        (
            "classes:\n  default:\n    reserved_per_slot: -1\n",
            "classes.default.reserved_per_slot",
        ),
        ("classes:\n  default:\n    queue_sise: 4\n", "queue_sise"),
        (
            "tenant_policies:\n  \"auth:a\":\n    max_class: garbage\n",
            "garbage",
        ),
        (
            "tenant_policies:\n  \"auth:a\":\n    weight: 0\n",
            "tenant_policies.auth:a.weight",
        ),
        ("classes: [1, 2]\n", "classes"),
    ];
    for (i, (text, entry)) in cases.iter().enumerate() {
        let file = write_file(&format!("bad{i}.yaml"), text);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args([
                "--worker-urls",
                "http://127.0.0.1:1",
                "--priority-scheduler-enabled",
            ])
            .args(["--priority-scheduler-config", &file])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}: {err}");
        assert!(err.contains(entry) && err.contains(&file), "{text}: {err}");
    }
    // The file without the scheduler is a mistake, not a silent no-op.
    let file = write_file("good.yaml", PRIORITY_FILE);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "--worker-urls",
            "http://127.0.0.1:1",
            "--priority-scheduler-config",
            &file,
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--priority-scheduler-enabled"));
}
