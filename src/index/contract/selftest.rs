//! Negative controls: the suite must fail backends with deliberate, realistic flaws, each caught
//! by the check aimed at it. A suite that passes these would pass anything.

use async_trait::async_trait;

use super::backends::{events, memory, EVENTS, MEMORY};
use super::{run, Setup};
use crate::blocks::BlockKey;
use crate::events::{KvEvent, KvEventBatch};
use crate::index::{ApplyStats, IndexError, IndexStats, KvIndex};
use crate::pods::PodId;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flaw {
    /// Counts every held key instead of stopping at the first missing one.
    NoPrefixStop,
    /// `forget_pod` does nothing.
    IgnoresForget,
    /// Lookups ignore the clock, so recorded entries never expire.
    NeverExpires,
    /// `BlockRemoved` events are acknowledged but not applied.
    DropsRemovals,
    /// `forget_rank` falls back to forgetting the whole pod (the trait's default).
    ForgetsAllRanks,
}

/// A correct backend with one flaw.
struct Flawed<B> {
    inner: B,
    flaw: Flaw,
}

#[async_trait]
impl<B: KvIndex> KvIndex for Flawed<B> {
    async fn lookup(
        &self,
        keys: &[BlockKey],
        pods: &[PodId],
        now_ms: u64,
    ) -> Result<Vec<f64>, IndexError> {
        match self.flaw {
            Flaw::NoPrefixStop => {
                let mut total = vec![0.0; pods.len()];
                for key in keys {
                    let one = self
                        .inner
                        .lookup(std::slice::from_ref(key), pods, now_ms)
                        .await?;
                    total.iter_mut().zip(one).for_each(|(t, w)| *t += w);
                }
                Ok(total)
            }
            Flaw::NeverExpires => self.inner.lookup(keys, pods, 0).await,
            _ => self.inner.lookup(keys, pods, now_ms).await,
        }
    }
    async fn record(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64) -> Result<(), IndexError> {
        self.inner.record(pod, keys, now_ms).await
    }
    async fn forget_pod(&self, pod: &PodId) -> Result<(), IndexError> {
        match self.flaw {
            Flaw::IgnoresForget => Ok(()),
            _ => self.inner.forget_pod(pod).await,
        }
    }
    async fn set_capacity(&self, pod: &PodId, blocks: usize) -> Result<(), IndexError> {
        self.inner.set_capacity(pod, blocks).await
    }
    async fn sweep(&self, now_ms: u64) -> Result<(), IndexError> {
        self.inner.sweep(now_ms).await
    }
    async fn apply_events(
        &self,
        pod: &PodId,
        rank: u32,
        model: &str,
        batch: &KvEventBatch,
    ) -> Result<ApplyStats, IndexError> {
        let mut batch = batch.clone();
        if self.flaw == Flaw::DropsRemovals {
            batch
                .events
                .retain(|e| !matches!(e, KvEvent::BlockRemoved { .. }));
        }
        self.inner.apply_events(pod, rank, model, &batch).await
    }
    async fn forget_rank(&self, pod: &PodId, rank: u32) -> Result<(), IndexError> {
        match self.flaw {
            Flaw::ForgetsAllRanks => self.inner.forget_pod(pod).await,
            _ => self.inner.forget_rank(pod, rank).await,
        }
    }
    fn stats(&self) -> IndexStats {
        self.inner.stats()
    }
    fn describe(&self) -> &'static str {
        "flawed"
    }
}

fn flawed_memory(
    flaw: Flaw,
) -> impl Fn(Setup) -> std::future::Ready<Flawed<crate::index::MemoryIndex>> {
    move |s| {
        std::future::ready(Flawed {
            inner: memory(s),
            flaw,
        })
    }
}

fn flawed_events(
    flaw: Flaw,
) -> impl Fn(Setup) -> std::future::Ready<Flawed<crate::index::EventIndex>> {
    move |s| {
        std::future::ready(Flawed {
            inner: events(s),
            flaw,
        })
    }
}

#[tokio::test]
async fn catches_a_lookup_that_does_not_stop_at_the_first_missing_block() {
    run(
        "no-prefix-stop memory",
        MEMORY,
        flawed_memory(Flaw::NoPrefixStop),
    )
    .await
    .assert_caught("record_then_lookup_counts_the_consecutive_prefix");
    run(
        "no-prefix-stop events",
        EVENTS,
        flawed_events(Flaw::NoPrefixStop),
    )
    .await
    .assert_caught("stored_blocks_match_until_removed_or_cleared");
}

#[tokio::test]
async fn catches_a_backend_that_ignores_forget_pod() {
    let report = run("ignores-forget", EVENTS, flawed_events(Flaw::IgnoresForget)).await;
    report.assert_caught("forget_pod_drops_that_pod_only");
    report.assert_caught("freed_slots_carry_nothing_over");
}

#[tokio::test]
async fn catches_entries_that_never_expire() {
    run("never-expires", MEMORY, flawed_memory(Flaw::NeverExpires))
        .await
        .assert_caught("recorded_entries_expire_after_the_ttl");
}

#[tokio::test]
async fn catches_dropped_removals() {
    let report = run("drops-removals", EVENTS, flawed_events(Flaw::DropsRemovals)).await;
    report.assert_caught("stored_blocks_match_until_removed_or_cleared");
    report.assert_caught("replayed_events_change_nothing");
}

#[tokio::test]
async fn catches_a_rank_reset_that_forgets_every_rank() {
    run(
        "forgets-all-ranks",
        EVENTS,
        flawed_events(Flaw::ForgetsAllRanks),
    )
    .await
    .assert_caught("forget_rank_keeps_other_ranks");
}

#[tokio::test]
async fn catches_a_backend_that_ignores_its_capacity() {
    // Built with far more room than the suite asked for: nothing is ever evicted.
    let unbounded = |s: Setup| async move {
        memory(Setup {
            capacity: s.capacity * 1000,
            ..s
        })
    };
    let report = run("unbounded", MEMORY, unbounded).await;
    report.assert_caught("capacity_evicts_least_recent_and_keeps_prompt_heads");
    report.assert_caught("recorded_size_stays_bounded");
}
