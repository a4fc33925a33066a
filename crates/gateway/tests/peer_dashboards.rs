//! The peers' published dashboards: every family that `docs/observability.md` ("The peers'
//! published dashboards") says kvroute fills is exported with `--metrics-compat`, with the
//! label names the docs give. The docs' tables are the test data: a row whose last cell starts
//! with "filled" names its families in backticks, `name{label,label}`.

mod support;

use std::collections::BTreeSet;

use kvroute_gateway::config::{MetricsCompat, MetricsPeer};
use support::*;

const SECTION: &str = "#### The peers' published dashboards";

/// `(family, label names)` for each family a "filled" row names.
fn claimed_families(docs: &str) -> Vec<(String, BTreeSet<String>)> {
    let start = docs.find(SECTION).expect("the docs have the section");
    let section = &docs[start + SECTION.len()..];
    let end = section.find("\n#").unwrap_or(section.len());
    let mut claims = vec![];
    for row in section[..end].lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        if cells.len() < 3 || !cells[cells.len() - 1].starts_with("filled") {
            continue;
        }
        for code in cells[1].split('`').skip(1).step_by(2) {
            let (name, labels) = code.split_once('{').unwrap_or((code, "}"));
            let labels = labels.trim_end_matches('}');
            let labels = labels
                .split(',')
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
                .collect();
            claims.push((name.to_owned(), labels));
        }
    }
    claims
}

/// The label names of each sample of `family` (a histogram's `_count`, without `le`).
fn label_names(scrape: &str, family: &str) -> Vec<BTreeSet<String>> {
    let count = format!("{family}_count");
    scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let name_end = l.find(['{', ' '])?;
            let name = &l[..name_end];
            if name != family && name != count {
                return None;
            }
            let mut names = BTreeSet::new();
            if l[name_end..].starts_with('{') {
                let body = &l[name_end + 1..l.rfind('}')?];
                // `name="value",...`: a value is quoted and may hold commas.
                let mut rest = body;
                while let Some((label, after)) = rest.split_once("=\"") {
                    names.insert(label.trim_start_matches(',').to_owned());
                    let mut end = 0;
                    let bytes = after.as_bytes();
                    let closes = |i: usize| bytes[i] == b'"' && (i == 0 || bytes[i - 1] != b'\\');
                    while end < bytes.len() && !closes(end) {
                        end += 1;
                    }
                    rest = &after[(end + 1).min(after.len())..];
                }
            }
            Some(names)
        })
        .collect()
}

#[test]
fn the_docs_rows_parse() {
    let docs = "#### The peers' published dashboards\n\
        | Panel | Families | kvroute |\n|---|---|---|\n\
        | A | `a_total{route}` | filled |\n\
        | B | `b{x,y}`, `c` | filled (as ...) |\n\
        | C | `d{z}` | not filled: none |\n\
        ## Next\n| E | `e` | filled |\n";
    let claims = claimed_families(docs);
    let names: Vec<&str> = claims.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["a_total", "b", "c"]);
    assert_eq!(claims[1].1, BTreeSet::from(["x".into(), "y".into()]));
    assert!(claims[2].1.is_empty());
    let scrape = "# TYPE h histogram\nh_bucket{le=\"0.1\"} 1\nh_count 1\n\
        f{name=\"a,b\",pod=\"x\\\"y\"} 1\ng{name=\"\",pod=\"p\"} 1\n";
    assert_eq!(label_names(scrape, "h"), vec![BTreeSet::new()]);
    assert_eq!(
        label_names(scrape, "f"),
        vec![BTreeSet::from(["name".into(), "pod".into()])]
    );
    assert_eq!(
        label_names(scrape, "g"),
        vec![BTreeSet::from(["name".into(), "pod".into()])]
    );
}

/// An engine's `/metrics` (vLLM's names), so that the pool's averages have readings.
fn engine(waiting: u32, running: u32, kv_usage: f64) -> String {
    format!(
        "vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {kv_usage}\n"
    )
}

#[tokio::test]
async fn every_family_the_docs_say_is_filled_is_exported() {
    let docs = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/observability.md"
    ))
    .unwrap();
    let claims = claimed_families(&docs);
    assert!(claims.len() >= 5, "too few claims parsed: {claims:?}");
    let a = MockWorker::start("a", &["m"]).await;
    let b = MockWorker::start("b", &["m"]).await;
    *a.metrics.lock().unwrap() = engine(1, 2, 0.5);
    *b.metrics.lock().unwrap() = engine(3, 4, 0.25);
    let mut s = settings(&[&a, &b]);
    // least_load reads the engines' metrics: the averages have values.
    s.policy = kvroute_core::PolicyKind::LeastLoad;
    s.metrics_compat = MetricsCompat::new(
        &[MetricsPeer::VllmRouter, MetricsPeer::Smg, MetricsPeer::LlmD],
        None,
    )
    .unwrap();
    let router = TestRouter::start(s).await;
    wait_until_async("the router to read both engines", || async {
        metric_value(
            &router.metrics().await,
            "inference_pool_average_queue_size",
            "",
        ) == Some(2.0)
    })
    .await;
    for i in 0..4 {
        let r = router
            .post("/v1/chat/completions", &[], &chat("m", &format!("hi {i}")))
            .await;
        assert_eq!(r.status, 200, "{:?}", r.body);
    }
    let m = router.metrics().await;
    router.stop().await;
    for (family, labels) in &claims {
        let found = label_names(&m, family);
        assert!(!found.is_empty(), "{family} is not exported:\n{m}");
        for names in found {
            assert_eq!(&names, labels, "{family}'s label names");
        }
    }
}
