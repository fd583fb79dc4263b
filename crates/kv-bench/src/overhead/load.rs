//! The load: fixed-size `/v1/completions` bodies sent in a closed loop, and the Envoy counter of
//! ext_proc fail-open events.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use kv_testkit::prose::prose;
use kv_testkit::splitmix::SplitMix64;

/// The model the bodies name (vllm-sim's default).
pub(super) const MODEL: &str = "sim-model";

/// Sixteen distinct `/v1/completions` bodies whose prompt is exactly `bytes` bytes of text.
pub(super) fn bodies(bytes: usize) -> Vec<Bytes> {
    (0..16u64)
        .map(|i| {
            let mut text = String::with_capacity(bytes + 64);
            prose(
                &mut SplitMix64::derive(i, "overhead", bytes as u64),
                bytes,
                &mut text,
            );
            // prose writes ASCII, so any byte index is a char boundary.
            text.truncate(bytes);
            let v = serde_json::json!({
                "model": MODEL,
                "prompt": text,
                "max_tokens": 1,
                "stream": false,
            });
            Bytes::from(serde_json::to_vec(&v).expect("json"))
        })
        .collect()
}

/// Latencies (ms) of successful requests, error count and the first error.
#[derive(Debug, Default)]
pub(super) struct Batch {
    pub(super) latencies: Vec<f64>,
    pub(super) errors: usize,
    pub(super) first_error: Option<String>,
    pub(super) wall: Duration,
}

pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

pub(super) async fn one_request(
    client: &reqwest::Client,
    url: &str,
    body: Bytes,
) -> Result<(), String> {
    let send = async {
        let r = client
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| format!("send: {e}"))?;
        let status = r.status();
        let body = r.bytes().await.map_err(|e| format!("read: {e}"))?;
        if status.is_success() {
            Ok(())
        } else {
            let snippet = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
            Err(format!("HTTP {status}: {snippet}"))
        }
    };
    tokio::time::timeout(REQUEST_TIMEOUT, send)
        .await
        .unwrap_or_else(|_| Err(format!("timed out after {REQUEST_TIMEOUT:?}")))
}

/// Sends `n` requests with `concurrency` in flight; `urls` are used in turn (direct: one per pod).
pub(super) async fn drive(
    client: &reqwest::Client,
    urls: &[String],
    bodies: &Arc<Vec<Bytes>>,
    n: usize,
    concurrency: usize,
) -> Batch {
    let next = Arc::new(AtomicUsize::new(0));
    let urls: Arc<Vec<String>> = Arc::new(urls.to_vec());
    let start = Instant::now();
    let workers: Vec<_> = (0..concurrency.max(1))
        .map(|_| {
            let (client, urls, bodies, next) =
                (client.clone(), urls.clone(), bodies.clone(), next.clone());
            tokio::spawn(async move {
                let mut out = Batch::default();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let url = &urls[i % urls.len()];
                    let t = Instant::now();
                    match one_request(&client, url, bodies[i % bodies.len()].clone()).await {
                        Ok(()) => out.latencies.push(t.elapsed().as_secs_f64() * 1e3),
                        Err(e) => {
                            out.errors += 1;
                            out.first_error.get_or_insert(e);
                        }
                    }
                }
                out
            })
        })
        .collect();
    let mut all = Batch::default();
    for w in workers {
        match w.await {
            Ok(b) => {
                all.latencies.extend(b.latencies);
                all.errors += b.errors;
                if all.first_error.is_none() {
                    all.first_error = b.first_error;
                }
            }
            Err(e) => {
                all.errors += 1;
                all.first_error
                    .get_or_insert(format!("worker panicked: {e}"));
            }
        }
    }
    all.wall = start.elapsed();
    all
}

/// `<name>: <value>` from Envoy's `/stats` text (0 when absent).
pub(super) fn envoy_counter(stats: &str, name: &str) -> u64 {
    stats
        .lines()
        .filter_map(|l| l.split_once(": "))
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

pub(super) const FAILED_OPEN_STAT: &str = "http.llm.ext_proc.failure_mode_allowed";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_come_from_stats_text() {
        let stats =
            "http.llm.ext_proc.failure_mode_allowed: 3\nhttp.llm.ext_proc.streams_started: 9\n";
        assert_eq!(envoy_counter(stats, FAILED_OPEN_STAT), 3);
        assert_eq!(envoy_counter(stats, "missing"), 0);
    }

    #[test]
    fn bodies_have_exact_prompt_sizes_and_differ() {
        let b = bodies(1024);
        assert_eq!(b.len(), 16);
        let v: serde_json::Value = serde_json::from_slice(&b[0]).unwrap();
        assert_eq!(v["prompt"].as_str().unwrap().len(), 1024);
        assert_eq!(v["max_tokens"], 1);
        assert_ne!(b[0], b[1]);
    }
}
