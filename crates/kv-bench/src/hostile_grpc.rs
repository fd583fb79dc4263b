//! The gRPC port's stream and message attacks (`kv-bench hostile --attacks`): stalled ext_proc
//! messages, stalled Pick uploads while ext_proc requests keep coming, and a flood of open
//! ext_proc streams.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use super::{open_stalled, pick_flood, Held};
use crate::extproc_client::{body, headers, message};

type Note = Arc<parking_lot::Mutex<String>>;

const PROCESS: &str = "http://x/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// Counters an attack's note is written from.
#[derive(Default)]
struct Counts([AtomicUsize; 4]);

impl Counts {
    fn add(&self, i: usize) {
        self.0[i].fetch_add(1, Ordering::Relaxed);
    }

    fn get(&self, i: usize) -> usize {
        self.0[i].load(Ordering::Relaxed)
    }
}

/// Rewrites `note` from `write` every 500 ms while the attack lasts.
fn keep_noting(
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
    note: &Note,
    write: impl Fn() -> String + Send + 'static,
) {
    let note = note.clone();
    tasks.push(tokio::spawn(async move {
        loop {
            *note.lock() = write();
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }));
}

/// `streams` ext_proc streams on one connection, each announcing an `announce`-byte message and
/// sending `send` bytes of it, then stalling: how many were refused at once (an immediate reply),
/// how many the router ended at its message deadline (DEADLINE_EXCEEDED), how many it still holds.
pub(super) async fn extproc_stalled_messages(
    grpc: SocketAddr,
    streams: usize,
    announce: u32,
    send: usize,
) -> (Held, Note) {
    let note = Note::default();
    // refused at once, ended by the deadline, ended otherwise
    let counts = Arc::new(Counts::default());
    let mut tasks = Vec::new();
    let mut data = vec![0u8];
    data.extend_from_slice(&announce.to_be_bytes());
    data.resize(5 + send, b' ');
    let data = Bytes::from(data);
    let c = counts.clone();
    tasks.push(tokio::spawn(async move {
        let Ok(tcp) = TcpStream::connect(grpc).await else {
            return;
        };
        let Ok((client, conn)) = h2::client::handshake(tcp).await else {
            return;
        };
        tokio::spawn(conn);
        let mut held = Vec::new();
        let mut answers = Vec::new();
        for _ in 0..streams {
            let Some((resp, body)) = open_stalled(&client, PROCESS, &data).await else {
                break;
            };
            held.push(body);
            answers.push(resp);
        }
        let answered = answers.into_iter().map(|resp| {
            let c = c.clone();
            async move {
                let Ok(resp) = resp.await else {
                    return c.add(2);
                };
                let mut body = resp.into_body();
                // A reply within 2 s is a refusal (ext_proc's 503); a held stream gets none.
                let first = tokio::time::timeout(Duration::from_secs(2), body.data()).await;
                if let Ok(Some(Ok(_))) = first {
                    return c.add(0);
                }
                while let Some(Ok(d)) = body.data().await {
                    let _ = body.flow_control().release_capacity(d.len());
                }
                let status = body.trailers().await.ok().flatten();
                let status = status.as_ref().and_then(|t| t.get("grpc-status"));
                c.add(if status.is_some_and(|s| s == "4") {
                    1
                } else {
                    2
                });
            }
        });
        futures::future::join_all(answered).await;
        std::future::pending::<()>().await;
        drop(held);
    }));
    keep_noting(&mut tasks, &note, move || {
        format!(
            "{streams} ext_proc streams of {} MiB announced, {} KiB sent: {} refused at once (503), {} ended at the message deadline (DEADLINE_EXCEEDED), {} ended otherwise",
            announce >> 20,
            send >> 10,
            counts.get(0),
            counts.get(1),
            counts.get(2)
        )
    });
    (Held(tasks), note)
}

/// One whole BUFFERED ext_proc request with a `prompt_bytes` prompt: whether it was routed.
async fn routed(client: &mut ExternalProcessorClient<Channel>, prompt_bytes: usize) -> bool {
    let (tx, rx) = mpsc::channel(4);
    let Ok(resp) = client.process(ReceiverStream::new(rx)).await else {
        return false;
    };
    let mut replies = resp.into_inner();
    let json = serde_json::json!({"model": "m", "prompt": "p".repeat(prompt_bytes)});
    let body_bytes = serde_json::to_vec(&json).unwrap_or_default();
    let _ = tx
        .send(message(headers(&[]), Some(BodySendMode::Buffered)))
        .await;
    let _ = tx.send(message(body(body_bytes, true), None)).await;
    for _ in 0..2 {
        match tokio::time::timeout(Duration::from_secs(5), replies.next()).await {
            Ok(Some(Ok(r))) if !matches!(r.response, Some(Out::ImmediateResponse(_)) | None) => {}
            _ => return false,
        }
    }
    true
}

/// Pick streams stalling on `announce`-byte messages while an ext_proc client sends whole
/// requests with 1 MiB prompts, one after another: how many were routed.
pub(super) async fn pick_holds_budget(
    grpc: SocketAddr,
    streams: usize,
    announce: u32,
    send: usize,
) -> (Held, Note) {
    let (mut flood, pick_note) = pick_flood(grpc, 1, streams, announce, send).await;
    let mut tasks = std::mem::take(&mut flood.0);
    let note = Note::default();
    // routed, not routed
    let counts = Arc::new(Counts::default());
    let c = counts.clone();
    tasks.push(tokio::spawn(async move {
        // The flood's streams first, as an attacker holding the budget would.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Ok(channel) = Channel::from_shared(format!("http://{grpc}")) else {
            return;
        };
        let Ok(channel) = channel.connect().await else {
            return;
        };
        let mut client = ExternalProcessorClient::new(channel);
        loop {
            c.add(if routed(&mut client, 1 << 20).await {
                0
            } else {
                1
            });
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }));
    keep_noting(&mut tasks, &note, move || {
        format!(
            "{}; ext_proc beside it (1 MiB prompts): {} routed, {} refused or failed",
            pick_note.lock(),
            counts.get(0),
            counts.get(1)
        )
    });
    (Held(tasks), note)
}

/// `conns` connections opening `streams` ext_proc streams each, every one sending its request
/// headers and then nothing: how many were established (a headers reply) and how many refused.
pub(super) async fn extproc_stream_flood(
    grpc: SocketAddr,
    conns: usize,
    streams: usize,
) -> (Held, Note) {
    let note = Note::default();
    // established, refused (RESOURCE_EXHAUSTED), failed otherwise
    let counts = Arc::new(Counts::default());
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let c = counts.clone();
        tasks.push(tokio::spawn(async move {
            let Ok(channel) = Channel::from_shared(format!("http://{grpc}")) else {
                return;
            };
            let Ok(channel) = channel.connect().await else {
                return;
            };
            let opened = (0..streams).map(|_| {
                let mut client = ExternalProcessorClient::new(channel.clone());
                let c = c.clone();
                async move {
                    let (tx, rx) = mpsc::channel::<ProcessingRequest>(1);
                    let _ = tx
                        .send(message(
                            headers(&[]),
                            Some(BodySendMode::FullDuplexStreamed),
                        ))
                        .await;
                    let open = tokio::time::timeout(
                        Duration::from_secs(10),
                        client.process(ReceiverStream::new(rx)),
                    )
                    .await;
                    let replies = match open {
                        Ok(Ok(resp)) => resp.into_inner(),
                        Ok(Err(s)) if s.code() == tonic::Code::ResourceExhausted => {
                            c.add(1);
                            return None;
                        }
                        _ => {
                            c.add(2);
                            return None;
                        }
                    };
                    // FULL_DUPLEX: the router answers nothing until the body; the stream is
                    // established once its response headers came.
                    c.add(0);
                    Some((tx, replies))
                }
            });
            let held: Vec<_> = futures::future::join_all(opened).await;
            std::future::pending::<()>().await;
            drop(held);
        }));
    }
    keep_noting(&mut tasks, &note, move || {
        format!(
            "{} streams opened with request headers: {} established, {} refused (RESOURCE_EXHAUSTED), {} failed otherwise",
            conns * streams,
            counts.get(0),
            counts.get(1),
            counts.get(2)
        )
    });
    (Held(tasks), note)
}
