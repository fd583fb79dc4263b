//! Flow control (`flow_control`, off by default): while no pod that could serve a request has
//! room (the saturation gate's test, see [`crate::picker::has_room`]), the request waits here
//! instead of piling onto a saturated pod's queue. One dispatcher task releases waiters one at a
//! time, in priority order and fairly between flows ([`queue`]), whenever their model has room
//! again; a waiter that times out, is shed for a higher priority, or finds the queue full gets a
//! 429 with `Retry-After`. A waiter whose client leaves (the ext_proc stream is dropped) drops
//! its [`Ticket`], which takes it out of the queue.
//!
//! Who may call it: only the ext_proc streams of the gRPC port. Memory: at most `max_queued`
//! entries (each a model name and the gateway's subset hint; the body stays in the stream,
//! counted in the body budget) in at most `max_flows` + 1 flow queues; metric labels come only
//! from the configuration, never from a client's header.

mod metrics;
pub mod objectives;
pub mod queue;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use crate::config::{FlowConfig, MAX_FLOW_ID_BYTES};
pub use metrics::FlowMetrics;
pub use objectives::{Objective, Watched};
use queue::{FlowId, Pushed, Queue, Slot};

/// How long the dispatcher waits for a released request to be committed (so that its pod's
/// load counts it) before it tests room for the next one.
const ACK_WAIT: Duration = Duration::from_millis(100);

/// A request's place in the order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Class {
    /// Higher leaves first.
    pub priority: i32,
    /// Its flow (tenant).
    pub flow: FlowId,
}

/// Why a request is refused instead of queued or released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The queue is full of requests of its priority or higher.
    QueueFull,
    /// It waited `queue_timeout_ms`.
    Timeout,
    /// Sheddable (below `shed_below`) while saturated, or dropped for a higher priority.
    Shed,
}

impl Refusal {
    /// The `reason` label and the error body's code.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::QueueFull => "queue_full",
            Refusal::Timeout => "queue_timeout",
            Refusal::Shed => "shed",
        }
    }
}

/// What the dispatcher tells a waiter.
enum Verdict {
    /// Decide now, then acknowledge (the dispatcher waits for that before the next release).
    Go(oneshot::Sender<()>),
    /// Dropped for a higher priority.
    Shed,
}

struct Waiter {
    model: Option<String>,
    subset: Option<Vec<String>>,
    tx: oneshot::Sender<Verdict>,
    since: Instant,
    flow_label: Arc<str>,
}

/// The queue, its dispatcher's wake-up and its metrics.
pub struct FlowControl {
    cfg: FlowConfig,
    queue: Mutex<Queue<Waiter>>,
    /// Queued requests per model (what [`FlowControl::holds`] asks).
    per_model: Mutex<HashMap<Option<String>, usize>>,
    wake: Notify,
    metrics: FlowMetrics,
    other: Arc<str>,
    /// Priorities of the pool's InferenceObjectives (filled by the watch, when one runs).
    watched: Arc<Watched>,
}

/// A queued request. Dropping it before it was released takes it out of the queue.
pub struct Ticket {
    fc: Arc<FlowControl>,
    slot: Slot,
    model: Option<String>,
    rx: oneshot::Receiver<Verdict>,
    since: Instant,
    flow_label: Arc<str>,
    done: bool,
}

/// Leave to go: the decision runs, then [`Release::committed`] lets the dispatcher go on.
pub struct Release(oneshot::Sender<()>);

impl Release {
    /// The released request is decided (its pod's load counts it).
    pub fn committed(self) {
        let _ = self.0.send(());
    }
}

impl FlowControl {
    /// A flow control over `cfg`, its metrics registered by the caller.
    pub fn new(cfg: FlowConfig, metrics: FlowMetrics) -> Arc<Self> {
        Arc::new(Self {
            queue: Mutex::new(Queue::new(cfg.max_queued, cfg.max_flows)),
            per_model: Mutex::new(HashMap::new()),
            wake: Notify::new(),
            watched: Arc::new(Watched::new(cfg.priority_range(), metrics.clone())),
            metrics,
            other: Arc::from("other"),
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &FlowConfig {
        &self.cfg
    }

    /// The watched InferenceObjectives' priorities (what the watch feeds).
    pub fn objectives(&self) -> Arc<Watched> {
        self.watched.clone()
    }

    /// The request's priority and flow. Its flow is the identity header's value; with
    /// `trust_client_headers`, else the flow header's; else the one shared flow. Its priority,
    /// only with `trust_client_headers`, is the objective's (a watched InferenceObjective's, else
    /// the `objectives` map's), else the priority header's (clamped to
    /// [`FlowConfig::priority_range`]); otherwise, and by default, `default_priority`.
    pub fn classify(&self, headers: &[(String, String)]) -> Class {
        let get = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| !name.is_empty() && k == name)
                .map(|(_, v)| v.trim())
                .filter(|v| !v.is_empty())
        };
        let trusted = self.cfg.trust_client_headers;
        let identity = get(&self.cfg.identity_header);
        let flow = match identity {
            Some(id) => id,
            None if trusted => get(&self.cfg.flow_header).unwrap_or(""),
            None => "",
        };
        let priority = if trusted {
            let (lo, hi) = self.cfg.priority_range();
            get(&self.cfg.objective_header)
                .and_then(|o| {
                    let watched = self.watched.priority(o);
                    watched.or_else(|| self.cfg.objectives.get(o).copied())
                })
                .or_else(|| get(&self.cfg.priority_header).and_then(|p| p.parse::<i32>().ok()))
                .map_or(self.cfg.default_priority, |p| p.clamp(lo, hi))
        } else {
            self.cfg.default_priority
        };
        Class {
            priority,
            flow: FlowId::Named(cut(flow).into()),
        }
    }

    /// Whether requests of `model` are queued (a newcomer then waits behind them).
    pub fn holds(&self, model: Option<&str>) -> bool {
        let per_model = self.per_model.lock();
        !per_model.is_empty() && per_model.contains_key(&model.map(str::to_string))
    }

    /// Queues a request whose pods are all saturated, or refuses it (counted).
    pub fn enqueue(
        self: &Arc<Self>,
        class: Class,
        model: Option<String>,
        subset: Option<Vec<String>>,
    ) -> Result<Ticket, Refusal> {
        let flow_label = self.flow_label(&class.flow);
        if class.priority < self.cfg.shed_below {
            self.metrics
                .rejected(Refusal::Shed, class.priority, &flow_label);
            return Err(Refusal::Shed);
        }
        let weight = match &class.flow {
            FlowId::Named(n) => self.cfg.flows.get(&**n).copied().unwrap_or(1),
            FlowId::Overflow => 1,
        };
        let (tx, rx) = oneshot::channel();
        let since = Instant::now();
        let waiter = Waiter {
            model: model.clone(),
            subset,
            tx,
            since,
            flow_label: flow_label.clone(),
        };
        let pushed = self
            .queue
            .lock()
            .push(class.priority, class.flow, weight, waiter);
        let (slot, evicted) = match pushed {
            Pushed::Queued { slot, evicted } => (slot, evicted),
            Pushed::Full(_) => {
                self.metrics
                    .rejected(Refusal::QueueFull, class.priority, &flow_label);
                return Err(Refusal::QueueFull);
            }
        };
        *self.per_model.lock().entry(model.clone()).or_default() += 1;
        self.metrics.queued(slot.priority, &flow_label, 1);
        if let Some((s, w)) = evicted {
            self.left(s.priority, &w.model, &w.flow_label);
            // Its waiter records the outcome.
            let _ = w.tx.send(Verdict::Shed);
        }
        self.wake.notify_one();
        Ok(Ticket {
            fc: self.clone(),
            slot,
            model,
            rx,
            since,
            flow_label,
            done: false,
        })
    }

    /// Releases waiters while their model has room (`room(model, subset)`), one at a time,
    /// forever: wakes on an arrival or every `recheck_ms` while anything waits.
    pub async fn dispatch<R>(self: Arc<Self>, room: R)
    where
        R: Fn(Option<&str>, Option<&[String]>) -> bool + Send + Sync,
    {
        let recheck = Duration::from_millis(self.cfg.recheck_ms);
        loop {
            if self.queue.lock().is_empty() {
                self.wake.notified().await;
            } else {
                let _ = tokio::time::timeout(recheck, self.wake.notified()).await;
            }
            while let Some(w) = self.next_release(&room) {
                let (ack, acked) = oneshot::channel();
                if w.tx.send(Verdict::Go(ack)).is_ok() {
                    let _ = tokio::time::timeout(ACK_WAIT, acked).await;
                }
            }
        }
    }

    /// Takes the next waiter whose model has room out of the queue.
    fn next_release<R>(&self, room: &R) -> Option<Waiter>
    where
        R: Fn(Option<&str>, Option<&[String]>) -> bool,
    {
        let mut q = self.queue.lock();
        let mut seen: HashMap<(Option<&str>, Option<&[String]>), bool> = HashMap::new();
        let slot = q.next_ready(|w| {
            let key = (w.model.as_deref(), w.subset.as_deref());
            *seen.entry(key).or_insert_with(|| room(key.0, key.1))
        })?;
        let w = q.release(slot.seq)?;
        drop(q);
        self.left(slot.priority, &w.model, &w.flow_label);
        self.metrics
            .waited(slot.priority, &w.flow_label, "released", w.since.elapsed());
        Some(w)
    }

    /// Accounts for an entry that left the queue.
    fn left(&self, priority: i32, model: &Option<String>, flow_label: &Arc<str>) {
        let mut per_model = self.per_model.lock();
        if let Some(n) = per_model.get_mut(model) {
            *n -= 1;
            if *n == 0 {
                per_model.remove(model);
            }
        }
        self.metrics.queued(priority, flow_label, -1);
    }

    /// Configured flows have their own label; every other flow is "other".
    fn flow_label(&self, flow: &FlowId) -> Arc<str> {
        match flow {
            FlowId::Named(n) if self.cfg.flows.contains_key(&**n) => Arc::from(&**n),
            _ => self.other.clone(),
        }
    }

    /// Requests queued now.
    pub fn len(&self) -> usize {
        self.queue.lock().len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.queue.lock().is_empty()
    }
}

impl Ticket {
    /// Waits for the release, at most `queue_timeout_ms` from the enqueue.
    pub async fn wait(mut self) -> Result<Release, Refusal> {
        let deadline = self.since + Duration::from_millis(self.fc.cfg.queue_timeout_ms);
        let verdict = tokio::time::timeout_at(deadline, &mut self.rx).await;
        self.done = true;
        let fc = self.fc.clone();
        match verdict {
            Ok(Ok(Verdict::Go(ack))) => Ok(Release(ack)),
            Ok(Ok(Verdict::Shed)) => {
                fc.metrics
                    .rejected(Refusal::Shed, self.slot.priority, &self.flow_label);
                fc.metrics.waited(
                    self.slot.priority,
                    &self.flow_label,
                    "shed",
                    self.since.elapsed(),
                );
                Err(Refusal::Shed)
            }
            // The sender only drops in a release that raced the deadline, or at shutdown.
            Ok(Err(_)) | Err(_) => {
                if fc.queue.lock().remove(self.slot.seq).is_some() {
                    fc.left(self.slot.priority, &self.model, &self.flow_label);
                }
                fc.metrics
                    .rejected(Refusal::Timeout, self.slot.priority, &self.flow_label);
                fc.metrics.waited(
                    self.slot.priority,
                    &self.flow_label,
                    "timeout",
                    self.since.elapsed(),
                );
                Err(Refusal::Timeout)
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // The client left while waiting (its stream was dropped).
        if self.fc.queue.lock().remove(self.slot.seq).is_some() {
            self.fc
                .left(self.slot.priority, &self.model, &self.flow_label);
            self.fc.metrics.waited(
                self.slot.priority,
                &self.flow_label,
                "cancelled",
                self.since.elapsed(),
            );
        }
    }
}

/// `s` cut to at most [`MAX_FLOW_ID_BYTES`] on a character boundary.
fn cut(s: &str) -> &str {
    if s.len() <= MAX_FLOW_ID_BYTES {
        return s;
    }
    let mut end = MAX_FLOW_ID_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests;
