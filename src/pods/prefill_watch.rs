//! Whether a prefill pod serves the prefills this router sends it, judged from the pod's own
//! prefix-cache lookup counter (`vllm:prefix_cache_queries`: every prompt token the engine
//! schedules is looked up once). A decode pod whose prefill pod fails, times out or cannot be
//! reached prefills locally, so the request still succeeds and nothing else tells the router:
//! the prefill pod's counter simply does not grow by what was sent there.
//!
//! Each prefill sent is owed until the counter has grown by its prompt tokens (oldest first;
//! anything more is other traffic, or other replicas', and pays nothing). When at least
//! [`MIN_UNSERVED`] prefills are owed, the oldest was sent `unserved_after` ago, and what was
//! paid over the last `unserved_after` would not cover it, the pod is excluded from prefill
//! picks for a backoff that doubles on each exclusion and resets once a prefill is served. A
//! saturated pod still works through its queue (it pays a prompt's worth in that time), so only
//! one that takes next to none of its prefills is excluded.
//! A pod whose engine reports no such counter is never judged.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// Owed prefills needed before a pod is judged: one slow prefill is not a failing pod.
pub const MIN_UNSERVED: usize = 2;
/// First exclusion.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(30);
/// Longest exclusion.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// Owed entries kept per pod; later sends merge into the newest (memory stays bounded).
const MAX_OWED: usize = 256;

/// One prefill pod's ledger.
#[derive(Debug, Clone)]
pub struct PrefillWatch {
    owed: VecDeque<(Instant, f64)>,
    /// The counter at the last sample read, and that sample's time.
    last: Option<(Instant, f64)>,
    /// What each scrape paid, oldest first (pruned to the last `unserved_after`).
    paid: VecDeque<(Instant, f64)>,
    excluded_until: Option<Instant>,
    backoff: Duration,
    exclusions: u64,
}

impl Default for PrefillWatch {
    fn default() -> Self {
        Self {
            owed: VecDeque::new(),
            last: None,
            paid: VecDeque::new(),
            excluded_until: None,
            backoff: FIRST_BACKOFF,
            exclusions: 0,
        }
    }
}

/// What [`PrefillWatch::check`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillVerdict {
    /// The pod may take prefills.
    Available,
    /// Excluded now, for the first time since it last served one.
    NewlyExcluded,
    /// Still excluded.
    Excluded,
}

impl PrefillWatch {
    /// Records a prefill of `prompt_tokens` sent to the pod at `now`.
    pub fn sent(&mut self, now: Instant, prompt_tokens: u64) {
        let tokens = prompt_tokens.max(1) as f64;
        let full = self.owed.len() >= MAX_OWED;
        match self.owed.back_mut() {
            Some(last) if full => last.1 += tokens,
            _ => self.owed.push_back((now, tokens)),
        }
    }

    /// Pays the owed prefills from the pod's lookup counter as scraped at `at` (`None`: the
    /// engine has none), then judges the pod at `now`.
    pub fn check(
        &mut self,
        now: Instant,
        sample: Option<(Instant, f64)>,
        unserved_after: Duration,
    ) -> PrefillVerdict {
        if let Some((at, queries)) = sample {
            match self.last {
                Some((t, _)) if t == at => {}
                Some((_, before)) => {
                    // A smaller value is a restarted engine: all of it is new.
                    let grew = if queries >= before {
                        queries - before
                    } else {
                        queries
                    };
                    let paid = self.pay(grew);
                    if paid > 0.0 {
                        let full = self.paid.len() >= MAX_OWED;
                        match self.paid.back_mut() {
                            Some(last) if full => last.1 += paid,
                            _ => self.paid.push_back((at, paid)),
                        }
                    }
                    self.last = Some((at, queries));
                }
                None => self.last = Some((at, queries)),
            }
        } else {
            // Nothing to judge by: never exclude on missing evidence.
            self.owed.clear();
        }
        if self.excluded_until.is_some_and(|t| now < t) {
            return PrefillVerdict::Excluded;
        }
        self.excluded_until = None;
        while self
            .paid
            .front()
            .is_some_and(|&(t, _)| now.saturating_duration_since(t) > unserved_after)
        {
            self.paid.pop_front();
        }
        let recently: f64 = self.paid.iter().map(|p| p.1).sum();
        // Overdue: old enough, and the pod has not served its worth in that time.
        let overdue = self.owed.front().is_some_and(|&(t, rest)| {
            now.saturating_duration_since(t) >= unserved_after && recently < rest
        });
        if unserved_after.is_zero() || self.owed.len() < MIN_UNSERVED || !overdue {
            return PrefillVerdict::Available;
        }
        self.excluded_until = Some(now + self.backoff);
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        self.exclusions += 1;
        self.owed.clear();
        PrefillVerdict::NewlyExcluded
    }

    /// Pays `tokens` oldest first; how much of it was owed.
    fn pay(&mut self, mut tokens: f64) -> f64 {
        let mut paid = 0.0;
        while let Some(front) = self.owed.front_mut() {
            if tokens < front.1 {
                front.1 -= tokens;
                return paid + tokens;
            }
            tokens -= front.1;
            paid += front.1;
            self.owed.pop_front();
            // It served one of ours: the next exclusion starts short again.
            self.backoff = FIRST_BACKOFF;
        }
        paid
    }

    /// Until when the pod is excluded, if it is at `now`.
    pub fn excluded_until(&self, now: Instant) -> Option<Instant> {
        self.excluded_until.filter(|&t| now < t)
    }

    /// Exclusions so far.
    pub fn exclusions(&self) -> u64 {
        self.exclusions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_secs(10);

    fn at(t0: Instant, s: u64) -> Instant {
        t0 + Duration::from_secs(s)
    }

    #[test]
    fn a_pod_that_serves_its_prefills_is_never_excluded() {
        let (t0, mut w) = (Instant::now(), PrefillWatch::default());
        assert_eq!(
            w.check(t0, Some((t0, 500.0)), AFTER),
            PrefillVerdict::Available
        );
        for s in 1..60 {
            w.sent(at(t0, s), 1000);
            // The counter lags a scrape but keeps up, other traffic included.
            let q = 500.0 + 1000.0 * (s - 1) as f64 + 7.0 * s as f64;
            assert_eq!(
                w.check(at(t0, s), Some((at(t0, s), q)), AFTER),
                PrefillVerdict::Available,
                "second {s}"
            );
        }
        assert_eq!(w.exclusions(), 0);
    }

    #[test]
    fn unserved_prefills_exclude_the_pod_with_a_doubling_backoff_reset_by_a_served_one() {
        let (t0, mut w) = (Instant::now(), PrefillWatch::default());
        w.check(t0, Some((t0, 100.0)), AFTER);
        w.sent(at(t0, 1), 2000);
        w.sent(at(t0, 2), 2000);
        // Other traffic (10 tokens) does not pay for 2,000-token prefills.
        let flat = |s| Some((at(t0, s), 110.0));
        assert_eq!(
            w.check(at(t0, 10), flat(10), AFTER),
            PrefillVerdict::Available
        );
        assert_eq!(
            w.check(at(t0, 11), flat(11), AFTER),
            PrefillVerdict::NewlyExcluded
        );
        assert_eq!(
            w.check(at(t0, 12), flat(12), AFTER),
            PrefillVerdict::Excluded
        );
        assert_eq!(w.excluded_until(at(t0, 12)), Some(at(t0, 41)));
        // Back after 30 s; two more unserved: excluded for 60 s.
        assert_eq!(
            w.check(at(t0, 41), flat(41), AFTER),
            PrefillVerdict::Available
        );
        w.sent(at(t0, 41), 2000);
        w.sent(at(t0, 42), 2000);
        assert_eq!(
            w.check(at(t0, 51), flat(51), AFTER),
            PrefillVerdict::NewlyExcluded
        );
        assert_eq!(w.excluded_until(at(t0, 51)), Some(at(t0, 111)));
        // Once it serves one, the next exclusion is short again.
        w.sent(at(t0, 111), 2000);
        w.check(at(t0, 112), Some((at(t0, 112), 2110.0)), AFTER);
        w.sent(at(t0, 113), 2000);
        w.sent(at(t0, 114), 2000);
        assert_eq!(
            w.check(at(t0, 124), Some((at(t0, 124), 2110.0)), AFTER),
            PrefillVerdict::NewlyExcluded
        );
        assert_eq!(w.excluded_until(at(t0, 124)), Some(at(t0, 154)));
        assert_eq!(w.exclusions(), 3);
    }

    #[test]
    fn a_saturated_pod_that_works_through_its_queue_slowly_is_not_excluded() {
        let (t0, mut w) = (Instant::now(), PrefillWatch::default());
        w.check(t0, Some((t0, 0.0)), AFTER);
        // 4,000 tokens sent each second, 1,000 scheduled: a queue growing for a minute.
        for s in 1..60 {
            w.sent(at(t0, s), 4000);
            let v = w.check(at(t0, s), Some((at(t0, s), 1000.0 * s as f64)), AFTER);
            assert_eq!(v, PrefillVerdict::Available, "second {s}");
        }
        // Then it stops taking any: excluded once nothing was paid for 10 s.
        let stuck = Some((at(t0, 60), 59_000.0));
        assert_eq!(w.check(at(t0, 68), stuck, AFTER), PrefillVerdict::Available);
        assert_eq!(
            w.check(at(t0, 70), stuck, AFTER),
            PrefillVerdict::NewlyExcluded
        );
    }

    #[test]
    fn one_slow_prefill_a_restart_or_no_counter_excludes_nothing() {
        let (t0, mut w) = (Instant::now(), PrefillWatch::default());
        w.check(t0, Some((t0, 5000.0)), AFTER);
        w.sent(at(t0, 1), 4000);
        assert_eq!(
            w.check(at(t0, 30), Some((at(t0, 30), 5000.0)), AFTER),
            PrefillVerdict::Available
        );
        // The engine restarted: its counter starts again at the prefill it served.
        w.sent(at(t0, 31), 100);
        assert_eq!(
            w.check(at(t0, 45), Some((at(t0, 45), 4100.0)), AFTER),
            PrefillVerdict::Available
        );
        // No counter at all: owed prefills are forgotten, not held against the pod.
        w.sent(at(t0, 46), 100);
        w.sent(at(t0, 47), 100);
        assert_eq!(w.check(at(t0, 90), None, AFTER), PrefillVerdict::Available);
        // Off.
        w.sent(at(t0, 91), 100);
        w.sent(at(t0, 92), 100);
        assert_eq!(
            w.check(at(t0, 200), Some((at(t0, 200), 4100.0)), Duration::ZERO),
            PrefillVerdict::Available
        );
    }

    #[test]
    fn a_flood_of_sends_keeps_the_ledger_bounded() {
        let (t0, mut w) = (Instant::now(), PrefillWatch::default());
        for i in 0..10_000 {
            w.sent(t0 + Duration::from_millis(i), 10);
        }
        assert_eq!(w.owed.len(), MAX_OWED);
        let total: f64 = w.owed.iter().map(|e| e.1).sum();
        assert_eq!(total, 100_000.0);
    }
}
