//! KV events through the router's `KvState` one at a time against in batches, in vLLM's shape:
//! an evicted block is an event of its own, and an engine step's events come as one batch.
//!
//!     cargo run --release -p kvroute-gateway --example event_batches [-- ROUNDS PER_BATCH]
//!
//! The index is built from `kvroute-index`'s `query_latency` workload (1 M blocks, 64
//! replicas), then its churn is applied ROUNDS times (10): conversations stored, then removed
//! a block an event, either each event under its own write (as before batches) or PER_BATCH
//! (16) removals under one write (`KvState::batch`), with one index (`--router-event-threads
//! 1`) and with two shards (`2`, every event from this one thread). Prints block events/s.

use std::sync::Arc;
use std::time::Instant;

use kvroute_gateway::kv::KvState;
use kvroute_gateway::prompts::Prompts;
use kvroute_gateway::Settings;
use kvroute_index::StorageTier;
use kvroute_tokenizer::Tokenizer;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[path = "../../index/benches/support/workload.rs"]
mod workload;

fn state(event_threads: usize) -> KvState {
    let mut settings = Settings::with_workers(Vec::new()).expect("no workers is valid");
    settings.block_size = workload::BS;
    settings.event_threads = event_threads;
    settings.max_indexed_blocks = 100_000_000;
    let mut registry = Registry::default();
    let tokenizer = Arc::new(Tokenizer::fallback());
    let prompts = Prompts::new(tokenizer, workload::BS, 0, &mut registry);
    KvState::new(&settings, prompts, (Gauge::default(), Gauge::default()))
}

fn main() {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(default)
    };
    let (rounds, per) = (arg(1, 10), arg(2, 16).max(1));
    let load = workload::build(1_000_000, 7);
    for threads in [1, 2] {
        for batched in [false, true] {
            let kv = state(threads);
            for s in &load.build {
                kv.stored(s.replica, &s.event()).expect("valid");
            }
            let start = Instant::now();
            for _ in 0..rounds {
                for s in &load.churn {
                    kv.stored(s.replica, &s.event()).expect("valid");
                }
                for (replica, hashes) in &load.churn_removed {
                    if batched {
                        for group in hashes.chunks(per) {
                            kv.batch(*replica, &mut |events| {
                                for hash in group {
                                    events.removed(StorageTier::Device, std::slice::from_ref(hash));
                                }
                            });
                        }
                    } else {
                        for hash in hashes {
                            kv.removed(*replica, StorageTier::Device, std::slice::from_ref(hash));
                        }
                    }
                }
            }
            let how = match batched {
                true => format!("removals {per} a batch"),
                false => "one event a write".to_string(),
            };
            let events = (rounds * 2 * load.churn_blocks) as f64;
            println!(
                "event threads {threads}, {how}: churn {:.2} M block events/s",
                events / start.elapsed().as_secs_f64() / 1e6
            );
        }
    }
}
