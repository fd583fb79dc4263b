//! The admin-port and file-descriptor attacks of `kv-bench hostile --attacks`: responses nobody
//! reads (an HTTP/2 zero flow-control window, an HTTP/1.1 reader taking a byte a second), and a
//! router started under a low `ulimit -n` flooded with preface-only gRPC connections.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use super::{measure, stalled_uploads, Held, Session};
use kv_testkit::deploy::{Binaries, RouterProc};

type Note = Arc<parking_lot::Mutex<String>>;

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

/// The router's `kv_router_connections_open{port="admin"}`, asked like a scraper would.
async fn admin_open(admin: SocketAddr) -> Option<u64> {
    let ask = async {
        let mut s = TcpStream::connect(admin).await.ok()?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        let text = String::from_utf8_lossy(&out).into_owned();
        let series = r#"kv_router_connections_open{port="admin"} "#;
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()
        .flatten()
}

/// `conns` attackers each running `one` (which returns once the router closed its connection)
/// again and again; the note counts the closes and the most admin connections the router had open.
fn reconnecting<F, Fut>(admin: SocketAddr, conns: usize, what: &'static str, one: F) -> (Held, Note)
where
    F: Fn() -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let note = Note::default();
    let closed = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let (one, closed) = (one.clone(), closed.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                one().await;
                closed.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }));
    }
    let n = note.clone();
    tasks.push(tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            if let Some(open) = admin_open(admin).await {
                peak.fetch_max(open, Ordering::Relaxed);
            }
            *n.lock() = format!(
                "{conns} conns {what}; {} closed by the router and reopened; at most {} admin connections open (the router's gauge)",
                closed.load(Ordering::Relaxed),
                peak.load(Ordering::Relaxed)
            );
        }
    }));
    (Held(tasks), note)
}

/// HTTP/2 connections that ask `/metrics` with a zero flow-control window (so no byte of the
/// body can be sent) and hold it; a closed one reconnects.
pub(super) async fn h2_zero_window(admin: SocketAddr, conns: usize) -> (Held, Note) {
    let hello: Arc<[u8]> = zero_window_get_metrics().into();
    reconnecting(admin, conns, "asking /metrics with window 0", move || {
        let hello = hello.clone();
        async move {
            let Ok(mut s) = TcpStream::connect(admin).await else {
                return;
            };
            if s.write_all(&hello).await.is_err() {
                return;
            }
            // Reading frames gives the router no window: it only tells when it closes.
            let mut buf = vec![0u8; 16 << 10];
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        }
    })
}

/// HTTP/1.1 connections that ask `/metrics` with a 4 KiB receive buffer and read a byte a
/// second; a closed one reconnects.
pub(super) async fn slow_read(admin: SocketAddr, conns: usize) -> (Held, Note) {
    reconnecting(
        admin,
        conns,
        "reading /metrics a byte a second",
        move || async move {
            let Ok(socket) = TcpSocket::new_v4() else {
                return;
            };
            let _ = socket.set_recv_buffer_size(4096);
            let Ok(mut s) = socket.connect(admin).await else {
                return;
            };
            if s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .is_err()
            {
                return;
            }
            let mut b = [0u8; 1];
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                match tokio::time::timeout(Duration::from_secs(1), s.read(&mut b)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return,
                    _ => {}
                }
            }
        },
    )
}

/// A second router, started by `sh` after `ulimit -n nofile`, flooded with `conns` connections
/// that send only the HTTP/2 preface; measured like the others (probes on its ports).
pub(super) async fn fd_limit(
    s: &mut Session<'_>,
    bins: &Binaries,
    nofile: u64,
    conns: usize,
) -> Result<()> {
    let name = format!(
        "fd-limit: router under ulimit -n {nofile}, {conns} gRPC conns sending only the preface"
    );
    if !s.wants(&name) {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("kv-router");
    let body = format!(
        "#!/bin/sh\nulimit -n {nofile} || exit 1\nexec '{}' \"$@\"\n",
        bins.kv_router.display()
    );
    std::fs::write(&script, body)?;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
    // The default cap, which alone once exceeded a 1,024 descriptor limit.
    let mut cfg = s.cfg.clone();
    cfg.server.max_connections = 10_000;
    let mut router = RouterProc::spawn_without(&script, &cfg, s.omit).await?;
    router.wait_pods_ready(1, Duration::from_secs(20)).await?;
    let caps = router.debug_pods().await?["connections"].clone();
    let pid = router.process().pid().context("router pid")?;
    let preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_string();
    let flood = stalled_uploads(router.grpc, conns, preface, 0, 1);
    let ports = (router.admin, router.grpc);
    let mut r = measure(&name, pid, ports, s.bound, s.hold, flood).await;
    r.note = format!(
        "{}; caps in force: gRPC {}, admin {}",
        r.note, caps["grpc_max_connections"], caps["admin_max_connections"]
    );
    s.results.push(r);
    Ok(())
}
