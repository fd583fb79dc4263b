//! LoRA adapters per pod: which adapters a pod's engine has running or waiting (vLLM's
//! `vllm:lora_requests_info` info gauge), which adapters it lists in `/v1/models` with their base
//! model, and which pods may take a request for an adapter (`docs/lora.md`).
//!
//! Bounded: one pass over a scrape already capped at `pods.max_response_bytes`, at most
//! [`MAX_LORA_SERIES`] series looked at, [`MAX_POD_ADAPTERS`] names kept per set, names over
//! [`MAX_LORA_NAME_BYTES`] dropped.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use serde::Serialize;
use tokio::time::Instant;

use super::exposition::{label, split_sample};
use super::Pod;
use crate::config::MAX_LORA_NAME_BYTES;

/// Series of the info gauge one scrape may show before the rest are ignored (vLLM keeps one
/// series per label set it ever set, so a long-running engine shows many).
pub const MAX_LORA_SERIES: usize = 10_000;

/// Recently used adapters remembered per pod (more than any engine's adapter slots).
pub const MAX_RECENT_ADAPTERS: usize = 64;

/// Adapter names kept per set (running, waiting) and adapters kept from one `/v1/models`.
pub const MAX_POD_ADAPTERS: usize = 256;

/// A pod's adapter residency from its newest `lora_requests_info` series.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LoraResidency {
    /// Adapter slots (`max_lora`); `None` when the label is missing or not a number.
    pub max_lora: Option<u32>,
    /// Adapters of running requests.
    pub running: BTreeSet<String>,
    /// Adapters of waiting requests.
    pub waiting: BTreeSet<String>,
    /// The series' value: the Unix time (seconds) the engine last set it.
    pub at: f64,
}

/// How a pod would take a request for one adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraFit {
    /// The adapter is running or waiting there: no load needed.
    Resident,
    /// Fewer distinct adapters than slots: it loads without evicting.
    FreeSlot,
    /// No fresh residency report (LoRA off, another engine, stale scrape).
    Unreported,
    /// Every slot holds another adapter: it would have to evict (or wait).
    Evicts,
}

impl LoraResidency {
    /// How this pod would take a request for `adapter`, from this report alone.
    pub fn fit(&self, adapter: &str) -> LoraFit {
        self.fit_with(adapter, &VecDeque::new())
    }

    /// How this pod would take a request for `adapter`, given the adapters it used most
    /// recently (`recent`, newest first). The gauge names only adapters with requests; vLLM
    /// keeps idle ones loaded until a slot is needed (least recently used first), so the
    /// newest idle ones fill the slots the busy ones leave.
    pub fn fit_with(&self, adapter: &str, recent: &VecDeque<String>) -> LoraFit {
        let busy = |a: &str| self.running.contains(a) || self.waiting.contains(a);
        if busy(adapter) {
            return LoraFit::Resident;
        }
        let Some(slots) = self.max_lora else {
            return LoraFit::FreeSlot;
        };
        let used = self.running.union(&self.waiting).count();
        let idle: Vec<&String> = recent
            .iter()
            .filter(|a| !busy(a))
            .take((slots as usize).saturating_sub(used))
            .collect();
        if idle.iter().any(|a| *a == adapter) {
            LoraFit::Resident
        } else if used + idle.len() < slots as usize {
            LoraFit::FreeSlot
        } else {
            LoraFit::Evicts
        }
    }

    /// Adapters in `self.running` that `before` did not run: loads since that scrape.
    pub fn loads_since(&self, before: &LoraResidency) -> u64 {
        self.running.difference(&before.running).count() as u64
    }
}

/// Reads the newest series of info gauge `name` (highest value; a later line wins a tie).
/// `None` when the scrape has no valid series of it.
pub fn read_lora_info(text: &str, name: &str) -> Option<LoraResidency> {
    // Cheap reject: most scrapes of pods without LoRA never mention the name.
    if !text.contains(name) {
        return None;
    }
    let mut best: Option<(f64, &str)> = None;
    let mut seen = 0usize;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((n, labels, value)) = split_sample(line) else {
            continue;
        };
        if n != name {
            continue;
        }
        seen += 1;
        if seen > MAX_LORA_SERIES {
            break;
        }
        if value.is_finite() && value >= 0.0 && best.is_none_or(|(b, _)| value >= b) {
            best = Some((value, labels));
        }
    }
    let (at, labels) = best?;
    Some(LoraResidency {
        max_lora: label(labels, "max_lora").and_then(|v| v.trim().parse().ok()),
        running: names(label(labels, "running_lora_adapters").unwrap_or("")),
        waiting: names(label(labels, "waiting_lora_adapters").unwrap_or("")),
        at,
    })
}

/// A comma-separated adapter list as a set: empty and over-long names dropped, at most
/// [`MAX_POD_ADAPTERS`] kept.
fn names(list: &str) -> BTreeSet<String> {
    list.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty() && n.len() <= MAX_LORA_NAME_BYTES)
        .take(MAX_POD_ADAPTERS)
        .map(str::to_string)
        .collect()
}

/// A pod's LoRA state: its last residency report, adapter loads not yet exported, and what its
/// `/v1/models` lists: adapters (adapter → base model) and base models.
#[derive(Debug, Default)]
pub(crate) struct LoraState {
    pub residency: Option<(Instant, Arc<LoraResidency>)>,
    /// Adapters the pod used most recently, newest first: seen busy in a scrape, or routed here.
    pub recent: VecDeque<String>,
    pub unexported_loads: u64,
    pub adapters: BTreeMap<String, String>,
    pub bases: BTreeSet<String>,
}

impl LoraState {
    /// Stores a scrape's report; an adapter newly running counts as one load.
    pub fn record(&mut self, at: Instant, report: Option<LoraResidency>) {
        let Some(new) = report else {
            self.residency = None;
            return;
        };
        if let Some((_, old)) = &self.residency {
            self.unexported_loads = self.unexported_loads.saturating_add(new.loads_since(old));
        }
        for a in new.waiting.iter().chain(&new.running) {
            self.used(a);
        }
        self.residency = Some((at, Arc::new(new)));
    }

    /// `adapter` was just used on the pod: first in [`LoraState::recent`].
    pub fn used(&mut self, adapter: &str) {
        mark_used(&mut self.recent, adapter);
    }
}

/// Moves `adapter` to the front of a pod's recently used adapters (newest first, at most
/// [`MAX_RECENT_ADAPTERS`]): the live pod's and the simulator's one rule.
pub fn mark_used(recent: &mut VecDeque<String>, adapter: &str) {
    if let Some(i) = recent.iter().position(|a| a == adapter) {
        if let Some(a) = recent.remove(i) {
            recent.push_front(a);
        }
        return;
    }
    if recent.len() >= MAX_RECENT_ADAPTERS {
        recent.pop_back();
    }
    recent.push_front(adapter.to_string());
}

/// Keeps the adapters of a `/v1/models` answer: `(id, parent)` pairs with a parent, bounded.
pub fn listed_adapters<I>(cards: I) -> BTreeMap<String, String>
where
    I: IntoIterator<Item = (String, Option<String>)>,
{
    let ok = |s: &str| !s.is_empty() && s.len() <= MAX_LORA_NAME_BYTES;
    cards
        .into_iter()
        .filter_map(|(id, parent)| Some((id, parent?)))
        .filter(|(id, parent)| ok(id) && ok(parent) && id != parent)
        .take(MAX_POD_ADAPTERS)
        .collect()
}

/// The base models of a `/v1/models` answer: ids of cards without a parent, bounded.
pub fn listed_bases(cards: &[(String, Option<String>)]) -> BTreeSet<String> {
    cards
        .iter()
        .filter(|(id, parent)| {
            parent.is_none() && !id.is_empty() && id.len() <= MAX_LORA_NAME_BYTES
        })
        .take(MAX_POD_ADAPTERS)
        .map(|(id, _)| id.clone())
        .collect()
}

/// What `/debug/pods` shows of a pod's adapters.
#[derive(Debug, Clone, Serialize)]
pub struct LoraReport {
    /// The newest residency report, if any.
    pub residency: Option<Arc<LoraResidency>>,
    /// Milliseconds since that report's scrape.
    pub residency_age_ms: Option<u64>,
    /// Adapters `/v1/models` lists, with their base model.
    pub adapters: BTreeMap<String, String>,
}

/// The base model of `model` if it names a LoRA adapter: the parent some pod lists for it,
/// else `configured` (`scorers.lora.adapters`). `None`: a base model (or unknown). An adapter
/// never shadows a base model: a model some pod serves as one (lists without a parent) or that
/// `configured` names as one is never an adapter, whatever another pod lists.
pub fn adapter_base(
    model: &str,
    pods: &[&Arc<Pod>],
    configured: &BTreeMap<String, String>,
) -> Option<String> {
    let base = pods
        .iter()
        .find_map(|p| p.adapter_parent(model))
        .or_else(|| configured.get(model).cloned())?;
    let a_base_model =
        pods.iter().any(|p| p.serves_as_base(model)) || configured.values().any(|b| b == model);
    (!a_base_model).then_some(base)
}

/// The pods that may take a request for `model`. A base model (or none): those that serve it.
/// An adapter: those that list it, else (loaded on demand) those that serve its base model.
pub fn serving(
    pods: Vec<&Arc<Pod>>,
    model: Option<&str>,
    configured: &BTreeMap<String, String>,
) -> Vec<Arc<Pod>> {
    let keep = |f: &dyn Fn(&Pod) -> bool| -> Vec<Arc<Pod>> {
        pods.iter()
            .filter(|p| f(p))
            .map(|p| Arc::clone(p))
            .collect()
    };
    let Some(m) = model else {
        return keep(&|_| true);
    };
    let Some(base) = adapter_base(m, &pods, configured) else {
        return keep(&|p| p.serves(Some(m)));
    };
    let listing = keep(&|p| p.lists_model(m));
    if !listing.is_empty() {
        return listing;
    }
    keep(&|p| p.serves(Some(&base)))
}

/// Each pod's fit for a request of `model` when it names an adapter (`None`: a base-model
/// request, which LoRA scoring leaves alone). Reports older than `stale_after` count as none.
pub fn fits(
    model: Option<&str>,
    pods: &[Arc<Pod>],
    configured: &BTreeMap<String, String>,
    now: Instant,
    stale_after: std::time::Duration,
) -> Option<Vec<LoraFit>> {
    let m = model?;
    let refs: Vec<&Arc<Pod>> = pods.iter().collect();
    adapter_base(m, &refs, configured)?;
    Some(
        pods.iter()
            .map(|p| p.lora_fit(m, now, stale_after))
            .collect(),
    )
}

#[cfg(test)]
#[path = "lora_tests.rs"]
mod tests;
