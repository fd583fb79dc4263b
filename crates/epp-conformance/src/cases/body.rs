//! Body shapes and responses: uploads in pieces, header-only requests, bodies the picker cannot
//! parse, and streamed (SSE) responses passed through intact.

use std::time::Duration;

use serde_json::{json, Value};

use super::{completion, CaseRes, Ctx};
use crate::http::{self, chunk, Resp, Write, LAST_CHUNK};
use crate::rig::MODEL;

/// `usage.prompt_tokens` of a completion response.
fn prompt_tokens(r: &Resp) -> Result<u64, String> {
    let v: Value = serde_json::from_slice(&r.body)
        .map_err(|e| format!("the answer is not JSON ({e}): {}", r.brief()))?;
    if v["choices"].as_array().is_none_or(|c| c.is_empty()) {
        return Err(format!("the answer has no choices: {}", r.brief()));
    }
    v["usage"]["prompt_tokens"]
        .as_u64()
        .ok_or_else(|| format!("the answer has no usage.prompt_tokens: {}", r.brief()))
}

/// Uploads `body` in `writes` (built from the body's bytes) and checks a pod answered the same
/// completion as for the body sent in one piece: the picker passed every byte on.
async fn upload(ctx: &Ctx, writes: impl Fn(&[u8]) -> Vec<Write>) -> CaseRes {
    let body = completion(Some(7));
    let bytes = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
    let whole = ctx.complete_body(&body, &[]).await?;
    ctx.served(&whole)?;
    let want = prompt_tokens(&whole)?;
    let r = http::raw_chunked_post(ctx.listen, "/v1/completions", &[], &writes(&bytes))
        .await
        .map_err(|e| format!("{e:#}"))?;
    let pod = ctx.served(&r)?;
    let got = prompt_tokens(&r)?;
    if got != want {
        return Err(format!(
            "pod {pod} saw {got} prompt tokens, {want} when the body came in one piece: the body \
             was altered on the way"
        ));
    }
    Ok(format!("served by {pod}, body intact"))
}

fn thirds(b: &[u8]) -> [&[u8]; 3] {
    let (x, y) = (b.len() / 3, 2 * b.len() / 3);
    [&b[..x], &b[x..y], &b[y..]]
}

/// A chunked upload written in small pieces with pauses between them.
pub async fn chunked_upload(ctx: &Ctx) -> CaseRes {
    upload(ctx, |b| {
        let mut w: Vec<Write> = b
            .chunks(b.len().div_ceil(5))
            .map(|c| Write {
                bytes: chunk(c),
                pause: Duration::from_millis(40),
            })
            .collect();
        w.push(Write {
            bytes: LAST_CHUNK.to_vec(),
            pause: Duration::ZERO,
        });
        w
    })
    .await
}

/// The whole body in one chunk, then a pause, then the end of the body on its own: the picker
/// gets an empty last message with end_of_stream.
pub async fn empty_end_of_stream(ctx: &Ctx) -> CaseRes {
    upload(ctx, |b| {
        vec![
            Write {
                bytes: chunk(b),
                pause: Duration::from_millis(300),
            },
            Write {
                bytes: LAST_CHUNK.to_vec(),
                pause: Duration::ZERO,
            },
        ]
    })
    .await
}

/// Three chunks, the last written together with the body's end: the final message carries data
/// and end_of_stream.
pub async fn multi_chunk_end_of_stream(ctx: &Ctx) -> CaseRes {
    upload(ctx, |b| {
        let [x, y, z] = thirds(b);
        let mut last = chunk(z);
        last.extend_from_slice(LAST_CHUNK);
        vec![
            Write {
                bytes: chunk(x),
                pause: Duration::from_millis(60),
            },
            Write {
                bytes: chunk(y),
                pause: Duration::from_millis(60),
            },
            Write {
                bytes: last,
                pause: Duration::ZERO,
            },
        ]
    })
    .await
}

/// `GET /v1/models`: no body at all, routed to a pod from the headers alone.
pub async fn header_only_get(ctx: &Ctx) -> CaseRes {
    let r = http::get(&ctx.client, &ctx.base, "/v1/models", &[])
        .await
        .map_err(|e| format!("{e:#}"))?;
    let pod = ctx.served(&r)?;
    let v: Value = serde_json::from_slice(&r.body).map_err(|e| format!("not JSON: {e}"))?;
    let listed = v["data"]
        .as_array()
        .is_some_and(|d| d.iter().any(|m| m["id"] == MODEL));
    if !listed {
        return Err(format!(
            "/v1/models from {pod} does not list {MODEL}: {}",
            r.brief()
        ));
    }
    Ok(format!("served by {pod}"))
}

/// A completion body that is not JSON: 400 (from the picker, as the reference picker does, or
/// from the pod it was routed to).
pub async fn invalid_json(ctx: &Ctx) -> CaseRes {
    let body = format!("{{\"model\": \"{MODEL}\", \"prompt\": \"Write as if").into_bytes();
    let r = http::post(&ctx.client, &ctx.base, "/v1/completions", body, &[])
        .await
        .map_err(|e| format!("{e:#}"))?;
    if r.status != 400 {
        return Err(format!("expected 400, got {}", r.brief()));
    }
    Ok(match r.pod() {
        Some(p) => format!("400 from pod {p} (the picker routed the unparsable body)"),
        None => "400 from the picker".into(),
    })
}

/// No `model` field: the protocol does not require one (OpenAI servers answer with their default
/// model). Either the picker routes it and a pod answers, or it refuses it with a 4xx; never a
/// 5xx.
pub async fn missing_model(ctx: &Ctx) -> CaseRes {
    let body = json!({"prompt": "Write as if you were a critic: San Francisco", "max_tokens": 4});
    let r = ctx.complete_body(&body, &[]).await?;
    match (r.status, r.pod()) {
        (200..=299, Some(_)) => Ok(format!("routed: served by {}", ctx.served(&r)?)),
        (400..=499, None) => Ok(format!("refused by the picker with {}", r.status)),
        _ => Err(format!(
            "expected routing or a 4xx refusal, got {}",
            r.brief()
        )),
    }
}

/// `"stream": true`: the SSE answer passes through whole (the same events, in order, as the pod
/// sends them directly) and as it is produced (not held back until the end).
pub async fn sse(ctx: &Ctx) -> CaseRes {
    const TOKENS: usize = 12;
    let body = json!({"model": MODEL, "prompt": "Write as if you were a critic: San Francisco",
                      "max_tokens": TOKENS, "stream": true});
    let got = http::post_sse(&ctx.client, &ctx.base, "/v1/completions", &body, &[])
        .await
        .map_err(|e| format!("{e:#}"))?;
    let pod = ctx.served(&got.resp)?;
    let ctype = got.resp.header("content-type").unwrap_or_default();
    if !ctype.starts_with("text/event-stream") {
        return Err(format!(
            "content-type {ctype:?}, expected text/event-stream"
        ));
    }
    let direct = http::post_sse(
        &ctx.client,
        &format!("http://{pod}"),
        "/v1/completions",
        &body,
        &[],
    )
    .await
    .map_err(|e| format!("asking {pod} directly: {e:#}"))?;
    let texts = |evs: &[(String, std::time::Instant)]| -> Result<Vec<String>, String> {
        evs.iter()
            .map(|(d, _)| match d.as_str() {
                "[DONE]" => Ok("[DONE]".to_string()),
                d => serde_json::from_str::<Value>(d)
                    .map(|v| {
                        v["choices"][0]["text"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string()
                    })
                    .map_err(|e| format!("event {d:?} is not JSON: {e}")),
            })
            .collect()
    };
    let (mine, theirs) = (texts(&got.events)?, texts(&direct.events)?);
    if mine != theirs {
        return Err(format!(
            "events differ from the pod's own stream: through Envoy {mine:?}, direct {theirs:?}"
        ));
    }
    if mine.last().map(String::as_str) != Some("[DONE]") || mine.len() < TOKENS {
        return Err(format!(
            "expected {TOKENS} token events and a final [DONE], got {mine:?}"
        ));
    }
    let first = got.events.first().map(|e| e.1);
    let last = got.events.last().map(|e| e.1);
    let spread = match (first, last) {
        (Some(f), Some(l)) => l.duration_since(f),
        _ => Duration::ZERO,
    };
    // The pods take 25 ms a token: a stream passed on as produced spreads over ~275 ms.
    if spread < Duration::from_millis(100) {
        return Err(format!(
            "the {} events arrived within {spread:?}: the stream was held back, not passed on as produced",
            mine.len()
        ));
    }
    Ok(format!(
        "{} events from {pod} in order over {spread:?}",
        mine.len()
    ))
}
