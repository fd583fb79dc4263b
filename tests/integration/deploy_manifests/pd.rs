//! P/D (prefill/decode): the pods of the P/D overlays carry the roles the router reads, the
//! llm-d sidecar owns the decode pod's HTTP port, and it reads the router's prefill header.

use std::collections::BTreeSet;
use std::fs;

use serde_yaml::Value;

use super::{render, root, router_config, seq_of, OVERLAYS};

/// The header llm-d's disagg sidecar reads the prefill pod from (llm-d-router
/// `pkg/common/routing`: `PrefillEndpointHeader`); the sidecar has no flag to change it.
const SIDECAR_PREFILL_HEADER: &str = "x-prefiller-host-port";

/// A container's `--flag=value` argument, and as a number.
fn arg<'a>(c: &'a Value, flag: &str) -> Option<&'a str> {
    let mut args = c["args"].as_sequence()?.iter().filter_map(Value::as_str);
    args.find_map(|a| a.strip_prefix(flag)?.strip_prefix('='))
}
fn num_arg(c: &Value, flag: &str) -> Option<u64> {
    arg(c, flag)?.parse().ok()
}

/// The number of a container port named `name`, or whether `number` is declared.
fn named(c: &Value, name: &str) -> Option<u64> {
    let p = seq_of(&c["ports"]).iter().find(|p| p["name"] == name)?;
    p["containerPort"].as_u64()
}
fn declares(c: &Value, number: Option<u64>) -> bool {
    let mut ports = seq_of(&c["ports"]).iter();
    number.is_some() && ports.any(|p| p["containerPort"].as_u64() == number)
}

#[test]
fn pd_pods_carry_roles_the_sidecar_owns_decode_http_and_reads_the_routers_header() {
    use kv_router::config::{PodRole, PortRef};
    let tok = |c: &str| {
        fs::read_to_string(root().join(format!("deploy/components/{c}/kv-router-tokenizer.yaml")))
    };
    assert_eq!(
        tok("vllm").unwrap(),
        tok("vllm-pd").unwrap(),
        "tokenizer patches differ"
    );
    let tmp = tempfile::tempdir().unwrap();
    let mut bad = Vec::new();
    for o in OVERLAYS {
        let r = render(&root().join("deploy/overlays").join(o), o, tmp.path());
        let Ok(cfg) = router_config(&r, tmp.path()) else {
            continue; // reported by the validation test
        };
        let k = cfg.pods.kubernetes.as_ref().unwrap();
        let PortRef::Name(http) = &k.port else {
            panic!("{o}: pods.kubernetes.port is no name")
        };
        let events: Option<u64> = cfg
            .kv_events
            .endpoint
            .rsplit(':')
            .next()
            .map(|p| p.parse().unwrap());
        let (mut roles, mut blocks, mut sidecars) = (BTreeSet::new(), BTreeSet::new(), 0);
        for d in r.docs.iter().filter(|d| d["kind"] == "Deployment") {
            let role_of = |v: &Value| v[k.role_label.as_str()].as_str().map(String::from);
            let Some(value) = role_of(&d["spec"]["template"]["metadata"]["labels"]) else {
                continue;
            };
            let name = d["metadata"]["name"].as_str().unwrap();
            let role = PodRole::parse(&value);
            let decode = role == Some(PodRole::Decode);
            let cs = seq_of(&d["spec"]["template"]["spec"]["containers"]);
            let front = cs
                .iter()
                .find(|c| named(c, http).is_some())
                .expect("a port `http`");
            let front_port = named(front, http);
            let null = Value::Null;
            let vllm = cs
                .iter()
                .find(|c| arg(c, "--kv-transfer-config").is_some())
                .unwrap_or(&null);
            let vllm_port = num_arg(vllm, "--port");
            let json = |f| serde_json::from_str::<serde_json::Value>(arg(vllm, f).unwrap_or("0"));
            let connector = json("--kv-transfer-config").unwrap()["kv_connector"].clone();
            let published = json("--kv-events-config").unwrap()["endpoint"].clone();
            let env = |n: &str| {
                seq_of(&vllm["env"])
                    .iter()
                    .find(|e| e["name"] == n)
                    .cloned()
            };
            let side_host = env("VLLM_NIXL_SIDE_CHANNEL_HOST").unwrap_or_default();
            let side_ip = side_host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP";
            let side = env("VLLM_NIXL_SIDE_CHANNEL_PORT").unwrap_or_default()["value"]
                .as_str()
                .map(|v| v.parse::<u64>().unwrap());
            let image = front["image"].as_str().unwrap_or("");
            let target = num_arg(front, "--model-server-port").or(num_arg(front, "--vllm-port"));
            let tls = arg(front, "--secure-proxy").or(arg(front, "--secure-serving"));
            let caching = Value::from("--enable-prefix-caching");
            let selected = role_of(&d["spec"]["selector"]["matchLabels"]) == Some(value.clone());
            let subscribed = events.map(|e| format!("tcp://*:{e}"));
            let at_http = front["name"] == vllm["name"] && vllm_port == front_port;
            let nixl_port = declares(vllm, side) && side != events;
            let forwards = target == vllm_port && declares(vllm, vllm_port);
            let nixlv2 = arg(front, "--kv-connector") == Some("nixlv2");
            let listens = num_arg(front, "--port") == front_port;
            // One line per check; `=>` keeps rustfmt from spreading each over four.
            macro_rules! check {
                ($($ok:expr => $what:literal,)*) => {
                    $(if !$ok { bad.push(format!("{o}: {name}: {}", $what)); })*
                };
            }
            check! {
                role.is_some() => "its role label names no role kv-router accepts",
                // Two role Deployments with one selector would adopt each other's pods.
                selected => "its selector lacks the role",
                connector == "NixlConnector" => "no vLLM with NixlConnector",
                // vLLM's default side-channel host (localhost) is unreachable from other pods.
                side_ip => "NIXL side-channel host is not the pod IP",
                nixl_port => "NIXL side-channel port undeclared, or the KV-events port",
                // Precise mode on every role: prefix caching, KV events where kv-router subscribes.
                seq_of(&vllm["args"]).contains(&caching) => "no prefix caching",
                published.as_str() == subscribed.as_deref() => "KV events not published there",
                declares(vllm, events) => "KV-events port undeclared",
                // Decode: llm-d's sidecar owns `http` and forwards to vLLM's port, in plain HTTP.
                !decode || image.contains("disagg-sidecar") => "no disagg sidecar on `http`",
                !decode || listens => "the sidecar does not listen on `http`",
                !decode || forwards => "the sidecar forwards elsewhere than vLLM's port",
                !decode || nixlv2 => "the sidecar's connector is not nixlv2",
                !decode || tls == Some("false") => "the sidecar serves TLS (its default)",
                // Prefill: vLLM itself on `http`, the ip:port kv-router names in the header.
                decode || at_http => "vLLM not on `http`",
            }
            roles.insert(value);
            blocks.insert(arg(vllm, "--block-size").map(String::from));
            sidecars += usize::from(decode);
        }
        if roles.contains("prefill") {
            let decodes = roles.contains("decode") || roles.contains("both");
            assert!(
                decodes && cfg.kv_events.enabled,
                "{o}: prefill pods need decode pods + KV events"
            );
            assert_eq!(
                blocks.len(),
                1,
                "{o}: --block-size differs between roles: {blocks:?}"
            );
        }
        if sidecars > 0 {
            let header = &cfg.disaggregation.header;
            assert_eq!(
                header, SIDECAR_PREFILL_HEADER,
                "{o}: the sidecar reads another header"
            );
        }
        if o == "vllm-pd" {
            assert_eq!(
                roles,
                BTreeSet::from(["prefill".into(), "decode".into()]),
                "{o}"
            );
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
