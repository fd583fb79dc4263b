//! `kv-bench capacity`'s report: the table, the chart of TTFT against QPS, the results section.

use super::CapacityReport;
use crate::charts::{self, ChartError};
use crate::results::{Chart, Section};
use crate::table::{Style, Table};

/// A TTFT for the table: whole milliseconds, `failed` when failures reach the percentile, `-`
/// when nothing was measured.
pub fn ms(x: f64) -> String {
    match x {
        x if x.is_nan() => "-".into(),
        x if x.is_infinite() => "failed".into(),
        x => format!("{x:.0} ms"),
    }
}

/// A capacity: its rung, or `< lowest` when the lowest rung failed.
fn qps(c: Option<f64>, lowest: f64) -> String {
    match c {
        Some(q) => format!("{q}"),
        None => format!("< {lowest}"),
    }
}

/// One row per strategy: its capacity (with min–max over the ladders when repeated), then per
/// rung the median over the ladders of the TTFT percentile, marked ✗ where it missed the SLO
/// in any ladder.
pub fn table(r: &CapacityReport, style: Style) -> String {
    let o = &r.options;
    let lowest = o.ladder.first().copied().unwrap_or(0.0);
    let mut header = vec!["strategy".to_string(), "capacity (QPS)".to_string()];
    if o.repeat > 1 {
        header.push(format!("min–max over {} ladders", o.repeat));
    }
    header.extend(o.ladder.iter().map(|q| format!("p{} @ {q}", o.percentile)));
    let mut t = Table::new(header).left(0);
    for c in &r.capacities {
        let mut row = vec![c.strategy.as_str().to_string()];
        let median = c.spread.and_then(|s| s.median);
        row.push(qps(median, lowest));
        if o.repeat > 1 {
            row.push(match c.spread {
                Some(s) => format!("{} – {}", qps(s.min, lowest), qps(s.max, lowest)),
                None => "-".into(),
            });
        }
        for m in &c.rungs {
            let mark = if m.passed < o.repeat { " ✗" } else { "" };
            row.push(format!("{}{mark}", ms(m.ttft_ms)));
        }
        t.row(row);
    }
    t.render(style)
}

/// The lines under the table: the workload, the fleet, the rule.
pub fn notes(r: &CapacityReport) -> String {
    let o = &r.options;
    let size = match o.rung {
        super::RungSize::Seconds { seconds } => format!("{seconds} s of arrivals"),
        super::RungSize::Requests { requests } => format!("{requests} requests"),
    };
    format!(
        "Workload: {}. Fleet: {}. Each rung: {} s of unmeasured warm-up arrivals then {size} \
         measured, Poisson at the rung's rate, caches reset and a fresh router stack per run; \
         the strategies run back to back at each rung, in an order rotated by rung and ladder. \
         Capacity = the highest rung such that it and every lower rung kept TTFT p{} ≤ {} ms \
         (a failed request counts as slower than the SLO); the median over {} ladder{} (the \
         lower middle of an even count). ✗: the rung missed the SLO in at least one ladder.",
        r.workload,
        r.fleet,
        o.warmup_s,
        o.percentile,
        o.slo_ms,
        o.repeat,
        if o.repeat == 1 { "" } else { "s" }
    )
}

/// TTFT at the percentile against QPS, one line per strategy (median over the ladders), with
/// the SLO as a dashed line.
pub fn chart(r: &CapacityReport) -> Result<String, ChartError> {
    let o = &r.options;
    let series: Vec<(String, Vec<(f64, f64)>)> = r
        .capacities
        .iter()
        .map(|c| {
            let points = c.rungs.iter().map(|m| (m.qps, m.ttft_ms)).collect();
            (c.strategy.as_str().to_string(), points)
        })
        .collect();
    charts::ttft_vs_qps(
        &format!("TTFT p{} against offered load", o.percentile),
        &format!("TTFT p{} (ms)", o.percentile),
        o.slo_ms,
        &series,
    )
}

/// The results section of `make bench`.
pub fn section(
    title: &str,
    slug: &str,
    command: &str,
    r: &CapacityReport,
    seconds: f64,
) -> anyhow::Result<Section> {
    let body = format!("{}\n\n{}\n", table(r, Style::Markdown), notes(r));
    Ok(Section {
        title: title.into(),
        command: command.into(),
        body,
        detail: String::new(),
        charts: vec![Chart {
            file: format!("{slug}-ttft-vs-qps.svg"),
            alt: format!(
                "TTFT p{} against offered load per strategy, SLO {} ms",
                r.options.percentile, r.options.slo_ms
            ),
            svg: chart(r)?,
        }],
        json: serde_json::to_value(r)?,
        seconds,
    })
}
