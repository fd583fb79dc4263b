//! Decoder for vLLM's KV-event payloads: the outer batch array (length ≥ 2; a map is accepted
//! too), events as maps keyed by `type` (vLLM ≥ 0.24) or as positional arrays (≤ 0.23 and the
//! earliest layout). Fields are read by name, unknown keys ignored; hashes may be any msgpack
//! integer (negative int64 reinterpreted) or bin. Malformed input is an error, never a panic.

use rmpv::Value;
use thiserror::Error;

use super::types::{BlockHash, ExtraKey, KvEvent, KvEventBatch};

/// Largest payload accepted (a batch is one scheduler step; real ones are far smaller).
pub(crate) const MAX_PAYLOAD_BYTES: usize = 64 << 20;
const MAX_DEPTH: usize = 16;

/// Why a payload could not be decoded (a closed set: ingest counts each kind).
#[derive(Debug, Error, PartialEq)]
pub enum DecodeError {
    /// Over [`MAX_PAYLOAD_BYTES`].
    #[error("payload of {0} bytes exceeds the limit")]
    TooLarge(usize),
    /// Not valid msgpack, or bytes left over.
    #[error("invalid msgpack: {0}")]
    Msgpack(String),
    /// The outer structure is not a batch.
    #[error("not an event batch: {0}")]
    Batch(&'static str),
    /// One event is malformed.
    #[error("event {index}: {reason}")]
    Event {
        /// Position in the batch.
        index: usize,
        /// What is wrong.
        reason: String,
    },
}

/// Decodes one payload (the third ZMQ frame).
pub fn decode_batch(payload: &[u8]) -> Result<KvEventBatch, DecodeError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::TooLarge(payload.len()));
    }
    let mut rd = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::Msgpack(format!("{} trailing bytes", rd.len())));
    }
    let (ts, events, rank) = match &value {
        Value::Array(items) if items.len() >= 2 => (&items[0], &items[1], items.get(2)),
        Value::Array(_) => return Err(DecodeError::Batch("array shorter than [ts, events]")),
        Value::Map(entries) => (
            map_get(entries, "ts").ok_or(DecodeError::Batch("map without ts"))?,
            map_get(entries, "events").ok_or(DecodeError::Batch("map without events"))?,
            map_get(entries, "data_parallel_rank"),
        ),
        _ => return Err(DecodeError::Batch("neither an array nor a map")),
    };
    let ts = match ts {
        Value::F64(f) => *f,
        Value::F32(f) => f64::from(*f),
        Value::Integer(i) => i.as_f64().unwrap_or(0.0),
        _ => return Err(DecodeError::Batch("ts is not a number")),
    };
    let data_parallel_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(Value::Integer(i)) => Some(i.as_i64().ok_or(DecodeError::Batch("rank out of range"))?),
        Some(_) => return Err(DecodeError::Batch("data_parallel_rank is not an integer")),
    };
    let Value::Array(events) = events else {
        return Err(DecodeError::Batch("events is not an array"));
    };
    let events = events
        .iter()
        .enumerate()
        .map(|(index, e)| decode_event(e).map_err(|reason| DecodeError::Event { index, reason }))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(KvEventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

fn map_get<'a>(entries: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    entries
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// Field access over either layout.
enum Fields<'a> {
    Map(&'a [(Value, Value)]),
    Array(&'a [Value], &'static [&'static str]),
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        let v = match self {
            Fields::Map(entries) => map_get(entries, name),
            Fields::Array(items, names) => names
                .iter()
                .position(|n| *n == name)
                .and_then(|i| items.get(i)),
        };
        v.filter(|v| !v.is_nil())
    }
}

// Positions of the ≤ 0.23 layout (index 0 is the tag); older layouts are prefixes of these.
const STORED_POSITIONS: &[&str] = &[
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED_POSITIONS: &[&str] = &["type", "block_hashes", "medium", "group_idx"];
const CLEARED_POSITIONS: &[&str] = &["type"];

fn decode_event(v: &Value) -> Result<KvEvent, String> {
    let (tag, fields) = match v {
        Value::Map(entries) => {
            let tag = map_get(entries, "type")
                .and_then(Value::as_str)
                .ok_or("map event without a string 'type'")?;
            (tag, Fields::Map(entries))
        }
        Value::Array(items) => {
            let tag = items
                .first()
                .and_then(Value::as_str)
                .ok_or("array event without a string tag")?;
            let positions = match tag {
                "BlockStored" => STORED_POSITIONS,
                "BlockRemoved" => REMOVED_POSITIONS,
                _ => CLEARED_POSITIONS,
            };
            (tag, Fields::Array(items, positions))
        }
        _ => return Err("event is neither a map nor an array".into()),
    };
    match tag {
        "BlockStored" => {
            let min = if matches!(fields, Fields::Array(..)) {
                5
            } else {
                0
            };
            if let Fields::Array(items, _) = &fields {
                if items.len() < min {
                    return Err(format!(
                        "BlockStored array has {} elements, needs at least {min}",
                        items.len()
                    ));
                }
            }
            Ok(KvEvent::BlockStored {
                block_hashes: hashes(
                    fields
                        .get("block_hashes")
                        .ok_or("BlockStored without block_hashes")?,
                )?,
                parent_block_hash: fields.get("parent_block_hash").map(hash).transpose()?,
                token_ids: tokens(
                    fields
                        .get("token_ids")
                        .ok_or("BlockStored without token_ids")?,
                )?,
                block_size: fields
                    .get("block_size")
                    .map(|v| uint(v, "block_size"))
                    .transpose()?
                    .unwrap_or(0),
                lora_id: fields.get("lora_id").and_then(Value::as_i64),
                medium: fields
                    .get("medium")
                    .map(|v| string(v, "medium"))
                    .transpose()?,
                lora_name: fields
                    .get("lora_name")
                    .map(|v| string(v, "lora_name"))
                    .transpose()?,
                extra_keys: fields.get("extra_keys").map(extra_keys).transpose()?,
                group_idx: fields
                    .get("group_idx")
                    .map(|v| uint(v, "group_idx"))
                    .transpose()?,
                kv_cache_spec_kind: fields
                    .get("kv_cache_spec_kind")
                    .map(|v| string(v, "kv_cache_spec_kind"))
                    .transpose()?,
                kv_cache_spec_sliding_window: fields
                    .get("kv_cache_spec_sliding_window")
                    .map(|v| uint(v, "kv_cache_spec_sliding_window"))
                    .transpose()?,
            })
        }
        "BlockRemoved" => {
            if let Fields::Array(items, _) = &fields {
                if items.len() < 2 {
                    return Err("BlockRemoved array needs at least 2 elements".into());
                }
            }
            Ok(KvEvent::BlockRemoved {
                block_hashes: hashes(
                    fields
                        .get("block_hashes")
                        .ok_or("BlockRemoved without block_hashes")?,
                )?,
                medium: fields
                    .get("medium")
                    .map(|v| string(v, "medium"))
                    .transpose()?,
                group_idx: fields
                    .get("group_idx")
                    .map(|v| uint(v, "group_idx"))
                    .transpose()?,
            })
        }
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(format!("unknown event type ({} bytes)", other.len())),
    }
}

fn hash(v: &Value) -> Result<BlockHash, String> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|n| n as u64))
            .map(BlockHash::Int)
            .ok_or_else(|| "hash integer out of range".into()),
        Value::Binary(b) if !b.is_empty() => Ok(BlockHash::Bytes(b.clone())),
        _ => Err("block hash is neither an integer nor bytes".into()),
    }
}

fn hashes(v: &Value) -> Result<Vec<BlockHash>, String> {
    match v {
        Value::Array(items) => items.iter().map(hash).collect(),
        _ => Err("block_hashes is not an array".into()),
    }
}

fn tokens(v: &Value) -> Result<Vec<u32>, String> {
    match v {
        Value::Array(items) => items
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| "token id is not a u32".to_string())
            })
            .collect(),
        _ => Err("token_ids is not an array".into()),
    }
}

fn uint(v: &Value, field: &str) -> Result<u32, String> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| format!("{field} is not a small unsigned integer"))
}

fn string(v: &Value, field: &str) -> Result<String, String> {
    match v {
        Value::String(s) => s
            .as_str()
            .map(String::from)
            .ok_or_else(|| format!("{field} is not UTF-8")),
        _ => Err(format!("{field} is not a string")),
    }
}

fn extra_keys(v: &Value) -> Result<Vec<Option<Vec<ExtraKey>>>, String> {
    let Value::Array(per_block) = v else {
        return Err("extra_keys is not an array".into());
    };
    per_block
        .iter()
        .map(|b| match b {
            Value::Nil => Ok(None),
            Value::Array(keys) => Ok(Some(keys.iter().map(extra_key).collect())),
            _ => Err("an extra_keys entry is neither nil nor an array".to_string()),
        })
        .collect()
}

fn extra_key(v: &Value) -> ExtraKey {
    match v {
        Value::String(s) => s.as_str().map_or_else(
            || ExtraKey::Other("non-utf8".into()),
            |s| ExtraKey::Str(s.to_string()),
        ),
        Value::Binary(b) => ExtraKey::Bytes(b.clone()),
        Value::Array(items) => ExtraKey::Array(items.iter().map(extra_key).collect()),
        Value::Integer(i) => i
            .as_i64()
            .map_or_else(|| ExtraKey::Other(i.to_string()), ExtraKey::Int),
        other => ExtraKey::Other(other.to_string()),
    }
}
