//! The checks of the conformance suite, one behaviour each, in the order they run.

use futures::future::BoxFuture;

use super::{
    clear, doc_keys, ensure, ensure_eq, k, pod, pods, remove, store, Check, Needs, Outcome, Probe,
};
use crate::index::IndexStats;

/// Every check.
pub(super) const ALL: &[Check] = &[
    Check {
        name: "record_then_lookup_counts_the_consecutive_prefix",
        needs: Needs::Nothing,
        run: record_then_lookup_counts_the_consecutive_prefix,
    },
    Check {
        name: "forget_pod_drops_that_pod_only",
        needs: Needs::Nothing,
        run: forget_pod_drops_that_pod_only,
    },
    Check {
        name: "freed_slots_carry_nothing_over",
        needs: Needs::Nothing,
        run: freed_slots_carry_nothing_over,
    },
    Check {
        name: "recorded_entries_expire_after_the_ttl",
        needs: Needs::Nothing,
        run: recorded_entries_expire_after_the_ttl,
    },
    Check {
        name: "capacity_evicts_least_recent_and_keeps_prompt_heads",
        needs: Needs::Nothing,
        run: capacity_evicts_least_recent_and_keeps_prompt_heads,
    },
    Check {
        name: "recording_the_same_keys_again_changes_nothing",
        needs: Needs::Nothing,
        run: recording_the_same_keys_again_changes_nothing,
    },
    Check {
        name: "recorded_size_stays_bounded",
        needs: Needs::Nothing,
        run: recorded_size_stays_bounded,
    },
    Check {
        name: "set_capacity_shrinks_a_pod",
        needs: Needs::SetCapacity,
        run: set_capacity_shrinks_a_pod,
    },
    Check {
        name: "stored_blocks_match_until_removed_or_cleared",
        needs: Needs::Events,
        run: stored_blocks_match_until_removed_or_cleared,
    },
    Check {
        name: "replayed_events_change_nothing",
        needs: Needs::Events,
        run: replayed_events_change_nothing,
    },
    Check {
        name: "stored_blocks_outlive_the_record_ttl",
        needs: Needs::Events,
        run: stored_blocks_outlive_the_record_ttl,
    },
    Check {
        name: "forget_rank_keeps_other_ranks",
        needs: Needs::Events,
        run: forget_rank_keeps_other_ranks,
    },
    Check {
        name: "event_fed_size_stays_bounded",
        needs: Needs::Events,
        run: event_fed_size_stays_bounded,
    },
];

fn record_then_lookup_counts_the_consecutive_prefix(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let p = pods(3);
        ix.record(&p[0], &k(&[1, 2, 3]), 0).await?;
        ix.record(&p[1], &k(&[1, 3]), 0).await?;
        ensure_eq!(
            ix.lookup(&k(&[1, 2, 3, 4]), &p, 1).await?,
            vec![3.0, 1.0, 0.0],
            "[1,2,3,4] over (holds 1-3, holds 1 and 3, unknown)"
        );
        ensure_eq!(
            ix.lookup(&k(&[2, 3]), &p[..2], 1).await?,
            vec![2.0, 0.0],
            "a pod missing the first key matches nothing"
        );
        ensure_eq!(
            ix.lookup(&k(&[1, 2]), &[p[1].clone(), p[0].clone()], 1)
                .await?,
            vec![1.0, 2.0],
            "answers follow the candidates' order"
        );
        ensure_eq!(ix.lookup(&[], &p, 1).await?, vec![0.0; 3], "no keys");
        ensure_eq!(
            ix.lookup(&k(&[1]), &[], 1).await?,
            Vec::<f64>::new(),
            "no candidates"
        );
        Ok(())
    })
}

fn forget_pod_drops_that_pod_only(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let (p, bt) = (pods(2), ix.s.block_tokens);
        ix.record(&p[0], &k(&[1, 2]), 0).await?;
        ix.record(&p[1], &k(&[1]), 0).await?;
        if ix.caps.events {
            ix.apply(&p[0], 0, &store(1, 0..2, bt)).await?;
            ix.apply(&p[1], 0, &store(1, 0..1, bt)).await?;
        }
        ix.forget(&p[0]).await?;
        ix.forget(&pod(99)).await?;
        ensure_eq!(
            ix.lookup(&k(&[1, 2]), &p, 1).await?,
            vec![0.0, 1.0],
            "recorded keys after forgetting the first pod"
        );
        let mut want = IndexStats::default();
        if ix.caps.records_in_stats {
            want.keys += 1;
            want.entries += 1;
            want.pods = 1;
        }
        if ix.caps.events {
            ensure_eq!(
                ix.lookup(&doc_keys(1, 2, bt), &p, 1).await?,
                vec![0.0, 1.0],
                "stored blocks after forgetting the first pod"
            );
            want.keys += 1;
            want.entries += 1;
            want.pods = 1;
        }
        ensure_eq!(ix.stats(), want, "stats after forgetting the first pod");
        ix.record(&p[0], &k(&[5]), 2).await?;
        ensure_eq!(
            ix.lookup(&k(&[1]), &p[..1], 3).await?,
            vec![0.0],
            "a returning pod starts empty"
        );
        Ok(())
    })
}

fn freed_slots_carry_nothing_over(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let bt = ix.s.block_tokens;
        let keeper = pod(1000);
        ix.record(&keeper, &k(&[7, 8]), 0).await?;
        for round in 0..3u64 {
            let churn: Vec<_> = (0..20).map(|i| pod(round as usize * 20 + i)).collect();
            for (i, p) in churn.iter().enumerate() {
                let base = 100 * (round * 20 + i as u64 + 1);
                ix.record(p, &k(&[base, base + 1]), 0).await?;
                if ix.caps.events {
                    ix.apply(p, 0, &store(base, 0..1, bt)).await?;
                }
            }
            for p in &churn {
                ix.forget(p).await?;
            }
            // Newcomers take the freed slots: they must not inherit anything.
            let fresh = pod(5000 + round as usize);
            ix.record(&fresh, &k(&[9]), 0).await?;
            for i in 0..20u64 {
                let base = 100 * (round * 20 + i + 1);
                ensure_eq!(
                    ix.held(&fresh, &k(&[base, base + 1]), 1).await?,
                    0.0,
                    "round {round}: a new pod sees a departed pod's keys {base}.."
                );
                if ix.caps.events {
                    ensure_eq!(
                        ix.lookup(&doc_keys(base, 1, bt), std::slice::from_ref(&fresh), 1)
                            .await?,
                        vec![0.0],
                        "round {round}: a new pod sees a departed pod's block"
                    );
                }
            }
            ix.forget(&fresh).await?;
            ensure_eq!(
                ix.lookup(&k(&[7, 8]), std::slice::from_ref(&keeper), 1)
                    .await?,
                vec![2.0],
                "round {round}: churn around it disturbed a staying pod"
            );
        }
        ix.forget(&keeper).await?;
        ensure_eq!(
            ix.stats(),
            IndexStats::default(),
            "every pod forgotten, yet"
        );
        Ok(())
    })
}

fn recorded_entries_expire_after_the_ttl(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let (p, ttl) = (pod(0), ix.s.ttl_ms);
        let one = std::slice::from_ref(&p);
        ix.record(&p, &k(&[1, 2]), 0).await?;
        ensure_eq!(
            ix.lookup(&k(&[1, 2]), one, ttl - 1).await?,
            vec![2.0],
            "just before the TTL"
        );
        ensure_eq!(
            ix.lookup(&k(&[1, 2]), one, ttl).await?,
            vec![0.0],
            "at the TTL"
        );
        // Recording refreshes: key 1 now lives until 500 + ttl, key 2 still until ttl.
        ix.record(&p, &k(&[1]), 500).await?;
        ensure_eq!(
            ix.lookup(&k(&[1, 2]), one, ttl).await?,
            vec![1.0],
            "after refreshing key 1 only"
        );
        ix.sweep(ttl).await?;
        ensure_eq!(
            ix.lookup(&k(&[1, 2]), one, ttl + 1).await?,
            vec![1.0],
            "a sweep keeps live entries"
        );
        if ix.caps.records_in_stats {
            ensure_eq!(ix.stats().entries, 1, "entries after sweeping key 2");
        }
        ix.sweep(500 + ttl).await?;
        ensure_eq!(
            ix.lookup(&k(&[1]), one, 500 + ttl).await?,
            vec![0.0],
            "after both expired"
        );
        if ix.caps.records_in_stats {
            ensure_eq!(ix.stats(), IndexStats::default(), "after sweeping all");
        }
        ix.record(&p, &k(&[3]), 2 * ttl).await?;
        ensure_eq!(
            ix.lookup(&k(&[3]), one, 2 * ttl).await?,
            vec![1.0],
            "recording after a sweep"
        );
        Ok(())
    })
}

fn capacity_evicts_least_recent_and_keeps_prompt_heads(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let (p, cap) = (pod(0), ix.s.capacity as u64);
        let one = std::slice::from_ref(&p);
        let first: Vec<u64> = (1..=cap).collect();
        ix.record(&p, &k(&first), 0).await?;
        ensure_eq!(
            ix.lookup(&k(&first), one, 1).await?,
            vec![cap as f64],
            "a full pod"
        );
        // Three more keys push out three: the tail of the first prompt, not its head.
        ix.record(&p, &k(&[100, 101, 102]), 1).await?;
        ensure_eq!(
            ix.lookup(&k(&[100, 101, 102]), one, 2).await?,
            vec![3.0],
            "the newest prompt"
        );
        ensure_eq!(
            ix.lookup(&k(&first), one, 2).await?,
            vec![(cap - 3) as f64],
            "the first prompt keeps its head"
        );
        let mut all = first.clone();
        all.extend([100, 101, 102]);
        ensure_eq!(ix.held(&p, &k(&all), 2).await?, cap as f64, "keys held");
        if ix.caps.records_in_stats {
            ensure_eq!(ix.stats().entries, cap as usize, "entries");
        }
        Ok(())
    })
}

fn recording_the_same_keys_again_changes_nothing(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let p = pods(2);
        let keys = k(&[1, 2, 3]);
        ix.record(&p[0], &keys, 10).await?;
        ix.record(&p[1], &keys[..1], 10).await?;
        let (before, stats) = (ix.lookup(&keys, &p, 11).await?, ix.stats());
        // The same decision arriving twice (a retry, a second replica) is one decision.
        ix.record(&p[0], &keys, 10).await?;
        ix.record(&p[1], &keys[..1], 10).await?;
        ensure_eq!(ix.lookup(&keys, &p, 11).await?, before, "lookups");
        ensure_eq!(ix.stats(), stats, "stats");
        Ok(())
    })
}

fn recorded_size_stays_bounded(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let (cap, n) = (ix.s.capacity as u64, 4);
        let p = pods(n);
        for round in 0..5 {
            for (i, q) in p.iter().enumerate() {
                let base = round * cap + i as u64;
                let keys: Vec<u64> = (base..base + 2 * cap).collect();
                ix.record(q, &k(&keys), round).await?;
            }
        }
        let every: Vec<u64> = (0..7 * cap + n as u64).collect();
        for q in &p {
            let held = ix.held(q, &k(&every), 6).await?;
            ensure!(held <= cap as f64, "{q} holds {held} keys, capacity {cap}");
        }
        if ix.caps.records_in_stats {
            let s = ix.stats();
            ensure!(
                s.entries <= n * cap as usize && s.keys <= s.entries,
                "stats {s:?} over {n} pods × capacity {cap}"
            );
        }
        Ok(())
    })
}

fn set_capacity_shrinks_a_pod(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let p = pods(2);
        ix.record(&p[0], &k(&[1, 2, 3]), 0).await?;
        ix.record(&p[0], &k(&[20, 21, 22]), 1).await?;
        ix.set_capacity(&p[0], 2).await?;
        ensure_eq!(
            ix.lookup(&k(&[20, 21, 22]), &p[..1], 2).await?,
            vec![2.0],
            "the two most recent keys stay"
        );
        ensure_eq!(
            ix.held(&p[0], &k(&[1, 2, 3, 22]), 2).await?,
            0.0,
            "older keys go"
        );
        // A capacity set before the pod's first record bounds it too.
        ix.set_capacity(&p[1], 3).await?;
        ix.record(&p[1], &k(&(1..=10).collect::<Vec<_>>()), 3)
            .await?;
        ensure_eq!(
            ix.lookup(&k(&[1, 2, 3, 4]), &p[1..], 4).await?,
            vec![3.0],
            "a pod capped at 3 before its first record"
        );
        if ix.caps.records_in_stats {
            ensure_eq!(ix.stats().entries, 5, "entries");
        }
        Ok(())
    })
}

fn stored_blocks_match_until_removed_or_cleared(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let (p, bt) = (pods(2), ix.s.block_tokens);
        let a = doc_keys(1, 5, bt);
        ix.apply(&p[0], 0, &store(1, 0..2, bt)).await?;
        ix.apply(&p[0], 0, &store(1, 2..4, bt)).await?;
        ix.apply(&p[1], 0, &store(1, 0..1, bt)).await?;
        ensure_eq!(ix.lookup(&a, &p, 0).await?, vec![4.0, 1.0], "after stores");
        ix.apply(&p[0], 0, &remove(1, 2)).await?;
        ensure_eq!(
            ix.lookup(&a, &p, 0).await?,
            vec![2.0, 1.0],
            "after removing block 2"
        );
        ensure_eq!(
            ix.stats(),
            IndexStats {
                keys: 3,
                entries: 4,
                pods: 2
            },
            "stats after the removal"
        );
        // A store whose parent the pod never announced cannot be keyed.
        ix.apply(&p[1], 0, &store(2, 1..2, bt)).await?;
        ensure_eq!(
            ix.held(&p[1], &doc_keys(2, 2, bt), 0).await?,
            0.0,
            "blocks chained to an unknown parent"
        );
        ix.apply(&p[0], 0, &clear()).await?;
        ensure_eq!(ix.lookup(&a, &p, 0).await?, vec![0.0, 1.0], "after a clear");
        ix.apply(&p[1], 0, &remove(1, 0)).await?;
        ensure_eq!(ix.stats(), IndexStats::default(), "after removing all");
        Ok(())
    })
}

fn replayed_events_change_nothing(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let (p, bt) = (pods(2), ix.s.block_tokens);
        let a = doc_keys(1, 3, bt);
        let stream = [store(1, 0..2, bt), store(1, 2..3, bt), remove(1, 1)];
        for b in &stream {
            ix.apply(&p[0], 0, b).await?;
        }
        let (once, stats) = (ix.lookup(&a, &p[..1], 0).await?, ix.stats());
        ensure_eq!(once, vec![1.0], "the stream applied once");
        // The whole stream again (a replay after a reconnect) ...
        for b in &stream {
            ix.apply(&p[0], 0, b).await?;
        }
        ensure_eq!(ix.lookup(&a, &p[..1], 0).await?, once, "after a replay");
        ensure_eq!(ix.stats(), stats, "stats after a replay");
        // ... or each batch delivered twice gives what one delivery gives.
        for b in &stream {
            ix.apply(&p[1], 0, b).await?;
            ix.apply(&p[1], 0, b).await?;
        }
        ensure_eq!(ix.lookup(&a, &p[1..], 0).await?, once, "each batch twice");
        // A block announced twice is still held once: one removal drops it.
        ix.apply(&p[0], 0, &remove(1, 0)).await?;
        ensure_eq!(
            ix.lookup(&a, &p, 0).await?,
            vec![0.0, 1.0],
            "one removal after duplicate stores"
        );
        Ok(())
    })
}

fn stored_blocks_outlive_the_record_ttl(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let (p, bt, ttl) = (pod(0), ix.s.block_tokens, ix.s.ttl_ms);
        let a = doc_keys(1, 2, bt);
        ix.apply(&p, 0, &store(1, 0..2, bt)).await?;
        ix.record(&p, &a, 0).await?;
        ix.sweep(100 * ttl).await?;
        ensure_eq!(
            ix.lookup(&a, std::slice::from_ref(&p), 100 * ttl).await?,
            vec![2.0],
            "stored blocks long after the TTL and a sweep"
        );
        Ok(())
    })
}

fn forget_rank_keeps_other_ranks(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let (p, bt) = (pod(0), ix.s.block_tokens);
        let one = std::slice::from_ref(&p);
        ix.apply(&p, 0, &store(1, 0..2, bt)).await?;
        ix.apply(&p, 1, &store(2, 0..2, bt)).await?;
        ensure_eq!(
            ix.lookup(&doc_keys(2, 2, bt), one, 0).await?,
            vec![2.0],
            "rank 1's blocks"
        );
        ix.forget_rank(&p, 1).await?;
        ensure_eq!(
            ix.lookup(&doc_keys(2, 2, bt), one, 0).await?,
            vec![0.0],
            "rank 1's blocks after its reset"
        );
        ensure_eq!(
            ix.lookup(&doc_keys(1, 2, bt), one, 0).await?,
            vec![2.0],
            "rank 0's blocks after rank 1's reset"
        );
        // The same engine hash on two ranks names two blocks: clearing one rank keeps the other.
        ix.apply(&p, 1, &store(1, 0..2, bt)).await?;
        ix.apply(&p, 1, &clear()).await?;
        ensure_eq!(
            ix.lookup(&doc_keys(1, 2, bt), one, 0).await?,
            vec![2.0],
            "rank 0's copy after clearing rank 1"
        );
        Ok(())
    })
}

fn event_fed_size_stays_bounded(ix: Probe<'_>) -> BoxFuture<'_, Outcome> {
    Box::pin(async move {
        let (p, bt, cap) = (pods(2), ix.s.block_tokens, ix.s.capacity);
        // One batch past the budget, and the same in small steps on another pod.
        ix.apply(&p[0], 0, &store(1, 0..3 * cap, bt)).await?;
        for start in (0..3 * cap).step_by(2) {
            ix.apply(&p[1], 0, &store(1, start..start + 2, bt)).await?;
        }
        let s = ix.stats();
        ensure!(
            s.entries <= 2 * cap,
            "stats {s:?} past 2 pods × {cap} blocks"
        );
        for q in &p {
            let held = ix.held(q, &doc_keys(1, 3 * cap, bt), 0).await?;
            ensure!(held <= cap as f64, "{q} holds {held} blocks, budget {cap}");
        }
        // The pod keeps working after hitting its budget.
        ix.apply(&p[0], 0, &store(2, 0..2, bt)).await?;
        ensure_eq!(
            ix.lookup(&doc_keys(2, 2, bt), &p[..1], 0).await?,
            vec![2.0],
            "a store after the overflow"
        );
        Ok(())
    })
}
