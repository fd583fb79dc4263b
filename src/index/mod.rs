//! The prefix index: which pods hold which block keys. A trait at the seam so the in-memory
//! index and a networked (Redis) index serve the same scorers unchanged.

mod build;
mod events;
mod memory;

use async_trait::async_trait;
use serde::Serialize;
use thiserror::Error;

use crate::blocks::BlockKey;
use crate::pods::PodId;

pub use build::{build_index, index_capacity};
pub use events::{EventIndex, EventIndexConfig};
pub use memory::MemoryIndex;

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
    /// Current size.
    fn stats(&self) -> IndexStats;
    /// Backend name for `/debug/pods`.
    fn describe(&self) -> &'static str;
}

/// The consecutive-prefix walk shared by the backends. For each key in order, `holders` yields
/// `(slot, weight)` of every pod slot holding it; `fallback(candidate, key)` may still vouch for an
/// alive candidate that no holder named (speculative entries). A candidate drops out at its first
/// missing key. Costs O(holders + alive candidates) per key, not O(holders × candidates).
pub(crate) fn prefix_walk<I>(
    keys: &[BlockKey],
    cand_slots: &[Option<u32>],
    mut holders: impl FnMut(&BlockKey) -> I,
    mut fallback: impl FnMut(usize, &BlockKey) -> Option<f64>,
) -> Vec<f64>
where
    I: IntoIterator<Item = (u32, f64)>,
{
    const NONE: usize = usize::MAX;
    let n = cand_slots.len();
    let mut matched = vec![0.0; n];
    let max_slot = cand_slots
        .iter()
        .flatten()
        .copied()
        .max()
        .map_or(0, |m| m as usize + 1);
    let mut cand_of = vec![NONE; max_slot];
    for (c, s) in cand_slots.iter().enumerate() {
        if let Some(s) = s {
            cand_of[*s as usize] = c;
        }
    }
    let mut alive: Vec<usize> = (0..n).filter(|&c| cand_slots[c].is_some()).collect();
    let mut stamp = vec![usize::MAX; n];
    let mut weight = vec![0.0; n];
    for (ki, key) in keys.iter().enumerate() {
        if alive.is_empty() {
            break;
        }
        for (slot, w) in holders(key) {
            if let Some(&c) = cand_of.get(slot as usize) {
                if c != NONE {
                    stamp[c] = ki;
                    weight[c] = w;
                }
            }
        }
        alive.retain(|&c| {
            let w = if stamp[c] == ki {
                Some(weight[c])
            } else {
                fallback(c, key)
            };
            match w {
                Some(w) => {
                    matched[c] += w;
                    true
                }
                None => false,
            }
        });
    }
    matched
}
