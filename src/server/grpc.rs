//! The gRPC port (`listen.grpc`): Envoy's ext_proc ([`crate::extproc`]), the `Pick` service
//! ([`super::pick`]) and gRPC health, on one listener with one connection limit, a body budget
//! for each of ext_proc and Pick, and a cap on open ext_proc streams.
//!
//! - **Who may call**: anyone who reaches the port; with `server.tls.client_ca_file`, only
//!   holders of a client certificate it signed. Nothing else is asked of a caller.
//! - **What a caller may change**: an ext_proc stream has its request decided and committed (the
//!   chosen pod's in-flight load until the stream ends, a session pin, the index entries
//!   recorded after the reply) and may wait in flow control; a Pick only ranks unless
//!   `pick_api.allow_commit`; health is read-only.
//! - **Memory**: at most `server.max_connections` connections (at the cap the oldest still in
//!   its handshake, else the quietest, is closed; [`super::conns`]), each with at most
//!   `server.max_concurrent_streams` streams, and at most `server.max_extproc_streams` ext_proc
//!   streams open at once on all of them (≈ 16 KiB each besides its body: 8,192 ≈ 128 MiB; a
//!   new one past it gets `RESOURCE_EXHAUSTED`, counted as `stream_limit`; Pick and health are
//!   not held to it). Request bytes are held to two budgets ([`BodyBudget`]), so neither caller
//!   class can spend the other's: ext_proc's `server.max_buffered_body_bytes` (each message's
//!   announced length, at most `body_limit_bytes` + 1 MiB, reserved before a byte of it is
//!   buffered and given back once it passed whole, then the bodies its streams hold before their
//!   decision) and Pick's `pick_api.max_buffered_bytes` (each message at most
//!   `pick_api.max_message_bytes`, held until its body ends); [`super::metered`]. A message
//!   started and not complete within `server.message_timeout_ms` (a Pick body: also its end)
//!   fails its stream with `DEADLINE_EXCEEDED` and gives its bytes back, so a stalled caller
//!   holds a budget for at most that long. Worst case ≈ 80 MiB + 2.2 × (both budgets) + 16 KiB
//!   × `max_extproc_streams` + 15 KiB × `max_connections` (docs/operations.md).
//!
//! Its health services report [`Readiness`], as `/readyz` on the admin port does.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use futures::TryStreamExt;
use tokio::time::interval;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};
use tonic_health::ServingStatus;

use crate::config::{PickApiConfig, ServerConfig};
use crate::decide::Decider;
use crate::extproc::{ExtProc, ExtProcMetrics, TestHooks};
use crate::flow::FlowControl;
use crate::observe::Receipts;
use crate::supervise::Supervisor;

use super::authority::AuthorityFix;
use super::conns::{self, ConnMetrics};
use super::metered::{Hold, Meter, Metered};
use super::pick::proto::picker_server::PickerServer;
use super::pick::PickService;
use super::readiness::Readiness;
use super::tls::{self, MaybeTls};
use crate::budget::BodyBudget;

/// gRPC health service names (Endpoint Picker Protocol).
/// `inference-extension` is the Gateway API Inference Extension chart's readiness probe.
pub(super) const HEALTH_SERVICES: [&str; 4] = [
    "liveness",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
    "inference-extension",
];

/// The gRPC port's settings: its parts of `router.yaml`.
pub(crate) struct GrpcSettings<'a> {
    /// `listen.grpc`.
    pub addr: SocketAddr,
    /// `listen.grpc_health`: health alone on a port of its own, if set.
    pub health_addr: Option<SocketAddr>,
    /// `body_limit_bytes`: the largest ext_proc request body.
    pub body_limit: usize,
    /// `destination_header`: also set the destination as a request header.
    pub destination_header: bool,
    /// `conformance_test_hooks`: the GIE conformance suite's selection and report headers.
    pub test_hooks: Option<TestHooks>,
    /// `server`: connections, streams, the buffered-body budget, TLS.
    pub server: &'a ServerConfig,
    /// `pick_api`: what Pick callers may do, and their largest message.
    pub pick_api: &'a PickApiConfig,
}

/// What the gRPC port's services answer from.
pub(crate) struct GrpcServices {
    /// The decision path (ext_proc and Pick).
    pub decider: Arc<Decider>,
    /// `flow_control.enabled`: where requests wait while every pod is saturated.
    pub flow: Option<Arc<FlowControl>>,
    /// `receipts.enabled`: receipts on responses.
    pub receipts: Option<Arc<Receipts>>,
    /// ext_proc's metric families.
    pub metrics: ExtProcMetrics,
    /// What the health services report.
    pub readiness: Readiness,
}

/// Sets liveness SERVING and readiness NOT_SERVING, starts the `readiness` loop under
/// `supervisor`, and returns the server (it binds when first polled, and stops accepting once
/// `closed` resolves). Fails when the TLS files cannot be read or used.
pub(crate) async fn start(
    cfg: GrpcSettings<'_>,
    services: GrpcServices,
    supervisor: &Supervisor,
    conn_metrics: ConnMetrics,
    closed: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<impl Future<Output = Result<(), tonic::transport::Error>>> {
    let GrpcServices {
        decider,
        flow,
        receipts,
        metrics,
        readiness,
    } = services;
    let (health_reporter, health_service) = health().await;
    supervisor.spawn("readiness", move || {
        report_readiness(readiness.clone(), health_reporter.clone())
    });
    // Two budgets, so neither caller class can spend the other's room: ext_proc's (its messages
    // as they arrive, then the bodies its streams hold) and Pick's.
    let budget = BodyBudget::new(cfg.server.max_buffered_body_bytes);
    let errors = metrics.errors();
    let mut extproc = ExtProc::new(
        decider.clone(),
        metrics,
        cfg.body_limit,
        cfg.destination_header,
    )
    .with_shared_budget(budget.clone())
    .with_stream_limit(cfg.server.max_extproc_streams);
    if let Some(flow) = flow {
        extproc = extproc.with_flow_control(flow);
    }
    if let Some(r) = receipts {
        extproc = extproc.with_receipts(r);
    }
    if let Some(hooks) = cfg.test_hooks {
        extproc = extproc.with_test_hooks(hooks);
    }
    let message_timeout = Duration::from_millis(cfg.server.message_timeout_ms);
    // Validated to at most 1 GiB; saturating all the same so no value can wrap the limit.
    let limit = cfg.body_limit.saturating_add(1 << 20);
    let extproc = Metered::new(
        ExternalProcessorServer::new(extproc).max_decoding_message_size(limit),
        Meter {
            budget,
            max_message: limit,
            max_message_key: "body_limit_bytes (+1 MiB)",
            budget_key: "server.max_buffered_body_bytes",
            message_timeout,
            hold: Hold::Message,
            errors: errors.clone(),
        },
    );
    let pick_limit = cfg.pick_api.max_message_bytes;
    let pick = Metered::new(
        PickerServer::new(PickService::new(decider, cfg.pick_api.clone()))
            .max_decoding_message_size(pick_limit),
        Meter {
            budget: BodyBudget::new(cfg.pick_api.max_buffered_bytes),
            max_message: pick_limit,
            max_message_key: "pick_api.max_message_bytes",
            budget_key: "pick_api.max_buffered_bytes",
            message_timeout,
            hold: Hold::Body,
            errors,
        },
    );
    let closed: Closed = futures::FutureExt::shared(Box::pin(closed));
    let health_only = match cfg.health_addr {
        None => None,
        Some(addr) => Some(health_only(
            addr,
            health_service.clone(),
            Duration::from_millis(cfg.server.handshake_timeout_ms),
            conn_metrics.clone(),
            closed.clone(),
        )?),
    };
    let addr = cfg.addr;
    let listener = conns::bind(addr).with_context(|| format!("binding gRPC listener {addr}"))?;
    let rewritten = conn_metrics.authority_rewritten.clone();
    let tls = tls::acceptor(&cfg.server.tls)?;
    let incoming = conns::incoming(
        listener,
        cfg.server.max_connections,
        Duration::from_millis(cfg.server.handshake_timeout_ms),
        conn_metrics,
    )
    .map_ok(move |conn| {
        AuthorityFix::new(MaybeTls::new(conn, tls.as_ref()), true, rewritten.clone())
    });
    let main = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .max_concurrent_streams(Some(cfg.server.max_concurrent_streams))
        .add_service(health_service)
        .add_service(extproc)
        .add_service(pick)
        .serve_with_incoming_shutdown(incoming, closed);
    Ok(async move {
        match health_only {
            None => main.await,
            Some(health) => {
                let (m, h) = tokio::join!(main, health);
                m.and(h)
            }
        }
    })
}

/// Resolves when the listeners stop accepting (both ports wait on it).
type Closed = futures::future::Shared<Pin<Box<dyn Future<Output = ()> + Send>>>;

/// Connections the health-only port keeps at once: probes, not traffic.
const HEALTH_PORT_CONNECTIONS: usize = 64;

/// The health-only listener (`listen.grpc_health`): plaintext (kubelet gRPC probes speak no
/// TLS), the same health services, at most [`HEALTH_PORT_CONNECTIONS`] connections and 8 streams
/// each. Binds now; serves once polled, until `closed`.
fn health_only(
    addr: SocketAddr,
    health: HealthServer<HealthService>,
    handshake_timeout: Duration,
    conn_metrics: ConnMetrics,
    closed: Closed,
) -> anyhow::Result<impl Future<Output = Result<(), tonic::transport::Error>>> {
    let listener =
        conns::bind(addr).with_context(|| format!("binding gRPC health listener {addr}"))?;
    let rewritten = conn_metrics.authority_rewritten.clone();
    let incoming = conns::incoming_on(
        conns::Port::GrpcHealth,
        listener,
        HEALTH_PORT_CONNECTIONS,
        handshake_timeout,
        conn_metrics,
    )
    .map_ok(move |conn| AuthorityFix::new(MaybeTls::new(conn, None), true, rewritten.clone()));
    Ok(tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .max_concurrent_streams(Some(8))
        .add_service(health)
        .serve_with_incoming_shutdown(incoming, closed))
}

/// The gRPC health services: liveness SERVING, readiness NOT_SERVING until [`report`] says.
pub(super) async fn health() -> (HealthReporter, HealthServer<HealthService>) {
    let reporter = HealthReporter::new();
    let service = HealthServer::new(HealthService::from_health_reporter(reporter.clone()));
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    for svc in &HEALTH_SERVICES[1..] {
        reporter
            .set_service_status(*svc, ServingStatus::NotServing)
            .await;
    }
    (reporter, service)
}

/// Keeps the gRPC readiness services equal to `readiness`, which `/readyz` answers from too.
async fn report_readiness(readiness: Readiness, health_reporter: HealthReporter) {
    let mut stopping = readiness.stopping();
    let mut last = None;
    let mut tick = interval(Duration::from_millis(200));
    loop {
        // Wake at once on a shutdown signal, else every tick.
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopping.changed(), if !*stopping.borrow() => {}
        }
        report(&readiness, &health_reporter, &mut last).await;
    }
}

/// Sets the readiness services (and `""`) to `readiness`'s state when it differs from `last`.
pub(super) async fn report(
    readiness: &Readiness,
    health_reporter: &HealthReporter,
    last: &mut Option<bool>,
) {
    let ready = readiness.check().is_ok();
    if *last == Some(ready) {
        return;
    }
    let status = if ready {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    for svc in &HEALTH_SERVICES[1..] {
        health_reporter.set_service_status(*svc, status).await;
    }
    health_reporter.set_service_status("", status).await;
    *last = Some(ready);
}

#[cfg(test)]
#[path = "grpc_tests.rs"]
mod tests;
