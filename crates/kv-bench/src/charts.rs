//! SVG charts for the reports (plotters' SVG backend: no font files needed, text stays text).

use plotters::coord::ranged1d::SegmentedCoord;
use plotters::coord::types::{RangedCoordf64, RangedCoordusize};
use plotters::coord::Shift;
use plotters::prelude::*;

/// Chart errors (plotters' own error type borrows the backend, so it is flattened to text).
#[derive(Debug, thiserror::Error)]
#[error("chart {chart}: {message}")]
pub struct ChartError {
    chart: &'static str,
    message: String,
}

fn err(chart: &'static str) -> impl Fn(&dyn std::fmt::Display) -> ChartError {
    move |e| ChartError {
        chart,
        message: e.to_string(),
    }
}

/// Distinct, colour-blind-friendly series colours (Okabe–Ito), cycled.
const PALETTE: [RGBColor; 8] = [
    RGBColor(0, 0, 0),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 158, 115),
    RGBColor(213, 94, 0),
    RGBColor(0, 114, 178),
    RGBColor(204, 121, 167),
    RGBColor(120, 120, 120),
];

fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

const SIZE: (u32, u32) = (760, 420);

/// A segmented axis over `0..=n-1` has exactly `n` slots (one per bar group).
fn segments(n: usize) -> std::ops::Range<usize> {
    0..n.saturating_sub(1)
}

/// TTFT CDF, one line per series, log-scaled milliseconds on x.
pub fn ttft_cdf(title: &str, series: &[(String, Vec<f64>)]) -> Result<String, ChartError> {
    let e = err("ttft-cdf");
    let mut svg = String::new();
    {
        let all: Vec<f64> = series
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        // No data: an empty 1 ms..1 s frame (log axes need finite, positive bounds).
        let lo = all.iter().copied().fold(f64::INFINITY, f64::min);
        let lo = if lo.is_finite() { lo.max(0.1) } else { 1.0 };
        let hi = all.iter().copied().fold(0.0, f64::max).max(lo * 10.0);
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d((lo * 0.9..hi * 1.1).log_scale(), 0.0..1.0)
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .x_desc("time to first token (ms, log scale)")
            .y_desc("fraction of requests")
            .draw()
            .map_err(|x| e(&x))?;
        for (i, (label, values)) in series.iter().enumerate() {
            let mut v: Vec<f64> = values
                .iter()
                .copied()
                .filter(|v| v.is_finite() && *v > 0.0)
                .collect();
            v.sort_by(f64::total_cmp);
            let n = v.len().max(1) as f64;
            let c = colour(i);
            chart
                .draw_series(LineSeries::new(
                    v.iter().enumerate().map(|(k, x)| (*x, (k + 1) as f64 / n)),
                    c.stroke_width(2),
                ))
                .map_err(|x| e(&x))?
                .label(label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|x| e(&x))?;
        root.present().map_err(|x| e(&x))?;
    }
    Ok(svg)
}

/// Values over time, one line per series: (seconds, value) points on linear axes.
pub fn time_series(
    title: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<String, ChartError> {
    let e = err("time-series");
    let mut svg = String::new();
    {
        let points = || series.iter().flat_map(|(_, v)| v.iter().copied());
        let x_hi = points().map(|p| p.0).fold(1.0, f64::max);
        let y_hi = points().map(|p| p.1).fold(1.0, f64::max) * 1.15;
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..x_hi, 0.0..y_hi)
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .y_desc(y_desc)
            .draw()
            .map_err(|x| e(&x))?;
        for (i, (label, values)) in series.iter().enumerate() {
            let c = colour(i);
            chart
                .draw_series(LineSeries::new(values.iter().copied(), c.stroke_width(2)))
                .map_err(|x| e(&x))?
                .label(label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|x| e(&x))?;
        root.present().map_err(|x| e(&x))?;
    }
    Ok(svg)
}

/// A latency percentile against offered load, one line with markers per series, and the SLO as
/// a dashed red line. A point whose failures reach the percentile (infinite) is drawn at the
/// top of the frame; one that measured nothing (NaN) is left out.
pub fn ttft_vs_qps(
    title: &str,
    y_desc: &str,
    slo_ms: f64,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<String, ChartError> {
    let e = err("ttft-vs-qps");
    let mut svg = String::new();
    {
        let points = || series.iter().flat_map(|(_, v)| v.iter().copied());
        let x_lo = points().map(|p| p.0).fold(f64::INFINITY, f64::min);
        let x_lo = if x_lo.is_finite() { x_lo } else { 0.0 };
        let x_hi = points().map(|p| p.0).fold(x_lo + 1.0, f64::max);
        let finite_hi = points()
            .map(|p| p.1)
            .filter(|y| y.is_finite())
            .fold(0.0, f64::max);
        let y_hi = finite_hi.max(slo_ms).max(1.0) * 1.2;
        let pad = (x_hi - x_lo) * 0.05;
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x_lo - pad..x_hi + pad, 0.0..y_hi)
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .x_desc("offered load (requests per second)")
            .y_desc(y_desc)
            .draw()
            .map_err(|x| e(&x))?;
        let red = RGBColor(200, 0, 0);
        chart
            .draw_series(DashedLineSeries::new(
                [(x_lo - pad, slo_ms), (x_hi + pad, slo_ms)],
                6,
                4,
                red.stroke_width(2),
            ))
            .map_err(|x| e(&x))?
            .label(format!("SLO {slo_ms} ms"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], red.stroke_width(2)));
        for (i, (label, values)) in series.iter().enumerate() {
            let c = colour(i);
            let shown: Vec<(f64, f64)> = values
                .iter()
                .filter(|p| !p.1.is_nan())
                .map(|&(x, y)| (x, if y.is_finite() { y } else { y_hi }))
                .collect();
            chart
                .draw_series(LineSeries::new(shown.iter().copied(), c.stroke_width(2)))
                .map_err(|x| e(&x))?
                .label(label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
            chart
                .draw_series(shown.iter().map(|&p| Circle::new(p, 3, c.filled())))
                .map_err(|x| e(&x))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|x| e(&x))?;
        root.present().map_err(|x| e(&x))?;
    }
    Ok(svg)
}

/// A bar chart's frame: one labelled segment per group on x, `0..top` on y.
type Bars<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<SegmentedCoord<RangedCoordusize>, RangedCoordf64>>;

/// Builds the frame of a segmented bar chart once (background, caption, axes, group labels),
/// lets `draw` draw into it, adds the legend of its labelled series if asked, and returns the SVG.
fn segmented_chart(
    chart: &'static str,
    title: &str,
    labels: &[String],
    top: f64,
    y_desc: &str,
    legend: bool,
    draw: impl FnOnce(&DrawingArea<SVGBackend, Shift>, &mut Bars) -> Result<(), ChartError>,
) -> Result<String, ChartError> {
    let e = err(chart);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let mut frame = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(segments(labels.len()).into_segmented(), 0.0..top)
            .map_err(|x| e(&x))?;
        frame
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(labels.len())
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .y_desc(y_desc)
            .draw()
            .map_err(|x| e(&x))?;
        draw(&root, &mut frame)?;
        if legend {
            frame
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(|x| e(&x))?;
        }
        root.present().map_err(|x| e(&x))?;
    }
    Ok(svg)
}

/// Hit ratio per strategy as bars, with the infinite and pooled oracles as horizontal lines.
pub fn hit_vs_oracle(
    title: &str,
    bars: &[(String, f64)],
    infinite: f64,
    pooled: f64,
) -> Result<String, ChartError> {
    let e = err("hit-vs-oracle");
    let top = bars
        .iter()
        .map(|b| b.1)
        .chain([infinite, pooled])
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max)
        .max(0.05)
        * 100.0
        * 1.15;
    let labels: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
    let y_desc = "prefix hit ratio (% of prompt tokens)";
    segmented_chart(
        "hit-vs-oracle",
        title,
        &labels,
        top,
        y_desc,
        true,
        |_, chart| {
            chart
                .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
                    let mut r = Rectangle::new(
                        [
                            (SegmentValue::Exact(i), 0.0),
                            (SegmentValue::Exact(i + 1), v * 100.0),
                        ],
                        colour(i).filled(),
                    );
                    r.set_margin(0, 0, 8, 8);
                    r
                }))
                .map_err(|x| e(&x))?;
            for (name, value, c) in [
                ("infinite oracle", infinite, RGBColor(0, 0, 0)),
                ("pooled oracle", pooled, RGBColor(200, 0, 0)),
            ] {
                if !value.is_finite() {
                    continue;
                }
                chart
                    .draw_series(LineSeries::new(
                        [
                            (SegmentValue::Exact(0), value * 100.0),
                            (SegmentValue::Last, value * 100.0),
                        ],
                        c.stroke_width(2),
                    ))
                    .map_err(|x| e(&x))?
                    .label(format!("{name} {:.1} %", value * 100.0))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                    });
            }
            Ok(())
        },
    )
}

/// Requests per pod, one group of bars per strategy (pods in fleet order within a group).
pub fn per_pod_load(title: &str, series: &[(String, Vec<usize>)]) -> Result<String, ChartError> {
    let e = err("per-pod-load");
    let pods = series.iter().map(|s| s.1.len()).max().unwrap_or(1).max(1);
    let top = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.1;
    let labels: Vec<String> = series.iter().map(|s| s.0.clone()).collect();
    let y_desc = "requests served, per pod";
    segmented_chart(
        "per-pod-load",
        title,
        &labels,
        top,
        y_desc,
        false,
        |root, chart| {
            // Each strategy's segment [g, g+1) split into `pods` thin bars.
            let w = 0.8 / pods as f64;
            let area = chart.plotting_area();
            let (px0, _) = area.map_coordinate(&(SegmentValue::Exact(0), 0.0));
            let (px1, _) = area.map_coordinate(&(SegmentValue::Exact(1), 0.0));
            let seg_px = (px1 - px0) as f64;
            for (g, (_, counts)) in series.iter().enumerate() {
                for (p, &n) in counts.iter().enumerate() {
                    let x0 = seg_px * (0.1 + w * p as f64);
                    let x1 = seg_px * (0.1 + w * (p as f64 + 0.9));
                    let (bx, by) = area.map_coordinate(&(SegmentValue::Exact(g), n as f64));
                    let (_, base) = area.map_coordinate(&(SegmentValue::Exact(g), 0.0));
                    root.draw(&Rectangle::new(
                        [(bx + x0 as i32, by), (bx + x1 as i32, base)],
                        colour(g).filled(),
                    ))
                    .map_err(|x| e(&x))?;
                }
            }
            Ok(())
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn well_formed(svg: &str) {
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        assert!(svg.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn charts_render_with_their_labels() {
        let cdf = ttft_cdf(
            "TTFT",
            &[
                ("round-robin".into(), vec![10.0, 20.0, 400.0]),
                ("weighted".into(), vec![5.0, 6.0, 7.0]),
            ],
        )
        .unwrap();
        well_formed(&cdf);
        assert!(cdf.contains("round-robin") && cdf.contains("weighted"));
        let bars = hit_vs_oracle(
            "hits",
            &[("round-robin".into(), 0.2), ("weighted".into(), 0.5)],
            0.7,
            0.6,
        )
        .unwrap();
        well_formed(&bars);
        let line = time_series(
            "RSS",
            "MiB",
            &[("kv-router".into(), vec![(0.0, 20.0), (5.0, 22.0)])],
        )
        .unwrap();
        well_formed(&line);
        assert!(line.contains("kv-router"));
        assert!(
            bars.contains("pooled oracle 60.0 %"),
            "legend names the oracle"
        );
        let load = per_pod_load(
            "load",
            &[("a".into(), vec![3, 1, 0]), ("b".into(), vec![2, 2, 2])],
        )
        .unwrap();
        well_formed(&load);
        assert!(load.matches("<rect").count() >= 6);
        let ladder = ttft_vs_qps(
            "TTFT p90",
            "ms",
            500.0,
            &[
                ("weighted".into(), vec![(4.0, 100.0), (8.0, 300.0)]),
                (
                    "round-robin".into(),
                    vec![(4.0, 400.0), (8.0, f64::INFINITY)],
                ),
                ("none".into(), vec![(4.0, f64::NAN)]),
            ],
        )
        .unwrap();
        well_formed(&ladder);
        assert!(ladder.contains("SLO 500 ms") && ladder.contains("round-robin"));
    }

    #[test]
    fn empty_series_still_render() {
        well_formed(&ttft_cdf("none", &[("x".into(), vec![])]).unwrap());
        well_formed(&per_pod_load("none", &[]).unwrap());
        well_formed(&ttft_vs_qps("none", "ms", 500.0, &[]).unwrap());
    }
}
