//! `kv-bench flow`: overload with two classes of traffic on a saturated fleet, behind real Envoy
//! (BUFFERED), with and without kv-router's flow control. Each arm starts its own fleet (vllm-sim
//! pods, kv-router, Envoy) and sends open-loop Poisson traffic for a window:
//!
//! - `off`: a light tenant at `light_rps` and a heavy one at `heavy_factor` × that, no flow
//!   control (the pods' queues absorb the overload);
//! - `fair`: the same traffic with flow control on, the tenants as equal-weight flows;
//! - `priority`: the same rates as a high class (priority 10) and a sheddable low class
//!   (priority -1, below `shed_below: 0`), with flow control on.
//!
//! Per class: requests sent, completed, refused (429), failed, TTFT p50/p99 of the completed
//! ones, and goodput (completed with TTFT ≤ the SLO, per second of the window). Arms run in
//! turn, their order reversed every other round.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::json;

use super::report::percentile;
use super::table::{Style, Table};
use kv_router::config::FlowConfig;
use kv_testkit::deploy::{
    envoy_template, find_envoy, local_router_config, Binaries, EnvoyProc, RouterProc, SimPod,
};
use kv_testkit::prose::prose;
use kv_testkit::runner::{self, StreamOutcome};
use kv_testkit::splitmix::SplitMix64;

/// One run's shape.
#[derive(Debug, Clone)]
pub struct FlowOptions {
    /// Envoy binary (None: the usual search).
    pub envoy: Option<PathBuf>,
    /// vllm-sim pods.
    pub pods: usize,
    /// Arguments of each pod (its speed and `--max-num-seqs`).
    pub sim_args: Vec<String>,
    /// Seconds of traffic per arm.
    pub seconds: u64,
    /// The light (or high-priority) class's rate, requests per second.
    pub light_rps: f64,
    /// The heavy (or low-priority) class sends this many times as much.
    pub heavy_factor: f64,
    /// Tokens generated per request.
    pub max_tokens: u32,
    /// Prompt bytes per request (each prompt unique).
    pub prompt_bytes: usize,
    /// Goodput counts completions with TTFT at most this.
    pub slo_ms: f64,
    /// `flow_control.queue_timeout_ms` of the flow-control arms.
    pub queue_timeout_ms: u64,
    /// Rounds of all arms.
    pub rounds: usize,
    /// Seed of prompts and arrival times.
    pub seed: u64,
}

/// The arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arm {
    /// Two tenants, no flow control.
    Off,
    /// Two tenants as equal flows.
    Fair,
    /// A high and a sheddable low class.
    Priority,
}

impl Arm {
    fn as_str(self) -> &'static str {
        match self {
            Arm::Off => "off",
            Arm::Fair => "fair",
            Arm::Priority => "priority",
        }
    }

    /// The two classes: (name, headers), light first.
    fn classes(self) -> [(&'static str, Vec<(String, String)>); 2] {
        let h = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        match self {
            Arm::Off | Arm::Fair => [
                ("light", h(FLOW_HEADER, "light")),
                ("heavy", h(FLOW_HEADER, "heavy")),
            ],
            Arm::Priority => [
                ("high", h(PRIORITY_HEADER, "10")),
                ("low", h(PRIORITY_HEADER, "-1")),
            ],
        }
    }
}

/// The class headers, as a trusted gateway in front would set them: the bundled Envoy configs
/// strip the router's default flow and priority headers from clients.
const FLOW_HEADER: &str = "x-bench-flow";
const PRIORITY_HEADER: &str = "x-bench-priority";

/// One class's figures in one arm.
#[derive(Debug, Clone, Serialize)]
pub struct ClassResult {
    /// Round (0-based).
    pub round: usize,
    /// Arm.
    pub arm: Arm,
    /// Class name.
    pub class: &'static str,
    /// Requests sent.
    pub sent: usize,
    /// Completed (2xx, whole response).
    pub ok: usize,
    /// Answered 429 by flow control.
    pub refused: usize,
    /// Anything else.
    pub failed: usize,
    /// TTFT of the completed ones, ms.
    pub ttft_p50_ms: f64,
    /// ...
    pub ttft_p99_ms: f64,
    /// Completions with TTFT ≤ the SLO per second of the window.
    pub goodput_rps: f64,
}

/// Poisson arrival offsets (seconds) of rate `rps` over `seconds`.
pub fn arrivals(rng: &mut SplitMix64, rps: f64, seconds: f64) -> Vec<f64> {
    let mut t = 0.0;
    let mut out = Vec::new();
    loop {
        t += -(1.0 - rng.unit()).max(1e-12).ln() / rps;
        if t >= seconds {
            return out;
        }
        out.push(t);
    }
}

/// Runs every arm `rounds` times.
pub async fn run(bins: &Binaries, opts: &FlowOptions) -> Result<Vec<ClassResult>> {
    let envoy = find_envoy(opts.envoy.as_deref())?;
    let mut out = Vec::new();
    for round in 0..opts.rounds {
        let mut arms = vec![Arm::Off, Arm::Fair, Arm::Priority];
        if round % 2 == 1 {
            arms.reverse();
        }
        for arm in arms {
            eprintln!("kv-bench flow: round {round}, arm {}", arm.as_str());
            out.extend(run_arm(bins, &envoy, opts, arm, round).await?);
        }
    }
    Ok(out)
}

async fn run_arm(
    bins: &Binaries,
    envoy: &std::path::Path,
    opts: &FlowOptions,
    arm: Arm,
    round: usize,
) -> Result<Vec<ClassResult>> {
    let pods: Vec<SimPod> = (0..opts.pods)
        .map(|_| SimPod::spawn(&bins.vllm_sim, &opts.sim_args))
        .collect::<Result<_>>()?;
    let addrs: Vec<_> = pods.iter().map(|p| p.addr).collect();
    let mut cfg = local_router_config(&addrs)?;
    cfg.flow_control = FlowConfig {
        enabled: arm != Arm::Off,
        queue_timeout_ms: opts.queue_timeout_ms,
        flows: [("light".to_string(), 1), ("heavy".to_string(), 1)].into(),
        trust_client_headers: true,
        flow_header: FLOW_HEADER.into(),
        priority_header: PRIORITY_HEADER.into(),
        ..FlowConfig::default()
    };
    let router = RouterProc::spawn(&bins.kv_router, &cfg).await?;
    router
        .wait_pods_ready(addrs.len(), Duration::from_secs(20))
        .await?;
    let template = envoy_template("override-host-buffered.yaml")?;
    let envoy = EnvoyProc::spawn(envoy, &template, Some(router.grpc), &addrs)
        .await
        .context("starting Envoy")?;
    let client = runner::client();
    let url = format!("{}/v1/completions", envoy.url());
    let seconds = opts.seconds as f64;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (c, (_, headers)) in arm.classes().into_iter().enumerate() {
        let rps = opts.light_rps * if c == 0 { 1.0 } else { opts.heavy_factor };
        // The same arrivals and prompts in every arm of a round.
        let mut rng = SplitMix64::derive(opts.seed, class_stream(c), round as u64);
        for (i, at) in arrivals(&mut rng, rps, seconds).into_iter().enumerate() {
            let mut text = String::new();
            prose(
                &mut SplitMix64::derive(opts.seed ^ round as u64, class_stream(c), i as u64),
                opts.prompt_bytes,
                &mut text,
            );
            let body = json!({
                "model": "sim-model", "prompt": text, "max_tokens": opts.max_tokens, "stream": true
            });
            let (client, url, headers) = (client.clone(), url.clone(), headers.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until((started + Duration::from_secs_f64(at)).into()).await;
                let o = runner::stream_request(
                    &client,
                    &url,
                    &body,
                    &headers,
                    Duration::from_secs(120),
                )
                .await;
                (c, o)
            }));
        }
    }
    let mut outcomes: [Vec<StreamOutcome>; 2] = [Vec::new(), Vec::new()];
    for t in tasks {
        let (c, o) = t.await.context("request task")?;
        outcomes[c].push(o);
    }
    drop((envoy, router, pods));
    Ok(arm
        .classes()
        .into_iter()
        .zip(outcomes)
        .map(|((class, _), os)| summarize(round, arm, class, &os, opts))
        .collect())
}

fn class_stream(c: usize) -> &'static str {
    ["flow-light", "flow-heavy"][c.min(1)]
}

fn summarize(
    round: usize,
    arm: Arm,
    class: &'static str,
    os: &[StreamOutcome],
    opts: &FlowOptions,
) -> ClassResult {
    let ok: Vec<&StreamOutcome> = os.iter().filter(|o| o.ok()).collect();
    let refused = os.iter().filter(|o| o.status == Some(429)).count();
    let mut ttft: Vec<f64> = ok
        .iter()
        .filter_map(|o| o.ttft.map(|t| t.as_secs_f64() * 1e3))
        .collect();
    let good = ttft.iter().filter(|t| **t <= opts.slo_ms).count();
    ClassResult {
        round,
        arm,
        class,
        sent: os.len(),
        ok: ok.len(),
        refused,
        failed: os.len() - ok.len() - refused,
        ttft_p50_ms: percentile(&mut ttft, 50.0),
        ttft_p99_ms: percentile(&mut ttft, 99.0),
        goodput_rps: good as f64 / opts.seconds.max(1) as f64,
    }
}

/// The results as a table.
pub fn table(results: &[ClassResult], style: Style) -> String {
    let mut t = Table::new([
        "round",
        "arm",
        "class",
        "sent",
        "ok",
        "429",
        "failed",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "goodput/s",
    ])
    .left(1)
    .left(2);
    for r in results {
        t.row(vec![
            r.round.to_string(),
            r.arm.as_str().to_string(),
            r.class.to_string(),
            r.sent.to_string(),
            r.ok.to_string(),
            r.refused.to_string(),
            r.failed.to_string(),
            format!("{:.0}", r.ttft_p50_ms),
            format!("{:.0}", r.ttft_p99_ms),
            format!("{:.2}", r.goodput_rps),
        ]);
    }
    t.render(style)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_are_seeded_and_near_their_rate() {
        let a = arrivals(&mut SplitMix64::new(7), 50.0, 20.0);
        let b = arrivals(&mut SplitMix64::new(7), 50.0, 20.0);
        assert_eq!(a, b);
        assert!((900..1100).contains(&a.len()), "{}", a.len());
        assert!(a.windows(2).all(|w| w[0] < w[1]) && a.last() < Some(&20.0));
    }
}
