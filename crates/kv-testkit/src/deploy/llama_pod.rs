//! Real engines: llama.cpp `llama-server` processes (built by `make llama`), started like the
//! simulated pods so a benchmark can run the same workload on engines with their own latency.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::{free_addr, http, temp_dir, ChildProc};

/// How each `llama-server` pod runs.
#[derive(Debug, Clone)]
pub struct LlamaOptions {
    /// The `llama-server` binary.
    pub server: PathBuf,
    /// The GGUF model file.
    pub model: PathBuf,
    /// CPU threads per pod (`--threads`, `--threads-batch`).
    pub threads: usize,
    /// Parallel slots per pod (`--parallel`).
    pub slots: usize,
    /// Context per slot, tokens (`--ctx-size` is this × slots).
    pub ctx_per_slot: usize,
    /// The model name it serves (`--alias`: the workloads' `model`).
    pub alias: String,
}

impl LlamaOptions {
    /// One thread, two slots of 4096 tokens each.
    pub fn new(server: PathBuf, model: PathBuf) -> Self {
        Self {
            server,
            model,
            threads: 1,
            slots: 2,
            ctx_per_slot: 4096,
            alias: "sim-model".into(),
        }
    }

    /// The pods' command line after `--host`/`--port`, as reports print it.
    pub fn args(&self) -> Vec<String> {
        [
            "--threads",
            &self.threads.to_string(),
            "--threads-batch",
            &self.threads.to_string(),
            "--parallel",
            &self.slots.to_string(),
            "--ctx-size",
            &(self.ctx_per_slot * self.slots).to_string(),
            "--alias",
            &self.alias,
            // Prompt cache: each slot keeps its prompt and reuses the common prefix of the next.
            "--cache-prompt",
            "--metrics",
            "--no-webui",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

/// How long a pod may take to load its model and answer `/health`.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// One `llama-server` process on 127.0.0.1.
#[derive(Debug)]
pub struct LlamaPod {
    /// Where it listens.
    pub addr: SocketAddr,
    proc: ChildProc,
}

impl LlamaPod {
    /// Starts a pod and waits until `/health` answers 200 (the model is loaded).
    pub async fn spawn(opts: &LlamaOptions) -> Result<Self> {
        let addr = free_addr()?;
        let mut cmd = Command::new(&opts.server);
        cmd.arg("--model")
            .arg(&opts.model)
            .args(["--host", "127.0.0.1", "--port", &addr.port().to_string()])
            .args(opts.args());
        let mut proc = ChildProc::spawn("llama-server", cmd, temp_dir("llama-server-")?, false)?;
        let client = http();
        let url = format!("http://{addr}/health");
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = proc.exited() {
                bail!(
                    "llama-server exited with {status}: {}",
                    proc.stderr_tail(20)
                );
            }
            if let Ok(r) = client.get(&url).send().await {
                if r.status().is_success() {
                    return Ok(Self { addr, proc });
                }
            }
            if Instant::now() > deadline {
                let tail = proc.stderr_tail(20);
                proc.kill();
                bail!("llama-server not healthy after {READY_TIMEOUT:?}: {tail}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `n` pods, started one after another (each loads the model on its own).
    pub async fn fleet(opts: &LlamaOptions, n: usize) -> Result<Vec<Self>> {
        let mut pods = Vec::with_capacity(n);
        for _ in 0..n {
            pods.push(Self::spawn(opts).await?);
        }
        Ok(pods)
    }

    /// The pod's `/metrics` text (`llamacpp:` counters).
    pub async fn metrics(&self) -> Result<String> {
        let url = format!("http://{}/metrics", self.addr);
        Ok(http().get(url).send().await?.text().await?)
    }

    /// The last `lines` lines of its log.
    pub fn stderr_tail(&self, lines: usize) -> String {
        self.proc.stderr_tail(lines)
    }
}

/// Whether `path` looks like a runnable `llama-server` (for clear errors before a long run).
pub fn check_llama(opts: &LlamaOptions) -> Result<()> {
    let exists = |p: &Path, what: &str| {
        if p.is_file() {
            Ok(())
        } else {
            Err(anyhow::anyhow!(
                "{what} {} not found (run `make llama`)",
                p.display()
            ))
        }
    };
    exists(&opts.server, "llama-server")?;
    exists(&opts.model, "model")
}
