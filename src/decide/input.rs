//! The one way into [`plan`]: [`DecisionState`] builds a decision's [`PlanInput`] from what the
//! caller gathered (the request's keys and session, each candidate's load and prefill model, the
//! index's matches) and the state consecutive decisions share (decisions answered but not yet
//! recorded, recent conversations, pinned sessions, the round-robin turn); it plans, and
//! commits. The live [`Decider`](super::Decider) and `kv-bench simulate` both go through it; the
//! one way they differ on purpose is [`Recording`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rand::Rng;

use super::conversation::{Conversations, SessionSeen, PROMPT_ENDS};
use super::plan::{commit, plan_with, Body, Committed, Plan, PlanInput, Stages, Stores};
use super::unrecorded::{Held, Unrecorded};
use crate::blocks::BlockKey;
use crate::config::Config;
use crate::index::KvIndex;
use crate::keys::Keys;
use crate::pods::{LoraFit, PodId, PodLoad, TtftModel};
use crate::scoring::{Candidate, SessionKey, SessionStore};

/// When a decision's keys reach the index: the one place the live router and the simulator
/// decide differently, on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recording {
    /// Live: the answer goes first and the index record lands later (`Decider::record`, a
    /// Redis round trip or an LRU move per block). Until it lands the decision stays in the
    /// unrecorded set, which the next decisions overlay on their index lookup.
    AfterReply,
    /// Simulated: [`DecisionState::commit`] records it in the same step (virtual time has no gap
    /// between an answer and its record), so the unrecorded set stays empty.
    InCommit,
}

/// One candidate pod as the caller sees it when it decides.
#[derive(Debug, Clone, PartialEq)]
pub struct PodFacts {
    /// `ip:port`.
    pub id: PodId,
    /// Its load now (last scrape and this router's in-flight charges).
    pub load: PodLoad,
    /// Its prefill coefficients (learned, or the prior).
    pub model: TtftModel,
    /// Consecutive prompt blocks the index says it holds (before the unrecorded overlay).
    pub matched_blocks: f64,
    /// The weight its matches get (1; less for a precise-mode pod whose prefix-cache counters
    /// report far fewer hits than its KV events promise: lost or misconfigured events).
    pub confidence: f64,
}

/// The request as the caller understood it.
#[derive(Debug, Clone)]
pub struct RequestFacts {
    /// Its block keys (empty for body-less and unparsable requests).
    pub keys: Keys,
    /// How its body was understood.
    pub body: Body,
    /// Its session, if it names one.
    pub session: Option<SessionKey>,
    /// Where the session store says the session's last request went.
    pub session_pod: Option<PodId>,
}

/// A planned decision; with [`Recording::AfterReply`] and `commit`, its entry in the unrecorded
/// set and the keys its record must write.
pub struct Planned {
    /// The ranked decision.
    pub plan: Plan,
    /// `(entry, keys)` for the deferred record.
    pub unrecorded: Option<(u64, Arc<[BlockKey]>)>,
}

/// What consecutive decisions of one router share.
pub struct DecisionState {
    conversations: Arc<Conversations>,
    sessions: Arc<SessionStore>,
    unrecorded: Arc<Unrecorded>,
    turns: AtomicU64,
    recording: Recording,
}

impl DecisionState {
    /// Fresh state over a session store (local, or backed by the shared index).
    pub fn new(cfg: &Config, sessions: Arc<SessionStore>, recording: Recording) -> Self {
        Self {
            conversations: Arc::new(Conversations::new(
                PROMPT_ENDS,
                cfg.gate.spread_half_life_ms,
            )),
            sessions,
            unrecorded: Arc::default(),
            turns: AtomicU64::new(0),
            recording,
        }
    }

    /// Where prompts ended and branched, and where new conversations went.
    pub fn conversations(&self) -> &Arc<Conversations> {
        &self.conversations
    }

    /// The session store.
    pub fn sessions(&self) -> &Arc<SessionStore> {
        &self.sessions
    }

    /// Decisions answered but not yet in the index.
    pub fn unrecorded(&self) -> &Arc<Unrecorded> {
        &self.unrecorded
    }

    /// When this router's decisions reach the index.
    pub fn recording(&self) -> Recording {
        self.recording
    }

    /// The plan's input: each pod's matched blocks with the unrecorded decisions overlaid, whether
    /// the request starts a new conversation, and each candidate's commitments, load, model and
    /// session flag. Its round-robin turn is the one the next committed decision takes; reading
    /// it moves nothing.
    pub fn input(
        &self,
        held: &mut Held<'_>,
        req: RequestFacts,
        pods: &[PodFacts],
        now_ms: u64,
    ) -> PlanInput {
        let turn = self.turns.load(Ordering::Relaxed);
        self.input_at(held, req, pods, now_ms, turn)
    }

    pub(super) fn input_at(
        &self,
        held: &mut Held<'_>,
        req: RequestFacts,
        pods: &[PodFacts],
        now_ms: u64,
        turn: u64,
    ) -> PlanInput {
        let ids: Vec<PodId> = pods.iter().map(|p| p.id.clone()).collect();
        let mut matched: Vec<f64> = pods
            .iter()
            .map(|p| p.matched_blocks * p.confidence)
            .collect();
        held.overlay(&req.keys.keys, &ids, &mut matched);
        let seen = match (&req.session, &req.session_pod) {
            (None, _) => SessionSeen::None,
            (Some(_), Some(pod)) if ids.contains(pod) => SessionSeen::Pinned,
            (Some(_), _) => SessionSeen::Unpinned,
        };
        let new_conversation = self.conversations.is_new(&req.keys, &matched, seen);
        let shares_prefix =
            !new_conversation && self.conversations.shares_prefix(&req.keys, &matched, seen);
        let conversations = if new_conversation || shares_prefix {
            let placed = self.conversations.placed(&ids, now_ms);
            let pinned = self.sessions.conversations(&ids, now_ms);
            pinned.iter().zip(placed).map(|(s, p)| s.max(p)).collect()
        } else {
            vec![0.0; ids.len()]
        };
        let candidates = pods
            .iter()
            .zip(matched)
            .zip(conversations)
            .map(|((p, matched_blocks), conversations)| Candidate {
                pod: p.id.clone(),
                matched_blocks,
                load: p.load,
                session_pod: req.session_pod.as_ref() == Some(&p.id),
                conversations,
                model: p.model,
            })
            .collect();
        PlanInput {
            keys: req.keys,
            body: req.body,
            candidates,
            session: req.session,
            turn,
            new_conversation,
            shares_prefix,
        }
    }

    /// The round-robin turn of a decision; a committed one moves it on.
    pub(super) fn turn(&self, commit: bool) -> u64 {
        if commit {
            self.turns.fetch_add(1, Ordering::Relaxed)
        } else {
            self.turns.load(Ordering::Relaxed)
        }
    }

    /// Builds the input and plans it. A decision to `commit` joins the unrecorded set
    /// ([`Recording::AfterReply`]) in the same held step that overlaid it, so two decisions
    /// never miss each other however close together they run.
    pub fn plan(
        &self,
        stages: &Stages,
        req: RequestFacts,
        pods: &[PodFacts],
        now_ms: u64,
        commit: bool,
        rng: &mut impl Rng,
    ) -> Planned {
        self.plan_lora(stages, req, pods, None, now_ms, commit, rng)
    }

    /// [`Self::plan`] with each pod's [`LoraFit`] for the request's adapter, in `pods` order
    /// (`crate::pods::lora_fits`; `None` for base-model requests).
    #[allow(clippy::too_many_arguments)]
    pub fn plan_lora(
        &self,
        stages: &Stages,
        req: RequestFacts,
        pods: &[PodFacts],
        lora: Option<&[LoraFit]>,
        now_ms: u64,
        commit: bool,
        rng: &mut impl Rng,
    ) -> Planned {
        let mut held = self.unrecorded.hold();
        let deferred = commit && self.recording == Recording::AfterReply;
        let keys: Option<Arc<[BlockKey]>> =
            (deferred && !req.keys.keys.is_empty()).then(|| req.keys.keys.as_slice().into());
        // Only a decision that will be committed takes a turn: a rank-only Pick or an explain
        // must not shift where the next request lands.
        let turn = self.turn(commit);
        let input = self.input_at(&mut held, req, pods, now_ms, turn);
        let plan = plan_with(stages, input, lora, rng);
        // Without keys to record the set is released here, unchanged.
        let unrecorded = keys.map(|k| (held.add(plan.ranked[0].pod.clone(), k.clone()), k));
        Planned { plan, unrecorded }
    }

    /// [`Self::commit`] of a decision whose index record follows the reply
    /// ([`Recording::AfterReply`]): nothing to wait for, so the caller can hold the lock its
    /// next decision plans in.
    pub fn commit_now<G>(
        &self,
        plan: &Plan,
        now_ms: u64,
        charge: impl FnOnce(usize, u64, f64) -> G,
    ) -> G {
        debug_assert_eq!(self.recording, Recording::AfterReply);
        super::plan::commit_local(
            plan,
            Some(&self.sessions),
            Some(&self.conversations),
            now_ms,
            charge,
        )
    }

    /// Records `plan` at `now_ms`: conversations, the session's pin, the primary's load charge,
    /// and the index when it is recorded [`Recording::InCommit`] (`index` is `None` for
    /// policies that ignore it).
    pub async fn commit<G>(
        &self,
        plan: &Plan,
        index: Option<&dyn KvIndex>,
        now_ms: u64,
        charge: impl FnOnce(usize, u64, f64) -> G,
    ) -> Committed<G> {
        let stores = Stores {
            index: index.filter(|_| self.recording == Recording::InCommit),
            sessions: Some(&self.sessions),
            conversations: Some(&self.conversations),
        };
        commit(plan, stores, now_ms, charge).await
    }
}

#[cfg(test)]
mod lora_tests {
    use std::time::Duration;

    use rand::rngs::StdRng;
    use rand::SeedableRng;
    use tokio::time::Instant;

    use super::*;
    use crate::pods::{lora_fits, serving, LoraResidency, Pod, PodSpec};

    fn pod(addr: &str, running: &str, listed: &[&str]) -> Arc<Pod> {
        let p = Pod::new(PodSpec {
            id: PodId::new(addr),
            addr: addr.parse().unwrap(),
            models: vec![],
            labels: Default::default(),
            kv_events_endpoint: None,
            kv_events_replay_endpoint: None,
        });
        let mut models = vec!["base".to_string()];
        models.extend(listed.iter().map(|s| s.to_string()));
        p.set_learned_models(Instant::now(), models);
        p.set_learned_adapters(
            listed
                .iter()
                .map(|a| (a.to_string(), "base".to_string()))
                .collect(),
        );
        p.record_lora(
            Instant::now(),
            Some(LoraResidency {
                max_lora: Some(1),
                running: [running.to_string()].into(),
                ..LoraResidency::default()
            }),
        );
        Arc::new(p)
    }

    // The live path's steps in order (docs/lora.md, Wiring): filter, fits, plan.
    #[test]
    fn an_adapter_request_is_planned_onto_the_pod_running_it() {
        let cfg = Config::default();
        let stages = Stages::new(&cfg);
        let sessions = Arc::new(SessionStore::new(100, 10_000));
        let state = DecisionState::new(&cfg, sessions, Recording::InCommit);
        let pods = [
            pod("10.0.0.1:8000", "chat", &["sql", "chat"]),
            pod("10.0.0.2:8000", "sql", &["sql", "chat"]),
            pod("10.0.0.3:8000", "", &[]),
        ];
        let now = Instant::now();
        let stale = Duration::from_secs(2);
        for seed in 0..8 {
            let cands = serving(pods.iter().collect(), Some("sql"), stages.lora_adapters());
            assert_eq!(cands.len(), 2, "the pod not listing the adapter is out");
            let fits = lora_fits(Some("sql"), &cands, stages.lora_adapters(), now, stale);
            let facts: Vec<PodFacts> = cands
                .iter()
                .map(|p| PodFacts {
                    id: p.id().clone(),
                    load: PodLoad {
                        fresh: true,
                        ..PodLoad::default()
                    },
                    model: TtftModel::default(),
                    matched_blocks: 0.0,
                    confidence: 1.0,
                })
                .collect();
            let req = RequestFacts {
                keys: Keys::default(),
                body: Body::Parsed,
                session: None,
                session_pod: None,
            };
            let mut rng = StdRng::seed_from_u64(seed);
            let p = state.plan_lora(&stages, req, &facts, fits.as_deref(), 0, false, &mut rng);
            assert_eq!(p.plan.ranked[0].pod, PodId::new("10.0.0.2:8000"));
        }
    }

    // A precise-mode pod whose counters report a quarter of the hits its events promise keeps a
    // quarter of its match in the plan; the unrecorded overlay (this router's own) is not scaled.
    #[test]
    fn a_pods_matches_are_weighted_by_its_confidence() {
        let cfg = Config::default();
        let sessions = Arc::new(SessionStore::new(100, 10_000));
        let state = DecisionState::new(&cfg, sessions, Recording::InCommit);
        let facts = |id: &str, matched_blocks: f64, confidence: f64| PodFacts {
            id: PodId::new(id),
            load: PodLoad {
                fresh: true,
                ..PodLoad::default()
            },
            model: TtftModel::default(),
            matched_blocks,
            confidence,
        };
        let pods = [
            facts("10.0.0.1:8000", 20.0, 0.25),
            facts("10.0.0.2:8000", 8.0, 1.0),
        ];
        let req = RequestFacts {
            keys: Keys::default(),
            body: Body::Parsed,
            session: None,
            session_pod: None,
        };
        let mut held = state.unrecorded().hold();
        let input = state.input(&mut held, req, &pods, 0);
        let matched: Vec<f64> = input.candidates.iter().map(|c| c.matched_blocks).collect();
        assert_eq!(matched, vec![5.0, 8.0]);
    }
}
