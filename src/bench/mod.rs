//! kv-bench: local deployments (simulated vLLM pods, kv-router, Envoy), workloads, a load runner
//! and reports. Used by the `kv-bench` binary and by the end-to-end tests.

pub mod deploy;
pub mod oracle;
pub mod report;
pub mod runner;
pub mod simulate;
pub mod trace;
pub mod workload;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::config::Policy;
use deploy::{Binaries, EnvoyOptions, EnvoyProc, RouterProc, SimPod};
use report::Summary;
use runner::{RunOptions, RunResult};
use workload::MultiturnSpec;

/// Parameters of `kv-bench demo`.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Envoy binary (None: [`deploy::find_envoy`] rules).
    pub envoy: Option<PathBuf>,
    /// Number of simulated pods.
    pub pods: usize,
    /// Workload.
    pub workload: MultiturnSpec,
    /// Cap on concurrent sessions.
    pub concurrency: Option<usize>,
    /// KV blocks per simulated pod.
    pub gpu_blocks: usize,
    /// Extra `vllm-sim` arguments.
    pub sim_args: Vec<String>,
}

/// A running demo fleet: pods, one plain round-robin Envoy, kv-router and an Envoy using it.
/// Everything is stopped when it is dropped.
#[derive(Debug)]
pub struct DemoFleet {
    /// Simulated pods.
    pub pods: Vec<SimPod>,
    /// Envoy with `round-robin.yaml`.
    pub rr_envoy: EnvoyProc,
    /// kv-router (weighted policy).
    pub router: RouterProc,
    /// Envoy with `override-host-buffered.yaml` pointed at the router.
    pub kv_envoy: EnvoyProc,
}

impl DemoFleet {
    /// Starts the fleet.
    pub async fn start(bins: &Binaries, opts: &DemoOptions) -> Result<Self> {
        let envoy = deploy::find_envoy(opts.envoy.as_deref())?;
        let mut pods = Vec::new();
        for i in 0..opts.pods {
            let mut args = vec![
                "--pod-name".to_string(),
                format!("pod-{i}"),
                "--seed".to_string(),
                i.to_string(),
                "--num-gpu-blocks".to_string(),
                opts.gpu_blocks.to_string(),
                "--model".to_string(),
                opts.workload.model.clone(),
            ];
            args.extend(opts.sim_args.iter().cloned());
            pods.push(SimPod::spawn(&bins.vllm_sim, &args)?);
        }
        let addrs: Vec<SocketAddr> = pods.iter().map(|p| p.addr).collect();
        let eopts = EnvoyOptions {
            concurrency: 2,
            ..Default::default()
        };
        let rr_envoy = EnvoyProc::spawn_with(
            &envoy,
            &deploy::envoy_template("round-robin.yaml")?,
            None,
            &addrs,
            &eopts,
        )
        .await?;
        let mut cfg = deploy::local_router_config(&addrs)?;
        cfg.policy = Policy::Weighted;
        cfg.log.level = "warn".into();
        let router = RouterProc::spawn(&bins.kv_router, &cfg).await?;
        // Every pod healthy with fresh load metrics, so none is gated as stale at the start.
        router
            .wait_pods_ready(addrs.len(), Duration::from_secs(15))
            .await?;
        let kv_envoy = EnvoyProc::spawn_with(
            &envoy,
            &deploy::envoy_template("override-host-buffered.yaml")?,
            Some(router.grpc),
            &addrs,
            &eopts,
        )
        .await?;
        Ok(Self {
            pods,
            rr_envoy,
            router,
            kv_envoy,
        })
    }

    /// Pod addresses.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.pods.iter().map(|p| p.addr).collect()
    }
}

/// Runs the demo: the multi-turn workload through round robin, then (caches reset) through
/// kv-router. Returns both runs.
pub async fn demo(bins: &Binaries, opts: &DemoOptions) -> Result<Vec<RunResult>> {
    let fleet = DemoFleet::start(bins, opts).await?;
    let mut runs = Vec::new();
    for (label, url) in [
        ("round-robin", fleet.rr_envoy.url()),
        ("kv-router", fleet.kv_envoy.url()),
    ] {
        deploy::reset_caches(&fleet.addrs())
            .await
            .context("resetting pod caches")?;
        eprintln!(
            "kv-bench: running {} requests through {label} ({url})",
            opts.workload.sessions * opts.workload.turns
        );
        let r = runner::run(
            opts.workload.build(),
            &RunOptions {
                target: url,
                concurrency: opts.concurrency,
                request_timeout: Duration::from_secs(60),
                label: label.into(),
            },
        )
        .await?;
        runs.push(r);
    }
    drop(fleet);
    Ok(runs)
}

/// Summaries of `runs` over a fleet of `pods`.
pub fn summarize(runs: &[RunResult], pods: Option<usize>) -> Vec<Summary> {
    runs.iter().map(|r| Summary::of(r, pods)).collect()
}
