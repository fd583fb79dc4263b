//! Connection limits for the gRPC port: at most `max_connections` open at once, and a
//! connection that has not sent its first `HANDSHAKE_BYTES` (the HTTP/2 preface, or a TLS
//! ClientHello) within the handshake timeout is closed. At the cap, the oldest connection still
//! in its handshake is evicted to make room, so a flood of silent connections can neither hold
//! file descriptors nor lock out the gateway's and the kubelet's new connections (2,000 such
//! connections once made a readiness check time out).

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::task::AtomicWaker;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::debug;

/// The HTTP/2 client preface is 24 bytes; a TLS ClientHello is longer.
const HANDSHAKE_BYTES: u64 = 24;

/// One connection's entry in the tracker.
#[derive(Default)]
struct Slot {
    /// Still short of its handshake bytes (evictable).
    handshaking: AtomicBool,
    evicted: AtomicBool,
    waker: AtomicWaker,
}

impl Slot {
    fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        self.waker.wake();
    }
}

/// Open connections, oldest first.
#[derive(Default)]
struct Tracker {
    open: Mutex<VecDeque<Weak<Slot>>>,
}

impl Tracker {
    /// Registers a new connection; at `cap`, evicts the oldest still handshaking, or refuses
    /// (`None`) when every open one has finished its handshake.
    fn admit(&self, cap: usize) -> Option<Arc<Slot>> {
        let mut open = self.open.lock();
        open.retain(|w| w.strong_count() > 0);
        if open.len() >= cap {
            let oldest = open.iter().position(|w| {
                w.upgrade()
                    .is_some_and(|s| s.handshaking.load(Ordering::Acquire))
            })?;
            if let Some(s) = open.remove(oldest).and_then(|w| w.upgrade()) {
                s.evict();
            }
        }
        let slot = Arc::new(Slot {
            handshaking: AtomicBool::new(true),
            ..Slot::default()
        });
        open.push_back(Arc::downgrade(&slot));
        Some(slot)
    }
}

/// A connection under the guard: reads fail once it is evicted or its handshake is late.
pub struct Guarded {
    inner: TcpStream,
    slot: Arc<Slot>,
    read: u64,
    deadline: Option<Pin<Box<Sleep>>>,
}

impl Guarded {
    fn closed(&self, why: &'static str) -> io::Error {
        debug!(why, "gRPC connection closed before its handshake");
        io::Error::new(io::ErrorKind::TimedOut, why)
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.deadline.is_some() {
            this.slot.waker.register(cx.waker());
            if this.slot.evicted.load(Ordering::Acquire) {
                return Poll::Ready(Err(this.closed("evicted at the connection cap")));
            }
            if let Some(d) = this.deadline.as_mut() {
                if d.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(this.closed("handshake timeout")));
                }
            }
        }
        let before = buf.filled().len();
        let res = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = res {
            this.read += (buf.filled().len() - before) as u64;
            if this.deadline.is_some() && this.read >= HANDSHAKE_BYTES {
                this.deadline = None;
                this.slot.handshaking.store(false, Ordering::Release);
            }
        }
        res
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl Connected for Guarded {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.inner.connect_info()
    }
}

/// The guarded connections `listener` accepts, as a stream for `serve_with_incoming`.
pub fn incoming(
    listener: TcpListener,
    cap: usize,
    handshake_timeout: Duration,
) -> impl futures::Stream<Item = io::Result<Guarded>> {
    let tracker = Arc::new(Tracker::default());
    futures::stream::unfold(listener, move |listener| {
        let tracker = tracker.clone();
        async move {
            loop {
                let (tcp, _) = match listener.accept().await {
                    Ok(c) => c,
                    // Out of fds and the like: the listener stays; try again shortly.
                    Err(e) => {
                        debug!(error = %e, "gRPC accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let Some(slot) = tracker.admit(cap) else {
                    debug!(
                        "gRPC connection refused: at the cap, every open one is past its handshake"
                    );
                    continue; // dropped: closed at once
                };
                let _ = tcp.set_nodelay(true);
                let conn = Guarded {
                    inner: tcp,
                    slot,
                    read: 0,
                    deadline: Some(Box::pin(tokio::time::sleep_until(
                        Instant::now() + handshake_timeout,
                    ))),
                };
                return Some((Ok(conn), listener));
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_the_cap_the_oldest_handshaking_connection_is_evicted_else_the_new_one_refused() {
        let t = Tracker::default();
        let a = t.admit(2).unwrap();
        let b = t.admit(2).unwrap();
        a.handshaking.store(false, Ordering::Release);
        let c = t.admit(2).expect("b, still handshaking, makes room");
        assert!(b.evicted.load(Ordering::Acquire) && !a.evicted.load(Ordering::Acquire));
        c.handshaking.store(false, Ordering::Release);
        assert!(t.admit(2).is_none(), "every open one is past its handshake");
        drop(a);
        assert!(t.admit(2).is_some(), "a closed connection frees its place");
    }
}
