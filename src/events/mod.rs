//! vLLM KV-cache events: typed events, the msgpack codec (vLLM 0.33 map layout and the legacy
//! positional layouts), and the ZMQ subscriber that feeds them to the index.

mod decode;
mod encode;
pub mod ingest;
pub mod sequence;
pub mod subscriber;
mod types;

#[cfg(test)]
mod fixture_tests;

pub use decode::{decode_batch, DecodeError, MAX_PAYLOAD_BYTES};
pub use encode::{encode_batch, encode_event};
pub use types::{BlockHash, ExtraKey, KvEvent, KvEventBatch, Medium};

/// A fixture payload by name (tests only; reads `shared/fixtures/vllm-kv-events`).
#[cfg(test)]
pub(crate) fn fixture_payload(name: &str) -> Vec<u8> {
    fixture_tests::payload(name)
}
