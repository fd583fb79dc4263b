//! The bookkeeping both in-process backends share: a dense slot per pod (holder lists store a
//! 4-byte slot, not the pod's name), a free list so a departed pod's slot is reused, the reverse
//! map block key → holders with its entry count, and the consecutive-prefix walk over them (a
//! bitset of the candidates still matching, intersected key by key with the holders' bits).

use ahash::AHashMap;
use smallvec::{smallvec, SmallVec};

use super::IndexStats;
use crate::blocks::BlockKey;
use crate::pods::PodId;

/// Keys a `record` writes per hold of the index's write lock (about 10 us of work), so a lookup
/// never waits for a whole long prompt.
pub(crate) const RECORD_CHUNK: usize = 256;

/// A pod's dense index in a [`PodSlots`] table.
pub(crate) type Slot = u32;

/// Pod ↔ slot, with per-pod state `T`.
pub(crate) struct PodSlots<T> {
    slots: AHashMap<PodId, Slot>,
    states: Vec<Option<T>>,
    free: Vec<Slot>,
}

impl<T> Default for PodSlots<T> {
    fn default() -> Self {
        Self {
            slots: AHashMap::new(),
            states: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> PodSlots<T> {
    /// The slot of `pod`, if it has one.
    pub(crate) fn get(&self, pod: &PodId) -> Option<Slot> {
        self.slots.get(pod).copied()
    }

    /// The slot of `pod`, creating its state with `make` (in a freed slot if any) when new.
    pub(crate) fn get_or_insert_with(&mut self, pod: &PodId, make: impl FnOnce() -> T) -> Slot {
        if let Some(&s) = self.slots.get(pod) {
            return s;
        }
        let s = match self.free.pop() {
            Some(s) => {
                self.states[s as usize] = Some(make());
                s
            }
            None => {
                self.states.push(Some(make()));
                Slot::try_from(self.states.len() - 1).expect("fewer than 2^32 pods")
            }
        };
        self.slots.insert(pod.clone(), s);
        s
    }

    /// Every pod with a slot.
    pub(crate) fn ids(&self) -> impl Iterator<Item = &PodId> {
        self.slots.keys()
    }

    /// Removes `pod`, returning its former slot (now free) and state.
    pub(crate) fn remove(&mut self, pod: &PodId) -> Option<(Slot, T)> {
        let slot = self.slots.remove(pod)?;
        self.free.push(slot);
        Some((slot, self.states[slot as usize].take()?))
    }

    /// The state in `slot`, if live.
    pub(crate) fn state(&self, slot: Slot) -> Option<&T> {
        self.states.get(slot as usize)?.as_ref()
    }

    /// The state in a live `slot` (from [`Self::get`] or [`Self::get_or_insert_with`]).
    pub(crate) fn state_mut(&mut self, slot: Slot) -> &mut T {
        self.states[slot as usize].as_mut().expect("live slot")
    }

    /// Live slots and their states.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Slot, &T)> {
        self.states
            .iter()
            .enumerate()
            .filter_map(|(s, t)| Some((s as Slot, t.as_ref()?)))
    }

    /// Live slots and their states, mutably.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (Slot, &mut T)> {
        self.states
            .iter_mut()
            .enumerate()
            .filter_map(|(s, t)| Some((s as Slot, t.as_mut()?)))
    }
}

/// One pod's entry in a key's holder list.
pub(crate) trait Holder: Copy {
    /// The pod's slot.
    fn slot(&self) -> Slot;
    /// The entry counts for lookups at `now_ms` below this (by default, forever).
    fn expiry(&self) -> u64 {
        u64::MAX
    }
    /// The entry counts at the lesser weight (e.g. an offloaded copy).
    fn lesser(&self) -> bool {
        false
    }
}

/// Holder lists up to this long stay inline; longer ones move out and keep [`SlotBits`]. Two keeps
/// a key's map slot at 56 bytes (it was 88 with four): a long prompt's lookup is its cache misses.
const INLINE: usize = 2;

/// A long holder list as bits over slots, so a lookup intersects it with its candidates a word
/// (64 pods) at a time instead of visiting every holder. The first word is kept in the map entry
/// itself: a fleet of up to 64 pods reads no other memory per key.
#[derive(Debug, Default)]
struct SlotBits {
    /// Slots 0..64 holding the key, and which of them are [`Holder::lesser`].
    held0: u64,
    lesser0: u64,
    /// The least [`Holder::expiry`] of the list: below it every entry counts.
    min_expiry: u64,
    /// The words for slots from 64 on, `[held, lesser]` each, allocated once such a slot holds.
    // One pointer in every long entry, not a Vec's three words.
    #[allow(clippy::box_collection)]
    more: Option<Box<Vec<[u64; 2]>>>,
}

impl SlotBits {
    fn set(&mut self, slot: Slot, held: bool, lesser: bool) {
        let (w, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        let put = |word: &mut u64, on: bool| {
            if on {
                *word |= bit;
            } else {
                *word &= !bit;
            }
        };
        if w == 0 {
            put(&mut self.held0, held);
            put(&mut self.lesser0, lesser);
            return;
        }
        if !held && self.more.as_ref().is_none_or(|m| m.len() < w) {
            return;
        }
        let more = self.more.get_or_insert_with(Box::default);
        if more.len() < w {
            more.resize(w, [0, 0]);
        }
        put(&mut more[w - 1][0], held);
        put(&mut more[w - 1][1], lesser);
    }
}

/// A key's holders: a short list inline, or a long one with its bits.
enum Held<H> {
    Few(SmallVec<[H; INLINE]>),
    // The list boxed: a lookup reads only the bits, and a short entry keeps the map small.
    #[allow(clippy::box_collection)]
    Many {
        list: Box<Vec<H>>,
        bits: SlotBits,
    },
}

impl<H> Default for Held<H> {
    fn default() -> Self {
        Held::Few(SmallVec::new())
    }
}

impl<H: Holder> Held<H> {
    fn list(&self) -> &[H] {
        match self {
            Held::Few(l) => l,
            Held::Many { list, .. } => list.as_slice(),
        }
    }

    fn position(&self, slot: Slot) -> Option<usize> {
        self.list().iter().position(|h| h.slot() == slot)
    }

    fn push(&mut self, h: H) {
        match self {
            Held::Few(l) if l.len() < INLINE => l.push(h),
            Held::Few(l) => {
                let mut list = Vec::with_capacity(2 * INLINE);
                list.extend_from_slice(l);
                list.push(h);
                let mut bits = SlotBits {
                    min_expiry: u64::MAX,
                    ..SlotBits::default()
                };
                for h in &list {
                    bits.set(h.slot(), true, h.lesser());
                    bits.min_expiry = bits.min_expiry.min(h.expiry());
                }
                *self = Held::Many {
                    list: Box::new(list),
                    bits,
                };
            }
            Held::Many { list, bits } => {
                list.push(h);
                bits.set(h.slot(), true, h.lesser());
                bits.min_expiry = bits.min_expiry.min(h.expiry());
            }
        }
    }

    /// Applies `update` to entry `i`; drops it when `update` returns false.
    fn update(&mut self, i: usize, update: impl FnOnce(&mut H) -> bool) {
        match self {
            Held::Few(l) => {
                if !update(&mut l[i]) {
                    l.swap_remove(i);
                }
            }
            Held::Many { list, bits } => {
                let old = list[i];
                let keep = update(&mut list[i]);
                let new = list[i];
                if keep {
                    bits.set(new.slot(), true, new.lesser());
                } else {
                    list.swap_remove(i);
                    bits.set(old.slot(), false, false);
                }
                if old.expiry() == bits.min_expiry || (keep && new.expiry() < bits.min_expiry) {
                    bits.min_expiry = list.iter().map(H::expiry).min().unwrap_or(u64::MAX);
                }
            }
        }
    }

    /// Into `cur`, the `alive` slots whose entry counts at `now_ms`; into `lesser`, those of
    /// them counting at the lesser weight. Both come in zeroed, as long as `alive`.
    #[inline(always)]
    fn intersect(&self, alive: &[u64], now_ms: u64, cur: &mut [u64], lesser: &mut [u64]) {
        match self {
            Held::Many { bits: b, .. } if b.min_expiry > now_ms => {
                cur[0] = alive[0] & b.held0;
                lesser[0] = alive[0] & b.lesser0;
                if let Some(more) = &b.more {
                    for (w, &[h, l]) in more.iter().enumerate().take(alive.len() - 1) {
                        cur[w + 1] = alive[w + 1] & h;
                        lesser[w + 1] = alive[w + 1] & l;
                    }
                }
            }
            _ => {
                for h in self.list() {
                    let (w, bit) = (h.slot() as usize / 64, 1u64 << (h.slot() % 64));
                    if alive.get(w).is_some_and(|&a| a & bit != 0) && h.expiry() > now_ms {
                        cur[w] |= bit;
                        if h.lesser() {
                            lesser[w] |= bit;
                        }
                    }
                }
            }
        }
    }
}

/// Block key → the pods holding it (usually a handful, kept inline), and the entry count.
pub(crate) struct Holders<H> {
    map: AHashMap<BlockKey, Held<H>>,
    entries: usize,
}

impl<H> Default for Holders<H> {
    fn default() -> Self {
        Self {
            map: AHashMap::new(),
            entries: 0,
        }
    }
}

impl<H: Holder> Holders<H> {
    /// Every holder of `key`.
    pub(crate) fn of(&self, key: &BlockKey) -> &[H] {
        self.map.get(key).map_or(&[], |h| h.list())
    }

    /// Makes room for `additional` more keys without growing the map on the way.
    pub(crate) fn reserve(&mut self, additional: usize) {
        self.map.reserve(additional);
    }

    /// Applies `update` to `slot`'s entry for `key`; false when it has none.
    pub(crate) fn update(
        &mut self,
        key: &BlockKey,
        slot: Slot,
        update: impl FnOnce(&mut H),
    ) -> bool {
        let Some(held) = self.map.get_mut(key) else {
            return false;
        };
        let Some(i) = held.position(slot) else {
            return false;
        };
        held.update(i, |h| {
            update(h);
            true
        });
        true
    }

    /// Adds `holder` to `key`; the caller knows its slot does not hold `key` yet.
    pub(crate) fn insert(&mut self, key: BlockKey, holder: H) {
        self.map.entry(key).or_default().push(holder);
        self.entries += 1;
    }

    /// Updates `slot`'s entry for `key` with `update`, or inserts `make()` when it has none.
    pub(crate) fn upsert(
        &mut self,
        key: BlockKey,
        slot: Slot,
        update: impl FnOnce(&mut H),
        make: impl FnOnce() -> H,
    ) {
        let held = self.map.entry(key).or_default();
        match held.position(slot) {
            Some(i) => held.update(i, |h| {
                update(h);
                true
            }),
            None => {
                held.push(make());
                self.entries += 1;
            }
        }
    }

    /// Applies `update` to `slot`'s entry for `key` and drops the entry when it returns false.
    pub(crate) fn update_or_remove(
        &mut self,
        key: &BlockKey,
        slot: Slot,
        update: impl FnOnce(&mut H) -> bool,
    ) {
        let Some(held) = self.map.get_mut(key) else {
            return;
        };
        if let Some(i) = held.position(slot) {
            let before = held.list().len();
            held.update(i, update);
            self.entries -= before - held.list().len();
        }
        if held.list().is_empty() {
            self.map.remove(key);
        }
    }

    /// Drops `slot`'s entry for `key`.
    pub(crate) fn remove(&mut self, key: &BlockKey, slot: Slot) {
        self.update_or_remove(key, slot, |_| false);
    }

    /// The consecutive-prefix walk over `keys` for the candidate slots `cands`, with a bitset
    /// of the candidates still matching: each key's holders are intersected with it (a word per
    /// 64 slots when the key keeps [`SlotBits`]), the walk stops when no candidate is left, and
    /// a candidate's tally is closed when it drops out. An entry counts while `now_ms` is below
    /// its expiry; `fallback(slot, key)` may still vouch (with a weight) for a candidate no
    /// counting entry names. Returns the tallies by slot.
    fn walk(
        &self,
        keys: &[BlockKey],
        cands: &[Slot],
        now_ms: u64,
        fallback: impl FnMut(Slot, &BlockKey) -> Option<f64>,
    ) -> Vec<Tally> {
        let n = cands.iter().max().map_or(0, |&m| m as usize + 1);
        // Up to 64 slots (most fleets) the bitsets are one register-held word.
        if n <= 64 {
            self.walk_in::<[u64; 1]>(keys, cands, n, now_ms, fallback)
        } else {
            self.walk_in::<SmallVec<[u64; 4]>>(keys, cands, n, now_ms, fallback)
        }
    }

    /// [`Self::walk`] with bitsets of storage `B` for `n` slots.
    #[inline(always)]
    fn walk_in<B: Words>(
        &self,
        keys: &[BlockKey],
        cands: &[Slot],
        n: usize,
        now_ms: u64,
        mut fallback: impl FnMut(Slot, &BlockKey) -> Option<f64>,
    ) -> Vec<Tally> {
        let mut tally = vec![Tally::default(); n];
        let words = n.div_ceil(64);
        let mut alive = B::zeroed(words);
        for &s in cands {
            alive.as_mut()[s as usize / 64] |= 1 << (s % 64);
        }
        let (mut cur, mut lesser) = (B::zeroed(words), B::zeroed(words));
        // Keys are looked up a few at a time, so that their probes overlap instead of each
        // waiting for the one before.
        const AHEAD: usize = 8;
        'walk: for (c, chunk) in keys.chunks(AHEAD).enumerate() {
            let found: [Option<&Held<H>>; AHEAD] =
                std::array::from_fn(|j| chunk.get(j).and_then(|k| self.map.get(k)));
            for (j, key) in chunk.iter().enumerate() {
                let i = c * AHEAD + j;
                if alive.as_ref().iter().all(|&w| w == 0) {
                    break 'walk;
                }
                cur.as_mut().fill(0);
                lesser.as_mut().fill(0);
                if let Some(held) = found[j] {
                    held.intersect(alive.as_ref(), now_ms, cur.as_mut(), lesser.as_mut());
                }
                let (alive, cur, lesser) = (alive.as_mut(), cur.as_mut(), lesser.as_ref());
                for w in 0..words {
                    for s in ones(alive[w] & !cur[w], w) {
                        let t = &mut tally[s as usize];
                        match fallback(s, key) {
                            Some(x) => {
                                cur[w] |= 1 << (s % 64);
                                t.vouched += 1;
                                t.vouched_weight += x;
                            }
                            None => t.len = i,
                        }
                    }
                    for s in ones(lesser[w], w) {
                        tally[s as usize].lesser += 1;
                    }
                    alive[w] = cur[w];
                }
            }
        }
        for (w, &a) in alive.as_ref().iter().enumerate() {
            for s in ones(a, w) {
                tally[s as usize].len = keys.len();
            }
        }
        tally
    }
}

/// Storage for a walk's bitsets: one fixed word, or as many as the slots need.
trait Words: AsRef<[u64]> + AsMut<[u64]> {
    /// `words` zero words (a fixed size ignores it: the caller checked it fits).
    fn zeroed(words: usize) -> Self;
}

impl Words for [u64; 1] {
    fn zeroed(_: usize) -> Self {
        [0]
    }
}

impl Words for SmallVec<[u64; 4]> {
    fn zeroed(words: usize) -> Self {
        smallvec![0; words]
    }
}

/// The slots of the set bits of word `w`.
fn ones(mut bits: u64, w: usize) -> impl Iterator<Item = Slot> {
    std::iter::from_fn(move || {
        (bits != 0).then(|| {
            let b = bits.trailing_zeros();
            bits &= bits - 1;
            (w * 64) as Slot + b
        })
    })
}

/// One candidate's walk: how many leading keys it matched, and how those counted.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Tally {
    /// Leading keys matched.
    len: usize,
    /// Of them, entries at the lesser weight.
    lesser: usize,
    /// Of them, keys only the fallback vouched for, and what it said they weigh.
    vouched: usize,
    vouched_weight: f64,
}

impl Tally {
    fn score(&self, w: Weights) -> f64 {
        (self.len - self.lesser - self.vouched) as f64 * w.full
            + self.lesser as f64 * w.lesser
            + self.vouched_weight
    }
}

/// What a counting holder entry weighs in a lookup.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Weights {
    /// A full entry (e.g. a GPU-resident block).
    pub(crate) full: f64,
    /// A [`Holder::lesser`] one (e.g. offloaded).
    pub(crate) lesser: f64,
}

/// The state of an in-process backend: pods with per-pod state `T`, keys with holders `H`.
/// Public fields so a backend can borrow both halves at once.
pub(crate) struct Table<T, H> {
    /// Pod ↔ slot and per-pod state.
    pub(crate) pods: PodSlots<T>,
    /// Block key → holders.
    pub(crate) holders: Holders<H>,
}

impl<T, H> Default for Table<T, H> {
    fn default() -> Self {
        Self {
            pods: PodSlots::default(),
            holders: Holders::default(),
        }
    }
}

impl<T, H: Holder> Table<T, H> {
    /// Size figures; `holds_any` says whether a pod's state holds anything.
    pub(crate) fn stats(&self, holds_any: impl Fn(&T) -> bool) -> IndexStats {
        IndexStats {
            keys: self.holders.map.len(),
            entries: self.holders.entries,
            pods: self.pods.iter().filter(|(_, t)| holds_any(t)).count(),
        }
    }

    /// For each of `pods`, the weight of the leading `keys` it holds at `now_ms`: each counting
    /// entry weighs `weights.full` or `weights.lesser` ([`Holder::lesser`]), an expired one does
    /// not count; `fallback(pod state, key)` may still vouch for a candidate no counting entry
    /// names (speculative entries). A pod listed twice gets its score twice.
    pub(crate) fn lookup(
        &self,
        keys: &[BlockKey],
        pods: &[PodId],
        now_ms: u64,
        weights: Weights,
        fallback: impl Fn(&T, &BlockKey) -> Option<f64>,
    ) -> Vec<f64> {
        let slots: SmallVec<[Option<Slot>; 64]> = pods.iter().map(|p| self.pods.get(p)).collect();
        let cands: SmallVec<[Slot; 64]> = slots.iter().flatten().copied().collect();
        let tally = self.holders.walk(keys, &cands, now_ms, |s, key| {
            fallback(self.pods.state(s)?, key)
        });
        slots
            .iter()
            .map(|s| s.map_or(0.0, |s| tally[s as usize].score(weights)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq)]
    struct H {
        slot: Slot,
        expiry: u64,
        lesser: bool,
    }

    impl Holder for H {
        fn slot(&self) -> Slot {
            self.slot
        }
        fn expiry(&self) -> u64 {
            self.expiry
        }
        fn lesser(&self) -> bool {
            self.lesser
        }
    }

    fn h(slot: Slot) -> H {
        H {
            slot,
            expiry: u64::MAX,
            lesser: false,
        }
    }

    const W: Weights = Weights {
        full: 1.0,
        lesser: 0.5,
    };

    #[test]
    fn freed_slots_are_reused_and_carry_no_state() {
        let mut t = PodSlots::<&str>::default();
        let (a, b, c) = (PodId::new("a:1"), PodId::new("b:1"), PodId::new("c:1"));
        assert_eq!(t.get_or_insert_with(&a, || "a"), 0);
        assert_eq!(t.get_or_insert_with(&b, || "b"), 1);
        assert_eq!(
            t.get_or_insert_with(&a, || "again"),
            0,
            "existing pods keep theirs"
        );
        assert_eq!(t.remove(&a), Some((0, "a")));
        assert_eq!(t.remove(&a), None);
        assert_eq!(t.get(&a), None);
        assert_eq!(t.get_or_insert_with(&c, || "c"), 0, "slot 0 reused");
        assert_eq!(t.state(0), Some(&"c"));
        assert_eq!(t.iter().count(), 2);
    }

    #[test]
    fn holder_entries_are_counted_once_per_key_and_slot() {
        let mut hs = Holders::<H>::default();
        let k = BlockKey(7);
        let bump = |e: &mut H| e.expiry -= 1;
        hs.upsert(k, 0, bump, || h(0));
        hs.upsert(k, 0, bump, || h(0));
        hs.insert(k, h(1));
        assert_eq!(
            hs.of(&k),
            &[
                H {
                    expiry: u64::MAX - 1,
                    ..h(0)
                },
                h(1)
            ]
        );
        assert_eq!(hs.entries, 2);
        assert!(hs.update(&k, 1, |e| e.expiry = 5));
        assert!(!hs.update(&k, 2, |e| e.expiry = 5), "slot 2 holds nothing");
        hs.update_or_remove(&k, 0, |e| {
            e.expiry -= 1;
            e.expiry > 0
        });
        assert_eq!(hs.entries, 2);
        hs.remove(&k, 0);
        hs.remove(&k, 0);
        hs.remove(&k, 1);
        assert_eq!(hs.entries, 0);
        assert!(hs.map.is_empty(), "keys without holders are dropped");
    }

    /// A table whose pods `p0..` hold `held[k]` (slots) of key `k`.
    fn table(pods: usize, held: &[&[Slot]]) -> (Table<(), H>, Vec<PodId>) {
        let mut t = Table::<(), H>::default();
        let ids: Vec<PodId> = (0..pods).map(|i| PodId::new(format!("p{i}:1"))).collect();
        for id in &ids {
            t.pods.get_or_insert_with(id, || ());
        }
        for (k, slots) in held.iter().enumerate() {
            for &s in *slots {
                t.holders.insert(BlockKey(k as u64), h(s));
            }
        }
        (t, ids)
    }

    fn keys(n: u64) -> Vec<BlockKey> {
        (0..n).map(BlockKey).collect()
    }

    #[test]
    fn each_candidate_stops_at_its_first_missing_key() {
        let (mut t, ids) = table(3, &[&[0, 1], &[0], &[0, 1]]);
        t.holders.update(&BlockKey(1), 0, |e| e.lesser = true);
        let got = t.lookup(&keys(3), &ids, 0, W, |_, _| None);
        assert_eq!(got, vec![2.5, 1.0, 0.0]);
        let vouched = t.lookup(&keys(3), &ids[1..2], 0, W, |_, k| {
            (k.0 == 1).then_some(0.25)
        });
        assert_eq!(vouched, vec![2.25], "the fallback fills a gap");
        let unknown = PodId::new("gone:1");
        assert_eq!(
            t.lookup(&keys(3), &[unknown, ids[0].clone()], 0, W, |_, _| Some(1.0)),
            vec![0.0, 2.5],
            "a pod without a slot matches nothing"
        );
        assert_eq!(t.lookup(&[], &ids, 0, W, |_, _| None), vec![0.0; 3]);
    }

    #[test]
    fn a_pod_listed_twice_gets_its_score_at_both_places() {
        // The walk before the candidate bitset kept one candidate per slot: a pod listed twice
        // matched nothing at its first place.
        let (t, ids) = table(2, &[&[0, 1], &[0]]);
        let pods = [ids[0].clone(), ids[1].clone(), ids[0].clone()];
        assert_eq!(
            t.lookup(&keys(2), &pods, 0, W, |_, _| None),
            vec![2.0, 1.0, 2.0]
        );
    }

    #[test]
    fn expired_entries_do_not_count_in_long_lists_either() {
        let all: Vec<Slot> = (0..70).collect();
        let (mut t, ids) = table(70, &[&all, &all]);
        assert!(
            matches!(t.holders.map[&BlockKey(0)], Held::Many { .. }),
            "long lists keep bits"
        );
        t.holders.update(&BlockKey(1), 65, |e| e.expiry = 10);
        t.holders.update(&BlockKey(1), 3, |e| e.lesser = true);
        let got = t.lookup(&keys(2), &ids, 10, W, |_, _| None);
        assert_eq!((got[65], got[3], got[0]), (1.0, 1.5, 2.0));
        let before = t.lookup(&keys(2), &ids, 9, W, |_, _| None);
        assert_eq!((before[65], before[3], before[0]), (2.0, 1.5, 2.0));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Upsert(u64, Slot, u64, bool),
        Remove(u64, Slot),
        Lookup(Vec<Slot>, u64, Vec<Slot>),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Slots past 64 and keys with more than INLINE holders, so bits are used and span words.
        let slot = prop_oneof![0..8 as Slot, 60..72 as Slot, 120..130 as Slot];
        prop_oneof![
            6 => (0u64..4, slot.clone(), 1u64..20, any::<bool>())
                .prop_map(|(k, s, e, l)| Op::Upsert(k, s, e, l)),
            2 => (0u64..4, slot.clone()).prop_map(|(k, s)| Op::Remove(k, s)),
            1 => (prop::collection::vec(slot.clone(), 0..12), 0u64..20, prop::collection::vec(slot, 0..4))
                .prop_map(|(c, now, v)| Op::Lookup(c, now, v)),
        ]
    }

    proptest! {
        /// The bitset walk against the plain definition, read off the holder lists.
        #[test]
        fn walk_matches_the_holder_lists(ops in prop::collection::vec(op(), 1..120)) {
            let mut hs = Holders::<H>::default();
            for op in ops {
                match op {
                    Op::Upsert(k, slot, expiry, lesser) => {
                        let e = H { slot, expiry, lesser };
                        hs.upsert(BlockKey(k), slot, |h| *h = e, || e);
                    }
                    Op::Remove(k, slot) => hs.remove(&BlockKey(k), slot),
                    Op::Lookup(cands, now, vouch) => {
                        let ks = keys(4);
                        let fb = |s: Slot, _: &BlockKey| vouch.contains(&s).then_some(0.25);
                        let tally = hs.walk(&ks, &cands, now, fb);
                        for &c in &cands {
                            let mut want = 0.0;
                            for k in &ks {
                                let e = hs.of(k).iter().find(|h| h.slot == c && h.expiry > now);
                                match (e, fb(c, k)) {
                                    (Some(e), _) => want += if e.lesser { W.lesser } else { W.full },
                                    (None, Some(x)) => want += x,
                                    (None, None) => break,
                                }
                            }
                            prop_assert_eq!(tally[c as usize].score(W), want, "slot {}", c);
                        }
                    }
                }
            }
        }
    }
}
