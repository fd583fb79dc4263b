//! The routing sections of `router.yaml`: the policy, the scorers' weights and parameters, and
//! the saturation gate, each with its serde defaults.

use serde::{Deserialize, Serialize};

/// Routing policy.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Weighted sum of the prefix, session and load scorers behind the saturation gate.
    Weighted,
    /// Rotate over candidates.
    RoundRobin,
    /// Uniformly random candidate.
    Random,
    /// Lowest load.
    LeastLoaded,
    /// Lowest predicted time to first token (learned per pod), near-ties to cache affinity.
    PredictedTtft,
}

impl Policy {
    /// Stable name for metrics and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Weighted => "weighted",
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
            Policy::LeastLoaded => "least-loaded",
            Policy::PredictedTtft => "predicted-ttft",
        }
    }
}

/// Scorer weights and parameters.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ScorersConfig {
    /// Prefix scorer: matched consecutive blocks / total blocks.
    pub prefix: PrefixScorerConfig,
    /// Session stickiness.
    pub session: SessionScorerConfig,
    /// Load.
    pub load: LoadScorerConfig,
    /// The `predicted-ttft` policy's model.
    pub ttft: TtftConfig,
    /// LoRA adapter residency (`docs/lora.md`).
    pub lora: super::LoraScorerConfig,
}

/// The `predicted-ttft` policy: its prior (the prefill speed is `load.prefill_tokens_per_sec`)
/// and what counts as a tie.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TtftConfig {
    /// Per-request prefill overhead assumed before a pod's engine reports its own (ms).
    pub prior_overhead_ms: f64,
    /// How many observed prefills the prior counts as.
    pub prior_weight: f64,
    /// Predictions within this many ms of the best are ties, broken toward cache affinity.
    pub tie_ms: f64,
    /// ...or within this fraction of the best prediction.
    pub tie_ratio: f64,
    /// How much a candidate's own prefill time counts again as the work it commits the pod to
    /// (everything routed there later waits behind it): rank by `ttft + this × prefill`.
    pub work_weight: f64,
}

impl Default for TtftConfig {
    fn default() -> Self {
        Self {
            prior_overhead_ms: 10.0,
            prior_weight: 1.0,
            tie_ms: 10.0,
            tie_ratio: 0.05,
            work_weight: 1.0,
        }
    }
}

/// Prefix scorer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixScorerConfig {
    /// Weight in the sum.
    pub weight: f64,
}

impl Default for PrefixScorerConfig {
    fn default() -> Self {
        Self { weight: 3.0 }
    }
}

/// The default session headers: the generic two, then those coding agents send on every
/// request (Claude Code, OpenCode, Codex CLI; docs/sessions.md says where each was confirmed).
pub const DEFAULT_SESSION_HEADERS: [&str; 5] = [
    "x-session-id",
    "session-id",
    "x-claude-code-session-id",
    "x-session-affinity",
    "session_id",
];

/// Session scorer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SessionScorerConfig {
    /// Weight in the sum.
    pub weight: f64,
    /// Headers carrying a session id, first present wins (coding agents' own among the defaults:
    /// docs/sessions.md).
    pub headers: Vec<String>,
    /// Without a header, the body's `prompt_cache_key` names the session.
    pub use_prompt_cache_key: bool,
    /// Fall back to the body's `user` field.
    pub use_user_field: bool,
    /// Idle sessions are forgotten after this long.
    pub ttl_ms: u64,
    /// Most sessions remembered (least recently used dropped first).
    pub capacity: usize,
}

impl Default for SessionScorerConfig {
    fn default() -> Self {
        Self {
            weight: 1.0,
            headers: DEFAULT_SESSION_HEADERS
                .iter()
                .map(|h| h.to_string())
                .collect(),
            use_prompt_cache_key: true,
            use_user_field: true,
            ttl_ms: 1_800_000,
            capacity: 100_000,
        }
    }
}

/// Load scorer: `1 − Σ wᵢ·signalᵢ / Σ wᵢ`, each signal normalised to [0,1].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LoadScorerConfig {
    /// Weight in the sum.
    pub weight: f64,
    /// Requests (the larger of the pod's waiting + running and this router's in-flight count)
    /// that count as fully loaded.
    pub queue_full: f64,
    /// Weight of the queue signal.
    pub queue_weight: f64,
    /// Weight of `vllm:kv_cache_usage_perc`.
    pub kv_weight: f64,
    /// Uncached prompt tokens in flight that count as fully loaded.
    pub tokens_full: f64,
    /// Weight of the in-flight uncached-token signal.
    pub tokens_weight: f64,
    /// Assumed prefill speed of a pod: routed uncached tokens stay counted for `tokens / this`
    /// seconds when the response itself is not observed (BUFFERED mode).
    pub prefill_tokens_per_sec: f64,
    /// Most prompt tokens one request is charged as in-flight load (the models' max_model_len):
    /// a longer prompt from a client cannot count for more than a pod would accept.
    pub max_prompt_tokens: u64,
}

impl Default for LoadScorerConfig {
    fn default() -> Self {
        Self {
            weight: 2.0,
            queue_full: 32.0,
            queue_weight: 1.0,
            kv_weight: 0.5,
            tokens_full: 32_768.0,
            tokens_weight: 1.0,
            prefill_tokens_per_sec: 10_000.0,
            max_prompt_tokens: 131_072,
        }
    }
}

/// Saturation gate: saturated pods are not candidates while an unsaturated one exists.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct GateConfig {
    /// Off: every healthy pod stays a candidate.
    pub enabled: bool,
    /// Saturated at this many waiting requests (pod queue + router in flight beyond running).
    pub max_waiting: f64,
    /// Saturated at this KV-cache usage.
    pub max_kv_usage: f64,
    /// Saturated at this many uncached prompt tokens in flight from this router.
    pub max_inflight_tokens: f64,
    /// A pod whose metrics are stale counts as saturated.
    pub stale_is_saturated: bool,
    /// A pod is hot (skipped like a saturated one) when its requests (running + waiting + routed
    /// but not yet visible) exceed the least loaded candidate's by more than this...
    pub hot_abs: f64,
    /// ...and are more than this many times the least loaded candidate's.
    pub hot_rel: f64,
    /// A new conversation whose matched prefix other conversations share (a system prompt)
    /// goes to the least busy holder of that prefix, warming a second pod when one holds it,
    /// instead of to the prefix's first holder (whose later turns would all pile up there).
    pub spread_new_conversations: bool,
    /// Without sessions, a new conversation placed on a pod counts against it as one live
    /// conversation, halving every this many milliseconds.
    pub spread_half_life_ms: u64,
    /// Without a session id, a prompt that shares only a prefix with what the pods hold (a long
    /// system prompt, then its own text) is spread like a new conversation while every holder of
    /// the prefix is busy and a pod with no requests would answer it sooner: that pod warms the
    /// prefix once, and later conversations have two holders to choose from. Only while at most
    /// half the candidates have requests and the shared part is the longer one.
    pub replicate_to_idle: bool,
}

impl Default for GateConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_waiting: 8.0,
            max_kv_usage: 0.95,
            max_inflight_tokens: 65_536.0,
            stale_is_saturated: true,
            hot_abs: 4.0,
            hot_rel: 1.5,
            spread_new_conversations: true,
            spread_half_life_ms: 300_000,
            replicate_to_idle: true,
        }
    }
}
