//! The gRPC port: ext_proc, the `Pick` service and gRPC health, whose readiness a supervised
//! loop keeps equal to `/readyz`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::time::interval;
use tonic_health::ServingStatus;

use crate::config::Config;
use crate::extproc::{ExtProc, ExtProcMetrics};
use crate::ingest;
use crate::pods::PodRegistry;
use crate::server::pick::budget::Metered;
use crate::server::pick::proto::picker_server::PickerServer;
use crate::server::pick::PickService;
use crate::supervise::Supervisor;

use crate::app::shutdown::Shutdown;
use crate::app::Shared;

use super::conns;

/// gRPC health service names (Endpoint Picker Protocol).
const HEALTH_SERVICES: [&str; 3] = [
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
    metrics: ExtProcMetrics,
    conn_metrics: conns::ConnMetrics,
    shutdown: &Shutdown,
) -> anyhow::Result<impl Future<Output = Result<(), tonic::transport::Error>>> {
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
        let (pods, sup, stopping) = (
            shared.pods.clone(),
            shared.supervisor.clone(),
            shutdown.stopping.clone(),
        );
        let catch_up = shared.catch_up.clone();
        let index = shared.decider.index().clone();
        shared.supervisor.spawn("readiness", move || {
            let (pods, sup, health_reporter) = (pods.clone(), sup.clone(), health_reporter.clone());
            readiness(
                pods,
                sup,
                catch_up.clone(),
                index.clone(),
                health_reporter,
                stopping.clone(),
            )
        });
    }
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

/// Keeps the gRPC readiness services equal to: not stopping, a healthy pod, no loop down,
/// (precise mode) the start-up KV-event catch-ups over and the index ready, as `/readyz`.
async fn readiness(
    pods: Arc<PodRegistry>,
    supervisor: Supervisor,
    catch_up: Option<Arc<ingest::CatchUp>>,
    index: Arc<dyn crate::index::KvIndex>,
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
                .is_none_or(|c| c.waiting_on(&pods).is_none())
            && index.unready().is_none();
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
