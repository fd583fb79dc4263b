//! Shutdown: a signal flips `stopping` (readiness NOT_SERVING, still serving); after the delay
//! `closing` flips and the listeners close; past the grace period open streams are dropped.

use std::time::Duration;

use tokio::sync::watch;
use tracing::info;

use crate::config::ServerConfig;

/// The two stages of shutdown, as the servers and readiness watch them.
#[derive(Debug, Clone)]
pub(super) struct Shutdown {
    /// True once a signal arrived: readiness fails, streams are still served.
    pub stopping: watch::Receiver<bool>,
    /// True once the delay is over: the listeners close and open streams drain.
    pub closing: watch::Receiver<bool>,
}

impl Shutdown {
    /// Waits for SIGINT/SIGTERM in the background. Closing at once failed FULL_DUPLEX requests
    /// that Envoy sent before its health check saw NOT_SERVING (it cannot fail open there).
    pub fn start(cfg: &ServerConfig) -> Self {
        let (stop_tx, stopping) = watch::channel(false);
        let (close_tx, closing) = watch::channel(false);
        let delay = Duration::from_millis(cfg.shutdown_delay_ms);
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
        Self { stopping, closing }
    }

    /// Resolves once the listeners are to close.
    pub fn closed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        stopped(self.closing.clone())
    }

    /// Resolves `grace` after the listeners closed: graceful shutdown waits for every open
    /// stream, so past it they are closed (dropping the servers) and the process exits inside
    /// Kubernetes' termination grace.
    pub async fn grace_over(self, grace: Duration) {
        stopped(self.closing).await;
        tokio::time::sleep(grace).await;
    }
}

/// Resolves once `stopping` is true.
async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|s| *s).await;
}

/// Resolves on SIGINT or (on Unix) SIGTERM.
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
