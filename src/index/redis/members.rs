//! The pods the router's pod sources list, as the mirror follows them: it keeps records for these
//! pods only. Anyone who can write under the key prefix can name any pod on the stream or in
//! `P:pods`; a mirror that applied them all grew by a pod's whole capacity per made-up name.
//! Records for other pods are counted (`kv_router_redis_mirror_unknown_pod_total{from}`) and
//! dropped; a pod that joins later has its snapshot loaded then, and one that leaves has its
//! entries dropped from the mirror.

use std::sync::Arc;
use std::time::Duration;

use ahash::AHashSet;
use tokio::sync::watch;

use crate::pods::PodId;

/// What the router's pod sources listed so far.
#[derive(Debug, Clone, Default)]
enum Listing {
    /// Nothing yet: the sources' first listing is still to come.
    #[default]
    Pending,
    /// The current pod set.
    Listed(Arc<AHashSet<PodId>>),
    /// No pod set to follow: every pod is admitted (`kv-bench simulate`, tests).
    Everyone,
}

/// The pod set the shared index's mirror keeps records for, handed to the Redis index when it
/// is built ([`crate::index::build_index_among`]); the router feeds it through [`MembersFeed`].
#[derive(Debug, Clone)]
pub struct PodMembers {
    rx: watch::Receiver<Listing>,
}

/// Where the router publishes its pod set to [`PodMembers`].
#[derive(Debug, Clone)]
pub struct MembersFeed {
    tx: Arc<watch::Sender<Listing>>,
}

impl PodMembers {
    /// A pod set to follow, empty until the feed's first [`MembersFeed::list`].
    pub fn channel() -> (MembersFeed, PodMembers) {
        let (tx, rx) = watch::channel(Listing::Pending);
        (MembersFeed { tx: Arc::new(tx) }, PodMembers { rx })
    }

    /// No pod set: the mirror keeps records for every pod named to it.
    pub fn everyone() -> Self {
        Self {
            rx: watch::channel(Listing::Everyone).1,
        }
    }
}

impl MembersFeed {
    /// The pod sources now list `pods` (every call after the first that changes nothing wakes
    /// nobody).
    pub fn list(&self, pods: impl IntoIterator<Item = PodId>) {
        let set: AHashSet<PodId> = pods.into_iter().collect();
        self.tx.send_if_modified(|l| match l {
            Listing::Listed(old) if **old == set => false,
            _ => {
                *l = Listing::Listed(Arc::new(set));
                true
            }
        });
    }
}

/// The mirror reader's side: the pod set its index was last brought in line with.
pub(super) struct Following {
    rx: watch::Receiver<Listing>,
    /// `None`: every pod is admitted.
    known: Option<Arc<AHashSet<PodId>>>,
}

/// Pods that joined and left since the mirror last caught up with the pod set.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Changes {
    pub(super) joined: Vec<PodId>,
    pub(super) left: Vec<PodId>,
}

impl Following {
    pub(super) fn new(members: PodMembers) -> Self {
        let known = match &*members.rx.borrow() {
            Listing::Everyone => None,
            _ => Some(Arc::default()),
        };
        Self {
            rx: members.rx,
            known,
        }
    }

    /// Waits (at most `grace`) for the pod sources' first listing, so a restart does not drop
    /// the records of pods its sources have not listed yet; without one, no pod is known.
    pub(super) async fn first_listing(&mut self, grace: Duration) {
        let listed = |l: &Listing| !matches!(l, Listing::Pending);
        let _ = tokio::time::timeout(grace, self.rx.wait_for(listed)).await;
    }

    /// Whether the mirror keeps records for `pod`.
    pub(super) fn admits(&self, pod: &PodId) -> bool {
        self.known.as_ref().is_none_or(|k| k.contains(pod))
    }

    /// Catches up with the pod set: what joined and left since the last call.
    pub(super) fn catch_up(&mut self) -> Changes {
        let Some(known) = &self.known else {
            return Changes::default();
        };
        let now = match &*self.rx.borrow_and_update() {
            Listing::Listed(set) => set.clone(),
            Listing::Pending | Listing::Everyone => return Changes::default(),
        };
        if Arc::ptr_eq(known, &now) {
            return Changes::default();
        }
        let mut changes = Changes {
            joined: now.difference(known).cloned().collect(),
            left: known.difference(&now).cloned().collect(),
        };
        changes.joined.sort_unstable();
        changes.left.sort_unstable();
        self.known = Some(now);
        changes
    }
}

#[cfg(test)]
#[path = "members_tests.rs"]
mod tests;
