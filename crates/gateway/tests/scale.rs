//! 64 simulated engines from one `kvroute-sim --engines 64` fleet behind one router: the
//! CI-sized version of `bench/scale.sh`'s 256 engines. Every engine serves, the router hears
//! the KV events of every engine that served, and `/debug/route` lists every candidate,
//! while a request is decided on the lean path (`routing/lean.rs`); then, sampling 8 ranks,
//! a prompt goes back to the engine that holds it.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kvroute_gateway::WorkerSpec;
use kvroute_sim::Fleet;
use kvroute_tokenizer::Tokenizer;
use serde_json::json;
use support::*;

const ENGINES: usize = 64;

/// A fleet of `ENGINES` engines on ports of the system's choosing, publishing KV events from
/// a free base port (retried when another test took one of them): the fleet and that base.
async fn fleet() -> (Fleet, u16) {
    let mut last = None;
    for _ in 0..20 {
        let base = kvroute_sim::fleet::free_port_run(ENGINES).expect("a run of free ports");
        let endpoint = format!("tcp://127.0.0.1:{base}");
        let engines = ENGINES.to_string();
        let argv = [
            "kvroute-sim",
            "--port",
            "0",
            "--engines",
            &engines,
            "--kv-events-endpoint",
            &endpoint,
            // Slow enough that 64 long answers are all in flight at once.
            "--speedup",
            "1",
            "--log-level",
            "warn",
        ];
        let args = <kvroute_sim::SimArgs as clap::Parser>::parse_from(argv);
        match Fleet::start(&args, Arc::new(Tokenizer::fallback())).await {
            Ok(fleet) => return (fleet, base),
            Err(e) => last = Some(e),
        }
    }
    panic!("no fleet could bind its ports: {last:?}");
}

fn id(i: usize) -> String {
    format!("sim{i}")
}

/// `name{worker="simI"}` summed over its other labels, per engine.
fn per_worker(metrics: &str, name: &str) -> BTreeMap<String, f64> {
    (0..ENGINES)
        .map(|i| {
            let label = format!("worker=\"{}\"", id(i));
            (id(i), metric_sum(metrics, name, &label))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_engines_of_one_fleet_all_serve_and_publish_behind_one_router() {
    let (fleet, base) = fleet().await;
    let specs: Vec<WorkerSpec> = fleet
        .urls()
        .into_iter()
        .enumerate()
        .map(|(i, url)| WorkerSpec {
            id: Some(id(i)),
            model: Some("kvroute-sim".into()),
            kv_events: Some(format!("tcp://127.0.0.1:{}", usize::from(base) + i)),
            ..WorkerSpec::url(url)
        })
        .collect();
    let settings = kvroute_gateway::Settings::with_workers(specs.clone()).unwrap();
    let r = TestRouter::start(settings).await;
    for (i, url) in fleet.urls().iter().enumerate() {
        joined(&r, url, &id(i)).await;
    }
    // Every engine is a candidate.
    let debug = debug_route(&r, "anything").await;
    let candidates: BTreeSet<String> = debug["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["worker"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(candidates, (0..ENGINES).map(id).collect(), "{debug}");
    let m = r.metrics().await;
    let before = per_worker(&m, "kvroute_kv_events_total");
    // 64 engines under the default 2,000 scrapes a second: each every 50 ms as asked.
    let interval = metric_sum(&m, "kvroute_engine_metrics_interval_seconds", "");
    assert_eq!(interval, 0.05);

    // Bursts of 64 distinct prompts, each answered slowly: an engine already answering one
    // costs kv_aware more than an idle one, so a burst spreads over the engines. On a loaded
    // machine an engine may finish before the burst's last prompt is routed and take a second
    // one, so bursts go on (a few at most) until every engine has served.
    let mut served = BTreeMap::new();
    for burst in 0..5 {
        if served.len() == ENGINES {
            break;
        }
        let prompts: Vec<String> = (0..ENGINES)
            .map(|i| {
                format!(
                    "scale {burst} {i} {}",
                    text(320, 7000 + (burst * ENGINES + i) as u64)
                )
            })
            .collect();
        let replies = futures_util::future::join_all(prompts.iter().map(|p| {
            let body = json!({"prompt": p, "max_tokens": 200}).to_string();
            let r = &r;
            async move { r.complete(&[], &body).await }
        }))
        .await;
        for (prompt, reply) in prompts.iter().zip(&replies) {
            assert_eq!(reply.status, 200, "{:?}", reply.body);
            served
                .entry(reply.worker().to_owned())
                .or_insert_with(|| prompt.clone());
        }
    }
    assert_eq!(
        served.len(),
        ENGINES,
        "engines that served: {:?}",
        served.keys()
    );
    // A request in a pool of 64 takes the lean path: every rank costed, few kept as
    // choices (those read under their lock and the winner), the winner among them.
    let (status, _, feed) = get_url(&format!("{}/dashboard/state", r.metrics_url)).await;
    assert_eq!(status, 200);
    let feed: serde_json::Value = serde_json::from_slice(&feed).unwrap();
    let newest = &feed["decisions"][0];
    assert_eq!(newest["ranks_scored"], ENGINES, "{newest}");
    let kept = newest["candidates"].as_array().unwrap();
    assert!(kept.len() < ENGINES, "{newest}");
    assert!(
        kept.iter().any(|c| c["worker"] == newest["worker"]),
        "{newest}"
    );

    // Each engine's KV events for the prompt it served reach the router's index.
    for (worker, prompt) in &served {
        wait_overlap(&r, prompt, worker, |o| o.is_some_and(|b| b >= 20)).await;
    }
    let m = r.metrics().await;
    let processed = per_worker(&m, "kvroute_processed_requests_total");
    let events = per_worker(&m, "kvroute_kv_events_total");
    for (worker, n) in &processed {
        assert!(*n >= 1.0, "{worker} served nothing");
        assert!(
            events[worker] > before[worker],
            "no KV events from {worker} after it served: {} then {}",
            before[worker],
            events[worker]
        );
    }
    r.stop().await;

    // A router sampling 8 ranks (`--router-sample-ranks 8`) on the same fleet: a prompt once
    // served is sent back to the engine that holds it, its decision reading that engine and
    // at most 8 others.
    // Its scrapes kept under 100 a second (`--metrics-scrapes-per-sec 100`): each engine's
    // stretched to every 640 ms.
    let mut settings = kvroute_gateway::Settings::with_workers(specs).unwrap();
    settings.sample_ranks = Some(8);
    settings.metrics_scrapes_per_sec = std::num::NonZeroU32::new(100);
    let r = TestRouter::start(settings).await;
    for (i, url) in fleet.urls().iter().enumerate() {
        joined(&r, url, &id(i)).await;
    }
    let interval = metric_sum(
        &r.metrics().await,
        "kvroute_engine_metrics_interval_seconds",
        "",
    );
    assert_eq!(interval, 0.64);
    let prompt = format!("sampled {}", text(320, 99));
    let body = json!({"prompt": prompt, "max_tokens": 2}).to_string();
    let first = r.complete(&[], &body).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let holder = first.worker().to_owned();
    wait_overlap(&r, &prompt, &holder, |o| o.is_some_and(|b| b >= 20)).await;
    for _ in 0..5 {
        let again = r.complete(&[], &body).await;
        assert_eq!(again.worker(), holder);
        let (_, _, feed) = get_url(&format!("{}/dashboard/state", r.metrics_url)).await;
        let feed: serde_json::Value = serde_json::from_slice(&feed).unwrap();
        let newest = &feed["decisions"][0];
        let read = newest["ranks_scored"].as_u64().unwrap();
        assert!((2..=9).contains(&read), "{newest}");
    }
    r.stop().await;
    fleet.stop().await.unwrap();
}
