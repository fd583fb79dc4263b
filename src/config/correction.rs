//! `index.correction`: how the approximate index corrects a pod's capacity from the gap between
//! the prefix-cache hits this router predicted for it and the hits the pod reports.

use serde::{Deserialize, Serialize};

/// `index.correction`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CorrectionConfig {
    /// Scale a pod's index capacity by what its hit counters show (approximate mode only).
    pub enabled: bool,
    /// Relative gap between observed and predicted hit rates that is left alone.
    pub tolerance: f64,
    /// Smallest fraction of the configured capacity a pod's index may be scaled to.
    pub min_scale: f64,
    /// Largest multiple of the configured capacity a pod's index may grow to, where the pod finds
    /// more hits than this router predicted (its configuration understates its cache).
    pub max_scale: f64,
    /// The most one judgement multiplies or divides a pod's scale by.
    pub max_step: f64,
    /// Predicted hit tokens a pod must accumulate before its gap is judged.
    pub min_predicted_tokens: u64,
    /// Decisions a pod must accumulate before each judgement: predictions count when routed,
    /// the pod's hits when it prefills, so a few long prompts straddle windows.
    pub min_decisions: u64,
}

impl Default for CorrectionConfig {
    fn default() -> Self {
        Self {
            // Off: in simulation it pays only where the configured capacity is too small, and
            // costs up to 2 points of pooled elsewhere (docs/results.md, "Prediction accuracy").
            enabled: false,
            tolerance: 0.2,
            min_scale: 0.1,
            max_scale: 4.0,
            max_step: 1.5,
            min_predicted_tokens: 8192,
            min_decisions: 32,
        }
    }
}

impl CorrectionConfig {
    /// The rules for an index fed by KV events (`precise`) or by the router's own decisions:
    /// events already say what a pod holds, so its weight only falls below 1 where its counters
    /// contradict them, and never grows.
    pub fn for_index(self, precise: bool) -> Self {
        if precise {
            Self {
                max_scale: 1.0,
                ..self
            }
        } else {
            self
        }
    }

    /// Problems by key under `index.correction`.
    pub fn problems(&self) -> Vec<(&'static str, &'static str)> {
        let mut out = Vec::new();
        if !(self.tolerance > 0.0 && self.tolerance < 1.0) {
            out.push(("tolerance", "must be in (0, 1)"));
        }
        if !(self.min_scale > 0.0 && self.min_scale <= 1.0) {
            out.push(("min_scale", "must be in (0, 1]"));
        }
        if !(self.max_scale >= 1.0 && self.max_scale <= 8.0) {
            out.push(("max_scale", "must be in [1, 8]"));
        }
        if !(self.max_step > 1.0 && self.max_step <= 4.0) {
            out.push(("max_step", "must be in (1, 4]"));
        }
        if self.min_predicted_tokens == 0 {
            out.push(("min_predicted_tokens", "must be positive"));
        }
        if self.min_decisions == 0 {
            out.push(("min_decisions", "must be positive"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn with_max_scale(v: &str) -> String {
        format!(
            "pods:\n  static:\n    - address: 127.0.0.1:8000\nindex:\n  correction:\n    max_scale: {v}\n"
        )
    }

    #[test]
    fn a_max_scale_outside_one_to_eight_is_refused_by_its_key() {
        for bad in ["0.5", "9", ".nan"] {
            let yaml = with_max_scale(bad);
            let err = Config::from_yaml(&yaml).unwrap_err().to_string();
            assert!(err.contains("index.correction.max_scale"), "{bad}: {err}");
        }
        for good in ["1", "4", "8"] {
            let yaml = with_max_scale(good);
            let r = Config::from_yaml(&yaml);
            assert!(r.is_ok(), "{good}: {:?}", r.err().map(|e| e.to_string()));
        }
    }
}
