//! `/v1/responses`, the OpenAI Responses API as vLLM serves it, through the same engine as chat
//! completions (prefix cache, queueing, TTFT).
//!
//! The input (a string or a list of message items), `instructions` and, with
//! `previous_response_id`, the stored conversation that response ended are rendered with the
//! model's chat template, so a chained turn extends the previous turn's prompt (and hits its
//! cached blocks) as long as the instructions stay the same. Like vLLM, the pod keeps the
//! responses it produced in its own memory (bounded here: the least recent go first) and answers
//! 404 for a `previous_response_id` it does not hold, which is why a chained request must reach the
//! pod that served the response it continues.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use lru::LruCache;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::{
    bad_request, error, hex_id, submission, unix_now, word, ApiError, AppState, DEFAULT_MAX_TOKENS,
};
use crate::actor::{RequestEvent, RequestStream};
use crate::engine::{AdapterName, Submission, Usage};
use crate::openai;

/// Most responses a pod keeps for chaining.
pub const MAX_STORED_RESPONSES: usize = 4096;
/// Most bytes of conversation text the kept responses hold together.
pub const MAX_STORED_BYTES: usize = 64 << 20;

/// One message of a stored conversation.
#[derive(Debug, Clone, Serialize)]
struct Message {
    role: String,
    content: String,
}

/// The conversations of the responses this pod produced, by response id, bounded in count and
/// bytes (least recently stored or chained first out).
pub struct ResponseStore {
    inner: Mutex<Stored>,
}

struct Stored {
    map: LruCache<String, Arc<[Message]>>,
    bytes: usize,
    max_bytes: usize,
}

fn size(id: &str, messages: &[Message]) -> usize {
    id.len()
        + messages
            .iter()
            .map(|m| m.role.len() + m.content.len())
            .sum::<usize>()
}

impl Default for ResponseStore {
    fn default() -> Self {
        Self::with_limits(MAX_STORED_RESPONSES, MAX_STORED_BYTES)
    }
}

impl ResponseStore {
    /// A store of at most `count` responses and `bytes` bytes of their text.
    pub fn with_limits(count: usize, bytes: usize) -> Self {
        Self {
            inner: Mutex::new(Stored {
                map: LruCache::new(NonZeroUsize::new(count.max(1)).expect("max(1)")),
                bytes: 0,
                max_bytes: bytes,
            }),
        }
    }

    fn get(&self, id: &str) -> Option<Arc<[Message]>> {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        s.map.get(id).cloned()
    }

    fn put(&self, id: String, messages: Vec<Message>) {
        let bytes = size(&id, &messages);
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if bytes > s.max_bytes {
            return;
        }
        if let Some((old_id, old)) = s.map.push(id, messages.into()) {
            s.bytes -= size(&old_id, &old);
        }
        s.bytes += bytes;
        while s.bytes > s.max_bytes {
            match s.map.pop_lru() {
                Some((old_id, old)) => s.bytes -= size(&old_id, &old),
                None => break,
            }
        }
    }

    /// Responses kept.
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map
            .len()
    }

    /// No response kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Deserialize)]
struct Request {
    model: Option<String>,
    input: Value,
    instructions: Option<String>,
    previous_response_id: Option<String>,
    stream: Option<bool>,
    store: Option<bool>,
    max_output_tokens: Option<i64>,
    cache_salt: Option<String>,
}

/// A part's or item's text: a string, or the `text` of each part of a list.
fn content_text(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match p.get("text") {
                    Some(Value::String(t)) => out.push_str(t),
                    Some(_) => return Err(bad_request("a content part's text must be a string")),
                    // Images, files: the simulated model reads text only.
                    None => {}
                }
            }
            Ok(out)
        }
        _ => Err(bad_request("content must be a string or a list of parts")),
    }
}

/// The Responses `input` as chat messages: a string is one user message; a list holds messages
/// (`role` and `content`), function calls and their outputs.
fn input_messages(input: &Value) -> Result<Vec<Message>, ApiError> {
    let items = match input {
        Value::String(s) => {
            return Ok(vec![Message {
                role: "user".into(),
                content: s.clone(),
            }])
        }
        Value::Array(items) => items,
        _ => return Err(bad_request("input must be a string or a list of items")),
    };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let Value::Object(o) = item else {
            return Err(bad_request("each input item must be an object"));
        };
        let text = |field: &str| match o.get(field) {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(bad_request(format!(
                "this input item needs a string {field}"
            ))),
        };
        match o.get("type").and_then(Value::as_str) {
            None | Some("message") => {
                let role = text("role")?;
                let content = content_text(o.get("content").unwrap_or(&Value::Null))?;
                out.push(Message { role, content });
            }
            Some("function_call") => out.push(Message {
                role: "assistant".into(),
                content: format!("{}({})", text("name")?, text("arguments")?),
            }),
            Some("function_call_output") => out.push(Message {
                role: "tool".into(),
                content: text("output")?,
            }),
            // Reasoning and other items carry nothing the simulated template renders.
            Some(_) => {}
        }
    }
    Ok(out)
}

/// A validated request: the engine submission and what the response echoes.
struct Job {
    model: String,
    lora: Option<AdapterName>,
    stream: bool,
    store: bool,
    max_tokens: u32,
    text_seed: u64,
    instructions: Option<String>,
    previous_response_id: Option<String>,
    /// The conversation so far (the stored one, then the input), without the instructions.
    conversation: Vec<Message>,
    submission: Submission,
}

fn model_of(
    state: &AppState,
    model: Option<String>,
) -> Result<(String, Option<AdapterName>), ApiError> {
    match model {
        None => Ok((state.models[0].clone(), None)),
        Some(m) if state.models.contains(&m) => Ok((m, None)),
        Some(m) => match state.adapters.iter().find(|a| *a.name == *m) {
            Some(a) => Ok((m, Some(a.name.clone()))),
            None => Err(ApiError(
                StatusCode::NOT_FOUND,
                format!("The model `{m}` does not exist."),
            )),
        },
    }
}

fn parse(state: &AppState, body: &[u8]) -> Result<Job, ApiError> {
    let req: Request = serde_json::from_slice(body).map_err(|e| bad_request(e.to_string()))?;
    let (model, lora) = model_of(state, req.model)?;
    let mut conversation = Vec::new();
    if let Some(id) = &req.previous_response_id {
        let Some(previous) = state.responses.get(id) else {
            return Err(ApiError(
                StatusCode::NOT_FOUND,
                format!("Response with id '{id}' not found."),
            ));
        };
        conversation.extend(previous.iter().cloned());
    }
    conversation.extend(input_messages(&req.input)?);
    let instructions = req.instructions.filter(|i| !i.is_empty());
    let mut rendered: Vec<&Message> = Vec::with_capacity(conversation.len() + 1);
    let system = instructions.as_ref().map(|i| Message {
        role: "system".into(),
        content: i.clone(),
    });
    rendered.extend(system.as_ref());
    rendered.extend(&conversation);
    let chat = serde_json::to_vec(&json!({ "messages": rendered }))
        .map_err(|e| bad_request(e.to_string()))?;
    let tokens = openai::parse(true, &chat).map_err(bad_request)?.tokens;
    if tokens.is_empty() {
        return Err(bad_request("The decoder prompt cannot be empty"));
    }
    let (n, max_len) = (tokens.len(), state.max_model_len);
    if n >= max_len {
        return Err(bad_request(format!(
            "This model's maximum context length is {max_len} tokens. However, your request \
             has {n} input tokens. Please reduce the length of the input."
        )));
    }
    let room = (max_len - n) as u64;
    let max_tokens = match req.max_output_tokens {
        None => DEFAULT_MAX_TOKENS.min(room),
        Some(m) if m < 1 => {
            return Err(bad_request(format!(
                "max_output_tokens must be at least 1, got {m}."
            )))
        }
        Some(m) if m as u64 > room => {
            return Err(bad_request(format!(
                "max_output_tokens is too large: {m}. This model's maximum context length is \
                 {max_len} tokens and your request has {n} input tokens."
            )))
        }
        Some(m) => m as u64,
    };
    let max_tokens = u32::try_from(max_tokens).unwrap_or(u32::MAX);
    let (text_seed, submission) =
        submission(state, &model, req.cache_salt.as_ref(), tokens, max_tokens);
    Ok(Job {
        model,
        lora,
        stream: req.stream.unwrap_or(false),
        store: req.store.unwrap_or(true),
        max_tokens,
        text_seed,
        instructions,
        previous_response_id: req.previous_response_id,
        conversation,
        submission,
    })
}

/// `POST /v1/responses`.
pub(super) async fn create(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let job = match parse(&state, &body) {
        Ok(job) => job,
        Err(e) => return e.into_response(),
    };
    drop(body);
    let n = state.counter.fetch_add(1, Ordering::Relaxed);
    let Job {
        model,
        lora,
        stream,
        store,
        max_tokens,
        text_seed,
        instructions,
        previous_response_id,
        conversation,
        submission,
    } = job;
    let out = Output {
        events: state.engine.submit_lora(submission, lora),
        id: format!("resp_{}", hex_id(state.seed, n)),
        item_id: format!("msg_{}", hex_id(state.seed ^ 0x6d73_675f, n)),
        created_at: unix_now(),
        model,
        instructions,
        previous_response_id,
        conversation: store.then_some(conversation),
        state,
        max_tokens,
        text_seed,
        text: String::new(),
        pending: VecDeque::new(),
        sequence: 0,
        finished: false,
    };
    if stream {
        let body = Body::from_stream(futures::stream::unfold(out, Output::next_bytes));
        return (
            [
                (header::CONTENT_TYPE, "text/event-stream; charset=utf-8"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            body,
        )
            .into_response();
    }
    out.collect().await
}

/// One response's generation: engine events to the Responses API's object or SSE events.
struct Output {
    events: RequestStream,
    id: String,
    item_id: String,
    created_at: u64,
    model: String,
    instructions: Option<String>,
    previous_response_id: Option<String>,
    /// The conversation to keep under this response's id (`store: false`: none).
    conversation: Option<Vec<Message>>,
    state: Arc<AppState>,
    max_tokens: u32,
    text_seed: u64,
    text: String,
    pending: VecDeque<Bytes>,
    sequence: u64,
    finished: bool,
}

fn usage_json(u: Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens.saturating_add(u.completion_tokens),
    })
}

impl Output {
    fn message(&self, status: &str) -> Value {
        let content = if status == "completed" {
            json!([{"type": "output_text", "text": self.text, "annotations": []}])
        } else {
            json!([])
        };
        json!({
            "type": "message",
            "id": self.item_id,
            "role": "assistant",
            "status": status,
            "content": content,
        })
    }

    /// The response object; `usage` once it is done.
    fn response(&self, usage: Option<Usage>) -> Value {
        let done = usage.is_some();
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": if done { "completed" } else { "in_progress" },
            "instructions": self.instructions,
            "previous_response_id": self.previous_response_id,
            "max_output_tokens": self.max_tokens,
            "output": if done { json!([self.message("completed")]) } else { json!([]) },
            "parallel_tool_calls": true,
            "tool_choice": "auto",
            "tools": [],
            "store": self.conversation.is_some(),
            "usage": usage.map(usage_json),
        })
    }

    /// Keeps the finished conversation for later `previous_response_id`s.
    fn keep(&mut self) {
        if let Some(mut conversation) = self.conversation.take() {
            conversation.push(Message {
                role: "assistant".into(),
                content: self.text.clone(),
            });
            self.state.responses.put(self.id.clone(), conversation);
        }
    }

    async fn collect(mut self) -> Response {
        loop {
            match self.events.recv().await {
                Some(RequestEvent::Token { index }) => {
                    self.text.push_str(&word(self.text_seed, index));
                }
                Some(RequestEvent::Done(usage)) => {
                    let body = self.response(Some(usage));
                    self.keep();
                    return Json(body).into_response();
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

    /// Queues one SSE event of type `kind` with `fields` besides `type` and `sequence_number`.
    fn event(&mut self, kind: &str, mut fields: Value) {
        if let Value::Object(o) = &mut fields {
            o.insert("type".into(), kind.into());
            o.insert("sequence_number".into(), self.sequence.into());
        }
        self.sequence += 1;
        self.pending
            .push_back(Bytes::from(format!("event: {kind}\ndata: {fields}\n\n")));
    }

    fn on_token(&mut self, index: u32) {
        if index == 0 {
            let item = self.message("in_progress");
            self.event(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            );
            let (item_id, part) = (
                self.item_id.clone(),
                json!({"type": "output_text", "text": "", "annotations": []}),
            );
            self.event(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part}),
            );
        }
        let delta = word(self.text_seed, index);
        self.text.push_str(&delta);
        let item_id = self.item_id.clone();
        self.event(
            "response.output_text.delta",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": delta}),
        );
    }

    fn on_done(&mut self, usage: Usage) {
        let (item_id, text) = (self.item_id.clone(), self.text.clone());
        self.event(
            "response.output_text.done",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text}),
        );
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        self.event(
            "response.content_part.done",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part}),
        );
        let item = self.message("completed");
        self.event(
            "response.output_item.done",
            json!({"output_index": 0, "item": item}),
        );
        let response = self.response(Some(usage));
        self.event("response.completed", json!({ "response": response }));
        self.keep();
    }

    /// Streaming: the next SSE bytes.
    async fn next_bytes(mut self) -> Option<(Result<Bytes, Infallible>, Self)> {
        if self.sequence == 0 {
            let response = self.response(None);
            self.event("response.created", json!({ "response": response }));
            self.event("response.in_progress", json!({ "response": response }));
        }
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
                    self.on_done(usage);
                    self.finished = true;
                }
                None => {
                    let error = json!({"code": "server_error", "message": "the engine stopped"});
                    self.event("error", error);
                    self.finished = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conversation(bytes: usize) -> Vec<Message> {
        vec![Message {
            role: "user".into(),
            content: "x".repeat(bytes),
        }]
    }

    #[test]
    fn the_store_is_bounded_in_count_and_bytes_least_recent_first() {
        let store = ResponseStore::with_limits(3, 1000);
        for id in ["a", "b", "c"] {
            store.put(id.into(), conversation(100));
        }
        assert!(store.get("a").is_some(), "a is now the most recent");
        store.put("d".into(), conversation(100));
        assert_eq!(store.len(), 3);
        assert!(store.get("b").is_none(), "count: the least recent goes");
        // c goes for the count; then 105 + 105 + 805 bytes pass 1,000 and a goes for the bytes.
        store.put("e".into(), conversation(800));
        assert!(store.get("e").is_some());
        assert!(
            store.get("c").is_none() && store.get("a").is_none(),
            "bytes"
        );
        assert!(store.get("d").is_some());
        store.put("huge".into(), conversation(2000));
        assert!(store.get("huge").is_none(), "larger than the whole budget");
        assert_eq!(store.len(), 2);
    }

    fn messages(input: Value) -> Vec<Message> {
        input_messages(&input).unwrap_or_else(|e| panic!("{}", e.1))
    }

    #[test]
    fn input_shapes_become_messages() {
        let m = messages(json!("hi"));
        assert_eq!((m[0].role.as_str(), m[0].content.as_str()), ("user", "hi"));
        let m = messages(json!([
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
            {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "1"},
            {"type": "function_call_output", "call_id": "1", "output": "42"},
            {"type": "reasoning", "summary": []}
        ]));
        let got: Vec<(&str, &str)> = m
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("user", "ab"),
                ("assistant", "c"),
                ("assistant", "f({})"),
                ("tool", "42")
            ]
        );
        for bad in [
            json!(1),
            json!([1]),
            json!([{"content": "x"}]),
            json!([{"role": "user", "content": 3}]),
        ] {
            assert!(input_messages(&bad).is_err(), "{bad}");
        }
    }
}
