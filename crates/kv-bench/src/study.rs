//! `kv-bench study`: llm-d's published benchmark shapes re-created on simulated pods behind real
//! Envoy, and what the picker itself costs on them.
//!
//! Three sections: shared-prefix (groups of prompts behind one long system prompt), long-input (a
//! ladder of input sizes at a fixed QPS) and short-requests (many short prompts at a high QPS).
//! Every shape runs once per picker on one fleet: the no-op ext_proc (round robin, the floor),
//! then kv-router in each mode asked for, each on freshly reset pod caches and its own processes
//! (the router stack `kv-bench compare` starts), Poisson arrivals at the shape's QPS. Per run:
//! TTFT, the router's own decision time (its `decision_duration_seconds` histogram), the time to
//! response headers over the no-op's (the picker's cost end to end: a streaming pod answers its
//! headers before any prefill, so placement does not enter it), the picker's CPU (average and
//! the busiest second) and peak RSS from `/proc`.

pub mod render;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::compare::stack::{histogram_quantile_linear, Stack};
use crate::compare::{envoy_options, CompareFleet, CompareOptions};
use crate::noop_extproc::NoopServer;
use crate::overhead::cpu::{clock_ticks_per_s, CpuSource};
use crate::report::percentile;
use crate::strategy::Strategy;
use kv_testkit::deploy::{self, Binaries, EnvoyProc};
use kv_testkit::runner::{self, RunOptions, RunResult};
use kv_testkit::workload::{Arrivals, SharedPrefixSpec};

/// The router's decision-time histogram.
const DECISION_HISTOGRAM: &str = "kv_router_decision_duration_seconds";

/// vllm-sim flags every study pod gets unless `--sim-arg` sets them: prefill fast enough that a
/// 1M-token prompt takes seconds, not minutes, and room for the longest prompts in the cache.
const SIM_DEFAULTS: [&str; 1] = ["--prefill-us-per-token=10"];

/// Prompts per group in the long-input section (each group shares 90 % of its input).
const LONG_GROUP: usize = 5;

/// `kv-bench study`'s flags.
#[derive(clap::Args, Debug, Clone)]
pub struct StudyArgs {
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// Sections to run, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "shared-prefix,long-input,short-requests"
    )]
    pub sections: Vec<Section>,
    /// kv-router modes, each run after the no-op picker on every shape.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "approximate,precise"
    )]
    pub modes: Vec<Mode>,
    /// Simulated pods.
    #[arg(long, default_value_t = 10)]
    pub pods: usize,
    /// KV blocks (16 tokens) per pod: 2M tokens, so a 1M-token prompt fits.
    #[arg(long, default_value_t = 131_072)]
    pub gpu_blocks: usize,
    /// Extra vllm-sim argument (repeatable); the study's default is --prefill-us-per-token=10.
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    pub sim_args: Vec<String>,
    /// Shared-prefix: groups (distinct system prompts).
    #[arg(long, default_value_t = 150)]
    pub sp_groups: usize,
    /// Shared-prefix: prompts per group.
    #[arg(long, default_value_t = 5)]
    pub sp_prompts_per_group: usize,
    /// Shared-prefix: system prompt, tokens (4 bytes of text each).
    #[arg(long, default_value_t = 9500)]
    pub sp_system_tokens: usize,
    /// Shared-prefix: each prompt's question, tokens.
    #[arg(long, default_value_t = 500)]
    pub sp_question_tokens: usize,
    /// Shared-prefix: tokens generated per request.
    #[arg(long, default_value_t = 1000)]
    pub sp_output_tokens: u32,
    /// Shared-prefix: requests per second.
    #[arg(long, default_value_t = 10.0)]
    pub sp_qps: f64,
    /// Long-input: the ladder of input sizes, tokens.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1000,10000,100000,1000000"
    )]
    pub long_sizes: Vec<usize>,
    /// Long-input: skip rungs above this many input tokens (a small machine's cap).
    #[arg(long)]
    pub long_max_tokens: Option<usize>,
    /// Long-input: requests per second, one value for every rung or one per rung.
    #[arg(long, value_delimiter = ',', default_value = "10")]
    pub long_qps: Vec<f64>,
    /// Long-input: requests per rung, in groups of five sharing 90 % of their input.
    #[arg(long, default_value_t = 50)]
    pub long_requests: usize,
    /// Long-input: tokens generated per request.
    #[arg(long, default_value_t = 100)]
    pub long_output_tokens: u32,
    /// Short-requests: requests per second (llm-d's 500; a 2-core machine cannot send that
    /// many: the report gives the rate reached).
    #[arg(long, default_value_t = 500.0)]
    pub short_qps: f64,
    /// Short-requests: requests.
    #[arg(long, default_value_t = 5000)]
    pub short_requests: usize,
    /// Short-requests: input tokens, every prompt unique.
    #[arg(long, default_value_t = 200)]
    pub short_input_tokens: usize,
    /// Short-requests: tokens generated per request.
    #[arg(long, default_value_t = 100)]
    pub short_output_tokens: u32,
    /// Model served by the pods and named in requests.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Seed of every prompt and arrival time.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_s: u64,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Print the tables as markdown with a heading (command, machine).
    #[arg(long)]
    pub markdown: bool,
}

/// A section of the study.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Section {
    /// Groups of prompts behind one long system prompt (inference-perf's shared_prefix).
    SharedPrefix,
    /// A ladder of input sizes at a fixed QPS.
    LongInput,
    /// Short unique prompts at a high QPS.
    ShortRequests,
}

/// A kv-router mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// The router's default: an index learned from its own decisions.
    Approximate,
    /// The index fed by the pods' KV events, prompts tokenized by the router.
    Precise,
}

/// Who picks the pod in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Picker {
    /// The no-op ext_proc (round robin, the body unread): Envoy's ext_proc floor.
    Noop,
    /// kv-router, approximate.
    Approximate,
    /// kv-router, precise.
    Precise,
}

impl Picker {
    /// The name in tables.
    pub fn label(self) -> &'static str {
        match self {
            Self::Noop => "no-op",
            Self::Approximate => "approximate",
            Self::Precise => "precise",
        }
    }

    fn strategy(self) -> Option<Strategy> {
        match self {
            Self::Noop => None,
            Self::Approximate => Some(Strategy::Weighted),
            Self::Precise => Some(Strategy::Precise),
        }
    }
}

impl From<Mode> for Picker {
    fn from(m: Mode) -> Self {
        match m {
            Mode::Approximate => Self::Approximate,
            Mode::Precise => Self::Precise,
        }
    }
}

/// One workload the study runs: a section, or one rung of the long-input ladder.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Its section.
    pub section: Section,
    /// Its name in tables (`long-input 100k`).
    pub label: String,
    /// Requests per second.
    pub qps: f64,
    /// The prompts.
    pub spec: SharedPrefixSpec,
}

impl Shape {
    /// Input tokens per request.
    pub fn input_tokens(&self) -> usize {
        self.spec.system_tokens + self.spec.question_tokens
    }
}

/// `1000` → `1k`, `1000000` → `1M`.
pub fn tokens_label(n: usize) -> String {
    match n {
        n if n >= 1_000_000 && n.is_multiple_of(1_000_000) => format!("{}M", n / 1_000_000),
        n if n >= 1000 && n.is_multiple_of(1000) => format!("{}k", n / 1000),
        n => n.to_string(),
    }
}

impl StudyArgs {
    /// The shapes in run order; a clear error for flags that make none or an empty one.
    pub fn shapes(&self) -> Result<Vec<Shape>> {
        let spec = |groups, per_group, system, question, output| SharedPrefixSpec {
            groups,
            prompts_per_group: per_group,
            system_tokens: system,
            question_tokens: question,
            output_tokens: output,
            model: self.model.clone(),
            seed: self.seed,
        };
        anyhow::ensure!(self.pods > 0, "--pods must be positive");
        let positive = |v: f64, flag: &str| {
            anyhow::ensure!(v.is_finite() && v > 0.0, "{flag} must be a positive rate");
            Ok(())
        };
        let mut shapes = Vec::new();
        for section in &self.sections {
            match section {
                Section::SharedPrefix => {
                    positive(self.sp_qps, "--sp-qps")?;
                    anyhow::ensure!(
                        self.sp_groups * self.sp_prompts_per_group > 0,
                        "--sp-groups and --sp-prompts-per-group must be positive"
                    );
                    shapes.push(Shape {
                        section: *section,
                        label: "shared-prefix".into(),
                        qps: self.sp_qps,
                        spec: spec(
                            self.sp_groups,
                            self.sp_prompts_per_group,
                            self.sp_system_tokens,
                            self.sp_question_tokens,
                            self.sp_output_tokens,
                        ),
                    });
                }
                Section::LongInput => {
                    let sizes: Vec<usize> = self
                        .long_sizes
                        .iter()
                        .copied()
                        .filter(|&s| self.long_max_tokens.is_none_or(|m| s <= m))
                        .collect();
                    anyhow::ensure!(
                        !sizes.is_empty() && sizes.iter().all(|&s| s >= 10),
                        "--long-sizes (under --long-max-tokens) must leave sizes of at least 10 tokens"
                    );
                    anyhow::ensure!(
                        self.long_qps.len() == 1 || self.long_qps.len() == self.long_sizes.len(),
                        "--long-qps takes one rate or one per --long-sizes entry"
                    );
                    for (i, &size) in self.long_sizes.iter().enumerate() {
                        if !sizes.contains(&size) {
                            continue;
                        }
                        let qps = self.long_qps[i.min(self.long_qps.len() - 1)];
                        positive(qps, "--long-qps")?;
                        let shared = size * 9 / 10;
                        shapes.push(Shape {
                            section: *section,
                            label: format!("long-input {}", tokens_label(size)),
                            qps,
                            spec: spec(
                                (self.long_requests / LONG_GROUP).max(1),
                                LONG_GROUP.min(self.long_requests.max(1)),
                                shared,
                                size - shared,
                                self.long_output_tokens,
                            ),
                        });
                    }
                }
                Section::ShortRequests => {
                    positive(self.short_qps, "--short-qps")?;
                    anyhow::ensure!(
                        self.short_requests > 0 && self.short_input_tokens > 0,
                        "--short-requests and --short-input-tokens must be positive"
                    );
                    shapes.push(Shape {
                        section: *section,
                        label: "short-requests".into(),
                        qps: self.short_qps,
                        spec: spec(
                            self.short_requests,
                            1,
                            0,
                            self.short_input_tokens,
                            self.short_output_tokens,
                        ),
                    });
                }
            }
        }
        anyhow::ensure!(!shapes.is_empty(), "--sections names no section");
        Ok(shapes)
    }

    /// The pickers of every shape: the no-op first, then the modes.
    pub fn pickers(&self) -> Vec<Picker> {
        let mut out = vec![Picker::Noop];
        for m in &self.modes {
            if !out.contains(&(*m).into()) {
                out.push((*m).into());
            }
        }
        out
    }

    /// vllm-sim flags of every pod: `--sim-arg`s, then the study's defaults they do not set.
    pub fn pod_args(&self) -> Vec<String> {
        let mut args = self.sim_args.clone();
        for d in SIM_DEFAULTS {
            let flag = d.split('=').next().unwrap_or(d);
            if !args.iter().any(|a| a.split('=').next() == Some(flag)) {
                args.push(d.to_string());
            }
        }
        args
    }
}

/// One (shape, picker) run.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The section.
    pub section: Section,
    /// The shape's name.
    pub shape: String,
    /// Input tokens per request.
    pub input_tokens: usize,
    /// Output tokens per request.
    pub output_tokens: u32,
    /// Requests per second asked for.
    pub qps: f64,
    /// Who picked.
    pub picker: Picker,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// The first failure, for diagnosis.
    pub first_error: Option<String>,
    /// Requests per second actually sent (first to last send).
    pub sent_qps: f64,
    /// Wall time of the run, seconds.
    pub duration_s: f64,
    /// TTFT percentiles, ms.
    pub ttft_p50_ms: f64,
    /// 90th percentile, ms.
    pub ttft_p90_ms: f64,
    /// 99th percentile, ms.
    pub ttft_p99_ms: f64,
    /// Time to response headers, median, ms.
    pub headers_p50_ms: f64,
    /// 95th percentile, ms.
    pub headers_p95_ms: f64,
    /// The router's decision time (its histogram, interpolated inside the bucket), median, ms.
    pub decision_p50_ms: Option<f64>,
    /// 95th percentile, ms.
    pub decision_p95_ms: Option<f64>,
    /// Time to headers minus the no-op's on the same shape, median, ms.
    pub added_p50_ms: Option<f64>,
    /// 95th percentile, ms.
    pub added_p95_ms: Option<f64>,
    /// The picker's CPU over the run, cores (CPU seconds / wall seconds).
    pub cpu_avg_cores: f64,
    /// Its busiest second, cores.
    pub cpu_peak_cores: f64,
    /// The router's RSS before the run, MiB (kv-router only: the no-op lives in kv-bench).
    pub rss_start_mib: Option<f64>,
    /// The router's peak RSS (VmHWM) over its life, which is this run, MiB.
    pub peak_rss_mib: Option<f64>,
}

/// The whole study (`--json`).
#[derive(Debug, Clone, Serialize)]
pub struct StudyReport {
    /// CPU model, cores, memory.
    pub machine: String,
    /// Simulated pods.
    pub pods: usize,
    /// KV blocks per pod.
    pub gpu_blocks: usize,
    /// vllm-sim flags of every pod.
    pub sim_args: Vec<String>,
    /// Wall time of the study, seconds.
    pub duration_s: f64,
    /// Every run, shape by shape, the no-op first.
    pub rows: Vec<Row>,
    /// The goals checked on the rows.
    pub goals: Vec<render::GoalCheck>,
}

/// A running picker: the no-op processor or a kv-router stack, each behind its own Envoy.
enum Running {
    Noop {
        server: NoopServer,
        envoy: EnvoyProc,
    },
    Router(Stack),
}

impl Running {
    fn url(&self) -> String {
        match self {
            Self::Noop { envoy, .. } => envoy.url(),
            Self::Router(s) => s.envoy_url(),
        }
    }
}

/// CPU seconds of a process or of the no-op's thread.
#[derive(Clone)]
enum CpuOf {
    Process(u32),
    Thread(CpuSource),
}

impl CpuOf {
    fn seconds(&self) -> Option<f64> {
        match self {
            Self::Process(pid) => deploy::cpu_seconds(*pid),
            Self::Thread(src) => src
                .ticks()
                .ok()
                .map(|t| t as f64 / clock_ticks_per_s() as f64),
        }
    }
}

/// Samples `cpu` every second until `stop`: (seconds since start, CPU seconds).
fn sample_cpu(cpu: CpuOf, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Vec<(f64, f64)>> {
    tokio::spawn(async move {
        let start = Instant::now();
        let mut out = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            if let Some(s) = cpu.seconds() {
                out.push((start.elapsed().as_secs_f64(), s));
            }
            if stop.load(Ordering::Relaxed) {
                return out;
            }
        }
    })
}

/// The busiest interval between consecutive samples, cores (None with fewer than two samples).
pub fn peak_cores(samples: &[(f64, f64)]) -> Option<f64> {
    samples
        .windows(2)
        .filter(|w| w[1].0 > w[0].0)
        .map(|w| (w[1].1 - w[0].1) / (w[1].0 - w[0].0))
        .reduce(f64::max)
}

/// Runs every shape with every picker on one fleet.
pub async fn run(bins: &Binaries, a: &StudyArgs) -> Result<StudyReport> {
    let started = Instant::now();
    let shapes = a.shapes()?;
    let copts = CompareOptions::fleet(
        a.envoy.clone(),
        a.pods,
        a.gpu_blocks,
        a.pod_args(),
        a.model.clone(),
    );
    let fleet = CompareFleet::start(bins, &copts).await?;
    let base = fleet.base_config()?;
    let mut rows = Vec::new();
    for shape in &shapes {
        let first = rows.len();
        for picker in a.pickers() {
            let row = run_one(bins, &fleet, &base, a, shape, picker)
                .await
                .with_context(|| format!("{} with {}", shape.label, picker.label()))?;
            eprintln!(
                "kv-bench study: {} / {}: {} requests ({} errors) at {:.1} QPS sent, TTFT p50 {:.1} ms, \
                 decision p95 {}, CPU {:.2} cores avg / {:.2} peak",
                shape.label,
                picker.label(),
                row.requests,
                row.errors,
                row.sent_qps,
                row.ttft_p50_ms,
                row.decision_p95_ms
                    .map_or("–".into(), |v| format!("{v:.3} ms")),
                row.cpu_avg_cores,
                row.cpu_peak_cores
            );
            rows.push(row);
        }
        fill_added(&mut rows[first..]);
    }
    Ok(StudyReport {
        machine: crate::results::machine(),
        pods: a.pods,
        gpu_blocks: a.gpu_blocks,
        sim_args: a.pod_args(),
        duration_s: started.elapsed().as_secs_f64(),
        goals: render::check(&rows),
        rows,
    })
}

/// Each router row's time to headers over the no-op row of the same shape.
pub fn fill_added(rows: &mut [Row]) {
    let Some((p50, p95)) = rows
        .iter()
        .find(|r| r.picker == Picker::Noop)
        .map(|r| (r.headers_p50_ms, r.headers_p95_ms))
    else {
        return;
    };
    for r in rows.iter_mut().filter(|r| r.picker != Picker::Noop) {
        r.added_p50_ms = Some(r.headers_p50_ms - p50);
        r.added_p95_ms = Some(r.headers_p95_ms - p95);
    }
}

async fn run_one(
    bins: &Binaries,
    fleet: &CompareFleet,
    base: &kv_router::config::Config,
    a: &StudyArgs,
    shape: &Shape,
    picker: Picker,
) -> Result<Row> {
    let addrs = fleet.addrs();
    deploy::reset_caches(&addrs)
        .await
        .context("resetting pod caches")?;
    // The picker and its Envoy live for this run only: its peak RSS is this run's.
    let mut running = match picker.strategy() {
        None => {
            let server = NoopServer::start(&addrs, base.fallbacks)?;
            let envoy = EnvoyProc::spawn_with(
                &fleet.envoy_bin,
                &deploy::envoy_template("override-host-buffered.yaml")?,
                Some(server.addr),
                &addrs,
                &envoy_options(),
            )
            .await
            .context("starting the no-op picker's Envoy")?;
            Running::Noop { server, envoy }
        }
        Some(s) => Running::Router(
            Stack::start(bins, fleet, s.router_config(base, &a.model), 1, None).await?,
        ),
    };
    let (cpu, pid) = match &mut running {
        Running::Noop { server, .. } => (CpuOf::Thread(CpuSource::own_thread(server.tid)), None),
        Running::Router(s) => {
            let pid = *s
                .router_pids()
                .first()
                .context("the router is not running")?;
            (CpuOf::Process(pid), Some(pid))
        }
    };
    let rss_mib = |pid: Option<u32>| -> Result<Option<(f64, f64)>> {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        pid.map(|p| crate::hostile::rss(p).map(|(rss, hwm)| (mib(rss), mib(hwm))))
            .transpose()
    };
    let rss_start = rss_mib(pid)?.map(|(rss, _)| rss);
    let workload = shape
        .spec
        .build()
        .with_arrivals(Arrivals::Poisson { rate: shape.qps }, a.seed);
    let stop = Arc::new(AtomicBool::new(false));
    let cpu0 = cpu.seconds().context("reading the picker's CPU time")?;
    let sampler = sample_cpu(cpu.clone(), stop.clone());
    let mut run = runner::run(
        workload,
        &RunOptions {
            target: running.url(),
            concurrency: None,
            request_timeout: Duration::from_secs(a.timeout_s),
            label: format!("{} {}", shape.label, picker.label()),
            progress: false,
        },
    )
    .await?;
    let cpu1 = cpu.seconds().context("reading the picker's CPU time")?;
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.await.context("CPU sampler")?;
    run.sent = Vec::new();
    let (decision_p50_ms, decision_p95_ms) = match &running {
        Running::Router(s) => {
            let text = s.first_metrics().await?;
            let q = |q| histogram_quantile_linear(&text, DECISION_HISTOGRAM, q).map(|v| v * 1e3);
            (q(0.5), q(0.95))
        }
        Running::Noop { .. } => (None, None),
    };
    let peak_rss = rss_mib(pid)?.map(|(_, hwm)| hwm);
    drop(running);
    let avg = (cpu1 - cpu0) / run.duration_s.max(1e-9);
    Ok(row(
        shape,
        picker,
        &run,
        avg,
        peak_cores(&samples).unwrap_or(avg),
    )
    .with_router(decision_p50_ms, decision_p95_ms, rss_start, peak_rss))
}

/// The client-side figures of `run`.
fn row(shape: &Shape, picker: Picker, run: &RunResult, avg: f64, peak: f64) -> Row {
    let ok: Vec<_> = run.records.iter().filter(|r| r.error.is_none()).collect();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let mut headers: Vec<f64> = ok.iter().filter_map(|r| r.headers_ms).collect();
    let sends = run.records.iter().map(|r| r.start_ms);
    let span_ms = sends.clone().fold(f64::MIN, f64::max) - sends.fold(f64::MAX, f64::min);
    let n = run.records.len();
    Row {
        section: shape.section,
        shape: shape.label.clone(),
        input_tokens: shape.input_tokens(),
        output_tokens: shape.spec.output_tokens,
        qps: shape.qps,
        picker,
        requests: n,
        errors: n - ok.len(),
        first_error: run.records.iter().find_map(|r| r.error.clone()),
        sent_qps: match n {
            0 | 1 => f64::NAN,
            _ => (n - 1) as f64 / (span_ms / 1e3).max(1e-9),
        },
        duration_s: run.duration_s,
        ttft_p50_ms: percentile(&mut ttft, 50.0),
        ttft_p90_ms: percentile(&mut ttft, 90.0),
        ttft_p99_ms: percentile(&mut ttft, 99.0),
        headers_p50_ms: percentile(&mut headers, 50.0),
        headers_p95_ms: percentile(&mut headers, 95.0),
        decision_p50_ms: None,
        decision_p95_ms: None,
        added_p50_ms: None,
        added_p95_ms: None,
        cpu_avg_cores: avg,
        cpu_peak_cores: peak.max(avg),
        rss_start_mib: None,
        peak_rss_mib: None,
    }
}

impl Row {
    fn with_router(
        mut self,
        p50: Option<f64>,
        p95: Option<f64>,
        rss_start: Option<f64>,
        peak_rss: Option<f64>,
    ) -> Self {
        self.decision_p50_ms = p50;
        self.decision_p95_ms = p95;
        self.rss_start_mib = rss_start;
        self.peak_rss_mib = peak_rss;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: StudyArgs,
    }

    fn args(extra: &[&str]) -> StudyArgs {
        Cli::try_parse_from(std::iter::once("study").chain(extra.iter().copied()))
            .unwrap()
            .a
    }

    #[test]
    fn defaults_are_llm_d_shapes() {
        let a = args(&[]);
        let shapes = a.shapes().unwrap();
        let labels: Vec<&str> = shapes.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "shared-prefix",
                "long-input 1k",
                "long-input 10k",
                "long-input 100k",
                "long-input 1M",
                "short-requests"
            ]
        );
        let sp = &shapes[0].spec;
        assert_eq!(
            (sp.groups, sp.prompts_per_group, sp.system_tokens),
            (150, 5, 9500)
        );
        assert_eq!((sp.question_tokens, sp.output_tokens), (500, 1000));
        assert_eq!(shapes[4].input_tokens(), 1_000_000);
        assert_eq!(shapes[4].spec.groups * shapes[4].spec.prompts_per_group, 50);
        assert_eq!((shapes[5].qps, shapes[5].input_tokens()), (500.0, 200));
        assert_eq!(
            a.pickers(),
            [Picker::Noop, Picker::Approximate, Picker::Precise]
        );
        assert_eq!(a.pod_args(), ["--prefill-us-per-token=10"]);
    }

    #[test]
    fn caps_and_per_rung_rates_apply() {
        let a = args(&[
            "--sections",
            "long-input",
            "--long-max-tokens",
            "100000",
            "--long-qps",
            "10,10,5,1",
            "--modes",
            "precise",
            "--sim-arg=--prefill-us-per-token=1",
        ]);
        let shapes = a.shapes().unwrap();
        let got: Vec<(usize, f64)> = shapes.iter().map(|s| (s.input_tokens(), s.qps)).collect();
        assert_eq!(got, [(1000, 10.0), (10_000, 10.0), (100_000, 5.0)]);
        assert_eq!(a.pickers(), [Picker::Noop, Picker::Precise]);
        assert_eq!(a.pod_args(), ["--prefill-us-per-token=1"]);
    }

    #[test]
    fn bad_flags_are_refused_with_reasons() {
        let err = |extra: &[&str]| format!("{:#}", args(extra).shapes().unwrap_err());
        assert!(err(&["--sp-qps", "0"]).contains("--sp-qps"));
        assert!(err(&["--long-max-tokens", "5"]).contains("--long-sizes"));
        assert!(err(&["--long-qps", "1,2"]).contains("--long-qps"));
        assert!(err(&["--pods", "0"]).contains("--pods"));
    }

    #[test]
    fn peaks_and_labels() {
        assert_eq!(
            peak_cores(&[(0.0, 1.0), (1.0, 1.5), (2.0, 2.75)]),
            Some(1.25)
        );
        assert_eq!(peak_cores(&[(0.0, 1.0)]), None);
        assert_eq!(tokens_label(1_000_000), "1M");
        assert_eq!(tokens_label(10_000), "10k");
        assert_eq!(tokens_label(1500), "1500");
    }
}
