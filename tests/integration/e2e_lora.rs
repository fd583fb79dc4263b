//! LoRA-aware routing end to end: the real Envoy 1.40, kv-router and vllm-sim pods with
//! `--enable-lora` on 127.0.0.1. A request for an adapter reaches only pods that list it in
//! `/v1/models`, and among pods listing it, the one that has it running (`docs/lora.md`).
//!
//! Run: `KV_ROUTER_ENVOY=/path/to/envoy cargo test --release --test integration e2e_lora::`

use crate::common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use common::deploy::{self, EnvoyProc, RouterProc, SimPod};
use common::runner;
use common::{bins, completion, envoy_bin, post_to, served_by, text, FAST_SIM};
use serde_json::Value;

const BUFFERED: &str = "override-host-buffered.yaml";

struct LoraDeployment {
    pods: Vec<SimPod>,
    router: RouterProc,
    envoy: EnvoyProc,
    client: reqwest::Client,
}

impl LoraDeployment {
    /// One sim per entry of `pods` (extra flags each), kv-router and one Envoy.
    async fn start(pods: &[Vec<&str>]) -> Self {
        let bins = bins();
        let pods: Vec<SimPod> = pods
            .iter()
            .map(|extra| {
                // FAST_SIM's flag/value pairs, except those `extra` sets itself.
                let mut args: Vec<String> = FAST_SIM
                    .chunks(2)
                    .filter(|kv| !extra.contains(&kv[0]))
                    .flatten()
                    .map(|s| s.to_string())
                    .collect();
                args.extend(extra.iter().map(|s| s.to_string()));
                SimPod::spawn(&bins.vllm_sim, &args).expect("start vllm-sim")
            })
            .collect();
        let addrs: Vec<SocketAddr> = pods.iter().map(|p| p.addr).collect();
        let mut cfg = deploy::local_router_config(&addrs).expect("router config");
        // Sequential ~1 ms requests look like a burst to the hot-pod gate (see e2e.rs).
        cfg.gate.hot_abs = 16.0;
        let router = RouterProc::spawn(&bins.kv_router, &cfg)
            .await
            .expect("start kv-router");
        router
            .wait_pods_ready(addrs.len(), Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", router.stderr_tail(40)));
        let path = deploy::envoy_template(BUFFERED).expect("template");
        let envoy = EnvoyProc::spawn(&envoy_bin(), &path, Some(router.grpc), &addrs)
            .await
            .unwrap_or_else(|e| panic!("start Envoy: {e:#}"));
        Self {
            pods,
            router,
            envoy,
            client: runner::client(),
        }
    }

    fn diag(&self) -> String {
        format!(
            "\n--- kv-router stderr (tail) ---\n{}",
            self.router.stderr_tail(40)
        )
    }

    /// A short completion for `model` through Envoy; the pod that served it.
    async fn route(&self, model: &str, seed: u64) -> String {
        let mut body = completion(&format!("Request {seed}. {}", text(seed, 400)), 2);
        body["model"] = Value::String(model.into());
        let o = post_to(
            &self.client,
            &self.envoy.url(),
            "/v1/completions",
            &body,
            &[],
        )
        .await;
        served_by(&o, &self.diag())
    }

    /// Starts a long request for `model` directly on pod `i` (not routed), left running.
    fn occupy(&self, i: usize, model: &str) -> tokio::task::JoinHandle<()> {
        let mut body = completion(&format!("Long job for {model}. {}", text(7, 200)), 400);
        body["model"] = Value::String(model.into());
        let (client, url) = (self.client.clone(), self.pods[i].url());
        tokio::spawn(async move {
            post_to(&client, &url, "/v1/completions", &body, &[]).await;
        })
    }

    /// Waits until pod `i`'s newest residency series shows `adapter` running.
    async fn wait_running(&self, i: usize, adapter: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let t = self
                .client
                .get(format!("{}/metrics", self.pods[i].url()))
                .send()
                .await
                .expect("scrape")
                .text()
                .await
                .expect("metrics text");
            let r = kv_router::pods::read_lora_info(&t, "vllm:lora_requests_info");
            if r.is_some_and(|r| r.running.contains(adapter)) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "pod {i} never ran {adapter}:\n{t}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn pod_of(d: &LoraDeployment, i: usize) -> String {
    d.pods[i].addr.to_string()
}

#[tokio::test]
async fn an_adapter_goes_only_to_the_pods_that_list_it() {
    let d = LoraDeployment::start(&[
        vec![
            "--enable-lora",
            "--max-loras",
            "2",
            "--lora-modules",
            "sql=/loras/sql",
        ],
        vec![
            "--enable-lora",
            "--max-loras",
            "2",
            "--lora-modules",
            "chat=/loras/chat",
        ],
    ])
    .await;
    for i in 0..4 {
        assert_eq!(d.route("sql", 10 + i).await, pod_of(&d, 0), "{}", d.diag());
        assert_eq!(d.route("chat", 20 + i).await, pod_of(&d, 1), "{}", d.diag());
    }
    // The base model is on both pods: it may go to either.
    let base: BTreeSet<String> = {
        let mut s = BTreeSet::new();
        for i in 0..6 {
            s.insert(d.route("sim-model", 30 + i).await);
        }
        s
    };
    assert!(base
        .iter()
        .all(|p| *p == pod_of(&d, 0) || *p == pod_of(&d, 1)));
    // Both pods report residency, so both get the adapter-load counter (pod gauges are
    // exported once a second).
    let series: Vec<String> = (0..2)
        .map(|i| {
            format!(
                "kv_router_lora_adapter_loads_total{{pod=\"{}\"}}",
                pod_of(&d, i)
            )
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = d.router.metrics().await.expect("router metrics");
        if series.iter().all(|s| m.contains(s.as_str())) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series:?} missing:\n{m}{}",
            d.diag()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn an_adapter_goes_to_the_pod_that_has_it_loaded() {
    // One slot each: a pod running another adapter would have to evict it.
    let flags = vec![
        "--enable-lora",
        "--max-loras",
        "1",
        "--decode-ms-per-token",
        "25",
        "--lora-modules",
        "sql=/loras/sql",
        "chat=/loras/chat",
    ];
    let d = LoraDeployment::start(&[flags.clone(), flags]).await;
    let _a = d.occupy(0, "sql");
    let _b = d.occupy(1, "chat");
    d.wait_running(0, "sql").await;
    d.wait_running(1, "chat").await;
    // Until the router's scrapes show both (in /debug/pods).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v = d.router.debug_pods().await.expect("debug pods");
        let running = |i: usize, adapter: &str| {
            v["pods"].as_array().is_some_and(|pods| {
                pods.iter().any(|p| {
                    p["address"] == pod_of(&d, i)
                        && p["lora"]["residency"]["running"]
                            .as_array()
                            .is_some_and(|r| r.iter().any(|a| a == adapter))
                })
            })
        };
        if running(0, "sql") && running(1, "chat") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the router never saw the residency: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for i in 0..3 {
        assert_eq!(d.route("sql", 40 + i).await, pod_of(&d, 0), "{}", d.diag());
        assert_eq!(d.route("chat", 50 + i).await, pod_of(&d, 1), "{}", d.diag());
    }
}
