//! `pods`: where pods come from (static list, DNS, Kubernetes) and how they are probed.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{disagg, engine, EngineSetting, KubernetesConfig, PodRole, ROLE_LABEL};

/// Pod sources and probes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PodsConfig {
    /// Pods listed explicitly.
    #[serde(rename = "static")]
    pub static_pods: Vec<StaticPod>,
    /// Headless-service DNS names re-resolved periodically.
    pub dns: Vec<DnsSource>,
    /// Pods watched through the Kubernetes API (label selector or InferencePool).
    pub kubernetes: Option<KubernetesConfig>,
    /// Whose `/metrics` names carry the load of pods whose source sets no engine.
    pub engine: EngineSetting,
    /// Models served by DNS/Kubernetes-discovered pods; empty = learn from each pod's `/v1/models`.
    pub models: Vec<String>,
    /// Health probe (`GET /health`) period.
    pub health_interval_ms: u64,
    /// Consecutive failed probes before a pod is unhealthy.
    pub unhealthy_after: u32,
    /// Load scrape (`GET /metrics`) period of a busy pod.
    pub scrape_interval_ms: u64,
    /// Scrape period of an idle pod (nothing in flight from this router or charged by another
    /// replica, none running or waiting at the last scrape): idle fleets cost less to watch.
    pub idle_scrape_interval_ms: u64,
    /// Metrics older than this are stale.
    pub stale_after_ms: u64,
    /// Timeout of one probe or scrape.
    pub probe_timeout_ms: u64,
    /// How often `/v1/models` is re-read for pods without configured models.
    pub models_refresh_ms: u64,
    /// Largest `/metrics` or `/v1/models` body read from a pod; a larger one fails the probe.
    pub max_response_bytes: usize,
}

impl Default for PodsConfig {
    fn default() -> Self {
        Self {
            static_pods: Vec::new(),
            dns: Vec::new(),
            kubernetes: None,
            engine: EngineSetting::Auto,
            models: Vec::new(),
            health_interval_ms: 1_000,
            unhealthy_after: 2,
            scrape_interval_ms: 100,
            idle_scrape_interval_ms: 1_000,
            stale_after_ms: 2_000,
            probe_timeout_ms: 1_000,
            models_refresh_ms: 30_000,
            max_response_bytes: 8 << 20,
        }
    }
}

/// One explicitly configured pod.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StaticPod {
    /// `ip:port` Envoy knows the pod by.
    pub address: String,
    /// Served model names (LoRA adapters included); empty = learn from `/v1/models`.
    #[serde(default)]
    pub models: Vec<String>,
    /// Free-form labels shown in /debug/pods.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// KV-event PUB endpoint of this pod (overrides `kv_events.endpoint`).
    #[serde(default)]
    pub kv_events_endpoint: Option<String>,
    /// KV-event replay endpoint of this pod (overrides `kv_events.replay_endpoint`).
    #[serde(default)]
    pub kv_events_replay_endpoint: Option<String>,
    /// P/D role (wins over a `llm-d.ai/role` label); unset: the label, else `both`.
    #[serde(default)]
    pub role: Option<PodRole>,
}

impl StaticPod {
    /// A pod at `address` serving `models`, with no labels or per-pod KV-event endpoints.
    pub fn new(address: impl Into<String>, models: &[&str]) -> Self {
        Self {
            address: address.into(),
            models: models.iter().map(|m| m.to_string()).collect(),
            labels: BTreeMap::new(),
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
            role: None,
        }
    }
}

/// A DNS source (Kubernetes headless Service).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DnsSource {
    /// Name to resolve, e.g. `vllm.llm.svc.cluster.local`.
    pub name: String,
    /// Port of every resolved pod.
    pub port: u16,
    /// Re-resolve period.
    #[serde(default = "default_dns_refresh_ms")]
    pub refresh_ms: u64,
    /// Engine of this name's pods; `None`: `pods.engine`.
    #[serde(default)]
    pub engine: Option<EngineSetting>,
    /// P/D role of every pod this name resolves to; unset: `both`.
    #[serde(default)]
    pub role: Option<PodRole>,
}

fn default_dns_refresh_ms() -> u64 {
    5_000
}

impl PodsConfig {
    /// Problems of role settings: a static pod's `llm-d.ai/role` label must name a role, and
    /// `pods.kubernetes.role_label` must be a label key.
    pub(super) fn role_problems(&self) -> Vec<(String, &'static str)> {
        let mut p = Vec::new();
        for (i, pod) in self.static_pods.iter().enumerate() {
            if let Some(v) = pod.labels.get(ROLE_LABEL) {
                if PodRole::parse(v).is_none() {
                    p.push((
                        format!("pods.static[{i}].labels.{ROLE_LABEL}"),
                        "must be prefill, decode or both",
                    ));
                }
            }
        }
        if let Some(k) = &self.kubernetes {
            if let Some(reason) = disagg::label_key_problem(&k.role_label) {
                p.push(("pods.kubernetes.role_label".to_string(), reason));
            }
        }
        p
    }

    /// Problems of every engine setting (`pods.engine`, per DNS name, Kubernetes).
    pub(super) fn engine_problems(&self) -> Vec<(String, String)> {
        let mut p = engine::problems("pods.engine", &self.engine);
        for (i, d) in self.dns.iter().enumerate() {
            if let Some(e) = &d.engine {
                p.extend(engine::problems(&format!("pods.dns[{i}].engine"), e));
            }
        }
        if let Some(e) = self.kubernetes.as_ref().and_then(|k| k.engine.as_ref()) {
            p.extend(engine::problems("pods.kubernetes.engine", e));
        }
        p
    }
}
