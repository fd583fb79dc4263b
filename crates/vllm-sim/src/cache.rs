//! Block-level prefix cache with vLLM's (v1 `KVCacheManager`) semantics, reduced to what the
//! simulator needs:
//!
//! * Every cached block is identified by its chained [`BlockKey`]; a lookup hits the longest run
//!   of leading keys that are present.
//! * Blocks referenced by running requests are pinned (reference counted) and never evicted.
//!   Unreferenced cached blocks sit in an LRU free list and are evicted least recently freed
//!   first. Like vLLM, a request's blocks are freed tail first, so the end of a prompt is evicted
//!   before its (more widely shared) beginning.
//! * Capacity is `num_gpu_blocks`, minus a reserve of blocks that running requests hold outside
//!   the prefix cache (partial prompt blocks and decode blocks); growing the reserve evicts.
//!
//! Every change is reported as a [`CacheEvent`] mirroring vLLM's KV events (`BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`), in the order it happened, so a publisher can forward
//! them verbatim.

use std::collections::HashMap;

use lru::LruCache;

use kv_router::blocks::BlockKey;

use super::vllm_hash::BlockDigest;

/// One change to the cache, in vLLM KV-event form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// A run of consecutive blocks of one prompt was stored. `token_ids` holds
    /// `block_size` tokens per block, in order; `parent` is the key of the block before the
    /// first stored one (`None` at the start of a prompt).
    BlockStored {
        /// Keys of the stored blocks, in prompt order.
        block_hashes: Vec<BlockKey>,
        /// Key of the preceding block of the same prompt.
        parent_block_hash: Option<BlockKey>,
        /// The blocks' token ids, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
        /// vLLM identity of the stored blocks, when the engine knows it (KV events enabled).
        vllm: Option<VllmStored>,
    },
    /// Blocks were evicted.
    BlockRemoved {
        /// Keys of the evicted blocks.
        block_hashes: Vec<BlockKey>,
    },
    /// The whole cache was cleared (`/reset_prefix_cache`).
    AllBlocksCleared,
}

/// What vLLM would publish about a run of stored blocks (filled in by the engine from the
/// request's [`super::engine::VllmInfo`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmStored {
    /// vLLM block digests, one per stored block.
    pub hashes: Vec<BlockDigest>,
    /// Digest of the block before the first one (`None` = the run starts at block 0).
    pub parent: Option<BlockDigest>,
    /// Published (untagged) extra keys, one entry per stored block.
    pub extra_keys: Vec<Option<Vec<String>>>,
    /// LoRA adapter `(name, id)` of the request.
    pub lora: Option<(String, i64)>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    refs: u32,
}

/// The prefix cache. All operations are O(number of keys passed) (amortised), never
/// proportional to the cache size, except [`PrefixCache::clear`].
#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    block_size: usize,
    reserved: usize,
    entries: HashMap<BlockKey, Entry>,
    /// Unreferenced cached blocks; the least recently used is evicted first.
    free: LruCache<BlockKey, ()>,
}

impl PrefixCache {
    /// A cache of `capacity` blocks of `block_size` tokens.
    pub fn new(capacity: usize, block_size: usize) -> Self {
        Self {
            capacity,
            block_size: block_size.max(1),
            reserved: 0,
            entries: HashMap::new(),
            free: LruCache::unbounded(),
        }
    }

    /// Cached blocks (pinned or not).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Cached blocks no running request references (evictable).
    #[cfg(test)]
    pub fn evictable(&self) -> usize {
        self.free.len()
    }

    /// Cached blocks referenced by at least one running request.
    pub fn pinned(&self) -> usize {
        self.entries.len() - self.free.len()
    }

    /// Whether `key` is cached.
    #[cfg(test)]
    pub fn contains(&self, key: BlockKey) -> bool {
        self.entries.contains_key(&key)
    }

    /// Number of leading `keys` that are cached (the prefix hit, in blocks). Does not touch
    /// recency; pin the hit with [`PrefixCache::acquire`].
    pub fn lookup(&self, keys: &[BlockKey]) -> usize {
        keys.iter()
            .take_while(|k| self.entries.contains_key(k))
            .count()
    }

    /// Pins every cached key among `keys` (one reference each) and returns the keys pinned,
    /// which the caller must later pass to [`PrefixCache::release`].
    pub fn acquire(&mut self, keys: &[BlockKey]) -> Vec<BlockKey> {
        let mut pinned = Vec::with_capacity(keys.len());
        for &key in keys {
            if self.pin(key) {
                pinned.push(key);
            }
        }
        pinned
    }

    fn pin(&mut self, key: BlockKey) -> bool {
        match self.entries.get_mut(&key) {
            Some(entry) => {
                if entry.refs == 0 {
                    self.free.pop(&key);
                }
                entry.refs += 1;
                true
            }
            None => false,
        }
    }

    /// Drops one reference from each key. Blocks that become unreferenced join the free list
    /// tail first (the last key becomes the least recently used), as vLLM frees them.
    pub fn release(&mut self, keys: &[BlockKey]) {
        for &key in keys.iter().rev() {
            if let Some(entry) = self.entries.get_mut(&key) {
                entry.refs = entry.refs.saturating_sub(1);
                if entry.refs == 0 {
                    self.free.push(key, ());
                }
            }
        }
    }

    /// Stores the computed blocks `keys` (chained after `parent`), whose tokens are
    /// `token_ids[i * block_size..(i + 1) * block_size]`, and pins each of them for the caller.
    ///
    /// Already-cached keys are just pinned. New blocks need room: unreferenced blocks are evicted
    /// (LRU) as needed; when no room can be made, storing stops at that block (later blocks
    /// would be unreachable by prefix lookups). Returns the pinned keys (to release later);
    /// appends the changes to `events`.
    pub fn insert(
        &mut self,
        parent: Option<BlockKey>,
        keys: &[BlockKey],
        token_ids: &[u32],
        events: &mut Vec<CacheEvent>,
    ) -> Vec<BlockKey> {
        let bs = self.block_size;
        let keys = &keys[..keys.len().min(token_ids.len() / bs)];
        let mut pinned = Vec::with_capacity(keys.len());
        let mut absent = Vec::new();
        for (i, &key) in keys.iter().enumerate() {
            if self.pin(key) {
                pinned.push(key);
            } else {
                absent.push(i);
            }
        }
        // Make room for the new blocks in one eviction batch.
        let room = self.room();
        if absent.len() > room {
            self.evict(absent.len() - room, events);
        }
        let mut stored: Vec<(usize, BlockKey)> = Vec::new();
        for &i in &absent {
            if self.room() == 0 {
                break;
            }
            let key = keys[i];
            // A key may repeat within one prompt; the first occurrence stored it.
            if self.pin(key) {
                pinned.push(key);
                continue;
            }
            self.entries.insert(key, Entry { refs: 1 });
            pinned.push(key);
            stored.push((i, key));
        }
        // One BlockStored per run of consecutive new blocks.
        let mut run_start = 0;
        while run_start < stored.len() {
            let mut end = run_start + 1;
            while end < stored.len() && stored[end].0 == stored[end - 1].0 + 1 {
                end += 1;
            }
            let first = stored[run_start].0;
            let last = stored[end - 1].0;
            events.push(CacheEvent::BlockStored {
                block_hashes: stored[run_start..end].iter().map(|&(_, k)| k).collect(),
                parent_block_hash: if first == 0 {
                    parent
                } else {
                    Some(keys[first - 1])
                },
                token_ids: token_ids[first * bs..(last + 1) * bs].to_vec(),
                block_size: bs,
                vllm: None,
            });
            run_start = end;
        }
        pinned
    }

    /// Sets how many blocks running requests hold outside the prefix cache; evicts
    /// unreferenced blocks until the cache fits in what is left.
    pub fn set_reserved(&mut self, blocks: usize, events: &mut Vec<CacheEvent>) {
        self.reserved = blocks;
        let limit = self.capacity.saturating_sub(self.reserved);
        if self.entries.len() > limit {
            self.evict(self.entries.len() - limit, events);
        }
    }

    /// Empties the cache, as vLLM's `reset_prefix_cache`: refused (returns false, nothing
    /// changes) while running requests still reference cached blocks.
    pub fn clear(&mut self, events: &mut Vec<CacheEvent>) -> bool {
        if self.pinned() > 0 {
            return false;
        }
        if !self.entries.is_empty() {
            self.entries.clear();
            self.free.clear();
        }
        events.push(CacheEvent::AllBlocksCleared);
        true
    }

    fn room(&self) -> usize {
        self.capacity
            .saturating_sub(self.reserved)
            .saturating_sub(self.entries.len())
    }

    fn evict(&mut self, n: usize, events: &mut Vec<CacheEvent>) {
        let mut removed = Vec::with_capacity(n.min(self.free.len()));
        while removed.len() < n {
            let Some((key, ())) = self.free.pop_lru() else {
                break;
            };
            self.entries.remove(&key);
            removed.push(key);
        }
        if !removed.is_empty() {
            events.push(CacheEvent::BlockRemoved {
                block_hashes: removed,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
        range.map(BlockKey).collect()
    }

    fn tokens(blocks: usize, bs: usize) -> Vec<u32> {
        (0..(blocks * bs) as u32).collect()
    }

    #[test]
    fn insert_then_lookup_prefix() {
        let mut c = PrefixCache::new(10, 2);
        let mut ev = Vec::new();
        let k = keys(1..5);
        let pinned = c.insert(None, &k, &tokens(4, 2), &mut ev);
        assert_eq!(pinned, k);
        assert_eq!(
            ev,
            vec![CacheEvent::BlockStored {
                block_hashes: k.clone(),
                parent_block_hash: None,
                token_ids: tokens(4, 2),
                block_size: 2,
                vllm: None,
            }]
        );
        assert_eq!(c.lookup(&k), 4);
        assert_eq!(c.lookup(&[BlockKey(1), BlockKey(2), BlockKey(99)]), 2);
        assert_eq!(c.lookup(&[BlockKey(99), BlockKey(1)]), 0);
        assert_eq!(c.pinned(), 4);
        c.release(&pinned);
        assert_eq!((c.pinned(), c.evictable()), (0, 4));
    }

    #[test]
    fn eviction_is_lru_and_tail_first_and_skips_pinned() {
        let mut c = PrefixCache::new(4, 1);
        let mut ev = Vec::new();
        let a = c.insert(None, &keys(1..3), &[0, 0], &mut ev);
        c.release(&a);
        let b = c.insert(None, &keys(10..12), &[0, 0], &mut ev);
        // Cache full: a (free) and b (pinned). Storing 2 more evicts a, tail (2) first.
        ev.clear();
        let d = c.insert(None, &keys(20..22), &[0, 0], &mut ev);
        assert_eq!(
            ev[0],
            CacheEvent::BlockRemoved {
                block_hashes: vec![BlockKey(2), BlockKey(1)]
            }
        );
        assert_eq!(d.len(), 2);
        // Everything pinned now: nothing more can be stored.
        ev.clear();
        let e = c.insert(None, &keys(30..31), &[0], &mut ev);
        assert!(e.is_empty() && ev.is_empty());
        assert!(c.contains(BlockKey(10)) && c.contains(BlockKey(11)));
        c.release(&b);
        c.release(&d);
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn store_stops_at_first_block_without_room_and_runs_have_parents() {
        let mut c = PrefixCache::new(3, 1);
        let mut ev = Vec::new();
        let p = c.insert(None, &keys(1..2), &[7], &mut ev);
        ev.clear();
        // Key 1 already cached (pinned again), 2 and 3 new: one run with parent 1; 4 does not fit.
        let q = c.insert(None, &keys(1..5), &[7, 8, 9, 10], &mut ev);
        assert_eq!(q, keys(1..4));
        assert_eq!(
            ev,
            vec![CacheEvent::BlockStored {
                block_hashes: keys(2..4),
                parent_block_hash: Some(BlockKey(1)),
                token_ids: vec![8, 9],
                block_size: 1,
                vllm: None,
            }]
        );
        c.release(&p);
        c.release(&q);
        assert_eq!(c.pinned(), 0);
    }

    #[test]
    fn reserve_evicts_and_clear_is_refused_while_pinned() {
        let mut c = PrefixCache::new(4, 1);
        let mut ev = Vec::new();
        let a = c.insert(None, &keys(1..5), &[0; 4], &mut ev);
        assert!(!c.clear(&mut ev));
        c.release(&a);
        ev.clear();
        c.set_reserved(3, &mut ev);
        assert_eq!(c.len(), 1);
        assert!(
            c.contains(BlockKey(1)),
            "the head of the prompt survives longest"
        );
        ev.clear();
        assert!(c.clear(&mut ev));
        assert_eq!(ev, vec![CacheEvent::AllBlocksCleared]);
        assert!(c.is_empty());
    }
}
