use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;
use crate::blocks::{namespace_seed, token_keys};
use crate::events::{decode_batch, BlockHash, KvEvent};

const MODEL: &str = "Qwen/Qwen3-0.6B";

fn fixture(name: &str) -> KvEventBatch {
    decode_batch(&crate::events::fixture_payload(name)).unwrap()
}

fn keys(
    model: &str,
    salt: Option<&str>,
    tokens: std::ops::Range<u32>,
    size: usize,
) -> Vec<BlockKey> {
    let ids: Vec<u32> = tokens.collect();
    token_keys(namespace_seed(model, salt), &ids, size, 1000)
}

async fn apply(idx: &EventIndex, pod: &PodId, names: &[&str]) {
    for n in names {
        idx.apply_events(pod, 0, MODEL, &fixture(n)).await.unwrap();
    }
}

fn pod(s: &str) -> PodId {
    PodId::new(s)
}

#[tokio::test]
async fn stored_then_removed_blocks_from_fixtures() {
    let idx = EventIndex::new(EventIndexConfig::default());
    let a = pod("10.0.0.5:8000");
    let k = keys(MODEL, None, 0..64, 16);
    apply(
        &idx,
        &a,
        &[
            "01_block_stored_root_int",
            "02_block_stored_with_parent_int",
        ],
    )
    .await;
    assert_eq!(
        idx.lookup(&k, std::slice::from_ref(&a), 0).await.unwrap(),
        vec![4.0]
    );
    apply(&idx, &a, &["06_block_removed"]).await;
    assert_eq!(
        idx.lookup(&k, std::slice::from_ref(&a), 0).await.unwrap(),
        vec![3.0],
        "blocks 0-2 remain"
    );
    apply(&idx, &a, &["07_all_blocks_cleared"]).await;
    assert_eq!(
        idx.lookup(&k, std::slice::from_ref(&a), 0).await.unwrap(),
        vec![0.0]
    );
    assert_eq!(idx.stats(), IndexStats::default());
}

#[tokio::test]
async fn mixed_batch_end_state() {
    let idx = EventIndex::new(EventIndexConfig::default());
    let a = pod("10.0.0.5:8000");
    apply(&idx, &a, &["01_block_stored_root_int", "08_mixed_batch"]).await;
    // GPU {block 0 of tokens 100..115}, CPU {same hash}; the clear dropped tokens 0..31.
    let k = keys(MODEL, None, 100..148, 16);
    assert_eq!(
        idx.lookup(&k, std::slice::from_ref(&a), 0).await.unwrap(),
        vec![1.0]
    );
    assert_eq!(
        idx.lookup(&keys(MODEL, None, 0..32, 16), std::slice::from_ref(&a), 0)
            .await
            .unwrap(),
        vec![0.0]
    );
    assert_eq!(idx.engine_blocks(&a), 1);
    // Removing the GPU copy leaves the CPU tier, weighted 0.8.
    let rm = KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockRemoved {
            block_hashes: vec![BlockHash::Int(10428775992902877628)],
            medium: Some("GPU".into()),
            group_idx: Some(0),
        }],
        data_parallel_rank: Some(0),
    };
    idx.apply_events(&a, 0, MODEL, &rm).await.unwrap();
    assert_eq!(
        idx.lookup(&k, std::slice::from_ref(&a), 0).await.unwrap(),
        vec![0.8]
    );
}

#[tokio::test]
async fn bytes_hashes_behave_like_int_hashes() {
    let idx = EventIndex::new(EventIndexConfig::default());
    let b = pod("10.0.0.6:8000");
    apply(&idx, &b, &["03_bytes_hashes"]).await;
    // Content of 01 + 02, then the removal of block 3.
    assert_eq!(
        idx.lookup(&keys(MODEL, None, 0..64, 16), &[b], 0)
            .await
            .unwrap(),
        vec![3.0]
    );
}

#[tokio::test]
async fn lora_and_salt_seed_the_keys() {
    let idx = EventIndex::new(EventIndexConfig::default());
    let a = pod("10.0.0.5:8000");
    apply(
        &idx,
        &a,
        &[
            "04_block_stored_lora_cache_salt",
            "05_block_stored_cache_salt_only",
        ],
    )
    .await;
    let lora = keys("sql-lora", Some("tenant-a"), 0..32, 16);
    assert_eq!(
        idx.lookup(&lora, std::slice::from_ref(&a), 0)
            .await
            .unwrap(),
        vec![2.0]
    );
    let salted = keys(MODEL, Some("tenant-a"), 0..32, 16);
    assert_eq!(
        idx.lookup(&salted, std::slice::from_ref(&a), 0)
            .await
            .unwrap(),
        vec![2.0]
    );
    let plain = keys(MODEL, None, 0..32, 16);
    assert_eq!(
        idx.lookup(&plain, &[a], 0).await.unwrap(),
        vec![0.0],
        "salted blocks never match unsalted requests"
    );
}

#[tokio::test]
async fn legacy_layouts_index_the_same() {
    let idx = EventIndex::new(EventIndexConfig::default());
    let a = pod("10.0.0.9:8000");
    apply(&idx, &a, &["11_legacy_block_stored"]).await;
    assert_eq!(
        idx.lookup(&keys(MODEL, None, 0..32, 16), std::slice::from_ref(&a), 0)
            .await
            .unwrap(),
        vec![2.0]
    );
    apply(
        &idx,
        &a,
        &[
            "12_legacy_block_removed",
            "13_legacy_all_blocks_cleared",
            "14_legacy_mixed_lora",
        ],
    )
    .await;
    assert_eq!(idx.stats().entries, 0, "14 ends with a clear");
    apply(&idx, &a, &["15_legacy_earliest_layout"]).await;
    assert_eq!(idx.stats().entries, 0, "15 stores, removes, then clears");
}

#[tokio::test]
async fn ranks_are_separate_and_router_block_size_may_differ() {
    let idx = EventIndex::new(EventIndexConfig {
        block_tokens: 32,
        ..EventIndexConfig::default()
    });
    let a = pod("10.0.0.5:8000");
    apply(
        &idx,
        &a,
        &[
            "01_block_stored_root_int",
            "02_block_stored_with_parent_int",
        ],
    )
    .await;
    assert_eq!(
        idx.lookup(&keys(MODEL, None, 0..64, 32), std::slice::from_ref(&a), 0)
            .await
            .unwrap(),
        vec![2.0]
    );
    // Rank 1's blocks are tracked on their own: purging rank 1 keeps rank 0's.
    let c = fixture("09_dp_rank1");
    idx.apply_events(&a, 1, MODEL, &c).await.unwrap();
    idx.forget_rank(&a, 1).await.unwrap();
    assert_eq!(
        idx.lookup(&keys(MODEL, None, 0..64, 32), &[a], 0)
            .await
            .unwrap(),
        vec![2.0]
    );
}

#[tokio::test]
async fn speculative_entries_expire_unless_confirmed() {
    let idx = EventIndex::new(EventIndexConfig {
        speculative_ttl_ms: 2_000,
        ..EventIndexConfig::default()
    });
    let a = pod("10.0.0.5:8000");
    let k = keys(MODEL, None, 0..64, 16);
    idx.record(&a, &k, 1000).await.unwrap();
    assert_eq!(
        idx.lookup(&k, std::slice::from_ref(&a), 2999)
            .await
            .unwrap(),
        vec![4.0]
    );
    assert_eq!(
        idx.lookup(&k, std::slice::from_ref(&a), 3000)
            .await
            .unwrap(),
        vec![0.0]
    );
    idx.record(&a, &k, 5000).await.unwrap();
    apply(&idx, &a, &["01_block_stored_root_int"]).await;
    idx.sweep(10_000).await.unwrap();
    assert_eq!(
        idx.lookup(&k, &[a], 10_000).await.unwrap(),
        vec![2.0],
        "confirmed blocks stay"
    );
}

/// One document's keys (16-token blocks) on a fresh index: what the guess tests send and read.
struct Doc {
    idx: EventIndex,
    keys: Vec<BlockKey>,
}

impl Doc {
    fn new(doc: u64, blocks: usize, speculative_ttl_ms: u64) -> Self {
        Self {
            idx: EventIndex::new(EventIndexConfig {
                speculative_ttl_ms,
                ..EventIndexConfig::default()
            }),
            keys: crate::index::contract::doc_keys(doc, blocks, 16),
        }
    }

    /// `pod` reports `batch`.
    async fn ev(&self, pod: &PodId, batch: KvEventBatch) {
        let model = crate::index::contract::MODEL;
        self.idx.apply_events(pod, 0, model, &batch).await.unwrap();
    }

    /// A decision sends the document's first `blocks` blocks to `pod` at `t`.
    async fn record(&self, pod: &PodId, blocks: usize, t: u64) {
        self.idx.record(pod, &self.keys[..blocks], t).await.unwrap();
    }

    /// The document's match on `pod` at `t`.
    async fn at(&self, pod: &PodId, t: u64) -> Vec<f64> {
        let pods = std::slice::from_ref(pod);
        self.idx.lookup(&self.keys, pods, t).await.unwrap()
    }
}

#[tokio::test]
async fn a_guess_lasts_until_the_pod_reports_on_its_blocks() {
    use crate::index::contract::{remove, store};
    let d = Doc::new(7, 4, 30_000);
    let a = pod("10.0.0.5:8000");
    // Queued for 20 s before its prefill: the decision's guess still stands (it lived 2 s).
    d.record(&a, 4, 0).await;
    assert_eq!(d.at(&a, 20_000).await, vec![4.0]);
    // The pod stored the blocks, then evicted the third: the guess does not outlive the report.
    d.ev(&a, store(7, 0..4, 16)).await;
    d.ev(&a, remove(7, 2)).await;
    assert_eq!(d.at(&a, 20_000).await, vec![2.0]);
    // A guess about blocks the pod never reports on ends with its TTL.
    let b = pod("10.0.0.6:8000");
    d.record(&b, 4, 0).await;
    assert_eq!(d.at(&b, 29_999).await, vec![4.0]);
    assert_eq!(d.at(&b, 30_000).await, vec![0.0]);
}

#[tokio::test]
async fn a_guess_outlives_the_eviction_of_an_older_copy_until_the_request_stores_its_blocks() {
    use crate::index::contract::{remove, store};
    let d = Doc::new(7, 4, 30_000);
    let a = pod("10.0.0.5:8000");
    // An earlier request's document, block 1 since evicted: the pod holds 0, 2 and 3.
    d.ev(&a, store(7, 0..4, 16)).await;
    d.ev(&a, remove(7, 1)).await;
    assert_eq!(d.at(&a, 0).await, vec![1.0]);
    // Routed there, the next request hits block 0 and computes 1..4: the guess covers them.
    d.record(&a, 4, 0).await;
    assert_eq!(d.at(&a, 0).await, vec![4.0]);
    // While it queues, the pod evicts the older copies of 2 and 3: it will compute them anew.
    d.ev(&a, remove(7, 2)).await;
    d.ev(&a, remove(7, 3)).await;
    assert_eq!(d.at(&a, 1_000).await, vec![4.0], "the guess stands");
    // It stores them: the pod's reports are the truth from here on, guess settled.
    d.ev(&a, store(7, 1..4, 16)).await;
    d.ev(&a, remove(7, 3)).await;
    assert_eq!(
        d.at(&a, 2_000).await,
        vec![3.0],
        "an eviction after the store counts"
    );
    // Its hit's guess ended with the store (the request had pinned it): an eviction counts.
    d.ev(&a, remove(7, 0)).await;
    assert_eq!(d.at(&a, 2_000).await, vec![0.0]);
}

#[tokio::test]
async fn a_hit_evicted_while_its_request_queues_does_not_hide_the_blocks_guessed_past_it() {
    use crate::index::contract::{remove, store};
    let d = Doc::new(3, 6, 30_000);
    let a = pod("10.0.0.5:8000");
    // The pod holds the document's first three blocks; a request for all six is routed there.
    d.ev(&a, store(3, 0..3, 16)).await;
    d.record(&a, 6, 0).await;
    assert_eq!(d.at(&a, 0).await, vec![6.0]);
    // While it queues, the pod evicts the last block of the held prefix (LRU takes the tail).
    // The request computes it again; the next request must still see all six blocks there.
    d.ev(&a, remove(3, 2)).await;
    assert_eq!(
        d.at(&a, 1_000).await,
        vec![6.0],
        "the hole does not hide 3..6"
    );
    // It runs: it stores 2..6, which settles its hits' guesses; later evictions count.
    d.ev(&a, store(3, 2..6, 16)).await;
    assert_eq!(d.at(&a, 2_000).await, vec![6.0]);
    d.ev(&a, remove(3, 1)).await;
    assert_eq!(d.at(&a, 2_000).await, vec![1.0]);
    // A request that computes nothing gets no guess: nothing it stores would end one.
    d.record(&a, 1, 3_000).await;
    d.ev(&a, remove(3, 0)).await;
    assert_eq!(d.at(&a, 3_000).await, vec![0.0]);
}

#[tokio::test]
async fn a_hit_guess_ends_after_the_ttl_when_its_request_never_stores() {
    use crate::index::contract::{remove, store};
    let d = Doc::new(4, 3, 2_000);
    let a = pod("10.0.0.5:8000");
    d.ev(&a, store(4, 0..2, 16)).await;
    d.record(&a, 3, 0).await;
    d.ev(&a, remove(4, 0)).await;
    assert_eq!(d.at(&a, 1_999).await, vec![3.0]);
    assert_eq!(d.at(&a, 2_000).await, vec![0.0]);
    d.idx.sweep(2_000).await.unwrap();
    let inner = d.idx.inner.read();
    assert!(inner.pods.iter().all(|(_, p)| p.speculative.is_empty()));
}

#[tokio::test]
async fn unknown_parent_is_dropped() {
    let idx = EventIndex::new(EventIndexConfig::default());
    let a = pod("10.0.0.5:8000");
    let stats = idx
        .apply_events(&a, 0, MODEL, &fixture("02_block_stored_with_parent_int"))
        .await
        .unwrap();
    assert_eq!(stats.unknown_parent, 1);
    assert_eq!(idx.stats().entries, 0);
}

// ---- Property test against a reference model -------------------------------------------

const E: usize = 4; // engine block tokens (router blocks are 4 tokens too, or 8)

/// Documents sharing prefixes: doc d's block i has content `content(d, i)`.
fn content(doc: usize, i: usize) -> u32 {
    // Docs 0 and 1 share their first 2 blocks; doc 2 is unrelated.
    let owner = if doc == 1 && i < 2 { 0 } else { doc };
    (owner * 100 + i) as u32
}

fn doc_tokens(doc: usize, n: usize) -> Vec<u32> {
    (0..n)
        .flat_map(|i| (0..E as u32).map(move |t| content(doc, i) * 10 + t))
        .collect()
}

/// Engine hash of doc's block i: identifies the whole prefix.
fn ehash(doc: usize, i: usize) -> u64 {
    let ids: Vec<u32> = doc_tokens(doc, i + 1);
    token_keys(99, &ids, E, 100)[i].0
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        pod: usize,
        doc: usize,
        start: usize,
        n: usize,
        gpu: bool,
    },
    Remove {
        pod: usize,
        doc: usize,
        i: usize,
        gpu: bool,
    },
    Clear {
        pod: usize,
    },
    Lookup {
        doc: usize,
        n: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0usize..2, 0usize..3, 0usize..5, 1usize..4, prop::bool::weighted(0.8))
            .prop_map(|(pod, doc, start, n, gpu)| Op::Store { pod, doc, start, n, gpu }),
        3 => (0usize..2, 0usize..3, 0usize..6, prop::bool::weighted(0.8))
            .prop_map(|(pod, doc, i, gpu)| Op::Remove { pod, doc, i, gpu }),
        1 => (0usize..2).prop_map(|pod| Op::Clear { pod }),
        4 => (0usize..3, 1usize..7).prop_map(|(doc, n)| Op::Lookup { doc, n }),
    ]
}

/// Model: per pod, engine hash → (gpu, cpu) presence.
#[derive(Default, Clone)]
struct Model {
    pods: [HashMap<u64, (bool, bool)>; 2],
}

impl Model {
    fn lookup(&self, pod: usize, doc: usize, n_router: usize, router: usize) -> f64 {
        let mut total = 0.0;
        for rb in 0..n_router {
            // A router block is held when every engine block it ends in is held; with router
            // blocks of whole engine blocks, that is the engine block containing its end.
            let last_engine = ((rb + 1) * router) / E - 1;
            let w = match self.pods[pod].get(&ehash(doc, last_engine)) {
                Some((true, _)) => 1.0,
                Some((false, true)) => 0.8,
                _ => return total,
            };
            total += w;
        }
        total
    }
}

proptest! {
    #[test]
    fn event_index_matches_reference_model(ops in prop::collection::vec(op(), 1..50), router_mult in 1usize..3) {
        let router = E * router_mult;
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let idx = EventIndex::new(EventIndexConfig { block_tokens: router, ..EventIndexConfig::default() });
            let pods = [pod("p:0"), pod("p:1")];
            let mut model = Model::default();
            for op in ops {
                match op {
                    Op::Store { pod: p, doc, start, n, gpu } => {
                        let parent_ok = start == 0 || model.pods[p].contains_key(&ehash(doc, start - 1));
                        let tokens: Vec<u32> = doc_tokens(doc, start + n)[start * E..].to_vec();
                        let batch = KvEventBatch { ts: 0.0, data_parallel_rank: Some(0), events: vec![KvEvent::BlockStored {
                            block_hashes: (start..start + n).map(|i| BlockHash::Int(ehash(doc, i))).collect(),
                            parent_block_hash: (start > 0).then(|| BlockHash::Int(ehash(doc, start - 1))),
                            token_ids: tokens, block_size: E as u32, lora_id: None,
                            medium: Some(if gpu { "GPU" } else { "CPU" }.into()), lora_name: None,
                            extra_keys: None, group_idx: Some(0), kv_cache_spec_kind: None, kv_cache_spec_sliding_window: None,
                        }]};
                        idx.apply_events(&pods[p], 0, "m", &batch).await.unwrap();
                        // Router blocks can span a missing parent only when the parent chain
                        // is known; the model stores only when the parent is present.
                        if parent_ok && (router == E || start % router_mult == 0 || model.pods[p].contains_key(&ehash(doc, start - 1))) {
                            for i in start..start + n {
                                let e = model.pods[p].entry(ehash(doc, i)).or_insert((false, false));
                                if gpu { e.0 = true } else { e.1 = true }
                            }
                        }
                    }
                    Op::Remove { pod: p, doc, i, gpu } => {
                        let batch = KvEventBatch { ts: 0.0, data_parallel_rank: Some(0), events: vec![KvEvent::BlockRemoved {
                            block_hashes: vec![BlockHash::Int(ehash(doc, i))],
                            medium: Some(if gpu { "GPU" } else { "CPU" }.into()), group_idx: None,
                        }]};
                        idx.apply_events(&pods[p], 0, "m", &batch).await.unwrap();
                        let h = ehash(doc, i);
                        if let Some(e) = model.pods[p].get_mut(&h) {
                            if gpu { e.0 = false } else { e.1 = false }
                            if !e.0 && !e.1 { model.pods[p].remove(&h); }
                        }
                    }
                    Op::Clear { pod: p } => {
                        let batch = KvEventBatch { ts: 0.0, data_parallel_rank: Some(0), events: vec![KvEvent::AllBlocksCleared] };
                        idx.apply_events(&pods[p], 0, "m", &batch).await.unwrap();
                        model.pods[p].clear();
                    }
                    Op::Lookup { doc, n } => {
                        let tokens = doc_tokens(doc, n);
                        let k = token_keys(namespace_seed("m", None), &tokens, router, 100);
                        let got = idx.lookup(&k, &pods, 0).await.unwrap();
                        let want: Vec<f64> = (0..2).map(|p| model.lookup(p, doc, k.len(), router)).collect();
                        for (g, w) in got.iter().zip(&want) {
                            prop_assert!((g - w).abs() < 1e-9, "got {:?} want {:?}", got, want);
                        }
                    }
                }
            }
            let _ = HashSet::<u8>::new();
            Ok(())
        })?;
    }
}
