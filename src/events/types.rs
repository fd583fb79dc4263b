//! KV-cache event types as vLLM defines them (`vllm/distributed/kv_events.py`, 0.33), normalised
//! just enough for a router: hashes keep their wire form, extra keys keep their structure.

/// A block hash as it appears on the wire: an integer (int mode) or the raw digest (bytes mode).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` (default): the digest's last 8 bytes, big-endian.
    /// Negative int64 values from old vLLM are reinterpreted as u64.
    Int(u64),
    /// The raw digest (32 bytes for sha256, 16 for xxhash).
    Bytes(Vec<u8>),
}

impl BlockHash {
    /// The int-mode value: ints as is, digests folded to their last 8 bytes big-endian.
    pub fn as_u64(&self) -> u64 {
        match self {
            BlockHash::Int(v) => *v,
            BlockHash::Bytes(b) => {
                let mut buf = [0u8; 8];
                let tail = &b[b.len().saturating_sub(8)..];
                buf[8 - tail.len()..].copy_from_slice(tail);
                u64::from_be_bytes(buf)
            }
        }
    }
}

/// Storage tier of a block (`medium`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Medium {
    /// `"GPU"` (also assumed when absent).
    Gpu,
    /// `"CPU"` (offload connector).
    Cpu,
    /// Anything else (`"STORAGE"`, …).
    Other(String),
}

impl Medium {
    /// From the wire value (`None` = GPU).
    pub fn parse(s: Option<&str>) -> Self {
        match s {
            None => Medium::Gpu,
            Some(s) if s.eq_ignore_ascii_case("gpu") => Medium::Gpu,
            Some(s) if s.eq_ignore_ascii_case("cpu") => Medium::Cpu,
            Some(s) => Medium::Other(s.to_string()),
        }
    }
}

/// One element of a block's published `extra_keys` (untagged form, §6.3 of the reference).
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraKey {
    /// A string: LoRA name or cache salt.
    Str(String),
    /// Bytes: a prompt-embeddings digest.
    Bytes(Vec<u8>),
    /// A multimodal item `[identifier, offset]`, or any other array.
    Array(Vec<ExtraKey>),
    /// An integer.
    Int(i64),
    /// Anything else (kept so the event round-trips).
    Other(String),
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks became full and cached.
    BlockStored {
        /// Hashes of the newly stored blocks, in order.
        block_hashes: Vec<BlockHash>,
        /// Hash of the block before the first one; `None` = chain starts at token 0.
        parent_block_hash: Option<BlockHash>,
        /// Tokens of the covered range.
        token_ids: Vec<u32>,
        /// Tokens per block (0 in offload placeholders).
        block_size: u32,
        /// Deprecated integer adapter id.
        lora_id: Option<i64>,
        /// Storage tier.
        medium: Option<String>,
        /// Adapter name.
        lora_name: Option<String>,
        /// Per block: its published extra keys (`None` = none); absent when not sent.
        extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
        /// KV-cache group (absent = 0).
        group_idx: Option<u32>,
        /// KV-cache spec kind, e.g. `full_attention`.
        kv_cache_spec_kind: Option<String>,
        /// Sliding window size for sliding-window groups.
        kv_cache_spec_sliding_window: Option<u32>,
    },
    /// Blocks were evicted.
    BlockRemoved {
        /// Hashes removed.
        block_hashes: Vec<BlockHash>,
        /// Storage tier.
        medium: Option<String>,
        /// KV-cache group.
        group_idx: Option<u32>,
    },
    /// The whole prefix cache was reset.
    AllBlocksCleared,
}

/// One published message: `[ts, events, data_parallel_rank]`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Seconds since the epoch.
    pub ts: f64,
    /// Events, to be applied in order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank (absent in the earliest layout).
    pub data_parallel_rank: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_hash_folds_to_last_eight_bytes() {
        let mut d = vec![0u8; 32];
        d[24..].copy_from_slice(&0x1efe_a062_06ac_0749u64.to_be_bytes());
        assert_eq!(BlockHash::Bytes(d).as_u64(), 0x1efe_a062_06ac_0749);
        assert_eq!(BlockHash::Bytes(vec![1, 2]).as_u64(), 0x0102);
    }
}
