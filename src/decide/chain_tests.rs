//! Session keys on the live decision path: a chained Responses request goes to the pod holding
//! its previous response; body ids name sessions.

use super::tests::decider;
use super::*;
use crate::pods::LoadSample;

fn responses<'a>(body: &'a [u8], headers: &'a [(String, String)]) -> DecideRequest<'a> {
    DecideRequest {
        path: "/v1/responses",
        headers,
        body: Some(body),
        subset: None,
    }
}

fn chained(previous: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "m", "input": "and then?", "previous_response_id": previous
    }))
    .unwrap()
}

#[tokio::test]
async fn a_chained_response_goes_to_the_pod_holding_it_whatever_its_load() {
    let (d, reg) = decider(3, |_| {}).await;
    let pods: Vec<PodId> = reg
        .snapshot()
        .pods()
        .iter()
        .map(|p| p.id().clone())
        .collect();
    let holder = pods[1].clone();
    d.state
        .sessions()
        .set(SessionKey::response("resp_1"), holder.clone(), d.now_ms());
    // Saturated and far busier than the others: load alone sends everything elsewhere.
    reg.snapshot().get(&holder).unwrap().record_sample(
        Instant::now(),
        LoadSample {
            waiting: 50.0,
            running: 8.0,
            ..LoadSample::default()
        },
    );
    let by_load = d
        .plan(responses(&chained("resp_unknown"), &[]))
        .await
        .unwrap();
    assert_ne!(
        by_load.plan.endpoints[0], holder,
        "an unknown id routes by load"
    );
    for _ in 0..3 {
        let o = d.decide(responses(&chained("resp_1"), &[])).await.unwrap();
        assert_eq!(o.plan.endpoints, vec![holder.clone()], "the only candidate");
    }
    // A header session does not pull a chained request away from its response.
    let h = vec![("x-session-id".to_string(), "s".to_string())];
    d.state
        .sessions()
        .set(SessionKey::of("s"), pods[0].clone(), d.now_ms());
    let o = d.decide(responses(&chained("resp_1"), &h)).await.unwrap();
    assert_eq!(o.plan.endpoints, vec![holder.clone()]);
    // ...but names the session when the response is unknown.
    let o = d
        .plan(responses(&chained("resp_unknown"), &h))
        .await
        .unwrap();
    assert_eq!(o.plan.endpoints[0], pods[0]);
}

#[tokio::test]
async fn a_chained_response_whose_pod_is_no_candidate_routes_as_usual() {
    let (d, reg) = decider(2, |_| {}).await;
    let gone = PodId::new("127.0.0.1:9999");
    d.state
        .sessions()
        .set(SessionKey::response("resp_1"), gone, d.now_ms());
    let o = d.decide(responses(&chained("resp_1"), &[])).await.unwrap();
    let ids: Vec<PodId> = reg
        .snapshot()
        .pods()
        .iter()
        .map(|p| p.id().clone())
        .collect();
    assert!(ids.contains(&o.plan.endpoints[0]));
    assert_eq!(o.plan.ranked.len(), 2, "every pod stays a candidate");
}

#[tokio::test]
async fn a_prompt_cache_key_keeps_unrelated_prompts_on_one_pod() {
    let (d, _) = decider(4, |c| c.scorers.prefix.weight = 0.0).await;
    let body = |i: usize, key: &str| {
        serde_json::to_vec(&serde_json::json!({
            "model": "m", "prompt": format!("unrelated {i} ").repeat(40), "prompt_cache_key": key
        }))
        .unwrap()
    };
    fn completions(b: &[u8]) -> DecideRequest<'_> {
        DecideRequest {
            path: "/v1/completions",
            headers: &[],
            body: Some(b),
            subset: None,
        }
    }
    let b = body(0, "agent-1");
    let first = d.decide(completions(&b)).await.unwrap();
    for i in 1..4 {
        let b = body(i, "agent-1");
        let next = d.decide(completions(&b)).await.unwrap();
        assert_eq!(next.plan.endpoints[0], first.plan.endpoints[0]);
    }
}
