//! Summaries of runs: prefix hit rate, latency percentiles, pod spread; side-by-side tables.

use std::collections::BTreeMap;

use serde::Serialize;

use super::oracle::{OracleRequest, Oracles};
use super::table::{Style, Table};
use kv_testkit::runner::RunResult;

/// Block size the oracle inputs are keyed with (vllm-sim's and vLLM's GPU default).
const ORACLE_BLOCK_SIZE: usize = 16;

/// Summary of one run.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Run label.
    pub label: String,
    /// Workload name.
    pub workload: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed (transport, non-2xx, incomplete stream).
    pub errors: usize,
    /// Σ prompt tokens over requests that reported usage.
    pub prompt_tokens: u64,
    /// Σ cached prompt tokens.
    pub cached_tokens: u64,
    /// cached_tokens / prompt_tokens.
    pub hit_rate: f64,
    /// Time to first token percentiles, ms.
    pub ttft_p50_ms: f64,
    /// p90 TTFT, ms.
    pub ttft_p90_ms: f64,
    /// p95 TTFT, ms.
    pub ttft_p95_ms: f64,
    /// p99 TTFT, ms.
    pub ttft_p99_ms: f64,
    /// End-to-end latency p50, ms.
    pub e2e_p50_ms: f64,
    /// End-to-end latency p99, ms.
    pub e2e_p99_ms: f64,
    /// Requests per serving pod (`?` = unknown).
    pub per_pod: BTreeMap<String, usize>,
    /// Pods the share is computed over.
    pub pods: usize,
    /// Busiest pod's share of requests × pod count (1.0 = perfectly even).
    pub hotspot: f64,
    /// Wall time, seconds.
    pub duration_s: f64,
    /// Completed requests per second.
    pub throughput_rps: f64,
    /// The oracles of the same request sequence, when computed.
    pub oracles: Option<Oracles>,
    /// CPU seconds the router replicas and their Redis used during the run (`compare` of
    /// strategies it starts; None for Envoy's round robin and external endpoints).
    pub cpu_s: Option<f64>,
    /// Every successful request's TTFT, ms, sorted: repeated runs pool them for a tail that
    /// rests on more than one run's few slowest requests.
    #[serde(skip)]
    pub ttfts_ms: Vec<f64>,
}

/// Nearest-rank percentile of `v` (sorted in place); NaN when empty.
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

impl Summary {
    /// Summarises `run`; `pods` is the fleet size (None: the pods seen in responses).
    pub fn of(run: &RunResult, pods: Option<usize>) -> Self {
        let ok: Vec<_> = run.records.iter().filter(|r| r.error.is_none()).collect();
        let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
        let mut e2e: Vec<f64> = ok.iter().map(|r| r.e2e_ms).collect();
        let prompt_tokens: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
        let cached_tokens: u64 = ok
            .iter()
            .filter(|r| r.prompt_tokens.is_some())
            .filter_map(|r| r.cached_tokens)
            .sum();
        let mut per_pod = BTreeMap::new();
        for r in &ok {
            *per_pod
                .entry(r.pod.clone().unwrap_or_else(|| "?".into()))
                .or_insert(0usize) += 1;
        }
        let pods = pods.unwrap_or(per_pod.len()).max(1);
        let busiest = per_pod.values().copied().max().unwrap_or(0);
        let hotspot = if ok.is_empty() {
            f64::NAN
        } else {
            busiest as f64 / ok.len() as f64 * pods as f64
        };
        Self {
            label: run.label.clone(),
            workload: run.workload.clone(),
            requests: run.records.len(),
            errors: run.records.len() - ok.len(),
            prompt_tokens,
            cached_tokens,
            hit_rate: if prompt_tokens > 0 {
                cached_tokens as f64 / prompt_tokens as f64
            } else {
                f64::NAN
            },
            ttft_p50_ms: percentile(&mut ttft, 50.0),
            ttft_p90_ms: percentile(&mut ttft, 90.0),
            ttft_p95_ms: percentile(&mut ttft, 95.0),
            ttft_p99_ms: percentile(&mut ttft, 99.0),
            ttfts_ms: ttft,
            e2e_p50_ms: percentile(&mut e2e, 50.0),
            e2e_p99_ms: percentile(&mut e2e, 99.0),
            per_pod,
            pods,
            hotspot,
            duration_s: run.duration_s,
            throughput_rps: if run.duration_s > 0.0 {
                ok.len() as f64 / run.duration_s
            } else {
                0.0
            },
            oracles: None,
            cpu_s: None,
        }
    }

    /// Adds the oracles of the run's own prompt sequence for a fleet of `pods` pods with
    /// `blocks_per_pod` blocks each.
    pub fn with_oracles(mut self, run: &RunResult, pods: usize, blocks_per_pod: usize) -> Self {
        let prompts: Vec<OracleRequest> = run
            .sent
            .iter()
            .filter_map(|(path, body)| OracleRequest::from_body(path, body, ORACLE_BLOCK_SIZE))
            .collect();
        self.oracles = Some(Oracles::compute(
            &prompts,
            ORACLE_BLOCK_SIZE,
            pods * blocks_per_pod,
        ));
        self
    }

    /// Hit rate as a fraction of the infinite oracle's.
    pub fn vs_infinite(&self) -> f64 {
        self.oracles
            .map_or(f64::NAN, |o| self.hit_rate / o.infinite.ratio())
    }

    /// Hit rate as a fraction of the pooled oracle's.
    pub fn vs_pooled(&self) -> f64 {
        self.oracles
            .map_or(f64::NAN, |o| self.hit_rate / o.pooled.ratio())
    }
}

fn pct(v: f64) -> String {
    if v.is_nan() || v.is_infinite() {
        "-".into()
    } else {
        format!("{:.1} %", v * 100.0)
    }
}

fn ms(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else {
        format!("{v:.1} ms")
    }
}

/// Metrics as rows, runs as columns.
pub fn table(runs: &[Summary], style: Style) -> String {
    type Cell = Box<dyn Fn(&Summary) -> String>;
    let rows: Vec<(&str, Cell)> = vec![
        ("requests", Box::new(|s| s.requests.to_string())),
        ("errors", Box::new(|s| s.errors.to_string())),
        ("prefix hit rate", Box::new(|s| pct(s.hit_rate))),
    ];
    let oracle_rows: Vec<(&str, Cell)> = vec![
        (
            "infinite oracle",
            Box::new(|s| pct(s.oracles.map_or(f64::NAN, |o| o.infinite.ratio()))),
        ),
        (
            "pooled oracle",
            Box::new(|s| pct(s.oracles.map_or(f64::NAN, |o| o.pooled.ratio()))),
        ),
        ("hit / infinite", Box::new(|s| pct(s.vs_infinite()))),
        ("hit / pooled", Box::new(|s| pct(s.vs_pooled()))),
    ];
    let rest: Vec<(&str, Cell)> = vec![
        ("TTFT p50", Box::new(|s| ms(s.ttft_p50_ms))),
        ("TTFT p90", Box::new(|s| ms(s.ttft_p90_ms))),
        ("TTFT p95", Box::new(|s| ms(s.ttft_p95_ms))),
        ("TTFT p99", Box::new(|s| ms(s.ttft_p99_ms))),
        ("E2E p50", Box::new(|s| ms(s.e2e_p50_ms))),
        ("E2E p99", Box::new(|s| ms(s.e2e_p99_ms))),
        (
            "hotspot factor",
            Box::new(|s| {
                if s.hotspot.is_nan() {
                    "-".into()
                } else {
                    format!("{:.2}", s.hotspot)
                }
            }),
        ),
        (
            "requests per pod",
            Box::new(|s| {
                // Busiest first, idle pods of the fleet as zeros: "96/0/0/0" vs "24/24/24/24".
                let mut counts: Vec<usize> = s.per_pod.values().copied().collect();
                counts.sort_unstable_by(|a, b| b.cmp(a));
                counts.resize(counts.len().max(s.pods), 0);
                counts
                    .iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join("/")
            }),
        ),
        (
            "throughput",
            Box::new(|s| format!("{:.1} req/s", s.throughput_rps)),
        ),
        ("wall time", Box::new(|s| format!("{:.1} s", s.duration_s))),
    ];
    let mut rows = rows;
    if runs.iter().any(|s| s.oracles.is_some()) {
        rows.extend(oracle_rows);
    }
    rows.extend(rest);
    let mut t = Table::new(std::iter::once("metric").chain(runs.iter().map(|r| r.label.as_str())));
    for (name, f) in &rows {
        let mut line = vec![name.to_string()];
        line.extend(runs.iter().map(f));
        t.row(line);
    }
    t.render(style)
}

/// Runs of one strategy under `compare --repeat`: the label without its ` #k` round.
pub(crate) fn strategy_of(label: &str) -> &str {
    label.rsplit_once(" #").map_or(label, |(s, _)| s)
}

/// With repeated runs (`weighted #1`, `weighted #2`, …): per strategy, the median and range of
/// the figures a verdict rests on, and the TTFT p99 of all its runs' requests pooled (one run's
/// p99 of 600 requests is its sixth-slowest, so one stall decides it). None when no label
/// carries a round.
pub fn spread_table(runs: &[Summary], style: Style) -> Option<String> {
    if !runs.iter().any(|s| s.label.contains(" #")) {
        return None;
    }
    let mut order: Vec<&str> = Vec::new();
    for s in runs {
        let name = strategy_of(&s.label);
        if !order.contains(&name) {
            order.push(name);
        }
    }
    let spread = |v: Vec<f64>, show: &dyn Fn(f64) -> String| {
        let mut v: Vec<f64> = v.into_iter().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return "-".to_string();
        }
        let med = median(&v);
        v.sort_by(f64::total_cmp);
        format!("{} ({}–{})", show(med), show(v[0]), show(v[v.len() - 1]))
    };
    let mut t = Table::new([
        "strategy",
        "runs",
        "hit / pooled",
        "hit / infinite",
        "TTFT p50",
        "TTFT p99",
        "TTFT p99, runs pooled",
        "errors",
        "CPU: routers + Redis",
    ]);
    for name in order {
        let of: Vec<&Summary> = runs
            .iter()
            .filter(|s| strategy_of(&s.label) == name)
            .collect();
        let col = |f: &dyn Fn(&Summary) -> f64| of.iter().map(|s| f(s)).collect::<Vec<f64>>();
        t.row(vec![
            name.to_string(),
            of.len().to_string(),
            spread(col(&|s| s.vs_pooled()), &pct),
            spread(col(&|s| s.vs_infinite()), &pct),
            spread(col(&|s| s.ttft_p50_ms), &ms),
            spread(col(&|s| s.ttft_p99_ms), &ms),
            ms(percentile(
                &mut of
                    .iter()
                    .flat_map(|s| s.ttfts_ms.iter().copied())
                    .collect::<Vec<f64>>(),
                99.0,
            )),
            of.iter().map(|s| s.errors).sum::<usize>().to_string(),
            spread(col(&|s| s.cpu_s.unwrap_or(f64::NAN)), &|x| {
                format!("{x:.1} s")
            }),
        ]);
    }
    Some(t.render(style))
}

/// JSON document written by `--json`: summaries plus every request record.
#[derive(Debug, Serialize)]
pub struct JsonReport<'a> {
    /// One summary per run.
    pub summaries: &'a [Summary],
    /// The raw runs.
    pub runs: &'a [RunResult],
}

/// The median of `v`, the mean of the middle two for an even count (NaN for none).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_testkit::runner::RequestRecord;

    fn rec(pod: &str, prompt: u64, cached: u64, ttft: f64, err: bool) -> RequestRecord {
        RequestRecord {
            session: "s".into(),
            turn: 0,
            start_ms: 0.0,
            headers_ms: None,
            ttft_ms: Some(ttft),
            e2e_ms: ttft * 2.0,
            status: Some(if err { 500 } else { 200 }),
            error: err.then(|| "HTTP 500".into()),
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
            completion_tokens: Some(4),
            pod: Some(pod.into()),
        }
    }

    #[test]
    fn summaries_count_hits_latencies_and_spread() {
        let run = RunResult {
            label: "x".into(),
            workload: "multiturn".into(),
            description: String::new(),
            target: String::new(),
            duration_s: 2.0,
            sent: Vec::new(),
            records: vec![
                rec("a", 100, 50, 10.0, false),
                rec("a", 100, 100, 20.0, false),
                rec("a", 100, 0, 30.0, false),
                rec("b", 100, 50, 40.0, false),
                rec("b", 100, 0, 99.0, true),
            ],
        };
        let s = Summary::of(&run, Some(4));
        assert_eq!(s.requests, 5);
        assert_eq!(s.errors, 1);
        assert!((s.hit_rate - 0.5).abs() < 1e-9);
        assert_eq!(s.ttft_p50_ms, 20.0);
        assert_eq!(s.ttft_p99_ms, 40.0);
        assert_eq!(s.per_pod["a"], 3);
        assert!((s.hotspot - 3.0).abs() < 1e-9); // 3/4 of requests x 4 pods
        let t = table(&[s.clone(), s], Style::Markdown);
        assert!(t.contains("| prefix hit rate "));
        assert!(t.contains("50.0 %"));
        assert!(t.contains("3/1/0/0"), "{t}");
    }

    #[test]
    fn repeated_runs_get_a_median_and_range_per_strategy() {
        let run = |label: &str, ttft: f64| {
            let r = RunResult {
                label: label.into(),
                workload: "multiturn".into(),
                description: String::new(),
                target: String::new(),
                duration_s: 1.0,
                sent: Vec::new(),
                records: vec![rec("a", 100, 50, ttft, false)],
            };
            let mut s = Summary::of(&r, Some(2));
            s.label = label.into();
            s.cpu_s = Some(ttft / 10.0);
            s
        };
        let once = [run("weighted", 10.0), run("precise", 20.0)];
        assert!(
            spread_table(&once, Style::Markdown).is_none(),
            "one round: no spread"
        );
        let runs = [
            run("weighted #1", 30.0),
            run("precise #1", 20.0),
            run("precise #2", 40.0),
            run("weighted #2", 10.0),
            run("weighted #3", 20.0),
            run("precise #3", 60.0),
        ];
        let t = spread_table(&runs, Style::Markdown).unwrap();
        let rows: Vec<&str> = t
            .lines()
            .filter(|l| l.starts_with("| w") || l.starts_with("| p"))
            .collect();
        assert_eq!(rows.len(), 2, "{t}");
        let cells: Vec<&str> = rows[0].split('|').map(str::trim).collect();
        assert_eq!((cells[1], cells[2]), ("weighted", "3"), "{t}");
        assert!(rows[0].contains("20.0 ms (10.0 ms–30.0 ms)"), "{t}");
        assert!(rows[1].contains("40.0 ms (20.0 ms–60.0 ms)"), "{t}");
        let pooled = |row: &str| row.split('|').map(str::trim).nth(7).unwrap().to_string();
        assert_eq!(
            pooled(rows[0]),
            "30.0 ms",
            "p99 of the three runs' requests\n{t}"
        );
        assert_eq!(pooled(rows[1]), "60.0 ms", "{t}");
        let cpu = |row: &str| row.split('|').map(str::trim).nth(9).unwrap().to_string();
        assert_eq!(cpu(rows[0]), "2.0 s (1.0 s–3.0 s)", "{t}");
        let even = spread_table(&runs[..4], Style::Markdown).unwrap();
        assert!(
            even.contains("30.0 ms (20.0 ms–40.0 ms)"),
            "two runs: their mean\n{even}"
        );
    }

    #[test]
    fn percentile_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 50.0), 50.0);
        assert_eq!(percentile(&mut v, 95.0), 95.0);
        assert_eq!(percentile(&mut v, 100.0), 100.0);
        assert!(percentile(&mut [], 50.0).is_nan());
    }
}
