//! `kv-bench simulate`: a virtual-time simulation of a fleet of simulated vLLM pods on a trace,
//! with no sockets, processes or wall clock.
//!
//! * **Pods** are [`Engine`]s (the `vllm-sim` scheduler, cache and latency model), stepped at their
//!   own event times from one discrete-event loop over virtual microseconds.
//! * **Routing** uses the router's own code: block keys as the router computes them for token-id
//!   prompts, the real index ([`MemoryIndex`] learning from decisions, or [`EventIndex`] fed by the
//!   engines' cache events after a delay), the real scorers and picker ([`Stages`]), and the index
//!   record of the chosen pod, in the order `Decider::decide` runs them.
//! * **Load as the router sees it** models the default deployment (`override-host-buffered.yaml`:
//!   the response is not observed): a scrape of every pod's `running`/`waiting`/KV usage every
//!   `scrape_interval_ms` of virtual time, plus the router's in-flight accounting of
//!   `pods/inflight.rs` in that mode: a routed request counts until a scrape started after its
//!   decision, its estimated uncached tokens for `tokens / prefill_tokens_per_sec`.
//! * **Maintenance** as `app.rs` does it once a second: index capacity from the pods' KV size, TTL
//!   sweep.
//!
//! Everything is deterministic: the same options (seed included) give the same report, whatever
//! the thread count. Strategies (and capacity-planning fleet sizes) run in parallel threads.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use std::time::Instant;

use anyhow::{Context, Result};
use futures::FutureExt;
use parking_lot::Mutex;
use serde::Serialize;
use thiserror::Error;

use super::oracle::{OracleRequest, Oracles};
use super::report::{percentile, Style};
use super::splitmix::SplitMix64;
use super::strategy::Strategy;
use super::trace::{self, Expansion, Trace};
use crate::sim::engine::{Engine, EngineConfig, Output, Submission};
use crate::sim::translate::{Hashes, Translator};
use kv_router::blocks::{namespace_seed, token_keys};
use kv_router::config::Config;
use kv_router::decide::{commit, plan, Body, PlanInput, Stages};
use kv_router::events::KvEventBatch;
use kv_router::index::{build_index, index_capacity, ApplyStats};
use kv_router::keys::Keys;
use kv_router::picker::Reason;
use kv_router::pods::{prefill_time, LoadSample, PodId, PodLoad, Settling, Timestamp};
use kv_router::scoring::Candidate;

/// Model name of every simulated request (seeds the block keys of router and pods alike).
pub const MODEL: &str = "sim-model";

/// Tokens per KV block, for pods and router alike (vLLM's default).
pub const BLOCK_TOKENS: usize = 16;

/// Whether a strategy's outcome depends on the index at all (round robin and random ignore it,
/// so their runs skip it).
fn uses_index(s: Strategy) -> bool {
    !matches!(s, Strategy::RoundRobin | Strategy::Random)
}

/// Invalid simulation options.
#[derive(Debug, Error, PartialEq)]
pub enum SimulateError {
    /// A fleet needs at least one pod.
    #[error("the fleet needs at least one pod")]
    NoPods,
    /// Nothing to compare.
    #[error("no strategy to simulate")]
    NoStrategies,
    /// A strategy this build cannot run.
    #[error("{0}: {1}")]
    Unavailable(&'static str, &'static str),
    /// Arrival compression must be a positive finite number.
    #[error("speedup must be positive and finite, got {0}")]
    BadSpeedup(f64),
    /// The trace (after `--requests`) has no request.
    #[error("the trace has no request to simulate")]
    EmptyTrace,
    /// The engines went idle with requests unfinished (a bug).
    #[error("{strategy} on {pods} pods finished {done} of {submitted} requests")]
    Unfinished {
        /// Strategy.
        strategy: &'static str,
        /// Fleet size.
        pods: usize,
        /// Requests finished.
        done: usize,
        /// Requests submitted.
        submitted: usize,
    },
}

/// Requests simulated by `--quick`.
pub const QUICK_REQUESTS: usize = 500;

/// Largest fleet of the `--quick` capacity sweep.
pub const QUICK_MAX_PLAN_PODS: usize = 16;

/// Default capacity target: TTFT p90 in ms. With the sim's default prefill (10k tokens/s) the
/// conversation trace's p90 prompt alone takes ~2.6 s, so 2 s is out of reach at any fleet size.
pub const DEFAULT_TTFT_TARGET_MS: f64 = 3_000.0;

/// Capacity planning: the smallest fleet meeting a TTFT target.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CapacityOptions {
    /// Strategy to plan for.
    pub strategy: Strategy,
    /// TTFT percentile that must meet the target (e.g. 90).
    pub percentile: f64,
    /// Target, milliseconds.
    pub ttft_target_ms: f64,
    /// Fleet sizes tried, ascending; the sweep stops at the first that meets the target.
    pub pods: Vec<usize>,
}

impl Default for CapacityOptions {
    fn default() -> Self {
        Self {
            strategy: Strategy::Weighted,
            percentile: 90.0,
            ttft_target_ms: DEFAULT_TTFT_TARGET_MS,
            pods: vec![4, 8, 16, 32, 64, 128, 256],
        }
    }
}

/// Parameters of `kv-bench simulate`.
#[derive(Debug, Clone, PartialEq)]
pub struct SimulateOptions {
    /// Trace: `conversation`, `synthetic` or a JSONL path (see [`trace::find_trace`]).
    pub trace: String,
    /// Only the first N requests.
    pub requests: Option<usize>,
    /// Arrival times are trace times / this.
    pub speedup: f64,
    /// Output tokens = `output_length × output_scale` (at least 1).
    pub output_scale: f64,
    /// Fleet size.
    pub pods: usize,
    /// Strategies compared on that fleet.
    pub strategies: Vec<Strategy>,
    /// Every pod's scheduler and latency model (block size is [`BLOCK_TOKENS`]).
    pub engine: EngineConfig,
    /// KV events reach the precise index this long after the engine step that caused them.
    pub event_delay_ms: f64,
    /// Pod metrics scrape period, virtual milliseconds (the router's `scrape_interval_ms`).
    pub scrape_interval_ms: u64,
    /// Seeds the picker's tie-breaks and the random policy.
    pub seed: u64,
    /// Worker threads (0 = available cores).
    pub threads: usize,
    /// Capacity planning sweep, if wanted.
    pub capacity: Option<CapacityOptions>,
}

impl Default for SimulateOptions {
    fn default() -> Self {
        Self {
            trace: "conversation".into(),
            requests: None,
            speedup: 1.0,
            output_scale: 1.0,
            pods: 64,
            strategies: Strategy::available(),
            engine: EngineConfig::default(),
            event_delay_ms: 5.0,
            scrape_interval_ms: kv_router::config::PodsConfig::default().scrape_interval_ms,
            seed: 1,
            threads: 0,
            capacity: Some(CapacityOptions::default()),
        }
    }
}

impl SimulateOptions {
    /// The CI-sized variant: at most the first 500 requests, capacity sweep up to 16 pods.
    pub fn quick(mut self) -> Self {
        self.requests = Some(self.requests.unwrap_or(QUICK_REQUESTS).min(QUICK_REQUESTS));
        if let Some(c) = &mut self.capacity {
            c.pods.retain(|&n| n <= QUICK_MAX_PLAN_PODS);
        }
        self
    }

    fn validate(&self) -> Result<(), SimulateError> {
        if self.pods == 0 {
            return Err(SimulateError::NoPods);
        }
        if self.strategies.is_empty() {
            return Err(SimulateError::NoStrategies);
        }
        let planned = self.capacity.iter().map(|c| c.strategy);
        for s in self.strategies.iter().copied().chain(planned) {
            if let Some(why) = s.unavailable() {
                return Err(SimulateError::Unavailable(s.as_str(), why));
            }
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(SimulateError::BadSpeedup(self.speedup));
        }
        Ok(())
    }
}

/// Virtual and real time of one simulation run (excluded from determinism comparisons).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Timing {
    /// Real seconds the run took.
    pub wall_s: f64,
    /// Simulated seconds per real second (makespan / wall time).
    pub speed: f64,
}

/// One strategy on one fleet size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StrategyResult {
    /// Strategy.
    pub strategy: Strategy,
    /// Fleet size.
    pub pods: usize,
    /// Requests completed (= submitted).
    pub requests: usize,
    /// Σ prompt tokens (engine usage).
    pub prompt_tokens: u64,
    /// Σ cached prompt tokens (engine usage).
    pub cached_tokens: u64,
    /// cached / prompt.
    pub hit_ratio: f64,
    /// hit ratio / infinite-cache oracle's.
    pub vs_infinite: f64,
    /// hit ratio / pooled-LRU oracle's (fleet-wide cache of pods × blocks), when computed.
    pub vs_pooled: Option<f64>,
    /// Modeled TTFT percentiles, ms.
    pub ttft_p50_ms: f64,
    /// p90 TTFT, ms.
    pub ttft_p90_ms: f64,
    /// p99 TTFT, ms.
    pub ttft_p99_ms: f64,
    /// End-to-end latency p50, ms.
    pub e2e_p50_ms: f64,
    /// End-to-end latency p99, ms.
    pub e2e_p99_ms: f64,
    /// Busiest pod's share of requests × pods (1 = even).
    pub hotspot: f64,
    /// Requests routed to each pod.
    pub per_pod: Vec<usize>,
    /// Decisions where every pod was gated (saturated or hot).
    pub all_saturated: usize,
    /// Virtual time of the last completion, seconds.
    pub makespan_s: f64,
    /// TTFT at percentiles 0, 1, …, 100 (ms): the CDF for charts.
    pub ttft_cdf_ms: Vec<f64>,
    /// What the precise index made of the KV events (precise strategy only).
    pub kv_events: Option<ApplyStats>,
    /// Real time spent.
    pub timing: Timing,
}

/// One fleet size of the capacity sweep.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CapacityPoint {
    /// Fleet size.
    pub pods: usize,
    /// TTFT at the plan's percentile, ms.
    pub ttft_ms: f64,
    /// p99 TTFT, ms.
    pub ttft_p99_ms: f64,
    /// Prefix hit ratio.
    pub hit_ratio: f64,
    /// Hotspot factor.
    pub hotspot: f64,
    /// Whether it meets the target.
    pub meets: bool,
}

/// How the capacity sweep ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PlanOutcome {
    /// A fleet size met the target: the answer.
    Met,
    /// The next size improved the TTFT percentile by less than [`LEVEL_OFF`] and still missed:
    /// the target is below what the model's prefill time allows at any fleet size.
    LevelledOff,
    /// Every size was tried and none met the target.
    Exhausted,
}

/// Relative TTFT improvement under which a larger fleet counts as no longer helping.
pub const LEVEL_OFF: f64 = 0.05;

/// The capacity-planning answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CapacityPlan {
    /// What was asked.
    pub options: CapacityOptions,
    /// Fleet sizes simulated, ascending, up to the one that ended the sweep.
    pub points: Vec<CapacityPoint>,
    /// Smallest fleet meeting the target (None: none of the sizes tried).
    pub answer: Option<usize>,
    /// Why the sweep ended.
    pub outcome: PlanOutcome,
}

/// Fleet sizes of a sweep: positive, ascending, distinct.
fn sweep_sizes(c: &CapacityOptions, opts: &SimulateOptions) -> Vec<usize> {
    let mut sizes: Vec<usize> = c.pods.iter().copied().filter(|&n| n > 0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    // The comparison run already covers this size with the plan's strategy.
    sizes.retain(|&n| !(n == opts.pods && opts.strategies.contains(&c.strategy)));
    sizes
}

/// Capacity-sweep state shared by the workers. Sizes run in parallel, but the outcome is read
/// from the completed sizes in ascending order only, so it does not depend on timing.
struct Sweep<'a> {
    opts: &'a CapacityOptions,
    /// Every size that counts (comparison run included), ascending.
    sizes: Vec<usize>,
    /// Results by size (at most one per entry of `sizes`).
    done: Mutex<BTreeMap<usize, StrategyResult>>,
    /// Sizes above this one need not run.
    stop: AtomicUsize,
}

impl<'a> Sweep<'a> {
    fn new(opts: &'a CapacityOptions) -> Self {
        let mut sizes: Vec<usize> = opts.pods.iter().copied().filter(|&n| n > 0).collect();
        sizes.sort_unstable();
        sizes.dedup();
        Self {
            opts,
            sizes,
            done: Mutex::new(Default::default()),
            stop: AtomicUsize::new(usize::MAX),
        }
    }

    fn ttft(&self, r: &StrategyResult) -> f64 {
        r.ttft_at(self.opts.percentile)
    }

    fn meets(&self, r: &StrategyResult) -> bool {
        self.ttft(r) <= self.opts.ttft_target_ms
    }

    fn skips(&self, pods: usize) -> bool {
        pods > self.stop.load(Ordering::Relaxed)
    }

    /// The size that ends the sweep and why, judged on the completed ascending prefix.
    fn outcome(&self, done: &BTreeMap<usize, StrategyResult>) -> Option<(usize, PlanOutcome)> {
        let mut prev: Option<f64> = None;
        for n in &self.sizes {
            let r = done.get(n)?;
            if self.meets(r) {
                return Some((*n, PlanOutcome::Met));
            }
            let t = self.ttft(r);
            if prev.is_some_and(|p| t >= p * (1.0 - LEVEL_OFF)) {
                return Some((*n, PlanOutcome::LevelledOff));
            }
            prev = Some(t);
        }
        None
    }

    fn record(&self, r: StrategyResult) {
        let mut done = self.done.lock();
        done.insert(r.pods, r);
        if let Some((n, _)) = self.outcome(&done) {
            self.stop.fetch_min(n, Ordering::Relaxed);
        }
    }

    fn plan(self) -> CapacityPlan {
        let done = self.done.lock();
        let (last, outcome) = self
            .outcome(&done)
            .unwrap_or((usize::MAX, PlanOutcome::Exhausted));
        let points: Vec<CapacityPoint> = done
            .values()
            .filter(|r| r.pods <= last)
            .map(|r| CapacityPoint {
                pods: r.pods,
                ttft_ms: self.ttft(r),
                ttft_p99_ms: r.ttft_p99_ms,
                hit_ratio: r.hit_ratio,
                hotspot: r.hotspot,
                meets: self.meets(r),
            })
            .collect();
        CapacityPlan {
            options: self.opts.clone(),
            answer: (outcome == PlanOutcome::Met).then_some(last),
            points,
            outcome,
        }
    }
}

/// Simulation parameters as reported.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimParams {
    /// KV blocks per pod.
    pub gpu_blocks: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Max running requests per pod.
    pub max_num_seqs: usize,
    /// Fixed TTFT overhead, ms.
    pub ttft_base_ms: f64,
    /// Prefill µs per uncached token.
    pub prefill_us_per_token: f64,
    /// Decode ms per token (batch of one).
    pub decode_ms_per_token: f64,
    /// Decode slowdown per running request.
    pub decode_batch_slowdown: f64,
    /// KV-event delay (precise), ms.
    pub event_delay_ms: f64,
    /// Scrape period, ms.
    pub scrape_interval_ms: u64,
    /// Arrival compression.
    pub speedup: f64,
    /// Output-length multiplier.
    pub output_scale: f64,
    /// Seed.
    pub seed: u64,
}

/// Everything `kv-bench simulate` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimulateReport {
    /// Trace name.
    pub trace: String,
    /// Requests simulated.
    pub requests: usize,
    /// Last arrival, virtual seconds (after speedup).
    pub arrival_span_s: f64,
    /// Mean prompt tokens.
    pub mean_prompt_tokens: f64,
    /// Fleet size of the strategy comparison.
    pub pods: usize,
    /// Pod and router parameters.
    pub params: SimParams,
    /// Oracles for this request sequence and fleet.
    pub oracles: Oracles,
    /// One result per strategy, in the order asked.
    pub strategies: Vec<StrategyResult>,
    /// Capacity planning, if asked.
    pub capacity: Option<CapacityPlan>,
    /// Worker threads used.
    pub threads: usize,
    /// Real seconds for everything (trace loading included).
    pub wall_s: f64,
}

/// The trace turned into what pods and router need, computed once and shared by every run.
struct Prepared {
    /// Arrival, virtual µs.
    at_us: Vec<u64>,
    /// Prompt token ids.
    tokens: Vec<Vec<u32>>,
    /// Full-block keys (the pods' keys) and prompt size.
    oracle: Vec<OracleRequest>,
    /// Tokens to generate.
    max_tokens: Vec<u32>,
}

impl Prepared {
    fn new(trace: &Trace, opts: &SimulateOptions, threads: usize) -> Self {
        let seed = namespace_seed(MODEL, None);
        let exp = Expansion::default();
        let recs = &trace.records;
        let chunk = recs.len().div_ceil(threads.max(1)).max(1);
        // Expansion and hashing dominate preparation: split them across the workers.
        let parts: Vec<Vec<(Vec<u32>, OracleRequest)>> = std::thread::scope(|s| {
            let handles: Vec<_> = recs
                .chunks(chunk)
                .map(|part| {
                    s.spawn(move || {
                        part.iter()
                            .map(|r| {
                                let tokens = exp.prompt(r);
                                let keys = token_keys(seed, &tokens, BLOCK_TOKENS, usize::MAX);
                                let prompt_tokens = tokens.len() as u64;
                                (
                                    tokens,
                                    OracleRequest {
                                        keys,
                                        prompt_tokens,
                                    },
                                )
                            })
                            .collect()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("expansion thread panicked"))
                .collect()
        });
        let (tokens, oracle) = parts.into_iter().flatten().unzip();
        Self {
            at_us: recs
                .iter()
                .map(|r| (r.timestamp as f64 * 1e3 / opts.speedup).round() as u64)
                .collect(),
            tokens,
            oracle,
            max_tokens: recs
                .iter()
                .map(|r| ((f64::from(r.output_length) * opts.output_scale).round() as u32).max(1))
                .collect(),
        }
    }
}

/// Virtual time in microseconds, as the router's in-flight accounting sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct SimTime(u64);

impl Timestamp for SimTime {
    fn since(self, earlier: Self) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }

    fn after(self, d: Duration) -> Self {
        SimTime(self.0 + d.as_micros() as u64)
    }
}

/// A pod as the router sees it: last scrape plus its own in-flight accounting (`pods/inflight.rs`
/// in BUFFERED mode: every guard is released as soon as the request is routed).
#[derive(Debug, Default)]
struct PodView {
    sample: Option<(SimTime, LoadSample)>,
    settling: Settling<SimTime>,
}

impl PodView {
    /// `Pod::load` at `now`.
    fn load(&mut self, now: SimTime, stale_after: Duration) -> PodLoad {
        let inflight = self.settling.count(now, stale_after);
        PodLoad::at(now, self.sample, inflight, stale_after)
    }

    /// A scrape sent at `now` succeeded (`Pod::record_sample`).
    fn scrape(&mut self, now: SimTime, e: &Engine) {
        let s = e.stats();
        self.sample = Some((
            now,
            LoadSample {
                waiting: s.waiting as f64,
                running: s.running as f64,
                kv_usage: s.kv_cache_usage,
                ..LoadSample::default()
            },
        ));
        self.settling.observed_scrape(now);
    }

    /// A request was routed here at `now` with `tokens` estimated uncached prompt tokens.
    fn routed(&mut self, now: SimTime, tokens: u64, prefill_tokens_per_sec: f64) {
        let until = now.after(prefill_time(tokens, prefill_tokens_per_sec));
        self.settling.push(now, tokens, until);
    }
}

/// Runs an in-memory index call: those backends never wait, so the future is ready at once.
fn ready<T>(f: impl std::future::Future<Output = T>) -> T {
    f.now_or_never()
        .expect("in-memory index operations complete without waiting")
}

/// Adds one batch's counts to a run's totals.
fn add_stats(total: &mut ApplyStats, a: &ApplyStats) {
    total.stored += a.stored;
    total.removed += a.removed;
    total.cleared += a.cleared;
    total.unknown_parent += a.unknown_parent;
    total.unknown += a.unknown;
    total.ignored += a.ignored;
    total.overflow += a.overflow;
}

/// Raw per-request outcome of one run.
struct RunOutcome {
    ttft_us: Vec<u64>,
    e2e_us: Vec<u64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    per_pod: Vec<usize>,
    all_saturated: usize,
    makespan_us: u64,
    kv_events: Option<ApplyStats>,
}

/// The fleet side of one run: engines, their event schedule, and what they reported.
struct Fleet<'a> {
    prep: &'a Prepared,
    engines: Vec<Engine>,
    /// Pending engine wake-ups (lazily invalidated: only `scheduled[p]` is current).
    heap: BinaryHeap<Reverse<(u64, usize)>>,
    scheduled: Vec<Option<u64>>,
    /// KV-event batches on their way to the precise index: (delivery time, pod, batch).
    deliveries: VecDeque<(u64, usize, KvEventBatch)>,
    /// Forward cache events (precise strategy only).
    publish: bool,
    translator: Translator,
    delay_us: u64,
    last_arrival_us: u64,
    ttft_us: Vec<u64>,
    e2e_us: Vec<u64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    done: usize,
    makespan_us: u64,
}

impl Fleet<'_> {
    /// After pod `p` was touched at `now`: its outputs, its cache events, its next wake-up.
    fn settle(&mut self, p: usize, now: u64) {
        for out in self.engines[p].step(now) {
            match out {
                Output::Token { id, index: 0, at } => {
                    let i = id as usize;
                    self.ttft_us[i] = at - self.prep.at_us[i];
                }
                Output::Token { .. } => {}
                Output::Finished { id, usage, at } => {
                    let i = id as usize;
                    self.e2e_us[i] = at - self.prep.at_us[i];
                    self.prompt_tokens += u64::from(usage.prompt_tokens);
                    self.cached_tokens += u64::from(usage.cached_tokens);
                    self.done += 1;
                    self.makespan_us = self.makespan_us.max(at);
                }
            }
        }
        let events = self.engines[p].drain_cache_events();
        // Events after the last decision can no longer matter.
        if self.publish && !events.is_empty() && now < self.last_arrival_us {
            let batch = KvEventBatch {
                ts: now as f64 / 1e6,
                events: self.translator.translate(events),
                data_parallel_rank: Some(0),
            };
            self.deliveries.push_back((now + self.delay_us, p, batch));
        }
        let next = self.engines[p].next_event_time();
        if next != self.scheduled[p] {
            self.scheduled[p] = next;
            if let Some(t) = next {
                self.heap.push(Reverse((t, p)));
            }
        }
    }

    /// The earliest current wake-up, dropping superseded heap entries.
    fn next_wakeup(&mut self) -> Option<(u64, usize)> {
        while let Some(&Reverse((t, p))) = self.heap.peek() {
            if self.scheduled[p] == Some(t) {
                return Some((t, p));
            }
            self.heap.pop();
        }
        None
    }
}

/// Simulates `strategy` on `pods` pods over the prepared requests.
fn simulate(
    prep: &Prepared,
    strategy: Strategy,
    pods: usize,
    opts: &SimulateOptions,
) -> Result<RunOutcome, SimulateError> {
    let cfg = strategy.router_config(&Config::default(), MODEL);
    let stages = Stages::new(&cfg);
    let index = uses_index(strategy).then(|| build_index(&cfg));
    let ecfg = EngineConfig {
        block_size: BLOCK_TOKENS,
        ..opts.engine.clone()
    };
    let ids: Vec<PodId> = (0..pods).map(|i| PodId::new(format!("pod-{i}"))).collect();
    let mut views: Vec<PodView> = (0..pods).map(|_| PodView::default()).collect();
    if let Some(index) = &index {
        // As the router's maintenance loop does from the pods' `cache_config_info`.
        let cap = index_capacity(&cfg, ecfg.num_gpu_blocks as u64, BLOCK_TOKENS as u64);
        for id in &ids {
            ready(index.set_capacity(id, cap)).expect("in-memory index");
        }
    }
    let salt = SplitMix64::derive(opts.seed, strategy.as_str(), pods as u64).next_u64();
    let mut rng = SplitMix64::new(salt);
    let stale_after = Duration::from_millis(cfg.pods.stale_after_ms);
    let scrape_us = opts.scrape_interval_ms.max(1) * 1000;
    let sweep_every = (1000 / opts.scrape_interval_ms.max(1)).max(1);
    let prefill_tps = stages.prefill_tokens_per_sec();
    let max_blocks = cfg.blocks.max_blocks;
    let n = prep.at_us.len();
    let mut fleet = Fleet {
        prep,
        engines: (0..pods).map(|_| Engine::new(ecfg.clone())).collect(),
        heap: BinaryHeap::new(),
        scheduled: vec![None; pods],
        deliveries: VecDeque::new(),
        publish: cfg.kv_events.enabled,
        translator: Translator::new(Hashes::EngineKeys),
        delay_us: (opts.event_delay_ms.max(0.0) * 1e3).round() as u64,
        last_arrival_us: prep.at_us.last().copied().unwrap_or(0),
        ttft_us: vec![u64::MAX; n],
        e2e_us: vec![u64::MAX; n],
        prompt_tokens: 0,
        cached_tokens: 0,
        done: 0,
        makespan_us: 0,
    };
    let mut per_pod = vec![0usize; pods];
    let mut all_saturated = 0usize;
    let mut applied = ApplyStats::default();
    let (mut next_req, mut next_tick, mut ticks) = (0usize, 0u64, 0u64);

    loop {
        let wake = fleet.next_wakeup();
        let t_pod = wake.map(|w| w.0);
        let t_arr = prep.at_us.get(next_req).copied();
        if t_pod.is_none() && t_arr.is_none() {
            break;
        }
        // Router-side events only matter while requests are still to be routed.
        let t_tick = t_arr.map(|_| next_tick);
        let t_del = t_arr.and(fleet.deliveries.front().map(|d| d.0));
        let t = [t_pod, t_del, t_tick, t_arr]
            .into_iter()
            .flatten()
            .min()
            .expect("something is pending");
        // At equal times: pods first, then event delivery, scrape, and the new request, so the
        // router sees everything that happened up to and including `t`.
        if let Some((_, p)) = wake.filter(|w| w.0 == t) {
            fleet.heap.pop();
            fleet.scheduled[p] = None;
            fleet.settle(p, t);
            continue;
        }
        if t_del == Some(t) {
            let (_, p, batch) = fleet.deliveries.pop_front().expect("peeked");
            if let Some(Ok(a)) = index
                .as_ref()
                .map(|index| ready(index.apply_events(&ids[p], 0, MODEL, &batch)))
            {
                add_stats(&mut applied, &a);
            }
            continue;
        }
        if t_tick == Some(t) {
            for (v, e) in views.iter_mut().zip(&fleet.engines) {
                v.scrape(SimTime(t), e);
            }
            if ticks % sweep_every == 0 {
                if let Some(index) = &index {
                    ready(index.sweep(t / 1000)).expect("in-memory index");
                }
            }
            ticks += 1;
            next_tick = t + scrape_us;
            continue;
        }
        // An arrival: the router's lookup, then its own plan and commit, then submit.
        let i = next_req;
        next_req += 1;
        let now_ms = t / 1000;
        let oracle = &prep.oracle[i];
        let keys = Keys {
            keys: oracle.keys[..oracle.keys.len().min(max_blocks)].to_vec(),
            tokens_per_block: BLOCK_TOKENS,
            prompt_tokens: oracle.prompt_tokens,
            precise: cfg.kv_events.enabled,
            tokenize_error: None,
        };
        let matched = match &index {
            Some(index) if !keys.keys.is_empty() => {
                ready(index.lookup(&keys.keys, &ids, now_ms)).expect("in-memory index")
            }
            _ => vec![0.0; pods],
        };
        let candidates = (0..pods)
            .map(|p| Candidate {
                pod: ids[p].clone(),
                matched_blocks: matched[p],
                load: views[p].load(SimTime(t), stale_after),
                session_pod: false,
            })
            .collect();
        let input = PlanInput {
            keys,
            body: Body::Parsed,
            candidates,
            session: None,
            turn: i as u64,
        };
        let plan = plan(&stages, input, &mut rng);
        if plan.reason == Reason::AllSaturated {
            all_saturated += 1;
        }
        let p = plan.primary;
        per_pod[p] += 1;
        ready(commit(
            &plan,
            index.as_deref(),
            None,
            now_ms,
            |p, tokens| views[p].routed(SimTime(t), tokens, prefill_tps),
        ));
        let sub = Submission {
            tokens: prep.tokens[i].clone(),
            keys: oracle.keys.clone(),
            max_tokens: prep.max_tokens[i],
            vllm: None,
        };
        fleet.engines[p].submit(t, i as u64, sub);
        fleet.settle(p, t);
    }
    if fleet.done != n {
        return Err(SimulateError::Unfinished {
            strategy: strategy.as_str(),
            pods,
            done: fleet.done,
            submitted: n,
        });
    }
    Ok(RunOutcome {
        ttft_us: fleet.ttft_us,
        e2e_us: fleet.e2e_us,
        prompt_tokens: fleet.prompt_tokens,
        cached_tokens: fleet.cached_tokens,
        per_pod,
        all_saturated,
        makespan_us: fleet.makespan_us,
        kv_events: fleet.publish.then_some(applied),
    })
}

fn ms(v: &[u64]) -> Vec<f64> {
    v.iter().map(|&us| us as f64 / 1e3).collect()
}

impl StrategyResult {
    /// Summarises a run; oracle ratios are filled in later ([`StrategyResult::against`]).
    fn new(strategy: Strategy, out: RunOutcome, wall_s: f64) -> Self {
        let mut ttft = ms(&out.ttft_us);
        let mut e2e = ms(&out.e2e_us);
        let pods = out.per_pod.len();
        let requests = ttft.len();
        let hit_ratio = if out.prompt_tokens == 0 {
            0.0
        } else {
            out.cached_tokens as f64 / out.prompt_tokens as f64
        };
        let busiest = out.per_pod.iter().copied().max().unwrap_or(0);
        let makespan_s = out.makespan_us as f64 / 1e6;
        let ttft_cdf_ms = (0..=100)
            .map(|p| percentile(&mut ttft, f64::from(p)))
            .collect();
        Self {
            strategy,
            pods,
            requests,
            prompt_tokens: out.prompt_tokens,
            cached_tokens: out.cached_tokens,
            hit_ratio,
            vs_infinite: f64::NAN,
            vs_pooled: None,
            ttft_p50_ms: percentile(&mut ttft, 50.0),
            ttft_p90_ms: percentile(&mut ttft, 90.0),
            ttft_p99_ms: percentile(&mut ttft, 99.0),
            e2e_p50_ms: percentile(&mut e2e, 50.0),
            e2e_p99_ms: percentile(&mut e2e, 99.0),
            hotspot: busiest as f64 / requests.max(1) as f64 * pods as f64,
            per_pod: out.per_pod,
            all_saturated: out.all_saturated,
            makespan_s,
            ttft_cdf_ms,
            kv_events: out.kv_events,
            timing: Timing {
                wall_s,
                speed: if wall_s > 0.0 {
                    makespan_s / wall_s
                } else {
                    f64::INFINITY
                },
            },
        }
    }

    /// The same result with its hit ratio compared to `oracles`.
    fn against(self, oracles: &Oracles) -> Self {
        let rel = |o: f64| {
            if o > 0.0 {
                self.hit_ratio / o
            } else {
                f64::NAN
            }
        };
        Self {
            vs_infinite: rel(oracles.infinite.ratio()),
            vs_pooled: Some(rel(oracles.pooled.ratio())),
            ..self
        }
    }

    /// TTFT at percentile `p` (from the CDF, exact at whole percentiles).
    pub fn ttft_at(&self, p: f64) -> f64 {
        let i = (p.clamp(0.0, 100.0).round() as usize).min(self.ttft_cdf_ms.len() - 1);
        self.ttft_cdf_ms[i]
    }
}

/// A unit of work for the thread pool.
#[derive(Debug, Clone, Copy)]
enum Job {
    Compare(Strategy),
    Plan(usize),
}

/// Loads the trace named in `opts` and simulates it.
pub fn run(opts: &SimulateOptions) -> Result<SimulateReport> {
    let started = Instant::now();
    let path = trace::find_trace(&opts.trace)?;
    let trace = Trace::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let trace = match opts.requests {
        Some(n) => trace.head(n),
        None => trace,
    };
    let mut report = run_trace(&trace, opts)?;
    report.wall_s = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Simulates `trace` (already cut) with `opts` (its `trace` and `requests` are not read).
pub fn run_trace(trace: &Trace, opts: &SimulateOptions) -> Result<SimulateReport> {
    let started = Instant::now();
    opts.validate()?;
    if trace.records.is_empty() {
        return Err(SimulateError::EmptyTrace.into());
    }
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let prep = Prepared::new(trace, opts, threads);
    let engine = &opts.engine;
    let blocks_per_pod = engine.num_gpu_blocks;

    let jobs: Vec<Job> = opts
        .strategies
        .iter()
        .map(|&s| Job::Compare(s))
        .chain(
            opts.capacity
                .iter()
                .flat_map(|c| sweep_sizes(c, opts))
                .map(Job::Plan),
        )
        .collect();
    let sweep = opts.capacity.as_ref().map(Sweep::new);
    let oracles = Mutex::new(None);
    let compared: Mutex<Vec<Option<StrategyResult>>> =
        Mutex::new(vec![None; opts.strategies.len()]);
    let errors: Mutex<Vec<SimulateError>> = Mutex::new(Vec::new());
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        // The oracles run beside the first jobs; results wait for them only at the end.
        s.spawn(|| {
            let o = Oracles::compute(&prep.oracle, BLOCK_TOKENS, opts.pods * blocks_per_pod);
            *oracles.lock() = Some(o);
        });
        for _ in 0..threads {
            s.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(&job) = jobs.get(k) else { break };
                let (strategy, pods) = match (job, &sweep) {
                    (Job::Compare(st), _) => (st, opts.pods),
                    (Job::Plan(n), Some(sw)) if !sw.skips(n) => (sw.opts.strategy, n),
                    (Job::Plan(_), _) => continue,
                };
                let t0 = Instant::now();
                match simulate(&prep, strategy, pods, opts) {
                    Ok(out) => {
                        let wall = t0.elapsed().as_secs_f64();
                        let r = StrategyResult::new(strategy, out, wall);
                        eprintln!(
                            "kv-bench simulate: {} on {} pods: {:.1} s ({:.0} trace s/s)",
                            strategy.as_str(),
                            pods,
                            wall,
                            r.timing.speed
                        );
                        if let Some(sw) = &sweep {
                            if sw.opts.strategy == strategy && sw.sizes.contains(&pods) {
                                sw.record(r.clone());
                            }
                        }
                        if let Job::Compare(st) = job {
                            if let Some(slot) = opts.strategies.iter().position(|&x| x == st) {
                                compared.lock()[slot] = Some(r);
                            }
                        }
                    }
                    Err(e) => errors.lock().push(e),
                }
            });
        }
    });
    if let Some(e) = errors.into_inner().into_iter().next() {
        return Err(e.into());
    }
    let oracles = oracles
        .into_inner()
        .expect("the oracle thread finished with the scope");
    let strategies: Vec<StrategyResult> = compared
        .into_inner()
        .into_iter()
        .flatten()
        .map(|r| r.against(&oracles))
        .collect();
    let capacity = sweep.map(Sweep::plan);
    let n = prep.at_us.len();
    Ok(SimulateReport {
        trace: trace.name.clone(),
        requests: n,
        arrival_span_s: prep.at_us.last().copied().unwrap_or(0) as f64 / 1e6,
        mean_prompt_tokens: prep.oracle.iter().map(|o| o.prompt_tokens).sum::<u64>() as f64
            / n as f64,
        pods: opts.pods,
        params: SimParams {
            gpu_blocks: engine.num_gpu_blocks,
            block_tokens: BLOCK_TOKENS,
            max_num_seqs: engine.max_num_seqs,
            ttft_base_ms: engine.ttft_base_us / 1e3,
            prefill_us_per_token: engine.prefill_us_per_token,
            decode_ms_per_token: engine.decode_us_per_token / 1e3,
            decode_batch_slowdown: engine.decode_batch_slowdown,
            event_delay_ms: opts.event_delay_ms,
            scrape_interval_ms: opts.scrape_interval_ms,
            speedup: opts.speedup,
            output_scale: opts.output_scale,
            seed: opts.seed,
        },
        oracles,
        strategies,
        capacity,
        threads,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

/// Renders rows as a markdown table or as aligned plain text.
fn render(header: &[&str], rows: &[Vec<String>], style: Style) -> String {
    let mut out = String::new();
    match style {
        Style::Markdown => {
            let _ = writeln!(out, "| {} |", header.join(" | "));
            let rule: Vec<&str> = header
                .iter()
                .enumerate()
                .map(|(i, _)| if i == 0 { "---" } else { "---:" })
                .collect();
            let _ = writeln!(out, "| {} |", rule.join(" | "));
            for r in rows {
                let _ = writeln!(out, "| {} |", r.join(" | "));
            }
        }
        Style::Plain => {
            let mut width: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
            for r in rows {
                for (w, c) in width.iter_mut().zip(r) {
                    *w = (*w).max(c.chars().count());
                }
            }
            let line = |cells: Vec<&str>| -> String {
                cells
                    .iter()
                    .zip(&width)
                    .enumerate()
                    .map(|(i, (c, w))| {
                        if i == 0 {
                            format!("{c:<w$}")
                        } else {
                            format!("{c:>w$}")
                        }
                    })
                    .collect::<Vec<_>>()
                    .join("  ")
            };
            let _ = writeln!(out, "{}", line(header.to_vec()));
            for r in rows {
                let _ = writeln!(out, "{}", line(r.iter().map(String::as_str).collect()));
            }
        }
    }
    out
}

fn fmt_ms(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else if v >= 10_000.0 {
        format!("{:.1} s", v / 1e3)
    } else {
        format!("{v:.0} ms")
    }
}

impl SimulateReport {
    /// The report as markdown: setup, strategy table, capacity plan (the caller adds a heading).
    pub fn markdown(&self) -> String {
        self.render(Style::Markdown)
    }

    /// The report as aligned plain text.
    pub fn plain(&self) -> String {
        self.render(Style::Plain)
    }

    fn render(&self, style: Style) -> String {
        let p = &self.params;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "Trace {}: {} requests arriving over {:.0} s (speedup {}), mean prompt {:.0} tokens, \
             output x{}. Fleet: {} pods x {} blocks of {} tokens, max_num_seqs {}, prefill {} us/token, \
             decode {} ms/token, TTFT base {} ms; scrape every {} ms, KV events after {} ms; seed {}.",
            self.trace,
            self.requests,
            self.arrival_span_s,
            p.speedup,
            self.mean_prompt_tokens,
            p.output_scale,
            self.pods,
            p.gpu_blocks,
            p.block_tokens,
            p.max_num_seqs,
            p.prefill_us_per_token,
            p.decode_ms_per_token,
            p.ttft_base_ms,
            p.scrape_interval_ms,
            p.event_delay_ms,
            p.seed
        );
        let _ = writeln!(
            out,
            "\nOracles: infinite cache {:.3}, pooled LRU of the fleet ({} blocks) {:.3}.\n",
            self.oracles.infinite.ratio(),
            self.oracles.pooled_blocks,
            self.oracles.pooled.ratio()
        );
        let header = [
            "strategy",
            "hit ratio",
            "/ infinite",
            "/ pooled",
            "TTFT p50",
            "TTFT p90",
            "TTFT p99",
            "E2E p50",
            "E2E p99",
            "hotspot",
            "req/pod min-max",
            "all gated",
            "sim speed",
        ];
        let rows: Vec<Vec<String>> = self
            .strategies
            .iter()
            .map(|r| {
                let min = r.per_pod.iter().min().copied().unwrap_or(0);
                let max = r.per_pod.iter().max().copied().unwrap_or(0);
                vec![
                    r.strategy.as_str().to_string(),
                    format!("{:.3}", r.hit_ratio),
                    format!("{:.2}", r.vs_infinite),
                    r.vs_pooled.map_or("-".into(), |v| format!("{v:.2}")),
                    fmt_ms(r.ttft_p50_ms),
                    fmt_ms(r.ttft_p90_ms),
                    fmt_ms(r.ttft_p99_ms),
                    fmt_ms(r.e2e_p50_ms),
                    fmt_ms(r.e2e_p99_ms),
                    format!("{:.2}", r.hotspot),
                    format!("{min}-{max}"),
                    format!("{}", r.all_saturated),
                    format!("{:.0}x", r.timing.speed),
                ]
            })
            .collect();
        out.push_str(&render(&header, &rows, style));
        for r in &self.strategies {
            if let Some(k) = &r.kv_events {
                let _ = writeln!(
                    out,
                    "\n{}: KV events applied: {} blocks stored, {} removed, {} with an unknown parent.",
                    r.strategy.as_str(),
                    k.stored,
                    k.removed,
                    k.unknown_parent
                );
            }
        }
        if let Some(c) = &self.capacity {
            let o = &c.options;
            let _ = writeln!(
                out,
                "\nCapacity plan ({}, TTFT p{} <= {:.0} ms):\n",
                o.strategy.as_str(),
                o.percentile,
                o.ttft_target_ms
            );
            let ttft_col = format!("TTFT p{}", o.percentile);
            let header = [
                "pods",
                ttft_col.as_str(),
                "TTFT p99",
                "hit ratio",
                "hotspot",
                "meets",
            ];
            let rows: Vec<Vec<String>> = c
                .points
                .iter()
                .map(|pt| {
                    vec![
                        pt.pods.to_string(),
                        fmt_ms(pt.ttft_ms),
                        fmt_ms(pt.ttft_p99_ms),
                        format!("{:.3}", pt.hit_ratio),
                        format!("{:.2}", pt.hotspot),
                        if pt.meets { "yes" } else { "no" }.into(),
                    ]
                })
                .collect();
            out.push_str(&render(&header, &rows, style));
            let goal = format!(
                "TTFT p{} <= {:.0} ms with {}",
                o.percentile,
                o.ttft_target_ms,
                o.strategy.as_str()
            );
            let last = c.points.last();
            let _ = match (c.outcome, c.answer, last) {
                (PlanOutcome::Met, Some(n), _) => writeln!(out, "\nAnswer: {n} pods meet {goal}."),
                (PlanOutcome::LevelledOff, _, Some(pt)) => writeln!(
                    out,
                    "\nAnswer: no fleet size meets {goal}: from {} pods on the percentile levels \
                     off near {} (more pods gain under {:.0}%; prefill time dominates).",
                    pt.pods,
                    fmt_ms(pt.ttft_ms),
                    LEVEL_OFF * 100.0
                ),
                _ => writeln!(out, "\nAnswer: none of {:?} pods meets {goal}.", o.pods),
            };
        }
        let _ = writeln!(
            out,
            "\nSimulated on {} threads in {:.1} s.",
            self.threads, self.wall_s
        );
        out
    }
}

/// Command-line flags of `kv-bench simulate`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// Trace: `conversation`, `synthetic` or a JSONL path.
    #[arg(long, default_value = "conversation")]
    pub trace: String,
    /// Fleet size of the strategy comparison.
    #[arg(long, default_value_t = 64)]
    pub pods: usize,
    /// Simulate only the first N requests.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Arrival times = trace times / this.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Output tokens = output_length x this.
    #[arg(long, default_value_t = 1.0)]
    pub output_scale: f64,
    /// Strategies to compare (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Strategy::available())]
    pub strategies: Vec<Strategy>,
    /// Capacity planning: TTFT target in ms at --ttft-percentile.
    #[arg(long, default_value_t = DEFAULT_TTFT_TARGET_MS)]
    pub ttft_target_ms: f64,
    /// Capacity planning: TTFT percentile that must meet the target.
    #[arg(long, default_value_t = 90.0)]
    pub ttft_percentile: f64,
    /// Capacity planning: strategy.
    #[arg(long, value_enum, default_value_t = Strategy::Weighted)]
    pub plan_strategy: Strategy,
    /// Capacity planning: fleet sizes to try, ascending (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![4usize, 8, 16, 32, 64, 128, 256])]
    pub plan_pods: Vec<usize>,
    /// Skip capacity planning.
    #[arg(long)]
    pub no_plan: bool,
    /// KV blocks per pod.
    #[arg(long, default_value_t = EngineConfig::default().num_gpu_blocks)]
    pub gpu_blocks: usize,
    /// Prefill time per uncached prompt token, microseconds.
    #[arg(long, default_value_t = EngineConfig::default().prefill_us_per_token)]
    pub prefill_us_per_token: f64,
    /// Decode time per output token (batch of one), milliseconds.
    #[arg(long, default_value_t = EngineConfig::default().decode_us_per_token / 1e3)]
    pub decode_ms_per_token: f64,
    /// Most running requests per pod.
    #[arg(long, default_value_t = EngineConfig::default().max_num_seqs)]
    pub max_num_seqs: usize,
    /// Fixed TTFT overhead per request, milliseconds.
    #[arg(long, default_value_t = EngineConfig::default().ttft_base_us / 1e3)]
    pub ttft_base_ms: f64,
    /// Delay of KV events before the precise index sees them, milliseconds.
    #[arg(long, default_value_t = 5.0)]
    pub event_delay_ms: f64,
    /// Seed of tie-breaks and the random policy.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// CI size: at most the first 500 requests, capacity sweep up to 16 pods.
    #[arg(long)]
    pub quick: bool,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Print the tables as markdown instead of plain text.
    #[arg(long)]
    pub markdown: bool,
}

impl SimulateArgs {
    /// The options these flags describe.
    pub fn options(&self) -> SimulateOptions {
        let finite = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
        let opts = SimulateOptions {
            trace: self.trace.clone(),
            requests: self.requests,
            speedup: self.speedup,
            output_scale: finite(self.output_scale),
            pods: self.pods,
            strategies: self.strategies.clone(),
            engine: EngineConfig {
                block_size: BLOCK_TOKENS,
                num_gpu_blocks: self.gpu_blocks,
                max_num_seqs: self.max_num_seqs.max(1),
                ttft_base_us: finite(self.ttft_base_ms) * 1e3,
                prefill_us_per_token: finite(self.prefill_us_per_token),
                decode_us_per_token: finite(self.decode_ms_per_token) * 1e3,
                ..EngineConfig::default()
            },
            event_delay_ms: finite(self.event_delay_ms),
            scrape_interval_ms: SimulateOptions::default().scrape_interval_ms,
            seed: self.seed,
            threads: self.threads,
            capacity: (!self.no_plan).then(|| CapacityOptions {
                strategy: self.plan_strategy,
                percentile: self.ttft_percentile.clamp(0.0, 100.0),
                ttft_target_ms: self.ttft_target_ms,
                pods: self.plan_pods.clone(),
            }),
        };
        if self.quick {
            opts.quick()
        } else {
            opts
        }
    }
}

/// `kv-bench simulate`: runs, prints the tables, writes the JSON when asked.
pub fn cli(args: &SimulateArgs) -> Result<()> {
    let report = run(&args.options())?;
    if args.markdown {
        println!("{}", report.markdown());
    } else {
        println!("{}", report.plain());
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("kv-bench: wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::trace::TraceRecord;
    use std::sync::Arc;

    /// Fast engines: small prompts still queue a little so load matters.
    fn opts(pods: usize) -> SimulateOptions {
        SimulateOptions {
            pods,
            threads: 2,
            capacity: None,
            engine: EngineConfig {
                num_gpu_blocks: 512,
                ..EngineConfig::default()
            },
            ..SimulateOptions::default()
        }
    }

    /// `groups` shared 1024-token prefixes (2 trace blocks), each request adding its own block;
    /// groups come in a pseudo-random order (no pattern a round robin could align with).
    fn grouped_trace(groups: u64, per_group: u64, gap_ms: u64) -> Trace {
        let mut records = Vec::new();
        let mut next_id = 1_000;
        let mut rng = SplitMix64::new(groups * 31 + per_group);
        for i in 0..groups * per_group {
            let g = rng.range(0, groups as usize - 1) as u64;
            next_id += 1;
            records.push(TraceRecord {
                timestamp: i * gap_ms,
                input_length: 1_300,
                output_length: 20,
                hash_ids: vec![g * 2, g * 2 + 1, next_id],
            });
        }
        Trace {
            name: "grouped".into(),
            offset: 0,
            records,
        }
    }

    fn zero_timing(mut r: SimulateReport) -> SimulateReport {
        r.wall_s = 0.0;
        r.threads = 0;
        for s in &mut r.strategies {
            s.timing = Timing::default();
        }
        r
    }

    #[test]
    fn same_seed_same_report_whatever_the_threads() {
        let t = grouped_trace(6, 10, 40);
        let mut o = opts(4);
        o.capacity = Some(CapacityOptions {
            pods: vec![1, 2, 4],
            ttft_target_ms: 1e9,
            ..CapacityOptions::default()
        });
        let a = zero_timing(run_trace(&t, &o).unwrap());
        o.threads = 1;
        let b = zero_timing(run_trace(&t, &o).unwrap());
        assert_eq!(a, b);
        assert_eq!(a.capacity.as_ref().unwrap().answer, Some(1));
        o.seed = 2;
        let c = zero_timing(run_trace(&t, &o).unwrap());
        let random = |r: &SimulateReport| r.strategies[1].per_pod.clone();
        assert_ne!(random(&a), random(&c), "the seed drives the random policy");
    }

    #[test]
    fn one_pod_makes_every_strategy_equal() {
        let t = grouped_trace(4, 8, 30);
        let r = run_trace(&t, &opts(1)).unwrap();
        let first = &r.strategies[0];
        for s in &r.strategies {
            assert_eq!(s.cached_tokens, first.cached_tokens, "{:?}", s.strategy);
            assert_eq!(s.ttft_cdf_ms, first.ttft_cdf_ms, "{:?}", s.strategy);
            assert_eq!(s.per_pod, vec![32]);
        }
    }

    #[test]
    fn prefix_aware_routing_beats_round_robin_and_stays_under_the_oracle() {
        // 8 groups on 4 pods: round robin spreads each group over every pod (cold prefixes
        // everywhere); prefix-aware strategies keep a group where its prefix is.
        let t = grouped_trace(8, 12, 200);
        let mut o = opts(4);
        // Room for about three prefixes per pod: spreading every group everywhere thrashes.
        o.engine.num_gpu_blocks = 256;
        let r = run_trace(&t, &o).unwrap();
        let get = |s: Strategy| r.strategies.iter().find(|x| x.strategy == s).unwrap();
        let rr = get(Strategy::RoundRobin).hit_ratio;
        for s in [Strategy::PrefixOnly, Strategy::Weighted, Strategy::Precise] {
            assert!(
                get(s).hit_ratio > rr + 0.05,
                "{s:?}: {} vs round robin {rr}",
                get(s).hit_ratio
            );
        }
        let inf = r.oracles.infinite.ratio();
        for s in &r.strategies {
            assert!(
                s.hit_ratio <= inf + 1e-12,
                "{:?} {} > {inf}",
                s.strategy,
                s.hit_ratio
            );
            assert_eq!(s.requests, t.records.len(), "requests conserved");
            assert_eq!(s.per_pod.iter().sum::<usize>(), t.records.len());
            assert_eq!(s.ttft_cdf_ms.len(), 101);
        }
    }

    #[test]
    fn router_keys_are_the_keyers_keys() {
        // The simulation's shortcut (pod keys cut at max_blocks) must equal what the router
        // computes from a token-id request, in approximate and precise mode alike.
        let tokens: Vec<u32> = (0..(5000 * BLOCK_TOKENS as u32 + 7))
            .map(|i| i % 977 + 3)
            .collect();
        let body =
            serde_json::to_vec(&serde_json::json!({"model": MODEL, "prompt": tokens})).unwrap();
        let req = kv_router::request::parse("/v1/completions", &body).unwrap();
        let pod_keys = token_keys(
            namespace_seed(MODEL, None),
            &tokens,
            BLOCK_TOKENS,
            usize::MAX,
        );
        for s in [Strategy::Weighted, Strategy::Precise] {
            let cfg = s.router_config(&Config::default(), MODEL);
            let keyer = kv_router::keys::Keyer::new(
                kv_router::blocks::BlockScheme {
                    size_chars: cfg.blocks.size_chars,
                    max_blocks: cfg.blocks.max_blocks,
                },
                cfg.kv_events.block_tokens,
                Arc::new(kv_router::keys::load_tokenizers(&cfg.tokenizers).unwrap()),
            );
            let k = keyer.keys(&req);
            assert_eq!(k.precise, s == Strategy::Precise);
            assert_eq!(k.tokens_per_block, BLOCK_TOKENS);
            assert_eq!(k.prompt_tokens, tokens.len() as u64);
            assert_eq!(k.keys[..], pod_keys[..cfg.blocks.max_blocks], "{s:?}");
        }
    }

    #[test]
    fn capacity_plan_stops_at_the_first_fleet_meeting_the_target() {
        let t = grouped_trace(4, 20, 5);
        let mut o = opts(2);
        o.strategies = vec![Strategy::Weighted];
        let base = zero_timing(run_trace(&t, &o).unwrap());
        let p90 = |pods: usize| {
            let mut o = o.clone();
            o.pods = pods;
            run_trace(&t, &o).unwrap().strategies[0].ttft_p90_ms
        };
        // A target between the 1-pod and 8-pod p90: the plan must pick a size in between.
        let target = (p90(1) + p90(8)) / 2.0;
        o.capacity = Some(CapacityOptions {
            strategy: Strategy::Weighted,
            percentile: 90.0,
            ttft_target_ms: target,
            pods: vec![8, 1, 2, 4],
        });
        let r = run_trace(&t, &o).unwrap();
        let plan = r.capacity.clone().unwrap();
        assert_eq!(plan.outcome, PlanOutcome::Met);
        let answer = plan.answer.unwrap();
        assert!(answer > 1 && answer <= 8, "{plan:?}");
        assert_eq!(plan.points.last().unwrap().pods, answer);
        assert!(plan.points.iter().rev().skip(1).all(|p| !p.meets));
        assert_eq!(zero_timing(r.clone()).strategies, base.strategies);
    }

    #[test]
    fn capacity_plan_gives_up_when_more_pods_stop_helping() {
        let t = grouped_trace(3, 4, 300);
        let mut o = opts(2);
        o.strategies = vec![Strategy::RoundRobin];
        o.capacity = Some(CapacityOptions {
            strategy: Strategy::Weighted,
            ttft_target_ms: 1.0,
            pods: vec![1, 2, 4, 8, 16, 32, 64],
            ..CapacityOptions::default()
        });
        let plan = run_trace(&t, &o).unwrap().capacity.unwrap();
        assert_eq!(plan.outcome, PlanOutcome::LevelledOff, "{plan:?}");
        assert_eq!(plan.answer, None);
        assert!(plan.points.len() < 7, "{plan:?}");
        let text = run_trace(&t, &o).unwrap().plain();
        assert!(text.contains("no fleet size meets"), "{text}");
    }

    #[test]
    fn precise_index_follows_the_events() {
        let t = grouped_trace(4, 10, 100);
        let mut o = opts(2);
        o.strategies = vec![Strategy::Precise];
        let r = run_trace(&t, &o).unwrap();
        let k = r.strategies[0].kv_events.unwrap();
        assert!(k.stored > 0, "{k:?}");
        assert_eq!(k.unknown_parent + k.ignored + k.overflow, 0, "{k:?}");
    }

    #[test]
    fn bad_options_are_typed_errors() {
        let t = grouped_trace(1, 1, 1);
        let mut o = opts(0);
        let e = run_trace(&t, &o).unwrap_err();
        assert_eq!(e.downcast_ref(), Some(&SimulateError::NoPods));
        o.pods = 1;
        o.speedup = 0.0;
        let e = run_trace(&t, &o).unwrap_err();
        assert!(matches!(
            e.downcast_ref(),
            Some(SimulateError::BadSpeedup(_))
        ));
    }

    #[test]
    fn report_renders_every_strategy() {
        let t = grouped_trace(2, 4, 50);
        let mut o = opts(2);
        o.capacity = Some(CapacityOptions {
            pods: vec![1, 2],
            ..CapacityOptions::default()
        });
        let r = run_trace(&t, &o).unwrap();
        let md = r.markdown();
        for s in Strategy::available() {
            assert!(md.contains(&format!("| {} |", s.as_str())), "{md}");
        }
        assert!(md.contains("Answer: 1 pods"), "{md}");
        assert!(r.plain().contains("prefix-only"));
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["strategies"][0]["strategy"], "round-robin");
    }
}
