//! The one decision path shared by ext_proc, the Pick service, `/debug/explain` and
//! `kv-bench simulate`, in two halves:
//!
//! * [`plan`]: a pure function of its inputs (the [`Stages`], the request's block keys, the
//!   candidates with their matched blocks, load, session flag and adapter fit, for a P/D model
//!   the prefill candidates too, a round-robin turn and an rng) that scores and ranks the
//!   candidates. It does no I/O and reads no clock.
//! * [`commit`]: records a plan: the primary pod learns the prompt in the index, the session is
//!   pinned to it, and its load is charged until the request ends (the in-flight guard).
//!
//! [`Decider`] is the live front: parse → pods → keys → [`DecisionState::gather`] (index
//! lookup, session, each pod's readings: the one gatherer, shared with `kv-bench simulate`) →
//! [`DecisionState::plan`] (the one planning entry point: base-model, LoRA and P/D requests) →
//! [`commit`].
//!
//! Files, bottom up: `plan.rs` (the plan's types, [`rank`], [`commit`]), `disagg.rs` ([`plan`]:
//! P/D on top of `rank`), `input.rs` ([`DecisionInput`], its gatherer and the entry point), this
//! file (the live front, handed the config's [`DecisionSections`]).

mod disagg;
mod input;
mod metrics;
mod plan;
mod unrecorded;

use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::blocks::{BlockKey, BlockScheme};
use crate::config::{DecisionSections, GateConfig, PodRole, SessionScorerConfig};
use crate::index::KvIndex;
use crate::keys::{Keyer, Keys};
use crate::pods::{
    prefill_time, InflightGuard, Pod, PodId, PodLoad, PodRegistry, PrefillVerdict, TtftPrior,
};
use crate::request::{self, RequestError, RoutingRequest};
use crate::scoring::{BodyIds, SessionKey, SessionStore};
use crate::share::{Charge, LoadShare, NoShare};
use crate::telemetry::ErrorKind;
use crate::tokenize::TokenizerRegistry;
use metrics::DecisionLabels;
use unrecorded::Unrecorded;

pub use crate::conversation::{Conversations, RemoteDecisions, SessionSeen, PROMPT_ENDS};
pub use disagg::{plan, plan_pd, split_roles, PlanInputs};
pub use input::{
    DecisionInput, DecisionState, Planned, PodFacts, PodReading, Recording, RequestFacts,
};
pub use metrics::DecisionMetrics;
pub use plan::{
    commit, log_decision, rank, Body, Committed, PdOutcome, PdPlan, Plan, PlanInput, ScoredPod,
    Stages, Stores,
};

impl Stages {
    /// The stages `cfg` configures (policy, scorers, gate, retry list, P/D threshold).
    pub fn new(cfg: DecisionSections<'_>) -> Self {
        Self::from_sections(
            cfg.policy,
            cfg.fallbacks,
            cfg.scorers,
            cfg.gate,
            cfg.disaggregation,
        )
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
    /// This replica's id of a committed decision (0: planned only), unique per replica: a
    /// counter from a random start, never derived from the request. Rendered `{:016x}`.
    pub id: u64,
    /// The ranking.
    pub plan: Plan,
    /// The request's model.
    pub model: Option<String>,
    /// Load accounting held until the request ends (`None` when only planned).
    pub guard: Option<InflightGuard>,
    /// The prefill pod's load charge when disaggregated, held until its prefill ends (the
    /// decode pod's first response bytes).
    pub prefill_guard: Option<InflightGuard>,
}

/// A decision's index record, left for after the reply ([`Decider::decide_reply_first`]).
/// Until it is recorded or dropped, the decider's lookups count it as if it were in the index.
pub struct PendingRecord {
    pod: PodId,
    /// The prefill pod of a disaggregated decision: it computed the prompt, so it holds it too.
    prefill: Option<PodId>,
    keys: Arc<[BlockKey]>,
    now_ms: u64,
    /// The request's load, which the other replicas count too (shared index).
    charge: Charge,
    id: u64,
    unrecorded: Arc<Unrecorded>,
}

impl std::fmt::Debug for PendingRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingRecord")
            .field("pod", &self.pod)
            .field("blocks", &self.keys.len())
            .finish()
    }
}

impl Drop for PendingRecord {
    fn drop(&mut self) {
        self.unrecorded.landed(self.id);
    }
}

/// Every candidate pod of the request is saturated: nothing was decided or committed (flow
/// control holds the request and asks [`Decider::has_room`] when to try again).
#[derive(Debug, Clone, PartialEq)]
pub struct Saturated {
    /// The request's model.
    pub model: Option<String>,
}

/// Flow control's "requests of this model already wait" test.
pub type Waiting<'a> = dyn Fn(Option<&str>) -> bool + Sync + 'a;

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

/// Bodies at least this big are parsed and keyed off the async workers when keys are text
/// blocks: a 1 MiB body takes about a millisecond, and handing the worker over costs a 400 KB
/// body 0.2-0.3 ms of its answer (`kv-bench overhead`'s answer-time pass).
const OFFLOAD_BYTES: usize = 1 << 20;

/// The same when a model has a tokenizer (precise mode): tokenizing 64 KiB can already take
/// milliseconds when its prefix is not cached.
const OFFLOAD_BYTES_TOKENIZED: usize = 64 * 1024;

/// The live decision path: owns the keyer, the stages and the stores, and runs them in order.
pub struct Decider {
    strict: bool,
    keyer: Arc<Keyer>,
    /// Bounds how many big bodies are parsed and keyed at once off the async workers.
    heavy: Arc<tokio::sync::Semaphore>,
    /// Bodies this big or bigger are parsed and keyed off the async workers.
    offload_bytes: usize,
    stale_after: Duration,
    /// `scorers.session`: where a request names its session.
    session: SessionScorerConfig,
    registry: Arc<PodRegistry>,
    index: Arc<dyn KvIndex>,
    /// Replica load sharing (a shared index's), [`NoShare`] unless [`Decider::with_load_share`].
    share: Arc<dyn LoadShare>,
    /// Conversations, sessions and decisions answered before their index record landed.
    state: DecisionState,
    stages: Stages,
    metrics: DecisionMetrics,
    epoch: Instant,
    pd_unserved_after: Duration,
    /// `disaggregation.header`.
    prefill_header: String,
    /// The saturation gate's thresholds (flow control's test for room).
    gate: GateConfig,
    /// Held from reading the pods' loads to committing the charge: one decision at a time.
    committing: parking_lot::Mutex<()>,
    /// The next committed decision's id.
    ids: std::sync::atomic::AtomicU64,
}

/// What a live decision gathered before it plans.
struct Gathered {
    input: DecisionInput,
    model: Option<String>,
    /// The candidates, in `input.pods` order.
    pods: Vec<Arc<Pod>>,
    now: Instant,
    now_ms: u64,
}

impl Gathered {
    fn loads(&self) -> Vec<&PodLoad> {
        self.input.pods.iter().map(|f| &f.load).collect()
    }
}

/// A planned decision with the live pods it ranked.
struct Prepared {
    plan: Plan,
    model: Option<String>,
    /// The candidates (`plan.primary` and `plan.pd`'s prefill pod among them).
    pods: Vec<Arc<Pod>>,
    now: Instant,
    now_ms: u64,
    /// Its entry among the unrecorded decisions, and its keys (decisions to commit only).
    unrecorded: Option<(u64, Arc<[BlockKey]>)>,
    /// The request names a LoRA adapter.
    adapter: bool,
}

impl Decider {
    /// The live path over the router's pods, index and sessions; `tokenizers` from
    /// [`crate::keys::load_tokenizers`] (empty: approximate keys for every model).
    pub fn new(
        cfg: DecisionSections<'_>,
        tokenizers: Arc<TokenizerRegistry>,
        registry: Arc<PodRegistry>,
        index: Arc<dyn KvIndex>,
        sessions: Arc<SessionStore>,
        metrics: DecisionMetrics,
    ) -> Self {
        let s = cfg.scorers;
        let offload_bytes = if tokenizers.is_empty() {
            OFFLOAD_BYTES
        } else {
            OFFLOAD_BYTES_TOKENIZED
        };
        Self {
            strict: cfg.strict,
            offload_bytes,
            keyer: Arc::new(Keyer::new(
                BlockScheme {
                    size_chars: cfg.blocks.size_chars,
                    max_blocks: cfg.blocks.max_blocks,
                },
                cfg.kv_events.block_tokens,
                tokenizers,
            )),
            heavy: Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            )),
            stale_after: Duration::from_millis(cfg.stale_after_ms),
            session: s.session.clone(),
            registry,
            index,
            share: Arc::new(NoShare),
            state: DecisionState::new(cfg.gate, sessions, Recording::AfterReply),
            stages: Stages::new(cfg),
            metrics,
            epoch: Instant::now(),
            pd_unserved_after: Duration::from_millis(cfg.disaggregation.prefill_unserved_after_ms),
            prefill_header: cfg.disaggregation.header.clone(),
            gate: cfg.gate.clone(),
            committing: parking_lot::Mutex::new(()),
            ids: std::sync::atomic::AtomicU64::new(rand::random()),
        }
    }

    /// Shares this router's load with the other replicas through `share` (the shared index's).
    pub fn with_load_share(mut self, share: Arc<dyn LoadShare>) -> Self {
        self.share = share;
        self
    }

    /// A committed decision's id (never 0, which marks a plan).
    fn next_id(&self) -> u64 {
        loop {
            let id = self.ids.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if id != 0 {
                return id;
            }
        }
    }

    /// The session store, where a served response's id is pinned to its pod.
    pub fn sessions(&self) -> &Arc<SessionStore> {
        self.state.sessions()
    }

    /// The request header that names the prefill pod (`disaggregation.header`).
    pub fn prefill_header(&self) -> &str {
        &self.prefill_header
    }

    /// Milliseconds on the router's monotonic clock (the index's time base).
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Where every pod's prefill model starts (`scorers.load.prefill_tokens_per_sec`,
    /// `scorers.ttft`).
    pub fn ttft_prior(&self) -> &TtftPrior {
        self.stages.ttft_prior()
    }

    /// This router's conversation memory (the mirror records the other replicas' marks in it).
    pub fn conversations(&self) -> Arc<Conversations> {
        self.state.conversations().clone()
    }

    /// The index (for maintenance and debug views).
    pub fn index(&self) -> &Arc<dyn KvIndex> {
        &self.index
    }

    /// Decides where a request goes and commits it (index, session, in-flight load).
    pub async fn decide(&self, req: DecideRequest<'_>) -> Result<Decision, DecideError> {
        let (decision, pending) = self.decide_reply_first(req).await?;
        if let Some(p) = pending {
            self.record(p).await;
        }
        Ok(decision)
    }

    /// [`Self::decide`] without the index record, which is returned for [`Self::record`]: the
    /// ext_proc stream sends its answer first, so a long prompt's record (an LRU move and a
    /// holder update per block, or a Redis round trip) is not on the request's path. Load,
    /// session and prompt ends are committed before this returns.
    pub async fn decide_reply_first(
        &self,
        req: DecideRequest<'_>,
    ) -> Result<(Decision, Option<PendingRecord>), DecideError> {
        match self.decide_or_hold(req, None).await? {
            Ok(d) => Ok(d),
            // Unreachable: nothing is held without `hold`.
            Err(Saturated { .. }) => Err(DecideError::NoHealthyPod),
        }
    }

    /// [`Self::decide_reply_first`], except that with `hold` (flow control), a request is not
    /// decided when `hold(model)` says requests of its model already wait, or when none of its
    /// candidate pods has room: it gets [`Saturated`] and nothing is committed.
    pub async fn decide_or_hold(
        &self,
        req: DecideRequest<'_>,
        hold: Option<&Waiting<'_>>,
    ) -> Result<Result<(Decision, Option<PendingRecord>), Saturated>, DecideError> {
        let started = Instant::now();
        let result = match self.gather(req).await {
            Ok(g)
                if hold.is_some_and(|waiting| {
                    waiting(g.model.as_deref()) || !self.room_among(&g.pods, &g.loads())
                }) =>
            {
                Ok(Err(Saturated { model: g.model }))
            }
            Ok(g) => Ok(Ok(self.plan_and_commit(g))),
            Err(e) => Err(e),
        };
        self.finish(started, result.as_ref().err());
        if let Ok(Ok((d, _))) = &result {
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
            if let Some(pd) = &d.plan.pd {
                self.metrics.count_pd(pd);
            }
        }
        result
    }

    /// Whether some pod that could serve `model` (in `subset`) has room now: not saturated by
    /// the gate's load tests. No candidate at all counts as room: the decision reports why.
    pub fn has_room(&self, model: Option<&str>, subset: Option<&[String]>) -> bool {
        let Ok(pods) = self.candidates(subset, model) else {
            return true;
        };
        let now = Instant::now();
        let loads: Vec<PodLoad> = pods.iter().map(|p| p.load(now, self.stale_after)).collect();
        self.room_among(&pods, &loads.iter().collect::<Vec<_>>())
    }

    /// The gate's room test over the pods that would take the request: the decode pods of a
    /// P/D model (a saturated prefill pod only moves the prefill to the decode pod).
    fn room_among(&self, pods: &[Arc<Pod>], loads: &[&PodLoad]) -> bool {
        let roles: Vec<PodRole> = pods.iter().map(|p| p.role()).collect();
        let loads: Vec<&PodLoad> = match split_roles(&roles) {
            None => loads.to_vec(),
            Some((decode, _)) => decode
                .iter()
                .filter_map(|&i| loads.get(i).copied())
                .collect(),
        };
        crate::picker::has_room(&self.gate, &loads)
    }

    /// Teaches the index a decision's keys on its pod; a failure is counted and logged.
    pub async fn record(&self, p: PendingRecord) {
        if !self
            .share
            .record_decision(&p.pod, &p.keys, p.now_ms, p.charge)
        {
            if let Err(e) = self.index.record(&p.pod, &p.keys, p.now_ms).await {
                debug!(error = %e, "index record failed");
                self.metrics.errors.inc(ErrorKind::Index);
            }
        }
        if let Some(prefill) = p.prefill.as_ref().filter(|q| **q != p.pod) {
            if let Err(e) = self.index.record(prefill, &p.keys, p.now_ms).await {
                debug!(error = %e, "index record of the prefill pod failed");
                self.metrics.errors.inc(ErrorKind::Index);
            }
        }
    }

    /// The decision [`Decider::decide`] would make now, recording nothing.
    pub async fn plan(&self, req: DecideRequest<'_>) -> Result<Decision, DecideError> {
        let started = Instant::now();
        let result = self.prepare(req, false).await.map(|p| Decision {
            id: 0,
            plan: p.plan,
            model: p.model,
            guard: None,
            prefill_guard: None,
        });
        self.finish(started, result.as_ref().err());
        result
    }

    fn finish(&self, started: Instant, error: Option<&DecideError>) {
        self.metrics
            .duration
            .observe(started.elapsed().as_secs_f64());
        if let Some(e) = error {
            self.metrics.errors.inc(e.kind());
        }
    }

    /// Plans and commits `g` as one step, its pods' loads read inside it: a decision whose
    /// lookup overlapped another's plans on that one's charge and conversation, never on loads
    /// read before it (two clients sending at once on a new prefix both went to one pod).
    fn plan_and_commit(&self, mut g: Gathered) -> (Decision, Option<PendingRecord>) {
        let _one_at_a_time = self.committing.lock();
        g.now = Instant::now();
        for (facts, pod) in g.input.pods.iter_mut().zip(&g.pods) {
            facts.load = pod.load(g.now, self.stale_after);
        }
        self.commit(self.plan_gathered(g, true))
    }

    fn commit(&self, p: Prepared) -> (Decision, Option<PendingRecord>) {
        let pods = &p.pods;
        let now = p.now;
        let mut guard = self.state.commit_now(&p.plan, p.now_ms, |i, tokens, rate| {
            pods[i].begin_request(tokens, now, rate)
        });
        // Checked against the pod's own hit counters (`pods::HitAccuracy`).
        let keys = &p.plan.keys;
        let hits = crate::pods::predicted_hit_tokens(
            p.plan.ranked[0].matched_blocks,
            keys.tokens_per_block,
            keys.prompt_tokens,
        );
        pods[p.plan.primary].predicted_hits(hits, keys.prompt_tokens);
        if let (true, Some(model)) = (p.adapter, p.model.as_deref()) {
            pods[p.plan.primary].lora_routed(model);
        }
        let prefill_guard = p.plan.pd.as_ref().and_then(|pd| {
            let id = pd.prefill.as_ref()?;
            let pod = pods.iter().find(|q| q.id() == id)?;
            pod.prefill_sent(now, keys.prompt_tokens);
            Some(pod.begin_request(pd.prefill_uncached_tokens, now, pd.prefill_tokens_per_sec))
        });
        let pending = p.unrecorded.map(|(id, keys)| {
            let pod = p.plan.ranked[0].pod.clone();
            let mut charge = Charge {
                uncached_tokens: p.plan.uncached_tokens,
                prefill_ms: prefill_time(
                    p.plan.uncached_tokens,
                    p.plan.ranked[0].predicted.tokens_per_sec,
                )
                .as_millis() as u64,
                mark: Some(p.plan.conversation_mark()),
                announced: None,
            };
            // The other replicas count it now, not once its record (after the reply) reaches them.
            charge.announced = self.share.announce(&pod, &charge);
            // ... and count its tokens until this replica sees the response start.
            if let Some(seq) = charge.announced {
                let (share, pod) = (self.share.clone(), pod.clone());
                guard.on_release(move |how| share.release(&pod, seq, how));
            }
            PendingRecord {
                pod,
                prefill: p.plan.prefill_pod().cloned(),
                keys,
                now_ms: p.now_ms,
                charge,
                id,
                unrecorded: self.state.unrecorded().clone(),
            }
        });
        let decision = Decision {
            id: self.next_id(),
            plan: p.plan,
            model: p.model,
            guard: Some(guard),
            prefill_guard,
        };
        (decision, pending)
    }

    /// What [`Decider::plan`] would hand to [`plan`] now (moves no round-robin turn, records
    /// nothing): the live half of the check that the simulator builds the same input.
    pub async fn plan_input(&self, req: DecideRequest<'_>) -> Result<PlanInputs, DecideError> {
        let g = self.gather(req).await?;
        Ok(self.state.input(&g.input, g.now_ms))
    }

    /// Parses, looks up and plans; with `commit`, the plan joins the unrecorded decisions in
    /// the same step that overlaid them, so concurrent decisions see each other.
    async fn prepare(&self, req: DecideRequest<'_>, commit: bool) -> Result<Prepared, DecideError> {
        let g = self.gather(req).await?;
        Ok(self.plan_gathered(g, commit))
    }

    /// Plans what [`Self::gather`] found.
    fn plan_gathered(&self, g: Gathered, commit: bool) -> Prepared {
        let planned = self
            .state
            .plan(&self.stages, &g.input, g.now_ms, commit, &mut rand::rng());
        let plan = planned.plan;
        log_decision(&plan);
        for e in &plan.scorer_errors {
            debug!(error = %e, "scorer failed; its scores count as 0");
            self.metrics.errors.inc(ErrorKind::Scorer);
        }
        Prepared {
            plan,
            adapter: g.input.request.adapter.is_some(),
            model: g.model,
            pods: g.pods,
            now: g.now,
            now_ms: g.now_ms,
            unrecorded: planned.unrecorded,
        }
    }

    /// Whether `pod` may take prefills at `now`; an exclusion is counted and logged once.
    fn prefill_usable(&self, pod: &Pod, now: Instant) -> bool {
        match pod.prefill_verdict(now, self.pd_unserved_after) {
            PrefillVerdict::Available => true,
            PrefillVerdict::Excluded => false,
            PrefillVerdict::NewlyExcluded => {
                warn!(
                    pod = %pod.id(),
                    "prefill pod excluded from prefill picks: the prefills sent it do not show in \
                     its prefix-cache lookups"
                );
                self.metrics.count_prefill_exclusion(pod.id());
                false
            }
        }
    }

    /// Everything a decision reads before it plans: the parsed request, its keys and session,
    /// the candidate pods with their load, model and index matches.
    async fn gather(&self, req: DecideRequest<'_>) -> Result<Gathered, DecideError> {
        let (parsed, keys) = self.parse_and_key(&req).await;
        let parsed: Option<RoutingRequest> = match parsed {
            None => None,
            Some(Ok(r)) => Some(r),
            Some(Err(e)) if self.strict => return Err(DecideError::BadRequest(e)),
            Some(Err(e)) => {
                debug!(kind = e.kind(), "unparsable body; routing by load");
                self.metrics.errors.inc(ErrorKind::Unparsable);
                None
            }
        };
        let model = parsed.as_ref().and_then(|r| r.model.clone());
        let mut pods = self.candidates(req.subset, model.as_deref())?;
        let keys = keys.unwrap_or_default();
        if let Some(kind) = keys.tokenize_error {
            debug!(kind, "tokenization failed; approximate keys");
            self.metrics.errors.inc(ErrorKind::Tokenize);
        }
        let mut session = SessionKey::find(
            |name| req.header(name),
            &self.session,
            parsed.as_ref().map_or(BodyIds::default(), |r| BodyIds {
                prompt_cache_key: r.prompt_cache_key.as_deref(),
                user: r.user.as_deref(),
            }),
        );
        // A stored response is continued only on the pod that holds it: that pod, when known
        // and a candidate, is the only candidate.
        let chain = parsed
            .as_ref()
            .and_then(|r| r.previous_response_id.as_deref());
        if let Some(id) = chain {
            let held = self.state.sessions().chained(id, self.now_ms()).await;
            if let Some((key, pod)) = held.filter(|(_, pod)| pods.iter().any(|p| p.id() == pod)) {
                pods.retain(|p| *p.id() == pod);
                session = Some(key);
            }
        }
        let body = match (&parsed, req.body) {
            (Some(_), _) => Body::Parsed,
            (None, None) => Body::Missing,
            (None, Some(_)) => Body::Unparsable,
        };
        let ids: Vec<PodId> = pods.iter().map(|p| p.id().clone()).collect();
        let now_ms = self.now_ms();
        let mut now = Instant::now();
        let mut adapter = None;
        let read = || {
            // Loads the other replicas sent that have arrived count before this decision reads
            // load.
            self.share.catch_up();
            now = Instant::now();
            self.readings(&pods, model.as_deref(), now, &mut adapter)
        };
        let request = RequestFacts {
            keys,
            body,
            session,
            adapter: None,
        };
        let (mut input, error) = self
            .state
            .gather(Some(&*self.index), &self.stages, request, ids, now_ms, read)
            .await;
        if let Some(e) = error {
            debug!(error = %e, "index lookup failed; scoring without it");
            self.metrics.errors.inc(ErrorKind::Index);
        }
        input.request.adapter = adapter;
        Ok(Gathered {
            input,
            model,
            pods,
            now,
            now_ms,
        })
    }

    /// Each candidate's readings at `now`; `adapter` is set to `model` when it names an adapter
    /// (the readings then carry each pod's fit for it).
    fn readings(
        &self,
        pods: &[Arc<Pod>],
        model: Option<&str>,
        now: Instant,
        adapter: &mut Option<String>,
    ) -> Vec<PodReading> {
        let adapters = self.stages.lora_adapters();
        let fits = crate::pods::lora_fits(model, pods, adapters, now, self.stale_after);
        if fits.is_some() {
            *adapter = model.map(str::to_string);
        }
        let roles: Vec<PodRole> = pods.iter().map(|p| p.role()).collect();
        let disaggregated = split_roles(&roles).is_some();
        pods.iter()
            .zip(roles)
            .enumerate()
            .map(|(i, (p, role))| PodReading {
                load: p.load(now, self.stale_after),
                ttft: p.ttft_learner(),
                role,
                prefill_excluded: disaggregated
                    && role == PodRole::Prefill
                    && !self.prefill_usable(p, now),
                lora: fits.as_ref().map(|f| f[i]),
            })
            .collect()
    }

    /// Parses the body and computes its keys. Bodies of [`OFFLOAD_BYTES`] or more
    /// ([`OFFLOAD_BYTES_TOKENIZED`] with tokenizers) are parsed and keyed (tokenized, in precise
    /// mode) on the blocking pool, at most one per core at a time, so a huge prompt never stalls
    /// the async workers (probes, other streams, health).
    async fn parse_and_key<'b>(&self, req: &DecideRequest<'b>) -> (Parsed<'b>, Option<Keys>) {
        let Some(body) = req.body else {
            return (None, None);
        };
        let work = parse_and_keys;
        if body.len() < self.offload_bytes {
            return work(&self.keyer, req.path, body);
        }
        let Ok(permit) = self.heavy.clone().acquire_owned().await else {
            return work(&self.keyer, req.path, body);
        };
        let flavor = tokio::runtime::Handle::current().runtime_flavor();
        if flavor == tokio::runtime::RuntimeFlavor::MultiThread {
            // The worker hands its other tasks to a new one and parses the borrowed body in
            // place: no copy of a body that can be most of `max_body_bytes`.
            let run = std::panic::AssertUnwindSafe(|| work(&self.keyer, req.path, body));
            let out = tokio::task::block_in_place(|| std::panic::catch_unwind(run));
            drop(permit);
            return out.unwrap_or_else(|_| {
                // A panic while parsing hostile input: treat the body as unparsable.
                tracing::error!("request parsing panicked");
                (None, None)
            });
        }
        let (keyer, path, body) = (self.keyer.clone(), req.path.to_string(), body.to_vec());
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let (parsed, keys) = work(&keyer, &path, &body);
            (parsed.map(|p| p.map(RoutingRequest::into_owned)), keys)
        })
        .await
        .unwrap_or_else(|e| {
            tracing::error!(error = %e, "request parsing panicked");
            (None, None)
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
        // An adapter goes to the pods that list it, else to those serving its base model.
        let pods = crate::pods::serving(in_subset, model, self.stages.lora_adapters());
        if pods.is_empty() {
            return Err(DecideError::ModelNotFound(model.unwrap_or_default().into()));
        }
        Ok(pods)
    }
}

/// A body's parse: `None` without a body; the request may borrow the body's prompt.
type Parsed<'b> = Option<Result<RoutingRequest<'b>, RequestError>>;

/// Parses a body and computes its keys (straight from the borrowed prompt text where the
/// canonical form is the body's own string).
fn parse_and_keys<'b>(keyer: &Keyer, path: &str, body: &'b [u8]) -> (Parsed<'b>, Option<Keys>) {
    let parsed = request::parse(path, body);
    let keys = parsed.as_ref().ok().map(|r| keyer.keys(r));
    (Some(parsed), keys)
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
mod chain_tests;
#[cfg(test)]
pub(crate) mod tests;
