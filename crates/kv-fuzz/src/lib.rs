//! The fuzz targets, one plain function per target: each takes arbitrary bytes, must never panic,
//! and asserts the invariants its input allows. `fuzz_targets/<name>.rs` hands them to libFuzzer
//! (nightly, `cargo fuzz run <name>`); this crate's `tests/fuzz_smoke.rs` runs the same functions on stable
//! over the seed corpora and proptest-made inputs, so `make test` needs no nightly.

use std::cell::{Cell, RefCell};
use std::sync::{Arc, Once};
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value as PbValue};
use futures::StreamExt;
use kv_router::blocks::{BlockKey, BlockScheme};
use kv_router::config::Config;
use kv_router::decide::{Decider, DecisionMetrics};
use kv_router::events::{decode_batch, encode_batch, ExtraKey, KvEvent, KvEventBatch};
use kv_router::extproc::{
    ExtProc, ExtProcMetrics, DESTINATION_HEADER, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE,
};
use kv_router::index::{
    decode_redis_lookup_reply, parse_redis_member, parse_redis_run, redis_member as member,
    redis_run_member as run_member, EventIndex, EventIndexConfig, KvIndex, MemoryIndex,
    REDIS_SNAPSHOT_RUN as RUN,
};
use kv_router::pods::{
    parse_vllm_metrics, LoadSample, PodId, PodRegistry, PodSource, StaticSource,
};
use kv_router::request::{parse, Api, Prompt, RoutingRequest};
use kv_router::scoring::SessionStore;
use kv_router::telemetry::Errors;
use serde_json::Value;
use tonic::codec::{Codec, EncodeBody, Streaming};
use tonic::Status;

// ---------------------------------------------------------------------------------------------
// request_parser: OpenAI body bytes → RoutingRequest → block keys
// ---------------------------------------------------------------------------------------------

const PATHS: [&str; 5] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/rerank",
];

/// Small blocks so short inputs get several keys.
const SCHEME: BlockScheme = BlockScheme {
    size_chars: 8,
    max_blocks: 4096,
};

/// The body on every API path. Parsed requests must survive a JSON round trip (re-serialised
/// compactly and pretty-printed: same request, same keys), have exactly one key per full
/// block, and a chat (or Responses `input`) one message shorter must give a prompt and keys
/// that are prefixes of the whole conversation's.
pub fn request_parser(data: &[u8]) {
    for path in PATHS {
        let Ok(req) = parse(path, data) else {
            continue;
        };
        let keys = SCHEME.keys(&req);
        let prompt_len = match &req.prompt {
            Prompt::Text(t) => t.len(),
            Prompt::Tokens(t) => t.len() * 4,
            Prompt::Empty => 0,
        };
        assert_eq!(
            keys.len(),
            (prompt_len / SCHEME.size_chars).min(SCHEME.max_blocks),
            "{path}: one key per full block"
        );
        assert_eq!(req.api, Api::from_path(path));
        // parse succeeded, so the body is a JSON object
        let value: Value = serde_json::from_slice(data).expect("parse accepted it");
        for again in [
            serde_json::to_vec(&value).expect("serialises"),
            serde_json::to_vec_pretty(&value).expect("serialises"),
        ] {
            let req2 = parse(path, &again).expect("a re-serialised request parses");
            assert_eq!(req2, req, "{path}: parse ∘ serialise ∘ parse differs");
            assert_eq!(SCHEME.keys(&req2), keys, "{path}: keys changed");
        }
        let field = match req.api {
            Api::ChatCompletions => "messages",
            Api::Responses => "input",
            _ => continue,
        };
        let mut shorter = value;
        let Some(Value::Array(items)) = shorter.get_mut(field) else {
            continue;
        };
        if items.pop().is_none() {
            continue;
        }
        let body = serde_json::to_vec(&shorter).expect("serialises");
        let prefix = parse(path, &body).expect("dropping the last message keeps it valid");
        assert_prefix(path, &prefix, &req);
    }
}

fn assert_prefix(path: &str, shorter: &RoutingRequest, longer: &RoutingRequest) {
    let (Prompt::Text(a), Prompt::Text(b)) = (&shorter.prompt, &longer.prompt) else {
        panic!("{path}: chat prompts are text");
    };
    assert!(
        b.starts_with(&**a),
        "{path}: turn t is not a prefix of turn t+1"
    );
    let (ka, kb) = (SCHEME.keys(shorter), SCHEME.keys(longer));
    assert!(
        ka.len() <= kb.len() && kb[..ka.len()] == ka[..],
        "{path}: keys not a prefix"
    );
}

// ---------------------------------------------------------------------------------------------
// kv_events: vLLM msgpack payload → KvEventBatch → EventIndex
// ---------------------------------------------------------------------------------------------

/// A payload as it arrives in ZMQ frame 3. A decoded batch re-encodes to bytes that decode to
/// the same batch (encode ∘ decode is idempotent), and applying it to an event index twice
/// leaves the same index as applying it once (the `KvIndex` contract: a replayed batch changes
/// nothing).
pub fn kv_events(data: &[u8]) {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    let bytes = encode_batch(&batch);
    let Ok(again) = decode_batch(&bytes) else {
        // The one lossy case: a value decoding could not type (`ExtraKey::Other`: nil, a float,
        // an integer past i64) is re-encoded as a string, and a string costs more of rmpv's
        // depth budget, so at the depth limit the re-encoded batch can be refused.
        assert!(
            has_other(&batch),
            "an encoded batch does not decode: {batch:?}"
        );
        return;
    };
    assert_eq!(
        encode_batch(&again),
        bytes,
        "encode ∘ decode is not idempotent"
    );
    assert!(
        same_batch(&normalised(&batch), &again),
        "the re-decoded batch differs:\n{batch:?}\n{again:?}"
    );

    let index = EventIndex::new(EventIndexConfig::default());
    let pod = PodId::new("10.0.0.1:8000");
    let rank = batch
        .data_parallel_rank
        .map_or(0, |r| u32::try_from(r.rem_euclid(4)).unwrap_or(0));
    futures::executor::block_on(async {
        index
            .apply_events(&pod, rank, "m", &batch)
            .await
            .expect("in-memory");
        let once = index.stats();
        index
            .apply_events(&pod, rank, "m", &batch)
            .await
            .expect("in-memory");
        assert_eq!(index.stats(), once, "replaying a batch changed the index");
        index.forget_rank(&pod, rank).await.expect("in-memory");
        assert_eq!(
            index.stats().entries,
            0,
            "forgetting the only rank left entries"
        );
    });
}

/// What decoding keeps of a value it cannot type (`ExtraKey::Other`) is re-encoded as a string.
fn normalised(b: &KvEventBatch) -> KvEventBatch {
    fn key(k: &ExtraKey) -> ExtraKey {
        match k {
            ExtraKey::Other(s) => ExtraKey::Str(s.clone()),
            ExtraKey::Array(items) => ExtraKey::Array(items.iter().map(key).collect()),
            other => other.clone(),
        }
    }
    let mut b = b.clone();
    for ev in &mut b.events {
        if let KvEvent::BlockStored {
            extra_keys: Some(per_block),
            ..
        } = ev
        {
            for keys in per_block.iter_mut().flatten() {
                *keys = keys.iter().map(key).collect();
            }
        }
    }
    b
}

fn has_other(b: &KvEventBatch) -> bool {
    fn any(k: &ExtraKey) -> bool {
        match k {
            ExtraKey::Other(_) => true,
            ExtraKey::Array(items) => items.iter().any(any),
            _ => false,
        }
    }
    b.events.iter().any(|ev| match ev {
        KvEvent::BlockStored {
            extra_keys: Some(per_block),
            ..
        } => per_block.iter().flatten().flatten().any(any),
        _ => false,
    })
}

/// Equality with `ts` compared bit for bit (a NaN timestamp is still the same timestamp).
fn same_batch(a: &KvEventBatch, b: &KvEventBatch) -> bool {
    a.ts.to_bits() == b.ts.to_bits()
        && a.events == b.events
        && a.data_parallel_rank == b.data_parallel_rank
}

// ---------------------------------------------------------------------------------------------
// prometheus: a pod's /metrics text → LoadSample
// ---------------------------------------------------------------------------------------------

/// Any text (bytes read lossily as UTF-8, as the scraper does). The sample holds no NaN,
/// `kv_usage` stays in 0..=1, comment lines change nothing, and two engines reporting the same
/// lines count `num_gpu_blocks` twice (saturating, never wrapping).
pub fn prometheus(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let s = parse_vllm_metrics(&text);
    assert!(
        !s.waiting.is_nan() && !s.running.is_nan(),
        "NaN load: {s:?}"
    );
    assert!(
        (0.0..=1.0).contains(&s.kv_usage),
        "kv_usage out of range: {s:?}"
    );
    let commented = parse_vllm_metrics(&format!("# HELP x y\n{text}\n# TYPE x gauge\n"));
    assert_eq!(commented, s, "comment lines changed the sample");
    let twice = parse_vllm_metrics(&format!("{text}\n{text}"));
    assert_eq!(
        twice.num_gpu_blocks,
        s.num_gpu_blocks.map(|n| n.saturating_mul(2)),
        "num_gpu_blocks of two engines"
    );
    assert_eq!(twice.block_size, s.block_size);
}

// ---------------------------------------------------------------------------------------------
// config: YAML text → validated Config
// ---------------------------------------------------------------------------------------------

/// Any text. A config that validates has parseable listen addresses, re-validates, and
/// survives a YAML round trip unchanged.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = Config::from_yaml(text) else {
        return;
    };
    let _ = (
        cfg.grpc_addr(),
        cfg.admin_addr(),
        kv_router::app::mode(&cfg),
    );
    let _ = kv_router::index::index_capacity(&cfg.index, &cfg.blocks, u64::MAX, 1);
    let _ = kv_router::index::index_capacity(&cfg.index, &cfg.blocks, 1 << 20, 16);
    assert!(
        cfg.clone().validate().is_ok(),
        "a validated config fails validation"
    );
    let yaml = serde_yaml::to_string(&cfg).expect("a config serialises");
    if yaml.len() > kv_router::config::MAX_YAML_BYTES {
        return;
    }
    let back = Config::from_yaml(&yaml).unwrap_or_else(|e| {
        panic!("a serialised valid config is refused: {e}\n{yaml}");
    });
    let yaml2 = serde_yaml::to_string(&back).expect("a config serialises");
    assert_eq!(yaml2, yaml, "the YAML round trip changed the config");
}

// ---------------------------------------------------------------------------------------------
// redis_member: members of the Redis index's per-pod sets, as read back from Redis
// ---------------------------------------------------------------------------------------------

/// Bytes as a Redis reply may hold them (anything: another version or tool may share the
/// prefix). A member is accepted only if it is exactly what this router writes for the
/// (root, key) it names; every (root, key) round-trips.
pub fn redis_member(data: &[u8]) {
    if let Some((root, key)) = parse_redis_member(data) {
        assert_eq!(
            member(root, key).as_bytes(),
            data,
            "accepted a member this router would not write"
        );
    }
    let mut words = [0u8; 16];
    let n = data.len().min(16);
    words[..n].copy_from_slice(&data[..n]);
    let root = u64::from_le_bytes(words[..8].try_into().expect("8 bytes"));
    let key = BlockKey(u64::from_le_bytes(words[8..].try_into().expect("8 bytes")));
    assert_eq!(
        parse_redis_member(member(root, key).as_bytes()),
        Some((root, key))
    );
    // Snapshot members: runs of keys, accepted only as written, and every run round-trips.
    if let Some((root, keys)) = parse_redis_run(data) {
        assert_eq!(
            run_member(root, &keys).as_bytes(),
            data,
            "accepted a run this router would not write"
        );
    }
    let keys: Vec<BlockKey> = data
        .chunks(8)
        .take(RUN)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            BlockKey(u64::from_le_bytes(w))
        })
        .collect();
    if !keys.is_empty() {
        assert_eq!(
            parse_redis_run(run_member(root, &keys).as_bytes()),
            Some((root, keys))
        );
    }
}

/// The Redis lookup script's reply: `data` split at NUL bytes into strings, the first byte picks
/// the candidate count. Never panics; an accepted reply has one finite, non-negative count per
/// candidate.
pub fn redis_lookup_reply(data: &[u8]) {
    let Some((&pods, rest)) = data.split_first() else {
        return;
    };
    let pods = usize::from(pods % 70);
    let out: Vec<String> = rest
        .split(|&b| b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect();
    if let Ok((matched, _)) = decode_redis_lookup_reply(&out, pods) {
        assert_eq!(matched.len(), pods);
        assert!(matched.iter().all(|m| m.is_finite() && *m >= 0.0));
    }
}

// ---------------------------------------------------------------------------------------------
// extproc: one ext_proc stream of arbitrary ProcessingRequest messages
// ---------------------------------------------------------------------------------------------

/// Body limit of the fuzzed service; also its body budget, so one leaked byte shows.
const BODY_LIMIT: usize = 4096;
const POD_ADDRS: [&str; 3] = ["10.1.0.0:8000", "10.1.0.1:8000", "10.1.0.2:8000"];

/// One ext_proc stream as Envoy (or anything else) might send it.
#[derive(Debug, Arbitrary)]
pub struct Exchange {
    /// `protocol_config` of the first message (`None`: absent).
    pub first: Option<Modes>,
    /// The messages, in order.
    pub messages: Vec<Message>,
    /// Then the stream ends normally (`false`) or is reset by the gateway.
    pub reset: bool,
}

/// The body modes Envoy announces.
#[derive(Debug, Arbitrary)]
pub struct Modes {
    /// Request body mode.
    pub request: Mode,
    /// Response body mode.
    pub response: Mode,
}

/// A body mode, or any other number.
#[derive(Debug, Clone, Copy, Arbitrary)]
pub enum Mode {
    /// NONE
    None,
    /// STREAMED
    Streamed,
    /// BUFFERED
    Buffered,
    /// BUFFERED_PARTIAL
    BufferedPartial,
    /// FULL_DUPLEX_STREAMED
    FullDuplex,
    /// Not a known mode.
    Raw(i32),
}

impl Mode {
    fn wire(self) -> i32 {
        match self {
            Mode::None => BodySendMode::None as i32,
            Mode::Streamed => BodySendMode::Streamed as i32,
            Mode::Buffered => BodySendMode::Buffered as i32,
            Mode::BufferedPartial => BodySendMode::BufferedPartial as i32,
            Mode::FullDuplex => BodySendMode::FullDuplexStreamed as i32,
            Mode::Raw(n) => n,
        }
    }
}

/// One message of the stream.
#[derive(Debug, Arbitrary)]
pub enum Message {
    /// Request headers (a second one is a protocol violation the service must survive).
    Headers {
        /// `:path`.
        path: PathKind,
        /// More headers.
        extra: Vec<(HeaderName, String)>,
        /// Value in `value` instead of `raw_value`.
        string_values: bool,
        /// No body follows.
        eos: bool,
    },
    /// A request body chunk.
    Body {
        /// Its bytes.
        body: BodyKind,
        /// Last chunk.
        eos: bool,
    },
    /// Request trailers.
    Trailers,
    /// Response headers.
    ResponseHeaders {
        /// No response body follows.
        eos: bool,
    },
    /// A response body chunk.
    ResponseBody {
        /// Its bytes.
        body: Vec<u8>,
        /// Last chunk.
        eos: bool,
    },
    /// Response trailers.
    ResponseTrailers,
    /// A message with no request set (flow control).
    Empty,
    /// A message carrying a subset hint (list or comma-separated string), and maybe a later
    /// `protocol_config` (only the first counts).
    Metadata {
        /// The hint.
        subset: Subset,
        /// A late protocol configuration.
        modes: Option<Modes>,
    },
}

/// A request path.
#[derive(Debug, Arbitrary)]
pub enum PathKind {
    /// `/v1/completions`
    Completions,
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/responses`
    Responses,
    /// `/v1/embeddings`
    Embeddings,
    /// No `:path` header at all.
    Missing,
    /// Anything.
    Raw(String),
}

/// A request header name.
#[derive(Debug, Arbitrary)]
pub enum HeaderName {
    /// The destination header a client must not set.
    Destination,
    /// A session header.
    Session,
    /// `content-type`
    ContentType,
    /// Anything (upper case too).
    Raw(String),
}

/// A request body chunk.
#[derive(Debug, Arbitrary)]
pub enum BodyKind {
    /// Empty.
    Empty,
    /// Any bytes.
    Raw(Vec<u8>),
    /// A completions request.
    Completion {
        /// Model (`m` is served).
        model: Model,
        /// Prompt text.
        prompt: String,
    },
    /// A chat request.
    Chat {
        /// Model.
        model: Model,
        /// (role, content) pairs.
        messages: Vec<(String, String)>,
    },
    /// `BODY_LIMIT + n` bytes.
    Oversized(u8),
    /// A valid request of exactly `BODY_LIMIT` bytes.
    AtLimit,
}

/// A model name.
#[derive(Debug, Arbitrary)]
pub enum Model {
    /// The one every pod serves.
    Served,
    /// None given.
    Absent,
    /// Anything.
    Raw(String),
}

/// A subset hint.
#[derive(Debug, Arbitrary)]
pub enum Subset {
    /// Pod addresses by index (3 = not a pod).
    Pods(Vec<u8>),
    /// A comma-separated string.
    Text(String),
    /// A number (ignored).
    Number(f64),
}

struct Service {
    svc: ExtProc,
    pods: Arc<PodRegistry>,
}

thread_local! {
    // Paused clock: timers fire as soon as every task waits (see `run_exchange`).
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a tokio runtime");
    static SERVICE: RefCell<Option<Arc<Service>>> = const { RefCell::new(None) };
    static PANICS: Cell<u64> = const { Cell::new(0) };
}

/// Counts panics per thread: tokio catches a panicking stream task, and the gateway only sees
/// the stream end, so the target compares the count before and after. The previous hook still
/// runs (under libFuzzer it aborts, which is how the fuzzer learns of the crash).
fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.with(|p| p.set(p.get() + 1));
            previous(info);
        }));
    });
}

async fn service() -> Arc<Service> {
    if let Some(s) = SERVICE.with(|s| s.borrow().clone()) {
        return s;
    }
    let mut yaml = String::from("pods:\n  static:\n");
    for a in POD_ADDRS {
        yaml.push_str(&format!("    - {{ address: \"{a}\", models: [m] }}\n"));
    }
    let cfg = Config::from_yaml(&yaml).expect("the harness config");
    let pods = Arc::new(PodRegistry::default());
    pods.update(
        StaticSource::new(&cfg.pods.static_pods)
            .pods()
            .await
            .expect("static pods"),
    );
    let mut registry = prometheus_client::registry::Registry::default();
    let errors = Errors::register(&mut registry);
    let decider = Arc::new(Decider::new(
        cfg.decision(),
        Arc::default(),
        pods.clone(),
        Arc::new(MemoryIndex::new(60_000, 10_000)),
        Arc::new(SessionStore::new(100, 60_000)),
        DecisionMetrics::register(&mut registry, errors.clone()),
    ));
    let svc = ExtProc::new(
        decider,
        ExtProcMetrics::register(&mut registry, errors),
        BODY_LIMIT,
        true,
    )
    .with_body_budget(BODY_LIMIT);
    let s = Arc::new(Service { svc, pods });
    SERVICE.with(|slot| *slot.borrow_mut() = Some(s.clone()));
    s
}

/// Arbitrary bytes → an [`Exchange`] → one stream through the real service, in memory. The
/// service must not panic or hang; an immediate response must be its last reply; a decision
/// must name known pods; a decided stream, still open, holds no body budget (a request of
/// exactly the body limit, which is also the budget, is still routed) unless a response id
/// watch keeps a response's head; and when the stream is
/// over no budget and no pod's in-flight load is left.
pub fn extproc(data: &[u8]) {
    let Ok(exchange) = Exchange::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    run_exchange(&exchange);
}

/// Runs one exchange (public so a test can run hand-made ones).
pub fn run_exchange(exchange: &Exchange) {
    count_panics();
    let before = PANICS.with(Cell::get);
    // A failed check may leave the shared service in a bad state: start the next input afresh
    // (proptest re-runs inputs while shrinking; libFuzzer stops at the first failure anyway).
    struct FreshAfterPanic;
    impl Drop for FreshAfterPanic {
        fn drop(&mut self) {
            if std::thread::panicking() {
                let _ = SERVICE.try_with(|s| s.borrow_mut().take());
            }
        }
    }
    let _fresh = FreshAfterPanic;
    RUNTIME.with(|rt| {
        rt.block_on(async {
            let s = service().await;
            fresh_samples(&s.pods);
            let (tx, inbound) = futures::channel::mpsc::unbounded();
            let mut out = open(&s.svc, inbound).await;
            let replies = RefCell::new(Vec::new());
            // Empty, or metadata alone: no request in it either way.
            let has_empty = exchange
                .messages
                .iter()
                .any(|m| matches!(m, Message::Empty | Message::Metadata { .. }));
            let collect = async {
                while let Some(r) = out.next().await {
                    match r {
                        Ok(r) => replies.borrow_mut().push(r),
                        // The one error status: a message that carries no request at all.
                        Err(s) => assert!(
                            has_empty && s.code() == tonic::Code::InvalidArgument,
                            "the service answers an error status only to an empty message: {s:?}"
                        ),
                    }
                }
            };
            let drive = async {
                for r in requests(exchange) {
                    // Refused once the service has ended the stream: like a gateway, carry on.
                    let _ = tx.unbounded_send(r);
                }
                // The clock is paused: this sleep ends once every task waits, i.e. once the
                // service has handled every message and waits for the next one.
                tokio::time::sleep(Duration::from_millis(1)).await;
                // Decided, and not refused: a refused stream keeps its largest chunk's share of
                // the budget until the gateway closes it (its receive buffer lives that long).
                let decided = {
                    let replies = replies.borrow();
                    replies.iter().any(|r| destination(r).is_some())
                        && !replies
                            .iter()
                            .any(|r| matches!(r.response, Some(Out::ImmediateResponse(_))))
                };
                if decided && !watches_a_response_id(exchange) {
                    // The stream is still open, but decided: it must hold no body budget.
                    probe(&s.svc, &s.pods, "while a decided stream is open").await;
                }
                drop(tx);
            };
            tokio::time::timeout(
                Duration::from_secs(30),
                futures::future::join(collect, drive),
            )
            .await
            .expect("the stream ends once its requests are done");
            check_replies(&replies.borrow());
            assert_no_load(&s.pods, "after the stream");
            probe(&s.svc, &s.pods, "after the stream").await;
            assert_no_load(&s.pods, "after the probe");
        })
    });
    assert_eq!(PANICS.with(Cell::get), before, "the stream task panicked");
}

fn assert_no_load(pods: &PodRegistry, when: &str) {
    for p in pods.snapshot().pods() {
        assert_eq!(
            p.inflight_counts(),
            (0, 0),
            "{when}: in-flight load left on {p:?}"
        );
    }
}

fn fresh_samples(pods: &PodRegistry) {
    for p in pods.snapshot().pods() {
        p.record_probe(true, 1);
        p.record_sample(tokio::time::Instant::now(), LoadSample::default());
    }
}

/// Opens one stream fed by `inbound`.
async fn open<S>(svc: &ExtProc, inbound: S) -> <ExtProc as ExternalProcessor>::ProcessStream
where
    S: futures::Stream<Item = Result<ProcessingRequest, Status>> + Send + 'static,
{
    let mut codec = tonic_prost::ProstCodec::<ProcessingRequest, ProcessingRequest>::default();
    let body = EncodeBody::new_client(codec.encoder(), inbound, None, None);
    let inbound = Streaming::new_request(codec.decoder(), body, None, None);
    svc.process(tonic::Request::new(inbound))
        .await
        .expect("process accepts every stream")
        .into_inner()
}

/// A `/v1/responses` request whose response body passed: its id watch may keep the body's head,
/// under the budget, until the id is read or the stream ends (checked after the stream).
fn watches_a_response_id(e: &Exchange) -> bool {
    let responses = e.messages.iter().any(|m| match m {
        Message::Headers { path, .. } => match path {
            PathKind::Responses => true,
            PathKind::Raw(p) => Api::from_path(p) == Api::Responses,
            _ => false,
        },
        _ => false,
    });
    responses
        && e.messages
            .iter()
            .any(|m| matches!(m, Message::ResponseBody { body, .. } if !body.is_empty()))
}

/// A BUFFERED request of exactly the body limit, which is also the budget: it is routed only
/// if no other stream holds a byte of the budget.
async fn probe(svc: &ExtProc, pods: &PodRegistry, when: &str) {
    fresh_samples(pods);
    let out = open(svc, futures::stream::iter(at_limit_request())).await;
    let replies: Vec<_> = tokio::time::timeout(Duration::from_secs(30), out.collect::<Vec<_>>())
        .await
        .expect("the probe ends");
    let routed = replies
        .last()
        .and_then(|r| r.as_ref().ok())
        .is_some_and(|r| destination(r).is_some());
    assert!(
        routed,
        "{when}: a request at the body limit was not routed: {replies:?}"
    );
}

fn check_replies(replies: &[ProcessingResponse]) {
    for (i, r) in replies.iter().enumerate() {
        assert!(r.response.is_some(), "reply {i} is empty");
        if matches!(r.response, Some(Out::ImmediateResponse(_))) {
            assert_eq!(i + 1, replies.len(), "replies after an immediate response");
        }
        if let Some(d) = destination(r) {
            assert!(
                !d.is_empty() && d.split(',').all(|a| POD_ADDRS.contains(&a)),
                "destination {d:?} is not a list of pods"
            );
        }
    }
}

fn destination(r: &ProcessingResponse) -> Option<String> {
    let lb = r.dynamic_metadata.as_ref()?.fields.get(LB_NAMESPACE)?;
    let Some(Kind::StructValue(lb)) = &lb.kind else {
        return None;
    };
    match &lb.fields.get(DESTINATION_HEADER)?.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

fn modes(m: &Modes) -> ProtocolConfiguration {
    ProtocolConfiguration {
        request_body_mode: m.request.wire(),
        response_body_mode: m.response.wire(),
        ..Default::default()
    }
}

fn requests(e: &Exchange) -> Vec<Result<ProcessingRequest, Status>> {
    let mut out: Vec<_> = e.messages.iter().map(|m| Ok(message(m))).collect();
    if let (Some(m), Some(Ok(first))) = (&e.first, out.first_mut()) {
        first.protocol_config = Some(modes(m));
    }
    if e.reset {
        out.push(Err(Status::cancelled("reset by the gateway")));
    }
    out
}

fn message(m: &Message) -> ProcessingRequest {
    let mut req = ProcessingRequest::default();
    req.request = match m {
        Message::Headers {
            path,
            extra,
            string_values,
            eos,
        } => {
            let mut hs: Vec<(String, String)> = vec![(":method".into(), "POST".into())];
            let path = match path {
                PathKind::Completions => Some("/v1/completions"),
                PathKind::Chat => Some("/v1/chat/completions"),
                PathKind::Responses => Some("/v1/responses"),
                PathKind::Embeddings => Some("/v1/embeddings"),
                PathKind::Missing => None,
                PathKind::Raw(p) => Some(p.as_str()),
            };
            if let Some(p) = path {
                hs.push((":path".into(), p.into()));
            }
            for (name, value) in extra {
                let name = match name {
                    HeaderName::Destination => DESTINATION_HEADER,
                    HeaderName::Session => "x-session-id",
                    HeaderName::ContentType => "content-type",
                    HeaderName::Raw(n) => n.as_str(),
                };
                hs.push((name.into(), value.clone()));
            }
            Some(In::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: hs
                        .into_iter()
                        .map(|(key, v)| {
                            if *string_values {
                                HeaderValue {
                                    key,
                                    value: v,
                                    ..Default::default()
                                }
                            } else {
                                HeaderValue {
                                    key,
                                    raw_value: v.into_bytes(),
                                    ..Default::default()
                                }
                            }
                        })
                        .collect(),
                }),
                end_of_stream: *eos,
                ..Default::default()
            }))
        }
        Message::Body { body, eos } => Some(In::RequestBody(HttpBody {
            body: body_bytes(body),
            end_of_stream: *eos,
            ..Default::default()
        })),
        Message::Trailers => Some(In::RequestTrailers(HttpTrailers::default())),
        Message::ResponseHeaders { eos } => Some(In::ResponseHeaders(HttpHeaders {
            end_of_stream: *eos,
            ..Default::default()
        })),
        Message::ResponseBody { body, eos } => Some(In::ResponseBody(HttpBody {
            body: body.clone(),
            end_of_stream: *eos,
            ..Default::default()
        })),
        Message::ResponseTrailers => Some(In::ResponseTrailers(HttpTrailers::default())),
        Message::Empty => None,
        Message::Metadata { subset, modes: m } => {
            req.metadata_context = Some(subset_metadata(subset));
            req.protocol_config = m.as_ref().map(modes);
            None
        }
    };
    req
}

fn subset_metadata(s: &Subset) -> Metadata {
    let kind = match s {
        Subset::Pods(ix) => Kind::ListValue(ListValue {
            values: ix
                .iter()
                .map(|&i| PbValue {
                    kind: Some(Kind::StringValue(
                        POD_ADDRS
                            .get(usize::from(i % 4))
                            .unwrap_or(&"10.9.9.9:1")
                            .to_string(),
                    )),
                })
                .collect(),
        }),
        Subset::Text(t) => Kind::StringValue(t.clone()),
        Subset::Number(n) => Kind::NumberValue(*n),
    };
    let mut inner = Struct::default();
    inner
        .fields
        .insert(SUBSET_KEY.to_string(), PbValue { kind: Some(kind) });
    let mut meta = Metadata::default();
    meta.filter_metadata
        .insert(SUBSET_NAMESPACE.to_string(), inner);
    meta
}

fn model(m: &Model) -> Value {
    match m {
        Model::Served => Value::from("m"),
        Model::Absent => Value::Null,
        Model::Raw(s) => Value::from(s.as_str()),
    }
}

fn body_bytes(b: &BodyKind) -> Vec<u8> {
    match b {
        BodyKind::Empty => Vec::new(),
        BodyKind::Raw(bytes) => bytes.clone(),
        BodyKind::Completion { model: m, prompt } => {
            serde_json::json!({"model": model(m), "prompt": prompt})
                .to_string()
                .into_bytes()
        }
        BodyKind::Chat { model: m, messages } => {
            let messages: Vec<Value> = messages
                .iter()
                .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
                .collect();
            serde_json::json!({"model": model(m), "messages": messages})
                .to_string()
                .into_bytes()
        }
        BodyKind::Oversized(n) => vec![b' '; BODY_LIMIT + 1 + usize::from(*n)],
        BodyKind::AtLimit => at_limit_body(),
    }
}

/// `{"model":"m","prompt":"aaa…"}` of exactly [`BODY_LIMIT`] bytes.
fn at_limit_body() -> Vec<u8> {
    let empty = br#"{"model":"m","prompt":""}"#.len();
    let prompt = "a".repeat(BODY_LIMIT - empty);
    let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
    debug_assert_eq!(body.len(), BODY_LIMIT);
    body.into_bytes()
}

/// A BUFFERED completions request whose body is exactly the body limit.
fn at_limit_request() -> Vec<Result<ProcessingRequest, Status>> {
    let e = Exchange {
        first: Some(Modes {
            request: Mode::Buffered,
            response: Mode::None,
        }),
        messages: vec![
            Message::Headers {
                path: PathKind::Completions,
                extra: Vec::new(),
                string_values: false,
                eos: false,
            },
            Message::Body {
                body: BodyKind::AtLimit,
                eos: true,
            },
        ],
        reset: false,
    };
    requests(&e)
}
