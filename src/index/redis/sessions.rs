//! Sessions shared through the index's Redis: `P:s:<session hash>` → the pod, expiring after the
//! session TTL of idleness. Reads go on a lookup connection within the lookup budget; writes
//! join the index's write queue.

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::mpsc;

use super::mirror::{Change, Mirror};
use super::state::Shared;
use super::writer::WriteOp;
use crate::pods::PodId;
use crate::scoring::{SessionKey, SharedSessions};

/// The shared session map of one replica.
pub(super) struct RedisSessions {
    pub(super) shared: Arc<Shared>,
    pub(super) tx: mpsc::Sender<WriteOp>,
    /// `lookups: mirror`: sessions answered here, kept current from the stream.
    pub(super) mirror: Option<Arc<Mirror>>,
}

#[async_trait]
impl SharedSessions for RedisSessions {
    async fn get(&self, key: SessionKey) -> Option<PodId> {
        if let Some(m) = &self.mirror {
            return m.session(key.hash(), self.shared.wall_now());
        }
        if self.shared.paused() {
            return None;
        }
        let mut con = self.shared.conn.lookup().await.ok()?;
        let pod: Option<String> = redis::cmd("GET")
            .arg(self.shared.schema.session(key.hash()))
            .query_async(&mut con)
            .await
            .ok()?;
        pod.filter(|p| !p.is_empty()).map(PodId::new)
    }

    fn set(&self, key: SessionKey, pod: &PodId, ttl_ms: u64) {
        if let Some(m) = &self.mirror {
            let wall = self.shared.wall_now();
            m.pin(key.hash(), pod.clone(), wall.saturating_add(ttl_ms));
            let change = Change::Session {
                hash: key.hash(),
                pod: pod.clone(),
                ttl_ms,
                wall,
            };
            m.publish(&self.shared, change);
        }
        let op = WriteOp::Session {
            key: key.hash(),
            pod: pod.clone(),
            ttl_ms: ttl_ms.max(1),
        };
        if self.tx.try_send(op).is_err() {
            self.shared
                .metrics
                .dropped(super::metrics::Dropped::QueueFull, 1);
        } else {
            self.shared.metrics.write_queue.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::RedisConfig;
    use crate::index::{KvIndex, Local, MemoryIndex, RedisIndex, RedisMetrics, Tuning};
    use crate::pods::PodId;
    use crate::scoring::{SessionKey, SessionStore};
    use kv_testkit::deploy::{find_redis_server, RedisProc};

    fn replica(url: &str) -> RedisIndex {
        let cfg = RedisConfig {
            url: url.to_string(),
            key_prefix: "sessions".into(),
            // Each lookup reads Redis: what a replica knows comes from Redis alone.
            lookups: crate::config::RedisLookups::Redis,
            lookup_budget_ms: 1_000,
            retry_after_ms: 1,
            ..RedisConfig::default()
        };
        let tuning = Tuning {
            record_ttl_ms: 60_000,
            default_capacity: 100,
            gpu_weight: 1.0,
            cpu_weight: 0.8,
        };
        let local = Local::Memory(MemoryIndex::new(60_000, 100));
        RedisIndex::new(&cfg, local, tuning, RedisMetrics::unregistered()).unwrap()
    }

    #[tokio::test]
    async fn a_session_pinned_by_one_replica_sticks_on_another_and_survives_an_outage_locally() {
        let bin = find_redis_server().unwrap_or_else(|e| panic!("{e:#}"));
        let mut server = RedisProc::start(&bin).unwrap();
        let (a, b) = (replica(&server.url()), replica(&server.url()));
        let budget = Duration::from_secs(1);
        let store_a = SessionStore::new(10, 60_000).with_shared(a.sessions(), budget);
        let store_b = SessionStore::new(10, 60_000).with_shared(b.sessions(), budget);
        let (s, pod) = (
            SessionKey::of("conversation-1"),
            PodId::new("10.0.0.7:8000"),
        );
        assert_eq!(store_b.find(s, 0).await, None);
        store_a.set(s, pod.clone(), 0);
        a.flush().await.unwrap();
        assert_eq!(store_b.find(s, 1).await, Some(pod.clone()), "replica B");
        assert_eq!(
            store_b.get(s, 1),
            None,
            "B learned it from Redis, not itself"
        );
        // Moved by B: A follows.
        let moved = PodId::new("10.0.0.8:8000");
        store_b.set(s, moved.clone(), 2);
        b.flush().await.unwrap();
        assert_eq!(store_a.find(s, 3).await, Some(moved.clone()));
        // Redis gone: each replica still knows what it decided itself.
        server.kill();
        assert_eq!(store_a.find(s, 4).await, Some(pod), "A's own memory");
        assert_eq!(store_b.find(s, 4).await, Some(moved), "B's own memory");
    }
}
