//! The admin port's accept loop. axum's `serve` sets no header read timeout and no connection
//! limit: 3,000 connections dribbling headers stayed open and 20,000 exhausted the file
//! descriptors; then a fixed cap that refused new connections let 2,000 dribbling ones starve
//! `/healthz` and `/metrics`. Here a request's headers (and an idle keep-alive connection's next
//! ones) must arrive within [`HEADER_READ_TIMEOUT`], and at [`MAX_CONNECTIONS`] the oldest
//! connection not serving a request is evicted for the new one (`server::conns`).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use bytes::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceExt;
use tracing::{debug, warn};

use crate::server::conns::{Closed, ConnMetrics, Port, Serving, Tracker};

/// Time allowed for a request's headers, and for the next request on an idle connection.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Most admin connections open at once.
pub const MAX_CONNECTIONS: usize = 512;

/// Serves `app` on `listener` until `stopping` turns true.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    metrics: ConnMetrics,
    mut stopping: watch::Receiver<bool>,
) {
    let tracker = Tracker::new(Port::Admin, MAX_CONNECTIONS, metrics.clone());
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
        let Some((conn, busy)) = tracker.admit_http(stream) else {
            debug!(%peer, "admin connection limit reached, every open one busy; closing a new connection");
            continue;
        };
        let app = app.clone();
        // Not evictable from the moment its headers are parsed until its response is written.
        let service = hyper::service::service_fn(move |req| {
            let serving = busy.serving();
            let app = app.clone();
            async move {
                let resp = app.oneshot(req).await?;
                Ok::<_, Infallible>(resp.map(|b| Body::new(Marked { inner: b, serving })))
            }
        });
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut builder = Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT);
            let done = builder.serve_connection(TokioIo::new(conn), service).await;
            let timed_out = done
                .as_ref()
                .err()
                .and_then(|e| e.downcast_ref::<hyper::Error>());
            if timed_out.is_some_and(|e| e.is_timeout()) {
                metrics.closed(Port::Admin, Closed::HeaderTimeout);
            }
        });
    }
}

/// A response body that keeps its connection marked as serving until written (or dropped).
struct Marked {
    inner: Body,
    #[allow(dead_code)] // held for its Drop
    serving: Serving,
}

impl http_body::Body for Marked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
