//! `round-robin` (baseline): rotate over the candidates, ignoring scores and the gate.

use super::{Context, RankPolicy, Reason};

/// Starts at candidate `turn % n` and goes round.
#[derive(Debug)]
pub(crate) struct RoundRobin;

impl RankPolicy for RoundRobin {
    fn order(&self, ctx: &Context<'_>, order: &mut Vec<usize>) -> (Vec<f64>, Reason) {
        let n = ctx.len();
        let start = if n == 0 {
            0
        } else {
            (ctx.turn % n as u64) as usize
        };
        *order = (0..n).map(|k| (start + k) % n).collect();
        (vec![0.0; n], Reason::Policy)
    }
}
