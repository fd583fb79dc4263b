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
/// The overhead's prior weighs this many times more than the per-token one's: requests of
/// similar sizes cannot tell the two apart, and then the prefill time goes to the tokens.
const OVERHEAD_PRIOR_FACTOR: f64 = 20.0;
/// Prefills a span of busy scrapes must hold before it is learned from.
const MIN_BUSY_PREFILLS: f64 = 4.0;

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
#[derive(Debug, Clone, Copy, Default)]
pub struct TtftLearner {
    last: Option<EngineTiming>,
    /// Σ x xᵀ and Σ x y over intervals, x = (prefills, tokens / TOKENS_UNIT), y = seconds.
    xx: [[f64; 2]; 2],
    xy: [f64; 2],
    prefills: f64,
    seconds: f64,
}

/// Each pod's model, pulled toward the fleet's: every pod's observations pooled and fitted
/// against `prior` give the prior of each pod's own fit. Pods of one fleet usually share their
/// hardware, so a pod with few prefills of its own (or only small ones) starts from what its
/// peers measured, not from the configuration.
pub fn fleet_models(learners: &[TtftLearner], prior: &TtftPrior) -> Vec<TtftModel> {
    // The fleet's coefficients: each pod's own fit against the prior, weighted by its data.
    let (mut n, mut spt, mut overhead) = (0.0, 0.0, 0.0);
    for l in learners.iter().filter(|l| l.prefills > 0.0) {
        let m = l.model(prior);
        n += l.prefills;
        spt += l.prefills * m.sec_per_token;
        overhead += l.prefills * m.overhead_s;
    }
    if n <= 0.0 {
        return vec![prior.model(); learners.len()];
    }
    let fleet_prior = TtftPrior {
        sec_per_token: spt / n,
        overhead_s: overhead / n,
        weight: prior.weight,
    };
    learners.iter().map(|l| l.model(&fleet_prior)).collect()
}

impl TtftLearner {
    /// Takes the next scrape's counters (`idle`: the scrape showed no request waiting or running);
    /// returns whether the span since the last learned scrape taught anything. A counter that
    /// went backwards (engine restart) starts a new baseline; garbage is ignored.
    pub fn observe(&mut self, now: EngineTiming, idle: bool) -> bool {
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
        let Some(last) = self.last else {
            self.last = Some(now);
            return false;
        };
        let n = now.prefills - last.prefills;
        let tokens = now.prefill_tokens - last.prefill_tokens;
        let secs = now.prefill_seconds - last.prefill_seconds;
        if n < 0.0 || secs < 0.0 || n > MAX_PREFILLS_PER_INTERVAL {
            self.last = Some(now); // restarted (or absurd): `now` is the new baseline
            return false;
        }
        // Engines count a request's cache hits when it is scheduled, its prompt tokens when its
        // prefill ends and its seconds at its first token (vLLM: when it finishes), so a busy
        // pod's counters describe different requests. Keep the baseline until they agree: an
        // idle scrape (everything counted everywhere), or enough prefills that a request or
        // two on the edges no longer matter.
        if n < 1.0 || tokens < 0.0 || (!idle && n < MIN_BUSY_PREFILLS) {
            return false;
        }
        self.last = Some(now);
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
        let wo = w * OVERHEAD_PRIOR_FACTOR;
        let a = [
            [self.xx[0][0] + wo, self.xx[0][1]],
            [self.xx[1][0], self.xx[1][1] + w],
        ];
        let b = [
            self.xy[0] + wo * p.overhead_s,
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
        let sec_per_token =
            (per_unit / TOKENS_UNIT).clamp(SEC_PER_TOKEN_RANGE.0, SEC_PER_TOKEN_RANGE.1);
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
        l.observe(timing(n, t, s), true);
        for i in 0..intervals {
            let size = [200.0, 3000.0, 800.0][i % 3];
            let reqs = 1.0 + (i % 2) as f64;
            n += reqs;
            t += reqs * size;
            s += reqs * (overhead + size * spt);
            l.observe(timing(n, t, s), true);
        }
        l
    }

    #[test]
    fn converges_to_each_pods_speed() {
        for (spt, overhead) in [(1e-4, 0.015), (4e-4, 0.015), (2e-5, 0.002)] {
            let m = learn(spt, overhead, 200).model(&TtftPrior::default());
            assert!((m.sec_per_token / spt - 1.0).abs() < 0.03, "{spt}: {m:?}");
            // The prior still pulls (the overhead's most): predictions within 5 % or 2 ms.
            for size in [200.0, 800.0, 3000.0] {
                let truth = overhead + size * spt;
                let predicted = m.overhead_s + size * m.sec_per_token;
                let err = (predicted - truth).abs();
                assert!(err < 0.05 * truth || err < 0.002, "{size}: {m:?}");
            }
        }
        // Twenty intervals already get within 20 % of a pod four times slower than the prior.
        let m = learn(4e-4, 0.015, 20).model(&TtftPrior::default());
        assert!((m.sec_per_token / 4e-4 - 1.0).abs() < 0.2, "{m:?}");
    }

    #[test]
    fn tokens_and_seconds_reported_in_different_scrapes_still_pair_up() {
        // vLLM (and vllm-sim) count a request's prompt tokens before its prefill time reaches
        // the histogram: scrape k sees the tokens, scrape k+1 the seconds. Each request:
        // 4000 tokens at 4e-4 s/token + 15 ms, then 100-token requests.
        let mut l = TtftLearner::default();
        let (mut n, mut t, mut s) = (0.0, 0.0, 0.0);
        l.observe(timing(n, t, s), true);
        for size in [4000.0, 100.0, 100.0, 3000.0, 100.0, 100.0, 100.0, 2000.0] {
            t += size;
            l.observe(timing(n, t, s), false); // tokens first, the seconds not yet
            n += 1.0;
            s += 0.015 + size * 4e-4;
            l.observe(timing(n, t, s), true); // then the seconds
        }
        let m = l.model(&TtftPrior::default());
        assert!((m.sec_per_token / 4e-4 - 1.0).abs() < 0.1, "{m:?}");
        assert!(m.overhead_s < 0.05, "{m:?}");
    }

    #[test]
    fn cache_hits_counted_before_prompt_tokens_do_not_reset_the_baseline() {
        // vllm-sim and vLLM count a request's prefix hits when it is scheduled and its prompt
        // tokens when its prefill ends: prompt − hits dips in between. A 4100-token prompt with
        // 4000 cached tokens, then the same again, each 100 uncached tokens at 4e-4 s + 15 ms.
        let mut l = TtftLearner::default();
        let (mut n, mut prompt, mut hits, mut s) = (0.0, 0.0, 0.0, 0.0);
        let at = |n, prompt: f64, hits: f64, s| timing(n, prompt - hits, s);
        l.observe(at(n, prompt, hits, s), true);
        for first in [true, false, false, false, false, false, false, false] {
            let uncached = if first { 4100.0 } else { 100.0 };
            hits += 4100.0 - uncached;
            l.observe(at(n, prompt, hits, s), false); // scheduled: hits counted
            prompt += 4100.0;
            n += 1.0;
            s += 0.015 + uncached * 4e-4;
            l.observe(at(n, prompt, hits, s), true); // first token
        }
        let m = l.model(&TtftPrior::default());
        assert!((m.sec_per_token / 4e-4 - 1.0).abs() < 0.1, "{m:?}");
        assert!(m.overhead_s < 0.05, "{m:?}");
    }

    #[test]
    fn overlapping_requests_on_a_busy_pod_are_learned_once_the_counters_agree() {
        // What small-fleet runs showed: request A (4100 uncached tokens) finishes its prefill,
        // B (4000 of 4100 cached) is scheduled before A's first token. A scrape then sees A's
        // seconds with B's hits subtracted from A's tokens: 1.66 s for ~100 tokens.
        let mut l = TtftLearner::default();
        l.observe(timing(0.0, 0.0, 0.0), true);
        let (mut n, mut t, mut s) = (0.0, 0.0, 0.0);
        for a in [4100.0, 2000.0, 6000.0, 1000.0, 3000.0] {
            let a_secs = 0.015 + a * 4e-4;
            // A's prompt counted, B's hits counted; A's seconds arrive with B still running.
            l.observe(timing(n, t + a - 4000.0, s), false);
            l.observe(timing(n + 1.0, t + a - 4000.0, s + a_secs), false);
            // B's prefill ends: idle again.
            (n, t, s) = (n + 2.0, t + a + 100.0, s + a_secs + 0.055);
            l.observe(timing(n, t, s), true);
        }
        let m = l.model(&TtftPrior::default());
        assert!((m.sec_per_token / 4e-4 - 1.0).abs() < 0.1, "{m:?}");
        assert!(m.overhead_s < 0.05, "{m:?}");
    }

    #[test]
    fn a_pod_without_data_starts_from_its_peers() {
        // Two pods measured at 2500 tokens/s, a third one slower, a fourth never prefilled.
        let prior = TtftPrior::default();
        let learners = [
            learn(4e-4, 0.015, 200),
            learn(4e-4, 0.015, 200),
            learn(1.6e-3, 0.015, 200),
            TtftLearner::default(),
        ];
        let m = fleet_models(&learners, &prior);
        assert!((m[0].sec_per_token / 4e-4 - 1.0).abs() < 0.03, "{m:?}");
        assert!((m[2].sec_per_token / 1.6e-3 - 1.0).abs() < 0.03, "{m:?}");
        // The silent pod gets the fleet's pooled fit, not the configured 10k tokens/s.
        assert!(m[3].sec_per_token > 4e-4, "{m:?}");
        assert_eq!(m[3].prefills, 0.0);
        // No pod has data: the configured prior, exactly.
        let none = fleet_models(&[TtftLearner::default(); 2], &prior);
        assert_eq!(none, vec![prior.model(); 2]);
    }

    #[test]
    fn a_silent_or_hostile_pod_keeps_the_prior() {
        let prior = TtftPrior::default();
        let mut l = TtftLearner::default();
        assert!(
            !l.observe(timing(0.0, 0.0, 0.0), true),
            "first scrape is a baseline"
        );
        assert!(
            !l.observe(timing(0.0, 0.0, 0.0), true),
            "no prefills: nothing learned"
        );
        assert!(!l.observe(timing(f64::NAN, 1.0, 1.0), true));
        assert!(!l.observe(timing(5.0, -3.0, 1.0), true));
        assert!(!l.observe(timing(f64::INFINITY, 1e300, 1e300), true));
        assert_eq!(l.model(&prior), prior.model());
        // Absurd values clamp instead of reaching the picker.
        l.observe(timing(1.0, 0.0, 0.0), true);
        l.observe(timing(2.0, 1.0, 1e12), true);
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
        assert!(!l.observe(timing(1.0, 100.0, 0.02), true));
        assert_eq!(l.model(&TtftPrior::default()), before);
        assert!(l.observe(timing(2.0, 1100.0, 0.13), true));
    }
}
