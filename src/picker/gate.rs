//! The saturation gate, shared by every policy: which candidates are saturated or hot, whether
//! all of them are, and whether a new conversation is spread.

use crate::config::GateConfig;
use crate::pods::PodLoad;
use crate::scoring::{Prediction, ScoreInput};

use super::Reason;

/// The gate's verdict on one request's candidates.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Verdict {
    /// Candidates the gate marked saturated.
    pub saturated: Vec<bool>,
    /// Every candidate is saturated: none is gated (they are ranked over all of them).
    pub all_saturated: bool,
    /// A new conversation, spread by commitments (see `spread.rs`).
    pub spread: bool,
}

impl Verdict {
    /// Candidate `i` is gated: ranked after every candidate that is not.
    pub fn gated(&self, i: usize) -> bool {
        self.saturated[i] && !self.all_saturated
    }

    /// The reason a scoring policy reports.
    pub fn reason(&self) -> Reason {
        match (self.all_saturated, self.spread) {
            (true, _) => Reason::AllSaturated,
            (false, true) => Reason::Spread,
            (false, false) => Reason::Scored,
        }
    }
}

/// Judges the candidates. `work` is how much of each candidate's own prefill counts on top of its
/// predicted TTFT (the policy's `RankPolicy::gate_work`).
pub(crate) fn judge(
    g: &GateConfig,
    input: &ScoreInput,
    predictions: &[Prediction],
    work: f64,
) -> Verdict {
    let n = input.candidates.len();
    let loads: Vec<&PodLoad> = input.candidates.iter().map(|c| &c.load).collect();
    let hot = hot(g, &loads);
    let unusable: Vec<bool> = loads.iter().map(|l| unusable(g, l)).collect();
    let busy_gate: Vec<bool> = (0..n).map(|i| hot[i] || queued_full(g, loads[i])).collect();
    // A hot or queue-saturated pod stays eligible while it is still the cheaper place: its
    // predicted TTFT plus the prefill it would do, against the same on the best pod that is
    // neither. Moving a long prefix cached only there costs the fleet a second prefill of it
    // (a conversation's history, for all its later turns too), not just this request's wait.
    let cost = |i: usize| predictions[i].ttft_ms + work * predictions[i].prefill_ms;
    let coolest = (0..n)
        .filter(|&i| !busy_gate[i] && !unusable[i])
        .map(cost)
        .fold(f64::INFINITY, f64::min);
    let saturated: Vec<bool> = (0..n)
        .map(|i| unusable[i] || (busy_gate[i] && (coolest.is_infinite() || cost(i) >= coolest)))
        .collect();
    let all_saturated = n > 0 && saturated.iter().all(|s| *s);
    let replicate = g.replicate_to_idle
        && input.shares_prefix
        && holders_queue(g, input, predictions, &saturated);
    let spread = g.enabled
        && g.spread_new_conversations
        && (input.new_conversation || replicate)
        && !all_saturated;
    Verdict {
        saturated,
        all_saturated,
        spread,
    }
}

/// Whether some pod has room: one that is neither unusable, hot nor queue-saturated, counting
/// this router's requests the pod has not started running as waiting (its scrape lags them).
/// Flow control holds requests while this is false, so a release is seen at once. With no such
/// lag it is exactly "not every candidate is saturated" by [`judge`].
pub fn has_room(g: &GateConfig, loads: &[&PodLoad]) -> bool {
    let hot = hot(g, loads);
    loads.iter().zip(hot).any(|(l, hot)| {
        // Whatever of the pod's requests it is not running: the running slots may be other
        // replicas' (`others`), which leave this router's own requests unstarted.
        let unstarted = PodLoad {
            waiting: l.requests() - l.running,
            ..**l
        };
        !unusable(g, l) && !hot && !queued_full(g, &unstarted)
    })
}

/// Whether a prompt that shares only a prefix should leave the prefix's holders (those with at
/// least half the longest match): every holder has a request, and an ungated pod with none that
/// holds none of the prompt would answer sooner, prefilling all of it, than the best holder after
/// its queue. That pod's prefill delays nobody; it is paid once, after which the pod holds the
/// prefix too. Only cold pods: on the Mooncake conversation trace, where every pod holds the
/// system prompt, a pod holding part of it took continuations this test cannot tell from new
/// prompts (64 pods: 0.99 -> 0.98 of pooled, work hotspot 1.29 -> 1.55). Without
/// this a fleet whose clients send no session id keeps every conversation on a long system
/// prompt's first holder (two sessionless clients on one system prompt: 24 of 24 requests on
/// one of two pods).
fn holders_queue(
    g: &GateConfig,
    input: &ScoreInput,
    predictions: &[Prediction],
    saturated: &[bool],
) -> bool {
    let best = input
        .candidates
        .iter()
        .map(|c| c.matched_blocks)
        .fold(0.0, f64::max);
    // A prompt whose own part is the longer one is spread as a new conversation once its prefix
    // is shared (`spread_new_conversations`); this rule covers the case that leaves out.
    if !g.enabled || best <= 0.0 || 2.0 * best < input.total_blocks as f64 {
        return false;
    }
    // Only while the fleet has fewer requests than pods: an idle pod is then spare capacity,
    // not a gap between the next arrivals (each pod counted once: its scrape or this router's).
    let busy: f64 = input.candidates.iter().map(|c| c.load.requests()).sum();
    if 2.0 * busy > input.candidates.len() as f64 {
        return false;
    }
    let holds = |i: usize| input.candidates[i].matched_blocks >= best / 2.0;
    let n = input.candidates.len();
    let mut holder_ttft = f64::INFINITY;
    for i in (0..n).filter(|&i| holds(i)) {
        // Queued or sent by this router and not finished: a scrape's `running` alone may be a
        // request that ended since (one-off questions sent one after another then alternated).
        let l = &input.candidates[i].load;
        if l.waiting + l.inflight_requests < 1.0 {
            return false;
        }
        holder_ttft = holder_ttft.min(predictions[i].ttft_ms);
    }
    (0..n).any(|i| {
        input.candidates[i].matched_blocks <= 0.0
            && !saturated[i]
            && input.candidates[i].load.requests() <= 0.0
            && predictions[i].ttft_ms < holder_ttft
    })
}

/// Saturated whatever the request: its load is unknown (stale) or its KV cache is full.
fn unusable(g: &GateConfig, load: &PodLoad) -> bool {
    g.enabled && ((g.stale_is_saturated && !load.fresh) || load.kv_usage >= g.max_kv_usage)
}

/// Saturated by queued work (waiting requests, this router's uncached tokens in flight):
/// a request whose long prefix only this pod holds may still be served sooner there.
fn queued_full(g: &GateConfig, load: &PodLoad) -> bool {
    g.enabled && (load.waiting >= g.max_waiting || load.inflight_tokens >= g.max_inflight_tokens)
}

/// Which candidates carry clearly more requests than the least loaded one (SGLang-style
/// imbalance test, per pod): more than `hot_abs` above the minimum and over `hot_rel` times
/// it. A shared hot prefix then spills to other pods instead of piling onto one.
fn hot(g: &GateConfig, loads: &[&PodLoad]) -> Vec<bool> {
    let min = loads
        .iter()
        .map(|l| l.requests())
        .fold(f64::INFINITY, f64::min);
    loads
        .iter()
        .map(|l| {
            let r = l.requests();
            g.enabled && r - min > g.hot_abs && r > g.hot_rel * min
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::pods::TtftModel;
    use crate::scoring::Candidate;

    fn load(waiting: f64, running: f64, kv_usage: f64, fresh: bool) -> PodLoad {
        PodLoad {
            waiting,
            running,
            kv_usage,
            inflight_requests: 0.0,
            inflight_tokens: 0.0,
            others: 0.0,
            fresh,
        }
    }

    #[test]
    fn unstarted_requests_count_when_other_replicas_hold_the_running_slots() {
        // Five requests run, all another replica's; this router's eight are not started yet.
        let g = GateConfig::default();
        let l = PodLoad {
            inflight_requests: g.max_waiting,
            others: 5.0,
            ..load(0.0, 5.0, 0.1, true)
        };
        assert!(!has_room(&g, &[&l]), "eight unstarted fill the queue");
        let mine = PodLoad { others: 0.0, ..l };
        assert!(
            has_room(&g, &[&mine]),
            "the five running are three of those eight"
        );
    }

    proptest! {
        // Flow control's test must never release into a fleet the gate finds all saturated, and
        // must not hold while the gate finds room unless the scrape lags the router's requests.
        #[test]
        fn has_room_is_not_all_saturated(
            pods in prop::collection::vec((0u8..12, 0u8..12, 0u8..=100, any::<bool>(), 0u8..4, 0u8..16, 0u8..8), 1..6),
        ) {
            let g = GateConfig::default();
            let candidates: Vec<Candidate> = pods
                .iter()
                .enumerate()
                .map(|(i, &(w, r, kv, fresh, m, inflight, others))| Candidate {
                    pod: crate::pods::PodId::new(format!("10.0.0.{i}:8000")),
                    matched_blocks: f64::from(m),
                    load: PodLoad {
                        inflight_requests: f64::from(inflight),
                        others: f64::from(others.min(w + r)),
                        ..load(f64::from(w), f64::from(r), f64::from(kv) / 100.0, fresh)
                    },
                    session_pod: false,
                    conversations: 0.0,
                    model: TtftModel::default(),
                })
                .collect();
            let input = ScoreInput {
                total_blocks: 4,
                candidates,
                new_conversation: false,
                shares_prefix: false,
                prompt_tokens: 256.0,
                tokens_per_block: 64.0,
            };
            let predictions = input.predictions();
            let verdict = judge(&g, &input, &predictions, 1.0);
            let loads: Vec<&PodLoad> = input.candidates.iter().map(|c| &c.load).collect();
            let lagless = loads.iter().all(|l| l.requests() == l.waiting + l.running);
            // Room implies the gate routes to a pod with room; without lag they agree exactly.
            prop_assert!(!has_room(&g, &loads) || !verdict.all_saturated);
            if lagless {
                prop_assert_eq!(has_room(&g, &loads), !verdict.all_saturated);
            }
        }
    }
}
