//! Readiness at start-up in precise mode. A router that has not yet read what each pod already
//! caches (its KV-event catch-up replay) routes on partial knowledge: a restarted replica beside
//! busy pods would send prompts to pods that do not hold them while the other replicas know
//! better. So `/readyz` waits until every pod known at start has had its first catch-up (done or
//! given up, each bounded by the subscriber's replay limits), for at most [`STARTUP_LIMIT`] in
//! all. Once ready, it never waits for a catch-up again: a pod joining later must not make every
//! replica unready at once.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::pods::{PodId, PodRegistry};

/// Longest readiness waits for catch-ups: the subscriber's connect wait and whole-replay limit
/// (1 s + 60 s), and room for a subscription started a little after the router.
pub(crate) const STARTUP_LIMIT: Duration = Duration::from_secs(75);

/// The start-up catch-ups readiness waits for.
#[derive(Debug)]
pub struct CatchUp {
    state: Mutex<State>,
    since: Instant,
    limit: Duration,
}

#[derive(Debug, Default)]
struct State {
    /// Readiness no longer waits (latched).
    over: bool,
    /// (pod, rank) subscriptions started so far; a restarted one does not wait again.
    seen: HashSet<(PodId, u32)>,
    /// Subscriptions whose first catch-up has not ended.
    pending: HashSet<(PodId, u32)>,
}

impl Default for CatchUp {
    fn default() -> Self {
        Self::with_limit(STARTUP_LIMIT)
    }
}

impl CatchUp {
    /// Waits at most `limit` from now.
    pub(crate) fn with_limit(limit: Duration) -> Self {
        Self {
            state: Mutex::new(State::default()),
            since: Instant::now(),
            limit,
        }
    }

    /// A subscription of `pod`'s rank `rank` started; `replays`: it has a replay socket, so a
    /// catch-up follows.
    pub(crate) fn started(&self, pod: &PodId, rank: u32, replays: bool) {
        let mut s = self.state.lock();
        if s.over || !s.seen.insert((pod.clone(), rank)) {
            return;
        }
        if replays {
            s.pending.insert((pod.clone(), rank));
        }
    }

    /// The subscription's catch-up ended (applied, or given up), or the subscription did.
    pub(crate) fn finished(&self, pod: &PodId, rank: u32) {
        let mut s = self.state.lock();
        if !s.over {
            s.pending.remove(&(pod.clone(), rank));
        }
    }

    /// The subscription was stopped (its pod left, or its endpoint changed).
    pub(crate) fn stopped(&self, pod: &PodId, rank: u32) {
        let mut s = self.state.lock();
        if !s.over {
            let key = (pod.clone(), rank);
            s.pending.remove(&key);
            s.seen.remove(&key);
        }
    }

    /// [`CatchUp::waiting`] for the registry's pods now healthy.
    pub fn waiting_on(&self, pods: &PodRegistry) -> Option<String> {
        let snapshot = pods.snapshot();
        let healthy = snapshot.pods().iter().filter(|p| p.is_healthy());
        self.waiting(healthy.map(|p| p.id()))
    }

    /// Why the router is not ready yet, given the pods now healthy: `None` once every one of
    /// them is subscribed and caught up, or the limit passed (from then on, always `None`).
    pub fn waiting<'a>(&self, healthy: impl IntoIterator<Item = &'a PodId>) -> Option<String> {
        let mut s = self.state.lock();
        if s.over {
            return None;
        }
        let unseen = healthy
            .into_iter()
            .filter(|p| !s.seen.iter().any(|(q, _)| q == *p))
            .count();
        if (unseen == 0 && s.pending.is_empty()) || self.since.elapsed() >= self.limit {
            // Latched: the sets are not needed any more.
            *s = State {
                over: true,
                ..State::default()
            };
            return None;
        }
        Some(format!(
            "KV-event catch-up: {} subscription(s) replaying, {unseen} healthy pod(s) not subscribed yet",
            s.pending.len()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_for_each_first_catch_up_then_never_again() {
        let c = CatchUp::default();
        let (a, b) = (PodId::new("10.0.0.1:8000"), PodId::new("10.0.0.2:8000"));
        assert!(
            c.waiting([&a]).is_some(),
            "a healthy pod not subscribed yet"
        );
        c.started(&a, 0, true);
        c.started(&b, 0, false);
        assert!(c.waiting([&a, &b]).unwrap().contains("1 subscription(s)"));
        // A restarted subscription does not wait again; the first one's end counts.
        c.finished(&a, 0);
        c.started(&a, 0, true);
        assert_eq!(c.waiting([&a, &b]), None);
        // Latched: a pod joining later never makes the router unready.
        let late = PodId::new("10.0.0.3:8000");
        c.started(&late, 0, true);
        assert_eq!(c.waiting([&a, &b, &late]), None);
    }

    #[test]
    fn a_stopped_subscription_is_not_waited_for_and_the_limit_ends_the_wait() {
        let c = CatchUp::default();
        let a = PodId::new("10.0.0.1:8000");
        c.started(&a, 0, true);
        c.started(&a, 1, true);
        c.stopped(&a, 1);
        assert!(c.waiting([&a]).is_some());
        c.finished(&a, 0);
        assert_eq!(c.waiting([&a]), None);
        let c = CatchUp::with_limit(Duration::ZERO);
        c.started(&a, 0, true);
        assert_eq!(c.waiting([&a]), None, "past the limit");
    }
}
