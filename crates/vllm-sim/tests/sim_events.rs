//! vLLM KV events from `vllm-sim`: the msgpack encoder against vLLM 0.33's golden bytes, the
//! block hashes against vLLM's vectors, and the live ZMQ publisher / replay service of the
//! real binary.
//!
//! Fixtures are read from the repository's `data/vllm-kv-events/`; a missing fixture directory
//! fails the tests.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kv_router::blocks::pseudo_tokens;
use kv_router::events::{encode_batch, BlockHash, ExtraKey, KvEvent, KvEventBatch};

use rmpv::Value as Mp;
use serde_json::{json, Value};
use vllm_sim::vllm_hash::{chain, digest_u64, none_hash, HashExtras, DEFAULT_SEED};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

fn fixtures() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/vllm-kv-events");
    assert!(
        dir.join("index.json").exists(),
        "vLLM KV-event fixtures not found at {} (they are part of the repository)",
        dir.display()
    );
    Some(dir)
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn hash_of(v: &Value, bytes: bool) -> BlockHash {
    let s = v.as_str().expect("hash string");
    if bytes {
        BlockHash::Bytes(unhex(s))
    } else {
        BlockHash::Int(s.parse().expect("u64"))
    }
}

fn opt_str(ev: &Value, key: &str) -> Option<String> {
    ev[key].as_str().map(str::to_string)
}

fn opt_u32(ev: &Value, key: &str) -> Option<u32> {
    ev[key].as_u64().map(|v| v as u32)
}

fn extra_key(v: &Value) -> ExtraKey {
    match v {
        Value::String(s) => ExtraKey::Str(s.clone()),
        Value::Number(n) => ExtraKey::Int(n.as_i64().unwrap()),
        Value::Array(a) => ExtraKey::Array(a.iter().map(extra_key).collect()),
        other => panic!("unexpected extra key {other}"),
    }
}

/// Builds the batch `index.json` describes, by hand.
fn expected_batch(fx: &Value) -> KvEventBatch {
    let bytes = fx["hash_encoding"] == "bytes";
    let events = fx["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ev| {
            let keys: Vec<&str> = ev["wire_keys"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_str().unwrap())
                .collect();
            // Optional fields are present on the wire only when listed in wire_keys.
            let present = |k: &str| keys.contains(&k);
            let hashes = ev["block_hashes"]
                .as_array()
                .map(|a| a.iter().map(|h| hash_of(h, bytes)).collect())
                .unwrap_or_default();
            match ev["type"].as_str().unwrap() {
                "BlockStored" => KvEvent::BlockStored {
                    block_hashes: hashes,
                    parent_block_hash: (!ev["parent_block_hash"].is_null())
                        .then(|| hash_of(&ev["parent_block_hash"], bytes)),
                    token_ids: ev["token_ids"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_u64().unwrap() as u32)
                        .collect(),
                    block_size: ev["block_size"].as_u64().unwrap() as u32,
                    lora_id: ev["lora_id"].as_i64(),
                    medium: opt_str(ev, "medium"),
                    lora_name: opt_str(ev, "lora_name"),
                    extra_keys: present("extra_keys").then(|| {
                        ev["extra_keys"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|b| {
                                b.as_array()
                                    .map(|ks| ks.iter().map(extra_key).collect::<Vec<_>>())
                            })
                            .collect()
                    }),
                    group_idx: present("group_idx")
                        .then(|| opt_u32(ev, "group_idx"))
                        .flatten(),
                    kv_cache_spec_kind: present("kv_cache_spec_kind")
                        .then(|| opt_str(ev, "kv_cache_spec_kind"))
                        .flatten(),
                    kv_cache_spec_sliding_window: present("kv_cache_spec_sliding_window")
                        .then(|| opt_u32(ev, "kv_cache_spec_sliding_window"))
                        .flatten(),
                },
                "BlockRemoved" => KvEvent::BlockRemoved {
                    block_hashes: hashes,
                    medium: opt_str(ev, "medium"),
                    group_idx: present("group_idx")
                        .then(|| opt_u32(ev, "group_idx"))
                        .flatten(),
                },
                "AllBlocksCleared" => KvEvent::AllBlocksCleared,
                other => panic!("unknown event type {other}"),
            }
        })
        .collect();
    KvEventBatch {
        ts: fx["ts"].as_f64().unwrap(),
        events,
        data_parallel_rank: fx["data_parallel_rank"].as_i64(),
    }
}

#[test]
fn encoder_reproduces_vllm_fixtures_byte_for_byte() {
    let Some(dir) = fixtures() else { return };
    let index: Value =
        serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
    let mut checked = 0;
    for fx in index["fixtures"].as_array().unwrap() {
        if fx["encoding"] != "map-events" {
            continue;
        }
        let want = std::fs::read(dir.join(fx["payload_file"].as_str().unwrap())).unwrap();
        let got = encode_batch(&expected_batch(fx));
        assert_eq!(
            hex(&got),
            hex(&want),
            "fixture {} re-encodes differently",
            fx["name"]
        );
        checked += 1;
    }
    assert_eq!(checked, 9, "fixtures 01-09");
}

#[test]
fn hashes_match_index_digests() {
    let Some(dir) = fixtures() else { return };
    let index: Value =
        serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
    let h = &index["hashing"];
    let none = none_hash(DEFAULT_SEED);
    assert_eq!(hex(&none), h["none_hash_hex"].as_str().unwrap());
    let digests = |key: &str| -> Vec<String> {
        h[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_str().unwrap().to_string())
            .collect()
    };
    let hexes = |d: Vec<[u8; 32]>| d.iter().map(|d| hex(d)).collect::<Vec<_>>();
    let plain = HashExtras::default();
    let t0: Vec<u32> = (0..64).collect();
    assert_eq!(
        hexes(chain(&none, &t0, 16, &plain)),
        digests("tokens_0_63_digests_hex")
    );
    let t100: Vec<u32> = (100..148).collect();
    assert_eq!(
        hexes(chain(&none, &t100, 16, &plain)),
        digests("tokens_100_147_digests_hex")
    );
    let both = HashExtras {
        lora: Some(("sql-lora".into(), "acme/sql-lora".into())),
        cache_salt: Some("tenant-a".into()),
    };
    assert_eq!(
        hexes(chain(&none, &t0[..32], 16, &both)),
        digests("lora_salt_digests_hex")
    );
    let salt = HashExtras {
        lora: None,
        cache_salt: Some("tenant-a".into()),
    };
    assert_eq!(
        hexes(chain(&none, &t0[..32], 16, &salt)),
        digests("salt_only_digests_hex")
    );

    // hash_vectors.json: the sha256_cbor rows (both seeds).
    let hv: Value =
        serde_json::from_slice(&std::fs::read(dir.join("hash_vectors.json")).unwrap()).unwrap();
    let mut rows = 0;
    for v in hv["vectors"].as_array().unwrap() {
        if v["algo"] != "sha256_cbor" {
            continue;
        }
        let none = none_hash(v["seed"].as_str().unwrap());
        assert_eq!(hex(&none), v["none_hash_hex"].as_str().unwrap());
        let d = chain(&none, &t0[..32], 16, &plain);
        for (i, digest) in d.iter().enumerate() {
            assert_eq!(hex(digest), v["block_digests_hex"][i].as_str().unwrap());
            let u: u64 = v["block_u64"][i].as_str().unwrap().parse().unwrap();
            assert_eq!(digest_u64(digest), u);
        }
        rows += 1;
    }
    assert_eq!(rows, 2);
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn zmsg(frames: Vec<Vec<u8>>) -> ZmqMessage {
    ZmqMessage::try_from(
        frames
            .into_iter()
            .map(bytes::Bytes::from)
            .collect::<Vec<_>>(),
    )
    .unwrap()
}

fn frames(m: ZmqMessage) -> Vec<Vec<u8>> {
    m.into_vec().into_iter().map(|b| b.to_vec()).collect()
}

/// The pure-Rust zeromq crate does multipart PUB/SUB and ROUTER/DEALER on loopback, including
/// empty frames.
#[tokio::test]
async fn zeromq_crate_multipart_sanity() {
    let mut publ = zeromq::PubSocket::new();
    let ep = publ.bind("tcp://127.0.0.1:0").await.unwrap();
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&ep.to_string()).await.unwrap();
    sub.subscribe("").await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            publ.send(zmsg(vec![b"".to_vec(), vec![0; 8], b"x".to_vec()]))
                .await
                .unwrap();
            if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
                return frames(m);
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(got, vec![b"".to_vec(), vec![0; 8], b"x".to_vec()]);

    let mut router = zeromq::RouterSocket::new();
    let ep = router.bind("tcp://127.0.0.1:0").await.unwrap();
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&ep.to_string()).await.unwrap();
    dealer
        .send(zmsg(vec![b"".to_vec(), vec![1; 8]]))
        .await
        .unwrap();
    let req = frames(router.recv().await.unwrap());
    assert_eq!(req.len(), 3);
    assert_eq!(&req[1..], &[b"".to_vec(), vec![1; 8]]);
    router
        .send(zmsg(vec![
            req[0].clone(),
            b"".to_vec(),
            b"".to_vec(),
            vec![0xff; 8],
            b"".to_vec(),
        ]))
        .await
        .unwrap();
    let rep = frames(dealer.recv().await.unwrap());
    assert_eq!(
        rep,
        vec![b"".to_vec(), b"".to_vec(), vec![0xff; 8], b"".to_vec()]
    );
}

// ---------------------------------------------------------------------------------------------
// The real binary.

/// A running `vllm-sim` with KV events; killed on drop.
struct Sim {
    child: Child,
    base: String,
    events: String,
    replay: Option<String>,
    client: reqwest::Client,
}

const FAST: &[&str] = &[
    "--prefill-us-per-token",
    "0",
    "--ttft-base-ms",
    "0",
    "--decode-ms-per-token",
    "0",
];

impl Sim {
    fn start(args: &[&str]) -> Sim {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
            .args(["--port", "0"])
            .args(FAST)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn vllm-sim");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        let mut next = |prefix: &str| {
            line.clear();
            out.read_line(&mut line).expect("stdout line");
            line.trim()
                .strip_prefix(prefix)
                .unwrap_or_else(|| panic!("expected {prefix:?}, got {line:?}"))
                .to_string()
        };
        let addr = next("vllm-sim listening on ");
        let events = next("vllm-sim kv-events on ");
        let replay = args
            .contains(&"--kv-events-replay-endpoint")
            .then(|| next("vllm-sim kv-events replay on "));
        Sim {
            child,
            base: format!("http://{addr}"),
            events,
            replay,
            client: reqwest::Client::new(),
        }
    }

    async fn post(&self, path: &str, body: &Value) -> u16 {
        let resp = self
            .client
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
            .expect("request");
        let status = resp.status().as_u16();
        let _ = resp.bytes().await;
        status
    }

    async fn complete(&self, prompt: &str, salt: Option<&str>) {
        let mut body = json!({"prompt": prompt, "max_tokens": 1});
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        assert_eq!(self.post("/v1/completions", &body).await, 200);
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One received message, decoded just enough for the tests.
#[derive(Debug, Clone)]
struct Msg {
    topic: Vec<u8>,
    seq: u64,
    payload: Vec<u8>,
    batch: Mp,
}

impl Msg {
    fn parse(frames: Vec<Vec<u8>>) -> Msg {
        assert_eq!(frames.len(), 3, "3 frames");
        let seq = u64::from_be_bytes(frames[1].as_slice().try_into().expect("8-byte seq"));
        let batch = rmpv::decode::read_value(&mut frames[2].as_slice()).expect("msgpack");
        Msg {
            topic: frames[0].clone(),
            seq,
            payload: frames[2].clone(),
            batch,
        }
    }

    fn events(&self) -> Vec<Mp> {
        self.batch.as_array().unwrap()[1]
            .as_array()
            .unwrap()
            .clone()
    }
}

fn field<'a>(ev: &'a Mp, key: &str) -> Option<&'a Mp> {
    ev.as_map()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

fn keys(ev: &Mp) -> Vec<String> {
    ev.as_map()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str().unwrap().to_string())
        .collect()
}

fn kind(ev: &Mp) -> String {
    field(ev, "type").unwrap().as_str().unwrap().to_string()
}

fn u64s(v: &Mp) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect()
}

struct Subscriber {
    sub: zeromq::SubSocket,
    log: Vec<Msg>,
}

impl Subscriber {
    async fn connect(endpoint: &str) -> Subscriber {
        let mut sub = zeromq::SubSocket::new();
        sub.connect(endpoint).await.expect("connect SUB");
        sub.subscribe("").await.unwrap();
        Subscriber {
            sub,
            log: Vec::new(),
        }
    }

    async fn recv(&mut self, wait: Duration) -> Option<Msg> {
        let m = tokio::time::timeout(wait, self.sub.recv()).await.ok()?;
        let msg = Msg::parse(frames(m.expect("recv")));
        if let Some(prev) = self.log.last() {
            assert_eq!(msg.seq, prev.seq + 1, "consecutive sequence numbers");
        }
        self.log.push(msg.clone());
        Some(msg)
    }

    /// Slow joiner: sends distinct warm-up prompts until the first message gets through,
    /// then drains what is in flight.
    async fn join(&mut self, sim: &Sim) {
        for i in 0..100 {
            sim.complete(
                &format!("warm-up prompt number {i:04} {}", "w".repeat(64)),
                None,
            )
            .await;
            if self.recv(Duration::from_millis(200)).await.is_some() {
                while self.recv(Duration::from_millis(200)).await.is_some() {}
                return;
            }
        }
        panic!("no KV event arrived");
    }

    /// The next message, which must arrive within 5 s.
    async fn next(&mut self) -> Msg {
        self.recv(Duration::from_secs(5))
            .await
            .expect("a KV event message")
    }
}

fn hashes_of(tokens: &[u32], extras: &HashExtras) -> Vec<u64> {
    chain(&none_hash(DEFAULT_SEED), tokens, 16, extras)
        .iter()
        .map(|d| digest_u64(d))
        .collect()
}

/// 400 bytes of text = 100 pseudo tokens = 6 full blocks.
fn prompt_100(tag: &str) -> String {
    let mut p = format!("{tag}: ");
    while p.len() < 400 {
        p.push_str("the quick brown fox jumps over the lazy dog ");
    }
    p.truncate(400);
    p
}

const BLOCK_STORED_KEYS: [&str; 11] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
];

#[tokio::test]
async fn publishes_vllm_events_and_replays_them() {
    let sim = Sim::start(&[
        "--kv-events-endpoint",
        "tcp://*:0",
        "--kv-events-replay-endpoint",
        "tcp://*:0",
        "--kv-events-topic",
        "kv@sim@sim-model",
    ]);
    let mut sub = Subscriber::connect(&sim.events).await;
    sub.join(&sim).await;

    // A 100-token prompt: one BlockStored of 6 blocks, hashes = vLLM sha256_cbor chain.
    let prompt = prompt_100("first");
    let tokens = pseudo_tokens(prompt.as_bytes());
    assert_eq!(tokens.len(), 100);
    sim.complete(&prompt, None).await;
    let msg = sub.next().await;
    assert_eq!(msg.topic, b"kv@sim@sim-model");
    let batch = msg.batch.as_array().unwrap();
    assert_eq!(batch.len(), 3);
    assert!(matches!(batch[0], Mp::F64(_)));
    assert_eq!(batch[2].as_u64(), Some(0), "data_parallel_rank");
    let evs = msg.events();
    assert_eq!(evs.len(), 1);
    let ev = &evs[0];
    assert_eq!(keys(ev), BLOCK_STORED_KEYS);
    let want = hashes_of(&tokens, &HashExtras::default());
    assert_eq!(want.len(), 6);
    assert_eq!(u64s(field(ev, "block_hashes").unwrap()), want);
    assert!(field(ev, "parent_block_hash").unwrap().is_nil());
    assert_eq!(
        u64s(field(ev, "token_ids").unwrap()),
        tokens[..96]
            .iter()
            .map(|&t| u64::from(t))
            .collect::<Vec<_>>()
    );
    assert_eq!(field(ev, "block_size").unwrap().as_u64(), Some(16));
    assert_eq!(field(ev, "medium").unwrap().as_str(), Some("GPU"));
    assert!(field(ev, "lora_id").unwrap().is_nil());
    assert!(field(ev, "lora_name").unwrap().is_nil());
    let extra = field(ev, "extra_keys").unwrap().as_array().unwrap();
    assert_eq!(extra.len(), 6);
    assert!(extra.iter().all(Mp::is_nil));
    assert_eq!(field(ev, "group_idx").unwrap().as_u64(), Some(0));
    assert_eq!(
        field(ev, "kv_cache_spec_kind").unwrap().as_str(),
        Some("full_attention")
    );
    // The payload is exactly what the shared encoder writes for that content.
    let ts = batch[0].as_f64().unwrap();
    let expected = KvEventBatch {
        ts,
        events: vec![KvEvent::BlockStored {
            block_hashes: want.iter().map(|&h| BlockHash::Int(h)).collect(),
            parent_block_hash: None,
            token_ids: tokens[..96].to_vec(),
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: Some(vec![None; 6]),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            kv_cache_spec_sliding_window: None,
        }],
        data_parallel_rank: Some(0),
    };
    assert_eq!(msg.payload, encode_batch(&expected));

    // A longer prompt sharing those 6 blocks: only the new blocks, parent = block 5.
    let longer = format!("{prompt}{}", "x".repeat(64));
    let long_tokens = pseudo_tokens(longer.as_bytes());
    sim.complete(&longer, None).await;
    let ev = &sub.next().await.events()[0];
    let all = hashes_of(&long_tokens, &HashExtras::default());
    assert_eq!(&all[..6], &want[..]);
    assert_eq!(u64s(field(ev, "block_hashes").unwrap()), all[6..].to_vec());
    assert_eq!(
        field(ev, "parent_block_hash").unwrap().as_u64(),
        Some(want[5])
    );

    // cache_salt: block 0 hashes the tagged salt, extra_keys = [["tenant-a"], nil, ...].
    sim.complete(&prompt, Some("tenant-a")).await;
    let ev = &sub.next().await.events()[0];
    let salted = hashes_of(
        &tokens,
        &HashExtras {
            lora: None,
            cache_salt: Some("tenant-a".into()),
        },
    );
    assert_eq!(u64s(field(ev, "block_hashes").unwrap()), salted);
    let extra = field(ev, "extra_keys").unwrap().as_array().unwrap();
    assert_eq!(extra[0], Mp::Array(vec![Mp::from("tenant-a")]));
    assert!(extra[1..].iter().all(Mp::is_nil));

    // reset_prefix_cache → AllBlocksCleared (a map with only "type").
    assert_eq!(sim.post("/reset_prefix_cache", &json!({})).await, 200);
    let ev = &sub.next().await.events()[0];
    assert_eq!(keys(ev), ["type"]);
    assert_eq!(kind(ev), "AllBlocksCleared");

    // Replay over DEALER: everything from seq 0 (the warm-ups the SUB may have missed too),
    // then the end marker.
    let last = sub.log.last().unwrap().seq;
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(sim.replay.as_ref().unwrap()).await.unwrap();
    // Malformed requests get no reply: the valid request sent right after it is answered
    // first (the loop below checks that the first reply is seq 0's batch), so an answer to the
    // malformed one cannot hide behind a slow publisher.
    dealer
        .send(zmsg(vec![b"".to_vec(), vec![0; 3]]))
        .await
        .unwrap();
    dealer
        .send(zmsg(vec![b"".to_vec(), 0u64.to_be_bytes().to_vec()]))
        .await
        .unwrap();
    let mut expect_seq = 0;
    loop {
        let reply = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
            .await
            .expect("replay reply")
            .unwrap();
        let f = frames(reply);
        assert_eq!(f.len(), 4);
        assert!(f[0].is_empty());
        if f[2] == [0xff; 8] {
            assert!(f[1].is_empty() && f[3].is_empty(), "end marker");
            break;
        }
        assert_eq!(f[1], b"kv@sim@sim-model");
        let seq = u64::from_be_bytes(f[2].as_slice().try_into().unwrap());
        assert_eq!(seq, expect_seq);
        if let Some(live) = sub.log.iter().find(|m| m.seq == seq) {
            assert_eq!(live.payload, f[3], "replayed payload of seq {seq}");
        }
        expect_seq += 1;
    }
    assert_eq!(expect_seq, last + 1, "replay covers seq 0..={last}");

    // Replay from the middle.
    dealer
        .send(zmsg(vec![b"".to_vec(), last.to_be_bytes().to_vec()]))
        .await
        .unwrap();
    let f = frames(dealer.recv().await.unwrap());
    assert_eq!(f[2], last.to_be_bytes());
    let f = frames(dealer.recv().await.unwrap());
    assert_eq!(f[2], [0xff; 8]);
}

#[tokio::test]
async fn evictions_name_the_stored_vllm_hashes() {
    let sim = Sim::start(&["--kv-events-endpoint", "tcp://*:0", "--num-gpu-blocks", "8"]);
    let mut sub = Subscriber::connect(&sim.events).await;
    sub.join(&sim).await;
    // The slow joiner may have missed warm-up stores whose evictions come later: start the
    // replay from a cleared cache.
    assert_eq!(sim.post("/reset_prefix_cache", &json!({})).await, 200);
    let a = prompt_100("prompt A");
    let b = prompt_100("prompt B");
    sim.complete(&a, None).await;
    sim.complete(&b, None).await;
    sim.complete(&a, None).await;
    // Let everything arrive.
    while sub.recv(Duration::from_millis(300)).await.is_some() {}

    // Replaying the whole log on an index: every removal names a stored hash.
    let mut index = std::collections::HashSet::new();
    let mut removed = Vec::new();
    let mut cleared = false;
    for m in &sub.log {
        for ev in m.events() {
            let k = kind(&ev);
            cleared |= k == "AllBlocksCleared";
            if !cleared {
                continue;
            }
            match k.as_str() {
                "BlockStored" => {
                    for h in u64s(field(&ev, "block_hashes").unwrap()) {
                        assert!(index.insert(h), "stored twice without removal");
                    }
                }
                "BlockRemoved" => {
                    assert_eq!(keys(&ev), ["type", "block_hashes", "medium", "group_idx"]);
                    let hs = u64s(field(&ev, "block_hashes").unwrap());
                    assert_eq!(hs.len(), 1, "one BlockRemoved per hash");
                    assert!(index.remove(&hs[0]), "removed hash was stored");
                    removed.push(hs[0]);
                }
                "AllBlocksCleared" => index.clear(),
                other => panic!("unexpected {other}"),
            }
        }
    }
    assert!(index.len() <= 8);
    let ha = hashes_of(&pseudo_tokens(a.as_bytes()), &HashExtras::default());
    let hb = hashes_of(&pseudo_tokens(b.as_bytes()), &HashExtras::default());
    // B evicted A's tail first, then A evicted B's.
    assert!(removed.contains(&ha[5]));
    assert!(removed.iter().any(|h| hb.contains(h)));
    assert!(ha.iter().all(|h| index.contains(h)), "A cached again");
}

#[tokio::test]
async fn bytes_hashes_rank_offset_and_connect_mode() {
    // The router side binds; the sim (DP rank 1) dials port + 1, like vLLM's connect mode.
    // Bind first on an ephemeral port: probing for a free port and binding later races other tests.
    let mut sub = zeromq::SubSocket::new();
    let bound = sub.bind("tcp://127.0.0.1:0").await.expect("bind SUB");
    let port = match bound {
        zeromq::Endpoint::Tcp(_, p) => p - 1,
        other => panic!("unexpected endpoint {other}"),
    };
    sub.subscribe("").await.unwrap();
    let mut sub = Subscriber {
        sub,
        log: Vec::new(),
    };
    let sim = Sim::start(&[
        "--kv-events-endpoint",
        &format!("tcp://127.0.0.1:{port}"),
        "--kv-events-bytes-hashes",
        "--data-parallel-rank",
        "1",
    ]);
    assert_eq!(sim.events, format!("tcp://127.0.0.1:{}", port + 1));
    sub.join(&sim).await;
    let prompt = prompt_100("bytes");
    let tokens = pseudo_tokens(prompt.as_bytes());
    sim.complete(&prompt, None).await;
    let m = sub.next().await;
    assert_eq!(m.batch.as_array().unwrap()[2].as_u64(), Some(1));
    let ev = &m.events()[0];
    let digests = chain(
        &none_hash(DEFAULT_SEED),
        &tokens,
        16,
        &HashExtras::default(),
    );
    let got: Vec<Vec<u8>> = field(ev, "block_hashes")
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|h| match h {
            Mp::Binary(b) => b.clone(),
            other => panic!("expected bin, got {other}"),
        })
        .collect();
    assert_eq!(got, digests.iter().map(|d| d.to_vec()).collect::<Vec<_>>());
}

/// LoRA + cache_salt over token-id prompts: the live payload equals vLLM's fixture 04 byte for
/// byte (except the timestamp).
#[tokio::test]
async fn lora_and_salt_match_vllm_fixture_04() {
    let sim = Sim::start(&[
        "--kv-events-endpoint",
        "tcp://*:0",
        "--lora-modules",
        "sql-lora=acme/sql-lora",
    ]);
    let mut sub = Subscriber::connect(&sim.events).await;
    sub.join(&sim).await;
    let body = json!({
        "model": "sql-lora",
        "prompt": (0..32).collect::<Vec<u32>>(),
        "max_tokens": 1,
        "cache_salt": "tenant-a",
    });
    assert_eq!(sim.post("/v1/completions", &body).await, 200);
    let m = sub.next().await;
    let ev = &m.events()[0];
    assert_eq!(
        u64s(field(ev, "block_hashes").unwrap()),
        [2074664808143845955, 16629636498037367489]
    );
    assert_eq!(field(ev, "lora_id").unwrap().as_u64(), Some(1));
    assert_eq!(field(ev, "lora_name").unwrap().as_str(), Some("sql-lora"));
    let Some(dir) = fixtures() else { return };
    let mut want = std::fs::read(dir.join("04_block_stored_lora_cache_salt.msgpack")).unwrap();
    // Bytes 1..10 are `cb` + the float64 timestamp.
    want[2..10].copy_from_slice(&m.payload[2..10]);
    assert_eq!(hex(&m.payload), hex(&want));
}
