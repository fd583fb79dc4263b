//! The one decision path shared by ext_proc, the Pick service, `/debug/explain` and `kv-bench`:
//! parse → block keys → index lookup → scorers → picker → record.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use thiserror::Error;
use tokio::time::Instant;
use tracing::debug;

use crate::blocks::BlockScheme;
use crate::config::{Config, Policy};
use crate::index::KvIndex;
use crate::keys::Keyer;
use crate::picker::{PickReason, Picker};
use crate::pods::{InflightGuard, Pod, PodId, PodRegistry};
use crate::request::{self, RequestError, RoutingRequest};
use crate::scoring::{
    run_scorer, Candidate, LoadScorer, PrefixScorer, ScoreError, ScoreInput, Scorer, SessionKey,
    SessionScorer, SessionStore,
};
use crate::telemetry::{DecisionLabels, Metrics};

/// Why the primary pod was chosen (closed set; a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reason {
    /// Weighted scores.
    Scored,
    /// Every candidate was saturated.
    AllSaturated,
    /// A baseline policy (round-robin, random, least-loaded).
    Policy,
    /// No body: least-loaded.
    NoBody,
    /// Body not understood: least-loaded (the pod answers).
    Unparsable,
}

impl Reason {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Scored => "scored",
            Reason::AllSaturated => "all-saturated",
            Reason::Policy => "policy",
            Reason::NoBody => "no-body",
            Reason::Unparsable => "unparsable",
        }
    }
}

/// A request as every front end hands it in.
#[derive(Debug, Clone, Copy)]
pub struct DecideRequest<'a> {
    /// Request path (`:path`).
    pub path: &'a str,
    /// Lower-case header names and values.
    pub headers: &'a [(String, String)],
    /// The body, `None` for body-less requests.
    pub body: Option<&'a [u8]>,
    /// Gateway subset hint (`ip:port` or `ip` entries); `None` = no restriction.
    pub subset: Option<&'a [String]>,
    /// Compute only: no index write, no session, no load accounting.
    pub dry_run: bool,
}

impl DecideRequest<'_> {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One candidate with everything that went into its rank.
#[derive(Debug, Clone, Serialize)]
pub struct ScoredPod {
    /// `ip:port`.
    pub pod: PodId,
    /// Combined score.
    pub total: f64,
    /// Each scorer's score in [0, 1].
    pub scores: Vec<(&'static str, f64)>,
    /// Blocks the index predicts the pod holds.
    pub matched_blocks: f64,
    /// The gate marked it saturated.
    pub saturated: bool,
}

/// The outcome of one decision.
#[derive(Debug, Serialize)]
pub struct Decision {
    /// Primary first, then fallbacks in retry order.
    pub endpoints: Vec<PodId>,
    /// All candidates, best first.
    pub ranked: Vec<ScoredPod>,
    /// Why.
    pub reason: Reason,
    /// The request's model.
    pub model: Option<String>,
    /// Full blocks in the prompt.
    pub total_blocks: usize,
    /// Load accounting held until the request ends (absent for dry runs).
    #[serde(skip)]
    pub guard: Option<InflightGuard>,
}

impl Decision {
    /// `ip:port[,ip:port…]` for the metadata and header.
    pub fn destination(&self) -> String {
        self.endpoints
            .iter()
            .map(PodId::as_str)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// No decision could be made; the edge turns this into an HTTP status.
#[derive(Debug, Error, PartialEq)]
pub enum DecideError {
    /// No pod passes its health probes.
    #[error("no healthy inference pod is available")]
    NoHealthyPod,
    /// The gateway's subset hint left nothing to choose from.
    #[error("no healthy inference pod in the gateway's endpoint subset")]
    EmptySubset,
    /// No healthy pod serves the model.
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    /// Strict mode: the body was not understood.
    #[error("{0}")]
    BadRequest(RequestError),
    /// The body exceeds the configured limit.
    #[error("request body exceeds the {0}-byte limit")]
    BodyTooLarge(usize),
}

impl DecideError {
    /// HTTP status for the client.
    pub fn status(&self) -> u16 {
        match self {
            DecideError::NoHealthyPod | DecideError::EmptySubset => 503,
            DecideError::ModelNotFound(_) => 404,
            DecideError::BadRequest(_) => 400,
            DecideError::BodyTooLarge(_) => 413,
        }
    }

    /// Closed label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            DecideError::NoHealthyPod => "no_healthy_pod",
            DecideError::EmptySubset => "empty_subset",
            DecideError::ModelNotFound(_) => "model_not_found",
            DecideError::BadRequest(_) => "bad_request",
            DecideError::BodyTooLarge(_) => "body_too_large",
        }
    }

    /// OpenAI-style JSON error body.
    pub fn openai_body(&self) -> Vec<u8> {
        let (ty, code) = match self {
            DecideError::NoHealthyPod | DecideError::EmptySubset => {
                ("ServiceUnavailableError", "no_healthy_upstream")
            }
            DecideError::ModelNotFound(_) => ("NotFoundError", "model_not_found"),
            DecideError::BadRequest(_) => ("BadRequestError", "invalid_request"),
            DecideError::BodyTooLarge(_) => ("RequestTooLargeError", "request_too_large"),
        };
        serde_json::to_vec(&serde_json::json!({
            "error": { "message": self.to_string(), "type": ty, "param": null, "code": code }
        }))
        .expect("static JSON")
    }
}

/// The scoring stages of a decision (scorers, load signal, picker) built from config, with no pod
/// registry or clock: the [`Decider`] runs them on live pods, `kv-bench simulate` in virtual time.
pub struct Stages {
    scorers: Vec<Box<dyn Scorer>>,
    load: LoadScorer,
    picker: Picker,
}

impl Stages {
    /// The prefix, session and load scorers with their configured weights, and the policy's picker.
    pub fn new(cfg: &Config) -> Self {
        let s = &cfg.scorers;
        let load = LoadScorer::new(s.load.clone());
        let scorers: Vec<Box<dyn Scorer>> = vec![
            Box::new(PrefixScorer),
            Box::new(SessionScorer),
            Box::new(load.clone()),
        ];
        let weights = vec![s.prefix.weight, s.session.weight, s.load.weight];
        Self {
            scorers,
            load,
            picker: Picker::new(cfg.policy, weights, cfg.gate.clone()),
        }
    }

    /// Scorer names, in the order of [`Stages::score`]'s scores.
    pub fn names(&self) -> Vec<&'static str> {
        self.scorers.iter().map(|s| s.name()).collect()
    }

    /// Every scorer's scores (a failing scorer counts as 0 for all, after `on_error`) and every
    /// candidate's load in [0, 1].
    pub fn score(
        &self,
        input: &ScoreInput,
        mut on_error: impl FnMut(&ScoreError),
    ) -> (Vec<Vec<f64>>, Vec<f64>) {
        let busy: Vec<f64> = input
            .candidates
            .iter()
            .map(|c| self.load.busy(&c.load))
            .collect();
        let mut scores = Vec::with_capacity(self.scorers.len());
        for scorer in &self.scorers {
            scores.push(run_scorer(scorer.as_ref(), input).unwrap_or_else(|e| {
                on_error(&e);
                vec![0.0; input.candidates.len()]
            }));
        }
        (scores, busy)
    }

    /// The picker of the configured policy.
    pub fn picker(&self) -> &Picker {
        &self.picker
    }
}

/// Owns the stages and runs them in order.
pub struct Decider {
    strict: bool,
    fallbacks: usize,
    keyer: Keyer,
    block_chars: usize,
    max_blocks: usize,
    block_tokens: usize,
    stale_after: Duration,
    prefill_tokens_per_sec: f64,
    session_headers: Vec<String>,
    use_user_field: bool,
    registry: Arc<PodRegistry>,
    index: Arc<dyn KvIndex>,
    sessions: Arc<SessionStore>,
    stages: Stages,
    least_loaded: Picker,
    metrics: Arc<Metrics>,
    epoch: Instant,
}

impl Decider {
    /// Builds the stages from config.
    pub fn new(
        cfg: &Config,
        registry: Arc<PodRegistry>,
        index: Arc<dyn KvIndex>,
        sessions: Arc<SessionStore>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let s = &cfg.scorers;
        Self {
            strict: cfg.strict,
            fallbacks: cfg.fallbacks,
            keyer: Keyer::new(
                BlockScheme {
                    size_chars: cfg.blocks.size_chars,
                    max_blocks: cfg.blocks.max_blocks,
                },
                cfg.kv_events.block_tokens,
                Arc::new(builtin_tokenizers(cfg)),
            ),
            block_chars: cfg.blocks.size_chars,
            max_blocks: cfg.blocks.max_blocks,
            block_tokens: cfg.kv_events.block_tokens,
            stale_after: Duration::from_millis(cfg.pods.stale_after_ms),
            prefill_tokens_per_sec: s.load.prefill_tokens_per_sec,
            session_headers: s.session.headers.clone(),
            use_user_field: s.session.use_user_field,
            registry,
            index,
            sessions,
            stages: Stages::new(cfg),
            least_loaded: Picker::new(Policy::LeastLoaded, vec![], cfg.gate.clone()),
            metrics,
            epoch: Instant::now(),
        }
    }

    /// Replaces the tokenizers (built with [`crate::keys::load_tokenizers`], which reads files).
    pub fn with_tokenizers(mut self, tokenizers: Arc<crate::tokenize::TokenizerRegistry>) -> Self {
        self.keyer = Keyer::new(
            BlockScheme {
                size_chars: self.block_chars,
                max_blocks: self.max_blocks,
            },
            self.block_tokens,
            tokenizers,
        );
        self
    }

    /// Milliseconds on the router's monotonic clock (the index's time base).
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The index (for maintenance and debug views).
    pub fn index(&self) -> &Arc<dyn KvIndex> {
        &self.index
    }

    /// Decides where a request goes.
    pub async fn decide(&self, req: DecideRequest<'_>) -> Result<Decision, DecideError> {
        let started = Instant::now();
        let result = self.decide_inner(req).await;
        self.metrics
            .decision_seconds
            .observe(started.elapsed().as_secs_f64());
        match &result {
            Ok(d) => {
                if !req.dry_run {
                    let pod = d
                        .endpoints
                        .first()
                        .map(|p| p.to_string())
                        .unwrap_or_default();
                    self.metrics
                        .decisions
                        .get_or_create(&DecisionLabels {
                            reason: d.reason.as_str(),
                            pod,
                        })
                        .inc();
                    if let Some(best) = d.ranked.first() {
                        self.metrics.matched_blocks.observe(best.matched_blocks);
                    }
                }
            }
            Err(e) => self.metrics.error(e.kind()),
        }
        result
    }

    async fn decide_inner(&self, req: DecideRequest<'_>) -> Result<Decision, DecideError> {
        let parsed: Option<RoutingRequest> = match req.body {
            None => None,
            Some(body) => match request::parse(req.path, body) {
                Ok(r) => Some(r),
                Err(e) if self.strict => return Err(DecideError::BadRequest(e)),
                Err(e) => {
                    debug!(kind = e.kind(), "unparsable body; routing by load");
                    self.metrics.error("unparsable");
                    None
                }
            },
        };
        let model = parsed.as_ref().and_then(|r| r.model.clone());
        let snapshot = self.registry.snapshot();
        let healthy: Vec<&Arc<Pod>> = snapshot.pods().iter().filter(|p| p.is_healthy()).collect();
        if healthy.is_empty() {
            return Err(DecideError::NoHealthyPod);
        }
        let in_subset: Vec<&Arc<Pod>> = match req.subset {
            None => healthy,
            Some(subset) => healthy
                .into_iter()
                .filter(|p| in_subset(p.id(), subset))
                .collect(),
        };
        if in_subset.is_empty() {
            return Err(DecideError::EmptySubset);
        }
        let pods: Vec<&Arc<Pod>> = in_subset
            .into_iter()
            .filter(|p| p.serves(model.as_deref()))
            .collect();
        if pods.is_empty() {
            return Err(DecideError::ModelNotFound(model.unwrap_or_default()));
        }

        let keyed = parsed
            .as_ref()
            .map(|r| self.keyer.keys(r))
            .unwrap_or_default();
        if let Some(kind) = keyed.tokenize_error {
            debug!(kind, "tokenization failed; approximate keys");
            self.metrics.error("tokenize");
        }
        let keys = &keyed.keys;
        let ids: Vec<PodId> = pods.iter().map(|p| p.id().clone()).collect();
        let now_ms = self.now_ms();
        let matched = if keys.is_empty() {
            vec![0.0; ids.len()]
        } else {
            self.index
                .lookup(keys, &ids, now_ms)
                .await
                .unwrap_or_else(|e| {
                    debug!(error = %e, "index lookup failed; scoring without it");
                    self.metrics.error("index");
                    vec![0.0; ids.len()]
                })
        };
        let session = SessionKey::find(
            |name| req.header(name),
            &self.session_headers,
            parsed.as_ref().and_then(|r| r.user.as_deref()),
            self.use_user_field,
        );
        let session_pod = session.and_then(|s| self.sessions.get(s, now_ms));
        let now = Instant::now();
        let input = ScoreInput {
            total_blocks: keys.len(),
            candidates: pods
                .iter()
                .zip(&matched)
                .map(|(p, m)| Candidate {
                    pod: p.id().clone(),
                    matched_blocks: *m,
                    load: p.load(now, self.stale_after),
                    session_pod: session_pod.as_ref() == Some(p.id()),
                })
                .collect(),
        };
        let (scores, busy) = self.stages.score(&input, |e| {
            debug!(error = %e, "scorer failed; its scores count as 0");
            self.metrics.error("scorer");
        });
        // ThreadRng is not Send: keep it out of scope of the awaits below.
        let (ranking, reason) = {
            let mut rng = rand::rng();
            match (&parsed, req.body) {
                (None, None) => (
                    self.least_loaded.rank(&input, &[], &busy, &mut rng),
                    Reason::NoBody,
                ),
                (None, Some(_)) => (
                    self.least_loaded.rank(&input, &[], &busy, &mut rng),
                    Reason::Unparsable,
                ),
                (Some(_), _) => {
                    let r = self.stages.picker().rank(&input, &scores, &busy, &mut rng);
                    let reason = match r.reason {
                        PickReason::Scored => Reason::Scored,
                        PickReason::AllSaturated => Reason::AllSaturated,
                        PickReason::Policy => Reason::Policy,
                    };
                    (r, reason)
                }
            }
        };
        let names = self.stages.names();
        let ranked: Vec<ScoredPod> = ranking
            .order
            .iter()
            .map(|&i| ScoredPod {
                pod: input.candidates[i].pod.clone(),
                total: ranking.totals[i],
                scores: names.iter().zip(&scores).map(|(n, s)| (*n, s[i])).collect(),
                matched_blocks: input.candidates[i].matched_blocks,
                saturated: ranking.saturated[i],
            })
            .collect();
        let endpoints: Vec<PodId> = ranked
            .iter()
            .take(1 + self.fallbacks)
            .map(|s| s.pod.clone())
            .collect();
        let primary_idx = ranking.order[0];
        let guard = if req.dry_run {
            None
        } else {
            let primary = pods[primary_idx];
            let prompt_tokens = keyed.prompt_tokens;
            let cached = (matched[primary_idx] * keyed.tokens_per_block as f64) as u64;
            let guard = primary.begin_request(
                prompt_tokens.saturating_sub(cached),
                now,
                self.prefill_tokens_per_sec,
            );
            if !keys.is_empty() {
                if let Err(e) = self.index.record(primary.id(), keys, now_ms).await {
                    debug!(error = %e, "index record failed");
                    self.metrics.error("index");
                }
            }
            if let Some(s) = session {
                self.sessions.set(s, primary.id().clone(), now_ms);
            }
            Some(guard)
        };
        Ok(Decision {
            endpoints,
            ranked,
            reason,
            model,
            total_blocks: keys.len(),
            guard,
        })
    }
}

/// Subset entries match a pod by `ip:port`, or by IP when the entry has no port.
fn in_subset(pod: &PodId, subset: &[String]) -> bool {
    let id = pod.as_str();
    let ip = id.rsplit_once(':').map_or(id, |(ip, _)| ip);
    subset.iter().any(|s| {
        let s = s.trim();
        s == id
            || s == ip
            || s.trim_start_matches('[').trim_end_matches(']')
                == ip.trim_start_matches('[').trim_end_matches(']')
    })
}

/// Built-in (pseudo) tokenizers from the config; file-backed ones need [`Decider::with_tokenizers`].
fn builtin_tokenizers(cfg: &Config) -> crate::tokenize::TokenizerRegistry {
    let builtin: Vec<_> = cfg
        .tokenizers
        .iter()
        .filter(|t| t.builtin)
        .cloned()
        .collect();
    crate::keys::load_tokenizers(&builtin).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, StaticPod};
    use crate::index::MemoryIndex;
    use crate::pods::PodSource;
    use crate::pods::{LoadSample, PodSpec, StaticSource};
    use prometheus_client::registry::Registry;

    async fn decider(n: usize, cfg_edit: impl FnOnce(&mut Config)) -> (Decider, Arc<PodRegistry>) {
        let mut cfg = Config::default();
        cfg.pods.static_pods = (0..n)
            .map(|i| StaticPod {
                address: format!("127.0.0.1:{}", 8000 + i),
                models: vec!["m".into()],
                labels: Default::default(),
                kv_events_endpoint: None,
                kv_events_replay_endpoint: None,
            })
            .collect();
        cfg_edit(&mut cfg);
        let registry = Arc::new(PodRegistry::default());
        let specs: Vec<PodSpec> = StaticSource::new(&cfg.pods.static_pods)
            .pods()
            .await
            .unwrap();
        registry.update(specs);
        for p in registry.snapshot().pods() {
            p.record_probe(true, 1);
            p.record_sample(Instant::now(), LoadSample::default());
        }
        let metrics = Arc::new(Metrics::new(&mut Registry::default()));
        let index = Arc::new(MemoryIndex::new(cfg.index.ttl_ms, 1000));
        let sessions = Arc::new(SessionStore::new(100, 10_000));
        (
            Decider::new(&cfg, registry.clone(), index, sessions, metrics),
            registry,
        )
    }

    fn req<'a>(body: &'a [u8], headers: &'a [(String, String)]) -> DecideRequest<'a> {
        DecideRequest {
            path: "/v1/completions",
            headers,
            body: Some(body),
            subset: None,
            dry_run: false,
        }
    }

    fn prompt(prefix: &str, suffix: &str) -> Vec<u8> {
        let text = format!("{}{}", prefix.repeat(40), suffix);
        serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": text})).unwrap()
    }

    #[tokio::test]
    async fn same_prefix_follows_the_first_decision() {
        let (d, _) = decider(4, |_| {}).await;
        let first = d
            .decide(req(&prompt("shared system prompt ", "q1"), &[]))
            .await
            .unwrap();
        for q in ["q2", "q3", "q4"] {
            let next = d
                .decide(req(&prompt("shared system prompt ", q), &[]))
                .await
                .unwrap();
            assert_eq!(next.endpoints[0], first.endpoints[0]);
            assert!(next.ranked[0].matched_blocks > 10.0);
        }
        assert_eq!(first.endpoints.len(), 3, "primary + 2 fallbacks");
    }

    #[tokio::test]
    async fn dry_run_records_nothing() {
        let (d, _) = decider(2, |_| {}).await;
        let body = prompt("abc ", "x");
        let a = d
            .decide(DecideRequest {
                dry_run: true,
                ..req(&body, &[])
            })
            .await
            .unwrap();
        assert!(a.guard.is_none());
        assert_eq!(d.index().stats().entries, 0);
    }

    #[tokio::test]
    async fn saturated_pod_is_avoided_despite_its_cache() {
        let (d, reg) = decider(2, |_| {}).await;
        let body = prompt("hot prefix ", "x");
        let first = d.decide(req(&body, &[])).await.unwrap();
        let hot = reg.snapshot().get(&first.endpoints[0]).unwrap().clone();
        hot.record_sample(
            Instant::now(),
            LoadSample {
                waiting: 50.0,
                ..LoadSample::default()
            },
        );
        let next = d.decide(req(&body, &[])).await.unwrap();
        assert_ne!(next.endpoints[0], first.endpoints[0]);
        assert_eq!(
            next.endpoints[1], first.endpoints[0],
            "the warm pod stays a fallback"
        );
    }

    #[tokio::test]
    async fn session_header_sticks() {
        let (d, _) = decider(4, |c| c.scorers.prefix.weight = 0.0).await;
        let h = vec![("x-session-id".to_string(), "s1".to_string())];
        let first = d.decide(req(&prompt("a", "1"), &h)).await.unwrap();
        // Three follow-ups: more outstanding requests than the hot gate allows would spill, by design.
        for i in 0..3 {
            let next = d
                .decide(req(&prompt(&format!("unrelated {i}"), "z"), &h))
                .await
                .unwrap();
            assert_eq!(next.endpoints[0], first.endpoints[0]);
        }
    }

    #[tokio::test]
    async fn errors_map_to_statuses() {
        let (d, reg) = decider(2, |_| {}).await;
        let other =
            serde_json::to_vec(&serde_json::json!({"model": "nope", "prompt": "x"})).unwrap();
        assert_eq!(d.decide(req(&other, &[])).await.unwrap_err().status(), 404);
        let subset = vec!["10.9.9.9".to_string()];
        let r = DecideRequest {
            subset: Some(&subset),
            ..req(&other, &[])
        };
        assert_eq!(d.decide(r).await.unwrap_err(), DecideError::EmptySubset);
        let bad = d.decide(req(b"{nope", &[])).await.unwrap();
        assert_eq!(bad.reason, Reason::Unparsable);
        for p in reg.snapshot().pods() {
            p.record_probe(false, 1);
        }
        let e = d.decide(req(&other, &[])).await.unwrap_err();
        assert_eq!(e.status(), 503);
        let body: serde_json::Value = serde_json::from_slice(&e.openai_body()).unwrap();
        assert!(body["error"]["message"].is_string());
        let (strict, _) = decider(1, |c| c.strict = true).await;
        assert_eq!(
            strict
                .decide(req(b"{nope", &[]))
                .await
                .unwrap_err()
                .status(),
            400
        );
    }

    #[tokio::test]
    async fn subset_restricts_candidates() {
        let (d, _) = decider(4, |_| {}).await;
        let subset = vec!["127.0.0.1:8002".to_string()];
        for i in 0..5 {
            let body = prompt(&format!("p{i}"), "x");
            let r = DecideRequest {
                subset: Some(&subset),
                ..req(&body, &[])
            };
            assert_eq!(
                d.decide(r).await.unwrap().endpoints,
                vec![PodId::new("127.0.0.1:8002")]
            );
        }
        assert!(in_subset(
            &PodId::new("127.0.0.1:8002"),
            &["127.0.0.1".to_string()]
        ));
    }

    #[tokio::test]
    async fn body_less_requests_go_to_least_loaded() {
        let (d, reg) = decider(2, |_| {}).await;
        let busy = reg.snapshot().pods()[0].clone();
        busy.record_sample(
            Instant::now(),
            LoadSample {
                waiting: 5.0,
                ..LoadSample::default()
            },
        );
        let r = DecideRequest {
            body: None,
            ..req(b"", &[])
        };
        let dec = d.decide(r).await.unwrap();
        assert_eq!(dec.reason, Reason::NoBody);
        assert_eq!(&dec.endpoints[0], reg.snapshot().pods()[1].id());
    }
}
