//! `kv-bench report --quick` end to end: real Envoy, kv-router, Redis and vllm-sim processes,
//! every strategy, the written results.md / results.json / SVG charts. Checks the report is
//! produced and well-formed, not any speed.

use std::process::Command;

use serde_json::Value;

#[test]
fn quick_report_is_produced_and_well_formed() {
    let envoy = kv_testkit::e2e::envoy_bin();
    let out = tempfile::tempdir().expect("temp dir");
    let status = Command::new(env!("CARGO_BIN_EXE_kv-bench"))
        .args(["report", "--quick", "--envoy"])
        .arg(&envoy)
        .arg("--out")
        .arg(out.path())
        .status()
        .expect("run kv-bench");
    assert!(status.success(), "kv-bench report --quick failed: {status}");

    let json: Value =
        serde_json::from_slice(&std::fs::read(out.path().join("results.json")).unwrap()).unwrap();
    let sections = json["sections"].as_array().expect("sections");
    // `kv-bench report` itself checks what it wrote (commands, tables, linked SVGs) and fails
    // otherwise; here: what each section holds.
    let (shared, comparisons): (Vec<&Value>, Vec<&Value>) = sections
        .iter()
        .filter(|s| {
            s["command"]
                .as_str()
                .unwrap()
                .starts_with("kv-bench compare")
        })
        .partition(|s| s["title"].as_str().unwrap().starts_with("Replicas sharing"));
    assert!(
        comparisons.len() >= 3,
        "trace, multiturn and shared-prefix comparisons"
    );
    for s in comparisons {
        let title = s["title"].as_str().unwrap();
        let summaries = s["json"]["summaries"].as_array().unwrap();
        let labels: Vec<&str> = summaries
            .iter()
            .map(|x| x["label"].as_str().unwrap())
            .collect();
        assert_eq!(
            labels,
            [
                "round-robin",
                "random",
                "least-loaded",
                "prefix-only",
                "weighted",
                "predicted-ttft",
                "precise",
                "redis"
            ],
            "{title}"
        );
        for x in summaries {
            assert_eq!(x["errors"], 0, "{title}: {x}");
            assert!(x["requests"].as_u64().unwrap() > 0, "{title}");
            let hit = x["hit_rate"].as_f64().unwrap();
            let inf = x["oracles"]["infinite"]["hit_tokens"].as_f64().unwrap()
                / x["oracles"]["infinite"]["prompt_tokens"].as_f64().unwrap();
            // Concurrent requests may be prefilled in another order than sent: small slack.
            assert!(
                hit <= inf + 0.02,
                "{title}: hit {hit} above the infinite oracle {inf}"
            );
        }
        // Every strategy ran: redis too (a missing Redis/Valkey server fails this test).
        let skipped = s["json"]["skipped"].as_array().unwrap();
        assert!(skipped.is_empty(), "{title}: skipped {skipped:?}");
    }
    let md = std::fs::read_to_string(out.path().join("results.md")).unwrap();
    assert!(md.contains("Machine: "), "names the machine");

    // The capacity ladder: both strategies at both rungs; instant sims meet the SLO at each.
    let capacity: Vec<&Value> = sections
        .iter()
        .filter(|s| {
            s["command"]
                .as_str()
                .unwrap()
                .starts_with("kv-bench capacity")
        })
        .collect();
    let [capacity] = capacity[..] else {
        panic!("one capacity section: {capacity:?}")
    };
    assert_eq!(capacity["json"]["runs"].as_array().unwrap().len(), 4);
    for c in capacity["json"]["capacities"].as_array().unwrap() {
        assert_eq!(c["per_round"][0].as_f64(), Some(8.0), "{c}");
    }
    assert!(capacity["charts"][0]["file"] == "capacity-ttft-vs-qps.svg");

    // The shared index against one router: paired rounds, every replica's lookups answered
    // without falling back, and the goal judged in the section.
    let [shared] = shared[..] else {
        panic!("one shared-index section: {shared:?}")
    };
    let labels: Vec<&str> = shared["json"]["summaries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["label"].as_str().unwrap())
        .collect();
    assert_eq!(
        labels,
        [
            "redis #1",
            "weighted #1",
            "weighted #2",
            "redis #2",
            "redis #3",
            "weighted #3"
        ]
    );
    let falls = shared["json"]["redis_fallbacks"].as_array().unwrap();
    assert_eq!(falls.len(), 3, "{falls:?}");
    assert!(falls.iter().all(|f| f["fallbacks"] == 0), "{falls:?}");
    assert!(
        md.contains("Goal for `redis` against `weighted` over 3 paired rounds"),
        "the verdict line"
    );
    // The rounds join the record under the report's directory, and the goal is judged over it.
    let record = std::fs::read_to_string(out.path().join("paired-rounds/rounds.tsv")).unwrap();
    let rows: Vec<&str> = record.lines().skip(1).collect();
    assert_eq!(rows.len(), 3, "{record}");
    assert!(rows
        .iter()
        .all(|r| r.contains("\tredis\tweighted\t") && r.ends_with("\t0")));
    assert!(
        md.contains("(`") && md.contains("paired-rounds/rounds.tsv`: 3 rounds from 1 invocation,"),
        "the pooled verdict line"
    );
}

/// `kv-bench compare --endpoint … --json` against one pod started here; returns the JSON.
fn compare_endpoint(pod: &kv_testkit::deploy::SimPod, extra: &[String]) -> Value {
    let out = tempfile::tempdir().expect("temp dir");
    let json = out.path().join("cmp.json");
    let status = Command::new(env!("CARGO_BIN_EXE_kv-bench"))
        .args([
            "compare",
            "--workload",
            "multiturn",
            "--sessions",
            "2",
            "--turns",
            "2",
        ])
        .args(["--max-tokens", "4", "--system-bytes", "2000"])
        .arg(format!("--endpoint=direct={}", pod.url()))
        .args(extra)
        .arg("--json")
        .arg(&json)
        .status()
        .expect("run kv-bench");
    assert!(
        status.success(),
        "kv-bench compare --endpoint failed: {status}"
    );
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

#[test]
fn compare_endpoint_describes_the_fleet_it_measured() {
    let bins = kv_testkit::e2e::bins();
    let args: Vec<String> = kv_testkit::e2e::FAST_SIM
        .iter()
        .map(|s| s.to_string())
        .chain(["--num-gpu-blocks".into(), "300".into()])
        .collect();
    let pod = kv_testkit::deploy::SimPod::spawn(&bins.vllm_sim, &args).expect("start vllm-sim");
    // Nothing given: one pod seen in the responses, its size unknown, no oracle claimed.
    let v = compare_endpoint(&pod, &[]);
    assert_eq!(v["pods"], 1, "{v}");
    assert!(v["gpu_blocks"].is_null(), "{v}");
    assert!(v["summaries"][0]["oracles"].is_null(), "{v}");
    let fleet = v["fleet"].as_str().unwrap();
    assert!(fleet.starts_with("1 pods (seen serving"), "{fleet}");
    // With the pod to reset: its KV size is read from its own /metrics.
    let v = compare_endpoint(&pod, &[format!("--reset-pod={}", pod.addr)]);
    assert_eq!(
        (v["pods"].as_u64(), v["gpu_blocks"].as_u64()),
        (Some(1), Some(300)),
        "{v}"
    );
    assert_eq!(v["summaries"][0]["oracles"]["pooled_blocks"], 300, "{v}");
}

#[test]
fn router_metrics_keeps_each_routers_metrics_and_its_decision_log() {
    let envoy = kv_testkit::e2e::envoy_bin();
    let dir = tempfile::tempdir().expect("temp dir");
    let status = Command::new(env!("CARGO_BIN_EXE_kv-bench"))
        .args("compare --workload multiturn --sessions 2 --turns 2".split(' '))
        .args("--max-tokens 4 --system-bytes 2000".split(' '))
        .args("--pods 2 --gpu-blocks 300 --strategies weighted".split(' '))
        .arg("--envoy")
        .arg(&envoy)
        .arg("--router-metrics")
        .arg(dir.path())
        .env("RUST_LOG", "kv_router=debug")
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run kv-bench");
    assert!(status.success(), "kv-bench compare failed: {status}");
    let prom = std::fs::read_to_string(dir.path().join("weighted-0.prom")).expect("metrics");
    assert!(prom.contains("kv_router_decisions_total"), "{prom}");
    let log = std::fs::read_to_string(dir.path().join("weighted-0.log")).expect("log");
    // Two sessions of two turns: four decisions, each with its line.
    let lines = log.lines().filter(|l| l.contains(" decision ")).count();
    assert_eq!(lines, 4, "{log}");
}
