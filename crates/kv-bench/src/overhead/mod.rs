//! `kv-bench overhead`: the latency Envoy, ext_proc and kv-router add to a request.
//!
//! One fleet (instant simulated pods, a round-robin Envoy, a no-op ext_proc + Envoy, kv-router +
//! Envoy) is driven with non-streamed `/v1/completions` (`max_tokens: 1`) of fixed prompt sizes
//! at fixed concurrencies (closed loop). Every (size, concurrency) cell runs all four paths in
//! rounds, in an order that rotates per round, so drift on a shared machine spreads over paths.
//! CPU time of kv-router, the no-op processor and each Envoy comes from `/proc`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

mod answer;
pub mod cpu;
mod fleet;
mod goals;
mod load;

use super::report::percentile;
use super::table::{Style, Table};
pub use answer::AnswerCell;
use cpu::{clock_ticks_per_s, envoy_version, CpuSource};
use fleet::Fleet;
pub use goals::Goal;
use kv_testkit::deploy::{self, Binaries};
use load::{bodies, drive, envoy_counter, FAILED_OPEN_STAT};

/// A way to reach the pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PathKind {
    /// Straight to a pod (the client alternates pods).
    Direct,
    /// Envoy with `round-robin.yaml`: the baseline of "added" latency.
    EnvoyRoundRobin,
    /// Envoy with `override-host-buffered.yaml` and the no-op processor: the ext_proc floor.
    EnvoyNoopExtProc,
    /// Envoy with `override-host-buffered.yaml` and kv-router (approximate, the default).
    EnvoyKvRouter,
    /// Envoy with `override-host-buffered.yaml` and kv-router in precise mode (the pods' KV
    /// events, vllm-sim's tokenizer).
    EnvoyKvRouterPrecise,
}

/// Every path, in table order.
pub const PATHS: [PathKind; 5] = [
    PathKind::Direct,
    PathKind::EnvoyRoundRobin,
    PathKind::EnvoyNoopExtProc,
    PathKind::EnvoyKvRouter,
    PathKind::EnvoyKvRouterPrecise,
];

impl PathKind {
    /// The name used in the JSON and the table.
    pub fn label(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::EnvoyRoundRobin => "envoy-round-robin",
            Self::EnvoyNoopExtProc => "envoy-noop-ext-proc",
            Self::EnvoyKvRouter => "envoy-kv-router",
            Self::EnvoyKvRouterPrecise => "envoy-kv-router-precise",
        }
    }

    /// Whether this path goes through one of the kv-router processes.
    pub fn is_router(self) -> bool {
        matches!(self, Self::EnvoyKvRouter | Self::EnvoyKvRouterPrecise)
    }
}

/// Parameters of a run.
#[derive(Debug, Clone)]
pub struct OverheadOptions {
    /// Prompt sizes in bytes of prompt text.
    pub sizes: Vec<usize>,
    /// Closed-loop concurrencies.
    pub concurrencies: Vec<usize>,
    /// Measured requests per cell (path × size × concurrency), over all rounds.
    pub requests: usize,
    /// Unmeasured requests before each round of a cell (at least the concurrency).
    pub warmup: usize,
    /// Rounds per (size, concurrency); the path order rotates every round.
    pub rounds: usize,
    /// Simulated pods.
    pub pods: usize,
    /// The CI variant (recorded in the report).
    pub quick: bool,
}

impl OverheadOptions {
    /// The full run: 1 KB / 8 KB / 400 KB at concurrency 1 and 32, 1000 requests per cell
    /// (enough that 10 ms CPU ticks resolve 0.01 ms per request).
    pub fn full() -> Self {
        Self {
            sizes: vec![1024, 8 * 1024, 400 * 1024],
            concurrencies: vec![1, 32],
            requests: 1000,
            warmup: 20,
            rounds: 2,
            pods: 2,
            quick: false,
        }
    }

    /// The CI variant: the same cells with a few requests each.
    pub fn quick() -> Self {
        Self {
            requests: 40,
            warmup: 4,
            rounds: 1,
            quick: true,
            ..Self::full()
        }
    }
}

impl Default for OverheadOptions {
    fn default() -> Self {
        Self::full()
    }
}

/// Results of one (path, prompt size, concurrency) cell.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    /// How requests reached the pods.
    pub path: PathKind,
    /// Bytes of prompt text.
    pub prompt_bytes: usize,
    /// Requests in flight.
    pub concurrency: usize,
    /// Measured requests.
    pub requests: usize,
    /// Requests without a 2xx and a complete body.
    pub errors: usize,
    /// Envoy `ext_proc.failure_mode_allowed` increments (the processor failed, Envoy went on).
    pub failed_open: u64,
    /// Client-side latency (request sent → body read), percentiles and mean, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Mean, ms.
    pub mean_ms: f64,
    /// p50 minus envoy-round-robin's p50 at the same size and concurrency, ms.
    pub added_p50_ms: Option<f64>,
    /// p99 minus envoy-round-robin's p99 at the same size and concurrency, ms.
    pub added_p99_ms: Option<f64>,
    /// Requests per second of measured wall time.
    pub throughput_rps: f64,
    /// That path's kv-router CPU (user + system) per request, ms (kv-router paths only).
    pub router_cpu_ms_per_request: Option<f64>,
    /// The same minus kv-router's idle background over the cell's wall time, ms (at least 0).
    pub router_cpu_net_ms_per_request: Option<f64>,
    /// The no-op processor thread's CPU per request, ms (envoy-noop-ext-proc only).
    pub noop_cpu_ms_per_request: Option<f64>,
    /// This path's Envoy CPU per request, ms (Envoy paths only).
    pub envoy_cpu_ms_per_request: Option<f64>,
    /// The first error seen, for diagnosis.
    pub first_error: Option<String>,
}

/// The whole report (`--json`).
#[derive(Debug, Clone, Serialize)]
pub struct OverheadReport {
    /// Run with `--quick`.
    pub quick: bool,
    /// Envoy binary used.
    pub envoy: PathBuf,
    /// `envoy --version` output.
    pub envoy_version: String,
    /// CPU model and core count.
    pub machine: String,
    /// Simulated pods.
    pub pods: usize,
    /// Measured requests per cell.
    pub requests_per_cell: usize,
    /// Warm-up requests before each round of a cell.
    pub warmup_per_round: usize,
    /// Rounds per (size, concurrency).
    pub rounds: usize,
    /// `sysconf(_SC_CLK_TCK)`: CPU figures are multiples of 1000 / this ms, divided by requests.
    pub clock_ticks_per_s: u64,
    /// Approximate kv-router's CPU while it got no traffic (health probes, scrapes), ms per second.
    pub router_idle_cpu_ms_per_s: f64,
    /// The same for the precise kv-router (which also reads the pods' KV events).
    pub precise_idle_cpu_ms_per_s: f64,
    /// Wall time of the whole run, seconds.
    pub duration_s: f64,
    /// Every cell.
    pub cells: Vec<Cell>,
    /// Each processor's answer time without Envoy, per prompt size (c=1).
    pub answers: Vec<AnswerCell>,
    /// The goals checked on these cells (kv-router against the no-op floor).
    pub goals: Vec<Goal>,
}

/// What a cell accumulates over its rounds.
#[derive(Debug, Default)]
struct Acc {
    latencies: Vec<f64>,
    errors: usize,
    failed_open: u64,
    first_error: Option<String>,
    wall: Duration,
    router_ticks: u64,
    noop_ticks: u64,
    envoy_ticks: u64,
}

/// Every router's CPU ticks now.
fn ticks_of(sources: &BTreeMap<PathKind, CpuSource>) -> Result<BTreeMap<PathKind, u64>> {
    sources
        .iter()
        .map(|(p, src)| Ok((*p, src.ticks()?)))
        .collect()
}

/// Measured requests of round `round` out of `rounds` (the remainder goes to the first rounds).
fn round_share(total: usize, rounds: usize, round: usize) -> usize {
    let rounds = rounds.max(1);
    total / rounds + usize::from(round < total % rounds)
}

/// Runs every cell on a fresh fleet and returns the report. `envoy`: [`deploy::find_envoy`] rules.
pub async fn run(
    bins: &Binaries,
    envoy: Option<&Path>,
    opts: &OverheadOptions,
) -> Result<OverheadReport> {
    let started = Instant::now();
    let envoy = deploy::find_envoy(envoy)?;
    let mut fleet = Fleet::start(bins, &envoy, opts.pods).await?;
    let client = kv_testkit::runner::client();
    let pid = |p: &mut kv_testkit::deploy::ChildProc| p.pid().context("process is not running");
    let router_cpu: BTreeMap<PathKind, CpuSource> = [
        (PathKind::EnvoyKvRouter, pid(fleet.router.process())?),
        (
            PathKind::EnvoyKvRouterPrecise,
            pid(fleet.precise.process())?,
        ),
    ]
    .into_iter()
    .map(|(p, id)| (p, CpuSource::process(id)))
    .collect();
    let noop_cpu = CpuSource::own_thread(fleet.noop.tid);
    let envoy_cpu: BTreeMap<PathKind, CpuSource> = [
        (PathKind::EnvoyRoundRobin, pid(fleet.rr_envoy.process())?),
        (PathKind::EnvoyNoopExtProc, pid(fleet.noop_envoy.process())?),
        (PathKind::EnvoyKvRouter, pid(fleet.kv_envoy.process())?),
        (
            PathKind::EnvoyKvRouterPrecise,
            pid(fleet.precise_envoy.process())?,
        ),
    ]
    .into_iter()
    .map(|(p, id)| (p, CpuSource::process(id)))
    .collect();
    let fleet = fleet;
    let hz = clock_ticks_per_s();
    let mut accs: BTreeMap<(usize, usize, PathKind), Acc> = BTreeMap::new();
    // Per router: CPU ticks and wall time while the other paths ran.
    let mut idle: BTreeMap<PathKind, (u64, Duration)> = BTreeMap::new();
    let mut cell_no = 0usize;
    let mut all_bodies = Vec::new();
    for &size in &opts.sizes {
        let bodies = Arc::new(bodies(size));
        all_bodies.push((size, bodies.to_vec()));
        for &conc in &opts.concurrencies {
            for round in 0..opts.rounds.max(1) {
                let n = round_share(opts.requests, opts.rounds, round);
                for k in 0..PATHS.len() {
                    let path = PATHS[(cell_no + round + k) % PATHS.len()];
                    let urls = fleet.urls(path);
                    let warm = drive(&client, &urls, &bodies, opts.warmup.max(conc), conc).await;
                    if warm.errors > 0 {
                        anyhow::bail!(
                            "{} warm-up failed ({} errors, first: {}); {}",
                            path.label(),
                            warm.errors,
                            warm.first_error.unwrap_or_default(),
                            fleet.diag()
                        );
                    }
                    let envoy = fleet.envoy(path);
                    let stats_before = match envoy {
                        Some(e) if path != PathKind::EnvoyRoundRobin => Some(e.stats().await?),
                        _ => None,
                    };
                    let r0 = ticks_of(&router_cpu)?;
                    let n0 = noop_cpu.ticks()?;
                    let e0 = envoy_cpu.get(&path).map(CpuSource::ticks).transpose()?;
                    let batch = drive(&client, &urls, &bodies, n, conc).await;
                    let r1 = ticks_of(&router_cpu)?;
                    let dn = noop_cpu.ticks()? - n0;
                    let de = match (envoy_cpu.get(&path), e0) {
                        (Some(src), Some(e0)) => src.ticks()? - e0,
                        _ => 0,
                    };
                    let failed_open = match (envoy, stats_before) {
                        (Some(e), Some(before)) => {
                            let after = e.stats().await?;
                            envoy_counter(&after, FAILED_OPEN_STAT)
                                .saturating_sub(envoy_counter(&before, FAILED_OPEN_STAT))
                        }
                        _ => 0,
                    };
                    let mut dr = 0;
                    for (router, t1) in &r1 {
                        let d = t1 - r0[router];
                        if *router == path {
                            dr = d;
                        } else {
                            let e = idle.entry(*router).or_default();
                            e.0 += d;
                            e.1 += batch.wall;
                        }
                    }
                    let acc = accs.entry((size, conc, path)).or_default();
                    acc.latencies.extend(batch.latencies);
                    acc.errors += batch.errors;
                    acc.failed_open += failed_open;
                    if acc.first_error.is_none() {
                        acc.first_error = batch.first_error;
                    }
                    acc.wall += batch.wall;
                    acc.router_ticks += dr;
                    acc.noop_ticks += dn;
                    acc.envoy_ticks += de;
                }
            }
            cell_no += 1;
            tracing::info!(size, conc, "overhead cell done");
        }
    }
    let targets = [
        (PathKind::EnvoyNoopExtProc, fleet.noop.addr),
        (PathKind::EnvoyKvRouter, fleet.router.grpc),
        (PathKind::EnvoyKvRouterPrecise, fleet.precise.grpc),
    ]
    .map(|(path, addr)| answer::Target { path, addr });
    let answers = answer::measure(
        &targets,
        &all_bodies,
        opts.requests,
        opts.rounds,
        opts.warmup,
    )
    .await?;
    let tick_ms = 1000.0 / hz as f64;
    let idle_ms_per_s = |router: PathKind| {
        let (ticks, wall) = idle.get(&router).copied().unwrap_or_default();
        ticks as f64 * tick_ms / wall.as_secs_f64().max(1e-9)
    };
    let mut cells: Vec<Cell> = accs
        .into_iter()
        .map(|((size, conc, path), mut a)| {
            let requests = a.latencies.len() + a.errors;
            let per_req = |ticks: u64| ticks as f64 * tick_ms / requests.max(1) as f64;
            let mean = if a.latencies.is_empty() {
                f64::NAN
            } else {
                a.latencies.iter().sum::<f64>() / a.latencies.len() as f64
            };
            Cell {
                path,
                prompt_bytes: size,
                concurrency: conc,
                requests,
                errors: a.errors,
                failed_open: a.failed_open,
                p50_ms: percentile(&mut a.latencies, 50.0),
                p99_ms: percentile(&mut a.latencies, 99.0),
                mean_ms: mean,
                added_p50_ms: None,
                added_p99_ms: None,
                throughput_rps: requests as f64 / a.wall.as_secs_f64().max(1e-9),
                router_cpu_ms_per_request: path.is_router().then(|| per_req(a.router_ticks)),
                router_cpu_net_ms_per_request: path.is_router().then(|| {
                    (per_req(a.router_ticks)
                        - idle_ms_per_s(path) * a.wall.as_secs_f64() / requests.max(1) as f64)
                        .max(0.0)
                }),
                noop_cpu_ms_per_request: (path == PathKind::EnvoyNoopExtProc)
                    .then(|| per_req(a.noop_ticks)),
                envoy_cpu_ms_per_request: (path != PathKind::Direct)
                    .then(|| per_req(a.envoy_ticks)),
                first_error: a.first_error,
            }
        })
        .collect();
    fill_added(&mut cells);
    let goals = goals::check(&cells);
    Ok(OverheadReport {
        quick: opts.quick,
        envoy_version: envoy_version(&envoy),
        envoy,
        machine: super::results::machine(),
        pods: opts.pods,
        requests_per_cell: opts.requests,
        warmup_per_round: opts.warmup,
        rounds: opts.rounds.max(1),
        clock_ticks_per_s: hz,
        router_idle_cpu_ms_per_s: idle_ms_per_s(PathKind::EnvoyKvRouter),
        precise_idle_cpu_ms_per_s: idle_ms_per_s(PathKind::EnvoyKvRouterPrecise),
        duration_s: started.elapsed().as_secs_f64(),
        cells,
        answers,
        goals,
    })
}

/// Sets each cell's added p50/p99 against envoy-round-robin at the same size and concurrency.
fn fill_added(cells: &mut [Cell]) {
    let base: BTreeMap<(usize, usize), (f64, f64)> = cells
        .iter()
        .filter(|c| c.path == PathKind::EnvoyRoundRobin)
        .map(|c| ((c.prompt_bytes, c.concurrency), (c.p50_ms, c.p99_ms)))
        .collect();
    for c in cells.iter_mut() {
        if let Some(&(p50, p99)) = base.get(&(c.prompt_bytes, c.concurrency)) {
            c.added_p50_ms = Some(c.p50_ms - p50);
            c.added_p99_ms = Some(c.p99_ms - p99);
        }
    }
}

fn size_label(bytes: usize) -> String {
    if bytes.is_multiple_of(1024) {
        format!("{} KB", bytes / 1024)
    } else {
        format!("{bytes} B")
    }
}

fn num(v: f64, digits: usize) -> String {
    if v.is_finite() {
        format!("{v:.digits$}")
    } else {
        "–".into()
    }
}

fn signed(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:+.3}"),
        _ => "–".into(),
    }
}

impl OverheadReport {
    /// The table as markdown, with notes on how to read it (no heading).
    pub fn markdown(&self) -> String {
        let header = [
            "prompt",
            "conc",
            "path",
            "requests",
            "errors",
            "p50 ms",
            "p99 ms",
            "mean ms",
            "+p50 vs RR ms",
            "+p99 vs RR ms",
            "req/s",
            "ext_proc CPU ms/req",
            "Envoy CPU ms/req",
        ];
        let mut t = Table::new(header).left(2);
        for c in &self.cells {
            let proc_cpu = c
                .router_cpu_net_ms_per_request
                .or(c.noop_cpu_ms_per_request);
            t.row(vec![
                size_label(c.prompt_bytes),
                c.concurrency.to_string(),
                c.path.label().to_string(),
                c.requests.to_string(),
                (c.errors as u64 + c.failed_open).to_string(),
                num(c.p50_ms, 3),
                num(c.p99_ms, 3),
                num(c.mean_ms, 3),
                signed(c.added_p50_ms),
                signed(c.added_p99_ms),
                num(c.throughput_rps, 0),
                proc_cpu.map_or("–".into(), |v| num(v, 3)),
                c.envoy_cpu_ms_per_request.map_or("–".into(), |v| num(v, 3)),
            ]);
        }
        let mut s = t.render(Style::Markdown);
        s.push_str(&format!(
            "\n{} measured requests per cell ({} round(s), path order rotating, {} warm-up \
             requests per round, at least the concurrency); {} instant simulated pods; \
             non-streamed /v1/completions, max_tokens 1. Latency is client-side, request sent to \
             body read. Errors include ext_proc fail-open events. ext_proc CPU is kv-router's \
             process (envoy-kv-router, envoy-kv-router-precise: two processes) or the no-op \
             processor's thread (envoy-noop-ext-proc), user + system from /proc in {:.0} ms \
             ticks; each kv-router's figure excludes its idle background (health probes, metric \
             scrapes, KV events: {:.3} ms/s approximate, {:.3} ms/s precise, measured while \
             other paths ran; the JSON has the raw figures too). Envoy: {}, 2 worker threads each. Machine: {}. Took {:.0} s.\n",
            self.requests_per_cell,
            self.rounds,
            self.warmup_per_round,
            self.pods,
            1000.0 / self.clock_ticks_per_s as f64,
            self.router_idle_cpu_ms_per_s,
            self.precise_idle_cpu_ms_per_s,
            self.envoy_version,
            self.machine,
            self.duration_s,
        ));
        if !self.answers.is_empty() {
            s.push('\n');
            s.push_str(&answer::markdown(&self.answers));
        }
        if !self.goals.is_empty() {
            s.push_str(
                "\nGoals (docs/microbench.md): kv-router against the no-op ext_proc at the same \
                 size and concurrency. Floor: the no-op's own p50 over round robin (Envoy's ext_proc \
                 round trip) for added latency, its p50/p99 in ms for the ratios, its CPU.\n\n",
            );
            s.push_str(&goals::markdown(&self.goals));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_split_the_requests() {
        assert_eq!((0..3).map(|r| round_share(10, 3, r)).sum::<usize>(), 10);
        assert_eq!(round_share(10, 3, 0), 4);
        assert_eq!(round_share(10, 0, 0), 10);
    }

    fn cell(path: PathKind, size: usize, p50: f64, p99: f64) -> Cell {
        Cell {
            path,
            prompt_bytes: size,
            concurrency: 1,
            requests: 10,
            errors: 0,
            failed_open: 0,
            p50_ms: p50,
            p99_ms: p99,
            mean_ms: p50,
            added_p50_ms: None,
            added_p99_ms: None,
            throughput_rps: 100.0,
            router_cpu_ms_per_request: (path == PathKind::EnvoyKvRouter).then_some(0.5),
            router_cpu_net_ms_per_request: (path == PathKind::EnvoyKvRouter).then_some(0.25),
            noop_cpu_ms_per_request: None,
            envoy_cpu_ms_per_request: (path != PathKind::Direct).then_some(0.125),
            first_error: None,
        }
    }

    fn report(cells: Vec<Cell>) -> OverheadReport {
        OverheadReport {
            goals: goals::check(&cells),
            quick: true,
            envoy: "/x/envoy".into(),
            envoy_version: "1.40.0".into(),
            machine: "2 cores".into(),
            pods: 2,
            requests_per_cell: 10,
            warmup_per_round: 2,
            rounds: 1,
            clock_ticks_per_s: 100,
            router_idle_cpu_ms_per_s: 0.5,
            precise_idle_cpu_ms_per_s: 0.75,
            duration_s: 3.0,
            cells,
            answers: vec![],
        }
    }

    #[test]
    fn added_latency_is_against_round_robin_of_the_same_cell() {
        let mut cells = vec![
            cell(PathKind::Direct, 1024, 0.5, 1.0),
            cell(PathKind::EnvoyRoundRobin, 1024, 0.75, 2.0),
            cell(PathKind::EnvoyKvRouter, 1024, 1.25, 3.5),
            cell(PathKind::EnvoyRoundRobin, 8192, 5.0, 9.0),
            cell(PathKind::EnvoyKvRouter, 8192, 6.0, 9.5),
        ];
        fill_added(&mut cells);
        assert_eq!(cells[0].added_p50_ms, Some(-0.25));
        assert_eq!(cells[1].added_p99_ms, Some(0.0));
        assert_eq!(
            (cells[2].added_p50_ms, cells[2].added_p99_ms),
            (Some(0.5), Some(1.5))
        );
        assert_eq!(
            (cells[4].added_p50_ms, cells[4].added_p99_ms),
            (Some(1.0), Some(0.5))
        );
    }

    #[test]
    fn markdown_has_a_row_per_cell() {
        let mut cells = vec![
            cell(PathKind::EnvoyRoundRobin, 400 * 1024, 0.75, 2.0),
            cell(PathKind::EnvoyKvRouter, 400 * 1024, 1.25, 3.5),
        ];
        fill_added(&mut cells);
        let md = report(cells).markdown();
        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with('|')).collect();
        assert_eq!(rows.len(), 4, "{md}");
        let cols = rows[0].matches('|').count();
        assert!(rows.iter().all(|r| r.matches('|').count() == cols), "{md}");
        let fields: Vec<&str> = rows[3].split('|').map(str::trim).collect();
        assert_eq!(
            fields,
            [
                "",
                "400 KB",
                "1",
                "envoy-kv-router",
                "10",
                "0",
                "1.250",
                "3.500",
                "1.250",
                "+0.500",
                "+1.500",
                "100",
                "0.250",
                "0.125",
                ""
            ]
        );
        assert!(rows[1].starts_with("| ---"), "{md}");
        assert!(md.contains("10 measured requests per cell"));
        let json = serde_json::to_value(report(vec![])).unwrap();
        assert_eq!(json["clock_ticks_per_s"], 100);
    }

    #[test]
    fn cell_serializes_with_kebab_paths() {
        let v = serde_json::to_value(cell(PathKind::EnvoyNoopExtProc, 1024, 1.0, 2.0)).unwrap();
        assert_eq!(v["path"], "envoy-noop-ext-proc");
        assert!(v["added_p50_ms"].is_null());
    }
}
