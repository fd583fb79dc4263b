//! Index benchmarks: what the router pays per KV event and per lookup.
//!
//! Run: `cargo bench --bench index` (criterion medians), plus a percentile pass printed at the
//! end: `lookup 256 blocks x 64 pods: p50 … p99 …`. Seeded; no I/O.

use std::time::{Duration, Instant};

use criterion::{criterion_group, BatchSize, Criterion, Throughput};
use kv_router::blocks::{namespace_seed, token_keys, BlockKey};
use kv_router::events::{BlockHash, KvEvent, KvEventBatch};
use kv_router::index::{EventIndex, EventIndexConfig, KvIndex, MemoryIndex};
use kv_router::pods::PodId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const MODEL: &str = "m";
const BLOCK: usize = 16;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
}

fn pods(n: usize) -> Vec<PodId> {
    (0..n)
        .map(|i| PodId::new(format!("10.0.{}.{}:8000", i / 250, i % 250)))
        .collect()
}

/// A BlockStored batch of `blocks` blocks chained from `parent` (engine hashes are synthetic).
fn stored(doc: u64, start: usize, blocks: usize) -> KvEventBatch {
    let tokens: Vec<u32> = (start * BLOCK..(start + blocks) * BLOCK)
        .map(|t| (doc as u32).wrapping_mul(7919) ^ t as u32)
        .collect();
    let h = |i: usize| BlockHash::Int(doc << 32 | i as u64);
    KvEventBatch {
        ts: 0.0,
        data_parallel_rank: Some(0),
        events: vec![KvEvent::BlockStored {
            block_hashes: (start..start + blocks).map(h).collect(),
            parent_block_hash: (start > 0).then(|| h(start - 1)),
            token_ids: tokens,
            block_size: BLOCK as u32,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: None,
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            kv_cache_spec_sliding_window: None,
        }],
    }
}

fn doc_keys(doc: u64, blocks: usize) -> Vec<BlockKey> {
    let tokens: Vec<u32> = (0..blocks * BLOCK)
        .map(|t| (doc as u32).wrapping_mul(7919) ^ t as u32)
        .collect();
    token_keys(namespace_seed(MODEL, None), &tokens, BLOCK, 4096)
}

/// 64 pods; each holds a shared 128-block system prompt and its own documents.
fn populated_event_index(pods: &[PodId]) -> EventIndex {
    let idx = EventIndex::new(EventIndexConfig::default());
    let rt = rt();
    rt.block_on(async {
        for (i, p) in pods.iter().enumerate() {
            idx.apply_events(p, 0, MODEL, &stored(0, 0, 128))
                .await
                .unwrap();
            for d in 0..20u64 {
                idx.apply_events(p, 0, MODEL, &stored(1000 + i as u64 * 100 + d, 0, 64))
                    .await
                    .unwrap();
            }
        }
    });
    idx
}

/// A BlockRemoved of `blocks` blocks of `doc` (engine hashes as in [`stored`]).
fn removed(doc: u64, blocks: usize) -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        data_parallel_rank: Some(0),
        events: vec![KvEvent::BlockRemoved {
            block_hashes: (0..blocks)
                .map(|i| BlockHash::Int(doc << 32 | i as u64))
                .collect(),
            medium: Some("GPU".into()),
            group_idx: Some(0),
        }],
    }
}

fn bench_apply(c: &mut Criterion) {
    let mut g = c.benchmark_group("apply_events");
    let rt = rt();
    for blocks in [16usize, 256] {
        g.throughput(Throughput::Elements(blocks as u64));
        g.bench_function(format!("block_stored_{blocks}_blocks"), |b| {
            let pod = PodId::new("10.0.0.1:8000");
            // A fresh index and pod each time; the index is returned so that dropping it is
            // not timed.
            b.iter_batched(
                || {
                    (
                        EventIndex::new(EventIndexConfig::default()),
                        stored(7, 0, blocks),
                    )
                },
                |(idx, batch)| {
                    let stats = rt
                        .block_on(idx.apply_events(&pod, 0, MODEL, &batch))
                        .unwrap();
                    (idx, stats)
                },
                BatchSize::SmallInput,
            )
        });
    }
    // Into the populated index of the lookup benchmarks (64 pods, ~90k keys): one pod stores a
    // new 256-block document; its removal between iterations is not timed.
    let ids = pods(64);
    let idx = populated_event_index(&ids);
    let (doc, blocks) = (999_999u64, 256usize);
    let (store, remove) = (stored(doc, 0, blocks), removed(doc, blocks));
    g.throughput(Throughput::Elements(blocks as u64));
    g.bench_function("block_stored_256_blocks_populated", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                let stats = rt
                    .block_on(idx.apply_events(&ids[0], 0, MODEL, &store))
                    .unwrap();
                spent += t.elapsed();
                assert_eq!(stats.stored, blocks as u64);
                rt.block_on(idx.apply_events(&ids[0], 0, MODEL, &remove))
                    .unwrap();
            }
            spent
        })
    });
    g.finish();
}

fn bench_lookup(c: &mut Criterion) {
    let ids = pods(64);
    let idx = populated_event_index(&ids);
    let rt = rt();
    // A request: the shared 128 blocks, then 128 blocks of one pod's document.
    let mut keys = doc_keys(0, 128);
    keys.truncate(128);
    let keys256 = doc_keys(0, 256);
    let mut g = c.benchmark_group("lookup_64_pods");
    g.bench_function("event_index_256_blocks", |b| {
        b.iter(|| rt.block_on(idx.lookup(&keys256, &ids, 0)).unwrap())
    });
    let mem = MemoryIndex::new(600_000, 100_000);
    rt.block_on(async {
        for p in &ids {
            mem.record(p, &keys256, 0).await.unwrap();
        }
    });
    g.bench_function("memory_index_256_blocks_all_hit", |b| {
        b.iter(|| rt.block_on(mem.lookup(&keys256, &ids, 1)).unwrap())
    });
    g.finish();
}

/// p50/p99 of single lookups (criterion reports means and medians only).
fn percentiles() {
    let ids = pods(64);
    let idx = populated_event_index(&ids);
    let rt = rt();
    let mut rng = StdRng::seed_from_u64(42);
    let mut samples = Vec::with_capacity(20_000);
    let (mut hot, mut cold) = (Vec::with_capacity(10_000), Vec::with_capacity(10_000));
    let mut warm = Vec::with_capacity(10_000);
    for _ in 0..20_000 {
        // Half the requests share the system prompt and one pod's document; half are cold.
        let is_hot = rng.random_bool(0.5);
        let keys = if is_hot {
            let mut k = doc_keys(0, 128);
            k.extend(doc_keys(1000 + rng.random_range(0..64u64) * 100, 128));
            k
        } else {
            doc_keys(rng.random_range(1..u32::MAX as u64), 256)
        };
        let t = Instant::now();
        std::hint::black_box(rt.block_on(idx.lookup(&keys, &ids, 0)).unwrap());
        let spent = t.elapsed();
        // The same request again at once, its keys now in cache: what the misses cost.
        if is_hot {
            let t = Instant::now();
            std::hint::black_box(rt.block_on(idx.lookup(&keys, &ids, 0)).unwrap());
            warm.push(t.elapsed());
        }
        samples.push(spent);
        if is_hot { &mut hot } else { &mut cold }.push(spent);
    }
    let p = |samples: &mut Vec<Duration>, q: f64| {
        samples.sort();
        samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)]
    };
    println!(
        "lookup 256 blocks x 64 pods (event index, 20k mixed requests): p50 {:?}  p99 {:?}  max {:?}",
        p(&mut samples, 0.5),
        p(&mut samples, 0.99),
        samples.last().copied().unwrap_or(Duration::ZERO)
    );
    println!(
        "  of them shared-prefix requests: p50 {:?}  p99 {:?}; cold requests: p50 {:?}  p99 {:?}",
        p(&mut hot, 0.5),
        p(&mut hot, 0.99),
        p(&mut cold, 0.5),
        p(&mut cold, 0.99)
    );
    println!(
        "  shared-prefix requests repeated at once (warm cache): p50 {:?}  p99 {:?}",
        p(&mut warm, 0.5),
        p(&mut warm, 0.99)
    );
}

criterion_group!(benches, bench_apply, bench_lookup);

fn main() {
    benches();
    percentiles();
    Criterion::default().configure_from_args().final_summary();
}
