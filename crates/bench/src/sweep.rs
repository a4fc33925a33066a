//! Runs at several loads, gathered into a line per router for the TTFT-against-load figure
//! ([`crate::plot::load`]).
//!
//! Two kinds of file are read, told apart by their content:
//! - `kvroute-bench simulate --json`: one run at its `rate_scale`, a row per policy (a line of
//!   kvroute's each, "kvroute <policy>") and the pooled-LRU reference (a line of its own);
//! - JSON lines of Dynamo's offline replay, as `bench/dynamo_replay_requests.py` prints them:
//!   one per router mode at its `speed`, with `ttft_ms` as `[p50, p90, p99]`. A `kv_router` at
//!   another `credit` or `scale` than Dynamo's defaults (1 and 1) is a line of its own.
//!
//! A line joins the runs of the same label; the figure's x is the rate scale (Dynamo's `speed`
//! is the same multiple of the trace's arrival rate).

use serde::Deserialize;

use crate::plot::load::Router;

/// Which TTFT percentile the figure plots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Percentile {
    P50,
    P90,
    P99,
}

impl Percentile {
    fn of(self, [p50, p90, p99]: [f64; 3]) -> f64 {
        match self {
            Percentile::P50 => p50,
            Percentile::P90 => p90,
            Percentile::P99 => p99,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Percentile::P50 => "p50",
            Percentile::P90 => "p90",
            Percentile::P99 => "p99",
        }
    }
}

/// One router's points, (rate scale, TTFT ms), by rate.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub label: String,
    pub router: Router,
    pub points: Vec<(f64, f64)>,
}

/// What the kvroute runs say about their setup, for the figure's subtitle.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Context {
    pub trace: Option<String>,
    pub shape: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("{file}: neither `kvroute-bench simulate --json` with its rate_scale nor Dynamo replay lines ({source})")]
    Unknown {
        file: String,
        source: serde_json::Error,
    },
}

#[derive(Deserialize)]
struct Ttft {
    ttft_ms: Percentiles3,
}

#[derive(Deserialize)]
struct Percentiles3 {
    p50: f64,
    p90: f64,
    p99: f64,
}

#[derive(Deserialize)]
struct Row {
    policy: String,
    #[serde(flatten)]
    ttft: Ttft,
}

#[derive(Deserialize)]
struct Reference {
    name: String,
    #[serde(flatten)]
    ttft: Ttft,
}

#[derive(Deserialize)]
struct KvrouteRun {
    rate_scale: f64,
    trace: Option<String>,
    shape: Option<String>,
    policies: Vec<Row>,
    reference: Option<Reference>,
}

#[derive(Deserialize)]
struct DynamoRun {
    mode: String,
    speed: f64,
    #[serde(default = "one")]
    credit: f64,
    #[serde(default = "one")]
    scale: f64,
    ttft_ms: [f64; 3],
}

fn one() -> f64 {
    1.0
}

impl Ttft {
    fn get(&self, p: Percentile) -> f64 {
        let t = &self.ttft_ms;
        p.of([t.p50, t.p90, t.p99])
    }
}

fn dynamo_label(run: &DynamoRun) -> String {
    if run.mode == "kv_router" && (run.credit != 1.0 || run.scale != 1.0) {
        format!(
            "Dynamo kv_router, credit {} / scale {}",
            run.credit, run.scale
        )
    } else {
        format!("Dynamo {}", run.mode)
    }
}

/// The points of every file (`(name, text)`), a line per label: kvroute's policies in the
/// order met, then Dynamo's, then the reference.
pub fn gather(
    files: &[(String, String)],
    p: Percentile,
) -> Result<(Vec<Line>, Context), SweepError> {
    let mut lines: Vec<Line> = Vec::new();
    let mut context = Context::default();
    let mut add = |label: String, router: Router, point: (f64, f64)| match lines
        .iter_mut()
        .find(|l| l.label == label)
    {
        Some(l) => l.points.push(point),
        None => lines.push(Line {
            label,
            router,
            points: vec![point],
        }),
    };
    for (name, text) in files {
        match serde_json::from_str::<KvrouteRun>(text) {
            Ok(run) => {
                context.trace = context.trace.or(run.trace);
                context.shape = context.shape.or(run.shape);
                let x = run.rate_scale;
                for row in &run.policies {
                    let label = format!("kvroute {}", row.policy);
                    add(label, Router::Kvroute, (x, row.ttft.get(p)));
                }
                if let Some(r) = &run.reference {
                    add(r.name.clone(), Router::Reference, (x, r.ttft.get(p)));
                }
            }
            Err(source) => {
                let runs: Result<Vec<DynamoRun>, _> = text
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(serde_json::from_str)
                    .collect();
                let runs =
                    runs.ok()
                        .filter(|r| !r.is_empty())
                        .ok_or_else(|| SweepError::Unknown {
                            file: name.clone(),
                            source,
                        })?;
                for run in &runs {
                    add(
                        dynamo_label(run),
                        Router::Peer,
                        (run.speed, p.of(run.ttft_ms)),
                    );
                }
            }
        }
    }
    let rank = |r: Router| match r {
        Router::Kvroute => 0,
        Router::Peer => 1,
        Router::Reference => 2,
    };
    lines.sort_by_key(|l| rank(l.router)); // stable: the order met within each
    for l in &mut lines {
        l.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok((lines, context))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kvroute_run(rate: f64, kv_p90: f64) -> String {
        serde_json::json!({
            "trace": "t.jsonl", "workers": 8, "rate_scale": rate, "shape": "8 workers",
            "policies": [
                {"policy": "kv_aware", "ttft_ms": {"p50": 1.0, "p90": kv_p90, "p99": 3.0}, "requests": 5},
                {"policy": "round_robin", "ttft_ms": {"p50": 10.0, "p90": 20.0 * rate, "p99": 30.0}},
            ],
            "reference": {"name": "pooled-LRU reference", "ttft_ms": {"p50": 0.5, "p90": 0.7, "p99": 0.9}},
        })
        .to_string()
    }

    #[test]
    fn runs_of_both_kinds_become_a_line_per_router_by_load() {
        let dynamo = [
            r#"{"system": "dynamo-1.6.1", "mode": "round_robin", "speed": 2.0, "credit": 1.0, "scale": 1.0, "ttft_ms": [5, 6, 7]}"#,
            r#"{"system": "dynamo-1.6.1", "mode": "kv_router", "speed": 2.0, "credit": 1.0, "scale": 1.0, "ttft_ms": [1, 2, 3]}"#,
            "",
        ]
        .join("\n");
        let c2s4 = r#"{"mode": "kv_router", "speed": 1.0, "credit": 2.0, "scale": 4.0, "ttft_ms": [1, 4, 9]}"#;
        let files = [
            ("x2.json".to_owned(), kvroute_run(2.0, 22.0)),
            ("dyn-x2.jsonl".to_owned(), dynamo),
            ("x1.json".to_owned(), kvroute_run(1.0, 11.0)),
            ("dyn-c2s4-x1.jsonl".to_owned(), c2s4.to_owned()),
        ];
        let (lines, context) = gather(&files, Percentile::P90).unwrap();
        type Got<'a> = (&'a str, Router, &'a [(f64, f64)]);
        let got: Vec<Got<'_>> = lines
            .iter()
            .map(|l| (l.label.as_str(), l.router, l.points.as_slice()))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "kvroute kv_aware",
                    Router::Kvroute,
                    &[(1.0, 11.0), (2.0, 22.0)][..]
                ),
                (
                    "kvroute round_robin",
                    Router::Kvroute,
                    &[(1.0, 20.0), (2.0, 40.0)][..]
                ),
                ("Dynamo round_robin", Router::Peer, &[(2.0, 6.0)][..]),
                ("Dynamo kv_router", Router::Peer, &[(2.0, 2.0)][..]),
                (
                    "Dynamo kv_router, credit 2 / scale 4",
                    Router::Peer,
                    &[(1.0, 4.0)][..]
                ),
                (
                    "pooled-LRU reference",
                    Router::Reference,
                    &[(1.0, 0.7), (2.0, 0.7)][..]
                ),
            ]
        );
        assert_eq!(context.trace.as_deref(), Some("t.jsonl"));
        assert_eq!(context.shape.as_deref(), Some("8 workers"));
        let (p50, _) = gather(&files[..1], Percentile::P50).unwrap();
        assert_eq!(p50[0].points, [(2.0, 1.0)]);
    }

    #[test]
    fn a_run_without_its_rate_or_an_unknown_file_is_an_error() {
        let without_rate =
            r#"{"policies": [{"policy": "kv_aware", "ttft_ms": {"p50": 1, "p90": 2, "p99": 3}}]}"#;
        for text in [without_rate, "not json", ""] {
            let err =
                gather(&[("f.json".to_owned(), text.to_owned())], Percentile::P90).unwrap_err();
            assert!(err.to_string().starts_with("f.json: neither"), "{err}");
        }
    }
}
