//! The engine actor: one tokio task owns the [`Engine`] and drives it with real timers.
//! HTTP handlers talk to it through an [`EngineHandle`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::cache::CacheEvent;
use super::engine::{AdapterName, Engine, LoraInfo, Output, RequestId, Stats, Submission, Usage};
use kv_router::blocks::BlockKey;

/// What a request's owner receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestEvent {
    /// Token number `index` (0-based) was generated.
    Token {
        /// 0-based output position.
        index: u32,
    },
    /// The request finished.
    Done(Usage),
}

enum Command {
    Submit {
        id: RequestId,
        sub: Submission,
        lora: Option<AdapterName>,
        events: mpsc::UnboundedSender<RequestEvent>,
    },
    Cancel(RequestId),
    Reset(oneshot::Sender<bool>),
    Stats(oneshot::Sender<Stats>),
    Cached(Vec<BlockKey>, oneshot::Sender<usize>),
    Import(Box<Submission>, oneshot::Sender<usize>),
    LoraInfo(oneshot::Sender<Option<LoraInfo>>),
}

/// Cloneable access to the engine actor.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    next_id: Arc<AtomicU64>,
}

/// Starts the actor on the current tokio runtime. Cache events (vLLM KV events) are sent to
/// `cache_events` when given, and dropped otherwise: one `Vec` per engine step (actor wake-up)
/// that changed the cache, like vLLM's one `KVEventBatch` per scheduler step.
pub fn spawn(
    engine: Engine,
    cache_events: Option<mpsc::UnboundedSender<Vec<CacheEvent>>>,
) -> EngineHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(run(engine, rx, cache_events));
    EngineHandle {
        tx,
        next_id: Arc::new(AtomicU64::new(1)),
    }
}

impl EngineHandle {
    /// Submits a request; events arrive on the returned [`RequestStream`]. Dropping the stream
    /// before `Done` cancels the request (frees its slot).
    pub fn submit(&self, sub: Submission) -> RequestStream {
        self.submit_lora(sub, None)
    }

    /// [`EngineHandle::submit`] for LoRA adapter `lora` (`None`: the base model).
    pub fn submit_lora(&self, sub: Submission, lora: Option<AdapterName>) -> RequestStream {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = mpsc::unbounded_channel();
        let _ = self.tx.send(Command::Submit {
            id,
            sub,
            lora,
            events,
        });
        RequestStream {
            id,
            rx,
            tx: self.tx.clone(),
            done: false,
        }
    }

    /// Clears the prefix cache; returns whether the engine accepted.
    pub async fn reset_prefix_cache(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        let _ = self.tx.send(Command::Reset(tx));
        rx.await.unwrap_or(false)
    }

    /// Full blocks of `keys` already in the prefix cache.
    pub async fn cached_blocks(&self, keys: Vec<BlockKey>) -> usize {
        let (tx, rx) = oneshot::channel();
        let _ = self.tx.send(Command::Cached(keys, tx));
        rx.await.unwrap_or(0)
    }

    /// Stores a prompt's blocks computed by another pod; returns the blocks newly stored.
    pub async fn import(&self, sub: Submission) -> usize {
        let (tx, rx) = oneshot::channel();
        let _ = self.tx.send(Command::Import(Box::new(sub), tx));
        rx.await.unwrap_or(0)
    }

    /// Adapter label sets (timestamps in Unix microseconds) and residency; `None` when LoRA
    /// is disabled.
    pub async fn lora_info(&self) -> Option<LoraInfo> {
        let (tx, rx) = oneshot::channel();
        let _ = self.tx.send(Command::LoraInfo(tx));
        rx.await.unwrap_or(None)
    }

    /// Current engine statistics.
    pub async fn stats(&self) -> Stats {
        let (tx, rx) = oneshot::channel();
        let _ = self.tx.send(Command::Stats(tx));
        rx.await.unwrap_or_default()
    }
}

/// Events of one submitted request.
pub struct RequestStream {
    id: RequestId,
    rx: mpsc::UnboundedReceiver<RequestEvent>,
    tx: mpsc::UnboundedSender<Command>,
    done: bool,
}

impl RequestStream {
    /// The next event; `None` if the engine went away.
    pub async fn recv(&mut self) -> Option<RequestEvent> {
        let ev = self.rx.recv().await;
        if matches!(ev, Some(RequestEvent::Done(_)) | None) {
            self.done = true;
        }
        ev
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(Command::Cancel(self.id));
        }
    }
}

fn micros(start: Instant) -> u64 {
    start.elapsed().as_micros().min(u64::MAX as u128) as u64
}

async fn run(
    mut engine: Engine,
    mut rx: mpsc::UnboundedReceiver<Command>,
    cache_events: Option<mpsc::UnboundedSender<Vec<CacheEvent>>>,
) {
    let start = Instant::now();
    // Engine time 0 as Unix microseconds, for the timestamps vLLM publishes.
    let unix_origin = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros().min(u64::MAX as u128) as u64)
        .unwrap_or(0);
    let mut owners: std::collections::HashMap<RequestId, mpsc::UnboundedSender<RequestEvent>> =
        std::collections::HashMap::new();
    loop {
        let now = micros(start);
        for out in engine.step(now) {
            let (id, ev) = match out {
                Output::Token { id, index, .. } => (id, RequestEvent::Token { index }),
                Output::Finished { id, usage, .. } => (id, RequestEvent::Done(usage)),
            };
            let delivered = match owners.get(&id) {
                Some(tx) => tx.send(ev).is_ok(),
                None => false,
            };
            if matches!(ev, RequestEvent::Done(_)) {
                owners.remove(&id);
            } else if !delivered {
                owners.remove(&id);
                engine.cancel(now, id);
            }
        }
        let step_events = engine.drain_cache_events();
        if !step_events.is_empty() {
            if let Some(tx) = &cache_events {
                let _ = tx.send(step_events);
            }
        }
        let deadline = engine
            .next_event_time()
            .map(|t| start + Duration::from_micros(t));
        let cmd = tokio::select! {
            cmd = rx.recv() => match cmd {
                Some(cmd) => Some(cmd),
                None => return,
            },
            _ = sleep_until(deadline) => None,
        };
        let Some(cmd) = cmd else { continue };
        let now = micros(start);
        match cmd {
            Command::Submit {
                id,
                sub,
                lora,
                events,
            } => {
                owners.insert(id, events);
                engine.submit_lora(now, id, sub, lora);
            }
            Command::Cancel(id) => {
                owners.remove(&id);
                engine.cancel(now, id);
            }
            Command::Reset(reply) => {
                let _ = reply.send(engine.reset_prefix_cache(now));
            }
            Command::Stats(reply) => {
                let _ = reply.send(engine.stats());
            }
            Command::Cached(keys, reply) => {
                let _ = reply.send(engine.cached_blocks(&keys));
            }
            Command::Import(sub, reply) => {
                let _ = reply.send(engine.import(&sub));
            }
            Command::LoraInfo(reply) => {
                let info = engine.lora_info().map(|mut info| {
                    for s in &mut info.series {
                        s.at_us = s.at_us.saturating_add(unix_origin);
                    }
                    info
                });
                let _ = reply.send(info);
            }
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
