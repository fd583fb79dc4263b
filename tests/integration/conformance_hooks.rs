//! The Gateway API Inference Extension's conformance-test hooks through real Envoy
//! (`gie-full-duplex.yaml`: the gateway reports the served endpoint at response headers), the
//! real kv-router and simulated pods, with the request shapes the suite sends: with
//! `conformance_test_hooks` on, `test-epp-endpoint-selection` decides the pod and the three
//! `x-conformance-test-*` headers report it; off, the header changes nothing.

use crate::common;

use common::{completion, served_by, text, Deployment};
use serde_json::json;

const FULL_DUPLEX: &str = "gie-full-duplex.yaml";
const SELECTION: &str = "test-epp-endpoint-selection";

/// The suite's own request body (its prompt and model name; the simulated pods serve any model).
fn suite_body() -> serde_json::Value {
    json!({"model": "sim-model", "prompt": "Write as if you were a critic: San Francisco", "max_tokens": 4})
}

#[tokio::test]
async fn the_selection_header_picks_the_pod_and_the_report_headers_say_where_it_went() {
    let d = Deployment::start_with(3, &[FULL_DUPLEX], |c| c.conformance_test_hooks = true).await;
    let addrs: Vec<String> = d.addrs().iter().map(|a| a.to_string()).collect();
    // Each pod in turn, several times: the same prompt would otherwise stay on its holder.
    for _ in 0..2 {
        for a in &addrs {
            let o = d
                .post(0, "/v1/completions", &suite_body(), &[(SELECTION, a)])
                .await;
            assert_eq!(&served_by(&o, &d.diag()), a, "selection {a} not honoured");
            assert_eq!(
                o.header("x-conformance-test-served-endpoint"),
                Some(a.as_str())
            );
            assert_eq!(
                o.header("x-conformance-test-selected-endpoint"),
                Some(a.as_str())
            );
            // The pods are a static list: no InferencePool to report.
            assert_eq!(o.header("x-conformance-test-epp-pool"), None);
        }
    }
    // A list: the requests stay within it (how they spread inside it is the router's choice);
    // the gateway's report always matches the router's pick.
    let pair = format!("{}, {}", addrs[1], addrs[2]);
    for i in 0..12 {
        let body = completion(&format!("Topic {i}. {}", text(70 + i, 600)), 4);
        let o = d
            .post(0, "/v1/completions", &body, &[(SELECTION, &pair)])
            .await;
        let pod = served_by(&o, &d.diag());
        assert!(
            pod != addrs[0],
            "request {i} left the selection {pair}: {pod}"
        );
        assert_eq!(
            o.header("x-conformance-test-served-endpoint"),
            Some(pod.as_str())
        );
        assert_eq!(
            o.header("x-conformance-test-selected-endpoint"),
            Some(pod.as_str())
        );
    }
    // Every entry counts, not the first alone: an unknown first entry leaves the second.
    let list = format!("10.255.255.1, {}", addrs[2]);
    let o = d
        .post(0, "/v1/completions", &suite_body(), &[(SELECTION, &list)])
        .await;
    assert_eq!(served_by(&o, &d.diag()), addrs[2], "selection {list}");
    // Nothing matches: 503 with a reason naming the header, and no pod reached.
    let o = d
        .post(
            0,
            "/v1/completions",
            &suite_body(),
            &[(SELECTION, "10.255.255.1")],
        )
        .await;
    assert_eq!(o.status, Some(503), "{o:?}{}", d.diag());
    assert!(o.body.contains(SELECTION), "no reason given: {}", o.body);
    assert_eq!(o.pod(), None);
    // No header: routed as usual, and still reported.
    let o = d.post(0, "/v1/completions", &suite_body(), &[]).await;
    let pod = served_by(&o, &d.diag());
    assert_eq!(
        o.header("x-conformance-test-served-endpoint"),
        Some(pod.as_str())
    );
}

#[tokio::test]
async fn with_the_hooks_off_the_selection_header_changes_nothing() {
    let d = Deployment::start(3, &[FULL_DUPLEX]).await;
    let addrs: Vec<String> = d.addrs().iter().map(|a| a.to_string()).collect();
    let prefix = text(81, 3000);
    let body = |i: usize| completion(&format!("{prefix} question {i}"), 4);
    let first = d.post(0, "/v1/completions", &body(0), &[]).await;
    let holder = served_by(&first, &d.diag());
    for (i, other) in addrs.iter().filter(|a| **a != holder).enumerate() {
        let o = d
            .post(0, "/v1/completions", &body(i + 1), &[(SELECTION, other)])
            .await;
        assert_eq!(
            served_by(&o, &d.diag()),
            holder,
            "hooks off, yet {SELECTION}: {other} moved it"
        );
        assert!(
            o.headers
                .iter()
                .all(|(k, _)| !k.starts_with("x-conformance-test-")),
            "hooks off, yet reported: {:?}",
            o.headers
        );
    }
    let o = d
        .post(
            0,
            "/v1/completions",
            &body(9),
            &[(SELECTION, "10.255.255.1")],
        )
        .await;
    assert_eq!(
        served_by(&o, &d.diag()),
        holder,
        "hooks off: an unknown selection must not refuse"
    );
}
