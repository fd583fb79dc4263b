//! One way into `plan`: for the same state, the simulator's router and the live `Decider` hand
//! `plan` the same input (candidates with matches, load, model, session flag, commitments and
//! adapter fit; a P/D model's prefill candidates; the new-conversation call; the turn), and make
//! the same decision: for base-model, LoRA adapter and prefill/decode requests alike.

use std::sync::Arc;

use kv_router::config::{Config, PodRole, StaticPod};
use kv_router::decide::{DecideRequest, Decider, DecisionMetrics};
use kv_router::index::build_index;
use kv_router::pods::{LoadSample, LoraResidency, PodId, PodRegistry, PodSource, StaticSource};
use kv_router::scoring::SessionStore;
use kv_router::telemetry::Errors;
use kv_testkit::splitmix::SplitMix64;
use prometheus_client::registry::Registry;
use serde_json::json;

use super::router::{SimRouter, SimTime};

fn body(model: &str, parts: &[String]) -> Vec<u8> {
    let prompt: String = parts.concat();
    serde_json::to_vec(&json!({"model": model, "prompt": prompt})).unwrap()
}

/// The adapter residency both routers are told: each pod runs its own adapter, one slot.
fn residency(p: usize) -> LoraResidency {
    LoraResidency {
        max_lora: Some(1),
        running: [["sql", "chat", "code"][p % 3].to_string()].into(),
        ..LoraResidency::default()
    }
}

/// What the fleet looks like in a case.
#[derive(Clone, Copy, PartialEq)]
enum Fleet {
    Base,
    Lora,
    /// The first pod prefills, the others decode.
    Pd,
}

/// Runs `requests` (model, prompt parts, session) through a live `Decider` and a `SimRouter` over
/// the same three pods, comparing each plan input and primary.
async fn same_plans(fleet: Fleet, requests: &[Request]) {
    let mut cfg = Config::default();
    cfg.pods.static_pods = (0..3)
        .map(|i| {
            let mut p = StaticPod::new(format!("127.0.0.1:{}", 8000 + i), &["m"]);
            if fleet == Fleet::Pd {
                p.role = Some(if i == 0 {
                    PodRole::Prefill
                } else {
                    PodRole::Decode
                });
            }
            p
        })
        .collect();
    if fleet == Fleet::Lora {
        for a in ["sql", "chat", "code"] {
            cfg.scorers.lora.adapters.insert(a.into(), "m".into());
        }
    }
    cfg.disaggregation.threshold_tokens = 64;
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
    let now = tokio::time::Instant::now();
    for (i, (p, s)) in pods.pods().iter().zip(samples).enumerate() {
        p.record_probe(true, 1);
        p.record_sample(now, s);
        if fleet == Fleet::Lora {
            p.record_lora(now, Some(residency(i)));
        }
    }
    let sessions = SessionStore::new(cfg.scorers.session.capacity, cfg.scorers.session.ttl_ms);
    let live = Decider::new(
        cfg.decision(),
        Arc::default(),
        registry.clone(),
        build_index(&cfg.index, &cfg.kv_events, &cfg.blocks, None)
            .unwrap()
            .index,
        Arc::new(sessions),
        DecisionMetrics::register(&mut Registry::default(), Errors::default()),
    );

    let ids: Vec<PodId> = pods.pods().iter().map(|p| p.id().clone()).collect();
    let roles = pods.pods().iter().map(|p| p.role()).collect();
    let index = build_index(&cfg.index, &cfg.kv_events, &cfg.blocks, None)
        .unwrap()
        .index;
    let mut sim = SimRouter::new(&cfg, Some(index), ids).with_roles(roles);
    for (i, (v, s)) in sim.views.iter_mut().zip(samples).enumerate() {
        v.sample = Some((SimTime(0), s));
        v.settling.observed_scrape(SimTime(0));
        if fleet == Fleet::Lora {
            let r = residency(i);
            for a in &r.running {
                v.used(a);
            }
            v.lora = Some((SimTime(0), r));
        }
    }
    let mut rng = SplitMix64::new(1);

    let mut pending = Vec::new();
    let mut disaggregated = 0;
    for (n, (model, parts, session)) in requests.iter().enumerate() {
        let headers: Vec<(String, String)> = session
            .map(|s| vec![("x-session-id".to_string(), s.to_string())])
            .unwrap_or_default();
        let body = body(model, parts);
        let req = DecideRequest {
            path: "/v1/completions",
            headers: &headers,
            body: Some(&body),
            subset: None,
        };
        let adapter = (*model != "m").then_some(*model);
        let live_input = live.plan_input(req).await.unwrap();
        let (keys, sess) = (&live_input.decode.keys, live_input.decode.session);
        let sim_input = sim.input(0, keys.clone(), sess, adapter);
        assert_eq!(
            format!("{live_input:?}"),
            format!("{sim_input:?}"),
            "request {n}: the simulator's plan input differs from the live one"
        );
        assert_eq!(live_input.decode.lora.is_some(), fleet == Fleet::Lora);
        assert_eq!(live_input.prefill.is_some(), fleet == Fleet::Pd);
        let (decision, record) = live.decide_reply_first(req).await.unwrap();
        let planned = sim.decide(0, keys.clone(), sess, adapter, &mut rng);
        assert_eq!(
            decision.plan.endpoints[0], planned.endpoints[0],
            "request {n}: a different primary"
        );
        assert_eq!(
            decision.plan.prefill_pod(),
            planned.prefill_pod(),
            "request {n}: a different prefill pod"
        );
        disaggregated += usize::from(planned.prefill_pod().is_some());
        match fleet {
            // Only the decode pod joins the live unrecorded set; the prefill pod learns the
            // prompt when the record lands, as the simulator's commit records it at once.
            Fleet::Pd => {
                if let Some(r) = record {
                    live.record(r).await;
                }
            }
            // Replies go first; the records stay pending, so the live lookups overlay them.
            _ => pending.extend(record),
        }
    }
    assert_eq!(
        pending.is_empty(),
        fleet == Fleet::Pd,
        "the live decisions left records to land"
    );
    if fleet == Fleet::Pd {
        assert!(disaggregated > 0, "some prompt was prefilled apart");
    }
}

/// A request: its model (an adapter, or the base model `m`), prompt parts and session.
type Request = (&'static str, Vec<String>, Option<&'static str>);

/// A conversation, its next turn before the first one's record landed, a second conversation
/// on the shared system prompt, a request with no session, the first conversation again.
fn conversations(models: [&'static str; 5]) -> Vec<Request> {
    let system = "You are a careful assistant. Follow the house rules. ".repeat(12);
    let doc_a = "Document A: the quarterly figures of the northern branch. ".repeat(6);
    let doc_b = "Document B: minutes of the planning meeting in March. ".repeat(6);
    let parts = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        (models[0], parts(&[&system, &doc_a, "Q1?"]), Some("s1")),
        (
            models[1],
            parts(&[&system, &doc_a, "Q1? A1. Q2?"]),
            Some("s1"),
        ),
        (models[2], parts(&[&system, &doc_b, "Q1?"]), Some("s2")),
        (models[3], parts(&[&system, "Document C. ", "Q1?"]), None),
        (
            models[4],
            parts(&[&system, &doc_a, "Q1? A1. Q2? A2. Q3?"]),
            Some("s1"),
        ),
    ]
}

// Paused time: the live router's clock stands still, as virtual time does between events.
#[tokio::test(start_paused = true)]
async fn the_simulator_hands_plan_what_the_live_decider_hands_it() {
    same_plans(Fleet::Base, &conversations(["m"; 5])).await;
}

#[tokio::test(start_paused = true)]
async fn adapter_requests_are_planned_alike() {
    same_plans(
        Fleet::Lora,
        &conversations(["sql", "sql", "chat", "code", "sql"]),
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn prefill_decode_requests_are_planned_alike() {
    same_plans(Fleet::Pd, &conversations(["m"; 5])).await;
}
