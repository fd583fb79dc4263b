//! End-to-end tests of PRECISE mode (`kv_events.enabled`): real vllm-sim pods publishing vLLM KV
//! events over ZMQ, the real kv-router subscribing to them, and (where a request goes through the
//! proxy) the real Envoy 1.40. Prompts are warmed by sending them DIRECTLY to a pod, so the
//! router can only learn about them from the pod's events.
//!
//! Assertions poll `POST /debug/explain` (a dry run: it records nothing) and `/metrics` with
//! deadlines; there are no fixed long sleeps.
//!
//! Run: `KV_ROUTER_ENVOY=/path/to/envoy cargo test --release --test integration e2e_precise::`

use crate::common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::deploy::{self, free_port, EnvoyProc, RouterProc, SimPod};
use common::runner;
use common::{
    bins, completion, envoy_bin, explain, matched, metric, post_to, served_by, text, FAST_SIM,
};
use kv_router::config::{Config, TokenizerConfig};
use serde_json::{json, Value};

const BUFFERED: &str = "override-host-buffered.yaml";
/// How long any polled condition may take on a loaded CI machine.
const POLL: Duration = Duration::from_secs(10);

/// A vllm-sim started on a FIXED http port (for restarts: [`SimPod::spawn`] always asks for
/// port 0). Killed on drop.
struct RawSim {
    child: Child,
    stderr: tempfile::NamedTempFile,
}

impl Drop for RawSim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One pod of a precise deployment: its fixed ports and its process.
struct Pod {
    addr: SocketAddr,
    events_port: u16,
    replay_port: u16,
    args: Vec<String>,
    sim: Option<SimPod>,
    raw: Option<RawSim>,
}

impl Pod {
    fn name(&self) -> String {
        self.addr.to_string()
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn kill(&mut self) {
        if let Some(s) = self.sim.as_mut() {
            s.kill();
        }
        self.sim = None;
        self.raw = None;
    }
}

/// vllm-sim arguments: fast timings, KV events on fixed ports, plus `extra`.
fn sim_args(events_port: u16, replay_port: u16, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = FAST_SIM.iter().map(|s| s.to_string()).collect();
    a.extend([
        "--kv-events-endpoint".to_string(),
        format!("tcp://*:{events_port}"),
        "--kv-events-replay-endpoint".to_string(),
        format!("tcp://*:{replay_port}"),
    ]);
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// Starts a pod on a free http port and fixed (free) event ports; retries with fresh ports if
/// one was taken in the meantime.
fn spawn_pod(extra: &[&str]) -> Pod {
    let b = bins();
    let mut last = String::new();
    for _ in 0..4 {
        let (ep, rp) = (free_port().unwrap(), free_port().unwrap());
        if ep == rp {
            continue;
        }
        let args = sim_args(ep, rp, extra);
        match SimPod::spawn(&b.vllm_sim, &args) {
            Ok(sim) => {
                return Pod {
                    addr: sim.addr,
                    events_port: ep,
                    replay_port: rp,
                    args,
                    sim: Some(sim),
                    raw: None,
                }
            }
            Err(e) => last = format!("{e:#}"),
        }
    }
    panic!("cannot start vllm-sim with KV events: {last}");
}

/// Restarts a killed pod on the SAME http port and the same event ports (a restarted engine:
/// its event sequence starts again at 0). Retries while a port is still held by the old process.
async fn restart_pod(pod: &mut Pod) {
    pod.kill();
    let b = bins();
    let client = runner::client();
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last = String::new();
    while Instant::now() < deadline {
        let stderr = tempfile::NamedTempFile::new().expect("temp file");
        let mut cmd = Command::new(&b.vllm_sim);
        cmd.args([
            "--host",
            "127.0.0.1",
            "--port",
            &pod.addr.port().to_string(),
        ])
        .args(&pod.args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr.reopen().expect("reopen temp file"));
        let child = cmd.spawn().expect("spawn vllm-sim");
        let mut raw = RawSim { child, stderr };
        loop {
            if let Ok(Some(status)) = raw.child.try_wait() {
                last = format!(
                    "exited with {status}: {}",
                    std::fs::read_to_string(raw.stderr.path()).unwrap_or_default()
                );
                break;
            }
            if let Ok(r) = client.get(format!("{}/health", pod.url())).send().await {
                if r.status().is_success() {
                    pod.raw = Some(raw);
                    return;
                }
            }
            if Instant::now() > deadline {
                last = "never answered /health".into();
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("cannot restart vllm-sim on {}: {last}", pod.addr);
}

/// A precise-mode deployment: pods with KV events, kv-router subscribed to them, optionally Envoy.
struct Precise {
    pods: Vec<Pod>,
    router: RouterProc,
    envoy: Option<EnvoyProc>,
    client: reqwest::Client,
}

impl Precise {
    /// `extra[i]` are pod `i`'s extra sim flags.
    async fn start(extra: &[&[&str]], with_envoy: bool, tweak: impl FnOnce(&mut Config)) -> Self {
        let envoy_path = with_envoy.then(envoy_bin);
        let pods: Vec<Pod> = extra.iter().map(|e| spawn_pod(e)).collect();
        let addrs: Vec<SocketAddr> = pods.iter().map(|p| p.addr).collect();
        let mut cfg = deploy::local_router_config(&addrs).expect("router config");
        cfg.kv_events.enabled = true;
        cfg.kv_events.block_tokens = 16;
        cfg.kv_events.speculative_ttl_ms = 2000;
        for (sp, p) in cfg.pods.static_pods.iter_mut().zip(&pods) {
            sp.kv_events_endpoint = Some(format!("tcp://127.0.0.1:{}", p.events_port));
            sp.kv_events_replay_endpoint = Some(format!("tcp://127.0.0.1:{}", p.replay_port));
        }
        let tok: TokenizerConfig =
            serde_json::from_value(json!({"model": "sim-model", "builtin": true})).unwrap();
        cfg.tokenizers = vec![tok];
        tweak(&mut cfg);
        let b = bins();
        let router = RouterProc::spawn(&b.kv_router, &cfg)
            .await
            .expect("start kv-router");
        router
            .wait_pods_ready(addrs.len(), Duration::from_secs(15))
            .await
            .unwrap_or_else(|e| panic!("{e:#}\nrouter stderr:\n{}", router.stderr_tail(40)));
        let envoy = match envoy_path {
            Some(path) => {
                let t = deploy::envoy_template(BUFFERED).expect("template");
                Some(
                    EnvoyProc::spawn(&path, &t, Some(router.grpc), &addrs)
                        .await
                        .unwrap_or_else(|e| panic!("start Envoy: {e:#}")),
                )
            }
            None => None,
        };
        let d = Self {
            pods,
            router,
            envoy,
            client: runner::client(),
        };
        for i in 0..d.pods.len() {
            d.wait_subscribed(i).await;
        }
        d
    }

    fn diag(&self) -> String {
        let mut s = format!(
            "\n--- kv-router stderr (tail) ---\n{}",
            self.router.stderr_tail(40)
        );
        if let Some(e) = &self.envoy {
            s.push_str(&format!(
                "\n--- envoy stderr (tail) ---\n{}",
                e.stderr_tail(20)
            ));
        }
        s
    }

    /// Sends `prompt` directly to pod `i` (bypassing the router) and returns the serving pod.
    async fn direct(&self, i: usize, prompt: &str) -> String {
        let o = post_to(
            &self.client,
            &self.pods[i].url(),
            "/v1/completions",
            &completion(prompt, 4),
            &[],
        )
        .await;
        served_by(&o, &self.diag())
    }

    /// Sends `prompt` through Envoy and returns the serving pod.
    async fn via_envoy(&self, prompt: &str) -> String {
        let e = self.envoy.as_ref().expect("deployment without Envoy");
        let o = post_to(
            &self.client,
            &e.url(),
            "/v1/completions",
            &completion(prompt, 4),
            &[],
        )
        .await;
        served_by(&o, &self.diag())
    }

    /// `POST /debug/explain` for a completion of `prompt`.
    async fn explain(&self, prompt: &str) -> Value {
        explain(&self.client, &self.router, &completion(prompt, 4)).await
    }

    /// Polls explain for `prompt` until `ok(explain)` holds; panics after [`POLL`].
    async fn poll_explain(&self, prompt: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + POLL;
        loop {
            let v = self.explain(prompt).await;
            if ok(&v) {
                return v;
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out waiting for {what}; last explain: {v:#}\nmetrics:\n{}{}",
                    kv_metrics(&self.metrics().await),
                    self.diag()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `GET /metrics` text.
    async fn metrics(&self) -> String {
        self.client
            .get(format!("{}/metrics", self.router.admin_url()))
            .send()
            .await
            .expect("metrics request")
            .text()
            .await
            .expect("metrics text")
    }

    /// ZMQ slow joiner: sends fresh short prompts directly to pod `i` until the router has
    /// learned one of them from pod `i`'s events (its subscription is live).
    async fn wait_subscribed(&self, i: usize) {
        let pod = self.pods[i].name();
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut n = 0u64;
        loop {
            n += 1;
            let p = format!("warm-up {pod} #{n}: {}", text(9_000 + n, 256));
            self.direct(i, &p).await;
            let until = Instant::now() + Duration::from_millis(1000);
            while Instant::now() < until {
                if matched(&self.explain(&p).await, &pod) > 0 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            if Instant::now() > deadline {
                panic!(
                    "kv-router never learned pod {pod}'s events; metrics:\n{}{}",
                    kv_metrics(&self.metrics().await),
                    self.diag()
                );
            }
        }
    }
}

/// The first-ranked pod of an explain answer.
fn first(v: &Value) -> String {
    v["ranked"][0]["pod"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The KV-event lines of a metrics text (for failure messages).
fn kv_metrics(text: &str) -> String {
    text.lines()
        .filter(|l| l.starts_with("kv_router_kv_event"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A ~4 KB prompt (64 blocks of 64 bytes) deterministic in `seed`.
fn long_prompt(seed: u64) -> String {
    text(seed, 4096)
}

#[tokio::test]
async fn events_make_router_prefer_the_pod_holding_the_prefix() {
    let d = Precise::start(&[&[], &[], &[]], true, |_| {}).await;
    let b = d.pods[1].name();
    let p = long_prompt(101);
    assert_eq!(d.direct(1, &p).await, b);
    let probe = format!("{p} And a new question: {}", text(102, 100));
    d.poll_explain(&probe, "pod B to hold > 50 blocks and rank first", |v| {
        matched(v, &b) > 50 && first(v) == b
    })
    .await;
    let q = format!("{p} Yet another question: {}", text(103, 100));
    assert_eq!(
        d.via_envoy(&q).await,
        b,
        "the prefix is on {b} (learned from its events) but Envoy's request went elsewhere{}",
        d.diag()
    );
}

/// Token-id prompts (what `kv-bench compare` replays from the Mooncake traces) are keyed from the
/// ids, as the pod's events key them: the router learns them from events alone.
#[tokio::test]
async fn token_id_prompts_are_learned_from_events() {
    let d = Precise::start(&[&[], &[]], false, |_| {}).await;
    let b = d.pods[1].name();
    let ids: Vec<u32> = (0..1000u32).map(|i| 1000 + (i * 7919) % 30_000).collect();
    let body = json!({"model": "sim-model", "prompt": ids, "max_tokens": 4});
    let o = post_to(&d.client, &d.pods[1].url(), "/v1/completions", &body, &[]).await;
    assert_eq!(served_by(&o, &d.diag()), b);
    let deadline = Instant::now() + POLL;
    loop {
        let v = explain(&d.client, &d.router, &body).await;
        // 62 full blocks of 16 tokens (the last token is never served from cache).
        if matched(&v, &b) >= 60 && first(&v) == b {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the router never learned the token prompt from {b}'s events: {v:#}\n{}",
            kv_metrics(&d.metrics().await)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn eviction_stops_preference() {
    // Pod A's cache holds 80 blocks: a 64-block prefix plus one more such prompt overflow it.
    let d = Precise::start(&[&["--num-gpu-blocks", "80"], &[]], false, |_| {}).await;
    let a = d.pods[0].name();
    let p = long_prompt(201);
    d.direct(0, &p).await;
    let v = d
        .poll_explain(&p, "pod A to hold P and rank first", |v| {
            matched(v, &a) > 50 && first(v) == a
        })
        .await;
    let before = matched(&v, &a);
    // Unrelated prompts directly to A until the router has seen P's blocks removed.
    let deadline = Instant::now() + POLL;
    let mut n = 0u64;
    loop {
        n += 1;
        d.direct(0, &long_prompt(210 + n)).await;
        let until = Instant::now() + Duration::from_millis(1000);
        let mut now = before;
        while Instant::now() < until {
            now = matched(&d.explain(&p).await, &a);
            if now == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        if now == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after {n} unrelated prompts on a 80-block pod the router still matches {now} of P's \
             blocks on {a}; metrics:\n{}{}",
            kv_metrics(&d.metrics().await),
            d.diag()
        );
    }
    eprintln!("P's blocks left {a} after {n} unrelated prompt(s)");
    assert!(
        n <= 4,
        "P should be evicted by at most a few prompts, took {n}"
    );
    let m = d.metrics().await;
    assert!(
        metric(
            &m,
            "kv_router_kv_events_applied_total",
            &[("pod", &a), ("type", "BlockRemoved")]
        ) > 0.0
            || metric(&m, "kv_router_kv_events_applied_total", &[("pod", &a)]) > 0.0,
        "no applied events for {a}:\n{}",
        kv_metrics(&m)
    );
    let v = d.explain(&p).await;
    let prefix_a = v["ranked"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["pod"] == a.as_str())
        .map(|r| r["scores"]["prefix"].as_f64().unwrap_or(0.0))
        .unwrap_or(0.0);
    assert_eq!(
        prefix_a, 0.0,
        "A keeps a prefix score after eviction: {v:#}"
    );
}

#[tokio::test]
async fn all_blocks_cleared_stops_preference() {
    let d = Precise::start(&[&[], &[]], false, |_| {}).await;
    let a = d.pods[0].name();
    let p = long_prompt(301);
    d.direct(0, &p).await;
    d.poll_explain(&p, "pod A to hold P and rank first", |v| {
        matched(v, &a) > 50 && first(v) == a
    })
    .await;
    let cleared = |m: &str| {
        metric(
            m,
            "kv_router_kv_event_purges_total",
            &[("pod", &a), ("type", "cleared")],
        )
    };
    let before = cleared(&d.metrics().await);
    deploy::reset_caches(&[d.pods[0].addr])
        .await
        .expect("reset_prefix_cache");
    d.poll_explain(&p, "A's blocks to be cleared", |v| matched(v, &a) == 0)
        .await;
    let deadline = Instant::now() + POLL;
    loop {
        let m = d.metrics().await;
        if cleared(&m) > before {
            eprintln!("cleared purges for {a}: {before} -> {}", cleared(&m));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "kv_router_kv_event_purges_total{{pod=\"{a}\",type=\"cleared\"}} did not increase \
             (was {before}):\n{}{}",
            kv_metrics(&m),
            d.diag()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn burst_with_new_prefix_lands_on_one_pod() {
    // The hot-pod gate (hot_abs 4 by default) deliberately spills a burst once the chosen pod
    // has 5+ more requests than the idlest one, and the saturation gate once 8 of them wait
    // (max_waiting), and a busy holder's prefix goes to an idle pod while at most half the pods
    // have requests (replicate_to_idle): that is load spreading, not a prefix-routing failure,
    // so all three are relaxed.
    // All 16 leave at once: each decision sees the ones answered before it whose entries are
    // not in the index yet (the record follows the reply). Before that, two of them picked
    // different cold pods and the rest split 8/8 about one run in six.
    let d = Precise::start(&[&[], &[], &[], &[]], true, |c| {
        c.gate.hot_abs = 100.0;
        c.gate.max_waiting = 100.0;
        c.gate.replicate_to_idle = false;
    })
    .await;
    let prefix = long_prompt(401);
    let d = &d;
    let prefix = &prefix;
    let ask = |i: u64| async move {
        d.via_envoy(&format!("{prefix} Question {i}: {}", text(410 + i, 120)))
            .await
    };
    let mut all = futures::future::join_all((0..16u64).map(ask)).await;
    let rest = all.split_off(1);
    let first = all.remove(0);
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for p in std::iter::once(&first).chain(&rest) {
        *counts.entry(p.clone()).or_default() += 1;
    }
    eprintln!("burst of 16 served by {counts:?}");
    assert_eq!(
        counts.get(&first).copied(),
        Some(16),
        "a burst following a new prefix spread over {counts:?}{}",
        d.diag()
    );
}

#[tokio::test]
async fn restarted_engine_is_purged_and_relearned() {
    let mut d = Precise::start(&[&[], &[]], false, |_| {}).await;
    let a = d.pods[0].name();
    let p = long_prompt(501);
    d.direct(0, &p).await;
    // A few more batches so the sequence number is well above the restarted engine's 0.
    for i in 0..3 {
        d.direct(0, &text(510 + i, 300)).await;
    }
    d.poll_explain(&p, "pod A to hold P", |v| matched(v, &a) > 50)
        .await;
    let restarts = |m: &str| {
        metric(
            m,
            "kv_router_kv_event_purges_total",
            &[("pod", &a), ("type", "restart")],
        )
    };
    let before = restarts(&d.metrics().await);

    restart_pod(&mut d.pods[0]).await;

    // The router's SUB socket reconnects by itself; events published before it did are lost
    // (slow joiner), so send fresh prompts Q until one is learned from the new engine.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut n = 0u64;
    let q = loop {
        n += 1;
        let q = format!("After the restart #{n}: {}", long_prompt(520 + n));
        d.direct(0, &q).await;
        let until = Instant::now() + Duration::from_millis(1000);
        let mut got = false;
        while Instant::now() < until {
            if matched(&d.explain(&q).await, &a) > 50 {
                got = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        if got {
            break q;
        }
        assert!(
            Instant::now() < deadline,
            "the router never relearned the restarted pod {a}; metrics:\n{}{}",
            kv_metrics(&d.metrics().await),
            d.diag()
        );
    };
    let v = d
        .poll_explain(&p, "P's blocks on the restarted pod A to be purged", |v| {
            matched(v, &a) == 0
        })
        .await;
    assert_eq!(matched(&v, &a), 0);
    assert!(matched(&d.explain(&q).await, &a) > 50, "Q forgotten again");
    let deadline = Instant::now() + POLL;
    loop {
        let m = d.metrics().await;
        if restarts(&m) > before {
            eprintln!(
                "restart purges for {a}: {before} -> {}; Q relearned after {n} prompt(s)",
                restarts(&m)
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "kv_router_kv_event_purges_total{{pod=\"{a}\",type=\"restart\"}} did not increase \
             (was {before}):\n{}{}",
            kv_metrics(&m),
            d.diag()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A replay socket in front of a pod's own that holds its first answer back by `delay` (less
/// than the subscriber's 2-s idle limit, so the catch-up is slow, not failed). Ends with the test.
struct SlowReplay {
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SlowReplay {
    fn start(upstream: String, delay: Duration) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let ctx = zmq::Context::new();
        let front = ctx.socket(zmq::ROUTER).unwrap();
        front.set_rcvtimeo(50).unwrap();
        let port = free_port().unwrap();
        front.bind(&format!("tcp://127.0.0.1:{port}")).unwrap();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let done = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut delay = Some(delay);
            while !done.load(Ordering::Relaxed) {
                let Ok(mut req) = front.recv_multipart(0) else {
                    continue;
                };
                let id = req.remove(0);
                let back = ctx.socket(zmq::DEALER).unwrap();
                back.set_rcvtimeo(2_000).unwrap();
                back.connect(&upstream).unwrap();
                back.send_multipart(req, 0).unwrap();
                if let Some(d) = delay.take() {
                    std::thread::sleep(d);
                }
                // Relay until the end marker (an empty payload after the all-ones sequence).
                while let Ok(reply) = back.recv_multipart(0) {
                    let end = reply.iter().rev().nth(1).is_some_and(|s| s == &[0xff; 8]);
                    let mut out = vec![id.clone()];
                    out.extend(reply);
                    front.send_multipart(out, 0).unwrap();
                    if end {
                        break;
                    }
                }
            }
        });
        Self {
            port,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for SlowReplay {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A router restarted beside a warm pod is not ready until it has read what the pod already
/// caches (its catch-up replay): once `/readyz` answers 200, a prompt the pod holds matches
/// there at once. Before, readiness followed the first health probe and a slow catch-up (a busy
/// pod's long replay buffer) left the new replica routing blind meanwhile.
#[tokio::test]
async fn readiness_waits_for_the_catch_up_of_what_the_pods_already_cache() {
    let pod = spawn_pod(&[]);
    let a = pod.name();
    let client = runner::client();
    let p = long_prompt(601);
    let o = post_to(
        &client,
        &pod.url(),
        "/v1/completions",
        &completion(&p, 4),
        &[],
    )
    .await;
    assert_eq!(served_by(&o, ""), a);
    let relay = SlowReplay::start(
        format!("tcp://127.0.0.1:{}", pod.replay_port),
        Duration::from_millis(1_500),
    );
    let mut cfg = deploy::local_router_config(&[pod.addr]).expect("router config");
    cfg.kv_events.enabled = true;
    cfg.kv_events.block_tokens = 16;
    let sp = &mut cfg.pods.static_pods[0];
    sp.kv_events_endpoint = Some(format!("tcp://127.0.0.1:{}", pod.events_port));
    sp.kv_events_replay_endpoint = Some(format!("tcp://127.0.0.1:{}", relay.port));
    cfg.tokenizers =
        vec![serde_json::from_value(json!({"model": "sim-model", "builtin": true})).unwrap()];
    let started = Instant::now();
    let router = RouterProc::spawn(&bins().kv_router, &cfg)
        .await
        .expect("start kv-router");
    let ready_after = started.elapsed();
    let v = explain(&client, &router, &completion(&p, 4)).await;
    assert!(
        matched(&v, &a) > 50,
        "ready after {ready_after:?} without the pod's cache: {v:#}\n{}",
        router.stderr_tail(30)
    );
    assert!(
        ready_after >= Duration::from_millis(1_500),
        "{ready_after:?}"
    );
}
