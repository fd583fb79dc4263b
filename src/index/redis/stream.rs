//! What the streams (the mirror's `P:log`, the load stream) have in common: entry ids, the
//! bounds on what an entry may carry, reading, and the supervision of the tasks that follow them.

use std::sync::Arc;
use std::time::Duration;

use redis::streams::{StreamId, StreamRangeReply, StreamReadReply};

use super::conn::{to_index_error, Handle};
use super::state::Shared;
use crate::index::IndexError;

/// Entries read per `XREAD`.
pub(super) const BATCH: usize = 512;
/// How long one `XREAD` waits for new entries (well under the connection's response timeout).
const BLOCK_MS: u64 = 250;
/// Longest pod name accepted from the stream.
pub(super) const MAX_POD: usize = 512;
/// Most uncached tokens one entry may charge (far above any model's context).
pub(super) const MAX_CHARGE_TOKENS: u64 = 1 << 24;
/// Longest prefill one entry may charge, in ms (the in-flight accounting's own cap).
pub(super) const MAX_CHARGE_MS: u64 = crate::pods::MAX_PREFILL.as_millis() as u64;

/// A stream entry id, ordered as Redis orders them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub(super) struct EntryId(pub(super) u64, pub(super) u64);

impl EntryId {
    pub(super) fn parse(s: &str) -> Option<Self> {
        let (ms, seq) = s.split_once('-')?;
        Some(Self(ms.parse().ok()?, seq.parse().ok()?))
    }

    /// The position just before every entry added at or after unix ms `ms`.
    pub(super) fn at_ms(ms: u64) -> Self {
        Self(ms, 0)
    }

    pub(super) fn render(self) -> String {
        format!("{}-{}", self.0, self.1)
    }
}

/// Runs `task` until it returns, restarting it (counted) whenever it panics.
pub(super) fn supervise<F, Fut>(shared: Arc<Shared>, task: F)
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            match tokio::spawn(task()).await {
                Err(e) if e.is_panic() => {
                    shared.metrics.mirror_restarts.inc();
                    tracing::error!("redis mirror task panicked; restarting");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                _ => return,
            }
        }
    });
}

/// The id of stream `key`'s newest entry (`0-0` when there is none).
pub(super) async fn newest(con: &mut Handle, key: &str) -> Result<EntryId, IndexError> {
    let r: StreamRangeReply = redis::cmd("XREVRANGE")
        .arg(key)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query_async(con)
        .await
        .map_err(|e| to_index_error(&e))?;
    Ok(r.ids
        .first()
        .and_then(|e| EntryId::parse(&e.id))
        .unwrap_or_default())
}

/// Up to [`BATCH`] entries of stream `key` after `from`, waiting up to [`BLOCK_MS`] for one.
pub(super) async fn read_after(
    con: &mut Handle,
    key: &str,
    from: EntryId,
) -> Result<Vec<StreamId>, IndexError> {
    let reply: Option<StreamReadReply> = redis::cmd("XREAD")
        .arg("COUNT")
        .arg(BATCH)
        .arg("BLOCK")
        .arg(BLOCK_MS)
        .arg("STREAMS")
        .arg(key)
        .arg(from.render())
        .query_async(con)
        .await
        .map_err(|e| to_index_error(&e))?;
    Ok(reply
        .map(|r| r.keys.into_iter().flat_map(|k| k.ids).collect())
        .unwrap_or_default())
}
