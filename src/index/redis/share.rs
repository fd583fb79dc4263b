//! The shared index's replica load sharing: with `lookups: mirror` and `mirror_load`, a routed
//! request's load goes to the other replicas ahead of its record (the load stream and peers) and
//! with it (the record's change on the mirror stream); theirs comes back to the attached sink.

use std::sync::Arc;

use super::{RedisIndex, Shared};
use crate::blocks::BlockKey;
use crate::pods::PodId;
use crate::share::{Charge, LoadShare, Release, RemoteLoad};

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
