//! Wiring: builds every stage from config, starts the background loops and both servers, and
//! shuts down on SIGINT/SIGTERM. The only place that constructs components.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::time::{interval, Instant, MissedTickBehavior};
use tonic_health::ServingStatus;
use tracing::{info, warn};

use crate::admin::{self, AdminState};
use crate::config::{Config, IndexBackend};
use crate::decide::{Decider, DecisionMetrics};
use crate::extproc::{ExtProc, ExtProcMetrics};
use crate::index::{build_index, index_capacity, RedisMetrics};
use crate::ingest::{self, IngestMetrics};
use crate::pick_api::proto::picker_server::PickerServer;
use crate::pick_api::PickService;
use crate::pods::{
    prefill_models, DnsSource, EngineResolver, PodId, PodMetrics, PodRegistry, PodSource, Prober,
    StaticSource,
};
use crate::scoring::SessionStore;
use crate::supervise::Supervisor;
use crate::telemetry::{ErrorKind, Errors};
use crate::tokenize::TokenizerRegistry;

/// gRPC health service names (Endpoint Picker Protocol).
const HEALTH_SERVICES: [&str; 3] = [
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

/// The gauges the maintenance loop sets.
#[derive(Debug, Clone, Default)]
struct MaintenanceMetrics {
    index_entries: Gauge,
    index_keys: Gauge,
    sessions: Gauge,
}

impl MaintenanceMetrics {
    fn register(registry: &mut Registry) -> Self {
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
        m
    }
}

/// Runs the router until a shutdown signal. `tokenizers` were loaded from `cfg.tokenizers`
/// (see [`crate::keys::load_tokenizers`]) before any port opens.
pub async fn run(cfg: Config, tokenizers: TokenizerRegistry) -> anyhow::Result<()> {
    let mut root = Registry::default();
    // KV-event ingestion registers its own families under the same prefix.
    let ingest_metrics = Arc::new(IngestMetrics::register(&mut root));
    let registry = root.sub_registry_with_prefix("kv_router");
    let errors = Errors::register(registry);
    let decision_metrics = DecisionMetrics::register(registry, errors.clone());
    let extproc_metrics = ExtProcMetrics::register(registry, errors.clone());
    let pod_metrics = PodMetrics::register(registry);
    let maintenance_metrics = MaintenanceMetrics::register(registry);
    let supervisor = Supervisor::register(registry);
    let redis_metrics =
        (cfg.index.backend == IndexBackend::Redis).then(|| RedisMetrics::register(registry));
    let registry = Arc::new(root);
    let pods = Arc::new(PodRegistry::with_engines(EngineResolver::new(&cfg.pods)));
    let built = build_index(&cfg, redis_metrics)?;
    let index = built.index;
    let mode = mode(&cfg);
    let mut sessions = SessionStore::new(cfg.scorers.session.capacity, cfg.scorers.session.ttl_ms);
    if let Some(shared) = built.sessions {
        let budget = Duration::from_millis(cfg.index.redis.lookup_budget_ms);
        sessions = sessions.with_shared(shared, budget);
    }
    let sessions = Arc::new(sessions);
    let decider = Arc::new(Decider::new(
        &cfg,
        Arc::new(tokenizers),
        pods.clone(),
        index.clone(),
        sessions.clone(),
        decision_metrics.clone(),
    ));
    info!(mode, policy = cfg.policy.as_str(), "kv-router starting");
    // Readiness waits for the start-up KV-event catch-ups (precise mode only).
    let catch_up = cfg
        .kv_events
        .enabled
        .then(|| Arc::new(ingest::CatchUp::default()));
    if let Some(catch_up) = &catch_up {
        for model in cfg.tokenizers.iter().map(|t| t.model.as_str()) {
            info!(model, "precise keys (tokenizer configured)");
        }
        if cfg.tokenizers.is_empty() {
            warn!("KV events are on but no tokenizer is configured: request keys stay approximate and only speculative entries can match");
        }
        let (ev, pods, index) = (cfg.kv_events.clone(), pods.clone(), index.clone());
        let catch_up = catch_up.clone();
        supervisor.spawn("kv_events", move || {
            ingest::run(
                ev.clone(),
                pods.clone(),
                index.clone(),
                ingest_metrics.clone(),
                catch_up.clone(),
            )
        });
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
        let source = crate::pods::KubernetesSource::start(k.clone(), models, Some(errors.clone()));
        sources.push(Box::new(source.await?));
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
    let prober = Prober::new(cfg.pods.clone(), pods.clone(), errors.clone());
    {
        let index = index.clone();
        let sessions = sessions.clone();
        let pod_metrics = pod_metrics.clone();
        let errors = errors.clone();
        let sources: Arc<[Box<dyn PodSource>]> = sources.into();
        let on_gone: Arc<dyn Fn(Vec<PodId>) + Send + Sync> = Arc::new(move |gone: Vec<PodId>| {
            for pod in gone {
                sessions.forget_pod(&pod);
                pod_metrics.forget(&pod);
                decision_metrics.forget_pod(&pod);
                let index = index.clone();
                let errors = errors.clone();
                tokio::spawn(async move {
                    if let Err(e) = index.forget_pod(&pod).await {
                        warn!(pod = %pod, error = %e, "forgetting a departed pod's index entries failed");
                        errors.inc(ErrorKind::Index);
                    }
                });
            }
        });
        let p = prober.clone();
        let refresh = Duration::from_millis(refresh_ms);
        supervisor.spawn("discovery", move || {
            p.clone()
                .run_discovery(sources.clone(), refresh, on_gone.clone())
        });
    }
    let p = prober.clone();
    supervisor.spawn("health", move || p.clone().run_health());
    let p = prober.clone();
    supervisor.spawn("scrape", move || p.clone().run_scrape());
    {
        let (cfg, pods, decider, sessions) =
            (cfg.clone(), pods.clone(), decider.clone(), sessions.clone());
        let gauges = Gauges {
            pods: pod_metrics,
            maintenance: maintenance_metrics,
            errors: errors.clone(),
        };
        supervisor.spawn("maintenance", move || {
            maintenance(
                cfg.clone(),
                pods.clone(),
                decider.clone(),
                sessions.clone(),
                gauges.clone(),
            )
        });
    }

    // Shutdown: a signal flips `stopping` (readiness NOT_SERVING, still serving); after the delay
    // `closing` flips and the listeners close. Closing at once failed FULL_DUPLEX requests that
    // Envoy sent before its health check saw NOT_SERVING (it cannot fail open there).
    let (stop_tx, stopping) = tokio::sync::watch::channel(false);
    let (close_tx, closing) = tokio::sync::watch::channel(false);
    let delay = Duration::from_millis(cfg.server.shutdown_delay_ms);
    tokio::spawn(async move {
        shutdown_signal().await;
        info!(delay_ms = delay.as_millis() as u64, "shutdown signal: readiness NOT_SERVING, still serving until gateways stop choosing this replica");
        let _ = stop_tx.send(true);
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown_signal() => info!("second shutdown signal: closing at once"),
        }
        info!("closing listeners, draining open streams");
        let _ = close_tx.send(true);
    });

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
        let (pods, sup, stopping) = (pods.clone(), supervisor.clone(), stopping.clone());
        let catch_up = catch_up.clone();
        supervisor.spawn("readiness", move || {
            let (pods, sup, health_reporter) = (pods.clone(), sup.clone(), health_reporter.clone());
            readiness(
                pods,
                sup,
                catch_up.clone(),
                health_reporter,
                stopping.clone(),
            )
        });
    }
    let extproc = ExtProc::new(
        decider.clone(),
        extproc_metrics,
        cfg.body_limit_bytes,
        cfg.destination_header,
    )
    .with_body_budget(cfg.server.max_buffered_body_bytes);
    let grpc_addr = cfg.grpc_addr();
    // Validated to at most 1 GiB; saturating all the same so no value can wrap the limit.
    let limit = cfg.body_limit_bytes.saturating_add(1 << 20);
    let grpc = grpc_builder(&cfg)?
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .max_concurrent_streams(Some(cfg.server.max_concurrent_streams))
        .add_service(health_service)
        .add_service(ExternalProcessorServer::new(extproc).max_decoding_message_size(limit))
        .add_service(
            PickerServer::new(PickService::new(decider.clone(), cfg.pick_api.clone()))
                .max_decoding_message_size(limit),
        )
        .serve_with_shutdown(grpc_addr, stopped(closing.clone()));

    let admin_addr = cfg.admin_addr();
    let token = admin_token(&cfg)?;
    if token.is_none() && !admin_addr.ip().is_loopback() {
        warn!(admin = %admin_addr, "the admin port is not on loopback and no admin.token is set: /debug/* is open to anyone who reaches it");
    }
    let admin_app = admin::router(AdminState {
        token,
        registry,
        pods: pods.clone(),
        decider,
        sessions,
        stale_after: Duration::from_millis(cfg.pods.stale_after_ms),
        mode,
        supervisor,
        catch_up,
        stopping: stopping.clone(),
        // An explain input wraps a body as a JSON string: escaping may double it.
        body_limit: cfg
            .body_limit_bytes
            .saturating_mul(2)
            .saturating_add(1 << 20),
    });
    let listener = tokio::net::TcpListener::bind(admin_addr)
        .await
        .with_context(|| format!("binding admin listener {admin_addr}"))?;
    let admin = crate::admin_serve::serve(listener, admin_app, closing.clone());
    info!(grpc = %grpc_addr, admin = %admin_addr, "kv-router listening");
    // Serve once a pod is known healthy (or the first probes had their time): a router that has
    // not probed yet answered 503 no_healthy_upstream where Envoy, finding the port closed, fails
    // open (seen restarting a router under load behind the BUFFERED config).
    let first_probes = Duration::from_millis(
        cfg.pods
            .health_interval_ms
            .saturating_add(cfg.pods.probe_timeout_ms)
            .min(10_000),
    );
    let servers = async {
        first_healthy_pod(&pods, first_probes).await;
        let (g, ()) = tokio::join!(grpc, admin);
        g.with_context(|| format!("gRPC server on {grpc_addr}"))
    };
    // Graceful shutdown waits for every open stream; past the grace period they are closed
    // (dropping the servers) so the process exits inside Kubernetes' termination grace.
    let grace = Duration::from_millis(cfg.server.shutdown_grace_ms);
    let deadline = async {
        stopped(closing).await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        r = servers => r?,
        () = deadline => warn!(grace_ms = cfg.server.shutdown_grace_ms, "shutdown grace period over: closing the remaining streams"),
    }
    info!("kv-router stopped");
    Ok(())
}

/// The gRPC server, with TLS (and client-certificate verification) when configured.
fn grpc_builder(cfg: &Config) -> anyhow::Result<tonic::transport::Server> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let tls = &cfg.server.tls;
    let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) else {
        return Ok(tonic::transport::Server::builder());
    };
    let read = |what: &str, path: &str| {
        std::fs::read(path).with_context(|| format!("server.tls.{what}: cannot read {path}"))
    };
    let mut config = ServerTlsConfig::new().identity(Identity::from_pem(
        read("cert_file", cert)?,
        read("key_file", key)?,
    ));
    if let Some(ca) = &tls.client_ca_file {
        config = config.client_ca_root(Certificate::from_pem(read("client_ca_file", ca)?));
    }
    tonic::transport::Server::builder()
        .tls_config(config)
        .context("server.tls: the certificate or key is not usable")
}

/// The admin bearer token: `admin.token_file` (trimmed) wins over `admin.token`; none = open.
fn admin_token(cfg: &Config) -> anyhow::Result<Option<Arc<str>>> {
    let token = match &cfg.admin.token_file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading admin.token_file {}", path.display()))?
            .trim()
            .to_string(),
        None => cfg.admin.token.clone(),
    };
    Ok((!token.is_empty()).then(|| token.into()))
}

/// Resolves once shutdown has begun.
/// Resolves once a pod is healthy or `limit` has passed.
async fn first_healthy_pod(pods: &PodRegistry, limit: Duration) {
    let wait = async {
        while !pods.any_healthy() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let _ = tokio::time::timeout(limit, wait).await;
}

async fn stopped(mut stopping: tokio::sync::watch::Receiver<bool>) {
    let _ = stopping.wait_for(|s| *s).await;
}

/// Keeps the gRPC readiness services equal to: not stopping, a healthy pod, no loop down and
/// (precise mode) the start-up KV-event catch-ups over, as `/readyz`.
async fn readiness(
    pods: Arc<PodRegistry>,
    supervisor: Supervisor,
    catch_up: Option<Arc<ingest::CatchUp>>,
    health_reporter: tonic_health::server::HealthReporter,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) {
    let mut last = None;
    let mut tick = interval(Duration::from_millis(200));
    loop {
        // Wake at once on a shutdown signal, else every tick.
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopping.changed(), if !*stopping.borrow() => {}
        }
        let ready = !*stopping.borrow()
            && pods.any_healthy()
            && supervisor.down().is_empty()
            && catch_up
                .as_ref()
                .is_none_or(|c| c.waiting_on(&pods).is_none());
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
}

/// What the maintenance loop reports to.
#[derive(Clone)]
struct Gauges {
    pods: PodMetrics,
    maintenance: MaintenanceMetrics,
    errors: Errors,
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
        for (pod, model) in snapshot.pods().iter().zip(&models) {
            gauges.pods.observe(pod, model, now, stale_after);
            let Some((_, sample)) = pod.last_sample() else {
                continue;
            };
            let Some(blocks) = sample.num_gpu_blocks else {
                continue;
            };
            let cap = index_capacity(&cfg, blocks, sample.block_size.unwrap_or(16));
            if capacities.get(pod.id()) != Some(&cap) {
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
