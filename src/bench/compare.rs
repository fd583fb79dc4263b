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
use super::workload::Workload;
use crate::config::{Config, Policy, TokenizerConfig};

/// A routing strategy under comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Envoy's round robin, no ext_proc.
    RoundRobin,
    /// kv-router `policy: random`.
    Random,
    /// kv-router `policy: least-loaded`.
    LeastLoaded,
    /// kv-router weighted policy with only the prefix scorer and no gates (pure prefix affinity).
    PrefixOnly,
    /// kv-router defaults: prefix + session + load scorers behind the gates, approximate index.
    Weighted,
    /// The weighted policy on the precise index fed by the pods' KV events.
    Precise,
    /// The weighted policy on the shared Redis index.
    Redis,
}

impl Strategy {
    /// Every strategy, baseline first.
    pub const ALL: [Strategy; 7] = [
        Strategy::RoundRobin,
        Strategy::Random,
        Strategy::LeastLoaded,
        Strategy::PrefixOnly,
        Strategy::Weighted,
        Strategy::Precise,
        Strategy::Redis,
    ];

    /// Label in reports.
    pub fn label(self) -> &'static str {
        match self {
            Strategy::RoundRobin => "round-robin",
            Strategy::Random => "random",
            Strategy::LeastLoaded => "least-loaded",
            Strategy::PrefixOnly => "prefix-only",
            Strategy::Weighted => "weighted",
            Strategy::Precise => "precise",
            Strategy::Redis => "redis",
        }
    }

    /// Why the strategy cannot run in this build, if it cannot.
    pub fn unavailable(self) -> Option<&'static str> {
        match self {
            Strategy::Redis => Some("the Redis index backend is not built yet"),
            _ => None,
        }
    }

    /// The router config of this strategy on top of `base` (None for Envoy round robin).
    pub fn router_config(self, base: &Config, model: &str) -> Option<Config> {
        let mut cfg = base.clone();
        match self {
            Strategy::RoundRobin | Strategy::Redis => return None,
            Strategy::Random => cfg.policy = Policy::Random,
            Strategy::LeastLoaded => cfg.policy = Policy::LeastLoaded,
            Strategy::PrefixOnly => {
                cfg.policy = Policy::Weighted;
                cfg.scorers.prefix.weight = 1.0;
                cfg.scorers.session.weight = 0.0;
                cfg.scorers.load.weight = 0.0;
                cfg.gate.enabled = false;
            }
            Strategy::Weighted => cfg.policy = Policy::Weighted,
            Strategy::Precise => {
                cfg.policy = Policy::Weighted;
                cfg.kv_events.enabled = true;
                cfg.kv_events.block_tokens = 16;
                let tok: TokenizerConfig =
                    serde_json::from_value(serde_json::json!({"model": model, "builtin": true}))
                        .expect("static tokenizer config");
                cfg.tokenizers = vec![tok];
            }
        }
        Some(cfg)
    }
}

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
    /// Pods.
    pub pods: usize,
    /// Blocks per pod.
    pub gpu_blocks: usize,
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
        pods: opts.pods,
        gpu_blocks: opts.gpu_blocks,
        runs: Vec::new(),
    };
    drop(sample);
    for &strategy in &opts.strategies {
        if let Some(why) = strategy.unavailable() {
            eprintln!("kv-bench: {}: skipped ({why})", strategy.label());
            out.runs.push(StrategyRun {
                label: strategy.label().into(),
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
        let target = match strategy.router_config(&base, &opts.model) {
            None => fleet.rr_envoy.url(),
            Some(cfg) => {
                let router = RouterProc::spawn(&bins.kv_router, &cfg)
                    .await
                    .with_context(|| format!("starting kv-router for {}", strategy.label()))?;
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
                strategy.label(),
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
                label: strategy.label().into(),
                progress: opts.progress,
            },
        )
        .await?;
        drop(stack);
        let summary =
            Summary::of(&run, Some(opts.pods)).with_oracles(&run, opts.pods, opts.gpu_blocks);
        out.runs.push(StrategyRun {
            label: strategy.label().into(),
            summary: Some(summary),
            run: Some(run),
            skipped: None,
        });
    }
    Ok(out)
}

/// Runs `workload()` once against each `(label, base URL)` of deployments managed elsewhere
/// ("pointed at" mode). Pod caches are reset between runs through `reset_pods` (vLLM's
/// `POST /reset_prefix_cache`) when given; `pods` × `gpu_blocks` sizes the pooled oracle.
pub async fn compare_endpoints(
    endpoints: &[(String, String)],
    reset_pods: &[SocketAddr],
    pods: usize,
    gpu_blocks: usize,
    request_timeout: Duration,
    workload: impl Fn() -> Workload,
    concurrency: Option<usize>,
) -> Result<Comparison> {
    let sample = workload();
    let mut out = Comparison {
        workload: sample.name.clone(),
        description: sample.description.clone(),
        pods,
        gpu_blocks,
        runs: Vec::new(),
    };
    drop(sample);
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
        let summary = Summary::of(&run, Some(pods)).with_oracles(&run, pods, gpu_blocks);
        out.runs.push(StrategyRun {
            label: label.clone(),
            summary: Some(summary),
            run: Some(run),
            skipped: None,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategies_map_to_router_configs() {
        let base = deploy::local_router_config(&["127.0.0.1:1".parse().unwrap()]).unwrap();
        assert!(Strategy::RoundRobin.router_config(&base, "m").is_none());
        assert_eq!(
            Strategy::Random.router_config(&base, "m").unwrap().policy,
            Policy::Random
        );
        let p = Strategy::PrefixOnly.router_config(&base, "m").unwrap();
        assert_eq!(
            (
                p.scorers.session.weight,
                p.scorers.load.weight,
                p.gate.enabled
            ),
            (0.0, 0.0, false)
        );
        let w = Strategy::Weighted.router_config(&base, "m").unwrap();
        assert!(!w.kv_events.enabled);
        assert_eq!(w.scorers, base.scorers, "weighted is the defaults");
        let precise = Strategy::Precise.router_config(&base, "m").unwrap();
        assert!(precise.kv_events.enabled);
        assert_eq!(precise.tokenizers[0].model, "m");
        precise.validate().expect("precise config is valid");
        assert!(Strategy::Redis.unavailable().is_some());
        let labels: Vec<&str> = Strategy::ALL.iter().map(|s| s.label()).collect();
        assert_eq!(labels.len(), 7);
    }
}
