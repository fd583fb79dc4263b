//! `/metrics` in the Prometheus text format as vLLM's `prometheus_client` writes it: one
//! `# HELP` and `# TYPE` per family, counter families named without `_total`, samples with
//! `_total`, float values (`1.0`), labels `model_name`, `engine` in that order. Histograms as
//! its `Histogram` writes them: cumulative `_bucket` samples (`le` last, up to `+Inf`), then
//! `_count`, then `_sum`.

use std::fmt::Write;

use super::engine::{Histogram, LoraInfo, Stats, REQUEST_LATENCY_BUCKETS_US, TTFT_BUCKETS_US};

/// Static labels and cache configuration for the exposition.
#[derive(Debug, Clone)]
pub struct MetricsInfo {
    /// First served model.
    pub model_name: String,
    /// Tokens per block.
    pub block_size: usize,
    /// KV blocks.
    pub num_gpu_blocks: usize,
}

fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Python-style float: integral values keep a `.0`.
fn num(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

/// A histogram's samples: cumulative buckets, `+Inf`, `_count`, `_sum` (seconds).
fn histogram<const N: usize>(
    labels: &str,
    h: &Histogram<N>,
    bounds: &[u64; N],
) -> Vec<(&'static str, String, f64)> {
    let mut out = Vec::with_capacity(N + 3);
    let mut acc = 0;
    for (bound, n) in bounds.iter().zip(h.buckets) {
        acc += n;
        let le = num(*bound as f64 / 1e6);
        out.push(("_bucket", format!("{labels},le=\"{le}\""), acc as f64));
    }
    out.push(("_bucket", format!("{labels},le=\"+Inf\""), h.count as f64));
    out.push(("_count", labels.to_string(), h.count as f64));
    out.push(("_sum", labels.to_string(), h.sum_us as f64 / 1e6));
    out
}

/// Renders the exposition text.
pub fn render(info: &MetricsInfo, s: &Stats) -> String {
    let labels = format!("model_name=\"{}\",engine=\"0\"", escape(&info.model_name));
    let mut out = String::with_capacity(4096);
    let mut family = |name: &str, kind: &str, help: &str, samples: &[(&str, String, f64)]| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (suffix, extra, value) in samples {
            let _ = writeln!(out, "{name}{suffix}{{{extra}}} {}", num(*value));
        }
    };
    let plain = |v: f64| vec![("", labels.clone(), v)];
    let total = |v: f64| vec![("_total", labels.clone(), v)];
    family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &plain(s.running as f64),
    );
    family(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &plain(s.waiting as f64),
    );
    family(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &plain(s.kv_cache_usage),
    );
    family(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "GPU KV-cache usage. 1 means 100 percent usage. (Deprecated name of kv_cache_usage_perc.)",
        &plain(s.kv_cache_usage),
    );
    family(
        "vllm:prefix_cache_queries",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &total(s.prefix_cache_queries as f64),
    );
    family(
        "vllm:prefix_cache_hits",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &total(s.prefix_cache_hits as f64),
    );
    family(
        "vllm:prompt_tokens",
        "counter",
        "Number of prefill tokens processed.",
        &total(s.prompt_tokens as f64),
    );
    family(
        "vllm:generation_tokens",
        "counter",
        "Number of generation tokens processed.",
        &total(s.generation_tokens as f64),
    );
    let reasons = [
        ("stop", 0.0),
        ("length", s.finished_length as f64),
        ("abort", s.aborted as f64),
    ];
    let success: Vec<_> = reasons
        .iter()
        .map(|(r, v)| ("_total", format!("{labels},finished_reason=\"{r}\""), *v))
        .collect();
    family(
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        &success,
    );
    family(
        "vllm:time_to_first_token_seconds",
        "histogram",
        "Histogram of time to first token in seconds.",
        &histogram(&labels, &s.ttft, &TTFT_BUCKETS_US),
    );
    family(
        "vllm:request_queue_time_seconds",
        "histogram",
        "Histogram of time spent in WAITING phase for request.",
        &histogram(&labels, &s.queue_time, &REQUEST_LATENCY_BUCKETS_US),
    );
    family(
        "vllm:request_prefill_time_seconds",
        "histogram",
        "Histogram of time spent in PREFILL phase for request.",
        &histogram(&labels, &s.prefill_time, &REQUEST_LATENCY_BUCKETS_US),
    );
    family(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMCache",
        &[(
            "",
            format!(
                "block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",\
                 num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"sha256\",engine=\"0\"",
                info.block_size, info.num_gpu_blocks
            ),
            1.0,
        )],
    );
    out
}

/// A sample value as prometheus_client's `floatToGoString` writes it: Python's `repr`, but
/// positive values with more than 6 integer digits in Go's exponent form
/// (`1732712345.25` → `1.73271234525e+09`).
pub fn go_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "+Inf" } else { "-Inf" }.into();
    }
    let s = num(v);
    match s.find('.') {
        Some(dot) if v > 0.0 && dot > 6 && !s.contains('e') => {
            let mantissa = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
            let mantissa = mantissa.trim_end_matches(['0', '.']);
            format!("{mantissa}e+0{}", dot - 1)
        }
        _ => s,
    }
}

/// vLLM's LoRA gauge `vllm:lora_requests_info` (labels `max_lora`, `waiting_lora_adapters`,
/// `running_lora_adapters` in vLLM's declaration order; one series per label set ever set,
/// valued with the Unix time it was last set, so the newest is the current state), then the
/// sim's `vllm_sim:lora_loads_total` and `vllm_sim:lora_evictions_total` counters.
pub fn render_lora(model_name: &str, info: &LoraInfo, s: &Stats) -> String {
    let mut out = String::with_capacity(256 + 96 * info.series.len());
    let name = "vllm:lora_requests_info";
    let _ = writeln!(out, "# HELP {name} Running stats on lora requests.");
    let _ = writeln!(out, "# TYPE {name} gauge");
    for series in &info.series {
        let _ = writeln!(
            out,
            "{name}{{max_lora=\"{}\",waiting_lora_adapters=\"{}\",running_lora_adapters=\"{}\"}} {}",
            info.max_loras,
            escape(&series.waiting),
            escape(&series.running),
            go_float(series.at_us as f64 / 1e6)
        );
    }
    let labels = format!("model_name=\"{}\",engine=\"0\"", escape(model_name));
    for (family, help, v) in [
        (
            "vllm_sim:lora_loads",
            "LoRA adapters loaded into a GPU slot (sim only).",
            s.lora_loads,
        ),
        (
            "vllm_sim:lora_evictions",
            "Loaded LoRA adapters evicted to make room for another (sim only).",
            s.lora_evictions,
        ),
    ] {
        let _ = writeln!(out, "# HELP {family} {help}");
        let _ = writeln!(out, "# TYPE {family} counter");
        let _ = writeln!(out, "{family}_total{{{labels}}} {}", num(v as f64));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::engine::{Engine, EngineConfig, Submission};
    use super::*;

    #[test]
    fn exposition_shape() {
        let info = MetricsInfo {
            model_name: "m\"x".into(),
            block_size: 16,
            num_gpu_blocks: 2048,
        };
        let s = Stats {
            running: 3,
            kv_cache_usage: 0.25,
            prefix_cache_hits: 32,
            finished_length: 2,
            ..Stats::default()
        };
        let text = render(&info, &s);
        assert!(text.contains("# TYPE vllm:prefix_cache_queries counter\n"));
        assert!(
            text.contains("vllm:num_requests_running{model_name=\"m\\\"x\",engine=\"0\"} 3.0\n")
        );
        assert!(
            text.contains("vllm:kv_cache_usage_perc{model_name=\"m\\\"x\",engine=\"0\"} 0.25\n")
        );
        assert!(text
            .contains("vllm:prefix_cache_hits_total{model_name=\"m\\\"x\",engine=\"0\"} 32.0\n"));
        assert!(text.contains("finished_reason=\"length\"} 2.0\n"));
        assert!(text.contains("block_size=\"16\""));
        assert!(text.contains("num_gpu_blocks=\"2048\""));
    }

    fn info() -> MetricsInfo {
        MetricsInfo {
            model_name: "m".into(),
            block_size: 4,
            num_gpu_blocks: 1024,
        }
    }

    /// Two uncached 100-token prompts submitted together, run to completion.
    fn run_two() -> Stats {
        let mut e = Engine::new(EngineConfig {
            block_size: 4,
            num_gpu_blocks: 1024,
            max_num_seqs: 4,
            ttft_base_us: 1_000.0,
            prefill_us_per_token: 10.0,
            decode_us_per_token: 100.0,
            decode_batch_slowdown: 0.0,
            prefill_chunk_tokens: 0,
        });
        e.submit(0, 1, Submission::new(1, (0..100).collect(), 2, 4));
        e.submit(0, 2, Submission::new(2, (0..100).collect(), 2, 4));
        while let Some(t) = e.next_event_time() {
            e.step(t);
        }
        e.stats()
    }

    #[test]
    fn timing_histograms_in_prometheus_client_shape() {
        let text = render(&info(), &run_two());
        let l = "model_name=\"m\",engine=\"0\"";
        // Prefill: 100 × 10 µs + 1 ms each; queue: 0 and 1 ms; TTFT: 2 and 3 ms.
        let prefill = "vllm:request_prefill_time_seconds";
        let want = format!(
            "# HELP {prefill} Histogram of time spent in PREFILL phase for request.\n\
             # TYPE {prefill} histogram\n\
             {prefill}_bucket{{{l},le=\"0.3\"}} 2.0\n\
             {prefill}_bucket{{{l},le=\"0.5\"}} 2.0\n"
        );
        assert!(text.contains(&want), "{text}");
        let tail = format!(
            "{prefill}_bucket{{{l},le=\"7680.0\"}} 2.0\n\
             {prefill}_bucket{{{l},le=\"+Inf\"}} 2.0\n\
             {prefill}_count{{{l}}} 2.0\n\
             {prefill}_sum{{{l}}} 0.004\n"
        );
        assert!(text.contains(&tail), "{text}");
        let queue = "vllm:request_queue_time_seconds";
        assert!(text.contains(&format!(
            "{queue}_count{{{l}}} 2.0\n{queue}_sum{{{l}}} 0.001\n"
        )));
        let ttft = "vllm:time_to_first_token_seconds";
        assert!(text.contains("# TYPE vllm:time_to_first_token_seconds histogram\n"));
        assert!(text.contains(&format!("{ttft}_bucket{{{l},le=\"0.001\"}} 0.0\n")));
        assert!(text.contains(&format!("{ttft}_bucket{{{l},le=\"0.005\"}} 2.0\n")));
        assert!(text.contains(&format!("{ttft}_bucket{{{l},le=\"2560.0\"}} 2.0\n")));
        assert!(text.contains(&format!("{ttft}_sum{{{l}}} 0.005\n")));
        // Every bucket line of the three families: 22 + 1, 21 + 1, 21 + 1.
        assert_eq!(text.matches("_seconds_bucket{").count(), 23 + 22 + 22);
    }

    #[test]
    fn buckets_are_cumulative() {
        let mut s = Stats::default();
        for us in [100_000, 400_000, 400_000, 9_000_000_000] {
            s.queue_time.observe(us, &REQUEST_LATENCY_BUCKETS_US);
        }
        let text = render(&info(), &s);
        let q = "vllm:request_queue_time_seconds_bucket{model_name=\"m\",engine=\"0\"";
        for (le, n) in [("0.3", 1), ("0.5", 3), ("7680.0", 3), ("+Inf", 4)] {
            assert!(text.contains(&format!("{q},le=\"{le}\"}} {n}.0\n")), "{le}");
        }
    }

    #[test]
    fn the_routers_vllm_preset_reads_the_timing_back() {
        let mut s = run_two();
        // Counters and sums that are not round in binary nor in decimal.
        s.prefill_uncached_tokens += 123_457;
        s.prompt_tokens += 123_457;
        s.prefill_time
            .observe(1_234_567, &REQUEST_LATENCY_BUCKETS_US);
        s.queue_time.observe(7_654_321, &REQUEST_LATENCY_BUCKETS_US);
        for stats in [run_two(), s] {
            let read = kv_router::pods::parse_vllm_metrics(&render(&info(), &stats));
            // prompt_tokens − prefix_cache_hits is the same set as the uncached tokens here
            // (no request is between its prefill and its first token).
            assert_eq!(read.timing, Some(stats.timing()));
            assert_eq!(read.running, 0.0);
        }
    }

    #[test]
    fn floats_as_prometheus_client_writes_them() {
        assert_eq!(go_float(1_732_712_345.25), "1.73271234525e+09");
        assert_eq!(go_float(1_700_000_000.0), "1.7e+09");
        assert_eq!(go_float(1_234_567.5), "1.2345675e+06");
        assert_eq!(go_float(123_456.5), "123456.5");
        assert_eq!(go_float(3.0), "3.0");
        assert_eq!(go_float(f64::INFINITY), "+Inf");
    }

    #[test]
    fn lora_gauge_in_vllms_label_order() {
        use super::super::engine::LoraSeries;
        let info = LoraInfo {
            max_loras: 4,
            series: vec![
                LoraSeries {
                    running: "a,b".into(),
                    waiting: "c".into(),
                    at_us: 1_700_000_000_250_000,
                },
                LoraSeries {
                    running: String::new(),
                    waiting: String::new(),
                    at_us: 1_700_000_001_000_000,
                },
            ],
            resident: vec!["a".into()],
        };
        let s = Stats {
            lora_loads: 7,
            lora_evictions: 3,
            ..Stats::default()
        };
        let text = render_lora("m", &info, &s);
        let want = "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
                    # TYPE vllm:lora_requests_info gauge\n\
                    vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"c\",\
                    running_lora_adapters=\"a,b\"} 1.70000000025e+09\n\
                    vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"\",\
                    running_lora_adapters=\"\"} 1.700000001e+09\n";
        assert!(text.starts_with(want), "{text}");
        assert!(text.contains(
            "# TYPE vllm_sim:lora_loads counter\n\
             vllm_sim:lora_loads_total{model_name=\"m\",engine=\"0\"} 7.0\n"
        ));
        assert!(text.contains("vllm_sim:lora_evictions_total{model_name=\"m\",engine=\"0\"} 3.0\n"));
    }
}
