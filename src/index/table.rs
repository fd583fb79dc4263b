//! The bookkeeping both in-process backends share: a dense slot per pod (holder lists store a
//! 4-byte slot, not the pod's name), a free list so a departed pod's slot is reused, the reverse
//! map block key → holders with its entry count, and the consecutive-prefix walk over them.

use ahash::AHashMap;
use smallvec::SmallVec;

use super::IndexStats;
use crate::blocks::BlockKey;
use crate::pods::PodId;

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
}

/// Block key → the pods holding it (usually a handful, kept inline), and the entry count.
pub(crate) struct Holders<H> {
    map: AHashMap<BlockKey, SmallVec<[H; 4]>>,
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
        self.map.get(key).map_or(&[], |h| h.as_slice())
    }

    /// `slot`'s entry for `key`.
    pub(crate) fn get_mut(&mut self, key: &BlockKey, slot: Slot) -> Option<&mut H> {
        self.map.get_mut(key)?.iter_mut().find(|h| h.slot() == slot)
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
        let holders = self.map.entry(key).or_default();
        match holders.iter_mut().find(|h| h.slot() == slot) {
            Some(h) => update(h),
            None => {
                holders.push(make());
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
        let Some(holders) = self.map.get_mut(key) else {
            return;
        };
        if let Some(i) = holders.iter().position(|h| h.slot() == slot) {
            if !update(&mut holders[i]) {
                holders.swap_remove(i);
                self.entries -= 1;
            }
        }
        if holders.is_empty() {
            self.map.remove(key);
        }
    }

    /// Drops `slot`'s entry for `key`.
    pub(crate) fn remove(&mut self, key: &BlockKey, slot: Slot) {
        self.update_or_remove(key, slot, |_| false);
    }
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

    /// For each of `pods`, the weight of the leading `keys` it holds. `weight` says what a
    /// holder entry is worth (`None`: it does not count, e.g. expired); `fallback(pod state, key)`
    /// may still vouch for a candidate no entry named (speculative entries).
    pub(crate) fn lookup(
        &self,
        keys: &[BlockKey],
        pods: &[PodId],
        weight: impl Fn(&H) -> Option<f64>,
        fallback: impl Fn(&T, &BlockKey) -> Option<f64>,
    ) -> Vec<f64> {
        let slots: Vec<Option<Slot>> = pods.iter().map(|p| self.pods.get(p)).collect();
        prefix_walk(
            keys,
            &slots,
            |key| {
                self.holders
                    .of(key)
                    .iter()
                    .filter_map(|h| Some((h.slot(), weight(h)?)))
            },
            |c, key| fallback(self.pods.state(slots[c]?)?, key),
        )
    }
}

/// The consecutive-prefix walk. For each key in order, `holders` yields `(slot, weight)` of every
/// pod slot holding it; `fallback(candidate, key)` may still vouch for an alive candidate that no
/// holder named. A candidate drops out at its first missing key. Costs O(holders + alive
/// candidates) per key, not O(holders × candidates).
fn prefix_walk<I>(
    keys: &[BlockKey],
    cand_slots: &[Option<Slot>],
    mut holders: impl FnMut(&BlockKey) -> I,
    mut fallback: impl FnMut(usize, &BlockKey) -> Option<f64>,
) -> Vec<f64>
where
    I: IntoIterator<Item = (Slot, f64)>,
{
    const NONE: usize = usize::MAX;
    let n = cand_slots.len();
    let mut matched = vec![0.0; n];
    let max_slot = cand_slots
        .iter()
        .flatten()
        .copied()
        .max()
        .map_or(0, |m| m as usize + 1);
    let mut cand_of = vec![NONE; max_slot];
    for (c, s) in cand_slots.iter().enumerate() {
        if let Some(s) = s {
            cand_of[*s as usize] = c;
        }
    }
    let mut alive: Vec<usize> = (0..n).filter(|&c| cand_slots[c].is_some()).collect();
    let mut stamp = vec![usize::MAX; n];
    let mut weight = vec![0.0; n];
    for (ki, key) in keys.iter().enumerate() {
        if alive.is_empty() {
            break;
        }
        for (slot, w) in holders(key) {
            if let Some(&c) = cand_of.get(slot as usize) {
                if c != NONE {
                    stamp[c] = ki;
                    weight[c] = w;
                }
            }
        }
        alive.retain(|&c| {
            let w = if stamp[c] == ki {
                Some(weight[c])
            } else {
                fallback(c, key)
            };
            match w {
                Some(w) => {
                    matched[c] += w;
                    true
                }
                None => false,
            }
        });
    }
    matched
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq)]
    struct H(Slot, u32);

    impl Holder for H {
        fn slot(&self) -> Slot {
            self.0
        }
    }

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
        let mut h = Holders::<H>::default();
        let k = BlockKey(7);
        h.upsert(k, 0, |e| e.1 += 1, || H(0, 1));
        h.upsert(k, 0, |e| e.1 += 1, || H(0, 1));
        h.insert(k, H(1, 1));
        assert_eq!(h.of(&k), &[H(0, 2), H(1, 1)]);
        assert_eq!(h.entries, 2);
        h.update_or_remove(&k, 0, |e| {
            e.1 -= 1;
            e.1 > 0
        });
        assert_eq!(h.entries, 2);
        h.remove(&k, 0);
        h.remove(&k, 0);
        h.remove(&k, 1);
        assert_eq!(h.entries, 0);
        assert!(h.map.is_empty(), "keys without holders are dropped");
    }

    #[test]
    fn walk_stops_each_candidate_at_its_first_missing_key() {
        let keys = [BlockKey(1), BlockKey(2), BlockKey(3)];
        let held = |k: &BlockKey| match k.0 {
            1 => vec![(0, 1.0), (1, 1.0)],
            2 => vec![(0, 0.5)],
            _ => vec![(0, 1.0), (1, 1.0)],
        };
        let got = prefix_walk(&keys, &[Some(0), Some(1), None], held, |_, _| None);
        assert_eq!(got, vec![2.5, 1.0, 0.0]);
        let vouched = prefix_walk(&keys, &[Some(1)], held, |_, k| (k.0 == 2).then_some(1.0));
        assert_eq!(vouched, vec![3.0]);
    }
}
