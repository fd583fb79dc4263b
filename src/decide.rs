//! The one decision path shared by ext_proc, the Pick service, `/debug/explain` and
//! `kv-bench simulate`, in two halves:
//!
//! * [`plan`]: a pure function of its inputs (the [`Stages`], the request's block keys, the
//!   candidates with their matched blocks, load and session flag, a round-robin turn and an rng)
//!   that scores and ranks the candidates. It does no I/O and reads no clock.
//! * [`commit`]: records a plan: the primary pod learns the prompt in the index, the session is
//!   pinned to it, and its load is charged until the request ends (the in-flight guard).
//!
//! [`Decider`] is the live front: parse → pods → keys → index lookup → [`plan`] → [`commit`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use rand::Rng;
use serde::Serialize;
use thiserror::Error;
use tokio::time::Instant;
use tracing::debug;

use crate::blocks::BlockScheme;
use crate::config::{Config, Policy};
use crate::index::{IndexError, KvIndex};
use crate::keys::{Keyer, Keys};
use crate::picker::{Picker, Reason};
use crate::pods::{InflightGuard, Pod, PodId, PodRegistry};
use crate::request::{self, RequestError, RoutingRequest};
use crate::scoring::{
    run_scorer, Candidate, LoadScorer, PrefixScorer, ScoreError, ScoreInput, Scorer, SessionKey,
    SessionScorer, SessionStore,
};
use crate::telemetry::{ErrorKind, Errors};
use crate::tokenize::TokenizerRegistry;

/// The scoring stages of a decision (scorers, load signal, pickers, retry list length) built
/// from config, with no pod registry or clock.
pub struct Stages {
    scorers: Vec<Box<dyn Scorer>>,
    load: LoadScorer,
    picker: Picker,
    least_loaded: Picker,
    fallbacks: usize,
    prefill_tokens_per_sec: f64,
}

impl Stages {
    /// The prefix, session and load scorers with their configured weights, the policy's picker.
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
            least_loaded: Picker::new(Policy::LeastLoaded, vec![], cfg.gate.clone()),
            fallbacks: cfg.fallbacks,
            prefill_tokens_per_sec: s.load.prefill_tokens_per_sec,
        }
    }

    /// The configured prefill rate (tokens/s) the in-flight estimate uses.
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        self.prefill_tokens_per_sec
    }
}

/// How the request body was understood: it decides which picker ranks the candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// Parsed: the policy's picker on the weighted scores.
    Parsed,
    /// No body: least-loaded.
    Missing,
    /// Not understood (and not strict): least-loaded.
    Unparsable,
}

/// Everything [`plan`] decides on.
#[derive(Debug, Clone)]
pub struct PlanInput {
    /// The request's block keys (empty for body-less and unparsable requests).
    pub keys: Keys,
    /// How the body was understood.
    pub body: Body,
    /// Candidate pods with the blocks the index matched, their load and the session flag.
    pub candidates: Vec<Candidate>,
    /// The request's session, pinned to the primary on commit.
    pub session: Option<SessionKey>,
    /// Round-robin position (the caller counts decisions).
    pub turn: u64,
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

/// A ranked decision, not yet recorded anywhere.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Primary first, then fallbacks in retry order.
    pub endpoints: Vec<PodId>,
    /// All candidates, best first.
    pub ranked: Vec<ScoredPod>,
    /// Why.
    pub reason: Reason,
    /// Full blocks in the prompt.
    pub total_blocks: usize,
    /// Index of the primary among the input's candidates.
    #[serde(skip)]
    pub primary: usize,
    /// Estimated prompt tokens the primary does not hold (charged to it on commit).
    #[serde(skip)]
    pub uncached_tokens: u64,
    /// Scorers that failed (their scores counted as 0).
    #[serde(skip)]
    pub scorer_errors: Vec<ScoreError>,
    #[serde(skip)]
    keys: Keys,
    #[serde(skip)]
    session: Option<SessionKey>,
}

impl Plan {
    /// `ip:port[,ip:port…]` for the metadata and header.
    pub fn destination(&self) -> String {
        self.endpoints
            .iter()
            .map(PodId::as_str)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Scores and ranks the candidates of one request (at least one candidate). Pure: the same
/// inputs and rng state give the same plan.
pub fn plan(stages: &Stages, input: PlanInput, rng: &mut impl Rng) -> Plan {
    let PlanInput {
        keys,
        body,
        candidates,
        session,
        turn,
    } = input;
    let input = ScoreInput {
        total_blocks: keys.keys.len(),
        candidates,
    };
    let busy: Vec<f64> = input
        .candidates
        .iter()
        .map(|c| stages.load.busy(&c.load))
        .collect();
    let mut scorer_errors = Vec::new();
    let scores: Vec<Vec<f64>> = stages
        .scorers
        .iter()
        .map(|scorer| {
            run_scorer(scorer.as_ref(), &input).unwrap_or_else(|e| {
                scorer_errors.push(e);
                vec![0.0; input.candidates.len()]
            })
        })
        .collect();
    let (ranking, reason) = match body {
        Body::Parsed => {
            let r = stages.picker.rank(&input, &scores, &busy, turn, rng);
            let reason = r.reason;
            (r, reason)
        }
        Body::Missing | Body::Unparsable => (
            stages.least_loaded.rank(&input, &[], &busy, turn, rng),
            if body == Body::Missing {
                Reason::NoBody
            } else {
                Reason::Unparsable
            },
        ),
    };
    let ranked: Vec<ScoredPod> = ranking
        .order
        .iter()
        .map(|&i| ScoredPod {
            pod: input.candidates[i].pod.clone(),
            total: ranking.totals[i],
            scores: stages
                .scorers
                .iter()
                .zip(&scores)
                .map(|(s, v)| (s.name(), v[i]))
                .collect(),
            matched_blocks: input.candidates[i].matched_blocks,
            saturated: ranking.saturated[i],
        })
        .collect();
    let endpoints = ranked
        .iter()
        .take(1 + stages.fallbacks)
        .map(|s| s.pod.clone())
        .collect();
    let primary = ranking.order[0];
    let cached = (input.candidates[primary].matched_blocks * keys.tokens_per_block as f64) as u64;
    Plan {
        endpoints,
        ranked,
        reason,
        total_blocks: keys.keys.len(),
        primary,
        uncached_tokens: keys.prompt_tokens.saturating_sub(cached),
        scorer_errors,
        keys,
        session,
    }
}

/// What [`commit`] did; the index write may have failed (the decision stands).
#[derive(Debug)]
pub struct Committed<G> {
    /// The load charge of the primary, held until the request ends.
    pub guard: G,
    /// The index record failed.
    pub index_error: Option<IndexError>,
}

/// Records a plan at `now_ms` (the index's time base): `charge(primary, uncached_tokens)`
/// charges the primary's load, the index learns that the primary now holds the prompt's keys,
/// and the request's session is pinned to it. `None` for the index or the session store: there
/// is none to teach (`kv-bench simulate` runs policies that ignore the index without one).
pub async fn commit<G>(
    plan: &Plan,
    index: Option<&dyn KvIndex>,
    sessions: Option<&SessionStore>,
    now_ms: u64,
    charge: impl FnOnce(usize, u64) -> G,
) -> Committed<G> {
    let guard = charge(plan.primary, plan.uncached_tokens);
    let primary = &plan.ranked[0].pod;
    let index_error = match index {
        Some(index) if !plan.keys.keys.is_empty() => {
            index.record(primary, &plan.keys.keys, now_ms).await.err()
        }
        _ => None,
    };
    if let (Some(store), Some(s)) = (sessions, plan.session) {
        store.set(s, primary.clone(), now_ms);
    }
    Committed { guard, index_error }
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
}

impl DecideRequest<'_> {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The outcome of one decision.
#[derive(Debug)]
pub struct Decision {
    /// The ranking.
    pub plan: Plan,
    /// The request's model.
    pub model: Option<String>,
    /// Load accounting held until the request ends (`None` when only planned).
    pub guard: Option<InflightGuard>,
}

/// No decision could be made; the edge (ext_proc, Pick, explain) turns this into its status.
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
}

impl DecideError {
    /// The error counter's kind.
    pub fn kind(&self) -> ErrorKind {
        match self {
            DecideError::NoHealthyPod => ErrorKind::NoHealthyPod,
            DecideError::EmptySubset => ErrorKind::EmptySubset,
            DecideError::ModelNotFound(_) => ErrorKind::ModelNotFound,
            DecideError::BadRequest(_) => ErrorKind::BadRequest,
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    reason: Reason,
    pod: String,
}

/// The decision path's metric families.
#[derive(Debug, Clone)]
pub struct DecisionMetrics {
    decisions: Family<DecisionLabels, Counter>,
    duration: Histogram,
    matched_blocks: Histogram,
    errors: Errors,
}

impl DecisionMetrics {
    /// Registers `decisions`, `decision_duration_seconds` and `predicted_matched_blocks`
    /// (`registry` is the `kv_router` sub-registry); errors go to the shared counter.
    pub fn register(registry: &mut Registry, errors: Errors) -> Self {
        let m = Self {
            decisions: Family::default(),
            duration: Histogram::new(exponential_buckets(1e-6, 2.0, 24)),
            matched_blocks: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            errors,
        };
        registry.register(
            "decisions",
            "Routing decisions by reason and primary pod",
            m.decisions.clone(),
        );
        registry.register(
            "decision_duration_seconds",
            "Time to decide (parse, keys, lookup, score, pick)",
            m.duration.clone(),
        );
        registry.register(
            "predicted_matched_blocks",
            "Prompt blocks the index predicted the chosen pod holds",
            m.matched_blocks.clone(),
        );
        m
    }

    /// Decisions committed with `reason` to `pod` so far.
    pub fn decisions(&self, reason: Reason, pod: &PodId) -> u64 {
        self.decisions
            .get_or_create(&DecisionLabels {
                reason,
                pod: pod.to_string(),
            })
            .get()
    }
}

/// The live decision path: owns the keyer, the stages and the stores, and runs them in order.
pub struct Decider {
    strict: bool,
    keyer: Keyer,
    stale_after: Duration,
    session_headers: Vec<String>,
    use_user_field: bool,
    registry: Arc<PodRegistry>,
    index: Arc<dyn KvIndex>,
    sessions: Arc<SessionStore>,
    stages: Stages,
    metrics: DecisionMetrics,
    epoch: Instant,
    turns: AtomicU64,
}

/// A planned decision with the live pods it ranked.
struct Prepared {
    plan: Plan,
    model: Option<String>,
    pods: Vec<Arc<Pod>>,
    now: Instant,
    now_ms: u64,
}

impl Decider {
    /// The live path over the router's pods, index and sessions; `tokenizers` from
    /// [`crate::keys::load_tokenizers`] (empty: approximate keys for every model).
    pub fn new(
        cfg: &Config,
        tokenizers: Arc<TokenizerRegistry>,
        registry: Arc<PodRegistry>,
        index: Arc<dyn KvIndex>,
        sessions: Arc<SessionStore>,
        metrics: DecisionMetrics,
    ) -> Self {
        let s = &cfg.scorers;
        Self {
            strict: cfg.strict,
            keyer: Keyer::new(
                BlockScheme {
                    size_chars: cfg.blocks.size_chars,
                    max_blocks: cfg.blocks.max_blocks,
                },
                cfg.kv_events.block_tokens,
                tokenizers,
            ),
            stale_after: Duration::from_millis(cfg.pods.stale_after_ms),
            session_headers: s.session.headers.clone(),
            use_user_field: s.session.use_user_field,
            registry,
            index,
            sessions,
            stages: Stages::new(cfg),
            metrics,
            epoch: Instant::now(),
            turns: AtomicU64::new(0),
        }
    }

    /// Milliseconds on the router's monotonic clock (the index's time base).
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The index (for maintenance and debug views).
    pub fn index(&self) -> &Arc<dyn KvIndex> {
        &self.index
    }

    /// Decides where a request goes and commits it (index, session, in-flight load).
    pub async fn decide(&self, req: DecideRequest<'_>) -> Result<Decision, DecideError> {
        let started = Instant::now();
        let result = match self.prepare(req).await {
            Ok(p) => Ok(self.commit(p).await),
            Err(e) => Err(e),
        };
        self.finish(started, &result);
        if let Ok(d) = &result {
            self.metrics
                .decisions
                .get_or_create(&DecisionLabels {
                    reason: d.plan.reason,
                    pod: d.plan.endpoints[0].to_string(),
                })
                .inc();
            if let Some(best) = d.plan.ranked.first() {
                self.metrics.matched_blocks.observe(best.matched_blocks);
            }
        }
        result
    }

    /// The decision [`Decider::decide`] would make now, recording nothing.
    pub async fn plan(&self, req: DecideRequest<'_>) -> Result<Decision, DecideError> {
        let started = Instant::now();
        let result = self.prepare(req).await.map(|p| Decision {
            plan: p.plan,
            model: p.model,
            guard: None,
        });
        self.finish(started, &result);
        result
    }

    fn finish(&self, started: Instant, result: &Result<Decision, DecideError>) {
        self.metrics
            .duration
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = result {
            self.metrics.errors.inc(e.kind());
        }
    }

    async fn commit(&self, p: Prepared) -> Decision {
        let rate = self.stages.prefill_tokens_per_sec();
        let pods = &p.pods;
        let now = p.now;
        let c = commit(
            &p.plan,
            Some(self.index.as_ref()),
            Some(&self.sessions),
            p.now_ms,
            |i, tokens| pods[i].begin_request(tokens, now, rate),
        )
        .await;
        if let Some(e) = c.index_error {
            debug!(error = %e, "index record failed");
            self.metrics.errors.inc(ErrorKind::Index);
        }
        Decision {
            plan: p.plan,
            model: p.model,
            guard: Some(c.guard),
        }
    }

    async fn prepare(&self, req: DecideRequest<'_>) -> Result<Prepared, DecideError> {
        let parsed: Option<RoutingRequest> = match req.body {
            None => None,
            Some(body) => match request::parse(req.path, body) {
                Ok(r) => Some(r),
                Err(e) if self.strict => return Err(DecideError::BadRequest(e)),
                Err(e) => {
                    debug!(kind = e.kind(), "unparsable body; routing by load");
                    self.metrics.errors.inc(ErrorKind::Unparsable);
                    None
                }
            },
        };
        let model = parsed.as_ref().and_then(|r| r.model.clone());
        let pods = self.candidates(req.subset, model.as_deref())?;
        let keys = parsed
            .as_ref()
            .map(|r| self.keyer.keys(r))
            .unwrap_or_default();
        if let Some(kind) = keys.tokenize_error {
            debug!(kind, "tokenization failed; approximate keys");
            self.metrics.errors.inc(ErrorKind::Tokenize);
        }
        let ids: Vec<PodId> = pods.iter().map(|p| p.id().clone()).collect();
        let now_ms = self.now_ms();
        let matched = if keys.keys.is_empty() {
            vec![0.0; ids.len()]
        } else {
            self.index
                .lookup(&keys.keys, &ids, now_ms)
                .await
                .unwrap_or_else(|e| {
                    debug!(error = %e, "index lookup failed; scoring without it");
                    self.metrics.errors.inc(ErrorKind::Index);
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
        let candidates = pods
            .iter()
            .zip(matched)
            .map(|(p, matched_blocks)| Candidate {
                pod: p.id().clone(),
                matched_blocks,
                load: p.load(now, self.stale_after),
                session_pod: session_pod.as_ref() == Some(p.id()),
            })
            .collect();
        let body = match (&parsed, req.body) {
            (Some(_), _) => Body::Parsed,
            (None, None) => Body::Missing,
            (None, Some(_)) => Body::Unparsable,
        };
        let input = PlanInput {
            keys,
            body,
            candidates,
            session,
            turn: self.turns.fetch_add(1, Ordering::Relaxed),
        };
        let plan = plan(&self.stages, input, &mut rand::rng());
        for e in &plan.scorer_errors {
            debug!(error = %e, "scorer failed; its scores count as 0");
            self.metrics.errors.inc(ErrorKind::Scorer);
        }
        Ok(Prepared {
            plan,
            model,
            pods,
            now,
            now_ms,
        })
    }

    /// Healthy pods in the subset that serve the model.
    fn candidates(
        &self,
        subset: Option<&[String]>,
        model: Option<&str>,
    ) -> Result<Vec<Arc<Pod>>, DecideError> {
        let snapshot = self.registry.snapshot();
        let healthy: Vec<&Arc<Pod>> = snapshot.pods().iter().filter(|p| p.is_healthy()).collect();
        if healthy.is_empty() {
            return Err(DecideError::NoHealthyPod);
        }
        let in_subset: Vec<&Arc<Pod>> = match subset {
            None => healthy,
            Some(subset) => healthy
                .into_iter()
                .filter(|p| in_subset(p.id(), subset))
                .collect(),
        };
        if in_subset.is_empty() {
            return Err(DecideError::EmptySubset);
        }
        let pods: Vec<Arc<Pod>> = in_subset
            .into_iter()
            .filter(|p| p.serves(model))
            .cloned()
            .collect();
        if pods.is_empty() {
            return Err(DecideError::ModelNotFound(model.unwrap_or_default().into()));
        }
        Ok(pods)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, StaticPod};
    use crate::index::MemoryIndex;
    use crate::pods::PodSource;
    use crate::pods::{LoadSample, PodSpec, StaticSource};
    use rand::rngs::StdRng;
    use rand::SeedableRng;

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
        let metrics = DecisionMetrics::register(&mut Registry::default(), Errors::default());
        let index = Arc::new(MemoryIndex::new(cfg.index.ttl_ms, 1000));
        let sessions = Arc::new(SessionStore::new(100, 10_000));
        let d = Decider::new(
            &cfg,
            Arc::default(),
            registry.clone(),
            index,
            sessions,
            metrics,
        );
        (d, registry)
    }

    fn req<'a>(body: &'a [u8], headers: &'a [(String, String)]) -> DecideRequest<'a> {
        DecideRequest {
            path: "/v1/completions",
            headers,
            body: Some(body),
            subset: None,
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
            assert_eq!(next.plan.endpoints[0], first.plan.endpoints[0]);
            assert!(next.plan.ranked[0].matched_blocks > 10.0);
        }
        assert_eq!(first.plan.endpoints.len(), 3, "primary + 2 fallbacks");
        assert_eq!(
            d.metrics
                .decisions(Reason::Scored, &first.plan.endpoints[0]),
            4
        );
    }

    #[tokio::test]
    async fn planning_alone_records_nothing() {
        let (d, reg) = decider(2, |_| {}).await;
        let body = prompt("abc ", "x");
        let h = vec![("x-session-id".to_string(), "s1".to_string())];
        let a = d.plan(req(&body, &h)).await.unwrap();
        assert!(a.guard.is_none());
        assert_eq!(d.index().stats().entries, 0);
        assert!(d.sessions.is_empty());
        for p in reg.snapshot().pods() {
            assert_eq!(p.inflight_counts(), (0, 0));
        }
        assert_eq!(d.metrics.decisions(a.plan.reason, &a.plan.endpoints[0]), 0);
        let b = d.decide(req(&body, &h)).await.unwrap();
        assert!(b.guard.is_some());
        assert!(d.index().stats().entries > 0);
        assert_eq!(d.sessions.len(), 1);
    }

    #[test]
    fn plan_is_a_function_of_its_inputs() {
        let stages = Stages::new(&Config::default());
        let input = || PlanInput {
            keys: Keys {
                keys: (0..8).map(crate::blocks::BlockKey).collect(),
                tokens_per_block: 16,
                prompt_tokens: 130,
                ..Keys::default()
            },
            body: Body::Parsed,
            candidates: (0..4)
                .map(|i| Candidate {
                    pod: PodId::new(format!("p:{i}")),
                    matched_blocks: if i == 2 { 5.0 } else { 0.0 },
                    load: crate::pods::PodLoad {
                        fresh: true,
                        ..Default::default()
                    },
                    session_pod: false,
                })
                .collect(),
            session: None,
            turn: 0,
        };
        let a = plan(&stages, input(), &mut StdRng::seed_from_u64(3));
        let b = plan(&stages, input(), &mut StdRng::seed_from_u64(3));
        assert_eq!(
            serde_json::to_value(&a).unwrap(),
            serde_json::to_value(&b).unwrap()
        );
        assert_eq!((a.primary, a.reason), (2, Reason::Scored));
        assert_eq!(a.uncached_tokens, 130 - 5 * 16);
    }

    #[tokio::test]
    async fn saturated_pod_is_avoided_despite_its_cache() {
        let (d, reg) = decider(2, |_| {}).await;
        let body = prompt("hot prefix ", "x");
        let first = d.decide(req(&body, &[])).await.unwrap();
        let hot = reg
            .snapshot()
            .get(&first.plan.endpoints[0])
            .unwrap()
            .clone();
        hot.record_sample(
            Instant::now(),
            LoadSample {
                waiting: 50.0,
                ..LoadSample::default()
            },
        );
        let next = d.decide(req(&body, &[])).await.unwrap();
        assert_ne!(next.plan.endpoints[0], first.plan.endpoints[0]);
        assert_eq!(
            next.plan.endpoints[1], first.plan.endpoints[0],
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
            assert_eq!(next.plan.endpoints[0], first.plan.endpoints[0]);
        }
    }

    #[tokio::test]
    async fn failures_are_typed_and_counted() {
        let (d, reg) = decider(2, |_| {}).await;
        let other =
            serde_json::to_vec(&serde_json::json!({"model": "nope", "prompt": "x"})).unwrap();
        assert_eq!(
            d.decide(req(&other, &[])).await.unwrap_err(),
            DecideError::ModelNotFound("nope".into())
        );
        let subset = vec!["10.9.9.9".to_string()];
        let r = DecideRequest {
            subset: Some(&subset),
            ..req(&other, &[])
        };
        assert_eq!(d.decide(r).await.unwrap_err(), DecideError::EmptySubset);
        let bad = d.decide(req(b"{nope", &[])).await.unwrap();
        assert_eq!(bad.plan.reason, Reason::Unparsable);
        assert_eq!(d.metrics.errors.get(ErrorKind::Unparsable), 1);
        for p in reg.snapshot().pods() {
            p.record_probe(false, 1);
        }
        let e = d.decide(req(&other, &[])).await.unwrap_err();
        assert_eq!(e, DecideError::NoHealthyPod);
        assert_eq!(d.metrics.errors.get(ErrorKind::NoHealthyPod), 1);
        let (strict, _) = decider(1, |c| c.strict = true).await;
        assert!(matches!(
            strict.decide(req(b"{nope", &[])).await.unwrap_err(),
            DecideError::BadRequest(_)
        ));
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
                d.decide(r).await.unwrap().plan.endpoints,
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
        assert_eq!(dec.plan.reason, Reason::NoBody);
        assert_eq!(&dec.plan.endpoints[0], reg.snapshot().pods()[1].id());
    }
}
