//! The admin port (`listen.admin`): `/metrics`, `/healthz`, `/readyz` and the `/debug/*`
//! endpoints ([`routes`]), served by its own accept loop ([`serve`]). Never the data plane.
//!
//! - **Who may call**: anyone who reaches the port (keep it on loopback or a private network);
//!   with `admin.token` (or `admin.token_file`), `/debug/*` only with `Authorization: Bearer`;
//!   `/metrics`, `/healthz` and `/readyz` stay open for scrapers and probes. Another replica's
//!   warm start presents the same token for `/debug/index/snapshot`.
//! - **What a caller may change**: nothing. `POST /debug/explain` plans a decision without
//!   committing it; `/debug/pods` shows pod addresses, models and load;
//!   `/debug/index/snapshot` the index's block keys and pod addresses (no prompt text).
//! - **Memory**: at most [`serve::MAX_CONNECTIONS`] connections (fewer under a low file-descriptor
//!   limit: `server::fds`), each reading headers for at most [`serve::HEADER_READ_TIMEOUT`] into
//!   hyper's bounded read buffer and writing a response for at most [`serve::WRITE_TIMEOUT`]; explain inputs being read
//!   hold at most 2 × `body_limit_bytes` + 1 MiB, all callers together, from a budget of the
//!   port's own (the gRPC port's is never spent here); one index snapshot is built at a time,
//!   of at most `index.warm_start.max_entries` entries.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tracing::warn;

use crate::config::AdminConfig;
use crate::decide::Decider;
use crate::observe::Receipts;
use crate::pods::PodRegistry;
use crate::scoring::SessionStore;

use super::conns::{self, ConnMetrics};
use super::fds::ConnCaps;
use super::readiness::Readiness;
use crate::budget::BodyBudget;

pub(super) mod routes;
mod serve;

pub(crate) use serve::MAX_CONNECTIONS;

use routes::AdminState;

/// The admin port's settings: its parts of `router.yaml`.
pub(crate) struct AdminSettings<'a> {
    /// `listen.admin`.
    pub addr: SocketAddr,
    /// `admin`: the token `/debug/*` requires.
    pub admin: &'a AdminConfig,
    /// `body_limit_bytes`: an explain input may carry a body this large.
    pub body_limit: usize,
    /// `pods.stale_after_ms`: `/debug/pods` shows older metrics as stale.
    pub stale_after: Duration,
    /// Both ports' connection caps in force (this port's is `admin_max_connections`).
    pub caps: ConnCaps,
    /// `index.warm_start.max_entries`: the most entries a snapshot served holds.
    pub snapshot_max_entries: usize,
}

/// What the admin port reads.
pub(crate) struct AdminSources {
    /// Every metric family, for `/metrics`.
    pub registry: Arc<Registry>,
    /// The pods, for `/debug/pods`.
    pub pods: Arc<PodRegistry>,
    /// The decision path, for explain (plan only) and the index figures.
    pub decider: Arc<Decider>,
    /// Sessions (their count only).
    pub sessions: Arc<SessionStore>,
    /// Recent decisions, for `GET /debug/explain?id=` (`receipts.enabled`).
    pub receipts: Option<Arc<Receipts>>,
    /// The routing mode `/debug/pods` reports.
    pub mode: &'static str,
    /// What `/readyz` answers.
    pub readiness: Readiness,
}

/// Binds the admin listener and returns its server, which stops once `closing` turns true.
/// Fails when the token file cannot be read or the address cannot be bound.
pub(crate) async fn start(
    cfg: AdminSettings<'_>,
    sources: AdminSources,
    conn_metrics: ConnMetrics,
    closing: watch::Receiver<bool>,
) -> anyhow::Result<impl Future<Output = ()>> {
    let admin_addr = cfg.addr;
    let token = admin_token(cfg.admin)?;
    if token.is_none() && !admin_addr.ip().is_loopback() {
        warn!(admin = %admin_addr, "the admin port is not on loopback and no admin.token is set: /debug/* is open to anyone who reaches it");
    }
    // An explain input wraps a body as a JSON string: escaping may double it.
    let explain_limit = cfg.body_limit.saturating_mul(2).saturating_add(1 << 20);
    let app = routes::router(AdminState {
        token,
        registry: sources.registry,
        pods: sources.pods,
        decider: sources.decider,
        sessions: sources.sessions,
        receipts: sources.receipts,
        stale_after: cfg.stale_after,
        mode: sources.mode,
        readiness: sources.readiness,
        // Its own budget of one explain input: a caller of the admin port must not be able to
        // spend the data plane's (ext_proc bodies would get 503s).
        bodies: BodyBudget::new(explain_limit),
        body_limit: explain_limit,
        caps: cfg.caps,
        snapshots: routes::IndexSnapshots::new(cfg.snapshot_max_entries),
    });
    let listener =
        conns::bind(admin_addr).with_context(|| format!("binding admin listener {admin_addr}"))?;
    let limits = serve::Limits::new(cfg.caps.admin_max_connections);
    Ok(serve::serve(listener, app, conn_metrics, limits, closing))
}

/// The admin bearer token: `admin.token_file` (trimmed) wins over `admin.token`; none = open.
pub(crate) fn admin_token(cfg: &AdminConfig) -> anyhow::Result<Option<Arc<str>>> {
    let token = match &cfg.token_file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading admin.token_file {}", path.display()))?
            .trim()
            .to_string(),
        None => cfg.token.clone(),
    };
    Ok((!token.is_empty()).then(|| token.into()))
}
