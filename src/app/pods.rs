//! Pods: discovery (static, DNS, Kubernetes), health probes and load scrapes, and forgetting
//! what departed pods left behind.

use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use crate::config::PodsConfig;
use crate::decide::DecisionMetrics;
use crate::pods::{DnsSource, PodId, PodMetrics, PodRegistry, PodSource, Prober, StaticSource};
use crate::telemetry::{ErrorKind, Errors};

use super::Shared;

/// Runs the first discovery pass now, then starts the `discovery`, `health` and `scrape` loops.
/// Fails only when a Kubernetes source cannot start.
pub(super) async fn start(
    cfg: &PodsConfig,
    shared: &Shared,
    errors: &Errors,
    pod_metrics: PodMetrics,
    decision_metrics: DecisionMetrics,
) -> anyhow::Result<()> {
    let pods = &shared.pods;
    let mut sources: Vec<Box<dyn PodSource>> = Vec::new();
    if !cfg.static_pods.is_empty() {
        sources.push(Box::new(StaticSource::new(&cfg.static_pods)));
    }
    let mut refresh_ms = 5_000;
    for d in &cfg.dns {
        refresh_ms = refresh_ms.min(d.refresh_ms);
        sources.push(Box::new(DnsSource::new(d.clone(), cfg.models.clone())));
    }
    #[cfg(feature = "kubernetes")]
    if let Some(k) = &cfg.kubernetes {
        refresh_ms = refresh_ms.min(k.refresh_ms);
        let models = cfg.models.clone();
        let source = crate::pods::KubernetesSource::start(k.clone(), models, Some(errors.clone()));
        let mut source = source.await?;
        if let Some(flow) = &shared.flow {
            source.watch_objectives(flow.config(), flow.objectives());
        }
        sources.push(Box::new(source));
    }
    // Static-only pod sets never change, but the first pass must happen now.
    let first: Vec<_> = futures::future::join_all(sources.iter().map(|s| s.pods())).await;
    let mut specs = Vec::new();
    for (source, result) in sources.iter().zip(first) {
        match result {
            Ok(pods) => specs.extend(pods),
            Err(e) => {
                // The discovery loop retries it.
                warn!(source = %source.name(), error = %e, "pod source failed at startup");
                errors.inc(ErrorKind::PodSource);
            }
        }
    }
    pods.update(specs);
    let prober = Prober::new(cfg.clone(), pods.clone(), errors.clone());
    {
        let on_gone = on_gone(shared, pod_metrics, decision_metrics, errors.clone());
        let sources: Arc<[Box<dyn PodSource>]> = sources.into();
        let p = prober.clone();
        let refresh = Duration::from_millis(refresh_ms);
        shared.supervisor.spawn("discovery", move || {
            p.clone()
                .run_discovery(sources.clone(), refresh, on_gone.clone())
        });
    }
    let p = prober.clone();
    shared
        .supervisor
        .spawn("health", move || p.clone().run_health());
    let p = prober.clone();
    shared
        .supervisor
        .spawn("scrape", move || p.clone().run_scrape());
    Ok(())
}

/// What discovery calls with the pods that left: their sessions, metric series and index
/// entries go (the index in the background, as it may be remote).
fn on_gone(
    shared: &Shared,
    pod_metrics: PodMetrics,
    decision_metrics: DecisionMetrics,
    errors: Errors,
) -> Arc<dyn Fn(Vec<PodId>) + Send + Sync> {
    let (index, sessions) = (shared.index.clone(), shared.sessions.clone());
    let receipts = shared.receipts.clone();
    Arc::new(move |gone: Vec<PodId>| {
        for pod in gone {
            sessions.forget_pod(&pod);
            pod_metrics.forget(&pod);
            decision_metrics.forget_pod(&pod);
            if let Some(r) = &receipts {
                r.metrics().forget_pod(&pod);
            }
            let index = index.clone();
            let errors = errors.clone();
            tokio::spawn(async move {
                if let Err(e) = index.forget_pod(&pod).await {
                    warn!(pod = %pod, error = %e, "forgetting a departed pod's index entries failed");
                    errors.inc(ErrorKind::Index);
                }
            });
        }
    })
}

/// Resolves once a pod is healthy or the first probes had their time (at most 10 s).
pub(super) async fn first_healthy_pod(cfg: &PodsConfig, pods: &PodRegistry) {
    let limit = Duration::from_millis(
        cfg.health_interval_ms
            .saturating_add(cfg.probe_timeout_ms)
            .min(10_000),
    );
    let wait = async {
        while !pods.any_healthy() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let _ = tokio::time::timeout(limit, wait).await;
}
