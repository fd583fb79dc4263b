//! The receipts' per-pod families: predicted and observed cached prompt tokens of judged
//! requests, requests judged, judged incorrectly routed, and answered without a cached count.
//! Pod labels are the pods' addresses, dropped when a pod leaves (as every per-pod family).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::pods::PodId;

use super::Observed;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodLabel {
    pod: String,
}

/// `kv_router_route_*`.
#[derive(Debug, Clone, Default)]
pub struct RouteMetrics {
    predicted: Family<PodLabel, Counter>,
    observed: Family<PodLabel, Counter>,
    judged: Family<PodLabel, Counter>,
    incorrect: Family<PodLabel, Counter>,
    unobserved: Family<PodLabel, Counter>,
}

impl RouteMetrics {
    /// Registers the families (`registry` is the `kv_router` sub-registry).
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "route_predicted_cached_tokens",
            "Prompt tokens the router predicted cached on the chosen pod, of judged requests",
            m.predicted.clone(),
        );
        registry.register(
            "route_observed_cached_tokens",
            "Prompt tokens the engine reported cached, of judged requests",
            m.observed.clone(),
        );
        registry.register(
            "route_judged",
            "Routed requests whose response reported the engine's cached prompt tokens",
            m.judged.clone(),
        );
        registry.register(
            "route_incorrect",
            "Judged requests whose engine found fewer cached tokens than predicted, by more than \
             one block or a tenth of the prompt",
            m.incorrect.clone(),
        );
        registry.register(
            "route_unobserved",
            "Routed requests whose response ended without a cached-token count",
            m.unobserved.clone(),
        );
        m
    }

    fn label(pod: &PodId) -> PodLabel {
        PodLabel {
            pod: pod.to_string(),
        }
    }

    pub(super) fn judged(&self, pod: &PodId, predicted: u64, o: &Observed) {
        let l = Self::label(pod);
        self.predicted.get_or_create(&l).inc_by(predicted);
        self.observed.get_or_create(&l).inc_by(o.cached_tokens);
        self.judged.get_or_create(&l).inc();
        if o.incorrect {
            self.incorrect.get_or_create(&l).inc();
        }
    }

    pub(super) fn unobserved(&self, pod: &PodId) {
        self.unobserved.get_or_create(&Self::label(pod)).inc();
    }

    /// Drops a departed pod's series.
    pub fn forget_pod(&self, pod: &PodId) {
        let l = Self::label(pod);
        for f in [
            &self.predicted,
            &self.observed,
            &self.judged,
            &self.incorrect,
            &self.unobserved,
        ] {
            f.remove(&l);
        }
    }
}
