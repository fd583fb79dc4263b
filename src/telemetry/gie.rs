//! The Gateway API Inference Extension's standard metric families, exported next to
//! `kv_router_*` so the GIE dashboards and autoscaling recipes that read an endpoint picker work
//! unchanged: the pool gauges (`inference_pool_*`, set by the maintenance loop each second) and
//! the per-model request families (`inference_objective_*`, set on the ext_proc path).
//!
//! Labels: `name` is the InferencePool's name (`default` without one); `model_server_pod` the
//! pod's `ip:port` (GIE's picker uses the Kubernetes pod name); `model_name` a model some pod
//! serves, at most [`MAX_MODELS`] distinct ones (then `other`), and empty on a refusal made
//! before the model was known, so clients cannot grow the series with invented names.

use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Distinct `model_name` values kept; later ones are counted as `other`.
pub const MAX_MODELS: usize = 64;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    name: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodLabels {
    model_server_pod: String,
    name: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model_name: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TargetLabels {
    model_name: String,
    target_model_name: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    model_name: String,
    target_model_name: String,
    error_code: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// One pod's load as the pool gauges average it.
#[derive(Debug, Clone, PartialEq)]
pub struct PodSample {
    /// `ip:port`.
    pub pod: String,
    /// Requests queued at the engine.
    pub waiting: f64,
    /// Requests running at the engine.
    pub running: f64,
    /// KV-cache usage, 0..1.
    pub kv_usage: f64,
}

/// The GIE families (see the module comment).
#[derive(Debug, Clone)]
pub struct GieMetrics {
    pool: String,
    ready_pods: Family<PoolLabels, Gauge>,
    kv: Family<PoolLabels, FloatGauge>,
    queue: Family<PoolLabels, FloatGauge>,
    running_avg: Family<PoolLabels, FloatGauge>,
    per_pod_queue: Family<PodLabels, FloatGauge>,
    requests: Family<TargetLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    running: Family<ModelLabels, Gauge>,
    models: Arc<Mutex<HashSet<String>>>,
    pods_seen: Arc<Mutex<HashSet<String>>>,
}

impl GieMetrics {
    /// Registers the families on the root registry (GIE's names carry no prefix); `pool` is the
    /// InferencePool's name, if the router watches one.
    pub fn register(root: &mut Registry, pool: Option<&str>) -> Self {
        let m = Self {
            pool: pool.unwrap_or("default").to_string(),
            ready_pods: Family::default(),
            kv: Family::default(),
            queue: Family::default(),
            running_avg: Family::default(),
            per_pod_queue: Family::default(),
            requests: Family::default(),
            errors: Family::default(),
            running: Family::default(),
            models: Arc::default(),
            pods_seen: Arc::default(),
        };
        let r = root.sub_registry_with_prefix("inference_pool");
        r.register(
            "ready_pods",
            "Healthy pods in the pool",
            m.ready_pods.clone(),
        );
        r.register(
            "average_kv_cache_utilization",
            "Mean KV-cache usage (0..1) of the pool's healthy pods",
            m.kv.clone(),
        );
        r.register(
            "average_queue_size",
            "Mean requests queued at the pool's healthy pods",
            m.queue.clone(),
        );
        r.register(
            "average_running_requests",
            "Mean requests running at the pool's healthy pods",
            m.running_avg.clone(),
        );
        r.register(
            "per_pod_queue_size",
            "Requests queued at each healthy pod of the pool",
            m.per_pod_queue.clone(),
        );
        let r = root.sub_registry_with_prefix("inference_objective");
        r.register("request", "Requests routed, by model", m.requests.clone());
        r.register(
            "request_error",
            "Requests refused by the router, by model and error code",
            m.errors.clone(),
        );
        r.register(
            "running_requests",
            "Routed requests not finished yet, by model",
            m.running.clone(),
        );
        m
    }

    /// Sets the pool gauges from the healthy pods' last samples; a departed pod's series goes.
    pub fn observe_pool(&self, healthy: &[PodSample]) {
        let pool = PoolLabels {
            name: self.pool.clone(),
        };
        self.ready_pods
            .get_or_create(&pool)
            .set(healthy.len() as i64);
        let n = healthy.len().max(1) as f64;
        // Folded from +0.0: an empty f64 sum is -0.0, which the exposition prints as such.
        let mean = |f: fn(&PodSample) -> f64| healthy.iter().map(f).fold(0.0, |a, b| a + b) / n;
        self.kv.get_or_create(&pool).set(mean(|p| p.kv_usage));
        self.queue.get_or_create(&pool).set(mean(|p| p.waiting));
        self.running_avg
            .get_or_create(&pool)
            .set(mean(|p| p.running));
        let mut seen = self.pods_seen.lock();
        let now: HashSet<String> = healthy.iter().map(|p| p.pod.clone()).collect();
        for gone in seen.difference(&now) {
            self.per_pod_queue.remove(&PodLabels {
                model_server_pod: gone.clone(),
                name: self.pool.clone(),
            });
        }
        for p in healthy {
            self.per_pod_queue
                .get_or_create(&PodLabels {
                    model_server_pod: p.pod.clone(),
                    name: self.pool.clone(),
                })
                .set(p.waiting);
        }
        *seen = now;
    }

    /// The label for `model`: itself while fewer than [`MAX_MODELS`] are known, else `other`.
    fn model_label(&self, model: Option<&str>) -> String {
        let Some(model) = model else {
            return String::new();
        };
        let mut models = self.models.lock();
        if models.contains(model) {
            return model.to_string();
        }
        if models.len() < MAX_MODELS {
            models.insert(model.to_string());
            return model.to_string();
        }
        "other".to_string()
    }

    /// Counts a routed request of `model`; it runs until the returned guard drops.
    pub fn routed(&self, model: Option<&str>) -> Running {
        let model_name = self.model_label(model);
        self.requests
            .get_or_create(&TargetLabels {
                model_name: model_name.clone(),
                target_model_name: model_name.clone(),
            })
            .inc();
        let gauge = self
            .running
            .get_or_create(&ModelLabels { model_name })
            .clone();
        gauge.inc();
        Running(gauge)
    }

    /// Counts a refusal (`code`: the router's error kind) of a request for `model`, if known.
    pub fn refused(&self, model: Option<&str>, code: &str) {
        let model_name = self.model_label(model);
        self.errors
            .get_or_create(&ErrorLabels {
                target_model_name: model_name.clone(),
                model_name,
                error_code: code.to_string(),
            })
            .inc();
    }
}

/// A routed request in `inference_objective_running_requests` until dropped.
#[derive(Debug)]
pub struct Running(Gauge);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    fn text(r: &Registry) -> String {
        let mut s = String::new();
        encode(&mut s, r).unwrap();
        s
    }

    fn sample(pod: &str, waiting: f64, running: f64, kv: f64) -> PodSample {
        PodSample {
            pod: pod.into(),
            waiting,
            running,
            kv_usage: kv,
        }
    }

    #[test]
    fn pool_gauges_average_the_healthy_pods_and_drop_departed_ones() {
        let mut r = Registry::default();
        let m = GieMetrics::register(&mut r, Some("vllm-pool"));
        m.observe_pool(&[
            sample("10.0.0.1:8000", 2.0, 4.0, 0.5),
            sample("10.0.0.2:8000", 4.0, 0.0, 0.1),
        ]);
        let t = text(&r);
        for line in [
            "inference_pool_ready_pods{name=\"vllm-pool\"} 2",
            "inference_pool_average_queue_size{name=\"vllm-pool\"} 3.0",
            "inference_pool_average_running_requests{name=\"vllm-pool\"} 2.0",
            "inference_pool_average_kv_cache_utilization{name=\"vllm-pool\"} 0.3",
            "inference_pool_per_pod_queue_size{model_server_pod=\"10.0.0.2:8000\",name=\"vllm-pool\"} 4.0",
        ] {
            assert!(t.contains(line), "{line} missing in\n{t}");
        }
        m.observe_pool(&[sample("10.0.0.2:8000", 1.0, 0.0, 0.0)]);
        let t = text(&r);
        assert!(!t.contains("10.0.0.1:8000"), "{t}");
        assert!(t.contains("inference_pool_ready_pods{name=\"vllm-pool\"} 1"));
        m.observe_pool(&[]);
        let t = text(&r);
        assert!(
            t.contains("inference_pool_average_queue_size{name=\"vllm-pool\"} 0.0"),
            "{t}"
        );
    }

    #[test]
    fn requests_count_and_run_by_model_with_bounded_labels() {
        let mut r = Registry::default();
        let m = GieMetrics::register(&mut r, None);
        let a = m.routed(Some("llama"));
        let b = m.routed(Some("llama"));
        drop(a);
        m.refused(None, "no_healthy_pod");
        let t = text(&r);
        assert!(t.contains("inference_objective_request_total{model_name=\"llama\",target_model_name=\"llama\"} 2"), "{t}");
        assert!(
            t.contains("inference_objective_running_requests{model_name=\"llama\"} 1"),
            "{t}"
        );
        assert!(t.contains("inference_objective_request_error_total{model_name=\"\",target_model_name=\"\",error_code=\"no_healthy_pod\"} 1"), "{t}");
        drop(b);
        for i in 0..(MAX_MODELS + 10) {
            drop(m.routed(Some(&format!("m{i}"))));
        }
        let t = text(&r);
        let series = t
            .lines()
            .filter(|l| l.starts_with("inference_objective_request_total{"))
            .count();
        assert_eq!(
            series,
            MAX_MODELS + 1,
            "the first {MAX_MODELS} models and `other`"
        );
        assert!(t.contains("model_name=\"other\""));
    }
}
