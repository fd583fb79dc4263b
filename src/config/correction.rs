//! `index.correction`, removed: it scaled each pod's index capacity by the gap between the hits
//! this router predicted and the hits the pod's counters report. It did not close the gap it was
//! built for (a router told a quarter of a pod's cache stayed under half of the hits of one told
//! the truth) and cost up to 2 points elsewhere (docs/investigations/correction.md). A config
//! that still names it loads, and the router warns once at startup that the key is ignored.

use serde::{Deserialize, Deserializer};

/// Why a config naming `index.correction` is loaded without it.
pub const CORRECTION_REMOVED: &str = "index.correction was removed and is ignored: it did not \
     correct a wrong cache size in measurement (docs/investigations/correction.md); the \
     per-pod prediction accuracy metrics remain";

/// Whether a config named a removed key; whatever it held is ignored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemovedKey(bool);

impl RemovedKey {
    /// The config named the key.
    pub fn present(self) -> bool {
        self.0
    }
}

impl<'de> Deserialize<'de> for RemovedKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(d)?;
        Ok(Self(true))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, CORRECTION_REMOVED};

    #[test]
    fn a_config_naming_the_removed_correction_loads_and_says_it_is_ignored() {
        let yaml = "pods:\n  static:\n    - address: 127.0.0.1:8000\nindex:\n  ttl_ms: 5000\n  \
                    correction:\n    enabled: true\n    max_scale: 9\n";
        let cfg = Config::from_yaml(yaml).expect("an old config still loads");
        assert_eq!(cfg.index.ttl_ms, 5000, "the keys beside it still apply");
        assert_eq!(cfg.ignored_keys(), vec![CORRECTION_REMOVED]);
        let plain =
            Config::from_yaml("pods:\n  static:\n    - address: 127.0.0.1:8000\n").expect("config");
        assert!(plain.ignored_keys().is_empty());
        let yaml = serde_yaml::to_string(&cfg).expect("serializes");
        assert!(!yaml.contains("correction"), "{yaml}");
    }
}
