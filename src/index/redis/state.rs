//! The state every part of the shared index works on: this replica's own index ([`Local`]) and
//! the connection, key schema, budgets and counters the router-facing side, the writer and the
//! mirror share ([`Shared`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lru::LruCache;
use parking_lot::Mutex;

use super::conn::{to_index_error, Conn};
use super::metrics::RedisMetrics;
use super::schema::{decode_lookup_reply, Schema, Scripts};
use crate::blocks::BlockKey;
use crate::index::{EventIndex, IndexError, KvIndex, MemoryIndex};
use crate::pods::PodId;

/// Buckets (by block key) of the write generations that invalidate cached lookups.
pub(super) const GENERATIONS: usize = 4_096;
/// Timeouts in a row before lookups pause on Redis (one slow answer is not an outage).
const TIMEOUTS_BEFORE_PAUSE: u32 = 3;

/// This replica's own index: answers when Redis cannot, and (precise mode) turns KV events
/// into the per-key changes written to Redis.
pub enum Local {
    /// Learns from this replica's decisions.
    Memory(MemoryIndex),
    /// Learns from KV events (plus speculative entries).
    Events(EventIndex),
}

impl Local {
    pub(super) fn index(&self) -> &dyn KvIndex {
        match self {
            Local::Memory(m) => m,
            Local::Events(e) => e,
        }
    }

    /// [`KvIndex::record`], which neither in-process index can fail or wait on.
    pub(super) fn record(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64) {
        match self {
            Local::Memory(m) => m.learn(pod, keys, now_ms),
            Local::Events(e) => {
                e.record_past(pod, keys, e.held_prefix(pod, keys), now_ms);
            }
        }
    }
}

/// How the shared index weighs and bounds entries.
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// How long a recorded entry matches (approximate TTL, or the speculative TTL).
    pub record_ttl_ms: u64,
    /// Recorded entries a pod keeps unless `set_capacity` says otherwise.
    pub default_capacity: usize,
    /// Weight of a GPU-resident block (and of a recorded entry in precise mode).
    pub gpu_weight: f64,
    /// Weight of an offloaded block.
    pub cpu_weight: f64,
}

/// Lookups paused after failures (a circuit breaker on the real clock: this is about Redis's
/// health, not about routing, so it does not take the decision's clock).
#[derive(Debug, Default)]
pub(super) struct Pause {
    until: Option<Instant>,
    timeouts: u32,
}

pub(super) struct Cached {
    pub(super) matched: Vec<f64>,
    /// Unix ms until which the answer may be reused.
    pub(super) until: u64,
    pub(super) generation: (u64, u64),
}

/// A lookup's answer: per-candidate weights, and the earliest expiry among the recorded entries
/// counted (unix ms).
pub(super) struct Answer {
    pub(super) matched: Vec<f64>,
    pub(super) soonest_expiry: Option<u64>,
}

/// State shared by the router-facing side and the writer task.
pub(crate) struct Shared {
    pub(super) conn: Conn,
    pub(super) schema: Schema,
    pub(super) scripts: Scripts,
    pub(super) precise: bool,
    /// Recorded entries are kept only as each pod's snapshot set (approximate mode answered by
    /// the mirror: nothing reads the per-block hashes).
    pub(super) snapshot: bool,
    pub(super) tuning: Tuning,
    pub(super) default_capacity: usize,
    pub(super) lookup_budget: Duration,
    pub(super) write_budget: Duration,
    /// Microseconds added to the lookup budget per block read, twice per block written.
    pub(super) per_block_us: u64,
    pub(super) retry_after: Duration,
    pub(super) pause: Mutex<Pause>,
    pub(super) match_cache_ms: u64,
    pub(super) cache: Mutex<LruCache<u64, Cached>>,
    pub(super) generations: Box<[AtomicU64]>,
    pub(super) global_generation: AtomicU64,
    pub(super) clock_offset: OnceLock<i64>,
    /// When this index was made: the router's monotonic clock starts about then.
    pub(super) created: Instant,
    /// Writes were dropped since the last resync (precise mode rewrites event state then).
    pub(super) lost_writes: AtomicBool,
    /// The last write batch reached Redis (so a resync can).
    pub(super) writes_ok: AtomicBool,
    pub(super) metrics: RedisMetrics,
}

impl Shared {
    /// Unix milliseconds for the router's monotonic `now_ms`, fixed at first use so entries from
    /// different replicas compare on one (NTP-synchronised) clock.
    pub(super) fn wall(&self, now_ms: u64) -> u64 {
        let offset = *self
            .clock_offset
            .get_or_init(|| Self::unix_ms() - now_ms as i64);
        (now_ms as i64).saturating_add(offset).max(0) as u64
    }

    /// The router's monotonic milliseconds for unix ms `wall` (another replica's time): before
    /// this replica's first decision fixes the offset, its clock is taken to start at `created`.
    pub(super) fn mono(&self, wall: u64) -> u64 {
        let offset = *self
            .clock_offset
            .get_or_init(|| Self::unix_ms() - self.created.elapsed().as_millis() as i64);
        (wall as i64).saturating_sub(offset).max(0) as u64
    }

    /// Unix milliseconds now (lags and expiries between replicas).
    pub(super) fn wall_now(&self) -> u64 {
        Self::unix_ms().max(0) as u64
    }

    /// Unix microseconds now (the load stream's clock).
    pub(super) fn wall_now_us() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
    }

    pub(super) fn unix_ms() -> i64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64)
    }

    /// A snapshot that changes whenever this replica writes any of `keys` (or forgets a pod):
    /// the sum of the keys' write-generation buckets, and the global generation.
    pub(super) fn generation(&self, keys: &[BlockKey]) -> (u64, u64) {
        let sum = keys.iter().fold(0u64, |acc, k| {
            acc.wrapping_add(self.generations[(k.0 as usize) % GENERATIONS].load(Ordering::Acquire))
        });
        (sum, self.global_generation.load(Ordering::Acquire))
    }

    /// Notes a write of `key` (cached lookups that include it are stale).
    pub(super) fn wrote(&self, key: BlockKey) {
        self.generations[(key.0 as usize) % GENERATIONS].fetch_add(1, Ordering::AcqRel);
    }

    pub(super) fn wrote_everywhere(&self) {
        self.global_generation.fetch_add(1, Ordering::AcqRel);
    }

    /// How long a lookup of `blocks` blocks may take before it falls back.
    pub(super) fn lookup_budget_for(&self, blocks: usize) -> Duration {
        self.lookup_budget + Duration::from_micros(self.per_block_us.saturating_mul(blocks as u64))
    }

    /// How long a write of `blocks` blocks may take before it is abandoned.
    pub(super) fn write_budget_for(&self, blocks: usize) -> Duration {
        let us = self
            .per_block_us
            .saturating_mul(2)
            .saturating_mul(blocks as u64);
        self.write_budget + Duration::from_micros(us)
    }

    pub(super) fn paused(&self) -> bool {
        let mut p = self.pause.lock();
        match p.until {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                p.until = None;
                false
            }
            None => false,
        }
    }

    pub(super) fn answered(&self) {
        self.pause.lock().timeouts = 0;
    }

    pub(super) fn failed(&self, e: &IndexError) {
        let mut p = self.pause.lock();
        if matches!(e, IndexError::Timeout(_)) {
            p.timeouts += 1;
            if p.timeouts < TIMEOUTS_BEFORE_PAUSE {
                return;
            }
        }
        p.timeouts = 0;
        p.until = Some(Instant::now() + self.retry_after);
    }

    pub(super) async fn remote_lookup(
        &self,
        keys: &[BlockKey],
        pods: &[PodId],
        wall: u64,
    ) -> Result<Answer, IndexError> {
        let root = keys[0].0;
        let mut con = self.conn.lookup().await?;
        let mut inv = self.scripts.lookup.prepare_invoke();
        for &k in keys {
            inv.key(self.schema.recorded(root, k));
            if self.precise {
                inv.key(self.schema.evented(root, k));
            }
        }
        let (gw, cw) = if self.precise {
            (self.tuning.gpu_weight, self.tuning.cpu_weight)
        } else {
            (1.0, 1.0)
        };
        inv.arg(wall).arg(u8::from(self.precise)).arg(gw).arg(cw);
        for p in pods {
            inv.arg(p.as_str());
        }
        let out: Vec<String> = inv
            .invoke_async(&mut con)
            .await
            .map_err(|e| to_index_error(&e))?;
        let (matched, soonest_expiry) = decode_lookup_reply(&out, pods.len())?;
        Ok(Answer {
            matched,
            soonest_expiry,
        })
    }
}
