//! LoRA adapters over HTTP: `/v1/models` cards, adapter-scoped prefix cache, slots and their
//! `/metrics` (vLLM's `vllm:lora_requests_info` line format, the sim's load/eviction counters).

mod common;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use common::{Sim, FAST};

impl Sim {
    async fn post(&self, body: Value) -> (u16, Value) {
        let resp = self
            .client
            .post(format!("{}/v1/completions", self.base))
            .json(&body)
            .send()
            .await
            .expect("request");
        let status = resp.status().as_u16();
        (status, resp.json().await.expect("json body"))
    }

    async fn get(&self, path: &str) -> String {
        let resp = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("request");
        assert_eq!(resp.status().as_u16(), 200);
        resp.text().await.expect("body")
    }

    async fn metrics(&self) -> Metrics {
        Metrics::parse(&self.get("/metrics").await)
    }

    /// Polls `/metrics` until `ok` holds, or panics after 10 s.
    async fn wait_for(&self, what: &str, ok: impl Fn(&Metrics) -> bool) -> Metrics {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let m = self.metrics().await;
            if ok(&m) {
                return m;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {m:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--model", "base-model"];
    v.extend_from_slice(FAST);
    v.extend_from_slice(extra);
    v
}

/// One `vllm:lora_requests_info` series.
#[derive(Debug, Clone, PartialEq)]
struct LoraSeries {
    max_lora: String,
    waiting: String,
    running: String,
    at: f64,
}

#[derive(Debug, Default)]
struct Metrics {
    lora: Vec<LoraSeries>,
    loads: Option<f64>,
    evictions: Option<f64>,
    waiting: f64,
    help_type: usize,
}

impl Metrics {
    /// Parses the sample lines this test reads; a `vllm:lora_requests_info` line that does
    /// not have vLLM's exact shape fails the test.
    fn parse(text: &str) -> Metrics {
        let mut m = Metrics::default();
        for line in text.lines() {
            if line == "# HELP vllm:lora_requests_info Running stats on lora requests."
                || line == "# TYPE vllm:lora_requests_info gauge"
            {
                m.help_type += 1;
            }
            let value = |l: &str| -> f64 {
                let (_, v) = l.rsplit_once(' ').expect("sample value");
                v.parse().unwrap_or_else(|_| panic!("bad value in {l:?}"))
            };
            if let Some(rest) = line.strip_prefix("vllm:lora_requests_info{") {
                let (labels, v) = rest.split_once("} ").expect("labels end");
                let label = |rest: &str, name: &str| -> (String, String) {
                    let rest = rest
                        .strip_prefix(&format!("{name}=\""))
                        .unwrap_or_else(|| panic!("{name} expected in {line:?}"));
                    let (val, tail) = rest.split_once('"').expect("closing quote");
                    (val.to_string(), tail.trim_start_matches(',').to_string())
                };
                let (max_lora, rest) = label(labels, "max_lora");
                let (waiting, rest) = label(&rest, "waiting_lora_adapters");
                let (running, rest) = label(&rest, "running_lora_adapters");
                assert!(rest.is_empty(), "extra labels in {line:?}");
                // prometheus_client writes a Unix time as 1.7xxxe+09.
                assert!(v.contains("e+09"), "{line:?}");
                m.lora.push(LoraSeries {
                    max_lora,
                    waiting,
                    running,
                    at: v.parse().expect("float"),
                });
            } else if line.starts_with("vllm_sim:lora_loads_total{") {
                m.loads = Some(value(line));
            } else if line.starts_with("vllm_sim:lora_evictions_total{") {
                m.evictions = Some(value(line));
            } else if line.starts_with("vllm:num_requests_waiting{") {
                m.waiting = value(line);
            }
        }
        m
    }

    /// The current label set: the newest timestamp.
    fn current(&self) -> Option<&LoraSeries> {
        self.lora.iter().max_by(|a, b| a.at.total_cmp(&b.at))
    }

    fn is(&self, running: &str, waiting: &str) -> bool {
        self.current()
            .is_some_and(|s| s.running == running && s.waiting == waiting)
    }
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[tokio::test]
async fn models_list_adapters_with_their_parent() {
    let sim = Sim::start(&args(&[
        "--enable-lora",
        "--lora-modules",
        "sql-lora=/adapters/sql",
        "chat-lora=acme/chat",
    ]));
    let list: Value = serde_json::from_str(&sim.get("/v1/models").await).unwrap();
    let data = list["data"].as_array().expect("data");
    let ids: Vec<&str> = data.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["base-model", "sql-lora", "chat-lora"]);
    assert_eq!(data[0]["parent"], Value::Null);
    assert_eq!(data[0]["root"], "base-model");
    assert!(data[0]["max_model_len"].is_u64());
    assert_eq!(data[1]["parent"], "base-model");
    assert_eq!(data[1]["root"], "/adapters/sql");
    assert_eq!(data[1]["max_model_len"], Value::Null);
    assert_eq!(data[2]["root"], "acme/chat");
    assert_eq!(data[2]["object"], "model");

    let (status, err) = sim.post(json!({"model": "sql", "prompt": "x"})).await;
    assert_eq!(status, 404);
    assert_eq!(err["error"]["message"], "The model `sql` does not exist.");
    assert_eq!(err["error"]["type"], "NotFoundError");
    let (status, ok) = sim.post(json!({"model": "sql-lora", "prompt": "x"})).await;
    assert_eq!((status, ok["model"].as_str()), (200, Some("sql-lora")));
}

#[tokio::test]
async fn the_prefix_cache_is_separate_per_adapter() {
    let sim = Sim::start(&args(&[
        "--enable-lora",
        "--max-loras",
        "4",
        "--lora-modules",
        "a=/a",
        "b=/b",
    ]));
    // 400 bytes = 100 pseudo tokens = 6 full blocks (96 tokens may hit).
    let prompt = "0123456789".repeat(40);
    let ask = |model: &str| json!({"model": model, "prompt": prompt, "max_tokens": 1});
    let (_, first) = sim.post(ask("a")).await;
    assert_eq!(cached(&first), 0);
    let (_, again) = sim.post(ask("a")).await;
    assert_eq!(cached(&again), 96, "same adapter: hit");
    let (_, other) = sim.post(ask("b")).await;
    assert_eq!(cached(&other), 0, "another adapter never hits a's blocks");
    let (_, base) = sim.post(ask("base-model")).await;
    assert_eq!(cached(&base), 0, "nor does the base model");
    let (_, b_again) = sim.post(ask("b")).await;
    assert_eq!(cached(&b_again), 96);
}

#[tokio::test]
async fn slots_loads_evictions_and_the_lora_gauge() {
    let start = unix_now();
    let sim = Sim::start(&args(&[
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-load-ms",
        "200",
        "--lora-modules",
        "a=/a",
        "b=/b",
        "c=/c",
    ]));
    let m = sim.metrics().await;
    assert_eq!(m.help_type, 2, "HELP and TYPE of vllm:lora_requests_info");
    assert_eq!((m.loads, m.evictions), (Some(0.0), Some(0.0)));

    let t = Instant::now();
    let (status, _) = sim
        .post(json!({"model": "a", "prompt": "hello", "max_tokens": 1}))
        .await;
    assert_eq!(status, 200);
    assert!(
        t.elapsed() >= Duration::from_millis(200),
        "the load takes 200 ms"
    );
    for model in ["a", "b", "a", "c"] {
        let (status, _) = sim
            .post(json!({"model": model, "prompt": "hello", "max_tokens": 1}))
            .await;
        assert_eq!(status, 200);
    }
    // a (load), a, b (load), a, c (load, evicts b: the least recently used idle adapter).
    let m = sim.metrics().await;
    assert_eq!((m.loads, m.evictions), (Some(3.0), Some(1.0)));
    let (_, _) = sim
        .post(json!({"model": "b", "prompt": "hello", "max_tokens": 1}))
        .await;
    let m = sim.metrics().await;
    assert_eq!((m.loads, m.evictions), (Some(4.0), Some(2.0)), "b evicts a");

    assert!(m.lora.iter().all(|s| s.max_lora == "2"));
    assert!(m.lora.iter().any(|s| s.running == "a"));
    assert!(m.is("", ""), "idle now: {:?}", m.current());
    let now = unix_now();
    for s in &m.lora {
        assert!(
            s.at >= start - 1.0 && s.at <= now + 1.0,
            "{s:?} not a Unix time"
        );
    }
    let mut label_sets: Vec<(&str, &str)> = m
        .lora
        .iter()
        .map(|s| (s.running.as_str(), s.waiting.as_str()))
        .collect();
    let n = label_sets.len();
    label_sets.sort_unstable();
    label_sets.dedup();
    assert_eq!(label_sets.len(), n, "one series per label set");
}

#[tokio::test]
async fn a_request_waits_for_a_busy_slot() {
    let sim = Sim::start(&[
        "--model",
        "base-model",
        "--enable-lora",
        "--max-loras",
        "1",
        "--lora-load-ms",
        "0",
        "--prefill-us-per-token",
        "0",
        "--ttft-base-ms",
        "0",
        "--decode-ms-per-token",
        "2",
        "--lora-modules",
        "a=/a",
        "b=/b",
    ]);
    let sim = std::sync::Arc::new(sim);
    let long = {
        let sim = sim.clone();
        tokio::spawn(async move {
            sim.post(json!({"model": "a", "prompt": "long", "max_tokens": 1000}))
                .await
        })
    };
    sim.wait_for("a running", |m| m.is("a", "")).await;
    let short = {
        let sim = sim.clone();
        tokio::spawn(async move {
            sim.post(json!({"model": "b", "prompt": "short", "max_tokens": 1}))
                .await
        })
    };
    // Gauges and label sets are read one after the other: wait until both show it (b counts
    // as waiting).
    sim.wait_for("b waiting behind a", |m| m.is("a", "b") && m.waiting == 1.0)
        .await;
    // The base model needs no slot: it is served while b waits.
    let (status, _) = sim
        .post(json!({"model": "base-model", "prompt": "x", "max_tokens": 1}))
        .await;
    assert_eq!(status, 200);
    assert!(sim.metrics().await.is("a", "b"), "b still waits");
    assert_eq!(long.await.unwrap().0, 200);
    assert_eq!(short.await.unwrap().0, 200);
    let m = sim.metrics().await;
    assert_eq!((m.loads, m.evictions), (Some(2.0), Some(1.0)));
    assert!(m.is("", ""));
}

#[tokio::test]
async fn without_enable_lora_adapters_are_plain_models() {
    let sim = Sim::start(&args(&["--lora-modules", "a=/a"]));
    let (status, _) = sim
        .post(json!({"model": "a", "prompt": "x", "max_tokens": 1}))
        .await;
    assert_eq!(status, 200);
    let m = sim.metrics().await;
    assert!(m.lora.is_empty() && m.loads.is_none() && m.help_type == 0);
    let list: Value = serde_json::from_str(&sim.get("/v1/models").await).unwrap();
    assert_eq!(list["data"][1]["parent"], "base-model");
}
