//! Whether this replica should take traffic: the one rule behind the admin port's `/readyz` and
//! the gRPC port's health services (`readiness`, the ext_proc service name and `""`), so a
//! gateway's gRPC health check and a kubelet's HTTP probe never disagree.
//!
//! Read-only: it reads the shutdown signal, the supervisor, the pods, the start-up catch-ups and
//! the index, and holds nothing but handles to them.

use std::sync::Arc;

use tokio::sync::watch;

use crate::index::KvIndex;
use crate::ingest::CatchUp;
use crate::pods::PodRegistry;
use crate::supervise::Supervisor;

/// The five conditions of readiness, built once and shared by both ports.
#[derive(Clone)]
pub(crate) struct Readiness {
    /// True once a shutdown signal arrived.
    stopping: watch::Receiver<bool>,
    /// Background loops (not ready while one is down).
    supervisor: Supervisor,
    /// Not ready until one pod is healthy.
    pods: Arc<PodRegistry>,
    /// Precise mode: the start-up KV-event catch-ups.
    catch_up: Option<Arc<CatchUp>>,
    /// A shared index still loading or too far behind says so.
    index: Arc<dyn KvIndex>,
}

impl Readiness {
    pub(crate) fn new(
        stopping: watch::Receiver<bool>,
        supervisor: Supervisor,
        pods: Arc<PodRegistry>,
        catch_up: Option<Arc<CatchUp>>,
        index: Arc<dyn KvIndex>,
    ) -> Self {
        Self {
            stopping,
            supervisor,
            pods,
            catch_up,
            index,
        }
    }

    /// `Ok` when ready; else why not (the first condition that fails, in the order of the
    /// fields), as `/readyz` shows it.
    pub(crate) fn check(&self) -> Result<(), String> {
        if *self.stopping.borrow() {
            return Err("shutting down".into());
        }
        let down = self.supervisor.down();
        if !down.is_empty() {
            return Err(format!(
                "background task down, restarting: {}",
                down.join(", ")
            ));
        }
        if !self.pods.any_healthy() {
            return Err("no healthy pod yet".into());
        }
        if let Some(why) = self
            .catch_up
            .as_ref()
            .and_then(|c| c.waiting_on(&self.pods))
        {
            return Err(why);
        }
        match self.index.unready() {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }

    /// The shutdown signal, for a loop that reports readiness to wake on at once rather than
    /// on its next poll.
    pub(crate) fn stopping(&self) -> watch::Receiver<bool> {
        self.stopping.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use async_trait::async_trait;
    use axum::body::Body;
    use axum::Router;
    use parking_lot::Mutex;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_server::Health;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::server::{HealthReporter, HealthService};
    use tower::ServiceExt;

    use super::*;
    use crate::blocks::BlockKey;
    use crate::budget::BodyBudget;
    use crate::index::{IndexError, IndexStats, MemoryIndex};
    use crate::pods::PodId;
    use crate::scoring::SessionStore;
    use crate::server::admin::routes::{router, AdminState};
    use crate::server::grpc;

    /// An in-process index that reports itself unready while `why` holds a reason, as a shared
    /// index does while loading from Redis (which a unit test cannot run).
    struct Loading {
        inner: MemoryIndex,
        why: Mutex<Option<String>>,
    }

    #[async_trait]
    impl KvIndex for Loading {
        async fn lookup(
            &self,
            keys: &[BlockKey],
            pods: &[PodId],
            now_ms: u64,
        ) -> Result<Vec<f64>, IndexError> {
            self.inner.lookup(keys, pods, now_ms).await
        }
        async fn record(
            &self,
            pod: &PodId,
            keys: &[BlockKey],
            now_ms: u64,
        ) -> Result<(), IndexError> {
            self.inner.record(pod, keys, now_ms).await
        }
        async fn forget_pod(&self, pod: &PodId) -> Result<(), IndexError> {
            self.inner.forget_pod(pod).await
        }
        async fn set_capacity(&self, pod: &PodId, blocks: usize) -> Result<(), IndexError> {
            self.inner.set_capacity(pod, blocks).await
        }
        async fn sweep(&self, now_ms: u64) -> Result<(), IndexError> {
            self.inner.sweep(now_ms).await
        }
        fn stats(&self) -> IndexStats {
            self.inner.stats()
        }
        fn unready(&self) -> Option<String> {
            self.why.lock().clone()
        }
        fn describe(&self) -> &'static str {
            "memory (reporting unready on demand)"
        }
    }

    /// Both ports' answers: `/readyz` (`Ok` on 200 "ready", else its 503 body), and whether the
    /// gRPC readiness services are SERVING after one readiness report (they must all agree).
    struct Surfaces {
        admin: Router,
        readiness: Readiness,
        reporter: HealthReporter,
        health: HealthService,
        last: Option<bool>,
    }

    impl Surfaces {
        async fn answer(&mut self) -> (Result<(), String>, bool) {
            let get = axum::http::Request::get("/readyz").body(Body::empty());
            let resp = self.admin.clone().oneshot(get.unwrap()).await.unwrap();
            let status = resp.status();
            let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
                .await
                .unwrap();
            let body = String::from_utf8(body.to_vec()).unwrap();
            let admin = match status.as_u16() {
                200 if body == "ready" => Ok(()),
                503 => Err(body),
                other => panic!("/readyz answered {other}: {body}"),
            };
            grpc::report(&self.readiness, &self.reporter, &mut self.last).await;
            let mut serving = Vec::new();
            for service in grpc::HEALTH_SERVICES[1..].iter().chain(&[""]) {
                let req = tonic::Request::new(HealthCheckRequest {
                    service: service.to_string(),
                });
                let status = self.health.check(req).await.unwrap().into_inner().status;
                serving.push(status == ServingStatus::Serving as i32);
            }
            assert!(
                serving.iter().all(|s| *s == serving[0]),
                "the gRPC readiness services disagree: {serving:?}"
            );
            (admin, serving[0])
        }

        /// Asserts both ports report not ready for `why`.
        async fn not_ready(&mut self, why: &str) {
            let (admin, grpc) = self.answer().await;
            let admin = admin.expect_err("/readyz answered ready");
            assert!(
                admin.starts_with(why),
                "/readyz: {admin:?}, expected {why:?}"
            );
            assert!(!grpc, "gRPC health SERVING while /readyz says {admin:?}");
        }

        async fn ready(&mut self) {
            assert_eq!(self.answer().await, (Ok(()), true));
        }
    }

    /// Each of the five conditions, alone, makes both ports not ready, and lifting it makes both
    /// ready again. In paused time: a supervised loop's restart backoff passes only when waited.
    #[tokio::test(start_paused = true)]
    async fn readyz_and_grpc_health_agree_on_each_condition() {
        let (decider, pods) = crate::decide::tests::decider(1, |_| {}).await;
        let pod = pods.snapshot().pods()[0].clone();
        let (stop, stopping) = watch::channel(false);
        let supervisor = Supervisor::default();
        let catch_up = Arc::new(CatchUp::default());
        let index = Arc::new(Loading {
            inner: MemoryIndex::new(60_000, 1000),
            why: Mutex::new(None),
        });
        let readiness = Readiness::new(
            stopping,
            supervisor.clone(),
            pods.clone(),
            Some(catch_up.clone()),
            index.clone(),
        );
        let admin = router(AdminState {
            receipts: None,
            registry: Arc::default(),
            pods: pods.clone(),
            decider: Arc::new(decider),
            sessions: Arc::new(SessionStore::new(10, 1000)),
            stale_after: Duration::from_secs(1),
            mode: "test",
            readiness: readiness.clone(),
            body_limit: 1 << 20,
            bodies: BodyBudget::new(1 << 20),
            token: None,
            caps: crate::server::fds::caps(None, 1, 1),
            snapshots: crate::server::admin::routes::IndexSnapshots::new(1000),
        });
        let (reporter, _server) = grpc::health().await;
        let health = HealthService::from_health_reporter(reporter.clone());
        let mut s = Surfaces {
            admin,
            readiness,
            reporter,
            health,
            last: None,
        };

        // First, as the catch-ups latch once over: a healthy pod not caught up yet.
        s.not_ready("KV-event catch-up").await;
        catch_up.started(pod.id(), 0, true);
        s.not_ready("KV-event catch-up").await;
        catch_up.finished(pod.id(), 0);
        s.ready().await;

        *index.why.lock() = Some("loading the shared index from Redis".into());
        s.not_ready("loading the shared index from Redis").await;
        *index.why.lock() = None;
        s.ready().await;

        pod.record_probe(false, 1);
        s.not_ready("no healthy pod yet").await;
        pod.record_probe(true, 1);
        s.ready().await;

        let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let r = runs.clone();
        supervisor.spawn("flaky", move || {
            let first = r.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
            async move {
                if !first {
                    std::future::pending::<()>().await
                }
            }
        });
        for _ in 0..100 {
            if !supervisor.down().is_empty() {
                break;
            }
            tokio::task::yield_now().await;
        }
        s.not_ready("background task down, restarting: flaky").await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
        s.ready().await;

        stop.send(true).unwrap();
        s.not_ready("shutting down").await;
    }
}
