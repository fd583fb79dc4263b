//! `flow_control`: when no pod of a request's model has room (the saturation gate's test), the
//! request waits in the router instead of piling onto a saturated pod, and leaves in priority
//! order, fairly between flows (tenants), when a pod has room again.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::disagg::header_problem;

/// Longest flow id or objective name kept (longer ones are cut: they are client-supplied).
pub const MAX_FLOW_ID_BYTES: usize = 64;

/// The InferenceObjective APIs a pool's objectives can be watched through: llm-d's current
/// group, and the Gateway API Inference Extension's (removed there after v1.5).
pub const OBJECTIVE_APIS: [&str; 2] = [
    "llm-d.ai/v1alpha2",
    "inference.networking.x-k8s.io/v1alpha2",
];

/// Time a released request has, past `queue_timeout_ms`, to be decided and answered.
pub const EXTENSION_MARGIN_MS: u64 = 1_000;

/// `flow_control`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct FlowConfig {
    /// Hold requests while every candidate pod is saturated.
    pub enabled: bool,
    /// Most requests waiting at once (all priorities and flows).
    pub max_queued: usize,
    /// Longest a request waits before it gets a 429.
    pub queue_timeout_ms: u64,
    /// `Retry-After` (seconds) on a 429 from the queue.
    pub retry_after_s: u64,
    /// Take the flow, priority and objective from the request's headers (`flow_header`,
    /// `priority_header`, `objective_header`). Only where the gateway in front sets or strips
    /// them: a client that can send them picks its own priority and, by rotating flow ids, its
    /// own share. Off: every request has `default_priority` and its flow is `identity_header`'s.
    pub trust_client_headers: bool,
    /// A header the gateway sets from the authenticated caller (e.g. a tenant or user id); its
    /// value is the request's flow, trusted or not. Empty: none (without trusted headers, every
    /// request then shares one flow, served first come, first served).
    pub identity_header: String,
    /// The request header carrying a priority (an integer; higher leaves first), read only with
    /// `trust_client_headers`, and clamped to the configured classes' range
    /// ([`FlowConfig::priority_range`]).
    pub priority_header: String,
    /// The priority of a request that names none (or an unparsable one).
    pub default_priority: i32,
    /// Priorities below this are sheddable: refused at once, never queued, while saturated
    /// (the Gateway API Inference Extension's meaning of a negative priority).
    pub shed_below: i32,
    /// The header naming the request's objective (a gateway sets it); `objectives` maps it to a
    /// priority, which wins over `priority_header`.
    pub objective_header: String,
    /// Objective name -> priority: for objectives no watched InferenceObjective names (a watched
    /// one wins).
    pub objectives: BTreeMap<String, i32>,
    /// The InferenceObjective API (`group/version`, one of [`OBJECTIVE_APIS`]) watched in the
    /// pool's namespace when pods come from an InferencePool (`pods.kubernetes.pool`) and the
    /// headers are trusted; objectives whose `spec.poolRef` names that pool give their
    /// `spec.priority` to requests naming them. Empty: none watched.
    pub objective_api: String,
    /// The header naming the request's flow (tenant); requests without one share one flow.
    pub flow_header: String,
    /// Named flows' weights (share of releases within a priority); others weigh 1. Only named
    /// flows get their own metric label (flow ids are client-supplied).
    pub flows: BTreeMap<String, u32>,
    /// Most distinct flows queued at once; further flows share one overflow flow.
    pub max_flows: usize,
    /// How often queued requests are checked against the pods' load.
    pub recheck_ms: u64,
    /// The ext_proc filter's `max_message_timeout` (the bundled configs set 30 s). A queued
    /// request extends Envoy's message timer once (Envoy allows one extension per message) to
    /// `queue_timeout_ms` + 1 s; Envoy ignores an extension above this and fails open.
    pub envoy_max_message_timeout_ms: u64,
}

impl Default for FlowConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            max_queued: 1024,
            queue_timeout_ms: 10_000,
            retry_after_s: 2,
            trust_client_headers: false,
            identity_header: String::new(),
            priority_header: "x-kv-router-priority".into(),
            default_priority: 0,
            shed_below: 0,
            objective_header: "x-gateway-inference-objective".into(),
            objectives: BTreeMap::new(),
            objective_api: OBJECTIVE_APIS[0].into(),
            flow_header: "x-kv-router-flow".into(),
            flows: BTreeMap::new(),
            max_flows: 1024,
            recheck_ms: 10,
            envoy_max_message_timeout_ms: 30_000,
        }
    }
}

impl FlowConfig {
    /// The one extension of Envoy's message timer a queued request asks for.
    pub fn envoy_extension_ms(&self) -> u64 {
        self.queue_timeout_ms
            .saturating_add(EXTENSION_MARGIN_MS)
            .min(self.envoy_max_message_timeout_ms)
    }

    /// The InferenceObjective API to watch as (group, version), when one is watched: flow control
    /// on, trusted headers (nothing else reads an objective) and an API named.
    pub fn watched_objective_api(&self) -> Option<(&str, &str)> {
        if !self.enabled || !self.trust_client_headers {
            return None;
        }
        self.objective_api.split_once('/')
    }

    /// The priorities a request can have: from the lowest configured class (an objective's, the
    /// default, or the highest sheddable one) to the highest (an objective's or the default), so
    /// that a priority header cannot outrank every configured class or open unbounded bands.
    pub fn priority_range(&self) -> (i32, i32) {
        let classes = self.objectives.values().copied();
        let lo = classes
            .clone()
            .chain([self.default_priority, self.shed_below.saturating_sub(1)])
            .min()
            .unwrap_or(self.default_priority);
        let hi = classes
            .chain([self.default_priority])
            .max()
            .unwrap_or(self.default_priority);
        (lo, hi)
    }

    /// Problems, as (key under `flow_control.`, reason).
    pub fn problems(&self) -> Vec<(String, &'static str)> {
        let mut out = Vec::new();
        let mut bad = |k: &str, r| out.push((k.to_string(), r));
        if self.max_queued == 0 || self.max_queued > 1 << 20 {
            bad("max_queued", "must be in 1..=1048576");
        }
        if !(1..=600_000).contains(&self.queue_timeout_ms) {
            bad("queue_timeout_ms", "must be in 1..=600000");
        }
        if self.retry_after_s > 3600 {
            bad("retry_after_s", "must be at most 3600");
        }
        for (k, v) in [
            ("priority_header", &self.priority_header),
            ("objective_header", &self.objective_header),
            ("flow_header", &self.flow_header),
        ] {
            if let Some(r) = header_problem(v) {
                bad(k, r);
            }
        }
        if !self.identity_header.is_empty() {
            if let Some(r) = header_problem(&self.identity_header) {
                bad("identity_header", r);
            } else if self.trust_client_headers && self.identity_header == self.flow_header {
                bad("identity_header", "must differ from flow_header");
            }
        }
        if self.objectives.len() > 1024
            || self
                .objectives
                .keys()
                .any(|k| k.is_empty() || k.len() > MAX_FLOW_ID_BYTES)
        {
            bad("objectives", "at most 1024 names of 1-64 bytes");
        }
        if !self.objective_api.is_empty() && !OBJECTIVE_APIS.contains(&self.objective_api.as_str())
        {
            bad(
                "objective_api",
                "must be llm-d.ai/v1alpha2, inference.networking.x-k8s.io/v1alpha2 or empty",
            );
        }
        if self.flows.len() > 1024
            || self.flows.iter().any(|(k, w)| {
                k.is_empty() || k.len() > MAX_FLOW_ID_BYTES || !(1..=1000).contains(w)
            })
        {
            bad(
                "flows",
                "at most 1024 names of 1-64 bytes, weights in 1..=1000",
            );
        }
        if self.max_flows == 0 || self.max_flows > 65_536 {
            bad("max_flows", "must be in 1..=65536");
        }
        if !(1..=1000).contains(&self.recheck_ms) {
            bad("recheck_ms", "must be in 1..=1000");
        }
        if !(1..=3_600_000).contains(&self.envoy_max_message_timeout_ms) {
            bad("envoy_max_message_timeout_ms", "must be in 1..=3600000");
        } else if self.queue_timeout_ms.saturating_add(EXTENSION_MARGIN_MS)
            > self.envoy_max_message_timeout_ms
        {
            bad(
                "queue_timeout_ms",
                "plus 1000 ms must fit in envoy_max_message_timeout_ms (Envoy's max_message_timeout)",
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn flow_control_parses_and_reports_bad_values() {
        let ok = Config::from_yaml(
            "pods: { static: [{ address: 127.0.0.1:1 }] }\nflow_control: {enabled: true, max_queued: 8, objectives: {chat: 10, batch: -1}, flows: {tenant-a: 3}, trust_client_headers: true, identity_header: x-tenant}\n",
        )
        .unwrap();
        assert!(ok.flow_control.enabled);
        assert_eq!(ok.flow_control.objectives["batch"], -1);
        assert_eq!(ok.flow_control.flows["tenant-a"], 3);
        assert!(ok.flow_control.trust_client_headers);
        assert_eq!(ok.flow_control.identity_header, "x-tenant");
        assert_eq!(ok.flow_control.priority_range(), (-1, 10));
        let default = Config::default().flow_control;
        assert!(!default.enabled && !default.trust_client_headers);
        assert_eq!(default.priority_range(), (-1, 0));
        // Watched only where something reads objectives: flow control on, trusted headers.
        assert_eq!(default.watched_objective_api(), None);
        assert_eq!(
            ok.flow_control.watched_objective_api(),
            Some(("llm-d.ai", "v1alpha2"))
        );
        let legacy = Config::from_yaml(
            "pods: { static: [{ address: 127.0.0.1:1 }] }\nflow_control: {enabled: true, trust_client_headers: true, objective_api: inference.networking.x-k8s.io/v1alpha2}\n",
        )
        .unwrap();
        assert_eq!(
            legacy.flow_control.watched_objective_api(),
            Some(("inference.networking.x-k8s.io", "v1alpha2"))
        );
        let off = Config::from_yaml(
            "pods: { static: [{ address: 127.0.0.1:1 }] }\nflow_control: {enabled: true, trust_client_headers: true, objective_api: \"\"}\n",
        )
        .unwrap();
        assert_eq!(off.flow_control.watched_objective_api(), None);
        let err = Config::from_yaml(
            "flow_control: {max_queued: 0, queue_timeout_ms: 0, flow_header: Bad, identity_header: X-User, flows: {a: 0}, recheck_ms: 0, envoy_max_message_timeout_ms: 0, objective_api: inference.networking.k8s.io/v1}\n",
        )
        .unwrap_err()
        .to_string();
        for key in [
            "flow_control.max_queued",
            "flow_control.queue_timeout_ms",
            "flow_control.flow_header",
            "flow_control.identity_header",
            "flow_control.flows",
            "flow_control.recheck_ms",
            "flow_control.envoy_max_message_timeout_ms",
            "flow_control.objective_api",
        ] {
            assert!(err.contains(key), "{key} missing from {err}");
        }
        let err = Config::from_yaml("flow_control: {queue_timeout_ms: 30000}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("flow_control.queue_timeout_ms"), "{err}");
    }
}
