//! `kv-bench failover`: a rolling restart of every kv-router replica in the middle of a steady
//! multi-turn chat load through Envoy, and what it costs: the pods' prefix-cache hit ratio and
//! TTFT p50/p99 in the window after the first replica goes down against the window before it.
//! One arm per way a replica may come back: the memory index warm from its live peers
//! (`index.warm_start`), the memory index cold (empty), and the shared Redis index (its mirror
//! reloads from Redis). Each arm gets a fresh fleet's caches and its own replicas.
//!
//! A replica is killed (SIGKILL: Envoy fails its open streams open, as with any crash) and started
//! again on its ports, then the next one once it is ready, as a rolling update with
//! `maxUnavailable: 1` replaces them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::Serialize;
use tokio::time::Instant;

use super::compare::{envoy_options, CompareFleet, CompareOptions};
use super::strategy::Strategy;
use super::table::{Style, Table};
use kv_router::config::{Config, IndexBackend};
use kv_testkit::deploy::{self, Binaries, EnvoyOptions, EnvoyProc, RedisProc, RouterProc};
use kv_testkit::runner::{self, RequestRecord, RunOptions};
use kv_testkit::workload::{MultiturnSpec, PlannedRequest, Previous, Session, Workload};

/// How a restarted replica comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Arm {
    /// Memory index, taken from the live peers at start (`index.warm_start.peers`).
    MemoryWarm,
    /// Memory index, empty at start.
    MemoryCold,
    /// The shared Redis index (`lookups: mirror`): the mirror reloads from Redis.
    Redis,
}

impl Arm {
    fn name(self) -> &'static str {
        match self {
            Arm::MemoryWarm => "memory, warm",
            Arm::MemoryCold => "memory, cold",
            Arm::Redis => "redis (mirror)",
        }
    }
}

/// `kv-bench failover` flags.
#[derive(Debug, Clone, Args)]
pub struct FailoverArgs {
    /// Arms, in run order.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "memory-warm,memory-cold,redis"
    )]
    pub arms: Vec<Arm>,
    /// Simulated pods.
    #[arg(long, default_value_t = 4)]
    pub pods: usize,
    /// KV blocks (16 tokens) per pod.
    #[arg(long, default_value_t = 4096)]
    pub gpu_blocks: usize,
    /// kv-router replicas behind Envoy, all restarted in turn.
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// Seconds of load before the measured window before the restart.
    #[arg(long, default_value_t = 30)]
    pub warmup_s: u64,
    /// Seconds of each measured window (before the restart, and from its start on).
    #[arg(long, default_value_t = 60)]
    pub window_s: u64,
    /// Conversations in flight (closed loop); each has 10 turns, new ones start as others end.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Seed of the conversations.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Envoy binary (default: the usual search).
    #[arg(long)]
    pub envoy: Option<std::path::PathBuf>,
}

/// Requests in one window and what they got.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Window {
    /// Requests sent in the window that completed.
    pub requests: usize,
    /// Requests sent in it that failed.
    pub errors: usize,
    /// Cached prompt tokens / prompt tokens, %.
    pub hit_pct: f64,
    /// TTFT median, ms.
    pub ttft_p50_ms: f64,
    /// TTFT 99th percentile, ms.
    pub ttft_p99_ms: f64,
}

impl Window {
    /// The records sent in `[from_ms, to_ms)` of the run.
    pub fn of(records: &[RequestRecord], from_ms: f64, to_ms: f64) -> Self {
        let inside: Vec<&RequestRecord> = records
            .iter()
            .filter(|r| r.start_ms >= from_ms && r.start_ms < to_ms)
            .collect();
        let ok: Vec<&&RequestRecord> = inside.iter().filter(|r| r.error.is_none()).collect();
        let prompt: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
        let cached: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
        let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
        ttft.sort_by(f64::total_cmp);
        let q = |f: f64| match ttft.len() {
            0 => 0.0,
            n => ttft[((n as f64 * f).ceil() as usize).clamp(1, n) - 1],
        };
        Self {
            requests: ok.len(),
            errors: inside.len() - ok.len(),
            hit_pct: 100.0 * cached as f64 / prompt.max(1) as f64,
            ttft_p50_ms: q(0.5),
            ttft_p99_ms: q(0.99),
        }
    }
}

/// One arm's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct ArmResult {
    /// The arm.
    pub arm: Arm,
    /// Seconds from the first replica killed to the last one ready again.
    pub restart_s: f64,
    /// The window before the first kill.
    pub before: Window,
    /// The window from the first kill on.
    pub after: Window,
    /// Warm starts the replicas counted at their restarts (`kv_router_warm_starts_total`).
    pub warm_starts: u64,
}

impl ArmResult {
    /// Hit-ratio points lost after the restart (negative: gained).
    pub fn hit_lost(&self) -> f64 {
        self.before.hit_pct - self.after.hit_pct
    }
}

/// Stops handing out requests once `stop` is set (a steady load of unbounded length).
struct Until {
    inner: Box<dyn Session>,
    stop: Arc<AtomicBool>,
}

impl Session for Until {
    fn id(&self) -> &str {
        self.inner.id()
    }

    fn next_request(&mut self, previous: Option<Previous<'_>>) -> Option<PlannedRequest> {
        if self.stop.load(Ordering::Relaxed) {
            return None;
        }
        self.inner.next_request(previous)
    }
}

/// Conversations enough for the whole run, each with its own document after one shared system
/// prompt, no session id (the index alone keeps a conversation on its pod).
fn workload(args: &FailoverArgs, stop: &Arc<AtomicBool>) -> Workload {
    let spec = MultiturnSpec {
        sessions: 2_000,
        turns: 10,
        system_bytes: 4 * 1024,
        question_bytes: (200, 400),
        max_tokens: 16,
        seed: args.seed,
        think_ms: (300, 1_500),
        document_bytes: (4_000, 12_000),
        session_header: false,
        ..MultiturnSpec::default()
    };
    let mut w = spec.build();
    w.sessions = std::mem::take(&mut w.sessions)
        .into_iter()
        .map(|inner| {
            Box::new(Until {
                inner,
                stop: stop.clone(),
            }) as Box<dyn Session>
        })
        .collect();
    w
}

/// The replicas of one arm behind one Envoy, restartable on their ports.
struct Replicas {
    cfgs: Vec<Config>,
    routers: Vec<Option<RouterProc>>,
    envoy: EnvoyProc,
    _redis: Option<RedisProc>,
}

impl Replicas {
    async fn start(bins: &Binaries, fleet: &CompareFleet, arm: Arm, n: usize) -> Result<Self> {
        let mut base = fleet.base_config()?;
        // The approximate index either way: what a restart can lose.
        base.kv_events.enabled = false;
        let redis = match arm {
            Arm::Redis => {
                let r = RedisProc::start(&deploy::find_redis_server()?)?;
                base.index.backend = IndexBackend::Redis;
                base.index.redis.url = r.url();
                base.index.redis.key_prefix = "kv-bench".into();
                Some(r)
            }
            _ => None,
        };
        let mut cfgs: Vec<Config> = (0..n.max(1))
            .map(|_| -> Result<Config> {
                let mut c = base.clone();
                c.listen.grpc = format!("127.0.0.1:{}", deploy::free_port()?);
                c.listen.admin = format!("127.0.0.1:{}", deploy::free_port()?);
                Ok(c)
            })
            .collect::<Result<_>>()?;
        if arm == Arm::MemoryWarm {
            let admins: Vec<String> = cfgs.iter().map(|c| c.listen.admin.clone()).collect();
            for (i, c) in cfgs.iter_mut().enumerate() {
                c.index.warm_start.peers = (0..admins.len())
                    .filter(|&j| j != i)
                    .map(|j| admins[j].clone())
                    .collect();
            }
        }
        let mut routers = Vec::new();
        for c in &mut cfgs {
            let r = spawn_ready(bins, c, fleet.addrs().len()).await?;
            // spawn may have moved to fresh ports; restarts reuse the ones it got.
            c.listen.grpc = r.grpc.to_string();
            c.listen.admin = r.admin.to_string();
            routers.push(Some(r));
        }
        let grpc: Vec<_> = routers.iter().flatten().map(|r| r.grpc).collect();
        let envoy = EnvoyProc::spawn_with(
            &fleet.envoy_bin,
            &deploy::envoy_template("override-host-buffered.yaml")?,
            Some(grpc[0]),
            &fleet.addrs(),
            &EnvoyOptions {
                more_pickers: grpc[1..].to_vec(),
                ..envoy_options()
            },
        )
        .await?;
        Ok(Self {
            cfgs,
            routers,
            envoy,
            _redis: redis,
        })
    }

    /// Kills each replica and starts it again on its ports, one after the other.
    async fn rolling_restart(&mut self, bins: &Binaries, pods: usize) -> Result<()> {
        for i in 0..self.routers.len() {
            if let Some(mut r) = self.routers[i].take() {
                r.kill();
            }
            let r = spawn_ready(bins, &self.cfgs[i], pods).await?;
            if r.grpc.to_string() != self.cfgs[i].listen.grpc {
                bail!("replica {i} came back on another port: Envoy cannot reach it");
            }
            self.routers[i] = Some(r);
        }
        Ok(())
    }

    /// `kv_router_warm_starts_total{result="warm"}` summed over the replicas.
    async fn warm_starts(&self) -> u64 {
        let mut n = 0;
        for r in self.routers.iter().flatten() {
            let text = r.metrics().await.unwrap_or_default();
            n += text
                .lines()
                .filter(|l| l.starts_with("kv_router_warm_starts_total{result=\"warm\"}"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>() as u64;
        }
        n
    }
}

async fn spawn_ready(bins: &Binaries, cfg: &Config, pods: usize) -> Result<RouterProc> {
    let r = RouterProc::spawn(&bins.kv_router, cfg).await?;
    r.wait_pods_ready(pods, Duration::from_secs(30)).await?;
    Ok(r)
}

/// Runs every arm.
pub async fn run(bins: &Binaries, args: &FailoverArgs) -> Result<Vec<ArmResult>> {
    let opts = CompareOptions {
        strategies: vec![Strategy::Weighted],
        ..CompareOptions::fleet(
            args.envoy.clone(),
            args.pods.max(1),
            args.gpu_blocks,
            Vec::new(),
            "sim-model".into(),
        )
    };
    let fleet = CompareFleet::start(bins, &opts).await?;
    let mut out = Vec::new();
    for &arm in &args.arms {
        deploy::reset_caches(&fleet.addrs())
            .await
            .context("resetting pod caches")?;
        let mut replicas = Replicas::start(bins, &fleet, arm, args.replicas)
            .await
            .with_context(|| format!("starting {}", arm.name()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let run_opts = RunOptions {
            target: replicas.envoy.url(),
            concurrency: Some(args.concurrency.max(1)),
            request_timeout: opts.request_timeout,
            label: arm.name().into(),
            progress: false,
        };
        let load = runner::run(workload(args, &stop), &run_opts);
        let started = Instant::now();
        let window = Duration::from_secs(args.window_s.max(1));
        let drive = async {
            tokio::time::sleep(Duration::from_secs(args.warmup_s) + window).await;
            let killed = started.elapsed();
            eprintln!("kv-bench failover: {}: rolling restart", arm.name());
            let restarted = replicas.rolling_restart(bins, args.pods).await;
            let ready = started.elapsed();
            if restarted.is_ok() {
                tokio::time::sleep((killed + window).saturating_sub(started.elapsed())).await;
            }
            // The load ends either way: a failed restart must not leave it running to the end.
            stop.store(true, Ordering::Relaxed);
            restarted.map(|()| (killed, ready))
        };
        let (run, times) = tokio::join!(load, drive);
        let ((killed, ready), run) = (times?, run?);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let kill_ms = ms(killed);
        let window_ms = ms(window);
        out.push(ArmResult {
            arm,
            restart_s: ready.saturating_sub(killed).as_secs_f64(),
            before: Window::of(&run.records, kill_ms - window_ms, kill_ms),
            after: Window::of(&run.records, kill_ms, kill_ms + window_ms),
            warm_starts: replicas.warm_starts().await,
        });
    }
    Ok(out)
}

/// The results as a table.
pub fn table(results: &[ArmResult], style: Style) -> String {
    let mut t = Table::new([
        "arm",
        "restart",
        "warm starts",
        "hit before",
        "hit after",
        "lost (points)",
        "TTFT p50 before",
        "after",
        "TTFT p99 before",
        "after",
        "requests before / after",
        "errors",
    ]);
    for r in results {
        t.row(vec![
            r.arm.name().to_string(),
            format!("{:.1} s", r.restart_s),
            r.warm_starts.to_string(),
            format!("{:.1} %", r.before.hit_pct),
            format!("{:.1} %", r.after.hit_pct),
            format!("{:.1}", r.hit_lost()),
            format!("{:.0} ms", r.before.ttft_p50_ms),
            format!("{:.0} ms", r.after.ttft_p50_ms),
            format!("{:.0} ms", r.before.ttft_p99_ms),
            format!("{:.0} ms", r.after.ttft_p99_ms),
            format!("{} / {}", r.before.requests, r.after.requests),
            (r.before.errors + r.after.errors).to_string(),
        ]);
    }
    t.render(style)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(start_ms: f64, prompt: u64, cached: u64, ttft: f64, ok: bool) -> RequestRecord {
        RequestRecord {
            session: "s".into(),
            turn: 0,
            start_ms,
            ttft_ms: Some(ttft),
            e2e_ms: ttft,
            status: Some(if ok { 200 } else { 500 }),
            error: (!ok).then(|| "HTTP 500".into()),
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
            completion_tokens: Some(1),
            pod: None,
            headers_ms: None,
        }
    }

    #[test]
    fn a_window_counts_the_requests_sent_in_it_and_their_hits_and_ttft() {
        let records: Vec<RequestRecord> = (0..100)
            .map(|i| rec(i as f64 * 10.0, 100, 50, (i + 1) as f64, true))
            .chain([rec(5.0, 100, 0, 1_000.0, false)])
            .collect();
        let w = Window::of(&records, 0.0, 500.0);
        assert_eq!((w.requests, w.errors), (50, 1));
        assert_eq!(w.hit_pct, 50.0);
        assert_eq!((w.ttft_p50_ms, w.ttft_p99_ms), (25.0, 50.0));
        assert_eq!(Window::of(&records, 2_000.0, 3_000.0), Window::default());
    }

    #[test]
    fn the_report_has_a_row_per_arm_with_the_points_lost() {
        let before = Window {
            requests: 600,
            errors: 0,
            hit_pct: 80.0,
            ttft_p50_ms: 100.0,
            ttft_p99_ms: 400.0,
        };
        let after = Window {
            hit_pct: 78.5,
            ..before.clone()
        };
        let r = ArmResult {
            arm: Arm::MemoryWarm,
            restart_s: 3.0,
            before,
            after,
            warm_starts: 2,
        };
        let text = table(&[r], Style::Markdown);
        assert_eq!(text.lines().count(), 3, "{text}");
        let row = text.lines().nth(2).unwrap();
        for cell in [
            "memory, warm",
            "3.0 s",
            "80.0 %",
            "78.5 %",
            "1.5",
            "600 / 600",
        ] {
            assert!(row.contains(cell), "{cell} missing: {row}");
        }
    }
}
