//! Pick request bodies against the router's one buffered-body budget: each gRPC message's
//! announced length is checked against Pick's own message limit and reserved from the budget
//! *before* its bytes are buffered by the decoder, so slow uploads on many streams cannot grow
//! memory past the budget (40 streams announcing 60 MiB once held 1.6 GB).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame};
use tonic::body::Body as GrpcBody;
use tonic::server::NamedService;
use tonic::Status;
use tower::Service;

use crate::budget::{BodyBudget, Reservation};
use crate::telemetry::{ErrorKind, Errors};

/// A gRPC service whose request bodies are metered.
#[derive(Clone)]
pub struct Metered<S> {
    inner: S,
    budget: BodyBudget,
    max_message: usize,
    errors: Errors,
}

impl<S> Metered<S> {
    /// `inner`'s messages may be at most `max_message` bytes, and draw from `budget`.
    pub fn new(inner: S, budget: BodyBudget, max_message: usize, errors: Errors) -> Self {
        Self {
            inner,
            budget,
            max_message,
            errors,
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
        let (budget, max_message, errors) =
            (self.budget.clone(), self.max_message, self.errors.clone());
        self.inner.call(req.map(|body| {
            GrpcBody::new(MeteredBody {
                inner: body,
                held: budget.reservation(),
                max_message,
                errors,
                prefix: [0; 5],
                prefix_len: 0,
                remaining: 0,
            })
        }))
    }
}

/// A request body read message by message: each 5-byte gRPC prefix is checked and its length
/// reserved before the message's bytes pass on. The reservation lasts as long as the body.
struct MeteredBody {
    inner: GrpcBody,
    held: Reservation,
    max_message: usize,
    errors: Errors,
    prefix: [u8; 5],
    prefix_len: usize,
    /// Bytes of the current message still to come.
    remaining: usize,
}

impl MeteredBody {
    /// Walks `data`'s message prefixes; an error refuses the body.
    fn meter(&mut self, mut data: &[u8]) -> Result<(), Status> {
        while !data.is_empty() {
            if self.remaining > 0 {
                let n = self.remaining.min(data.len());
                self.remaining -= n;
                data = &data[n..];
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
            if len > self.max_message {
                return Err(Status::resource_exhausted(format!(
                    "Pick message of {len} bytes exceeds pick_api.max_message_bytes ({})",
                    self.max_message
                )));
            }
            if !self.held.grow(len) {
                self.errors.inc(ErrorKind::BodyBudget);
                return Err(Status::resource_exhausted(
                    "the router's buffered-body budget is spent (server.max_buffered_body_bytes); retry later",
                ));
            }
            self.remaining = len;
        }
        Ok(())
    }
}

impl Body for MeteredBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            other => return other,
        };
        if let Some(data) = frame.data_ref() {
            if let Err(status) = self.meter(data.chunk()) {
                self.held.release();
                return Poll::Ready(Some(Err(status)));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use tokio::net::{TcpListener, TcpStream};

    /// A gRPC server whose only service (health) is metered like Pick; returns its address.
    async fn server(
        budget: BodyBudget,
        max_message: usize,
        errors: Errors,
    ) -> std::net::SocketAddr {
        let (_, health) = tonic_health::server::health_reporter();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(Metered::new(health, budget, max_message, errors))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        addr
    }

    /// Opens a stream that announces a `len`-byte message and sends only `sent` bytes of it.
    async fn stalled(
        client: &mut h2::client::SendRequest<Bytes>,
        len: u32,
        sent: usize,
    ) -> (h2::client::ResponseFuture, h2::SendStream<Bytes>) {
        let req = http::Request::post("http://x/grpc.health.v1.Health/Check")
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
    async fn grpc_status(resp: h2::client::ResponseFuture) -> Option<String> {
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

    #[tokio::test]
    async fn announced_messages_draw_from_the_budget_before_they_are_read() {
        let budget = BodyBudget::new(8 << 20);
        let mut registry = prometheus_client::registry::Registry::default();
        let errors = Errors::register(&mut registry);
        let addr = server(budget.clone(), 4 << 20, errors.clone()).await;
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(conn);

        // Two stalled 3 MiB messages hold 6 MiB of the 8 as soon as their prefixes arrive.
        let a = stalled(&mut client, 3 << 20, 1024).await;
        let b = stalled(&mut client, 3 << 20, 1024).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while budget.used() < 6 << 20 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "used {}",
                budget.used()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // A third is refused at once: RESOURCE_EXHAUSTED (8), counted, nothing more held.
        let (third, _keep) = stalled(&mut client, 3 << 20, 1024).await;
        assert_eq!(grpc_status(third).await.as_deref(), Some("8"));
        assert_eq!(errors.get(ErrorKind::BodyBudget), 1);
        assert_eq!(budget.used(), 6 << 20);
        // Past Pick's own message limit: refused whatever the budget.
        let (big, _keep2) = stalled(&mut client, 5 << 20, 10).await;
        assert_eq!(grpc_status(big).await.as_deref(), Some("8"));
        // Streams that end give their share back.
        drop((a, b));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while budget.used() != 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "used {}",
                budget.used()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
