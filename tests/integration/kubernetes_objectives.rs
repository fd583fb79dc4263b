//! InferenceObjectives watched for flow control's priorities, against the stub API server
//! (tests/integration/kube_stub): an object created, changed, moved to another pool and deleted
//! changes the class a request naming it gets, and whether it is shed; the static map covers
//! the rest; the older x-k8s.io group is watched when configured; the calls made are exactly
//! the RBAC the Role is checked against.
#![cfg(feature = "kubernetes")]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::kube_stub::{self, objective, pool, Kind, KubeStub};
use kv_router::config::{FlowConfig, KubernetesConfig, PoolRef, PortRef};
use kv_router::flow::{FlowControl, FlowMetrics, Refusal};
use kv_router::pods::kubernetes::required_rbac;
use kv_router::pods::KubernetesSource;
use prometheus_client::registry::Registry;
use serde_json::json;

const NS: &str = "llm";
const POOL: &str = "vllm-pool";

fn k8s_cfg(stub: &KubeStub) -> KubernetesConfig {
    KubernetesConfig {
        port: PortRef::Number(8000),
        kubeconfig: Some(stub.kubeconfig(NS)),
        refresh_ms: 50,
        pool: Some(PoolRef {
            name: POOL.into(),
            namespace: String::new(),
        }),
        ..Default::default()
    }
}

fn flow_cfg(api: &str) -> FlowConfig {
    FlowConfig {
        enabled: true,
        trust_client_headers: true,
        shed_below: 0,
        // The classes' range: -1 (below shed_below) ..= 10.
        objectives: [("static".to_string(), 10), ("both".to_string(), 7)].into(),
        objective_api: api.into(),
        ..FlowConfig::default()
    }
}

fn flow_control(cfg: FlowConfig) -> (Arc<FlowControl>, Registry) {
    let mut registry = Registry::with_prefix("kv_router");
    let metrics = FlowMetrics::register(&mut registry, &cfg);
    (FlowControl::new(cfg, metrics), registry)
}

fn priority(fc: &FlowControl, objective: &str) -> i32 {
    let h = vec![(
        "x-gateway-inference-objective".to_string(),
        objective.to_string(),
    )];
    fc.classify(&h).priority
}

/// Waits until `objective` classifies as `want`.
async fn expect(fc: &FlowControl, objective: &str, want: i32, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = priority(fc, objective);
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {objective} has priority {got}, expected {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn metric(r: &Registry, prefix: &str) -> Option<String> {
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, r).unwrap();
    s.lines()
        .find(|l| l.starts_with(prefix))
        .map(|l| l.rsplit(' ').next().unwrap().to_string())
}

fn calls(stub: &KubeStub) -> BTreeSet<(String, String, String)> {
    stub.requests()
        .iter()
        .map(|r| {
            let (g, res) = r.kind.rbac();
            (g.to_string(), res.to_string(), r.verb.to_string())
        })
        .collect()
}

#[tokio::test]
async fn objectives_created_changed_and_deleted_set_request_priorities() {
    let stub = KubeStub::start().await;
    stub.apply(Kind::Pool, pool(NS, POOL, json!({"app": "vllm"}), &[8000]));
    // Before the router starts: found by the first list.
    stub.apply(Kind::Objective, objective(NS, "chat", POOL, Some(5)));
    stub.apply(
        Kind::Objective,
        objective(NS, "other-pool", "elsewhere", Some(9)),
    );
    stub.apply(
        Kind::Objective,
        objective("another-ns", "far", POOL, Some(9)),
    );
    let flow = flow_cfg("llm-d.ai/v1alpha2");
    let (fc, registry) = flow_control(flow.clone());
    let cfg = k8s_cfg(&stub);
    let mut src = KubernetesSource::start(cfg.clone(), vec![], None)
        .await
        .unwrap();
    src.watch_objectives(&flow, fc.objectives());

    expect(&fc, "chat", 5, "listed at start").await;
    assert_eq!(priority(&fc, "other-pool"), 0, "another pool's objective");
    assert_eq!(priority(&fc, "far"), 0, "another namespace's objective");
    assert_eq!(
        priority(&fc, "static"),
        10,
        "the static map covers the rest"
    );

    // Created: a sheddable objective; a request naming it is refused at once while saturated.
    stub.apply(Kind::Objective, objective(NS, "batch", POOL, Some(-1)));
    expect(&fc, "batch", -1, "created").await;
    let class = fc.classify(&[(
        "x-gateway-inference-objective".to_string(),
        "batch".to_string(),
    )]);
    assert_eq!(fc.enqueue(class, None, None).err(), Some(Refusal::Shed));

    // The object wins over the static map's entry of the same name.
    stub.apply(Kind::Objective, objective(NS, "both", POOL, Some(2)));
    expect(&fc, "both", 2, "object over static").await;

    // Changed; changed past the classes' range (clamped, counted); unset (0).
    stub.apply(Kind::Objective, objective(NS, "chat", POOL, Some(8)));
    expect(&fc, "chat", 8, "changed").await;
    stub.apply(
        Kind::Objective,
        objective(NS, "chat", POOL, Some(1_000_000)),
    );
    expect(&fc, "chat", 10, "clamped to the highest class").await;
    assert_eq!(
        metric(
            &registry,
            "kv_router_flow_objectives_limited_total{reason=\"clamped\"}"
        )
        .as_deref(),
        Some("1")
    );
    stub.apply(Kind::Objective, objective(NS, "chat", POOL, None));
    expect(&fc, "chat", 0, "no priority: 0").await;
    assert_eq!(
        metric(&registry, "kv_router_flow_objectives_watched").as_deref(),
        Some("3")
    );

    // Moved to another pool: no longer ours. Deleted: back to the static map.
    stub.apply(
        Kind::Objective,
        objective(NS, "batch", "elsewhere", Some(-1)),
    );
    expect(&fc, "batch", 0, "moved to another pool").await;
    stub.delete(Kind::Objective, NS, "both");
    expect(&fc, "both", 7, "deleted: the static map again").await;

    // A relist (410 Gone) forgets what was deleted in the gap.
    stub.apply(Kind::Objective, objective(NS, "chat", POOL, Some(4)));
    expect(&fc, "chat", 4, "changed again").await;
    stub.expire(|s| s.delete(Kind::Objective, NS, "chat"));
    stub.apply(Kind::Objective, objective(NS, "late", POOL, Some(3)));
    expect(&fc, "late", 3, "after the relist").await;
    expect(&fc, "chat", 0, "deleted while expired").await;
    assert_eq!(
        metric(&registry, "kv_router_flow_objectives_watched").as_deref(),
        Some("1")
    );

    // Exactly the calls the Role is checked against; every one in the pool's namespace.
    let want: BTreeSet<_> = required_rbac(&cfg, &flow)
        .iter()
        .flat_map(|r| {
            r.verbs
                .iter()
                .map(|v| (r.api_group.clone(), r.resource.clone(), v.clone()))
        })
        .collect();
    assert_eq!(calls(&stub), want);
    assert!(stub.requests().iter().all(|r| r.namespace == NS));
    drop(src);
}

#[tokio::test]
async fn the_older_group_is_watched_when_configured_and_nothing_when_off() {
    let stub = KubeStub::start().await;
    stub.apply(Kind::Pool, pool(NS, POOL, json!({"app": "vllm"}), &[8000]));
    stub.apply(Kind::Objective, objective(NS, "chat", POOL, Some(9)));
    stub.apply(Kind::LegacyObjective, objective(NS, "chat", POOL, Some(4)));
    let flow = flow_cfg("inference.networking.x-k8s.io/v1alpha2");
    let (fc, _) = flow_control(flow.clone());
    let cfg = k8s_cfg(&stub);
    let mut src = KubernetesSource::start(cfg.clone(), vec![], None)
        .await
        .unwrap();
    src.watch_objectives(&flow, fc.objectives());
    expect(&fc, "chat", 4, "the x-k8s.io object").await;
    stub.apply(Kind::LegacyObjective, objective(NS, "chat", POOL, Some(6)));
    expect(&fc, "chat", 6, "changed").await;
    assert!(stub.requests().iter().all(|r| r.kind != Kind::Objective));
    drop(src);

    // Untrusted headers: no watch, no grant needed.
    let stub = KubeStub::start().await;
    stub.apply(Kind::Pool, pool(NS, POOL, json!({"app": "vllm"}), &[8000]));
    let flow = FlowConfig {
        trust_client_headers: false,
        ..flow_cfg("llm-d.ai/v1alpha2")
    };
    let (fc, _) = flow_control(flow.clone());
    let cfg = k8s_cfg(&stub);
    let mut src = KubernetesSource::start(cfg.clone(), vec![], None)
        .await
        .unwrap();
    src.watch_objectives(&flow, fc.objectives());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !stub.requests().iter().any(|r| r.kind == Kind::Pool) {
        assert!(Instant::now() < deadline, "the pool was never watched");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(stub
        .requests()
        .iter()
        .all(|r| !matches!(r.kind, Kind::Objective | Kind::LegacyObjective)));
    assert!(required_rbac(&cfg, &flow)
        .iter()
        .all(|r| r.resource != kube_stub::Kind::Objective.rbac().1));
}

/// The kv-router binary with flow control on and trusted headers, its pods from an InferencePool
/// on the stub: it watches the pool's objectives (the app's wiring), as its metrics show.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_watches_its_pools_objectives() {
    use crate::common::{
        self,
        deploy::{self, RouterProc, SimPod},
    };

    let stub = KubeStub::start().await;
    let bins = common::bins();
    let args: Vec<String> = common::FAST_SIM.iter().map(|s| s.to_string()).collect();
    let sim = SimPod::spawn(&bins.vllm_sim, &args).expect("start vllm-sim");
    stub.apply(
        Kind::Pool,
        pool(NS, POOL, json!({"app": "vllm"}), &[sim.addr.port()]),
    );
    stub.apply(
        Kind::Pod,
        kube_stub::pod(
            NS,
            "vllm-0",
            json!({"app": "vllm"}),
            Some("127.0.0.1"),
            true,
            &[],
        ),
    );
    stub.apply(Kind::Objective, objective(NS, "chat", POOL, Some(5)));
    stub.apply(
        Kind::Objective,
        objective(NS, "theirs", "elsewhere", Some(5)),
    );
    let mut cfg = deploy::local_router_config(&[]).unwrap();
    cfg.pods.kubernetes = Some(KubernetesConfig {
        namespace: NS.into(),
        kubeconfig: Some(stub.kubeconfig(NS)),
        refresh_ms: 50,
        pool: Some(PoolRef {
            name: POOL.into(),
            namespace: String::new(),
        }),
        ..Default::default()
    });
    cfg.flow_control.enabled = true;
    cfg.flow_control.trust_client_headers = true;
    let router = RouterProc::spawn(&bins.kv_router, &cfg)
        .await
        .expect("start kv-router");
    let watched = || async {
        let text = reqwest::get(format!("{}/metrics", router.admin_url()))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find(|l| l.starts_with("kv_router_flow_objectives_watched "))
            .map(|l| l.rsplit(' ').next().unwrap().to_string())
    };
    let until = |want: &'static str, what: &'static str| {
        let watched = &watched;
        let router = &router;
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let got = watched().await;
                if got.as_deref() == Some(want) {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "{what}: kv_router_flow_objectives_watched is {got:?}, expected {want}\n{}",
                    router.stderr_tail(30)
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    until("1", "the pool's one objective listed").await;
    stub.apply(Kind::Objective, objective(NS, "batch", POOL, Some(-1)));
    until("2", "one created").await;
    stub.delete(Kind::Objective, NS, "chat");
    until("1", "one deleted").await;
    let flow = cfg.flow_control.clone();
    let k = cfg.pods.kubernetes.clone().unwrap();
    let want: BTreeSet<_> = required_rbac(&k, &flow)
        .iter()
        .flat_map(|r| {
            r.verbs
                .iter()
                .map(|v| (r.api_group.clone(), r.resource.clone(), v.clone()))
        })
        .collect();
    assert_eq!(calls(&stub), want);
}
