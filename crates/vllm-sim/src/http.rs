//! The OpenAI-compatible HTTP surface of the simulated pod, with vLLM's response shapes.

mod models;
mod responses;

pub use responses::{ResponseStore, MAX_STORED_BYTES, MAX_STORED_RESPONSES};

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use serde_json::Value;
use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

use kv_router::blocks::namespace_seed;

use super::actor::{EngineHandle, RequestEvent, RequestStream};
use super::engine::{AdapterName, Submission, Usage, VllmInfo};
use super::metrics::{self, MetricsInfo};
use super::openai;
use super::vllm_hash::{chain, BlockDigest, HashExtras};

/// Header naming the pod that served a response.
pub const POD_HEADER: &str = "x-vllm-sim-pod";

/// Largest accepted request body (a 4 MB prompt is 4 MB plus JSON escaping).
pub const MAX_BODY_BYTES: usize = 256 << 20;

/// Default `max_tokens` when a request gives none.
pub const DEFAULT_MAX_TOKENS: u64 = 16;

/// Shared state of the HTTP handlers.
pub struct AppState {
    /// Served model names; the first is the default.
    pub models: Vec<String>,
    /// LoRA adapters (`--lora-modules`), in flag order; requests name them in `model`.
    pub adapters: Vec<Adapter>,
    /// Whether adapters compete for slots (`--enable-lora`): `/metrics` then shows them.
    pub lora_enabled: bool,
    /// Maximum prompt + output tokens.
    pub max_model_len: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks (for `/metrics`).
    pub num_gpu_blocks: usize,
    /// Value of the `x-vllm-sim-pod` header.
    pub pod_name: String,
    /// Seed for ids and output text.
    pub seed: u64,
    /// The engine actor.
    pub engine: EngineHandle,
    /// Unix time the server started (model `created`).
    pub started: u64,
    /// Response id counter.
    pub counter: AtomicU64,
    /// vLLM block hashing for KV events (`None` when events are off).
    pub vllm_hashing: Option<VllmHashing>,
    /// Prefill/decode role and its counters.
    pub pd: crate::pd::Pd,
    /// The responses `/v1/responses` produced, for `previous_response_id`.
    pub responses: ResponseStore,
}

/// A LoRA adapter the pod serves.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// Name requests use in `model`.
    pub name: AdapterName,
    /// Its path (`root` in `/v1/models`).
    pub path: String,
}

/// What the HTTP layer needs to compute vLLM block hashes of a prompt.
#[derive(Debug, Clone, Default)]
pub struct VllmHashing {
    /// `NONE_HASH`, the parent of block 0.
    pub none_hash: BlockDigest,
    /// LoRA adapters by served name: `(path, lora_id)`.
    pub loras: std::collections::HashMap<String, (String, i64)>,
}

/// The application router.
pub fn router(state: Arc<AppState>) -> Router {
    let pod = HeaderValue::from_str(&state.pod_name)
        .unwrap_or_else(|_| HeaderValue::from_static("vllm-sim"));
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/models", get(models::list_models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            let pod = pod.clone();
            async move {
                let mut res = next.run(req).await;
                res.headers_mut()
                    .insert(HeaderName::from_static(POD_HEADER), pod);
                res
            }
        }))
        .with_state(state)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorInfo<'a>,
}

#[derive(Serialize)]
struct ErrorInfo<'a> {
    message: String,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<()>,
    code: u16,
}

/// vLLM's OpenAI error response.
fn error(status: StatusCode, message: String) -> Response {
    let kind = match status {
        StatusCode::BAD_REQUEST => "BadRequestError",
        StatusCode::NOT_FOUND => "NotFoundError",
        _ => "InternalServerError",
    };
    let body = ErrorBody {
        error: ErrorInfo {
            message,
            kind,
            param: None,
            code: status.as_u16(),
        },
    };
    (status, Json(body)).into_response()
}

/// A request rejected before reaching the engine.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error(self.0, self.1)
    }
}

fn bad_request(message: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, message.into())
}

async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(serde_json::json!({"detail": "Not Found"})),
    )
        .into_response()
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> StatusCode {
    if !state.engine.reset_prefix_cache().await {
        tracing::warn!("prefix cache not reset: running requests still hold cached blocks");
    }
    StatusCode::OK
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    let stats = state.engine.stats().await;
    let lora = match state.engine.lora_info().await {
        Some(l) if state.lora_enabled => metrics::render_lora(&state.models[0], &l, &stats),
        _ => String::new(),
    };
    let info = MetricsInfo {
        model_name: state.models[0].clone(),
        block_size: state.block_size,
        num_gpu_blocks: state.num_gpu_blocks,
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics::render(&info, &stats) + &lora + &state.pd.render(),
    )
        .into_response()
}

pub(crate) fn hex_id(seed: u64, n: u64) -> String {
    let a = xxh3_64_with_seed(&n.to_le_bytes(), seed);
    let b = xxh3_64_with_seed(&n.to_le_bytes(), seed ^ 0x9e37_79b9_7f4a_7c15);
    format!("{a:016x}{b:016x}")
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(state, Api::Completions, headers, body).await
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(state, Api::ChatCompletions, headers, body).await
}

/// The generation API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    ChatCompletions,
}

/// A validated generation request.
struct Job {
    api: Api,
    model: String,
    /// The LoRA adapter `model` names, if any.
    lora: Option<AdapterName>,
    stream: bool,
    include_usage: bool,
    max_tokens: u32,
    text_seed: u64,
    submission: Submission,
}

fn parse_job(state: &AppState, api: Api, body: &[u8]) -> Result<Job, ApiError> {
    let req = openai::parse(api == Api::ChatCompletions, body).map_err(bad_request)?;
    let value: Value = serde_json::from_slice(body).map_err(|e| bad_request(e.to_string()))?;
    let mut lora = None;
    let model = match req.model {
        None => state.models[0].clone(),
        Some(m) if state.models.contains(&m) => m,
        Some(m) if state.adapters.iter().any(|a| *a.name == *m) => {
            lora = state
                .adapters
                .iter()
                .find(|a| *a.name == *m)
                .map(|a| a.name.clone());
            m
        }
        Some(m) => {
            return Err(ApiError(
                StatusCode::NOT_FOUND,
                format!("The model `{m}` does not exist."),
            ))
        }
    };
    let include_usage = match value.pointer("/stream_options/include_usage") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(bad_request(
                "stream_options.include_usage must be a boolean",
            ))
        }
    };
    if let Some(v) = value.get("ignore_eos") {
        if !v.is_null() && !v.is_boolean() {
            return Err(bad_request("ignore_eos must be a boolean"));
        }
    }
    let mut requested = None;
    let fields: &[&str] = match api {
        Api::ChatCompletions => &["max_completion_tokens", "max_tokens"],
        _ => &["max_tokens"],
    };
    for &field in fields {
        match value.get(field) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                match (v.as_u64(), v.as_i64()) {
                    (Some(n), _) if n >= 1 => requested = Some(n),
                    (_, Some(n)) => {
                        return Err(bad_request(format!("{field} must be at least 1, got {n}.")))
                    }
                    _ => return Err(bad_request(format!("{field} must be an integer"))),
                }
                break;
            }
        }
    }
    let tokens = req.tokens;
    if tokens.is_empty() {
        return Err(bad_request("The decoder prompt cannot be empty"));
    }
    let n = tokens.len();
    let max_len = state.max_model_len;
    let what = match api {
        Api::ChatCompletions => "messages",
        _ => "prompt",
    };
    if n >= max_len {
        return Err(bad_request(format!(
            "This model's maximum context length is {max_len} tokens. However, your request \
             has {n} input tokens. Please reduce the length of the input {what}."
        )));
    }
    let room = (max_len - n) as u64;
    let max_tokens = match requested {
        Some(m) if m > room => {
            return Err(bad_request(format!(
                "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum \
                 context length is {max_len} tokens and your request has {n} input tokens \
                 ({m} > {max_len} - {n})."
            )))
        }
        Some(m) => m,
        None => DEFAULT_MAX_TOKENS.min(room),
    };
    let max_tokens = u32::try_from(max_tokens).unwrap_or(u32::MAX);
    let (text_seed, submission) =
        submission(state, &model, req.cache_salt.as_ref(), tokens, max_tokens);
    Ok(Job {
        api,
        model,
        lora,
        stream: req.stream,
        include_usage,
        max_tokens,
        text_seed,
        submission,
    })
}

const WORDS: &[&str] = &[
    "the",
    "cache",
    "token",
    "model",
    "prefix",
    "block",
    "router",
    "pod",
    "request",
    "stream",
    "simulated",
    "answer",
    "of",
    "and",
    "to",
    "a",
    "in",
    "is",
    "that",
    "with",
    "for",
    "on",
    "latency",
    "batch",
    "decode",
    "prefill",
    "vector",
    "layer",
    "attention",
    "memory",
    "fast",
    "quiet",
];

/// Output token `index` of a request: a deterministic filler word.
/// A parsed request's text seed (the same prompt gets the same words) and its submission to the
/// engine, with vLLM's block digests when the pod reports them.
pub(crate) fn submission(
    state: &AppState,
    model: &str,
    cache_salt: Option<&String>,
    tokens: Vec<u32>,
    max_tokens: u32,
) -> (u64, Submission) {
    let mut hasher = Xxh3::with_seed(state.seed);
    for id in &tokens {
        hasher.update(&id.to_le_bytes());
    }
    let seed = namespace_seed(model, cache_salt.map(String::as_str));
    let vllm = state.vllm_hashing.as_ref().map(|h| {
        let lora = h.loras.get(model);
        let extras = HashExtras {
            lora: lora.map(|(path, _)| (model.to_string(), path.clone())),
            cache_salt: cache_salt.cloned(),
        };
        VllmInfo {
            digests: chain(&h.none_hash, &tokens, state.block_size, &extras),
            extras,
            lora_id: lora.map(|(_, id)| *id),
        }
    });
    let mut submission = Submission::new(seed, tokens, max_tokens, state.block_size);
    submission.vllm = vllm;
    (hasher.digest(), submission)
}

fn word(text_seed: u64, index: u32) -> String {
    let w =
        WORDS[(xxh3_64_with_seed(&index.to_le_bytes(), text_seed) % WORDS.len() as u64) as usize];
    if index == 0 {
        w.to_string()
    } else {
        format!(" {w}")
    }
}

#[derive(Serialize)]
struct UsageJson {
    prompt_tokens: u32,
    total_tokens: u32,
    completion_tokens: u32,
    prompt_tokens_details: PromptTokensDetails,
}

#[derive(Serialize)]
struct PromptTokensDetails {
    cached_tokens: u32,
}

impl From<Usage> for UsageJson {
    fn from(u: Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            total_tokens: u.prompt_tokens.saturating_add(u.completion_tokens),
            completion_tokens: u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

#[derive(Serialize)]
struct CompletionResponse<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<CompletionChoice>,
    service_tier: Option<()>,
    system_fingerprint: Option<()>,
    usage: UsageJson,
    kv_transfer_params: Option<()>,
}

#[derive(Serialize)]
struct CompletionChoice {
    index: u32,
    text: String,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
    stop_reason: Option<()>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<Value>,
}

#[derive(Serialize)]
struct ChatResponse<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<ChatChoice>,
    service_tier: Option<()>,
    system_fingerprint: Option<()>,
    usage: UsageJson,
    prompt_logprobs: Option<()>,
    kv_transfer_params: Option<()>,
}

#[derive(Serialize)]
struct ChatChoice {
    index: u32,
    message: ChatMessage,
    logprobs: Option<()>,
    finish_reason: &'static str,
    stop_reason: Option<()>,
}

#[derive(Serialize)]
struct ChatMessage {
    role: &'static str,
    reasoning_content: Option<()>,
    content: String,
    tool_calls: Vec<()>,
}

#[derive(Serialize)]
struct Chunk<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<UsageJson>,
}

#[derive(Serialize)]
struct ChatChunkChoice {
    index: u32,
    delta: Delta,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_reason: Option<Value>,
}

#[derive(Serialize)]
struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    content: String,
}

async fn generate(state: Arc<AppState>, api: Api, headers: HeaderMap, body: Bytes) -> Response {
    let job = match parse_job(&state, api, &body) {
        Ok(job) => job,
        Err(err) => return err.into_response(),
    };
    let role = state.pd.role();
    let target = state.pd.prefill_target(&headers);
    let mut prefilled_by = None;
    if role == crate::pd::Role::Prefill || target.is_some() {
        // parse_job accepted this body as JSON already.
        let value: Value = serde_json::from_slice(&body).unwrap_or_default();
        state.pd.note_request(&value, job.submission.tokens.len());
        if let Some(target) = target {
            let path = match api {
                Api::ChatCompletions => "/v1/chat/completions",
                Api::Completions => "/v1/completions",
            };
            let ok = state
                .pd
                .remote_prefill(&state.engine, target, path, &value, &job.submission)
                .await;
            prefilled_by = ok.then_some(target);
        }
    }
    drop(body);
    let mut response = respond(state, job).await;
    if let Some(t) = prefilled_by.and_then(|t| HeaderValue::from_str(&t.to_string()).ok()) {
        response
            .headers_mut()
            .insert(HeaderName::from_static(crate::pd::PREFILLED_BY_HEADER), t);
    }
    response
}

async fn respond(state: Arc<AppState>, job: Job) -> Response {
    let n = state.counter.fetch_add(1, Ordering::Relaxed);
    let id = match job.api {
        Api::ChatCompletions => format!("chatcmpl-{}", hex_id(state.seed, n)),
        _ => format!("cmpl-{}", hex_id(state.seed, n)),
    };
    let created = unix_now();
    let Job {
        api,
        model,
        lora,
        stream,
        include_usage,
        max_tokens,
        text_seed,
        submission,
    } = job;
    let events = state.engine.submit_lora(submission, lora);
    let sse = Sse {
        events,
        chat: api == Api::ChatCompletions,
        id,
        created,
        model,
        include_usage,
        max_tokens,
        text_seed,
        pending: VecDeque::new(),
        finished: false,
    };
    if stream {
        let body = Body::from_stream(futures::stream::unfold(sse, Sse::next_bytes));
        return (
            [
                (header::CONTENT_TYPE, "text/event-stream; charset=utf-8"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            body,
        )
            .into_response();
    }
    sse.collect().await
}

/// One generation's conversion from engine events to OpenAI output.
struct Sse {
    events: RequestStream,
    chat: bool,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    max_tokens: u32,
    text_seed: u64,
    pending: VecDeque<Bytes>,
    finished: bool,
}

impl Sse {
    /// Non-streaming: waits for the end and builds the whole response.
    async fn collect(mut self) -> Response {
        let mut text = String::new();
        loop {
            match self.events.recv().await {
                Some(RequestEvent::Token { index }) => text.push_str(&word(self.text_seed, index)),
                Some(RequestEvent::Done(usage)) => {
                    let usage = UsageJson::from(usage);
                    return if self.chat {
                        Json(ChatResponse {
                            id: &self.id,
                            object: "chat.completion",
                            created: self.created,
                            model: &self.model,
                            choices: vec![ChatChoice {
                                index: 0,
                                message: ChatMessage {
                                    role: "assistant",
                                    reasoning_content: None,
                                    content: text,
                                    tool_calls: Vec::new(),
                                },
                                logprobs: None,
                                finish_reason: "length",
                                stop_reason: None,
                            }],
                            service_tier: None,
                            system_fingerprint: None,
                            usage,
                            prompt_logprobs: None,
                            kv_transfer_params: None,
                        })
                        .into_response()
                    } else {
                        Json(CompletionResponse {
                            id: &self.id,
                            object: "text_completion",
                            created: self.created,
                            model: &self.model,
                            choices: vec![CompletionChoice {
                                index: 0,
                                text,
                                logprobs: None,
                                finish_reason: Some("length"),
                                stop_reason: None,
                                prompt_logprobs: Some(Value::Null),
                            }],
                            service_tier: None,
                            system_fingerprint: None,
                            usage,
                            kv_transfer_params: None,
                        })
                        .into_response()
                    };
                }
                None => {
                    return error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "the engine stopped".to_string(),
                    )
                }
            }
        }
    }

    fn push<C: Serialize>(&mut self, choices: Vec<C>, usage: Option<UsageJson>) {
        let chunk = Chunk {
            id: &self.id,
            object: if self.chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            },
            created: self.created,
            model: &self.model,
            choices,
            usage,
        };
        let json = serde_json::to_string(&chunk).unwrap_or_default();
        self.pending
            .push_back(Bytes::from(format!("data: {json}\n\n")));
    }

    fn on_token(&mut self, index: u32) {
        let text = word(self.text_seed, index);
        let last = index + 1 >= self.max_tokens.max(1);
        let finish_reason = last.then_some("length");
        if self.chat {
            if index == 0 {
                self.push(
                    vec![ChatChunkChoice {
                        index: 0,
                        delta: Delta {
                            role: Some("assistant"),
                            content: String::new(),
                        },
                        logprobs: None,
                        finish_reason: None,
                        stop_reason: None,
                    }],
                    None,
                );
            }
            self.push(
                vec![ChatChunkChoice {
                    index: 0,
                    delta: Delta {
                        role: None,
                        content: text,
                    },
                    logprobs: None,
                    finish_reason,
                    stop_reason: last.then_some(Value::Null),
                }],
                None,
            );
        } else {
            self.push(
                vec![CompletionChoice {
                    index: 0,
                    text,
                    logprobs: None,
                    finish_reason,
                    stop_reason: None,
                    prompt_logprobs: None,
                }],
                None,
            );
        }
    }

    /// Streaming: the next SSE bytes.
    async fn next_bytes(mut self) -> Option<(Result<Bytes, Infallible>, Self)> {
        loop {
            if let Some(bytes) = self.pending.pop_front() {
                return Some((Ok(bytes), self));
            }
            if self.finished {
                return None;
            }
            match self.events.recv().await {
                Some(RequestEvent::Token { index }) => self.on_token(index),
                Some(RequestEvent::Done(usage)) => {
                    if self.include_usage {
                        self.push::<ChatChunkChoice>(Vec::new(), Some(usage.into()));
                    }
                    self.pending
                        .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    self.finished = true;
                }
                None => {
                    self.pending
                        .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    self.finished = true;
                }
            }
        }
    }
}
