//! Prefill/decode disaggregation end to end: the real Envoy 1.40, kv-router and vllm-sim pods
//! in `decode` and `prefill` roles on 127.0.0.1. A long uncached prompt reaches a decode pod
//! with the prefill header naming a prefill pod (the decode sim prefills there and says so in
//! `x-vllm-sim-prefilled-by`); a client's forged header never reaches a pod; short and cached
//! prompts stay aggregated; the prefill pod that holds a prefix attracts the next prompt on it;
//! a prefill pod that never serves the prefills sent it stops being chosen.
//!
//! Run: `KV_ROUTER_ENVOY=/path/to/envoy cargo test --release --test integration e2e_pd::`

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::deploy::{self, EnvoyProc, RouterProc, SimPod};
use common::runner::{self, StreamOutcome};
use common::{bins, completion, envoy_bin, explain, metric, post_to, served_by, text, FAST_SIM};
use kv_router::config::PodRole;
use serde_json::Value;

const BUFFERED: &str = "override-host-buffered.yaml";
const FULL_DUPLEX: &str = "gie-full-duplex.yaml";
const PREFILLED_BY: &str = "x-vllm-sim-prefilled-by";
const HEADER: &str = "x-prefiller-host-port";

struct PdDeployment {
    decode: Vec<SimPod>,
    prefill: Vec<SimPod>,
    router: RouterProc,
    envoys: Vec<EnvoyProc>,
    client: reqwest::Client,
}

impl PdDeployment {
    /// Two decode and two prefill sims, kv-router (threshold 256 tokens), one Envoy per template.
    async fn start(templates: &[&str]) -> Self {
        Self::start_with(templates, &[], |_| {}).await
    }

    /// [`Self::start`] with extra arguments for the first prefill sim and a config tweak.
    async fn start_with(
        templates: &[&str],
        first_prefill_args: &[&str],
        tweak: impl FnOnce(&mut kv_router::config::Config),
    ) -> Self {
        let bins = bins();
        let sim = |role: &str, extra: &[&str]| {
            let mut args: Vec<String> = FAST_SIM.iter().map(|s| s.to_string()).collect();
            args.extend(["--role".to_string(), role.to_string()]);
            args.extend(extra.iter().map(|s| s.to_string()));
            SimPod::spawn(&bins.vllm_sim, &args).expect("start vllm-sim")
        };
        let decode = vec![sim("decode", &[]), sim("decode", &[])];
        let prefill = vec![sim("prefill", first_prefill_args), sim("prefill", &[])];
        let addrs: Vec<SocketAddr> = decode.iter().chain(&prefill).map(|p| p.addr).collect();
        let mut cfg = deploy::local_router_config(&addrs).expect("router config");
        for (i, pod) in cfg.pods.static_pods.iter_mut().enumerate() {
            pod.role = Some(if i < 2 {
                PodRole::Decode
            } else {
                PodRole::Prefill
            });
        }
        // Sequential ~1 ms requests look like a burst to the hot-pod gate (see e2e.rs).
        cfg.gate.hot_abs = 16.0;
        cfg.disaggregation.threshold_tokens = 256;
        tweak(&mut cfg);
        let router = RouterProc::spawn(&bins.kv_router, &cfg)
            .await
            .expect("start kv-router");
        router
            .wait_pods_ready(addrs.len(), Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", router.stderr_tail(40)));
        let mut envoys = Vec::new();
        for t in templates {
            let path = deploy::envoy_template(t).expect("template");
            envoys.push(
                EnvoyProc::spawn(&envoy_bin(), &path, Some(router.grpc), &addrs)
                    .await
                    .unwrap_or_else(|e| panic!("start Envoy with {t}: {e:#}")),
            );
        }
        Self {
            decode,
            prefill,
            router,
            envoys,
            client: runner::client(),
        }
    }

    fn diag(&self) -> String {
        format!(
            "\n--- kv-router stderr (tail) ---\n{}",
            self.router.stderr_tail(40)
        )
    }

    async fn post(&self, envoy: usize, prompt: &str, headers: &[(&str, &str)]) -> StreamOutcome {
        let body = completion(prompt, 4);
        post_to(
            &self.client,
            &self.envoys[envoy].url(),
            "/v1/completions",
            &body,
            headers,
        )
        .await
    }

    async fn metrics(&self, url: String) -> String {
        self.client
            .get(format!("{url}/metrics"))
            .send()
            .await
            .expect("scrape")
            .text()
            .await
            .expect("metrics text")
    }

    /// Prefills each prefill sim did for decode pods.
    async fn prefills_for_others(&self) -> Vec<f64> {
        let mut v = Vec::new();
        for p in &self.prefill {
            let t = self.metrics(p.url()).await;
            v.push(metric(&t, "vllm_sim:prefills_for_others_total", &[]));
        }
        v
    }

    /// The router's `/debug/pods`.
    async fn debug_pods(&self) -> Value {
        self.client
            .get(format!("{}/debug/pods", self.router.admin_url()))
            .send()
            .await
            .expect("debug pods")
            .json()
            .await
            .expect("debug pods JSON")
    }

    /// Remote prefills the decode sims gave up on (and prefilled locally instead).
    async fn remote_prefill_failures(&self) -> f64 {
        let mut n = 0.0;
        for p in &self.decode {
            let t = self.metrics(p.url()).await;
            n += metric(
                &t,
                "vllm_sim:remote_prefills_total",
                &[("outcome", "failed")],
            );
        }
        n
    }

    fn is_decode(&self, pod: &str) -> bool {
        self.decode.iter().any(|p| p.addr.to_string() == pod)
    }
}

#[tokio::test]
async fn long_uncached_prompts_are_prefilled_on_the_prefill_pod_holding_their_prefix() {
    let d = PdDeployment::start(&[BUFFERED]).await;
    let prefix = text(35, 6000);
    // A forged header naming a pod the client chose is overwritten by the router's choice.
    let forged = d.prefill[1].addr.to_string();
    let first = format!("{prefix} Question zero: {}", text(350, 3000));
    let o = d.post(0, &first, &[(HEADER, &forged)]).await;
    let pod = served_by(&o, &d.diag());
    assert!(d.is_decode(&pod), "served by {pod}, not a decode pod");
    let prefiller = o
        .header(PREFILLED_BY)
        .unwrap_or_else(|| panic!("not disaggregated: {:?}{}", o.headers, d.diag()))
        .to_string();
    assert!(
        d.prefill.iter().any(|p| p.addr.to_string() == prefiller),
        "prefilled by {prefiller}, not a prefill pod"
    );
    let counts = d.prefills_for_others().await;
    assert_eq!(counts.iter().sum::<f64>(), 1.0, "{counts:?}");

    // Same prefix, new long suffix: the prefill pod that holds the prefix prefills it again.
    for i in 1..4u64 {
        let prompt = format!("{prefix} Question {i}: {}", text(350 + i, 3000));
        let o = d.post(0, &prompt, &[]).await;
        served_by(&o, &d.diag());
        assert_eq!(
            o.header(PREFILLED_BY),
            Some(prefiller.as_str()),
            "request {i} left the prefix's prefill pod{}",
            d.diag()
        );
    }

    // The first prompt again: cached where it decodes, so not worth a transfer.
    let o = d.post(0, &first, &[]).await;
    served_by(&o, &d.diag());
    assert_eq!(
        o.header(PREFILLED_BY),
        None,
        "a cached prompt was disaggregated"
    );
    assert_eq!(d.prefills_for_others().await.iter().sum::<f64>(), 4.0);

    // Explain shows both pods and why, recording nothing.
    let fresh = completion(&text(36, 8000), 4);
    let v = explain(&d.client, &d.router, &fresh).await;
    assert_eq!(v["pd"]["outcome"], "disaggregated", "{v}");
    let named = v["pd"]["prefill"].as_str().unwrap_or_default();
    assert!(d.prefill.iter().any(|p| p.addr.to_string() == named), "{v}");
    assert!(d.is_decode(
        v["destination"]
            .as_str()
            .unwrap_or_default()
            .split(',')
            .next()
            .unwrap()
    ));

    let m = d.metrics(d.router.admin_url()).await;
    let pd = |outcome| metric(&m, "kv_router_pd_decisions_total", &[("outcome", outcome)]);
    assert_eq!(
        (pd("disaggregated"), pd("short_or_cached")),
        (4.0, 1.0),
        "{m}"
    );
    let pods = d.debug_pods().await;
    let roles: Vec<&str> = pods["pods"]
        .as_array()
        .expect("pods")
        .iter()
        .filter_map(|p| p["role"].as_str())
        .collect();
    assert_eq!(roles, ["decode", "decode", "prefill", "prefill"]);
}

#[tokio::test]
async fn a_forged_prefill_header_never_reaches_a_pod_and_short_prompts_stay_aggregated() {
    let d = PdDeployment::start(&[BUFFERED, FULL_DUPLEX]).await;
    let forged = d.prefill[0].addr.to_string();
    for envoy in 0..2 {
        for i in 0..3u64 {
            let prompt = format!("Short question {envoy}-{i}: {}", text(700 + i, 200));
            let o = d
                .post(
                    envoy,
                    &prompt,
                    &[(HEADER, &forged), ("x-prefiller-url", "http://10.9.9.9:1")],
                )
                .await;
            let pod = served_by(&o, &d.diag());
            assert!(d.is_decode(&pod), "served by {pod}, not a decode pod");
            // Had the forged header survived, the decode sim would have prefilled there.
            assert_eq!(
                o.header(PREFILLED_BY),
                None,
                "envoy {envoy}: {:?}",
                o.headers
            );
        }
    }
    assert_eq!(d.prefills_for_others().await, vec![0.0, 0.0]);
    for p in &d.decode {
        let t = d.metrics(p.url()).await;
        assert_eq!(
            metric(&t, "vllm_sim:remote_prefills_total", &[]),
            0.0,
            "a decode pod saw a prefill header"
        );
    }
    let m = d.metrics(d.router.admin_url()).await;
    assert_eq!(
        metric(
            &m,
            "kv_router_pd_decisions_total",
            &[("outcome", "short_or_cached")]
        ),
        6.0,
        "{m}"
    );
}

#[tokio::test]
async fn a_prefill_pod_that_never_serves_its_prefills_stops_being_chosen() {
    // Prefill pod 0 rejects every prompt over 128 tokens (a smaller --max-model-len than the
    // decode pods: a misconfigured prefill Deployment). Its scrapes and health stay fine; the
    // decode pods fall back to prefilling locally, so every request still succeeds.
    let d = PdDeployment::start_with(&[BUFFERED], &["--max-model-len", "128"], |cfg| {
        cfg.disaggregation.prefill_unserved_after_ms = 1_500;
    })
    .await;
    let (bad, good) = (d.prefill[0].addr.to_string(), d.prefill[1].addr.to_string());
    let exclusions =
        |m: &str, pod: &str| metric(m, "kv_router_prefill_exclusions_total", &[("pod", pod)]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut n = 0u64;
    loop {
        let o = d.post(0, &text(500 + n, 3000), &[]).await;
        served_by(&o, &d.diag());
        n += 1;
        let m = d.metrics(d.router.admin_url()).await;
        if exclusions(&m, &bad) >= 1.0 {
            assert_eq!(
                exclusions(&m, &good),
                0.0,
                "the healthy prefill pod was excluded{}",
                d.diag()
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "prefill pod {bad} never excluded after {n} requests{}\n{m}",
            d.diag()
        );
    }
    let failed_before = d.remote_prefill_failures().await;
    assert!(
        failed_before >= 2.0,
        "the decode pods saw {failed_before} failed remote prefills"
    );
    // Excluded: long prompts still disaggregate, on the healthy prefill pod only.
    for i in 0..6u64 {
        let o = d.post(0, &text(900 + i, 3000), &[]).await;
        served_by(&o, &d.diag());
        assert_eq!(
            o.header(PREFILLED_BY),
            Some(good.as_str()),
            "request {i} after the exclusion{}",
            d.diag()
        );
    }
    assert_eq!(
        d.remote_prefill_failures().await,
        failed_before,
        "no more failed prefills"
    );
    let pods = d.debug_pods().await;
    let excluded: Vec<(&str, bool)> = pods["pods"]
        .as_array()
        .expect("pods")
        .iter()
        .map(|p| {
            let ms = p["prefill_excluded_for_ms"].as_u64();
            (
                p["address"].as_str().unwrap_or_default(),
                ms.is_some_and(|ms| ms > 0),
            )
        })
        .filter(|(_, x)| *x)
        .collect();
    assert_eq!(excluded, [(bad.as_str(), true)], "{pods}");
}
