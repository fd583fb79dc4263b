//! `kv-router`: serve, or check a config file. Config is validated before any port opens.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kv-router",
    version,
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { file } => match kv_router::config::Config::load_with(
            &file,
            kv_router::config::KubernetesOverrides::default(),
        ) {
            // Tokenizer files are read too: a missing or broken one is a config error.
            Ok(cfg) => match kv_router::keys::load_tokenizers(&cfg.tokenizers) {
                Ok(_) => {
                    println!("{}: OK", file.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("{}: tokenizers: {e}", file.display());
                    ExitCode::from(64)
                }
            },
            Err(e) => {
                eprintln!("{}: {e}", file.display());
                ExitCode::from(64)
            }
        },
        Command::Serve {
            config,
            pool_name,
            pool_namespace,
        } => {
            let overrides = kv_router::config::KubernetesOverrides {
                pool_name,
                pool_namespace,
            };
            let cfg = match kv_router::config::Config::load_with(&config, overrides) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{}: {e}", config.display());
                    return ExitCode::from(64);
                }
            };
            kv_router::telemetry::init_logging(&cfg.log);
            let rt = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(kv_router::app::run(cfg)) {
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
