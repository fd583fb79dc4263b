//! Requests through Envoy: JSON posts and GETs (reqwest), exact upload shapes over a raw HTTP/1.1
//! connection (chunk boundaries, pauses, where the end of the body falls), and SSE reads that
//! keep each event's arrival time.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The stub pods name themselves in this response header (`ip:port`).
pub const POD_HEADER: &str = "x-vllm-sim-pod";

/// How long one request may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A response as the client saw it.
#[derive(Debug, Clone)]
pub struct Resp {
    /// HTTP status.
    pub status: u16,
    /// Headers, names lower-case, in order.
    pub headers: Vec<(String, String)>,
    /// The whole body.
    pub body: Vec<u8>,
}

impl Resp {
    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The pod that served it (its own `x-vllm-sim-pod` header), when a pod did.
    pub fn pod(&self) -> Option<SocketAddr> {
        self.header(POD_HEADER).and_then(|v| v.trim().parse().ok())
    }

    /// Status, serving pod and the start of the body, for failure messages.
    pub fn brief(&self) -> String {
        let body = String::from_utf8_lossy(&self.body);
        let body: String = body.chars().take(160).collect();
        let pod = self
            .pod()
            .map(|p| format!("served by {p}"))
            .unwrap_or_else(|| "no pod".into());
        format!("{} ({pod}; body {body:?})", self.status)
    }
}

/// An HTTP client that never uses a proxy.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .expect("reqwest client")
}

async fn collect(r: reqwest::Response) -> Result<Resp> {
    let status = r.status().as_u16();
    let headers = kv_testkit::runner::header_pairs(r.headers());
    let body = r
        .bytes()
        .await
        .context("reading the response body")?
        .to_vec();
    Ok(Resp {
        status,
        headers,
        body,
    })
}

/// POSTs `body` (raw bytes, `content-type: application/json`) to `base + path`.
pub async fn post(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    body: Vec<u8>,
    headers: &[(&str, String)],
) -> Result<Resp> {
    let mut req = client
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    collect(req.send().await.with_context(|| format!("POST {path}"))?).await
}

/// POSTs JSON.
pub async fn post_json(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    body: &Value,
    headers: &[(&str, String)],
) -> Result<Resp> {
    post(client, base, path, serde_json::to_vec(body)?, headers).await
}

/// GETs `base + path`.
pub async fn get(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    headers: &[(&str, String)],
) -> Result<Resp> {
    let mut req = client.get(format!("{base}{path}"));
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    collect(req.send().await.with_context(|| format!("GET {path}"))?).await
}

/// One write of an upload: bytes, then a pause before the next write.
#[derive(Debug, Clone)]
pub struct Write {
    /// What goes on the wire (already chunk-framed).
    pub bytes: Vec<u8>,
    /// Pause after it.
    pub pause: Duration,
}

/// `data` as one HTTP/1.1 chunk.
pub fn chunk(data: &[u8]) -> Vec<u8> {
    let mut v = format!("{:x}\r\n", data.len()).into_bytes();
    v.extend_from_slice(data);
    v.extend_from_slice(b"\r\n");
    v
}

/// The chunked body's terminator.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// POSTs a chunked body over a fresh HTTP/1.1 connection, write by write (each write flushed,
/// then its pause), and reads the response until the server closes.
pub async fn raw_chunked_post(
    listen: SocketAddr,
    path: &str,
    headers: &[(&str, String)],
    writes: &[Write],
) -> Result<Resp> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(listen).await?;
        s.set_nodelay(true)?;
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nhost: {listen}\r\ncontent-type: application/json\r\n\
             transfer-encoding: chunked\r\nconnection: close\r\n"
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).await?;
        s.flush().await?;
        for w in writes {
            s.write_all(&w.bytes).await?;
            s.flush().await?;
            if !w.pause.is_zero() {
                tokio::time::sleep(w.pause).await;
            }
        }
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await?;
        parse_response(&raw)
    };
    match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
        Ok(r) => r,
        Err(_) => bail!("no complete response in {REQUEST_TIMEOUT:?}"),
    }
}

/// Parses an HTTP/1.1 response read to the connection's end (content-length, chunked or
/// close-delimited body).
pub fn parse_response(raw: &[u8]) -> Result<Resp> {
    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        bail!("no complete response head ({} bytes read)", raw.len());
    };
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let rest = &raw[end + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked"));
    let body = if chunked {
        dechunk(rest)?
    } else {
        rest.to_vec()
    };
    Ok(Resp {
        status,
        headers,
        body,
    })
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            bail!("truncated chunked response");
        };
        let size_text = String::from_utf8_lossy(&rest[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .with_context(|| format!("bad chunk size {size_text:?}"))?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if rest.len() < size + 2 {
            bail!("truncated chunk");
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

/// An SSE response: the head, and each `data:` event with the time it arrived.
#[derive(Debug, Clone)]
pub struct SseResp {
    /// Status, headers and the raw body.
    pub resp: Resp,
    /// Each event's `data:` payload and its arrival, in order.
    pub events: Vec<(String, Instant)>,
}

/// POSTs `body` and reads the answer as server-sent events as they arrive.
pub async fn post_sse(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    body: &Value,
    headers: &[(&str, String)],
) -> Result<SseResp> {
    let mut req = client.post(format!("{base}{path}")).json(body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let r = req.send().await.with_context(|| format!("POST {path}"))?;
    let status = r.status().as_u16();
    let headers: Vec<(String, String)> = kv_testkit::runner::header_pairs(r.headers());
    let mut stream = r.bytes_stream();
    let mut raw = Vec::new();
    let mut pending = Vec::new();
    let mut events = Vec::new();
    while let Some(piece) = stream.next().await {
        let piece = piece.context("reading the event stream")?;
        let at = Instant::now();
        raw.extend_from_slice(&piece);
        pending.extend_from_slice(&piece);
        // Events end with a blank line.
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                if let Some(data) = line.strip_prefix("data:") {
                    events.push((data.trim().to_string(), at));
                }
            }
        }
    }
    Ok(SseResp {
        resp: Resp {
            status,
            headers,
            body: raw,
        },
        events,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_chunked_and_plain_responses() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        let r = parse_response(raw).unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"abcde"[..]));
        assert_eq!(r.header("x-a"), Some("1"));
        let raw = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\nno";
        let r = parse_response(raw).unwrap();
        assert_eq!((r.status, r.body.as_slice()), (503, &b"no"[..]));
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
    }

    #[test]
    fn chunk_frames_its_bytes() {
        assert_eq!(
            chunk(b"hello world!!!!!"),
            b"10\r\nhello world!!!!!\r\n".to_vec()
        );
    }
}
