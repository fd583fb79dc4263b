//! The load stream (`mirror_load`): each routed decision's load reaches the other replicas
//! the moment it is committed, apart from and ahead of its record, so two replicas deciding a
//! few milliseconds apart do not both take the same idle pod for the least loaded one.
//!
//! - At commit, before the reply, a replica queues the load (pod, uncached tokens, prefill
//!   time, a sequence number) for a task of its own that `XADD`s it to `P:load` (`MAXLEN ~`
//!   [`MAX_LEN`]) on a connection of its own: a few dozen bytes, never behind a record's keys.
//! - A reader task follows `P:load` with blocking `XREAD`s on another connection of its own and
//!   charges the other replicas' loads at once, not behind the records the mirror applies.
//! - The record still carries the load, with its sequence number: whichever of the two arrives
//!   first charges it and the other is skipped ([`Seen`]), so a replica that missed the load
//!   entry (or an older replica that never reads the stream) still counts it once.
//! - Nothing is reloaded: a load older than `mirror_max_lag_ms` is not charged (a scrape has
//!   seen the request by then), so at start and after a reconnect the reader reads on from the
//!   entries of the last `mirror_max_lag_ms`.
//!
//! Who may call: nobody; replicas only, as for the mirror stream. Entries are bounded before use
//! (pod name, tokens and prefill time as for records); others are skipped and counted.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use lru::LruCache;
use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::announced::{Announced, Kind};
use super::metrics::Dropped;
use super::peers::Peers;
use super::state::Shared;
use super::stream::{read_after, supervise, EntryId, MAX_CHARGE_MS, MAX_CHARGE_TOKENS};
use crate::index::IndexError;
use crate::pods::PodId;
use crate::share::{Charge, Release};

/// Entries the stream keeps (`MAXLEN ~`): far more than the loads of `mirror_max_lag_ms`.
pub(super) const MAX_LEN: usize = 10_000;
/// Loads queued for publishing at most (more are dropped and counted).
pub(super) const QUEUE: usize = 4_096;
/// Loads published per pipelined batch.
const PUBLISH_BATCH: usize = 256;
/// Charged loads remembered, so the record of one is not charged again (at 1,000 requests/s,
/// 16 s of them: far past `mirror_max_lag_ms`).
const SEEN: usize = 16_384;

/// The loads this replica charged, by origin and sequence number: the first of a load's copies
/// (datagram, load entry, record) to arrive is charged, the others are not; and whether it was
/// released (a release that came first leaves its load uncharged).
pub(super) struct Seen(Mutex<LruCache<(u64, u64), bool>>);

impl Seen {
    pub(super) fn new() -> Self {
        Self(Mutex::new(LruCache::new(
            NonZeroUsize::new(SEEN).expect("non-zero"),
        )))
    }

    /// Whether this is the load's first copy here (and from now on, it is not).
    pub(super) fn first(&self, origin: u64, seq: u64) -> bool {
        let mut seen = self.0.lock();
        if seen.get(&(origin, seq)).is_some() {
            return false;
        }
        seen.put((origin, seq), false);
        true
    }

    /// Whether the load is charged here and this is its release's first copy (from now on, a
    /// copy of the load or of its release changes nothing).
    pub(super) fn release(&self, origin: u64, seq: u64) -> bool {
        let mut seen = self.0.lock();
        match seen.get_mut(&(origin, seq)) {
            Some(released) => !std::mem::replace(released, true),
            None => {
                seen.put((origin, seq), true);
                false
            }
        }
    }
}

/// This replica's side of the load stream: its sequence numbers and publishing queue.
pub(super) struct LoadStream {
    origin: u64,
    next: AtomicU64,
    tx: mpsc::Sender<Announced>,
    /// Where each load is also sent straight to the other replicas (`load_peers_bind`).
    pub(super) peers: Option<Arc<Peers>>,
}

impl LoadStream {
    /// The stream of replica `origin`, with its publisher task (restarted if it panics, and
    /// counted; the reader is started apart).
    pub(super) fn start(shared: Arc<Shared>, origin: u64, peers: Option<Arc<Peers>>) -> Arc<Self> {
        let (tx, rx) = mpsc::channel(QUEUE);
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        let sh = shared.clone();
        supervise(shared, move || publish(sh.clone(), rx.clone()));
        Arc::new(Self {
            origin,
            next: AtomicU64::new(1),
            tx,
            peers,
        })
    }

    /// Sends `charge` on `pod`, committed at `wall_us`, and answers its sequence number (never
    /// waits; a full queue drops the stream copy and counts). The number is answered even then:
    /// the record carries it, so a datagram and the record are not both charged, and the
    /// release follows (without it, the others would hold the tokens to their bound).
    pub(super) fn announce(
        &self,
        shared: &Shared,
        pod: &PodId,
        wall_us: u64,
        charge: &Charge,
    ) -> u64 {
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        let a = Announced {
            origin: self.origin,
            seq,
            pod: pod.clone(),
            wall_us,
            uncached_tokens: charge.uncached_tokens.min(MAX_CHARGE_TOKENS),
            prefill_ms: charge.prefill_ms.min(MAX_CHARGE_MS),
            kind: Kind::Held,
        };
        self.send(shared, a);
        seq
    }

    /// Sends the release of load `seq` on `pod`, at `wall_us` (never waits; both copies lost,
    /// the others stop counting its tokens at their bound, `pods::MAX_HOLD`).
    pub(super) fn release(
        &self,
        shared: &Shared,
        pod: &PodId,
        seq: u64,
        wall_us: u64,
        how: Release,
    ) {
        let a = Announced {
            origin: self.origin,
            seq,
            pod: pod.clone(),
            wall_us,
            uncached_tokens: 0,
            prefill_ms: 0,
            kind: Kind::Released(how),
        };
        self.send(shared, a);
    }

    /// Sends `a` as a datagram and queues it for the stream (a full queue drops it, counted).
    fn send(&self, shared: &Shared, a: Announced) {
        if let Some(peers) = &self.peers {
            peers.send(shared, &a);
        }
        if self.tx.try_send(a).is_err() {
            shared.metrics.load_dropped(Dropped::QueueFull, 1);
        }
    }
}

/// Drains the queue in batches: one pipelined round trip of `XADD`s per batch. Ends when the
/// index is dropped (the queue's sender with it).
async fn publish(shared: Arc<Shared>, rx: Arc<tokio::sync::Mutex<mpsc::Receiver<Announced>>>) {
    let mut rx = rx.lock().await;
    let mut batch = Vec::with_capacity(PUBLISH_BATCH);
    let key = shared.schema.load_stream();
    while rx.recv_many(&mut batch, PUBLISH_BATCH).await > 0 {
        let n = batch.len() as u64;
        let Ok(con) = shared.conn.load_writes().await else {
            shared.metrics.load_dropped(Dropped::Error, n);
            batch.clear();
            continue;
        };
        let adds = batch.drain(..).map(|a| {
            let mut cmd = redis::cmd("XADD");
            cmd.arg(&key).arg("MAXLEN").arg("~").arg(MAX_LEN).arg("*");
            for (f, v) in a.fields() {
                cmd.arg(f).arg(v);
            }
            let mut con = con.clone();
            async move { cmd.query_async::<String>(&mut con).await }
        });
        match tokio::time::timeout(shared.write_budget, join_all(adds)).await {
            Ok(results) => {
                let failed = results.iter().filter(|r| r.is_err()).count() as u64;
                shared.metrics.load_published.inc_by(n - failed);
                shared.metrics.load_dropped(Dropped::Error, failed);
            }
            Err(_) => shared.metrics.load_dropped(Dropped::Timeout, n),
        }
    }
}

/// Follows the load stream, handing each other replica's load to `charge` with its age; at
/// start and after an error it reads from `max_lag_ms` ago (older loads are not charged).
pub(super) async fn read(
    shared: Arc<Shared>,
    origin: u64,
    max_lag_ms: u64,
    charge: impl Fn(Announced, Duration) -> bool,
) {
    let key = shared.schema.load_stream();
    let mut pos: Option<EntryId> = None;
    let mut backoff = Duration::from_millis(50);
    loop {
        let step = async {
            let mut con = shared.conn.load_reads().await?;
            let from = pos.unwrap_or_else(|| {
                EntryId::at_ms((Shared::wall_now_us() / 1_000).saturating_sub(max_lag_ms))
            });
            let entries = read_after(&mut con, &key, from).await?;
            Ok::<_, IndexError>((from, entries))
        };
        let (from, entries) = match step.await {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, "redis load stream read failed; retrying");
                shared.metrics.mirror_errors.inc();
                pos = None;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        let mut last = from;
        for e in entries {
            if let Some(id) = EntryId::parse(&e.id) {
                last = last.max(id);
            }
            match Announced::parse(&e.map) {
                Some(a) if a.origin == origin => {}
                Some(a) => {
                    let age =
                        Duration::from_micros(Shared::wall_now_us().saturating_sub(a.wall_us));
                    shared.metrics.load_lag.observe(age.as_secs_f64());
                    charge(a, age);
                }
                None => {
                    shared.metrics.mirror_bad_entries.inc();
                }
            }
        }
        pos = Some(last);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_load_is_released_once_and_a_release_that_came_first_leaves_it_uncharged() {
        let seen = Seen::new();
        assert!(seen.first(1, 7));
        assert!(seen.release(1, 7), "charged, released");
        assert!(!seen.release(1, 7), "the release's second copy");
        assert!(!seen.first(1, 7), "the load's late copy");
        assert!(!seen.release(1, 8), "nothing charged to release");
        assert!(
            !seen.first(1, 8),
            "its load came after its release: not charged"
        );
    }

    #[test]
    fn only_the_first_copy_of_a_load_is_charged() {
        let seen = Seen::new();
        assert!(seen.first(1, 7));
        assert!(!seen.first(1, 7), "its second copy");
        assert!(seen.first(2, 7), "another replica's seventh");
        for seq in 0..SEEN as u64 {
            seen.first(3, seq);
        }
        assert!(seen.first(1, 7), "forgotten once far older than any charge");
    }
}
