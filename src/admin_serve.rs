//! The admin port's accept loop. axum's `serve` sets no header read timeout and no connection
//! limit: 3,000 connections dribbling headers stayed open and 20,000 exhausted the file
//! descriptors. Here a request's headers must arrive within [`HEADER_READ_TIMEOUT`], and past
//! [`MAX_CONNECTIONS`] new connections are closed at once (the open ones keep being served).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tracing::{debug, warn};

/// Time allowed for a request's headers (slowloris bound).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Most admin connections open at once.
pub const MAX_CONNECTIONS: usize = 512;

/// Serves `app` on `listener` until `stopping` turns true.
pub async fn serve(listener: TcpListener, app: Router, mut stopping: watch::Receiver<bool>) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopping.wait_for(|s| *s) => return,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                warn!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            debug!(%peer, "admin connection limit reached; closing a new connection");
            drop(stream);
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let mut builder = Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT);
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
            drop(permit);
        });
    }
}
