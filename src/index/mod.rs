//! The prefix index: which pods hold which block keys. A trait at the seam so the in-process
//! indexes and a networked one serve the same scorers unchanged; every backend passes the one
//! conformance suite in `contract/`.
//!
//! - [`MemoryIndex`] (approximate) learns from the router's own decisions (`record`), one LRU per
//!   pod bounded by its KV-cache size, with a TTL.
//! - [`EventIndex`] (precise) learns from vLLM KV events (`apply_events`); `record` only adds
//!   short-lived speculative entries until the pod's events confirm them.
//!
//! - [`RedisIndex`] shares either of them between replicas through Redis/Valkey, keeping the
//!   in-process one as its fail-open fallback.
//!
//! The in-process two keep their state in one `table::Table`: pod ↔ slot with a free list,
//! key → holders.

mod build;
#[cfg(test)]
mod contract;
mod events;
mod memory;
mod redis;
mod table;
pub mod warm;

use async_trait::async_trait;
use serde::Serialize;
use thiserror::Error;

use crate::blocks::BlockKey;
use crate::pods::PodId;

pub use build::{build_index, build_index_among, index_capacity, BuiltIndex};
pub use events::{EventIndex, EventIndexConfig};
pub use memory::MemoryIndex;
pub use redis::{
    decode_lookup_reply as decode_redis_lookup_reply, member as redis_member,
    parse_member as parse_redis_member, parse_run as parse_redis_run,
    run_member as redis_run_member, Local, MembersFeed, PodMembers, Reason as RedisFallbackReason,
    RedisIndex, RedisMetrics, Reload as RedisReload, Source as RedisSource, Tuning,
    Unknown as RedisUnknown, RUN as REDIS_SNAPSHOT_RUN,
};

use crate::events::KvEventBatch;

/// What applying an event batch did (for metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ApplyStats {
    /// Engine blocks stored (or gaining a tier).
    pub stored: u64,
    /// Engine blocks removed.
    pub removed: u64,
    /// `AllBlocksCleared` events.
    pub cleared: u64,
    /// Stores whose parent block was unknown (dropped).
    pub unknown_parent: u64,
    /// Hashes not known to the index (removals, placeholders).
    pub unknown: u64,
    /// Events not indexed (other KV-cache groups, inconsistent token counts).
    pub ignored: u64,
    /// A pod exceeded its block budget and was purged.
    pub overflow: u64,
}

/// An index operation failed. Only networked backends fail; callers route without the index
/// (fail open) and ask [`IndexError::retryable`] whether to keep trying or to tell an operator.
#[derive(Debug, Error)]
pub enum IndexError {
    /// No answer within the operation's budget.
    #[error("index backend timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// The backend could not be reached, or the connection broke.
    #[error("index backend unreachable: {0}")]
    Connection(String),
    /// The backend is out of room or too busy to take the operation (e.g. out of memory, a full
    /// write queue).
    #[error("index backend overloaded: {0}")]
    Overloaded(String),
    /// The backend answered something this router cannot read (version skew, foreign data).
    #[error("index backend answered unexpectedly: {0}")]
    Protocol(String),
    /// The backend refused the operation (authentication, permissions, configuration).
    #[error("index backend refused the operation: {0}")]
    Refused(String),
}

impl IndexError {
    /// Whether the same operation may succeed later without an operator doing anything
    /// (timeouts, lost connections, overload); otherwise retrying only adds load.
    pub fn retryable(&self) -> bool {
        match self {
            IndexError::Timeout(_) | IndexError::Connection(_) | IndexError::Overloaded(_) => true,
            IndexError::Protocol(_) | IndexError::Refused(_) => false,
        }
    }
}

/// Size figures for `/debug/pods` and metrics.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct block keys.
    pub keys: usize,
    /// (key, pod) entries.
    pub entries: usize,
    /// Pods with entries.
    pub pods: usize,
}

/// Lookups and writes of the prefix index. Time is passed in (milliseconds on the router's
/// monotonic clock) so tests and `kv-bench simulate` control it; a backend honours the `now_ms`
/// it is given, never a clock of its own. Every write is idempotent: repeating it (a replayed
/// event batch, the same decision recorded by two replicas) leaves the same state.
#[async_trait]
pub trait KvIndex: Send + Sync + 'static {
    /// For each of `pods`, in order, the weight of the leading `keys` it holds: consecutive from
    /// the first, stopping at its first missing key (a block counts 1, an offloaded one less).
    async fn lookup(
        &self,
        keys: &[BlockKey],
        pods: &[PodId],
        now_ms: u64,
    ) -> Result<Vec<f64>, IndexError>;
    /// Records that `pod` now holds `keys` (the router's own decision): they match until the
    /// backend's TTL after `now_ms`, refreshed by each record. Under the pod's capacity the
    /// least recently recorded keys go first, and a prompt's head counts as its most recent.
    async fn record(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64) -> Result<(), IndexError>;
    /// Drops everything about `pod` (it left the fleet).
    async fn forget_pod(&self, pod: &PodId) -> Result<(), IndexError>;
    /// Sets how many blocks `pod` can hold (its KV-cache size); extra entries are evicted.
    /// Event-fed backends may ignore it: the engine's events say what the pod holds.
    async fn set_capacity(&self, pod: &PodId, blocks: usize) -> Result<(), IndexError>;
    /// Drops entries whose TTL ran out by `now_ms` (lookups already ignore them; this frees them).
    async fn sweep(&self, now_ms: u64) -> Result<(), IndexError>;
    /// Applies one event batch of `pod`'s data-parallel rank `rank`, in order. `model` seeds the
    /// keys of blocks without a LoRA name. Indexes that do not ingest events ignore it.
    async fn apply_events(
        &self,
        _pod: &PodId,
        _rank: u32,
        _model: &str,
        _batch: &KvEventBatch,
    ) -> Result<ApplyStats, IndexError> {
        Ok(ApplyStats::default())
    }
    /// Drops everything learned from one rank's events (sequence gap or engine restart).
    async fn forget_rank(&self, pod: &PodId, _rank: u32) -> Result<(), IndexError> {
        self.forget_pod(pod).await
    }
    /// Waits until every write accepted so far is visible to lookups. Backends that queue writes
    /// off the request path (Redis) need it for read-your-writes; the others are always there.
    async fn flush(&self) -> Result<(), IndexError> {
        Ok(())
    }
    /// Current size (of this process's view, for a shared backend).
    fn stats(&self) -> IndexStats;
    /// Why this replica should not take traffic yet (a shared backend still loading, or too
    /// far behind the other replicas); `None` when it may.
    fn unready(&self) -> Option<String> {
        None
    }
    /// Backend name for `/debug/pods`.
    fn describe(&self) -> &'static str;
    /// This replica's entries at `now_ms` for a starting peer (`index.warm_start`), at most
    /// `max_entries`; `None` from a backend that has none to hand over (a shared index reloads
    /// from Redis, an event-fed one replays the pods' events).
    fn warm_snapshot(&self, _now_ms: u64, _max_entries: usize) -> Option<warm::Snapshot> {
        None
    }
    /// Takes in a peer's snapshot at `now_ms`, keeping the pods `known` says this replica
    /// lists; `None` from a backend that takes none.
    fn warm_restore(
        &self,
        _snap: &warm::Snapshot,
        _now_ms: u64,
        _known: &dyn Fn(&PodId) -> bool,
    ) -> Option<warm::Imported> {
        None
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::IndexError;

    #[test]
    fn transient_failures_are_retryable_and_answers_that_would_repeat_are_not() {
        for e in [
            IndexError::Timeout(Duration::from_millis(5)),
            IndexError::Connection("connection reset".into()),
            IndexError::Overloaded("OOM command not allowed".into()),
        ] {
            assert!(e.retryable(), "{e}");
        }
        for e in [
            IndexError::Protocol("unexpected reply type".into()),
            IndexError::Refused("WRONGPASS".into()),
        ] {
            assert!(!e.retryable(), "{e}");
        }
    }
}
