use super::*;
use crate::compare::{Comparison, StrategyRun};
use crate::paired::tests::run;

/// A round of `source` with hit difference `hits` points and TTFT p99 ratio `p99`.
fn round(source: &str, k: usize, hits: f64, p99: f64) -> Round {
    Round {
        epoch: EPOCH,
        machine: "CPU, 2 cores, 24 GiB RAM".into(),
        workload: "Workload: w (d). Fleet: f.".into(),
        sim: "--prefill-us-per-token=20".into(),
        strategy: "redis x4".into(),
        baseline: "weighted".into(),
        source: source.into(),
        round: k,
        strategy_hit: 90.0 + hits,
        baseline_hit: 90.0,
        strategy_p99_ms: 1000.0 * p99,
        baseline_p99_ms: 1000.0,
        fallbacks: Some(0),
    }
}

#[test]
fn a_round_survives_its_line() {
    let mut r = round("2026-12-01T22:40Z abc1234", 3, -1.25, 1.0375);
    assert_eq!(Round::parse(&r.line()).unwrap(), r);
    r.fallbacks = None;
    assert!(r.line().ends_with("\t-"), "{}", r.line());
    assert_eq!(Round::parse(&r.line()).unwrap(), r);
    // A tab inside a field cannot shift the columns.
    r.source = "a\tb".into();
    assert_eq!(Round::parse(&r.line()).unwrap().source, "a b");
}

#[test]
fn a_bad_line_is_an_error_that_names_it() {
    let good = round("s", 1, 0.0, 1.0).line();
    let text = format!(
        "{HEADER}\n# a comment\n\n{good}\n{}\n",
        good.replace("\t1000.00\t", "\tfast\t")
    );
    let e = format!("{:#}", parse(&text).unwrap_err());
    assert!(
        e.contains("line 5") && e.contains("\"fast\" is not a number"),
        "{e}"
    );
    let e = format!("{:#}", parse("1\ttoo\tfew").unwrap_err());
    assert!(e.contains("3 fields"), "{e}");
    assert_eq!(parse(&format!("{HEADER}\n{good}\n")).unwrap().len(), 1);
    let zero = good.replace("\t1000.00\t", "\t0.00\t");
    let e = format!("{:#}", parse(&zero).unwrap_err());
    assert!(e.contains("\"0.00\" is not a latency"), "{e}");
}

#[test]
fn appending_writes_the_header_once_and_returns_every_round() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("paired-rounds").join("rounds.tsv");
    assert!(
        read(&path).unwrap().is_empty(),
        "no record yet is an empty one"
    );
    let first = append(&path, &[round("a", 1, 0.0, 1.0)]).unwrap();
    assert_eq!(first.len(), 1);
    let all = append(&path, &[round("b", 1, 1.0, 1.0), round("b", 2, 2.0, 1.0)]).unwrap();
    assert_eq!(all.len(), 3);
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.matches("epoch\t").count(), 1, "{text}");
    assert_eq!(read(&path).unwrap(), all);
}

#[test]
fn the_pooled_verdict_takes_only_rounds_of_the_same_setting() {
    // Three invocations of the setting, every round within the goal…
    let mut all: Vec<Round> = (1..=4).map(|k| round("a", k, 0.5, 1.01)).collect();
    all.extend((1..=4).map(|k| round("b", k, -0.5, 1.03)));
    let new: Vec<Round> = (1..=4).map(|k| round("c", k, 0.0, 1.02)).collect();
    all.extend(new.clone());
    // …and rounds far off the goal that must not pool: another epoch, machine, window, sim
    // flags, replica count.
    let off = |f: &dyn Fn(&mut Round)| {
        let mut r = round("x", 1, -30.0, 2.0);
        f(&mut r);
        r
    };
    all.push(off(&|r| r.epoch = EPOCH + 1));
    all.push(off(&|r| r.machine = "other".into()));
    all.push(off(&|r| r.workload = "Workload: v.".into()));
    all.push(off(&|r| r.sim = String::new()));
    all.push(off(&|r| r.strategy = "redis".into()));
    let v = verdicts(&all, &new, "rounds.tsv");
    assert_eq!(v.lines().count(), 1, "{v}");
    let one = verdicts(&new, &new, "r");
    assert!(
        one.contains("4 rounds from 1 invocation, this one's 4"),
        "{one}"
    );
    assert!(
        v.contains("12 rounds from 3 invocations, this one's 4"),
        "{v}"
    );
    assert!(v.contains("**met**"), "{v}");
    assert!(v.contains("0 lookups fell back"), "{v}");

    // Rounds past the goal, and rounds that did not record their fallbacks.
    let mut worse = all.clone();
    worse.extend((1..=20).map(|k| {
        let mut r = round("d", k, -3.0, 1.2);
        r.fallbacks = None;
        r
    }));
    let v = verdicts(&worse, &new, "rounds.tsv");
    assert!(
        v.contains("**not met: median hits -3.0 points, median TTFT p99 1.200×**"),
        "{v}"
    );
    assert!(v.contains("in the 12 rounds that recorded them"), "{v}");
    let mut fell = all.clone();
    fell[0].fallbacks = Some(2);
    assert!(verdicts(&fell, &new, "r").contains("not met: 2 lookups fell back"));
}

#[test]
fn a_comparison_gives_one_round_per_paired_run_of_the_shared_index() {
    let strategy = |label: &str, pooled: f64, p99: f64, fallbacks: Option<u64>| StrategyRun {
        label: label.into(),
        summary: Some(run(label, pooled, p99)),
        run: None,
        skipped: None,
        pod_work: None,
        replica_counters: Vec::new(),
        redis_fallbacks: fallbacks,
    };
    let cmp = Comparison {
        workload: "w".into(),
        description: "d".into(),
        pods: Some(8),
        gpu_blocks: Some(1),
        fleet: "f".into(),
        runs: vec![
            strategy("redis x4 #1", 0.9, 1100.0, Some(0)),
            strategy("weighted #1", 0.8, 1000.0, None),
            strategy("weighted #2", 0.8, 1000.0, None),
            strategy("redis x4 #2", 0.7, 900.0, Some(1)),
            // Not on the shared index: no round of its own.
            strategy("precise #1", 0.8, 1000.0, None),
        ],
        pd_prefill: 0,
    };
    let sim = ["--a=1".to_string(), "--b=2".to_string()];
    let rounds = rounds_of(&cmp, &sim, "m", "src");
    assert_eq!(rounds.len(), 2, "{rounds:?}");
    let (a, b) = (&rounds[0], &rounds[1]);
    assert_eq!((a.round, b.round), (1, 2));
    assert_eq!(a.workload, "Workload: w (d). Fleet: f.");
    assert_eq!(
        (a.sim.as_str(), a.strategy.as_str(), a.baseline.as_str()),
        ("--a=1 --b=2", "redis x4", "weighted")
    );
    assert!((a.strategy_hit - 90.0).abs() < 1e-9 && (a.baseline_hit - 80.0).abs() < 1e-9);
    assert_eq!((a.strategy_p99_ms, b.fallbacks), (1100.0, Some(1)));
}

#[test]
fn utc_minutes_are_civil_dates() {
    assert_eq!(utc_minute(0), "1970-01-01T00:00Z");
    assert_eq!(utc_minute(951_868_740), "2000-02-29T23:59Z");
    assert_eq!(utc_minute(1_796_161_200), "2026-12-01T21:40Z");
}

#[test]
fn the_record_in_the_repository_parses_and_pools_by_window_and_replicas() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/paired-rounds/rounds.tsv");
    let all = read(&path).unwrap();
    assert!(all.len() >= 149, "{} rounds", all.len());
    let mut settings: Vec<&Round> = Vec::new();
    for r in &all {
        if !settings.iter().any(|s| s.pools_with(r)) {
            settings.push(r);
        }
    }
    // Both windows, two and four replicas (the record may grow more, never fewer).
    assert!(settings.len() >= 4, "{settings:?}");
    for s in &settings {
        let v = verdicts(&all, std::slice::from_ref(*s), "rounds.tsv");
        println!("{v}");
        assert!(v.starts_with("Pooled with every round on record"), "{v}");
    }
}
