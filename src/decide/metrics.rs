//! The decision path's metric families: decisions by reason and primary pod, decision time,
//! predicted matched blocks; failures go to the shared error counter.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::picker::Reason;
use crate::pods::PodId;
use crate::telemetry::Errors;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct DecisionLabels {
    pub(super) reason: Reason,
    pub(super) pod: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct PdLabels {
    pub(super) outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct PodLabel {
    pub(super) pod: String,
}

/// The decision path's metric families.
#[derive(Debug, Clone)]
pub struct DecisionMetrics {
    pub(super) decisions: Family<DecisionLabels, Counter>,
    pub(super) duration: Histogram,
    pub(super) matched_blocks: Histogram,
    pub(super) errors: Errors,
    pub(super) pd: Family<PdLabels, Counter>,
    pub(super) prefill_picks: Family<PodLabel, Counter>,
    pub(super) prefill_exclusions: Family<PodLabel, Counter>,
}

impl DecisionMetrics {
    /// Registers `decisions`, `decision_duration_seconds` and `predicted_matched_blocks`
    /// (`registry` is the `kv_router` sub-registry); errors go to the shared counter.
    pub fn register(registry: &mut Registry, errors: Errors) -> Self {
        let m = Self {
            decisions: Family::default(),
            duration: Histogram::new(exponential_buckets(1e-6, 2.0, 24)),
            matched_blocks: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            errors,
            pd: Family::default(),
            prefill_picks: Family::default(),
            prefill_exclusions: Family::default(),
        };
        registry.register(
            "decisions",
            "Routing decisions by reason and primary pod",
            m.decisions.clone(),
        );
        registry.register(
            "decision_duration_seconds",
            "Time to decide (parse, keys, lookup, score, pick)",
            m.duration.clone(),
        );
        registry.register(
            "predicted_matched_blocks",
            "Prompt blocks the index predicted the chosen pod holds",
            m.matched_blocks.clone(),
        );
        registry.register(
            "pd_decisions",
            "Decisions on models with prefill pods: disaggregated, or why not",
            m.pd.clone(),
        );
        registry.register(
            "prefill_picks",
            "Disaggregated decisions by the prefill pod chosen",
            m.prefill_picks.clone(),
        );
        registry.register(
            "prefill_exclusions",
            "Times a prefill pod was excluded from prefill picks: the prefills sent it did not \
             show in its prefix-cache lookups in time",
            m.prefill_exclusions.clone(),
        );
        m
    }

    /// Counts a prefill pod's exclusion.
    pub(super) fn count_prefill_exclusion(&self, pod: &PodId) {
        self.prefill_exclusions
            .get_or_create(&PodLabel {
                pod: pod.to_string(),
            })
            .inc();
    }

    /// Counts a committed P/D decision and its prefill pod.
    pub(super) fn count_pd(&self, pd: &super::PdPlan) {
        self.pd
            .get_or_create(&PdLabels {
                outcome: pd.outcome.as_str(),
            })
            .inc();
        if let Some(pod) = &pd.prefill {
            self.prefill_picks
                .get_or_create(&PodLabel {
                    pod: pod.to_string(),
                })
                .inc();
        }
    }

    /// P/D decisions committed with `outcome` so far.
    pub fn pd_decisions(&self, outcome: super::PdOutcome) -> u64 {
        self.pd
            .get_or_create(&PdLabels {
                outcome: outcome.as_str(),
            })
            .get()
    }

    /// Decisions committed with `reason` to `pod` so far.
    pub fn decisions(&self, reason: Reason, pod: &PodId) -> u64 {
        self.decisions
            .get_or_create(&DecisionLabels {
                reason,
                pod: pod.to_string(),
            })
            .get()
    }

    /// Drops the `decisions{pod}` series of a pod that left (no series outlives its pod).
    pub fn forget_pod(&self, pod: &PodId) {
        self.prefill_picks.remove(&PodLabel {
            pod: pod.to_string(),
        });
        for reason in Reason::ALL {
            self.decisions.remove(&DecisionLabels {
                reason,
                pod: pod.to_string(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_departed_pods_decision_series_are_dropped() {
        let mut registry = Registry::default();
        let m = DecisionMetrics::register(&mut registry, Errors::default());
        let (gone, stays) = (PodId::new("10.0.0.1:8000"), PodId::new("10.0.0.2:8000"));
        for (reason, pod) in [
            (Reason::Scored, &gone),
            (Reason::AllSaturated, &gone),
            (Reason::Scored, &stays),
        ] {
            m.decisions
                .get_or_create(&DecisionLabels {
                    reason,
                    pod: pod.to_string(),
                })
                .inc();
        }
        m.forget_pod(&gone);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(!text.contains("10.0.0.1:8000"), "{text}");
        assert!(text.contains("10.0.0.2:8000"), "{text}");
    }
}
