//! The scheduler's unit tests (latency model, cache, timing histograms).

use super::*;

fn cfg() -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_gpu_blocks: 1024,
        max_num_seqs: 2,
        ttft_base_us: 1_000.0,
        prefill_us_per_token: 10.0,
        decode_us_per_token: 100.0,
        decode_batch_slowdown: 0.0,
        prefill_chunk_tokens: 0,
    }
}

fn sub(seed: u64, len: u32, max_tokens: u32) -> Submission {
    Submission::new(seed, (0..len).collect(), max_tokens, 4)
}

/// Runs the engine to completion; returns (first-token time, usage) per request id.
fn run(engine: &mut Engine) -> HashMap<RequestId, (u64, Usage)> {
    let mut first = HashMap::new();
    let mut done = HashMap::new();
    let mut guard = 0;
    loop {
        for out in engine.step(engine.now) {
            match out {
                Output::Token { id, index: 0, at } => {
                    first.insert(id, at);
                }
                Output::Token { .. } => {}
                Output::Finished { id, usage, .. } => {
                    done.insert(id, (first[&id], usage));
                }
            }
        }
        let Some(t) = engine.next_event_time() else {
            break;
        };
        engine.advance(t);
        guard += 1;
        assert!(guard < 100_000, "engine does not terminate");
    }
    done
}

#[test]
fn cached_prompt_has_lower_ttft() {
    let mut e = Engine::new(cfg());
    e.submit(0, 1, sub(7, 402, 3));
    let a = run(&mut e)[&1];
    let t0 = e.now + 1_000_000;
    e.submit(t0, 2, sub(7, 402, 3));
    let b = run(&mut e)[&2];
    // 402 tokens: 100 full blocks, all hit on the second run.
    assert_eq!(a.1.cached_tokens, 0);
    assert_eq!(b.1.cached_tokens, 400);
    assert_eq!(a.0, 402 * 10 + 1_000);
    assert_eq!(b.0 - t0, 2 * 10 + 1_000);
    assert_eq!(b.1.prompt_tokens, 402);
    assert_eq!(b.1.completion_tokens, 3);
    // A different namespace does not hit.
    let t1 = e.now + 1_000_000;
    e.submit(t1, 3, sub(8, 402, 3));
    assert_eq!(run(&mut e)[&3].1.cached_tokens, 0);
    let s = e.stats();
    assert_eq!(s.prefix_cache_queries, 3 * 402);
    assert_eq!(s.prefix_cache_hits, 400);
    assert_eq!(s.generation_tokens, 9);
    assert_eq!(s.finished_length, 3);
    assert_eq!((s.running, s.waiting, s.kv_cache_usage), (0, 0, 0.0));
}

#[test]
fn a_restart_drops_the_cache_and_hands_back_unfinished_requests() {
    let mut e = Engine::new(cfg());
    e.submit(0, 1, sub(7, 402, 3));
    run(&mut e);
    e.drain_cache_events();
    let t = e.now + 1_000;
    e.submit(t, 2, sub(7, 402, 3));
    e.submit(t, 3, sub(8, 40, 3));
    let lost = e.restart(t + 10);
    assert_eq!(
        lost.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        vec![2, 3]
    );
    assert_eq!(
        e.drain_cache_events().last(),
        Some(&CacheEvent::AllBlocksCleared)
    );
    assert_eq!(e.stats().prefix_cache_queries, 0, "counters restart too");
    for (id, s) in lost {
        e.submit(t + 10, id, s);
    }
    let done = run(&mut e);
    assert_eq!(
        done[&2].1.cached_tokens, 0,
        "the retried prompt finds no cache"
    );
    assert!(done[&2].0 > t + 10);
}

#[test]
fn last_token_is_never_a_hit() {
    let mut e = Engine::new(cfg());
    e.submit(0, 1, sub(7, 16, 1));
    run(&mut e);
    e.submit(e.now, 2, sub(7, 16, 1));
    // 16 tokens = 4 full blocks, but only 15 may hit: 3 blocks.
    assert_eq!(run(&mut e)[&2].1.cached_tokens, 12);
}

#[test]
fn prefills_share_one_lane_and_excess_requests_wait() {
    let mut e = Engine::new(cfg());
    for id in 0..3 {
        e.submit(0, id, sub(100 + id, 100, 2));
    }
    let s = e.stats();
    assert_eq!((s.running, s.waiting), (2, 1));
    let done = run(&mut e);
    // Lane: request 0 prefills 0..1000, request 1 1000..2000.
    assert_eq!(done[&0].0, 1_000 + 1_000);
    assert_eq!(done[&1].0, 2_000 + 1_000);
    // Request 2 waits for a slot: request 0 finishes at 2000 + 100, then prefills.
    assert_eq!(done[&2].0, 2_100 + 1_000 + 1_000);
}

#[test]
fn decode_slows_down_with_batch() {
    let mut c = cfg();
    c.decode_batch_slowdown = 0.5;
    c.ttft_base_us = 0.0;
    c.prefill_us_per_token = 0.0;
    let mut e = Engine::new(c);
    e.submit(0, 1, sub(1, 8, 2));
    let mut times = Vec::new();
    loop {
        for out in e.step(e.now) {
            if let Output::Token { at, .. } = out {
                times.push(at);
            }
        }
        match e.next_event_time() {
            Some(t) => e.advance(t),
            None => break,
        }
    }
    // One running request: 100 × (1 + 0.5 × 1).
    assert_eq!(times, vec![0, 150]);
}

#[test]
fn a_running_prefill_stalls_decode_by_one_chunk_per_step() {
    let times = |chunk: usize| {
        let mut c = cfg();
        c.ttft_base_us = 0.0;
        c.prefill_chunk_tokens = chunk;
        let mut e = Engine::new(c);
        // Request 1 (4 tokens) prefills 0..40 µs and decodes; request 2 (1000 tokens) prefills
        // 40..10_040 µs on the lane meanwhile.
        e.submit(0, 1, sub(1, 4, 4));
        e.submit(0, 2, sub(2, 1000, 1));
        let mut out = Vec::new();
        loop {
            for o in e.step(e.now) {
                if let Output::Token { id: 1, at, .. } = o {
                    out.push(at);
                }
            }
            match e.next_event_time() {
                Some(t) => e.advance(t),
                None => break,
            }
        }
        out
    };
    // No chunking: tokens every 100 µs whatever the lane does.
    assert_eq!(times(0), vec![40, 140, 240, 340]);
    // 256-token chunks at 10 µs/token: each step while request 2 prefills takes 2,560 µs more.
    assert_eq!(times(256), vec![40, 2_700, 5_360, 8_020]);
    // A chunk never stalls past the end of the prefill it belongs to.
    assert_eq!(times(4096), vec![40, 10_140, 10_240, 10_340]);
}

#[test]
fn eviction_at_capacity_emits_events() {
    let mut c = cfg();
    c.num_gpu_blocks = 8;
    let mut e = Engine::new(c);
    e.submit(0, 1, sub(1, 20, 1)); // 5 blocks
    run(&mut e);
    e.submit(e.now, 2, sub(2, 20, 1)); // 5 more: evicts 2 of request 1's
    run(&mut e);
    let events = e.drain_cache_events();
    let removed: Vec<_> = events
        .iter()
        .filter_map(|ev| match ev {
            CacheEvent::BlockRemoved { block_hashes } => Some(block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    let first = sub(1, 20, 1).keys;
    // Tail blocks of request 1 go first (the partial decode block reserve may take one more).
    assert!(removed.len() >= 2);
    assert_eq!(removed[0], first[4]);
    assert_eq!(removed[1], first[3]);
    assert!(e.cache().len() <= 8);
    e.submit(e.now, 3, sub(1, 20, 1));
    assert!(run(&mut e)[&3].1.cached_tokens < 16);
    let stored = events
        .iter()
        .filter(|ev| matches!(ev, CacheEvent::BlockStored { .. }))
        .count();
    assert_eq!(stored, 2);
}

#[test]
fn reset_clears_and_cancel_frees_the_slot() {
    let mut e = Engine::new(cfg());
    e.submit(0, 1, sub(1, 40, 1));
    run(&mut e);
    assert!(e.reset_prefix_cache(e.now));
    assert_eq!(
        e.drain_cache_events().last(),
        Some(&CacheEvent::AllBlocksCleared)
    );
    e.submit(e.now, 2, sub(1, 40, 1000));
    e.submit(e.now, 3, sub(2, 40, 1000));
    e.submit(e.now, 4, sub(3, 40, 1));
    assert_eq!(e.stats().waiting, 1);
    // Running requests pin blocks: reset is refused.
    let t = e.now + 5_000;
    assert!(!e.reset_prefix_cache(t));
    assert!(e.cancel(t, 2));
    assert!(!e.cancel(t, 2));
    let s = e.stats();
    assert_eq!((s.running, s.waiting, s.aborted), (2, 0, 1));
    assert!(e.cancel(t, 3));
    let done = run(&mut e);
    assert_eq!(done[&4].1.cached_tokens, 0);
    assert_eq!(e.stats().kv_cache_usage, 0.0);
    assert_eq!(e.cache().pinned(), 0);
}

#[test]
fn deterministic_and_kv_usage_tracks_running_blocks() {
    let trace = || {
        let mut e = Engine::new(cfg());
        let mut log = Vec::new();
        for id in 0..5u64 {
            e.submit(id * 300, id, sub(id % 2, 30 + id as u32, 3));
            log.extend(e.step(id * 300));
        }
        while let Some(t) = e.next_event_time() {
            log.extend(e.step(t));
        }
        (log, e.drain_cache_events())
    };
    assert_eq!(trace(), trace());

    let mut e = Engine::new(cfg());
    // 30 prompt tokens = 8 blocks (7 full + 1 partial) of 4 tokens, out of 1024.
    e.submit(0, 1, sub(1, 30, 10));
    e.step(0);
    assert_eq!(e.stats().kv_cache_usage, 8.0 / 1024.0);
    // After 3 tokens: 33 tokens = 9 blocks.
    let mut tokens = 0;
    while tokens < 3 {
        let t = e.next_event_time().unwrap();
        tokens += e
            .step(t)
            .iter()
            .filter(|o| matches!(o, Output::Token { .. }))
            .count();
    }
    assert_eq!(e.stats().kv_cache_usage, 9.0 / 1024.0);
    assert_eq!(e.stats().running, 1);
}

#[test]
fn timing_histograms_follow_the_lane() {
    let mut e = Engine::new(cfg());
    // Two uncached 100-token prompts at once: the lane takes 0..1000, then 1000..2000.
    e.submit(0, 1, sub(1, 100, 2));
    e.submit(0, 2, sub(2, 100, 2));
    let done = run(&mut e);
    assert_eq!((done[&1].0, done[&2].0), (2_000, 3_000));
    let s = e.stats();
    // Request 1: queue 0, prefill 100 × 10 + 1000; request 2 also waits request 1's lane time.
    assert_eq!((s.queue_time.count, s.queue_time.sum_us), (2, 1_000));
    assert_eq!((s.prefill_time.count, s.prefill_time.sum_us), (2, 4_000));
    assert_eq!((s.ttft.count, s.ttft.sum_us), (2, 5_000));
    // All queue times ≤ 0.3 s; TTFTs of 2 and 3 ms fall in le=0.005.
    assert_eq!(s.queue_time.buckets[0], 2);
    assert_eq!(s.ttft.buckets[..3], [0, 2, 0]);
    assert_eq!(s.prefill_uncached_tokens, 200);
    let t = s.timing();
    assert_eq!(t.prefill_tokens, 200.0);
    assert_eq!((t.prefills, t.prefill_seconds), (2.0, 0.004));
    assert_eq!((t.queued, t.queue_seconds), (2.0, 0.001));

    // A cached prompt: only its uncached tokens count, and its prefill is shorter.
    let t0 = e.now + 1_000_000;
    e.submit(t0, 3, sub(1, 100, 2));
    run(&mut e);
    let s = e.stats();
    // 100 tokens = 25 blocks; 24 hit (the last token is recomputed): 4 uncached tokens.
    assert_eq!(s.prefill_uncached_tokens, 204);
    assert_eq!(s.prefill_time.sum_us, 4_000 + 4 * 10 + 1_000);
    assert_eq!(s.timing().prefill_tokens, 204.0);
}

#[test]
fn a_request_cancelled_before_its_first_token_records_no_timing() {
    let mut e = Engine::new(cfg());
    e.submit(0, 1, sub(1, 100, 2));
    // Its prefill finished at 1000; the first token is due at 2000.
    e.step(1_500);
    assert!(e.cancel(1_500, 1));
    e.submit(1_500, 2, sub(2, 100, 2));
    assert!(e.cancel(1_600, 2), "cancelled mid-prefill");
    run(&mut e);
    let s = e.stats();
    assert_eq!(
        s.prompt_tokens, 100,
        "vLLM's counter counts the finished prefill"
    );
    assert_eq!(s.prefill_uncached_tokens, 0);
    assert_eq!(s.timing(), kv_router::pods::EngineTiming::default());
    assert_eq!((s.ttft, s.queue_time, s.prefill_time), Default::default());
}

#[test]
fn histogram_bounds_are_inclusive() {
    let mut h = Histogram::<21>::default();
    h.observe(300_000, &REQUEST_LATENCY_BUCKETS_US);
    h.observe(300_001, &REQUEST_LATENCY_BUCKETS_US);
    h.observe(10_000_000_000, &REQUEST_LATENCY_BUCKETS_US);
    assert_eq!(h.buckets[..2], [1, 1]);
    assert_eq!(
        h.buckets.iter().sum::<u64>(),
        2,
        "above the last bound: +Inf only"
    );
    assert_eq!((h.count, h.sum_us), (3, 10_000_600_001));
}

#[test]
fn huge_prompt_is_linear() {
    let mut c = cfg();
    c.block_size = 16;
    c.num_gpu_blocks = 2048;
    c.prefill_us_per_token = 0.0;
    let mut e = Engine::new(c);
    let tokens: Vec<u32> = (0..1_000_000).collect();
    e.submit(0, 1, Submission::new(1, tokens.clone(), 2, 16));
    let u = run(&mut e)[&1].1;
    assert_eq!(u.prompt_tokens, 1_000_000);
    e.submit(e.now, 2, Submission::new(1, tokens, 2, 16));
    assert!(run(&mut e)[&2].1.cached_tokens > 0);
}
