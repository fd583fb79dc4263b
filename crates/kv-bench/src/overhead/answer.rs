//! The processor's own answer time, without Envoy: a client speaks ext_proc straight to the no-op
//! processor and to each kv-router (one gRPC connection, a stream per request, as Envoy does),
//! sends the request headers in BUFFERED mode, waits for their reply, then times the body from
//! sending it to the reply that carries the decision. What Envoy adds on top (buffering the body,
//! encoding it, its own scheduling) is the same for every processor; this isolates what differs.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use super::super::extproc_client::{body, headers, message};
use super::super::report::percentile;
use super::super::table::{Style, Table};
use super::PathKind;

/// How long one answer may take before the pass gives up on the processor.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// One (processor, prompt size) cell of the pass.
#[derive(Debug, Clone, Serialize)]
pub struct AnswerCell {
    /// The processor, named by the Envoy path it serves (`envoy-noop-ext-proc`, …).
    pub path: PathKind,
    /// Bytes of prompt text.
    pub prompt_bytes: usize,
    /// Timed requests.
    pub requests: usize,
    /// Body sent → body reply, median, microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// p50 minus the no-op processor's p50 for the same size, microseconds.
    pub over_noop_p50_us: Option<f64>,
}

/// A processor the pass times.
pub(super) struct Target {
    pub(super) path: PathKind,
    pub(super) addr: SocketAddr,
}

/// Times `requests` answers per target for each body size (`bodies[i]` are one size's bodies),
/// in `rounds` rounds whose target order rotates; `warmup` untimed answers start each round.
pub(super) async fn measure(
    targets: &[Target],
    bodies: &[(usize, Vec<Bytes>)],
    requests: usize,
    rounds: usize,
    warmup: usize,
) -> Result<Vec<AnswerCell>> {
    let mut clients = Vec::new();
    for t in targets {
        let ch = Channel::from_shared(format!("http://{}", t.addr))?
            .connect()
            .await
            .with_context(|| format!("connecting to {}", t.path.label()))?;
        clients.push(ExternalProcessorClient::new(ch).max_decoding_message_size(usize::MAX));
    }
    let mut cells = Vec::new();
    for (size, bodies) in bodies {
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
        let rounds = rounds.max(1);
        for round in 0..rounds {
            let n = super::round_share(requests, rounds, round);
            for k in 0..targets.len() {
                let t = (round + k) % targets.len();
                let client = &mut clients[t];
                for i in 0..warmup + n {
                    let b = bodies[i % bodies.len()].clone();
                    let took = answer(client, b)
                        .await
                        .with_context(|| format!("{} answering", targets[t].path.label()))?;
                    if i >= warmup {
                        samples[t].push(took.as_secs_f64() * 1e6);
                    }
                }
            }
        }
        let mut row: Vec<AnswerCell> = targets
            .iter()
            .zip(samples)
            .map(|(t, mut s)| AnswerCell {
                path: t.path,
                prompt_bytes: *size,
                requests: s.len(),
                p50_us: percentile(&mut s, 50.0),
                p99_us: percentile(&mut s, 99.0),
                over_noop_p50_us: None,
            })
            .collect();
        let noop = row
            .iter()
            .find(|c| c.path == PathKind::EnvoyNoopExtProc)
            .map(|c| c.p50_us);
        for c in &mut row {
            c.over_noop_p50_us = noop.map(|n| c.p50_us - n);
        }
        cells.extend(row);
    }
    Ok(cells)
}

/// One request on its own stream: headers (answered first), then the timed body.
async fn answer(client: &mut ExternalProcessorClient<Channel>, json: Bytes) -> Result<Duration> {
    let (tx, rx) = mpsc::channel(2);
    tx.send(message(headers(&[]), Some(BodySendMode::Buffered)))
        .await?;
    let mut replies = client
        .process(ReceiverStream::new(rx))
        .await
        .context("opening the stream")?
        .into_inner();
    let mut next = async || -> Result<Out> {
        let r = tokio::time::timeout(ANSWER_TIMEOUT, replies.next())
            .await
            .context("no reply in time")?
            .context("the stream ended")??;
        r.response.context("an empty reply")
    };
    anyhow::ensure!(
        matches!(next().await?, Out::RequestHeaders(_)),
        "the headers were not answered with a headers reply"
    );
    let started = Instant::now();
    tx.send(message(body(json.to_vec(), true), None)).await?;
    let reply = next().await?;
    let took = started.elapsed();
    anyhow::ensure!(
        matches!(reply, Out::RequestBody(_)),
        "the body was not answered with a body reply"
    );
    Ok(took)
}

/// The pass as a markdown table with a line on how it was measured.
pub(super) fn markdown(cells: &[AnswerCell]) -> String {
    let mut t = Table::new([
        "prompt",
        "processor",
        "requests",
        "p50 µs",
        "p99 µs",
        "p50 over no-op µs",
    ])
    .left(2);
    for c in cells {
        t.row(vec![
            super::size_label(c.prompt_bytes),
            c.path.label().trim_start_matches("envoy-").to_string(),
            c.requests.to_string(),
            super::num(c.p50_us, 0),
            super::num(c.p99_us, 0),
            c.over_noop_p50_us
                .map_or("–".into(), |v| format!("{v:+.0}")),
        ]);
    }
    let mut s = t.render(Style::Markdown);
    s.push_str(
        "\nAnswer time at the processor (ext_proc straight from a client, no Envoy; one request \
         at a time, a stream per request on one connection): request body sent → the body reply \
         carrying the decision received.\n",
    );
    s
}
