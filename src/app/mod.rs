//! Wiring: builds every component from config, starts the background loops and both servers, and
//! shuts down on SIGINT/SIGTERM. The only place that constructs components (each port's
//! services are built by its own module in [`crate::server`], from the config sections and
//! components handed over here); each has its own file, and [`run`] starts them in order.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tracing::{info, warn};

use crate::config::Config;
use crate::decide::Decider;
use crate::extproc::TestHooks;
use crate::flow::FlowControl;
use crate::index::KvIndex;
use crate::ingest::CatchUp;
use crate::observe::Receipts;
use crate::pods::{EngineResolver, PodRegistry};
use crate::scoring::SessionStore;
use crate::server::admin::{self, AdminSettings, AdminSources};
use crate::server::fds;
use crate::server::grpc::{self, GrpcServices, GrpcSettings};
use crate::server::readiness::Readiness;
use crate::supervise::Supervisor;
use crate::tokenize::TokenizerRegistry;

mod index;
mod maintenance;
mod pods;
mod shutdown;
mod telemetry;
mod warm;

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

/// `conformance_test_hooks`, with the pool they report; logged loudly, since the selection
/// header lets any client that reaches the gateway choose its own pod.
fn test_hooks(cfg: &Config) -> Option<TestHooks> {
    if !cfg.conformance_test_hooks {
        return None;
    }
    let kubernetes = cfg.pods.kubernetes.as_ref();
    let pool = kubernetes.and_then(|k| {
        let pool = k.pool.as_ref()?;
        // As the watch resolves it: the pool's, the source's, then the downward API's.
        let ns = [&pool.namespace, &k.namespace]
            .into_iter()
            .find(|n| !n.is_empty())
            .cloned()
            .or_else(|| std::env::var("NAMESPACE").ok())?;
        Some(format!("{ns}/{}", pool.name))
    });
    warn!(
        pool = pool.as_deref().unwrap_or("-"),
        "conformance_test_hooks is ON: the test-epp-endpoint-selection request header chooses the pod; never enable it where clients are not trusted"
    );
    Some(TestHooks { pool })
}

/// The long-lived state the loops and servers share.
struct Shared {
    pods: Arc<PodRegistry>,
    index: Arc<dyn KvIndex>,
    sessions: Arc<SessionStore>,
    decider: Arc<Decider>,
    /// Starts and restarts the background loops (readiness fails while one is down).
    supervisor: Supervisor,
    /// Precise mode: the start-up KV-event catch-ups readiness waits for.
    catch_up: Option<Arc<CatchUp>>,
    /// Requests held while every pod is saturated (`flow_control.enabled`).
    flow: Option<Arc<FlowControl>>,
    /// Route receipts (`receipts.enabled`).
    receipts: Option<Arc<Receipts>>,
}

/// Runs the router until a shutdown signal. `tokenizers` were loaded from `cfg.tokenizers`
/// (see [`crate::keys::load_tokenizers`]) before any port opens.
pub async fn run(cfg: Config, tokenizers: TokenizerRegistry) -> anyhow::Result<()> {
    let telemetry = Telemetry::register(&cfg);
    let pods = Arc::new(PodRegistry::with_engines(EngineResolver::new(&cfg.pods)));
    // The shared index's mirror follows the pod set the pod sources list (fed below).
    let (members_feed, members) = crate::index::PodMembers::channel();
    let (index, share, sessions) = index::build(&cfg, telemetry.redis, members)?;
    let mode = mode(&cfg);
    let decider = Arc::new(
        Decider::new(
            cfg.decision(),
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
    index::follow_pods(&cfg, &supervisor, &pods, members_feed);
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
    let receipts = telemetry
        .routes
        .map(|m| Arc::new(Receipts::new(&cfg.receipts, m)));
    let shared = Shared {
        pods,
        index,
        sessions,
        decider,
        supervisor,
        catch_up,
        flow,
        receipts,
    };
    let errors = telemetry.errors;
    pods::start(
        &cfg.pods,
        &shared,
        &errors,
        telemetry.pods.clone(),
        telemetry.decisions,
    )
    .await?;
    // Before either port serves: the index starts from what the live peers know.
    let decider = shared.decider.clone();
    warm::WarmStart {
        cfg: &cfg.index.warm_start,
        token: admin::admin_token(&cfg.admin)?,
        index: &shared.index,
        pods: &shared.pods,
        now_ms: &move || decider.now_ms(),
        metrics: &telemetry.warm,
    }
    .run()
    .await;
    let gauges = Gauges {
        pods: telemetry.pods,
        maintenance: telemetry.maintenance,
        gie: telemetry.gie,
        errors,
    };
    maintenance::start(&cfg, &shared, gauges);
    let shutdown = Shutdown::start(&cfg.server);
    let conns = telemetry.conns;
    // One readiness rule for both ports: `/readyz` and the gRPC health services.
    let readiness = Readiness::new(
        shutdown.stopping.clone(),
        shared.supervisor.clone(),
        shared.pods.clone(),
        shared.catch_up.clone(),
        shared.decider.index().clone(),
    );
    let (grpc_addr, admin_addr) = (cfg.grpc_addr(), cfg.admin_addr());
    // Both ports' caps fit under the file-descriptor limit (raised to its hard limit first).
    let caps = fds::raise_and_cap(cfg.server.max_connections, admin::MAX_CONNECTIONS);
    let server = crate::config::ServerConfig {
        max_connections: caps.grpc_max_connections,
        ..cfg.server.clone()
    };
    let grpc = grpc::start(
        GrpcSettings {
            addr: grpc_addr,
            health_addr: cfg.grpc_health_addr(),
            body_limit: cfg.body_limit_bytes,
            destination_header: cfg.destination_header,
            test_hooks: test_hooks(&cfg),
            server: &server,
            pick_api: &cfg.pick_api,
        },
        GrpcServices {
            decider: shared.decider.clone(),
            flow: shared.flow.clone(),
            receipts: shared.receipts.clone(),
            metrics: telemetry.extproc,
            readiness: readiness.clone(),
        },
        &shared.supervisor,
        conns.clone(),
        shutdown.closed(),
    )
    .await?;
    let admin = admin::start(
        AdminSettings {
            addr: admin_addr,
            admin: &cfg.admin,
            body_limit: cfg.body_limit_bytes,
            stale_after: Duration::from_millis(cfg.pods.stale_after_ms),
            caps,
            snapshot_max_entries: cfg.index.warm_start.max_entries,
        },
        AdminSources {
            registry: telemetry.registry,
            pods: shared.pods.clone(),
            decider: shared.decider.clone(),
            sessions: shared.sessions.clone(),
            receipts: shared.receipts.clone(),
            mode,
            readiness,
        },
        conns,
        shutdown.closing.clone(),
    )
    .await?;
    info!(grpc = %grpc_addr, admin = %admin_addr, "kv-router listening");
    // Serve once a pod is known healthy (or the first probes had their time): a router that has
    // not probed yet answered 503 no_healthy_upstream where Envoy, finding the port closed, fails
    // open (seen restarting a router under load behind the BUFFERED config).
    let servers = async {
        pods::first_healthy_pod(&cfg.pods, &shared.pods).await;
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
