//! Simulated vLLM pods (`vllm-sim` processes).

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::{http, temp_dir, ChildProc, START_TIMEOUT};

/// One simulated vLLM pod.
#[derive(Debug)]
pub struct SimPod {
    /// Where it listens.
    pub addr: SocketAddr,
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
        Ok(Self { addr, proc })
    }

    /// `http://ip:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The process id (to pause it with SIGSTOP, as a frozen node would).
    pub fn pid(&self) -> Option<u32> {
        self.proc.pid()
    }

    /// Kills the pod now (failure tests).
    #[allow(dead_code)] // the end-to-end tests' harness (tests/integration/common mounts deploy/)
    pub fn kill(&mut self) {
        self.proc.kill();
    }
}

/// A pod that publishes KV events, with its event and replay ports.
#[derive(Debug)]
pub struct EventPod {
    /// The pod.
    pub sim: SimPod,
    /// Its ZMQ PUB port.
    pub events_port: u16,
    /// Its replay (ROUTER) port.
    pub replay_port: u16,
}

impl EventPod {
    /// Starts `vllm-sim --pod-name <name> <args>` publishing KV events on two free ports.
    pub fn spawn(bin: &Path, name: &str, args: &[String]) -> Result<Self> {
        let mut last = None;
        for _ in 0..4 {
            let (ep, rp) = (super::free_port()?, super::free_port()?);
            if ep == rp {
                continue;
            }
            let mut a = vec![
                "--pod-name".to_string(),
                name.to_string(),
                "--kv-events-endpoint".to_string(),
                format!("tcp://*:{ep}"),
                "--kv-events-replay-endpoint".to_string(),
                format!("tcp://*:{rp}"),
            ];
            a.extend(args.iter().cloned());
            match SimPod::spawn(bin, &a) {
                Ok(sim) => {
                    return Ok(Self {
                        sim,
                        events_port: ep,
                        replay_port: rp,
                    })
                }
                // An event port taken between probing and binding: try fresh ones.
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no free port pair")))
            .with_context(|| format!("starting {name}"))
    }

    /// Points each of `cfg`'s static pods (in `pods`' order) at its pod's event endpoints.
    pub fn set_endpoints(cfg: &mut kv_router::config::Config, pods: &[EventPod]) {
        for (sp, p) in cfg.pods.static_pods.iter_mut().zip(pods) {
            sp.kv_events_endpoint = Some(format!("tcp://127.0.0.1:{}", p.events_port));
            sp.kv_events_replay_endpoint = Some(format!("tcp://127.0.0.1:{}", p.replay_port));
        }
    }
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
