//! `kv-bench overhead --quick` through real Envoy: the report is produced and well-formed (every
//! path in every cell, no errors, positive latencies). Speed is not asserted.

use std::collections::BTreeSet;
use std::process::Command;

use serde_json::Value;

const PATHS: [&str; 5] = [
    "direct",
    "envoy-round-robin",
    "envoy-noop-ext-proc",
    "envoy-kv-router",
    "envoy-kv-router-precise",
];

#[test]
fn quick_overhead_report_is_well_formed() {
    let envoy = kv_testkit::e2e::envoy_bin();
    let out = tempfile::tempdir().expect("temp dir");
    let json = out.path().join("overhead.json");
    let run = Command::new(env!("CARGO_BIN_EXE_kv-bench"))
        .args(["overhead", "--quick", "--envoy"])
        .arg(&envoy)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run kv-bench");
    assert!(
        run.status.success(),
        "kv-bench overhead --quick failed: {}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let md = String::from_utf8_lossy(&run.stdout);
    let r: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(r["quick"], true);
    let cells = r["cells"].as_array().expect("cells");
    let f = |c: &Value, k: &str| c[k].as_f64();
    let sizes: BTreeSet<u64> = cells
        .iter()
        .map(|c| c["prompt_bytes"].as_u64().unwrap())
        .collect();
    let concs: BTreeSet<u64> = cells
        .iter()
        .map(|c| c["concurrency"].as_u64().unwrap())
        .collect();
    assert_eq!(cells.len(), sizes.len() * concs.len() * PATHS.len());
    for &size in &sizes {
        for &conc in &concs {
            let cell: Vec<&Value> = cells
                .iter()
                .filter(|c| c["prompt_bytes"] == size && c["concurrency"] == conc)
                .collect();
            let paths: BTreeSet<&str> = cell.iter().map(|c| c["path"].as_str().unwrap()).collect();
            assert_eq!(
                paths,
                PATHS.into_iter().collect(),
                "{size} B x {conc}: every path"
            );
            for c in cell {
                let path = c["path"].as_str().unwrap();
                let what = format!("{path} {size} B x {conc}: {c}");
                assert_eq!(c["requests"], r["requests_per_cell"], "{what}");
                assert_eq!(
                    (&c["errors"], &c["failed_open"]),
                    (&0.into(), &0.into()),
                    "{what}"
                );
                let (p50, p99, mean) = (f(c, "p50_ms"), f(c, "p99_ms"), f(c, "mean_ms"));
                assert!(p50 > Some(0.0) && p99 >= p50 && mean > Some(0.0), "{what}");
                assert!(
                    f(c, "added_p50_ms").is_some() && f(c, "added_p99_ms").is_some(),
                    "{what}"
                );
                assert_eq!(
                    f(c, "router_cpu_ms_per_request").is_some(),
                    path.starts_with("envoy-kv-router"),
                    "{what}"
                );
                assert_eq!(
                    f(c, "noop_cpu_ms_per_request").is_some(),
                    path == "envoy-noop-ext-proc",
                    "{what}"
                );
                assert_eq!(
                    f(c, "envoy_cpu_ms_per_request").is_some(),
                    path != "direct",
                    "{what}"
                );
            }
        }
    }
    // The goals: both routers against the no-op at every (size, concurrency), each with a floor.
    let goals = r["goals"].as_array().expect("goals");
    let want = sizes.len() * 2 * (concs.len() + concs.iter().filter(|&&c| c > 1).count())
        + 2 * sizes.iter().filter(|&&s| s >= 256 * 1024).count() * concs.len();
    assert_eq!(goals.len(), want, "{goals:?}");
    for g in goals {
        assert!(g["met"].is_boolean() && g["floor"].is_number(), "{g}");
    }
    // The answer-time pass: every processor at every size, straight over ext_proc.
    let answers = r["answers"].as_array().expect("answers");
    assert_eq!(answers.len(), sizes.len() * 3, "{answers:?}");
    for a in answers {
        let p50 = f(a, "p50_us").unwrap_or(0.0);
        assert!(p50 > 0.0 && f(a, "p99_us") >= Some(p50), "{a}");
        assert!(f(a, "over_noop_p50_us").is_some(), "{a}");
        assert_eq!(a["requests"], r["requests_per_cell"], "{a}");
    }
    let rows = md.lines().filter(|l| l.starts_with('|')).count();
    assert_eq!(
        rows,
        cells.len() + 2 + answers.len() + 2 + goals.len() + 2,
        "{md}"
    );
}
