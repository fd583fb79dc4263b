//! The maintenance loop: once a second, each pod's index capacity from its KV size (held to
//! `index.max_pod_cache_tokens`), the index's TTL sweep, and the index, session and per-pod
//! gauges.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::time::{interval, Instant, MissedTickBehavior};
use tracing::warn;

use crate::config::Config;
use crate::decide::Decider;
use crate::index::index_capacity;
use crate::pods::{prefill_models, LoadSample, PodMetrics, PodRegistry};
use crate::scoring::SessionStore;
use crate::telemetry::gie::{GieMetrics, PodSample};
use crate::telemetry::{ErrorKind, Errors};

use super::Shared;

/// The gauges the maintenance loop sets.
#[derive(Debug, Clone, Default)]
pub(super) struct MaintenanceMetrics {
    index_entries: Gauge,
    index_keys: Gauge,
    sessions: Gauge,
    capacity_clamped: Counter,
}

impl MaintenanceMetrics {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "index_entries",
            "(block key, pod) entries in the prefix index",
            m.index_entries.clone(),
        );
        registry.register(
            "index_keys",
            "Distinct block keys in the prefix index",
            m.index_keys.clone(),
        );
        registry.register("sessions", "Sessions remembered", m.sessions.clone());
        registry.register(
            "pod_capacity_clamped",
            "Index capacities set from a pod's KV-cache report held to index.max_pod_cache_tokens",
            m.capacity_clamped.clone(),
        );
        m
    }
}

/// What the maintenance loop reports to.
#[derive(Clone)]
pub(super) struct Gauges {
    pub pods: PodMetrics,
    pub maintenance: MaintenanceMetrics,
    pub gie: GieMetrics,
    pub errors: Errors,
}

/// Starts the `maintenance` loop under the supervisor.
pub(super) fn start(cfg: &Config, shared: &Shared, gauges: Gauges) {
    let (cfg, pods, decider, sessions) = (
        cfg.clone(),
        shared.pods.clone(),
        shared.decider.clone(),
        shared.sessions.clone(),
    );
    shared.supervisor.spawn("maintenance", move || {
        maintenance(
            cfg.clone(),
            pods.clone(),
            decider.clone(),
            sessions.clone(),
            gauges.clone(),
        )
    });
}

/// Once a second: index capacity from each pod's KV size, TTL sweep, gauges.
async fn maintenance(
    cfg: Config,
    pods: Arc<PodRegistry>,
    decider: Arc<Decider>,
    sessions: Arc<SessionStore>,
    gauges: Gauges,
) {
    let stale_after = Duration::from_millis(cfg.pods.stale_after_ms);
    let mut capacities = ahash::AHashMap::new();
    let mut tick = interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let index = decider.index();
        let now = Instant::now();
        let snapshot = pods.snapshot();
        let models = prefill_models(snapshot.pods(), decider.ttft_prior());
        let healthy: Vec<PodSample> = snapshot
            .pods()
            .iter()
            .filter(|p| p.is_healthy())
            .map(|p| {
                let load = p.load(now, stale_after);
                PodSample {
                    pod: p.id().to_string(),
                    waiting: load.waiting,
                    running: load.running,
                    kv_usage: load.kv_usage,
                }
            })
            .collect();
        gauges.gie.observe_pool(&healthy);
        for (pod, model) in snapshot.pods().iter().zip(&models) {
            if pod.take_restart() {
                gauges.pods.engine_restarted(pod.id());
                // Its cache is empty; precise mode learns that from AllBlocksCleared instead.
                if !cfg.kv_events.enabled {
                    match index.forget_pod(pod.id()).await {
                        // Forgetting drops the pod's capacity too: set it again below.
                        Ok(()) => _ = capacities.remove(pod.id()),
                        Err(e) => {
                            warn!(pod = %pod.id(), error = %e, "forgetting a restarted pod's index entries failed");
                            gauges.errors.inc(ErrorKind::Index);
                        }
                    }
                }
            }
            gauges.pods.observe(pod, model, now, stale_after);
            let Some((_, sample)) = pod.last_sample() else {
                continue;
            };
            let Some(cap) = pod_capacity(&cfg, &sample) else {
                continue;
            };
            if capacities.get(pod.id()) != Some(&cap) {
                if let Some(reported) = clamped_report(&cfg, &sample) {
                    warn!(
                        pod = %pod.id(),
                        reported_tokens = reported,
                        max_pod_cache_tokens = cfg.index.max_pod_cache_tokens,
                        "pod reports a KV cache past index.max_pod_cache_tokens; its index capacity is held to that"
                    );
                    gauges.maintenance.capacity_clamped.inc();
                }
                match index.set_capacity(pod.id(), cap).await {
                    Ok(()) => {
                        capacities.insert(pod.id().clone(), cap);
                    }
                    Err(e) => {
                        warn!(pod = %pod.id(), error = %e, "setting index capacity failed");
                        gauges.errors.inc(ErrorKind::Index);
                    }
                }
            }
        }
        if let Err(e) = index.sweep(decider.now_ms()).await {
            warn!(error = %e, "index TTL sweep failed");
            gauges.errors.inc(ErrorKind::Index);
        }
        let stats = index.stats();
        let m = &gauges.maintenance;
        m.index_entries.set(stats.entries as i64);
        m.index_keys.set(stats.keys as i64);
        m.sessions.set(sessions.len() as i64);
    }
}

/// A pod's index capacity from its KV size (`cache_config_info`); a pod without one keeps the
/// index's default.
fn pod_capacity(cfg: &Config, sample: &LoadSample) -> Option<usize> {
    let blocks = sample.num_gpu_blocks?;
    Some(index_capacity(
        &cfg.index,
        &cfg.blocks,
        blocks,
        sample.block_size.unwrap_or(16),
    ))
}

/// The KV-cache tokens a pod reports when `index.max_pod_cache_tokens` holds them.
fn clamped_report(cfg: &Config, sample: &LoadSample) -> Option<u64> {
    let blocks = sample.num_gpu_blocks?;
    let block_tokens = sample.block_size.unwrap_or(16);
    let (_, clamped) = cfg.index.pod_cache_tokens(blocks, block_tokens);
    clamped.then(|| blocks.saturating_mul(block_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_without_its_kv_size_is_left_to_the_index_default() {
        let cfg = Config::default();
        assert_eq!(pod_capacity(&cfg, &LoadSample::default()), None);
        let sized = LoadSample {
            num_gpu_blocks: Some(1000),
            block_size: Some(16),
            ..LoadSample::default()
        };
        let full = index_capacity(&cfg.index, &cfg.blocks, 1000, 16);
        assert_eq!(pod_capacity(&cfg, &sized), Some(full));
    }

    #[test]
    fn a_pods_reported_cache_is_held_to_the_configured_maximum() {
        let cfg = Config::default();
        // `num_gpu_blocks="1e15"` as an integer: a quadrillion blocks of 16 tokens.
        let liar = LoadSample {
            num_gpu_blocks: Some(1_000_000_000_000_000),
            block_size: Some(16),
            ..LoadSample::default()
        };
        let max = cfg.index.max_pod_cache_tokens;
        let most = index_capacity(&cfg.index, &cfg.blocks, max / 16, 16);
        assert_eq!(pod_capacity(&cfg, &liar), Some(most));
        assert_eq!(clamped_report(&cfg, &liar), Some(16_000_000_000_000_000));
        let honest = LoadSample {
            num_gpu_blocks: Some(max / 16),
            ..liar
        };
        assert_eq!(pod_capacity(&cfg, &honest), Some(most));
        assert_eq!(
            clamped_report(&cfg, &honest),
            None,
            "at the maximum: not held"
        );
    }
}
