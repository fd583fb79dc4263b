//! Prefill/decode roles of the `vllm-sim` binary over HTTP: a decode pod prefills on the pod the
//! prefill header names, then decodes with the transferred blocks; a prefill pod that fails,
//! hangs or cannot be named leaves the prefill local.

mod common;

use common::SimProcess;
use serde_json::{json, Value};

const HEADER: &str = "x-prefiller-host-port";
const PREFILLED_BY: &str = "x-vllm-sim-prefilled-by";

/// A running `vllm-sim`; killed on drop.
struct Sim {
    _process: SimProcess,
    addr: String,
    client: reqwest::Client,
}

impl Sim {
    fn start(args: &[&str]) -> Sim {
        let fast = ["--ttft-base-ms", "1", "--decode-ms-per-token", "1"];
        let process = SimProcess::start(&[&fast[..], args].concat());
        Sim {
            addr: process.addr.clone(),
            _process: process,
            client: reqwest::Client::new(),
        }
    }

    /// A completion with the prefill header set to `prefill` (if any): (prefilled-by, body).
    async fn complete(&self, prompt: &str, prefill: Option<&str>) -> (Option<String>, Value) {
        let mut req = self
            .client
            .post(format!("http://{}/v1/completions", self.addr))
            .json(&json!({"prompt": prompt, "max_tokens": 2}));
        if let Some(p) = prefill {
            req = req.header(HEADER, p);
        }
        let resp = req.send().await.expect("request");
        assert_eq!(resp.status(), 200);
        let by = resp
            .headers()
            .get(PREFILLED_BY)
            .map(|v| v.to_str().unwrap().to_string());
        (by, resp.json().await.expect("json"))
    }

    /// The sum of the samples of `name` (with `labels` inside the braces, if given).
    async fn metric(&self, name: &str, labels: &str) -> f64 {
        let text = self
            .client
            .get(format!("http://{}/metrics", self.addr))
            .send()
            .await
            .expect("scrape")
            .text()
            .await
            .expect("text");
        text.lines()
            .filter(|l| l.starts_with(name) && l.contains(labels))
            .filter(|l| l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

fn prompt(seed: u32, words: u32) -> String {
    (0..words)
        .map(|i| format!("w{}", seed * 100_000 + i))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
async fn a_decode_pod_prefills_on_the_named_pod_and_decodes_with_the_transferred_blocks() {
    let prefill = Sim::start(&["--role", "prefill", "--prefill-us-per-token", "200"]);
    let decode = Sim::start(&[
        "--role",
        "decode",
        "--kv-transfer-blocks-per-sec",
        "1000",
        "--prefill-us-per-token",
        "200",
    ]);
    let p = prompt(1, 600);
    let (by, body) = decode.complete(&p, Some(&prefill.addr)).await;
    assert_eq!(by.as_deref(), Some(prefill.addr.as_str()));
    assert_eq!(
        body["choices"][0]["text"].as_str().map(|t| !t.is_empty()),
        Some(true)
    );
    assert_eq!(
        prefill
            .metric("vllm_sim:prefills_for_others_total", "")
            .await,
        1.0
    );
    let tokens = prefill
        .metric("vllm_sim:prefill_for_others_prompt_tokens_total", "")
        .await;
    assert!(tokens >= 600.0, "{tokens}");
    assert_eq!(
        decode
            .metric("vllm_sim:remote_prefills_total", "outcome=\"ok\"")
            .await,
        1.0
    );
    let blocks = decode.metric("vllm_sim:kv_transfer_blocks_total", "").await;
    assert!(blocks >= (600 / 16) as f64, "{blocks}");
    // 1000 blocks/s: the wait is at least blocks ms.
    let secs = decode
        .metric("vllm_sim:kv_transfer_seconds_total", "")
        .await;
    assert!(secs >= blocks / 1000.0, "{secs} s for {blocks} blocks");
    // The decode pod found the transferred blocks cached: it computed only the rest.
    let hits = decode.metric("vllm:prefix_cache_hits_total", "").await;
    assert!(hits >= (blocks - 1.0) * 16.0, "{hits}");
    assert_eq!(
        decode
            .metric("vllm_sim:prefills_for_others_total", "")
            .await,
        0.0
    );

    // The same prompt again: every block is local, nothing more to transfer.
    let (by, _) = decode.complete(&p, Some(&prefill.addr)).await;
    assert_eq!(by.as_deref(), Some(prefill.addr.as_str()));
    let again = decode.metric("vllm_sim:kv_transfer_blocks_total", "").await;
    assert_eq!(again, blocks, "blocks already held are not transferred");
}

#[tokio::test]
async fn a_failed_hung_or_unnamed_prefill_pod_leaves_the_prefill_local() {
    let decode = Sim::start(&["--role", "decode", "--remote-prefill-timeout-ms", "300"]);
    // Refused: a port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let refused = closed.local_addr().unwrap().to_string();
    drop(closed);
    // Hung: a listener that never answers (the kernel completes the connection).
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hung_addr = hung.local_addr().unwrap().to_string();
    for (i, target) in [refused.as_str(), hung_addr.as_str(), "not-an-address"]
        .into_iter()
        .enumerate()
    {
        let (by, body) = decode
            .complete(&prompt(10 + i as u32, 300), Some(target))
            .await;
        assert_eq!(by, None, "{target}");
        assert!(
            body["usage"]["completion_tokens"].as_u64() == Some(2),
            "{body}"
        );
    }
    assert_eq!(
        decode
            .metric("vllm_sim:remote_prefills_total", "outcome=\"failed\"")
            .await,
        3.0
    );
    assert_eq!(
        decode.metric("vllm_sim:kv_transfer_blocks_total", "").await,
        0.0
    );
    drop(hung);

    // An aggregated pod ignores the header.
    let both = Sim::start(&[]);
    let (by, _) = both.complete(&prompt(20, 300), Some(&decode.addr)).await;
    assert_eq!(by, None);
    assert_eq!(
        decode
            .metric("vllm_sim:prefills_for_others_total", "")
            .await,
        0.0
    );
    assert_eq!(both.metric("vllm_sim:remote_prefills_total", "").await, 0.0);
}
