//! A pod's speculative entries: what the router's own decisions say the pod is about to hold.
//!
//! A decision guesses every block of its request. Blocks the request computes (past the pod's
//! held prefix) end one by one as the pod reports them stored. Blocks it hits end together, as
//! a *group*, once any computed block of the same decision is reported stored: by then the
//! request is running and has pinned its hits, so from there the pod's own reports are the
//! truth. Until then an eviction does not end a guess: a hit evicted while the request queues is
//! one the request computes again, and without the guess the lookup would stop at the hole and
//! never reach the blocks guessed past it. Every guess also ends after the TTL.

use lru::LruCache;

use crate::blocks::BlockKey;

/// One guessed key: until when, by which decision, and whether that decision hits or computes it.
#[derive(Debug, Clone, Copy)]
struct Guess {
    expiry: u64,
    group: u64,
    hit: bool,
}

/// The hit keys of one decision, ended together.
#[derive(Debug)]
struct Group {
    root: u64,
    hits: Vec<BlockKey>,
    expiry: u64,
}

/// A pod's guesses, bounded: at most `capacity` keys, and group bookkeeping for at most
/// `capacity` hit keys (a group dropped from it leaves its hits to the TTL).
#[derive(Debug)]
pub(super) struct Guesses {
    keys: LruCache<BlockKey, Guess>,
    groups: LruCache<u64, Group>,
    group_keys: usize,
    next_group: u64,
    capacity: usize,
}

impl Guesses {
    /// Empty; maps grow as guesses come (most pods never get near the bound).
    pub(super) fn new(capacity: usize) -> Self {
        let mut keys = LruCache::unbounded();
        keys.resize(nz(capacity));
        Self {
            keys,
            groups: LruCache::unbounded(),
            group_keys: 0,
            next_group: 0,
            capacity: capacity.max(1),
        }
    }

    /// No key is guessed.
    pub(super) fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// `key` is guessed and its guess is live at `now_ms`.
    pub(super) fn live(&self, key: &BlockKey, now_ms: u64) -> bool {
        self.keys.peek(key).is_some_and(|g| g.expiry > now_ms)
    }

    /// Opens a decision's group for its hit keys `hits` (a prefix rooted at `root`).
    pub(super) fn open(&mut self, root: u64, hits: &[BlockKey], expiry: u64) -> u64 {
        self.next_group = self.next_group.wrapping_add(1);
        let id = self.next_group;
        let hits = &hits[..hits.len().min(self.capacity)];
        if hits.is_empty() {
            return id;
        }
        while self.group_keys + hits.len() > self.capacity {
            let Some((_, g)) = self.groups.pop_lru() else {
                break;
            };
            self.group_keys -= g.hits.len();
        }
        self.group_keys += hits.len();
        self.groups.put(
            id,
            Group {
                root,
                hits: hits.to_vec(),
                expiry,
            },
        );
        id
    }

    /// Guesses `key` for decision `group` (a hit, or a block it computes). A hit of a group
    /// already settled (or dropped from the bookkeeping) is not guessed: nothing would end it.
    pub(super) fn put(&mut self, key: BlockKey, expiry: u64, group: u64, hit: bool) {
        if hit && !self.groups.contains(&group) {
            return;
        }
        self.keys.put(key, Guess { expiry, group, hit });
    }

    /// The pod reported `key` stored: its guess ends, and if it was a block a decision
    /// computes, that decision's hits end too; those are noted (root, key) in `settled`.
    pub(super) fn stored(&mut self, key: &BlockKey, settled: &mut Option<Vec<(u64, BlockKey)>>) {
        let Some(g) = self.keys.pop(key) else {
            return;
        };
        if g.hit {
            return;
        }
        let Some(group) = self.groups.pop(&g.group) else {
            return;
        };
        self.group_keys -= group.hits.len();
        for k in &group.hits {
            if self.keys.peek(k).is_some_and(|h| h.group == g.group) {
                self.keys.pop(k);
                if let Some(s) = settled {
                    s.push((group.root, *k));
                }
            }
        }
    }

    /// Drops guesses and groups expired at `now_ms` (oldest first; both are in time order).
    pub(super) fn sweep(&mut self, now_ms: u64) {
        while self
            .keys
            .peek_lru()
            .is_some_and(|(_, g)| g.expiry <= now_ms)
        {
            self.keys.pop_lru();
        }
        while self
            .groups
            .peek_lru()
            .is_some_and(|(_, g)| g.expiry <= now_ms)
        {
            if let Some((_, g)) = self.groups.pop_lru() {
                self.group_keys -= g.hits.len();
            }
        }
    }

    /// Forgets everything (the engine restarted or its stream was lost).
    pub(super) fn clear(&mut self) {
        self.keys.clear();
        self.groups.clear();
        self.group_keys = 0;
    }
}

fn nz(n: usize) -> std::num::NonZeroUsize {
    std::num::NonZeroUsize::new(n.max(1)).expect("max(1)")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u64) -> BlockKey {
        BlockKey(i)
    }

    #[test]
    fn a_computed_block_stored_ends_its_decisions_hits_and_no_one_elses() {
        let mut g = Guesses::new(100);
        let a = g.open(1, &[k(1), k(2)], 50);
        for (key, hit) in [(k(1), true), (k(2), true), (k(3), false), (k(4), false)] {
            g.put(key, 50, a, hit);
        }
        // A later decision hits 2 again: its guess of 2 is its own.
        let b = g.open(1, &[k(2)], 60);
        g.put(k(2), 60, b, true);
        g.put(k(9), 60, b, false);
        let mut settled = Some(Vec::new());
        g.stored(&k(3), &mut settled);
        assert_eq!(settled.take().unwrap(), vec![(1, k(1))]);
        assert!(!g.live(&k(1), 0) && g.live(&k(2), 0) && !g.live(&k(3), 0) && g.live(&k(4), 0));
        // Storing a hit ends that key only; a group settles once.
        let mut settled = Some(Vec::new());
        g.stored(&k(2), &mut settled);
        g.stored(&k(4), &mut settled);
        assert_eq!(settled.unwrap(), vec![]);
        assert!(g.live(&k(9), 0));
        assert_eq!(g.group_keys, 1);
    }

    #[test]
    fn group_bookkeeping_is_bounded_and_a_dropped_group_leaves_hits_to_the_ttl() {
        let mut g = Guesses::new(3);
        let a = g.open(1, &[k(1), k(2)], 50);
        let b = g.open(1, &[k(5), k(6)], 50);
        assert_eq!(g.group_keys, 2, "a's group made room for b's");
        g.put(k(1), 50, a, true);
        assert!(!g.live(&k(1), 0), "a hit of a dropped group is not guessed");
        g.put(k(5), 50, b, true);
        assert!(g.live(&k(5), 49) && !g.live(&k(5), 50));
        g.sweep(50);
        assert!(g.is_empty() && g.group_keys == 0);
        let big: Vec<BlockKey> = (0..10).map(k).collect();
        g.open(1, &big, 70);
        assert_eq!(g.group_keys, 3);
    }
}
