//! msgpack encoder for [`KvEventBatch`], byte-compatible with what vLLM 0.33's publisher
//! (`msgspec.msgpack.Encoder()`) writes (see `docs/vllm-sim.md` and the shared reference §4).
//!
//! * The batch is a positional array `[ts (float64), events, data_parallel_rank]`; without a
//!   rank it is the earliest 2-element layout `[ts, events]`.
//! * Each event is a map whose first key is `"type"`, then the fields in vLLM 0.33's
//!   declaration order: required fields always (nil when `None`), optional fields only when
//!   `Some`. msgspec sizes a struct's map header for its maximum field count, so `BlockStored`
//!   (16 possible keys in 0.33) always gets a map16 header, the others a fixmap.
//! * Integers use the smallest msgpack encoding, strings fixstr/str8/str16/str32, arrays
//!   fixarray/array16/array32, binary bin8/bin16/bin32 — as msgspec does.

use super::types::{BlockHash, ExtraKey, KvEvent, KvEventBatch};

/// Encodes one batch exactly as vLLM 0.33's ZMQ publisher does (frame 3 of a message).
pub fn encode_batch(batch: &KvEventBatch) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 256);
    let n = if batch.data_parallel_rank.is_some() {
        3
    } else {
        2
    };
    write_array_len(&mut out, n);
    out.push(0xcb);
    out.extend_from_slice(&batch.ts.to_bits().to_be_bytes());
    write_array_len(&mut out, batch.events.len());
    for ev in &batch.events {
        encode_event(&mut out, ev);
    }
    if let Some(rank) = batch.data_parallel_rank {
        write_int(&mut out, rank);
    }
    out
}

/// Appends one event (map layout) to `out`.
fn encode_event(out: &mut Vec<u8>, ev: &KvEvent) {
    match ev {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
            group_idx,
            kv_cache_spec_kind,
            kv_cache_spec_sliding_window,
        } => {
            let pairs = 8
                + usize::from(extra_keys.is_some())
                + usize::from(group_idx.is_some())
                + usize::from(kv_cache_spec_kind.is_some())
                + usize::from(kv_cache_spec_sliding_window.is_some());
            // msgspec reserves a map16 header for structs with 16+ possible fields.
            out.push(0xde);
            out.extend_from_slice(&(pairs as u16).to_be_bytes());
            write_str(out, "type");
            write_str(out, "BlockStored");
            write_str(out, "block_hashes");
            write_hashes(out, block_hashes);
            write_str(out, "parent_block_hash");
            match parent_block_hash {
                Some(h) => write_hash(out, h),
                None => out.push(0xc0),
            }
            write_str(out, "token_ids");
            write_array_len(out, token_ids.len());
            for &t in token_ids {
                write_uint(out, u64::from(t));
            }
            write_str(out, "block_size");
            write_uint(out, u64::from(*block_size));
            write_str(out, "lora_id");
            match lora_id {
                Some(id) => write_int(out, *id),
                None => out.push(0xc0),
            }
            write_str(out, "medium");
            write_opt_str(out, medium.as_deref());
            write_str(out, "lora_name");
            write_opt_str(out, lora_name.as_deref());
            if let Some(extra) = extra_keys {
                write_str(out, "extra_keys");
                write_array_len(out, extra.len());
                for block in extra {
                    match block {
                        Some(keys) => {
                            write_array_len(out, keys.len());
                            for k in keys {
                                write_extra_key(out, k);
                            }
                        }
                        None => out.push(0xc0),
                    }
                }
            }
            if let Some(g) = group_idx {
                write_str(out, "group_idx");
                write_uint(out, u64::from(*g));
            }
            if let Some(kind) = kv_cache_spec_kind {
                write_str(out, "kv_cache_spec_kind");
                write_str(out, kind);
            }
            if let Some(w) = kv_cache_spec_sliding_window {
                write_str(out, "kv_cache_spec_sliding_window");
                write_uint(out, u64::from(*w));
            }
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        } => {
            let pairs = 3 + usize::from(group_idx.is_some());
            write_map_len(out, pairs);
            write_str(out, "type");
            write_str(out, "BlockRemoved");
            write_str(out, "block_hashes");
            write_hashes(out, block_hashes);
            write_str(out, "medium");
            write_opt_str(out, medium.as_deref());
            if let Some(g) = group_idx {
                write_str(out, "group_idx");
                write_uint(out, u64::from(*g));
            }
        }
        KvEvent::AllBlocksCleared => {
            write_map_len(out, 1);
            write_str(out, "type");
            write_str(out, "AllBlocksCleared");
        }
    }
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[BlockHash]) {
    write_array_len(out, hashes.len());
    for h in hashes {
        write_hash(out, h);
    }
}

fn write_hash(out: &mut Vec<u8>, h: &BlockHash) {
    match h {
        BlockHash::Int(v) => write_uint(out, *v),
        BlockHash::Bytes(b) => write_bin(out, b),
    }
}

fn write_extra_key(out: &mut Vec<u8>, k: &ExtraKey) {
    match k {
        ExtraKey::Str(s) | ExtraKey::Other(s) => write_str(out, s),
        ExtraKey::Bytes(b) => write_bin(out, b),
        ExtraKey::Int(i) => write_int(out, *i),
        ExtraKey::Array(items) => {
            write_array_len(out, items.len());
            for item in items {
                write_extra_key(out, item);
            }
        }
    }
}

fn write_opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => write_str(out, s),
        None => out.push(0xc0),
    }
}

/// Smallest unsigned encoding: positive fixint, uint8/16/32/64.
fn write_uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else if v <= u64::from(u8::MAX) {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v <= u64::from(u16::MAX) {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= u64::from(u32::MAX) {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// Smallest signed encoding (non-negative values as unsigned, like msgspec).
fn write_int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        write_uint(out, v as u64);
    } else if v >= -32 {
        out.push(v as i8 as u8);
    } else if v >= i64::from(i8::MIN) {
        out.extend_from_slice(&[0xd0, v as i8 as u8]);
    } else if v >= i64::from(i16::MIN) {
        out.push(0xd1);
        out.extend_from_slice(&(v as i16).to_be_bytes());
    } else if v >= i64::from(i32::MIN) {
        out.push(0xd2);
        out.extend_from_slice(&(v as i32).to_be_bytes());
    } else {
        out.push(0xd3);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if n <= usize::from(u8::MAX) {
        out.extend_from_slice(&[0xd9, n as u8]);
    } else if n <= usize::from(u16::MAX) {
        out.push(0xda);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

fn write_bin(out: &mut Vec<u8>, b: &[u8]) {
    let n = b.len();
    if n <= usize::from(u8::MAX) {
        out.extend_from_slice(&[0xc4, n as u8]);
    } else if n <= usize::from(u16::MAX) {
        out.push(0xc5);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xc6);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
    out.extend_from_slice(b);
}

fn write_array_len(out: &mut Vec<u8>, n: usize) {
    if n < 16 {
        out.push(0x90 | n as u8);
    } else if n <= usize::from(u16::MAX) {
        out.push(0xdc);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdd);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

fn write_map_len(out: &mut Vec<u8>, n: usize) {
    if n < 16 {
        out.push(0x80 | n as u8);
    } else if n <= usize::from(u16::MAX) {
        out.push(0xde);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdf);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_use_the_smallest_form() {
        let enc = |v: i64| {
            let mut o = Vec::new();
            write_int(&mut o, v);
            o
        };
        assert_eq!(enc(0), [0x00]);
        assert_eq!(enc(127), [0x7f]);
        assert_eq!(enc(128), [0xcc, 0x80]);
        assert_eq!(enc(256), [0xcd, 0x01, 0x00]);
        assert_eq!(enc(65_536), [0xce, 0, 1, 0, 0]);
        assert_eq!(enc(1 << 32), [0xcf, 0, 0, 0, 1, 0, 0, 0, 0]);
        assert_eq!(enc(-1), [0xff]);
        assert_eq!(enc(-33), [0xd0, 0xdf]);
        assert_eq!(enc(-129), [0xd1, 0xff, 0x7f]);
    }

    #[test]
    fn rankless_batch_is_two_elements() {
        let b = KvEventBatch {
            ts: 1.5,
            events: vec![KvEvent::AllBlocksCleared],
            data_parallel_rank: None,
        };
        let bytes = encode_batch(&b);
        assert_eq!(bytes[0], 0x92);
        assert_eq!(&bytes[1..10], &[0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]);
        assert_eq!(bytes[10], 0x91);
        assert_eq!(bytes[11], 0x81);
    }

    #[test]
    fn long_strings_use_str8() {
        let mut o = Vec::new();
        write_str(&mut o, &"x".repeat(32));
        assert_eq!(&o[..2], &[0xd9, 32]);
    }
}
