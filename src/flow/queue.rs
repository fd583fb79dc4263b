//! The flow-control queue as a plain data structure (no clock, no tasks): priority bands, highest
//! first; within a band, flows served by stride scheduling (each release advances the flow's
//! pass by `1 / weight`, and the flow with the smallest pass goes first), FIFO within a flow.
//! Bounded: `max_queued` entries; past `max_flows` flow queues, new flows share their band's
//! overflow flow; a full queue makes room for a higher priority by dropping the newest entry of
//! the lowest band below it.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque};

/// A flow (tenant) within a band.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FlowId {
    /// A client-named flow (cut to `MAX_FLOW_ID_BYTES`), or "" for requests that name none.
    Named(Box<str>),
    /// New flows once `max_flows` flow queues exist.
    Overflow,
}

/// A pass advance of weight 1; weights are at most 1000, so every stride is at least 1000.
const STRIDE_ONE: u64 = 1_000_000;

struct Flow<T> {
    pass: u64,
    stride: u64,
    entries: VecDeque<(u64, T)>,
}

struct Band<T> {
    flows: HashMap<FlowId, Flow<T>>,
    /// The pass of the flow served last: where a flow joining the band starts.
    vtime: u64,
}

/// Where one queued entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Its id, unique for the queue's life.
    pub seq: u64,
    /// Its band.
    pub priority: i32,
}

/// What became of an arrival.
#[derive(Debug)]
pub enum Pushed<T> {
    /// Queued, possibly in place of a lower-priority entry that was dropped.
    Queued {
        /// The new entry.
        slot: Slot,
        /// The entry dropped to make room (its owner is told).
        evicted: Option<(Slot, T)>,
    },
    /// Full of entries of the arrival's priority or higher: the arrival is returned.
    Full(T),
}

/// The queue; `T` is what a waiter leaves in it.
pub struct Queue<T> {
    bands: BTreeMap<Reverse<i32>, Band<T>>,
    located: HashMap<u64, (i32, FlowId)>,
    flow_queues: usize,
    next_seq: u64,
    max_queued: usize,
    max_flows: usize,
}

impl<T> Queue<T> {
    /// An empty queue of at most `max_queued` entries in at most `max_flows` flow queues.
    pub fn new(max_queued: usize, max_flows: usize) -> Self {
        Self {
            bands: BTreeMap::new(),
            located: HashMap::new(),
            flow_queues: 0,
            next_seq: 0,
            max_queued: max_queued.max(1),
            max_flows: max_flows.max(1),
        }
    }

    /// Entries queued.
    pub fn len(&self) -> usize {
        self.located.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.located.is_empty()
    }

    /// Queues `item` at `priority` in `flow` (weight 1..=1000).
    pub fn push(&mut self, priority: i32, flow: FlowId, weight: u32, item: T) -> Pushed<T> {
        let mut evicted = None;
        if self.len() >= self.max_queued {
            match self.evict_below(priority) {
                Some(e) => evicted = Some(e),
                None => return Pushed::Full(item),
            }
        }
        let band = self.bands.entry(Reverse(priority)).or_insert_with(|| Band {
            flows: HashMap::new(),
            vtime: 0,
        });
        let flow = if band.flows.contains_key(&flow) || self.flow_queues < self.max_flows {
            flow
        } else {
            FlowId::Overflow
        };
        let vtime = band.vtime;
        let f = band.flows.entry(flow.clone()).or_insert_with(|| {
            self.flow_queues += 1;
            Flow {
                pass: vtime,
                stride: STRIDE_ONE / u64::from(weight.clamp(1, 1000)),
                entries: VecDeque::new(),
            }
        });
        let seq = self.next_seq;
        self.next_seq += 1;
        f.entries.push_back((seq, item));
        self.located.insert(seq, (priority, flow));
        Pushed::Queued {
            slot: Slot { seq, priority },
            evicted,
        }
    }

    /// The entry to release next among those `ready` accepts: the highest band first, then the
    /// flow with the smallest pass, then the oldest entry of that flow that is ready.
    pub fn next_ready<'a>(&'a self, mut ready: impl FnMut(&'a T) -> bool) -> Option<Slot> {
        for (Reverse(priority), band) in &self.bands {
            let mut flows: Vec<&'a Flow<T>> = band.flows.values().collect();
            // Ties by the oldest head: deterministic whatever the map's order.
            flows.sort_by_key(|f| (f.pass, f.entries.front().map(|e| e.0)));
            for f in flows {
                if let Some((seq, _)) = f.entries.iter().find(|(_, item)| ready(item)) {
                    return Some(Slot {
                        seq: *seq,
                        priority: *priority,
                    });
                }
            }
        }
        None
    }

    /// Takes entry `seq` out as released: its flow's pass advances.
    pub fn release(&mut self, seq: u64) -> Option<T> {
        self.take(seq, true)
    }

    /// Takes entry `seq` out without serving it (its waiter left or was refused).
    pub fn remove(&mut self, seq: u64) -> Option<T> {
        self.take(seq, false)
    }

    fn take(&mut self, seq: u64, served: bool) -> Option<T> {
        let (priority, flow) = self.located.remove(&seq)?;
        let band = self.bands.get_mut(&Reverse(priority))?;
        let f = band.flows.get_mut(&flow)?;
        let at = f.entries.iter().position(|e| e.0 == seq)?;
        let (_, item) = f.entries.remove(at)?;
        if served {
            band.vtime = band.vtime.max(f.pass);
            f.pass += f.stride;
        }
        if f.entries.is_empty() {
            band.flows.remove(&flow);
            self.flow_queues -= 1;
            if band.flows.is_empty() {
                self.bands.remove(&Reverse(priority));
            }
        }
        Some(item)
    }

    /// Drops the newest entry of the lowest band below `priority`, if there is one.
    fn evict_below(&mut self, priority: i32) -> Option<(Slot, T)> {
        let (Reverse(lowest), band) = self.bands.iter().next_back()?;
        if *lowest >= priority {
            return None;
        }
        let lowest = *lowest;
        let seq = band
            .flows
            .values()
            .filter_map(|f| f.entries.back().map(|e| e.0))
            .max()?;
        let item = self.remove(seq)?;
        Some((
            Slot {
                seq,
                priority: lowest,
            },
            item,
        ))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn named(s: &str) -> FlowId {
        FlowId::Named(s.into())
    }

    fn queued<T: std::fmt::Debug>(p: Pushed<T>) -> Slot {
        match p {
            Pushed::Queued { slot, .. } => slot,
            Pushed::Full(_) => panic!("full"),
        }
    }

    /// Releases everything `ready` accepts, in order.
    fn drain<T: Clone>(q: &mut Queue<T>, ready: impl Fn(&T) -> bool) -> Vec<T> {
        let mut out = Vec::new();
        while let Some(s) = q.next_ready(&ready) {
            out.push(q.release(s.seq).unwrap());
        }
        out
    }

    #[test]
    fn higher_priorities_leave_first_and_fifo_within_a_flow() {
        let mut q = Queue::new(16, 16);
        for (p, name) in [
            (0, "low1"),
            (5, "high1"),
            (0, "low2"),
            (5, "high2"),
            (-1, "bg"),
        ] {
            queued(q.push(p, named(""), 1, name));
        }
        assert_eq!(
            drain(&mut q, |_| true),
            ["high1", "high2", "low1", "low2", "bg"]
        );
        assert!(q.is_empty());
        assert_eq!(q.flow_queues, 0);
    }

    #[test]
    fn flows_share_a_band_by_weight() {
        let mut q = Queue::new(64, 16);
        // The heavy tenant queues 20 first; the light one's 5 still interleave 1:1.
        for i in 0..20 {
            queued(q.push(0, named("heavy"), 1, format!("h{i}")));
        }
        for i in 0..5 {
            queued(q.push(0, named("light"), 1, format!("l{i}")));
        }
        let order = drain(&mut q, |_| true);
        let light_at: Vec<usize> = (0..5)
            .map(|i| order.iter().position(|s| *s == format!("l{i}")).unwrap())
            .collect();
        assert!(light_at[4] <= 10, "light tenant starved: {order:?}");
        // Weight 3 against 1: three releases to one while both wait.
        let mut q = Queue::new(64, 16);
        for i in 0..12 {
            queued(q.push(0, named("a"), 3, format!("a{i}")));
            queued(q.push(0, named("b"), 1, format!("b{i}")));
        }
        let first8: Vec<String> = drain(&mut q, |_| true).into_iter().take(8).collect();
        let a = first8.iter().filter(|s| s.starts_with('a')).count();
        assert_eq!(a, 6, "{first8:?}");
    }

    #[test]
    fn an_entry_without_room_does_not_block_others() {
        let mut q = Queue::new(16, 16);
        queued(q.push(5, named(""), 1, ("model-a", 1)));
        queued(q.push(0, named(""), 1, ("model-b", 2)));
        queued(q.push(0, named(""), 1, ("model-a", 3)));
        let got = drain(&mut q, |(m, _)| *m == "model-b");
        assert_eq!(got, [("model-b", 2)]);
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn a_full_queue_sheds_the_newest_lowest_or_refuses() {
        let mut q = Queue::new(3, 16);
        queued(q.push(0, named(""), 1, "a"));
        queued(q.push(-1, named(""), 1, "old-bg"));
        queued(q.push(-1, named(""), 1, "new-bg"));
        match q.push(0, named(""), 1, "b") {
            Pushed::Queued {
                evicted: Some((slot, item)),
                ..
            } => {
                assert_eq!((slot.priority, item), (-1, "new-bg"));
            }
            other => panic!("{other:?}"),
        }
        // Same or lower priority than everything queued: refused.
        assert!(matches!(q.push(-1, named(""), 1, "c"), Pushed::Full("c")));
        assert_eq!(q.len(), 3);
        assert_eq!(drain(&mut q, |_| true), ["a", "b", "old-bg"]);
    }

    #[test]
    fn flows_past_the_limit_share_the_overflow_flow() {
        let mut q = Queue::new(16, 2);
        queued(q.push(0, named("a"), 1, 1));
        queued(q.push(0, named("b"), 1, 2));
        let s = queued(q.push(0, named("c"), 1, 3));
        queued(q.push(0, named("d"), 1, 4));
        assert_eq!(q.located[&s.seq].1, FlowId::Overflow);
        assert_eq!(q.flow_queues, 3);
        assert_eq!(q.remove(s.seq), Some(3));
        assert_eq!(q.remove(s.seq), None);
        assert_eq!(drain(&mut q, |_| true).len(), 3);
        assert_eq!(q.flow_queues, 0);
    }

    proptest! {
        // Whatever the pushes, removals and releases, the queue stays bounded, loses nothing and
        // releases in non-increasing priority when everything is ready.
        #[test]
        fn bounded_and_ordered(
            ops in prop::collection::vec((any::<bool>(), -2i32..3, 0u8..6, 1u32..4), 1..200),
        ) {
            let mut q = Queue::new(8, 3);
            let mut live: Vec<u64> = Vec::new();
            for (i, &(push, p, flow, w)) in ops.iter().enumerate() {
                if push || live.is_empty() {
                    match q.push(p, named(&flow.to_string()), w, i) {
                        Pushed::Queued { slot, evicted: e } => {
                            live.push(slot.seq);
                            if let Some((s, _)) = e {
                                prop_assert!(s.priority < p);
                                live.retain(|x| *x != s.seq);
                            }
                        }
                        Pushed::Full(_) => prop_assert_eq!(q.len(), 8),
                    }
                } else {
                    let seq = live.remove(usize::from(flow) % live.len());
                    prop_assert!(q.remove(seq).is_some());
                }
                prop_assert!(q.len() <= 8);
                // Each band may add its own overflow flow; every flow queue holds an entry.
                prop_assert!(q.flow_queues <= (3 + q.bands.len()).min(q.len()));
                prop_assert_eq!(q.len(), live.len());
            }
            let mut last = i32::MAX;
            while let Some(s) = q.next_ready(|_| true) {
                prop_assert!(s.priority <= last);
                last = s.priority;
                prop_assert!(q.release(s.seq).is_some());
            }
            prop_assert!(q.is_empty());
            prop_assert!(q.bands.is_empty());
        }
    }
}
