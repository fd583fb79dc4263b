//! Redis lost and back: lookups fall back, then return to Redis by themselves, and precise-mode
//! event state lost with the server (or removals lost in the outage) is rewritten from this
//! replica's own view.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::config::RedisConfig;
use crate::index::contract::{doc_keys, pods, remove, store, MODEL};
use crate::index::{
    EventIndex, EventIndexConfig, KvIndex, Local, RedisFallbackReason, RedisIndex, RedisMetrics,
    RedisSource, Tuning,
};
use kv_testkit::deploy::{find_redis_server, redis_command};

const BT: usize = 4;

/// A server on a fixed port (so it can come back where the router expects it), killed on drop.
struct Server(Child);

impl Server {
    fn start(port: u16) -> Self {
        let bin = find_redis_server().unwrap_or_else(|e| panic!("{e:#}"));
        let child = Command::new(&bin)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + Duration::from_secs(10);
        while redis_command(addr, &["PING"]).ok().as_deref() != Some("+PONG") {
            assert!(Instant::now() < deadline, "redis on {port} never answered");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self(child)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn precise(port: u16) -> RedisIndex {
    let cfg = RedisConfig {
        // Every lookup reads Redis: these tests are about what Redis holds.
        lookups: crate::config::RedisLookups::Redis,
        url: format!("redis://127.0.0.1:{port}"),
        lookup_budget_ms: 500,
        write_budget_ms: 500,
        retry_after_ms: 50,
        ..RedisConfig::default()
    };
    let local = Local::Events(EventIndex::new(EventIndexConfig {
        block_tokens: BT,
        ..EventIndexConfig::default()
    }));
    let tuning = Tuning {
        record_ttl_ms: 2_000,
        default_capacity: 1_000,
        gpu_weight: 1.0,
        cpu_weight: 0.8,
    };
    RedisIndex::new(&cfg, local, tuning, RedisMetrics::unregistered()).unwrap()
}

#[tokio::test]
async fn a_redis_restart_is_survived_and_event_state_is_rewritten_from_the_replicas_view() {
    let port = free_port();
    let server = Server::start(port);
    let (a, b) = (precise(port), precise(port));
    let p = pods(1);
    let keys = doc_keys(1, 4, BT);
    a.apply_events(&p[0], 0, MODEL, &store(1, 0..4, BT))
        .await
        .unwrap();
    a.flush().await.unwrap();
    assert_eq!(
        b.lookup(&keys, &p, 1).await.unwrap(),
        vec![4.0],
        "B sees A's events"
    );
    assert_eq!(b.metrics().lookups(RedisSource::Redis), 1);

    // Redis dies; A learns that block 2 went (the removal cannot be written).
    drop(server);
    a.apply_events(&p[0], 0, MODEL, &remove(1, 2))
        .await
        .unwrap();
    a.flush().await.unwrap();
    assert_eq!(
        a.lookup(&keys, &p, 2).await.unwrap(),
        vec![2.0],
        "A answers from its own index"
    );
    assert!(a.metrics().fallbacks(RedisFallbackReason::Connection) >= 1);
    // (Past B's match cache, which may repeat an answer for `match_cache_ms`.)
    assert_eq!(
        b.lookup(&keys, &p, 1_000).await.unwrap(),
        vec![0.0],
        "B never saw the events"
    );

    // Redis is back, empty (no persistence). A's next sweep after a write that reaches it
    // rewrites its event state; lookups return to Redis by themselves.
    let _server = Server::start(port);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        a.record(&p[0], &doc_keys(9, 1, BT), 2_000).await.unwrap();
        a.flush().await.unwrap();
        a.sweep(2_000).await.unwrap();
        a.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(60)).await;
        if b.lookup(&keys, &p, 2_100).await.unwrap() == vec![2.0] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "B never saw A's rewritten state (fallbacks: {})",
            b.metrics().lookups(RedisSource::Fallback)
        );
    }
    assert!(
        b.metrics().lookups(RedisSource::Redis) >= 2,
        "B is back on Redis"
    );
}
