//! Scorers: each fills one value in [0, 1] per candidate from a borrowed input. They do no I/O
//! and read no clock; the index lookup and load snapshot arrive as plain values.

mod load;
mod lora;
mod prefix;
mod session;
mod ttft;

use thiserror::Error;

use crate::pods::{PodId, PodLoad, TtftModel};

pub(crate) use load::LoadScorer;
pub(crate) use lora::LoraScorer;
pub(crate) use prefix::PrefixScorer;
pub(crate) use session::SessionScorer;
pub use session::{BodyIds, SessionKey, SessionStore, SharedSessions};
pub use ttft::{predict, Prediction};

/// One candidate pod as the scorers see it.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The pod.
    pub pod: PodId,
    /// Consecutive prompt blocks the index says it holds.
    pub matched_blocks: f64,
    /// Its load.
    pub load: PodLoad,
    /// This pod served the request's session last.
    pub session_pod: bool,
    /// Live conversations (sessions) this router pinned to the pod.
    pub conversations: f64,
    /// The pod's learned prefill coefficients (predicted TTFT).
    pub model: TtftModel,
}

/// Everything scorers read for one request.
#[derive(Debug, Clone)]
pub(crate) struct ScoreInput {
    /// Full blocks in the prompt.
    pub total_blocks: usize,
    /// Candidates, in a fixed order shared with the output slices.
    pub candidates: Vec<Candidate>,
    /// The request starts a new conversation on a prefix others share (the picker spreads it).
    pub new_conversation: bool,
    /// It names no session and shares only a prefix with what the pods hold (the gate places
    /// it on an idle pod while the holders queue).
    pub shares_prefix: bool,
    /// Prompt tokens (estimated in approximate mode), capped at what a model accepts.
    pub prompt_tokens: f64,
    /// Tokens per matched block.
    pub tokens_per_block: f64,
}

impl ScoreInput {
    /// Each candidate's predicted time to first token.
    pub fn predictions(&self) -> Vec<Prediction> {
        self.candidates
            .iter()
            .map(|c| predict(c, self.prompt_tokens, self.tokens_per_block))
            .collect()
    }
}

/// A scorer produced an unusable value.
#[derive(Debug, Clone, Error, PartialEq)]
pub enum ScoreError {
    /// NaN or infinite output.
    #[error("scorer {scorer} produced a non-finite score for {pod}")]
    NonFinite {
        /// Scorer name.
        scorer: &'static str,
        /// The candidate.
        pod: String,
    },
}

/// Scores candidates; `out[i]` belongs to `input.candidates[i]`.
pub(crate) trait Scorer: Send + Sync {
    /// Stable name (metrics, explain output, config key).
    fn name(&self) -> &'static str;
    /// Fills `out` (same length as the candidates) with raw scores.
    fn score(&self, input: &ScoreInput, out: &mut [f64]);
}

/// Runs a scorer and clamps its output to [0, 1]; non-finite output is an error.
pub(crate) fn run_scorer(scorer: &dyn Scorer, input: &ScoreInput) -> Result<Vec<f64>, ScoreError> {
    let mut out = vec![0.0; input.candidates.len()];
    scorer.score(input, &mut out);
    for (v, c) in out.iter_mut().zip(&input.candidates) {
        if !v.is_finite() {
            return Err(ScoreError::NonFinite {
                scorer: scorer.name(),
                pod: c.pod.to_string(),
            });
        }
        *v = v.clamp(0.0, 1.0);
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) fn candidate(pod: &str) -> Candidate {
    Candidate {
        pod: PodId::new(pod),
        matched_blocks: 0.0,
        load: PodLoad {
            fresh: true,
            ..PodLoad::default()
        },
        session_pod: false,
        conversations: 0.0,
        model: TtftModel::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Broken;
    impl Scorer for Broken {
        fn name(&self) -> &'static str {
            "broken"
        }
        fn score(&self, _: &ScoreInput, out: &mut [f64]) {
            out[0] = 7.0;
            if out.len() > 1 {
                out[1] = f64::NAN;
            }
        }
    }

    #[test]
    fn clamps_and_rejects_non_finite() {
        let one = ScoreInput {
            total_blocks: 1,
            candidates: vec![candidate("a:1")],
            new_conversation: false,
            shares_prefix: false,
            prompt_tokens: 0.0,
            tokens_per_block: 16.0,
        };
        assert_eq!(run_scorer(&Broken, &one).unwrap(), vec![1.0]);
        let two = ScoreInput {
            total_blocks: 1,
            candidates: vec![candidate("a:1"), candidate("b:1")],
            new_conversation: false,
            shares_prefix: false,
            prompt_tokens: 0.0,
            tokens_per_block: 16.0,
        };
        assert!(matches!(
            run_scorer(&Broken, &two),
            Err(ScoreError::NonFinite { .. })
        ));
    }
}
