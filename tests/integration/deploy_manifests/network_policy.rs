//! The model pods' NetworkPolicies, evaluated as Kubernetes does on every overlay's render: each
//! model pod is isolated, and what reaches it is exactly its gateway on `http`, kv-router on `http`
//! and the KV-event ports its config dials, and (P/D) the other P/D model pods; every peer a policy
//! names matches pods that exist, and strangers get nothing.

use std::collections::{BTreeMap, BTreeSet};

use kv_router::config::{Config, PortRef};
use serde_yaml::Value;

use super::{find, render, root, router_config, seq_of, Rendered, OVERLAYS};

type Labels = BTreeMap<String, String>;

/// A pod: from a Deployment's template, or one the render implies (a gateway Istio creates) or a
/// stranger the policies must shut out.
#[derive(Clone, Debug)]
struct Pod {
    name: String,
    namespace: String,
    labels: Labels,
    /// (name, number, protocol) of every container port.
    ports: Vec<(String, u16, String)>,
    kind: Kind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Gateway,
    Router,
    Model,
    Other,
}

/// What one source reaches on one pod: nothing, some TCP ports, or every port.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Reach {
    Ports(BTreeSet<u16>),
    All,
}

impl Reach {
    fn none() -> Self {
        Reach::Ports(BTreeSet::new())
    }
    fn add(&mut self, other: Reach) {
        match (&mut *self, other) {
            (Reach::All, _) => {}
            (_, Reach::All) => *self = Reach::All,
            (Reach::Ports(a), Reach::Ports(b)) => a.extend(b),
        }
    }
}

fn labels(v: &Value) -> Labels {
    serde_yaml::from_value(v.clone()).unwrap_or_default()
}

/// A label selector (`matchLabels`, `matchExpressions`); `{}` selects everything.
fn selects(sel: &Value, l: &Labels) -> bool {
    let by_label = labels(&sel["matchLabels"])
        .iter()
        .all(|(k, v)| l.get(k) == Some(v));
    by_label
        && seq_of(&sel["matchExpressions"]).iter().all(|e| {
            let key = e["key"].as_str().unwrap();
            let values: Vec<&str> = seq_of(&e["values"])
                .iter()
                .filter_map(Value::as_str)
                .collect();
            let have = l.get(key).map(String::as_str);
            match e["operator"].as_str().unwrap() {
                "In" => have.is_some_and(|h| values.contains(&h)),
                "NotIn" => !have.is_some_and(|h| values.contains(&h)),
                "Exists" => have.is_some(),
                "DoesNotExist" => have.is_none(),
                op => panic!("unknown selector operator {op}"),
            }
        })
}

fn ns_labels(ns: &str) -> Labels {
    BTreeMap::from([("kubernetes.io/metadata.name".into(), ns.into())])
}

/// An ingress peer (`from[]` entry) of a policy in namespace `ns` admits `src`.
fn peer_admits(peer: &Value, ns: &str, src: &Pod) -> bool {
    assert!(
        peer["ipBlock"].is_null(),
        "ipBlock peers are not expected: {peer:?}"
    );
    let in_ns = match &peer["namespaceSelector"] {
        Value::Null => src.namespace == ns,
        sel => selects(sel, &ns_labels(&src.namespace)),
    };
    in_ns
        && match &peer["podSelector"] {
            Value::Null => true,
            sel => selects(sel, &src.labels),
        }
}

fn is_ingress(np: &Value) -> bool {
    match np["spec"]["policyTypes"].as_sequence() {
        Some(t) => t.iter().any(|t| t == "Ingress"),
        None => true,
    }
}

fn policy_selects(np: &Value, pod: &Pod) -> bool {
    np["metadata"]["namespace"].as_str() == Some(pod.namespace.as_str())
        && selects(&np["spec"]["podSelector"], &pod.labels)
}

/// A rule's ports resolved on `dst` (a named port `dst` lacks opens nothing).
fn rule_ports(rule: &Value, dst: &Pod) -> Reach {
    let ports = seq_of(&rule["ports"]);
    if ports.is_empty() {
        return Reach::All; // missing or empty: every port
    }
    let mut out = BTreeSet::new();
    for p in ports {
        let proto = p["protocol"].as_str().unwrap_or("TCP");
        assert_eq!(proto, "TCP", "model pods speak TCP only: {p:?}");
        assert!(
            p["endPort"].is_null(),
            "port ranges are not expected: {p:?}"
        );
        match (&p["port"], p["port"].as_u64()) {
            (_, Some(n)) => {
                out.insert(n as u16);
            }
            (Value::String(name), None) => {
                out.extend(
                    dst.ports
                        .iter()
                        .filter(|(n, _, pr)| n == name && pr == proto)
                        .map(|(_, num, _)| *num),
                );
            }
            _ => return Reach::All, // no port: every port of that protocol
        }
    }
    Reach::Ports(out)
}

/// What `src` reaches on `dst` under these policies; None when no policy isolates `dst`.
fn reach(policies: &[&Value], src: &Pod, dst: &Pod) -> Option<Reach> {
    let mine: Vec<&&Value> = policies
        .iter()
        .filter(|np| is_ingress(np) && policy_selects(np, dst))
        .collect();
    if mine.is_empty() {
        return None;
    }
    let mut r = Reach::none();
    for np in mine {
        let ns = np["metadata"]["namespace"].as_str().unwrap();
        for rule in seq_of(&np["spec"]["ingress"]) {
            let from = seq_of(&rule["from"]);
            if from.is_empty() || from.iter().any(|p| peer_admits(p, ns, src)) {
                r.add(rule_ports(rule, dst));
            }
        }
    }
    Some(r)
}

/// The Deployments' pods, classified, plus the gateway pods the render implies but does not
/// contain (Istio's ingress gateway, the Gateway API gateway Istio deploys).
fn pods_of(r: &Rendered, model_sel: &Labels) -> Vec<Pod> {
    let mut pods = Vec::new();
    for d in r.docs.iter().filter(|d| d["kind"] == "Deployment") {
        let name = d["metadata"]["name"].as_str().unwrap().to_string();
        let t = &d["spec"]["template"];
        let l = labels(&t["metadata"]["labels"]);
        let ports = seq_of(&t["spec"]["containers"])
            .iter()
            .flat_map(|c| seq_of(&c["ports"]))
            .map(|p| {
                (
                    p["name"].as_str().unwrap_or("").to_string(),
                    p["containerPort"].as_u64().unwrap() as u16,
                    p["protocol"].as_str().unwrap_or("TCP").to_string(),
                )
            })
            .collect();
        let kind = if model_sel.iter().all(|(k, v)| l.get(k) == Some(v)) {
            Kind::Model
        } else if name == "kv-router" {
            Kind::Router
        } else if name == "envoy" {
            Kind::Gateway // components/standalone-envoy
        } else {
            Kind::Other
        };
        pods.push(Pod {
            name,
            namespace: d["metadata"]["namespace"].as_str().unwrap().to_string(),
            labels: l,
            ports,
            kind,
        });
    }
    // Istio's gateways, which the render configures but Istio creates: the pods an EnvoyFilter's
    // workloadSelector patches (in its namespace: the ingress gateway in istio-system), and a
    // Gateway API Gateway's pods (its namespace, labelled with its name).
    let mut implied: BTreeSet<(String, Labels)> = BTreeSet::new();
    for d in &r.docs {
        let ns = d["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string();
        if d["kind"] == "EnvoyFilter" && !d["spec"]["workloadSelector"].is_null() {
            implied.insert((ns, labels(&d["spec"]["workloadSelector"]["labels"])));
        } else if d["kind"] == "Gateway"
            && d["apiVersion"]
                .as_str()
                .is_some_and(|a| a.starts_with("gateway.networking.k8s.io/"))
        {
            let name = d["metadata"]["name"].as_str().unwrap();
            let l = Labels::from([("gateway.networking.k8s.io/gateway-name".into(), name.into())]);
            implied.insert((ns, l));
        }
    }
    for (namespace, labels) in implied {
        pods.push(Pod {
            name: format!("gateway in {namespace}"),
            namespace,
            labels,
            ports: vec![],
            kind: Kind::Gateway,
        });
    }
    // Overlays that bring no model pods: one as the base describes them (Service vllm's labels,
    // a port named `http` on 8000), so the policies are checked against it.
    if !pods.iter().any(|p| p.kind == Kind::Model) {
        pods.push(Pod {
            name: "your-model-pod".into(),
            namespace: "llm".into(),
            labels: model_sel.clone(),
            ports: vec![("http".into(), 8000, "TCP".into())],
            kind: Kind::Model,
        });
    }
    pods
}

/// Pods that must reach no model pod: look-alikes in the wrong namespace or with a wrong label.
fn strangers(model_sel: &Labels) -> Vec<Pod> {
    let pod = |name: &str, ns: &str, l: &[(&str, &str)]| Pod {
        name: name.into(),
        namespace: ns.into(),
        labels: l
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ports: vec![],
        kind: Kind::Other,
    };
    let mut out = vec![
        pod("client", "llm", &[("app", "client")]),
        pod(
            "kv-router-elsewhere",
            "default",
            &[("app.kubernetes.io/name", "kv-router")],
        ),
        pod(
            "envoy-elsewhere",
            "default",
            &[("app.kubernetes.io/name", "envoy")],
        ),
        pod(
            "ingressgateway-in-llm",
            "llm",
            &[("istio", "ingressgateway")],
        ),
        pod(
            "gateway-pod-elsewhere",
            "default",
            &[("gateway.networking.k8s.io/gateway-name", "llm-gateway")],
        ),
        pod(
            "prometheus",
            "monitoring",
            &[("app.kubernetes.io/name", "prometheus")],
        ),
    ];
    let mut model_elsewhere = pod("model-elsewhere", "default", &[]);
    model_elsewhere.labels = model_sel.clone();
    model_elsewhere
        .labels
        .insert("llm-d.ai/role".into(), "decode".into());
    out.push(model_elsewhere);
    out
}

/// The port of a `tcp://{ip}:PORT` endpoint template (`{port}`: the pod's HTTP port).
fn endpoint_port(template: &str, http: u16) -> u16 {
    let p = template.rsplit(':').next().unwrap();
    if p == "{port}" {
        http
    } else {
        p.parse()
            .unwrap_or_else(|_| panic!("endpoint {template:?}: no port"))
    }
}

/// What each kind of source may reach on `dst`, from the router's config and the pod's ports.
fn expected(cfg: &Config, dst: &Pod, src: &Pod, pd: bool) -> Reach {
    let k = cfg.pods.kubernetes.as_ref().unwrap();
    let http = match &k.port {
        PortRef::Number(n) => *n,
        PortRef::Name(n) => {
            dst.ports
                .iter()
                .find(|(name, _, _)| name == n)
                .unwrap_or_else(|| panic!("{}: no port named {n}", dst.name))
                .1
        }
    };
    let mut ports = BTreeSet::from([http]);
    match src.kind {
        Kind::Gateway => Reach::Ports(ports),
        Kind::Router => {
            let ev = &cfg.kv_events;
            if ev.enabled {
                let dp = u16::try_from(ev.data_parallel_size.max(1)).unwrap();
                for t in [&ev.endpoint, &ev.replay_endpoint] {
                    if !t.is_empty() {
                        let base = endpoint_port(t, http);
                        ports.extend((0..dp).map(|r| base + r));
                    }
                }
            }
            for p in &ports {
                assert!(
                    dst.ports.iter().any(|(_, n, pr)| n == p && pr == "TCP"),
                    "{}: kv-router dials port {p}, which no container declares",
                    dst.name
                );
            }
            Reach::Ports(ports)
        }
        Kind::Model
            if pd
                && dst.labels.contains_key(&k.role_label)
                && src.labels.contains_key(&k.role_label) =>
        {
            Reach::All
        }
        _ => Reach::none(),
    }
}

#[test]
fn model_pods_admit_only_their_gateway_kv_router_and_pd_peers() {
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let mut named_ports: BTreeMap<String, bool> = BTreeMap::new();
    for o in OVERLAYS {
        let r = render(&root().join("deploy/overlays").join(o), o, tmp.path());
        let Ok(cfg) = router_config(&r, tmp.path()) else {
            continue; // reported by the validation test
        };
        let k = cfg.pods.kubernetes.as_ref().unwrap();
        let svc = find(&r.docs, "Service", "vllm").expect("vllm Service");
        let model_sel = labels(&svc["spec"]["selector"]);
        let pods = pods_of(&r, &model_sel);
        let policies: Vec<&Value> = r
            .docs
            .iter()
            .filter(|d| d["kind"] == "NetworkPolicy")
            .collect();
        let pd = pods
            .iter()
            .any(|p| p.kind == Kind::Model && p.labels.contains_key(&k.role_label));
        let mut sources = pods.clone();
        sources.extend(strangers(&model_sel));

        for dst in pods.iter().filter(|p| p.kind == Kind::Model) {
            for src in &sources {
                let Some(have) = reach(&policies, src, dst) else {
                    failures.push(format!(
                        "{o}: model pod {} is selected by no NetworkPolicy",
                        dst.name
                    ));
                    break;
                };
                let want = expected(&cfg, dst, src, pd);
                if have != want {
                    failures.push(format!(
                        "{o}: {} ({:?}, ns {}) reaches {:?} on model pod {}, expected {:?}",
                        src.name, src.kind, src.namespace, have, dst.name, want
                    ));
                }
            }
            // Every kind of legitimate peer is there to be admitted.
            for kind in [Kind::Gateway, Kind::Router] {
                if !pods.iter().any(|p| p.kind == kind) {
                    failures.push(format!("{o}: no {kind:?} pod in the render"));
                }
            }
        }

        // Every policy that isolates model pods names peers that exist and selects pods that do.
        for np in policies.iter().filter(|np| {
            pods.iter()
                .any(|p| p.kind == Kind::Model && policy_selects(np, p))
        }) {
            let name = np["metadata"]["name"].as_str().unwrap();
            let ns = np["metadata"]["namespace"].as_str().unwrap();
            for rule in seq_of(&np["spec"]["ingress"]) {
                for peer in seq_of(&rule["from"]) {
                    if !pods.iter().any(|p| peer_admits(peer, ns, p)) {
                        failures.push(format!("{o}: {name}: peer {peer:?} matches no pod"));
                    }
                }
                for p in seq_of(&rule["ports"]) {
                    if let Some(n) = p["port"].as_str() {
                        let found = pods.iter().any(|d| {
                            policy_selects(np, d) && d.ports.iter().any(|(pn, _, _)| pn == n)
                        });
                        *named_ports.entry(format!("{name}: {n}")).or_default() |= found;
                    }
                }
            }
        }
    }
    // A named port no selected pod declares in any overlay is a typo, not a pod without it.
    for (port, found) in named_ports {
        if !found {
            failures.push(format!("{port}: no model pod of any overlay has that port"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The evaluator itself: namespaces, named ports, expressions and isolation as Kubernetes reads them.
#[test]
fn the_policy_evaluator_reads_selectors_as_kubernetes_does() {
    let np: Value = serde_yaml::from_str(
        "kind: NetworkPolicy\n\
         metadata: { name: p, namespace: llm }\n\
         spec:\n\
         \x20 podSelector: { matchExpressions: [ { key: role, operator: In, values: [a, b] } ] }\n\
         \x20 ingress:\n\
         \x20 - from: [ { podSelector: { matchLabels: { x: y } } } ]\n\
         \x20   ports: [ { port: http }, { port: 9000, protocol: TCP } ]\n\
         \x20 - from: [ { namespaceSelector: { matchLabels: { kubernetes.io/metadata.name: mon } }, podSelector: {} } ]\n",
    )
    .unwrap();
    let pod = |ns: &str, l: &[(&str, &str)]| Pod {
        name: "p".into(),
        namespace: ns.into(),
        labels: l
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ports: vec![("http".into(), 8000, "TCP".into())],
        kind: Kind::Other,
    };
    let dst = pod("llm", &[("role", "a")]);
    let ps = [&np];
    let ports = |v: &[u16]| Some(Reach::Ports(v.iter().copied().collect()));
    assert_eq!(
        reach(&ps, &pod("llm", &[("x", "y")]), &dst),
        ports(&[8000, 9000])
    );
    assert_eq!(reach(&ps, &pod("other", &[("x", "y")]), &dst), ports(&[]));
    assert_eq!(reach(&ps, &pod("mon", &[]), &dst), Some(Reach::All));
    assert_eq!(reach(&ps, &pod("llm", &[]), &dst), ports(&[]));
    assert_eq!(
        reach(&ps, &pod("llm", &[]), &pod("llm", &[("role", "c")])),
        None
    );
    assert_eq!(
        reach(&ps, &pod("llm", &[]), &pod("other", &[("role", "a")])),
        None
    );
}
