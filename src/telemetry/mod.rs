//! Shared telemetry: the error counter with its closed kinds, the KV-event families, logging
//! setup. Each component registers its own families (`decide`, `extproc`, `pods`, `app`); labels
//! are closed enums or pod addresses, never prompt text or raw error strings.

use std::fmt::Write as _;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
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

/// A pod.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodLabels {
    /// `ip:port`.
    pub pod: String,
}

/// A pod and an event type.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodTypeLabels {
    /// `ip:port`.
    pub pod: String,
    /// Closed set: event type, purge reason, replay outcome or decode-error kind.
    pub r#type: &'static str,
}

/// Every `type` label value the KV-event families use (event types, purge reasons, replay
/// outcomes, decode-error kinds), so a departed pod's series can all be removed.
const EVENT_LABEL_TYPES: [&str; 13] = [
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "gap",
    "restart",
    "cleared",
    "complete",
    "failed",
    "too_large",
    "msgpack",
    "batch",
    "event",
    "frames",
];

/// The KV-event families and the shared error counter (the other components register their
/// own families: `decide`, `extproc`, `pods`, `app`).
pub struct Metrics {
    /// `kv_router_errors_total{kind}`.
    pub errors: Errors,
    /// `kv_router_kv_events_applied_total{pod,type}`.
    pub events_applied: Family<PodTypeLabels, Counter>,
    /// `kv_router_kv_event_gaps_total{pod}`.
    pub event_gaps: Family<PodLabels, Counter>,
    /// `kv_router_kv_event_replays_total{pod,type=complete|failed}`.
    pub event_replays: Family<PodTypeLabels, Counter>,
    /// `kv_router_kv_event_purges_total{pod,type=gap|restart|cleared}`.
    pub event_purges: Family<PodTypeLabels, Counter>,
    /// `kv_router_kv_event_decode_errors_total{pod,type}`.
    pub event_decode_errors: Family<PodTypeLabels, Counter>,
    /// `kv_router_kv_event_lag_seconds`: publish time to application.
    pub event_lag: Histogram,
}

impl Metrics {
    /// Creates the families and registers them (`registry` is the `kv_router` sub-registry).
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self {
            errors: Errors::register(registry),
            events_applied: Family::default(),
            event_gaps: Family::default(),
            event_replays: Family::default(),
            event_purges: Family::default(),
            event_decode_errors: Family::default(),
            event_lag: Histogram::new(exponential_buckets(1e-4, 2.0, 18)),
        };
        let r = registry;
        r.register(
            "kv_events_applied",
            "vLLM KV events applied, by pod and type",
            m.events_applied.clone(),
        );
        r.register(
            "kv_event_gaps",
            "Sequence gaps in a pod's KV-event stream",
            m.event_gaps.clone(),
        );
        r.register(
            "kv_event_replays",
            "Replay requests by outcome",
            m.event_replays.clone(),
        );
        r.register(
            "kv_event_purges",
            "Pod index purges by reason",
            m.event_purges.clone(),
        );
        r.register(
            "kv_event_decode_errors",
            "Undecodable KV-event messages by kind",
            m.event_decode_errors.clone(),
        );
        r.register(
            "kv_event_lag_seconds",
            "Time from publication to application of a KV-event batch",
            m.event_lag.clone(),
        );
        m
    }

    /// Counts an error.
    pub fn error(&self, kind: ErrorKind) {
        self.errors.inc(kind);
    }

    /// Drops the KV-event series of a pod that left.
    pub fn forget_pod(&self, pod: &str) {
        self.event_gaps.remove(&PodLabels {
            pod: pod.to_string(),
        });
        // The KV-event families are keyed by pod and a closed type set: drop every combination.
        for t in EVENT_LABEL_TYPES {
            let l = PodTypeLabels {
                pod: pod.to_string(),
                r#type: t,
            };
            self.events_applied.remove(&l);
            self.event_replays.remove(&l);
            self.event_purges.remove(&l);
            self.event_decode_errors.remove(&l);
        }
    }
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
    fn forgetting_a_pod_drops_its_event_series() {
        let mut reg = Registry::default();
        let m = Metrics::new(&mut reg);
        let l = PodTypeLabels {
            pod: "p:1".into(),
            r#type: "BlockStored",
        };
        m.events_applied.get_or_create(&l).inc();
        m.event_purges
            .get_or_create(&PodTypeLabels {
                pod: "p:1".into(),
                r#type: "restart",
            })
            .inc();
        m.event_gaps
            .get_or_create(&PodLabels { pod: "p:1".into() })
            .inc();
        m.forget_pod("p:1");
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        assert!(!out.contains("p:1"), "{out}");
    }
}
