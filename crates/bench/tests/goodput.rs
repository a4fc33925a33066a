//! `kvroute-bench goodput` and `simulate`'s reference, end to end: the binary on a tiny
//! synthetic workload, read back from its JSON.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// Small multi-turn chats on two small engines: 24 requests, each simulation milliseconds.
const WORKLOAD: &str = "--synthetic multi-turn --conversations 8 --turns 3 --turn-len 300 \
    --output-len 20 --request-rate 4 --workers 2 --num-gpu-blocks 512 --seed 5";

/// Runs the binary with `args` and `--json FILE`; the JSON it wrote.
fn run(name: &str, args: &str) -> Value {
    let out: PathBuf = [env!("CARGO_TARGET_TMPDIR"), name].iter().collect();
    let status = Command::new(env!("CARGO_BIN_EXE_kvroute-bench"))
        .args(args.split_whitespace())
        .arg("--json")
        .arg(&out)
        .output()
        .expect("the binary runs");
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
}

#[test]
fn goodput_brackets_each_policys_highest_rate_meeting_the_slo() {
    let slo = 80.0;
    let doc = run(
        "goodput.json",
        &format!("goodput {WORKLOAD} --policies kv_aware,round_robin --slo-ttft-p90-ms {slo}"),
    );
    assert_eq!(doc["slo"]["ttft_p90_ms"], slo);
    let policies = doc["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 2);
    for p in policies {
        let (pass, fail) = (&p["pass"], &p["fail"]);
        let (lo, hi) = (
            pass["rate_scale"].as_f64().expect("a passing rate"),
            fail["rate_scale"].as_f64().expect("a failing rate"),
        );
        assert!(lo < hi, "{p}");
        assert!(pass["passes"].as_bool().unwrap() && !fail["passes"].as_bool().unwrap());
        assert!(pass["ttft_ms"]["p90"].as_f64().unwrap() <= slo, "{p}");
        assert!(fail["ttft_ms"]["p90"].as_f64().unwrap() > slo, "{p}");
        let bisections = p["bisections"].as_u64().unwrap();
        assert!((hi - lo) / lo <= 0.02 || bisections == 8, "{p}");
        assert!(bisections <= 8);
    }
    // Deterministic: the same run, the same brackets.
    let again = run(
        "goodput-again.json",
        &format!("goodput {WORKLOAD} --policies kv_aware,round_robin --slo-ttft-p90-ms {slo}"),
    );
    assert_eq!(again["policies"], doc["policies"]);
}

#[test]
fn goodput_reports_an_open_end_when_the_range_given_passes() {
    let doc = run(
        "goodput-open.json",
        &format!(
            "goodput {WORKLOAD} --policies round_robin --slo-ttft-p90-ms 1e9 --min-rate-scale 0.5 --max-rate-scale 2"
        ),
    );
    let p = &doc["policies"][0];
    assert_eq!(p["pass"]["rate_scale"], 2.0);
    assert!(p["fail"].is_null());
    assert_eq!(p["runs"], 2);
}

/// Each policy's passing and failing rate scales, and its runs.
fn brackets(doc: &Value) -> Vec<(f64, f64, u64)> {
    let policies = doc["policies"].as_array().unwrap();
    (policies.iter())
        .map(|p| {
            let rate = |end: &str| p[end]["rate_scale"].as_f64().expect("both ends");
            (rate("pass"), rate("fail"), p["runs"].as_u64().unwrap())
        })
        .collect()
}

#[test]
fn goodput_of_one_class_at_90_percent_is_the_ttft_p90_objective() {
    // Every request is answered here, so a class of all requests meeting 80 ms for 90% of
    // them is the nearest-rank TTFT p90 within 80 ms: the same runs, the same brackets.
    let policies = "--policies kv_aware,round_robin";
    let p90 = run(
        "goodput-p90.json",
        &format!("goodput {WORKLOAD} {policies} --slo-ttft-p90-ms 80"),
    );
    let one = run(
        "goodput-one-class.json",
        &format!("goodput {WORKLOAD} {policies} --slo-mix 1:80 --slo-headers drop"),
    );
    assert_eq!(brackets(&one), brackets(&p90));
    assert_eq!(one["slo"]["attainment"], 0.9);
    assert_eq!(one["slo"]["classes"][0]["ttft_ms"], 80.0);
    assert_eq!(one["slo"]["headers"], "drop");
}

#[test]
fn goodput_of_a_mix_needs_every_class_and_a_looser_target_passes_higher() {
    // The same fractions draw the same classes, and the router is blind to them: the runs
    // differ only in what they are measured against.
    let mix = |name: &str, mix: &str| {
        run(
            name,
            &format!(
                "goodput {WORKLOAD} --policies kv_aware,round_robin --slo-mix {mix} --slo-headers drop"
            ),
        )
    };
    let tight = mix("goodput-tight.json", "0.5:60,0.5:400");
    let loose = mix("goodput-loose.json", "0.5:80,0.5:400");
    for (t, l) in brackets(&tight).iter().zip(brackets(&loose)) {
        assert!(l.0 > t.0, "loose {l:?}, tight {t:?}");
    }
    for doc in [&tight, &loose] {
        for p in doc["policies"].as_array().unwrap() {
            let attainment = |end: &str| -> Vec<f64> {
                let classes = p[end]["slo"]["classes"].as_array().unwrap();
                (classes.iter())
                    .map(|c| c["attainment"].as_f64().unwrap())
                    .collect()
            };
            // Each class at the passing end; some class short of it at the failing end.
            assert!(attainment("pass").iter().all(|a| *a >= 0.9), "{p}");
            assert!(attainment("fail").iter().any(|a| *a < 0.9), "{p}");
            assert!(p["pass"]["passes"].as_bool().unwrap());
        }
    }
}

#[test]
fn simulate_puts_the_reference_beside_the_policies() {
    let doc = run(
        "simulate.json",
        &format!("simulate {WORKLOAD} --policies kv_aware,round_robin"),
    );
    assert_eq!(doc["policies"].as_array().unwrap().len(), 2);
    let r = &doc["reference"];
    assert_eq!(r["name"], "pooled-LRU reference");
    // 2 engines x 512 blocks x 16 tokens in 512-token hash blocks.
    assert_eq!(r["capacity_hash_blocks"], 32);
    assert_eq!(r["requests"], 24);
    // No policy's hit share is above the reference's on chats this small (all fit), and no
    // TTFT p50 below it.
    let share = r["hit_share"].as_f64().unwrap();
    assert!(share > 0.3, "{r}");
    for p in doc["policies"].as_array().unwrap() {
        assert!(p["hit_share"].as_f64().unwrap() <= share + 1e-9, "{p}");
        assert!(p["ttft_ms"]["p50"].as_f64().unwrap() >= r["ttft_ms"]["p50"].as_f64().unwrap());
    }
}

#[test]
fn simulate_reports_the_router_queue_under_its_own_key() {
    // Prompts of 300 tokens per turn over engines of 64 tokens a step: a threshold of 1
    // saturates both engines with two requests each.
    let engines = "--max-num-batched-tokens 64 --policies kv_aware --rate-scale 8";
    let plain = run("no_queue.json", &format!("simulate {WORKLOAD} {engines}"));
    let queued = run(
        "queue.json",
        &format!(
            "simulate {WORKLOAD} {engines} --router-queue-threshold 1 --router-queue-policy wspt"
        ),
    );
    let (plain, queued) = (&plain["policies"][0], &queued["policies"][0]);
    assert!(plain.get("queue").is_none(), "{plain}");
    let q = &queued["queue"];
    assert_eq!(
        (q["threshold"].as_f64(), q["policy"].as_str()),
        (Some(1.0), Some("wspt"))
    );
    assert!(q["queued"].as_u64().unwrap() > 0, "{q}");
    assert_eq!(q["timed_out"], 0);
    assert!(q["wait_ms"]["p99"].as_f64().unwrap() > 0.0, "{q}");
    // The other keys are as without the queue.
    let keys = |v: &Value| {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.retain(|k| k != "queue");
        k
    };
    assert_eq!(keys(plain), keys(queued));
    assert_eq!(queued["requests"], 24);
}
