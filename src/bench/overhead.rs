//! `kv-bench overhead`: the latency Envoy, ext_proc and kv-router add to a request.
//!
//! One fleet (instant simulated pods, a round-robin Envoy, a no-op ext_proc + Envoy, kv-router +
//! Envoy) is driven with non-streamed `/v1/completions` (`max_tokens: 1`) of fixed prompt sizes
//! at fixed concurrencies (closed loop). Every (size, concurrency) cell runs all four paths in
//! rounds, in an order that rotates per round, so drift on a shared machine spreads over paths.
//! CPU time of kv-router, the no-op processor and each Envoy comes from `/proc`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use serde::Serialize;
use thiserror::Error;

use super::deploy::{self, Binaries, EnvoyOptions, EnvoyProc, RouterProc, SimPod};
use super::noop_extproc::NoopServer;
use super::prose::prose;
use super::report::percentile;
use super::splitmix::SplitMix64;
use super::table::{Style, Table};

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
    /// Envoy with `override-host-buffered.yaml` and kv-router.
    EnvoyKvRouter,
}

/// Every path, in table order.
pub const PATHS: [PathKind; 4] = [
    PathKind::Direct,
    PathKind::EnvoyRoundRobin,
    PathKind::EnvoyNoopExtProc,
    PathKind::EnvoyKvRouter,
];

impl PathKind {
    /// The name used in the JSON and the table.
    pub fn label(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::EnvoyRoundRobin => "envoy-round-robin",
            Self::EnvoyNoopExtProc => "envoy-noop-ext-proc",
            Self::EnvoyKvRouter => "envoy-kv-router",
        }
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
    /// kv-router CPU (user + system) per request, ms (envoy-kv-router only).
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
    /// kv-router CPU while it got no traffic (health probes, scrapes), ms per second.
    pub router_idle_cpu_ms_per_s: f64,
    /// Wall time of the whole run, seconds.
    pub duration_s: f64,
    /// Every cell.
    pub cells: Vec<Cell>,
}

/// Why a `/proc` CPU figure could not be read.
#[derive(Debug, Error)]
pub enum CpuStatError {
    /// The stat file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The stat line did not have numeric utime/stime fields.
    #[error("malformed stat line")]
    Malformed,
}

/// utime + stime (fields 14 and 15 of `/proc/<pid>/stat`), in clock ticks.
pub fn parse_stat_ticks(stat: &str) -> Result<u64, CpuStatError> {
    // comm (field 2) may contain spaces and parentheses: fields restart after the last ')'.
    let rest = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .ok_or(CpuStatError::Malformed)?;
    let mut f = rest.split_whitespace().skip(11);
    let mut next = || -> Result<u64, CpuStatError> {
        f.next()
            .and_then(|v| v.parse().ok())
            .ok_or(CpuStatError::Malformed)
    };
    Ok(next()? + next()?)
}

/// A `/proc/…/stat` file whose CPU time is tracked.
#[derive(Debug, Clone)]
struct CpuSource(PathBuf);

impl CpuSource {
    fn process(pid: u32) -> Self {
        Self(PathBuf::from(format!("/proc/{pid}/stat")))
    }

    fn own_thread(tid: i32) -> Self {
        Self(PathBuf::from(format!("/proc/self/task/{tid}/stat")))
    }

    fn ticks(&self) -> Result<u64, CpuStatError> {
        let text = std::fs::read_to_string(&self.0).map_err(|source| CpuStatError::Read {
            path: self.0.display().to_string(),
            source,
        })?;
        parse_stat_ticks(&text)
    }
}

fn clock_ticks_per_s() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

/// `model name` from /proc/cpuinfo and the number of online CPUs.
pub fn machine_description() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores, {model}")
}

fn envoy_version(bin: &Path) -> String {
    std::process::Command::new(bin)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        // "<sha>/1.40.0/Clean/RELEASE/BoringSSL": keep the release.
        .and_then(|s| s.rsplit_once("version: ").map(|(_, v)| v.to_string()))
        .map(|v| v.split('/').nth(1).unwrap_or(&v).to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// Sixteen distinct `/v1/completions` bodies whose prompt is exactly `bytes` bytes of text.
fn bodies(bytes: usize) -> Vec<Bytes> {
    (0..16u64)
        .map(|i| {
            let mut text = String::with_capacity(bytes + 64);
            prose(
                &mut SplitMix64::derive(i, "overhead", bytes as u64),
                bytes,
                &mut text,
            );
            // prose writes ASCII, so any byte index is a char boundary.
            text.truncate(bytes);
            let v = serde_json::json!({
                "model": "sim-model",
                "prompt": text,
                "max_tokens": 1,
                "stream": false,
            });
            Bytes::from(serde_json::to_vec(&v).expect("json"))
        })
        .collect()
}

/// Latencies (ms) of successful requests, error count and the first error.
#[derive(Debug, Default)]
struct Batch {
    latencies: Vec<f64>,
    errors: usize,
    first_error: Option<String>,
    wall: Duration,
}

const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

async fn one_request(client: &reqwest::Client, url: &str, body: Bytes) -> Result<(), String> {
    let send = async {
        let r = client
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| format!("send: {e}"))?;
        let status = r.status();
        let body = r.bytes().await.map_err(|e| format!("read: {e}"))?;
        if status.is_success() {
            Ok(())
        } else {
            let snippet = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
            Err(format!("HTTP {status}: {snippet}"))
        }
    };
    tokio::time::timeout(REQUEST_TIMEOUT, send)
        .await
        .unwrap_or_else(|_| Err(format!("timed out after {REQUEST_TIMEOUT:?}")))
}

/// Sends `n` requests with `concurrency` in flight; `urls` are used in turn (direct: one per pod).
async fn drive(
    client: &reqwest::Client,
    urls: &[String],
    bodies: &Arc<Vec<Bytes>>,
    n: usize,
    concurrency: usize,
) -> Batch {
    let next = Arc::new(AtomicUsize::new(0));
    let urls: Arc<Vec<String>> = Arc::new(urls.to_vec());
    let start = Instant::now();
    let workers: Vec<_> = (0..concurrency.max(1))
        .map(|_| {
            let (client, urls, bodies, next) =
                (client.clone(), urls.clone(), bodies.clone(), next.clone());
            tokio::spawn(async move {
                let mut out = Batch::default();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let url = &urls[i % urls.len()];
                    let t = Instant::now();
                    match one_request(&client, url, bodies[i % bodies.len()].clone()).await {
                        Ok(()) => out.latencies.push(t.elapsed().as_secs_f64() * 1e3),
                        Err(e) => {
                            out.errors += 1;
                            out.first_error.get_or_insert(e);
                        }
                    }
                }
                out
            })
        })
        .collect();
    let mut all = Batch::default();
    for w in workers {
        match w.await {
            Ok(b) => {
                all.latencies.extend(b.latencies);
                all.errors += b.errors;
                if all.first_error.is_none() {
                    all.first_error = b.first_error;
                }
            }
            Err(e) => {
                all.errors += 1;
                all.first_error
                    .get_or_insert(format!("worker panicked: {e}"));
            }
        }
    }
    all.wall = start.elapsed();
    all
}

/// `<name>: <value>` from Envoy's `/stats` text (0 when absent).
fn envoy_counter(stats: &str, name: &str) -> u64 {
    stats
        .lines()
        .filter_map(|l| l.split_once(": "))
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

const FAILED_OPEN_STAT: &str = "http.llm.ext_proc.failure_mode_allowed";

/// The running fleet; everything stops when it is dropped.
struct Fleet {
    pods: Vec<SimPod>,
    rr_envoy: EnvoyProc,
    router: RouterProc,
    kv_envoy: EnvoyProc,
    noop: NoopServer,
    noop_envoy: EnvoyProc,
}

impl Fleet {
    async fn start(bins: &Binaries, envoy: &Path, pods: usize) -> Result<Self> {
        let sim_args: Vec<String> = [
            "--prefill-us-per-token",
            "0",
            "--ttft-base-ms",
            "0",
            "--decode-ms-per-token",
            "0",
            // A 400 KB prompt (~100k tokens) fits without evicting the others.
            "--num-gpu-blocks",
            "65536",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let pods = deploy::spawn_pods(&bins.vllm_sim, pods, Some("pod-"), &sim_args)?;
        let addrs: Vec<SocketAddr> = pods.iter().map(|p| p.addr).collect();
        // Same Envoy options on every path, so only the filter chain differs.
        let eopts = EnvoyOptions {
            concurrency: 2,
            ..Default::default()
        };
        let buffered = deploy::envoy_template("override-host-buffered.yaml")?;
        let rr_envoy = EnvoyProc::spawn_with(
            envoy,
            &deploy::envoy_template("round-robin.yaml")?,
            None,
            &addrs,
            &eopts,
        )
        .await
        .context("starting the round-robin Envoy")?;
        let mut cfg = deploy::local_router_config(&addrs)?;
        cfg.log.level = "warn".into();
        let fallbacks = cfg.fallbacks;
        let router = RouterProc::spawn(&bins.kv_router, &cfg)
            .await
            .context("starting kv-router")?;
        router
            .wait_pods_ready(addrs.len(), Duration::from_secs(15))
            .await?;
        let kv_envoy = EnvoyProc::spawn_with(envoy, &buffered, Some(router.grpc), &addrs, &eopts)
            .await
            .context("starting the kv-router Envoy")?;
        let noop = NoopServer::start(&addrs, fallbacks)?;
        let noop_envoy = EnvoyProc::spawn_with(envoy, &buffered, Some(noop.addr), &addrs, &eopts)
            .await
            .context("starting the no-op ext_proc Envoy")?;
        Ok(Self {
            pods,
            rr_envoy,
            router,
            kv_envoy,
            noop,
            noop_envoy,
        })
    }

    fn urls(&self, path: PathKind) -> Vec<String> {
        let u = |base: String| vec![format!("{base}/v1/completions")];
        match path {
            PathKind::Direct => self
                .pods
                .iter()
                .map(|p| format!("{}/v1/completions", p.url()))
                .collect(),
            PathKind::EnvoyRoundRobin => u(self.rr_envoy.url()),
            PathKind::EnvoyNoopExtProc => u(self.noop_envoy.url()),
            PathKind::EnvoyKvRouter => u(self.kv_envoy.url()),
        }
    }

    fn envoy(&self, path: PathKind) -> Option<&EnvoyProc> {
        match path {
            PathKind::Direct => None,
            PathKind::EnvoyRoundRobin => Some(&self.rr_envoy),
            PathKind::EnvoyNoopExtProc => Some(&self.noop_envoy),
            PathKind::EnvoyKvRouter => Some(&self.kv_envoy),
        }
    }

    fn diag(&self) -> String {
        format!(
            "kv-router stderr:\n{}\nkv-router Envoy stderr:\n{}\nno-op Envoy stderr:\n{}",
            self.router.stderr_tail(20),
            self.kv_envoy.stderr_tail(10),
            self.noop_envoy.stderr_tail(10)
        )
    }
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
    let client = super::runner::client();
    let pid = |p: &mut super::deploy::ChildProc| p.pid().context("process is not running");
    let router_cpu = CpuSource::process(pid(fleet.router.process())?);
    let noop_cpu = CpuSource::own_thread(fleet.noop.tid);
    let envoy_cpu: BTreeMap<PathKind, CpuSource> = [
        (PathKind::EnvoyRoundRobin, pid(fleet.rr_envoy.process())?),
        (PathKind::EnvoyNoopExtProc, pid(fleet.noop_envoy.process())?),
        (PathKind::EnvoyKvRouter, pid(fleet.kv_envoy.process())?),
    ]
    .into_iter()
    .map(|(p, id)| (p, CpuSource::process(id)))
    .collect();
    let fleet = fleet;
    let hz = clock_ticks_per_s();
    let mut accs: BTreeMap<(usize, usize, PathKind), Acc> = BTreeMap::new();
    let (mut idle_ticks, mut idle_wall) = (0u64, Duration::ZERO);
    let mut cell_no = 0usize;
    for &size in &opts.sizes {
        let bodies = Arc::new(bodies(size));
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
                    let r0 = router_cpu.ticks()?;
                    let n0 = noop_cpu.ticks()?;
                    let e0 = envoy_cpu.get(&path).map(CpuSource::ticks).transpose()?;
                    let batch = drive(&client, &urls, &bodies, n, conc).await;
                    let dr = router_cpu.ticks()? - r0;
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
                    if path != PathKind::EnvoyKvRouter {
                        idle_ticks += dr;
                        idle_wall += batch.wall;
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
    let tick_ms = 1000.0 / hz as f64;
    let idle_ms_per_s = idle_ticks as f64 * tick_ms / idle_wall.as_secs_f64().max(1e-9);
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
                router_cpu_ms_per_request: (path == PathKind::EnvoyKvRouter)
                    .then(|| per_req(a.router_ticks)),
                router_cpu_net_ms_per_request: (path == PathKind::EnvoyKvRouter).then(|| {
                    (per_req(a.router_ticks)
                        - idle_ms_per_s * a.wall.as_secs_f64() / requests.max(1) as f64)
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
    Ok(OverheadReport {
        quick: opts.quick,
        envoy_version: envoy_version(&envoy),
        envoy,
        machine: machine_description(),
        pods: opts.pods,
        requests_per_cell: opts.requests,
        warmup_per_round: opts.warmup,
        rounds: opts.rounds.max(1),
        clock_ticks_per_s: hz,
        router_idle_cpu_ms_per_s: idle_ms_per_s,
        duration_s: started.elapsed().as_secs_f64(),
        cells,
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
             process (envoy-kv-router) or the no-op processor's thread (envoy-noop-ext-proc), \
             user + system from /proc in {:.0} ms ticks; kv-router's figure excludes its idle \
             background (health probes, metric scrapes: {:.3} ms/s, measured while other paths \
             ran; the JSON has the raw figure too). Envoy: {}, 2 worker threads each. Machine: {}. Took {:.0} s.\n",
            self.requests_per_cell,
            self.rounds,
            self.warmup_per_round,
            self.pods,
            1000.0 / self.clock_ticks_per_s as f64,
            self.router_idle_cpu_ms_per_s,
            self.envoy_version,
            self.machine,
            self.duration_s,
        ));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_are_utime_plus_stime() {
        let line = "4242 (kv (router) x) S 1 4242 4242 0 -1 4194560 2000 0 0 0 \
                    1234 56 0 0 20 0 9 0 100 1000000 500 18446744073709551615";
        assert_eq!(parse_stat_ticks(line).unwrap(), 1290);
        assert!(matches!(
            parse_stat_ticks("1 (x) S 1 2"),
            Err(CpuStatError::Malformed)
        ));
        assert!(parse_stat_ticks("no parenthesis").is_err());
    }

    #[test]
    fn own_process_stat_parses() {
        let me = CpuSource::process(std::process::id());
        let a = me.ticks().unwrap();
        let t = Instant::now();
        let mut x = 0u64;
        // Spins until a tick is charged: a loaded machine may give this thread little CPU.
        while me.ticks().unwrap() == a {
            x = x.wrapping_add(std::hint::black_box(1));
            assert!(t.elapsed() < Duration::from_secs(10), "no CPU tick in 10 s");
        }
        assert!(me.ticks().unwrap() > a, "{x}");
    }

    #[test]
    fn rounds_split_the_requests() {
        assert_eq!((0..3).map(|r| round_share(10, 3, r)).sum::<usize>(), 10);
        assert_eq!(round_share(10, 3, 0), 4);
        assert_eq!(round_share(10, 0, 0), 10);
    }

    #[test]
    fn counters_come_from_stats_text() {
        let stats =
            "http.llm.ext_proc.failure_mode_allowed: 3\nhttp.llm.ext_proc.streams_started: 9\n";
        assert_eq!(envoy_counter(stats, FAILED_OPEN_STAT), 3);
        assert_eq!(envoy_counter(stats, "missing"), 0);
    }

    #[test]
    fn bodies_have_exact_prompt_sizes_and_differ() {
        let b = bodies(1024);
        assert_eq!(b.len(), 16);
        let v: serde_json::Value = serde_json::from_slice(&b[0]).unwrap();
        assert_eq!(v["prompt"].as_str().unwrap().len(), 1024);
        assert_eq!(v["max_tokens"], 1);
        assert_ne!(b[0], b[1]);
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
            duration_s: 3.0,
            cells,
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
