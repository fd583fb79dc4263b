use std::sync::atomic::{AtomicUsize, Ordering};

use prometheus_client::registry::Registry;

use super::*;

fn flow_control(cfg: FlowConfig) -> (Arc<FlowControl>, Registry) {
    let mut registry = Registry::with_prefix("kv_router");
    let metrics = FlowMetrics::register(&mut registry, &cfg);
    (FlowControl::new(cfg, metrics), registry)
}

fn cfg() -> FlowConfig {
    FlowConfig {
        enabled: true,
        shed_below: -5,
        objectives: [("chat".to_string(), 10), ("batch".to_string(), -10)].into(),
        flows: [("tenant-a".to_string(), 2)].into(),
        ..FlowConfig::default()
    }
}

fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn class(priority: i32) -> Class {
    Class {
        priority,
        flow: FlowId::Named("".into()),
    }
}

fn text(r: &Registry) -> String {
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, r).unwrap();
    s
}

async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn trusted() -> FlowConfig {
    FlowConfig {
        trust_client_headers: true,
        ..cfg()
    }
}

#[test]
fn classify_reads_objective_then_priority_then_default_when_trusted() {
    let (fc, _) = flow_control(trusted());
    let c = |h: &[(&str, &str)]| fc.classify(&headers(h));
    assert_eq!(c(&[]).priority, 0);
    assert_eq!(c(&[("x-kv-router-priority", " 7 ")]).priority, 7);
    assert_eq!(c(&[("x-kv-router-priority", "high")]).priority, 0);
    let both = [
        ("x-kv-router-priority", "7"),
        ("x-gateway-inference-objective", "batch"),
    ];
    assert_eq!(c(&both).priority, -10);
    // An objective the configuration does not name falls back to the header.
    assert_eq!(
        c(&[
            ("x-gateway-inference-objective", "nope"),
            ("x-kv-router-priority", "3")
        ])
        .priority,
        3
    );
    // Clamped to the configured classes' range (-10..=10 here).
    assert_eq!(c(&[("x-kv-router-priority", "2147483647")]).priority, 10);
    assert_eq!(c(&[("x-kv-router-priority", "-2147483648")]).priority, -10);
    let long = "é".repeat(100);
    let FlowId::Named(f) = c(&[("x-kv-router-flow", &long)]).flow else {
        panic!("named")
    };
    assert!(f.len() <= MAX_FLOW_ID_BYTES && long.starts_with(&*f));
}

#[test]
fn a_watched_objective_wins_over_the_map_which_covers_the_rest() {
    let (fc, _) = flow_control(trusted());
    let watched = fc.objectives();
    let obj = |name: &str, priority: i64| Objective {
        name: name.into(),
        priority,
        for_pool: true,
    };
    let p = |o: &str| {
        fc.classify(&headers(&[
            ("x-gateway-inference-objective", o),
            ("x-kv-router-priority", "3"),
        ]))
        .priority
    };
    watched.apply(&obj("batch", 4));
    watched.apply(&obj("premium", 8));
    assert_eq!(p("batch"), 4, "the object wins over the map's -10");
    assert_eq!(p("premium"), 8, "an object the map does not name");
    assert_eq!(p("chat"), 10, "the map covers objectives no object names");
    assert_eq!(p("nope"), 3, "neither: the priority header");
    // Outside the classes' range (-10..=10 here): clamped, so shedding and bands still hold.
    watched.apply(&obj("premium", 1_000));
    assert_eq!(p("premium"), 10);
    watched.apply(&obj("premium", -1_000));
    assert_eq!(p("premium"), -10);
    assert_eq!(
        fc.enqueue(class(p("premium")), None, None).err(),
        Some(Refusal::Shed),
        "below shed_below: sheddable"
    );
    watched.delete("batch");
    assert_eq!(p("batch"), -10, "deleted: back to the map");
    // Untrusted headers read no objective, watched or not.
    let (fc, _) = flow_control(cfg());
    fc.objectives().apply(&obj("premium", 8));
    let h = headers(&[("x-gateway-inference-objective", "premium")]);
    assert_eq!(fc.classify(&h).priority, 0);
}

#[test]
fn untrusted_headers_buy_nothing() {
    let (fc, _) = flow_control(FlowConfig {
        identity_header: "x-tenant".into(),
        ..cfg()
    });
    let c = |h: &[(&str, &str)]| fc.classify(&headers(h));
    let forged = [
        ("x-kv-router-priority", "2147483647"),
        ("x-gateway-inference-objective", "chat"),
        ("x-kv-router-flow", "tenant-a"),
    ];
    assert_eq!(c(&forged), class(0));
    let with_id = [forged[0], forged[1], forged[2], ("x-tenant", "alice")];
    assert_eq!(
        c(&with_id),
        Class {
            priority: 0,
            flow: FlowId::Named("alice".into())
        }
    );
    // The identity header wins over a trusted flow header too.
    let (fc, _) = flow_control(FlowConfig {
        identity_header: "x-tenant".into(),
        ..trusted()
    });
    assert_eq!(
        fc.classify(&headers(&with_id)).flow,
        FlowId::Named("alice".into())
    );
}

/// Enqueues 600 attacker requests (each with `attacker(i)`'s headers plus identity "mallory")
/// then 60 victim requests (identity "victim"), and returns the victim's share of the releases
/// made while both still waited.
fn victim_share(fc: &FlowControl, attacker: impl Fn(usize) -> Vec<(String, String)>) -> f64 {
    let mut q = queue::Queue::new(10_000, 1024);
    let id = |who: &str, mut h: Vec<(String, String)>| {
        h.push(("x-tenant".into(), who.into()));
        h
    };
    for i in 0..600 {
        let c = fc.classify(&id("mallory", attacker(i)));
        assert!(matches!(
            q.push(c.priority, c.flow, 1, false),
            queue::Pushed::Queued { .. }
        ));
    }
    let victim = id("victim", headers(&[("x-kv-router-flow", "victim")]));
    for _ in 0..60 {
        let c = fc.classify(&victim);
        assert!(matches!(
            q.push(c.priority, c.flow, 1, true),
            queue::Pushed::Queued { .. }
        ));
    }
    let (mut victims, mut released, mut attackers_left) = (0, 0, 600);
    while victims < 60 && attackers_left > 0 {
        let slot = q.next_ready(|_| true).expect("queued");
        if q.release(slot.seq).expect("present") {
            victims += 1;
        } else {
            attackers_left -= 1;
        }
        released += 1;
    }
    f64::from(victims) / f64::from(released)
}

#[test]
fn rotating_flow_ids_or_forging_priority_gains_no_share() {
    let (fc, _) = flow_control(FlowConfig {
        identity_header: "x-tenant".into(),
        ..cfg()
    });
    let rotating = |i: usize| headers(&[("x-kv-router-flow", &format!("flow-{i}"))]);
    let priority = |_| headers(&[("x-kv-router-priority", "2147483647")]);
    let objective = |_| headers(&[("x-gateway-inference-objective", "chat")]);
    for (what, share) in [
        ("rotation", victim_share(&fc, rotating)),
        ("priority", victim_share(&fc, priority)),
        ("objective", victim_share(&fc, objective)),
    ] {
        // Two identities waiting: the victim's fair share is half.
        assert!(share >= 0.5, "{what}: victim got {share}");
    }
}

#[test]
fn without_an_identity_rotating_flow_ids_is_first_come_first_served() {
    let (fc, _) = flow_control(cfg());
    let mut q = queue::Queue::new(10_000, 1024);
    for i in 0..50 {
        let c = fc.classify(&headers(&[("x-kv-router-flow", &format!("flow-{i}"))]));
        q.push(c.priority, c.flow, 1, i);
    }
    let order: Vec<usize> = (0..50)
        .map(|_| {
            let slot = q.next_ready(|_| true).expect("queued");
            q.release(slot.seq).expect("present")
        })
        .collect();
    assert_eq!(order, (0..50).collect::<Vec<_>>());
}

#[tokio::test]
async fn waiters_leave_by_priority_when_room_frees() {
    let (fc, registry) = flow_control(cfg());
    let slots = Arc::new(AtomicUsize::new(0));
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for (name, p) in [("low1", 0), ("low2", 0), ("high1", 10), ("high2", 10)] {
        let t = fc.enqueue(class(p), Some("m".into()), None).unwrap();
        let (slots, order) = (slots.clone(), order.clone());
        waiters.push(tokio::spawn(async move {
            let release = t.wait().await.expect("released");
            order.lock().push(name);
            slots.fetch_sub(1, Ordering::SeqCst);
            release.committed();
        }));
    }
    assert!(fc.holds(Some("m")) && !fc.holds(Some("other")));
    let m = text(&registry);
    assert!(
        m.contains("kv_router_flow_queued{priority=\"10\",flow=\"other\"} 2"),
        "{m}"
    );
    let s = slots.clone();
    tokio::spawn(
        fc.clone()
            .dispatch(move |model, _| model == Some("m") && s.load(Ordering::SeqCst) > 0),
    );
    // Nothing leaves without room.
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(fc.len(), 4);
    slots.store(4, Ordering::SeqCst);
    for w in waiters {
        w.await.unwrap();
    }
    assert_eq!(*order.lock(), ["high1", "high2", "low1", "low2"]);
    assert!(fc.is_empty() && !fc.holds(Some("m")));
    let m = text(&registry);
    assert!(
        m.contains("kv_router_flow_wait_seconds_count{priority=\"0\",flow=\"other\",outcome=\"released\"} 2"),
        "{m}"
    );
}

#[tokio::test]
async fn timeouts_sheds_and_full_queues_are_refused_and_counted() {
    let (fc, registry) = flow_control(FlowConfig {
        max_queued: 1,
        queue_timeout_ms: 50,
        ..cfg()
    });
    // Sheddable while saturated: refused at once.
    assert_eq!(fc.enqueue(class(-6), None, None).err(), Some(Refusal::Shed));
    // Nothing has room: the one slot times out.
    let t = fc.enqueue(class(0), None, None).unwrap();
    assert_eq!(
        fc.enqueue(class(0), None, None).err(),
        Some(Refusal::QueueFull)
    );
    assert_eq!(t.wait().await.err(), Some(Refusal::Timeout));
    assert!(fc.is_empty());
    // A higher priority takes a full queue's lowest entry, whose waiter is told.
    let low = fc.enqueue(class(-1), None, None).unwrap();
    let _high = fc.enqueue(class(3), None, None).unwrap();
    assert_eq!(low.wait().await.err(), Some(Refusal::Shed));
    assert_eq!(fc.len(), 1);
    let m = text(&registry);
    for reason in ["shed", "queue_full", "queue_timeout"] {
        assert!(
            m.contains(&format!(
                "kv_router_flow_rejections_total{{reason=\"{reason}\""
            )),
            "{reason}: {m}"
        );
    }
}

#[tokio::test]
async fn a_dropped_ticket_leaves_the_queue() {
    let (fc, registry) = flow_control(trusted());
    let headers = headers(&[("x-kv-router-flow", "tenant-a")]);
    let t = fc
        .enqueue(fc.classify(&headers), Some("m".into()), None)
        .unwrap();
    let waiting = tokio::spawn(t.wait());
    until("queued", || fc.len() == 1).await;
    waiting.abort();
    until("the dropped waiter's exit", || fc.is_empty()).await;
    assert!(!fc.holds(Some("m")));
    let m = text(&registry);
    assert!(
        m.contains("kv_router_flow_queued{priority=\"0\",flow=\"tenant-a\"} 0"),
        "{m}"
    );
    assert!(m.contains("outcome=\"cancelled\"} 1"), "{m}");
}
