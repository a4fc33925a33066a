//! kvroute-sim replicas, and what the router's KV index credits them with.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use kvroute_sim::{SimArgs, SimInstance};
use kvroute_tokenizer::Tokenizer;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::{free_port, holds_within, post, text, wait_until_async, TestRouter};

/// A kvroute-sim replica with the command line `argv` (less the program's name), serving on
/// loopback until `shutdown`: its URL (`https://` with the TLS flags).
pub async fn serve_sim(argv: &[&str], shutdown: &CancellationToken) -> String {
    serve_sim_with(argv, Arc::new(Tokenizer::fallback()), shutdown).await
}

/// Settings for simulated engines at `urls`, known as `sim0`, `sim1`, ... serving
/// `kvroute-sim`, under `policy`.
pub fn sim_settings(
    urls: &[String],
    policy: kvroute_core::PolicyKind,
) -> kvroute_gateway::Settings {
    let specs = urls
        .iter()
        .enumerate()
        .map(|(i, u)| super::named_spec(&format!("sim{i}"), "kvroute-sim", u.clone()))
        .collect();
    let mut s = kvroute_gateway::Settings::with_workers(specs).unwrap();
    s.policy = policy;
    s
}

/// [`serve_sim`], tokenising with `tokenizer`.
pub async fn serve_sim_with(
    argv: &[&str],
    tokenizer: Arc<Tokenizer>,
    shutdown: &CancellationToken,
) -> String {
    let argv = std::iter::once("kvroute-sim").chain(argv.iter().copied());
    let args = <SimArgs as clap::Parser>::parse_from(argv);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("{}://{}", args.scheme(), listener.local_addr().unwrap());
    let server = kvroute_sim::SimServer::new(args, tokenizer);
    tokio::spawn(server.serve(listener, shutdown.clone()));
    url
}

/// Listeners on `127.0.0.2`, `127.0.0.3`, ... (`n` of them) sharing one port, as pods share
/// their container port: the port and the listeners.
pub async fn pod_listeners(n: usize) -> (u16, Vec<TcpListener>) {
    'retry: for _ in 0..50 {
        let first = TcpListener::bind("127.0.0.2:0").await.unwrap();
        let port = first.local_addr().unwrap().port();
        let mut listeners = vec![first];
        for i in 1..n {
            match TcpListener::bind(format!("127.0.0.{}:{port}", i + 2)).await {
                Ok(l) => listeners.push(l),
                Err(_) => continue 'retry,
            }
        }
        return (port, listeners);
    }
    panic!("no port free on every loopback address");
}

/// kvroute-sim replicas with `argv` on `n` "pods" (see [`pod_listeners`]), serving until
/// `shutdown`: the port and their URLs.
pub async fn sim_pods(n: usize, argv: &[&str], shutdown: &CancellationToken) -> (u16, Vec<String>) {
    let (port, listeners) = pod_listeners(n).await;
    let mut urls = Vec::new();
    for listener in listeners {
        let argv = std::iter::once("kvroute-sim").chain(argv.iter().copied());
        let args = <SimArgs as clap::Parser>::parse_from(argv);
        urls.push(format!("http://{}", listener.local_addr().unwrap()));
        let server = kvroute_sim::SimServer::new(args, Arc::new(Tokenizer::fallback()));
        tokio::spawn(server.serve(listener, shutdown.clone()));
    }
    (port, urls)
}

/// A kvroute-sim replica serving on a port of its own and publishing KV events on a free one:
/// `args` makes its arguments from that endpoint (`tcp://127.0.0.1:PORT`). Returns once the
/// replica has bound its sockets, with the endpoint. The replica binds the event port (and any
/// other it is given) itself, so another test may take one first: then it is started again
/// with fresh ports.
pub async fn sim_with_events(mut args: impl FnMut(&str) -> SimArgs) -> (SimInstance, String) {
    let mut error = None;
    for _ in 0..20 {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let events = format!("tcp://127.0.0.1:{}", free_port());
        match SimInstance::start(args(&events), Arc::new(Tokenizer::fallback()), listener).await {
            Ok(sim) => return (sim, events),
            Err(e) => error = Some(e),
        }
    }
    panic!("no engine could bind its ports: {error:?}");
}

/// A kvroute-sim replica in a disaggregated role (`prefill` or `decode`) at `speedup`, seeded
/// with `seed`, publishing KV events (a prefill one with a bootstrap port): the replica, and
/// the router's spec for it, known as `id`.
pub async fn pd_engine(
    id: &str,
    role: &str,
    speedup: &str,
    seed: u64,
) -> (SimInstance, kvroute_gateway::WorkerSpec) {
    use kvroute_gateway::config::WorkerRole;
    let (sim, events) = sim_with_events(|events| {
        let bootstrap = free_port().to_string();
        let mut argv = vec![
            "kvroute-sim",
            "--role",
            role,
            "--kv-events-endpoint",
            events,
            "--speedup",
            speedup,
        ];
        if role == "prefill" {
            argv.extend(["--bootstrap-port", &bootstrap]);
        }
        SimArgs {
            seed,
            ..<SimArgs as clap::Parser>::parse_from(argv)
        }
    })
    .await;
    let spec = kvroute_gateway::WorkerSpec {
        id: Some(id.into()),
        kv_events: Some(events),
        role: if role == "prefill" {
            WorkerRole::Prefill
        } else {
            WorkerRole::Decode
        },
        bootstrap_port: sim.args().bootstrap_port,
        ..kvroute_gateway::WorkerSpec::url(sim.url())
    };
    (sim, spec)
}

/// `POST /debug/route` for `prompt`: the router's decision and its candidates.
pub async fn debug_route(r: &TestRouter, prompt: &str) -> Value {
    let body = serde_json::json!({ "prompt": prompt }).to_string();
    let reply = post(&r.url, "/debug/route", &[], &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    reply.json()
}

/// The device blocks a `/debug/route` answer credits `worker` with (its first rank listed);
/// `None` when `worker` is not a candidate.
pub fn device_overlap(debug: &Value, worker: &str) -> Option<u64> {
    debug["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["worker"] == worker)
        .map(|c| c["overlap_blocks"]["device"].as_u64().unwrap())
}

/// The device blocks the router's index credits `worker` with for `prompt`; `None` when
/// `worker` is not a candidate.
pub async fn overlap(r: &TestRouter, prompt: &str, worker: &str) -> Option<u64> {
    device_overlap(&debug_route(r, prompt).await, worker)
}

/// Waits until the device blocks the router credits `worker` with for `prompt` satisfy `cond`
/// (`None`: `worker` is not a candidate).
pub async fn wait_overlap(
    r: &TestRouter,
    prompt: &str,
    worker: &str,
    cond: impl Fn(Option<u64>) -> bool,
) {
    let what = format!("the router's credit to {worker} for the prompt");
    wait_until_async(&what, || async { cond(overlap(r, prompt, worker).await) }).await;
}

/// Waits until the router hears the KV events of worker `id`, the engine at `engine_url`: a
/// ZMQ subscriber joins asynchronously, and what the engine published before it did is lost.
/// Probes go straight to the engine until the index credits each of the worker's ranks with
/// one of them.
pub async fn joined(r: &TestRouter, engine_url: &str, id: &str) {
    let heard = std::cell::RefCell::new(std::collections::HashSet::new());
    for i in 0..400u64 {
        let probe = format!("probe {id} {i} {}", text(64, 1000 + i));
        let body = serde_json::json!({"prompt": probe, "max_tokens": 1}).to_string();
        let reply = post(engine_url, "/v1/completions", &[], &body).await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        // The probe's events reach the index a moment later, or never (published before the
        // subscriber joined): then the next probe tries again.
        let all_heard = std::cell::Cell::new(false);
        holds_within(Duration::from_millis(100), || async {
            let d = debug_route(r, &probe).await;
            let ranks: Vec<&Value> = d["candidates"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|c| c["worker"] == id)
                .collect();
            let Some(c) = ranks
                .iter()
                .find(|c| c["overlap_blocks"]["device"].as_u64().unwrap() > 0)
            else {
                return false;
            };
            let mut heard = heard.borrow_mut();
            heard.insert(c["dp_rank"].to_string());
            all_heard.set(heard.len() == ranks.len());
            true
        })
        .await;
        if all_heard.get() {
            return;
        }
    }
    panic!("the router never received {id}'s KV events");
}
