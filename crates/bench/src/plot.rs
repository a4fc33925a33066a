//! TTFT figures: one SVG with the empirical CDF of time to first token per policy.
//!
//! x is TTFT in milliseconds on a log axis (from the power of ten below the fastest request
//! to the one above the slowest), y the fraction of requests whose TTFT is at most x. A line
//! further left is a faster policy; where it reaches 0.99 is its p99. The legend names each
//! policy with its p50 and p99. Up to [`MAX_POINTS`] requests a line is the exact step
//! function; above, it joins that many evenly spaced quantiles.
//!
//! Text is written as SVG `<text>` elements and laid out by the viewer, so no font is needed
//! here (plotters without its font features only estimates text widths).
//!
//! [`load`] draws the other figure: a TTFT percentile against load, a line per router.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

pub mod load;

/// Lines with more requests than this are drawn through this many quantiles.
pub const MAX_POINTS: usize = 1000;

const WIDTH: u32 = 960;
const HEIGHT: u32 = 600;

const GREY: RGBColor = RGBColor(90, 90, 90);

/// Okabe and Ito's colour-blind safe palette (yellow last: faint on white), then grey and
/// wine, so that every policy kvroute has gets a colour of its own.
const PALETTE: [RGBColor; 10] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(240, 228, 66),
    RGBColor(140, 140, 140),
    RGBColor(136, 34, 85),
];

/// One line of the figure.
#[derive(Debug, Clone, Copy)]
pub struct Series<'a> {
    /// The policy (shown in the legend).
    pub label: &'a str,
    /// Every request's TTFT in milliseconds, in any order.
    pub ttft_ms: &'a [f64],
}

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("no TTFT to plot")]
    Empty,
    #[error("cannot draw the plot")]
    Draw(#[from] DrawingAreaErrorKind<std::io::Error>),
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The points of a CDF over `sorted` (ascending, not empty): a step per request, or a line
/// through [`MAX_POINTS`] quantiles.
fn cdf_points(sorted: &[f64], floor: f64) -> Vec<(f64, f64)> {
    let n = sorted.len();
    let y = |i: usize| (i + 1) as f64 / n as f64;
    if n <= MAX_POINTS {
        let mut points = Vec::with_capacity(2 * n);
        for (i, &v) in sorted.iter().enumerate() {
            let v = v.max(floor);
            points.push((v, if i == 0 { 0.0 } else { y(i - 1) }));
            points.push((v, y(i)));
        }
        points
    } else {
        let mut points = vec![(sorted[0].max(floor), 0.0)];
        points.extend((0..MAX_POINTS).map(|k| {
            let i = k * (n - 1) / (MAX_POINTS - 1);
            (sorted[i].max(floor), y(i))
        }));
        points
    }
}

/// A tick label in ms: whole numbers from 1 up, shortest decimals below.
fn ms_label(v: &f64) -> String {
    if *v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// The figure as SVG text, `title` over a smaller `subtitle`. Series without requests are left
/// out; none with any is an error.
pub fn ttft_cdf_svg(
    title: &str,
    subtitle: &str,
    series: &[Series<'_>],
) -> Result<String, PlotError> {
    let lines: Vec<(&str, Vec<f64>)> = series
        .iter()
        .filter(|s| !s.ttft_ms.is_empty())
        .map(|s| {
            let mut v = s.ttft_ms.to_vec();
            v.sort_by(f64::total_cmp);
            (s.label, v)
        })
        .collect();
    let floor = 1e-3;
    let lo = lines
        .iter()
        .map(|(_, v)| v[0])
        .fold(f64::INFINITY, f64::min);
    let hi = lines
        .iter()
        .map(|(_, v)| v[v.len() - 1])
        .fold(0.0, f64::max);
    if !lo.is_finite() {
        return Err(PlotError::Empty);
    }
    let x_lo = 10f64.powf(lo.max(floor).log10().floor());
    let x_hi = 10f64.powf(hi.max(floor).log10().ceil()).max(x_lo * 10.0);

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let (head, body) = root.split_vertically(56);
        let centre = |size: f64, color: &'static RGBColor| {
            TextStyle::from(("sans-serif", size).into_font())
                .color(color)
                .pos(Pos::new(HPos::Center, VPos::Top))
        };
        let middle = WIDTH as i32 / 2;
        head.draw(&Text::new(title, (middle, 10), centre(20.0, &BLACK)))?;
        head.draw(&Text::new(subtitle, (middle, 36), centre(15.0, &GREY)))?;
        let mut chart = ChartBuilder::on(&body)
            .margin(16)
            .margin_top(4)
            .margin_right(40)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d((x_lo..x_hi).log_scale(), 0.0..1.0)?;
        chart
            .configure_mesh()
            .x_desc("TTFT (ms, log scale)")
            .y_desc("fraction of requests with TTFT at most x")
            .x_label_formatter(&ms_label)
            .y_label_formatter(&|v| format!("{v:.1}"))
            .axis_desc_style(("sans-serif", 16))
            .label_style(("sans-serif", 14))
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(200, 200, 200))
            .draw()?;
        for (i, (label, sorted)) in lines.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let style = color.stroke_width(2);
            chart
                .draw_series(LineSeries::new(cdf_points(sorted, floor), style))?
                .label(format!(
                    "{label} (p50 {:.0} ms, p99 {:.0} ms)",
                    crate::simulate::nearest_rank(sorted, 0.5),
                    crate::simulate::nearest_rank(sorted, 0.99)
                ))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.9))
            .border_style(RGBColor(160, 160, 160))
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

/// Writes the figure (see [`ttft_cdf_svg`]) to `path`.
pub fn write_ttft_cdf(
    path: &Path,
    title: &str,
    subtitle: &str,
    series: &[Series<'_>],
) -> Result<(), PlotError> {
    let svg = ttft_cdf_svg(title, subtitle, series)?;
    std::fs::write(path, svg).map_err(|source| PlotError::Write {
        path: path.to_owned(),
        source,
    })
}

/// Writes the TTFT-against-load figure (see [`load::ttft_load_svg`]) to `path`.
pub fn write_ttft_load(
    path: &Path,
    title: &str,
    subtitle: &str,
    y_desc: &str,
    series: &[load::LoadSeries<'_>],
) -> Result<(), PlotError> {
    let svg = load::ttft_load_svg(title, subtitle, y_desc, series)?;
    std::fs::write(path, svg).map_err(|source| PlotError::Write {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names of the elements opened in `svg`, checking that every one is closed in order.
    fn elements(svg: &str) -> Vec<String> {
        let (mut open, mut names) = (Vec::<String>::new(), Vec::new());
        let mut rest = svg;
        while let Some(start) = rest.find('<') {
            let end = rest[start..].find('>').expect("a tag ends") + start;
            let tag = &rest[start + 1..end];
            rest = &rest[end + 1..];
            if tag.starts_with('?') || tag.starts_with('!') {
                continue;
            }
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(open.pop().as_deref(), Some(name.trim()), "balanced");
                continue;
            }
            let name: String = tag
                .chars()
                .take_while(|c| !c.is_whitespace() && *c != '/')
                .collect();
            if !tag.ends_with('/') {
                open.push(name.clone());
            }
            names.push(name);
        }
        assert!(open.is_empty(), "unclosed {open:?}");
        names
    }

    #[test]
    fn two_policies_give_two_labelled_lines() {
        let fast: Vec<f64> = (1..=200).map(|i| 20.0 + f64::from(i)).collect();
        let slow: Vec<f64> = (1..=5000).rev().map(|i| 100.0 + f64::from(i)).collect();
        let svg = ttft_cdf_svg(
            "TTFT: test trace, 5200 requests",
            "4 workers, rate x1",
            &[
                Series {
                    label: "kv_aware",
                    ttft_ms: &fast,
                },
                Series {
                    label: "round_robin",
                    ttft_ms: &slow,
                },
            ],
        )
        .unwrap();
        let names = elements(&svg);
        assert_eq!(names.first().map(String::as_str), Some("svg"));
        for text in [
            "kv_aware (p50 120 ms",
            "round_robin (p50 2600 ms",
            "TTFT: test trace, 5200 requests",
            "4 workers, rate x1",
            "TTFT (ms, log scale)",
            "fraction of requests",
        ] {
            assert!(svg.contains(text), "{text}");
        }
        // One polyline per policy with more than the legend sample's two points, in its colour.
        let curves: Vec<&str> = svg
            .split("<polyline")
            .skip(1)
            .filter(|p| {
                p.split("points=\"").nth(1).is_some_and(|pts| {
                    pts.split('"')
                        .next()
                        .unwrap_or("")
                        .split_whitespace()
                        .count()
                        > 2
                })
            })
            .collect();
        assert_eq!(curves.len(), 2, "{svg}");
        for (curve, color) in curves.iter().zip(["#0072B2", "#D55E00"]) {
            assert!(curve.contains(color), "{color} in {curve}");
        }
    }

    #[test]
    fn no_requests_is_an_error_and_empty_lines_are_left_out() {
        assert!(matches!(
            ttft_cdf_svg(
                "t",
                "s",
                &[Series {
                    label: "a",
                    ttft_ms: &[]
                }]
            ),
            Err(PlotError::Empty)
        ));
        let svg = ttft_cdf_svg(
            "t",
            "s",
            &[
                Series {
                    label: "a",
                    ttft_ms: &[],
                },
                Series {
                    label: "b",
                    ttft_ms: &[5.0],
                },
            ],
        )
        .unwrap();
        assert!(!svg.contains(">a (") && svg.contains("b (p50 5 ms"));
    }

    #[test]
    fn a_large_series_is_drawn_through_quantiles() {
        let v: Vec<f64> = (1..=100_000).map(f64::from).collect();
        let points = cdf_points(&v, 1e-3);
        assert_eq!(points.len(), MAX_POINTS + 1);
        assert_eq!(points.last(), Some(&(100_000.0, 1.0)));
        let small = cdf_points(&[1.0, 2.0], 1e-3);
        assert_eq!(small, [(1.0, 0.0), (1.0, 0.5), (2.0, 0.5), (2.0, 1.0)]);
    }
}
