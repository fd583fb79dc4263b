//! The write path to Redis, off the request path: a bounded queue drained by one task in
//! batches. Within a batch, records and event changes are sent concurrently on one multiplexed
//! connection (pipelined, in queue order); capacity changes, forgets and flushes are barriers.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use tokio::sync::{mpsc, oneshot, Mutex};
use tracing::{debug, warn};

use super::conn::{to_index_error, Handle};
use super::metrics::Dropped;
use super::schema::parse_member;
use super::snapshot::RECORD_CHUNK;
use super::state::Shared;
use crate::blocks::BlockKey;
use crate::index::IndexError;
use crate::pods::PodId;

/// Most operations taken from the queue at once.
const BATCH: usize = 256;
/// Members popped per round trip when a pod is forgotten.
const FORGET_CHUNK: usize = 1_000;

/// What a pod's events say about one (root, key): held on GPU, offloaded only, or not; and
/// whether a decision's guess of it ended with the decision's hits (dropped even if not held).
pub(super) type Change = (u64, BlockKey, Option<bool>, bool);

/// A write waiting for Redis.
pub(super) enum WriteOp {
    /// `pod` was sent `keys` (all under `root`); entries live until `expiry` (unix ms).
    Record {
        pod: PodId,
        root: u64,
        keys: Vec<BlockKey>,
        expiry: u64,
    },
    /// What `pod`'s events now say about these (root, key)s: held on GPU, offloaded, or not.
    Events { pod: PodId, changes: Vec<Change> },
    /// A session (by hash) now goes to `pod`, for `ttl_ms` of idleness.
    Session { key: u64, pod: PodId, ttl_ms: u64 },
    /// `pod` holds at most `blocks` recorded entries.
    Capacity { pod: PodId, blocks: usize },
    /// After writes were lost: make Redis say exactly what `held` (this replica's view of
    /// `pod`'s events) says, dropping event entries it no longer holds.
    Resync { pod: PodId, held: Vec<Change> },
    /// `pod` left: drop all it had (or only its recorded entries).
    Forget { pod: PodId, recorded_only: bool },
    /// Answer once everything queued before is written.
    Flush(oneshot::Sender<()>),
}

impl WriteOp {
    /// Blocks the operation writes (what its write budget grows with).
    fn blocks(&self) -> usize {
        match self {
            WriteOp::Record { keys, .. } => keys.len(),
            WriteOp::Events { changes, .. } => changes.len(),
            _ => 0,
        }
    }
}

/// Drains the queue until every sender is gone. Restarted by the owner if it panics, so the
/// receiver lives behind a lock the next run takes over.
pub(super) async fn run(shared: Arc<Shared>, rx: Arc<Mutex<mpsc::Receiver<WriteOp>>>) {
    let mut rx = rx.lock().await;
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        if rx.recv_many(&mut batch, BATCH).await == 0 {
            return;
        }
        shared.metrics.write_queue.set(rx.len() as i64);
        let mut group: Vec<WriteOp> = Vec::new();
        for op in batch.drain(..) {
            match op {
                WriteOp::Record { .. } | WriteOp::Events { .. } | WriteOp::Session { .. } => {
                    group.push(op)
                }
                barrier => {
                    concurrent(&shared, std::mem::take(&mut group)).await;
                    single(&shared, barrier).await;
                }
            }
        }
        concurrent(&shared, group).await;
    }
}

/// Runs `f` on a write connection within the write budget; counts `n` writes as done or
/// dropped. Where `f` counts in `done` the writes Redis already answered, a batch that fails or
/// runs past its budget drops only the rest (Redis may still apply those; nobody waits to see).
pub(super) async fn budgeted<F, Fut>(
    shared: &Shared,
    n: u64,
    budget: Duration,
    done: &AtomicU64,
    f: F,
) where
    F: FnOnce(Handle) -> Fut,
    Fut: std::future::Future<Output = Result<(), IndexError>>,
{
    if n == 0 {
        return;
    }
    let con = match shared.conn.write().await {
        Ok(c) => c,
        Err(e) => {
            debug!(error = %e, "redis write skipped: not connected");
            shared.metrics.dropped(Dropped::Error, n);
            shared.lost_writes.store(true, Ordering::Release);
            shared.writes_ok.store(false, Ordering::Release);
            return;
        }
    };
    let failed = match tokio::time::timeout(budget, f(con)).await {
        Ok(Ok(())) => {
            shared.metrics.writes.inc_by(n);
            shared.writes_ok.store(true, Ordering::Release);
            return;
        }
        Ok(Err(e)) => {
            debug!(error = %e, "redis write failed");
            Dropped::Error
        }
        Err(_) => Dropped::Timeout,
    };
    let written = done.load(Ordering::Acquire).min(n);
    shared.metrics.writes.inc_by(written);
    shared.metrics.dropped(failed, n - written);
    shared.lost_writes.store(true, Ordering::Release);
    shared.writes_ok.store(false, Ordering::Release);
}

/// Records and event changes, sent together; evictions they cause are deleted afterwards,
/// except entries a later operation of the same group recorded again.
async fn concurrent(shared: &Shared, ops: Vec<WriteOp>) {
    let n = ops.len() as u64;
    let budget = shared.write_budget_for(ops.iter().map(WriteOp::blocks).sum());
    let done = AtomicU64::new(0);
    let answered = &done;
    budgeted(shared, n, budget, &done, |con| async move {
        let sends = ops.iter().enumerate().map(|(i, op)| {
            let con = con.clone();
            async move {
                let r = match op {
                    WriteOp::Record {
                        pod,
                        root,
                        keys,
                        expiry,
                    } => record(shared, con, pod, *root, keys, *expiry)
                        .await
                        .map(|ev| (i, ev)),
                    WriteOp::Events { pod, changes } => events(shared, con, pod, changes, true)
                        .await
                        .map(|()| (i, Vec::new())),
                    WriteOp::Session { key, pod, ttl_ms } => {
                        let mut con = con;
                        redis::cmd("SET")
                            .arg(shared.schema.session(*key))
                            .arg(pod.as_str())
                            .arg("PX")
                            .arg(*ttl_ms)
                            .query_async::<()>(&mut con)
                            .await
                            .map_err(|e| to_index_error(&e))
                            .map(|()| (i, Vec::new()))
                    }
                    _ => Ok((i, Vec::new())),
                };
                if r.is_ok() {
                    answered.fetch_add(1, Ordering::Release);
                }
                r
            }
        });
        let mut evicted = Vec::new();
        for r in join_all(sends).await {
            let (i, ev) = r?;
            let WriteOp::Record { pod, .. } = &ops[i] else {
                continue;
            };
            for (root, key) in ev {
                let again = ops[i + 1..].iter().any(|later| match later {
                    WriteOp::Record { pod: p, keys, .. } => p == pod && keys.contains(&key),
                    _ => false,
                });
                if !again {
                    evicted.push((pod.clone(), root, key));
                }
            }
        }
        delete_recorded(shared, &con, &evicted).await
    })
    .await;
}

/// A barrier operation, alone.
async fn single(shared: &Shared, op: WriteOp) {
    match op {
        WriteOp::Flush(done) => {
            let _ = done.send(());
        }
        WriteOp::Capacity { pod, blocks } => {
            budgeted(
                shared,
                1,
                shared.write_budget,
                &AtomicU64::new(0),
                |mut con| async move {
                    // The snapshot set's evicted members name no hash: nothing more to delete.
                    let (set, per_member) = match shared.snapshot {
                        true => (shared.schema.snapshot(&pod), super::schema::RUN),
                        false => (shared.schema.lru(&pod), 1),
                    };
                    let popped: Vec<Vec<u8>> = shared
                        .scripts
                        .capacity
                        .key(set)
                        .key(shared.schema.meta(&pod))
                        .arg(blocks)
                        .arg(per_member)
                        .invoke_async(&mut con)
                        .await
                        .map_err(|e| to_index_error(&e))?;
                    let evicted: Vec<_> = popped
                        .iter()
                        .filter(|_| !shared.snapshot)
                        .filter_map(|m| parse_member(m))
                        .map(|(r, k)| (pod.clone(), r, k))
                        .collect();
                    delete_recorded(shared, &con, &evicted).await
                },
            )
            .await;
        }
        WriteOp::Resync { pod, held } => {
            let budget = shared.write_budget * 20;
            budgeted(shared, 1, budget, &AtomicU64::new(0), |con| async move {
                resync(shared, con, &pod, &held).await
            })
            .await;
        }
        WriteOp::Forget { pod, recorded_only } => {
            // Chunked, so a pod with millions of entries never makes one huge reply; each chunk
            // gets the write budget.
            let budget = shared.write_budget * 20;
            budgeted(shared, 1, budget, &AtomicU64::new(0), |con| async move {
                forget(shared, con, &pod, recorded_only).await
            })
            .await;
        }
        WriteOp::Record { .. } | WriteOp::Events { .. } | WriteOp::Session { .. } => {
            warn!("redis writer: a record or event change reached the barrier path");
        }
    }
}

/// Writes one record: the entries (on the prefix's shard) and the pod's recency (on the pod's),
/// in scripts of at most [`RECORD_CHUNK`] blocks so other clients' lookups run in between.
/// Recency is written tail chunk first, so the prompt's head ends up most recent. Returns what
/// the pod's capacity evicted. With the snapshot set, the record goes there instead and its
/// evictions name no hash to delete.
async fn record(
    shared: &Shared,
    con: Handle,
    pod: &PodId,
    root: u64,
    keys: &[BlockKey],
    expiry: u64,
) -> Result<Vec<(u64, BlockKey)>, IndexError> {
    if shared.snapshot {
        super::snapshot::record(shared, con, pod, root, keys, expiry).await?;
        return Ok(Vec::new());
    }
    let entries = keys.chunks(RECORD_CHUNK).map(|chunk| {
        let mut con = con.clone();
        let mut inv = shared.scripts.record.prepare_invoke();
        for &k in chunk {
            inv.key(shared.schema.recorded(root, k));
        }
        inv.arg(pod.as_str()).arg(expiry);
        async move { inv.invoke_async::<i64>(&mut con).await }
    });
    let recency = async {
        let mut con = con.clone();
        let mut popped: Vec<Vec<u8>> = Vec::new();
        for chunk in keys.rchunks(RECORD_CHUNK) {
            let mut inv = shared.scripts.touch.prepare_invoke();
            inv.key(shared.schema.lru(pod))
                .key(shared.schema.meta(pod))
                .arg(shared.default_capacity);
            for &k in chunk {
                inv.arg(shared.schema.member(root, k));
            }
            popped.extend(inv.invoke_async::<Vec<Vec<u8>>>(&mut con).await?);
        }
        // Where a mirror's snapshot finds the pod.
        redis::cmd("SADD")
            .arg(shared.schema.pods())
            .arg(pod.as_str())
            .query_async::<i64>(&mut con)
            .await?;
        Ok::<_, redis::RedisError>(popped)
    };
    let (a, b) = tokio::join!(join_all(entries), recency);
    for r in a {
        r.map_err(|e| to_index_error(&e))?;
    }
    let popped = b.map_err(|e| to_index_error(&e))?;
    Ok(popped.iter().filter_map(|m| parse_member(m)).collect())
}

/// Writes event changes: one script per prefix root, and the pod's membership set. With
/// `settle`, every key the pod now holds also loses the pod's recorded entry (in precise mode, a
/// decision's speculative guess), as `EventIndex` drops it once the pod reports the key stored;
/// a key the pod no longer holds keeps it, as there (a request yet to run computes it again),
/// unless its change says its decision's hits were settled.
async fn events(
    shared: &Shared,
    con: Handle,
    pod: &PodId,
    changes: &[Change],
    settle: bool,
) -> Result<(), IndexError> {
    // Changes arrive sorted by root: one script per run of equal roots.
    let by_root = changes.chunk_by(|a, b| a.0 == b.0);
    let scripts = by_root.map(|v| {
        let mut con = con.clone();
        let mut inv = shared.scripts.events.prepare_invoke();
        for (root, k, _, _) in v {
            inv.key(shared.schema.evented(*root, *k));
            inv.key(shared.schema.recorded(*root, *k));
        }
        inv.arg(pod.as_str());
        for (_, _, tier, settled) in v {
            let drop = settle || *settled;
            inv.arg(match tier {
                Some(true) if drop => "G",
                Some(false) if drop => "C",
                Some(true) => "g",
                Some(false) => "c",
                None if *settled => "X",
                None => "-",
            });
        }
        async move { inv.invoke_async::<i64>(&mut con).await }
    });
    let (held, gone): (Vec<_>, Vec<_>) = changes.iter().partition(|c| c.2.is_some());
    let dropped: Vec<&Change> = changes
        .iter()
        .filter(|c| (settle && c.2.is_some()) || c.3)
        .collect();
    let set = shared.schema.events(pod);
    let membership = |cmd: &str, set: &str, v: &[&Change]| {
        let mut c = redis::cmd(cmd);
        c.arg(set);
        for (root, key, _, _) in v {
            c.arg(shared.schema.member(*root, *key));
        }
        c
    };
    let mut sets = Vec::new();
    if !held.is_empty() {
        sets.push(membership("SADD", &set, &held));
    }
    if !gone.is_empty() {
        sets.push(membership("SREM", &set, &gone));
    }
    if !dropped.is_empty() {
        // The settled guesses leave the pod's recency set, as they leave its local LRU.
        sets.push(membership("ZREM", &shared.schema.lru(pod), &dropped));
    }
    let set_sends = sets.iter().map(|c| {
        let mut con = con.clone();
        async move { c.query_async::<i64>(&mut con).await }
    });
    let (a, b) = tokio::join!(join_all(scripts), join_all(set_sends));
    for r in a.into_iter().chain(b) {
        r.map_err(|e| to_index_error(&e))?;
    }
    Ok(())
}

/// Rewrites `pod`'s event entries from `held`, and drops those Redis has beyond it.
async fn resync(
    shared: &Shared,
    mut con: Handle,
    pod: &PodId,
    held: &[Change],
) -> Result<(), IndexError> {
    let members: Vec<Vec<u8>> = redis::cmd("SMEMBERS")
        .arg(shared.schema.events(pod))
        .query_async(&mut con)
        .await
        .map_err(|e| to_index_error(&e))?;
    let keep: HashSet<String> = held
        .iter()
        .map(|&(r, k, _, _)| shared.schema.member(r, k))
        .collect();
    let mut changes: Vec<Change> = held.to_vec();
    changes.extend(
        members
            .iter()
            .filter(|m| !std::str::from_utf8(m).is_ok_and(|m| keep.contains(m)))
            .filter_map(|m| parse_member(m))
            .map(|(r, k)| (r, k, None, false)),
    );
    changes.sort_unstable_by_key(|&(r, k, _, _)| (r, k.0));
    events(shared, con, pod, &changes, false).await
}

/// Deletes the recorded entries of (pod, root, key)s.
async fn delete_recorded(
    shared: &Shared,
    con: &Handle,
    entries: &[(PodId, u64, BlockKey)],
) -> Result<(), IndexError> {
    // Cached lookups of those keys are stale now.
    for (_, _, key) in entries {
        shared.wrote(*key);
    }
    let mut by_pod: HashMap<&PodId, Vec<(u64, String)>> = HashMap::new();
    for (pod, root, key) in entries {
        let named = (*root, shared.schema.recorded(*root, *key));
        by_pod.entry(pod).or_default().push(named);
    }
    let sends = by_pod
        .into_iter()
        .map(|(pod, keys)| delete_fields(shared, con, pod, keys));
    join_all(sends).await.into_iter().collect()
}

/// Deletes `pod`'s field from each of `keys` (named with their roots), in scripts of at most
/// [`RECORD_CHUNK`] keys of one shard (one root when keys are tagged), sent concurrently.
async fn delete_fields(
    shared: &Shared,
    con: &Handle,
    pod: &PodId,
    mut keys: Vec<(u64, String)>,
) -> Result<(), IndexError> {
    let tagged = shared.schema.tags_roots();
    if tagged {
        keys.sort_unstable_by_key(|(root, _)| *root);
    }
    let chunks = keys
        .chunk_by(|a, b| !tagged || a.0 == b.0)
        .flat_map(|shard| shard.chunks(RECORD_CHUNK));
    let sends = chunks.map(|chunk| {
        let mut inv = shared.scripts.unset.prepare_invoke();
        for (_, key) in chunk {
            inv.key(key);
        }
        inv.arg(pod.as_str());
        let mut con = con.clone();
        async move { inv.invoke_async::<i64>(&mut con).await }
    });
    for r in join_all(sends).await {
        r.map_err(|e| to_index_error(&e))?;
    }
    Ok(())
}

/// Drops everything `pod` had, chunk by chunk, without scanning the keyspace.
async fn forget(
    shared: &Shared,
    mut con: Handle,
    pod: &PodId,
    recorded_only: bool,
) -> Result<(), IndexError> {
    shared.wrote_everywhere();
    redis::cmd("DEL")
        .arg(shared.schema.snapshot(pod))
        .query_async::<i64>(&mut con)
        .await
        .map_err(|e| to_index_error(&e))?;
    let (lru, set) = (shared.schema.lru(pod), shared.schema.events(pod));
    loop {
        let popped: Vec<Vec<u8>> = redis::cmd("ZPOPMIN")
            .arg(&lru)
            .arg(FORGET_CHUNK)
            .query_async(&mut con)
            .await
            .map_err(|e| to_index_error(&e))?;
        if popped.is_empty() {
            break;
        }
        // ZPOPMIN answers member, score, member, score...
        let keys = popped
            .iter()
            .step_by(2)
            .filter_map(|m| parse_member(m))
            .map(|(r, k)| (r, shared.schema.recorded(r, k)))
            .collect();
        delete_fields(shared, &con, pod, keys).await?;
    }
    if recorded_only {
        return Ok(());
    }
    loop {
        let popped: Vec<Vec<u8>> = redis::cmd("SPOP")
            .arg(&set)
            .arg(FORGET_CHUNK)
            .query_async(&mut con)
            .await
            .map_err(|e| to_index_error(&e))?;
        if popped.is_empty() {
            break;
        }
        let keys = popped
            .iter()
            .filter_map(|m| parse_member(m))
            .map(|(r, k)| (r, shared.schema.evented(r, k)))
            .collect();
        delete_fields(shared, &con, pod, keys).await?;
    }
    redis::cmd("DEL")
        .arg(shared.schema.meta(pod))
        .query_async::<i64>(&mut con)
        .await
        .map_err(|e| to_index_error(&e))?;
    redis::cmd("SREM")
        .arg(shared.schema.pods())
        .arg(pod.as_str())
        .query_async::<i64>(&mut con)
        .await
        .map_err(|e| to_index_error(&e))?;
    Ok(())
}
