//! The gRPC port: ext_proc, the `Pick` service and gRPC health, whose readiness a supervised
//! loop keeps equal to [`Readiness`] (as `/readyz` is).

use std::future::Future;
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::time::interval;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};
use tonic_health::ServingStatus;

use crate::config::Config;
use crate::extproc::{ExtProc, ExtProcMetrics};
use crate::server::pick::budget::Metered;
use crate::server::pick::proto::picker_server::PickerServer;
use crate::server::pick::PickService;

use crate::app::shutdown::Shutdown;
use crate::app::Shared;

use super::conns;
use super::readiness::Readiness;

/// gRPC health service names (Endpoint Picker Protocol).
pub(super) const HEALTH_SERVICES: [&str; 3] = [
    "liveness",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

/// Sets liveness SERVING and readiness NOT_SERVING, starts the `readiness` loop, and returns the
/// server (it binds when first polled, and stops accepting once shutdown closes the listeners).
/// Fails when the TLS files cannot be read or used.
pub(crate) async fn start(
    cfg: &Config,
    shared: &Shared,
    readiness: Readiness,
    metrics: ExtProcMetrics,
    conn_metrics: conns::ConnMetrics,
    shutdown: &Shutdown,
) -> anyhow::Result<impl Future<Output = Result<(), tonic::transport::Error>>> {
    let (health_reporter, health_service) = health().await;
    shared.supervisor.spawn("readiness", move || {
        report_readiness(readiness.clone(), health_reporter.clone())
    });
    // One budget for every body this port buffers: ext_proc bodies and Pick messages.
    let budget = shared.bodies.clone();
    let errors = metrics.errors();
    let mut extproc = ExtProc::new(
        shared.decider.clone(),
        metrics,
        cfg.body_limit_bytes,
        cfg.destination_header,
    )
    .with_shared_budget(budget.clone());
    if let Some(flow) = &shared.flow {
        extproc = extproc.with_flow_control(flow.clone());
    }
    // Validated to at most 1 GiB; saturating all the same so no value can wrap the limit.
    let limit = cfg.body_limit_bytes.saturating_add(1 << 20);
    let pick_limit = cfg.pick_api.max_message_bytes;
    let pick = Metered::new(
        PickerServer::new(PickService::new(
            shared.decider.clone(),
            cfg.pick_api.clone(),
        ))
        .max_decoding_message_size(pick_limit),
        budget,
        pick_limit,
        errors,
    );
    let addr = cfg.grpc_addr();
    let listener = conns::bind(addr).with_context(|| format!("binding gRPC listener {addr}"))?;
    let incoming = conns::incoming(
        listener,
        cfg.server.max_connections,
        Duration::from_millis(cfg.server.handshake_timeout_ms),
        conn_metrics,
    );
    Ok(grpc_builder(cfg)?
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .max_concurrent_streams(Some(cfg.server.max_concurrent_streams))
        .add_service(health_service)
        .add_service(ExternalProcessorServer::new(extproc).max_decoding_message_size(limit))
        .add_service(pick)
        .serve_with_incoming_shutdown(incoming, shutdown.closed()))
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
