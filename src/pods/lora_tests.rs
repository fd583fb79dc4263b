//! Tests of LoRA residency parsing, fits, load counting and adapter routing.

use std::time::Duration;

use proptest::prelude::*;

use super::super::engine::{EngineChoice, MetricMap, PodEngine};
use super::super::{PodId, PodSpec};
use super::*;
use crate::config::{CustomEngine, Preset};

const NAME: &str = "vllm:lora_requests_info";

// vLLM's format (`vllm/v1/metrics/loggers.py`): one series per label set, valued with the Unix
// time it was last set.
const SCRAPE: &str = r#"# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7000000005e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.700000001e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql",waiting_lora_adapters=""} 1.6e+09
vllm:num_requests_waiting{model_name="m"} 1.0
"#;

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn residency(max: Option<u32>, running: &[&str], waiting: &[&str]) -> LoraResidency {
    LoraResidency {
        max_lora: max,
        running: set(running),
        waiting: set(waiting),
        at: 0.0,
    }
}

#[test]
fn the_newest_series_is_the_current_state() {
    let r = read_lora_info(SCRAPE, NAME).unwrap();
    assert_eq!(
        r,
        LoraResidency {
            at: 1.700000001e9,
            ..residency(Some(4), &[], &[])
        }
    );
    let newer = SCRAPE.replace("1.7000000005e+09", "1.7000000020e+09");
    let r = read_lora_info(&newer, NAME).unwrap();
    assert_eq!(r.running, set(&["a", "b"]));
    assert_eq!(r.waiting, set(&["c"]));
    assert_eq!(r.max_lora, Some(4));
    assert_eq!(read_lora_info("vllm:num_requests_waiting 1\n", NAME), None);
}

#[test]
fn a_tie_goes_to_the_later_line_and_nonsense_values_are_skipped() {
    let text = format!(
        "{NAME}{{max_lora=\"2\",running_lora_adapters=\"x\"}} 5\n\
         {NAME}{{max_lora=\"2\",running_lora_adapters=\"y\"}} 5\n\
         {NAME}{{max_lora=\"2\",running_lora_adapters=\"z\"}} NaN\n\
         {NAME}{{max_lora=\"2\",running_lora_adapters=\"w\"}} -9\n"
    );
    let r = read_lora_info(&text, NAME).unwrap();
    assert_eq!(r.running, set(&["y"]));
    assert_eq!(r.waiting, set(&[]), "a missing label is an empty set");
    let odd = format!("{NAME}{{max_lora=\"many\",running_lora_adapters=\" a , ,b,\"}} 1\n");
    let r = read_lora_info(&odd, NAME).unwrap();
    assert_eq!((r.max_lora, r.running), (None, set(&["a", "b"])));
}

#[test]
fn names_sets_and_series_are_bounded() {
    let long = "n".repeat(MAX_LORA_NAME_BYTES + 1);
    let many: Vec<String> = (0..MAX_POD_ADAPTERS + 50)
        .map(|i| format!("a{i}"))
        .collect();
    let text = format!(
        "{NAME}{{max_lora=\"4\",running_lora_adapters=\"{long},ok\",waiting_lora_adapters=\"{}\"}} 1\n",
        many.join(",")
    );
    let r = read_lora_info(&text, NAME).unwrap();
    assert_eq!(r.running, set(&["ok"]), "an over-long name is dropped");
    assert_eq!(r.waiting.len(), MAX_POD_ADAPTERS);
    // Series past the cap are not looked at.
    let mut flood = String::new();
    for i in 0..MAX_LORA_SERIES {
        flood.push_str(&format!("{NAME}{{running_lora_adapters=\"s{i}\"}} 1\n"));
    }
    flood.push_str(&format!("{NAME}{{running_lora_adapters=\"late\"}} 9\n"));
    let r = read_lora_info(&flood, NAME).unwrap();
    assert_eq!(r.running, set(&[&format!("s{}", MAX_LORA_SERIES - 1)]));
}

#[test]
fn fit_is_resident_free_or_evicting() {
    let r = residency(Some(2), &["a"], &["b"]);
    assert_eq!(r.fit("a"), LoraFit::Resident);
    assert_eq!(
        r.fit("b"),
        LoraFit::Resident,
        "waiting counts: it is loading"
    );
    assert_eq!(r.fit("c"), LoraFit::Evicts);
    assert_eq!(
        residency(Some(3), &["a"], &["a"]).fit("c"),
        LoraFit::FreeSlot
    );
    assert_eq!(
        residency(None, &["a", "b"], &[]).fit("c"),
        LoraFit::FreeSlot
    );
    assert_eq!(residency(Some(0), &[], &[]).fit("c"), LoraFit::Evicts);
}

#[test]
fn idle_adapters_used_most_recently_stay_loaded() {
    // Two slots, "a" busy: of the idle adapters, only the newest one ("b") fits beside it.
    let r = residency(Some(2), &["a"], &[]);
    let mut state = LoraState::default();
    for a in ["c", "b", "a"] {
        state.used(a);
    }
    assert_eq!(Vec::from(state.recent.clone()), ["a", "b", "c"]);
    assert_eq!(r.fit_with("b", &state.recent), LoraFit::Resident);
    assert_eq!(r.fit_with("c", &state.recent), LoraFit::Evicts);
    assert_eq!(r.fit_with("c", &VecDeque::new()), LoraFit::FreeSlot);
    // Used again, "c" is loaded and "b" is the one a new adapter would evict.
    state.used("c");
    assert_eq!(r.fit_with("c", &state.recent), LoraFit::Resident);
    assert_eq!(r.fit_with("b", &state.recent), LoraFit::Evicts);
    // A scrape's busy adapters count as used; the memory stays bounded.
    state.record(Instant::now(), Some(residency(Some(2), &["z"], &["y"])));
    assert_eq!(state.recent.front().map(String::as_str), Some("z"));
    for i in 0..200 {
        state.used(&format!("x{i}"));
    }
    assert_eq!(state.recent.len(), MAX_RECENT_ADAPTERS);
}

#[test]
fn newly_running_adapters_count_as_loads() {
    let mut s = LoraState::default();
    let t = Instant::now();
    s.record(t, Some(residency(Some(4), &["a"], &[])));
    assert_eq!(s.unexported_loads, 0, "the first report is a baseline");
    s.record(t, Some(residency(Some(4), &["a", "b"], &["c"])));
    s.record(t, Some(residency(Some(4), &["b", "c"], &[])));
    assert_eq!(s.unexported_loads, 2, "b then c");
    s.record(t, None);
    assert!(s.residency.is_none());
    s.record(t, Some(residency(Some(4), &["d"], &[])));
    assert_eq!(
        s.unexported_loads, 2,
        "after a gap the next report is a new baseline"
    );
}

#[test]
fn listed_adapters_keep_cards_with_a_parent() {
    let got = listed_adapters([
        ("base".to_string(), None),
        ("sql".to_string(), Some("base".to_string())),
        ("self".to_string(), Some("self".to_string())),
        (
            "x".repeat(MAX_LORA_NAME_BYTES + 1),
            Some("base".to_string()),
        ),
    ]);
    assert_eq!(
        got.into_iter().collect::<Vec<_>>(),
        vec![("sql".to_string(), "base".to_string())]
    );
}

#[test]
fn listed_bases_are_the_cards_without_a_parent() {
    let cards = [
        ("base".to_string(), None),
        ("sql".to_string(), Some("base".to_string())),
        (String::new(), None),
        ("x".repeat(MAX_LORA_NAME_BYTES + 1), None),
    ];
    assert_eq!(listed_bases(&cards), set(&["base"]));
    let many: Vec<_> = (0..2 * MAX_POD_ADAPTERS)
        .map(|i| (format!("m{i}"), None))
        .collect();
    assert_eq!(listed_bases(&many).len(), MAX_POD_ADAPTERS);
}

fn pod(addr: &str, models: &[&str], adapters: &[(&str, &str)]) -> Arc<Pod> {
    let p = Pod::new(PodSpec {
        id: PodId::new(addr),
        addr: addr.parse().unwrap(),
        models: vec![],
        labels: Default::default(),
        kv_events_endpoint: None,
        kv_events_replay_endpoint: None,
    });
    p.set_learned_models(
        Instant::now(),
        models.iter().map(|s| s.to_string()).collect(),
    );
    p.set_learned_adapters(
        adapters
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect(),
    );
    Arc::new(p)
}

fn ids(pods: &[Arc<Pod>]) -> Vec<&str> {
    pods.iter().map(|p| p.id().as_str()).collect()
}

#[test]
fn an_adapter_goes_to_pods_listing_it_else_to_its_base_models_pods() {
    let a = pod("10.0.0.1:8000", &["base", "sql"], &[("sql", "base")]);
    let b = pod("10.0.0.2:8000", &["base"], &[]);
    let c = pod("10.0.0.3:8000", &["other"], &[]);
    let all = vec![&a, &b, &c];
    let none = BTreeMap::new();
    assert_eq!(
        ids(&serving(all.clone(), Some("sql"), &none)),
        ["10.0.0.1:8000"]
    );
    assert_eq!(
        ids(&serving(all.clone(), Some("base"), &none)),
        ["10.0.0.1:8000", "10.0.0.2:8000"]
    );
    assert_eq!(ids(&serving(all.clone(), None, &none)).len(), 3);
    // Loaded on demand: listed nowhere, mapped in config to its base model.
    let cfg: BTreeMap<String, String> = [("chat".to_string(), "base".to_string())].into();
    assert_eq!(
        ids(&serving(all.clone(), Some("chat"), &cfg)),
        ["10.0.0.1:8000", "10.0.0.2:8000"]
    );
    assert!(
        serving(all.clone(), Some("chat"), &none).is_empty(),
        "unknown model"
    );
    assert_eq!(adapter_base("sql", &all, &none).as_deref(), Some("base"));
    assert_eq!(adapter_base("base", &all, &cfg), None);
}

/// A pod that learned `cards` (`(id, parent)`) from its `/v1/models`.
fn pod_with_cards(addr: &str, cards: &[(&str, Option<&str>)]) -> Arc<Pod> {
    let p = pod(addr, &[], &[]);
    let cards = cards
        .iter()
        .map(|(id, parent)| (id.to_string(), parent.map(str::to_string)))
        .collect();
    p.set_learned_cards(Instant::now(), cards);
    p
}

#[test]
fn a_pod_listing_a_base_model_with_a_parent_does_not_make_it_an_adapter() {
    let honest = pod_with_cards("10.0.0.1:8000", &[("base", None), ("sql", Some("base"))]);
    let liar = pod_with_cards("10.0.0.2:8000", &[("base", Some("other"))]);
    let now = Instant::now();
    let stale = Duration::from_secs(2);
    liar.record_lora(now, Some(residency(Some(4), &["base"], &[])));
    let pods = vec![honest.clone(), liar.clone()];
    let refs: Vec<&Arc<Pod>> = pods.iter().collect();
    let none = BTreeMap::new();
    assert_eq!(adapter_base("base", &refs, &none), None);
    assert_eq!(
        fits(Some("base"), &pods, &none, now, stale),
        None,
        "a base-model request gets no LoRA column"
    );
    assert_eq!(
        ids(&serving(refs.clone(), Some("base"), &none)),
        ["10.0.0.1:8000", "10.0.0.2:8000"]
    );
    assert_eq!(
        adapter_base("sql", &refs, &none).as_deref(),
        Some("base"),
        "a real adapter still is one"
    );
    // With no pod serving it as base, a base model named in `scorers.lora.adapters` holds.
    let alone = [&liar];
    let cfg: BTreeMap<String, String> = [("chat".to_string(), "base".to_string())].into();
    assert_eq!(
        adapter_base("base", &alone, &none).as_deref(),
        Some("other")
    );
    assert_eq!(adapter_base("base", &alone, &cfg), None);
    assert_eq!(
        fits(Some("base"), std::slice::from_ref(&liar), &cfg, now, stale),
        None
    );
}

#[test]
fn fits_are_for_adapter_requests_and_fresh_reports_only() {
    let a = pod("10.0.0.1:8000", &["base", "sql"], &[("sql", "base")]);
    let b = pod("10.0.0.2:8000", &["base", "sql"], &[("sql", "base")]);
    let now = Instant::now();
    let stale = Duration::from_secs(2);
    a.record_lora(now, Some(residency(Some(1), &["sql"], &[])));
    b.record_lora(now, Some(residency(Some(1), &["chat"], &[])));
    let pods = vec![a.clone(), b.clone()];
    let none = BTreeMap::new();
    assert_eq!(
        fits(Some("sql"), &pods, &none, now, stale),
        Some(vec![LoraFit::Resident, LoraFit::Evicts])
    );
    assert_eq!(fits(Some("base"), &pods, &none, now, stale), None);
    assert_eq!(fits(None, &pods, &none, now, stale), None);
    let later = now + Duration::from_secs(3);
    assert_eq!(
        fits(Some("sql"), &pods, &none, later, stale),
        Some(vec![LoraFit::Unreported; 2])
    );
    let report = a.lora_report(now);
    assert_eq!(report.adapters.get("sql").map(String::as_str), Some("base"));
    assert_eq!(report.residency.unwrap().running, set(&["sql"]));
}

#[test]
fn the_vllm_preset_and_a_custom_mapping_read_residency() {
    let vllm = PodEngine::new(EngineChoice::Preset(Preset::Vllm), "pods.engine");
    assert_eq!(vllm.read_lora(SCRAPE).unwrap().max_lora, Some(4));
    let auto = PodEngine::default();
    assert_eq!(auto.read_lora(SCRAPE), None, "nothing detected yet");
    auto.read(&PodId::new("10.0.0.1:8000"), SCRAPE);
    assert!(auto.read_lora(SCRAPE).is_some(), "detected as vLLM");
    let c: CustomEngine = serde_yaml::from_str("{ running: r, lora_info: my_lora }").unwrap();
    let custom = PodEngine::new(
        EngineChoice::Custom(Arc::new(MetricMap::custom(&c))),
        "label",
    );
    let text = "my_lora{max_lora=\"1\",running_lora_adapters=\"q\"} 3\n";
    assert_eq!(custom.read_lora(text).unwrap().running, set(&["q"]));
    assert_eq!(custom.read_lora(SCRAPE), None);
    let sglang = PodEngine::new(EngineChoice::Preset(Preset::Sglang), "pods.engine");
    assert_eq!(sglang.read_lora(SCRAPE), None, "no residency gauge");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]
    // Whatever a pod sends, residency stays bounded and fits are consistent with the sets.
    #[test]
    fn any_scrape_gives_a_bounded_residency(
        series in prop::collection::vec(
            ("[a-z,\" ]{0,40}", "[a-z,]{0,40}", "[0-9a-z]{0,3}", prop_oneof![Just("1".to_string()), Just("NaN".to_string()), "[0-9.e+-]{1,8}"]),
            0..12,
        ),
        ask in "[a-z]{1,3}",
    ) {
        let text: String = series
            .iter()
            .map(|(r, w, m, v)| format!("{NAME}{{max_lora=\"{m}\",running_lora_adapters=\"{r}\",waiting_lora_adapters=\"{w}\"}} {v}\n"))
            .collect();
        if let Some(r) = read_lora_info(&text, NAME) {
            prop_assert!(r.running.len() <= MAX_POD_ADAPTERS && r.waiting.len() <= MAX_POD_ADAPTERS);
            prop_assert!(r.running.iter().chain(&r.waiting).all(|n| !n.is_empty() && n.len() <= MAX_LORA_NAME_BYTES && !n.contains(',')));
            prop_assert!(r.at.is_finite() && r.at >= 0.0);
            let fit = r.fit(&ask);
            let resident = r.running.contains(&ask) || r.waiting.contains(&ask);
            prop_assert_eq!(fit == LoraFit::Resident, resident);
        }
    }
}
