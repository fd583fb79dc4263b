//! Proof without a cluster that `deploy/components/istio-envoyfilter/` steers: the configuration
//! istiod renders for the ingress gateway from `gateway.yaml` (listener and HTTP filter chain,
//! routes over RDS, the pool as an EDS cluster; `istio_render`) is patched by `envoyfilter.yaml`
//! with Istio's match rules, validated with the Envoy of the oldest supported Istio (1.28 = Envoy
//! 1.36) and with Envoy 1.40, and run live with Envoy 1.40 (this test serving RDS and EDS),
//! kv-router and simulated pods:
//! - inference requests go to the pod kv-router picked (per-pod decisions == per-pod serves,
//!   conversations stick), bodies larger than the gateway's 32 KiB connection buffer included;
//! - the non-inference route never calls kv-router and is served with kv-router down;
//! - a client-forged `x-gateway-destination-endpoint` is ignored (router up and down);
//! - with kv-router down the inference route fails open to round robin.
//!
//! It also checks that every metric the Grafana dashboard queries is exported by the running
//! kv-router (or by this Envoy, for the `envoy_*` fail-open counters).

use crate::common;
use crate::istio_render;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use common::deploy::{free_port, local_router_config, RouterProc, SimPod};
use common::exported_names;
use istio_render::envoy::{decisions_by_pod, min_envoy, sum_samples, validate, Envoy};
use istio_render::{root, Gateway, MIN_ENVOY};

const DASHBOARD: &str = "deploy/monitoring/kv-router-dashboard.json";
const HEADER: &str = "x-gateway-destination-endpoint";

async fn start_envoy(picker: SocketAddr, pods: &[SocketAddr]) -> Envoy {
    let envoy = common::envoy_bin();
    let dir = tempfile::tempdir().unwrap();
    let (listen, admin) = (free_port().unwrap(), free_port().unwrap());
    let mut gw = Gateway::render(listen, pods);
    gw.apply_envoyfilter(picker);
    // Inlined, the patched configuration must hold for Istio's oldest supported proxy and ours.
    let inline = dir.path().join("gateway-inline.yaml");
    std::fs::write(
        &inline,
        serde_yaml::to_string(&gw.static_bootstrap(admin)).unwrap(),
    )
    .unwrap();
    validate(&min_envoy(), &inline, &format!("Envoy {MIN_ENVOY}"));
    validate(&envoy, &inline, "Envoy");
    let cfg = dir.path().join("gateway.yaml");
    std::fs::write(
        &cfg,
        serde_yaml::to_string(&gw.xds_bootstrap(admin, dir.path())).unwrap(),
    )
    .unwrap();
    let base_id = (std::process::id() % 100_000 * 10 + 7).to_string();
    Envoy::run(
        &envoy,
        &cfg,
        &["--base-id", &base_id],
        (listen, admin),
        dir,
        "the patched gateway",
    )
    .await
}

/// Three GETs of the non-inference route answer 200.
async fn models_route_serves(client: &reqwest::Client, base: &str, when: &str) {
    for _ in 0..3 {
        let r = client
            .get(format!("{base}/v1/models"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "GET /v1/models with {when}");
    }
}

/// Metric names (or `__name__` regexes) the dashboard's queries use.
fn dashboard_metrics() -> BTreeSet<String> {
    fn exprs(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    if k == "expr" || k == "definition" {
                        out.push(x.as_str().unwrap_or("").to_string());
                    }
                    exprs(x, out);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| exprs(x, out)),
            _ => {}
        }
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join(DASHBOARD)).unwrap()).unwrap();
    let mut all = Vec::new();
    exprs(&dashboard, &mut all);
    let mut names = BTreeSet::new();
    for e in &all {
        // `{__name__=~"envoy_http_.*ext_proc_x"}`: the stat prefix differs per gateway.
        for part in e.split("__name__=~\"").skip(1) {
            names.insert(part.split('"').next().unwrap().to_string());
        }
        let bytes = e.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            let word_start = i == 0
                || !(bytes[i - 1].is_ascii_alphanumeric()
                    || matches!(bytes[i - 1], b'_' | b'"' | b'*'));
            if word_start && e[i..].starts_with("kv_router_") {
                let end = e[i..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .map_or(e.len(), |n| i + n);
                names.insert(e[i..end].to_string());
                i = end;
            } else {
                i += 1;
            }
        }
    }
    names
}

/// `pattern` is a metric name, or a regex whose only operator is `.*`.
fn name_matches(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split(".*").collect();
    let mut rest = name;
    for (i, p) in parts.iter().enumerate() {
        if i == 0 {
            let Some(r) = rest.strip_prefix(p) else {
                return false;
            };
            rest = r;
        } else if i == parts.len() - 1 {
            return rest.ends_with(p);
        } else {
            let Some(at) = rest.find(p) else { return false };
            rest = &rest[at + p.len()..];
        }
    }
    rest.is_empty()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patched_istio_gateway_steers_and_fails_open() {
    let bins = common::bins();
    let args: Vec<String> = common::FAST_SIM.iter().map(|s| s.to_string()).collect();
    // Precise mode, as the sim overlay runs it: the pods publish KV events, kv-router indexes them.
    let event_ports: Vec<u16> = (0..3).map(|_| free_port().unwrap()).collect();
    let sims: Vec<SimPod> = event_ports
        .iter()
        .map(|p| {
            let mut a = args.clone();
            a.push(format!("--kv-events-endpoint=tcp://*:{p}"));
            SimPod::spawn(&bins.vllm_sim, &a).expect("start vllm-sim")
        })
        .collect();
    let pods: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let mut cfg = local_router_config(&pods).unwrap();
    for (sp, p) in cfg.pods.static_pods.iter_mut().zip(&event_ports) {
        sp.kv_events_endpoint = Some(format!("tcp://127.0.0.1:{p}"));
    }
    cfg.kv_events.enabled = true;
    cfg.tokenizers = serde_yaml::from_str("[{model: sim-model, builtin: true}]").unwrap();
    cfg.gate.hot_abs = 16.0; // sequential ~1 ms requests would otherwise look like a burst
    let mut router = RouterProc::spawn(&bins.kv_router, &cfg)
        .await
        .expect("start kv-router");
    router
        .wait_pods_ready(pods.len(), Duration::from_secs(10))
        .await
        .unwrap();
    let envoy = start_envoy(router.grpc, &pods).await;
    let base = format!("http://{}", envoy.listen);
    let client = reqwest::Client::new();
    let diag = |router: &RouterProc| {
        format!(
            "\n--- envoy ---\n{}\n--- kv-router ---\n{}",
            envoy.stderr(),
            router.stderr_tail(30)
        )
    };
    let metrics = |router: &RouterProc| {
        let url = format!("{}/metrics", router.admin_url());
        async move { reqwest::get(url).await.unwrap().text().await.unwrap() }
    };

    // 1. Inference: three conversations of four turns; each turn extends the last, so kv-router
    //    keeps a conversation on one pod, and Envoy sends every request where kv-router said.
    //    Prompts exceed the 32 KiB connection buffer (the route's own limit lets them through).
    let mut served: BTreeMap<String, u64> = BTreeMap::new();
    let mut home: Vec<String> = Vec::new();
    for conv in 0..3u64 {
        let mut prompt = common::text(100 + conv, 40_000);
        let mut pods_seen = BTreeSet::new();
        for turn in 0..4u64 {
            prompt.push_str(&common::text(1000 * conv + turn, 300));
            let o = common::post_to(
                &client,
                &base,
                "/v1/completions",
                &common::completion(&prompt, 4),
                &[],
            )
            .await;
            let pod = common::served_by(&o, &diag(&router));
            *served.entry(pod.clone()).or_default() += 1;
            pods_seen.insert(pod);
        }
        assert_eq!(
            pods_seen.len(),
            1,
            "conversation {conv} was split over {pods_seen:?}{}",
            diag(&router)
        );
        home.extend(pods_seen);
    }
    let decided = decisions_by_pod(&metrics(&router).await);
    assert_eq!(
        decided,
        served,
        "every request must be served by the pod kv-router picked{}",
        diag(&router)
    );
    assert_eq!(
        envoy
            .stat("http.outbound_0.0.0.0_8080.ext_proc.streams_started")
            .await,
        12
    );

    // 2. The non-inference route never reaches kv-router.
    let streams = "kv_router_extproc_streams_total";
    let streams_before = sum_samples(&metrics(&router).await, streams);
    models_route_serves(&client, &base, "kv-router up").await;
    let streams_after = sum_samples(&metrics(&router).await, streams);
    assert_eq!(
        streams_before, streams_after,
        "/v1/models went through kv-router"
    );

    // 3. A forged destination header does not move a conversation (kv-router up).
    let other = pods
        .iter()
        .map(|p| p.to_string())
        .find(|p| *p != home[0])
        .unwrap();
    let mut prompt = common::text(100, 40_000);
    prompt.push_str(&common::text(0, 300));
    let o = common::post_to(
        &client,
        &base,
        "/v1/completions",
        &common::completion(&prompt, 4),
        &[(HEADER, other.as_str())],
    )
    .await;
    assert_eq!(
        common::served_by(&o, &diag(&router)),
        home[0],
        "a client header overrode kv-router's pick"
    );

    // 4. Dashboard: every metric it queries is exported by this running router (or by this
    //    Envoy). Families that only get samples on faults (event gaps, replays, purges, decode
    //    errors) still announce themselves with `# TYPE` in a healthy scrape.
    let _ = common::post_to(
        &client,
        &base,
        "/v1/completions",
        &serde_json::json!("not an object"),
        &[],
    )
    .await;
    let queried = dashboard_metrics();
    assert!(queried.len() >= 15, "dashboard queries: {queried:?}");
    let live = exported_names(&metrics(&router).await);
    let envoy_prom = reqwest::get(format!("http://{}/stats/prometheus", envoy.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let envoy_names = exported_names(&envoy_prom);
    let mut missing = Vec::new();
    for q in &queried {
        let found = if q.starts_with("envoy_") {
            envoy_names.iter().any(|n| name_matches(q, n))
        } else {
            live.contains(q)
        };
        if !found {
            missing.push(q.clone());
        }
    }
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics the running router/Envoy do not export: {missing:?}\nrouter: {live:?}"
    );

    // 5. kv-router down: the non-inference route is untouched, the inference route fails open to
    //    round robin, and a forged header still steers nothing.
    router.kill();
    models_route_serves(&client, &base, "kv-router down").await;
    let mut spread = BTreeSet::new();
    for i in 0..6u64 {
        let o = common::post_to(
            &client,
            &base,
            "/v1/completions",
            &common::completion(&common::text(5000 + i, 2000), 4),
            &[(HEADER, other.as_str())],
        )
        .await;
        spread.insert(common::served_by(&o, "\n(kv-router down: fail-open)"));
    }
    assert!(
        spread.len() >= 2,
        "with kv-router down requests must be round-robined, not follow the client's header: {spread:?}"
    );
    let fail_open = envoy
        .stat("http.outbound_0.0.0.0_8080.ext_proc.failure_mode_allowed")
        .await;
    assert!(fail_open >= 6, "failure_mode_allowed = {fail_open}");
}
