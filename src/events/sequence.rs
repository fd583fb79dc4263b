//! Sequence tracking per (pod, DP rank): what to do with each arriving message number.
//! Pure logic; the subscriber acts on the verdicts.

/// What the subscriber should do with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The next message in order: apply it.
    Apply,
    /// Messages `from..to` were missed (a forward jump): replay them, else purge, then apply.
    Gap {
        /// First missing sequence number.
        from: u64,
        /// The arriving sequence number (exclusive end of the gap).
        to: u64,
    },
    /// The first message seen, not from the start: replay `0..to` if possible, then apply.
    Joined {
        /// The arriving sequence number.
        to: u64,
    },
    /// The sequence went back: the engine restarted. Purge, then replay `0..to`, then apply.
    Restarted {
        /// The arriving sequence number.
        to: u64,
    },
}

/// Last applied sequence number of one publisher.
#[derive(Debug, Default, Clone)]
pub(crate) struct SeqTracker {
    last: Option<u64>,
}

impl SeqTracker {
    /// Judges `seq` and records it as the last applied.
    pub(crate) fn observe(&mut self, seq: u64) -> Verdict {
        let verdict = match self.last {
            None if seq == 0 => Verdict::Apply,
            None => Verdict::Joined { to: seq },
            Some(last) if seq == last.wrapping_add(1) => Verdict::Apply,
            Some(last) if seq > last => Verdict::Gap {
                from: last + 1,
                to: seq,
            },
            Some(_) => Verdict::Restarted { to: seq },
        };
        self.last = Some(seq);
        verdict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(0), Verdict::Apply);
        assert_eq!(t.observe(1), Verdict::Apply);
        assert_eq!(t.observe(5), Verdict::Gap { from: 2, to: 5 });
        assert_eq!(t.observe(6), Verdict::Apply);
        assert_eq!(t.observe(0), Verdict::Restarted { to: 0 });
        assert_eq!(t.observe(1), Verdict::Apply);
        assert_eq!(
            t.observe(1),
            Verdict::Restarted { to: 1 },
            "a repeat means a restart too"
        );
        let mut late = SeqTracker::default();
        assert_eq!(late.observe(42), Verdict::Joined { to: 42 });
        assert_eq!(
            late.observe(43),
            Verdict::Apply,
            "42 was recorded as the last"
        );
    }
}
