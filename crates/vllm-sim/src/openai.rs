//! The simulator's own reading of the OpenAI requests it serves (completions and chat
//! completions), with serde structs of the wire format: kv-router's request parser is not used,
//! so a bug there shows up end to end instead of being mirrored here.
//!
//! Prompts become token ids the way the simulated model tokenizes: text through the pseudo
//! tokenizer (4 bytes per token), token-id prompts as given, the first prompt of a batch. A chat
//! conversation is rendered by the model's chat template: tools (if any), then every message,
//! each framed as `\u{1}role[:name]\u{2}content[\u{2}key=value…]\u{3}` with the message's other
//! non-null fields in key order. kv-router's built-in tokenizer (`builtin: true`) renders the
//! same template, which is what makes its precise keys match the pods' blocks.

use std::collections::BTreeMap;

use kv_router::blocks::pseudo_tokens;
use serde::Deserialize;
use serde_json::Value;

const OPEN: char = '\u{1}';
const SEP: char = '\u{2}';
const CLOSE: char = '\u{3}';

/// What the simulator needs from a generation request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimRequest {
    /// `model`.
    pub model: Option<String>,
    /// `stream: true`.
    pub stream: bool,
    /// vLLM `cache_salt`.
    pub cache_salt: Option<String>,
    /// The prompt as the model's token ids.
    pub tokens: Vec<u32>,
}

/// `/v1/completions` `prompt`: a string, token ids, or a batch of either (the first is served).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
struct Completion {
    model: Option<String>,
    prompt: Prompt,
    stream: Option<bool>,
    cache_salt: Option<String>,
}

/// A content part: a string or an object, whose `text` is used when it has one.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Part {
    Text(String),
    Object(serde_json::Map<String, Value>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    name: Option<Value>,
    #[serde(default)]
    content: Option<Content>,
    #[serde(flatten)]
    rest: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
struct Chat {
    model: Option<String>,
    messages: Vec<Message>,
    #[serde(default)]
    tools: Option<Value>,
    stream: Option<bool>,
    cache_salt: Option<String>,
}

/// Parses a completions (`chat = false`) or chat completions body.
pub fn parse(chat: bool, body: &[u8]) -> Result<SimRequest, String> {
    let err = |e: serde_json::Error| e.to_string();
    if chat {
        let c: Chat = serde_json::from_slice(body).map_err(err)?;
        Ok(SimRequest {
            model: c.model,
            stream: c.stream.unwrap_or(false),
            cache_salt: c.cache_salt,
            tokens: pseudo_tokens(render_chat(c.tools.as_ref(), &c.messages).as_bytes()),
        })
    } else {
        let c: Completion = serde_json::from_slice(body).map_err(err)?;
        let tokens = match c.prompt {
            Prompt::Text(t) => pseudo_tokens(t.as_bytes()),
            Prompt::Tokens(ids) => ids,
            Prompt::Texts(ts) => ts
                .first()
                .map_or(Vec::new(), |t| pseudo_tokens(t.as_bytes())),
            Prompt::TokenLists(mut ls) => {
                if ls.is_empty() {
                    Vec::new()
                } else {
                    ls.swap_remove(0)
                }
            }
        };
        Ok(SimRequest {
            model: c.model,
            stream: c.stream.unwrap_or(false),
            cache_salt: c.cache_salt,
            tokens,
        })
    }
}

/// The simulated model's chat template.
fn render_chat(tools: Option<&Value>, messages: &[Message]) -> String {
    let mut out = String::new();
    if let Some(tools) = tools.filter(|t| !t.is_null()) {
        out.push(OPEN);
        out.push_str("tools");
        out.push(SEP);
        out.push_str(&tools.to_string());
        out.push(CLOSE);
    }
    for m in messages {
        out.push(OPEN);
        out.push_str(&m.role);
        if let Some(Value::String(name)) = &m.name {
            out.push(':');
            out.push_str(name);
        }
        out.push(SEP);
        match &m.content {
            None => {}
            Some(Content::Text(t)) => out.push_str(t),
            Some(Content::Parts(parts)) => {
                for p in parts {
                    match p {
                        Part::Text(t) => out.push_str(t),
                        Part::Object(o) => match o.get("text") {
                            Some(Value::String(t)) => out.push_str(t),
                            _ => out.push_str(&Value::Object(o.clone()).to_string()),
                        },
                    }
                }
            }
        }
        for (key, value) in m.rest.iter().filter(|(_, v)| !v.is_null()) {
            out.push(SEP);
            out.push_str(key);
            out.push('=');
            match value {
                Value::String(s) => out.push_str(s),
                other => out.push_str(&other.to_string()),
            }
        }
        out.push(CLOSE);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_prompts_of_every_shape() {
        let p = |body: &str| parse(false, body.as_bytes());
        assert_eq!(p(r#"{"prompt":"abcdefgh"}"#).unwrap().tokens.len(), 2);
        let r = p(r#"{"model":"m","prompt":[5,6,7],"stream":true,"cache_salt":"s"}"#).unwrap();
        assert_eq!(
            r,
            SimRequest {
                model: Some("m".into()),
                stream: true,
                cache_salt: Some("s".into()),
                tokens: vec![5, 6, 7],
            }
        );
        assert_eq!(p(r#"{"prompt":[[1,2],[3]]}"#).unwrap().tokens, vec![1, 2]);
        assert_eq!(p(r#"{"prompt":["abcd","x"]}"#).unwrap().tokens.len(), 1);
        for bad in [
            r#"{"prompt":5}"#,
            r#"{"prompt":[4294967296]}"#,
            r#"{"prompt":"x","stream":"yes"}"#,
            r#"{"model":1,"prompt":"x"}"#,
            r#"{}"#,
            "[]",
            "{nope",
        ] {
            assert!(p(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn chat_template_frames_each_message_so_turns_extend_each_other() {
        let one = r#"{"messages":[{"role":"system","content":"be brief"},
            {"role":"user","name":"ann","content":[{"type":"text","text":"hi"},"!"]}]}"#;
        let two = r#"{"messages":[{"role":"system","content":"be brief"},
            {"role":"user","name":"ann","content":[{"type":"text","text":"hi"},"!"]},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1"}]}]}"#;
        let text = |m: &str| {
            let c: Chat = serde_json::from_str(m).unwrap();
            render_chat(c.tools.as_ref(), &c.messages)
        };
        assert_eq!(
            text(one),
            "\u{1}system\u{2}be brief\u{3}\u{1}user:ann\u{2}hi!\u{3}"
        );
        assert!(text(two).starts_with(&text(one)));
        assert!(text(two).ends_with("\u{1}assistant\u{2}\u{2}tool_calls=[{\"id\":\"c1\"}]\u{3}"));
        assert!(parse(true, br#"{"messages":[{"content":"no role"}]}"#).is_err());
    }
}
