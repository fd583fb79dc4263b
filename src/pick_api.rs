//! The project's own `Pick` gRPC service (proto/kvrouter.proto): the ext_proc decision for
//! callers that are not Envoy, on the exact same code path. A pick only ranks unless the caller
//! asks to commit it.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::decide::{DecideError, DecideRequest, Decider, Decision, ScoredPod};

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

fn to_response(d: &Decision) -> PickResponse {
    let p = &d.plan;
    PickResponse {
        endpoints: p
            .endpoints
            .iter()
            .filter_map(|id| p.ranked.iter().find(|s| &s.pod == id))
            .map(endpoint)
            .collect(),
        reason: p.reason.as_str().to_string(),
        model: d.model.clone().unwrap_or_default(),
        total_blocks: p.total_blocks as u32,
        candidates: p.ranked.iter().map(endpoint).collect(),
    }
}

fn status(e: &DecideError) -> Status {
    match e {
        DecideError::BadRequest(_) => Status::invalid_argument(e.to_string()),
        DecideError::ModelNotFound(_) => Status::not_found(e.to_string()),
        DecideError::NoHealthyPod | DecideError::EmptySubset => Status::unavailable(e.to_string()),
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
        let req = DecideRequest {
            path: &r.path,
            headers: &headers,
            body: (!r.body.is_empty()).then_some(r.body.as_slice()),
            subset: subset.as_deref(),
        };
        let decision = if r.commit {
            self.decider.decide(req).await
        } else {
            self.decider.plan(req).await
        }
        .map_err(|e| status(&e))?;
        // A caller outside Envoy owns the request's lifetime: a committed request's load is
        // released here and settles on the pod's next scrape.
        Ok(Response::new(to_response(&decision)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn service() -> (PickService, Arc<Decider>) {
        let (decider, _) = crate::decide::tests::decider(3, |_| {}).await;
        let decider = Arc::new(decider);
        (PickService::new(decider.clone()), decider)
    }

    fn pick(commit: bool) -> Request<PickRequest> {
        let prompt = "a long shared system prompt ".repeat(30);
        Request::new(PickRequest {
            path: "/v1/completions".into(),
            body: serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": prompt})).unwrap(),
            commit,
            ..Default::default()
        })
    }

    #[tokio::test]
    async fn a_pick_records_only_when_committed() {
        let (svc, decider) = service().await;
        let r = svc.pick(pick(false)).await.unwrap().into_inner();
        assert_eq!(r.reason, "scored");
        assert_eq!(r.endpoints.len(), 3);
        assert_eq!(r.candidates.len(), 3);
        assert_eq!(
            decider.index().stats().entries,
            0,
            "a plain pick records nothing"
        );
        let first = svc.pick(pick(true)).await.unwrap().into_inner();
        assert!(
            decider.index().stats().entries > 0,
            "a committed pick teaches the index"
        );
        let again = svc.pick(pick(false)).await.unwrap().into_inner();
        assert_eq!(again.endpoints[0].address, first.endpoints[0].address);
        assert!(again.endpoints[0].matched_blocks > 0.0);
    }

    #[tokio::test]
    async fn an_empty_subset_is_unavailable() {
        let (svc, _) = service().await;
        let mut req = pick(false);
        req.get_mut().subset = vec!["10.0.0.1".into()];
        assert_eq!(
            svc.pick(req).await.unwrap_err().code(),
            tonic::Code::Unavailable
        );
    }
}
