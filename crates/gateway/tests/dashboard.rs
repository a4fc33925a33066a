//! The live dashboard, rendered by a real browser: Debian's `chromium`, headless, loads
//! `/dashboard` from a `kvroute` in front of its embedded engines under load. The rendered
//! DOM names every worker and every tenant with its share, shows decisions with their
//! candidates, and changes as traffic flows. Needs `chromium` on the PATH (`.ci/run` installs it).

mod support;

use std::process::{Command, Stdio};

use serde_json::Value;
use support::*;

struct Kvroute {
    _child: ChildGuard,
    url: String,
    metrics_url: String,
}

async fn kvroute(args: &[&str]) -> Kvroute {
    let (child, url, metrics_url) = kvroute_process(args).await;
    Kvroute {
        _child: child,
        url,
        metrics_url,
    }
}

/// The page as chromium renders it after a few seconds of (virtual) time: its DOM.
fn rendered(url: &str) -> String {
    let out = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--virtual-time-budget=3000",
            "--dump-dom",
            url,
        ])
        .stderr(Stdio::null())
        .output()
        .expect("chromium on the PATH (apt-get install chromium)");
    assert!(out.status.success(), "chromium failed");
    String::from_utf8(out.stdout).unwrap()
}

async fn traffic(url: &str, n: usize, offset: usize) {
    for i in offset..offset + n {
        // Three requests in four are team-a's (a trusted tenant header), the rest team-b's.
        let team = if i % 4 == 3 { "team-b" } else { "team-a" };
        let body = format!(
            r#"{{"model":"kvroute-sim","max_tokens":4,"stream":{},"messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"question {i}"}}]}}"#,
            i % 2 == 0,
            "a shared system prompt, long enough to span several KV blocks. ".repeat(4),
        );
        let tenant = [("x-smg-tenant-id", team)];
        let r = post(url, "/v1/chat/completions", &tenant, &body).await;
        assert_eq!(r.status, 200, "{:?}", r.body);
    }
}

/// The newest decision's id in a rendered page.
fn newest_decision(dom: &str) -> u64 {
    let at = dom
        .find(r#"class="decision" data-id=""#)
        .expect("a decision is shown")
        + 26;
    dom[at..].split('"').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_sees_every_worker_and_the_decisions_change_as_traffic_flows() {
    let k = kvroute(&["--trust-tenant-header", "--router-cost-model", "predicted"]).await;
    traffic(&k.url, 12, 0).await;
    let page = format!("{}/dashboard", k.metrics_url);
    let first = rendered(&page);

    let (_, _, body) = get_url(&format!("{}/workers", k.url)).await;
    let workers: Value = serde_json::from_slice(&body).unwrap();
    let ids: Vec<&str> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["id"].as_str().unwrap())
        .collect();
    assert!(ids.len() >= 2);
    for id in &ids {
        assert!(
            first.contains(&format!(r#"data-worker="{id}""#)),
            "{id} is not on the page"
        );
    }
    assert!(first.contains("kv_aware"), "the policy is named");
    // A decision expands to its candidates: one row per worker considered.
    let decision = &first[first.find(r#"class="decision""#).unwrap()..];
    let decision = &decision[..decision.find("</details>").unwrap()];
    assert_eq!(
        decision.matches(r#"class="candidate""#).count(),
        ids.len(),
        "{decision}"
    );
    // Each tenant with its share of the requests: 9 and 3 of 12.
    for (tenant, share) in [("header:team-a", "75.0%"), ("header:team-b", "25.0%")] {
        let row = &first[first
            .find(&format!(r#"data-tenant="{tenant}""#))
            .unwrap_or_else(|| panic!("{tenant} is not on the page"))..];
        let row = &row[..row.find("</tr>").unwrap()];
        assert!(row.contains(&format!("<td>{share}</td>")), "{row}");
    }
    // Each candidate with its predicted TTFT, and the ranks that answered with their fitted
    // speed (the others still on the prior).
    let cells = |class: &str| -> Vec<String> {
        first
            .split(&format!(r#"<td class="{class}">"#))
            .skip(1)
            .map(|c| c[..c.find("</td>").unwrap()].to_owned())
            // Not the page's own script, which holds the cell's template.
            .filter(|c| !c.starts_with("${"))
            .collect()
    };
    let predicted = cells("predicted");
    assert!(!predicted.is_empty(), "{decision}");
    assert!(
        predicted.iter().all(|c| c.ends_with(')') && c != "–"),
        "{predicted:?}"
    );
    let speeds = cells("speed");
    assert_eq!(speeds.len(), ids.len(), "one fitted speed per rank");
    assert!(speeds.iter().any(|c| c.contains("x step")), "{speeds:?}");
    let before = newest_decision(&first);
    assert!(before >= 12, "{before}");

    traffic(&k.url, 6, 100).await;
    let second = rendered(&page);
    assert_eq!(newest_decision(&second), before + 6);
    assert_ne!(first, second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_admin_key_the_feed_needs_it_and_the_page_asks_for_it() {
    let k = kvroute(&["--admin-api-key", "s3cret"]).await;
    let feed = format!("{}/dashboard/state", k.metrics_url);
    let (status, _, _) = get_url(&feed).await;
    assert_eq!(status, 401);
    let r = send(
        &k.metrics_url,
        http::Method::GET,
        "/dashboard/state",
        &[("authorization", "Bearer s3cret")],
        "",
    )
    .await;
    assert_eq!(r.status, 200);
    let state = r.json();
    assert_eq!(state["policy"]["name"], "kv_aware");
    assert!(state["workers"].as_array().unwrap().len() >= 2);
    let dom = rendered(&format!("{}/dashboard", k.metrics_url));
    assert!(dom.contains("the feed needs the admin key"), "{dom}");
}
