//! `vllm-sim`: a simulated vLLM pod for tests, demos and benchmarks (no GPU needed).
//!
//! ```text
//! HTTP (http) ─► openai (own parser, pseudo tokens) ─► actor (tokio task) ─► engine (pure) ─► cache
//! ```
//! The [`engine`] is a deterministic scheduler (prefix cache, continuous batching, latency
//! model) driven by explicit timestamps; the [`actor`] drives it with real timers; [`http`]
//! speaks vLLM's OpenAI-compatible wire format. See `docs/vllm-sim.md`.

pub mod actor;
pub mod cache;
pub mod engine;
pub mod http;
pub mod kv_events;
pub mod metrics;
pub mod openai;
pub mod pd;
pub mod translate;
pub mod vllm_hash;

use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use clap::Parser;

use engine::{Engine, EngineConfig};

/// Command-line flags of `vllm-sim` (defaults documented in `docs/vllm-sim.md`).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "vllm-sim",
    about = "Simulated vLLM pod (OpenAI-compatible API, prefix cache)"
)]
pub struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = pick a free port; the address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Served model name (repeatable; the first is the default for requests without `model`).
    #[arg(
        long = "model",
        alias = "served-model-name",
        default_value = "sim-model"
    )]
    pub models: Vec<String>,
    /// Pod name sent in the `x-vllm-sim-pod` header (default: the listen address).
    #[arg(long)]
    pub pod_name: Option<String>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks on the simulated GPU (prefix-cache capacity).
    #[arg(long, default_value_t = 2048)]
    pub num_gpu_blocks: usize,
    /// Maximum concurrently running requests; more wait FIFO.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Maximum prompt + output tokens per request.
    #[arg(long, default_value_t = 4_194_304)]
    pub max_model_len: usize,
    /// Fixed time-to-first-token overhead, milliseconds.
    #[arg(long, default_value_t = 15.0)]
    pub ttft_base_ms: f64,
    /// Prefill compute per uncached prompt token, microseconds (single prefill lane per pod).
    #[arg(long, default_value_t = 100.0)]
    pub prefill_us_per_token: f64,
    /// Decode time per output token with a batch of one, milliseconds.
    #[arg(long, default_value_t = 10.0)]
    pub decode_ms_per_token: f64,
    /// Relative decode slowdown per running request.
    #[arg(long, default_value_t = 0.01)]
    pub decode_batch_slowdown: f64,
    /// Prefill tokens each decode step carries while a prefill runs (vLLM's chunked prefill,
    /// `max_num_batched_tokens`): decode stalls behind prefills. 0: no interference.
    #[arg(long, default_value_t = 0)]
    pub prefill_chunk_tokens: usize,
    /// Seed for response ids and generated text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// LoRA adapters served as extra models, `name=path` (repeatable, or several per flag).
    #[arg(long = "lora-modules", num_args = 1.., value_parser = parse_lora)]
    pub lora_modules: Vec<(String, String)>,
    /// Schedule LoRA adapters like vLLM: `--max-loras` GPU slots, loads, LRU eviction.
    #[arg(long)]
    pub enable_lora: bool,
    /// Adapters resident on the GPU at once (vLLM's `--max-loras`; needs `--enable-lora`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_loras: u32,
    /// Time to load an adapter into a slot, milliseconds (sim only; paid before its prefill).
    #[arg(long, default_value_t = 50.0)]
    pub lora_load_ms: f64,
    /// Publish vLLM KV-cache events on this ZMQ PUB endpoint (binds if it contains `*` or
    /// `::` or is `ipc://`, else connects). `tcp://*:0` binds an ephemeral port on 127.0.0.1.
    #[arg(long)]
    pub kv_events_endpoint: Option<String>,
    /// Topic (first frame) of every KV-event message.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// ZMQ ROUTER endpoint of the replay service (always binds; needs `--kv-events-endpoint`).
    #[arg(long)]
    pub kv_events_replay_endpoint: Option<String>,
    /// Batches kept for replay.
    #[arg(long, default_value_t = 10_000)]
    pub kv_events_buffer_steps: usize,
    /// Publish block hashes as 32-byte digests (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    #[arg(long)]
    pub kv_events_bytes_hashes: bool,
    /// Data-parallel rank: offsets tcp KV-event ports and is stamped into every batch.
    #[arg(long, default_value_t = 0)]
    pub data_parallel_rank: i64,
    /// Prefill/decode role: `decode` prefills on the pod named by `--prefill-header` first.
    #[arg(long, value_enum, default_value_t = pd::Role::Both)]
    pub role: pd::Role,
    /// Request header naming the prefill pod (`ip:port`) of a decode pod.
    #[arg(long, default_value = "x-prefiller-host-port", value_parser = parse_header_name)]
    pub prefill_header: String,
    /// KV-transfer bandwidth from a prefill pod, blocks per second (0: instant).
    #[arg(long, default_value_t = 20_000.0)]
    pub kv_transfer_blocks_per_sec: f64,
    /// Longest wait for a prefill pod before prefilling locally, milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub remote_prefill_timeout_ms: u64,
}

fn parse_header_name(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_".contains(c));
    ok.then(|| s.to_string())
        .ok_or_else(|| format!("expected a lower-case header name of at most 64 bytes, got {s:?}"))
}

fn parse_lora(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_string(), path.to_string()))
        }
        _ => Err(format!("expected name=path, got {s:?}")),
    }
}

impl Args {
    /// The engine configuration these flags describe.
    pub fn engine_config(&self) -> EngineConfig {
        let finite = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
        EngineConfig {
            block_size: self.block_size.max(1),
            num_gpu_blocks: self.num_gpu_blocks,
            max_num_seqs: self.max_num_seqs.max(1),
            ttft_base_us: finite(self.ttft_base_ms) * 1000.0,
            prefill_us_per_token: finite(self.prefill_us_per_token),
            decode_us_per_token: finite(self.decode_ms_per_token) * 1000.0,
            decode_batch_slowdown: finite(self.decode_batch_slowdown),
            prefill_chunk_tokens: self.prefill_chunk_tokens,
        }
    }
}

impl Args {
    /// The adapter scheduling these flags describe (`None` without `--enable-lora`).
    pub fn lora_config(&self) -> Option<engine::LoraConfig> {
        let ms = if self.lora_load_ms.is_finite() {
            self.lora_load_ms.max(0.0)
        } else {
            0.0
        };
        self.enable_lora.then(|| engine::LoraConfig {
            max_loras: self.max_loras.max(1) as usize,
            load_us: ms * 1000.0,
        })
    }
}

/// Binds, prints `vllm-sim listening on <addr>` to stdout, and serves until the process ends.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port)).await?;
    let addr: SocketAddr = listener.local_addr()?;
    let mut lines = vec![format!("vllm-sim listening on {addr}")];
    let (events_tx, vllm_hashing) = match &args.kv_events_endpoint {
        Some(endpoint) => {
            let (tx, eps) = kv_events::start(kv_events::KvEventsConfig {
                endpoint: endpoint.clone(),
                topic: args.kv_events_topic.clone(),
                replay_endpoint: args.kv_events_replay_endpoint.clone(),
                buffer_steps: args.kv_events_buffer_steps,
                data_parallel_rank: args.data_parallel_rank,
                bytes_hashes: args.kv_events_bytes_hashes,
            })
            .await?;
            lines.push(format!("vllm-sim kv-events on {}", eps.publisher));
            if let Some(replay) = &eps.replay {
                lines.push(format!("vllm-sim kv-events replay on {replay}"));
            }
            let hashing = http::VllmHashing {
                none_hash: vllm_hash::none_hash(vllm_hash::DEFAULT_SEED),
                loras: args
                    .lora_modules
                    .iter()
                    .enumerate()
                    .map(|(i, (name, path))| (name.clone(), (path.clone(), i as i64 + 1)))
                    .collect(),
            };
            (Some(tx), Some(hashing))
        }
        None => {
            if args.kv_events_replay_endpoint.is_some() {
                anyhow::bail!("--kv-events-replay-endpoint needs --kv-events-endpoint");
            }
            (None, None)
        }
    };
    let mut engine = Engine::new(args.engine_config());
    if let Some(cfg) = args.lora_config() {
        engine = engine.with_lora(cfg);
    }
    let engine = actor::spawn(engine, events_tx);
    let mut models = args.models.clone();
    if models.is_empty() {
        models.push("sim-model".into());
    }
    let mut adapters: Vec<http::Adapter> = Vec::new();
    for (name, path) in &args.lora_modules {
        if !models.contains(name) && !adapters.iter().any(|a| &*a.name == name) {
            adapters.push(http::Adapter {
                name: name.as_str().into(),
                path: path.clone(),
            });
        }
    }
    let state = Arc::new(http::AppState {
        models,
        adapters,
        lora_enabled: args.enable_lora,
        max_model_len: args.max_model_len,
        block_size: args.block_size.max(1),
        num_gpu_blocks: args.num_gpu_blocks,
        pod_name: args.pod_name.clone().unwrap_or_else(|| addr.to_string()),
        seed: args.seed,
        engine,
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        counter: AtomicU64::new(0),
        vllm_hashing,
        pd: pd::Pd::new(pd::PdConfig {
            role: args.role,
            header: args.prefill_header.clone(),
            transfer_blocks_per_sec: args.kv_transfer_blocks_per_sec,
            timeout: std::time::Duration::from_millis(args.remote_prefill_timeout_ms.max(1)),
        }),
        responses: http::ResponseStore::default(),
    });
    {
        let mut out = std::io::stdout().lock();
        for line in &lines {
            writeln!(out, "{line}")?;
        }
        out.flush()?;
    }
    tracing::info!(%addr, pod = %state.pod_name, "vllm-sim started");
    axum::serve(listener, http::router(state)).await?;
    Ok(())
}
