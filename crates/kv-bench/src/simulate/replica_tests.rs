//! Router replicas sharing the index through a delayed stream: no delay is one shared index,
//! a long delay loses the hits that only another replica's record could give.

use super::fleet::{simulate_replicas, RunOutcome};
use super::options::{Replication, SimulateError};
use super::prepare::Prepared;
use super::tests::{conversation_trace, grouped_trace, opts};
use super::*;
use crate::strategy::Strategy;

fn replicas(replicas: usize, propagation_ms: f64) -> Replication {
    Replication {
        replicas,
        propagation_ms,
        charge_ms: None,
    }
}

/// What a run decided and what the pods made of it.
fn fingerprint(
    o: &RunOutcome,
) -> (
    Vec<u64>,
    Vec<usize>,
    u64,
    Option<kv_router::index::ApplyStats>,
) {
    (
        o.ttft_us.clone(),
        o.per_pod.clone(),
        o.cached_tokens,
        o.kv_events,
    )
}

#[test]
fn replicas_without_delay_decide_as_on_one_shared_index() {
    // Each replica keeps its own copy; with no delay every copy gets every record before the
    // next decision, so the copies are the one index the reference shares between replicas.
    let t = conversation_trace(48, 4, 150, 1_500);
    let o = SimulateOptions {
        engine: vllm_sim::engine::EngineConfig {
            num_gpu_blocks: 2_400,
            ..opts(8).engine
        },
        ..opts(8)
    };
    let prep = Prepared::new(&t, &o, 1);
    for strategy in [Strategy::Weighted, Strategy::Precise] {
        let run = |how, one_index| simulate_replicas(&prep, strategy, 8, how, &o, one_index);
        let shared = run(replicas(4, 0.0), true).unwrap();
        let mirrored = run(replicas(4, 0.0), false).unwrap();
        assert_eq!(
            fingerprint(&shared),
            fingerprint(&mirrored),
            "{strategy:?}: four mirrors with no delay differ from one shared index"
        );
        assert_eq!(shared.writes, mirrored.writes);
        // Negative control: the comparison sees a delay that matters.
        let late = run(replicas(4, 5_000.0), false).unwrap();
        assert_ne!(
            fingerprint(&shared),
            fingerprint(&late),
            "{strategy:?}: a 5 s delay changed nothing"
        );
    }
}

#[test]
fn one_replica_is_the_router_alone_and_more_stay_close_to_it_without_delay() {
    let t = conversation_trace(48, 4, 150, 1_500);
    let mut o = opts(8);
    o.engine.num_gpu_blocks = 2_400;
    o.strategies = vec![Strategy::Weighted];
    let alone = run_trace(&t, &o).unwrap();
    // A delay means nothing to one replica: it runs once, as the router alone.
    o.propagation_ms = vec![0.0, 100.0];
    let one = run_trace(&t, &o).unwrap();
    assert_eq!(one.strategies.len(), 1);
    let strip = |mut r: StrategyResult| {
        r.timing = Default::default();
        r
    };
    assert_eq!(
        strip(one.strategies[0].clone()),
        strip(alone.strategies[0].clone())
    );
    // Several replicas with no delay share every record; only their own in-flight charges and
    // conversation memory differ from one router's: a few hits either way.
    o.replicas = vec![1, 2, 4];
    o.propagation_ms = vec![0.0];
    let r = run_trace(&t, &o).unwrap();
    let hit = |i: usize| r.strategies[i].hit_ratio;
    for i in 1..3 {
        assert!(
            (hit(i) - hit(0)).abs() <= 0.1 * hit(0),
            "{} replicas: hit ratio {} vs one router's {}",
            r.strategies[i].replication.replicas,
            hit(i),
            hit(0)
        );
    }
}

#[test]
fn a_delay_longer_than_a_turn_loses_the_conversations_hits() {
    // Turns of a conversation come 1.5 s apart and land on different replicas (round robin): a
    // replica that learns of the previous turn only 60 s later cannot find its history.
    let t = conversation_trace(48, 4, 150, 1_500);
    let mut o = opts(8);
    o.engine.num_gpu_blocks = 2_400;
    o.strategies = vec![Strategy::Weighted, Strategy::Precise];
    o.replicas = vec![4];
    o.propagation_ms = vec![1.0, 60_000.0];
    let r = run_trace(&t, &o).unwrap();
    for pair in r.strategies.chunks(2) {
        let (fast, late) = (&pair[0], &pair[1]);
        assert_eq!(
            (fast.replication, late.replication),
            (replicas(4, 1.0), replicas(4, 60_000.0))
        );
        eprintln!(
            "{:?}: {} with a 60 s delay vs {} with 1 ms",
            fast.strategy, late.hit_ratio, fast.hit_ratio
        );
        if fast.strategy == Strategy::Precise {
            // Every replica reads the pods' events (5 ms): only the speculative entries wait.
            assert!(late.hit_ratio > 0.9 * fast.hit_ratio);
        } else {
            assert!(late.hit_ratio < 0.8 * fast.hit_ratio);
        }
    }
}

#[test]
fn every_routed_decision_publishes_one_record() {
    let t = grouped_trace(6, 10, 40);
    let mut o = opts(4);
    o.strategies = vec![Strategy::RoundRobin, Strategy::Weighted];
    o.replicas = vec![3];
    let r = run_trace(&t, &o).unwrap();
    // Round robin keeps no index, so publishes nothing.
    assert_eq!(r.strategies[0].writes, Writes::default());
    let w = &r.strategies[1].writes;
    assert_eq!(w.records, t.records.len() as u64);
    // 1300-token prompts: 81 full 16-token blocks each.
    assert_eq!(w.blocks, 81 * t.records.len() as u64);
    assert!(r.markdown().contains("weighted x3: each replica publishes"));
}

#[test]
fn replication_options_are_checked_and_deduplicated() {
    let t = grouped_trace(2, 2, 40);
    let mut o = opts(2);
    o.replicas = vec![1, 2];
    o.propagation_ms = vec![0.0, 10.0];
    assert_eq!(
        o.replications(),
        [replicas(1, 0.0), replicas(2, 0.0), replicas(2, 10.0)]
    );
    for (r, d) in [(vec![0], vec![0.0]), (vec![], vec![0.0])] {
        o.replicas = r;
        o.propagation_ms = d;
        let e = run_trace(&t, &o).unwrap_err();
        assert!(matches!(
            e.downcast_ref::<SimulateError>(),
            Some(SimulateError::BadReplication(_))
        ));
    }
    o.replicas = vec![2];
    for d in [vec![-1.0], vec![f64::NAN], vec![]] {
        o.propagation_ms = d;
        assert!(run_trace(&t, &o).is_err());
    }
}

#[test]
fn shared_conversation_marks_reach_the_other_replica_with_the_record() {
    use rand::SeedableRng;

    let seen_by_second = |shared: bool| {
        let (mut r, keys, _) =
            two_replicas(replicas(2, 10.0), false, shared, TokenRelease::Prefill);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        r.decide(0, 1_000, keys.clone(), None, &mut rng);
        let before = r.routers[1].state.conversations().continues(&keys.keys, 8);
        assert_eq!(
            r.next_due(),
            Some(11_000),
            "one record, due after the delay"
        );
        r.deliver_next();
        (
            before,
            r.routers[1].state.conversations().continues(&keys.keys, 8),
        )
    };
    assert_eq!(seen_by_second(true), (false, true));
    assert_eq!(seen_by_second(false), (false, false), "without sharing");
}

#[test]
fn a_load_sent_apart_reaches_the_other_replica_before_its_record() {
    use rand::SeedableRng;

    use super::replicas::Replicas;
    use super::router::SimTime;

    let how = Replication {
        charge_ms: Some(1.0),
        ..replicas(2, 10.0)
    };
    let (mut r, keys, ids) = two_replicas(how, true, false, TokenRelease::Prefill);
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let plan = r.decide(0, 1_000, keys.clone(), None, &mut rng);
    let stale = std::time::Duration::from_secs(60);
    let load = |r: &mut Replicas, at: u64| {
        r.routers[1].views[plan.primary]
            .load(SimTime(at), stale)
            .requests()
    };
    assert_eq!(
        r.next_due(),
        Some(2_000),
        "the load first, after its own delay"
    );
    r.deliver_next();
    assert_eq!(load(&mut r, 2_000), 1.0, "the other replica counts it");
    let held = |r: &Replicas, at: u64| {
        let index = r.routers[1].index.as_ref().unwrap().clone();
        super::router::ready(index.lookup(&keys.keys, &ids, at)).unwrap()
    };
    assert_eq!(held(&r, 2), [0.0, 0.0], "no keys yet");
    assert_eq!(r.next_due(), Some(11_000), "then the record");
    r.deliver_next();
    assert_eq!(
        load(&mut r, 11_000),
        1.0,
        "charged once, not again with the record"
    );
    assert_eq!(
        held(&r, 11)[plan.primary],
        8.0,
        "the keys arrive with the record"
    );
    assert_eq!(r.next_due(), None);
}

/// How long each replica counts a request's tokens, per `TokenRelease`: the live router counts
/// its own until the first token and the others' for the predicted prefill alone; with a release
/// message every replica counts them until the first token. The simulator used to count all of
/// them for the predicted prefill, and so found replicas at parity where the live ones lost
/// 6 points of pooled on the conversation window (docs/results.md, "Paired rounds").
#[test]
fn each_replica_counts_a_requests_tokens_until_its_token_release() {
    use rand::SeedableRng;

    use super::replicas::Replicas;
    use super::router::SimTime;

    let stale = std::time::Duration::from_secs(600);
    // (decider's tokens, the other's tokens) long after the predicted prefill, then after the
    // first token and its release have arrived.
    let run = |release: TokenRelease| {
        let how = Replication {
            charge_ms: Some(1.0),
            ..replicas(2, 10.0)
        };
        let (mut r, keys, _) = two_replicas(how, true, false, release);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let plan = r.decide(0, 1_000, keys.clone(), None, &mut rng);
        let tokens = |r: &mut Replicas, replica: usize, at: u64| {
            r.routers[replica].views[plan.primary]
                .load(SimTime(at), stale)
                .inflight_tokens
        };
        r.deliver_next();
        // A minute on: far past any predicted prefill of 128 tokens.
        let late = 60_000_000;
        let before = (tokens(&mut r, 0, late), tokens(&mut r, 1, late));
        r.first_token(0, late);
        while r.next_due().is_some() {
            r.deliver_next();
        }
        let after = (
            tokens(&mut r, 0, late + 2_000),
            tokens(&mut r, 1, late + 2_000),
        );
        (plan.uncached_tokens as f64, before, after)
    };
    let (t, before, after) = run(TokenRelease::Live);
    assert!(t > 0.0);
    assert_eq!(
        before,
        (t, 0.0),
        "live: the decider waits for the first token"
    );
    assert_eq!(after, (0.0, 0.0));
    let (t, before, after) = run(TokenRelease::FirstToken);
    assert_eq!(before, (t, t), "with a release message both wait for it");
    assert_eq!(after, (0.0, 0.0), "and both let go once it came");
    let (_, before, after) = run(TokenRelease::Prefill);
    assert_eq!(before, (0.0, 0.0), "both for the predicted prefill alone");
    assert_eq!(after, (0.0, 0.0));
}

/// Two weighted replicas over pods `pod-0` and `pod-1`, each on an index of its own, sharing as
/// the flags say, and an 8-block prompt to route.
fn two_replicas(
    how: Replication,
    shared_load: bool,
    shared_conversations: bool,
    release: TokenRelease,
) -> (
    super::replicas::Replicas,
    kv_router::keys::Keys,
    Vec<kv_router::pods::PodId>,
) {
    use kv_router::blocks::BlockKey;
    use kv_router::config::Config;
    use kv_router::keys::Keys;
    use kv_router::pods::PodId;

    let ids: Vec<PodId> = (0..2).map(|i| PodId::new(format!("pod-{i}"))).collect();
    let cfg = Strategy::Weighted.router_config(&Config::default(), super::options::MODEL);
    let keys = Keys {
        keys: (1..=8).map(BlockKey).collect(),
        tokens_per_block: 16,
        prompt_tokens: 128,
        ..Keys::default()
    };
    let routers = (0..2)
        .map(|_| {
            let index =
                kv_router::index::build_index(&cfg.index, &cfg.kv_events, &cfg.blocks, None)
                    .unwrap()
                    .index;
            super::router::SimRouter::new(&cfg, Some(index), ids.clone())
        })
        .collect();
    let r = super::replicas::Replicas::new(
        routers,
        how,
        false,
        shared_load,
        shared_conversations,
        release,
    );
    (r, keys, ids)
}
