//! Shared telemetry: the error counter with its closed kinds, the pod label, logging setup. Each
//! component registers its own families (`decide`, `extproc`, `pods`, `ingest`, `app`); labels
//! are closed enums or pod addresses, never prompt text or raw error strings.

pub mod gie;

use std::fmt::Write as _;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::config::{LogConfig, LogFormat};

/// What went wrong (closed set; the `kind` label of `kv_router_errors_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A body the request parser did not understand (routed by load).
    Unparsable,
    /// Tokenization failed; the keys fell back to text blocks.
    Tokenize,
    /// An index operation failed.
    Index,
    /// A scorer produced a non-finite score.
    Scorer,
    /// No pod passes its health probes.
    NoHealthyPod,
    /// The gateway's subset hint left no pod.
    EmptySubset,
    /// No healthy pod serves the model.
    ModelNotFound,
    /// Strict mode refused a body.
    BadRequest,
    /// The body exceeded the limit.
    BodyTooLarge,
    /// A pod source (static list, DNS) failed.
    PodSource,
    /// The Kubernetes watch failed (it retries with backoff).
    KubernetesWatch,
    /// The Kubernetes watch task ended and was restarted.
    KubernetesRestart,
    /// A probe or scrape of one pod panicked (that pod's round is lost, nothing else).
    ProbePanic,
    /// A body chunk was refused: the buffered-body budget of all streams was spent.
    BodyBudget,
    /// Flow control answered 429: queue full, timed out, or shed.
    FlowControl,
    /// A gRPC message started and was not complete within `server.message_timeout_ms`.
    MessageTimeout,
    /// A new ext_proc stream was refused: `server.max_extproc_streams` were open.
    StreamLimit,
}

impl ErrorKind {
    /// The label value (the one place each is spelled).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Unparsable => "unparsable",
            ErrorKind::Tokenize => "tokenize",
            ErrorKind::Index => "index",
            ErrorKind::Scorer => "scorer",
            ErrorKind::NoHealthyPod => "no_healthy_pod",
            ErrorKind::EmptySubset => "empty_subset",
            ErrorKind::ModelNotFound => "model_not_found",
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::BodyTooLarge => "body_too_large",
            ErrorKind::PodSource => "pod_source",
            ErrorKind::KubernetesWatch => "kubernetes_watch",
            ErrorKind::KubernetesRestart => "kubernetes_restart",
            ErrorKind::ProbePanic => "probe_panic",
            ErrorKind::BodyBudget => "body_budget",
            ErrorKind::FlowControl => "flow_control",
            ErrorKind::MessageTimeout => "message_timeout",
            ErrorKind::StreamLimit => "stream_limit",
        }
    }
}

impl EncodeLabelValue for ErrorKind {
    fn encode(&self, e: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        e.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    kind: ErrorKind,
}

/// `kv_router_errors_total{kind}`: one family shared by every component that counts errors.
#[derive(Debug, Clone, Default)]
pub struct Errors(Family<ErrorLabels, Counter>);

impl Errors {
    /// Registers the family.
    pub fn register(registry: &mut Registry) -> Self {
        let errors = Self::default();
        registry.register("errors", "Errors by kind", errors.0.clone());
        errors
    }

    /// Counts one error.
    pub fn inc(&self, kind: ErrorKind) {
        self.0.get_or_create(&ErrorLabels { kind }).inc();
    }

    /// Errors of `kind` counted so far.
    pub fn get(&self, kind: ErrorKind) -> u64 {
        self.0.get_or_create(&ErrorLabels { kind }).get()
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    revision: &'static str,
}

/// `kv_router_build_info{version,revision} 1`: which build each replica runs (a rollout mixes two).
pub fn register_build_info(registry: &mut Registry) {
    let info: Family<BuildLabels, Gauge> = Family::default();
    info.get_or_create(&BuildLabels {
        version: crate::VERSION,
        revision: crate::GIT_REVISION,
    })
    .set(1);
    registry.register(
        "build_info",
        "The build: crate version and git revision",
        info,
    );
}

/// A pod.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodLabels {
    /// `ip:port`.
    pub pod: String,
}

/// Installs the global tracing subscriber (RUST_LOG overrides the configured level).
pub fn init_logging(cfg: &LogConfig) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&cfg.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match cfg.format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_counted_under_their_kind_label() {
        let mut reg = Registry::default();
        let errors = Errors::register(reg.sub_registry_with_prefix("kv_router"));
        errors.inc(ErrorKind::PodSource);
        errors.inc(ErrorKind::PodSource);
        assert_eq!(errors.get(ErrorKind::PodSource), 2);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        assert!(
            out.contains(r#"kv_router_errors_total{kind="pod_source"} 2"#),
            "{out}"
        );
    }

    #[test]
    fn build_info_names_the_version_and_revision() {
        let mut reg = Registry::default();
        register_build_info(reg.sub_registry_with_prefix("kv_router"));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        let want = format!(
            "kv_router_build_info{{version=\"{}\",revision=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            crate::GIT_REVISION
        );
        assert!(out.contains(&want), "{out}");
        let rev = crate::GIT_REVISION;
        assert!(
            rev == "unknown" || (rev.len() == 12 && rev.chars().all(|c| c.is_ascii_hexdigit())),
            "{rev}"
        );
    }
}
