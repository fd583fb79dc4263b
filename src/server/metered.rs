//! The gRPC port's request bodies read message by message against a body budget: each message's
//! announced length is checked against the service's message limit and reserved from its budget
//! *before* the decoder sees the 5-byte prefix (tonic allocates the whole announced length on
//! it), so slow uploads on many streams cannot grow memory past the budget (40 Pick streams
//! announcing 60 MiB once held 1.6 GB; 40 ext_proc streams announcing 64 MiB, 2.5 GB). A message
//! started and not complete within the message timeout fails its stream and gives its bytes back,
//! so a stalled caller cannot hold a budget for long (40 stalled Pick uploads once refused every
//! Envoy request for as long as they stalled).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body::{Body, Frame};
use tokio::time::{Instant, Sleep};
use tonic::body::Body as GrpcBody;
use tonic::server::NamedService;
use tonic::Status;
use tower::Service;

use crate::budget::{BodyBudget, Refused, Reservation};
use crate::telemetry::{ErrorKind, Errors};

/// How long a message's reservation lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Until the body ends: a unary call, whose message is decoded once the body is read.
    Body,
    /// Until the message's last byte passed to the decoder: a streaming call whose service
    /// accounts what it keeps of each message itself (ext_proc's body budget), so nothing is
    /// counted twice while a stream holds a body.
    Message,
}

/// What a metered service's messages may be, and the config keys its refusals name.
#[derive(Debug, Clone)]
pub struct Meter {
    /// Where the announced lengths are reserved.
    pub budget: BodyBudget,
    /// The largest message.
    pub max_message: usize,
    /// The key that sets `max_message` (for the refusal's text).
    pub max_message_key: &'static str,
    /// The key that sets `budget` (for the refusal's text).
    pub budget_key: &'static str,
    /// A message started must be complete within this.
    pub message_timeout: Duration,
    /// How long each message's reservation lasts.
    pub hold: Hold,
    /// Counts refusals (`body_budget`, `message_timeout`).
    pub errors: Errors,
}

/// A gRPC service whose request bodies are metered.
#[derive(Clone)]
pub struct Metered<S> {
    inner: S,
    meter: Arc<Meter>,
}

impl<S> Metered<S> {
    /// `inner`'s request bodies read under `meter`.
    pub fn new(inner: S, meter: Meter) -> Self {
        Self {
            inner,
            meter: Arc::new(meter),
        }
    }
}

impl<S: NamedService> NamedService for Metered<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<GrpcBody>> for Metered<S>
where
    S: Service<http::Request<GrpcBody>, Response = http::Response<GrpcBody>, Error = Infallible>,
{
    type Response = S::Response;
    type Error = Infallible;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<GrpcBody>) -> Self::Future {
        let meter = self.meter.clone();
        self.inner.call(req.map(|body| {
            GrpcBody::new(MeteredBody {
                inner: body,
                held: meter.budget.reservation(),
                meter,
                prefix: [0; 5],
                prefix_len: 0,
                remaining: 0,
                deadline: None,
                armed: false,
                failed: false,
            })
        }))
    }
}

/// A request body read message by message: each 5-byte gRPC prefix is checked and its length
/// reserved before the message's bytes pass on.
struct MeteredBody {
    inner: GrpcBody,
    meter: Arc<Meter>,
    held: Reservation,
    prefix: [u8; 5],
    prefix_len: usize,
    /// Bytes of the current message still to come.
    remaining: usize,
    /// The current message's deadline; boxed, and only once a stream waited mid-message.
    deadline: Option<Pin<Box<Sleep>>>,
    /// Whether `deadline` is the current message's.
    armed: bool,
    /// Refused: the body ends here.
    failed: bool,
}

impl MeteredBody {
    /// Whether the caller owes bytes on a clock: a message started and not yet passed whole,
    /// or (unary) a message read and the body's end not yet come, its bytes still held.
    fn owing(&self) -> bool {
        self.prefix_len > 0
            || self.remaining > 0
            || (self.meter.hold == Hold::Body && self.held.held() > 0)
    }

    /// A message passed whole: its deadline ends, and its reservation too if held per message.
    fn message_done(&mut self) {
        self.armed = false;
        if self.meter.hold == Hold::Message {
            self.held.release();
        }
    }

    /// Walks `data`'s message prefixes; an error refuses the body.
    fn meter(&mut self, mut data: &[u8]) -> Result<(), Status> {
        while !data.is_empty() {
            if self.remaining > 0 {
                let n = self.remaining.min(data.len());
                self.remaining -= n;
                data = &data[n..];
                if self.remaining == 0 {
                    self.message_done();
                }
                continue;
            }
            let n = (5 - self.prefix_len).min(data.len());
            self.prefix[self.prefix_len..self.prefix_len + n].copy_from_slice(&data[..n]);
            self.prefix_len += n;
            data = &data[n..];
            if self.prefix_len < 5 {
                break;
            }
            self.prefix_len = 0;
            let len = u32::from_be_bytes([
                self.prefix[1],
                self.prefix[2],
                self.prefix[3],
                self.prefix[4],
            ]) as usize;
            let m = &self.meter;
            if len > m.max_message {
                return Err(Refused::TooLarge.status(format!(
                    "a message of {len} bytes exceeds {} ({} bytes)",
                    m.max_message_key, m.max_message
                )));
            }
            if !self.held.grow(len) {
                m.errors.inc(ErrorKind::BodyBudget);
                return Err(Refused::Spent.status(format!(
                    "the router's buffered-body budget is spent ({}); retry later",
                    m.budget_key
                )));
            }
            self.remaining = len;
            if len == 0 {
                self.message_done();
            }
        }
        Ok(())
    }

    /// Ends the body with `status`, giving its bytes back.
    fn fail(&mut self, status: Status) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        self.failed = true;
        self.held.release();
        self.deadline = None;
        Poll::Ready(Some(Err(status)))
    }

    /// Waiting for owed bytes: fails the body once the message's deadline passed.
    fn poll_deadline(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if !self.owing() {
            return Poll::Pending;
        }
        let timeout = self.meter.message_timeout;
        let sleep = self
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if !self.armed {
            // Counted from the first wait for the rest, not from the prefix: a service that
            // stopped reading between messages (deciding, queued) is not the caller's stall.
            sleep.as_mut().reset(Instant::now() + timeout);
            self.armed = true;
        }
        if sleep.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.meter.errors.inc(ErrorKind::MessageTimeout);
        let status = Refused::Stalled.status(format!(
            "a message was not complete within server.message_timeout_ms ({} ms)",
            timeout.as_millis()
        ));
        self.fail(status)
    }
}

impl Body for MeteredBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            Poll::Pending => return self.poll_deadline(cx),
            other => return other,
        };
        if let Some(data) = frame.data_ref() {
            if let Err(status) = self.meter(data.chunk()) {
                return self.fail(status);
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    use tokio::net::{TcpListener, TcpStream};

    /// Opens a stream to `path` that announces a `len`-byte message and sends only `sent`
    /// bytes of it.
    pub(crate) async fn stalled(
        client: &mut h2::client::SendRequest<Bytes>,
        path: &str,
        len: u32,
        sent: usize,
    ) -> (h2::client::ResponseFuture, h2::SendStream<Bytes>) {
        let req = http::Request::post(format!("http://x{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let mut c = client.clone().ready().await.unwrap();
        let (resp, mut body) = c.send_request(req, false).unwrap();
        let mut data = vec![0u8];
        data.extend_from_slice(&len.to_be_bytes());
        data.resize(5 + sent, b'x');
        body.reserve_capacity(data.len());
        body.send_data(Bytes::from(data), false).unwrap();
        (resp, body)
    }

    /// The gRPC status of a finished response (headers or trailers).
    pub(crate) async fn grpc_status(resp: h2::client::ResponseFuture) -> Option<String> {
        let resp = tokio::time::timeout(Duration::from_secs(5), resp)
            .await
            .expect("an answer in time")
            .unwrap();
        if let Some(s) = resp.headers().get("grpc-status") {
            return Some(s.to_str().unwrap().to_string());
        }
        let mut body = resp.into_body();
        while body.data().await.is_some() {}
        let trailers = body.trailers().await.ok()??;
        trailers
            .get("grpc-status")
            .map(|s| s.to_str().unwrap().to_string())
    }

    /// Waits (≤ 5 s) until `budget` holds `want` bytes.
    pub(crate) async fn wait_used(budget: &BodyBudget, want: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while budget.used() != want {
            assert!(
                tokio::time::Instant::now() < deadline,
                "used {}, want {want}",
                budget.used()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// An h2 client of `addr`.
    pub(crate) async fn client(addr: std::net::SocketAddr) -> h2::client::SendRequest<Bytes> {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (client, conn) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(conn);
        client
    }

    /// A gRPC server whose only service (health) is metered by `meter`; returns its address.
    async fn server(meter: Meter) -> std::net::SocketAddr {
        let (_, health) = tonic_health::server::health_reporter();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(Metered::new(health, meter))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        addr
    }

    fn meter(budget: &BodyBudget, errors: &Errors, timeout: Duration) -> Meter {
        Meter {
            budget: budget.clone(),
            max_message: 4 << 20,
            max_message_key: "pick_api.max_message_bytes",
            budget_key: "pick_api.max_buffered_bytes",
            message_timeout: timeout,
            hold: Hold::Body,
            errors: errors.clone(),
        }
    }

    const CHECK: &str = "/grpc.health.v1.Health/Check";

    #[tokio::test]
    async fn announced_messages_draw_from_the_budget_before_they_are_read() {
        let budget = BodyBudget::new(8 << 20);
        let mut registry = prometheus_client::registry::Registry::default();
        let errors = Errors::register(&mut registry);
        let addr = server(meter(&budget, &errors, Duration::from_secs(60))).await;
        let mut client = client(addr).await;

        // Two stalled 3 MiB messages hold 6 MiB of the 8 as soon as their prefixes arrive.
        let a = stalled(&mut client, CHECK, 3 << 20, 1024).await;
        let b = stalled(&mut client, CHECK, 3 << 20, 1024).await;
        wait_used(&budget, 6 << 20).await;
        // A third is refused at once: RESOURCE_EXHAUSTED (8), counted, nothing more held.
        let (third, _keep) = stalled(&mut client, CHECK, 3 << 20, 1024).await;
        assert_eq!(grpc_status(third).await.as_deref(), Some("8"));
        assert_eq!(errors.get(ErrorKind::BodyBudget), 1);
        assert_eq!(budget.used(), 6 << 20);
        // Past the message limit: refused whatever the budget.
        let (big, _keep2) = stalled(&mut client, CHECK, 5 << 20, 10).await;
        assert_eq!(grpc_status(big).await.as_deref(), Some("8"));
        // Streams that end give their share back.
        drop((a, b));
        wait_used(&budget, 0).await;
    }

    #[tokio::test]
    async fn a_stalled_message_fails_at_its_deadline_and_gives_its_bytes_back() {
        let budget = BodyBudget::new(8 << 20);
        let mut registry = prometheus_client::registry::Registry::default();
        let errors = Errors::register(&mut registry);
        let addr = server(meter(&budget, &errors, Duration::from_millis(300))).await;
        let mut client = client(addr).await;

        let started = std::time::Instant::now();
        let (resp, _keep) = stalled(&mut client, CHECK, 3 << 20, 1024).await;
        wait_used(&budget, 3 << 20).await;
        // DEADLINE_EXCEEDED (4), though the caller keeps the stream open.
        assert_eq!(grpc_status(resp).await.as_deref(), Some("4"));
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert_eq!(errors.get(ErrorKind::MessageTimeout), 1);
        wait_used(&budget, 0).await;
        // A prefix alone is a started message too.
        let (resp, _keep) = stalled(&mut client, CHECK, 3 << 20, 0).await;
        assert_eq!(grpc_status(resp).await.as_deref(), Some("4"));
        wait_used(&budget, 0).await;
        // A unary message read whole holds its bytes until the body ends: on the same clock.
        let (resp, _keep) = stalled(&mut client, CHECK, 10, 10).await;
        assert_eq!(grpc_status(resp).await.as_deref(), Some("4"));
        assert_eq!(errors.get(ErrorKind::MessageTimeout), 3);
        wait_used(&budget, 0).await;
    }
}
