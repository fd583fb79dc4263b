//! End-to-end tests through the REAL Envoy 1.40 binary, the real kv-router and real vllm-sim
//! processes on 127.0.0.1 (random free ports). Every test builds its own deployment and drops it
//! (killing every process) at the end. Envoy missing = panic with instructions, never a skip.
//!
//! Run: `KV_ROUTER_ENVOY=/path/to/envoy cargo test --release --test integration e2e::`

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::deploy::reset_caches;
use common::runner::{self, RunOptions};
use common::workload::MultiturnSpec;
use common::{chat_stream, completion, served_by, text, Deployment};
use futures::StreamExt;
use serde_json::Value;

const BUFFERED: &str = "override-host-buffered.yaml";
const FULL_DUPLEX: &str = "gie-full-duplex.yaml";
const ORIGINAL_DST: &str = "original-dst.yaml";

/// Sends `n` completions sharing a `prefix_bytes` prefix (different suffixes) one after the
/// other through Envoy `envoy`; returns the serving pods.
async fn same_prefix_pods(
    d: &Deployment,
    envoy: usize,
    seed: u64,
    n: usize,
    stream: bool,
) -> Vec<String> {
    let prefix = text(seed, 3000);
    let mut pods = Vec::new();
    for i in 0..n {
        let prompt = format!(
            "{prefix} Now answer question number {i}: {}",
            text(seed * 100 + i as u64, 120)
        );
        let mut body = completion(&prompt, 4);
        if stream {
            body["stream"] = Value::Bool(true);
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        let o = d.post(envoy, "/v1/completions", &body, &[]).await;
        pods.push(served_by(&o, &d.diag()));
    }
    pods
}

#[tokio::test]
async fn same_prefix_goes_to_same_pod() {
    let d = Deployment::start(3, &[BUFFERED]).await;
    let pods = same_prefix_pods(&d, 0, 11, 6, false).await;
    let distinct: BTreeSet<_> = pods.iter().collect();
    assert_eq!(
        distinct.len(),
        1,
        "same-prefix requests spread over {pods:?}{}",
        d.diag()
    );
}

#[tokio::test]
async fn full_duplex_routes_by_prefix() {
    let d = Deployment::start(3, &[FULL_DUPLEX]).await;
    let pods = same_prefix_pods(&d, 0, 12, 6, true).await;
    let distinct: BTreeSet<_> = pods.iter().collect();
    assert_eq!(
        distinct.len(),
        1,
        "same-prefix requests spread over {pods:?}{}",
        d.diag()
    );
}

#[tokio::test]
async fn unrelated_prompts_spread_over_pods() {
    let d = Deployment::start(4, &[BUFFERED]).await;
    let bodies: Vec<Value> = (0..24)
        .map(|i| completion(&format!("Topic {i}. {}", text(1000 + i, 2500)), 8))
        .collect();
    let outcomes: Vec<_> = futures::stream::iter(bodies.iter())
        .map(|b| d.post(0, "/v1/completions", b, &[]))
        .buffer_unordered(6)
        .collect()
        .await;
    let mut per_pod: BTreeMap<String, usize> = BTreeMap::new();
    for o in &outcomes {
        *per_pod.entry(served_by(o, &d.diag())).or_default() += 1;
    }
    assert!(
        per_pod.len() >= 3,
        "24 unrelated prompts used only {per_pod:?}{}",
        d.diag()
    );
}

/// The router's pick for a prefix must not move when the client names another pod (or an
/// address outside the pool, e.g. the router's own admin port) in x-gateway-destination-endpoint.
async fn spoofed_destination_header(template: &str) {
    let d = Deployment::start(3, &[template]).await;
    let addrs: Vec<String> = d.addrs().iter().map(|a| a.to_string()).collect();
    let router_admin = d.router.as_ref().unwrap().admin.to_string();
    let prefix = text(20, 3000);
    let body = |i: usize| completion(&format!("{prefix} question {i}"), 4);
    // Where the router sends this prefix.
    let first = d.post(0, "/v1/completions", &body(0), &[]).await;
    let chosen = served_by(
        &first,
        &format!(
            "\n{template}: first request (no client header) failed; if this is 503 'no healthy \
             upstream' through original-dst.yaml, check that kv-router sets a single ip:port \
             (ORIGINAL_DST cannot use a comma-separated list){}",
            d.diag()
        ),
    );
    assert!(addrs.contains(&chosen), "{template}: unknown pod {chosen}");
    let mut spoofs: Vec<String> = addrs.iter().filter(|a| **a != chosen).cloned().collect();
    spoofs.push(router_admin);
    for (i, spoof) in spoofs.iter().enumerate() {
        let o = d
            .post(
                0,
                "/v1/completions",
                &body(i + 1),
                &[("x-gateway-destination-endpoint", spoof)],
            )
            .await;
        let got = served_by(&o, &d.diag());
        assert_eq!(
            got,
            chosen,
            "{template}: spoofed x-gateway-destination-endpoint: {spoof} moved the request{}",
            d.diag()
        );
    }
}

#[tokio::test]
async fn spoofed_destination_header_is_ignored() {
    spoofed_destination_header(BUFFERED).await;
}

#[tokio::test]
async fn spoofed_destination_header_is_ignored_original_dst() {
    spoofed_destination_header(ORIGINAL_DST).await;
}

#[tokio::test]
async fn router_down_fails_open() {
    let mut d = Deployment::start(3, &[BUFFERED]).await;
    d.router.as_mut().unwrap().kill();
    let mut per_pod: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..9 {
        let o = d
            .post(
                0,
                "/v1/completions",
                &completion(&text(300 + i, 800), 4),
                &[],
            )
            .await;
        assert_eq!(
            o.status,
            Some(200),
            "request {i} with kv-router down: {:?} {}",
            o.error,
            o.body
        );
        *per_pod.entry(served_by(&o, "")).or_default() += 1;
    }
    // Fallback is round robin over vllm_pool (one Envoy worker): every pod gets its turn.
    assert_eq!(
        per_pod.len(),
        3,
        "fallback did not round-robin: {per_pod:?}"
    );
}

/// Parses SSE payloads and drops the fields that legitimately differ between two runs.
fn normalized(events: &[String]) -> Vec<Value> {
    events
        .iter()
        .map(|e| match serde_json::from_str::<Value>(e) {
            Ok(mut v) => {
                if let Some(o) = v.as_object_mut() {
                    o.remove("id");
                    o.remove("created");
                }
                v
            }
            Err(_) => Value::String(e.clone()),
        })
        .collect()
}

#[tokio::test]
async fn sse_streaming_passes_through() {
    let d = Deployment::start(2, &[BUFFERED]).await;
    let body = chat_stream(&text(40, 2000), "Tell me a story about caches.", 12);
    let via = d.post(0, "/v1/chat/completions", &body, &[]).await;
    let pod = served_by(&via, &d.diag());
    assert!(via
        .header("content-type")
        .unwrap_or("")
        .starts_with("text/event-stream"));
    // Same request straight to the pod that served it, from a cold cache again.
    reset_caches(&d.addrs()).await.unwrap();
    let direct = common::post_to(
        &d.client,
        &format!("http://{pod}"),
        "/v1/chat/completions",
        &body,
        &[],
    )
    .await;
    assert!(direct.ok(), "direct request failed: {direct:?}");
    assert_eq!(via.events.len(), direct.events.len(), "chunk count differs");
    assert_eq!(via.events.last().map(String::as_str), Some("[DONE]"));
    assert!(
        via.events.len() >= 12 + 2,
        "too few chunks: {}",
        via.events.len()
    );
    assert_eq!(normalized(&via.events), normalized(&direct.events));
    let usage = via.usage.as_ref().expect("usage chunk through Envoy");
    assert_eq!(usage["completion_tokens"], 12);
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 400);
}

async fn four_mb_prompt(template: &str) {
    let d = Deployment::start(2, &[template]).await;
    let mut prompt = text(50, 4 * 1024 * 1024);
    prompt.truncate(4 * 1024 * 1024);
    let expected_tokens = prompt.len().div_ceil(4) as u64;
    let o = d
        .post(0, "/v1/completions", &completion(&prompt, 2), &[])
        .await;
    served_by(&o, &d.diag());
    let body: Value = serde_json::from_str(&o.body).expect("JSON completion");
    assert_eq!(
        body["usage"]["prompt_tokens"].as_u64(),
        Some(expected_tokens),
        "{template}: the pod did not see the whole 4 MB prompt{}",
        d.diag()
    );
}

#[tokio::test]
async fn four_mb_prompt_buffered() {
    four_mb_prompt(BUFFERED).await;
}

#[tokio::test]
async fn four_mb_prompt_full_duplex() {
    four_mb_prompt(FULL_DUPLEX).await;
}

#[tokio::test]
async fn model_listing_passes_through_envoy() {
    let d = Deployment::start(2, &[BUFFERED]).await;
    let r = d
        .client
        .get(format!("{}/v1/models", d.url(0)))
        .send()
        .await
        .expect("GET /v1/models");
    assert_eq!(r.status(), 200, "{}", d.diag());
    assert!(r.headers().contains_key("x-vllm-sim-pod"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["data"][0]["id"], "sim-model", "{v}");
}

#[tokio::test]
async fn malformed_json_does_not_crash() {
    let mut d = Deployment::start(2, &[BUFFERED]).await;
    let r = d
        .client
        .post(format!("{}/v1/chat/completions", d.url(0)))
        .header("content-type", "application/json")
        .body(r#"{"model": "sim-model", "messages": [{"role": "user", "content": "hi"#)
        .send()
        .await
        .expect("send malformed body");
    let status = r.status();
    let from_pod = r.headers().contains_key("x-vllm-sim-pod");
    let body = r.text().await.unwrap();
    assert_eq!(status, 400, "malformed JSON: {body}{}", d.diag());
    assert!(from_pod, "the 400 should come from the pod: {body}");
    let v: Value = serde_json::from_str(&body).expect("JSON error body");
    assert!(v["error"].is_object(), "{v}");
    // Everybody keeps serving.
    for i in 0..3 {
        let o = d
            .post(
                0,
                "/v1/completions",
                &completion(&format!("valid request {i}"), 4),
                &[],
            )
            .await;
        served_by(&o, &d.diag());
    }
    assert!(
        d.router.as_mut().unwrap().process().exited().is_none(),
        "kv-router died"
    );
    assert!(d.envoys[0].process().exited().is_none(), "Envoy died");
}

/// An immediate reply waits for the gateway to close its side of the ext_proc stream (ending it
/// first piles up h2 resets until h2 drops the connection): Envoy closes it at once, in the
/// BUFFERED and the FULL_DUPLEX config, so rejected streams are not held for the 10 s wait.
#[tokio::test]
async fn envoy_closes_rejected_ext_proc_streams_at_once() {
    let d = Deployment::start(1, &[BUFFERED, FULL_DUPLEX]).await;
    for envoy in 0..2 {
        for i in 0..5 {
            let body = serde_json::json!({"model": "nobody", "prompt": format!("p{i}")});
            let r = d
                .client
                .post(format!("{}/v1/completions", d.url(envoy)))
                .json(&body)
                .send()
                .await
                .expect("send");
            assert_eq!(
                r.status(),
                404,
                "unknown model via envoy {envoy}{}",
                d.diag()
            );
        }
    }
    let router = d.router.as_ref().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    loop {
        let m = router.metrics().await.expect("router metrics");
        let open = common::metric(&m, "kv_router_extproc_open_streams", &[]);
        if open == 0.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{open} ext_proc streams still open 3 s after their 404s{}",
            d.diag()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn session_id_keeps_conversation_on_one_pod() {
    let d = Deployment::start(3, &[BUFFERED]).await;
    let spec = MultiturnSpec {
        sessions: 3,
        turns: 5,
        system_bytes: 2048,
        max_tokens: 8,
        seed: 7,
        ..Default::default()
    };
    let run = runner::run(
        spec.build(),
        &RunOptions {
            target: d.url(0),
            concurrency: None,
            request_timeout: Duration::from_secs(20),
            label: "e2e".into(),
            progress: false,
        },
    )
    .await
    .unwrap();
    let mut by_session: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for r in &run.records {
        assert!(r.error.is_none(), "{r:?}{}", d.diag());
        by_session
            .entry(&r.session)
            .or_default()
            .insert(r.pod.clone().unwrap_or_default());
    }
    assert_eq!(by_session.len(), 3);
    for (s, pods) in &by_session {
        assert_eq!(
            pods.len(),
            1,
            "session {s} moved between pods {pods:?}{}",
            d.diag()
        );
    }
    // Later turns reuse the conversation's cached history.
    let late_hits = run
        .records
        .iter()
        .filter(|r| r.turn >= 2)
        .all(|r| r.cached_tokens.unwrap_or(0) > 0);
    assert!(
        late_hits,
        "later turns had no cache hits: {:?}",
        run.records
    );
}

#[tokio::test]
async fn no_healthy_pod_gives_503_json() {
    let mut d = Deployment::start(2, &[BUFFERED]).await;
    for p in &mut d.pods {
        p.kill();
    }
    d.router
        .as_ref()
        .unwrap()
        .wait_no_healthy_pod(Duration::from_secs(10))
        .await
        .unwrap();
    let o = d
        .post(
            0,
            "/v1/chat/completions",
            &chat_stream("system", "hello", 4),
            &[],
        )
        .await;
    assert_eq!(o.status, Some(503), "{o:?}{}", d.diag());
    let v: Value = serde_json::from_str(&o.body).unwrap_or_else(|_| {
        panic!(
            "503 body is not JSON (Envoy's own reply, not kv-router's?): {:?}{}",
            o.body,
            d.diag()
        )
    });
    assert!(
        v["error"].is_object(),
        "503 body lacks an OpenAI error object: {v}"
    );
    assert!(v["error"]["message"].is_string(), "{v}");
}

#[tokio::test]
async fn round_robin_baseline_spreads_and_streams() {
    let d = Deployment::start(3, &["round-robin.yaml"]).await;
    let mut per_pod: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..6 {
        let body = chat_stream(&text(60, 1000), &format!("question {i}"), 4);
        let o = d.post(0, "/v1/chat/completions", &body, &[]).await;
        *per_pod.entry(served_by(&o, "")).or_default() += 1;
        assert!(o.usage.is_some(), "no usage chunk");
    }
    assert_eq!(per_pod.values().copied().collect::<Vec<_>>(), vec![2, 2, 2]);
}
