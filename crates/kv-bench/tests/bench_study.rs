//! `kv-bench study` through real Envoy and vllm-sim pods at a tiny size: two pods, one small
//! shape per section, both modes. The report has a row per (shape, picker), the no-op first;
//! every router row carries its decision time, its time over the no-op, CPU and peak RSS.

use std::process::Command;

use serde_json::Value;

#[test]
fn tiny_study_reports_every_picker_with_its_cost() {
    let envoy = kv_testkit::e2e::envoy_bin();
    let out = tempfile::tempdir().expect("temp dir");
    let json = out.path().join("study.json");
    let args = "study --pods 2 --gpu-blocks 1024 --sim-arg=--prefill-us-per-token=1 \
                --sim-arg=--decode-ms-per-token=1 --sp-groups 2 --sp-prompts-per-group 3 \
                --sp-system-tokens 64 --sp-question-tokens 16 --sp-output-tokens 4 --sp-qps 20 \
                --long-sizes 1000,4000 --long-max-tokens 1000 --long-requests 5 \
                --long-output-tokens 4 --long-qps 20 --short-qps 50 --short-requests 100 \
                --short-output-tokens 4";
    let run = Command::new(env!("CARGO_BIN_EXE_kv-bench"))
        .args(args.split_whitespace())
        .arg("--envoy")
        .arg(&envoy)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run kv-bench");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "kv-bench study failed: {}\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("The machines differ"), "{stdout}");
    let v: Value = serde_json::from_slice(&std::fs::read(&json).expect("json written")).unwrap();
    let rows = v["rows"].as_array().expect("rows");
    let keys: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| (r["shape"].as_str().unwrap(), r["picker"].as_str().unwrap()))
        .collect();
    let mut want = Vec::new();
    // --long-max-tokens leaves the 1k rung alone.
    for shape in ["shared-prefix", "long-input 1k", "short-requests"] {
        for picker in ["noop", "approximate", "precise"] {
            want.push((shape, picker));
        }
    }
    assert_eq!(keys, want);
    for r in rows {
        let what = format!("{} / {}", r["shape"], r["picker"]);
        assert_eq!(r["errors"], 0, "{what}: {r}");
        assert!(r["requests"].as_u64().unwrap() > 0, "{what}");
        for f in [
            "ttft_p50_ms",
            "ttft_p90_ms",
            "ttft_p99_ms",
            "headers_p95_ms",
            "sent_qps",
        ] {
            assert!(r[f].as_f64().is_some_and(|x| x > 0.0), "{what}: {f} in {r}");
        }
        let cpu = (r["cpu_avg_cores"].as_f64(), r["cpu_peak_cores"].as_f64());
        if r["picker"] == "noop" {
            assert!(
                r["decision_p95_ms"].is_null() && r["added_p50_ms"].is_null(),
                "{r}"
            );
            assert!(cpu.0.is_some_and(|c| c >= 0.0), "{what}: {r}");
            continue;
        }
        // The router's own figures, and its time to headers over the no-op's on this shape.
        for f in [
            "decision_p50_ms",
            "decision_p95_ms",
            "peak_rss_mib",
            "rss_start_mib",
        ] {
            assert!(r[f].as_f64().is_some_and(|x| x > 0.0), "{what}: {f} in {r}");
        }
        assert!(
            r["added_p50_ms"].is_f64() && r["added_p95_ms"].is_f64(),
            "{what}: {r}"
        );
        // A run under a second may fall between two 10 ms CPU ticks; the 100 short ones do not.
        let floor = if r["shape"] == "short-requests" {
            0.0
        } else {
            -1.0
        };
        assert!(
            cpu.0.is_some_and(|c| c > floor) && cpu.1 >= cpu.0,
            "{what}: CPU {cpu:?}"
        );
        assert!(
            r["peak_rss_mib"].as_f64() >= r["rss_start_mib"].as_f64(),
            "{r}"
        );
    }
    let goals = v["goals"].as_array().expect("goals");
    assert_eq!(goals.len(), 6, "three goals x two modes: {goals:?}");
    // No 1M or 100k rung ran: those goals say so instead of passing.
    assert_eq!(goals[0]["verdict"], "not-run", "{goals:?}");
    assert_ne!(goals[4]["verdict"], "not-run", "{goals:?}");
}
