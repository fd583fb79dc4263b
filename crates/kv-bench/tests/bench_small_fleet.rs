//! `kv-bench small-fleet --quick` through real Envoy and slow vllm-sim pods: two chat sessions
//! sharing a long system prompt on two pods. The report is well-formed; kv-router's default
//! policy, approximate and precise, does not pile both conversations onto the first pod that saw
//! the system prompt (it did before new conversations were told from continuations: the busiest
//! pod served every request); precise mode keeps at least the approximate mode's hits.

use std::process::Command;

use serde_json::Value;

#[test]
fn two_sessions_on_two_pods_do_not_pile_onto_one() {
    let envoy = kv_testkit::e2e::envoy_bin();
    let out = tempfile::tempdir().expect("temp dir");
    let json = out.path().join("small-fleet.json");
    let run = Command::new(env!("CARGO_BIN_EXE_kv-bench"))
        .args(["small-fleet", "--quick", "--envoy"])
        .arg(&envoy)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run kv-bench");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "kv-bench small-fleet --quick failed: {}\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let r: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let cells = r["cells"].as_array().expect("cells");
    assert_eq!(cells.len(), 1, "{r}");
    assert_eq!(
        (&cells[0]["pods"], &cells[0]["sessions"]),
        (&2.into(), &2.into())
    );
    let rows = cells[0]["rows"].as_array().expect("rows");
    let labels: Vec<&str> = rows.iter().map(|r| r["label"].as_str().unwrap()).collect();
    assert_eq!(labels, ["round-robin", "weighted", "precise"], "{r}");
    for row in rows {
        assert_eq!(row["errors"], 0, "{row}");
        let hit = row["hit_vs_infinite"].as_f64().expect("hit / infinite");
        assert!(hit > 0.0 && hit <= 1.0 + 1e-9, "{row}");
        assert!(row["ttft_p50_ms"].as_f64() > Some(0.0), "{row}");
    }
    assert!(rows[0]["goals"].is_null(), "round robin is the reference");
    for router in &rows[1..] {
        for goal in ["hit", "p50", "p99", "balance"] {
            assert!(router["goals"][goal].is_boolean(), "{router}");
        }
        assert_eq!(
            router["max_pod_share"].as_f64(),
            Some(0.5),
            "each conversation on its own pod: {router}\n{stdout}"
        );
    }
    let weighted = &rows[1];
    let precise = rows[2]["hit_vs_infinite"].as_f64().unwrap();
    let (w, rr) = (
        weighted["hit_vs_infinite"].as_f64().unwrap(),
        rows[0]["hit_vs_infinite"].as_f64().unwrap(),
    );
    assert!(
        w >= rr - 0.02,
        "affinity keeps at least round robin's hits: {r}"
    );
    assert!(
        precise >= w - 0.02,
        "precise keeps the approximate mode's hits: {r}"
    );
}

/// The sessionless shape on slow vllm-sim pods (`small-fleet --quick --sessionless`): two pods, two
/// clients in a closed loop, six conversations of four turns that name no session and open with
/// one long system prompt, then each its own shorter document. Before, kv-router sent all 24
/// requests to the system prompt's first holder; now the second pod takes conversations too.
#[test]
fn sessionless_conversations_on_a_long_system_prompt_use_both_pods() {
    let envoy = kv_testkit::e2e::envoy_bin();
    let out = tempfile::tempdir().expect("temp dir");
    let json = out.path().join("small-fleet.json");
    let run = Command::new(env!("CARGO_BIN_EXE_kv-bench"))
        .args(["small-fleet", "--quick", "--sessionless", "--envoy"])
        .arg(&envoy)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run kv-bench");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "kv-bench small-fleet --quick --sessionless failed: {}\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let r: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert!(
        r["workload"].as_str().unwrap().contains("no session id"),
        "{r}"
    );
    let cell = &r["cells"][0];
    assert_eq!((&cell["pods"], &cell["sessions"]), (&2.into(), &6.into()));
    let rows = cell["rows"].as_array().expect("rows");
    let labels: Vec<&str> = rows.iter().map(|r| r["label"].as_str().unwrap()).collect();
    assert_eq!(labels, ["round-robin", "weighted"], "{r}");
    for row in rows {
        assert_eq!(row["errors"], 0, "{row}");
    }
    let weighted = &rows[1];
    let share = weighted["max_pod_share"].as_f64().unwrap();
    assert!(
        share <= 2.0 / 3.0 + 1e-9,
        "no pod above 2/3 of the requests (was 1.0: every request on one pod): {weighted}\n{stdout}"
    );
    let (w, rr) = (
        weighted["hit_ratio"].as_f64().unwrap(),
        rows[0]["hit_ratio"].as_f64().unwrap(),
    );
    // Round robin alternates with the two clients and may land every conversation where
    // affinity would (0.8684 vs 0.8682 in one run: the same placement, a block's rounding).
    assert!(
        w >= rr - 0.01,
        "affinity keeps at least round robin's hits: {r}"
    );
}
