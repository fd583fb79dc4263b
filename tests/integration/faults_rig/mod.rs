//! The fault runs' rig (shared by `faults.rs` and `faults_streams.rs`): closed-loop load through
//! Envoy with every outcome recorded, and a deployment whose routers can be killed, stopped and
//! restarted on the same ports.
#![allow(dead_code, unused_imports)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::deploy::{self, EnvoyOptions, EnvoyProc, RouterProc, SimPod};
use crate::common::{bins, chat_stream, completion, envoy_bin, metric, text, FAST_SIM};
use futures::StreamExt;
use kv_router::config::Config;
use parking_lot::Mutex;
use serde_json::Value;

pub(crate) const BUFFERED: &str = "override-host-buffered.yaml";
pub(crate) const FULL_DUPLEX: &str = "gie-full-duplex.yaml";
/// How long any polled condition may take on a loaded 2-core machine.
pub(crate) const POLL: Duration = Duration::from_secs(10);
/// Every test must finish within this: a fault run is bounded in time.
pub(crate) const TEST_BUDGET: Duration = Duration::from_secs(30);

/// Fails a fault run that took longer than [`TEST_BUDGET`].
pub(crate) fn assert_within_budget(started: Instant) {
    assert!(
        started.elapsed() < TEST_BUDGET,
        "took {:?}",
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------------------------
// Polling.

/// Polls `cond` every 25 ms until it returns `Some`, or panics after `timeout` with `what` and
/// the last `diag()`.
pub(crate) async fn wait_for<T, F, Fut>(
    what: &str,
    timeout: Duration,
    diag: impl Fn() -> String,
    cond: F,
) -> T
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = cond().await {
            return v;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}{}", diag());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

pub(crate) async fn get_text(client: &reqwest::Client, url: &str) -> Option<String> {
    client.get(url).send().await.ok()?.text().await.ok()
}

pub(crate) async fn get_json(client: &reqwest::Client, url: &str) -> Option<Value> {
    client.get(url).send().await.ok()?.json().await.ok()
}

/// One counter or gauge of Envoy's `/stats` text (`name: value`).
pub(crate) fn envoy_stat(stats: &str, name: &str) -> u64 {
    stats
        .lines()
        .find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(": ")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Load.

/// One request of a load run.
#[derive(Debug, Clone)]
pub(crate) struct Rec {
    pub(crate) start: Instant,
    pub(crate) end: Instant,
    pub(crate) ok: bool,
    pub(crate) status: Option<u16>,
    pub(crate) pod: Option<String>,
    pub(crate) error: Option<String>,
    pub(crate) body: String,
}

/// Closed-loop load: `workers` tasks sending one request after another to an Envoy listener
/// until stopped (at most `MAX_PER_WORKER` each), every outcome recorded with its timing.
pub(crate) struct Load {
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) recs: Arc<Mutex<Vec<Rec>>>,
    pub(crate) tasks: Vec<tokio::task::JoinHandle<()>>,
}

pub(crate) const MAX_PER_WORKER: usize = 2_000;

/// What the load sends: a completion of a fresh ~1.2 KB prompt (so the router spreads by load),
/// or a streamed chat of the same shape.
#[derive(Clone, Copy)]
pub(crate) enum Traffic {
    Completion { max_tokens: u32 },
    StreamedChat { max_tokens: u32 },
}

impl Load {
    pub(crate) fn start(base: String, workers: usize, seed: u64, kind: Traffic) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let recs = Arc::new(Mutex::new(Vec::new()));
        let next = Arc::new(AtomicU64::new(0));
        let client = crate::common::runner::client();
        let tasks = (0..workers)
            .map(|_| {
                let (stop, recs, next, client, base) = (
                    stop.clone(),
                    recs.clone(),
                    next.clone(),
                    client.clone(),
                    base.clone(),
                );
                tokio::spawn(async move {
                    for _ in 0..MAX_PER_WORKER {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let prompt =
                            format!("Request {seed}/{i}. {}", text(seed * 100_000 + i, 1200));
                        let (path, body) = match kind {
                            Traffic::Completion { max_tokens } => {
                                ("/v1/completions", completion(&prompt, max_tokens))
                            }
                            Traffic::StreamedChat { max_tokens } => (
                                "/v1/chat/completions",
                                chat_stream(&prompt, "Summarize.", max_tokens),
                            ),
                        };
                        let start = Instant::now();
                        let o = crate::common::runner::stream_request(
                            &client,
                            &format!("{base}{path}"),
                            &body,
                            &[],
                            Duration::from_secs(10),
                        )
                        .await;
                        recs.lock().push(Rec {
                            start,
                            end: Instant::now(),
                            ok: o.ok(),
                            status: o.status,
                            pod: o.pod().map(str::to_string),
                            error: o.error.clone(),
                            body: o.body.chars().take(300).collect(),
                        });
                    }
                })
            })
            .collect();
        Self { stop, recs, tasks }
    }

    pub(crate) fn snapshot(&self) -> Vec<Rec> {
        self.recs.lock().clone()
    }

    /// Waits until `n` requests that started at or after `since` succeeded (`pod`: served by it).
    pub(crate) async fn wait_ok(
        &self,
        what: &str,
        n: usize,
        since: Instant,
        pod: Option<&str>,
        diag: impl Fn() -> String,
    ) {
        wait_for(
            what,
            POLL,
            || format!("\nload so far: {}{}", summary(&self.snapshot()), diag()),
            || async {
                let got = self
                    .recs
                    .lock()
                    .iter()
                    .filter(|r| {
                        r.ok && r.start >= since && pod.is_none_or(|p| r.pod.as_deref() == Some(p))
                    })
                    .count();
                (got >= n).then_some(())
            },
        )
        .await
    }

    pub(crate) async fn finish(self) -> Vec<Rec> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("load worker");
        }
        let recs = self.recs.lock().clone();
        recs
    }
}

/// Requests, failures and requests per pod, for messages.
pub(crate) fn summary(recs: &[Rec]) -> String {
    let mut per_pod: BTreeMap<String, usize> = BTreeMap::new();
    for r in recs.iter().filter(|r| r.ok) {
        *per_pod
            .entry(r.pod.clone().unwrap_or_default())
            .or_default() += 1;
    }
    let failed: Vec<&Rec> = recs.iter().filter(|r| !r.ok).collect();
    let first = failed
        .first()
        .map(|r| {
            format!(
                "; first failure: status {:?} error {:?} body {:?}",
                r.status, r.error, r.body
            )
        })
        .unwrap_or_default();
    format!(
        "{} requests, {} failed, served per pod {per_pod:?}{first}",
        recs.len(),
        failed.len()
    )
}

#[track_caller]
pub(crate) fn assert_no_failure(recs: &[Rec], what: &str, diag: &str) {
    let failed = recs.iter().filter(|r| !r.ok).count();
    assert_eq!(failed, 0, "{what}: {}{diag}", summary(recs));
}

// ---------------------------------------------------------------------------------------------
// A deployment whose routers can be killed, stopped and restarted on the same ports.

pub(crate) struct Rig {
    pub(crate) pods: Vec<SimPod>,
    pub(crate) cfgs: Vec<Config>,
    pub(crate) routers: Vec<Option<RouterProc>>,
    pub(crate) envoys: Vec<EnvoyProc>,
    pub(crate) client: reqwest::Client,
}

impl Rig {
    /// `pods` fast pods, `replicas` kv-routers over them (fast probes, `tweak`ed), and one Envoy
    /// per template with every replica in its `kv_router` cluster.
    pub(crate) async fn start(
        pods: usize,
        replicas: usize,
        templates: &[&str],
        tweak: impl Fn(&mut Config),
    ) -> Self {
        let envoy = envoy_bin();
        let b = bins();
        let args: Vec<String> = FAST_SIM.iter().map(|s| s.to_string()).collect();
        let pods: Vec<SimPod> = (0..pods)
            .map(|_| SimPod::spawn(&b.vllm_sim, &args).expect("start vllm-sim"))
            .collect();
        let addrs: Vec<SocketAddr> = pods.iter().map(|p| p.addr).collect();
        let mut cfgs = Vec::new();
        let mut routers = Vec::new();
        for _ in 0..replicas {
            let mut cfg = deploy::local_router_config(&addrs).expect("router config");
            // Sequential fast requests look like a burst to the hot-pod gate (see tests/integration/common).
            cfg.gate.hot_abs = 16.0;
            tweak(&mut cfg);
            let r = RouterProc::spawn(&b.kv_router, &cfg)
                .await
                .expect("start kv-router");
            r.wait_pods_ready(addrs.len(), POLL)
                .await
                .unwrap_or_else(|e| panic!("{e:#}\nrouter stderr:\n{}", r.stderr_tail(40)));
            // spawn may have moved to fresh ports; restarts reuse the ones it got.
            cfg.listen.grpc = r.grpc.to_string();
            cfg.listen.admin = r.admin.to_string();
            cfgs.push(cfg);
            routers.push(Some(r));
        }
        let mut envoys = Vec::new();
        for t in templates {
            let opts = EnvoyOptions {
                more_pickers: routers[1..].iter().flatten().map(|r| r.grpc).collect(),
                ..Default::default()
            };
            let path = deploy::envoy_template(t).expect("template");
            envoys.push(
                EnvoyProc::spawn_with(
                    &envoy,
                    &path,
                    Some(routers[0].as_ref().unwrap().grpc),
                    &addrs,
                    &opts,
                )
                .await
                .unwrap_or_else(|e| panic!("start Envoy with {t}: {e:#}")),
            );
        }
        Self {
            pods,
            cfgs,
            routers,
            envoys,
            client: crate::common::runner::client(),
        }
    }

    pub(crate) fn router(&self, i: usize) -> &RouterProc {
        self.routers[i].as_ref().expect("router running")
    }

    pub(crate) fn diag(&self) -> String {
        let mut s = String::new();
        for (i, r) in self.routers.iter().enumerate() {
            if let Some(r) = r {
                s.push_str(&format!(
                    "\n--- kv-router {i} stderr (tail) ---\n{}",
                    r.stderr_tail(30)
                ));
            }
        }
        for e in &self.envoys {
            s.push_str(&format!(
                "\n--- envoy {} stderr (tail) ---\n{}",
                e.listen,
                e.stderr_tail(20)
            ));
        }
        s
    }

    pub(crate) async fn metrics(&self, i: usize) -> String {
        self.router(i)
            .metrics()
            .await
            .unwrap_or_else(|e| panic!("router {i} /metrics: {e:#}{}", self.diag()))
    }

    /// Starts router `i` again on its old ports (a restarted Deployment pod behind the same
    /// Service address) and waits until it sees every pod.
    pub(crate) async fn restart(&mut self, i: usize) {
        assert!(self.routers[i].is_none(), "router {i} still running");
        let cfg = self.cfgs[i].clone();
        let b = bins();
        let r = RouterProc::spawn(&b.kv_router, &cfg)
            .await
            .expect("restart kv-router");
        assert_eq!(
            r.grpc.to_string(),
            cfg.listen.grpc,
            "router {i} came back on another gRPC port (the old one was still taken): Envoy cannot reach it"
        );
        r.wait_pods_ready(self.pods.len(), POLL)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\nrouter stderr:\n{}", r.stderr_tail(40)));
        self.routers[i] = Some(r);
    }

    /// SIGTERM to router `i`, then waits for its exit (it must exit 0 within its grace + 5 s).
    pub(crate) async fn terminate(&mut self, i: usize) -> Duration {
        let grace = Duration::from_millis(self.cfgs[i].server.shutdown_grace_ms);
        let mut r = self.routers[i].take().expect("router running");
        let pid = rustix::process::Pid::from_raw(r.process().pid().expect("running") as i32)
            .expect("a child's pid is positive");
        let sent = Instant::now();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM)
            .expect("kill(2) our own child");
        let status = loop {
            if let Some(s) = r.process().exited() {
                break s;
            }
            assert!(
                sent.elapsed() < grace + Duration::from_secs(5),
                "router {i} still running {:?} after SIGTERM (grace {grace:?}):\n{}",
                sent.elapsed(),
                r.stderr_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(
            status.success(),
            "router {i} exited with {status}:\n{}",
            r.stderr_tail(30)
        );
        sent.elapsed()
    }
}
