//! The Envoy ext_proc service: one task per HTTP request runs a small state machine over the
//! bidirectional stream, for BUFFERED (and STREAMED) and FULL_DUPLEX_STREAMED request bodies.
//!
//! BUFFERED: headers → CONTINUE (client routing headers stripped); body → decision in the body
//! reply. FULL_DUPLEX_STREAMED (Endpoint Picker Protocol): buffer the body to end of stream,
//! then the headers reply with the decision, then the body echoed as `streamed_response` chunks.

pub mod hooks;
pub mod reply;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;

use std::fmt::Write as _;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::budget::{BodyBudget, Refused, Reservation};
use crate::decide::{DecideError, DecideRequest, Decider, Decision, PendingRecord, Saturated};
use crate::flow::FlowControl;
use crate::observe::{Receipts, Watch, RECEIPT_HEADER};
use crate::pods::InflightGuard;
use crate::telemetry::gie::{GieMetrics, Running};
use crate::telemetry::{ErrorKind, Errors};
use reply::Rejection;

pub use hooks::TestHooks;
pub use reply::{
    DESTINATION_HEADER, DESTINATION_SERVED_HEADER, LB_NAMESPACE, OWNED_HEADERS, SUBSET_KEY,
    SUBSET_NAMESPACE,
};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: BodyMode,
}

/// The ext_proc edge's metric families.
#[derive(Debug, Clone)]
pub struct ExtProcMetrics {
    streams: Family<ModeLabels, Counter>,
    open: Gauge,
    errors: Errors,
    /// The GIE `inference_objective_*` families, when registered.
    gie: Option<GieMetrics>,
}

impl ExtProcMetrics {
    /// The error counter the streams report to.
    pub fn errors(&self) -> Errors {
        self.errors.clone()
    }

    /// Also reports routed and refused requests to GIE's per-model families.
    pub fn with_gie(mut self, gie: GieMetrics) -> Self {
        self.gie = Some(gie);
        self
    }

    /// A refusal, in the error counter and GIE's (the model is not known yet).
    fn refused(&self, kind: ErrorKind) {
        self.errors.inc(kind);
        if let Some(g) = &self.gie {
            g.refused(None, kind.as_str());
        }
    }
}

/// Counts a stream as open until dropped.
struct OpenStream(Gauge);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl ExtProcMetrics {
    /// Registers `extproc_streams` and `extproc_open_streams` (`registry` is the `kv_router`
    /// sub-registry); refusals go to the shared error counter.
    pub fn register(registry: &mut Registry, errors: Errors) -> Self {
        let m = Self {
            streams: Family::default(),
            open: Gauge::default(),
            errors,
            gie: None,
        };
        registry.register(
            "extproc_open_streams",
            "ext_proc streams open now, including rejected ones waiting for the gateway to close",
            m.open.clone(),
        );
        registry.register(
            "extproc_streams",
            "ext_proc streams by body mode",
            m.streams.clone(),
        );
        m
    }
}

/// The streams open at once, across connections, and the most allowed.
#[derive(Debug)]
struct StreamCap {
    open: AtomicUsize,
    limit: usize,
}

/// One open stream's place under the cap, given back when dropped.
struct StreamSlot(Arc<StreamCap>);

impl StreamCap {
    fn try_open(self: &Arc<Self>) -> Option<StreamSlot> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limit).then_some(n + 1)
            })
            .ok()
            .map(|_| StreamSlot(self.clone()))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// ext_proc service state shared by all streams.
#[derive(Clone)]
pub struct ExtProc {
    decider: Arc<Decider>,
    metrics: ExtProcMetrics,
    body_limit: usize,
    destination_header: bool,
    budget: BodyBudget,
    /// `flow_control.enabled`: requests wait here while every pod is saturated.
    flow: Option<Arc<FlowControl>>,
    streams: Arc<StreamCap>,
    /// `conformance_test_hooks`: the GIE suite's selection and report headers.
    hooks: Option<Arc<TestHooks>>,
    /// `receipts.enabled`: receipts on responses, checked against the engine's cached tokens.
    receipts: Option<Arc<Receipts>>,
}

impl ExtProc {
    /// Holds requests in `flow` while every pod that could serve them is saturated.
    pub fn with_flow_control(mut self, flow: Arc<FlowControl>) -> Self {
        self.flow = Some(flow);
        self
    }

    /// Caps the request-body bytes buffered across all streams (default: unlimited).
    pub fn with_body_budget(self, bytes: usize) -> Self {
        self.with_shared_budget(BodyBudget::new(bytes))
    }

    /// Draws bodies from `budget`, which the port's meter of ext_proc messages shares.
    pub fn with_shared_budget(mut self, budget: BodyBudget) -> Self {
        self.budget = budget;
        self
    }

    /// Refuses a new stream while `limit` are open (default: unlimited): each costs ≈ 16 KiB
    /// besides its body, and a stream that sent its headers and nothing more has no deadline.
    pub fn with_stream_limit(mut self, limit: usize) -> Self {
        self.streams = Arc::new(StreamCap {
            open: AtomicUsize::new(0),
            limit,
        });
        self
    }

    /// Sets a receipt on each routed response and checks it against the engine's report.
    pub fn with_receipts(mut self, receipts: Arc<Receipts>) -> Self {
        self.receipts = Some(receipts);
        self
    }

    /// Honours the conformance suite's selection header and answers its report headers.
    pub fn with_test_hooks(mut self, hooks: TestHooks) -> Self {
        self.hooks = Some(Arc::new(hooks));
        self
    }

    /// A service over the shared decision path.
    pub fn new(
        decider: Arc<Decider>,
        metrics: ExtProcMetrics,
        body_limit: usize,
        destination_header: bool,
    ) -> Self {
        Self {
            decider,
            metrics,
            body_limit,
            destination_header,
            budget: BodyBudget::new(usize::MAX),
            flow: None,
            streams: Arc::new(StreamCap {
                open: AtomicUsize::new(0),
                limit: usize::MAX,
            }),
            hooks: None,
            receipts: None,
        }
    }
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = ReplyStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // Refused before anything is kept: an established stream is never closed for a new one.
        let Some(slot) = self.streams.try_open() else {
            self.metrics.errors.inc(ErrorKind::StreamLimit);
            return Err(Status::resource_exhausted(format!(
                "{} ext_proc streams are open (server.max_extproc_streams); retry later",
                self.streams.limit
            )));
        };
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let this = self.clone();
        Ok(Response::new(Box::pin(Driven {
            run: Some(Box::pin(async move { this.run(inbound, tx).await })),
            replies: rx,
            ending: None,
            _slot: slot,
        })))
    }
}

/// A stream's replies, produced by running the stream's work inside the reply stream itself:
/// the task that writes the replies also reads the messages and decides, instead of a spawned
/// task handing each reply over through a wake-up (one task switch per message fewer). Dropping
/// it (the gateway reset the stream) drops the work and everything it holds.
struct Driven {
    run: Option<Pin<Box<dyn Future<Output = Option<Status>> + Send>>>,
    replies: mpsc::Receiver<Box<ProcessingResponse>>,
    /// The error status the work ended with, sent after its queued replies.
    ending: Option<Status>,
    _slot: StreamSlot,
}

impl Stream for Driven {
    type Item = Result<ProcessingResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        // The work first (it may queue replies), then a queued reply; the work waiting on a
        // full queue resumes at the next poll, after a reply was taken.
        if let Some(run) = self.run.as_mut() {
            if let Poll::Ready(ending) = run.as_mut().poll(cx) {
                self.run = None;
                self.ending = ending;
            }
        }
        match self.replies.poll_recv(cx) {
            Poll::Ready(Some(r)) => Poll::Ready(Some(Ok(*r))),
            // The work is done and its replies are sent: its error, if any, ends the stream.
            Poll::Ready(None) => Poll::Ready(self.ending.take().map(Err)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The request body mode Envoy announced (the `mode` label of `extproc_streams`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum BodyMode {
    Buffered,
    Streamed,
    FullDuplex,
}

impl BodyMode {
    fn as_str(self) -> &'static str {
        match self {
            BodyMode::Buffered => "buffered",
            BodyMode::Streamed => "streamed",
            BodyMode::FullDuplex => "full_duplex",
        }
    }
}

impl EncodeLabelValue for BodyMode {
    fn encode(&self, e: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        e.write_str(self.as_str())
    }
}

/// Per-HTTP-request state.
struct StreamState {
    mode: BodyMode,
    response_full_duplex: bool,
    /// Response body chunks reach the router as they come (STREAMED or FULL_DUPLEX): the first
    /// one marks the end of the prefill.
    response_body_streamed: bool,
    headers: Vec<(String, String)>,
    path: String,
    subset: Option<Vec<String>>,
    /// The conformance hooks' `test-epp-endpoint-selection` entries (hooks on only).
    selection: Option<Vec<String>>,
    /// The destination list sent to the gateway (the hooks report its primary).
    destination: Option<String>,
    body: Chunks,
    /// `body`'s share of the service's buffered-bytes budget.
    reserved: Reservation,
    /// The largest body chunk received: about what the stream's receive buffer keeps.
    largest_chunk: usize,
    decided: bool,
    guard: Option<InflightGuard>,
    /// The prefill pod's charge of a disaggregated request, released at the first response.
    prefill_guard: Option<InflightGuard>,
    /// In GIE's `inference_objective_running_requests` until the stream ends.
    running: Option<Running>,
    /// The routed request's receipt (`receipts.enabled`), or on `/v1/responses` its id watch.
    receipt: Option<Box<Watch>>,
}

impl StreamState {
    /// The stream ends without showing the request's end: its charges settle.
    fn settle_guards(&mut self) {
        if let Some(g) = self.guard.take() {
            g.settle();
        }
        if let Some(g) = self.prefill_guard.take() {
            g.settle();
        }
    }
}

/// A body as the chunks it came in, kept apart until the decision (appending to one `Vec`
/// doubled its capacity as it grew: held bodies cost up to twice their bytes).
#[derive(Default)]
struct Chunks {
    parts: Vec<Vec<u8>>,
    len: usize,
}

impl Chunks {
    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, chunk: Vec<u8>) {
        if !chunk.is_empty() {
            self.len += chunk.len();
            self.parts.push(chunk);
        }
    }

    /// The whole body, for the decision.
    fn take(&mut self) -> HeldBody {
        self.len = 0;
        HeldBody::new(std::mem::take(&mut self.parts))
    }
}

/// A body at its decision: the chunks it came in, echoed as they are (FULL_DUPLEX), and one
/// joined copy for the parser only when there are several. Each body byte is copied at most
/// once: joined, or (a lone chunk longer than an echo message) cut into echo messages.
struct HeldBody {
    parts: Vec<Vec<u8>>,
    joined: Option<Vec<u8>>,
}

impl HeldBody {
    fn new(parts: Vec<Vec<u8>>) -> Self {
        let joined = (parts.len() > 1).then(|| parts.concat());
        Self { parts, joined }
    }

    /// The body in one piece.
    fn bytes(&self) -> &[u8] {
        match (&self.joined, self.parts.first()) {
            (Some(joined), _) => joined,
            (None, Some(part)) => part,
            (None, None) => &[],
        }
    }

    /// The chunks it came in (the joined copy is dropped).
    fn into_parts(self) -> Vec<Vec<u8>> {
        self.parts
    }
}

/// Replies go through the channel boxed: its queue allocates 32 slots at a time, and unboxed
/// slots (a `ProcessingResponse` or a `Status`, hundreds of bytes each) cost every stream KiBs.
type Tx = mpsc::Sender<Box<ProcessingResponse>>;

/// How long a stream answered early (immediate reply) waits for the gateway to close its side.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

impl ExtProc {
    /// Serves one stream; returns the error status that ends it, if one does.
    async fn run(self, mut inbound: Streaming<ProcessingRequest>, tx: Tx) -> Option<Status> {
        self.metrics.open.inc();
        let _open = OpenStream(self.metrics.open.clone());
        let mut st = StreamState {
            mode: BodyMode::Buffered,
            response_full_duplex: false,
            response_body_streamed: false,
            headers: Vec::new(),
            path: String::new(),
            subset: None,
            selection: None,
            destination: None,
            body: Chunks::default(),
            reserved: self.budget.reservation(),
            largest_chunk: 0,
            decided: false,
            guard: None,
            prefill_guard: None,
            running: None,
            receipt: None,
        };
        let mut first = true;
        let mut ending = None;
        let mut reset = false;
        while let Some(msg) = inbound.next().await {
            let msg = match msg {
                Ok(m) => m,
                Err(status) => {
                    match Refused::of(&status) {
                        // The port's meter refused a message before buffering it (it counted the
                        // spent budget and the stall): a stall ends the stream with its status,
                        // a refused message is answered to the client as a refused chunk is.
                        Some(Refused::Stalled) => ending = Some(status),
                        Some(refused) => {
                            let r = if refused == Refused::TooLarge {
                                let r = Rejection::BodyTooLarge(self.body_limit);
                                self.metrics.refused(r.kind());
                                r
                            } else {
                                Rejection::Overloaded
                            };
                            send(&tx, reply::immediate_error(&r)).await;
                        }
                        // Envoy resets the side stream when the HTTP stream ends: a normal end.
                        None => {
                            debug!(code = ?status.code(), "ext_proc stream ended by Envoy");
                            reset = true;
                        }
                    }
                    break;
                }
            };
            if first {
                first = false;
                if let Some(pc) = &msg.protocol_config {
                    st.mode = match BodySendMode::try_from(pc.request_body_mode) {
                        Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
                        Ok(BodySendMode::Streamed) => BodyMode::Streamed,
                        _ => BodyMode::Buffered,
                    };
                    let response_mode = BodySendMode::try_from(pc.response_body_mode);
                    st.response_full_duplex = response_mode == Ok(BodySendMode::FullDuplexStreamed);
                    st.response_body_streamed = matches!(
                        response_mode,
                        Ok(BodySendMode::FullDuplexStreamed | BodySendMode::Streamed)
                    );
                }
                self.metrics
                    .streams
                    .get_or_create(&ModeLabels { mode: st.mode })
                    .inc();
            }
            if let Some(subset) = subset_hint(msg.metadata_context.as_ref()) {
                st.subset = Some(subset);
            }
            let keep_going = match msg.request {
                Some(In::RequestHeaders(h)) => {
                    self.on_request_headers(&mut st, h.headers.as_ref(), h.end_of_stream, &tx)
                        .await
                }
                Some(In::RequestBody(b)) => {
                    self.on_request_body(&mut st, b.body, b.end_of_stream, &tx)
                        .await
                }
                Some(In::RequestTrailers(_)) => self.on_request_trailers(&mut st, &tx).await,
                Some(In::ResponseHeaders(h)) => {
                    if let Some(g) = st.guard.as_mut() {
                        // A streamed response's headers leave before its prefill (even queued);
                        // a whole response's come after it.
                        if !is_event_stream(h.headers.as_ref()) {
                            g.prefill_done();
                        } else if !st.response_body_streamed {
                            g.prefill_by_estimate();
                        }
                    }
                    // The decode pod answers once the prefill pod handed over the prompt.
                    if let Some(g) = st.prefill_guard.take() {
                        g.complete();
                    }
                    if h.end_of_stream {
                        if let Some(g) = st.guard.take() {
                            g.complete();
                        }
                    }
                    let mut set = match &self.hooks {
                        Some(hooks) => hooks::response_headers(
                            hooks,
                            msg.metadata_context.as_ref(),
                            st.destination.as_deref(),
                        ),
                        None => Vec::new(),
                    };
                    let mut remove = Vec::new();
                    let receipt = st
                        .receipt
                        .as_deref_mut()
                        .and_then(|w| w.response_headers(&read_headers(h.headers.as_ref())));
                    match receipt {
                        Some(v) => set.push((RECEIPT_HEADER, v)),
                        // No decision of ours: the upstream's copy is not passed on.
                        None if self.receipts.is_some() => remove.push(RECEIPT_HEADER),
                        None => {}
                    }
                    if h.end_of_stream {
                        self.end_receipt(&mut st);
                    }
                    send(&tx, reply::response_headers_mutation(&set, &remove)).await
                }
                Some(In::ResponseBody(b)) => {
                    let eos = b.end_of_stream;
                    if let Some(g) = st.guard.as_mut() {
                        g.prefill_done();
                    }
                    if let Some(w) = st.receipt.as_deref_mut() {
                        w.body(&b.body, &self.decider);
                        if eos {
                            w.end(&self.decider);
                        }
                    }
                    let out = if st.response_full_duplex {
                        reply::response_body_echo(b.body, eos)
                    } else {
                        reply::response_body_continue()
                    };
                    if eos {
                        if let Some(g) = st.guard.take() {
                            g.complete();
                        }
                    }
                    send(&tx, out).await
                }
                Some(In::ResponseTrailers(_)) => {
                    if let Some(g) = st.guard.take() {
                        g.complete();
                    }
                    self.end_receipt(&mut st);
                    send(&tx, reply::response_trailers_continue()).await
                }
                // Envoy always sends one of the six; a client that does not is told so.
                None => {
                    ending = Some(Status::invalid_argument(
                        "ProcessingRequest carries no request (headers, body, trailers)",
                    ));
                    false
                }
            };
            if !keep_going {
                // Ending our side first makes h2 reset the stream when the gateway's late frames
                // arrive; 1024 such resets and h2 drops the whole connection (ENHANCE_YOUR_CALM).
                st.body = Chunks::default();
                st.reserved.release();
                st.settle_guards();
                // The receive buffer lives until the stream ends: wait only if the budget holds it.
                // A protocol error ends at once: it is not Envoy, and owes no late frames.
                if ending.is_none() && st.reserved.grow(st.largest_chunk) {
                    let drain = async { while let Some(Ok(_)) = inbound.next().await {} };
                    let _ = tokio::time::timeout(DRAIN_TIMEOUT, drain).await;
                }
                break;
            }
        }
        // Whatever of the response was shown is all there is.
        self.end_receipt(&mut st);
        // A reset is the HTTP stream's end (so is this future's drop, when Envoy's reset comes
        // first): the request is over. A half-close says nothing of the response.
        if !reset {
            st.settle_guards();
        }
        ending
    }

    async fn on_request_headers(
        &self,
        st: &mut StreamState,
        headers: Option<&HeaderMap>,
        eos: bool,
        tx: &Tx,
    ) -> bool {
        st.headers = read_headers(headers);
        if self.hooks.is_some() {
            st.selection = hooks::selection(&st.headers);
        }
        st.path = st
            .headers
            .iter()
            .find(|(k, _)| k == ":path")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        if eos {
            // Body bytes sent before these headers (out of order) are not part of the decision:
            // they must not hold the budget while the stream lives (found by fuzz/extproc).
            st.body = Chunks::default();
            st.reserved.release();
            return self.decide_and_reply(st, None, tx).await;
        }
        match st.mode {
            BodyMode::FullDuplex => true,
            BodyMode::Buffered | BodyMode::Streamed => {
                send(
                    tx,
                    reply::request_headers_strip_pd(self.decider.prefill_header()),
                )
                .await
            }
        }
    }

    async fn on_request_body(
        &self,
        st: &mut StreamState,
        chunk: Vec<u8>,
        eos: bool,
        tx: &Tx,
    ) -> bool {
        if st.decided {
            // Body after a decision (should not happen): pass it through untouched.
            return send(
                tx,
                reply::request_body_continue(st.mode == BodyMode::FullDuplex, chunk, eos),
            )
            .await;
        }
        st.largest_chunk = st.largest_chunk.max(chunk.len());
        if st.body.len() + chunk.len() > self.body_limit {
            let r = Rejection::BodyTooLarge(self.body_limit);
            self.metrics.refused(r.kind());
            send(tx, reply::immediate_error(&r)).await;
            return false;
        }
        if !st.reserved.grow(chunk.len()) {
            let r = Rejection::Overloaded;
            self.metrics.refused(r.kind());
            send(tx, reply::immediate_error(&r)).await;
            return false;
        }
        st.body.push(chunk);
        if !eos {
            return match st.mode {
                BodyMode::Streamed => {
                    send(tx, reply::request_body_continue(false, Vec::new(), false)).await
                }
                _ => true,
            };
        }
        let body = st.body.take();
        let ok = self.decide_and_reply(st, Some(body), tx).await;
        // The body is gone with the decision; a long response must not hold its budget.
        st.reserved.release();
        ok
    }

    async fn on_request_trailers(&self, st: &mut StreamState, tx: &Tx) -> bool {
        if !st.decided && st.mode == BodyMode::FullDuplex {
            // The body ended without end_of_stream (trailers follow): decide now.
            let body = st.body.take();
            let ok = self.decide_and_reply_inner(st, Some(body), tx, false).await;
            st.reserved.release();
            if !ok {
                return false;
            }
        }
        send(tx, reply::request_trailers_continue()).await
    }

    async fn decide_and_reply(
        &self,
        st: &mut StreamState,
        body: Option<HeldBody>,
        tx: &Tx,
    ) -> bool {
        self.decide_and_reply_inner(st, body, tx, true).await
    }

    async fn decide_and_reply_inner(
        &self,
        st: &mut StreamState,
        body: Option<HeldBody>,
        tx: &Tx,
        body_eos: bool,
    ) -> bool {
        st.decided = true;
        let has_body = body.is_some();
        let (decision, pending) = match self
            .decide(st, body.as_ref().map(HeldBody::bytes), tx)
            .await
        {
            Ok(d) => d,
            Err(e) => {
                // The decision path or flow control counted the error.
                if let Some(g) = &self.metrics.gie {
                    g.refused(None, e.kind().as_str());
                }
                send(tx, reply::immediate_error(&e)).await;
                return false;
            }
        };
        // Decided: the joined copy goes now, and the chunks too unless they are to be echoed.
        let echo = match st.mode {
            BodyMode::FullDuplex => body.map(HeldBody::into_parts),
            BodyMode::Buffered | BodyMode::Streamed => None,
        };
        if let Some(g) = &self.metrics.gie {
            st.running = Some(g.routed(decision.model.as_deref()));
        }
        let destination = decision.plan.destination();
        let held = self.budget.reservation();
        st.receipt = match &self.receipts {
            Some(r) => Some(r.watch(&decision, &st.path, held)),
            None => Watch::response_id(&decision, &st.path, held),
        };
        if self.hooks.is_some() {
            st.destination = Some(destination.clone());
        }
        st.guard = decision.guard.map(InflightGuard::ends_with_drop);
        st.prefill_guard = decision.prefill_guard.map(InflightGuard::ends_with_drop);
        let set_header = self.destination_header;
        let prefill = reply::Prefill {
            header: self.decider.prefill_header(),
            pod: decision.plan.prefill_pod().map(|p| p.as_str()),
        };
        let sent = match (st.mode, has_body) {
            // Body-less request: the headers reply carries the decision in every mode.
            (_, false) => {
                send(
                    tx,
                    reply::request_headers_decision_pd(&destination, set_header, prefill),
                )
                .await
            }
            (BodyMode::FullDuplex, true) => {
                if !send(
                    tx,
                    reply::request_headers_decision_pd(&destination, set_header, prefill),
                )
                .await
                {
                    return false;
                }
                for msg in reply::echo_parts(echo.unwrap_or_default(), body_eos) {
                    if !send(tx, msg).await {
                        return false;
                    }
                }
                true
            }
            (BodyMode::Buffered | BodyMode::Streamed, true) => {
                send(
                    tx,
                    reply::request_body_decision_pd(&destination, set_header, prefill),
                )
                .await
            }
        };
        // Envoy has its answer; the request is on its way while the index learns its keys.
        if let (true, Some(p)) = (sent, pending) {
            // Let the tasks that write the answer run first: the one woken last sits in this
            // worker's LIFO slot, which no other worker steals, until this task yields.
            tokio::task::yield_now().await;
            self.decider.record(p).await;
        }
        sent
    }
}

impl ExtProc {
    /// The response ended: its receipt is judged and counted, its id pinned.
    fn end_receipt(&self, st: &mut StreamState) {
        if let Some(w) = st.receipt.as_deref_mut() {
            w.end(&self.decider);
        }
    }

    /// The decision; with flow control, first a wait in its queue while every pod is saturated.
    async fn decide(
        &self,
        st: &StreamState,
        body: Option<&[u8]>,
        tx: &Tx,
    ) -> Result<(Decision, Option<PendingRecord>), Rejection> {
        let subset = hooks::restrict(st.subset.as_deref(), st.selection.as_deref());
        let req = || DecideRequest {
            path: &st.path,
            headers: &st.headers,
            body,
            subset: subset.as_deref(),
        };
        let result = self.decide_in(st, req, tx).await;
        match result {
            // Said so: the client's own header left nothing, not the gateway's hint.
            Err(Rejection::Decide(DecideError::EmptySubset)) if st.selection.is_some() => {
                Err(Rejection::Unselected)
            }
            r => r,
        }
    }

    async fn decide_in<'a>(
        &self,
        st: &StreamState,
        req: impl Fn() -> DecideRequest<'a>,
        tx: &Tx,
    ) -> Result<(Decision, Option<PendingRecord>), Rejection> {
        // Boxed: the decision's state lives only while it runs, not in every open stream's task.
        let Some(fc) = &self.flow else {
            return Ok(Box::pin(self.decider.decide_reply_first(req())).await?);
        };
        let waiting = |model: Option<&str>| fc.holds(model);
        let model = match Box::pin(self.decider.decide_or_hold(req(), Some(&waiting))).await? {
            Ok(d) => return Ok(d),
            Err(Saturated { model }) => model,
        };
        let retry_after = fc.config().retry_after_s;
        let refused = |r| {
            self.metrics
                .errors
                .inc(crate::telemetry::ErrorKind::FlowControl);
            Rejection::Queue(r, retry_after)
        };
        let ticket = fc
            .enqueue(
                fc.classify(&st.headers),
                model,
                req().subset.map(<[String]>::to_vec),
            )
            .map_err(refused)?;
        // Envoy restarts its timer once per message: one extension covers the whole wait. If the
        // stream is gone this future is dropped with it (and the ticket leaves the queue).
        send(tx, reply::extend_timeout(fc.config().envoy_extension_ms())).await;
        let release = ticket.wait().await.map_err(refused)?;
        let decided = Box::pin(self.decider.decide_or_hold(req(), None)).await;
        release.committed();
        match decided? {
            Ok(d) => Ok(d),
            // Unreachable: nothing is held without `hold`.
            Err(Saturated { .. }) => Err(DecideError::NoHealthyPod.into()),
        }
    }
}

async fn send(tx: &Tx, msg: ProcessingResponse) -> bool {
    tx.send(Box::new(msg)).await.is_ok()
}

/// Whether response headers announce server-sent events (a streamed completion).
fn is_event_stream(map: Option<&HeaderMap>) -> bool {
    map.is_some_and(|m| {
        m.headers.iter().any(|h| {
            h.key.eq_ignore_ascii_case("content-type") && {
                let v = if h.raw_value.is_empty() {
                    h.value.as_bytes()
                } else {
                    &h.raw_value
                };
                v.len() >= 17 && v[..17].eq_ignore_ascii_case(b"text/event-stream")
            }
        })
    })
}

/// Header names lower-cased; values from `raw_value`, falling back to `value`.
fn read_headers(map: Option<&HeaderMap>) -> Vec<(String, String)> {
    let Some(map) = map else { return Vec::new() };
    map.headers
        .iter()
        .map(|h| {
            let value = if h.raw_value.is_empty() {
                h.value.clone()
            } else {
                String::from_utf8_lossy(&h.raw_value).into_owned()
            };
            (h.key.to_ascii_lowercase(), value)
        })
        .collect()
}

/// `metadata_context["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]`.
fn subset_hint(meta: Option<&Metadata>) -> Option<Vec<String>> {
    use envoy_types::pb::google::protobuf::value::Kind;
    let s = meta?.filter_metadata.get(SUBSET_NAMESPACE)?;
    let v = s.fields.get(SUBSET_KEY)?;
    match v.kind.as_ref()? {
        Kind::ListValue(list) => Some(
            list.values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
        ),
        Kind::StringValue(s) => Some(
            s.split(',')
                .map(|p| p.trim().to_string())
                .filter(|p| !p.is_empty())
                .collect(),
        ),
        _ => None,
    }
}
