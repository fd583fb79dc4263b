//! One way into `plan`: for the same state, the simulator's router and the live `Decider` hand
//! `plan` the same input (candidates with matches, load, model, session flag and commitments;
//! the new-conversation call; the turn), and make the same decision.

use std::sync::Arc;

use kv_router::config::{Config, StaticPod};
use kv_router::decide::{DecideRequest, Decider, DecisionMetrics};
use kv_router::index::build_index;
use kv_router::pods::{LoadSample, PodId, PodRegistry, PodSource, StaticSource};
use kv_router::scoring::SessionStore;
use kv_router::telemetry::Errors;
use kv_testkit::splitmix::SplitMix64;
use prometheus_client::registry::Registry;
use serde_json::json;

use super::router::{SimRouter, SimTime};

fn body(parts: &[&str]) -> Vec<u8> {
    let prompt: String = parts.concat();
    serde_json::to_vec(&json!({"model": "m", "prompt": prompt})).unwrap()
}

// Paused time: the live router's clock stands still, as virtual time does between events.
#[tokio::test(start_paused = true)]
async fn the_simulator_hands_plan_what_the_live_decider_hands_it() {
    let mut cfg = Config::default();
    cfg.pods.static_pods = (0..3)
        .map(|i| StaticPod::new(format!("127.0.0.1:{}", 8000 + i), &["m"]))
        .collect();
    // Distinct loads, so no decision is a tie that two rngs could break apart.
    let samples =
        [(1.0, 2.0, 0.30), (0.0, 1.0, 0.10), (2.0, 0.0, 0.50)].map(|(w, r, kv)| LoadSample {
            waiting: w,
            running: r,
            kv_usage: kv,
            ..LoadSample::default()
        });

    let registry = Arc::new(PodRegistry::default());
    registry.update(
        StaticSource::new(&cfg.pods.static_pods)
            .pods()
            .await
            .unwrap(),
    );
    let pods = registry.snapshot();
    for (p, s) in pods.pods().iter().zip(samples) {
        p.record_probe(true, 1);
        p.record_sample(tokio::time::Instant::now(), s);
    }
    let sessions = SessionStore::new(cfg.scorers.session.capacity, cfg.scorers.session.ttl_ms);
    let live = Decider::new(
        &cfg,
        Arc::default(),
        registry.clone(),
        build_index(&cfg.index, &cfg.kv_events, &cfg.blocks, None)
            .unwrap()
            .index,
        Arc::new(sessions),
        DecisionMetrics::register(&mut Registry::default(), Errors::default()),
    );

    let ids: Vec<PodId> = pods.pods().iter().map(|p| p.id().clone()).collect();
    let mut sim = SimRouter::new(
        &cfg,
        Some(
            build_index(&cfg.index, &cfg.kv_events, &cfg.blocks, None)
                .unwrap()
                .index,
        ),
        ids,
    );
    for (v, s) in sim.views.iter_mut().zip(samples) {
        v.sample = Some((SimTime(0), s));
        v.settling.observed_scrape(SimTime(0));
    }
    let mut rng = SplitMix64::new(1);

    let system = "You are a careful assistant. Follow the house rules. ".repeat(12);
    let doc_a = "Document A: the quarterly figures of the northern branch. ".repeat(6);
    let doc_b = "Document B: minutes of the planning meeting in March. ".repeat(6);
    let requests: Vec<(Vec<u8>, Option<&str>)> = vec![
        // A first turn, then its next turn before the first one's record landed (live: the
        // unrecorded overlay; simulated: the index) and pinned to a session.
        (body(&[&system, &doc_a, "Q1?"]), Some("s1")),
        (body(&[&system, &doc_a, "Q1? A1. Q2?"]), Some("s1")),
        // A second conversation on the shared system prompt: counted commitments decide.
        (body(&[&system, &doc_b, "Q1?"]), Some("s2")),
        // No session at all, a third branch.
        (body(&[&system, "Document C. ", "Q1?"]), None),
        // The first conversation again: its session's pod.
        (body(&[&system, &doc_a, "Q1? A1. Q2? A2. Q3?"]), Some("s1")),
    ];
    let mut pending = Vec::new();
    for (n, (body, session)) in requests.iter().enumerate() {
        let headers: Vec<(String, String)> = session
            .map(|s| vec![("x-session-id".to_string(), s.to_string())])
            .unwrap_or_default();
        let req = DecideRequest {
            path: "/v1/completions",
            headers: &headers,
            body: Some(body),
            subset: None,
        };
        let live_input = live.plan_input(req).await.unwrap();
        let sim_input = sim.input(0, live_input.decode.keys.clone(), live_input.decode.session);
        assert_eq!(
            format!("{live_input:?}"),
            format!("{sim_input:?}"),
            "request {n}: the simulator's plan input differs from the live one"
        );
        let (decision, record) = live.decide_reply_first(req).await.unwrap();
        let planned = sim.decide(
            0,
            live_input.decode.keys.clone(),
            live_input.decode.session,
            &mut rng,
        );
        assert_eq!(
            decision.plan.endpoints[0], planned.endpoints[0],
            "request {n}: a different primary"
        );
        // Replies go first; the records stay pending, so the live lookups overlay them.
        pending.extend(record);
    }
    assert!(
        !pending.is_empty(),
        "the live decisions left records to land"
    );
}
