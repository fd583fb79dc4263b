//! epp-conformance: a black-box conformance suite for endpoint pickers, the Envoy ext_proc gRPC
//! servers of the Gateway API Inference Extension (GIE) Endpoint Picker Protocol.
//!
//! The suite starts simulated vLLM pods (`vllm-sim`) on distinct loopback addresses, points two
//! real Envoys at the picker (one with a BUFFERED request body, one FULL_DUPLEX_STREAMED both
//! ways), sends requests through them and checks where each one was served: the GIE conformance
//! hooks (`test-epp-endpoint-selection`, `x-conformance-test-*`), the subset hint, body shapes,
//! streaming, forged routing headers, gRPC health and, when it runs the picker itself, what
//! Envoy does once the picker is gone. See `README.md`.

pub mod cases;
pub mod control;
pub mod http;
pub mod rig;

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// How Envoy hands bodies to the picker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mode {
    /// `request_body_mode: BUFFERED` (response headers SEND, response body NONE).
    Buffered,
    /// `FULL_DUPLEX_STREAMED` both ways, trailers SEND (the Endpoint Picker Protocol).
    FullDuplex,
}

impl Mode {
    /// Both modes, in the order they run.
    pub const ALL: [Mode; 2] = [Mode::Buffered, Mode::FullDuplex];

    /// The name in case names and the summary.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Buffered => "buffered",
            Mode::FullDuplex => "full-duplex",
        }
    }

    /// The Envoy bootstrap template of this mode (embedded in the binary).
    pub fn envoy_template(self) -> &'static str {
        match self {
            Mode::Buffered => include_str!("../envoy/buffered.yaml"),
            Mode::FullDuplex => include_str!("../envoy/full-duplex.yaml"),
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the picker under test comes from.
#[derive(Debug, Clone)]
pub enum PickerSpec {
    /// Already running, configured by the user with the suite's pods (`--pods`).
    Addr {
        /// Its ext_proc gRPC address.
        grpc: SocketAddr,
        /// Where it answers gRPC health (default: `grpc`).
        health: Option<SocketAddr>,
    },
    /// Started (and killed) by the suite: a shell command line with placeholders (see
    /// [`rig::Placeholders`]), and optionally a config file template rendered to `{config}`.
    Cmd {
        /// The command line.
        command: String,
        /// The config template's text.
        config_template: Option<String>,
        /// How long the picker may take to listen and route a first request.
        ready_timeout: Duration,
    },
}

/// Everything one run needs.
#[derive(Debug, Clone)]
pub struct Options {
    /// The Envoy binary.
    pub envoy: PathBuf,
    /// The `vllm-sim` binary (the stub pods).
    pub vllm_sim: PathBuf,
    /// The picker under test.
    pub picker: PickerSpec,
    /// The modes to run.
    pub modes: Vec<Mode>,
    /// Fixed pod addresses (`--pods`); None: free ports on the suite's loopback addresses.
    pub pods: Option<rig::PodLayout>,
    /// Whether to run the IPv6 pod (`[::1]`) and its cases.
    pub ipv6: bool,
    /// Run only the cases whose full name contains one of these.
    pub only: Vec<String>,
}

/// How one case ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The picker did what the protocol asks; the note says what was seen.
    Pass(String),
    /// It did not; the reason.
    Fail(String),
    /// The case could not run here (e.g. the picker was not started by the suite).
    Skip(String),
}

/// One case's result.
#[derive(Debug, Clone)]
pub struct CaseResult {
    /// `<mode>/<case>` or `<case>` for mode-independent cases.
    pub name: String,
    /// The mode, when the case ran through an Envoy.
    pub mode: Option<Mode>,
    /// What happened.
    pub outcome: Outcome,
}

/// A run's results, in the order the cases ran.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Every case.
    pub results: Vec<CaseResult>,
}

impl Report {
    /// Names of the failed cases.
    pub fn failed(&self) -> Vec<String> {
        self.names(|o| matches!(o, Outcome::Fail(_)))
    }

    /// Names of the passed cases.
    pub fn passed(&self) -> Vec<String> {
        self.names(|o| matches!(o, Outcome::Pass(_)))
    }

    fn names(&self, keep: impl Fn(&Outcome) -> bool) -> Vec<String> {
        self.results
            .iter()
            .filter(|r| keep(&r.outcome))
            .map(|r| r.name.clone())
            .collect()
    }

    /// The last line: `epp-conformance: N passed, M failed (mode buffered: p/n, ...)`.
    pub fn summary(&self) -> String {
        let count = |mode: Option<Mode>| {
            let of: Vec<_> = self.results.iter().filter(|r| r.mode == mode).collect();
            let pass = of
                .iter()
                .filter(|r| matches!(r.outcome, Outcome::Pass(_)))
                .count();
            let run = of
                .iter()
                .filter(|r| !matches!(r.outcome, Outcome::Skip(_)))
                .count();
            (pass, run)
        };
        let mut parts = Vec::new();
        for mode in Mode::ALL {
            let (p, n) = count(Some(mode));
            if n > 0 {
                parts.push(format!("mode {mode}: {p}/{n} passed"));
            }
        }
        let (p, n) = count(None);
        if n > 0 {
            parts.push(format!("health: {p}/{n} passed"));
        }
        let skipped = self.results.len() - self.passed().len() - self.failed().len();
        let skipped = if skipped > 0 {
            format!(", {skipped} skipped")
        } else {
            String::new()
        };
        format!(
            "epp-conformance: {} passed, {} failed{skipped} ({})",
            self.passed().len(),
            self.failed().len(),
            parts.join(", ")
        )
    }
}

impl fmt::Display for CaseResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            Outcome::Pass(note) if note.is_empty() => write!(f, "PASS {}", self.name),
            Outcome::Pass(note) => write!(f, "PASS {} ({note})", self.name),
            Outcome::Fail(why) => write!(f, "FAIL {}: {why}", self.name),
            Outcome::Skip(why) => write!(f, "SKIP {}: {why}", self.name),
        }
    }
}

/// Starts the pods, the picker (in cmd mode) and one Envoy per mode, runs every case and returns
/// the report; `progress` sees each result as it comes. Errors only when the rig cannot start.
pub async fn run(opts: &Options, progress: impl FnMut(&CaseResult)) -> anyhow::Result<Report> {
    let rig = rig::Rig::start(opts).await?;
    Ok(cases::run_all(rig, opts, progress).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(name: &str, mode: Option<Mode>, outcome: Outcome) -> CaseResult {
        CaseResult {
            name: name.into(),
            mode,
            outcome,
        }
    }

    #[test]
    fn the_summary_counts_by_mode_and_skips_apart() {
        let report = Report {
            results: vec![
                result("health.x", None, Outcome::Pass(String::new())),
                result(
                    "buffered/a",
                    Some(Mode::Buffered),
                    Outcome::Pass("ok".into()),
                ),
                result(
                    "buffered/b",
                    Some(Mode::Buffered),
                    Outcome::Fail("no".into()),
                ),
                result(
                    "full-duplex/a",
                    Some(Mode::FullDuplex),
                    Outcome::Skip("x".into()),
                ),
            ],
        };
        assert_eq!(report.failed(), ["buffered/b"]);
        assert_eq!(
            report.summary(),
            "epp-conformance: 2 passed, 1 failed, 1 skipped (mode buffered: 1/2 passed, health: 1/1 passed)"
        );
        assert_eq!(report.results[2].to_string(), "FAIL buffered/b: no");
    }
}
