//! Prefix scorer: the share of the prompt's blocks a pod already holds, from the first block on.

use super::{ScoreInput, Scorer};

/// `matched consecutive blocks / total blocks` (0 for prompts shorter than one block).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PrefixScorer;

impl Scorer for PrefixScorer {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn score(&self, input: &ScoreInput, out: &mut [f64]) {
        let total = input.total_blocks as f64;
        for (o, c) in out.iter_mut().zip(&input.candidates) {
            *o = if total > 0.0 {
                c.matched_blocks / total
            } else {
                0.0
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{candidate, run_scorer};
    use super::*;

    #[test]
    fn prefix_score_is_the_share_of_matched_blocks() {
        let mut a = candidate("a:1");
        a.matched_blocks = 3.0;
        let input = ScoreInput {
            total_blocks: 4,
            candidates: vec![a, candidate("b:1")],
            new_conversation: false,
            shares_prefix: false,
            prompt_tokens: 0.0,
            tokens_per_block: 16.0,
        };
        assert_eq!(run_scorer(&PrefixScorer, &input).unwrap(), vec![0.75, 0.0]);
        let empty = ScoreInput {
            total_blocks: 0,
            candidates: vec![candidate("a:1")],
            new_conversation: false,
            shares_prefix: false,
            prompt_tokens: 0.0,
            tokens_per_block: 16.0,
        };
        assert_eq!(run_scorer(&PrefixScorer, &empty).unwrap(), vec![0.0]);
    }
}
