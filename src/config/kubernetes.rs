//! `pods.kubernetes`: where the Kubernetes pod source looks, and the flag/env overrides a
//! manifest sets (GIE endpoint-picker style `--pool-name` / `--pool-namespace`, `NAMESPACE`).

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::EngineSetting;

/// Kubernetes pod discovery: a watch of pods by label selector, or of an InferencePool.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Namespace of the model pods; empty = `$NAMESPACE` (downward API), else the client's
    /// default (the service account's namespace in a cluster, the kubeconfig context's outside).
    pub namespace: String,
    /// Label selector of the model pods (`app=vllm,tier in (a,b)`); unused when `pool` is set.
    pub selector: String,
    /// The pods' serving port: a number or a container port name; unused when `pool` is set.
    pub port: PortRef,
    /// Take the selector and target ports from this InferencePool (`inference.networking.k8s.io/v1`).
    pub pool: Option<PoolRef>,
    /// Annotation holding the pod's model names, comma-separated (checked first; empty = none).
    pub models_annotation: String,
    /// Label holding the pod's model name (label values cannot hold `/`; empty = none).
    pub models_label: String,
    /// Label holding the pod's P/D role (`prefill`, `decode`, `both`; absent: `both`).
    pub role_label: String,
    /// Kubeconfig file; unset = `$KUBECONFIG`, `~/.kube/config`, then the in-cluster service account.
    pub kubeconfig: Option<PathBuf>,
    /// How often the router takes the watched set (the watch itself is pushed by the API server).
    pub refresh_ms: u64,
    /// Engine of the watched pods (`None`: `pods.engine`); a pod's `kv-router.io/engine`
    /// annotation or label overrides it.
    pub engine: Option<EngineSetting>,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            namespace: String::new(),
            selector: String::new(),
            port: PortRef::Number(8000),
            pool: None,
            models_annotation: String::new(),
            models_label: String::new(),
            role_label: super::ROLE_LABEL.to_string(),
            kubeconfig: None,
            refresh_ms: 250,
            engine: None,
        }
    }
}

/// A container port by number or by name.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum PortRef {
    /// A port number.
    Number(u16),
    /// A container port name (`ports[].name` of the pod's containers).
    Name(String),
}

impl fmt::Display for PortRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortRef::Number(n) => write!(f, "{n}"),
            PortRef::Name(s) => f.write_str(s),
        }
    }
}

/// An InferencePool by name.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PoolRef {
    /// `metadata.name` of the pool.
    pub name: String,
    /// Its namespace (the pool selects pods of its own namespace); empty = `pods.kubernetes.namespace`.
    #[serde(default)]
    pub namespace: String,
}

/// Flag/env values that override the file (a Deployment sets them; the file stays generic).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubernetesOverrides {
    /// `--pool-name`: watch this InferencePool (enables `pods.kubernetes` when absent).
    pub pool_name: Option<String>,
    /// `--pool-namespace`: its namespace.
    pub pool_namespace: Option<String>,
}

impl KubernetesOverrides {
    /// Applies the overrides to a parsed (not yet validated) config's `pods.kubernetes`.
    pub(super) fn apply_to(self, kubernetes: &mut Option<KubernetesConfig>) {
        if self.pool_name.is_none() && self.pool_namespace.is_none() {
            return;
        }
        let k = kubernetes.get_or_insert_with(Default::default);
        let pool = k.pool.get_or_insert_with(|| PoolRef {
            name: String::new(),
            namespace: String::new(),
        });
        if let Some(name) = self.pool_name {
            pool.name = name;
        }
        if let Some(ns) = self.pool_namespace {
            pool.namespace = ns;
        }
    }
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// Problems of `pods.kubernetes` as `(key, reason)`.
pub(super) fn problems(k: &KubernetesConfig) -> Vec<(String, String)> {
    let mut p = Vec::new();
    let mut bad = |key: &str, reason: &str| {
        let key = if key.is_empty() {
            "pods.kubernetes".to_string()
        } else {
            format!("pods.kubernetes.{key}")
        };
        p.push((key, reason.to_string()));
    };
    if !cfg!(feature = "kubernetes") {
        bad(
            "",
            "this kv-router was built without the `kubernetes` feature",
        );
    }
    if !k.namespace.is_empty() && !valid_name(&k.namespace) {
        bad("namespace", "must be a Kubernetes namespace name");
    }
    match &k.pool {
        Some(pool) => {
            if !valid_name(&pool.name) {
                bad("pool.name", "must be an InferencePool name");
            }
            if !pool.namespace.is_empty() && !valid_name(&pool.namespace) {
                bad("pool.namespace", "must be a Kubernetes namespace name");
            }
        }
        None => {
            if k.selector.trim().is_empty() {
                bad(
                    "selector",
                    "set a label selector (e.g. app=vllm) or pool: {name: ...}; an empty selector would take every pod of the namespace",
                );
            }
            match &k.port {
                PortRef::Number(0) => bad("port", "must be 1..=65535 or a container port name"),
                PortRef::Name(n) if n.is_empty() || n.len() > 15 => {
                    bad("port", "a port name has 1 to 15 characters")
                }
                _ => {}
            }
        }
    }
    if k.refresh_ms == 0 {
        bad("refresh_ms", "must be positive");
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn selector_source_parses_with_named_port() {
        let cfg = Config::from_yaml(
            "pods:\n  kubernetes: { namespace: llm, selector: app=vllm, port: http, models_annotation: kv-router.io/models }\n",
        )
        .unwrap();
        let k = cfg.pods.kubernetes.unwrap();
        assert_eq!(k.port, PortRef::Name("http".into()));
        assert_eq!(k.selector, "app=vllm");
        assert_eq!(k.refresh_ms, 250);
    }

    #[test]
    fn documented_block_spells_out_the_defaults() {
        let doc = include_str!("../../docs/config.md");
        let start = doc.find("```yaml\n").unwrap() + 8;
        let end = start + doc[start..].find("```").unwrap();
        let cfg = Config::from_yaml(&doc[start..end]).unwrap();
        let want = KubernetesConfig {
            selector: "app=vllm".into(),
            ..Default::default()
        };
        assert_eq!(cfg.pods.kubernetes, Some(want));
    }

    #[test]
    fn bad_values_name_their_keys() {
        let err = Config::from_yaml(
            "pods:\n  kubernetes: { namespace: Bad_NS, port: 0, refresh_ms: 0 }\n",
        )
        .unwrap_err()
        .to_string();
        for key in [
            "pods.kubernetes.namespace",
            "pods.kubernetes.selector",
            "pods.kubernetes.port",
            "pods.kubernetes.refresh_ms",
        ] {
            assert!(err.contains(key), "{key} missing from: {err}");
        }
    }

    #[test]
    fn pool_overrides_enable_the_source() {
        let flags = || KubernetesOverrides {
            pool_name: Some("vllm-pool".into()),
            pool_namespace: Some("llm".into()),
        };
        // A file with no pod source is complete once the flags name a pool.
        let cfg = Config::from_yaml_with("listen: { grpc: 0.0.0.0:9002 }\n", flags()).unwrap();
        let k = cfg.pods.kubernetes.unwrap();
        assert_eq!(
            k.pool,
            Some(PoolRef {
                name: "vllm-pool".into(),
                namespace: "llm".into()
            })
        );
        let static_only = "pods:\n  static: [{ address: 127.0.0.1:1 }]\n";
        let none = Config::from_yaml_with(static_only, KubernetesOverrides::default()).unwrap();
        assert!(none.pods.kubernetes.is_none());
        let err = Config::from_yaml_with(
            static_only,
            KubernetesOverrides {
                pool_name: None,
                pool_namespace: Some("llm".into()),
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("pods.kubernetes.pool.name"));
    }
}
