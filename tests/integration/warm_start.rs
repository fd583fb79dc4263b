//! Warm start (`index.warm_start`) through the real Envoy (BUFFERED bootstrap) and real vllm-sim
//! pods: a kv-router restarted on its ports while a peer replica lives starts from the peer's
//! index and keeps sending a known prefix to the pod holding it; restarted cold (its peer
//! unreachable) the same router has forgotten it, which is what makes the warm half mean
//! something.
//!
//! Run: `KV_ROUTER_ENVOY=/path/to/envoy cargo test --release --test integration warm_start::`

use crate::common;
use crate::faults_rig::*;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::deploy::{self, RouterProc};
use common::{bins, completion, explain, matched, metric, post_to, served_by, text};
use serde_json::Value;

/// Router `i`'s decisions so far.
async fn decisions(d: &Rig, i: usize) -> f64 {
    metric(&d.metrics(i).await, "kv_router_decisions_total", &[])
}

/// The pod ranked first by an explain answer.
fn first(v: &Value) -> String {
    v["ranked"][0]["pod"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Sends `prompt` through Envoy until router 0 decides one (right after a restart Envoy may still
/// fail open around it) and returns the pod that served the decided one.
async fn routed_by_router_0(d: &Rig, prompt: &str) -> String {
    let deadline = Instant::now() + POLL;
    loop {
        let before = decisions(d, 0).await;
        let o = post_to(
            &d.client,
            &d.envoys[0].url(),
            "/v1/completions",
            &completion(prompt, 4),
            &[],
        )
        .await;
        let pod = served_by(&o, &d.diag());
        if decisions(d, 0).await > before {
            return pod;
        }
        assert!(
            Instant::now() < deadline,
            "router 0 decided no request in {POLL:?}{}",
            d.diag()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Kills router 0 and starts it again on its ports with `peers` as its warm-start peers.
async fn restart_router_0(d: &mut Rig, peers: Vec<String>) {
    d.routers[0].as_mut().expect("router 0 running").kill();
    d.routers[0] = None;
    d.cfgs[0].index.warm_start.peers = peers;
    d.restart(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_router_keeps_routing_a_known_prefix_to_its_holder_when_warm_only() {
    let mut d = Rig::start(3, 1, &[BUFFERED], |_| {}).await;
    let prompt = text(41, 4000);
    let holder = routed_by_router_0(&d, &prompt).await;
    let probe = completion(&format!("{prompt} And then: {}", text(42, 200)), 4);

    // A second replica, started warm from router 0 (the live peer a rolling update leaves).
    let addrs: Vec<SocketAddr> = d.pods.iter().map(|p| p.addr).collect();
    let mut cfg = deploy::local_router_config(&addrs).expect("router config");
    cfg.gate.hot_abs = 16.0;
    cfg.index.warm_start.peers = vec![d.router(0).admin.to_string()];
    let peer = RouterProc::spawn(&bins().kv_router, &cfg)
        .await
        .expect("start the peer");
    peer.wait_pods_ready(addrs.len(), POLL)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\npeer stderr:\n{}", peer.stderr_tail(30)));
    let v = explain(&d.client, &peer, &probe).await;
    assert!(
        matched(&v, &holder) > 10 && first(&v) == holder,
        "the peer did not take in router 0's index: {v:#}\npeer stderr:\n{}",
        peer.stderr_tail(30)
    );

    // Router 0 restarted warm: it took the peer's index in before serving.
    restart_router_0(&mut d, vec![peer.admin.to_string()]).await;
    let m = d.metrics(0).await;
    assert_eq!(
        metric(&m, "kv_router_warm_starts_total", &[("result", "warm")]),
        1.0,
        "{}",
        d.diag()
    );
    assert!(metric(&m, "kv_router_warm_start_entries_total", &[]) > 10.0);
    let v = explain(&d.client, d.router(0), &probe).await;
    assert!(
        matched(&v, &holder) > 10 && first(&v) == holder,
        "the warm router does not rank the holder first: {v:#}{}",
        d.diag()
    );
    let again = format!("{prompt} A follow-up: {}", text(43, 200));
    assert_eq!(
        routed_by_router_0(&d, &again).await,
        holder,
        "the warm router sent the known prefix elsewhere{}",
        d.diag()
    );

    // Restarted cold (its only peer unreachable): the knowledge is gone, and that is counted.
    let nobody = deploy::free_port().expect("free port");
    restart_router_0(&mut d, vec![format!("127.0.0.1:{nobody}")]).await;
    let m = d.metrics(0).await;
    assert_eq!(
        metric(&m, "kv_router_warm_starts_total", &[("result", "cold")]),
        1.0,
        "{}",
        d.diag()
    );
    let v = explain(&d.client, d.router(0), &probe).await;
    for pod in &addrs {
        assert_eq!(
            matched(&v, &pod.to_string()),
            0,
            "a cold router still knows the prefix: {v:#}"
        );
    }
}

/// A router with `token` as its admin token and `peers` as its warm-start peers, over `pods`.
async fn token_router(pods: &[SocketAddr], token: &str, peers: Vec<String>) -> RouterProc {
    let mut cfg = deploy::local_router_config(pods).expect("router config");
    cfg.admin.token = token.into();
    cfg.index.warm_start.peers = peers;
    RouterProc::spawn(&bins().kv_router, &cfg)
        .await
        .expect("start kv-router")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_is_given_only_to_callers_with_the_admin_token() {
    let b = bins();
    let args: Vec<String> = common::FAST_SIM.iter().map(|s| s.to_string()).collect();
    let pod = deploy::SimPod::spawn(&b.vllm_sim, &args).expect("start vllm-sim");
    let first = token_router(&[pod.addr], "s3cret", vec![]).await;
    let client = common::runner::client();
    let url = format!("{}/debug/index/snapshot", first.admin_url());
    let r = client.get(&url).send().await.expect("snapshot request");
    assert_eq!(r.status(), 401);
    let r = client
        .get(&url)
        .bearer_auth("s3cret")
        .send()
        .await
        .expect("snapshot request");
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.expect("snapshot JSON");
    assert_eq!(v["format"], "kv-router-index-snapshot");
    assert_eq!(v["version"], 1);

    // A replica sharing the token starts warm; one with another token is refused and starts cold.
    let peers = vec![first.admin.to_string()];
    for (token, result) in [("s3cret", "warm"), ("wrong", "cold")] {
        let r = token_router(&[pod.addr], token, peers.clone()).await;
        let m = r.metrics().await.expect("metrics");
        assert_eq!(
            metric(&m, "kv_router_warm_starts_total", &[("result", result)]),
            1.0,
            "token {token}: {}",
            r.stderr_tail(20)
        );
    }
}
