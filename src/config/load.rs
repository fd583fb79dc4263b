//! Loading: one file or a conf.d-style directory of layers (Kubernetes overlays add a ConfigMap
//! key each), merged in name order, then flag/env overrides, then validation.

use std::path::Path;

use serde_yaml::Value;

use super::{check_yaml_shape, Config, ConfigError, KubernetesOverrides, MAX_YAML_BYTES};

/// Most layer files read from one directory (a ConfigMap has a handful).
const MAX_LAYERS: usize = 64;

impl Config {
    /// Reads `path` — a YAML file, or a directory whose `*.yaml`/`*.yml` files (dotfiles
    /// skipped, so a mounted ConfigMap's `..data` is ignored) are merged in name order: mappings
    /// merge key by key, anything else in a later file replaces the earlier value. Then applies
    /// `overrides` and validates, so a file without a pod source is fine when `--pool-name`
    /// supplies one.
    pub fn load_with(path: &Path, overrides: KubernetesOverrides) -> Result<Self, ConfigError> {
        let read = |p: &Path| {
            let io = |source| ConfigError::Read {
                path: p.display().to_string(),
                source,
            };
            // Never read an unbounded file into memory.
            let len = std::fs::metadata(p).map_err(io)?.len();
            if len > MAX_YAML_BYTES as u64 {
                return Err(ConfigError::Shape(format!(
                    "{}: {len} bytes; at most {MAX_YAML_BYTES} are read",
                    p.display()
                )));
            }
            std::fs::read_to_string(p).map_err(io)
        };
        if !path.is_dir() {
            return Self::from_yaml_with(&read(path)?, overrides);
        }
        let mut files: Vec<_> = std::fs::read_dir(path)
            .map_err(|source| ConfigError::Read {
                path: path.display().to_string(),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                !name.starts_with('.')
                    && (name.ends_with(".yaml") || name.ends_with(".yml"))
                    && p.is_file()
            })
            .collect();
        files.sort();
        files.truncate(MAX_LAYERS);
        let mut merged = Value::Null;
        for f in &files {
            let text = read(f)?;
            if text.trim().is_empty() {
                continue;
            }
            check_yaml_shape(&text)?;
            let layer: Value = serde_yaml::from_str(&text)?;
            merge(&mut merged, layer);
        }
        let mut cfg: Config = if merged.is_null() {
            Config::default()
        } else {
            serde_yaml::from_value(merged)?
        };
        overrides.apply_to(&mut cfg.pods.kubernetes);
        cfg.validate()
    }

    /// [`Config::from_yaml`] with overrides applied before validation.
    pub fn from_yaml_with(text: &str, overrides: KubernetesOverrides) -> Result<Self, ConfigError> {
        let mut cfg: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            check_yaml_shape(text)?;
            serde_yaml::from_str(text)?
        };
        overrides.apply_to(&mut cfg.pods.kubernetes);
        cfg.validate()
    }
}

/// Deep-merges `layer` into `base`: mappings key by key, everything else replaced.
fn merge(base: &mut Value, layer: Value) {
    match (base, layer) {
        (Value::Mapping(b), Value::Mapping(l)) => {
            for (k, v) in l {
                match b.get_mut(&k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (slot, v) => *slot = v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_layers_merge_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        let w = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        w(
            "00-base.yaml",
            "listen: { grpc: 0.0.0.0:9002 }\npods: { dns: [{ name: a, port: 1 }] }\nscorers: { load: { weight: 5 } }\n",
        );
        w(
            "20-sim.yaml",
            "pods: { dns: [{ name: b, port: 2 }] }\nscorers: { prefix: { weight: 7 } }\n",
        );
        w("..data.yaml", "bogus: 1\n"); // a ConfigMap mount's hidden entries are skipped
        w("notes.txt", "bogus: 1\n");
        let cfg = Config::load_with(dir.path(), KubernetesOverrides::default()).unwrap();
        assert_eq!(cfg.listen.grpc, "0.0.0.0:9002");
        assert_eq!(cfg.pods.dns.len(), 1, "lists are replaced, not appended");
        assert_eq!(cfg.pods.dns[0].name, "b");
        assert_eq!(cfg.scorers.load.weight, 5.0);
        assert_eq!(cfg.scorers.prefix.weight, 7.0);
    }

    #[test]
    fn a_bad_layer_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("a.yaml"),
            "pods: { static: [] }\nbogus: 1\n",
        )
        .unwrap();
        let err = Config::load_with(dir.path(), KubernetesOverrides::default()).unwrap_err();
        assert!(err.to_string().contains("bogus"), "{err}");
    }
}
