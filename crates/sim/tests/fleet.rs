//! `--engines N`: N engines in one process, each on its own ports with its own instance id.

mod support;

use std::sync::Arc;

use kvroute_sim::fleet::engine_args;
use kvroute_sim::{Fleet, SimArgs};
use kvroute_tokenizer::Tokenizer;
use support::*;

/// A fleet of `n` engines on ports of the system's choosing, publishing KV events from a
/// free base port (retried when another test took one of the ports): the fleet and that base.
async fn fleet(n: usize, extra: &[&str]) -> (Fleet, u16) {
    let mut last = None;
    for _ in 0..20 {
        let base = kvroute_sim::fleet::free_port_run(n).expect("a run of free ports");
        let engines = n.to_string();
        let endpoint = format!("tcp://127.0.0.1:{base}");
        let mut argv = vec!["--port", "0", "--engines", &engines];
        argv.extend_from_slice(&["--kv-events-endpoint", &endpoint]);
        argv.extend_from_slice(extra);
        match Fleet::start(&args(&argv), Arc::new(Tokenizer::fallback())).await {
            Ok(fleet) => return (fleet, base),
            Err(e) => last = Some(e),
        }
    }
    panic!("no fleet could bind its ports: {last:?}");
}

#[tokio::test]
async fn each_engine_serves_on_its_own_port_with_its_own_id_and_events() {
    let (fleet, base) = fleet(4, &["--instance-id", "pod"]).await;
    let urls = fleet.urls();
    assert_eq!(urls.len(), 4);
    let distinct: std::collections::HashSet<_> = urls.iter().collect();
    assert_eq!(distinct.len(), 4, "{urls:?}");
    for (i, url) in urls.iter().enumerate() {
        let (status, body) = post_json(
            url,
            "/v1/completions",
            &completion(&prompt_of(20, i), 1, false),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["system_fingerprint"], format!("pod-{i}"));
        // Engine i publishes its own events on base + i: a request to it is heard there.
        let endpoint = format!("tcp://127.0.0.1:{}", usize::from(base) + i);
        let sub = subscribe(&endpoint, url, 1000 * (i + 1)).await;
        drop(sub);
    }
    fleet.stop().await.unwrap();
}

#[tokio::test]
async fn a_crashed_engine_stops_the_fleet_with_its_number() {
    let (fleet, _) = fleet(3, &["--crash-after-requests", "1"]).await;
    let url = fleet.urls()[1].clone();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let serving = tokio::spawn(fleet.serve(shutdown));
    // Its answer is cut (or never comes): only the crash matters here.
    let _ = client()
        .request(post(
            &url,
            "/v1/completions",
            &completion("crash", 2, false),
        ))
        .await;
    let error = serving.await.unwrap().unwrap_err();
    assert!(error.is::<kvroute_sim::Crashed>(), "{error:#}");
    assert!(format!("{error:#}").contains("engine 1"), "{error:#}");
}

#[test]
fn engine_flags_are_offset_by_the_engine_number() {
    let parse = |extra: &[&str]| {
        let argv = ["kvroute-sim", "--engines", "256"].iter().chain(extra);
        <SimArgs as clap::Parser>::parse_from(argv)
    };
    let a = parse(&["--port", "9000", "--kv-events-endpoint", "tcp://*:20000"]);
    assert!(a.validate().is_ok());
    let e = engine_args(&a, 255).unwrap();
    assert_eq!((e.port, e.engines), (9255, 1));
    assert_eq!(e.kv_events_endpoint.as_deref(), Some("tcp://*:20255"));
    assert_eq!((e.instance_id.as_str(), e.seed), ("kvroute-sim-255", 255));
    // Two ranks each: engine i's ranks are on base + 2i and base + 2i + 1.
    let a = parse(&[
        "--kv-events-endpoint",
        "tcp://*:20000",
        "--data-parallel-size",
        "2",
    ]);
    let e = engine_args(&a, 3).unwrap();
    assert_eq!(e.kv_events_endpoint.as_deref(), Some("tcp://*:20006"));
    // One engine keeps its flags as they are.
    let one = <SimArgs as clap::Parser>::parse_from(["kvroute-sim", "--port", "9000"]);
    assert_eq!(engine_args(&one, 0).unwrap().instance_id, "kvroute-sim");
    // Ports past 65535 are an error naming the flag.
    let a = parse(&["--port", "65400"]);
    assert!(engine_args(&a, 255)
        .unwrap_err()
        .to_string()
        .contains("--port"));
    let a = parse(&["--kv-events-endpoint", "tcp://*:65500"]);
    let e = engine_args(&a, 200).unwrap_err().to_string();
    assert!(e.contains("--kv-events-endpoint"), "{e}");
    for bad in ["0", "5000"] {
        let a = <SimArgs as clap::Parser>::parse_from(["kvroute-sim", "--engines", bad]);
        assert!(a.validate().unwrap_err().to_string().contains("--engines"));
    }
}
