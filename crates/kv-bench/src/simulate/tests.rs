//! The simulation end to end on small synthetic traces.

use std::sync::Arc;

use kv_router::blocks::{namespace_seed, token_keys};
use kv_router::config::Config;

use super::capacity::PlanOutcome;
use super::options::MODEL;
use super::outcome::Timing;
use super::*;
use crate::strategy::Strategy;
use kv_testkit::splitmix::SplitMix64;
use kv_testkit::trace::{Trace, TraceRecord};
use vllm_sim::engine::EngineConfig;

/// Fast engines: small prompts still queue a little so load matters.
pub(super) fn opts(pods: usize) -> SimulateOptions {
    SimulateOptions {
        pods,
        threads: 2,
        capacity: None,
        engine: EngineConfig {
            num_gpu_blocks: 512,
            ..EngineConfig::default()
        },
        ..SimulateOptions::default()
    }
}

/// `groups` shared 1024-token prefixes (2 trace blocks), each request adding its own block;
/// groups come in a pseudo-random order (no pattern a round robin could align with).
pub(super) fn grouped_trace(groups: u64, per_group: u64, gap_ms: u64) -> Trace {
    let mut records = Vec::new();
    let mut next_id = 1_000;
    let mut rng = SplitMix64::new(groups * 31 + per_group);
    for i in 0..groups * per_group {
        let g = rng.range(0, groups as usize - 1) as u64;
        next_id += 1;
        records.push(TraceRecord {
            timestamp: i * gap_ms,
            input_length: 1_300,
            output_length: 20,
            hash_ids: vec![g * 2, g * 2 + 1, next_id],
        });
    }
    Trace {
        name: "grouped".into(),
        offset: 0,
        records,
    }
}

fn zero_timing(mut r: SimulateReport) -> SimulateReport {
    r.wall_s = 0.0;
    r.threads = 0;
    for s in &mut r.strategies {
        s.timing = Timing::default();
    }
    r
}

#[test]
fn same_seed_same_report_whatever_the_threads() {
    let t = grouped_trace(6, 10, 40);
    let mut o = opts(4);
    o.capacity = Some(CapacityOptions {
        pods: vec![1, 2, 4],
        ttft_target_ms: 1e9,
        ..CapacityOptions::default()
    });
    let a = zero_timing(run_trace(&t, &o).unwrap());
    o.threads = 1;
    let b = zero_timing(run_trace(&t, &o).unwrap());
    assert_eq!(a, b);
    assert_eq!(a.capacity.as_ref().unwrap().answer, Some(1));
    o.seed = 2;
    let c = zero_timing(run_trace(&t, &o).unwrap());
    let random = |r: &SimulateReport| r.strategies[1].per_pod.clone();
    assert_ne!(random(&a), random(&c), "the seed drives the random policy");
}

#[test]
fn one_pod_makes_every_strategy_equal() {
    let t = grouped_trace(4, 8, 30);
    let r = run_trace(&t, &opts(1)).unwrap();
    let first = &r.strategies[0];
    for s in &r.strategies {
        assert_eq!(s.cached_tokens, first.cached_tokens, "{:?}", s.strategy);
        assert_eq!(s.ttft_cdf_ms, first.ttft_cdf_ms, "{:?}", s.strategy);
        assert_eq!(s.per_pod, vec![32]);
    }
}

#[test]
fn strategies_that_see_the_same_fleet_break_ties_alike() {
    // No prompt shares a block: both indexes match nothing, so weighted and precise see the same
    // scores and loads, and only the tie-breaks could set them apart. Drawing those from one
    // stream per seed (common random numbers) keeps a comparison of two strategies from
    // measuring two rng streams: unpaired, 12 churning-cache seeds put precise 2.3 points of
    // pooled below weighted; paired, 1.3 points above (docs/results.md, "Paired tie-breaks").
    let records = (0..120u64)
        .map(|i| TraceRecord {
            timestamp: i * 15,
            input_length: 1_100,
            output_length: 30,
            hash_ids: vec![10 * i + 1, 10 * i + 2],
        })
        .collect();
    let t = Trace {
        name: "unique".into(),
        offset: 0,
        records,
    };
    let mut o = opts(4);
    o.strategies = vec![Strategy::Weighted, Strategy::Precise];
    for seed in 1..=3 {
        o.seed = seed;
        let r = run_trace(&t, &o).unwrap();
        let (w, p) = (&r.strategies[0], &r.strategies[1]);
        assert_eq!(w.per_pod, p.per_pod, "seed {seed}");
        assert_eq!(w.ttft_cdf_ms, p.ttft_cdf_ms, "seed {seed}");
    }
}

#[test]
fn prefix_aware_routing_beats_round_robin_and_stays_under_the_oracle() {
    // 8 groups on 4 pods: round robin spreads each group over every pod (cold prefixes
    // everywhere); prefix-aware strategies keep a group where its prefix is.
    let t = grouped_trace(8, 12, 200);
    let mut o = opts(4);
    // Room for about three prefixes per pod: spreading every group everywhere thrashes.
    o.engine.num_gpu_blocks = 256;
    let r = run_trace(&t, &o).unwrap();
    let get = |s: Strategy| r.strategies.iter().find(|x| x.strategy == s).unwrap();
    let rr = get(Strategy::RoundRobin).hit_ratio;
    for s in [Strategy::PrefixOnly, Strategy::Weighted, Strategy::Precise] {
        assert!(
            get(s).hit_ratio > rr + 0.05,
            "{s:?}: {} vs round robin {rr}",
            get(s).hit_ratio
        );
    }
    let inf = r.oracles.infinite.ratio();
    for s in &r.strategies {
        assert!(
            s.hit_ratio <= inf + 1e-12,
            "{:?} {} > {inf}",
            s.strategy,
            s.hit_ratio
        );
        assert_eq!(s.requests, t.records.len(), "requests conserved");
        assert_eq!(s.per_pod.iter().sum::<usize>(), t.records.len());
        assert_eq!(s.ttft_cdf_ms.len(), 101);
    }
}

#[test]
fn router_keys_are_the_keyers_keys() {
    // The simulation's shortcut (pod keys cut at max_blocks) must equal what the router
    // computes from a token-id request, in approximate and precise mode alike.
    let tokens: Vec<u32> = (0..(5000 * BLOCK_TOKENS as u32 + 7))
        .map(|i| i % 977 + 3)
        .collect();
    let body = serde_json::to_vec(&serde_json::json!({"model": MODEL, "prompt": tokens})).unwrap();
    let req = kv_router::request::parse("/v1/completions", &body).unwrap();
    let pod_keys = token_keys(
        namespace_seed(MODEL, None),
        &tokens,
        BLOCK_TOKENS,
        usize::MAX,
    );
    for s in [Strategy::Weighted, Strategy::Precise] {
        let cfg = s.router_config(&Config::default(), MODEL);
        let keyer = kv_router::keys::Keyer::new(
            kv_router::blocks::BlockScheme {
                size_chars: cfg.blocks.size_chars,
                max_blocks: cfg.blocks.max_blocks,
            },
            cfg.kv_events.block_tokens,
            Arc::new(kv_router::keys::load_tokenizers(&cfg.tokenizers).unwrap()),
        );
        let k = keyer.keys(&req);
        assert_eq!(k.precise, s == Strategy::Precise);
        assert_eq!(k.tokens_per_block, BLOCK_TOKENS);
        assert_eq!(k.prompt_tokens, tokens.len() as u64);
        assert_eq!(k.keys[..], pod_keys[..cfg.blocks.max_blocks], "{s:?}");
    }
}

#[test]
fn capacity_plan_stops_at_the_first_fleet_meeting_the_target() {
    let t = grouped_trace(4, 20, 5);
    let mut o = opts(2);
    o.strategies = vec![Strategy::Weighted];
    let base = zero_timing(run_trace(&t, &o).unwrap());
    let p90 = |pods: usize| {
        let mut o = o.clone();
        o.pods = pods;
        run_trace(&t, &o).unwrap().strategies[0].ttft_p90_ms
    };
    // A target between the 1-pod and 8-pod p90: the plan must pick a size in between.
    let target = (p90(1) + p90(8)) / 2.0;
    o.capacity = Some(CapacityOptions {
        strategy: Strategy::Weighted,
        percentile: 90.0,
        ttft_target_ms: target,
        pods: vec![8, 1, 2, 4],
    });
    let r = run_trace(&t, &o).unwrap();
    let plan = r.capacity.clone().unwrap();
    assert_eq!(plan.outcome, PlanOutcome::Met);
    let answer = plan.answer.unwrap();
    assert!(answer > 1 && answer <= 8, "{plan:?}");
    assert_eq!(plan.points.last().unwrap().pods, answer);
    assert!(plan.points.iter().rev().skip(1).all(|p| !p.meets));
    assert_eq!(zero_timing(r.clone()).strategies, base.strategies);
}

#[test]
fn capacity_plan_gives_up_when_more_pods_stop_helping() {
    let t = grouped_trace(3, 4, 300);
    let mut o = opts(2);
    o.strategies = vec![Strategy::RoundRobin];
    o.capacity = Some(CapacityOptions {
        strategy: Strategy::Weighted,
        ttft_target_ms: 1.0,
        pods: vec![1, 2, 4, 8, 16, 32, 64],
        ..CapacityOptions::default()
    });
    let plan = run_trace(&t, &o).unwrap().capacity.unwrap();
    assert_eq!(plan.outcome, PlanOutcome::LevelledOff, "{plan:?}");
    assert_eq!(plan.answer, None);
    assert!(plan.points.len() < 7, "{plan:?}");
    let text = run_trace(&t, &o).unwrap().plain();
    assert!(text.contains("no fleet size meets"), "{text}");
}

#[test]
fn precise_index_follows_the_events() {
    let t = grouped_trace(4, 10, 100);
    let mut o = opts(2);
    o.strategies = vec![Strategy::Precise];
    let r = run_trace(&t, &o).unwrap();
    let k = r.strategies[0].kv_events.unwrap();
    assert!(k.stored > 0, "{k:?}");
    assert_eq!(k.unknown_parent + k.ignored + k.overflow, 0, "{k:?}");
}

#[test]
fn bad_options_are_typed_errors() {
    let t = grouped_trace(1, 1, 1);
    let mut o = opts(0);
    let e = run_trace(&t, &o).unwrap_err();
    assert_eq!(e.downcast_ref(), Some(&SimulateError::NoPods));
    o.pods = 1;
    o.speedup = 0.0;
    let e = run_trace(&t, &o).unwrap_err();
    assert!(matches!(
        e.downcast_ref(),
        Some(SimulateError::BadSpeedup(_))
    ));
}

#[test]
fn report_renders_every_strategy() {
    let t = grouped_trace(2, 4, 50);
    let mut o = opts(2);
    o.capacity = Some(CapacityOptions {
        pods: vec![1, 2],
        ..CapacityOptions::default()
    });
    let r = run_trace(&t, &o).unwrap();
    let md = r.markdown();
    for s in Strategy::available() {
        let row = format!("| {} ", s.as_str());
        assert!(md.lines().any(|l| l.starts_with(&row)), "{md}");
    }
    assert!(md.contains("Answer: 1 pods"), "{md}");
    assert!(r.plain().contains("prefix-only"));
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["strategies"][0]["strategy"], "round-robin");
}

#[test]
fn predicted_ttft_learns_a_slow_pod_and_sends_it_less() {
    // Pod 0 prefills four times slower; mostly cold prompts (64 prefixes, 5 requests each) of
    // 1-6 blocks (sizes must vary for a speed to be told from a per-request overhead) arrive
    // faster than one pod prefills them.
    let mut t = grouped_trace(64, 5, 40);
    for (i, r) in t.records.iter_mut().enumerate() {
        let extra = i * 7 % 4;
        r.input_length = (1_300 + 1_000 * extra) as _;
        r.hash_ids
            .extend((0..2 * extra as u64).map(|k| 1_000_000 + i as u64 * 8 + k));
    }
    let mut o = opts(4);
    o.slow_pods = 1;
    o.slow_factor = 4.0;
    o.strategies = vec![
        Strategy::RoundRobin,
        Strategy::Weighted,
        Strategy::PredictedTtft,
    ];
    let r = run_trace(&t, &o).unwrap();
    let (rr, weighted, ttft) = (&r.strategies[0], &r.strategies[1], &r.strategies[2]);
    let fast = 1e6 / o.engine.prefill_us_per_token;
    // The router learns each pod's speed from the engines' counters: the fast pods within 5 %
    // after 80 requests each, the slow one within 20 % (the prior, 10k tokens/s, still pulls).
    let l = &rr.learned_tokens_per_sec;
    assert!((l[0] / (fast / 4.0) - 1.0).abs() < 0.2, "slow pod: {l:?}");
    for v in &l[1..] {
        assert!((v / fast - 1.0).abs() < 0.05, "fast pods: {l:?}");
    }
    let share = |s: &StrategyResult| s.per_pod[0] as f64 / t.records.len() as f64;
    assert_eq!(share(rr), 0.25);
    // A pod at a quarter of the speed is worth a thirteenth of the fleet (7.7 %).
    assert!(
        share(ttft) < 0.15 && share(ttft) < share(weighted),
        "slow pod's share {} (weighted {})",
        share(ttft),
        share(weighted)
    );
    assert!(
        ttft.ttft_p90_ms < weighted.ttft_p90_ms,
        "{} vs {}",
        ttft.ttft_p90_ms,
        weighted.ttft_p90_ms
    );
}

#[test]
fn precise_sees_what_the_routers_own_record_misses() {
    // 8 shared prefixes on 4 pods with room for about three each: where a prefix lives matters.
    let t = grouped_trace(8, 12, 200);
    let mut o = opts(4);
    o.engine.num_gpu_blocks = 256;
    o.strategies = vec![Strategy::Weighted, Strategy::Precise];
    let hits = |o: &SimulateOptions| {
        let r = run_trace(&t, o).unwrap();
        (r.strategies[0].hit_ratio, r.strategies[1].hit_ratio)
    };
    let (w0, p0) = hits(&o);
    // Half the traffic reaches pods directly: only KV events tell where it left prefixes (a
    // small win on 96 requests; 12-14 points of pooled on the Mooncake runs in docs/results.md).
    o.divergence.bypass = 0.5;
    let (w, p) = hits(&o);
    assert!(p > w + 0.01, "bypass: precise {p} vs weighted {w}");
    // Told a quarter of the real cache, the router forgets prefixes the pods still hold.
    o.divergence = Divergence {
        capacity_belief: 0.25,
        ..Divergence::default()
    };
    let (w, p) = hits(&o);
    assert!(p > w + 0.02, "capacity: precise {p} vs weighted {w}");
    assert_eq!(p, p0, "precise reads the pods, not the belief");
    assert!(w < w0, "weighted: {w} vs {w0} when told the truth");
    // Restarts: every request still finishes (retried on the restarted pod).
    o.divergence = Divergence {
        restart_every_s: Some(1.0),
        ..Divergence::default()
    };
    let r = run_trace(&t, &o).unwrap();
    for s in &r.strategies {
        assert_eq!(s.requests, t.records.len());
        assert!(s.hit_ratio < w0.max(p0), "{:?} lost nothing", s.strategy);
    }
    o.divergence.bypass = 1.5;
    assert!(run_trace(&t, &o).is_err(), "a share above 1 is refused");
}

/// `conversations` chats of `turns` turns without session ids, Mooncake style: every prompt
/// starts with the same 512-token system prompt (trace block 0), then the conversation's own
/// history, whose last partial block is re-cut (a new id) when the next turn extends it. New
/// conversations arrive every `gap_ms`; a conversation's turns come `turn_gap_ms` apart.
pub(super) fn conversation_trace(
    conversations: u64,
    turns: u64,
    gap_ms: u64,
    turn_gap_ms: u64,
) -> Trace {
    let mut records = Vec::new();
    let mut next_id = 1;
    for c in 0..conversations {
        let mut history: Vec<u64> = vec![0];
        for t in 0..turns {
            // The partial last block of the previous turn is cut again with the new text.
            if t > 0 {
                history.pop();
            }
            for _ in 0..4 {
                history.push(next_id);
                next_id += 1;
            }
            records.push(TraceRecord {
                timestamp: c * gap_ms + t * turn_gap_ms,
                input_length: (512 * (history.len() - 1) + 200) as u32,
                output_length: 20,
                hash_ids: history.clone(),
            });
        }
    }
    records.sort_by_key(|r| r.timestamp);
    Trace {
        name: "conversations".into(),
        offset: 0,
        records,
    }
}

#[test]
fn conversations_without_sessions_spread_over_the_fleet_and_keep_their_history() {
    // 48 conversations of 3 turns on 8 pods with room for about seven conversations each: the
    // first holders of the system prompt cannot keep them all. Before, every new conversation
    // went to a pod holding the system prompt (its prefix score) and the hot gate never saw
    // the one or two requests that made the difference: the first pods took nearly everything
    // and evicted the histories the next turns needed.
    let t = conversation_trace(48, 3, 300, 4_000);
    let mut o = opts(8);
    o.engine.num_gpu_blocks = 2_400;
    o.strategies = vec![
        Strategy::Weighted,
        Strategy::PredictedTtft,
        Strategy::Precise,
    ];
    let r = run_trace(&t, &o).unwrap();
    for s in &r.strategies {
        let mean = t.records.len() as f64 / 8.0;
        let busiest = *s.per_pod.iter().max().unwrap() as f64;
        assert!(busiest <= 1.6 * mean, "{:?}: {:?}", s.strategy, s.per_pod);
        let vs_pooled = s.vs_pooled.unwrap();
        assert!(vs_pooled > 0.9, "{:?}: {vs_pooled} of pooled", s.strategy);
    }
}

#[test]
fn precise_keeps_weighteds_hits_on_the_compare_windows() {
    // `make bench`'s two Mooncake windows in virtual time, seeds 1-3, tie-breaks paired: the
    // precise index must keep the approximate record's hits. Measured (docs/results.md, "Paired
    // tie-breaks"): precise 0.974 vs 0.963 of pooled on synthetic, 0.897 vs 0.898 on
    // conversation over 12 seeds; one seed moves either by up to 6 points, so the mean of three
    // is held to 1.5 points below weighted.
    for (trace, skip, speedup) in [("synthetic", 2000, 6.0), ("conversation", 0, 8.0)] {
        let mut o = SimulateOptions {
            trace: trace.into(),
            skip,
            requests: Some(600),
            speedup,
            output_scale: 0.25,
            pods: 8,
            strategies: vec![Strategy::Weighted, Strategy::Precise],
            engine: EngineConfig {
                num_gpu_blocks: 32_768,
                prefill_us_per_token: 20.0,
                decode_us_per_token: 2_000.0,
                ..EngineConfig::default()
            },
            capacity: None,
            ..SimulateOptions::default()
        };
        let (mut w, mut p) = (0.0, 0.0);
        for seed in 1..=3 {
            o.seed = seed;
            let r = run(&o).unwrap();
            w += r.strategies[0].vs_pooled.unwrap() / 3.0;
            p += r.strategies[1].vs_pooled.unwrap() / 3.0;
        }
        assert!(
            p >= w - 0.015,
            "{trace}: precise {p:.3} vs weighted {w:.3} of pooled"
        );
    }
}
