//! End-to-end tests of the `vllm-sim` binary over HTTP.

mod common;

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

use common::{Sim, FAST};

impl Sim {
    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self
            .client
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
            .expect("request");
        let status = resp.status().as_u16();
        (status, resp.json().await.expect("json body"))
    }

    async fn get_text(&self, path: &str) -> (u16, String) {
        let resp = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("request");
        (resp.status().as_u16(), resp.text().await.expect("body"))
    }
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

#[tokio::test]
async fn repeated_prompt_hits_the_prefix_cache() {
    let sim = Sim::start(&["--pod-name", "pod-a"]);
    // 330 bytes = 83 pseudo tokens = 5 full 16-token blocks.
    let prompt = "x".repeat(100) + &"abcdefghij".repeat(23);
    let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4});
    let resp = sim
        .client
        .post(format!("{}/v1/completions", sim.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-vllm-sim-pod"], "pod-a");
    let first: Value = resp.json().await.unwrap();
    assert_eq!(cached(&first), 0);
    assert_eq!(first["object"], "text_completion");
    assert!(first["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(first["model"], "sim-model");
    assert_eq!(first["usage"]["prompt_tokens"], 83);
    assert_eq!(first["usage"]["completion_tokens"], 4);
    assert_eq!(first["usage"]["total_tokens"], 87);
    let choice = &first["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["logprobs"].is_null() && choice["stop_reason"].is_null());
    assert!(!choice["text"].as_str().unwrap().is_empty());

    let (status, second) = sim.post("/v1/completions", &body).await;
    assert_eq!(status, 200);
    assert_eq!(cached(&second), 5 * 16);
    assert_eq!(second["choices"][0]["text"], first["choices"][0]["text"]);

    // Chat: same conversation twice.
    let chat = json!({"messages": [{"role": "user", "content": "hello ".repeat(40)}],
                      "max_completion_tokens": 2});
    let (status, a) = sim.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200);
    assert_eq!(a["object"], "chat.completion");
    assert!(a["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(a["choices"][0]["message"]["role"], "assistant");
    assert_eq!(a["choices"][0]["message"]["tool_calls"], json!([]));
    assert_eq!(a["usage"]["completion_tokens"], 2);
    let (_, b) = sim.post("/v1/chat/completions", &chat).await;
    assert!(cached(&b) > 0);
    assert_eq!(cached(&b) % 16, 0);
}

#[tokio::test]
async fn streamed_responses_end_with_usage() {
    let sim = Sim::start(FAST);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "stream me", "max_tokens": 5, "stream": true,
                   "stream_options": {"include_usage": true}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                   "stream": true, "stream_options": {"include_usage": true}}),
        ),
    ] {
        let resp = sim
            .client
            .post(format!("{}{path}", sim.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert!(resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        assert!(resp.headers().contains_key("x-vllm-sim-pod"));
        let mut text = String::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        }
        let events: Vec<&str> = text
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").expect("data: prefix"))
            .collect();
        assert_eq!(*events.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let usage = chunks.last().unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["completion_tokens"], 5);
        assert!(usage["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
        let content: Vec<&Value> = chunks[..chunks.len() - 1].iter().collect();
        if path == "/v1/chat/completions" {
            assert_eq!(content.len(), 6, "role chunk + 5 tokens");
            assert_eq!(content[0]["choices"][0]["delta"]["role"], "assistant");
            assert!(content
                .iter()
                .all(|c| c["object"] == "chat.completion.chunk"));
        } else {
            assert_eq!(content.len(), 5);
            assert!(content.iter().all(|c| c["object"] == "text_completion"));
        }
        let last = content.last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert!(content[..content.len() - 1]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()));
    }
}

#[tokio::test]
async fn models_health_and_metrics_answer_like_vllm() {
    let sim = Sim::start(&[
        "--model",
        "m1",
        "--model",
        "m2",
        "--num-gpu-blocks",
        "1000",
        "--block-size",
        "16",
    ]);
    let (status, body) = sim.get_text("/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "m1");
    assert_eq!(models["data"][1]["id"], "m2");
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["owned_by"], "vllm");
    assert_eq!(models["data"][0]["root"], "m1");
    assert!(models["data"][0]["parent"].is_null());
    assert_eq!(models["data"][0]["max_model_len"], 4_194_304);

    let (status, body) = sim.get_text("/health").await;
    assert_eq!((status, body.as_str()), (200, ""));

    // A request without `model` goes to the first model.
    let (status, r) = sim
        .post("/v1/completions", &json!({"prompt": "p", "max_tokens": 1}))
        .await;
    assert_eq!((status, r["model"].as_str()), (200, Some("m1")));

    let (status, text) = sim.get_text("/metrics").await;
    assert_eq!(status, 200);
    for needle in [
        "# TYPE vllm:num_requests_waiting gauge",
        "# TYPE vllm:num_requests_running gauge",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        "# TYPE vllm:prefix_cache_queries counter",
        "# TYPE vllm:prefix_cache_hits counter",
        "# TYPE vllm:prompt_tokens counter",
        "# TYPE vllm:generation_tokens counter",
        "# TYPE vllm:request_success counter",
        "vllm:num_requests_running{model_name=\"m1\",engine=\"0\"} 0.0",
        "vllm:prefix_cache_queries_total{model_name=\"m1\",engine=\"0\"} 1.0",
        "vllm:generation_tokens_total{model_name=\"m1\",engine=\"0\"} 1.0",
        "vllm:request_success_total{model_name=\"m1\",engine=\"0\",finished_reason=\"length\"} 1.0",
        "block_size=\"16\"",
        "num_gpu_blocks=\"1000\"",
        "enable_prefix_caching=\"True\"",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    // Every sample line is `name{labels} value` with a float value.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').expect("sample line");
        // `vllm_sim:` families are the simulator's own P/D counters (docs/vllm-sim.md).
        assert!(
            (series.starts_with("vllm:") || series.starts_with("vllm_sim:"))
                && series.ends_with('}'),
            "{line}"
        );
        assert!(
            value.parse::<f64>().is_ok() && value.contains('.'),
            "{line}"
        );
    }
}

#[tokio::test]
async fn errors_have_the_vllm_shape() {
    let sim = Sim::start(&["--max-model-len", "100"]);
    let resp = sim
        .client
        .post(format!("{}/v1/completions", sim.base))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert!(resp.headers().contains_key("x-vllm-sim-pod"));
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["type"], "BadRequestError");
    assert_eq!(err["error"]["code"], 400);
    assert!(err["error"]["param"].is_null());
    assert!(err["error"]["message"].is_string());

    let (status, err) = sim
        .post("/v1/completions", &json!({"model": "nope", "prompt": "x"}))
        .await;
    assert_eq!(status, 404);
    assert_eq!(err["error"]["type"], "NotFoundError");
    assert_eq!(err["error"]["message"], "The model `nope` does not exist.");
    assert_eq!(err["error"]["code"], 404);

    for bad in [
        json!({"prompt": "x".repeat(400)}),
        json!({"prompt": "x", "max_tokens": 1000}),
        json!({"prompt": "x", "max_tokens": 0}),
        json!({"prompt": "x", "max_tokens": "many"}),
        json!({"prompt": ""}),
        json!({"prompt": 5}),
        json!({"prompt": "x", "max_tokens": 1e30}),
        json!({"prompt": "x", "max_tokens": -1}),
        json!({"prompt": "x", "max_tokens": u64::MAX}),
        json!({"prompt": "x", "stream_options": {"include_usage": "yes"}}),
        json!({"prompt": [4_294_967_296u64]}),
        json!({"prompt": "x", "stream": "yes"}),
        json!([]),
        json!(null),
    ] {
        let (status, err) = sim.post("/v1/completions", &bad).await;
        assert_eq!(status, 400, "{bad}");
        assert_eq!(err["error"]["type"], "BadRequestError");
    }
    let (status, err) = sim
        .post("/v1/chat/completions", &json!({"model": "sim-model"}))
        .await;
    assert_eq!((status, &err["error"]["code"]), (400, &json!(400)));
}

#[tokio::test]
async fn reset_prefix_cache_makes_next_request_uncached() {
    let sim = Sim::start(FAST);
    let body = json!({"prompt": "r".repeat(200), "max_tokens": 1});
    sim.post("/v1/completions", &body).await;
    let (_, hit) = sim.post("/v1/completions", &body).await;
    assert_eq!(cached(&hit), 48);
    let resp = sim
        .client
        .post(format!("{}/reset_prefix_cache", sim.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let (_, miss) = sim.post("/v1/completions", &body).await;
    assert_eq!(cached(&miss), 0);
}

#[tokio::test]
async fn four_megabyte_prompt_is_fast() {
    let sim = Sim::start(FAST);
    let prompt: String = (0..4 * 1024 * 1024 / 8)
        .map(|i| format!("{:07x} ", i % 0xfff_ffff))
        .collect();
    assert_eq!(prompt.len(), 4 * 1024 * 1024);
    let body = json!({"prompt": prompt, "max_tokens": 2});
    let start = Instant::now();
    let (status, r) = sim.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], 1024 * 1024);
    let (status, r) = sim.post("/v1/completions", &body).await;
    assert_eq!(status, 200);
    // The cache holds 2048 blocks, all of them the prompt's head.
    assert_eq!(cached(&r), 2048 * 16);
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn client_disconnect_frees_the_slot() {
    let sim = Sim::start(&["--max-num-seqs", "1", "--decode-ms-per-token", "5"]);
    let long = json!({"prompt": "a", "max_tokens": 100000, "stream": true});
    let resp = sim
        .client
        .post(format!("{}/v1/completions", sim.base))
        .json(&long)
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    drop(stream);
    // With the only slot freed, a short request completes promptly.
    let short = json!({"prompt": "b", "max_tokens": 1});
    let r = tokio::time::timeout(Duration::from_secs(5), sim.post("/v1/completions", &short))
        .await
        .expect("slot was not freed");
    assert_eq!(r.0, 200);
    let (_, text) = sim.get_text("/metrics").await;
    assert!(text.contains("finished_reason=\"abort\"} 1.0"), "{text}");
}

#[tokio::test]
async fn bursts_queue_beyond_max_num_seqs() {
    // Each request decodes for about 1 s: the first two hold both slots that long, the window
    // in which all five are in and the other three wait.
    let sim = Sim::start(&["--max-num-seqs", "2", "--decode-ms-per-token", "100"]);
    let sim = std::sync::Arc::new(sim);
    let mut handles = Vec::new();
    for i in 0..5 {
        let sim = sim.clone();
        handles.push(tokio::spawn(async move {
            let body = json!({"prompt": format!("request {i}"), "max_tokens": 10});
            sim.post("/v1/completions", &body).await.0
        }));
    }
    // Wait until all five have arrived (running + waiting = 5), instead of a fixed pause.
    let series = |name: &str| format!("{name}{{model_name=\"sim-model\",engine=\"0\"}} ");
    let deadline = Instant::now() + Duration::from_secs(5);
    let text = loop {
        let (_, text) = sim.get_text("/metrics").await;
        let value = |name: &str| -> f64 {
            let prefix = series(name);
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
                .unwrap_or(0.0)
        };
        if value("vllm:num_requests_running") + value("vllm:num_requests_waiting") >= 5.0 {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the five requests never all arrived:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(
        text.contains("vllm:num_requests_running{model_name=\"sim-model\",engine=\"0\"} 2.0"),
        "{text}"
    );
    assert!(
        text.contains("vllm:num_requests_waiting{model_name=\"sim-model\",engine=\"0\"} 3.0"),
        "{text}"
    );
    assert!(!text.contains("vllm:kv_cache_usage_perc{model_name=\"sim-model\",engine=\"0\"} 0.0\n"));
    for h in handles {
        assert_eq!(h.await.unwrap(), 200);
    }
}
