//! `--metrics-compat` against the real peers (opt-in): the same ten requests through
//! vllm-router 0.1.17, smg 1.13 and kvroute (round robin over the same two mock engines), then
//! each peer's scrape beside kvroute's, for the families kvroute exports under that peer's
//! names: the same sample names, label names, types and counts.
//!
//!     ../shared/peers/setup_peers.sh vllmr smg
//!     KVROUTE_PEERS_DIR=/tmp/kvroute-peers \
//!         cargo test -p kvroute-gateway --test metrics_differential -- --nocapture
//!
//! Without `KVROUTE_PEERS_DIR` it says so and checks nothing. Counters are compared as the
//! change over the ten requests (a scrape before, a scrape after), gauges as read after.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvroute_gateway::config::{MetricsCompat, MetricsPeer, PdProtocol, WorkerRole};
use kvroute_gateway::{Settings, WorkerSpec};
use support::*;

const REQUESTS: usize = 10;
const MODEL: &str = "mock-model";

/// One sample's labels, sorted by name.
type Labels = BTreeMap<String, String>;

/// A scrape: per sample name, its type (from `# TYPE`) and its samples.
#[derive(Debug, Default)]
struct Scrape {
    types: BTreeMap<String, String>,
    samples: BTreeMap<String, Vec<(Labels, f64)>>,
}

fn parse_labels(s: &str) -> Labels {
    let mut out = Labels::new();
    let mut rest = s;
    while let Some(eq) = rest.find('=') {
        let name = rest[..eq].trim_start_matches(',').trim().to_owned();
        let after = &rest[eq + 1..];
        let after = after.strip_prefix('"').unwrap_or(after);
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(match n {
                            'n' => '\n',
                            other => other,
                        });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.insert(name, value);
        rest = &after[end..];
    }
    out
}

fn parse(text: &str) -> Scrape {
    let mut s = Scrape::default();
    for line in text.lines() {
        let line = line.trim();
        if let Some(t) = line.strip_prefix("# TYPE ") {
            let mut it = t.split_whitespace();
            if let (Some(name), Some(ty)) = (it.next(), it.next()) {
                s.types.insert(name.to_owned(), ty.to_owned());
            }
            continue;
        }
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(open) => {
                let close = line.rfind('}').expect("closing brace");
                (
                    &line[..open],
                    parse_labels(&line[open + 1..close]),
                    &line[close + 1..],
                )
            }
            None => {
                let sp = line.find(' ').expect("a value");
                (&line[..sp], Labels::new(), &line[sp..])
            }
        };
        let value = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN);
        s.samples
            .entry(name.to_owned())
            .or_default()
            .push((labels, value));
    }
    s
}

impl Scrape {
    /// The type `# TYPE` gives a sample name (`x_total` under `# TYPE x counter` too).
    fn type_of(&self, sample: &str) -> Option<&str> {
        self.types
            .get(sample)
            .or_else(|| self.types.get(sample.strip_suffix("_total")?))
            .map(String::as_str)
    }

    fn label_names(&self, sample: &str) -> BTreeSet<String> {
        self.samples
            .get(sample)
            .into_iter()
            .flatten()
            .flat_map(|(l, _)| l.keys().cloned())
            .collect()
    }

    /// The sample's values by label set: a counter's change since `before`, a gauge's value.
    fn values(&self, sample: &str, before: &Scrape) -> BTreeMap<String, f64> {
        let counter = self.type_of(sample) == Some("counter");
        let prior = |l: &Labels| {
            before
                .samples
                .get(sample)
                .and_then(|v| v.iter().find(|(b, _)| b == l))
                .map_or(0.0, |(_, v)| *v)
        };
        self.samples
            .get(sample)
            .into_iter()
            .flatten()
            .map(|(l, v)| {
                let v = if counter { v - prior(l) } else { *v };
                (show(l), v)
            })
            .collect()
    }
}

fn show(l: &Labels) -> String {
    let inner: Vec<String> = l.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    format!("{{{}}}", inner.join(","))
}

/// A peer's router process, killed when dropped.
struct Peer {
    child: Child,
    name: String,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_peer(name: &str, program: &Path, args: &[String], log: &Path) -> Peer {
    let out = std::fs::File::create(log).unwrap();
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("{name}: {}: {e}", program.display()));
    Peer {
        child,
        name: name.to_owned(),
    }
}

/// Waits until `url` answers `/metrics` and a chat request through it succeeds once workers
/// are registered (that probe's request counts in both scrapes' baseline).
async fn wait_serving(peer: &Peer, url: &str, metrics_url: &str, log: &Path) {
    let body = chat(MODEL, "probe");
    let serving = holds_within(Duration::from_secs(90), || async {
        let listening = |u: &str| {
            let addr = addr_of(u);
            async move { tokio::net::TcpStream::connect(addr).await.is_ok() }
        };
        if !(listening(url).await && listening(metrics_url).await) {
            return false;
        }
        let probe = post(url, "/v1/chat/completions", &[], &body);
        tokio::time::timeout(Duration::from_secs(5), probe)
            .await
            .is_ok_and(|r| r.status == 200)
    })
    .await;
    assert!(
        serving,
        "{} did not serve in 90 s; its log:\n{}",
        peer.name,
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// The routing decisions a scrape counts: every router counts each of the requests in one of
/// these families as soon as it routes it.
fn routed(s: &Scrape) -> f64 {
    s.samples
        .iter()
        .filter(|(name, _)| {
            name.ends_with("processed_requests_total") || *name == "smg_worker_selection_total"
        })
        .flat_map(|(_, samples)| samples.iter().map(|(_, v)| v))
        .sum()
}

/// Sends the requests and returns the scrapes before and after.
async fn drive(url: &str, metrics_url: &str) -> (Scrape, Scrape) {
    let before = parse(&scrape(metrics_url).await);
    for i in 0..REQUESTS {
        let r = post(
            url,
            "/v1/chat/completions",
            &[],
            &chat(MODEL, &format!("hi {i}")),
        )
        .await;
        assert_eq!(r.status, 200, "{url}: {:?}", r.body);
    }
    // Every request's decision is counted (some routers count it as the answer ends).
    let after = std::cell::RefCell::new(Scrape::default());
    let counted = holds_within(Duration::from_secs(20), || async {
        let now = parse(&scrape(metrics_url).await);
        let all = routed(&now) - routed(&before) >= REQUESTS as f64;
        *after.borrow_mut() = now;
        all
    })
    .await;
    assert!(
        counted,
        "{metrics_url}: the {REQUESTS} requests are counted"
    );
    (before, after.into_inner())
}

/// The peer at `program` with `args` (its workers and policy) on free ports, driven.
async fn run_peer(
    name: &str,
    program: &Path,
    args: &[String],
    logs: &Path,
) -> (Scrape, Scrape, String) {
    let port = free_port();
    let mport = free_port();
    let mut all: Vec<String> = args.to_vec();
    for a in [
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        &mport.to_string(),
    ] {
        all.push(a.to_owned());
    }
    let log = logs.join(format!("{}.log", name.replace([' ', '/'], "-")));
    let peer = start_peer(name, program, &all, &log);
    let url = format!("http://127.0.0.1:{port}");
    let murl = format!("http://127.0.0.1:{mport}");
    wait_serving(&peer, &url, &murl, &log).await;
    let (before, after) = drive(&url, &murl).await;
    let text = scrape(&murl).await;
    std::fs::write(
        logs.join(format!("{}.metrics", name.replace([' ', '/'], "-"))),
        &text,
    )
    .unwrap();
    drop(peer);
    (before, after, text)
}

/// kvroute's scrapes with `s` (exporting `peer`'s names) over the same engines.
async fn run_kvroute(peer: MetricsPeer, mut s: Settings) -> (Scrape, Scrape, String) {
    s.metrics_compat = MetricsCompat::new(&[peer], None).unwrap();
    let router = TestRouter::start(s).await;
    let r = post(
        &router.url,
        "/v1/chat/completions",
        &[],
        &chat(MODEL, "probe"),
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let (before, after) = drive(&router.url, &router.metrics_url).await;
    let text = router.metrics().await;
    router.stop().await;
    (before, after, text)
}

fn role_spec(w: &MockWorker, role: WorkerRole) -> WorkerSpec {
    WorkerSpec {
        model: Some(MODEL.into()),
        role,
        bootstrap_port: (role == WorkerRole::Prefill).then_some(8998),
        ..w.spec()
    }
}

/// kvroute with `p` prefilling and `d` decoding under `protocol`, round robin.
fn pd_settings(p: &MockWorker, d: &MockWorker, protocol: PdProtocol) -> Settings {
    let mut s = Settings::with_workers(vec![
        role_spec(p, WorkerRole::Prefill),
        role_spec(d, WorkerRole::Decode),
    ])
    .unwrap();
    s.policy = kvroute_core::PolicyKind::RoundRobin;
    s.pd.as_mut()
        .expect("roles turn disaggregation on")
        .protocol = protocol;
    s
}

/// The differences between kvroute's and the peer's samples under `prefix`; empty when they
/// agree.
fn compare(
    peer: &str,
    prefix: &str,
    kv: &(Scrape, Scrape, String),
    real: &(Scrape, Scrape, String),
) -> Vec<String> {
    let (kb, ka, _) = kv;
    let (rb, ra, _) = real;
    let mut diffs = vec![];
    let ours: Vec<&String> = ka
        .samples
        .keys()
        .filter(|n| n.starts_with(prefix))
        .collect();
    for name in ours {
        let Some(_) = ra.samples.get(name) else {
            diffs.push(format!(
                "{peer}: {name}: exported by kvroute, absent from {peer}"
            ));
            continue;
        };
        let (kt, rt) = (ka.type_of(name), ra.type_of(name));
        if kt != rt {
            diffs.push(format!(
                "{peer}: {name}: type {kt:?} in kvroute, {rt:?} in {peer}"
            ));
        }
        let (kl, rl) = (ka.label_names(name), ra.label_names(name));
        if kl != rl {
            diffs.push(format!(
                "{peer}: {name}: label names {kl:?} in kvroute, {rl:?} in {peer}"
            ));
        }
        let kv = ka.values(name, kb);
        let rv = ra.values(name, rb);
        eprintln!("{peer}: {name} ({rt:?}, labels {rl:?}): {rv:?}");
        if kv != rv {
            diffs.push(format!(
                "{peer}: {name}: values differ\n    kvroute: {kv:?}\n    {peer}: {rv:?}"
            ));
        }
    }
    diffs
}

fn peers_dir() -> Option<PathBuf> {
    std::env::var_os("KVROUTE_PEERS_DIR").map(PathBuf::from)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peers_names_read_as_the_real_peers_write_them() {
    let Some(dir) = peers_dir() else {
        eprintln!("metrics_differential: KVROUTE_PEERS_DIR not set; nothing checked");
        return;
    };
    let logs = std::env::temp_dir().join(format!("kvroute-metrics-diff-{}", std::process::id()));
    std::fs::create_dir_all(&logs).unwrap();
    let a = MockWorker::start("a", &[MODEL]).await;
    let b = MockWorker::start("b", &[MODEL]).await;
    let (au, bu) = (a.url.clone(), b.url.clone());
    let vllm_router = dir.join("venv-vllmr/bin/vllm-router");
    let smg = dir.join("venv-smg/bin/smg");
    let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let cases = [
        (
            "vllm-router",
            MetricsPeer::VllmRouter,
            "vllm_router_",
            &vllm_router,
            args(&["--policy", "round_robin", "--worker-urls", &au, &bu]),
            settings(&[&a, &b]),
        ),
        (
            "smg",
            MetricsPeer::Smg,
            "smg_",
            &smg,
            args(&[
                "launch",
                "--policy",
                "round_robin",
                "--worker-urls",
                &au,
                &bu,
            ]),
            settings(&[&a, &b]),
        ),
        (
            "vllm-router P/D",
            MetricsPeer::VllmRouter,
            "vllm_router_",
            &vllm_router,
            args(&[
                "--vllm-pd-disaggregation",
                "--policy",
                "round_robin",
                "--prefill",
                &au,
                "--decode",
                &bu,
            ]),
            pd_settings(&a, &b, PdProtocol::Vllm),
        ),
        (
            "smg P/D",
            MetricsPeer::Smg,
            "smg_",
            &smg,
            args(&[
                "launch",
                "--pd-disaggregation",
                "--policy",
                "round_robin",
                "--prefill",
                &au,
                "8998",
                "--decode",
                &bu,
            ]),
            pd_settings(&a, &b, PdProtocol::Sglang),
        ),
    ];
    let only = std::env::var("KVROUTE_DIFF_ONLY").ok();
    let mut diffs = vec![];
    let mut texts = vec![];
    for (name, peer, prefix, program, args, kvroute) in cases {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        // The same engines for both: counters compare as their change over the requests.
        let real = run_peer(name, program, &args, &logs).await;
        let kv = run_kvroute(peer, kvroute).await;
        let found = compare(name, prefix, &kv, &real);
        let peer_families: BTreeSet<&String> = real
            .1
            .samples
            .keys()
            .filter(|n| n.starts_with(prefix))
            .collect();
        eprintln!("{name}: its families after {REQUESTS} requests: {peer_families:?}");
        if found.is_empty() {
            eprintln!("{name}: every family kvroute exports matches");
        }
        diffs.extend(found);
        texts.push((name, real.2, kv.2));
    }
    eprintln!(
        "metrics_differential: the peers' logs and scrapes are in {}",
        logs.display()
    );
    if !diffs.is_empty() {
        for (name, real, ours) in &texts {
            eprintln!("---- {name}'s scrape ----\n{real}\n---- kvroute's ----\n{ours}");
        }
        panic!(
            "kvroute's peer metrics differ from the real peers':\n  {}",
            diffs.join("\n  ")
        );
    }
}
