//! What reading one engine's `/metrics` costs the router: `engine_metrics::parse` on a body
//! shaped as vLLM's (two engines' gauges, its cache config, eight histograms of 20 buckets
//! each, with their `# HELP` and `# TYPE` lines), and on kvroute-sim's smaller one. At
//! 1,024 engines scraped every 50 ms (`--metrics-refresh-ms`), the router parses 20,000
//! bodies a second.
//!
//!     cargo run --release -p kvroute-gateway --example metrics_parse [-- ROUNDS]

use std::fmt::Write;
use std::hint::black_box;
use std::time::Instant;

use kvroute_gateway::engine_metrics::parse;

/// A body of `engines` engines and `histograms` histograms of 20 buckets.
fn body(engines: usize, histograms: usize) -> String {
    let mut text = String::new();
    let gauge = |text: &mut String, name: &str, value: &str| {
        let _ = writeln!(text, "# HELP {name} A gauge.\n# TYPE {name} gauge");
        for e in 0..engines {
            let _ = writeln!(text, "{name}{{engine=\"{e}\",model_name=\"m\"}} {value}");
        }
    };
    gauge(&mut text, "vllm:num_requests_running", "3.0");
    gauge(&mut text, "vllm:num_requests_waiting", "0.0");
    gauge(&mut text, "vllm:kv_cache_usage_perc", "0.25");
    let _ = writeln!(text, "# TYPE vllm:cache_config_info gauge");
    for e in 0..engines {
        let _ = writeln!(
            text,
            "vllm:cache_config_info{{block_size=\"16\",engine=\"{e}\",num_gpu_blocks=\"16384\"}} 1.0"
        );
    }
    for h in 0..histograms {
        let name = format!("vllm:histogram_{h}_seconds");
        let _ = writeln!(text, "# HELP {name} A histogram.\n# TYPE {name} histogram");
        for e in 0..engines {
            for b in 0..20 {
                let le = 0.001 * f64::from(1u32 << b);
                let _ = writeln!(
                    text,
                    "{name}_bucket{{engine=\"{e}\",le=\"{le}\",model_name=\"m\"}} {}.0",
                    b * 7
                );
            }
            let _ = writeln!(text, "{name}_sum{{engine=\"{e}\",model_name=\"m\"}} 1234.5");
            let _ = writeln!(
                text,
                "{name}_count{{engine=\"{e}\",model_name=\"m\"}} 140.0"
            );
        }
    }
    text
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(20_000);
    for (label, body) in [
        ("vLLM-shaped", body(2, 8)),
        ("kvroute-sim-shaped", body(1, 3)),
    ] {
        let readings = parse(&body).expect("a valid body");
        assert_eq!(readings.len(), if label == "vLLM-shaped" { 2 } else { 1 });
        let lines = body.lines().count();
        let mut best = f64::MAX;
        for _ in 0..5 {
            let start = Instant::now();
            for _ in 0..rounds {
                black_box(parse(black_box(&body)).map(|r| r.len()).unwrap_or(0));
            }
            best = best.min(start.elapsed().as_secs_f64() / rounds as f64);
        }
        println!(
            "{label}: {} bytes, {lines} lines: {:.2} µs a body, {:.0} ns a line",
            body.len(),
            best * 1e6,
            best * 1e9 / lines as f64
        );
    }
}
