//! The mirror over a real server: replicas agree within the staleness bound under load, a late
//! replica loads what the others wrote, a replica cut off from Redis converges once it is back,
//! and a stream trimmed past a reader is detected as a gap.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};

use super::mirror::trimmed_past;
use super::schema::RUN;
use super::stream::EntryId;
use crate::blocks::BlockKey;
use crate::config::RedisConfig;
use crate::index::contract::{doc_keys, pods};
use crate::index::{KvIndex, Local, MemoryIndex, RedisIndex, RedisMetrics, RedisReload, Tuning};
use crate::pods::{PodId, PodRegistry, PodSpec};
use crate::share::{Charge, ConversationMark, LoadShare};
use kv_testkit::deploy::{find_redis_server, RedisProc};

const BT: usize = 4;
/// The staleness the docs state (`mirror_max_lag_ms`' default): one replica's decision is seen
/// by the others within it, even on a loaded 2-core test machine.
const BOUND: Duration = Duration::from_millis(1_000);

pub(super) fn config(url: &str, prefix: &str, max_len: usize) -> RedisConfig {
    RedisConfig {
        url: url.to_string(),
        key_prefix: prefix.to_string(),
        stream_max_len: max_len,
        write_budget_ms: 5_000,
        ..RedisConfig::default()
    }
}

pub(super) fn replica(cfg: &RedisConfig) -> RedisIndex {
    let tuning = Tuning {
        record_ttl_ms: 600_000,
        default_capacity: 1_000_000,
        gpu_weight: 1.0,
        cpu_weight: 0.8,
    };
    let local = Local::Memory(MemoryIndex::new(600_000, 1_000_000));
    RedisIndex::new(cfg, local, tuning, RedisMetrics::unregistered()).unwrap()
}

pub(super) fn server() -> RedisProc {
    let bin = find_redis_server().unwrap_or_else(|e| panic!("{e:#}"));
    RedisProc::start(&bin).unwrap()
}

/// Waits (deadline `within`) until `index` sees `keys` fully held by `pod` among `candidates`.
async fn sees(index: &RedisIndex, keys: &[BlockKey], candidates: &[PodId], pod: usize) -> bool {
    let got = index.lookup(keys, candidates, 1).await.unwrap();
    got[pod] == keys.len() as f64
}

/// Records prompts `0..docs` of `blocks` blocks each, dealt round the pods in turn.
async fn record_docs(index: &RedisIndex, pods: &[PodId], docs: u64, blocks: usize) {
    for d in 0..docs {
        let pod = &pods[(d % pods.len() as u64) as usize];
        index
            .record(pod, &doc_keys(d, blocks, BT), 1)
            .await
            .unwrap();
    }
}

/// Waits (10-s deadline) until `index` says it is ready: it has loaded the snapshot.
async fn until_ready(index: &RedisIndex) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while index.unready().is_some() {
        assert!(Instant::now() < deadline, "{:?}", index.unready());
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_agree_within_the_staleness_bound_under_load() {
    let srv = server();
    let cfg = config(&srv.url(), "mirror-load", 100_000);
    let (a, b) = (Arc::new(replica(&cfg)), Arc::new(replica(&cfg)));
    let p = pods(4);
    // Load beside the measurement: B records long prompts as fast as it can.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (b, p, stop) = (b.clone(), p.clone(), stop.clone());
        tokio::spawn(async move {
            let mut d = 10_000u64;
            while !stop.load(Ordering::Relaxed) && d < 13_000 {
                b.record(&p[(d % 4) as usize], &doc_keys(d, 256, BT), 1)
                    .await
                    .unwrap();
                d += 1;
                tokio::task::yield_now().await;
            }
            d - 10_000
        })
    };
    let mut delays = Vec::new();
    for d in 0..60u64 {
        let keys = doc_keys(d, 64, BT);
        let pod = (d % 4) as usize;
        a.record(&p[pod], &keys, 1).await.unwrap();
        let t = Instant::now();
        while !sees(&b, &keys, &p, pod).await {
            assert!(
                t.elapsed() < BOUND * 5,
                "replica B never saw A's decision {d}"
            );
            tokio::task::yield_now().await;
        }
        delays.push(t.elapsed());
    }
    stop.store(true, Ordering::Relaxed);
    let loaded = load.await.unwrap();
    delays.sort();
    let p99 = delays[delays.len() * 99 / 100];
    assert!(
        p99 <= BOUND,
        "p99 {p99:?} > {BOUND:?} (p50 {:?}, {loaded} concurrent records)",
        delays[delays.len() / 2]
    );
    assert!(loaded > 0, "the load ran");
    // Once both are synced, they answer every prompt alike, and nothing went to Redis.
    a.flush().await.unwrap();
    b.flush().await.unwrap();
    for d in (0..60).chain(10_000..10_000 + loaded.min(200)) {
        let keys = doc_keys(d, 64, BT);
        assert_eq!(
            a.lookup(&keys, &p, 2).await.unwrap(),
            b.lookup(&keys, &p, 2).await.unwrap(),
            "prompt {d}"
        );
    }
    assert_eq!(b.metrics().lookups(crate::index::RedisSource::Redis), 0);
    eprintln!(
        "mirror staleness under load: p50 {:?}, p99 {p99:?}, {loaded} concurrent records",
        delays[delays.len() / 2]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_replica_loads_the_shared_index_then_follows_the_stream() {
    let srv = server();
    let cfg = config(&srv.url(), "mirror-late", 100_000);
    let a = replica(&cfg);
    let p = pods(3);
    record_docs(&a, &p, 200, 8).await;
    a.flush().await.unwrap();
    let b = replica(&cfg);
    assert!(b.unready().is_some(), "not ready before it loaded");
    b.flush().await.unwrap();
    until_ready(&b).await;
    assert_eq!(b.metrics().reloads(RedisReload::Start), 1);
    for d in 0..200u64 {
        let keys = doc_keys(d, 8, BT);
        let mut want = vec![0.0; 3];
        want[(d % 3) as usize] = 8.0;
        assert_eq!(b.lookup(&keys, &p, 2).await.unwrap(), want, "prompt {d}");
    }
    // And what A decides next arrives over the stream.
    a.record(&p[0], &doc_keys(500, 8, BT), 3).await.unwrap();
    a.flush().await.unwrap();
    b.flush().await.unwrap();
    assert_eq!(
        b.lookup(&doc_keys(500, 8, BT), &p, 4).await.unwrap(),
        vec![8.0, 0.0, 0.0]
    );
    assert!(b.metrics().mirror_applied() >= 1);
}

/// A TCP proxy to Redis that can be cut (every connection dropped, new ones refused).
struct Cuttable {
    port: u16,
    up: Arc<AtomicBool>,
}

impl Cuttable {
    async fn to(backend: std::net::SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let flag = up.clone();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !flag.load(Ordering::Acquire) {
                    continue;
                }
                let flag = flag.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(backend).await else {
                        return;
                    };
                    let copy = tokio::io::copy_bidirectional(&mut client, &mut server);
                    tokio::pin!(copy);
                    // Polls the flag so a cut drops connections that are idle too.
                    loop {
                        tokio::select! {
                            _ = &mut copy => return,
                            _ = tokio::time::sleep(Duration::from_millis(20)) => {
                                if !flag.load(Ordering::Acquire) {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        Self { port, up }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_from_redis_converges_from_the_snapshot_once_back() {
    let srv = server();
    let proxy = Cuttable::to(srv.addr).await;
    let direct = config(&srv.url(), "mirror-cut", 1_000);
    let via_proxy = config(
        &format!("redis://127.0.0.1:{}", proxy.port),
        "mirror-cut",
        1_000,
    );
    let (a, b) = (replica(&direct), replica(&via_proxy));
    let p = pods(2);
    a.flush().await.unwrap();
    b.flush().await.unwrap();
    proxy.up.store(false, Ordering::Release);
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.metrics().mirror_errors.get() == 0 {
        assert!(
            Instant::now() < deadline,
            "B's mirror never lost its connection"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // More than the stream keeps: B cannot catch up from it.
    record_docs(&a, &p, 3_000, 4).await;
    a.flush().await.unwrap();
    assert!(
        b.lookup(&doc_keys(0, 4, BT), &p, 2).await.unwrap() == vec![0.0, 0.0],
        "B was cut off"
    );
    proxy.up.store(true, Ordering::Release);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let flushed = b.flush().await;
        // Cut mid-read, B reloads on reconnecting; cut between reads (the load stream's errors
        // count too), it finds the trimmed stream a gap. Either is the snapshot.
        let m = b.metrics();
        let reloads = m.reloads(RedisReload::Reconnect) + m.reloads(RedisReload::Gap);
        let seen = b.lookup(&doc_keys(0, 4, BT), &p, 2).await.unwrap();
        if flushed.is_ok() && reloads >= 1 && seen == vec![4.0, 0.0] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "B never converged: flush {flushed:?}, {reloads} reloads, sees {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for d in 0..3_000u64 {
        let mut want = vec![0.0; 2];
        want[(d % 2) as usize] = 4.0;
        assert_eq!(
            b.lookup(&doc_keys(d, 4, BT), &p, 2).await.unwrap(),
            want,
            "prompt {d}"
        );
    }
}

/// A reload rewinds its read position by seconds, to entries the trimmed stream no longer
/// holds; those are the snapshot's, so reading on from there is no new gap (it once reloaded
/// until the stream moved past the rewind, which a quiet stream never does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_loads_past_a_trimmed_stream_reloads_once() {
    let srv = server();
    let cfg = config(&srv.url(), "mirror-late-trim", 1_000);
    let a = replica(&cfg);
    let p = pods(2);
    // More than the stream keeps, all within the rewind (A's own reader may lag and reload:
    // not what this is about).
    record_docs(&a, &p, 3_000, 4).await;
    a.flush().await.unwrap();
    let b = replica(&cfg);
    until_ready(&b).await;
    let started = Instant::now();
    b.flush().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "B took {:?} to catch up",
        started.elapsed()
    );
    assert_eq!(b.metrics().reloads(RedisReload::Start), 1);
    assert_eq!(b.metrics().reloads(RedisReload::Gap), 0);
    for d in [0u64, 1, 2_998, 2_999] {
        let mut want = vec![0.0; 2];
        want[(d % 2) as usize] = 4.0;
        assert_eq!(b.lookup(&doc_keys(d, 4, BT), &p, 2).await.unwrap(), want);
    }
}

#[tokio::test]
async fn a_stream_trimmed_past_a_reader_is_a_gap() {
    let srv = server();
    let cfg = config(&srv.url(), "mirror-gap", 1_000);
    let index = replica(&cfg);
    let shared = &index.shared;
    let mut con = shared.conn.write().await.unwrap();
    assert!(!trimmed_past(shared, &mut con, EntryId::default())
        .await
        .unwrap());
    let mut ids = Vec::new();
    let add = |i: usize| {
        let mut c = redis::cmd("XADD");
        c.arg(shared.schema.stream())
            .arg("MAXLEN")
            .arg(1_000)
            .arg("*")
            .arg("x")
            .arg(i);
        c
    };
    // Entries nobody trimmed are no gap, even for a reader that started before the stream.
    for i in 0..600 {
        let id: String = add(i).query_async(&mut con).await.unwrap();
        ids.push(EntryId::parse(&id).unwrap());
    }
    assert!(!trimmed_past(shared, &mut con, EntryId::default())
        .await
        .unwrap());
    for i in 600..3_000 {
        let id: String = add(i).query_async(&mut con).await.unwrap();
        ids.push(EntryId::parse(&id).unwrap());
    }
    assert!(trimmed_past(shared, &mut con, ids[10]).await.unwrap());
    assert!(trimmed_past(shared, &mut con, EntryId::default())
        .await
        .unwrap());
    assert!(trimmed_past(shared, &mut con, ids[1_998]).await.unwrap());
    assert!(!trimmed_past(shared, &mut con, ids[2_000]).await.unwrap());
    assert!(!trimmed_past(shared, &mut con, ids[2_500]).await.unwrap());
    assert!(!trimmed_past(shared, &mut con, ids[2_999]).await.unwrap());
}

pub(super) fn registry_specs(p: &[PodId]) -> Vec<PodSpec> {
    p.iter()
        .map(|id| PodSpec {
            id: id.clone(),
            addr: id.as_str().parse().unwrap(),
            models: vec![],
            labels: Default::default(),
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
        })
        .collect()
}

/// The router's monotonic milliseconds now, on `index`'s clock (what a live decision passes).
fn now_ms(index: &RedisIndex) -> u64 {
    index.shared.created.elapsed().as_millis() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_replicas_requests_count_as_load_here() {
    let srv = server();
    let cfg = RedisConfig {
        mirror_max_lag_ms: 200,
        mirror_load: true,
        ..config(&srv.url(), "mirror-charge", 100_000)
    };
    let (a, b) = (replica(&cfg), replica(&cfg));
    // A third replica with the setting off counts nothing of the others'.
    let c = replica(&RedisConfig {
        mirror_load: false,
        ..cfg.clone()
    });
    let p = pods(3);
    let registry = Arc::new(PodRegistry::default());
    let unshared = Arc::new(PodRegistry::default());
    registry.update(registry_specs(&p));
    unshared.update(registry_specs(&p));
    // As the router attaches it: load to the pods, conversation marks to conversation memory.
    let memory = || Arc::new(crate::conversation::Conversations::new(1_000, 300_000));
    let (b_memory, c_memory) = (memory(), memory());
    c.attach(Arc::new(crate::conversation::RemoteDecisions {
        load: unshared.clone(),
        conversations: c_memory.clone(),
    }));
    b.attach(Arc::new(crate::conversation::RemoteDecisions {
        load: registry.clone(),
        conversations: b_memory.clone(),
    }));
    let stale = Duration::from_secs(30);
    let load = |i: usize| {
        let l = registry
            .snapshot()
            .get(&p[i])
            .unwrap()
            .load(tokio::time::Instant::now(), stale);
        (l.inflight_requests, l.inflight_tokens)
    };
    let charge = Charge {
        uncached_tokens: 4_000,
        prefill_ms: 20_000,
        mark: Some(ConversationMark {
            best_match: 0,
            new_conversation: true,
        }),
        announced: None,
    };
    // B's own decisions are its guards' to count; a plain record (no request) charges nothing.
    assert!(b.record_decision(&p[2], &doc_keys(1, 8, BT), now_ms(&b), charge));
    a.record(&p[1], &doc_keys(2, 8, BT), now_ms(&a))
        .await
        .unwrap();
    assert!(a.record_decision(&p[0], &doc_keys(3, 8, BT), now_ms(&a), charge));
    let t = Instant::now();
    while load(0) == (0.0, 0.0) {
        assert!(t.elapsed() < BOUND * 5, "A's request never counted on B");
        tokio::task::yield_now().await;
    }
    // Entries are applied in stream order: the two before it were applied already.
    assert_eq!(load(0), (1.0, 4_000.0));
    assert_eq!(load(1), (0.0, 0.0), "a plain record is no request");
    assert_eq!(
        load(2),
        (0.0, 0.0),
        "B's own decision came back from the stream"
    );
    assert_eq!(b.metrics().mirror_charges.get(), 1);
    // Its conversation mark too: B's memory knows the prompt and the new conversation on p0.
    let placed = |m: &crate::conversation::Conversations| m.placed(&p, now_ms(&b));
    assert!(b_memory.continues(&doc_keys(3, 8, BT), 8));
    assert!(placed(&b_memory)[0] > 0.9, "{:?}", placed(&b_memory));
    assert_eq!(placed(&b_memory)[2], 0.0, "B's own decision came back");
    // A decision older than the mirror's lag bound teaches the index but charges nothing.
    let late = cfg.mirror_max_lag_ms + 300;
    tokio::time::sleep_until((a.shared.created + Duration::from_millis(late + 100)).into()).await;
    let old = now_ms(&a) - late;
    assert!(a.record_decision(&p[1], &doc_keys(4, 8, BT), old, charge));
    a.flush().await.unwrap();
    b.flush().await.unwrap();
    assert!(sees(&b, &doc_keys(4, 8, BT), &p, 1).await);
    assert_eq!(load(1), (0.0, 0.0));
    c.flush().await.unwrap();
    assert!(sees(&c, &doc_keys(3, 8, BT), &p, 0).await);
    let now = tokio::time::Instant::now();
    for pod in unshared.snapshot().pods() {
        assert_eq!(
            pod.load(now, stale).inflight_requests,
            0.0,
            "mirror_load off"
        );
    }
    assert!(
        !c_memory.continues(&doc_keys(3, 8, BT), 8),
        "mirror_load off"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decisions_load_reaches_the_others_ahead_of_its_record_and_counts_once() {
    let srv = server();
    let cfg = RedisConfig {
        mirror_max_lag_ms: 5_000,
        mirror_load: true,
        ..config(&srv.url(), "mirror-ahead", 100_000)
    };
    let (a, b) = (replica(&cfg), replica(&cfg));
    let off = replica(&RedisConfig {
        mirror_load: false,
        ..cfg.clone()
    });
    let p = pods(3);
    let registry = Arc::new(PodRegistry::default());
    registry.update(registry_specs(&p));
    let memory = Arc::new(crate::conversation::Conversations::new(1_000, 300_000));
    b.attach(Arc::new(crate::conversation::RemoteDecisions {
        load: registry.clone(),
        conversations: memory.clone(),
    }));
    let load = |i: usize| {
        let l = registry
            .snapshot()
            .get(&p[i])
            .unwrap()
            .load(tokio::time::Instant::now(), Duration::from_secs(30));
        (l.inflight_requests, l.inflight_tokens)
    };
    let mut charge = Charge {
        uncached_tokens: 4_000,
        prefill_ms: 20_000,
        mark: Some(ConversationMark {
            best_match: 0,
            new_conversation: true,
        }),
        announced: None,
    };
    assert_eq!(off.announce(&p[0], &charge), None, "mirror_load off");
    assert!(
        !off.record_decision(&p[0], &doc_keys(9, 8, BT), now_ms(&off), charge),
        "mirror_load off: the record is the caller's"
    );
    // Announced at commit, recorded never (yet): B counts it from the load stream alone.
    charge.announced = a.announce(&p[0], &charge);
    assert!(charge.announced.is_some());
    let t = Instant::now();
    while load(0) == (0.0, 0.0) {
        assert!(t.elapsed() < BOUND * 5, "A's load never reached B");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(load(0), (1.0, 4_000.0));
    assert_eq!(b.metrics().load_charges.get(), 1);
    // Its record follows: its keys and conversation mark land, its load is not counted again.
    assert!(a.record_decision(&p[0], &doc_keys(1, 8, BT), now_ms(&a), charge));
    a.flush().await.unwrap();
    b.flush().await.unwrap();
    assert!(sees(&b, &doc_keys(1, 8, BT), &p, 0).await);
    assert!(memory.continues(&doc_keys(1, 8, BT), 8));
    assert_eq!(load(0), (1.0, 4_000.0), "counted once");
    assert_eq!(b.metrics().mirror_charges.get(), 1);
    // A load whose announcement never arrived (a full queue) still counts, from its record.
    let lost = Charge {
        announced: Some(u64::MAX),
        ..charge
    };
    assert!(a.record_decision(&p[1], &doc_keys(2, 8, BT), now_ms(&a), lost));
    a.flush().await.unwrap();
    b.flush().await.unwrap();
    assert_eq!(load(1), (1.0, 4_000.0));
    assert_eq!(b.metrics().mirror_charges.get(), 2);
    assert_eq!(a.metrics().load_published.get(), 1);
    assert_eq!(b.metrics().load_charges.get(), 1);
}

/// What Redis holds for `pod`'s recorded entry of each of `keys`: the expiry its last writer set,
/// as the score of the run holding it in the pod's snapshot set (no per-block hash is written).
async fn stored(index: &RedisIndex, keys: &[BlockKey], pod: &PodId) -> Vec<Option<u64>> {
    let schema = &index.shared.schema;
    let mut con = index.shared.conn.write().await.unwrap();
    let runs: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
        .arg(schema.snapshot(pod))
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut con)
        .await
        .unwrap();
    let mut held = std::collections::HashMap::new();
    for (m, score) in &runs {
        let (_, run) = super::schema::parse_run(m).expect("a run this router wrote");
        for k in run {
            let e = held.entry(k).or_insert(0u64);
            *e = (*e).max(*score as u64);
        }
    }
    let mut out = Vec::new();
    for &k in keys {
        let hashes: i64 = redis::cmd("EXISTS")
            .arg(schema.recorded(keys[0].0, k))
            .query_async(&mut con)
            .await
            .unwrap();
        assert_eq!(hashes, 0, "no per-block hash in approximate mirror mode");
        out.push(held.get(&k).copied());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_any_replica_recorded_within_the_refresh_window_is_not_rewritten() {
    let srv = server();
    let cfg = RedisConfig {
        record_refresh_ms: 60_000,
        ..config(&srv.url(), "mirror-refresh", 100_000)
    };
    let (a, b) = (replica(&cfg), replica(&cfg));
    let p = pods(2);
    // One snapshot run of 16 keys; the longer prompt adds a second run.
    let keys = doc_keys(1, RUN, BT);
    a.record(&p[0], &keys, now_ms(&a)).await.unwrap();
    a.flush().await.unwrap();
    b.flush().await.unwrap();
    assert!(sees(&b, &keys, &p, 0).await);
    let first = stored(&a, &keys, &p[0]).await;
    assert!(first.iter().all(Option::is_some), "{first:?}");
    // B sends the same prompt to the same pod moments after A: its mirror has every entry.
    b.record(&p[0], &keys, now_ms(&b)).await.unwrap();
    b.flush().await.unwrap();
    assert_eq!(b.metrics().record_skipped.get(), 16);
    assert_eq!(stored(&a, &keys, &p[0]).await, first, "nothing rewritten");
    // Another pod's entries, a longer prompt's new run, and entries past the window are written.
    let longer = doc_keys(1, RUN + 8, BT);
    b.record(&p[1], &keys, now_ms(&b)).await.unwrap();
    b.record(&p[0], &longer, now_ms(&b)).await.unwrap();
    b.flush().await.unwrap();
    assert_eq!(b.metrics().record_skipped.get(), 32);
    assert!(stored(&b, &keys, &p[1]).await.iter().all(Option::is_some));
    assert!(stored(&b, &longer[RUN..], &p[0])
        .await
        .iter()
        .all(Option::is_some));
    b.record(&p[0], &keys, now_ms(&b) + 60_001).await.unwrap();
    b.flush().await.unwrap();
    assert_eq!(b.metrics().record_skipped.get(), 32);
    let later = stored(&a, &keys, &p[0]).await;
    assert!(
        later.iter().zip(&first).all(|(l, f)| l > f),
        "{later:?} vs {first:?}"
    );
    // What was skipped is still in the snapshot a late replica loads.
    let c = replica(&cfg);
    c.flush().await.unwrap();
    until_ready(&c).await;
    assert_eq!(c.lookup(&longer, &p, 2).await.unwrap(), vec![24.0, 16.0]);
    // Off (0), every record is rewritten.
    let off = replica(&RedisConfig {
        record_refresh_ms: 0,
        ..cfg.clone()
    });
    off.flush().await.unwrap();
    off.record(&p[1], &keys, now_ms(&off)).await.unwrap();
    off.flush().await.unwrap();
    assert_eq!(off.metrics().record_skipped.get(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_set_keeps_a_pods_capacity_of_prompt_heads_and_goes_with_the_pod() {
    let srv = server();
    let a = replica(&config(&srv.url(), "mirror-snap", 100_000));
    let p = pods(1);
    // Three runs (16, 16 and 8 keys) against a capacity of two.
    let keys = doc_keys(3, 2 * RUN + 8, BT);
    a.set_capacity(&p[0], 2 * RUN).await.unwrap();
    a.record(&p[0], &keys, now_ms(&a)).await.unwrap();
    a.flush().await.unwrap();
    let held = stored(&a, &keys, &p[0]).await;
    assert!(held[..2 * RUN].iter().all(Option::is_some), "{held:?}");
    assert!(held[2 * RUN..].iter().all(Option::is_none), "{held:?}");
    let members: i64 = redis::cmd("ZCARD")
        .arg(a.shared.schema.snapshot(&p[0]))
        .query_async(&mut a.shared.conn.write().await.unwrap())
        .await
        .unwrap();
    assert_eq!(members, 2, "a member per run of blocks, not per block");
    a.forget_pod(&p[0]).await.unwrap();
    a.flush().await.unwrap();
    let mut con = a.shared.conn.write().await.unwrap();
    let left: i64 = redis::cmd("EXISTS")
        .arg(a.shared.schema.snapshot(&p[0]))
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(left, 0, "forgotten");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_an_older_replica_wrote_one_block_per_member_still_loads() {
    let srv = server();
    let cfg = config(&srv.url(), "mirror-old-snap", 100_000);
    let a = replica(&cfg);
    let p = pods(1);
    let keys = doc_keys(4, 8, BT);
    let expiry = a.shared.wall_now() + a.shared.tuning.record_ttl_ms;
    {
        let mut con = a.shared.conn.write().await.unwrap();
        for (i, &k) in keys.iter().enumerate() {
            redis::cmd("ZADD")
                .arg(a.shared.schema.snapshot(&p[0]))
                .arg(super::snapshot::score(expiry, i))
                .arg(a.shared.schema.member(keys[0].0, k))
                .query_async::<i64>(&mut con)
                .await
                .unwrap();
        }
        redis::cmd("SADD")
            .arg(a.shared.schema.pods())
            .arg(p[0].as_str())
            .query_async::<i64>(&mut con)
            .await
            .unwrap();
    }
    let c = replica(&cfg);
    until_ready(&c).await;
    assert_eq!(c.lookup(&keys, &p, 2).await.unwrap(), vec![8.0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lowered_capacity_trims_the_snapshot_set_in_runs_at_once() {
    let srv = server();
    let a = replica(&config(&srv.url(), "mirror-snap-cap", 100_000));
    let p = pods(1);
    let keys = doc_keys(5, 2 * RUN + 8, BT);
    a.record(&p[0], &keys, now_ms(&a)).await.unwrap();
    a.flush().await.unwrap();
    let members = || async {
        redis::cmd("ZCARD")
            .arg(a.shared.schema.snapshot(&p[0]))
            .query_async::<i64>(&mut a.shared.conn.write().await.unwrap())
            .await
            .unwrap()
    };
    assert_eq!(members().await, 3);
    // Trimmed by the capacity change itself, not at the pod's next record.
    a.set_capacity(&p[0], RUN).await.unwrap();
    a.flush().await.unwrap();
    assert_eq!(members().await, 1, "one run of {RUN} blocks");
    let held = stored(&a, &keys, &p[0]).await;
    assert!(
        held[..RUN].iter().all(Option::is_some),
        "the head stays: {held:?}"
    );
}
