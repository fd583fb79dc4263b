//! kv-bench: compare kv-router with round robin on simulated vLLM pods, load any endpoint,
//! measure the router's overhead, simulate a fleet in virtual time, write the results document.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;

use bench::{
    cli,
    compare::{self, CompareOptions},
    pipeline,
    report::{self, JsonReport, Summary},
    strategy::Strategy,
    table::Style,
};
use cli::{Cli, Cmd, SimulateArgs, WorkloadArgs};
use kv_bench as bench;
use kv_testkit::deploy::Binaries;
use kv_testkit::runner::{self, RunOptions, RunResult};

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
        write_json(path, &doc)?;
    }
    Ok(())
}

/// Writes `value` as pretty JSON to `path` and says so on stderr.
fn write_json(path: &std::path::Path, value: &impl serde::Serialize) -> Result<()> {
    std::fs::write(path, serde_json::to_vec_pretty(value)?)
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("kv-bench: wrote {}", path.display());
    Ok(())
}

/// Prints a report's tables (headed by the command and machine with `markdown`) and writes its
/// JSON where asked.
fn print_report(
    markdown: bool,
    machine: &str,
    tables: &str,
    json: Option<&std::path::Path>,
    value: &impl serde::Serialize,
) -> Result<()> {
    if markdown {
        let cmd: Vec<String> = std::env::args().skip(1).collect();
        println!("### `kv-bench {}` ({machine})\n", cmd.join(" "));
    }
    println!("{tables}");
    if let Some(path) = json {
        write_json(path, value)?;
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
                slow_pods: (0, 1.0),
                strategies: vec![Strategy::RoundRobin, Strategy::Weighted],
                request_timeout: Duration::from_secs(60),
                model: a.workload.model.clone(),
                progress: true,
                replicas: None,
                redis_replicas: None,
                router_metrics: None,
                repeat: 1,
                pd_prefill: 0,
            };
            let spec = a.workload.spec();
            let cmp =
                compare::compare(&bins, &opts, || spec.build(), a.workload.concurrency).await?;
            let summaries = cmp.summaries();
            let runs: Vec<RunResult> = cmp.runs.into_iter().filter_map(|r| r.run).collect();
            output(&runs, summaries, &a.workload)
        }
        Cmd::Run(a) => {
            let (workload, concurrency) = cli::workload_factory(
                a.workload,
                &a.args,
                &a.shared_prefix,
                &a.fork,
                &a.trace,
                &a.arrivals,
            )?;
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
            let section = pipeline::compare_section(&a, "Comparison", "compare", &command).await?;
            println!("{}", section.body);
            if let Some(dir) = &a.charts {
                std::fs::create_dir_all(dir)?;
                for c in &section.charts {
                    std::fs::write(dir.join(&c.file), &c.svg)?;
                }
                eprintln!("kv-bench: charts in {}", dir.display());
            }
            if let Some(path) = &a.args.json {
                write_json(path, &section.json)?;
            }
            Ok(())
        }
        Cmd::Report(a) => pipeline::report_all(&a).await,
        Cmd::Overhead(a) => {
            let r = pipeline::overhead_report(&a).await?;
            print_report(a.markdown, &r.machine, &r.markdown(), a.json.as_deref(), &r)
        }
        Cmd::Study(a) => {
            let r = bench::study::run(&Binaries::beside_current_exe()?, &a).await?;
            print_report(a.markdown, &r.machine, &r.markdown(), a.json.as_deref(), &r)
        }
        Cmd::RedisIndex(a) => redis_index(&a).await,
        Cmd::Capacity(a) => {
            let opts = a.options()?;
            let r = bench::capacity::run(&Binaries::beside_current_exe()?, &opts).await?;
            let render = bench::capacity::render::table;
            println!("{}\n", render(&r, Style::Plain));
            println!("{}", bench::capacity::render::notes(&r));
            if a.markdown {
                let cmd: Vec<String> = std::env::args().skip(1).collect();
                println!("\n### `kv-bench {}`\n", cmd.join(" "));
                println!("{}", render(&r, Style::Markdown));
            }
            if let Some(path) = &a.svg {
                std::fs::write(path, bench::capacity::render::chart(&r)?)
                    .with_context(|| format!("writing {}", path.display()))?;
                eprintln!("kv-bench: wrote {}", path.display());
            }
            if let Some(path) = &a.json {
                write_json(path, &r)?;
            }
            Ok(())
        }
        Cmd::Failover(a) => {
            let arms = bench::failover::run(&Binaries::beside_current_exe()?, &a).await?;
            let cmd: Vec<String> = std::env::args().skip(1).collect();
            println!(
                "### `kv-bench {}`\n\n{}",
                cmd.join(" "),
                bench::failover::table(&arms, bench::table::Style::Markdown)
            );
            Ok(())
        }
        Cmd::Lora(a) => {
            let arms = bench::lora::run(&Binaries::beside_current_exe()?, &a).await?;
            println!("{}", bench::lora::markdown(&arms));
            Ok(())
        }
        Cmd::SmallFleet(a) => {
            let opts = a.options();
            let r = bench::small_fleet::run(&Binaries::beside_current_exe()?, &opts).await?;
            if a.markdown {
                let cmd: Vec<String> = std::env::args().skip(1).collect();
                println!("### `kv-bench {}`\n\n{}\n", cmd.join(" "), r.workload);
                println!("{}", r.table(Style::Markdown));
            } else {
                println!("workload: {}\n{}", r.workload, r.table(Style::Plain));
            }
            for miss in r.misses() {
                println!("goal missed: {miss}");
            }
            if let Some(path) = &a.json {
                write_json(path, &r)?;
            }
            Ok(())
        }
        Cmd::Soak(a) => {
            let opts = bench::soak::SoakOptions {
                duration: Duration::from_secs_f64(a.minutes.max(0.1) * 60.0),
                concurrency: a.concurrency.max(1),
                sample_every: Duration::from_secs(5),
                envoy: a.envoy.clone(),
                seed: a.seed,
            };
            let report = bench::soak::run(&Binaries::beside_current_exe()?, &opts).await?;
            println!("{}", report.markdown());
            for e in &report.error_examples {
                println!("error: {e}");
            }
            if let Some(path) = &a.svg {
                std::fs::write(path, report.svg()?)
                    .with_context(|| format!("writing {}", path.display()))?;
                eprintln!("kv-bench: wrote {}", path.display());
            }
            if let Some(path) = &a.json {
                write_json(path, &report)?;
            }
            report
                .verdict()
                .map_err(|why| anyhow::anyhow!("soak failed: {}", why.join("; ")))
        }
        Cmd::Hostile(a) if a.attacks => {
            let hold = Duration::from_secs(a.hold_s);
            let bins = Binaries::beside_current_exe()?;
            let before = match &a.before_router {
                Some(old) => {
                    let old = Binaries::new(old, &bins.vllm_sim);
                    let omit = bench::hostile_compare::NEWER_KEYS;
                    Some(bench::hostile_attacks::run(&old, hold, a.only.as_deref(), omit).await?)
                }
                None => None,
            };
            let results = bench::hostile_attacks::run(&bins, hold, a.only.as_deref(), &[]).await?;
            println!("{}", bench::hostile_attacks::table(&results, Style::Plain));
            if a.markdown {
                println!(
                    "{}",
                    bench::hostile_attacks::table(&results, Style::Markdown)
                );
            }
            if let Some(before) = &before {
                let style = if a.markdown {
                    Style::Markdown
                } else {
                    Style::Plain
                };
                println!("{}", bench::hostile_compare::table(before, &results, style));
            }
            if let Some(path) = &a.json {
                write_json(path, &results)?;
            }
            Ok(())
        }
        Cmd::Hostile(a) => {
            let opts = bench::hostile::HostileOptions {
                requests: a.requests,
                concurrency: a.concurrency.max(1),
                held_streams: a.held_streams,
                held_bytes: a.held_bytes,
                pods: a.pods.max(1),
            };
            let results = bench::hostile::run(&Binaries::beside_current_exe()?, &opts).await?;
            println!("{}", bench::hostile::table(&results, Style::Plain));
            if a.markdown {
                println!("{}", bench::hostile::table(&results, Style::Markdown));
            }
            if let Some(path) = &a.json {
                write_json(path, &results)?;
            }
            Ok(())
        }
        Cmd::Flow(a) => {
            let sim_args = [
                "--max-num-seqs".to_string(),
                a.max_num_seqs.to_string(),
                "--decode-ms-per-token".to_string(),
                a.decode_ms_per_token.to_string(),
            ]
            .to_vec();
            let opts = bench::flow::FlowOptions {
                envoy: a.envoy.clone(),
                pods: a.pods,
                sim_args,
                seconds: a.seconds,
                light_rps: a.light_rps,
                heavy_factor: a.heavy_factor,
                max_tokens: a.max_tokens,
                prompt_bytes: a.prompt_bytes,
                slo_ms: a.slo_ms,
                queue_timeout_ms: a.queue_timeout_ms,
                rounds: a.rounds,
                seed: a.seed,
            };
            let results = bench::flow::run(&Binaries::beside_current_exe()?, &opts).await?;
            println!("{}", bench::flow::table(&results, Style::Plain));
            if a.markdown {
                println!("{}", bench::flow::table(&results, Style::Markdown));
            }
            Ok(())
        }
        Cmd::Idle(a) => {
            let opts = bench::idle::IdleOptions {
                pods: a.pods.clone(),
                window: Duration::from_secs(a.seconds.max(1)),
                idle_scrape_interval_ms: a.idle_scrape_interval_ms,
            };
            let results = bench::idle::run(&Binaries::beside_current_exe()?, &opts).await?;
            println!("{}", bench::idle::table(&results, Style::Plain));
            if a.markdown {
                println!("{}", bench::idle::table(&results, Style::Markdown));
            }
            Ok(())
        }
        // CPU-bound: off the async workers so the signal handlers stay responsive.
        Cmd::Simulate(a) => tokio::task::spawn_blocking(move || simulate(&a))
            .await
            .context("simulation thread")?,
    }
}

/// `kv-bench redis-index`: measures, prints the table, writes the JSON when asked.
async fn redis_index(a: &cli::RedisIndexArgs) -> Result<()> {
    let server = match &a.server {
        Some(p) => p.clone(),
        None => kv_testkit::deploy::find_redis_server()?,
    };
    let modes = a
        .modes
        .iter()
        .map(|m| {
            bench::redis_index::Mode::parse(m).ok_or_else(|| {
                anyhow::anyhow!("--modes: unknown mode {m:?} (precise, approximate, mirrored)")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let opts = bench::redis_index::RedisIndexOptions {
        server,
        entries: a.entries,
        pods: a.pods.clone(),
        lookups: a.lookups,
        modes,
        cluster: a.cluster,
        seed: a.seed,
    };
    let results = bench::redis_index::run(&opts).await?;
    println!("{}", bench::redis_index::table(&results, Style::Plain));
    if a.markdown {
        println!("{}", bench::redis_index::table(&results, Style::Markdown));
    }
    if let Some(path) = &a.json {
        write_json(path, &results)?;
    }
    Ok(())
}

/// `kv-bench simulate`: runs, prints the tables, writes the JSON when asked.
/// A router configuration file for the simulator, which supplies the pods: checked as the
/// router checks it, with a placeholder pod where the file names none.
fn router_config_for_simulation(path: &std::path::Path) -> Result<kv_router::config::Config> {
    use kv_router::config::{check_yaml_shape, Config, StaticPod};
    let text = std::fs::read_to_string(path)?;
    check_yaml_shape(&text)?;
    let cfg: Config = serde_yaml::from_str(&text)?;
    match cfg.clone().validate() {
        Ok(_) => {}
        Err(_) if cfg.pods.static_pods.is_empty() => {
            let mut probe = cfg.clone();
            probe.pods.static_pods = vec![StaticPod::new("127.0.0.1:8000", &[])];
            probe.validate()?;
        }
        Err(e) => return Err(e.into()),
    }
    Ok(cfg)
}

fn simulate(args: &SimulateArgs) -> Result<()> {
    let mut opts = args.options();
    if let Some(path) = &args.router_config {
        opts.base_config = router_config_for_simulation(path)
            .with_context(|| format!("--router-config {}", path.display()))?;
    }
    let report = bench::simulate::run(&opts)?;
    if args.markdown {
        println!("{}", report.markdown());
    } else {
        println!("{}", report.plain());
    }
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // Only when asked: `RUST_LOG=kv_router=debug kv-bench simulate` prints the router's own
    // per-decision lines (simulate runs the router's code in this process).
    if std::env::var_os("RUST_LOG").is_some() {
        kv_router::telemetry::init_logging(&kv_router::config::LogConfig::default());
    }
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

#[cfg(test)]
mod tests {
    use super::router_config_for_simulation;

    fn load(yaml: &str) -> anyhow::Result<kv_router::config::Config> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("router.yaml");
        std::fs::write(&path, yaml)?;
        router_config_for_simulation(&path)
    }

    #[test]
    fn a_router_config_without_pods_is_checked_as_the_router_checks_it() {
        let cfg = load("scorers:\n  prefix: {weight: 1.5}\n").expect("valid without pods");
        assert_eq!(cfg.scorers.prefix.weight, 1.5);
        assert!(
            cfg.pods.static_pods.is_empty(),
            "the fleet supplies the pods"
        );
        assert!(
            load("scorers:\n  prefix: {wieght: 1.5}\n").is_err(),
            "unknown key"
        );
        assert!(load("gate:\n  max_kv_usage: 7\n").is_err(), "out of range");
    }
}
