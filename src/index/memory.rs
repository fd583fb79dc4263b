//! In-memory prefix index: key → pods, plus one LRU per pod bounded by the pod's KV-cache size,
//! with a TTL on every entry. One lock, never held across an `.await`.

use async_trait::async_trait;
use lru::LruCache;
use parking_lot::RwLock;

use super::table::{Holder, Slot, Table, Weights, RECORD_CHUNK};
use super::warm::{Imported, PodEntries as SnapshotPod, Snapshot};
use super::{IndexError, IndexStats, KvIndex};
use crate::blocks::BlockKey;
use crate::pods::PodId;

/// A pod's entries: key → expiry (ms). LRU order equals refresh order, so expired entries sit
/// at the end.
type PodEntries = LruCache<BlockKey, u64>;

/// A key's holder with its entry's expiry (mirrors the LRU value) so lookups never touch the LRUs.
#[derive(Debug, Clone, Copy)]
struct Entry {
    slot: Slot,
    expiry: u64,
}

impl Holder for Entry {
    fn slot(&self) -> Slot {
        self.slot
    }
    fn expiry(&self) -> u64 {
        self.expiry
    }
}

/// The embedded index: learned from routing decisions, bounded per pod and by TTL.
pub struct MemoryIndex {
    inner: RwLock<Table<PodEntries, Entry>>,
    ttl_ms: u64,
    default_capacity: usize,
}

impl MemoryIndex {
    /// An empty index.
    pub fn new(ttl_ms: u64, default_capacity: usize) -> Self {
        Self {
            inner: RwLock::new(Table::default()),
            ttl_ms,
            default_capacity: default_capacity.max(1),
        }
    }

    /// A pod's LRU: bounded by the default capacity, grown as entries come (not allocated for the
    /// whole capacity up front).
    fn new_pod(&self) -> PodEntries {
        let mut lru = LruCache::unbounded();
        lru.resize(cap(self.default_capacity));
        lru
    }
}

impl MemoryIndex {
    /// [`KvIndex::record`], which never fails or waits.
    pub(crate) fn learn(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64) {
        self.record_each(pod, keys, now_ms.saturating_add(self.ttl_ms), |_, _| {});
    }

    /// Records like `record` and says, per key of `keys`, whether the pod's entry of it had been
    /// refreshed less than `within_ms` before `now_ms` (by any decision this index applied): a
    /// writer of the shared index may leave such an entry as that decision wrote it.
    pub fn record_noting_fresh(
        &self,
        pod: &PodId,
        keys: &[BlockKey],
        now_ms: u64,
        within_ms: u64,
    ) -> Vec<bool> {
        let expiry = now_ms.saturating_add(self.ttl_ms);
        let mut fresh = vec![false; keys.len()];
        self.record_each(pod, keys, expiry, |i, prev| {
            fresh[i] = prev.saturating_add(within_ms) > expiry;
        });
        fresh
    }

    /// Records `keys` on `pod` until `expiry`, calling `refreshed(i, previous expiry)` for each
    /// key already held. Keys go in reverse so the prompt's first blocks are the most recently
    /// used: under pressure a pod keeps the shared head of its prompts, as a real prefix cache
    /// does. The lock is taken per chunk, so a lookup never waits for a whole long prompt (a
    /// 400 KB prompt's 4096 keys took ~160 us); one caught between two chunks sees the prompt's
    /// tail without its head, which its prefix walk cannot match yet.
    fn record_each(
        &self,
        pod: &PodId,
        keys: &[BlockKey],
        expiry: u64,
        mut refreshed: impl FnMut(usize, u64),
    ) {
        let mut end = keys.len();
        while end > 0 {
            let start = end.saturating_sub(RECORD_CHUNK);
            let mut inner = self.inner.write();
            let Table { pods, holders } = &mut *inner;
            let slot = pods.get_or_insert_with(pod, || self.new_pod());
            let lru = pods.state_mut(slot);
            for i in (start..end).rev() {
                let key = keys[i];
                if let Some(e) = lru.get_mut(&key) {
                    refreshed(i, *e);
                    *e = expiry;
                    holders.update(&key, slot, |h| h.expiry = expiry);
                    continue;
                }
                if let Some((old, _)) = lru.push(key, expiry) {
                    holders.remove(&old, slot);
                }
                holders.insert(key, Entry { slot, expiry });
            }
            end = start;
        }
    }
}

impl MemoryIndex {
    /// The entries with time left at `now_ms`, each pod's most recently refreshed first, at most
    /// `max_entries` in all (each pod up to an equal share). The lock is taken per pod, so
    /// decisions wait for one pod's copy at most.
    pub fn snapshot(&self, now_ms: u64, max_entries: usize) -> Snapshot {
        let ids: Vec<PodId> = self.inner.read().pods.ids().cloned().collect();
        let share = max_entries / ids.len().max(1);
        let mut pods = Vec::with_capacity(ids.len());
        for id in ids {
            let inner = self.inner.read();
            let Some(lru) = inner.pods.get(&id).and_then(|s| inner.pods.state(s)) else {
                continue;
            };
            let entries: Vec<(u64, u64)> = lru
                .iter()
                .filter(|(_, &exp)| exp > now_ms)
                .take(share)
                .map(|(k, &exp)| (k.0, exp - now_ms))
                .collect();
            drop(inner);
            if !entries.is_empty() {
                pods.push(SnapshotPod {
                    pod: id.to_string(),
                    entries,
                });
            }
        }
        Snapshot::new(pods)
    }

    /// Takes in a peer's `snap` at `now_ms`: entries of pods for which `known` is false are
    /// dropped, each entry expires after the time it had left (at most this index's TTL), keys
    /// this index already holds keep their own entry, and each pod's recency order is kept (only
    /// its most recent entries are taken when its capacity is short). A pod new here gets room
    /// for all of its entries; its reported capacity resizes it later as usual.
    pub fn restore(
        &self,
        snap: &Snapshot,
        now_ms: u64,
        known: &dyn Fn(&PodId) -> bool,
    ) -> Imported {
        let mut done = Imported::default();
        for p in &snap.pods {
            let id = PodId::new(p.pod.as_str());
            if !known(&id) {
                done.unknown_pods += 1;
                continue;
            }
            let before = done.entries;
            let room = {
                let mut inner = self.inner.write();
                let slot = inner.pods.get_or_insert_with(&id, || {
                    let mut lru = LruCache::unbounded();
                    lru.resize(cap(self.default_capacity.max(p.entries.len())));
                    lru
                });
                inner.pods.state_mut(slot).cap().get()
            };
            // Only the most recent that fit: a restored entry never evicts another.
            let (fit, over) = p.entries.split_at(p.entries.len().min(room));
            done.skipped += over.len();
            // Oldest first, so the most recent end up most recently used.
            for chunk in fit.rchunks(RECORD_CHUNK) {
                let mut inner = self.inner.write();
                let Table { pods, holders } = &mut *inner;
                let Some(slot) = pods.get(&id) else {
                    break;
                };
                let lru = pods.state_mut(slot);
                for &(key, left) in chunk.iter().rev() {
                    let key = BlockKey(key);
                    if left == 0 || lru.contains(&key) {
                        done.skipped += 1;
                        continue;
                    }
                    let expiry = now_ms.saturating_add(left.min(self.ttl_ms));
                    if let Some((old, _)) = lru.push(key, expiry) {
                        holders.remove(&old, slot);
                    }
                    holders.insert(key, Entry { slot, expiry });
                    done.entries += 1;
                }
            }
            if done.entries > before {
                done.pods += 1;
            }
        }
        done
    }
}

fn cap(n: usize) -> std::num::NonZeroUsize {
    std::num::NonZeroUsize::new(n.max(1)).expect("max(1)")
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
        let weights = Weights {
            full: 1.0,
            lesser: 1.0,
        };
        Ok(inner.lookup(keys, pods, now_ms, weights, |_, _| None))
    }

    async fn record(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64) -> Result<(), IndexError> {
        self.learn(pod, keys, now_ms);
        Ok(())
    }

    async fn forget_pod(&self, pod: &PodId) -> Result<(), IndexError> {
        let mut inner = self.inner.write();
        let Table { pods, holders } = &mut *inner;
        if let Some((slot, lru)) = pods.remove(pod) {
            for (key, _) in lru.iter() {
                holders.remove(key, slot);
            }
        }
        Ok(())
    }

    async fn set_capacity(&self, pod: &PodId, blocks: usize) -> Result<(), IndexError> {
        let mut inner = self.inner.write();
        let Table { pods, holders } = &mut *inner;
        let slot = pods.get_or_insert_with(pod, || self.new_pod());
        let lru = pods.state_mut(slot);
        while lru.len() > blocks.max(1) {
            let (key, _) = lru.pop_lru().expect("non-empty");
            holders.remove(&key, slot);
        }
        lru.resize(cap(blocks));
        Ok(())
    }

    async fn sweep(&self, now_ms: u64) -> Result<(), IndexError> {
        let mut inner = self.inner.write();
        let Table { pods, holders } = &mut *inner;
        for (slot, lru) in pods.iter_mut() {
            while let Some((_, &exp)) = lru.peek_lru() {
                if exp > now_ms {
                    break;
                }
                let (key, _) = lru.pop_lru().expect("peeked");
                holders.remove(&key, slot);
            }
        }
        Ok(())
    }

    fn stats(&self) -> IndexStats {
        self.inner.read().stats(|lru| !lru.is_empty())
    }

    fn describe(&self) -> &'static str {
        "memory (approximate: learned from routing decisions)"
    }

    fn warm_snapshot(&self, now_ms: u64, max_entries: usize) -> Option<Snapshot> {
        Some(self.snapshot(now_ms, max_entries))
    }

    fn warm_restore(
        &self,
        snap: &Snapshot,
        now_ms: u64,
        known: &dyn Fn(&PodId) -> bool,
    ) -> Option<Imported> {
        Some(self.restore(snap, now_ms, known))
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

    #[test]
    fn a_refresh_is_fresh_only_within_the_window_since_the_last_one() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let idx = MemoryIndex::new(1_000, 100);
        // (pod, keys, now, fresh within 200 ms), in order.
        let steps: [(usize, &[u64], u64, &[bool]); 5] = [
            (0, &[1, 2], 0, &[false, false]),
            (0, &[2, 3], 100, &[true, false]),
            // Key 2 was last refreshed at 100: 300 ms before 400 is past the window.
            (0, &[2, 1], 400, &[false, false]),
            // A key repeated in one prompt is written once.
            (0, &[7, 7], 400, &[true, false]),
            // Another pod's entry of the same key is its own.
            (1, &[2], 450, &[false]),
        ];
        for (pod, keys, now, want) in steps {
            let got = idx.record_noting_fresh(&pods(2)[pod], &k(keys), now, 200);
            assert_eq!(got, want, "{keys:?} at {now}");
        }
        // Recording this way is recording: lookups see it.
        let got = rt
            .block_on(idx.lookup(&k(&[2, 1, 3]), &pods(2), 500))
            .unwrap();
        assert_eq!(got, vec![3.0, 1.0]);
    }

    #[test]
    fn a_restored_snapshot_keeps_holders_recency_and_time_left_of_known_pods_only() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let ids = pods(3);
        let peer = MemoryIndex::new(1_000, 100);
        peer.learn(&ids[0], &k(&[1, 2, 3]), 0);
        peer.learn(&ids[1], &k(&[1, 9]), 0);
        peer.learn(&ids[2], &k(&[5]), 0);
        // Expired by the snapshot's time: not handed over.
        let old = MemoryIndex::new(100, 100);
        old.learn(&ids[0], &k(&[4]), 0);
        assert!(old.snapshot(100, 10).pods.is_empty());

        let snap = peer.snapshot(400, 100);
        assert_eq!(snap.entries(), 6);
        assert_eq!(
            snap.pods
                .iter()
                .find(|p| p.pod == ids[0].to_string())
                .unwrap()
                .entries,
            vec![(1, 600), (2, 600), (3, 600)],
            "head first, 600 ms left"
        );
        let snap =
            crate::index::warm::decode(&crate::index::warm::encode(&snap), 1 << 20, 6).unwrap();

        // Another process: its clock started elsewhere; pod 2 left the fleet.
        let fresh = MemoryIndex::new(1_000, 100);
        rt.block_on(fresh.set_capacity(&ids[1], 1)).unwrap();
        let known = |p: &PodId| *p != ids[2];
        let done = fresh.restore(&snap, 50_000, &known);
        assert_eq!((done.entries, done.pods, done.unknown_pods), (4, 2, 1));
        let at = |now| {
            rt.block_on(fresh.lookup(&k(&[1, 2, 3]), &ids, now))
                .unwrap()
        };
        // Pod 1 has room for one entry: it keeps the head, as it would have.
        assert_eq!(at(50_000), vec![3.0, 1.0, 0.0]);
        assert_eq!(at(50_599), vec![3.0, 1.0, 0.0]);
        assert_eq!(at(50_600), vec![0.0, 0.0, 0.0], "600 ms left, no more");
        // Restoring again (a second peer) leaves held keys as they are.
        let again = fresh.restore(&snap, 50_100, &known);
        assert_eq!(
            (again.entries, again.skipped),
            (0, 5),
            "every key held or past capacity"
        );
        assert_eq!(fresh.stats().entries, 4);
        assert_eq!(at(50_100), vec![3.0, 1.0, 0.0]);
    }

    #[test]
    fn a_snapshot_holds_at_most_max_entries_each_pods_most_recent() {
        let ids = pods(2);
        let idx = MemoryIndex::new(1_000, 100);
        idx.learn(&ids[0], &k(&[1, 2, 3, 4]), 0);
        idx.learn(&ids[1], &k(&[5, 6, 7, 8]), 0);
        let snap = idx.snapshot(0, 4);
        assert_eq!(snap.entries(), 4);
        for p in &snap.pods {
            assert_eq!(p.entries.len(), 2);
            assert!([1, 5].contains(&p.entries[0].0), "{p:?}");
        }
    }

    // The shared behaviour (prefix, TTL, capacity, forget, slot reuse) is checked by the
    // contract suite (`index::contract`); this is the model-based check of the LRU itself.

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
