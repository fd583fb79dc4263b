//! `scorers.lora`: LoRA-aware routing. The scorer's weight, what a pod with a free adapter slot
//! scores, and an optional map of adapter → base model for adapters the pods do not list.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Most entries of `scorers.lora.adapters` (each a few hundred bytes at most).
pub const MAX_LORA_ADAPTERS: usize = 10_000;

/// Longest adapter or base-model name accepted in `scorers.lora.adapters`.
pub const MAX_LORA_NAME_BYTES: usize = 256;

/// LoRA scorer: 1 for a pod with the request's adapter running or waiting, `free_slot_score`
/// for one with a free adapter slot (or no residency report), 0 for one that must evict.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LoraScorerConfig {
    /// Weight in the sum.
    pub weight: f64,
    /// Score of a pod that would load the adapter into a free slot (0..1).
    pub free_slot_score: f64,
    /// Adapter name → base model, for adapters a pod's `/v1/models` does not list (loaded on
    /// demand): such a request may go to any pod serving the base model.
    pub adapters: BTreeMap<String, String>,
}

impl Default for LoraScorerConfig {
    fn default() -> Self {
        Self {
            weight: 2.0,
            free_slot_score: 0.5,
            adapters: BTreeMap::new(),
        }
    }
}

impl LoraScorerConfig {
    /// Problems as `(key under scorers.lora, reason)`.
    pub fn problems(&self) -> Vec<(&'static str, &'static str)> {
        let mut p = Vec::new();
        if !(self.weight >= 0.0 && self.weight.is_finite()) {
            p.push(("weight", "must be a finite number >= 0"));
        }
        if !(0.0..=1.0).contains(&self.free_slot_score) {
            p.push(("free_slot_score", "must be in [0, 1]"));
        }
        if self.adapters.len() > MAX_LORA_ADAPTERS {
            p.push(("adapters", "at most 10000 entries"));
        }
        let bad_name = |s: &str| s.trim().is_empty() || s.len() > MAX_LORA_NAME_BYTES;
        if self
            .adapters
            .iter()
            .any(|(a, b)| bad_name(a) || bad_name(b) || a == b)
        {
            p.push((
                "adapters",
                "names must be non-empty, at most 256 bytes, and an adapter is not its own base",
            ));
        }
        let bases: std::collections::BTreeSet<&String> = self.adapters.values().collect();
        // A base model is never an adapter (docs/lora.md): such an entry could never apply.
        if self
            .adapters
            .iter()
            .any(|(a, b)| a != b && bases.contains(a))
        {
            p.push((
                "adapters",
                "a model is an adapter or a base model, not both",
            ));
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn defaults_and_a_map_parse() {
        let cfg = Config::from_yaml(
            "pods: { static: [{ address: 127.0.0.1:1 }] }\nscorers:\n  lora:\n    weight: 3\n    adapters: { sql-lora: meta-llama/Llama-2-7b-hf }\n",
        )
        .unwrap();
        assert_eq!(cfg.scorers.lora.weight, 3.0);
        assert_eq!(cfg.scorers.lora.free_slot_score, 0.5);
        assert_eq!(
            cfg.scorers
                .lora
                .adapters
                .get("sql-lora")
                .map(String::as_str),
            Some("meta-llama/Llama-2-7b-hf")
        );
        assert!(LoraScorerConfig::default().problems().is_empty());
    }

    #[test]
    fn bad_values_are_named() {
        let mut c = LoraScorerConfig {
            weight: -1.0,
            free_slot_score: 2.0,
            ..LoraScorerConfig::default()
        };
        c.adapters.insert("a".into(), "a".into());
        let keys: Vec<_> = c.problems().into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["weight", "free_slot_score", "adapters"]);
        let chain = LoraScorerConfig {
            adapters: [("a", "b"), ("b", "c")]
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into(),
            ..LoraScorerConfig::default()
        };
        assert_eq!(
            chain.problems(),
            [(
                "adapters",
                "a model is an adapter or a base model, not both"
            )]
        );
        let err = Config::from_yaml(
            "pods: { static: [{ address: 127.0.0.1:1 }] }\nscorers: { lora: { wieght: 1 } }\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("wieght"), "{err}");
    }
}
