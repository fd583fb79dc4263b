//! The pods' capacity correction over the real approximate index: a pod whose hit counters
//! report far fewer hits than the index predicts loses the router's preference for what it
//! dropped, and keeps it for what it holds.

use crate::blocks::BlockKey;
use crate::config::{CorrectionConfig, Preset};
use crate::index::{KvIndex, MemoryIndex};
use crate::pods::{predicted_hit_tokens, read, scaled_capacity, MetricMap, Pod, PodId, PodSpec};

/// A prefix of `BLOCKS` keys, distinct per `p`.
fn prefix(p: u64) -> Vec<BlockKey> {
    (0..BLOCKS).map(|b| BlockKey(p * 1000 + b)).collect()
}

const BLOCKS: u64 = 20;
const PREFIXES: u64 = 40;

/// Scrapes after which the pod that dropped 3/4 of what the router believes it holds has lost
/// the router's preference for the dropped prefixes (each judgement moves the scale by at most
/// `max_step`, so four steps of 1/1.5 cover the quarter).
const WITHIN_SCRAPES: usize = 5;

/// Pod A is configured for 800 router blocks and the router taught its index 40 prefixes of 20
/// blocks; its real cache holds only the last 10 (a quarter). Each scrape window the router
/// sends A every prefix the index still matches on A (elsewhere the rest), and A's vLLM counters
/// report the hits it really has. Returns how many prefixes the router sent A in each window.
async fn prefixes_sent_to_a(correction: CorrectionConfig) -> Vec<usize> {
    let (a, b) = (PodId::new("10.0.0.1:8000"), PodId::new("10.0.0.2:8000"));
    let pod = Pod::new(PodSpec {
        id: a.clone(),
        addr: "10.0.0.1:8000".parse().expect("addr"),
        models: vec![],
        labels: Default::default(),
        kv_events_endpoint: None,
        kv_events_replay_endpoint: None,
    });
    let (capacity, tokens) = (800usize, 16usize);
    let index = MemoryIndex::new(3_600_000, capacity);
    index.set_capacity(&a, capacity).await.expect("capacity");
    for p in 0..PREFIXES {
        index.record(&a, &prefix(p), 0).await.expect("record");
    }
    let real = PREFIXES - PREFIXES / 4..PREFIXES;
    let prompt = BLOCKS * tokens as u64;
    let text = |q: u64, h: u64| {
        format!(
            "vllm:prefix_cache_queries_total{{engine=\"0\",model_name=\"m\"}} {q}.0\n\
             vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"m\"}} {h}.0\n"
        )
    };
    let (mut queries, mut hits) = (0u64, 0u64);
    let started = tokio::time::Instant::now();
    pod.record_sample(
        started,
        read(&text(0, 0), MetricMap::preset(Preset::Vllm)).sample,
    );
    let mut sent = Vec::new();
    for scrape in 1..=WITHIN_SCRAPES + 2 {
        let mut to_a = 0;
        for p in 0..PREFIXES {
            let m = index.lookup(&prefix(p), &[a.clone(), b.clone()], 1).await;
            let m = m.expect("lookup");
            if m[0] <= m[1] {
                continue;
            }
            to_a += 1;
            pod.predicted_hits(predicted_hit_tokens(m[0], tokens, prompt), prompt);
            queries += prompt;
            if real.contains(&p) {
                hits += predicted_hit_tokens(BLOCKS as f64, tokens, prompt);
            }
        }
        sent.push(to_a);
        let at = started + std::time::Duration::from_millis(scrape as u64 * 500);
        pod.record_sample(
            at,
            read(&text(queries, hits), MetricMap::preset(Preset::Vllm)).sample,
        );
        // As the maintenance loop does once a second.
        let scale = pod.correct_capacity(&correction);
        index
            .set_capacity(&a, scaled_capacity(capacity, scale))
            .await
            .expect("capacity");
    }
    sent
}

#[tokio::test]
async fn a_pod_reporting_far_fewer_hits_than_predicted_loses_the_routers_preference() {
    let on = CorrectionConfig {
        enabled: true,
        min_predicted_tokens: 4096,
        min_decisions: 8,
        ..CorrectionConfig::default()
    };
    let sent = prefixes_sent_to_a(on).await;
    assert_eq!(sent[0], PREFIXES as usize, "the index believes A holds all");
    // The correction stops inside its tolerance: 10 real of at most 12 sent is a ratio of 0.83.
    let most = ((PREFIXES / 4) as f64 / (1.0 - on.tolerance)) as usize;
    assert!(
        sent[WITHIN_SCRAPES..].iter().all(|&n| n <= most),
        "within {WITHIN_SCRAPES} scrapes A keeps at most {most}, 10 of which it holds: {sent:?}"
    );
    assert!(
        *sent.last().expect("windows") >= PREFIXES as usize / 4 - 1,
        "and still attracts what it does hold: {sent:?}"
    );
    let off = CorrectionConfig {
        enabled: false,
        ..on
    };
    let sent = prefixes_sent_to_a(off).await;
    assert!(
        sent.iter().all(|&n| n == PREFIXES as usize),
        "without the correction A attracts every prefix: {sent:?}"
    );
}
