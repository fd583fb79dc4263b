//! Precise index fed by vLLM KV events. Dual keys: the router computes its own chained block
//! keys from each `BlockStored`'s `token_ids` (seeded by model or LoRA name and cache salt, at the
//! router's block size), and keeps engine hash → router keys so `BlockRemoved`, which names
//! engine hashes only, resolves. A speculative side holds each decision's guess of its request's
//! blocks until the pod's reports settle it or `speculative_ttl_ms` passes (long enough to cover
//! a request's queueing and prefill under load): how, in [`guess`]. How each event kind changes
//! the state: [`apply`].

mod apply;
mod guess;
#[cfg(test)]
mod tests;

use ahash::AHashMap;
use async_trait::async_trait;
use parking_lot::RwLock;
use smallvec::SmallVec;

use super::table::{Holder, Holders, Slot, Table, Weights, RECORD_CHUNK};
use super::{ApplyStats, IndexError, IndexStats, KvIndex};
use crate::blocks::BlockKey;
use crate::events::KvEventBatch;
use crate::pods::PodId;
use guess::Guesses;

/// A pod's hold on a router key: how many of its engine blocks (per tier) produce the key.
#[derive(Debug, Clone, Copy)]
struct KeyHolder {
    slot: Slot,
    gpu: u32,
    cpu: u32,
}

impl Holder for KeyHolder {
    fn slot(&self) -> Slot {
        self.slot
    }
    /// Offloaded only: weighs `cpu_weight`.
    fn lesser(&self) -> bool {
        self.gpu == 0
    }
}

/// Where a router-key chain stands after an engine block: the last full router key, the tokens
/// not yet making a full router block, and the chain's first router key (its root: a shared
/// index groups a prefix's keys by it; 0 until the chain completes a key).
#[derive(Debug, Clone, Default)]
struct Chain {
    prev: u64,
    pending: SmallVec<[u32; 16]>,
    root: u64,
}

/// (root, key) pairs whose hold by a pod may have changed, for a backend mirroring this index.
pub(crate) type Touched = Vec<(u64, BlockKey)>;

/// One engine block of a pod: the router keys completed in it and its tiers.
#[derive(Debug, Clone)]
struct EngineBlock {
    keys: SmallVec<[BlockKey; 2]>,
    end: Chain,
    gpu: bool,
    cpu: bool,
}

/// Engine blocks are keyed by (DP rank, engine hash): ranks have separate caches.
type EngineKey = (u32, u64);

struct PodState {
    id: PodId,
    blocks: AHashMap<EngineKey, EngineBlock>,
    speculative: Guesses,
}

impl PodState {
    fn new(id: &PodId, speculative_capacity: usize) -> Self {
        Self {
            id: id.clone(),
            blocks: AHashMap::new(),
            speculative: Guesses::new(speculative_capacity),
        }
    }
}

/// Tunables of the precise index.
#[derive(Debug, Clone)]
pub struct EventIndexConfig {
    /// Router block size in tokens (need not equal the engine's).
    pub block_tokens: usize,
    /// Most blocks keyed per request (kept for configuration compatibility; the index does not
    /// use it: event chains are bounded by the payload limit and the per-pod block budget).
    pub max_blocks: usize,
    /// Weight of a GPU-resident block.
    pub gpu_weight: f64,
    /// Weight of a CPU-resident (offloaded) block.
    pub cpu_weight: f64,
    /// Speculative entries live this long unless the pod reports on their keys first.
    pub speculative_ttl_ms: u64,
    /// Speculative entries kept per pod.
    pub speculative_capacity: usize,
    /// Engine blocks tracked per pod before the pod's state is judged corrupt and purged.
    pub max_engine_blocks_per_pod: usize,
}

impl Default for EventIndexConfig {
    fn default() -> Self {
        Self {
            block_tokens: 16,
            max_blocks: 4096,
            gpu_weight: 1.0,
            cpu_weight: 0.8,
            speculative_ttl_ms: 30_000,
            speculative_capacity: 65_536,
            max_engine_blocks_per_pod: 4_000_000,
        }
    }
}

/// The precise, event-fed index.
pub struct EventIndex {
    inner: RwLock<Table<PodState, KeyHolder>>,
    cfg: EventIndexConfig,
}

impl EventIndex {
    /// An empty index.
    pub fn new(cfg: EventIndexConfig) -> Self {
        Self {
            inner: RwLock::new(Table::default()),
            cfg,
        }
    }

    /// Engine blocks tracked for a pod (all ranks).
    #[cfg(test)]
    fn engine_blocks(&self, pod: &PodId) -> usize {
        let inner = self.inner.read();
        inner
            .pods
            .get(pod)
            .and_then(|s| inner.pods.state(s))
            .map_or(0, |p| p.blocks.len())
    }
}

/// Adds one tier's hold of `key` by `slot`. The pod's own report settles the key, so a
/// decision's guess about it goes (and the decision's hits, if it computes the key).
fn hold(
    holders: &mut Holders<KeyHolder>,
    speculative: &mut Guesses,
    settled: &mut Option<Touched>,
    key: BlockKey,
    slot: Slot,
    gpu: bool,
) {
    speculative.stored(&key, settled);
    holders.upsert(
        key,
        slot,
        |h| {
            if gpu {
                h.gpu += 1
            } else {
                h.cpu += 1
            }
        },
        || KeyHolder {
            slot,
            gpu: u32::from(gpu),
            cpu: u32::from(!gpu),
        },
    );
}

/// Drops one tier's hold of `key` by `slot`; the entry goes with its last hold. A speculative
/// guess about the key stays: the request it was made for has not run yet (its reports would
/// have settled the guess), so it will compute the evicted block again.
fn release(holders: &mut Holders<KeyHolder>, key: &BlockKey, slot: Slot, gpu: bool) {
    holders.update_or_remove(key, slot, |h| {
        if gpu {
            h.gpu = h.gpu.saturating_sub(1);
        } else {
            h.cpu = h.cpu.saturating_sub(1);
        }
        h.gpu > 0 || h.cpu > 0
    });
}

/// Removes every engine block of `state` (of one rank, or all ranks) and its holds, noting the
/// keys in `touched` when tracked.
fn purge(
    state: &mut PodState,
    holders: &mut Holders<KeyHolder>,
    slot: Slot,
    rank: Option<u32>,
    touched: &mut Option<Touched>,
) {
    let PodState { blocks, .. } = state;
    blocks.retain(|(r, _), b| {
        if rank.is_some_and(|x| x != *r) {
            return true;
        }
        if let Some(t) = touched {
            t.extend(b.keys.iter().map(|&k| (b.end.root, k)));
        }
        for key in &b.keys {
            if b.gpu {
                release(holders, key, slot, true);
            }
            if b.cpu {
                release(holders, key, slot, false);
            }
        }
        false
    });
}

/// What a backend mirroring this index (the Redis one) needs: which keys a change touched, and
/// what a pod now holds.
impl EventIndex {
    /// Applies `batch` as [`KvIndex::apply_events`] does and returns the keys whose hold it
    /// changed and the keys whose guess it settled as a decision's hits.
    pub(crate) fn apply_tracked(
        &self,
        pod: &PodId,
        rank: u32,
        model: &str,
        batch: &KvEventBatch,
    ) -> (ApplyStats, Touched, Touched) {
        let mut inner = self.inner.write();
        let Table { pods, holders } = &mut *inner;
        let slot =
            pods.get_or_insert_with(pod, || PodState::new(pod, self.cfg.speculative_capacity));
        let mut apply = apply::Apply::new(&self.cfg, pods.state_mut(slot), holders, slot, rank);
        apply.touched = Some(Vec::new());
        apply.settled = Some(Vec::new());
        for event in &batch.events {
            apply.event(model, event);
        }
        let touched = apply.touched.take().unwrap_or_default();
        let settled = apply.settled.take().unwrap_or_default();
        (apply.stats, touched, settled)
    }

    /// Drops one rank's event state as [`KvIndex::forget_rank`] does and returns the keys it held.
    pub(crate) fn forget_rank_tracked(&self, pod: &PodId, rank: u32) -> Touched {
        let mut inner = self.inner.write();
        let Table { pods, holders } = &mut *inner;
        let mut touched = Some(Vec::new());
        if let Some(slot) = pods.get(pod) {
            let state = pods.state_mut(slot);
            purge(state, holders, slot, Some(rank), &mut touched);
            state.speculative.clear();
        }
        touched.unwrap_or_default()
    }

    /// Pods with event state.
    pub(crate) fn pods(&self) -> Vec<PodId> {
        let inner = self.inner.read();
        inner
            .pods
            .iter()
            .filter(|(_, p)| !p.blocks.is_empty())
            .map(|(_, p)| p.id.clone())
            .collect()
    }

    /// Every (root, key, tier) `pod` holds through its events, sorted by root.
    pub(crate) fn held(&self, pod: &PodId) -> Vec<(u64, BlockKey, Option<bool>)> {
        let inner = self.inner.read();
        let Some(slot) = inner.pods.get(pod) else {
            return Vec::new();
        };
        let Some(state) = inner.pods.state(slot) else {
            return Vec::new();
        };
        let mut out: Vec<(u64, BlockKey, Option<bool>)> = Vec::new();
        for b in state.blocks.values() {
            for k in &b.keys {
                let gpu = inner
                    .holders
                    .of(k)
                    .iter()
                    .find(|h| h.slot == slot)
                    .map(|h| h.gpu > 0);
                out.push((b.end.root, *k, gpu));
            }
        }
        out.sort_unstable_by_key(|&(r, k, _)| (r, k.0));
        out.dedup_by_key(|e| (e.0, e.1));
        out
    }

    /// How many of `keys`, from the first, `pod` holds through its events (in either tier): a
    /// request routed there hits those and computes the rest.
    pub(crate) fn held_prefix(&self, pod: &PodId, keys: &[BlockKey]) -> usize {
        let inner = self.inner.read();
        let Some(slot) = inner.pods.get(pod) else {
            return 0;
        };
        keys.iter()
            .take_while(|k| inner.holders.of(k).iter().any(|h| h.slot == slot))
            .count()
    }

    /// How `pod` holds `key` through its events: `Some(true)` with a GPU copy, `Some(false)`
    /// offloaded only, `None` not at all (speculative entries do not count).
    pub(crate) fn tier(&self, pod: &PodId, key: &BlockKey) -> Option<bool> {
        let inner = self.inner.read();
        let slot = inner.pods.get(pod)?;
        let h = inner.holders.of(key).iter().find(|h| h.slot == slot)?;
        Some(h.gpu > 0)
    }

    /// Records a decision's guess of `keys` on `pod`, of which the pod holds the first `held`
    /// (its hits, a group [`guess`] ends together). Returns whether anything was guessed: a
    /// request that computes nothing gets no guess (nothing it stores would end one).
    pub(crate) fn record_past(
        &self,
        pod: &PodId,
        keys: &[BlockKey],
        held: usize,
        now_ms: u64,
    ) -> bool {
        let (Some(first), true) = (keys.first(), held < keys.len()) else {
            return false;
        };
        let expiry = now_ms.saturating_add(self.cfg.speculative_ttl_ms);
        let group = {
            let mut inner = self.inner.write();
            let slot = inner
                .pods
                .get_or_insert_with(pod, || PodState::new(pod, self.cfg.speculative_capacity));
            let state = inner.pods.state_mut(slot);
            state.speculative.open(first.0, &keys[..held], expiry)
        };
        // A chunk per hold of the write lock, so lookups and event batches never wait for a
        // whole long prompt (as in `MemoryIndex::record`); the head goes last, most recent.
        let mut end = keys.len();
        for chunk in keys.rchunks(RECORD_CHUNK) {
            let start = end - chunk.len();
            let mut inner = self.inner.write();
            let slot = inner
                .pods
                .get_or_insert_with(pod, || PodState::new(pod, self.cfg.speculative_capacity));
            let state = inner.pods.state_mut(slot);
            for (i, &key) in chunk.iter().enumerate().rev() {
                state.speculative.put(key, expiry, group, start + i < held);
            }
            end = start;
        }
        true
    }
}

#[async_trait]
impl KvIndex for EventIndex {
    async fn lookup(
        &self,
        keys: &[BlockKey],
        pods: &[PodId],
        now_ms: u64,
    ) -> Result<Vec<f64>, IndexError> {
        let inner = self.inner.read();
        let weights = Weights {
            full: self.cfg.gpu_weight,
            lesser: self.cfg.cpu_weight,
        };
        Ok(inner.lookup(keys, pods, now_ms, weights, |state, key| {
            if state.speculative.is_empty() {
                return None;
            }
            state.speculative.live(key, now_ms).then_some(weights.full)
        }))
    }

    async fn record(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64) -> Result<(), IndexError> {
        self.record_past(pod, keys, self.held_prefix(pod, keys), now_ms);
        Ok(())
    }

    async fn forget_pod(&self, pod: &PodId) -> Result<(), IndexError> {
        let mut inner = self.inner.write();
        let Table { pods, holders } = &mut *inner;
        if let Some((slot, mut state)) = pods.remove(pod) {
            purge(&mut state, holders, slot, None, &mut None);
        }
        Ok(())
    }

    async fn forget_rank(&self, pod: &PodId, rank: u32) -> Result<(), IndexError> {
        let mut inner = self.inner.write();
        let Table { pods, holders } = &mut *inner;
        if let Some(slot) = pods.get(pod) {
            let state = pods.state_mut(slot);
            purge(state, holders, slot, Some(rank), &mut None);
            state.speculative.clear();
        }
        Ok(())
    }

    async fn set_capacity(&self, _pod: &PodId, _blocks: usize) -> Result<(), IndexError> {
        // Events are authoritative about what a pod holds; capacity needs no enforcing here.
        Ok(())
    }

    async fn sweep(&self, now_ms: u64) -> Result<(), IndexError> {
        let mut inner = self.inner.write();
        for (_, state) in inner.pods.iter_mut() {
            state.speculative.sweep(now_ms);
        }
        Ok(())
    }

    async fn apply_events(
        &self,
        pod: &PodId,
        rank: u32,
        model: &str,
        batch: &KvEventBatch,
    ) -> Result<ApplyStats, IndexError> {
        let mut inner = self.inner.write();
        let Table { pods, holders } = &mut *inner;
        let slot =
            pods.get_or_insert_with(pod, || PodState::new(pod, self.cfg.speculative_capacity));
        let mut apply = apply::Apply::new(&self.cfg, pods.state_mut(slot), holders, slot, rank);
        for event in &batch.events {
            apply.event(model, event);
        }
        Ok(apply.stats)
    }

    fn stats(&self) -> IndexStats {
        self.inner.read().stats(|p| !p.blocks.is_empty())
    }

    fn describe(&self) -> &'static str {
        "events (precise: vLLM KV events + speculative entries)"
    }
}

impl std::fmt::Debug for EventIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner.read();
        let pods: Vec<&PodId> = inner.pods.iter().map(|(_, p)| &p.id).collect();
        f.debug_struct("EventIndex")
            .field("pods", &pods)
            .field("stats", &inner.stats(|p| !p.blocks.is_empty()))
            .finish()
    }
}
