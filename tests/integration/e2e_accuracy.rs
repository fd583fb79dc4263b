//! Prediction accuracy end to end: the real Envoy 1.40, kv-router (approximate mode) and a
//! vllm-sim pod on 127.0.0.1. The router's predicted prefix-cache hits agree with the pod's
//! `vllm:prefix_cache_*` counters while the pod keeps what it was sent; once the pod drops its
//! cache behind the router's back, `/debug/pods` and `/metrics` show the shortfall
//! (`docs/config.md`, "Prediction accuracy").
//!
//! Run: `KV_ROUTER_ENVOY=/path/to/envoy cargo test --release --test integration e2e_accuracy::`

use crate::common;

use std::time::Duration;

use common::deploy::{self, reset_caches, EnvoyProc, RouterProc, SimPod};
use common::runner;
use common::{bins, completion, envoy_bin, post_to, served_by, text, FAST_SIM};
use serde_json::Value;

/// The pod's `hit_accuracy` in `/debug/pods`.
async fn accuracy(router: &RouterProc) -> Value {
    let pods = router.debug_pods().await.expect("/debug/pods");
    let pods = pods["pods"].as_array().cloned().unwrap_or_default();
    assert_eq!(pods.len(), 1, "{pods:?}");
    pods[0]["hit_accuracy"].clone()
}

#[tokio::test]
async fn predicted_hits_match_the_pods_counters_until_it_drops_its_cache() {
    let bins = bins();
    let args: Vec<String> = FAST_SIM.iter().map(|s| s.to_string()).collect();
    let sim = SimPod::spawn(&bins.vllm_sim, &args).expect("start vllm-sim");
    let cfg = deploy::local_router_config(&[sim.addr]).expect("router config");
    let router = RouterProc::spawn(&bins.kv_router, &cfg)
        .await
        .expect("start kv-router");
    router
        .wait_pods_ready(1, Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", router.stderr_tail(40)));
    let template = deploy::envoy_template("override-host-buffered.yaml").expect("template");
    let envoy = EnvoyProc::spawn(&envoy_bin(), &template, Some(router.grpc), &[sim.addr])
        .await
        .unwrap_or_else(|e| panic!("start Envoy: {e:#}"));
    let client = runner::client();
    let diag = || format!("\n--- kv-router stderr ---\n{}", router.stderr_tail(30));
    // A long shared head (about 20 router blocks) and a short distinct tail per request.
    let head = text(1, 5000);
    let mut seq = 0u64;
    let mut send = || {
        seq += 1;
        let body = completion(
            &format!("{head} Question {seq}: {}", text(100 + seq, 60)),
            2,
        );
        let (client, url) = (client.clone(), envoy.url());
        async move { post_to(&client, &url, "/v1/completions", &body, &[]).await }
    };

    // The pod keeps what it is sent: the router's prediction is right.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let right = loop {
        served_by(&send().await, &diag());
        let a = accuracy(&router).await;
        let r = &a["recent"];
        if r["predicted"].as_f64() > Some(0.0) && r["observed"].as_f64() > Some(0.0) {
            break a;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no predicted and observed hits: {a}{}",
            diag()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let ratio = right["accuracy"].as_f64().expect("an accuracy");
    assert!(
        (0.75..=1.34).contains(&ratio),
        "a pod that keeps its cache reports about the hits predicted: {right}"
    );

    // The pod now drops its cache before every request (as a much smaller cache, or another
    // client's traffic, would): it reports misses where the router predicts hits.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    let wrong = loop {
        reset_caches(&[sim.addr])
            .await
            .expect("reset the pod's cache");
        served_by(&send().await, &diag());
        let a = accuracy(&router).await;
        if a["accuracy"].as_f64().is_some_and(|r| r < 0.5) {
            break a;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the shortfall never showed: {a}{}",
            diag()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // The same in /metrics (pod gauges are exported with each scrape).
    let pod = sim.addr.to_string();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = router.metrics().await.expect("router metrics");
        let gauge = |name: &str| {
            let prefix = format!("kv_router_{name}{{pod=\"{pod}\"}} ");
            m.lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .and_then(|v| v.trim().parse::<f64>().ok())
        };
        let acc = gauge("pod_hit_accuracy_ratio");
        if acc.is_some_and(|a| a < 0.5) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "gauge accuracy {acc:?} after {wrong}:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
