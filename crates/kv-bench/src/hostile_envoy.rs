//! `kv-bench hostile --attacks`: uploads held in the Envoy in front of the router. A real Envoy
//! runs a bundled config (its overload manager included) and 400 clients each send 2 MiB of a
//! body that never completes. Envoy's own RSS is sampled every 50 ms from /proc and reported,
//! in the attack's note, against Envoy's documented worst case (docs/operations.md, "Memory
//! bounds", `[envoy]`): its peak while the uploads are held, and once they closed.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{proc_rss, stalled_uploads, Held};
use kv_testkit::deploy::EnvoyProc;

/// One Envoy config under the flood.
pub struct Flood {
    /// The attack's name (what `--only` matches).
    pub name: &'static str,
    /// The bundled config under `envoy/`.
    file: &'static str,
}

pub const BUFFERED: Flood = Flood {
    name: "Envoy's RSS, BUFFERED config: 400 held uploads, 2 MiB sent each",
    file: "override-host-buffered.yaml",
};

pub const FULL_DUPLEX: Flood = Flood {
    name: "Envoy's RSS, FULL_DUPLEX config: 400 held uploads, 2 MiB sent each",
    file: "gie-full-duplex.yaml",
};

const CONNS: usize = 400;
const SENT: usize = 2 << 20;

const MIB: f64 = (1u64 << 20) as f64;

/// Envoy's documented worst case, bytes (None: docs/operations.md has none).
fn documented_bound() -> Option<u64> {
    kv_testkit::memory_bounds::documented(&kv_testkit::repo_root())
        .ok()?
        .into_iter()
        .find(|b| b.component == "envoy")
        .map(|b| b.bound)
}

/// The overload manager's counters from Envoy's admin `/stats`: streams reset for memory,
/// requests refused, connections refused.
async fn overload_stats(admin: SocketAddr) -> String {
    let read = async {
        let mut s = TcpStream::connect(admin).await.ok()?;
        s.write_all(b"GET /stats?filter=(overload|idle_timeout|heap) HTTP/1.0\r\n\r\n")
            .await
            .ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).await.ok()?;
        Some(text)
    };
    let text = tokio::time::timeout(Duration::from_secs(2), read)
        .await
        .ok()
        .flatten()
        .unwrap_or_default();
    let sum = |suffix: &str| -> u64 {
        text.lines()
            .filter_map(|l| l.split_once(": "))
            .filter(|(k, _)| k.ends_with(suffix))
            .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
            .sum()
    };
    format!(
        "overload manager: {} streams reset for memory, {} idle streams reset, {} requests and {} \
         connections refused, heap pressure now {} %",
        sum("reset_high_memory_stream.count"),
        sum("http.llm.downstream_rq_idle_timeout"),
        sum("http.llm.downstream_rq_overload_close") + sum("http.llm.rq_overload_local_reply"),
        sum("downstream_cx_overload_reject"),
        sum("fixed_heap.pressure"),
    )
}

/// Starts Envoy with `flood`'s config in front of `picker` and `pod`, holds [`CONNS`] uploads of
/// [`SENT`] bytes each (announcing 64 KiB more, so none completes) for `hold`, closes them and
/// waits up to 30 s for Envoy's RSS to come back within 20 % of its start. Everything happens
/// before this returns; the note carries Envoy's figures.
pub async fn held_uploads(
    bin: &Path,
    root: &Path,
    flood: &Flood,
    picker: SocketAddr,
    pod: SocketAddr,
    hold: Duration,
) -> (Held, Arc<parking_lot::Mutex<String>>) {
    let note = Arc::new(parking_lot::Mutex::new(String::new()));
    let mut envoy = match EnvoyProc::spawn(bin, &root.join(flood.file), Some(picker), &[pod]).await
    {
        Ok(e) => e,
        Err(e) => {
            *note.lock() = format!("Envoy did not start: {e:#}");
            return (Held(Vec::new()), note);
        }
    };
    let Some(pid) = envoy.process().pid() else {
        *note.lock() = "Envoy exited at start".into();
        return (Held(Vec::new()), note);
    };
    let before = proc_rss(pid);
    let peak = Arc::new(AtomicU64::new(before));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, stop) = (peak.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(proc_rss(pid), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{{\"model\": \"m\", \"prompt\": \"",
        SENT + (64 << 10)
    );
    let (uploads, seen) = stalled_uploads(envoy.listen, CONNS, head, SENT, 64 << 10).await;
    // The uploads' own note is written 6 s in.
    tokio::time::sleep(hold.max(Duration::from_secs(7))).await;
    let seen = seen.lock().clone();
    let stats = overload_stats(envoy.admin).await;
    drop(uploads);
    let t = Instant::now();
    let mut after = proc_rss(pid);
    while after as f64 > before as f64 * 1.2 && t.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        after = proc_rss(pid);
    }
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    let peak = peak.load(Ordering::Relaxed);
    let alive = envoy.process().exited().is_none();
    let verdict = match documented_bound() {
        Some(b) if peak <= b => format!("within its documented bound {:.0} MiB", b as f64 / MIB),
        Some(b) => format!("OVER its documented bound {:.0} MiB", b as f64 / MIB),
        None => "docs/operations.md documents no [envoy] bound".into(),
    };
    *note.lock() = format!(
        "Envoy RSS {:.0} MiB before, peak {:.0} MiB ({verdict}), {:.0} MiB {:.0} s after the \
         uploads closed{}; {stats}; clients: {seen}",
        before as f64 / MIB,
        peak as f64 / MIB,
        after as f64 / MIB,
        t.elapsed().as_secs_f64(),
        if alive { "" } else { "; ENVOY EXITED" },
    );
    eprintln!("kv-bench hostile: {}: {}", flood.name, note.lock());
    drop(envoy);
    (Held(Vec::new()), note)
}
