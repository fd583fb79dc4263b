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
    workload::{MultiturnSpec, WorkloadKind},
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
