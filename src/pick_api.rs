//! The project's own `Pick` gRPC service (proto/kvrouter.proto): the ext_proc decision for
//! callers that are not Envoy, on the exact same code path.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::decide::{DecideRequest, Decider, Decision, ScoredPod};

/// Generated protobuf types and service stubs.
pub mod proto {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("kvrouter.v1");
}

use proto::picker_server::Picker;
use proto::{PickRequest, PickResponse, ScoredEndpoint};

/// The Pick service.
#[derive(Clone)]
pub struct PickService {
    decider: Arc<Decider>,
}

impl PickService {
    /// Over the shared decision path.
    pub fn new(decider: Arc<Decider>) -> Self {
        Self { decider }
    }
}

fn endpoint(s: &ScoredPod) -> ScoredEndpoint {
    ScoredEndpoint {
        address: s.pod.to_string(),
        score: s.total,
        scores: s.scores.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        matched_blocks: s.matched_blocks,
    }
}

/// Converts a decision to the wire answer.
pub fn to_response(d: &Decision) -> PickResponse {
    PickResponse {
        endpoints: d
            .endpoints
            .iter()
            .filter_map(|id| d.ranked.iter().find(|s| &s.pod == id))
            .map(endpoint)
            .collect(),
        reason: d.reason.as_str().to_string(),
        model: d.model.clone().unwrap_or_default(),
        total_blocks: d.total_blocks as u32,
        candidates: d.ranked.iter().map(endpoint).collect(),
    }
}

#[tonic::async_trait]
impl Picker for PickService {
    async fn pick(&self, request: Request<PickRequest>) -> Result<Response<PickResponse>, Status> {
        let r = request.into_inner();
        let headers: Vec<(String, String)> = r
            .headers
            .into_iter()
            .map(|(k, v)| (k.to_ascii_lowercase(), v))
            .collect();
        let subset = (!r.subset.is_empty()).then_some(r.subset);
        let decision = self
            .decider
            .decide(DecideRequest {
                path: &r.path,
                headers: &headers,
                body: (!r.body.is_empty()).then_some(r.body.as_slice()),
                subset: subset.as_deref(),
                dry_run: r.dry_run,
            })
            .await
            .map_err(|e| match e.status() {
                400 | 413 => Status::invalid_argument(e.to_string()),
                404 => Status::not_found(e.to_string()),
                _ => Status::unavailable(e.to_string()),
            })?;
        // A caller outside Envoy owns the request's lifetime; the guard settles on the next scrape.
        Ok(Response::new(to_response(&decision)))
    }
}
