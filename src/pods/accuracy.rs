//! Prediction accuracy: the prefix-cache hits this router predicted for a pod against the hits
//! the pod's own counters report, per scrape window (metrics and `/debug/pods`), and the engine
//! restarts those counters reveal.
//!
//! Rates, not token counts, are compared (predicted hits / prompt tokens routed against reported
//! hits / prompt tokens looked up): the pod also serves traffic this replica did not route (other
//! replicas, direct clients), and text blocks only estimate tokens; both cancel out of a rate.
//! Pure: no clock, no locks; [`super::Pod`] holds one behind its mutex, the simulator one per pod.

use std::collections::VecDeque;

use serde::Serialize;

/// Scrape windows the reported accuracy spans.
pub const WINDOWS: usize = 8;

/// A pod's cumulative prefix-cache counters in tokens (vLLM `vllm:prefix_cache_queries_total`,
/// `vllm:prefix_cache_hits_total`), summed over its ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PrefixCounters {
    /// Prompt tokens looked up in the prefix cache.
    pub queries: f64,
    /// Of those, tokens found.
    pub hits: f64,
}

/// Tokens over one or more scrape windows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct HitWindow {
    /// Prompt tokens this router routed to the pod.
    pub routed: f64,
    /// Of those, the tokens it predicted the pod holds.
    pub predicted: f64,
    /// Prompt tokens the pod looked up (all its traffic).
    pub queries: f64,
    /// Of those, the tokens the pod found.
    pub observed: f64,
}

impl HitWindow {
    fn add(&mut self, o: &HitWindow) {
        self.routed += o.routed;
        self.predicted += o.predicted;
        self.queries += o.queries;
        self.observed += o.observed;
    }

    /// Predicted hits per routed prompt token.
    pub fn predicted_rate(&self) -> Option<f64> {
        (self.routed > 0.0).then(|| self.predicted / self.routed)
    }

    /// Reported hits per looked-up prompt token.
    pub fn observed_rate(&self) -> Option<f64> {
        (self.queries > 0.0).then(|| self.observed / self.queries)
    }

    /// Observed rate over predicted rate (1: the router's view is right; below: it predicts hits
    /// the pod does not have); `None` until both rates exist and some hit was predicted.
    pub fn accuracy(&self) -> Option<f64> {
        let p = self.predicted_rate().filter(|p| *p > 0.0)?;
        Some(self.observed_rate()? / p)
    }
}

/// What `/debug/pods` shows of a pod's accuracy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AccuracyReport {
    /// The last [`WINDOWS`] scrape windows summed.
    pub recent: HitWindow,
    /// `recent.accuracy()`.
    pub accuracy: Option<f64>,
    /// Times the pod's counters went backwards (an engine restart).
    pub counter_resets: u64,
}

/// One pod's predicted and reported hits.
#[derive(Debug, Clone)]
pub struct HitAccuracy {
    /// Predictions since the last scrape.
    pending: HitWindow,
    /// The counters of the last scrape that had them.
    last: Option<PrefixCounters>,
    /// The last [`WINDOWS`] windows, newest last.
    recent: VecDeque<HitWindow>,
    /// Windows not exported yet as metric counters.
    unexported: HitWindow,
    resets: u64,
    /// Counters went backwards since [`HitAccuracy::take_restart`] last looked.
    restarted: bool,
}

impl Default for HitAccuracy {
    fn default() -> Self {
        Self {
            pending: HitWindow::default(),
            last: None,
            recent: VecDeque::with_capacity(WINDOWS),
            unexported: HitWindow::default(),
            resets: 0,
            restarted: false,
        }
    }
}

impl HitAccuracy {
    /// A decision sent `prompt_tokens` to the pod, `hit_tokens` of them predicted cached.
    pub fn predicted(&mut self, hit_tokens: u64, prompt_tokens: u64) {
        self.pending.routed += prompt_tokens as f64;
        self.pending.predicted += hit_tokens.min(prompt_tokens) as f64;
    }

    /// A scrape read `counters` (`None`: the engine reports none). Closes the window since the
    /// previous scrape and returns it; the first scrape with counters only sets the baseline.
    pub fn observe(&mut self, counters: Option<PrefixCounters>) -> Option<HitWindow> {
        let now = counters?;
        let pending = std::mem::take(&mut self.pending);
        let last = self.last.replace(now)?;
        // Counters that went backwards restarted from zero with the engine.
        let restarted = now.queries < last.queries || now.hits < last.hits;
        let (queries, observed) = if restarted {
            self.resets += 1;
            self.restarted = true;
            (now.queries, now.hits)
        } else {
            (now.queries - last.queries, now.hits - last.hits)
        };
        let w = HitWindow {
            queries,
            observed,
            ..pending
        };
        if self.recent.len() == WINDOWS {
            self.recent.pop_front();
        }
        self.recent.push_back(w);
        self.unexported.add(&w);
        Some(w)
    }

    /// Whether the pod's counters went backwards (its engine restarted, its cache empty) since
    /// the last call.
    pub fn take_restart(&mut self) -> bool {
        std::mem::take(&mut self.restarted)
    }

    /// The windows closed since the last call (for metric counters).
    pub fn take_unexported(&mut self) -> HitWindow {
        std::mem::take(&mut self.unexported)
    }

    /// The last windows' accuracy.
    pub fn report(&self) -> AccuracyReport {
        let mut recent = HitWindow::default();
        for w in &self.recent {
            recent.add(w);
        }
        AccuracyReport {
            recent,
            accuracy: recent.accuracy(),
            counter_resets: self.resets,
        }
    }
}

/// The prompt tokens a decision predicts its pod holds: its matched blocks in tokens, capped as
/// vLLM caps a hit (the last prompt token is always computed, and hits are whole blocks).
pub fn predicted_hit_tokens(
    matched_blocks: f64,
    tokens_per_block: usize,
    prompt_tokens: u64,
) -> u64 {
    let bs = tokens_per_block.max(1) as u64;
    let most = prompt_tokens.saturating_sub(1) / bs * bs;
    ((matched_blocks.max(0.0) * bs as f64) as u64).min(most)
}

#[cfg(test)]
#[path = "accuracy_tests.rs"]
mod tests;
