//! Load scorer: high for idle pods, low for busy ones, from scraped and router-side signals.

use super::{ScoreInput, Scorer};
use crate::config::LoadScorerConfig;

/// `1 − weighted mean of (queue, KV usage, in-flight uncached tokens)`, each in [0, 1].
#[derive(Debug, Clone)]
pub(crate) struct LoadScorer {
    cfg: LoadScorerConfig,
}

impl LoadScorer {
    /// From config.
    pub fn new(cfg: LoadScorerConfig) -> Self {
        Self { cfg }
    }

    /// Load in [0, 1] (1 = fully loaded) of one pod.
    pub fn busy(&self, load: &crate::pods::PodLoad) -> f64 {
        let c = &self.cfg;
        let total = c.queue_weight + c.kv_weight + c.tokens_weight;
        if total <= 0.0 {
            return 0.0;
        }
        let queue = (load.requests() / c.queue_full).min(1.0);
        let kv = load.kv_usage.clamp(0.0, 1.0);
        let tokens = (load.inflight_tokens / c.tokens_full).min(1.0);
        (c.queue_weight * queue + c.kv_weight * kv + c.tokens_weight * tokens) / total
    }
}

impl Scorer for LoadScorer {
    fn name(&self) -> &'static str {
        "load"
    }

    fn score(&self, input: &ScoreInput, out: &mut [f64]) {
        for (o, c) in out.iter_mut().zip(&input.candidates) {
            *o = 1.0 - self.busy(&c.load);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{candidate, run_scorer};
    use super::*;

    #[test]
    fn idle_beats_busy_and_saturates_at_one() {
        let scorer = LoadScorer::new(LoadScorerConfig::default());
        let idle = candidate("a:1");
        let mut busy = candidate("b:1");
        busy.load.waiting = 10.0;
        busy.load.inflight_requests = 6.0;
        busy.load.kv_usage = 0.5;
        let mut drowned = candidate("c:1");
        drowned.load.waiting = 1e9;
        drowned.load.kv_usage = 1.0;
        drowned.load.inflight_tokens = 1e12;
        let input = ScoreInput {
            total_blocks: 1,
            candidates: vec![idle, busy, drowned],
            new_conversation: false,
            shares_prefix: false,
            prompt_tokens: 0.0,
            tokens_per_block: 16.0,
        };
        let s = run_scorer(&scorer, &input).unwrap();
        assert_eq!(s[0], 1.0);
        assert!(s[1] < 1.0 && s[1] > 0.0);
        assert_eq!(s[2], 0.0);
    }
}
