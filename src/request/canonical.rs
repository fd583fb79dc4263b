//! Canonical prompt serialization. Each message is written as one framed record, so the
//! serialization of a conversation's first `n` messages is a byte prefix of the serialization of
//! any longer conversation that starts with them.

use serde_json::Value;

use super::RequestError;

// Control characters frame records; they do not occur in ordinary prompt text.
const OPEN: char = '\u{1}';
const SEP: char = '\u{2}';
const CLOSE: char = '\u{3}';

/// Serializes chat `tools` (if any) followed by every message.
pub fn canonical_chat(tools: Option<&Value>, messages: &[Value]) -> Result<String, RequestError> {
    let mut out = String::with_capacity(estimate(messages));
    write_tools(&mut out, tools);
    for message in messages {
        write_message(&mut out, message, "messages")?;
    }
    Ok(out)
}

/// Serializes a Responses API request: `instructions` as a system record, `tools`, then `input`.
pub fn canonical_responses(
    instructions: Option<&Value>,
    tools: Option<&Value>,
    input: &Value,
) -> Result<String, RequestError> {
    let mut out = String::new();
    write_tools(&mut out, tools);
    match instructions {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => record(&mut out, "system", s),
        Some(_) => {
            return Err(RequestError::InvalidField {
                field: "instructions",
                expected: "a string",
            })
        }
    }
    match input {
        Value::String(s) => record(&mut out, "user", s),
        Value::Array(items) => {
            for item in items {
                write_message(&mut out, item, "input")?;
            }
        }
        _ => {
            return Err(RequestError::InvalidField {
                field: "input",
                expected: "a string or an array of input items",
            })
        }
    }
    Ok(out)
}

fn estimate(messages: &[Value]) -> usize {
    messages
        .iter()
        .map(|m| match m.get("content") {
            Some(Value::String(s)) => s.len() + 16,
            _ => 64,
        })
        .sum()
}

fn write_tools(out: &mut String, tools: Option<&Value>) {
    if let Some(tools) = tools.filter(|t| !t.is_null()) {
        // serde_json's map is ordered by key, so this is canonical whatever the client's key order.
        record(out, "tools", &tools.to_string());
    }
}

fn record(out: &mut String, role: &str, content: &str) {
    out.push(OPEN);
    out.push_str(role);
    out.push(SEP);
    out.push_str(content);
    out.push(CLOSE);
}

fn write_message(
    out: &mut String,
    message: &Value,
    field: &'static str,
) -> Result<(), RequestError> {
    let Value::Object(obj) = message else {
        return Err(RequestError::InvalidField {
            field,
            expected: "an array of objects",
        });
    };
    let role = match obj.get("role") {
        Some(Value::String(r)) => r.as_str(),
        // Responses API items without a role (function calls, outputs): keep them whole.
        None => obj.get("type").and_then(Value::as_str).unwrap_or("item"),
        Some(_) => {
            return Err(RequestError::InvalidField {
                field,
                expected: "messages whose 'role' is a string",
            })
        }
    };
    out.push(OPEN);
    out.push_str(role);
    if let Some(Value::String(name)) = obj.get("name") {
        out.push(':');
        out.push_str(name);
    }
    out.push(SEP);
    match obj.get("content") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(parts)) => {
            for part in parts {
                match part {
                    Value::String(s) => out.push_str(s),
                    Value::Object(p) => match p.get("text") {
                        Some(Value::String(t)) => out.push_str(t),
                        _ => out.push_str(&part.to_string()),
                    },
                    _ => {
                        return Err(RequestError::InvalidField {
                            field,
                            expected: "content parts that are objects or strings",
                        })
                    }
                }
            }
        }
        Some(_) => {
            return Err(RequestError::InvalidField {
                field,
                expected: "message content that is a string or an array of parts",
            })
        }
    }
    // Everything else that reaches the model (tool calls, ids, function-call items) in key order.
    for (key, value) in obj {
        if matches!(key.as_str(), "role" | "name" | "content") || value.is_null() {
            continue;
        }
        out.push(SEP);
        out.push_str(key);
        out.push('=');
        match value {
            Value::String(s) => out.push_str(s),
            other => out.push_str(&other.to_string()),
        }
    }
    out.push(CLOSE);
    Ok(())
}
