//! The live decision path end to end over in-process pods, index and sessions.

use std::sync::atomic::{AtomicU64, Ordering};

use super::*;
use crate::config::{Config, StaticPod};
use crate::index::MemoryIndex;
use crate::picker::Reason;
use crate::pods::PodSource;
use crate::pods::{LoadSample, PodSpec, StaticSource};
use crate::telemetry::Errors;
use prometheus_client::registry::Registry;

/// `n` healthy pods serving model `m` (`127.0.0.1:8000…`) behind a fresh decider.
pub(crate) async fn decider(
    n: usize,
    cfg_edit: impl FnOnce(&mut Config),
) -> (Decider, Arc<PodRegistry>) {
    let mut cfg = Config::default();
    cfg.pods.static_pods = (0..n)
        .map(|i| StaticPod::new(format!("127.0.0.1:{}", 8000 + i), &["m"]))
        .collect();
    cfg_edit(&mut cfg);
    let registry = Arc::new(PodRegistry::default());
    let specs: Vec<PodSpec> = StaticSource::new(&cfg.pods.static_pods)
        .pods()
        .await
        .unwrap();
    registry.update(specs);
    for p in registry.snapshot().pods() {
        p.record_probe(true, 1);
        p.record_sample(Instant::now(), LoadSample::default());
    }
    let metrics = DecisionMetrics::register(&mut Registry::default(), Errors::default());
    let index = Arc::new(MemoryIndex::new(cfg.index.ttl_ms, 1000));
    let sessions = Arc::new(SessionStore::new(100, 10_000));
    let d = Decider::new(
        cfg.decision(),
        Arc::default(),
        registry.clone(),
        index,
        sessions,
        metrics,
    );
    (d, registry)
}

/// A huge prompt is parsed and keyed off the async worker: on a single-threaded runtime
/// another task keeps running while it is decided (inline parsing would starve it).
#[tokio::test(flavor = "current_thread")]
async fn a_huge_body_does_not_stall_the_runtime() {
    let (d, _) = decider(2, |_| {}).await;
    let text = "lorem ipsum dolor sit amet ".repeat(1_000_000);
    let body = serde_json::json!({"model": "m", "prompt": text}).to_string();
    let ticks = Arc::new(AtomicU64::new(0));
    let counter = ticks.clone();
    let ticker = tokio::spawn(async move {
        loop {
            // Not synchronization: the ticker's own pace, counted to see the runtime run.
            tokio::time::sleep(Duration::from_micros(200)).await;
            counter.fetch_add(1, Ordering::Relaxed);
        }
    });
    tokio::task::yield_now().await;
    let before = ticks.load(Ordering::Relaxed);
    let decision = d.plan(req(body.as_bytes(), &[])).await.unwrap();
    let during = ticks.load(Ordering::Relaxed) - before;
    ticker.abort();
    assert!(decision.plan.total_blocks > 100, "the prompt was keyed");
    assert!(
        during >= 3,
        "the runtime ticked {during} times while a 27 MB body was decided"
    );
}

fn req<'a>(body: &'a [u8], headers: &'a [(String, String)]) -> DecideRequest<'a> {
    DecideRequest {
        path: "/v1/completions",
        headers,
        body: Some(body),
        subset: None,
    }
}

fn prompt(prefix: &str, suffix: &str) -> Vec<u8> {
    let text = format!("{}{}", prefix.repeat(40), suffix);
    serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": text})).unwrap()
}

#[tokio::test]
async fn same_prefix_follows_the_first_decision() {
    let (d, _) = decider(4, |_| {}).await;
    let first = d
        .decide(req(&prompt("shared system prompt ", "q1"), &[]))
        .await
        .unwrap();
    for q in ["q2", "q3", "q4"] {
        let next = d
            .decide(req(&prompt("shared system prompt ", q), &[]))
            .await
            .unwrap();
        assert_eq!(next.plan.endpoints[0], first.plan.endpoints[0]);
        assert!(next.plan.ranked[0].matched_blocks > 10.0);
    }
    assert_eq!(first.plan.endpoints.len(), 3, "primary + 2 fallbacks");
    assert_eq!(
        d.metrics
            .decisions(Reason::Scored, &first.plan.endpoints[0]),
        4
    );
}

/// Two requests on a new prefix decided before the first one's record lands (the reply goes
/// first): the second sees the first as if it were in the index and follows it. Before,
/// it saw nothing and a burst leaving at once split over cold pods.
#[tokio::test]
async fn a_decision_answered_but_not_yet_recorded_is_seen_by_the_next() {
    let (d, _) = decider(4, |_| {}).await;
    let body = prompt("a burst on a new prefix ", "q");
    let (a, pending) = d.decide_reply_first(req(&body, &[])).await.unwrap();
    let pending = pending.expect("keys to record");
    assert_eq!(d.index().stats().entries, 0, "not recorded yet");
    let (b, b_pending) = d.decide_reply_first(req(&body, &[])).await.unwrap();
    assert_eq!(b.plan.endpoints[0], a.plan.endpoints[0]);
    let total = b.plan.total_blocks as f64;
    assert!(total > 10.0);
    assert_eq!(b.plan.ranked[0].matched_blocks, total);
    assert_eq!(d.state.unrecorded().len(), 2);
    drop(b_pending);
    d.record(pending).await;
    assert!(d.index().stats().entries > 0);
    // Not synchronization: the grace itself is under test, timed on the std clock the set
    // reads (sleeping at least this long puts both landed entries past it, every run).
    tokio::time::sleep(unrecorded::GRACE + Duration::from_millis(20)).await;
    assert_eq!(
        d.state.unrecorded().len(),
        0,
        "a record, landed or dropped, leaves"
    );
}

#[tokio::test]
async fn new_sessions_on_a_shared_prefix_spread_and_next_turns_stay() {
    let (d, _) = decider(2, |_| {}).await;
    let h = |s: &str| vec![("x-session-id".to_string(), s.to_string())];
    let sys = "shared system prompt ";
    // Each session's own text spans several blocks past the shared prefix.
    let own = |s: &str| format!("{s} own words ").repeat(20);
    let s1 = d
        .decide(req(&prompt(sys, &own("s1")), &h("s1")))
        .await
        .unwrap();
    let s2 = d
        .decide(req(&prompt(sys, &own("s2")), &h("s2")))
        .await
        .unwrap();
    assert_ne!(
        s2.plan.endpoints[0], s1.plan.endpoints[0],
        "a second pod warms"
    );
    assert_eq!(s2.plan.reason, Reason::Spread);
    // s1's next turn extends its first prompt: it stays, scored as before.
    let turn2 = prompt(sys, &format!("{}answer, then the next question", own("s1")));
    let s1b = d.decide(req(&turn2, &h("s1"))).await.unwrap();
    assert_eq!(s1b.plan.endpoints[0], s1.plan.endpoints[0]);
    assert_eq!(s1b.plan.reason, Reason::Scored);
    // A third session: both pods hold the prefix; the one with fewer requests in flight.
    let s3 = d
        .decide(req(&prompt(sys, &own("s3")), &h("s3")))
        .await
        .unwrap();
    assert_eq!(s3.plan.endpoints[0], s2.plan.endpoints[0]);
    assert_eq!(s3.plan.reason, Reason::Spread);
    // Without a session id a request on this prefix may be a one-off question on a shared
    // document: it follows the prefix while the prefix is the longer part of its prompt...
    let anon = d
        .decide(req(&prompt(sys, &own("anon")), &[]))
        .await
        .unwrap();
    assert_eq!(anon.plan.reason, Reason::Scored);
    // ...and is spread once its own text is the longer part (two conversations, s2 and
    // s3, went on from the prefix already, so the prefix is shared).
    let long = format!("{} ", own("anon2").repeat(4));
    let anon2 = d.decide(req(&prompt(sys, &long), &[])).await.unwrap();
    assert_eq!(anon2.plan.reason, Reason::Spread);
}

#[tokio::test]
async fn planning_alone_records_nothing() {
    let (d, reg) = decider(2, |_| {}).await;
    let body = prompt("abc ", "x");
    let h = vec![("x-session-id".to_string(), "s1".to_string())];
    let a = d.plan(req(&body, &h)).await.unwrap();
    assert!(a.guard.is_none());
    assert_eq!(d.index().stats().entries, 0);
    assert!(d.state.sessions().is_empty());
    for p in reg.snapshot().pods() {
        assert_eq!(p.inflight_counts(), (0, 0));
    }
    assert_eq!(d.metrics.decisions(a.plan.reason, &a.plan.endpoints[0]), 0);
    let b = d.decide(req(&body, &h)).await.unwrap();
    assert!(b.guard.is_some());
    assert!(d.index().stats().entries > 0);
    assert_eq!(d.state.sessions().len(), 1);
}

#[tokio::test]
async fn reply_first_commits_all_but_the_index_which_waits_for_record() {
    let (d, reg) = decider(2, |_| {}).await;
    let body = prompt("abc ", "x");
    let h = vec![("x-session-id".to_string(), "s1".to_string())];
    let (a, pending) = d.decide_reply_first(req(&body, &h)).await.unwrap();
    assert!(a.guard.is_some());
    assert_eq!(d.state.sessions().len(), 1);
    let charged: i64 = reg
        .snapshot()
        .pods()
        .iter()
        .map(|p| p.inflight_counts().0)
        .sum();
    assert_eq!(charged, 1, "the load is charged before the reply");
    assert_eq!(d.index().stats().entries, 0, "the index waits");
    d.record(pending.expect("a prompt with keys")).await;
    assert!(d.index().stats().entries > 0);
    let next = d.plan(req(&body, &[])).await.unwrap();
    assert_eq!(next.plan.endpoints[0], a.plan.endpoints[0]);
    assert!(next.plan.ranked[0].matched_blocks > 0.0);
}

#[tokio::test]
async fn saturated_pod_is_avoided_despite_its_cache() {
    let (d, reg) = decider(2, |_| {}).await;
    let body = prompt("hot prefix ", "x");
    let first = d.decide(req(&body, &[])).await.unwrap();
    let hot = reg
        .snapshot()
        .get(&first.plan.endpoints[0])
        .unwrap()
        .clone();
    hot.record_sample(
        Instant::now(),
        LoadSample {
            waiting: 50.0,
            ..LoadSample::default()
        },
    );
    let next = d.decide(req(&body, &[])).await.unwrap();
    assert_ne!(next.plan.endpoints[0], first.plan.endpoints[0]);
    assert_eq!(
        next.plan.endpoints[1], first.plan.endpoints[0],
        "the warm pod stays a fallback"
    );
}

#[tokio::test]
async fn session_header_sticks() {
    let (d, _) = decider(4, |c| c.scorers.prefix.weight = 0.0).await;
    let h = vec![("x-session-id".to_string(), "s1".to_string())];
    let first = d.decide(req(&prompt("a", "1"), &h)).await.unwrap();
    // Three follow-ups: more outstanding requests than the hot gate allows would spill, by design.
    for i in 0..3 {
        let next = d
            .decide(req(&prompt(&format!("unrelated {i}"), "z"), &h))
            .await
            .unwrap();
        assert_eq!(next.plan.endpoints[0], first.plan.endpoints[0]);
    }
}

#[tokio::test]
async fn failures_are_typed_and_counted() {
    let (d, reg) = decider(2, |_| {}).await;
    let other = serde_json::to_vec(&serde_json::json!({"model": "nope", "prompt": "x"})).unwrap();
    assert_eq!(
        d.decide(req(&other, &[])).await.unwrap_err(),
        DecideError::ModelNotFound("nope".into())
    );
    let subset = vec!["10.9.9.9".to_string()];
    let r = DecideRequest {
        subset: Some(&subset),
        ..req(&other, &[])
    };
    assert_eq!(d.decide(r).await.unwrap_err(), DecideError::EmptySubset);
    let bad = d.decide(req(b"{nope", &[])).await.unwrap();
    assert_eq!(bad.plan.reason, Reason::Unparsable);
    assert_eq!(d.metrics.errors.get(ErrorKind::Unparsable), 1);
    for p in reg.snapshot().pods() {
        p.record_probe(false, 1);
    }
    let e = d.decide(req(&other, &[])).await.unwrap_err();
    assert_eq!(e, DecideError::NoHealthyPod);
    assert_eq!(d.metrics.errors.get(ErrorKind::NoHealthyPod), 1);
    let (strict, _) = decider(1, |c| c.strict = true).await;
    assert!(matches!(
        strict.decide(req(b"{nope", &[])).await.unwrap_err(),
        DecideError::BadRequest(_)
    ));
}

#[tokio::test]
async fn subset_restricts_candidates() {
    let (d, _) = decider(4, |_| {}).await;
    let subset = vec!["127.0.0.1:8002".to_string()];
    for i in 0..5 {
        let body = prompt(&format!("p{i}"), "x");
        let r = DecideRequest {
            subset: Some(&subset),
            ..req(&body, &[])
        };
        assert_eq!(
            d.decide(r).await.unwrap().plan.endpoints,
            vec![PodId::new("127.0.0.1:8002")]
        );
    }
    assert!(in_subset(
        &PodId::new("127.0.0.1:8002"),
        &["127.0.0.1".to_string()]
    ));
}

#[tokio::test]
async fn body_less_requests_go_to_least_loaded() {
    let (d, reg) = decider(2, |_| {}).await;
    let busy = reg.snapshot().pods()[0].clone();
    busy.record_sample(
        Instant::now(),
        LoadSample {
            waiting: 5.0,
            ..LoadSample::default()
        },
    );
    let r = DecideRequest {
        body: None,
        ..req(b"", &[])
    };
    let dec = d.decide(r).await.unwrap();
    assert_eq!(dec.plan.reason, Reason::NoBody);
    assert_eq!(&dec.plan.endpoints[0], reg.snapshot().pods()[1].id());
}

/// A rank-only plan (Pick without commit, explain) must not move the round-robin rotation:
/// otherwise any caller of the Pick port shifts where the next real request lands.
#[tokio::test]
async fn rank_only_plans_do_not_advance_round_robin() {
    let rr = |c: &mut Config| c.policy = crate::config::Policy::RoundRobin;
    let body = prompt("a", "b");
    let (probed, _) = decider(3, rr).await;
    let (quiet, _) = decider(3, rr).await;
    let mut got = Vec::new();
    let mut want = Vec::new();
    for _ in 0..3 {
        for _ in 0..4 {
            probed.plan(req(&body, &[])).await.unwrap();
            probed.plan_input(req(&body, &[])).await.unwrap();
        }
        got.push(
            probed.decide(req(&body, &[])).await.unwrap().plan.ranked[0]
                .pod
                .clone(),
        );
        want.push(
            quiet.decide(req(&body, &[])).await.unwrap().plan.ranked[0]
                .pod
                .clone(),
        );
    }
    assert_eq!(got, want, "rank-only plans moved the rotation");
}

/// Two conversations on one long system prompt whose lookups overlap: both gathered (index,
/// loads) before either plans, as when two clients send at once. The second must plan on the
/// first's load and conversation, committed under the lock it plans in. Before, it read the
/// pods' load before the first's charge, saw the first's keys in the unrecorded set but neither
/// its request nor its conversation, and joined it on the cold prefix; a closed loop then kept
/// every request on that pod (kv-bench small-fleet --sessionless: 24 of 24, one CI run in five).
#[tokio::test]
async fn decisions_gathered_together_plan_on_each_others_charge() {
    let (d, reg) = decider(2, |c| c.gate.replicate_to_idle = true).await;
    let system = "You are a careful assistant; follow the house rules. ".repeat(110);
    let first = |conv: usize| {
        let text = format!(
            "{system}Document {conv}: {} Question 0? Answer: fine.",
            "its own words ".repeat(90)
        );
        serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": text})).unwrap()
    };
    let (b0, b1) = (first(0), first(1));
    let g0 = d.gather(req(&b0, &[])).await.unwrap();
    let g1 = d.gather(req(&b1, &[])).await.unwrap();
    let (a, _) = d.plan_and_commit(g0);
    let (b, _) = d.plan_and_commit(g1);
    let pods = reg.snapshot();
    let holder = pods.get(&a.plan.endpoints[0]).unwrap();
    assert_eq!(holder.inflight_counts().0, 1, "the first is charged");
    assert_ne!(
        b.plan.endpoints[0], a.plan.endpoints[0],
        "the idle pod takes the second conversation: {:?}",
        b.plan.reason
    );
}

/// Sessionless clients on a shared system prompt, in process: two pods, two clients in a closed
/// loop, no session id, six conversations of four turns, each opening with the same long system
/// prompt, then its own document (the shared part the longer one), then short questions. Returns the requests per
/// pod and whether the two clients' first requests went to the same pod.
async fn sessionless_closed_loop(replicate_to_idle: bool) -> (Vec<usize>, bool) {
    let (d, _) = decider(2, |c| c.gate.replicate_to_idle = replicate_to_idle).await;
    let system = "You are a careful assistant; follow the house rules. ".repeat(110);
    let body = |text: &str| serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": text}));
    let send = |text: &mut String, conv: usize, turn: usize| {
        if turn == 0 {
            text.push_str(&system);
            text.push_str(&format!("Document {conv}: {}", "its own words ".repeat(90)));
        }
        text.push_str(&format!(
            " Question {turn} of conversation {conv}? Answer: fine."
        ));
        body(text).unwrap()
    };
    // Per client: (conversation, its text so far, turns sent, the request in flight).
    let mut clients: Vec<(usize, String, usize, Option<Decision>)> = Vec::new();
    for conv in 0..2 {
        let mut text = String::new();
        let b = send(&mut text, conv, 0);
        let dec = d.decide(req(&b, &[])).await.unwrap();
        clients.push((conv, text, 1, Some(dec)));
    }
    let pod = |d: &Decision| usize::from(d.plan.endpoints[0].as_str().ends_with("8001"));
    let same_first = pod(clients[0].3.as_ref().unwrap()) == pod(clients[1].3.as_ref().unwrap());
    let (mut next_conversation, mut per_pod) = (2, vec![0usize; 2]);
    // The clients' responses end in turn; each client then sends its next request.
    while clients.iter().any(|c| c.3.is_some()) {
        for c in &mut clients {
            let Some(done) = c.3.take() else { continue };
            per_pod[pod(&done)] += 1;
            drop(done);
            if c.2 == 4 {
                if next_conversation == 6 {
                    continue;
                }
                *c = (next_conversation, String::new(), 0, None);
                next_conversation += 1;
            }
            let b = send(&mut c.1, c.0, c.2);
            c.3 = Some(d.decide(req(&b, &[])).await.unwrap());
            c.2 += 1;
        }
    }
    (per_pod, same_first)
}

#[tokio::test]
async fn sessionless_conversations_on_a_long_shared_prompt_use_both_pods() {
    // Before (the switch off): the second client's first conversation joined the first on the
    // system prompt's holder, which queued both cold prefills while the other pod idled.
    let (before, same_first) = sessionless_closed_loop(false).await;
    assert!(same_first, "before: {before:?}");
    let (after, same_first) = sessionless_closed_loop(true).await;
    assert!(
        !same_first,
        "the idle pod warms the prompt: {after:?} (before {before:?})"
    );
    assert_eq!(after.iter().sum::<usize>(), 24);
    assert!(
        after.iter().all(|&n| n >= 8),
        "no pod above 2/3 of the requests: {after:?} (before {before:?})"
    );
}
