//! Wiring: builds every stage from config, starts the background loops and both servers, and
//! shuts down on SIGINT/SIGTERM. The only place that constructs components.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use prometheus_client::registry::Registry;
use tokio::time::{interval, Instant, MissedTickBehavior};
use tonic_health::ServingStatus;
use tracing::{info, warn};

use crate::admin::{self, AdminState};
use crate::config::{Config, IndexBackend};
use crate::decide::Decider;
use crate::events;
use crate::extproc::ExtProc;
use crate::index::{EventIndex, EventIndexConfig, KvIndex, MemoryIndex};
use crate::keys::load_tokenizers;
use crate::pick_api::proto::picker_server::PickerServer;
use crate::pick_api::PickService;
use crate::pods::{DnsSource, PodRegistry, PodSource, Prober, StaticSource};
use crate::scoring::SessionStore;
use crate::telemetry::{Metrics, PodLabels};

/// gRPC health service names (Endpoint Picker Protocol).
pub const HEALTH_SERVICES: [&str; 3] = [
    "liveness",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

/// Routing mode reported at startup and in `/debug/pods`.
pub fn mode(cfg: &Config) -> &'static str {
    match (cfg.kv_events.enabled, cfg.tokenizers.is_empty()) {
        (false, _) => "approximate (no KV events): character blocks learned from routing decisions",
        (true, true) => {
            "events without tokenizer: approximate request keys, speculative matches only"
        }
        (true, false) => "precise: vLLM KV events + exact token blocks for models with a tokenizer",
    }
}

/// Runs the router until a shutdown signal.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let registry = Arc::new(registry);
    let pods = Arc::new(PodRegistry::default());
    let index: Arc<dyn KvIndex> = match (cfg.kv_events.enabled, cfg.index.backend) {
        (true, IndexBackend::Memory) => Arc::new(EventIndex::new(EventIndexConfig {
            block_tokens: cfg.kv_events.block_tokens,
            max_blocks: cfg.blocks.max_blocks,
            gpu_weight: cfg.kv_events.gpu_weight,
            cpu_weight: cfg.kv_events.cpu_weight,
            speculative_ttl_ms: cfg.kv_events.speculative_ttl_ms,
            ..EventIndexConfig::default()
        })),
        (false, IndexBackend::Memory) => Arc::new(MemoryIndex::new(
            cfg.index.ttl_ms,
            cfg.index.default_capacity_blocks,
        )),
    };
    let mode = mode(&cfg);
    let sessions = Arc::new(SessionStore::new(
        cfg.scorers.session.capacity,
        cfg.scorers.session.ttl_ms,
    ));
    let tokenizers = Arc::new(load_tokenizers(&cfg.tokenizers).context("loading tokenizers")?);
    let decider = Arc::new(
        Decider::new(
            &cfg,
            pods.clone(),
            index.clone(),
            sessions.clone(),
            metrics.clone(),
        )
        .with_tokenizers(tokenizers),
    );
    info!(mode, policy = cfg.policy.as_str(), "kv-router starting");
    if cfg.kv_events.enabled {
        for model in cfg.tokenizers.iter().map(|t| t.model.as_str()) {
            info!(model, "precise keys (tokenizer configured)");
        }
        if cfg.tokenizers.is_empty() {
            warn!("KV events are on but no tokenizer is configured: request keys stay approximate and only speculative entries can match");
        }
        tokio::spawn(events::ingest::run(
            cfg.kv_events.clone(),
            pods.clone(),
            index.clone(),
            metrics.clone(),
        ));
    }

    // Pod discovery, health, load.
    let mut sources: Vec<Box<dyn PodSource>> = Vec::new();
    if !cfg.pods.static_pods.is_empty() {
        sources.push(Box::new(StaticSource::new(&cfg.pods.static_pods)));
    }
    let mut refresh_ms = 5_000;
    for d in &cfg.pods.dns {
        refresh_ms = refresh_ms.min(d.refresh_ms);
        sources.push(Box::new(DnsSource::new(d.clone(), cfg.pods.models.clone())));
    }
    #[cfg(feature = "kubernetes")]
    if let Some(k) = &cfg.pods.kubernetes {
        refresh_ms = refresh_ms.min(k.refresh_ms);
        let models = cfg.pods.models.clone();
        let source = crate::pods::KubernetesSource::start(k.clone(), models, Some(metrics.clone()));
        sources.push(Box::new(source.await?));
    }
    // Static-only pod sets never change, but the first pass must happen now.
    let first: Vec<_> = futures::future::join_all(sources.iter().map(|s| s.pods())).await;
    pods.update(first.into_iter().filter_map(Result::ok).flatten().collect());
    let prober = Prober::new(cfg.pods.clone(), pods.clone());
    {
        let index = index.clone();
        let sessions = sessions.clone();
        let metrics = metrics.clone();
        tokio::spawn(prober.clone().run_discovery(
            sources,
            Duration::from_millis(refresh_ms),
            move |gone| {
                for pod in gone {
                    sessions.forget_pod(&pod);
                    metrics.forget_pod(pod.as_str());
                    let index = index.clone();
                    tokio::spawn(async move {
                        let _ = index.forget_pod(&pod).await;
                    });
                }
            },
        ));
    }
    tokio::spawn(prober.clone().run_health());
    tokio::spawn(prober.run_scrape());
    tokio::spawn(maintenance(
        cfg.clone(),
        pods.clone(),
        decider.clone(),
        sessions.clone(),
        metrics.clone(),
    ));

    // gRPC: ext_proc + Pick + health.
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    for svc in &HEALTH_SERVICES[1..] {
        health_reporter
            .set_service_status(*svc, ServingStatus::NotServing)
            .await;
    }
    {
        let pods = pods.clone();
        tokio::spawn(async move {
            let mut last = None;
            let mut tick = interval(Duration::from_millis(200));
            loop {
                tick.tick().await;
                let ready = pods.any_healthy();
                if last != Some(ready) {
                    let status = if ready {
                        ServingStatus::Serving
                    } else {
                        ServingStatus::NotServing
                    };
                    for svc in &HEALTH_SERVICES[1..] {
                        health_reporter.set_service_status(*svc, status).await;
                    }
                    health_reporter.set_service_status("", status).await;
                    last = Some(ready);
                }
            }
        });
    }
    let extproc = ExtProc::new(
        decider.clone(),
        metrics.clone(),
        cfg.body_limit_bytes,
        cfg.destination_header,
    );
    let grpc_addr = cfg.grpc_addr();
    let limit = cfg.body_limit_bytes + (1 << 20);
    let grpc = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .add_service(health_service)
        .add_service(ExternalProcessorServer::new(extproc).max_decoding_message_size(limit))
        .add_service(
            PickerServer::new(PickService::new(decider.clone())).max_decoding_message_size(limit),
        )
        .serve_with_shutdown(grpc_addr, shutdown_signal());

    let admin_addr = cfg.admin_addr();
    let admin_app = admin::router(AdminState {
        registry,
        pods: pods.clone(),
        decider,
        sessions,
        stale_after: Duration::from_millis(cfg.pods.stale_after_ms),
        mode,
    });
    let listener = tokio::net::TcpListener::bind(admin_addr)
        .await
        .with_context(|| format!("binding admin listener {admin_addr}"))?;
    let admin = axum::serve(listener, admin_app).with_graceful_shutdown(shutdown_signal());
    info!(grpc = %grpc_addr, admin = %admin_addr, "kv-router listening");
    let (g, a) = tokio::join!(grpc, admin);
    g.with_context(|| format!("gRPC server on {grpc_addr}"))?;
    a.with_context(|| format!("admin server on {admin_addr}"))?;
    info!("kv-router stopped");
    Ok(())
}

/// Once a second: index capacity from each pod's KV size, TTL sweep, gauges.
async fn maintenance(
    cfg: Config,
    pods: Arc<PodRegistry>,
    decider: Arc<Decider>,
    sessions: Arc<SessionStore>,
    metrics: Arc<Metrics>,
) {
    let stale_after = Duration::from_millis(cfg.pods.stale_after_ms);
    let mut capacities = ahash::AHashMap::new();
    let mut tick = interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let index = decider.index();
        let now = Instant::now();
        for pod in pods.snapshot().pods() {
            let l = PodLabels {
                pod: pod.id().to_string(),
            };
            metrics
                .pod_healthy
                .get_or_create(&l)
                .set(i64::from(pod.is_healthy()));
            let load = pod.load(now, stale_after);
            metrics.pod_waiting.get_or_create(&l).set(load.waiting);
            metrics.pod_running.get_or_create(&l).set(load.running);
            metrics.pod_kv_usage.get_or_create(&l).set(load.kv_usage);
            metrics
                .pod_inflight_requests
                .get_or_create(&l)
                .set(load.inflight_requests as i64);
            metrics
                .pod_inflight_tokens
                .get_or_create(&l)
                .set(load.inflight_tokens as i64);
            if let Some((_, sample)) = pod.last_sample() {
                if let Some(blocks) = sample.num_gpu_blocks {
                    // Router blocks of size_chars bytes ≈ size_chars/4 tokens; scale to engine blocks.
                    let engine_block = sample.block_size.unwrap_or(16) as f64;
                    let router_block = (cfg.blocks.size_chars / 4).max(1) as f64;
                    let cap = (blocks as f64 * engine_block / router_block
                        * cfg.index.capacity_factor) as usize;
                    if capacities.get(pod.id()) != Some(&cap) {
                        match index.set_capacity(pod.id(), cap).await {
                            Ok(()) => {
                                capacities.insert(pod.id().clone(), cap);
                            }
                            Err(e) => {
                                warn!(pod = %pod.id(), error = %e, "setting index capacity failed")
                            }
                        }
                    }
                }
            }
        }
        let _ = index.sweep(decider.now_ms()).await;
        let stats = index.stats();
        metrics.index_entries.set(stats.entries as i64);
        metrics.index_keys.set(stats.keys as i64);
        metrics.sessions.set(sessions.len() as i64);
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}
