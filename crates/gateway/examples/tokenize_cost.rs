//! What routing a long, growing conversation costs with a real tokenizer, with and without
//! the prefix cache: the decision `POST /debug/route` makes (parse, render the chat template,
//! tokenise, hash, score), beside the tokenizer's own encode of the same text.
//!
//!     cargo run --release -p kvroute-gateway --example tokenize_cost [-- TOKENIZER_DIR]
//!
//! Agent-like chats of 50-60k characters (code and prose, 60 turns), 4 workers, kv_aware;
//! then 100k distinct conversations through a 32 MiB cache, for its bound. `REPS` (default
//! 30) decisions per row; `CONVERSATIONS` (default 100000) for the bound.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::PolicyKind;
use kvroute_gateway::kv::KvState;
use kvroute_gateway::prompts::Prompts;
use kvroute_gateway::routing;
use kvroute_gateway::workers::WorkerSet;
use kvroute_gateway::{Settings, WorkerSpec};
use kvroute_protocol::RoutingFields;
use kvroute_tokenizer::{ChatOptions, PrefixCache, Tokenizer};
use serde_json::{json, Value};

/// Deterministic text: words, and now and then a code block.
struct Text(u64);

impl Text {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn words(&mut self, n: usize) -> String {
        let mut s = String::new();
        for i in 0..n {
            let x = self.next();
            for k in 0..2 + (x % 7) as usize {
                s.push((b'a' + ((x >> (k * 5)) % 26) as u8) as char);
            }
            s.push(if i % 12 == 11 { '\n' } else { ' ' });
        }
        s
    }

    fn turn(&mut self, i: usize) -> Value {
        let role = if i.is_multiple_of(2) {
            "user"
        } else {
            "assistant"
        };
        let mut content = self.words(120);
        if i % 2 == 1 {
            content.push_str("```rust\n");
            for l in 0..12 {
                content.push_str(&format!("    let v{l} = f{}(x, {l});\n", self.next() % 97));
            }
            content.push_str("```\n");
        }
        json!({"role": role, "content": content})
    }
}

fn conversation(seed: u64, turns: usize) -> Vec<Value> {
    let mut t = Text(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut m = vec![json!({"role": "system", "content": t.words(300)})];
    m.extend((0..turns).map(|i| t.turn(i)));
    m
}

fn body(messages: &[Value]) -> String {
    json!({"model": "m", "messages": messages}).to_string()
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

struct Router {
    kv: KvState,
    set: WorkerSet,
}

impl Router {
    fn new(tokenizer: &Arc<Tokenizer>, cache_bytes: usize) -> Self {
        let specs: Vec<WorkerSpec> = (0..4)
            .map(|i| WorkerSpec {
                id: Some(format!("w{i}")),
                model: Some("m".into()),
                ..WorkerSpec::url(format!("http://127.0.0.1:{}", 9000 + i))
            })
            .collect();
        let mut settings = Settings::with_workers(specs).unwrap();
        settings.policy = PolicyKind::KvAware;
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = kvroute_gateway::metrics::GatewayMetrics::register(&mut registry);
        let set = WorkerSet::new(&settings, &metrics);
        for i in 0..4 {
            set.set_healthy(&format!("w{i}"), true);
        }
        let prompts = Prompts::new(tokenizer.clone(), 16, cache_bytes, &mut registry);
        let size = (
            metrics.kv_index_blocks.clone(),
            metrics.kv_index_bytes.clone(),
        );
        Self {
            kv: KvState::new(&settings, prompts, size),
            set,
        }
    }

    /// One decision as `/debug/route` makes it: (time, prompt tokens).
    fn decide(&self, body: &str) -> (Duration, usize) {
        let t = Instant::now();
        let fields = RoutingFields::from_json(body.as_bytes()).unwrap();
        let tokens = routing::prompt_tokens(&self.kv.prompts, body.as_bytes(), &fields).unwrap();
        let table = self.set.table();
        let plan = routing::plan(
            &self.kv,
            table.resolve(Some("m")).unwrap(),
            None,
            &Default::default(),
            &Default::default(),
            None,
            &fields,
            &tokens,
            Instant::now(),
            true,
        )
        .unwrap();
        (t.elapsed(), plan.prompt_tokens)
    }
}

fn row(name: &str, v: &mut [Duration], base: Duration) {
    let p50 = pct(v, 0.5);
    println!(
        "{name:<44} p50={:>9.2?} p90={:>9.2?}  {:.2}x",
        p50,
        pct(v, 0.9),
        p50.as_secs_f64() / base.as_secs_f64()
    );
}

fn main() {
    let dir = std::env::args().nth(1).unwrap_or_else(|| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/tiny-llama").into()
    });
    let tokenizer = Arc::new(Tokenizer::load(std::path::Path::new(&dir)).expect("tokenizer"));
    let reps: u64 = std::env::var("REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let turns = 60;
    let opts = ChatOptions {
        add_generation_prompt: true,
        ..ChatOptions::default()
    };
    let sample = conversation(1, turns);
    let text = tokenizer
        .render_chat(&Value::Array(sample.clone()), &opts)
        .unwrap();
    println!(
        "tokenizer={dir} chat: {} messages, {} characters, {} tokens",
        sample.len(),
        text.chars().count(),
        tokenizer.encode(&text, false).unwrap().len()
    );

    let (mut encode, mut off, mut fresh, mut extend, mut repeat) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let uncached = Router::new(&tokenizer, 0);
    let cached = Router::new(&tokenizer, 256 << 20);
    for seed in 10..10 + reps {
        let chat = conversation(seed, turns);
        let text = tokenizer
            .render_chat(&Value::Array(chat.clone()), &opts)
            .unwrap();
        let t = Instant::now();
        let ids = tokenizer.encode(&text, false).unwrap();
        encode.push(t.elapsed());
        let b = body(&chat);
        let (d, n) = uncached.decide(&b);
        assert_eq!(n, ids.len());
        off.push(d);
        // A conversation never seen: a miss, which fills the cache.
        let (d, n) = cached.decide(&b);
        assert_eq!(n, ids.len());
        fresh.push(d);
        // The same conversation one turn on, and then again as it is.
        let longer = body(&conversation(seed, turns + 1));
        let (d, n) = cached.decide(&longer);
        assert_eq!(n, uncached.decide(&longer).1, "cached ids equal fresh ones");
        extend.push(d);
        repeat.push(cached.decide(&longer).0);
    }
    let base = pct(&mut encode, 0.5);
    println!("ratios: to the tokenizer's own encode of the rendered text");
    row(
        "tokenizer encode (the `tokenizers` crate)",
        &mut encode,
        base,
    );
    row("decision, no cache (before)", &mut off, base);
    row("decision, cache on, fresh conversation", &mut fresh, base);
    row("decision, cache on, one turn on", &mut extend, base);
    row("decision, cache on, same chat again", &mut repeat, base);
    let fresh50 = pct(&mut fresh, 0.5);
    println!(
        "one turn on / fresh: {:.3}x",
        pct(&mut extend, 0.5).as_secs_f64() / fresh50.as_secs_f64()
    );

    // The bound, over many distinct conversations (short ones, to keep the run short).
    let n: u64 = std::env::var("CONVERSATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let bound = 32 << 20;
    let cache = PrefixCache::new(bound, None);
    let before = rss_kib();
    let t = Instant::now();
    for seed in 0..n {
        let chat = conversation(1_000_000 + seed, 1);
        let text = tokenizer.render_chat(&Value::Array(chat), &opts).unwrap();
        tokenizer.encode_cached(&text, false, &cache).unwrap();
    }
    println!(
        "{n} distinct conversations in {:.1?}: cache holds {} entries, {:.1} MiB of a {:.0} MiB bound; RSS grew {:.1} MiB",
        t.elapsed(),
        cache.len(),
        cache.bytes() as f64 / (1 << 20) as f64,
        bound as f64 / (1 << 20) as f64,
        (rss_kib().saturating_sub(before)) as f64 / 1024.0
    );
}
