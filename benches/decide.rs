//! The decision path in process: what kv-router spends on one request's body, without Envoy or
//! gRPC (the `ext_proc CPU` of `kv-bench overhead` less the stream handling).
//!
//! Run: `cargo bench --bench decide`. Two healthy pods, approximate (memory) index, the default
//! config; 16 distinct `/v1/completions` prompts per size, each decided once before timing, so
//! the index holds them (the warm case `kv-bench overhead` measures). `decide` is the request
//! path (parse, keys, lookup, plan, load and session commit: what Envoy waits for);
//! `record` the index write the ext_proc stream does after its reply. `parse_key` is the body's
//! own stage (parse, canonical prompt, approximate block keys) on 400 KB and 4 MB prompts: plain
//! text, text with JSON escapes (newlines, quotes), and a chat conversation.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kv_router::blocks::BlockScheme;
use kv_router::config::{Config, StaticPod};
use kv_router::decide::{DecideRequest, Decider, DecisionMetrics};
use kv_router::index::MemoryIndex;
use kv_router::pods::{LoadSample, PodRegistry, PodSource, StaticSource};
use kv_router::request;
use kv_router::scoring::SessionStore;
use kv_router::telemetry::Errors;
use prometheus_client::registry::Registry;
use tokio::runtime::Runtime;
use tokio::time::Instant;

const PATH: &str = "/v1/completions";
/// Distinct prompts per size: 16 × 400 KB keeps ~65k keys, an index bigger than the caches.
const BODIES: u64 = 16;

fn runtime() -> Runtime {
    // Two workers like the router on this machine: big bodies take the block_in_place path.
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Two healthy pods serving `m` behind a decider with the default config, and their registry.
async fn decider() -> (Decider, Arc<PodRegistry>) {
    let mut cfg = Config::default();
    cfg.pods.static_pods = (0..2)
        .map(|i| StaticPod::new(format!("127.0.0.1:{}", 8000 + i), &["m"]))
        .collect();
    let registry = Arc::new(PodRegistry::default());
    registry.update(
        StaticSource::new(&cfg.pods.static_pods)
            .pods()
            .await
            .unwrap(),
    );
    for p in registry.snapshot().pods() {
        p.record_probe(true, 1);
        p.record_sample(Instant::now(), LoadSample::default());
    }
    let metrics = DecisionMetrics::register(&mut Registry::default(), Errors::default());
    let index = Arc::new(MemoryIndex::new(cfg.index.ttl_ms, 1_000_000));
    let sessions = Arc::new(SessionStore::new(10_000, 600_000));
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

/// A scrape of every pod now: released requests stop counting, as between live scrapes.
fn scrape(registry: &PodRegistry) {
    for p in registry.snapshot().pods() {
        p.record_sample(Instant::now(), LoadSample::default());
    }
}

/// 16 distinct completions bodies with `bytes` of ASCII prompt each.
fn bodies(bytes: usize) -> Vec<Vec<u8>> {
    (0..BODIES)
        .map(|i| {
            let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut text = String::with_capacity(bytes + 16);
            while text.len() < bytes {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                text.push_str(
                    [
                        "lorem ",
                        "ipsum ",
                        "dolor ",
                        "sit ",
                        "amet, ",
                        "consectetur ",
                    ][(x % 6) as usize],
                );
            }
            text.truncate(bytes);
            serde_json::to_vec(&serde_json::json!({
                "model": "m", "prompt": text, "max_tokens": 1, "stream": false,
            }))
            .unwrap()
        })
        .collect()
}

fn request(body: &[u8]) -> DecideRequest<'_> {
    DecideRequest {
        path: PATH,
        headers: &[],
        body: Some(body),
        subset: None,
    }
}

fn bench_decide(c: &mut Criterion) {
    let rt = runtime();
    let (d, registry) = rt.block_on(decider());
    let mut g = c.benchmark_group("decide_2_pods_warm");
    for (label, bytes) in [("1KB", 1024), ("8KB", 8 * 1024), ("400KB", 400 * 1024)] {
        let bodies = bodies(bytes);
        rt.block_on(async {
            for b in &bodies {
                d.decide(request(b)).await.unwrap();
            }
        });
        g.throughput(Throughput::Bytes(bytes as u64));
        let mut i = 0;
        g.bench_function(format!("decide_{label}"), |b| {
            b.iter_batched(
                || {
                    i = (i + 1) % bodies.len();
                    scrape(&registry);
                    &bodies[i]
                },
                // The guard drops with the decision: the load is released as when a stream ends.
                |body| rt.block_on(d.decide_reply_first(request(body))).unwrap(),
                BatchSize::SmallInput,
            )
        });
        let mut i = 0;
        g.bench_function(format!("record_{label}"), |b| {
            b.iter_batched(
                || {
                    i = (i + 1) % bodies.len();
                    scrape(&registry);
                    let (_, pending) = rt
                        .block_on(d.decide_reply_first(request(&bodies[i])))
                        .unwrap();
                    pending.expect("keys")
                },
                |pending| rt.block_on(d.record(pending)),
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

/// Prose of `bytes` bytes; `escaped` puts a newline and a quote (JSON escapes) in every ~40 bytes.
fn prose(bytes: usize, escaped: bool) -> String {
    let mut text = String::with_capacity(bytes + 16);
    let mut i = 0usize;
    while text.len() < bytes {
        i += 1;
        text.push_str(["lorem ", "ipsum ", "dolor ", "sit ", "amet, "][i % 5]);
        if escaped && i.is_multiple_of(7) {
            text.push_str(if i.is_multiple_of(2) { "\n" } else { "\"" });
        }
    }
    text.truncate(bytes);
    text
}

fn bench_parse_key(c: &mut Criterion) {
    let scheme = BlockScheme::default();
    let mut g = c.benchmark_group("parse_key");
    for (label, bytes) in [("400KB", 400 * 1024), ("4MB", 4 << 20)] {
        let plain =
            serde_json::json!({"model": "m", "prompt": prose(bytes, false), "max_tokens": 1});
        let escaped =
            serde_json::json!({"model": "m", "prompt": prose(bytes, true), "max_tokens": 1});
        let turn = prose(bytes / 8, true);
        let messages: Vec<_> = (0..8)
            .map(|i| serde_json::json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": turn}))
            .collect();
        let chat = serde_json::json!({"model": "m", "messages": messages, "max_tokens": 1});
        for (kind, path, body) in [
            ("completions", "/v1/completions", plain),
            ("completions_escaped", "/v1/completions", escaped),
            ("chat", "/v1/chat/completions", chat),
        ] {
            let body = serde_json::to_vec(&body).unwrap();
            g.throughput(Throughput::Bytes(body.len() as u64));
            g.bench_function(format!("{kind}_{label}"), |b| {
                b.iter(|| {
                    let req = request::parse(path, &body).unwrap();
                    scheme.keys(&req).len()
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench_decide, bench_parse_key);
criterion_main!(benches);
