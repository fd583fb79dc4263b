//! The engine's own count of the prompt tokens it found cached, read from a response body as it
//! passes through, plus a `/v1/responses` response's id. Formats:
//!
//! - vLLM, SGLang and llama.cpp's OpenAI-compatible APIs: `usage.prompt_tokens_details
//!   .cached_tokens` (Responses API: `usage.input_tokens_details.cached_tokens`), in the JSON
//!   body or, streamed, in the last `data:` event(s) that carry `usage`;
//! - SGLang's native API: `meta_info.cached_tokens`;
//! - llama.cpp: `timings.cache_n` (with `timings.prompt_n`, the tokens it computed).
//!
//! Memory is bounded: a JSON body is kept while it fits in [`WINDOW`], then only its last
//! [`WINDOW`] bytes (usage is at its end; the id, at its start, is read before the head goes);
//! an SSE stream keeps only its current line, and skips a line longer than [`WINDOW`]. Every
//! byte is reserved from the stream budget before it is kept; a refusal ends the observation.
//! Input that is not what an engine sends yields no observation, never a panic.

use serde::Deserialize;

use crate::budget::Reservation;

/// The most bytes of a response one stream keeps.
pub const WINDOW: usize = 64 * 1024;

/// The first step of a window's reservation; it doubles up to [`WINDOW`].
const FIRST_STEP: usize = 4 * 1024;

/// Longest response id kept (OpenAI's are ~50 bytes).
const MAX_ID_BYTES: usize = 256;

/// What the engine reported about the request's prompt.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens the engine found in its prefix cache.
    pub cached_tokens: Option<u64>,
    /// Prompt tokens in the engine's own count.
    pub prompt_tokens: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    /// Not known yet: the first body byte tells.
    Unknown,
    /// `text/event-stream`.
    Sse,
    /// One JSON document.
    Json,
}

/// Reads one response body, chunk by chunk.
#[derive(Debug)]
pub struct Scanner {
    format: Format,
    /// Read the response id (a `/v1/responses` request).
    want_id: bool,
    /// SSE: the current line. JSON: the body while it fits, then its tail.
    buf: Vec<u8>,
    /// JSON: bytes were dropped from the front (the head and its id are gone).
    slid: bool,
    /// SSE: the current line outgrew the window; skipped up to its end.
    skipping: bool,
    /// The budget refused: nothing more is kept or read.
    gave_up: bool,
    held: Reservation,
    usage: Usage,
    id: Option<String>,
    /// The id was looked for (JSON: once, in the head).
    id_read: bool,
    /// Only the id is wanted: once it is read, nothing more is kept.
    id_only: bool,
}

impl Scanner {
    /// A scanner for a body whose `content-type` is `content_type` (None: sniffed), holding its
    /// bytes under `held`.
    pub fn new(content_type: Option<&str>, want_id: bool, held: Reservation) -> Self {
        Self {
            format: content_type.map_or(Format::Unknown, format_of),
            want_id,
            buf: Vec::new(),
            slid: false,
            skipping: false,
            gave_up: false,
            held,
            usage: Usage::default(),
            id: None,
            id_read: false,
            id_only: false,
        }
    }

    /// A scanner that reads a `/v1/responses` body's id and no usage: its bytes go back to the
    /// budget as soon as the id is read (a JSON body's head, a stream's `response.created`).
    pub fn id_only(held: Reservation) -> Self {
        Self {
            id_only: true,
            ..Self::new(None, true, held)
        }
    }

    /// Sets the format from the response's `content-type` before the body starts.
    pub fn content_type(&mut self, ct: &str) {
        if self.format == Format::Unknown {
            self.format = format_of(ct);
        }
    }

    /// Reads the next body chunk.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.gave_up || chunk.is_empty() {
            return;
        }
        if self.format == Format::Unknown {
            let Some(&first) = chunk.iter().find(|b| !b.is_ascii_whitespace()) else {
                return;
            };
            self.format = if first == b'{' {
                Format::Json
            } else {
                Format::Sse
            };
        }
        match self.format {
            Format::Sse => self.feed_sse(chunk),
            _ => self.feed_json(chunk),
        }
        if self.id_only {
            self.stop_once_id_read();
        }
    }

    /// Id only: looks for it in a JSON head so far, and once it is read stops keeping bytes.
    fn stop_once_id_read(&mut self) {
        if self.format == Format::Json && !self.id_read {
            // A head cut short has no complete `"id": "…"` yet: the next chunk tries again.
            if let Some(id) = top_level_string(&self.buf, b"id") {
                self.id = Some(id);
                self.id_read = true;
            }
        }
        if self.id_read && !self.gave_up {
            self.gave_up = true;
            self.buf = Vec::new();
            self.held.release();
        }
    }

    /// The body ended: what it reported.
    pub fn finish(&mut self) -> Usage {
        if !self.gave_up && self.format == Format::Json {
            if !self.slid {
                self.read_id();
            }
            merge(&mut self.usage, usage_in(&self.buf));
        } else if !self.gave_up && self.format == Format::Sse && !self.skipping {
            // A last line without its newline.
            let line = std::mem::take(&mut self.buf);
            self.sse_line(&line);
        }
        self.buf = Vec::new();
        self.held.release();
        self.usage
    }

    /// The response id, once found (taken once).
    pub fn take_id(&mut self) -> Option<String> {
        self.id.take()
    }

    /// What was reported so far.
    pub fn usage(&self) -> Usage {
        self.usage
    }

    /// Makes room for `len` bytes in the buffer, reserved first; false (and nothing more is
    /// read) when the budget refuses.
    fn room(&mut self, len: usize) -> bool {
        let cap = self.buf.capacity();
        if len <= cap {
            return true;
        }
        let want = len.max(cap * 2).clamp(FIRST_STEP, WINDOW);
        if want < len || !self.held.grow(want - cap) {
            self.gave_up = true;
            self.buf = Vec::new();
            self.held.release();
            return false;
        }
        self.buf.reserve_exact(want - self.buf.len());
        true
    }

    fn feed_json(&mut self, mut chunk: &[u8]) {
        let free = WINDOW - self.buf.len();
        if chunk.len() > free && !self.slid {
            // The head is about to go: its id first.
            let (fits, rest) = chunk.split_at(free);
            if !self.room(WINDOW) {
                return;
            }
            self.buf.extend_from_slice(fits);
            self.read_id();
            self.slid = true;
            chunk = rest;
        }
        if chunk.is_empty() {
            return;
        }
        if chunk.len() >= WINDOW {
            self.buf.clear();
            chunk = &chunk[chunk.len() - WINDOW..];
        } else if self.buf.len() + chunk.len() > WINDOW {
            self.buf.drain(..self.buf.len() + chunk.len() - WINDOW);
        }
        if self.room(self.buf.len() + chunk.len()) {
            self.buf.extend_from_slice(chunk);
        }
    }

    fn read_id(&mut self) {
        if self.want_id && !self.id_read {
            self.id_read = true;
            self.id = top_level_string(&self.buf, b"id");
        }
    }

    fn feed_sse(&mut self, mut chunk: &[u8]) {
        while !chunk.is_empty() {
            let end = chunk.iter().position(|&b| b == b'\n');
            let (part, rest) = match end {
                Some(i) => (&chunk[..i], &chunk[i + 1..]),
                None => (chunk, &[][..]),
            };
            if !self.skipping {
                if self.buf.len() + part.len() > WINDOW {
                    self.skipping = true;
                    self.buf.clear();
                } else if self.room(self.buf.len() + part.len()) {
                    self.buf.extend_from_slice(part);
                } else {
                    return;
                }
            }
            if end.is_some() {
                if !self.skipping {
                    let line = std::mem::take(&mut self.buf);
                    self.sse_line(&line);
                    // The allocation stays for the next line (it is what the budget holds).
                    self.buf = line;
                    self.buf.clear();
                }
                self.skipping = false;
            }
            chunk = rest;
        }
    }

    fn sse_line(&mut self, line: &[u8]) {
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        if self.want_id && self.id.is_none() && !self.id_read && contains(data, b"response.created")
        {
            if let Ok(ev) = serde_json::from_slice::<Created>(data) {
                if ev.kind == "response.created" {
                    self.id_read = true;
                    self.id = ev.response.id.filter(|id| valid_id(id));
                }
            }
        }
        merge(&mut self.usage, usage_in(data));
    }
}

fn format_of(content_type: &str) -> Format {
    let ct = content_type.to_ascii_lowercase();
    if ct.contains("text/event-stream") {
        Format::Sse
    } else if ct.contains("json") {
        Format::Json
    } else {
        Format::Unknown
    }
}

/// A later report replaces an earlier one field by field (streams repeat usage cumulatively).
fn merge(into: &mut Usage, new: Usage) {
    if new.cached_tokens.is_some() {
        into.cached_tokens = new.cached_tokens;
    }
    if new.prompt_tokens.is_some() {
        into.prompt_tokens = new.prompt_tokens;
    }
}

#[derive(Deserialize)]
struct Created {
    #[serde(rename = "type")]
    kind: String,
    response: CreatedResponse,
}

#[derive(Deserialize)]
struct CreatedResponse {
    id: Option<String>,
}

#[derive(Deserialize, Default)]
struct Details {
    cached_tokens: Option<u64>,
}

/// OpenAI `usage` (chat/completions and Responses spellings).
#[derive(Deserialize)]
struct OpenAiUsage {
    prompt_tokens: Option<u64>,
    input_tokens: Option<u64>,
    prompt_tokens_details: Option<Details>,
    input_tokens_details: Option<Details>,
}

/// SGLang's native `meta_info`.
#[derive(Deserialize)]
struct MetaInfo {
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
}

/// llama.cpp's `timings`: `cache_n` reused, `prompt_n` computed.
#[derive(Deserialize)]
struct Timings {
    cache_n: Option<u64>,
    prompt_n: Option<u64>,
}

/// The usage the last `"usage"`, `"meta_info"` or `"timings"` object in `text` reports, in
/// that order of preference.
pub fn usage_in(text: &[u8]) -> Usage {
    let mut out = Usage::default();
    if let Some(u) = last_value::<OpenAiUsage>(text, b"usage") {
        out.prompt_tokens = u.prompt_tokens.or(u.input_tokens);
        out.cached_tokens = u
            .prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .or(u.input_tokens_details.and_then(|d| d.cached_tokens));
    }
    if out.cached_tokens.is_none() {
        if let Some(m) = last_value::<MetaInfo>(text, b"meta_info") {
            out.cached_tokens = m.cached_tokens;
            out.prompt_tokens = out.prompt_tokens.or(m.prompt_tokens);
        }
    }
    if out.cached_tokens.is_none() {
        if let Some(t) = last_value::<Timings>(text, b"timings") {
            out.cached_tokens = t.cache_n;
            if let (Some(c), Some(p)) = (t.cache_n, t.prompt_n) {
                out.prompt_tokens = out.prompt_tokens.or(Some(c.saturating_add(p)));
            }
        }
    }
    out
}

/// The value of the last key `key` in `text` (a JSON document or a tail of one) that is an
/// object and reads as a `T`. A key is a quoted name followed by `:`; inside a JSON string the quotes are escaped,
/// so text an engine generated cannot pose as one.
fn last_value<T: serde::de::DeserializeOwned>(text: &[u8], key: &[u8]) -> Option<T> {
    let mut end = text.len();
    // A few tries: a later match may be a cut-off object at the window's edge.
    for _ in 0..4 {
        let at = rfind_key(&text[..end], key)?;
        let rest = text[at + key.len() + 2..].trim_ascii_start();
        let object = rest
            .strip_prefix(b":")
            .is_some_and(|v| v.trim_ascii_start().first() == Some(&b'{'));
        if object {
            if let Some(v) = value_after(rest) {
                return Some(v);
            }
        }
        end = at;
    }
    None
}

/// Where the last `"key"` (its opening quote) that is followed by `:` begins.
fn rfind_key(text: &[u8], key: &[u8]) -> Option<usize> {
    let n = key.len() + 2;
    let mut end = text.len();
    while end >= n {
        let at = rfind(&text[..end], key)?;
        end = at;
        if at == 0 || text[at - 1] != b'"' || text.get(at + key.len()) != Some(&b'"') {
            continue;
        }
        let q = at - 1;
        if q > 0 && text[q - 1] == b'\\' {
            continue;
        }
        let after = text[at + key.len() + 1..].trim_ascii_start();
        if after.first() == Some(&b':') {
            return Some(q);
        }
    }
    None
}

/// The value that follows `: ` in `rest` (trailing bytes ignored).
fn value_after<T: serde::de::DeserializeOwned>(rest: &[u8]) -> Option<T> {
    let rest = rest.trim_ascii_start().strip_prefix(b":")?;
    serde_json::Deserializer::from_slice(rest)
        .into_iter::<T>()
        .next()?
        .ok()
}

fn rfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (0..=hay.len() - needle.len())
        .rev()
        .find(|&i| &hay[i..i + needle.len()] == needle)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_ID_BYTES && id.bytes().all(|b| b.is_ascii_graphic())
}

/// The string value of the top-level key `key` of the JSON object `doc` begins with (`doc` may
/// be cut short after it).
pub fn top_level_string(doc: &[u8], key: &[u8]) -> Option<String> {
    let mut depth = 0usize;
    let mut i = 0;
    while i < doc.len() {
        match doc[i] {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.checked_sub(1)?,
            b'"' => {
                let start = i + 1;
                let end = string_end(doc, start)?;
                i = end;
                if depth == 1 && &doc[start..end] == key {
                    let rest = doc[end + 1..].trim_ascii_start();
                    if rest.first() == Some(&b':') {
                        let id: String = value_after(rest)?;
                        return valid_id(&id).then_some(id);
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// The index of the quote that closes the string whose first byte is at `start`.
fn string_end(doc: &[u8], mut i: usize) -> Option<usize> {
    while i < doc.len() {
        match doc[i] {
            b'\\' => i += 2,
            b'"' => return Some(i),
            _ => i += 1,
        }
    }
    None
}

#[cfg(test)]
#[path = "usage_tests.rs"]
mod tests;
