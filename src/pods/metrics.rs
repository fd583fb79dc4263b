//! The pods' metric families: health, scraped load and this router's in-flight accounting, one
//! series per pod, dropped when the pod leaves.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

use super::{Pod, PodId, TtftModel};
use crate::telemetry::PodLabels;

type FloatGauge = Gauge<f64, AtomicU64>;
type FloatCounter = Counter<f64, AtomicU64>;

/// `kv_router_pod_*{pod}`.
#[derive(Debug, Clone, Default)]
pub struct PodMetrics {
    healthy: Family<PodLabels, Gauge>,
    waiting: Family<PodLabels, FloatGauge>,
    running: Family<PodLabels, FloatGauge>,
    kv_usage: Family<PodLabels, FloatGauge>,
    inflight_requests: Family<PodLabels, Gauge>,
    inflight_tokens: Family<PodLabels, Gauge>,
    prefill_speed: Family<PodLabels, FloatGauge>,
    routed_tokens: Family<PodLabels, FloatCounter>,
    predicted_hits: Family<PodLabels, FloatCounter>,
    query_tokens: Family<PodLabels, FloatCounter>,
    observed_hits: Family<PodLabels, FloatCounter>,
    hit_accuracy: Family<PodLabels, FloatGauge>,
    engine_restarts: Family<PodLabels, Counter>,
    lora_loads: Family<PodLabels, Counter>,
}

impl PodMetrics {
    /// Registers the families (`registry` is the `kv_router` sub-registry).
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "pod_healthy",
            "1 if the pod passed its health probes",
            m.healthy.clone(),
        );
        registry.register(
            "pod_waiting_requests",
            "vllm:num_requests_waiting (scraped)",
            m.waiting.clone(),
        );
        registry.register(
            "pod_running_requests",
            "vllm:num_requests_running (scraped)",
            m.running.clone(),
        );
        registry.register(
            "pod_kv_cache_usage_ratio",
            "vllm:kv_cache_usage_perc (scraped)",
            m.kv_usage.clone(),
        );
        registry.register(
            "pod_inflight_requests",
            "Requests this router routed to the pod and still counts",
            m.inflight_requests.clone(),
        );
        registry.register(
            "pod_inflight_uncached_tokens",
            "Uncached prompt tokens this router routed to the pod, still prefilling",
            m.inflight_tokens.clone(),
        );
        registry.register(
            "pod_prefill_tokens_per_second",
            "The pod's prefill speed as this router learned it from the engine's timing (the prior until it reports)",
            m.prefill_speed.clone(),
        );
        registry.register(
            "pod_routed_prompt_tokens",
            "Prompt tokens this router routed to the pod, counted at each scrape of its prefix-cache counters",
            m.routed_tokens.clone(),
        );
        registry.register(
            "pod_predicted_hit_tokens",
            "Of the routed prompt tokens, those this router predicted the pod had cached",
            m.predicted_hits.clone(),
        );
        registry.register(
            "pod_observed_query_tokens",
            "Prompt tokens the pod looked up in its prefix cache, all traffic (vllm:prefix_cache_queries)",
            m.query_tokens.clone(),
        );
        registry.register(
            "pod_observed_hit_tokens",
            "Prompt tokens the pod found in its prefix cache, all traffic (vllm:prefix_cache_hits)",
            m.observed_hits.clone(),
        );
        registry.register(
            "pod_hit_accuracy_ratio",
            "Observed over predicted prefix-cache hit rate, last 8 scrapes (1 = the index is right, below = it predicts hits the pod lacks)",
            m.hit_accuracy.clone(),
        );
        registry.register(
            "pod_engine_restarts",
            "Times the pod's prefix-cache counters went backwards: its engine restarted with an empty cache (approximate mode forgets its index entries)",
            m.engine_restarts.clone(),
        );
        registry.register(
            "lora_adapter_loads",
            "LoRA adapters that started running on the pod (absent from its running set at the previous scrape)",
            m.lora_loads.clone(),
        );
        m
    }

    /// Sets a pod's gauges to its state at `now`; `model` is its learned prefill model.
    pub fn observe(&self, pod: &Pod, model: &TtftModel, now: Instant, stale_after: Duration) {
        let l = PodLabels {
            pod: pod.id().to_string(),
        };
        self.healthy
            .get_or_create(&l)
            .set(i64::from(pod.is_healthy()));
        let load = pod.load(now, stale_after);
        self.waiting.get_or_create(&l).set(load.waiting);
        self.running.get_or_create(&l).set(load.running);
        self.kv_usage.get_or_create(&l).set(load.kv_usage);
        self.inflight_requests
            .get_or_create(&l)
            .set(load.inflight_requests as i64);
        self.inflight_tokens
            .get_or_create(&l)
            .set(load.inflight_tokens as i64);
        if model.sec_per_token > 0.0 {
            self.prefill_speed
                .get_or_create(&l)
                .set(1.0 / model.sec_per_token);
        }
        let w = pod.take_hit_windows();
        self.routed_tokens.get_or_create(&l).inc_by(w.routed);
        self.predicted_hits.get_or_create(&l).inc_by(w.predicted);
        self.query_tokens.get_or_create(&l).inc_by(w.queries);
        self.observed_hits.get_or_create(&l).inc_by(w.observed);
        let report = pod.hit_accuracy();
        match report.accuracy {
            Some(a) => {
                self.hit_accuracy.get_or_create(&l).set(a);
            }
            None => {
                self.hit_accuracy.remove(&l);
            }
        }
        let loads = pod.take_lora_loads();
        // Only pods that report residency get a series: no zero rows for LoRA-less fleets.
        if loads > 0 || pod.lora_residency().is_some() {
            self.lora_loads.get_or_create(&l).inc_by(loads);
        }
    }

    /// The pod's engine restarted (see [`Pod::take_restart`]).
    pub fn engine_restarted(&self, pod: &PodId) {
        let l = PodLabels {
            pod: pod.to_string(),
        };
        self.engine_restarts.get_or_create(&l).inc();
    }

    /// Drops the series of a pod that left.
    pub fn forget(&self, pod: &PodId) {
        let l = PodLabels {
            pod: pod.to_string(),
        };
        self.healthy.remove(&l);
        self.waiting.remove(&l);
        self.running.remove(&l);
        self.kv_usage.remove(&l);
        self.inflight_requests.remove(&l);
        self.inflight_tokens.remove(&l);
        self.prefill_speed.remove(&l);
        self.routed_tokens.remove(&l);
        self.predicted_hits.remove(&l);
        self.query_tokens.remove(&l);
        self.observed_hits.remove(&l);
        self.hit_accuracy.remove(&l);
        self.engine_restarts.remove(&l);
        self.lora_loads.remove(&l);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pods::{LoadSample, PodSpec, PrefixCounters};

    #[test]
    fn prediction_accuracy_is_exported_per_pod() {
        let mut reg = Registry::default();
        let m = PodMetrics::register(&mut reg);
        let pod = Pod::new(PodSpec {
            id: PodId::new("127.0.0.1:8"),
            addr: "127.0.0.1:8".parse().unwrap(),
            models: vec![],
            labels: Default::default(),
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
        });
        let now = Instant::now();
        let scrape = |queries, hits| LoadSample {
            prefix_cache: Some(PrefixCounters { queries, hits }),
            ..LoadSample::default()
        };
        pod.record_sample(now, scrape(1000.0, 500.0));
        pod.predicted_hits(800, 1000);
        pod.record_sample(now, scrape(3000.0, 1300.0));
        m.observe(&pod, &TtftModel::default(), now, Duration::from_secs(1));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        for line in [
            r#"pod_routed_prompt_tokens_total{pod="127.0.0.1:8"} 1000.0"#,
            r#"pod_predicted_hit_tokens_total{pod="127.0.0.1:8"} 800.0"#,
            r#"pod_observed_query_tokens_total{pod="127.0.0.1:8"} 2000.0"#,
            r#"pod_observed_hit_tokens_total{pod="127.0.0.1:8"} 800.0"#,
            // Observed 0.4 of queried tokens against 0.8 predicted.
            r#"pod_hit_accuracy_ratio{pod="127.0.0.1:8"} 0.5"#,
        ] {
            assert!(out.contains(line), "{line} in {out}");
        }
        m.observe(&pod, &TtftModel::default(), now, Duration::from_secs(1));
        out.clear();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        assert!(
            out.contains(r#"pod_predicted_hit_tokens_total{pod="127.0.0.1:8"} 800.0"#),
            "a window is counted once: {out}"
        );
    }

    #[test]
    fn a_departed_pods_series_are_dropped() {
        let mut reg = Registry::default();
        let m = PodMetrics::register(&mut reg);
        let pod = Pod::new(PodSpec {
            id: PodId::new("127.0.0.1:7"),
            addr: "127.0.0.1:7".parse().unwrap(),
            models: vec![],
            labels: Default::default(),
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
        });
        pod.record_probe(true, 1);
        let now = Instant::now();
        pod.record_sample(
            now,
            LoadSample {
                waiting: 3.0,
                ..LoadSample::default()
            },
        );
        m.observe(&pod, &TtftModel::default(), now, Duration::from_secs(1));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        assert!(
            out.contains(r#"pod_waiting_requests{pod="127.0.0.1:7"} 3.0"#),
            "{out}"
        );
        assert!(out.contains(r#"pod_healthy{pod="127.0.0.1:7"} 1"#), "{out}");
        assert!(
            out.contains(r#"pod_prefill_tokens_per_second{pod="127.0.0.1:7"} 10000.0"#),
            "the prior's speed until the engine reports: {out}"
        );
        m.forget(pod.id());
        out.clear();
        prometheus_client::encoding::text::encode(&mut out, &reg).unwrap();
        assert!(!out.contains("127.0.0.1:7"), "{out}");
    }
}
