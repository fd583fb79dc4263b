//! `kv-router`: serve, or check a config file. Config (tokenizer files included) is validated
//! before any port opens; an invalid one exits with status 64 either way.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};

use clap::{Parser, Subcommand};
use kv_router::config::{Config, KubernetesOverrides};
use kv_router::keys::load_tokenizers;
use kv_router::tokenize::TokenizerRegistry;

/// `kv-router --version`: the crate version and the git revision it was built from.
const VERSION_LINE: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("KV_ROUTER_GIT_REVISION"),
    ")"
);

#[derive(Parser)]
#[command(
    name = "kv-router",
    version = VERSION_LINE,
    about = "KV-cache-aware endpoint picker for vLLM behind Envoy ext_proc"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the ext_proc, Pick and admin servers.
    Serve {
        /// Path to router.yaml (see docs/config.md), or a directory of YAML layers merged in name order.
        #[arg(long, short)]
        config: PathBuf,
        /// Discover pods from this InferencePool (sets pods.kubernetes.pool.name; GIE EPP flag).
        #[arg(long)]
        pool_name: Option<String>,
        /// Namespace of that InferencePool (sets pods.kubernetes.pool.namespace).
        #[arg(long)]
        pool_namespace: Option<String>,
    },
    /// Validate a config file and list every problem.
    CheckConfig {
        /// Path to router.yaml, or a directory of YAML layers.
        file: PathBuf,
    },
}

/// Exit status of an invalid configuration (EX_USAGE), for `check-config` and `serve` alike.
const BAD_CONFIG: u8 = 64;

/// Loads and validates a config file, tokenizer files included (a missing or broken tokenizer
/// is a config error).
fn load(
    file: &Path,
    overrides: KubernetesOverrides,
) -> Result<(Config, TokenizerRegistry), String> {
    let cfg = Config::load_with(file, overrides).map_err(|e| format!("{}: {e}", file.display()))?;
    let tokenizers = load_tokenizers(&cfg.tokenizers)
        .map_err(|e| format!("{}: tokenizers: {e}", file.display()))?;
    Ok((cfg, tokenizers))
}

/// Freed request buffers go back to the OS: with glibc's allocator a burst of large bodies kept
/// ~90 % of its peak RSS after the streams closed (`kv-bench hostile`, docs/results.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
/// `MIMALLOC_PURGE_DELAY` / `MIMALLOC_ALLOW_THP` in the environment still win.
fn return_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one integer option of the linked mimalloc; any value is valid.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, 0) }
    }
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // SAFETY: PR_SET_THP_DISABLE takes integer arguments only; a kernel without it (< 3.15)
        // answers EINVAL, which changes nothing.
        unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
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
    // SAFETY: sysconf reads a constant of the system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

/// Called when a runtime worker goes idle. At most once a second per thread it reads RSS; when RSS
/// has moved 4 MiB and an eighth from its level after the last collection (a burst, or its end),
/// it bumps the generation, and every worker collects its own heap, forced, once per generation:
/// - a body buffered on one worker and dropped on another stays on the first one's pages until
///   that worker collects; a normal collection skips full pages, where a large buffer lives alone
///   (RSS stayed 1.2-1.6x its pre-flood level for over 60 s after the explain and preface floods,
///   and 1.27x after held uploads in CI);
/// - a worker parked for good never sees the bump, so the one that bumps spawns one empty task per
///   other worker, which wakes them to park again and collect;
/// - only after a burst: a collection on every park cost 0.1 ms at p99 of 1 KB requests
///   (`kv-bench overhead`).
fn collect_when_idle() {
    use std::cell::Cell;
    use std::time::{Duration, Instant};
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { file } => match load(&file, KubernetesOverrides::default()) {
            Ok(_) => {
                println!("{}: OK", file.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(BAD_CONFIG)
            }
        },
        Command::Serve {
            config,
            pool_name,
            pool_namespace,
        } => {
            let overrides = KubernetesOverrides {
                pool_name,
                pool_namespace,
            };
            let (cfg, tokenizers) = match load(&config, overrides) {
                Ok(loaded) => loaded,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(BAD_CONFIG);
                }
            };
            kv_router::telemetry::init_logging(&cfg.log);
            return_freed_memory();
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .on_thread_park(collect_when_idle)
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let result = rt.block_on(kv_router::app::run(cfg, tokenizers));
            // Background loops stop with the runtime; a stuck blocking task cannot hold the exit.
            rt.shutdown_timeout(std::time::Duration::from_secs(2));
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    eprintln!("kv-router: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
