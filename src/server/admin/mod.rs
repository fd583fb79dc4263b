//! The admin port: `/metrics`, `/healthz`, `/readyz` and the `/debug/*` endpoints.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use prometheus_client::registry::Registry;
use tracing::warn;

use crate::config::Config;
use crate::server::budget::BodyBudget;

use crate::app::shutdown::Shutdown;
use crate::app::Shared;
use crate::server::conns::ConnMetrics;
use crate::server::readiness::Readiness;

pub(super) mod routes;
mod serve;

use routes::AdminState;

/// Binds the admin listener and returns its server, which stops once shutdown closes the
/// listeners. Fails when the token file cannot be read or the address cannot be bound.
pub(crate) async fn start(
    cfg: &Config,
    shared: Shared,
    readiness: Readiness,
    registry: Arc<Registry>,
    conns: ConnMetrics,
    mode: &'static str,
    shutdown: &Shutdown,
) -> anyhow::Result<impl Future<Output = ()>> {
    let admin_addr = cfg.admin_addr();
    let token = admin_token(cfg)?;
    if token.is_none() && !admin_addr.ip().is_loopback() {
        warn!(admin = %admin_addr, "the admin port is not on loopback and no admin.token is set: /debug/* is open to anyone who reaches it");
    }
    // An explain input wraps a body as a JSON string: escaping may double it.
    let explain_limit = cfg
        .body_limit_bytes
        .saturating_mul(2)
        .saturating_add(1 << 20);
    let app = routes::router(AdminState {
        token,
        registry,
        pods: shared.pods,
        decider: shared.decider,
        sessions: shared.sessions,
        stale_after: Duration::from_millis(cfg.pods.stale_after_ms),
        mode,
        readiness,
        // Its own budget of one explain input: a caller of the admin port must not be able to
        // spend the data plane's (ext_proc bodies would get 503s).
        bodies: BodyBudget::new(explain_limit),
        body_limit: explain_limit,
    });
    let listener = crate::server::conns::bind(admin_addr)
        .with_context(|| format!("binding admin listener {admin_addr}"))?;
    Ok(serve::serve(listener, app, conns, shutdown.closing.clone()))
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
