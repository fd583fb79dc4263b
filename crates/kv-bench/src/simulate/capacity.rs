//! Capacity planning: the smallest fleet whose TTFT percentile meets a target, found by a sweep
//! of fleet sizes that run in parallel but are judged in ascending order.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use serde::Serialize;

use super::options::{CapacityOptions, SimulateOptions};
use super::outcome::StrategyResult;

/// One fleet size of the capacity sweep.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CapacityPoint {
    /// Fleet size.
    pub pods: usize,
    /// TTFT at the plan's percentile, ms.
    pub ttft_ms: f64,
    /// p99 TTFT, ms.
    pub ttft_p99_ms: f64,
    /// Prefix hit ratio.
    pub hit_ratio: f64,
    /// Hotspot factor.
    pub hotspot: f64,
    /// Whether it meets the target.
    pub meets: bool,
}

/// How the capacity sweep ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PlanOutcome {
    /// A fleet size met the target: the answer.
    Met,
    /// The next size improved the TTFT percentile by less than [`LEVEL_OFF`] and still missed:
    /// the target is below what the model's prefill time allows at any fleet size.
    LevelledOff,
    /// Every size was tried and none met the target.
    Exhausted,
}

/// Relative TTFT improvement under which a larger fleet counts as no longer helping.
pub const LEVEL_OFF: f64 = 0.05;

/// The capacity-planning answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CapacityPlan {
    /// What was asked.
    pub options: CapacityOptions,
    /// Fleet sizes simulated, ascending, up to the one that ended the sweep.
    pub points: Vec<CapacityPoint>,
    /// Smallest fleet meeting the target (None: none of the sizes tried).
    pub answer: Option<usize>,
    /// Why the sweep ended.
    pub outcome: PlanOutcome,
}

/// Fleet sizes of a sweep: positive, ascending, distinct.
pub(super) fn sweep_sizes(c: &CapacityOptions, opts: &SimulateOptions) -> Vec<usize> {
    let mut sizes: Vec<usize> = c.pods.iter().copied().filter(|&n| n > 0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    // The comparison run already covers this size with the plan's strategy.
    sizes.retain(|&n| !(n == opts.pods && opts.strategies.contains(&c.strategy)));
    sizes
}

/// Capacity-sweep state shared by the workers. Sizes run in parallel, but the outcome is read
/// from the completed sizes in ascending order only, so it does not depend on timing.
pub(super) struct Sweep<'a> {
    pub(super) opts: &'a CapacityOptions,
    /// Every size that counts (comparison run included), ascending.
    pub(super) sizes: Vec<usize>,
    /// Results by size (at most one per entry of `sizes`).
    pub(super) done: Mutex<BTreeMap<usize, StrategyResult>>,
    /// Sizes above this one need not run.
    pub(super) stop: AtomicUsize,
}

impl<'a> Sweep<'a> {
    pub(super) fn new(opts: &'a CapacityOptions) -> Self {
        let mut sizes: Vec<usize> = opts.pods.iter().copied().filter(|&n| n > 0).collect();
        sizes.sort_unstable();
        sizes.dedup();
        Self {
            opts,
            sizes,
            done: Mutex::new(Default::default()),
            stop: AtomicUsize::new(usize::MAX),
        }
    }

    pub(super) fn ttft(&self, r: &StrategyResult) -> f64 {
        r.ttft_at(self.opts.percentile)
    }

    pub(super) fn meets(&self, r: &StrategyResult) -> bool {
        self.ttft(r) <= self.opts.ttft_target_ms
    }

    pub(super) fn skips(&self, pods: usize) -> bool {
        pods > self.stop.load(Ordering::Relaxed)
    }

    /// The size that ends the sweep and why, judged on the completed ascending prefix.
    pub(super) fn outcome(
        &self,
        done: &BTreeMap<usize, StrategyResult>,
    ) -> Option<(usize, PlanOutcome)> {
        let mut prev: Option<f64> = None;
        for n in &self.sizes {
            let r = done.get(n)?;
            if self.meets(r) {
                return Some((*n, PlanOutcome::Met));
            }
            let t = self.ttft(r);
            if prev.is_some_and(|p| t >= p * (1.0 - LEVEL_OFF)) {
                return Some((*n, PlanOutcome::LevelledOff));
            }
            prev = Some(t);
        }
        None
    }

    pub(super) fn record(&self, r: StrategyResult) {
        let mut done = self.done.lock();
        done.insert(r.pods, r);
        if let Some((n, _)) = self.outcome(&done) {
            self.stop.fetch_min(n, Ordering::Relaxed);
        }
    }

    pub(super) fn plan(self) -> CapacityPlan {
        let done = self.done.lock();
        let (last, outcome) = self
            .outcome(&done)
            .unwrap_or((usize::MAX, PlanOutcome::Exhausted));
        let points: Vec<CapacityPoint> = done
            .values()
            .filter(|r| r.pods <= last)
            .map(|r| CapacityPoint {
                pods: r.pods,
                ttft_ms: self.ttft(r),
                ttft_p99_ms: r.ttft_p99_ms,
                hit_ratio: r.hit_ratio,
                hotspot: r.hotspot,
                meets: self.meets(r),
            })
            .collect();
        CapacityPlan {
            options: self.opts.clone(),
            answer: (outcome == PlanOutcome::Met).then_some(last),
            points,
            outcome,
        }
    }
}
