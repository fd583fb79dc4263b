//! `kv-bench hostile`: the router's memory under traffic built to grow it. Starts vllm-sim pods
//! and the real kv-router binary, speaks ext_proc to it directly (as Envoy would, without Envoy
//! in the way), and samples the router's RSS after each phase: a million unique prompts, session
//! ids, model names and `cache_salt`s, then thousands of streams each holding a large unfinished
//! body. Every figure is the router process's own VmRSS/VmHWM from /proc.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use super::extproc_client::{body, headers, message};
use super::table::{Style, Table};
use kv_testkit::deploy::{local_router_config, Binaries, RouterProc, SimPod};

/// What to send.
#[derive(Debug, Clone)]
pub struct HostileOptions {
    /// Requests per unique-value phase.
    pub requests: usize,
    /// Concurrent ext_proc streams while sending them.
    pub concurrency: usize,
    /// Streams that each hold an unfinished body in the last phase.
    pub held_streams: usize,
    /// Body bytes each of them holds.
    pub held_bytes: usize,
    /// Simulated pods behind the router.
    pub pods: usize,
}

/// The router's memory after one phase.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseResult {
    /// What was sent.
    pub phase: String,
    /// Streams opened.
    pub streams: usize,
    /// Streams answered with an immediate HTTP reply instead of a route (404 unknown model, 503).
    pub rejected: u64,
    /// Streams that got no reply or a gRPC error.
    pub failed: u64,
    /// Streams per second.
    pub rate: f64,
    /// VmRSS after the phase, bytes.
    pub rss: u64,
    /// VmHWM (peak RSS) so far, bytes.
    pub peak: u64,
}

/// VmRSS and VmHWM of `pid`, bytes.
pub(crate) fn rss(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let kb = |field: &str| {
        status
            .lines()
            .find_map(|l| {
                l.strip_prefix(field)?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .map(|k| k * 1024)
            .unwrap_or(0)
    };
    Ok((kb("VmRSS:"), kb("VmHWM:")))
}

/// One unique-value phase: the i-th request's extra headers and JSON body.
type Request = fn(usize) -> (Vec<(&'static str, String)>, serde_json::Value);

/// A 2 KB prompt no other request shares (128 blocks of 16 tokens, roughly).
fn unique_prompt(i: usize) -> (Vec<(&'static str, String)>, serde_json::Value) {
    let prompt = format!("{i:08} ").repeat(2048 / 9);
    (vec![], serde_json::json!({"model": "m", "prompt": prompt}))
}

fn unique_session(i: usize) -> (Vec<(&'static str, String)>, serde_json::Value) {
    let h = vec![("x-session-id", format!("session-{i:08}"))];
    (
        h,
        serde_json::json!({"model": "m", "prompt": "the same short prompt"}),
    )
}

fn unique_model(i: usize) -> (Vec<(&'static str, String)>, serde_json::Value) {
    (
        vec![],
        serde_json::json!({"model": format!("model-{i:08}"), "prompt": "hello"}),
    )
}

fn unique_salt(i: usize) -> (Vec<(&'static str, String)>, serde_json::Value) {
    let b = serde_json::json!({"model": "m", "prompt": "the same short prompt", "cache_salt": format!("salt-{i:08}")});
    (vec![], b)
}

/// What one stream got back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// A routing decision.
    Routed,
    /// An immediate HTTP reply (e.g. 404 for a model no pod serves).
    Rejected,
    /// No reply, or a gRPC error.
    Failed,
}

/// Sends one whole request on its own stream and says what came back.
async fn one(client: &mut ExternalProcessorClient<Channel>, req: Request, i: usize) -> Outcome {
    let (extra, json) = req(i);
    let (tx, rx) = mpsc::channel(4);
    let Ok(resp) = client.process(ReceiverStream::new(rx)).await else {
        return Outcome::Failed;
    };
    let mut replies = resp.into_inner();
    let body_bytes = serde_json::to_vec(&json).expect("json");
    let _ = tx
        .send(message(headers(&extra), Some(BodySendMode::Buffered)))
        .await;
    let _ = tx.send(message(body(body_bytes, true), None)).await;
    // The headers reply, then the body reply that carries the decision (or an immediate reply).
    for _ in 0..2 {
        match tokio::time::timeout(Duration::from_secs(10), replies.next()).await {
            Ok(Some(Ok(r))) => match r.response {
                Some(Out::ImmediateResponse(_)) => return Outcome::Rejected,
                Some(_) => {}
                None => return Outcome::Failed,
            },
            _ => return Outcome::Failed,
        }
    }
    Outcome::Routed
}

/// Sends the phase's requests; (rejected, failed, streams per second).
async fn phase(channels: &[Channel], opts: &HostileOptions, req: Request) -> (u64, u64, f64) {
    let next = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let rejected = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..opts.concurrency {
        let mut client = ExternalProcessorClient::new(channels[w % channels.len()].clone());
        let (next, failed, n) = (next.clone(), failed.clone(), opts.requests as u64);
        let rejected = rejected.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                match one(&mut client, req, i as usize).await {
                    Outcome::Routed => {}
                    Outcome::Rejected => _ = rejected.fetch_add(1, Ordering::Relaxed),
                    Outcome::Failed => _ = failed.fetch_add(1, Ordering::Relaxed),
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let secs = start.elapsed().as_secs_f64();
    (
        rejected.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        opts.requests as f64 / secs,
    )
}

/// Opens `held_streams` FULL_DUPLEX streams that each send `held_bytes` of body without ending
/// it, samples RSS while they are held, then closes them all.
async fn held_bodies(
    channels: &[Channel],
    opts: &HostileOptions,
    pid: u32,
) -> Result<(PhaseResult, PhaseResult)> {
    let start = Instant::now();
    let mut held = Vec::new();
    let chunk = vec![b' '; opts.held_bytes];
    let mut refused = 0u64;
    for i in 0..opts.held_streams {
        let mut client = ExternalProcessorClient::new(channels[i % channels.len()].clone());
        let (tx, rx) = mpsc::channel(4);
        let resp = client.process(ReceiverStream::new(rx)).await;
        let Ok(resp) = resp else {
            refused += 1;
            continue;
        };
        let _ = tx
            .send(message(
                headers(&[]),
                Some(BodySendMode::FullDuplexStreamed),
            ))
            .await;
        let _ = tx.send(message(body(chunk.clone(), false), None)).await;
        held.push((tx, resp.into_inner()));
    }
    // Let the router take in what was sent; a refused chunk shows up as an immediate 503.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut answered = 0u64;
    for (_, replies) in held.iter_mut() {
        while let Ok(Some(Ok(r))) =
            tokio::time::timeout(Duration::from_millis(1), replies.next()).await
        {
            if r.response.is_some() {
                answered += 1;
            }
        }
    }
    let (rss_held, peak) = rss(pid)?;
    let holding = PhaseResult {
        phase: format!(
            "{} streams holding {} KiB each",
            opts.held_streams,
            opts.held_bytes / 1024,
        ),
        streams: opts.held_streams,
        rejected: answered,
        failed: refused,
        rate: opts.held_streams as f64 / start.elapsed().as_secs_f64(),
        rss: rss_held,
        peak,
    };
    drop(held);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (rss_after, peak) = rss(pid)?;
    let closed = PhaseResult {
        phase: "5 s after they closed".into(),
        streams: 0,
        rejected: 0,
        failed: 0,
        rate: 0.0,
        rss: rss_after,
        peak,
    };
    Ok((holding, closed))
}

/// Runs every phase against one router and returns the RSS after each.
pub async fn run(bins: &Binaries, opts: &HostileOptions) -> Result<Vec<PhaseResult>> {
    let sim_args: Vec<String> = ["--ttft-base-ms", "1", "--model", "m"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let pods: Vec<SimPod> = (0..opts.pods)
        .map(|_| SimPod::spawn(&bins.vllm_sim, &sim_args))
        .collect::<Result<_>>()?;
    let addrs: Vec<_> = pods.iter().map(|p| p.addr).collect();
    let cfg = local_router_config(&addrs)?;
    let mut router = RouterProc::spawn(&bins.kv_router, &cfg).await?;
    router
        .wait_pods_ready(opts.pods, Duration::from_secs(20))
        .await?;
    let pid = router.process().pid().context("router pid")?;
    let mut channels = Vec::new();
    for _ in 0..4 {
        channels.push(
            Channel::from_shared(format!("http://{}", router.grpc))?
                .connect()
                .await
                .context("connecting to kv-router")?,
        );
    }
    let (rss0, peak0) = rss(pid)?;
    let mut out = vec![PhaseResult {
        phase: "started, pods ready".into(),
        streams: 0,
        rejected: 0,
        failed: 0,
        rate: 0.0,
        rss: rss0,
        peak: peak0,
    }];
    let phases: [(&str, Request); 4] = [
        ("unique 2 KB prompts", unique_prompt),
        ("unique session ids", unique_session),
        ("unique model names", unique_model),
        ("unique cache_salts", unique_salt),
    ];
    for (name, req) in phases {
        let (rejected, failed, rate) = phase(&channels, opts, req).await;
        let (rss, peak) = rss(pid)?;
        eprintln!(
            "kv-bench hostile: {name}: {rate:.0}/s, RSS {} MiB",
            rss >> 20
        );
        out.push(PhaseResult {
            phase: format!("+ {} {name}", opts.requests),
            streams: opts.requests,
            rejected,
            failed,
            rate,
            rss,
            peak,
        });
    }
    // Twice: a second round that peaks no higher shows the first round's memory is reused (kept
    // by the allocator), not leaked.
    for round in ["", "again: "] {
        let (mut holding, mut closed) = held_bodies(&channels, opts, pid).await?;
        holding.phase.insert_str(0, round);
        closed.phase.insert_str(0, round);
        out.push(holding);
        out.push(closed);
    }
    if router.process().exited().is_some() {
        bail!(
            "kv-router exited during the run:\n{}",
            router.stderr_tail(20)
        );
    }
    Ok(out)
}

/// The results as a table.
pub fn table(results: &[PhaseResult], style: Style) -> String {
    let mut t = Table::new([
        "after",
        "streams",
        "rejected",
        "failed",
        "streams/s",
        "RSS",
        "peak RSS",
    ])
    .left(0);
    let mib = |b: u64| format!("{:.0} MiB", b as f64 / (1 << 20) as f64);
    for r in results {
        t.row(vec![
            r.phase.clone(),
            r.streams.to_string(),
            r.rejected.to_string(),
            r.failed.to_string(),
            if r.rate > 0.0 {
                format!("{:.0}", r.rate)
            } else {
                "".into()
            },
            mib(r.rss),
            mib(r.peak),
        ]);
    }
    t.render(style)
}
