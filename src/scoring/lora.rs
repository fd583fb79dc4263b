//! LoRA scorer: prefers pods that already run (or queue) the request's adapter, then pods with a
//! free adapter slot, and avoids pods that would have to evict another adapter (`docs/lora.md`).

use std::collections::BTreeMap;

use crate::config::LoraScorerConfig;
use crate::pods::LoraFit;

/// Scores each candidate's [`LoraFit`] for the request's adapter; base-model requests get no
/// LoRA column at all.
#[derive(Debug, Clone)]
pub(crate) struct LoraScorer {
    cfg: LoraScorerConfig,
}

impl LoraScorer {
    /// From config.
    pub fn new(cfg: LoraScorerConfig) -> Self {
        Self { cfg }
    }

    /// Stable name (explain output, config key).
    pub fn name(&self) -> &'static str {
        "lora"
    }

    /// `scorers.lora.adapters`: adapter → base model for adapters the pods do not list.
    pub fn adapters(&self) -> &BTreeMap<String, String> {
        &self.cfg.adapters
    }

    /// One pod's score: 1 resident, `free_slot_score` for a free slot or no report, 0 to evict.
    pub fn score_one(&self, fit: LoraFit) -> f64 {
        match fit {
            LoraFit::Resident => 1.0,
            LoraFit::FreeSlot | LoraFit::Unreported => self.cfg.free_slot_score.clamp(0.0, 1.0),
            LoraFit::Evicts => 0.0,
        }
    }

    /// The LoRA column of a request for an adapter (`fits` in candidate order), or `None` when
    /// the request names no adapter, the scorer is off, or the fits do not match `n` candidates.
    pub fn scores(&self, fits: Option<&[LoraFit]>, n: usize) -> Option<Vec<f64>> {
        let fits = fits.filter(|f| f.len() == n && self.cfg.weight > 0.0)?;
        Some(fits.iter().map(|&f| self.score_one(f)).collect())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn scorer() -> LoraScorer {
        LoraScorer::new(LoraScorerConfig::default())
    }

    #[test]
    fn resident_beats_free_slot_beats_evicting() {
        let s = scorer();
        let fits = [
            LoraFit::Evicts,
            LoraFit::Resident,
            LoraFit::FreeSlot,
            LoraFit::Unreported,
        ];
        assert_eq!(s.scores(Some(&fits), 4), Some(vec![0.0, 1.0, 0.5, 0.5]));
    }

    #[test]
    fn base_model_requests_and_a_zero_weight_get_no_column() {
        let s = scorer();
        assert_eq!(s.scores(None, 3), None, "no adapter: no LoRA column");
        let off = LoraScorer::new(LoraScorerConfig {
            weight: 0.0,
            ..LoraScorerConfig::default()
        });
        assert_eq!(off.scores(Some(&[LoraFit::Resident]), 1), None);
        assert_eq!(
            s.scores(Some(&[LoraFit::Resident]), 2),
            None,
            "a length mismatch is ignored, not misattributed"
        );
    }

    fn fit() -> impl Strategy<Value = LoraFit> {
        prop_oneof![
            Just(LoraFit::Resident),
            Just(LoraFit::FreeSlot),
            Just(LoraFit::Unreported),
            Just(LoraFit::Evicts),
        ]
    }

    proptest! {
        // Scores stay in [0, 1] and order resident ≥ free slot ≥ evicting for any config.
        #[test]
        fn scores_are_bounded_and_ordered(
            fits in prop::collection::vec(fit(), 0..8),
            free in 0.0f64..=1.0,
            weight in 0.001f64..10.0,
        ) {
            let s = LoraScorer::new(LoraScorerConfig {
                weight,
                free_slot_score: free,
                ..LoraScorerConfig::default()
            });
            let out = s.scores(Some(&fits), fits.len()).unwrap();
            for (f, v) in fits.iter().zip(&out) {
                prop_assert!((0.0..=1.0).contains(v));
                let resident = s.score_one(LoraFit::Resident);
                let evicts = s.score_one(LoraFit::Evicts);
                prop_assert!(*v <= resident && *v >= evicts, "{f:?}");
            }
        }
    }
}
