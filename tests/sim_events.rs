//! vLLM KV events from `vllm-sim`: the msgpack encoder against vLLM 0.33's golden bytes, the
//! block hashes against vLLM's vectors, and the live ZMQ publisher / replay service of the
//! real binary.
//!
//! Fixtures are read from `$KV_EVENTS_FIXTURES` (default `/work/shared/fixtures/vllm-kv-events`);
//! fixture-based tests are skipped with a message when the directory is missing.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kv_router::events::{encode_batch, BlockHash, ExtraKey, KvEvent, KvEventBatch};
use kv_router::sim::vllm_hash::{chain, digest_u64, none_hash, HashExtras, DEFAULT_SEED};
use serde_json::{json, Value};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

fn fixtures() -> Option<PathBuf> {
    let dir = std::env::var_os("KV_EVENTS_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/work/shared/fixtures/vllm-kv-events"));
    if dir.join("index.json").exists() {
        Some(dir)
    } else {
        eprintln!("skipping: no fixtures at {}", dir.display());
        None
    }
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
