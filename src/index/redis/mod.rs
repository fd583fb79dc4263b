//! The shared index: Redis or Valkey, one for every router replica, so N replicas route like
//! one. Lookups are one server-side script on one shard within a latency budget; writes queue
//! off the request path. Each replica keeps its own in-process index beside it (the same one
//! `backend: memory` would build) and answers from it whenever Redis is slow, down or
//! misbehaving: the client never sees an error. docs/redis-schema.md describes the keys.
//!
//! Who may call: only this router, with the credentials in `index.redis`. What it may change:
//! entries under `key_prefix`. Anyone who can write there can steer routing, so the Redis
//! deployment must be as private as the router's own ports.

mod announced;
#[cfg(test)]
mod cluster_tests;
mod conn;
mod load;
#[cfg(test)]
mod long_prompt_tests;
mod members;
mod metrics;
mod mirror;
#[cfg(test)]
mod mirror_tests;
mod peers;
#[cfg(test)]
mod peers_tests;
#[cfg(test)]
mod prop_tests;
#[cfg(test)]
mod recovery_tests;
mod schema;
mod sessions;
mod snapshot;
mod state;
mod stream;
#[cfg(test)]
mod tls_tests;
mod writer;
#[cfg(test)]
mod writer_tests;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use lru::LruCache;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use xxhash_rust::xxh3::Xxh3;

use self::conn::Conn;
pub use self::members::{MembersFeed, PodMembers};
pub use self::metrics::{Reason, RedisMetrics, Reload, Source, Unknown};
use self::mirror::{Change, Mirror};
pub use self::schema::{decode_lookup_reply, member, parse_member, parse_run, run_member, RUN};
use self::schema::{Schema, Scripts};
use self::state::{Cached, Pause, Shared, GENERATIONS};
pub use self::state::{Local, Tuning};
use self::writer::WriteOp;
use super::{ApplyStats, EventIndex, IndexError, IndexStats, KvIndex};
use crate::blocks::BlockKey;
use crate::config::{RedisConfig, RedisLookups, RedisMode};
use crate::events::KvEventBatch;
use crate::pods::PodId;
use crate::scoring::SharedSessions;
use crate::share::{Charge, LoadShare, Release, RemoteLoad};

/// How long `flush` waits for the mirror to apply what the stream holds.
const MIRROR_SYNC: Duration = Duration::from_secs(10);

/// The shared index backend.
pub struct RedisIndex {
    shared: Arc<Shared>,
    local: Arc<Local>,
    tx: mpsc::Sender<WriteOp>,
    /// `lookups: mirror`: the stream publisher and reader keeping `local` current.
    mirror: Option<Arc<Mirror>>,
    /// With the mirror, a decision leaves in Redis the entries recorded less than this ago (0:
    /// rewrites all): lookups read the mirror, so Redis's copy only seeds a starting replica.
    refresh_ms: u64,
}

impl RedisIndex {
    /// Connects lazily to the Redis of `cfg` (nothing is dialled until the first request), with
    /// `local` as this replica's own index, its mirror keeping records for every pod. Must run
    /// inside a tokio runtime (it starts the writer task).
    pub fn new(
        cfg: &RedisConfig,
        local: Local,
        tuning: Tuning,
        metrics: RedisMetrics,
    ) -> Result<Self, String> {
        Self::with_members(cfg, local, tuning, metrics, PodMembers::everyone())
    }

    /// [`RedisIndex::new`], its mirror keeping records only for the pods in `members`.
    pub fn with_members(
        cfg: &RedisConfig,
        local: Local,
        tuning: Tuning,
        metrics: RedisMetrics,
        members: PodMembers,
    ) -> Result<Self, String> {
        let password = cfg.resolve_password()?;
        let conn = Conn::open(cfg, password.as_deref())?;
        let precise = matches!(local, Local::Events(_));
        let shared = Arc::new(Shared {
            conn,
            schema: Schema::new(&cfg.key_prefix, cfg.mode == RedisMode::Cluster),
            scripts: Scripts::new(),
            precise,
            snapshot: !precise && cfg.lookups == RedisLookups::Mirror,
            tuning,
            default_capacity: tuning.default_capacity.max(1),
            lookup_budget: Duration::from_millis(cfg.lookup_budget_ms),
            write_budget: Duration::from_millis(cfg.write_budget_ms),
            per_block_us: cfg.budget_us_per_block,
            retry_after: Duration::from_millis(cfg.retry_after_ms),
            pause: Mutex::new(Pause::default()),
            match_cache_ms: cfg.match_cache_ms,
            cache: Mutex::new(LruCache::new(
                std::num::NonZeroUsize::new(cfg.match_cache_entries.max(1)).expect("max(1)"),
            )),
            generations: (0..GENERATIONS).map(|_| AtomicU64::new(0)).collect(),
            global_generation: AtomicU64::new(0),
            clock_offset: OnceLock::new(),
            created: Instant::now(),
            lost_writes: AtomicBool::new(false),
            writes_ok: AtomicBool::new(true),
            metrics,
        });
        let (tx, rx) = mpsc::channel(cfg.write_queue.max(1));
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        let writer_shared = shared.clone();
        tokio::spawn(async move {
            loop {
                let run = tokio::spawn(writer::run(writer_shared.clone(), rx.clone()));
                match run.await {
                    Err(e) if e.is_panic() => {
                        writer_shared.metrics.writer_restarts.inc();
                        tracing::error!("redis writer task panicked; restarting");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    _ => return,
                }
            }
        });
        let local = Arc::new(local);
        let mirror = (cfg.lookups == RedisLookups::Mirror)
            .then(|| Mirror::start(cfg, shared.clone(), local.clone(), members));
        // Bounded by a quarter of the TTL, so a skipped entry's key still outlives most of it.
        let refresh_ms = match mirror {
            Some(_) => cfg.record_refresh_ms.min(tuning.record_ttl_ms / 4),
            None => 0,
        };
        Ok(Self {
            shared,
            local,
            tx,
            mirror,
            refresh_ms,
        })
    }

    /// The metric families (tests).
    pub fn metrics(&self) -> &RedisMetrics {
        &self.shared.metrics
    }

    /// This replica's id on the streams and in `P:peers` (tests).
    #[cfg(test)]
    pub(crate) fn replica_id(&self) -> Option<u64> {
        Some(self.mirror.as_ref()?.origin)
    }

    /// Where this replica receives load datagrams (tests).
    #[cfg(test)]
    pub(crate) fn load_peers_addr(&self) -> Option<std::net::SocketAddr> {
        self.mirror
            .as_ref()?
            .load
            .as_ref()?
            .peers
            .as_ref()?
            .local_addr()
    }

    /// The session map shared through the same Redis.
    pub fn sessions(&self) -> Arc<dyn SharedSessions> {
        Arc::new(sessions::RedisSessions {
            shared: self.shared.clone(),
            tx: self.tx.clone(),
            mirror: self.mirror.clone(),
        })
    }

    fn enqueue(&self, op: WriteOp) {
        use mpsc::error::TrySendError;
        match self.tx.try_send(op) {
            Ok(()) => {
                self.shared.metrics.write_queue.inc();
            }
            Err(TrySendError::Full(_)) => {
                self.shared.metrics.dropped(metrics::Dropped::QueueFull, 1)
            }
            Err(TrySendError::Closed(_)) => self.shared.metrics.dropped(metrics::Dropped::Error, 1),
        };
    }

    /// What `pod`'s events now say about `touched` keys, and which of them, or of `settled`
    /// keys, lost their guess as a decision's hits; deduplicated.
    fn event_changes(
        &self,
        ev: &EventIndex,
        pod: &PodId,
        touched: Vec<(u64, BlockKey)>,
        settled: Vec<(u64, BlockKey)>,
    ) -> Vec<writer::Change> {
        let mut all: Vec<(u64, BlockKey, bool)> = touched
            .into_iter()
            .map(|(r, k)| (r, k, false))
            .chain(settled.into_iter().map(|(r, k)| (r, k, true)))
            .collect();
        // Settled first among equal keys, so the dedup keeps it.
        all.sort_unstable_by_key(|&(r, k, s)| (r, k.0, !s));
        all.dedup_by_key(|e| (e.0, e.1));
        all.into_iter()
            .map(|(root, key, settled)| {
                self.shared.wrote(key);
                (root, key, ev.tier(pod, &key), settled)
            })
            .collect()
    }

    /// A record, published to the other replicas with its `charge` when it was a routed request.
    /// Never waits: the in-process record is immediate and the Redis writes are queued.
    fn record_with(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64, charge: Option<Charge>) {
        let Some(first) = keys.first() else {
            self.local.record(pod, keys, now_ms);
            return;
        };
        let root = first.0;
        let wall = self.shared.wall(now_ms);
        let publish = |keys: &[BlockKey]| {
            if let Some(m) = &self.mirror {
                let (pod, keys) = (pod.clone(), keys.to_vec());
                let change = Change::Record {
                    pod,
                    keys,
                    wall,
                    charge,
                };
                m.publish(&self.shared, change);
            }
        };
        // The entries to write to Redis.
        let stale: Vec<BlockKey> = match &*self.local {
            // A request that computes nothing gets no guess (`EventIndex::record_past`); its
            // load still counts on every replica.
            Local::Events(ev) => {
                if !ev.record_past(pod, keys, ev.held_prefix(pod, keys), now_ms) {
                    if charge.is_some() {
                        publish(keys);
                    }
                    return;
                }
                keys.to_vec()
            }
            // Whole runs, as the snapshot stores them: a run is rewritten unless every key of it
            // is fresh, so the runs kept stay aligned to the prompt's first block.
            Local::Memory(m) if self.refresh_ms > 0 => {
                let fresh = m.record_noting_fresh(pod, keys, now_ms, self.refresh_ms);
                keys.chunks(RUN)
                    .zip(fresh.chunks(RUN))
                    .filter(|(_, f)| !f.iter().all(|&f| f))
                    .flat_map(|(k, _)| k.iter().copied())
                    .collect()
            }
            Local::Memory(m) => {
                m.learn(pod, keys, now_ms);
                keys.to_vec()
            }
        };
        for &k in keys {
            self.shared.wrote(k);
        }
        publish(keys);
        let skipped = keys.len() - stale.len();
        self.shared.metrics.record_skipped.inc_by(skipped as u64);
        if stale.is_empty() {
            return;
        }
        self.enqueue(WriteOp::Record {
            pod: pod.clone(),
            root,
            keys: stale,
            expiry: wall.saturating_add(self.shared.tuning.record_ttl_ms),
        });
    }

    fn cache_key(keys: &[BlockKey], pods: &[PodId]) -> u64 {
        let mut h = Xxh3::new();
        for k in keys {
            h.update(&k.0.to_le_bytes());
        }
        h.update(&[0xff]);
        for p in pods {
            h.update(p.as_str().as_bytes());
            h.update(&[0]);
        }
        h.digest()
    }
}

#[async_trait]
impl KvIndex for RedisIndex {
    async fn lookup(
        &self,
        keys: &[BlockKey],
        pods: &[PodId],
        now_ms: u64,
    ) -> Result<Vec<f64>, IndexError> {
        let sh = &self.shared;
        if keys.is_empty() || pods.is_empty() {
            return Ok(vec![0.0; pods.len()]);
        }
        if self.mirror.is_some() {
            // Fixes the clock offset at this replica's first decision, as a record would.
            sh.wall(now_ms);
            sh.metrics.looked_up(Source::Mirror);
            return self.local.index().lookup(keys, pods, now_ms).await;
        }
        let generation = sh.generation(keys);
        let wall = sh.wall(now_ms);
        let cache_key = (sh.match_cache_ms > 0).then(|| Self::cache_key(keys, pods));
        if let Some(ck) = cache_key {
            if let Some(c) = sh.cache.lock().get(&ck) {
                if wall < c.until && c.generation == generation {
                    sh.metrics.looked_up(Source::Cache);
                    return Ok(c.matched.clone());
                }
            }
        }
        if sh.paused() {
            sh.metrics.fell_back(Reason::RetryWait);
            return self.local.index().lookup(keys, pods, now_ms).await;
        }
        let started = Instant::now();
        let budget = sh.lookup_budget_for(keys.len());
        let answer = tokio::time::timeout(budget, sh.remote_lookup(keys, pods, wall))
            .await
            .unwrap_or(Err(IndexError::Timeout(budget)));
        sh.metrics
            .lookup_seconds
            .observe(started.elapsed().as_secs_f64());
        sh.metrics.round_trips.inc();
        match answer {
            Ok(answer) => {
                sh.answered();
                sh.metrics.looked_up(Source::Redis);
                if let Some(ck) = cache_key {
                    let until = wall
                        .saturating_add(sh.match_cache_ms)
                        .min(answer.soonest_expiry.unwrap_or(u64::MAX));
                    sh.cache.lock().put(
                        ck,
                        Cached {
                            matched: answer.matched.clone(),
                            until,
                            generation,
                        },
                    );
                }
                Ok(answer.matched)
            }
            Err(e) => {
                tracing::debug!(error = %e, "redis lookup failed; using this replica's index");
                sh.failed(&e);
                sh.metrics.fell_back(Reason::of(&e));
                self.local.index().lookup(keys, pods, now_ms).await
            }
        }
    }

    async fn record(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64) -> Result<(), IndexError> {
        self.record_with(pod, keys, now_ms, None);
        Ok(())
    }

    async fn forget_pod(&self, pod: &PodId) -> Result<(), IndexError> {
        self.local.index().forget_pod(pod).await?;
        self.shared.wrote_everywhere();
        self.enqueue(WriteOp::Forget {
            pod: pod.clone(),
            recorded_only: false,
        });
        Ok(())
    }

    async fn set_capacity(&self, pod: &PodId, blocks: usize) -> Result<(), IndexError> {
        self.local.index().set_capacity(pod, blocks).await?;
        if !self.shared.precise {
            self.shared.wrote_everywhere();
            self.enqueue(WriteOp::Capacity {
                pod: pod.clone(),
                blocks: blocks.max(1),
            });
        }
        Ok(())
    }

    async fn sweep(&self, now_ms: u64) -> Result<(), IndexError> {
        // Redis frees expired entries by itself (key TTLs, pod capacity); this sweeps the
        // fallback, and, once Redis takes writes again after losing some, rewrites each pod's
        // event state so removals lost in the outage leave nothing stale.
        if let Local::Events(ev) = &*self.local {
            let reachable = self.shared.writes_ok.load(Ordering::Acquire);
            if reachable && self.shared.lost_writes.swap(false, Ordering::AcqRel) {
                for pod in ev.pods() {
                    let held = ev.held(&pod).into_iter();
                    let held = held.map(|(r, k, t)| (r, k, t, false)).collect();
                    self.shared.wrote_everywhere();
                    self.enqueue(WriteOp::Resync { pod, held });
                }
            }
        }
        self.local.index().sweep(now_ms).await
    }

    async fn apply_events(
        &self,
        pod: &PodId,
        rank: u32,
        model: &str,
        batch: &KvEventBatch,
    ) -> Result<ApplyStats, IndexError> {
        let Local::Events(ev) = &*self.local else {
            return Ok(ApplyStats::default());
        };
        let (stats, touched, settled) = ev.apply_tracked(pod, rank, model, batch);
        let changes = self.event_changes(ev, pod, touched, settled);
        if !changes.is_empty() {
            self.enqueue(WriteOp::Events {
                pod: pod.clone(),
                changes,
            });
        }
        Ok(stats)
    }

    async fn forget_rank(&self, pod: &PodId, rank: u32) -> Result<(), IndexError> {
        let Local::Events(ev) = &*self.local else {
            return self.forget_pod(pod).await;
        };
        let touched = ev.forget_rank_tracked(pod, rank);
        let changes = self.event_changes(ev, pod, touched, Vec::new());
        if !changes.is_empty() {
            self.enqueue(WriteOp::Events {
                pod: pod.clone(),
                changes,
            });
        }
        // The engine restarted or we lost its stream: its speculative entries go too.
        self.shared.wrote_everywhere();
        self.enqueue(WriteOp::Forget {
            pod: pod.clone(),
            recorded_only: true,
        });
        Ok(())
    }

    async fn flush(&self) -> Result<(), IndexError> {
        let (done, wait) = oneshot::channel();
        self.tx
            .send(WriteOp::Flush(done))
            .await
            .map_err(|_| IndexError::Connection("redis writer stopped".into()))?;
        wait.await
            .map_err(|_| IndexError::Connection("redis writer stopped".into()))?;
        match &self.mirror {
            Some(m) => m.sync(&self.shared, MIRROR_SYNC).await,
            None => Ok(()),
        }
    }

    fn stats(&self) -> IndexStats {
        self.local.index().stats()
    }

    fn unready(&self) -> Option<String> {
        self.mirror.as_ref().and_then(|m| m.unready())
    }

    fn describe(&self) -> &'static str {
        if self.mirror.is_some() {
            "redis (shared by replicas; answered from this replica's mirror, kept current from a Redis stream)"
        } else {
            "redis (shared by replicas; this replica's in-process index answers when Redis cannot)"
        }
    }
}

/// Replica load sharing: with `lookups: mirror` and `mirror_load`, a routed request's load goes
/// to the other replicas ahead of its record (the load stream and peers) and with it (the
/// record's change on the mirror stream); theirs comes back to the attached sink.
impl LoadShare for RedisIndex {
    fn attach(&self, sink: Arc<dyn RemoteLoad>) {
        if let Some(m) = &self.mirror {
            m.attach(sink);
        }
    }

    fn announce(&self, pod: &PodId, charge: &Charge) -> Option<u64> {
        let load = self.mirror.as_ref()?.load.as_ref()?;
        Some(load.announce(&self.shared, pod, Shared::wall_now_us(), charge))
    }

    fn release(&self, pod: &PodId, seq: u64, how: Release) {
        if let Some(load) = self.mirror.as_ref().and_then(|m| m.load.as_ref()) {
            load.release(&self.shared, pod, seq, Shared::wall_now_us(), how);
        }
    }

    fn catch_up(&self) {
        if let Some(m) = &self.mirror {
            m.catch_up_load(&self.shared);
        }
    }

    fn record_decision(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64, charge: Charge) -> bool {
        // Without the mirror's `mirror_load` the record carries no load: the caller's plain
        // record writes the same thing.
        if !self.mirror.as_ref().is_some_and(|m| m.share_load) {
            return false;
        }
        self.record_with(pod, keys, now_ms, Some(charge));
        true
    }
}
