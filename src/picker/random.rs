//! `random` (baseline): a uniformly random candidate, ignoring scores and the gate.

use super::{Context, RankPolicy, Reason};

/// Keeps the picker's shuffle as the order: the shuffle is the draw.
#[derive(Debug)]
pub(crate) struct Random;

impl RankPolicy for Random {
    fn order(&self, ctx: &Context<'_>, _order: &mut Vec<usize>) -> (Vec<f64>, Reason) {
        (vec![0.0; ctx.len()], Reason::Policy)
    }
}
