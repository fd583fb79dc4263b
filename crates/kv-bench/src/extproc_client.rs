//! Speaking ext_proc to a processor as Envoy would, without Envoy: the messages `kv-bench hostile`
//! and `kv-bench overhead`'s answer-time pass send straight to kv-router or the no-op processor.

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration,
};

/// Request headers of a `POST /v1/completions` JSON request, plus `extra`; the body follows.
pub fn headers(extra: &[(&str, String)]) -> In {
    let mut hs: Vec<(&str, String)> = vec![
        (":path", "/v1/completions".into()),
        (":method", "POST".into()),
        ("content-type", "application/json".into()),
    ];
    hs.extend(extra.iter().cloned());
    In::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: hs
                .into_iter()
                .map(|(k, v)| HeaderValue {
                    key: k.into(),
                    raw_value: v.into_bytes(),
                    ..Default::default()
                })
                .collect(),
        }),
        end_of_stream: false,
        ..Default::default()
    })
}

/// `request` as a message; `mode` announces the body send mode (Envoy sends it with the first).
pub fn message(request: In, mode: Option<BodySendMode>) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        protocol_config: mode.map(|m| ProtocolConfiguration {
            request_body_mode: m as i32,
            response_body_mode: m as i32,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A request body chunk.
pub fn body(bytes: Vec<u8>, end_of_stream: bool) -> In {
    In::RequestBody(HttpBody {
        body: bytes,
        end_of_stream,
        ..Default::default()
    })
}
