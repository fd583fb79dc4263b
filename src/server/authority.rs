//! Istio names an InferencePool's picker only by its cluster, so Envoy sends the gRPC
//! `:authority: outbound|9002||kv-router.<ns>.svc.cluster.local`. `|` is not legal in an
//! authority, and the HTTP/2 server under tonic resets such a stream (PROTOCOL_ERROR) before any
//! service sees it. This reader sits between the plaintext connection and that server: it passes
//! every frame through, re-encodes each header block the client sends, and there turns an
//! illegal `:authority` into a legal one (`<fqdn>:<port>` from Istio's cluster name, else none;
//! gRPC routes by `:path`). Counted in `kv_router_grpc_authority_rewritten_total`.
//!
//! Header blocks are re-encoded as literals that never enter the server's HPACK table, so the
//! server's table stays empty and cannot drift from the client's, which this reader decodes
//! against. A block is buffered whole (HEADERS + CONTINUATION) up to [`MAX_BLOCK`] bytes encoded
//! and [`MAX_LIST`] decoded, the server's own header-list limit (a larger list ends the
//! connection here, where the server would refuse the stream: Envoy's ext_proc and health calls
//! send a few hundred bytes); anything else (bodies included) streams through as it arrives.
//! Memory per connection: the client's HPACK table (4 KiB at most) and the block on its way;
//! buffers past 4 KiB are freed once passed on. Under TLS ([`super::tls`]) it reads plaintext.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BufMut, BytesMut};
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// The HTTP/2 client connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Largest encoded header block buffered (HEADERS + CONTINUATION payloads): an encoded block is
/// never larger than its decoded list, which the server holds to [`MAX_LIST`].
pub const MAX_BLOCK: usize = MAX_LIST;
/// Largest decoded header list (RFC 9113's size: names, values and 32 bytes a field): hyper's
/// default SETTINGS_MAX_HEADER_LIST_SIZE, which tonic keeps.
pub const MAX_LIST: usize = 16 << 10;
/// Buffers larger than this are dropped once empty rather than kept for the next frame.
const KEEP_BUFFER: usize = 4096;
/// The dynamic table the server allows (HTTP/2's default; it announces no other).
const TABLE_SIZE: usize = 4096;
/// Frame payloads we write stay within HTTP/2's minimum SETTINGS_MAX_FRAME_SIZE.
const MAX_FRAME: usize = 16_384;

const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

enum State {
    /// Matching the preface: bytes of it seen so far.
    Preface(usize),
    /// At a frame boundary.
    Frame,
    /// Passing this many more payload bytes through.
    Pass(usize),
    /// Not HTTP/2 as expected (or TLS below): everything passes through untouched.
    Off,
}

/// A header block being gathered from HEADERS and its CONTINUATION frames.
struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// A connection whose client header blocks get a legal `:authority` (see the module comment).
pub struct AuthorityFix<S> {
    inner: S,
    state: State,
    /// Read from `inner`, not yet handed on.
    input: BytesMut,
    /// Ready for the HTTP/2 server.
    output: BytesMut,
    block: Option<Block>,
    decoder: loona_hpack::Decoder<'static>,
    rewritten: Counter,
}

impl<S> AuthorityFix<S> {
    /// `on`: false where `inner` carries TLS (the bytes are not HTTP/2 frames here).
    pub fn new(inner: S, on: bool, rewritten: Counter) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        Self {
            inner,
            state: if on { State::Preface(0) } else { State::Off },
            input: BytesMut::new(),
            output: BytesMut::new(),
            block: None,
            decoder,
            rewritten,
        }
    }

    /// Moves what `input` holds into `output`, as far as whole frame headers and blocks allow.
    fn process(&mut self) -> io::Result<()> {
        loop {
            match self.state {
                State::Off => {
                    let all = self.input.split();
                    self.output.unsplit(all);
                    return Ok(());
                }
                State::Preface(seen) => {
                    let n = (PREFACE.len() - seen).min(self.input.len());
                    if n == 0 {
                        return Ok(());
                    }
                    let same = self.input[..n] == PREFACE[seen..seen + n];
                    let bytes = self.input.split_to(n);
                    self.output.unsplit(bytes);
                    self.state = match (same, seen + n == PREFACE.len()) {
                        (false, _) => State::Off,
                        (true, true) => State::Frame,
                        (true, false) => State::Preface(seen + n),
                    };
                }
                State::Pass(0) => self.state = State::Frame,
                State::Pass(left) => {
                    let n = left.min(self.input.len());
                    if n == 0 {
                        return Ok(());
                    }
                    let bytes = self.input.split_to(n);
                    self.output.unsplit(bytes);
                    self.state = State::Pass(left - n);
                }
                State::Frame => {
                    if self.input.len() < 9 {
                        return Ok(());
                    }
                    let h = &self.input[..9];
                    let len =
                        (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
                    let (kind, flags) = (h[3], h[4]);
                    let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
                    if self.block.is_none() && kind != HEADERS {
                        if kind == CONTINUATION {
                            return Err(bad("CONTINUATION without HEADERS"));
                        }
                        let head = self.input.split_to(9);
                        self.output.unsplit(head);
                        self.state = State::Pass(len);
                        continue;
                    }
                    let gathered = self.block.as_ref().map_or(0, |b| b.fragment.len());
                    if gathered + len > MAX_BLOCK {
                        return Err(bad("header block over 16 KiB"));
                    }
                    if self.input.len() < 9 + len {
                        self.input.reserve(9 + len - self.input.len());
                        return Ok(());
                    }
                    self.input.advance(9);
                    let payload = self.input.split_to(len);
                    self.gather(kind, flags, stream, &payload)?;
                    if flags & END_HEADERS != 0 {
                        self.emit()?;
                    }
                }
            }
        }
    }

    /// Adds one HEADERS or CONTINUATION frame's fragment to the block.
    fn gather(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) -> io::Result<()> {
        match (&mut self.block, kind) {
            (None, HEADERS) => {
                let mut p = payload;
                let mut pad = 0;
                if flags & PADDED != 0 {
                    pad = usize::from(*p.first().ok_or_else(|| bad("short HEADERS"))?);
                    p = &p[1..];
                }
                let mut priority = None;
                if flags & PRIORITY != 0 {
                    let f: [u8; 5] = p
                        .get(..5)
                        .and_then(|s| s.try_into().ok())
                        .ok_or_else(|| bad("short HEADERS"))?;
                    priority = Some(f);
                    p = &p[5..];
                }
                let end = p
                    .len()
                    .checked_sub(pad)
                    .ok_or_else(|| bad("HEADERS padding"))?;
                self.block = Some(Block {
                    stream,
                    end_stream: flags & END_STREAM != 0,
                    priority,
                    fragment: p[..end].to_vec(),
                });
                Ok(())
            }
            (Some(b), CONTINUATION) if b.stream == stream => {
                b.fragment.extend_from_slice(payload);
                Ok(())
            }
            _ => Err(bad("a header block interrupted by another frame")),
        }
    }

    /// Decodes the gathered block, fixes its `:authority`, and writes it re-encoded.
    fn emit(&mut self) -> io::Result<()> {
        let Some(b) = self.block.take() else {
            return Ok(());
        };
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut size = 0usize;
        self.decoder
            .decode_with_cb(&b.fragment, |name, value| {
                size += name.len() + value.len() + 32;
                if size <= MAX_LIST {
                    fields.push((name.into_owned(), value.into_owned()));
                }
            })
            .map_err(|e| bad_owned(format!("header block does not decode: {e:?}")))?;
        if size > MAX_LIST {
            return Err(bad("header list over 16 KiB"));
        }
        if let Some(i) = fields.iter().position(|(n, _)| n == b":authority") {
            if !legal_authority(&fields[i].1) {
                self.rewritten.inc();
                match istio_authority(&fields[i].1) {
                    Some(fixed) => fields[i].1 = fixed.into_bytes(),
                    None => {
                        fields.remove(i);
                    }
                }
            }
        }
        let mut block = Vec::with_capacity(size);
        for (n, v) in &fields {
            // Literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2).
            block.push(0);
            encode_string(&mut block, n);
            encode_string(&mut block, v);
        }
        self.write_block(&b, &block);
        Ok(())
    }

    fn write_block(&mut self, b: &Block, block: &[u8]) {
        let prio = b.priority.map_or(0, |_| 5);
        let first = block.len().min(MAX_FRAME - prio);
        let (head, mut rest) = block.split_at(first);
        let mut flags = if b.end_stream { END_STREAM } else { 0 };
        if b.priority.is_some() {
            flags |= PRIORITY;
        }
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        self.frame_head(prio + head.len(), HEADERS, flags, b.stream);
        if let Some(p) = b.priority {
            self.output.put_slice(&p);
        }
        self.output.put_slice(head);
        while !rest.is_empty() {
            let (part, tail) = rest.split_at(rest.len().min(MAX_FRAME));
            let flags = if tail.is_empty() { END_HEADERS } else { 0 };
            self.frame_head(part.len(), CONTINUATION, flags, b.stream);
            self.output.put_slice(part);
            rest = tail;
        }
    }

    fn frame_head(&mut self, len: usize, kind: u8, flags: u8, stream: u32) {
        let len = len as u32;
        self.output.put_slice(&len.to_be_bytes()[1..]);
        self.output.put_u8(kind);
        self.output.put_u8(flags);
        self.output.put_u32(stream);
    }
}

fn bad(why: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

fn bad_owned(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// An HPACK string literal without Huffman coding: 7-bit-prefix length, then the bytes.
fn encode_string(out: &mut Vec<u8>, s: &[u8]) {
    let mut n = s.len();
    if n < 127 {
        out.push(n as u8);
    } else {
        out.push(127);
        n -= 127;
        while n >= 128 {
            out.push((n % 128) as u8 | 0x80);
            n /= 128;
        }
        out.push(n as u8);
    }
    out.extend_from_slice(s);
}

/// Whether the HTTP/2 server takes `v` as an authority.
fn legal_authority(v: &[u8]) -> bool {
    http::uri::Authority::try_from(v).is_ok()
}

/// `<fqdn>:<port>` from an Envoy cluster name as Istio builds it
/// (`outbound|<port>|<subset>|<fqdn>`), when that is a legal authority.
fn istio_authority(v: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(v).ok()?;
    let mut parts = s.split('|');
    let (_direction, port, _subset, host) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || host.is_empty() {
        return None;
    }
    let port: u16 = port.parse().ok()?;
    let fixed = format!("{host}:{port}");
    legal_authority(fixed.as_bytes()).then_some(fixed)
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output.split_to(n));
                if this.output.is_empty() && this.output.capacity() > KEEP_BUFFER {
                    this.output = BytesMut::new();
                }
                if this.input.is_empty() && this.input.capacity() > KEEP_BUFFER {
                    this.input = BytesMut::new();
                }
                return Poll::Ready(Ok(()));
            }
            this.process()?;
            if !this.output.is_empty() {
                continue;
            }
            // Bodies and pass-through bytes go straight into the server's buffer.
            let direct = match this.state {
                State::Off => Some(buf.remaining()),
                State::Pass(left) if left > 0 => Some(left.min(buf.remaining())),
                _ => None,
            };
            if let (Some(n), true) = (direct, this.input.is_empty()) {
                let mut sub = ReadBuf::new(buf.initialize_unfilled_to(n));
                ready!(Pin::new(&mut this.inner).poll_read(cx, &mut sub))?;
                let got = sub.filled().len();
                buf.advance(got);
                if let State::Pass(left) = this.state {
                    this.state = State::Pass(left - got);
                }
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut rb = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            if rb.filled().is_empty() {
                return Poll::Ready(Ok(())); // end of stream
            }
            this.input.extend_from_slice(rb.filled());
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S: Connected<ConnectInfo = TcpConnectInfo>> Connected for AuthorityFix<S> {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
#[path = "authority_tests.rs"]
mod tests;
