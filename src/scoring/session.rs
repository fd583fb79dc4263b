//! Session stickiness: the pod that served a session last scores 1. Session ids come from
//! configured headers or the body's `user`; only their hash is stored, bounded by LRU and TTL.
//! With a shared index (Redis) the session → pod map is shared too, so a conversation sticks to
//! its pod whichever replica decides; this replica's own map answers when the shared one cannot.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lru::LruCache;
use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64;

use super::{ScoreInput, Scorer};
use crate::pods::PodId;

/// Hash of a session id (the id itself is never stored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionKey(u64);

impl SessionKey {
    /// The first configured header present (non-empty), else `user` when allowed.
    pub fn find<'a>(
        header: impl Fn(&str) -> Option<&'a str>,
        names: &[String],
        user: Option<&str>,
        use_user_field: bool,
    ) -> Option<Self> {
        for name in names {
            if let Some(v) = header(name).filter(|v| !v.is_empty()) {
                return Some(Self::of(v));
            }
        }
        user.filter(|u| use_user_field && !u.is_empty())
            .map(|u| Self::of(&format!("user\0{u}")))
    }

    /// Key of a raw id.
    pub fn of(id: &str) -> Self {
        Self(xxh3_64(id.as_bytes()))
    }

    /// The hash (what a shared store keys on; the id itself is never stored).
    pub fn hash(self) -> u64 {
        self.0
    }
}

/// Sessions shared by router replicas (a seam: the Redis index implements it).
#[async_trait]
pub trait SharedSessions: Send + Sync + 'static {
    /// The session's pod, if the shared store knows it (errors and timeouts answer `None`).
    async fn get(&self, key: SessionKey) -> Option<PodId>;
    /// Pins the session to `pod` for `ttl_ms` of idleness (queued, never waits).
    fn set(&self, key: SessionKey, pod: &PodId, ttl_ms: u64);
}

/// Session → last pod, bounded by capacity (LRU) and idle TTL; optionally shared.
pub struct SessionStore {
    map: Mutex<LruCache<SessionKey, (PodId, u64)>>,
    ttl_ms: u64,
    shared: Option<(Arc<dyn SharedSessions>, Duration)>,
}

impl SessionStore {
    /// An empty store.
    pub fn new(capacity: usize, ttl_ms: u64) -> Self {
        Self {
            map: Mutex::new(LruCache::new(
                std::num::NonZeroUsize::new(capacity.max(1)).expect("max(1)"),
            )),
            ttl_ms,
            shared: None,
        }
    }

    /// Shares sessions through `shared`, asked for at most `budget` per lookup.
    pub fn with_shared(mut self, shared: Arc<dyn SharedSessions>, budget: Duration) -> Self {
        self.shared = Some((shared, budget));
        self
    }

    /// The session's pod: the shared store's answer when it has one, else this replica's own
    /// (unless idle for longer than the TTL).
    pub async fn find(&self, key: SessionKey, now_ms: u64) -> Option<PodId> {
        if let Some((shared, budget)) = &self.shared {
            if let Ok(Some(pod)) = tokio::time::timeout(*budget, shared.get(key)).await {
                return Some(pod);
            }
        }
        self.get(key, now_ms)
    }

    /// The session's pod in this replica's own map, unless idle for longer than the TTL.
    pub fn get(&self, key: SessionKey, now_ms: u64) -> Option<PodId> {
        let mut map = self.map.lock();
        match map.peek(&key) {
            Some((pod, seen)) if now_ms.saturating_sub(*seen) < self.ttl_ms => Some(pod.clone()),
            Some(_) => {
                map.pop(&key);
                None
            }
            None => None,
        }
    }

    /// Records the pod that serves the session now (here, and in the shared store).
    pub fn set(&self, key: SessionKey, pod: PodId, now_ms: u64) {
        if let Some((shared, _)) = &self.shared {
            shared.set(key, &pod, self.ttl_ms);
        }
        self.map.lock().put(key, (pod, now_ms));
    }

    /// Forgets sessions pinned to a pod that left.
    pub fn forget_pod(&self, pod: &PodId) {
        let mut map = self.map.lock();
        let stale: Vec<SessionKey> = map
            .iter()
            .filter(|(_, (p, _))| p == pod)
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            map.pop(&k);
        }
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    /// No sessions remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// 1 for the session's pod, 0 for the others.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SessionScorer;

impl Scorer for SessionScorer {
    fn name(&self) -> &'static str {
        "session"
    }

    fn score(&self, input: &ScoreInput, out: &mut [f64]) {
        for (o, c) in out.iter_mut().zip(&input.candidates) {
            *o = if c.session_pod { 1.0 } else { 0.0 };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_order_then_user() {
        let names = vec!["x-session-id".to_string(), "session-id".to_string()];
        let h = |n: &str| (n == "session-id").then_some("abc");
        assert_eq!(
            SessionKey::find(h, &names, Some("u"), true),
            Some(SessionKey::of("abc"))
        );
        let none = |_: &str| None;
        assert!(SessionKey::find(none, &names, Some("u"), true).is_some());
        assert!(SessionKey::find(none, &names, Some("u"), false).is_none());
        assert!(SessionKey::find(none, &names, None, true).is_none());
    }

    #[test]
    fn sessions_expire_stay_bounded_and_forget_departed_pods() {
        let store = SessionStore::new(2, 100);
        let (a, b, c) = (
            SessionKey::of("a"),
            SessionKey::of("b"),
            SessionKey::of("c"),
        );
        store.set(a, PodId::new("p:1"), 0);
        assert_eq!(store.get(a, 99), Some(PodId::new("p:1")));
        assert_eq!(store.get(a, 100), None);
        store.set(a, PodId::new("p:1"), 0);
        store.set(b, PodId::new("p:2"), 0);
        store.set(c, PodId::new("p:2"), 0);
        assert_eq!(store.len(), 2);
        store.forget_pod(&PodId::new("p:2"));
        assert!(store.is_empty());
    }
}
