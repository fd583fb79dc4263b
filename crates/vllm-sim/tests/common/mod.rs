//! What the binary's HTTP tests share: a `vllm-sim` process on a free port.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A running `vllm-sim` (killed on drop) and the `ip:port` it listens on.
pub struct SimProcess {
    child: Child,
    pub addr: String,
}

impl SimProcess {
    /// Starts `vllm-sim --port 0 <args>` and reads the address it prints first.
    pub fn start(args: &[&str]) -> SimProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
            .args(["--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn vllm-sim");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read address line");
        let addr = line
            .trim()
            .strip_prefix("vllm-sim listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        SimProcess { child, addr }
    }
}

impl Drop for SimProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// No modelled latency: for tests of behaviour, not of timing.
#[allow(dead_code)] // not every test binary uses it
pub const FAST: &[&str] = &[
    "--prefill-us-per-token",
    "0",
    "--ttft-base-ms",
    "0",
    "--decode-ms-per-token",
    "0",
];

/// A running `vllm-sim` (killed on drop) with a client for its base URL; each test binary adds
/// the requests it needs in its own `impl Sim`.
#[allow(dead_code)] // not every test binary uses it
pub struct Sim {
    _process: SimProcess,
    pub base: String,
    pub client: reqwest::Client,
}

#[allow(dead_code)]
impl Sim {
    /// Starts `vllm-sim <args>` on a free port.
    pub fn start(args: &[&str]) -> Sim {
        let process = SimProcess::start(args);
        Sim {
            base: format!("http://{}", process.addr),
            _process: process,
            client: reqwest::Client::new(),
        }
    }
}
