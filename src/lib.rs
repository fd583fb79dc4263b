//! kv-router: an Envoy ext_proc endpoint picker that sends each LLM request to the vLLM pod
//! whose KV cache already holds the most of its prompt, without letting any pod drown.
//!
//! One way through, for every request (ext_proc, the `Pick` gRPC service and
//! `POST /debug/explain` alike):
//!
//! ```text
//! extproc ─► decide::Decider ─► request (parse) ─► keys (blocks / tokenize) ─► index.lookup
//!   ─► decide::DecisionState (the one input builder) ─► decide::plan (scoring ─► picker; pure)
//!   ─► decide::commit (session, in-flight load) ─► extproc::reply ─► index.record
//! ```
//! Beside it run the background services that keep its inputs fresh: `pods` (discovery, health
//! probes, load scrapes) and, in precise mode, the KV-event ingestion into the `index`. [`app`]
//! builds every component from a validated [`config::Config`] and starts those loops; `explain`
//! plans without committing. The two ports, and what bounds each caller of them: [`server`].
//! [`decide::DecisionState`], [`decide::plan`] and [`decide::commit`] are public so that
//! `kv-bench simulate` runs the very same decision in virtual time.
//!
//! The library is the router alone: the simulated pod (`crates/vllm-sim`), the test kit of
//! process rigs (`crates/kv-testkit`) and the benchmarks (`crates/kv-bench`) are workspace
//! members of their own that reach the router only through this public API. Which file owns
//! which truth, and which reads may be stale: `docs/architecture.md`.

pub mod allocator;
pub mod app;
pub mod blocks;
pub mod budget;
pub mod config;
pub mod conversation;
pub mod decide;
pub mod events;
pub mod extproc;
pub mod flow;
pub mod index;
mod ingest;
pub mod keys;
pub mod observe;
pub mod picker;
pub mod pod_id;
pub mod pods;
pub mod request;
pub mod scoring;
pub mod server;
pub mod share;
pub mod supervise;
pub mod telemetry;
pub mod tokenize;

/// The crate version, as released.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The git revision this binary was built from (12 hex digits), or "unknown" (see build.rs).
pub const GIT_REVISION: &str = env!("KV_ROUTER_GIT_REVISION");
