//! The prefix index: which pods hold which block keys. A trait at the seam so the in-memory
//! index and a networked (Redis) index serve the same scorers unchanged.

mod memory;

use async_trait::async_trait;
use serde::Serialize;
use thiserror::Error;

use crate::blocks::BlockKey;
use crate::pods::PodId;

pub use memory::MemoryIndex;

/// An index operation failed (only networked backends fail; callers route without it).
#[derive(Debug, Error)]
pub enum IndexError {
    /// The backend could not be reached or answered badly.
    #[error("index backend unavailable: {0}")]
    Unavailable(String),
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
/// monotonic clock) so tests and `kv-bench simulate` control it.
#[async_trait]
pub trait KvIndex: Send + Sync + 'static {
    /// For each of `pods`, how many leading `keys` it holds (consecutive from the first).
    async fn lookup(
        &self,
        keys: &[BlockKey],
        pods: &[PodId],
        now_ms: u64,
    ) -> Result<Vec<f64>, IndexError>;
    /// Records that `pod` now holds `keys` (the router's own decision; refreshes their TTL).
    async fn record(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64) -> Result<(), IndexError>;
    /// Drops everything about `pod`.
    async fn forget_pod(&self, pod: &PodId) -> Result<(), IndexError>;
    /// Sets how many blocks `pod` can hold (its KV-cache size); extra entries are evicted.
    async fn set_capacity(&self, pod: &PodId, blocks: usize) -> Result<(), IndexError>;
    /// Drops entries older than the TTL.
    async fn sweep(&self, now_ms: u64) -> Result<(), IndexError>;
    /// Current size.
    fn stats(&self) -> IndexStats;
    /// Backend name for `/debug/pods`.
    fn describe(&self) -> &'static str;
}
