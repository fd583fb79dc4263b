//! Metrics used by alerts and dashboards: every metric and label the PrometheusRule and the
//! dashboards query is one a running kv-router (Redis backend) or the standalone Envoy's stats
//! port exports, and Istio's stats snippets keep Envoy's ext_proc stats.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_yaml::Value;

use super::{free_port, root, seq, tool, Proc};

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
    // The rule covers what an operator needs (docs/operations.md).
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
