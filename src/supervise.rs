//! Supervision of the background loops (discovery, probes, scrapes, maintenance, KV-event
//! ingestion): a loop that ends or panics is restarted after a short backoff and counted in
//! `kv_router_task_restarts_total{task}`; while one is down, readiness says so.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::time::Instant;
use tracing::{error, warn};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TaskLabels {
    task: String,
}

/// Starts, watches and restarts the router's background loops.
#[derive(Debug, Clone, Default)]
pub struct Supervisor {
    restarts: Family<TaskLabels, Counter>,
    down: Arc<Mutex<BTreeSet<&'static str>>>,
}

/// First restart delay; doubles per quick failure up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A run this long resets the backoff.
const HEALTHY_RUN: Duration = Duration::from_secs(60);

impl Supervisor {
    /// Registers `task_restarts` (`registry` is the `kv_router` sub-registry).
    pub fn register(registry: &mut Registry) -> Self {
        let s = Self::default();
        registry.register(
            "task_restarts",
            "Background loops that ended or panicked and were restarted",
            s.restarts.clone(),
        );
        s
    }

    /// Runs `make()` as task `name` forever: whenever it ends or panics it is counted, marked
    /// down, and started again after a backoff.
    pub fn spawn<F, Fut>(&self, name: &'static str, mut make: F)
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let restarts = self
            .restarts
            .get_or_create(&TaskLabels { task: name.into() })
            .clone();
        let down = self.down.clone();
        tokio::spawn(async move {
            let mut backoff = MIN_BACKOFF;
            loop {
                let started = Instant::now();
                match tokio::spawn(make()).await {
                    Ok(()) => warn!(task = name, "background task ended; restarting it"),
                    Err(e) if e.is_panic() => {
                        error!(task = name, "background task panicked; restarting it")
                    }
                    // Cancelled: the runtime is shutting down.
                    Err(_) => return,
                }
                restarts.inc();
                down.lock().insert(name);
                if started.elapsed() >= HEALTHY_RUN {
                    backoff = MIN_BACKOFF;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                down.lock().remove(name);
            }
        });
    }

    /// Tasks currently down (waiting to be restarted).
    pub fn down(&self) -> Vec<&'static str> {
        self.down.lock().iter().copied().collect()
    }

    /// Restarts of `name` so far.
    pub fn restarts(&self, name: &'static str) -> u64 {
        self.restarts
            .get_or_create(&TaskLabels { task: name.into() })
            .get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// In paused time: the backoffs elapse as soon as every task waits, the same way each run.
    #[tokio::test(start_paused = true)]
    async fn a_panicking_task_is_restarted_counted_and_reported_down() {
        let s = Supervisor::default();
        let runs = Arc::new(AtomicU32::new(0));
        let r = runs.clone();
        s.spawn("flaky", move || {
            let n = r.fetch_add(1, Ordering::SeqCst);
            async move {
                if n < 2 {
                    panic!("injected failure {n}");
                }
                std::future::pending::<()>().await
            }
        });
        let mut saw_down = false;
        let deadline = Instant::now() + Duration::from_secs(5);
        while runs.load(Ordering::SeqCst) < 3 && Instant::now() < deadline {
            saw_down |= s.down() == ["flaky"];
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(runs.load(Ordering::SeqCst), 3, "restarted after each panic");
        assert!(saw_down, "readiness saw the task down between runs");
        assert_eq!(s.restarts("flaky"), 2);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !s.down().is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(s.down().is_empty(), "running again");
    }
}
