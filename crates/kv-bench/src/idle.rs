//! `kv-bench idle`: what kv-router costs when no request arrives, as a function of the fleet it
//! watches (health probes, `/metrics` scrapes, readiness, supervision). Starts N `vllm-sim` pods
//! and the real binary with its default probe settings, waits until every pod is healthy, then
//! reads the router's own CPU time (utime + stime from /proc) over a window.

use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use super::overhead::cpu::{clock_ticks_per_s, CpuSource};
use super::table::{Style, Table};
use kv_testkit::deploy::{local_router_config, Binaries, RouterProc, SimPod};

/// Fleets to measure and for how long.
#[derive(Debug, Clone)]
pub struct IdleOptions {
    /// Fleet sizes, one router run each.
    pub pods: Vec<usize>,
    /// Measured window per fleet.
    pub window: Duration,
    /// `pods.idle_scrape_interval_ms` (None: the default); 100 scrapes idle pods as busy ones.
    pub idle_scrape_interval_ms: Option<u64>,
}

/// The router's idle CPU over one fleet.
#[derive(Debug, Clone, Serialize)]
pub struct IdleResult {
    /// Pods watched.
    pub pods: usize,
    /// CPU time per wall second, ms.
    pub cpu_ms_per_s: f64,
    /// The same per pod, ms.
    pub per_pod_ms_per_s: f64,
}

/// Measures each fleet size in turn (pods and router stopped between them).
pub async fn run(bins: &Binaries, opts: &IdleOptions) -> Result<Vec<IdleResult>> {
    let sim_args: Vec<String> = ["--model", "m"].iter().map(|s| s.to_string()).collect();
    let mut out = Vec::new();
    for &n in &opts.pods {
        let pods: Vec<SimPod> = (0..n)
            .map(|_| SimPod::spawn(&bins.vllm_sim, &sim_args))
            .collect::<Result<_>>()?;
        let addrs: Vec<_> = pods.iter().map(|p| p.addr).collect();
        let mut cfg = local_router_config(&addrs)?;
        // The shipped probe cadence, not the fast one the local deployments use.
        cfg.pods.health_interval_ms = kv_router::config::Config::default().pods.health_interval_ms;
        if let Some(ms) = opts.idle_scrape_interval_ms {
            cfg.pods.idle_scrape_interval_ms = ms;
        }
        let mut router = RouterProc::spawn(&bins.kv_router, &cfg).await?;
        router
            .wait_pods_ready(n, Duration::from_secs(30))
            .await
            .with_context(|| format!("{n} pods ready"))?;
        let cpu = CpuSource::process(router.process().pid().context("router exited")?);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let before = cpu.ticks()?;
        tokio::time::sleep(opts.window).await;
        let used = cpu.ticks()?.saturating_sub(before);
        let ms = used as f64 * 1000.0 / clock_ticks_per_s() as f64;
        let cpu_ms_per_s = ms / opts.window.as_secs_f64();
        eprintln!("kv-bench idle: {n} pods: {cpu_ms_per_s:.2} ms CPU per s");
        out.push(IdleResult {
            pods: n,
            cpu_ms_per_s,
            per_pod_ms_per_s: cpu_ms_per_s / n.max(1) as f64,
        });
    }
    Ok(out)
}

/// The figures as a table.
pub fn table(results: &[IdleResult], style: Style) -> String {
    let mut t = Table::new(["pods", "router CPU ms/s", "per pod ms/s", "% of one core"]);
    for r in results {
        t.row(vec![
            r.pods.to_string(),
            format!("{:.2}", r.cpu_ms_per_s),
            format!("{:.3}", r.per_pod_ms_per_s),
            format!("{:.2} %", r.cpu_ms_per_s / 10.0),
        ]);
    }
    t.render(style)
}
