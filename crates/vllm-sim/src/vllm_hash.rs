//! vLLM 0.33 prefix-cache block hashes, `--prefix-caching-hash-algo sha256_cbor` flavour:
//!
//! ```text
//! NONE_HASH = SHA256(CBOR("vllm-none-hash"))
//! digest_i  = SHA256(CBOR([parent_digest (bstr 32), [token ids], extra_keys_or_null]))
//! parent    = digest_{i-1}, or NONE_HASH for block 0
//! int mode  = last 8 digest bytes, big-endian (what events carry by default)
//! ```
//! `extra_keys` is the *tagged* (hashed) form: `["lora", name, path]` on every block of a LoRA
//! request, then `["cache_salt", salt]` on block 0 only; `null` when a block has none. The
//! canonical CBOR needed here is tiny (unsigned ints, byte strings, text strings, arrays, null),
//! so it is written by hand.

use sha2::{Digest, Sha256};

/// A 32-byte SHA-256 block digest.
pub type BlockDigest = [u8; 32];

/// The default seed string vLLM 0.33 hashes into `NONE_HASH` (no `PYTHONHASHSEED`).
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// One element of a block's hashed extra keys (a CBOR value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cbor {
    /// Text string.
    Text(String),
    /// Array.
    Array(Vec<Cbor>),
}

fn head(out: &mut Vec<u8>, major: u8, v: u64) {
    let m = major << 5;
    if v < 24 {
        out.push(m | v as u8);
    } else if v <= u64::from(u8::MAX) {
        out.extend_from_slice(&[m | 24, v as u8]);
    } else if v <= u64::from(u16::MAX) {
        out.push(m | 25);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= u64::from(u32::MAX) {
        out.push(m | 26);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

impl Cbor {
    /// Appends the canonical (shortest-form, definite-length) CBOR encoding.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Cbor::Text(s) => {
                head(out, 3, s.len() as u64);
                out.extend_from_slice(s.as_bytes());
            }
            Cbor::Array(items) => {
                head(out, 4, items.len() as u64);
                for item in items {
                    item.encode(out);
                }
            }
        }
    }

    /// A tagged extra key: an array of text strings, e.g. `["cache_salt", salt]`.
    pub fn texts(parts: &[&str]) -> Cbor {
        Cbor::Array(parts.iter().map(|s| Cbor::Text((*s).to_string())).collect())
    }
}

/// `SHA256(CBOR(seed))`: the parent of block 0.
pub fn none_hash(seed: &str) -> BlockDigest {
    let mut buf = Vec::with_capacity(seed.len() + 9);
    Cbor::Text(seed.to_string()).encode(&mut buf);
    Sha256::digest(&buf).into()
}

/// The CBOR input vLLM hashes for one block: `[parent, tokens, extra_keys or null]`.
pub fn block_input(parent: &BlockDigest, tokens: &[u32], extra_keys: Option<&[Cbor]>) -> Vec<u8> {
    let mut buf = Vec::with_capacity(40 + tokens.len() * 5);
    head(&mut buf, 4, 3);
    head(&mut buf, 2, 32);
    buf.extend_from_slice(parent);
    head(&mut buf, 4, tokens.len() as u64);
    for &t in tokens {
        head(&mut buf, 0, u64::from(t));
    }
    match extra_keys {
        Some(keys) => {
            head(&mut buf, 4, keys.len() as u64);
            for k in keys {
                k.encode(&mut buf);
            }
        }
        None => buf.push(0xf6),
    }
    buf
}

/// One block's digest given its parent's.
pub fn block_digest(
    parent: &BlockDigest,
    tokens: &[u32],
    extra_keys: Option<&[Cbor]>,
) -> BlockDigest {
    Sha256::digest(block_input(parent, tokens, extra_keys)).into()
}

/// The int-mode event value of a digest: its last 8 bytes, big-endian.
pub fn digest_u64(d: &[u8]) -> u64 {
    let mut buf = [0u8; 8];
    let tail = &d[d.len().saturating_sub(8)..];
    buf[8 - tail.len()..].copy_from_slice(tail);
    u64::from_be_bytes(buf)
}

/// Request-level inputs to the hashed extra keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HashExtras {
    /// LoRA adapter `(name, path)`: `["lora", name, path]` on every block.
    pub lora: Option<(String, String)>,
    /// `cache_salt`: `["cache_salt", salt]` on block 0 only.
    pub cache_salt: Option<String>,
}

impl HashExtras {
    /// The tagged extra keys of block `index` (`None` = no extra keys, hashed as null).
    pub fn tagged(&self, index: usize) -> Option<Vec<Cbor>> {
        let mut keys = Vec::new();
        if let Some((name, path)) = &self.lora {
            keys.push(Cbor::texts(&["lora", name, path]));
        }
        if index == 0 {
            if let Some(salt) = &self.cache_salt {
                keys.push(Cbor::texts(&["cache_salt", salt]));
            }
        }
        (!keys.is_empty()).then_some(keys)
    }

    /// The untagged extra keys vLLM publishes for block `index` (`None` = nil).
    pub fn published(&self, index: usize) -> Option<Vec<String>> {
        let mut keys = Vec::new();
        if let Some((name, _)) = &self.lora {
            keys.push(name.clone());
        }
        if index == 0 {
            if let Some(salt) = &self.cache_salt {
                keys.push(salt.clone());
            }
        }
        (!keys.is_empty()).then_some(keys)
    }
}

/// Digests of every full `block_size`-token block of `tokens`, chained from `none`
/// (= [`none_hash`] of the seed).
pub fn chain(
    none: &BlockDigest,
    tokens: &[u32],
    block_size: usize,
    extras: &HashExtras,
) -> Vec<BlockDigest> {
    let mut parent = *none;
    tokens
        .chunks_exact(block_size.max(1))
        .enumerate()
        .map(|(i, block)| {
            let keys = extras.tagged(i);
            parent = block_digest(&parent, block, keys.as_deref());
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(d: &[u8]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    const NONE: &str = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0";

    #[test]
    fn none_hash_and_first_blocks_match_vllm() {
        let none = none_hash(DEFAULT_SEED);
        assert_eq!(hex(&none), NONE);
        assert_eq!(
            hex(&none_hash("0")),
            "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
        );
        let tokens: Vec<u32> = (0..64).collect();
        let d = chain(&none, &tokens, 16, &HashExtras::default());
        assert_eq!(
            d.iter().map(|d| hex(d)).collect::<Vec<_>>(),
            [
                "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
                "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
                "117dad852830e0103c12d7c7f8b7cf58434ea8751d1f42ee07b1c93711e4da6c",
                "c8d5e6f4474de3fedaf244a4a77b875c7b37aebd04530b5c4bd5fbb7d9d8aeab",
            ]
        );
        assert_eq!(digest_u64(&d[0]), 2233398808101521225);
        assert_eq!(digest_u64(&d[1]), 17911472383915781900);
        let tokens: Vec<u32> = (0..32).collect();
        let d = chain(&none_hash("0"), &tokens, 16, &HashExtras::default());
        assert_eq!(digest_u64(&d[0]), 12687895063098490012);
        assert_eq!(digest_u64(&d[1]), 1814341696565857452);
    }

    #[test]
    fn cbor_byte_layouts() {
        let mut b = Vec::new();
        Cbor::Text(DEFAULT_SEED.into()).encode(&mut b);
        assert_eq!(hex(&b), "6e766c6c6d2d6e6f6e652d68617368");
        let mut b = Vec::new();
        head(&mut b, 0, 151644);
        assert_eq!(hex(&b), "1a0002505c");
        let none = none_hash(DEFAULT_SEED);
        let tokens: Vec<u32> = (0..16).collect();
        assert_eq!(
            hex(&block_input(&none, &tokens, None)),
            format!("835820{NONE}90000102030405060708090a0b0c0d0e0ff6")
        );
    }

    #[test]
    fn lora_salt_and_salt_only() {
        let none = none_hash(DEFAULT_SEED);
        let tokens: Vec<u32> = (0..32).collect();
        let both = HashExtras {
            lora: Some(("sql-lora".into(), "acme/sql-lora".into())),
            cache_salt: Some("tenant-a".into()),
        };
        let keys = both.tagged(0).unwrap();
        assert_eq!(
            hex(&block_input(&none, &tokens[..16], Some(&keys))),
            format!(
                "835820{NONE}90000102030405060708090a0b0c0d0e0f\
                 8283646c6f72616873716c2d6c6f72616d61636d652f73716c2d6c6f7261\
                 826a63616368655f73616c746874656e616e742d61"
            )
        );
        let d = chain(&none, &tokens, 16, &both);
        assert_eq!(
            hex(&d[0]),
            "646853dec47b1d6f1a54c14611b4214c464250d4af5313791ccab0a6a56afa43"
        );
        assert_eq!(
            hex(&d[1]),
            "23ae635ecfcfef8b13c17ebab7921dd9f05bc9e354a8e6f0e6c85649916362c1"
        );
        assert_eq!(both.published(0).unwrap(), ["sql-lora", "tenant-a"]);
        assert_eq!(both.published(1).unwrap(), ["sql-lora"]);
        let salt = HashExtras {
            lora: None,
            cache_salt: Some("tenant-a".into()),
        };
        let d = chain(&none, &tokens, 16, &salt);
        assert_eq!(
            hex(&d[0]),
            "4e31e1ced73eb044a95997f0109d0ddab3d9145878214f1a0ee37c048b397859"
        );
        assert_eq!(
            hex(&d[1]),
            "dd153a6b48192c90c7d94ac9bb001d90b8150f328f74b1ea6f85313d4ecba23f"
        );
        assert_eq!(salt.published(1), None);
    }

    #[test]
    fn tokens_100_147() {
        let none = none_hash(DEFAULT_SEED);
        let tokens: Vec<u32> = (100..148).collect();
        let d = chain(&none, &tokens, 16, &HashExtras::default());
        assert_eq!(
            hex(&d[2]),
            "2441f618186a645f56c3898f753a836f1e3dab0ae51494ac7ffdff5408e1a2ee"
        );
        assert_eq!(digest_u64(&d[0]), 10428775992902877628);
    }
}
