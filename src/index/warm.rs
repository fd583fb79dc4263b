//! The index snapshot one replica hands another at start-up (`index.warm_start`): block keys and
//! pod addresses only, each entry with the time it has left as a relative duration (the two
//! processes' monotonic clocks share no origin). JSON through serde, with a format name and a
//! version a reader checks before trusting anything else.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The format name every snapshot carries.
pub const FORMAT: &str = "kv-router-index-snapshot";
/// The version this build writes and reads.
pub const VERSION: u32 = 1;
/// Longest pod id taken from a snapshot (an address, or a name and port).
const MAX_POD_ID: usize = 512;

/// A memory index's entries, pod by pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// Every pod with entries.
    pub pods: Vec<PodEntries>,
}

/// One pod's entries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodEntries {
    /// The pod's id (its address).
    pub pod: String,
    /// `[block key, ms left before the entry expires]`, most recently refreshed first.
    pub entries: Vec<(u64, u64)>,
}

impl Snapshot {
    /// A snapshot of `pods`.
    pub fn new(pods: Vec<PodEntries>) -> Self {
        Self {
            format: FORMAT.to_string(),
            version: VERSION,
            pods,
        }
    }

    /// (key, pod) entries in all.
    pub fn entries(&self) -> usize {
        self.pods.iter().map(|p| p.entries.len()).sum()
    }
}

/// Why a snapshot was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SnapshotError {
    /// Longer than the reader's `max_bytes`.
    #[error("snapshot larger than {0} bytes")]
    TooLarge(usize),
    /// More entries than the reader's `max_entries`.
    #[error("snapshot holds {0} entries, more than {1}")]
    TooManyEntries(usize, usize),
    /// Not JSON of this shape.
    #[error("snapshot unreadable: {0}")]
    Malformed(String),
    /// Another format or version.
    #[error("snapshot format {0} version {1}, this build reads {FORMAT} version {VERSION}")]
    Version(String, u32),
    /// A pod id no pod has.
    #[error("snapshot names a pod id of {0} bytes")]
    PodId(usize),
}

/// Encodes `snap` (JSON).
pub fn encode(snap: &Snapshot) -> Vec<u8> {
    serde_json::to_vec(snap).expect("a snapshot of strings and numbers serializes")
}

/// Decodes and checks a snapshot of at most `max_bytes` and `max_entries`.
pub fn decode(
    bytes: &[u8],
    max_bytes: usize,
    max_entries: usize,
) -> Result<Snapshot, SnapshotError> {
    if bytes.len() > max_bytes {
        return Err(SnapshotError::TooLarge(max_bytes));
    }
    // The header first: a snapshot of another version is refused by what it says it is, not by
    // whatever its body fails on.
    #[derive(Deserialize)]
    struct Header {
        format: String,
        version: u32,
    }
    let head: Header =
        serde_json::from_slice(bytes).map_err(|e| SnapshotError::Malformed(e.to_string()))?;
    if head.format != FORMAT || head.version != VERSION {
        return Err(SnapshotError::Version(head.format, head.version));
    }
    let snap: Snapshot =
        serde_json::from_slice(bytes).map_err(|e| SnapshotError::Malformed(e.to_string()))?;
    let n = snap.entries();
    if n > max_entries {
        return Err(SnapshotError::TooManyEntries(n, max_entries));
    }
    if let Some(p) = snap
        .pods
        .iter()
        .find(|p| p.pod.is_empty() || p.pod.len() > MAX_POD_ID)
    {
        return Err(SnapshotError::PodId(p.pod.len()));
    }
    Ok(snap)
}

/// What importing a snapshot did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Imported {
    /// Entries taken in.
    pub entries: usize,
    /// Pods they belong to.
    pub pods: usize,
    /// Pods of the snapshot this replica does not know: their entries were dropped.
    pub unknown_pods: usize,
    /// Entries with no time left, past their pod's capacity, or whose key was already held.
    pub skipped: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap() -> Snapshot {
        Snapshot::new(vec![
            PodEntries {
                pod: "10.0.0.1:8000".into(),
                entries: vec![(u64::MAX, 5), (7, 1)],
            },
            PodEntries {
                pod: "10.0.0.2:8000".into(),
                entries: vec![(9, 3)],
            },
        ])
    }

    #[test]
    fn a_snapshot_survives_encoding_with_full_width_keys() {
        let s = snap();
        let bytes = encode(&s);
        assert_eq!(decode(&bytes, bytes.len(), 3), Ok(s));
    }

    #[test]
    fn oversized_foreign_and_malformed_snapshots_are_refused() {
        let bytes = encode(&snap());
        assert_eq!(
            decode(&bytes, bytes.len() - 1, 3),
            Err(SnapshotError::TooLarge(bytes.len() - 1))
        );
        assert_eq!(
            decode(&bytes, bytes.len(), 2),
            Err(SnapshotError::TooManyEntries(3, 2))
        );
        let newer = String::from_utf8(bytes.clone())
            .unwrap()
            .replace("\"version\":1", "\"version\":2");
        assert_eq!(
            decode(newer.as_bytes(), 1 << 20, 10),
            Err(SnapshotError::Version(FORMAT.into(), 2))
        );
        let other = br#"{"format":"something-else","version":1,"pods":[]}"#;
        assert!(matches!(
            decode(other, 1 << 20, 10),
            Err(SnapshotError::Version(..))
        ));
        let malformed: [&[u8]; 3] = [
            b"not json",
            br#"{"format":"kv-router-index-snapshot","version":1,"pods":[{"pod":"a:1","entries":[[1]]}]}"#,
            br#"{"format":"kv-router-index-snapshot","version":1,"pods":[],"prompt":"x"}"#,
        ];
        for bad in malformed {
            assert!(
                matches!(decode(bad, 1 << 20, 10), Err(SnapshotError::Malformed(_))),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let long = Snapshot::new(vec![PodEntries {
            pod: "x".repeat(MAX_POD_ID + 1),
            entries: vec![],
        }]);
        assert_eq!(
            decode(&encode(&long), 1 << 20, 10),
            Err(SnapshotError::PodId(MAX_POD_ID + 1))
        );
    }
}
