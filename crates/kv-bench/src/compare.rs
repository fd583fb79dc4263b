//! `kv-bench compare`: one fleet of simulated pods, the same workload once per routing strategy.
//!
//! Envoy round robin (no ext_proc) is the baseline; every other strategy is kv-router (restarted
//! with that strategy's config) behind Envoy's BUFFERED override-host bootstrap. `redis` is two
//! replicas sharing a fresh Redis/Valkey, both endpoints of Envoy's `kv_router` cluster (Envoy
//! spreads ext_proc streams over them). Pod caches are reset between strategies so each run
//! starts cold; routers, Envoy and Redis live only for their strategy.

pub mod stack;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use super::pd_report::{self, PodWork};
use super::report::Summary;
use super::strategy::Strategy;
use kv_router::config::{Config, PodRole};
use kv_testkit::deploy::{self, Binaries, EnvoyOptions, EnvoyProc, EventPod, RouterProc};
use kv_testkit::runner::{self, RunOptions, RunResult};
use kv_testkit::workload::Workload;
use stack::Stack;

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
    /// The first `n` pods prefill `factor` times slower than the others (a mixed fleet).
    pub slow_pods: (usize, f64),
    /// Strategies, in run order.
    pub strategies: Vec<Strategy>,
    /// Per-request timeout.
    pub request_timeout: Duration,
    /// Model served by the pods and sent in requests.
    pub model: String,
    /// Progress bars on stderr.
    pub progress: bool,
    /// kv-router replicas behind Envoy for every router strategy (None: each strategy's
    /// [`Strategy::default_replicas`]). Replicas without the shared index each learn alone.
    pub replicas: Option<usize>,
    /// Replicas for the strategies that share the Redis index, overriding `replicas` for them
    /// alone: `redis` x4 against one `weighted` replica in one invocation.
    pub redis_replicas: Option<usize>,
    /// Where each router's final `/metrics` and its log go (`<label>-<replica>.prom`, `.log`),
    /// if anywhere.
    pub router_metrics: Option<PathBuf>,
    /// Rounds over the strategies, each in an order rotated by one (`#1`, `#2`… in labels when
    /// more than one): a single run's verdict can be its slot or the machine's noise.
    pub repeat: usize,
    /// A prefill/decode fleet: the first `n` pods run `--role prefill`, the rest
    /// `--role decode` (0: every pod aggregated). Only the P/D strategies route by roles.
    pub pd_prefill: usize,
}

impl CompareOptions {
    /// A fleet of `pods` aggregated pods, none slower, each strategy with its default replicas,
    /// one quiet round and no strategy yet: what the sections that run their own loop start from.
    pub fn fleet(
        envoy: Option<PathBuf>,
        pods: usize,
        gpu_blocks: usize,
        sim_args: Vec<String>,
        model: String,
    ) -> Self {
        Self {
            envoy,
            pods,
            gpu_blocks,
            sim_args,
            slow_pods: (0, 1.0),
            strategies: Vec::new(),
            request_timeout: Duration::from_secs(60),
            model,
            progress: false,
            replicas: None,
            redis_replicas: None,
            router_metrics: None,
            repeat: 1,
            pd_prefill: 0,
        }
    }

    /// kv-router replicas for `strategy` (none for Envoy's own round robin).
    pub fn replicas(&self, strategy: Strategy) -> usize {
        match (strategy.default_replicas(), self.replicas) {
            (0, _) => 0,
            _ if strategy.needs_redis() && self.redis_replicas.is_some() => {
                self.redis_replicas.unwrap_or(2).max(1)
            }
            (_, Some(n)) => n.max(1),
            (d, None) => d,
        }
    }

    /// The label of `strategy` in reports: its name, with the replica count when not the
    /// strategy's default (`weighted x2`).
    pub fn label(&self, strategy: Strategy) -> String {
        let n = self.replicas(strategy);
        if n == strategy.default_replicas() {
            strategy.as_str().into()
        } else {
            format!("{} x{n}", strategy.as_str())
        }
    }
}

/// The fleet shared by every strategy: pods publishing KV events and a round-robin Envoy.
#[derive(Debug)]
pub struct CompareFleet {
    pods: Vec<EventPod>,
    pub(crate) envoy_bin: PathBuf,
    rr_envoy: EnvoyProc,
    pd_prefill: usize,
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
            pd_prefill: opts.pd_prefill,
        })
    }

    /// The URL of the fleet's round-robin Envoy (no router): the `round-robin` strategy.
    pub(crate) fn round_robin_url(&self) -> String {
        self.rr_envoy.url()
    }

    /// Pod addresses.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.pods.iter().map(|p| p.sim.addr).collect()
    }

    /// The router config every strategy starts from: these pods, their event endpoints.
    pub(crate) fn base_config(&self) -> Result<Config> {
        let mut cfg = deploy::local_router_config(&self.addrs())?;
        cfg.log.level = "warn".into();
        EventPod::set_endpoints(&mut cfg, &self.pods);
        if self.pd_prefill > 0 {
            for (i, p) in cfg.pods.static_pods.iter_mut().enumerate() {
                p.role = Some(pod_role(i, self.pd_prefill));
            }
        }
        Ok(cfg)
    }

    /// Every pod with whether it is a prefill-role pod.
    pub(crate) fn roles(&self) -> Vec<(SocketAddr, bool)> {
        let n = self.pd_prefill;
        self.addrs()
            .into_iter()
            .enumerate()
            .map(|(i, a)| (a, pod_role(i, n) == PodRole::Prefill))
            .collect()
    }
}

/// Pod `i`'s role in a fleet whose first `prefill` pods prefill (0: aggregated).
fn pod_role(i: usize, prefill: usize) -> PodRole {
    match (prefill, i < prefill) {
        (0, _) => PodRole::Both,
        (_, true) => PodRole::Prefill,
        (_, false) => PodRole::Decode,
    }
}

pub(crate) fn envoy_options() -> EnvoyOptions {
    EnvoyOptions {
        concurrency: 2,
        ..Default::default()
    }
}

fn spawn_event_pod(bins: &Binaries, i: usize, opts: &CompareOptions) -> Result<EventPod> {
    let mut args = vec![
        "--seed".to_string(),
        i.to_string(),
        "--num-gpu-blocks".to_string(),
        opts.gpu_blocks.to_string(),
        "--model".to_string(),
        opts.model.clone(),
    ];
    args.extend(pod_sim_args(&opts.sim_args, i, opts.slow_pods));
    args.push(format!("--role={}", pod_role(i, opts.pd_prefill).as_str()));
    EventPod::spawn(&bins.vllm_sim, &format!("pod-{i}"), &args)
}

/// vllm-sim's prefill cost when `--prefill-us-per-token` is not given.
const SIM_PREFILL_US_PER_TOKEN: f64 = 100.0;

/// Pod `i`'s extra vllm-sim arguments: `sim_args`, with the prefill cost multiplied by
/// `slow.1` on the first `slow.0` pods.
fn pod_sim_args(sim_args: &[String], i: usize, slow: (usize, f64)) -> Vec<String> {
    if i >= slow.0 {
        return sim_args.to_vec();
    }
    const FLAG: &str = "--prefill-us-per-token";
    let mut base = SIM_PREFILL_US_PER_TOKEN;
    let mut out = Vec::with_capacity(sim_args.len() + 1);
    let mut args = sim_args.iter();
    while let Some(a) = args.next() {
        if let Some(v) = a.strip_prefix(FLAG).and_then(|r| r.strip_prefix('=')) {
            base = v.parse().unwrap_or(base);
        } else if a == FLAG {
            base = args.next().and_then(|v| v.parse().ok()).unwrap_or(base);
        } else {
            out.push(a.clone());
        }
    }
    out.push(format!("{FLAG}={}", base * slow.1));
    out
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
    /// What the pods did during the run (their counters' change), on a P/D fleet.
    pub pod_work: Option<PodWork>,
    /// Each router replica's shared-index counters at the end of the run (none without Redis).
    pub replica_counters: Vec<String>,
    /// Lookups that fell back from the shared index, summed over its replicas (None without it).
    pub redis_fallbacks: Option<u64>,
}

impl StrategyRun {
    /// A finished run, summarized (with the oracles when the fleet is known). The bodies it
    /// sent are dropped once the oracles have replayed them: a Mooncake run's token arrays as
    /// JSON values are ~300 MB, and keeping every run's grew `make bench` to 5 GB by its last
    /// rounds, so later runs' clients paid for fresh pages while they timed requests.
    fn finished(label: String, mut run: RunResult, fleet: Option<(usize, usize)>) -> Self {
        let mut summary = Summary::of(&run, fleet.map(|(p, _)| p));
        if let Some((pods, blocks)) = fleet {
            summary = summary.with_oracles(&run, pods, blocks);
        }
        run.sent = Vec::new();
        Self {
            label,
            summary: Some(summary),
            run: Some(run),
            skipped: None,
            pod_work: None,
            replica_counters: Vec::new(),
            redis_fallbacks: None,
        }
    }

    /// A strategy that could not run, and why.
    fn skipped(label: String, why: String) -> Self {
        Self {
            label,
            summary: None,
            run: None,
            skipped: Some(why),
            pod_work: None,
            replica_counters: Vec::new(),
            redis_fallbacks: None,
        }
    }
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
    /// Prefill-role pods of a P/D fleet (0: aggregated).
    pub pd_prefill: usize,
}

impl Comparison {
    /// The report's line naming the workload and the fleet (the shared-index record's window).
    pub fn workload_line(&self) -> String {
        format!(
            "Workload: {} ({}). Fleet: {}.",
            self.workload, self.description, self.fleet
        )
    }

    /// Summaries of the strategies that ran.
    pub fn summaries(&self) -> Vec<Summary> {
        self.runs.iter().filter_map(|r| r.summary.clone()).collect()
    }

    /// The P/D table's rows: every run with pod counters, against the pooled oracle.
    pub fn pd_rows(&self) -> Vec<pd_report::PdRow> {
        self.runs
            .iter()
            .filter_map(|r| {
                let (run, work) = (r.run.as_ref()?, r.pod_work.as_ref()?);
                let pooled = r.summary.as_ref()?.oracles?.pooled.ratio();
                Some(pd_report::PdRow::of(&r.label, run, work, pooled))
            })
            .collect()
    }

    /// One line per router replica of every run that shared an index: its counters at the end.
    pub fn counters_note(&self) -> String {
        let mut out = String::new();
        for r in &self.runs {
            for line in &r.replica_counters {
                out.push_str(&format!("- `{}` {line}\n", r.label));
            }
        }
        out
    }

    /// Per strategy that shared an index over paired rounds: whether it met the shared index's
    /// goal against the baseline (`paired::shared_index_verdict`), one line each.
    pub fn shared_index_verdicts(&self) -> String {
        let summaries = self.summaries();
        let mut falls: Vec<(&str, u64)> = Vec::new();
        for r in &self.runs {
            let Some(f) = r.redis_fallbacks else {
                continue;
            };
            let name = crate::report::strategy_of(&r.label);
            match falls.iter_mut().find(|(n, _)| *n == name) {
                Some((_, sum)) => *sum += f,
                None => falls.push((name, f)),
            }
        }
        falls
            .iter()
            .filter_map(|&(name, f)| crate::paired::shared_index_verdict(&summaries, name, f))
            .map(|v| format!("{v}\n"))
            .collect()
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
        fleet: match opts.pd_prefill {
            0 => format!(
                "{} vllm-sim pods x {} KV blocks of 16 tokens",
                opts.pods, opts.gpu_blocks
            ),
            n => format!(
                "{} vllm-sim pods x {} KV blocks of 16 tokens, the first {n} `--role prefill` \
                 and the rest `--role decode`; only the P/D strategies route by role, the \
                 others see one aggregated fleet (a decode pod without the prefill header \
                 prefills itself)",
                opts.pods, opts.gpu_blocks
            ),
        },
        runs: Vec::new(),
        pd_prefill: opts.pd_prefill,
    };
    drop(sample);
    let rounds = opts.repeat.max(1);
    for (round, i) in run_order(opts.strategies.len(), rounds) {
        let strategy = opts.strategies[i];
        let label = match rounds {
            1 => opts.label(strategy),
            _ => format!("{} #{}", opts.label(strategy), round + 1),
        };
        if strategy.disaggregates() && opts.pd_prefill == 0 {
            let why = "the fleet has no prefill pods (--pd-prefill)";
            out.runs.push(StrategyRun::skipped(label, why.into()));
            continue;
        }
        let redis = if strategy.needs_redis() {
            match deploy::find_redis_server() {
                Ok(bin) => Some(bin),
                Err(e) => {
                    let why = format!("{e:#}");
                    eprintln!("kv-bench: {label}: skipped ({why})");
                    out.runs.push(StrategyRun::skipped(label, why));
                    continue;
                }
            }
        } else {
            None
        };
        deploy::reset_caches(&addrs)
            .await
            .context("resetting pod caches")?;
        // Routers, their Envoy and Redis live only for this strategy (dropping them stops them).
        let mut stack: Option<Stack> = None;
        // Round robin needs no router: Envoy's own round robin is the baseline.
        let target = match strategy {
            Strategy::RoundRobin => fleet.rr_envoy.url(),
            _ => {
                let s = Stack::start_behind(
                    bins,
                    &fleet,
                    strategy.router_config(&base, &opts.model),
                    opts.replicas(strategy),
                    redis.as_deref(),
                    strategy.envoy_template(),
                )
                .await
                .with_context(|| format!("starting {label}"))?;
                let url = s.envoy_url();
                stack = Some(s);
                url
            }
        };
        let roles = fleet.roles();
        let before = match opts.pd_prefill {
            0 => None,
            _ => Some(pd_report::scrape(&roles).await?),
        };
        let w = workload();
        let cpu_before = stack.as_ref().and_then(Stack::cpu_seconds);
        if opts.progress {
            eprintln!(
                "kv-bench: {label} ({} requests) through {}",
                w.requests, target
            );
        }
        let run = runner::run(
            w,
            &RunOptions {
                target,
                concurrency,
                request_timeout: opts.request_timeout,
                label: label.clone(),
                progress: opts.progress,
            },
        )
        .await?;
        let cpu = match (cpu_before, stack.as_ref().and_then(Stack::cpu_seconds)) {
            (Some(a), Some(b)) => Some(b - a),
            _ => None,
        };
        let (counters, fallbacks) = match &stack {
            Some(s) => s.redis_counters().await.unzip(),
            None => (None, None),
        };
        let counters = counters.unwrap_or_default();
        if opts.progress {
            for line in &counters {
                eprintln!("kv-bench: {label}: {line}");
            }
        }
        if let (Some(s), Some(dir)) = (&stack, &opts.router_metrics) {
            s.save_metrics(dir, &label).await?;
        }
        let pod_work = match before {
            Some(b) => Some(pd_report::scrape(&roles).await?.since(b)),
            None => None,
        };
        drop(stack);
        let fleet = Some((opts.pods, opts.gpu_blocks));
        let mut finished = StrategyRun::finished(label, run, fleet);
        finished.pod_work = pod_work;
        if let Some(s) = finished.summary.as_mut() {
            s.cpu_s = cpu;
        }
        finished.replica_counters = counters;
        finished.redis_fallbacks = fallbacks;
        out.runs.push(finished);
    }
    Ok(out)
}

/// Waits until a precise router has replayed every pod's KV-event buffer and applied it. The
/// pods live through the whole comparison, so their replay buffers (10,000 batches, as vLLM's)
/// hold every earlier strategy's runs: a router starting late in `make bench` replayed ~1.2 M
/// events of them while its own run was being measured, and precise's TTFT grew with its place
/// in the order (p50 314 → 334 → 354 ms over three rounds of six strategies). Only a complete
/// catch-up counts: one cut short leaves the rest to a gap replay during the run.
pub(crate) async fn wait_caught_up(
    router: &RouterProc,
    pods: usize,
    limit: Duration,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut last_applied = None;
    loop {
        let text = router
            .metrics()
            .await
            .context("reading a router's /metrics")?;
        let (done, applied) = catch_up_state(&text);
        if done >= pods && last_applied == Some(applied) {
            return Ok(());
        }
        last_applied = (done >= pods).then_some(applied);
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!(
                "the precise router completed {done} of {pods} pods' KV-event catch-ups in {limit:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// From a router's `/metrics`: pods whose catch-up replay completed, and the KV events applied
/// so far.
fn catch_up_state(metrics: &str) -> (usize, f64) {
    let mut done = std::collections::BTreeSet::new();
    let mut applied = 0.0;
    for line in metrics.lines() {
        let Some((name, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let value: f64 = value.parse().unwrap_or(0.0);
        if name.starts_with("kv_router_kv_events_applied_total") {
            applied += value;
        } else if name.starts_with("kv_router_kv_event_replays_total{")
            && name.contains("type=\"complete\"")
            && value >= 1.0
        {
            if let Some(pod) = name
                .split("pod=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
            {
                done.insert(pod.to_string());
            }
        }
    }
    (done.len(), applied)
}

/// (round, strategy index) in run order: every round rotates the strategies by one, so over
/// `n` rounds each strategy runs once in every slot.
fn run_order(n: usize, rounds: usize) -> Vec<(usize, usize)> {
    (0..rounds)
        .flat_map(|r| (0..n).map(move |k| (r, (k + r) % n)))
        .collect()
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

/// `--scrape`: URLs (`/metrics` of routers and pods managed elsewhere) saved right before and
/// right after each endpoint's run, so the fleet's own counters can be compared over exactly
/// that run (e.g. each router's decisions per pod against each pod's served requests).
#[derive(Debug, Clone, Default)]
pub struct Scrapes {
    /// `(name, URL)` pairs.
    pub targets: Vec<(String, String)>,
    /// Where the files go (nothing is fetched without it).
    pub dir: Option<PathBuf>,
}

/// `s` usable in a file name: every character outside `A-Za-z0-9._-` becomes `_`.
fn file_safe(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

impl Scrapes {
    /// The file of target `name` for the run `label`, `when` = `before` or `after`.
    pub fn path(dir: &std::path::Path, label: &str, name: &str, when: &str) -> PathBuf {
        dir.join(format!(
            "{}.{}.{when}.prom",
            file_safe(label),
            file_safe(name)
        ))
    }

    /// Fetches every target and writes its body; any failure fails the comparison, since a
    /// check over a missing scrape would compare nothing.
    async fn save(&self, label: &str, when: &str) -> Result<()> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        if self.targets.is_empty() {
            return Ok(());
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let client = runner::client();
        for (name, url) in &self.targets {
            let resp = client
                .get(url)
                .timeout(Duration::from_secs(10))
                .send()
                .await
                .with_context(|| format!("--scrape {name}: GET {url}"))?;
            anyhow::ensure!(
                resp.status().is_success(),
                "--scrape {name}: GET {url} answered {}",
                resp.status()
            );
            let text = resp
                .text()
                .await
                .with_context(|| format!("--scrape {name}: reading {url}"))?;
            let path = Self::path(dir, label, name, when);
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}

/// Runs `workload()` once against each `(label, base URL)` of deployments managed elsewhere
/// ("pointed at" mode). Pod caches are reset between runs through `reset_pods` (vLLM's
/// `POST /reset_prefix_cache`) when given; `scrapes` are saved around each run. The report
/// describes the fleet it measured: pods and blocks per pod as given, else from the
/// `reset_pods` (their count, their `/metrics`), else the pods seen in responses; with blocks
/// per pod unknown, no oracle is computed.
pub async fn compare_endpoints(
    endpoints: &[(String, String)],
    reset_pods: &[SocketAddr],
    scrapes: &Scrapes,
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
        scrapes.save(label, "before").await?;
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
        scrapes.save(label, "after").await?;
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
        .map(|(label, run)| StrategyRun::finished(label, run, pods.zip(gpu_blocks)))
        .collect();
    Ok(Comparison {
        workload: workload_name,
        description,
        pods,
        gpu_blocks,
        fleet,
        runs,
        pd_prefill: 0,
    })
}

#[cfg(test)]
#[path = "compare_tests.rs"]
mod tests;
