//! `predicted-ttft`: the lowest predicted time to first token plus the prefill work it leaves
//! the pod with, behind the gate; near-ties go to the weighted score (cache affinity).

use super::{spread, Context, RankPolicy, Reason};

/// Ranks by `ttft + work_weight × prefill`, ties within the band by the weighted score.
#[derive(Debug)]
pub(crate) struct PredictedTtft;

impl RankPolicy for PredictedTtft {
    /// This policy prices the prefill work in its own ranking; counting it in the gate as well
    /// kept hot holders past where its ranking leaves them (simulate, conversation window: 0.90
    /// -> 0.80 of pooled), so its gate compares TTFTs alone.
    fn gate_work(&self) -> f64 {
        0.0
    }

    fn order(&self, ctx: &Context<'_>, order: &mut Vec<usize>) -> (Vec<f64>, Reason) {
        let n = ctx.len();
        // The request's wait plus the prefill work it leaves the pod with.
        let ttft: Vec<f64> = ctx
            .predictions
            .iter()
            .map(|p| p.ttft_ms + ctx.ties.work_weight * p.prefill_ms)
            .collect();
        if ctx.gate.spread {
            spread::order(ctx, order, &ttft);
        } else {
            let best = (0..n)
                .filter(|&i| !ctx.gated(i))
                .map(|i| ttft[i])
                .fold(f64::INFINITY, f64::min);
            let band = best + ctx.ties.tie_ms.max(ctx.ties.tie_ratio * best);
            let tied = |i: usize| ttft[i] <= band;
            let weighted = ctx.weighted_totals();
            order.sort_by(|&a, &b| {
                ctx.gated(a)
                    .cmp(&ctx.gated(b))
                    .then(tied(b).cmp(&tied(a)))
                    .then_with(|| {
                        if tied(a) && tied(b) {
                            // Near-equal predictions: the weighted score (cache affinity, the
                            // session's pod, load and KV usage) decides, and equal scores stay in
                            // random order. Falling back to the prediction would hand every cold
                            // request to the pod learned a hair faster, which is the pod that has
                            // served the most.
                            weighted[b].total_cmp(&weighted[a])
                        } else {
                            ttft[a].total_cmp(&ttft[b])
                        }
                    })
            });
        }
        (ttft.iter().map(|t| -t).collect(), ctx.gate.reason())
    }
}
