//! `kv-bench simulate`: a virtual-time simulation of a fleet of simulated vLLM pods on a trace,
//! with no sockets, processes or wall clock.
//!
//! * **Pods** are `vllm-sim`'s [`Engine`](vllm_sim::engine::Engine)s (scheduler, cache and
//!   latency model), stepped at their own event times from one discrete-event loop over virtual
//!   microseconds ([`fleet`]).
//! * **Routing** is the router's own decision path: block keys as the router computes them for
//!   token-id prompts, the router's index (built by `kv_router::index::build_index`: learning
//!   from decisions, or fed by the engines' cache events after a delay), then
//!   `kv_router::decide::plan` and `kv_router::decide::commit`, the same two functions the live
//!   router runs.
//! * **Load as the router sees it** ([`router`]) models the default deployment
//!   (`override-host-buffered.yaml`: the response is not observed): a scrape of every pod's
//!   `running`/`waiting`/KV usage every `scrape_interval_ms` of virtual time, plus the router's
//!   own in-flight settling queue (`kv_router::pods::Settling`) on virtual time.
//! * **Maintenance** as the router does it once a second: index capacity from the pods' KV size
//!   (`kv_router::index::index_capacity`), TTL sweep.
//!
//! * **Adapters and P/D** (`adapters`, `prefill_pods`): requests name LoRA adapters that the
//!   engines hold in a few slots, and some pods prefill while the others decode; the router
//!   plans both through the live entry point, with adapter residency scraped from the engines
//!   ([`fleet`] says what is modelled).
//!
//! Everything is deterministic: the same options (seed included) give the same report, whatever
//! the thread count. Strategies (and capacity-planning fleet sizes) run in parallel threads.
//!
//! Files: [`options`] (what to simulate), [`prepare`] (the trace turned into prompts, once),
//! [`router`] and [`fleet`] (one run), [`outcome`] (a run's figures), [`capacity`] (the sweep),
//! this file (orchestration), [`report`] (the tables).

mod capacity;
#[cfg(test)]
mod equivalence_tests;
mod fleet;
mod options;
mod outcome;
mod prepare;
#[cfg(test)]
mod replica_tests;
mod replicas;
mod report;
mod router;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod workload_tests;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};
use parking_lot::Mutex;
use serde::Serialize;

use super::oracle::Oracles;
use super::strategy::Strategy;
use capacity::{sweep_sizes, Sweep};
use fleet::simulate;
use kv_testkit::trace::{self, Trace};
use prepare::Prepared;

pub use capacity::CapacityPlan;
pub use options::{
    CapacityOptions, Divergence, Replication, SimulateError, SimulateOptions, TokenRelease,
    BLOCK_TOKENS, DEFAULT_TTFT_TARGET_MS,
};
pub use outcome::StrategyResult;
pub use replicas::Writes;

/// Simulation parameters as reported.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimParams {
    /// KV blocks per pod.
    pub gpu_blocks: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Max running requests per pod.
    pub max_num_seqs: usize,
    /// Fixed TTFT overhead, ms.
    pub ttft_base_ms: f64,
    /// Prefill µs per uncached token.
    pub prefill_us_per_token: f64,
    /// Pods (the first ones) that prefill `slow_factor` times slower.
    pub slow_pods: usize,
    /// Their slowdown.
    pub slow_factor: f64,
    /// Decode ms per token (batch of one).
    pub decode_ms_per_token: f64,
    /// Decode slowdown per running request.
    pub decode_batch_slowdown: f64,
    /// KV-event delay (precise), ms.
    pub event_delay_ms: f64,
    /// Scrape period, ms.
    pub scrape_interval_ms: u64,
    /// Arrival compression.
    pub speedup: f64,
    /// Output-length multiplier.
    pub output_scale: f64,
    /// Seed.
    pub seed: u64,
    /// Where the pods' caches drift from the router's record.
    pub divergence: Divergence,
    /// LoRA adapters the requests name (0: base model only).
    #[serde(skip_serializing_if = "outcome::is_zero")]
    pub adapters: u64,
    /// Adapter slots per pod (0 without adapters).
    #[serde(skip_serializing_if = "outcome::is_zero")]
    pub adapter_slots: u64,
    /// Pods with the P/D role `prefill` (0: an aggregated fleet).
    #[serde(skip_serializing_if = "outcome::is_zero")]
    pub prefill_pods: u64,
}

/// Everything `kv-bench simulate` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimulateReport {
    /// Trace name.
    pub trace: String,
    /// Requests simulated.
    pub requests: usize,
    /// Last arrival, virtual seconds (after speedup).
    pub arrival_span_s: f64,
    /// Mean prompt tokens.
    pub mean_prompt_tokens: f64,
    /// Fleet size of the strategy comparison.
    pub pods: usize,
    /// Pod and router parameters.
    pub params: SimParams,
    /// Oracles for this request sequence and fleet.
    pub oracles: Oracles,
    /// One result per strategy and replication (replicas, delay), strategies in the order asked,
    /// each with every replication in [`SimulateOptions::replications`] order.
    pub strategies: Vec<StrategyResult>,
    /// Capacity planning, if asked.
    pub capacity: Option<CapacityPlan>,
    /// Worker threads used.
    pub threads: usize,
    /// Real seconds for everything (trace loading included).
    pub wall_s: f64,
}

/// A unit of work for the thread pool.
#[derive(Debug, Clone, Copy)]
enum Job {
    Compare(Strategy, Replication),
    Plan(usize),
}

/// Loads the trace named in `opts` and simulates it.
pub fn run(opts: &SimulateOptions) -> Result<SimulateReport> {
    let started = Instant::now();
    let path = trace::find_trace(&opts.trace)?;
    let trace = Trace::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let trace = match (opts.skip, opts.requests) {
        (0, None) => trace,
        (skip, n) => trace.window(skip, n.unwrap_or(usize::MAX)),
    };
    let mut report = run_trace(&trace, opts)?;
    report.wall_s = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Simulates `trace` (already cut) with `opts` (its `trace`, `skip` and `requests` are not read).
pub fn run_trace(trace: &Trace, opts: &SimulateOptions) -> Result<SimulateReport> {
    let started = Instant::now();
    opts.validate()?;
    if trace.records.is_empty() {
        return Err(SimulateError::EmptyTrace.into());
    }
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let prep = Prepared::new(trace, opts, threads);
    let engine = &opts.engine;
    let blocks_per_pod = engine.num_gpu_blocks;

    let replications = opts.replications();
    // The capacity plan runs with the first replication asked.
    let planned_with = replications[0];
    let compares: Vec<Job> = opts
        .strategies
        .iter()
        .flat_map(|&s| replications.iter().map(move |&r| Job::Compare(s, r)))
        .collect();
    let jobs: Vec<Job> = compares
        .iter()
        .copied()
        .chain(
            opts.capacity
                .iter()
                .flat_map(|c| sweep_sizes(c, opts))
                .map(Job::Plan),
        )
        .collect();
    let sweep = opts.capacity.as_ref().map(Sweep::new);
    let oracles = Mutex::new(None);
    let compared: Mutex<Vec<Option<StrategyResult>>> = Mutex::new(vec![None; compares.len()]);
    let errors: Mutex<Vec<SimulateError>> = Mutex::new(Vec::new());
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        // The oracles run beside the first jobs; results wait for them only at the end.
        s.spawn(|| {
            let o = Oracles::compute(&prep.oracle, BLOCK_TOKENS, opts.pods * blocks_per_pod);
            *oracles.lock() = Some(o);
        });
        for _ in 0..threads {
            s.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(&job) = jobs.get(k) else { break };
                let (strategy, pods, how) = match (job, &sweep) {
                    (Job::Compare(st, how), _) => (st, opts.pods, how),
                    (Job::Plan(n), Some(sw)) if !sw.skips(n) => (sw.opts.strategy, n, planned_with),
                    (Job::Plan(_), _) => continue,
                };
                let t0 = Instant::now();
                match simulate(&prep, strategy, pods, how, opts) {
                    Ok(out) => {
                        let wall = t0.elapsed().as_secs_f64();
                        let r = StrategyResult::new(strategy, out, wall);
                        eprintln!(
                            "kv-bench simulate: {} on {} pods, {} replica(s), {} ms: {:.1} s \
                             ({:.0} trace s/s)",
                            strategy.as_str(),
                            pods,
                            how.replicas,
                            how.propagation_ms,
                            wall,
                            r.timing.speed
                        );
                        let plans_this = how == planned_with;
                        if let Some(sw) = &sweep {
                            if plans_this
                                && sw.opts.strategy == strategy
                                && sw.sizes.contains(&pods)
                            {
                                sw.record(r.clone());
                            }
                        }
                        // The comparison's jobs come first, in the report's order.
                        if let Some(slot) = compared.lock().get_mut(k) {
                            *slot = Some(r);
                        }
                    }
                    Err(e) => errors.lock().push(e),
                }
            });
        }
    });
    if let Some(e) = errors.into_inner().into_iter().next() {
        return Err(e.into());
    }
    let oracles = oracles
        .into_inner()
        .expect("the oracle thread finished with the scope");
    let strategies: Vec<StrategyResult> = compared
        .into_inner()
        .into_iter()
        .flatten()
        .map(|r| r.against(&oracles))
        .collect();
    let capacity = sweep.map(Sweep::plan);
    let n = prep.at_us.len();
    Ok(SimulateReport {
        trace: trace.name.clone(),
        requests: n,
        arrival_span_s: prep.at_us.last().copied().unwrap_or(0) as f64 / 1e6,
        mean_prompt_tokens: prep.oracle.iter().map(|o| o.prompt_tokens).sum::<u64>() as f64
            / n as f64,
        pods: opts.pods,
        params: SimParams {
            gpu_blocks: engine.num_gpu_blocks,
            block_tokens: BLOCK_TOKENS,
            max_num_seqs: engine.max_num_seqs,
            ttft_base_ms: engine.ttft_base_us / 1e3,
            prefill_us_per_token: engine.prefill_us_per_token,
            slow_pods: opts.slow_pods.min(opts.pods),
            slow_factor: opts.slow_factor,
            decode_ms_per_token: engine.decode_us_per_token / 1e3,
            decode_batch_slowdown: engine.decode_batch_slowdown,
            event_delay_ms: opts.event_delay_ms,
            scrape_interval_ms: opts.scrape_interval_ms,
            speedup: opts.speedup,
            output_scale: opts.output_scale,
            seed: opts.seed,
            divergence: opts.divergence,
            adapters: opts.adapters as u64,
            adapter_slots: if opts.adapters > 0 {
                opts.adapter_slots as u64
            } else {
                0
            },
            prefill_pods: opts.prefill_pods.min(opts.pods.saturating_sub(1)) as u64,
        },
        oracles,
        strategies,
        capacity,
        threads,
        wall_s: started.elapsed().as_secs_f64(),
    })
}
