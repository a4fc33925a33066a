//! `--router-track-output-blocks` end to end on kvroute-sim engines: a long stream raises its
//! rank's decode load as it generates, and `nvext.agent_hints.osl` decays it.

mod support;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use kvroute_core::PolicyKind;
use serde_json::{json, Value};
use support::*;
use tokio_util::sync::CancellationToken;

/// A prompt of `n` tokens (the fallback tokenizer's: a byte a token) made of `c`.
fn prompt(c: char) -> String {
    std::iter::repeat_n(c, 600).collect()
}

/// Reads `stream` until it has brought `n` more `data:` events.
async fn read_events(stream: &mut Incoming, n: usize) {
    let mut seen = 0;
    while seen < n {
        let frame = stream.frame().await.expect("the stream goes on").unwrap();
        if let Some(data) = frame.data_ref() {
            let text = String::from_utf8_lossy(data);
            seen += text.lines().filter(|l| l.starts_with("data:")).count();
        }
    }
}

/// A stream of `prompt`, `nvext` added to the body: its worker and its body, once it has
/// brought `tokens` events.
async fn stream(r: &TestRouter, prompt: &str, nvext: Value, tokens: usize) -> (String, Incoming) {
    let mut body = json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 4000,
        "stream": true, "ignore_eos": true});
    if !nvext.is_null() {
        body["nvext"] = nvext;
    }
    let resp = open_stream(&r.url, "/v1/completions", &body.to_string()).await;
    assert_eq!(resp.status(), 200);
    let worker = resp.headers()["x-kvroute-worker"]
        .to_str()
        .unwrap()
        .to_owned();
    let mut body = resp.into_body();
    read_events(&mut body, tokens).await;
    (worker, body)
}

/// The decision for a third prompt while a long stream (with `nvext`) runs on one engine and
/// a young one on the other: (the long one's worker, the young one's, the decision).
async fn probe(track: bool, nvext: Value) -> (String, String, Value) {
    let shutdown = CancellationToken::new();
    let urls = [
        serve_sim(&["--speedup", "4"], &shutdown).await,
        serve_sim(&["--speedup", "4"], &shutdown).await,
    ];
    let mut s = sim_settings(&urls, PolicyKind::KvAware);
    s.track_output_blocks = track;
    let r = TestRouter::start(s).await;
    // 200 tokens: 12 output blocks of 16 past the prompt's 38 blocks.
    let (long, long_body) = stream(&r, &prompt('a'), nvext, 200).await;
    let (young, young_body) = stream(&r, &prompt('b'), Value::Null, 1).await;
    assert_ne!(long, young, "the second stream goes to the idle engine");
    let body = json!({"model": "kvroute-sim", "prompt": prompt('c')}).to_string();
    let decision = r.post("/debug/route", &[], &body).await.json();
    drop((long_body, young_body));
    r.stop_idle().await;
    shutdown.cancel();
    (long, young, decision)
}

fn candidate<'a>(decision: &'a Value, worker: &str) -> &'a Value {
    decision["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["worker"] == worker)
        .unwrap_or_else(|| panic!("{worker} in {decision}"))
}

fn blocks(c: &Value) -> (u64, u64) {
    (
        c["decode_blocks"].as_u64().unwrap(),
        c["output_blocks"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_stream_raises_its_ranks_decode_load_and_the_next_request_goes_elsewhere() {
    // Without tracking: the two engines hold one request of the same prompt length each.
    let (long, young, d) = probe(false, Value::Null).await;
    let (l, y) = (candidate(&d, &long), candidate(&d, &young));
    assert_eq!(blocks(l), blocks(y), "{d}");
    assert_eq!(blocks(l).1, 0);
    assert_eq!(l["cost"], y["cost"], "a tie: {d}");

    // With it: the long stream's output blocks count, so the young one's engine is cheaper.
    let (long, young, d) = probe(true, Value::Null).await;
    let (l, y) = (candidate(&d, &long), candidate(&d, &young));
    let (long_blocks, long_output) = blocks(l);
    let (young_blocks, young_output) = blocks(y);
    assert!(long_output >= 12, "{d}");
    assert!(
        long_blocks - long_output == young_blocks - young_output,
        "{d}"
    );
    assert!(long_blocks >= young_blocks + 10, "{d}");
    assert_eq!(d["worker"], young.as_str(), "{d}");

    // An expected length of 100 tokens: 200 in, the long stream's blocks (all its own) weigh
    // nothing, so its engine is now the lighter one.
    let osl = json!({"agent_hints": {"osl": 100}});
    let (long, young, d) = probe(true, osl).await;
    let (l, y) = (candidate(&d, &long), candidate(&d, &young));
    assert_eq!(blocks(l).0, 0, "{d}");
    assert!(blocks(l).1 >= 12, "the blocks are counted, weightless: {d}");
    assert!(blocks(y).0 > 0);
    assert_eq!(d["worker"], long.as_str(), "{d}");
}

#[test]
fn dynamos_spellings_turn_it_on() {
    let on = |flags: &[&str]| {
        let argv = ["kvroute"].iter().chain(flags).copied();
        <kvroute_gateway::Args as clap::Parser>::try_parse_from(argv)
            .unwrap()
            .into_settings()
            .unwrap()
            .track_output_blocks
    };
    assert!(!on(&[]), "off by default, as Dynamo's");
    assert!(on(&["--router-track-output-blocks"]));
    assert!(on(&["--track-output-blocks"]));
}
