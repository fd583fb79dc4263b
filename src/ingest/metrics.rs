//! The ingest service's metric families. Each `type` label is a closed enum spelled once here;
//! a departed pod's series are removed by iterating those enums.

use std::fmt::Write as _;

use prometheus_client::encoding::{
    EncodeLabel, EncodeLabelSet, EncodeLabelValue, LabelSetEncoder, LabelValueEncoder,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::subscriber::PurgeReason;
use crate::events::{DecodeError, KvEvent};
use crate::index::ApplyStats;

/// A closed label enum: every value, its one spelling, and its encoding.
macro_rules! label_values {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $text:literal,)+ }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub(crate) enum $name {
            $($(#[$vdoc])* $variant,)+
        }

        impl $name {
            /// Every value.
            const ALL: &'static [Self] = &[$(Self::$variant,)+];

            /// The label value.
            fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text,)+
                }
            }
        }

        impl EncodeLabelValue for $name {
            fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
                encoder.write_str(self.as_str())
            }
        }
    };
}

label_values! {
    /// `type` of `kv_router_kv_events_applied_total`.
    EventType {
        /// `BlockStored`.
        Stored => "BlockStored",
        /// `BlockRemoved`.
        Removed => "BlockRemoved",
        /// `AllBlocksCleared`.
        Cleared => "AllBlocksCleared",
    }
}

label_values! {
    /// `type` of `kv_router_kv_event_purges_total`: why a pod's (rank's) state was dropped.
    PurgeType {
        /// Lost messages the replay could not return.
        Gap => "gap",
        /// The engine restarted.
        Restart => "restart",
        /// The engine cleared its cache (`AllBlocksCleared`).
        Cleared => "cleared",
        /// The pod announced more blocks than its budget.
        Overflow => "overflow",
    }
}

label_values! {
    /// `type` of `kv_router_kv_event_replays_total`.
    ReplayOutcome {
        /// Every missing message came back.
        Complete => "complete",
        /// The replay failed or fell short.
        Failed => "failed",
    }
}

label_values! {
    /// `type` of `kv_router_kv_event_decode_errors_total`.
    DecodeErrorType {
        /// Payload over the size limit.
        TooLarge => "too_large",
        /// Not msgpack.
        Msgpack => "msgpack",
        /// Not an event batch.
        Batch => "batch",
        /// A malformed event.
        Event => "event",
        /// A message without the 3-frame shape.
        Frames => "frames",
    }
}

label_values! {
    /// `type` of `kv_router_kv_event_blocks_total`: engine blocks by what the index did.
    BlockOutcome {
        /// Stored (or gained a tier).
        Stored => "stored",
        /// Removed.
        Removed => "removed",
        /// Named by hash but unknown to the index (removal or offload placeholder).
        Unknown => "unknown",
    }
}

label_values! {
    /// `type` of `kv_router_kv_events_skipped_total`: events the index could not use.
    SkipReason {
        /// `BlockStored` chained to a parent the index never saw.
        UnknownParent => "unknown_parent",
        /// Another KV-cache group, or fewer tokens than blocks.
        Ignored => "ignored",
    }
}

impl From<PurgeReason> for PurgeType {
    fn from(r: PurgeReason) -> Self {
        match r {
            PurgeReason::Gap => PurgeType::Gap,
            PurgeReason::Restart => PurgeType::Restart,
        }
    }
}

impl From<&DecodeError> for DecodeErrorType {
    fn from(e: &DecodeError) -> Self {
        match e {
            DecodeError::TooLarge(_) => DecodeErrorType::TooLarge,
            DecodeError::Msgpack(_) => DecodeErrorType::Msgpack,
            DecodeError::Batch(_) => DecodeErrorType::Batch,
            DecodeError::Event { .. } => DecodeErrorType::Event,
        }
    }
}

impl From<&KvEvent> for EventType {
    fn from(e: &KvEvent) -> Self {
        match e {
            KvEvent::BlockStored { .. } => EventType::Stored,
            KvEvent::BlockRemoved { .. } => EventType::Removed,
            KvEvent::AllBlocksCleared => EventType::Cleared,
        }
    }
}

/// `{pod}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq)]
struct PodLabel {
    pod: String,
}

/// `{pod, type}` with a closed `type`.
#[derive(Debug, Clone, Hash, PartialEq, Eq)]
struct PodType<T> {
    pod: String,
    r#type: T,
}

impl EncodeLabelSet for PodLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> std::fmt::Result {
        ("pod", self.pod.as_str()).encode(encoder.encode_label())
    }
}

impl<T: EncodeLabelValue + Copy> EncodeLabelSet for PodType<T> {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> std::fmt::Result {
        ("pod", self.pod.as_str()).encode(encoder.encode_label())?;
        ("type", self.r#type).encode(encoder.encode_label())
    }
}

fn typed<T>(pod: &str, r#type: T) -> PodType<T> {
    PodType {
        pod: pod.to_string(),
        r#type,
    }
}

/// Adds `n` (when positive) to `family{pod, type}`.
fn add<T: LabelType>(family: &Family<PodType<T>, Counter>, pod: &str, r#type: T, n: u64) {
    if n > 0 {
        family.get_or_create(&typed(pod, r#type)).inc_by(n);
    }
}

/// What a `type` label enum is.
trait LabelType: EncodeLabelValue + Copy + Eq + std::hash::Hash + std::fmt::Debug {}
impl<T: EncodeLabelValue + Copy + Eq + std::hash::Hash + std::fmt::Debug> LabelType for T {}

/// Every KV-event family (names and labels as documented in the README).
pub(crate) struct IngestMetrics {
    applied: Family<PodType<EventType>, Counter>,
    gaps: Family<PodLabel, Counter>,
    replays: Family<PodType<ReplayOutcome>, Counter>,
    purges: Family<PodType<PurgeType>, Counter>,
    decode_errors: Family<PodType<DecodeErrorType>, Counter>,
    lag: Histogram,
    blocks: Family<PodType<BlockOutcome>, Counter>,
    skipped: Family<PodType<SkipReason>, Counter>,
    apply_errors: Family<PodLabel, Counter>,
    restarts: Family<PodLabel, Counter>,
}

impl IngestMetrics {
    /// Creates the families and registers them under `kv_router_`.
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let m = Self {
            applied: Family::default(),
            gaps: Family::default(),
            replays: Family::default(),
            purges: Family::default(),
            decode_errors: Family::default(),
            lag: Histogram::new(exponential_buckets(1e-4, 2.0, 18)),
            blocks: Family::default(),
            skipped: Family::default(),
            apply_errors: Family::default(),
            restarts: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("kv_router");
        r.register(
            "kv_events_applied",
            "vLLM KV events applied, by pod and type",
            m.applied.clone(),
        );
        r.register(
            "kv_event_gaps",
            "Sequence gaps in a pod's KV-event stream",
            m.gaps.clone(),
        );
        r.register(
            "kv_event_replays",
            "Replay requests by outcome",
            m.replays.clone(),
        );
        r.register(
            "kv_event_purges",
            "Pod index purges by reason",
            m.purges.clone(),
        );
        r.register(
            "kv_event_decode_errors",
            "Undecodable KV-event messages by kind",
            m.decode_errors.clone(),
        );
        r.register(
            "kv_event_lag_seconds",
            "Time from publication to application of a KV-event batch",
            m.lag.clone(),
        );
        r.register(
            "kv_event_blocks",
            "Engine blocks named by applied KV events, by what the index did with them",
            m.blocks.clone(),
        );
        r.register(
            "kv_events_skipped",
            "KV events the index could not use, by reason",
            m.skipped.clone(),
        );
        r.register(
            "kv_event_apply_errors",
            "KV-event batches the index backend failed to apply",
            m.apply_errors.clone(),
        );
        r.register(
            "kv_event_subscription_restarts",
            "KV-event subscriptions that ended on their own and were started again",
            m.restarts.clone(),
        );
        m
    }

    /// Counts an applied batch: its events by type and every figure of its [`ApplyStats`].
    pub(crate) fn applied(&self, pod: &str, events: &[KvEvent], stats: &ApplyStats) {
        for e in events {
            self.applied
                .get_or_create(&typed(pod, EventType::from(e)))
                .inc();
        }
        // Destructured so a new ApplyStats field cannot be forgotten here.
        let ApplyStats {
            stored,
            removed,
            cleared,
            unknown_parent,
            unknown,
            ignored,
            overflow,
        } = *stats;
        add(&self.blocks, pod, BlockOutcome::Stored, stored);
        add(&self.blocks, pod, BlockOutcome::Removed, removed);
        add(&self.blocks, pod, BlockOutcome::Unknown, unknown);
        add(&self.purges, pod, PurgeType::Cleared, cleared);
        add(&self.purges, pod, PurgeType::Overflow, overflow);
        add(
            &self.skipped,
            pod,
            SkipReason::UnknownParent,
            unknown_parent,
        );
        add(&self.skipped, pod, SkipReason::Ignored, ignored);
    }

    /// Counts a purge ordered by the subscriber.
    pub(crate) fn purged(&self, pod: &str, reason: PurgeReason) {
        self.purges
            .get_or_create(&typed(pod, PurgeType::from(reason)))
            .inc();
    }

    /// Counts a sequence gap.
    pub(crate) fn gap(&self, pod: &str) {
        self.gaps
            .get_or_create(&PodLabel {
                pod: pod.to_string(),
            })
            .inc();
    }

    /// Counts a replay attempt.
    pub(crate) fn replay(&self, pod: &str, complete: bool) {
        let outcome = if complete {
            ReplayOutcome::Complete
        } else {
            ReplayOutcome::Failed
        };
        self.replays.get_or_create(&typed(pod, outcome)).inc();
    }

    /// Counts an undecodable message.
    pub(crate) fn decode_error(&self, pod: &str, kind: DecodeErrorType) {
        self.decode_errors.get_or_create(&typed(pod, kind)).inc();
    }

    /// Counts a batch the index backend failed to apply.
    pub(crate) fn apply_error(&self, pod: &str) {
        self.apply_errors
            .get_or_create(&PodLabel {
                pod: pod.to_string(),
            })
            .inc();
    }

    /// Counts a subscription restarted after it ended on its own.
    pub(crate) fn restarted(&self, pod: &str) {
        self.restarts
            .get_or_create(&PodLabel {
                pod: pod.to_string(),
            })
            .inc();
    }

    /// Observes the publish-to-apply lag of a batch.
    pub(crate) fn lag(&self, seconds: f64) {
        self.lag.observe(seconds);
    }

    /// Creates a pod's series at zero when its subscription starts, so a dashboard reads 0
    /// (not "no data") for faults that have not happened and `rate()` sees the first one.
    pub(crate) fn init_pod(&self, pod: &str) {
        let l = PodLabel {
            pod: pod.to_string(),
        };
        // The returned guards are dropped at once: only the series' creation matters here.
        drop(self.gaps.get_or_create(&l));
        drop(self.apply_errors.get_or_create(&l));
        drop(self.restarts.get_or_create(&l));
        fn zero_all<T: LabelType>(family: &Family<PodType<T>, Counter>, pod: &str, all: &[T]) {
            for &t in all {
                drop(family.get_or_create(&typed(pod, t)));
            }
        }
        zero_all(&self.applied, pod, EventType::ALL);
        zero_all(&self.replays, pod, ReplayOutcome::ALL);
        zero_all(&self.purges, pod, PurgeType::ALL);
        zero_all(&self.decode_errors, pod, DecodeErrorType::ALL);
        zero_all(&self.blocks, pod, BlockOutcome::ALL);
        zero_all(&self.skipped, pod, SkipReason::ALL);
    }

    /// Drops every series of a pod that left.
    pub(crate) fn forget_pod(&self, pod: &str) {
        let l = PodLabel {
            pod: pod.to_string(),
        };
        self.gaps.remove(&l);
        self.apply_errors.remove(&l);
        self.restarts.remove(&l);
        fn drop_all<T: LabelType>(family: &Family<PodType<T>, Counter>, pod: &str, all: &[T]) {
            for &t in all {
                family.remove(&typed(pod, t));
            }
        }
        drop_all(&self.applied, pod, EventType::ALL);
        drop_all(&self.replays, pod, ReplayOutcome::ALL);
        drop_all(&self.purges, pod, PurgeType::ALL);
        drop_all(&self.decode_errors, pod, DecodeErrorType::ALL);
        drop_all(&self.blocks, pod, BlockOutcome::ALL);
        drop_all(&self.skipped, pod, SkipReason::ALL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(reg: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, reg).unwrap();
        out
    }

    #[test]
    fn a_started_pod_exports_every_fault_series_at_zero_and_forgetting_drops_them() {
        let mut reg = Registry::default();
        let m = IngestMetrics::register(&mut reg);
        m.init_pod("p:1");
        let out = text(&reg);
        for line in [
            r#"kv_router_kv_event_gaps_total{pod="p:1"} 0"#,
            r#"kv_router_kv_event_replays_total{pod="p:1",type="failed"} 0"#,
            r#"kv_router_kv_event_purges_total{pod="p:1",type="restart"} 0"#,
            r#"kv_router_kv_event_decode_errors_total{pod="p:1",type="msgpack"} 0"#,
            r#"kv_router_kv_event_apply_errors_total{pod="p:1"} 0"#,
        ] {
            assert!(out.contains(line), "missing {line} in\n{out}");
        }
        m.forget_pod("p:1");
        assert!(!text(&reg).contains("p:1"));
    }

    #[test]
    fn every_apply_figure_reaches_its_series() {
        let mut reg = Registry::default();
        let m = IngestMetrics::register(&mut reg);
        let stats = ApplyStats {
            stored: 5,
            removed: 4,
            cleared: 1,
            unknown_parent: 2,
            unknown: 3,
            ignored: 6,
            overflow: 7,
        };
        m.applied("p:1", &[KvEvent::AllBlocksCleared], &stats);
        let out = text(&reg);
        for line in [
            r#"kv_router_kv_events_applied_total{pod="p:1",type="AllBlocksCleared"} 1"#,
            r#"kv_router_kv_event_blocks_total{pod="p:1",type="stored"} 5"#,
            r#"kv_router_kv_event_blocks_total{pod="p:1",type="removed"} 4"#,
            r#"kv_router_kv_event_blocks_total{pod="p:1",type="unknown"} 3"#,
            r#"kv_router_kv_event_purges_total{pod="p:1",type="cleared"} 1"#,
            r#"kv_router_kv_event_purges_total{pod="p:1",type="overflow"} 7"#,
            r#"kv_router_kv_events_skipped_total{pod="p:1",type="unknown_parent"} 2"#,
            r#"kv_router_kv_events_skipped_total{pod="p:1",type="ignored"} 6"#,
        ] {
            assert!(out.contains(line), "missing {line} in\n{out}");
        }
    }

    #[test]
    fn forgetting_a_pod_drops_every_series_of_it() {
        let mut reg = Registry::default();
        let m = IngestMetrics::register(&mut reg);
        let stats = ApplyStats {
            stored: 1,
            removed: 1,
            cleared: 1,
            unknown_parent: 1,
            unknown: 1,
            ignored: 1,
            overflow: 1,
        };
        let events = [
            KvEvent::AllBlocksCleared,
            KvEvent::BlockRemoved {
                block_hashes: vec![],
                medium: None,
                group_idx: None,
            },
        ];
        for pod in ["p:1", "p:2"] {
            m.applied(pod, &events, &stats);
            m.purged(pod, PurgeReason::Restart);
            m.purged(pod, PurgeReason::Gap);
            m.gap(pod);
            m.replay(pod, true);
            m.replay(pod, false);
            m.apply_error(pod);
            m.restarted(pod);
            for &kind in DecodeErrorType::ALL {
                m.decode_error(pod, kind);
            }
        }
        m.forget_pod("p:1");
        let out = text(&reg);
        assert!(!out.contains("p:1"), "{out}");
        assert!(
            out.contains(r#"type="restart""#),
            "the other pod stays: {out}"
        );
    }
}
