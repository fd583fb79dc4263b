//! Probes: `/health` for liveness, `/metrics` for load, `/v1/models` for served models, and the
//! discovery loop that keeps the pod set current.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use tokio::time::{interval, Instant, MissedTickBehavior};
use tracing::{debug, info, warn};

use super::{LoadSample, Pod, PodId, PodRegistry, PodSource, PodSpec};
use crate::config::PodsConfig;
use crate::telemetry::{ErrorKind, Errors};

/// Runs the probe loops for a registry.
#[derive(Clone)]
pub struct Prober {
    client: reqwest::Client,
    cfg: PodsConfig,
    registry: Arc<PodRegistry>,
    errors: Errors,
}

impl Prober {
    /// A prober with its own HTTP client; failing pod sources are counted in `errors`.
    pub fn new(cfg: PodsConfig, registry: Arc<PodRegistry>, errors: Errors) -> Self {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(cfg.probe_timeout_ms))
            .pool_max_idle_per_host(2)
            .build()
            .expect("static reqwest configuration");
        Self {
            client,
            cfg,
            registry,
            errors,
        }
    }

    /// Keeps the registry equal to the union of the sources; a failing source keeps its last
    /// answer. Calls `on_gone` for every pod that left.
    pub async fn run_discovery(
        self,
        sources: Vec<Box<dyn PodSource>>,
        refresh: Duration,
        on_gone: impl Fn(Vec<PodId>) + Send + 'static,
    ) {
        let mut last: Vec<Option<Vec<PodSpec>>> = vec![None; sources.len()];
        let mut tick = interval(refresh);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let mut changed = false;
            for (i, source) in sources.iter().enumerate() {
                match source.pods().await {
                    Ok(pods) => {
                        if last[i].as_ref() != Some(&pods) {
                            info!(source = %source.name(), pods = pods.len(), "pod source updated");
                            last[i] = Some(pods);
                            changed = true;
                        }
                    }
                    Err(e) => {
                        warn!(source = %source.name(), error = %e, "pod source failed; keeping its last pods");
                        self.errors.inc(ErrorKind::PodSource);
                    }
                }
            }
            if changed {
                let specs: Vec<PodSpec> = last.iter().flatten().flatten().cloned().collect();
                let gone = self.registry.update(specs);
                if !gone.is_empty() {
                    info!(pods = ?gone.iter().map(PodId::as_str).collect::<Vec<_>>(), "pods left");
                    on_gone(gone);
                }
            }
        }
    }

    /// Probes `/health` (and `/v1/models` when models are not configured) forever.
    pub async fn run_health(self) {
        let mut tick = interval(Duration::from_millis(self.cfg.health_interval_ms));
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let set = self.registry.snapshot();
            join_all(set.pods().iter().map(|pod| self.health_once(pod.clone()))).await;
        }
    }

    /// One health probe of one pod.
    pub async fn health_once(&self, pod: Arc<Pod>) {
        let url = format!("http://{}/health", pod.spec.addr);
        let ok = matches!(self.client.get(&url).send().await, Ok(r) if r.status().is_success());
        let was = pod.is_healthy();
        pod.record_probe(ok, self.cfg.unhealthy_after);
        if was != pod.is_healthy() {
            info!(pod = %pod.id(), healthy = pod.is_healthy(), "pod health changed");
        }
        let due = pod
            .models_learned_at()
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(self.cfg.models_refresh_ms));
        if ok && pod.spec.models.is_empty() && due {
            match self.fetch_models(&pod).await {
                Ok(models) => pod.set_learned_models(Instant::now(), models),
                Err(e) => debug!(pod = %pod.id(), error = %e, "reading /v1/models failed"),
            }
        }
    }

    async fn fetch_models(&self, pod: &Pod) -> Result<Vec<String>, reqwest::Error> {
        let url = format!("http://{}/v1/models", pod.spec.addr);
        let v: serde_json::Value = self
            .client
            .get(&url)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        Ok(v.get("data")
            .and_then(|d| d.as_array())
            .map(|d| {
                d.iter()
                    .filter_map(|m| m.get("id")?.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Scrapes `/metrics` of every pod forever.
    pub async fn run_scrape(self) {
        let mut tick = interval(Duration::from_millis(self.cfg.scrape_interval_ms));
        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        loop {
            tick.tick().await;
            let set = self.registry.snapshot();
            join_all(set.pods().iter().map(|pod| self.scrape_once(pod.clone()))).await;
        }
    }

    /// One scrape of one pod; a failure leaves the last sample to go stale.
    pub async fn scrape_once(&self, pod: Arc<Pod>) {
        let started = Instant::now();
        let url = format!("http://{}/metrics", pod.spec.addr);
        let text = match self.client.get(&url).send().await {
            Ok(r) if r.status().is_success() => r.text().await,
            Ok(r) => {
                debug!(pod = %pod.id(), status = %r.status(), "scrape failed");
                return;
            }
            Err(e) => {
                debug!(pod = %pod.id(), error = %e, "scrape failed");
                return;
            }
        };
        match text {
            Ok(text) => pod.record_sample(started, parse_vllm_metrics(&text)),
            Err(e) => debug!(pod = %pod.id(), error = %e, "scrape body failed"),
        }
    }
}

/// Extracts the load signals from vLLM's Prometheus text. Several engines (DP ranks) add up;
/// KV usage is their mean. (prometheus-parse rejects the `vllm:` names, hence this parser.)
pub fn parse_vllm_metrics(text: &str) -> LoadSample {
    let mut s = LoadSample::default();
    let (mut kv_sum, mut kv_n) = (0.0, 0u32);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, labels, value)) = split_sample(line) else {
            continue;
        };
        match name {
            "vllm:num_requests_waiting" => s.waiting += value,
            "vllm:num_requests_running" => s.running += value,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                kv_sum += value;
                kv_n += 1;
            }
            "vllm:cache_config_info" => {
                if let Some(n) = label(labels, "num_gpu_blocks").and_then(|v| v.parse::<u64>().ok())
                {
                    s.num_gpu_blocks = Some(s.num_gpu_blocks.unwrap_or(0) + n);
                }
                if let Some(b) = label(labels, "block_size").and_then(|v| v.parse().ok()) {
                    s.block_size = Some(b);
                }
            }
            _ => {}
        }
    }
    if kv_n > 0 {
        s.kv_usage = (kv_sum / f64::from(kv_n)).clamp(0.0, 1.0);
    }
    s
}

fn split_sample(line: &str) -> Option<(&str, &str, f64)> {
    let (name, labels, rest) = match line.find('{') {
        Some(open) if line[..open].find(' ').is_none() => {
            let close = line.rfind('}')?;
            (&line[..open], &line[open + 1..close], &line[close + 1..])
        }
        _ => {
            let sp = line.find(char::is_whitespace)?;
            (&line[..sp], "", &line[sp..])
        }
    };
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    value.is_finite().then_some((name, labels, value))
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let k = rest[..eq].trim().trim_start_matches(',').trim();
        let after = rest[eq + 1..].strip_prefix('"')?;
        let mut end = None;
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = Some(i);
                    break;
                }
                _ => escaped = false,
            }
        }
        let end = end?;
        if k == key {
            return Some(&after[..end]);
        }
        rest = after[end + 1..].trim_start_matches(',');
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="2048",weird="a,b=\"c\""} 1.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
"#;

    #[test]
    fn parses_vllm_names_and_labels() {
        let s = parse_vllm_metrics(SAMPLE);
        assert_eq!(s.waiting, 5.0);
        assert_eq!(s.running, 7.0);
        assert_eq!(s.kv_usage, 0.375);
        assert_eq!(s.num_gpu_blocks, Some(2048));
        assert_eq!(s.block_size, Some(16));
    }

    #[test]
    fn garbage_metric_lines_are_ignored() {
        let s = parse_vllm_metrics(
            "vllm:num_requests_waiting{ 1\n{}}}\nvllm:num_requests_running NaN\n\u{0}\n",
        );
        assert_eq!(s, LoadSample::default());
    }

    #[test]
    fn label_lookup_handles_escapes() {
        assert_eq!(label(r#"a="1",b="x\"y",c="3""#, "c"), Some("3"));
        assert_eq!(label(r#"a="1""#, "z"), None);
    }
}
