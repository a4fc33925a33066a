//! The Grafana dashboard and the Prometheus rules, checked on real data: Debian's
//! `prometheus` scrapes a real `kvroute` on its default flags (embedded engines) under
//! traffic, and every panel's expression, its variables set to `.*`, returns a series.
//! Needs `prometheus` and `promtool` on the PATH (`.ci/run` installs them).

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::*;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

const RULES: &str = "deploy/prometheus/kvroute-rules.yml";

/// Every panel's expressions, with Grafana's variables as a test run sets them.
fn panel_queries() -> Vec<(String, String)> {
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(repo("deploy/grafana/kvroute.json")).unwrap(),
    )
    .unwrap();
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$worker", ".*")
                .replace("$__rate_interval", "30s");
            out.push((panel["title"].as_str().unwrap().to_owned(), expr));
        }
    }
    out
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

async fn query(prometheus: &str, q: &str) -> Value {
    let (status, _, body) =
        get_url(&format!("{prometheus}/api/v1/query?query={}", encode(q))).await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, 200, "{q}: {v}");
    v
}

#[test]
fn promtool_accepts_the_rules() {
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(repo(RULES))
        .output()
        .expect("promtool on the PATH (apt-get install prometheus)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_has_data_from_a_default_kvroute() {
    let (_kvroute, url, metrics_url) = kvroute_process(&[]).await;
    let metrics_port = metrics_url.rsplit(':').next().unwrap().to_owned();
    let prom_port = free_port();

    let dir = std::env::temp_dir().join(format!("kvroute-prometheus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
         rule_files: [{rules}]\n\
         scrape_configs:\n  - job_name: kvroute\n    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n",
        rules = repo(RULES).display()
    );
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    let _prometheus = ChildGuard(
        Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus on the PATH (apt-get install prometheus)"),
    );
    let prometheus = format!("http://127.0.0.1:{prom_port}");
    let ready = format!("{prometheus}/-/ready");
    wait_until_async("prometheus ready", || answers(&ready)).await;

    // Traffic, streaming and not, one request after another until the queries are done:
    // the panels' rates then cover requests whatever the machine's speed.
    let traffic = {
        let url = url.clone();
        tokio::spawn(async move {
            for i in 0.. {
                let stream = i % 2 == 0;
                let body = format!(
                    r#"{{"model":"kvroute-sim","max_tokens":4,"stream":{stream},"messages":[{{"role":"user","content":"shared system prompt, then question {}"}}]}}"#,
                    i % 7
                );
                let r = post(&url, "/v1/chat/completions", &[], &body).await;
                assert_eq!(r.status, 200);
            }
        })
    };
    // Enough scrapes for a rate over 30 s to have two samples, with traffic between them.
    let scraped = holds_within(Duration::from_secs(60), || {
        let prometheus = prometheus.clone();
        async move {
            let Ok((status, _, body)) = tokio::time::timeout(
                Duration::from_secs(2),
                get_url(&format!(
                    "{prometheus}/api/v1/query?query={}",
                    encode("count_over_time(kvroute_requests_total[30s])")
                )),
            )
            .await
            else {
                return false;
            };
            status == 200
                && serde_json::from_slice::<Value>(&body).is_ok_and(|v| {
                    v["data"]["result"]
                        .as_array()
                        .and_then(|r| r.first())
                        .and_then(|s| s["value"][1].as_str()?.parse::<f64>().ok())
                        .is_some_and(|n| n >= 4.0)
                })
        }
    })
    .await;
    assert!(
        scraped,
        "Prometheus scraped kvroute under traffic within 60 s"
    );

    let mut empty = Vec::new();
    for (title, q) in panel_queries() {
        let v = query(&prometheus, &q).await;
        assert_eq!(v["status"], "success", "{title}: {q}: {v}");
        if v["data"]["result"].as_array().is_none_or(Vec::is_empty) {
            empty.push(format!("{title}: {q}"));
        }
    }
    assert!(
        empty.is_empty(),
        "panels without data:\n{}",
        empty.join("\n")
    );

    // The rules loaded and evaluate without error.
    let (_, _, body) = get_url(&format!("{prometheus}/api/v1/rules")).await;
    let rules: Value = serde_json::from_slice(&body).unwrap();
    let all: Vec<&Value> = rules["data"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect();
    assert_eq!(all.len(), 18, "{rules}");
    for rule in all {
        assert_ne!(rule["health"], "err", "{rule}");
    }
    traffic.abort();
    let _ = std::fs::remove_dir_all(&dir);
}
