//! Flow control's metric families. Labels are bounded by the configuration: a priority is its
//! number only when the configuration names it (the default, `shed_below`, an objective's),
//! else "other"; a flow is its name only when listed in `flow_control.flows`, else "other".

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::Refusal;
use crate::config::FlowConfig;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    priority: String,
    flow: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WaitLabels {
    priority: String,
    flow: String,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RejectLabels {
    reason: &'static str,
    priority: String,
    flow: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    reason: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn wait_histogram() -> Histogram {
    // 1 ms .. ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// `kv_router_flow_queued{priority,flow}`, `kv_router_flow_wait_seconds{priority,flow,outcome}`,
/// `kv_router_flow_rejections_total{reason,priority,flow}`, `kv_router_flow_objectives_watched`,
/// `kv_router_flow_objectives_limited_total{reason}`.
#[derive(Debug, Clone)]
pub struct FlowMetrics {
    queued: Family<QueueLabels, Gauge>,
    wait: HistogramFamily<WaitLabels>,
    rejections: Family<RejectLabels, Counter>,
    objectives: Gauge,
    objectives_limited: Family<LimitLabels, Counter>,
    priorities: Arc<BTreeSet<i32>>,
}

impl FlowMetrics {
    /// Registers the families (`registry` is the `kv_router` sub-registry).
    pub fn register(registry: &mut Registry, cfg: &FlowConfig) -> Self {
        let mut priorities: BTreeSet<i32> = cfg.objectives.values().copied().collect();
        priorities.extend([cfg.default_priority, cfg.shed_below]);
        let m = Self {
            queued: Family::default(),
            wait: Family::new_with_constructor(wait_histogram),
            rejections: Family::default(),
            objectives: Gauge::default(),
            objectives_limited: Family::default(),
            priorities: Arc::new(priorities),
        };
        registry.register(
            "flow_queued",
            "Requests waiting in flow control for a pod with room",
            m.queued.clone(),
        );
        registry.register(
            "flow_wait_seconds",
            "Time requests waited in flow control, by how the wait ended",
            m.wait.clone(),
        );
        registry.register(
            "flow_rejections",
            "Requests flow control answered with 429 (queue full, timed out, shed)",
            m.rejections.clone(),
        );
        registry.register(
            "flow_objectives_watched",
            "InferenceObjectives of the pool whose priority requests get",
            m.objectives.clone(),
        );
        registry.register(
            "flow_objectives_limited",
            "InferenceObjective events limited: dropped past the cap (over_cap) or priority clamped to the classes' range (clamped)",
            m.objectives_limited.clone(),
        );
        m
    }

    pub(super) fn objectives_known(&self, n: usize) {
        self.objectives.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub(super) fn objective_limited(&self, reason: &'static str) {
        self.objectives_limited
            .get_or_create(&LimitLabels { reason })
            .inc();
    }

    fn priority(&self, p: i32) -> String {
        if self.priorities.contains(&p) {
            p.to_string()
        } else {
            "other".to_string()
        }
    }

    pub(super) fn queued(&self, priority: i32, flow: &str, delta: i64) {
        let g = self.queued.get_or_create(&QueueLabels {
            priority: self.priority(priority),
            flow: flow.to_string(),
        });
        g.inc_by(delta);
    }

    pub(super) fn waited(&self, priority: i32, flow: &str, outcome: &'static str, d: Duration) {
        self.wait
            .get_or_create(&WaitLabels {
                priority: self.priority(priority),
                flow: flow.to_string(),
                outcome,
            })
            .observe(d.as_secs_f64());
    }

    pub(super) fn rejected(&self, reason: Refusal, priority: i32, flow: &str) {
        self.rejections
            .get_or_create(&RejectLabels {
                reason: reason.as_str(),
                priority: self.priority(priority),
                flow: flow.to_string(),
            })
            .inc();
    }
}
