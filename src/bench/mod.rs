//! kv-bench: local deployments (simulated vLLM pods, kv-router, Envoy), workloads, a load runner
//! and reports. Used by the `kv-bench` binary and by the end-to-end tests.

pub mod charts;
pub mod compare;
pub mod deploy;
pub mod extproc_client;
pub mod hostile;
pub mod idle;
pub mod noop_extproc;
pub mod oracle;
pub mod overhead;
pub mod pipeline;
pub mod prose;
pub mod redis_index;
pub mod report;
pub mod results;
pub mod runner;
pub mod simulate;
pub mod small_fleet;
pub mod soak;
pub mod splitmix;
pub mod strategy;
pub mod table;
pub mod trace;
pub mod workload;

use report::Summary;
use runner::RunResult;

/// Summaries of `runs` over a fleet of `pods`.
pub fn summarize(runs: &[RunResult], pods: Option<usize>) -> Vec<Summary> {
    runs.iter().map(|r| Summary::of(r, pods)).collect()
}
