//! `kv-bench lora`: a multi-adapter workload on a LoRA fleet. 8 vllm-sim pods with
//! `--enable-lora --max-loras 4` serve 32 adapters; each request names an adapter drawn by Zipf
//! popularity (seeded). The same requests go through Envoy and kv-router twice per round: with
//! the LoRA scorer (`scorers.lora.weight` 2.0, the default) and without it (weight 0). Reported
//! per arm: adapter loads and evictions per 1,000 requests (the pods' own
//! `vllm_sim:lora_loads_total` / `vllm_sim:lora_evictions_total` over the run), TTFT p50/p99.
//! Every arm gets a fresh fleet, so every arm starts with no adapter loaded and a cold cache.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use serde_json::{json, Value};

use super::compare::stack::Stack;
use super::compare::{CompareFleet, CompareOptions};
use super::report::Summary;
use super::strategy::Strategy;
use kv_testkit::deploy::Binaries;
use kv_testkit::prose::prose_tokens;
use kv_testkit::runner::{self, RunOptions};
use kv_testkit::splitmix::SplitMix64;
use kv_testkit::workload::{Api, PlannedRequest, Previous, Session, Workload};

/// The base model the pods serve.
pub const BASE_MODEL: &str = "base-model";

/// `kv-bench lora` flags.
#[derive(Debug, Clone, Args)]
pub struct LoraArgs {
    /// Simulated pods.
    #[arg(long, default_value_t = 8)]
    pub pods: usize,
    /// Adapters every pod can serve (`--lora-modules`).
    #[arg(long, default_value_t = 32)]
    pub adapters: usize,
    /// Adapter slots per pod (`--max-loras`).
    #[arg(long, default_value_t = 4)]
    pub max_loras: usize,
    /// Adapter load time (`--lora-load-ms`).
    #[arg(long, default_value_t = 50.0)]
    pub lora_load_ms: f64,
    /// Requests per arm.
    #[arg(long, default_value_t = 480)]
    pub requests: usize,
    /// Poisson arrival rate, requests per second.
    #[arg(long, default_value_t = 40.0)]
    pub rate: f64,
    /// Zipf exponent of adapter popularity.
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Rounds (each runs both arms, alternating which goes first).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Seed of the adapters drawn, the prompts and the arrival times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Envoy binary (default: the usual search).
    #[arg(long)]
    pub envoy: Option<std::path::PathBuf>,
}

impl LoraArgs {
    fn workload(&self) -> LoraWorkload {
        LoraWorkload {
            adapters: self.adapters.max(1),
            requests: self.requests,
            rate: self.rate,
            zipf: self.zipf,
            seed: self.seed,
            system_tokens: 64,
            question_tokens: 192,
            max_tokens: 16,
        }
    }
}

/// Adapter `i`'s name.
pub fn adapter_name(i: usize) -> String {
    format!("adapter-{i:02}")
}

/// A Zipf distribution over ranks `0..n`: P(k) ∝ 1 / (k + 1)^s.
#[derive(Debug, Clone)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// Over `n` ranks (at least 1) with exponent `s`.
    pub fn new(n: usize, s: f64) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (0..n.max(1))
            .map(|k| {
                acc += 1.0 / ((k + 1) as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Self { cdf }
    }

    /// A rank drawn with `rng`.
    pub fn sample(&self, rng: &mut SplitMix64) -> usize {
        let u = rng.unit();
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1)
    }
}

/// The workload: single-request sessions at Poisson times, each for a Zipf-drawn adapter, with
/// the adapter's own short system prompt then a unique question.
#[derive(Debug, Clone, Serialize)]
pub struct LoraWorkload {
    /// Adapters to draw from.
    pub adapters: usize,
    /// Requests.
    pub requests: usize,
    /// Arrivals per second.
    pub rate: f64,
    /// Zipf exponent.
    pub zipf: f64,
    /// Seed.
    pub seed: u64,
    /// Per-adapter system prompt, tokens.
    pub system_tokens: usize,
    /// Unique question, tokens.
    pub question_tokens: usize,
    /// Output tokens.
    pub max_tokens: u32,
}

/// One planned request.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraRequest {
    /// Adapter index.
    pub adapter: usize,
    /// Send time from the start.
    pub at: Duration,
    /// Prompt text.
    pub prompt: String,
}

impl LoraWorkload {
    /// The requests, deterministic under the seed.
    pub fn plan(&self) -> Vec<LoraRequest> {
        let zipf = Zipf::new(self.adapters, self.zipf);
        let mut pick = SplitMix64::derive(self.seed, "lora-adapter", 0);
        let mut gaps = SplitMix64::derive(self.seed, "lora-arrival", 0);
        let systems: Vec<String> = (0..self.adapters)
            .map(|a| {
                let mut rng = SplitMix64::derive(self.seed, "lora-system", a as u64);
                prose_tokens(&mut rng, self.system_tokens)
            })
            .collect();
        let mut t = 0.0f64;
        (0..self.requests)
            .map(|i| {
                let adapter = zipf.sample(&mut pick);
                let at = Duration::from_secs_f64(t);
                t += -(1.0 - gaps.unit()).ln() / self.rate.max(1e-9);
                let mut q = SplitMix64::derive(self.seed, "lora-question", i as u64);
                let prompt = format!(
                    "{}{}",
                    systems[adapter],
                    prose_tokens(&mut q, self.question_tokens)
                );
                LoraRequest {
                    adapter,
                    at,
                    prompt,
                }
            })
            .collect()
    }

    /// The runnable workload.
    pub fn build(&self) -> Workload {
        let sessions: Vec<Box<dyn Session>> = self
            .plan()
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                Box::new(Once {
                    id: format!("lora-{}-{i}", self.seed),
                    request: Some(PlannedRequest {
                        api: Api::Completions,
                        body: json!({
                            "model": adapter_name(r.adapter),
                            "prompt": Value::String(r.prompt),
                            "stream": true,
                            "stream_options": {"include_usage": true},
                            "max_tokens": self.max_tokens.max(1),
                            "ignore_eos": true,
                        }),
                        headers: Vec::new(),
                        turn: 0,
                        not_before: Some(r.at),
                        think: None,
                    }),
                }) as Box<dyn Session>
            })
            .collect();
        Workload {
            name: "lora".into(),
            description: format!(
                "{} requests at {}/s over {} adapters (Zipf s={}), system {} / question {} / \
                 output {} tokens, seed {}",
                self.requests,
                self.rate,
                self.adapters,
                self.zipf,
                self.system_tokens,
                self.question_tokens,
                self.max_tokens,
                self.seed
            ),
            requests: sessions.len(),
            sessions,
        }
    }
}

struct Once {
    id: String,
    request: Option<PlannedRequest>,
}

impl Session for Once {
    fn id(&self) -> &str {
        &self.id
    }

    fn next_request(&mut self, _previous: Option<Previous<'_>>) -> Option<PlannedRequest> {
        self.request.take()
    }
}

/// One arm of one round.
#[derive(Debug, Clone, Serialize)]
pub struct ArmResult {
    /// `lora-scorer #1`, `no-lora-scorer #2`…
    pub label: String,
    /// `scorers.lora.weight`.
    pub lora_weight: f64,
    /// Requests sent.
    pub requests: usize,
    /// Failed requests.
    pub errors: usize,
    /// Adapter loads per 1,000 requests.
    pub loads_per_1k: f64,
    /// Adapter evictions per 1,000 requests.
    pub evictions_per_1k: f64,
    /// TTFT p50, ms.
    pub ttft_p50_ms: f64,
    /// TTFT p99, ms.
    pub ttft_p99_ms: f64,
    /// Prefix-cache hit rate.
    pub hit_rate: f64,
}

/// Sum over pods of `vllm_sim:lora_loads_total` and `vllm_sim:lora_evictions_total`.
async fn lora_counters(pods: &[SocketAddr]) -> Result<(f64, f64)> {
    let client = runner::client();
    let (mut loads, mut evictions) = (0.0, 0.0);
    for p in pods {
        let text = client
            .get(format!("http://{p}/metrics"))
            .send()
            .await
            .with_context(|| format!("scraping {p}"))?
            .text()
            .await?;
        let (l, e) = parse_lora_counters(&text);
        loads += l;
        evictions += e;
    }
    Ok((loads, evictions))
}

/// `(loads, evictions)` from one pod's `/metrics`.
pub fn parse_lora_counters(text: &str) -> (f64, f64) {
    let mut out = (0.0, 0.0);
    for line in text.lines() {
        let value = || {
            line.rsplit_once(' ')
                .and_then(|(_, v)| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        if line.starts_with("vllm_sim:lora_loads_total") {
            out.0 += value();
        } else if line.starts_with("vllm_sim:lora_evictions_total") {
            out.1 += value();
        }
    }
    out
}

/// Runs every round, both arms each, and returns the arms in run order.
pub async fn run(bins: &Binaries, args: &LoraArgs) -> Result<Vec<ArmResult>> {
    let modules: Vec<String> = (0..args.adapters.max(1))
        .map(|i| {
            format!(
                "--lora-modules={}=/adapters/{}",
                adapter_name(i),
                adapter_name(i)
            )
        })
        .collect();
    let mut sim_args = vec![
        "--enable-lora".to_string(),
        format!("--max-loras={}", args.max_loras.max(1)),
        format!("--lora-load-ms={}", args.lora_load_ms),
    ];
    sim_args.extend(modules);
    let opts = CompareOptions {
        strategies: vec![Strategy::Weighted],
        ..CompareOptions::fleet(
            args.envoy.clone(),
            args.pods.max(1),
            2048,
            sim_args,
            BASE_MODEL.into(),
        )
    };
    let arms = [("lora-scorer", 2.0), ("no-lora-scorer", 0.0)];
    let mut out = Vec::new();
    for round in 0..args.rounds.max(1) {
        for k in 0..arms.len() {
            let (name, weight) = arms[(k + round) % arms.len()];
            let label = format!("{name} #{}", round + 1);
            let fleet = CompareFleet::start(bins, &opts).await?;
            let mut cfg = Strategy::Weighted.router_config(&fleet.base_config()?, BASE_MODEL);
            cfg.scorers.lora.weight = weight;
            let stack = Stack::start(bins, &fleet, cfg, 1, None)
                .await
                .with_context(|| format!("starting {label}"))?;
            let addrs = fleet.addrs();
            let before = lora_counters(&addrs).await?;
            eprintln!("kv-bench: lora: {label}");
            let run = runner::run(
                args.workload().build(),
                &RunOptions {
                    target: stack.envoy_url(),
                    concurrency: None,
                    request_timeout: opts.request_timeout,
                    label: label.clone(),
                    progress: false,
                },
            )
            .await?;
            let after = lora_counters(&addrs).await?;
            drop(stack);
            drop(fleet);
            let s = Summary::of(&run, Some(opts.pods));
            let per_1k = |d: f64| d * 1000.0 / s.requests.max(1) as f64;
            out.push(ArmResult {
                label,
                lora_weight: weight,
                requests: s.requests,
                errors: s.errors,
                loads_per_1k: per_1k(after.0 - before.0),
                evictions_per_1k: per_1k(after.1 - before.1),
                ttft_p50_ms: s.ttft_p50_ms,
                ttft_p99_ms: s.ttft_p99_ms,
                hit_rate: s.hit_rate,
            });
        }
    }
    Ok(out)
}

/// The arms as a Markdown table.
pub fn markdown(arms: &[ArmResult]) -> String {
    let mut t = String::from(
        "| arm | requests (errors) | adapter loads / 1k | evictions / 1k | TTFT p50 / p99 ms | hit rate |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for a in arms {
        t.push_str(&format!(
            "| {} | {} ({}) | {:.1} | {:.1} | {:.0} / {:.0} | {:.1} % |\n",
            a.label,
            a.requests,
            a.errors,
            a.loads_per_1k,
            a.evictions_per_1k,
            a.ttft_p50_ms,
            a.ttft_p99_ms,
            a.hit_rate * 100.0
        ));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(seed: u64) -> LoraWorkload {
        LoraWorkload {
            adapters: 32,
            requests: 2_000,
            rate: 40.0,
            zipf: 1.0,
            seed,
            system_tokens: 8,
            question_tokens: 8,
            max_tokens: 4,
        }
    }

    #[test]
    fn the_workload_is_deterministic_under_its_seed() {
        let a = spec(7).plan();
        assert_eq!(a, spec(7).plan());
        assert_ne!(a, spec(8).plan());
        assert!(
            a.windows(2).all(|w| w[0].at <= w[1].at),
            "arrivals in order"
        );
        // ~50 s of arrivals at 40/s.
        let end = a.last().unwrap().at.as_secs_f64();
        assert!((40.0..60.0).contains(&end), "{end}");
        let w = spec(7).build();
        assert_eq!((w.requests, w.sessions.len()), (2_000, 2_000));
    }

    #[test]
    fn adapters_follow_zipf_popularity() {
        let plan = spec(3).plan();
        let mut counts = [0usize; 32];
        for r in &plan {
            counts[r.adapter] += 1;
        }
        // Zipf s=1 over 32: P(rank 0) = 1/H32 ≈ 0.246, rank 1 half of that, rank 31 ≈ 0.0077.
        let share = |k: usize| counts[k] as f64 / plan.len() as f64;
        assert!((0.20..0.30).contains(&share(0)), "{counts:?}");
        assert!((0.09..0.16).contains(&share(1)), "{counts:?}");
        assert!(share(31) < 0.03, "{counts:?}");
        let top4: usize = counts[..4].iter().sum();
        assert!(top4 * 2 > plan.len(), "the top 4 take half: {counts:?}");
        // A uniform draw would fail all of the above.
        let uniform = Zipf::new(32, 0.0);
        let mut rng = SplitMix64::new(1);
        let firsts = (0..2_000).filter(|_| uniform.sample(&mut rng) == 0).count();
        assert!(firsts < 150, "{firsts}");
    }

    #[test]
    fn counters_are_summed_from_metrics_text() {
        let text = "# TYPE vllm_sim:lora_loads counter\n\
                    vllm_sim:lora_loads_total{model_name=\"m\",engine=\"0\"} 3.0\n\
                    vllm_sim:lora_evictions_total{model_name=\"m\",engine=\"0\"} 1.0\n";
        assert_eq!(parse_lora_counters(text), (3.0, 1.0));
    }
}
