//! `kv-bench compare`: one fleet of simulated pods, the same workload once per routing strategy.
//!
//! Envoy round robin (no ext_proc) is the baseline; every other strategy is kv-router (restarted
//! with that strategy's config) behind Envoy's BUFFERED override-host bootstrap. Pod caches are
//! reset between strategies so each run starts cold.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use super::deploy::{self, Binaries, EnvoyOptions, EnvoyProc, RouterProc, SimPod};
use super::report::Summary;
use super::runner::{self, RunOptions, RunResult};
use super::strategy::Strategy;
use super::workload::Workload;
use kv_router::config::Config;

/// How to run a comparison.
#[derive(Debug, Clone)]
pub struct CompareOptions {
    /// Envoy binary (None: [`deploy::find_envoy`] rules).
    pub envoy: Option<PathBuf>,
    /// Simulated pods.
    pub pods: usize,
    /// KV blocks per pod.
    pub gpu_blocks: usize,
    /// Extra `vllm-sim` arguments for every pod.
    pub sim_args: Vec<String>,
    /// Strategies, in run order.
    pub strategies: Vec<Strategy>,
    /// Per-request timeout.
    pub request_timeout: Duration,
    /// Model served by the pods and sent in requests.
    pub model: String,
    /// Progress bars on stderr.
    pub progress: bool,
}

/// A pod with its KV-event ports.
#[derive(Debug)]
struct EventPod {
    sim: SimPod,
    events_port: u16,
    replay_port: u16,
}

/// The fleet shared by every strategy: pods publishing KV events and a round-robin Envoy.
#[derive(Debug)]
pub struct CompareFleet {
    pods: Vec<EventPod>,
    envoy_bin: PathBuf,
    rr_envoy: EnvoyProc,
}

impl CompareFleet {
    /// Starts the pods (named `pod-0…`, seeds 0…) and the round-robin Envoy.
    pub async fn start(bins: &Binaries, opts: &CompareOptions) -> Result<Self> {
        let envoy_bin = deploy::find_envoy(opts.envoy.as_deref())?;
        let mut pods = Vec::new();
        for i in 0..opts.pods {
            pods.push(spawn_event_pod(bins, i, opts)?);
        }
        let addrs: Vec<SocketAddr> = pods.iter().map(|p| p.sim.addr).collect();
        let rr_envoy = EnvoyProc::spawn_with(
            &envoy_bin,
            &deploy::envoy_template("round-robin.yaml")?,
            None,
            &addrs,
            &envoy_options(),
        )
        .await?;
        Ok(Self {
            pods,
            envoy_bin,
            rr_envoy,
        })
    }

    /// Pod addresses.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.pods.iter().map(|p| p.sim.addr).collect()
    }

    /// The router config every strategy starts from: these pods, their event endpoints.
    fn base_config(&self) -> Result<Config> {
        let mut cfg = deploy::local_router_config(&self.addrs())?;
        cfg.log.level = "warn".into();
        for (sp, p) in cfg.pods.static_pods.iter_mut().zip(&self.pods) {
            sp.kv_events_endpoint = Some(format!("tcp://127.0.0.1:{}", p.events_port));
            sp.kv_events_replay_endpoint = Some(format!("tcp://127.0.0.1:{}", p.replay_port));
        }
        Ok(cfg)
    }
}

fn envoy_options() -> EnvoyOptions {
    EnvoyOptions {
        concurrency: 2,
        ..Default::default()
    }
}

fn spawn_event_pod(bins: &Binaries, i: usize, opts: &CompareOptions) -> Result<EventPod> {
    let mut last = None;
    for _ in 0..4 {
        let (ep, rp) = (deploy::free_port()?, deploy::free_port()?);
        if ep == rp {
            continue;
        }
        let mut args = vec![
            "--pod-name".to_string(),
            format!("pod-{i}"),
            "--seed".to_string(),
            i.to_string(),
            "--num-gpu-blocks".to_string(),
            opts.gpu_blocks.to_string(),
            "--model".to_string(),
            opts.model.clone(),
            "--kv-events-endpoint".to_string(),
            format!("tcp://*:{ep}"),
            "--kv-events-replay-endpoint".to_string(),
            format!("tcp://*:{rp}"),
        ];
        args.extend(opts.sim_args.iter().cloned());
        match SimPod::spawn(&bins.vllm_sim, &args) {
            Ok(sim) => {
                return Ok(EventPod {
                    sim,
                    events_port: ep,
                    replay_port: rp,
                })
            }
            // An event port taken between probing and binding: try fresh ones.
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no free port pair")))
        .with_context(|| format!("starting pod-{i}"))
}

/// One strategy's outcome.
#[derive(Debug, Serialize)]
pub struct StrategyRun {
    /// Label in reports (the strategy's, or the user's for external endpoints).
    pub label: String,
    /// Its summary (None when it could not run).
    pub summary: Option<Summary>,
    /// Every request record (None when it could not run).
    pub run: Option<RunResult>,
    /// Why it did not run.
    pub skipped: Option<String>,
}

/// A whole comparison.
#[derive(Debug, Serialize)]
pub struct Comparison {
    /// Workload name.
    pub workload: String,
    /// Workload parameters.
    pub description: String,
    /// Pods measured (None: unknown).
    pub pods: Option<usize>,
    /// KV blocks per pod (None: unknown; then no oracle is computed).
    pub gpu_blocks: Option<usize>,
    /// One sentence saying what the fleet was and how that is known.
    pub fleet: String,
    /// One entry per strategy, in run order.
    pub runs: Vec<StrategyRun>,
}

impl Comparison {
    /// Summaries of the strategies that ran.
    pub fn summaries(&self) -> Vec<Summary> {
        self.runs.iter().filter_map(|r| r.summary.clone()).collect()
    }

    /// Lines naming the strategies that did not run and why.
    pub fn skipped_note(&self) -> String {
        self.runs
            .iter()
            .filter_map(|r| {
                r.skipped
                    .as_ref()
                    .map(|why| format!("- `{}` not run: {why}.\n", r.label))
            })
            .collect()
    }
}

/// Runs `workload()` once per strategy on a fresh fleet; `concurrency` is the runner's cap.
pub async fn compare(
    bins: &Binaries,
    opts: &CompareOptions,
    workload: impl Fn() -> Workload,
    concurrency: Option<usize>,
) -> Result<Comparison> {
    let fleet = CompareFleet::start(bins, opts).await?;
    let base = fleet.base_config()?;
    let addrs = fleet.addrs();
    let sample = workload();
    let mut out = Comparison {
        workload: sample.name.clone(),
        description: sample.description.clone(),
        pods: Some(opts.pods),
        gpu_blocks: Some(opts.gpu_blocks),
        fleet: format!(
            "{} vllm-sim pods x {} KV blocks of 16 tokens",
            opts.pods, opts.gpu_blocks
        ),
        runs: Vec::new(),
    };
    drop(sample);
    for &strategy in &opts.strategies {
        if let Some(why) = strategy.unavailable() {
            eprintln!("kv-bench: {}: skipped ({why})", strategy.as_str());
            out.runs.push(StrategyRun {
                label: strategy.as_str().into(),
                summary: None,
                run: None,
                skipped: Some(why.into()),
            });
            continue;
        }
        deploy::reset_caches(&addrs)
            .await
            .context("resetting pod caches")?;
        // Router and its Envoy live only for this strategy (dropping them stops them).
        let mut stack: Option<(RouterProc, EnvoyProc)> = None;
        // Round robin needs no router: Envoy's own round robin is the baseline.
        let target = match strategy {
            Strategy::RoundRobin => fleet.rr_envoy.url(),
            _ => {
                let cfg = strategy.router_config(&base, &opts.model);
                let router = RouterProc::spawn(&bins.kv_router, &cfg)
                    .await
                    .with_context(|| format!("starting kv-router for {}", strategy.as_str()))?;
                router
                    .wait_pods_ready(addrs.len(), Duration::from_secs(20))
                    .await?;
                let envoy = EnvoyProc::spawn_with(
                    &fleet.envoy_bin,
                    &deploy::envoy_template("override-host-buffered.yaml")?,
                    Some(router.grpc),
                    &addrs,
                    &envoy_options(),
                )
                .await?;
                let url = envoy.url();
                stack = Some((router, envoy));
                url
            }
        };
        let w = workload();
        if opts.progress {
            eprintln!(
                "kv-bench: {} ({} requests) through {}",
                strategy.as_str(),
                w.requests,
                target
            );
        }
        let run = runner::run(
            w,
            &RunOptions {
                target,
                concurrency,
                request_timeout: opts.request_timeout,
                label: strategy.as_str().into(),
                progress: opts.progress,
            },
        )
        .await?;
        drop(stack);
        let summary =
            Summary::of(&run, Some(opts.pods)).with_oracles(&run, opts.pods, opts.gpu_blocks);
        out.runs.push(StrategyRun {
            label: strategy.as_str().into(),
            summary: Some(summary),
            run: Some(run),
            skipped: None,
        });
    }
    Ok(out)
}

/// What is known of a fleet managed elsewhere, from the flags or measured.
#[derive(Debug, Clone, Copy, Default)]
pub struct FleetHint {
    /// `--pods`.
    pub pods: Option<usize>,
    /// `--gpu-blocks`.
    pub gpu_blocks: Option<usize>,
}

/// KV blocks per pod as the pods' own `/metrics` state them (`vllm:cache_config_info`), when
/// every pod answers and they agree.
async fn scraped_gpu_blocks(pods: &[SocketAddr]) -> Option<usize> {
    let client = runner::client();
    let mut seen = None;
    for p in pods {
        let text = client
            .get(format!("http://{p}/metrics"))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        let blocks = kv_router::pods::parse_vllm_metrics(&text).num_gpu_blocks? as usize;
        if seen.is_some_and(|b| b != blocks) {
            return None;
        }
        seen = Some(blocks);
    }
    seen
}

/// Runs `workload()` once against each `(label, base URL)` of deployments managed elsewhere
/// ("pointed at" mode). Pod caches are reset between runs through `reset_pods` (vLLM's
/// `POST /reset_prefix_cache`) when given. The report describes the fleet it measured: pods and
/// blocks per pod as given, else from the `reset_pods` (their count, their `/metrics`), else the
/// pods seen in responses; with blocks per pod unknown, no oracle is computed.
pub async fn compare_endpoints(
    endpoints: &[(String, String)],
    reset_pods: &[SocketAddr],
    hint: FleetHint,
    request_timeout: Duration,
    workload: impl Fn() -> Workload,
    concurrency: Option<usize>,
) -> Result<Comparison> {
    let sample = workload();
    let (workload_name, description) = (sample.name.clone(), sample.description.clone());
    drop(sample);
    let scraped = match hint.gpu_blocks {
        None if !reset_pods.is_empty() => scraped_gpu_blocks(reset_pods).await,
        _ => None,
    };
    let mut runs = Vec::new();
    for (label, url) in endpoints {
        if !reset_pods.is_empty() {
            deploy::reset_caches(reset_pods)
                .await
                .context("resetting pod caches")?;
        }
        let run = runner::run(
            workload(),
            &RunOptions {
                target: url.clone(),
                concurrency,
                request_timeout,
                label: label.clone(),
                progress: true,
            },
        )
        .await?;
        runs.push((label.clone(), run));
    }
    let seen: std::collections::BTreeSet<&str> = runs
        .iter()
        .flat_map(|(_, r)| r.records.iter().filter_map(|x| x.pod.as_deref()))
        .collect();
    let (pods, pods_how) = match (hint.pods, reset_pods.len(), seen.len()) {
        (Some(n), _, _) => (Some(n), "as given by --pods"),
        (None, n, _) if n > 0 => (Some(n), "the --reset-pod pods"),
        (None, _, n) if n > 0 => (Some(n), "seen serving in responses"),
        _ => (None, "unknown"),
    };
    let (gpu_blocks, blocks_how) = match (hint.gpu_blocks, scraped) {
        (Some(b), _) => (Some(b), "as given by --gpu-blocks"),
        (None, Some(b)) => (Some(b), "from the pods' /metrics"),
        (None, None) => (None, "unknown, so no oracle is computed"),
    };
    let fleet = format!(
        "{} pods ({pods_how}) x {} KV blocks per pod ({blocks_how}), behind {}",
        pods.map_or("?".into(), |n| n.to_string()),
        gpu_blocks.map_or("?".into(), |n| n.to_string()),
        endpoints
            .iter()
            .map(|(l, u)| format!("`{l}` = {u}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let runs = runs
        .into_iter()
        .map(|(label, run)| {
            let mut summary = Summary::of(&run, pods);
            if let (Some(p), Some(b)) = (pods, gpu_blocks) {
                summary = summary.with_oracles(&run, p, b);
            }
            StrategyRun {
                label,
                summary: Some(summary),
                run: Some(run),
                skipped: None,
            }
        })
        .collect();
    Ok(Comparison {
        workload: workload_name,
        description,
        pods,
        gpu_blocks,
        fleet,
        runs,
    })
}
