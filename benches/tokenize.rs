//! Tokenizing a ~100k-token chat prompt (long shared system prompt + short user turn), with and
//! without the prefix cache. Tokenizer: vendored GPT-2 + ChatML added tokens; template: the
//! vendored Qwen3 chat template. Run: `cargo bench --bench tokenize`.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{criterion_group, criterion_main, Criterion};
use kv_router::request::ChatInput;
use kv_router::tokenize::{CacheConfig, ChatTemplate, Tokenizer};
use serde_json::{json, Value};
use tokenizers::AddedToken;

const WORDS: [&str; 32] = [
    " the", " and", " that", " for", " you", " with", " this", " was", " are", " have", " not",
    " but", " from", " they", " his", " she", " which", " will", " would", " there", " their",
    " what", " about", " been", " more", " when", " some", " time", " could", " them", " other",
    " into",
];

fn tokenizer(cache: Option<CacheConfig>) -> Tokenizer {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers");
    let mut inner = tokenizers::Tokenizer::from_file(dir.join("gpt2/tokenizer.json")).unwrap();
    inner.add_special_tokens(&[
        AddedToken::from("<|im_start|>", true),
        AddedToken::from("<|im_end|>", true),
    ]);
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(dir.join("qwen3/tokenizer_config.json")).unwrap())
            .unwrap();
    let source = cfg["chat_template"].as_str().unwrap().to_string();
    let template = ChatTemplate::new(vec![("default".into(), source)], BTreeMap::new()).unwrap();
    Tokenizer::from_hf("bench", inner, Some(template), cache).unwrap()
}

fn system_prompt(words: usize) -> String {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..words)
        .map(|i| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            if i % 500 == 499 {
                ".\n"
            } else {
                WORDS[(z % WORDS.len() as u64) as usize]
            }
        })
        .collect()
}

fn chat(system: &str, n: u64) -> ChatInput {
    ChatInput {
        messages: vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": format!("Question number {n}: what is said above?")}),
        ],
        tools: None,
        add_generation_prompt: true,
        continue_final_message: false,
        template_kwargs: serde_json::Map::new(),
    }
}

fn bench(c: &mut Criterion) {
    let system = system_prompt(100_000);
    let plain = tokenizer(None);
    let cached = tokenizer(Some(CacheConfig::default()));
    let rendered = plain.render_chat(&chat(&system, 0)).unwrap();
    let n_tokens = plain.encode_uncached(&rendered, false).unwrap().len();
    eprintln!("prompt: {} bytes, {n_tokens} tokens", rendered.len());
    // Warm the cache with the shared system prompt.
    cached.encode(&rendered, false).unwrap();

    let mut g = c.benchmark_group("tokenize_100k");
    g.sample_size(20);
    let counter = AtomicU64::new(1);
    g.bench_function("render_only", |b| {
        b.iter(|| {
            let n = counter.fetch_add(1, Ordering::Relaxed);
            black_box(plain.render_chat(&chat(&system, n)).unwrap())
        })
    });
    g.bench_function("render+encode_uncached", |b| {
        b.iter(|| {
            let n = counter.fetch_add(1, Ordering::Relaxed);
            let text = plain.render_chat(&chat(&system, n)).unwrap();
            black_box(plain.encode_uncached(&text, false).unwrap())
        })
    });
    g.bench_function("render+encode_cached", |b| {
        b.iter(|| {
            let n = counter.fetch_add(1, Ordering::Relaxed);
            let text = cached.render_chat(&chat(&system, n)).unwrap();
            black_box(cached.encode(&text, false).unwrap())
        })
    });
    g.finish();
    let s = cached.cache_stats();
    eprintln!("cache: {s:?}");
    assert_eq!(s.fallbacks, 0);
}

criterion_group!(benches, bench);
criterion_main!(benches);
