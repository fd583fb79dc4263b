//! The mirror keeps records for the router's pod set only: a third client naming made-up pods on
//! the stream or in `P:pods` costs the mirror nothing but a count; a pod that joins gets its
//! records from its snapshot, one that leaves has them dropped. Against a real server.

use std::time::{Duration, Instant};

use super::*;
use crate::index::contract::{doc_keys, pods};
use crate::index::redis::mirror_tests::{config, replica, server};
use crate::index::redis::{RedisIndex, Reload, Unknown};
use crate::index::{IndexStats, KvIndex, Local, MemoryIndex, RedisMetrics, Tuning};

const BT: usize = 4;
/// Made-up pods the third client names, and the keys it records for each.
const MADE_UP: usize = 50;
const KEYS_EACH: usize = 2_000;

fn ids(names: &[&str]) -> Vec<PodId> {
    names.iter().map(|n| PodId::new(*n)).collect()
}

#[test]
fn catching_up_says_who_joined_and_who_left() {
    let (feed, members) = PodMembers::channel();
    let mut f = Following::new(members);
    assert!(!f.admits(&PodId::new("a")), "nothing listed yet: nobody");
    assert_eq!(f.catch_up(), Changes::default());
    feed.list(ids(&["a", "b"]));
    let c = f.catch_up();
    assert_eq!((c.joined, c.left), (ids(&["a", "b"]), vec![]));
    assert!(f.admits(&PodId::new("a")) && !f.admits(&PodId::new("c")));
    feed.list(ids(&["b", "c"]));
    let c = f.catch_up();
    assert_eq!((c.joined, c.left), (ids(&["c"]), ids(&["a"])));
    assert!(!f.admits(&PodId::new("a")) && f.admits(&PodId::new("c")));
    feed.list(ids(&["c", "b"]));
    assert_eq!(f.catch_up(), Changes::default(), "the same set again");
    assert_eq!(f.known.as_ref().map(|k| k.len()), Some(2));
}

#[test]
fn without_a_pod_set_every_pod_is_admitted() {
    let mut f = Following::new(PodMembers::everyone());
    assert!(f.admits(&PodId::new("anything")));
    assert_eq!(f.catch_up(), Changes::default());
    assert!(f.known.is_none());
}

#[tokio::test]
async fn the_first_listing_is_waited_for_within_its_grace() {
    let (feed, members) = PodMembers::channel();
    let mut f = Following::new(members);
    let t = Instant::now();
    f.first_listing(Duration::from_millis(50)).await;
    assert!(t.elapsed() >= Duration::from_millis(50), "waited the grace");
    let mut f2 = Following::new(PodMembers { rx: f.rx.clone() });
    feed.list(ids(&["a"]));
    let t = Instant::now();
    f2.first_listing(Duration::from_secs(10)).await;
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "a listing ends the wait"
    );
}

/// A router's replica whose mirror keeps records for the pods `members` lists.
fn router(cfg: &crate::config::RedisConfig, members: PodMembers) -> RedisIndex {
    let tuning = Tuning {
        record_ttl_ms: 600_000,
        default_capacity: 1_000_000,
        gpu_weight: 1.0,
        cpu_weight: 0.8,
    };
    let local = Local::Memory(MemoryIndex::new(600_000, 1_000_000));
    RedisIndex::with_members(cfg, local, tuning, RedisMetrics::unregistered(), members).unwrap()
}

/// Waits (10-s deadline) until `cond` holds.
async fn until(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond().await {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn until_ready(index: &RedisIndex) {
    until("ready", async || index.unready().is_none()).await;
}

fn made_up() -> Vec<PodId> {
    (0..MADE_UP)
        .map(|i| PodId::new(format!("10.255.{}.{}:8000", i / 250, i % 250)))
        .collect()
}

/// A third client (a replica of no router's pod set) records `KEYS_EACH` keys for every made-up
/// pod, and `blocks` keys of document `doc` for each of `known`.
async fn third_client_writes(third: &RedisIndex, known: &[PodId], doc: u64, blocks: usize) {
    for (i, pod) in made_up().iter().enumerate() {
        third
            .record(pod, &doc_keys(1_000 + i as u64, KEYS_EACH, BT), 1)
            .await
            .unwrap();
    }
    for (i, pod) in known.iter().enumerate() {
        let keys = doc_keys(doc + i as u64, blocks, BT);
        third.record(pod, &keys, 1).await.unwrap();
    }
    third.flush().await.unwrap();
}

fn eprint_figures(what: &str, before: IndexStats, after: IndexStats) {
    eprintln!(
        "{what}: {MADE_UP} made-up pods x {KEYS_EACH} keys: mirror without the pod set {} entries, {} pods; with it {} entries, {} pods",
        before.entries, before.pods, after.entries, after.pods
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_records_for_pods_outside_the_pod_set_are_counted_and_dropped() {
    let srv = server();
    let cfg = config(&srv.url(), "members-stream", 1_000_000);
    let known = pods(2);
    let (feed, members) = PodMembers::channel();
    feed.list(known.clone());
    let a = router(&cfg, members);
    // What the mirror did before it followed a pod set.
    let unfiltered = router(&cfg, PodMembers::everyone());
    until_ready(&a).await;
    until_ready(&unfiltered).await;
    let third = replica(&cfg);
    third_client_writes(&third, &known, 1, 16).await;
    a.flush().await.unwrap();
    unfiltered.flush().await.unwrap();
    let (before, after) = (unfiltered.stats(), a.stats());
    eprint_figures("stream", before, after);
    assert_eq!(after.pods, 2, "{after:?}");
    assert_eq!(after.entries, 2 * 16, "{after:?}");
    assert!(before.entries >= MADE_UP * KEYS_EACH, "{before:?}");
    assert_eq!(
        a.metrics().unknown_pods_total(Unknown::Stream),
        MADE_UP as u64
    );
    for (i, pod) in known.iter().enumerate() {
        let keys = doc_keys(1 + i as u64, 16, BT);
        let got = a.lookup(&keys, std::slice::from_ref(pod), 2).await.unwrap();
        assert_eq!(got, vec![16.0], "the known pods' records arrive");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_starting_loads_only_the_pods_its_sources_list() {
    let srv = server();
    let cfg = config(&srv.url(), "members-load", 1_000_000);
    let known = pods(2);
    let third = replica(&cfg);
    third_client_writes(&third, &known, 1, 16).await;
    let (feed, members) = PodMembers::channel();
    let a = router(&cfg, members);
    // What the mirror did before it followed a pod set, started beside it.
    let unfiltered = router(&cfg, PodMembers::everyone());
    until_ready(&unfiltered).await;
    // It waits for the pod sources' first listing before it loads.
    assert!(a.unready().is_some(), "not ready before the first listing");
    assert_eq!(a.metrics().reloads(Reload::Start), 0);
    feed.list(known.clone());
    until_ready(&a).await;
    let (before, after) = (unfiltered.stats(), a.stats());
    eprint_figures("load", before, after);
    assert_eq!((after.pods, after.entries), (2, 2 * 16), "{after:?}");
    assert!(before.entries >= MADE_UP * KEYS_EACH, "{before:?}");
    assert_eq!(
        a.metrics().unknown_pods_total(Unknown::Load),
        MADE_UP as u64
    );
    assert_eq!(a.metrics().reloads(Reload::Start), 1);
    assert_eq!(a.metrics().reloads(Reload::Join), 0, "loaded at start");
    assert_eq!(a.metrics().mirror_reload_entries.get(), 2 * 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_joins_gets_its_records_and_one_that_leaves_loses_them() {
    let srv = server();
    let cfg = config(&srv.url(), "members-join", 1_000_000);
    let p = pods(3);
    let (feed, members) = PodMembers::channel();
    feed.list(p[..1].to_vec());
    let a = router(&cfg, members);
    until_ready(&a).await;
    let third = replica(&cfg);
    let keys: Vec<_> = (0..3).map(|i| doc_keys(i, 8, BT)).collect();
    for (pod, k) in p.iter().zip(&keys) {
        third.record(pod, k, 1).await.unwrap();
    }
    third.flush().await.unwrap();
    a.flush().await.unwrap();
    assert_eq!(a.stats().pods, 1);
    assert_eq!(a.metrics().unknown_pods_total(Unknown::Stream), 2);

    // p1 joins: its snapshot is read then.
    feed.list(p[..2].to_vec());
    let held = |i: usize| {
        let (a, k, pod) = (&a, &keys[i], p[i].clone());
        async move { a.lookup(k, &[pod], 2).await.unwrap() == vec![8.0] }
    };
    until("the joined pod's records", async || held(1).await).await;
    assert_eq!(a.metrics().reloads(Reload::Join), 1);
    assert!(!held(2).await, "p2 is still outside");

    // p0 leaves: its entries go from the mirror (Redis keeps them: the router forgets them there).
    feed.list(p[1..2].to_vec());
    until("the left pod's entries dropped", async || !held(0).await).await;
    assert_eq!(a.stats().pods, 1, "{:?}", a.stats());
    // And what the stream says of it from now on is dropped too.
    third.record(&p[0], &doc_keys(9, 8, BT), 1).await.unwrap();
    third.flush().await.unwrap();
    a.flush().await.unwrap();
    assert_eq!(a.stats().pods, 1, "{:?}", a.stats());
    assert_eq!(a.metrics().unknown_pods_total(Unknown::Stream), 3);
}
