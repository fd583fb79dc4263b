//! `weighted`: the weighted sum of the prefix, session and load scorers, best first, behind the
//! gate; new conversations on a shared prefix spread by commitments, then by that sum.

use super::{spread, Context, RankPolicy, Reason};

/// Ranks by `Σ weight × score`.
#[derive(Debug)]
pub(crate) struct Weighted;

impl RankPolicy for Weighted {
    fn order(&self, ctx: &Context<'_>, order: &mut Vec<usize>) -> (Vec<f64>, Reason) {
        let totals = ctx.weighted_totals();
        if ctx.gate.spread {
            let cost: Vec<f64> = totals.iter().map(|t| -t).collect();
            spread::order(ctx, order, &cost);
        } else {
            order.sort_by(|&a, &b| {
                ctx.gated(a)
                    .cmp(&ctx.gated(b))
                    .then(totals[b].total_cmp(&totals[a]))
            });
        }
        (totals, ctx.gate.reason())
    }
}
