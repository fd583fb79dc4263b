//! `disaggregation`: prefill/decode (P/D) splitting for models that have prefill-role pods, and
//! the pod roles themselves (`prefill`, `decode`, `both`).

use serde::{Deserialize, Serialize};

/// What a pod does in a P/D deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PodRole {
    /// Computes prompts for decode pods (chosen by prefix cache and prefill load).
    Prefill,
    /// Generates tokens, with the prompt's KV transferred from a prefill pod when disaggregated.
    Decode,
    /// Does both (every pod without a role: the aggregated behaviour).
    #[default]
    Both,
}

impl PodRole {
    /// The role named by a label value (`prefill`, `decode`, `both`; ASCII case ignored).
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Prefill, Self::Decode, Self::Both]
            .into_iter()
            .find(|r| s.eq_ignore_ascii_case(r.as_str()))
    }

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Both => "both",
        }
    }
}

/// The label key llm-d puts a pod's role under; also where every source stores the role in a
/// pod's labels (`/debug/pods` shows it).
pub const ROLE_LABEL: &str = "llm-d.ai/role";

/// The request header llm-d's decode-side routing sidecar reads the prefill pod from.
pub const DEFAULT_PREFILL_HEADER: &str = "x-prefiller-host-port";

/// Header names that can never carry the prefill pod: hop-by-hop, framing and routing headers.
const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "te",
    "upgrade",
    "x-gateway-destination-endpoint",
    "x-gateway-destination-endpoint-served",
    "x-gateway-destination-endpoint-subset",
];

/// P/D disaggregation. It applies only to models with healthy `prefill`-role pods; a fleet
/// without roles routes exactly as before.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DisaggConfig {
    /// Disaggregate when the best decode pod would have to compute at least this many prompt
    /// tokens itself (prompt tokens minus the blocks the index predicts it holds).
    pub threshold_tokens: u64,
    /// The request header naming the prefill pod (`ip:port`); kv-router always removes a
    /// client's copy.
    pub header: String,
    /// A prefill pod that, over this long, served (by its prefix-cache lookups) less than the
    /// oldest of two or more prefills sent it is excluded from prefill picks (30 s, doubling to
    /// 5 min, until it serves one again); 0: never.
    pub prefill_unserved_after_ms: u64,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self {
            threshold_tokens: 512,
            header: DEFAULT_PREFILL_HEADER.to_string(),
            prefill_unserved_after_ms: 15_000,
        }
    }
}

/// A valid HTTP header name for the prefill pod: lower-case token characters, at most 64 bytes,
/// no pseudo-header, no hop-by-hop, framing or routing header.
pub fn header_problem(name: &str) -> Option<&'static str> {
    let token = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_.".contains(c);
    if name.is_empty() || name.len() > 64 || !name.chars().all(token) {
        return Some("must be 1-64 lower-case letters, digits, '-', '_' or '.'");
    }
    if RESERVED_HEADERS.contains(&name) {
        return Some("must not be a hop-by-hop, framing or routing header");
    }
    None
}

/// A Kubernetes label key: an optional DNS prefix and `/`, then a name of at most 63 characters.
pub fn label_key_problem(key: &str) -> Option<&'static str> {
    let (prefix, name) = key.rsplit_once('/').unwrap_or(("", key));
    let ok_name = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    let ok_prefix = prefix.len() <= 253
        && prefix
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-.".contains(c));
    if key.contains('/') && prefix.is_empty() || !ok_name || !ok_prefix {
        return Some("must be a Kubernetes label key ([prefix/]name, name at most 63 characters)");
    }
    None
}

impl DisaggConfig {
    /// Problems, as (key under `disaggregation.`, reason).
    pub(super) fn problems(&self) -> Vec<(&'static str, &'static str)> {
        let mut p = Vec::new();
        if let Some(reason) = header_problem(&self.header) {
            p.push(("header", reason));
        }
        // Past this no prompt is ever long enough (max_prompt_tokens caps what counts).
        if self.threshold_tokens > 1 << 24 {
            p.push(("threshold_tokens", "must be at most 16777216"));
        }
        if self.prefill_unserved_after_ms > 3_600_000 {
            p.push((
                "prefill_unserved_after_ms",
                "must be at most 3600000 (1 h); 0 turns it off",
            ));
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_parse_from_label_values() {
        assert_eq!(PodRole::parse("prefill"), Some(PodRole::Prefill));
        assert_eq!(PodRole::parse("Decode"), Some(PodRole::Decode));
        assert_eq!(PodRole::parse("both"), Some(PodRole::Both));
        assert_eq!(PodRole::parse("prefill-decode"), None);
        assert_eq!(PodRole::parse(""), None);
    }

    #[test]
    fn header_names_are_bounded_and_not_routing_headers() {
        assert_eq!(header_problem(DEFAULT_PREFILL_HEADER), None);
        assert_eq!(header_problem("x-prefiller-url"), None);
        for bad in [
            "",
            "X-Prefill",
            "x prefill",
            ":authority",
            "content-length",
            "x-gateway-destination-endpoint",
        ] {
            assert!(header_problem(bad).is_some(), "{bad:?}");
        }
        assert!(header_problem(&"x".repeat(65)).is_some());
    }

    #[test]
    fn roles_and_pd_settings_load_and_bad_ones_are_reported_by_key() {
        use crate::config::Config;
        let ok = Config::from_yaml(
            "pods:\n  static:\n    - {address: 10.0.0.1:8000, role: prefill}\n    - {address: 10.0.0.2:8000, labels: {llm-d.ai/role: decode}}\ndisaggregation: {threshold_tokens: 1024, header: x-pd}\n",
        )
        .unwrap();
        assert_eq!(ok.pods.static_pods[0].role, Some(PodRole::Prefill));
        assert_eq!(ok.disaggregation.threshold_tokens, 1024);
        let err = Config::from_yaml(
            "pods:\n  static:\n    - {address: 10.0.0.1:8000, labels: {llm-d.ai/role: gpu}}\n  kubernetes: {selector: app=vllm, role_label: \"/x\"}\ndisaggregation: {header: host, threshold_tokens: 99999999}\n",
        )
        .unwrap_err()
        .to_string();
        for key in [
            "pods.static[0].labels.llm-d.ai/role",
            "pods.kubernetes.role_label",
            "disaggregation.header",
            "disaggregation.threshold_tokens",
        ] {
            assert!(err.contains(key), "{key} missing from {err}");
        }
        assert!(
            Config::from_yaml("pods: {static: [{address: 10.0.0.1:8000, role: gpu}]}\n").is_err()
        );
    }

    #[test]
    fn label_keys_follow_kubernetes_syntax() {
        for ok in [ROLE_LABEL, "role", "example.com/pd-role"] {
            assert_eq!(label_key_problem(ok), None, "{ok}");
        }
        for bad in ["", "/role", "Example.com/role", "a/b/", &"r".repeat(64)] {
            assert!(label_key_problem(bad).is_some(), "{bad:?}");
        }
    }
}
