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
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::deploy::{free_port, local_router_config, RouterProc, SimPod};
use common::exported_names;
use istio_render::{root, Gateway, MIN_ENVOY, MIN_ISTIO};

const DASHBOARD: &str = "deploy/monitoring/kv-router-dashboard.json";
const HEADER: &str = "x-gateway-destination-endpoint";

/// Envoy killed on drop.
struct Envoy {
    child: Child,
    listen: SocketAddr,
    admin: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Envoy {
    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }

    async fn stats(&self) -> String {
        reqwest::get(format!("http://{}/stats", self.admin))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn stat(&self, name: &str) -> u64 {
        self.stats()
            .await
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// `envoy --mode validate` of `cfg` with `envoy`, failing on deprecated fields too.
fn validate(envoy: &Path, cfg: &Path, what: &str) {
    let out = Command::new(envoy)
        .args(["--mode", "validate", "--log-level", "warn", "-c"])
        .arg(cfg)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !stderr.contains("Deprecated"),
        "the patched gateway config fails {what} --mode validate (or uses a deprecated field):\n{stderr}\n{}",
        std::fs::read_to_string(cfg).unwrap()
    );
}

/// Envoy as built into the oldest supported Istio's proxy: `$KV_ROUTER_ENVOY_MIN`, else the copy
/// `make test` installs into `.venv/envoy-<MIN_ENVOY>/`. Missing, it fails (never skips).
fn min_envoy() -> PathBuf {
    let path = std::env::var_os("KV_ROUTER_ENVOY_MIN")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(format!(".venv/envoy-{MIN_ENVOY}/envoy/_bin/envoy")));
    assert!(
        path.exists(),
        "Envoy {MIN_ENVOY} (Istio {MIN_ISTIO}'s proxy) not found at {}: run `make envoy-min` or set KV_ROUTER_ENVOY_MIN",
        path.display()
    );
    let out = Command::new(&path).arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(
        version.contains(&format!("/{MIN_ENVOY}.")),
        "{} is not Envoy {MIN_ENVOY}: {version}",
        path.display()
    );
    path
}

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
    let base_id = std::process::id() % 100_000 * 10 + 7;
    let child = Command::new(&envoy)
        .arg("-c")
        .arg(&cfg)
        .args(["--base-id", &base_id.to_string(), "--log-level", "warn"])
        .args(["--concurrency", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("stderr.log")).unwrap())
        .spawn()
        .unwrap();
    let e = Envoy {
        child,
        listen: SocketAddr::from(([127, 0, 0, 1], listen)),
        admin: SocketAddr::from(([127, 0, 0, 1], admin)),
        dir,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(r) = reqwest::get(format!("http://{}/ready", e.admin)).await {
            if r.text().await.unwrap_or_default().trim() == "LIVE" {
                return e;
            }
        }
        assert!(Instant::now() < deadline, "Envoy not LIVE:\n{}", e.stderr());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `name → value` of the router's `kv_router_decisions_total{pod=...}` samples.
fn decisions_by_pod(metrics: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for l in metrics.lines() {
        let Some(rest) = l.strip_prefix("kv_router_decisions_total{") else {
            continue;
        };
        let pod = rest
            .split("pod=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .unwrap()
            .to_string();
        let v: f64 = rest.rsplit(' ').next().unwrap().parse().unwrap();
        *out.entry(pod).or_insert(0) += v as u64;
    }
    out
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

/// Sum of every sample of `name` in a Prometheus text scrape.
fn sum_samples(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
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
