//! Metric families (prometheus-client) with closed label sets, and logging setup.
//! Labels never carry prompt text or raw error strings.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::config::{LogConfig, LogFormat};

/// `reason` and `pod` of a decision.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// Closed set: see `decide::Reason`.
    pub reason: &'static str,
    /// Primary pod (`ip:port`).
    pub pod: String,
}

/// A closed error kind.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// Closed set, e.g. `unparsable`, `no_healthy_pod`, `index`, `body_too_large`.
    pub kind: &'static str,
}

/// A pod.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodLabels {
    /// `ip:port`.
    pub pod: String,
}

/// ext_proc body mode.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabels {
    /// `buffered`, `full_duplex`, `headers_only`.
    pub mode: &'static str,
}

/// Every metric the router exports.
pub struct Metrics {
    /// `kv_router_decisions_total{reason,pod}`.
    pub decisions: Family<DecisionLabels, Counter>,
    /// `kv_router_decision_duration_seconds`.
    pub decision_seconds: Histogram,
    /// `kv_router_predicted_matched_blocks` of the chosen pod.
    pub matched_blocks: Histogram,
    /// `kv_router_errors_total{kind}`.
    pub errors: Family<KindLabels, Counter>,
    /// `kv_router_extproc_streams_total{mode}`.
    pub streams: Family<ModeLabels, Counter>,
    /// `kv_router_pod_healthy{pod}`.
    pub pod_healthy: Family<PodLabels, Gauge>,
    /// `kv_router_pod_waiting_requests{pod}` (scraped).
    pub pod_waiting: Family<PodLabels, Gauge<f64, AtomicU64>>,
    /// `kv_router_pod_running_requests{pod}` (scraped).
    pub pod_running: Family<PodLabels, Gauge<f64, AtomicU64>>,
    /// `kv_router_pod_kv_cache_usage_ratio{pod}` (scraped).
    pub pod_kv_usage: Family<PodLabels, Gauge<f64, AtomicU64>>,
    /// `kv_router_pod_inflight_requests{pod}` (this router).
    pub pod_inflight_requests: Family<PodLabels, Gauge>,
    /// `kv_router_pod_inflight_uncached_tokens{pod}` (this router).
    pub pod_inflight_tokens: Family<PodLabels, Gauge>,
    /// `kv_router_index_entries`.
    pub index_entries: Gauge,
    /// `kv_router_index_keys`.
    pub index_keys: Gauge,
    /// `kv_router_sessions`.
    pub sessions: Gauge,
}

impl Metrics {
    /// Creates the families and registers them.
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self {
            decisions: Family::default(),
            decision_seconds: Histogram::new(exponential_buckets(1e-6, 2.0, 24)),
            matched_blocks: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            errors: Family::default(),
            streams: Family::default(),
            pod_healthy: Family::default(),
            pod_waiting: Family::default(),
            pod_running: Family::default(),
            pod_kv_usage: Family::default(),
            pod_inflight_requests: Family::default(),
            pod_inflight_tokens: Family::default(),
            index_entries: Gauge::default(),
            index_keys: Gauge::default(),
            sessions: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("kv_router");
        r.register(
            "decisions",
            "Routing decisions by reason and primary pod",
            m.decisions.clone(),
        );
        r.register(
            "decision_duration_seconds",
            "Time to decide (parse, keys, lookup, score, pick)",
            m.decision_seconds.clone(),
        );
        r.register(
            "predicted_matched_blocks",
            "Prompt blocks the index predicted the chosen pod holds",
            m.matched_blocks.clone(),
        );
        r.register("errors", "Errors by kind", m.errors.clone());
        r.register(
            "extproc_streams",
            "ext_proc streams by body mode",
            m.streams.clone(),
        );
        r.register(
            "pod_healthy",
            "1 if the pod passed its health probes",
            m.pod_healthy.clone(),
        );
        r.register(
            "pod_waiting_requests",
            "vllm:num_requests_waiting (scraped)",
            m.pod_waiting.clone(),
        );
        r.register(
            "pod_running_requests",
            "vllm:num_requests_running (scraped)",
            m.pod_running.clone(),
        );
        r.register(
            "pod_kv_cache_usage_ratio",
            "vllm:kv_cache_usage_perc (scraped)",
            m.pod_kv_usage.clone(),
        );
        r.register(
            "pod_inflight_requests",
            "Requests this router routed to the pod and still counts",
            m.pod_inflight_requests.clone(),
        );
        r.register(
            "pod_inflight_uncached_tokens",
            "Uncached prompt tokens this router routed to the pod, still prefilling",
            m.pod_inflight_tokens.clone(),
        );
        r.register(
            "index_entries",
            "(block key, pod) entries in the prefix index",
            m.index_entries.clone(),
        );
        r.register(
            "index_keys",
            "Distinct block keys in the prefix index",
            m.index_keys.clone(),
        );
        r.register("sessions", "Sessions remembered", m.sessions.clone());
        m
    }

    /// Counts an error of a closed kind.
    pub fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&KindLabels { kind }).inc();
    }

    /// Drops the series of a pod that left (the KV-event series are ingest's own).
    pub fn forget_pod(&self, pod: &str) {
        let l = PodLabels {
            pod: pod.to_string(),
        };
        self.pod_healthy.remove(&l);
        self.pod_waiting.remove(&l);
        self.pod_running.remove(&l);
        self.pod_kv_usage.remove(&l);
        self.pod_inflight_requests.remove(&l);
        self.pod_inflight_tokens.remove(&l);
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
