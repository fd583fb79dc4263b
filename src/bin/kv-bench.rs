//! kv-bench: compare kv-router with round robin on simulated vLLM pods, or load any endpoint.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use kv_router::bench::{
    self,
    deploy::Binaries,
    report::{self, JsonReport, Style},
    runner::{self, RunOptions, RunResult},
    trace::{self, Expansion, Trace},
    workload::{Arrivals, MultiturnSpec, SharedPrefixSpec, TraceSpec, WorkloadKind},
};

#[derive(Parser)]
#[command(name = "kv-bench", version, about = "Benchmarks for kv-router")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start simulated pods, Envoy (round robin) and kv-router (+ Envoy); run the workload through
    /// both and print a side-by-side table. Stops everything it started.
    Demo(DemoArgs),
    /// Run a workload against an existing OpenAI-compatible endpoint.
    Run(RunArgs),
    /// Virtual-time simulation of a fleet on a trace with the router's own scoring and index (no
    /// sockets): hit ratio vs oracles, modeled TTFT and load balance per strategy, capacity plan.
    Simulate(bench::simulate::SimulateArgs),
}

#[derive(Args, Clone)]
struct WorkloadArgs {
    /// Conversations.
    #[arg(long, default_value_t = 16)]
    sessions: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 8)]
    turns: usize,
    /// Seed of every generated text.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Shared system prompt size in bytes.
    #[arg(long, default_value_t = 6144)]
    system_bytes: usize,
    /// max_tokens per request.
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// Model name sent in requests.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Most sessions in flight (default: all).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Write summaries and every request record as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also print the table as markdown.
    #[arg(long)]
    markdown: bool,
}

impl WorkloadArgs {
    fn spec(&self) -> MultiturnSpec {
        MultiturnSpec {
            sessions: self.sessions,
            turns: self.turns,
            system_bytes: self.system_bytes,
            max_tokens: self.max_tokens,
            model: self.model.clone(),
            seed: self.seed,
            ..Default::default()
        }
    }
}

#[derive(Args)]
struct DemoArgs {
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    envoy: Option<PathBuf>,
    /// Simulated pods.
    #[arg(long, default_value_t = 4)]
    pods: usize,
    /// KV-cache blocks per simulated pod.
    #[arg(long, default_value_t = 4096)]
    gpu_blocks: usize,
    /// Extra vllm-sim argument (repeatable), e.g. --sim-arg=--ttft-base-ms=5.
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    sim_args: Vec<String>,
    #[command(flatten)]
    workload: WorkloadArgs,
}

#[derive(Args)]
struct RunArgs {
    /// Base URL of the endpoint, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    target: String,
    /// Workload.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Multiturn)]
    workload: WorkloadKind,
    /// Label of the run in the table.
    #[arg(long, default_value = "run")]
    label: String,
    /// Fleet size for the hotspot factor (default: pods seen in responses).
    #[arg(long)]
    pods: Option<usize>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    #[command(flatten)]
    args: WorkloadArgs,
    #[command(flatten)]
    shared_prefix: SharedPrefixArgs,
    #[command(flatten)]
    trace: TraceArgs,
    #[command(flatten)]
    arrivals: ArrivalArgs,
}

/// Shared-prefix workload parameters (workloads.md §3.1).
#[derive(Args, Clone)]
struct SharedPrefixArgs {
    /// Shared-prefix: groups (distinct system prompts).
    #[arg(long, default_value_t = 10)]
    groups: usize,
    /// Shared-prefix: prompts per group.
    #[arg(long, default_value_t = 10)]
    prompts_per_group: usize,
    /// Shared-prefix: system prompt tokens.
    #[arg(long, default_value_t = 100)]
    system_tokens: usize,
    /// Shared-prefix: question tokens.
    #[arg(long, default_value_t = 50)]
    question_tokens: usize,
    /// Shared-prefix: output tokens.
    #[arg(long, default_value_t = 50)]
    output_tokens: u32,
}

impl SharedPrefixArgs {
    fn spec(&self, w: &WorkloadArgs) -> SharedPrefixSpec {
        SharedPrefixSpec {
            groups: self.groups,
            prompts_per_group: self.prompts_per_group,
            system_tokens: self.system_tokens,
            question_tokens: self.question_tokens,
            output_tokens: self.output_tokens,
            model: w.model.clone(),
            seed: w.seed,
        }
    }
}

/// Trace replay parameters.
#[derive(Args, Clone)]
struct TraceArgs {
    /// Trace: `conversation`, `synthetic` or a JSONL path.
    #[arg(long, default_value = "conversation")]
    trace: String,
    /// Trace: replay only the first N requests.
    #[arg(long)]
    trace_requests: Option<usize>,
    /// Trace: arrival-time compression (open loop at trace times / this); 0 = closed loop.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Trace: output tokens = output_length x this.
    #[arg(long, default_value_t = 1.0)]
    output_scale: f64,
}

impl TraceArgs {
    fn spec(&self, w: &WorkloadArgs) -> Result<TraceSpec> {
        let trace = Trace::load(&trace::find_trace(&self.trace)?)?;
        let trace = match self.trace_requests {
            Some(n) => trace.head(n),
            None => trace,
        };
        Ok(TraceSpec {
            trace,
            expansion: Expansion::default(),
            output_scale: self.output_scale,
            arrivals: if self.speedup > 0.0 {
                Arrivals::Timed {
                    speedup: self.speedup,
                }
            } else {
                Arrivals::Closed {
                    concurrency: w.concurrency.unwrap_or(1),
                }
            },
            model: w.model.clone(),
        })
    }
}

/// Open-loop arrivals.
#[derive(Args, Clone)]
struct ArrivalArgs {
    /// Start sessions at Poisson times of this rate (per second) instead of all at once.
    #[arg(long)]
    poisson_rate: Option<f64>,
}

fn output(runs: &[RunResult], pods: Option<usize>, w: &WorkloadArgs) -> Result<()> {
    let summaries = bench::summarize(runs, pods);
    if let Some(r) = runs.first() {
        println!("workload: {} ({})", r.workload, r.description);
    }
    println!("{}", report::table(&summaries, Style::Plain));
    if w.markdown {
        println!("{}", report::table(&summaries, Style::Markdown));
    }
    if let Some(path) = &w.json {
        let doc = JsonReport {
            summaries: &summaries,
            runs,
        };
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("kv-bench: wrote {}", path.display());
    }
    Ok(())
}

async fn real_main(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Demo(a) => {
            let bins = Binaries::beside_current_exe()?;
            let opts = bench::DemoOptions {
                envoy: a.envoy.clone(),
                pods: a.pods,
                workload: a.workload.spec(),
                concurrency: a.workload.concurrency,
                gpu_blocks: a.gpu_blocks,
                sim_args: a.sim_args.clone(),
            };
            let runs = bench::demo(&bins, &opts).await?;
            output(&runs, Some(a.pods), &a.workload)
        }
        Cmd::Run(a) => {
            let workload = match a.workload {
                WorkloadKind::Multiturn => a.args.spec().build(),
                WorkloadKind::SharedPrefix => a.shared_prefix.spec(&a.args).build(),
                WorkloadKind::Trace => a.trace.spec(&a.args)?.build(),
            };
            let workload = match a.arrivals.poisson_rate {
                Some(rate) => workload.with_arrivals(Arrivals::Poisson { rate }, a.args.seed),
                None => workload,
            };
            let r = runner::run(
                workload,
                &RunOptions {
                    target: a.target.clone(),
                    concurrency: a.args.concurrency,
                    request_timeout: Duration::from_secs(a.timeout_s),
                    label: a.label.clone(),
                },
            )
            .await?;
            output(&[r], a.pods, &a.args)
        }
        // CPU-bound: off the async workers so the signal handlers stay responsive.
        Cmd::Simulate(a) => tokio::task::spawn_blocking(move || bench::simulate::cli(&a))
            .await
            .context("simulation thread")?,
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kv-bench: cannot install SIGTERM handler: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Dropping the work future on a signal drops every process handle, which kills the children.
    tokio::select! {
        r = real_main(cli) => match r {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kv-bench: error: {e:#}");
                ExitCode::FAILURE
            }
        },
        _ = tokio::signal::ctrl_c() => {
            eprintln!("kv-bench: interrupted; stopping everything it started");
            ExitCode::from(130)
        }
        _ = term.recv() => {
            eprintln!("kv-bench: terminated; stopping everything it started");
            ExitCode::from(143)
        }
    }
}
