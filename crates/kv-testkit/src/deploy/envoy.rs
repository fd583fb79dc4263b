//! Envoy processes: bootstrap templates rendered for a run (ports, pods, the picker).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_yaml::Value;

use super::{free_addr, http, temp_dir, ChildProc, START_TIMEOUT};

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
/// `listen`, admin on `admin`'s port, cluster `kv_router`'s endpoints to `pickers` (several
/// kv-router replicas: Envoy spreads ext_proc streams over them), and cluster `vllm_pool`'s
/// endpoints to `pods`.
pub fn render_envoy_config(
    template: &str,
    listen: SocketAddr,
    admin: SocketAddr,
    pickers: &[SocketAddr],
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
    fn lb_endpoints(addrs: &[SocketAddr]) -> Value {
        let list = addrs
            .iter()
            .map(|p| {
                let mut addr = serde_yaml::Mapping::new();
                addr.insert("socket_address".into(), socket(*p));
                let mut ep = serde_yaml::Mapping::new();
                ep.insert("address".into(), Value::Mapping(addr));
                let mut m = serde_yaml::Mapping::new();
                m.insert("endpoint".into(), Value::Mapping(ep));
                Value::Mapping(m)
            })
            .collect();
        Value::Sequence(list)
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
                if pickers.is_empty() {
                    bail!("template has a kv_router cluster but no picker address was given");
                }
                let eps = get(c, &["load_assignment", "endpoints"])?;
                let e0 = eps
                    .get_mut(0)
                    .ok_or_else(|| anyhow!("kv_router cluster has no endpoints[0]"))?;
                *get(e0, &["lb_endpoints"])? = lb_endpoints(pickers);
            }
            "vllm_pool" => {
                let eps = get(c, &["load_assignment", "endpoints"])?;
                let e0 = eps
                    .get_mut(0)
                    .ok_or_else(|| anyhow!("vllm_pool has no endpoints[0]"))?;
                *get(e0, &["lb_endpoints"])? = lb_endpoints(pods);
            }
            _ => {}
        }
    }
    if !pickers.is_empty() && !saw_picker {
        bail!("a picker address was given but the template has no kv_router cluster");
    }
    Ok(serde_yaml::to_string(&doc)?)
}

/// Adds `x-vllm-sim-pod: <upstream address>` to every response of listener 0's routes.
fn with_pod_header(rendered: &str) -> Result<String> {
    let mut doc: Value = serde_yaml::from_str(rendered)?;
    let hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]
        .get_mut("route_config")
        .ok_or_else(|| anyhow!("listener 0 has no inline route_config"))?;
    let header: Value = serde_yaml::from_str(
        "[{header: {key: x-vllm-sim-pod, value: '%UPSTREAM_HOST%'}, append_action: OVERWRITE_IF_EXISTS_OR_ADD}]",
    )?;
    hcm["response_headers_to_add"] = header;
    Ok(serde_yaml::to_string(&doc)?)
}

/// Extra Envoy knobs.
#[derive(Debug, Clone)]
pub struct EnvoyOptions {
    /// `--concurrency` (worker threads).
    pub concurrency: u32,
    /// `--log-level`.
    pub log_level: String,
    /// Further kv-router replicas in cluster `kv_router` beside the picker (Envoy's round robin
    /// spreads ext_proc streams over all of them).
    pub more_pickers: Vec<SocketAddr>,
    /// Envoy names the serving pod in the response header `x-vllm-sim-pod` (its upstream
    /// address), for engines that do not name themselves (llama.cpp).
    pub pod_header: bool,
}

impl Default for EnvoyOptions {
    fn default() -> Self {
        Self {
            concurrency: 1,
            log_level: "warn".into(),
            more_pickers: Vec::new(),
            pod_header: false,
        }
    }
}

impl EnvoyProc {
    /// Renders `template` for this run and starts Envoy with default options.
    #[allow(dead_code)] // the end-to-end tests' harness (tests/integration/common mounts deploy/)
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
        let pickers: Vec<SocketAddr> = picker
            .into_iter()
            .chain(opts.more_pickers.iter().copied())
            .collect();
        let rendered = render_envoy_config(text, listen, admin, &pickers, pods)
            .and_then(|r| match opts.pod_header {
                true => with_pod_header(&r),
                false => Ok(r),
            })
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
                // LIVE can precede the workers' listen sockets (reuse_port): wait until one accepts.
                if r.status().is_success()
                    && r.text().await.unwrap_or_default().trim() == "LIVE"
                    && tokio::net::TcpStream::connect(listen).await.is_ok()
                {
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

    /// The process handle (stderr tail, exit status).
    pub fn process(&mut self) -> &mut ChildProc {
        &mut self.proc
    }
}

#[cfg(test)]
mod tests {
    use super::super::envoy_template;
    use super::*;

    #[test]
    fn renders_every_bundled_template() {
        let listen: SocketAddr = "127.0.0.1:18080".parse().unwrap();
        let admin: SocketAddr = "127.0.0.1:19901".parse().unwrap();
        let replicas: Vec<SocketAddr> = vec![
            "127.0.0.1:19002".parse().unwrap(),
            "127.0.0.1:19003".parse().unwrap(),
        ];
        let pickers = |with: bool| if with { &replicas[..] } else { &[] };
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
                render_envoy_config(&text, listen, admin, pickers(with_picker), &pods).unwrap();
            let v: Value = serde_yaml::from_str(&out).unwrap();
            let named: Value = serde_yaml::from_str(&with_pod_header(&out).unwrap()).unwrap();
            let rc = &named["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
                ["typed_config"]["route_config"];
            assert_eq!(
                rc["response_headers_to_add"][0]["header"]["value"].as_str(),
                Some("%UPSTREAM_HOST%"),
                "{name}"
            );
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
                        let lb = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
                            .as_sequence()
                            .unwrap();
                        let ports: Vec<_> = lb
                            .iter()
                            .map(|e| {
                                e["endpoint"]["address"]["socket_address"]["port_value"].as_u64()
                            })
                            .collect();
                        assert_eq!(ports, [Some(19002), Some(19003)], "{name}");
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
        assert!(render_envoy_config(&text, a, a, &[a], &[a]).is_err());
    }
}
