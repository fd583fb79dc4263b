//! Router-side in-flight accounting. A request counts against its pod from the moment it is
//! routed (before the reply reaches Envoy), so a burst cannot pile onto one pod between scrapes.
//! When the stream ends without the response being observed (BUFFERED mode), the request stays
//! counted until a scrape that started after that moment shows the pod's own view, and its
//! uncached tokens stay counted for their estimated prefill time.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::Pod;

#[derive(Debug)]
struct Settling {
    released_at: Instant,
    request_pending: bool,
    tokens: u64,
    tokens_until: Instant,
}

/// Per-pod counters shared by guards and scorers.
#[derive(Debug, Default)]
pub(crate) struct Inflight {
    requests: AtomicI64,
    tokens: AtomicI64,
    settling: Mutex<VecDeque<Settling>>,
}

// Bound on settling entries per pod: beyond it the oldest are dropped (they are estimates anyway).
const MAX_SETTLING: usize = 65_536;

impl Inflight {
    /// Requests and uncached tokens to count at `now`.
    pub(crate) fn current(&self, now: Instant, stale_after: Duration) -> (i64, i64) {
        let mut requests = self.requests.load(Ordering::Relaxed).max(0);
        let mut tokens = self.tokens.load(Ordering::Relaxed).max(0);
        let mut settling = self.settling.lock();
        settling.retain(|s| {
            let request =
                s.request_pending && now.saturating_duration_since(s.released_at) < stale_after;
            let token = s.tokens_until > now;
            request || token
        });
        for s in settling.iter() {
            if s.request_pending && now.saturating_duration_since(s.released_at) < stale_after {
                requests += 1;
            }
            if s.tokens_until > now {
                tokens += s.tokens as i64;
            }
        }
        (requests, tokens)
    }

    /// A scrape sent at `started` succeeded: requests released before then are in its numbers.
    pub(crate) fn observed_scrape(&self, started: Instant) {
        let mut settling = self.settling.lock();
        for s in settling.iter_mut() {
            if s.released_at < started {
                s.request_pending = false;
            }
        }
        settling.retain(|s| s.request_pending || s.tokens_until > started);
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
        let secs = if prefill_tokens_per_sec > 0.0 {
            tokens as f64 / prefill_tokens_per_sec
        } else {
            0.0
        };
        Self {
            pod,
            tokens,
            tokens_until: now + Duration::from_secs_f64(secs.min(3600.0)),
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
        let mut settling = self.pod.inflight.settling.lock();
        if settling.len() >= MAX_SETTLING {
            settling.pop_front();
        }
        settling.push_back(Settling {
            released_at: Instant::now(),
            request_pending: true,
            tokens: pending_tokens,
            tokens_until: self.tokens_until,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PodId, PodSpec};
    use super::*;

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
