//! kv-testkit: what kv-router's end-to-end tests and kv-bench share. Process rigs that start and
//! stop real Envoy, Redis/Valkey, simulated vLLM pods and routers on 127.0.0.1 (`deploy`), the
//! workloads and Mooncake traces (`workload`, `cache_pressure`, `trace`, `prose`, `splitmix`),
//! the load runner that streams them through an endpoint (`runner`), and the documented
//! worst-case memory of each shipped component (`memory_bounds`).

pub mod cache_pressure;
pub mod deploy;
pub mod e2e;
pub mod memory_bounds;
pub mod prose;
pub mod runner;
pub mod splitmix;
pub mod trace;
pub mod workload;

use std::path::{Path, PathBuf};

/// The repository this kit was built from (the workspace root).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The repository's data folder (`data/`: traces and vLLM KV-event fixtures; sources and
/// licences in `data/README.md`).
pub fn data_dir() -> PathBuf {
    repo_root().join("data")
}
