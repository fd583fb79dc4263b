//! Session stickiness: the pod that served a session last scores 1. Session ids come from
//! configured headers (coding agents' own among the defaults), the body's `prompt_cache_key` or
//! `user`, and a Responses request's `previous_response_id`; only their hash is stored, bounded
//! by LRU and TTL. With a shared index (Redis) the session → pod map is shared too, so a
//! conversation sticks to its pod whichever replica decides; this replica's own map answers when
//! the shared one cannot.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lru::LruCache;
use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64;

use super::{ScoreInput, Scorer};
use crate::config::SessionScorerConfig;
use crate::pods::PodId;

/// Hash of a session id (the id itself is never stored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionKey(u64);

/// The session ids a request body carries.
#[derive(Debug, Clone, Copy, Default)]
pub struct BodyIds<'a> {
    /// `prompt_cache_key`.
    pub prompt_cache_key: Option<&'a str>,
    /// `user`.
    pub user: Option<&'a str>,
}

impl SessionKey {
    /// The request's session: the first configured header present (non-empty), else the body's
    /// `prompt_cache_key`, else its `user`, each when `cfg` allows it. Ids of different sources
    /// are kept apart (a `user` never shares a key with an equal header value); the headers
    /// share one space, as agents send one id under several of them.
    pub fn find<'a>(
        header: impl Fn(&str) -> Option<&'a str>,
        cfg: &SessionScorerConfig,
        body: BodyIds<'_>,
    ) -> Option<Self> {
        for name in &cfg.headers {
            if let Some(v) = header(name).filter(|v| !v.is_empty()) {
                return Some(Self::of(v));
            }
        }
        if let Some(k) = body
            .prompt_cache_key
            .filter(|k| cfg.use_prompt_cache_key && !k.is_empty())
        {
            return Some(Self::of(&format!("prompt_cache_key\0{k}")));
        }
        body.user
            .filter(|u| cfg.use_user_field && !u.is_empty())
            .map(|u| Self::of(&format!("user\0{u}")))
    }

    /// Key of a raw id.
    pub fn of(id: &str) -> Self {
        Self(xxh3_64(id.as_bytes()))
    }

    /// Key of a served response's id: a request chaining `previous_response_id` finds the pod
    /// that produced that response under it (the response side sets it, the request side reads).
    pub fn response(id: &str) -> Self {
        Self::of(&format!("response\0{id}"))
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
    inner: Mutex<Inner>,
    ttl_ms: u64,
    shared: Option<(Arc<dyn SharedSessions>, Duration)>,
}

/// A session's pin: its pod, when the session was last seen, and until when (by the router's
/// estimate) its latest request there or elsewhere is still prefilling.
#[derive(Debug, Clone)]
struct Pin {
    pod: PodId,
    seen: u64,
    prefilling_until: u64,
}

/// The map and, per pod, how many of its sessions are pinned there (kept in step with it).
struct Inner {
    map: LruCache<SessionKey, Pin>,
    per_pod: ahash::AHashMap<PodId, usize>,
}

impl Inner {
    fn unpin(&mut self, pod: &PodId) {
        if let Some(n) = self.per_pod.get_mut(pod) {
            *n -= 1;
            if *n == 0 {
                self.per_pod.remove(pod);
            }
        }
    }

    /// Drops sessions idle for `ttl_ms` (the map's least recent entries are the oldest set).
    fn expire(&mut self, now_ms: u64, ttl_ms: u64) {
        while let Some((_, pin)) = self.map.peek_lru() {
            if now_ms.saturating_sub(pin.seen) < ttl_ms {
                break;
            }
            if let Some((_, pin)) = self.map.pop_lru() {
                self.unpin(&pin.pod);
            }
        }
    }
}

impl SessionStore {
    /// An empty store.
    pub fn new(capacity: usize, ttl_ms: u64) -> Self {
        Self {
            inner: Mutex::new(Inner {
                map: LruCache::new(std::num::NonZeroUsize::new(capacity.max(1)).expect("max(1)")),
                per_pod: ahash::AHashMap::new(),
            }),
            ttl_ms,
            shared: None,
        }
    }

    /// How many live sessions this replica pinned to each of `pods` (idle ones expire first):
    /// the conversations whose later turns each pod is committed to.
    pub fn conversations(&self, pods: &[PodId], now_ms: u64) -> Vec<f64> {
        let mut inner = self.inner.lock();
        inner.expire(now_ms, self.ttl_ms);
        pods.iter()
            .map(|p| inner.per_pod.get(p).copied().unwrap_or(0) as f64)
            .collect()
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

    /// Where a Responses request chaining `previous_response_id` must go: the pod the response
    /// was pinned to as it passed (see [`SessionKey::response`]), with that key.
    pub async fn chained(
        &self,
        previous_response_id: &str,
        now_ms: u64,
    ) -> Option<(SessionKey, PodId)> {
        let key = SessionKey::response(previous_response_id);
        self.find(key, now_ms).await.map(|pod| (key, pod))
    }

    /// The session's pod in this replica's own map, unless idle for longer than the TTL.
    pub fn get(&self, key: SessionKey, now_ms: u64) -> Option<PodId> {
        let mut inner = self.inner.lock();
        match inner.map.peek(&key) {
            Some(pin) if now_ms.saturating_sub(pin.seen) < self.ttl_ms => Some(pin.pod.clone()),
            Some(_) => {
                if let Some(pin) = inner.map.pop(&key) {
                    inner.unpin(&pin.pod);
                }
                None
            }
            None => None,
        }
    }

    /// Records the pod that serves the session now (here, and in the shared store).
    pub fn set(&self, key: SessionKey, pod: PodId, now_ms: u64) {
        self.pin(key, pod, now_ms, now_ms);
    }

    /// Records a decision of the session: its request goes to `pod` and prefills until
    /// `prefill_end_ms` (the router's estimate). A request placed on another pod while an earlier
    /// one of the session is still prefilling is a fork (parallel branches of one context): the
    /// pin stays, or later branches would follow each spilled one onto a pod still computing
    /// the context. Turns sent one after another move it.
    pub fn follow(&self, key: SessionKey, pod: PodId, now_ms: u64, prefill_end_ms: u64) {
        {
            let mut inner = self.inner.lock();
            let ttl_ms = self.ttl_ms;
            if let Some(pin) = inner.map.get_mut(&key).filter(|pin| {
                pin.pod != pod
                    && pin.prefilling_until > now_ms
                    && now_ms.saturating_sub(pin.seen) < ttl_ms
            }) {
                pin.seen = now_ms;
                pin.prefilling_until = pin.prefilling_until.max(prefill_end_ms);
                return;
            }
        }
        self.pin(key, pod, now_ms, prefill_end_ms);
    }

    fn pin(&self, key: SessionKey, pod: PodId, now_ms: u64, prefill_end_ms: u64) {
        if let Some((shared, _)) = &self.shared {
            shared.set(key, &pod, self.ttl_ms);
        }
        let mut inner = self.inner.lock();
        if let Some(pin) = inner.map.get_mut(&key).filter(|pin| pin.pod == pod) {
            pin.seen = now_ms;
            pin.prefilling_until = pin.prefilling_until.max(prefill_end_ms);
            return;
        }
        *inner.per_pod.entry(pod.clone()).or_default() += 1;
        let pin = Pin {
            pod,
            seen: now_ms,
            prefilling_until: prefill_end_ms,
        };
        // The key's previous pin, or the least recent session evicted to make room.
        if let Some((_, old)) = inner.map.push(key, pin) {
            inner.unpin(&old.pod);
        }
    }

    /// Forgets sessions pinned to a pod that left.
    pub fn forget_pod(&self, pod: &PodId) {
        let mut inner = self.inner.lock();
        let stale: Vec<SessionKey> = inner
            .map
            .iter()
            .filter(|(_, pin)| &pin.pod == pod)
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            inner.map.pop(&k);
        }
        inner.per_pod.remove(pod);
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
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

    fn cfg(headers: &[&str]) -> SessionScorerConfig {
        SessionScorerConfig {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            ..SessionScorerConfig::default()
        }
    }

    fn ids<'a>(prompt_cache_key: Option<&'a str>, user: Option<&'a str>) -> BodyIds<'a> {
        BodyIds {
            prompt_cache_key,
            user,
        }
    }

    #[test]
    fn headers_in_order_then_prompt_cache_key_then_user() {
        let c = cfg(&["x-session-id", "session-id"]);
        let h = |n: &str| (n == "session-id").then_some("abc");
        let none = |_: &str| None;
        let body = ids(Some("k"), Some("u"));
        assert_eq!(SessionKey::find(h, &c, body), Some(SessionKey::of("abc")));
        let both = |n: &str| {
            Some(if n == "x-session-id" {
                "first"
            } else {
                "second"
            })
        };
        assert_eq!(
            SessionKey::find(both, &c, body),
            Some(SessionKey::of("first"))
        );
        let empty = |_: &str| Some("");
        let by_key = SessionKey::find(empty, &c, body);
        assert_eq!(by_key, SessionKey::find(none, &c, ids(Some("k"), None)));
        assert!(by_key.is_some());
        let by_user = SessionKey::find(none, &c, ids(None, Some("u")));
        assert!(by_user.is_some() && by_user != by_key);
        assert_eq!(
            SessionKey::find(none, &c, ids(Some(""), Some("u"))),
            by_user
        );
        assert!(SessionKey::find(none, &c, ids(None, None)).is_none());
    }

    #[test]
    fn each_body_source_can_be_switched_off() {
        let none = |_: &str| None;
        let body = ids(Some("k"), Some("u"));
        let no_key = SessionScorerConfig {
            use_prompt_cache_key: false,
            ..cfg(&[])
        };
        assert_eq!(
            SessionKey::find(none, &no_key, body),
            SessionKey::find(none, &cfg(&[]), ids(None, Some("u")))
        );
        let neither = SessionScorerConfig {
            use_user_field: false,
            ..no_key
        };
        assert!(SessionKey::find(none, &neither, body).is_none());
    }

    #[test]
    fn equal_ids_from_different_sources_are_different_sessions() {
        let c = cfg(&["x-session-id", "session_id"]);
        let none = |_: &str| None;
        let header = SessionKey::find(|_| Some("same"), &c, BodyIds::default());
        let underscored = SessionKey::find(
            |n| (n == "session_id").then_some("same"),
            &c,
            BodyIds::default(),
        );
        let key = SessionKey::find(none, &c, ids(Some("same"), None));
        let user = SessionKey::find(none, &c, ids(None, Some("same")));
        let response = Some(SessionKey::response("same"));
        // Agents send one id under several headers: those share a key.
        assert_eq!(header, underscored);
        let all = [header, key, user, response];
        for (i, a) in all.iter().enumerate() {
            assert!(a.is_some());
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn the_default_headers_include_the_coding_agents() {
        let c = SessionScorerConfig::default();
        for agent_header in [
            "x-claude-code-session-id",
            "x-session-affinity",
            "session_id",
        ] {
            let h = |n: &str| (n == agent_header).then_some("agent-session");
            assert_eq!(
                SessionKey::find(h, &c, ids(Some("k"), Some("u"))),
                Some(SessionKey::of("agent-session")),
                "{agent_header}"
            );
        }
        assert!(c.use_prompt_cache_key && c.use_user_field);
    }

    #[tokio::test]
    async fn a_chained_response_finds_the_pod_its_response_was_pinned_to() {
        let store = SessionStore::new(10, 1000);
        assert_eq!(store.chained("resp_1", 0).await, None);
        store.set(SessionKey::response("resp_1"), PodId::new("p:2"), 0);
        assert_eq!(
            store.chained("resp_1", 10).await,
            Some((SessionKey::response("resp_1"), PodId::new("p:2")))
        );
        assert_eq!(store.chained("resp_2", 10).await, None);
        assert_eq!(store.chained("resp_1", 1000).await, None, "expired");
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

    #[test]
    fn conversations_per_pod_follow_pins_moves_evictions_and_expiry() {
        let store = SessionStore::new(3, 100);
        let (p1, p2) = (PodId::new("p:1"), PodId::new("p:2"));
        let count = |now| store.conversations(&[p1.clone(), p2.clone()], now);
        let k = |s: &str| SessionKey::of(s);
        store.set(k("a"), p1.clone(), 0);
        store.set(k("b"), p1.clone(), 10);
        store.set(k("a"), p1.clone(), 20);
        assert_eq!(
            count(20),
            vec![2.0, 0.0],
            "a re-pin is not a new conversation"
        );
        store.set(k("b"), p2.clone(), 30);
        assert_eq!(count(30), vec![1.0, 1.0], "a move");
        store.set(k("c"), p2.clone(), 40);
        store.set(k("d"), p2.clone(), 50);
        assert_eq!(
            count(50),
            vec![0.0, 3.0],
            "capacity 3: a (least recent) evicted"
        );
        assert_eq!(count(135), vec![0.0, 2.0], "b idle 105 ms: expired");
        assert_eq!(store.get(k("c"), 140), None);
        assert_eq!(count(140), vec![0.0, 1.0]);
        store.forget_pod(&p2);
        assert_eq!(count(140), vec![0.0, 0.0]);
    }

    #[test]
    fn a_fork_leaves_the_pin_while_turns_one_after_another_move_it() {
        let store = SessionStore::new(8, 10_000);
        let (home, spill, later) = (PodId::new("p:1"), PodId::new("p:2"), PodId::new("p:3"));
        let k = SessionKey::of("agent");
        // The context's first branch prefills on `home` until 800 ms.
        store.follow(k, home.clone(), 0, 800);
        // Branches spilled elsewhere meanwhile leave the session at home, and extend its prefill.
        store.follow(k, spill.clone(), 100, 900);
        assert_eq!(store.get(k, 100), Some(home.clone()));
        store.follow(k, later.clone(), 850, 1_700);
        assert_eq!(
            store.get(k, 850),
            Some(home.clone()),
            "the spill's prefill counts"
        );
        assert_eq!(
            store.conversations(&[home.clone(), spill.clone()], 850),
            vec![1.0, 0.0]
        );
        // Once nothing of the session prefills, the next turn moves it.
        store.follow(k, spill.clone(), 1_700, 2_000);
        assert_eq!(store.get(k, 1_700), Some(spill.clone()));
        store.follow(k, spill.clone(), 1_800, 2_500);
        store.follow(k, home.clone(), 2_400, 2_600);
        assert_eq!(
            store.get(k, 2_400),
            Some(spill),
            "its own pod's prefill counts too"
        );
    }
}
