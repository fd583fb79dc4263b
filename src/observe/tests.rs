use super::*;

fn usage(cached: Option<u64>, prompt: Option<u64>) -> Usage {
    Usage {
        cached_tokens: cached,
        prompt_tokens: prompt,
    }
}

#[test]
fn a_shortfall_past_one_block_or_a_tenth_of_the_prompt_is_incorrect() {
    // 512-token prompt, 480 predicted: the tolerance is 51 tokens (a tenth; a block is 16).
    let j = |cached| judge(480, 512, 16, usage(Some(cached), Some(512))).unwrap();
    assert!(!j(480).incorrect && !j(430).incorrect);
    assert_eq!(j(430).tolerance_tokens, 51);
    assert!(j(428).incorrect, "52 short of 480");
    assert!(j(0).incorrect);
    // More than predicted is never incorrect.
    assert!(!j(511).incorrect);
    // Nothing predicted: nothing to fall short of.
    assert!(
        !judge(0, 512, 16, usage(Some(0), Some(512)))
            .unwrap()
            .incorrect
    );
    // Short prompts: one block is the tolerance.
    let o = judge(48, 64, 16, usage(Some(32), Some(64))).unwrap();
    assert_eq!((o.tolerance_tokens, o.incorrect), (16, false));
    assert!(
        judge(48, 64, 16, usage(Some(31), Some(64)))
            .unwrap()
            .incorrect
    );
}

#[test]
fn the_prediction_is_held_in_the_engines_tokens() {
    // The router estimated 1000 prompt tokens where the engine counted 500: 800 predicted
    // becomes 400 expected, with 50 tokens of tolerance.
    let o = judge(800, 1000, 16, usage(Some(360), Some(500))).unwrap();
    assert_eq!((o.expected_cached_tokens, o.tolerance_tokens), (400, 50));
    assert!(!o.incorrect);
    assert!(
        judge(800, 1000, 16, usage(Some(349), Some(500)))
            .unwrap()
            .incorrect
    );
    // No engine prompt count: the router's own, unscaled.
    let o = judge(800, 1000, 16, usage(Some(700), None)).unwrap();
    assert_eq!((o.expected_cached_tokens, o.incorrect), (800, false));
    assert!(
        judge(800, 1000, 16, usage(Some(699), None))
            .unwrap()
            .incorrect
    );
}

#[test]
fn no_cached_count_is_not_judged() {
    assert_eq!(judge(480, 512, 16, usage(None, Some(512))), None);
}

fn summary(id: u64) -> Summary {
    Summary {
        id,
        at_unix_ms: 1,
        model: None,
        pod: PodId::new("10.0.0.5:8000"),
        reason: Reason::Scored,
        prompt_tokens: 100,
        block_tokens: 16,
        predicted_cached_tokens: 64,
        best_other: None,
        candidates: Vec::new(),
        observed: None,
    }
}

#[test]
fn the_ring_keeps_the_last_decisions_by_id() {
    let ring = Recent::new(4);
    let start = u64::MAX - 5; // ids wrap
    for i in 0..8u64 {
        ring.record(summary(start.wrapping_add(i)));
    }
    for i in 0..4u64 {
        assert!(
            ring.get(start.wrapping_add(i)).is_none(),
            "{i} was replaced"
        );
    }
    for i in 4..8u64 {
        assert_eq!(
            ring.get(start.wrapping_add(i)).unwrap().id,
            start.wrapping_add(i)
        );
    }
    let o = judge(64, 100, 16, usage(Some(0), Some(100))).unwrap();
    ring.observe(start.wrapping_add(7), o);
    ring.observe(start, o); // gone: nothing to add to
    assert_eq!(ring.get(start.wrapping_add(7)).unwrap().observed, Some(o));
    assert_eq!(ring.get(start.wrapping_add(6)).unwrap().observed, None);
}

#[test]
fn the_receipt_names_the_decision_pod_prediction_and_reason_only() {
    let r = summary(0xab).receipt();
    assert_eq!(
        r,
        "id=00000000000000ab; pod=10.0.0.5:8000; predicted_cached_tokens=64; prompt_tokens=100; reason=scored"
    );
    let v = serde_json::to_value(summary(0xab)).unwrap();
    assert_eq!(v["id"], "00000000000000ab");
}
