//! The `KvIndex` conformance suite: one set of behavioural checks every backend must pass,
//! through the trait only, each on a fresh backend from a factory. A backend declares its
//! capabilities ([`Caps`]); checks it cannot serve are skipped and listed, never silently passed.
//!
//! Add a backend: one `#[tokio::test]` in [`backends`] calling [`run`] with its factory and caps.
//! `selftest` proves the suite fails deliberately broken backends.
//!
//! What every backend promises (see the [`KvIndex`] docs): lookups count the consecutive prefix
//! per candidate, in candidate order; `record` entries match until `ttl_ms` after their last
//! record and a pod keeps at most `capacity` of them, prompt heads last to go; `forget_pod` drops
//! a pod whose slot may then serve another pod without leaking; `sweep` frees what expired;
//! every write is idempotent. Event-fed backends also index stored blocks (not subject to the
//! TTL), drop removed ones, purge on a clear or a rank reset, and bound a pod's blocks.

mod checks;
mod selftest;

use std::future::Future;

use futures::future::BoxFuture;

use super::{ApplyStats, IndexStats, KvIndex};
use crate::blocks::{namespace_seed, token_keys, BlockKey};
use crate::events::{BlockHash, KvEvent, KvEventBatch};
use crate::pods::PodId;

/// What the factory must build: a backend whose recorded entries live `ttl_ms` and of which a
/// pod keeps at most `capacity`, and (event-fed backends) whose router blocks are `block_tokens`
/// tokens long and which purges a pod past `capacity` engine blocks. GPU blocks weigh 1.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Setup {
    /// TTL of recorded (approximate or speculative) entries.
    pub(crate) ttl_ms: u64,
    /// Per-pod bound of recorded entries and of event-fed blocks.
    pub(crate) capacity: usize,
    /// Router block size in tokens; the suite's engine blocks have the same size.
    pub(crate) block_tokens: usize,
}

/// The setup every check gets.
pub(crate) const SETUP: Setup = Setup {
    ttl_ms: 1_000,
    capacity: 8,
    block_tokens: 4,
};

/// What a backend declares it does beyond the shared contract.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    /// `apply_events` indexes vLLM KV events (otherwise it may ignore them).
    pub(crate) events: bool,
    /// `set_capacity` evicts recorded entries (event-fed backends trust the events instead).
    pub(crate) set_capacity: bool,
    /// `stats()` counts recorded entries (otherwise only event-fed ones).
    pub(crate) records_in_stats: bool,
}

/// Outcome of one check: `Err` says what differed.
type Outcome = Result<(), String>;

/// The backend under test, with its declared capabilities and setup; calls return `Err(String)`
/// so checks read as straight-line code with `?`.
#[derive(Clone, Copy)]
pub(crate) struct Probe<'a> {
    ix: &'a dyn KvIndex,
    caps: Caps,
    s: Setup,
}

impl Probe<'_> {
    async fn lookup(
        &self,
        keys: &[BlockKey],
        pods: &[PodId],
        now: u64,
    ) -> Result<Vec<f64>, String> {
        self.ix
            .lookup(keys, pods, now)
            .await
            .map_err(|e| format!("lookup failed: {e}"))
    }
    async fn record(&self, pod: &PodId, keys: &[BlockKey], now: u64) -> Outcome {
        self.ix
            .record(pod, keys, now)
            .await
            .map_err(|e| format!("record failed: {e}"))?;
        self.flush().await
    }
    /// Every write is followed by a flush: the contract is about what lookups see once the
    /// backend says the write is visible.
    async fn flush(&self) -> Outcome {
        self.ix
            .flush()
            .await
            .map_err(|e| format!("flush failed: {e}"))
    }
    async fn forget(&self, pod: &PodId) -> Outcome {
        self.ix
            .forget_pod(pod)
            .await
            .map_err(|e| format!("forget_pod failed: {e}"))?;
        self.flush().await
    }
    async fn forget_rank(&self, pod: &PodId, rank: u32) -> Outcome {
        self.ix
            .forget_rank(pod, rank)
            .await
            .map_err(|e| format!("forget_rank failed: {e}"))?;
        self.flush().await
    }
    async fn set_capacity(&self, pod: &PodId, blocks: usize) -> Outcome {
        self.ix
            .set_capacity(pod, blocks)
            .await
            .map_err(|e| format!("set_capacity failed: {e}"))?;
        self.flush().await
    }
    async fn sweep(&self, now: u64) -> Outcome {
        self.ix
            .sweep(now)
            .await
            .map_err(|e| format!("sweep failed: {e}"))?;
        self.flush().await
    }
    async fn apply(
        &self,
        pod: &PodId,
        rank: u32,
        batch: &KvEventBatch,
    ) -> Result<ApplyStats, String> {
        let stats = self
            .ix
            .apply_events(pod, rank, MODEL, batch)
            .await
            .map_err(|e| format!("apply_events failed: {e}"))?;
        self.flush().await?;
        Ok(stats)
    }
    fn stats(&self) -> IndexStats {
        self.ix.stats()
    }
    /// How much of `keys` `pod` holds, key by key (not only the leading run).
    async fn held(&self, pod: &PodId, keys: &[BlockKey], now: u64) -> Result<f64, String> {
        let mut total = 0.0;
        for k in keys {
            total += self
                .lookup(std::slice::from_ref(k), std::slice::from_ref(pod), now)
                .await?[0];
        }
        Ok(total)
    }
}

/// A check must hold if the backend declares what it `needs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Needs {
    Nothing,
    Events,
    SetCapacity,
}

struct Check {
    name: &'static str,
    needs: Needs,
    run: for<'a> fn(Probe<'a>) -> BoxFuture<'a, Outcome>,
}

/// What a suite run found.
#[derive(Debug)]
pub(crate) struct Report {
    backend: &'static str,
    passed: Vec<&'static str>,
    skipped: Vec<&'static str>,
    failed: Vec<(&'static str, String)>,
}

impl Report {
    /// Panics with every failure unless all applicable checks passed.
    pub(crate) fn assert_passed(&self) {
        let failures: Vec<String> = self
            .failed
            .iter()
            .map(|(name, why)| format!("  {name}: {why}"))
            .collect();
        assert!(
            failures.is_empty(),
            "{} fails the KvIndex contract:\n{}",
            self.backend,
            failures.join("\n")
        );
        assert!(!self.passed.is_empty(), "no check ran");
    }

    /// Panics unless `check` failed (the suite caught the flaw it targets).
    pub(crate) fn assert_caught(&self, check: &str) {
        assert!(
            self.failed.iter().any(|(name, _)| *name == check),
            "the suite missed {}'s flaw: `{check}` did not fail (failed: {:?})",
            self.backend,
            self.failed
        );
    }
}

/// Runs every applicable check, each on a fresh backend from `factory(SETUP)`.
pub(crate) async fn run<B, F, Fut>(backend: &'static str, caps: Caps, factory: F) -> Report
where
    B: KvIndex,
    F: Fn(Setup) -> Fut,
    Fut: Future<Output = B>,
{
    let mut report = Report {
        backend,
        passed: Vec::new(),
        skipped: Vec::new(),
        failed: Vec::new(),
    };
    for check in checks::ALL {
        let applies = match check.needs {
            Needs::Nothing => true,
            Needs::Events => caps.events,
            Needs::SetCapacity => caps.set_capacity,
        };
        if !applies {
            report.skipped.push(check.name);
            continue;
        }
        let ix = factory(SETUP).await;
        let probe = Probe {
            ix: &ix,
            caps,
            s: SETUP,
        };
        match (check.run)(probe).await {
            Ok(()) => report.passed.push(check.name),
            Err(why) => report.failed.push((check.name, why)),
        }
    }
    report
}

// ---- Workload: pods, recorded keys, event documents ---------------------------------------

/// Seeds the keys of the suite's event-fed blocks.
pub(crate) const MODEL: &str = "contract-model";

pub(crate) fn pod(i: usize) -> PodId {
    PodId::new(format!("10.9.{}.{}:8000", i / 200, i % 200))
}

pub(crate) fn pods(n: usize) -> Vec<PodId> {
    (0..n).map(pod).collect()
}

/// Recorded keys with the given values.
fn k(values: &[u64]) -> Vec<BlockKey> {
    values.iter().map(|&v| BlockKey(v)).collect()
}

/// Token `t` of block `i` of document `doc` (documents share nothing).
fn doc_tokens(doc: u64, blocks: std::ops::Range<usize>, bt: usize) -> Vec<u32> {
    (blocks.start * bt..blocks.end * bt)
        .map(|t| (doc as u32) << 16 | t as u32)
        .collect()
}

/// The router keys of a document's first `n` blocks, as a request would compute them.
pub(crate) fn doc_keys(doc: u64, n: usize, bt: usize) -> Vec<BlockKey> {
    token_keys(
        namespace_seed(MODEL, None),
        &doc_tokens(doc, 0..n, bt),
        bt,
        4096,
    )
}

/// The engine hash of a document's block `i` (synthetic, unique per document and position).
fn ehash(doc: u64, i: usize) -> BlockHash {
    BlockHash::Int(doc << 32 | i as u64)
}

fn batch(events: Vec<KvEvent>) -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        events,
        data_parallel_rank: Some(0),
    }
}

/// `BlockStored` of a document's blocks `range`, chained to block `range.start - 1`.
pub(crate) fn store(doc: u64, range: std::ops::Range<usize>, bt: usize) -> KvEventBatch {
    batch(vec![KvEvent::BlockStored {
        block_hashes: range.clone().map(|i| ehash(doc, i)).collect(),
        parent_block_hash: (range.start > 0).then(|| ehash(doc, range.start - 1)),
        token_ids: doc_tokens(doc, range, bt),
        block_size: bt as u32,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: None,
        group_idx: None,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
    }])
}

/// `BlockRemoved` of a document's block `i` (GPU).
pub(crate) fn remove(doc: u64, i: usize) -> KvEventBatch {
    batch(vec![KvEvent::BlockRemoved {
        block_hashes: vec![ehash(doc, i)],
        medium: Some("GPU".into()),
        group_idx: None,
    }])
}

pub(crate) fn clear() -> KvEventBatch {
    batch(vec![KvEvent::AllBlocksCleared])
}

/// Returns `Err` describing the difference unless `got == want`.
macro_rules! ensure_eq {
    ($got:expr, $want:expr, $($what:tt)+) => {
        match (&$got, &$want) {
            (got, want) => {
                if got != want {
                    return Err(format!("{}: got {:?}, want {:?}", format_args!($($what)+), got, want));
                }
            }
        }
    };
}
use ensure_eq;

/// Returns `Err(what)` unless `cond`.
macro_rules! ensure {
    ($cond:expr, $($what:tt)+) => {{
        let holds: bool = $cond;
        if !holds {
            return Err(format!($($what)+));
        }
    }};
}
use ensure;

/// Every backend of this crate, with the capabilities it declares.
mod backends {
    use super::*;
    use crate::index::{EventIndex, EventIndexConfig, MemoryIndex};

    /// The approximate backend learns from `record` only.
    pub(super) const MEMORY: Caps = Caps {
        events: false,
        set_capacity: true,
        records_in_stats: true,
    };

    /// The precise backend: events are authoritative (capacity is theirs to say), recorded
    /// entries are speculative and not counted in `stats()`.
    pub(super) const EVENTS: Caps = Caps {
        events: true,
        set_capacity: false,
        records_in_stats: false,
    };

    pub(super) fn memory(s: Setup) -> MemoryIndex {
        MemoryIndex::new(s.ttl_ms, s.capacity)
    }

    pub(super) fn events(s: Setup) -> EventIndex {
        EventIndex::new(EventIndexConfig {
            block_tokens: s.block_tokens,
            speculative_ttl_ms: s.ttl_ms,
            speculative_capacity: s.capacity,
            max_engine_blocks_per_pod: s.capacity,
            ..EventIndexConfig::default()
        })
    }

    #[tokio::test]
    async fn memory_index_passes_the_contract() {
        let report = run("MemoryIndex", MEMORY, |s| async move { memory(s) }).await;
        report.assert_passed();
        assert_eq!(report.skipped.len(), 5, "{:?}", report.skipped);
    }

    #[tokio::test]
    async fn event_index_passes_the_contract() {
        let report = run("EventIndex", EVENTS, |s| async move { events(s) }).await;
        report.assert_passed();
        assert_eq!(report.skipped, ["set_capacity_shrinks_a_pod"]);
    }

    /// The shared backend over a real server: approximate (MEMORY caps) and precise (EVENTS).
    mod redis {
        use std::sync::atomic::{AtomicUsize, Ordering};

        use super::*;
        use crate::config::RedisConfig;
        use crate::index::{Local, RedisIndex, RedisMetrics, Tuning};
        use kv_testkit::deploy::{find_redis_server, RedisProc};

        /// A server for one test (fails, never skips, when none can start).
        pub(crate) fn server() -> RedisProc {
            let bin = find_redis_server().unwrap_or_else(|e| panic!("{e:#}"));
            RedisProc::start(&bin).unwrap_or_else(|e| panic!("{}: {e:#}", bin.display()))
        }

        /// A backend on `url` whose keys no other backend of the test shares.
        pub(crate) fn redis(url: &str, prefix: String, local: Local, s: Setup) -> RedisIndex {
            // Every lookup reads Redis: these tests are about what Redis holds.
            redis_with(url, prefix, local, s, crate::config::RedisLookups::Redis)
        }

        /// A backend answering lookups as `lookups` says.
        fn redis_with(
            url: &str,
            prefix: String,
            local: Local,
            s: Setup,
            lookups: crate::config::RedisLookups,
        ) -> RedisIndex {
            let cfg = RedisConfig {
                lookups,
                url: url.to_string(),
                key_prefix: prefix,
                // Generous: the checks are about behaviour, and CI runs them beside other tests.
                lookup_budget_ms: 1_000,
                write_budget_ms: 5_000,
                ..RedisConfig::default()
            };
            let tuning = Tuning {
                record_ttl_ms: s.ttl_ms,
                default_capacity: s.capacity,
                gpu_weight: 1.0,
                cpu_weight: 0.8,
            };
            RedisIndex::new(&cfg, local, tuning, RedisMetrics::unregistered()).unwrap()
        }

        #[tokio::test]
        async fn redis_index_passes_the_contract_in_both_modes() {
            let server = server();
            let url = server.url();
            let n = AtomicUsize::new(0);
            let prefix = || format!("contract{}", n.fetch_add(1, Ordering::Relaxed));
            let report = run("RedisIndex (approximate)", MEMORY, |s| {
                let ix = redis(&url, prefix(), Local::Memory(memory(s)), s);
                async move { ix }
            })
            .await;
            report.assert_passed();
            assert_eq!(report.skipped.len(), 5, "{:?}", report.skipped);
            let report = run("RedisIndex (precise)", EVENTS, |s| {
                let ix = redis(&url, prefix(), Local::Events(events(s)), s);
                async move { ix }
            })
            .await;
            report.assert_passed();
            assert_eq!(report.skipped, ["set_capacity_shrinks_a_pod"]);
        }

        #[tokio::test]
        async fn a_mirrored_redis_index_passes_the_contract_in_both_modes() {
            let server = server();
            let url = server.url();
            let n = AtomicUsize::new(0);
            let prefix = || format!("mirrored{}", n.fetch_add(1, Ordering::Relaxed));
            let mirrored = |local: Local, s: Setup| {
                redis_with(
                    &url,
                    prefix(),
                    local,
                    s,
                    crate::config::RedisLookups::Mirror,
                )
            };
            let report = run("RedisIndex (mirror, approximate)", MEMORY, |s| {
                let ix = mirrored(Local::Memory(memory(s)), s);
                async move { ix }
            })
            .await;
            report.assert_passed();
            let report = run("RedisIndex (mirror, precise)", EVENTS, |s| {
                let ix = mirrored(Local::Events(events(s)), s);
                async move { ix }
            })
            .await;
            report.assert_passed();
        }
    }
}
