//! Spreading new conversations on a shared prefix: ungated candidates first, then the least
//! committed pod, then the policy's own cost. Weighted and predicted-ttft share it.

use crate::scoring::{Candidate, ScoreInput};

use super::Context;

/// Sorts `order` for a new conversation: ungated first, then the least committed pod, then `cost`.
pub(crate) fn order(ctx: &Context<'_>, order: &mut [usize], cost: &[f64]) {
    let commitments = commitments(ctx.input);
    order.sort_by(|&a, &b| {
        ctx.gated(a)
            .cmp(&ctx.gated(b))
            .then(commitments[a].total_cmp(&commitments[b]))
            .then(cost[a].total_cmp(&cost[b]))
    });
}

/// What placing a new conversation on each candidate commits it to: the larger of the requests
/// the pod carries (its own count or this router's in-flight one, often the same requests) and
/// the live conversations on it (sessions pinned there, or recent new conversations placed there
/// when requests name no session). When the shared prefix is at least as long as the rest of the
/// prompt, so that warming another pod would cost more than the conversation's own text: at
/// least one on the sole holder of the prefix (the conversation that warmed it lives there, even
/// between its turns or when another replica routed it), and one more on a pod that would first
/// have to prefill the prefix once two pods already hold it. So the second conversation on a
/// long system prompt warms a second pod, and further ones go to the least committed holder
/// until every holder carries one more than a pod that does not hold it. A short shared prefix
/// (a few hundred tokens before a long document) is cheap to warm anywhere: conversations then
/// spread over every pod by what each carries, so each pod's cache turns over at the same pace.
/// A pod that prefills several times slower than the fleet's fastest (as learned) counts each
/// commitment that many times (rounded, so learning noise breaks no tie).
fn commitments(input: &ScoreInput) -> Vec<f64> {
    let fastest = input
        .candidates
        .iter()
        .map(|c| c.model.sec_per_token)
        .filter(|s| s.is_finite() && *s > 0.0)
        .fold(f64::INFINITY, f64::min);
    let slowness = |c: &Candidate| {
        let s = c.model.sec_per_token / fastest;
        if s.is_finite() {
            s.round().max(1.0)
        } else {
            1.0
        }
    };
    let best = input
        .candidates
        .iter()
        .map(|c| c.matched_blocks)
        .fold(0.0, f64::max);
    let shared_tokens = best * input.tokens_per_block;
    let costly_to_warm = shared_tokens >= input.prompt_tokens - shared_tokens;
    // A holder has at least half the best match: most of the shared prefix is warm there.
    let holds = |m: f64| best > 0.0 && m >= best / 2.0;
    let holders = input
        .candidates
        .iter()
        .filter(|c| holds(c.matched_blocks))
        .count();
    input
        .candidates
        .iter()
        .map(|c| {
            let l = &c.load;
            let mut committed = l.requests().max(c.conversations);
            if costly_to_warm && holders == 1 && holds(c.matched_blocks) {
                committed = committed.max(1.0);
            }
            if costly_to_warm && holders >= 2 && !holds(c.matched_blocks) {
                committed += 1.0;
            }
            committed * slowness(c)
        })
        .collect()
}
