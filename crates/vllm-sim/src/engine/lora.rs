//! LoRA adapter slots, as vLLM schedules them: at most `max_loras` adapters are resident on the
//! GPU; a request whose adapter is not resident takes a free slot or evicts the least recently
//! used idle adapter (one without running requests), else it waits; the first request to reach
//! the prefill lane after a load pays the load time.
//!
//! Also the per-adapter request counts behind `vllm:lora_requests_info` and the label sets the
//! engine has published (vLLM's gauge keeps every label set it ever set, each with the Unix time
//! it was last set; the newest one is the current state).

use std::sync::Arc;

/// An adapter, by the name requests use (`model`).
pub type AdapterName = Arc<str>;

/// Label sets kept for `vllm:lora_requests_info`; the oldest beyond this are dropped so a long
/// benchmark's `/metrics` stays small (vLLM keeps them all).
pub const MAX_LORA_SERIES: usize = 64;

/// Adapter scheduling parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Adapters resident at once (vLLM's `--max-loras`; at least 1).
    pub max_loras: usize,
    /// Time to load an adapter into a slot, microseconds.
    pub load_us: f64,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            max_loras: 1,
            load_us: 50_000.0,
        }
    }
}

/// One `vllm:lora_requests_info` label set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraSeries {
    /// Adapters with running requests, comma-joined.
    pub running: String,
    /// Adapters with waiting requests, comma-joined.
    pub waiting: String,
    /// When it was last set: engine time in microseconds (Unix microseconds once the actor
    /// hands it out).
    pub at_us: u64,
}

/// What `/metrics` shows about adapters.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LoraInfo {
    /// `max_lora` label.
    pub max_loras: usize,
    /// Label sets in the order they were first set.
    pub series: Vec<LoraSeries>,
    /// Resident adapters, most recently used first.
    pub resident: Vec<String>,
}

#[derive(Debug)]
struct Slot {
    name: AdapterName,
    /// Whether the load has been paid (a slot is reserved at admission, loaded at the lane).
    loaded: bool,
    /// Running requests using it; a slot with none can be evicted.
    running: usize,
    last_used: u64,
}

/// Requests of one adapter, as vLLM's per-adapter request states count them.
#[derive(Debug)]
struct Active {
    name: AdapterName,
    waiting: usize,
    running: usize,
}

/// The adapter state of an engine.
#[derive(Debug)]
pub(super) struct Loras {
    pub(super) cfg: LoraConfig,
    slots: Vec<Slot>,
    /// Adapters with requests, in order of first activity (the order vLLM joins names in).
    active: Vec<Active>,
    series: Vec<LoraSeries>,
    current: Option<usize>,
    /// The request counts changed since the current label set was computed.
    dirty: bool,
    pub(super) loads: u64,
    pub(super) evictions: u64,
}

impl Loras {
    pub(super) fn new(cfg: LoraConfig) -> Self {
        let cfg = LoraConfig {
            max_loras: cfg.max_loras.max(1),
            load_us: if cfg.load_us.is_finite() {
                cfg.load_us.max(0.0)
            } else {
                0.0
            },
        };
        Self {
            cfg,
            slots: Vec::new(),
            active: Vec::new(),
            series: Vec::new(),
            current: None,
            dirty: true,
            loads: 0,
            evictions: 0,
        }
    }

    /// Whether a request for `name` could start running now.
    pub(super) fn admissible(&self, name: &str) -> bool {
        self.slots.len() < self.cfg.max_loras
            || self
                .slots
                .iter()
                .any(|s| &*s.name == name || s.running == 0)
    }

    /// A request for `name` arrived (waiting).
    pub(super) fn arrive(&mut self, name: &AdapterName) {
        self.dirty = true;
        match self.active.iter_mut().find(|a| a.name == *name) {
            Some(a) => a.waiting += 1,
            None => self.active.push(Active {
                name: name.clone(),
                waiting: 1,
                running: 0,
            }),
        }
    }

    /// A waiting request for `name` starts running: it gets its adapter's slot, a free one, or
    /// the least recently used idle one. Call only when [`Loras::admissible`].
    pub(super) fn admit(&mut self, name: &AdapterName, now: u64) {
        self.dirty = true;
        if let Some(a) = self.active.iter_mut().find(|a| a.name == *name) {
            a.waiting = a.waiting.saturating_sub(1);
            a.running += 1;
        }
        if let Some(slot) = self.slots.iter_mut().find(|s| s.name == *name) {
            slot.running += 1;
            slot.last_used = now;
            return;
        }
        let fresh = Slot {
            name: name.clone(),
            loaded: false,
            running: 1,
            last_used: now,
        };
        if self.slots.len() < self.cfg.max_loras {
            self.slots.push(fresh);
            return;
        }
        let victim = self
            .slots
            .iter_mut()
            .filter(|s| s.running == 0)
            .min_by_key(|s| s.last_used);
        if let Some(victim) = victim {
            if victim.loaded {
                self.evictions += 1;
            }
            *victim = fresh;
        }
    }

    /// The request for `name` reaches the prefill lane: returns the load time it pays, if its
    /// adapter is not loaded yet.
    pub(super) fn take_load(&mut self, name: &str) -> u64 {
        match self.slots.iter_mut().find(|s| &*s.name == name) {
            Some(slot) if !slot.loaded => {
                slot.loaded = true;
                self.loads += 1;
                self.cfg.load_us.round() as u64
            }
            _ => 0,
        }
    }

    /// A request for `name` left (finished or cancelled), running or still waiting.
    pub(super) fn leave(&mut self, name: &str, was_running: bool, now: u64) {
        self.dirty = true;
        if let Some(i) = self.active.iter().position(|a| &*a.name == name) {
            let a = &mut self.active[i];
            if was_running {
                a.running = a.running.saturating_sub(1);
            } else {
                a.waiting = a.waiting.saturating_sub(1);
            }
            if a.running == 0 && a.waiting == 0 {
                self.active.remove(i);
            }
        }
        if was_running {
            if let Some(slot) = self.slots.iter_mut().find(|s| &*s.name == name) {
                slot.running = slot.running.saturating_sub(1);
                slot.last_used = now;
            }
        }
    }

    /// Sets the current label set to `now`, as vLLM does on every engine step. Timestamps
    /// strictly increase, so the newest label set is always the current one.
    pub(super) fn record(&mut self, now: u64) {
        let last = self.series.iter().map(|s| s.at_us).max();
        let at = match last {
            Some(l) if l >= now => l + 1,
            _ => now,
        };
        if self.dirty || self.current.is_none() {
            self.dirty = false;
            let join = |f: fn(&Active) -> usize| {
                let names: Vec<&str> = self
                    .active
                    .iter()
                    .filter(|a| f(a) > 0)
                    .map(|a| &*a.name)
                    .collect();
                names.join(",")
            };
            let running = join(|a| a.running);
            let waiting = join(|a| a.waiting);
            let found = self
                .series
                .iter()
                .position(|s| s.running == running && s.waiting == waiting);
            self.current = Some(match found {
                Some(i) => i,
                None => {
                    if self.series.len() >= MAX_LORA_SERIES {
                        let oldest = (0..self.series.len()).min_by_key(|&i| self.series[i].at_us);
                        if let Some(i) = oldest {
                            self.series.remove(i);
                        }
                    }
                    self.series.push(LoraSeries {
                        running,
                        waiting,
                        at_us: at,
                    });
                    self.series.len() - 1
                }
            });
        }
        if let Some(s) = self.current.and_then(|i| self.series.get_mut(i)) {
            s.at_us = at;
        }
    }

    pub(super) fn info(&self) -> LoraInfo {
        let mut resident: Vec<&Slot> = self.slots.iter().collect();
        resident.sort_by_key(|s| std::cmp::Reverse(s.last_used));
        LoraInfo {
            max_loras: self.cfg.max_loras,
            series: self.series.clone(),
            resident: resident.iter().map(|s| s.name.to_string()).collect(),
        }
    }
}
