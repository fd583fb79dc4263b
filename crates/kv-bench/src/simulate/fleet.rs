//! One run: a strategy's router (index, plan, commit) over a fleet of engines, driven by one
//! discrete-event loop over virtual microseconds.
//!
//! Adapter workloads (`adapters`): each request names an adapter, and every engine schedules
//! adapters in `adapter_slots` slots (vllm-sim's LoRA model: a request whose adapter is not
//! resident takes a free slot or evicts the least recently used idle one, paying a load time).
//! Prompts keep their block keys whatever the adapter (the simulated caches do not separate
//! adapters). P/D fleets (`prefill_pods`): a disaggregated request runs a one-token request on
//! its prefill pod; when it ends, the decode pod imports the prompt's blocks (the KV transfer,
//! which takes no time here) and runs the request, its cache hits counting the transferred
//! blocks. Its TTFT runs from arrival to the decode pod's first token.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use kv_router::events::{KvEvent, KvEventBatch};
use kv_router::index::{build_index, index_capacity, ApplyStats};
use kv_router::keys::Keys;
use kv_router::picker::Reason;
use kv_router::pods::{PodId, PodRole};
use kv_testkit::splitmix::SplitMix64;
use vllm_sim::engine::{AdapterName, Engine, EngineConfig, LoraConfig, Output, Submission};
use vllm_sim::translate::{Hashes, Translator};

use super::options::{Replication, SimulateError, SimulateOptions, BLOCK_TOKENS, MODEL};
use super::prepare::Prepared;
use super::replicas::{Replicas, Writes};
use super::router::{ready, SimRouter};
use crate::strategy::Strategy;

/// Whether a strategy's outcome depends on the index at all (round robin and random ignore it,
/// so their runs skip it).
pub(super) fn uses_index(s: Strategy) -> bool {
    !matches!(s, Strategy::RoundRobin | Strategy::Random)
}

/// Adds one batch's counts to a run's totals.
pub(super) fn add_stats(total: &mut ApplyStats, a: &ApplyStats) {
    total.stored += a.stored;
    total.removed += a.removed;
    total.cleared += a.cleared;
    total.unknown_parent += a.unknown_parent;
    total.unknown += a.unknown;
    total.ignored += a.ignored;
    total.overflow += a.overflow;
}

/// Raw per-request outcome of one run.
pub(super) struct RunOutcome {
    pub(super) ttft_us: Vec<u64>,
    pub(super) e2e_us: Vec<u64>,
    pub(super) prompt_tokens: u64,
    pub(super) cached_tokens: u64,
    pub(super) per_pod: Vec<usize>,
    /// Prompt tokens each pod computed (not served from its cache).
    pub(super) prefilled: Vec<u64>,
    pub(super) all_saturated: usize,
    pub(super) makespan_us: u64,
    pub(super) kv_events: Option<ApplyStats>,
    /// Each pod's prefill speed as the router learned it by the end (tokens/s).
    pub(super) learned_tokens_per_sec: Vec<f64>,
    /// The router replicas and their delay.
    pub(super) replication: Replication,
    /// Index records the replicas published.
    pub(super) writes: Writes,
    /// Requests prefilled on a prefill pod (P/D fleets).
    pub(super) disaggregated: usize,
    /// Adapters the engines loaded into a slot.
    pub(super) adapter_loads: u64,
}

/// The fleet side of one run: engines, their event schedule, and what they reported.
pub(super) struct Fleet<'a> {
    pub(super) prep: &'a Prepared,
    pub(super) engines: Vec<Engine>,
    /// Pending engine wake-ups (lazily invalidated: only `scheduled[p]` is current).
    pub(super) heap: BinaryHeap<Reverse<(u64, usize)>>,
    pub(super) scheduled: Vec<Option<u64>>,
    /// KV-event batches on their way to the precise index: (delivery time, pod, batch).
    pub(super) deliveries: VecDeque<(u64, usize, KvEventBatch)>,
    /// Forward cache events (precise strategy only).
    pub(super) publish: bool,
    pub(super) translator: Translator,
    pub(super) delay_us: u64,
    /// Pods below this index lose their `BlockRemoved` events.
    pub(super) lost_removals: usize,
    pub(super) last_arrival_us: u64,
    pub(super) ttft_us: Vec<u64>,
    pub(super) e2e_us: Vec<u64>,
    pub(super) prompt_tokens: u64,
    pub(super) cached_tokens: u64,
    pub(super) prefilled: Vec<u64>,
    pub(super) done: usize,
    pub(super) makespan_us: u64,
    /// Requests finished since the run loop last looked (their router releases them).
    pub(super) finished: Vec<usize>,
    /// Requests whose first token came since the run loop last looked, and when.
    pub(super) started: Vec<(usize, u64)>,
    /// Disaggregated requests whose prefill ended since the run loop last looked, and when.
    pub(super) prefilled_remotely: Vec<(usize, u64)>,
}

impl Fleet<'_> {
    /// After pod `p` was touched at `now`: its outputs, its cache events, its next wake-up.
    pub(super) fn settle(&mut self, p: usize, now: u64) {
        let n = self.prep.at_us.len();
        for out in self.engines[p].step(now) {
            match out {
                // A disaggregated request's prefill (its id past the requests'): its prompt
                // counts as computed here, its timings on the decode pod.
                Output::Finished { id, usage, at } if id as usize >= n => {
                    self.prefilled[p] +=
                        u64::from(usage.prompt_tokens.saturating_sub(usage.cached_tokens));
                    self.prefilled_remotely.push((id as usize - n, at));
                }
                Output::Token { id, .. } if id as usize >= n => {}
                Output::Token { id, index: 0, at } => {
                    let i = id as usize;
                    self.ttft_us[i] = at - self.prep.at_us[i];
                    self.started.push((i, at));
                }
                Output::Token { .. } => {}
                Output::Finished { id, usage, at } => {
                    let i = id as usize;
                    self.e2e_us[i] = at - self.prep.at_us[i];
                    self.prompt_tokens += u64::from(usage.prompt_tokens);
                    self.cached_tokens += u64::from(usage.cached_tokens);
                    self.prefilled[p] +=
                        u64::from(usage.prompt_tokens.saturating_sub(usage.cached_tokens));
                    self.done += 1;
                    self.makespan_us = self.makespan_us.max(at);
                    self.finished.push(i);
                }
            }
        }
        let events = self.engines[p].drain_cache_events();
        // Events after the last decision can no longer matter.
        if self.publish && !events.is_empty() && now < self.last_arrival_us {
            let mut events = self.translator.translate(events);
            if p < self.lost_removals {
                events.retain(|e| !matches!(e, KvEvent::BlockRemoved { .. }));
            }
            let batch = KvEventBatch {
                ts: now as f64 / 1e6,
                events,
                data_parallel_rank: Some(0),
            };
            self.deliveries.push_back((now + self.delay_us, p, batch));
        }
        let next = self.engines[p].next_event_time();
        if next != self.scheduled[p] {
            self.scheduled[p] = next;
            if let Some(t) = next {
                self.heap.push(Reverse((t, p)));
            }
        }
    }

    /// The earliest current wake-up, dropping superseded heap entries.
    pub(super) fn next_wakeup(&mut self) -> Option<(u64, usize)> {
        while let Some(&Reverse((t, p))) = self.heap.peek() {
            if self.scheduled[p] == Some(t) {
                return Some((t, p));
            }
            self.heap.pop();
        }
        None
    }
}

/// Each request's adapter: `adapters` names, drawn from the prompt's first block (a
/// conversation keeps its adapter); none when `adapters` is 0.
fn adapters(prep: &Prepared, adapters: usize, seed: u64) -> Vec<Option<AdapterName>> {
    let names: Vec<AdapterName> = (0..adapters)
        .map(|a| AdapterName::from(format!("adapter-{a}")))
        .collect();
    (0..prep.at_us.len())
        .map(|i| {
            let first = prep.oracle[i].keys.first().map_or(i as u64, |k| k.0);
            let draw = SplitMix64::new(first ^ seed).next_u64();
            names.get((draw % adapters.max(1) as u64) as usize).cloned()
        })
        .collect()
}

/// Request `i` as its pod receives it.
fn submission(prep: &Prepared, i: usize) -> Submission {
    Submission {
        tokens: prep.tokens[i].clone(),
        keys: prep.oracle[i].keys.clone(),
        max_tokens: prep.max_tokens[i],
        vllm: None,
    }
}

/// Simulates `strategy` on `pods` pods over the prepared requests, routed by the replicas `how`
/// describes.
pub(super) fn simulate(
    prep: &Prepared,
    strategy: Strategy,
    pods: usize,
    how: Replication,
    opts: &SimulateOptions,
) -> Result<RunOutcome, SimulateError> {
    simulate_replicas(prep, strategy, pods, how, opts, false)
}

/// [`simulate`]; with `one_index` every replica holds the same index object (no propagation).
pub(super) fn simulate_replicas(
    prep: &Prepared,
    strategy: Strategy,
    pods: usize,
    how: Replication,
    opts: &SimulateOptions,
    one_index: bool,
) -> Result<RunOutcome, SimulateError> {
    let mut cfg = strategy.router_config(&opts.base_config, MODEL);
    cfg.gate.replicate_to_idle = opts.replicate_to_idle;
    let ecfg = EngineConfig {
        block_size: BLOCK_TOKENS,
        ..opts.engine.clone()
    };
    let ids: Vec<PodId> = (0..pods).map(|i| PodId::new(format!("pod-{i}"))).collect();
    // As the router's maintenance loop does from the pods' `cache_config_info`.
    let told = ecfg.num_gpu_blocks as f64 * opts.divergence.capacity_belief;
    let cap = index_capacity(
        &cfg.index,
        &cfg.blocks,
        told.round().max(1.0) as u64,
        BLOCK_TOKENS as u64,
    );
    let new_index = || {
        let index = build_index(&cfg.index, &cfg.kv_events, &cfg.blocks, None)
            .expect("simulated fleets use in-process indexes")
            .index;
        for id in &ids {
            ready(index.set_capacity(id, cap)).expect("in-memory index");
        }
        index
    };
    let shared = (one_index && uses_index(strategy)).then(new_index);
    // The first pods prefill, as `kv-bench compare --pd-prefill` lays a fleet out.
    let prefill_pods = opts.prefill_pods.min(pods.saturating_sub(1));
    let roles: Vec<PodRole> = (0..pods)
        .map(|p| match p < prefill_pods {
            true => PodRole::Prefill,
            false if prefill_pods > 0 => PodRole::Decode,
            false => PodRole::Both,
        })
        .collect();
    let adapter = adapters(prep, opts.adapters, opts.seed);
    let routers = (0..how.replicas.max(1))
        .map(|_| {
            let index = match &shared {
                Some(index) => Some(index.clone()),
                None => uses_index(strategy).then(new_index),
            };
            SimRouter::new(&cfg, index, ids.clone())
                .with_capacity(cap)
                .with_roles(roles.clone())
        })
        .collect();
    let mut router = Replicas::new(
        routers,
        how,
        one_index,
        opts.shared_load,
        opts.shared_conversations,
        opts.token_release,
    );
    // One tie-break stream per seed and fleet, whatever the strategy: two strategies are
    // compared on common random numbers, not on two streams' luck.
    let salt = SplitMix64::derive(opts.seed, "tie-breaks", pods as u64).next_u64();
    let mut rng = SplitMix64::new(salt);
    // Not salted by strategy: every strategy sees the same requests bypass it, to the same pods.
    let mut bypass_rng = SplitMix64::derive(opts.seed, "bypass", pods as u64);
    let restart_us = opts
        .divergence
        .restart_every_s
        .map(|s| ((s * 1e6).round() as u64).max(1));
    let (mut next_restart, mut restarts) = (restart_us.unwrap_or(u64::MAX), 0usize);
    let scrape_us = opts.scrape_interval_ms.max(1) * 1000;
    let sweep_every = (1000 / opts.scrape_interval_ms.max(1)).max(1);
    let max_blocks = cfg.blocks.max_blocks;
    let n = prep.at_us.len();
    let mut fleet = Fleet {
        prep,
        engines: (0..pods)
            .map(|p| {
                let mut e = ecfg.clone();
                if p < opts.slow_pods {
                    e.prefill_us_per_token *= opts.slow_factor;
                }
                let engine = Engine::new(e);
                match opts.adapters {
                    0 => engine,
                    _ => engine.with_lora(LoraConfig {
                        max_loras: opts.adapter_slots.max(1),
                        ..LoraConfig::default()
                    }),
                }
            })
            .collect(),
        heap: BinaryHeap::new(),
        scheduled: vec![None; pods],
        deliveries: VecDeque::new(),
        publish: cfg.kv_events.enabled,
        translator: Translator::new(Hashes::EngineKeys),
        delay_us: (opts.event_delay_ms.max(0.0) * 1e3).round() as u64,
        lost_removals: opts.divergence.lost_removals,
        last_arrival_us: prep.at_us.last().copied().unwrap_or(0),
        ttft_us: vec![u64::MAX; n],
        e2e_us: vec![u64::MAX; n],
        prompt_tokens: 0,
        cached_tokens: 0,
        prefilled: vec![0; pods],
        done: 0,
        makespan_us: 0,
        finished: Vec::new(),
        started: Vec::new(),
        prefilled_remotely: Vec::new(),
    };
    let mut per_pod = vec![0usize; pods];
    let mut all_saturated = 0usize;
    let mut applied = ApplyStats::default();
    let (mut next_req, mut next_tick, mut ticks) = (0usize, 0u64, 0u64);
    // The pod each request was routed to (a bypassed one has none): its router's charge.
    let mut routed_to: Vec<Option<usize>> = vec![None; n];
    // A disaggregated request's prefill pod, until its prefill ends.
    let mut prefill_on: Vec<Option<usize>> = vec![None; n];
    let mut disaggregated = 0usize;

    loop {
        for (i, at) in fleet.started.drain(..) {
            router.first_token(i, at);
        }
        for i in fleet.finished.drain(..) {
            if let Some(p) = routed_to[i] {
                router.finished(i, p);
            }
        }
        let transfers: Vec<(usize, u64)> = fleet.prefilled_remotely.drain(..).collect();
        for (i, at) in transfers {
            if let Some(q) = prefill_on[i].take() {
                router.finished(i, q);
            }
            // The prompt's KV reaches the decode pod, which runs the request from it.
            let p = routed_to[i].expect("a disaggregated request has its decode pod");
            let sub = submission(prep, i);
            fleet.engines[p].import(&sub);
            fleet.engines[p].submit_lora(at, i as u64, sub, adapter[i].clone());
            fleet.settle(p, at);
        }
        let wake = fleet.next_wakeup();
        let t_pod = wake.map(|w| w.0);
        let t_arr = prep.at_us.get(next_req).copied();
        if t_pod.is_none() && t_arr.is_none() {
            break;
        }
        // Router-side events only matter while requests are still to be routed.
        let t_tick = t_arr.map(|_| next_tick);
        let t_del = t_arr.and(fleet.deliveries.front().map(|d| d.0));
        let t_rec = t_arr.and(router.next_due());
        let t_restart = t_arr.and(restart_us).map(|_| next_restart);
        let t = [t_pod, t_rec, t_del, t_tick, t_restart, t_arr]
            .into_iter()
            .flatten()
            .min()
            .expect("something is pending");
        // At equal times: pods first, then other replicas' records, event delivery, scrape, and
        // the new request, so the router sees everything that happened up to and including `t`.
        if let Some((_, p)) = wake.filter(|w| w.0 == t) {
            fleet.heap.pop();
            fleet.scheduled[p] = None;
            fleet.settle(p, t);
            continue;
        }
        if t_rec == Some(t) {
            router.deliver_next();
            continue;
        }
        if t_del == Some(t) {
            let (_, p, batch) = fleet.deliveries.pop_front().expect("peeked");
            if let Some(a) = router.apply_events(p, &batch) {
                add_stats(&mut applied, &a);
            }
            continue;
        }
        if t_tick == Some(t) {
            router.scrape(t, &fleet.engines);
            if ticks % sweep_every == 0 {
                router.forget_restarted();
                router.sweep(t);
            }
            ticks += 1;
            next_tick = t + scrape_us;
            continue;
        }
        if t_restart == Some(t) {
            // A crash: the pod comes back empty, and its clients retry on it.
            let p = restarts % pods;
            restarts += 1;
            next_restart = t + restart_us.expect("scheduled");
            for (id, sub) in fleet.engines[p].restart(t) {
                let a = adapter[id as usize % n].clone();
                fleet.engines[p].submit_lora(t, id, sub, a);
            }
            fleet.settle(p, t);
            continue;
        }
        let i = next_req;
        next_req += 1;
        let oracle = &prep.oracle[i];
        let (bypassed, pod) = (bypass_rng.unit(), bypass_rng.range(0, pods - 1));
        if bypassed < opts.divergence.bypass {
            // Another replica or a direct client: the pod caches it, this router never knows.
            fleet.engines[pod].submit_lora(t, i as u64, submission(prep, i), adapter[i].clone());
            fleet.settle(pod, t);
            continue;
        }
        // An arrival: the router's lookup, plan and commit, then submit. Traces name no
        // sessions: new conversations are told by where prompts branch.
        let keys = Keys {
            keys: oracle.keys[..oracle.keys.len().min(max_blocks)].to_vec(),
            tokens_per_block: BLOCK_TOKENS,
            prompt_tokens: oracle.prompt_tokens,
            precise: cfg.kv_events.enabled,
            tokenize_error: None,
        };
        let plan = router.decide(i, t, keys, adapter[i].as_deref(), &mut rng);
        if plan.reason == Reason::AllSaturated {
            all_saturated += 1;
        }
        let p = plan.primary;
        per_pod[p] += 1;
        routed_to[i] = Some(p);
        let prefill = plan
            .prefill_pod()
            .and_then(|q| ids.iter().position(|id| id == q));
        if let Some(q) = prefill {
            // Prefill only: one token, then the transfer (`prefilled_remotely`).
            disaggregated += 1;
            prefill_on[i] = Some(q);
            let sub = Submission {
                max_tokens: 1,
                ..submission(prep, i)
            };
            fleet.engines[q].submit_lora(t, (n + i) as u64, sub, adapter[i].clone());
            fleet.settle(q, t);
            continue;
        }
        fleet.engines[p].submit_lora(t, i as u64, submission(prep, i), adapter[i].clone());
        fleet.settle(p, t);
    }
    if fleet.done != n {
        return Err(SimulateError::Unfinished {
            strategy: strategy.as_str(),
            pods,
            done: fleet.done,
            submitted: n,
        });
    }
    Ok(RunOutcome {
        ttft_us: fleet.ttft_us,
        e2e_us: fleet.e2e_us,
        prompt_tokens: fleet.prompt_tokens,
        cached_tokens: fleet.cached_tokens,
        per_pod,
        prefilled: fleet.prefilled,
        all_saturated,
        makespan_us: fleet.makespan_us,
        kv_events: fleet.publish.then_some(applied),
        learned_tokens_per_sec: router.routers[0].learned_tokens_per_sec(),
        replication: how,
        writes: router.writes,
        disaggregated,
        adapter_loads: fleet.engines.iter().map(|e| e.stats().lora_loads).sum(),
    })
}
