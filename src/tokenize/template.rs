//! Chat-template rendering compatible with HuggingFace `apply_chat_template` as vLLM calls it.
//!
//! Environment: `trim_blocks`, `lstrip_blocks`, no trailing newline kept, loop controls,
//! python string methods (`minijinja_contrib::pycompat`), `raise_exception(msg)`,
//! `strftime_now(fmt)` (UTC wall clock), and a `tojson` filter that prints like Python's
//! `json.dumps(x, ensure_ascii=False)` (`", "` / `": "` separators, optional `indent`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

use crate::request::ChatInput;

/// How message `content` is handed to the template (vLLM's `chat_template_content_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Content parts are flattened to one string (text parts joined with `"\n"`).
    String,
    /// Content stays a list of `{"type": "text", "text": ...}` parts (templates that loop over
    /// `message['content']`).
    OpenAi,
}

/// A compiled chat template (one or several named variants) plus the special-token variables.
pub struct ChatTemplate {
    env: Environment<'static>,
    has_tool_use: bool,
    format: ContentFormat,
    special_tokens: BTreeMap<String, Json>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("has_tool_use", &self.has_tool_use)
            .field("format", &self.format)
            .finish_non_exhaustive()
    }
}

const DEFAULT: &str = "default";
const TOOL_USE: &str = "tool_use";

impl ChatTemplate {
    /// Compiles templates given as `(name, source)`; `default` (or the only one) is used unless
    /// tools are present and a `tool_use` template exists. Errors are syntax errors (message
    /// names the template line, never a prompt).
    pub fn new(
        templates: Vec<(String, String)>,
        special_tokens: BTreeMap<String, Json>,
    ) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", py_tojson);
        let single = templates.len() == 1;
        let mut has_default = false;
        let mut has_tool_use = false;
        let mut format = ContentFormat::String;
        for (name, source) in templates {
            if detect_openai_format(&source) {
                format = ContentFormat::OpenAi;
            }
            let name = if single { DEFAULT.to_string() } else { name };
            has_default |= name == DEFAULT;
            has_tool_use |= name == TOOL_USE;
            env.add_template_owned(name.clone(), source)
                .map_err(|e| format!("template '{name}': {e}"))?;
        }
        if !has_default {
            return Err("no 'default' chat template in the template list".into());
        }
        Ok(Self {
            env,
            has_tool_use,
            format,
            special_tokens,
        })
    }

    /// The content format detected from the template source.
    pub fn content_format(&self) -> ContentFormat {
        self.format
    }

    /// Renders a chat request to the prompt text vLLM would tokenize.
    pub fn render(&self, chat: &ChatInput) -> Result<String, String> {
        let has_tools = chat
            .tools
            .as_ref()
            .is_some_and(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty()));
        let name = if has_tools && self.has_tool_use {
            TOOL_USE
        } else {
            DEFAULT
        };
        let tmpl = self.env.get_template(name).map_err(|e| e.to_string())?;
        let messages = normalize_messages(&chat.messages, self.format);
        // HF: render(messages=, tools=, documents=, add_generation_prompt=, **special_tokens,
        // **chat_template_kwargs).
        let mut ctx: BTreeMap<String, Json> = self.special_tokens.clone();
        for (k, v) in &chat.template_kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Json::Array(messages.clone()));
        ctx.insert(
            "tools".into(),
            if has_tools {
                chat.tools.clone().unwrap_or(Json::Null)
            } else {
                Json::Null
            },
        );
        ctx.insert("documents".into(), Json::Null);
        let add_gen = chat.add_generation_prompt && !chat.continue_final_message;
        ctx.insert("add_generation_prompt".into(), Json::Bool(add_gen));
        let mut out = tmpl
            .render(Value::from_serialize(&ctx))
            .map_err(|e| e.to_string())?;
        if chat.continue_final_message {
            out = continue_final(out, messages.last())?;
        }
        Ok(out)
    }
}

/// HF `continue_final_message`: cut the rendering right after the final message's content.
fn continue_final(rendered: String, last: Option<&Json>) -> Result<String, String> {
    let content = match last.and_then(|m| m.get("content")) {
        Some(Json::String(s)) => s.clone(),
        Some(Json::Array(parts)) => parts
            .iter()
            .rev()
            .find_map(|p| p.get("text").and_then(Json::as_str))
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    };
    if let Some(i) = rendered.rfind(&content) {
        return Ok(rendered[..i + content.len()].to_string());
    }
    let trimmed = content.trim();
    match rendered.rfind(trimmed) {
        Some(i) => Ok(rendered[..i + trimmed.len()].to_string()),
        None => Err("continue_final_message: final message not found in the rendering".into()),
    }
}

/// vLLM-style message normalization (`parse_chat_messages`): `content` becomes a string (or a
/// list of text parts), `tool_calls[].function.arguments` JSON strings become objects, and only
/// `role`, `content`, `tool_calls`, `tool_call_id`, `name` are kept.
pub fn normalize_messages(messages: &[Json], format: ContentFormat) -> Vec<Json> {
    messages
        .iter()
        .map(|m| {
            let mut out = serde_json::Map::new();
            let role = m.get("role").cloned().unwrap_or(Json::Null);
            out.insert("role".into(), role.clone());
            let texts: Vec<String> = match m.get("content") {
                None | Some(Json::Null) => Vec::new(),
                Some(Json::String(s)) => vec![s.clone()],
                Some(Json::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| match p {
                        Json::String(s) => Some(s.clone()),
                        Json::Object(o) => o.get("text").and_then(Json::as_str).map(String::from),
                        _ => None,
                    })
                    .collect(),
                Some(other) => vec![other.to_string()],
            };
            let content = match format {
                ContentFormat::String => Json::String(texts.join("\n")),
                ContentFormat::OpenAi => Json::Array(
                    texts
                        .into_iter()
                        .map(|t| serde_json::json!({"type": "text", "text": t}))
                        .collect(),
                ),
            };
            out.insert("content".into(), content);
            if role == "assistant" {
                if let Some(Json::Array(calls)) = m.get("tool_calls") {
                    let calls = calls
                        .iter()
                        .map(|c| {
                            let mut c = c.clone();
                            if let Some(f) = c.get_mut("function") {
                                if let Some(Json::String(args)) = f.get("arguments") {
                                    if let Ok(parsed) = serde_json::from_str::<Json>(args) {
                                        f["arguments"] = parsed;
                                    }
                                }
                            }
                            c
                        })
                        .collect();
                    out.insert("tool_calls".into(), Json::Array(calls));
                }
            }
            if role == "tool" {
                if let Some(id) = m.get("tool_call_id") {
                    out.insert("tool_call_id".into(), id.clone());
                }
            }
            if let Some(Json::String(name)) = m.get("name") {
                out.insert("name".into(), Json::String(name.clone()));
            }
            Json::Object(out)
        })
        .collect()
}

/// Templates that loop over `message['content']` want OpenAI-style content parts (vLLM detects
/// this on the template AST; this is a source-level approximation).
fn detect_openai_format(source: &str) -> bool {
    let mut rest = source;
    while let Some(i) = rest.find("{%") {
        rest = &rest[i + 2..];
        let end = rest.find("%}").unwrap_or(rest.len());
        let tag = rest[..end].trim_start_matches(['-', '+', ' ', '\t', '\n']);
        if let Some(body) = tag.strip_prefix("for ") {
            if let Some(j) = body.find(" in ") {
                let iter = body[j + 4..].trim();
                if iter.ends_with(".content")
                    || iter.ends_with("['content']")
                    || iter.ends_with("[\"content\"]")
                    || iter.contains(".content ")
                    || iter.contains("['content'] ")
                    || iter.contains("[\"content\"] ")
                {
                    return true;
                }
            }
        }
        rest = &rest[end..];
    }
    false
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)`: current UTC time formatted with the common `strftime` directives.
fn strftime_now(fmt: String) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime_utc(&fmt, secs)
}

/// Formats a UNIX timestamp (UTC) with `%Y %y %m %d %e %b %B %a %A %H %I %M %S %p %j %%`.
pub fn strftime_utc(fmt: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 4).rem_euclid(7) as usize;
    let (h, mi, s) = (sod / 3600, (sod / 60) % 60, sod % 60);
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('e') => write!(out, "{day:2}"),
            Some('b') => write!(out, "{}", &MONTHS[month as usize - 1][..3]),
            Some('B') => write!(out, "{}", MONTHS[month as usize - 1]),
            Some('a') => write!(out, "{}", &DAYS[weekday][..3]),
            Some('A') => write!(out, "{}", DAYS[weekday]),
            Some('H') => write!(out, "{h:02}"),
            Some('I') => write!(out, "{:02}", if h % 12 == 0 { 12 } else { h % 12 }),
            Some('M') => write!(out, "{mi:02}"),
            Some('S') => write!(out, "{s:02}"),
            Some('p') => write!(out, "{}", if h < 12 { "AM" } else { "PM" }),
            Some('j') => write!(out, "{yday:03}"),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31), proleptic Gregorian.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn py_tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_py_json(&mut out, &value, indent, 0)?;
    Ok(Value::from_safe_string(out))
}

fn newline_indent(out: &mut String, indent: Option<usize>, level: usize) {
    if let Some(n) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * level));
    }
}

fn write_py_json(
    out: &mut String,
    v: &Value,
    indent: Option<usize>,
    level: usize,
) -> Result<(), Error> {
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match serde_json::to_value(v) {
            Ok(Json::Number(n)) if !n.is_f64() => {
                let _ = write!(out, "{n}");
            }
            _ => {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                out.push_str(&py_float_repr(f));
            }
        },
        ValueKind::String => write_py_str(out, v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline_indent(out, indent, level + 1);
                write_py_json(out, item, indent, level + 1)?;
            }
            newline_indent(out, indent, level);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline_indent(out, indent, level + 1);
                match key.as_str() {
                    Some(s) => write_py_str(out, s),
                    None => write_py_str(out, &key.to_string()),
                }
                out.push_str(": ");
                write_py_json(out, &v.get_item(key)?, indent, level + 1)?;
            }
            newline_indent(out, indent, level);
            out.push('}');
        }
        _ => write_py_str(out, &v.to_string()),
    }
    Ok(())
}

fn write_py_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, scientific outside `1e-4 <= |x| < 1e16`.
pub fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let sci = format!("{f:e}"); // e.g. "-1.2345e-7"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp < 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_like_python() {
        assert_eq!(py_float_repr(1.0), "1.0");
        assert_eq!(py_float_repr(0.1), "0.1");
        assert_eq!(py_float_repr(123.456), "123.456");
        assert_eq!(py_float_repr(1e16), "1e+16");
        assert_eq!(py_float_repr(1.5e-5), "1.5e-05");
        assert_eq!(py_float_repr(0.0001), "0.0001");
        assert_eq!(py_float_repr(-2.5), "-2.5");
    }

    #[test]
    fn strftime_known_dates() {
        assert_eq!(strftime_utc("%d %b %Y", 0), "01 Jan 1970");
        // 2024-07-26 13:25:09 UTC, a Friday, day 208.
        assert_eq!(
            strftime_utc("%A %B %d %Y %H:%M:%S %j %y %%", 1_722_000_309),
            "Friday July 26 2024 13:25:09 208 24 %"
        );
    }

    #[test]
    fn tojson_matches_python_dumps() {
        let t = ChatTemplate::new(
            vec![(
                "x".into(),
                "{{ v | tojson }}|{{ v | tojson(indent=2) }}".into(),
            )],
            BTreeMap::new(),
        )
        .unwrap();
        let tmpl = t.env.get_template(DEFAULT).unwrap();
        let v = serde_json::json!({"a": [1, 2.0, "x\"\n<é>"], "b": null, "c": {}});
        let out = tmpl.render(minijinja::context! { v => v }).unwrap();
        assert_eq!(
            out,
            "{\"a\": [1, 2.0, \"x\\\"\\n<é>\"], \"b\": null, \"c\": {}}|{\n  \"a\": [\n    1,\n    2.0,\n    \"x\\\"\\n<é>\"\n  ],\n  \"b\": null,\n  \"c\": {}\n}"
        );
    }

    #[test]
    fn content_format_detection() {
        assert!(detect_openai_format(
            "{% for m in messages %}{%- for part in m['content'] %}{{ part.text }}{% endfor %}{% endfor %}"
        ));
        assert!(!detect_openai_format(
            "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        ));
    }
}
