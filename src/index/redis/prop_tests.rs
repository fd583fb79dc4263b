//! Property: over a real server, the shared index answers every lookup exactly as the
//! in-process index it replaces, for random sequences of records, capacity changes, forgets,
//! sweeps and (precise mode) KV events. Writes are flushed before each lookup; the match cache
//! stays on.

use std::sync::atomic::{AtomicUsize, Ordering};

use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};

use crate::blocks::BlockKey;
use crate::config::RedisConfig;
use crate::index::contract::{clear, doc_keys, pods, remove, store, MODEL};
use crate::index::{
    EventIndex, EventIndexConfig, KvIndex, Local, MemoryIndex, RedisIndex, RedisMetrics, Tuning,
};
use kv_testkit::deploy::{find_redis_server, RedisProc};

const TTL: u64 = 3_000;
const CAP: usize = 6;
const BT: usize = 4;

#[derive(Debug, Clone)]
enum Op {
    Record(usize, Vec<u64>),
    Capacity(usize, usize),
    Forget(usize),
    Sweep,
    Advance(u64),
    Store(usize, u64, usize, usize),
    Remove(usize, u64, usize),
    Clear(usize),
    ForgetRank(usize),
}

fn ops(precise: bool) -> impl Strategy<Value = Vec<Op>> {
    let keys = proptest::sample::subsequence((1u64..=10).collect::<Vec<_>>(), 1..5).prop_shuffle();
    let approx = prop_oneof![
        4 => (0..3usize, keys).prop_map(|(p, k)| Op::Record(p, k)),
        1 => (0..3usize, 1..=CAP).prop_map(|(p, c)| Op::Capacity(p, c)),
        1 => (0..3usize).prop_map(Op::Forget),
        1 => Just(Op::Sweep),
        2 => (1u64..1_500).prop_map(Op::Advance),
    ];
    let events = prop_oneof![
        // From a block on: a parent evicted meanwhile leaves the chain unknown, as in vLLM.
        3 => (0..3usize, 0..3u64, 0..3usize, 1..5usize).prop_map(|(p, d, s, n)| Op::Store(p, d, s, n)),
        2 => (0..3usize, 0..3u64, 0..5usize).prop_map(|(p, d, i)| Op::Remove(p, d, i)),
        1 => (0..3usize).prop_map(Op::Clear),
        1 => (0..3usize).prop_map(Op::ForgetRank),
        1 => (0..3usize).prop_map(Op::Forget),
        // A decision's guess (of blocks the pod holds, then of blocks it computes), which the
        // pod's later reports on the same blocks settle.
        2 => (0..3usize, 0..3u64, 1..=5usize).prop_map(|(p, d, n)| Op::Record(p, doc_keys(d, n, BT).iter().map(|k| k.0).collect())),
        1 => (1u64..1_500).prop_map(Op::Advance),
    ];
    if precise {
        proptest::collection::vec(events, 1..14).boxed()
    } else {
        proptest::collection::vec(approx, 1..14).boxed()
    }
}

fn shared(url: &str, prefix: String, local: Local, ttl: u64, cap: usize) -> RedisIndex {
    let cfg = RedisConfig {
        // Every lookup reads Redis: these tests are about what Redis holds.
        lookups: crate::config::RedisLookups::Redis,
        url: url.to_string(),
        key_prefix: prefix,
        lookup_budget_ms: 2_000,
        write_budget_ms: 5_000,
        ..RedisConfig::default()
    };
    let tuning = Tuning {
        record_ttl_ms: ttl,
        default_capacity: cap,
        gpu_weight: 1.0,
        cpu_weight: 0.8,
    };
    RedisIndex::new(&cfg, local, tuning, RedisMetrics::unregistered()).unwrap()
}

fn events_index() -> EventIndex {
    EventIndex::new(EventIndexConfig {
        block_tokens: BT,
        speculative_ttl_ms: TTL,
        speculative_capacity: CAP,
        ..EventIndexConfig::default()
    })
}

/// Applies `ops` to both and compares every lookup after each step.
async fn same_answers(
    reference: &dyn KvIndex,
    redis: &RedisIndex,
    ops: &[Op],
    probes: &[Vec<BlockKey>],
) -> Result<(), String> {
    let p = pods(3);
    let mut now = 0u64;
    for (step, op) in ops.iter().enumerate() {
        for ix in [reference, redis as &dyn KvIndex] {
            let r = match op {
                Op::Record(i, keys) => {
                    let keys: Vec<BlockKey> = keys.iter().map(|&k| BlockKey(k)).collect();
                    ix.record(&p[*i], &keys, now).await
                }
                Op::Capacity(i, c) => ix.set_capacity(&p[*i], *c).await,
                Op::Forget(i) => ix.forget_pod(&p[*i]).await,
                Op::Sweep => ix.sweep(now).await,
                Op::Advance(_) => Ok(()),
                Op::Store(i, d, s, n) => ix
                    .apply_events(&p[*i], 0, MODEL, &store(*d, *s..*s + *n, BT))
                    .await
                    .map(|_| ()),
                Op::Remove(i, d, b) => ix
                    .apply_events(&p[*i], 0, MODEL, &remove(*d, *b))
                    .await
                    .map(|_| ()),
                Op::Clear(i) => ix
                    .apply_events(&p[*i], 0, MODEL, &clear())
                    .await
                    .map(|_| ()),
                Op::ForgetRank(i) => ix.forget_rank(&p[*i], 0).await,
            };
            r.map_err(|e| format!("step {step} {op:?}: {e}"))?;
        }
        if let Op::Advance(ms) = op {
            now += ms;
        }
        redis.flush().await.map_err(|e| e.to_string())?;
        for keys in probes {
            let want = reference.lookup(keys, &p, now).await.unwrap();
            let got = redis.lookup(keys, &p, now).await.unwrap();
            if want != got {
                return Err(format!(
                    "after step {step} {op:?} at {now} ms, lookup {keys:?}: in-process {want:?}, redis {got:?}"
                ));
            }
        }
    }
    Ok(())
}

fn run(precise: bool) {
    let bin = find_redis_server().unwrap_or_else(|e| panic!("{e:#}"));
    let server = RedisProc::start(&bin).unwrap();
    let url = server.url();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let n = AtomicUsize::new(0);
    let probes: Vec<Vec<BlockKey>> = if precise {
        (0..3).map(|d| doc_keys(d, 5, BT)).collect()
    } else {
        vec![
            (1..=10).map(BlockKey).collect(),
            vec![BlockKey(3), BlockKey(1), BlockKey(2)],
            (5..=8).map(BlockKey).collect(),
        ]
    };
    let mut runner = TestRunner::new(RunnerConfig {
        cases: if precise { 96 } else { 24 },
        failure_persistence: None,
        ..RunnerConfig::default()
    });
    let result = runner.run(&ops(precise), |ops| {
        let prefix = format!("prop{}", n.fetch_add(1, Ordering::Relaxed));
        let outcome = rt.block_on(async {
            let (reference, local): (Box<dyn KvIndex>, Local) = if precise {
                (Box::new(events_index()), Local::Events(events_index()))
            } else {
                (
                    Box::new(MemoryIndex::new(TTL, CAP)),
                    Local::Memory(MemoryIndex::new(TTL, CAP)),
                )
            };
            let redis = shared(&url, prefix, local, TTL, CAP);
            same_answers(reference.as_ref(), &redis, &ops, &probes).await
        });
        outcome.map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn approximate_redis_answers_as_the_memory_index() {
    run(false);
}

#[test]
fn precise_redis_answers_as_the_event_index() {
    run(true);
}

/// The sequences the random ones rarely draw: a decision's hit evicted while its request
/// queues, then its blocks stored, settling the hit guesses (held, or not held any more).
#[test]
fn precise_redis_settles_a_decisions_hits_as_the_event_index() {
    let bin = find_redis_server().unwrap_or_else(|e| panic!("{e:#}"));
    let server = RedisProc::start(&bin).unwrap();
    let url = server.url();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let probes: Vec<Vec<BlockKey>> = (0..3).map(|d| doc_keys(d, 5, BT)).collect();
    let guess = |d, n| Op::Record(0, doc_keys(d, n, BT).iter().map(|k| k.0).collect());
    let cases = [
        // The held prefix's tail evicted, then computed again with the rest.
        vec![
            Op::Store(0, 1, 0, 3),
            guess(1, 5),
            Op::Remove(0, 1, 2),
            Op::Advance(100),
            Op::Store(0, 1, 2, 3),
            Op::Remove(0, 1, 0),
        ],
        // A hit evicted and not stored again when the computed blocks are.
        vec![
            Op::Store(0, 2, 0, 2),
            guess(2, 4),
            Op::Remove(0, 2, 0),
            Op::Store(0, 2, 2, 2),
            Op::Sweep,
        ],
    ];
    for (i, ops) in cases.iter().enumerate() {
        rt.block_on(async {
            let local = Local::Events(events_index());
            let redis = shared(&url, format!("settle{i}"), local, TTL, CAP);
            let outcome = same_answers(&events_index(), &redis, ops, &probes).await;
            outcome.unwrap_or_else(|e| panic!("case {i}: {e}"));
        });
    }
}
