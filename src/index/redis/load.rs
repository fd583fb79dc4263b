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

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use lru::LruCache;
use parking_lot::Mutex;
use redis::Value;
use tokio::sync::mpsc;

use super::metrics::Dropped;
use super::mirror::{read_after, supervise, EntryId, MAX_CHARGE_MS, MAX_CHARGE_TOKENS, MAX_POD};
use super::peers::Peers;
use super::Shared;
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

/// What a load message says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A load counted for its predicted prefill (older replicas send only these).
    Load,
    /// A load whose tokens count until its replica releases them.
    Held,
    /// The release of a held load: [`Release::Started`] or [`Release::Settled`].
    Released(Release),
}

impl Kind {
    pub(super) fn code(self) -> u8 {
        match self {
            Kind::Load => 0,
            Kind::Held => 1,
            Kind::Released(Release::Started) => 2,
            Kind::Released(Release::Settled) => 3,
        }
    }

    pub(super) fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            0 => Kind::Load,
            1 => Kind::Held,
            2 => Kind::Released(Release::Started),
            3 => Kind::Released(Release::Settled),
            _ => return None,
        })
    }
}

/// One decision's load, or its release, as the load stream carries it. A release names the
/// load's pod and number, at its own time, with no tokens: an older replica takes it for a
/// second copy of the load and skips it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Announced {
    pub(super) origin: u64,
    pub(super) seq: u64,
    pub(super) pod: PodId,
    /// When it was committed (a release: sent), unix microseconds.
    pub(super) wall_us: u64,
    pub(super) uncached_tokens: u64,
    pub(super) prefill_ms: u64,
    pub(super) kind: Kind,
}

impl Announced {
    fn fields(&self) -> [(&'static str, Vec<u8>); 7] {
        [
            ("k", self.kind.code().to_string().into_bytes()),
            ("o", format!("{:016x}", self.origin).into_bytes()),
            ("q", self.seq.to_string().into_bytes()),
            ("p", self.pod.as_str().as_bytes().to_vec()),
            ("m", self.wall_us.to_string().into_bytes()),
            ("u", self.uncached_tokens.to_string().into_bytes()),
            ("d", self.prefill_ms.to_string().into_bytes()),
        ]
    }

    /// A load entry; `None` for anything this router would not write.
    pub(super) fn parse(map: &HashMap<String, Value>) -> Option<Self> {
        let bytes = |f: &str| match map.get(f)? {
            Value::BulkString(b) => Some(b.as_slice()),
            Value::SimpleString(s) => Some(s.as_bytes()),
            _ => None,
        };
        let text = |f: &str| std::str::from_utf8(bytes(f)?).ok();
        let number = |f: &str| text(f)?.parse::<u64>().ok();
        Some(Self {
            origin: u64::from_str_radix(text("o").filter(|s| s.len() == 16)?, 16).ok()?,
            seq: number("q")?,
            pod: PodId::new(text("p").filter(|p| !p.is_empty() && p.len() <= MAX_POD)?),
            wall_us: number("m")?,
            uncached_tokens: number("u").filter(|&u| u <= MAX_CHARGE_TOKENS)?,
            prefill_ms: number("d").filter(|&d| d <= MAX_CHARGE_MS)?,
            kind: match map.contains_key("k") {
                true => Kind::from_code(u8::try_from(number("k")?).ok()?)?,
                false => Kind::Load,
            },
        })
    }
}

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
pub(super) mod tests {
    use super::*;

    /// A load as tests send it (also the datagram tests').
    pub(in crate::index::redis) fn announced() -> Announced {
        Announced {
            origin: 0xabc,
            seq: 41,
            pod: PodId::new("10.0.0.1:8000"),
            wall_us: 1_700_000_000_123_456,
            uncached_tokens: 4_000,
            prefill_ms: 350,
            kind: Kind::Held,
        }
    }

    fn as_map(a: &Announced) -> HashMap<String, Value> {
        a.fields()
            .into_iter()
            .map(|(f, v)| (f.to_string(), Value::BulkString(v)))
            .collect()
    }

    #[test]
    fn a_load_survives_the_stream_encoding_and_bad_ones_are_refused() {
        let a = announced();
        assert_eq!(Announced::parse(&as_map(&a)), Some(a.clone()));
        let with = |f: &str, v: &[u8]| {
            let mut m = as_map(&a);
            m.insert(f.to_string(), Value::BulkString(v.to_vec()));
            m
        };
        for bad in [
            with("o", b"not-hex"),
            with("q", b"-1"),
            with("p", b""),
            with("p", &[b'x'; MAX_POD + 1]),
            with("m", b"soon"),
            with("u", (MAX_CHARGE_TOKENS + 1).to_string().as_bytes()),
            with("d", (MAX_CHARGE_MS + 1).to_string().as_bytes()),
            with("k", b"4"),
            with("k", b"256"),
        ] {
            assert_eq!(Announced::parse(&bad), None);
        }
        let mut missing = as_map(&a);
        missing.remove("q");
        assert_eq!(Announced::parse(&missing), None);
        // An older replica's entry has no kind: a load counted for its predicted prefill.
        let mut old = as_map(&a);
        old.remove("k");
        assert_eq!(Announced::parse(&old).unwrap().kind, Kind::Load);
        for c in 0..4 {
            let k = Kind::from_code(c).unwrap();
            let r = Announced {
                kind: k,
                ..a.clone()
            };
            assert_eq!(Announced::parse(&as_map(&r)).unwrap().kind, k);
        }
    }

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
