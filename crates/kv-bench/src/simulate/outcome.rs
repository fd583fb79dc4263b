//! A run's figures: hit ratio against the oracles, TTFT and end-to-end percentiles, balance.

use serde::Serialize;

use kv_router::index::ApplyStats;

use super::super::oracle::Oracles;
use super::super::report::percentile;
use super::super::strategy::Strategy;
use super::fleet::RunOutcome;
use super::options::Replication;
use super::replicas::Writes;

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
    /// Router replicas and the delay of each other's records.
    pub replication: Replication,
    /// Index records the replicas published for each other (all replicas together).
    pub writes: Writes,
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
    /// Busiest pod's share of the prompt tokens computed (not served from a cache) × pods: the
    /// prefill work, which a cache hit spares (1 = even).
    pub work_hotspot: f64,
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
    /// Each pod's prefill speed as the router learned it from the engine's counters (tokens/s).
    pub learned_tokens_per_sec: Vec<f64>,
    /// Requests prefilled on a prefill pod (P/D fleets).
    #[serde(skip_serializing_if = "is_zero")]
    pub disaggregated: u64,
    /// Adapters the engines loaded into a slot (adapter workloads).
    #[serde(skip_serializing_if = "is_zero")]
    pub adapter_loads: u64,
    /// Real time spent.
    pub timing: Timing,
}

/// Whether a count is zero (left out of the JSON report: base-model, aggregated runs).
pub(super) fn is_zero(v: &u64) -> bool {
    *v == 0
}

pub(super) fn ms(v: &[u64]) -> Vec<f64> {
    v.iter().map(|&us| us as f64 / 1e3).collect()
}

impl StrategyResult {
    /// Summarises a run; oracle ratios are filled in later ([`StrategyResult::against`]).
    pub(super) fn new(strategy: Strategy, out: RunOutcome, wall_s: f64) -> Self {
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
        let work: u64 = out.prefilled.iter().sum();
        let busiest_work = out.prefilled.iter().copied().max().unwrap_or(0);
        let makespan_s = out.makespan_us as f64 / 1e6;
        let ttft_cdf_ms = (0..=100)
            .map(|p| percentile(&mut ttft, f64::from(p)))
            .collect();
        Self {
            strategy,
            pods,
            replication: out.replication,
            writes: out.writes,
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
            work_hotspot: busiest_work as f64 / work.max(1) as f64 * pods as f64,
            per_pod: out.per_pod,
            all_saturated: out.all_saturated,
            makespan_s,
            ttft_cdf_ms,
            kv_events: out.kv_events,
            learned_tokens_per_sec: out.learned_tokens_per_sec,
            disaggregated: out.disaggregated as u64,
            adapter_loads: out.adapter_loads,
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
    pub(super) fn against(self, oracles: &Oracles) -> Self {
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
