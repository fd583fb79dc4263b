//! `deploy/kind/demo.sh` run here against stand-in `docker`, `kind`, `kubectl`, `istioctl`,
//! `curl`, `make`, `cargo` and `kv-bench`: small scripts first on PATH that log their arguments
//! and answer as the real tools would. The tests check the order of the steps and the flags of
//! each path; nothing here creates a cluster (see deploy/README.md, "kind demo", for what needs
//! a real one). `kubectl apply -k` renders with the real kubectl of `.venv` (`make deploy-tools`),
//! so what the demo would apply is checked too.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{repo_root as root, venv_tool as tool};
use serde_yaml::Value;

/// The Istio version demo.sh pins (`ISTIO_VERSION="${ISTIO_VERSION:-X.Y.Z}"`).
fn istio_pin() -> String {
    let text = fs::read_to_string(root().join("deploy/kind/demo.sh")).unwrap();
    let pin = text
        .split("ISTIO_VERSION=\"${ISTIO_VERSION:-")
        .nth(1)
        .and_then(|r| r.split('}').next())
        .expect("demo.sh pins the Istio version as ISTIO_VERSION=\"${ISTIO_VERSION:-X.Y.Z}\"")
        .to_string();
    let parts: Vec<&str> = pin.split('.').collect();
    assert!(
        parts.len() == 3 && parts.iter().all(|p| p.parse::<u32>().is_ok()),
        "the Istio pin {pin:?} is not a full X.Y.Z release"
    );
    pin
}

/// The simulated pods the stand-in kubectl lists: 4 live, then one terminating (left over
/// from an earlier run of a reused cluster), which the demo must leave out.
const SIMS: [(&str, &str); 4] = [
    ("vllm-sim-0", "10.244.1.10"),
    ("vllm-sim-1", "10.244.2.11"),
    ("vllm-sim-2", "10.244.1.12"),
    ("vllm-sim-3", "10.244.2.13"),
];
const LOCAL_PORT: u16 = 18080;

/// Logs one call per line: the tool's name and its arguments, tab-separated, in one write
/// (stand-ins run concurrently).
const LOG: &str = r#"#!/usr/bin/env bash
set -u
line="$(basename "$0")"
for a in "$@"; do line+=$'\t'"$a"; done
printf '%s\n' "$line" >>"$DEMO_LOG"
"#;

const DOCKER: &str = r#"
if [ "${1:-}" = info ]; then exit "${FAKE_DOCKER_INFO_RC:-0}"; fi
exit 0
"#;

const MAKE: &str = r#"
exit "${FAKE_MAKE_RC:-0}"
"#;

const KIND: &str = r#"
if [ "${1:-} ${2:-}" = "get clusters" ]; then
  if [ -n "${FAKE_KIND_CLUSTERS:-}" ]; then printf '%s\n' "$FAKE_KIND_CLUSTERS"; fi
fi
exit 0
"#;

const ISTIOCTL: &str = r#"
if [ "${1:-}" = version ]; then echo "client version: $FAKE_ISTIOCTL_VERSION"; fi
exit 0
"#;

const CARGO: &str = r#"
if [ "${1:-}" = build ]; then
  mkdir -p "$CARGO_TARGET_DIR/release"
  cp "$DEMO_STANDINS/kv-bench" "$CARGO_TARGET_DIR/release/kv-bench"
fi
exit 0
"#;

const KUBECTL: &str = r#"
selector="" kustomization="" verb="" last="${*: -1}"
while [ $# -gt 0 ]; do
  case "$1" in
    --context|-n) shift 2; continue ;;
    -l) selector="$2"; shift 2; continue ;;
    -k) kustomization="$2"; shift 2; continue ;;
  esac
  if [ -z "$verb" ]; then verb="$1"; fi
  shift
done
case "$verb" in
  apply)
    if [ -n "$kustomization" ]; then
      "$REAL_KUBECTL" kustomize "$kustomization" >"$DEMO_OUT/rendered.yaml" || exit 1
    fi ;;
  get)
    case "$selector" in
      app=vllm)
        printf 'vllm-sim-0 10.244.1.10 \nvllm-sim-1 10.244.2.11 \nvllm-sim-old 10.244.1.9 2026-01-01T00:00:00Z\n'
        printf 'vllm-sim-2 10.244.1.12 \nvllm-sim-3 10.244.2.13 \n' ;;
      app.kubernetes.io/name=kv-router)
        printf 'kv-router-7f9c-a 10.244.1.20 \nkv-router-7f9c-b 10.244.2.21 \n' ;;
    esac ;;
  # Listening only after the call is logged: curl fails until then, as against a real one.
  port-forward)
    touch "$DEMO_OUT/port-forward-${last%%:*}"
    exec sleep 60 ;;
esac
exit 0
"#;

const CURL: &str = r#"
out="" url=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift 2; continue ;;
    http*) url="$1" ;;
  esac
  shift
done
port="${url#http://127.0.0.1:}"; port="${port%%/*}"
[ -e "$DEMO_OUT/port-forward-$port" ] || exit 7
case "$url" in
  */metrics) body='vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="512",prefix_caching_hash_algo="sha256",engine="0"} 1.0' ;;
  *) body='{"object":"list","data":[{"id":"sim-model"}]}' ;;
esac
if [ -n "$out" ]; then printf '%s\n' "$body" >"$out"; else printf '%s\n' "$body"; fi
"#;

/// Writes what kv-bench's `--scrape` would have saved around each run: pod i served 10 + i
/// requests in every run; router 0 decided all but 3 of them, router 1 the other 3 (both with
/// counts from earlier runs). With FAKE_MISROUTE, router 1 sent one more to pod 0 than it served.
/// Every pod counted 1,000 prompt tokens in each run, of which 500 hit its prefix cache under
/// round robin and FAKE_KV_HITS (default 800) under kv-router (on top of earlier runs' counts).
const KV_BENCH: &str = r#"
dir="" scrapes="" labels=""
while [ $# -gt 0 ]; do
  case "$1" in
    --scrape-dir) dir="$2"; shift 2; continue ;;
    --scrape) scrapes="$scrapes ${2%%=*}"; shift 2; continue ;;
    --endpoint) labels="$labels ${2%%=*}"; shift 2; continue ;;
  esac
  shift
done
ips="10.244.1.10 10.244.2.11 10.244.1.12 10.244.2.13"
[ -n "$dir" ] || exit 0
mkdir -p "$dir"
for label in $labels; do
  for name in $scrapes; do
    for when in before after; do
      f="$dir/$label.$name.$when.prom"
      : >"$f"
      i=0
      for ip in $ips; do
        n=$((10 + i))
        case "$name:$when" in
          sim-$i:before)
            echo "vllm:request_success_total{model_name=\"sim-model\",engine=\"0\",finished_reason=\"length\"} 7.0" >>"$f"
            echo "vllm:prefix_cache_queries_total{model_name=\"sim-model\",engine=\"0\"} 3000.0" >>"$f"
            echo "vllm:prefix_cache_hits_total{model_name=\"sim-model\",engine=\"0\"} 2900.0" >>"$f" ;;
          sim-$i:after)
            hits=500
            if [ "$label" = kv-router ]; then hits="${FAKE_KV_HITS:-800}"; fi
            echo "vllm:request_success_total{model_name=\"sim-model\",engine=\"0\",finished_reason=\"length\"} $((7 + n)).0" >>"$f"
            echo "vllm:prefix_cache_queries_total{model_name=\"sim-model\",engine=\"0\"} 4000.0" >>"$f"
            echo "vllm:prefix_cache_hits_total{model_name=\"sim-model\",engine=\"0\"} $((2900 + hits)).0" >>"$f" ;;
          router-0:before) echo "kv_router_decisions_total{reason=\"scored\",pod=\"$ip:8000\"} 5" >>"$f" ;;
          router-0:after) echo "kv_router_decisions_total{reason=\"scored\",pod=\"$ip:8000\"} $((5 + n - 3))" >>"$f" ;;
          router-1:before) echo "kv_router_decisions_total{reason=\"spread\",pod=\"$ip:8000\"} 2" >>"$f" ;;
          router-1:after)
            extra=0
            if [ -n "${FAKE_MISROUTE:-}" ] && [ "$i" = 0 ]; then extra=1; fi
            echo "kv_router_decisions_total{reason=\"spread\",pod=\"$ip:8000\"} $((2 + 3 + extra))" >>"$f" ;;
        esac
        i=$((i + 1))
      done
      echo '# EOF' >>"$f"
    done
  done
done
echo "| run | hit ratio | infinite oracle |"
"#;

struct Run {
    ok: bool,
    stderr: String,
    calls: Vec<Vec<String>>,
    rendered: Vec<Value>,
}

impl Run {
    /// Index of the first call of `tool` whose arguments contain every one of `args`
    /// (as consecutive-or-not members).
    fn find(&self, tool: &str, args: &[&str]) -> Option<usize> {
        self.calls
            .iter()
            .position(|c| c[0] == tool && args.iter().all(|a| c[1..].iter().any(|x| x == a)))
    }

    fn must(&self, tool: &str, args: &[&str]) -> usize {
        self.find(tool, args).unwrap_or_else(|| {
            panic!(
                "no `{tool} {}` call; calls:\n{}\nstderr:\n{}",
                args.join(" "),
                self.listing(),
                self.stderr
            )
        })
    }

    fn before(&self, a: (&str, &[&str]), b: (&str, &[&str])) {
        let (i, j) = (self.must(a.0, a.1), self.must(b.0, b.1));
        assert!(
            i < j,
            "`{} {}` must come before `{} {}`; calls:\n{}",
            a.0,
            a.1.join(" "),
            b.0,
            b.1.join(" "),
            self.listing()
        );
    }

    fn listing(&self) -> String {
        self.calls
            .iter()
            .map(|c| c.join(" "))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The one kv-bench call's arguments.
    fn bench(&self) -> &[String] {
        &self.calls[self.must("kv-bench", &["compare"])][1..]
    }

    fn rendered(&self, kind: &str, name: &str) -> Option<&Value> {
        self.rendered.iter().find(|d| {
            d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name)
        })
    }
}

/// Values following each occurrence of `flag` in `args`.
fn values<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
    args.windows(2)
        .filter(|w| w[0] == flag)
        .map(|w| w[1].as_str())
        .collect()
}

fn demo(args: &[&str], env: &[(&str, &str)]) -> Run {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    let standins = tmp.path().join("standins");
    let out = tmp.path().join("out");
    for d in [&bin, &standins, &out] {
        fs::create_dir_all(d).unwrap();
    }
    let write = |dir: &Path, name: &str, body: &str| {
        let p = dir.join(name);
        fs::write(&p, format!("{LOG}{body}")).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
        }
    };
    for (name, body) in [
        ("docker", DOCKER),
        ("make", MAKE),
        ("kind", KIND),
        ("istioctl", ISTIOCTL),
        ("cargo", CARGO),
        ("kubectl", KUBECTL),
        ("curl", CURL),
    ] {
        write(&bin, name, body);
    }
    write(&standins, "kv-bench", KV_BENCH);
    let log = tmp.path().join("calls.log");
    let mut cmd = Command::new(root().join("deploy/kind/demo.sh"));
    cmd.args(args)
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("DEMO_LOG", &log)
        .env("DEMO_OUT", &out)
        .env("DEMO_STANDINS", &standins)
        .env("REAL_KUBECTL", tool("kubectl"))
        .env("CARGO_TARGET_DIR", tmp.path().join("target"))
        .env("LOCAL_PORT", LOCAL_PORT.to_string())
        .env("FAKE_ISTIOCTL_VERSION", istio_pin())
        .env_remove("ISTIO_VERSION")
        .env_remove("KV_BENCH_ARGS");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let res = cmd.output().expect("running deploy/kind/demo.sh");
    let calls = fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .map(|l| l.split('\t').map(str::to_string).collect())
        .collect();
    let rendered = fs::read_to_string(out.join("rendered.yaml"))
        .map(|t| {
            serde_yaml::Deserializer::from_str(&t)
                .map(|d| serde::Deserialize::deserialize(d).unwrap())
                .filter(|v: &Value| !v.is_null())
                .collect()
        })
        .unwrap_or_default();
    Run {
        ok: res.status.success(),
        stderr: String::from_utf8_lossy(&res.stderr).into_owned(),
        calls,
        rendered,
    }
}

fn assert_ok(r: &Run) {
    assert!(
        r.ok,
        "demo.sh failed:\n{}\ncalls:\n{}",
        r.stderr,
        r.listing()
    );
}

const NAME: &str = "kv-router-demo";

/// The stand-ins run concurrently (a background `kubectl port-forward` beside `curl`), so each
/// call's line must reach the log in one write: three `printf`s once interleaved into
/// `kubectlcurl --context …` and failed a CI run.
#[test]
fn concurrent_stand_ins_log_whole_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let (tool, log) = (tmp.path().join("tool"), tmp.path().join("calls.log"));
    fs::write(&tool, format!("{LOG}exit 0\n")).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&tool, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let arg = "x".repeat(200);
    let (rounds, width) = (10, 40);
    for _ in 0..rounds {
        let children: Vec<_> = (0..width)
            .map(|i| {
                Command::new(&tool)
                    .args(["--context", &arg, &i.to_string()])
                    .env("DEMO_LOG", &log)
                    .spawn()
                    .unwrap()
            })
            .collect();
        for mut c in children {
            assert!(c.wait().unwrap().success());
        }
    }
    let text = fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), rounds * width, "{text}");
    for l in lines {
        let f: Vec<&str> = l.split('\t').collect();
        assert!(
            f.len() == 4 && f[0] == "tool" && f[1] == "--context" && f[2] == arg,
            "a torn line: {l:?}"
        );
    }
}

#[test]
fn builds_everything_before_the_cluster_and_deletes_only_the_cluster_it_created() {
    let r = demo(&[], &[]);
    assert_ok(&r);
    assert_eq!(
        r.calls[0][..2],
        ["docker", "info"],
        "the daemon is checked first"
    );
    let create: (&str, &[&str]) = ("kind", &["create", "cluster", "--name", NAME]);
    r.before(("make", &["image", "IMAGE=kv-router:demo"]), create);
    r.before(("docker", &["image", "inspect", "kv-router:demo"]), create);
    r.before(("cargo", &["build", "--release", "-p", "kv-bench"]), create);
    r.before(
        create,
        ("kind", &["load", "docker-image", "kv-router:demo"]),
    );
    let delete = r.must("kind", &["delete", "cluster", "--name", NAME]);
    assert_eq!(delete, r.calls.len() - 1, "the cluster goes last");
    assert!(
        !r.stderr.contains("stays up") && !r.stderr.contains("--context kind-"),
        "no hint may name the cluster just deleted:\n{}",
        r.stderr
    );
}

#[test]
fn round_robin_and_kv_router_run_the_same_workload_with_the_oracle_flags() {
    let r = demo(&[], &[]);
    assert_ok(&r);
    let args = r.bench();
    let rr = format!("round-robin=http://127.0.0.1:{}", LOCAL_PORT + 1);
    let kv = format!("kv-router=http://127.0.0.1:{LOCAL_PORT}");
    assert_eq!(values(args, "--endpoint"), [rr.as_str(), kv.as_str()]);
    assert_eq!(
        values(args, "--pods"),
        ["4"],
        "the terminating pod is not counted"
    );
    assert_eq!(
        values(args, "--gpu-blocks"),
        ["512"],
        "from the pods' /metrics"
    );
    let resets: Vec<String> = (0..4)
        .map(|i| format!("127.0.0.1:{}", LOCAL_PORT + 10 + i))
        .collect();
    assert_eq!(values(args, "--reset-pod"), resets);
    let scrapes = values(args, "--scrape");
    assert_eq!(scrapes.len(), 6, "4 pods + 2 router replicas: {scrapes:?}");
    assert!(!values(args, "--scrape-dir").is_empty());
    // Each pod's counters come through a port-forward to that very pod.
    for (i, (pod, _)) in SIMS.iter().enumerate() {
        r.must("kubectl", &["port-forward", &format!("pod/{pod}")]);
        let want = format!(
            "sim-{i}=http://127.0.0.1:{}/metrics",
            LOCAL_PORT + 10 + i as u16
        );
        assert!(scrapes.contains(&want.as_str()), "{want} in {scrapes:?}");
    }
    r.before(
        ("kubectl", &["port-forward", "service/envoy-round-robin"]),
        ("kv-bench", &["compare"]),
    );
    // The baseline is Envoy without ext_proc over the same Service.
    let cm = r
        .rendered
        .iter()
        .find(|d| {
            d["kind"] == "ConfigMap"
                && d["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("envoy-round-robin-config"))
        })
        .expect("the round-robin Envoy's ConfigMap is applied");
    let envoy = cm["data"]["envoy.yaml"].as_str().unwrap();
    assert!(!envoy.contains("envoy.filters.http.ext_proc") && envoy.contains("ROUND_ROBIN"));
    assert!(envoy.contains("vllm.llm.svc.cluster.local"));
    assert!(r.rendered("Deployment", "envoy-round-robin").is_some());
    // Both kinds of pods run the image just built.
    for d in ["vllm-sim", "kv-router"] {
        let dep = r.rendered("Deployment", d).unwrap();
        assert_eq!(
            dep["spec"]["template"]["spec"]["containers"][0]["image"],
            "kv-router:demo"
        );
    }
    // The routing check ran over the kv-router run: decided = served per pod (10 + i each).
    for (i, (pod, ip)) in SIMS.iter().enumerate() {
        let n = 10 + i;
        let line = r
            .stderr
            .lines()
            .find(|l| l.starts_with(pod) && l.contains(ip))
            .unwrap_or_else(|| panic!("no routing check line for {pod}:\n{}", r.stderr));
        let nums: Vec<&str> = line.split_whitespace().skip(2).collect();
        assert_eq!(nums, [n.to_string(), n.to_string()], "{line}");
    }
    assert!(
        r.stderr.contains("routing check passed: 46 decisions"),
        "{}",
        r.stderr
    );
}

#[test]
fn a_decision_the_gateway_did_not_follow_fails_the_run() {
    let r = demo(&[], &[("FAKE_MISROUTE", "1")]);
    assert!(
        !r.ok,
        "a misrouted request must fail the demo:\n{}",
        r.stderr
    );
    assert!(r.stderr.contains("routing check failed"), "{}", r.stderr);
    let line = r
        .stderr
        .lines()
        .find(|l| l.starts_with("vllm-sim-0"))
        .unwrap();
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(cols[2..4], ["11", "10"], "decided 11, served 10: {line}");
    assert!(line.contains("differs"), "{line}");
    r.must("kind", &["delete", "cluster", "--name", NAME]);
}

#[test]
fn gateway_api_pins_its_versions_and_waits_for_the_gateway_deployment() {
    let pin = istio_pin();
    let tag = format!("tag={pin}");
    let r = demo(&["--path", "gateway-api"], &[]);
    assert_ok(&r);
    r.before(
        ("istioctl", &["version", "--remote=false"]),
        ("make", &["image"]),
    );
    let crds = r.must(
        "kubectl",
        &[
            "--server-side",
            "https://github.com/kubernetes-sigs/gateway-api/releases/download/v1.6.1/standard-install.yaml",
        ],
    );
    let gie = r.must(
        "kubectl",
        &[
            "--server-side",
            "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/v1.6.0/manifests.yaml",
        ],
    );
    let install = r.must(
        "istioctl",
        &[
            "install",
            "profile=minimal",
            &tag,
            "values.pilot.env.PILOT_ENABLE_GATEWAY_API=true",
            "values.pilot.env.ENABLE_GATEWAY_API_INFERENCE_EXTENSION=true",
        ],
    );
    let apply = r.must("kubectl", &["apply", "-k"]);
    assert!(
        crds < install && gie < install && install < apply,
        "{}",
        r.listing()
    );
    // Stock kind has no load balancer: the Gateway asks Istio for a ClusterIP Service.
    let gw = r
        .rendered("Gateway", "llm-gateway")
        .expect("Gateway applied");
    assert_eq!(
        gw["metadata"]["annotations"]["networking.istio.io/service-type"],
        "ClusterIP"
    );
    r.before(
        (
            "kubectl",
            &["rollout", "status", "deployment/llm-gateway-istio"],
        ),
        ("kubectl", &["port-forward", "service/llm-gateway-istio"]),
    );
    r.before(
        (
            "kubectl",
            &["rollout", "status", "deployment/llm-gateway-istio"],
        ),
        ("kubectl", &["wait", "gateway/llm-gateway"]),
    );
    let bench = r.bench();
    assert_eq!(values(bench, "--endpoint").len(), 2);
}

#[test]
fn istio_envoyfilter_installs_the_pinned_istio() {
    let tag = format!("tag={}", istio_pin());
    let r = demo(&["--path", "istio-envoyfilter"], &[]);
    assert_ok(&r);
    r.before(
        ("istioctl", &["version", "--remote=false"]),
        ("make", &["image"]),
    );
    r.before(
        ("istioctl", &["install", "profile=default", &tag]),
        ("kubectl", &["apply", "-k"]),
    );
    r.must(
        "kubectl",
        &["rollout", "status", "deployment/istio-ingressgateway"],
    );
    r.must(
        "kubectl",
        &[
            "port-forward",
            "service/istio-ingressgateway",
            &format!("{LOCAL_PORT}:80"),
        ],
    );
}

#[test]
fn failures_stop_the_demo_before_a_cluster_exists() {
    let no_cluster = |r: &Run, why: &str| {
        assert!(!r.ok, "{why}: demo.sh succeeded");
        for (tool, args) in [("kind", &["create"][..]), ("kubectl", &[][..])] {
            assert!(
                r.find(tool, args).is_none(),
                "{why}: `{tool}` ran:\n{}",
                r.listing()
            );
        }
    };
    // An istioctl that is not the pinned version: nothing built, a message naming both.
    let r = demo(
        &["--path", "gateway-api"],
        &[("FAKE_ISTIOCTL_VERSION", "1.2.3")],
    );
    no_cluster(&r, "istioctl 1.2.3");
    assert!(r.find("make", &[]).is_none() && r.find("cargo", &[]).is_none());
    assert!(
        r.stderr.contains("1.2.3") && r.stderr.contains(&istio_pin()),
        "{}",
        r.stderr
    );
    // The image does not build.
    let r = demo(&[], &[("FAKE_MAKE_RC", "2")]);
    no_cluster(&r, "make image failing");
    assert!(r.find("cargo", &[]).is_none());
    // The Docker daemon is down: nothing but the check ran.
    let r = demo(&[], &[("FAKE_DOCKER_INFO_RC", "1")]);
    no_cluster(&r, "docker info failing");
    assert_eq!(r.calls.len(), 1, "{}", r.listing());
    assert!(r.stderr.contains("daemon"), "{}", r.stderr);
}

#[test]
fn a_reused_cluster_and_a_kept_one_stay_up_and_are_named() {
    let r = demo(&[], &[("FAKE_KIND_CLUSTERS", &format!("other\n{NAME}"))]);
    assert_ok(&r);
    assert!(r.find("kind", &["create"]).is_none(), "{}", r.listing());
    assert!(
        r.find("kind", &["delete"]).is_none(),
        "a reused cluster is kept"
    );
    r.must("kind", &["export", "kubeconfig", "--name", NAME]);
    // The tag did not change, so only a restart runs the image just loaded.
    r.before(
        ("kind", &["load", "docker-image"]),
        ("kubectl", &["rollout", "restart", "deployment/kv-router"]),
    );
    assert!(r
        .stderr
        .contains(&format!("kind delete cluster --name {NAME}")));
    assert!(r.stderr.contains(&format!("--context kind-{NAME}")));

    let r = demo(
        &["--keep", "--name", "mine"],
        &[("FAKE_KIND_CLUSTERS", NAME)],
    );
    assert_ok(&r);
    r.must("kind", &["create", "cluster", "--name", "mine"]);
    assert!(r.find("kind", &["delete"]).is_none(), "--keep keeps it");
    assert!(r.find("kubectl", &["rollout", "restart"]).is_none());
    assert!(r.stderr.contains("kind delete cluster --name mine"));
    assert!(r.stderr.contains("--context kind-mine"));
}

#[test]
fn the_round_robin_baseline_is_a_valid_envoy_config() {
    let envoy = std::env::var_os("KV_ROUTER_ENVOY")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| tool("envoy"));
    let config = root().join("deploy/kind/round-robin/envoy.yaml");
    let out = Command::new(envoy)
        .args(["--mode", "validate", "-c"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The margin demo.sh states (`MIN_HIT_GAIN="${MIN_HIT_GAIN:-N}"`), in percentage points.
fn min_hit_gain() -> u32 {
    let text = fs::read_to_string(root().join("deploy/kind/demo.sh")).unwrap();
    text.split("MIN_HIT_GAIN=\"${MIN_HIT_GAIN:-")
        .nth(1)
        .and_then(|r| r.split('}').next())
        .and_then(|n| n.parse().ok())
        .expect("demo.sh states its margin as MIN_HIT_GAIN=\"${MIN_HIT_GAIN:-N}\"")
}

#[test]
fn kv_router_must_beat_round_robin_by_the_stated_margin() {
    // The stand-in pods: 1,000 prompt tokens each per run, 500 cached under round robin (50 %).
    let gain = min_hit_gain();
    let readme = fs::read_to_string(root().join("deploy/README.md")).unwrap();
    assert!(
        readme.contains(&format!("`MIN_HIT_GAIN`, default {gain}")),
        "deploy/README.md must state the demo's margin ({gain} points) and why"
    );
    let r = demo(&[], &[]);
    assert_ok(&r);
    assert!(
        r.stderr
            .contains("round robin 50.00 %, kv-router 80.00 %, 30.00 points apart")
            && r.stderr.contains("hit ratio check passed"),
        "{}",
        r.stderr
    );
    // Exactly the margin passes; a hundredth of a point less fails, and so does a loss.
    let exactly = 500 + gain * 10; // of 1,000 per pod
    let r = demo(&[], &[("FAKE_KV_HITS", &exactly.to_string())]);
    assert_ok(&r);
    for hits in [(exactly - 1).to_string(), "400".to_string()] {
        let r = demo(&[], &[("FAKE_KV_HITS", &hits)]);
        assert!(
            !r.ok,
            "kv-router {hits}/1000 must fail the demo:\n{}",
            r.stderr
        );
        assert!(r.stderr.contains("hit ratio check failed"), "{}", r.stderr);
        assert!(!r.stderr.contains("routing check passed"), "{}", r.stderr);
        r.must("kind", &["delete", "cluster", "--name", NAME]);
    }
    let r = demo(&[], &[("FAKE_KV_HITS", "400")]);
    assert!(r.stderr.contains("-10.00 points above"), "{}", r.stderr);
    // The margin can be raised (and is checked before anything runs).
    let r = demo(&[], &[("MIN_HIT_GAIN", "31")]);
    assert!(
        !r.ok && r.stderr.contains("short of the 31 points"),
        "{}",
        r.stderr
    );
    let r = demo(&[], &[("MIN_HIT_GAIN", "ten")]);
    assert!(!r.ok && r.calls.is_empty(), "{}", r.listing());
}

/// Any mapping key naming a retry policy, anywhere in an Envoy config.
fn retry_keys(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Mapping(m) => {
            for (k, v) in m {
                if k.as_str().is_some_and(|k| k.contains("retr")) {
                    out.push(format!("{k:?}: {v:?}"));
                }
                retry_keys(v, out);
            }
        }
        Value::Sequence(s) => s.iter().for_each(|v| retry_keys(v, out)),
        _ => {}
    }
}

#[test]
fn gateway_retries_are_off_on_every_demo_route() {
    // A retry is served by a pod kv-router did not pick for it: decided = served needs one
    // attempt per request. Envoy retries only where a route says so; Istio retries twice unless told.
    let r = demo(&[], &[]);
    assert_ok(&r);
    for cm in ["envoy-config", "envoy-round-robin-config"] {
        let d = r
            .rendered
            .iter()
            .find(|d| {
                d["kind"] == "ConfigMap"
                    && d["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.starts_with(&format!("{cm}-")))
            })
            .unwrap_or_else(|| panic!("ConfigMap {cm} applied"));
        let envoy: Value = serde_yaml::from_str(d["data"]["envoy.yaml"].as_str().unwrap()).unwrap();
        let mut found = Vec::new();
        retry_keys(&envoy, &mut found);
        assert!(found.is_empty(), "{cm}: {found:?}");
    }
    for path in ["istio-envoyfilter", "gateway-api"] {
        let r = demo(&["--path", path], &[]);
        assert_ok(&r);
        r.must(
            "istioctl",
            &["install", "meshConfig.defaultHttpRetryPolicy.attempts=0"],
        );
        if path == "istio-envoyfilter" {
            let vs = r
                .rendered("VirtualService", "llm")
                .expect("VirtualService llm");
            let routes = vs["spec"]["http"].as_sequence().unwrap();
            assert!(!routes.is_empty());
            for route in routes {
                assert_eq!(
                    route["retries"]["attempts"].as_u64(),
                    Some(0),
                    "route {:?} may retry",
                    route["name"]
                );
            }
        }
    }
}
