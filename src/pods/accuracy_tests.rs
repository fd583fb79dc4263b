//! Tests of prediction accuracy and the capacity correction, on the engines' real metric texts
//! (tests/fixtures/engine-metrics/); the correction's effect on the approximate index is tested
//! beside the index (`index::correction_tests`).

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

fn cfg() -> CorrectionConfig {
    CorrectionConfig {
        enabled: true,
        tolerance: 0.2,
        min_scale: 0.1,
        max_scale: 1.0,
        max_step: 1.5,
        min_predicted_tokens: 1000,
        min_decisions: 1,
    }
}

/// One scrape window in which the router predicted `rate_p` and the pod found `rate_o`.
fn window(a: &mut HitAccuracy, at: &mut PrefixCounters, rate_p: f64, rate_o: f64) {
    a.predicted((4000.0 * rate_p) as u64, 4000);
    at.queries += 4000.0;
    at.hits += 4000.0 * rate_o;
    a.observe(Some(*at));
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn the_scale_moves_by_the_ratios_square_root_within_the_step_and_its_bounds() {
    let (mut a, mut at) = (HitAccuracy::default(), PrefixCounters::default());
    a.observe(Some(at));
    window(&mut a, &mut at, 0.5, 0.0625);
    assert!(
        close(a.correct(&cfg()), 1.0 / 1.5),
        "ratio 1/8: at most 1/1.5"
    );
    window(&mut a, &mut at, 0.5, 0.32);
    let s = 0.64f64.sqrt() / 1.5;
    assert!(
        close(a.correct(&cfg()), s),
        "ratio 0.64: by its square root"
    );
    window(&mut a, &mut at, 0.5, 0.4375);
    assert!(close(a.correct(&cfg()), s), "0.875 is within the tolerance");
    window(&mut a, &mut at, 0.25, 0.36);
    assert!(
        close(a.correct(&cfg()), s * 1.2),
        "ratio 1.44 grows it by 1.2"
    );
    for _ in 0..10 {
        window(&mut a, &mut at, 0.25, 0.5);
        a.correct(&cfg());
    }
    assert_eq!(a.scale(), 1.0, "never above the configured capacity");
    for _ in 0..20 {
        window(&mut a, &mut at, 0.5, 0.0);
        a.correct(&cfg());
    }
    assert_eq!(a.scale(), 0.1, "never under min_scale");
}

#[test]
fn a_pod_finding_more_than_predicted_grows_past_its_configuration_only_on_its_own_hits() {
    let grows = CorrectionConfig {
        max_scale: 4.0,
        ..cfg()
    };
    // The router's index forgets what the pod still holds: the pod finds 1.44x the predicted
    // rate on this router's own traffic, so the scale grows by 1.2 per judgement, up to 4.
    let (mut a, mut at) = (HitAccuracy::default(), PrefixCounters::default());
    a.observe(Some(at));
    window(&mut a, &mut at, 0.25, 0.36);
    assert!(close(a.correct(&grows), 1.2));
    for _ in 0..20 {
        window(&mut a, &mut at, 0.25, 0.36);
        a.correct(&grows);
    }
    assert_eq!(a.scale(), 4.0, "never above max_scale");
    assert_eq!(
        a.confidence(),
        1.0,
        "a precise pod's weight stays at most 1"
    );
    // Within the band it holds; a shortfall brings it back down.
    window(&mut a, &mut at, 0.25, 0.27);
    assert_eq!(a.correct(&grows), 4.0);
    window(&mut a, &mut at, 0.5, 0.32);
    assert!(close(a.correct(&grows), 4.0 * 0.8));

    // The same excess, but only once other clients' hits are credited: the pod found 0.9x the
    // rate over twice the tokens this router sent, so it holds other clients' prefixes, not ours.
    let (mut b, mut at) = (HitAccuracy::default(), PrefixCounters::default());
    b.observe(Some(at));
    for _ in 0..5 {
        b.predicted(1000, 4000);
        at.queries += 8000.0;
        at.hits += 1800.0;
        b.observe(Some(at));
        assert_eq!(b.correct(&grows), 1.0, "credited 1.8x, own 0.9x: not grown");
    }
    // Precise mode never grows: events already say what the pod holds.
    let (mut c, mut at) = (HitAccuracy::default(), PrefixCounters::default());
    c.observe(Some(at));
    for _ in 0..5 {
        window(&mut c, &mut at, 0.25, 0.5);
        assert_eq!(c.correct(&grows.for_index(true)), 1.0);
    }
}

#[test]
fn noise_around_a_right_view_does_not_ratchet_the_scale_down() {
    // Judgements that miss by as much either way (0.75 and 1/0.75): the view is right on average.
    let (mut a, mut at) = (HitAccuracy::default(), PrefixCounters::default());
    a.observe(Some(at));
    for _ in 0..20 {
        window(&mut a, &mut at, 0.4, 0.3);
        a.correct(&cfg());
        window(&mut a, &mut at, 0.3, 0.4);
        a.correct(&cfg());
    }
    assert!(a.scale() > 0.95, "scale {}", a.scale());
}

#[test]
fn traffic_the_router_did_not_route_does_not_shrink_a_pod() {
    // The router sent 4000 tokens predicting half cached, and the pod found those 2000; other
    // clients sent it 4000 more that found nothing, halving the pod's own rate.
    let (mut a, mut at) = (HitAccuracy::default(), PrefixCounters::default());
    a.observe(Some(at));
    for _ in 0..5 {
        a.predicted(2000, 4000);
        at.queries += 8000.0;
        at.hits += 2000.0;
        let w = a.observe(Some(at)).expect("a window");
        assert_eq!(w.accuracy(), Some(0.5));
        assert_eq!(w.credited_accuracy(), Some(1.0));
        assert_eq!(a.correct(&cfg()), 1.0);
    }
    // A shortfall beyond what the other traffic explains still counts.
    a.predicted(2000, 4000);
    at.queries += 8000.0;
    at.hits += 1000.0;
    a.observe(Some(at));
    assert!(close(a.correct(&cfg()), 0.5f64.sqrt()));
}

#[test]
fn a_restart_is_reported_once_and_the_window_across_it_is_not_judged() {
    let (mut a, mut at) = (HitAccuracy::default(), PrefixCounters::default());
    at.queries = 1e6;
    at.hits = 5e5;
    a.observe(Some(at));
    assert!(!a.take_restart());
    // Hits were predicted on the cache the restart emptied.
    a.predicted(3000, 4000);
    a.observe(Some(PrefixCounters {
        queries: 4000.0,
        hits: 0.0,
    }));
    assert!(a.take_restart(), "counters went backwards");
    assert!(!a.take_restart(), "reported once");
    assert_eq!(a.correct(&cfg()), 1.0, "that window is not judged");
}

#[test]
fn too_few_predicted_hits_are_not_judged_and_disabled_means_full_capacity() {
    let (mut a, mut at) = (HitAccuracy::default(), PrefixCounters::default());
    a.observe(Some(at));
    window(&mut a, &mut at, 0.2, 0.0);
    assert_eq!(
        a.correct(&cfg()),
        1.0,
        "800 predicted tokens: not judged yet"
    );
    window(&mut a, &mut at, 0.2, 0.0);
    window(&mut a, &mut at, 0.2, 0.0);
    assert!(
        close(a.correct(&cfg()), 1.0 / 1.5),
        "2400 accumulated: judged"
    );
    let off = CorrectionConfig {
        enabled: false,
        ..cfg()
    };
    window(&mut a, &mut at, 0.5, 0.0);
    assert_eq!(a.correct(&off), 1.0);
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

/// Scrape windows after which a precise-mode pod whose events promise four times the hits its
/// counters report is weighted at most 0.5, and after which, once they agree again, it is back
/// within the tolerance of full weight (steps of at most `max_step`, by the ratio's square root;
/// a window with fewer than `min_predicted_tokens` predicted waits for the next).
const FLAGGED_WITHIN: usize = 3;
const TRUSTED_AGAIN_WITHIN: usize = 5;

#[test]
fn a_precise_pod_whose_counters_contradict_its_events_is_weighted_down_until_they_agree() {
    // The decider predicts the events' matches times the pod's confidence (its scale):
    // `decide::input` weights the matches, and the commit predicts from the weighted plan.
    let promised = 0.8;
    let (mut a, mut at) = (HitAccuracy::default(), PrefixCounters::default());
    a.observe(Some(at));
    let mut scales = Vec::new();
    // Lost removals: the pod really holds a quarter of what its events say.
    for _ in 0..8 {
        let predicted = promised * a.scale();
        window(&mut a, &mut at, predicted, promised / 4.0);
        scales.push(a.correct(&cfg()));
    }
    assert!(
        scales[FLAGGED_WITHIN - 1] <= 0.5,
        "flagged within {FLAGGED_WITHIN} windows: {scales:?}"
    );
    let settled = *scales.last().expect("judged");
    assert!(
        (0.2..=0.3).contains(&settled),
        "it settles near the quarter its counters confirm, within the tolerance: {scales:?}"
    );
    // The events are fixed: the counters now report what the events promise.
    scales.clear();
    for _ in 0..8 {
        let predicted = promised * a.scale();
        window(&mut a, &mut at, predicted, promised);
        scales.push(a.correct(&cfg()));
    }
    // Within the tolerance the weight stops moving, as a right-sized one does under noise.
    let trusted = 1.0 / (1.0 + cfg().tolerance);
    assert!(
        scales[TRUSTED_AGAIN_WITHIN - 1..]
            .iter()
            .all(|&s| s >= trusted),
        "trusted again within {TRUSTED_AGAIN_WITHIN} windows: {scales:?}"
    );
}
