//! Offline validation of everything under `deploy/` and the image files, with the real tools
//! (`make deploy-tools` installs them into `.venv`; a missing tool fails the test):
//! - the standalone Envoy ConfigMap is generated from `envoy/override-host-buffered.yaml`
//!   (`KV_ROUTER_BLESS=1` rewrites it after a deliberate change of the bundled file);
//! - every overlay renders with `kubectl kustomize`, core kinds pass `kubernetes-validate
//!   --strict`, custom resources pass their vendored CRD schemas (`deploy/schemas/`), Envoy
//!   configs in ConfigMaps pass `envoy --mode validate`, kv-router's config layers parse, and the
//!   Role grants exactly what the discovery code calls;
//! - (`pd`) the P/D overlays' pods carry the roles, ports and flags the router and sidecar read;
//! - (`network_policy`) the model pods admit exactly their gateway, kv-router and P/D peers;
//! - (`images`) third-party images are pinned by digest, or listed with the reason they are not;
//! - (`scripts`) `deploy/kind/demo.sh` passes shellcheck; the Dockerfile passes hadolint and
//!   copies only paths that exist and that `.dockerignore` keeps.
#![cfg(feature = "kubernetes")]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use kv_router::config::{Config, KubernetesOverrides};
use kv_router::pods::kubernetes::{required_rbac, RbacRule};
use serde_yaml::Value;

mod images;
mod network_policy;
mod pd;
mod scripts;

/// The Kubernetes version manifests are validated against (k8s-openapi feature `v1_35`).
const KUBE_VERSION: &str = "1.35.0";
const OVERLAYS: [&str; 9] = [
    "standalone-envoy",
    "istio-envoyfilter",
    "gateway-api",
    "sim",
    "vllm",
    "vllm-pd",
    "redis",
    "redis-tls",
    "monitoring",
];
/// Overlays whose kv-router shares the Valkey index (`components/redis`).
const SHARED_INDEX: [&str; 3] = ["redis", "redis-tls", "monitoring"];

fn envoy() -> PathBuf {
    std::env::var_os("KV_ROUTER_ENVOY")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| tool("envoy"))
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

// ---- the standalone Envoy config: one source ----

const BUNDLED: &str = "envoy/override-host-buffered.yaml";
const GENERATED: &str = "deploy/components/standalone-envoy/envoy.yaml";

/// Replaces `from` (which must occur exactly once) by `to`.
fn replace_once(text: &str, from: &str, to: &str) -> String {
    assert_eq!(
        text.matches(from).count(),
        1,
        "{BUNDLED} changed shape: `{from}` must occur exactly once; update the generator in {}",
        file!()
    );
    text.replacen(from, to, 1)
}

/// Envoy 1.40's strict-DNS cluster (the `dns_refresh_rate` cluster field is deprecated): every
/// address the name resolves to is an endpoint.
fn dns_cluster(why: &str, refresh: &str) -> String {
    format!(
        "    cluster_type:                       # STRICT_DNS on the {why}\n\
         \x20     name: envoy.cluster.dns\n\
         \x20     typed_config:\n\
         \x20       \"@type\": type.googleapis.com/envoy.extensions.clusters.dns.v3.DnsCluster\n\
         \x20       dns_refresh_rate: {refresh}\n\
         \x20       respect_dns_ttl: false            # headless Service records carry a 30 s TTL\n"
    )
}

/// The standalone Envoy's Prometheus port (container port `stats`, scraped by
/// `components/standalone-envoy/monitoring`).
const STATS_PORT: u16 = 9102;

/// Listener `stats`: exactly `/stats/prometheus` of the admin (which stays on 127.0.0.1, where it
/// can also stop Envoy), every other path 404.
fn stats_listener() -> String {
    format!(
        "  - name: stats                       # Prometheus: only /stats/prometheus of the loopback admin\n\
         \x20   address: {{ socket_address: {{ address: 0.0.0.0, port_value: {STATS_PORT} }} }}\n\
         \x20   filter_chains:\n\
         \x20   - filters:\n\
         \x20     - name: envoy.filters.network.http_connection_manager\n\
         \x20       typed_config:\n\
         \x20         \"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager\n\
         \x20         stat_prefix: stats\n\
         \x20         route_config:\n\
         \x20           name: stats\n\
         \x20           virtual_hosts:\n\
         \x20           - name: stats\n\
         \x20             domains: [\"*\"]\n\
         \x20             routes:\n\
         \x20             - match: {{ path: /stats/prometheus, headers: [ {{ name: \":method\", string_match: {{ exact: GET }} }} ] }}\n\
         \x20               route: {{ cluster: envoy_admin }}\n\
         \x20             - match: {{ prefix: / }}\n\
         \x20               direct_response: {{ status: 404 }}\n\
         \x20         http_filters:\n\
         \x20         - name: envoy.filters.http.router\n\
         \x20           typed_config: {{ \"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}\n"
    )
}

/// The admin as an upstream of listener `stats`.
const ADMIN_CLUSTER: &str =
    "  - name: envoy_admin                 # the loopback admin, for listener `stats` only\n\
\x20   type: STATIC\n\
\x20   connect_timeout: 1s\n\
\x20   load_assignment:\n\
\x20     cluster_name: envoy_admin\n\
\x20     endpoints:\n\
\x20     - lb_endpoints:\n\
\x20       - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 9901 } } }\n";

/// `envoy/override-host-buffered.yaml` for Kubernetes: kv_router and vllm_pool become STRICT_DNS
/// clusters (DnsCluster) on the headless Services (one endpoint per Ready pod / replica), and
/// listener `stats` exposes `/stats/prometheus` of the admin; nothing else changes.
fn standalone_envoy(bundled: &str) -> String {
    assert!(
        bundled.contains(
            "\nadmin:\n  address: { socket_address: { address: 127.0.0.1, port_value: 9901 } }"
        ),
        "{BUNDLED}: the admin moved; update ADMIN_CLUSTER in {}",
        file!()
    );
    let body_start = bundled
        .find("\nadmin:")
        .expect("bundled config has a top-level admin block");
    let mut t = format!(
        "# GENERATED from {BUNDLED} by tests/integration/deploy_manifests/ — do not edit; edit the bundled file\n\
         # and run `KV_ROUTER_BLESS=1 cargo test --test integration deploy_manifests::`. kv_router and vllm_pool are\n\
         # strict-DNS clusters on the headless Services kv-router and vllm, and listener `stats` serves\n\
         # GET /stats/prometheus of the loopback-only admin on :{STATS_PORT} (nothing else of the admin).\n{}",
        &bundled[body_start + 1..]
    );
    t = replace_once(
        &t,
        "  - name: kv_router\n    type: STATIC\n",
        &format!(
            "  - name: kv_router\n{}",
            dns_cluster("headless Service kv-router: one endpoint per replica", "5s")
        ),
    );
    t = replace_once(
        &t,
        "address: 127.0.0.1, port_value: 9002",
        "address: kv-router.llm.svc.cluster.local, port_value: 9002",
    );
    let pool_type = t
        .lines()
        .find(|l| l.starts_with("    type: STATIC") && l.contains("Kubernetes"))
        .expect("vllm_pool type line")
        .to_string();
    t = replace_once(
        &t,
        &format!("  - name: vllm_pool\n{pool_type}\n"),
        &format!(
            "  - name: vllm_pool\n{}",
            dns_cluster("headless Service vllm: one endpoint per Ready pod", "2s")
        ),
    );
    t = replace_once(
        &t,
        "        - endpoint: { address: { socket_address: { address: 10.0.0.5, port_value: 8000 } } }\n        - endpoint: { address: { socket_address: { address: 10.0.0.6, port_value: 8000 } } }\n",
        "        - endpoint: { address: { socket_address: { address: vllm.llm.svc.cluster.local, port_value: 8000 } } }\n",
    );
    t = replace_once(
        &t,
        "  listeners:\n",
        &format!("  listeners:\n{}", stats_listener()),
    );
    t = replace_once(
        &t,
        "  clusters:\n",
        &format!("  clusters:\n{ADMIN_CLUSTER}"),
    );
    t
}

#[test]
fn standalone_envoy_config_is_generated_from_the_bundled_one() {
    let bundled = fs::read_to_string(root().join(BUNDLED)).unwrap();
    let want = standalone_envoy(&bundled);
    let path = root().join(GENERATED);
    if std::env::var_os("KV_ROUTER_BLESS").is_some() {
        fs::write(&path, &want).unwrap();
    }
    let have = fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "{GENERATED} is not what {BUNDLED} generates; run `KV_ROUTER_BLESS=1 cargo test --test integration deploy_manifests::`"
    );
    // Structurally: the bundled config with only those two clusters changed, plus the stats
    // listener and its admin cluster (which route exactly GET /stats/prometheus to the admin).
    let mut b: Value = serde_yaml::from_str(&bundled).unwrap();
    let mut g: Value = serde_yaml::from_str(&have).unwrap();
    let take = |list: &mut Value, name: &str| -> Value {
        let seq = list.as_sequence_mut().unwrap();
        let i = seq
            .iter()
            .position(|x| x["name"] == name)
            .unwrap_or_else(|| panic!("{GENERATED}: no {name}"));
        seq.remove(i)
    };
    let stats = take(&mut g["static_resources"]["listeners"], "stats");
    let admin = take(&mut g["static_resources"]["clusters"], "envoy_admin");
    assert_eq!(
        stats["address"]["socket_address"]["port_value"].as_u64(),
        Some(u64::from(STATS_PORT))
    );
    let hcm = &stats["filter_chains"][0]["filters"][0]["typed_config"];
    let routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        .as_sequence()
        .unwrap();
    assert_eq!(routes.len(), 2, "stats routes: {routes:?}");
    assert_eq!(routes[0]["match"]["path"], "/stats/prometheus");
    assert_eq!(routes[0]["route"]["cluster"], "envoy_admin");
    assert_eq!(routes[1]["direct_response"]["status"].as_u64(), Some(404));
    assert_eq!(
        admin["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"],
        b["admin"]["address"],
        "envoy_admin must be the admin's own loopback address"
    );
    let clusters = b["static_resources"]["clusters"].as_sequence_mut().unwrap();
    for (c, host, port) in [
        ("kv_router", "kv-router.llm.svc.cluster.local", 9002),
        ("vllm_pool", "vllm.llm.svc.cluster.local", 8000),
    ] {
        let cl = clusters.iter_mut().find(|x| x["name"] == c).unwrap();
        cl.as_mapping_mut().unwrap().remove("type");
        cl["cluster_type"] = serde_yaml::from_str(&format!(
            "{{name: envoy.cluster.dns, typed_config: {{'@type': type.googleapis.com/envoy.extensions.clusters.dns.v3.DnsCluster, dns_refresh_rate: {}, respect_dns_ttl: false}}}}",
            if c == "kv_router" { "5s" } else { "2s" }
        ))
        .unwrap();
        cl["load_assignment"]["endpoints"][0]["lb_endpoints"] = serde_yaml::from_str(&format!(
            "[{{endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}}}]"
        ))
        .unwrap();
    }
    assert_eq!(b, g, "generated config differs beyond the two clusters");
}

// ---- overlays ----

struct Rendered {
    name: String,
    file: PathBuf,
    docs: Vec<Value>,
}

fn render(dir: &Path, name: &str, out: &Path) -> Rendered {
    let text = run(Command::new(tool("kubectl")).arg("kustomize").arg(dir));
    let file = out.join(format!("{name}.yaml"));
    fs::write(&file, &text).unwrap();
    let docs = serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect();
    Rendered {
        name: name.to_string(),
        file,
        docs,
    }
}

use crate::common::{repo_root as root, venv_tool as tool};
use serde::Deserialize;

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    docs.iter().find(|d| {
        d["kind"].as_str() == Some(kind)
            && d["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n == name || n.starts_with(&format!("{name}-")))
    })
}

/// kv-router's effective config: the ConfigMap's layers (merged by `load_with`) + the
/// Deployment's `--pool-*` flags.
fn router_config(r: &Rendered, tmp: &Path) -> Result<Config, String> {
    let cm = find(&r.docs, "ConfigMap", "kv-router-config").expect("kv-router ConfigMap");
    let dir = tmp.join(format!("{}-router", r.name));
    fs::create_dir_all(&dir).unwrap();
    for (k, v) in cm["data"].as_mapping().unwrap() {
        fs::write(dir.join(k.as_str().unwrap()), v.as_str().unwrap()).unwrap();
    }
    let dep = find(&r.docs, "Deployment", "kv-router").expect("kv-router Deployment");
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let flag = |f: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("{f}=")).map(String::from))
    };
    // The config directory is what the Deployment mounts and passes to --config.
    let cfg_at = args
        .iter()
        .position(|a| *a == "--config")
        .map(|i| args[i + 1])
        .expect("--config");
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "config")
        .unwrap();
    assert_eq!(mount["mountPath"].as_str(), Some(cfg_at), "{}", r.name);
    Config::load_with(
        &dir,
        KubernetesOverrides {
            pool_name: flag("--pool-name"),
            pool_namespace: flag("--pool-namespace"),
        },
    )
    .map_err(|e| e.to_string())
}

fn role_rules(r: &Rendered) -> BTreeSet<RbacRule> {
    let role = find(&r.docs, "Role", "kv-router").expect("kv-router Role");
    let mut out = BTreeSet::new();
    for rule in role["rules"].as_sequence().unwrap() {
        let list = |k: &str| -> Vec<String> {
            let mut v: Vec<String> = rule[k]
                .as_sequence()
                .map(|s| s.iter().map(|x| x.as_str().unwrap().to_string()).collect())
                .unwrap_or_default();
            v.sort();
            v
        };
        for g in list("apiGroups") {
            for res in list("resources") {
                out.insert(RbacRule {
                    api_group: g.clone(),
                    resource: res,
                    verbs: list("verbs"),
                    resource_names: list("resourceNames"),
                });
            }
        }
    }
    out
}

/// `(api group, kind)` of the resources `kubernetes-validate` has no schema for.
fn unvalidated_kinds(output: &str) -> BTreeSet<String> {
    output
        .lines()
        .filter(|l| l.starts_with("WARN"))
        .filter_map(|l| {
            let kind = l.split("for kind ").nth(1)?.split(' ').next()?;
            Some(kind.to_string())
        })
        .collect()
}

#[test]
fn every_overlay_renders_and_validates_offline() {
    let tmp = tempfile::tempdir().unwrap();
    // Every component is in some overlay (monitoring: overlays/monitoring).
    let rendered: Vec<Rendered> = OVERLAYS
        .iter()
        .map(|o| render(&root().join("deploy/overlays").join(o), o, tmp.path()))
        .collect();

    let mut failures = Vec::new();
    let files: Vec<&Path> = rendered.iter().map(|r| r.file.as_path()).collect();
    // Core kinds: the Kubernetes OpenAPI schemas, unknown fields rejected.
    let core = Command::new(tool("kubernetes-validate"))
        .args(["--strict", "-k", KUBE_VERSION])
        .args(&files)
        .output()
        .unwrap();
    let core_out = String::from_utf8_lossy(&core.stdout).into_owned();
    if !core.status.success() || core_out.contains("ERROR") {
        failures.push(format!("kubernetes-validate --strict:\n{core_out}"));
    }
    // Custom kinds: the vendored CRD schemas (every non-built-in group must have one).
    let crd = Command::new(tool("python3"))
        .arg(root().join("deploy/schemas/validate_crds.py"))
        .args(&files)
        .output()
        .unwrap();
    let crd_out = String::from_utf8_lossy(&crd.stdout).into_owned();
    if !crd.status.success() {
        failures.push(format!("validate_crds.py:\n{crd_out}"));
    }
    let crd_checked: BTreeSet<String> = crd_out
        .lines()
        .filter(|l| l.starts_with("OK "))
        .filter_map(|l| l.split(": ").nth(1)?.split('/').next().map(String::from))
        .collect();
    for kind in unvalidated_kinds(&core_out) {
        if !crd_checked.contains(&kind) {
            failures.push(format!(
                "{kind}: neither kubernetes-validate nor a vendored CRD checked it"
            ));
        }
    }
    for want in [
        "EnvoyFilter",
        "Gateway",
        "VirtualService",
        "InferencePool",
        "HTTPRoute",
        "PodMonitor",
        "PrometheusRule",
    ] {
        if !crd_checked.contains(want) {
            failures.push(format!(
                "no {want} was validated against its CRD:\n{crd_out}"
            ));
        }
    }

    let envoy = envoy();
    for r in &rendered {
        // Every Envoy bootstrap shipped in a ConfigMap.
        for cm in r.docs.iter().filter(|d| d["kind"] == "ConfigMap") {
            for (k, v) in cm["data"].as_mapping().into_iter().flatten() {
                let text = v.as_str().unwrap_or("");
                if !text.contains("static_resources:") {
                    continue;
                }
                let f = tmp
                    .path()
                    .join(format!("{}-{}", r.name, k.as_str().unwrap()));
                fs::write(&f, text).unwrap();
                let out = Command::new(&envoy)
                    .args(["--mode", "validate", "--log-level", "warn", "-c"])
                    .arg(&f)
                    .output()
                    .unwrap();
                let stderr = String::from_utf8_lossy(&out.stderr);
                if !out.status.success() || stderr.contains("Deprecated") {
                    failures.push(format!(
                        "{}: ConfigMap {} key {k:?} fails envoy --mode validate (or uses a deprecated field):\n{}",
                        r.name,
                        cm["metadata"]["name"].as_str().unwrap_or("?"),
                        stderr
                    ));
                }
            }
        }
        // kv-router's config, and the Role it runs with.
        let cfg = match router_config(r, tmp.path()) {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!("{}: kv-router config: {e}", r.name));
                continue;
            }
        };
        let k = cfg
            .pods
            .kubernetes
            .as_ref()
            .unwrap_or_else(|| panic!("{}: kv-router does not use pods.kubernetes", r.name));
        let want: BTreeSet<RbacRule> = required_rbac(k, &cfg.flow_control).into_iter().collect();
        let have = role_rules(r);
        if want != have {
            failures.push(format!(
                "{}: Role grants {have:?}, the code calls exactly {want:?}",
                r.name
            ));
        }
        if r.name == "gateway-api" {
            assert_eq!(k.pool.as_ref().map(|p| p.name.as_str()), Some("vllm-pool"));
        }
        // The redis layer shares the index (and sessions) through the bundled Valkey, with the
        // password from the mounted Secret only (tests/integration/deploy_cluster/ follows the Secret).
        let shared = cfg.index.backend == kv_router::config::IndexBackend::Redis;
        assert_eq!(
            shared,
            SHARED_INDEX.contains(&r.name.as_str()),
            "{}: index.backend",
            r.name
        );
        if shared {
            let redis = &cfg.index.redis;
            let scheme = if r.name == "redis-tls" {
                "rediss://"
            } else {
                "redis://"
            };
            assert_eq!(
                redis.url,
                format!("{scheme}valkey.llm.svc.cluster.local:6379"),
                "{}",
                r.name
            );
            assert_eq!(
                redis.tls_ca_file.is_some(),
                r.name == "redis-tls",
                "{}",
                r.name
            );
            assert_eq!(
                redis.password_file.as_deref(),
                Some("/var/run/secrets/redis/password")
            );
            assert!(redis.password.is_none() && redis.password_env.is_none());
            peers_are_declared_and_admitted(r, &redis.load_peers_bind);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn pools_services_and_selectors_agree() {
    // Picks are ip:port of pods kv-router watches; the gateway only knows the Service's (or the
    // pool's) pods. If the selectors differ, picks silently fall back to round robin.
    let tmp = tempfile::tempdir().unwrap();
    for o in OVERLAYS {
        let r = render(&root().join("deploy/overlays").join(o), o, tmp.path());
        let svc = find(&r.docs, "Service", "vllm").expect("vllm Service");
        let svc_sel: BTreeMap<String, String> =
            serde_yaml::from_value(svc["spec"]["selector"].clone()).unwrap();
        let Ok(cfg) = router_config(&r, tmp.path()) else {
            continue; // reported by the validation test
        };
        let k = cfg.pods.kubernetes.unwrap();
        let router_sel: BTreeMap<String, String> = match &k.pool {
            Some(p) => {
                let pool = find(&r.docs, "InferencePool", &p.name).expect("the named pool");
                serde_yaml::from_value(pool["spec"]["selector"]["matchLabels"].clone()).unwrap()
            }
            None => k
                .selector
                .split(',')
                .map(|t| {
                    let (a, b) = t.split_once('=').unwrap();
                    (a.trim().to_string(), b.trim().to_string())
                })
                .collect(),
        };
        assert_eq!(
            svc_sel, router_sel,
            "{o}: Service vllm and kv-router select different pods"
        );
        for d in r.docs.iter().filter(|d| d["kind"] == "Deployment") {
            // Logical image names (`kv-router`, `envoy`) must all be resolved by kustomize.
            let spec = &d["spec"]["template"]["spec"];
            for c in ["containers", "initContainers"]
                .iter()
                .flat_map(|k| spec[*k].as_sequence().into_iter().flatten())
            {
                let image = c["image"].as_str().unwrap();
                let (repo, tag) = image.rsplit_once(':').unwrap_or((image, ""));
                assert!(
                    !["kv-router", "envoy"].contains(&repo) && !tag.is_empty() && tag != "latest",
                    "{o}: image {image:?} is not a pinned, resolved reference"
                );
            }
            let labels: BTreeMap<String, String> =
                serde_yaml::from_value(d["spec"]["template"]["metadata"]["labels"].clone())
                    .unwrap();
            if router_sel.iter().all(|(k, v)| labels.get(k) == Some(v)) {
                // kv-router resolves the port name among spec.containers only (not init
                // containers), and exactly one container may own it (P/D: the decode sidecar).
                let http: Vec<&Value> = spec["containers"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .flat_map(|c| c["ports"].as_sequence().into_iter().flatten())
                    .filter(|p| p["name"] == "http")
                    .collect();
                assert_eq!(
                    http.len(),
                    1,
                    "{o}: model Deployment without exactly one `http` container port"
                );
                assert_eq!(http[0]["containerPort"].as_u64(), Some(8000), "{o}");
            }
        }
    }
}

/// The load-datagram port (`index.redis.load_peers_bind`) is fixed, a UDP port of the router's
/// container, and admitted by a NetworkPolicy from kv-router's own pods only.
fn peers_are_declared_and_admitted(r: &Rendered, bind: &str) {
    let port = bind
        .parse::<std::net::SocketAddr>()
        .unwrap_or_else(|e| panic!("{}: load_peers_bind {bind:?}: {e}", r.name))
        .port() as u64;
    assert_ne!(port, 0, "{}: a NetworkPolicy needs a fixed port", r.name);
    let deploy = find(&r.docs, "Deployment", "kv-router").expect("kv-router Deployment");
    let c = &seq_of(&deploy["spec"]["template"]["spec"]["containers"])[0];
    assert!(
        seq_of(&c["ports"])
            .iter()
            .any(|p| p["containerPort"].as_u64() == Some(port) && p["protocol"] == "UDP"),
        "{}: UDP {port} is not a container port",
        r.name
    );
    let router = |sel: &Value| sel["matchLabels"]["app.kubernetes.io/name"] == "kv-router";
    let admitted = r
        .docs
        .iter()
        .filter(|d| d["kind"] == "NetworkPolicy")
        .any(|np| {
            router(&np["spec"]["podSelector"])
                && seq_of(&np["spec"]["ingress"]).iter().any(|rule| {
                    let from = seq_of(&rule["from"]);
                    !from.is_empty()
                        && from
                            .iter()
                            .all(|f| router(&f["podSelector"]) && f["namespaceSelector"].is_null())
                        && seq_of(&rule["ports"])
                            .iter()
                            .any(|p| p["port"].as_u64() == Some(port) && p["protocol"] == "UDP")
                })
        });
    assert!(
        admitted,
        "{}: no NetworkPolicy admits UDP {port} from kv-router",
        r.name
    );
}

/// A sequence, or nothing.
fn seq_of(v: &Value) -> &[Value] {
    v.as_sequence().map(Vec::as_slice).unwrap_or(&[])
}
