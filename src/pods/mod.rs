//! Pods: identities, the current set (an immutable snapshot swapped atomically), per-pod live
//! state (health, scraped load, router in-flight accounting, engine) and the sources that list
//! pods.

mod accuracy;
mod engine;
mod exposition;
mod inflight;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
mod lora;
mod metrics;
mod prefill_watch;
mod probe;
mod role;
mod source;
mod ttft;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use ahash::AHashMap;
use arc_swap::ArcSwap;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::time::Instant;

pub use accuracy::{
    predicted_hit_tokens, AccuracyReport, HitAccuracy, HitWindow, PrefixCounters, WINDOWS,
};
pub use engine::{
    detect, parse_vllm_metrics, read, EngineChoice, EngineResolver, MetricMap, PodEngine, Reading,
    ENGINE_LABEL, MAX_GROUPS,
};
pub use inflight::{prefill_time, InflightGuard, Settling, Timestamp, MAX_PREFILL};
#[cfg(feature = "kubernetes")]
pub use kubernetes::KubernetesSource;
pub use lora::{
    adapter_base, fits as lora_fits, listed_adapters, mark_used as mark_adapter_used,
    read_lora_info, serving, LoraFit, LoraReport, LoraResidency, MAX_LORA_SERIES, MAX_POD_ADAPTERS,
};
pub use metrics::PodMetrics;
pub use prefill_watch::{PrefillVerdict, PrefillWatch};
pub(crate) use probe::Prober;
pub use role::{role_of, PodRole, ROLE_LABEL};
pub use source::{DnsSource, PodSource, PodSourceError, StaticSource};
pub use ttft::{fleet_models, TtftLearner, TtftModel, TtftPrior};

pub use crate::pod_id::PodId;

/// What a source says about a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSpec {
    /// Identity (`ip:port`).
    pub id: PodId,
    /// Socket address for probes.
    pub addr: SocketAddr,
    /// Configured model names; empty = learn from `/v1/models`.
    pub models: Vec<String>,
    /// Free-form labels.
    pub labels: BTreeMap<String, String>,
    /// KV-event PUB endpoint override (else the config template).
    pub kv_events_endpoint: Option<String>,
    /// KV-event replay endpoint override.
    pub kv_events_replay_endpoint: Option<String>,
}

/// One sample of a pod's `/metrics`, read through its engine's names ([`MetricMap`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LoadSample {
    /// Requests queued at the engine (`vllm:num_requests_waiting`, `sglang:num_queue_reqs`...).
    pub waiting: f64,
    /// Requests being processed (`vllm:num_requests_running`...).
    pub running: f64,
    /// KV-cache usage 0..1 (`vllm:kv_cache_usage_perc`...; 0 for engines without one).
    pub kv_usage: f64,
    /// `num_gpu_blocks` label of `vllm:cache_config_info`, when present.
    pub num_gpu_blocks: Option<u64>,
    /// `block_size` label of `vllm:cache_config_info`, when present.
    pub block_size: Option<u64>,
    /// Cumulative prefill timing, for engines that report it (the TTFT model learns from it).
    pub timing: Option<EngineTiming>,
    /// Cumulative prefix-cache counters, for engines that report them (prediction accuracy).
    pub prefix_cache: Option<PrefixCounters>,
    /// This router's own requests in flight on the pod when the scrape was sent (set by the
    /// prober, not read from the metrics): the rest of `waiting + running` came from elsewhere.
    pub sent_here: f64,
}

/// Cumulative prefill counters a pod's engine reports since it started, summed over its ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EngineTiming {
    /// Prompt tokens the engine computed: prompt tokens minus prefix-cache hits.
    pub prefill_tokens: f64,
    /// Requests whose prefill finished (`vllm:request_prefill_time_seconds_count`).
    pub prefills: f64,
    /// Seconds from scheduling to first token, summed (`vllm:request_prefill_time_seconds_sum`).
    pub prefill_seconds: f64,
    /// Requests that left the waiting queue (`vllm:request_queue_time_seconds_count`).
    pub queued: f64,
    /// Seconds spent waiting to be scheduled, summed (`vllm:request_queue_time_seconds_sum`).
    pub queue_seconds: f64,
}

/// A pod's load as the scorers see it (plain values, no clock).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PodLoad {
    /// Waiting requests at the pod (last scrape).
    pub waiting: f64,
    /// Running requests at the pod (last scrape).
    pub running: f64,
    /// KV-cache usage 0..1 (last scrape).
    pub kv_usage: f64,
    /// Requests this router sent that the pod's metrics may not show yet, or not finished.
    pub inflight_requests: f64,
    /// Uncached prompt tokens this router sent that are still being prefilled (estimate).
    pub inflight_tokens: f64,
    /// Requests in the last scrape that this router did not send (other replicas', clients that
    /// bypass it): its own in-flight count cannot stand for them.
    pub others: f64,
    /// Whether the scrape is recent enough to trust.
    pub fresh: bool,
}

impl PodLoad {
    /// Requests on the pod, each counted once: its scrape's, or this router's in-flight count
    /// plus the scrape's requests from elsewhere, whichever is larger (a request this router sent
    /// is in both once the pod runs it). Without `others`, replicas sharing a pod each hid their
    /// peers' scraped requests under their own newer ones and herded onto it.
    pub fn requests(&self) -> f64 {
        (self.waiting + self.running).max(self.inflight_requests + self.others)
    }

    /// The load at `now` from the last scrape (trusted while at most `stale_after` old) and the
    /// router's own in-flight counts.
    pub fn at<T: Timestamp>(
        now: T,
        sample: Option<(T, LoadSample)>,
        (inflight_requests, inflight_tokens): (u64, u64),
        stale_after: std::time::Duration,
    ) -> Self {
        let (fresh, s) = match sample {
            Some((at, s)) => (now.since(at) <= stale_after, s),
            None => (false, LoadSample::default()),
        };
        PodLoad {
            waiting: s.waiting,
            running: s.running,
            kv_usage: s.kv_usage,
            inflight_requests: inflight_requests as f64,
            inflight_tokens: inflight_tokens as f64,
            others: (s.waiting + s.running - s.sent_here).max(0.0),
            fresh,
        }
    }
}

/// A pod in the current set: its spec plus live state shared by probes, decisions and guards.
#[derive(Debug)]
pub struct Pod {
    /// What the source said.
    pub spec: PodSpec,
    healthy: AtomicBool,
    failures: AtomicU32,
    sample: Mutex<Option<(Instant, LoadSample)>>,
    learned_models: RwLock<Option<(Instant, Vec<String>)>>,
    pub(crate) inflight: inflight::Inflight,
    engine: PodEngine,
    ttft: Mutex<TtftLearner>,
    accuracy: Mutex<HitAccuracy>,
    lora: Mutex<lora::LoraState>,
    prefill: Mutex<PrefillWatch>,
}

impl Pod {
    /// A new pod, unhealthy until its first successful probe; its engine is detected (`auto`).
    pub fn new(spec: PodSpec) -> Self {
        Self::with_engine(spec, PodEngine::default())
    }

    /// A new pod whose load is read as `engine` says.
    pub fn with_engine(spec: PodSpec, engine: PodEngine) -> Self {
        Self {
            spec,
            healthy: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            sample: Mutex::new(None),
            learned_models: RwLock::new(None),
            inflight: inflight::Inflight::default(),
            engine,
            ttft: Mutex::new(TtftLearner::default()),
            accuracy: Mutex::new(HitAccuracy::default()),
            lora: Mutex::new(lora::LoraState::default()),
            prefill: Mutex::new(PrefillWatch::default()),
        }
    }

    /// Records a prefill of `prompt_tokens` this router sent the pod as prefill pod.
    pub fn prefill_sent(&self, now: Instant, prompt_tokens: u64) {
        self.prefill.lock().sent(now, prompt_tokens);
    }

    /// Whether the pod may take prefills at `now`: the prefills sent it are judged against its
    /// last scrape's prefix-cache lookups (see [`PrefillWatch`]).
    pub fn prefill_verdict(
        &self,
        now: Instant,
        unserved_after: std::time::Duration,
    ) -> PrefillVerdict {
        let sample = self
            .last_sample()
            .and_then(|(t, s)| s.prefix_cache.map(|c| (t, c.queries)));
        self.prefill.lock().check(now, sample, unserved_after)
    }

    /// Until when the pod is excluded from prefill picks, and how often it was.
    pub fn prefill_exclusion(&self, now: Instant) -> (Option<Instant>, u64) {
        let w = self.prefill.lock();
        (w.excluded_until(now), w.exclusions())
    }

    /// Whose metric names carry this pod's load, and what was detected.
    pub fn engine(&self) -> &PodEngine {
        &self.engine
    }

    /// Identity.
    pub fn id(&self) -> &PodId {
        &self.spec.id
    }

    /// Passed its last probes.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Records a probe result; unhealthy after `unhealthy_after` consecutive failures.
    pub fn record_probe(&self, ok: bool, unhealthy_after: u32) {
        if ok {
            self.failures.store(0, Ordering::Relaxed);
            self.healthy.store(true, Ordering::Relaxed);
        } else {
            let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
            if n >= unhealthy_after {
                self.healthy.store(false, Ordering::Relaxed);
            }
        }
    }

    /// Stores a scrape taken at `started` (the time the request was sent).
    pub fn record_sample(&self, started: Instant, sample: LoadSample) {
        *self.sample.lock() = Some((started, sample));
        self.inflight.observed_scrape(started);
        self.accuracy.lock().observe(sample.prefix_cache);
        if let Some(timing) = sample.timing {
            self.ttft
                .lock()
                .observe(timing, sample.waiting + sample.running == 0.0);
        }
    }

    /// A decision sent `prompt_tokens` here, predicting `hit_tokens` of them cached.
    pub fn predicted_hits(&self, hit_tokens: u64, prompt_tokens: u64) {
        self.accuracy.lock().predicted(hit_tokens, prompt_tokens);
    }

    /// Whether the pod's engine restarted (its prefix-cache counters went backwards) since the
    /// last call: its cache is empty.
    pub fn take_restart(&self) -> bool {
        self.accuracy.lock().take_restart()
    }

    /// Predicted against reported prefix-cache hits over the last scrape windows.
    pub fn hit_accuracy(&self) -> AccuracyReport {
        self.accuracy.lock().report()
    }

    /// Scrape windows closed since the last call (for the metric counters).
    pub fn take_hit_windows(&self) -> HitWindow {
        self.accuracy.lock().take_unexported()
    }

    /// What the pod's prefill model has learned so far (see [`fleet_models`]).
    pub fn ttft_learner(&self) -> TtftLearner {
        *self.ttft.lock()
    }

    /// Last scrape and its time.
    pub fn last_sample(&self) -> Option<(Instant, LoadSample)> {
        *self.sample.lock()
    }

    /// Models served: configured ones, else the last `/v1/models` answer.
    pub fn models(&self) -> Vec<String> {
        if !self.spec.models.is_empty() {
            return self.spec.models.clone();
        }
        self.learned_models
            .read()
            .as_ref()
            .map(|(_, m)| m.clone())
            .unwrap_or_default()
    }

    /// Whether the pod serves `model` (pods with no known models accept any).
    pub fn serves(&self, model: Option<&str>) -> bool {
        let Some(model) = model else { return true };
        if !self.spec.models.is_empty() {
            return self.spec.models.iter().any(|m| m == model);
        }
        match &*self.learned_models.read() {
            Some((_, models)) if !models.is_empty() => models.iter().any(|m| m == model),
            _ => true,
        }
    }

    /// When the models were last learned, if ever.
    pub fn models_learned_at(&self) -> Option<Instant> {
        self.learned_models.read().as_ref().map(|(t, _)| *t)
    }

    /// Stores models learned from `/v1/models`.
    pub fn set_learned_models(&self, at: Instant, models: Vec<String>) {
        *self.learned_models.write() = Some((at, models));
    }

    /// Whether `model` is among the pod's configured or learned models (no "unknown: any").
    pub fn lists_model(&self, model: &str) -> bool {
        if !self.spec.models.is_empty() {
            return self.spec.models.iter().any(|m| m == model);
        }
        self.learned_models
            .read()
            .as_ref()
            .is_some_and(|(_, models)| models.iter().any(|m| m == model))
    }

    /// Stores the adapters `/v1/models` listed (adapter → base model, see [`listed_adapters`]).
    pub fn set_learned_adapters(&self, adapters: BTreeMap<String, String>) {
        self.lora.lock().adapters = adapters;
    }

    /// Stores a `/v1/models` answer read at `at`, `(id, parent)` of each card: its models, its
    /// adapters (cards with a parent) and its base models (cards without one).
    pub fn set_learned_cards(&self, at: Instant, cards: Vec<(String, Option<String>)>) {
        let models = cards.iter().map(|(id, _)| id.clone()).collect();
        let bases = lora::listed_bases(&cards);
        {
            let mut l = self.lora.lock();
            l.adapters = listed_adapters(cards);
            l.bases = bases;
        }
        self.set_learned_models(at, models);
    }

    /// The base model the pod lists for adapter `name`.
    pub fn adapter_parent(&self, name: &str) -> Option<String> {
        self.lora.lock().adapters.get(name).cloned()
    }

    /// Whether the pod's `/v1/models` lists `name` as a base model (a card without a parent).
    pub fn serves_as_base(&self, name: &str) -> bool {
        self.lora.lock().bases.contains(name)
    }

    /// Stores the LoRA residency of a scrape taken at `at` (`None`: the scrape had none).
    pub fn record_lora(&self, at: Instant, report: Option<LoraResidency>) {
        self.lora.lock().record(at, report);
    }

    /// The last residency report and its scrape time.
    pub fn lora_residency(&self) -> Option<(Instant, Arc<LoraResidency>)> {
        self.lora.lock().residency.clone()
    }

    /// How the pod would take a request for `adapter` at `now` (a report older than
    /// `stale_after` counts as none).
    pub fn lora_fit(
        &self,
        adapter: &str,
        now: Instant,
        stale_after: std::time::Duration,
    ) -> LoraFit {
        let l = self.lora.lock();
        match &l.residency {
            Some((at, r)) if now.saturating_duration_since(*at) <= stale_after => {
                r.fit_with(adapter, &l.recent)
            }
            _ => LoraFit::Unreported,
        }
    }

    /// A request for `adapter` was routed here: the pod loads it if it has not.
    pub fn lora_routed(&self, adapter: &str) {
        self.lora.lock().used(adapter);
    }

    /// Adapter loads seen since the last call (for the counter).
    pub fn take_lora_loads(&self) -> u64 {
        std::mem::take(&mut self.lora.lock().unexported_loads)
    }

    /// What `/debug/pods` shows of the pod's adapters.
    pub fn lora_report(&self, now: Instant) -> LoraReport {
        let l = self.lora.lock();
        LoraReport {
            residency: l.residency.as_ref().map(|(_, r)| r.clone()),
            residency_age_ms: l
                .residency
                .as_ref()
                .map(|(t, _)| now.saturating_duration_since(*t).as_millis() as u64),
            adapters: l.adapters.clone(),
        }
    }

    /// Load as the scorers see it at `now`.
    pub fn load(&self, now: Instant, stale_after: std::time::Duration) -> PodLoad {
        let inflight = self.inflight.current(now, stale_after);
        PodLoad::at(now, self.last_sample(), inflight, stale_after)
    }

    /// Starts router-side accounting for one routed request.
    pub fn begin_request(
        self: &Arc<Self>,
        uncached_tokens: u64,
        now: Instant,
        prefill_tokens_per_sec: f64,
    ) -> InflightGuard {
        InflightGuard::new(self.clone(), uncached_tokens, now, prefill_tokens_per_sec)
    }

    /// Current in-flight counters (for gauges): requests, tokens.
    pub fn inflight_counts(&self) -> (i64, i64) {
        self.inflight.raw()
    }
}

/// An immutable snapshot of all pods.
#[derive(Debug, Default)]
pub struct PodSet {
    pods: Vec<Arc<Pod>>,
    by_id: AHashMap<PodId, usize>,
}

impl PodSet {
    /// Builds a set from pods (later duplicates of an id are dropped).
    pub fn new(pods: Vec<Arc<Pod>>) -> Self {
        let mut by_id = AHashMap::with_capacity(pods.len());
        let mut kept = Vec::with_capacity(pods.len());
        for pod in pods {
            if !by_id.contains_key(pod.id()) {
                by_id.insert(pod.id().clone(), kept.len());
                kept.push(pod);
            }
        }
        Self { pods: kept, by_id }
    }

    /// All pods.
    pub fn pods(&self) -> &[Arc<Pod>] {
        &self.pods
    }

    /// A pod by id.
    pub fn get(&self, id: &PodId) -> Option<&Arc<Pod>> {
        self.by_id.get(id).map(|&i| &self.pods[i])
    }
}

/// The current pod set, readable without locks.
#[derive(Debug)]
pub struct PodRegistry {
    set: ArcSwap<PodSet>,
    engines: EngineResolver,
    /// Bumped on every update, so followers (KV-event subscriptions) need not poll.
    generation: tokio::sync::watch::Sender<u64>,
}

impl Default for PodRegistry {
    fn default() -> Self {
        Self::with_engines(EngineResolver::default())
    }
}

impl PodRegistry {
    /// An empty registry whose pods get their engine from `engines` (default: all `auto`).
    pub fn with_engines(engines: EngineResolver) -> Self {
        Self {
            set: ArcSwap::default(),
            engines,
            generation: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Wakes on each update of the pod set after this call.
    pub fn watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Current snapshot.
    pub fn snapshot(&self) -> Arc<PodSet> {
        self.set.load_full()
    }

    /// Replaces the set with `specs`, keeping the live state of pods whose spec is unchanged.
    /// Returns the ids of pods that left.
    pub fn update(&self, specs: Vec<PodSpec>) -> Vec<PodId> {
        let old = self.snapshot();
        let mut pods = Vec::with_capacity(specs.len());
        for spec in specs {
            match old.get(&spec.id) {
                Some(existing) if existing.spec == spec => pods.push(existing.clone()),
                _ => {
                    let engine = self.engines.resolve(&spec);
                    pods.push(Arc::new(Pod::with_engine(spec, engine)))
                }
            }
        }
        let new = PodSet::new(pods);
        let gone = old
            .pods()
            .iter()
            .filter(|p| new.get(p.id()).is_none())
            .map(|p| p.id().clone())
            .collect();
        self.set.store(Arc::new(new));
        self.generation.send_modify(|g| *g += 1);
        gone
    }

    /// At least one pod is healthy.
    pub fn any_healthy(&self) -> bool {
        self.snapshot().pods().iter().any(|p| p.is_healthy())
    }
}

/// Each pod's prefill model as [`fleet_models`] fits it from the pods' learners.
pub fn prefill_models(pods: &[Arc<Pod>], prior: &TtftPrior) -> Vec<TtftModel> {
    let learners: Vec<_> = pods.iter().map(|p| p.ttft_learner()).collect();
    fleet_models(&learners, prior)
}

/// A plain pod spec at `addr` (an `ip:port`), for tests.
#[cfg(test)]
pub(crate) fn test_spec(addr: &str) -> PodSpec {
    PodSpec {
        id: PodId::new(addr),
        addr: addr.parse().unwrap(),
        models: vec![],
        labels: BTreeMap::new(),
        kv_events_endpoint: None,
        kv_events_replay_endpoint: None,
    }
}

#[cfg(test)]
mod tests {
    use super::test_spec as spec;
    use super::*;

    /// One router alone: its own in-flight count is the pod's load (its scrape shows nothing
    /// else). Beside peers or clients that bypass it, their scraped requests add to its own.
    #[test]
    fn requests_add_the_scrapes_others_to_this_routers_own() {
        let at = |running: f64, sent_here: f64, inflight: u64| {
            let sample = LoadSample {
                running,
                sent_here,
                ..LoadSample::default()
            };
            let stale = std::time::Duration::from_secs(1);
            let now = tokio::time::Instant::now();
            PodLoad::at(now, Some((now, sample)), (inflight, 0), stale).requests()
        };
        assert_eq!(at(3.0, 3.0, 4), 4.0, "alone: 3 scraped, 1 sent since");
        assert_eq!(
            at(3.0, 3.0, 1),
            3.0,
            "alone, 2 ended since: the scrape still counts them"
        );
        assert_eq!(at(3.0, 1.0, 2), 4.0, "2 of the 3 scraped were a peer's");
        assert_eq!(at(0.0, 2.0, 2), 2.0, "sent but not yet seen by the pod");
    }

    #[test]
    fn followers_wake_on_each_update() {
        let reg = PodRegistry::default();
        let mut w = reg.watch();
        assert!(!w.has_changed().unwrap());
        reg.update(vec![spec("127.0.0.1:1")]);
        assert!(w.has_changed().unwrap());
        w.mark_unchanged();
        reg.update(vec![]);
        assert!(w.has_changed().unwrap(), "a pod leaving wakes them too");
    }

    #[test]
    fn update_keeps_state_of_unchanged_pods() {
        let reg = PodRegistry::default();
        reg.update(vec![spec("127.0.0.1:1"), spec("127.0.0.1:2")]);
        reg.snapshot().pods()[0].record_probe(true, 1);
        let gone = reg.update(vec![spec("127.0.0.1:1"), spec("127.0.0.1:3")]);
        assert_eq!(gone, vec![PodId::new("127.0.0.1:2")]);
        let snap = reg.snapshot();
        assert!(snap.get(&PodId::new("127.0.0.1:1")).unwrap().is_healthy());
        assert!(!snap.get(&PodId::new("127.0.0.1:3")).unwrap().is_healthy());
    }

    #[test]
    fn unhealthy_after_consecutive_failures() {
        let pod = Pod::new(spec("127.0.0.1:1"));
        pod.record_probe(true, 2);
        pod.record_probe(false, 2);
        assert!(pod.is_healthy());
        pod.record_probe(false, 2);
        assert!(!pod.is_healthy());
        pod.record_probe(true, 2);
        assert!(pod.is_healthy());
    }

    #[test]
    fn a_pod_serves_its_configured_or_learned_models() {
        let mut s = spec("127.0.0.1:1");
        s.models = vec!["a".into()];
        let pod = Pod::new(s);
        assert!(pod.serves(Some("a")) && !pod.serves(Some("b")) && pod.serves(None));
        let learned = Pod::new(spec("127.0.0.1:2"));
        assert!(learned.serves(Some("b")), "unknown models: accept");
        learned.set_learned_models(Instant::now(), vec!["a".into()]);
        assert!(!learned.serves(Some("b")));
    }
}
