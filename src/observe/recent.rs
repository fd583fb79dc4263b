//! The last decisions' summaries, by id, in fixed memory: slot `id % capacity` (ids count up,
//! so each new decision takes the oldest slot). A summary holds no prompt text and at most 8
//! candidates, so the ring costs about a kilobyte per slot at most.

use parking_lot::Mutex;

use super::{Observed, Summary};

/// A ring of recent decisions' summaries.
pub struct Recent {
    slots: Mutex<Vec<Option<Summary>>>,
}

impl Recent {
    /// A ring of `capacity` (at least 1) decisions.
    pub fn new(capacity: usize) -> Self {
        Self {
            slots: Mutex::new(vec![None; capacity.max(1)]),
        }
    }

    fn slot(len: usize, id: u64) -> usize {
        (id % len as u64) as usize
    }

    /// Keeps `s`, in place of the oldest.
    pub fn record(&self, s: Summary) {
        let mut slots = self.slots.lock();
        let i = Self::slot(slots.len(), s.id);
        slots[i] = Some(s);
    }

    /// Adds the engine's report to decision `id`, if it is still kept.
    pub fn observe(&self, id: u64, o: Observed) {
        let mut slots = self.slots.lock();
        let i = Self::slot(slots.len(), id);
        if let Some(s) = slots[i].as_mut().filter(|s| s.id == id) {
            s.observed = Some(o);
        }
    }

    /// Decision `id`, if it is still kept.
    pub fn get(&self, id: u64) -> Option<Summary> {
        let slots = self.slots.lock();
        slots[Self::slot(slots.len(), id)]
            .as_ref()
            .filter(|s| s.id == id)
            .cloned()
    }
}
