//! The mirror stream's encoding: changes survive it, and entries this router would not write
//! are refused.

use super::*;

fn as_map(fields: Vec<(&'static str, Vec<u8>)>) -> HashMap<String, Value> {
    fields
        .into_iter()
        .map(|(f, v)| (f.to_string(), Value::BulkString(v)))
        .collect()
}

#[test]
fn changes_survive_the_stream_encoding() {
    for c in [
        Change::Record {
            pod: PodId::new("10.0.0.1:8000"),
            keys: vec![
                BlockKey(1),
                BlockKey(u64::MAX),
                BlockKey(0x0123_4567_89ab_cdef),
            ],
            wall: 1_700_000_000_123,
            charge: Some(Charge {
                uncached_tokens: 4_000,
                prefill_ms: 350,
                mark: Some(ConversationMark {
                    best_match: 12,
                    new_conversation: true,
                }),
                announced: Some(9),
            }),
        },
        Change::Record {
            pod: PodId::new("10.0.0.2:8000"),
            keys: vec![BlockKey(3)],
            wall: 7,
            charge: Some(Charge {
                uncached_tokens: 16,
                prefill_ms: 0,
                mark: None,
                announced: None,
            }),
        },
        Change::Record {
            pod: PodId::new("p"),
            keys: vec![BlockKey(9)],
            wall: 1,
            charge: None,
        },
        Change::Session {
            hash: 0xfeed_beef,
            pod: PodId::new("pod-b"),
            ttl_ms: 600_000,
            wall: 5,
        },
    ] {
        assert_eq!(parse_entry(&as_map(fields(42, &c))), Some((42, c.clone())));
    }
}

#[test]
fn foreign_or_oversized_entries_are_refused() {
    let good = Change::Record {
        pod: PodId::new("p"),
        keys: vec![BlockKey(7)],
        wall: 1,
        charge: Some(Charge {
            uncached_tokens: 10,
            prefill_ms: 1,
            mark: Some(ConversationMark::default()),
            announced: Some(3),
        }),
    };
    let base = fields(1, &good);
    assert_eq!(parse_entry(&as_map(base.clone())), Some((1, good)));
    let with = |f: &str, v: &[u8]| {
        let mut m = as_map(base.clone());
        m.insert(f.to_string(), Value::BulkString(v.to_vec()));
        m
    };
    for bad in [
        with("k", b"1234567"),
        with("k", b""),
        with("o", b"not-hex"),
        with("t", b"z"),
        with("w", b"-1"),
        with("p", &[b'x'; MAX_POD + 1]),
        with("p", b""),
        with("p", &[0xff, 0xfe]),
        with("u", b"-5"),
        with("u", (MAX_CHARGE_TOKENS + 1).to_string().as_bytes()),
        with("d", (MAX_CHARGE_MS + 1).to_string().as_bytes()),
        with("b", (MAX_KEYS as u64 + 1).to_string().as_bytes()),
        with("b", b"-1"),
        with("n", b"2"),
        with("q", b"-2"),
    ] {
        assert_eq!(parse_entry(&bad), None);
    }
    let mut missing = as_map(base.clone());
    missing.remove("p");
    assert_eq!(parse_entry(&missing), None);
    // Half a charge is not one, nor half a mark, nor a mark without its charge.
    let mut half = as_map(base.clone());
    half.remove("d");
    assert_eq!(parse_entry(&half), None);
    let mut half_mark = as_map(base.clone());
    half_mark.remove("n");
    assert_eq!(parse_entry(&half_mark), None);
    let mut bare_mark = as_map(base);
    bare_mark.remove("u");
    bare_mark.remove("d");
    assert_eq!(parse_entry(&bare_mark), None);
}

#[test]
fn entry_ids_order_as_redis_orders_them() {
    let a = EntryId::parse("1700000000000-9").unwrap();
    let b = EntryId::parse("1700000000001-0").unwrap();
    assert!(a < b && EntryId::default() < a);
    assert_eq!(a.render(), "1700000000000-9");
    assert_eq!(EntryId::parse("12"), None);
    assert_eq!(EntryId::parse("a-1"), None);
}
