//! TTFT against load: one SVG with a line per router, a point per load.
//!
//! x is the load as a multiple of the workload's own arrival rate (linear), y a TTFT percentile
//! in milliseconds (log scale, from the power of ten below the fastest point to the one above
//! the slowest). kvroute's policies are drawn with round markers, a peer's routers with square
//! ones, and a load-independent bound (the pooled-LRU reference) as a grey line without
//! markers. The legend sits right of the chart, in the order given, each line labelled with its
//! value at the highest load it reached.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{ms_label, PlotError, GREY, PALETTE};

const WIDTH: u32 = 1200;
const HEIGHT: u32 = 720;
/// The legend's width, right of the chart.
const LEGEND_WIDTH: u32 = 330;

/// Colours for a peer's lines, apart from kvroute's.
const PEER_PALETTE: [RGBColor; 3] = [
    RGBColor(170, 20, 20),
    RGBColor(110, 60, 10),
    RGBColor(90, 30, 140),
];

/// Whose line it is, which sets its marker and colours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Router {
    /// One of kvroute's policies: a colour of [`PALETTE`], round markers.
    Kvroute,
    /// Another router (Dynamo's): a colour of its own, square markers.
    Peer,
    /// A bound that does not route (the pooled-LRU reference): grey, no markers.
    Reference,
}

/// One line of the figure.
#[derive(Debug, Clone, Copy)]
pub struct LoadSeries<'a> {
    pub label: &'a str,
    pub router: Router,
    /// (load, TTFT ms), in any order; the line joins them by load.
    pub points: &'a [(f64, f64)],
}

/// The axes' ranges, each as (low, high).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Axes {
    pub load: (f64, f64),
    pub ttft_ms: (f64, f64),
}

/// The axes' ranges over every point: the loads with a margin of 4% each side, and TTFT from
/// the round figure (1, 2 or 5 times a power of ten) at or below the smallest to the one at or
/// above the largest, at least a decade apart (TTFT under 1 µs is drawn at 1 µs).
pub fn axis_ranges(series: &[LoadSeries<'_>]) -> Result<Axes, PlotError> {
    let points = || series.iter().flat_map(|s| s.points.iter().copied());
    let fold = |f: fn(f64, f64) -> f64, init: f64, pick: fn((f64, f64)) -> f64| {
        points().map(pick).fold(init, f)
    };
    let (x_min, x_max) = (
        fold(f64::min, f64::INFINITY, |p| p.0),
        fold(f64::max, f64::NEG_INFINITY, |p| p.0),
    );
    let (y_min, y_max) = (
        fold(f64::min, f64::INFINITY, |p| p.1.max(1e-3)),
        fold(f64::max, 0.0, |p| p.1.max(1e-3)),
    );
    if !x_min.is_finite() {
        return Err(PlotError::Empty);
    }
    let pad = ((x_max - x_min) * 0.04).max(0.05);
    let y_lo = nice_below(y_min);
    let y_hi = nice_above(y_max).max(y_lo * 10.0);
    Ok(Axes {
        load: (x_min - pad, x_max + pad),
        ttft_ms: (y_lo, y_hi),
    })
}

/// The largest of 1, 2 and 5 times a power of ten that is at most `v` (> 0).
fn nice_below(v: f64) -> f64 {
    let decade = 10f64.powf(v.log10().floor());
    [5.0, 2.0, 1.0]
        .into_iter()
        .map(|m| m * decade)
        .find(|&n| n <= v * (1.0 + 1e-9))
        .unwrap_or(decade)
}

/// The smallest of 1, 2 and 5 times a power of ten that is at least `v` (> 0).
fn nice_above(v: f64) -> f64 {
    let decade = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * decade)
        .find(|&n| n >= v * (1.0 - 1e-9))
        .unwrap_or(10.0 * decade)
}

/// Every `m` times a power of ten in `lo..=hi`, ascending.
fn log_ticks(lo: f64, hi: f64, multiples: &[f64]) -> Vec<f64> {
    let mut ticks = Vec::new();
    let mut decade = 10f64.powf(lo.log10().floor());
    while decade <= hi {
        ticks.extend(
            multiples
                .iter()
                .map(|m| m * decade)
                .filter(|&t| t >= lo * (1.0 - 1e-9) && t <= hi * (1.0 + 1e-9)),
        );
        decade *= 10.0;
    }
    ticks
}

/// A series as drawn: its points by load, and its colour.
struct Drawn<'a> {
    series: LoadSeries<'a>,
    points: Vec<(f64, f64)>,
    color: RGBColor,
}

/// The series with points, each with its colour: kvroute's in [`PALETTE`]'s order, a peer's in
/// [`PEER_PALETTE`]'s, the reference grey.
fn drawn<'a>(series: &[LoadSeries<'a>]) -> Vec<Drawn<'a>> {
    let (mut own, mut peer) = (0, 0);
    let mut next = |router: Router| match router {
        Router::Kvroute => {
            own += 1;
            PALETTE[(own - 1) % PALETTE.len()]
        }
        Router::Peer => {
            peer += 1;
            PEER_PALETTE[(peer - 1) % PEER_PALETTE.len()]
        }
        Router::Reference => GREY,
    };
    series
        .iter()
        .filter(|s| !s.points.is_empty())
        .map(|s| {
            let mut points: Vec<(f64, f64)> =
                s.points.iter().map(|&(x, y)| (x, y.max(1e-3))).collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Drawn {
                series: *s,
                points,
                color: next(s.router),
            }
        })
        .collect()
}

/// A load tick: `x1`, `x2.5`.
fn load_label(v: &f64) -> String {
    format!("x{}", (v * 100.0).round() / 100.0)
}

/// The figure as SVG text: `title` over a smaller `subtitle`, `y_desc` naming the percentile.
/// Series without points are left out; none with any is an error.
pub fn ttft_load_svg(
    title: &str,
    subtitle: &str,
    y_desc: &str,
    series: &[LoadSeries<'_>],
) -> Result<String, PlotError> {
    let lines = drawn(series);
    // A tick per load when the loads are whole multiples.
    let mut xs: Vec<f64> = lines
        .iter()
        .flat_map(|d| d.points.iter().map(|p| p.0))
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let loads = xs.len();
    let Axes {
        load: (x_lo, x_hi),
        ttft_ms: (y_lo, y_hi),
    } = axis_ranges(series)?;

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let (head, body) = root.split_vertically(60);
        let (plot_area, legend) = body.split_horizontally(WIDTH - LEGEND_WIDTH);
        let centre = |size: f64, color: &'static RGBColor| {
            TextStyle::from(("sans-serif", size).into_font())
                .color(color)
                .pos(Pos::new(HPos::Center, VPos::Top))
        };
        let middle = WIDTH as i32 / 2;
        head.draw(&Text::new(title, (middle, 10), centre(20.0, &BLACK)))?;
        head.draw(&Text::new(subtitle, (middle, 38), centre(15.0, &GREY)))?;
        let mut chart = ChartBuilder::on(&plot_area)
            .margin(16)
            .margin_top(4)
            .margin_right(24)
            .x_label_area_size(48)
            .y_label_area_size(72)
            .build_cartesian_2d(
                x_lo..x_hi,
                (y_lo..y_hi)
                    .log_scale()
                    .with_key_points(log_ticks(y_lo, y_hi, &[1.0, 2.0, 5.0]))
                    .with_light_points(log_ticks(y_lo, y_hi, &[3.0, 4.0, 6.0, 7.0, 8.0, 9.0])),
            )?;
        chart
            .configure_mesh()
            .x_desc("load (multiple of the trace's arrival rate)")
            .y_desc(y_desc)
            .x_labels(loads.clamp(2, 12))
            .x_label_formatter(&load_label)
            .y_label_formatter(&ms_label)
            .axis_desc_style(("sans-serif", 16))
            .label_style(("sans-serif", 14))
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(200, 200, 200))
            .draw()?;
        for Drawn {
            series: s,
            points: pts,
            color,
        } in &lines
        {
            let style = color.stroke_width(if s.router == Router::Reference { 2 } else { 3 });
            chart.draw_series(LineSeries::new(pts.iter().copied(), style))?;
            match s.router {
                Router::Kvroute => {
                    chart.draw_series(pts.iter().map(|&p| Circle::new(p, 5, color.filled())))?;
                }
                Router::Peer => {
                    chart.draw_series(pts.iter().map(|&p| {
                        EmptyElement::at(p) + Rectangle::new([(-6, -6), (6, 6)], style)
                    }))?;
                }
                Router::Reference => {}
            }
        }
        draw_legend(&legend, &lines)?;
        root.present()?;
    }
    Ok(svg)
}

/// The legend, one row per line: a sample of the line and its marker, the label, and its value
/// at the highest load it reached.
fn draw_legend(
    legend: &DrawingArea<SVGBackend<'_>, Shift>,
    lines: &[Drawn<'_>],
) -> Result<(), PlotError> {
    let row = 26;
    let top = 24;
    let text = TextStyle::from(("sans-serif", 14).into_font())
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    for (i, d) in lines.iter().enumerate() {
        let (s, pts, color) = (&d.series, &d.points, &d.color);
        let y = top + row * i as i32;
        let style = color.stroke_width(3);
        legend.draw(&PathElement::new(vec![(4, y), (40, y)], style))?;
        match s.router {
            Router::Kvroute => legend.draw(&Circle::new((22, y), 5, color.filled()))?,
            Router::Peer => legend.draw(&Rectangle::new([(16, y - 6), (28, y + 6)], style))?,
            Router::Reference => {}
        }
        let (x, v) = pts[pts.len() - 1];
        let label = format!("{} ({} ms at {})", s.label, ms_label(&v), load_label(&x));
        legend.draw(&Text::new(label, (48, y), text.clone()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `points` of each `<polyline>` in `svg` with more than two (a legend sample has two),
    /// with the polyline's stroke colour.
    fn curves(svg: &str) -> Vec<(String, Vec<(f64, f64)>)> {
        svg.split("<polyline")
            .skip(1)
            .filter_map(|p| {
                let attr = |name: &str| {
                    p.split(&format!("{name}=\""))
                        .nth(1)
                        .and_then(|v| v.split('"').next())
                        .map(str::to_owned)
                };
                let points: Vec<(f64, f64)> = attr("points")?
                    .split_whitespace()
                    .map(|xy| {
                        let (x, y) = xy.split_once(',').expect("x,y");
                        (x.parse().unwrap(), y.parse().unwrap())
                    })
                    .collect();
                (points.len() > 2).then(|| (attr("stroke").unwrap_or_default(), points))
            })
            .collect()
    }

    #[test]
    fn a_line_per_router_with_a_point_per_load_inside_the_axes() {
        let kv = [
            (1.0, 66.0),
            (2.0, 83.0),
            (3.0, 110.0),
            (5.0, 2233.0),
            (4.0, 236.0),
        ];
        let rr = [
            (1.0, 235.0),
            (2.0, 297.0),
            (3.0, 382.0),
            (4.0, 864.0),
            (5.0, 6461.0),
        ];
        let dynamo = [(1.0, 77.0), (3.0, 197.0), (5.0, 2850.0)];
        let reference = [(1.0, 49.0), (5.0, 49.0)];
        let series = [
            LoadSeries {
                label: "kv_aware",
                router: Router::Kvroute,
                points: &kv,
            },
            LoadSeries {
                label: "round_robin",
                router: Router::Kvroute,
                points: &rr,
            },
            LoadSeries {
                label: "Dynamo kv_router",
                router: Router::Peer,
                points: &dynamo,
            },
            LoadSeries {
                label: "pooled-LRU reference",
                router: Router::Reference,
                points: &reference,
            },
            LoadSeries {
                label: "nothing",
                router: Router::Kvroute,
                points: &[],
            },
        ];
        let Axes {
            load: (x_lo, x_hi),
            ttft_ms,
        } = axis_ranges(&series).unwrap();
        assert!(x_lo < 1.0 && x_hi > 5.0 && x_hi < 5.5, "{x_lo}..{x_hi}");
        assert_eq!(ttft_ms, (20.0, 10_000.0), "49 ms to 6461 ms");
        assert_eq!((nice_below(742.0), nice_above(43_374.0)), (500.0, 50_000.0));
        assert_eq!((nice_below(200.0), nice_above(200.0)), (200.0, 200.0));
        assert_eq!((nice_below(0.15), nice_above(1.5)), (0.1, 2.0));
        assert_eq!(
            log_ticks(20.0, 10_000.0, &[1.0, 2.0, 5.0]),
            [20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10_000.0]
        );

        let svg = ttft_load_svg(
            "TTFT against load",
            "sub",
            "TTFT p50 (ms, log scale)",
            &series,
        )
        .unwrap();
        for text in [
            "kv_aware (2233 ms at x5)",
            "Dynamo kv_router (2850 ms at x5)",
            "pooled-LRU reference (49 ms at x5)",
            "TTFT p50 (ms, log scale)",
            "load (multiple of the trace",
            "\nx3\n",
        ] {
            assert!(svg.contains(text), "{text}");
        }
        assert!(
            !svg.contains("nothing"),
            "a line without points is left out"
        );

        // One polyline per router with a point per load (the reference's two points are its
        // legend sample's count, so it is not among these), in the router's colour.
        let curves = curves(&svg);
        let colors: Vec<&str> = curves.iter().map(|(c, _)| c.as_str()).collect();
        assert_eq!(colors, ["#0072B2", "#D55E00", "#AA1414"], "{svg}");
        let lens: Vec<usize> = curves.iter().map(|(_, p)| p.len()).collect();
        assert_eq!(lens, [5, 5, 3]);
        // Inside the chart, and where the data says: x grows with the load, a higher TTFT is
        // higher up (a smaller pixel y), and every point is within the image.
        for (_, pts) in &curves {
            for w in pts.windows(2) {
                assert!(w[1].0 > w[0].0, "by load: {pts:?}");
            }
            for &(x, y) in pts {
                assert!((0.0..f64::from(WIDTH - LEGEND_WIDTH)).contains(&x), "{x}");
                assert!((60.0..f64::from(HEIGHT)).contains(&y), "{y}");
            }
        }
        let (kv_px, rr_px) = (&curves[0].1, &curves[1].1);
        for i in 0..5 {
            assert_eq!(kv_px[i].0, rr_px[i].0, "the same load, the same x");
            assert!(kv_px[i].1 > rr_px[i].1, "kv_aware lower at load {i}");
        }
        // The log scale: 66 -> 2233 ms (x33.8) spans 1.53 decades, round robin's 1.44.
        let plot_h = rr_px[0].1 - rr_px[4].1; // 235 -> 6461 ms, 1.44 decades
        let kv_h = kv_px[0].1 - kv_px[4].1;
        let ratio = kv_h / plot_h;
        let expected = (2233f64 / 66.0).log10() / (6461f64 / 235.0).log10();
        assert!(
            (ratio - expected).abs() < 0.02,
            "{ratio} against {expected}"
        );
    }

    #[test]
    fn no_points_is_an_error() {
        let empty = [LoadSeries {
            label: "a",
            router: Router::Kvroute,
            points: &[],
        }];
        assert!(matches!(axis_ranges(&empty), Err(PlotError::Empty)));
        assert!(matches!(
            ttft_load_svg("t", "s", "y", &empty),
            Err(PlotError::Empty)
        ));
    }
}
