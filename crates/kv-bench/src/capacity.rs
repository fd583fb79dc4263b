//! `kv-bench capacity`: how many requests per second a fleet carries before TTFT breaks its
//! SLO, per routing strategy.
//!
//! One fleet of vllm-sim pods sized like a cache-bound deployment (KV blocks and running
//! requests per pod) serves the cache-pressure workload at Poisson arrivals, rung by rung up a
//! QPS ladder. At each rung every strategy runs back to back in an order rotated by rung and
//! round, on freshly reset caches and its own router stack (the processes `kv-bench compare`
//! starts), so the machine's noise at that moment hits all of them alike. A strategy's capacity
//! is the highest rung such that it and every lower rung kept the TTFT percentile within the
//! SLO ([`rule::capacity`]); repeated ladders give its spread.

pub mod render;
pub mod rule;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::compare::{stack::Stack, CompareFleet, CompareOptions};
use crate::strategy::Strategy;
use kv_testkit::cache_pressure::{CachePressureSpec, Tiers};
use kv_testkit::deploy::{self, Binaries};
use kv_testkit::runner::{self, RunOptions, RunResult};

/// `kv-bench capacity`'s flags.
#[derive(clap::Args, Debug, Clone)]
pub struct CapacityArgs {
    /// Envoy binary (default: $KV_ROUTER_ENVOY, .venv/bin/envoy, PATH).
    #[arg(long)]
    pub envoy: Option<PathBuf>,
    /// Simulated pods.
    #[arg(long, default_value_t = 8)]
    pub pods: usize,
    /// KV-cache blocks (16 tokens) per pod (`vllm-sim --num-gpu-blocks`).
    #[arg(long, default_value_t = 6000)]
    pub gpu_blocks: usize,
    /// Requests each pod runs at once; the rest wait (`vllm-sim --max-num-seqs`).
    #[arg(long, default_value_t = 8)]
    pub max_num_seqs: usize,
    /// Extra vllm-sim argument (repeatable), e.g. --sim-arg=--prefill-us-per-token=50.
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    pub sim_args: Vec<String>,
    /// Strategies, comma-separated (aggregated ones: not pd or precise-pd).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "round-robin,least-loaded,weighted,precise,predicted-ttft"
    )]
    pub strategies: Vec<Strategy>,
    /// The QPS ladder, comma-separated (run in ascending order).
    #[arg(long, value_delimiter = ',', default_value = "4,6,8,10,12,14,16")]
    pub qps: Vec<f64>,
    /// Measured seconds per rung: QPS x this many requests after the warm-up.
    #[arg(long, default_value_t = 60.0)]
    pub rung_s: f64,
    /// Measured requests per rung instead of --rung-s.
    #[arg(long)]
    pub rung_requests: Option<usize>,
    /// Seconds of arrivals at the rung's rate before the measured ones (not counted): the
    /// caches, reset before every run, fill with the hot groups first.
    #[arg(long, default_value_t = 10.0)]
    pub warmup_s: f64,
    /// Ladders to run; capacity is given as min / median / max over them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=20))]
    pub repeat: u64,
    /// The TTFT percentile the SLO holds (0–100].
    #[arg(long, default_value_t = 90.0)]
    pub percentile: f64,
    /// The SLO: TTFT at --percentile at most this, ms.
    #[arg(long, default_value_t = 500.0)]
    pub slo_ms: f64,
    /// Prefix groups of the cache-pressure workload.
    #[arg(long, default_value_t = 300)]
    pub groups: usize,
    /// Popularity tiers hot,warm,cold as GROUPS%:REQUESTS% each.
    #[arg(long, default_value = "10:60,30:30,60:10", value_parser = Tiers::parse)]
    pub tiers: Tiers,
    /// Prefix length of every group, tokens (4 bytes of text each).
    #[arg(long, default_value_t = 3072)]
    pub prefix_tokens: usize,
    /// Each request's own question after the prefix, tokens.
    #[arg(long, default_value_t = 128)]
    pub question_tokens: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 64)]
    pub output_tokens: u32,
    /// Model served by the pods and named in requests.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Seed of the prefixes, group draws, questions and arrival times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Per-request timeout, seconds (a request past it counts as failed: slower than any SLO).
    #[arg(long, default_value_t = 60)]
    pub timeout_s: u64,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the chart of TTFT at the percentile against QPS here (SVG).
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Print the table as markdown too.
    #[arg(long)]
    pub markdown: bool,
}

/// How long each rung runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum RungSize {
    /// Measured seconds of arrivals (QPS x seconds requests).
    Seconds {
        /// Seconds.
        seconds: f64,
    },
    /// Measured requests.
    Requests {
        /// Requests.
        requests: usize,
    },
}

/// What `kv-bench capacity` runs.
#[derive(Debug, Clone, Serialize)]
pub struct CapacityOptions {
    /// Envoy binary (None: [`deploy::find_envoy`] rules).
    #[serde(skip)]
    pub envoy: Option<PathBuf>,
    /// Simulated pods.
    pub pods: usize,
    /// KV blocks per pod.
    pub gpu_blocks: usize,
    /// Running requests per pod.
    pub max_num_seqs: usize,
    /// Extra vllm-sim arguments.
    pub sim_args: Vec<String>,
    /// Strategies, in their order at the first rung.
    pub strategies: Vec<Strategy>,
    /// Offered loads, ascending, distinct.
    pub ladder: Vec<f64>,
    /// Each rung's measured size.
    pub rung: RungSize,
    /// Seconds of unmeasured arrivals before each rung's measured ones.
    pub warmup_s: f64,
    /// Ladders.
    pub repeat: usize,
    /// The SLO's TTFT percentile.
    pub percentile: f64,
    /// The SLO, ms.
    pub slo_ms: f64,
    /// The workload (its request count, rate and stream seed are set per rung).
    pub workload: CachePressureSpec,
    /// Per-request timeout, seconds.
    pub timeout_s: u64,
    /// Progress lines on stderr.
    #[serde(skip)]
    pub progress: bool,
}

impl CapacityArgs {
    /// The run's options, checked.
    pub fn options(&self) -> Result<CapacityOptions> {
        let o = CapacityOptions {
            envoy: self.envoy.clone(),
            pods: self.pods,
            gpu_blocks: self.gpu_blocks,
            max_num_seqs: self.max_num_seqs,
            sim_args: self.sim_args.clone(),
            strategies: self.strategies.clone(),
            ladder: self.qps.clone(),
            rung: match self.rung_requests {
                Some(requests) => RungSize::Requests { requests },
                None => RungSize::Seconds {
                    seconds: self.rung_s,
                },
            },
            warmup_s: self.warmup_s,
            repeat: self.repeat as usize,
            percentile: self.percentile,
            slo_ms: self.slo_ms,
            workload: CachePressureSpec {
                groups: self.groups,
                tiers: self.tiers,
                prefix_tokens: self.prefix_tokens,
                question_tokens: self.question_tokens,
                output_tokens: self.output_tokens,
                model: self.model.clone(),
                seed: self.seed,
                ..Default::default()
            },
            timeout_s: self.timeout_s,
            progress: true,
        };
        o.checked()
    }
}

impl CapacityOptions {
    /// These options with the ladder sorted, or why they cannot run.
    pub fn checked(mut self) -> Result<Self> {
        anyhow::ensure!(
            self.pods > 0 && self.gpu_blocks > 0 && self.max_num_seqs > 0,
            "--pods, --gpu-blocks and --max-num-seqs take positive numbers"
        );
        anyhow::ensure!(
            !self.ladder.is_empty() && self.ladder.iter().all(|q| q.is_finite() && *q > 0.0),
            "--qps takes positive rates"
        );
        self.ladder.sort_by(f64::total_cmp);
        self.ladder.dedup();
        anyhow::ensure!(!self.strategies.is_empty(), "--strategies names none");
        for (i, s) in self.strategies.iter().enumerate() {
            anyhow::ensure!(
                !s.disaggregates(),
                "{}: capacity runs an aggregated fleet (no prefill/decode roles)",
                s.as_str()
            );
            anyhow::ensure!(
                !self.strategies[..i].contains(s),
                "{} is named twice in --strategies",
                s.as_str()
            );
        }
        anyhow::ensure!(
            self.percentile > 0.0 && self.percentile <= 100.0,
            "--percentile {} is not in (0, 100]",
            self.percentile
        );
        anyhow::ensure!(
            self.slo_ms.is_finite() && self.slo_ms > 0.0,
            "--slo-ms takes a positive number"
        );
        anyhow::ensure!(
            self.warmup_s.is_finite() && self.warmup_s >= 0.0,
            "--warmup-s takes a non-negative number"
        );
        match self.rung {
            RungSize::Seconds { seconds } => anyhow::ensure!(
                seconds.is_finite() && seconds > 0.0,
                "--rung-s takes a positive number"
            ),
            RungSize::Requests { requests } => {
                anyhow::ensure!(requests > 0, "--rung-requests takes a positive number")
            }
        }
        anyhow::ensure!(self.repeat > 0, "--repeat takes a positive number");
        self.workload.rate = self.ladder[0];
        self.workload.check().map_err(anyhow::Error::msg)?;
        Ok(self)
    }

    /// (warm-up, measured) requests of a rung at `qps`.
    pub fn requests(&self, qps: f64) -> (usize, usize) {
        let warm = (qps * self.warmup_s).round() as usize;
        let measured = match self.rung {
            RungSize::Seconds { seconds } => ((qps * seconds).round() as usize).max(1),
            RungSize::Requests { requests } => requests,
        };
        (warm, measured)
    }

    /// The workload of rung `rung` of ladder `round`: its own request stream, the same for
    /// every strategy there (paired), another for every other rung and round.
    pub fn spec(&self, round: usize, rung: usize) -> CachePressureSpec {
        let qps = self.ladder[rung];
        let (warm, measured) = self.requests(qps);
        CachePressureSpec {
            requests: warm + measured,
            rate: qps,
            stream_seed: self
                .workload
                .seed
                .wrapping_mul(1_000_003)
                .wrapping_add((round * self.ladder.len() + rung) as u64),
            ..self.workload.clone()
        }
    }

    /// The fleet in one sentence.
    pub fn fleet_line(&self) -> String {
        let extra = match self.sim_args.is_empty() {
            true => "vllm-sim's default speeds".to_string(),
            false => format!("`{}`", self.sim_args.join(" ")),
        };
        format!(
            "{} vllm-sim pods x {} KV blocks of 16 tokens, max-num-seqs {}, {extra}",
            self.pods, self.gpu_blocks, self.max_num_seqs
        )
    }
}

/// One strategy's run at one rung of one ladder.
#[derive(Debug, Clone, Serialize)]
pub struct RungRun {
    /// The strategy.
    pub strategy: Strategy,
    /// Its ladder, from 1.
    pub round: usize,
    /// Offered load, requests per second.
    pub qps: f64,
    /// Requests measured (after the warm-up).
    pub measured: usize,
    /// Of them, failed ones (error status, transport error, timeout, incomplete stream).
    pub errors: usize,
    /// Measured requests over the span of their send times, per second.
    pub achieved_qps: f64,
    /// TTFT at the report's percentile, failures counted as slower than any SLO, ms (null when
    /// failures reach the percentile).
    pub ttft_ms: f64,
    /// TTFT p50 of the same requests, ms.
    pub ttft_p50_ms: f64,
    /// Cached / prompt tokens of the measured requests that succeeded.
    pub hit_ratio: f64,
    /// Whether the rung met the SLO.
    pub passes: bool,
}

impl RungRun {
    /// The measured part of `run` (requests from the `warm`-th of the stream on).
    pub fn of(
        strategy: Strategy,
        round: usize,
        qps: f64,
        warm: usize,
        run: &RunResult,
        o: &CapacityOptions,
    ) -> Self {
        let measured: Vec<_> = run
            .records
            .iter()
            .filter(|r| CachePressureSpec::ordinal(&r.session).is_some_and(|n| n >= warm))
            .collect();
        let ttfts: Vec<Option<f64>> = measured
            .iter()
            .map(|r| r.ttft_ms.filter(|_| r.error.is_none()))
            .collect();
        let starts: Vec<f64> = measured.iter().map(|r| r.start_ms).collect();
        let span_s = match (starts.first(), starts.last()) {
            (Some(a), Some(b)) if b > a => (b - a) / 1e3,
            _ => f64::NAN,
        };
        let ok = measured.iter().filter(|r| r.error.is_none());
        let (cached, prompt) = ok.fold((0u64, 0u64), |(c, p), r| {
            (
                c + r.cached_tokens.unwrap_or(0),
                p + r.prompt_tokens.unwrap_or(0),
            )
        });
        let ttft_ms = rule::ttft_percentile(&ttfts, o.percentile);
        Self {
            strategy,
            round,
            qps,
            measured: measured.len(),
            errors: measured.iter().filter(|r| r.error.is_some()).count(),
            achieved_qps: (measured.len().saturating_sub(1)) as f64 / span_s,
            ttft_ms,
            ttft_p50_ms: rule::ttft_percentile(&ttfts, 50.0),
            hit_ratio: cached as f64 / prompt.max(1) as f64,
            passes: rule::passes(ttft_ms, o.slo_ms),
        }
    }
}

/// One strategy's capacity over the ladders.
#[derive(Debug, Clone, Serialize)]
pub struct StrategyCapacity {
    /// The strategy.
    pub strategy: Strategy,
    /// Its capacity in each ladder (null: the lowest rung failed).
    pub per_round: Vec<Option<f64>>,
    /// Min / median / max of `per_round`.
    pub spread: Option<rule::Spread>,
    /// Per rung, ascending.
    pub rungs: Vec<RungMedian>,
}

/// One strategy at one rung over the ladders.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RungMedian {
    /// Offered load.
    pub qps: f64,
    /// The median over the ladders of the TTFT percentile, ms (lower middle of an even count).
    pub ttft_ms: f64,
    /// Ladders in which the rung met the SLO.
    pub passed: usize,
}

/// Everything `kv-bench capacity` measured.
#[derive(Debug, Clone, Serialize)]
pub struct CapacityReport {
    /// The workload's parameters.
    pub workload: String,
    /// The fleet.
    pub fleet: String,
    /// The options it ran with.
    pub options: CapacityOptions,
    /// Every run, in run order.
    pub runs: Vec<RungRun>,
    /// Per strategy, in the options' order.
    pub capacities: Vec<StrategyCapacity>,
}

impl CapacityReport {
    /// The report of `runs` under `o`.
    pub fn new(o: &CapacityOptions, workload: String, runs: Vec<RungRun>) -> Self {
        let capacities = o
            .strategies
            .iter()
            .map(|&s| {
                let mine: Vec<&RungRun> = runs.iter().filter(|r| r.strategy == s).collect();
                let per_round: Vec<Option<f64>> = (1..=o.repeat)
                    .map(|round| {
                        let points: Vec<rule::RungPoint> = mine
                            .iter()
                            .filter(|r| r.round == round)
                            .map(|r| rule::RungPoint {
                                qps: r.qps,
                                ttft_ms: r.ttft_ms,
                            })
                            .collect();
                        rule::capacity(&points, o.slo_ms)
                    })
                    .collect();
                let rungs = o
                    .ladder
                    .iter()
                    .map(|&q| {
                        let at: Vec<&&RungRun> = mine.iter().filter(|r| r.qps == q).collect();
                        let t: Vec<f64> = at.iter().map(|r| r.ttft_ms).collect();
                        RungMedian {
                            qps: q,
                            ttft_ms: lower_median(&t),
                            passed: at.iter().filter(|r| r.passes).count(),
                        }
                    })
                    .collect();
                StrategyCapacity {
                    strategy: s,
                    spread: rule::spread(&per_round),
                    per_round,
                    rungs,
                }
            })
            .collect();
        Self {
            workload,
            fleet: o.fleet_line(),
            options: o.clone(),
            runs,
            capacities,
        }
    }
}

/// The lower middle of `v` (NaN sorted last, infinity as a value); NaN when empty.
fn lower_median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(f64::NAN)
}

/// The (round, rung, strategy) order of every run: rungs ascending within a ladder, and at each
/// rung all strategies back to back, rotated by one per rung and per round so no strategy
/// always runs first.
pub fn run_order(strategies: usize, rungs: usize, rounds: usize) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::with_capacity(strategies * rungs * rounds);
    for round in 0..rounds {
        for rung in 0..rungs {
            for k in 0..strategies {
                out.push((round, rung, (k + round + rung) % strategies));
            }
        }
    }
    out
}

/// Runs every ladder on one fleet.
pub async fn run(bins: &Binaries, o: &CapacityOptions) -> Result<CapacityReport> {
    let mut sim_args = o.sim_args.clone();
    sim_args.push(format!("--max-num-seqs={}", o.max_num_seqs));
    let copts = CompareOptions {
        strategies: o.strategies.clone(),
        request_timeout: Duration::from_secs(o.timeout_s),
        progress: o.progress,
        ..CompareOptions::fleet(
            o.envoy.clone(),
            o.pods,
            o.gpu_blocks,
            sim_args,
            o.workload.model.clone(),
        )
    };
    let redis = match o.strategies.iter().any(|s| s.needs_redis()) {
        true => Some(deploy::find_redis_server()?),
        false => None,
    };
    let fleet = CompareFleet::start(bins, &copts).await?;
    let base = fleet.base_config()?;
    let addrs = fleet.addrs();
    // The arrivals are each rung's own (the notes say so), not the first rung's.
    let built = o.spec(0, 0).build().description;
    let workload = built
        .split("; Poisson")
        .next()
        .unwrap_or(&built)
        .to_string();
    let mut runs = Vec::new();
    let order = run_order(o.strategies.len(), o.ladder.len(), o.repeat);
    for (i, &(round, rung, k)) in order.iter().enumerate() {
        let strategy = o.strategies[k];
        let qps = o.ladder[rung];
        deploy::reset_caches(&addrs)
            .await
            .context("resetting pod caches")?;
        // The strategy's routers and Envoy live for this run only (dropping them stops them).
        let stack = match strategy {
            Strategy::RoundRobin => None,
            _ => Some(
                Stack::start(
                    bins,
                    &fleet,
                    strategy.router_config(&base, &o.workload.model),
                    strategy.default_replicas(),
                    redis.as_deref().filter(|_| strategy.needs_redis()),
                )
                .await
                .with_context(|| format!("starting {}", strategy.as_str()))?,
            ),
        };
        let target = stack
            .as_ref()
            .map_or_else(|| fleet.round_robin_url(), Stack::envoy_url);
        let spec = o.spec(round, rung);
        let (warm, _) = o.requests(qps);
        let label = format!("{} {qps} QPS #{}", strategy.as_str(), round + 1);
        let mut result = runner::run(
            spec.build(),
            &RunOptions {
                target,
                concurrency: None,
                request_timeout: Duration::from_secs(o.timeout_s),
                label: label.clone(),
                progress: o.progress,
            },
        )
        .await?;
        result.sent = Vec::new();
        drop(stack);
        let r = RungRun::of(strategy, round + 1, qps, warm, &result, o);
        if o.progress {
            eprintln!(
                "kv-bench capacity [{}/{}] {label}: TTFT p{} {} ({}), p50 {:.0} ms, {} requests, \
                 {} errors, hits {:.1} %",
                i + 1,
                order.len(),
                o.percentile,
                render::ms(r.ttft_ms),
                if r.passes { "meets the SLO" } else { "misses" },
                r.ttft_p50_ms,
                r.measured,
                r.errors,
                r.hit_ratio * 100.0
            );
        }
        runs.push(r);
    }
    Ok(CapacityReport::new(o, workload, runs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: CapacityArgs,
    }

    fn options(args: &[&str]) -> Result<CapacityOptions> {
        let mut argv = vec!["capacity"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .a
            .options()
    }

    #[test]
    fn defaults_are_the_cache_bound_fleet_and_ladder() {
        let o = options(&[]).unwrap();
        assert_eq!((o.pods, o.gpu_blocks, o.max_num_seqs), (8, 6000, 8));
        assert_eq!(o.ladder, [4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0]);
        assert_eq!((o.percentile, o.slo_ms), (90.0, 500.0));
        let names: Vec<&str> = o.strategies.iter().map(|s| s.as_str()).collect();
        assert_eq!(
            names,
            [
                "round-robin",
                "least-loaded",
                "weighted",
                "precise",
                "predicted-ttft"
            ]
        );
        assert_eq!(o.workload.groups, 300);
        // 10 s warm-up and 60 s measured at 4 QPS.
        assert_eq!(o.requests(4.0), (40, 240));
    }

    #[test]
    fn bad_flags_are_refused_with_reasons() {
        let err = |a: &[&str]| format!("{:#}", options(a).unwrap_err());
        assert!(err(&["--qps", "4,0"]).contains("positive rates"));
        assert!(err(&["--strategies", "pd"]).contains("aggregated fleet"));
        assert!(err(&["--strategies", "weighted,weighted"]).contains("named twice"));
        assert!(err(&["--percentile", "0"]).contains("(0, 100]"));
        assert!(err(&["--slo-ms", "0"]).contains("positive"));
        assert!(err(&["--tiers", "10:60,30:30"]).contains("tiers"));
        assert!(err(&["--groups", "2"]).contains("hot tier"));
        assert!(err(&["--rung-requests", "0"]).contains("positive"));
        let o = options(&["--qps", "8,4,8", "--rung-requests", "5", "--warmup-s", "0"]).unwrap();
        assert_eq!(o.ladder, [4.0, 8.0], "sorted, deduplicated");
        assert_eq!(o.requests(8.0), (0, 5));
    }

    #[test]
    fn strategies_share_each_rungs_stream_and_rotate() {
        let o = options(&["--qps", "4,8"]).unwrap();
        let a = o.spec(0, 1);
        assert_eq!((a.rate, a.requests), (8.0, 80 + 480));
        assert_eq!(a.stream_seed, o.spec(0, 1).stream_seed);
        assert_ne!(a.stream_seed, o.spec(0, 0).stream_seed);
        assert_ne!(a.stream_seed, o.spec(1, 1).stream_seed);
        let order = run_order(3, 2, 2);
        assert_eq!(order.len(), 12);
        let firsts: Vec<usize> = order.chunks(3).map(|c| c[0].2).collect();
        assert_eq!(firsts, [0, 1, 1, 2], "who goes first rotates");
        for c in order.chunks(3) {
            let mut s: Vec<usize> = c.iter().map(|x| x.2).collect();
            s.sort();
            assert_eq!(s, [0, 1, 2], "every strategy at every rung");
            assert!(c.iter().all(|x| (x.0, x.1) == (c[0].0, c[0].1)));
        }
    }

    /// The report applies the rule to each ladder's own rungs: strategy `b`, slower everywhere,
    /// carries less.
    #[test]
    fn reports_rate_each_ladder_by_the_rule() {
        let o = options(&[
            "--qps",
            "4,8,12",
            "--repeat",
            "2",
            "--strategies",
            "weighted,round-robin",
        ])
        .unwrap();
        let run = |s, round, qps, ttft_ms: f64| RungRun {
            strategy: s,
            round,
            qps,
            measured: 10,
            errors: 0,
            achieved_qps: qps,
            ttft_ms,
            ttft_p50_ms: ttft_ms / 2.0,
            hit_ratio: 0.5,
            passes: rule::passes(ttft_ms, o.slo_ms),
        };
        let mut runs = Vec::new();
        for round in 1..=2 {
            for (q, t) in [(4.0, 200.0), (8.0, 300.0), (12.0, 450.0)] {
                runs.push(run(Strategy::Weighted, round, q, t));
                runs.push(run(Strategy::RoundRobin, round, q, t * 1.5));
            }
        }
        let r = CapacityReport::new(&o, "w".into(), runs);
        let (w, rr) = (&r.capacities[0], &r.capacities[1]);
        assert_eq!(w.per_round, [Some(12.0), Some(12.0)]);
        assert_eq!(rr.per_round, [Some(8.0), Some(8.0)]);
        let at = |c: &StrategyCapacity, i: usize| {
            (c.rungs[i].qps, c.rungs[i].ttft_ms, c.rungs[i].passed)
        };
        assert_eq!(at(rr, 2), (12.0, 675.0, 0));
        assert_eq!(at(w, 0), (4.0, 200.0, 2));
        let s = rr.spread.unwrap();
        assert_eq!((s.min, s.median, s.max), (Some(8.0), Some(8.0), Some(8.0)));
    }
}
