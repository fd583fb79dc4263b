//! `pods.kubernetes` against a stub API server speaking the real list + watch protocol
//! (tests/kube_stub): adds, readiness flips, terminating pods, deletions, relabels, a watch that
//! ends and is resumed from its resourceVersion, 410 Gone forcing a relist, InferencePool mode,
//! and the RBAC the code needs. The last test runs the kv-router binary against the stub with
//! simulated pods and checks that departed pods are forgotten (index entries, metric series).
#![cfg(feature = "kubernetes")]

mod common;
mod kube_stub;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube_stub::{pod, pool, Kind, KubeStub};
use kv_router::config::{KubernetesConfig, PoolRef, PortRef};
use kv_router::pods::kubernetes::{required_rbac, RbacRule};
use kv_router::pods::{KubernetesSource, PodSource};
use kv_router::telemetry::Metrics;
use serde_json::json;

const NS: &str = "llm";

fn selector_cfg(stub: &KubeStub) -> KubernetesConfig {
    KubernetesConfig {
        selector: "app=vllm".into(),
        port: PortRef::Number(8000),
        kubeconfig: Some(stub.kubeconfig(NS)),
        refresh_ms: 50,
        ..Default::default()
    }
}

async fn ids(src: &KubernetesSource) -> Vec<String> {
    let mut v: Vec<String> = src
        .pods()
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.id.to_string())
        .collect();
    v.sort();
    v
}

/// Polls the source until it lists exactly `want` (ip:port), or panics with the last answer.
async fn expect(src: &KubernetesSource, want: &[&str], what: &str) {
    let mut want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    want.sort();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = ids(src).await;
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: source lists {got:?}, expected {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A pod in namespace `llm` serving on the configured port.
fn put(stub: &KubeStub, name: &str, labels: serde_json::Value, ip: Option<&str>, ready: bool) {
    stub.apply(Kind::Pod, pod(NS, name, labels, ip, ready, &[]));
}

fn metrics() -> Arc<Metrics> {
    let mut reg = prometheus_client::registry::Registry::default();
    Arc::new(Metrics::new(&mut reg))
}

/// The (apiGroup, resource, verb) triples the stub saw.
fn calls(stub: &KubeStub) -> BTreeSet<(String, String, String)> {
    stub.requests()
        .iter()
        .map(|r| {
            let (g, res) = r.kind.rbac();
            (g.to_string(), res.to_string(), r.verb.to_string())
        })
        .collect()
}

fn rbac_triples(rules: &[RbacRule]) -> BTreeSet<(String, String, String)> {
    rules
        .iter()
        .flat_map(|r| {
            r.verbs
                .iter()
                .map(|v| (r.api_group.clone(), r.resource.clone(), v.clone()))
        })
        .collect()
}

#[tokio::test]
async fn selector_watch_tracks_adds_readiness_terminations_and_deletes() {
    let stub = KubeStub::start().await;
    let vllm = json!({"app": "vllm"});
    put(&stub, "a", vllm.clone(), Some("10.1.0.1"), true);
    put(&stub, "b", vllm.clone(), Some("10.1.0.2"), false);
    put(&stub, "c", json!({"app": "other"}), Some("10.1.0.3"), true);
    put(&stub, "d", vllm.clone(), None, false); // scheduled, no IP yet
    stub.apply(
        Kind::Pod,
        pod("elsewhere", "e", vllm.clone(), Some("10.1.0.5"), true, &[]),
    );
    let cfg = selector_cfg(&stub);
    let m = metrics();
    let src = KubernetesSource::start(cfg.clone(), vec![], Some(m.clone()))
        .await
        .unwrap();
    expect(
        &src,
        &["10.1.0.1:8000"],
        "initial list: Ready + selected + namespace",
    )
    .await;

    put(&stub, "b", vllm.clone(), Some("10.1.0.2"), true);
    expect(&src, &["10.1.0.1:8000", "10.1.0.2:8000"], "b turned Ready").await;
    put(&stub, "a", vllm.clone(), Some("10.1.0.1"), false);
    expect(&src, &["10.1.0.2:8000"], "a turned NotReady").await;
    put(&stub, "d", vllm.clone(), Some("10.1.0.4"), true);
    expect(
        &src,
        &["10.1.0.2:8000", "10.1.0.4:8000"],
        "d got an IP and is Ready",
    )
    .await;
    let mut terminating = stub.get(Kind::Pod, NS, "b").unwrap();
    terminating["metadata"]["deletionTimestamp"] = json!("2026-11-23T00:00:00Z");
    stub.apply(Kind::Pod, terminating);
    expect(&src, &["10.1.0.4:8000"], "b is terminating").await;
    stub.delete(Kind::Pod, NS, "b");
    put(&stub, "c", vllm.clone(), Some("10.1.0.3"), true);
    expect(
        &src,
        &["10.1.0.3:8000", "10.1.0.4:8000"],
        "c relabelled into the selection",
    )
    .await;
    put(&stub, "c", json!({"app": "other"}), Some("10.1.0.3"), true);
    expect(&src, &["10.1.0.4:8000"], "c relabelled out of it").await;
    stub.bookmark();
    stub.delete(Kind::Pod, NS, "d");
    expect(&src, &[], "d deleted").await;

    // What the code called is exactly what required_rbac (and so the shipped Role) grants.
    assert_eq!(calls(&stub), rbac_triples(&required_rbac(&cfg)));
    for r in stub.requests() {
        assert_eq!(r.namespace, NS, "every call stays in the pods' namespace");
        assert_eq!(r.label_selector.as_deref(), Some("app=vllm"));
    }
    let lists = stub.requests().iter().filter(|r| r.verb == "list").count();
    assert_eq!(
        lists,
        1,
        "no relist without a reason: {:?}",
        stub.requests()
    );
}

#[tokio::test]
async fn ended_watch_resumes_from_its_resource_version() {
    let stub = KubeStub::start().await;
    put(&stub, "a", json!({"app": "vllm"}), Some("10.2.0.1"), true);
    let src = KubernetesSource::start(selector_cfg(&stub), vec![], None)
        .await
        .unwrap();
    expect(&src, &["10.2.0.1:8000"], "initial").await;
    let seen = stub.resource_version();
    // The watch ends (API server timeout / restart); a pod is added while nobody watches.
    stub.end_watches(|s| {
        s.apply(
            Kind::Pod,
            pod(NS, "b", json!({"app": "vllm"}), Some("10.2.0.2"), true, &[]),
        )
    });
    expect(
        &src,
        &["10.2.0.1:8000", "10.2.0.2:8000"],
        "change made in the gap",
    )
    .await;
    let reqs = stub.requests();
    let watches: Vec<_> = reqs.iter().filter(|r| r.verb == "watch").collect();
    assert!(watches.len() >= 2, "the watch was not resumed: {reqs:?}");
    assert_eq!(
        watches[1].resource_version.as_deref(),
        Some(seen.to_string().as_str()),
        "resumed from the last version seen: {reqs:?}"
    );
    assert_eq!(
        reqs.iter().filter(|r| r.verb == "list").count(),
        1,
        "a resumable watch must not relist: {reqs:?}"
    );
}

#[tokio::test]
async fn gone_forces_a_relist_that_drops_what_vanished() {
    let stub = KubeStub::start().await;
    let vllm = json!({"app": "vllm"});
    put(&stub, "a", vllm.clone(), Some("10.3.0.1"), true);
    put(&stub, "b", vllm.clone(), Some("10.3.0.2"), true);
    let m = metrics();
    let src = KubernetesSource::start(selector_cfg(&stub), vec![], Some(m.clone()))
        .await
        .unwrap();
    expect(&src, &["10.3.0.1:8000", "10.3.0.2:8000"], "initial").await;
    // History is compacted while the client is away: its resume gets 410, the deletion of `a`
    // is only visible in a fresh list.
    stub.expire(|s| {
        s.delete(Kind::Pod, NS, "a");
        s.apply(
            Kind::Pod,
            pod(NS, "c", vllm.clone(), Some("10.3.0.3"), true, &[]),
        );
    });
    // While relisting, the last complete view is kept (never an empty set in between).
    assert!(!ids(&src).await.is_empty());
    expect(
        &src,
        &["10.3.0.2:8000", "10.3.0.3:8000"],
        "after 410 and relist",
    )
    .await;
    let reqs = stub.requests();
    assert_eq!(
        reqs.iter().filter(|r| r.verb == "list").count(),
        2,
        "410 Gone must force exactly one relist: {reqs:?}"
    );
    // Still watching after the relist.
    put(&stub, "d", vllm, Some("10.3.0.4"), true);
    expect(
        &src,
        &["10.3.0.2:8000", "10.3.0.3:8000", "10.3.0.4:8000"],
        "watch after relist",
    )
    .await;
}

#[tokio::test]
async fn inference_pool_selector_and_target_ports_are_followed() {
    let stub = KubeStub::start().await;
    stub.apply(
        Kind::Pod,
        pod(
            NS,
            "a",
            json!({"app": "vllm", "tier": "a"}),
            Some("10.4.0.1"),
            true,
            &[],
        ),
    );
    stub.apply(
        Kind::Pod,
        pod(
            NS,
            "b",
            json!({"app": "vllm", "tier": "b"}),
            Some("10.4.0.2"),
            true,
            &[],
        ),
    );
    stub.apply(
        Kind::Pool,
        pool(NS, "other", json!({"app": "vllm"}), &[9999]),
    );
    let mut cfg = selector_cfg(&stub);
    cfg.selector = String::new(); // unused with a pool
    cfg.pool = Some(PoolRef {
        name: "vllm-pool".into(),
        namespace: String::new(),
    });
    let src = KubernetesSource::start(cfg.clone(), vec!["m".into()], None)
        .await
        .unwrap();
    // No such pool yet: nothing to route to.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(ids(&src).await.is_empty());
    stub.apply(
        Kind::Pool,
        pool(NS, "vllm-pool", json!({"app": "vllm"}), &[8000, 8001]),
    );
    expect(
        &src,
        &[
            "10.4.0.1:8000",
            "10.4.0.1:8001",
            "10.4.0.2:8000",
            "10.4.0.2:8001",
        ],
        "every target port of every selected pod",
    )
    .await;
    let specs = src.pods().await.unwrap();
    assert!(specs.iter().all(|p| p.models == vec!["m".to_string()]));
    assert!(specs
        .iter()
        .any(|p| p.labels.get("pod").map(String::as_str) == Some("a")));
    stub.apply(
        Kind::Pool,
        pool(
            NS,
            "vllm-pool",
            json!({"app": "vllm", "tier": "b"}),
            &[8000],
        ),
    );
    expect(&src, &["10.4.0.2:8000"], "pool selector narrowed").await;
    stub.delete(Kind::Pool, NS, "vllm-pool");
    expect(&src, &[], "pool deleted").await;
    stub.apply(
        Kind::Pool,
        pool(NS, "vllm-pool", json!({"app": "vllm"}), &[8000]),
    );
    expect(&src, &["10.4.0.1:8000", "10.4.0.2:8000"], "pool recreated").await;

    assert_eq!(calls(&stub), rbac_triples(&required_rbac(&cfg)));
    for r in stub.requests().iter().filter(|r| r.kind == Kind::Pool) {
        // resourceNames in the Role only authorise requests that name the pool.
        assert_eq!(r.field_selector.as_deref(), Some("metadata.name=vllm-pool"));
    }
}

#[tokio::test]
async fn a_bad_token_is_an_error_and_counted_not_a_crash() {
    let stub = KubeStub::start().await;
    put(&stub, "a", json!({"app": "vllm"}), Some("10.5.0.1"), true);
    let cfg = selector_cfg(&stub);
    let path = cfg.kubeconfig.clone().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace(kube_stub::TOKEN, "wrong")).unwrap();
    let m = metrics();
    let src = KubernetesSource::start(cfg, vec![], Some(m.clone()))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut reg_text = String::new();
    while Instant::now() < deadline {
        let mut reg = prometheus_client::registry::Registry::default();
        reg.register("errors", "", m.errors.clone());
        reg_text.clear();
        prometheus_client::encoding::text::encode(&mut reg_text, &reg).unwrap();
        if reg_text.contains("kind=\"kubernetes_watch\"") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        reg_text.contains("kind=\"kubernetes_watch\""),
        "401 not counted: {reg_text}"
    );
    assert!(ids(&src).await.is_empty());
}

#[tokio::test]
async fn missing_kubeconfig_fails_at_start() {
    let cfg = KubernetesConfig {
        selector: "app=vllm".into(),
        kubeconfig: Some("/nonexistent/kubeconfig".into()),
        ..Default::default()
    };
    let err = KubernetesSource::start(cfg, vec![], None)
        .await
        .err()
        .expect("must fail");
    assert!(err.to_string().contains("/nonexistent/kubeconfig"), "{err}");
}

/// The kv-router binary, discovering simulated pods through the stub by a named container port:
/// a pod that is deleted leaves the candidate set, its index entries are purged and its
/// per-pod metric series dropped; with no pod left the router reports not ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_forgets_pods_that_leave_the_cluster() {
    use kv_router::bench::deploy::{self, RouterProc, SimPod};
    use kv_router::pick_api::proto::{picker_client::PickerClient, PickRequest};

    let stub = KubeStub::start().await;
    let bins = common::bins();
    let args: Vec<String> = common::FAST_SIM.iter().map(|s| s.to_string()).collect();
    let sims: Vec<SimPod> = (0..2)
        .map(|_| SimPod::spawn(&bins.vllm_sim, &args).expect("start vllm-sim"))
        .collect();
    for (i, s) in sims.iter().enumerate() {
        stub.apply(
            Kind::Pod,
            pod(
                NS,
                &format!("vllm-{i}"),
                json!({"app": "vllm"}),
                Some("127.0.0.1"),
                true,
                &[("metrics", 1), ("http", s.addr.port())],
            ),
        );
    }
    let mut cfg = deploy::local_router_config(&[]).unwrap();
    cfg.pods.kubernetes = Some(KubernetesConfig {
        namespace: NS.into(),
        selector: "app=vllm".into(),
        port: PortRef::Name("http".into()),
        kubeconfig: Some(stub.kubeconfig("default")),
        refresh_ms: 50,
        ..Default::default()
    });
    let router = RouterProc::spawn(&bins.kv_router, &cfg)
        .await
        .expect("start kv-router");
    let diag = || format!("\n--- kv-router stderr ---\n{}", router.stderr_tail(40));
    router
        .wait_pods_ready(2, Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("{e:#}{}", diag()));
    let pods = router.debug_pods().await.unwrap();
    let labels: Vec<&str> = pods["pods"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["labels"]["pod"].as_str())
        .collect();
    assert_eq!(labels.len(), 2, "pod names carried as labels: {pods}");

    // One recorded decision puts the chosen pod's blocks into the index.
    let mut client = PickerClient::connect(format!("http://{}", router.grpc))
        .await
        .unwrap();
    let body = serde_json::to_vec(&common::completion(&common::text(7, 2000), 4)).unwrap();
    let picked = client
        .pick(PickRequest {
            path: "/v1/completions".into(),
            body,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .endpoints[0]
        .address
        .clone();
    let entries = |v: &serde_json::Value| v["index"]["stats"]["entries"].as_u64().unwrap_or(0);
    assert!(entries(&router.debug_pods().await.unwrap()) > 0);
    let metrics_text = || async {
        reqwest::get(format!("{}/metrics", router.admin_url()))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let series = format!("kv_router_pod_healthy{{pod=\"{picked}\"}}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !metrics_text().await.contains(&series) {
        assert!(Instant::now() < deadline, "{series} never exported");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The picked pod goes away in the cluster.
    let name = sims
        .iter()
        .position(|s| s.addr.to_string() == picked)
        .map(|i| format!("vllm-{i}"))
        .unwrap();
    stub.delete(Kind::Pod, NS, &name);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = router.debug_pods().await.unwrap();
        let listed: Vec<String> = v["pods"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["address"].as_str().unwrap().to_string())
            .collect();
        let gone = !listed.contains(&picked) && listed.len() == 1;
        if gone && entries(&v) == 0 && !metrics_text().await.contains(&series) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{picked} not forgotten: /debug/pods {v}{}",
            diag()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The remaining pod turns NotReady: no candidate left, and readiness says so.
    let other = if name == "vllm-0" { "vllm-1" } else { "vllm-0" };
    let mut not_ready = stub.get(Kind::Pod, NS, other).unwrap();
    not_ready["status"]["conditions"][1]["status"] = json!("False");
    stub.apply(Kind::Pod, not_ready);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = reqwest::get(format!("{}/readyz", router.admin_url()))
            .await
            .unwrap();
        if r.status() == 503 {
            break;
        }
        assert!(Instant::now() < deadline, "still ready{}", diag());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
