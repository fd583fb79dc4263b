//! `kv-router`: serve, or check a config file. Config (tokenizer files included) is validated
//! before any port opens; an invalid one exits with status 64 either way.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kv_router::allocator;
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
        /// Turn on the Gateway API Inference Extension conformance-test hooks (sets
        /// conformance_test_hooks; test clusters only: a client header then picks the pod).
        #[arg(long)]
        conformance_test_hooks: bool,
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

/// mimalloc returns freed request buffers to the OS (see `kv_router::allocator`); only this binary
/// installs it.
#[global_allocator]
static ALLOCATOR: allocator::MiMalloc = allocator::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { file } => match load(&file, KubernetesOverrides::default()) {
            Ok((cfg, _)) => {
                for why in cfg.ignored_keys() {
                    eprintln!("{}: {why}", file.display());
                }
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
            conformance_test_hooks,
        } => {
            let overrides = KubernetesOverrides {
                pool_name,
                pool_namespace,
            };
            let (mut cfg, tokenizers) = match load(&config, overrides) {
                Ok(loaded) => loaded,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(BAD_CONFIG);
                }
            };
            cfg.conformance_test_hooks |= conformance_test_hooks;
            kv_router::telemetry::init_logging(&cfg.log);
            for why in cfg.ignored_keys() {
                tracing::warn!("{why}");
            }
            allocator::return_freed_memory();
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .on_thread_park(allocator::collect_when_idle)
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
