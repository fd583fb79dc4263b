//! OpenAI request understanding: body bytes in, a [`RoutingRequest`] out.
//!
//! The routing input is a deterministic canonical serialization of the whole prompt, built so
//! that a chat conversation's turn `t` is a byte prefix of turn `t + 1`. Nothing here logs or
//! returns prompt text in errors.

mod canonical;
mod fields;

use std::borrow::Cow;

use serde_json::{Map, Value};

use fields::{Body, Fields, PromptValue, Scalar};
use thiserror::Error;

pub(crate) use canonical::{canonical_chat, canonical_responses};

/// Which OpenAI-compatible API a request targets, from its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `/v1/completions`
    Completions,
    /// `/v1/chat/completions`
    ChatCompletions,
    /// `/v1/responses`
    Responses,
    /// `/v1/embeddings`
    Embeddings,
    /// Any other path with a JSON body (routed by load; the pod decides).
    Other,
}

impl Api {
    /// Classifies a request path (query string ignored).
    pub fn from_path(path: &str) -> Self {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        if path.ends_with("/chat/completions") {
            Api::ChatCompletions
        } else if path.ends_with("/completions") {
            Api::Completions
        } else if path.ends_with("/responses") {
            Api::Responses
        } else if path.ends_with("/embeddings") {
            Api::Embeddings
        } else {
            Api::Other
        }
    }

    /// Stable label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::ChatCompletions => "chat_completions",
            Api::Responses => "responses",
            Api::Embeddings => "embeddings",
            Api::Other => "other",
        }
    }
}

/// The prompt in the form the block-key stage consumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt<'a> {
    /// Canonical text (chat conversations, string prompts); a string prompt without JSON escapes
    /// is borrowed from the body.
    Text(Cow<'a, str>),
    /// Token ids given by the client.
    Tokens(Vec<u32>),
    /// No prompt (e.g. unknown API with a body).
    Empty,
}

impl Prompt<'_> {
    /// The prompt detached from the body it was read from.
    pub fn into_owned(self) -> Prompt<'static> {
        match self {
            Prompt::Text(t) => Prompt::Text(Cow::Owned(t.into_owned())),
            Prompt::Tokens(t) => Prompt::Tokens(t),
            Prompt::Empty => Prompt::Empty,
        }
    }

    /// Rough prompt size in tokens (text: 4 bytes per token).
    pub fn approx_tokens(&self) -> u64 {
        match self {
            Prompt::Text(t) => (t.len() as u64).div_ceil(4),
            Prompt::Tokens(t) => t.len() as u64,
            Prompt::Empty => 0,
        }
    }
}

/// Everything the router needs from a request body (its prompt may borrow from the body).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingRequest<'a> {
    /// The API the path names.
    pub api: Api,
    /// `model` (a LoRA adapter is a model name).
    pub model: Option<String>,
    /// `user` field, usable as a session key.
    pub user: Option<String>,
    /// `prompt_cache_key` (Chat Completions and Responses): the client's own cache-affinity id,
    /// usable as a session key. A value that is not a string is ignored, as vLLM ignores it.
    pub prompt_cache_key: Option<String>,
    /// `previous_response_id` (Responses only): the stored response this request continues.
    pub previous_response_id: Option<String>,
    /// `stream: true`.
    pub stream: bool,
    /// vLLM `cache_salt`: isolates prefix caching between tenants.
    pub cache_salt: Option<String>,
    /// Canonical prompt (first prompt of a batch; see docs/block-keys.md).
    pub prompt: Prompt<'a>,
    /// Number of prompts in a batched request (completions/embeddings lists).
    pub batch: usize,
    /// Chat requests: the structured conversation, for rendering with a chat template.
    pub chat: Option<ChatInput>,
}

impl RoutingRequest<'_> {
    /// The request detached from the body it was read from (the prompt is copied if borrowed).
    pub fn into_owned(self) -> RoutingRequest<'static> {
        RoutingRequest {
            api: self.api,
            model: self.model,
            user: self.user,
            prompt_cache_key: self.prompt_cache_key,
            previous_response_id: self.previous_response_id,
            stream: self.stream,
            cache_salt: self.cache_salt,
            prompt: self.prompt.into_owned(),
            batch: self.batch,
            chat: self.chat,
        }
    }
}

/// A chat request's structured input (what a chat template renders).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatInput {
    /// `messages`, as sent.
    pub messages: Vec<Value>,
    /// `tools`, if any.
    pub tools: Option<Value>,
    /// `add_generation_prompt` (vLLM default true).
    pub add_generation_prompt: bool,
    /// `continue_final_message` (vLLM default false).
    pub continue_final_message: bool,
    /// `chat_template_kwargs`.
    pub template_kwargs: Map<String, Value>,
}

/// Why a body could not be understood. Messages never contain prompt text.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RequestError {
    /// The body is not valid JSON.
    #[error("request body is not valid JSON (line {line}, column {column})")]
    InvalidJson {
        /// 1-based line of the first error.
        line: usize,
        /// 1-based column of the first error.
        column: usize,
    },
    /// The body is JSON but not an object.
    #[error("request body must be a JSON object")]
    NotAnObject,
    /// A required field is missing.
    #[error("missing required field '{0}'")]
    MissingField(&'static str),
    /// A field has the wrong type or shape.
    #[error("field '{field}' must be {expected}")]
    InvalidField {
        /// The field's name.
        field: &'static str,
        /// What it must be.
        expected: &'static str,
    },
}

impl RequestError {
    /// Stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            RequestError::InvalidJson { .. } => "invalid_json",
            RequestError::NotAnObject => "not_an_object",
            RequestError::MissingField(_) => "missing_field",
            RequestError::InvalidField { .. } => "invalid_field",
        }
    }
}

/// `body` with every `\uD800`–`\uDFFF` escape that is not half of a pair replaced by
/// `\uFFFD`; `None` when it has none.
fn without_lone_surrogates(body: &[u8]) -> Option<Vec<u8>> {
    fn escape_at(b: &[u8], i: usize) -> Option<u16> {
        let hex = b.get(i..i + 6)?;
        if hex[0] != b'\\' || hex[1] != b'u' {
            return None;
        }
        u16::from_str_radix(std::str::from_utf8(&hex[2..]).ok()?, 16).ok()
    }
    let mut out = Vec::with_capacity(body.len());
    let mut changed = false;
    let mut i = 0;
    while i < body.len() {
        if body[i] != b'\\' {
            out.push(body[i]);
            i += 1;
            continue;
        }
        match escape_at(body, i) {
            Some(0xD800..=0xDBFF) if matches!(escape_at(body, i + 6), Some(0xDC00..=0xDFFF)) => {
                out.extend_from_slice(&body[i..i + 12]);
                i += 12;
            }
            Some(0xD800..=0xDFFF) => {
                out.extend_from_slice(b"\\uFFFD");
                changed = true;
                i += 6;
            }
            // Any other escape (`\\` included) is copied whole, so its second byte is not
            // mistaken for the start of another.
            _ => {
                out.extend_from_slice(&body[i..(i + 2).min(body.len())]);
                i += 2;
            }
        }
    }
    changed.then_some(out)
}

/// Parses a request body for the API named by `path`. A string prompt without JSON escapes is
/// borrowed from `body`; [`RoutingRequest::into_owned`] detaches the request from it.
pub fn parse<'a>(path: &str, body: &'a [u8]) -> Result<RoutingRequest<'a>, RequestError> {
    let api = Api::from_path(path);
    match serde_json::from_slice::<Body<'a>>(body) {
        Ok(Body(fields)) => build(api, fields),
        // Python's json (vLLM's parser) accepts a lone UTF-16 surrogate escape; serde_json does
        // not. Such a body is parsed again with each lone one read as U+FFFD.
        Err(e) => {
            let invalid = RequestError::InvalidJson {
                line: e.line(),
                column: e.column(),
            };
            let fixed = without_lone_surrogates(body).ok_or(invalid.clone())?;
            let Ok(Body(fields)) = serde_json::from_slice::<Body<'_>>(&fixed) else {
                return Err(invalid);
            };
            build(api, fields).map(RoutingRequest::into_owned)
        }
    }
}

/// The routing request from a body's fields (`None`: the body is not an object).
fn build(api: Api, fields: Option<Fields<'_>>) -> Result<RoutingRequest<'_>, RequestError> {
    let Some(f) = fields else {
        return Err(RequestError::NotAnObject);
    };
    let model = opt_string(f.model, "model")?;
    let user = opt_string(f.user, "user")?;
    let prompt_cache_key = match f.prompt_cache_key {
        Scalar::Str(k) => Some(k.into_owned()),
        _ => None,
    };
    let previous_response_id = match api {
        Api::Responses => opt_string(f.previous_response_id, "previous_response_id")?,
        _ => None,
    };
    let cache_salt = opt_string(f.cache_salt, "cache_salt")?;
    let stream = match f.stream {
        Scalar::Missing | Scalar::Null => false,
        Scalar::Bool(b) => b,
        _ => {
            return Err(RequestError::InvalidField {
                field: "stream",
                expected: "a boolean",
            })
        }
    };
    let tools = f.tools;
    let (prompt, batch) = match api {
        Api::Completions => prompt_field(f.prompt, "prompt")?,
        Api::Embeddings => prompt_field(f.input, "input")?,
        Api::ChatCompletions => {
            let messages = f
                .messages
                .as_ref()
                .ok_or(RequestError::MissingField("messages"))?;
            let Value::Array(messages) = messages else {
                return Err(RequestError::InvalidField {
                    field: "messages",
                    expected: "an array of messages",
                });
            };
            (
                Prompt::Text(canonical_chat(tools.as_ref(), messages)?.into()),
                1,
            )
        }
        Api::Responses => {
            let input = f
                .input
                .map(PromptValue::into_json)
                .ok_or(RequestError::MissingField("input"))?;
            (
                Prompt::Text(
                    canonical_responses(f.instructions.as_ref(), tools.as_ref(), &input)?.into(),
                ),
                1,
            )
        }
        Api::Other => (Prompt::Empty, 0),
    };
    let as_bool = |s: Scalar<'_>, default: bool| match s {
        Scalar::Bool(b) => b,
        _ => default,
    };
    let chat = (api == Api::ChatCompletions).then(|| ChatInput {
        messages: match f.messages {
            Some(Value::Array(m)) => m,
            _ => Vec::new(),
        },
        tools: tools.filter(|t| !t.is_null()),
        add_generation_prompt: as_bool(f.add_generation_prompt, true),
        continue_final_message: as_bool(f.continue_final_message, false),
        template_kwargs: match f.chat_template_kwargs {
            Some(Value::Object(m)) => m,
            _ => Map::new(),
        },
    });
    Ok(RoutingRequest {
        chat,
        api,
        model,
        user,
        prompt_cache_key,
        previous_response_id,
        stream,
        cache_salt,
        prompt,
        batch,
    })
}

fn opt_string(value: Scalar<'_>, field: &'static str) -> Result<Option<String>, RequestError> {
    match value {
        Scalar::Missing | Scalar::Null => Ok(None),
        Scalar::Str(s) => Ok(Some(s.into_owned())),
        _ => Err(RequestError::InvalidField {
            field,
            expected: "a string",
        }),
    }
}

/// `prompt` / `input`: string, list of strings, token ids, or list of token-id lists. A string is
/// kept as the parser gave it (borrowed from the body when it has no escapes): a prompt can be
/// most of a large body.
fn prompt_field<'a>(
    value: Option<PromptValue<'a>>,
    field: &'static str,
) -> Result<(Prompt<'a>, usize), RequestError> {
    let invalid = RequestError::InvalidField {
        field,
        expected:
            "a string, an array of strings, an array of token ids or an array of token-id arrays",
    };
    let value = match value.ok_or(RequestError::MissingField(field))? {
        PromptValue::Str(s) => return Ok((Prompt::Text(s), 1)),
        PromptValue::Json(v) => v,
    };
    match value {
        Value::String(s) => Ok((Prompt::Text(s.into()), 1)),
        Value::Array(items) if items.is_empty() => Err(invalid),
        Value::Array(mut items) => match &items[0] {
            Value::String(_) => {
                if !items.iter().all(Value::is_string) {
                    return Err(invalid);
                }
                let batch = items.len();
                let Value::String(first) = items.swap_remove(0) else {
                    return Err(invalid);
                };
                Ok((Prompt::Text(first.into()), batch))
            }
            Value::Number(_) => Ok((Prompt::Tokens(token_ids(&items).ok_or(invalid)?), 1)),
            Value::Array(_) => {
                let mut first = None;
                for item in &items {
                    let Value::Array(ids) = item else {
                        return Err(invalid.clone());
                    };
                    let ids = token_ids(ids).ok_or(invalid.clone())?;
                    first.get_or_insert(ids);
                }
                Ok((Prompt::Tokens(first.unwrap_or_default()), items.len()))
            }
            _ => Err(invalid),
        },
        _ => Err(invalid),
    }
}

fn token_ids(items: &[Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

#[cfg(test)]
mod tests {

    /// The bytes Python's `json.loads` (vLLM's parser) accepts with a lone surrogate: parsed,
    /// with the lone one as U+FFFD; a real pair and an escaped backslash are untouched.
    #[test]
    fn lone_surrogates_parse_as_replacement_characters() {
        let body = br#"{"model":"m","prompt":"ab\ud800cd \udc00 \ud83d\ude00 \\ud800 e\ud83d"}"#;
        let r = parse("/v1/completions", body).expect("vLLM accepts this body");
        let Prompt::Text(text) = &r.prompt else {
            panic!("a text prompt")
        };
        assert_eq!(text, "ab\u{FFFD}cd \u{FFFD} \u{1F600} \\ud800 e\u{FFFD}");
        assert!(without_lone_surrogates(br#"{"p":"\ud83d\ude00 \\ud800"}"#).is_none());
        assert!(parse("/v1/completions", br#"{"prompt":"\ud800"#).is_err());
    }
    use super::*;

    fn text<'r>(r: &'r RoutingRequest<'_>) -> &'r str {
        match &r.prompt {
            Prompt::Text(t) => t,
            other => panic!("expected text prompt, got {other:?}"),
        }
    }

    #[test]
    fn a_completions_string_prompt_keeps_model_user_salt_and_stream() {
        let r = parse(
            "/v1/completions",
            br#"{"model":"m","prompt":"hello","stream":true,"user":"u1","cache_salt":"s"}"#,
        )
        .unwrap();
        assert_eq!(r.api, Api::Completions);
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.user.as_deref(), Some("u1"));
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        assert!(r.stream);
        assert_eq!(text(&r), "hello");
    }

    #[test]
    fn every_completions_prompt_shape_is_understood() {
        let r = parse("/v1/completions", br#"{"model":"m","prompt":["a","b"]}"#).unwrap();
        assert_eq!((text(&r), r.batch), ("a", 2));
        let r = parse("/v1/completions", br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
        let r = parse("/v1/completions", br#"{"model":"m","prompt":[[4,5],[6]]}"#).unwrap();
        assert_eq!((r.prompt, r.batch), (Prompt::Tokens(vec![4, 5]), 2));
        for bad in [
            &br#"{"prompt":[1,"a"]}"#[..],
            br#"{"prompt":[]}"#,
            br#"{"prompt":{"x":1}}"#,
            br#"{"prompt":[-1]}"#,
            br#"{"prompt":[[1],"a"]}"#,
        ] {
            assert!(matches!(
                parse("/v1/completions", bad),
                Err(RequestError::InvalidField {
                    field: "prompt",
                    ..
                })
            ));
        }
        assert_eq!(
            parse("/v1/completions", br#"{"model":"m"}"#),
            Err(RequestError::MissingField("prompt"))
        );
    }

    #[test]
    fn chat_turns_share_a_prefix() {
        let t1 = br#"{"model":"m","messages":[{"role":"system","content":"sys"},{"role":"user","content":"q1"}]}"#;
        let t2 = br#"{"model":"m","messages":[{"role":"system","content":"sys"},{"role":"user","content":"q1"},{"role":"assistant","content":"a1"},{"role":"user","content":[{"type":"text","text":"q2"}]}]}"#;
        let a = parse("/v1/chat/completions", t1).unwrap();
        let b = parse("/v1/chat/completions", t2).unwrap();
        assert!(text(&b).starts_with(text(&a)));
        assert!(text(&b).len() > text(&a).len());
        let chat = b.chat.as_ref().unwrap();
        assert_eq!(chat.messages.len(), 4);
        assert!(chat.add_generation_prompt && !chat.continue_final_message);
        assert!(
            a.chat.is_some()
                && parse("/v1/completions", br#"{"prompt":"x"}"#)
                    .unwrap()
                    .chat
                    .is_none()
        );
    }

    #[test]
    fn chat_content_parts_equal_plain_string() {
        let a = parse(
            "/v1/chat/completions",
            br#"{"messages":[{"role":"user","content":"hello world"}]}"#,
        )
        .unwrap();
        let b = parse(
            "/v1/chat/completions",
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"hello "},{"type":"text","text":"world"}]}]}"#,
        )
        .unwrap();
        assert_eq!(text(&a), text(&b));
    }

    #[test]
    fn chat_tools_are_part_of_the_prompt_and_key_order_does_not_matter() {
        let a = parse(
            "/v1/chat/completions",
            br#"{"tools":[{"type":"function","function":{"name":"f","parameters":{"a":1,"b":2}}}],"messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap();
        let b = parse(
            "/v1/chat/completions",
            br#"{"messages":[{"role":"user","content":"x"}],"tools":[{"function":{"parameters":{"b":2,"a":1},"name":"f"},"type":"function"}]}"#,
        )
        .unwrap();
        let c = parse(
            "/v1/chat/completions",
            br#"{"messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap();
        assert_eq!(text(&a), text(&b));
        assert_ne!(text(&a), text(&c));
    }

    #[test]
    fn chat_errors_are_typed() {
        assert_eq!(
            parse("/v1/chat/completions", br#"{"model":"m"}"#),
            Err(RequestError::MissingField("messages"))
        );
        assert!(matches!(
            parse("/v1/chat/completions", br#"{"messages":"hi"}"#),
            Err(RequestError::InvalidField {
                field: "messages",
                ..
            })
        ));
        assert!(matches!(
            parse("/v1/chat/completions", br#"{"messages":[1]}"#),
            Err(RequestError::InvalidField { .. })
        ));
        assert!(matches!(
            parse("/v1/chat/completions", b"{not json"),
            Err(RequestError::InvalidJson { .. })
        ));
        assert_eq!(
            parse("/v1/chat/completions", b"[1]"),
            Err(RequestError::NotAnObject)
        );
        assert!(matches!(
            parse("/v1/chat/completions", br#"{"messages":[],"stream":"yes"}"#),
            Err(RequestError::InvalidField {
                field: "stream",
                ..
            })
        ));
    }

    #[test]
    fn errors_never_echo_prompt_text() {
        let secret = "TOP-SECRET-PROMPT";
        let body = format!(r#"{{"prompt":[{{"x":"{secret}"}}]}}"#);
        let err = parse("/v1/completions", body.as_bytes()).unwrap_err();
        assert!(!err.to_string().contains(secret));
        let body = format!(r#"{{"prompt":"{secret}"#);
        let err = parse("/v1/completions", body.as_bytes()).unwrap_err();
        assert!(!err.to_string().contains(secret));
    }

    #[test]
    fn responses_and_embeddings_prompts_are_understood() {
        let r = parse(
            "/v1/responses",
            br#"{"model":"m","instructions":"be nice","input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]}]}"#,
        )
        .unwrap();
        assert!(text(&r).contains("be nice") && text(&r).contains("hi"));
        let s = parse("/v1/responses", br#"{"model":"m","input":"hi"}"#).unwrap();
        assert!(text(&s).contains("hi"));
        let e = parse("/v1/embeddings", br#"{"model":"m","input":["a","b","c"]}"#).unwrap();
        assert_eq!((text(&e), e.batch), ("a", 3));
    }

    #[test]
    fn session_ids_are_read_from_the_body() {
        let r = parse(
            "/v1/chat/completions",
            br#"{"messages":[{"role":"user","content":"x"}],"prompt_cache_key":"k1","user":"u"}"#,
        )
        .unwrap();
        assert_eq!(r.prompt_cache_key.as_deref(), Some("k1"));
        assert_eq!(r.user.as_deref(), Some("u"));
        assert_eq!(r.previous_response_id, None);
        let r = parse(
            "/v1/responses",
            br#"{"input":"x","previous_response_id":"resp_abc","prompt_cache_key":"k2"}"#,
        )
        .unwrap();
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_abc"));
        assert_eq!(r.prompt_cache_key.as_deref(), Some("k2"));
        // Only the Responses API chains responses; vLLM ignores a prompt_cache_key it does not
        // understand, and so does the router.
        let r = parse(
            "/v1/completions",
            br#"{"prompt":"x","previous_response_id":"resp_abc","prompt_cache_key":7}"#,
        )
        .unwrap();
        assert_eq!((r.previous_response_id, r.prompt_cache_key), (None, None));
        assert!(matches!(
            parse(
                "/v1/responses",
                br#"{"input":"x","previous_response_id":1}"#
            ),
            Err(RequestError::InvalidField {
                field: "previous_response_id",
                ..
            })
        ));
        let r = parse(
            "/v1/responses",
            br#"{"input":"x","previous_response_id":null}"#,
        )
        .unwrap();
        assert_eq!(r.previous_response_id, None);
    }

    #[test]
    fn other_paths_parse_model_only() {
        let r = parse("/v1/rerank", br#"{"model":"m","query":"q"}"#).unwrap();
        assert_eq!((r.api, r.prompt), (Api::Other, Prompt::Empty));
        assert_eq!(
            Api::from_path("/v1/chat/completions?x=1"),
            Api::ChatCompletions
        );
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// JSON-ish bytes: real request shapes with arbitrary values, and raw noise.
        fn body() -> impl Strategy<Value = Vec<u8>> {
            let leaf = prop_oneof![
                any::<String>().prop_map(serde_json::Value::from),
                any::<i64>().prop_map(serde_json::Value::from),
                any::<bool>().prop_map(serde_json::Value::from),
                Just(serde_json::Value::Null),
            ];
            let value = leaf.prop_recursive(4, 32, 6, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
                    prop::collection::btree_map(
                        prop_oneof![
                            Just("model".to_string()),
                            Just("prompt".to_string()),
                            Just("messages".to_string()),
                            Just("role".to_string()),
                            Just("content".to_string()),
                            Just("type".to_string()),
                            Just("text".to_string()),
                            Just("input".to_string()),
                            Just("user".to_string()),
                            Just("prompt_cache_key".to_string()),
                            Just("previous_response_id".to_string()),
                            Just("cache_salt".to_string()),
                            any::<String>(),
                        ],
                        inner,
                        0..6
                    )
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
                ]
            });
            prop_oneof![
                value.prop_map(|v| v.to_string().into_bytes()),
                prop::collection::vec(any::<u8>(), 0..400),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
            #[test]
            fn any_body_on_any_path_parses_or_errors_never_panics(
                body in body(),
                path in prop_oneof![
                    Just("/v1/chat/completions".to_string()),
                    Just("/v1/completions".to_string()),
                    Just("/v1/responses".to_string()),
                    any::<String>(),
                ],
            ) {
                let _ = parse(&path, &body);
            }
        }
    }
}
