//! NEGATIVE CONTROL, not a picker to deploy: a tiny round-robin endpoint picker the suite's own
//! tests run (hidden subcommand `epp-conformance control-picker`) to show the suite tells right
//! from wrong. Without a flaw it speaks the Endpoint Picker Protocol in both body modes, with the
//! GIE conformance hooks on, and passes every case; each [`Flaw`] breaks one rule, and the tests
//! assert that exactly the cases checking that rule fail.

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::cases::{SELECTED, SELECTION, SERVED};

/// The rule a negative control breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Flaw {
    /// None: a correct picker.
    None,
    /// Ignores `test-epp-endpoint-selection` (routes round robin over every candidate).
    IgnoreSelection,
    /// Steers by a client's `x-gateway-destination-endpoint` and passes a client's
    /// `x-prefiller-host-port` on to the pod.
    TrustClientHeaders,
}

const DESTINATION: &str = "x-gateway-destination-endpoint";
const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
const PREFILL: &str = "x-prefiller-host-port";

#[derive(Clone)]
struct Control {
    pods: Arc<Vec<SocketAddr>>,
    turn: Arc<AtomicUsize>,
    flaw: Flaw,
}

/// Serves the control picker's ext_proc and gRPC health on `127.0.0.1:grpc_port` until killed.
pub async fn serve(grpc_port: u16, pods: Vec<SocketAddr>, flaw: Flaw) -> anyhow::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    for s in [
        "",
        "inference-extension",
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        reporter
            .set_service_status(s, tonic_health::ServingStatus::Serving)
            .await;
    }
    let control = Control {
        pods: Arc::new(pods),
        turn: Arc::new(AtomicUsize::new(0)),
        flaw,
    };
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(ExternalProcessorServer::new(control))
        .serve(SocketAddr::from(([127, 0, 0, 1], grpc_port)))
        .await?;
    Ok(())
}

type Tx = mpsc::Sender<Result<ProcessingResponse, Status>>;

#[tonic::async_trait]
impl ExternalProcessor for Control {
    type ProcessStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

    async fn process(
        &self,
        req: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let me = self.clone();
        tokio::spawn(async move { me.stream(inbound, tx).await });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

fn header_values(h: Option<&HeaderMap>) -> Vec<(String, String)> {
    h.map(|m| {
        m.headers
            .iter()
            .map(|h| {
                let v = match h.raw_value.is_empty() {
                    true => h.value.clone(),
                    false => String::from_utf8_lossy(&h.raw_value).into_owned(),
                };
                (h.key.to_ascii_lowercase(), v)
            })
            .collect()
    })
    .unwrap_or_default()
}

fn find<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

fn string_at(meta: Option<&Metadata>, ns: &str, key: &str) -> Option<Kind> {
    meta?.filter_metadata.get(ns)?.fields.get(key)?.kind.clone()
}

/// Whether a selection or subset entry (`ip`, `ip:port`, `[v6]`, `[v6]:port`) names `pod`.
fn entry_matches(entry: &str, pod: SocketAddr) -> bool {
    let e = entry.trim();
    if let Ok(a) = e.parse::<SocketAddr>() {
        return a == pod;
    }
    let bare = e.trim_start_matches('[').trim_end_matches(']');
    bare.parse::<IpAddr>().is_ok_and(|ip| ip == pod.ip())
}

fn set(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn reply(out: Out) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(out),
        ..Default::default()
    }
}

fn immediate(code: i32, why: &str) -> ProcessingResponse {
    reply(Out::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus { code }),
        headers: Some(HeaderMutation {
            set_headers: vec![set("content-type", "application/json")],
            ..Default::default()
        }),
        body: serde_json::json!({"error": {"message": why}})
            .to_string()
            .into_bytes(),
        ..Default::default()
    }))
}

fn common(mutation: Option<HeaderMutation>, body: Option<Mutation>) -> Option<CommonResponse> {
    Some(CommonResponse {
        header_mutation: mutation,
        body_mutation: body.map(|m| BodyMutation { mutation: Some(m) }),
        ..Default::default()
    })
}

fn streamed(body: Vec<u8>, end_of_stream: bool) -> Option<Mutation> {
    Some(Mutation::StreamedResponse(StreamedBodyResponse {
        body,
        end_of_stream,
        ..Default::default()
    }))
}

#[derive(Default)]
struct State {
    full_duplex: bool,
    response_full_duplex: bool,
    headers: Vec<(String, String)>,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    chosen: Option<String>,
}

impl Control {
    async fn stream(self, mut inbound: Streaming<ProcessingRequest>, tx: Tx) {
        let mut st = State::default();
        let mut first = true;
        while let Some(Ok(msg)) = inbound.next().await {
            if first {
                first = false;
                if let Some(pc) = &msg.protocol_config {
                    let fd = BodySendMode::FullDuplexStreamed as i32;
                    st.full_duplex = pc.request_body_mode == fd;
                    st.response_full_duplex = pc.response_body_mode == fd;
                }
            }
            let meta = msg.metadata_context.as_ref();
            if let Some(Kind::ListValue(l)) = string_at(
                meta,
                "envoy.lb.subset_hint",
                "x-gateway-destination-endpoint-subset",
            ) {
                // The protocol's hint is a list of strings; anything else is no hint.
                let entries = l.values.iter().filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                });
                st.subset = Some(entries.collect());
            }
            let out: Vec<ProcessingResponse> = match msg.request {
                Some(In::RequestHeaders(h)) => {
                    st.headers = header_values(h.headers.as_ref());
                    if h.end_of_stream {
                        vec![self.decision(&mut st, true)]
                    } else if st.full_duplex {
                        vec![]
                    } else {
                        vec![reply(Out::RequestHeaders(HeadersResponse::default()))]
                    }
                }
                Some(In::RequestBody(b)) => {
                    st.body.extend_from_slice(&b.body);
                    if !b.end_of_stream {
                        vec![]
                    } else if serde_json::from_slice::<serde_json::Value>(&st.body).is_err() {
                        vec![immediate(400, "the request body is not JSON")]
                    } else {
                        self.decided(&mut st, true)
                    }
                }
                Some(In::RequestTrailers(_)) => {
                    let mut v = match st.chosen.is_none() && st.full_duplex {
                        true => self.decided(&mut st, false),
                        false => vec![],
                    };
                    v.push(reply(Out::RequestTrailers(TrailersResponse::default())));
                    v
                }
                Some(In::ResponseHeaders(_)) => {
                    let served = match string_at(meta, "envoy.lb", SERVED_KEY) {
                        Some(Kind::StringValue(s)) => s,
                        _ => "fail: missing destination endpoint served metadata".into(),
                    };
                    let mut set_headers = vec![set(SERVED, &served)];
                    if let Some(c) = &st.chosen {
                        set_headers.push(set(SELECTED, c.split(',').next().unwrap_or(c)));
                    }
                    let m = HeaderMutation {
                        set_headers,
                        ..Default::default()
                    };
                    vec![reply(Out::ResponseHeaders(HeadersResponse {
                        response: common(Some(m), None),
                    }))]
                }
                Some(In::ResponseBody(b)) => {
                    let body = match st.response_full_duplex {
                        true => streamed(b.body, b.end_of_stream),
                        false => None,
                    };
                    vec![reply(Out::ResponseBody(BodyResponse {
                        response: common(None, body),
                    }))]
                }
                Some(In::ResponseTrailers(_)) => {
                    vec![reply(Out::ResponseTrailers(TrailersResponse::default()))]
                }
                None => vec![],
            };
            let done = out
                .iter()
                .any(|r| matches!(r.response, Some(Out::ImmediateResponse(_))));
            for r in out {
                if tx.send(Ok(r)).await.is_err() {
                    return;
                }
            }
            if done {
                return;
            }
        }
    }

    /// The decision at the body's end: BUFFERED answers the body message; FULL_DUPLEX answers
    /// the headers, then echoes the body (`eos`: it ends the request).
    fn decided(&self, st: &mut State, eos: bool) -> Vec<ProcessingResponse> {
        let d = self.decision(st, st.full_duplex);
        if !st.full_duplex || matches!(d.response, Some(Out::ImmediateResponse(_))) {
            return vec![d];
        }
        let body = std::mem::take(&mut st.body);
        let echo = reply(Out::RequestBody(BodyResponse {
            response: common(None, streamed(body, eos)),
        }));
        vec![d, echo]
    }

    /// The routing reply: to the headers (`headers_reply`) or to the buffered body.
    fn decision(&self, st: &mut State, headers_reply: bool) -> ProcessingResponse {
        let mut candidates: Vec<SocketAddr> = self.pods.to_vec();
        if let Some(subset) = &st.subset {
            candidates.retain(|p| subset.iter().any(|e| entry_matches(e, *p)));
        }
        if self.flaw != Flaw::IgnoreSelection {
            if let Some(sel) = find(&st.headers, SELECTION) {
                candidates.retain(|p| sel.split(',').any(|e| entry_matches(e, *p)));
            }
        }
        let forged = find(&st.headers, DESTINATION).map(str::to_string);
        let dest = match (self.flaw, forged) {
            (Flaw::TrustClientHeaders, Some(f)) => f,
            _ if candidates.is_empty() => return immediate(503, "no endpoint matches"),
            _ => {
                let i = self.turn.fetch_add(1, Ordering::Relaxed) % candidates.len();
                candidates[i].to_string()
            }
        };
        st.chosen = Some(dest.clone());
        let remove_headers = match self.flaw {
            Flaw::TrustClientHeaders => vec![],
            _ => vec![PREFILL.to_string()],
        };
        let m = HeaderMutation {
            set_headers: vec![set(DESTINATION, &dest)],
            remove_headers,
        };
        let lb = Struct {
            fields: [(
                DESTINATION.to_string(),
                Value {
                    kind: Some(Kind::StringValue(dest)),
                },
            )]
            .into(),
        };
        let meta = Struct {
            fields: [(
                "envoy.lb".to_string(),
                Value {
                    kind: Some(Kind::StructValue(lb)),
                },
            )]
            .into(),
        };
        let response = Some(CommonResponse {
            header_mutation: Some(m),
            clear_route_cache: true,
            ..Default::default()
        });
        let out = match headers_reply {
            true => Out::RequestHeaders(HeadersResponse { response }),
            false => Out::RequestBody(BodyResponse { response }),
        };
        ProcessingResponse {
            response: Some(out),
            dynamic_metadata: Some(meta),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::entry_matches;

    #[test]
    fn entries_match_by_ip_or_exact_address() {
        let p = "127.0.0.4:8001".parse().unwrap();
        assert!(entry_matches("127.0.0.4", p));
        assert!(entry_matches(" 127.0.0.4:8001", p));
        assert!(!entry_matches("127.0.0.4:8002", p));
        let v6 = "[::1]:9000".parse().unwrap();
        for e in ["::1", "[::1]", "[::1]:9000"] {
            assert!(entry_matches(e, v6), "{e}");
        }
        assert!(!entry_matches("[::1]:9001", v6));
    }
}
