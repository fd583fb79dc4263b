//! The response side's effect on a pod's load: when a request's prefill counts as over.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration,
};
use kv_router::pods::Pod;

use super::{body, completion, destination, harness, headers, Harness, Stream};

fn response_headers(content_type: &str) -> In {
    In::ResponseHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: [(":status", "200"), ("content-type", content_type)]
                .into_iter()
                .map(|(k, v)| HeaderValue {
                    key: k.into(),
                    raw_value: v.as_bytes().to_vec(),
                    ..Default::default()
                })
                .collect(),
        }),
        ..Default::default()
    })
}

/// Opens a FULL_DUPLEX request stream whose responses come as `response_mode`, sends a 1,000-token
/// prompt and returns the stream and the pod it was routed to (request echo consumed).
async fn routed(h: &mut Harness, response_mode: BodySendMode) -> (Stream, Arc<Pod>) {
    let mut s = Stream::open(h).await;
    s.tx.send(ProcessingRequest {
        request: Some(headers("/v1/completions", &[], false)),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::FullDuplexStreamed as i32,
            response_body_mode: response_mode as i32,
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .unwrap();
    s.send(body(&completion(&"z".repeat(4000)), true), None)
        .await;
    let dest = destination(&s.next().await);
    assert!(matches!(s.next().await.response, Some(Out::RequestBody(_))));
    let primary = dest.split(',').next().unwrap();
    let pod = h
        .pods
        .snapshot()
        .pods()
        .iter()
        .find(|p| p.id().as_str() == primary)
        .unwrap()
        .clone();
    assert_eq!(pod.inflight_counts(), (1, 1000), "charged at the decision");
    (s, pod)
}

fn tokens_counted(pod: &Pod) -> f64 {
    pod.load(tokio::time::Instant::now(), Duration::from_secs(60))
        .inflight_tokens
}

/// A streamed completion's headers leave the engine before its prefill, even while it queues:
/// its uncached tokens keep counting until the first body chunk (they once stopped at the
/// headers, so a pod with a queue of long prompts looked idle and drew every hot prefix).
#[tokio::test]
async fn a_streamed_responses_prefill_counts_until_its_first_chunk() {
    let mut h = harness(1 << 20).await;
    let (mut s, pod) = routed(&mut h, BodySendMode::FullDuplexStreamed).await;
    s.send(response_headers("text/event-stream; charset=utf-8"), None)
        .await;
    assert!(matches!(
        s.next().await.response,
        Some(Out::ResponseHeaders(_))
    ));
    assert_eq!(
        pod.inflight_counts(),
        (1, 1000),
        "headers: prefill not over"
    );
    s.send(
        In::ResponseBody(HttpBody {
            body: b"data: {}\n\n".to_vec(),
            ..Default::default()
        }),
        None,
    )
    .await;
    assert!(matches!(
        s.next().await.response,
        Some(Out::ResponseBody(_))
    ));
    assert_eq!(pod.inflight_counts(), (1, 0), "first chunk: prefill over");
    assert_eq!(tokens_counted(&pod), 0.0);
}

/// A whole (non-streamed) response's headers come after its generation: the prefill is over.
#[tokio::test]
async fn a_whole_responses_headers_end_the_prefill() {
    let mut h = harness(1 << 20).await;
    let (mut s, pod) = routed(&mut h, BodySendMode::FullDuplexStreamed).await;
    s.send(response_headers("application/json"), None).await;
    assert!(matches!(
        s.next().await.response,
        Some(Out::ResponseHeaders(_))
    ));
    assert_eq!(pod.inflight_counts(), (1, 0));
    assert_eq!(tokens_counted(&pod), 0.0);
}

/// Response headers seen but not the body (response_body_mode NONE): a streamed response's
/// tokens count until their estimated prefill end, then stop.
#[tokio::test]
async fn an_unseen_streamed_body_counts_the_prefill_by_its_estimate() {
    let mut h = harness(1 << 20).await;
    let (mut s, pod) = routed(&mut h, BodySendMode::None).await;
    s.send(response_headers("text/event-stream"), None).await;
    assert!(matches!(
        s.next().await.response,
        Some(Out::ResponseHeaders(_))
    ));
    assert_eq!(pod.inflight_counts().0, 1, "the request is still open");
    assert!(
        tokens_counted(&pod) > 0.0,
        "headers of a stream: its prefill is estimated, not over"
    );
    // The estimate is bounded: 1,000 tokens at the default prefill speed end well within 30 s.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while tokens_counted(&pod) > 0.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "estimated prefill never ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
