//! vLLM KV-cache events: typed events, the msgpack codec (vLLM 0.33 map layout and the legacy
//! positional layouts), and the ZMQ subscriber that feeds them to the index.

mod encode;
mod types;

pub use encode::{encode_batch, encode_event};
pub use types::{BlockHash, ExtraKey, KvEvent, KvEventBatch, Medium};
