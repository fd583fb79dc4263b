//! Router-side in-flight accounting. A request counts against its pod from the moment it is
//! routed (before the reply reaches Envoy), so a burst cannot pile onto one pod between scrapes.
//! When the stream ends without the response being observed (BUFFERED mode), the request stays
//! counted until a scrape that started after that moment shows the pod's own view, and its
//! uncached tokens stay counted for their estimated prefill time.
//!
//! The settling part is a plain queue with time passed in ([`Settling`]): the live pods run it on
//! the router's monotonic clock, `kv-bench simulate` on virtual time.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::Pod;

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

#[derive(Debug, Clone, Copy)]
struct Entry<T> {
    released_at: T,
    request_pending: bool,
    tokens: u64,
    tokens_until: T,
}

// Bound on settling entries per pod: beyond it the oldest are dropped (they are estimates anyway).
const MAX_SETTLING: usize = 65_536;

/// Requests whose stream ended unobserved, still counted against their pod: the request until a
/// scrape that started after its release (or `stale_after`), its uncached tokens until their
/// estimated prefill ends. Bounded; the oldest entries go first.
#[derive(Debug)]
pub struct Settling<T> {
    entries: VecDeque<Entry<T>>,
}

impl<T> Default for Settling<T> {
    fn default() -> Self {
        Self {
            entries: VecDeque::new(),
        }
    }
}

impl<T: Timestamp> Settling<T> {
    /// A request released at `released_at`, its `tokens` still prefilling until `tokens_until`.
    pub fn push(&mut self, released_at: T, tokens: u64, tokens_until: T) {
        if self.entries.len() >= MAX_SETTLING {
            self.entries.pop_front();
        }
        self.entries.push_back(Entry {
            released_at,
            request_pending: true,
            tokens,
            tokens_until,
        });
    }

    /// Requests and tokens still counted at `now`; forgets entries that no longer count.
    pub fn count(&mut self, now: T, stale_after: Duration) -> (u64, u64) {
        let request = |e: &Entry<T>| e.request_pending && now.since(e.released_at) < stale_after;
        self.entries.retain(|e| request(e) || e.tokens_until > now);
        let (mut requests, mut tokens) = (0, 0);
        for e in &self.entries {
            if request(e) {
                requests += 1;
            }
            if e.tokens_until > now {
                tokens += e.tokens;
            }
        }
        (requests, tokens)
    }

    /// A scrape sent at `started` succeeded: requests released before then are in its numbers.
    pub fn observed_scrape(&mut self, started: T) {
        for e in self.entries.iter_mut() {
            if e.released_at < started {
                e.request_pending = false;
            }
        }
        self.entries
            .retain(|e| e.request_pending || e.tokens_until > started);
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

    pub(crate) fn raw(&self) -> (i64, i64) {
        (
            self.requests.load(Ordering::Relaxed),
            self.tokens.load(Ordering::Relaxed),
        )
    }
}

/// Holds one routed request's load on its pod; released on drop (stream end, reset or
/// disconnect alike).
#[derive(Debug)]
pub struct InflightGuard {
    pod: Arc<Pod>,
    tokens: u64,
    tokens_until: Instant,
    prefill_done: bool,
    completed: bool,
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
        }
    }
    /// The pod's response has started: its prefill is over.
    pub fn prefill_done(&mut self) {
        if !self.prefill_done {
            self.prefill_done = true;
            self.pod
                .inflight
                .tokens
                .fetch_sub(self.tokens as i64, Ordering::Relaxed);
        }
    }

    /// The response ended and was observed: release everything now.
    pub fn complete(mut self) {
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
        let pending_tokens = if self.prefill_done { 0 } else { self.tokens };
        self.prefill_done();
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
        Arc::new(Pod::new(PodSpec {
            id: PodId::new("127.0.0.1:1"),
            addr: "127.0.0.1:1".parse().unwrap(),
            models: vec![],
            labels: Default::default(),
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
        }))
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
    async fn settling_expires_without_scrapes() {
        let p = pod();
        let stale = Duration::from_secs(2);
        drop(p.begin_request(0, Instant::now(), 1000.0));
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(p.inflight.current(Instant::now(), stale), (0, 0));
    }
}
