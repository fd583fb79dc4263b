//! A load message: one decision's load, or its release, as the load stream and the peers'
//! datagrams carry it.

use std::collections::HashMap;

use redis::Value;

use super::stream::{MAX_CHARGE_MS, MAX_CHARGE_TOKENS, MAX_POD};
use crate::pods::PodId;
use crate::share::Release;

/// What a load message says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A load counted for its predicted prefill (older replicas send only these).
    Load,
    /// A load whose tokens count until its replica releases them.
    Held,
    /// The release of a held load: [`Release::Started`] or [`Release::Settled`].
    Released(Release),
}

impl Kind {
    pub(super) fn code(self) -> u8 {
        match self {
            Kind::Load => 0,
            Kind::Held => 1,
            Kind::Released(Release::Started) => 2,
            Kind::Released(Release::Settled) => 3,
        }
    }

    pub(super) fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            0 => Kind::Load,
            1 => Kind::Held,
            2 => Kind::Released(Release::Started),
            3 => Kind::Released(Release::Settled),
            _ => return None,
        })
    }
}

/// One decision's load, or its release, as the load stream carries it. A release names the
/// load's pod and number, at its own time, with no tokens: an older replica takes it for a
/// second copy of the load and skips it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Announced {
    pub(super) origin: u64,
    pub(super) seq: u64,
    pub(super) pod: PodId,
    /// When it was committed (a release: sent), unix microseconds.
    pub(super) wall_us: u64,
    pub(super) uncached_tokens: u64,
    pub(super) prefill_ms: u64,
    pub(super) kind: Kind,
}

impl Announced {
    pub(super) fn fields(&self) -> [(&'static str, Vec<u8>); 7] {
        [
            ("k", self.kind.code().to_string().into_bytes()),
            ("o", format!("{:016x}", self.origin).into_bytes()),
            ("q", self.seq.to_string().into_bytes()),
            ("p", self.pod.as_str().as_bytes().to_vec()),
            ("m", self.wall_us.to_string().into_bytes()),
            ("u", self.uncached_tokens.to_string().into_bytes()),
            ("d", self.prefill_ms.to_string().into_bytes()),
        ]
    }

    /// A load entry; `None` for anything this router would not write.
    pub(super) fn parse(map: &HashMap<String, Value>) -> Option<Self> {
        let bytes = |f: &str| match map.get(f)? {
            Value::BulkString(b) => Some(b.as_slice()),
            Value::SimpleString(s) => Some(s.as_bytes()),
            _ => None,
        };
        let text = |f: &str| std::str::from_utf8(bytes(f)?).ok();
        let number = |f: &str| text(f)?.parse::<u64>().ok();
        Some(Self {
            origin: u64::from_str_radix(text("o").filter(|s| s.len() == 16)?, 16).ok()?,
            seq: number("q")?,
            pod: PodId::new(text("p").filter(|p| !p.is_empty() && p.len() <= MAX_POD)?),
            wall_us: number("m")?,
            uncached_tokens: number("u").filter(|&u| u <= MAX_CHARGE_TOKENS)?,
            prefill_ms: number("d").filter(|&d| d <= MAX_CHARGE_MS)?,
            kind: match map.contains_key("k") {
                true => Kind::from_code(u8::try_from(number("k")?).ok()?)?,
                false => Kind::Load,
            },
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A load as tests send it (also the datagram tests').
    pub(in crate::index::redis) fn announced() -> Announced {
        Announced {
            origin: 0xabc,
            seq: 41,
            pod: PodId::new("10.0.0.1:8000"),
            wall_us: 1_700_000_000_123_456,
            uncached_tokens: 4_000,
            prefill_ms: 350,
            kind: Kind::Held,
        }
    }

    fn as_map(a: &Announced) -> HashMap<String, Value> {
        a.fields()
            .into_iter()
            .map(|(f, v)| (f.to_string(), Value::BulkString(v)))
            .collect()
    }

    #[test]
    fn a_load_survives_the_stream_encoding_and_bad_ones_are_refused() {
        let a = announced();
        assert_eq!(Announced::parse(&as_map(&a)), Some(a.clone()));
        let with = |f: &str, v: &[u8]| {
            let mut m = as_map(&a);
            m.insert(f.to_string(), Value::BulkString(v.to_vec()));
            m
        };
        for bad in [
            with("o", b"not-hex"),
            with("q", b"-1"),
            with("p", b""),
            with("p", &[b'x'; MAX_POD + 1]),
            with("m", b"soon"),
            with("u", (MAX_CHARGE_TOKENS + 1).to_string().as_bytes()),
            with("d", (MAX_CHARGE_MS + 1).to_string().as_bytes()),
            with("k", b"4"),
            with("k", b"256"),
        ] {
            assert_eq!(Announced::parse(&bad), None);
        }
        let mut missing = as_map(&a);
        missing.remove("q");
        assert_eq!(Announced::parse(&missing), None);
        // An older replica's entry has no kind: a load counted for its predicted prefill.
        let mut old = as_map(&a);
        old.remove("k");
        assert_eq!(Announced::parse(&old).unwrap().kind, Kind::Load);
        for c in 0..4 {
            let k = Kind::from_code(c).unwrap();
            let r = Announced {
                kind: k,
                ..a.clone()
            };
            assert_eq!(Announced::parse(&as_map(&r)).unwrap().kind, k);
        }
    }
}
