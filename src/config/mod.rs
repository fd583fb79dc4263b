//! Router configuration: YAML (serde_yaml), every field defaulted, validated once at startup.
//! Every default is documented in `docs/config.md`; a test parses the example there.
//! The schema and its defaults (`schema.rs`, `routing.rs`, `pods.rs`, ...) are apart from the
//! checks (`validate.rs`, `bounds.rs`); every type is re-exported here.

use std::net::SocketAddr;
use std::path::Path;

mod bounds;
mod correction;
mod disagg;
mod engine;
mod error;
mod flow;
mod kubernetes;
mod load;
mod lora;
mod pods;
mod redis;
mod routing;
mod schema;
mod validate;
pub use bounds::{check_yaml_shape, MAX_YAML_BYTES};
pub use correction::{RemovedKey, CORRECTION_REMOVED};
pub use disagg::{header_problem, DisaggConfig, PodRole, DEFAULT_PREFILL_HEADER, ROLE_LABEL};
pub use engine::{CustomEngine, EngineSetting, Preset, MAX_METRIC_NAME_BYTES};
pub use error::{ConfigError, Problem};
pub use flow::{FlowConfig, EXTENSION_MARGIN_MS, MAX_FLOW_ID_BYTES, OBJECTIVE_APIS};
pub use kubernetes::{KubernetesConfig, KubernetesOverrides, PoolRef, PortRef};
pub use lora::{LoraScorerConfig, MAX_LORA_ADAPTERS, MAX_LORA_NAME_BYTES};
pub use pods::{DnsSource, PodsConfig, StaticPod};
pub use redis::{redact_url, RedisConfig, RedisLookups, RedisMode};
pub use routing::{
    GateConfig, LoadScorerConfig, Policy, PrefixScorerConfig, ScorersConfig, SessionScorerConfig,
    TtftConfig,
};
pub use schema::{
    AdminConfig, BlocksConfig, Config, GrpcTlsConfig, IndexBackend, IndexConfig, KvEventsConfig,
    Listen, LogConfig, LogFormat, PickApiConfig, ReceiptsConfig, ServerConfig, TokenizerConfig,
    WarmStartConfig,
};

/// The sections the decision reads (`Decider::new`, `Stages::new`): it is handed these, not the
/// whole [`Config`].
#[derive(Debug, Clone, Copy)]
pub struct DecisionSections<'a> {
    /// `strict`: an unparsable body is refused instead of routed by load.
    pub strict: bool,
    /// `policy`.
    pub policy: Policy,
    /// `fallbacks`.
    pub fallbacks: usize,
    /// `blocks`.
    pub blocks: &'a BlocksConfig,
    /// `kv_events` (precise mode and its block size).
    pub kv_events: &'a KvEventsConfig,
    /// `scorers`.
    pub scorers: &'a ScorersConfig,
    /// `gate`.
    pub gate: &'a GateConfig,
    /// `disaggregation`.
    pub disaggregation: &'a DisaggConfig,
    /// `pods.stale_after_ms`: how old a load sample may be before it is not believed.
    pub stale_after_ms: u64,
}

impl Config {
    /// The sections the decision reads.
    pub fn decision(&self) -> DecisionSections<'_> {
        DecisionSections {
            strict: self.strict,
            policy: self.policy,
            fallbacks: self.fallbacks,
            blocks: &self.blocks,
            kv_events: &self.kv_events,
            scorers: &self.scorers,
            gate: &self.gate,
            disaggregation: &self.disaggregation,
            stale_after_ms: self.pods.stale_after_ms,
        }
    }

    /// Reads, parses and validates a YAML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_yaml(&text)
    }

    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let cfg: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            check_yaml_shape(text)?;
            serde_yaml::from_str(text)?
        };
        cfg.validate()
    }

    /// Why each removed key the config still names is ignored (one line each, for a warning).
    pub fn ignored_keys(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.index.correction.present() {
            out.push(CORRECTION_REMOVED);
        }
        out
    }

    /// Parsed gRPC listen address (valid after [`Config::validate`]).
    pub fn grpc_addr(&self) -> SocketAddr {
        self.listen.grpc.parse().expect("validated")
    }

    /// Parsed health-only listen address, if any (valid after [`Config::validate`]).
    pub fn grpc_health_addr(&self) -> Option<SocketAddr> {
        (!self.listen.grpc_health.is_empty())
            .then(|| self.listen.grpc_health.parse().expect("validated"))
    }

    /// Parsed admin listen address (valid after [`Config::validate`]).
    pub fn admin_addr(&self) -> SocketAddr {
        self.listen.admin.parse().expect("validated")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_config_gets_defaults() {
        let cfg = Config::from_yaml("pods:\n  static:\n    - address: 127.0.0.1:8000\n").unwrap();
        assert_eq!(cfg.body_limit_bytes, 64 << 20);
        assert_eq!(cfg.policy, Policy::Weighted);
        assert_eq!(cfg.pods.static_pods[0].address, "127.0.0.1:8000");
    }

    #[test]
    fn all_problems_reported_with_keys() {
        let err = Config::from_yaml(
            "listen: { grpc: nope }\nblocks: { size_chars: 1 }\nscorers: { load: { weight: -1 } }\ngate: { max_kv_usage: 2 }\nindex: { max_pod_cache_tokens: 0 }\n",
        )
        .unwrap_err();
        let text = err.to_string();
        for key in [
            "listen.grpc",
            "blocks.size_chars",
            "scorers.load.weight",
            "gate.max_kv_usage",
            "index.max_pod_cache_tokens",
            "pods",
        ] {
            assert!(text.contains(key), "{key} missing from: {text}");
        }
    }

    #[test]
    fn warm_start_peers_must_be_admin_addresses_of_an_approximate_memory_index() {
        let pods = "pods: { static: [{ address: 127.0.0.1:8000 }] }\n";
        let ok = "index: { warm_start: { peers: [kv-router-admin:9090, 10.0.0.1:9090] } }";
        let cfg = Config::from_yaml(&format!("{pods}{ok}")).unwrap();
        assert_eq!(cfg.index.warm_start.peers.len(), 2);
        for (yaml, key) in [
            (
                "index: { warm_start: { peers: [nohost] } }",
                "index.warm_start.peers",
            ),
            (
                "index: { warm_start: { peers: [':9090'] } }",
                "index.warm_start.peers",
            ),
            (
                "index: { backend: redis, warm_start: { peers: [a:1] } }",
                "index.warm_start.peers",
            ),
            (
                "kv_events: { enabled: true }\nindex: { warm_start: { peers: [a:1] } }",
                "index.warm_start.peers",
            ),
            (
                "index: { warm_start: { timeout_ms: 0 } }",
                "index.warm_start.timeout_ms",
            ),
            (
                "index: { warm_start: { max_bytes: 10 } }",
                "index.warm_start.max_bytes",
            ),
            (
                "index: { warm_start: { max_entries: 0 } }",
                "index.warm_start.max_entries",
            ),
        ] {
            let err = Config::from_yaml(&format!("{pods}{yaml}")).unwrap_err();
            assert!(err.to_string().contains(key), "{yaml}: {err}");
        }
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = Config::from_yaml("pods: { static: [] }\nbogus: 1\n").unwrap_err();
        assert!(err.to_string().contains("bogus"));
    }

    #[test]
    fn documented_example_parses_and_matches_defaults() {
        let doc = include_str!("../../docs/config.md");
        let start = doc
            .find("```yaml\n")
            .expect("docs/config.md has a yaml block")
            + 8;
        let end = start + doc[start..].find("```").unwrap();
        let cfg = Config::from_yaml(&doc[start..end]).unwrap();
        // The documented example spells out every default; only the pod list differs.
        let mut expected = Config::default();
        expected.pods.static_pods = cfg.pods.static_pods.clone();
        expected.pods.dns = cfg.pods.dns.clone();
        expected.pods.kubernetes = cfg.pods.kubernetes.clone();
        assert_eq!(cfg, expected);
    }
}
