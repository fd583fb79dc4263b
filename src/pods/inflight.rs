//! Router-side in-flight accounting. A request counts against its pod from the moment it is
//! routed (before the reply reaches Envoy), so a burst cannot pile onto one pod between scrapes.
//! When the stream ends without the response being observed (BUFFERED mode), the request stays
//! counted until a scrape that started after that moment shows the pod's own view, and its
//! uncached tokens stay counted for their estimated prefill time.
//!
//! The settling part is a plain queue with time passed in ([`Settling`]): the live pods run it on
//! the router's monotonic clock, `kv-bench simulate` on virtual time.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::{Pod, PodId, PodRegistry};
use crate::share::{Charge, Hold, Release, RemoteLoad};

/// A point in time on some monotonic clock: the router's, or a simulation's virtual one.
pub trait Timestamp: Copy + Ord {
    /// Time from `earlier` to `self` (zero if `earlier` is later).
    fn since(self, earlier: Self) -> Duration;
    /// `self + d`.
    fn after(self, d: Duration) -> Self;
}

impl Timestamp for Instant {
    fn since(self, earlier: Self) -> Duration {
        self.saturating_duration_since(earlier)
    }

    fn after(self, d: Duration) -> Self {
        self + d
    }
}

// Longest prefill a request is charged for: neither a bad rate nor a client's prompt length can
// pin tokens on a pod for longer (a 128k-token prefill takes well under a minute on a GPU).
pub const MAX_PREFILL: Duration = Duration::from_secs(300);

/// Estimated prefill time of `tokens` uncached tokens at `prefill_tokens_per_sec` (capped at
/// [`MAX_PREFILL`]; zero when the rate is not positive).
pub fn prefill_time(tokens: u64, prefill_tokens_per_sec: f64) -> Duration {
    if prefill_tokens_per_sec > 0.0 {
        Duration::from_secs_f64(
            (tokens as f64 / prefill_tokens_per_sec).min(MAX_PREFILL.as_secs_f64()),
        )
    } else {
        Duration::ZERO
    }
}

// Bound on settling entries per pod: beyond it the oldest are dropped (they are estimates anyway).
const MAX_SETTLING: usize = 65_536;

/// Requests whose stream ended unobserved, still counted against their pod: the request until a
/// scrape that started after its release (or `stale_after`), its uncached tokens until their
/// estimated prefill ends. Bounded; the oldest entries go first.
///
/// Every decision counts every candidate's queue, so counting pops what no longer counts instead
/// of scanning what does: releases come in time order (a queue), prefill ends in any order (a
/// min-heap beside a running sum). Another replica's held tokens ([`Hold`]) sit in the heap at
/// their bound and in `held`; released early, they leave `held` and their heap entry is skipped.
#[derive(Debug)]
pub struct Settling<T> {
    /// Release times of the requests still counted, oldest first.
    requests: VecDeque<T>,
    /// (end, tokens, hold) of the tokens still counted, soonest end on top.
    tokens: BinaryHeap<Reverse<(T, u64, Option<Hold>)>>,
    tokens_sum: u64,
    /// Held tokens not released yet: (tokens, predicted end of their prefill).
    held: HashMap<Hold, (u64, T)>,
    /// Start of the latest successful scrape: a request released before it is in its numbers.
    seen: Option<T>,
}

impl<T> Default for Settling<T> {
    fn default() -> Self {
        Self {
            requests: VecDeque::new(),
            tokens: BinaryHeap::new(),
            tokens_sum: 0,
            held: HashMap::new(),
            seen: None,
        }
    }
}

impl<T: Timestamp> Settling<T> {
    /// A request released at `released_at`, its `tokens` still prefilling until `tokens_until`.
    /// Another replica's request arrives late: released before the latest scrape, it is already
    /// in the pod's numbers, and only its tokens count.
    pub fn push(&mut self, released_at: T, tokens: u64, tokens_until: T) {
        self.push_request(released_at);
        self.push_tokens(tokens, tokens_until);
    }

    /// [`Self::push`] for another replica's request whose tokens count until that replica
    /// releases them ([`Self::release`]), until `bound` at most (a release lost, or its replica
    /// gone); `prefill_end` is when they would stop counting unheld.
    pub fn push_held(&mut self, at: T, tokens: u64, prefill_end: T, bound: T, hold: Hold) {
        self.push_request(at);
        if tokens > 0 && !self.held.contains_key(&hold) {
            self.push_entry(tokens, bound.max(prefill_end), Some(hold));
            self.held.insert(hold, (tokens, prefill_end));
        }
    }

    /// The replica holding `hold` released it at `now`: its tokens stop counting now (the
    /// response started), or at their predicted prefill end (the request settled).
    pub fn release(&mut self, hold: Hold, how: Release, now: T) {
        let Some((tokens, prefill_end)) = self.held.remove(&hold) else {
            return;
        };
        self.tokens_sum -= tokens;
        if how == Release::Settled && prefill_end > now {
            self.push_tokens(tokens, prefill_end);
        }
    }

    fn push_request(&mut self, released_at: T) {
        if self.seen.is_none_or(|seen| released_at >= seen) {
            if self.requests.len() >= MAX_SETTLING {
                self.requests.pop_front();
            }
            // Guards dropped on other threads may read the clock a little out of order.
            let released_at = self
                .requests
                .back()
                .map_or(released_at, |&b| b.max(released_at));
            self.requests.push_back(released_at);
        }
    }

    /// `tokens` still prefilling until `until`, for a request counted elsewhere.
    pub fn push_tokens(&mut self, tokens: u64, until: T) {
        if tokens > 0 {
            self.push_entry(tokens, until, None);
        }
    }

    fn push_entry(&mut self, tokens: u64, until: T, hold: Option<Hold>) {
        if self.tokens.len() >= MAX_SETTLING {
            self.pop_tokens();
        }
        self.tokens.push(Reverse((until, tokens, hold)));
        self.tokens_sum += tokens;
    }

    /// Requests and tokens still counted at `now`; forgets entries that no longer count.
    pub fn count(&mut self, now: T, stale_after: Duration) -> (u64, u64) {
        while self
            .requests
            .front()
            .is_some_and(|&r| now.since(r) >= stale_after)
        {
            self.requests.pop_front();
        }
        self.expire_tokens(now);
        (self.requests.len() as u64, self.tokens_sum)
    }

    /// A scrape sent at `started` succeeded: requests released before then are in its numbers.
    pub fn observed_scrape(&mut self, started: T) {
        self.seen = Some(self.seen.map_or(started, |s| s.max(started)));
        while self.requests.front().is_some_and(|&r| r < started) {
            self.requests.pop_front();
        }
        self.expire_tokens(started);
    }

    /// Drops tokens whose prefill ended by `at`.
    fn expire_tokens(&mut self, at: T) {
        while self
            .tokens
            .peek()
            .is_some_and(|Reverse((until, _, _))| *until <= at)
        {
            self.pop_tokens();
        }
    }

    /// Pops the soonest entry; a held one released already was taken off the sum then.
    fn pop_tokens(&mut self) {
        if let Some(Reverse((_, n, hold))) = self.tokens.pop() {
            if hold.is_none_or(|h| self.held.remove(&h).is_some()) {
                self.tokens_sum -= n;
            }
        }
    }
}

/// Per-pod counters shared by guards and scorers.
#[derive(Debug, Default)]
pub(crate) struct Inflight {
    requests: AtomicI64,
    tokens: AtomicI64,
    settling: Mutex<Settling<Instant>>,
}

impl Inflight {
    /// Requests and uncached tokens to count at `now`.
    pub(crate) fn current(&self, now: Instant, stale_after: Duration) -> (u64, u64) {
        let requests = self.requests.load(Ordering::Relaxed).max(0) as u64;
        let tokens = self.tokens.load(Ordering::Relaxed).max(0) as u64;
        let (r, t) = self.settling.lock().count(now, stale_after);
        (requests + r, tokens + t)
    }

    /// A scrape sent at `started` succeeded: requests released before then are in its numbers.
    pub(crate) fn observed_scrape(&self, started: Instant) {
        self.settling.lock().observed_scrape(started);
    }

    /// Whether anything still counts here besides this router's live guards: another
    /// replica's request or tokens, or a settled request of its own.
    pub(crate) fn settling(&self) -> bool {
        let s = self.settling.lock();
        !s.requests.is_empty() || s.tokens_sum > 0
    }

    pub(crate) fn raw(&self) -> (i64, i64) {
        (
            self.requests.load(Ordering::Relaxed),
            self.tokens.load(Ordering::Relaxed),
        )
    }
}

/// Longest another replica's held tokens count past their predicted prefill when its release
/// never comes (lost twice, or the replica gone): longer than a pod's queue under any sane load.
pub const MAX_HOLD: Duration = Duration::from_secs(30);

impl Pod {
    /// Counts a request another router replica sent here `at`: like a guard released at once,
    /// it counts until a scrape that started after `at` (or `stale_after`), and its uncached
    /// tokens until `prefill` after `at`, or with `hold` until that replica releases them
    /// (at most [`MAX_HOLD`] past the prefill).
    pub fn charge_remote(
        &self,
        at: Instant,
        uncached_tokens: u64,
        prefill: Duration,
        hold: Option<Hold>,
    ) {
        let prefill = prefill.min(MAX_PREFILL);
        let mut s = self.inflight.settling.lock();
        match hold {
            Some(h) => s.push_held(
                at,
                uncached_tokens,
                at + prefill,
                at + prefill + MAX_HOLD,
                h,
            ),
            None => s.push(at, uncached_tokens, at + prefill),
        }
    }

    /// The replica that charged `hold` here released it.
    pub fn release_remote(&self, hold: Hold, how: Release) {
        self.inflight
            .settling
            .lock()
            .release(hold, how, Instant::now());
    }
}

/// The other replicas' decisions (through a shared index's mirror) charge the pods here.
impl RemoteLoad for PodRegistry {
    fn charge(&self, pod: &PodId, charge: Charge, age: Duration, hold: Option<Hold>) {
        if let Some(p) = self.snapshot().get(pod) {
            let now = Instant::now();
            let at = now.checked_sub(age).unwrap_or(now);
            let prefill = Duration::from_millis(charge.prefill_ms);
            p.charge_remote(at, charge.uncached_tokens, prefill, hold);
        }
    }

    fn release(&self, pod: &PodId, hold: Hold, how: Release) {
        if let Some(p) = self.snapshot().get(pod) {
            p.release_remote(hold, how);
        }
    }
}

/// Holds one routed request's load on its pod. Dropped, it settles (counted until the pod's
/// next scrape) unless [`InflightGuard::ends_with_drop`] said its owner's end is the request's.
#[derive(Debug)]
pub struct InflightGuard {
    pod: Arc<Pod>,
    tokens: u64,
    tokens_until: Instant,
    prefill_done: bool,
    completed: bool,
    drop_completes: bool,
    on_release: Option<OnRelease>,
}

/// Told once how the guard's tokens stopped counting here (the other replicas hold them until).
pub struct OnRelease(Box<dyn FnOnce(Release) + Send + Sync>);

impl std::fmt::Debug for OnRelease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnRelease")
    }
}

impl InflightGuard {
    pub(super) fn new(
        pod: Arc<Pod>,
        tokens: u64,
        now: Instant,
        prefill_tokens_per_sec: f64,
    ) -> Self {
        pod.inflight.requests.fetch_add(1, Ordering::Relaxed);
        pod.inflight
            .tokens
            .fetch_add(tokens as i64, Ordering::Relaxed);
        Self {
            pod,
            tokens,
            tokens_until: now + prefill_time(tokens, prefill_tokens_per_sec),
            prefill_done: false,
            completed: false,
            drop_completes: false,
            on_release: None,
        }
    }

    /// Calls `f` once, when this request's tokens stop counting here: at the response's start
    /// or end ([`Release::Started`]), or when the stream ends unobserved ([`Release::Settled`]).
    pub fn on_release(&mut self, f: impl FnOnce(Release) + Send + Sync + 'static) {
        self.on_release = Some(OnRelease(Box::new(f)));
    }

    /// Dropping the guard from now on means the request is over: Envoy ends an ext_proc stream
    /// when the HTTP stream ends (1.40, every body mode), so a reset releases at once instead of
    /// waiting for a scrape (a client's next question then found its own last one in flight).
    pub fn ends_with_drop(mut self) -> Self {
        self.drop_completes = true;
        self
    }

    /// The stream ended without showing the request's end (a half-close, or this router ended
    /// it): counted until the pod's next scrape shows its own numbers.
    pub fn settle(mut self) {
        self.drop_completes = false;
    }
    /// The pod's first token is out: its prefill is over.
    pub fn prefill_done(&mut self) {
        self.release_tokens(Release::Started);
    }

    /// The response started, but its first token will not be seen (a streamed response whose
    /// body does not pass the router): the uncached tokens count until their estimated prefill
    /// end, as a settled request's do. Streamed headers come before the prefill, even queued.
    pub fn prefill_by_estimate(&mut self) {
        if self.prefill_done {
            return;
        }
        let tokens = self.tokens;
        self.release_tokens(Release::Settled);
        self.pod
            .inflight
            .settling
            .lock()
            .push_tokens(tokens, self.tokens_until);
    }

    fn release_tokens(&mut self, how: Release) {
        if !self.prefill_done {
            self.prefill_done = true;
            self.pod
                .inflight
                .tokens
                .fetch_sub(self.tokens as i64, Ordering::Relaxed);
        }
        if let Some(OnRelease(f)) = self.on_release.take() {
            f(how);
        }
    }

    /// The response ended and was observed: release everything now.
    pub fn complete(mut self) {
        self.release_now();
    }

    fn release_now(&mut self) {
        self.prefill_done();
        self.completed = true;
        self.pod.inflight.requests.fetch_sub(1, Ordering::Relaxed);
    }

    /// The pod this guard charges.
    pub fn pod(&self) -> &Arc<Pod> {
        &self.pod
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        if self.completed {
            return;
        }
        if self.drop_completes {
            self.release_now();
            return;
        }
        let pending_tokens = if self.prefill_done { 0 } else { self.tokens };
        self.release_tokens(Release::Settled);
        self.pod.inflight.requests.fetch_sub(1, Ordering::Relaxed);
        // Drop cannot take the time as an argument: the live clock is read here.
        self.pod
            .inflight
            .settling
            .lock()
            .push(Instant::now(), pending_tokens, self.tokens_until);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PodId, PodSpec};
    use super::*;

    #[test]
    fn no_prompt_pins_tokens_on_a_pod_for_more_than_five_minutes() {
        // 16 M tokens (a 64 MiB body) at the default 10k tokens/s once counted for an hour.
        assert_eq!(prefill_time(16 << 20, 10_000.0), MAX_PREFILL);
        assert!(MAX_PREFILL <= Duration::from_secs(300));
        assert_eq!(prefill_time(10_000, 10_000.0), Duration::from_secs(1));
    }

    fn pod() -> Arc<Pod> {
        Arc::new(Pod::new(super::super::test_spec("127.0.0.1:1")))
    }

    #[tokio::test(start_paused = true)]
    async fn counted_until_a_later_scrape() {
        let p = pod();
        let stale = Duration::from_secs(2);
        let g = p.begin_request(1000, Instant::now(), 1000.0);
        assert_eq!(p.inflight.current(Instant::now(), stale), (1, 1000));
        drop(g);
        // Stream over, pod metrics not seen yet: still counted.
        assert_eq!(p.inflight.current(Instant::now(), stale), (1, 1000));
        let before = Instant::now();
        tokio::time::advance(Duration::from_millis(10)).await;
        p.inflight.observed_scrape(before); // scrape sent before the release: no effect
        assert_eq!(p.inflight.current(Instant::now(), stale).0, 1);
        p.inflight.observed_scrape(Instant::now());
        // Request now visible in the pod's own numbers; tokens still prefilling (1 s estimate).
        assert_eq!(p.inflight.current(Instant::now(), stale), (0, 1000));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(p.inflight.current(Instant::now(), stale), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn observed_response_releases_at_once() {
        let p = pod();
        let stale = Duration::from_secs(2);
        let mut g = p.begin_request(500, Instant::now(), 1000.0);
        g.prefill_done();
        assert_eq!(p.inflight.current(Instant::now(), stale), (1, 0));
        g.complete();
        assert_eq!(p.inflight.current(Instant::now(), stale), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_guard_whose_drop_is_the_requests_end_releases_at_once() {
        let p = pod();
        let stale = Duration::from_secs(2);
        let g = p
            .begin_request(500, Instant::now(), 1000.0)
            .ends_with_drop();
        drop(g);
        assert_eq!(p.inflight.current(Instant::now(), stale), (0, 0));
        // The same guard told its stream ended without the response settles as before.
        let g = p
            .begin_request(500, Instant::now(), 1000.0)
            .ends_with_drop();
        g.settle();
        assert_eq!(p.inflight.current(Instant::now(), stale), (1, 500));
        tokio::time::advance(Duration::from_millis(1)).await;
        p.inflight.observed_scrape(Instant::now());
        assert_eq!(p.inflight.current(Instant::now(), stale), (0, 500));
    }

    #[tokio::test(start_paused = true)]
    async fn another_replicas_request_counts_until_a_later_scrape() {
        let reg = PodRegistry::default();
        let id = PodId::new("127.0.0.1:1");
        reg.update(vec![PodSpec {
            id: id.clone(),
            addr: "127.0.0.1:1".parse().unwrap(),
            models: vec![],
            labels: Default::default(),
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
        }]);
        let p = reg.snapshot().get(&id).unwrap().clone();
        let stale = Duration::from_secs(2);
        let charge = Charge {
            uncached_tokens: 800,
            prefill_ms: 1_000,
            mark: None,
            announced: None,
        };
        let decided = Instant::now();
        tokio::time::advance(Duration::from_millis(40)).await;
        // Heard of 40 ms after the other replica decided; unknown pods are ignored.
        reg.charge(&id, charge, Duration::from_millis(40), None);
        reg.charge(&PodId::new("gone:1"), charge, Duration::ZERO, None);
        assert_eq!(p.inflight.current(Instant::now(), stale), (1, 800));
        p.inflight
            .observed_scrape(decided + Duration::from_millis(1));
        assert_eq!(p.inflight.current(Instant::now(), stale), (0, 800));
        // Heard of after a scrape that started after it: already in the pod's numbers.
        reg.charge(&id, charge, Duration::from_millis(40), None);
        assert_eq!(p.inflight.current(Instant::now(), stale), (0, 1_600));
        // Its prefill estimate runs from the decision, not from when it was heard of.
        tokio::time::advance(Duration::from_millis(961)).await;
        assert_eq!(p.inflight.current(Instant::now(), stale), (0, 0));
    }

    /// Milliseconds on a test clock.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    struct Ms(u64);

    impl Timestamp for Ms {
        fn since(self, earlier: Self) -> Duration {
            Duration::from_millis(self.0.saturating_sub(earlier.0))
        }
        fn after(self, d: Duration) -> Self {
            Ms(self.0 + d.as_millis() as u64)
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// After `dt` ms, a release `late` ms ago with `tokens` prefilling for `prefill` ms more
        /// from then (late: another replica's request, heard of after the fact).
        Push {
            dt: u64,
            late: u64,
            tokens: u64,
            prefill: u64,
        },
        /// After `dt` ms, a count.
        Count { dt: u64 },
        /// A scrape that started `back` ms ago succeeded.
        Scrape { back: u64 },
        /// Like `Push`, another replica's request held until released or `bound` ms after its
        /// prefill.
        Hold {
            dt: u64,
            late: u64,
            tokens: u64,
            prefill: u64,
            bound: u64,
        },
        /// The `pick`th push (modulo) is released, `started` or settled.
        Release { pick: usize, started: bool },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            3 => (
                0u64..50,
                prop_oneof![3 => Just(0u64), 1 => 0u64..300],
                prop_oneof![Just(0u64), 1u64..1000],
                0u64..3000,
            )
                .prop_map(|(dt, late, tokens, prefill)| Op::Push { dt, late, tokens, prefill }),
            2 => (0u64..400).prop_map(|dt| Op::Count { dt }),
            1 => (0u64..300).prop_map(|back| Op::Scrape { back }),
            2 => (0u64..50, 0u64..300, 1u64..1000, 0u64..3000, 0u64..3000).prop_map(
                |(dt, late, tokens, prefill, bound)| Op::Hold { dt, late, tokens, prefill, bound }
            ),
            2 => (0usize..64, proptest::bool::ANY)
                .prop_map(|(pick, started)| Op::Release { pick, started }),
        ]
    }

    proptest::proptest! {
        /// The queue and heap count exactly what a scan of every released request counts.
        #[test]
        fn settling_counts_what_a_scan_of_every_entry_counts(
            ops in proptest::collection::vec(op(), 1..200)
        ) {
            let stale = Duration::from_millis(2000);
            let mut s = Settling::<Ms>::default();
            // (released_at, request still pending, tokens, tokens_until, held: prefill end)
            let mut all: Vec<Entry> = Vec::new();
            let (mut now, mut seen, mut last) = (0u64, None::<u64>, 0u64);
            type Entry = (u64, bool, u64, u64, Option<u64>);
            let request = |all: &mut Vec<Entry>, seen: Option<u64>, last: &mut u64, at: u64, e: (u64, u64, Option<u64>)| {
                // Counted from the latest release so far, unless a scrape saw it.
                let pending = seen.is_none_or(|seen| at >= seen);
                if pending {
                    *last = (*last).max(at);
                }
                all.push((*last, pending, e.0, e.1, e.2));
            };
            for op in ops {
                match op {
                    Op::Push { dt, late, tokens, prefill } => {
                        now += dt;
                        let at = now.saturating_sub(late);
                        s.push(Ms(at), tokens, Ms(at + prefill));
                        request(&mut all, seen, &mut last, at, (tokens, at + prefill, None));
                    }
                    Op::Hold { dt, late, tokens, prefill, bound } => {
                        now += dt;
                        let at = now.saturating_sub(late);
                        let hold = Hold { origin: 1, seq: all.len() as u64 };
                        let (end, bound) = (at + prefill, at + prefill + bound);
                        s.push_held(Ms(at), tokens, Ms(end), Ms(bound), hold);
                        request(&mut all, seen, &mut last, at, (tokens, bound, Some(end)));
                    }
                    Op::Release { pick, started } => {
                        if all.is_empty() {
                            continue;
                        }
                        let i = pick % all.len();
                        let how = if started { Release::Started } else { Release::Settled };
                        s.release(Hold { origin: 1, seq: i as u64 }, how, Ms(now));
                        let e = &mut all[i];
                        if let Some(end) = e.4.take() {
                            e.3 = match how {
                                Release::Settled if end > now => end,
                                _ => e.3.min(now),
                            };
                        }
                    }
                    Op::Count { dt } => {
                        now += dt;
                        let requests = all
                            .iter()
                            .filter(|e| e.1 && now - e.0 < stale.as_millis() as u64)
                            .count() as u64;
                        let tokens: u64 = all.iter().filter(|e| e.3 > now).map(|e| e.2).sum();
                        proptest::prop_assert_eq!(s.count(Ms(now), stale), (requests, tokens));
                    }
                    Op::Scrape { back } => {
                        let started = now.saturating_sub(back);
                        s.observed_scrape(Ms(started));
                        seen = Some(seen.map_or(started, |s: u64| s.max(started)));
                        for e in all.iter_mut().filter(|e| e.0 < started) {
                            e.1 = false;
                        }
                    }
                }
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_guard_tells_once_how_its_tokens_stopped_counting() {
        let p = pod();
        let told = Arc::new(Mutex::new(Vec::new()));
        let guard = |told: &Arc<Mutex<Vec<Release>>>| {
            let mut g = p.begin_request(100, Instant::now(), 1000.0);
            let t = told.clone();
            g.on_release(move |how| t.lock().push(how));
            g
        };
        // The response started, then ended: told once, at the start.
        let mut g = guard(&told);
        g.prefill_done();
        g.prefill_done();
        g.complete();
        // Ended unobserved: settled. Ended by its stream's end (a reset): started.
        guard(&told).settle();
        drop(guard(&told).ends_with_drop());
        assert_eq!(
            *told.lock(),
            [Release::Started, Release::Settled, Release::Started]
        );
    }

    #[test]
    fn another_replicas_held_tokens_stop_at_their_release_or_bound() {
        let stale = Duration::from_secs(60);
        let mut s = Settling::<Ms>::default();
        let h = |seq| Hold { origin: 9, seq };
        // Predicted to prefill by 100 ms, held until 30 s after that at most.
        s.push_held(Ms(0), 500, Ms(100), Ms(30_100), h(1));
        s.push_held(Ms(0), 300, Ms(100), Ms(30_100), h(2));
        s.push_held(Ms(0), 200, Ms(5_000), Ms(35_000), h(3));
        assert_eq!(
            s.count(Ms(1_000), stale),
            (3, 1_000),
            "past the prefill, still held"
        );
        s.release(h(1), Release::Started, Ms(1_000));
        s.release(h(1), Release::Started, Ms(1_000));
        s.release(h(3), Release::Settled, Ms(1_000));
        assert_eq!(
            s.count(Ms(1_000), stale),
            (3, 500),
            "one gone, one until its prefill"
        );
        assert_eq!(s.count(Ms(5_000), stale), (3, 300));
        // Its release never came.
        assert_eq!(s.count(Ms(30_100), stale), (3, 0));
        s.release(h(2), Release::Settled, Ms(30_200));
        assert_eq!(s.count(Ms(30_200), stale), (3, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn settling_expires_without_scrapes() {
        let p = pod();
        let stale = Duration::from_secs(2);
        drop(p.begin_request(0, Instant::now(), 1000.0));
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(p.inflight.current(Instant::now(), stale), (0, 0));
    }
}
