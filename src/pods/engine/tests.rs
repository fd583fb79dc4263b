//! Tests of the engine presets against real-format fixtures (tests/fixtures/engine-metrics/).

use std::collections::BTreeMap;

use super::*;
use crate::config::Config;

fn fixture(name: &str) -> String {
    let path = format!(
        "{}/tests/fixtures/engine-metrics/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn load(s: &LoadSample) -> (f64, f64, f64) {
    // Rounded: means and ratios are not exact in binary.
    let r = |v: f64| (v * 1e6).round() / 1e6;
    (r(s.waiting), r(s.running), r(s.kv_usage))
}

fn preset(p: Preset, text: &str) -> Reading {
    read(text, MetricMap::preset(p))
}

#[test]
fn each_preset_reads_its_engines_fixture() {
    for (file, p, want) in [
        ("vllm.txt", Preset::Vllm, (4.0, 14.0, 0.6)),
        ("sglang.txt", Preset::Sglang, (3.0, 7.0, 0.41)),
        ("sglang-dp.txt", Preset::Sglang, (2.0, 10.0, 0.4)),
        ("sglang-idle.txt", Preset::Sglang, (0.0, 0.0, 0.0)),
        ("llamacpp.txt", Preset::Llamacpp, (2.0, 4.0, 0.0)),
        ("llamacpp-legacy.txt", Preset::Llamacpp, (0.0, 1.0, 0.25)),
        ("tgi.txt", Preset::Tgi, (6.0, 16.0, 0.3125)),
    ] {
        let r = preset(p, &fixture(file));
        assert_eq!(load(&r.sample), want, "{file}");
        assert_eq!(r.matched, file != "sglang-idle.txt", "{file}");
    }
}

#[test]
fn vllm_capacity_comes_from_cache_config_info() {
    let s = preset(Preset::Vllm, &fixture("vllm.txt")).sample;
    assert_eq!(s.num_gpu_blocks, Some(55_680));
    assert_eq!(s.block_size, Some(16));
    // No other engine reports it.
    let s = preset(Preset::Sglang, &fixture("sglang.txt")).sample;
    assert_eq!((s.num_gpu_blocks, s.block_size), (None, None));
}

#[test]
fn a_preset_reads_nothing_from_another_engines_metrics() {
    for p in Preset::ALL {
        for file in ["vllm.txt", "sglang.txt", "llamacpp.txt", "tgi.txt"] {
            if file.starts_with(p.as_str()) {
                continue;
            }
            let r = preset(p, &fixture(file));
            assert!(!r.matched, "{p} matched {file}");
            assert_eq!(r.sample, LoadSample::default(), "{p} on {file}");
        }
    }
}

#[test]
fn detection_recognises_every_fixture() {
    for (file, want) in [
        ("vllm.txt", Preset::Vllm),
        ("sglang.txt", Preset::Sglang),
        ("sglang-dp.txt", Preset::Sglang),
        ("sglang-idle.txt", Preset::Sglang),
        ("llamacpp.txt", Preset::Llamacpp),
        ("llamacpp-legacy.txt", Preset::Llamacpp),
        ("tgi.txt", Preset::Tgi),
    ] {
        assert_eq!(detect(&fixture(file)), Some(want), "{file}");
    }
    assert_eq!(detect(""), None);
    assert_eq!(
        detect("# HELP python_info x\npython_info 1\nhttp_requests_total 3\n"),
        None
    );
    // The engine with more lines wins a mixed text (a sidecar's stray series).
    let mixed = format!("{}tgi_queue_size 1\n", fixture("sglang.txt"));
    assert_eq!(detect(&mixed), Some(Preset::Sglang));
}

#[test]
fn auto_detects_on_the_first_scrape_and_remembers() {
    let id = PodId::new("10.0.0.1:8000");
    let engine = PodEngine::default();
    assert_eq!((engine.setting(), engine.current()), ("auto", "unknown"));
    // Before the engine is up its /metrics may show only the runtime's own series.
    let s = engine.read(&id, "python_info 1\n");
    assert_eq!(s, LoadSample::default());
    assert_eq!(engine.current(), "unknown");
    let s = engine.read(&id, &fixture("llamacpp.txt"));
    assert_eq!(engine.current(), "llamacpp");
    assert_eq!(load(&s), (2.0, 4.0, 0.0));
    // Remembered: a scrape without any engine's names changes nothing.
    engine.read(&id, "python_info 1\n");
    assert_eq!(engine.current(), "llamacpp");
}

#[test]
fn auto_follows_another_engine_at_the_same_address() {
    let id = PodId::new("10.0.0.1:8000");
    let engine = PodEngine::default();
    engine.read(&id, &fixture("vllm.txt"));
    assert_eq!(engine.current(), "vllm");
    // The pod was redeployed with SGLang behind the same IP and port.
    let s = engine.read(&id, &fixture("sglang.txt"));
    assert_eq!(engine.current(), "sglang");
    assert_eq!(load(&s), (3.0, 7.0, 0.41));
}

#[test]
fn a_configured_preset_is_not_second_guessed() {
    let id = PodId::new("10.0.0.1:8000");
    let engine = PodEngine::new(EngineChoice::Preset(Preset::Tgi), "dns");
    let s = engine.read(&id, &fixture("vllm.txt"));
    assert_eq!(s, LoadSample::default(), "vLLM text read as TGI: nothing");
    assert_eq!((engine.setting(), engine.current()), ("tgi", "tgi"));
    assert_eq!(engine.setting_from(), "dns");
}

fn custom(yaml: &str) -> MetricMap {
    let c: CustomEngine = serde_yaml::from_str(yaml).unwrap();
    MetricMap::custom(&c)
}

#[test]
fn a_custom_mapping_reads_percent_and_used_over_total() {
    let text = "q{shard=\"0\"} 2\nq{shard=\"1\"} 3\nactive 5\nkv_pct 42\nused 300\ncap 1200\n";
    let pct = custom("{ waiting: q, running: active, kv_usage: kv_pct, kv_usage_scale: 0.01 }");
    assert_eq!(load(&read(text, &pct).sample), (5.0, 5.0, 0.42));
    let ratio = custom("{ running: active, kv_used: used, kv_total: cap }");
    assert_eq!(load(&read(text, &ratio).sample), (0.0, 5.0, 0.25));
    // An engine repeating its gauges per shard: one value per group.
    let grouped = custom("{ waiting: q, group_by: replica }");
    assert_eq!(read(text, &grouped).sample.waiting, 3.0);
}

#[test]
fn kv_usage_is_clamped_and_never_nan() {
    let over = custom("{ kv_usage: k, kv_usage_scale: 0.01 }");
    assert_eq!(read("k 250\n", &over).sample.kv_usage, 1.0);
    let ratio = custom("{ kv_used: u, kv_total: t }");
    let huge = "u 1e308\nu 1e308\nt 1e308\nt 1e308\n";
    assert_eq!(read(huge, &ratio).sample.kv_usage, 0.0, "inf / inf");
    assert_eq!(
        read("u 5\nt 0\n", &ratio).sample.kv_usage,
        0.0,
        "no capacity"
    );
    assert_eq!(read("u -5\nt 10\n", &ratio).sample.kv_usage, 0.0);
}

#[test]
fn rank_groups_are_bounded() {
    // A hostile pod inventing a new dp_rank on every line: the table stops growing.
    let text: String = (0..10_000)
        .map(|i| format!("sglang:num_queue_reqs{{dp_rank=\"{i}\"}} 1\n"))
        .collect();
    let s = preset(Preset::Sglang, &text).sample;
    assert_eq!(s.waiting, MAX_GROUPS as f64);
}

fn spec(addr: &str, labels: &[(&str, &str)]) -> PodSpec {
    PodSpec {
        id: PodId::new(addr),
        addr: addr.parse().unwrap(),
        models: vec![],
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>(),
        kv_events_endpoint: None,
        kv_events_replay_endpoint: None,
    }
}

#[test]
fn the_label_then_the_source_then_pods_engine_decide() {
    let cfg = Config::from_yaml(
        "pods:\n  engine: vllm\n  static: [{ address: 10.0.0.1:8000, labels: { kv-router.io/engine: llamacpp } }, { address: 10.0.0.2:8000 }]\n  dns: [{ name: sgl.svc, port: 30000, engine: sglang }, { name: other.svc, port: 8000 }]\n  kubernetes: { selector: app=tgi, engine: { running: my_running } }\n",
    )
    .unwrap();
    let r = EngineResolver::new(&cfg.pods);
    let show = |e: PodEngine| (e.setting(), e.setting_from());
    let static_labelled = [(ENGINE_LABEL, "llamacpp")];
    assert_eq!(
        show(r.resolve(&spec("10.0.0.1:8000", &static_labelled))),
        ("llamacpp", "label")
    );
    assert_eq!(
        show(r.resolve(&spec("10.0.0.2:8000", &[]))),
        ("vllm", "pods.engine")
    );
    let dns = [("source", "dns:sgl.svc")];
    assert_eq!(
        show(r.resolve(&spec("10.1.0.1:30000", &dns))),
        ("sglang", "dns")
    );
    let other = [("source", "dns:other.svc")];
    assert_eq!(
        show(r.resolve(&spec("10.1.0.2:8000", &other))),
        ("vllm", "pods.engine")
    );
    let kube = [("source", "kubernetes")];
    assert_eq!(
        show(r.resolve(&spec("10.2.0.1:80", &kube))),
        ("custom", "kubernetes")
    );
    // The pod's own label wins over every source; an unknown value is ignored.
    let labelled = [("source", "kubernetes"), (ENGINE_LABEL, "TGI")];
    assert_eq!(
        show(r.resolve(&spec("10.2.0.2:80", &labelled))),
        ("tgi", "label")
    );
    let auto = [("source", "dns:sgl.svc"), (ENGINE_LABEL, "auto")];
    assert_eq!(
        show(r.resolve(&spec("10.1.0.3:30000", &auto))),
        ("auto", "label")
    );
    let bogus = [("source", "dns:sgl.svc"), (ENGINE_LABEL, "ollama")];
    assert_eq!(
        show(r.resolve(&spec("10.1.0.4:30000", &bogus))),
        ("sglang", "dns")
    );
}

#[test]
fn the_vllm_parser_is_the_vllm_preset() {
    let text = fixture("vllm.txt");
    assert_eq!(
        parse_vllm_metrics(&text),
        preset(Preset::Vllm, &text).sample
    );
}

#[test]
fn vllm_timing_sums_both_engines() {
    let s = preset(Preset::Vllm, &fixture("vllm.txt")).sample;
    assert_eq!(
        s.timing,
        Some(EngineTiming {
            // (184,320 − 96,256) + (150,016 − 70,144)
            prefill_tokens: 167_936.0,
            prefills: 571.0,
            prefill_seconds: 22.75,
            queued: 571.0,
            queue_seconds: 9.25,
        })
    );
    // The rest of the sample is what it was before vLLM's timing was read.
    assert_eq!(
        LoadSample {
            timing: None,
            prefix_cache: None,
            ..s
        },
        LoadSample {
            waiting: 4.0,
            running: 14.0,
            kv_usage: s.kv_usage,
            num_gpu_blocks: Some(55_680),
            block_size: Some(16),
            timing: None,
            prefix_cache: None,
            sent_here: 0.0,
        }
    );
    // No other preset, and no custom mapping, reads timing.
    for p in [Preset::Sglang, Preset::Llamacpp, Preset::Tgi] {
        assert_eq!(preset(p, &fixture("vllm.txt")).sample.timing, None, "{p}");
    }
    let names = custom("{ waiting: vllm:num_requests_waiting }");
    assert_eq!(read(&fixture("vllm.txt"), &names).sample.timing, None);
}

/// The vLLM fixture's lines without those of the named families.
fn vllm_without(families: &[&str]) -> String {
    fixture("vllm.txt")
        .lines()
        .filter(|l| !families.iter().any(|f| l.contains(f)))
        .map(|l| format!("{l}\n"))
        .collect()
}

#[test]
fn vllm_timing_needs_the_prefill_histogram() {
    let text = vllm_without(&["vllm:request_prefill_time_seconds"]);
    let r = preset(Preset::Vllm, &text);
    assert_eq!(r.sample.timing, None);
    assert_eq!(load(&r.sample), (4.0, 14.0, 0.6), "load unchanged");
    // Its _sum alone is not enough either, nor is the prompt-token counter optional.
    let text = vllm_without(&["vllm:request_prefill_time_seconds_count"]);
    assert_eq!(preset(Preset::Vllm, &text).sample.timing, None);
    let text = vllm_without(&["vllm:prompt_tokens_total"]);
    assert_eq!(preset(Preset::Vllm, &text).sample.timing, None);
    // Without the queue histogram and the prefix cache counter: zeros.
    let text = vllm_without(&[
        "vllm:request_queue_time_seconds",
        "vllm:prefix_cache_hits_total",
    ]);
    let t = preset(Preset::Vllm, &text).sample.timing.unwrap();
    assert_eq!(
        (t.prefill_tokens, t.prefills, t.queued, t.queue_seconds),
        (334_336.0, 571.0, 0.0, 0.0)
    );
    // The older name of the prefix cache counter stands in for the newer one.
    let old = fixture("vllm.txt").replace(
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits_total",
    );
    let t = preset(Preset::Vllm, &old).sample.timing.unwrap();
    assert_eq!(t.prefill_tokens, 167_936.0);
    let m = "{engine=\"0\"}";
    let both = format!(
        "vllm:prompt_tokens_total{m} 100\nvllm:prefix_cache_hits_total{m} 30\n\
         vllm:gpu_prefix_cache_hits_total{m} 30\nvllm:request_prefill_time_seconds_sum{m} 1\n\
         vllm:request_prefill_time_seconds_count{m} 2\n"
    );
    let t = preset(Preset::Vllm, &both).sample.timing.unwrap();
    assert_eq!(t.prefill_tokens, 70.0, "both names: counted once");
    let more_hits = both.replace("} 30\n", "} 130\n");
    let t = preset(Preset::Vllm, &more_hits).sample.timing.unwrap();
    assert_eq!(t.prefill_tokens, 0.0, "clamped");
    assert_eq!(preset(Preset::Vllm, "").sample, LoadSample::default());
}

#[test]
fn hostile_timing_values_read_as_absent() {
    let fixture = fixture("vllm.txt");
    let sum =
        "vllm:request_prefill_time_seconds_sum{engine=\"1\",model_name=\"Qwen/Qwen3-8B\"} 10.25";
    let hits = "vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"Qwen/Qwen3-8B\"} 70144.0";
    let queue =
        "vllm:request_queue_time_seconds_count{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 320.0";
    for (line, bad) in [
        (sum, "NaN"),
        (sum, "-10.25"),
        (sum, "+Inf"),
        (hits, "-1"),
        (queue, "-Inf"),
        (sum, "1e308"),
    ] {
        assert!(fixture.contains(line));
        let (name, _) = line.rsplit_once(' ').unwrap();
        let mut text = fixture.replace(line, &format!("{name} {bad}"));
        if bad == "1e308" {
            // Two finite values whose sum is not.
            text = text.replace(
                "vllm:request_prefill_time_seconds_sum{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 12.5",
                "vllm:request_prefill_time_seconds_sum{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 1e308",
            );
        }
        let r = preset(Preset::Vllm, &text);
        assert_eq!(r.sample.timing, None, "{bad} in {name}");
        assert_eq!(load(&r.sample), (4.0, 14.0, 0.6), "{bad}: load unchanged");
    }
}
