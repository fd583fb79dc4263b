//! Drives an OpenAI-compatible endpoint (normally the Envoy listener) with a [`Workload`]:
//! sessions run concurrently (closed loop, optionally capped), the requests of a session one
//! after another, every request a streaming completion whose timing and usage are recorded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use serde::Serialize;
use serde_json::Value;

use super::workload::{PlannedRequest, Previous, Workload};

/// Header every simulated pod puts on its responses.
pub const POD_HEADER: &str = "x-vllm-sim-pod";

/// Outcome of one streamed request, with everything a test may want to compare.
#[derive(Debug, Clone, Default)]
pub struct StreamOutcome {
    /// HTTP status (None if no response arrived).
    pub status: Option<u16>,
    /// Response headers (lower-case names).
    pub headers: Vec<(String, String)>,
    /// Every SSE `data:` payload in order, `[DONE]` included.
    pub events: Vec<String>,
    /// Time to the response headers: the proxy path and the pod's accept, before any prefill
    /// (a streaming pod answers its headers at once).
    pub headers_at: Option<Duration>,
    /// Time to the first content chunk (or the first chunk if none has content).
    pub ttft: Option<Duration>,
    /// Time to the end of the response.
    pub e2e: Duration,
    /// Concatenated generated text.
    pub text: String,
    /// The `usage` object of the stream, if any.
    pub usage: Option<Value>,
    /// Non-SSE body (error responses), at most 64 KiB.
    pub body: String,
    /// Transport or protocol error.
    pub error: Option<String>,
    /// The stream ended with `data: [DONE]`.
    pub done: bool,
}

impl StreamOutcome {
    /// First value of a response header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The serving pod (`x-vllm-sim-pod`).
    pub fn pod(&self) -> Option<&str> {
        self.header(POD_HEADER)
    }

    /// 2xx with a complete stream.
    #[allow(dead_code)] // the end-to-end tests' harness (tests/integration/common mounts this file)
    pub fn ok(&self) -> bool {
        self.error.is_none() && matches!(self.status, Some(200..=299)) && self.done
    }

    fn usage_u64(&self, path: &[&str]) -> Option<u64> {
        let mut v = self.usage.as_ref()?;
        for k in path {
            v = v.get(*k)?;
        }
        v.as_u64()
    }

    /// `usage.prompt_tokens`.
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.usage_u64(&["prompt_tokens"])
    }

    /// `usage.prompt_tokens_details.cached_tokens`.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.usage_u64(&["prompt_tokens_details", "cached_tokens"])
    }

    /// `usage.completion_tokens`.
    pub fn completion_tokens(&self) -> Option<u64> {
        self.usage_u64(&["completion_tokens"])
    }
}

/// A response's headers as (name, value) pairs, values read lossily as UTF-8.
pub fn header_pairs(headers: &reqwest::header::HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

/// An HTTP client for benchmark traffic (no proxy, generous pool, no overall timeout).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(1024)
        .connect_timeout(Duration::from_secs(5))
        .build()
        .expect("reqwest client")
}

/// Sends one POST and consumes the response: SSE is parsed event by event (text, usage, TTFT);
/// any other body is kept in [`StreamOutcome::body`]. Never fails: errors land in the outcome.
pub async fn stream_request(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    headers: &[(String, String)],
    timeout: Duration,
) -> StreamOutcome {
    let start = Instant::now();
    let mut out = StreamOutcome::default();
    let fut = stream_inner(client, url, body, headers, start, &mut out);
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => out.error = Some(format!("{e:#}")),
        Err(_) => out.error = Some(format!("timed out after {timeout:?}")),
    }
    out.e2e = start.elapsed();
    out
}

async fn stream_inner(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    headers: &[(String, String)],
    start: Instant,
    out: &mut StreamOutcome,
) -> Result<()> {
    let mut req = client.post(url).json(body);
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let resp = req.send().await.context("request failed")?;
    out.headers_at = Some(start.elapsed());
    out.status = Some(resp.status().as_u16());
    out.headers = header_pairs(resp.headers());
    let is_sse = out
        .header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream"));
    let mut stream = resp.bytes_stream();
    if !is_sse {
        let mut buf = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.context("reading body")?;
            if buf.len() < 64 * 1024 {
                buf.extend_from_slice(&chunk[..chunk.len().min(64 * 1024 - buf.len())]);
            }
        }
        out.body = String::from_utf8_lossy(&buf).into_owned();
        // A non-streamed JSON completion still has usage and text.
        if let Ok(v) = serde_json::from_str::<Value>(&out.body) {
            out.usage = v.get("usage").filter(|u| !u.is_null()).cloned();
            if let Some(t) = completion_text(&v) {
                out.text = t;
            }
        }
        out.done = out.status.is_some_and(|s| (200..300).contains(&s));
        return Ok(());
    }
    let mut pending: Vec<u8> = Vec::new();
    let mut first_chunk: Option<Duration> = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.context("reading event stream")?;
        let now = start.elapsed();
        pending.extend_from_slice(&chunk);
        while let Some((end, sep)) = find_event_end(&pending) {
            let event: Vec<u8> = pending.drain(..end + sep).collect();
            let event = String::from_utf8_lossy(&event[..end]).into_owned();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim_start();
                out.events.push(data.to_string());
                if data == "[DONE]" {
                    out.done = true;
                    continue;
                }
                first_chunk.get_or_insert(now);
                let v: Value = match serde_json::from_str(data) {
                    Ok(v) => v,
                    Err(_) => continue,
                };
                if let Some(t) = delta_text(&v) {
                    if !t.is_empty() {
                        out.ttft.get_or_insert(now);
                        out.text.push_str(&t);
                    }
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    out.usage = Some(u.clone());
                }
            }
        }
    }
    if out.ttft.is_none() {
        out.ttft = first_chunk;
    }
    Ok(())
}

/// End of the first SSE event in `buf`: (index of the separator, separator length).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

fn delta_text(v: &Value) -> Option<String> {
    let c = v.get("choices")?.get(0)?;
    c.get("delta")
        .and_then(|d| d.get("content"))
        .and_then(Value::as_str)
        .or_else(|| c.get("text").and_then(Value::as_str))
        .map(str::to_string)
}

fn completion_text(v: &Value) -> Option<String> {
    let c = v.get("choices")?.get(0)?;
    c.get("message")
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str)
        .or_else(|| c.get("text").and_then(Value::as_str))
        .map(str::to_string)
}

/// One request's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    /// Session id.
    pub session: String,
    /// Position within the session.
    pub turn: usize,
    /// Send time, milliseconds since the start of the run.
    pub start_ms: f64,
    /// Time to the response headers, milliseconds.
    pub headers_ms: Option<f64>,
    /// Time to first token, milliseconds.
    pub ttft_ms: Option<f64>,
    /// End-to-end latency, milliseconds.
    pub e2e_ms: f64,
    /// HTTP status.
    pub status: Option<u16>,
    /// Error (transport, non-2xx with body excerpt, or incomplete stream).
    pub error: Option<String>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// Serving pod (`x-vllm-sim-pod`).
    pub pod: Option<String>,
}

impl RequestRecord {
    fn from_outcome(session: &str, turn: usize, start_ms: f64, o: &StreamOutcome) -> Self {
        let error = if let Some(e) = &o.error {
            Some(e.clone())
        } else if !matches!(o.status, Some(200..=299)) {
            Some(format!(
                "HTTP {}: {}",
                o.status.unwrap_or(0),
                o.body.chars().take(200).collect::<String>()
            ))
        } else if !o.done {
            Some("stream ended without [DONE]".into())
        } else {
            None
        };
        Self {
            session: session.to_string(),
            turn,
            start_ms,
            headers_ms: o.headers_at.map(|d| d.as_secs_f64() * 1e3),
            ttft_ms: o.ttft.map(|d| d.as_secs_f64() * 1e3),
            e2e_ms: o.e2e.as_secs_f64() * 1e3,
            status: o.status,
            error,
            prompt_tokens: o.prompt_tokens(),
            cached_tokens: o.cached_tokens(),
            completion_tokens: o.completion_tokens(),
            pod: o.pod().map(str::to_string),
        }
    }
}

/// How to run a workload.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Base URL, e.g. `http://127.0.0.1:8080`.
    pub target: String,
    /// At most this many sessions in flight (None: all).
    pub concurrency: Option<usize>,
    /// Per-request timeout.
    pub request_timeout: Duration,
    /// Label of the run in reports.
    pub label: String,
    /// Show a progress bar on stderr (drawn only when stderr is a terminal).
    pub progress: bool,
}

/// All records of one run.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    /// Label (e.g. `round-robin`, `kv-router`).
    pub label: String,
    /// Workload name.
    pub workload: String,
    /// Workload parameters.
    pub description: String,
    /// Target URL.
    pub target: String,
    /// Wall time of the run, seconds.
    pub duration_s: f64,
    /// Per-request measurements, in send order.
    pub records: Vec<RequestRecord>,
    /// Every request sent (path, body), in send order: what the oracles replay.
    #[serde(skip)]
    pub sent: Vec<(&'static str, Value)>,
}

/// Runs `workload` against `opts.target`.
pub async fn run(workload: Workload, opts: &RunOptions) -> Result<RunResult> {
    let client = client();
    let base = opts.target.trim_end_matches('/').to_string();
    let limit = opts.concurrency.unwrap_or(workload.sessions.len()).max(1);
    let sem = Arc::new(tokio::sync::Semaphore::new(limit));
    let start = Instant::now();
    let bar = if opts.progress {
        indicatif::ProgressBar::new(workload.requests as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{prefix:>14} [{bar:30}] {pos}/{len} requests {elapsed_precise} {msg}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_prefix(opts.label.clone());
    let mut tasks = tokio::task::JoinSet::new();
    for mut session in workload.sessions {
        let bar = bar.clone();
        let client = client.clone();
        let base = base.clone();
        let sem = sem.clone();
        let timeout = opts.request_timeout;
        tasks.spawn(async move {
            let _permit = sem.acquire_owned().await.expect("semaphore open");
            let mut records = Vec::new();
            let mut last: Option<StreamOutcome> = None;
            loop {
                let prev = last.as_ref().map(|o| Previous { text: &o.text });
                let Some(PlannedRequest {
                    api,
                    body,
                    headers,
                    turn,
                    not_before,
                    think,
                }) = session.next_request(prev)
                else {
                    break;
                };
                if let Some(at) = not_before {
                    tokio::time::sleep_until((start + at).into()).await;
                }
                if let Some(pause) = think {
                    tokio::time::sleep(pause).await;
                }
                let url = format!("{base}{}", api.path());
                let sent = start.elapsed().as_secs_f64() * 1e3;
                let o = stream_request(&client, &url, &body, &headers, timeout).await;
                let record = RequestRecord::from_outcome(session.id(), turn, sent, &o);
                if record.error.is_some() {
                    bar.set_message("(errors)");
                }
                bar.inc(1);
                records.push((record, (api.path(), body)));
                last = Some(o);
            }
            records
        });
    }
    let mut records = Vec::new();
    while let Some(r) = tasks.join_next().await {
        records.extend(r.context("session task panicked")?);
    }
    let duration_s = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    records.sort_by(|a, b| a.0.start_ms.total_cmp(&b.0.start_ms));
    let (records, sent): (Vec<_>, Vec<_>) = records.into_iter().unzip();
    Ok(RunResult {
        label: opts.label.clone(),
        workload: workload.name,
        description: workload.description,
        target: base,
        duration_s,
        records,
        sent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_boundaries() {
        assert_eq!(find_event_end(b"data: x\n\ndata: y"), Some((7, 2)));
        assert_eq!(find_event_end(b"data: x\r\n\r\n"), Some((7, 4)));
        assert_eq!(find_event_end(b"data: x\n"), None);
    }

    #[test]
    fn delta_and_text() {
        let chat: Value =
            serde_json::from_str(r#"{"choices":[{"delta":{"content":"hi"}}]}"#).unwrap();
        assert_eq!(delta_text(&chat).as_deref(), Some("hi"));
        let cmpl: Value = serde_json::from_str(r#"{"choices":[{"text":"yo"}]}"#).unwrap();
        assert_eq!(delta_text(&cmpl).as_deref(), Some("yo"));
        let usage: Value = serde_json::from_str(r#"{"choices":[],"usage":{}}"#).unwrap();
        assert_eq!(delta_text(&usage), None);
    }
}
