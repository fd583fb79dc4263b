//! Precise index fed by vLLM KV events. Dual keys: the router computes its own chained block
//! keys from each `BlockStored`'s `token_ids` (seeded by model or LoRA name and cache salt, at the
//! router's block size), and keeps engine hash → router keys so `BlockRemoved`, which names
//! engine hashes only, resolves. A short-TTL speculative side holds each decision's keys until
//! the pod's own events arrive.

use ahash::AHashMap;
use async_trait::async_trait;
use lru::LruCache;
use parking_lot::RwLock;
use smallvec::SmallVec;

use super::{ApplyStats, IndexError, IndexStats, KvIndex};
use crate::blocks::{chain_token_block, namespace_seed, BlockKey};
use crate::events::{ExtraKey, KvEvent, KvEventBatch, Medium};
use crate::pods::PodId;

type Slot = u32;

#[derive(Debug, Clone, Copy)]
struct Holder {
    slot: Slot,
    gpu: u32,
    cpu: u32,
}

#[derive(Debug, Clone, Default)]
struct Chain {
    prev: u64,
    pending: SmallVec<[u32; 16]>,
}

#[derive(Debug, Clone)]
struct EngineBlock {
    keys: SmallVec<[BlockKey; 2]>,
    end: Chain,
    gpu: bool,
    cpu: bool,
}

struct PodState {
    id: PodId,
    blocks: AHashMap<(u32, u64), EngineBlock>,
    speculative: LruCache<BlockKey, u64>,
}

#[derive(Default)]
struct Inner {
    slots: AHashMap<PodId, Slot>,
    pods: Vec<Option<PodState>>,
    free: Vec<Slot>,
    keys: AHashMap<BlockKey, SmallVec<[Holder; 4]>>,
    entries: usize,
}

/// Tunables of the precise index.
#[derive(Debug, Clone)]
pub struct EventIndexConfig {
    /// Router block size in tokens (need not equal the engine's).
    pub block_tokens: usize,
    /// Most blocks keyed per request (and per event chain walk).
    pub max_blocks: usize,
    /// Weight of a GPU-resident block.
    pub gpu_weight: f64,
    /// Weight of a CPU-resident (offloaded) block.
    pub cpu_weight: f64,
    /// Speculative entries live this long unless events confirm them.
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
            speculative_ttl_ms: 2_000,
            speculative_capacity: 65_536,
            max_engine_blocks_per_pod: 4_000_000,
        }
    }
}

/// The precise, event-fed index.
pub struct EventIndex {
    inner: RwLock<Inner>,
    cfg: EventIndexConfig,
}

fn nz(n: usize) -> std::num::NonZeroUsize {
    std::num::NonZeroUsize::new(n.max(1)).expect("max(1)")
}

impl EventIndex {
    /// An empty index.
    pub fn new(cfg: EventIndexConfig) -> Self {
        Self {
            inner: RwLock::new(Inner::default()),
            cfg,
        }
    }
}

impl Inner {
    fn slot(&mut self, pod: &PodId, spec_cap: usize) -> Slot {
        if let Some(&s) = self.slots.get(pod) {
            return s;
        }
        let state = PodState {
            id: pod.clone(),
            blocks: AHashMap::new(),
            speculative: LruCache::new(nz(spec_cap)),
        };
        let s = match self.free.pop() {
            Some(s) => {
                self.pods[s as usize] = Some(state);
                s
            }
            None => {
                self.pods.push(Some(state));
                (self.pods.len() - 1) as Slot
            }
        };
        self.slots.insert(pod.clone(), s);
        s
    }

    fn add_key(&mut self, key: BlockKey, slot: Slot, gpu: bool) {
        let holders = self.keys.entry(key).or_default();
        match holders.iter_mut().find(|h| h.slot == slot) {
            Some(h) => {
                if gpu {
                    h.gpu += 1
                } else {
                    h.cpu += 1
                }
            }
            None => {
                holders.push(Holder {
                    slot,
                    gpu: u32::from(gpu),
                    cpu: u32::from(!gpu),
                });
                self.entries += 1;
            }
        }
    }

    fn drop_key(&mut self, key: BlockKey, slot: Slot, gpu: bool) {
        let Some(holders) = self.keys.get_mut(&key) else {
            return;
        };
        if let Some(i) = holders.iter().position(|h| h.slot == slot) {
            let h = &mut holders[i];
            if gpu {
                h.gpu = h.gpu.saturating_sub(1);
            } else {
                h.cpu = h.cpu.saturating_sub(1);
            }
            if h.gpu == 0 && h.cpu == 0 {
                holders.swap_remove(i);
                self.entries -= 1;
            }
        }
        if holders.is_empty() {
            self.keys.remove(&key);
        }
    }

    /// Removes every engine block of `slot` (of one rank, or all ranks).
    fn purge(&mut self, slot: Slot, rank: Option<u32>) {
        let Some(state) = self.pods[slot as usize].as_mut() else {
            return;
        };
        let doomed: Vec<(u32, u64)> = state
            .blocks
            .keys()
            .filter(|(r, _)| rank.is_none_or(|x| x == *r))
            .copied()
            .collect();
        let mut removed = Vec::with_capacity(doomed.len());
        for k in doomed {
            if let Some(b) = state.blocks.remove(&k) {
                removed.push(b);
            }
        }
        for b in removed {
            for key in b.keys {
                if b.gpu {
                    self.drop_key(key, slot, true);
                }
                if b.cpu {
                    self.drop_key(key, slot, false);
                }
            }
        }
    }
}

/// The cache salt published in block 0's extra keys (the string that is not the LoRA name).
fn salt_of(extra: Option<&Vec<Option<Vec<ExtraKey>>>>, lora: Option<&str>) -> Option<String> {
    let first = extra?.first()?.as_ref()?;
    let mut lora_seen = false;
    first.iter().find_map(|k| match k {
        ExtraKey::Str(s) if lora == Some(s.as_str()) && !lora_seen => {
            lora_seen = true;
            None
        }
        ExtraKey::Str(s) => Some(s.clone()),
        _ => None,
    })
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
        let slots: Vec<Option<Slot>> = pods.iter().map(|p| inner.slots.get(p).copied()).collect();
        let mut matched = vec![0.0; pods.len()];
        let mut alive: Vec<bool> = slots.iter().map(Option::is_some).collect();
        let mut remaining = alive.iter().filter(|a| **a).count();
        for key in keys {
            if remaining == 0 {
                break;
            }
            let holders = inner.keys.get(key);
            for (i, slot) in slots.iter().enumerate() {
                if !alive[i] {
                    continue;
                }
                let slot = slot.expect("alive implies a slot");
                let confirmed = holders
                    .and_then(|hs| hs.iter().find(|h| h.slot == slot))
                    .map(|h| {
                        if h.gpu > 0 {
                            self.cfg.gpu_weight
                        } else {
                            self.cfg.cpu_weight
                        }
                    });
                let weight = confirmed.or_else(|| {
                    let state = inner.pods[slot as usize].as_ref()?;
                    state
                        .speculative
                        .peek(key)
                        .filter(|&&exp| exp > now_ms)
                        .map(|_| self.cfg.gpu_weight)
                });
                match weight {
                    Some(w) => matched[i] += w,
                    None => {
                        alive[i] = false;
                        remaining -= 1;
                    }
                }
            }
        }
        Ok(matched)
    }

    async fn record(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64) -> Result<(), IndexError> {
        let expiry = now_ms.saturating_add(self.cfg.speculative_ttl_ms);
        let mut inner = self.inner.write();
        let slot = inner.slot(pod, self.cfg.speculative_capacity);
        let state = inner.pods[slot as usize].as_mut().expect("live slot");
        for &key in keys.iter().rev() {
            state.speculative.put(key, expiry);
        }
        Ok(())
    }

    async fn forget_pod(&self, pod: &PodId) -> Result<(), IndexError> {
        let mut inner = self.inner.write();
        let Some(slot) = inner.slots.remove(pod) else {
            return Ok(());
        };
        inner.purge(slot, None);
        inner.pods[slot as usize] = None;
        inner.free.push(slot);
        Ok(())
    }

    async fn forget_rank(&self, pod: &PodId, rank: u32) -> Result<(), IndexError> {
        let mut inner = self.inner.write();
        if let Some(&slot) = inner.slots.get(pod) {
            inner.purge(slot, Some(rank));
            if let Some(state) = inner.pods[slot as usize].as_mut() {
                state.speculative.clear();
            }
        }
        Ok(())
    }

    async fn set_capacity(&self, _pod: &PodId, _blocks: usize) -> Result<(), IndexError> {
        // Events are authoritative about what a pod holds; capacity needs no enforcing here.
        Ok(())
    }

    async fn sweep(&self, now_ms: u64) -> Result<(), IndexError> {
        let mut inner = self.inner.write();
        for state in inner.pods.iter_mut().flatten() {
            while let Some((_, &exp)) = state.speculative.peek_lru() {
                if exp > now_ms {
                    break;
                }
                state.speculative.pop_lru();
            }
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
        let mut stats = ApplyStats::default();
        let r = self.cfg.block_tokens.max(1);
        let mut buf = Vec::with_capacity(r * 4);
        let mut inner = self.inner.write();
        let slot = inner.slot(pod, self.cfg.speculative_capacity);
        for event in &batch.events {
            match event {
                KvEvent::AllBlocksCleared => {
                    inner.purge(slot, Some(rank));
                    stats.cleared += 1;
                }
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx,
                } => {
                    if group_idx.unwrap_or(0) != 0 {
                        stats.ignored += 1;
                        continue;
                    }
                    let gpu = Medium::parse(medium.as_deref()) == Medium::Gpu;
                    for h in block_hashes {
                        let k = (rank, h.as_u64());
                        let state = inner.pods[slot as usize].as_mut().expect("live slot");
                        let Some(block) = state.blocks.get_mut(&k) else {
                            stats.unknown += 1;
                            continue;
                        };
                        let had = if gpu {
                            std::mem::take(&mut block.gpu)
                        } else {
                            std::mem::take(&mut block.cpu)
                        };
                        let keys = block.keys.clone();
                        if !block.gpu && !block.cpu {
                            state.blocks.remove(&k);
                        }
                        if had {
                            for key in keys {
                                inner.drop_key(key, slot, gpu);
                            }
                        }
                        stats.removed += 1;
                    }
                }
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    medium,
                    lora_name,
                    extra_keys,
                    group_idx,
                    ..
                } => {
                    if group_idx.unwrap_or(0) != 0 {
                        // Only the first KV-cache group is indexed: other groups (sliding window,
                        // Mamba) would report blocks that do not make a prefix hit by themselves.
                        stats.ignored += 1;
                        continue;
                    }
                    let gpu = Medium::parse(medium.as_deref()) == Medium::Gpu;
                    let e = *block_size as usize;
                    if token_ids.is_empty() || e == 0 {
                        // Offload placeholder: only blocks already known by hash gain the tier.
                        for h in block_hashes {
                            let state = inner.pods[slot as usize].as_mut().expect("live slot");
                            let Some(block) = state.blocks.get_mut(&(rank, h.as_u64())) else {
                                stats.unknown += 1;
                                continue;
                            };
                            let newly = if gpu {
                                !std::mem::replace(&mut block.gpu, true)
                            } else {
                                !std::mem::replace(&mut block.cpu, true)
                            };
                            let keys = block.keys.clone();
                            if newly {
                                for key in keys {
                                    inner.add_key(key, slot, gpu);
                                }
                            }
                            stats.stored += 1;
                        }
                        continue;
                    }
                    let mut chain = match parent_block_hash {
                        None => Chain {
                            prev: namespace_seed(
                                lora_name.as_deref().unwrap_or(model),
                                salt_of(extra_keys.as_ref(), lora_name.as_deref()).as_deref(),
                            ),
                            pending: SmallVec::new(),
                        },
                        Some(p) => {
                            let state = inner.pods[slot as usize].as_ref().expect("live slot");
                            match state.blocks.get(&(rank, p.as_u64())) {
                                Some(b) => b.end.clone(),
                                None => {
                                    // Without the parent the chain cannot be continued (llm-d drops too).
                                    stats.unknown_parent += 1;
                                    continue;
                                }
                            }
                        }
                    };
                    for (i, h) in block_hashes.iter().enumerate() {
                        let Some(tokens) = token_ids.get(i * e..(i + 1) * e) else {
                            stats.ignored += 1;
                            break;
                        };
                        let mut keys = SmallVec::new();
                        chain.pending.extend_from_slice(tokens);
                        while chain.pending.len() >= r {
                            let key = chain_token_block(chain.prev, &chain.pending[..r], &mut buf);
                            chain.prev = key.0;
                            chain.pending.drain(..r);
                            keys.push(key);
                        }
                        let k = (rank, h.as_u64());
                        let state = inner.pods[slot as usize].as_mut().expect("live slot");
                        if state.blocks.len() >= self.cfg.max_engine_blocks_per_pod
                            && !state.blocks.contains_key(&k)
                        {
                            stats.overflow += 1;
                            inner.purge(slot, None);
                            break;
                        }
                        let (newly, old_keys) = match state.blocks.get_mut(&k) {
                            Some(existing) => {
                                // Re-announced block (e.g. a hit reported in full): same content.
                                let newly = if gpu {
                                    !std::mem::replace(&mut existing.gpu, true)
                                } else {
                                    !std::mem::replace(&mut existing.cpu, true)
                                };
                                (newly, Some(existing.keys.clone()))
                            }
                            None => {
                                state.blocks.insert(
                                    k,
                                    EngineBlock {
                                        keys: keys.clone(),
                                        end: chain.clone(),
                                        gpu,
                                        cpu: !gpu,
                                    },
                                );
                                (true, None)
                            }
                        };
                        if newly {
                            for key in old_keys.unwrap_or(keys) {
                                inner.add_key(key, slot, gpu);
                            }
                        }
                        stats.stored += 1;
                    }
                }
            }
        }
        Ok(stats)
    }

    fn stats(&self) -> IndexStats {
        let inner = self.inner.read();
        IndexStats {
            keys: inner.keys.len(),
            entries: inner.entries,
            pods: inner
                .pods
                .iter()
                .flatten()
                .filter(|p| !p.blocks.is_empty())
                .count(),
        }
    }

    fn describe(&self) -> &'static str {
        "events (precise: vLLM KV events + speculative entries)"
    }
}

impl EventIndex {
    /// Engine blocks tracked for a pod (all ranks), for debug views and tests.
    pub fn engine_blocks(&self, pod: &PodId) -> usize {
        let inner = self.inner.read();
        inner
            .slots
            .get(pod)
            .and_then(|&s| inner.pods[s as usize].as_ref())
            .map_or(0, |p| p.blocks.len())
    }
}

impl std::fmt::Debug for EventIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner.read();
        let pods: Vec<&PodId> = inner.pods.iter().flatten().map(|p| &p.id).collect();
        f.debug_struct("EventIndex")
            .field("pods", &pods)
            .field("keys", &inner.keys.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use proptest::prelude::*;

    use super::*;
    use crate::blocks::token_keys;
    use crate::events::{decode_batch, BlockHash};

    const MODEL: &str = "Qwen/Qwen3-0.6B";

    fn fixture(name: &str) -> KvEventBatch {
        decode_batch(&crate::events::fixture_payload(name)).unwrap()
    }

    fn keys(
        model: &str,
        salt: Option<&str>,
        tokens: std::ops::Range<u32>,
        size: usize,
    ) -> Vec<BlockKey> {
        let ids: Vec<u32> = tokens.collect();
        token_keys(namespace_seed(model, salt), &ids, size, 1000)
    }

    async fn apply(idx: &EventIndex, pod: &PodId, names: &[&str]) {
        for n in names {
            idx.apply_events(pod, 0, MODEL, &fixture(n)).await.unwrap();
        }
    }

    fn pod(s: &str) -> PodId {
        PodId::new(s)
    }

    #[tokio::test]
    async fn stored_then_removed_blocks_from_fixtures() {
        let idx = EventIndex::new(EventIndexConfig::default());
        let a = pod("10.0.0.5:8000");
        let k = keys(MODEL, None, 0..64, 16);
        apply(
            &idx,
            &a,
            &[
                "01_block_stored_root_int",
                "02_block_stored_with_parent_int",
            ],
        )
        .await;
        assert_eq!(
            idx.lookup(&k, std::slice::from_ref(&a), 0).await.unwrap(),
            vec![4.0]
        );
        apply(&idx, &a, &["06_block_removed"]).await;
        assert_eq!(
            idx.lookup(&k, std::slice::from_ref(&a), 0).await.unwrap(),
            vec![3.0],
            "blocks 0-2 remain"
        );
        apply(&idx, &a, &["07_all_blocks_cleared"]).await;
        assert_eq!(
            idx.lookup(&k, std::slice::from_ref(&a), 0).await.unwrap(),
            vec![0.0]
        );
        assert_eq!(idx.stats(), IndexStats::default());
    }

    #[tokio::test]
    async fn mixed_batch_end_state() {
        let idx = EventIndex::new(EventIndexConfig::default());
        let a = pod("10.0.0.5:8000");
        apply(&idx, &a, &["01_block_stored_root_int", "08_mixed_batch"]).await;
        // GPU {block 0 of tokens 100..115}, CPU {same hash}; the clear dropped tokens 0..31.
        let k = keys(MODEL, None, 100..148, 16);
        assert_eq!(
            idx.lookup(&k, std::slice::from_ref(&a), 0).await.unwrap(),
            vec![1.0]
        );
        assert_eq!(
            idx.lookup(&keys(MODEL, None, 0..32, 16), std::slice::from_ref(&a), 0)
                .await
                .unwrap(),
            vec![0.0]
        );
        assert_eq!(idx.engine_blocks(&a), 1);
        // Removing the GPU copy leaves the CPU tier, weighted 0.8.
        let rm = KvEventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockRemoved {
                block_hashes: vec![BlockHash::Int(10428775992902877628)],
                medium: Some("GPU".into()),
                group_idx: Some(0),
            }],
            data_parallel_rank: Some(0),
        };
        idx.apply_events(&a, 0, MODEL, &rm).await.unwrap();
        assert_eq!(
            idx.lookup(&k, std::slice::from_ref(&a), 0).await.unwrap(),
            vec![0.8]
        );
    }

    #[tokio::test]
    async fn bytes_hashes_behave_like_int_hashes() {
        let idx = EventIndex::new(EventIndexConfig::default());
        let b = pod("10.0.0.6:8000");
        apply(&idx, &b, &["03_bytes_hashes"]).await;
        // Content of 01 + 02, then the removal of block 3.
        assert_eq!(
            idx.lookup(&keys(MODEL, None, 0..64, 16), &[b], 0)
                .await
                .unwrap(),
            vec![3.0]
        );
    }

    #[tokio::test]
    async fn lora_and_salt_seed_the_keys() {
        let idx = EventIndex::new(EventIndexConfig::default());
        let a = pod("10.0.0.5:8000");
        apply(
            &idx,
            &a,
            &[
                "04_block_stored_lora_cache_salt",
                "05_block_stored_cache_salt_only",
            ],
        )
        .await;
        let lora = keys("sql-lora", Some("tenant-a"), 0..32, 16);
        assert_eq!(
            idx.lookup(&lora, std::slice::from_ref(&a), 0)
                .await
                .unwrap(),
            vec![2.0]
        );
        let salted = keys(MODEL, Some("tenant-a"), 0..32, 16);
        assert_eq!(
            idx.lookup(&salted, std::slice::from_ref(&a), 0)
                .await
                .unwrap(),
            vec![2.0]
        );
        let plain = keys(MODEL, None, 0..32, 16);
        assert_eq!(
            idx.lookup(&plain, &[a], 0).await.unwrap(),
            vec![0.0],
            "salted blocks never match unsalted requests"
        );
    }

    #[tokio::test]
    async fn legacy_layouts_index_the_same() {
        let idx = EventIndex::new(EventIndexConfig::default());
        let a = pod("10.0.0.9:8000");
        apply(&idx, &a, &["11_legacy_block_stored"]).await;
        assert_eq!(
            idx.lookup(&keys(MODEL, None, 0..32, 16), std::slice::from_ref(&a), 0)
                .await
                .unwrap(),
            vec![2.0]
        );
        apply(
            &idx,
            &a,
            &[
                "12_legacy_block_removed",
                "13_legacy_all_blocks_cleared",
                "14_legacy_mixed_lora",
            ],
        )
        .await;
        assert_eq!(idx.stats().entries, 0, "14 ends with a clear");
        apply(&idx, &a, &["15_legacy_earliest_layout"]).await;
        assert_eq!(idx.stats().entries, 0, "15 stores, removes, then clears");
    }

    #[tokio::test]
    async fn ranks_are_separate_and_router_block_size_may_differ() {
        let idx = EventIndex::new(EventIndexConfig {
            block_tokens: 32,
            ..EventIndexConfig::default()
        });
        let a = pod("10.0.0.5:8000");
        apply(
            &idx,
            &a,
            &[
                "01_block_stored_root_int",
                "02_block_stored_with_parent_int",
            ],
        )
        .await;
        assert_eq!(
            idx.lookup(&keys(MODEL, None, 0..64, 32), std::slice::from_ref(&a), 0)
                .await
                .unwrap(),
            vec![2.0]
        );
        // Rank 1's blocks are tracked on their own: purging rank 1 keeps rank 0's.
        let c = fixture("09_dp_rank1");
        idx.apply_events(&a, 1, MODEL, &c).await.unwrap();
        idx.forget_rank(&a, 1).await.unwrap();
        assert_eq!(
            idx.lookup(&keys(MODEL, None, 0..64, 32), &[a], 0)
                .await
                .unwrap(),
            vec![2.0]
        );
    }

    #[tokio::test]
    async fn speculative_entries_expire_unless_confirmed() {
        let idx = EventIndex::new(EventIndexConfig::default());
        let a = pod("10.0.0.5:8000");
        let k = keys(MODEL, None, 0..64, 16);
        idx.record(&a, &k, 1000).await.unwrap();
        assert_eq!(
            idx.lookup(&k, std::slice::from_ref(&a), 2999)
                .await
                .unwrap(),
            vec![4.0]
        );
        assert_eq!(
            idx.lookup(&k, std::slice::from_ref(&a), 3000)
                .await
                .unwrap(),
            vec![0.0]
        );
        idx.record(&a, &k, 5000).await.unwrap();
        apply(&idx, &a, &["01_block_stored_root_int"]).await;
        idx.sweep(10_000).await.unwrap();
        assert_eq!(
            idx.lookup(&k, &[a], 10_000).await.unwrap(),
            vec![2.0],
            "confirmed blocks stay"
        );
    }

    #[tokio::test]
    async fn unknown_parent_is_dropped() {
        let idx = EventIndex::new(EventIndexConfig::default());
        let a = pod("10.0.0.5:8000");
        let stats = idx
            .apply_events(&a, 0, MODEL, &fixture("02_block_stored_with_parent_int"))
            .await
            .unwrap();
        assert_eq!(stats.unknown_parent, 1);
        assert_eq!(idx.stats().entries, 0);
    }

    // ---- Property test against a reference model -------------------------------------------

    const E: usize = 4; // engine block tokens (router blocks are 4 tokens too, or 8)

    /// Documents sharing prefixes: doc d's block i has content `content(d, i)`.
    fn content(doc: usize, i: usize) -> u32 {
        // Docs 0 and 1 share their first 2 blocks; doc 2 is unrelated.
        let owner = if doc == 1 && i < 2 { 0 } else { doc };
        (owner * 100 + i) as u32
    }

    fn doc_tokens(doc: usize, n: usize) -> Vec<u32> {
        (0..n)
            .flat_map(|i| (0..E as u32).map(move |t| content(doc, i) * 10 + t))
            .collect()
    }

    /// Engine hash of doc's block i: identifies the whole prefix.
    fn ehash(doc: usize, i: usize) -> u64 {
        let ids: Vec<u32> = doc_tokens(doc, i + 1);
        token_keys(99, &ids, E, 100)[i].0
    }

    #[derive(Debug, Clone)]
    enum Op {
        Store {
            pod: usize,
            doc: usize,
            start: usize,
            n: usize,
            gpu: bool,
        },
        Remove {
            pod: usize,
            doc: usize,
            i: usize,
            gpu: bool,
        },
        Clear {
            pod: usize,
        },
        Lookup {
            doc: usize,
            n: usize,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (0usize..2, 0usize..3, 0usize..5, 1usize..4, prop::bool::weighted(0.8))
                .prop_map(|(pod, doc, start, n, gpu)| Op::Store { pod, doc, start, n, gpu }),
            3 => (0usize..2, 0usize..3, 0usize..6, prop::bool::weighted(0.8))
                .prop_map(|(pod, doc, i, gpu)| Op::Remove { pod, doc, i, gpu }),
            1 => (0usize..2).prop_map(|pod| Op::Clear { pod }),
            4 => (0usize..3, 1usize..7).prop_map(|(doc, n)| Op::Lookup { doc, n }),
        ]
    }

    /// Model: per pod, engine hash → (gpu, cpu) presence.
    #[derive(Default, Clone)]
    struct Model {
        pods: [HashMap<u64, (bool, bool)>; 2],
    }

    impl Model {
        fn lookup(&self, pod: usize, doc: usize, n_router: usize, router: usize) -> f64 {
            let mut total = 0.0;
            for rb in 0..n_router {
                // A router block is held when every engine block it ends in is held; with router
                // blocks of whole engine blocks, that is the engine block containing its end.
                let last_engine = ((rb + 1) * router) / E - 1;
                let w = match self.pods[pod].get(&ehash(doc, last_engine)) {
                    Some((true, _)) => 1.0,
                    Some((false, true)) => 0.8,
                    _ => return total,
                };
                total += w;
            }
            total
        }
    }

    proptest! {
        #[test]
        fn event_index_matches_reference_model(ops in prop::collection::vec(op(), 1..50), router_mult in 1usize..3) {
            let router = E * router_mult;
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let idx = EventIndex::new(EventIndexConfig { block_tokens: router, ..EventIndexConfig::default() });
                let pods = [pod("p:0"), pod("p:1")];
                let mut model = Model::default();
                for op in ops {
                    match op {
                        Op::Store { pod: p, doc, start, n, gpu } => {
                            let parent_ok = start == 0 || model.pods[p].contains_key(&ehash(doc, start - 1));
                            let tokens: Vec<u32> = doc_tokens(doc, start + n)[start * E..].to_vec();
                            let batch = KvEventBatch { ts: 0.0, data_parallel_rank: Some(0), events: vec![KvEvent::BlockStored {
                                block_hashes: (start..start + n).map(|i| BlockHash::Int(ehash(doc, i))).collect(),
                                parent_block_hash: (start > 0).then(|| BlockHash::Int(ehash(doc, start - 1))),
                                token_ids: tokens, block_size: E as u32, lora_id: None,
                                medium: Some(if gpu { "GPU" } else { "CPU" }.into()), lora_name: None,
                                extra_keys: None, group_idx: Some(0), kv_cache_spec_kind: None, kv_cache_spec_sliding_window: None,
                            }]};
                            idx.apply_events(&pods[p], 0, "m", &batch).await.unwrap();
                            // Router blocks can span a missing parent only when the parent chain
                            // is known; the model stores only when the parent is present.
                            if parent_ok && (router == E || start % router_mult == 0 || model.pods[p].contains_key(&ehash(doc, start - 1))) {
                                for i in start..start + n {
                                    let e = model.pods[p].entry(ehash(doc, i)).or_insert((false, false));
                                    if gpu { e.0 = true } else { e.1 = true }
                                }
                            }
                        }
                        Op::Remove { pod: p, doc, i, gpu } => {
                            let batch = KvEventBatch { ts: 0.0, data_parallel_rank: Some(0), events: vec![KvEvent::BlockRemoved {
                                block_hashes: vec![BlockHash::Int(ehash(doc, i))],
                                medium: Some(if gpu { "GPU" } else { "CPU" }.into()), group_idx: None,
                            }]};
                            idx.apply_events(&pods[p], 0, "m", &batch).await.unwrap();
                            let h = ehash(doc, i);
                            if let Some(e) = model.pods[p].get_mut(&h) {
                                if gpu { e.0 = false } else { e.1 = false }
                                if !e.0 && !e.1 { model.pods[p].remove(&h); }
                            }
                        }
                        Op::Clear { pod: p } => {
                            let batch = KvEventBatch { ts: 0.0, data_parallel_rank: Some(0), events: vec![KvEvent::AllBlocksCleared] };
                            idx.apply_events(&pods[p], 0, "m", &batch).await.unwrap();
                            model.pods[p].clear();
                        }
                        Op::Lookup { doc, n } => {
                            let tokens = doc_tokens(doc, n);
                            let k = token_keys(namespace_seed("m", None), &tokens, router, 100);
                            let got = idx.lookup(&k, &pods, 0).await.unwrap();
                            let want: Vec<f64> = (0..2).map(|p| model.lookup(p, doc, k.len(), router)).collect();
                            for (g, w) in got.iter().zip(&want) {
                                prop_assert!((g - w).abs() < 1e-9, "got {:?} want {:?}", got, want);
                            }
                        }
                    }
                }
                let _ = HashSet::<u8>::new();
                Ok(())
            })?;
        }
    }
}
