//! The Envoy processes the Istio-shaped tests run: validated (deprecated fields fail too), run
//! until LIVE, killed on drop; the oldest supported Istio's Envoy; the router's per-pod decisions
//! and Prometheus sums they compare with what the pods served.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{root, MIN_ENVOY, MIN_ISTIO};

/// Envoy killed on drop.
pub struct Envoy {
    child: Child,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Envoy {
    /// Runs `bin -c cfg` (with `args`) until its admin port on `admin` says LIVE; `dir` holds its
    /// stderr and lives as long as it does.
    pub async fn run(
        bin: &Path,
        cfg: &Path,
        args: &[&str],
        (listen, admin): (u16, u16),
        dir: tempfile::TempDir,
        what: &str,
    ) -> Self {
        let child = Command::new(bin)
            .arg("-c")
            .arg(cfg)
            .args(args)
            .args(["--log-level", "warn", "--concurrency", "1"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("stderr.log")).unwrap())
            .spawn()
            .unwrap();
        let e = Envoy {
            child,
            listen: SocketAddr::from(([127, 0, 0, 1], listen)),
            admin: SocketAddr::from(([127, 0, 0, 1], admin)),
            dir,
        };
        // Generous: under a loaded CI machine an Envoy start took past 20 s.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = reqwest::get(format!("http://{}/ready", e.admin)).await {
                if r.text().await.unwrap_or_default().trim() == "LIVE" {
                    return e;
                }
            }
            assert!(
                Instant::now() < deadline,
                "{what}: Envoy not LIVE:\n{}",
                e.stderr()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }

    /// One counter of its `/stats` (0 when absent).
    pub async fn stat(&self, name: &str) -> u64 {
        let stats = reqwest::get(format!("http://{}/stats", self.admin))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// `envoy --mode validate` of `cfg` with `envoy`, failing on deprecated fields too.
pub fn validate(envoy: &Path, cfg: &Path, what: &str) {
    let out = Command::new(envoy)
        .args(["--mode", "validate", "--log-level", "warn", "-c"])
        .arg(cfg)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !stderr.contains("Deprecated"),
        "{what}: the gateway config fails --mode validate (or uses a deprecated field):\n{stderr}\n{}",
        std::fs::read_to_string(cfg).unwrap()
    );
}

/// Envoy as built into the oldest supported Istio's proxy: `$KV_ROUTER_ENVOY_MIN`, else the copy
/// `make envoy-min` installs into `.venv/envoy-<MIN_ENVOY>/`. Missing, it fails (never skips).
pub fn min_envoy() -> PathBuf {
    let path = std::env::var_os("KV_ROUTER_ENVOY_MIN")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(format!(".venv/envoy-{MIN_ENVOY}/envoy/_bin/envoy")));
    assert!(
        path.exists(),
        "Envoy {MIN_ENVOY} (Istio {MIN_ISTIO}'s proxy) not found at {}: run `make envoy-min` or set KV_ROUTER_ENVOY_MIN",
        path.display()
    );
    let out = Command::new(&path).arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(
        version.contains(&format!("/{MIN_ENVOY}.")),
        "{} is not Envoy {MIN_ENVOY}: {version}",
        path.display()
    );
    path
}

/// `pod → count` of the router's `kv_router_decisions_total{pod=...}` samples.
pub fn decisions_by_pod(metrics: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for l in metrics.lines() {
        let Some(rest) = l.strip_prefix("kv_router_decisions_total{") else {
            continue;
        };
        let Some(pod) = rest
            .split("pod=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
        else {
            continue;
        };
        let v: f64 = rest.rsplit(' ').next().unwrap().parse().unwrap();
        *out.entry(pod.to_string()).or_insert(0) += v as u64;
    }
    out
}

/// Sum of every sample of `name` in a Prometheus text scrape.
pub fn sum_samples(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}
