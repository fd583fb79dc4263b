//! The router in virtual time: the pods as it sees them (the last scrape and its own in-flight
//! settling queue: the live router's `Settling`, on virtual microseconds), and its decisions,
//! built, planned and committed by the live router's own [`DecisionState`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use kv_router::config::Config;
#[cfg(test)]
use kv_router::decide::PlanInputs;
use kv_router::decide::{
    log_decision, Body, DecisionInput, DecisionState, Plan, PodReading, Recording, RequestFacts,
    Stages,
};
use kv_router::index::KvIndex;
use kv_router::keys::Keys;
use kv_router::pods::{
    fleet_models, predicted_hit_tokens, prefill_time, HitAccuracy, LoadSample, LoraFit,
    LoraResidency, PodId, PodLoad, PodRole, PrefixCounters, Settling, Timestamp, TtftLearner,
};
use kv_router::scoring::{SessionKey, SessionStore};
use rand::Rng;
use vllm_sim::engine::Engine;

/// Runs an in-memory index call: those backends never wait, so the future is ready at once.
pub(super) fn ready<T>(f: impl std::future::Future<Output = T>) -> T {
    futures::FutureExt::now_or_never(f)
        .expect("in-memory index operations complete without waiting")
}

/// Virtual time in microseconds, as the router's in-flight accounting sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct SimTime(pub(super) u64);

impl Timestamp for SimTime {
    fn since(self, earlier: Self) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }

    fn after(self, d: Duration) -> Self {
        SimTime(self.0 + d.as_micros() as u64)
    }
}

/// A pod as the router sees it: last scrape plus its own in-flight accounting (`pods/inflight.rs`
/// behind Envoy 1.40, which ends a request's ext_proc stream when the response ends: a routed
/// request counts until the engine finishes it, its uncached tokens for their estimated prefill).
#[derive(Debug, Default)]
pub(super) struct PodView {
    pub(super) sample: Option<(SimTime, LoadSample)>,
    /// This router's requests on the pod that have not finished (their streams are open).
    pub(super) live: u64,
    /// Other replicas' requests (counted until a later scrape) and the tokens counted for their
    /// predicted prefill.
    pub(super) settling: Settling<SimTime>,
    /// Tokens counted until their request's first token (`TokenRelease`).
    pub(super) prefilling: u64,
    /// The prefill model learned from the engine's timing counters, as `Pod` learns it.
    pub(super) ttft: TtftLearner,
    /// Predicted against reported prefix-cache hits, as `Pod` keeps them.
    pub(super) accuracy: HitAccuracy,
    /// The engine's last adapter residency report (`vllm:lora_requests_info`), when LoRA is on.
    pub(super) lora: Option<(SimTime, LoraResidency)>,
    /// Adapters used most recently, newest first: seen busy in a scrape, or routed here (as
    /// `Pod` keeps them).
    pub(super) recent: VecDeque<String>,
}

impl PodView {
    /// `Pod::load` at `now`.
    pub(super) fn load(&mut self, now: SimTime, stale_after: Duration) -> PodLoad {
        let (requests, tokens) = self.settling.count(now, stale_after);
        PodLoad::at(
            now,
            self.sample,
            (requests + self.live, tokens + self.prefilling),
            stale_after,
        )
    }

    /// A scrape sent at `now` succeeded (`Pod::record_sample`).
    pub(super) fn scrape(&mut self, now: SimTime, e: &Engine) {
        let s = e.stats();
        self.sample = Some((
            now,
            LoadSample {
                waiting: s.waiting as f64,
                running: s.running as f64,
                kv_usage: s.kv_cache_usage,
                timing: Some(s.timing()),
                sent_here: self.live as f64,
                ..LoadSample::default()
            },
        ));
        self.settling.observed_scrape(now);
        self.ttft.observe(s.timing(), s.waiting + s.running == 0);
        self.accuracy.observe(Some(PrefixCounters {
            queries: s.prefix_cache_queries as f64,
            hits: s.prefix_cache_hits as f64,
        }));
        let Some(info) = e.lora_info() else {
            return;
        };
        // The newest label set is the engine's state (a later one wins a tie).
        let mut newest: Option<&vllm_sim::engine::LoraSeries> = None;
        for x in &info.series {
            if newest.is_none_or(|b| x.at_us >= b.at_us) {
                newest = Some(x);
            }
        }
        let names = |list: &str| {
            list.split(',')
                .filter(|a| !a.is_empty())
                .map(str::to_string)
                .collect()
        };
        let residency = LoraResidency {
            max_lora: u32::try_from(info.max_loras).ok(),
            running: newest.map(|n| names(&n.running)).unwrap_or_default(),
            waiting: newest.map(|n| names(&n.waiting)).unwrap_or_default(),
            at: now.0 as f64 / 1e6,
        };
        for a in residency.waiting.iter().chain(&residency.running) {
            self.used(a);
        }
        self.lora = Some((now, residency));
    }

    /// How the pod would take a request for `adapter` at `now` (`Pod::lora_fit`).
    pub(super) fn lora_fit(&self, adapter: &str, now: SimTime, stale_after: Duration) -> LoraFit {
        match &self.lora {
            Some((at, r)) if now.since(*at) <= stale_after => r.fit_with(adapter, &self.recent),
            _ => LoraFit::Unreported,
        }
    }

    /// `adapter` was just used on the pod: first in `recent`, as on a live pod.
    pub(super) fn used(&mut self, adapter: &str) {
        kv_router::pods::mark_adapter_used(&mut self.recent, adapter);
    }

    /// A request was routed here at `now` with `tokens` estimated uncached prompt tokens,
    /// counted until its first token when `until_first_token` (the live guard), else for their
    /// predicted prefill.
    pub(super) fn routed(
        &mut self,
        now: SimTime,
        tokens: u64,
        prefill_tokens_per_sec: f64,
        until_first_token: bool,
    ) {
        self.live += 1;
        if until_first_token {
            self.prefilling += tokens;
        } else {
            let until = now.after(prefill_time(tokens, prefill_tokens_per_sec));
            self.settling.push_tokens(tokens, until);
        }
    }

    /// `tokens` counted until a first token: it came.
    pub(super) fn first_token(&mut self, tokens: u64) {
        self.prefilling = self.prefilling.saturating_sub(tokens);
    }

    /// A request this router routed here finished: Envoy resets its stream, the guard goes.
    pub(super) fn finished(&mut self) {
        self.live = self.live.saturating_sub(1);
    }
}

/// One simulated kv-router: the live router's decision state, stages and index over pods seen
/// through [`PodView`]s. Its decisions go through the same input builder as the live
/// `Decider` ([`DecisionState`]); they differ only in [`Recording::InCommit`].
pub(super) struct SimRouter {
    pub(super) stages: Stages,
    pub(super) state: DecisionState,
    /// `None` for policies that ignore it (round robin, random).
    pub(super) index: Option<Arc<dyn KvIndex>>,
    pub(super) ids: Vec<PodId>,
    pub(super) views: Vec<PodView>,
    /// Each pod's P/D role (all `Both`: an aggregated fleet).
    roles: Vec<PodRole>,
    stale_after: Duration,
    /// Each pod's configured index capacity, and the capacity last set (0: forgotten).
    capacity: Option<usize>,
    applied: Vec<usize>,
    /// KV events feed the index (a restart arrives as `AllBlocksCleared`).
    precise: bool,
    /// Its own requests' tokens count until their first token (the live guard).
    pub(super) own_until_first_token: bool,
    /// What the last decision charged: (pod, tokens) per pod.
    pub(super) charged: Vec<(usize, u64)>,
}

impl SimRouter {
    /// A router with `cfg`'s stages and session store over the pods `ids`.
    pub(super) fn new(cfg: &Config, index: Option<Arc<dyn KvIndex>>, ids: Vec<PodId>) -> Self {
        let sessions = SessionStore::new(cfg.scorers.session.capacity, cfg.scorers.session.ttl_ms);
        Self {
            stages: Stages::new(cfg.decision()),
            state: DecisionState::new(&cfg.gate, Arc::new(sessions), Recording::InCommit),
            index,
            views: ids.iter().map(|_| PodView::default()).collect(),
            roles: vec![PodRole::Both; ids.len()],
            applied: vec![0; ids.len()],
            ids,
            stale_after: Duration::from_millis(cfg.pods.stale_after_ms),
            capacity: None,
            precise: cfg.kv_events.enabled,
            own_until_first_token: false,
            charged: Vec::new(),
        }
    }

    /// Each pod's index capacity as configured (set again after a restart forgets the pod).
    pub(super) fn with_capacity(mut self, blocks: usize) -> Self {
        self.capacity = Some(blocks);
        self.applied.fill(blocks);
        self
    }

    /// The pods' P/D roles, in `ids` order.
    pub(super) fn with_roles(mut self, roles: Vec<PodRole>) -> Self {
        debug_assert_eq!(roles.len(), self.ids.len());
        self.roles = roles;
        self
    }

    /// The live maintenance loop's restart handling: a pod whose prefix-cache counters went
    /// backwards restarted empty, so the approximate index forgets it and sets its capacity again.
    pub(super) fn forget_restarted(&mut self) {
        let (Some(index), Some(base)) = (&self.index, self.capacity) else {
            return;
        };
        for ((v, id), applied) in self.views.iter_mut().zip(&self.ids).zip(&mut self.applied) {
            if v.accuracy.take_restart() && !self.precise {
                ready(index.forget_pod(id)).expect("in-memory index");
                // Forgetting drops the pod's capacity too.
                *applied = 0;
            }
            if *applied != base {
                ready(index.set_capacity(id, base)).expect("in-memory index");
                *applied = base;
            }
        }
    }

    /// What the router knows of a request arriving at `t` (µs), gathered as the live router
    /// gathers it: the index's matches, its session's pod, each pod's readings (role, and fit
    /// for the request's adapter). Every pod serves the model and may load any adapter; no
    /// prefill pod is ever excluded.
    fn gather(
        &mut self,
        t: u64,
        keys: Keys,
        session: Option<SessionKey>,
        adapter: Option<&str>,
    ) -> DecisionInput {
        let request = RequestFacts {
            keys,
            body: Body::Parsed,
            session,
            adapter: adapter.map(str::to_string),
        };
        let (views, stale_after) = (&mut self.views, self.stale_after);
        let roles = &self.roles;
        let read = || {
            views
                .iter_mut()
                .zip(roles)
                .map(|(v, &role)| PodReading {
                    load: v.load(SimTime(t), stale_after),
                    ttft: v.ttft,
                    role,
                    prefill_excluded: false,
                    lora: adapter.map(|a| v.lora_fit(a, SimTime(t), stale_after)),
                })
                .collect()
        };
        let gathered = self.state.gather(
            self.index.as_deref(),
            &self.stages,
            request,
            self.ids.clone(),
            t / 1000,
            read,
        );
        // In-memory indexes answer at once and never fail a lookup.
        ready(gathered).0
    }

    /// The input a decision at `t` hands to `plan` (takes no round-robin turn, records nothing).
    #[cfg(test)]
    pub(super) fn input(
        &mut self,
        t: u64,
        keys: Keys,
        session: Option<SessionKey>,
        adapter: Option<&str>,
    ) -> PlanInputs {
        let input = self.gather(t, keys, session, adapter);
        self.state.input(&input, t / 1000)
    }

    /// Decides and commits a request arriving at `t` (µs) naming `adapter` (`None`: the base
    /// model): index, session, conversations, the primary's in-flight charge, and a
    /// disaggregated prompt's charge on its prefill pod (until [`PodView::finished`]).
    pub(super) fn decide(
        &mut self,
        t: u64,
        keys: Keys,
        session: Option<SessionKey>,
        adapter: Option<&str>,
        rng: &mut impl Rng,
    ) -> Plan {
        let now_ms = t / 1000;
        let (per_block, prompt) = (keys.tokens_per_block, keys.prompt_tokens);
        let input = self.gather(t, keys, session, adapter);
        let plan = self
            .state
            .plan(&self.stages, &input, now_ms, true, rng)
            .plan;
        // The live router's per-decision debug line (`RUST_LOG=kv_router=debug`).
        log_decision(&plan);
        let (views, charged) = (&mut self.views, &mut self.charged);
        let until_first_token = self.own_until_first_token;
        charged.clear();
        ready(
            self.state
                .commit(&plan, self.index.as_deref(), now_ms, |p, tokens, rate| {
                    charged.push((p, tokens));
                    views[p].routed(SimTime(t), tokens, rate, until_first_token)
                }),
        );
        let hits = predicted_hit_tokens(plan.ranked[0].matched_blocks, per_block, prompt);
        views[plan.primary].accuracy.predicted(hits, prompt);
        if let Some(a) = adapter {
            views[plan.primary].used(a);
        }
        if let Some(p) = self.prefill_pod(&plan) {
            let pd = plan
                .pd
                .as_ref()
                .expect("a prefill pod comes with a P/D plan");
            let (tokens, rate) = (pd.prefill_uncached_tokens, pd.prefill_tokens_per_sec);
            self.views[p].routed(SimTime(t), tokens, rate, false);
        }
        plan
    }

    /// The position of a disaggregated plan's prefill pod.
    pub(super) fn prefill_pod(&self, plan: &Plan) -> Option<usize> {
        let id = plan.prefill_pod()?;
        self.ids.iter().position(|p| p == id)
    }

    /// Each pod's prefill speed as the router learned it (tokens/s).
    pub(super) fn learned_tokens_per_sec(&self) -> Vec<f64> {
        let learners: Vec<_> = self.views.iter().map(|v| v.ttft).collect();
        fleet_models(&learners, self.stages.ttft_prior())
            .iter()
            .map(|m| 1.0 / m.sec_per_token)
            .collect()
    }
}
