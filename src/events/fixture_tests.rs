//! Every fixture in `data/vllm-kv-events/` (vLLM 0.33's own publisher output) decodes
//! to its documented meaning in `index.json`; malformed payloads are errors, never panics.

use std::path::PathBuf;

use serde_json::Value as J;

use super::decode::MAX_PAYLOAD_BYTES;
use super::*;

pub(crate) fn fixtures_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/vllm-kv-events");
    assert!(
        dir.join("index.json").exists(),
        "vLLM KV-event fixtures not found at {} (they are part of the repository)",
        dir.display()
    );
    dir
}

pub(crate) fn index() -> J {
    serde_json::from_slice(&std::fs::read(fixtures_dir().join("index.json")).unwrap()).unwrap()
}

pub(crate) fn payload(name: &str) -> Vec<u8> {
    std::fs::read(fixtures_dir().join(format!("{name}.msgpack"))).unwrap()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn expect_hash(j: &J, bytes_mode: bool) -> BlockHash {
    let s = j.as_str().unwrap();
    if bytes_mode {
        BlockHash::Bytes(unhex(s))
    } else {
        BlockHash::Int(s.parse().unwrap())
    }
}

fn expect_extra(j: &J) -> ExtraKey {
    match j {
        J::String(s) => ExtraKey::Str(s.clone()),
        J::Array(a) => ExtraKey::Array(a.iter().map(expect_extra).collect()),
        J::Number(n) => ExtraKey::Int(n.as_i64().unwrap()),
        other => panic!("unexpected extra key {other}"),
    }
}

fn expected_event(e: &J, bytes_mode: bool) -> KvEvent {
    let opt_str = |k: &str| e.get(k).and_then(J::as_str).map(String::from);
    let opt_u32 = |k: &str| e.get(k).and_then(J::as_u64).map(|v| v as u32);
    let hashes = |k: &str| {
        e[k].as_array()
            .unwrap()
            .iter()
            .map(|h| expect_hash(h, bytes_mode))
            .collect()
    };
    match e["type"].as_str().unwrap() {
        "BlockStored" => KvEvent::BlockStored {
            block_hashes: hashes("block_hashes"),
            parent_block_hash: (!e["parent_block_hash"].is_null())
                .then(|| expect_hash(&e["parent_block_hash"], bytes_mode)),
            token_ids: e["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect(),
            block_size: e["block_size"].as_u64().unwrap() as u32,
            lora_id: e.get("lora_id").and_then(J::as_i64),
            medium: opt_str("medium"),
            lora_name: opt_str("lora_name"),
            extra_keys: e.get("extra_keys").and_then(J::as_array).map(|blocks| {
                blocks
                    .iter()
                    .map(|b| {
                        b.as_array()
                            .map(|keys| keys.iter().map(expect_extra).collect())
                    })
                    .collect()
            }),
            group_idx: opt_u32("group_idx"),
            kv_cache_spec_kind: opt_str("kv_cache_spec_kind"),
            kv_cache_spec_sliding_window: opt_u32("kv_cache_spec_sliding_window"),
        },
        "BlockRemoved" => KvEvent::BlockRemoved {
            block_hashes: hashes("block_hashes"),
            medium: opt_str("medium"),
            group_idx: opt_u32("group_idx"),
        },
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        other => panic!("unknown type {other}"),
    }
}

#[test]
fn every_fixture_decodes_to_its_documented_meaning() {
    let index = index();
    let fixtures = index["fixtures"].as_array().unwrap();
    let files: Vec<String> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".msgpack"))
        .collect();
    assert_eq!(
        files.len(),
        fixtures.len(),
        "index.json lists every payload file"
    );
    for f in fixtures {
        let name = f["name"].as_str().unwrap();
        let batch = decode_batch(&payload(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(batch.ts, f["ts"].as_f64().unwrap(), "{name} ts");
        assert_eq!(
            batch.data_parallel_rank,
            f["data_parallel_rank"].as_i64(),
            "{name} rank"
        );
        let bytes_mode = f["hash_encoding"] == "bytes";
        let expected: Vec<KvEvent> = f["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| expected_event(e, bytes_mode))
            .collect();
        assert_eq!(batch.events, expected, "{name} events");
        if bytes_mode {
            // Folding the digests gives the int-mode values of the same blocks.
            for (got, e) in batch.events.iter().zip(f["events"].as_array().unwrap()) {
                let hs = match got {
                    KvEvent::BlockStored { block_hashes, .. }
                    | KvEvent::BlockRemoved { block_hashes, .. } => block_hashes,
                    KvEvent::AllBlocksCleared => continue,
                };
                let ints: Vec<u64> = e["block_hashes_int_mode_u64"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|h| h.as_str().unwrap().parse().unwrap())
                    .collect();
                assert_eq!(
                    hs.iter().map(BlockHash::as_u64).collect::<Vec<_>>(),
                    ints,
                    "{name} int-mode fold"
                );
            }
        }
    }
}

#[test]
fn frames_files_match_their_payloads() {
    let index = index();
    for f in index["fixtures"].as_array().unwrap() {
        let name = f["name"].as_str().unwrap();
        let frames: J = serde_json::from_slice(
            &std::fs::read(fixtures_dir().join(f["frames_file"].as_str().unwrap())).unwrap(),
        )
        .unwrap();
        let hex = frames["frames_hex"].as_array().unwrap();
        assert_eq!(hex.len(), 3, "{name}: topic, seq, payload");
        assert_eq!(
            unhex(hex[0].as_str().unwrap()),
            f["topic"].as_str().unwrap().as_bytes()
        );
        let seq = unhex(hex[1].as_str().unwrap());
        assert_eq!(
            u64::from_be_bytes(seq.try_into().unwrap()),
            f["seq"].as_u64().unwrap()
        );
        assert_eq!(unhex(hex[2].as_str().unwrap()), payload(name));
    }
}

#[test]
fn replay_replies_carry_fixture_payloads() {
    let replay: J = serde_json::from_slice(
        &std::fs::read(fixtures_dir().join("10_replay_exchange.json")).unwrap(),
    )
    .unwrap();
    let replies = replay["replies"].as_array().unwrap();
    let names = [
        "06_block_removed",
        "07_all_blocks_cleared",
        "08_mixed_batch",
    ];
    for (reply, name) in replies.iter().zip(names) {
        let frames = reply["frames_hex"].as_array().unwrap();
        assert_eq!(frames.len(), 4);
        assert_eq!(unhex(frames[3].as_str().unwrap()), payload(name));
        decode_batch(&unhex(frames[3].as_str().unwrap())).unwrap();
    }
}

#[test]
fn malformed_payloads_are_errors_not_panics() {
    let good = payload("08_mixed_batch");
    // Every truncation of a real payload fails cleanly.
    for cut in 0..good.len() {
        assert!(decode_batch(&good[..cut]).is_err(), "truncated at {cut}");
    }
    // Every single-byte corruption either decodes or fails cleanly (never panics).
    for i in 0..good.len() {
        for b in [0x00u8, 0xc1, 0xdd, 0xff, 0x90] {
            let mut bad = good.clone();
            bad[i] = b;
            let _ = decode_batch(&bad);
        }
    }
    let (batch, event, msgpack) = (
        DecodeError::Batch(""),
        DecodeError::Event {
            index: 0,
            reason: String::new(),
        },
        DecodeError::Msgpack(String::new()),
    );
    let cases: Vec<(&[u8], &DecodeError)> = vec![
        (&[0xc0], &batch),                               // nil
        (&[0x91, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0], &batch), // [ts] only
        (&[0x92, 0xa1, b'x', 0x90], &batch),             // ts is a string
        (&[0x92, 0x00, 0x91, 0x01], &event),             // event is an int
        (&[0x92, 0x00, 0x91, 0x91, 0xa1, b'Z'], &event), // unknown tag
        (
            &[
                0x92, 0x00, 0x91, 0x92, 0xab, b'B', b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r',
                b'e', b'd', 0x90,
            ],
            &event,
        ), // short BlockStored
        (&[0xdd, 0xff, 0xff, 0xff, 0xff], &msgpack),     // array32 claiming 4G elements
        (&[0x92, 0x00, 0x90, 0x00], &msgpack),           // trailing byte
    ];
    for (bytes, kind) in cases {
        let err = decode_batch(bytes).unwrap_err();
        assert_eq!(
            std::mem::discriminant(&err),
            std::mem::discriminant(kind),
            "{bytes:02x?}: {err}"
        );
    }
    assert!(matches!(
        decode_batch(&vec![0u8; MAX_PAYLOAD_BYTES + 1]),
        Err(DecodeError::TooLarge(_))
    ));
}

#[test]
fn negative_int64_hashes_are_reinterpreted() {
    // [0, [["BlockRemoved", [-2]]]] with -2 as int64 (d3).
    let mut p = vec![0x92, 0x00, 0x91, 0x92, 0xac];
    p.extend_from_slice(b"BlockRemoved");
    p.extend_from_slice(&[0x91, 0xd3]);
    p.extend_from_slice(&(-2i64).to_be_bytes());
    let batch = decode_batch(&p).unwrap();
    assert_eq!(
        batch.events,
        vec![KvEvent::BlockRemoved {
            block_hashes: vec![BlockHash::Int(u64::MAX - 1)],
            medium: None,
            group_idx: None
        }]
    );
}

mod roundtrip {
    use proptest::prelude::*;

    use super::super::*;

    fn hash() -> impl Strategy<Value = BlockHash> {
        prop_oneof![
            any::<u64>().prop_map(BlockHash::Int),
            prop::collection::vec(any::<u8>(), 1..33).prop_map(BlockHash::Bytes),
        ]
    }

    fn extra() -> impl Strategy<Value = Option<Vec<ExtraKey>>> {
        prop::option::of(prop::collection::vec(
            prop_oneof![
                "[a-z-]{0,12}".prop_map(ExtraKey::Str),
                any::<i64>().prop_map(ExtraKey::Int)
            ],
            0..3,
        ))
    }

    fn event() -> impl Strategy<Value = KvEvent> {
        let stored = (
            prop::collection::vec(hash(), 0..4),
            prop::option::of(hash()),
            prop::collection::vec(any::<u32>(), 0..40),
            any::<u32>(),
            prop::option::of(any::<i64>()),
            prop::option::of(prop_oneof![
                Just("GPU".to_string()),
                Just("CPU".to_string())
            ]),
            prop::option::of("[a-z]{1,8}"),
            prop::option::of(prop::collection::vec(extra(), 0..3)),
            prop::option::of(any::<u32>()),
            prop::option::of(Just("full_attention".to_string())),
            prop::option::of(any::<u32>()),
        )
            .prop_map(
                |(h, p, t, bs, lid, m, ln, ek, g, kind, sw)| KvEvent::BlockStored {
                    block_hashes: h,
                    parent_block_hash: p,
                    token_ids: t,
                    block_size: bs,
                    lora_id: lid,
                    medium: m,
                    lora_name: ln,
                    extra_keys: ek,
                    group_idx: g,
                    kv_cache_spec_kind: kind,
                    kv_cache_spec_sliding_window: sw,
                },
            );
        let removed = (
            prop::collection::vec(hash(), 0..4),
            prop::option::of(Just("GPU".to_string())),
            prop::option::of(any::<u32>()),
        )
            .prop_map(|(h, m, g)| KvEvent::BlockRemoved {
                block_hashes: h,
                medium: m,
                group_idx: g,
            });
        prop_oneof![stored, removed, Just(KvEvent::AllBlocksCleared)]
    }

    proptest! {
        #[test]
        fn decode_inverts_encode(events in prop::collection::vec(event(), 0..6), ts in 0.0f64..2e9, rank in prop::option::of(0i64..8)) {
            let batch = KvEventBatch { ts, events, data_parallel_rank: rank };
            prop_assert_eq!(decode_batch(&encode_batch(&batch)).unwrap(), batch);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
            let _ = decode_batch(&bytes);
        }

        #[test]
        fn mutated_real_payloads_never_panic(idx in 0usize..1000, byte in any::<u8>(), cut in 0usize..1000) {
            let mut p = payload("08_mixed_batch");
            let i = idx % p.len();
            p[i] = byte;
            p.truncate(p.len() - cut % p.len());
            let _ = decode_batch(&p);
        }
    }

    use super::payload;
}
