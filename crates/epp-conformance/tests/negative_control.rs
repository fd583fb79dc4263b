//! The suite tells right from wrong: the built-in NEGATIVE CONTROL picker (`epp-conformance
//! control-picker`, a tiny round-robin picker) passes every case without a flaw, and with a
//! deliberate flaw fails exactly the cases that check the rule it breaks, in both modes.
//!
//! Needs Envoy 1.40 (`KV_ROUTER_ENVOY`, `.venv/bin/envoy` or PATH) and the workspace's `vllm-sim`
//! binary (`cargo test --release --workspace` builds it).

use std::collections::BTreeSet;
use std::time::Duration;

use epp_conformance::cases::all_names;
use epp_conformance::{run, Mode, Options, PickerSpec};

async fn failures_with(flaw: &str) -> BTreeSet<String> {
    let bins = kv_testkit::deploy::Binaries::for_tests();
    let me = env!("CARGO_BIN_EXE_epp-conformance");
    let opts = Options {
        envoy: kv_testkit::e2e::envoy_bin(),
        vllm_sim: bins.vllm_sim,
        picker: PickerSpec::Cmd {
            command: format!(
                "'{me}' control-picker --grpc-port {{grpc_port}} --pods {{pods}} --flaw {flaw}"
            ),
            config_template: None,
            ready_timeout: Duration::from_secs(30),
        },
        modes: Mode::ALL.to_vec(),
        pods: None,
        ipv6: true,
        only: Vec::new(),
    };
    let report = run(&opts, |r| println!("[{flaw}] {r}"))
        .await
        .unwrap_or_else(|e| panic!("the rig did not start: {e:#}"));
    println!("[{flaw}] {}", report.summary());
    let ran: BTreeSet<String> = report.results.iter().map(|r| r.name.clone()).collect();
    let every: BTreeSet<String> = all_names(&Mode::ALL).into_iter().collect();
    assert_eq!(ran, every, "every case runs, none is skipped in cmd mode");
    assert_eq!(
        report.passed().len() + report.failed().len(),
        every.len(),
        "no case skipped: {:?}",
        report.results
    );
    report.failed().into_iter().collect()
}

fn in_both_modes(cases: &[&str]) -> BTreeSet<String> {
    Mode::ALL
        .iter()
        .flat_map(|m| cases.iter().map(move |c| format!("{m}/{c}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_without_a_flaw_passes_every_case() {
    assert_eq!(failures_with("none").await, BTreeSet::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignoring_the_selection_header_fails_the_selection_cases_and_nothing_else() {
    // The security cases restrict the request to pod A with the selection header, so a picker
    // that ignores it lands elsewhere there too.
    let want = in_both_modes(&[
        "selection.ip-port",
        "selection.ip",
        "selection.list",
        "selection.ipv6",
        "selection.no-match",
        "security.forged-destination",
        "security.forged-prefiller",
    ]);
    assert_eq!(failures_with("ignore-selection").await, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusting_client_routing_headers_fails_the_security_cases_and_nothing_else() {
    let want = in_both_modes(&["security.forged-destination", "security.forged-prefiller"]);
    assert_eq!(failures_with("trust-client-headers").await, want);
}
