//! A pod's P/D role, kept in its labels under [`ROLE_LABEL`] by every source.

use std::collections::BTreeMap;

use super::Pod;
pub use crate::config::{PodRole, ROLE_LABEL};

impl Pod {
    /// The pod's P/D role: its [`ROLE_LABEL`] label, `both` when absent or not a role.
    pub fn role(&self) -> PodRole {
        role_of(&self.spec.labels)
    }
}

/// The role a label set names; `both` when it names none.
pub fn role_of(labels: &BTreeMap<String, String>) -> PodRole {
    labels
        .get(ROLE_LABEL)
        .and_then(|v| PodRole::parse(v))
        .unwrap_or_default()
}

/// Puts `role` in `labels` (a configured role wins over a label already there).
pub(crate) fn set_role(labels: &mut BTreeMap<String, String>, role: Option<PodRole>) {
    if let Some(r) = role {
        labels.insert(ROLE_LABEL.to_string(), r.as_str().to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_role_or_an_unknown_one_is_both() {
        let mut labels = BTreeMap::new();
        assert_eq!(role_of(&labels), PodRole::Both);
        labels.insert(ROLE_LABEL.to_string(), "gpu".to_string());
        assert_eq!(role_of(&labels), PodRole::Both);
        set_role(&mut labels, Some(PodRole::Prefill));
        assert_eq!(role_of(&labels), PodRole::Prefill);
        set_role(&mut labels, None);
        assert_eq!(
            role_of(&labels),
            PodRole::Prefill,
            "no configured role keeps the label"
        );
    }
}
