//! Prefill/decode disaggregation: for a model with `prefill`-role pods, the decode pod is planned
//! among the other pods as usual, and [`plan_pd`] (pure) decides whether the prompt is worth
//! prefilling elsewhere and, if so, on which prefill pod.
//!
//! The rule: disaggregate when the chosen decode pod would compute at least
//! `disaggregation.threshold_tokens` prompt tokens itself (prompt tokens minus the blocks the
//! index predicts it holds). A short prompt, or one mostly cached where it will decode, costs
//! less to prefill in place than to prefill, transfer and decode. The prefill pod is ranked by
//! the same scorers (prefix cache, load) and gate among the prefill pods; when even the best
//! one is saturated the decode pod prefills itself.

use rand::Rng;

use super::plan::{rank, Body, PdOutcome, PdPlan, Plan, PlanInput, Stages};
use crate::pods::PodRole;

/// Everything the pure planner decides on: the candidates that take the request (the decode
/// pods of a P/D model) and, for a P/D model, its prefill candidates (empty: every prefill pod
/// is excluded).
#[derive(Debug, Clone)]
pub struct PlanInputs {
    /// The candidates that take the request.
    pub decode: PlanInput,
    /// The prefill candidates of a P/D model (`None`: an aggregated model).
    pub prefill: Option<PlanInput>,
}

/// Plans a request: base-model and adapter requests are ranked by [`rank`], a P/D model's by
/// [`plan_pd`]. Pure: the same inputs and rng state give the same plan; its `primary` indexes
/// `input.decode`'s candidates.
pub fn plan(stages: &Stages, input: PlanInputs, rng: &mut impl Rng) -> Plan {
    match input.prefill {
        None => rank(stages, input.decode, rng),
        Some(prefill) => plan_pd(stages, input.decode, prefill, rng),
    }
}

/// Plans a request on a P/D model: `decode` ranks the decode candidates (primary and
/// fallbacks), `prefill` the prefill candidates (none: every prefill pod is excluded). Pure,
/// like [`plan`].
pub fn plan_pd(stages: &Stages, decode: PlanInput, prefill: PlanInput, rng: &mut impl Rng) -> Plan {
    let threshold_tokens = stages.pd_threshold();
    let body = decode.body;
    let mut p = rank(stages, decode, rng);
    let pre = (!prefill.candidates.is_empty()).then(|| rank(stages, prefill, rng));
    let best = pre
        .as_ref()
        .and_then(|pre| pre.ranked.first())
        .map(|b| (b.pod.clone(), b.saturated, b.predicted.tokens_per_sec));
    let outcome = if body != Body::Parsed {
        PdOutcome::NoPrompt
    } else if p.uncached_tokens < threshold_tokens || p.uncached_tokens == 0 {
        PdOutcome::ShortOrCached
    } else {
        match best {
            None => PdOutcome::PrefillFailing,
            Some((_, true, _)) => PdOutcome::PrefillSaturated,
            Some(_) => PdOutcome::Disaggregated,
        }
    };
    let disaggregated = outcome == PdOutcome::Disaggregated;
    p.pd = Some(PdPlan {
        outcome,
        prefill: best.as_ref().filter(|_| disaggregated).map(|b| b.0.clone()),
        decode_uncached_tokens: p.uncached_tokens,
        threshold_tokens,
        prefill_uncached_tokens: pre.as_ref().map_or(0, |pre| pre.uncached_tokens),
        prefill_tokens_per_sec: best.map_or(0.0, |b| b.2),
        prefill_ranked: pre.map(|pre| pre.ranked).unwrap_or_default(),
    });
    p
}

/// Splits candidates by role into (decode, prefill) positions when the model has prefill pods
/// and something to decode on; `None`: plan as before (no roles, or only prefill pods).
pub fn split_roles(roles: &[PodRole]) -> Option<(Vec<usize>, Vec<usize>)> {
    let (prefill, decode): (Vec<usize>, Vec<usize>) =
        (0..roles.len()).partition(|&i| roles[i] == PodRole::Prefill);
    (!prefill.is_empty() && !decode.is_empty()).then_some((decode, prefill))
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;
    use crate::config::{DisaggConfig, GateConfig};
    use crate::keys::Keys;
    use crate::pods::PodId;
    use crate::pods::PodLoad;
    use crate::scoring::Candidate;

    const TPB: usize = 16;

    fn input(prompt_tokens: u64, pods: &[(&str, f64, f64)]) -> PlanInput {
        PlanInput {
            keys: Keys {
                keys: (0..prompt_tokens / TPB as u64)
                    .map(crate::blocks::BlockKey)
                    .collect(),
                tokens_per_block: TPB,
                prompt_tokens,
                ..Keys::default()
            },
            body: Body::Parsed,
            candidates: pods
                .iter()
                .map(|&(id, matched_blocks, waiting)| Candidate {
                    pod: PodId::new(id),
                    matched_blocks,
                    load: PodLoad {
                        waiting,
                        fresh: true,
                        ..Default::default()
                    },
                    session_pod: false,
                    conversations: 0.0,
                    model: Default::default(),
                })
                .collect(),
            session: None,
            turn: 0,
            new_conversation: false,
            shares_prefix: false,
            lora: None,
        }
    }

    fn pd(plan: &Plan) -> &PdPlan {
        plan.pd.as_ref().expect("a P/D plan")
    }

    const DECODE: &[(&str, f64, f64)] = &[("d:1", 0.0, 0.0), ("d:2", 0.0, 1.0)];

    #[test]
    fn a_short_prompt_is_not_disaggregated() {
        let stages = Stages::defaults(&DisaggConfig::default());
        let prefill = &[("p:1", 0.0, 0.0)];
        let p = plan_pd(
            &stages,
            input(160, DECODE),
            input(160, prefill),
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(pd(&p).outcome, PdOutcome::ShortOrCached);
        assert_eq!(pd(&p).prefill, None);
        assert_eq!(pd(&p).decode_uncached_tokens, 160);
        assert_eq!(p.endpoints[0], PodId::new("d:1"), "decode by load");
    }

    #[test]
    fn a_long_prompt_cached_on_its_decode_pod_is_not_disaggregated() {
        let stages = Stages::defaults(&DisaggConfig::default());
        // 2048 tokens, 120 of 128 blocks held by d:2: 128 uncached tokens.
        let decode = &[("d:1", 0.0, 0.0), ("d:2", 120.0, 0.0)];
        let prefill = &[("p:1", 0.0, 0.0)];
        let p = plan_pd(
            &stages,
            input(2048, decode),
            input(2048, prefill),
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(p.endpoints[0], PodId::new("d:2"));
        assert_eq!(pd(&p).decode_uncached_tokens, 2048 - 120 * 16);
        assert_eq!(pd(&p).outcome, PdOutcome::ShortOrCached);
    }

    #[test]
    fn a_long_uncached_prompt_goes_to_the_prefill_pod_with_the_best_match() {
        let stages = Stages::defaults(&DisaggConfig::default());
        let prefill = &[("p:1", 10.0, 0.0), ("p:2", 100.0, 0.0), ("p:3", 0.0, 0.0)];
        for seed in 0..16 {
            let p = plan_pd(
                &stages,
                input(2048, DECODE),
                input(2048, prefill),
                &mut StdRng::seed_from_u64(seed),
            );
            let pd = pd(&p);
            assert_eq!(pd.outcome, PdOutcome::Disaggregated);
            assert_eq!(pd.prefill, Some(PodId::new("p:2")));
            assert_eq!(pd.prefill_uncached_tokens, 2048 - 100 * 16);
            assert_eq!(p.endpoints[0], PodId::new("d:1"), "the destination decodes");
            assert!(p.endpoints.iter().all(|e| e.as_str().starts_with("d:")));
        }
    }

    #[test]
    fn with_every_prefill_pod_excluded_the_decode_pod_prefills() {
        let stages = Stages::defaults(&DisaggConfig::default());
        let p = plan_pd(
            &stages,
            input(2048, DECODE),
            input(2048, &[]),
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(pd(&p).outcome, PdOutcome::PrefillFailing);
        assert_eq!(pd(&p).prefill, None);
        assert!(pd(&p).prefill_ranked.is_empty());
        assert_eq!(p.endpoints[0], PodId::new("d:1"));
    }

    #[test]
    fn with_equal_matches_the_less_loaded_prefill_pod_wins() {
        let stages = Stages::defaults(&DisaggConfig::default());
        let prefill = &[("p:1", 0.0, 6.0), ("p:2", 0.0, 0.0)];
        let p = plan_pd(
            &stages,
            input(4096, DECODE),
            input(4096, prefill),
            &mut StdRng::seed_from_u64(7),
        );
        assert_eq!(pd(&p).prefill, Some(PodId::new("p:2")));
    }

    #[test]
    fn saturated_prefill_pods_or_no_prompt_keep_the_prefill_on_the_decode_pod() {
        let stages = Stages::defaults(&DisaggConfig::default());
        let busy = GateConfig::default().max_waiting + 1.0;
        let prefill = &[("p:1", 0.0, busy)];
        let p = plan_pd(
            &stages,
            input(4096, DECODE),
            input(4096, prefill),
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(pd(&p).outcome, PdOutcome::PrefillSaturated);
        assert_eq!(pd(&p).prefill, None);
        let mut none = input(4096, DECODE);
        none.body = Body::Missing;
        let p = plan_pd(
            &stages,
            none,
            input(4096, &[("p:1", 0.0, 0.0)]),
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(pd(&p).outcome, PdOutcome::NoPrompt);
    }

    #[test]
    fn the_threshold_is_inclusive_and_zero_disaggregates_any_uncached_prompt() {
        let prefill = &[("p:1", 0.0, 0.0)];
        let at = |threshold_tokens, tokens| {
            let stages = Stages::defaults(&DisaggConfig {
                threshold_tokens,
                ..DisaggConfig::default()
            });
            let p = plan_pd(
                &stages,
                input(tokens, DECODE),
                input(tokens, prefill),
                &mut StdRng::seed_from_u64(1),
            );
            pd(&p).outcome
        };
        assert_eq!(at(512, 512), PdOutcome::Disaggregated);
        assert_eq!(at(512, 511), PdOutcome::ShortOrCached);
        assert_eq!(at(0, 16), PdOutcome::Disaggregated);
    }
}
