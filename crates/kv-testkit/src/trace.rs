//! Mooncake traces (`data/traces/*.jsonl`): loading, statistics and the deterministic expansion
//! of 512-token hash ids into token ids (workloads.md §1–2).
//!
//! Each trace id stands for 512 tokens; ids are chained (equal id ⇒ equal prefix), so the tokens
//! of block `h` depend on `h` alone: `token(h, k) = lo + splitmix64(seed ^ (h << 9 | k)) % span`.
//! A request's prompt is its blocks concatenated, the last one cut to `input_length`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::splitmix::SplitMix64;

/// Tokens per trace hash id.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// One line of a Mooncake trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct TraceRecord {
    /// Arrival, milliseconds since the first request.
    pub timestamp: u64,
    /// Prompt length in tokens.
    pub input_length: u32,
    /// Output length in tokens.
    pub output_length: u32,
    /// Chained 512-token block ids.
    pub hash_ids: Vec<u64>,
}

/// A loaded trace.
#[derive(Debug, Clone)]
pub struct Trace {
    /// File stem (`mooncake_conversation_trace`, …).
    pub name: String,
    /// Index of the first record in the file (windows of a trace).
    pub offset: usize,
    /// Requests in file (= arrival) order.
    pub records: Vec<TraceRecord>,
}

/// Summary figures of a trace (workloads.md §1.1 table): the tests check the loader against
/// them.
#[cfg(test)]
#[derive(Debug, Clone, Serialize)]
pub struct TraceStats {
    /// Requests.
    pub requests: usize,
    /// Last timestamp, seconds.
    pub span_s: f64,
    /// Mean prompt tokens.
    pub mean_input: f64,
    /// Mean output tokens.
    pub mean_output: f64,
    /// Distinct hash ids.
    pub distinct_blocks: usize,
    /// Infinite-cache prefix hit ratio in tokens at 512-token granularity.
    pub ideal_hit_tokens: f64,
}

impl Trace {
    /// Parses a JSONL trace; every line is validated (`len(hash_ids) == ceil(input_length/512)`).
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut records = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let r: TraceRecord = serde_json::from_str(line)
                .with_context(|| format!("{}:{}: not a trace record", path.display(), i + 1))?;
            let want = (r.input_length as usize).div_ceil(TRACE_BLOCK_TOKENS);
            if r.hash_ids.len() != want || r.input_length == 0 {
                bail!(
                    "{}:{}: {} hash ids for {} input tokens (want {want})",
                    path.display(),
                    i + 1,
                    r.hash_ids.len(),
                    r.input_length
                );
            }
            records.push(r);
        }
        if records.is_empty() {
            bail!("{}: empty trace", path.display());
        }
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "trace".into());
        Ok(Self {
            name,
            offset: 0,
            records,
        })
    }

    /// Requests `skip..skip + n` (clamped), timestamps re-based so the first is at 0.
    pub fn window(&self, skip: usize, n: usize) -> Self {
        let from = skip.min(self.records.len());
        let to = from.saturating_add(n).min(self.records.len());
        let t0 = self.records.get(from).map_or(0, |r| r.timestamp);
        Self {
            name: self.name.clone(),
            offset: self.offset + from,
            records: self.records[from..to]
                .iter()
                .map(|r| TraceRecord {
                    timestamp: r.timestamp - t0,
                    ..r.clone()
                })
                .collect(),
        }
    }

    /// Arrival times in µs at `speedup` (trace ms / speedup, rounded); with `spread`, requests
    /// that share one timestamp arrive evenly spread until the next ([`spread_clumps`]).
    pub fn arrivals_us(&self, speedup: f64, spread: bool) -> Vec<u64> {
        let mut at: Vec<u64> = self
            .records
            .iter()
            .map(|r| (r.timestamp as f64 * 1e3 / speedup).round() as u64)
            .collect();
        if spread {
            spread_clumps(&mut at);
        }
        at
    }

    /// Statistics, including the infinite-cache ideal hit ratio computed as in workloads.md §1.2.
    #[cfg(test)]
    pub fn stats(&self) -> TraceStats {
        let mut seen = ahash::AHashSet::new();
        let (mut hit, mut total, mut input, mut output) = (0u64, 0u64, 0u64, 0u64);
        for r in &self.records {
            let n = r.hash_ids.len();
            let h = r
                .hash_ids
                .iter()
                .take_while(|id| seen.contains(*id))
                .count();
            for i in 0..h {
                hit += block_len(r, i) as u64;
            }
            total += u64::from(r.input_length);
            input += u64::from(r.input_length);
            output += u64::from(r.output_length);
            seen.extend(r.hash_ids.iter().copied());
            debug_assert!(h <= n);
        }
        let n = self.records.len() as f64;
        TraceStats {
            requests: self.records.len(),
            span_s: self
                .records
                .last()
                .map_or(0.0, |r| r.timestamp as f64 / 1e3),
            mean_input: input as f64 / n,
            mean_output: output as f64 / n,
            distinct_blocks: seen.len(),
            ideal_hit_tokens: if total == 0 {
                0.0
            } else {
                hit as f64 / total as f64
            },
        }
    }
}

/// Arrivals that share one instant (`at_us`, ascending) spread evenly from it until the next
/// distinct instant; a clump at the end spreads over one millisecond. The Mooncake conversation
/// trace buckets its timestamps to 3 s: about 10 requests at one instant, which any router
/// replica deciding without the others' picks sends to the same pod.
pub fn spread_clumps(at_us: &mut [u64]) {
    let mut i = 0;
    while i < at_us.len() {
        let t = at_us[i];
        let end = i + at_us[i..].iter().take_while(|&&a| a == t).count();
        let next = at_us.get(end).copied().unwrap_or(t + 1_000);
        let k = (end - i) as u64;
        for (n, a) in (0u64..).zip(&mut at_us[i..end]) {
            *a = t + (next - t) * n / k;
        }
        i = end;
    }
}

/// Tokens in block `i` of `r` (512, the last one partial).
fn block_len(r: &TraceRecord, i: usize) -> usize {
    let n = r.hash_ids.len();
    if i + 1 < n {
        TRACE_BLOCK_TOKENS
    } else {
        r.input_length as usize - TRACE_BLOCK_TOKENS * (n - 1)
    }
}

/// Finds a trace by file name: `$KV_ROUTER_TRACES/`, then the repository's `data/traces/`, then
/// `data/traces/` under the current directory, then the path as given.
pub fn find_trace(name: &str) -> Result<PathBuf> {
    let direct = PathBuf::from(name);
    if direct.is_file() {
        return Ok(direct);
    }
    let file = if name.ends_with(".jsonl") {
        name.to_string()
    } else {
        format!("mooncake_{name}_trace.jsonl")
    };
    let mut roots = Vec::new();
    if let Some(s) = std::env::var_os("KV_ROUTER_TRACES").filter(|v| !v.is_empty()) {
        roots.push(PathBuf::from(s));
    }
    roots.push(crate::data_dir().join("traces"));
    if let Ok(cwd) = std::env::current_dir() {
        roots.push(cwd.join("data/traces"));
    }
    for root in &roots {
        let p = root.join(&file);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "trace {name:?} not found (looked for {file} under {}; set KV_ROUTER_TRACES)",
        roots
            .iter()
            .map(|r| r.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// The id → token expansion of workloads.md §2.1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Expansion {
    /// XORed into every splitmix64 input.
    pub seed: u64,
    /// Smallest token id.
    pub lo: u32,
    /// Number of distinct token ids.
    pub span: u32,
}

impl Default for Expansion {
    fn default() -> Self {
        Self {
            seed: 0,
            lo: 1000,
            span: 100_000,
        }
    }
}

impl Expansion {
    /// Token `k` (0..512) of trace block `h`.
    pub fn token(&self, h: u64, k: usize) -> u32 {
        let x = self.seed ^ ((h << 9) | k as u64);
        self.lo + (SplitMix64::new(x).next_u64() % u64::from(self.span)) as u32
    }

    /// Appends the first `len` tokens of block `h`.
    pub fn extend_block(&self, h: u64, len: usize, out: &mut Vec<u32>) {
        out.extend((0..len.min(TRACE_BLOCK_TOKENS)).map(|k| self.token(h, k)));
    }

    /// The prompt of `r`: its blocks concatenated, the last truncated to `input_length`.
    pub fn prompt(&self, r: &TraceRecord) -> Vec<u32> {
        let mut out = Vec::with_capacity(r.input_length as usize);
        for (i, &h) in r.hash_ids.iter().enumerate() {
            self.extend_block(h, block_len(r, i), &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clumps_spread_evenly_until_the_next_arrival() {
        let mut at = vec![0, 0, 0, 3_000, 3_000, 4_000, 9_000, 9_000];
        spread_clumps(&mut at);
        assert_eq!(at, vec![0, 1_000, 2_000, 3_000, 3_500, 4_000, 9_000, 9_500]);
        let mut none: Vec<u64> = vec![];
        spread_clumps(&mut none);
    }

    #[test]
    fn expansion_matches_the_reference_values() {
        // workloads.md §2.1.
        let e = Expansion::default();
        let b0: Vec<u32> = (0..8).map(|k| e.token(0, k)).collect();
        assert_eq!(b0, [8535, 23465, 49110, 40053, 4978, 59618, 11592, 75487]);
        let b1: Vec<u32> = (0..8).map(|k| e.token(1, k)).collect();
        assert_eq!(b1, [28302, 65121, 62274, 12130, 73780, 43523, 4042, 27184]);
        let tail: Vec<u32> = (508..512).map(|k| e.token(182_789, k)).collect();
        assert_eq!(tail, [98237, 6755, 82715, 61693]);
    }

    #[test]
    fn prompts_share_exactly_their_common_ids() {
        let e = Expansion::default();
        let a = TraceRecord {
            timestamp: 0,
            input_length: 1100,
            output_length: 1,
            hash_ids: vec![0, 1, 2],
        };
        let b = TraceRecord {
            timestamp: 0,
            input_length: 600,
            output_length: 1,
            hash_ids: vec![0, 7],
        };
        let (pa, pb) = (e.prompt(&a), e.prompt(&b));
        assert_eq!(pa.len(), 1100);
        assert_eq!(pb.len(), 600);
        assert_eq!(pa[..512], pb[..512]);
        assert_ne!(pa[512..600], pb[512..600]);
    }

    #[test]
    fn shared_traces_load_with_the_documented_ideal_ratios() {
        // workloads.md §1.1: 0.374 (conversation) and 0.651 (synthetic) in tokens.
        for (name, requests, ideal) in [
            ("conversation", 12_031, 0.3736),
            ("synthetic", 3_993, 0.6512),
        ] {
            let t = Trace::load(&find_trace(name).unwrap()).unwrap();
            let s = t.stats();
            assert_eq!(s.requests, requests, "{name}");
            assert!((s.ideal_hit_tokens - ideal).abs() < 5e-4, "{name}: {s:?}");
        }
    }

    #[test]
    fn windows_rebase_time() {
        let rec = |t| TraceRecord {
            timestamp: t,
            input_length: 1,
            output_length: 1,
            hash_ids: vec![t],
        };
        let t = Trace {
            name: "t".into(),
            offset: 0,
            records: vec![rec(0), rec(5), rec(9)],
        };
        let w = t.window(1, 5);
        assert_eq!(w.records.len(), 2);
        assert_eq!((w.records[0].timestamp, w.records[1].timestamp), (0, 4));
        assert_eq!(w.records[1].hash_ids, [9]);
        assert_eq!(w.offset, 1);
        assert!(t.window(7, 2).records.is_empty());
        assert_eq!(t.window(0, 2).records.len(), 2);
    }

    #[test]
    fn bad_lines_are_reported_with_their_line_number() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\":0,\"input_length\":10,\"output_length\":1,\"hash_ids\":[0]}\n\
             {\"timestamp\":1,\"input_length\":600,\"output_length\":1,\"hash_ids\":[0]}\n",
        )
        .unwrap();
        let e = Trace::load(&p).unwrap_err().to_string();
        assert!(e.contains(":2:"), "{e}");
    }
}
