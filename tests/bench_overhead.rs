//! `kv-bench overhead --quick` through real Envoy: the report is produced and well-formed (every
//! path in every cell, no errors, positive latencies). Speed is not asserted.

mod common;

use std::collections::BTreeSet;

use kv_router::bench::overhead::{self, OverheadOptions, PathKind, PATHS};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_overhead_report_is_well_formed() {
    let envoy = common::envoy_bin();
    let opts = OverheadOptions::quick();
    let r = overhead::run(&common::bins(), Some(&envoy), &opts)
        .await
        .unwrap_or_else(|e| panic!("kv-bench overhead --quick failed: {e:#}"));
    assert_eq!(
        r.cells.len(),
        opts.sizes.len() * opts.concurrencies.len() * PATHS.len()
    );
    for &size in &opts.sizes {
        for &conc in &opts.concurrencies {
            let cells: Vec<_> = r
                .cells
                .iter()
                .filter(|c| c.prompt_bytes == size && c.concurrency == conc)
                .collect();
            let paths: BTreeSet<PathKind> = cells.iter().map(|c| c.path).collect();
            assert_eq!(
                paths,
                PATHS.into_iter().collect(),
                "{size} B x {conc}: every path"
            );
            for c in cells {
                let what = format!("{} {size} B x {conc}: {c:?}", c.path.label());
                assert_eq!(c.requests, opts.requests, "{what}");
                assert_eq!((c.errors, c.failed_open), (0, 0), "{what}");
                assert!(
                    c.p50_ms > 0.0 && c.p99_ms >= c.p50_ms && c.mean_ms > 0.0,
                    "{what}"
                );
                assert!(
                    c.added_p50_ms.is_some() && c.added_p99_ms.is_some(),
                    "{what}"
                );
                assert_eq!(
                    c.router_cpu_ms_per_request.is_some(),
                    c.path == PathKind::EnvoyKvRouter,
                    "{what}"
                );
                assert_eq!(
                    c.noop_cpu_ms_per_request.is_some(),
                    c.path == PathKind::EnvoyNoopExtProc,
                    "{what}"
                );
                assert_eq!(
                    c.envoy_cpu_ms_per_request.is_some(),
                    c.path != PathKind::Direct,
                    "{what}"
                );
            }
        }
    }
    let md = r.markdown();
    let rows = md.lines().filter(|l| l.starts_with('|')).count();
    assert_eq!(rows, r.cells.len() + 2, "{md}");
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["cells"].as_array().unwrap().len(), r.cells.len());
    assert_eq!(json["quick"], true);
}
