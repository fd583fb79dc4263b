//! kv-bench: compare kv-router with round robin on simulated vLLM pods, or load any endpoint.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

#[path = "../../bench/mod.rs"]
mod bench;

mod sim;

use bench::{
    compare::{self, CompareOptions},
    deploy::Binaries,
    overhead,
    report::{self, JsonReport, Style, Summary},
    results,
    runner::{self, RunOptions, RunResult},
    strategy::Strategy,
    trace::{self, Expansion, Trace},
    workload::{Arrivals, MultiturnSpec, SharedPrefixSpec, TraceSpec, Workload, WorkloadKind},
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
    /// Start a fleet of simulated pods and run the same workload once per routing strategy
    /// (Envoy round robin, kv-router random / least-loaded / prefix-only / weighted / precise);
    /// report hit ratio against the oracles, TTFT, load balance.
    Compare(CompareArgs),
    /// Run every benchmark of `make bench` and write results.md, results.json and images/.
    Report(ReportArgs),
    /// Added latency through real Envoy: direct, round robin, no-op ext_proc, kv-router.
    Overhead(OverheadArgs),
    /// Virtual-time simulation of a fleet on a trace with the router's own scoring and index (no
    /// sockets): hit ratio vs oracles, modeled TTFT and load balance per strategy, capacity plan.
    Simulate(bench::simulate::SimulateArgs),
}

#[derive(Args)]
struct CompareArgs {
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    envoy: Option<PathBuf>,
    /// Simulated pods [default: 8]. With --endpoint: the size of the fleet behind them
    /// (default: the --reset-pod count, else the pods seen in responses).
    #[arg(long)]
    pods: Option<usize>,
    /// KV-cache blocks (16 tokens) per simulated pod [default: 4096]. With --endpoint: per pod
    /// of that fleet (default: read from the --reset-pod pods' /metrics, else unknown and no
    /// oracle is computed).
    #[arg(long)]
    gpu_blocks: Option<usize>,
    /// Extra vllm-sim argument (repeatable), e.g. --sim-arg=--prefill-us-per-token=20.
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    sim_args: Vec<String>,
    /// Strategies to run, comma-separated, in order.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Strategy::ALL)]
    strategies: Vec<Strategy>,
    /// Workload.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Multiturn)]
    workload: WorkloadKind,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    /// Write the three SVG charts into this directory.
    #[arg(long)]
    charts: Option<PathBuf>,
    /// Compare existing deployments instead of starting a fleet: LABEL=URL (repeatable).
    #[arg(long = "endpoint", value_parser = parse_endpoint)]
    endpoints: Vec<(String, String)>,
    /// With --endpoint: pod address (ip:port) whose prefix cache is reset between runs (repeatable).
    #[arg(long = "reset-pod")]
    reset_pods: Vec<std::net::SocketAddr>,
    #[command(flatten)]
    args: WorkloadArgs,
    #[command(flatten)]
    shared_prefix: SharedPrefixArgs,
    #[command(flatten)]
    trace: TraceArgs,
    #[command(flatten)]
    arrivals: ArrivalArgs,
}

#[derive(Args)]
struct ReportArgs {
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    envoy: Option<PathBuf>,
    /// Directory receiving results.md, results.json and images/.
    #[arg(long, default_value = "docs")]
    out: PathBuf,
    /// Small fleets and workloads (a minute or two): checks the pipeline, not the numbers.
    #[arg(long)]
    quick: bool,
}

#[derive(Args)]
struct OverheadArgs {
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    envoy: Option<PathBuf>,
    /// Measured requests per cell (default: 1000, or 40 with --quick).
    #[arg(long)]
    requests: Option<usize>,
    /// A few requests per cell (CI: checks the report, not speed).
    #[arg(long)]
    quick: bool,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Print the table as markdown with a heading (command, machine).
    #[arg(long)]
    markdown: bool,
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
    /// Trace: replay only N requests (after --trace-skip).
    #[arg(long)]
    trace_requests: Option<usize>,
    /// Trace: skip this many requests first (timestamps re-based to the first replayed).
    #[arg(long, default_value_t = 0)]
    trace_skip: usize,
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
        let trace = trace.window(self.trace_skip, self.trace_requests.unwrap_or(usize::MAX));
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

fn parse_endpoint(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((l, u)) if !l.is_empty() && u.starts_with("http") => Ok((l.into(), u.into())),
        _ => Err(format!("expected LABEL=http://host:port, got {s:?}")),
    }
}

/// Rebuilds a workload's sessions for each run.
type WorkloadFactory = Box<dyn Fn() -> Workload>;

/// Builds the chosen workload; trace files are read once, the closure rebuilds the sessions.
fn workload_factory(
    kind: WorkloadKind,
    args: &WorkloadArgs,
    shared_prefix: &SharedPrefixArgs,
    trace: &TraceArgs,
    arrivals: &ArrivalArgs,
) -> Result<(WorkloadFactory, Option<usize>)> {
    let seed = args.seed;
    let poisson = arrivals.poisson_rate;
    let with_arrivals = move |w: Workload| match poisson {
        Some(rate) => w.with_arrivals(Arrivals::Poisson { rate }, seed),
        None => w,
    };
    // Open-loop arrivals need every session ready; closed loop caps sessions in flight.
    let open = poisson.is_some();
    Ok(match kind {
        WorkloadKind::Multiturn => {
            let spec = args.spec();
            (
                Box::new(move || with_arrivals(spec.build())),
                if open { None } else { args.concurrency },
            )
        }
        WorkloadKind::SharedPrefix => {
            let spec = shared_prefix.spec(args);
            (
                Box::new(move || with_arrivals(spec.build())),
                if open { None } else { args.concurrency },
            )
        }
        WorkloadKind::Trace => {
            let spec = trace.spec(args)?;
            let cap = spec.arrivals.concurrency();
            (Box::new(move || spec.build()), cap)
        }
    })
}

fn output(runs: &[RunResult], summaries: Vec<Summary>, w: &WorkloadArgs) -> Result<()> {
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
            let opts = CompareOptions {
                envoy: a.envoy.clone(),
                pods: a.pods,
                gpu_blocks: a.gpu_blocks,
                sim_args: a.sim_args.clone(),
                strategies: vec![Strategy::RoundRobin, Strategy::Weighted],
                request_timeout: Duration::from_secs(60),
                model: a.workload.model.clone(),
                progress: true,
            };
            let spec = a.workload.spec();
            let cmp =
                compare::compare(&bins, &opts, || spec.build(), a.workload.concurrency).await?;
            let summaries = cmp.summaries();
            let runs: Vec<RunResult> = cmp.runs.into_iter().filter_map(|r| r.run).collect();
            output(&runs, summaries, &a.workload)
        }
        Cmd::Run(a) => {
            let (workload, concurrency) =
                workload_factory(a.workload, &a.args, &a.shared_prefix, &a.trace, &a.arrivals)?;
            let r = runner::run(
                workload(),
                &RunOptions {
                    target: a.target.clone(),
                    concurrency,
                    request_timeout: Duration::from_secs(a.timeout_s),
                    label: a.label.clone(),
                    progress: true,
                },
            )
            .await?;
            let summaries = bench::summarize(std::slice::from_ref(&r), a.pods);
            output(&[r], summaries, &a.args)
        }
        Cmd::Compare(a) => {
            let command = std::env::args().collect::<Vec<_>>().join(" ");
            let section = compare_section(&a, "Comparison", "compare", &command).await?;
            println!("{}", section.body);
            if let Some(dir) = &a.charts {
                std::fs::create_dir_all(dir)?;
                for c in &section.charts {
                    std::fs::write(dir.join(&c.file), &c.svg)?;
                }
                eprintln!("kv-bench: charts in {}", dir.display());
            }
            if let Some(path) = &a.args.json {
                std::fs::write(path, serde_json::to_vec_pretty(&section.json)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            Ok(())
        }
        Cmd::Report(a) => report_all(&a).await,
        Cmd::Overhead(a) => {
            let r = overhead_report(&a).await?;
            if a.markdown {
                let cmd: Vec<String> = std::env::args().skip(1).collect();
                println!("### `kv-bench {}` ({})\n", cmd.join(" "), r.machine);
            }
            println!("{}", r.markdown());
            if let Some(path) = &a.json {
                std::fs::write(path, serde_json::to_vec_pretty(&r)?)
                    .with_context(|| format!("writing {}", path.display()))?;
                eprintln!("kv-bench: wrote {}", path.display());
            }
            Ok(())
        }
        // CPU-bound: off the async workers so the signal handlers stay responsive.
        Cmd::Simulate(a) => tokio::task::spawn_blocking(move || bench::simulate::cli(&a))
            .await
            .context("simulation thread")?,
    }
}

async fn overhead_report(a: &OverheadArgs) -> Result<overhead::OverheadReport> {
    let mut opts = if a.quick {
        overhead::OverheadOptions::quick()
    } else {
        overhead::OverheadOptions::full()
    };
    opts.requests = a.requests.unwrap_or(opts.requests);
    let bins = Binaries::beside_current_exe()?;
    overhead::run(&bins, a.envoy.as_deref(), &opts).await
}

async fn compare_section(
    a: &CompareArgs,
    title: &str,
    slug: &str,
    command: &str,
) -> Result<results::Section> {
    let started = std::time::Instant::now();
    let bins = Binaries::beside_current_exe()?;
    let (workload, concurrency) =
        workload_factory(a.workload, &a.args, &a.shared_prefix, &a.trace, &a.arrivals)?;
    let opts = CompareOptions {
        envoy: a.envoy.clone(),
        pods: a.pods.unwrap_or(8),
        gpu_blocks: a.gpu_blocks.unwrap_or(4096),
        sim_args: a.sim_args.clone(),
        strategies: a.strategies.clone(),
        request_timeout: Duration::from_secs(a.timeout_s),
        model: a.args.model.clone(),
        progress: true,
    };
    let cmp = if a.endpoints.is_empty() {
        compare::compare(&bins, &opts, workload, concurrency).await?
    } else {
        compare::compare_endpoints(
            &a.endpoints,
            &a.reset_pods,
            compare::FleetHint {
                pods: a.pods,
                gpu_blocks: a.gpu_blocks,
            },
            opts.request_timeout,
            workload,
            concurrency,
        )
        .await?
    };
    results::comparison_section(title, slug, command, &cmp, started.elapsed().as_secs_f64())
}

/// One benchmark of the report: heading, chart file prefix, the command (without `kv-bench`).
struct Planned {
    title: &'static str,
    slug: &'static str,
    args: String,
}

/// Sim timings of the trace replays: 5x faster prefill and decode than vllm-sim's defaults, to
/// match the trace's arrival rate compressed by `--speedup` (a fleet of faster GPUs).
const TRACE_SIM: &str = "--sim-arg=--prefill-us-per-token=20 --sim-arg=--decode-ms-per-token=2";

fn plan(quick: bool) -> Vec<Planned> {
    let p = |title, slug, args: String| Planned { title, slug, args };
    if quick {
        // Two pods, instant sims, a handful of requests: the pipeline end to end in about a minute.
        let fast = "--pods 2 --gpu-blocks 512 --sim-arg=--prefill-us-per-token=1 \
                    --sim-arg=--decode-ms-per-token=0 --sim-arg=--ttft-base-ms=1";
        return vec![
            p("Mooncake conversation trace", "trace-conversation",
              format!("compare --workload trace --trace conversation --trace-requests 12 --speedup 0 --concurrency 4 --output-scale 0.02 {fast}")),
            p("Multi-turn chat", "multiturn",
              format!("compare --workload multiturn --sessions 3 --turns 2 --max-tokens 8 {fast}")),
            p("Shared prefix", "shared-prefix",
              format!("compare --workload shared-prefix --groups 2 --prompts-per-group 3 --poisson-rate 50 {fast}")),
            p("Router overhead", "overhead", "overhead --quick".into()),
            p("Fleet simulation", "simulate", "simulate --trace conversation --pods 8 --quick".into()),
        ];
    }
    vec![
        p("Mooncake conversation trace", "trace-conversation",
          format!("compare --workload trace --trace conversation --trace-requests 600 --speedup 8 --output-scale 0.25 --pods 8 --gpu-blocks 32768 {TRACE_SIM}")),
        p("Mooncake synthetic trace", "trace-synthetic",
          format!("compare --workload trace --trace synthetic --trace-skip 2000 --trace-requests 600 --speedup 6 --output-scale 0.25 --pods 8 --gpu-blocks 32768 {TRACE_SIM}")),
        p("Multi-turn chat", "multiturn",
          "compare --workload multiturn --sessions 32 --turns 6 --pods 8 --gpu-blocks 4096".into()),
        p("Shared prefix", "shared-prefix",
          "compare --workload shared-prefix --groups 40 --prompts-per-group 5 --system-tokens 6000 --question-tokens 1200 --output-tokens 100 --poisson-rate 8 --pods 8 --gpu-blocks 5120".into()),
        p("Router overhead", "overhead", "overhead".into()),
        p("Fleet simulation, 64 pods", "simulate",
          "simulate --trace conversation --pods 64 --gpu-blocks 31250".into()),
    ]
}

async fn report_all(a: &ReportArgs) -> Result<()> {
    let machine = results::machine();
    let mut sections = Vec::new();
    for item in plan(a.quick) {
        let command = format!(
            "kv-bench {}",
            item.args.split_whitespace().collect::<Vec<_>>().join(" ")
        );
        let mut argv: Vec<String> = command.split_whitespace().map(str::to_string).collect();
        // The simulation starts no process, so it takes no --envoy.
        if let (Some(e), false) = (&a.envoy, item.args.starts_with("simulate")) {
            argv.extend(["--envoy".to_string(), e.display().to_string()]);
        }
        eprintln!("kv-bench report: {}", item.title);
        let cli = Cli::try_parse_from(&argv)
            .with_context(|| format!("planned command does not parse: {command}"))?;
        let started = std::time::Instant::now();
        let section = match cli.cmd {
            Cmd::Compare(c) => compare_section(&c, item.title, item.slug, &command).await?,
            Cmd::Simulate(a) => {
                let opts = a.options();
                let r = tokio::task::spawn_blocking(move || bench::simulate::run(&opts))
                    .await
                    .context("simulation thread")??;
                results::simulate_section(
                    item.title,
                    item.slug,
                    &command,
                    &r,
                    started.elapsed().as_secs_f64(),
                )?
            }
            Cmd::Overhead(o) => {
                let r = overhead_report(&o).await?;
                results::Section {
                    title: item.title.into(),
                    command: command.clone(),
                    body: r.markdown(),
                    charts: Vec::new(),
                    json: serde_json::to_value(&r)?,
                    seconds: started.elapsed().as_secs_f64(),
                }
            }
            _ => anyhow::bail!("the report cannot run {command}"),
        };
        sections.push(section);
    }
    let intro = if a.quick {
        "Quick variant (`kv-bench report --quick`): tiny fleets and workloads that check the \
         pipeline; the numbers mean nothing."
    } else {
        "Generated by `make bench` (`kv-bench report --out docs`) from scratch; every table is \
         headed by the command that reproduces it alone. Simulated pods (`vllm-sim`) behind real \
         Envoy 1.40 on 127.0.0.1; medians and ratios are from one run on a noisy 2-core machine. \
         Hit ratio = cached / prompt tokens as the pods report them; the oracles are computed \
         from the same request sequence (`src/bench/oracle.rs`). Micro-benchmarks (index, \
         tokenization): [microbench.md](microbench.md)."
    };
    let md = results::render("kv-router benchmark results", intro, &machine, &sections);
    results::write(&a.out, &md, &sections)?;
    results::check(&a.out, sections.len())?;
    eprintln!(
        "kv-bench report: wrote {} ({} sections)",
        a.out.join("results.md").display(),
        sections.len()
    );
    Ok(())
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
