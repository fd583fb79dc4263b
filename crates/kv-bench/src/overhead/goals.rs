//! The overhead goals, checked on every report: kv-router against the no-op ext_proc (the floor:
//! Envoy's own ext_proc round trip) at the same size and concurrency.

use serde::Serialize;

use super::super::table::{Style, Table};
use super::{size_label, Cell, PathKind};

/// One goal checked against one cell pair.
#[derive(Debug, Clone, Serialize)]
pub struct Goal {
    /// What is measured, e.g. "p50 over no-op".
    pub what: String,
    /// The kv-router path.
    pub path: PathKind,
    /// Bytes of prompt text.
    pub prompt_bytes: usize,
    /// Requests in flight.
    pub concurrency: usize,
    /// The measured value.
    pub value: f64,
    /// The goal (an upper bound).
    pub limit: f64,
    /// The floor beside it, from the no-op processor in the same cell: its own p50 over Envoy
    /// round robin (Envoy's ext_proc round trip) for added latency, its p50/p99 in ms for the
    /// ratios, its CPU per request for CPU.
    pub floor: f64,
    /// `value <= limit`.
    pub met: bool,
}

/// The router-overhead goals over `cells`: added p50 at c=1 (≤ +0.1 ms for 1–8 KB, ≤ +0.3 ms at
/// 400 KB), p50/p99 at c=32 (≤ 1.1 × no-op), CPU per 400 KB request (≤ 2 ms approximate, ≤ 10 ms
/// precise). Cells a run did not measure are skipped.
pub fn check(cells: &[Cell]) -> Vec<Goal> {
    let find = |path: PathKind, size: usize, conc: usize| {
        cells
            .iter()
            .find(|c| c.path == path && c.prompt_bytes == size && c.concurrency == conc)
    };
    let mut goals = Vec::new();
    let mut sizes: Vec<(usize, usize)> = cells
        .iter()
        .map(|c| (c.prompt_bytes, c.concurrency))
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    for (size, conc) in sizes {
        let Some(noop) = find(PathKind::EnvoyNoopExtProc, size, conc) else {
            continue;
        };
        for path in [PathKind::EnvoyKvRouter, PathKind::EnvoyKvRouterPrecise] {
            let Some(c) = find(path, size, conc) else {
                continue;
            };
            let mut push = |what: &str, value: f64, limit: f64, floor: f64| {
                goals.push(Goal {
                    what: what.into(),
                    path,
                    prompt_bytes: size,
                    concurrency: conc,
                    value,
                    limit,
                    floor,
                    met: value <= limit,
                })
            };
            if conc == 1 {
                let limit = if size <= 8 * 1024 { 0.1 } else { 0.3 };
                let floor = noop.added_p50_ms.unwrap_or(f64::NAN);
                push("p50 over no-op, ms", c.p50_ms - noop.p50_ms, limit, floor);
            } else {
                push("p50 / no-op's", c.p50_ms / noop.p50_ms, 1.1, noop.p50_ms);
                push("p99 / no-op's", c.p99_ms / noop.p99_ms, 1.1, noop.p99_ms);
            }
            if size >= 256 * 1024 {
                let limit = if path == PathKind::EnvoyKvRouter {
                    2.0
                } else {
                    10.0
                };
                if let (Some(cpu), Some(floor)) = (
                    c.router_cpu_net_ms_per_request,
                    noop.noop_cpu_ms_per_request,
                ) {
                    push("CPU ms/request", cpu, limit, floor);
                }
            }
        }
    }
    goals
}

/// The goals as a markdown table.
pub fn markdown(goals: &[Goal]) -> String {
    let mut t = Table::new([
        "prompt",
        "conc",
        "path",
        "measure",
        "value",
        "goal",
        "floor (no-op)",
        "met",
    ])
    .left(2)
    .left(3)
    .left(7);
    for g in goals {
        t.row(vec![
            size_label(g.prompt_bytes),
            g.concurrency.to_string(),
            g.path.label().to_string(),
            g.what.clone(),
            format!("{:.3}", g.value),
            format!("≤ {}", g.limit),
            format!("{:.3}", g.floor),
            if g.met { "yes" } else { "**no**" }.into(),
        ]);
    }
    t.render(Style::Markdown)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(path: PathKind, size: usize, conc: usize, p50: f64, p99: f64, cpu: f64) -> Cell {
        Cell {
            path,
            prompt_bytes: size,
            concurrency: conc,
            requests: 10,
            errors: 0,
            failed_open: 0,
            p50_ms: p50,
            p99_ms: p99,
            mean_ms: p50,
            added_p50_ms: None,
            added_p99_ms: None,
            throughput_rps: 1.0,
            router_cpu_ms_per_request: path.is_router().then_some(cpu),
            router_cpu_net_ms_per_request: path.is_router().then_some(cpu),
            noop_cpu_ms_per_request: (path == PathKind::EnvoyNoopExtProc).then_some(cpu),
            envoy_cpu_ms_per_request: None,
            first_error: None,
        }
    }

    #[test]
    fn goals_compare_each_router_with_the_noop_at_the_same_cell() {
        let kb = 1024;
        let cells = vec![
            cell(PathKind::EnvoyNoopExtProc, kb, 1, 0.70, 1.0, 0.1),
            cell(PathKind::EnvoyKvRouter, kb, 1, 0.75, 1.0, 0.2),
            cell(PathKind::EnvoyKvRouterPrecise, kb, 1, 0.90, 1.0, 0.2),
            cell(PathKind::EnvoyNoopExtProc, 400 * kb, 32, 100.0, 200.0, 0.5),
            cell(PathKind::EnvoyKvRouter, 400 * kb, 32, 105.0, 230.0, 2.5),
        ];
        let g = check(&cells);
        let met: Vec<(&str, PathKind, bool)> =
            g.iter().map(|g| (g.what.as_str(), g.path, g.met)).collect();
        assert_eq!(
            met,
            vec![
                ("p50 over no-op, ms", PathKind::EnvoyKvRouter, true),
                ("p50 over no-op, ms", PathKind::EnvoyKvRouterPrecise, false),
                ("p50 / no-op's", PathKind::EnvoyKvRouter, true),
                ("p99 / no-op's", PathKind::EnvoyKvRouter, false),
                ("CPU ms/request", PathKind::EnvoyKvRouter, false),
            ]
        );
        assert_eq!(g[4].floor, 0.5);
        let md = markdown(&g);
        assert_eq!(
            md.lines().filter(|l| l.starts_with('|')).count(),
            2 + g.len()
        );
        assert!(md.contains("**no**"));
    }
}
