//! The study's tables: every run, llm-d's published figures beside ours, and the goals.

use serde::Serialize;

use super::{Picker, Row, Section, StudyReport};
use crate::table::{Style, Table};

/// A figure, or `–` where there is none.
fn num(v: Option<f64>, digits: usize) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:.digits$}"),
        _ => "–".into(),
    }
}

fn signed(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:+.2}"),
        _ => "–".into(),
    }
}

/// Whether a goal held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// Every figure within the goal.
    Met,
    /// A figure past it.
    Missed,
    /// The shape it needs was not run.
    NotRun,
}

/// One goal on one mode.
#[derive(Debug, Clone, Serialize)]
pub struct GoalCheck {
    /// The goal, in words.
    pub goal: String,
    /// The mode it was checked on.
    pub picker: Picker,
    /// The figures it was judged on, and at what QPS they were measured.
    pub figures: String,
    /// The verdict.
    pub verdict: Verdict,
}

/// A figure a goal bounds on a row: its name, its value, the limit.
type Limit = (&'static str, Option<f64>, f64);

/// A goal: the rows it applies to, and its limits on them.
struct Goal {
    text: &'static str,
    applies: fn(&Row) -> bool,
    limits: fn(&Row) -> Vec<Limit>,
}

const GOALS: [Goal; 3] = [
    Goal {
        text: "10 QPS x 1M-token inputs: CPU <= 0.5 cores, peak RSS <= 500 MiB",
        applies: |r| r.section == Section::LongInput && r.input_tokens >= 1_000_000,
        limits: |r| {
            vec![
                ("CPU cores", Some(r.cpu_avg_cores), 0.5),
                ("peak RSS MiB", r.peak_rss_mib, 500.0),
            ]
        },
    },
    Goal {
        text: "decision p95 <= 1 ms at 100k-token inputs",
        applies: |r| r.section == Section::LongInput && r.input_tokens == 100_000,
        limits: |r| vec![("decision p95 ms", r.decision_p95_ms, 1.0)],
    },
    Goal {
        text: "500 QPS of short requests: decision p95 <= 2 ms, CPU <= 0.5 cores",
        applies: |r| r.section == Section::ShortRequests,
        limits: |r| {
            vec![
                ("decision p95 ms", r.decision_p95_ms, 2.0),
                ("CPU cores", Some(r.cpu_avg_cores), 0.5),
            ]
        },
    },
];

/// Every goal on every kv-router mode the rows hold.
pub fn check(rows: &[Row]) -> Vec<GoalCheck> {
    let mut modes: Vec<Picker> = Vec::new();
    for r in rows.iter().filter(|r| r.picker != Picker::Noop) {
        if !modes.contains(&r.picker) {
            modes.push(r.picker);
        }
    }
    let mut out = Vec::new();
    for g in &GOALS {
        for &picker in &modes {
            let hit: Vec<&Row> = rows
                .iter()
                .filter(|r| r.picker == picker && (g.applies)(r))
                .collect();
            let mut figures = Vec::new();
            let mut met = !hit.is_empty();
            for r in &hit {
                for (name, value, limit) in (g.limits)(r) {
                    met &= value.is_some_and(|v| v <= limit);
                    figures.push(format!("{name} {}", num(value, 3)));
                }
                figures.push(format!("at {:.1} QPS sent", r.sent_qps));
            }
            out.push(GoalCheck {
                goal: g.text.into(),
                picker,
                figures: figures.join(", "),
                verdict: match (hit.is_empty(), met) {
                    (true, _) => Verdict::NotRun,
                    (false, true) => Verdict::Met,
                    (false, false) => Verdict::Missed,
                },
            });
        }
    }
    out
}

/// llm-d's published figures for a row's shape and mode, on their machine (None: none given).
fn published(r: &Row) -> Option<&'static str> {
    match (r.section, r.input_tokens, r.picker) {
        (Section::LongInput, 1000, Picker::Approximate) => Some(
            "scheduling p50 0.90-0.97 / p95 1.92-3.15 ms over 1k-1M; picker 0.87 cores peak, 39 MiB",
        ),
        (Section::LongInput, 1_000_000, Picker::Approximate) => {
            Some("scheduling p50 0.90-0.97 / p95 1.92-3.15 ms over 1k-1M; 7.12 cores peak, 4.2 GiB")
        }
        (Section::LongInput, 100_000, Picker::Precise) => {
            Some("precise: scheduling p50 2.98 / p95 6.78 ms")
        }
        (Section::ShortRequests, _, Picker::Approximate) => Some(
            "500 QPS: scheduling p50 3.59 / p95 78.55 ms, 4.94 cores (random picker 0.69 / 4.15 ms)",
        ),
        (Section::ShortRequests, _, Picker::Noop) => {
            Some("random picker: scheduling p50 0.69 / p95 4.15 ms")
        }
        _ => None,
    }
}

impl StudyReport {
    /// The tables as markdown, with notes on how to read them (no heading).
    pub fn markdown(&self) -> String {
        let mut t = Table::new([
            "shape",
            "picker",
            "QPS asked / sent",
            "requests",
            "errors",
            "TTFT p50 / p90 / p99 ms",
            "decision p50 / p95 ms",
            "added p50 / p95 ms",
            "CPU avg / peak cores",
            "peak RSS MiB",
        ])
        .left(1)
        .left(2);
        for r in &self.rows {
            t.row(vec![
                r.shape.clone(),
                r.picker.label().into(),
                format!("{} / {}", num(Some(r.qps), 0), num(Some(r.sent_qps), 1)),
                r.requests.to_string(),
                r.errors.to_string(),
                format!(
                    "{} / {} / {}",
                    num(Some(r.ttft_p50_ms), 0),
                    num(Some(r.ttft_p90_ms), 0),
                    num(Some(r.ttft_p99_ms), 0)
                ),
                format!(
                    "{} / {}",
                    num(r.decision_p50_ms, 3),
                    num(r.decision_p95_ms, 3)
                ),
                format!("{} / {}", signed(r.added_p50_ms), signed(r.added_p95_ms)),
                format!(
                    "{} / {}",
                    num(Some(r.cpu_avg_cores), 2),
                    num(Some(r.cpu_peak_cores), 2)
                ),
                num(r.peak_rss_mib, 0),
            ]);
        }
        let mut s = t.render(Style::Markdown);
        s.push_str(&format!(
            "\n{} vllm-sim pods x {} KV blocks of 16 tokens ({}), Envoy with 2 workers, Poisson \
             arrivals; each picker on freshly reset caches in its own processes. Decision: the \
             router's `kv_router_decision_duration_seconds` (parse, keys, lookup, score, pick), \
             interpolated inside its power-of-two buckets. Added: time to response headers over \
             the no-op ext_proc's on the same shape (the pods answer headers before any \
             prefill, so placement stays out of it; percentiles subtracted). CPU: the picker's \
             user + system time from /proc over the run's wall time, and its busiest second \
             (the no-op: its thread). Peak RSS: the router's VmHWM. Machine: {}. Took {:.0} s.\n",
            self.pods,
            self.gpu_blocks,
            self.sim_args.join(" "),
            self.machine,
            self.duration_s
        ));
        let mut p = Table::new(["shape", "picker", "llm-d published (their machine)", "ours"])
            .left(1)
            .left(2)
            .left(3);
        for r in &self.rows {
            if let Some(theirs) = published(r) {
                p.row(vec![
                    r.shape.clone(),
                    r.picker.label().into(),
                    theirs.into(),
                    format!(
                        "decision p50 {} / p95 {} ms, {} cores peak, {} MiB",
                        num(r.decision_p50_ms, 2),
                        num(r.decision_p95_ms, 2),
                        num(Some(r.cpu_peak_cores), 2),
                        num(r.peak_rss_mib, 0)
                    ),
                ]);
            }
        }
        if !p.is_empty() {
            s.push_str(
                "\nllm-d's nightly study (10 simulated pods) beside ours. The machines differ: \
                 theirs is a cluster node, ours the machine above, shared by the pods, Envoy and \
                 the load generator; their scheduling latency is the EPP's, ours the router's \
                 decision.\n\n",
            );
            s.push_str(&p.render(Style::Markdown));
        }
        if !self.goals.is_empty() {
            let mut g = Table::new(["goal", "mode", "figures", "verdict"])
                .left(1)
                .left(2)
                .left(3);
            for c in &self.goals {
                g.row(vec![
                    c.goal.clone(),
                    c.picker.label().into(),
                    c.figures.clone(),
                    match c.verdict {
                        Verdict::Met => "met",
                        Verdict::Missed => "missed",
                        Verdict::NotRun => "not run",
                    }
                    .into(),
                ]);
            }
            s.push_str("\nGoals (at the QPS this machine sent, which the figures give):\n\n");
            s.push_str(&g.render(Style::Markdown));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::super::fill_added;
    use super::*;

    pub(crate) fn row(section: Section, input: usize, picker: Picker) -> Row {
        let router = picker != Picker::Noop;
        Row {
            section,
            shape: "s".into(),
            input_tokens: input,
            output_tokens: 10,
            qps: 10.0,
            picker,
            requests: 20,
            errors: 0,
            first_error: None,
            sent_qps: 9.5,
            duration_s: 2.0,
            ttft_p50_ms: 20.0,
            ttft_p90_ms: 30.0,
            ttft_p99_ms: 40.0,
            headers_p50_ms: if router { 3.0 } else { 2.0 },
            headers_p95_ms: if router { 6.0 } else { 4.5 },
            decision_p50_ms: router.then_some(0.25),
            decision_p95_ms: router.then_some(0.75),
            added_p50_ms: None,
            added_p95_ms: None,
            cpu_avg_cores: 0.25,
            cpu_peak_cores: 0.5,
            rss_start_mib: router.then_some(20.0),
            peak_rss_mib: router.then_some(600.0),
        }
    }

    #[test]
    fn goals_judge_their_rows_per_mode() {
        let rows = vec![
            row(Section::LongInput, 100_000, Picker::Noop),
            row(Section::LongInput, 100_000, Picker::Approximate),
            row(Section::LongInput, 1_000_000, Picker::Approximate),
        ];
        let g = check(&rows);
        assert_eq!(g.len(), 3);
        // 600 MiB peak breaks the 1M goal; 0.75 ms meets the 100k one; no short requests ran.
        let verdicts: Vec<Verdict> = g.iter().map(|c| c.verdict).collect();
        assert_eq!(verdicts, [Verdict::Missed, Verdict::Met, Verdict::NotRun]);
        assert!(g[0].figures.contains("peak RSS MiB 600.000"), "{:?}", g[0]);
    }

    #[test]
    fn markdown_has_every_row_and_the_published_figures() {
        let mut rows = vec![
            row(Section::LongInput, 1000, Picker::Noop),
            row(Section::LongInput, 1000, Picker::Approximate),
        ];
        fill_added(&mut rows);
        assert_eq!(rows[1].added_p50_ms, Some(1.0));
        assert_eq!(rows[1].added_p95_ms, Some(1.5));
        assert_eq!(rows[0].added_p50_ms, None);
        let report = StudyReport {
            machine: "2 cores".into(),
            pods: 10,
            gpu_blocks: 1024,
            sim_args: vec![],
            duration_s: 3.0,
            goals: check(&rows),
            rows,
        };
        let md = report.markdown();
        let fields: Vec<&str> = md
            .lines()
            .find(|l| l.contains("| approximate"))
            .map(|l| l.split('|').map(str::trim).collect())
            .unwrap_or_default();
        assert_eq!(
            fields.get(1..5),
            Some(&["s", "approximate", "10 / 9.5", "20"][..])
        );
        assert!(md.contains("+1.00 / +1.50"), "{md}");
        assert!(
            md.contains("39 MiB") && md.contains("The machines differ"),
            "{md}"
        );
        assert!(md.contains("| not run |"), "{md}");
    }
}
