//! Load datagrams over a real server: replicas find each other in `P:peers`, a decision's load
//! reaches the other replica by datagram and is charged once whatever copy follows, and forged,
//! unknown or replayed datagrams charge nothing.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::announced::{Announced, Kind};
use super::mirror_tests::{config, registry_specs, replica, server};
use super::peers::{seal, unhex, Key};
use crate::config::RedisConfig;
use crate::index::contract::pods;
use crate::index::RedisIndex;
use crate::pods::{PodId, PodRegistry};
use crate::share::{Charge, LoadShare, Release};

/// Waits (deadline 10 s) until `done` holds.
async fn until(what: &str, done: impl Fn() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(10), "never: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The replicas listed in `P:peers` under `prefix`: origin → signing key.
async fn listed(url: &str, prefix: &str) -> HashMap<u64, Key> {
    let client = redis::Client::open(url).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let all: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(format!("{prefix}:peers"))
        .query_async(&mut con)
        .await
        .unwrap();
    all.iter()
        .map(|(f, e)| {
            let key = unhex(e.split(' ').nth(1).unwrap()).unwrap();
            (u64::from_str_radix(f, 16).unwrap(), key)
        })
        .collect()
}

fn dropped(index: &RedisIndex, reason: super::metrics::PeerDrop) -> u64 {
    index
        .metrics()
        .load_peer_drops
        .get_or_create(&super::metrics::PeerDropLabel { reason })
        .get()
}

/// Two replicas under `prefix` that list each other; B applies the loads it receives to
/// `registry`'s `pods` (A's decisions are B's remote load).
struct Pair {
    srv: kv_testkit::deploy::RedisProc,
    a: RedisIndex,
    b: RedisIndex,
    pods: Vec<PodId>,
    registry: Arc<PodRegistry>,
}

impl Pair {
    async fn new(prefix: &str, n_pods: usize) -> Self {
        let srv = server();
        let cfg = RedisConfig {
            mirror_max_lag_ms: 5_000,
            load_peers_bind: "127.0.0.1:0".into(),
            ..config(&srv.url(), prefix, 100_000)
        };
        let (a, b) = (replica(&cfg), replica(&cfg));
        let pods = pods(n_pods);
        let registry = Arc::new(PodRegistry::default());
        registry.update(registry_specs(&pods));
        b.attach(Arc::new(crate::conversation::RemoteDecisions {
            load: registry.clone(),
            conversations: Arc::new(crate::conversation::Conversations::new(1_000, 300_000)),
        }));
        until("each replica lists the other", || {
            a.metrics().load_peers.get() == 1 && b.metrics().load_peers.get() == 1
        })
        .await;
        Pair {
            srv,
            a,
            b,
            pods,
            registry,
        }
    }

    /// Pod `i`'s load as B sees it: (in-flight requests, in-flight tokens).
    fn load(&self, i: usize) -> (f64, f64) {
        let l = self
            .registry
            .snapshot()
            .get(&self.pods[i])
            .unwrap()
            .load(tokio::time::Instant::now(), Duration::from_secs(30));
        (l.inflight_requests, l.inflight_tokens)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_goes_straight_to_the_other_replica_and_forged_ones_charge_nothing() {
    use super::metrics::PeerDrop;
    let prefix = "peers";
    let pair = Pair::new(prefix, 2).await;
    let (a, b, p, srv) = (&pair.a, &pair.b, &pair.pods, &pair.srv);
    let load = |i: usize| pair.load(i);
    let charge = Charge {
        uncached_tokens: 4_000,
        prefill_ms: 20_000,
        mark: None,
        announced: None,
    };
    a.announce(&p[0], &charge).unwrap();
    assert_eq!(a.metrics().load_peer_sent.get(), 1);
    // Both copies arrive (datagram and load-stream entry); the load is charged once.
    until("the datagram and the stream entry reach B", || {
        b.metrics().load_peer_lag.count() == 1 && b.metrics().load_lag.count() == 1
    })
    .await;
    assert_eq!(load(0), (1.0, 4_000.0));
    assert_eq!(b.metrics().load_charges.get(), 1, "counted once");

    // Forged, unknown and malformed datagrams: counted, never charged.
    let to = b.load_peers_addr().unwrap();
    let a_origin = a.replica_id().unwrap();
    let a_key = listed(&srv.url(), prefix).await[&a_origin];
    let raw = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let load_on = |origin: u64, seq: u64| Announced {
        origin,
        seq,
        pod: p[1].clone(),
        wall_us: super::state::Shared::wall_now_us(),
        uncached_tokens: 1_000,
        prefill_ms: 1_000,
        kind: Kind::Load,
    };
    raw.send_to(b"not a load", to).unwrap();
    raw.send_to(&seal(&load_on(a_origin, 1 << 40), &[0; 32]).unwrap(), to)
        .unwrap();
    raw.send_to(&seal(&load_on(42, 1 << 40), &a_key).unwrap(), to)
        .unwrap();
    until("all three refused", || {
        dropped(b, PeerDrop::Malformed) == 1
            && dropped(b, PeerDrop::BadSignature) + dropped(b, PeerDrop::UnknownSender) == 2
    })
    .await;
    assert_eq!(load(1), (0.0, 0.0));
    // A datagram signed with a listed key counts once, however often it is replayed.
    let before = b.metrics().load_peer_charges.get();
    let signed = seal(&load_on(a_origin, 1 << 41), &a_key).unwrap();
    for _ in 0..3 {
        raw.send_to(&signed, to).unwrap();
    }
    until("the replays are read", || {
        b.metrics().load_peer_lag.count() == 4
    })
    .await;
    assert_eq!(load(1), (1.0, 1_000.0));
    assert_eq!(b.metrics().load_peer_charges.get(), before + 1);
}

/// A load that reached this replica's socket counts when the next decision reads load, even
/// though the task that receives datagrams has not run (one thread, never yielded to).
#[tokio::test(flavor = "current_thread")]
async fn a_load_waiting_in_the_socket_counts_before_the_next_decision_reads_load() {
    let pair = Pair::new("drain", 1).await;
    let (a, b) = (&pair.a, &pair.b);
    let load = || pair.load(0);
    let charge = Charge {
        uncached_tokens: 3_000,
        prefill_ms: 10_000,
        mark: None,
        announced: None,
    };
    a.announce(&pair.pods[0], &charge).unwrap();
    // From here to the end nothing awaits, so no task of this runtime runs: only the catch-up
    // can charge the load. Blocking sleeps give the kernel time to deliver the datagram.
    assert_eq!(
        load(),
        (0.0, 0.0),
        "nothing charges it while the runtime does not run"
    );
    let t = Instant::now();
    while load() == (0.0, 0.0) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "never charged by the catch-up"
        );
        std::thread::sleep(Duration::from_millis(1));
        b.catch_up();
    }
    // (The charged tokens drain as the modelled prefill runs: compare requests.)
    assert_eq!(load().0, 1.0);
    assert_eq!(b.metrics().load_peer_charges.get(), 1);
    b.catch_up();
    assert_eq!(load().0, 1.0, "an empty socket changes nothing");
    assert_eq!(b.metrics().load_peer_charges.get(), 1);
}

/// Another replica's tokens count until its response starts, not for their predicted prefill
/// alone (which leaves out the pod's queue: the replicas saw an idler fleet than one router
/// did and moved long continuations off their holders).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_tokens_count_until_the_deciding_replica_releases_them() {
    let prefix = "release";
    let pair = Pair::new(prefix, 3).await;
    let (a, b, p) = (&pair.a, &pair.b, &pair.pods);
    let load = |i: usize| pair.load(i);
    // Predicted to prefill at once: only a release ends the count.
    let queued = Charge {
        uncached_tokens: 4_000,
        prefill_ms: 0,
        mark: None,
        announced: None,
    };
    let seq = a.announce(&p[0], &queued).unwrap();
    until("B charges A's load", || {
        b.metrics().load_charges.get() + b.metrics().load_peer_charges.get() > 0
    })
    .await;
    assert_eq!(load(0), (1.0, 4_000.0), "held past its predicted prefill");
    a.release(&p[0], seq, Release::Started);
    until("B releases it", || b.metrics().load_releases.get() == 1).await;
    assert_eq!(
        load(0),
        (1.0, 0.0),
        "the response started: only the request counts"
    );

    // A stream that ended unobserved: its tokens count for their predicted prefill, no longer.
    let long = Charge {
        prefill_ms: 20_000,
        ..queued
    };
    let seq = a.announce(&p[1], &long).unwrap();
    until("B charges the second", || load(1) == (1.0, 4_000.0)).await;
    a.release(&p[1], seq, Release::Settled);
    until("B releases the second", || {
        b.metrics().load_releases.get() == 2
    })
    .await;
    assert_eq!(load(1), (1.0, 4_000.0), "still in its predicted prefill");

    // Both copies of each release arrive; the second changes nothing. A release that comes
    // before its load leaves the load uncharged.
    until("every copy is read", || {
        b.metrics().load_lag.count() == 4 && b.metrics().load_peer_lag.count() == 4
    })
    .await;
    assert_eq!(b.metrics().load_releases.get(), 2);
    assert_eq!(
        b.metrics().load_charges.get(),
        2,
        "releases are not counted as loads"
    );
    assert!(b.metrics().load_peer_charges.get() <= 2);
    let a_origin = a.replica_id().unwrap();
    let a_key = listed(&pair.srv.url(), prefix).await[&a_origin];
    let raw = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let to = b.load_peers_addr().unwrap();
    let message = |kind| Announced {
        origin: a_origin,
        seq: 1 << 42,
        pod: p[2].clone(),
        wall_us: super::state::Shared::wall_now_us(),
        uncached_tokens: 1_000,
        prefill_ms: 0,
        kind,
    };
    for kind in [Kind::Released(Release::Started), Kind::Held] {
        raw.send_to(&seal(&message(kind), &a_key).unwrap(), to)
            .unwrap();
    }
    until("both datagrams are read", || {
        b.metrics().load_peer_lag.count() == 6
    })
    .await;
    assert_eq!(load(2), (0.0, 0.0), "released before it arrived");
    assert_eq!(b.metrics().load_releases.get(), 2);
}

/// A load whose stream copy found the queue full still has its number: its record carries it
/// (a datagram and the record are not both charged) and its release follows (without one the
/// others held its tokens to their bound). One thread, never yielded to: the publisher never
/// drains the queue.
#[tokio::test(flavor = "current_thread")]
async fn a_load_dropped_from_a_full_queue_keeps_its_number() {
    let pair = Pair::new("full", 1).await;
    let charge = Charge {
        uncached_tokens: 10,
        prefill_ms: 1,
        mark: None,
        announced: None,
    };
    let full = || {
        pair.a
            .metrics()
            .load_drops
            .get_or_create(&super::metrics::DroppedLabel {
                reason: super::metrics::Dropped::QueueFull,
            })
            .get()
    };
    let mut last = None;
    for _ in 0..=super::load::QUEUE {
        last = pair.a.announce(&pair.pods[0], &charge);
    }
    assert_eq!(full(), 1, "the queue took {} loads", super::load::QUEUE);
    assert_eq!(last, Some(super::load::QUEUE as u64 + 1));
}
