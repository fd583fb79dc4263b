//! The documented worst-case memory of kv-router and Envoy (docs/operations.md, "Memory bounds")
//! against what `deploy/` ships, read from the files (no cluster, no kustomize; a second):
//! - every memory limit set for their Deployments (base, components, overlays, kind, inline
//!   kustomize patches) holds the bound plus its stated headroom, and the bound is the sum of
//!   its terms;
//! - each term's input is the shipped value: kv-router's effective config in every overlay
//!   (its ConfigMap layers merged as the pod merges them), the overload manager's heap cap in
//!   every Envoy config (`envoy/*.yaml` and the ones under `deploy/`).
#![cfg(feature = "kubernetes")]

use std::fs;
use std::path::{Path, PathBuf};

use kv_router::config::{Config, KubernetesOverrides};
use kv_testkit::memory_bounds::{documented, parse, quantity, Bound};
use serde::Deserialize;
use serde_yaml::Value;

use crate::common::repo_root;

fn bound(name: &str) -> Bound {
    documented(&repo_root())
        .unwrap_or_else(|e| panic!("docs/operations.md: {e}"))
        .into_iter()
        .find(|b| b.component == name)
        .unwrap_or_else(|| panic!("docs/operations.md documents no [{name}] bound"))
}

fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = fs::read_to_string(path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|v| !v.is_null())
        .collect()
}

/// Every YAML file under `deploy/` but the vendored schemas.
fn deploy_yaml(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() && p.file_name().is_some_and(|n| n != "schemas") {
            deploy_yaml(&p, out);
        } else if p.extension().is_some_and(|e| e == "yaml") {
            out.push(p);
        }
    }
}

/// The memory limit in a container's `resources` (or a part of it a patch replaces).
fn limit_in(v: &Value, path_tail: &str) -> Option<u64> {
    let mem = match path_tail {
        "limits/memory" => v,
        "limits" => &v["memory"],
        "resources" => &v["limits"]["memory"],
        _ => &v["resources"]["limits"]["memory"],
    };
    let q = match mem {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        _ => return None,
    };
    Some(quantity(&q).unwrap_or_else(|| panic!("unreadable memory quantity `{q}`")))
}

/// Limits a Deployment document (or a strategic-merge patch of one) sets for `container`.
fn deployment_limits(doc: &Value, b: &Bound) -> Vec<u64> {
    let named = doc["metadata"]["name"]
        .as_str()
        .is_some_and(|n| b.deployments.iter().any(|d| d == n));
    if doc["kind"] != "Deployment" || !named {
        return Vec::new();
    }
    let containers = doc["spec"]["template"]["spec"]["containers"].as_sequence();
    containers
        .into_iter()
        .flatten()
        .filter(|c| c["name"] == b.container.as_str())
        .filter_map(|c| limit_in(c, ""))
        .collect()
}

/// Limits a kustomization's inline patches set for one of `b`'s Deployments: JSON 6902 ops on a
/// `resources` path (any container: conservative) or strategic-merge documents.
fn patch_limits(kustomization: &Value, b: &Bound) -> Vec<u64> {
    let mut out = Vec::new();
    for p in kustomization["patches"].as_sequence().into_iter().flatten() {
        let Some(text) = p["patch"].as_str() else {
            continue; // `path:` patches are files under deploy/, scanned as documents
        };
        let patch: Value = serde_yaml::from_str(text).expect("inline patch parses");
        if let Some(ops) = patch.as_sequence() {
            let target = p["target"]["name"].as_str();
            if !target.is_some_and(|t| b.deployments.iter().any(|d| d == t)) {
                continue;
            }
            for op in ops {
                let path = op["path"].as_str().unwrap_or_default();
                if let Some(at) = path.find("/resources") {
                    let tail = path[at + 1..].trim_start_matches("resources/");
                    out.extend(limit_in(&op["value"], tail));
                }
            }
        } else {
            out.extend(deployment_limits(&patch, b));
        }
    }
    out
}

/// Every memory limit `deploy/` sets for `b`'s container, with the file it is in.
fn shipped_limits(b: &Bound) -> Vec<(PathBuf, u64)> {
    let mut files = Vec::new();
    deploy_yaml(&repo_root().join("deploy"), &mut files);
    let mut out = Vec::new();
    for f in files {
        for doc in yaml_docs(&f) {
            let found = match doc["kind"].as_str() {
                Some("Kustomization" | "Component") => patch_limits(&doc, b),
                _ => deployment_limits(&doc, b),
            };
            out.extend(found.into_iter().map(|l| (f.clone(), l)));
        }
    }
    out
}

#[test]
fn every_shipped_memory_limit_holds_the_documented_worst_case() {
    for name in ["router", "envoy"] {
        let b = bound(name);
        let limits = shipped_limits(&b);
        assert!(
            !limits.is_empty(),
            "deploy/ sets no memory limit for {:?}",
            b.deployments
        );
        for (file, limit) in limits {
            b.check(limit)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        }
    }
}

/// kv-router's config layers in `overlay`: the base ConfigMap's files, then each component's
/// `kv-router-config` layers, as the pod mounts them.
fn router_layers(overlay: &Path) -> Vec<(String, PathBuf)> {
    let mut layers = Vec::new();
    let mut add = |dir: &Path| {
        let k = &yaml_docs(&dir.join("kustomization.yaml"))[0];
        for g in k["configMapGenerator"].as_sequence().into_iter().flatten() {
            if g["name"] != "kv-router-config" {
                continue;
            }
            for f in g["files"].as_sequence().unwrap() {
                let f = f.as_str().unwrap();
                let (key, file) = f.split_once('=').unwrap_or((f, f));
                layers.push((key.to_string(), dir.join(file)));
            }
        }
    };
    let k = &yaml_docs(&overlay.join("kustomization.yaml"))[0];
    for r in k["resources"].as_sequence().into_iter().flatten() {
        add(&overlay.join(r.as_str().unwrap()));
    }
    for c in k["components"].as_sequence().into_iter().flatten() {
        add(&overlay.join(c.as_str().unwrap()));
    }
    layers
}

/// The shipped value a router term's source names (None: not read from the config).
fn router_input(c: &Config, source: &str) -> Option<f64> {
    match source {
        "server.max_buffered_body_bytes" => Some(c.server.max_buffered_body_bytes as f64),
        "server.max_connections" => Some(c.server.max_connections as f64),
        "server.max_extproc_streams" => Some(c.server.max_extproc_streams as f64),
        "pick_api.max_buffered_bytes" => Some(c.pick_api.max_buffered_bytes as f64),
        "explain budget: body_limit_bytes × 2 + 1 MiB" => {
            Some((c.body_limit_bytes * 2 + (1 << 20)) as f64)
        }
        "measured" => None,
        other => panic!(
            "[router] term source `{other}`: teach {} to read it",
            file!()
        ),
    }
}

#[test]
fn the_router_terms_are_the_values_every_overlay_ships() {
    let b = bound("router");
    let tmp = tempfile::tempdir().unwrap();
    let overlays = repo_root().join("deploy/overlays");
    let mut names: Vec<_> = fs::read_dir(&overlays)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert!(names.len() >= 9, "{names:?}");
    for name in names {
        let dir = tmp.path().join(&name);
        fs::create_dir_all(&dir).unwrap();
        for (key, file) in router_layers(&overlays.join(&name)) {
            fs::copy(&file, dir.join(key)).unwrap();
        }
        let cfg = Config::load_with(&dir, KubernetesOverrides::default())
            .unwrap_or_else(|e| panic!("{name:?}: {e}"));
        for t in &b.terms {
            let Some(want) = router_input(&cfg, &t.source) else {
                continue;
            };
            assert!(
                t.operands.iter().any(|o| (o - want).abs() < 0.5),
                "overlay {name:?} ships {} = {want}, the documented term `{}` counts {:?}",
                t.source,
                t.name,
                t.operands
            );
        }
    }
}

/// Every Envoy bootstrap shipped: the bundled ones and those under `deploy/`.
fn envoy_configs() -> Vec<PathBuf> {
    let root = repo_root();
    let mut out: Vec<PathBuf> = fs::read_dir(root.join("envoy"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    out.push(root.join("deploy/components/standalone-envoy/envoy.yaml"));
    out.push(root.join("deploy/kind/round-robin/envoy.yaml"));
    out.sort();
    out
}

#[test]
fn every_envoy_config_holds_its_heap_to_the_documented_cap() {
    let b = bound("envoy");
    let heap = b
        .terms
        .iter()
        .find(|t| t.source == "overload_manager fixed_heap max_heap_size_bytes")
        .expect("[envoy] has a term for the overload manager's heap cap");
    for path in envoy_configs() {
        let cfg = &yaml_docs(&path)[0];
        let name = path.display();
        let om = &cfg["overload_manager"];
        let monitor = |m: &str| {
            om["resource_monitors"]
                .as_sequence()
                .into_iter()
                .flatten()
                .find(|r| r["name"] == m)
                .map(|r| &r["typed_config"])
        };
        let cap = monitor("envoy.resource_monitors.fixed_heap")
            .and_then(|m| m["max_heap_size_bytes"].as_u64())
            .unwrap_or_else(|| panic!("{name}: no fixed_heap monitor"));
        assert!(
            heap.operands.iter().any(|o| (o - cap as f64).abs() < 0.5),
            "{name}: max_heap_size_bytes {cap}, documented {:?}",
            heap.operands
        );
        assert!(
            monitor("envoy.resource_monitors.global_downstream_max_connections")
                .and_then(|m| m["max_active_downstream_connections"].as_u64())
                .is_some(),
            "{name}: no global downstream connection cap"
        );
        assert!(
            om["buffer_factory_config"]["minimum_account_to_track_power_of_two"]
                .as_u64()
                .is_some(),
            "{name}: streams' buffers are not tracked, so none can be reset for memory"
        );
        for action in [
            "envoy.overload_actions.shrink_heap",
            "envoy.overload_actions.reset_high_memory_stream",
            "envoy.overload_actions.reduce_timeouts",
            "envoy.overload_actions.stop_accepting_requests",
            "envoy.overload_actions.stop_accepting_connections",
        ] {
            let on_heap = om["actions"]
                .as_sequence()
                .into_iter()
                .flatten()
                .filter(|a| a["name"] == action)
                .flat_map(|a| a["triggers"].as_sequence().into_iter().flatten())
                .any(|t| t["name"] == "envoy.resource_monitors.fixed_heap");
            assert!(on_heap, "{name}: no {action} on the heap monitor");
        }
    }
}

/// The figures docs/operations.md gave before ("80 MiB + 2.2 × (256 + 129) MiB ≈ 930 MiB", plus
/// ≈ 150 MiB for the 10,000-connection cap) against the Deployment's 1 GiB: caught.
#[test]
fn the_previously_documented_router_worst_case_fails_against_its_limit() {
    let old = "```memory-bounds\n\
        [router] deployment=kv-router container=kv-router headroom=10%\n\
        base = 80 MiB # measured\n\
        body_budget = 2.2 × 256 MiB # server.max_buffered_body_bytes\n\
        explain_budget = 2.2 × 129 MiB # explain budget: body_limit_bytes × 2 + 1 MiB\n\
        connections = 10,000 × 15 KiB # server.max_connections\n\
        bound = 1074 MiB\n\
        ```\n";
    let b = &parse(old).unwrap()[0];
    let err = b.check(quantity("1Gi").unwrap()).unwrap_err();
    assert!(err.contains("below the documented worst case"), "{err}");
}
