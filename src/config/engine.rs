//! `pods.engine`: which serving engine's `/metrics` names carry a pod's load. A built-in preset
//! (`vllm`, `sglang`, `llamacpp`, `tgi`), `auto` (detected from a scrape), or a custom mapping of
//! metric names for an engine without a preset.

use std::fmt;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Longest metric or label name accepted in a custom mapping (real ones are under 100 bytes).
pub const MAX_METRIC_NAME_BYTES: usize = 200;

/// A serving engine with built-in metric names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// vLLM (`vllm:` names).
    Vllm,
    /// SGLang (`sglang:` names).
    Sglang,
    /// llama.cpp's `llama-server` (`llamacpp:` names, `--metrics`).
    Llamacpp,
    /// Hugging Face Text Generation Inference (`tgi_` names).
    Tgi,
}

impl Preset {
    /// Every preset, in the order auto-detection breaks ties.
    pub const ALL: [Preset; 4] = [Preset::Vllm, Preset::Sglang, Preset::Llamacpp, Preset::Tgi];

    /// The name used in config, labels and `/debug/pods`.
    pub fn as_str(self) -> &'static str {
        match self {
            Preset::Vllm => "vllm",
            Preset::Sglang => "sglang",
            Preset::Llamacpp => "llamacpp",
            Preset::Tgi => "tgi",
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Metric names of an engine without a preset. Each value is one metric name; samples of a
/// name add up (data-parallel ranks), KV usage is their mean.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomEngine {
    /// Gauge of requests queued at the engine.
    #[serde(default)]
    pub waiting: Option<String>,
    /// Gauge of requests being processed.
    #[serde(default)]
    pub running: Option<String>,
    /// Gauge of KV-cache usage, multiplied by `kv_usage_scale` to get 0..1.
    #[serde(default)]
    pub kv_usage: Option<String>,
    /// Factor from `kv_usage`'s unit to 0..1: 1 for a ratio, 0.01 for a percentage.
    #[serde(default = "one")]
    pub kv_usage_scale: f64,
    /// Gauge of KV-cache tokens (or blocks) in use; with `kv_total`, usage = used / total.
    #[serde(default)]
    pub kv_used: Option<String>,
    /// Gauge of the KV-cache capacity, in `kv_used`'s unit.
    #[serde(default)]
    pub kv_total: Option<String>,
    /// Label whose value names a rank group: samples of one group count once (their maximum,
    /// for engines that repeat a gauge on every tensor-parallel rank), groups add up.
    #[serde(default)]
    pub group_by: Option<String>,
    /// Info gauge of LoRA adapter residency with vLLM's labels (`running_lora_adapters`,
    /// `waiting_lora_adapters`: comma-separated names; `max_lora`); its newest series counts.
    #[serde(default)]
    pub lora_info: Option<String>,
}

fn one() -> f64 {
    1.0
}

/// Where a pod's load is read from: a preset, detection, or a custom mapping.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum EngineSetting {
    /// Detect the engine from the metric names of a pod's scrape and remember it.
    #[default]
    Auto,
    /// A built-in engine.
    Preset(Preset),
    /// Metric names given in the config.
    Custom(CustomEngine),
}

impl EngineSetting {
    /// A setting by name (`auto` or a preset), as config files and pod labels spell it.
    pub fn from_name(name: &str) -> Option<Self> {
        let name = name.trim().to_ascii_lowercase();
        match name.as_str() {
            "auto" => Some(EngineSetting::Auto),
            "vllm" => Some(EngineSetting::Preset(Preset::Vllm)),
            "sglang" => Some(EngineSetting::Preset(Preset::Sglang)),
            "llamacpp" | "llama.cpp" | "llama-cpp" => Some(EngineSetting::Preset(Preset::Llamacpp)),
            "tgi" => Some(EngineSetting::Preset(Preset::Tgi)),
            _ => None,
        }
    }

    /// `auto`, a preset's name, or `custom`.
    pub fn name(&self) -> &'static str {
        match self {
            EngineSetting::Auto => "auto",
            EngineSetting::Preset(p) => p.as_str(),
            EngineSetting::Custom(_) => "custom",
        }
    }
}

const EXPECTED: &str = "auto, vllm, sglang, llamacpp, tgi, or a mapping of metric names \
                        (waiting, running, kv_usage, kv_usage_scale, kv_used, kv_total, \
                        group_by, lora_info)";

impl Serialize for EngineSetting {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            EngineSetting::Custom(c) => c.serialize(s),
            other => s.serialize_str(other.name()),
        }
    }
}

impl<'de> Deserialize<'de> for EngineSetting {
    // By hand rather than `untagged`: a typo must name the accepted values, not say "did not
    // match any variant".
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EngineSetting;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(EXPECTED)
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                EngineSetting::from_name(v)
                    .ok_or_else(|| E::custom(format!("unknown engine `{v}`: expected {EXPECTED}")))
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                CustomEngine::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(EngineSetting::Custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A Prometheus metric or label name: `[a-zA-Z_:][a-zA-Z0-9_:]*`, bounded.
fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_METRIC_NAME_BYTES
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}

/// Problems of one engine setting at `key`, as `(key, reason)`.
pub(super) fn problems(key: &str, setting: &EngineSetting) -> Vec<(String, String)> {
    let EngineSetting::Custom(c) = setting else {
        return Vec::new();
    };
    let mut p = Vec::new();
    let mut bad = |field: &str, reason: &str| {
        let key = if field.is_empty() {
            key.to_string()
        } else {
            format!("{key}.{field}")
        };
        p.push((key, reason.to_string()));
    };
    for (field, name) in [
        ("waiting", &c.waiting),
        ("running", &c.running),
        ("kv_usage", &c.kv_usage),
        ("kv_used", &c.kv_used),
        ("kv_total", &c.kv_total),
        ("group_by", &c.group_by),
        ("lora_info", &c.lora_info),
    ] {
        if name.as_deref().is_some_and(|n| !valid_name(n)) {
            bad(
                field,
                "must be a Prometheus name ([a-zA-Z_:][a-zA-Z0-9_:]*, at most 200 bytes)",
            );
        }
    }
    if [&c.waiting, &c.running, &c.kv_usage, &c.kv_used]
        .iter()
        .all(|n| n.is_none())
    {
        bad(
            "",
            "a custom engine names at least one of waiting, running, kv_usage, kv_used + kv_total",
        );
    }
    if c.kv_used.is_some() != c.kv_total.is_some() {
        bad("kv_total", "kv_used and kv_total go together");
    }
    if c.kv_usage.is_some() && c.kv_used.is_some() {
        bad("kv_usage", "set kv_usage or kv_used + kv_total, not both");
    }
    if !(c.kv_usage_scale > 0.0 && c.kv_usage_scale.is_finite()) {
        bad("kv_usage_scale", "must be a positive number");
    }
    p
}

#[cfg(test)]
mod tests {
    use super::super::Config;
    use super::*;

    fn parse(yaml: &str) -> Result<Config, String> {
        Config::from_yaml(yaml).map_err(|e| e.to_string())
    }

    #[test]
    fn engine_defaults_to_auto_and_takes_preset_names() {
        let cfg = parse("pods: { static: [{ address: 127.0.0.1:1 }] }\n").unwrap();
        assert_eq!(cfg.pods.engine, EngineSetting::Auto);
        for (name, want) in [
            ("vllm", Preset::Vllm),
            ("sglang", Preset::Sglang),
            ("llamacpp", Preset::Llamacpp),
            ("llama.cpp", Preset::Llamacpp),
            ("TGI", Preset::Tgi),
        ] {
            let cfg = parse(&format!(
                "pods: {{ engine: {name}, static: [{{ address: 127.0.0.1:1 }}] }}\n"
            ))
            .unwrap();
            assert_eq!(cfg.pods.engine, EngineSetting::Preset(want), "{name}");
        }
    }

    #[test]
    fn each_source_takes_its_own_engine() {
        let cfg = parse(
            "pods:\n  engine: vllm\n  static: [{ address: 127.0.0.1:1 }]\n  dns:\n    - { name: sglang.svc, port: 30000, engine: sglang }\n    - { name: vllm.svc, port: 8000 }\n",
        )
        .unwrap();
        assert_eq!(cfg.pods.engine, EngineSetting::Preset(Preset::Vllm));
        assert_eq!(
            cfg.pods.dns[0].engine,
            Some(EngineSetting::Preset(Preset::Sglang))
        );
        assert_eq!(cfg.pods.dns[1].engine, None, "unset: pods.engine applies");
    }

    #[test]
    fn a_custom_mapping_parses_and_round_trips() {
        let yaml = "pods:\n  static: [{ address: 127.0.0.1:1 }]\n  engine:\n    waiting: my_queue_depth\n    running: my_active\n    kv_usage: my_kv_percent\n    kv_usage_scale: 0.01\n";
        let cfg = parse(yaml).unwrap();
        let EngineSetting::Custom(c) = &cfg.pods.engine else {
            panic!("custom expected: {:?}", cfg.pods.engine)
        };
        assert_eq!(c.waiting.as_deref(), Some("my_queue_depth"));
        assert_eq!(c.kv_usage_scale, 0.01);
        assert_eq!(c.group_by, None);
        assert_eq!(c.lora_info, None);
        let again = parse(&serde_yaml::to_string(&cfg).unwrap()).unwrap();
        assert_eq!(again, cfg);
    }

    #[test]
    fn an_unknown_engine_name_lists_the_accepted_ones() {
        let err =
            parse("pods: { engine: ollama, static: [{ address: 127.0.0.1:1 }] }\n").unwrap_err();
        assert!(err.contains("unknown engine `ollama`"), "{err}");
        assert!(err.contains("sglang") && err.contains("mapping"), "{err}");
    }

    #[test]
    fn a_misspelt_custom_field_is_named() {
        let err = parse("pods: { engine: { waitng: q }, static: [{ address: 127.0.0.1:1 }] }\n")
            .unwrap_err();
        assert!(err.contains("waitng"), "{err}");
    }

    #[test]
    fn bad_custom_mappings_name_their_keys() {
        let err = parse(
            "pods:\n  engine: { kv_used: used }\n  dns: [{ name: a, port: 1, engine: { waiting: \"bad name\", kv_usage: k, kv_usage_scale: 0, kv_used: u, kv_total: t } }]\n  kubernetes: { selector: app=x, engine: {} }\n",
        )
        .unwrap_err();
        for (key, why) in [
            ("pods.engine.kv_total", "go together"),
            ("pods.dns[0].engine.waiting", "Prometheus name"),
            ("pods.dns[0].engine.kv_usage", "not both"),
            ("pods.dns[0].engine.kv_usage_scale", "positive"),
            ("pods.kubernetes.engine", "at least one"),
        ] {
            assert!(
                err.lines().any(|l| l.contains(key) && l.contains(why)),
                "{key}: {why} missing from: {err}"
            );
        }
    }
}
