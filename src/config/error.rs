//! What loading a configuration can fail with: unreadable, unparsable, or invalid values.

use thiserror::Error;

/// A configuration problem, naming the key.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML does not match the schema.
    #[error("invalid YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    /// The text is too large or too deeply nested to parse.
    #[error("YAML refused before parsing: {0}")]
    Shape(String),
    /// One or more values are out of range (all listed).
    #[error("invalid configuration:\n{}", .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Problem>),
}

/// One invalid value.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// Dotted key, e.g. `scorers.load.weight`.
    pub key: String,
    /// What is wrong.
    pub reason: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.reason)
    }
}
