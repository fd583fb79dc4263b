//! The router's integration tests, one module per subject, in one test binary: each binary
//! links the whole router and its dependencies, so 21 of them cost CI about as long to build as
//! the router itself (docs/results.md, "CI time"). Run one subject with
//! `cargo test --release --test integration -- e2e::` (any module name).
//!
//! Every test builds its own processes on 127.0.0.1 with random ports and waits on conditions
//! with deadlines, so the subjects run side by side like the tests within one subject always did.

// Shared rigs.
mod common;
mod faults_rig;
mod istio_render;
#[cfg(feature = "kubernetes")]
mod kube_stub;

// The command line and the ext_proc protocol without Envoy.
mod cli;
mod extproc;
mod grpc_tls;

// End to end through the real Envoy, kv-router and vllm-sim.
mod conformance_hooks;
mod e2e;
mod e2e_accuracy;
mod e2e_flow;
mod e2e_lora;
mod e2e_pd;
mod e2e_precise;
mod faults;
mod faults_streams;
mod fd_limit;
mod gie_surface;
mod hardening;
mod previous_response;
mod receipts;
mod router_headers;
mod session_keys;
mod warm_start;

// The shared index on a real Redis/Valkey.
mod redis_replicas;
mod redis_server;

// Deployment: Envoy and Istio configurations, manifests, the image, Kubernetes discovery.
#[cfg(feature = "kubernetes")]
mod deploy_cluster;
#[cfg(feature = "kubernetes")]
mod deploy_manifests;
mod envoy_configs;
mod image;
mod istio_gateway;
mod istio_inferencepool;
mod kind_demo;
#[cfg(feature = "kubernetes")]
mod kubernetes_discovery;
#[cfg(feature = "kubernetes")]
mod kubernetes_objectives;
#[cfg(feature = "kubernetes")]
mod memory_bounds;
