//! Route receipts (`receipts.enabled`): what the router predicted for a request, set on its
//! response as the [`RECEIPT_HEADER`], checked against what the engine says it found cached
//! (read from the response body as it passes: [`usage`]), counted per pod, and kept for
//! `GET /debug/explain?id=` in a fixed ring of recent decisions ([`Recent`]). With or without
//! receipts, a `/v1/responses` response that passes the router pins its id to its pod
//! ([`Watch`]), so that `previous_response_id` finds it.
//!
//! A request is *judged* when its response reports the engine's cached prompt tokens, and
//! *incorrectly routed* when those fall short of what the router predicted for the chosen pod by
//! more than the tolerance (docs/operations.md, "Route receipts"): [`judge`].

mod metrics;
mod recent;
pub mod usage;

use std::sync::Arc;

use serde::Serialize;

use crate::budget::Reservation;
use crate::config::ReceiptsConfig;
use crate::decide::{Decider, Decision};
use crate::picker::Reason;
use crate::pods::PodId;
use crate::request::Api;
use crate::scoring::SessionKey;

pub use metrics::RouteMetrics;
pub use recent::Recent;
use usage::{Scanner, Usage};

/// The response header that carries a receipt; an upstream's copy is replaced or removed.
pub const RECEIPT_HEADER: &str = "x-kv-router-receipt";

/// Candidates a summary keeps (best first): its memory stays fixed.
const SUMMARY_CANDIDATES: usize = 8;

/// Longest model name a summary keeps (a client's string).
const MAX_MODEL_BYTES: usize = 128;

/// A decision as `/debug/explain?id=` shows it: no prompt text.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The decision id, `{:016x}`.
    #[serde(serialize_with = "hex")]
    pub id: u64,
    /// When it was decided (Unix ms).
    pub at_unix_ms: u64,
    /// The request's model (cut to 128 bytes).
    pub model: Option<String>,
    /// The chosen (primary) pod.
    pub pod: PodId,
    /// Why it was chosen.
    pub reason: Reason,
    /// Prompt tokens as the router counts them.
    pub prompt_tokens: u64,
    /// Tokens per block.
    pub block_tokens: u64,
    /// Prompt tokens predicted cached on the chosen pod.
    pub predicted_cached_tokens: u64,
    /// The other candidate predicted to hold the most, if any other holds some.
    pub best_other: Option<Predicted>,
    /// The best-ranked candidates (at most 8).
    pub candidates: Vec<Candidate>,
    /// What the engine reported, once its response ended.
    pub observed: Option<Observed>,
}

/// A pod and the prompt tokens predicted cached there.
#[derive(Debug, Clone, Serialize)]
pub struct Predicted {
    /// `ip:port`.
    pub pod: PodId,
    /// Predicted cached prompt tokens.
    pub predicted_cached_tokens: u64,
}

/// One ranked candidate of a summary.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    /// `ip:port`.
    pub pod: PodId,
    /// Combined score.
    pub total: f64,
    /// Blocks the index predicted it holds.
    pub matched_blocks: f64,
    /// The same in prompt tokens.
    pub predicted_cached_tokens: u64,
    /// The gate marked it saturated.
    pub saturated: bool,
}

/// The engine's report on a routed request, and the verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Observed {
    /// Prompt tokens the engine found cached.
    pub cached_tokens: u64,
    /// Prompt tokens in the engine's count, when it said.
    pub prompt_tokens: Option<u64>,
    /// The prediction, in the engine's tokens, the observation was held to.
    pub expected_cached_tokens: u64,
    /// How far short of it the observation may fall.
    pub tolerance_tokens: u64,
    /// It fell further short.
    pub incorrect: bool,
}

fn hex<S: serde::Serializer>(id: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{id:016x}"))
}

impl Summary {
    /// The summary of a committed decision.
    pub fn of(d: &Decision) -> Self {
        let plan = &d.plan;
        let chosen = plan.ranked.first();
        let predicted = chosen.map_or(0, |r| plan.predicted_hit_tokens(r));
        let best_other = plan
            .ranked
            .iter()
            .skip(1)
            .map(|r| Predicted {
                pod: r.pod.clone(),
                predicted_cached_tokens: plan.predicted_hit_tokens(r),
            })
            .filter(|p| p.predicted_cached_tokens > 0)
            .max_by_key(|p| p.predicted_cached_tokens);
        let model = d.model.as_deref().map(|m| {
            let mut end = m.len().min(MAX_MODEL_BYTES);
            while !m.is_char_boundary(end) {
                end -= 1;
            }
            m[..end].to_string()
        });
        Self {
            id: d.id,
            at_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |t| t.as_millis() as u64),
            model,
            pod: plan
                .endpoints
                .first()
                .cloned()
                .unwrap_or_else(|| PodId::new("")),
            reason: plan.reason,
            prompt_tokens: plan.prompt_tokens(),
            block_tokens: plan.block_tokens(),
            predicted_cached_tokens: predicted,
            best_other,
            candidates: plan
                .ranked
                .iter()
                .take(SUMMARY_CANDIDATES)
                .map(|r| Candidate {
                    pod: r.pod.clone(),
                    total: r.total,
                    matched_blocks: r.matched_blocks,
                    predicted_cached_tokens: plan.predicted_hit_tokens(r),
                    saturated: r.saturated,
                })
                .collect(),
            observed: None,
        }
    }

    /// The receipt header's value: `id=…; pod=…; predicted_cached_tokens=…; prompt_tokens=…;
    /// reason=…`.
    pub fn receipt(&self) -> String {
        format!(
            "id={:016x}; pod={}; predicted_cached_tokens={}; prompt_tokens={}; reason={}",
            self.id,
            self.pod,
            self.predicted_cached_tokens,
            self.prompt_tokens,
            self.reason.as_str()
        )
    }
}

/// Holds an observation to the prediction. The prediction is rescaled to the engine's prompt
/// count when the engine gives one (the router's count is an estimate without a tokenizer);
/// the tolerance is one block or a tenth of the prompt, whichever is more. `None`: the engine
/// reported no cached count.
pub fn judge(predicted: u64, prompt_tokens: u64, block_tokens: u64, u: Usage) -> Option<Observed> {
    let cached = u.cached_tokens?;
    let expected = match u.prompt_tokens {
        Some(p) if prompt_tokens > 0 => {
            (u128::from(predicted) * u128::from(p) / u128::from(prompt_tokens)) as u64
        }
        _ => predicted,
    };
    let prompt = u.prompt_tokens.unwrap_or(prompt_tokens);
    let tolerance = block_tokens.max(prompt / 10);
    Some(Observed {
        cached_tokens: cached,
        prompt_tokens: u.prompt_tokens,
        expected_cached_tokens: expected,
        tolerance_tokens: tolerance,
        incorrect: cached.saturating_add(tolerance) < expected,
    })
}

/// Receipts, their metrics and the ring of recent decisions; one per router.
pub struct Receipts {
    metrics: RouteMetrics,
    recent: Recent,
}

/// One routed request's response while it passes: its receipt (`receipts.enabled`), and on
/// `/v1/responses` the response id, pinned to the pod that produced it. Dropped unjudged (the
/// gateway reset the stream before the response's end reached kv-router: a response body it is
/// not sent), it is judged on what it saw.
pub struct Watch {
    /// Receipts are on: the header is set and the response judged and counted.
    receipts: Option<Arc<Receipts>>,
    summary: Summary,
    scanner: Scanner,
    /// The gateway showed the response headers (else the response is not this router's to
    /// judge: the route skips responses).
    shown: bool,
    ended: bool,
}

impl Receipts {
    /// Receipts as `cfg` sets them, counted in `metrics`.
    pub fn new(cfg: &ReceiptsConfig, metrics: RouteMetrics) -> Self {
        Self {
            metrics,
            recent: Recent::new(cfg.recent_decisions),
        }
    }

    /// The per-pod families.
    pub fn metrics(&self) -> &RouteMetrics {
        &self.metrics
    }

    /// A recent decision by id.
    pub fn get(&self, id: u64) -> Option<Summary> {
        self.recent.get(id)
    }

    /// Starts the receipt of decision `d` of a request to `path` (its summary joins the ring);
    /// the response's bytes are kept under `held`.
    pub fn watch(self: &Arc<Self>, d: &Decision, path: &str, held: Reservation) -> Box<Watch> {
        let summary = Summary::of(d);
        self.recent.record(summary.clone());
        let want_id = Api::from_path(path) == Api::Responses;
        Box::new(Watch {
            receipts: Some(self.clone()),
            summary,
            scanner: Scanner::new(None, want_id, held),
            shown: false,
            ended: false,
        })
    }

    fn count(&self, s: &Summary, usage: Usage) {
        match judge(
            s.predicted_cached_tokens,
            s.prompt_tokens,
            s.block_tokens,
            usage,
        ) {
            Some(o) => {
                self.metrics.judged(&s.pod, s.predicted_cached_tokens, &o);
                self.recent.observe(s.id, o);
            }
            None => self.metrics.unobserved(&s.pod),
        }
    }
}

impl Watch {
    /// Without receipts: a `/v1/responses` request's response, watched for its id only (other
    /// paths: nothing to watch). Its bytes are kept under `held`.
    pub fn response_id(d: &Decision, path: &str, held: Reservation) -> Option<Box<Watch>> {
        (Api::from_path(path) == Api::Responses).then(|| {
            Box::new(Watch {
                receipts: None,
                summary: Summary::of(d),
                scanner: Scanner::id_only(held),
                shown: false,
                ended: false,
            })
        })
    }

    /// The response headers arrived: the body's format, and the receipt header's value when
    /// receipts are on.
    pub fn response_headers(&mut self, headers: &[(String, String)]) -> Option<String> {
        self.shown = true;
        if let Some((_, ct)) = headers.iter().find(|(k, _)| k == "content-type") {
            self.scanner.content_type(ct);
        }
        self.receipts.as_ref().map(|_| self.summary.receipt())
    }

    /// A response body chunk passed; a `/v1/responses` id found in it is pinned to the pod.
    pub fn body(&mut self, chunk: &[u8], decider: &Decider) {
        if self.ended {
            return;
        }
        self.scanner.feed(chunk);
        self.pin_id(decider);
    }

    /// The response ended, or its stream did (the body was not sent here, or the client left):
    /// judged and counted, once, if its headers were shown.
    pub fn end(&mut self, decider: &Decider) {
        if self.ended || !self.shown {
            return;
        }
        let usage = self.scanner.finish();
        self.pin_id(decider);
        self.ended = true;
        if let Some(r) = &self.receipts {
            r.count(&self.summary, usage);
        }
    }

    fn pin_id(&mut self, decider: &Decider) {
        if let Some(id) = self.scanner.take_id() {
            decider.sessions().set(
                SessionKey::response(&id),
                self.summary.pod.clone(),
                decider.now_ms(),
            );
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if self.shown && !self.ended {
            self.ended = true;
            let usage = self.scanner.finish();
            if let Some(r) = &self.receipts {
                r.count(&self.summary, usage);
            }
        }
    }
}

#[cfg(test)]
mod tests;
