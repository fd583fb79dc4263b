//! Paired rounds on record: `compare --repeat N --pool FILE` appends each round of a
//! shared-index strategy and its baseline to FILE, then judges the goal over every round there
//! of the same workload, sim flags, machine kind and [`EPOCH`].
//!
//! Why: on a saturated 2-core machine one round's hit difference spreads by ~5 points of pooled
//! and its TTFT p99 ratio by 7–14 %, so eight rounds decide a 1-point or 5 % goal about as often
//! as a coin; rounds made back to back pair the two strategies, so the rounds of several
//! invocations of one command pool into one estimate. The file is plain TSV, one round a line,
//! so what the pooled line rests on can be read, diffed and traced to its invocation.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::compare::Comparison;
use super::paired;

/// Rounds of different epochs never pool: bump it with any change that moves what the router
/// decides for either strategy (1: the busy-scrape fix `4e3968b` and everything since).
pub const EPOCH: u32 = 1;
/// The file's header (its first line).
pub const HEADER: &str = "epoch\tmachine\tworkload\tsim\tstrategy\tbaseline\tsource\tround\t\
     strategy_hit_pooled_pct\tbaseline_hit_pooled_pct\tstrategy_ttft_p99_ms\t\
     baseline_ttft_p99_ms\tfallbacks";
/// A record larger than this is not one this tool wrote (about 50,000 rounds).
const MAX_FILE: u64 = 16 << 20;

/// One paired round: a shared-index strategy's run and the baseline's in the same round.
#[derive(Debug, Clone, PartialEq)]
pub struct Round {
    /// [`EPOCH`] when it ran.
    pub epoch: u32,
    /// The machine kind ([`machine_kind`]): rounds of other machines do not pool.
    pub machine: String,
    /// The section's workload and fleet line (`Workload: … Fleet: …`).
    pub workload: String,
    /// The `--sim-arg` values, space-separated.
    pub sim: String,
    /// The strategy's label without its round (`redis x4`).
    pub strategy: String,
    /// The baseline's (`weighted`).
    pub baseline: String,
    /// The invocation it came from (UTC minute and router revision, or a file on record).
    pub source: String,
    /// Its round in that invocation.
    pub round: usize,
    /// The strategy's hit ratio as a share of the pooled oracle's, %.
    pub strategy_hit: f64,
    /// The baseline's, %.
    pub baseline_hit: f64,
    /// The strategy's TTFT p99, ms.
    pub strategy_p99_ms: f64,
    /// The baseline's, ms.
    pub baseline_p99_ms: f64,
    /// Lookups that fell back in the strategy's run (None: not recorded).
    pub fallbacks: Option<u64>,
}

impl Round {
    /// Whether `other` pools with this one: same epoch, machine, workload, sim, strategies.
    fn pools_with(&self, other: &Round) -> bool {
        (self.epoch, &self.machine, &self.workload, &self.sim)
            == (other.epoch, &other.machine, &other.workload, &other.sim)
            && (&self.strategy, &self.baseline) == (&other.strategy, &other.baseline)
    }

    fn line(&self) -> String {
        // Tabs and newlines would split a field; nothing this tool writes has them.
        let clean = |s: &str| s.replace(['\t', '\n', '\r'], " ");
        format!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{:.4}\t{:.4}\t{:.2}\t{:.2}\t{}",
            self.epoch,
            clean(&self.machine),
            clean(&self.workload),
            clean(&self.sim),
            clean(&self.strategy),
            clean(&self.baseline),
            clean(&self.source),
            self.round,
            self.strategy_hit,
            self.baseline_hit,
            self.strategy_p99_ms,
            self.baseline_p99_ms,
            self.fallbacks.map_or("-".to_string(), |f| f.to_string()),
        )
    }

    fn parse(line: &str) -> Result<Self> {
        let f: Vec<&str> = line.split('\t').collect();
        let [epoch, machine, workload, sim, strategy, baseline, source, round, sh, bh, sp, bp, fb] =
            f.as_slice()
        else {
            bail!("{} fields where the header names 13", f.len());
        };
        let num = |name: &str, v: &str| -> Result<f64> {
            let x: f64 = v
                .parse()
                .with_context(|| format!("{name} {v:?} is not a number"))?;
            anyhow::ensure!(x.is_finite() && x >= 0.0, "{name} {v:?} is not a figure");
            Ok(x)
        };
        // A ratio's divisor: a p99 of 0 ms is no run's.
        let positive = |name: &str, v: &str| -> Result<f64> {
            let x = num(name, v)?;
            anyhow::ensure!(x > 0.0, "{name} {v:?} is not a latency");
            Ok(x)
        };
        Ok(Self {
            epoch: epoch.parse().with_context(|| format!("epoch {epoch:?}"))?,
            machine: machine.to_string(),
            workload: workload.to_string(),
            sim: sim.to_string(),
            strategy: strategy.to_string(),
            baseline: baseline.to_string(),
            source: source.to_string(),
            round: round.parse().with_context(|| format!("round {round:?}"))?,
            strategy_hit: num("strategy_hit_pooled_pct", sh)?,
            baseline_hit: num("baseline_hit_pooled_pct", bh)?,
            strategy_p99_ms: positive("strategy_ttft_p99_ms", sp)?,
            baseline_p99_ms: positive("baseline_ttft_p99_ms", bp)?,
            fallbacks: match *fb {
                "-" => None,
                n => Some(n.parse().with_context(|| format!("fallbacks {n:?}"))?),
            },
        })
    }
}

/// Every round of a record's text (header, `#` comments and blank lines skipped).
pub fn parse(text: &str) -> Result<Vec<Round>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() || line.starts_with('#') || line == HEADER {
            continue;
        }
        out.push(Round::parse(line).with_context(|| format!("line {}", i + 1))?);
    }
    Ok(out)
}

/// The record at `path` (none yet: empty).
pub fn read(path: &Path) -> Result<Vec<Round>> {
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    anyhow::ensure!(
        len <= MAX_FILE,
        "{} is {len} bytes: not a record of paired rounds",
        path.display()
    );
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text).with_context(|| format!("in {}", path.display()))
}

/// Appends `rounds` to the record at `path` (created with its header) and returns every round
/// it now holds.
pub fn append(path: &Path, rounds: &[Round]) -> Result<Vec<Round>> {
    let mut all = read(path)?;
    let mut text = if path.exists() {
        String::new()
    } else {
        format!("{HEADER}\n")
    };
    for r in rounds {
        text.push_str(&r.line());
        text.push('\n');
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    use std::io::Write;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .with_context(|| format!("writing {}", path.display()))?;
    all.extend_from_slice(rounds);
    Ok(all)
}

/// This machine as the record names it: CPU, cores and memory, without the kernel (rounds of
/// one VM kind pool across its reboots, never with another kind's).
pub fn machine_kind() -> String {
    let m = super::results::machine();
    m.split(", Linux").next().unwrap_or(&m).to_string()
}

/// The UTC minute `secs` after the epoch, `2026-12-01T22:40Z`.
pub fn utc_minute(secs: u64) -> String {
    kv_router::tokenize::strftime_utc("%Y-%m-%dT%H:%MZ", i64::try_from(secs).unwrap_or(i64::MAX))
}

/// The paired rounds of every shared-index strategy of `cmp` (the runs that report fallbacks)
/// against the baseline, as records of `source`.
pub fn rounds_of(cmp: &Comparison, sim: &[String], machine: &str, source: &str) -> Vec<Round> {
    let summaries = cmp.summaries();
    let workload = cmp.workload_line();
    let fallbacks = |label: &str| cmp.runs.iter().find(|r| r.label == label)?.redis_fallbacks;
    let mut out = Vec::new();
    for p in paired::pairings(&summaries) {
        for &(round, ss, bs) in &p.runs {
            let Some(fb) = fallbacks(&ss.label) else {
                continue;
            };
            let figures = [
                ss.vs_pooled(),
                bs.vs_pooled(),
                ss.ttft_p99_ms,
                bs.ttft_p99_ms,
            ];
            if figures.iter().any(|x| !x.is_finite()) {
                continue;
            }
            out.push(Round {
                epoch: EPOCH,
                machine: machine.to_string(),
                workload: workload.clone(),
                sim: sim.join(" "),
                strategy: p.name.to_string(),
                baseline: p.base.to_string(),
                source: source.to_string(),
                round,
                strategy_hit: figures[0] * 100.0,
                baseline_hit: figures[1] * 100.0,
                strategy_p99_ms: figures[2],
                baseline_p99_ms: figures[3],
                fallbacks: Some(fb),
            });
        }
    }
    out
}

/// For each strategy among `new`, the goal judged over every round of `all` that pools with
/// it, one line each; `record` names the file in the text.
pub fn verdicts(all: &[Round], new: &[Round], record: &str) -> String {
    let mut done: Vec<&Round> = Vec::new();
    let mut out = String::new();
    for r in new {
        if done.iter().any(|d| d.pools_with(r)) {
            continue;
        }
        done.push(r);
        let pooled: Vec<&Round> = all.iter().filter(|x| x.pools_with(r)).collect();
        let hits: Vec<f64> = pooled
            .iter()
            .map(|x| x.strategy_hit - x.baseline_hit)
            .collect();
        let ln: Vec<f64> = pooled
            .iter()
            .map(|x| (x.strategy_p99_ms / x.baseline_p99_ms).ln())
            .collect();
        let sources: BTreeSet<&str> = pooled.iter().map(|x| x.source.as_str()).collect();
        let recorded: Vec<u64> = pooled.iter().filter_map(|x| x.fallbacks).collect();
        let fell: u64 = recorded.iter().sum();
        let fallbacks = match recorded.len() == pooled.len() {
            true => format!("{fell} lookups fell back"),
            false => format!(
                "{fell} lookups fell back in the {} rounds that recorded them",
                recorded.len()
            ),
        };
        let _ = write!(
            out,
            "Pooled with every round on record for this window, machine kind and epoch {EPOCH} \
             (`{record}`: {} rounds from {} invocation{}, this one's {} among them), goal \
             for `{}` against `{}` ({}): {}.{}",
            pooled.len(),
            sources.len(),
            if sources.len() == 1 { "" } else { "s" },
            new.iter().filter(|x| x.pools_with(r)).count(),
            r.strategy,
            r.baseline,
            paired::goal_terms(),
            paired::judge(&hits, &ln, &fallbacks, fell > 0),
            paired::precision(&hits, &ln),
        );
        out.push('\n');
    }
    out
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
