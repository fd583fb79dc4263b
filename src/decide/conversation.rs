//! New conversations versus continuations. A request whose matched prefix is only a prefix
//! shared with other conversations (a system prompt) is not a continuation: placing it commits
//! that conversation's later turns to the pod, so the picker spreads it by load instead of
//! sending it to the prefix's first holder.
//!
//! A new conversation is a request with a session id (header or `user`) that is pinned to no
//! pod, whose match does not extend an earlier *complete* prompt (the router remembers where
//! recent prompts ended: the key of their last full block), so a session that merely expired
//! mid-conversation still counts as a continuation. Requests without a session id are never
//! called new: on the Mooncake traces a conversation's next turn often diverges inside the
//! previous prompt's last block (its tokens are re-cut), so prompt ends alone mistook most
//! continuations for new conversations (`kv-bench simulate --trace conversation`: weighted fell
//! from 0.80 to 0.66 of the infinite oracle).

use std::num::NonZeroUsize;

use lru::LruCache;
use parking_lot::Mutex;

use crate::blocks::BlockKey;

/// Prompt ends remembered (8 bytes of key plus LRU links each: about 4 MiB at this size).
pub const PROMPT_ENDS: usize = 65_536;

/// How far back from the end of the best match an earlier prompt's end is looked for: in
/// precise mode a pod also holds the blocks of the answer it generated, so the match of a
/// conversation's next turn runs past the previous prompt by up to the answer's length.
pub const ENDS_LOOKBACK: usize = 128;

/// Where recent prompts ended (bounded LRU of block keys; no prompt text).
pub struct PromptEnds {
    ends: Mutex<LruCache<BlockKey, ()>>,
}

impl Default for PromptEnds {
    fn default() -> Self {
        Self::new(PROMPT_ENDS)
    }
}

impl PromptEnds {
    /// Remembers at most `capacity` ends.
    pub fn new(capacity: usize) -> Self {
        Self {
            ends: Mutex::new(LruCache::new(
                NonZeroUsize::new(capacity.max(1)).expect("max(1)"),
            )),
        }
    }

    /// Remembers that a prompt with these keys was routed.
    pub fn record(&self, keys: &[BlockKey]) {
        if let Some(last) = keys.last() {
            self.ends.lock().put(*last, ());
        }
    }

    /// Whether the first `matched` keys reach past the end of an earlier prompt (at most
    /// [`ENDS_LOOKBACK`] blocks before the match ends): the request continues that prompt.
    pub fn continues(&self, keys: &[BlockKey], matched: usize) -> bool {
        let end = matched.min(keys.len());
        let from = end.saturating_sub(ENDS_LOOKBACK);
        let ends = self.ends.lock();
        keys[from..end].iter().rev().any(|k| ends.contains(k))
    }

    /// Ends remembered.
    pub fn len(&self) -> usize {
        self.ends.lock().len()
    }

    /// Nothing remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The request's session as the decision sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionSeen {
    /// The request names no session.
    None,
    /// It names one that is pinned to no candidate (new, expired, or its pod left).
    Unpinned,
    /// It names one pinned to a candidate.
    Pinned,
}

/// Whether a request starts a new conversation on a prefix other conversations share: it names
/// a session pinned to no candidate, some candidate holds part of its prompt, and that part
/// does not extend any earlier prompt this router routed.
pub fn is_new_conversation(
    ends: &PromptEnds,
    keys: &[BlockKey],
    matched: &[f64],
    session: SessionSeen,
) -> bool {
    let best = matched.iter().copied().fold(0.0, f64::max);
    if session != SessionSeen::Unpinned || best < 1.0 {
        return false;
    }
    !ends.continues(keys, best as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
        range.map(BlockKey).collect()
    }

    #[test]
    fn a_second_conversation_on_a_shared_prefix_is_new_and_a_next_turn_is_not() {
        let ends = PromptEnds::new(16);
        // Conversation A: system prompt blocks 0..10, own text 100..103.
        let a1: Vec<BlockKey> = keys(0..10).into_iter().chain(keys(100..103)).collect();
        ends.record(&a1);
        // Conversation B shares the system prompt only: its best match is the 10 shared blocks.
        let b1: Vec<BlockKey> = keys(0..10).into_iter().chain(keys(200..203)).collect();
        let matched = [10.0, 0.0];
        let unpinned = SessionSeen::Unpinned;
        assert!(is_new_conversation(&ends, &b1, &matched, unpinned));
        // A's next turn extends A's whole first prompt (a session that expired, say).
        let a2: Vec<BlockKey> = a1.iter().copied().chain(keys(300..305)).collect();
        assert!(!is_new_conversation(&ends, &a2, &[13.0, 0.0], unpinned));
        // Precise mode: the pod also holds A's answer, the match runs past A's prompt end.
        assert!(!is_new_conversation(&ends, &a2, &[16.0, 0.0], unpinned));
        // A pinned session is a continuation whatever the index says, a request without a
        // session is never new, and no match is not new.
        assert!(!is_new_conversation(
            &ends,
            &b1,
            &matched,
            SessionSeen::Pinned
        ));
        assert!(!is_new_conversation(
            &ends,
            &b1,
            &matched,
            SessionSeen::None
        ));
        assert!(!is_new_conversation(&ends, &b1, &[0.0, 0.0], unpinned));
    }

    #[test]
    fn ends_are_bounded_and_the_lookback_is_bounded() {
        let ends = PromptEnds::new(4);
        for i in 0..100u64 {
            ends.record(&[BlockKey(i)]);
        }
        assert_eq!(ends.len(), 4, "LRU-bounded");
        assert!(ends.continues(&[BlockKey(99)], 1));
        assert!(!ends.continues(&[BlockKey(3)], 1), "evicted");
        let long = keys(0..1000);
        ends.record(&long[..10]);
        assert!(
            !ends.continues(&long, 1000),
            "an end further back than the lookback is not searched"
        );
        assert!(ends.continues(&long, 10 + ENDS_LOOKBACK - 1));
        assert!(!ends.continues(&long, 0), "empty match");
        assert!(!ends.continues(&[], 5), "match past the keys is clamped");
    }
}
