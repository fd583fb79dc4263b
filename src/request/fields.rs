//! One pass over a request body that decodes only the top-level fields the router reads.
//!
//! A field it does not read is skipped without being built (a `serde_json::Value` of the whole
//! body once held a copy of every field), and a string prompt without escapes is borrowed from
//! the body, not copied: a prompt can be most of a multi-megabyte body. A field given twice keeps
//! its last value, as a JSON object read into a map does.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// A scalar field: a string is kept (borrowed when it has no escapes), a boolean too; anything
/// else is only told apart from null.
#[derive(Debug, Default)]
pub(super) enum Scalar<'a> {
    /// Absent.
    #[default]
    Missing,
    /// `null`.
    Null,
    /// A string.
    Str(Cow<'a, str>),
    /// A boolean.
    Bool(bool),
    /// A number, array or object (skipped, not built).
    Other,
}

/// `prompt` / `input`: a string is kept as such (borrowed when it has no escapes); any other
/// JSON value is built, for the shape checks.
#[derive(Debug)]
pub(super) enum PromptValue<'a> {
    /// A string.
    Str(Cow<'a, str>),
    /// Anything else.
    Json(Value),
}

/// The top-level fields the router reads, each as its last occurrence in the body.
#[derive(Debug, Default)]
pub(super) struct Fields<'a> {
    pub model: Scalar<'a>,
    pub user: Scalar<'a>,
    pub prompt_cache_key: Scalar<'a>,
    pub previous_response_id: Scalar<'a>,
    pub cache_salt: Scalar<'a>,
    pub stream: Scalar<'a>,
    pub add_generation_prompt: Scalar<'a>,
    pub continue_final_message: Scalar<'a>,
    pub prompt: Option<PromptValue<'a>>,
    pub input: Option<PromptValue<'a>>,
    pub messages: Option<Value>,
    pub tools: Option<Value>,
    pub instructions: Option<Value>,
    pub chat_template_kwargs: Option<Value>,
}

/// A body: an object's fields, or `None` for any other JSON value.
pub(super) struct Body<'a>(pub Option<Fields<'a>>);

impl<'de> Deserialize<'de> for Body<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BodyVisitor)
    }
}

/// A value read and dropped without being built, but checked as a `Value` would be (numbers in
/// range, strings valid UTF-8 without lone surrogates), so a body is accepted exactly when its
/// `Value` would be. `IgnoredAny` checks neither.
struct Skip;

impl<'de> Deserialize<'de> for Skip {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(SkipVisitor)
    }
}

struct SkipVisitor;

impl<'de> Visitor<'de> for SkipVisitor {
    type Value = Skip;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_none<E: de::Error>(self) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Skip, A::Error> {
        skip_seq(seq).map(|()| Skip)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Skip, A::Error> {
        skip_map(map).map(|()| Skip)
    }
}

/// Skips the rest of a sequence.
fn skip_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<Skip>()?.is_some() {}
    Ok(())
}

/// Skips the rest of a map.
fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<Key<'de>, Skip>()?.is_some() {}
    Ok(())
}

struct BodyVisitor;

impl<'de> Visitor<'de> for BodyVisitor {
    type Value = Body<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut f = Fields::default();
        while let Some(Key(key)) = map.next_key()? {
            match &*key {
                "model" => f.model = map.next_value()?,
                "user" => f.user = map.next_value()?,
                "prompt_cache_key" => f.prompt_cache_key = map.next_value()?,
                "previous_response_id" => f.previous_response_id = map.next_value()?,
                "cache_salt" => f.cache_salt = map.next_value()?,
                "stream" => f.stream = map.next_value()?,
                "add_generation_prompt" => f.add_generation_prompt = map.next_value()?,
                "continue_final_message" => f.continue_final_message = map.next_value()?,
                "prompt" => f.prompt = Some(map.next_value()?),
                "input" => f.input = Some(map.next_value()?),
                "messages" => f.messages = Some(map.next_value()?),
                "tools" => f.tools = Some(map.next_value()?),
                "instructions" => f.instructions = Some(map.next_value()?),
                "chat_template_kwargs" => f.chat_template_kwargs = Some(map.next_value()?),
                _ => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        Ok(Body(Some(f)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        skip_seq(seq).map(|()| Body(None))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Body(None))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Body(None))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Body(None))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Body(None))
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Body(None))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Body(None))
    }
}

/// An object key, unescaped (borrowed when it has no escapes).
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(CowStr).map(Key)
    }
}

/// A string, borrowed from the input when it has no escapes.
struct CowStr;

impl<'de> Visitor<'de> for CowStr {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(s))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(s.to_owned()))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(s))
    }
}

impl<'de> Deserialize<'de> for Scalar<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Scalar::Str(Cow::Borrowed(s)))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Scalar::Str(Cow::Owned(s.to_owned())))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
        Ok(Scalar::Str(Cow::Owned(s)))
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Self::Value, E> {
        Ok(Scalar::Bool(b))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Scalar::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Scalar::Null)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Scalar::Other)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Scalar::Other)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Scalar::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        skip_seq(seq).map(|()| Scalar::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        skip_map(map).map(|()| Scalar::Other)
    }
}

impl<'de> Deserialize<'de> for PromptValue<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = PromptValue<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(PromptValue::Str(Cow::Borrowed(s)))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(PromptValue::Str(Cow::Owned(s.to_owned())))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
        Ok(PromptValue::Str(Cow::Owned(s)))
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Self::Value, E> {
        Ok(PromptValue::Json(Value::Bool(b)))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(PromptValue::Json(Value::Null))
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(PromptValue::Json(Value::Null))
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Self::Value, E> {
        Ok(PromptValue::Json(Value::from(n)))
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Self::Value, E> {
        Ok(PromptValue::Json(Value::from(n)))
    }

    fn visit_f64<E: de::Error>(self, n: f64) -> Result<Self::Value, E> {
        Ok(PromptValue::Json(Value::from(n)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        Value::deserialize(de::value::SeqAccessDeserializer::new(seq)).map(PromptValue::Json)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Value::deserialize(de::value::MapAccessDeserializer::new(map)).map(PromptValue::Json)
    }
}

impl PromptValue<'_> {
    /// The value as JSON (a string is copied).
    pub(super) fn into_json(self) -> Value {
        match self {
            PromptValue::Str(s) => Value::String(s.into_owned()),
            PromptValue::Json(v) => v,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::super::{parse, Prompt, RequestError};

    fn prompt(body: &[u8]) -> Prompt<'_> {
        parse("/v1/completions", body).unwrap().prompt
    }

    #[test]
    fn a_prompt_without_escapes_is_borrowed_from_the_body() {
        let body = br#"{"model":"m","prompt":"hello world"}"#;
        let Prompt::Text(Cow::Borrowed(text)) = prompt(body) else {
            panic!("a borrowed text prompt")
        };
        assert_eq!(text, "hello world");
        assert!(body.as_ptr_range().contains(&text.as_ptr()));
        let escaped = prompt(br#"{"prompt":"a\nb\u00e9"}"#);
        assert_eq!(escaped, Prompt::Text(Cow::Owned("a\nbé".into())));
        assert_eq!(escaped.into_owned(), Prompt::Text("a\nbé".into()));
    }

    /// Fields the router does not read are skipped, not built, yet checked as before: a body is
    /// accepted exactly when it is valid JSON.
    #[test]
    fn unread_fields_are_skipped_but_still_checked() {
        for bad in [
            &br#"{"prompt":"x","extra":1e999}"#[..],
            br#"{"prompt":"x","extra":[{"k":"\u12"}]}"#,
            b"{\"prompt\":\"x\",\"extra\":\"\xff\"}",
            b"{\"prompt\":\"x\",\"extra\":{\"\xff\":1}}",
            br#"{"prompt":"x","extra":{"a":[1,]}}"#,
            br#"{"prompt":"x"} 1"#,
        ] {
            assert!(
                matches!(
                    parse("/v1/completions", bad),
                    Err(RequestError::InvalidJson { .. })
                ),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let ok = br#"{"prompt":"x","extra":{"a":[1,2.5,-3,true,null,"s\n"]},"n":1e300}"#;
        assert_eq!(prompt(ok), Prompt::Text("x".into()));
    }

    /// As in a JSON object read into a map: the last of a repeated field counts, and keys are
    /// compared unescaped.
    #[test]
    fn the_last_of_a_repeated_field_counts_and_keys_are_unescaped() {
        let r = parse(
            "/v1/completions",
            br#"{"prompt":7,"stream":"no","prompt":"b","stream":true,"mod\u0065l":"m"}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Text("b".into()));
        assert!(r.stream);
        assert_eq!(r.model.as_deref(), Some("m"));
    }
}
