//! The gRPC port as `app` builds it, driven over HTTP/2: each caller class within its own budget,
//! stalled messages on a clock, and the cap on open ext_proc streams.

use super::*;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use prometheus_client::registry::Registry;
use prost::Message;
use tokio::sync::watch;

use crate::config::Config;
use crate::server::metered::tests::{client, grpc_status, stalled};
use crate::telemetry::{ErrorKind, Errors};

const PROCESS: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";
const PICK: &str = "/kvrouter.v1.Picker/Pick";

/// A started gRPC port over two pods serving model `m`, with `edit`'s settings.
async fn port(edit: impl Fn(&mut Config)) -> (SocketAddr, Errors) {
    let mut cfg = Config::default();
    edit(&mut cfg);
    let (decider, pods) = crate::decide::tests::decider(2, |_| {}).await;
    let decider = Arc::new(decider);
    let errors = Errors::default();
    let metrics = ExtProcMetrics::register(&mut Registry::default(), errors.clone());
    let supervisor = Supervisor::default();
    let (stop, stopping) = watch::channel(false);
    // Held for the test's life: a dropped sender would spin the readiness loop.
    tokio::spawn(async move {
        let _stop = stop;
        std::future::pending::<()>().await
    });
    let readiness = Readiness::new(
        stopping,
        supervisor.clone(),
        pods,
        None,
        decider.index().clone(),
    );
    // A free port, taken again if another process bound it in between.
    for _ in 0..5 {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap();
        let settings = GrpcSettings {
            addr,
            health_addr: None,
            body_limit: cfg.body_limit_bytes,
            destination_header: false,
            test_hooks: None,
            server: &cfg.server,
            pick_api: &cfg.pick_api,
        };
        let services = GrpcServices {
            receipts: None,
            decider: decider.clone(),
            flow: None,
            metrics: metrics.clone(),
            readiness: readiness.clone(),
        };
        let closed = std::future::pending::<()>();
        if let Ok(server) = start(
            settings,
            services,
            &supervisor,
            ConnMetrics::default(),
            closed,
        )
        .await
        {
            tokio::spawn(server);
            return (addr, errors);
        }
    }
    panic!("no free port");
}

/// `msg` as one gRPC message.
fn frame(msg: &ProcessingRequest) -> Bytes {
    let bytes = msg.encode_to_vec();
    let mut out = vec![0u8];
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(&bytes);
    Bytes::from(out)
}

fn headers() -> ProcessingRequest {
    let hs = [(":path", "/v1/completions"), (":method", "POST")];
    ProcessingRequest {
        request: Some(In::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: hs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: k.to_string(),
                        raw_value: v.as_bytes().to_vec(),
                        ..Default::default()
                    })
                    .collect(),
            }),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// A last body chunk: a completion request whose prompt is `prompt_bytes` long.
fn body(prompt_bytes: usize) -> ProcessingRequest {
    let body = serde_json::json!({"model": "m", "prompt": "x".repeat(prompt_bytes)});
    ProcessingRequest {
        request: Some(In::RequestBody(HttpBody {
            body: body.to_string().into_bytes(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// An open ext_proc stream, read message by message.
struct Stream {
    send: h2::SendStream<Bytes>,
    recv: Option<h2::RecvStream>,
    resp: Option<h2::client::ResponseFuture>,
    buf: Vec<u8>,
}

impl Stream {
    async fn open(client: &mut h2::client::SendRequest<Bytes>) -> Self {
        let req = http::Request::post(format!("http://x{PROCESS}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let mut c = client.clone().ready().await.unwrap();
        let (resp, send) = c.send_request(req, false).unwrap();
        Self {
            send,
            recv: None,
            resp: Some(resp),
            buf: Vec::new(),
        }
    }

    fn send(&mut self, msg: &ProcessingRequest) {
        let data = frame(msg);
        self.send.reserve_capacity(data.len());
        // A stream already refused may be closed: the reply says so.
        let _ = self.send.send_data(data, false);
    }

    /// The next reply (≤ 10 s); `Err` with the grpc-status when the stream ended instead.
    async fn reply(&mut self) -> Result<ProcessingResponse, Option<String>> {
        let go = async {
            if let Some(resp) = self.resp.take() {
                let resp = resp.await.unwrap();
                if let Some(s) = resp.headers().get("grpc-status") {
                    return Err(Some(s.to_str().unwrap().to_string()));
                }
                self.recv = Some(resp.into_body());
            }
            let recv = self.recv.as_mut().unwrap();
            loop {
                if self.buf.len() >= 5 {
                    let len = u32::from_be_bytes(self.buf[1..5].try_into().unwrap()) as usize;
                    if self.buf.len() >= 5 + len {
                        let msg = ProcessingResponse::decode(&self.buf[5..5 + len]).unwrap();
                        self.buf.drain(..5 + len);
                        return Ok(msg);
                    }
                }
                match recv.data().await {
                    Some(Ok(d)) => {
                        let _ = recv.flow_control().release_capacity(d.len());
                        self.buf.extend_from_slice(&d);
                    }
                    _ => {
                        let trailers = recv.trailers().await.ok().flatten();
                        return Err(trailers.and_then(|t| {
                            t.get("grpc-status")
                                .map(|s| s.to_str().unwrap().to_string())
                        }));
                    }
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), go)
            .await
            .expect("a reply in time")
    }
}

/// The HTTP status of an immediate response, if `r` is one.
fn immediate(r: &ProcessingResponse) -> Option<i32> {
    match &r.response {
        Some(Out::ImmediateResponse(i)) => i.status.as_ref().map(|s| s.code),
        _ => None,
    }
}

/// A whole BUFFERED request on a new stream: its decision, or the status that ended it.
async fn decide(
    client: &mut h2::client::SendRequest<Bytes>,
    prompt_bytes: usize,
) -> Result<(), String> {
    let mut s = Stream::open(client).await;
    s.send(&headers());
    let r = s.reply().await.map_err(|e| format!("{e:?}"))?;
    if let Some(code) = immediate(&r) {
        return Err(format!("immediate {code}"));
    }
    s.send(&body(prompt_bytes));
    let r = s.reply().await.map_err(|e| format!("{e:?}"))?;
    match (&r.response, immediate(&r)) {
        (_, Some(code)) => Err(format!("immediate {code}")),
        (Some(Out::RequestBody(_)), _) => Ok(()),
        (other, _) => Err(format!("{other:?}")),
    }
}

#[tokio::test]
async fn stalled_extproc_messages_draw_from_the_extproc_budget() {
    let (addr, errors) = port(|c| {
        c.body_limit_bytes = 4 << 20;
        c.server.max_buffered_body_bytes = 8 << 20;
    })
    .await;
    let mut client = client(addr).await;
    // Two stalled 3 MiB messages hold 6 MiB of the 8 before a byte of them is buffered...
    let _a = stalled(&mut client, PROCESS, 3 << 20, 1024).await;
    let _b = stalled(&mut client, PROCESS, 3 << 20, 1024).await;
    // ...so a third is refused at once with ext_proc's 503, counted.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (resp, send) = stalled(&mut client, PROCESS, 3 << 20, 1024).await;
        let mut s = Stream {
            send,
            recv: None,
            resp: Some(resp),
            buf: Vec::new(),
        };
        let first = tokio::time::timeout(Duration::from_millis(500), s.reply()).await;
        if let Ok(Ok(r)) = first {
            assert_eq!(immediate(&r), Some(503), "{r:?}");
            break;
        }
        // The first two may not have reached the router yet.
        assert!(
            tokio::time::Instant::now() < deadline,
            "a third stalled message was not refused"
        );
    }
    assert!(errors.get(ErrorKind::BodyBudget) >= 1);
    // Past body_limit_bytes + 1 MiB: a 413, whatever the budget.
    let (resp, send) = stalled(&mut client, PROCESS, 6 << 20, 10).await;
    let mut s = Stream {
        send,
        recv: None,
        resp: Some(resp),
        buf: Vec::new(),
    };
    assert_eq!(immediate(&s.reply().await.unwrap()), Some(413));
}

#[tokio::test]
async fn pick_spending_its_budget_leaves_extproc_room() {
    let (addr, errors) = port(|c| {
        c.body_limit_bytes = 1 << 20;
        c.server.max_buffered_body_bytes = 2 << 20;
        c.pick_api.max_message_bytes = 1 << 20;
        c.pick_api.max_buffered_bytes = 2 << 20;
    })
    .await;
    let mut client = client(addr).await;
    let _a = stalled(&mut client, PICK, 1 << 20, 1024).await;
    let _b = stalled(&mut client, PICK, 1 << 20, 1024).await;
    // Pick's budget is spent: its next caller is refused (RESOURCE_EXHAUSTED)...
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (third, _keep) = stalled(&mut client, PICK, 1 << 20, 1024).await;
        if let Ok(status) =
            tokio::time::timeout(Duration::from_millis(500), grpc_status(third)).await
        {
            assert_eq!(status.as_deref(), Some("8"));
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a third stalled Pick was not refused"
        );
    }
    let refused = errors.get(ErrorKind::BodyBudget);
    assert!(refused >= 1);
    // ...while ext_proc still decides a body of half its own budget.
    decide(&mut client, 1 << 20 >> 1).await.unwrap();
    assert_eq!(errors.get(ErrorKind::BodyBudget), refused);
}

#[tokio::test]
async fn a_stalled_extproc_message_fails_at_its_deadline_and_gives_its_bytes_back() {
    let (addr, errors) = port(|c| {
        c.body_limit_bytes = 4 << 20;
        c.server.max_buffered_body_bytes = 4 << 20;
        c.server.message_timeout_ms = 300;
    })
    .await;
    let mut client = client(addr).await;
    let (resp, send) = stalled(&mut client, PROCESS, 3 << 20, 1024).await;
    let mut s = Stream {
        send,
        recv: None,
        resp: Some(resp),
        buf: Vec::new(),
    };
    // DEADLINE_EXCEEDED (4), though the caller keeps the stream open.
    assert_eq!(s.reply().await.unwrap_err().as_deref(), Some("4"));
    assert_eq!(errors.get(ErrorKind::MessageTimeout), 1);
    // Its 3 MiB are back: a 3 MiB body fits the 4 MiB budget again.
    decide(&mut client, 3 << 20).await.unwrap();
    drop(s);
}

#[tokio::test]
async fn streams_past_the_cap_are_refused_and_the_open_ones_and_health_go_on() {
    let (addr, errors) = port(|c| c.server.max_extproc_streams = 3).await;
    let mut client = client(addr).await;
    let mut open = Vec::new();
    for _ in 0..3 {
        let mut s = Stream::open(&mut client).await;
        s.send(&headers());
        let r = s.reply().await.unwrap();
        assert_eq!(immediate(&r), None, "{r:?}");
        open.push(s);
    }
    // A fourth is refused at once: RESOURCE_EXHAUSTED (8), counted.
    let mut fourth = Stream::open(&mut client).await;
    fourth.send(&headers());
    assert_eq!(fourth.reply().await.unwrap_err().as_deref(), Some("8"));
    assert_eq!(errors.get(ErrorKind::StreamLimit), 1);
    // The open ones are decided.
    open[0].send(&body(100));
    let r = open[0].reply().await.unwrap();
    assert!(matches!(r.response, Some(Out::RequestBody(_))), "{r:?}");
    // Health answers.
    let req = http::Request::post("http://x/grpc.health.v1.Health/Check")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (resp, mut send) = client
        .clone()
        .ready()
        .await
        .unwrap()
        .send_request(req, false)
        .unwrap();
    let msg = b"\x0a\x08liveness";
    let mut data = vec![0u8, 0, 0, 0, msg.len() as u8];
    data.extend_from_slice(msg);
    send.send_data(Bytes::from(data), true).unwrap();
    assert_eq!(grpc_status(resp).await.as_deref(), Some("0"));
    // A stream that ends gives its place to a new one.
    drop(open.remove(0));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let mut s = Stream::open(&mut client).await;
        s.send(&headers());
        match s.reply().await {
            Ok(r) => {
                assert_eq!(immediate(&r), None, "{r:?}");
                break;
            }
            Err(status) => assert_eq!(status.as_deref(), Some("8")),
        }
        assert!(tokio::time::Instant::now() < deadline, "no place freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
