//! Tests of prediction accuracy, on the engines' real metric texts
//! (tests/fixtures/engine-metrics/).

use super::*;
use crate::config::Preset;
use crate::pods::{read, MetricMap};

fn fixture(name: &str) -> String {
    let path = format!(
        "{}/tests/fixtures/engine-metrics/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn vllm(text: &str) -> Option<PrefixCounters> {
    read(text, MetricMap::preset(Preset::Vllm))
        .sample
        .prefix_cache
}

/// The vLLM fixture with each engine's prefix-cache counters advanced by the given tokens.
fn advanced(queries: [f64; 2], hits: [f64; 2]) -> String {
    let base = fixture("vllm.txt");
    let mut out = String::new();
    for line in base.lines() {
        let (name, q, h) = if line.starts_with("vllm:prefix_cache_queries_total") {
            ("queries", queries, [0.0; 2])
        } else if line.starts_with("vllm:prefix_cache_hits_total") {
            ("hits", [0.0; 2], hits)
        } else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let engine = usize::from(line.contains("engine=\"1\""));
        let (head, value) = line.rsplit_once(' ').expect("sample line");
        let v: f64 = value.parse().expect("value");
        let add = if name == "queries" {
            q[engine]
        } else {
            h[engine]
        };
        out.push_str(&format!("{head} {:.1}\n", v + add));
    }
    out
}

#[test]
fn the_vllm_fixture_reads_its_prefix_counters_summed_over_engines() {
    let c = vllm(&fixture("vllm.txt")).expect("vLLM reports prefix-cache counters");
    assert_eq!(c.queries, 184_320.0 + 150_016.0);
    assert_eq!(c.hits, 96_256.0 + 70_144.0);
}

#[test]
fn engines_without_prefix_counters_read_none() {
    for (file, p) in [
        ("sglang.txt", Preset::Sglang),
        ("llamacpp.txt", Preset::Llamacpp),
        ("tgi.txt", Preset::Tgi),
    ] {
        let s = read(&fixture(file), MetricMap::preset(p)).sample;
        assert_eq!(s.prefix_cache, None, "{file}");
    }
}

#[test]
fn older_vllm_names_are_read_and_a_negative_counter_is_refused() {
    let old = "vllm:gpu_prefix_cache_queries_total{model_name=\"m\"} 100.0\n\
               vllm:gpu_prefix_cache_hits_total{model_name=\"m\"} 40.0\n";
    assert_eq!(
        vllm(old),
        Some(PrefixCounters {
            queries: 100.0,
            hits: 40.0
        })
    );
    let bad = "vllm:prefix_cache_queries_total{model_name=\"m\"} -1\n\
               vllm:prefix_cache_hits_total{model_name=\"m\"} 40.0\n";
    assert_eq!(vllm(bad), None);
}

#[test]
fn a_window_is_the_counters_difference_against_the_predictions_between_two_scrapes() {
    let mut a = HitAccuracy::default();
    a.predicted(1000, 2000);
    assert_eq!(
        a.observe(vllm(&fixture("vllm.txt"))),
        None,
        "the first scrape is the baseline"
    );
    a.predicted(3000, 4000);
    let w = a
        .observe(vllm(&advanced([2000.0, 2000.0], [1000.0, 500.0])))
        .expect("a window");
    assert_eq!(
        w,
        HitWindow {
            routed: 4000.0,
            predicted: 3000.0,
            queries: 4000.0,
            observed: 1500.0,
        },
        "predictions before the baseline are dropped"
    );
    assert_eq!(w.predicted_rate(), Some(0.75));
    assert_eq!(w.observed_rate(), Some(0.375));
    assert_eq!(w.accuracy(), Some(0.5));
    let r = a.report();
    assert_eq!(r.accuracy, Some(0.5));
    assert_eq!(a.take_unexported(), w);
    assert_eq!(a.take_unexported(), HitWindow::default());
}

#[test]
fn counters_that_go_backwards_count_from_zero_as_a_restart() {
    let mut a = HitAccuracy::default();
    a.observe(vllm(&advanced([5000.0; 2], [5000.0; 2])));
    let restarted = "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 300.0\n\
                     vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 100.0\n";
    let w = a.observe(vllm(restarted)).expect("a window");
    assert_eq!((w.queries, w.observed), (300.0, 100.0));
    assert_eq!(a.report().counter_resets, 1);
}

#[test]
fn the_report_spans_the_last_windows_only() {
    let mut a = HitAccuracy::default();
    let mut total = (0.0, 0.0);
    a.observe(Some(PrefixCounters::default()));
    for i in 1..=(WINDOWS as u64 + 3) {
        a.predicted(100, 100);
        total = (total.0 + 100.0, total.1 + i as f64);
        a.observe(Some(PrefixCounters {
            queries: total.0,
            hits: total.1,
        }));
    }
    let r = a.report().recent;
    assert_eq!(r.routed, 100.0 * WINDOWS as f64);
    let last: u64 = (4..=(WINDOWS as u64 + 3)).sum();
    assert_eq!(r.observed, last as f64);
}

#[test]
fn a_restart_is_reported_once() {
    let (mut a, mut at) = (HitAccuracy::default(), PrefixCounters::default());
    at.queries = 1e6;
    at.hits = 5e5;
    a.observe(Some(at));
    assert!(!a.take_restart());
    a.predicted(3000, 4000);
    a.observe(Some(PrefixCounters {
        queries: 4000.0,
        hits: 0.0,
    }));
    assert!(a.take_restart(), "counters went backwards");
    assert!(!a.take_restart(), "reported once");
}

#[test]
fn predicted_hits_are_whole_blocks_short_of_the_last_prompt_token() {
    assert_eq!(
        predicted_hit_tokens(4.0, 16, 64),
        48,
        "the last block is computed"
    );
    assert_eq!(predicted_hit_tokens(4.0, 16, 65), 64);
    assert_eq!(predicted_hit_tokens(2.5, 16, 100), 40);
    assert_eq!(predicted_hit_tokens(0.0, 16, 100), 0);
    assert_eq!(predicted_hit_tokens(9.0, 16, 0), 0);
}
