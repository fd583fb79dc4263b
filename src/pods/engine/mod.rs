//! Engines: which `/metrics` names carry a pod's load. vLLM, SGLang, llama.cpp's server and TGI
//! each name their queue, batch and KV-cache gauges differently; a [`MetricMap`] says which names
//! to read, [`read`] reads a scrape through one, [`detect`] recognises an engine by its names, and
//! [`PodEngine`] holds what a pod's config said and what was detected.
//!
//! Bounded like the parser it replaces: one pass over a body already capped at
//! `pods.max_response_bytes`, borrowing from it; the only table (rank groups) has
//! [`MAX_GROUPS`] entries at most.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock};

use ahash::AHashMap;
use parking_lot::Mutex;
use tracing::{debug, info, warn};

use super::exposition::{label, split_sample};
use super::{EngineTiming, LoadSample, PodId, PodSpec, PrefixCounters};
use crate::config::{CustomEngine, EngineSetting, PodsConfig, Preset};

/// Pod label (or, on Kubernetes, annotation) naming a pod's engine; overrides the config.
pub const ENGINE_LABEL: &str = "kv-router.io/engine";

/// Most rank groups (`group_by` values) one scrape may have; samples of further groups are
/// ignored, so a hostile pod cannot grow the table.
pub const MAX_GROUPS: usize = 64;

/// Unrecognised scrapes of an `auto` pod before a warning (an engine still starting may not
/// expose its own metrics yet).
const WARN_UNKNOWN_AFTER: u32 = 10;

/// The metric names one engine reports its load under.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricMap {
    waiting: Vec<Cow<'static, str>>,
    running: Vec<Cow<'static, str>>,
    kv_usage: Vec<Cow<'static, str>>,
    kv_scale: f64,
    kv_used: Option<Cow<'static, str>>,
    kv_total: Option<Cow<'static, str>>,
    group_by: Option<Cow<'static, str>>,
    /// vLLM's `cache_config_info` (`num_gpu_blocks`, `block_size` labels).
    cache_info: Option<&'static str>,
    /// Names of the cumulative prefill counters ([`EngineTiming`]), vLLM only.
    timing: Option<&'static [(&'static str, Field)]>,
    /// Info gauge of LoRA adapter residency (`super::lora`), vLLM's labels.
    lora_info: Option<Cow<'static, str>>,
}

/// vLLM's prefill counters: `vllm/v1/metrics/loggers.py` (`PrometheusStatLogger`). The
/// `gpu_` spelling is the older name of the prefix-cache counter (read only without the new one).
/// SGLang would need `sglang:prompt_tokens_total`, `sglang:cached_tokens_total` and a
/// scheduled-to-first-token histogram; llama.cpp has `llamacpp:prompt_tokens_total` and
/// `llamacpp:prompt_seconds_total` but no request count: both read `None`.
const VLLM_TIMING: [(&str, Field); 9] = [
    ("vllm:prompt_tokens_total", Field::PromptTokens),
    ("vllm:prefix_cache_hits_total", Field::Hits),
    ("vllm:gpu_prefix_cache_hits_total", Field::HitsOld),
    ("vllm:prefix_cache_queries_total", Field::Queries),
    ("vllm:gpu_prefix_cache_queries_total", Field::QueriesOld),
    ("vllm:request_prefill_time_seconds_sum", Field::PrefillSum),
    (
        "vllm:request_prefill_time_seconds_count",
        Field::PrefillCount,
    ),
    ("vllm:request_queue_time_seconds_sum", Field::QueueSum),
    ("vllm:request_queue_time_seconds_count", Field::QueueCount),
];

fn names(n: &[&'static str]) -> Vec<Cow<'static, str>> {
    n.iter().map(|s| Cow::Borrowed(*s)).collect()
}

// Names from each engine's source; tests/fixtures/engine-metrics/README.md says where.
static PRESETS: LazyLock<[MetricMap; 4]> = LazyLock::new(|| {
    let base = MetricMap {
        waiting: Vec::new(),
        running: Vec::new(),
        kv_usage: Vec::new(),
        kv_scale: 1.0,
        kv_used: None,
        kv_total: None,
        group_by: None,
        cache_info: None,
        timing: None,
        lora_info: None,
    };
    [
        MetricMap {
            waiting: names(&["vllm:num_requests_waiting"]),
            running: names(&["vllm:num_requests_running"]),
            // `gpu_cache_usage_perc` is the pre-V1 name; some versions report both, equal.
            kv_usage: names(&["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]),
            cache_info: Some("vllm:cache_config_info"),
            timing: Some(&VLLM_TIMING),
            // `vllm/v1/metrics/loggers.py`: one series per label set, valued with the time set.
            lora_info: Some(Cow::Borrowed("vllm:lora_requests_info")),
            ..base.clone()
        },
        MetricMap {
            waiting: names(&["sglang:num_queue_reqs"]),
            running: names(&["sglang:num_running_reqs"]),
            kv_usage: names(&["sglang:token_usage"]),
            // Every tensor-parallel rank's scheduler reports the same queue; data-parallel
            // ranks (`dp_rank`) each have their own.
            group_by: Some(Cow::Borrowed("dp_rank")),
            ..base.clone()
        },
        MetricMap {
            waiting: names(&["llamacpp:requests_deferred"]),
            running: names(&["llamacpp:requests_processing"]),
            // Only builds before mid-2025 report it; newer ones have no KV gauge.
            kv_usage: names(&["llamacpp:kv_cache_usage_ratio"]),
            ..base.clone()
        },
        MetricMap {
            waiting: names(&["tgi_queue_size"]),
            running: names(&["tgi_batch_current_size"]),
            // Tokens the running batch may fill over the batch token budget: KV reserved, the
            // closest TGI has to a usage gauge.
            kv_used: Some(Cow::Borrowed("tgi_batch_current_max_tokens")),
            kv_total: Some(Cow::Borrowed("tgi_batch_max_total_tokens")),
            ..base
        },
    ]
});

impl MetricMap {
    /// A preset's names.
    pub fn preset(p: Preset) -> &'static MetricMap {
        let i = Preset::ALL
            .iter()
            .position(|x| *x == p)
            .expect("every preset");
        &PRESETS[i]
    }

    /// A config's custom names.
    pub fn custom(c: &CustomEngine) -> Self {
        let own = |n: &Option<String>| n.clone().map(Cow::Owned);
        MetricMap {
            waiting: own(&c.waiting).into_iter().collect(),
            running: own(&c.running).into_iter().collect(),
            kv_usage: own(&c.kv_usage).into_iter().collect(),
            kv_scale: c.kv_usage_scale,
            kv_used: own(&c.kv_used),
            kv_total: own(&c.kv_total),
            group_by: own(&c.group_by),
            cache_info: None,
            timing: None,
            lora_info: own(&c.lora_info),
        }
    }

    fn field(&self, name: &str) -> Option<Field> {
        let is = |v: &[Cow<'static, str>]| v.iter().any(|n| n == name);
        if is(&self.waiting) {
            Some(Field::Waiting)
        } else if is(&self.running) {
            Some(Field::Running)
        } else if is(&self.kv_usage) {
            Some(Field::Kv)
        } else if self.kv_used.as_deref() == Some(name) {
            Some(Field::Used)
        } else if self.kv_total.as_deref() == Some(name) {
            Some(Field::Total)
        } else {
            let timing = self.timing?;
            timing.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Waiting,
    Running,
    Kv,
    Used,
    Total,
    // Cumulative prefill counters (from here on: see `is_timing`).
    PromptTokens,
    Hits,
    HitsOld,
    PrefillSum,
    PrefillCount,
    QueueSum,
    QueueCount,
    Queries,
    QueriesOld,
}

const FIELDS: [Field; 14] = [
    Field::Waiting,
    Field::Running,
    Field::Kv,
    Field::Used,
    Field::Total,
    Field::PromptTokens,
    Field::Hits,
    Field::HitsOld,
    Field::PrefillSum,
    Field::PrefillCount,
    Field::QueueSum,
    Field::QueueCount,
    Field::Queries,
    Field::QueriesOld,
];

impl Field {
    fn is_timing(self) -> bool {
        self as usize >= Field::PromptTokens as usize
    }
}

/// One rank group's values (the maximum of its samples per field).
#[derive(Debug, Default, Clone, Copy)]
struct Vals([Option<f64>; FIELDS.len()]);

impl Vals {
    fn max(&mut self, f: Field, v: f64) {
        let slot = &mut self.0[f as usize];
        *slot = Some(slot.map_or(v, |old| old.max(v)));
    }
}

/// Running totals over samples (or groups): waiting and running add up, KV usage is a mean,
/// the prefill counters add up (`None` until a sample of theirs is seen).
#[derive(Debug, Default)]
struct Totals {
    waiting: f64,
    running: f64,
    kv_sum: f64,
    kv_n: u32,
    used: f64,
    total: f64,
    timing: [Option<f64>; FIELDS.len() - Field::PromptTokens as usize],
}

impl Totals {
    fn add(&mut self, f: Field, v: f64) {
        match f {
            Field::Waiting => self.waiting += v,
            Field::Running => self.running += v,
            Field::Kv => {
                self.kv_sum += v;
                self.kv_n = self.kv_n.saturating_add(1);
            }
            Field::Used => self.used += v,
            Field::Total => self.total += v,
            f => {
                let slot = &mut self.timing[f as usize - Field::PromptTokens as usize];
                *slot = Some(slot.unwrap_or(0.0) + v);
            }
        }
    }

    fn get(&self, f: Field) -> Option<f64> {
        self.timing[f as usize - Field::PromptTokens as usize]
    }

    /// The prefix-cache counters (hits and queries, new names else old), when both were seen and
    /// are finite.
    fn prefix_counters(&self) -> Option<PrefixCounters> {
        let hits = self.get(Field::Hits).or(self.get(Field::HitsOld))?;
        let queries = self.get(Field::Queries).or(self.get(Field::QueriesOld))?;
        (hits.is_finite() && queries.is_finite()).then_some(PrefixCounters { queries, hits })
    }

    /// The prefill counters, when the prompt-token counter and the prefill-time histogram's
    /// `_sum` and `_count` were all seen and every one is finite.
    fn engine_timing(&self) -> Option<EngineTiming> {
        // Sums of huge values may overflow to ∞.
        if self.timing.iter().flatten().any(|v| !v.is_finite()) {
            return None;
        }
        let hits = self.get(Field::Hits).or(self.get(Field::HitsOld));
        Some(EngineTiming {
            prefill_tokens: (self.get(Field::PromptTokens)? - hits.unwrap_or(0.0)).max(0.0),
            prefills: self.get(Field::PrefillCount)?,
            prefill_seconds: self.get(Field::PrefillSum)?,
            queued: self.get(Field::QueueCount).unwrap_or(0.0),
            queue_seconds: self.get(Field::QueueSum).unwrap_or(0.0),
        })
    }
}

/// What one scrape said through one mapping.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    /// The load signals.
    pub sample: LoadSample,
    /// Whether any sample carried one of the mapping's names.
    pub matched: bool,
}

/// Reads the load signals of a Prometheus text through `map`. Samples of a name add up
/// (data-parallel engines); KV usage is their mean, scaled and clamped to 0..1. With
/// `group_by`, samples sharing that label's value count once (their maximum). The prefill
/// counters (vLLM) read as `None` when absent or when any of their samples is negative or not
/// finite: a pod's nonsense must not reach the TTFT model.
pub fn read(text: &str, map: &MetricMap) -> Reading {
    let mut s = LoadSample::default();
    let mut t = Totals::default();
    let mut groups: Vec<(&str, Vals)> = Vec::new();
    let mut matched = false;
    let mut bad_timing = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, labels, value)) = split_sample(line) else {
            continue;
        };
        if !value.is_finite() || value < 0.0 {
            if map.field(name).is_some_and(Field::is_timing) {
                bad_timing = true;
                continue;
            }
            if !value.is_finite() {
                continue;
            }
        }
        if map.cache_info == Some(name) {
            matched = true;
            if let Some(n) = label(labels, "num_gpu_blocks").and_then(|v| v.parse::<u64>().ok()) {
                // Saturating: a pod's numbers must not wrap (fuzz/artifacts/prometheus).
                s.num_gpu_blocks = Some(s.num_gpu_blocks.unwrap_or(0).saturating_add(n));
            }
            if let Some(b) = label(labels, "block_size").and_then(|v| v.parse().ok()) {
                s.block_size = Some(b);
            }
            continue;
        }
        let Some(field) = map.field(name) else {
            continue;
        };
        matched = true;
        let Some(key) = map.group_by.as_deref() else {
            t.add(field, value);
            continue;
        };
        let group = label(labels, key).unwrap_or("");
        if let Some((_, vals)) = groups.iter_mut().find(|(g, _)| *g == group) {
            vals.max(field, value);
        } else if groups.len() < MAX_GROUPS {
            let mut vals = Vals::default();
            vals.max(field, value);
            groups.push((group, vals));
        }
    }
    for (_, vals) in &groups {
        for (f, v) in FIELDS.into_iter().zip(vals.0) {
            if let Some(v) = v {
                t.add(f, v);
            }
        }
    }
    s.timing = t.engine_timing().filter(|_| !bad_timing);
    s.prefix_cache = t.prefix_counters().filter(|_| !bad_timing);
    s.waiting = t.waiting;
    s.running = t.running;
    let kv = if t.kv_n > 0 {
        t.kv_sum / f64::from(t.kv_n) * map.kv_scale
    } else if t.total > 0.0 {
        t.used / t.total
    } else {
        0.0
    };
    // NaN (∞/∞ from absurd values) reads as no usage rather than poisoning the scores.
    s.kv_usage = if kv.is_nan() { 0.0 } else { kv.clamp(0.0, 1.0) };
    Reading { sample: s, matched }
}

/// The preset whose metric-name prefix (`vllm:`, `sglang:`, `llamacpp:`, `tgi_`) most samples
/// and `# HELP`/`# TYPE` lines carry; `None` when no line does. Comment lines count because an
/// idle engine may list its gauges before it has a sample of them.
pub fn detect(text: &str) -> Option<Preset> {
    const PREFIXES: [(&str, Preset); 4] = [
        ("vllm:", Preset::Vllm),
        ("sglang:", Preset::Sglang),
        ("llamacpp:", Preset::Llamacpp),
        ("tgi_", Preset::Tgi),
    ];
    let mut counts = [0u32; 4];
    for line in text.lines() {
        let line = line.trim_start();
        let name = match line.strip_prefix('#') {
            Some(rest) => {
                let rest = rest.trim_start();
                match rest
                    .strip_prefix("TYPE ")
                    .or_else(|| rest.strip_prefix("HELP "))
                {
                    Some(r) => r.trim_start(),
                    None => continue,
                }
            }
            None => line,
        };
        if let Some(i) = PREFIXES.iter().position(|(p, _)| name.starts_with(p)) {
            counts[i] = counts[i].saturating_add(1);
        }
    }
    let best = (0..4).rev().max_by_key(|&i| counts[i])?;
    (counts[best] > 0).then_some(PREFIXES[best].1)
}

/// A pod's configured engine, ready to read with.
#[derive(Debug, Clone, Default)]
pub enum EngineChoice {
    /// Detect from the scrapes.
    #[default]
    Auto,
    /// A preset.
    Preset(Preset),
    /// Custom names.
    Custom(Arc<MetricMap>),
}

impl From<&EngineSetting> for EngineChoice {
    fn from(s: &EngineSetting) -> Self {
        match s {
            EngineSetting::Auto => EngineChoice::Auto,
            EngineSetting::Preset(p) => EngineChoice::Preset(*p),
            EngineSetting::Custom(c) => EngineChoice::Custom(Arc::new(MetricMap::custom(c))),
        }
    }
}

/// A pod's engine: the setting that applies to it, where that came from, and (for `auto`)
/// what its scrapes showed.
#[derive(Debug, Default)]
pub struct PodEngine {
    choice: EngineChoice,
    from: &'static str,
    detected: Mutex<Option<Preset>>,
    unknown_scrapes: AtomicU32,
}

impl PodEngine {
    /// A pod's engine as configured (`from` names the config key or label that said so).
    pub fn new(choice: EngineChoice, from: &'static str) -> Self {
        Self {
            choice,
            from,
            ..Self::default()
        }
    }

    /// The setting: `auto`, a preset's name or `custom`.
    pub fn setting(&self) -> &'static str {
        match &self.choice {
            EngineChoice::Auto => "auto",
            EngineChoice::Preset(p) => p.as_str(),
            EngineChoice::Custom(_) => "custom",
        }
    }

    /// Where the setting came from: `label`, `dns`, `kubernetes` or `pods.engine`.
    pub fn setting_from(&self) -> &'static str {
        if self.from.is_empty() {
            "pods.engine"
        } else {
            self.from
        }
    }

    /// The engine load is read as: the setting, or what `auto` detected, else `unknown`.
    pub fn current(&self) -> &'static str {
        match &self.choice {
            EngineChoice::Auto => self.detected.lock().map_or("unknown", Preset::as_str),
            EngineChoice::Preset(p) => p.as_str(),
            EngineChoice::Custom(_) => "custom",
        }
    }

    /// The LoRA residency of one scrape, through the engine [`Self::read`] settled on (call it
    /// after `read`); `None` for engines without a residency gauge or scrapes without one.
    pub fn read_lora(&self, text: &str) -> Option<super::lora::LoraResidency> {
        let name = match &self.choice {
            EngineChoice::Preset(p) => MetricMap::preset(*p).lora_info.clone(),
            EngineChoice::Custom(m) => m.lora_info.clone(),
            EngineChoice::Auto => {
                let kept = *self.detected.lock();
                kept.and_then(|p| MetricMap::preset(p).lora_info.clone())
            }
        }?;
        super::lora::read_lora_info(text, &name)
    }

    /// The load signals of one scrape of `pod`. `auto` detects the engine on the first scrape
    /// that shows one and keeps it; it looks again only when a scrape has none of the kept
    /// engine's names (another engine now answers at that address).
    pub fn read(&self, pod: &PodId, text: &str) -> LoadSample {
        let kept = match &self.choice {
            EngineChoice::Preset(p) => return read(text, MetricMap::preset(*p)).sample,
            EngineChoice::Custom(m) => return read(text, m).sample,
            EngineChoice::Auto => *self.detected.lock(),
        };
        let first = kept.map(|p| read(text, MetricMap::preset(p)));
        if let Some(r) = first.filter(|r| r.matched) {
            return r.sample;
        }
        match detect(text) {
            Some(p) if Some(p) != kept => {
                info!(pod = %pod, engine = %p, "engine detected from /metrics");
                *self.detected.lock() = Some(p);
                self.unknown_scrapes.store(0, Ordering::Relaxed);
                read(text, MetricMap::preset(p)).sample
            }
            Some(_) => first.map(|r| r.sample).unwrap_or_default(),
            None => {
                let n = self.unknown_scrapes.fetch_add(1, Ordering::Relaxed) + 1;
                if kept.is_none() && n == WARN_UNKNOWN_AFTER {
                    warn!(pod = %pod, "no known engine's metric names in /metrics; its load reads as zero (set pods.engine or the pod's kv-router.io/engine label)");
                } else {
                    debug!(pod = %pod, "no known engine's metric names in this scrape");
                }
                first.map(|r| r.sample).unwrap_or_default()
            }
        }
    }
}

/// Which engine setting applies to a pod: its `kv-router.io/engine` label (static pods set it in
/// `labels`), else its source's `engine` (its DNS entry's, `pods.kubernetes.engine`), else
/// `pods.engine`.
#[derive(Debug, Clone, Default)]
pub struct EngineResolver {
    default: EngineChoice,
    dns: AHashMap<String, EngineChoice>,
    kubernetes: Option<EngineChoice>,
}

impl EngineResolver {
    /// From the pods config (validated).
    pub fn new(cfg: &PodsConfig) -> Self {
        let mut r = EngineResolver {
            default: EngineChoice::from(&cfg.engine),
            kubernetes: cfg
                .kubernetes
                .as_ref()
                .and_then(|k| k.engine.as_ref())
                .map(EngineChoice::from),
            ..Default::default()
        };
        for d in &cfg.dns {
            if let Some(e) = &d.engine {
                // The DNS source labels its pods `source: dns:<name>`; a name listed twice
                // takes its first entry's engine.
                let key = format!("dns:{}", d.name);
                r.dns.entry(key).or_insert_with(|| e.into());
            }
        }
        r
    }

    /// The engine of a pod the sources just listed.
    pub fn resolve(&self, spec: &PodSpec) -> PodEngine {
        if let Some(v) = spec.labels.get(ENGINE_LABEL) {
            match EngineSetting::from_name(v) {
                Some(s) => return PodEngine::new((&s).into(), "label"),
                None => warn!(pod = %spec.id, value = %v.chars().take(64).collect::<String>(),
                    "unknown kv-router.io/engine value (auto, vllm, sglang, llamacpp, tgi); using the config's engine"),
            }
        }
        let source = spec.labels.get("source").map(String::as_str);
        let from_source = match source {
            Some(s) if s.starts_with("dns:") => self.dns.get(s).map(|c| (c, "dns")),
            Some("kubernetes") => self.kubernetes.as_ref().map(|c| (c, "kubernetes")),
            _ => None,
        };
        match from_source {
            Some((c, from)) => PodEngine::new(c.clone(), from),
            None => PodEngine::new(self.default.clone(), "pods.engine"),
        }
    }
}

/// Extracts vLLM's load signals (the `vllm` preset, as before presets existed).
pub fn parse_vllm_metrics(text: &str) -> LoadSample {
    read(text, MetricMap::preset(Preset::Vllm)).sample
}

#[cfg(test)]
mod tests;
