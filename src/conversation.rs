//! New conversations versus continuations. A request whose matched prefix is only a prefix
//! shared with other conversations (a system prompt) is not a continuation: placing it commits
//! that conversation's later turns to the pod, so the picker spreads it by what each pod is
//! already committed to instead of sending it to the prefix's first holder.
//!
//! Two signals, both kept here in bounded memory (block keys and pod ids, no text):
//! - **Sessions.** A request naming a session pinned to no pod is new unless its match extends
//!   an earlier *complete* prompt (the key of each routed prompt's last full block is kept), so a
//!   session that merely expired mid-conversation still counts as a continuation.
//! - **Branch points, for requests without a session.** Where a routed prompt leaves the longest
//!   prefix any pod held, the router notes which block came next. A match that ends where at
//!   least [`SHARED_BRANCHES`] other prompts already went on differently ends on a prefix many
//!   conversations share. A conversation's next turn leaves its own history at a point no other
//!   prompt left (on the Mooncake traces inside the previous prompt's re-cut last block), so it
//!   stays a continuation. Prompt ends alone cannot tell this: those re-cut blocks made most
//!   continuations look new (`kv-bench simulate --trace conversation`: weighted fell from 0.80
//!   to 0.66 of the infinite oracle when that was tried).
//!
//! Without sessions nothing says how many conversations live on a pod, so the new
//! conversations placed on each pod are counted with a half-life ([`Conversations::placed`]).

use std::num::NonZeroUsize;

use ahash::AHashMap;
use lru::LruCache;
use parking_lot::Mutex;

use crate::blocks::BlockKey;
use crate::keys::Keys;
use crate::pods::PodId;

/// Prompt ends remembered, and as many branch points (about 4 MiB and 6 MiB at this size: a
/// key and LRU links each, plus up to [`SUCCESSORS`] next keys per branch point).
pub const PROMPT_ENDS: usize = 65_536;

/// Next blocks remembered per branch point: enough to tell [`SHARED_BRANCHES`] others apart
/// from the request's own.
const SUCCESSORS: usize = 4;

/// Other prompts that must have gone on differently from where a match ends for that prefix to
/// count as shared: two, so two conversations that happen to share a prefix stay together until
/// a third shows the prefix is common ground.
pub const SHARED_BRANCHES: usize = 2;

/// How far back from the end of the best match an earlier prompt's end is looked for: in
/// precise mode a pod also holds the blocks of the answer it generated, so the match of a
/// conversation's next turn runs past the previous prompt by up to the answer's length.
pub const ENDS_LOOKBACK: usize = 128;

/// Placement counts below this are forgotten (a pod that left stops costing memory).
const PLACED_FLOOR: f64 = 1e-3;

/// Most pods with placements remembered: other replicas' marks name pods from the shared stream,
/// and a name this router never saw must not grow the map without bound.
pub const PLACED_PODS: usize = 4_096;

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

/// Blocks seen right after a branch point (distinct, at most [`SUCCESSORS`]).
#[derive(Debug, Clone, Copy)]
struct Successors {
    keys: [BlockKey; SUCCESSORS],
    len: u8,
}

impl Default for Successors {
    fn default() -> Self {
        Self {
            keys: [BlockKey(0); SUCCESSORS],
            len: 0,
        }
    }
}

impl Successors {
    fn add(&mut self, key: BlockKey) {
        let n = usize::from(self.len);
        if n < SUCCESSORS && !self.keys[..n].contains(&key) {
            self.keys[n] = key;
            self.len += 1;
        }
    }

    /// Successors other than `own`.
    fn others(&self, own: Option<BlockKey>) -> usize {
        self.keys[..usize::from(self.len)]
            .iter()
            .filter(|k| Some(**k) != own)
            .count()
    }
}

/// A count that halves every `half_life_ms`.
#[derive(Debug, Clone, Copy)]
struct Decaying {
    value: f64,
    at_ms: u64,
}

impl Decaying {
    fn at(&self, now_ms: u64, half_life_ms: u64) -> f64 {
        let dt = now_ms.saturating_sub(self.at_ms) as f64;
        self.value * (-dt / half_life_ms.max(1) as f64 * std::f64::consts::LN_2).exp()
    }
}

struct Inner {
    ends: LruCache<BlockKey, ()>,
    branches: LruCache<BlockKey, Successors>,
    placed: AHashMap<PodId, Decaying>,
}

/// What the router remembers about conversations: where recent prompts ended, where they
/// branched off shared prefixes, and how many new conversations each pod recently took.
pub struct Conversations {
    inner: Mutex<Inner>,
    half_life_ms: u64,
}

impl Conversations {
    /// At most `capacity` prompt ends and as many branch points; placements count with a
    /// half-life of `half_life_ms`.
    pub fn new(capacity: usize, half_life_ms: u64) -> Self {
        let cap = NonZeroUsize::new(capacity.max(1)).expect("max(1)");
        Self {
            inner: Mutex::new(Inner {
                ends: LruCache::new(cap),
                branches: LruCache::new(cap),
                placed: AHashMap::new(),
            }),
            half_life_ms,
        }
    }

    /// Whether a request starts a new conversation on a prefix other conversations share:
    /// some candidate holds part of its prompt (`matched`, per candidate) but not all of it,
    /// and either it names a session pinned nowhere whose match extends no earlier prompt, or
    /// it names none, its match ends at a branch point of [`SHARED_BRANCHES`] others, and the
    /// shared part is shorter than the rest of the prompt. Without a session the request may
    /// be a one-off question on a shared document as well as a conversation's first turn; a
    /// short shared prefix is cheap to warm anywhere either way, a long one stays with its
    /// holders (whose load the hot gate watches).
    pub fn is_new(&self, keys: &Keys, matched: &[f64], session: SessionSeen) -> bool {
        let k = &keys.keys;
        let best = best_match(matched, k.len());
        if best == 0 || best >= k.len() {
            return false;
        }
        let inner = self.inner.lock();
        match session {
            SessionSeen::Pinned => false,
            SessionSeen::Unpinned => !continues(&inner.ends, k, best),
            SessionSeen::None => {
                let shared = (best * keys.tokens_per_block) as u64;
                shared < keys.prompt_tokens.saturating_sub(shared)
                    && inner
                        .branches
                        .peek(&k[best - 1])
                        .is_some_and(|s| s.others(Some(k[best])) >= SHARED_BRANCHES)
            }
        }
    }

    /// Whether a request naming no session shares only a prefix with what the pods hold: some
    /// candidate holds part of its prompt, none all of it, and the match reaches past no earlier
    /// prompt's end, so the rest (a conversation's own document, a one-off question) is new.
    /// The gate places it on an idle pod only while every holder of the prefix queues and the
    /// idle pod would answer sooner (`gate.replicate_to_idle`); otherwise it stays with them.
    pub fn shares_prefix(&self, keys: &Keys, matched: &[f64], session: SessionSeen) -> bool {
        let k = &keys.keys;
        let best = best_match(matched, k.len());
        session == SessionSeen::None
            && best > 0
            && best < k.len()
            && !continues(&self.inner.lock().ends, k, best)
    }

    /// Remembers a routed prompt: its end, the block after its best match (`best`, the most
    /// blocks any candidate held), and, when it started a new conversation, that `new_on` took
    /// one more.
    pub fn record(&self, keys: &[BlockKey], best: f64, new_on: Option<&PodId>, now_ms: u64) {
        let best = best_match(&[best], keys.len());
        let mut inner = self.inner.lock();
        if let Some(last) = keys.last() {
            inner.ends.put(*last, ());
        }
        if best > 0 && best < keys.len() {
            let next = keys[best];
            match inner.branches.get_mut(&keys[best - 1]) {
                Some(s) => s.add(next),
                None => {
                    let mut s = Successors::default();
                    s.add(next);
                    inner.branches.put(keys[best - 1], s);
                }
            }
        }
        if let Some(pod) = new_on {
            let half_life = self.half_life_ms;
            inner
                .placed
                .retain(|_, d| d.at(now_ms, half_life) >= PLACED_FLOOR);
            if inner.placed.len() >= PLACED_PODS && !inner.placed.contains_key(pod) {
                return;
            }
            let d = inner.placed.entry(pod.clone()).or_insert(Decaying {
                value: 0.0,
                at_ms: now_ms,
            });
            *d = Decaying {
                value: d.at(now_ms, half_life) + 1.0,
                at_ms: now_ms.max(d.at_ms),
            };
        }
    }

    /// [`Self::record`] of another replica's decision on `pod`, from its mark.
    pub fn record_mark(
        &self,
        keys: &[BlockKey],
        pod: &PodId,
        mark: crate::share::ConversationMark,
        now_ms: u64,
    ) {
        let new_on = mark.new_conversation.then_some(pod);
        self.record(keys, f64::from(mark.best_match), new_on, now_ms);
    }

    /// New conversations placed on each pod, each counting one at first and half as much every
    /// half-life after.
    pub fn placed(&self, pods: &[PodId], now_ms: u64) -> Vec<f64> {
        let inner = self.inner.lock();
        pods.iter()
            .map(|p| {
                inner
                    .placed
                    .get(p)
                    .map_or(0.0, |d| d.at(now_ms, self.half_life_ms))
            })
            .collect()
    }

    /// Whether the first `matched` keys reach past the end of an earlier prompt (at most
    /// [`ENDS_LOOKBACK`] blocks before the match ends): the request continues that prompt.
    pub fn continues(&self, keys: &[BlockKey], matched: usize) -> bool {
        continues(&self.inner.lock().ends, keys, matched)
    }

    /// Prompt ends, branch points and pods with placements remembered.
    pub fn sizes(&self) -> (usize, usize, usize) {
        let inner = self.inner.lock();
        (inner.ends.len(), inner.branches.len(), inner.placed.len())
    }
}

/// The longest match over the candidates, in whole blocks, at most `len`.
fn best_match(matched: &[f64], len: usize) -> usize {
    let best = matched.iter().copied().fold(0.0, f64::max);
    (best.max(0.0) as usize).min(len)
}

fn continues(ends: &LruCache<BlockKey, ()>, keys: &[BlockKey], matched: usize) -> bool {
    let end = matched.min(keys.len());
    let from = end.saturating_sub(ENDS_LOOKBACK);
    keys[from..end].iter().rev().any(|k| ends.contains(k))
}

/// The other replicas' decisions, as a shared index's mirror hands them over: their load to the
/// pods' in-flight accounting, their conversation marks to this router's conversation memory.
pub struct RemoteDecisions {
    /// Where the load goes.
    pub load: std::sync::Arc<dyn crate::share::RemoteLoad>,
    /// Where the marks go.
    pub conversations: std::sync::Arc<Conversations>,
}

impl crate::share::RemoteLoad for RemoteDecisions {
    fn charge(
        &self,
        pod: &PodId,
        charge: crate::share::Charge,
        age: std::time::Duration,
        hold: Option<crate::share::Hold>,
    ) {
        self.load.charge(pod, charge, age, hold);
    }

    fn release(&self, pod: &PodId, hold: crate::share::Hold, how: crate::share::Release) {
        self.load.release(pod, hold, how);
    }

    fn mark(
        &self,
        pod: &PodId,
        keys: &[BlockKey],
        mark: crate::share::ConversationMark,
        now_ms: u64,
    ) {
        self.conversations.record_mark(keys, pod, mark, now_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
        range.map(BlockKey).collect()
    }

    fn chain(parts: &[std::ops::Range<u64>]) -> Vec<BlockKey> {
        parts.iter().flat_map(|r| keys(r.clone())).collect()
    }

    /// A prompt of exactly these 16-token blocks.
    fn k(keys: &[BlockKey]) -> Keys {
        Keys {
            keys: keys.to_vec(),
            tokens_per_block: 16,
            prompt_tokens: 16 * keys.len() as u64,
            ..Keys::default()
        }
    }

    #[test]
    fn a_second_conversation_on_a_shared_prefix_is_new_and_a_next_turn_is_not() {
        let c = Conversations::new(16, 60_000);
        // Conversation A: system prompt blocks 0..10, own text 100..103.
        let a1 = chain(&[0..10, 100..103]);
        c.record(&a1, 0.0, None, 0);
        // Conversation B shares the system prompt only: its best match is the 10 shared blocks.
        let b1 = chain(&[0..10, 200..203]);
        let matched = [10.0, 0.0];
        let unpinned = SessionSeen::Unpinned;
        assert!(c.is_new(&k(&b1), &matched, unpinned));
        // A's next turn extends A's whole first prompt (a session that expired, say).
        let a2 = chain(&[0..10, 100..103, 300..305]);
        assert!(!c.is_new(&k(&a2), &[13.0, 0.0], unpinned));
        // Precise mode: the pod also holds A's answer, the match runs past A's prompt end.
        assert!(!c.is_new(&k(&a2), &[16.0, 0.0], unpinned));
        // A pinned session is a continuation whatever the index says, no match is not new, and
        // neither is a prompt matched whole.
        assert!(!c.is_new(&k(&b1), &matched, SessionSeen::Pinned));
        assert!(!c.is_new(&k(&b1), &[0.0, 0.0], unpinned));
        assert!(!c.is_new(&k(&b1), &[13.0, 0.0], unpinned));
    }

    #[test]
    fn without_a_session_a_prefix_is_shared_once_two_others_branched_off_it() {
        let c = Conversations::new(16, 60_000);
        let none = SessionSeen::None;
        // Conversations start on the system prompt 0..4, each routed after the first matched
        // the 4 shared blocks somewhere; each has 10 blocks of its own.
        let first = chain(&[0..4, 100..110]);
        c.record(&first, 0.0, None, 0);
        let second = chain(&[0..4, 200..210]);
        assert!(
            !c.is_new(&k(&second), &[4.0], none),
            "one other branch: not yet"
        );
        c.record(&second, 4.0, None, 0);
        let third = chain(&[0..4, 300..310]);
        assert!(
            !c.is_new(&k(&third), &[4.0], none),
            "the first never branched"
        );
        c.record(&third, 4.0, None, 0);
        let fourth = chain(&[0..4, 400..410]);
        assert!(
            c.is_new(&k(&fourth), &[4.0], none),
            "two others went on from here"
        );
        c.record(&fourth, 4.0, None, 0);
        // Another prompt that goes on like the third: only the others count, still two.
        assert!(c.is_new(&k(&chain(&[0..4, 300..311])), &[4.0], none));
        assert!(!c.is_new(&k(&fourth), &[4.0], SessionSeen::Pinned));
        // The second conversation's next turn leaves its own history where nobody else did.
        let second_next = chain(&[0..4, 200..209, 500..520]);
        assert!(!c.is_new(&k(&second_next), &[13.0], none));
        // A shared prefix as long as the rest of the prompt (a document and a question) is not
        // spread without a session: it may be a one-off, and warming it elsewhere costs more
        // than the question.
        let question = chain(&[0..4, 600..604]);
        assert!(!c.is_new(&k(&question), &[4.0], none));
        assert!(c.is_new(&k(&question), &[4.0], SessionSeen::Unpinned));
    }

    #[test]
    fn a_sessionless_prompt_shares_a_prefix_unless_it_continues_an_earlier_one() {
        let c = Conversations::new(16, 60_000);
        let none = SessionSeen::None;
        // One conversation so far: a long system prompt 0..90, its own document 100..120.
        let first = chain(&[0..90, 100..120]);
        c.record(&first, 0.0, None, 0);
        // A second conversation matches the system prompt only: its own text is held nowhere,
        // and no branch point is known yet, so it is not a new conversation but shares a prefix.
        let second = chain(&[0..90, 200..220]);
        assert!(!c.is_new(&k(&second), &[90.0, 0.0], none));
        assert!(c.shares_prefix(&k(&second), &[90.0, 0.0], none));
        // The first conversation's next turn reaches past its earlier prompt's end.
        let next = chain(&[0..90, 100..120, 300..302]);
        assert!(!c.shares_prefix(&k(&next), &[110.0, 0.0], none));
        // A session, no match, or a match of the whole prompt: not this case.
        assert!(!c.shares_prefix(&k(&second), &[90.0, 0.0], SessionSeen::Unpinned));
        assert!(!c.shares_prefix(&k(&second), &[0.0, 0.0], none));
        assert!(!c.shares_prefix(&k(&second), &[110.0, 0.0], none));
    }

    #[test]
    fn placements_halve_every_half_life_and_fade_out() {
        let c = Conversations::new(16, 1000);
        let (a, b) = (PodId::new("a:1"), PodId::new("b:1"));
        let k = keys(0..3);
        c.record(&k, 1.0, Some(&a), 0);
        c.record(&k, 1.0, Some(&a), 0);
        c.record(&k, 1.0, Some(&b), 1000);
        let p = c.placed(&[a.clone(), b.clone()], 1000);
        assert!(
            (p[0] - 1.0).abs() < 1e-9 && (p[1] - 1.0).abs() < 1e-9,
            "{p:?}"
        );
        // Much later a's entry has faded below the floor and is dropped on the next record.
        c.record(&k, 1.0, Some(&b), 30_000);
        assert_eq!(c.sizes().2, 1);
        assert!(c.placed(&[a], 30_000)[0] < 1e-6);
    }

    #[test]
    fn placements_on_pods_from_other_replicas_marks_are_bounded() {
        let c = Conversations::new(16, 300_000);
        let k = keys(0..3);
        let new = crate::share::ConversationMark {
            best_match: 1,
            new_conversation: true,
        };
        let pods: Vec<PodId> = (0..PLACED_PODS + 10)
            .map(|i| PodId::new(format!("stream-{i}")))
            .collect();
        for p in &pods {
            c.record_mark(&k, p, new, 0);
        }
        assert_eq!(c.sizes().2, PLACED_PODS);
        // A pod already counted still counts more.
        c.record_mark(&k, &pods[0], new, 0);
        assert!((c.placed(&pods[..1], 0)[0] - 2.0).abs() < 1e-9);
        assert_eq!(c.placed(&pods[PLACED_PODS..], 0)[0], 0.0);
    }

    #[test]
    fn memory_is_bounded_and_the_lookback_is_bounded() {
        let c = Conversations::new(4, 1000);
        for i in 0..100u64 {
            c.record(&[BlockKey(i), BlockKey(i + 1000)], 1.0, None, 0);
        }
        let (ends, branches, _) = c.sizes();
        assert_eq!((ends, branches), (4, 4), "LRU-bounded");
        let mut s = Successors::default();
        for k in 0..10 {
            s.add(BlockKey(k % 7));
        }
        assert_eq!(s.others(None), SUCCESSORS, "distinct, at most four");
        assert!(c.continues(&[BlockKey(1099)], 1));
        assert!(!c.continues(&[BlockKey(1003)], 1), "evicted");
        let long = keys(0..1000);
        c.record(&long[..10], 0.0, None, 0);
        assert!(
            !c.continues(&long, 1000),
            "an end further back than the lookback is not searched"
        );
        assert!(c.continues(&long, 10 + ENDS_LOOKBACK - 1));
        assert!(!c.continues(&long, 0), "empty match");
        assert!(!c.continues(&[], 5), "match past the keys is clamped");
    }
}
