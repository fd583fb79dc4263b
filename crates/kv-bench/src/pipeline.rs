//! The report pipeline of `kv-bench report` (`make bench`): the planned benchmarks, each a
//! kv-bench command line parsed by the CLI itself (so the command printed above each section is
//! exactly what ran), run in turn and written as one results document.

use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;

use super::compare::{self, CompareOptions};
use super::{overhead, pool, results};
use crate::cli::{Cli, Cmd, CompareArgs, OverheadArgs, ReportArgs};
use kv_testkit::deploy::Binaries;

/// `kv-bench overhead` as its flags ask.
pub async fn overhead_report(a: &OverheadArgs) -> Result<overhead::OverheadReport> {
    let mut opts = if a.quick {
        overhead::OverheadOptions::quick()
    } else {
        overhead::OverheadOptions::full()
    };
    opts.requests = a.requests.unwrap_or(opts.requests);
    if !a.sizes_kib.is_empty() {
        opts.sizes = a.sizes_kib.iter().map(|k| k * 1024).collect();
    }
    if !a.concurrency.is_empty() {
        opts.concurrencies = a.concurrency.clone();
    }
    anyhow::ensure!(
        opts.sizes.iter().chain(&opts.concurrencies).all(|&n| n > 0),
        "--sizes-kib and --concurrency take positive numbers"
    );
    let bins = Binaries::beside_current_exe()?;
    overhead::run(&bins, a.envoy.as_deref(), &opts).await
}

/// `kv-bench compare` as its flags ask, as a results section.
pub async fn compare_section(
    a: &CompareArgs,
    title: &str,
    slug: &str,
    command: &str,
) -> Result<results::Section> {
    let started = std::time::Instant::now();
    let bins = Binaries::beside_current_exe()?;
    let (workload, concurrency) = crate::cli::workload_factory(
        a.workload,
        &a.args,
        &a.shared_prefix,
        &a.fork,
        &a.trace,
        &a.arrivals,
    )?;
    let opts = CompareOptions {
        envoy: a.envoy.clone(),
        pods: a.pods.unwrap_or(8),
        gpu_blocks: a.gpu_blocks.unwrap_or(4096),
        sim_args: a.sim_args.clone(),
        slow_pods: (a.slow_pods, a.slow_factor),
        strategies: a.strategies.clone(),
        request_timeout: Duration::from_secs(a.timeout_s),
        model: a.args.model.clone(),
        progress: true,
        replicas: a.replicas,
        redis_replicas: a.redis_replicas,
        router_metrics: a.router_metrics.clone(),
        repeat: a.repeat as usize,
        pd_prefill: a.pd_prefill,
    };
    let cmp = if a.endpoints.is_empty() {
        compare::compare(&bins, &opts, workload, concurrency).await?
    } else {
        compare::compare_endpoints(
            &a.endpoints,
            &a.reset_pods,
            &compare::Scrapes {
                targets: a.scrapes.clone(),
                dir: a.scrape_dir.clone(),
            },
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
    if let Some(path) = &a.records {
        write_records(path, &cmp)?;
    }
    let pooled = match &a.pool {
        Some(path) => pool_rounds(&cmp, &a.sim_args, path)?,
        None => String::new(),
    };
    let secs = started.elapsed().as_secs_f64();
    results::comparison_section(title, slug, command, &cmp, secs, &pooled)
}

/// `compare --pool`: this invocation's shared-index rounds appended to the record at `path`,
/// and the goal judged over every round there that pools with them.
fn pool_rounds(
    cmp: &compare::Comparison,
    sim_args: &[String],
    path: &std::path::Path,
) -> Result<String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let source = format!("{} {}", pool::utc_minute(now), kv_router::GIT_REVISION);
    let new = pool::rounds_of(cmp, sim_args, &pool::machine_kind(), &source);
    if new.is_empty() {
        return Ok(String::new());
    }
    let all = pool::append(path, &new)?;
    eprintln!(
        "kv-bench: {} paired rounds added to {} ({} on record)",
        new.len(),
        path.display(),
        all.len()
    );
    Ok(pool::verdicts(&all, &new, &path.display().to_string()))
}

/// Every request of every run of `cmp` as JSON lines (`compare --records`).
fn write_records(path: &std::path::Path, cmp: &compare::Comparison) -> Result<()> {
    use std::io::Write;
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    for run in &cmp.runs {
        for (i, r) in run.run.iter().flat_map(|x| x.records.iter()).enumerate() {
            let line = serde_json::json!({
                "run": run.label, "request": i, "session": r.session, "turn": r.turn,
                "start_ms": r.start_ms, "pod": r.pod, "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens, "ttft_ms": r.ttft_ms, "error": r.error,
            });
            writeln!(out, "{line}")?;
        }
    }
    out.flush()?;
    eprintln!("kv-bench: wrote {}", path.display());
    Ok(())
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

/// The trace replays load the fleet to saturation, where a few long prompts decide the hit ratio
/// and a millisecond decides where they go: one run of a strategy spans several points of the
/// pooled oracle. Three rounds in rotated order, and the router strategies with the baselines
/// that bound them (random and prefix-only are in the cheaper workloads below).
const TRACE_RUNS: &str =
    "--repeat 3 --strategies round-robin,least-loaded,weighted,predicted-ttft,precise,redis";

/// make bench's two Mooncake windows: 600 requests each, 8 pods of 32768 blocks.
const CONVERSATION: &str = "compare --workload trace --trace conversation --trace-requests 600 \
     --speedup 8 --spread-clumps --output-scale 0.25 --pods 8 --gpu-blocks 32768";
const SYNTHETIC: &str = "compare --workload trace --trace synthetic --trace-skip 2000 \
     --trace-requests 600 --speedup 6 --spread-clumps --output-scale 0.25 --pods 8 \
     --gpu-blocks 32768";

/// Replicas sharing the index against one router (the shared index's goal): the two strategies alone,
/// eight rounds in alternating order, so the paired medians and intervals can settle a 5 % p99
/// goal that three rounds of six strategies cannot (one round spans ±15 % on these windows).
const SHARED_RUNS: &str = "--repeat 8 --strategies redis,weighted";

/// The capacity ladder, short: the cache-pressure fleet and workload of `kv-bench capacity`'s
/// defaults, four rungs of 15 measured seconds, the baseline and the two router indexes
/// (about five minutes; the full ladder of five strategies takes about 45).
const CAPACITY: &str = "capacity --qps 4,8,12,16 --rung-s 15 --warmup-s 5 \
     --strategies round-robin,weighted,precise";

/// The study's short version in `make bench`: every section at a size and rate this 2-core
/// machine carries (the full shapes are `kv-bench study` with its defaults, docs/kv-bench.md).
const STUDY: &str = "study --sp-groups 20 --sp-output-tokens 100 --long-sizes 1000,10000,100000 \
     --long-requests 20 --short-qps 100 --short-requests 1000";

/// Its quick version (on the quick fleet flags): one small rung each, both modes.
const STUDY_QUICK: &str = "study --sp-groups 2 --sp-prompts-per-group 2 \
     --sp-system-tokens 64 --sp-question-tokens 16 --sp-output-tokens 4 --sp-qps 20 \
     --long-sizes 1000 --long-requests 5 --long-output-tokens 4 --long-qps 20 \
     --short-qps 50 --short-requests 20 --short-output-tokens 4";

/// Where the shared-index sections keep their rounds, under the report's directory: each
/// report adds its rounds and judges the goal over all of them too (`compare --pool`).
pub const POOL_FILE: &str = "paired-rounds/rounds.tsv";

fn plan(quick: bool, out: &std::path::Path) -> Vec<Planned> {
    let p = |title, slug, args: String| Planned { title, slug, args };
    let shared = format!("{SHARED_RUNS} --pool {}", out.join(POOL_FILE).display());
    if quick {
        // Two pods, instant sims, a handful of requests: the pipeline end to end in about a minute.
        let fast = "--pods 2 --gpu-blocks 512 --sim-arg=--prefill-us-per-token=1 \
                    --sim-arg=--decode-ms-per-token=0 --sim-arg=--ttft-base-ms=1";
        let tiny = "compare --workload trace --trace conversation --trace-requests 12 --speedup 0 --concurrency 4 --output-scale 0.02";
        return vec![
            p("Mooncake conversation trace", "trace-conversation", format!("{tiny} {fast}")),
            p("Replicas sharing the index: conversation window, two replicas", "shared-conversation-2",
              format!("{tiny} {fast} --repeat 3 --strategies redis,weighted --redis-replicas 2 --pool {}",
                      out.join(POOL_FILE).display())),
            p("Multi-turn chat", "multiturn",
              format!("compare --workload multiturn --sessions 3 --turns 2 --max-tokens 8 {fast}")),
            p("Shared prefix", "shared-prefix",
              format!("compare --workload shared-prefix --groups 2 --prompts-per-group 3 --poisson-rate 50 {fast}")),
            p("Capacity at a TTFT SLO", "capacity",
              format!("capacity --qps 4,8 --strategies round-robin,weighted --rung-requests 6 \
                       --warmup-s 0 --groups 10 --prefix-tokens 64 --question-tokens 16 \
                       --output-tokens 4 {fast}")),
            p("Router overhead", "overhead", "overhead --quick".into()),
            p("Picker cost on llm-d's study shapes", "study", format!("{STUDY_QUICK} {fast}")),
            p("Fleet simulation", "simulate", "simulate --trace conversation --pods 8 --quick".into()),
        ];
    }
    vec![
        // The conversation trace's timestamps are bucketed to 3 s: replayed as recorded, ~10
        // requests would arrive at one instant (both windows spread, for one replay rule).
        p("Mooncake conversation trace", "trace-conversation",
          format!("{CONVERSATION} {TRACE_SIM} {TRACE_RUNS}")),
        p("Mooncake synthetic trace", "trace-synthetic",
          format!("{SYNTHETIC} {TRACE_SIM} {TRACE_RUNS}")),
        p("Replicas sharing the index: conversation window, two replicas", "shared-conversation-2",
          format!("{CONVERSATION} {TRACE_SIM} {shared} --redis-replicas 2")),
        p("Replicas sharing the index: synthetic window, two replicas", "shared-synthetic-2",
          format!("{SYNTHETIC} {TRACE_SIM} {shared} --redis-replicas 2")),
        p("Replicas sharing the index: conversation window, four replicas", "shared-conversation-4",
          format!("{CONVERSATION} {TRACE_SIM} {shared} --redis-replicas 4")),
        p("Replicas sharing the index: synthetic window, four replicas", "shared-synthetic-4",
          format!("{SYNTHETIC} {TRACE_SIM} {shared} --redis-replicas 4")),
        p("Multi-turn chat", "multiturn",
          "compare --workload multiturn --sessions 32 --turns 6 --pods 8 --gpu-blocks 4096".into()),
        p("Shared prefix", "shared-prefix",
          "compare --workload shared-prefix --groups 40 --prompts-per-group 5 --system-tokens 6000 --question-tokens 1200 --output-tokens 100 --poisson-rate 8 --pods 8 --gpu-blocks 5120".into()),
        p("Capacity at a TTFT SLO", "capacity", CAPACITY.into()),
        p("Router overhead", "overhead", "overhead".into()),
        p("Picker cost on llm-d's study shapes", "study", STUDY.into()),
        p("Fleet simulation, 64 pods", "simulate",
          "simulate --trace conversation --pods 64 --gpu-blocks 31250".into()),
    ]
}

/// A section of tables alone (no charts, no details page), its JSON the report itself.
fn tables_section(
    title: &str,
    command: &str,
    body: String,
    report: &impl serde::Serialize,
    started: std::time::Instant,
) -> Result<results::Section> {
    Ok(results::Section {
        title: title.into(),
        command: command.into(),
        body,
        detail: String::new(),
        charts: Vec::new(),
        json: serde_json::to_value(report)?,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// `kv-bench report`: every planned benchmark, then the document, checked.
pub async fn report_all(a: &ReportArgs) -> Result<()> {
    let machine = results::machine();
    let mut sections = Vec::new();
    for item in plan(a.quick, &a.out) {
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
                let r = tokio::task::spawn_blocking(move || super::simulate::run(&opts))
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
            Cmd::Capacity(c) => {
                let opts = c.options()?;
                let r = super::capacity::run(&Binaries::beside_current_exe()?, &opts).await?;
                super::capacity::render::section(
                    item.title,
                    item.slug,
                    &command,
                    &r,
                    started.elapsed().as_secs_f64(),
                )?
            }
            Cmd::Study(s) => {
                let r = super::study::run(&Binaries::beside_current_exe()?, &s).await?;
                tables_section(item.title, &command, r.markdown(), &r, started)?
            }
            Cmd::Overhead(o) => {
                let r = overhead_report(&o).await?;
                tables_section(item.title, &command, r.markdown(), &r, started)?
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
         Envoy 1.40 on 127.0.0.1, on a noisy 2-core machine: the trace replays run three rounds \
         of each strategy, the shared-index sections eight paired rounds (judged \
         alone, then with every round on record in `paired-rounds/rounds.tsv`), the others one \
         run. \
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
