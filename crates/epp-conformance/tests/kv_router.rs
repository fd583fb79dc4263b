//! epp-conformance against kv-router: with its conformance hooks on (`conformance_test_hooks`),
//! kv-router passes every case in both modes, the picker-dies cases included (the suite starts
//! and kills it).
//!
//! Needs Envoy 1.40 (`KV_ROUTER_ENVOY`, `.venv/bin/envoy` or PATH; a missing Envoy fails the
//! test) and the workspace's `kv-router` and `vllm-sim` binaries (`cargo test --release
//! --workspace` builds them).

use std::time::Duration;

use epp_conformance::cases::all_names;
use epp_conformance::{run, Mode, Options, PickerSpec};

/// The router config the README shows, rendered by the suite into `{config}`.
const ROUTER_YAML: &str = include_str!("../pickers/kv-router.yaml");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_router_passes_every_case_in_both_modes() {
    let bins = kv_testkit::deploy::Binaries::for_tests();
    let opts = Options {
        envoy: kv_testkit::e2e::envoy_bin(),
        vllm_sim: bins.vllm_sim,
        picker: PickerSpec::Cmd {
            command: format!("'{}' serve --config {{config}}", bins.kv_router.display()),
            config_template: Some(ROUTER_YAML.to_string()),
            ready_timeout: Duration::from_secs(60),
        },
        modes: Mode::ALL.to_vec(),
        pods: None,
        ipv6: true,
        only: Vec::new(),
    };
    let report = run(&opts, |r| println!("{r}"))
        .await
        .unwrap_or_else(|e| panic!("the rig did not start: {e:#}"));
    println!("{}", report.summary());
    assert!(
        report.failed().is_empty(),
        "kv-router failed {:?}\n{}",
        report.failed(),
        report.summary()
    );
    assert_eq!(
        report.passed().len(),
        all_names(&Mode::ALL).len(),
        "every case ran and passed"
    );
}
