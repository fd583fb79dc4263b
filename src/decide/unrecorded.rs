//! Decisions answered but not yet in the index. The ext_proc stream replies before it records
//! (a long prompt's record is an LRU move per block, or a Redis write), so two requests on one
//! prefix decided a moment apart both looked up an index that knew neither, and a burst on a new
//! prefix split over cold pods. Lookups see these entries until shortly after their record lands.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use crate::blocks::BlockKey;
use crate::pods::PodId;

/// Entries kept at most (the oldest goes first): this bounds what a flood of decisions, or
/// callers that never record, can leave behind.
const CAPACITY: usize = 256;
/// An entry unrecorded this long no longer counts (its record was lost with its stream).
const MAX_AGE: Duration = Duration::from_secs(10);
/// An entry still counts this long after its record landed: a lookup that started before the
/// record landed (a Redis round trip) overlays it after.
pub(super) const GRACE: Duration = Duration::from_millis(100);

/// Unrecorded decisions: (pod, prompt keys), shared with each decision's pending record.
#[derive(Default)]
pub struct Unrecorded {
    inner: Mutex<Inner>,
}

/// Holds the set while one decision overlays it, plans and adds itself, so two decisions never
/// miss each other however close together they run.
pub struct Held<'a>(MutexGuard<'a, Inner>);

#[derive(Default)]
struct Inner {
    next: u64,
    entries: VecDeque<Entry>,
}

struct Entry {
    id: u64,
    pod: PodId,
    keys: Arc<[BlockKey]>,
    at: Instant,
    landed: Option<Instant>,
}

impl Unrecorded {
    /// Takes the set for one decision (held briefly: an overlay, a plan, an add).
    pub fn hold(&self) -> Held<'_> {
        Held(self.inner.lock())
    }

    /// Marks the entry `id` recorded (or abandoned); it stops counting after [`GRACE`].
    pub fn landed(&self, id: u64) {
        let mut g = self.inner.lock();
        if let Some(e) = g.entries.iter_mut().find(|e| e.id == id) {
            e.landed = Some(Instant::now());
        }
    }

    /// Entries that still count.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        let mut g = self.inner.lock();
        g.purge(Instant::now());
        g.entries.len()
    }
}

impl Inner {
    fn purge(&mut self, now: Instant) {
        self.entries.retain(|e| match e.landed {
            Some(t) => now.saturating_duration_since(t) <= GRACE,
            None => now.saturating_duration_since(e.at) <= MAX_AGE,
        });
    }
}

impl Held<'_> {
    /// Raises each candidate's matched blocks to the longest prefix of `keys` an unrecorded
    /// decision sent it.
    pub fn overlay(&mut self, keys: &[BlockKey], pods: &[PodId], matched: &mut [f64]) {
        let Some(first) = keys.first() else {
            return;
        };
        self.0.purge(Instant::now());
        for e in self
            .0
            .entries
            .iter()
            .filter(|e| e.keys.first() == Some(first))
        {
            let Some(i) = pods.iter().position(|p| *p == e.pod) else {
                continue;
            };
            let common = keys.iter().zip(e.keys.iter()).take_while(|(a, b)| a == b);
            matched[i] = matched[i].max(common.count() as f64);
        }
    }

    /// Adds a decision's keys on its pod; returns the id that marks it landed.
    pub fn add(mut self, pod: PodId, keys: Arc<[BlockKey]>) -> u64 {
        let g = &mut self.0;
        g.next += 1;
        let id = g.next;
        if g.entries.len() >= CAPACITY {
            g.entries.pop_front();
        }
        g.entries.push_back(Entry {
            id,
            pod,
            keys,
            at: Instant::now(),
            landed: None,
        });
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(v: &[u64]) -> Arc<[BlockKey]> {
        v.iter().map(|&k| BlockKey(k)).collect()
    }

    fn overlay(u: &Unrecorded, k: &[u64], pods: &[PodId], start: &[f64]) -> Vec<f64> {
        let mut m = start.to_vec();
        u.hold().overlay(&keys(k), pods, &mut m);
        m
    }

    #[test]
    fn lookups_see_the_longest_unrecorded_prefix_until_shortly_after_it_lands() {
        let u = Unrecorded::default();
        let pods = [PodId::new("a:1"), PodId::new("b:1")];
        let a = u.hold().add(pods[0].clone(), keys(&[1, 2, 3, 4]));
        u.hold().add(pods[1].clone(), keys(&[1, 2, 9]));
        u.hold().add(PodId::new("gone:1"), keys(&[1, 2, 3]));
        let m = overlay(&u, &[1, 2, 3, 5], &pods, &[0.0, 3.0]);
        assert_eq!(m, [3.0, 3.0], "a prefix of 3 on a; b's index answer stays");
        u.landed(a);
        let m = overlay(&u, &[1, 2, 3, 5], &pods, &[0.0, 0.0]);
        assert_eq!(m, [3.0, 2.0], "still counted within the grace");
        // Not synchronization: the grace itself is under test (the clock only moves forward).
        std::thread::sleep(GRACE + Duration::from_millis(20));
        let m = overlay(&u, &[1, 2, 3, 5], &pods, &[0.0, 0.0]);
        assert_eq!(m, [0.0, 2.0], "gone after it");
        let m = overlay(&u, &[7, 2], &pods, &[0.0, 0.0]);
        assert_eq!(m, [0.0, 0.0], "another root");
    }

    #[test]
    fn surplus_entries_are_dropped_oldest_first() {
        let u = Unrecorded::default();
        let pod = PodId::new("a:1");
        for i in 0..(CAPACITY as u64 + 10) {
            u.hold().add(pod.clone(), keys(&[i, 1]));
        }
        assert_eq!(u.len(), CAPACITY);
        let p = [pod];
        assert_eq!(
            overlay(&u, &[0, 1], &p, &[0.0]),
            [0.0],
            "the oldest went first"
        );
        assert_eq!(overlay(&u, &[20, 1], &p, &[0.0]), [2.0]);
    }
}
