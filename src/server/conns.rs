//! Connection limits for both listeners: at most `cap` connections open at once, and at the cap
//! the oldest connection still *evictable* is closed to make room for the new one, so a flood of
//! silent or dribbling connections can neither hold file descriptors nor lock out the gateway's,
//! the kubelet's or Prometheus' new connections (2,000 preface-less gRPC connections once made a
//! readiness check time out; 2,000 admin connections dribbling headers starved `/healthz`).
//!
//! Evictable means: on the gRPC port, short of its first `HANDSHAKE_BYTES` (the HTTP/2 preface, or
//! a TLS ClientHello), which must also arrive within the handshake timeout; on the admin port, not
//! running a request's handler (reading headers, idle, or writing a response). The admin port
//! evicts an idle connection first, else the one whose response has been stuck writing the longest
//! (520 HTTP/2 connections whose `/metrics` responses met a zero flow-control window once held
//! every slot), and refuses only while every one runs a handler. When
//! nothing is, a gRPC port at its cap evicts the connection that has read nothing the longest: a
//! flood of HTTP/2 connections that complete their handshake and then say nothing once locked out
//! every new one. A gateway's live connection reads at least its keepalive PING ACKs every 30 s,
//! so it is never the quietest while such a flood lasts.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::LazyLock;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::task::AtomicWaker;
use parking_lot::Mutex;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::debug;

/// The accept queue asked of the kernel (which caps it at `net.core.somaxconn`): with tokio's
/// 1,024, 2,000 clients reconnecting at once overflowed it, and a health probe whose SYN was
/// dropped waited the kernel's 1 s retransmit (`kv-bench hostile --attacks`, admin slowloris).
const LISTEN_BACKLOG: u32 = 4096;

/// Binds a listener (SO_REUSEADDR, as `TcpListener::bind` does) with [`LISTEN_BACKLOG`].
pub(crate) fn bind(addr: std::net::SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// The HTTP/2 client preface is 24 bytes; a TLS ClientHello is longer.
const HANDSHAKE_BYTES: u64 = 24;

/// Which listener (the `port` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Port {
    Grpc,
    Admin,
    /// `listen.grpc_health`: gRPC health alone, held like the gRPC port.
    GrpcHealth,
}

/// Why the router closed a connection (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Closed {
    /// At the cap with nothing evictable: the new connection was closed at once.
    Refused,
    /// At the cap: closed to make room for a new one.
    Evicted,
    /// gRPC: its handshake bytes did not arrive in time.
    HandshakeTimeout,
    /// Admin: a request's headers did not arrive in time (idle keep-alive and an HTTP/2
    /// connection with no open stream included).
    HeaderTimeout,
    /// Admin: a response was not written within the write deadline.
    WriteTimeout,
}

impl EncodeLabelValue for Port {
    fn encode(&self, e: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        e.write_str(match self {
            Port::Grpc => "grpc",
            Port::Admin => "admin",
            Port::GrpcHealth => "grpc_health",
        })
    }
}

impl EncodeLabelValue for Closed {
    fn encode(&self, e: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        e.write_str(match self {
            Closed::Refused => "refused",
            Closed::Evicted => "evicted",
            Closed::HandshakeTimeout => "handshake_timeout",
            Closed::HeaderTimeout => "header_timeout",
            Closed::WriteTimeout => "write_timeout",
        })
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PortLabels {
    port: Port,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClosedLabels {
    port: Port,
    reason: Closed,
}

/// `kv_router_connections_open{port}` and `kv_router_connections_closed_total{port,reason}`.
#[derive(Debug, Clone, Default)]
pub struct ConnMetrics {
    open: Family<PortLabels, Gauge>,
    closed: Family<ClosedLabels, Counter>,
    /// gRPC requests whose illegal `:authority` was rewritten (`super::authority`).
    pub authority_rewritten: Counter,
}

impl ConnMetrics {
    /// Registers both families (`registry` is the `kv_router` sub-registry).
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "connections_open",
            "Connections open now, by listener",
            m.open.clone(),
        );
        registry.register(
            "connections_closed",
            "Connections the router closed to bound them (refused or evicted at the cap, handshake, header or write timeout), by listener",
            m.closed.clone(),
        );
        registry.register(
            "grpc_authority_rewritten",
            "gRPC requests whose :authority the HTTP/2 server would refuse (Istio's outbound|port||host) that the router rewrote to host:port, or dropped",
            m.authority_rewritten.clone(),
        );
        m
    }

    /// Counts one connection closed on `port` for `reason`.
    pub fn closed(&self, port: Port, reason: Closed) {
        self.closed
            .get_or_create(&ClosedLabels { port, reason })
            .inc();
    }
}

/// Milliseconds since the first call: the connections' common clock for "quiet the longest".
fn now_ms() -> u64 {
    static START: LazyLock<std::time::Instant> = LazyLock::new(std::time::Instant::now);
    START.elapsed().as_millis() as u64
}

/// One connection's entry in the tracker; dropped with the connection.
struct Slot {
    /// Evictable now (see the module comment).
    evictable: AtomicBool,
    /// When it last read a byte ([`now_ms`]); gRPC only.
    last_read: AtomicU64,
    evicted: AtomicBool,
    waker: AtomicWaker,
    /// Admin: wakes the connection's task to drop it (evicted, or a write deadline passed).
    kill: Notify,
    /// Admin: requests whose handler runs.
    handling: AtomicU32,
    /// Admin: responses being written, and since when the first of them ([`now_ms`]).
    writing: AtomicU32,
    writing_since: AtomicU64,
    /// Admin: when it last had no request in hand ([`now_ms`]).
    idle_since: AtomicU64,
    /// Admin: a write to the socket is waiting for the peer to read.
    write_blocked: AtomicBool,
    port: Port,
    metrics: ConnMetrics,
}

impl Slot {
    fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        self.waker.wake();
        self.kill.notify_one();
    }

    /// Admin: no handler runs and no response is being written.
    fn idle(&self) -> bool {
        self.handling.load(Ordering::Acquire) == 0 && self.writing.load(Ordering::Acquire) == 0
    }

    fn evictable(&self) -> bool {
        match self.port {
            Port::Grpc | Port::GrpcHealth => self.evictable.load(Ordering::Acquire),
            Port::Admin => self.idle(),
        }
    }

    /// Admin: writing responses only, since when (`None` while a handler runs or none writes).
    fn stuck_writing(&self) -> Option<u64> {
        let writing = self.writing.load(Ordering::Acquire) > 0;
        (writing && self.handling.load(Ordering::Acquire) == 0)
            .then(|| self.writing_since.load(Ordering::Acquire))
    }

    fn went_idle(&self) {
        if self.idle() {
            self.idle_since.store(now_ms(), Ordering::Release);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.metrics
            .open
            .get_or_create(&PortLabels { port: self.port })
            .dec();
    }
}

/// Open connections of one listener, oldest first.
pub struct Tracker {
    open: Mutex<VecDeque<Weak<Slot>>>,
    cap: usize,
    port: Port,
    metrics: ConnMetrics,
}

impl Tracker {
    pub fn new(port: Port, cap: usize, metrics: ConnMetrics) -> Arc<Self> {
        Arc::new(Self {
            open: Mutex::default(),
            cap,
            port,
            metrics,
        })
    }

    /// Registers a new connection; at the cap, evicts the oldest evictable one, or refuses
    /// (`None`) when none is.
    fn admit(&self) -> Option<Arc<Slot>> {
        let mut open = self.open.lock();
        open.retain(|w| w.strong_count() > 0);
        if open.len() >= self.cap {
            let oldest = open
                .iter()
                .position(|w| w.upgrade().is_some_and(|s| s.evictable()));
            // gRPC: else the connection that has read nothing the longest.
            let quietest = || {
                let live = open.iter().enumerate();
                let quiet = live
                    .filter_map(|(i, w)| Some((w.upgrade()?.last_read.load(Ordering::Relaxed), i)));
                quiet.min().map(|(_, i)| i)
            };
            // Admin: else the one whose response has been stuck writing the longest.
            let stuck = || {
                let live = open.iter().enumerate();
                let writing = live.filter_map(|(i, w)| Some((w.upgrade()?.stuck_writing()?, i)));
                writing.min().map(|(_, i)| i)
            };
            let victim = match self.port {
                Port::Grpc | Port::GrpcHealth => oldest.or_else(quietest),
                Port::Admin => oldest.or_else(stuck),
            };
            let Some(oldest) = victim else {
                self.metrics.closed(self.port, Closed::Refused);
                return None;
            };
            if let Some(s) = open.remove(oldest).and_then(|w| w.upgrade()) {
                s.evict();
                self.metrics.closed(self.port, Closed::Evicted);
            }
        }
        self.metrics
            .open
            .get_or_create(&PortLabels { port: self.port })
            .inc();
        let slot = Arc::new(Slot {
            evictable: AtomicBool::new(true),
            last_read: AtomicU64::new(now_ms()),
            evicted: AtomicBool::new(false),
            waker: AtomicWaker::new(),
            kill: Notify::new(),
            handling: AtomicU32::new(0),
            writing: AtomicU32::new(0),
            writing_since: AtomicU64::new(0),
            idle_since: AtomicU64::new(now_ms()),
            write_blocked: AtomicBool::new(false),
            port: self.port,
            metrics: self.metrics.clone(),
        });
        open.push_back(Arc::downgrade(&slot));
        Some(slot)
    }

    /// An admin connection: evictable whenever no handler of its runs (see [`Busy`]); a write
    /// to its socket that waits longer than `write_timeout` fails. `None` when refused at the cap
    /// (dropped: closed at once).
    pub fn admit_http(&self, tcp: TcpStream, write_timeout: Duration) -> Option<(Guarded, Busy)> {
        let slot = self.admit()?;
        let busy = Busy(slot.clone());
        let conn = Guarded {
            inner: tcp,
            slot,
            read: 0,
            deadline: None,
            handshake_bytes: None,
            write_timeout: Some(write_timeout),
            write_deadline: None,
        };
        Some((conn, busy))
    }
}

/// An admin connection's state, for its service and its task.
#[derive(Clone)]
pub struct Busy(Arc<Slot>);

/// Held from a request's headers until its response is written (or dropped).
pub struct Serving {
    slot: Arc<Slot>,
    writing: bool,
}

impl Busy {
    /// A request's handler starts: not evictable until it returns.
    pub fn serving(&self) -> Serving {
        self.0.handling.fetch_add(1, Ordering::AcqRel);
        Serving {
            slot: self.0.clone(),
            writing: false,
        }
    }

    /// Resolves once the connection must close: evicted, or a response's write deadline passed.
    pub async fn killed(&self) {
        self.0.kill.notified().await
    }

    /// How long it has had no request in hand and no write waiting; `None` while it has.
    pub fn idle_for(&self) -> Option<Duration> {
        let s = &self.0;
        if !s.idle() || s.write_blocked.load(Ordering::Acquire) {
            return None;
        }
        let since = s.idle_since.load(Ordering::Acquire);
        Some(Duration::from_millis(now_ms().saturating_sub(since)))
    }

    /// Closes the connection: a response missed its write deadline.
    pub fn write_timed_out(&self) {
        self.0.metrics.closed(self.0.port, Closed::WriteTimeout);
        self.0.kill.notify_one();
    }
}

impl Serving {
    /// The handler returned: its response is being written (evictable when nothing else runs).
    pub fn writing(&mut self) {
        if std::mem::replace(&mut self.writing, true) {
            return;
        }
        let s = &self.slot;
        if s.writing.fetch_add(1, Ordering::AcqRel) == 0 {
            s.writing_since.store(now_ms(), Ordering::Release);
        }
        s.handling.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let counter = match self.writing {
            true => &self.slot.writing,
            false => &self.slot.handling,
        };
        counter.fetch_sub(1, Ordering::AcqRel);
        self.slot.went_idle();
    }
}

/// A connection under the guard: reads fail once it is evicted or its handshake is late.
pub struct Guarded {
    inner: TcpStream,
    slot: Arc<Slot>,
    read: u64,
    deadline: Option<Pin<Box<Sleep>>>,
    /// gRPC: evictable until this many bytes were read.
    handshake_bytes: Option<u64>,
    /// Admin: how long a write may wait for the peer to read, and when the waiting one fails.
    write_timeout: Option<Duration>,
    write_deadline: Option<Pin<Box<Sleep>>>,
}

impl Guarded {
    fn closed(&self, why: &'static str) -> io::Error {
        debug!(why, "connection closed by the connection guard");
        io::Error::new(io::ErrorKind::TimedOut, why)
    }

    /// Admin: a write that stays pending past the write timeout fails (the peer stopped reading).
    fn write_waits<T>(
        &mut self,
        cx: &mut Context<'_>,
        res: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        let Some(timeout) = self.write_timeout else {
            return res;
        };
        if res.is_ready() {
            self.write_deadline = None;
            self.slot.write_blocked.store(false, Ordering::Release);
            return res;
        }
        self.slot.write_blocked.store(true, Ordering::Release);
        let deadline = self
            .write_deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if deadline.as_mut().poll(cx).is_ready() {
            self.write_deadline = None;
            self.slot.write_blocked.store(false, Ordering::Release);
            self.slot
                .metrics
                .closed(self.slot.port, Closed::WriteTimeout);
            return Poll::Ready(Err(self.closed("write timeout")));
        }
        res
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.slot.waker.register(cx.waker());
        if this.slot.evicted.load(Ordering::Acquire) {
            return Poll::Ready(Err(this.closed("evicted at the connection cap")));
        }
        if let Some(d) = this.deadline.as_mut() {
            if d.as_mut().poll(cx).is_ready() {
                this.deadline = None;
                // Not evictable any more and counted once: later reads fail as evicted.
                this.slot.evictable.store(false, Ordering::Release);
                this.slot.evicted.store(true, Ordering::Release);
                this.slot
                    .metrics
                    .closed(this.slot.port, Closed::HandshakeTimeout);
                return Poll::Ready(Err(this.closed("handshake timeout")));
            }
        }
        let before = buf.filled().len();
        let res = Pin::new(&mut this.inner).poll_read(cx, buf);
        let got = buf.filled().len() - before;
        if matches!(res, Poll::Ready(Ok(()))) && got > 0 && this.slot.port != Port::Admin {
            this.slot.last_read.store(now_ms(), Ordering::Relaxed);
            if let Some(need) = this.handshake_bytes {
                this.read += got as u64;
                if this.read >= need {
                    this.handshake_bytes = None;
                    this.deadline = None;
                    this.slot.evictable.store(false, Ordering::Release);
                }
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
        let res = Pin::new(&mut self.inner).poll_write(cx, data);
        self.write_waits(cx, res)
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
        let res = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.write_waits(cx, res)
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
    metrics: ConnMetrics,
) -> impl futures::Stream<Item = io::Result<Guarded>> {
    incoming_on(Port::Grpc, listener, cap, handshake_timeout, metrics)
}

/// [`incoming`] for a gRPC listener labelled `port`.
pub fn incoming_on(
    port: Port,
    listener: TcpListener,
    cap: usize,
    handshake_timeout: Duration,
    metrics: ConnMetrics,
) -> impl futures::Stream<Item = io::Result<Guarded>> {
    let tracker = Tracker::new(port, cap, metrics);
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
                let Some(slot) = tracker.admit() else {
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
                    handshake_bytes: Some(HANDSHAKE_BYTES),
                    write_timeout: None,
                    write_deadline: None,
                };
                return Some((Ok(conn), listener));
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evictable(s: &Slot) -> bool {
        s.evictable()
    }

    fn busy(s: &Slot) {
        s.handling.fetch_add(1, Ordering::AcqRel);
    }

    #[test]
    fn at_the_cap_the_oldest_evictable_connection_is_evicted_else_the_new_one_refused() {
        let m = ConnMetrics::default();
        let t = Tracker::new(Port::Admin, 2, m.clone());
        let a = t.admit().unwrap();
        let b = t.admit().unwrap();
        busy(&a);
        let c = t.admit().expect("b, still evictable, makes room");
        assert!(b.evicted.load(Ordering::Acquire) && !a.evicted.load(Ordering::Acquire));
        busy(&c);
        assert!(t.admit().is_none(), "nothing open is evictable");
        drop(a);
        let d = t.admit();
        assert!(d.is_some(), "a closed connection frees its place");
        let closed = |reason| {
            m.closed
                .get_or_create(&ClosedLabels {
                    port: Port::Admin,
                    reason,
                })
                .get()
        };
        assert_eq!((closed(Closed::Evicted), closed(Closed::Refused)), (1, 1));
        drop((b, c));
        let open = m
            .open
            .get_or_create(&PortLabels { port: Port::Admin })
            .get();
        assert_eq!(open, 1, "only the last admitted one is still open");
    }

    #[test]
    fn a_grpc_port_at_its_cap_with_every_handshake_done_evicts_the_quietest() {
        let t = Tracker::new(Port::Grpc, 3, ConnMetrics::default());
        let slots: Vec<_> = (0..3).map(|_| t.admit().unwrap()).collect();
        for (s, last_read) in slots.iter().zip([50, 10, 30]) {
            s.evictable.store(false, Ordering::Release);
            s.last_read.store(last_read, Ordering::Relaxed);
        }
        assert!(t.admit().is_some(), "a new connection is never refused");
        let evicted: Vec<_> = slots
            .iter()
            .map(|s| s.evicted.load(Ordering::Acquire))
            .collect();
        assert_eq!(
            evicted,
            [false, true, false],
            "the one that read nothing the longest"
        );
        // The admin port keeps refusing instead: its busy connections are serving requests.
        let admin = Tracker::new(Port::Admin, 1, ConnMetrics::default());
        let busy = admin.admit().unwrap();
        super::tests::busy(&busy);
        assert!(admin.admit().is_none());
    }

    #[test]
    fn an_admin_connection_serving_a_request_is_not_evictable() {
        let t = Tracker::new(Port::Admin, 1, ConnMetrics::default());
        let a = t.admit().unwrap();
        let busy = Busy(a.clone());
        let serving = busy.serving();
        assert!(!evictable(&a));
        assert!(t.admit().is_none(), "refused while the only one is serving");
        drop(serving);
        assert!(evictable(&a));
        assert!(t.admit().is_some() && a.evicted.load(Ordering::Acquire));
    }

    #[test]
    fn an_admin_port_at_its_cap_evicts_the_response_stuck_writing_the_longest() {
        let t = Tracker::new(Port::Admin, 3, ConnMetrics::default());
        let slots: Vec<_> = (0..3).map(|_| t.admit().unwrap()).collect();
        let mut serving: Vec<_> = slots.iter().map(|s| Busy(s.clone()).serving()).collect();
        for (s, since) in serving.iter_mut().zip([30, 10, 20]) {
            s.writing();
            s.slot.writing_since.store(since, Ordering::Release);
        }
        assert!(!evictable(&slots[1]), "writing: not idle");
        assert!(t.admit().is_some(), "a response stuck writing makes room");
        let evicted: Vec<_> = slots
            .iter()
            .map(|s| s.evicted.load(Ordering::Acquire))
            .collect();
        assert_eq!(evicted, [false, true, false], "the one writing the longest");
        // A handler running on a connection keeps it, whatever else it writes.
        let handler = Busy(slots[0].clone()).serving();
        assert_eq!(slots[0].stuck_writing(), None);
        drop(serving);
        assert!(evictable(&slots[2]) && !evictable(&slots[0]));
        drop(handler);
        assert!(evictable(&slots[0]));
    }
}
