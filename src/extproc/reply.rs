//! ProcessingResponse builders, the wire names we own, and how a refusal reaches the client
//! (HTTP status and OpenAI error body: the edge decides them, not the decision path).

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

use crate::decide::DecideError;
use crate::flow::Refusal;
use crate::telemetry::ErrorKind;

/// Dynamic-metadata namespace override_host reads.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The destination key (metadata) and request header.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Where Envoy reports the endpoint it actually used.
pub const DESTINATION_SERVED_HEADER: &str = "x-gateway-destination-endpoint-served";
/// Namespace of a gateway's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset hint.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Routing headers only the router may set; a client's copies are removed.
pub const OWNED_HEADERS: &[&str] = &[DESTINATION_HEADER, DESTINATION_SERVED_HEADER, SUBSET_KEY];

/// Prefill-pod headers of llm-d's decode sidecar (older and newer name): always stripped from
/// clients, whatever `disaggregation.header` is, so no sidecar trusts a forged one.
pub const PREFILL_HEADERS: &[&str] = &[crate::config::DEFAULT_PREFILL_HEADER, "x-prefiller-url"];

/// The prefill half of a P/D decision's headers: `header` is always removed from the client's
/// request, and set to `pod` when the decision is disaggregated.
#[derive(Debug, Clone, Copy)]
pub struct Prefill<'a> {
    /// `disaggregation.header`.
    pub header: &'a str,
    /// The prefill pod (`ip:port`), if any.
    pub pod: Option<&'a str>,
}

impl Default for Prefill<'_> {
    fn default() -> Self {
        Self {
            header: crate::config::DEFAULT_PREFILL_HEADER,
            pod: None,
        }
    }
}

// llm-d echoes at 62 000 bytes: some Envoy deployments cap a streamed chunk at 64 KiB.
const ECHO_CHUNK: usize = 62_000;

fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            // Envoy reads raw_value; a value-only header arrives empty.
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        // Never append: an appended client value would come first.
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn strip(prefill_header: &str) -> HeaderMutation {
    let mut remove: Vec<String> = OWNED_HEADERS.iter().map(|h| h.to_string()).collect();
    for h in PREFILL_HEADERS.iter().copied().chain([prefill_header]) {
        if !remove.iter().any(|r| r == h) {
            remove.push(h.to_string());
        }
    }
    HeaderMutation {
        set_headers: vec![],
        remove_headers: remove,
    }
}

fn decision_mutation(destination: &str, set_header: bool, prefill: Prefill<'_>) -> HeaderMutation {
    let mut m = strip(prefill.header);
    if let Some(pod) = prefill.pod {
        // Overwritten in place, like the destination: the client's copy cannot survive.
        m.remove_headers.retain(|h| h != prefill.header);
        m.set_headers.push(header(prefill.header, pod));
    }
    if set_header {
        // The header names the primary only: ORIGINAL_DST clusters reject a list (503), while
        // override_host reads the full retry list from the metadata.
        let primary = destination.split(',').next().unwrap_or(destination);
        // Overwritten in place instead of removed, so it cannot be lost to mutation ordering.
        m.remove_headers.retain(|h| h != DESTINATION_HEADER);
        m.set_headers.push(header(DESTINATION_HEADER, primary));
    }
    m
}

fn metadata(destination: &str) -> Struct {
    let mut inner = Struct::default();
    inner.fields.insert(
        DESTINATION_HEADER.to_string(),
        Value {
            kind: Some(Kind::StringValue(destination.to_string())),
        },
    );
    let mut outer = Struct::default();
    outer.fields.insert(
        LB_NAMESPACE.to_string(),
        Value {
            kind: Some(Kind::StructValue(inner)),
        },
    );
    outer
}

fn common(mutation: Option<HeaderMutation>, clear_route_cache: bool) -> Option<CommonResponse> {
    Some(CommonResponse {
        header_mutation: mutation,
        clear_route_cache,
        ..Default::default()
    })
}

/// BUFFERED request headers: continue, minus the client's routing headers.
pub fn request_headers_strip() -> ProcessingResponse {
    request_headers_strip_pd(crate::config::DEFAULT_PREFILL_HEADER)
}

/// [`request_headers_strip`], also removing the configured prefill header.
pub fn request_headers_strip_pd(prefill_header: &str) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Out::RequestHeaders(HeadersResponse {
            response: common(Some(strip(prefill_header)), false),
        })),
        ..Default::default()
    }
}

/// Headers reply carrying the decision (body-less requests, FULL_DUPLEX_STREAMED).
pub fn request_headers_decision(destination: &str, set_header: bool) -> ProcessingResponse {
    request_headers_decision_pd(destination, set_header, Prefill::default())
}

/// [`request_headers_decision`] with the prefill pod's header.
pub fn request_headers_decision_pd(
    destination: &str,
    set_header: bool,
    prefill: Prefill<'_>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Out::RequestHeaders(HeadersResponse {
            response: common(
                Some(decision_mutation(destination, set_header, prefill)),
                true,
            ),
        })),
        dynamic_metadata: Some(metadata(destination)),
        ..Default::default()
    }
}

/// BUFFERED body reply carrying the decision (headers are still held, so the header applies).
pub fn request_body_decision(destination: &str, set_header: bool) -> ProcessingResponse {
    request_body_decision_pd(destination, set_header, Prefill::default())
}

/// [`request_body_decision`] with the prefill pod's header.
pub fn request_body_decision_pd(
    destination: &str,
    set_header: bool,
    prefill: Prefill<'_>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Out::RequestBody(BodyResponse {
            response: common(
                Some(decision_mutation(destination, set_header, prefill)),
                true,
            ),
        })),
        dynamic_metadata: Some(metadata(destination)),
        ..Default::default()
    }
}

/// A body chunk passed on unchanged (STREAMED: plain continue; FULL_DUPLEX: echoed).
pub fn request_body_continue(full_duplex: bool, chunk: Vec<u8>, eos: bool) -> ProcessingResponse {
    let response = if full_duplex {
        common_streamed(chunk, eos)
    } else {
        common(None, false)
    };
    ProcessingResponse {
        response: Some(Out::RequestBody(BodyResponse { response })),
        ..Default::default()
    }
}

fn common_streamed(chunk: Vec<u8>, eos: bool) -> Option<CommonResponse> {
    Some(CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                body: chunk,
                end_of_stream: eos,
                ..Default::default()
            })),
        }),
        ..Default::default()
    })
}

/// FULL_DUPLEX_STREAMED: the whole request body echoed in chunks of at most 62 000 bytes.
pub fn echo_body(body: Vec<u8>, eos: bool) -> Vec<ProcessingResponse> {
    echo_parts(vec![body], eos)
}

/// A chunk shorter than this is appended to the echo message before it rather than sent alone
/// (a body dribbled in tiny chunks is not echoed as as many tiny messages).
const ECHO_COALESCE: usize = 4096;

/// FULL_DUPLEX_STREAMED: a body echoed from the chunks it came in, in messages of at most
/// 62 000 bytes. A chunk that fits one message is moved into it, not copied; only a chunk too
/// long for one (past its first message) and chunks shorter than 4 KiB are copied, each byte
/// once.
pub fn echo_parts(parts: Vec<Vec<u8>>, eos: bool) -> Vec<ProcessingResponse> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    // Whether the last message is made of chunks shorter than ECHO_COALESCE (more may join it).
    let mut small_tail = false;
    for mut part in parts {
        if part.is_empty() {
            continue;
        }
        if part.len() < ECHO_COALESCE {
            match out.last_mut() {
                Some(last) if small_tail && last.len() + part.len() <= ECHO_CHUNK => {
                    // Grown once to a full message: its bytes are not moved again.
                    last.reserve_exact(ECHO_CHUNK - last.len());
                    last.extend_from_slice(&part);
                }
                _ => {
                    out.push(part);
                    small_tail = true;
                }
            }
            continue;
        }
        small_tail = false;
        // Cut from the end: each cut copies only its own bytes, and the first piece stays put.
        let mut tail = Vec::with_capacity(part.len().div_ceil(ECHO_CHUNK));
        while part.len() > ECHO_CHUNK {
            let at = (part.len() - 1) / ECHO_CHUNK * ECHO_CHUNK;
            tail.push(part.split_off(at));
        }
        out.push(part);
        out.extend(tail.into_iter().rev());
    }
    if out.is_empty() {
        return vec![request_body_continue(true, Vec::new(), eos)];
    }
    let n = out.len();
    out.into_iter()
        .enumerate()
        .map(|(i, c)| request_body_continue(true, c, eos && i + 1 == n))
        .collect()
}

/// Request trailers: continue.
pub fn request_trailers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Out::RequestTrailers(TrailersResponse::default())),
        ..Default::default()
    }
}

/// Response headers: continue.
pub fn response_headers_continue() -> ProcessingResponse {
    response_headers_set(&[])
}

/// Response headers: continue, with these headers set (overwriting a backend's copies).
pub fn response_headers_set(set: &[(&str, String)]) -> ProcessingResponse {
    response_headers_mutation(set, &[])
}

/// Response headers: continue, with `set` set (overwriting a backend's copies) and `remove`
/// removed.
pub fn response_headers_mutation(set: &[(&str, String)], remove: &[&str]) -> ProcessingResponse {
    let mutation = (!set.is_empty() || !remove.is_empty()).then(|| HeaderMutation {
        set_headers: set.iter().map(|(k, v)| header(k, v)).collect(),
        remove_headers: remove.iter().map(|h| h.to_string()).collect(),
    });
    ProcessingResponse {
        response: Some(Out::ResponseHeaders(HeadersResponse {
            response: common(mutation, false),
        })),
        ..Default::default()
    }
}

/// Response body chunk, FULL_DUPLEX: echoed at once (SSE keeps its pace).
pub fn response_body_echo(chunk: Vec<u8>, eos: bool) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Out::ResponseBody(BodyResponse {
            response: common_streamed(chunk, eos),
        })),
        ..Default::default()
    }
}

/// Response body (buffered/streamed modes): continue.
pub fn response_body_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Out::ResponseBody(BodyResponse {
            response: common(None, false),
        })),
        ..Default::default()
    }
}

/// Response trailers: continue.
pub fn response_trailers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Out::ResponseTrailers(TrailersResponse::default())),
        ..Default::default()
    }
}

/// Why the router answers the client itself instead of routing the request.
#[derive(Debug, PartialEq)]
pub enum Rejection {
    /// No decision could be made.
    Decide(DecideError),
    /// The body exceeds the configured limit (bytes).
    BodyTooLarge(usize),
    /// The router's budget of buffered body bytes (all streams) is spent: retry shortly.
    Overloaded,
    /// Flow control refused the request (every pod saturated): retry after this many seconds.
    Queue(Refusal, u64),
    /// Conformance hooks: no healthy pod matches the `test-epp-endpoint-selection` header.
    Unselected,
}

impl From<DecideError> for Rejection {
    fn from(e: DecideError) -> Self {
        Rejection::Decide(e)
    }
}

impl Rejection {
    /// HTTP status for the client.
    pub fn status(&self) -> u16 {
        match self {
            Rejection::Decide(DecideError::NoHealthyPod | DecideError::EmptySubset) => 503,
            Rejection::Unselected => 503,
            Rejection::Decide(DecideError::ModelNotFound(_)) => 404,
            Rejection::Decide(DecideError::BadRequest(_)) => 400,
            Rejection::BodyTooLarge(_) => 413,
            Rejection::Overloaded => 503,
            Rejection::Queue(..) => 429,
        }
    }

    /// The error counter's kind.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Rejection::Decide(e) => e.kind(),
            Rejection::BodyTooLarge(_) => ErrorKind::BodyTooLarge,
            Rejection::Overloaded => ErrorKind::BodyBudget,
            Rejection::Queue(..) => ErrorKind::FlowControl,
            Rejection::Unselected => ErrorKind::EmptySubset,
        }
    }

    /// Client-facing message (never prompt text).
    pub fn message(&self) -> String {
        match self {
            Rejection::Decide(e) => e.to_string(),
            Rejection::BodyTooLarge(limit) => {
                format!("request body exceeds the {limit}-byte limit")
            }
            Rejection::Overloaded => {
                "the router is buffering too many request bodies; retry shortly".to_string()
            }
            Rejection::Unselected => {
                "no healthy inference pod matches the test-epp-endpoint-selection header".into()
            }
            Rejection::Queue(r, _) => match r {
                Refusal::QueueFull => "every pod is saturated and the router's queue is full",
                Refusal::Timeout => "every pod is saturated and the request waited too long",
                Refusal::Shed => "every pod is saturated and this request's priority is shed",
            }
            .to_string(),
        }
    }

    /// OpenAI-style JSON error body.
    pub fn openai_body(&self) -> Vec<u8> {
        let (ty, code) = match self {
            Rejection::Decide(DecideError::NoHealthyPod | DecideError::EmptySubset)
            | Rejection::Unselected => ("ServiceUnavailableError", "no_healthy_upstream"),
            Rejection::Decide(DecideError::ModelNotFound(_)) => {
                ("NotFoundError", "model_not_found")
            }
            Rejection::Decide(DecideError::BadRequest(_)) => ("BadRequestError", "invalid_request"),
            Rejection::BodyTooLarge(_) => ("RequestTooLargeError", "request_too_large"),
            Rejection::Overloaded => ("ServiceUnavailableError", "router_overloaded"),
            Rejection::Queue(r, _) => ("RateLimitError", r.as_str()),
        };
        serde_json::to_vec(&serde_json::json!({
            "error": { "message": self.message(), "type": ty, "param": null, "code": code }
        }))
        .expect("static JSON")
    }
}

/// Asks Envoy to wait `ms` for the reply to the message it sent last, instead of its
/// `message_timeout` (once per message; ignored above the filter's `max_message_timeout`).
pub fn extend_timeout(ms: u64) -> ProcessingResponse {
    ProcessingResponse {
        override_message_timeout: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: (ms / 1000) as i64,
            nanos: ((ms % 1000) * 1_000_000) as i32,
        }),
        ..Default::default()
    }
}

/// A client-visible error with an OpenAI-style JSON body.
pub fn immediate_error(r: &Rejection) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Out::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(r.status()),
            }),
            headers: Some(HeaderMutation {
                set_headers: match r {
                    Rejection::Queue(_, after) => vec![
                        header("content-type", "application/json"),
                        header("retry-after", &after.to_string()),
                    ],
                    _ => vec![header("content-type", "application/json")],
                },
                remove_headers: vec![],
            }),
            body: r.openai_body(),
            details: format!("kv_router_{}", r.kind().as_str()),
            ..Default::default()
        })),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejections_map_to_statuses_and_openai_bodies() {
        let cases = [
            (
                Rejection::Decide(DecideError::NoHealthyPod),
                503,
                "no_healthy_upstream",
            ),
            (
                Rejection::Decide(DecideError::EmptySubset),
                503,
                "no_healthy_upstream",
            ),
            (
                Rejection::Decide(DecideError::ModelNotFound("m".into())),
                404,
                "model_not_found",
            ),
            (
                Rejection::Decide(DecideError::BadRequest(
                    crate::request::RequestError::NotAnObject,
                )),
                400,
                "invalid_request",
            ),
            (Rejection::BodyTooLarge(10), 413, "request_too_large"),
            (Rejection::Queue(Refusal::Timeout, 2), 429, "queue_timeout"),
            (Rejection::Queue(Refusal::QueueFull, 2), 429, "queue_full"),
            (Rejection::Queue(Refusal::Shed, 2), 429, "shed"),
        ];
        for (r, status, code) in cases {
            assert_eq!(r.status(), status, "{r:?}");
            let body: serde_json::Value = serde_json::from_slice(&r.openai_body()).unwrap();
            assert_eq!(body["error"]["code"], code, "{r:?}");
            assert!(body["error"]["message"].is_string());
        }
    }

    #[test]
    fn echo_chunks_cover_the_body_and_end_once() {
        let body: Vec<u8> = (0..150_000u32).map(|i| i as u8).collect();
        let (bodies, eos) = echoed(echo_body(body.clone(), true));
        assert_eq!(bodies.len(), 3);
        assert!(bodies.iter().all(|b| b.len() <= ECHO_CHUNK));
        assert_eq!((bodies.concat(), eos), (body, 1));
    }

    /// Bodies of the messages, and how many carry end of stream.
    fn echoed(msgs: Vec<ProcessingResponse>) -> (Vec<Vec<u8>>, usize) {
        let mut eos = 0;
        let bodies = msgs
            .into_iter()
            .map(|m| {
                let Some(Out::RequestBody(b)) = m.response else {
                    panic!("body reply")
                };
                let Some(Mutation::StreamedResponse(s)) =
                    b.response.unwrap().body_mutation.unwrap().mutation
                else {
                    panic!("streamed")
                };
                eos += usize::from(s.end_of_stream);
                s.body
            })
            .collect();
        (bodies, eos)
    }

    #[test]
    fn echoed_parts_are_moved_not_copied_and_tiny_ones_are_packed() {
        let byte = |i: usize| (i % 251) as u8;
        // 30 tiny chunks, a 50 KB one, a 130 KB one, 5 tiny ones.
        let mut sizes = vec![100; 30];
        sizes.extend([50_000, 130_000]);
        sizes.extend([10; 5]);
        let mut at = 0;
        let parts: Vec<Vec<u8>> = sizes
            .iter()
            .map(|&n| {
                let p = (at..at + n).map(byte).collect();
                at += n;
                p
            })
            .collect();
        let whole: Vec<u8> = parts.concat();
        let (mid, big) = (parts[30].as_ptr(), parts[31].as_ptr());
        let (bodies, eos) = echoed(echo_parts(parts, true));
        assert_eq!((bodies.concat(), eos), (whole, 1));
        assert!(bodies
            .iter()
            .all(|b| !b.is_empty() && b.len() <= ECHO_CHUNK));
        // tiny ×30 | 50 KB | 62 000 | 62 000 | 6 000 | tiny ×5
        let lens: Vec<usize> = bodies.iter().map(Vec::len).collect();
        assert_eq!(lens, [3_000, 50_000, 62_000, 62_000, 6_000, 50]);
        assert_eq!(
            bodies[1].as_ptr(),
            mid,
            "a chunk that fits a message is moved"
        );
        assert_eq!(
            bodies[2].as_ptr(),
            big,
            "a long chunk's first message stays in place"
        );
        let (bodies, eos) = echoed(echo_parts(Vec::new(), false));
        assert_eq!((bodies, eos), (vec![Vec::new()], 0));
    }

    fn mutation(r: ProcessingResponse) -> HeaderMutation {
        match r.response {
            Some(Out::RequestBody(b)) => b.response.unwrap().header_mutation.unwrap(),
            Some(Out::RequestHeaders(h)) => h.response.unwrap().header_mutation.unwrap(),
            _ => panic!("a request reply"),
        }
    }

    #[test]
    fn the_prefill_header_is_stripped_everywhere_and_set_only_by_a_pd_decision() {
        let custom = "x-pd-prefill";
        let strips = |m: &HeaderMutation, h: &str| m.remove_headers.iter().any(|r| r == h);
        for m in [
            mutation(request_headers_strip_pd(custom)),
            mutation(request_body_decision_pd(
                "10.0.0.5:8000",
                true,
                Prefill {
                    header: custom,
                    pod: None,
                },
            )),
            mutation(request_headers_decision("10.0.0.5:8000", false)),
        ] {
            for h in PREFILL_HEADERS {
                assert!(strips(&m, h), "{h} in {m:?}");
            }
            assert!(m.set_headers.iter().all(|h| {
                let k = &h.header.as_ref().unwrap().key;
                k != custom && !PREFILL_HEADERS.contains(&k.as_str())
            }));
        }
        assert!(strips(&mutation(request_headers_strip_pd(custom)), custom));
        let pd = Prefill {
            header: custom,
            pod: Some("10.0.0.9:8000"),
        };
        for m in [
            mutation(request_body_decision_pd("10.0.0.5:8000", true, pd)),
            mutation(request_headers_decision_pd("10.0.0.5:8000", false, pd)),
        ] {
            let set = m
                .set_headers
                .iter()
                .find(|h| h.header.as_ref().unwrap().key == custom)
                .expect("the prefill header is set");
            assert_eq!(set.header.as_ref().unwrap().raw_value, b"10.0.0.9:8000");
            assert_eq!(
                set.append_action,
                HeaderAppendAction::OverwriteIfExistsOrAdd as i32
            );
            assert!(!strips(&m, custom), "set in place, not removed after");
            assert!(strips(&m, "x-prefiller-host-port") && strips(&m, "x-prefiller-url"));
        }
    }

    #[test]
    fn decision_overwrites_and_strips() {
        let r = request_body_decision("10.0.0.5:8000,10.0.0.6:8000", true);
        let Some(Out::RequestBody(b)) = r.response else {
            panic!()
        };
        let m = b.response.unwrap().header_mutation.unwrap();
        assert_eq!(
            m.set_headers[0].header.as_ref().unwrap().raw_value,
            b"10.0.0.5:8000",
            "the header names the primary only"
        );
        assert_eq!(
            m.set_headers[0].append_action,
            HeaderAppendAction::OverwriteIfExistsOrAdd as i32
        );
        assert!(m
            .remove_headers
            .contains(&DESTINATION_SERVED_HEADER.to_string()));
        let md = r.dynamic_metadata.unwrap();
        let Some(Kind::StructValue(lb)) = &md.fields[LB_NAMESPACE].kind else {
            panic!()
        };
        assert!(
            matches!(&lb.fields[DESTINATION_HEADER].kind, Some(Kind::StringValue(s)) if s == "10.0.0.5:8000,10.0.0.6:8000")
        );
        let no_header = request_body_decision("10.0.0.5:8000", false);
        let Some(Out::RequestBody(b)) = no_header.response else {
            panic!()
        };
        let m = b.response.unwrap().header_mutation.unwrap();
        assert!(
            m.set_headers.is_empty() && m.remove_headers.contains(&DESTINATION_HEADER.to_string())
        );
    }
}
