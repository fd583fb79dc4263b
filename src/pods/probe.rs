//! Probes: `/health` for liveness, `/metrics` for load, `/v1/models` for served models, and the
//! discovery loop that keeps the pod set current.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ahash::AHashMap;
use futures::FutureExt;
use tokio::time::{interval, Instant, Interval, MissedTickBehavior};
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
        sources: Arc<[Box<dyn PodSource>]>,
        refresh: Duration,
        on_gone: Arc<dyn Fn(Vec<PodId>) + Send + Sync>,
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
        self.each_pod_each_tick(
            tick,
            |_, _| true,
            |p, pod| async move { p.health_once(pod).await },
        )
        .await
    }

    /// Every tick, runs `probe` for every pod whose previous probe has finished, each in its own
    /// task: a pod that hangs until the probe timeout delays only its own rounds (one did delay
    /// every pod's), and a probe that panics costs that pod's round (counted as
    /// `kv_router_errors_total{kind="probe_panic"}`), never the others' or the loop.
    /// `due(pod, last probe started)` says whether a pod's turn has come this tick.
    async fn each_pod_each_tick<F, Fut>(
        &self,
        mut tick: Interval,
        due: impl Fn(&Pod, Option<Instant>) -> bool,
        probe: F,
    ) where
        F: Fn(Prober, Arc<Pod>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let mut busy: AHashMap<PodId, (Arc<AtomicBool>, Option<Instant>)> = AHashMap::new();
        loop {
            tick.tick().await;
            let set = self.registry.snapshot();
            busy.retain(|id, _| set.get(id).is_some());
            for pod in set.pods() {
                let (flag, last) = busy.entry(pod.id().clone()).or_default();
                if !due(pod, *last) || flag.swap(true, Ordering::AcqRel) {
                    continue;
                }
                *last = Some(Instant::now());
                let done = Finished(flag.clone());
                let (run, errors, id) = (
                    probe(self.clone(), pod.clone()),
                    self.errors.clone(),
                    pod.id().clone(),
                );
                tokio::spawn(async move {
                    let _done = done;
                    if AssertUnwindSafe(run).catch_unwind().await.is_err() {
                        warn!(pod = %id, "a probe of this pod panicked; the other pods are unaffected");
                        errors.inc(ErrorKind::ProbePanic);
                    }
                });
            }
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
                Ok(cards) => pod.set_learned_cards(Instant::now(), cards),
                Err(e) => debug!(pod = %pod.id(), error = %e, "reading /v1/models failed"),
            }
        }
    }

    /// `(id, parent)` of each model card; vLLM lists each LoRA adapter with its base as parent.
    async fn fetch_models(&self, pod: &Pod) -> Result<Vec<(String, Option<String>)>, ProbeError> {
        #[derive(serde::Deserialize)]
        struct Models {
            #[serde(default)]
            data: Vec<Model>,
        }
        #[derive(serde::Deserialize)]
        struct Model {
            id: Option<String>,
            #[serde(default)]
            parent: Option<String>,
        }
        let url = format!("http://{}/v1/models", pod.spec.addr);
        let resp = self.client.get(&url).send().await?.error_for_status()?;
        let body = read_capped(resp, self.cfg.max_response_bytes).await?;
        let models: Models = serde_json::from_slice(&body)?;
        Ok(models
            .data
            .into_iter()
            .filter_map(|m| Some((m.id?, m.parent)))
            .collect())
    }

    /// Scrapes `/metrics` of every pod forever.
    pub async fn run_scrape(self) {
        let mut tick = interval(Duration::from_millis(self.cfg.scrape_interval_ms));
        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        let idle_every = Duration::from_millis(self.cfg.idle_scrape_interval_ms);
        self.each_pod_each_tick(
            tick,
            move |pod, last| last.is_none_or(|t| t.elapsed() >= idle_every) || is_busy(pod),
            |p, pod| async move { p.scrape_once(pod).await },
        )
        .await
    }

    /// One scrape of one pod; a failure (an oversized body included) leaves the last sample to
    /// go stale.
    pub async fn scrape_once(&self, pod: Arc<Pod>) {
        let started = Instant::now();
        // This router's own requests in flight as the scrape is sent (`LoadSample::sent_here`).
        let sent_here = pod.inflight_counts().0.max(0) as f64;
        let url = format!("http://{}/metrics", pod.spec.addr);
        let body = match self.client.get(&url).send().await {
            Ok(r) if r.status().is_success() => read_capped(r, self.cfg.max_response_bytes).await,
            Ok(r) => {
                debug!(pod = %pod.id(), status = %r.status(), "scrape failed");
                return;
            }
            Err(e) => {
                debug!(pod = %pod.id(), error = %e, "scrape failed");
                return;
            }
        };
        match body {
            Ok(body) => {
                let text = String::from_utf8_lossy(&body);
                let sample = LoadSample {
                    sent_here,
                    ..pod.engine().read(pod.id(), &text)
                };
                pod.record_sample(started, sample);
                pod.record_lora(started, pod.engine().read_lora(&text));
            }
            Err(e) => debug!(pod = %pod.id(), error = %e, "scrape body failed"),
        }
    }
}

/// A pod whose load may be changing: this router counts requests on it (its own, or another
/// replica's it was told of), or it was running or queueing some at its last scrape. Without
/// the other replicas' charges, a pod idle at its last scrape waited the idle interval before
/// this replica saw the peers' requests on it, where one router sees its own at once.
fn is_busy(pod: &Pod) -> bool {
    let (requests, tokens) = pod.inflight_counts();
    requests > 0
        || tokens > 0
        || pod.inflight.settling()
        || pod
            .last_sample()
            .is_some_and(|(_, s)| s.running > 0.0 || s.waiting > 0.0)
}

/// Marks a pod's probe finished when dropped (panics included).
struct Finished(Arc<AtomicBool>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Why a pod's answer was not used.
#[derive(Debug, thiserror::Error)]
enum ProbeError {
    #[error(transparent)]
    Http(#[from] reqwest::Error),
    #[error("response body over {0} bytes")]
    TooLarge(usize),
    #[error("invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Reads a pod's response body, giving up past `cap` bytes (a pod cannot grow our memory).
async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Result<Vec<u8>, ProbeError> {
    if resp.content_length().is_some_and(|n| n > cap as u64) {
        return Err(ProbeError::TooLarge(cap));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        if body.len() + chunk.len() > cap {
            return Err(ProbeError::TooLarge(cap));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::super::exposition::label;
    use super::super::{parse_vllm_metrics, LoadSample};
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

    #[tokio::test(start_paused = true)]
    async fn a_pod_loaded_only_by_other_replicas_is_scraped_at_the_busy_rate() {
        let pod = Pod::new(super::super::test_spec("127.0.0.1:1"));
        let t0 = Instant::now();
        pod.record_sample(t0, LoadSample::default());
        assert!(!is_busy(&pod), "idle at its last scrape, nothing sent");
        // Another replica sent it a request after that scrape: busy, as our own would make it.
        pod.charge_remote(t0 + Duration::from_millis(5), 0, Duration::ZERO, None);
        assert!(is_busy(&pod));
        // A scrape started after it shows the pod's own numbers (idle again here).
        pod.record_sample(t0 + Duration::from_millis(10), LoadSample::default());
        assert!(!is_busy(&pod));
        // Held tokens keep it busy until they stop counting.
        let hold = crate::share::Hold { origin: 1, seq: 1 };
        pod.charge_remote(
            t0 + Duration::from_millis(20),
            500,
            Duration::from_secs(1),
            Some(hold),
        );
        pod.record_sample(t0 + Duration::from_millis(30), LoadSample::default());
        assert!(is_busy(&pod));
        pod.release_remote(hold, crate::share::Release::Started);
        assert!(!is_busy(&pod));
    }

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
    fn gpu_blocks_of_several_engines_saturate_instead_of_wrapping() {
        // fuzz/artifacts/prometheus/minimized-from-95e2…, doubled by the target (two engines):
        // the sum overflowed, a panic in debug builds and a wrapped, tiny capacity in release.
        let line = "vllm:cache_config_info{num_gpu_blocks=\"16841123001817868970\"} 1\n";
        assert_eq!(
            parse_vllm_metrics(&line.repeat(2)).num_gpu_blocks,
            Some(u64::MAX)
        );
    }

    #[test]
    fn garbage_metric_lines_are_ignored() {
        let s = parse_vllm_metrics(
            "vllm:num_requests_waiting{ 1\n{}}}\nvllm:num_requests_running NaN\n\u{0}\n",
        );
        assert_eq!(s, LoadSample::default());
    }

    #[test]
    fn a_closing_brace_before_the_opening_one_is_ignored_not_a_panic() {
        let s = parse_vllm_metrics(
            "x}{ 1\nvllm:num_requests_waiting}{ 2\nvllm:num_requests_running 4\n",
        );
        assert_eq!(s.running, 4.0);
        assert_eq!(s.waiting, 0.0);
    }

    /// Serves `/metrics` with `body` on a random 127.0.0.1 port.
    async fn metrics_server(body: String) -> std::net::SocketAddr {
        let app =
            axum::Router::new().route("/metrics", axum::routing::get(move || async move { body }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    fn pods(addrs: &[std::net::SocketAddr]) -> Arc<PodRegistry> {
        let registry = Arc::new(PodRegistry::default());
        registry.update(
            addrs
                .iter()
                .map(|a| PodSpec {
                    id: PodId::from(*a),
                    addr: *a,
                    models: vec!["m".into()],
                    labels: Default::default(),
                    kv_events_endpoint: None,
                    kv_events_replay_endpoint: None,
                })
                .collect(),
        );
        registry
    }

    fn prober(registry: &Arc<PodRegistry>, max_response_bytes: usize) -> Prober {
        let cfg = PodsConfig {
            scrape_interval_ms: 20,
            max_response_bytes,
            ..PodsConfig::default()
        };
        Prober::new(cfg, registry.clone(), Errors::default())
    }

    /// Waits until `pod` has a sample whose scrape started after `after` (any sample with
    /// `None`) and returns that start, or fails with `what` after 5 s.
    async fn wait_sample(pod: &Pod, after: Option<Instant>, what: &str) -> Instant {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some((t, _)) = pod.last_sample() {
                if after.is_none_or(|a| t > a) {
                    return t;
                }
            }
            assert!(Instant::now() < deadline, "{what} (waited 5 s)");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn a_hostile_pod_cannot_stop_the_scrape_of_the_others() {
        let bad = metrics_server("x}{ 1\n".into()).await;
        let good = metrics_server("vllm:num_requests_waiting 3\n".into()).await;
        let registry = pods(&[bad, good]);
        let task = tokio::spawn(prober(&registry, 1 << 20).run_scrape());
        let good_pod = registry.snapshot().get(&PodId::from(good)).unwrap().clone();
        let bad_pod = registry.snapshot().get(&PodId::from(bad)).unwrap().clone();
        // The hostile answer was read (as an empty sample): its scrape is over.
        wait_sample(&bad_pod, None, "the hostile pod was never scraped").await;
        // A round that started after it: the loop must still be alive.
        let after_bad = Instant::now();
        wait_sample(
            &good_pod,
            Some(after_bad),
            "no scrape after the hostile one",
        )
        .await;
        assert!(!task.is_finished(), "the scrape loop died");
        let first = good_pod.last_sample().expect("the good pod was scraped").0;
        wait_sample(&good_pod, Some(first), "scrapes continue").await;
        assert!(
            good_pod.last_sample().unwrap().0 > first,
            "scrapes continue"
        );
        assert_eq!(good_pod.last_sample().unwrap().1.waiting, 3.0);
        task.abort();
    }

    /// One pod whose `/metrics` never answers once held every pod's scrape round until the probe
    /// timeout: the healthy pod's sample aged to the timeout instead of the interval.
    #[tokio::test]
    async fn a_hanging_pod_does_not_slow_the_scrape_of_the_others() {
        let hang = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let hang_addr = hang.local_addr().unwrap();
        let _accepted = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = hang.accept().await {
                held.push(conn);
            }
        });
        let good = metrics_server("vllm:num_requests_waiting 3\n".into()).await;
        let registry = pods(&[hang_addr, good]);
        let cfg = PodsConfig {
            scrape_interval_ms: 20,
            probe_timeout_ms: 2_000,
            ..PodsConfig::default()
        };
        let task = tokio::spawn(Prober::new(cfg, registry.clone(), Errors::default()).run_scrape());
        let good_pod = registry.snapshot().get(&PodId::from(good)).unwrap().clone();
        // From the healthy pod's first sample (its age is undefined before), watch it for
        // 1.2 s, a window shorter than the hanging pod's probe timeout (not synchronization:
        // the window is the measurement).
        wait_sample(&good_pod, None, "the healthy pod was never scraped").await;
        let mut oldest = Duration::ZERO;
        let end = Instant::now() + Duration::from_millis(1_200);
        while Instant::now() < end {
            let age = good_pod
                .last_sample()
                .map_or(Duration::MAX, |(t, _)| t.elapsed());
            oldest = oldest.max(age);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
        assert!(
            oldest < Duration::from_millis(400),
            "healthy pod's sample aged {oldest:?}"
        );
    }

    /// Serves `/metrics` with `body`, counting the scrapes.
    async fn counting_metrics_server(
        body: &'static str,
    ) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let h = hits.clone();
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                h.fetch_add(1, Ordering::Relaxed);
                async move { body }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (addr, hits)
    }

    #[tokio::test]
    async fn idle_pods_are_scraped_at_the_idle_interval_busy_ones_at_the_fast_one() {
        let (idle, idle_hits) = counting_metrics_server("vllm:num_requests_running 0\n").await;
        let (busy, busy_hits) = counting_metrics_server("vllm:num_requests_running 2\n").await;
        let (mine, mine_hits) = counting_metrics_server("vllm:num_requests_running 0\n").await;
        let registry = pods(&[idle, busy, mine]);
        let own = registry.snapshot().get(&PodId::from(mine)).unwrap().clone();
        // A request of this router's own on a pod that reported nothing running.
        let _guard = own.begin_request(100, Instant::now(), 1e6);
        let cfg = PodsConfig {
            scrape_interval_ms: 20,
            idle_scrape_interval_ms: 400,
            ..PodsConfig::default()
        };
        let task = tokio::spawn(Prober::new(cfg, registry.clone(), Errors::default()).run_scrape());
        // Not synchronization: scrapes are counted over this 1 s window (rates are under test).
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        task.abort();
        let (i, b, m) = (
            idle_hits.load(Ordering::Relaxed),
            busy_hits.load(Ordering::Relaxed),
            mine_hits.load(Ordering::Relaxed),
        );
        assert!((2..=4).contains(&i), "idle pod scraped {i} times in 1 s");
        assert!(b >= 20, "busy pod scraped {b} times in 1 s");
        assert!(
            m >= 20,
            "pod with this router's request scraped {m} times in 1 s"
        );
    }

    /// Replicas sharing a pod: the scrape shows the peers' requests beside this router's own, and
    /// a request this router sends after it must add to them, not hide under them.
    #[tokio::test]
    async fn a_scrape_counts_the_requests_this_router_did_not_send_beside_its_new_ones() {
        let addr = metrics_server("vllm:num_requests_running 3\n".to_string()).await;
        let registry = pods(&[addr]);
        let pod = registry.snapshot().pods()[0].clone();
        let _mine = pod.begin_request(100, Instant::now(), 1e6);
        prober(&registry, 1 << 20).scrape_once(pod.clone()).await;
        let (_, sample) = pod.last_sample().unwrap();
        assert_eq!(
            sample.sent_here, 1.0,
            "one of the 3 running was this router's"
        );
        let _newer = pod.begin_request(100, Instant::now(), 1e6);
        let load = pod.load(Instant::now(), Duration::from_secs(5));
        assert_eq!(load.others, 2.0);
        assert_eq!(load.requests(), 4.0, "3 scraped + 1 sent since: {load:?}");
    }

    #[tokio::test]
    async fn an_oversized_metrics_body_fails_the_scrape() {
        let mut big = "vllm:num_requests_waiting 3\n".to_string();
        big.push_str(&"# padding\n".repeat(20_000));
        let addr = metrics_server(big).await;
        let registry = pods(&[addr]);
        let pod = registry.snapshot().pods()[0].clone();
        prober(&registry, 64 << 10).scrape_once(pod.clone()).await;
        assert!(
            pod.last_sample().is_none(),
            "a 200 KB body over a 64 KiB cap is not used"
        );
        prober(&registry, 1 << 20).scrape_once(pod.clone()).await;
        assert_eq!(pod.last_sample().unwrap().1.waiting, 3.0);
    }

    #[test]
    fn label_lookup_handles_escapes() {
        assert_eq!(label(r#"a="1",b="x\"y",c="3""#, "c"), Some("3"));
        assert_eq!(label(r#"a="1""#, "z"), None);
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
            #[test]
            fn any_metrics_text_parses_without_panic(
                lines in prop::collection::vec(
                    prop_oneof![
                        "[a-z:_{}=\", .0-9#\\-]{0,60}",
                        any::<String>(),
                        Just("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"99999999999999999999\"} 1".to_string()),
                        Just("vllm:kv_cache_usage_perc 1e308".to_string()),
                    ],
                    0..20,
                )
            ) {
                let s = parse_vllm_metrics(&lines.join("\n"));
                prop_assert!((0.0..=1.0).contains(&s.kv_usage));
                prop_assert!(s.waiting.is_finite() || s.waiting.is_infinite());
            }
        }
    }
}
