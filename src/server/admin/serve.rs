//! The admin port's accept loop. axum's `serve` sets no header read timeout and no connection
//! limit: 3,000 connections dribbling headers stayed open and 20,000 exhausted the file
//! descriptors; then a fixed cap that refused new connections let 2,000 dribbling ones starve
//! `/healthz` and `/metrics`. Here a request's headers (and an idle keep-alive connection's next
//! ones) must arrive within [`HEADER_READ_TIMEOUT`], and at the cap the oldest connection not
//! running a handler is evicted for the new one (`server::conns`).
//!
//! A response must be written within [`WRITE_TIMEOUT`]: 520 HTTP/2 connections whose `/metrics`
//! responses met a zero flow-control window held every slot as "serving", and HTTP/1.1 readers
//! that never read theirs kept 578 connections open past the 512 cap (an evicted connection
//! blocked writing never read again, so never saw its eviction). Now a connection is dropped by
//! its own task when evicted, when a response (or a socket write) outlives the write deadline,
//! and when it has had no request in hand for the header timeout (an HTTP/2 connection with no
//! open stream).

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
use tokio::task::AbortHandle;
use tower::ServiceExt;
use tracing::{debug, warn};

use crate::server::conns::{Busy, Closed, ConnMetrics, Guarded, Port, Serving, Tracker};

/// Time allowed for a request's headers, and for the next request on an idle connection.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Most admin connections open at once (lower when the file-descriptor limit is: `server::fds`).
pub const MAX_CONNECTIONS: usize = 512;
/// Time allowed to write a response once its handler returned, and for one socket write.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2: streams one admin connection may have open (probes and scrapes need one).
const MAX_CONCURRENT_STREAMS: u32 = 8;
/// HTTP/2: a PING this often, and the connection closes when its ACK is this late.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The admin port's connection limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most connections open at once.
    pub max_connections: usize,
    /// Headers, and a connection's next request, must arrive within this.
    pub header_read_timeout: Duration,
    /// A response must be written within this.
    pub write_timeout: Duration,
}

impl Limits {
    /// The defaults, at most `max_connections` connections.
    pub fn new(max_connections: usize) -> Self {
        Self {
            max_connections,
            header_read_timeout: HEADER_READ_TIMEOUT,
            write_timeout: WRITE_TIMEOUT,
        }
    }
}

/// Serves `app` on `listener` until `stopping` turns true.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    metrics: ConnMetrics,
    limits: Limits,
    mut stopping: watch::Receiver<bool>,
) {
    let tracker = Tracker::new(Port::Admin, limits.max_connections, metrics.clone());
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
        let Some((conn, busy)) = tracker.admit_http(stream, limits.write_timeout) else {
            debug!(%peer, "admin connection limit reached, every open one running a handler; closing a new connection");
            continue;
        };
        tokio::spawn(connection(conn, busy, app.clone(), metrics.clone(), limits));
    }
}

/// Serves one connection until it ends, is evicted, misses a write deadline or stays idle.
async fn connection(conn: Guarded, busy: Busy, app: Router, metrics: ConnMetrics, limits: Limits) {
    let service = {
        let busy = busy.clone();
        // Not evictable while its handler runs; then its response has the write deadline.
        hyper::service::service_fn(move |req| {
            let mut serving = busy.serving();
            let (app, busy) = (app.clone(), busy.clone());
            async move {
                let resp = app.oneshot(req).await?;
                serving.writing();
                let watchdog = tokio::spawn(async move {
                    tokio::time::sleep(limits.write_timeout).await;
                    busy.write_timed_out();
                });
                let marked = |inner| Marked {
                    inner,
                    _serving: serving,
                    watchdog: watchdog.abort_handle(),
                };
                Ok::<_, Infallible>(resp.map(|b| Body::new(marked(b))))
            }
        })
    };
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(KEEP_ALIVE_TIMEOUT);
    let served = builder.serve_connection(TokioIo::new(conn), service);
    tokio::pin!(served);
    loop {
        let idle = busy.idle_for();
        if idle.is_some_and(|d| d >= limits.header_read_timeout) {
            metrics.closed(Port::Admin, Closed::HeaderTimeout);
            return;
        }
        let wait = limits
            .header_read_timeout
            .saturating_sub(idle.unwrap_or_default());
        tokio::select! {
            done = &mut served => {
                let error = done.as_ref().err().and_then(|e| e.downcast_ref::<hyper::Error>());
                if error.is_some_and(|e| e.is_timeout()) {
                    metrics.closed(Port::Admin, Closed::HeaderTimeout);
                }
                return;
            }
            // Evicted or past a write deadline (counted where decided): dropped, so closed.
            () = busy.killed() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// A response body that keeps its connection marked as writing until written (or dropped), and
/// its write deadline's watchdog armed until then.
struct Marked {
    inner: Body,
    _serving: Serving,
    watchdog: AbortHandle,
}

impl Drop for Marked {
    fn drop(&mut self) {
        self.watchdog.abort();
    }
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

#[cfg(test)]
#[path = "serve_tests.rs"]
mod tests;
