//! The project's own `Pick` gRPC service (proto/kvrouter.proto): the ext_proc decision for
//! callers that are not Envoy, on the exact same code path. A pick only ranks unless the caller
//! asks to commit it.
//!
//! - **Who may call**: anyone who reaches the gRPC port it shares with ext_proc
//!   ([`super::grpc`]).
//! - **What a caller may change**: nothing by default. With `pick_api.allow_commit`, a pick with
//!   `commit` records its decision (index entries, session pin, in-flight load until the pod's
//!   next scrape); with `pick_api.allow_subset` a caller narrows the candidates.
//! - **Memory**: each message at most `pick_api.max_message_bytes`, its announced length reserved
//!   from Pick's own budget (`pick_api.max_buffered_bytes`, apart from ext_proc's) before a byte
//!   of it is buffered, and given back if the message and the body's end do not come within
//!   `server.message_timeout_ms` ([`super::metered`]).

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::config::PickApiConfig;
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
    allowed: PickApiConfig,
}

impl PickService {
    /// Over the shared decision path; `allowed` says whether callers may commit or name a subset.
    pub fn new(decider: Arc<Decider>, allowed: PickApiConfig) -> Self {
        Self { decider, allowed }
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
        prefill_endpoint: p.prefill_pod().map(|q| q.to_string()).unwrap_or_default(),
        pd_outcome: p
            .pd
            .as_ref()
            .map(|pd| pd.outcome.as_str().to_string())
            .unwrap_or_default(),
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
        // Anyone who reaches the gRPC port can call Pick: writes are opt-in (pick_api.*).
        if r.commit && !self.allowed.allow_commit {
            return Err(Status::permission_denied(
                "Pick with commit is disabled (pick_api.allow_commit: false)",
            ));
        }
        if !r.subset.is_empty() && !self.allowed.allow_subset {
            return Err(Status::permission_denied(
                "Pick with a subset is disabled (pick_api.allow_subset: false)",
            ));
        }
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
        let open = PickApiConfig {
            allow_commit: true,
            allow_subset: true,
            ..PickApiConfig::default()
        };
        (PickService::new(decider.clone(), open), decider)
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
    async fn by_default_a_caller_can_neither_commit_nor_choose_a_subset() {
        let (decider, _) = crate::decide::tests::decider(3, |_| {}).await;
        let decider = Arc::new(decider);
        let svc = PickService::new(decider.clone(), PickApiConfig::default());
        let err = svc.pick(pick(true)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::PermissionDenied);
        let mut req = pick(false);
        req.get_mut().subset = vec!["127.0.0.1:8000".into()];
        let err = svc.pick(req).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::PermissionDenied);
        assert_eq!(decider.index().stats().entries, 0, "nothing recorded");
        assert_eq!(
            svc.pick(pick(false))
                .await
                .unwrap()
                .into_inner()
                .endpoints
                .len(),
            3
        );
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

    /// Pick answers both pods of a disaggregated request, and says when it is not one.
    #[tokio::test]
    async fn pick_names_the_prefill_pod_of_a_disaggregated_request() {
        use crate::config::PodRole;
        let (decider, _) = crate::decide::tests::decider(4, |c| {
            for (i, p) in c.pods.static_pods.iter_mut().enumerate() {
                p.role = Some(if i < 2 {
                    PodRole::Prefill
                } else {
                    PodRole::Decode
                });
            }
            c.disaggregation.threshold_tokens = 16;
        })
        .await;
        let svc = PickService::new(Arc::new(decider), PickApiConfig::default());
        let prefill = ["127.0.0.1:8000", "127.0.0.1:8001"];
        let r = svc.pick(pick(false)).await.unwrap().into_inner();
        assert_eq!(r.pd_outcome, "disaggregated");
        assert!(prefill.contains(&r.prefill_endpoint.as_str()), "{r:?}");
        assert!(
            !prefill.contains(&r.endpoints[0].address.as_str()),
            "the destination is a decode pod: {r:?}"
        );
        let short = Request::new(PickRequest {
            path: "/v1/completions".into(),
            body: br#"{"model": "m", "prompt": "hi"}"#.to_vec(),
            ..Default::default()
        });
        let r = svc.pick(short).await.unwrap().into_inner();
        assert_eq!(r.pd_outcome, "short_or_cached");
        assert_eq!(r.prefill_endpoint, "", "{r:?}");
    }
}
