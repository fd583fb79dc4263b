//! What to simulate: the options, their defaults and the `--quick` variant, and why a set of
//! options is refused.

use serde::Serialize;
use thiserror::Error;

use super::super::strategy::Strategy;
use vllm_sim::engine::EngineConfig;

/// Model name of every simulated request (seeds the block keys of router and pods alike).
pub const MODEL: &str = "sim-model";

/// Tokens per KV block, for pods and router alike (vLLM's default).
pub const BLOCK_TOKENS: usize = 16;

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
    /// A divergence option out of its range.
    #[error("{0}")]
    BadDivergence(&'static str),
    /// A replica count or propagation delay out of its range.
    #[error("{0}")]
    BadReplication(&'static str),
    /// An adapter or prefill/decode option out of its range.
    #[error("{0}")]
    BadWorkload(&'static str),
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
    /// Requests of the trace skipped before the first one simulated.
    pub skip: usize,
    /// Only N requests (after `skip`).
    pub requests: Option<usize>,
    /// Arrival times are trace times / this.
    pub speedup: f64,
    /// Output tokens = `output_length × output_scale` (at least 1).
    pub output_scale: f64,
    /// Fleet size.
    pub pods: usize,
    /// Strategies compared on that fleet.
    pub strategies: Vec<Strategy>,
    /// The router configuration each strategy starts from (`--router-config`: a user's own
    /// weights and gates; the defaults otherwise). The strategy's own keys are set over it.
    pub base_config: kv_router::config::Config,
    /// Every pod's scheduler and latency model (block size is [`BLOCK_TOKENS`]).
    pub engine: EngineConfig,
    /// The first this many pods prefill `slow_factor` times slower than the rest.
    pub slow_pods: usize,
    /// How much slower the slow pods prefill (1 = all pods equal).
    pub slow_factor: f64,
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
    /// Where the pods' caches stop matching what the router recorded.
    pub divergence: Divergence,
    /// Router replicas sharing the index, each size simulated (the comparison sweeps every
    /// size with every delay; the capacity plan uses the first pair).
    pub replicas: Vec<usize>,
    /// Virtual ms before one replica's index record reaches the other replicas' indexes.
    pub propagation_ms: Vec<f64>,
    /// Virtual ms before a decision's load reaches the other replicas, when it travels apart
    /// from its record (`None`: with it).
    pub charge_propagation_ms: Option<f64>,
    /// Each replica counts the others' requests as in-flight load, from their records (the
    /// live mirror's `mirror_load`); off: each charges only its own decisions.
    pub shared_load: bool,
    /// Replicas apply each other's conversation marks with the records.
    pub shared_conversations: bool,
    /// Until when a routed request's uncached tokens count as queued work on its pod.
    pub token_release: TokenRelease,
    /// Requests sharing one trace timestamp arrive evenly spread until the next one.
    pub spread_clumps: bool,
    /// `gate.replicate_to_idle` (on by default): off measures what the rule changes.
    pub replicate_to_idle: bool,
    /// LoRA adapters the requests name (0: every request is for the base model); a request's
    /// adapter is drawn from its prompt's first block, so a conversation keeps its adapter.
    pub adapters: usize,
    /// Adapter slots per pod (vLLM's `--max-loras`) when `adapters` is set.
    pub adapter_slots: usize,
    /// The first this many pods prefill (P/D role `prefill`), the rest decode; 0: aggregated.
    pub prefill_pods: usize,
}

/// One way of running the router: `replicas` replicas, each with its own index, applying each
/// other's records `propagation_ms` after they were made.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Replication {
    /// Router replicas; request `i` goes to replica `i % replicas` (Envoy's round robin).
    pub replicas: usize,
    /// Delay of another replica's record, virtual ms (0 with one replica: nothing to propagate).
    pub propagation_ms: f64,
    /// Delay of another replica's load when it travels apart from the record.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub charge_ms: Option<f64>,
}

impl Default for Replication {
    fn default() -> Self {
        Self {
            replicas: 1,
            propagation_ms: 0.0,
            charge_ms: None,
        }
    }
}

/// Ways the pods' caches drift from the router's own record of its decisions: what only a
/// router that reads the pods' KV events can see.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Divergence {
    /// Share of requests that reach a pod without this router (another replica, direct
    /// clients): sent to a pod drawn at random, the same ones for every strategy.
    pub bypass: f64,
    /// Every this many virtual seconds one pod, in turn, restarts with an empty cache; its
    /// unfinished requests are retried on it.
    pub restart_every_s: Option<f64>,
    /// The router is told each pod's KV cache is this many times its real size.
    pub capacity_belief: f64,
    /// The first this many pods publish no `BlockRemoved` events (a publisher that loses them):
    /// a precise index believes they keep every block they ever stored.
    pub lost_removals: usize,
}

impl Default for Divergence {
    fn default() -> Self {
        Self {
            bypass: 0.0,
            restart_every_s: None,
            capacity_belief: 1.0,
            lost_removals: 0,
        }
    }
}

impl Divergence {
    /// Whether anything diverges.
    pub fn any(&self) -> bool {
        *self != Self::default()
    }
}

impl Default for SimulateOptions {
    fn default() -> Self {
        Self {
            trace: "conversation".into(),
            skip: 0,
            requests: None,
            speedup: 1.0,
            output_scale: 1.0,
            pods: 64,
            strategies: Strategy::available(),
            base_config: kv_router::config::Config::default(),
            engine: EngineConfig::default(),
            slow_pods: 0,
            slow_factor: 1.0,
            event_delay_ms: 5.0,
            scrape_interval_ms: kv_router::config::PodsConfig::default().scrape_interval_ms,
            seed: 1,
            threads: 0,
            capacity: Some(CapacityOptions::default()),
            divergence: Divergence::default(),
            replicas: vec![1],
            propagation_ms: vec![0.0],
            charge_propagation_ms: None,
            shared_load: false,
            token_release: TokenRelease::Prefill,
            shared_conversations: false,
            spread_clumps: false,
            replicate_to_idle: true,
            adapters: 0,
            adapter_slots: 1,
            prefill_pods: 0,
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

    /// Every (replicas, delay) pair to compare, in the order given; one replica once, whatever
    /// the delays (it has nothing to propagate).
    pub fn replications(&self) -> Vec<Replication> {
        let mut out: Vec<Replication> = Vec::new();
        for &replicas in &self.replicas {
            for &d in &self.propagation_ms {
                let propagation_ms = if replicas == 1 { 0.0 } else { d };
                let r = Replication {
                    replicas,
                    propagation_ms,
                    charge_ms: self.charge_propagation_ms.filter(|_| replicas > 1),
                };
                if !out.contains(&r) {
                    out.push(r);
                }
            }
        }
        out
    }

    pub(super) fn validate(&self) -> Result<(), SimulateError> {
        if self.pods == 0 {
            return Err(SimulateError::NoPods);
        }
        if self.replicas.is_empty() || self.replicas.contains(&0) {
            return Err(SimulateError::BadReplication(
                "at least one replica size, each at least 1",
            ));
        }
        if self.propagation_ms.is_empty()
            || self
                .propagation_ms
                .iter()
                .any(|d| !(d.is_finite() && *d >= 0.0))
        {
            return Err(SimulateError::BadReplication(
                "at least one propagation delay, each finite and at least 0",
            ));
        }
        if self
            .charge_propagation_ms
            .is_some_and(|d| !(d.is_finite() && d >= 0.0))
        {
            return Err(SimulateError::BadReplication(
                "the charge's propagation delay must be finite and at least 0",
            ));
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
        let d = &self.divergence;
        if !(0.0..=1.0).contains(&d.bypass) {
            return Err(SimulateError::BadDivergence("bypass must be within 0..=1"));
        }
        if d.restart_every_s
            .is_some_and(|s| !(s.is_finite() && s > 0.0))
        {
            return Err(SimulateError::BadDivergence(
                "restart interval must be positive and finite",
            ));
        }
        if self.adapters > 0 && self.adapter_slots == 0 {
            return Err(SimulateError::BadWorkload(
                "adapter pods need at least one adapter slot",
            ));
        }
        if self.prefill_pods > 0 && self.prefill_pods >= self.pods {
            return Err(SimulateError::BadWorkload(
                "a prefill/decode fleet needs at least one decode pod besides its prefill pods",
            ));
        }
        if !(d.capacity_belief.is_finite() && d.capacity_belief > 0.0) {
            return Err(SimulateError::BadDivergence(
                "capacity belief must be positive and finite",
            ));
        }
        Ok(())
    }
}

/// Until when a routed request's uncached tokens count as queued work on its pod, for the
/// router that decided it and for the others that share its load (`--shared-load`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TokenRelease {
    /// As the live router: its own until the request's first token (`InflightGuard` releases
    /// them when the response starts), the others' for the predicted prefill alone
    /// (`Charge::prefill_ms`).
    Live,
    /// Everyone for the predicted prefill alone: the model the simulator's tables and tests
    /// were measured with (`live` moves precise below weighted on the synthetic window).
    #[default]
    Prefill,
    /// Everyone until the first token: the others are told when it came, a charge's
    /// propagation delay later.
    FirstToken,
}
