//! What reading an engine's KV-event message costs the router: `decode_batch` (the direct
//! reader) against `decode_batch_via_tree` (the same answer through a generic msgpack tree,
//! which the router used before), on the messages of `kvroute-bench firehose`'s engines at
//! full size (a step: one 32-block `BlockStored` and 32 one-block `BlockRemoved`s), in
//! vLLM's positional encoding and in the tagged maps of vLLM 0.32.
//!
//!     cargo run --release -p kvroute-bench --example decode_cost [-- MESSAGES]

use std::hint::black_box;
use std::time::Instant;

use kvroute_bench::firehose::{Engine, Shape};
use kvroute_protocol::kv_events::{decode_batch, decode_batch_via_tree, encode_batch, Encoding};

fn main() {
    let messages: usize = std::env::args()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    let shape = Shape {
        engine_blocks: 4096,
        block_size: 16,
        prefixes: 64,
        prefix_blocks: 32,
        suffix_blocks: 32,
    };
    let mut engine = Engine::new(0, &shape, 7);
    // Past the first steps, which fill the cache: every step stores and evicts.
    let steps: Vec<_> = (0..1000 + messages)
        .map(|_| engine.step(&shape))
        .skip(1000)
        .collect();
    let blocks: usize = steps.iter().map(|(_, blocks)| blocks).sum();
    for encoding in [Encoding::Array, Encoding::Map] {
        let payloads: Vec<Vec<u8>> = (steps.iter())
            .map(|(batch, _)| encode_batch(batch, encoding))
            .collect();
        let bytes: usize = payloads.iter().map(Vec::len).sum();
        for (payload, (batch, _)) in payloads.iter().zip(&steps) {
            assert_eq!(&decode_batch(payload).expect("valid"), batch);
        }
        let time = |decode: &dyn Fn(&[u8]) -> usize| {
            let mut best = f64::MAX;
            for _ in 0..5 {
                let start = Instant::now();
                for payload in &payloads {
                    black_box(decode(payload));
                }
                best = best.min(start.elapsed().as_secs_f64());
            }
            best
        };
        let direct = time(&|p| decode_batch(p).map_or(0, |b| b.events.len()));
        let tree = time(&|p| decode_batch_via_tree(p).map_or(0, |b| b.events.len()));
        let per = |secs: f64| {
            format!(
                "{:.2} µs a message, {:.0} ns a block event",
                secs * 1e6 / messages as f64,
                secs * 1e9 / blocks as f64
            )
        };
        println!(
            "{encoding:?} ({:.0} bytes a message): direct {}; tree {}; direct/tree {:.2}x the time",
            bytes as f64 / messages as f64,
            per(direct),
            per(tree),
            direct / tree
        );
    }
}
