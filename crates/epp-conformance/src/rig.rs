//! The processes a run needs: stub pods on distinct loopback addresses, the picker (when the suite
//! starts it) and one Envoy per mode. Every process is killed when its handle is dropped.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use kv_testkit::deploy::{die_with_parent, EnvoyOptions, EnvoyProc};

use crate::{Mode, Options, PickerSpec};

/// The model every stub pod serves (the GIE conformance tests' model name).
pub const MODEL: &str = "conformance-fake-model";

/// The pods, by role in the cases: `a` and `b` alone on their IPs, `c1`/`c2` two ports of one IP
/// (data parallelism: one pod, several target ports), `v6` on `[::1]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodLayout {
    /// Alone on 127.0.0.2.
    pub a: SocketAddr,
    /// Alone on 127.0.0.3.
    pub b: SocketAddr,
    /// First port of 127.0.0.4.
    pub c1: SocketAddr,
    /// Second port of 127.0.0.4.
    pub c2: SocketAddr,
    /// On `[::1]`, when IPv6 runs.
    pub v6: Option<SocketAddr>,
}

impl PodLayout {
    /// The fixed addresses `epp-conformance pods` prints, for a picker configured by hand.
    pub fn default_fixed(ipv6: bool) -> Self {
        let at = |s: &str| s.parse().expect("static address");
        Self {
            a: at("127.0.0.2:18001"),
            b: at("127.0.0.3:18001"),
            c1: at("127.0.0.4:18001"),
            c2: at("127.0.0.4:18002"),
            v6: ipv6.then(|| at("[::1]:18003")),
        }
    }

    /// Parses `a,b,c1,c2[,v6]` and checks the shape the cases rely on.
    pub fn parse(s: &str) -> Result<Self> {
        let addrs: Vec<SocketAddr> = s
            .split(',')
            .map(|p| p.trim().parse().with_context(|| format!("pod {p:?}")))
            .collect::<Result<_>>()?;
        let (a, b, c1, c2, v6) = match addrs[..] {
            [a, b, c1, c2] => (a, b, c1, c2, None),
            [a, b, c1, c2, v6] => (a, b, c1, c2, Some(v6)),
            _ => bail!(
                "--pods takes 4 or 5 addresses (a,b,c1,c2[,v6]), got {}",
                addrs.len()
            ),
        };
        let l = Self { a, b, c1, c2, v6 };
        l.check()?;
        Ok(l)
    }

    fn check(&self) -> Result<()> {
        let ips = [self.a.ip(), self.b.ip(), self.c1.ip()];
        if ips[0] == ips[1] || ips[0] == ips[2] || ips[1] == ips[2] {
            bail!("pods a, b and c1 need three different IPs");
        }
        if self.c1.ip() != self.c2.ip() || self.c1.port() == self.c2.port() {
            bail!("pods c1 and c2 need the same IP and different ports");
        }
        if let Some(v6) = self.v6 {
            if !v6.is_ipv6() || ips.contains(&v6.ip()) {
                bail!("the fifth pod must be on an IPv6 address of its own");
            }
        }
        Ok(())
    }

    /// Every pod, in layout order.
    pub fn all(&self) -> Vec<SocketAddr> {
        let mut v = vec![self.a, self.b, self.c1, self.c2];
        v.extend(self.v6);
        v
    }

    /// The comma list `ip:port,...` (`{pods}`).
    pub fn comma_list(&self) -> String {
        self.all()
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// A child process killed (its whole process group) when dropped, with its output in a
/// private directory.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl Proc {
    fn spawn(name: &str, mut cmd: Command, pipe_stdout: bool) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("epp-conformance-")
            .tempdir()?;
        cmd.stdin(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("stderr.log"))?)
            .process_group(0);
        if pipe_stdout {
            cmd.stdout(Stdio::piped());
        } else {
            cmd.stdout(std::fs::File::create(dir.path().join("stdout.log"))?);
        }
        die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        Ok(Self {
            name: name.to_string(),
            child: Some(child),
            dir,
        })
    }

    /// Whether it has exited.
    pub fn exited(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().ok().flatten().is_some(),
            None => true,
        }
    }

    /// SIGKILL to its process group (a shell command's children too), then reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = rustix::process::Pid::from_child(&c);
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The last `n` lines of its stderr and stdout.
    pub fn tail(&self, n: usize) -> String {
        let mut out = String::new();
        for f in ["stderr.log", "stdout.log"] {
            let text = std::fs::read_to_string(self.dir.path().join(f)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let from = lines.len().saturating_sub(n);
            if from < lines.len() {
                out.push_str(&format!(
                    "--- {} {f} ---\n{}\n",
                    self.name,
                    lines[from..].join("\n")
                ));
            }
        }
        out
    }

    /// Its private directory (rendered config files live here).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `vllm-sim` on `addr` (port 0: a free one) and returns the address it announced.
fn spawn_pod(bin: &Path, addr: SocketAddr) -> Result<(SocketAddr, Proc)> {
    let mut cmd = Command::new(bin);
    cmd.args(["--host", &addr.ip().to_string()])
        .args(["--port", &addr.port().to_string()])
        .args(["--model", MODEL])
        // Fast tokens, but slow enough that a stream's events arrive spread over time.
        .args(["--ttft-base-ms", "1", "--prefill-us-per-token", "1"])
        .args(["--decode-ms-per-token", "25"])
        // A decode pod honours x-prefiller-host-port: a forged one shows as a remote prefill.
        .args(["--role", "decode"]);
    let mut proc = Proc::spawn(&format!("vllm-sim {addr}"), cmd, true)?;
    let stdout = proc
        .child
        .as_mut()
        .and_then(|c| c.stdout.take())
        .ok_or_else(|| anyhow!("no stdout"))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            if let Some(rest) = line.trim().strip_prefix("vllm-sim listening on ") {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(rest.trim().to_string());
                }
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(a) => {
                let got: SocketAddr = a.parse().with_context(|| format!("vllm-sim said {a:?}"))?;
                return Ok((got, proc));
            }
            Err(_) if proc.exited() || Instant::now() > deadline => {
                bail!("vllm-sim on {addr} did not start:\n{}", proc.tail(20))
            }
            Err(_) => {}
        }
    }
}

/// The values substituted into `--picker-cmd` and `--picker-config`.
#[derive(Debug, Clone)]
pub struct Placeholders(BTreeMap<&'static str, String>);

impl Placeholders {
    fn new(pods: &PodLayout, workdir: &Path) -> Result<Self> {
        let port = || kv_testkit::deploy::free_port();
        let mut m = BTreeMap::new();
        let grpc = port()?;
        m.insert("grpc_port", grpc.to_string());
        m.insert("grpc_addr", format!("127.0.0.1:{grpc}"));
        m.insert("health_port", port()?.to_string());
        m.insert("metrics_port", port()?.to_string());
        m.insert("admin_port", port()?.to_string());
        m.insert("pods", pods.comma_list());
        let quoted: Vec<String> = pods.all().iter().map(|a| format!("\"{a}\"")).collect();
        m.insert("pods_json", format!("[{}]", quoted.join(", ")));
        let objects: Vec<String> = pods
            .all()
            .iter()
            .map(|a| format!("{{\"address\": \"{a}\"}}"))
            .collect();
        m.insert("pods_objects_json", format!("[{}]", objects.join(", ")));
        m.insert("model", MODEL.to_string());
        m.insert("workdir", workdir.display().to_string());
        m.insert(
            "config",
            workdir.join("picker-config").display().to_string(),
        );
        Ok(Self(m))
    }

    /// `text` with every `{name}` replaced.
    pub fn render(&self, text: &str) -> String {
        let mut out = text.to_string();
        for (k, v) in &self.0 {
            out = out.replace(&format!("{{{k}}}"), v);
        }
        out
    }

    fn port(&self, key: &str) -> u16 {
        self.0[key].parse().expect("a port")
    }
}

/// The picker under test as the suite reaches it.
#[derive(Debug)]
pub struct Picker {
    /// Its ext_proc address.
    pub grpc: SocketAddr,
    /// Where gRPC health answers.
    pub health: SocketAddr,
    /// The process, when the suite started it.
    pub proc: Option<Proc>,
    /// Its rendered config, kept while it runs.
    _workdir: Option<tempfile::TempDir>,
}

impl Picker {
    async fn start(spec: &PickerSpec, pods: &PodLayout) -> Result<Self> {
        let (command, template, timeout) = match spec {
            PickerSpec::Addr { grpc, health } => {
                return Ok(Self {
                    grpc: *grpc,
                    health: health.unwrap_or(*grpc),
                    proc: None,
                    _workdir: None,
                })
            }
            PickerSpec::Cmd {
                command,
                config_template,
                ready_timeout,
            } => (command, config_template, *ready_timeout),
        };
        let workdir = tempfile::Builder::new()
            .prefix("epp-conformance-picker-")
            .tempdir()?;
        let ph = Placeholders::new(pods, workdir.path())?;
        if let Some(t) = template {
            std::fs::write(workdir.path().join("picker-config"), ph.render(t))?;
        }
        let line = ph.render(command);
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(&line);
        let mut proc = Proc::spawn("picker", cmd, false)?;
        // The rendered config goes with the process's directory, for the failure message.
        if template.is_some() {
            let _ = std::fs::copy(
                workdir.path().join("picker-config"),
                proc.dir().join("picker-config"),
            );
        }
        let grpc = SocketAddr::from(([127, 0, 0, 1], ph.port("grpc_port")));
        let uses_health = command.contains("{health_port}")
            || template
                .as_ref()
                .is_some_and(|t| t.contains("{health_port}"));
        let health = match uses_health {
            true => SocketAddr::from(([127, 0, 0, 1], ph.port("health_port"))),
            false => grpc,
        };
        let deadline = Instant::now() + timeout;
        while tokio::net::TcpStream::connect(grpc).await.is_err() {
            if proc.exited() {
                bail!(
                    "the picker exited before listening on {grpc} ({line}):\n{}",
                    proc.tail(30)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "the picker did not listen on {grpc} in {timeout:?} ({line}):\n{}",
                    proc.tail(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Self {
            grpc,
            health,
            proc: Some(proc),
            _workdir: Some(workdir),
        })
    }

    /// Kills the picker the suite started (false when it did not start one).
    pub fn kill(&mut self) -> bool {
        match self.proc.as_mut() {
            Some(p) => {
                p.kill();
                true
            }
            None => false,
        }
    }

    /// Its log tail (empty when the suite did not start it).
    pub fn tail(&self, n: usize) -> String {
        self.proc.as_ref().map(|p| p.tail(n)).unwrap_or_default()
    }
}

/// Pods, picker and Envoys of one run.
pub struct Rig {
    /// Pod addresses by role.
    pub pods: PodLayout,
    /// The pod processes.
    pub pod_procs: Vec<Proc>,
    /// The picker.
    pub picker: Picker,
    /// One Envoy per mode.
    pub envoys: Vec<(Mode, EnvoyProc)>,
    /// The picker's ready deadline for warm-up.
    pub ready_timeout: Duration,
}

impl Rig {
    /// Starts everything `opts` asks for.
    pub async fn start(opts: &Options) -> Result<Self> {
        let wanted = match &opts.pods {
            Some(l) => l.clone(),
            None => {
                let at = |s: &str| s.parse::<SocketAddr>().expect("static address");
                PodLayout {
                    a: at("127.0.0.2:0"),
                    b: at("127.0.0.3:0"),
                    c1: at("127.0.0.4:0"),
                    c2: at("127.0.0.4:0"),
                    v6: opts.ipv6.then(|| at("[::1]:0")),
                }
            }
        };
        let mut pod_procs = Vec::new();
        let mut got = Vec::new();
        for addr in wanted.all() {
            let (a, p) = spawn_pod(&opts.vllm_sim, addr)?;
            got.push(a);
            pod_procs.push(p);
        }
        let pods = PodLayout {
            a: got[0],
            b: got[1],
            c1: got[2],
            c2: got[3],
            v6: got.get(4).copied(),
        };
        pods.check()?;
        let picker = Picker::start(&opts.picker, &pods).await?;
        let mut envoys = Vec::new();
        let dir = tempfile::Builder::new()
            .prefix("epp-conformance-envoy-")
            .tempdir()?;
        for mode in &opts.modes {
            let path: PathBuf = dir.path().join(format!("{}.yaml", mode.name()));
            std::fs::write(&path, mode.envoy_template())?;
            let e = EnvoyProc::spawn_with(
                &opts.envoy,
                &path,
                Some(picker.grpc),
                &pods.all(),
                &EnvoyOptions::default(),
            )
            .await
            .with_context(|| format!("starting Envoy ({mode})"))?;
            envoys.push((*mode, e));
        }
        let ready_timeout = match &opts.picker {
            PickerSpec::Cmd { ready_timeout, .. } => *ready_timeout,
            PickerSpec::Addr { .. } => Duration::from_secs(30),
        };
        Ok(Self {
            pods,
            pod_procs,
            picker,
            envoys,
            ready_timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_needs_three_ips_and_two_ports_of_one() {
        let l =
            PodLayout::parse("127.0.0.2:1,127.0.0.3:1, 127.0.0.4:1,127.0.0.4:2,[::1]:3").unwrap();
        assert_eq!(l, PodLayout::parse(&l.comma_list()).unwrap());
        assert_eq!(l.v6, Some("[::1]:3".parse().unwrap()));
        assert_eq!(PodLayout::default_fixed(true).all().len(), 5);
        assert_eq!(PodLayout::default_fixed(false).all().len(), 4);
        for bad in [
            "127.0.0.2:1,127.0.0.2:2,127.0.0.4:1,127.0.0.4:2",
            "127.0.0.2:1,127.0.0.3:1,127.0.0.4:1,127.0.0.5:2",
            "127.0.0.2:1,127.0.0.3:1,127.0.0.4:1,127.0.0.4:1",
            "127.0.0.2:1,127.0.0.3:1,127.0.0.4:1,127.0.0.4:2,127.0.0.6:1",
            "127.0.0.2:1,127.0.0.3:1,127.0.0.4:1",
        ] {
            assert!(PodLayout::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn placeholders_render_every_name() {
        let l = PodLayout::parse("127.0.0.2:1,127.0.0.3:1,127.0.0.4:1,127.0.0.4:2").unwrap();
        let ph = Placeholders::new(&l, Path::new("/tmp/w")).unwrap();
        let out = ph.render("{pods}|{pods_json}|{pods_objects_json}|{model}|{config}|{grpc_addr}");
        let parts: Vec<&str> = out.split('|').collect();
        assert_eq!(parts[0], "127.0.0.2:1,127.0.0.3:1,127.0.0.4:1,127.0.0.4:2");
        let json: Vec<String> = serde_json::from_str(parts[1]).unwrap();
        assert_eq!(json.len(), 4);
        let objects: serde_json::Value = serde_json::from_str(parts[2]).unwrap();
        assert_eq!(objects[3]["address"], "127.0.0.4:2");
        assert_eq!(parts[3], MODEL);
        assert_eq!(parts[4], "/tmp/w/picker-config");
        assert_eq!(parts[5], format!("127.0.0.1:{}", ph.port("grpc_port")));
        assert_eq!(
            ph.render("{unknown}"),
            "{unknown}",
            "unknown names stay as they are"
        );
    }
}
