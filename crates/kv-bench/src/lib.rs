//! kv-bench: live comparisons of routing strategies behind real Envoy, the fleet simulation in
//! virtual time, the router-overhead and hostile-traffic measurements, and the results document.
//! The process rigs, workloads and traces it drives come from `kv-testkit`; the simulated pods
//! from `vllm-sim`; the router only through its public API.

pub mod capacity;
pub mod charts;
pub mod cli;
pub mod compare;
pub mod extproc_client;
pub mod failover;
pub mod flow;
pub mod hostile;
pub mod hostile_attacks;
pub mod hostile_compare;
pub mod idle;
pub mod llama;
pub mod lora;
pub mod noop_extproc;
pub mod oracle;
pub mod overhead;
pub mod paired;
pub mod pd_report;
pub mod pipeline;
pub mod pool;
pub mod redis_index;
pub mod report;
pub mod results;
pub mod simulate;
pub mod small_fleet;
pub mod soak;
pub mod strategy;
pub mod study;
pub mod table;

use kv_testkit::runner::RunResult;
use report::Summary;

/// Summaries of `runs` over a fleet of `pods`.
pub fn summarize(runs: &[RunResult], pods: Option<usize>) -> Vec<Summary> {
    runs.iter().map(|r| Summary::of(r, pods)).collect()
}
