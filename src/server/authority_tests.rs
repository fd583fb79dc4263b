use super::*;

use tokio::io::AsyncReadExt;

const ISTIO: &str = "outbound|9002||kv-router.llm.svc.cluster.local";

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn request(authority: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
    [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/grpc.health.v1.Health/Check"),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    .iter()
    .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
    .collect()
}

/// Feeds its bytes `step` at a time, so every state sees a frame cut anywhere.
struct Trickle {
    data: Vec<u8>,
    at: usize,
    step: usize,
}

impl AsyncRead for Trickle {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let n = self
            .step
            .min(self.data.len() - self.at)
            .min(buf.remaining());
        let at = self.at;
        buf.put_slice(&self.data[at..at + n]);
        self.at += n;
        Poll::Ready(Ok(()))
    }
}

async fn through(data: Vec<u8>, step: usize) -> (io::Result<Vec<u8>>, u64) {
    let counter = Counter::default();
    let mut fix = AuthorityFix::new(Trickle { data, at: 0, step }, true, counter.clone());
    let mut out = Vec::new();
    let r = fix.read_to_end(&mut out).await.map(|_| out);
    (r, counter.get())
}

/// The frames of `bytes` after the preface: (kind, flags, stream, payload).
fn frames(bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
    assert_eq!(&bytes[..PREFACE.len()], PREFACE);
    let mut b = &bytes[PREFACE.len()..];
    let mut out = Vec::new();
    while !b.is_empty() {
        let len = (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]);
        let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
        out.push((b[3], b[4], stream, b[9..9 + len].to_vec()));
        b = &b[9 + len..];
    }
    out
}

fn decode(block: &[u8]) -> Vec<(String, String)> {
    let mut d = loona_hpack::Decoder::new();
    let mut out = Vec::new();
    d.decode_with_cb(block, |n, v| {
        out.push((
            String::from_utf8(n.into_owned()).unwrap(),
            String::from_utf8(v.into_owned()).unwrap(),
        ))
    })
    .unwrap();
    out
}

fn authority(fields: &[(String, String)]) -> Option<&str> {
    fields
        .iter()
        .find(|(n, _)| n == ":authority")
        .map(|(_, v)| v.as_str())
}

/// A client's bytes: preface, SETTINGS, then per request a HEADERS block (encoded with one
/// connection-wide HPACK encoder, as Envoy's) and a DATA frame.
fn client(authorities: &[&str]) -> Vec<u8> {
    let mut enc = loona_hpack::Encoder::new();
    let mut bytes = PREFACE.to_vec();
    bytes.extend(frame(0x4, 0, 0, &[0, 4, 0, 0, 0xff, 0xff]));
    for (i, a) in authorities.iter().enumerate() {
        let stream = 2 * i as u32 + 1;
        let req = request(a);
        let block = enc.encode(req.iter().map(|(n, v)| (&n[..], &v[..])));
        bytes.extend(frame(HEADERS, END_HEADERS, stream, &block));
        bytes.extend(frame(0x0, END_STREAM, stream, &[0, 0, 0, 0, 2, 0x0a, 0x00]));
    }
    bytes
}

#[tokio::test]
async fn istios_cluster_name_becomes_the_service_authority_and_the_rest_passes_untouched() {
    let input = client(&[ISTIO, ISTIO, "kv-router:9002"]);
    for step in [1, 7, 9, 4096, usize::MAX] {
        let (out, rewritten) = through(input.clone(), step.min(input.len())).await;
        let out = out.unwrap();
        let f = frames(&out);
        assert_eq!(f.len(), 7, "step {step}: SETTINGS + 3 x (HEADERS, DATA)");
        assert_eq!(f[0], (0x4, 0, 0, vec![0, 4, 0, 0, 0xff, 0xff]));
        for (i, want) in [
            "kv-router.llm.svc.cluster.local:9002",
            "kv-router.llm.svc.cluster.local:9002",
            "kv-router:9002",
        ]
        .iter()
        .enumerate()
        {
            let (kind, flags, stream, block) = &f[1 + 2 * i];
            assert_eq!(
                (*kind, *flags, *stream),
                (HEADERS, END_HEADERS, 2 * i as u32 + 1)
            );
            let fields = decode(block);
            assert_eq!(authority(&fields), Some(*want), "step {step}, request {i}");
            assert_eq!(fields.len(), 6, "every other field kept: {fields:?}");
            assert_eq!(
                fields[2],
                (":path".into(), "/grpc.health.v1.Health/Check".into())
            );
            assert_eq!(
                f[2 + 2 * i].3,
                vec![0, 0, 0, 0, 2, 0x0a, 0x00],
                "DATA untouched"
            );
        }
        assert_eq!(rewritten, 2, "step {step}");
    }
}

#[tokio::test]
async fn an_illegal_authority_that_is_no_cluster_name_is_dropped() {
    let (out, rewritten) = through(client(&["bad authority|x"]), 5).await;
    let f = frames(&out.unwrap());
    let fields = decode(&f[1].3);
    assert_eq!(authority(&fields), None);
    assert_eq!(fields.len(), 5);
    assert_eq!(rewritten, 1);
    assert_eq!(istio_authority(b"outbound|port||svc"), None);
    assert_eq!(istio_authority(b"outbound|9002||svc|extra"), None);
    assert_eq!(istio_authority(b"inbound|9002||"), None);
    assert_eq!(
        istio_authority(b"outbound|9002|v1|svc.ns"),
        Some("svc.ns:9002".into())
    );
}

#[tokio::test]
async fn padded_prioritised_and_continued_blocks_arrive_as_one_block() {
    let mut enc = loona_hpack::Encoder::new();
    let mut req = request(ISTIO);
    req.push((b"x-big".to_vec(), vec![b'a'; 15_000]));
    let block = enc.encode(req.iter().map(|(n, v)| (&n[..], &v[..])));
    let (a, rest) = block.split_at(100);
    let (b, c) = rest.split_at(rest.len() / 2);
    let mut headers = vec![3u8]; // pad length
    headers.extend_from_slice(&[0x80, 0, 0, 0, 7]); // exclusive dependency on 0, weight 8
    headers.extend_from_slice(a);
    headers.extend_from_slice(&[0, 0, 0]);
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 1, &headers));
    input.extend(frame(CONTINUATION, 0, 1, b));
    input.extend(frame(CONTINUATION, END_HEADERS, 1, c));
    input.extend(frame(0x6, 0, 0, &[1; 8])); // PING after the block
    let (out, _) = through(input, 1000).await;
    let f = frames(&out.unwrap());
    assert_eq!(f.len(), 2, "one HEADERS (the continuations joined) + PING");
    assert_eq!(
        (f[0].0, f[0].1),
        (HEADERS, END_STREAM | PRIORITY | END_HEADERS)
    );
    assert_eq!(&f[0].3[..5], &[0x80, 0, 0, 0, 7]);
    let fields = decode(&f[0].3[5..]);
    assert_eq!(
        authority(&fields),
        Some("kv-router.llm.svc.cluster.local:9002")
    );
    assert_eq!(fields.last().unwrap().1.len(), 15_000);
    assert_eq!(f[1].0, 0x6);
}

#[test]
fn a_block_past_one_frame_continues_in_16_kib_frames() {
    let mut fix = AuthorityFix::new(&b""[..], true, Counter::default());
    let block = Block {
        stream: 5,
        end_stream: true,
        priority: Some([0, 0, 0, 3, 15]),
        fragment: Vec::new(),
    };
    let bytes: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
    fix.write_block(&block, &bytes);
    let mut out = PREFACE.to_vec();
    out.extend_from_slice(&fix.output);
    let f = frames(&out);
    let shape: Vec<(u8, u8, u32, usize)> = f.iter().map(|x| (x.0, x.1, x.2, x.3.len())).collect();
    assert_eq!(
        shape,
        vec![
            (HEADERS, END_STREAM | PRIORITY, 5, MAX_FRAME),
            (CONTINUATION, 0, 5, MAX_FRAME),
            (CONTINUATION, END_HEADERS, 5, 40_005 - 2 * MAX_FRAME),
        ]
    );
    let mut joined = f[0].3[5..].to_vec();
    joined.extend_from_slice(&f[1].3);
    joined.extend_from_slice(&f[2].3);
    assert_eq!(joined, bytes);
}

#[tokio::test]
async fn oversized_or_broken_blocks_end_the_connection_with_an_error() {
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, 0, 1, &vec![0x40; 10_000]));
    input.extend(frame(CONTINUATION, END_HEADERS, 1, &vec![0x40; 10_000]));
    let (out, _) = through(input, 4096).await;
    assert!(out.unwrap_err().to_string().contains("16 KiB"));
    // A small block whose indices expand past the server's list limit.
    // Literal with incremental indexing, new name: it becomes dynamic table entry 62.
    let mut bomb = vec![0x40];
    encode_string(&mut bomb, b"x-a");
    encode_string(&mut bomb, &[b'a'; 3000]);
    // Dynamic table entry 62, ten times: the 3 KB field again and again.
    bomb.extend(std::iter::repeat_n(0xbe, 10));
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, END_HEADERS, 1, &bomb));
    let (out, _) = through(input, 4096).await;
    assert!(out.unwrap_err().to_string().contains("16 KiB"));
    let mut input = PREFACE.to_vec();
    input.extend(frame(HEADERS, 0, 1, &[0x82]));
    input.extend(frame(0x0, 0, 1, &[1, 2, 3]));
    assert!(
        through(input, 4096).await.0.is_err(),
        "DATA inside a header block"
    );
    let mut input = PREFACE.to_vec();
    input.extend(frame(
        HEADERS,
        END_HEADERS,
        1,
        &[0xff, 0xff, 0xff, 0xff, 0xff, 0x7f],
    ));
    assert!(
        through(input, 4096).await.0.is_err(),
        "an index past every table"
    );
    let mut input = PREFACE.to_vec();
    input.extend(frame(CONTINUATION, END_HEADERS, 1, &[0x82]));
    assert!(through(input, 4096).await.0.is_err());
}

#[tokio::test]
async fn anything_but_an_http2_preface_and_a_tls_port_pass_untouched() {
    let junk = b"GET / HTTP/1.1\r\nHost: a|b\r\n\r\n".to_vec();
    let (out, n) = through(junk.clone(), 3).await;
    assert_eq!((out.unwrap(), n), (junk, 0));
    let input = client(&[ISTIO]);
    let mut off = AuthorityFix::new(
        Trickle {
            data: input.clone(),
            at: 0,
            step: 100,
        },
        false,
        Counter::default(),
    );
    let mut out = Vec::new();
    off.read_to_end(&mut out).await.unwrap();
    assert_eq!(out, input);
}
