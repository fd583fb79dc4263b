//! The shared index's metric families: where lookups were answered, why they fell back, how
//! long they took, and what happened to writes.

use std::fmt::Write as _;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::index::IndexError;

/// Where a lookup was answered.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Source {
    /// By Redis (one round trip).
    Redis,
    /// By the match cache (no round trip).
    Cache,
    /// By this replica's in-process index (fail open).
    Fallback,
    /// By this replica's mirror of the shared index (`lookups: mirror`; no round trip).
    Mirror,
}

impl Source {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Redis => "redis",
            Source::Cache => "cache",
            Source::Fallback => "fallback",
            Source::Mirror => "mirror",
        }
    }
}

impl EncodeLabelValue for Source {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        encoder.write_str(self.as_str())
    }
}

/// Why a lookup fell back to the in-process index.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Reason {
    /// No answer within `lookup_budget_ms`.
    Timeout,
    /// Not connected, or the connection broke.
    Connection,
    /// Redis out of memory, loading, or the cluster down.
    Overloaded,
    /// Authentication or permissions.
    Refused,
    /// An answer this router cannot read.
    Protocol,
    /// A recent failure: waiting `retry_after_ms` before trying Redis again.
    RetryWait,
}

impl Reason {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Timeout => "timeout",
            Reason::Connection => "connection",
            Reason::Overloaded => "overloaded",
            Reason::Refused => "refused",
            Reason::Protocol => "protocol",
            Reason::RetryWait => "retry_wait",
        }
    }
}

impl EncodeLabelValue for Reason {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        encoder.write_str(self.as_str())
    }
}

impl Reason {
    /// The reason for an index error.
    pub(crate) fn of(e: &IndexError) -> Self {
        match e {
            IndexError::Timeout(_) => Reason::Timeout,
            IndexError::Connection(_) => Reason::Connection,
            IndexError::Overloaded(_) => Reason::Overloaded,
            IndexError::Refused(_) => Reason::Refused,
            IndexError::Protocol(_) => Reason::Protocol,
        }
    }
}

/// What happened to writes that did not reach Redis.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub(crate) enum Dropped {
    /// The write queue was full.
    QueueFull,
    /// The batch took longer than `write_budget_ms`.
    Timeout,
    /// Redis answered an error or could not be reached.
    Error,
}

impl Dropped {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Dropped::QueueFull => "queue_full",
            Dropped::Timeout => "timeout",
            Dropped::Error => "error",
        }
    }
}

impl EncodeLabelValue for Dropped {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        encoder.write_str(self.as_str())
    }
}

/// Why a load datagram was not charged, or not sent.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub(crate) enum PeerDrop {
    /// Not a datagram of this format, or a load past a record's bounds.
    Malformed,
    /// Signed by no replica listed in `P:peers`.
    UnknownSender,
    /// The signature does not match the named replica's key.
    BadSignature,
    /// The socket refused to send (its buffer full).
    SendFailed,
}

impl EncodeLabelValue for PeerDrop {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        encoder.write_str(match self {
            PeerDrop::Malformed => "malformed",
            PeerDrop::UnknownSender => "unknown_sender",
            PeerDrop::BadSignature => "bad_signature",
            PeerDrop::SendFailed => "send_failed",
        })
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PeerDropLabel {
    pub(crate) reason: PeerDrop,
}

/// Why a mirror loaded the shared index from Redis's hashes.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Reload {
    /// The replica started.
    Start,
    /// Changes it had not read were trimmed from the stream (it fell behind, or was cut off).
    Gap,
    /// The stream could not be read (connection lost, Redis restarted): changes published
    /// meanwhile may be lost.
    Reconnect,
    /// Pods joined the pod set: their snapshots, whose records the mirror had dropped.
    Join,
}

impl EncodeLabelValue for Reload {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        encoder.write_str(match self {
            Reload::Start => "start",
            Reload::Gap => "gap",
            Reload::Reconnect => "reconnect",
            Reload::Join => "join",
        })
    }
}

/// Where the mirror met a pod outside the router's pod set (and dropped its records).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Unknown {
    /// A stream entry (counted per entry).
    Stream,
    /// A pod named in `P:pods` at a load (counted per pod).
    Load,
}

impl EncodeLabelValue for Unknown {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        encoder.write_str(match self {
            Unknown::Stream => "stream",
            Unknown::Load => "load",
        })
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct UnknownLabel {
    pub(crate) from: Unknown,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReloadLabel {
    pub(crate) reason: Reload,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SourceLabel {
    pub(crate) source: Source,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabel {
    pub(crate) reason: Reason,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DroppedLabel {
    pub(crate) reason: Dropped,
}

/// The shared index's metric families.
#[derive(Debug, Clone)]
pub struct RedisMetrics {
    pub(crate) lookups: Family<SourceLabel, Counter>,
    pub(crate) fallbacks: Family<ReasonLabel, Counter>,
    pub(crate) round_trips: Counter,
    pub(crate) lookup_seconds: Histogram,
    pub(crate) write_queue: Gauge,
    pub(crate) writes: Counter,
    pub(crate) record_skipped: Counter,
    pub(crate) writes_dropped: Family<DroppedLabel, Counter>,
    pub(crate) writer_restarts: Counter,
    pub(crate) mirror_lag: Histogram,
    pub(crate) mirror_applied: Counter,
    pub(crate) mirror_charges: Counter,
    pub(crate) mirror_published: Counter,
    pub(crate) mirror_publish_dropped: Family<DroppedLabel, Counter>,
    pub(crate) mirror_reloads: Family<ReloadLabel, Counter>,
    pub(crate) mirror_reload_entries: Counter,
    pub(crate) mirror_errors: Counter,
    pub(crate) mirror_bad_entries: Counter,
    pub(crate) mirror_unknown_pods: Family<UnknownLabel, Counter>,
    pub(crate) mirror_behind: Gauge,
    pub(crate) mirror_restarts: Counter,
    pub(crate) load_lag: Histogram,
    pub(crate) load_charges: Counter,
    pub(crate) load_releases: Counter,
    pub(crate) load_published: Counter,
    pub(crate) load_drops: Family<DroppedLabel, Counter>,
    pub(crate) load_peers: Gauge,
    pub(crate) load_peer_sent: Counter,
    pub(crate) load_peer_lag: Histogram,
    pub(crate) load_peer_charges: Counter,
    pub(crate) load_peer_drops: Family<PeerDropLabel, Counter>,
}

impl RedisMetrics {
    /// Families not registered anywhere (`kv-bench simulate`, tests).
    pub fn unregistered() -> Self {
        Self {
            lookups: Family::default(),
            fallbacks: Family::default(),
            round_trips: Counter::default(),
            lookup_seconds: Histogram::new(exponential_buckets(25e-6, 2.0, 16)),
            write_queue: Gauge::default(),
            writes: Counter::default(),
            record_skipped: Counter::default(),
            writes_dropped: Family::default(),
            writer_restarts: Counter::default(),
            // 50 µs .. ~6.5 s
            mirror_lag: Histogram::new(exponential_buckets(50e-6, 2.0, 18)),
            mirror_applied: Counter::default(),
            mirror_charges: Counter::default(),
            mirror_published: Counter::default(),
            mirror_publish_dropped: Family::default(),
            mirror_reloads: Family::default(),
            mirror_reload_entries: Counter::default(),
            mirror_errors: Counter::default(),
            mirror_bad_entries: Counter::default(),
            mirror_unknown_pods: Family::default(),
            mirror_behind: Gauge::default(),
            mirror_restarts: Counter::default(),
            // 10 µs .. ~2.6 s
            load_lag: Histogram::new(exponential_buckets(10e-6, 2.0, 19)),
            load_charges: Counter::default(),
            load_releases: Counter::default(),
            load_published: Counter::default(),
            load_drops: Family::default(),
            load_peers: Gauge::default(),
            load_peer_sent: Counter::default(),
            load_peer_lag: Histogram::new(exponential_buckets(10e-6, 2.0, 19)),
            load_peer_charges: Counter::default(),
            load_peer_drops: Family::default(),
        }
    }

    /// Registers the families under `redis_*` (`registry` is the `kv_router` sub-registry).
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::unregistered();
        registry.register(
            "redis_lookups",
            "Index lookups by where they were answered (redis, cache, fallback)",
            m.lookups.clone(),
        );
        registry.register(
            "redis_fallbacks",
            "Lookups answered by the in-process index instead of Redis, by reason",
            m.fallbacks.clone(),
        );
        registry.register(
            "redis_round_trips",
            "Round trips to Redis made by lookups (one per lookup that reached Redis)",
            m.round_trips.clone(),
        );
        registry.register(
            "redis_lookup_duration_seconds",
            "Time of lookups that reached Redis, answered or not",
            m.lookup_seconds.clone(),
        );
        registry.register(
            "redis_write_queue_depth",
            "Writes waiting for Redis",
            m.write_queue.clone(),
        );
        registry.register("redis_writes", "Writes applied to Redis", m.writes.clone());
        registry.register(
            "redis_record_skipped",
            "Recorded entries not rewritten in Redis: written less than record_refresh_ms before",
            m.record_skipped.clone(),
        );
        registry.register(
            "redis_writes_dropped",
            "Writes that did not reach Redis, by reason",
            m.writes_dropped.clone(),
        );
        registry.register(
            "redis_writer_restarts",
            "Times the Redis writer task died and was restarted",
            m.writer_restarts.clone(),
        );
        registry.register(
            "redis_mirror_lag_seconds",
            "Time from another replica's decision (its clock) to this replica's mirror applying it",
            m.mirror_lag.clone(),
        );
        registry.register(
            "redis_mirror_applied",
            "Other replicas' changes applied to this replica's mirror",
            m.mirror_applied.clone(),
        );
        registry.register(
            "redis_mirror_charges",
            "Other replicas' requests counted as in-flight load on their pods here",
            m.mirror_charges.clone(),
        );
        registry.register(
            "redis_mirror_published",
            "This replica's changes published to the mirror stream",
            m.mirror_published.clone(),
        );
        registry.register(
            "redis_mirror_publish_dropped",
            "Changes not published to the mirror stream, by reason",
            m.mirror_publish_dropped.clone(),
        );
        registry.register(
            "redis_mirror_reloads",
            "Times the mirror loaded the shared index from Redis, by reason (start, gap, reconnect, join)",
            m.mirror_reloads.clone(),
        );
        registry.register(
            "redis_mirror_reload_entries",
            "Entries loaded into the mirror by reloads",
            m.mirror_reload_entries.clone(),
        );
        registry.register(
            "redis_mirror_errors",
            "Failed reads of the mirror stream or snapshot (retried with backoff)",
            m.mirror_errors.clone(),
        );
        registry.register(
            "redis_mirror_bad_entries",
            "Stream entries the mirror could not read (skipped)",
            m.mirror_bad_entries.clone(),
        );
        registry.register(
            "redis_mirror_unknown_pod",
            "Records for pods outside this router's pod set, dropped: stream entries, and pods named in P:pods at a load",
            m.mirror_unknown_pods.clone(),
        );
        registry.register(
            "redis_mirror_behind",
            "1 while the mirror is more than mirror_max_lag_ms behind with changes waiting",
            m.mirror_behind.clone(),
        );
        registry.register(
            "redis_mirror_restarts",
            "Times the mirror task died and was restarted",
            m.mirror_restarts.clone(),
        );
        registry.register(
            "redis_load_lag_seconds",
            "Time from another replica's commit (its clock, in µs) to this replica reading its load",
            m.load_lag.clone(),
        );
        registry.register(
            "redis_load_charges",
            "Other replicas' loads charged from the load stream (ahead of their records)",
            m.load_charges.clone(),
        );
        registry.register(
            "redis_load_releases",
            "Other replicas' held loads released here (their response started, or their stream ended)",
            m.load_releases.clone(),
        );
        registry.register(
            "redis_load_published",
            "This replica's loads, and their releases, published to the load stream",
            m.load_published.clone(),
        );
        registry.register(
            "redis_load_dropped",
            "Loads not published to the load stream, by reason (their records still carry them)",
            m.load_drops.clone(),
        );
        registry.register(
            "redis_load_peers",
            "Other replicas this one sends load datagrams to (live entries of P:peers)",
            m.load_peers.clone(),
        );
        registry.register(
            "redis_load_peer_sent",
            "Load datagrams sent to other replicas",
            m.load_peer_sent.clone(),
        );
        registry.register(
            "redis_load_peer_lag_seconds",
            "Time from another replica's commit (its clock, in µs) to its signed load datagram here",
            m.load_peer_lag.clone(),
        );
        registry.register(
            "redis_load_peer_charges",
            "Other replicas' loads charged from their datagrams (the first copy to arrive)",
            m.load_peer_charges.clone(),
        );
        registry.register(
            "redis_load_peer_dropped",
            "Load datagrams not sent or not charged, by reason",
            m.load_peer_drops.clone(),
        );
        m
    }

    /// Counts a lookup answered by `source`.
    pub(crate) fn looked_up(&self, source: Source) {
        self.lookups.get_or_create(&SourceLabel { source }).inc();
    }

    /// Counts a fallback for `reason`.
    pub(crate) fn fell_back(&self, reason: Reason) {
        self.looked_up(Source::Fallback);
        self.fallbacks.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Counts `n` loads not published for `reason`.
    pub(crate) fn load_dropped(&self, reason: Dropped, n: u64) {
        if n > 0 {
            self.load_drops
                .get_or_create(&DroppedLabel { reason })
                .inc_by(n);
        }
    }

    /// Counts a load datagram dropped for `reason`.
    pub(crate) fn load_peer_dropped(&self, reason: PeerDrop) {
        self.load_peer_drops
            .get_or_create(&PeerDropLabel { reason })
            .inc();
    }

    /// Counts `n` writes dropped for `reason`.
    pub(crate) fn dropped(&self, reason: Dropped, n: u64) {
        self.writes_dropped
            .get_or_create(&DroppedLabel { reason })
            .inc_by(n);
    }

    /// Fallbacks so far for `reason` (tests, `/debug`).
    pub fn fallbacks(&self, reason: Reason) -> u64 {
        self.fallbacks.get_or_create(&ReasonLabel { reason }).get()
    }

    /// Writes dropped so far, whatever the reason (benchmarks: figures with drops mean little).
    pub fn writes_dropped_total(&self) -> u64 {
        [Dropped::QueueFull, Dropped::Timeout, Dropped::Error]
            .into_iter()
            .map(|reason| {
                self.writes_dropped
                    .get_or_create(&DroppedLabel { reason })
                    .get()
            })
            .sum()
    }

    /// Counts `n` changes not published for `reason`.
    pub(crate) fn publish_dropped(&self, reason: Dropped, n: u64) {
        if n > 0 {
            self.mirror_publish_dropped
                .get_or_create(&DroppedLabel { reason })
                .inc_by(n);
        }
    }

    /// Counts a reload for `reason` that loaded `entries`.
    pub(crate) fn reloaded(&self, reason: Reload, entries: u64) {
        self.mirror_reloads
            .get_or_create(&ReloadLabel { reason })
            .inc();
        self.mirror_reload_entries.inc_by(entries);
    }

    /// Counts `n` records for pods outside the pod set, met in `from`.
    pub(crate) fn unknown_pods(&self, from: Unknown, n: u64) {
        if n > 0 {
            self.mirror_unknown_pods
                .get_or_create(&UnknownLabel { from })
                .inc_by(n);
        }
    }

    /// Records for pods outside the pod set dropped so far, met in `from` (tests, benchmarks).
    pub fn unknown_pods_total(&self, from: Unknown) -> u64 {
        self.mirror_unknown_pods
            .get_or_create(&UnknownLabel { from })
            .get()
    }

    /// Mirror reloads so far for `reason` (tests, benchmarks).
    pub fn reloads(&self, reason: Reload) -> u64 {
        self.mirror_reloads
            .get_or_create(&ReloadLabel { reason })
            .get()
    }

    /// Other replicas' changes this mirror applied so far.
    pub fn mirror_applied(&self) -> u64 {
        self.mirror_applied.get()
    }

    /// Lookups answered by `source` so far.
    pub fn lookups(&self, source: Source) -> u64 {
        self.lookups.get_or_create(&SourceLabel { source }).get()
    }
}
