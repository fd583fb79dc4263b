//! The `router.yaml` schema: the root and its server, index, ingestion and logging sections,
//! each with its serde defaults. Routing (policy, scorers, gate) is in `routing.rs`, pods in
//! `pods.rs`; `validate.rs` checks the values.

use serde::{Deserialize, Serialize};

use super::{DisaggConfig, FlowConfig, GateConfig, PodsConfig, Policy, RedisConfig, ScorersConfig};

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
    /// Prefill/decode disaggregation (models with `prefill`-role pods only).
    pub disaggregation: DisaggConfig,
    /// Requests held in the router while every pod is saturated (priorities, fairness).
    pub flow_control: FlowConfig,
    /// Route receipts on responses, checked against the engine's own cached-token count.
    pub receipts: ReceiptsConfig,
    /// The Gateway API Inference Extension's conformance-test hooks: the
    /// `test-epp-endpoint-selection` request header picks the candidates and responses carry
    /// `x-conformance-test-*` headers. Test clusters only: any client could steer itself.
    pub conformance_test_hooks: bool,
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

/// Route receipts: the `x-kv-router-receipt` response header, the engine's cached-token count
/// read from the response, per-pod incorrect-routing counters and `/debug/explain?id=`. Only on
/// responses the gateway shows the router (ext_proc response headers; body for the counts).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ReceiptsConfig {
    /// Set receipts on the responses the router sees, and keep recent decisions.
    pub enabled: bool,
    /// Decisions `/debug/explain?id=` can show (a fixed ring, ~1 KiB each at most).
    pub recent_decisions: usize,
}

impl Default for ReceiptsConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            recent_decisions: 1024,
        }
    }
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
    /// Most gRPC connections open at once; at the cap the oldest one still in its handshake is
    /// closed to make room, else the one that has read nothing the longest.
    pub max_connections: usize,
    /// A gRPC connection that has not sent its HTTP/2 preface (or TLS hello) by then is closed.
    pub handshake_timeout_ms: u64,
    /// A gRPC message (ext_proc or Pick) started and not complete by then fails its stream, and
    /// its reserved bytes go back to the budget.
    pub message_timeout_ms: u64,
    /// Most ext_proc streams open at once (all connections); a new one past it is refused.
    pub max_extproc_streams: usize,
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
            max_connections: 10_000,
            handshake_timeout_ms: 5_000,
            message_timeout_ms: 10_000,
            max_extproc_streams: 8_192,
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PickApiConfig {
    /// Accept `commit: true` (record the decision: index, session pin, in-flight load).
    pub allow_commit: bool,
    /// Accept a caller-chosen `subset` of endpoints.
    pub allow_subset: bool,
    /// Largest Pick message: a prompt with its headers, not a whole ext_proc body. Each one's
    /// announced length is reserved from `max_buffered_bytes` before it is read.
    pub max_message_bytes: usize,
    /// Pick messages buffered at once, apart from ext_proc's `server.max_buffered_body_bytes`,
    /// so Pick callers cannot spend the gateway's room.
    pub max_buffered_bytes: usize,
}

impl Default for PickApiConfig {
    fn default() -> Self {
        Self {
            allow_commit: false,
            allow_subset: false,
            max_message_bytes: 16 << 20,
            max_buffered_bytes: 32 << 20,
        }
    }
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
            disaggregation: DisaggConfig::default(),
            flow_control: FlowConfig::default(),
            receipts: ReceiptsConfig::default(),
            conformance_test_hooks: false,
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
    /// gRPC health only, on a port of its own (the Gateway API Inference Extension chart probes
    /// 9003); empty: none (health is on `grpc` in any case).
    pub grpc_health: String,
}

impl Default for Listen {
    fn default() -> Self {
        Self {
            grpc: "127.0.0.1:9002".into(),
            admin: "127.0.0.1:9090".into(),
            grpc_health: String::new(),
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

/// `index.max_pod_cache_tokens`' default, 2^28: about 3 TiB of KV cache (8×H200 HBM plus a
/// 2 TB host-memory offload tier) at 12 KiB a token, the smallest footprint of a served model
/// (docs/config.md).
const DEFAULT_MAX_POD_CACHE_TOKENS: u64 = 1 << 28;

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
    /// Most KV-cache tokens (`num_gpu_blocks` × block size) a pod's report is believed for: a
    /// larger report is held to this, so no pod sizes its own share of the index.
    pub max_pod_cache_tokens: u64,
    /// Removed (`config/correction.rs`): still accepted, ignored with a warning.
    #[serde(skip_serializing)]
    pub correction: crate::config::RemovedKey,
    /// The shared index (`backend: redis`).
    pub redis: RedisConfig,
    /// Starting from a live peer's index instead of an empty one (memory backend, approximate).
    pub warm_start: WarmStartConfig,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            backend: IndexBackend::Memory,
            ttl_ms: 3_600_000,
            default_capacity_blocks: 31_250,
            capacity_factor: 1.0,
            max_pod_cache_tokens: DEFAULT_MAX_POD_CACHE_TOKENS,
            correction: crate::config::RemovedKey::default(),
            redis: RedisConfig::default(),
            warm_start: WarmStartConfig::default(),
        }
    }
}

/// `index.warm_start`: a starting replica copies the index of a live peer (another replica's
/// `GET /debug/index/snapshot`) before it serves, so a rolling restart keeps what the fleet
/// learned. Memory backend in approximate mode only (the Redis mirror reloads from Redis, the
/// precise index replays the pods' KV events).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct WarmStartConfig {
    /// Admin addresses (`host:port`) of the other replicas; a name resolving to several
    /// addresses (a headless Service) names them all. Empty: every start is cold.
    pub peers: Vec<String>,
    /// The whole warm start, every peer together; past it the replica starts cold.
    pub timeout_ms: u64,
    /// Largest snapshot read from a peer (checked before and while reading).
    pub max_bytes: usize,
    /// Most (key, pod) entries a snapshot holds, served or taken.
    pub max_entries: usize,
}

impl Default for WarmStartConfig {
    fn default() -> Self {
        Self {
            peers: Vec::new(),
            timeout_ms: 5_000,
            max_bytes: 64 << 20,
            max_entries: 2_000_000,
        }
    }
}

impl IndexConfig {
    /// A pod's KV cache in tokens as it reports it (`num_gpu_blocks` of `block_tokens`), held to
    /// `max_pod_cache_tokens`, and whether that held it: a report is believed only up to the
    /// largest engine the router is configured to expect.
    pub fn pod_cache_tokens(&self, num_gpu_blocks: u64, block_tokens: u64) -> (u64, bool) {
        let reported = num_gpu_blocks.saturating_mul(block_tokens);
        (
            reported.min(self.max_pod_cache_tokens),
            reported > self.max_pod_cache_tokens,
        )
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
