//! The ext_proc protocol without Envoy: a real tonic server with the router's service, driven by
//! envoy-types' client, message by message as Envoy 1.40 sends them.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::value::Kind;
use kv_router::blocks::BlockScheme;
use kv_router::config::{Config, StaticPod};
use kv_router::decide::{Decider, DecisionMetrics};
use kv_router::extproc::{ExtProc, ExtProcMetrics, DESTINATION_HEADER};
use kv_router::index::MemoryIndex;
use kv_router::pods::{LoadSample, PodRegistry, PodSource, StaticSource};
use kv_router::scoring::SessionStore;
use kv_router::telemetry::Errors;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::Streaming;

mod response;

struct Harness {
    client: ExternalProcessorClient<tonic::transport::Channel>,
    pods: Arc<PodRegistry>,
    /// The decider's index (what a decision recorded).
    index: Arc<MemoryIndex>,
    /// The service's metrics (`extproc_open_streams`: what the tests wait on).
    registry: prometheus_client::registry::Registry,
}

impl Harness {
    /// `extproc_open_streams`: streams whose work is still alive on the server. A stream's
    /// body-budget reservation lives in that work, so a stream no longer counted has returned
    /// its bytes.
    fn open_streams(&self) -> i64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("extproc_open_streams ")?.trim().parse().ok())
            .unwrap_or_else(|| panic!("extproc_open_streams not exported:\n{text}"))
    }

    /// Waits until the server counts `n` open streams, or fails after 5 s.
    async fn wait_open_streams(&self, n: i64, what: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let open = self.open_streams();
            if open == n {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: {open} ext_proc streams still open after 5 s, expected {n}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

async fn harness(limit: usize) -> Harness {
    harness_with_budget(limit, usize::MAX).await
}

async fn harness_with_budget(limit: usize, budget: usize) -> Harness {
    let mut cfg = Config::default();
    cfg.pods.static_pods = (0..3)
        .map(|i| StaticPod {
            address: format!("10.1.0.{i}:8000"),
            models: vec!["m".into()],
            labels: Default::default(),
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
            role: None,
        })
        .collect();
    let pods = Arc::new(PodRegistry::default());
    pods.update(
        StaticSource::new(&cfg.pods.static_pods)
            .pods()
            .await
            .unwrap(),
    );
    for p in pods.snapshot().pods() {
        p.record_probe(true, 1);
        p.record_sample(tokio::time::Instant::now(), LoadSample::default());
    }
    let mut registry = prometheus_client::registry::Registry::default();
    let errors = Errors::register(&mut registry);
    let index = Arc::new(MemoryIndex::new(60_000, 10_000));
    let decider = Arc::new(Decider::new(
        cfg.decision(),
        Arc::default(),
        pods.clone(),
        index.clone(),
        Arc::new(SessionStore::new(100, 60_000)),
        DecisionMetrics::register(&mut registry, errors.clone()),
    ));
    let svc = ExtProc::new(
        decider,
        ExtProcMetrics::register(&mut registry, errors),
        limit,
        true,
    )
    .with_body_budget(budget);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                ExternalProcessorServer::new(svc).max_decoding_message_size(limit + (1 << 20)),
            )
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let client = ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(usize::MAX);
    Harness {
        client,
        pods,
        index,
        registry,
    }
}

struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(h: &mut Harness) -> Self {
        let (tx, rx) = mpsc::channel(64);
        let rx = h
            .client
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Self { tx, rx }
    }
    async fn send(&self, r: In, mode: Option<BodySendMode>) {
        let protocol_config = mode.map(|m| ProtocolConfiguration {
            request_body_mode: m as i32,
            response_body_mode: m as i32,
            ..Default::default()
        });
        self.tx
            .send(ProcessingRequest {
                request: Some(r),
                protocol_config,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    async fn next(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(5), self.rx.next())
            .await
            .expect("a reply in time")
            .expect("stream open")
            .expect("ok status")
    }
}

fn headers(path: &str, extra: &[(&str, &str)], eos: bool) -> In {
    let mut hs = vec![
        (":path", path),
        (":method", "POST"),
        ("content-type", "application/json"),
    ];
    hs.extend_from_slice(extra);
    In::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: hs
                .into_iter()
                .map(|(k, v)| HeaderValue {
                    key: k.into(),
                    raw_value: v.as_bytes().to_vec(),
                    ..Default::default()
                })
                .collect(),
        }),
        end_of_stream: eos,
        ..Default::default()
    })
}

fn body(bytes: &[u8], eos: bool) -> In {
    In::RequestBody(HttpBody {
        body: bytes.to_vec(),
        end_of_stream: eos,
        ..Default::default()
    })
}

fn completion(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": prompt})).unwrap()
}

fn destination(r: &ProcessingResponse) -> String {
    let md = r.dynamic_metadata.as_ref().expect("dynamic metadata");
    let Some(Kind::StructValue(lb)) = &md.fields["envoy.lb"].kind else {
        panic!("envoy.lb struct")
    };
    match &lb.fields[DESTINATION_HEADER].kind {
        Some(Kind::StringValue(s)) => s.clone(),
        other => panic!("destination string, got {other:?}"),
    }
}

/// A ProcessingRequest with none of the six messages gets a clear INVALID_ARGUMENT, not a
/// silent close (found by probing the port with an empty message).
#[tokio::test]
async fn an_empty_processing_request_is_answered_with_invalid_argument() {
    let mut h = harness(1 << 20).await;
    let mut s = Stream::open(&mut h).await;
    s.tx.send(ProcessingRequest::default()).await.unwrap();
    let end = tokio::time::timeout(Duration::from_secs(5), s.rx.next())
        .await
        .expect("an answer in time")
        .expect("a status, not a silent end");
    let status = end.expect_err("an error status");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("no request"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn buffered_strips_then_decides_in_the_body_reply() {
    let mut h = harness(1 << 20).await;
    let mut s = Stream::open(&mut h).await;
    s.send(
        headers(
            "/v1/completions",
            &[(DESTINATION_HEADER, "10.9.9.9:1")],
            false,
        ),
        Some(BodySendMode::Buffered),
    )
    .await;
    let r = s.next().await;
    let Some(Out::RequestHeaders(hr)) = r.response else {
        panic!("headers reply first")
    };
    let m = hr.response.unwrap().header_mutation.unwrap();
    assert!(
        m.remove_headers.contains(&DESTINATION_HEADER.to_string()),
        "client copy stripped"
    );
    assert!(r.dynamic_metadata.is_none());
    s.send(body(&completion(&"x".repeat(500)), true), None)
        .await;
    let r = s.next().await;
    let dest = destination(&r);
    let primary = dest.split(',').next().unwrap();
    assert!(primary.starts_with("10.1.0."), "a pool member: {dest}");
    assert_eq!(dest.split(',').count(), 3, "primary + 2 fallbacks");
    let Some(Out::RequestBody(br)) = r.response else {
        panic!("body reply")
    };
    let set = &br.response.unwrap().header_mutation.unwrap().set_headers[0];
    assert_eq!(set.header.as_ref().unwrap().raw_value, primary.as_bytes());
}

#[tokio::test]
async fn full_duplex_buffers_decides_then_echoes_the_whole_body() {
    let mut h = harness(1 << 20).await;
    let mut s = Stream::open(&mut h).await;
    s.send(
        headers("/v1/completions", &[], false),
        Some(BodySendMode::FullDuplexStreamed),
    )
    .await;
    let payload = completion(&"y".repeat(150_000));
    let (a, b) = payload.split_at(70_000);
    s.send(body(a, false), None).await;
    s.send(body(b, true), None).await;
    let r = s.next().await;
    let dest = destination(&r);
    let Some(Out::RequestHeaders(hr)) = r.response else {
        panic!("headers reply carries the decision")
    };
    let common = hr.response.unwrap();
    assert!(common.clear_route_cache);
    assert!(!common.header_mutation.unwrap().set_headers.is_empty());
    assert!(dest.starts_with("10.1.0."));
    assert_eq!(
        echoed_body(&mut s).await,
        payload,
        "every byte echoed, in order"
    );
}

/// The request body echoed back in FULL_DUPLEX, to its end; no message past Envoy's 62,000 bytes.
async fn echoed_body(s: &mut Stream) -> Vec<u8> {
    let mut echoed = Vec::new();
    loop {
        let Some(Out::RequestBody(br)) = s.next().await.response else {
            panic!("body echo")
        };
        let Some(Mutation::StreamedResponse(sr)) =
            br.response.unwrap().body_mutation.unwrap().mutation
        else {
            panic!("streamed_response")
        };
        assert!(sr.body.len() <= 62_000);
        echoed.extend(sr.body);
        if sr.end_of_stream {
            return echoed;
        }
    }
}

/// A FULL_DUPLEX request whose body is sent as `pieces`: the pod chosen and the echoed body.
async fn full_duplex_in_pieces(h: &mut Harness, pieces: &[&[u8]]) -> (String, Vec<u8>) {
    let mut s = Stream::open(h).await;
    s.send(
        headers("/v1/completions", &[], false),
        Some(BodySendMode::FullDuplexStreamed),
    )
    .await;
    for (i, p) in pieces.iter().enumerate() {
        s.send(body(p, i + 1 == pieces.len()), None).await;
    }
    // The destination list: the chosen pod first, then the fallbacks.
    let dest = destination(&s.next().await);
    let primary = dest.split(',').next().unwrap_or_default().to_string();
    (primary, echoed_body(&mut s).await)
}

/// A body that came in many chunks (cut inside escapes and multi-byte characters) is decided on
/// the same bytes as the body in one: the keys recorded for it are the one-piece body's, the
/// body in one chunk then goes to the same pod, and both are echoed byte for byte.
#[tokio::test]
async fn a_body_in_many_chunks_is_decided_as_the_body_in_one() {
    let mut h = harness(1 << 22).await;
    let text: String = (0..40_000)
        .map(|i| ["é", "\n", "\"", "ab", "€ ", "\u{1F600}"][i % 6])
        .collect();
    let payload = completion(&text);
    let blocks = Config::default().blocks;
    let scheme = BlockScheme {
        size_chars: blocks.size_chars,
        max_blocks: blocks.max_blocks,
    };
    let parsed = kv_router::request::parse("/v1/completions", &payload).unwrap();
    let want: HashSet<u64> = scheme.keys(&parsed).iter().map(|k| k.0).collect();
    assert!(want.len() > 1_000, "{} keys", want.len());
    let pieces: Vec<&[u8]> = payload.chunks(777).collect();
    let (first, echoed) = full_duplex_in_pieces(&mut h, &pieces).await;
    assert!(echoed == payload, "every byte echoed, in order");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let held: HashSet<u64> = h
            .index
            .snapshot(0, usize::MAX)
            .pods
            .iter()
            .filter(|p| p.pod == first)
            .flat_map(|p| p.entries.iter().map(|e| e.0))
            .collect();
        if held == want {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{first} holds {} keys, {} of the one-piece body's",
            held.len(),
            held.intersection(&want).count()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (second, echoed) = full_duplex_in_pieces(&mut h, &[&payload]).await;
    assert_eq!(second, first, "the same body goes where its blocks are");
    assert!(echoed == payload, "every byte echoed, in order");
}

#[tokio::test]
async fn full_duplex_with_trailers_and_response_path() {
    let mut h = harness(1 << 20).await;
    let mut s = Stream::open(&mut h).await;
    s.send(
        headers("/v1/completions", &[], false),
        Some(BodySendMode::FullDuplexStreamed),
    )
    .await;
    let payload = completion("hello");
    s.send(body(&payload, false), None).await;
    s.send(In::RequestTrailers(HttpTrailers::default()), None)
        .await;
    assert!(matches!(
        s.next().await.response,
        Some(Out::RequestHeaders(_))
    ));
    let r = s.next().await;
    let Some(Out::RequestBody(br)) = r.response else {
        panic!()
    };
    let Some(Mutation::StreamedResponse(sr)) = br.response.unwrap().body_mutation.unwrap().mutation
    else {
        panic!()
    };
    assert_eq!(
        (sr.body, sr.end_of_stream),
        (payload, false),
        "trailers follow: no end of stream on the body"
    );
    assert!(matches!(
        s.next().await.response,
        Some(Out::RequestTrailers(_))
    ));
    // Response side: headers continue, body chunks echoed at once.
    s.send(In::ResponseHeaders(HttpHeaders::default()), None)
        .await;
    assert!(matches!(
        s.next().await.response,
        Some(Out::ResponseHeaders(_))
    ));
    s.send(
        In::ResponseBody(HttpBody {
            body: b"data: 1\n\n".to_vec(),
            end_of_stream: false,
            ..Default::default()
        }),
        None,
    )
    .await;
    let r = s.next().await;
    let Some(Out::ResponseBody(br)) = r.response else {
        panic!()
    };
    let Some(Mutation::StreamedResponse(sr)) = br.response.unwrap().body_mutation.unwrap().mutation
    else {
        panic!()
    };
    assert_eq!(sr.body, b"data: 1\n\n");
}

#[tokio::test]
async fn body_less_request_is_decided_in_the_headers_reply() {
    let mut h = harness(1 << 20).await;
    let mut s = Stream::open(&mut h).await;
    s.send(
        headers("/v1/models", &[], true),
        Some(BodySendMode::Buffered),
    )
    .await;
    let r = s.next().await;
    assert!(destination(&r).starts_with("10.1.0."));
    assert!(matches!(r.response, Some(Out::RequestHeaders(_))));
}

#[tokio::test]
async fn oversized_body_gets_413_json() {
    let mut h = harness(10_000).await;
    let mut s = Stream::open(&mut h).await;
    s.send(
        headers("/v1/completions", &[], false),
        Some(BodySendMode::FullDuplexStreamed),
    )
    .await;
    s.send(body(&vec![b'a'; 6_000], false), None).await;
    s.send(body(&vec![b'a'; 6_000], false), None).await;
    let r = s.next().await;
    let Some(Out::ImmediateResponse(ir)) = r.response else {
        panic!("immediate response")
    };
    assert_eq!(ir.status.unwrap().code, 413);
    let v: serde_json::Value = serde_json::from_slice(&ir.body).unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("limit"));
}

async fn open_full_duplex(h: &mut Harness) -> Stream {
    let s = Stream::open(h).await;
    s.send(
        headers("/v1/completions", &[], false),
        Some(BodySendMode::FullDuplexStreamed),
    )
    .await;
    s
}

#[tokio::test]
async fn bodies_past_the_shared_buffer_budget_get_a_fast_503() {
    let mut h = harness_with_budget(1 << 20, 10_000).await;
    // STREAMED: the router answers each chunk after charging it to the budget, so the holder's
    // bytes are known to count before the late stream sends (FULL_DUPLEX sends no such answer).
    let mut holder = Stream::open(&mut h).await;
    holder
        .send(
            headers("/v1/completions", &[], false),
            Some(BodySendMode::Streamed),
        )
        .await;
    assert!(matches!(
        holder.next().await.response,
        Some(Out::RequestHeaders(_))
    ));
    holder.send(body(&vec![b'a'; 6_000], false), None).await;
    let ack = holder.next().await;
    assert!(
        matches!(ack.response, Some(Out::RequestBody(_))),
        "the holder's chunk is buffered: {ack:?}"
    );
    let mut late = open_full_duplex(&mut h).await;
    late.send(body(&vec![b'a'; 6_000], false), None).await;
    let Some(Out::ImmediateResponse(ir)) = late.next().await.response else {
        panic!("immediate response")
    };
    assert_eq!(ir.status.unwrap().code, 503);
    let v: serde_json::Value = serde_json::from_slice(&ir.body).unwrap();
    assert_eq!(v["error"]["code"], "router_overloaded");
    // The holder's stream ends: its bytes return to the budget (the refused stream ended at
    // its 503: it holds nothing).
    drop(holder);
    h.wait_open_streams(0, "the holder's stream never ended")
        .await;
    let mut next = open_full_duplex(&mut h).await;
    next.send(body(&completion(&"y".repeat(5_000)), true), None)
        .await;
    let r = next.next().await;
    assert!(
        !matches!(r.response, Some(Out::ImmediateResponse(_))),
        "decided, not refused: {r:?}"
    );
}

/// A rejected stream that waits for the gateway to close its side still holds its receive
/// buffer: the wait is charged to the body budget, or a client answered 404 could hold
/// unbudgeted memory by never closing.
#[tokio::test]
async fn a_rejected_stream_waiting_for_the_gateway_is_charged_to_the_budget() {
    let mut h = harness_with_budget(1 << 20, 10_000).await;
    let mut rejected = open_full_duplex(&mut h).await;
    let unknown = serde_json::json!({"model": "nobody", "prompt": "z".repeat(6_000)});
    rejected
        .send(body(&serde_json::to_vec(&unknown).unwrap(), true), None)
        .await;
    let Some(Out::ImmediateResponse(ir)) = rejected.next().await.response else {
        panic!("immediate response")
    };
    assert_eq!(ir.status.unwrap().code, 404);
    let mut late = open_full_duplex(&mut h).await;
    late.send(body(&vec![b'a'; 6_000], false), None).await;
    let Some(Out::ImmediateResponse(ir)) = late.next().await.response else {
        panic!("the waiting stream's bytes count: immediate response")
    };
    assert_eq!(ir.status.unwrap().code, 503);
    // The gateway closes the rejected stream: its bytes return to the budget (the refused late
    // stream ended at its 503: it holds nothing).
    drop(rejected);
    h.wait_open_streams(0, "the rejected stream never ended")
        .await;
    let mut next = open_full_duplex(&mut h).await;
    next.send(body(&vec![b'a'; 6_000], false), None).await;
    let r = tokio::time::timeout(Duration::from_millis(300), next.next()).await;
    assert!(r.is_err(), "buffered, not refused: {r:?}");
    expect_decided_after_the_end(&mut next).await;
}

/// Ends `s`'s full-duplex body and checks that its first reply is the decision: a refusal of an
/// earlier chunk would have come first, so this proves the chunk was buffered, whatever the
/// timing of the check before it.
async fn expect_decided_after_the_end(s: &mut Stream) {
    s.send(body(b"", true), None).await;
    let r = s.next().await;
    assert!(
        matches!(r.response, Some(Out::RequestHeaders(_))),
        "buffered, then decided: {r:?}"
    );
    assert!(destination(&r).starts_with("10.1.0."), "{r:?}");
}

/// Found by fuzz/extproc: body bytes, then request headers with end_of_stream (out of order)
/// decided without the body, yet the stream kept those bytes' share of the budget until it ended.
#[tokio::test]
async fn headers_ending_the_request_after_stray_body_bytes_release_their_budget() {
    let mut h = harness_with_budget(1 << 20, 10_000).await;
    let mut odd = Stream::open(&mut h).await;
    odd.send(body(&vec![b'a'; 4_096], false), None).await;
    odd.send(headers("/v1/completions", &[], true), None).await;
    let decided = odd.next().await;
    assert!(
        !matches!(decided.response, Some(Out::ImmediateResponse(_))),
        "decided: {decided:?}"
    );
    // `odd` is still open: a 6,000-byte body must fit the 10,000-byte budget.
    let mut next = open_full_duplex(&mut h).await;
    next.send(body(&vec![b'a'; 6_000], false), None).await;
    let r = tokio::time::timeout(Duration::from_millis(300), next.next()).await;
    assert!(r.is_err(), "buffered, not refused: {r:?}");
    expect_decided_after_the_end(&mut next).await;
    drop(odd);
}

#[tokio::test]
async fn no_healthy_pod_gets_503_json() {
    let mut h = harness(1 << 20).await;
    for p in h.pods.snapshot().pods() {
        p.record_probe(false, 1);
    }
    let mut s = Stream::open(&mut h).await;
    s.send(
        headers("/v1/completions", &[], false),
        Some(BodySendMode::Buffered),
    )
    .await;
    let _ = s.next().await;
    s.send(body(&completion("x"), true), None).await;
    let r = s.next().await;
    let Some(Out::ImmediateResponse(ir)) = r.response else {
        panic!("immediate response")
    };
    assert_eq!(ir.status.unwrap().code, 503);
    let ct = &ir.headers.unwrap().set_headers[0];
    assert_eq!(ct.header.as_ref().unwrap().raw_value, b"application/json");
    let v: serde_json::Value = serde_json::from_slice(&ir.body).unwrap();
    assert_eq!(v["error"]["code"], "no_healthy_upstream");
}

/// An immediate reply (404 here; 413, 503 alike) once ended the stream before the gateway had
/// closed its side; the gateway's late frames then hit a stream h2 had already forgotten, each
/// such reset counts against the connection, and after 1024 h2 sent GOAWAY (ENHANCE_YOUR_CALM,
/// "too_many_internal_resets"): every stream on the gateway's connection failed. Seen by
/// `kv-bench hostile` after ~30k rejections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_never_make_the_server_drop_the_gateways_connection() {
    let h = harness(1 << 20).await;
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (mut client, next) = (h.client.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= 60_000 {
                        return Ok(());
                    }
                    let (tx, rx) = mpsc::channel(4);
                    let mut replies = client
                        .process(ReceiverStream::new(rx))
                        .await
                        .map_err(|e| format!("request {i}: {e}"))?
                        .into_inner();
                    let unknown =
                        serde_json::json!({"model": format!("nobody-{i}"), "prompt": "x"});
                    for r in [
                        headers("/v1/completions", &[], false),
                        body(&serde_json::to_vec(&unknown).unwrap(), true),
                    ] {
                        let _ = tx
                            .send(ProcessingRequest {
                                request: Some(r),
                                ..Default::default()
                            })
                            .await;
                    }
                    for _ in 0..2 {
                        match replies.next().await {
                            Some(Ok(r)) if r.response.is_some() => {}
                            other => return Err(format!("request {i}: {other:?}")),
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn malformed_json_is_routed_by_load() {
    let mut h = harness(1 << 20).await;
    let mut s = Stream::open(&mut h).await;
    s.send(
        headers("/v1/completions", &[], false),
        Some(BodySendMode::Buffered),
    )
    .await;
    let _ = s.next().await;
    s.send(body(b"{not json", true), None).await;
    assert!(destination(&s.next().await).starts_with("10.1.0."));
}

#[tokio::test]
async fn reset_stream_releases_in_flight_load() {
    let mut h = harness(1 << 20).await;
    let mut s = Stream::open(&mut h).await;
    s.send(
        headers("/v1/completions", &[], false),
        Some(BodySendMode::FullDuplexStreamed),
    )
    .await;
    s.send(body(&completion(&"z".repeat(4000)), true), None)
        .await;
    let dest = destination(&s.next().await);
    let primary = dest.split(',').next().unwrap().to_string();
    let pod = h
        .pods
        .snapshot()
        .pods()
        .iter()
        .find(|p| p.id().as_str() == primary)
        .unwrap()
        .clone();
    assert_eq!(
        pod.inflight_counts().0,
        1,
        "counted while the request is open"
    );
    // Envoy resets the stream (client gone): the guard is released.
    drop(s);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while pod.inflight_counts().0 != 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "in-flight count never released"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Fuzz smoke of the per-stream state machine (stable Rust: proptest values, run on one
/// server): arbitrary sequences of ProcessingRequest messages — out of order, duplicate
/// end-of-stream, empty and oversized bodies, trailers without body, a second headers message,
/// response-side messages — never kill the service, and every stream's in-flight load returns.
#[tokio::test]
async fn arbitrary_message_sequences_never_break_the_service() {
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;

    let msg = prop_oneof![
        (any::<bool>(), any::<bool>()).prop_map(|(chat, eos)| {
            headers(
                if chat {
                    "/v1/chat/completions"
                } else {
                    "/v1/completions"
                },
                &[],
                eos,
            )
        }),
        (0usize..3, any::<bool>()).prop_map(|(kind, eos)| match kind {
            0 => body(b"", eos),
            1 => body(&completion("shared words for routing"), eos),
            _ => body(&vec![b'z'; 12_000], eos), // over the 10 kB limit below
        }),
        Just(In::RequestTrailers(HttpTrailers::default())),
        Just(In::ResponseHeaders(HttpHeaders::default())),
        any::<bool>().prop_map(|eos| In::ResponseBody(HttpBody {
            body: b"data: {}\n\n".to_vec(),
            end_of_stream: eos,
            ..Default::default()
        })),
        Just(In::ResponseTrailers(HttpTrailers::default())),
    ];
    let mode = prop_oneof![
        Just(BodySendMode::Buffered),
        Just(BodySendMode::Streamed),
        Just(BodySendMode::FullDuplexStreamed),
        Just(BodySendMode::None),
    ];
    let case = (mode, prop::collection::vec(msg, 1..8));
    let mut runner = TestRunner::deterministic();
    let mut h = harness(10_000).await;
    for _ in 0..300 {
        let (mode, msgs) = case.new_tree(&mut runner).unwrap().current();
        let mut s = Stream::open(&mut h).await;
        for (i, m) in msgs.into_iter().enumerate() {
            if s.tx.is_closed() {
                break;
            }
            let pc = (i == 0).then_some(mode);
            let _ =
                s.tx.send(ProcessingRequest {
                    request: Some(m),
                    protocol_config: pc.map(|m| ProtocolConfiguration {
                        request_body_mode: m as i32,
                        response_body_mode: m as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .await;
        }
        drop(s.tx);
        // Drain: the stream ends (replies, an error status, or end) within the timeout.
        tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(Ok(_)) = s.rx.next().await {}
        })
        .await
        .expect("every stream ends");
    }
    // Still serving, and no in-flight load left behind.
    let mut s = Stream::open(&mut h).await;
    s.send(
        headers("/v1/completions", &[], false),
        Some(BodySendMode::Buffered),
    )
    .await;
    let _ = s.next().await;
    s.send(body(&completion("after the fuzz"), true), None)
        .await;
    assert!(destination(&s.next().await).starts_with("10.1.0."));
    drop(s);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while h
        .pods
        .snapshot()
        .pods()
        .iter()
        .any(|p| p.inflight_counts().0 != 0)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "in-flight load left behind"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
