//! The writer's write budget against a real server.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::mirror_tests::{config, replica, server};
use super::writer::budgeted;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_past_its_budget_drops_only_the_writes_redis_had_not_answered() {
    let server = server();
    let index = replica(&config(&server.url(), "w", 1_000));
    let shared = &index.shared;
    let done = AtomicU64::new(0);
    // Three of five writes answered, then the batch hangs past its 20 ms budget.
    budgeted(shared, 5, Duration::from_millis(20), &done, |_con| async {
        done.fetch_add(3, Ordering::Release);
        std::future::pending::<()>().await;
        Ok(())
    })
    .await;
    assert_eq!(
        shared.metrics.writes.get(),
        3,
        "answered writes are written"
    );
    assert_eq!(
        shared.metrics.writes_dropped_total(),
        2,
        "only the rest dropped"
    );
}
