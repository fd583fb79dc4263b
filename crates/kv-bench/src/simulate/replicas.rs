//! Router replicas sharing the index, as the live design shares it: every replica answers
//! lookups from its own in-process index and decides with its own state (conversation memory,
//! in-flight charges, round-robin turn); its index record lands in its own index at once and in
//! every other replica's `propagation` later (the shared stream's delay). KV events reach every
//! replica alike (each subscribes to every pod). With `shared_load` each routed request's load
//! travels with its record, as the live mirror's `mirror_load` sends it; with
//! `shared_conversations` its conversation mark does too (the live mirror sends both together).
//! With a `charge_ms` of its own the load travels apart from the record, ahead of it (the
//! live mirror's load stream).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kv_router::blocks::BlockKey;
use kv_router::config::RedisConfig;
use kv_router::decide::Plan;
use kv_router::events::KvEventBatch;
use kv_router::index::{ApplyStats, KvIndex};
use kv_router::keys::Keys;
use kv_router::pods::{prefill_time, Timestamp};
use kv_router::share::ConversationMark;
use rand::Rng;
use serde::Serialize;
use vllm_sim::engine::Engine;

use super::options::{Replication, TokenRelease, MODEL};
use super::router::ready;
use super::router::{SimRouter, SimTime};

/// A routed request's load as the deciding replica charged it: when, uncached tokens, prefill.
#[derive(Clone, Copy)]
struct Charge {
    at: SimTime,
    tokens: u64,
    prefill: std::time::Duration,
}

/// The index writes the replicas published for each other (each counted once, at its origin).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Writes {
    /// Records published (one per routed decision with keys, on an index-using strategy).
    pub records: u64,
    /// Block keys in them.
    pub blocks: u64,
}

/// A record on its way from one replica to the others.
struct InFlight {
    due_us: u64,
    from: usize,
    /// The request it is about.
    req: usize,
    pod: usize,
    /// The request's first token came (`TokenRelease::FirstToken`): its tokens stop counting.
    started: bool,
    /// `None` when the replicas hold one index object (nothing to copy).
    keys: Option<Arc<[BlockKey]>>,
    charge: Option<Charge>,
    /// The decision's conversation mark, with its keys.
    conv: Option<(Arc<[BlockKey]>, ConversationMark)>,
}

/// The router replicas of one run.
pub(super) struct Replicas {
    pub(super) routers: Vec<SimRouter>,
    /// Records not yet applied by the other replicas, in due order (one delay per run).
    pending: VecDeque<InFlight>,
    delay_us: u64,
    /// Charges sent apart from their records, in due order, when they travel faster.
    charges: VecDeque<InFlight>,
    charge_delay_us: Option<u64>,
    /// Every replica holds the same index object: a shared index with no delay at all (the
    /// reference the propagation is tested against).
    one_index: bool,
    /// Other replicas' decisions are charged as in-flight load (the live mirror does).
    shared_load: bool,
    /// Other replicas' conversation marks are recorded too (the live mirror's `mirror_load`).
    shared_conversations: bool,
    /// Charges older than this on arrival are not applied (`index.redis.mirror_max_lag_ms`).
    max_charge_age_us: u64,
    pub(super) writes: Writes,
    token_release: TokenRelease,
    /// Per request whose first token has not come: what its replica charged, (pod, tokens).
    own: HashMap<usize, Vec<(usize, u64)>>,
    /// Per (replica, request of another replica): the tokens it counts until that first token.
    remote: HashMap<(usize, usize), (usize, u64)>,
}

impl Replicas {
    /// `routers` (one per replica) propagating as `how` says; `one_index` when they were all
    /// built on one index object.
    pub(super) fn new(
        routers: Vec<SimRouter>,
        how: Replication,
        one_index: bool,
        shared_load: bool,
        shared_conversations: bool,
        token_release: TokenRelease,
    ) -> Self {
        let mut routers = routers;
        for r in &mut routers {
            r.own_until_first_token = token_release != TokenRelease::Prefill;
        }
        Self {
            routers,
            pending: VecDeque::new(),
            delay_us: (how.propagation_ms * 1e3).round() as u64,
            charges: VecDeque::new(),
            charge_delay_us: how
                .charge_ms
                .map(|c| (c * 1e3).round() as u64)
                .filter(|&c| c != (how.propagation_ms * 1e3).round() as u64),
            one_index,
            shared_load,
            shared_conversations,
            max_charge_age_us: RedisConfig::default().mirror_max_lag_ms * 1000,
            writes: Writes::default(),
            token_release,
            own: HashMap::new(),
            remote: HashMap::new(),
        }
    }

    /// Each distinct index once.
    pub(super) fn indexes(&self) -> impl Iterator<Item = &Arc<dyn KvIndex>> {
        let distinct = if self.one_index {
            1
        } else {
            self.routers.len()
        };
        self.routers[..distinct]
            .iter()
            .filter_map(|r| r.index.as_ref())
    }

    /// When the next propagated record is due, if any.
    pub(super) fn next_due(&self) -> Option<u64> {
        let (r, c) = (self.pending.front(), self.charges.front());
        r.into_iter().chain(c).map(|p| p.due_us).min()
    }

    /// Applies the next propagated record (or charge) to every replica but its origin, at its
    /// due time; a charge first at equal times.
    pub(super) fn deliver_next(&mut self) {
        let charge_first = match (self.charges.front(), self.pending.front()) {
            (Some(c), Some(r)) => c.due_us <= r.due_us,
            (c, _) => c.is_some(),
        };
        let next = if charge_first {
            self.charges.pop_front()
        } else {
            self.pending.pop_front()
        };
        let Some(rec) = next else {
            return;
        };
        let now_ms = rec.due_us / 1000;
        for (r, router) in self.routers.iter_mut().enumerate() {
            if r == rec.from {
                continue;
            }
            if let (Some(index), Some(keys)) = (&router.index, &rec.keys) {
                let pod = &router.ids[rec.pod];
                ready(index.record(pod, keys, now_ms)).expect("in-memory index");
            }
            if let Some((keys, mark)) = &rec.conv {
                let pod = &router.ids[rec.pod];
                router
                    .state
                    .conversations()
                    .record_mark(keys, pod, *mark, now_ms);
            }
            if rec.started {
                if let Some((p, tokens)) = self.remote.remove(&(r, rec.req)) {
                    router.views[p].first_token(tokens);
                }
            }
            if let Some(c) = rec.charge {
                if SimTime(rec.due_us).since(c.at).as_micros() as u64 <= self.max_charge_age_us {
                    let view = &mut router.views[rec.pod];
                    if self.token_release == TokenRelease::FirstToken {
                        view.settling.push(c.at, 0, c.at);
                        view.prefilling += c.tokens;
                        self.remote.insert((r, rec.req), (rec.pod, c.tokens));
                    } else {
                        let until = c.at.after(c.prefill);
                        view.settling.push(c.at, c.tokens, until);
                    }
                }
            }
        }
    }

    /// Request `i` arriving at `t` (µs), decided and committed by its replica (round robin by
    /// request number, as Envoy spreads ext_proc streams), its record sent to the others.
    pub(super) fn decide(
        &mut self,
        i: usize,
        t: u64,
        keys: Keys,
        adapter: Option<&str>,
        rng: &mut impl Rng,
    ) -> Plan {
        let r = i % self.routers.len();
        let router = &mut self.routers[r];
        // What commit records: the primary and the request's keys, when the index is used.
        let published = (router.index.is_some() && !keys.keys.is_empty())
            .then(|| Arc::<[BlockKey]>::from(keys.keys.as_slice()));
        let plan = router.decide(t, keys, None, adapter, rng);
        if self.token_release != TokenRelease::Prefill && !router.charged.is_empty() {
            self.own.insert(i, std::mem::take(&mut router.charged));
        }
        if let Some(keys) = published {
            self.writes.records += 1;
            self.writes.blocks += keys.len() as u64;
            let charge = self.shared_load.then(|| Charge {
                at: SimTime(t),
                tokens: plan.uncached_tokens,
                prefill: prefill_time(
                    plan.uncached_tokens,
                    plan.ranked[0].predicted.tokens_per_sec,
                ),
            });
            let conv = self
                .shared_conversations
                .then(|| (keys.clone(), plan.conversation_mark()));
            let keys = (!self.one_index).then_some(keys);
            let mut charge = charge;
            if let (Some(d), Some(c), true) = (self.charge_delay_us, charge, self.routers.len() > 1)
            {
                self.charges.push_back(InFlight {
                    due_us: t + d,
                    from: r,
                    req: i,
                    pod: plan.primary,
                    started: false,
                    keys: None,
                    charge: Some(c),
                    conv: None,
                });
                charge = None;
            }
            if self.routers.len() > 1 && (keys.is_some() || charge.is_some() || conv.is_some()) {
                self.pending.push_back(InFlight {
                    due_us: t + self.delay_us,
                    from: r,
                    req: i,
                    pod: plan.primary,
                    started: false,
                    keys,
                    charge,
                    conv,
                });
            }
        }
        plan
    }

    /// Request `i`'s first token came at `t`: its replica stops counting its tokens, and with
    /// `TokenRelease::FirstToken` the others do once they hear of it (a charge's delay later).
    pub(super) fn first_token(&mut self, i: usize, t: u64) {
        let Some(charged) = self.own.remove(&i) else {
            return;
        };
        let r = i % self.routers.len();
        for &(p, tokens) in &charged {
            self.routers[r].views[p].first_token(tokens);
        }
        if self.token_release != TokenRelease::FirstToken || self.routers.len() < 2 {
            return;
        }
        let Some(&(pod, _)) = charged.first() else {
            return;
        };
        let release = |due_us| InFlight {
            due_us,
            from: r,
            req: i,
            pod,
            started: true,
            keys: None,
            charge: None,
            conv: None,
        };
        match self.charge_delay_us {
            Some(d) => self.charges.push_back(release(t + d)),
            None => self.pending.push_back(release(t + self.delay_us)),
        }
    }

    /// Request `i`, routed to pod `p` by its replica, finished.
    pub(super) fn finished(&mut self, i: usize, p: usize) {
        let r = i % self.routers.len();
        self.routers[r].views[p].finished();
    }

    /// A scrape of every pod by every replica at `t`.
    pub(super) fn scrape(&mut self, t: u64, engines: &[Engine]) {
        for router in &mut self.routers {
            for (v, e) in router.views.iter_mut().zip(engines) {
                v.scrape(SimTime(t), e);
            }
        }
    }

    /// Pod `p`'s KV-event batch, applied by every replica; the figures are one replica's.
    pub(super) fn apply_events(&self, p: usize, batch: &KvEventBatch) -> Option<ApplyStats> {
        let pod = &self.routers[0].ids[p];
        let mut first = None;
        for index in self.indexes() {
            let a = ready(index.apply_events(pod, 0, MODEL, batch)).expect("in-memory index");
            first.get_or_insert(a);
        }
        first
    }

    /// The TTL sweep of every index at `t`.
    /// Every replica's restart handling (the live maintenance loop's, once a second).
    pub(super) fn forget_restarted(&mut self) {
        for router in &mut self.routers {
            router.forget_restarted();
        }
    }

    pub(super) fn sweep(&self, t: u64) {
        for index in self.indexes() {
            ready(index.sweep(t / 1000)).expect("in-memory index");
        }
    }
}
