//! A Responses conversation through the real Envoy (full-duplex, so the router sees responses):
//! a request chaining `previous_response_id` reaches the pod that produced and stores that
//! response even while load points elsewhere. Any other pod answers 404, as vLLM does.

use crate::common;

use std::time::{Duration, Instant};

use common::{post_to, served_by, text, Deployment};
use serde_json::{json, Value};

const FULL_DUPLEX: &str = "gie-full-duplex.yaml";

/// Fast pods with two request slots each: more requests wait, and the router sees the queue.
const SIM: [&str; 8] = [
    "--ttft-base-ms",
    "1",
    "--prefill-us-per-token",
    "1",
    "--decode-ms-per-token",
    "1",
    "--max-num-seqs",
    "2",
];

const INSTRUCTIONS: &str = "You are a coding agent. Answer with the next tool call.";

/// The router's dry-run choice for a Responses request.
async fn explain_first(d: &Deployment, body: &Value) -> String {
    let router = d.router.as_ref().expect("router");
    let v: Value = d
        .client
        .post(format!("{}/debug/explain", router.admin_url()))
        .json(&json!({"path": "/v1/responses", "body": body}))
        .send()
        .await
        .expect("explain")
        .json()
        .await
        .expect("explain JSON");
    v["ranked"][0]["pod"]
        .as_str()
        .unwrap_or_else(|| panic!("explain without a ranking: {v}"))
        .to_string()
}

#[tokio::test]
async fn a_chained_response_returns_to_its_pod_even_when_load_points_elsewhere() {
    // Receipts stay off: the router learns response ids wherever it sees the responses.
    let d = Deployment::start_sims(&SIM, 3, &[FULL_DUPLEX], |_| {}).await;
    let first = json!({"model": "sim-model", "instructions": INSTRUCTIONS,
                       "input": text(1, 2000), "max_output_tokens": 4});
    let o = d.post(0, "/v1/responses", &first, &[]).await;
    let holder = served_by(&o, &d.diag());
    let resp: Value = serde_json::from_str(&o.body).expect("a response object");
    let id = resp["id"].as_str().expect("response id").to_string();

    // Keep the holder busy straight from the side: long generations, more than its slots.
    let url = format!("http://{holder}");
    let load: Vec<_> = (0..16)
        .map(|i| {
            let (client, url) = (d.client.clone(), url.clone());
            tokio::spawn(async move {
                let body = json!({"model": "sim-model", "prompt": text(100 + i, 400),
                                  "max_tokens": 800, "ignore_eos": true});
                post_to(&client, &url, "/v1/completions", &body, &[]).await
            })
        })
        .collect();

    let chained = json!({"model": "sim-model", "instructions": INSTRUCTIONS,
                         "previous_response_id": id, "input": "The tool returned 3 lines.",
                         "max_output_tokens": 4});
    let mut unchained = chained.clone();
    unchained
        .as_object_mut()
        .unwrap()
        .remove("previous_response_id");
    let deadline = Instant::now() + Duration::from_secs(10);
    while explain_first(&d, &unchained).await == holder {
        assert!(
            Instant::now() < deadline,
            "the router never saw the holder's load{}",
            d.diag()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let o = d.post(0, "/v1/responses", &chained, &[]).await;
    assert_eq!(
        o.status,
        Some(200),
        "the chained request reached a pod without its response: {}{}",
        o.body,
        d.diag()
    );
    assert_eq!(served_by(&o, &d.diag()), holder);
    let resp: Value = serde_json::from_str(&o.body).expect("a response object");
    assert_eq!(resp["previous_response_id"], id.as_str());
    assert!(
        resp["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
            > 0,
        "the stored conversation's blocks are hits on its pod: {resp}"
    );
    for l in load {
        let _ = l.await;
    }
    let metrics = d
        .router
        .as_ref()
        .expect("router")
        .metrics()
        .await
        .expect("metrics");
    assert!(
        !metrics.contains("kv_router_route_"),
        "receipts' families appear only with receipts enabled"
    );
}
