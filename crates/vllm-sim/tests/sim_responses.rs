//! `/v1/responses` of the `vllm-sim` binary over HTTP: the object and its SSE events, chaining
//! with `previous_response_id` through the prefix cache, and the pod-local response store.

mod common;

use futures::StreamExt;
use serde_json::{json, Value};

use common::{Sim, FAST};

impl Sim {
    async fn respond(&self, body: &Value) -> (u16, Value) {
        let resp = self
            .client
            .post(format!("{}/v1/responses", self.base))
            .json(body)
            .send()
            .await
            .expect("request");
        let status = resp.status().as_u16();
        (status, resp.json().await.expect("json body"))
    }

    /// A streamed response's events, `(event name, data)` in order.
    async fn respond_stream(&self, body: &Value) -> Vec<(String, Value)> {
        let resp = self
            .client
            .post(format!("{}/v1/responses", self.base))
            .json(body)
            .send()
            .await
            .expect("request");
        assert_eq!(resp.status(), 200);
        assert!(resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        let mut raw = Vec::new();
        let mut body = resp.bytes_stream();
        while let Some(chunk) = body.next().await {
            raw.extend_from_slice(&chunk.expect("chunk"));
        }
        String::from_utf8(raw)
            .expect("utf-8")
            .split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                let (mut name, mut data) = (String::new(), Value::Null);
                for line in e.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = n.to_string();
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data = serde_json::from_str(d).expect("event data is JSON");
                    }
                }
                assert_eq!(data["type"], name.as_str(), "{e}");
                (name, data)
            })
            .collect()
    }
}

fn text(resp: &Value) -> &str {
    resp["output"][0]["content"][0]["text"]
        .as_str()
        .expect("output text")
}

fn usage(resp: &Value, field: &str) -> u64 {
    resp["usage"][field].as_u64().expect(field)
}

fn cached(resp: &Value) -> u64 {
    resp["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

const INSTRUCTIONS: &str = "You are a careful assistant who answers in one short sentence.";

#[tokio::test]
async fn a_chained_response_extends_the_stored_conversation_and_hits_its_cache() {
    let sim = Sim::start(FAST);
    let first_input = "Tell me about prefix caches. ".repeat(20);
    let (status, first) = sim
        .respond(&json!({"model": "sim-model", "instructions": INSTRUCTIONS,
                          "input": first_input, "max_output_tokens": 6}))
        .await;
    assert_eq!(status, 200, "{first}");
    let id = first["id"].as_str().unwrap();
    assert!(id.starts_with("resp_") && id.len() > 5, "{id}");
    assert_eq!(first["object"], "response");
    assert_eq!(first["status"], "completed");
    assert_eq!(first["model"], "sim-model");
    assert_eq!(first["output"][0]["type"], "message");
    assert_eq!(first["output"][0]["role"], "assistant");
    assert_eq!(first["output"][0]["content"][0]["type"], "output_text");
    assert!(!text(&first).is_empty());
    assert_eq!(usage(&first, "output_tokens"), 6);
    assert_eq!(
        usage(&first, "total_tokens"),
        usage(&first, "input_tokens") + 6
    );
    assert_eq!(cached(&first), 0);

    // The chained turn sends only its new input: the pod prepends the stored conversation.
    let chained = json!({"model": "sim-model", "instructions": INSTRUCTIONS,
                         "previous_response_id": id,
                         "input": [{"role": "user", "content": [{"type": "input_text", "text": "And why?"}]}],
                         "max_output_tokens": 4});
    let (status, second) = sim.respond(&chained).await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["previous_response_id"], id);
    assert_ne!(second["id"], first["id"]);
    let first_prompt = usage(&first, "input_tokens");
    assert!(
        usage(&second, "input_tokens") > first_prompt,
        "the stored conversation is part of the prompt: {second}"
    );
    assert!(
        cached(&second) >= first_prompt / 16 * 16 - 16,
        "the previous turn's blocks are hits: {second}"
    );

    // Without the chain the same input is a new, short, uncached prompt.
    let mut alone = chained.clone();
    alone
        .as_object_mut()
        .unwrap()
        .remove("previous_response_id");
    let (_, alone) = sim.respond(&alone).await;
    assert!(usage(&alone, "input_tokens") < first_prompt);
}

#[tokio::test]
async fn responses_are_held_by_the_pod_that_made_them() {
    let (a, b) = (Sim::start(FAST), Sim::start(FAST));
    let (_, first) = a
        .respond(&json!({"input": "hello there", "max_output_tokens": 2}))
        .await;
    let id = first["id"].as_str().unwrap();
    let chained = json!({"input": "again", "previous_response_id": id});
    let (status, other) = b.respond(&chained).await;
    assert_eq!(status, 404, "{other}");
    assert!(other["error"]["message"].as_str().unwrap().contains(id));
    assert_eq!(a.respond(&chained).await.0, 200);

    // store: false keeps nothing to chain from.
    let (_, unstored) = a
        .respond(&json!({"input": "x", "store": false, "max_output_tokens": 1}))
        .await;
    assert_eq!(unstored["store"], false);
    let (status, _) = a
        .respond(&json!({"input": "y", "previous_response_id": unstored["id"]}))
        .await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn a_streamed_response_sends_the_responses_events_and_is_stored() {
    let sim = Sim::start(FAST);
    let events = sim
        .respond_stream(
            &json!({"input": "Stream me a few words, please. ".repeat(10), "stream": true,
                                "max_output_tokens": 5}),
        )
        .await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"response.created"), "{names:?}");
    assert_eq!(names.last(), Some(&"response.completed"), "{names:?}");
    assert_eq!(
        names
            .iter()
            .filter(|n| **n == "response.output_text.delta")
            .count(),
        5
    );
    for (i, (_, data)) in events.iter().enumerate() {
        assert_eq!(data["sequence_number"], i as u64);
    }
    let id = events[0].1["response"]["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("resp_"));
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    let streamed: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    let done = &events.last().unwrap().1["response"];
    assert_eq!(done["id"], id.as_str());
    assert_eq!(done["status"], "completed");
    assert_eq!(text(done), streamed);
    assert_eq!(usage(done, "output_tokens"), 5);
    assert!(usage(done, "input_tokens") > 0);

    let events = sim
        .respond_stream(&json!({"input": "More.", "stream": true, "previous_response_id": id}))
        .await;
    let done = &events.last().unwrap().1["response"];
    assert_eq!(done["previous_response_id"], id.as_str());
    assert!(cached(done) > 0, "{done}");
}

#[tokio::test]
async fn bad_responses_requests_are_400_or_404() {
    let sim = Sim::start(FAST);
    for (body, status) in [
        (json!({"input": 3}), 400),
        (json!({"input": [{"content": "no role"}]}), 400),
        (json!({"input": "x", "max_output_tokens": 0}), 400),
        (json!({"model": "nope", "input": "x"}), 404),
        (
            json!({"input": "x", "previous_response_id": "resp_unknown"}),
            404,
        ),
        (json!({"model": "sim-model"}), 400),
    ] {
        let (got, resp) = sim.respond(&body).await;
        assert_eq!(got, status, "{body} -> {resp}");
        assert!(resp["error"]["message"].is_string(), "{resp}");
    }
}
