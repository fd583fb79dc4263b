//! The snapshot of the shared index a replica loads at start, after a connection error and after
//! a gap in the stream, and (approximate mode with the mirror) its writes.
//!
//! With `lookups: mirror` in approximate mode nothing reads a block's entries by key: lookups
//! read the mirrors, which get every decision's keys from the stream. So a pod's recorded
//! entries are kept as one sorted set `P:pod:{T}:snap`, member `RK`, score its expiry (unix
//! ms), where the per-block hash took an `HSET`, a `PEXPIREAT`, a recency `ZADD` and, once the
//! capacity evicted it, a `ZPOPMIN` and an `HDEL`. A member is a run of up to [`RUN`]
//! consecutive blocks of one record, not one block: a sorted set's cost is per member. Expiry
//! order is recency order (every entry lives one TTL), so the lowest scores go first past the
//! capacity.
//! Precise mode and `lookups: redis` keep the per-block hashes and the recency set: lookups, or
//! the settling of speculative entries by KV events, read them.

use futures::future::join_all;

use super::conn::{to_index_error, Handle};
use super::members::Following;
use super::metrics::Unknown;
use super::schema::{parse_member, parse_run, RUN};
use super::state::{Local, Shared};
use super::stream::{newest, EntryId, MAX_POD};
use crate::blocks::BlockKey;
use crate::index::{IndexError, KvIndex};
use crate::pods::PodId;

/// Blocks per script when a record is written: Redis runs one script at a time, so a 4096-block
/// prompt written in one script held every other replica's lookup back for ~15 ms.
pub(super) const RECORD_CHUNK: usize = 512;
/// Snapshot members loaded per round trip (a run's up to 16 keys each: ≤ 16,000 keys, ~300 KB).
const LOAD_CHUNK: isize = 1_000;
/// How much of the stream before a load's position is read again after it.
const LOAD_REWIND: std::time::Duration = std::time::Duration::from_secs(5);

/// Positions in a prompt a snapshot score tells apart: the score's fraction, in 1/1024ths (exact
/// in a double for expiries up to 2^43 ms, the year 2248).
const RANKS: usize = 1_024;

/// A member's score: its expiry (unix ms), plus a fraction that puts the prompt's head (block
/// `i` = 0) highest, so a loading replica applies it last and keeps it, as the pod's LRU does.
pub(super) fn score(expiry: u64, i: usize) -> String {
    let rank = (RANKS - 1 - i.min(RANKS - 1)) as u64;
    // rank / 1024 = rank * 9_765_625 / 10^10, written exactly.
    format!("{expiry}.{:010}", rank * 9_765_625)
}

/// The expiry (unix ms) a snapshot score carries; `None` for a score this router never writes.
pub(super) fn expiry_of(score: f64) -> Option<u64> {
    (score.is_finite() && score >= 0.0).then(|| score.floor() as u64)
}

/// Writes `pod`'s entries of `keys` (under `root`) into its snapshot set until `expiry`, as runs
/// of [`RUN`] keys from the first (the caller keeps `keys` aligned: only the last run may be
/// short), in scripts of at most [`RECORD_CHUNK`] blocks so other clients' commands run in
/// between.
pub(super) async fn record(
    shared: &Shared,
    con: Handle,
    pod: &PodId,
    root: u64,
    keys: &[BlockKey],
    expiry: u64,
) -> Result<(), IndexError> {
    let (snap, meta) = (shared.schema.snapshot(pod), shared.schema.meta(pod));
    let now = shared.wall_now();
    let runs: Vec<&[BlockKey]> = keys.chunks(RUN).collect();
    let per_script = RECORD_CHUNK / RUN;
    let chunks = runs.chunks(per_script).enumerate().map(|(c, chunk)| {
        let mut inv = shared.scripts.snapshot.prepare_invoke();
        inv.key(&snap)
            .key(&meta)
            .arg(shared.default_capacity)
            .arg(RUN)
            .arg(now);
        for (j, run) in chunk.iter().enumerate() {
            inv.arg(score(expiry, c * per_script + j))
                .arg(shared.schema.run(root, run));
        }
        let mut con = con.clone();
        async move { inv.invoke_async::<i64>(&mut con).await }
    });
    let mut con = con.clone();
    // Where a loading replica finds the pod.
    let mut sadd = redis::cmd("SADD");
    sadd.arg(shared.schema.pods()).arg(pod.as_str());
    let listed = sadd.query_async::<i64>(&mut con);
    let (written, listed) = tokio::join!(join_all(chunks), listed);
    for r in written {
        r.map_err(|e| to_index_error(&e))?;
    }
    listed.map_err(|e| to_index_error(&e))?;
    Ok(())
}

/// Where a load leaves the stream reader.
#[derive(Debug, Clone, Copy)]
pub(super) struct Loaded {
    /// Read the stream after this (rewound before `head`).
    pub from: EntryId,
    /// The stream's newest entry when the load began: what the snapshot covers.
    pub head: EntryId,
    /// Block keys loaded.
    pub keys: u64,
}

/// Pod names read from `P:pods` per round trip.
const SCAN_COUNT: usize = 1_000;

/// Loads the recorded entries of every pod in `P:pods` that `members` admits from Redis into
/// `local`, oldest first, and answers where the stream is to be read from. Pods it does not
/// admit are counted and not read.
pub(super) async fn load(
    shared: &Shared,
    local: &Local,
    members: &Following,
) -> Result<Loaded, IndexError> {
    let mut con = shared.conn.write().await?;
    // Rewound: an entry is published before its snapshot is written, so the last seconds of the
    // stream are read again (applying an entry twice only refreshes it).
    let newest = newest(&mut con, &shared.schema.stream()).await?;
    let rewind = (shared.write_budget * 2).max(LOAD_REWIND).as_millis() as u64;
    let from = match newest {
        EntryId(0, 0) => newest,
        EntryId(ms, _) => EntryId(ms.saturating_sub(rewind), 0),
    };
    let mut loaded = 0u64;
    // SSCAN may name a pod twice; the set of those loaded is bounded by the pods admitted.
    let mut done = ahash::AHashSet::new();
    let mut unknown = 0u64;
    let mut cursor = 0u64;
    loop {
        let (next, names): (u64, Vec<Vec<u8>>) = redis::cmd("SSCAN")
            .arg(shared.schema.pods())
            .arg(cursor)
            .arg("COUNT")
            .arg(SCAN_COUNT)
            .query_async(&mut con)
            .await
            .map_err(|e| to_index_error(&e))?;
        for name in names {
            let Some(pod) = std::str::from_utf8(&name)
                .ok()
                .filter(|p| !p.is_empty() && p.len() <= MAX_POD)
                .map(PodId::new)
            else {
                continue;
            };
            if !members.admits(&pod) {
                unknown += 1;
                continue;
            }
            if done.insert(pod.clone()) {
                loaded += load_pod(shared, &mut con, local, &pod).await?;
            }
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    shared.metrics.unknown_pods(Unknown::Load, unknown);
    Ok(Loaded {
        from,
        head: newest,
        keys: loaded,
    })
}

/// Loads `pods`' recorded entries from Redis into `local` (pods that joined the pod set), and
/// answers how many keys it loaded.
pub(super) async fn load_pods(
    shared: &Shared,
    local: &Local,
    pods: &[PodId],
) -> Result<u64, IndexError> {
    let mut con = shared.conn.write().await?;
    let mut loaded = 0u64;
    for pod in pods {
        loaded += load_pod(shared, &mut con, local, pod).await?;
    }
    Ok(loaded)
}

/// Loads `pod`'s unexpired entries into `local`, oldest first; answers how many keys.
async fn load_pod(
    shared: &Shared,
    con: &mut Handle,
    local: &Local,
    pod: &PodId,
) -> Result<u64, IndexError> {
    let (wall_now, ttl) = (shared.wall_now(), shared.tuning.record_ttl_ms);
    let mut loaded = 0u64;
    let mut start = 0isize;
    loop {
        let (read, entries) = if shared.snapshot {
            scored(shared, con, pod, start).await?
        } else {
            hashed(shared, con, pod, start).await?
        };
        for (keys, expiry) in entries {
            if expiry <= wall_now {
                continue;
            }
            let at = shared.mono(expiry.saturating_sub(ttl));
            match local {
                Local::Memory(m) => m.record(pod, &keys, at).await?,
                Local::Events(ev) => {
                    for key in &keys {
                        let key = std::slice::from_ref(key);
                        ev.record_past(pod, key, ev.held_prefix(pod, key), at);
                    }
                }
            }
            loaded += keys.len() as u64;
        }
        if read < LOAD_CHUNK {
            return Ok(loaded);
        }
        start += LOAD_CHUNK;
    }
}

/// Keys loaded together, and their expiry.
type Runs = Vec<(Vec<BlockKey>, u64)>;

/// One chunk of `pod`'s snapshot set from `start`, oldest first: members read, and each run's
/// (keys, expiry). A member of one key (an older replica's) is a run of one.
async fn scored(
    shared: &Shared,
    con: &mut Handle,
    pod: &PodId,
    start: isize,
) -> Result<(isize, Runs), IndexError> {
    let members: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
        .arg(shared.schema.snapshot(pod))
        .arg(start)
        .arg(start + LOAD_CHUNK - 1)
        .arg("WITHSCORES")
        .query_async(con)
        .await
        .map_err(|e| to_index_error(&e))?;
    let entries = members
        .iter()
        .filter_map(|(m, score)| Some((parse_run(m)?.1, expiry_of(*score)?)))
        .collect();
    Ok((members.len() as isize, entries))
}

/// One chunk of `pod`'s recency set from `start`, oldest first, with each entry's expiry from
/// its hash (precise mode, `lookups: redis`): members read, and each held entry's (key, expiry).
async fn hashed(
    shared: &Shared,
    con: &Handle,
    pod: &PodId,
    start: isize,
) -> Result<(isize, Runs), IndexError> {
    let members: Vec<Vec<u8>> = redis::cmd("ZRANGE")
        .arg(shared.schema.lru(pod))
        .arg(start)
        .arg(start + LOAD_CHUNK - 1)
        .query_async(&mut con.clone())
        .await
        .map_err(|e| to_index_error(&e))?;
    let entries: Vec<(u64, BlockKey)> = members.iter().filter_map(|m| parse_member(m)).collect();
    let expiries = join_all(entries.iter().map(|&(root, key)| {
        let mut con = con.clone();
        let k = shared.schema.recorded(root, key);
        async move {
            redis::cmd("HGET")
                .arg(k)
                .arg(pod.as_str())
                .query_async::<Option<u64>>(&mut con)
                .await
        }
    }))
    .await;
    let mut out = Vec::with_capacity(entries.len());
    for ((_, key), expiry) in entries.iter().zip(expiries) {
        if let Some(e) = expiry.map_err(|e| to_index_error(&e))? {
            out.push((vec![*key], e));
        }
    }
    Ok((members.len() as isize, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_score_carries_its_expiry_and_puts_the_prompt_head_highest() {
        let expiry = 1_800_000_000_123u64;
        let scores: Vec<f64> = [0, 1, 2, 1_022, 1_023, 5_000]
            .iter()
            .map(|&i| score(expiry, i).parse().unwrap())
            .collect();
        assert!(scores.windows(2).take(4).all(|w| w[0] > w[1]), "{scores:?}");
        assert_eq!(scores[4], scores[5], "the far tail shares the lowest rank");
        for s in &scores {
            assert_eq!(expiry_of(*s), Some(expiry));
        }
        assert!(scores[0] < (expiry + 1) as f64);
        assert_eq!(score(7, 0), "7.9990234375");
        assert_eq!(score(7, 1_023), "7.0000000000");
        assert_eq!(expiry_of(f64::NAN), None);
        assert_eq!(expiry_of(-1.0), None);
    }
}
