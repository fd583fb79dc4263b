//! `/metrics` in the Prometheus text format as vLLM's `prometheus_client` writes it: one
//! `# HELP` and `# TYPE` per family, counter families named without `_total`, samples with
//! `_total`, float values (`1.0`), labels `model_name`, `engine` in that order.

use std::fmt::Write;

use super::engine::Stats;

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

#[cfg(test)]
mod tests {
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
}
