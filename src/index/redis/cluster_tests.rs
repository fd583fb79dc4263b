//! Cluster mode on a local three-master Redis Cluster: prompts spread over the shards by root,
//! a second replica sees the first one's records and events, a pod's capacity evicts on every
//! shard, a forgotten pod leaves nothing, and a master killed mid-run costs fallbacks (each
//! within the budget), not errors, until the cluster is whole again and lookups return to Redis
//! by themselves.

use std::time::{Duration, Instant};

use crate::config::{RedisConfig, RedisMode};
use crate::index::contract::{doc_keys, pods, store, MODEL};
use crate::index::{
    EventIndex, EventIndexConfig, KvIndex, Local, MemoryIndex, RedisIndex, RedisMetrics,
    RedisSource, Tuning,
};
use kv_testkit::deploy::{find_redis_server, RedisCluster};

const BT: usize = 4;
const BUDGET_MS: u64 = 100;

fn replica(urls: &[String], prefix: &str, precise: bool) -> RedisIndex {
    let cfg = RedisConfig {
        // Every lookup reads Redis: these tests are about what Redis holds.
        lookups: crate::config::RedisLookups::Redis,
        url: urls[0].clone(),
        mode: RedisMode::Cluster,
        cluster_seeds: urls[1..].to_vec(),
        key_prefix: prefix.into(),
        lookup_budget_ms: BUDGET_MS,
        write_budget_ms: 2_000,
        retry_after_ms: 100,
        ..RedisConfig::default()
    };
    let local = if precise {
        Local::Events(EventIndex::new(EventIndexConfig {
            block_tokens: BT,
            ..EventIndexConfig::default()
        }))
    } else {
        Local::Memory(MemoryIndex::new(600_000, 10_000))
    };
    let tuning = Tuning {
        record_ttl_ms: 600_000,
        default_capacity: 10_000,
        gpu_weight: 1.0,
        cpu_weight: 0.8,
    };
    RedisIndex::new(&cfg, local, tuning, RedisMetrics::unregistered()).unwrap()
}

fn dbsizes(urls: &[String]) -> Vec<i64> {
    urls.iter()
        .map(|u| {
            let addr = u.trim_start_matches("redis://").parse().unwrap();
            kv_testkit::deploy::redis_command(addr, &["DBSIZE"])
                .ok()
                .and_then(|r| r.trim_start_matches(':').parse().ok())
                .unwrap_or(-1)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_a_cluster_and_survive_a_dead_master() {
    let bin = find_redis_server().unwrap_or_else(|e| panic!("{e:#}"));
    let mut cluster = RedisCluster::start(&bin).unwrap_or_else(|e| panic!("{e:#}"));
    let urls = cluster.urls();
    let (a, b) = (replica(&urls, "ca", false), replica(&urls, "ca", false));
    let p = pods(2);
    let docs: Vec<_> = (0..24).map(|d| doc_keys(d, 6, BT)).collect();
    for (i, keys) in docs.iter().enumerate() {
        a.record(&p[i % 2], keys, 0).await.unwrap();
    }
    a.flush().await.unwrap();
    for (i, keys) in docs.iter().enumerate() {
        let want = if i % 2 == 0 { [6.0, 0.0] } else { [0.0, 6.0] };
        assert_eq!(b.lookup(keys, &p, 1).await.unwrap(), want, "doc {i}");
    }
    assert_eq!(b.metrics().lookups(RedisSource::Redis), 24);
    let sizes = dbsizes(&urls);
    assert!(
        sizes.iter().filter(|&&n| n > 0).count() == 3,
        "24 prompts spread over the three masters: {sizes:?}"
    );

    // Precise replicas: events applied by one are seen by the other.
    let (pa, pb) = (replica(&urls, "cp", true), replica(&urls, "cp", true));
    pa.apply_events(&p[0], 0, MODEL, &store(77, 0..5, BT))
        .await
        .unwrap();
    pa.flush().await.unwrap();
    assert_eq!(
        pb.lookup(&doc_keys(77, 5, BT), &p, 1).await.unwrap(),
        vec![5.0, 0.0]
    );

    // A pod past its capacity loses its oldest entries on every shard they were spread over
    // (the evictions' deletes are grouped by shard).
    let q = pods(3);
    for keys in &docs[..6] {
        a.record(&q[2], keys, 0).await.unwrap();
    }
    a.set_capacity(&q[2], 6).await.unwrap();
    a.flush().await.unwrap();
    let held = |d: usize| {
        let (b, q, keys) = (&b, &q, &docs[d]);
        async move { b.lookup(keys, q, 1_000).await.unwrap()[2] }
    };
    assert_eq!(held(5).await, 6.0, "the newest prompt stays");
    for d in 0..5 {
        assert_eq!(held(d).await, 0.0, "doc {d} was evicted from its shard");
    }
    assert_eq!(b.metrics().lookups(RedisSource::Redis), 24 + 6);
    a.forget_pod(&q[2]).await.unwrap();

    // A forgotten pod leaves nothing behind on any shard.
    a.forget_pod(&p[0]).await.unwrap();
    a.forget_pod(&p[1]).await.unwrap();
    a.flush().await.unwrap();
    assert_eq!(b.lookup(&docs[0], &p, 2_000).await.unwrap(), vec![0.0, 0.0]);
    pa.forget_pod(&p[0]).await.unwrap();
    pa.flush().await.unwrap();
    assert_eq!(dbsizes(&urls), vec![0, 0, 0], "every key cleaned up");

    // A master dies mid-run: every lookup still answers within the budget (from the replica's
    // own index), counted as a fallback.
    for (i, keys) in docs.iter().enumerate() {
        a.record(&p[i % 2], keys, 3_000).await.unwrap();
    }
    a.flush().await.unwrap();
    cluster.kill(1);
    let mut slowest = Duration::ZERO;
    let deadline = Instant::now() + Duration::from_secs(20);
    while a.metrics().lookups(RedisSource::Fallback) == 0 {
        for keys in &docs {
            let t = Instant::now();
            a.lookup(keys, &p, 4_000).await.unwrap();
            slowest = slowest.max(t.elapsed());
        }
        assert!(Instant::now() < deadline, "no lookup ever fell back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        slowest < Duration::from_millis(BUDGET_MS + 400),
        "a lookup took {slowest:?} with a dead master (budget {BUDGET_MS} ms)"
    );
    for (i, keys) in docs.iter().enumerate() {
        let want = if i % 2 == 0 { [6.0, 0.0] } else { [0.0, 6.0] };
        assert_eq!(
            a.lookup(keys, &p, 5_000).await.unwrap(),
            want,
            "A's own index answers doc {i}"
        );
    }

    // The master returns (its data lost: no persistence): lookups go back to Redis by
    // themselves, and what is recorded again is shared again.
    cluster.restart(1).unwrap();
    cluster.wait_ok(Duration::from_secs(20)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut now = 6_000;
    loop {
        for (i, keys) in docs.iter().enumerate() {
            a.record(&p[i % 2], keys, now).await.unwrap();
        }
        a.flush().await.unwrap();
        let before = b.metrics().lookups(RedisSource::Redis);
        let all = {
            let mut ok = true;
            for (i, keys) in docs.iter().enumerate() {
                let want = if i % 2 == 0 { [6.0, 0.0] } else { [0.0, 6.0] };
                ok &= b.lookup(keys, &p, now + 1).await.unwrap() == want;
            }
            ok
        };
        if all && b.metrics().lookups(RedisSource::Redis) == before + docs.len() as u64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "B never got back to a whole cluster"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        now += 1_000;
    }
}
