//! Two kv-router replicas sharing one real Redis/Valkey (random port), both endpoints of the
//! `kv_router` cluster of the real Envoy 1.40 (BUFFERED bootstrap), in front of real vllm-sim
//! pods: the shared index makes N replicas route like one, and a Redis that dies, comes back or
//! stalls never fails a client request.
//!
//! Envoy round-robins ext_proc streams over the replicas, so consecutive requests are decided by
//! different replicas; every test checks from each replica's own `/metrics` that both decided.
//! No Redis server, no Envoy: the tests fail, they never skip.
//!
//! Run: `KV_ROUTER_ENVOY=/path/to/envoy cargo test --release --test integration redis_replicas::`

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::deploy::{
    self, find_redis_server, free_port, redis_command, EnvoyOptions, EnvoyProc, RedisProc,
    RouterProc, SimPod,
};
use common::runner::StreamOutcome;
use common::{bins, completion, envoy_bin, matched, metric, post_to, served_by, text, FAST_SIM};
use kv_router::config::{Config, IndexBackend, RedisLookups, TokenizerConfig};
use serde_json::{json, Value};

const BUFFERED: &str = "override-host-buffered.yaml";
/// How long any polled condition may take on a loaded CI machine.
const POLL: Duration = Duration::from_secs(10);

/// The affinity tests are about what the replicas share, not the latency budget (the fault test
/// keeps the 5 ms default): a lookup slowed past 5 ms by a loaded CI machine would fall back to
/// the replica's own index, by design, and move a conversation.
fn roomy_budget(c: &mut Config) {
    c.index.redis.lookup_budget_ms = 250;
}

fn redis_bin() -> PathBuf {
    find_redis_server().unwrap_or_else(|e| panic!("these tests need a Redis/Valkey server: {e:#}"))
}

/// A Redis server of the tests: first from the harness (random port), after a crash restarted
/// here on the same port, as a Kubernetes Service address would stay the same.
enum Redis {
    Harness(RedisProc),
    Restarted(Restarted),
}

/// A redis-server started on a fixed port; killed on drop (and with the test process).
struct Restarted {
    child: Child,
}

impl Drop for Restarted {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Redis {
    fn kill(&mut self) {
        match self {
            Redis::Harness(r) => r.kill(),
            Redis::Restarted(r) => {
                let _ = r.child.kill();
                let _ = r.child.wait();
            }
        }
    }

    /// Starts a fresh server on `addr`'s port (the old one must be dead); retries while the
    /// port is still held.
    fn restart_on(bin: &Path, addr: SocketAddr, dir: &Path) -> Self {
        let deadline = Instant::now() + POLL;
        loop {
            // The harness's server flags (src/bench/deploy/redis.rs), on the old port.
            let mut cmd = Command::new(bin);
            cmd.args(["--port", &addr.port().to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
                .args(["--enable-debug-command", "yes"])
                .arg("--dir")
                .arg(dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            deploy::die_with_parent(&mut cmd);
            let mut child = cmd
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
            let until = Instant::now() + Duration::from_secs(3);
            while Instant::now() < until {
                if redis_command(addr, &["PING"]).is_ok_and(|r| r == "+PONG") {
                    return Redis::Restarted(Restarted { child });
                }
                if child.try_wait().ok().flatten().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
            assert!(Instant::now() < deadline, "cannot restart Redis on {addr}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// A pod, optionally publishing KV events on fixed ports.
struct Pod {
    sim: SimPod,
    events: Option<(u16, u16)>,
}

fn spawn_pod(with_events: bool) -> Pod {
    let b = bins();
    let mut last = String::new();
    for _ in 0..4 {
        let mut args: Vec<String> = FAST_SIM.iter().map(|s| s.to_string()).collect();
        let events = if with_events {
            let (ep, rp) = (free_port().unwrap(), free_port().unwrap());
            if ep == rp {
                continue;
            }
            args.extend([
                "--kv-events-endpoint".to_string(),
                format!("tcp://*:{ep}"),
                "--kv-events-replay-endpoint".to_string(),
                format!("tcp://*:{rp}"),
            ]);
            Some((ep, rp))
        } else {
            None
        };
        match SimPod::spawn(&b.vllm_sim, &args) {
            Ok(sim) => return Pod { sim, events },
            Err(e) => last = format!("{e:#}"),
        }
    }
    panic!("cannot start vllm-sim: {last}");
}

/// Two replicas on one Redis behind one Envoy, four pods.
struct Replicas {
    redis: std::sync::Mutex<Redis>,
    redis_addr: SocketAddr,
    pods: Vec<Pod>,
    routers: Vec<RouterProc>,
    envoy: EnvoyProc,
    client: reqwest::Client,
}

impl Replicas {
    /// `precise`: pods publish KV events and replica 0 (only) subscribes to them, so replica 1
    /// can learn them only through Redis. `tweak` adjusts both replicas' config.
    async fn start(precise: bool, tweak: impl Fn(&mut Config)) -> Self {
        let envoy_path = envoy_bin();
        let redis = RedisProc::start(&redis_bin()).unwrap_or_else(|e| panic!("{e:#}"));
        let redis_addr = redis.addr;
        let pods: Vec<Pod> = (0..4).map(|_| spawn_pod(precise)).collect();
        let addrs: Vec<SocketAddr> = pods.iter().map(|p| p.sim.addr).collect();
        let mut routers = Vec::new();
        for replica in 0..2 {
            let mut cfg = deploy::local_router_config(&addrs).expect("router config");
            cfg.index.backend = IndexBackend::Redis;
            cfg.index.redis.url = redis.url();
            cfg.index.redis.key_prefix = "replicas-test".into();
            // Sequential requests of fast pods look like a burst to the hot-pod gate (see
            // tests/integration/common): keep it out of the affinity under test.
            cfg.gate.hot_abs = 16.0;
            if precise {
                cfg.kv_events.enabled = true;
                cfg.kv_events.block_tokens = 16;
                let tok: TokenizerConfig =
                    serde_json::from_value(json!({"model": "sim-model", "builtin": true})).unwrap();
                cfg.tokenizers = vec![tok];
                if replica == 0 {
                    for (sp, p) in cfg.pods.static_pods.iter_mut().zip(&pods) {
                        let (ep, rp) = p.events.expect("event ports");
                        sp.kv_events_endpoint = Some(format!("tcp://127.0.0.1:{ep}"));
                        sp.kv_events_replay_endpoint = Some(format!("tcp://127.0.0.1:{rp}"));
                    }
                }
            }
            tweak(&mut cfg);
            let r = RouterProc::spawn(&bins().kv_router, &cfg)
                .await
                .expect("start kv-router");
            r.wait_pods_ready(addrs.len(), Duration::from_secs(15))
                .await
                .unwrap_or_else(|e| panic!("{e:#}\nrouter stderr:\n{}", r.stderr_tail(40)));
            routers.push(r);
        }
        let opts = EnvoyOptions {
            more_pickers: vec![routers[1].grpc],
            ..Default::default()
        };
        let envoy = EnvoyProc::spawn_with(
            &envoy_path,
            &deploy::envoy_template(BUFFERED).expect("template"),
            Some(routers[0].grpc),
            &addrs,
            &opts,
        )
        .await
        .unwrap_or_else(|e| panic!("start Envoy: {e:#}"));
        Self {
            redis: std::sync::Mutex::new(Redis::Harness(redis)),
            redis_addr,
            pods,
            routers,
            envoy,
            client: common::runner::client(),
        }
    }

    fn diag(&self) -> String {
        let mut s = String::new();
        for (i, r) in self.routers.iter().enumerate() {
            s.push_str(&format!(
                "\n--- kv-router replica {i} stderr (tail) ---\n{}",
                r.stderr_tail(30)
            ));
        }
        s.push_str(&format!(
            "\n--- envoy stderr (tail) ---\n{}",
            self.envoy.stderr_tail(20)
        ));
        s
    }

    async fn post(&self, prompt: &str) -> StreamOutcome {
        post_to(
            &self.client,
            &self.envoy.url(),
            "/v1/completions",
            &completion(prompt, 4),
            &[],
        )
        .await
    }

    /// Sends `prompt` straight to the pod at `addr`, bypassing Envoy and the routers.
    async fn direct(&self, addr: &str, prompt: &str) {
        let o = post_to(
            &self.client,
            &format!("http://{addr}"),
            "/v1/completions",
            &completion(prompt, 4),
            &[],
        )
        .await;
        served_by(&o, &self.diag());
    }

    async fn via_envoy(&self, prompt: &str) -> String {
        served_by(&self.post(prompt).await, &self.diag())
    }

    async fn metrics(&self, replica: usize) -> String {
        self.routers[replica]
            .metrics()
            .await
            .unwrap_or_else(|e| panic!("replica {replica} /metrics: {e:#}"))
    }

    /// Sum over both replicas of metric `name` with `labels`.
    async fn total(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut sum = 0.0;
        for i in 0..self.routers.len() {
            sum += metric(&self.metrics(i).await, name, labels);
        }
        sum
    }

    /// Asserts that each replica committed decisions and answered lookups from the shared index
    /// (`source`: `redis`, a round trip each, or `mirror`).
    async fn assert_both_decided_through(&self, source: &str) {
        for i in 0..self.routers.len() {
            let m = self.metrics(i).await;
            let decisions = metric(&m, "kv_router_decisions_total", &[]);
            let from_redis = metric(&m, "kv_router_redis_lookups_total", &[("source", source)]);
            assert!(
                decisions > 0.0 && from_redis > 0.0,
                "replica {i} made {decisions} decisions, {from_redis} lookups from {source}: Envoy \
                 did not spread the ext_proc streams or the replica did not use the shared index\n{}{}",
                redis_lines(&m),
                self.diag()
            );
        }
    }

    /// `POST /debug/explain` on replica `i`.
    async fn explain(&self, replica: usize, prompt: &str) -> Value {
        common::explain(&self.client, &self.routers[replica], &completion(prompt, 4)).await
    }
}

/// The largest bucket bound of histogram `name` not above `max`, and its cumulative count.
fn bucket_at_most(text: &str, name: &str, max: f64) -> (f64, f64) {
    let prefix = format!("{name}_bucket{{le=\"");
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, count) = rest.split_once("\"}")?;
            Some((le.parse::<f64>().ok()?, count.trim().parse::<f64>().ok()?))
        })
        .filter(|(le, _)| *le <= max)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap_or_else(|| panic!("no {name} bucket at most {max}"))
}

/// The `kv_router_redis_*` lines of a metrics text (for failure messages).
fn redis_lines(text: &str) -> String {
    text.lines()
        .filter(|l| l.starts_with("kv_router_redis_"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Turn `t` of conversation `c`: its own system prompt, then every earlier exchange, then the
/// new question (what a chat client resends each turn).
fn turn_prompt(c: u64, t: u64) -> String {
    let mut p = text(7_000 + c, 2_000);
    for i in 0..=t {
        p.push_str(&format!(
            "\nUser: {}\nAssistant: {}",
            text(c * 100 + i, 300),
            text(c * 100 + i + 50, 200)
        ));
    }
    p
}

#[tokio::test]
async fn a_conversation_stays_on_one_pod_whichever_replica_decides() {
    let d = Replicas::start(false, roomy_budget).await;
    let mut pods_of: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    // Sequential turns alternate between the replicas (Envoy's round robin over the cluster):
    // with in-process indexes only, each replica would pick a pod for a conversation on its
    // own and four conversations would all agree by chance with odds of about 1 in 256.
    for c in 0..4 {
        for t in 0..6 {
            let pod = d.via_envoy(&turn_prompt(c, t)).await;
            pods_of.entry(c).or_default().push(pod);
        }
    }
    for (c, pods) in &pods_of {
        let distinct: BTreeSet<_> = pods.iter().collect();
        assert_eq!(
            distinct.len(),
            1,
            "conversation {c} moved between pods {pods:?} although both replicas share Redis{}",
            d.diag()
        );
    }
    d.assert_both_decided_through("mirror").await;
    // Each decision's tokens counted on the other replica until its response started: every
    // load one replica published (with its release) was released on the other.
    for (i, j) in [(0, 1), (1, 0)] {
        let deadline = Instant::now() + POLL;
        loop {
            let published = metric(
                &d.metrics(i).await,
                "kv_router_redis_load_published_total",
                &[],
            );
            let released = metric(
                &d.metrics(j).await,
                "kv_router_redis_load_releases_total",
                &[],
            );
            if released > 0.0 && 2.0 * released == published {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "replica {j} released {released} of replica {i}'s loads ({published} loads and \
                 releases published)\n{}{}",
                redis_lines(&d.metrics(j).await),
                d.diag()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test]
async fn precise_replicas_agree_after_events() {
    // Replica 1 hears no KV events, so only Redis lookups can tell it (a mirror carries the
    // decisions, not event state: every mirrored replica subscribes to the events itself).
    let d = Replicas::start(true, |c| {
        roomy_budget(c);
        c.index.redis.lookups = RedisLookups::Redis;
    })
    .await;
    // The prompt reaches pod 2 directly (not through a router): only its KV events tell, and
    // only replica 0 hears them; replica 1 must learn them from Redis.
    let target = d.pods[2].sim.addr.to_string();
    let prompt = text(4_242, 4_096);
    d.direct(&target, &prompt).await;
    let probe = format!("{prompt} And a follow-up question: {}", text(4_243, 100));
    let deadline = Instant::now() + POLL;
    loop {
        let answers = [d.explain(0, &probe).await, d.explain(1, &probe).await];
        let agree = answers
            .iter()
            .all(|v| v["ranked"][0]["pod"] == target.as_str() && matched(v, &target) > 50);
        if agree {
            break;
        }
        if Instant::now() > deadline {
            panic!(
                "replicas do not agree that {target} holds the prompt; explain 0: {:#}\n\
                 explain 1: {:#}\nreplica 1:\n{}{}",
                answers[0],
                answers[1],
                redis_lines(&d.metrics(1).await),
                d.diag()
            );
        }
        // No resend: a cached prompt publishes nothing new. If the publication preceded replica
        // 0's subscription (it starts on a 500 ms tick), its catch-up replay brings it.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Through Envoy, whichever replica decides, follow-ups go where the KV blocks are.
    for i in 0..6 {
        let q = format!("{prompt} Question {i}: {}", text(4_300 + i, 120));
        assert_eq!(
            d.via_envoy(&q).await,
            target,
            "follow-up {i} left the pod holding the prefix{}",
            d.diag()
        );
    }
    d.assert_both_decided_through("redis").await;
}

/// Requests sent back to back (two at a time) until `stop`; returns every outcome.
fn background_load(
    d: &Arc<Replicas>,
    stop: &Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<StreamOutcome>> {
    let (d, stop) = (d.clone(), stop.clone());
    tokio::spawn(async move {
        let mut out = Vec::new();
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) && out.len() < 5_000 {
            let a = turn_prompt(100 + i % 8, i / 8 % 4);
            let b = turn_prompt(200 + i % 8, i / 8 % 4);
            let (x, y) = tokio::join!(d.post(&a), d.post(&b));
            out.extend([x, y]);
            i += 1;
        }
        out
    })
}

/// Polls `ok(total)` on the sum of `name{labels}` over both replicas until it holds.
async fn wait_total(
    d: &Replicas,
    what: &str,
    name: &str,
    labels: &[(&str, &str)],
    ok: impl Fn(f64) -> bool,
) -> f64 {
    let deadline = Instant::now() + POLL;
    loop {
        let v = d.total(name, labels).await;
        if ok(v) {
            return v;
        }
        if Instant::now() > deadline {
            panic!(
                "timed out waiting for {what} ({name}{labels:?} = {v}); replica 0:\n{}\nreplica 1:\n{}{}",
                redis_lines(&d.metrics(0).await),
                redis_lines(&d.metrics(1).await),
                d.diag()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn redis_killed_restarted_and_slowed_never_fails_a_request() {
    let started = Instant::now();
    let bin = redis_bin();
    let d = Arc::new(
        Replicas::start(false, |c| {
            // The round-trip mode's fail-open (the mirror's is the next test).
            c.index.redis.lookups = RedisLookups::Redis;
            // Come back to Redis quickly after a failure, so recovery fits the test's bounds.
            c.index.redis.retry_after_ms = 200;
        })
        .await,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let load = background_load(&d, &stop);
    const LOOKUPS: &str = "kv_router_redis_lookups_total";
    const FALLBACKS: &str = "kv_router_redis_fallbacks_total";
    wait_total(
        &d,
        "lookups answered by Redis",
        LOOKUPS,
        &[("source", "redis")],
        |v| v >= 4.0,
    )
    .await;

    // 1. Redis dies mid-run: lookups fall back (connection refused, then the retry pause).
    let fallbacks_before = d.total(FALLBACKS, &[]).await;
    let redis_addr = d.redis_addr;
    d.redis.lock().unwrap().kill();
    assert!(
        redis_command(redis_addr, &["PING"]).is_err(),
        "Redis still answers after the kill"
    );
    wait_total(&d, "fallbacks after the kill", FALLBACKS, &[], |v| {
        v >= fallbacks_before + 8.0
    })
    .await;
    let by_reason = d.total(FALLBACKS, &[("reason", "connection")]).await
        + d.total(FALLBACKS, &[("reason", "retry_wait")]).await;
    assert!(
        by_reason > 0.0,
        "fallbacks after a kill must say connection or retry_wait{}",
        d.diag()
    );

    // 2. Redis comes back on the same address: each replica returns to it by itself.
    let dir = tempfile::tempdir().expect("temp dir");
    *d.redis.lock().unwrap() = Redis::restart_on(&bin, redis_addr, dir.path());
    for i in 0..d.routers.len() {
        let before = metric(&d.metrics(i).await, LOOKUPS, &[("source", "redis")]);
        let deadline = Instant::now() + POLL;
        loop {
            let now = metric(&d.metrics(i).await, LOOKUPS, &[("source", "redis")]);
            if now > before {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "replica {i} never went back to Redis after the restart:\n{}{}",
                redis_lines(&d.metrics(i).await),
                d.diag()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // 3. Redis stalls (DEBUG SLEEP from another connection): lookups give up at the budget.
    let timeouts_before = d.total(FALLBACKS, &[("reason", "timeout")]).await;
    for _ in 0..3 {
        let sleeper =
            std::thread::spawn(move || redis_command(redis_addr, &["DEBUG", "SLEEP", "0.3"]));
        let deadline = Instant::now() + Duration::from_secs(1);
        while !sleeper.is_finished() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let reply = sleeper.join().expect("sleeper thread");
        assert_eq!(reply.as_deref().ok(), Some("+OK"), "DEBUG SLEEP: {reply:?}");
        if d.total(FALLBACKS, &[("reason", "timeout")]).await > timeouts_before {
            break;
        }
    }
    let timeouts = d.total(FALLBACKS, &[("reason", "timeout")]).await;
    assert!(
        timeouts > timeouts_before,
        "lookups during DEBUG SLEEP were not counted as timeouts\nreplica 0:\n{}{}",
        redis_lines(&d.metrics(0).await),
        d.diag()
    );

    stop.store(true, Ordering::Relaxed);
    let outcomes = load.await.expect("load task");
    let failed: Vec<_> = outcomes.iter().filter(|o| !o.ok()).collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed while Redis was killed, restarted and slowed; first: {:?} {:?}{}",
        failed.len(),
        outcomes.len(),
        failed[0].status,
        failed[0].error,
        d.diag()
    );
    eprintln!(
        "{} requests in {:?}; fallbacks: connection {}, retry_wait {}, timeout {}",
        outcomes.len(),
        started.elapsed(),
        d.total(FALLBACKS, &[("reason", "connection")]).await,
        d.total(FALLBACKS, &[("reason", "retry_wait")]).await,
        timeouts
    );
    // No decision waited for the stalled Redis: every one took well under the 300 ms stall.
    d.assert_both_decided_through("redis").await;
    assert_no_decision_waited(&d, started).await;
}

/// Whether replica `i` answers `/readyz` with 200.
async fn ready(d: &Replicas, i: usize) -> bool {
    let url = format!("{}/readyz", d.routers[i].admin_url());
    d.client
        .get(url)
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

#[tokio::test]
async fn mirrored_replicas_never_wait_on_a_killed_restarted_or_stalled_redis() {
    let started = Instant::now();
    let bin = redis_bin();
    let d = Arc::new(Replicas::start(false, |_| {}).await);
    let stop = Arc::new(AtomicBool::new(false));
    let load = background_load(&d, &stop);
    const LOOKUPS: &str = "kv_router_redis_lookups_total";
    const APPLIED: &str = "kv_router_redis_mirror_applied_total";
    const RELOADS: &str = "kv_router_redis_mirror_reloads_total";
    // Each replica applies the other's decisions.
    for i in 0..d.routers.len() {
        let deadline = Instant::now() + POLL;
        while metric(&d.metrics(i).await, APPLIED, &[]) < 2.0 {
            assert!(
                Instant::now() < deadline,
                "replica {i} applied no decision of the other:\n{}{}",
                redis_lines(&d.metrics(i).await),
                d.diag()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // 1. Redis dies: requests go on, and both replicas stay ready (Redis down is no reason to
    // take every replica out at once).
    let redis_addr = d.redis_addr;
    d.redis.lock().unwrap().kill();
    let decided = d.total(LOOKUPS, &[("source", "mirror")]).await;
    wait_total(
        &d,
        "decisions without Redis",
        LOOKUPS,
        &[("source", "mirror")],
        |v| v >= decided + 8.0,
    )
    .await;
    for i in 0..d.routers.len() {
        assert!(
            ready(&d, i).await,
            "replica {i} unready without Redis{}",
            d.diag()
        );
    }

    // 2. Redis comes back empty: each mirror reloads by itself and follows the stream again.
    let dir = tempfile::tempdir().expect("temp dir");
    *d.redis.lock().unwrap() = Redis::restart_on(&bin, redis_addr, dir.path());
    wait_total(
        &d,
        "reloads after the restart",
        RELOADS,
        &[("reason", "reconnect")],
        |v| v >= 2.0,
    )
    .await;
    let applied = d.total(APPLIED, &[]).await;
    wait_total(
        &d,
        "decisions applied after the restart",
        APPLIED,
        &[],
        |v| v >= applied + 4.0,
    )
    .await;

    // 3. Redis stalls (DEBUG SLEEP): no decision waits for it.
    for _ in 0..3 {
        let sleeper =
            std::thread::spawn(move || redis_command(redis_addr, &["DEBUG", "SLEEP", "0.3"]));
        let deadline = Instant::now() + Duration::from_secs(1);
        while !sleeper.is_finished() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let reply = sleeper.join().expect("sleeper thread");
        assert_eq!(reply.as_deref().ok(), Some("+OK"), "DEBUG SLEEP: {reply:?}");
    }

    stop.store(true, Ordering::Relaxed);
    let outcomes = load.await.expect("load task");
    let failed: Vec<_> = outcomes.iter().filter(|o| !o.ok()).collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed while Redis was killed, restarted and slowed; first: {:?} {:?}{}",
        failed.len(),
        outcomes.len(),
        failed[0].status,
        failed[0].error,
        d.diag()
    );
    assert_eq!(d.total(LOOKUPS, &[("source", "redis")]).await, 0.0);
    assert_eq!(d.total("kv_router_redis_fallbacks_total", &[]).await, 0.0);
    d.assert_both_decided_through("mirror").await;
    assert_no_decision_waited(&d, started).await;
}

/// Every decision of both replicas took well under the 0.3 s stalls, and the test its minute.
async fn assert_no_decision_waited(d: &Replicas, started: Instant) {
    for i in 0..d.routers.len() {
        let m = d.metrics(i).await;
        let all = metric(&m, "kv_router_decision_duration_seconds_count", &[]);
        let (le, fast) = bucket_at_most(&m, "kv_router_decision_duration_seconds", 0.15);
        assert_eq!(
            fast,
            all,
            "replica {i}: a decision took longer than {le} s while Redis stalled for 0.3 s{}",
            d.diag()
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "fault test took {:?}",
        started.elapsed()
    );
}
