//! Tests of the strategy comparison: run order, labels, options and scrapes.

use super::*;

#[test]
fn catch_up_counts_pods_with_a_complete_replay_and_events_applied() {
    let text = "kv_router_kv_event_replays_total{pod=\"a:1\",type=\"complete\"} 1\n\
                kv_router_kv_event_replays_total{pod=\"a:1\",type=\"failed\"} 0\n\
                kv_router_kv_event_replays_total{pod=\"b:1\",type=\"failed\"} 1\n\
                kv_router_kv_event_replays_total{pod=\"c:1\",type=\"complete\"} 0\n\
                kv_router_kv_events_applied_total{pod=\"a:1\",type=\"BlockStored\"} 40\n\
                kv_router_kv_events_applied_total{pod=\"b:1\",type=\"BlockRemoved\"} 2\n";
    // b's catch-up failed (cut short): what it did not replay would come back as a gap
    // replay under the run's own traffic, so b is not caught up.
    assert_eq!(catch_up_state(text), (1, 42.0));
}

#[test]
fn a_finished_run_keeps_its_oracles_and_records_but_not_its_bodies() {
    let body = serde_json::json!({"model": "m", "prompt": "a prompt long enough ".repeat(50)});
    let run = RunResult {
        label: "w".into(),
        workload: "t".into(),
        description: String::new(),
        target: String::new(),
        duration_s: 1.0,
        records: Vec::new(),
        sent: vec![("/v1/completions", body.clone()), ("/v1/completions", body)],
    };
    let done = StrategyRun::finished("w".into(), run, Some((2, 100)));
    let oracles = done.summary.as_ref().and_then(|s| s.oracles.as_ref());
    assert!(oracles.is_some(), "the oracles replayed the bodies");
    assert!(done.run.as_ref().is_some_and(|r| r.sent.is_empty()));
}

#[test]
fn scrape_files_are_named_after_run_and_target() {
    let dir = std::path::Path::new("/s");
    assert_eq!(
        Scrapes::path(
            dir,
            "kv-router (gateway-api)",
            "router-kv-router-7f9c",
            "before"
        ),
        dir.join("kv-router__gateway-api_.router-kv-router-7f9c.before.prom")
    );
    assert_eq!(
        Scrapes::path(dir, "round-robin", "sim-10.244.1.5", "after"),
        dir.join("round-robin.sim-10.244.1.5.after.prom")
    );
}

#[tokio::test]
async fn scrapes_are_saved_and_a_failing_one_fails() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).await.unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]).to_string();
            let reply = if req.starts_with("GET /metrics ") {
                "HTTP/1.1 200 OK\r\ncontent-length: 6\r\nconnection: close\r\n\r\nx 1.0\n"
            } else {
                "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            };
            let _ = s.write_all(reply.as_bytes()).await;
        }
    });
    let tmp = tempfile::tempdir().unwrap();
    let ok = Scrapes {
        targets: vec![("pod a".into(), format!("http://{addr}/metrics"))],
        dir: Some(tmp.path().join("scrapes")),
    };
    ok.save("rr", "before").await.unwrap();
    let written = Scrapes::path(&tmp.path().join("scrapes"), "rr", "pod a", "before");
    assert_eq!(std::fs::read_to_string(written).unwrap(), "x 1.0\n");
    let bad = Scrapes {
        targets: vec![("gone".into(), format!("http://{addr}/nothing"))],
        ..ok
    };
    let err = format!("{:#}", bad.save("rr", "after").await.unwrap_err());
    assert!(
        err.contains("--scrape gone") && err.contains("404"),
        "{err}"
    );
}

#[test]
fn repeated_rounds_rotate_the_order() {
    assert_eq!(run_order(2, 1), [(0, 0), (0, 1)]);
    assert_eq!(
        run_order(3, 3),
        [
            (0, 0),
            (0, 1),
            (0, 2),
            (1, 1),
            (1, 2),
            (1, 0),
            (2, 2),
            (2, 0),
            (2, 1)
        ]
    );
    assert!(run_order(0, 2).is_empty());
}

fn opts(replicas: Option<usize>) -> CompareOptions {
    CompareOptions {
        envoy: None,
        pods: 4,
        gpu_blocks: 64,
        sim_args: Vec::new(),
        slow_pods: (0, 1.0),
        strategies: Strategy::ALL.to_vec(),
        request_timeout: Duration::from_secs(1),
        model: "m".into(),
        progress: false,
        replicas,
        redis_replicas: None,
        router_metrics: None,
        repeat: 1,
        pd_prefill: 0,
    }
}

#[test]
fn slow_pods_prefill_slower_whatever_the_base_cost() {
    let a = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let base = a(&["--decode-ms-per-token=2", "--prefill-us-per-token=20"]);
    assert_eq!(pod_sim_args(&base, 1, (1, 4.0)), base, "pod 1 is not slow");
    assert_eq!(
        pod_sim_args(&base, 0, (1, 4.0)),
        a(&["--decode-ms-per-token=2", "--prefill-us-per-token=80"])
    );
    assert_eq!(
        pod_sim_args(&a(&["--prefill-us-per-token", "50"]), 0, (2, 2.0)),
        a(&["--prefill-us-per-token=100"])
    );
    assert_eq!(
        pod_sim_args(&[], 0, (1, 3.0)),
        a(&["--prefill-us-per-token=300"]),
        "vllm-sim's default cost"
    );
}

#[test]
fn replicas_and_labels() {
    let d = opts(None);
    assert_eq!(d.replicas(Strategy::Redis), 2);
    assert_eq!(d.replicas(Strategy::Weighted), 1);
    assert_eq!(d.replicas(Strategy::RoundRobin), 0);
    assert_eq!(d.label(Strategy::Redis), "redis");
    assert_eq!(d.label(Strategy::Weighted), "weighted");
    let two = opts(Some(2));
    assert_eq!(two.label(Strategy::Weighted), "weighted x2");
    assert_eq!(two.label(Strategy::Redis), "redis");
    assert_eq!(two.label(Strategy::RoundRobin), "round-robin");
    let four = opts(Some(4));
    assert_eq!(four.replicas(Strategy::Redis), 4);
    assert_eq!(four.label(Strategy::Redis), "redis x4");
    assert_eq!(opts(Some(0)).replicas(Strategy::Precise), 1);
    // --redis-replicas: the shared-index strategies alone, whatever --replicas says.
    let shared = CompareOptions {
        redis_replicas: Some(4),
        ..opts(None)
    };
    assert_eq!(shared.label(Strategy::Redis), "redis x4");
    assert_eq!(shared.replicas(Strategy::RedisOwnLoad), 4);
    assert_eq!(shared.label(Strategy::Weighted), "weighted");
    assert_eq!(shared.replicas(Strategy::RoundRobin), 0);
    let both = CompareOptions {
        redis_replicas: Some(1),
        ..opts(Some(2))
    };
    assert_eq!(
        (
            both.replicas(Strategy::Redis),
            both.replicas(Strategy::Weighted)
        ),
        (1, 2)
    );
}

#[test]
fn the_report_names_each_replicas_shared_index_counters_by_run() {
    let run = |label: &str, counters: &[&str]| StrategyRun {
        label: label.into(),
        summary: None,
        run: None,
        skipped: None,
        pod_work: None,
        replica_counters: counters.iter().map(|c| c.to_string()).collect(),
        redis_fallbacks: None,
    };
    let cmp = Comparison {
        workload: "w".into(),
        description: "d".into(),
        pods: None,
        gpu_blocks: None,
        fleet: "f".into(),
        runs: vec![
            run("weighted #1", &[]),
            run(
                "redis #1",
                &[
                    "replica 0: lookups_total{source=\"mirror\"} 300",
                    "replica 1: lookups_total{source=\"mirror\"} 299",
                ],
            ),
        ],
        pd_prefill: 0,
    };
    assert_eq!(
        cmp.counters_note(),
        "- `redis #1` replica 0: lookups_total{source=\"mirror\"} 300\n\
         - `redis #1` replica 1: lookups_total{source=\"mirror\"} 299\n"
    );
}
