//! Prefill/decode roles. A `decode` pod given the prefill header first asks the named prefill
//! pod to prefill the prompt (one output token, `kv_transfer_params.do_remote_decode`, as llm-d's
//! decode sidecar asks a vLLM prefiller), then waits the KV transfer of the blocks it lacks at
//! the configured bandwidth, stores them, and decodes, computing only what was not transferred.
//! A prefill pod that fails, times out or cannot be named leaves the decode pod to prefill
//! locally. A `prefill` pod counts the prefills it does for others.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use clap::ValueEnum;
use serde_json::Value;

use crate::actor::EngineHandle;
use crate::engine::Submission;

/// What the pod does in a P/D deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Role {
    /// Prefills for decode pods (and serves plain requests as any pod).
    Prefill,
    /// Honours the prefill header: prefill remotely, transfer, decode.
    Decode,
    /// Aggregated: ignores the header and prefills itself.
    #[default]
    Both,
}

/// P/D settings from the command line.
#[derive(Debug, Clone)]
pub struct PdConfig {
    /// The pod's role.
    pub role: Role,
    /// Request header naming the prefill pod (`ip:port`), lower-case.
    pub header: String,
    /// KV-transfer bandwidth in blocks per second.
    pub transfer_blocks_per_sec: f64,
    /// Longest wait for the prefill pod's answer.
    pub timeout: Duration,
}

/// P/D state shared by the handlers: settings, HTTP client, counters for `/metrics`.
pub struct Pd {
    cfg: PdConfig,
    client: reqwest::Client,
    remote_ok: AtomicU64,
    remote_failed: AtomicU64,
    transfer_blocks: AtomicU64,
    transfer_us: AtomicU64,
    for_others: AtomicU64,
    for_others_tokens: AtomicU64,
}

/// Response header naming the prefill pod that prefilled the prompt (tests read it).
pub const PREFILLED_BY_HEADER: &str = "x-vllm-sim-prefilled-by";

/// Prefill header values are `ip:port`; anything longer is not one.
const MAX_HEADER_BYTES: usize = 64;

impl Pd {
    /// State for `cfg`.
    pub fn new(cfg: PdConfig) -> Self {
        Self {
            client: reqwest::Client::builder()
                .timeout(cfg.timeout)
                .no_proxy()
                .build()
                .unwrap_or_default(),
            cfg,
            remote_ok: AtomicU64::new(0),
            remote_failed: AtomicU64::new(0),
            transfer_blocks: AtomicU64::new(0),
            transfer_us: AtomicU64::new(0),
            for_others: AtomicU64::new(0),
            for_others_tokens: AtomicU64::new(0),
        }
    }

    /// The pod's role.
    pub fn role(&self) -> Role {
        self.cfg.role
    }

    /// The prefill pod a decode pod should use for this request, if any. A value that is not
    /// an `ip:port` counts as a failed remote prefill (the pod prefills locally).
    pub fn prefill_target(&self, headers: &HeaderMap) -> Option<SocketAddr> {
        if self.cfg.role != Role::Decode {
            return None;
        }
        let v = headers.get(self.cfg.header.as_str())?;
        let addr = v
            .to_str()
            .ok()
            .filter(|s| s.len() <= MAX_HEADER_BYTES)
            .and_then(|s| s.trim().parse().ok());
        if addr.is_none() {
            self.remote_failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("prefill header is not an ip:port; prefilling locally");
        }
        addr
    }

    /// Counts a request that asks this pod to prefill for a decode pod.
    pub fn note_request(&self, body: &Value, prompt_tokens: usize) {
        let remote =
            body.pointer("/kv_transfer_params/do_remote_decode") == Some(&Value::Bool(true));
        if remote {
            self.for_others.fetch_add(1, Ordering::Relaxed);
            self.for_others_tokens
                .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        }
    }

    /// Prefills `sub` on `target` (the client's body, asked for one token), then waits the
    /// transfer of the blocks this pod lacks and stores them. Returns whether it succeeded;
    /// on failure nothing is stored and the caller prefills locally.
    pub async fn remote_prefill(
        &self,
        engine: &EngineHandle,
        target: SocketAddr,
        path: &str,
        body: &Value,
        sub: &Submission,
    ) -> bool {
        let mut ask = body.clone();
        if let Some(o) = ask.as_object_mut() {
            o.insert("max_tokens".into(), 1.into());
            o.remove("max_completion_tokens");
            o.insert("stream".into(), false.into());
            o.remove("stream_options");
            o.insert(
                "kv_transfer_params".into(),
                serde_json::json!({"do_remote_decode": true}),
            );
        }
        let url = format!("http://{target}{path}");
        let answered = self.client.post(&url).json(&ask).send().await;
        let ok = match answered {
            Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
            Ok(r) => {
                tracing::warn!(%target, status = %r.status(), "remote prefill refused; prefilling locally");
                false
            }
            Err(e) => {
                tracing::warn!(%target, error = %e, "remote prefill failed; prefilling locally");
                false
            }
        };
        if !ok {
            self.remote_failed.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let started = Instant::now();
        let have = engine.cached_blocks(sub.keys.clone()).await;
        let lacking = sub.keys.len().saturating_sub(have);
        tokio::time::sleep(transfer_time(lacking, self.cfg.transfer_blocks_per_sec)).await;
        engine.import(sub.clone()).await;
        self.remote_ok.fetch_add(1, Ordering::Relaxed);
        self.transfer_blocks
            .fetch_add(lacking as u64, Ordering::Relaxed);
        self.transfer_us
            .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        true
    }

    /// The P/D families of `/metrics` (Prometheus text).
    pub fn render(&self) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::new();
        let mut family = |name: &str, help: &str, samples: &[(&str, f64)]| {
            // Counter families are named without `_total`, as Python's prometheus_client does.
            let base = name.trim_end_matches("_total");
            out.push_str(&format!("# HELP {base} {help}\n# TYPE {base} counter\n"));
            // As vLLM writes samples: always a label set, always a float (`0.0`, not `0`).
            for (labels, v) in samples {
                let labels = if labels.is_empty() { "{}" } else { labels };
                out.push_str(&format!("{name}{labels} {v:?}\n"));
            }
        };
        family(
            "vllm_sim:remote_prefills_total",
            "Prompts this decode pod asked a prefill pod to prefill, by outcome.",
            &[
                ("{outcome=\"ok\"}", get(&self.remote_ok) as f64),
                ("{outcome=\"failed\"}", get(&self.remote_failed) as f64),
            ],
        );
        family(
            "vllm_sim:kv_transfer_blocks_total",
            "KV blocks transferred from prefill pods.",
            &[("", get(&self.transfer_blocks) as f64)],
        );
        family(
            "vllm_sim:kv_transfer_seconds_total",
            "Time spent waiting for KV transfers.",
            &[("", get(&self.transfer_us) as f64 / 1e6)],
        );
        family(
            "vllm_sim:prefills_for_others_total",
            "Prefills this pod did for decode pods (kv_transfer_params.do_remote_decode).",
            &[("", get(&self.for_others) as f64)],
        );
        family(
            "vllm_sim:prefill_for_others_prompt_tokens_total",
            "Prompt tokens of the prefills this pod did for decode pods.",
            &[("", get(&self.for_others_tokens) as f64)],
        );
        out
    }
}

/// How long `blocks` take at `blocks_per_sec` (0 or less, or not finite: instant).
pub fn transfer_time(blocks: usize, blocks_per_sec: f64) -> Duration {
    if !(blocks_per_sec > 0.0 && blocks_per_sec.is_finite()) {
        return Duration::ZERO;
    }
    Duration::from_secs_f64((blocks as f64 / blocks_per_sec).min(3600.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pd(role: Role) -> Pd {
        Pd::new(PdConfig {
            role,
            header: "x-prefiller-host-port".into(),
            transfer_blocks_per_sec: 1000.0,
            timeout: Duration::from_secs(1),
        })
    }

    #[test]
    fn only_a_decode_pod_reads_the_header_and_only_an_ip_port() {
        let mut h = HeaderMap::new();
        h.insert("x-prefiller-host-port", "127.0.0.1:9".parse().unwrap());
        assert_eq!(pd(Role::Both).prefill_target(&h), None);
        assert_eq!(pd(Role::Prefill).prefill_target(&h), None);
        let d = pd(Role::Decode);
        assert_eq!(d.prefill_target(&h), Some("127.0.0.1:9".parse().unwrap()));
        h.insert("x-prefiller-host-port", "evil.example:80".parse().unwrap());
        assert_eq!(d.prefill_target(&h), None);
        assert!(d
            .render()
            .contains("vllm_sim:remote_prefills_total{outcome=\"failed\"} 1.0"));
    }

    #[test]
    fn transfer_time_is_blocks_over_bandwidth() {
        assert_eq!(transfer_time(500, 1000.0), Duration::from_millis(500));
        assert_eq!(transfer_time(500, 0.0), Duration::ZERO);
        assert_eq!(transfer_time(500, f64::NAN), Duration::ZERO);
    }
}
