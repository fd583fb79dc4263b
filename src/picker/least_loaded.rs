//! `least-loaded` (baseline, and the fallback for requests without a usable body): the lowest
//! load first, ignoring scores and the gate.

use super::{Context, RankPolicy, Reason};

/// Ranks by the load in [0, 1], exact ties in the picker's random order.
#[derive(Debug)]
pub(crate) struct LeastLoaded;

impl RankPolicy for LeastLoaded {
    fn order(&self, ctx: &Context<'_>, order: &mut Vec<usize>) -> (Vec<f64>, Reason) {
        let busy = ctx.busy;
        order.sort_by(|&a, &b| busy[a].total_cmp(&busy[b]));
        (
            (0..ctx.len()).map(|i| 1.0 - busy[i]).collect(),
            Reason::Policy,
        )
    }
}
