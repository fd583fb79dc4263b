//! Session keys through the real Envoy: requests naming one session in a body's
//! `prompt_cache_key` or a coding agent's own header stay on one pod, while requests naming none
//! spread. The prompts share no prefix, so only the session can hold them together.

use crate::common;

use std::collections::BTreeSet;

use common::{completion, served_by, text, Deployment};
use serde_json::Value;

const BUFFERED: &str = "override-host-buffered.yaml";

/// Sends `n` unrelated completions one after the other (an agent's calls), each with
/// `prompt_cache_key: key` when given and `headers`; returns the serving pods.
async fn pods_of(
    d: &Deployment,
    seed: u64,
    n: u64,
    key: Option<&str>,
    headers: &[(&str, &str)],
) -> Vec<String> {
    let mut pods = Vec::new();
    for i in 0..n {
        let mut body = completion(&format!("Task {i}. {}", text(seed * 1000 + i, 2000)), 4);
        if let Some(k) = key {
            body["prompt_cache_key"] = Value::String(k.into());
        }
        let o = d.post(0, "/v1/completions", &body, headers).await;
        pods.push(served_by(&o, &d.diag()));
    }
    pods
}

fn distinct(pods: &[String]) -> usize {
    pods.iter().collect::<BTreeSet<_>>().len()
}

/// Requests naming no session spread over the fleet (the control: without it, one pod for a
/// session could be an accident of the tie-break).
async fn sessionless_spread(d: &Deployment, seed: u64) {
    let pods = pods_of(d, seed, 8, None, &[]).await;
    assert!(
        distinct(&pods) >= 2,
        "8 unrelated prompts without a session all went to {pods:?}{}",
        d.diag()
    );
}

#[tokio::test]
async fn requests_sharing_a_prompt_cache_key_stick_to_one_pod_while_others_spread() {
    let d = Deployment::start(4, &[BUFFERED]).await;
    sessionless_spread(&d, 1).await;
    for (seed, key) in [(2, "agent-a"), (3, "agent-b")] {
        let pods = pods_of(&d, seed, 8, Some(key), &[]).await;
        assert_eq!(
            distinct(&pods),
            1,
            "prompt_cache_key {key} moved between pods {pods:?}{}",
            d.diag()
        );
    }
}

#[tokio::test]
async fn a_coding_agents_session_header_keeps_its_calls_on_one_pod() {
    let d = Deployment::start(4, &[BUFFERED]).await;
    sessionless_spread(&d, 4).await;
    // Codex CLI's header has an underscore: Envoy passes it by default.
    for (seed, header) in [
        (5, "session_id"),
        (6, "x-claude-code-session-id"),
        (7, "x-session-affinity"),
    ] {
        let value = format!("{header}-session");
        let pods = pods_of(&d, seed, 6, None, &[(header, value.as_str())]).await;
        assert_eq!(
            distinct(&pods),
            1,
            "{header} moved between pods {pods:?}{}",
            d.diag()
        );
    }
}
