//! kv-bench's command line: every subcommand's flags, and the options and workloads they
//! describe.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

use crate::simulate::{
    CapacityOptions, Divergence, SimulateOptions, BLOCK_TOKENS, DEFAULT_TTFT_TARGET_MS,
};
use crate::strategy::Strategy;
use kv_testkit::trace::{self, Expansion, Trace};
use kv_testkit::workload::{
    Arrivals, ForkSpec, MultiturnSpec, SharedPrefixSpec, TraceSpec, Workload, WorkloadKind,
};
use vllm_sim::engine::EngineConfig;

#[derive(Parser)]
#[command(name = "kv-bench", version, about = "Benchmarks for kv-router")]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Start simulated pods, Envoy (round robin) and kv-router (+ Envoy); run the workload through
    /// both and print a side-by-side table. Stops everything it started.
    Demo(DemoArgs),
    /// Run a workload against an existing OpenAI-compatible endpoint.
    Run(RunArgs),
    /// Start a fleet of simulated pods and run the same workload once per routing strategy
    /// (Envoy round robin, kv-router random / least-loaded / prefix-only / weighted / precise,
    /// redis: two replicas sharing a Redis index); report hit ratio against the oracles, TTFT,
    /// load balance.
    Compare(Box<CompareArgs>), // boxed: its flags make it far larger than the other variants
    /// How many requests per second the fleet carries before TTFT breaks its SLO, per strategy:
    /// a cache-bound fleet (6,000 blocks, max-num-seqs 8 per pod) under the cache-pressure
    /// workload, Poisson arrivals up a QPS ladder, the strategies interleaved at every rung.
    Capacity(Box<crate::capacity::CapacityArgs>),
    /// llm-d's published study shapes (shared prefix, a long-input ladder, short requests at a
    /// high QPS) on 10 pods behind Envoy: TTFT and the picker's own cost (decision time at the
    /// router and over a no-op picker end to end, CPU cores, peak RSS), approximate and precise.
    Study(Box<crate::study::StudyArgs>),
    /// Run every benchmark of `make bench` and write results.md, results.json and images/.
    Report(ReportArgs),
    /// Added latency through real Envoy: direct, round robin, no-op ext_proc, kv-router.
    Overhead(OverheadArgs),
    /// Virtual-time simulation of a fleet on a trace with the router's own scoring and index (no
    /// sockets): hit ratio vs oracles, modeled TTFT and load balance per strategy, capacity plan.
    Simulate(SimulateArgs),
    /// The shared Redis index alone: fills a fresh Redis (or a local 3-master cluster) with
    /// about a million (pod, block) entries through the backend, then times 256-block lookups
    /// over 16 and 64 candidate pods; reports write rate, memory per entry, round trips.
    RedisIndex(RedisIndexArgs),
    /// The router's memory under traffic built to grow it (ext_proc straight to kv-router):
    /// unique prompts, session ids, model names, cache_salts, then streams holding large bodies.
    Hostile(HostileArgs),
    /// The router's CPU with no requests, per fleet size (probes and scrapes only).
    Idle(IdleArgs),
    /// Overload on a saturated fleet behind Envoy: a light and a 5x heavy tenant without and
    /// with flow control, then a high and a sheddable low priority class (docs/flow-control.md).
    Flow(FlowArgs),
    /// A few chat sessions sharing a long system prompt on two and four slow pods: every
    /// strategy against round robin, held to the small-fleet goals (hit ≥ 0.95 × infinite
    /// oracle, TTFT p50 ≤ 0.4 × and p99 ≤ round robin's, no pod above 2/3 of the requests).
    SmallFleet(SmallFleetArgs),
    /// 8 LoRA pods (4 slots, 32 adapters, Zipf popularity) behind Envoy and kv-router, with
    /// and without the LoRA scorer: adapter loads and evictions per 1,000 requests, TTFT.
    Lora(crate::lora::LoraArgs),
    /// Minutes of mixed traffic through real Envoy with a pod frozen every minute; samples the
    /// router's RSS and in-flight gauges; exits 1 if anything but the bad requests failed,
    /// in-flight load stays, or RSS keeps growing.
    Soak(SoakArgs),
    /// A rolling restart of every kv-router replica mid-run under steady multi-turn chat: hit
    /// ratio and TTFT p50/p99 in the window after against the window before, with the memory
    /// index warm from the live peers, cold, and with the shared Redis index.
    Failover(crate::failover::FailoverArgs),
}

#[derive(Args)]
pub struct SoakArgs {
    /// Minutes of load.
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// Seed of the request mix.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the RSS curve here (SVG).
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Write the samples and totals as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args)]
pub struct IdleArgs {
    /// Fleet sizes (comma-separated), one router run each.
    #[arg(long, value_delimiter = ',', default_value = "2,16,64")]
    pub pods: Vec<usize>,
    /// Seconds measured per fleet.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// The router's pods.idle_scrape_interval_ms (default: its default; 100 = every pod as busy).
    #[arg(long)]
    pub idle_scrape_interval_ms: Option<u64>,
    /// Print a markdown table too.
    #[arg(long)]
    pub markdown: bool,
}

#[derive(Args)]
pub struct HostileArgs {
    /// Requests per unique-value phase.
    #[arg(long, default_value_t = 1_000_000)]
    pub requests: usize,
    /// Concurrent ext_proc streams in those phases.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Streams that each hold an unfinished body in the last phase.
    #[arg(long, default_value_t = 2_000)]
    pub held_streams: usize,
    /// Bytes of body each of them holds.
    #[arg(long, default_value_t = 1 << 20)]
    pub held_bytes: usize,
    /// Simulated pods.
    #[arg(long, default_value_t = 4)]
    pub pods: usize,
    /// Instead of the phases above: the connection and upload floods (Pick, explain, preface,
    /// admin slowloris, held uploads through Envoy), each with a health probe beside it.
    #[arg(long)]
    pub attacks: bool,
    /// Seconds each attack is held (with --attacks).
    #[arg(long, default_value_t = 10)]
    pub hold_s: u64,
    /// With --attacks: only the attacks whose name contains this (e.g. "Pick flood").
    #[arg(long)]
    pub only: Option<String>,
    /// With --attacks: run every attack against this kv-router binary first (an earlier build),
    /// then against the current one, and table the two side by side.
    #[arg(long)]
    pub before_router: Option<PathBuf>,
    /// Print a markdown table too.
    #[arg(long)]
    pub markdown: bool,
    /// Write the figures as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args)]
pub struct RedisIndexArgs {
    /// redis-server or valkey-server (default: $KV_ROUTER_REDIS_SERVER, PATH, .venv).
    #[arg(long)]
    pub server: Option<PathBuf>,
    /// (pod, block) entries to store.
    #[arg(long, default_value_t = 1_000_000)]
    pub entries: usize,
    /// Candidate-set sizes (comma-separated); the largest is the fleet holding the blocks.
    #[arg(long, value_delimiter = ',', default_value = "16,64")]
    pub pods: Vec<usize>,
    /// Timed lookups per candidate-set size.
    #[arg(long, default_value_t = 2_000)]
    pub lookups: usize,
    /// Index modes (comma-separated): precise (KV events), approximate (recorded decisions,
    /// `lookups: redis`), mirrored (recorded decisions, `lookups: mirror`: the default).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "precise,approximate,mirrored"
    )]
    pub modes: Vec<String>,
    /// A local 3-master Redis Cluster instead of one server.
    #[arg(long)]
    pub cluster: bool,
    /// Seed for which pods hold which prompts and which are looked up.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print a markdown table too.
    #[arg(long)]
    pub markdown: bool,
    /// Write the figures as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args)]
pub struct CompareArgs {
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// Simulated pods [default: 8]. With --endpoint: the size of the fleet behind them
    /// (default: the --reset-pod count, else the pods seen in responses).
    #[arg(long)]
    pub pods: Option<usize>,
    /// KV-cache blocks (16 tokens) per simulated pod [default: 4096]. With --endpoint: per pod
    /// of that fleet (default: read from the --reset-pod pods' /metrics, else unknown and no
    /// oracle is computed).
    #[arg(long)]
    pub gpu_blocks: Option<usize>,
    /// Extra vllm-sim argument (repeatable), e.g. --sim-arg=--prefill-us-per-token=20.
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    pub sim_args: Vec<String>,
    /// The first N pods prefill --slow-factor times slower (a mixed fleet).
    #[arg(long, default_value_t = 0)]
    pub slow_pods: usize,
    /// How much slower the --slow-pods prefill.
    #[arg(long, default_value_t = 4.0, value_parser = positive_factor)]
    pub slow_factor: f64,
    /// A prefill/decode fleet: the first N pods `--role prefill`, the rest `--role decode`.
    /// Strategies `pd` and `precise-pd` route by roles; the others see the pods as one
    /// aggregated fleet. The report adds the P/D table (ITL, prompt tokens computed, transfers).
    #[arg(long, default_value_t = 0)]
    pub pd_prefill: usize,
    /// Strategies to run, comma-separated, in order [default: all but pd and precise-pd, which
    /// need --pd-prefill].
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Strategy::AGGREGATED)]
    pub strategies: Vec<Strategy>,
    /// kv-router replicas behind Envoy for every router strategy [default: 2 for redis, 1 for
    /// the others]; labelled `weighted x2` etc. when not the default.
    #[arg(long)]
    pub replicas: Option<usize>,
    /// kv-router replicas for the strategies sharing the Redis index only (`redis`,
    /// `redis-own-load`), overriding --replicas for them: `--redis-replicas 4` pairs four shared
    /// replicas with one `weighted` replica in one invocation.
    #[arg(long)]
    pub redis_replicas: Option<usize>,
    /// Workload.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Multiturn)]
    pub workload: WorkloadKind,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout_s: u64,
    /// Write the three SVG charts into this directory.
    #[arg(long)]
    pub charts: Option<PathBuf>,
    /// Write each router's `/metrics` and log at the end of its strategy's run into this
    /// directory (`<strategy>-<replica>.prom`, `.log`): decisions by reason, KV-event lag and
    /// counts, errors; with `RUST_LOG=kv_router=debug`, one log line per decision.
    #[arg(long)]
    pub router_metrics: Option<PathBuf>,
    /// Write every request of every run here, one JSON object per line (run label, request
    /// number in send order, send time from the run's start, serving pod, prompt and cached
    /// tokens, TTFT): which requests made two runs differ.
    #[arg(long)]
    pub records: Option<PathBuf>,
    /// Append each paired round of the shared-index strategies (with --repeat) to this record
    /// (TSV, created when missing) and judge the shared index's goal over every round there of the same
    /// workload, sim flags, machine kind and epoch, under this invocation's own verdict.
    #[arg(long)]
    pub pool: Option<PathBuf>,
    /// Run every strategy this many times, each round in an order rotated by one; the table
    /// gets a column per run (`weighted #2`) and the median and range of each strategy follow.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=20))]
    pub repeat: u64,
    /// Compare existing deployments instead of starting a fleet: LABEL=URL (repeatable).
    #[arg(long = "endpoint", value_parser = parse_endpoint)]
    pub endpoints: Vec<(String, String)>,
    /// With --endpoint: pod address (ip:port) whose prefix cache is reset between runs (repeatable).
    #[arg(long = "reset-pod")]
    pub reset_pods: Vec<std::net::SocketAddr>,
    /// With --endpoint: NAME=URL (repeatable) fetched right before and right after each
    /// endpoint's run into `--scrape-dir` as `<label>.<name>.before.prom` / `.after.prom` (names
    /// and labels with characters other than `A-Za-z0-9._-` written with `_`): the fleet's own
    /// counters over exactly that run, e.g. each router's decisions and each pod's requests.
    #[arg(long = "scrape", value_parser = parse_scrape, requires_all = ["endpoints", "scrape_dir"])]
    pub scrapes: Vec<(String, String)>,
    /// Directory receiving the `--scrape` files.
    #[arg(long, requires = "scrapes")]
    pub scrape_dir: Option<PathBuf>,
    #[command(flatten)]
    pub args: WorkloadArgs,
    #[command(flatten)]
    pub shared_prefix: SharedPrefixArgs,
    #[command(flatten)]
    pub fork: ForkArgs,
    #[command(flatten)]
    pub trace: TraceArgs,
    #[command(flatten)]
    pub arrivals: ArrivalArgs,
}

#[derive(Args)]
pub struct FlowArgs {
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// vllm-sim pods.
    #[arg(long, default_value_t = 4)]
    pub pods: usize,
    /// Requests each pod runs at once (`vllm-sim --max-num-seqs`).
    #[arg(long, default_value_t = 4)]
    pub max_num_seqs: usize,
    /// Per generated token, ms (`vllm-sim --decode-ms-per-token`).
    #[arg(long, default_value_t = 10.0)]
    pub decode_ms_per_token: f64,
    /// Seconds of traffic per arm.
    #[arg(long, default_value_t = 20)]
    pub seconds: u64,
    /// The light (high-priority) class's requests per second.
    #[arg(long, default_value_t = 8.0)]
    pub light_rps: f64,
    /// The heavy (low-priority) class sends this many times as much.
    #[arg(long, default_value_t = 5.0)]
    pub heavy_factor: f64,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// Prompt bytes per request.
    #[arg(long, default_value_t = 2000)]
    pub prompt_bytes: usize,
    /// Goodput counts completions with TTFT at most this, ms.
    #[arg(long, default_value_t = 1000.0)]
    pub slo_ms: f64,
    /// flow_control.queue_timeout_ms of the flow-control arms.
    #[arg(long, default_value_t = 5000)]
    pub queue_timeout_ms: u64,
    /// Rounds of all arms (order reversed every other round).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Seed of prompts and arrivals.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Print a markdown table too.
    #[arg(long)]
    pub markdown: bool,
}

#[derive(Args)]
pub struct SmallFleetArgs {
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// Cells as PODSxSESSIONS, comma-separated [default: 2x2,2x4,4x2,4x4; --quick: 2x2].
    #[arg(long, value_delimiter = ',', value_parser = parse_cell)]
    pub cells: Vec<(usize, usize)>,
    /// Strategies after round robin (always first: the goals are relative to it)
    /// [default: least-loaded,prefix-only,weighted,predicted-ttft,precise,redis; --quick: weighted,precise].
    #[arg(long, value_enum, value_delimiter = ',')]
    pub strategies: Vec<Strategy>,
    /// Turns per session [default: 8; --quick: 4].
    #[arg(long)]
    pub turns: Option<usize>,
    /// Shared system prompt size in bytes [default: 16384].
    #[arg(long)]
    pub system_bytes: Option<usize>,
    /// Extra vllm-sim argument (repeatable) [default: --prefill-us-per-token=400].
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    pub sim_args: Vec<String>,
    /// Seed of the texts and session arrival times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// CI size: one 2-pod cell of 2 sessions x 4 turns, weighted and precise (with
    /// --sessionless: one 2-pod cell of 6 conversations, weighted).
    #[arg(long)]
    pub quick: bool,
    /// Sessionless conversations on a long shared prompt: no session id, a 6 KB system prompt, then each conversation's own
    /// ~1.2 KB document and ~100 B questions, 16-token answers, 2 clients in a closed loop; cells
    /// 2x6,4x12; goals hit ratio ≥ 0.85, TTFT p50 ≤ 0.6 × and p99 ≤ round robin's, balance.
    #[arg(long)]
    pub sessionless: bool,
    /// Pods: `sim` (vllm-sim) or `llama` (real llama.cpp `llama-server` pods started here, one
    /// thread and 2 slots each, prompt cache and metrics on; `make llama` builds them).
    #[arg(long, default_value = "sim")]
    pub engine: Engine,
    /// The `llama-server` binary [default: .venv/llama/bin/llama-server].
    #[arg(long)]
    pub llama_server: Option<PathBuf>,
    /// The GGUF model [default: .venv/llama/SmolLM2-135M-Instruct.Q4_1.gguf].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write each router's `/metrics` and log after each run into this directory (with
    /// `RUST_LOG=kv_router=debug`, one log line per decision).
    #[arg(long)]
    pub router_metrics: Option<PathBuf>,
    /// Print the table as markdown with a heading (the command).
    #[arg(long)]
    pub markdown: bool,
}

impl SmallFleetArgs {
    /// The run's options: the defaults, then `--quick`, then explicit flags.
    pub fn options(&self) -> crate::small_fleet::SmallFleetOptions {
        let base = if self.sessionless {
            crate::small_fleet::SmallFleetOptions::sessionless()
        } else {
            Default::default()
        };
        let mut o = crate::small_fleet::SmallFleetOptions {
            envoy: self.envoy.clone(),
            seed: self.seed,
            router_metrics: self.router_metrics.clone(),
            ..base
        };
        if self.quick && self.sessionless {
            o.cells = vec![(2, 6)];
            o.strategies = vec![Strategy::Weighted];
        } else if self.quick {
            o.cells = vec![(2, 2)];
            o.turns = 4;
            o.strategies = vec![Strategy::Weighted, Strategy::Precise];
        }
        if !self.cells.is_empty() {
            o.cells = self.cells.clone();
        }
        if !self.strategies.is_empty() {
            o.strategies = self.strategies.clone();
        }
        if let Some(t) = self.turns {
            o.turns = t.max(1);
        }
        if let Some(b) = self.system_bytes {
            o.system_bytes = b;
        }
        if !self.sim_args.is_empty() {
            o.sim_args = self.sim_args.clone();
        }
        if self.engine == Engine::Llama {
            let venv = PathBuf::from(".venv/llama");
            o.llama = Some(kv_testkit::deploy::LlamaOptions::new(
                self.llama_server
                    .clone()
                    .unwrap_or_else(|| venv.join("bin/llama-server")),
                self.model
                    .clone()
                    .unwrap_or_else(|| venv.join("SmolLM2-135M-Instruct.Q4_1.gguf")),
            ));
        }
        o
    }
}

/// Which pods `small-fleet` runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    /// vllm-sim processes.
    Sim,
    /// llama.cpp `llama-server` processes.
    Llama,
}

fn parse_cell(s: &str) -> Result<(usize, usize), String> {
    let (p, n) = s
        .split_once('x')
        .ok_or_else(|| format!("`{s}`: expected PODSxSESSIONS, e.g. 2x4"))?;
    let num = |v: &str| {
        v.trim()
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("`{s}`: `{v}` is not a positive number"))
    };
    Ok((num(p)?, num(n)?))
}

#[derive(Args)]
pub struct ReportArgs {
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// Directory receiving results.md, results.json and images/.
    #[arg(long, default_value = "docs")]
    pub out: PathBuf,
    /// Small fleets and workloads (a minute or two): checks the pipeline, not the numbers.
    #[arg(long)]
    pub quick: bool,
}

#[derive(Args)]
pub struct OverheadArgs {
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// Measured requests per cell (default: 1000, or 40 with --quick).
    #[arg(long)]
    pub requests: Option<usize>,
    /// A few requests per cell (CI: checks the report, not speed).
    #[arg(long)]
    pub quick: bool,
    /// Prompt sizes in KiB (default: 1,8,400); one size alone is what a profile wants.
    #[arg(long, value_delimiter = ',')]
    pub sizes_kib: Vec<usize>,
    /// Closed-loop concurrencies (default: 1,32).
    #[arg(long, value_delimiter = ',')]
    pub concurrency: Vec<usize>,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Print the table as markdown with a heading (command, machine).
    #[arg(long)]
    pub markdown: bool,
}

#[derive(Args, Clone)]
pub struct WorkloadArgs {
    /// Conversations.
    #[arg(long, default_value_t = 16)]
    pub sessions: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 8)]
    pub turns: usize,
    /// Seed of every generated text.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Shared system prompt size in bytes.
    #[arg(long, default_value_t = 6144)]
    pub system_bytes: usize,
    /// max_tokens per request.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// Model name sent in requests.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Most sessions in flight (default: all).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Write summaries and every request record as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also print the table as markdown.
    #[arg(long)]
    pub markdown: bool,
}

impl WorkloadArgs {
    pub fn spec(&self) -> MultiturnSpec {
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
pub struct DemoArgs {
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// Simulated pods.
    #[arg(long, default_value_t = 4)]
    pub pods: usize,
    /// KV-cache blocks per simulated pod.
    #[arg(long, default_value_t = 4096)]
    pub gpu_blocks: usize,
    /// Extra vllm-sim argument (repeatable), e.g. --sim-arg=--ttft-base-ms=5.
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    pub sim_args: Vec<String>,
    #[command(flatten)]
    pub workload: WorkloadArgs,
}

#[derive(Args)]
pub struct RunArgs {
    /// Base URL of the endpoint, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    pub target: String,
    /// Workload.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Multiturn)]
    pub workload: WorkloadKind,
    /// Label of the run in the table.
    #[arg(long, default_value = "run")]
    pub label: String,
    /// Fleet size for the hotspot factor (default: pods seen in responses).
    #[arg(long)]
    pub pods: Option<usize>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout_s: u64,
    #[command(flatten)]
    pub args: WorkloadArgs,
    #[command(flatten)]
    pub shared_prefix: SharedPrefixArgs,
    #[command(flatten)]
    pub fork: ForkArgs,
    #[command(flatten)]
    pub trace: TraceArgs,
    #[command(flatten)]
    pub arrivals: ArrivalArgs,
}

/// Shared-prefix workload parameters (workloads.md §3.1).
#[derive(Args, Clone)]
pub struct SharedPrefixArgs {
    /// Shared-prefix: groups (distinct system prompts).
    #[arg(long, default_value_t = 10)]
    pub groups: usize,
    /// Shared-prefix: prompts per group.
    #[arg(long, default_value_t = 10)]
    pub prompts_per_group: usize,
    /// Shared-prefix: system prompt tokens.
    #[arg(long, default_value_t = 100)]
    pub system_tokens: usize,
    /// Shared-prefix: question tokens.
    #[arg(long, default_value_t = 50)]
    pub question_tokens: usize,
    /// Shared-prefix: output tokens.
    #[arg(long, default_value_t = 50)]
    pub output_tokens: u32,
}

impl SharedPrefixArgs {
    pub fn spec(&self, w: &WorkloadArgs) -> SharedPrefixSpec {
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

/// Fork workload parameters.
#[derive(Args, Clone)]
pub struct ForkArgs {
    /// Fork: the shared context's tokens in the first round.
    #[arg(long, default_value_t = 8192)]
    pub fork_prefix_tokens: usize,
    /// Fork: tokens the context grows by each round.
    #[arg(long, default_value_t = 256)]
    pub fork_growth_tokens: usize,
    /// Fork: branches per round.
    #[arg(long, default_value_t = 32)]
    pub fork_branches: usize,
    /// Fork: rounds.
    #[arg(long, default_value_t = 3)]
    pub fork_rounds: usize,
    /// Fork: a round's branches start within this many ms.
    #[arg(long, default_value_t = 1000)]
    pub fork_spread_ms: u64,
    /// Fork: ms between the starts of two rounds.
    #[arg(long, default_value_t = 8000)]
    pub fork_round_gap_ms: u64,
    /// Fork: each branch's own suffix, tokens.
    #[arg(long, default_value_t = 64)]
    pub fork_suffix_tokens: usize,
    /// Fork: output tokens.
    #[arg(long, default_value_t = 16)]
    pub fork_output_tokens: u32,
    /// Fork: every branch sends one `prompt_cache_key` (one agent session).
    #[arg(long)]
    pub fork_shared_cache_key: bool,
}

impl ForkArgs {
    pub fn spec(&self, w: &WorkloadArgs) -> ForkSpec {
        ForkSpec {
            prefix_tokens: self.fork_prefix_tokens,
            growth_tokens: self.fork_growth_tokens,
            branches: self.fork_branches,
            rounds: self.fork_rounds,
            spread_ms: self.fork_spread_ms,
            round_gap_ms: self.fork_round_gap_ms,
            suffix_tokens: self.fork_suffix_tokens,
            output_tokens: self.fork_output_tokens,
            shared_cache_key: self.fork_shared_cache_key,
            model: w.model.clone(),
            seed: w.seed,
        }
    }
}

/// Trace replay parameters.
#[derive(Args, Clone)]
pub struct TraceArgs {
    /// Trace: `conversation`, `synthetic` or a JSONL path.
    #[arg(long, default_value = "conversation")]
    pub trace: String,
    /// Trace: replay only N requests (after --trace-skip).
    #[arg(long)]
    pub trace_requests: Option<usize>,
    /// Trace: skip this many requests first (timestamps re-based to the first replayed).
    #[arg(long, default_value_t = 0)]
    pub trace_skip: usize,
    /// Trace: arrival-time compression (open loop at trace times / this); 0 = closed loop.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Trace: output tokens = output_length x this.
    #[arg(long, default_value_t = 1.0)]
    pub output_scale: f64,
    /// Trace: requests that share one timestamp arrive evenly spread until the next (the
    /// Mooncake conversation trace buckets its arrivals to 3 s: about 10 at one instant).
    #[arg(long)]
    pub spread_clumps: bool,
}

impl TraceArgs {
    pub fn spec(&self, w: &WorkloadArgs) -> Result<TraceSpec> {
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
            spread_clumps: self.spread_clumps,
            model: w.model.clone(),
        })
    }
}

/// Open-loop arrivals.
#[derive(Args, Clone)]
pub struct ArrivalArgs {
    /// Start sessions at Poisson times of this rate (per second) instead of all at once.
    #[arg(long)]
    pub poisson_rate: Option<f64>,
}

pub fn parse_endpoint(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((l, u)) if !l.is_empty() && u.starts_with("http") => Ok((l.into(), u.into())),
        _ => Err(format!("expected LABEL=http://host:port, got {s:?}")),
    }
}

/// `NAME=URL` of `--scrape`.
pub fn parse_scrape(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((n, u)) if !n.is_empty() && u.starts_with("http") => Ok((n.into(), u.into())),
        _ => Err(format!("expected NAME=http://host:port/path, got {s:?}")),
    }
}

/// Rebuilds a workload's sessions for each run.
pub type WorkloadFactory = Box<dyn Fn() -> Workload>;

/// Builds the chosen workload; trace files are read once, the closure rebuilds the sessions.
pub fn workload_factory(
    kind: WorkloadKind,
    args: &WorkloadArgs,
    shared_prefix: &SharedPrefixArgs,
    fork: &ForkArgs,
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
        // Open loop at the branches' own times.
        WorkloadKind::Fork => {
            let spec = fork.spec(args);
            (Box::new(move || spec.build()), None)
        }
        WorkloadKind::Trace => {
            let spec = trace.spec(args)?;
            let cap = spec.arrivals.concurrency();
            (Box::new(move || spec.build()), cap)
        }
    })
}

/// Command-line flags of `kv-bench simulate`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// Trace: `conversation`, `synthetic` or a JSONL path.
    #[arg(long, default_value = "conversation")]
    pub trace: String,
    /// Fleet size of the strategy comparison.
    #[arg(long, default_value_t = 64)]
    pub pods: usize,
    /// Skip the first N requests of the trace (another window; arrival times re-based).
    #[arg(long, default_value_t = 0)]
    pub skip: usize,
    /// Simulate only N requests (the first N after --skip).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Arrival times = trace times / this.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Output tokens = output_length x this.
    #[arg(long, default_value_t = 1.0)]
    pub output_scale: f64,
    /// Strategies to compare (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Strategy::available())]
    pub strategies: Vec<Strategy>,
    /// Capacity planning: TTFT target in ms at --ttft-percentile.
    #[arg(long, default_value_t = DEFAULT_TTFT_TARGET_MS)]
    pub ttft_target_ms: f64,
    /// Capacity planning: TTFT percentile that must meet the target.
    #[arg(long, default_value_t = 90.0)]
    pub ttft_percentile: f64,
    /// Capacity planning: strategy.
    #[arg(long, value_enum, default_value_t = Strategy::Weighted)]
    pub plan_strategy: Strategy,
    /// Capacity planning: fleet sizes to try, ascending (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![4usize, 8, 16, 32, 64, 128, 256])]
    pub plan_pods: Vec<usize>,
    /// Skip capacity planning.
    #[arg(long)]
    pub no_plan: bool,
    /// KV blocks per pod.
    #[arg(long, default_value_t = EngineConfig::default().num_gpu_blocks)]
    pub gpu_blocks: usize,
    /// Prefill time per uncached prompt token, microseconds.
    #[arg(long, default_value_t = EngineConfig::default().prefill_us_per_token)]
    pub prefill_us_per_token: f64,
    /// Decode time per output token (batch of one), milliseconds.
    #[arg(long, default_value_t = EngineConfig::default().decode_us_per_token / 1e3)]
    pub decode_ms_per_token: f64,
    /// Most running requests per pod.
    #[arg(long, default_value_t = EngineConfig::default().max_num_seqs)]
    pub max_num_seqs: usize,
    /// Fixed TTFT overhead per request, milliseconds.
    #[arg(long, default_value_t = EngineConfig::default().ttft_base_us / 1e3)]
    pub ttft_base_ms: f64,
    /// Delay of KV events before the precise index sees them, milliseconds.
    #[arg(long, default_value_t = 5.0)]
    pub event_delay_ms: f64,
    /// The first N pods prefill --slow-factor times slower (a mixed fleet).
    #[arg(long, default_value_t = 0)]
    pub slow_pods: usize,
    /// How much slower the --slow-pods prefill.
    #[arg(long, default_value_t = 1.0)]
    pub slow_factor: f64,
    /// Share of requests (0-1) that reach a random pod without this router (another replica,
    /// direct clients): the pods cache them, the router does not record them.
    #[arg(long, default_value_t = 0.0)]
    pub bypass: f64,
    /// Every this many virtual seconds one pod, in turn, restarts with an empty cache.
    #[arg(long)]
    pub restart_every_s: Option<f64>,
    /// The router is told each pod's KV cache is this many times its real size.
    #[arg(long, default_value_t = 1.0)]
    pub capacity_belief: f64,
    /// The first N pods publish no BlockRemoved events (precise strategies: a lossy publisher).
    #[arg(long, default_value_t = 0)]
    pub lost_removals: usize,
    /// Router replicas sharing the index, requests spread round robin; a list sweeps sizes.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize])]
    pub replicas: Vec<usize>,
    /// Virtual ms before a replica's index record reaches the other replicas; a list sweeps
    /// delays (each with each --replicas).
    #[arg(long, value_delimiter = ',', default_values_t = vec![0.0f64])]
    pub propagation_ms: Vec<f64>,
    /// Virtual ms before a decision's load reaches the other replicas when it travels apart
    /// from, and ahead of, its record (the live mirror's load stream); default: with it.
    #[arg(long)]
    pub charge_propagation_ms: Option<f64>,
    /// Replicas also count the others' requests as in-flight load, `propagation_ms` after they
    /// were decided (the live mirror's `index.redis.mirror_load`).
    #[arg(long)]
    pub shared_load: bool,
    /// Until when a request's uncached tokens count on its pod: `prefill` (everyone for the
    /// predicted prefill), `live` (its router until the first token, the other replicas for the
    /// predicted prefill, as the live router), `first-token` (everyone until the first token).
    #[arg(long, value_enum, default_value_t = crate::simulate::TokenRelease::Prefill)]
    pub token_release: crate::simulate::TokenRelease,
    /// Replicas also apply each other's conversation marks (a decision's best match and whether
    /// it started a conversation) with its record; the live mirror sends them with
    /// `mirror_load`'s charge, i.e. with `--shared-load`.
    #[arg(long)]
    pub shared_conversations: bool,
    /// Requests that share one trace timestamp arrive evenly spread until the next timestamp
    /// (the Mooncake conversation trace buckets arrivals to 3 s: about 10 requests at one instant).
    #[arg(long)]
    pub spread_clumps: bool,
    /// Turns `gate.replicate_to_idle` off (it is on by default), to measure what it changes.
    #[arg(long)]
    pub no_replicate_to_idle: bool,
    /// Requests name one of N LoRA adapters (drawn per conversation); 0: the base model only.
    #[arg(long, default_value_t = 0)]
    pub adapters: usize,
    /// Adapter slots per pod (vLLM's --max-loras) with --adapters.
    #[arg(long, default_value_t = 1)]
    pub adapter_slots: usize,
    /// A prefill/decode fleet: the first N pods prefill, the rest decode; 0: aggregated.
    #[arg(long, default_value_t = 0)]
    pub prefill_pods: usize,
    /// Seed of tie-breaks and the random policy.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A router configuration file (the router's own format) every strategy starts from, to
    /// try weights and gates on the trace before deploying them.
    #[arg(long)]
    pub router_config: Option<std::path::PathBuf>,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// CI size: at most the first 500 requests, capacity sweep up to 16 pods.
    #[arg(long)]
    pub quick: bool,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Print the tables as markdown instead of plain text.
    #[arg(long)]
    pub markdown: bool,
}

impl SimulateArgs {
    /// The options these flags describe.
    pub fn options(&self) -> SimulateOptions {
        let finite = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
        let opts = SimulateOptions {
            trace: self.trace.clone(),
            skip: self.skip,
            requests: self.requests,
            speedup: self.speedup,
            output_scale: finite(self.output_scale),
            pods: self.pods,
            strategies: self.strategies.clone(),
            // Read in `main` (a file can fail to load; these flags cannot).
            base_config: kv_router::config::Config::default(),
            engine: EngineConfig {
                block_size: BLOCK_TOKENS,
                num_gpu_blocks: self.gpu_blocks,
                max_num_seqs: self.max_num_seqs.max(1),
                ttft_base_us: finite(self.ttft_base_ms) * 1e3,
                prefill_us_per_token: finite(self.prefill_us_per_token),
                decode_us_per_token: finite(self.decode_ms_per_token) * 1e3,
                ..EngineConfig::default()
            },
            slow_pods: self.slow_pods,
            slow_factor: if self.slow_factor.is_finite() && self.slow_factor > 0.0 {
                self.slow_factor
            } else {
                1.0
            },
            event_delay_ms: finite(self.event_delay_ms),
            scrape_interval_ms: SimulateOptions::default().scrape_interval_ms,
            seed: self.seed,
            threads: self.threads,
            capacity: (!self.no_plan).then(|| CapacityOptions {
                strategy: self.plan_strategy,
                percentile: self.ttft_percentile.clamp(0.0, 100.0),
                ttft_target_ms: self.ttft_target_ms,
                pods: self.plan_pods.clone(),
            }),
            divergence: Divergence {
                bypass: self.bypass,
                restart_every_s: self.restart_every_s,
                capacity_belief: self.capacity_belief,
                lost_removals: self.lost_removals,
            },
            replicas: self.replicas.clone(),
            propagation_ms: self.propagation_ms.clone(),
            charge_propagation_ms: self.charge_propagation_ms,
            shared_load: self.shared_load,
            token_release: self.token_release,
            shared_conversations: self.shared_conversations,
            spread_clumps: self.spread_clumps,
            replicate_to_idle: !self.no_replicate_to_idle,
            adapters: self.adapters,
            adapter_slots: self.adapter_slots,
            prefill_pods: self.prefill_pods,
        };
        if self.quick {
            opts.quick()
        } else {
            opts
        }
    }
}

/// A finite factor above zero.
fn positive_factor(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a positive number")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compare(args: &[&str]) -> Result<CompareArgs, clap::Error> {
        let argv = ["kv-bench", "compare"].iter().chain(args);
        match Cli::try_parse_from(argv)?.cmd {
            Cmd::Compare(a) => Ok(*a),
            _ => unreachable!(),
        }
    }

    #[test]
    fn scrapes_need_endpoints_and_a_directory() {
        let a = compare(&[
            "--endpoint=kv=http://127.0.0.1:1",
            "--scrape=sim-10.0.0.1=http://127.0.0.1:2/metrics",
            "--scrape=router-0=http://127.0.0.1:3/metrics",
            "--scrape-dir=/tmp/s",
        ])
        .unwrap();
        assert_eq!(
            a.scrapes,
            [
                ("sim-10.0.0.1".into(), "http://127.0.0.1:2/metrics".into()),
                (
                    "router-0".to_string(),
                    "http://127.0.0.1:3/metrics".to_string()
                )
            ]
        );
        assert_eq!(
            a.scrape_dir.as_deref(),
            Some(std::path::Path::new("/tmp/s"))
        );
        // Without --endpoint there is no run of a fleet managed elsewhere to bracket.
        assert!(compare(&["--scrape=a=http://h/metrics", "--scrape-dir=/tmp/s"]).is_err());
        assert!(compare(&["--endpoint=kv=http://h:1", "--scrape=a=http://h/metrics"]).is_err());
        assert!(compare(&["--endpoint=kv=http://h:1", "--scrape-dir=/tmp/s"]).is_err());
        assert!(compare(&[
            "--endpoint=kv=http://h:1",
            "--scrape=nourl",
            "--scrape-dir=/x"
        ])
        .is_err());
    }
}
