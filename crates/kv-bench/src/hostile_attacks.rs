//! `kv-bench hostile --attacks`: the connection and upload floods, each against a
//! fresh kv-router (and, for held uploads, a real Envoy in front), with a health probe beside it:
//! every 100 ms a fresh connection asks `/healthz` on the admin port and gRPC `readiness` on the
//! gRPC port. For each attack: the router's peak RSS and open fds (sampled every 50 ms from
//! /proc), the probes' worst and p99 latency and failures, and how long RSS took to return
//! within 20 % of its level before the attack once the attack's connections closed.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::table::{Style, Table};
#[path = "hostile_admin.rs"]
mod admin;
#[path = "hostile_grpc.rs"]
mod grpc;
#[path = "hostile_envoy.rs"]
mod hostile_envoy;
use kv_testkit::deploy::{
    find_envoy, local_router_config, Binaries, EnvoyProc, RouterProc, SimPod,
};

/// One attack's figures.
#[derive(Debug, Clone, Serialize)]
pub struct AttackResult {
    pub attack: String,
    /// VmRSS before the attack, bytes.
    pub rss_before: u64,
    /// Highest VmRSS sampled during the attack, bytes.
    pub rss_peak: u64,
    /// The bound it must stay under (docs/operations.md), bytes.
    pub rss_bound: u64,
    /// VmRSS once it settled after the attack (or 60 s), bytes.
    pub rss_after: u64,
    /// Seconds from the attack's end until RSS was within 20 % of `rss_before` (None: not in 60 s).
    pub settle_s: Option<f64>,
    /// Most open fds sampled.
    pub fds_peak: usize,
    pub probes: usize,
    pub probe_failures: usize,
    pub probe_p99_ms: f64,
    pub probe_worst_ms: f64,
    /// What the attack itself saw (held / refused ...).
    pub note: String,
}

fn proc_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse::<u64>()
                .ok()
        })
        .unwrap_or(0)
        * 1024
}

fn proc_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// `/healthz` on a fresh connection: Ok when a 200 came within 2 s.
async fn probe_http(admin: SocketAddr) -> Result<()> {
    let go = async {
        let mut s = TcpStream::connect(admin).await?;
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await?;
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf).await?;
        anyhow::ensure!(
            &buf[9..12] == b"200",
            "status {}",
            String::from_utf8_lossy(&buf)
        );
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(2), go)
        .await
        .context("timeout")?
}

/// gRPC `readiness` on a fresh HTTP/2 connection: Ok when grpc-status 0 came within 2 s.
async fn probe_grpc(grpc: SocketAddr) -> Result<()> {
    let go = async {
        let tcp = TcpStream::connect(grpc).await?;
        let (client, conn) = h2::client::handshake(tcp).await?;
        tokio::spawn(conn);
        let req = http::Request::post("http://x/grpc.health.v1.Health/Check")
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())?;
        let mut client = client.ready().await?;
        let (resp, mut body) = client.send_request(req, false)?;
        let msg = b"\x0a\x09readiness";
        let mut frame = vec![0u8, 0, 0, 0, msg.len() as u8];
        frame.extend_from_slice(msg);
        body.send_data(Bytes::from(frame), true)?;
        let resp = resp.await?;
        if let Some(s) = resp.headers().get("grpc-status") {
            anyhow::ensure!(s == "0", "grpc-status {s:?}");
            return Ok(());
        }
        let mut body = resp.into_body();
        while body.data().await.is_some() {}
        let trailers = body.trailers().await?.context("no trailers")?;
        anyhow::ensure!(
            trailers.get("grpc-status").is_some_and(|s| s == "0"),
            "{trailers:?}"
        );
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(2), go)
        .await
        .context("timeout")?
}

/// Samples and probes while an attack runs, on a thread of its own (as a kubelet probes from its
/// own process): the attack's work in this process never delays a probe.
struct Watch {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(u64, usize, Vec<Option<Duration>>)>,
}

impl Watch {
    fn start(pid: u32, admin: SocketAddr, grpc: SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("probe runtime");
            rt.block_on(async move {
                let (mut rss, mut fds, mut lat) = (0, 0, Vec::new());
                let sampler = async {
                    while !flag.load(Ordering::Relaxed) {
                        rss = rss.max(proc_rss(pid));
                        fds = fds.max(proc_fds(pid));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                };
                let prober = async {
                    while !flag.load(Ordering::Relaxed) {
                        for http in [true, false] {
                            let t = Instant::now();
                            let ok = if http {
                                probe_http(admin).await
                            } else {
                                probe_grpc(grpc).await
                            };
                            if let Err(e) = &ok {
                                let which = if http { "/healthz" } else { "gRPC readiness" };
                                eprintln!(
                                    "kv-bench hostile: {which} probe failed after {:?}: {e:#}",
                                    t.elapsed()
                                );
                            }
                            lat.push(ok.is_ok().then(|| t.elapsed()));
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                };
                tokio::join!(sampler, prober);
                (rss, fds, lat)
            })
        });
        Self { stop, thread }
    }

    async fn finish(self) -> (u64, usize, Vec<Option<Duration>>) {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self.thread;
        tokio::task::spawn_blocking(move || thread.join().unwrap_or_default())
            .await
            .unwrap_or_default()
    }
}

/// Waits (≤ 60 s) for RSS to come back within 20 % of `before`.
async fn settle(pid: u32, before: u64) -> (u64, Option<f64>) {
    let t = Instant::now();
    loop {
        let now = proc_rss(pid);
        if now as f64 <= before as f64 * 1.2 {
            return (now, Some(t.elapsed().as_secs_f64()));
        }
        if t.elapsed() > Duration::from_secs(60) {
            return (now, None);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Aborts the attack's background task (closing its connections) when dropped.
struct Held(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Held {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Runs `spawn`'s attack for `hold`, then closes it and waits for RSS to settle.
async fn measure(
    name: &str,
    pid: u32,
    (admin, grpc): (SocketAddr, SocketAddr),
    bound: u64,
    hold: Duration,
    attack: impl std::future::Future<Output = (Held, Arc<parking_lot::Mutex<String>>)>,
) -> AttackResult {
    let rss_before = proc_rss(pid);
    let watch = Watch::start(pid, admin, grpc);
    let (held, note) = attack.await;
    tokio::time::sleep(hold).await;
    let note = note.lock().clone();
    drop(held);
    let (rss_peak, fds_peak, lat) = watch.finish().await;
    let (rss_after, settle_s) = settle(pid, rss_before).await;
    let mut ok: Vec<Duration> = lat.iter().flatten().copied().collect();
    ok.sort();
    let ms = |d: Option<&Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3);
    let p99 = ok.get((ok.len() * 99 / 100).min(ok.len().saturating_sub(1)));
    let r = AttackResult {
        attack: name.into(),
        rss_before,
        rss_peak,
        rss_bound: bound,
        rss_after,
        settle_s,
        fds_peak,
        probes: lat.len(),
        probe_failures: lat.iter().filter(|l| l.is_none()).count(),
        probe_p99_ms: ms(p99),
        probe_worst_ms: ms(ok.last()),
        note,
    };
    eprintln!("kv-bench hostile: {r:?}");
    r
}

/// One router under attack: each attack wanted by `only` is measured in turn into `results`.
struct Session<'a> {
    pid: u32,
    ports: (SocketAddr, SocketAddr),
    bound: u64,
    hold: Duration,
    only: Option<&'a str>,
    /// Config keys left out of a router's file (an earlier build refuses newer ones).
    omit: &'a [&'a str],
    /// The config every router of the run starts from.
    cfg: kv_router::config::Config,
    results: Vec<AttackResult>,
}

impl Session<'_> {
    /// Whether `name` is to run (its name contains `only`, or there is none).
    fn wants(&self, name: &str) -> bool {
        self.only.is_none_or(|o| name.contains(o))
    }

    /// Measures `attack` under `name` when wanted (an unwanted one is never started).
    async fn attack(
        &mut self,
        name: &str,
        attack: impl std::future::Future<Output = (Held, Arc<parking_lot::Mutex<String>>)>,
    ) {
        if self.wants(name) {
            let r = measure(name, self.pid, self.ports, self.bound, self.hold, attack).await;
            self.results.push(r);
        }
    }
}

/// Opens a gRPC stream to `path` on `client`, sends `data` (a message's start) and keeps it open;
/// None once the connection is gone.
async fn open_stalled(
    client: &h2::client::SendRequest<Bytes>,
    path: &str,
    data: &Bytes,
) -> Option<(h2::client::ResponseFuture, h2::SendStream<Bytes>)> {
    let req = http::Request::post(path)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .ok()?;
    let mut c = client.clone().ready().await.ok()?;
    let (resp, mut body) = c.send_request(req, false).ok()?;
    body.reserve_capacity(data.len());
    let _ = body.send_data(data.clone(), false);
    Some((resp, body))
}

/// Streams to `Pick` announcing `announce` bytes and sending `send`, then stalling.
async fn pick_flood(
    grpc: SocketAddr,
    conns: usize,
    streams: usize,
    announce: u32,
    send: usize,
) -> (Held, Arc<parking_lot::Mutex<String>>) {
    let note = Arc::new(parking_lot::Mutex::new(String::new()));
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    let mut data = vec![0u8];
    data.extend_from_slice(&announce.to_be_bytes());
    data.resize(5 + send, b'x');
    let data = Bytes::from(data);
    for _ in 0..conns {
        let (data, refused) = (data.clone(), refused.clone());
        tasks.push(tokio::spawn(async move {
            let Ok(tcp) = TcpStream::connect(grpc).await else {
                return;
            };
            let Ok((client, conn)) = h2::client::handshake(tcp).await else {
                return;
            };
            tokio::spawn(conn);
            let mut held = Vec::new();
            let mut answers = Vec::new();
            for _ in 0..streams {
                let Some((resp, body)) =
                    open_stalled(&client, "http://x/kvrouter.v1.Picker/Pick", &data).await
                else {
                    break;
                };
                held.push(body);
                answers.push(resp);
            }
            // Every stream's answer waited for at once: a held stream must not hide the refusals
            // behind it.
            let answered = answers.into_iter().map(|resp| {
                let refused = refused.clone();
                async move {
                    if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), resp).await {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
            futures::future::join_all(answered).await;
            std::future::pending::<()>().await;
            drop(held);
        }));
    }
    let n = note.clone();
    tasks.push(tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        *n.lock() = format!(
            "{} streams of {} MiB announced, {} KiB sent; {} answered (RESOURCE_EXHAUSTED) at once",
            conns * streams,
            announce >> 20,
            send >> 10,
            refused.load(Ordering::Relaxed)
        );
    }));
    (Held(tasks), note)
}

/// Connections that send `head` (and `body_bytes` of body, as far as the server reads), then stall.
async fn stalled_uploads(
    addr: SocketAddr,
    conns: usize,
    head: String,
    body_bytes: usize,
    chunk: usize,
) -> (Held, Arc<parking_lot::Mutex<String>>) {
    let note = Arc::new(parking_lot::Mutex::new(String::new()));
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let (head, answered, opened) = (head.clone(), answered.clone(), opened.clone());
        tasks.push(tokio::spawn(async move {
            let Ok(mut s) = TcpStream::connect(addr).await else {
                return;
            };
            if s.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            opened.fetch_add(1, Ordering::Relaxed);
            let buf = vec![b' '; chunk];
            let mut sent = 0;
            while sent < body_bytes {
                match tokio::time::timeout(Duration::from_secs(1), s.write_all(&buf)).await {
                    Ok(Ok(())) => sent += chunk,
                    _ => break, // stalled by flow control, or closed
                }
            }
            let mut b = [0u8; 64];
            if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(3), s.read(&mut b)).await {
                if n > 0 {
                    answered.fetch_add(1, Ordering::Relaxed);
                }
            }
            std::future::pending::<()>().await;
            drop(s);
        }));
    }
    let n = note.clone();
    tasks.push(tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(6)).await;
        *n.lock() = format!(
            "{} connections opened, {} answered at once (503/413), the rest held",
            opened.load(Ordering::Relaxed),
            answered.load(Ordering::Relaxed)
        );
    }));
    (Held(tasks), note)
}

/// `conns` connections that each send `first`, then one byte a second; a closed one reconnects.
async fn dribble(
    addr: SocketAddr,
    conns: usize,
    first: &'static [u8],
) -> (Held, Arc<parking_lot::Mutex<String>>) {
    let note = Arc::new(parking_lot::Mutex::new(String::new()));
    let reconnects = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let reconnects = reconnects.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                if let Ok(mut s) = TcpStream::connect(addr).await {
                    if s.write_all(first).await.is_ok() {
                        loop {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            let mut b = [0u8; 64];
                            if s.try_read(&mut b).is_ok() || s.write_all(b"x").await.is_err() {
                                break;
                            }
                        }
                    }
                }
                reconnects.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }));
    }
    let n = note.clone();
    tasks.push(tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            *n.lock() = format!(
                "{conns} connections, {} closed by the router and reopened",
                reconnects.load(Ordering::Relaxed)
            );
        }
    }));
    (Held(tasks), note)
}

/// Runs every attack whose name contains `only` (all without it); `hold` is how long each is held;
/// `omit`: config keys left out of the router's file (an earlier build refuses newer keys).
pub async fn run(
    bins: &Binaries,
    hold: Duration,
    only: Option<&str>,
    omit: &[&str],
) -> Result<Vec<AttackResult>> {
    let sim_args: Vec<String> = ["--ttft-base-ms", "1", "--model", "m"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let pod = SimPod::spawn(&bins.vllm_sim, &sim_args)?;
    let mut cfg = local_router_config(&[pod.addr])?;
    // The values deploy/base/router.yaml ships, so the documented worst case applies.
    cfg.server.max_buffered_body_bytes = 96 << 20;
    cfg.server.max_connections = 1024;
    let bound = kv_testkit::memory_bounds::documented(&kv_testkit::repo_root())
        .ok()
        .and_then(|bs| bs.into_iter().find(|b| b.component == "router"))
        .map(|b| b.bound)
        .context("docs/operations.md documents no [router] bound")?;
    let mut router = RouterProc::spawn_without(&bins.kv_router, &cfg, omit).await?;
    router.wait_pods_ready(1, Duration::from_secs(20)).await?;
    let pid = router.process().pid().context("router pid")?;
    let mut s = Session {
        pid,
        ports: (router.admin, router.grpc),
        bound,
        hold,
        only,
        omit,
        cfg: cfg.clone(),
        results: Vec::new(),
    };
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    s.attack(
        "Pick flood: 4 conns x 100 streams, 2 MiB announced, 1 MiB sent",
        pick_flood(router.grpc, 4, 100, 2 << 20, 1 << 20),
    )
    .await;
    s.attack(
        "Pick flood: 40 streams, 60 MiB announced, 40 MiB sent",
        pick_flood(router.grpc, 1, 40, 60 << 20, 40 << 20),
    )
    .await;
    s.attack(
        "extproc-stalled-messages: 40 streams, 64 MiB announced, 1 MiB sent",
        grpc::extproc_stalled_messages(router.grpc, 40, 64 << 20, 1 << 20),
    )
    .await;
    s.attack(
        "pick-holds-budget: 40 Pick streams, 16 MiB announced, 1 MiB sent, ext_proc beside",
        grpc::pick_holds_budget(router.grpc, 40, 16 << 20, 1 << 20),
    )
    .await;
    s.attack(
        "extproc-stream-flood: 5 conns x 4,000 streams sending request headers",
        grpc::extproc_stream_flood(router.grpc, 5, 4_000),
    )
    .await;
    let explain = "POST /debug/explain HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 125000000\r\n\r\n{\"body\": \"".to_string();
    s.attack(
        "explain flood: 64 conns, Content-Length 125 MB, 96 MiB sent",
        stalled_uploads(router.admin, 64, explain, 96 << 20, 64 << 10),
    )
    .await;
    s.attack(
        "preface flood: 2,000 gRPC conns sending only the preface",
        stalled_uploads(
            router.grpc,
            2_000,
            String::from_utf8_lossy(preface).into(),
            0,
            1,
        ),
    )
    .await;
    s.attack(
        "admin slowloris: 2,000 conns, a header byte a second, reconnecting",
        dribble(router.admin, 2_000, b"GET /healthz HTTP/1.1\r\nhost: x\r\n"),
    )
    .await;
    s.attack(
        "admin-h2-zero-window: 520 HTTP/2 conns asking /metrics with a zero window, reconnecting",
        admin::h2_zero_window(router.admin, 520),
    )
    .await;
    s.attack(
        "admin-slow-read: 600 HTTP/1.1 conns reading /metrics a byte a second, reconnecting",
        admin::slow_read(router.admin, 600),
    )
    .await;
    admin::fd_limit(&mut s, bins, 1024, 2_000).await?;
    let envoy = find_envoy(None)?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../envoy");
    for (mode, file) in [
        ("FULL_DUPLEX", "gie-full-duplex.yaml"),
        ("BUFFERED", "override-host-buffered.yaml"),
    ] {
        let name =
            format!("{mode} held uploads via Envoy: 400 x 2 MiB, 1 MiB sent in 64 KiB writes");
        if !s.wants(&name) {
            continue;
        }
        let e = EnvoyProc::spawn(&envoy, &root.join(file), Some(router.grpc), &[pod.addr]).await?;
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{{\"model\": \"m\", \"prompt\": \"",
            2 << 20
        );
        s.attack(
            &name,
            stalled_uploads(e.listen, 400, head, 1 << 20, 64 << 10),
        )
        .await;
        drop(e);
    }
    s.attack(
        hostile_envoy::BUFFERED.name,
        hostile_envoy::held_uploads(
            &envoy,
            &root,
            &hostile_envoy::BUFFERED,
            router.grpc,
            pod.addr,
            hold,
        ),
    )
    .await;
    s.attack(
        hostile_envoy::FULL_DUPLEX.name,
        hostile_envoy::held_uploads(
            &envoy,
            &root,
            &hostile_envoy::FULL_DUPLEX,
            router.grpc,
            pod.addr,
            hold,
        ),
    )
    .await;
    if router.process().exited().is_some() {
        anyhow::bail!(
            "kv-router exited during the run:\n{}",
            router.stderr_tail(20)
        );
    }
    Ok(s.results)
}

/// The results as a table.
pub fn table(results: &[AttackResult], style: Style) -> String {
    let mut t = Table::new([
        "attack",
        "RSS before",
        "peak RSS",
        "bound",
        "RSS after",
        "settled in",
        "peak fds",
        "probes (failed)",
        "probe p99",
        "probe worst",
        "what the attacker saw",
    ])
    .left(0)
    .left(10);
    let mib = |b: u64| format!("{:.0} MiB", b as f64 / (1 << 20) as f64);
    for r in results {
        t.row(vec![
            r.attack.clone(),
            mib(r.rss_before),
            mib(r.rss_peak),
            mib(r.rss_bound),
            mib(r.rss_after),
            r.settle_s.map_or("> 60 s".into(), |s| format!("{s:.1} s")),
            r.fds_peak.to_string(),
            format!("{} ({})", r.probes, r.probe_failures),
            format!("{:.1} ms", r.probe_p99_ms),
            format!("{:.1} ms", r.probe_worst_ms),
            r.note.clone(),
        ]);
    }
    t.render(style)
}
