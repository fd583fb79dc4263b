//! The pods as the router sees them in virtual time: the last scrape and the router's own
//! in-flight settling queue (the live router's `Settling`, on virtual microseconds).

use std::time::Duration;

use kv_router::pods::{prefill_time, LoadSample, PodLoad, Settling, Timestamp, TtftLearner};

use crate::sim::engine::Engine;

/// Virtual time in microseconds, as the router's in-flight accounting sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct SimTime(pub(super) u64);

impl Timestamp for SimTime {
    fn since(self, earlier: Self) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }

    fn after(self, d: Duration) -> Self {
        SimTime(self.0 + d.as_micros() as u64)
    }
}

/// A pod as the router sees it: last scrape plus its own in-flight accounting (`pods/inflight.rs`
/// in BUFFERED mode: every guard is released as soon as the request is routed).
#[derive(Debug, Default)]
pub(super) struct PodView {
    pub(super) sample: Option<(SimTime, LoadSample)>,
    pub(super) settling: Settling<SimTime>,
    /// The prefill model learned from the engine's timing counters, as `Pod` learns it.
    pub(super) ttft: TtftLearner,
}

impl PodView {
    /// `Pod::load` at `now`.
    pub(super) fn load(&mut self, now: SimTime, stale_after: Duration) -> PodLoad {
        let inflight = self.settling.count(now, stale_after);
        PodLoad::at(now, self.sample, inflight, stale_after)
    }

    /// A scrape sent at `now` succeeded (`Pod::record_sample`).
    pub(super) fn scrape(&mut self, now: SimTime, e: &Engine) {
        let s = e.stats();
        self.sample = Some((
            now,
            LoadSample {
                waiting: s.waiting as f64,
                running: s.running as f64,
                kv_usage: s.kv_cache_usage,
                timing: Some(s.timing()),
                ..LoadSample::default()
            },
        ));
        self.settling.observed_scrape(now);
        self.ttft.observe(s.timing(), s.waiting + s.running == 0);
    }

    /// A request was routed here at `now` with `tokens` estimated uncached prompt tokens.
    pub(super) fn routed(&mut self, now: SimTime, tokens: u64, prefill_tokens_per_sec: f64) {
        let until = now.after(prefill_time(tokens, prefill_tokens_per_sec));
        self.settling.push(now, tokens, until);
    }
}
