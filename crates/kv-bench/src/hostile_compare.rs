//! `kv-bench hostile --attacks --before-router PATH`: every attack run against an earlier
//! router binary and then the current one, tabled side by side (peak RSS, failed health probes,
//! what the attacker saw) with the bound both must stay under.

use super::hostile_attacks::AttackResult;
use super::table::{Style, Table};

/// Config keys the current router knows and the one these comparisons started from
/// (revision 7c5f830) refuses: left out of the config written for `--before-router`.
pub const NEWER_KEYS: &[&str] = &[
    "server.message_timeout_ms",
    "server.max_extproc_streams",
    "pick_api.max_buffered_bytes",
];

/// One side's figures in one cell.
fn cell(r: Option<&AttackResult>) -> String {
    let Some(r) = r else {
        return "not run".into();
    };
    let mib = r.rss_peak as f64 / (1 << 20) as f64;
    let mut s = format!(
        "{mib:.0} MiB; probes failed {}/{}",
        r.probe_failures, r.probes
    );
    if !r.note.is_empty() {
        s.push_str("; ");
        s.push_str(&r.note);
    }
    s
}

/// `before` and `after` joined by attack name, in `after`'s order (then any only `before` ran).
pub fn table(before: &[AttackResult], after: &[AttackResult], style: Style) -> String {
    let mut t = Table::new(["attack", "before", "after", "bound"])
        .left(1)
        .left(2);
    let find = |rs: &[AttackResult], name: &str| rs.iter().find(|r| r.attack == name).cloned();
    let mut names: Vec<&str> = after.iter().map(|r| r.attack.as_str()).collect();
    for r in before {
        if !names.contains(&r.attack.as_str()) {
            names.push(&r.attack);
        }
    }
    for name in names {
        let (b, a) = (find(before, name), find(after, name));
        let bound = a.as_ref().or(b.as_ref()).map_or(0, |r| r.rss_bound);
        t.row(vec![
            name.to_string(),
            cell(b.as_ref()),
            cell(a.as_ref()),
            format!("{:.0} MiB", bound as f64 / (1 << 20) as f64),
        ]);
    }
    t.render(style)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(attack: &str, peak_mib: u64, failed: usize) -> AttackResult {
        AttackResult {
            attack: attack.into(),
            rss_before: 20 << 20,
            rss_peak: peak_mib << 20,
            rss_bound: 900 << 20,
            rss_after: 20 << 20,
            settle_s: Some(0.0),
            fds_peak: 10,
            probes: 100,
            probe_failures: failed,
            probe_p99_ms: 1.0,
            probe_worst_ms: 2.0,
            note: String::new(),
        }
    }

    #[test]
    fn rows_join_by_attack_and_keep_attacks_one_side_ran() {
        let before = [result("a", 1030, 0), result("old only", 30, 5)];
        let after = [result("a", 40, 0), result("new only", 25, 0)];
        let t = table(&before, &after, Style::Plain);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[1].starts_with("a ") || lines[2].starts_with("a "),
            "{t}"
        );
        let row = |name: &str| *lines.iter().find(|l| l.starts_with(name)).unwrap();
        assert!(row("a ").contains("1030 MiB") && row("a ").contains("40 MiB"));
        assert!(row("new only").contains("not run"));
        assert!(row("old only").contains("probes failed 5/100"));
    }
}
