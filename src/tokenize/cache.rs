//! Prefix tokenization cache.
//!
//! Texts are cut at *checkpoints*: the end of every occurrence of an added token (e.g.
//! `<|im_end|>`, `<|im_start|>`, `<|eot_id|>`) that is matched verbatim (`normalized = false`,
//! `single_word = false`). `tokenizers` splits the input on added tokens before normalization,
//! pre-tokenization and the model run, so the tokens before and after such an occurrence are
//! computed independently. The cache keeps, per checkpoint, the *segment* between the previous
//! checkpoint and this one (its exact text and its token ids, as tokenized in context), chained
//! to its parent entry by a unique serial. A lookup walks the new text's checkpoints and reuses
//! the chain while every segment's text matches byte for byte; the rest is tokenized starting AT
//! the last reused added token (so it is not at the start of the text, which matters for
//! `Metaspace(prepend_scheme = first)`), and that first token is dropped after checking that it
//! is the expected added token. Any surprise falls back to tokenizing the whole text.
//!
//! Memory is bounded by entry count and by bytes (segment text + 4 bytes per token + overhead),
//! evicting least recently used entries.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use lru::LruCache;
use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Limits of a [`PrefixCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// Maximum number of cached segments.
    pub max_entries: usize,
    /// Maximum bytes of segment text plus token ids (plus a fixed per-entry overhead).
    pub max_bytes: usize,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            max_entries: 16_384,
            max_bytes: 64 << 20,
        }
    }
}

/// Cache counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Entries held.
    pub entries: usize,
    /// Bytes accounted.
    pub bytes: usize,
    /// Lookups that reused at least one segment.
    pub hits: u64,
    /// Lookups that reused nothing.
    pub misses: u64,
    /// Tokens served from the cache.
    pub tokens_reused: u64,
    /// Times the cached path gave up and tokenized the full text.
    pub fallbacks: u64,
}

const ENTRY_OVERHEAD: usize = 96;
const ROOT_SEED: u64 = 0x6b76_2d74_6f6b_656e; // "kv-token"

pub(crate) struct Entry {
    serial: u64,
    parent: u64,
    text: Box<str>,
    tokens: Box<[u32]>,
}

impl Entry {
    fn cost(&self) -> usize {
        ENTRY_OVERHEAD + self.text.len() + 4 * self.tokens.len()
    }
}

struct State {
    lru: LruCache<u64, Arc<Entry>>,
    bytes: usize,
}

/// The cache (thread-safe).
pub struct PrefixCache {
    config: CacheConfig,
    state: Mutex<State>,
    next_serial: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    tokens_reused: AtomicU64,
    fallbacks: AtomicU64,
}

/// An added-token occurrence in the text: `[start, end)` bytes, and its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Checkpoint {
    pub start: usize,
    pub end: usize,
    pub id: u32,
}

/// Token ids and their `[start, end)` byte offsets.
pub(crate) type IdsAndOffsets = (Vec<u32>, Vec<(usize, usize)>);

/// What the tokenizer must provide: tokenization of a text with byte offsets.
pub(crate) trait OffsetEncoder {
    /// Ids and byte offsets (relative to `text`), without special tokens added.
    fn encode_with_offsets(&self, text: &str) -> Result<IdsAndOffsets, String>;
    /// Ids only, without special tokens added.
    fn encode_ids(&self, text: &str) -> Result<Vec<u32>, String>;
}

impl PrefixCache {
    /// An empty cache.
    pub fn new(config: CacheConfig) -> Self {
        Self {
            config,
            state: Mutex::new(State {
                lru: LruCache::unbounded(),
                bytes: 0,
            }),
            next_serial: AtomicU64::new(1),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            tokens_reused: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
        }
    }

    /// Counters and size.
    pub fn stats(&self) -> CacheStats {
        let st = self.state.lock();
        CacheStats {
            entries: st.lru.len(),
            bytes: st.bytes,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            tokens_reused: self.tokens_reused.load(Ordering::Relaxed),
            fallbacks: self.fallbacks.load(Ordering::Relaxed),
        }
    }

    /// Drops every entry.
    pub fn clear(&self) {
        let mut st = self.state.lock();
        st.lru.clear();
        st.bytes = 0;
    }

    fn get(&self, key: u64) -> Option<Arc<Entry>> {
        self.state.lock().lru.get(&key).cloned()
    }

    fn insert(&self, key: u64, entry: Entry) {
        let cost = entry.cost();
        if cost > self.config.max_bytes || self.config.max_entries == 0 {
            return;
        }
        let mut st = self.state.lock();
        if let Some(old) = st.lru.put(key, Arc::new(entry)) {
            st.bytes -= old.cost();
        }
        st.bytes += cost;
        while st.lru.len() > self.config.max_entries || st.bytes > self.config.max_bytes {
            match st.lru.pop_lru() {
                Some((_, old)) => st.bytes -= old.cost(),
                None => break,
            }
        }
    }

    /// Tokenizes `text` (no special tokens added) reusing cached segments; `checkpoints` must be
    /// the added-token occurrences of `text`, in order and non-overlapping.
    pub(crate) fn encode(
        &self,
        enc: &dyn OffsetEncoder,
        text: &str,
        checkpoints: &[Checkpoint],
    ) -> Result<Vec<u32>, String> {
        if checkpoints.is_empty() {
            return enc.encode_ids(text);
        }
        // 1. Walk the chain of cached segments.
        let mut out: Vec<u32> = Vec::new();
        let mut key = ROOT_SEED;
        let mut parent = 0u64;
        let mut covered = 0usize;
        let mut matched: Option<Checkpoint> = None;
        let mut next = 0usize;
        for cp in checkpoints {
            let seg = &text[covered..cp.end];
            let k = xxh3_64_with_seed(seg.as_bytes(), key);
            let Some(e) = self.get(k) else { break };
            if e.parent != parent || &*e.text != seg || e.tokens.last() != Some(&cp.id) {
                break;
            }
            out.extend_from_slice(&e.tokens);
            key = k;
            parent = e.serial;
            covered = cp.end;
            matched = Some(*cp);
            next += 1;
        }
        if matched.is_some() {
            self.hits.fetch_add(1, Ordering::Relaxed);
            self.tokens_reused
                .fetch_add(out.len() as u64, Ordering::Relaxed);
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        // 2. Tokenize the rest, starting at the last reused added token.
        let win_start = matched.map_or(0, |cp| cp.start);
        let (ids, offsets) = enc.encode_with_offsets(&text[win_start..])?;
        let mut first = 0usize;
        if let Some(cp) = matched {
            if ids.first() != Some(&cp.id)
                || offsets.first().map(|o| o.1) != Some(cp.end - cp.start)
            {
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                return enc.encode_ids(text);
            }
            first = 1;
        }
        // 3. Remember the segments ending at the remaining checkpoints.
        let mut seg_begin = first;
        let mut j = first;
        for cp in &checkpoints[next..] {
            let rel_end = cp.end - win_start;
            while j < ids.len() && offsets[j].1 < rel_end {
                j += 1;
            }
            if j >= ids.len() || offsets[j].1 != rel_end || ids[j] != cp.id {
                break;
            }
            let seg = &text[covered..cp.end];
            let k = xxh3_64_with_seed(seg.as_bytes(), key);
            let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
            self.insert(
                k,
                Entry {
                    serial,
                    parent,
                    text: seg.into(),
                    tokens: ids[seg_begin..=j].into(),
                },
            );
            key = k;
            parent = serial;
            covered = cp.end;
            j += 1;
            seg_begin = j;
        }
        out.extend_from_slice(&ids[first..]);
        Ok(out)
    }
}
