//! `kv-bench small-fleet`: a handful of chat sessions sharing a long system prompt on a fleet of
//! two or four slow pods, the shape on which a prefix-affine router sends every conversation to
//! the first pod that saw the system prompt. Each cell (pods × sessions) runs every strategy on
//! one fleet (`compare`) and holds each one to the goals against round robin in the same cell.

use std::time::Duration;

use anyhow::Result;
use serde::Serialize;

use super::compare::{self, CompareOptions};
use super::report::Summary;
use super::strategy::Strategy;
use super::table::{Style, Table};
use kv_testkit::deploy::{Binaries, LlamaOptions};
use kv_testkit::workload::{Arrivals, MultiturnSpec};

/// The workload and fleets of one run.
#[derive(Debug, Clone)]
pub struct SmallFleetOptions {
    /// Envoy binary (None: the usual search).
    pub envoy: Option<std::path::PathBuf>,
    /// (pods, sessions) cells, in order.
    pub cells: Vec<(usize, usize)>,
    /// Strategies after round robin (which always runs first: the goals are relative to it).
    pub strategies: Vec<Strategy>,
    /// Turns per session.
    pub turns: usize,
    /// Shared system prompt, bytes.
    pub system_bytes: usize,
    /// Question size range, bytes.
    pub question_bytes: (usize, usize),
    /// `max_tokens` per answer (the answer joins the next turn's prompt).
    pub max_tokens: u32,
    /// Sessions start at Poisson times of this rate (per second), as users arrive.
    pub session_rate: f64,
    /// A user's pause between a response and the next turn, ms (uniform).
    pub think_ms: (u64, u64),
    /// vllm-sim arguments (the pods' speed).
    pub sim_args: Vec<String>,
    /// Seed of the texts and arrival times.
    pub seed: u64,
    /// Each conversation's own document after the system prompt, bytes ((0, 0): none).
    pub document_bytes: (usize, usize),
    /// Requests carry `x-session-id`.
    pub session_header: bool,
    /// Closed loop with this many clients instead of Poisson session arrivals.
    pub clients: Option<usize>,
    /// The goals the strategies are held to.
    pub goals: GoalSpec,
    /// Real llama.cpp pods instead of vllm-sim (`--engine llama`).
    pub llama: Option<LlamaOptions>,
    /// Each router's `/metrics` and log after each run go here (`--router-metrics`).
    pub router_metrics: Option<std::path::PathBuf>,
}

/// Thresholds of the goals, against round robin in the same cell.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct GoalSpec {
    /// Hit ratio at least this share of the infinite oracle's...
    pub hit_vs_infinite: f64,
    /// ...or, when set, at least this hit ratio (the pods' own cached / prompt tokens).
    pub hit_ratio: Option<f64>,
    /// TTFT p50 at most this share of round robin's.
    pub p50_vs_rr: f64,
}

impl Default for GoalSpec {
    fn default() -> Self {
        Self {
            hit_vs_infinite: HIT_VS_INFINITE,
            hit_ratio: None,
            p50_vs_rr: P50_VS_RR,
        }
    }
}

impl Default for SmallFleetOptions {
    fn default() -> Self {
        Self {
            envoy: None,
            cells: vec![(2, 2), (2, 4), (4, 2), (4, 4)],
            strategies: vec![
                Strategy::LeastLoaded,
                Strategy::PrefixOnly,
                Strategy::Weighted,
                Strategy::PredictedTtft,
                Strategy::Precise,
                Strategy::Redis,
            ],
            turns: 8,
            system_bytes: 16 * 1024,
            question_bytes: (300, 600),
            max_tokens: 48,
            session_rate: 4.0,
            think_ms: (100, 1500),
            // Slow enough that a pod's prefill lane queues: 0.4 ms per uncached token.
            sim_args: vec!["--prefill-us-per-token=400".into()],
            seed: 1,
            document_bytes: (0, 0),
            session_header: true,
            clients: None,
            goals: GoalSpec::default(),
            llama: None,
            router_metrics: None,
        }
    }
}

impl SmallFleetOptions {
    /// The sessionless shape: clients that send no session id, a ~1,500-token system prompt, then each
    /// conversation's own ~300-token document and ~25-token questions, 16-token answers, two
    /// clients in a closed loop; 6 conversations on 2 pods and 12 on 4. Held to its goals: hit ratio ≥ 0.85, TTFT p50 ≤ 0.6 × and p99 ≤ round robin's, no pod above 2/3.
    pub fn sessionless() -> Self {
        Self {
            cells: vec![(2, 6), (4, 12)],
            strategies: vec![
                Strategy::Weighted,
                Strategy::PredictedTtft,
                Strategy::Precise,
            ],
            turns: 4,
            system_bytes: 6000,
            document_bytes: (1100, 1300),
            question_bytes: (80, 120),
            max_tokens: 16,
            think_ms: (0, 0),
            session_header: false,
            clients: Some(2),
            goals: GoalSpec {
                hit_vs_infinite: 0.0,
                hit_ratio: Some(0.85),
                p50_vs_rr: 0.6,
            },
            ..Self::default()
        }
    }

    /// The workload of a cell with `sessions` sessions.
    pub fn spec(&self, sessions: usize) -> MultiturnSpec {
        MultiturnSpec {
            sessions,
            turns: self.turns,
            system_bytes: self.system_bytes,
            question_bytes: self.question_bytes,
            max_tokens: self.max_tokens,
            seed: self.seed,
            think_ms: self.think_ms,
            document_bytes: self.document_bytes,
            session_header: self.session_header,
            ..MultiturnSpec::default()
        }
    }

    /// One sentence describing the shape.
    pub fn describe(&self) -> String {
        let arrivals = match self.clients {
            Some(c) => format!("{c} clients in a closed loop"),
            None => format!("sessions arriving at {}/s (Poisson)", self.session_rate),
        };
        let document = match self.document_bytes {
            (_, 0) => String::new(),
            (lo, hi) => format!("a document of {lo}-{hi} B per session, "),
        };
        format!(
            "{} turns per session, system prompt {} B, {document}questions {}-{} B, max_tokens {}, \
             {arrivals}, {}-{} ms between a response and the next turn, {}, {}",
            self.turns,
            self.system_bytes,
            self.question_bytes.0,
            self.question_bytes.1,
            self.max_tokens,
            self.think_ms.0,
            self.think_ms.1,
            if self.session_header {
                "x-session-id sent"
            } else {
                "no session id"
            },
            match &self.llama {
                Some(l) => format!(
                    "llama.cpp llama-server {} (model {})",
                    l.args().join(" "),
                    l.model.file_name().unwrap_or_default().to_string_lossy()
                ),
                None => format!("vllm-sim {}", self.sim_args.join(" ")),
            }
        )
    }
}

/// The goals every policy is held to, per cell, against round robin in the same cell.
pub const HIT_VS_INFINITE: f64 = 0.95;
/// TTFT p50 at most this share of round robin's.
pub const P50_VS_RR: f64 = 0.4;
/// No pod serves more than this share of the requests.
pub const MAX_POD_SHARE: f64 = 2.0 / 3.0;
/// TTFT p99 at most round robin's, within this factor: with a few dozen requests per run the
/// p99 is the cold prefill of the system prompt, the same for every strategy; run to run it
/// moves by a few milliseconds in 1.7 s.
pub const P99_NOISE: f64 = 1.02;

/// One strategy in one cell.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Strategy label.
    pub label: String,
    /// Hit ratio (the pods' own cached / prompt tokens).
    pub hit_ratio: f64,
    /// Hit ratio / the infinite oracle's.
    pub hit_vs_infinite: f64,
    /// TTFT p50, ms.
    pub ttft_p50_ms: f64,
    /// TTFT p99, ms.
    pub ttft_p99_ms: f64,
    /// TTFT p50 / round robin's.
    pub p50_vs_rr: f64,
    /// TTFT p99 / round robin's.
    pub p99_vs_rr: f64,
    /// The busiest pod's share of requests.
    pub max_pod_share: f64,
    /// Failed requests.
    pub errors: usize,
    /// Each goal met (None for round robin, the reference).
    pub goals: Option<Goals>,
}

/// Which goals a row meets.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Goals {
    /// Hit ≥ 0.95 × infinite oracle.
    pub hit: bool,
    /// TTFT p50 ≤ 0.4 × round robin's.
    pub p50: bool,
    /// TTFT p99 ≤ round robin's (within [`P99_NOISE`]).
    pub p99: bool,
    /// No pod above 2/3 of the requests.
    pub balance: bool,
}

impl Goals {
    /// Every goal met.
    pub fn all(&self) -> bool {
        self.hit && self.p50 && self.p99 && self.balance
    }
}

/// One fleet size and session count.
#[derive(Debug, Clone, Serialize)]
pub struct CellReport {
    /// Pods.
    pub pods: usize,
    /// Concurrent sessions.
    pub sessions: usize,
    /// Round robin first, then the strategies.
    pub rows: Vec<Row>,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct SmallFleetReport {
    /// The shape.
    pub workload: String,
    /// One per cell.
    pub cells: Vec<CellReport>,
}

impl Row {
    fn of(s: &Summary) -> Self {
        let total: usize = s.per_pod.values().sum();
        let busiest = s.per_pod.values().copied().max().unwrap_or(0);
        Self {
            label: s.label.clone(),
            hit_ratio: s.hit_rate,
            hit_vs_infinite: s
                .oracles
                .map_or(f64::NAN, |o| s.hit_rate / o.infinite.ratio()),
            ttft_p50_ms: s.ttft_p50_ms,
            ttft_p99_ms: s.ttft_p99_ms,
            p50_vs_rr: 1.0,
            p99_vs_rr: 1.0,
            max_pod_share: if total == 0 {
                f64::NAN
            } else {
                busiest as f64 / total as f64
            },
            errors: s.errors,
            goals: None,
        }
    }

    fn judged(mut self, rr: &Row, spec: &GoalSpec) -> Self {
        self.p50_vs_rr = self.ttft_p50_ms / rr.ttft_p50_ms;
        self.p99_vs_rr = self.ttft_p99_ms / rr.ttft_p99_ms;
        self.goals = Some(Goals {
            hit: match spec.hit_ratio {
                Some(h) => self.hit_ratio >= h,
                None => self.hit_vs_infinite >= spec.hit_vs_infinite,
            },
            p50: self.p50_vs_rr <= spec.p50_vs_rr,
            p99: self.p99_vs_rr <= P99_NOISE,
            balance: self.max_pod_share <= MAX_POD_SHARE + 1e-9,
        });
        self
    }
}

/// The rows of one cell from its summaries (round robin's first), each judged against it.
pub fn judge(summaries: &[Summary], spec: &GoalSpec) -> Vec<Row> {
    let rows: Vec<Row> = summaries.iter().map(Row::of).collect();
    let Some(rr) = rows.first().cloned() else {
        return rows;
    };
    std::iter::once(rr.clone())
        .chain(rows.into_iter().skip(1).map(|r| r.judged(&rr, spec)))
        .collect()
}

/// Runs every cell: a fresh fleet of slow pods per cell, round robin then each strategy.
pub async fn run(bins: &Binaries, opts: &SmallFleetOptions) -> Result<SmallFleetReport> {
    let mut cells = Vec::new();
    for &(pods, sessions) in &opts.cells {
        let strategies: Vec<Strategy> = std::iter::once(Strategy::RoundRobin)
            .chain(
                opts.strategies
                    .iter()
                    .copied()
                    .filter(|s| *s != Strategy::RoundRobin),
            )
            .collect();
        let copts = CompareOptions {
            envoy: opts.envoy.clone(),
            pods,
            gpu_blocks: 4096,
            sim_args: opts.sim_args.clone(),
            slow_pods: (0, 1.0),
            strategies: strategies.clone(),
            request_timeout: Duration::from_secs(120),
            model: "sim-model".into(),
            progress: false,
            replicas: None,
            redis_replicas: None,
            router_metrics: opts.router_metrics.clone(),
            repeat: 1,
            pd_prefill: 0,
        };
        let spec = opts.spec(sessions);
        let arrivals = match opts.clients {
            Some(c) => Arrivals::Closed { concurrency: c },
            None => Arrivals::Poisson {
                rate: opts.session_rate,
            },
        };
        let seed = opts.seed;
        eprintln!("kv-bench: small fleet: {pods} pods, {sessions} sessions");
        if let Some(llama) = &opts.llama {
            let summaries = crate::llama::compare(
                bins,
                opts.envoy.as_deref(),
                llama,
                pods,
                &strategies,
                || spec.build().with_arrivals(arrivals, seed),
                arrivals.concurrency(),
            )
            .await?;
            cells.push(CellReport {
                pods,
                sessions,
                rows: judge(&summaries, &opts.goals),
            });
            continue;
        }
        let cmp = compare::compare(
            bins,
            &copts,
            || spec.build().with_arrivals(arrivals, seed),
            arrivals.concurrency(),
        )
        .await?;
        cells.push(CellReport {
            pods,
            sessions,
            rows: judge(&cmp.summaries(), &opts.goals),
        });
    }
    Ok(SmallFleetReport {
        workload: opts.describe(),
        cells,
    })
}

impl SmallFleetReport {
    /// One table: a row per cell and strategy, each goal ✓/✗.
    pub fn table(&self, style: Style) -> String {
        let mut t = Table::new([
            "pods x sessions",
            "strategy",
            "hit ratio",
            "hit / infinite",
            "TTFT p50 ms",
            "p50 / RR",
            "TTFT p99 ms",
            "p99 / RR",
            "busiest pod",
            "errors",
            "goals",
        ])
        .left(1)
        .left(10);
        let mark = |ok: bool| if ok { "✓" } else { "✗" };
        for c in &self.cells {
            for r in &c.rows {
                let goals = r.goals.map_or("(reference)".to_string(), |g| {
                    format!(
                        "hit {} p50 {} p99 {} balance {}",
                        mark(g.hit),
                        mark(g.p50),
                        mark(g.p99),
                        mark(g.balance)
                    )
                });
                t.row(vec![
                    format!("{} x {}", c.pods, c.sessions),
                    r.label.clone(),
                    format!("{:.3}", r.hit_ratio),
                    format!("{:.3}", r.hit_vs_infinite),
                    format!("{:.0}", r.ttft_p50_ms),
                    format!("{:.2}", r.p50_vs_rr),
                    format!("{:.0}", r.ttft_p99_ms),
                    format!("{:.3}", r.p99_vs_rr),
                    format!("{:.0} %", 100.0 * r.max_pod_share),
                    r.errors.to_string(),
                    goals,
                ]);
            }
        }
        t.render(style)
    }

    /// `(cell, strategy)` pairs that miss a goal.
    pub fn misses(&self) -> Vec<String> {
        self.cells
            .iter()
            .flat_map(|c| {
                c.rows.iter().filter_map(move |r| {
                    r.goals
                        .filter(|g| !g.all())
                        .map(|_| format!("{} x {}: {}", c.pods, c.sessions, r.label))
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::oracle::{HitTokens, Oracles};

    fn summary(label: &str, hit: f64, p50: f64, p99: f64, per_pod: &[usize]) -> Summary {
        Summary {
            label: label.into(),
            workload: "multiturn".into(),
            requests: per_pod.iter().sum(),
            errors: 0,
            prompt_tokens: 1000,
            cached_tokens: (hit * 1000.0) as u64,
            hit_rate: hit,
            ttft_p50_ms: p50,
            ttft_p90_ms: p99,
            ttft_p95_ms: p99,
            ttft_p99_ms: p99,
            e2e_p50_ms: p50,
            e2e_p99_ms: p99,
            per_pod: per_pod
                .iter()
                .enumerate()
                .map(|(i, n)| (format!("pod-{i}"), *n))
                .collect::<BTreeMap<_, _>>(),
            pods: per_pod.len(),
            hotspot: 1.0,
            duration_s: 1.0,
            throughput_rps: 1.0,
            ttfts_ms: vec![p50, p99],
            cpu_s: None,
            oracles: Some(Oracles {
                infinite: HitTokens {
                    hit_tokens: 900,
                    prompt_tokens: 1000,
                },
                pooled: HitTokens {
                    hit_tokens: 900,
                    prompt_tokens: 1000,
                },
                pooled_blocks: 1,
            }),
        }
    }

    #[test]
    fn every_goal_is_judged_against_round_robin_in_the_same_cell() {
        let rows = judge(
            &[
                summary("round-robin", 0.6, 500.0, 2000.0, &[8, 8]),
                summary("good", 0.88, 150.0, 2030.0, &[8, 8]),
                summary("piled", 0.9, 100.0, 2500.0, &[16, 0]),
                summary("cold", 0.8, 300.0, 2000.0, &[9, 7]),
            ],
            &GoalSpec::default(),
        );
        assert!(rows[0].goals.is_none(), "round robin is the reference");
        let g = |i: usize| rows[i].goals.unwrap();
        assert!(g(1).all());
        assert!(!g(2).balance && !g(2).p99 && g(2).hit && g(2).p50);
        assert!(!g(3).hit && !g(3).p50 && g(3).p99 && g(3).balance);
        assert!((rows[1].hit_vs_infinite - 0.88 / 0.9).abs() < 1e-9);
        assert!(
            (rows[1].p99_vs_rr - 1.015).abs() < 1e-9,
            "p99 within the noise band"
        );
        assert!((rows[1].p50_vs_rr - 0.3).abs() < 1e-9);
        assert_eq!(rows[2].max_pod_share, 1.0);
        let report = SmallFleetReport {
            workload: "w".into(),
            cells: vec![CellReport {
                pods: 2,
                sessions: 2,
                rows,
            }],
        };
        assert_eq!(report.misses(), vec!["2 x 2: piled", "2 x 2: cold"]);
        // The sessionless shape judges the pods' own hit ratio and a looser p50.
        let spec = SmallFleetOptions::sessionless().goals;
        let rows = judge(
            &[
                summary("round-robin", 0.6, 500.0, 2000.0, &[8, 8]),
                summary("cold", 0.8, 250.0, 2000.0, &[9, 7]),
                summary("warm", 0.86, 280.0, 2000.0, &[9, 7]),
            ],
            &spec,
        );
        assert!(!rows[1].goals.unwrap().hit && rows[1].goals.unwrap().p50);
        assert!(rows[2].goals.unwrap().all(), "{:?}", rows[2]);
        let md = report.table(Style::Markdown);
        assert!(md.contains("| 2 x 2") && md.contains("(reference)"), "{md}");
    }
}
