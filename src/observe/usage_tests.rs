use super::*;
use crate::budget::BodyBudget;

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/usage/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The body fed in chunks of `chunk` bytes; what the scanner reports, and the id.
fn scan(
    body: &[u8],
    content_type: Option<&str>,
    want_id: bool,
    chunk: usize,
) -> (Usage, Option<String>) {
    let budget = BodyBudget::new(1 << 20);
    let mut s = Scanner::new(content_type, want_id, budget.reservation());
    let mut id = None;
    for c in body.chunks(chunk.max(1)) {
        s.feed(c);
        id = id.or(s.take_id());
        assert!(budget.used() <= WINDOW, "{} held", budget.used());
    }
    let usage = s.finish();
    assert_eq!(budget.used(), 0, "the window is given back at the end");
    (usage, id.or(s.take_id()))
}

fn seen(cached: u64, prompt: u64) -> Usage {
    Usage {
        cached_tokens: Some(cached),
        prompt_tokens: Some(prompt),
    }
}

/// Every fixture, whole and in small and odd chunks, with and without its content type.
#[test]
fn each_engine_format_reports_its_cached_tokens() {
    let cases: [(&str, &str, Usage); 9] = [
        ("vllm-chat.json", "application/json", seen(480, 512)),
        ("vllm-chat-stream.sse", "text/event-stream", seen(464, 530)),
        ("sglang-chat.json", "application/json", seen(256, 300)),
        (
            "sglang-generate-stream.sse",
            "text/event-stream; charset=utf-8",
            seen(128, 140),
        ),
        ("responses.json", "application/json", seen(96, 120)),
        ("responses-stream.sse", "text/event-stream", seen(96, 120)),
        (
            "llama-completion.json",
            "application/json",
            LLAMA_COMPLETION,
        ),
        (
            "llama-chat-stream.sse",
            "text/event-stream",
            LLAMA_CHAT_STREAM,
        ),
        ("llama-native.json", "application/json", seen(38, 40)),
    ];
    for (name, ct, want) in cases {
        let body = fixture(name);
        for chunk in [body.len(), 1, 7, 64] {
            for ct in [Some(ct), None] {
                let (got, _) = scan(&body, ct, false, chunk);
                assert_eq!(got, want, "{name}, chunks of {chunk}, content type {ct:?}");
            }
        }
    }
}

/// What the llama.cpp fixtures report (tests/fixtures/usage/README.md).
const LLAMA_COMPLETION: Usage = Usage {
    cached_tokens: Some(38),
    prompt_tokens: Some(40),
};
const LLAMA_CHAT_STREAM: Usage = Usage {
    cached_tokens: Some(46),
    prompt_tokens: Some(54),
};

#[test]
fn llama_timings_alone_are_read() {
    // Native /completion: no OpenAI usage, only timings (cache_n reused, prompt_n computed).
    let body = br#"{"content":"x","tokens_cached":40,"timings":{"cache_n":32,"prompt_n":9,"prompt_ms":1.5,"predicted_n":1}}"#;
    assert_eq!(scan(body, None, false, 5).0, seen(32, 41));
}

#[test]
fn no_cached_count_is_no_observation() {
    let (got, _) = scan(&fixture("vllm-no-details.json"), None, false, 13);
    assert_eq!(
        got,
        Usage {
            cached_tokens: None,
            prompt_tokens: Some(200)
        }
    );
    // A stream without include_usage: no usage at all.
    let body = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n";
    assert_eq!(scan(body, None, false, 9).0, Usage::default());
}

#[test]
fn response_ids_come_from_the_top_level_or_response_created() {
    let (_, id) = scan(&fixture("responses.json"), None, true, 11);
    assert_eq!(id.as_deref(), Some("resp_0a1b2c3d4e5f60718293a4b5c6d7e8f9"));
    let (_, id) = scan(&fixture("responses-stream.sse"), None, true, 11);
    assert_eq!(id.as_deref(), Some("resp_9f8e7d6c5b4a39281706f5e4d3c2b1a0"));
    // Not asked for (not a /v1/responses request): not read.
    assert_eq!(scan(&fixture("responses.json"), None, false, 11).1, None);
    // A nested "id" is not the response's.
    let body = br#"{"object":"response","output":[{"id":"msg_1"}],"id":"resp_top"}"#;
    assert_eq!(scan(body, None, true, 3).1.as_deref(), Some("resp_top"));
    let body = br#"{"output":[{"id":"msg_1"}]}"#;
    assert_eq!(scan(body, None, true, 3).1, None);
}

#[test]
fn a_long_json_body_keeps_its_head_id_and_its_tail_usage_in_one_window() {
    let filler = "x".repeat(3 * WINDOW);
    let body = format!(
        r#"{{"id":"resp_long","object":"response","output":[{{"type":"message","content":[{{"text":"{filler}"}}]}}],"usage":{{"input_tokens":900,"input_tokens_details":{{"cached_tokens":800}}}}}}"#
    );
    for chunk in [body.len(), 1000, 70_000] {
        let (usage, id) = scan(body.as_bytes(), None, true, chunk);
        assert_eq!((usage, id.as_deref()), (seen(800, 900), Some("resp_long")));
    }
}

#[test]
fn an_sse_line_longer_than_the_window_is_skipped_not_kept() {
    let long = format!(
        "data: {{\"usage\":{{\"prompt_tokens\":5,\"prompt_tokens_details\":{{\"cached_tokens\":1}}}},\"pad\":\"{}\"}}\n\n",
        "y".repeat(WINDOW)
    );
    let body = format!(
        "{long}data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":70,\"prompt_tokens_details\":{{\"cached_tokens\":64}}}}}}\n\n"
    );
    assert_eq!(scan(body.as_bytes(), None, false, 4096).0, seen(64, 70));
    assert_eq!(scan(long.as_bytes(), None, false, 4096).0, Usage::default());
}

#[test]
fn a_refused_budget_ends_the_observation() {
    let budget = BodyBudget::new(100);
    let mut s = Scanner::new(None, true, budget.reservation());
    s.feed(&fixture("vllm-chat.json"));
    assert_eq!(s.finish(), Usage::default());
    assert_eq!(budget.used(), 0);
}

#[test]
fn malformed_input_is_no_observation() {
    let cases: [&[u8]; 10] = [
        b"",
        b"{",
        b"}}}}]]]",
        b"{\"usage\":",
        b"{\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":-3}}}",
        b"{\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":\"480\"}}}",
        b"{\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":1e99}}}",
        b"data: {\"usage\":null}\n\n",
        b"\xff\xfe\x00data:\x00{\"usage\"\n",
        b"{\"id\":\"\\\"\",\"timings\":[1,2]}",
    ];
    for body in cases {
        for chunk in [1, 3, body.len()] {
            let (usage, _) = scan(body, None, true, chunk);
            assert_eq!(usage.cached_tokens, None, "{body:?}");
        }
    }
}

#[test]
fn arbitrary_bytes_never_panic() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let alphabet = b"{}[]\":,\\ \n\rdata:usagecached_tokenstimingscache_nmeta_info0123456789id";
    for _ in 0..2000 {
        let len = (next() % 300) as usize;
        let body: Vec<u8> = (0..len)
            .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
            .collect();
        let chunk = 1 + (next() % 40) as usize;
        let _ = scan(&body, None, true, chunk);
    }
}

#[test]
fn an_id_only_scanner_gives_its_bytes_back_once_the_id_is_read() {
    let budget = BodyBudget::new(1 << 20);
    // A JSON body: the id is read from its head, before the body ends.
    let mut s = Scanner::id_only(budget.reservation());
    s.feed(b"{\"id\":\"resp_1\",\"object\":\"response\",\"output\":[");
    assert_eq!(s.take_id().as_deref(), Some("resp_1"));
    assert_eq!(budget.used(), 0, "nothing is kept once the id is read");
    s.feed(&[b' '; 10_000]);
    assert_eq!(budget.used(), 0);
    // Cut inside the id: kept until the rest arrives.
    let mut s = Scanner::id_only(budget.reservation());
    s.feed(b"{\"id\":\"resp_");
    assert_eq!(s.take_id(), None);
    assert!(budget.used() > 0);
    s.feed(b"2\",\"output\":[]}");
    assert_eq!(s.take_id().as_deref(), Some("resp_2"));
    assert_eq!(budget.used(), 0);
    // A stream: its response.created event names it.
    let stream = fixture("responses-stream.sse");
    let mut s = Scanner::id_only(budget.reservation());
    for c in stream.chunks(7) {
        s.feed(c);
    }
    assert!(s.take_id().is_some_and(|id| id.starts_with("resp")));
    assert_eq!(budget.used(), 0);
}
