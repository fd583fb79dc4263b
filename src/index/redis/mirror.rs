//! The mirror (`lookups: mirror`): each replica answers lookups from its own in-process index,
//! which also applies every other replica's decisions, so no decision waits on Redis.
//!
//! - A replica publishes each decision's record and each session pin on the stream `P:log`
//!   (one `XADD`, `MAXLEN ~ stream_max_len`), off the request path, beside the writes to the
//!   snapshot that stays the shared truth (`snapshot.rs`).
//! - A reader task follows the stream with blocking `XREAD`s on a connection of its own and
//!   applies the other replicas' entries to the in-process index and session map.
//! - At start, after a connection error, and when entries it had not read were trimmed (it
//!   fell behind by more than the stream keeps), it loads the shared index from the pods'
//!   snapshot sets (no `SCAN`), then reads on from the stream position taken before the load. Loading merges: it never clears what the replica knows.
//! - It keeps records only for the pods in the router's pod set (`members.rs`): the first load
//!   waits for the pod sources' first listing, a pod that joins has its snapshot loaded then,
//!   and one that leaves has its entries dropped here.
//!
//! Precise mode: every replica subscribes to every pod's KV events itself, so only the
//! speculative records travel on the stream.
//!
//! Who may call: nobody; the stream is written and read by router replicas only. Anyone who can
//! write it can steer routing, as with every key under the prefix. Entries are bounded before
//! they are applied: at most [`MAX_KEYS`] keys and a pod name of at most [`MAX_POD`] bytes;
//! others are skipped and counted.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures::future::join_all;
use lru::LruCache;
use parking_lot::Mutex;
use redis::Value;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{info, warn};

use super::announced::{Announced, Kind};
use super::conn::{to_index_error, Handle};
use super::load::{self, LoadStream, Seen};
use super::members::{Following, PodMembers};
use super::metrics::{Dropped, Reload, Unknown};
use super::peers::{self, Peers};
use super::snapshot;
use super::state::{Local, Shared};
use super::stream::{
    newest, read_after, supervise, EntryId, BATCH, MAX_CHARGE_MS, MAX_CHARGE_TOKENS, MAX_POD,
};
use crate::blocks::BlockKey;
use crate::config::RedisConfig;
use crate::index::{IndexError, KvIndex};
use crate::pods::PodId;
use crate::share::{Charge, ConversationMark, Hold, RemoteLoad};

/// Most keys one stream entry may carry (a prompt has at most `blocks.max_blocks` ≤ 2^20, but
/// the default is 4,096; more than this is not a prompt this router wrote).
pub(super) const MAX_KEYS: usize = 1 << 20;
/// Changes published per batch.
const PUBLISH_BATCH: usize = 256;
/// A replica that cannot load the shared index at start routes on its own after this (fail
/// open: Redis down must never keep every replica unready).
const LOAD_GRACE: Duration = Duration::from_secs(10);
/// How long the first load waits for the pod sources' first listing (then it loads the pods
/// listed by then, and each pod listed later as it joins).
const LISTING_GRACE: Duration = Duration::from_secs(10);

/// A change one replica publishes for the others.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Change {
    /// A decision: `pod` was sent `keys` at `wall` (unix ms), with the request's load when it
    /// was a routed request.
    Record {
        pod: PodId,
        keys: Vec<BlockKey>,
        wall: u64,
        charge: Option<Charge>,
    },
    /// A session (by hash) now goes to `pod`, for `ttl_ms` of idleness from `wall`.
    Session {
        hash: u64,
        pod: PodId,
        ttl_ms: u64,
        wall: u64,
    },
}

enum Publish {
    Change(Change),
    Flush(oneshot::Sender<()>),
}

/// The fields of a change's stream entry (`origin` names the replica that wrote it).
fn fields(origin: u64, c: &Change) -> Vec<(&'static str, Vec<u8>)> {
    let o = format!("{origin:016x}").into_bytes();
    match c {
        Change::Record {
            pod,
            keys,
            wall,
            charge,
        } => {
            let mut f = vec![
                ("o", o),
                ("t", b"r".to_vec()),
                ("w", wall.to_string().into_bytes()),
                ("p", pod.as_str().as_bytes().to_vec()),
                ("k", keys.iter().flat_map(|k| k.0.to_le_bytes()).collect()),
            ];
            if let Some(c) = charge {
                f.push(("u", c.uncached_tokens.to_string().into_bytes()));
                f.push(("d", c.prefill_ms.to_string().into_bytes()));
                if let Some(q) = c.announced {
                    f.push(("q", q.to_string().into_bytes()));
                }
                if let Some(m) = c.mark {
                    f.push(("b", m.best_match.to_string().into_bytes()));
                    f.push(("n", vec![if m.new_conversation { b'1' } else { b'0' }]));
                }
            }
            f
        }
        Change::Session {
            hash,
            pod,
            ttl_ms,
            wall,
        } => vec![
            ("o", o),
            ("t", b"s".to_vec()),
            ("w", wall.to_string().into_bytes()),
            ("p", pod.as_str().as_bytes().to_vec()),
            ("s", format!("{hash:016x}").into_bytes()),
            ("l", ttl_ms.to_string().into_bytes()),
        ],
    }
}

/// A stream entry's origin and change; `None` for anything this router would not write.
pub(super) fn parse_entry(map: &HashMap<String, Value>) -> Option<(u64, Change)> {
    let bytes = |f: &str| match map.get(f)? {
        Value::BulkString(b) => Some(b.as_slice()),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    };
    let text = |f: &str| std::str::from_utf8(bytes(f)?).ok();
    let hex = |f: &str| u64::from_str_radix(text(f).filter(|s| s.len() == 16)?, 16).ok();
    let number = |f: &str| text(f)?.parse::<u64>().ok();
    let origin = hex("o")?;
    let wall = number("w")?;
    let pod = text("p").filter(|p| !p.is_empty() && p.len() <= MAX_POD)?;
    let pod = PodId::new(pod);
    let change = match text("t")? {
        "r" => {
            let k = bytes("k")?;
            if k.is_empty() || k.len() % 8 != 0 || k.len() / 8 > MAX_KEYS {
                return None;
            }
            let keys = k
                .chunks_exact(8)
                .map(|c| BlockKey(u64::from_le_bytes(c.try_into().expect("8 bytes"))))
                .collect();
            // Entries without a charge come from older replicas or from plain records.
            // A mark comes with a charge, from replicas that share conversation memory.
            let mark = match (map.contains_key("b"), map.contains_key("n")) {
                (false, false) => None,
                _ => Some(ConversationMark {
                    best_match: number("b")
                        .filter(|&b| b <= MAX_KEYS as u64)
                        .and_then(|b| u32::try_from(b).ok())?,
                    new_conversation: match text("n")? {
                        "1" => true,
                        "0" => false,
                        _ => return None,
                    },
                }),
            };
            let charge = match (map.contains_key("u"), map.contains_key("d")) {
                (false, false) if mark.is_none() => None,
                _ => Some(Charge {
                    uncached_tokens: number("u").filter(|&u| u <= MAX_CHARGE_TOKENS)?,
                    prefill_ms: number("d").filter(|&d| d <= MAX_CHARGE_MS)?,
                    mark,
                    // Sent ahead on the load stream too: charged once, from the first copy.
                    announced: match map.contains_key("q") {
                        true => Some(number("q")?),
                        false => None,
                    },
                }),
            };
            Change::Record {
                pod,
                keys,
                wall,
                charge,
            }
        }
        "s" => Change::Session {
            hash: hex("s")?,
            pod,
            ttl_ms: number("l")?,
            wall,
        },
        _ => return None,
    };
    Some((origin, change))
}

/// This replica's mirror: the publisher's queue, the session map, and where the reader is.
pub(super) struct Mirror {
    pub(super) origin: u64,
    tx: mpsc::Sender<Publish>,
    sessions: Mutex<LruCache<u64, (PodId, u64)>>,
    /// The last stream entry applied (or the position a load started from).
    applied: watch::Sender<EntryId>,
    /// The first load finished (or was given up after [`LOAD_GRACE`]).
    loaded: AtomicBool,
    /// How far (ms) the newest applied entry was behind while more were waiting; 0 when current.
    behind_ms: AtomicU64,
    max_len: usize,
    max_lag_ms: u64,
    /// Where the other replicas' decisions are counted as load (the pods, once they exist).
    remote: OnceLock<Arc<dyn RemoteLoad>>,
    /// `mirror_load`: publish and apply each request's load.
    pub(super) share_load: bool,
    /// Where each decision's load is published ahead of its record (with `mirror_load`).
    pub(super) load: Option<Arc<LoadStream>>,
    /// Loads charged here, so their second copy is not.
    seen: Seen,
}

impl Mirror {
    /// Starts the publisher and the reader (each restarted if it panics, and counted).
    pub(super) fn start(
        cfg: &RedisConfig,
        shared: Arc<Shared>,
        local: Arc<Local>,
        members: PodMembers,
    ) -> Arc<Self> {
        let (tx, rx) = mpsc::channel(cfg.write_queue.max(1));
        let origin = rand::random();
        let peers = cfg.mirror_load.then(|| Peers::bind(cfg, origin)).flatten();
        let mirror = Arc::new(Self {
            origin,
            tx,
            sessions: Mutex::new(LruCache::new(
                NonZeroUsize::new(cfg.mirror_sessions.max(1)).expect("max(1)"),
            )),
            applied: watch::Sender::new(EntryId::default()),
            loaded: AtomicBool::new(false),
            behind_ms: AtomicU64::new(0),
            max_len: cfg.stream_max_len,
            max_lag_ms: cfg.mirror_max_lag_ms,
            remote: OnceLock::new(),
            share_load: cfg.mirror_load,
            load: cfg
                .mirror_load
                .then(|| LoadStream::start(shared.clone(), origin, peers.clone())),
            seen: Seen::new(),
        });
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        let (sh, m) = (shared.clone(), mirror.clone());
        supervise(shared.clone(), move || {
            publish(sh.clone(), m.clone(), rx.clone())
        });
        if mirror.load.is_some() {
            let (sh, m) = (shared.clone(), mirror.clone());
            supervise(shared.clone(), move || {
                let (sh2, m) = (sh.clone(), m.clone());
                load::read(sh.clone(), origin, m.max_lag_ms, move |a, age| {
                    m.charge_announced(&sh2, a, age)
                })
            });
        }
        if let Some(p) = peers {
            let (sh, cfg) = (shared.clone(), Arc::new(cfg.clone()));
            let p2 = p.clone();
            supervise(shared.clone(), move || {
                peers::heartbeat(sh.clone(), p2.clone(), cfg.clone())
            });
            let (sh, m) = (shared.clone(), mirror.clone());
            supervise(shared.clone(), move || {
                let (sh2, m) = (sh.clone(), m.clone());
                peers::receive(sh.clone(), p.clone(), move |a, age| {
                    m.charge_announced(&sh2, a, age)
                })
            });
        }
        let (sh, m) = (shared.clone(), mirror.clone());
        supervise(shared, move || {
            read(sh.clone(), m.clone(), local.clone(), members.clone())
        });
        mirror
    }

    /// Charges another replica's load from the load stream or its datagram, unless it is too old
    /// by now or another copy already charged it, or releases it; answers whether it did.
    fn charge_announced(&self, shared: &Shared, a: Announced, age: Duration) -> bool {
        let Some(sink) = self.remote.get() else {
            return false;
        };
        let hold = Hold {
            origin: a.origin,
            seq: a.seq,
        };
        if let Kind::Released(how) = a.kind {
            // Releasing is harmless at any age; a release before its load leaves it uncharged.
            if !self.seen.release(a.origin, a.seq) {
                return false;
            }
            sink.release(&a.pod, hold, how);
            shared.metrics.load_releases.inc();
            return true;
        }
        if age.as_millis() as u64 > self.max_lag_ms || !self.seen.first(a.origin, a.seq) {
            return false;
        }
        let charge = Charge {
            uncached_tokens: a.uncached_tokens,
            prefill_ms: a.prefill_ms,
            mark: None,
            announced: Some(a.seq),
        };
        sink.charge(&a.pod, charge, age, (a.kind == Kind::Held).then_some(hold));
        shared.metrics.mirror_charges.inc();
        shared.metrics.load_charges.inc();
        true
    }

    /// Charges the load datagrams already waiting in this replica's socket (never waits).
    pub(super) fn catch_up_load(&self, shared: &Shared) {
        if let Some(peers) = self.load.as_ref().and_then(|l| l.peers.as_ref()) {
            peers.drain(shared, |a, age| self.charge_announced(shared, a, age));
        }
    }

    /// Queues `change` for the other replicas (never waits; a full queue drops and counts).
    pub(super) fn publish(&self, shared: &Shared, change: Change) {
        if self.tx.try_send(Publish::Change(change)).is_err() {
            shared.metrics.publish_dropped(Dropped::QueueFull, 1);
        }
    }

    /// Counts the other replicas' decisions as load on `sink` from now on (set once).
    pub(super) fn attach(&self, sink: Arc<dyn RemoteLoad>) {
        let _ = self.remote.set(sink);
    }

    /// Pins a session here (this replica's own pins, and the others' from the stream).
    pub(super) fn pin(&self, hash: u64, pod: PodId, expiry: u64) {
        self.sessions.lock().put(hash, (pod, expiry));
    }

    /// The session's pod, unless it expired by `wall` (unix ms).
    pub(super) fn session(&self, hash: u64, wall: u64) -> Option<PodId> {
        let mut s = self.sessions.lock();
        match s.get(&hash) {
            Some((pod, expiry)) if wall < *expiry => Some(pod.clone()),
            Some(_) => {
                s.pop(&hash);
                None
            }
            None => None,
        }
    }

    /// Why this replica should not take traffic yet, if it should not.
    pub(super) fn unready(&self) -> Option<String> {
        if !self.loaded.load(Ordering::Acquire) {
            return Some("loading the shared index from Redis".into());
        }
        let behind = self.behind_ms.load(Ordering::Acquire);
        (behind > self.max_lag_ms).then(|| {
            format!(
                "the shared index mirror is {behind} ms behind (mirror_max_lag_ms {})",
                self.max_lag_ms
            )
        })
    }

    /// Waits until this replica's changes queued so far are published, and everything on the
    /// stream now is applied here (within `deadline`).
    pub(super) async fn sync(&self, shared: &Shared, deadline: Duration) -> Result<(), IndexError> {
        let (done, wait) = oneshot::channel();
        let stopped = || IndexError::Connection("mirror publisher stopped".into());
        self.tx
            .send(Publish::Flush(done))
            .await
            .map_err(|_| stopped())?;
        wait.await.map_err(|_| stopped())?;
        let Ok(head) = newest(&mut shared.conn.lookup().await?, &shared.schema.stream()).await
        else {
            // Redis unreachable: nothing to catch up with.
            return Ok(());
        };
        let mut applied = self.applied.subscribe();
        let reached = tokio::time::timeout(deadline, applied.wait_for(|a| *a >= head)).await;
        if matches!(reached, Ok(Ok(_))) {
            Ok(())
        } else {
            Err(IndexError::Timeout(deadline))
        }
    }
}

/// Drains the publish queue in batches: one pipelined round trip of `XADD`s per batch.
async fn publish(
    shared: Arc<Shared>,
    mirror: Arc<Mirror>,
    rx: Arc<tokio::sync::Mutex<mpsc::Receiver<Publish>>>,
) {
    let mut rx = rx.lock().await;
    let mut batch = Vec::with_capacity(PUBLISH_BATCH);
    loop {
        if rx.recv_many(&mut batch, PUBLISH_BATCH).await == 0 {
            return;
        }
        let mut changes = Vec::new();
        for p in batch.drain(..) {
            match p {
                Publish::Change(c) => changes.push(c),
                Publish::Flush(done) => {
                    send(&shared, &mirror, std::mem::take(&mut changes)).await;
                    let _ = done.send(());
                }
            }
        }
        send(&shared, &mirror, changes).await;
    }
}

async fn send(shared: &Shared, mirror: &Mirror, changes: Vec<Change>) {
    if changes.is_empty() {
        return;
    }
    let n = changes.len() as u64;
    let blocks = changes
        .iter()
        .map(|c| match c {
            Change::Record { keys, .. } => keys.len(),
            Change::Session { .. } => 1,
        })
        .sum();
    let con = match shared.conn.lookup().await {
        Ok(c) => c,
        Err(_) => return shared.metrics.publish_dropped(Dropped::Error, n),
    };
    let key = shared.schema.stream();
    let adds = changes.iter().map(|c| {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&key)
            .arg("MAXLEN")
            .arg("~")
            .arg(mirror.max_len)
            .arg("*");
        for (f, v) in fields(mirror.origin, c) {
            cmd.arg(f).arg(v);
        }
        let mut con = con.clone();
        async move { cmd.query_async::<String>(&mut con).await }
    });
    let budget = shared.write_budget_for(blocks);
    match tokio::time::timeout(budget, join_all(adds)).await {
        Ok(results) => {
            let failed = results.iter().filter(|r| r.is_err()).count() as u64;
            shared.metrics.mirror_published.inc_by(n - failed);
            shared.metrics.publish_dropped(Dropped::Error, failed);
        }
        Err(_) => shared.metrics.publish_dropped(Dropped::Timeout, n),
    }
}

/// Whether entries after `pos` were trimmed before this replica read them.
pub(super) async fn trimmed_past(
    shared: &Shared,
    con: &mut Handle,
    pos: EntryId,
) -> Result<bool, IndexError> {
    let info: redis::RedisResult<HashMap<String, Value>> = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(shared.schema.stream())
        .query_async(con)
        .await;
    let info = match info {
        Ok(i) => i,
        // No stream (yet, or any more): nothing newer than `pos` can have been trimmed unless
        // the stream was dropped, which a reconnect's reload covers.
        Err(e) if e.code() == Some("ERR") => return Ok(false),
        Err(e) => return Err(to_index_error(&e)),
    };
    let id = |field: &str| match info.get(field) {
        Some(Value::BulkString(b)) => std::str::from_utf8(b).ok().and_then(EntryId::parse),
        Some(Value::SimpleString(s)) => EntryId::parse(s),
        _ => None,
    };
    // Trimming moves the oldest entry on (`max-deleted-entry-id` counts XDEL only): an oldest
    // entry newer than `pos` means entries this replica had not read are gone. At the exact
    // boundary this reloads once without need; the check runs only on a full batch.
    let first = id("recorded-first-entry-id").or_else(|| match info.get("first-entry") {
        Some(Value::Array(e)) => e.first().and_then(|v| match v {
            Value::BulkString(b) => std::str::from_utf8(b).ok().and_then(EntryId::parse),
            _ => None,
        }),
        _ => None,
    });
    let count = |field: &str| match info.get(field) {
        Some(Value::Int(n)) => Some(*n),
        _ => None,
    };
    // Nothing ever trimmed (Redis 7+ says so): no gap, even when `pos` predates the stream.
    if let (Some(added), Some(len)) = (count("entries-added"), count("length")) {
        if added <= len {
            return Ok(false);
        }
    } else if pos == EntryId::default() {
        return Ok(false);
    }
    Ok(first.is_some_and(|first| first > pos))
}

/// Applies another replica's change to this replica's index and session map.
async fn apply(shared: &Shared, mirror: &Mirror, local: &Local, origin: u64, change: Change) {
    match change {
        Change::Record {
            pod,
            keys,
            wall,
            charge,
        } => {
            // Late entries (a reload's rewind, a lagging reader) teach the index, not the load:
            // a scrape has seen those requests by now.
            let age = shared.wall_now().saturating_sub(wall);
            let now = shared.mono(wall);
            if let (Some(c), Some(sink)) = (charge, mirror.remote.get()) {
                if mirror.share_load && age <= mirror.max_lag_ms {
                    // Not when the load stream brought it first.
                    if c.announced.is_none_or(|q| mirror.seen.first(origin, q)) {
                        sink.charge(&pod, c, Duration::from_millis(age), None);
                        shared.metrics.mirror_charges.inc();
                    }
                    if let Some(m) = c.mark {
                        sink.mark(&pod, &keys, m, now);
                    }
                }
            }
            match local {
                Local::Memory(m) => {
                    let _ = m.record(&pod, &keys, now).await;
                }
                Local::Events(ev) => {
                    ev.record_past(&pod, &keys, ev.held_prefix(&pod, &keys), now);
                }
            }
        }
        Change::Session {
            hash,
            pod,
            ttl_ms,
            wall,
        } => mirror.pin(hash, pod, wall.saturating_add(ttl_ms)),
    }
}

/// Follows the stream, applying the other replicas' changes for the pods in `members`; loads
/// from Redis at start (once the pod sources listed their pods), after a connection error, after
/// a gap, and for each pod that joins.
async fn read(shared: Arc<Shared>, mirror: Arc<Mirror>, local: Arc<Local>, members: PodMembers) {
    let started = Instant::now();
    let mut members = Following::new(members);
    if !mirror.loaded.load(Ordering::Acquire) {
        members.first_listing(LISTING_GRACE).await;
    }
    let mut pos: Option<EntryId> = None;
    // The stream head the last load covered: entries trimmed up to it are in the snapshot.
    let mut covered = EntryId::default();
    let mut reason = if mirror.loaded.load(Ordering::Acquire) {
        Reload::Reconnect
    } else {
        Reload::Start
    };
    let mut backoff = Duration::from_millis(50);
    let key = shared.schema.stream();
    loop {
        let Some(from) = pos else {
            // The load covers the pods that joined; those that left go.
            let changes = members.catch_up();
            forget(&local, &changes.left).await;
            match snapshot::load(&shared, &local, &members).await {
                Ok(loaded) => {
                    let (from, n) = (loaded.from, loaded.keys);
                    shared.metrics.reloaded(reason, n);
                    info!(entries = n, reason = ?reason, "redis mirror loaded the shared index");
                    pos = Some(from);
                    covered = loaded.head;
                    mirror.applied.send_replace(from);
                    mirror.loaded.store(true, Ordering::Release);
                    backoff = Duration::from_millis(50);
                }
                Err(e) => {
                    shared.metrics.mirror_errors.inc();
                    if started.elapsed() > LOAD_GRACE && !mirror.loaded.swap(true, Ordering::AcqRel)
                    {
                        warn!(error = %e, "redis mirror could not load the shared index; routing on this replica's own until it can");
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
            continue;
        };
        let changes = members.catch_up();
        forget(&local, &changes.left).await;
        if !changes.joined.is_empty() {
            match snapshot::load_pods(&shared, &local, &changes.joined).await {
                Ok(n) => {
                    shared.metrics.reloaded(Reload::Join, n);
                    info!(
                        pods = changes.joined.len(),
                        entries = n,
                        "redis mirror loaded the pods that joined"
                    );
                }
                Err(e) => {
                    // A full reload loads them, and every other pod listed.
                    tracing::debug!(error = %e, "redis mirror could not load the pods that joined; reloading once it can");
                    shared.metrics.mirror_errors.inc();
                    pos = None;
                    reason = Reload::Reconnect;
                    continue;
                }
            }
        }
        let read = async {
            let mut con = shared.conn.mirror().await?;
            let entries = read_after(&mut con, &key, from).await?;
            // A full batch may mean this replica fell behind far enough to lose entries. Not
            // those a load's rewind reads again: trimmed, they are the snapshot's (measured from
            // `from`, it reloaded until the stream moved past the rewind; a quiet one never did).
            if entries.len() >= BATCH && trimmed_past(&shared, &mut con, from.max(covered)).await? {
                return Ok(None);
            }
            Ok::<_, IndexError>(Some(entries))
        };
        let entries = match read.await {
            Ok(Some(entries)) => entries,
            Ok(None) => {
                pos = None;
                reason = Reload::Gap;
                continue;
            }
            Err(e) => {
                tracing::debug!(error = %e, "redis mirror read failed; reloading once it can");
                shared.metrics.mirror_errors.inc();
                pos = None;
                reason = Reload::Reconnect;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        let full = entries.len() >= BATCH;
        let mut last = from;
        let mut newest_wall = None;
        for e in entries {
            if let Some(id) = EntryId::parse(&e.id) {
                last = last.max(id);
            }
            match parse_entry(&e.map) {
                Some((origin, _)) if origin == mirror.origin => {}
                Some((_, Change::Record { pod, .. })) if !members.admits(&pod) => {
                    shared.metrics.unknown_pods(Unknown::Stream, 1);
                }
                Some((origin, change)) => {
                    let wall = match &change {
                        Change::Record { wall, .. } | Change::Session { wall, .. } => *wall,
                    };
                    let lag = shared.wall_now().saturating_sub(wall);
                    shared.metrics.mirror_lag.observe(lag as f64 / 1e3);
                    newest_wall = Some(wall);
                    apply(&shared, &mirror, &local, origin, change).await;
                    shared.metrics.mirror_applied.inc();
                }
                None => {
                    shared.metrics.mirror_bad_entries.inc();
                }
            }
        }
        let behind = match (full, newest_wall) {
            (true, Some(w)) => shared.wall_now().saturating_sub(w).max(1),
            _ => 0,
        };
        mirror.behind_ms.store(behind, Ordering::Release);
        shared
            .metrics
            .mirror_behind
            .set(i64::from(behind > mirror.max_lag_ms));
        pos = Some(last);
        mirror.applied.send_replace(last);
    }
}

/// Drops the mirror's entries of pods that left the pod set (this replica's own; the router
/// forgets them in Redis as well).
async fn forget(local: &Local, left: &[PodId]) {
    for pod in left {
        // The in-process indexes cannot fail.
        let _ = local.index().forget_pod(pod).await;
    }
}

#[cfg(test)]
#[path = "mirror_encoding_tests.rs"]
mod tests;
