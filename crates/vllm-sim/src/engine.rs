//! The simulated vLLM scheduler: a pure, deterministic state machine.
//!
//! No I/O and no clock reads: every call takes the current time in microseconds since an
//! arbitrary origin, and [`Engine::next_event_time`] says when the engine next needs a call.
//! Events are processed at their own scheduled times (not at the time of the call), so results
//! do not depend on how late the driver wakes up.
//!
//! Model (see `docs/vllm-sim.md`):
//! * at most `max_num_seqs` requests run; the rest wait FIFO;
//! * running requests prefill one after another on a single prefill lane; a request's prefix
//!   cache lookup happens when the lane picks it up, so it sees every prompt prefilled before;
//!   the lane is busy `prefill_us_per_token × uncached tokens`; the first token follows
//!   `ttft_base_us` later (overhead that overlaps with the next prefill);
//! * vLLM never serves the last prompt token from the cache: hits are capped at
//!   `prompt_len - 1` tokens, rounded down to whole blocks;
//! * after its prefill, a request's full prompt blocks are stored in (or touched in) the cache
//!   and pinned until it finishes;
//! * each decoding request emits a token every
//!   `decode_us_per_token × (1 + decode_batch_slowdown × running)`, plus, while a prefill runs
//!   and `prefill_chunk_tokens` is set, the compute of one prefill chunk (chunked prefill);
//! * vLLM's request timing histograms: a request is "scheduled" when the prefill lane picks it
//!   up, so queue time = submit → lane start, prefill time = lane start → first token (lane busy
//!   time + `ttft_base_us`), TTFT = submit → first token; all three (and the uncached prompt
//!   tokens) are recorded when the first token is emitted, so a request cancelled before it
//!   records nothing.

use std::collections::{BTreeSet, HashMap, VecDeque};

use kv_router::blocks::{token_keys, BlockKey};

use super::cache::{CacheEvent, PrefixCache, VllmStored};
use super::vllm_hash::{BlockDigest, HashExtras};

mod kv_import;
mod lora;

use lora::Loras;
pub use lora::{AdapterName, LoraConfig, LoraInfo, LoraSeries, MAX_LORA_SERIES};

/// Identifies a submitted request; chosen by the caller, unique per engine.
pub type RequestId = u64;

/// Scheduler and latency parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks on the (simulated) GPU.
    pub num_gpu_blocks: usize,
    /// Maximum running requests.
    pub max_num_seqs: usize,
    /// Fixed time-to-first-token overhead, microseconds.
    pub ttft_base_us: f64,
    /// Prefill compute per uncached prompt token, microseconds.
    pub prefill_us_per_token: f64,
    /// Decode time per token with one running request, microseconds.
    pub decode_us_per_token: f64,
    /// Relative decode slowdown per running request.
    pub decode_batch_slowdown: f64,
    /// Prefill tokens computed in each decode step while a prefill runs (vLLM's chunked
    /// prefill, `max_num_batched_tokens`); 0: prefill and decode never slow each other.
    pub prefill_chunk_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_gpu_blocks: 2048,
            max_num_seqs: 64,
            ttft_base_us: 15_000.0,
            prefill_us_per_token: 100.0,
            decode_us_per_token: 10_000.0,
            decode_batch_slowdown: 0.01,
            prefill_chunk_tokens: 0,
        }
    }
}

/// A request as the engine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submission {
    /// Prompt token ids.
    pub tokens: Vec<u32>,
    /// Chained keys of the prompt's full blocks (namespace = model + cache salt).
    pub keys: Vec<BlockKey>,
    /// Tokens to generate (at least 1 is generated).
    pub max_tokens: u32,
    /// vLLM block hashes of the prompt (only when KV events are published).
    pub vllm: Option<VllmInfo>,
}

/// A prompt's vLLM identity: what KV events say about its blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmInfo {
    /// vLLM digests of the full prompt blocks (parallel to [`Submission::keys`]).
    pub digests: Vec<BlockDigest>,
    /// LoRA adapter and cache salt (published extra keys).
    pub extras: HashExtras,
    /// LoRA adapter id (`lora_id` in events).
    pub lora_id: Option<i64>,
}

impl VllmInfo {
    /// What vLLM publishes for the blocks `first..first + n` of this prompt.
    pub fn stored(&self, first: usize, n: usize) -> VllmStored {
        VllmStored {
            hashes: self.digests[first..first + n].to_vec(),
            parent: first.checked_sub(1).map(|i| self.digests[i]),
            extra_keys: (first..first + n)
                .map(|i| self.extras.published(i))
                .collect(),
            lora: self
                .extras
                .lora
                .as_ref()
                .map(|(name, _)| (name.clone(), self.lora_id.unwrap_or(0))),
        }
    }
}

impl Submission {
    /// Builds a submission, hashing the prompt's full blocks under namespace `seed`.
    pub fn new(seed: u64, tokens: Vec<u32>, max_tokens: u32, block_size: usize) -> Self {
        let keys = token_keys(seed, &tokens, block_size.max(1), usize::MAX);
        Self {
            tokens,
            keys,
            max_tokens,
            vllm: None,
        }
    }
}

/// Token accounting of a finished request (OpenAI `usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

/// What the engine tells request owners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// A token was generated (`index` 0 is the first token) at time `at`.
    Token {
        /// The request.
        id: RequestId,
        /// 0-based position in the output.
        index: u32,
        /// Engine time of emission, microseconds.
        at: u64,
    },
    /// The request finished (after its last token) at time `at`.
    Finished {
        /// The request.
        id: RequestId,
        /// Token accounting.
        usage: Usage,
        /// Engine time, microseconds.
        at: u64,
    },
}

/// vLLM V1's `request_latency_buckets` (`vllm/v1/metrics/loggers.py`), the bounds of
/// `vllm:request_queue_time_seconds` and `vllm:request_prefill_time_seconds`, in microseconds.
pub const REQUEST_LATENCY_BUCKETS_US: [u64; 21] = [
    300_000,
    500_000,
    800_000,
    1_000_000,
    1_500_000,
    2_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    15_000_000,
    20_000_000,
    30_000_000,
    40_000_000,
    50_000_000,
    60_000_000,
    120_000_000,
    240_000_000,
    480_000_000,
    960_000_000,
    1_920_000_000,
    7_680_000_000,
];

/// The bounds of vLLM V1's `vllm:time_to_first_token_seconds` (same file), in microseconds.
pub const TTFT_BUCKETS_US: [u64; 22] = [
    1_000,
    5_000,
    10_000,
    20_000,
    40_000,
    60_000,
    80_000,
    100_000,
    250_000,
    500_000,
    750_000,
    1_000_000,
    2_500_000,
    5_000_000,
    7_500_000,
    10_000_000,
    20_000_000,
    40_000_000,
    80_000_000,
    160_000_000,
    640_000_000,
    2_560_000_000,
];

/// A cumulative latency histogram over fixed bounds (`le`, inclusive, as prometheus_client).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Histogram<const N: usize> {
    /// Observations, microseconds, summed.
    pub sum_us: u64,
    /// Observations.
    pub count: u64,
    /// Observations per bucket (not cumulative): `buckets[i]` counts those in
    /// `(bounds[i - 1], bounds[i]]`; those above the last bound are only in `count`.
    pub buckets: [u64; N],
}

impl<const N: usize> Default for Histogram<N> {
    fn default() -> Self {
        Self {
            sum_us: 0,
            count: 0,
            buckets: [0; N],
        }
    }
}

impl<const N: usize> Histogram<N> {
    /// Records one observation of `us` microseconds against `bounds`.
    pub fn observe(&mut self, us: u64, bounds: &[u64; N]) {
        self.sum_us = self.sum_us.saturating_add(us);
        self.count += 1;
        if let Some(i) = bounds.iter().position(|&b| us <= b) {
            self.buckets[i] += 1;
        }
    }
}

/// Point-in-time numbers for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Stats {
    /// Requests waiting for a running slot.
    pub waiting: usize,
    /// Running requests (prefilling or decoding).
    pub running: usize,
    /// Fraction of KV blocks held by running requests, in `[0, 1]`.
    pub kv_cache_usage: f64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: u64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_cache_hits: u64,
    /// Prompt tokens prefilled (cached or not) by finished prefills.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Requests finished by reaching `max_tokens`.
    pub finished_length: u64,
    /// Requests cancelled by their client.
    pub aborted: u64,
    /// Blocks in the prefix cache.
    pub cached_blocks: usize,
    /// Prompt tokens not served from the prefix cache, of the requests counted in
    /// `prefill_time` (their first token was emitted).
    pub prefill_uncached_tokens: u64,
    /// `vllm:time_to_first_token_seconds`: submit → first token.
    pub ttft: Histogram<22>,
    /// `vllm:request_queue_time_seconds`: submit → the prefill lane picks the request up.
    pub queue_time: Histogram<21>,
    /// `vllm:request_prefill_time_seconds`: lane pickup → first token.
    pub prefill_time: Histogram<21>,
    /// LoRA adapters loaded into a slot (`vllm_sim:lora_loads_total`).
    pub lora_loads: u64,
    /// Loaded adapters evicted to make room for another (`vllm_sim:lora_evictions_total`).
    pub lora_evictions: u64,
}

impl Stats {
    /// The cumulative prefill counters the router's scraper reads from `/metrics` (what
    /// kv-bench's fleet simulation hands its router; vllm-sim itself only renders them).
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn timing(&self) -> kv_router::pods::EngineTiming {
        let secs = |us: u64| us as f64 / 1e6;
        kv_router::pods::EngineTiming {
            prefill_tokens: self.prefill_uncached_tokens as f64,
            prefills: self.prefill_time.count as f64,
            prefill_seconds: secs(self.prefill_time.sum_us),
            queued: self.queue_time.count as f64,
            queue_seconds: secs(self.queue_time.sum_us),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    /// Running, waiting for the prefill lane.
    Queued,
    Prefilling,
    Decoding,
}

#[derive(Debug)]
struct Req {
    sub: Submission,
    /// LoRA adapter it runs with (`None`: the base model).
    lora: Option<AdapterName>,
    phase: Phase,
    /// Cache keys this request pinned.
    held: Vec<BlockKey>,
    cached_tokens: u32,
    generated: u32,
    /// When it was submitted.
    submitted: u64,
    /// When the prefill lane picked it up.
    scheduled: u64,
    /// Scheduled time of the next decode event (while decoding).
    next_at: u64,
}

impl Req {
    fn prompt_len(&self) -> usize {
        self.sub.tokens.len()
    }
}

/// The scheduler state.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    cache: PrefixCache,
    reqs: HashMap<RequestId, Req>,
    waiting: VecDeque<RequestId>,
    queued: VecDeque<RequestId>,
    /// Request on the prefill lane and when its prefill completes.
    lane: Option<(RequestId, u64)>,
    /// Decode events: (time, request).
    decode: BTreeSet<(u64, RequestId)>,
    running: usize,
    /// Blocks held by prefilling/decoding requests: Σ ceil((prompt + generated) / block_size).
    used_blocks: usize,
    /// Of those, blocks outside the prefix cache (partial prompt block, generated tokens).
    private_blocks: usize,
    outputs: Vec<Output>,
    events: Vec<CacheEvent>,
    stats: Stats,
    now: u64,
    /// Adapter slots (`None`: LoRA disabled, adapters are ignored).
    lora: Option<Loras>,
}

impl Engine {
    /// A fresh engine.
    pub fn new(cfg: EngineConfig) -> Self {
        let cfg = EngineConfig {
            block_size: cfg.block_size.max(1),
            max_num_seqs: cfg.max_num_seqs.max(1),
            ..cfg
        };
        Self {
            cache: PrefixCache::new(cfg.num_gpu_blocks, cfg.block_size),
            cfg,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            queued: VecDeque::new(),
            lane: None,
            decode: BTreeSet::new(),
            running: 0,
            used_blocks: 0,
            private_blocks: 0,
            outputs: Vec::new(),
            events: Vec::new(),
            stats: Stats::default(),
            now: 0,
            lora: None,
        }
    }

    /// Enables LoRA adapters: requests submitted with [`Engine::submit_lora`] compete for
    /// `max_loras` adapter slots.
    pub fn with_lora(mut self, cfg: LoraConfig) -> Self {
        self.lora = Some(Loras::new(cfg));
        self
    }

    /// Adapter label sets and residency for `/metrics` (`None` when LoRA is disabled).
    pub fn lora_info(&self) -> Option<LoraInfo> {
        self.lora.as_ref().map(Loras::info)
    }

    /// Read access to the prefix cache.
    #[cfg(test)]
    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// Adds a request arriving at `now`. Ignored if `id` is already in use.
    pub fn submit(&mut self, now: u64, id: RequestId, sub: Submission) {
        self.submit_lora(now, id, sub, None);
    }

    /// Adds a request for LoRA adapter `lora` (`None`: the base model; ignored when LoRA is
    /// disabled) arriving at `now`. Ignored if `id` is already in use.
    pub fn submit_lora(
        &mut self,
        now: u64,
        id: RequestId,
        sub: Submission,
        lora: Option<AdapterName>,
    ) {
        self.advance(now);
        if self.reqs.contains_key(&id) {
            return;
        }
        let lora = lora.filter(|_| self.lora.is_some());
        if let (Some(l), Some(name)) = (self.lora.as_mut(), &lora) {
            l.arrive(name);
        }
        self.reqs.insert(
            id,
            Req {
                sub,
                lora,
                phase: Phase::Waiting,
                held: Vec::new(),
                cached_tokens: 0,
                generated: 0,
                submitted: self.now,
                scheduled: 0,
                next_at: 0,
            },
        );
        self.waiting.push_back(id);
        self.schedule();
    }

    /// Drops a request at `now` (client went away), freeing its slot and blocks. Returns
    /// whether it was still known.
    pub fn cancel(&mut self, now: u64, id: RequestId) -> bool {
        self.advance(now);
        let Some(req) = self.reqs.remove(&id) else {
            return false;
        };
        if let (Some(l), Some(name)) = (self.lora.as_mut(), &req.lora) {
            l.leave(name, req.phase != Phase::Waiting, self.now);
        }
        match req.phase {
            Phase::Waiting => self.waiting.retain(|&r| r != id),
            Phase::Queued => {
                self.queued.retain(|&r| r != id);
                self.running -= 1;
            }
            Phase::Prefilling => {
                // The lane is freed at once; the partial prefill is lost.
                self.lane = None;
                self.running -= 1;
                self.free_blocks(&req);
            }
            Phase::Decoding => {
                self.decode.remove(&(req.next_at, id));
                self.running -= 1;
                self.free_blocks(&req);
            }
        }
        self.stats.aborted += 1;
        self.schedule();
        true
    }

    /// Clears the prefix cache, like vLLM's `reset_prefix_cache` (refused while running
    /// requests hold cached blocks). Returns whether it was cleared.
    pub fn reset_prefix_cache(&mut self, now: u64) -> bool {
        self.advance(now);
        self.cache.clear(&mut self.events)
    }

    /// The engine restarts at `now` (a crash, a redeploy): its cache and counters start empty,
    /// `AllBlocksCleared` is published, and every unfinished request is returned, by id, for
    /// its client to retry. Outputs produced before the restart are kept.
    #[allow(dead_code)] // kv-bench simulate's restarts; a vllm-sim process restarts whole
    pub fn restart(&mut self, now: u64) -> Vec<(RequestId, Submission)> {
        self.advance(now);
        let mut lost: Vec<_> = self.reqs.drain().map(|(id, r)| (id, r.sub)).collect();
        lost.sort_by_key(|(id, _)| *id);
        let outputs = std::mem::take(&mut self.outputs);
        let mut events = std::mem::take(&mut self.events);
        events.push(CacheEvent::AllBlocksCleared);
        let at = self.now.max(now);
        let lora = self.lora.as_ref().map(|l| l.cfg.clone());
        *self = Engine::new(self.cfg.clone());
        self.lora = lora.map(Loras::new);
        self.now = at;
        self.outputs = outputs;
        self.events = events;
        lost
    }

    /// Processes everything due up to `now` and returns the outputs produced since the last
    /// call (including those caused by `submit`/`cancel`).
    pub fn step(&mut self, now: u64) -> Vec<Output> {
        self.advance(now);
        std::mem::take(&mut self.outputs)
    }

    /// When the engine next has something to do, if anything.
    pub fn next_event_time(&self) -> Option<u64> {
        let lane = self.lane.map(|(_, t)| t);
        let decode = self.decode.first().map(|&(t, _)| t);
        match (lane, decode) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Takes the prefix-cache changes (vLLM KV events) since the last call, in order.
    pub fn drain_cache_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// Current gauges and counters.
    pub fn stats(&self) -> Stats {
        let cap = self.cfg.num_gpu_blocks.max(1) as f64;
        Stats {
            waiting: self.waiting.len(),
            running: self.running,
            kv_cache_usage: (self.used_blocks as f64 / cap).min(1.0),
            cached_blocks: self.cache.len(),
            lora_loads: self.lora.as_ref().map_or(0, |l| l.loads),
            lora_evictions: self.lora.as_ref().map_or(0, |l| l.evictions),
            ..self.stats
        }
    }

    fn advance(&mut self, now: u64) {
        // Time never goes backwards, whatever the caller passes.
        let now = now.max(self.now);
        while let Some(t) = self.next_event_time().filter(|&t| t <= now) {
            self.now = t;
            match self.lane {
                Some((id, done)) if done == t => {
                    self.lane = None;
                    self.finish_prefill(id, t);
                }
                _ => {
                    let Some((t, id)) = self.decode.pop_first() else {
                        break;
                    };
                    self.emit_token(id, t);
                }
            }
            self.schedule();
        }
        self.now = now;
    }

    /// Admits waiting requests into free running slots and starts the next prefill.
    fn schedule(&mut self) {
        while self.running < self.cfg.max_num_seqs {
            let Some(id) = self.next_admissible() else {
                break;
            };
            if let Some(req) = self.reqs.get_mut(&id) {
                if let (Some(l), Some(name)) = (self.lora.as_mut(), &req.lora) {
                    l.admit(name, self.now);
                }
                req.phase = Phase::Queued;
                self.queued.push_back(id);
                self.running += 1;
            }
        }
        if self.lane.is_none() {
            if let Some(id) = self.queued.pop_front() {
                self.start_prefill(id, self.now);
            }
        }
        if let Some(l) = self.lora.as_mut() {
            l.record(self.now);
        }
    }

    /// Takes the first waiting request that may run now: like vLLM, a request whose adapter
    /// cannot get a slot is skipped, not blocking the requests behind it.
    fn next_admissible(&mut self) -> Option<RequestId> {
        let pos = match &self.lora {
            None => 0,
            Some(l) => self.waiting.iter().position(|id| {
                self.reqs
                    .get(id)
                    .and_then(|r| r.lora.as_deref())
                    .is_none_or(|name| l.admissible(name))
            })?,
        };
        self.waiting.remove(pos)
    }

    fn start_prefill(&mut self, id: RequestId, now: u64) {
        let bs = self.cfg.block_size;
        let Some(req) = self.reqs.get_mut(&id) else {
            return;
        };
        let prompt = req.prompt_len();
        // vLLM recomputes at least the last prompt token.
        let max_hit_blocks = prompt.saturating_sub(1) / bs;
        let hit = self
            .cache
            .lookup(&req.sub.keys[..max_hit_blocks.min(req.sub.keys.len())]);
        req.held = self.cache.acquire(&req.sub.keys[..hit]);
        req.cached_tokens = (hit * bs) as u32;
        req.phase = Phase::Prefilling;
        req.scheduled = now;
        self.stats.prefix_cache_queries += prompt as u64;
        self.stats.prefix_cache_hits += (hit * bs) as u64;
        let uncached = (prompt - hit * bs) as f64;
        let load = match (self.lora.as_mut(), req.lora.as_deref()) {
            (Some(l), Some(name)) => l.take_load(name),
            _ => 0,
        };
        let busy = (self.cfg.prefill_us_per_token * uncached).max(0.0).round() as u64;
        let busy = busy.saturating_add(load);
        self.used_blocks += prompt.div_ceil(bs);
        self.private_blocks += prompt.div_ceil(bs) - prompt / bs;
        self.lane = Some((id, now.saturating_add(busy)));
        self.cache
            .set_reserved(self.private_blocks, &mut self.events);
    }

    fn finish_prefill(&mut self, id: RequestId, now: u64) {
        let bs = self.cfg.block_size;
        let Some(req) = self.reqs.get_mut(&id) else {
            return;
        };
        let hit = req.cached_tokens as usize / bs;
        let keys = &req.sub.keys[hit..];
        let tokens = &req.sub.tokens[hit * bs..];
        let parent = hit.checked_sub(1).map(|i| req.sub.keys[i]);
        let start = self.events.len();
        let pinned = self.cache.insert(parent, keys, tokens, &mut self.events);
        if let Some(info) = &req.sub.vllm {
            annotate(&mut self.events[start..], &req.sub.keys, hit, info);
        }
        req.held.extend(pinned);
        self.stats.prompt_tokens += req.prompt_len() as u64;
        req.phase = Phase::Decoding;
        let first = now.saturating_add(self.cfg.ttft_base_us.max(0.0).round() as u64);
        req.next_at = first;
        self.decode.insert((first, id));
    }

    fn emit_token(&mut self, id: RequestId, now: u64) {
        let bs = self.cfg.block_size;
        let stall = self.chunk_stall(now);
        let Some(req) = self.reqs.get_mut(&id) else {
            return;
        };
        let before = (req.prompt_len() + req.generated as usize).div_ceil(bs);
        req.generated += 1;
        let after = (req.prompt_len() + req.generated as usize).div_ceil(bs);
        let index = req.generated - 1;
        self.stats.generation_tokens += 1;
        if index == 0 {
            let s = &mut self.stats;
            s.prefill_uncached_tokens += (req.prompt_len() - req.cached_tokens as usize) as u64;
            // Engine time never goes backwards: submitted ≤ scheduled ≤ now.
            s.ttft
                .observe(now.saturating_sub(req.submitted), &TTFT_BUCKETS_US);
            s.queue_time.observe(
                req.scheduled.saturating_sub(req.submitted),
                &REQUEST_LATENCY_BUCKETS_US,
            );
            s.prefill_time.observe(
                now.saturating_sub(req.scheduled),
                &REQUEST_LATENCY_BUCKETS_US,
            );
        }
        self.outputs.push(Output::Token { id, index, at: now });
        let grew = after - before;
        let finished = req.generated >= req.sub.max_tokens.max(1);
        if !finished {
            let slowdown = 1.0 + self.cfg.decode_batch_slowdown.max(0.0) * self.running as f64;
            let dt = (self.cfg.decode_us_per_token.max(0.0) * slowdown).round() as u64;
            req.next_at = now.saturating_add(dt).saturating_add(stall);
            self.decode.insert((req.next_at, id));
        }
        if grew > 0 {
            self.used_blocks += grew;
            self.private_blocks += grew;
        }
        if finished {
            let usage = Usage {
                prompt_tokens: req.prompt_len() as u32,
                completion_tokens: req.generated,
                cached_tokens: req.cached_tokens,
            };
            let req = self.reqs.remove(&id).expect("request present");
            if let (Some(l), Some(name)) = (self.lora.as_mut(), &req.lora) {
                l.leave(name, true, now);
            }
            self.running -= 1;
            self.free_blocks(&req);
            self.stats.finished_length += 1;
            self.outputs.push(Output::Finished { id, usage, at: now });
        } else if grew > 0 {
            self.cache
                .set_reserved(self.private_blocks, &mut self.events);
        }
    }

    /// How much longer the next decode step takes because it carries a chunk of the prefill
    /// running at `now`: the chunk's compute, at most what is left of that prefill. This is the
    /// inter-token stall prefill/decode disaggregation removes.
    fn chunk_stall(&self, now: u64) -> u64 {
        let Some((_, done)) = self.lane else {
            return 0;
        };
        let chunk = self.cfg.prefill_chunk_tokens as f64 * self.cfg.prefill_us_per_token.max(0.0);
        (chunk.round() as u64).min(done.saturating_sub(now))
    }

    /// Returns a prefilling/decoding request's blocks.
    fn free_blocks(&mut self, req: &Req) {
        let bs = self.cfg.block_size;
        let total = req.prompt_len() + req.generated as usize;
        self.used_blocks -= total.div_ceil(bs);
        self.private_blocks -= total.div_ceil(bs) - req.prompt_len() / bs;
        self.cache.release(&req.held);
        self.cache
            .set_reserved(self.private_blocks, &mut self.events);
    }
}

/// Fills in the vLLM identity of the `BlockStored` events the cache just emitted for a prompt
/// with `keys`, stored from block `from` on. Runs come in prompt order, so one forward scan
/// finds each run's first block.
fn annotate(events: &mut [CacheEvent], keys: &[BlockKey], from: usize, info: &VllmInfo) {
    let mut cursor = from;
    for ev in events {
        if let CacheEvent::BlockStored {
            block_hashes, vllm, ..
        } = ev
        {
            let Some(first) = block_hashes.first() else {
                continue;
            };
            let Some(pos) = keys[cursor..].iter().position(|k| k == first) else {
                continue;
            };
            let idx = cursor + pos;
            let n = block_hashes.len();
            if idx + n <= info.digests.len() {
                *vllm = Some(info.stored(idx, n));
            }
            cursor = idx + n;
        }
    }
}

#[cfg(test)]
mod lora_tests;
#[cfg(test)]
mod tests;
