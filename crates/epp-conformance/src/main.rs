//! `epp-conformance`: runs the endpoint-picker conformance suite (see README.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use epp_conformance::control::{self, Flaw};
use epp_conformance::rig::PodLayout;
use epp_conformance::{cases, Mode, Options, PickerSpec};

#[derive(Debug, Parser)]
#[command(
    name = "epp-conformance",
    about = "Black-box conformance suite for Envoy ext_proc endpoint pickers (GIE Endpoint Picker Protocol)"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// A picker already running (ext_proc gRPC address), configured with the pods `--pods` fixes.
    #[arg(long, conflicts_with = "picker_cmd")]
    picker_addr: Option<SocketAddr>,
    /// Where that picker answers gRPC health (default: --picker-addr).
    #[arg(long, requires = "picker_addr")]
    health_addr: Option<SocketAddr>,
    /// Command line (run with `sh -c`) starting the picker; placeholders {grpc_port},
    /// {grpc_addr}, {health_port}, {metrics_port}, {admin_port}, {pods}, {pods_json},
    /// {pods_objects_json}, {model}, {config}, {workdir}.
    #[arg(long)]
    picker_cmd: Option<String>,
    /// A config file template (same placeholders) rendered to the file `{config}` names.
    #[arg(long, requires = "picker_cmd")]
    picker_config: Option<PathBuf>,
    /// How long the started picker may take to listen and route its first request, seconds.
    #[arg(long, default_value_t = 60)]
    ready_timeout: u64,
    /// Pod addresses `a,b,c1,c2[,v6]` (a and b on IPs of their own, c1 and c2 two ports of one
    /// IP, v6 on an IPv6 address). Default with --picker-addr: the list `epp-conformance pods`
    /// prints; with --picker-cmd: free ports on 127.0.0.2, .3, .4 and [::1].
    #[arg(long)]
    pods: Option<String>,
    /// No IPv6 pod (and no IPv6 selection case).
    #[arg(long)]
    no_ipv6: bool,
    /// Envoy binary (default: $KV_ROUTER_ENVOY, ./.venv/bin/envoy, envoy on PATH).
    #[arg(long)]
    envoy: Option<PathBuf>,
    /// vllm-sim binary (default: beside this executable).
    #[arg(long)]
    vllm_sim: Option<PathBuf>,
    /// Modes to run (default: both).
    #[arg(long, value_enum)]
    mode: Vec<ModeArg>,
    /// Run only the cases whose name contains this (repeatable).
    #[arg(long)]
    only: Vec<String>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum ModeArg {
    Buffered,
    FullDuplex,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Print the fixed pod addresses for a picker started by hand (--picker-addr).
    Pods {
        /// Without the IPv6 pod.
        #[arg(long)]
        no_ipv6: bool,
    },
    /// List the cases.
    List,
    /// NEGATIVE CONTROL for the suite's own tests: a tiny round-robin picker, optionally with a
    /// deliberate flaw. Not a picker to deploy.
    #[command(hide = true)]
    ControlPicker {
        #[arg(long)]
        grpc_port: u16,
        /// Comma list of pod addresses.
        #[arg(long)]
        pods: String,
        #[arg(long, value_enum, default_value_t = Flaw::None)]
        flaw: Flaw,
    },
}

fn options(a: RunArgs) -> Result<Options> {
    let picker = match (a.picker_addr, a.picker_cmd) {
        (Some(grpc), None) => PickerSpec::Addr {
            grpc,
            health: a.health_addr,
        },
        (None, Some(command)) => PickerSpec::Cmd {
            command,
            config_template: match &a.picker_config {
                Some(p) => Some(
                    std::fs::read_to_string(p)
                        .with_context(|| format!("reading {}", p.display()))?,
                ),
                None => None,
            },
            ready_timeout: Duration::from_secs(a.ready_timeout),
        },
        _ => bail!("give the picker with --picker-addr HOST:PORT or --picker-cmd '<command line>'"),
    };
    let ipv6 = !a.no_ipv6;
    let pods = match (&a.pods, &picker) {
        (Some(p), _) => Some(PodLayout::parse(p)?),
        (None, PickerSpec::Addr { .. }) => Some(PodLayout::default_fixed(ipv6)),
        (None, PickerSpec::Cmd { .. }) => None,
    };
    let vllm_sim = match a.vllm_sim {
        Some(p) => p,
        None => std::env::current_exe()?
            .parent()
            .context("no directory of the running executable")?
            .join("vllm-sim"),
    };
    if !vllm_sim.is_file() {
        bail!(
            "{} not found: build it (cargo build --release -p vllm-sim) or pass --vllm-sim",
            vllm_sim.display()
        );
    }
    let modes = match a.mode.is_empty() {
        true => Mode::ALL.to_vec(),
        false => a
            .mode
            .iter()
            .map(|m| match m {
                ModeArg::Buffered => Mode::Buffered,
                ModeArg::FullDuplex => Mode::FullDuplex,
            })
            .collect(),
    };
    Ok(Options {
        envoy: kv_testkit::deploy::find_envoy(a.envoy.as_deref())?,
        vllm_sim,
        picker,
        modes,
        ipv6: pods.as_ref().map_or(ipv6, |p| p.v6.is_some()),
        pods,
        only: a.only,
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Cmd::Pods { no_ipv6 }) => {
            println!("{}", PodLayout::default_fixed(!no_ipv6).comma_list());
            Ok(true)
        }
        Some(Cmd::List) => {
            for n in cases::all_names(&Mode::ALL) {
                println!("{n}");
            }
            Ok(true)
        }
        Some(Cmd::ControlPicker {
            grpc_port,
            pods,
            flaw,
        }) => match PodLayout::parse(&pods) {
            Ok(l) => control::serve(grpc_port, l.all(), flaw).await.map(|_| true),
            Err(e) => Err(e),
        },
        None => run(cli.run).await,
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("epp-conformance: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(a: RunArgs) -> Result<bool> {
    let opts = options(a)?;
    let report = epp_conformance::run(&opts, |r| println!("{r}")).await?;
    println!("{}", report.summary());
    Ok(report.failed().is_empty())
}
