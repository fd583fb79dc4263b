//! vLLM KV-cache events: typed events, the msgpack codec (vLLM 0.33 map layout and the legacy
//! positional layouts) and per-publisher sequence tracking. The service that subscribes to pods
//! and feeds the index lives in `crate::ingest`.

mod decode;
mod encode;
pub(crate) mod sequence;
mod types;

#[cfg(test)]
mod fixture_tests;

pub use decode::{decode_batch, DecodeError};
pub use encode::encode_batch;
pub(crate) use types::Medium;
pub use types::{BlockHash, ExtraKey, KvEvent, KvEventBatch};

/// A fixture payload by name (tests only; reads `data/vllm-kv-events`).
#[cfg(test)]
pub(crate) fn fixture_payload(name: &str) -> Vec<u8> {
    fixture_tests::payload(name)
}
