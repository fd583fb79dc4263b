//! In-memory prefix index: key → pods, plus one LRU per pod bounded by the pod's KV-cache size,
//! with a TTL on every entry. One lock, never held across an `.await`.

use ahash::AHashMap;
use async_trait::async_trait;
use lru::LruCache;
use parking_lot::RwLock;
use smallvec::SmallVec;

use super::{IndexError, IndexStats, KvIndex};
use crate::blocks::BlockKey;
use crate::pods::PodId;

type Slot = u32;

struct PodEntries {
    // Value: expiry time in ms. LRU order equals refresh order, so expired entries sit at the end.
    lru: LruCache<BlockKey, u64>,
}

#[derive(Default)]
struct Inner {
    slots: AHashMap<PodId, Slot>,
    pods: Vec<Option<PodEntries>>,
    free: Vec<Slot>,
    keys: AHashMap<BlockKey, SmallVec<[Slot; 4]>>,
    entries: usize,
}

/// The embedded index: learned from routing decisions, bounded per pod and by TTL.
pub struct MemoryIndex {
    inner: RwLock<Inner>,
    ttl_ms: u64,
    default_capacity: usize,
}

impl MemoryIndex {
    /// An empty index.
    pub fn new(ttl_ms: u64, default_capacity: usize) -> Self {
        Self {
            inner: RwLock::new(Inner::default()),
            ttl_ms,
            default_capacity: default_capacity.max(1),
        }
    }
}

fn cap(n: usize) -> std::num::NonZeroUsize {
    std::num::NonZeroUsize::new(n.max(1)).expect("max(1)")
}

impl Inner {
    fn slot(&mut self, pod: &PodId, default_capacity: usize) -> Slot {
        if let Some(&s) = self.slots.get(pod) {
            return s;
        }
        let entries = PodEntries {
            lru: LruCache::new(cap(default_capacity)),
        };
        let s = match self.free.pop() {
            Some(s) => {
                self.pods[s as usize] = Some(entries);
                s
            }
            None => {
                self.pods.push(Some(entries));
                (self.pods.len() - 1) as Slot
            }
        };
        self.slots.insert(pod.clone(), s);
        s
    }

    fn unlink(&mut self, key: BlockKey, slot: Slot) {
        if let Some(holders) = self.keys.get_mut(&key) {
            holders.retain(|s| *s != slot);
            self.entries -= 1;
            if holders.is_empty() {
                self.keys.remove(&key);
            }
        }
    }
}

#[async_trait]
impl KvIndex for MemoryIndex {
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
                let held = holders.is_some_and(|h| h.contains(&slot))
                    && inner.pods[slot as usize]
                        .as_ref()
                        .and_then(|p| p.lru.peek(key))
                        .is_some_and(|&exp| exp > now_ms);
                if held {
                    matched[i] += 1.0;
                } else {
                    alive[i] = false;
                    remaining -= 1;
                }
            }
        }
        Ok(matched)
    }

    async fn record(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64) -> Result<(), IndexError> {
        let expiry = now_ms.saturating_add(self.ttl_ms);
        let mut inner = self.inner.write();
        let slot = inner.slot(pod, self.default_capacity);
        // Insert in reverse so the prompt's first blocks are the most recently used: under
        // pressure a pod keeps the shared head of its prompts, as a real prefix cache does.
        for &key in keys.iter().rev() {
            let entries = inner.pods[slot as usize].as_mut().expect("live slot");
            if entries.lru.contains(&key) {
                entries.lru.put(key, expiry);
                continue;
            }
            let evicted = entries.lru.push(key, expiry).map(|(k, _)| k);
            if let Some(old) = evicted {
                inner.unlink(old, slot);
            }
            inner.keys.entry(key).or_default().push(slot);
            inner.entries += 1;
        }
        Ok(())
    }

    async fn forget_pod(&self, pod: &PodId) -> Result<(), IndexError> {
        let mut inner = self.inner.write();
        let Some(slot) = inner.slots.remove(pod) else {
            return Ok(());
        };
        if let Some(entries) = inner.pods[slot as usize].take() {
            for (key, _) in entries.lru.iter() {
                inner.unlink(*key, slot);
            }
        }
        inner.free.push(slot);
        Ok(())
    }

    async fn set_capacity(&self, pod: &PodId, blocks: usize) -> Result<(), IndexError> {
        let mut inner = self.inner.write();
        let slot = inner.slot(pod, self.default_capacity);
        while let Some(entries) = inner.pods[slot as usize].as_mut() {
            if entries.lru.len() <= blocks.max(1) {
                entries.lru.resize(cap(blocks));
                break;
            }
            let (key, _) = entries.lru.pop_lru().expect("non-empty");
            inner.unlink(key, slot);
        }
        Ok(())
    }

    async fn sweep(&self, now_ms: u64) -> Result<(), IndexError> {
        let mut inner = self.inner.write();
        for slot in 0..inner.pods.len() {
            while let Some(entries) = inner.pods[slot].as_mut() {
                match entries.lru.peek_lru() {
                    Some((_, &exp)) if exp <= now_ms => {
                        let (key, _) = entries.lru.pop_lru().expect("peeked");
                        inner.unlink(key, slot as Slot);
                    }
                    _ => break,
                }
            }
        }
        Ok(())
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
                .filter(|p| !p.lru.is_empty())
                .count(),
        }
    }

    fn describe(&self) -> &'static str {
        "memory (approximate: learned from routing decisions)"
    }
}

impl std::fmt::Debug for MemoryIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryIndex")
            .field("stats", &self.stats())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use proptest::prelude::*;

    use super::*;

    fn k(v: &[u64]) -> Vec<BlockKey> {
        v.iter().map(|&x| BlockKey(x)).collect()
    }

    fn pods(n: usize) -> Vec<PodId> {
        (0..n)
            .map(|i| PodId::new(format!("10.0.0.{i}:8000")))
            .collect()
    }

    #[tokio::test]
    async fn consecutive_prefix_only() {
        let idx = MemoryIndex::new(1000, 100);
        let p = pods(2);
        idx.record(&p[0], &k(&[1, 2, 3]), 0).await.unwrap();
        idx.record(&p[1], &k(&[1, 3]), 0).await.unwrap();
        let m = idx.lookup(&k(&[1, 2, 3, 4]), &p, 1).await.unwrap();
        assert_eq!(m, vec![3.0, 1.0]);
    }

    #[tokio::test]
    async fn ttl_expires_entries() {
        let idx = MemoryIndex::new(100, 100);
        let p = pods(1);
        idx.record(&p[0], &k(&[1, 2]), 0).await.unwrap();
        assert_eq!(idx.lookup(&k(&[1, 2]), &p, 99).await.unwrap(), vec![2.0]);
        assert_eq!(idx.lookup(&k(&[1, 2]), &p, 100).await.unwrap(), vec![0.0]);
        idx.sweep(100).await.unwrap();
        assert_eq!(idx.stats(), IndexStats::default());
    }

    #[tokio::test]
    async fn capacity_evicts_least_recent_and_keeps_prompt_heads() {
        let idx = MemoryIndex::new(1000, 3);
        let p = pods(1);
        idx.record(&p[0], &k(&[1, 2, 3]), 0).await.unwrap();
        idx.record(&p[0], &k(&[10, 11]), 1).await.unwrap();
        // 3 and 2 (the oldest tails) were evicted; 1 survives.
        assert_eq!(idx.stats().entries, 3);
        assert_eq!(idx.lookup(&k(&[1, 2]), &p, 2).await.unwrap(), vec![1.0]);
        idx.set_capacity(&p[0], 1).await.unwrap();
        assert_eq!(idx.stats().entries, 1);
    }

    #[tokio::test]
    async fn forget_pod_drops_everything() {
        let idx = MemoryIndex::new(1000, 10);
        let p = pods(2);
        idx.record(&p[0], &k(&[1, 2]), 0).await.unwrap();
        idx.record(&p[1], &k(&[1]), 0).await.unwrap();
        idx.forget_pod(&p[0]).await.unwrap();
        assert_eq!(
            idx.lookup(&k(&[1, 2]), &p, 1).await.unwrap(),
            vec![0.0, 1.0]
        );
        assert_eq!(
            idx.stats(),
            IndexStats {
                keys: 1,
                entries: 1,
                pods: 1
            }
        );
        // The freed slot is reused without leaking old entries.
        let q = PodId::new("10.0.0.9:1");
        idx.record(&q, &k(&[5]), 0).await.unwrap();
        assert_eq!(idx.lookup(&k(&[1]), &[q], 1).await.unwrap(), vec![0.0]);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Record(usize, Vec<u64>, u64),
        Forget(usize),
        Capacity(usize, usize),
        Sweep(u64),
        Lookup(Vec<u64>, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        let keys = prop::collection::vec(0u64..12, 0..6);
        prop_oneof![
            4 => (0usize..3, keys.clone(), 0u64..50).prop_map(|(p, k, t)| Op::Record(p, k, t)),
            1 => (0usize..3).prop_map(Op::Forget),
            1 => (0usize..3, 1usize..6).prop_map(|(p, c)| Op::Capacity(p, c)),
            1 => (0u64..80).prop_map(Op::Sweep),
            4 => (keys, 0u64..80).prop_map(|(k, t)| Op::Lookup(k, t)),
        ]
    }

    /// Reference model: per pod an ordered list (most recent first) of (key, expiry).
    #[derive(Default)]
    struct Model {
        pods: HashMap<usize, (usize, Vec<(u64, u64)>)>,
    }

    impl Model {
        fn record(&mut self, p: usize, keys: &[u64], now: u64, ttl: u64, default_cap: usize) {
            let (cap, list) = self.pods.entry(p).or_insert((default_cap, Vec::new()));
            for &key in keys.iter().rev() {
                list.retain(|(k, _)| *k != key);
                list.insert(0, (key, now + ttl));
                list.truncate(*cap);
            }
        }
        fn lookup(&self, keys: &[u64], p: usize, now: u64) -> f64 {
            let Some((_, list)) = self.pods.get(&p) else {
                return 0.0;
            };
            let held: HashSet<u64> = list
                .iter()
                .filter(|(_, e)| *e > now)
                .map(|(k, _)| *k)
                .collect();
            keys.iter().take_while(|k| held.contains(k)).count() as f64
        }
    }

    proptest! {
        #[test]
        fn index_matches_reference_model(ops in prop::collection::vec(op(), 1..60)) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let (ttl, default_cap) = (30, 4);
                let idx = MemoryIndex::new(ttl, default_cap);
                let ids = pods(3);
                let mut model = Model::default();
                for op in ops {
                    match op {
                        Op::Record(p, keys, t) => {
                            idx.record(&ids[p], &k(&keys), t).await.unwrap();
                            // Keys repeated within one call are refreshed once per occurrence.
                            model.record(p, &keys, t, ttl, default_cap);
                        }
                        Op::Forget(p) => {
                            idx.forget_pod(&ids[p]).await.unwrap();
                            model.pods.remove(&p);
                        }
                        Op::Capacity(p, c) => {
                            idx.set_capacity(&ids[p], c).await.unwrap();
                            let (cap, list) = model.pods.entry(p).or_insert((default_cap, Vec::new()));
                            *cap = c;
                            list.truncate(c);
                        }
                        Op::Sweep(t) => {
                            idx.sweep(t).await.unwrap();
                            for (_, list) in model.pods.values_mut() {
                                // Sweep pops expired entries from the LRU end only.
                                while list.last().is_some_and(|(_, e)| *e <= t) {
                                    list.pop();
                                }
                            }
                        }
                        Op::Lookup(keys, t) => {
                            let got = idx.lookup(&k(&keys), &ids, t).await.unwrap();
                            let want: Vec<f64> = (0..3).map(|p| model.lookup(&keys, p, t)).collect();
                            prop_assert_eq!(got, want);
                        }
                    }
                }
                let entries: usize = model.pods.values().map(|(_, l)| l.len()).sum();
                prop_assert_eq!(idx.stats().entries, entries);
                Ok(())
            })?;
        }
    }
}
