//! The `kv-router` binary's allocator, mimalloc, and the tuning that returns freed memory to the
//! OS. Only the binary installs it (`#[global_allocator]` in main.rs): the tests, the simulator
//! and the benchmarks that link this library keep the system allocator.
//!
//! The crate's only unsafe code: two calls into the linked mimalloc, which has no safe binding
//! for them. Everything else here (prctl, the page size) goes through rustix's safe API.
#![allow(
    unsafe_code,
    reason = "mimalloc's option setter and heap collection are C functions without a safe binding"
)]

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Freed request buffers go back to the OS: with glibc's allocator a burst of large bodies kept
/// ~90 % of its peak RSS after the streams closed (`kv-bench hostile`, docs/results.md).
pub use mimalloc::MiMalloc;

extern "C" {
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
    fn mi_collect(force: bool);
}

/// `mi_option_purge_delay` in the bundled mimalloc v3's `mi_option_t`.
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

/// Memory freed after a burst goes back to the OS (`kv-bench hostile --attacks`, docs/results.md):
/// - purge delay 0: mimalloc's default 1 s delay only elapses with further allocator activity, so
///   after a Pick or explain flood RSS stayed 3-5x its pre-flood level for over 60 s;
/// - no transparent huge pages for this process: khugepaged collapsed every 2 MiB range a flood
///   had touched into a huge page, so an idle router's RSS crept up in 10 s steps (32 -> 59 MiB
///   after held uploads), and its idle RSS was twice what it used (32 vs 17 MiB). mimalloc's own
///   `allow_thp` option is read before `main`, hence the process-wide switch.
///
/// `MIMALLOC_PURGE_DELAY` / `MIMALLOC_ALLOW_THP` in the environment still win. Called once, at
/// start-up.
pub fn return_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one integer option of the linked mimalloc; any value is valid.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, 0) }
    }
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // A kernel without PR_SET_THP_DISABLE (< 3.15) answers EINVAL, which changes nothing.
        let _ = rustix::thread::disable_transparent_huge_pages(true);
    }
}

/// Bumped when RSS has moved well away from its level after the last collection: each runtime
/// worker then collects its own mimalloc heap once, on its next park.
static COLLECT_GENERATION: AtomicU64 = AtomicU64::new(0);
/// RSS right after the last collection, bytes.
static RSS_AFTER_COLLECT: AtomicU64 = AtomicU64::new(0);

/// Resident bytes from `/proc/self/statm` (None where there is none).
fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * u64::try_from(rustix::param::page_size()).ok()?)
}

/// The runtime's park hook (`on_thread_park`), called when a worker goes idle. At most once a
/// second per thread it reads RSS; when RSS has moved 4 MiB and an eighth from its level after the
/// last collection (a burst, or its end), it bumps the generation, and every worker collects its
/// own heap, forced, once per generation:
/// - a body buffered on one worker and dropped on another stays on the first one's pages until
///   that worker collects; a normal collection skips full pages, where a large buffer lives alone
///   (RSS stayed 1.2-1.6x its pre-flood level for over 60 s after the explain and preface floods,
///   and 1.27x after held uploads in CI);
/// - a worker parked for good never sees the bump, so the one that bumps spawns one empty task per
///   other worker, which wakes them to park again and collect;
/// - only after a burst: a collection on every park cost 0.1 ms at p99 of 1 KB requests
///   (`kv-bench overhead`).
pub fn collect_when_idle() {
    thread_local! {
        static LAST_CHECK: Cell<Option<Instant>> = const { Cell::new(None) };
        static SEEN: Cell<u64> = const { Cell::new(0) };
    }
    let mut generation = COLLECT_GENERATION.load(Ordering::Acquire);
    if SEEN.get() == generation {
        let now = Instant::now();
        if LAST_CHECK
            .get()
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            return;
        }
        LAST_CHECK.set(Some(now));
        let (Some(rss), base) = (rss_bytes(), RSS_AFTER_COLLECT.load(Ordering::Relaxed)) else {
            return;
        };
        // Grown: garbage of a burst; shrunk: a burst's end, whose remainder the purge missed.
        if rss.abs_diff(base) <= (base / 8).max(4 << 20) {
            return;
        }
        generation = COLLECT_GENERATION.fetch_add(1, Ordering::AcqRel) + 1;
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            // From the park hook a spawn goes to the shared queue and wakes a parked worker.
            for _ in 1..rt.metrics().num_workers() {
                drop(rt.spawn(async {}));
            }
        }
    }
    SEEN.set(generation);
    // SAFETY: collects the calling thread's own heap; no pointer crosses the boundary.
    unsafe { mi_collect(true) }
    if let Some(rss) = rss_bytes() {
        RSS_AFTER_COLLECT.store(rss, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// statm counts pages: the bytes agree with the kernel's own VmRSS (kB) in /proc/self/status.
    #[test]
    fn rss_is_read_in_bytes() {
        let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
        let vm_rss_kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in kB");
        let rss = rss_bytes().expect("/proc/self/statm");
        // Read moments apart, by a process whose other test threads allocate meanwhile.
        assert!(
            rss.abs_diff(vm_rss_kb * 1024) <= (vm_rss_kb * 1024 / 4).max(4 << 20),
            "statm {rss} bytes, status {vm_rss_kb} kB"
        );
    }
}
