//! The tables `kvroute-bench` prints: one row per policy (and the pooled-LRU reference) for
//! `simulate`, one line per simulation and a table of brackets for `goodput`. Pure: each
//! function returns the text, the binary prints it.

use crate::goodput::{Bracket, Goodput, Probe};
use crate::replay::TenantTtft;
use crate::simulate::{Percentiles, PolicyResult, Reference};

/// The name column's width.
const NAME: usize = 20;

fn ms(p: &Percentiles) -> String {
    format!("{:.0}/{:.0}/{:.0}", p.p50, p.p90, p.p99)
}

fn scale(x: Option<f64>) -> String {
    x.map_or("-".to_owned(), |x| format!("x{x:.3}"))
}

/// Each `--slo-mix` class's attainment, `1000 ms 91.2% / 10000 ms 99.5%`; None without a mix.
fn class_attainment(r: &PolicyResult) -> Option<String> {
    let s = r.slo.as_ref()?;
    let classes: Vec<String> = (s.classes.iter())
        .map(|c| format!("{} ms {:.1}%", c.ttft_slo_ms, c.attainment * 100.0))
        .collect();
    Some(classes.join(" / "))
}

/// `simulate`'s column names.
pub fn simulate_header() -> String {
    format!(
        "{:<NAME$} {:>22} {:>22} {:>8} {:>9} {:>7} {:>7} {:>6}",
        "policy",
        "TTFT ms p50/p90/p99",
        "E2E ms p50/p90/p99",
        "req/s",
        "out tok/s",
        "hit %",
        "preempt",
        "loras"
    )
}

/// A policy's row (and a disaggregated cluster's second line); `wall_s` is what it took.
pub fn policy_row(r: &PolicyResult, wall_s: f64) -> String {
    let mut row = format!(
        "{:<NAME$} {:>22} {:>22} {:>8.2} {:>9.0} {:>7.1} {:>7} {:>6}   ({wall_s:.1}s; per worker {:?})",
        r.policy,
        ms(&r.ttft_ms),
        ms(&r.e2e_ms),
        r.throughput_rps,
        r.output_tokens_per_s,
        r.hit_share * 100.0,
        r.preemptions,
        r.lora_loads,
        r.requests_per_worker
    );
    if let Some(pd) = &r.pd {
        row.push_str(&format!(
            "\n{:<NAME$} decode-only {} / split {} ({:.1}% decode-only); per prefill worker {:?}; per decode worker {:?}; {} KV tokens transferred",
            "",
            pd.decode_only,
            pd.split,
            pd.decode_only as f64 * 100.0 / (pd.decode_only + pd.split).max(1) as f64,
            pd.prefill_requests_per_worker,
            pd.decode_requests_per_worker,
            pd.kv_transfer_tokens
        ));
    }
    if let Some(q) = &r.queue {
        row.push_str(&format!(
            "\n{:<NAME$} router queue (threshold {}, {}, tenants {:?}): {} queued ({:.1}%), {} timed out after {} s; wait ms p50/p90/p99 {}; at most {} waiting",
            "",
            q.threshold,
            q.policy,
            q.fairness,
            q.queued,
            q.queued as f64 * 100.0 / (r.requests + r.rejected + q.timed_out).max(1) as f64,
            q.timed_out,
            q.timeout_s,
            ms(&q.wait_ms),
            q.longest
        ));
    }
    if let Some(s) = &r.slo {
        row.push_str(&format!(
            "\n{:<NAME$} SLO ({}): {:.1}% of requests met their TTFT target, goodput {:.2} req/s",
            "",
            match s.routed_on_targets {
                true => "routed on targets",
                false => "targets not sent",
            },
            s.attainment * 100.0,
            s.goodput_rps
        ));
        for c in &s.classes {
            row.push_str(&format!(
                "\n{:<NAME$}   TTFT <= {} ms ({:.0}% of requests): {}/{} met ({:.1}%), TTFT ms p50/p90/p99 {}",
                "",
                c.ttft_slo_ms,
                c.fraction * 100.0,
                c.met,
                c.requests,
                c.attainment * 100.0,
                ms(&c.ttft_ms)
            ));
        }
    }
    if !r.fitted_lora_load_ms.is_empty() {
        let fitted: Vec<String> = r
            .fitted_lora_load_ms
            .iter()
            .map(|ms| format!("{ms:.0}"))
            .collect();
        row.push_str(&format!(
            "\n{:<NAME$} fitted LoRA load ms per worker [{}]",
            "",
            fitted.join(", ")
        ));
    }
    for t in &r.tenants {
        row.push_str(&format!(
            "\n{:<NAME$} {}: {} requests ({} answered), TTFT ms p50/p90/p99 {} (router queue {}), {:.1}% of tokens served to the last arrival",
            "",
            t.tenant,
            t.requests,
            t.answered,
            ms(&t.ttft_ms),
            ms(&t.router_wait_ms),
            t.token_share * 100.0
        ));
    }
    row
}

/// `replay`'s line per tenant, as `simulate`'s (no router queue or token share: the replay
/// sees only its answers).
pub fn replay_tenant_rows(tenants: &[TenantTtft]) -> String {
    tenants
        .iter()
        .map(|t| {
            format!(
                "{}: {} requests ({} answered), TTFT ms p50/p90/p99 {}",
                t.tenant,
                t.requests,
                t.answered,
                ms(&t.ttft_ms)
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The reference's row: no throughput or preemptions (each request runs alone).
pub fn reference_row(r: &Reference, wall_s: f64) -> String {
    format!(
        "{:<NAME$} {:>22} {:>22} {:>8} {:>9} {:>7.1} {:>7}   ({wall_s:.1}s; each request alone on an idle engine with what one LRU cache of {} blocks of {} tokens held: {:.1}% of prompt tokens)",
        r.name,
        ms(&r.ttft_ms),
        ms(&r.e2e_ms),
        "-",
        "-",
        r.hit_share * 100.0,
        "-",
        r.capacity_hash_blocks,
        r.hash_block,
        r.pooled_share * 100.0
    )
}

/// A `goodput` simulation as it ends, with the bracket so far.
pub fn goodput_progress(policy: &str, p: &Probe, b: &Bracket, wall_s: f64) -> String {
    let classes = class_attainment(&p.result).map_or(String::new(), |c| format!(", met {c}"));
    format!(
        "{policy:<NAME$} run {:>2}: x{:<7.3} TTFT p90 {:>6.0} ms, E2E p90 {:>6.0} ms{classes}: {}; passes at {}, fails at {} ({wall_s:.1}s)",
        b.runs.len(),
        p.rate_scale,
        p.result.ttft_ms.p90,
        p.result.e2e_ms.p90,
        if p.passes { "pass" } else { "FAIL" },
        scale(b.pass),
        scale(b.fail),
    )
}

/// `goodput`'s table: each cluster's bracket, with the figures of its run at the passing end.
pub fn goodput_table(results: &[Goodput]) -> String {
    let mut t = format!(
        "{:<NAME$} {:>9} {:>9} {:>8} {:>22} {:>22} {:>5}",
        "policy",
        "passes at",
        "fails at",
        "req/s",
        "TTFT ms p50/p90/p99",
        "E2E ms p50/p90/p99",
        "runs"
    );
    for g in results {
        let pass = g.pass.as_ref().map(|p| &p.result);
        let or_dash = |f: &dyn Fn(&PolicyResult) -> String| pass.map_or("-".to_owned(), f);
        t.push_str(&format!(
            "\n{:<NAME$} {:>9} {:>9} {:>8} {:>22} {:>22} {:>5}",
            g.policy,
            scale(g.pass.as_ref().map(|p| p.rate_scale)),
            scale(g.fail.as_ref().map(|p| p.rate_scale)),
            or_dash(&|r| format!("{:.2}", r.throughput_rps)),
            or_dash(&|r| ms(&r.ttft_ms)),
            or_dash(&|r| ms(&r.e2e_ms)),
            g.runs
        ));
        if let Some(c) = pass.and_then(class_attainment) {
            t.push_str(&format!("\n{:<NAME$} met at the pass: {c}", ""));
        }
    }
    t.push_str("\n(req/s, TTFT, E2E and, with --slo-mix, each class's attainment: the run at the highest passing rate)");
    t
}
