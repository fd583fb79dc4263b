//! Replica load sharing: every router replica counts the requests the others routed as in-flight
//! load on their pods, between scrapes. A trait at the seam, beside the index's own
//! (`index::KvIndex`): the Redis backend shares load through its streams and peers, the
//! in-process indexes share nothing ([`NoShare`]).
//!
//! The vocabulary (a decision's [`Charge`], a [`Hold`] and how it ends, the [`RemoteLoad`] sink)
//! depends only on block keys and pod ids, so the pods' in-flight accounting, the index and the
//! decision path can all name it without depending on one another.

use std::sync::Arc;
use std::time::Duration;

use crate::blocks::BlockKey;
use crate::pod_id::PodId;

/// A decision's load on its pod: the tokens it has to prefill and for how long they count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charge {
    /// Prompt tokens the pod was predicted not to hold.
    pub uncached_tokens: u64,
    /// The deciding replica's estimate of their prefill time, in milliseconds.
    pub prefill_ms: u64,
    /// What the deciding replica's conversation memory recorded of it.
    pub mark: Option<ConversationMark>,
    /// Its number on the deciding replica's load stream, when it was sent ahead of the record
    /// ([`LoadShare::announce`]): a replica charges whichever copy reaches it first.
    pub announced: Option<u64>,
}

/// Another replica's announced load that it will release itself: its tokens count until the
/// deciding replica says the pod's response started, not only for their predicted prefill (which
/// leaves out the wait in the pod's queue).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Hold {
    /// The deciding replica.
    pub origin: u64,
    /// The load's number on its load stream.
    pub seq: u64,
}

/// How a held load ends ([`LoadShare::release`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The pod's response started: its prefill is over, the tokens no longer count.
    Started,
    /// The request ended unobserved: the tokens count until their predicted prefill ends.
    Settled,
}

/// A decision as conversation memory records it, besides its keys and pod.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConversationMark {
    /// The longest match over the candidates, in blocks.
    pub best_match: u32,
    /// The request started a new conversation.
    pub new_conversation: bool,
}

/// Where a [`LoadShare`] hands the decisions other replicas made, so that every replica counts
/// them as in-flight load between scrapes (the pods' in-flight accounting implements it), and
/// records them in its conversation memory.
pub trait RemoteLoad: Send + Sync {
    /// Another replica sent a request to `pod` `age` ago; with `hold`, its tokens count until
    /// that replica releases them ([`Self::release`]), within a bound.
    fn charge(&self, pod: &PodId, charge: Charge, age: Duration, hold: Option<Hold>);
    /// The replica that sent a held load on `pod` released it.
    fn release(&self, _pod: &PodId, _hold: Hold, _how: Release) {}
    /// Another replica sent `keys` to `pod` at `now_ms` (this router's clock), marked `mark`.
    fn mark(&self, _pod: &PodId, _keys: &[BlockKey], _mark: ConversationMark, _now_ms: u64) {}
}

/// Sends this replica's routed requests' load to the other replicas and delivers theirs to a
/// [`RemoteLoad`] sink. No method waits: the request path calls them.
pub trait LoadShare: Send + Sync + 'static {
    /// Where the other replicas' charges go from now on (set once).
    fn attach(&self, sink: Arc<dyn RemoteLoad>);
    /// Sends a routed request's load to the other replicas now, at commit and ahead of its
    /// record, and answers its number there; `None` when this share does not announce.
    fn announce(&self, pod: &PodId, charge: &Charge) -> Option<u64>;
    /// Tells the other replicas how the load announced as `seq` on `pod` ended: they count its
    /// tokens until then.
    fn release(&self, pod: &PodId, seq: u64, how: Release);
    /// Charges the other replicas' loads that reached this process but were not applied yet,
    /// before a decision reads the pods' load.
    fn catch_up(&self);
    /// Records a routed request's `keys` on `pod` at `now_ms` with its `charge`, when this share's
    /// records carry the load to the other replicas (the Redis backend publishes the record and
    /// its charge as one message, so it writes the record into its own index): answers `true`.
    /// `false`: nothing was recorded, and the record is the caller's to make in its index.
    fn record_decision(&self, pod: &PodId, keys: &[BlockKey], now_ms: u64, charge: Charge) -> bool;
}

/// The share of a backend that shares nothing between replicas (the in-process indexes): no
/// other replica's load arrives, none is sent, and records are the index's alone.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoShare;

impl LoadShare for NoShare {
    fn attach(&self, _sink: Arc<dyn RemoteLoad>) {}

    fn announce(&self, _pod: &PodId, _charge: &Charge) -> Option<u64> {
        None
    }

    fn release(&self, _pod: &PodId, _seq: u64, _how: Release) {}

    fn catch_up(&self) {}

    fn record_decision(&self, _: &PodId, _: &[BlockKey], _: u64, _: Charge) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_of_nothing_announces_nothing_and_leaves_the_record_to_the_index() {
        let (share, pod) = (NoShare, PodId::new("10.0.0.1:8000"));
        let charge = Charge {
            uncached_tokens: 4_000,
            prefill_ms: 20,
            ..Charge::default()
        };
        assert_eq!(share.announce(&pod, &charge), None);
        assert!(!share.record_decision(&pod, &[BlockKey(1)], 0, charge));
    }
}
