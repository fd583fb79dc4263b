//! Wiring: builds every component from config, starts the background loops and both servers, and
//! shuts down on SIGINT/SIGTERM. The only place that constructs components; each has its own
//! file, and [`run`] starts them in order.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tracing::{info, warn};

use crate::config::Config;
use crate::decide::Decider;
use crate::extproc::BodyBudget;
use crate::flow::FlowControl;
use crate::index::KvIndex;
use crate::ingest::CatchUp;
use crate::pods::{EngineResolver, PodRegistry};
use crate::scoring::SessionStore;
use crate::server::readiness::Readiness;
use crate::supervise::Supervisor;
use crate::tokenize::TokenizerRegistry;

mod index;
mod maintenance;
mod pods;
pub(crate) mod shutdown;
mod telemetry;

use maintenance::Gauges;
use shutdown::Shutdown;
use telemetry::Telemetry;

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

/// The long-lived state the loops and servers share.
pub(crate) struct Shared {
    pub(crate) pods: Arc<PodRegistry>,
    pub(crate) index: Arc<dyn KvIndex>,
    pub(crate) sessions: Arc<SessionStore>,
    pub(crate) decider: Arc<Decider>,
    /// Starts and restarts the background loops (readiness fails while one is down).
    pub(crate) supervisor: Supervisor,
    /// Precise mode: the start-up KV-event catch-ups readiness waits for.
    pub(crate) catch_up: Option<Arc<CatchUp>>,
    /// Every request body the gRPC port buffers (ext_proc, Pick) draws from it.
    pub(crate) bodies: BodyBudget,
    /// Requests held while every pod is saturated (`flow_control.enabled`).
    pub(crate) flow: Option<Arc<FlowControl>>,
}

/// Runs the router until a shutdown signal. `tokenizers` were loaded from `cfg.tokenizers`
/// (see [`crate::keys::load_tokenizers`]) before any port opens.
pub async fn run(cfg: Config, tokenizers: TokenizerRegistry) -> anyhow::Result<()> {
    let telemetry = Telemetry::register(&cfg);
    let pods = Arc::new(PodRegistry::with_engines(EngineResolver::new(&cfg.pods)));
    let (index, share, sessions) = index::build(&cfg, telemetry.redis)?;
    let mode = mode(&cfg);
    let decider = Arc::new(
        Decider::new(
            &cfg,
            Arc::new(tokenizers),
            pods.clone(),
            index.clone(),
            sessions.clone(),
            telemetry.decisions.clone(),
        )
        .with_load_share(share.clone()),
    );
    // The other replicas' decisions count as load here too, and in conversation memory (a
    // shared index's mirror with `mirror_load`).
    share.attach(Arc::new(crate::decide::RemoteDecisions {
        load: pods.clone(),
        conversations: decider.conversations(),
    }));
    info!(mode, policy = cfg.policy.as_str(), "kv-router starting");
    let supervisor = telemetry.supervisor;
    let catch_up = index::start_ingestion(&cfg, &supervisor, &pods, &index, telemetry.ingest);
    let flow = telemetry.flow.map(|m| {
        let flow = FlowControl::new(cfg.flow_control.clone(), m);
        let (fc, decider) = (flow.clone(), decider.clone());
        // A restarted dispatcher finds the waiters where it left them.
        supervisor.spawn("flow_dispatch", move || {
            let decider = decider.clone();
            fc.clone()
                .dispatch(move |model, subset| decider.has_room(model, subset))
        });
        flow
    });
    let shared = Shared {
        pods,
        index,
        sessions,
        decider,
        supervisor,
        catch_up,
        bodies: BodyBudget::new(cfg.server.max_buffered_body_bytes),
        flow,
    };
    let errors = telemetry.errors;
    pods::start(
        &cfg,
        &shared,
        &errors,
        telemetry.pods.clone(),
        telemetry.decisions,
    )
    .await?;
    let gauges = Gauges {
        pods: telemetry.pods,
        maintenance: telemetry.maintenance,
        errors,
    };
    maintenance::start(&cfg, &shared, gauges);
    let shutdown = Shutdown::start(&cfg);
    let conns = telemetry.conns;
    // One readiness rule for both ports: `/readyz` and the gRPC health services.
    let readiness = Readiness::new(
        shutdown.stopping.clone(),
        shared.supervisor.clone(),
        shared.pods.clone(),
        shared.catch_up.clone(),
        shared.decider.index().clone(),
    );
    let grpc = crate::server::grpc::start(
        &cfg,
        &shared,
        readiness.clone(),
        telemetry.extproc,
        conns.clone(),
        &shutdown,
    )
    .await?;
    let pods = shared.pods.clone();
    let admin = crate::server::admin::start(
        &cfg,
        shared,
        readiness,
        telemetry.registry,
        conns,
        mode,
        &shutdown,
    )
    .await?;
    let (grpc_addr, admin_addr) = (cfg.grpc_addr(), cfg.admin_addr());
    info!(grpc = %grpc_addr, admin = %admin_addr, "kv-router listening");
    // Serve once a pod is known healthy (or the first probes had their time): a router that has
    // not probed yet answered 503 no_healthy_upstream where Envoy, finding the port closed, fails
    // open (seen restarting a router under load behind the BUFFERED config).
    let servers = async {
        pods::first_healthy_pod(&cfg, &pods).await;
        let (g, ()) = tokio::join!(grpc, admin);
        g.with_context(|| format!("gRPC server on {grpc_addr}"))
    };
    let grace = Duration::from_millis(cfg.server.shutdown_grace_ms);
    tokio::select! {
        r = servers => r?,
        () = shutdown.grace_over(grace) => warn!(grace_ms = cfg.server.shutdown_grace_ms, "shutdown grace period over: closing the remaining streams"),
    }
    info!("kv-router stopped");
    Ok(())
}
