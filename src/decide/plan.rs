//! The bottom of a decision: the plan's types, [`rank`] (scores and ranks one set of candidates
//! from plain inputs; pure), and [`commit`] (records a plan in the index, the session store and
//! the primary's load). Nothing here reads the pods, the clock or the whole config.

use rand::Rng;
use serde::Serialize;

use crate::config::{DisaggConfig, GateConfig, Policy, ScorersConfig};
use crate::conversation::Conversations;
use crate::index::{IndexError, KvIndex};
use crate::keys::Keys;
use crate::picker::{Picker, Reason};
use crate::pods::{LoraFit, PodId, TtftPrior};
use crate::scoring::{
    run_scorer, Candidate, LoadScorer, LoraScorer, Prediction, PrefixScorer, ScoreError,
    ScoreInput, Scorer, SessionKey, SessionScorer, SessionStore,
};

/// The scoring stages of a decision (scorers, load signal, pickers, retry list length) built
/// from config, with no pod registry or clock.
pub struct Stages {
    scorers: Vec<Box<dyn Scorer>>,
    load: LoadScorer,
    lora: LoraScorer,
    picker: Picker,
    least_loaded: Picker,
    fallbacks: usize,
    prefill_tokens_per_sec: f64,
    max_prompt_tokens: u64,
    prior: TtftPrior,
    /// `disaggregation.threshold_tokens`.
    pd_threshold: u64,
}

impl Stages {
    /// The prefix, session and load scorers with their configured weights, the policy's picker
    /// (`policy`, gated by `gate`, `fallbacks` retry pods) and the P/D threshold.
    pub fn from_sections(
        policy: Policy,
        fallbacks: usize,
        s: &ScorersConfig,
        gate: &GateConfig,
        disagg: &DisaggConfig,
    ) -> Self {
        let load = LoadScorer::new(s.load.clone());
        let scorers: Vec<Box<dyn Scorer>> = vec![
            Box::new(PrefixScorer),
            Box::new(SessionScorer),
            Box::new(load.clone()),
        ];
        // The LoRA column comes last and only for adapter requests (see `rank`).
        let weights = vec![
            s.prefix.weight,
            s.session.weight,
            s.load.weight,
            s.lora.weight,
        ];
        Self {
            scorers,
            load,
            lora: LoraScorer::new(s.lora.clone()),
            picker: Picker::new(policy, weights, gate.clone()).with_ties(s.ttft.clone()),
            least_loaded: Picker::new(Policy::LeastLoaded, vec![], gate.clone()),
            fallbacks,
            prefill_tokens_per_sec: s.load.prefill_tokens_per_sec,
            max_prompt_tokens: s.load.max_prompt_tokens,
            prior: TtftPrior::new(
                s.load.prefill_tokens_per_sec,
                s.ttft.prior_overhead_ms,
                s.ttft.prior_weight,
            ),
            pd_threshold: disagg.threshold_tokens,
        }
    }

    /// The default configuration's stages with `disagg` (tests).
    #[cfg(test)]
    pub(crate) fn defaults(disagg: &DisaggConfig) -> Self {
        Self::from_sections(
            Policy::Weighted,
            2,
            &ScorersConfig::default(),
            &GateConfig::default(),
            disagg,
        )
    }

    /// `disaggregation.threshold_tokens`: the decode pod's uncached prompt tokens from which a
    /// prompt is prefilled on a prefill pod.
    pub fn pd_threshold(&self) -> u64 {
        self.pd_threshold
    }

    /// Where every pod's TTFT model starts, and what it is pulled toward while data is scarce.
    pub fn ttft_prior(&self) -> &TtftPrior {
        &self.prior
    }

    /// `scorers.lora.adapters`: adapter → base model for adapters pods load on demand.
    pub fn lora_adapters(&self) -> &std::collections::BTreeMap<String, String> {
        self.lora.adapters()
    }

    /// The configured prefill rate (tokens/s) the in-flight estimate uses.
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        self.prefill_tokens_per_sec
    }
}

/// How the request body was understood: it decides which picker ranks the candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// Parsed: the policy's picker on the weighted scores.
    Parsed,
    /// No body: least-loaded.
    Missing,
    /// Not understood (and not strict): least-loaded.
    Unparsable,
}

/// Everything [`plan`] decides on.
#[derive(Debug, Clone)]
pub struct PlanInput {
    /// The request's block keys (empty for body-less and unparsable requests).
    pub keys: Keys,
    /// How the body was understood.
    pub body: Body,
    /// Candidate pods with the blocks the index matched, their load and the session flag.
    pub candidates: Vec<Candidate>,
    /// The request's session, pinned to the primary on commit ([`SessionStore::follow`]).
    pub session: Option<SessionKey>,
    /// Round-robin position (the caller counts decisions).
    pub turn: u64,
    /// The request starts a new conversation on a shared prefix ([`Conversations::is_new`]).
    pub new_conversation: bool,
    /// It names no session and shares only a prefix with what the pods hold
    /// ([`Conversations::shares_prefix`]): placed on an idle pod while the holders queue.
    pub shares_prefix: bool,
    /// Each candidate's [`LoraFit`] for the request's adapter (`None`: a base-model request, or
    /// LoRA unknown): an adapter request gets a `lora` column weighted `scorers.lora.weight`.
    pub lora: Option<Vec<LoraFit>>,
}

/// One candidate with everything that went into its rank.
#[derive(Debug, Clone, Serialize)]
pub struct ScoredPod {
    /// `ip:port`.
    pub pod: PodId,
    /// Combined score.
    pub total: f64,
    /// Each scorer's score in [0, 1].
    pub scores: Vec<(&'static str, f64)>,
    /// Blocks the index predicts the pod holds.
    pub matched_blocks: f64,
    /// The gate marked it saturated.
    pub saturated: bool,
    /// Predicted time to first token and its terms (every policy shows it; `predicted-ttft`
    /// ranks by it).
    pub predicted: Prediction,
}

/// Why a request on a model with prefill pods was (or was not) disaggregated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PdOutcome {
    /// Prefilled on a prefill pod, decoded on the primary.
    Disaggregated,
    /// Fewer uncached prompt tokens on the decode pod than the threshold.
    ShortOrCached,
    /// Every prefill pod is saturated: the decode pod prefills.
    PrefillSaturated,
    /// Every prefill pod is excluded for prefills that never showed in its counters (see
    /// `pods::PrefillWatch`): the decode pod prefills.
    PrefillFailing,
    /// No parsed body, so no prompt to measure.
    NoPrompt,
}

impl PdOutcome {
    /// Every outcome (metric series).
    pub const ALL: [PdOutcome; 5] = [
        Self::Disaggregated,
        Self::ShortOrCached,
        Self::PrefillSaturated,
        Self::PrefillFailing,
        Self::NoPrompt,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disaggregated => "disaggregated",
            Self::ShortOrCached => "short_or_cached",
            Self::PrefillSaturated => "prefill_saturated",
            Self::PrefillFailing => "prefill_failing",
            Self::NoPrompt => "no_prompt",
        }
    }
}

/// The P/D half of a plan.
#[derive(Debug, Clone, Serialize)]
pub struct PdPlan {
    /// What was decided.
    pub outcome: PdOutcome,
    /// The prefill pod (`ip:port`) when disaggregated.
    pub prefill: Option<PodId>,
    /// Prompt tokens the decode pod would compute itself.
    pub decode_uncached_tokens: u64,
    /// The threshold they were compared with.
    pub threshold_tokens: u64,
    /// The prefill candidates, best first.
    pub prefill_ranked: Vec<ScoredPod>,
    /// Prompt tokens the prefill pod computes (charged to it on commit).
    #[serde(skip)]
    pub prefill_uncached_tokens: u64,
    /// The prefill pod's predicted prefill speed (tokens/s), for its load charge.
    #[serde(skip)]
    pub prefill_tokens_per_sec: f64,
}

/// A ranked decision, not yet recorded anywhere.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Primary first, then fallbacks in retry order.
    pub endpoints: Vec<PodId>,
    /// All candidates, best first.
    pub ranked: Vec<ScoredPod>,
    /// Why.
    pub reason: Reason,
    /// Full blocks in the prompt.
    pub total_blocks: usize,
    /// Index of the primary among the decision's pods (`DecisionInput::pods`; among the
    /// candidates of the [`PlanInput`] when [`rank`] is called alone).
    #[serde(skip)]
    pub primary: usize,
    /// Estimated prompt tokens the primary does not hold (charged to it on commit).
    #[serde(skip)]
    pub uncached_tokens: u64,
    /// Scorers that failed (their scores counted as 0).
    #[serde(skip)]
    pub scorer_errors: Vec<ScoreError>,
    #[serde(skip)]
    pub(super) keys: Keys,
    #[serde(skip)]
    session: Option<SessionKey>,
    /// The longest match over the candidates (blocks).
    #[serde(skip)]
    best_match: f64,
    /// The request started a new conversation.
    #[serde(skip)]
    pub(super) new_conversation: bool,
    /// The prefill/decode choice, for models with prefill-role pods.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pd: Option<PdPlan>,
}

impl Plan {
    /// What conversation memory records of this decision besides its keys and pod.
    pub fn conversation_mark(&self) -> crate::share::ConversationMark {
        crate::share::ConversationMark {
            best_match: self.best_match.clamp(0.0, f64::from(u32::MAX)) as u32,
            new_conversation: self.new_conversation,
        }
    }

    /// The request's prompt tokens as the router counts them (its keys' estimate or tokenizer).
    pub fn prompt_tokens(&self) -> u64 {
        self.keys.prompt_tokens
    }

    /// Tokens in one of the request's blocks.
    pub fn block_tokens(&self) -> u64 {
        self.keys.tokens_per_block as u64
    }

    /// The prompt tokens the plan predicts candidate `r` holds (whole blocks, short of the last
    /// prompt token, as an engine counts a hit).
    pub fn predicted_hit_tokens(&self, r: &ScoredPod) -> u64 {
        crate::pods::predicted_hit_tokens(
            r.matched_blocks,
            self.keys.tokens_per_block,
            self.keys.prompt_tokens,
        )
    }

    /// The prefill pod of a disaggregated plan.
    pub fn prefill_pod(&self) -> Option<&PodId> {
        self.pd.as_ref()?.prefill.as_ref()
    }

    /// `ip:port[,ip:port…]` for the metadata and header.
    pub fn destination(&self) -> String {
        self.endpoints
            .iter()
            .map(PodId::as_str)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Scores and ranks one set of candidates of a request (at least one candidate). Pure: the same
/// inputs and rng state give the same plan.
pub fn rank(stages: &Stages, input: PlanInput, rng: &mut impl Rng) -> Plan {
    let PlanInput {
        keys,
        body,
        candidates,
        session,
        turn,
        new_conversation,
        shares_prefix,
        lora,
    } = input;
    let lora_scores = stages.lora.scores(lora.as_deref(), candidates.len());
    // An adapter request is ranked by its scores, LoRA fit included, not spread by commitments
    // like a new conversation: a pod without the adapter pays a load and evicts another.
    let spreadable = lora_scores.is_none();
    let input = ScoreInput {
        total_blocks: keys.keys.len(),
        candidates,
        new_conversation: new_conversation && spreadable,
        shares_prefix: shares_prefix && spreadable,
        prompt_tokens: keys.prompt_tokens.min(stages.max_prompt_tokens) as f64,
        tokens_per_block: keys.tokens_per_block as f64,
    };
    let busy: Vec<f64> = input
        .candidates
        .iter()
        .map(|c| stages.load.busy(&c.load))
        .collect();
    let mut scorer_errors = Vec::new();
    let mut scores: Vec<Vec<f64>> = stages
        .scorers
        .iter()
        .map(|scorer| {
            run_scorer(scorer.as_ref(), &input).unwrap_or_else(|e| {
                scorer_errors.push(e);
                vec![0.0; input.candidates.len()]
            })
        })
        .collect();
    if let Some(l) = &lora_scores {
        scores.push(l.clone());
    }
    let (ranking, reason) = match body {
        Body::Parsed => {
            let r = stages.picker.rank(&input, &scores, &busy, turn, rng);
            let reason = r.reason;
            (r, reason)
        }
        Body::Missing | Body::Unparsable => (
            stages.least_loaded.rank(&input, &[], &busy, turn, rng),
            if body == Body::Missing {
                Reason::NoBody
            } else {
                Reason::Unparsable
            },
        ),
    };
    let ranked: Vec<ScoredPod> = ranking
        .order
        .iter()
        .map(|&i| ScoredPod {
            pod: input.candidates[i].pod.clone(),
            total: ranking.totals[i],
            scores: stages
                .scorers
                .iter()
                .map(|s| s.name())
                .chain(lora_scores.as_ref().map(|_| stages.lora.name()))
                .zip(&scores)
                .map(|(name, v)| (name, v[i]))
                .collect(),
            matched_blocks: input.candidates[i].matched_blocks,
            saturated: ranking.saturated[i],
            predicted: ranking.predictions[i],
        })
        .collect();
    let endpoints = ranked
        .iter()
        .take(1 + stages.fallbacks)
        .map(|s| s.pod.clone())
        .collect();
    let primary = ranking.order[0];
    let best_match = input
        .candidates
        .iter()
        .map(|c| c.matched_blocks)
        .fold(0.0, f64::max);
    let cached = (input.candidates[primary].matched_blocks * keys.tokens_per_block as f64) as u64;
    Plan {
        endpoints,
        ranked,
        reason,
        total_blocks: keys.keys.len(),
        primary,
        // The client sets the prompt length: no request counts past what a model accepts.
        uncached_tokens: keys
            .prompt_tokens
            .min(stages.max_prompt_tokens)
            .saturating_sub(cached),
        scorer_errors,
        keys,
        session,
        best_match,
        // A prompt placed away from its busy holders counts as a conversation placed there.
        new_conversation: new_conversation || (shares_prefix && reason == Reason::Spread),
        pd: None,
    }
}

/// What [`commit`] did; the index write may have failed (the decision stands).
#[derive(Debug)]
pub struct Committed<G> {
    /// The load charge of the primary, held until the request ends.
    pub guard: G,
    /// The index record failed.
    pub index_error: Option<IndexError>,
}

/// Where a plan is recorded; `None`: there is nothing to teach (`kv-bench simulate` runs
/// policies that ignore the index without one).
#[derive(Clone, Copy, Default)]
pub struct Stores<'a> {
    /// The KV index: the primary now holds the prompt's keys.
    pub index: Option<&'a dyn KvIndex>,
    /// Sessions: the request's session is pinned to the primary.
    pub sessions: Option<&'a SessionStore>,
    /// Conversations: where the prompt ended and branched, and a new one's pod.
    pub conversations: Option<&'a Conversations>,
}

/// Records a plan at `now_ms` (the index's time base) in `stores`, and
/// `charge(primary, uncached_tokens, tokens_per_sec)` charges the primary's load, its tokens
/// counted for as long as the primary's learned prefill speed takes to compute them.
pub async fn commit<G>(
    plan: &Plan,
    stores: Stores<'_>,
    now_ms: u64,
    charge: impl FnOnce(usize, u64, f64) -> G,
) -> Committed<G> {
    let guard = commit_local(plan, stores.sessions, stores.conversations, now_ms, charge);
    let primary = &plan.ranked[0].pod;
    let index_error = match stores.index {
        Some(index) if !plan.keys.keys.is_empty() => {
            let prefill = plan.prefill_pod().filter(|p| *p != primary);
            let on_prefill = match prefill {
                Some(p) => index.record(p, &plan.keys.keys, now_ms).await.err(),
                None => None,
            };
            let on_primary = index.record(primary, &plan.keys.keys, now_ms).await.err();
            on_primary.or(on_prefill)
        }
        _ => None,
    };
    Committed { guard, index_error }
}

/// What [`commit`] records in this process (the load charge, conversations, the session's
/// pin), all at once: the live router runs it under the lock its next decision plans in.
pub fn commit_local<G>(
    plan: &Plan,
    sessions: Option<&SessionStore>,
    conversations: Option<&Conversations>,
    now_ms: u64,
    charge: impl FnOnce(usize, u64, f64) -> G,
) -> G {
    let guard = charge(
        plan.primary,
        plan.uncached_tokens,
        plan.ranked[0].predicted.tokens_per_sec,
    );
    let primary = &plan.ranked[0].pod;
    if let Some(c) = conversations {
        let new_on = plan.new_conversation.then_some(primary);
        c.record(&plan.keys.keys, plan.best_match, new_on, now_ms);
    }
    if let (Some(store), Some(s)) = (sessions, plan.session) {
        let prefill_ms = plan.ranked[0].predicted.ttft_ms.clamp(0.0, 3.6e6) as u64;
        store.follow(s, primary.clone(), now_ms, now_ms + prefill_ms);
    }
    guard
}

/// One debug line per decision: why, where, and how that compares with the pod holding the
/// longest match (block counts and pod addresses only: never prompt text).
pub fn log_decision(plan: &Plan) {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    let (Some(chosen), Some(holder)) = (
        plan.ranked.first(),
        plan.ranked
            .iter()
            .max_by(|a, b| a.matched_blocks.total_cmp(&b.matched_blocks)),
    ) else {
        return;
    };
    // The fleet's queue in this router's view (replicas sharing the load should see one router's).
    let mean_queue_ms = plan
        .ranked
        .iter()
        .map(|r| r.predicted.queue_ms)
        .sum::<f64>()
        / plan.ranked.len() as f64;
    let candidates = candidates_field(&plan.ranked);
    tracing::debug!(
        reason = plan.reason.as_str(),
        blocks = plan.total_blocks,
        new_conversation = plan.new_conversation,
        pod = %chosen.pod,
        matched = chosen.matched_blocks,
        ttft_ms = chosen.predicted.ttft_ms,
        holder = %holder.pod,
        holder_matched = holder.matched_blocks,
        holder_saturated = holder.saturated,
        holder_ttft_ms = holder.predicted.ttft_ms,
        holder_queue_ms = holder.predicted.queue_ms,
        mean_queue_ms,
        candidates = %candidates,
        "decision"
    );
}

/// Candidates a decision line lists at most: a large fleet's debug log stays ~1 KB a line.
const LOGGED_CANDIDATES: usize = 16;

/// The first [`LOGGED_CANDIDATES`] candidates' inputs in rank order, `pod/total/matched/
/// queue_ms/ttft_ms/saturated/scorer:score;…` joined by commas (one field, so a log line stays
/// one record), then `+N` for the N left out.
fn candidates_field(ranked: &[ScoredPod]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for (i, r) in ranked.iter().take(LOGGED_CANDIDATES).enumerate() {
        let sep = if i == 0 { "" } else { "," };
        let _ = write!(
            out,
            "{sep}{}/{:.3}/{}/{:.0}/{:.0}/{}/",
            r.pod,
            r.total,
            r.matched_blocks,
            r.predicted.queue_ms,
            r.predicted.ttft_ms,
            u8::from(r.saturated)
        );
        for (j, (name, score)) in r.scores.iter().enumerate() {
            let sep = if j == 0 { "" } else { ";" };
            let _ = write!(out, "{sep}{name}:{score:.3}");
        }
    }
    if ranked.len() > LOGGED_CANDIDATES {
        let _ = write!(out, ",+{}", ranked.len() - LOGGED_CANDIDATES);
    }
    out
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;

    /// `blocks` keys of 16 tokens, `prompt_tokens` tokens, one fresh idle candidate per entry of
    /// `matched` (its matched blocks), named `p:0`, `p:1`…
    fn input(blocks: u64, prompt_tokens: u64, matched: &[f64]) -> PlanInput {
        PlanInput {
            keys: Keys {
                keys: (0..blocks).map(crate::blocks::BlockKey).collect(),
                tokens_per_block: 16,
                prompt_tokens,
                ..Keys::default()
            },
            body: Body::Parsed,
            candidates: matched
                .iter()
                .enumerate()
                .map(|(i, &matched_blocks)| Candidate {
                    pod: PodId::new(format!("p:{i}")),
                    matched_blocks,
                    load: crate::pods::PodLoad {
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

    fn stages() -> Stages {
        Stages::defaults(&DisaggConfig::default())
    }

    #[test]
    fn plan_is_a_function_of_its_inputs() {
        let stages = stages();
        let input = || input(8, 130, &[0.0, 0.0, 5.0, 0.0]);
        let a = rank(&stages, input(), &mut StdRng::seed_from_u64(3));
        let b = rank(&stages, input(), &mut StdRng::seed_from_u64(3));
        assert_eq!(
            serde_json::to_value(&a).unwrap(),
            serde_json::to_value(&b).unwrap()
        );
        assert_eq!((a.primary, a.reason), (2, Reason::Scored));
        assert_eq!(a.uncached_tokens, 130 - 5 * 16);
        let mut huge = input();
        huge.keys.prompt_tokens = 16 << 20; // a 64 MiB prompt
        let h = rank(&stages, huge, &mut StdRng::seed_from_u64(3));
        assert_eq!(
            h.uncached_tokens,
            131_072 - 5 * 16,
            "capped at max_prompt_tokens"
        );
    }

    #[test]
    fn an_adapter_request_prefers_the_pod_running_it() {
        let stages = stages();
        let input = || input(4, 64, &[0.0; 3]);
        let fits = [LoraFit::Evicts, LoraFit::FreeSlot, LoraFit::Resident];
        for seed in 0..8 {
            let mut adapter = input();
            adapter.lora = Some(fits.to_vec());
            let p = rank(&stages, adapter, &mut StdRng::seed_from_u64(seed));
            assert_eq!(p.primary, 2);
            assert_eq!(p.ranked[0].scores.last(), Some(&("lora", 1.0)));
            assert_eq!(
                p.ranked[1].pod,
                PodId::new("p:1"),
                "a free slot before an eviction"
            );
        }
        // A base-model request: no LoRA column.
        let base = rank(&stages, input(), &mut StdRng::seed_from_u64(1));
        assert!(base
            .ranked
            .iter()
            .all(|r| r.scores.iter().all(|(n, _)| *n != "lora")));
    }

    /// The decision line's candidates field: every candidate, rank order, one token per field
    /// and nothing a log parser splits on besides its own separators.
    #[test]
    fn the_candidates_field_lists_every_candidates_inputs_in_rank_order() {
        let stages = stages();
        let p = rank(
            &stages,
            input(4, 64, &[0.0, 3.0]),
            &mut StdRng::seed_from_u64(1),
        );
        let field = candidates_field(&p.ranked);
        let rows: Vec<Vec<&str>> = field.split(',').map(|c| c.split('/').collect()).collect();
        assert_eq!(rows.len(), 2, "{field}");
        assert_eq!(rows[0][0], "p:1", "the holder ranks first: {field}");
        assert_eq!(rows[0][2], "3");
        assert!(rows.iter().all(|r| r.len() == 7), "{field}");
        assert!(!field.contains(' ') && !field.contains('"'), "{field}");
        assert!(rows[0][6].split(';').all(|s| s.contains(':')), "{field}");
        // A large fleet: the best sixteen, then how many more.
        let p = rank(
            &stages,
            input(4, 64, &[0.0; 40]),
            &mut StdRng::seed_from_u64(1),
        );
        let field = candidates_field(&p.ranked);
        let entries: Vec<&str> = field.split(',').collect();
        assert_eq!(entries.len(), LOGGED_CANDIDATES + 1, "{field}");
        assert_eq!(entries[LOGGED_CANDIDATES], "+24");
    }
}
