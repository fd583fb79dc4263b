//! The one way into [`plan`](super::disagg::plan): [`DecisionState::gather`] turns what a caller
//! read (the request, each candidate pod's own readings) into a [`DecisionInput`] (index
//! matches, the session's pod, prefill models), and [`DecisionState::plan`] builds the plan's
//! input from it and the state consecutive decisions share (decisions answered but not yet
//! recorded, recent conversations, pinned sessions, the round-robin turn), plans, and commits.
//! The live [`Decider`](super::Decider) and `kv-bench simulate` both go through it; the one way
//! they differ on purpose is [`Recording`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rand::Rng;

use super::disagg::{plan, split_roles, PlanInputs};
use super::plan::{commit, Body, Committed, Plan, PlanInput, Stages, Stores};
use super::unrecorded::{Held, Unrecorded};
use crate::blocks::BlockKey;
use crate::config::GateConfig;
use crate::conversation::{Conversations, SessionSeen, PROMPT_ENDS};
use crate::index::{IndexError, KvIndex};
use crate::keys::Keys;
use crate::pods::{fleet_models, LoraFit, PodId, PodLoad, PodRole, TtftLearner, TtftModel};
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

/// One candidate pod's own readings at decision time: what the live router reads from its
/// `Pod`, and the simulator from its view of a simulated pod ([`DecisionState::gather`]'s seam).
#[derive(Debug, Clone)]
pub struct PodReading {
    /// Its load now (last scrape and this router's in-flight charges).
    pub load: PodLoad,
    /// Its prefill learner (fitted against the fleet's).
    pub ttft: TtftLearner,
    /// Its P/D role.
    pub role: PodRole,
    /// A prefill pod excluded from prefill picks (its prefills never showed in its counters).
    pub prefill_excluded: bool,
    /// How it would take the request's adapter (`None`: a base-model request).
    pub lora: Option<LoraFit>,
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
    /// Its P/D role: a model with `prefill` pods and others is disaggregated.
    pub role: PodRole,
    /// A prefill pod left out of prefill picks.
    pub prefill_excluded: bool,
    /// How it would take the request's adapter (`None`: a base-model request).
    pub lora: Option<LoraFit>,
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
    /// The LoRA adapter it names (`None`: a base-model request).
    pub adapter: Option<String>,
}

/// Everything a decision is planned from: the request, where its session went, and each
/// candidate pod's facts (load, prefill model, index match, role, adapter fit).
#[derive(Debug, Clone)]
pub struct DecisionInput {
    /// The request.
    pub request: RequestFacts,
    /// Where the session store says the session's last request went.
    pub session_pod: Option<PodId>,
    /// The candidates, in the caller's order (the plan's `primary` indexes them).
    pub pods: Vec<PodFacts>,
}

impl DecisionInput {
    /// (decode, prefill) positions of a P/D model ([`split_roles`]; prefill pods excluded from
    /// prefill picks left out), `None` for an aggregated one.
    pub fn roles(&self) -> Option<(Vec<usize>, Vec<usize>)> {
        let roles: Vec<PodRole> = self.pods.iter().map(|p| p.role).collect();
        let (decode, mut prefill) = split_roles(&roles)?;
        prefill.retain(|&i| !self.pods[i].prefill_excluded);
        Some((decode, prefill))
    }
}

/// A planned decision; with [`Recording::AfterReply`] and `commit`, its entry in the unrecorded
/// set and the keys its record must write.
pub struct Planned {
    /// The ranked decision (`primary` indexes [`DecisionInput::pods`]).
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
    /// Fresh state over a session store (local, or backed by the shared index); `gate` sets how
    /// fast new conversations' placements fade.
    pub fn new(gate: &GateConfig, sessions: Arc<SessionStore>, recording: Recording) -> Self {
        Self {
            conversations: Arc::new(Conversations::new(PROMPT_ENDS, gate.spread_half_life_ms)),
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

    /// Gathers a decision's input: the index's matches for the candidates `ids` (none without an
    /// index or keys), the session's pod, then `read()` (each candidate's readings, in `ids`
    /// order, read after the lookups so its loads are the newest) with the prefill models
    /// fitted over them. A failed lookup scores without matches and is returned.
    pub async fn gather(
        &self,
        index: Option<&dyn KvIndex>,
        stages: &Stages,
        request: RequestFacts,
        ids: Vec<PodId>,
        now_ms: u64,
        read: impl FnOnce() -> Vec<PodReading>,
    ) -> (DecisionInput, Option<IndexError>) {
        let (matched, error) = match index {
            Some(index) if !request.keys.keys.is_empty() => {
                match index.lookup(&request.keys.keys, &ids, now_ms).await {
                    Ok(m) => (m, None),
                    Err(e) => (vec![0.0; ids.len()], Some(e)),
                }
            }
            _ => (vec![0.0; ids.len()], None),
        };
        let session_pod = match request.session {
            Some(s) => self.sessions.find(s, now_ms).await,
            None => None,
        };
        let readings = read();
        let learners: Vec<TtftLearner> = readings.iter().map(|r| r.ttft).collect();
        let models = fleet_models(&learners, stages.ttft_prior());
        let pods = ids
            .into_iter()
            .zip(readings)
            .zip(models.into_iter().zip(matched))
            .map(|((id, r), (model, matched_blocks))| PodFacts {
                id,
                load: r.load,
                model,
                matched_blocks,
                role: r.role,
                prefill_excluded: r.prefill_excluded,
                lora: r.lora,
            })
            .collect();
        let input = DecisionInput {
            request,
            session_pod,
            pods,
        };
        (input, error)
    }

    /// The plan's input for `input` now: each pod's matched blocks with the unrecorded decisions
    /// overlaid, whether the request starts a new conversation, and each candidate's
    /// commitments, load, model and session flag. Its round-robin turn is the one the next
    /// committed decision takes; reading it moves nothing.
    pub fn input(&self, input: &DecisionInput, now_ms: u64) -> PlanInputs {
        let mut held = self.unrecorded.hold();
        let turn = self.turns.load(Ordering::Relaxed);
        self.inputs_at(&mut held, input, now_ms, turn)
    }

    fn inputs_at(
        &self,
        held: &mut Held<'_>,
        input: &DecisionInput,
        now_ms: u64,
        turn: u64,
    ) -> PlanInputs {
        match input.roles() {
            None => {
                let all: Vec<usize> = (0..input.pods.len()).collect();
                let mut decode = self.set_input(held, input, &all, true, now_ms, turn);
                decode.lora = input
                    .request
                    .adapter
                    .as_ref()
                    .map(|_| input.pods.iter().map(lora_fit).collect());
                PlanInputs {
                    decode,
                    prefill: None,
                }
            }
            Some((decode, prefill)) => {
                let decode = self.set_input(held, input, &decode, true, now_ms, turn);
                // The session pins the decode pod; prefill pods are chosen by cache and load.
                let mut prefill = self.set_input(held, input, &prefill, false, now_ms, turn);
                // Spreading new conversations is about where they decode; a prefill follows the
                // cache.
                (prefill.new_conversation, prefill.shares_prefix) = (false, false);
                PlanInputs {
                    decode,
                    prefill: Some(prefill),
                }
            }
        }
    }

    /// The plan input over the pods at positions `at`; `session`: the request's session counts.
    fn set_input(
        &self,
        held: &mut Held<'_>,
        input: &DecisionInput,
        at: &[usize],
        session: bool,
        now_ms: u64,
        turn: u64,
    ) -> PlanInput {
        let req = &input.request;
        let (session, session_pod) = match session {
            true => (req.session, input.session_pod.as_ref()),
            false => (None, None),
        };
        let pods: Vec<&PodFacts> = at.iter().map(|&i| &input.pods[i]).collect();
        let ids: Vec<PodId> = pods.iter().map(|p| p.id.clone()).collect();
        let mut matched: Vec<f64> = pods.iter().map(|p| p.matched_blocks).collect();
        held.overlay(&req.keys.keys, &ids, &mut matched);
        let seen = match (&session, session_pod) {
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
                session_pod: session_pod == Some(&p.id),
                conversations,
                model: p.model,
            })
            .collect();
        PlanInput {
            keys: req.keys.clone(),
            body: req.body,
            candidates,
            session,
            turn,
            new_conversation,
            shares_prefix,
            lora: None,
        }
    }

    /// The round-robin turn of a decision; a committed one moves it on.
    fn turn(&self, commit: bool) -> u64 {
        if commit {
            self.turns.fetch_add(1, Ordering::Relaxed)
        } else {
            self.turns.load(Ordering::Relaxed)
        }
    }

    /// Plans a decision: base-model, adapter and P/D requests alike. Builds the input and plans
    /// it; a decision to `commit` takes the round-robin turn and joins the unrecorded set
    /// ([`Recording::AfterReply`]) in the same held step that overlaid it, so two decisions never
    /// miss each other however close together they run. Time and randomness come in.
    pub fn plan(
        &self,
        stages: &Stages,
        input: &DecisionInput,
        now_ms: u64,
        commit: bool,
        rng: &mut impl Rng,
    ) -> Planned {
        let mut held = self.unrecorded.hold();
        let keys = &input.request.keys.keys;
        let deferred = commit && self.recording == Recording::AfterReply;
        let keys: Option<Arc<[BlockKey]>> =
            (deferred && !keys.is_empty()).then(|| keys.as_slice().into());
        // Only a decision that will be committed takes a turn: a rank-only Pick or an explain
        // must not shift where the next request lands.
        let turn = self.turn(commit);
        let inputs = self.inputs_at(&mut held, input, now_ms, turn);
        let mut plan = plan(stages, inputs, rng);
        if let Some((decode, _)) = input.roles() {
            plan.primary = decode[plan.primary];
        }
        // Without keys to record the set is released here, unchanged. Only the primary joins
        // it; a prefill pod's record follows the reply.
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

/// A pod's fit for the request's adapter; a pod without one counts as unreported.
fn lora_fit(p: &PodFacts) -> LoraFit {
    p.lora.unwrap_or(LoraFit::Unreported)
}

#[cfg(test)]
mod lora_tests {
    use std::time::Duration;

    use rand::rngs::StdRng;
    use rand::SeedableRng;
    use tokio::time::Instant;

    use super::*;
    use crate::config::DisaggConfig;
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
        let stages = Stages::defaults(&DisaggConfig::default());
        let sessions = Arc::new(SessionStore::new(100, 10_000));
        let state = DecisionState::new(&GateConfig::default(), sessions, Recording::InCommit);
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
            let fits = fits.expect("an adapter request");
            let facts: Vec<PodFacts> = cands
                .iter()
                .zip(fits)
                .map(|(p, fit)| PodFacts {
                    id: p.id().clone(),
                    load: PodLoad {
                        fresh: true,
                        ..PodLoad::default()
                    },
                    model: TtftModel::default(),
                    matched_blocks: 0.0,
                    role: PodRole::Both,
                    prefill_excluded: false,
                    lora: Some(fit),
                })
                .collect();
            let input = DecisionInput {
                request: RequestFacts {
                    keys: Keys::default(),
                    body: Body::Parsed,
                    session: None,
                    adapter: Some("sql".into()),
                },
                session_pod: None,
                pods: facts,
            };
            let mut rng = StdRng::seed_from_u64(seed);
            let p = state.plan(&stages, &input, 0, false, &mut rng);
            assert_eq!(p.plan.ranked[0].pod, PodId::new("10.0.0.2:8000"));
        }
    }
}
