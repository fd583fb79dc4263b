//! Telemetry: every metric family, registered once and in a fixed order (the order `/metrics`
//! lists them in), handed out to the components that report to them.

use std::sync::Arc;

use prometheus_client::registry::Registry;

use crate::config::{Config, IndexBackend};
use crate::decide::DecisionMetrics;
use crate::extproc::ExtProcMetrics;
use crate::flow::FlowMetrics;
use crate::index::RedisMetrics;
use crate::ingest::IngestMetrics;
use crate::observe::RouteMetrics;
use crate::pods::PodMetrics;
use crate::supervise::Supervisor;
use crate::telemetry::gie::GieMetrics;
use crate::telemetry::Errors;

use super::maintenance::MaintenanceMetrics;
use super::warm::WarmMetrics;
use crate::server::conns::ConnMetrics;

/// The registry and each component's metrics.
pub(super) struct Telemetry {
    /// Everything, for `/metrics`.
    pub registry: Arc<Registry>,
    /// KV-event ingestion (its own families, unprefixed).
    pub ingest: Arc<IngestMetrics>,
    /// Errors by kind, shared by every component.
    pub errors: Errors,
    /// Decisions.
    pub decisions: DecisionMetrics,
    /// ext_proc streams.
    pub extproc: ExtProcMetrics,
    /// Per-pod gauges.
    pub pods: PodMetrics,
    /// Index and session gauges.
    pub maintenance: MaintenanceMetrics,
    /// Background loops and their restarts.
    pub supervisor: Supervisor,
    /// The shared index (`backend: redis` only).
    pub redis: Option<RedisMetrics>,
    /// Open and closed connections of both listeners.
    pub conns: ConnMetrics,
    /// Flow control (`flow_control.enabled` only).
    pub flow: Option<FlowMetrics>,
    /// Route receipts (`receipts.enabled` only).
    pub routes: Option<RouteMetrics>,
    /// The Gateway API Inference Extension's families.
    pub gie: GieMetrics,
    /// Warm starts (`index.warm_start`).
    pub warm: WarmMetrics,
}

impl Telemetry {
    /// Registers every family (the router's own under the `kv_router` prefix).
    pub fn register(cfg: &Config) -> Self {
        let mut root = Registry::default();
        // KV-event ingestion registers its own families under the same prefix.
        let ingest = Arc::new(IngestMetrics::register(&mut root));
        let pool = cfg.pods.kubernetes.as_ref().and_then(|k| k.pool.as_ref());
        let gie = GieMetrics::register(&mut root, pool.map(|p| p.name.as_str()));
        let registry = root.sub_registry_with_prefix("kv_router");
        crate::telemetry::register_build_info(registry);
        let errors = Errors::register(registry);
        let decisions = DecisionMetrics::register(registry, errors.clone());
        let extproc = ExtProcMetrics::register(registry, errors.clone()).with_gie(gie.clone());
        let pods = PodMetrics::register(registry);
        let maintenance = MaintenanceMetrics::register(registry);
        let supervisor = Supervisor::register(registry);
        let redis =
            (cfg.index.backend == IndexBackend::Redis).then(|| RedisMetrics::register(registry));
        let conns = ConnMetrics::register(registry);
        let warm = WarmMetrics::register(registry);
        let flow = cfg
            .flow_control
            .enabled
            .then(|| FlowMetrics::register(registry, &cfg.flow_control));
        let routes = cfg
            .receipts
            .enabled
            .then(|| RouteMetrics::register(registry));
        Self {
            registry: Arc::new(root),
            ingest,
            errors,
            decisions,
            extproc,
            pods,
            maintenance,
            supervisor,
            redis,
            conns,
            flow,
            routes,
            gie,
            warm,
        }
    }
}
