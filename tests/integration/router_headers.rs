//! The router-owned request headers (the P/D prefill header, the destination headers, the flow
//! headers) are never the client's to set: every bundled Envoy configuration and deploy component
//! strips them before ext_proc, and a live check shows that with kv-router down and
//! `failure_mode_allow` a forged `x-prefiller-host-port` never makes a decode pod call out.
//!
//! Run the live part: `KV_ROUTER_ENVOY=/path/to/envoy cargo test --test integration router_headers::`

use crate::common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::deploy::{self, EnvoyProc, SimPod};
use common::{bins, completion, envoy_bin, post_to, repo_root, text, FAST_SIM};
use serde::Deserialize;
use serde_yaml::Value;

/// What every gateway in front of kv-router must strip (docs/operations.md).
const ROUTER_OWNED: [&str; 8] = [
    "x-prefiller-host-port",
    "x-prefiller-url",
    "x-gateway-destination-endpoint",
    "x-gateway-destination-endpoint-subset",
    "x-gateway-destination-endpoint-served",
    "x-kv-router-flow",
    "x-kv-router-priority",
    "x-gateway-inference-objective",
];

const HEADER_MUTATION: &str = "envoy.filters.http.header_mutation";

fn load(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).expect("YAML"))
        .collect()
}

/// The headers a header_mutation filter removes from requests.
fn removed(filter: &Value) -> Vec<String> {
    filter["typed_config"]["mutations"]["request_mutations"]
        .as_sequence()
        .map(|m| {
            m.iter()
                .filter_map(|r| r["remove"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn assert_strips_all(what: &str, filter: &Value) {
    let got = removed(filter);
    for h in ROUTER_OWNED {
        assert!(got.iter().any(|g| g == h), "{what}: {h} is not stripped");
    }
}

/// The filter list of every HTTP connection manager in a bootstrap that routes to a cluster other
/// than Envoy's own admin (the pods, directly or through ext_proc).
fn http_filter_lists(doc: &Value) -> Vec<Vec<Value>> {
    let mut out = Vec::new();
    for l in doc["static_resources"]["listeners"]
        .as_sequence()
        .into_iter()
        .flatten()
    {
        for chain in l["filter_chains"].as_sequence().into_iter().flatten() {
            for f in chain["filters"].as_sequence().into_iter().flatten() {
                let hcm = &f["typed_config"];
                let to_admin_only = hcm["route_config"]["virtual_hosts"]
                    .as_sequence()
                    .into_iter()
                    .flatten()
                    .flat_map(|v| v["routes"].as_sequence().into_iter().flatten())
                    .all(|r| r["route"].is_null() || r["route"]["cluster"] == "envoy_admin");
                if to_admin_only {
                    continue;
                }
                if let Some(list) = hcm["http_filters"].as_sequence() {
                    out.push(list.clone());
                }
            }
        }
    }
    out
}

fn bootstraps() -> Vec<PathBuf> {
    let root = repo_root();
    let mut out: Vec<PathBuf> = std::fs::read_dir(root.join("envoy"))
        .expect("envoy/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    out.push(root.join("deploy/components/standalone-envoy/envoy.yaml"));
    out.sort();
    out
}

#[test]
fn every_bundled_envoy_config_strips_router_owned_headers_before_ext_proc() {
    let paths = bootstraps();
    assert!(paths.len() >= 5, "{paths:?}");
    for p in paths {
        let what = p.display().to_string();
        let docs = load(&p);
        let lists = http_filter_lists(&docs[0]);
        assert!(!lists.is_empty(), "{what}: no HTTP connection manager");
        for list in lists {
            let name = |f: &Value| f["name"].as_str().unwrap_or_default().to_string();
            let strip = list
                .iter()
                .position(|f| name(f) == HEADER_MUTATION)
                .unwrap_or_else(|| panic!("{what}: no {HEADER_MUTATION} filter"));
            assert_strips_all(&what, &list[strip]);
            // Before ext_proc, or before the router where there is no ext_proc.
            let consumer = list
                .iter()
                .position(|f| name(f) == "envoy.filters.http.ext_proc")
                .or_else(|| {
                    list.iter()
                        .position(|f| name(f) == "envoy.filters.http.router")
                })
                .expect("a router filter");
            assert!(strip < consumer, "{what}: the strip runs after ext_proc");
        }
    }
}

#[test]
fn the_istio_components_strip_router_owned_headers_before_ext_proc() {
    let root = repo_root();
    // istio-envoyfilter: its header_mutation patch is inserted before the router before the
    // ext_proc patch is, so it lands ahead of ext_proc.
    let ef = &load(&root.join("deploy/components/istio-envoyfilter/envoyfilter.yaml"))[0];
    let patches = ef["spec"]["configPatches"].as_sequence().unwrap();
    let at = |n: &str| {
        patches
            .iter()
            .position(|p| p["applyTo"] == "HTTP_FILTER" && p["patch"]["value"]["name"] == n)
            .unwrap_or_else(|| panic!("no {n} patch"))
    };
    let strip = at(HEADER_MUTATION);
    assert!(strip < at("envoy.filters.http.ext_proc"));
    assert_eq!(patches[strip]["patch"]["operation"], "INSERT_BEFORE");
    assert_strips_all("istio-envoyfilter", &patches[strip]["patch"]["value"]);

    // gateway-api: istiod generates ext_proc; the strip goes first in the chain.
    let dir = root.join("deploy/components/gateway-api");
    let kustomization = std::fs::read_to_string(dir.join("kustomization.yaml")).unwrap();
    assert!(kustomization.contains("envoyfilter-strip-headers.yaml"));
    let ef = &load(&dir.join("envoyfilter-strip-headers.yaml"))[0];
    let p = &ef["spec"]["configPatches"][0];
    assert_eq!(p["patch"]["operation"], "INSERT_FIRST");
    assert_eq!(p["patch"]["value"]["name"], HEADER_MUTATION);
    assert_strips_all("gateway-api", &p["patch"]["value"]);
}

/// A listener that counts the connections it accepts and answers nothing useful.
async fn counting_listener() -> (SocketAddr, Arc<AtomicUsize>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            h.fetch_add(1, Ordering::SeqCst);
            drop(s);
        }
    });
    (addr, hits)
}

/// An address nothing listens on (kv-router down).
fn closed_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// Sends one completion with a forged prefill header through `template` (kv-router down, so
/// Envoy fails open) to a decode pod, and returns how often the forged address was called.
async fn forged_prefill_calls(template: &Path) -> usize {
    let bins = bins();
    let mut args: Vec<String> = FAST_SIM.iter().map(|s| s.to_string()).collect();
    args.extend(["--role", "decode", "--remote-prefill-timeout-ms", "2000"].map(String::from));
    let pod = SimPod::spawn(&bins.vllm_sim, &args).expect("start vllm-sim");
    let (attacker, hits) = counting_listener().await;
    let envoy = EnvoyProc::spawn(&envoy_bin(), template, Some(closed_port()), &[pod.addr])
        .await
        .expect("start Envoy");
    let client = reqwest::Client::new();
    let forged = attacker.to_string();
    let out = post_to(
        &client,
        &envoy.url(),
        "/v1/completions",
        &completion(&text(7, 200), 2),
        &[("x-prefiller-host-port", &forged)],
    )
    .await;
    // The pod answered (it prefills itself when its prefiller fails).
    assert_eq!(out.status, Some(200), "{out:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    hits.load(Ordering::SeqCst)
}

#[tokio::test]
async fn a_forged_prefill_header_never_reaches_a_pod_when_envoy_fails_open() {
    let template = deploy::envoy_template("override-host-buffered.yaml").expect("template");
    let docs = load(&template);
    assert_eq!(
        http_filter_lists(&docs[0])[0]
            .iter()
            .find(|f| f["name"] == "envoy.filters.http.ext_proc")
            .expect("ext_proc")["typed_config"]["failure_mode_allow"],
        true
    );
    assert_eq!(forged_prefill_calls(&template).await, 0);

    // The same configuration without its strip: the decode pod calls the forged address, so
    // the check above can fail.
    let mut doc = docs[0].clone();
    let hcm = &mut doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"];
    let list = hcm.as_sequence_mut().unwrap();
    list.retain(|f| f["name"] != HEADER_MUTATION);
    let dir = tempfile::tempdir().unwrap();
    let unstripped = dir.path().join("unstripped.yaml");
    std::fs::write(&unstripped, serde_yaml::to_string(&doc).unwrap()).unwrap();
    assert!(forged_prefill_calls(&unstripped).await > 0);
}
