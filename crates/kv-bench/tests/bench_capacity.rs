//! `kv-bench capacity` through real Envoy and vllm-sim pods on a tiny ladder: two pods, two
//! rungs of two seconds. The report holds every strategy at every rung, each capacity is the SLO
//! rule applied to the TTFTs it reports, and pods made slower (every first token 600 ms later)
//! lower the capacity of the same strategy from the top rung to none.

use std::collections::BTreeSet;
use std::process::Command;

use serde_json::Value;

const SLO_MS: f64 = 300.0;

/// Runs the tiny ladder with these strategies and extra flags; the JSON report.
fn ladder(strategies: &str, extra: &[&str]) -> Value {
    let envoy = kv_testkit::e2e::envoy_bin();
    let out = tempfile::tempdir().expect("temp dir");
    let json = out.path().join("capacity.json");
    let svg = out.path().join("capacity.svg");
    let slo = SLO_MS.to_string();
    let mut args = vec![
        "capacity",
        "--pods",
        "2",
        "--gpu-blocks",
        "512",
        "--qps",
        "4,8",
        "--rung-s",
        "2",
        "--warmup-s",
        "0.5",
        "--groups",
        "10",
        "--prefix-tokens",
        "64",
        "--question-tokens",
        "16",
        "--output-tokens",
        "4",
        "--slo-ms",
        &slo,
        "--sim-arg=--decode-ms-per-token=1",
        "--strategies",
        strategies,
    ];
    args.extend_from_slice(extra);
    let run = Command::new(env!("CARGO_BIN_EXE_kv-bench"))
        .args(&args)
        .arg("--envoy")
        .arg(&envoy)
        .arg("--json")
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        .output()
        .expect("run kv-bench");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "kv-bench capacity failed: {}\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("capacity (QPS)"), "{stdout}");
    let chart = std::fs::read_to_string(&svg).expect("chart written");
    assert!(chart.starts_with("<svg") && chart.contains("SLO 300 ms"));
    serde_json::from_slice(&std::fs::read(&json).expect("json written")).expect("json")
}

/// The rule, restated: the highest rung such that it and every lower one met the SLO.
fn rule(rungs: &[(f64, Option<f64>)]) -> Option<f64> {
    let mut best = None;
    for &(qps, ttft) in rungs {
        match ttft {
            Some(t) if t <= SLO_MS => best = Some(qps),
            _ => break,
        }
    }
    best
}

/// Each strategy's capacity in the report, after checking it against the rule on the runs.
fn capacities(r: &Value, strategies: &[&str]) -> Vec<Option<f64>> {
    let runs = r["runs"].as_array().expect("runs");
    let seen: BTreeSet<(String, String)> = runs
        .iter()
        .map(|x| (x["strategy"].to_string(), x["qps"].to_string()))
        .collect();
    assert_eq!(runs.len(), strategies.len() * 2, "{r}");
    assert_eq!(seen.len(), runs.len(), "one run per strategy and rung: {r}");
    for x in runs {
        // 4 and 8 QPS for 2 s.
        let want = x["qps"].as_f64().unwrap() * 2.0;
        assert_eq!(x["measured"].as_f64(), Some(want), "{x}");
        assert_eq!(x["errors"], 0, "{x}");
        assert!(x["hit_ratio"].as_f64().unwrap() >= 0.0, "{x}");
    }
    let caps = r["capacities"].as_array().expect("capacities");
    assert_eq!(caps.len(), strategies.len());
    caps.iter()
        .zip(strategies)
        .map(|(c, name)| {
            assert_eq!(c["strategy"], *name);
            let mut rungs: Vec<(f64, Option<f64>)> = runs
                .iter()
                .filter(|x| x["strategy"] == *name)
                .map(|x| (x["qps"].as_f64().unwrap(), x["ttft_ms"].as_f64()))
                .collect();
            rungs.sort_by(|a, b| a.0.total_cmp(&b.0));
            assert_eq!(rungs.len(), 2, "{name} at both rungs");
            let want = rule(&rungs);
            let got = c["per_round"][0].as_f64();
            assert_eq!(got, want, "{name}: {rungs:?}");
            assert_eq!(c["spread"]["median"].as_f64(), want);
            got
        })
        .collect()
}

#[test]
fn a_tiny_ladder_rates_each_strategy_and_slower_pods_carry_less() {
    let fast = ladder("round-robin,weighted", &[]);
    let caps = capacities(&fast, &["round-robin", "weighted"]);
    // 80-token prompts prefill in ~8 ms: both rungs far inside 300 ms.
    assert_eq!(caps, [Some(8.0), Some(8.0)], "{fast}");
    let slow = ladder("weighted", &["--sim-arg=--ttft-base-ms=600"]);
    let slow_caps = capacities(&slow, &["weighted"]);
    assert_eq!(slow_caps, [None], "every first token ≥ 600 ms: {slow}");
    assert!(slow_caps[0].unwrap_or(0.0) < caps[1].unwrap_or(0.0));
}
