//! Proof without a cluster that `deploy/components/istio-envoyfilter/` steers: the Envoy
//! configuration an Istio ingress gateway holds after the EnvoyFilter's patches is built here from
//! the patch values in `envoyfilter.yaml` and the routes of `gateway.yaml` (so the two cannot
//! drift), validated, and run live with real Envoy 1.40, kv-router and simulated pods:
//! - inference requests go to the pod kv-router picked (per-pod decisions == per-pod serves,
//!   conversations stick), bodies larger than the gateway's 32 KiB connection buffer included;
//! - the non-inference route never calls kv-router and is served with kv-router down;
//! - a client-forged `x-gateway-destination-endpoint` is ignored (router up and down);
//! - with kv-router down the inference route fails open to round robin.
//!
//! It also checks that every metric the Grafana dashboard queries is exported by the running
//! kv-router (or by this Envoy, for the `envoy_*` fail-open counters).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::deploy::{free_port, local_router_config, RouterProc, SimPod};
use serde_yaml::Value;

const FILTER: &str = "deploy/components/istio-envoyfilter/envoyfilter.yaml";
const ROUTES: &str = "deploy/components/istio-envoyfilter/gateway.yaml";
const DASHBOARD: &str = "deploy/monitoring/kv-router-dashboard.json";
const HEADER: &str = "x-gateway-destination-endpoint";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn docs(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(root().join(path)).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

fn y(s: &str) -> Value {
    serde_yaml::from_str(s).unwrap()
}

/// Istio's outbound cluster name for a service port.
fn cluster_name(host: &str, port: u64) -> String {
    format!("outbound|{port}||{host}")
}

/// Proto-style merge as Istio's MERGE does it: messages/maps merge field by field, repeated
/// fields append, scalars are replaced.
fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Mapping(b), Value::Mapping(p)) => {
            for (k, v) in p {
                match b.get_mut(k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Sequence(b), Value::Sequence(p)) => b.extend(p.iter().cloned()),
        (slot, v) => *slot = v.clone(),
    }
}

/// The gateway's routes as istiod builds them from the VirtualService: one Envoy route per
/// http[] entry (single match), named after it, to `outbound|port||host`, timeout from the VS.
fn routes_from_virtual_service() -> (Vec<Value>, BTreeSet<String>) {
    let vs = docs(ROUTES)
        .into_iter()
        .find(|d| d["kind"] == "VirtualService")
        .expect("gateway.yaml has a VirtualService");
    let mut routes = Vec::new();
    let mut clusters = BTreeSet::new();
    for http in vs["spec"]["http"].as_sequence().unwrap() {
        let name = http["name"].as_str().expect("every http route is named");
        let matches = http["match"].as_sequence().unwrap();
        assert_eq!(
            matches.len(),
            1,
            "{name}: one match per route keeps names 1:1"
        );
        let uri = &matches[0]["uri"];
        let m = if let Some(p) = uri["prefix"].as_str() {
            format!("{{prefix: \"{p}\"}}")
        } else if let Some(p) = uri["exact"].as_str() {
            format!("{{path: \"{p}\"}}")
        } else {
            panic!("{name}: only uri prefix/exact matches are mirrored");
        };
        let dests = http["route"].as_sequence().unwrap();
        assert_eq!(dests.len(), 1, "{name}: one destination");
        let d = &dests[0]["destination"];
        let cluster = cluster_name(
            d["host"].as_str().unwrap(),
            d["port"]["number"].as_u64().unwrap(),
        );
        let timeout = http["timeout"].as_str().unwrap_or("0s");
        routes.push(y(&format!(
            "{{name: {name}, match: {m}, route: {{cluster: \"{cluster}\", timeout: {timeout}}}}}"
        )));
        clusters.insert(cluster);
    }
    (routes, clusters)
}

/// The patched gateway configuration, with the picker cluster pointed at `picker` and the pool's
/// EDS endpoints (one per Ready pod) at `pods`.
fn gateway_bootstrap(listen: u16, admin: u16, picker: SocketAddr, pods: &[SocketAddr]) -> Value {
    let (routes, pool_clusters) = routes_from_virtual_service();
    // What istiod renders for Gateway port 80 before any EnvoyFilter. The 32 KiB connection buffer
    // is Istio's edge setting: BUFFERED bodies must get through by the route's own limit.
    let mut doc = y(&format!(
        r#"
admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }} }}
static_resources:
  listeners:
  - name: 0.0.0.0_8080
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listen} }} }}
    per_connection_buffer_limit_bytes: 32768
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: outbound_0.0.0.0_8080
          route_config:
            name: http.8080
            virtual_hosts:
            - name: "*:80"
              domains: ["*"]
              routes: []
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}
  clusters: []
"#
    ));
    *doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["route_config"]["virtual_hosts"][0]
        .get_mut("routes")
        .unwrap() = Value::Sequence(routes);
    let endpoints: Vec<Value> = pods
        .iter()
        .map(|p| {
            y(&format!(
                "{{endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}}}",
                p.ip(),
                p.port()
            ))
        })
        .collect();
    for name in &pool_clusters {
        // An EDS cluster as istiod builds it for the headless Service on a gateway (Istio's
        // default lb_policy LEAST_REQUEST), endpoints inlined.
        let mut c = y(&format!(
            "{{name: \"{name}\", type: STATIC, connect_timeout: 10s, lb_policy: LEAST_REQUEST, \
              load_assignment: {{cluster_name: \"{name}\", endpoints: [{{lb_endpoints: []}}]}}}}"
        ));
        c["load_assignment"]["endpoints"][0]["lb_endpoints"] = Value::Sequence(endpoints.clone());
        doc["static_resources"]["clusters"]
            .as_sequence_mut()
            .unwrap()
            .push(c);
    }

    let filter = docs(FILTER)
        .into_iter()
        .find(|d| d["kind"] == "EnvoyFilter")
        .unwrap();
    assert_eq!(
        filter["spec"]["workloadSelector"]["labels"]["istio"], "ingressgateway",
        "the EnvoyFilter targets the ingress gateway"
    );
    let mut applied = BTreeSet::new();
    for (i, p) in filter["spec"]["configPatches"]
        .as_sequence()
        .unwrap()
        .iter()
        .enumerate()
    {
        assert_eq!(p["match"]["context"], "GATEWAY", "patch {i}");
        let value = &p["patch"]["value"];
        let apply_to = p["applyTo"].as_str().unwrap();
        let op = p["patch"]["operation"].as_str().unwrap();
        match (apply_to, op) {
            ("CLUSTER", "ADD") => {
                let mut c = value.clone();
                // The picker's in-cluster address becomes the local kv-router.
                let sa = &mut c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
                    ["address"]["socket_address"];
                assert_eq!(sa["address"], "kv-router.llm.svc.cluster.local");
                assert_eq!(sa["port_value"].as_u64(), Some(9002));
                sa["address"] = picker.ip().to_string().into();
                sa["port_value"] = u64::from(picker.port()).into();
                doc["static_resources"]["clusters"]
                    .as_sequence_mut()
                    .unwrap()
                    .push(c);
            }
            ("HTTP_FILTER", "INSERT_BEFORE") => {
                let sub = &p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"];
                assert_eq!(sub, "envoy.filters.http.router");
                let filters = doc["static_resources"]["listeners"][0]["filter_chains"][0]
                    ["filters"][0]["typed_config"]["http_filters"]
                    .as_sequence_mut()
                    .unwrap();
                let at = filters
                    .iter()
                    .position(|f| f["name"] == *sub)
                    .expect("router filter");
                filters.insert(at, value.clone());
            }
            ("HTTP_ROUTE", "MERGE") => {
                let name = p["match"]["routeConfiguration"]["vhost"]["route"]["name"]
                    .as_str()
                    .unwrap();
                let routes = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
                    [0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
                    .as_sequence_mut()
                    .unwrap();
                let hits: Vec<&mut Value> =
                    routes.iter_mut().filter(|r| r["name"] == name).collect();
                assert_eq!(hits.len(), 1, "HTTP_ROUTE patch matches route {name} once");
                for r in hits {
                    merge(r, value);
                }
            }
            ("CLUSTER", "MERGE") => {
                let c = &p["match"]["cluster"];
                let name = cluster_name(
                    c["service"].as_str().unwrap(),
                    c["portNumber"].as_u64().unwrap(),
                );
                let cl = doc["static_resources"]["clusters"]
                    .as_sequence_mut()
                    .unwrap()
                    .iter_mut()
                    .find(|x| x["name"].as_str() == Some(name.as_str()))
                    .unwrap_or_else(|| {
                        panic!("CLUSTER MERGE names {name}, which no VirtualService route uses")
                    });
                merge(cl, value);
            }
            other => panic!("patch {i}: {other:?} is not mirrored by this test"),
        }
        applied.insert(format!("{apply_to} {op}"));
    }
    assert_eq!(
        applied,
        [
            "CLUSTER ADD",
            "CLUSTER MERGE",
            "HTTP_FILTER INSERT_BEFORE",
            "HTTP_ROUTE MERGE"
        ]
        .into_iter()
        .map(String::from)
        .collect(),
        "the four patches a steering EnvoyFilter needs"
    );
    doc
}

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

async fn start_envoy(picker: SocketAddr, pods: &[SocketAddr]) -> Envoy {
    let envoy = common::envoy_bin();
    let dir = tempfile::tempdir().unwrap();
    let (listen, admin) = (free_port().unwrap(), free_port().unwrap());
    let cfg = dir.path().join("gateway.yaml");
    let doc = gateway_bootstrap(listen, admin, picker, pods);
    std::fs::write(&cfg, serde_yaml::to_string(&doc).unwrap()).unwrap();
    let out = Command::new(&envoy)
        .args(["--mode", "validate", "--log-level", "warn", "-c"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(
        out.status.success() && !String::from_utf8_lossy(&out.stderr).contains("Deprecated"),
        "the patched gateway config fails envoy --mode validate (or uses a deprecated field):\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        serde_yaml::to_string(&doc).unwrap()
    );
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

/// Every metric name a scrape exposes, counting the suffixes of counters and histograms.
fn exported_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for l in text.lines() {
        if let Some(t) = l.strip_prefix("# TYPE ") {
            let mut it = t.split_whitespace();
            let (name, ty) = (it.next().unwrap(), it.next().unwrap_or(""));
            names.insert(name.to_string());
            match ty {
                "counter" => {
                    names.insert(format!("{name}_total"));
                }
                "histogram" => {
                    for s in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{s}"));
                    }
                }
                _ => {}
            }
        } else if !l.starts_with('#') && !l.is_empty() {
            let end = l.find(['{', ' ']).unwrap_or(l.len());
            names.insert(l[..end].to_string());
        }
    }
    names
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
