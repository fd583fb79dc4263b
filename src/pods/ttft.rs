//! A pod's prefill model for the predicted time to first token, learned online from the prefill
//! counters its engine reports ([`EngineTiming`]); `scoring::predict` applies it to a request.
//!
//! Model: a request's prefill on pod `p` takes `overhead_p + uncached_tokens × sec_per_token_p`
//! (vLLM's `request_prefill_time_seconds`: scheduled until first token). Between two scrapes the
//! engine reports how many prefills finished (`n`), how many uncached tokens they computed (`T`)
//! and how long they took in total (`S`), so `S ≈ n·overhead + T·sec_per_token`: a two-parameter
//! least-squares fit over the scrape intervals, older intervals forgotten geometrically, with the
//! configured prior as pseudo-observations so a cold pod starts from sane values and a pod that
//! reports nothing stays there.

use serde::Serialize;

use super::EngineTiming;

/// Tokens per unit of the fit's second feature (keeps the 2×2 system well conditioned).
const TOKENS_UNIT: f64 = 1000.0;
/// Weight kept by earlier intervals at each new one (memory of ~100 intervals with prefills:
/// long enough to average out counters that vLLM updates at different moments).
const FORGET: f64 = 0.99;
/// Intervals with fewer prefills or more than this many carry no usable signal / are suspect.
const MAX_PREFILLS_PER_INTERVAL: f64 = 1e6;
/// No pod prefills slower than this per token or faster than its inverse bound.
const SEC_PER_TOKEN_RANGE: (f64, f64) = (1e-8, 1.0);
/// No per-request overhead beyond this (seconds).
const MAX_OVERHEAD_S: f64 = 60.0;

/// Where a model starts: the configured prefill speed and per-request overhead, held with the
/// weight of `weight` requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftPrior {
    /// Seconds per uncached prompt token.
    pub sec_per_token: f64,
    /// Seconds per request besides its tokens.
    pub overhead_s: f64,
    /// How many observed prefills the prior counts as.
    pub weight: f64,
}

impl TtftPrior {
    /// From a prefill rate (tokens/s), an overhead (ms) and a weight in requests.
    pub fn new(prefill_tokens_per_sec: f64, overhead_ms: f64, weight: f64) -> Self {
        let rate = if prefill_tokens_per_sec > 0.0 {
            prefill_tokens_per_sec
        } else {
            10_000.0
        };
        Self {
            sec_per_token: (1.0 / rate).clamp(SEC_PER_TOKEN_RANGE.0, SEC_PER_TOKEN_RANGE.1),
            overhead_s: (overhead_ms.max(0.0) / 1e3).min(MAX_OVERHEAD_S),
            weight: weight.max(1e-3),
        }
    }

    /// The prior's own model (no observations).
    pub fn model(&self) -> TtftModel {
        TtftModel {
            sec_per_token: self.sec_per_token,
            overhead_s: self.overhead_s,
            mean_prefill_s: self.overhead_s + self.sec_per_token * TOKENS_UNIT,
            prefills: 0.0,
        }
    }
}

impl Default for TtftPrior {
    fn default() -> Self {
        Self::new(10_000.0, 10.0, 1.0)
    }
}

/// A pod's learned coefficients (a plain value: the decision reads it like the pod's load).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TtftModel {
    /// Seconds of prefill per uncached prompt token.
    pub sec_per_token: f64,
    /// Seconds per request besides its tokens.
    pub overhead_s: f64,
    /// Mean prefill time of the requests this pod served lately (prices a waiting request whose
    /// size this router does not know).
    pub mean_prefill_s: f64,
    /// Observed prefills the fit rests on, after forgetting (0: the prior alone).
    pub prefills: f64,
}

impl Default for TtftModel {
    fn default() -> Self {
        TtftPrior::default().model()
    }
}

/// Online fit of one pod's [`TtftModel`] from successive [`EngineTiming`] scrapes; the prior
/// (configuration) is applied when the model is read.
#[derive(Debug, Clone, Default)]
pub struct TtftLearner {
    last: Option<EngineTiming>,
    /// Σ x xᵀ and Σ x y over intervals, x = (prefills, tokens / TOKENS_UNIT), y = seconds.
    xx: [[f64; 2]; 2],
    xy: [f64; 2],
    prefills: f64,
    seconds: f64,
}

impl TtftLearner {
    /// Takes the next scrape's counters; returns whether the interval taught anything. A counter
    /// that went backwards (engine restart) starts a new baseline; garbage is ignored.
    pub fn observe(&mut self, now: EngineTiming) -> bool {
        let valid = [
            now.prefill_tokens,
            now.prefills,
            now.prefill_seconds,
            now.queued,
            now.queue_seconds,
        ]
        .iter()
        .all(|v| v.is_finite() && *v >= 0.0);
        if !valid {
            return false;
        }
        let Some(last) = self.last.replace(now) else {
            return false;
        };
        let n = now.prefills - last.prefills;
        let tokens = now.prefill_tokens - last.prefill_tokens;
        let secs = now.prefill_seconds - last.prefill_seconds;
        if n < 0.0 || tokens < 0.0 || secs < 0.0 {
            return false; // restarted: `now` is the new baseline
        }
        if !(1.0..=MAX_PREFILLS_PER_INTERVAL).contains(&n) {
            return false;
        }
        let x = [n, tokens / TOKENS_UNIT];
        for (i, xi) in x.iter().enumerate() {
            for (j, xj) in x.iter().enumerate() {
                self.xx[i][j] = FORGET * self.xx[i][j] + xi * xj;
            }
            self.xy[i] = FORGET * self.xy[i] + xi * secs;
        }
        self.prefills = FORGET * self.prefills + n;
        self.seconds = FORGET * self.seconds + secs;
        true
    }

    /// The coefficients: the regularised 2×2 least-squares solution, the prior entering as
    /// `weight` pseudo-observations of each coefficient.
    pub fn model(&self, prior: &TtftPrior) -> TtftModel {
        let p = prior;
        if self.prefills <= 0.0 {
            return p.model();
        }
        let w = p.weight;
        // Pseudo-rows (1, 0) → overhead and (0, 1) → the time of TOKENS_UNIT tokens, each with
        // weight w: each coefficient shrinks toward its own prior.
        let a = [
            [self.xx[0][0] + w, self.xx[0][1]],
            [self.xx[1][0], self.xx[1][1] + w],
        ];
        let b = [
            self.xy[0] + w * p.overhead_s,
            self.xy[1] + w * p.sec_per_token * TOKENS_UNIT,
        ];
        let det = a[0][0] * a[1][1] - a[0][1] * a[1][0];
        let (overhead, per_unit) = if det.abs() > f64::EPSILON * a[0][0] * a[1][1] {
            (
                (b[0] * a[1][1] - a[0][1] * b[1]) / det,
                (a[0][0] * b[1] - a[1][0] * b[0]) / det,
            )
        } else {
            (p.overhead_s, p.sec_per_token * TOKENS_UNIT)
        };
        let sec_per_token = (per_unit / TOKENS_UNIT)
            .max(SEC_PER_TOKEN_RANGE.0)
            .min(SEC_PER_TOKEN_RANGE.1);
        let overhead_s = overhead.clamp(0.0, MAX_OVERHEAD_S);
        let mean_prefill_s =
            (self.seconds + w * p.model().mean_prefill_s) / (self.prefills + w).max(1e-9);
        TtftModel {
            sec_per_token,
            overhead_s,
            mean_prefill_s: mean_prefill_s.clamp(0.0, MAX_OVERHEAD_S),
            prefills: self.prefills,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(prefills: f64, tokens: f64, secs: f64) -> EngineTiming {
        EngineTiming {
            prefill_tokens: tokens,
            prefills,
            prefill_seconds: secs,
            ..EngineTiming::default()
        }
    }

    /// Feeds `intervals` scrapes of a pod whose prefill costs `overhead + tokens × spt`,
    /// requests of alternating sizes.
    fn learn(spt: f64, overhead: f64, intervals: usize) -> TtftLearner {
        let mut l = TtftLearner::default();
        let (mut n, mut t, mut s) = (0.0, 0.0, 0.0);
        l.observe(timing(n, t, s));
        for i in 0..intervals {
            let size = [200.0, 3000.0, 800.0][i % 3];
            let reqs = 1.0 + (i % 2) as f64;
            n += reqs;
            t += reqs * size;
            s += reqs * (overhead + size * spt);
            l.observe(timing(n, t, s));
        }
        l
    }

    #[test]
    fn converges_to_each_pods_speed() {
        for (spt, overhead) in [(1e-4, 0.015), (4e-4, 0.015), (2e-5, 0.002)] {
            let m = learn(spt, overhead, 200).model(&TtftPrior::default());
            assert!((m.sec_per_token / spt - 1.0).abs() < 0.03, "{spt}: {m:?}");
            // The prior still pulls a little (it counts as 1 of ~150 remembered prefills); the
            // split between overhead and per-token time absorbs it, the prediction does not.
            for size in [200.0, 800.0, 3000.0] {
                let truth = overhead + size * spt;
                let predicted = m.overhead_s + size * m.sec_per_token;
                assert!((predicted / truth - 1.0).abs() < 0.05, "{size}: {m:?}");
            }
        }
        // Twenty intervals already get within 20 % of a pod four times slower than the prior.
        let m = learn(4e-4, 0.015, 20).model(&TtftPrior::default());
        assert!((m.sec_per_token / 4e-4 - 1.0).abs() < 0.2, "{m:?}");
    }

    #[test]
    fn a_silent_or_hostile_pod_keeps_the_prior() {
        let prior = TtftPrior::default();
        let mut l = TtftLearner::default();
        assert!(
            !l.observe(timing(0.0, 0.0, 0.0)),
            "first scrape is a baseline"
        );
        assert!(
            !l.observe(timing(0.0, 0.0, 0.0)),
            "no prefills: nothing learned"
        );
        assert!(!l.observe(timing(f64::NAN, 1.0, 1.0)));
        assert!(!l.observe(timing(5.0, -3.0, 1.0)));
        assert!(!l.observe(timing(f64::INFINITY, 1e300, 1e300)));
        assert_eq!(l.model(&prior), prior.model());
        // Absurd values clamp instead of reaching the picker.
        l.observe(timing(1.0, 0.0, 0.0));
        l.observe(timing(2.0, 1.0, 1e12));
        let m = l.model(&prior);
        assert!(
            m.sec_per_token <= 1.0 && m.overhead_s <= MAX_OVERHEAD_S,
            "{m:?}"
        );
        assert!(m.mean_prefill_s.is_finite() && m.sec_per_token > 0.0);
    }

    #[test]
    fn a_restart_starts_a_new_baseline() {
        let mut l = learn(1e-4, 0.01, 50);
        let before = l.model(&TtftPrior::default());
        // Counters drop to near zero: no negative interval is learned, the next one is.
        assert!(!l.observe(timing(1.0, 100.0, 0.02)));
        assert_eq!(l.model(&TtftPrior::default()), before);
        assert!(l.observe(timing(2.0, 1100.0, 0.13)));
    }
}
