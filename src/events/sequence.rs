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
    /// Already applied by the catch-up replay (published while it ran): drop it.
    Duplicate,
}

/// Last applied sequence number of one publisher.
#[derive(Debug, Default, Clone)]
pub(crate) struct SeqTracker {
    last: Option<u64>,
    /// After a catch-up replay through `.0`: live copies of replayed messages, in increasing
    /// order, last seen `.1`; the window closes at the first message outside it.
    duplicates: Option<(u64, Option<u64>)>,
}

impl SeqTracker {
    /// Records that a catch-up replay applied everything through `last`.
    pub(crate) fn caught_up(&mut self, last: u64) {
        self.last = Some(last);
        self.duplicates = Some((last, None));
    }

    /// Judges `seq` and records it as the last applied.
    pub(crate) fn observe(&mut self, seq: u64) -> Verdict {
        if let Some((through, prev)) = self.duplicates {
            // A repeat or a step back inside the window is a restart, not a copy.
            if seq <= through && prev.is_none_or(|p| seq > p) {
                self.duplicates = Some((through, Some(seq)));
                return Verdict::Duplicate;
            }
            self.duplicates = None;
        }
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

    #[test]
    fn after_a_catch_up_live_copies_are_dropped_until_new_messages() {
        let mut t = SeqTracker::default();
        t.caught_up(7);
        assert_eq!(t.observe(6), Verdict::Duplicate);
        assert_eq!(t.observe(7), Verdict::Duplicate);
        assert_eq!(t.observe(8), Verdict::Apply);
        assert_eq!(
            t.observe(3),
            Verdict::Restarted { to: 3 },
            "the window closed"
        );
        let mut gap = SeqTracker::default();
        gap.caught_up(7);
        assert_eq!(gap.observe(10), Verdict::Gap { from: 8, to: 10 });
        // A step back inside the window is the engine starting over.
        let mut restart = SeqTracker::default();
        restart.caught_up(7);
        assert_eq!(restart.observe(5), Verdict::Duplicate);
        assert_eq!(restart.observe(0), Verdict::Restarted { to: 0 });
        assert_eq!(restart.observe(1), Verdict::Apply);
    }
}
