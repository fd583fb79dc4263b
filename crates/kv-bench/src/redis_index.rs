//! `kv-bench redis-index`: what the shared Redis index costs on its own, without Envoy or pods.
//! Fills a fresh Redis (or a local 3-master cluster) with about a million (pod, block) entries
//! through the real backend's write path, then times single lookups of 256-block prompts over
//! 16 and 64 candidate pods and counts the server round trips they took. `mirrored` writes as a
//! replica with the mirror does (snapshot sets, and the stream) and times no lookup; a fresh
//! mirrored replica loads what it wrote.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use kv_router::blocks::{namespace_seed, token_keys, BlockKey};
use kv_router::config::{Config, IndexBackend, RedisLookups, RedisMode};
use kv_router::events::{BlockHash, KvEvent, KvEventBatch};
use kv_router::index::{build_index, KvIndex, RedisMetrics, RedisSource};
use kv_router::pods::PodId;

use super::table::{Style, Table};
use kv_testkit::deploy::{RedisCluster, RedisProc};

const MODEL: &str = "bench-model";
/// Blocks per stored prompt and per looked-up prompt.
const PROMPT_BLOCKS: usize = 256;
/// Stores between write barriers: keeps the bounded write queue from dropping (it never waits).
const STORES_PER_FLUSH: usize = 16;

/// What to measure.
#[derive(Debug, Clone)]
pub struct RedisIndexOptions {
    /// The redis-server / valkey-server binary.
    pub server: PathBuf,
    /// (pod, block) entries to store.
    pub entries: usize,
    /// Candidate-set sizes to time lookups for; the largest is also the fleet that holds blocks.
    pub pods: Vec<usize>,
    /// Timed lookups per candidate-set size.
    pub lookups: usize,
    /// Index modes to measure.
    pub modes: Vec<Mode>,
    /// A local 3-master Redis Cluster instead of one server.
    pub cluster: bool,
    /// Seeds which pods hold which prompts and which prompts are looked up.
    pub seed: u64,
}

/// How the index under test is fed and read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// KV events, lookups through Redis.
    Precise,
    /// Recorded decisions, lookups through Redis (`lookups: redis`): the per-block hashes.
    Approximate,
    /// Recorded decisions with the mirror (the default `lookups: mirror`): the per-pod snapshot
    /// sets. Lookups are in-process, so none is timed; a fresh replica loads what was written.
    Mirrored,
}

impl Mode {
    /// The name `--modes` takes and the table shows.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Precise => "precise",
            Mode::Approximate => "approximate",
            Mode::Mirrored => "mirrored",
        }
    }

    /// The mode `name` names.
    pub fn parse(name: &str) -> Option<Self> {
        [Mode::Precise, Mode::Approximate, Mode::Mirrored]
            .into_iter()
            .find(|m| m.name() == name)
    }
}

/// Figures for one index mode.
#[derive(Debug, Clone, Serialize)]
pub struct ModeResult {
    /// `precise` (KV events), `approximate` (recorded decisions) or `mirrored` (recorded
    /// decisions, snapshot sets).
    pub mode: &'static str,
    /// "standalone" or "cluster (3 masters)".
    pub topology: &'static str,
    /// (pod, block) entries written.
    pub entries: usize,
    /// Distinct block keys among them.
    pub keys: usize,
    /// Entries per second through the backend's write path, flushes included.
    pub write_blocks_per_s: f64,
    /// Writes the backend dropped (must be 0 for the figures to mean anything).
    pub writes_dropped: u64,
    /// Redis `used_memory` growth (all masters), bytes.
    pub memory_bytes: u64,
    /// This process's RSS growth while a fresh mirrored replica loaded the entries, per entry
    /// (mirrored mode; the mirror's in-process copy).
    pub mirror_bytes_per_entry: Option<f64>,
    /// Keys in Redis (all masters).
    pub redis_keys: u64,
    /// One row per candidate-set size.
    pub lookups: Vec<LookupResult>,
}

/// Lookup latency over one candidate-set size.
#[derive(Debug, Clone, Serialize)]
pub struct LookupResult {
    /// Candidate pods per lookup.
    pub pods: usize,
    /// Timed lookups.
    pub count: usize,
    /// Lookups answered by Redis (the rest by the match cache or the fallback).
    pub from_redis: u64,
    /// Server-side script calls per lookup.
    pub round_trips: f64,
    /// Mean microseconds Redis spent running one lookup script.
    pub server_us: f64,
    /// Median, microseconds.
    pub p50_us: f64,
    /// 99th percentile, microseconds.
    pub p99_us: f64,
    /// Slowest, microseconds.
    pub max_us: f64,
}

/// The Redis deployment under test.
enum Server {
    One(RedisProc),
    Cluster(RedisCluster),
}

impl Server {
    fn start(opts: &RedisIndexOptions) -> Result<Self> {
        Ok(if opts.cluster {
            Server::Cluster(RedisCluster::start(&opts.server)?)
        } else {
            Server::One(RedisProc::start(&opts.server)?)
        })
    }

    fn urls(&self) -> Vec<String> {
        match self {
            Server::One(p) => vec![p.url()],
            Server::Cluster(c) => c.urls(),
        }
    }

    fn topology(&self) -> &'static str {
        match self {
            Server::One(_) => "standalone",
            Server::Cluster(_) => "cluster (3 masters)",
        }
    }

    /// Sums an integer `INFO` field over every server.
    async fn info_sum(&self, section: &str, field: &str) -> Result<u64> {
        let mut sum = 0;
        for url in self.urls() {
            let client = redis::Client::open(url.as_str())?;
            let mut con = client.get_multiplexed_async_connection().await?;
            let text: String = redis::cmd("INFO")
                .arg(section)
                .query_async(&mut con)
                .await?;
            sum += info_field(&text, field).unwrap_or(0);
        }
        Ok(sum)
    }
}

/// An integer field of `INFO` text: `used_memory:123`, or the first `name=value` of a line such
/// as `cmdstat_evalsha:calls=42,...` or `db0:keys=7,...`.
fn info_field(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        let first = rest.split(',').next()?;
        let value = first.split_once('=').map_or(first, |(_, v)| v);
        value.trim().parse().ok()
    })
}

/// Script calls answered so far and the server's microseconds spent in them (EVALSHA, plus
/// EVAL for a script not yet loaded).
async fn script_calls(server: &Server) -> Result<(u64, u64)> {
    let mut calls = 0;
    let mut usec = 0;
    for url in server.urls() {
        let client = redis::Client::open(url.as_str())?;
        let mut con = client.get_multiplexed_async_connection().await?;
        let text: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut con)
            .await?;
        for cmd in ["cmdstat_evalsha", "cmdstat_eval"] {
            let line = text.lines().find(|l| l.starts_with(&format!("{cmd}:")));
            let stat = |name: &str| {
                line.and_then(|l| {
                    l.split([':', ','])
                        .find_map(|kv| kv.strip_prefix(name)?.parse::<u64>().ok())
                })
                .unwrap_or(0)
            };
            calls += stat("calls=");
            usec += stat("usec=");
        }
    }
    Ok((calls, usec))
}

/// The tokens of prompt `doc` (distinct per doc, deterministic).
fn prompt_tokens(doc: u64) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(doc ^ 0x005e_ed0f_d0c5);
    (0..PROMPT_BLOCKS * 16)
        .map(|_| rng.random_range(0..150_000))
        .collect()
}

/// vLLM's BlockStored for prompt `doc` on one pod (engine block size 16).
fn stored_event(doc: u64, tokens: Vec<u32>) -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        data_parallel_rank: Some(0),
        events: vec![KvEvent::BlockStored {
            block_hashes: (0..PROMPT_BLOCKS as u64)
                .map(|i| BlockHash::Int(doc << 16 | i))
                .collect(),
            parent_block_hash: None,
            token_ids: tokens,
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: None,
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            kv_cache_spec_sliding_window: None,
        }],
    }
}

/// Runs every mode; each gets a fresh server so its memory is its own.
pub async fn run(opts: &RedisIndexOptions) -> Result<Vec<ModeResult>> {
    ensure!(!opts.pods.is_empty(), "--pods needs at least one size");
    let mut out = Vec::new();
    for &mode in &opts.modes {
        let server = Server::start(opts)?;
        out.push(measure(opts, &server, mode).await?);
    }
    Ok(out)
}

async fn measure(opts: &RedisIndexOptions, server: &Server, mode: Mode) -> Result<ModeResult> {
    let precise = mode == Mode::Precise;
    let fleet = *opts.pods.iter().max().expect("checked non-empty");
    let pods: Vec<PodId> = (0..fleet)
        .map(|i| PodId::new(format!("10.1.{}.{}:8000", i / 250, i % 250)))
        .collect();
    let mut cfg = Config::default();
    cfg.index.backend = IndexBackend::Redis;
    let urls = server.urls();
    cfg.index.redis.url = urls[0].clone();
    if opts.cluster {
        cfg.index.redis.mode = RedisMode::Cluster;
        cfg.index.redis.cluster_seeds = urls.clone();
    }
    // Time Redis itself: a budget that never trips, and no cached answers to flatter it.
    cfg.index.redis.lookup_budget_ms = 2_000;
    cfg.index.redis.write_budget_ms = 10_000;
    cfg.index.redis.match_cache_ms = 0;
    cfg.index.redis.lookups = match mode {
        Mode::Mirrored => RedisLookups::Mirror,
        _ => RedisLookups::Redis,
    };
    cfg.kv_events.enabled = precise;
    cfg.index.ttl_ms = 3_600_000;
    cfg.kv_events.speculative_ttl_ms = 3_600_000;
    let metrics = RedisMetrics::unregistered();
    let built = build_index(
        &cfg.index,
        &cfg.kv_events,
        &cfg.blocks,
        Some(metrics.clone()),
    )?;
    let index: Arc<dyn KvIndex> = built.index;
    let seed = namespace_seed(MODEL, None);
    let block = cfg.kv_events.block_tokens;
    let now_ms = now_ms();

    // Each prompt is held by 1-4 random pods, until the entry target is reached.
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mut holders: Vec<Vec<usize>> = Vec::new();
    let mut stores = Vec::new();
    let mut entries = 0;
    while entries < opts.entries {
        let doc = holders.len();
        let mut on: Vec<usize> = (0..fleet).collect();
        on.shuffle(&mut rng);
        on.truncate(rng.random_range(1..=4usize.min(fleet)));
        for &p in &on {
            stores.push((doc, p));
            entries += PROMPT_BLOCKS;
        }
        holders.push(on);
    }
    stores.shuffle(&mut rng);
    if !precise {
        for p in &pods {
            index.set_capacity(p, opts.entries).await?;
        }
    }
    index.flush().await?;
    let memory_before = server.info_sum("memory", "used_memory").await?;
    let keys_of = |doc: usize| token_keys(seed, &prompt_tokens(doc as u64), block, 4096);

    let start = Instant::now();
    for (i, &(doc, p)) in stores.iter().enumerate() {
        if precise {
            let batch = stored_event(doc as u64, prompt_tokens(doc as u64));
            index.apply_events(&pods[p], 0, MODEL, &batch).await?;
        } else {
            index.record(&pods[p], &keys_of(doc), now_ms).await?;
        }
        if i % STORES_PER_FLUSH == STORES_PER_FLUSH - 1 {
            index.flush().await?;
        }
    }
    index.flush().await?;
    let write_secs = start.elapsed().as_secs_f64();
    let dropped = metrics.writes_dropped_total();
    let memory_bytes = server
        .info_sum("memory", "used_memory")
        .await?
        .saturating_sub(memory_before);
    let redis_keys = server.info_sum("keyspace", "db0").await.unwrap_or(0);
    let mirror_bytes_per_entry = match mode {
        Mode::Mirrored => Some(mirror_memory(&cfg, entries).await?),
        _ => None,
    };

    let mut lookups = Vec::new();
    // A mirrored replica answers lookups in-process: nothing of Redis to time.
    let timed = if mode == Mode::Mirrored {
        &[][..]
    } else {
        &opts.pods[..]
    };
    for &n in timed {
        let candidates = &pods[..n];
        // Prompts some candidate holds whole: the walk covers all 256 blocks (the worst case).
        let held: Vec<usize> = (0..holders.len())
            .filter(|&d| holders[d].iter().any(|&p| p < n))
            .collect();
        ensure!(!held.is_empty(), "no prompt is held by the first {n} pods");
        let queries: Vec<(usize, Vec<BlockKey>)> = (0..opts.lookups)
            .map(|_| {
                let d = held[rng.random_range(0..held.len())];
                (d, keys_of(d))
            })
            .collect();
        let redis_before = metrics.lookups(RedisSource::Redis);
        let calls_before = script_calls(server).await?;
        let mut samples = Vec::with_capacity(queries.len());
        for (d, keys) in &queries {
            let t = Instant::now();
            let matched = index.lookup(keys, candidates, now_ms).await?;
            samples.push(t.elapsed());
            let best = matched.iter().cloned().fold(0.0, f64::max);
            if best < PROMPT_BLOCKS as f64 {
                bail!("prompt {d} should match {PROMPT_BLOCKS} blocks on a holder, best {best}");
            }
        }
        let (calls_after, usec_after) = script_calls(server).await?;
        let (calls, usec) = (calls_after - calls_before.0, usec_after - calls_before.1);
        samples.sort();
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let q = |f: f64| {
            us(samples[((samples.len() as f64 * f).ceil() as usize).clamp(1, samples.len()) - 1])
        };
        lookups.push(LookupResult {
            pods: n,
            count: samples.len(),
            from_redis: metrics.lookups(RedisSource::Redis) - redis_before,
            // Two INFO calls per cluster node are not scripts; only script calls are counted.
            round_trips: calls as f64 / samples.len() as f64,
            server_us: usec as f64 / calls.max(1) as f64,
            p50_us: q(0.5),
            p99_us: q(0.99),
            max_us: us(*samples.last().expect("lookups > 0")),
        });
    }
    Ok(ModeResult {
        mode: mode.name(),
        topology: server.topology(),
        entries,
        keys: holders.len() * PROMPT_BLOCKS,
        write_blocks_per_s: entries as f64 / write_secs,
        writes_dropped: dropped,
        memory_bytes,
        mirror_bytes_per_entry,
        redis_keys,
        lookups,
    })
}

/// RSS growth per entry of a fresh replica with `lookups: mirror` loading what `cfg`'s Redis
/// holds (`entries` of them) into its in-process index.
async fn mirror_memory(cfg: &Config, entries: usize) -> Result<f64> {
    let mut cfg = cfg.clone();
    cfg.index.redis.lookups = RedisLookups::Mirror;
    cfg.index.default_capacity_blocks = entries;
    let pid = std::process::id();
    let before = crate::hostile::rss(pid)?.0;
    let index = build_index(
        &cfg.index,
        &cfg.kv_events,
        &cfg.blocks,
        Some(RedisMetrics::unregistered()),
    )?
    .index;
    let deadline = Instant::now() + Duration::from_secs(600);
    while index.unready().is_some() || index.stats().entries < entries {
        ensure!(
            Instant::now() < deadline,
            "the mirror loaded {} of {entries} entries in 600 s",
            index.stats().entries
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let grown = crate::hostile::rss(pid)?.0.saturating_sub(before);
    Ok(grown as f64 / index.stats().entries.max(1) as f64)
}

/// Wall-clock milliseconds (the backend turns them into absolute expiry times).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The results as a table (plain or markdown).
pub fn table(results: &[ModeResult], style: Style) -> String {
    let mut t = Table::new([
        "mode",
        "Redis",
        "entries",
        "writes/s (blocks)",
        "bytes/entry",
        "mirror B/entry",
        "pods",
        "lookup p50",
        "p99",
        "max",
        "round trips",
        "in Redis",
    ]);
    for r in results {
        let written = vec![
            r.mode.to_string(),
            r.topology.to_string(),
            r.entries.to_string(),
            format!("{:.0}", r.write_blocks_per_s),
            format!("{:.0}", r.memory_bytes as f64 / r.entries.max(1) as f64),
            r.mirror_bytes_per_entry
                .map_or("-".into(), |b| format!("{b:.0}")),
        ];
        for l in &r.lookups {
            let mut row = written.clone();
            row.extend([
                l.pods.to_string(),
                format!("{:.0} µs", l.p50_us),
                format!("{:.0} µs", l.p99_us),
                format!("{:.0} µs", l.max_us),
                format!("{:.2}", l.round_trips),
                format!("{:.0} µs", l.server_us),
            ]);
            t.row(row);
        }
        if r.lookups.is_empty() {
            let mut row = written;
            row.extend(std::iter::repeat_n("-".to_string(), 6));
            t.row(row);
        }
    }
    t.render(style)
}

#[cfg(test)]
mod tests {
    use super::info_field;

    #[test]
    fn info_fields_and_command_calls_are_read() {
        let text = "# Memory\r\nused_memory:1234\r\nused_memory_rss:99\r\n\
                    cmdstat_evalsha:calls=42,usec=7,usec_per_call=0.1\r\n";
        assert_eq!(info_field(text, "used_memory"), Some(1234));
        assert_eq!(info_field(text, "cmdstat_evalsha"), Some(42));
        assert_eq!(info_field(text, "cmdstat_eval"), None);
        assert_eq!(info_field("db0:keys=7,expires=3\r\n", "db0"), Some(7));
    }
}
