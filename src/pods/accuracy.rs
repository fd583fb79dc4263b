//! Prediction accuracy: the prefix-cache hits this router predicted for a pod against the hits
//! the pod's own counters report, per scrape window, and the capacity scale the approximate index
//! applies to the pod when the two disagree.
//!
//! Rates, not token counts, are compared (predicted hits / prompt tokens routed against reported
//! hits / prompt tokens looked up): the pod also serves traffic this replica did not route (other
//! replicas, direct clients), and text blocks only estimate tokens; both cancel out of a rate.
//! Pure: no clock, no locks; [`super::Pod`] holds one behind its mutex, the simulator one per pod.

use std::collections::VecDeque;

use serde::Serialize;

use crate::config::CorrectionConfig;

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

    /// [`Self::accuracy`] with the pod's hits on traffic this router did not route (its lookups
    /// beyond the tokens routed to it) credited to this router's predictions. That traffic can
    /// only dilute the pod's rate, so a shortfall left after crediting is this router's view
    /// being wrong, not other clients' misses.
    pub fn credited_accuracy(&self) -> Option<f64> {
        let r = self.accuracy()?;
        Some(r * (self.queries / self.routed).max(1.0))
    }
}

/// What `/debug/pods` shows of a pod's accuracy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AccuracyReport {
    /// The last [`WINDOWS`] scrape windows summed.
    pub recent: HitWindow,
    /// `recent.accuracy()`.
    pub accuracy: Option<f64>,
    /// The fraction of its configured capacity the pod's index entries are held to.
    pub capacity_scale: f64,
    /// Times the pod's counters went backwards (an engine restart).
    pub counter_resets: u64,
}

/// One pod's predicted and reported hits, and the capacity scale derived from them.
#[derive(Debug, Clone)]
pub struct HitAccuracy {
    /// Predictions since the last scrape.
    pending: HitWindow,
    /// The counters of the last scrape that had them.
    last: Option<PrefixCounters>,
    /// The last [`WINDOWS`] windows, newest last.
    recent: VecDeque<HitWindow>,
    /// Windows not judged yet by [`HitAccuracy::correct`], and the decisions in them.
    unjudged: HitWindow,
    unjudged_decisions: u64,
    /// Decisions since the last scrape.
    pending_decisions: u64,
    /// Windows not exported yet as metric counters.
    unexported: HitWindow,
    scale: f64,
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
            unjudged: HitWindow::default(),
            unjudged_decisions: 0,
            pending_decisions: 0,
            unexported: HitWindow::default(),
            scale: 1.0,
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
        self.pending_decisions += 1;
    }

    /// A scrape read `counters` (`None`: the engine reports none). Closes the window since the
    /// previous scrape and returns it; the first scrape with counters only sets the baseline.
    pub fn observe(&mut self, counters: Option<PrefixCounters>) -> Option<HitWindow> {
        let now = counters?;
        let pending = std::mem::take(&mut self.pending);
        let decisions = std::mem::take(&mut self.pending_decisions);
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
        if restarted {
            // Predictions made before the restart against an empty cache say nothing of its size.
            self.unjudged = HitWindow::default();
            self.unjudged_decisions = 0;
        } else {
            self.unjudged.add(&w);
            self.unjudged_decisions += decisions;
        }
        self.unexported.add(&w);
        Some(w)
    }

    /// Judges the windows seen since the last judgement once they hold `min_predicted_tokens`
    /// predicted hits and `min_decisions` decisions, and returns the capacity scale. Outside
    /// `1 ± tolerance` of the credited observed/predicted ratio the scale moves by the ratio's
    /// square root, at most `max_step` either way, within `[min_scale, 1]`, or up to `max_scale`
    /// where the pod's own, uncredited ratio is above the band too. Disabled: always 1.
    pub fn correct(&mut self, cfg: &CorrectionConfig) -> f64 {
        if !cfg.enabled {
            self.scale = 1.0;
            return 1.0;
        }
        let min = cfg.min_predicted_tokens as f64;
        let w = self.unjudged;
        if w.predicted < min || self.unjudged_decisions < cfg.min_decisions {
            // A pod routed plenty but predicted no hits teaches nothing; start afresh.
            if w.predicted < min && w.routed >= 16.0 * min {
                self.unjudged = HitWindow::default();
                self.unjudged_decisions = 0;
            }
            return self.scale;
        }
        self.unjudged = HitWindow::default();
        self.unjudged_decisions = 0;
        let (Some(r), Some(own)) = (w.credited_accuracy(), w.accuracy()) else {
            return self.scale;
        };
        if (r - 1.0).abs() > cfg.tolerance {
            // Past the configured capacity only the pod's own rate, uncredited, may grow the
            // index: other clients' hits say the pod holds their prefixes, not this router's.
            let ceiling = if own > 1.0 + cfg.tolerance {
                cfg.max_scale
            } else {
                self.scale.max(1.0)
            };
            // Damped and symmetric: a judgement rests on a few dozen decisions, and full steps
            // that shrink on noise but grow back slowly ratchet a right-sized index down.
            let step = r.sqrt().clamp(1.0 / cfg.max_step, cfg.max_step);
            self.scale = (self.scale * step).clamp(cfg.min_scale, ceiling.max(cfg.min_scale));
        }
        self.scale
    }

    /// Whether the pod's counters went backwards (its engine restarted, its cache empty) since
    /// the last call.
    pub fn take_restart(&mut self) -> bool {
        std::mem::take(&mut self.restarted)
    }

    /// The fraction of its configured capacity the pod's index entries are held to.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// In precise mode, the weight the pod's index matches get: events already say what the pod
    /// holds, so only a shortfall (a scale below 1) is applied.
    pub fn confidence(&self) -> f64 {
        self.scale.min(1.0)
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
            capacity_scale: self.scale,
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

/// A pod's index capacity once scaled (at least one block).
pub fn scaled_capacity(blocks: usize, scale: f64) -> usize {
    ((blocks as f64 * scale) as usize).max(1)
}

#[cfg(test)]
#[path = "accuracy_tests.rs"]
mod tests;
