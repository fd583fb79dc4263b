//! Unit tests of LoRA adapter slots: loads, LRU eviction of idle adapters, waiting for a slot,
//! the load time on the prefill lane, and the label sets behind `vllm:lora_requests_info`.

use super::*;

const LOAD_US: u64 = 5_000;

fn engine(max_loras: usize, max_num_seqs: usize) -> Engine {
    Engine::new(EngineConfig {
        block_size: 4,
        num_gpu_blocks: 1024,
        max_num_seqs,
        ttft_base_us: 1_000.0,
        prefill_us_per_token: 10.0,
        decode_us_per_token: 100.0,
        decode_batch_slowdown: 0.0,
        prefill_chunk_tokens: 0,
    })
    .with_lora(LoraConfig {
        max_loras,
        load_us: LOAD_US as f64,
    })
}

/// A 100-token prompt (uncached prefill: 1000 µs) in namespace `seed`.
fn sub(seed: u64, max_tokens: u32) -> Submission {
    Submission::new(seed, (0..100).collect(), max_tokens, 4)
}

fn name(s: &str) -> Option<AdapterName> {
    Some(s.into())
}

/// Runs to completion; (first-token time, finish time) per request.
fn run(e: &mut Engine) -> HashMap<RequestId, (u64, u64)> {
    let mut first = HashMap::new();
    let mut done = HashMap::new();
    let mut guard = 0;
    loop {
        for out in e.step(e.now) {
            match out {
                Output::Token { id, index: 0, at } => {
                    first.insert(id, at);
                }
                Output::Token { .. } => {}
                Output::Finished { id, at, .. } => {
                    done.insert(id, (first[&id], at));
                }
            }
        }
        let Some(t) = e.next_event_time() else { break };
        e.advance(t);
        guard += 1;
        assert!(guard < 100_000, "engine does not terminate");
    }
    done
}

/// Runs one request for `adapter` alone, starting 1 s after the engine's current time.
fn serve(e: &mut Engine, id: RequestId, adapter: &str) -> (u64, u64) {
    let t0 = e.now + 1_000_000;
    e.submit_lora(t0, id, sub(id, 1), name(adapter));
    let (first, _) = run(e)[&id];
    (t0, first - t0)
}

fn resident(e: &Engine) -> Vec<String> {
    e.lora_info().expect("LoRA enabled").resident
}

/// The current label set: the newest timestamp.
fn current(e: &Engine) -> (String, String) {
    let info = e.lora_info().expect("LoRA enabled");
    let s = info
        .series
        .iter()
        .max_by_key(|s| s.at_us)
        .expect("a series");
    (s.running.clone(), s.waiting.clone())
}

#[test]
fn the_first_request_of_an_adapter_pays_the_load_then_it_is_resident() {
    let mut e = engine(2, 4);
    // Load + 100 uncached tokens × 10 µs + 1 ms.
    assert_eq!(serve(&mut e, 1, "a").1, LOAD_US + 1_000 + 1_000);
    assert_eq!(serve(&mut e, 2, "a").1, 1_000 + 1_000, "resident: no load");
    assert_eq!(
        serve(&mut e, 3, "b").1,
        LOAD_US + 2_000,
        "a free slot: load"
    );
    // The base model needs no slot.
    let t0 = e.now + 1_000_000;
    e.submit(t0, 4, sub(4, 1));
    assert_eq!(run(&mut e)[&4].0 - t0, 2_000);
    let s = e.stats();
    assert_eq!((s.lora_loads, s.lora_evictions), (2, 0));
    assert_eq!(resident(&e), ["b", "a"], "most recently used first");
}

#[test]
fn a_full_engine_evicts_the_least_recently_used_idle_adapter() {
    let mut e = engine(2, 4);
    serve(&mut e, 1, "a");
    serve(&mut e, 2, "b");
    serve(&mut e, 3, "a"); // a is now more recent than b
    assert_eq!(serve(&mut e, 4, "c").1, LOAD_US + 2_000);
    assert_eq!(resident(&e), ["c", "a"], "b was the least recently used");
    assert_eq!((e.stats().lora_loads, e.stats().lora_evictions), (3, 1));
    serve(&mut e, 5, "b");
    assert_eq!(resident(&e), ["b", "c"], "then a");
    assert_eq!((e.stats().lora_loads, e.stats().lora_evictions), (4, 2));
}

#[test]
fn a_request_waits_while_every_slot_is_busy_without_blocking_others() {
    let mut e = engine(1, 4);
    e.submit_lora(0, 1, sub(1, 3), name("a"));
    e.submit_lora(0, 2, sub(2, 1), name("b"));
    e.submit(0, 3, sub(3, 1));
    let s = e.stats();
    assert_eq!(
        (s.running, s.waiting),
        (2, 1),
        "b waits; the base request runs"
    );
    assert_eq!(current(&e), ("a".to_string(), "b".to_string()));
    let done = run(&mut e);
    // a: load 5000 + prefill 1000, first token at 7000, tokens every 100 µs: done at 7200.
    assert_eq!(done[&1], (7_000, 7_200));
    // The base request prefills after a on the lane (6000..7000).
    assert_eq!(done[&3].0, 8_000);
    // b starts when a's slot is idle (7200): load + prefill, + 1 ms.
    assert_eq!(done[&2].0, 7_200 + LOAD_US + 1_000 + 1_000);
    let s = e.stats();
    assert_eq!((s.lora_loads, s.lora_evictions), (2, 1));
    assert_eq!(current(&e), (String::new(), String::new()), "all done");
}

#[test]
fn requests_of_a_resident_adapter_share_its_slot() {
    let mut e = engine(1, 4);
    e.submit_lora(0, 1, sub(1, 5), name("a"));
    e.submit_lora(0, 2, sub(2, 5), name("a"));
    assert_eq!((e.stats().running, e.stats().waiting), (2, 0));
    let done = run(&mut e);
    // One load, paid by the first on the lane.
    assert_eq!(done[&1].0, LOAD_US + 2_000);
    assert_eq!(done[&2].0, LOAD_US + 1_000 + 2_000);
    assert_eq!(e.stats().lora_loads, 1);
}

#[test]
fn a_cancelled_waiting_request_leaves_the_labels() {
    let mut e = engine(1, 4);
    e.submit_lora(0, 1, sub(1, 50), name("a"));
    e.submit_lora(0, 2, sub(2, 1), name("b"));
    assert_eq!(current(&e).1, "b");
    assert!(e.cancel(10, 2));
    assert_eq!(current(&e), ("a".to_string(), String::new()));
    assert_eq!(e.stats().waiting, 0);
    run(&mut e);
    assert_eq!(e.stats().lora_loads, 1, "b was never loaded");
}

#[test]
fn label_sets_are_bounded_and_the_newest_is_current() {
    let mut e = engine(2, 4);
    for i in 0..(MAX_LORA_SERIES as u64 + 10) {
        serve(&mut e, i + 1, &format!("ad{i}"));
    }
    let info = e.lora_info().unwrap();
    assert!(
        info.series.len() <= MAX_LORA_SERIES,
        "{}",
        info.series.len()
    );
    let mut stamps: Vec<u64> = info.series.iter().map(|s| s.at_us).collect();
    stamps.sort_unstable();
    stamps.dedup();
    assert_eq!(stamps.len(), info.series.len(), "timestamps are distinct");
    assert_eq!(current(&e), (String::new(), String::new()));
    assert_eq!(info.max_loras, 2);
}

#[test]
fn without_lora_adapters_are_ignored() {
    let mut e = Engine::new(engine(1, 4).cfg.clone());
    e.submit_lora(0, 1, sub(1, 1), name("a"));
    e.submit_lora(0, 2, sub(2, 1), name("b"));
    let done = run(&mut e);
    assert_eq!(done[&1].0, 2_000, "no load time");
    assert_eq!(done[&2].0, 3_000, "no slot to wait for");
    assert_eq!(e.lora_info(), None);
    assert_eq!(e.stats().lora_loads, 0);
}

#[test]
fn a_restart_keeps_the_slots_configuration_but_not_the_adapters() {
    let mut e = engine(3, 4);
    serve(&mut e, 1, "a");
    let t = e.now + 10;
    e.restart(t);
    assert_eq!(resident(&e), Vec::<String>::new());
    assert_eq!(e.lora_info().unwrap().max_loras, 3);
    assert_eq!(serve(&mut e, 2, "a").1, LOAD_US + 2_000, "loaded again");
}
