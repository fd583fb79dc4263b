//! Adapter workloads and prefill/decode fleets, run tiny end to end.

use super::tests::{grouped_trace, opts};
use super::*;
use crate::strategy::Strategy;

/// Four pods, a few shared prompts, the weighted and round-robin strategies.
fn tiny() -> SimulateOptions {
    SimulateOptions {
        strategies: vec![Strategy::Weighted, Strategy::RoundRobin],
        ..opts(4)
    }
}

#[test]
fn an_adapter_workload_loads_adapters_and_is_routed_by_residency() {
    let t = grouped_trace(6, 10, 50);
    let o = SimulateOptions {
        adapters: 3,
        adapter_slots: 1,
        ..tiny()
    };
    let r = run_trace(&t, &o).unwrap();
    assert_eq!((r.params.adapters, r.params.adapter_slots), (3, 1));
    let loads = |s: Strategy| {
        let res = r.strategies.iter().find(|x| x.strategy == s).unwrap();
        assert_eq!(res.requests, 60, "every request finished");
        assert_eq!(res.disaggregated, 0, "an aggregated fleet");
        res.adapter_loads
    };
    let (weighted, round_robin) = (loads(Strategy::Weighted), loads(Strategy::RoundRobin));
    assert!(
        weighted > 0,
        "three adapters on one slot per pod are loaded"
    );
    // Residency counts in the weighted plan: fewer swaps than rotating blindly.
    assert!(
        weighted < round_robin,
        "weighted {weighted} loads, round robin {round_robin}"
    );
    assert!(r.plain().contains("3 LoRA adapter(s), 1 slot(s) per pod"));
    // Without adapters nothing is loaded.
    let base = run_trace(&t, &tiny()).unwrap();
    assert!(base.strategies.iter().all(|s| s.adapter_loads == 0));
}

#[test]
fn a_prefill_decode_fleet_prefills_long_prompts_on_its_prefill_pod() {
    let t = grouped_trace(6, 10, 50);
    let o = SimulateOptions {
        prefill_pods: 1,
        ..tiny()
    };
    let r = run_trace(&t, &o).unwrap();
    assert_eq!(r.params.prefill_pods, 1);
    for s in &r.strategies {
        assert_eq!(s.requests, 60, "every request finished");
        assert!(
            s.disaggregated > 0,
            "{}: 1300-token prompts",
            s.strategy.as_str()
        );
        assert_eq!(s.per_pod[0], 0, "the prefill pod decodes nothing");
    }
    assert!(r.plain().contains("1 prefill pod(s)"));
}

#[test]
fn a_fleet_of_prefill_pods_alone_or_adapters_without_slots_is_refused() {
    let t = grouped_trace(2, 2, 50);
    let all_prefill = SimulateOptions {
        prefill_pods: 4,
        ..tiny()
    };
    let no_slots = SimulateOptions {
        adapters: 2,
        adapter_slots: 0,
        ..tiny()
    };
    for o in [all_prefill, no_slots] {
        let e = run_trace(&t, &o).unwrap_err();
        assert!(matches!(
            e.downcast_ref::<SimulateError>(),
            Some(SimulateError::BadWorkload(_))
        ));
    }
}
