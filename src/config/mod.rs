//! Router configuration: YAML (serde_yaml), every field defaulted, validated once at startup.
//! Every default is documented in `docs/config.md`; a test parses the example there.

use std::net::SocketAddr;
use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

mod bounds;
mod engine;
mod kubernetes;
mod load;
mod pods;
mod redis;
pub use bounds::{check_yaml_shape, MAX_YAML_BYTES};
pub use engine::{CustomEngine, EngineSetting, Preset, MAX_METRIC_NAME_BYTES};
pub use kubernetes::{KubernetesConfig, KubernetesOverrides, PoolRef, PortRef};
pub use pods::{DnsSource, PodsConfig, StaticPod};
pub use redis::{redact_url, RedisConfig, RedisMode};

/// Root of `router.yaml`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Listening addresses.
    pub listen: Listen,
    /// Largest request body accepted (both body modes); also tonic's decode limit.
    pub body_limit_bytes: usize,
    /// Unparsable bodies get a 400 from the router instead of being routed by load.
    pub strict: bool,
    /// Also set the `x-gateway-destination-endpoint` request header (GIE compatibility).
    pub destination_header: bool,
    /// Fallback endpoints listed after the primary (tried in order on retry).
    pub fallbacks: usize,
    /// Routing policy.
    pub policy: Policy,
    /// How prompts are cut into block keys.
    pub blocks: BlocksConfig,
    /// Prefix index.
    pub index: IndexConfig,
    /// Scorer weights and parameters.
    pub scorers: ScorersConfig,
    /// Saturation gate.
    pub gate: GateConfig,
    /// Where pods come from and how they are watched.
    pub pods: PodsConfig,
    /// vLLM KV-event ingestion (precise mode).
    pub kv_events: KvEventsConfig,
    /// Tokenizers per model (precise mode); models without one use approximate text blocks.
    pub tokenizers: Vec<TokenizerConfig>,
    /// Logging.
    pub log: LogConfig,
    /// What callers of the `Pick` gRPC service may do.
    pub pick_api: PickApiConfig,
    /// gRPC server limits and shutdown.
    pub server: ServerConfig,
    /// Admin port access.
    pub admin: AdminConfig,
}

/// Admin port access: `/debug/*` needs `Authorization: Bearer <token>` when a token is set;
/// `/metrics`, `/healthz` and `/readyz` stay open (scrapers and probes).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// The bearer token (prefer `token_file`).
    pub token: String,
    /// A file holding the token (e.g. a mounted Secret); wins over `token`.
    pub token_file: Option<std::path::PathBuf>,
}

/// gRPC server limits and shutdown.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Most concurrent HTTP/2 streams per gRPC connection (Envoy opens more connections).
    pub max_concurrent_streams: u32,
    /// After SIGTERM/SIGINT, readiness is NOT_SERVING but new streams are still served this long,
    /// so gateways' health checks and endpoint updates stop choosing this replica first.
    pub shutdown_delay_ms: u64,
    /// Then the listeners close and in-flight streams get this long before they are closed.
    pub shutdown_grace_ms: u64,
    /// Request-body bytes buffered across all ext_proc streams; a chunk past it gets a 503.
    pub max_buffered_body_bytes: usize,
    /// TLS on the gRPC port (ext_proc, Pick, health); none of its files set: plaintext.
    pub tls: GrpcTlsConfig,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_concurrent_streams: 4096,
            shutdown_delay_ms: 5_000,
            shutdown_grace_ms: 20_000,
            max_buffered_body_bytes: 256 << 20,
            tls: GrpcTlsConfig::default(),
        }
    }
}

/// TLS for the gRPC port, read at startup (rotate certificates with a rolling restart).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcTlsConfig {
    /// PEM certificate chain the router presents.
    pub cert_file: Option<String>,
    /// Its PEM private key.
    pub key_file: Option<String>,
    /// PEM CA that client certificates must chain to (mTLS); none: clients are not asked.
    pub client_ca_file: Option<String>,
}

impl GrpcTlsConfig {
    /// Whether the port serves TLS.
    pub fn enabled(&self) -> bool {
        self.cert_file.is_some()
    }
}

/// The `Pick` service shares the ext_proc port, so anyone who reaches that port may call it:
/// by default it only ranks (reads), and recording state is opt-in.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PickApiConfig {
    /// Accept `commit: true` (record the decision: index, session pin, in-flight load).
    pub allow_commit: bool,
    /// Accept a caller-chosen `subset` of endpoints.
    pub allow_subset: bool,
}

/// vLLM KV-event ingestion.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// Subscribe to every pod's KV-event publisher and index its blocks exactly.
    pub enabled: bool,
    /// PUB endpoint template; `{ip}` and `{port}` (the pod's HTTP port) are substituted.
    pub endpoint: String,
    /// Replay (ROUTER) endpoint template; empty = pods run no replay socket.
    pub replay_endpoint: String,
    /// Topic prefix subscribed to (`""` = all messages).
    pub topic: String,
    /// Data-parallel ranks per pod; rank r publishes on the endpoint's port + r.
    pub data_parallel_size: u32,
    /// Router block size in tokens (need not equal the engine's).
    pub block_tokens: usize,
    /// Speculative entries (the chosen pod, right after a decision) live this long.
    pub speculative_ttl_ms: u64,
    /// Weight of GPU-resident blocks in the kv-cache score.
    pub gpu_weight: f64,
    /// Weight of CPU-offloaded blocks.
    pub cpu_weight: f64,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            endpoint: "tcp://{ip}:5557".into(),
            replay_endpoint: String::new(),
            topic: String::new(),
            data_parallel_size: 1,
            block_tokens: 16,
            speculative_ttl_ms: 30_000,
            gpu_weight: 1.0,
            cpu_weight: 0.8,
        }
    }
}

/// A model's tokenizer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TokenizerConfig {
    /// Model name as requests send it (LoRA adapters: their base model's tokenizer applies).
    pub model: String,
    /// HuggingFace `tokenizer.json` (never fetched from a hub).
    #[serde(default)]
    pub tokenizer_json: Option<std::path::PathBuf>,
    /// `tokenizer_config.json` with the chat template and special tokens.
    #[serde(default)]
    pub tokenizer_config: Option<std::path::PathBuf>,
    /// A standalone Jinja chat template overriding the one in `tokenizer_config`.
    #[serde(default)]
    pub chat_template: Option<std::path::PathBuf>,
    /// Use the built-in pseudo tokenizer that `vllm-sim` uses (4 bytes of canonical prompt per token).
    #[serde(default)]
    pub builtin: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: Listen::default(),
            body_limit_bytes: 64 << 20,
            strict: false,
            destination_header: true,
            fallbacks: 2,
            policy: Policy::Weighted,
            blocks: BlocksConfig::default(),
            index: IndexConfig::default(),
            scorers: ScorersConfig::default(),
            gate: GateConfig::default(),
            pods: PodsConfig::default(),
            kv_events: KvEventsConfig::default(),
            tokenizers: Vec::new(),
            log: LogConfig::default(),
            pick_api: PickApiConfig::default(),
            server: ServerConfig::default(),
            admin: AdminConfig::default(),
        }
    }
}

/// Listening addresses.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Listen {
    /// ext_proc, Pick and gRPC health.
    pub grpc: String,
    /// Admin HTTP: /metrics, /healthz, /readyz, /debug/*.
    pub admin: String,
}

impl Default for Listen {
    fn default() -> Self {
        Self {
            grpc: "127.0.0.1:9002".into(),
            admin: "127.0.0.1:9090".into(),
        }
    }
}

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

/// Block-key scheme (approximate mode).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct BlocksConfig {
    /// Bytes of canonical prompt per block (64 ≈ 16 tokens, vLLM's default block).
    pub size_chars: usize,
    /// Most blocks keyed per request (longer prompts are keyed on their head only).
    pub max_blocks: usize,
}

impl Default for BlocksConfig {
    fn default() -> Self {
        Self {
            size_chars: 64,
            max_blocks: 4096,
        }
    }
}

/// Prefix index.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct IndexConfig {
    /// Backend: `memory` (in process) or `redis` (shared by replicas; see `redis`).
    pub backend: IndexBackend,
    /// Entries not refreshed for this long are ignored and swept.
    pub ttl_ms: u64,
    /// Per-pod capacity in blocks when the pod does not report `num_gpu_blocks`.
    pub default_capacity_blocks: usize,
    /// Multiplier applied to a pod's `num_gpu_blocks` (router blocks may differ in size).
    pub capacity_factor: f64,
    /// The shared index (`backend: redis`).
    pub redis: RedisConfig,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            backend: IndexBackend::Memory,
            ttl_ms: 3_600_000,
            default_capacity_blocks: 31_250,
            capacity_factor: 1.0,
            redis: RedisConfig::default(),
        }
    }
}

/// Where the index lives. How it learns is `kv_events.enabled`'s choice (events, or the
/// router's own decisions); every backend serves both and passes the `KvIndex` contract suite.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum IndexBackend {
    /// In process: `MemoryIndex` (decisions) or `EventIndex` (KV events).
    Memory,
    /// Redis/Valkey shared by replicas (`RedisIndex`), with the in-process index as fallback.
    Redis,
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

/// Session scorer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SessionScorerConfig {
    /// Weight in the sum.
    pub weight: f64,
    /// Headers carrying a session id, first present wins.
    pub headers: Vec<String>,
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
            headers: vec!["x-session-id".into(), "session-id".into()],
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
    /// Requests (waiting at the pod + in flight from this router) that count as fully loaded.
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
        }
    }
}

/// Logging.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `text` or `json`.
    pub format: LogFormat,
    /// tracing-subscriber filter (RUST_LOG overrides).
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// A configuration problem, naming the key.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML does not match the schema.
    #[error("invalid YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    /// The text is too large or too deeply nested to parse.
    #[error("YAML refused before parsing: {0}")]
    Shape(String),
    /// One or more values are out of range (all listed).
    #[error("invalid configuration:\n{}", .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Problem>),
}

/// One invalid value.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// Dotted key, e.g. `scorers.load.weight`.
    pub key: String,
    /// What is wrong.
    pub reason: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.reason)
    }
}

impl Config {
    /// Reads, parses and validates a YAML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_yaml(&text)
    }

    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let cfg: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            check_yaml_shape(text)?;
            serde_yaml::from_str(text)?
        };
        cfg.validate()
    }

    /// Checks every value; reports all problems at once.
    pub fn validate(self) -> Result<Self, ConfigError> {
        let mut p = Vec::new();
        let mut bad = |key: &str, reason: &str| {
            p.push(Problem {
                key: key.to_string(),
                reason: reason.to_string(),
            })
        };
        for (key, value) in [
            ("listen.grpc", &self.listen.grpc),
            ("listen.admin", &self.listen.admin),
        ] {
            if value.parse::<SocketAddr>().is_err() {
                bad(key, "must be an ip:port socket address");
            }
        }
        if self.body_limit_bytes < 1024 {
            bad("body_limit_bytes", "must be at least 1024");
        }
        if self.fallbacks > 16 {
            bad("fallbacks", "must be at most 16");
        }
        if self.blocks.size_chars < 4 {
            bad("blocks.size_chars", "must be at least 4");
        }
        if self.blocks.max_blocks == 0 {
            bad("blocks.max_blocks", "must be positive");
        }
        if self.index.ttl_ms == 0 {
            bad("index.ttl_ms", "must be positive");
        }
        if self.index.default_capacity_blocks == 0 {
            bad("index.default_capacity_blocks", "must be positive");
        }
        if !(self.index.capacity_factor > 0.0 && self.index.capacity_factor.is_finite()) {
            bad("index.capacity_factor", "must be a positive number");
        }
        if self.index.backend == IndexBackend::Redis {
            for (key, reason) in self.index.redis.problems() {
                bad(&format!("index.redis.{key}"), reason);
            }
        }
        let s = &self.scorers;
        for (key, w) in [
            ("scorers.prefix.weight", s.prefix.weight),
            ("scorers.session.weight", s.session.weight),
            ("scorers.load.weight", s.load.weight),
            ("scorers.load.queue_weight", s.load.queue_weight),
            ("scorers.load.kv_weight", s.load.kv_weight),
            ("scorers.load.tokens_weight", s.load.tokens_weight),
            ("scorers.ttft.prior_overhead_ms", s.ttft.prior_overhead_ms),
            ("scorers.ttft.tie_ms", s.ttft.tie_ms),
            ("scorers.ttft.tie_ratio", s.ttft.tie_ratio),
            ("scorers.ttft.work_weight", s.ttft.work_weight),
        ] {
            if !(w >= 0.0 && w.is_finite()) {
                bad(key, "must be a finite number >= 0");
            }
        }
        for (key, v) in [
            ("scorers.load.queue_full", s.load.queue_full),
            ("scorers.load.tokens_full", s.load.tokens_full),
            (
                "scorers.load.prefill_tokens_per_sec",
                s.load.prefill_tokens_per_sec,
            ),
            ("scorers.ttft.prior_weight", s.ttft.prior_weight),
            ("gate.max_waiting", self.gate.max_waiting),
            ("gate.max_inflight_tokens", self.gate.max_inflight_tokens),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                bad(key, "must be a positive number");
            }
        }
        if !(self.gate.hot_abs >= 0.0 && self.gate.hot_abs.is_finite()) {
            bad("gate.hot_abs", "must be a finite number >= 0");
        }
        if self.gate.spread_half_life_ms == 0 {
            bad("gate.spread_half_life_ms", "must be positive");
        }
        if !(self.gate.hot_rel >= 1.0 && self.gate.hot_rel.is_finite()) {
            bad("gate.hot_rel", "must be a finite number >= 1");
        }
        if !(self.gate.max_kv_usage > 0.0 && self.gate.max_kv_usage <= 1.0) {
            bad("gate.max_kv_usage", "must be in (0, 1]");
        }
        if s.session.capacity == 0 {
            bad("scorers.session.capacity", "must be positive");
        }
        if s.session.ttl_ms == 0 {
            bad("scorers.session.ttl_ms", "must be positive");
        }
        if s.session
            .headers
            .iter()
            .any(|h| h.is_empty() || h.chars().any(|c| c.is_ascii_uppercase()))
        {
            bad(
                "scorers.session.headers",
                "header names must be non-empty and lower-case",
            );
        }
        for (i, pod) in self.pods.static_pods.iter().enumerate() {
            if pod.address.parse::<SocketAddr>().is_err() {
                bad(
                    &format!("pods.static[{i}].address"),
                    "must be an ip:port socket address",
                );
            }
        }
        for (i, d) in self.pods.dns.iter().enumerate() {
            if d.name.is_empty() {
                bad(&format!("pods.dns[{i}].name"), "must not be empty");
            }
            if d.refresh_ms == 0 {
                bad(&format!("pods.dns[{i}].refresh_ms"), "must be positive");
            }
        }
        if let Some(k) = &self.pods.kubernetes {
            for (key, reason) in kubernetes::problems(k) {
                bad(&key, &reason);
            }
        }
        for (key, reason) in self.pods.engine_problems() {
            bad(&key, &reason);
        }
        if self.pods.static_pods.is_empty()
            && self.pods.dns.is_empty()
            && self.pods.kubernetes.is_none()
        {
            bad(
                "pods",
                "list at least one pod under pods.static, a name under pods.dns, or set pods.kubernetes",
            );
        }
        for (key, v) in [
            ("pods.health_interval_ms", self.pods.health_interval_ms),
            ("pods.scrape_interval_ms", self.pods.scrape_interval_ms),
            (
                "pods.idle_scrape_interval_ms",
                self.pods.idle_scrape_interval_ms,
            ),
            ("pods.stale_after_ms", self.pods.stale_after_ms),
            ("pods.probe_timeout_ms", self.pods.probe_timeout_ms),
            ("pods.models_refresh_ms", self.pods.models_refresh_ms),
        ] {
            if v == 0 {
                bad(key, "must be positive");
            }
        }
        let ev = &self.kv_events;
        if ev.endpoint.is_empty() {
            bad("kv_events.endpoint", "must not be empty");
        }
        if ev.data_parallel_size == 0 || ev.data_parallel_size > 1024 {
            bad("kv_events.data_parallel_size", "must be in 1..=1024");
        }
        if ev.block_tokens == 0 {
            bad("kv_events.block_tokens", "must be positive");
        }
        for (key, w) in [
            ("kv_events.gpu_weight", ev.gpu_weight),
            ("kv_events.cpu_weight", ev.cpu_weight),
        ] {
            if !(w >= 0.0 && w.is_finite()) {
                bad(key, "must be a finite number >= 0");
            }
        }
        for (i, t) in self.tokenizers.iter().enumerate() {
            if t.model.is_empty() {
                bad(&format!("tokenizers[{i}].model"), "must not be empty");
            }
            if t.builtin == t.tokenizer_json.is_some() {
                bad(
                    &format!("tokenizers[{i}]"),
                    "set exactly one of tokenizer_json and builtin: true",
                );
            }
        }
        if self.pods.unhealthy_after == 0 {
            bad("pods.unhealthy_after", "must be at least 1");
        }
        bounds::upper_bounds(&self, &mut bad);
        if p.is_empty() {
            Ok(self)
        } else {
            Err(ConfigError::Invalid(p))
        }
    }

    /// Parsed gRPC listen address (valid after [`Config::validate`]).
    pub fn grpc_addr(&self) -> SocketAddr {
        self.listen.grpc.parse().expect("validated")
    }

    /// Parsed admin listen address (valid after [`Config::validate`]).
    pub fn admin_addr(&self) -> SocketAddr {
        self.listen.admin.parse().expect("validated")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_config_gets_defaults() {
        let cfg = Config::from_yaml("pods:\n  static:\n    - address: 127.0.0.1:8000\n").unwrap();
        assert_eq!(cfg.body_limit_bytes, 64 << 20);
        assert_eq!(cfg.policy, Policy::Weighted);
        assert_eq!(cfg.pods.static_pods[0].address, "127.0.0.1:8000");
    }

    #[test]
    fn all_problems_reported_with_keys() {
        let err = Config::from_yaml(
            "listen: { grpc: nope }\nblocks: { size_chars: 1 }\nscorers: { load: { weight: -1 } }\ngate: { max_kv_usage: 2 }\n",
        )
        .unwrap_err();
        let text = err.to_string();
        for key in [
            "listen.grpc",
            "blocks.size_chars",
            "scorers.load.weight",
            "gate.max_kv_usage",
            "pods",
        ] {
            assert!(text.contains(key), "{key} missing from: {text}");
        }
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = Config::from_yaml("pods: { static: [] }\nbogus: 1\n").unwrap_err();
        assert!(err.to_string().contains("bogus"));
    }

    #[test]
    fn documented_example_parses_and_matches_defaults() {
        let doc = include_str!("../../docs/config.md");
        let start = doc
            .find("```yaml\n")
            .expect("docs/config.md has a yaml block")
            + 8;
        let end = start + doc[start..].find("```").unwrap();
        let cfg = Config::from_yaml(&doc[start..end]).unwrap();
        // The documented example spells out every default; only the pod list differs.
        let mut expected = Config::default();
        expected.pods.static_pods = cfg.pods.static_pods.clone();
        expected.pods.dns = cfg.pods.dns.clone();
        expected.pods.kubernetes = cfg.pods.kubernetes.clone();
        assert_eq!(cfg, expected);
    }
}
