//! The admin port under floods of connections that never read their responses.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::watch;

use super::{serve, Limits};
use crate::server::conns::ConnMetrics;

const CAP: usize = 16;
const WRITE: Duration = Duration::from_secs(1);

/// An admin port with a `/metrics` of `metrics_bytes`, a cap of [`CAP`] and a write deadline of
/// [`WRITE`]; its open-connections gauge reads back through the returned registry.
async fn port(metrics_bytes: usize) -> (SocketAddr, Registry, watch::Sender<bool>) {
    let body = Bytes::from(vec![b'#'; metrics_bytes]);
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(move || async move { body.clone() }));
    let mut registry = Registry::default();
    let metrics = ConnMetrics::register(&mut registry);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = Limits {
        max_connections: CAP,
        header_read_timeout: Duration::from_secs(2),
        write_timeout: WRITE,
    };
    let (stop, stopping) = watch::channel(false);
    tokio::spawn(serve(listener, app, metrics, limits, stopping));
    (addr, registry, stop)
}

/// Admin connections open now, from the `connections_open` gauge.
fn open(registry: &Registry) -> usize {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with(r#"connections_open{port="admin"}"#));
    let value = line.and_then(|l| l.rsplit(' ').next()?.parse().ok());
    value.unwrap_or(0)
}

/// `GET /healthz` on a fresh connection, retried until it answers 200; how long that took.
async fn healthz_answers(addr: SocketAddr, within: Duration) -> Result<Duration, String> {
    let started = Instant::now();
    let mut last = String::new();
    while started.elapsed() < within {
        let try_once = async {
            let mut s = TcpStream::connect(addr).await.ok()?;
            let req = b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
            s.write_all(req).await.ok()?;
            let mut out = Vec::new();
            s.read_to_end(&mut out).await.ok()?;
            Some(String::from_utf8_lossy(&out).into_owned())
        };
        match tokio::time::timeout(Duration::from_millis(500), try_once).await {
            Ok(Some(r)) if r.starts_with("HTTP/1.1 200") => return Ok(started.elapsed()),
            other => last = format!("{other:?}"),
        }
    }
    Err(last)
}

/// Waits until every connection in `conns` was closed by the server (EOF or reset), or `within`.
async fn all_closed(conns: &mut [TcpStream], within: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + within;
    let mut closed = 0;
    for c in conns.iter_mut() {
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match tokio::time::timeout_at(deadline, c.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    closed += 1;
                    break;
                }
                Ok(Ok(_)) => continue,
                Err(_) => return closed,
            }
        }
    }
    closed
}

/// The HTTP/2 preface, SETTINGS with INITIAL_WINDOW_SIZE 0, and `GET /metrics` on stream 1.
fn zero_window_get_metrics() -> Vec<u8> {
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend_from_slice(&[0, 0, 6, 4, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0]);
    // HPACK: :method GET, :scheme http, :path /metrics, :authority x.
    let mut block = vec![0x82, 0x86, 0x44, 8];
    block.extend_from_slice(b"/metrics");
    block.extend_from_slice(&[0x41, 1, b'x']);
    // HEADERS, END_STREAM | END_HEADERS, stream 1.
    out.extend_from_slice(&[0, 0, block.len() as u8, 1, 5, 0, 0, 0, 1]);
    out.extend_from_slice(&block);
    out
}

/// More HTTP/2 connections than the cap, each asking `/metrics` with a zero flow-control window,
/// so no response can be written: they held every slot as serving, and `/healthz` was refused
/// for as long as they stayed. Now a fresh probe is answered (at the cap a stuck response makes
/// room), and each stuck one is closed by its write deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_responses_stuck_on_a_zero_window_never_starve_healthz() {
    let (addr, registry, _stop) = port(64 << 10).await;
    let hello = zero_window_get_metrics();
    let mut flood = Vec::new();
    for _ in 0..CAP + 8 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&hello).await.unwrap();
        flood.push(s);
    }
    let answered = healthz_answers(addr, WRITE + Duration::from_secs(2)).await;
    assert!(answered.is_ok(), "/healthz behind the flood: {answered:?}");
    let now = within_cap(&registry).await;
    assert!(now <= CAP, "{now} open");
    // Every stuck response's connection closes once its write deadline passed.
    let closed = all_closed(&mut flood, WRITE + Duration::from_secs(3)).await;
    assert_eq!(
        closed,
        flood.len(),
        "connections still open past the write deadline"
    );
}

/// More HTTP/1.1 connections than the cap, each asking a large `/metrics` and never reading it:
/// an evicted one blocked writing never noticed its eviction, so more stayed open than the cap.
/// Now the open count stays within the cap, `/healthz` is answered, and each is closed by the
/// write deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_readers_that_never_read_stay_within_the_cap() {
    let (addr, registry, _stop) = port(8 << 20).await;
    let mut flood = Vec::new();
    let mut most = 0;
    for _ in 0..CAP + 8 {
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut s = socket.connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        flood.push(s);
        most = most.max(within_cap(&registry).await);
    }
    let answered = healthz_answers(addr, WRITE + Duration::from_secs(2)).await;
    assert!(answered.is_ok(), "/healthz behind the flood: {answered:?}");
    most = most.max(within_cap(&registry).await);
    assert!(most <= CAP, "{most} admin connections open, cap {CAP}");
    // Not one read: the router closes them all once their writes waited past the deadline.
    let deadline = Instant::now() + WRITE + Duration::from_secs(3);
    while open(&registry) > 0 {
        assert!(
            Instant::now() < deadline,
            "{} connections still open past the write deadline",
            open(&registry)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(flood);
}

/// The open count once it is within the cap, or after 1 s: an evicted connection is closed by
/// its own task a moment after the new one is admitted, so the count may pass the cap by the
/// ones closing (before, an evicted connection blocked writing never closed).
async fn within_cap(registry: &Registry) -> usize {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let n = open(registry);
        if n <= CAP || Instant::now() >= deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
