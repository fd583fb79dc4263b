//! A trivial ext_proc processor for `kv-bench overhead`: the floor cost of ext_proc mechanics.
//!
//! It answers every message with kv-router's own reply for that message type and picks pods
//! round robin without looking at the body. It runs on its own thread with a single-threaded
//! runtime, so that thread's CPU time (`/proc/self/task/<tid>/stat`) is the processor's cost.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::{Stream, StreamExt};
use thiserror::Error;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status, Streaming};

use kv_router::extproc::reply;

/// Why the no-op processor could not start.
#[derive(Debug, Error)]
pub enum NoopError {
    /// Binding 127.0.0.1:0 or building the runtime failed.
    #[error("no-op ext_proc: {0}")]
    Io(#[from] std::io::Error),
    /// The server thread ended before reporting its address.
    #[error("no-op ext_proc thread ended during start-up")]
    ThreadGone,
}

/// The service: a round-robin cursor over the pods.
#[derive(Clone)]
struct Noop {
    pods: Arc<Vec<String>>,
    next: Arc<AtomicUsize>,
    fallbacks: usize,
}

impl Noop {
    /// `primary,fallback…` like kv-router's destination (its default number of fallbacks).
    fn destination(&self) -> String {
        let n = self.pods.len();
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n.min(1 + self.fallbacks))
            .map(|k| self.pods[(first + k) % n].as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    // Without a destination override_host would fall back to its own round robin and skip the
    // metadata lookup; sending kv-router's exact reply shapes (strip, header, metadata, route
    // cache clear) makes Envoy do the same work for both, so only the decision cost differs.
    fn reply(&self, msg: ProcessingRequest) -> Option<ProcessingResponse> {
        Some(match msg.request? {
            In::RequestHeaders(h) if h.end_of_stream => {
                reply::request_headers_decision(&self.destination(), true)
            }
            In::RequestHeaders(_) => reply::request_headers_strip(),
            In::RequestBody(b) if b.end_of_stream => {
                reply::request_body_decision(&self.destination(), true)
            }
            In::RequestBody(_) => reply::request_body_continue(false, Vec::new(), false),
            In::RequestTrailers(_) => reply::request_trailers_continue(),
            In::ResponseHeaders(_) => reply::response_headers_continue(),
            In::ResponseBody(_) => reply::response_body_continue(),
            In::ResponseTrailers(_) => reply::response_trailers_continue(),
        })
    }
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Noop {
    type ProcessStream = ReplyStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let this = self.clone();
        // Envoy resets the stream when the HTTP request ends: stop at the first error.
        let out = request
            .into_inner()
            .take_while(|m| futures::future::ready(m.is_ok()))
            .filter_map(move |m| futures::future::ready(m.ok().and_then(|m| this.reply(m))))
            .map(Ok);
        Ok(Response::new(Box::pin(out)))
    }
}

/// A running no-op processor; stopped when dropped.
pub struct NoopServer {
    /// Its gRPC address.
    pub addr: SocketAddr,
    /// Kernel thread id of the server thread (for its CPU time).
    pub tid: i32,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl NoopServer {
    /// Starts the processor on 127.0.0.1 (a free port), steering to `pods` round robin.
    pub fn start(pods: &[SocketAddr], fallbacks: usize) -> Result<Self, NoopError> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let svc = Noop {
            pods: Arc::new(pods.iter().map(|p| p.to_string()).collect()),
            next: Arc::new(AtomicUsize::new(0)),
            fallbacks,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("noop-extproc".into())
            .spawn(move || {
                let _ = tid_tx.send(rustix::thread::gettid().as_raw_nonzero().get());
                rt.block_on(async move {
                    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                        return;
                    };
                    let incoming = incoming(listener);
                    // Same decode limit as kv-router's default (64 MiB body + 1 MiB).
                    let server = tonic::transport::Server::builder()
                        .add_service(
                            ExternalProcessorServer::new(svc)
                                .max_decoding_message_size((64 << 20) + (1 << 20)),
                        )
                        .serve_with_incoming(incoming);
                    // Dropping the server future on stop ends it at once, open streams or not.
                    tokio::select! {
                        _ = server => {}
                        _ = stopped => {}
                    }
                });
            })?;
        let tid = tid_rx.recv().map_err(|_| NoopError::ThreadGone)?;
        Ok(Self {
            addr,
            tid,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

/// Accepted connections as kv-router's own server sets them up: TCP_NODELAY on (tonic does it
/// for an address it binds, not for a listener handed to it). Without it the no-op's small
/// replies could wait for a delayed ACK, up to 40 ms: a floor slower than it is.
fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

impl Drop for NoopServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders};
    use envoy_types::pb::google::protobuf::value::Kind;

    fn noop(n: usize, fallbacks: usize) -> Noop {
        Noop {
            pods: Arc::new((0..n).map(|i| format!("127.0.0.1:{}", 8000 + i)).collect()),
            next: Arc::new(AtomicUsize::new(0)),
            fallbacks,
        }
    }

    fn msg(r: In) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(r),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn accepted_connections_do_not_delay_small_replies() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut accepted = incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let server_side = accepted.next().await.unwrap().unwrap();
        assert!(
            server_side.nodelay().unwrap(),
            "Nagle on: replies wait for ACKs"
        );
    }

    #[test]
    fn destinations_rotate_with_fallbacks() {
        let n = noop(3, 2);
        assert_eq!(
            n.destination(),
            "127.0.0.1:8000,127.0.0.1:8001,127.0.0.1:8002"
        );
        assert_eq!(
            n.destination(),
            "127.0.0.1:8001,127.0.0.1:8002,127.0.0.1:8000"
        );
        let one = noop(2, 0);
        assert_eq!(one.destination(), "127.0.0.1:8000");
        assert_eq!(one.destination(), "127.0.0.1:8001");
    }

    #[test]
    fn replies_match_the_message_type() {
        let n = noop(2, 2);
        let h = n.reply(msg(In::RequestHeaders(HttpHeaders::default())));
        assert!(matches!(h.unwrap().response, Some(Out::RequestHeaders(_))));
        let b = n
            .reply(msg(In::RequestBody(HttpBody {
                body: b"{}".to_vec(),
                end_of_stream: true,
                ..Default::default()
            })))
            .unwrap();
        assert!(matches!(b.response, Some(Out::RequestBody(_))));
        let md = b.dynamic_metadata.expect("destination metadata");
        let Some(Kind::StructValue(lb)) = &md.fields[kv_router::extproc::LB_NAMESPACE].kind else {
            panic!("envoy.lb struct")
        };
        assert!(matches!(
            &lb.fields[kv_router::extproc::DESTINATION_HEADER].kind,
            Some(Kind::StringValue(s)) if s == "127.0.0.1:8000,127.0.0.1:8001"
        ));
        assert!(n.reply(ProcessingRequest::default()).is_none());
    }
}
