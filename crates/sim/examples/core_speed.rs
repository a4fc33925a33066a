//! How much faster than real time the engine core simulates a full batch.
//!
//!     cargo run --release -p kvroute-sim --example core_speed [-- BATCH SIM_SECONDS]
//!
//! Keeps BATCH (default 256) sequences running (512-token prompts, 256-token outputs, a
//! finished one replaced at once) for SIM_SECONDS (default 600) of simulated time and
//! prints simulated seconds per wall-clock second.

use std::time::{Duration, Instant};

use kvroute_sim::engine::{EngineConfig, EngineCore, EngineRequest, RequestId};

fn main() {
    let mut args = std::env::args().skip(1);
    let batch: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(256);
    let sim_secs: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(600.0);
    let mut core = EngineCore::new(EngineConfig {
        max_num_seqs: batch,
        ..EngineConfig::default()
    });
    let mut next = 0u64;
    let mut add = |core: &mut EngineCore| {
        let prompt: Vec<u32> = (0..512u32)
            .map(|i| (next as u32).wrapping_mul(2654435761) ^ i)
            .collect();
        core.add_request(EngineRequest {
            id: RequestId(next),
            prompt,
            max_tokens: 256,
            salt: 0,
            lora: None,
            priority: 0,
        })
        .expect("fits");
        next += 1;
    };
    for _ in 0..batch {
        add(&mut core);
    }
    let limit = Duration::from_secs_f64(sim_secs);
    let mut now = Duration::ZERO;
    let (mut steps, mut tokens, mut full_steps, mut decoded) = (0u64, 0u64, 0u64, 0u64);
    let wall = Instant::now();
    while now < limit {
        let out = core.step(now);
        now += out.duration;
        steps += 1;
        decoded += out.work.decode_seqs as u64;
        tokens += out.tokens.len() as u64;
        if out.work.decode_seqs == batch {
            full_steps += 1;
        }
        for t in &out.tokens {
            if t.finished {
                add(&mut core);
            }
        }
    }
    let wall = wall.elapsed().as_secs_f64();
    println!(
        "batch={batch} simulated={:.1}s wall={wall:.3}s speed={:.0}x real time steps={steps} ({:.1} us/step, mean decode batch {:.0}, {full_steps} steps with all {batch} decoding) tokens={tokens} preemptions={}",
        now.as_secs_f64(),
        now.as_secs_f64() / wall,
        wall * 1e6 / steps as f64,
        decoded as f64 / steps as f64,
        core.stats().preemptions,
    );
}
