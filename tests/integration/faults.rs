//! Fault runs through the REAL Envoy 1.40, the real kv-router and real vllm-sim processes on
//! 127.0.0.1 (random ports), each under load, bounded in count and time, each asserting what the
//! clients saw.
//!
//! | fault | test |
//! |---|---|
//! | a pod SIGKILLed mid-run | `a_pod_killed_under_load_gets_no_traffic_once_the_health_probe_noticed` |
//! | a pod added mid-run (Kubernetes discovery, stub API server) | `a_pod_added_under_load_gets_traffic_within_one_refresh` |
//! | kv-router SIGKILLed and restarted behind the BUFFERED config | `router_killed_and_restarted_behind_buffered_envoy_fails_no_request` |
//! | both kv-router replicas restarted in turn behind the FULL_DUPLEX config | `rolling_restart_of_two_replicas_behind_full_duplex_envoy_fails_no_request` |
//! | clients aborting uploads mid-body and responses mid-stream | `faults_streams`' `aborted_uploads_and_responses_leave_no_inflight_load_or_buffered_bytes` |
//! | a pod whose `/metrics` hangs | `faults_streams`' `a_pod_whose_metrics_hang_does_not_delay_decisions`, `a_pod_whose_metrics_hang_does_not_slow_the_scrape_of_the_others` |
//!
//! A KV-event publisher restarted with its sequence reset is `e2e_precise`'s
//! `restarted_engine_is_purged_and_relearned`; kv-router down with no restart is `e2e`'s
//! `router_down_fails_open`; Redis killed/restarted/stalled under load is `redis_replicas`'
//! `redis_killed_restarted_and_slowed_never_fails_a_request`; a stream reset after the decision,
//! without Envoy, is `extproc`'s `reset_stream_releases_in_flight_load`.
//!
//! No Envoy: the tests fail (never skip). Every wait polls a condition with a deadline.
//!
//! Run: `KV_ROUTER_ENVOY=/path/to/envoy cargo test --release --test integration faults:: -- --test-threads=1`

use crate::common;
use crate::faults_rig;
#[cfg(feature = "kubernetes")]
use crate::kube_stub;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::deploy::{self, EnvoyProc, RouterProc, SimPod};
use common::{bins, envoy_bin, metric, FAST_SIM};

use faults_rig::*;

// ---------------------------------------------------------------------------------------------
// 1. A pod SIGKILLed mid-run.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_killed_under_load_gets_no_traffic_once_the_health_probe_noticed() {
    let started = Instant::now();
    let mut d = Rig::start(3, 1, &[BUFFERED], |_| {}).await;
    let health = Duration::from_millis(d.cfgs[0].pods.health_interval_ms);
    let unhealthy_after = d.cfgs[0].pods.unhealthy_after;
    let victim = d.pods[0].addr.to_string();
    // ~100 decode steps of 1 ms: requests last long enough for some to be on the pod when it dies.
    let load = Load::start(
        d.envoys[0].url(),
        6,
        1,
        Traffic::Completion { max_tokens: 100 },
    );
    load.wait_ok(
        "the victim to serve under load",
        3,
        started,
        Some(&victim),
        || d.diag(),
    )
    .await;

    // Taken before the signal: requests it breaks may end before kill() has reaped the process.
    let killed_at = Instant::now();
    d.pods[0].kill();
    let admin = d.router(0).admin_url();
    let detected_at = wait_for(
        "the router to mark the killed pod unhealthy",
        POLL,
        || d.diag(),
        || async {
            let v = get_json(&d.client, &format!("{admin}/debug/pods")).await?;
            let dead = v["pods"]
                .as_array()?
                .iter()
                .any(|p| p["address"] == victim.as_str() && p["healthy"] == false);
            dead.then(Instant::now)
        },
    )
    .await;
    let detection = detected_at - killed_at;
    // Consecutive failed probes, one per interval, plus the interval the kill fell into.
    let window = health * (unhealthy_after + 1);
    assert!(
        detection <= window + Duration::from_millis(750),
        "the killed pod was marked unhealthy only after {detection:?} (probe window {window:?}){}",
        d.diag()
    );

    // From here on nothing is routed to it: its decision count stays put while the load goes on.
    let decisions = |m: &str| metric(m, "kv_router_decisions_total", &[("pod", &victim)]);
    load.wait_ok(
        "requests after the detection",
        10,
        detected_at,
        None,
        || d.diag(),
    )
    .await;
    let frozen_at = Instant::now();
    let before = decisions(&d.metrics(0).await);
    load.wait_ok(
        "more requests after the detection",
        40,
        frozen_at,
        None,
        || d.diag(),
    )
    .await;
    let after = decisions(&d.metrics(0).await);
    let recs = load.finish().await;
    assert_eq!(
        before,
        after,
        "kv-router kept routing to {victim} after marking it unhealthy{}",
        d.diag()
    );

    // What the clients saw: failures only among requests already on the pod or routed to it
    // before the probe could tell (started before the detection), and no more of them than
    // requests started in that window.
    let failed: Vec<&Rec> = recs.iter().filter(|r| !r.ok).collect();
    let late: Vec<&&Rec> = failed.iter().filter(|r| r.start >= detected_at).collect();
    assert!(
        late.is_empty(),
        "{} request(s) started after the router knew {victim} was dead failed; first: {:?}\n{}{}",
        late.len(),
        late.first(),
        summary(&recs),
        d.diag()
    );
    let exposed = recs
        .iter()
        .filter(|r| r.end >= killed_at && r.start < detected_at)
        .count();
    assert!(
        failed.len() <= exposed,
        "{} failures but only {exposed} requests were open between the kill and the detection{}",
        failed.len(),
        d.diag()
    );
    for r in &failed {
        assert!(
            r.end >= killed_at,
            "a request that ended before the kill failed: {r:?}{}",
            d.diag()
        );
        assert!(
            matches!(r.status, Some(502..=504)) || r.error.is_some(),
            "a request failed other than with a gateway error: {r:?}"
        );
    }
    let after_detection = recs.iter().filter(|r| r.start >= detected_at).count();
    eprintln!(
        "pod killed: detected after {detection:?} (window {window:?}); {} of {exposed} exposed \
         requests failed; {after_detection} requests after detection, all ok; {}; total {:?}",
        failed.len(),
        summary(&recs),
        started.elapsed()
    );
    assert_within_budget(started);
}

// ---------------------------------------------------------------------------------------------
// 2. A pod added mid-run.

/// Static pods are fixed at start and DNS names resolve to one port per name, so a pod joining
/// on 127.0.0.1 is modelled with Kubernetes discovery against the stub API server: the pod is
/// created in the "cluster" mid-run. Envoy's `vllm_pool` lists it from the start, as EDS or a
/// headless Service would as soon as the pod exists.
#[cfg(feature = "kubernetes")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_added_under_load_gets_traffic_within_one_refresh() {
    use kube_stub::{pod, Kind as K8s, KubeStub};
    use kv_router::config::{KubernetesConfig, PortRef};
    const NS: &str = "llm";

    let started = Instant::now();
    let stub = KubeStub::start().await;
    let envoy = envoy_bin();
    let b = bins();
    let args: Vec<String> = FAST_SIM.iter().map(|s| s.to_string()).collect();
    let sims: Vec<SimPod> = (0..3)
        .map(|_| SimPod::spawn(&b.vllm_sim, &args).expect("start vllm-sim"))
        .collect();
    let k8s_pod = |i: usize| {
        pod(
            NS,
            &format!("vllm-{i}"),
            serde_json::json!({"app": "vllm"}),
            Some("127.0.0.1"),
            true,
            &[("http", sims[i].addr.port())],
        )
    };
    stub.apply(K8s::Pod, k8s_pod(0));
    stub.apply(K8s::Pod, k8s_pod(1));
    let mut cfg = deploy::local_router_config(&[]).unwrap();
    cfg.gate.hot_abs = 16.0;
    cfg.pods.kubernetes = Some(KubernetesConfig {
        namespace: NS.into(),
        selector: "app=vllm".into(),
        port: PortRef::Name("http".into()),
        kubeconfig: Some(stub.kubeconfig(NS)),
        ..Default::default()
    });
    let refresh = Duration::from_millis(cfg.pods.kubernetes.as_ref().unwrap().refresh_ms);
    let health = Duration::from_millis(cfg.pods.health_interval_ms);
    let router = RouterProc::spawn(&b.kv_router, &cfg)
        .await
        .expect("start kv-router");
    let addrs: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let envoy = EnvoyProc::spawn(
        &envoy,
        &deploy::envoy_template(BUFFERED).unwrap(),
        Some(router.grpc),
        &addrs,
    )
    .await
    .unwrap_or_else(|e| panic!("start Envoy: {e:#}"));
    let diag = || {
        format!(
            "\n--- kv-router stderr ---\n{}\n--- envoy stderr ---\n{}",
            router.stderr_tail(30),
            envoy.stderr_tail(20)
        )
    };
    router
        .wait_pods_ready(2, POLL)
        .await
        .unwrap_or_else(|e| panic!("{e:#}{}", diag()));

    let load = Load::start(envoy.url(), 4, 2, Traffic::Completion { max_tokens: 20 });
    load.wait_ok("load on the first two pods", 20, started, None, &diag)
        .await;
    let newcomer = sims[2].addr.to_string();
    assert!(
        load.snapshot()
            .iter()
            .all(|r| r.pod.as_deref() != Some(newcomer.as_str())),
        "the third pod got traffic before it joined"
    );

    stub.apply(K8s::Pod, k8s_pod(2));
    let added_at = Instant::now();
    load.wait_ok("the new pod to serve", 1, added_at, Some(&newcomer), &diag)
        .await;
    let first = load
        .snapshot()
        .iter()
        .filter(|r| r.ok && r.pod.as_deref() == Some(newcomer.as_str()))
        .map(|r| r.end)
        .min()
        .unwrap();
    let joined = first.saturating_duration_since(added_at);
    // One discovery refresh, then the first health probe (a new pod is unhealthy until then).
    let bound = refresh + health + Duration::from_millis(750);
    // It keeps getting its share: a least-loaded pick on fresh prompts.
    load.wait_ok(
        "the new pod to keep serving",
        10,
        added_at,
        Some(&newcomer),
        &diag,
    )
    .await;
    let recs = load.finish().await;
    eprintln!(
        "pod added: first request served {joined:?} after it joined (refresh {refresh:?}, health \
         {health:?}); {}; total {:?}",
        summary(&recs),
        started.elapsed()
    );
    assert_no_failure(&recs, "adding a pod", &diag());
    assert!(
        joined <= bound,
        "the added pod got its first request {joined:?} after it joined (bound {bound:?}){}",
        diag()
    );
    assert_within_budget(started);
}

// ---------------------------------------------------------------------------------------------
// 3. kv-router killed and restarted behind the BUFFERED config.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_killed_and_restarted_behind_buffered_envoy_fails_no_request() {
    let started = Instant::now();
    let mut d = Rig::start(3, 1, &[BUFFERED], |_| {}).await;
    let load = Load::start(
        d.envoys[0].url(),
        4,
        3,
        Traffic::Completion { max_tokens: 20 },
    );
    load.wait_ok("load through kv-router", 20, started, None, || d.diag())
        .await;
    let decided = metric(&d.metrics(0).await, "kv_router_decisions_total", &[]);
    assert!(decided > 0.0, "kv-router decided nothing{}", d.diag());

    // SIGKILL: every open ext_proc stream breaks at once, new ones are refused.
    d.routers[0].as_mut().unwrap().kill();
    d.routers[0] = None;
    let killed_at = Instant::now();
    let stats = |e: &EnvoyProc| {
        let url = format!("http://{}/stats", e.admin);
        let c = d.client.clone();
        async move { get_text(&c, &url).await.unwrap_or_default() }
    };
    let fail_open = "http.llm.ext_proc.failure_mode_allowed";
    let allowed_before = envoy_stat(&stats(&d.envoys[0]).await, fail_open);
    load.wait_ok(
        "requests while kv-router is down",
        20,
        killed_at,
        None,
        || d.diag(),
    )
    .await;
    let allowed = envoy_stat(&stats(&d.envoys[0]).await, fail_open);
    assert!(
        allowed >= allowed_before + 20,
        "Envoy did not fail open while kv-router was down ({fail_open}: {allowed_before} -> {allowed}){}",
        d.diag()
    );

    d.restart(0).await;
    let restarted_at = Instant::now();
    // Envoy finds the new process on the old address by itself.
    let admin = d.router(0).admin_url();
    wait_for(
        "the restarted kv-router to decide again",
        POLL,
        || d.diag(),
        || async {
            let m = get_text(&d.client, &format!("{admin}/metrics")).await?;
            (metric(&m, "kv_router_decisions_total", &[]) >= 10.0).then_some(())
        },
    )
    .await;
    load.wait_ok("requests after the restart", 20, restarted_at, None, || {
        d.diag()
    })
    .await;
    let recs = load.finish().await;
    eprintln!(
        "router killed/restarted (BUFFERED): {} requests failed open; {}; total {:?}",
        allowed - allowed_before,
        summary(&recs),
        started.elapsed()
    );
    assert_no_failure(
        &recs,
        "kv-router killed and restarted behind BUFFERED Envoy",
        &d.diag(),
    );
    assert_within_budget(started);
}

// ---------------------------------------------------------------------------------------------
// 4. kv-router replicas restarted in turn behind the FULL_DUPLEX config.

/// FULL_DUPLEX cannot fail open (see the template's header): a stream Envoy opens to a replica
/// that is draining or gone fails the request with a 500. Zero client errors therefore needs
/// Envoy to stop choosing a replica before it stops accepting streams, which takes both a
/// health check of the `kv_router` cluster in the template and a router that keeps accepting
/// streams for a while after it turned NOT_SERVING on SIGTERM. The failure message shows where
/// the failures fell (draining, down) and Envoy's ext_proc counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_of_two_replicas_behind_full_duplex_envoy_fails_no_request() {
    let started = Instant::now();
    // The template health-checks every 1 s (1 s timeout): 2.5 s of delay covers it.
    let mut d = Rig::start(3, 2, &[FULL_DUPLEX], |c| {
        c.server.shutdown_delay_ms = 2_500;
        c.server.shutdown_grace_ms = 3_000;
    })
    .await;
    let load = Load::start(
        d.envoys[0].url(),
        4,
        4,
        Traffic::StreamedChat { max_tokens: 30 },
    );
    load.wait_ok("load through both replicas", 20, started, None, || d.diag())
        .await;
    // (replica, SIGTERM sent, process gone, restarted and ready)
    let mut phases: Vec<(usize, Instant, Instant, Instant)> = Vec::new();
    for i in 0..2 {
        // A rolling update: SIGTERM, the process drains and exits, a new one starts on the same
        // address, Envoy sends it streams again.
        let sigterm_at = Instant::now();
        d.terminate(i).await;
        let down_at = Instant::now();
        load.wait_ok(
            "requests while one replica is down",
            10,
            down_at,
            None,
            || d.diag(),
        )
        .await;
        d.restart(i).await;
        phases.push((i, sigterm_at, down_at, Instant::now()));
        let admin = d.router(i).admin_url();
        wait_for(
            &format!("restarted replica {i} to decide again"),
            POLL,
            || d.diag(),
            || async {
                let m = get_text(&d.client, &format!("{admin}/metrics")).await?;
                (metric(&m, "kv_router_decisions_total", &[]) >= 5.0).then_some(())
            },
        )
        .await;
    }
    let recs = load.finish().await;
    let stats = get_text(&d.client, &format!("http://{}/stats", d.envoys[0].admin))
        .await
        .unwrap_or_default();
    let ext: Vec<&str> = stats
        .lines()
        .filter(|l| l.starts_with("http.llm.ext_proc.") && !l.ends_with(": 0"))
        .collect();
    // Where the failures fell: while a replica drained (SIGTERM..exit), while it was gone
    // (exit..restarted), or elsewhere.
    let mut report = String::new();
    for (i, term, gone, back) in &phases {
        let in_span = |a: Instant, b: Instant| {
            let all = recs.iter().filter(|r| r.start < b && r.end >= a).count();
            let bad = recs
                .iter()
                .filter(|r| !r.ok && r.start < b && r.end >= a)
                .count();
            (bad, all)
        };
        report.push_str(&format!(
            "\nreplica {i}: draining {:?} -> failed/open {:?}; down {:?} -> failed/open {:?}",
            *gone - *term,
            in_span(*term, *gone),
            *back - *gone,
            in_span(*gone, *back),
        ));
    }
    for (i, term, gone, _) in &phases {
        let mut times: Vec<(i128, i128)> = recs
            .iter()
            .filter(|r| !r.ok && r.end >= *term)
            .map(|r| {
                let ms = |t: Instant| {
                    if t >= *term {
                        (t - *term).as_millis() as i128
                    } else {
                        -((*term - t).as_millis() as i128)
                    }
                };
                (ms(r.start), ms(r.end))
            })
            .filter(|(a, _)| *a < (*gone - *term).as_millis() as i128 + 300)
            .collect();
        times.sort();
        report.push_str(&format!(
            "\nreplica {i}: failures (start, end) in ms after SIGTERM: {times:?}"
        ));
    }
    let outside = recs
        .iter()
        .filter(|r| !r.ok)
        .filter(|r| {
            !phases
                .iter()
                .any(|(_, t, _, b)| r.start < *b && r.end >= *t)
        })
        .count();
    report.push_str(&format!(
        "\nfailures outside those spans: {outside}\nEnvoy ext_proc stats: {ext:?}"
    ));
    eprintln!(
        "rolling restart (FULL_DUPLEX, 2 replicas): {}; total {:?}{report}",
        summary(&recs),
        started.elapsed()
    );
    assert_no_failure(
        &recs,
        "rolling restart of two replicas behind FULL_DUPLEX Envoy",
        &format!("{report}{}", d.diag()),
    );
    assert_within_budget(started);
}
