//! The picker: saturation gate, then one policy ranks the candidates (weighted sum, predicted
//! TTFT, or the baselines round-robin, random and least-loaded used for comparisons), exact ties
//! in random order. One file per policy, each behind [`RankPolicy`].

use std::fmt::Write as _;

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};
use rand::seq::SliceRandom;
use rand::Rng;
use serde::{Serialize, Serializer};

use crate::config::{GateConfig, Policy, TtftConfig};
use crate::scoring::{Prediction, ScoreInput};

mod gate;
mod least_loaded;
mod predicted_ttft;
mod random;
mod round_robin;
mod spread;
mod weighted;

pub use gate::has_room;
use gate::Verdict;

/// Why the primary pod was chosen (closed set; the `reason` label of decisions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Weighted scores over the candidates the gates let through.
    Scored,
    /// Every candidate was gated (saturated or hot); scored over all of them.
    AllSaturated,
    /// A baseline policy (round-robin, random, least-loaded) chose.
    Policy,
    /// No body: least-loaded.
    NoBody,
    /// Body not understood: least-loaded (the pod answers).
    Unparsable,
    /// A new conversation on a shared prefix: the least-loaded holder of the prefix (or a
    /// second pod, which then warms it), not the prefix's first holder.
    Spread,
}

impl Reason {
    /// Every reason (to drop a departed pod's series).
    pub const ALL: [Reason; 6] = [
        Reason::Scored,
        Reason::AllSaturated,
        Reason::Policy,
        Reason::NoBody,
        Reason::Unparsable,
        Reason::Spread,
    ];

    /// The label value and wire name (the one place each is spelled).
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Scored => "scored",
            Reason::AllSaturated => "all-saturated",
            Reason::Policy => "policy",
            Reason::NoBody => "no-body",
            Reason::Unparsable => "unparsable",
            Reason::Spread => "spread",
        }
    }
}

impl Serialize for Reason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl EncodeLabelValue for Reason {
    fn encode(&self, e: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        e.write_str(self.as_str())
    }
}

/// The picker's output: candidate indices best first, with their combined scores.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Ranking {
    /// Indices into the candidates, best first (saturated ones after all others).
    pub order: Vec<usize>,
    /// Combined score per candidate (same order as the candidates).
    pub totals: Vec<f64>,
    /// Candidates the gate marked saturated.
    pub saturated: Vec<bool>,
    /// Why: [`Reason::Scored`], [`Reason::AllSaturated`] or [`Reason::Policy`].
    pub reason: Reason,
    /// Each candidate's predicted TTFT, as the gate and `predicted-ttft` read it.
    pub predictions: Vec<Prediction>,
}

/// Combines scorer outputs into a ranking. Holds no state: round robin's position is an input.
#[derive(Debug)]
pub(crate) struct Picker {
    policy: Policy,
    weights: Vec<f64>,
    gate: GateConfig,
    ties: TtftConfig,
}

impl Picker {
    /// `weights[i]` applies to the i-th scorer's output.
    pub fn new(policy: Policy, weights: Vec<f64>, gate: GateConfig) -> Self {
        Self {
            policy,
            weights,
            gate,
            ties: TtftConfig::default(),
        }
    }

    /// What `predicted-ttft` counts as a tie.
    pub fn with_ties(mut self, ties: TtftConfig) -> Self {
        self.ties = ties;
        self
    }

    /// Ranks candidates. `scores[s][i]` is scorer `s`'s score of candidate `i`; `busy[i]` is
    /// candidate `i`'s load in [0, 1] (for least-loaded); round robin starts at candidate
    /// `turn % n`; `rng` breaks ties and drives the random policy.
    pub fn rank(
        &self,
        input: &ScoreInput,
        scores: &[Vec<f64>],
        busy: &[f64],
        turn: u64,
        rng: &mut impl Rng,
    ) -> Ranking {
        let policy = rank_policy(self.policy);
        let predictions = input.predictions();
        let verdict = gate::judge(&self.gate, input, &predictions, policy.gate_work());
        let mut order: Vec<usize> = (0..input.candidates.len()).collect();
        // Shuffle first, then a stable sort: exact ties end up in random order. Here, for every
        // policy, so a seeded run draws the same numbers whichever policy ranks.
        order.shuffle(rng);
        let ctx = Context {
            input,
            scores,
            weights: &self.weights,
            busy,
            predictions: &predictions,
            gate: &verdict,
            ties: &self.ties,
            turn,
        };
        let (totals, reason) = policy.order(&ctx, &mut order);
        Ranking {
            order,
            totals,
            saturated: verdict.saturated,
            reason,
            predictions,
        }
    }
}

/// The policy that ranks for `p`.
fn rank_policy(p: Policy) -> &'static dyn RankPolicy {
    match p {
        Policy::Weighted => &weighted::Weighted,
        Policy::PredictedTtft => &predicted_ttft::PredictedTtft,
        Policy::RoundRobin => &round_robin::RoundRobin,
        Policy::Random => &random::Random,
        Policy::LeastLoaded => &least_loaded::LeastLoaded,
    }
}

/// One routing policy: orders the candidates the gate has judged.
pub(crate) trait RankPolicy: std::fmt::Debug + Send + Sync {
    /// How much of a candidate's own prefill the gate adds to its predicted TTFT.
    fn gate_work(&self) -> f64 {
        1.0
    }

    /// Sorts `order` (shuffled: keep sorts stable so exact ties stay random) best first;
    /// returns each candidate's total (in candidate order) and the reason.
    fn order(&self, ctx: &Context<'_>, order: &mut Vec<usize>) -> (Vec<f64>, Reason);
}

/// What a policy ranks from: the request, the scorers' outputs and the gate's verdict.
#[derive(Debug)]
pub(crate) struct Context<'a> {
    /// The request and its candidates.
    pub input: &'a ScoreInput,
    /// `scores[s][i]`: scorer `s`'s score of candidate `i`.
    pub scores: &'a [Vec<f64>],
    /// `weights[s]` applies to scorer `s`.
    pub weights: &'a [f64],
    /// Each candidate's load in [0, 1].
    pub busy: &'a [f64],
    /// Each candidate's predicted TTFT.
    pub predictions: &'a [Prediction],
    /// Which candidates are gated, and whether a new conversation is spread.
    pub gate: &'a Verdict,
    /// What `predicted-ttft` counts as a tie.
    pub ties: &'a TtftConfig,
    /// Round robin's position.
    pub turn: u64,
}

impl Context<'_> {
    /// How many candidates.
    pub fn len(&self) -> usize {
        self.input.candidates.len()
    }

    /// Candidate `i` is gated: ranked after every candidate that is not.
    pub fn gated(&self, i: usize) -> bool {
        self.gate.gated(i)
    }

    /// `Σ weight × score` per candidate.
    pub fn weighted_totals(&self) -> Vec<f64> {
        (0..self.len())
            .map(|i| {
                self.scores
                    .iter()
                    .zip(self.weights)
                    .map(|(s, w)| w * s.get(i).copied().unwrap_or(0.0))
                    .sum()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;
    use crate::scoring::candidate;

    fn input(n: usize) -> ScoreInput {
        ScoreInput {
            total_blocks: 4,
            candidates: (0..n).map(|i| candidate(&format!("p:{i}"))).collect(),
            new_conversation: false,
            shares_prefix: false,
            prompt_tokens: 0.0,
            tokens_per_block: 16.0,
        }
    }

    #[test]
    fn weighted_sum_orders_candidates() {
        let p = Picker::new(Policy::Weighted, vec![3.0, 1.0], GateConfig::default());
        let scores = vec![vec![0.5, 1.0, 0.0], vec![1.0, 0.0, 0.0]];
        let r = p.rank(
            &input(3),
            &scores,
            &[0.0; 3],
            0,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(r.order, vec![1, 0, 2]);
        assert_eq!(r.totals, vec![2.5, 3.0, 0.0]);
        assert_eq!(r.reason, Reason::Scored);
    }

    #[test]
    fn exact_ties_break_at_random() {
        let p = Picker::new(Policy::Weighted, vec![1.0], GateConfig::default());
        let scores = vec![vec![1.0; 4]];
        let mut firsts = std::collections::HashSet::new();
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..200 {
            firsts.insert(p.rank(&input(4), &scores, &[0.0; 4], 0, &mut rng).order[0]);
        }
        assert_eq!(firsts.len(), 4, "every tied pod must win sometimes");
    }

    #[test]
    fn gate_skips_saturated_unless_all_are() {
        let p = Picker::new(Policy::Weighted, vec![1.0], GateConfig::default());
        let mut inp = input(2);
        inp.candidates[0].load.waiting = 100.0;
        let scores = vec![vec![1.0, 0.0]];
        let r = p.rank(&inp, &scores, &[0.0; 2], 0, &mut StdRng::seed_from_u64(1));
        assert_eq!(r.order, vec![1, 0], "the hot pod becomes a fallback");
        inp.candidates[1].load.fresh = false;
        let r = p.rank(&inp, &scores, &[0.0; 2], 0, &mut StdRng::seed_from_u64(1));
        assert_eq!((r.order[0], r.reason), (0, Reason::AllSaturated));
    }

    #[test]
    fn hot_pod_spills_to_idle_ones() {
        let gate = GateConfig {
            hot_abs: 4.0,
            ..GateConfig::default()
        };
        let p = Picker::new(Policy::Weighted, vec![3.0], gate);
        let mut inp = input(3);
        inp.candidates[0].load.running = 5.0;
        inp.candidates[1].load.running = 1.0;
        inp.candidates[2].load.running = 2.0;
        // The warm pod has 4 more requests than the idlest: still preferred.
        let r = p.rank(
            &inp,
            &[vec![1.0, 0.0, 0.0]],
            &[0.0; 3],
            0,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(r.order[0], 0);
        // One more (this router has six in flight there, the scrape shows five) and it is hot:
        // the prefix no longer wins it the request.
        inp.candidates[0].load.inflight_requests = 6.0;
        let r = p.rank(
            &inp,
            &[vec![1.0, 0.0, 0.0]],
            &[0.0; 3],
            0,
            &mut StdRng::seed_from_u64(1),
        );
        assert_ne!(r.order[0], 0);
        assert_eq!(r.order[2], 0, "the hot pod is the last fallback");
        // Big loads: a difference of 5 is not an imbalance (under 1.5x).
        for c in &mut inp.candidates {
            c.load.running += 100.0;
        }
        let r = p.rank(
            &inp,
            &[vec![1.0, 0.0, 0.0]],
            &[0.0; 3],
            0,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(r.order[0], 0);
    }

    /// Places `conversations` new conversations on a shared prefix, one at a time, each still
    /// running when the next arrives; returns how many each pod got.
    fn place_new_conversations(pods: usize, conversations: usize, gate: GateConfig) -> Vec<usize> {
        let p = Picker::new(Policy::Weighted, vec![3.0, 2.0], gate);
        let mut inp = input(pods);
        let mut rng = StdRng::seed_from_u64(5);
        let mut per_pod = vec![0; pods];
        for k in 0..conversations {
            // The first conversation matches nothing; later ones match the shared prefix
            // wherever an earlier one ran.
            inp.new_conversation = k > 0;
            let prefix: Vec<f64> = inp
                .candidates
                .iter()
                .map(|c| c.matched_blocks / 4.0)
                .collect();
            let load: Vec<f64> = inp
                .candidates
                .iter()
                .map(|c| 1.0 - c.load.inflight_requests / 32.0)
                .collect();
            let r = p.rank(&inp, &[prefix, load], &[0.0; 8][..pods], k as u64, &mut rng);
            let c = &mut inp.candidates[r.order[0]];
            c.matched_blocks = 3.0;
            c.load.inflight_requests += 1.0;
            per_pod[r.order[0]] += 1;
            assert_eq!(r.reason == Reason::Spread, k > 0 && gate_on(&p));
        }
        per_pod.sort_unstable();
        per_pod
    }

    fn gate_on(p: &Picker) -> bool {
        p.gate.enabled && p.gate.spread_new_conversations
    }

    #[test]
    fn conversations_between_turns_still_count() {
        // Two pods hold the prefix, nothing is in flight: the one with fewer conversations.
        let p = Picker::new(Policy::Weighted, vec![3.0], GateConfig::default());
        let mut inp = input(3);
        inp.new_conversation = true;
        for (c, (m, conv)) in inp
            .candidates
            .iter_mut()
            .zip([(3.0, 2.0), (3.0, 1.0), (0.0, 0.0)])
        {
            c.matched_blocks = m;
            c.conversations = conv;
        }
        let prefix = vec![vec![0.75, 0.75, 0.0]];
        let mut rng = StdRng::seed_from_u64(1);
        let r = p.rank(&inp, &prefix, &[0.0; 3], 0, &mut rng);
        assert_eq!((r.order[0], r.reason), (1, Reason::Spread));
        // One holder with nothing in flight and no conversation this replica knows of (another
        // replica routed it): the conversation that warmed it still counts, a second pod warms.
        inp.candidates[0].conversations = 0.0;
        inp.candidates[1].matched_blocks = 0.0;
        let r = p.rank(&inp, &[vec![0.75, 0.0, 0.0]], &[0.0; 3], 0, &mut rng);
        assert_ne!(r.order[0], 0);
    }

    #[test]
    fn new_conversations_on_a_shared_prefix_spread_over_two_pods_then_by_load() {
        let gate = GateConfig::default;
        assert_eq!(place_new_conversations(2, 2, gate()), vec![1, 1]);
        assert_eq!(place_new_conversations(2, 3, gate()), vec![1, 2]);
        // Four conversations on four pods: two pods warm the prefix, not four.
        assert_eq!(place_new_conversations(4, 4, gate()), vec![0, 0, 2, 2]);
        assert_eq!(place_new_conversations(4, 2, gate()), vec![0, 0, 1, 1]);
        // Sixteen: every pod ends up with four.
        assert_eq!(place_new_conversations(4, 16, gate()), vec![4, 4, 4, 4]);
        // Off (or the gate off): the first holder keeps every conversation, as before.
        let off = GateConfig {
            spread_new_conversations: false,
            ..gate()
        };
        assert_eq!(place_new_conversations(2, 3, off), vec![0, 3]);
    }

    /// Three candidates of a 1600-token prompt: pod 0 holds 80 of its 100 blocks, 1 and 2 none.
    fn ttft_input() -> ScoreInput {
        let mut inp = input(3);
        inp.prompt_tokens = 1600.0;
        inp.tokens_per_block = 16.0;
        inp.candidates[0].matched_blocks = 80.0;
        inp
    }

    fn ttft_first(inp: &ScoreInput) -> (usize, Reason) {
        let p = Picker::new(Policy::PredictedTtft, vec![3.0], GateConfig::default());
        let prefix = inp.candidates.iter().map(|c| c.matched_blocks / 100.0);
        let scores = vec![prefix.collect()];
        let r = p.rank(inp, &scores, &[0.0; 3], 0, &mut StdRng::seed_from_u64(2));
        assert!(r.totals.iter().all(|t| t.is_finite() && *t <= 0.0));
        (r.order[0], r.reason)
    }

    #[test]
    fn predicted_ttft_takes_the_warm_pod_until_its_queue_costs_more() {
        // Idle fleet: the warm pod computes 320 tokens instead of 1600 (ranked by 42 ms of
        // TTFT + 32 ms of work left on the pod, against 170 + 160 on a cold one).
        let mut inp = ttft_input();
        assert_eq!(ttft_first(&inp), (0, Reason::Scored));
        // 3000 tokens of this router's requests still prefilling there (300 ms at the prior's
        // 10k tokens/s) outweigh the 256 ms the cache saves: a cold pod is ranked first.
        inp.candidates[0].load.inflight_tokens = 3000.0;
        assert_ne!(ttft_first(&inp).0, 0);
        // The pod's own queue counts too (another replica's requests): 3 waiting at the mean.
        inp.candidates[0].load.inflight_tokens = 0.0;
        inp.candidates[0].load.waiting = 3.0;
        assert_ne!(ttft_first(&inp).0, 0);
    }

    #[test]
    fn predicted_ttft_prices_each_pods_learned_speed() {
        // Nothing cached anywhere; pod 1 learned to prefill 4x slower, pod 2 2x faster.
        let mut inp = ttft_input();
        inp.candidates[0].matched_blocks = 0.0;
        inp.candidates[1].model.sec_per_token *= 4.0;
        inp.candidates[2].model.sec_per_token /= 2.0;
        assert_eq!(ttft_first(&inp).0, 2);
        // The fast pod with a queue loses to the idle one of the prior's speed.
        inp.candidates[2].load.inflight_tokens = 4000.0;
        assert_eq!(ttft_first(&inp).0, 0);
    }

    #[test]
    fn predicted_ttft_breaks_near_ties_toward_the_cache() {
        // Pod 0 holds one block more but 100 in-flight tokens: ranked 6.8 ms behind, inside the
        // 16.5 ms tie band (5 %), so the weighted score (its cache match) decides.
        let mut inp = ttft_input();
        inp.candidates[0].matched_blocks = 1.0;
        inp.candidates[0].load.inflight_tokens = 100.0;
        assert_eq!(ttft_first(&inp).0, 0);
        // A hot pod (ten requests running, the others idle) that holds the prompt and has
        // nothing queued would still answer first: it stays eligible...
        inp.candidates[0].matched_blocks = 80.0;
        inp.candidates[0].load.inflight_tokens = 0.0;
        inp.candidates[0].load.running = 10.0;
        assert_eq!(ttft_first(&inp).0, 0);
        // ...and is gated once its queue costs more than a cold pod's prefill.
        inp.candidates[0].load.waiting = 3.0;
        assert_ne!(ttft_first(&inp).0, 0);
    }

    #[test]
    fn a_hot_pod_that_would_answer_first_is_not_spilled() {
        // Weighted: pod 0 holds a long prompt's 80 of 100 blocks and runs five requests more
        // than the idlest. Spilling it sends 1280 more tokens to prefill on a cold pod.
        let p = Picker::new(Policy::Weighted, vec![3.0, 2.0], GateConfig::default());
        let mut inp = ttft_input();
        inp.candidates[0].load.running = 5.0;
        let scores = vec![vec![0.8, 0.0, 0.0], vec![0.84, 1.0, 1.0]];
        let first = |inp: &ScoreInput| {
            p.rank(inp, &scores, &[0.0; 3], 0, &mut StdRng::seed_from_u64(3))
                .order[0]
        };
        assert_eq!(first(&inp), 0);
        // Its own queue (router-side tokens still prefilling there) makes it the slower one.
        inp.candidates[0].load.inflight_tokens = 3000.0;
        assert_ne!(first(&inp), 0);
    }

    #[test]
    fn a_busy_holder_of_a_long_history_keeps_it_while_moving_it_costs_more() {
        // Weighted: a 100k-token turn whose first 96k tokens only pod 0 holds. Elsewhere it
        // would prefill 10 s at the prior's 10k tokens/s, and leave that work on the new pod.
        let p = Picker::new(Policy::Weighted, vec![3.0, 2.0], GateConfig::default());
        let mut inp = input(3);
        inp.prompt_tokens = 100_000.0;
        inp.candidates[0].matched_blocks = 6000.0;
        let scores = vec![vec![0.96, 0.0, 0.0], vec![0.0, 1.0, 1.0]];
        let first = |inp: &ScoreInput| {
            p.rank(inp, &scores, &[0.0; 3], 0, &mut StdRng::seed_from_u64(3))
                .order[0]
        };
        // Saturated by this router's tokens in flight (70k: 7 s of queue): it still answers
        // before a cold pod would (before, the saturation gate spilled it regardless).
        inp.candidates[0].load.inflight_tokens = 70_000.0;
        assert_eq!(first(&inp), 0);
        // Hot, and 7 waiting requests of 2 s each: 14.4 s against a cold pod's 10 s, but the
        // cold pod would also compute 96k tokens more (before, the slower TTFT alone spilled it).
        inp.candidates[0].load.inflight_tokens = 0.0;
        inp.candidates[0].load.running = 5.0;
        inp.candidates[0].load.waiting = 7.0;
        inp.candidates[0].model.mean_prefill_s = 2.0;
        assert_eq!(first(&inp), 0);
        // At 4 s each the queue outweighs both: the turn moves.
        inp.candidates[0].model.mean_prefill_s = 4.0;
        assert_ne!(first(&inp), 0);
    }

    #[test]
    fn predicted_ttft_spreads_new_conversations() {
        let mut inp = ttft_input();
        inp.new_conversation = true;
        inp.candidates[0].conversations = 2.0;
        let (first, reason) = ttft_first(&inp);
        assert_eq!(reason, Reason::Spread);
        assert_ne!(
            first, 0,
            "the holder is committed; a second pod warms the prefix"
        );
    }

    #[test]
    fn a_sessionless_prompt_leaves_its_busy_holder_for_an_idle_pod_that_answers_sooner() {
        // Pod 0 holds a long system prompt (80 of 100 blocks); the prompt names no session.
        let on = GateConfig {
            replicate_to_idle: true,
            ..GateConfig::default()
        };
        let weighted = Picker::new(Policy::Weighted, vec![3.0, 1.0], on);
        let rank = |inp: &ScoreInput, p: &Picker| {
            let prefix: Vec<f64> = inp
                .candidates
                .iter()
                .map(|c| c.matched_blocks / 100.0)
                .collect();
            let scores = vec![prefix, vec![1.0; 3]];
            let r = p.rank(inp, &scores, &[0.0; 3], 0, &mut StdRng::seed_from_u64(5));
            (r.order[0], r.reason)
        };
        let mut inp = ttft_input();
        inp.total_blocks = 100;
        inp.shares_prefix = true;
        // An idle holder keeps it: a one-off question on a shared document warms nothing new;
        // so does one whose last scrape still shows a request that has since ended (questions
        // sent one after another alternated between two pods: tests/integration/e2e.rs).
        assert_eq!(rank(&inp, &weighted), (0, Reason::Scored));
        inp.candidates[0].load.running = 1.0;
        inp.candidates[0].load.inflight_tokens = 2000.0;
        assert_eq!(rank(&inp, &weighted), (0, Reason::Scored), "stale scrape");
        inp.candidates[0].load.running = 0.0;
        // The holder is prefilling another conversation's first turn (2000 tokens of this
        // router's requests): an idle pod computes the whole prompt sooner, and warms the prefix.
        inp.candidates[0].load.inflight_requests = 1.0;
        inp.candidates[0].load.inflight_tokens = 2000.0;
        let (first, reason) = rank(&inp, &weighted);
        assert_eq!(reason, Reason::Spread);
        assert_ne!(first, 0);
        // Only to a pod with no requests, and only when it would answer sooner.
        for c in &mut inp.candidates[1..] {
            c.load.running = 1.0;
        }
        assert_eq!(rank(&inp, &weighted), (0, Reason::Scored));
        inp.candidates[1].load.running = 0.0;
        inp.candidates[2].load.running = 0.0;
        inp.candidates[0].load.inflight_tokens = 100.0;
        assert_eq!(rank(&inp, &weighted), (0, Reason::Scored), "short queue");
        inp.candidates[0].load.inflight_tokens = 2000.0;
        assert_eq!(rank(&inp, &weighted).0, 1);
        // Only while at most half the fleet has requests: a busy fleet's idle pod is a gap
        // between arrivals (make bench's 8-pod conversation window lost hits to it).
        inp.candidates[2].load.running = 1.0;
        assert_eq!(rank(&inp, &weighted), (0, Reason::Scored), "2 of 3 busy");
        inp.candidates[2].load.running = 0.0;
        // Only when the shared part is the longer one: otherwise a new conversation is
        // spread by `spread_new_conversations` once its prefix is shared.
        inp.candidates[0].matched_blocks = 40.0;
        assert_eq!(rank(&inp, &weighted).1, Reason::Scored, "own part longer");
        inp.candidates[0].matched_blocks = 80.0;
        assert_eq!(rank(&inp, &weighted).0, 1);
        // A continuation (not sharing only a prefix), or the switch off: the holder keeps it.
        inp.shares_prefix = false;
        assert_eq!(rank(&inp, &weighted), (0, Reason::Scored));
        inp.shares_prefix = true;
        let off = GateConfig {
            replicate_to_idle: false,
            ..GateConfig::default()
        };
        let p = Picker::new(Policy::Weighted, vec![3.0, 1.0], off);
        assert_eq!(rank(&inp, &p), (0, Reason::Scored));
    }

    #[test]
    fn predicted_ttft_leaves_equal_cold_pods_to_chance_whatever_their_learning_noise() {
        // Nothing cached, every pod idle; pod 1 learned a 1 % faster speed (it served more).
        // Before, the prediction broke the weighted score's exact tie and every cold request
        // went to pod 1: on 64 pods one pod took 292 of 3993 synthetic requests.
        let mut inp = ttft_input();
        inp.candidates[0].matched_blocks = 0.0;
        inp.candidates[1].model.sec_per_token *= 0.99;
        let p = Picker::new(Policy::PredictedTtft, vec![3.0], GateConfig::default());
        let scores = vec![vec![0.0; 3]];
        let mut rng = StdRng::seed_from_u64(4);
        let mut firsts = std::collections::HashSet::new();
        for _ in 0..100 {
            firsts.insert(p.rank(&inp, &scores, &[0.0; 3], 0, &mut rng).order[0]);
        }
        assert_eq!(firsts.len(), 3, "{firsts:?}");
    }

    #[test]
    fn a_slow_pod_counts_each_new_conversation_as_many_times_as_it_is_slower() {
        let p = Picker::new(Policy::Weighted, vec![3.0], GateConfig::default());
        let mut inp = input(2);
        inp.new_conversation = true;
        inp.candidates[0].conversations = 1.0;
        inp.candidates[1].conversations = 2.0;
        let first = |inp: &ScoreInput| {
            let r = p.rank(
                inp,
                &[vec![0.0; 2]],
                &[0.0; 2],
                0,
                &mut StdRng::seed_from_u64(1),
            );
            assert_eq!(r.reason, Reason::Spread);
            r.order[0]
        };
        assert_eq!(first(&inp), 0, "fewer conversations");
        // Pod 0 prefills four times slower: its one conversation weighs four.
        inp.candidates[0].model.sec_per_token *= 4.0;
        assert_eq!(first(&inp), 1);
        // A little slower (learning noise) changes nothing.
        inp.candidates[0].model.sec_per_token /= 3.8;
        assert_eq!(first(&inp), 0);
    }

    #[test]
    fn baseline_policies_follow_turn_load_and_chance() {
        let rr = Picker::new(Policy::RoundRobin, vec![], GateConfig::default());
        let mut rng = StdRng::seed_from_u64(1);
        let firsts: Vec<usize> = (0..6u64)
            .map(|turn| rr.rank(&input(3), &[], &[0.0; 3], turn, &mut rng).order[0])
            .collect();
        assert_eq!(firsts, vec![0, 1, 2, 0, 1, 2]);
        let ll = Picker::new(Policy::LeastLoaded, vec![], GateConfig::default());
        assert_eq!(
            ll.rank(&input(3), &[], &[0.5, 0.1, 0.9], 0, &mut rng).order,
            vec![1, 0, 2]
        );
        let rnd = Picker::new(Policy::Random, vec![], GateConfig::default());
        assert_eq!(
            rnd.rank(&input(3), &[], &[0.0; 3], 0, &mut rng).order.len(),
            3
        );
        assert!(rr.rank(&input(0), &[], &[], 7, &mut rng).order.is_empty());
    }
}
