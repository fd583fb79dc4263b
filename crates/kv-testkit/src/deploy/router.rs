//! kv-router processes and their local configuration.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kv_router::config::{Config, StaticPod};

use super::{free_addr, http, temp_dir, ChildProc, START_TIMEOUT};

/// How long a router may take to become ready: a precise one waits for its pods' catch-up
/// replays (at most 75 s) on top of the usual start.
const READY_TIMEOUT: Duration = Duration::from_secs(75).saturating_add(START_TIMEOUT);

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
    proc: ChildProc,
}

impl RouterProc {
    /// CPU seconds the router process has used so far (None once it is gone).
    pub fn cpu_seconds(&self) -> Option<f64> {
        self.proc.cpu_seconds()
    }

    /// Writes `config` to a temporary `router.yaml`, runs `kv-router serve --config …` and waits
    /// until `GET /readyz` answers 200. If a listen port turns out to be taken, retries with
    /// fresh ports.
    pub async fn spawn(bin: &Path, config: &Config) -> Result<Self> {
        Self::spawn_without(bin, config, &[]).await
    }

    /// As [`Self::spawn`], with the dotted keys in `omit` left out of the config file written
    /// (an earlier build refuses keys it does not know).
    pub async fn spawn_without(bin: &Path, config: &Config, omit: &[&str]) -> Result<Self> {
        let mut config = config.clone();
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::spawn_once(bin, &config, omit).await {
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

    async fn spawn_once(
        bin: &Path,
        config: &Config,
        omit: &[&str],
    ) -> Result<Self, (anyhow::Error, bool)> {
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
        let mut value = serde_yaml::to_value(config)
            .context("serialize router config")
            .map_err(plain)?;
        for key in omit {
            remove_key(&mut value, key);
        }
        let yaml = serde_yaml::to_string(&value)
            .context("serialize router config")
            .map_err(plain)?;
        std::fs::write(&cfg_path, yaml).map_err(|e| plain(e.into()))?;
        let mut cmd = Command::new(bin);
        cmd.arg("serve").arg("--config").arg(&cfg_path);
        let mut proc = ChildProc::spawn("kv-router", cmd, dir, false).map_err(plain)?;
        let url = format!("http://{admin}/readyz");
        let client = http();
        let deadline = Instant::now() + READY_TIMEOUT;
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
        Ok(Self { grpc, admin, proc })
    }

    /// `http://<admin>`.
    #[allow(dead_code)] // the end-to-end tests' harness (tests/integration/common mounts deploy/)
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin)
    }

    /// `GET /metrics` as text.
    pub async fn metrics(&self) -> Result<String> {
        let r = http()
            .get(format!("http://{}/metrics", self.admin))
            .send()
            .await?;
        Ok(r.text().await?)
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
    #[allow(dead_code)] // the end-to-end tests' harness
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
    #[allow(dead_code)] // the end-to-end tests' harness
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

    /// The router's whole log (stderr), which goes with the process's directory.
    pub fn log_path(&self) -> std::path::PathBuf {
        self.proc.dir().join("stderr.log")
    }
}

/// Removes `dotted` (`server.max_extproc_streams`) from a YAML mapping, when present.
fn remove_key(value: &mut serde_yaml::Value, dotted: &str) {
    let (parent, last) = match dotted.rsplit_once('.') {
        Some((p, l)) => (Some(p), l),
        None => (None, dotted),
    };
    let mut at = value;
    for part in parent.into_iter().flat_map(|p| p.split('.')) {
        match at.get_mut(part) {
            Some(v) => at = v,
            None => return,
        }
    }
    if let Some(m) = at.as_mapping_mut() {
        m.remove(last);
    }
}

#[cfg(test)]
mod tests {
    use super::remove_key;

    #[test]
    fn remove_key_drops_a_nested_key_and_ignores_missing_ones() {
        let mut v: serde_yaml::Value =
            serde_yaml::from_str("server: { a: 1, b: 2 }\ntop: 3\n").unwrap();
        remove_key(&mut v, "server.a");
        remove_key(&mut v, "top");
        remove_key(&mut v, "nowhere.x");
        assert_eq!(serde_yaml::to_string(&v).unwrap(), "server:\n  b: 2\n");
    }
}
