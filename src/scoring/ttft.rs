//! Predicted time to first token of one request on one candidate, from the candidate's learned
//! prefill model (`pods::TtftModel`), its load and the index match.

use serde::Serialize;

use super::Candidate;

/// A candidate's predicted time to first token and its terms (milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Prediction {
    /// Queue + prefill + overhead.
    pub ttft_ms: f64,
    /// Work ahead of the request on the pod: the larger of this router's uncached tokens still
    /// prefilling there and the pod's waiting requests at their mean prefill time.
    pub queue_ms: f64,
    /// The request's own uncached tokens at the pod's learned speed.
    pub prefill_ms: f64,
    /// The pod's learned per-request overhead.
    pub overhead_ms: f64,
    /// Prompt tokens the pod would have to compute.
    pub uncached_tokens: f64,
    /// The learned prefill speed (tokens/s).
    pub tokens_per_sec: f64,
}

/// Predicts the time to first token of a `prompt_tokens` request on `c`, whose match covers
/// `c.matched_blocks` blocks of `tokens_per_block` tokens.
pub fn predict(c: &Candidate, prompt_tokens: f64, tokens_per_block: f64) -> Prediction {
    let m = &c.model;
    let l = &c.load;
    let cached = (c.matched_blocks * tokens_per_block).max(0.0);
    let uncached = (prompt_tokens - cached).max(0.0);
    let ahead_tokens = l.inflight_tokens.max(0.0) * m.sec_per_token;
    let ahead_waiting = l.waiting.max(0.0) * m.mean_prefill_s;
    let queue = ahead_tokens.max(ahead_waiting);
    let prefill = uncached * m.sec_per_token;
    let ttft = queue + prefill + m.overhead_s;
    Prediction {
        ttft_ms: ttft * 1e3,
        queue_ms: queue * 1e3,
        prefill_ms: prefill * 1e3,
        overhead_ms: m.overhead_s * 1e3,
        uncached_tokens: uncached,
        tokens_per_sec: 1.0 / m.sec_per_token,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pods::TtftModel;

    #[test]
    fn prediction_adds_queue_prefill_and_overhead() {
        let mut c = super::super::candidate("a:1");
        c.model = TtftModel {
            sec_per_token: 1e-4,
            overhead_s: 0.01,
            mean_prefill_s: 0.2,
            prefills: 10.0,
        };
        c.matched_blocks = 10.0;
        let p = predict(&c, 1160.0, 16.0);
        assert_eq!(p.uncached_tokens, 1000.0);
        assert!((p.ttft_ms - 110.0).abs() < 1e-9, "{p:?}");
        // Three waiting requests at 200 ms each outweigh 1000 in-flight tokens (100 ms).
        c.load.waiting = 3.0;
        c.load.inflight_tokens = 1000.0;
        let p = predict(&c, 1160.0, 16.0);
        assert!((p.queue_ms - 600.0).abs() < 1e-9, "{p:?}");
        assert!((p.tokens_per_sec - 10_000.0).abs() < 1e-6);
    }
}
