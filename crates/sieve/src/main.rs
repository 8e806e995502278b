//! `sieve`: sparse LLM inference from the command line. Each subcommand lives in `commands/`.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod commands;

#[derive(Parser)]
#[command(
    name = "sieve",
    version,
    about = "Sparse LLM inference: skip the zeros"
)]
struct Cli {
    /// A CPU kernel switch, KEY=VALUE, repeatable: simd=best|avx512|avx2|portable,
    /// tiled-cbc=rows|columns, balanced-cbc=auto|f16|split|int4-quads, ie-bme=int4|columns.
    /// Each picks between kernels of the same product, for comparing them; the environment
    /// variables SIEVE_CPU_SIMD, SIEVE_TCBC_CPU, SIEVE_BCBC_CPU, SIEVE_IEBME_KERNEL set the
    /// switches no flag sets.
    #[arg(long = "cpu-kernel", value_name = "KEY=VALUE", global = true)]
    cpu_kernel: Vec<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Inspect the sparse weight formats.
    Formats {
        #[command(subcommand)]
        command: commands::formats::FormatsCommand,
    },
    /// Generate text from a prompt, streaming it as it is produced.
    Generate(commands::generate::GenerateArgs),
    /// Evaluate a model (perplexity).
    Eval {
        #[command(subcommand)]
        command: commands::eval::EvalCommand,
    },
    /// Prune a model on calibration text, set activation thresholds and write a `.sieve` file.
    Pack(commands::pack::PackArgs),
    /// Benchmarks (GPU kernels against cuBLAS; whole-model decode on the GPU; CPU models' tokens/s).
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
    /// Hardware models (Celty's sparse SIMT core), run on the CPU.
    Sim {
        #[command(subcommand)]
        command: commands::sim::SimCommand,
    },
    /// Serve the model over an OpenAI-compatible HTTP API (with a chat page at /).
    Serve(commands::serve::ServeArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    #[command(flatten)]
    Other(commands::bench_cpu::AnyBench),
    /// Time whole-model decode on the GPU (TPOT, TTFT, bytes per token, step breakdown).
    Decode(commands::bench_decode::DecodeArgs),
    /// Load running OpenAI-compatible servers (sieve serve, llama-server, ...) with the same
    /// requests: throughput, TTFT, TPOT, latency.
    Serve(commands::bench_serve::ServeBenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The server keeps Rust's ignored SIGPIPE: a client that hangs up must not end it.
    if !matches!(cli.command, Command::Serve(_)) {
        restore_sigpipe();
    }
    if let Err(e) = install_cpu_kernels(&cli.cpu_kernel) {
        report(&e);
        return ExitCode::FAILURE;
    }
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            report(&e);
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Formats { command } => commands::formats::run(command),
        Command::Bench { command } => match command {
            BenchCommand::Other(c) => commands::bench_cpu::run_any(c),
            BenchCommand::Decode(a) => commands::bench_decode::run(a),
            BenchCommand::Serve(a) => commands::bench_serve::run(a),
        },
        Command::Generate(args) => commands::generate::run(args),
        Command::Eval { command } => commands::eval::run(command),
        Command::Pack(args) => commands::pack::run(args),
        Command::Sim { command } => commands::sim::run(command),
        Command::Serve(args) => commands::serve::run(args),
    }
}

/// The CPU kernel switches of `--cpu-kernel`, over the environment's, fixed for the process
/// before any product is built (sieve-cpu's `options` module).
fn install_cpu_kernels(switches: &[String]) -> anyhow::Result<()> {
    if switches.is_empty() {
        return Ok(());
    }
    let mut options = sieve_cpu::CpuKernelOptions::from_env();
    for switch in switches {
        let (key, value) = switch.split_once('=').ok_or_else(|| {
            anyhow::anyhow!("--cpu-kernel {switch}: expected KEY=VALUE, e.g. simd=avx2")
        })?;
        options = options
            .with_switch(key, value)
            .map_err(anyhow::Error::msg)?;
    }
    sieve_cpu::CpuKernelOptions::install(options).map_err(|_| {
        anyhow::anyhow!("the CPU kernel switches were fixed before --cpu-kernel was read")
    })
}

/// A user's mistake is a message, not a stack trace: the error and its causes on one line.
/// `SIEVE_DEBUG=1` adds the backtrace anyhow captured (when `RUST_BACKTRACE` asked for one);
/// `RUST_BACKTRACE` alone does not, since it is often set globally. Panics keep Rust's report.
fn report(e: &anyhow::Error) {
    let debug = std::env::var_os("SIEVE_DEBUG").is_some_and(|v| !v.is_empty() && v != "0");
    if debug {
        eprintln!("error: {e:?}");
    } else {
        eprintln!("error: {e:#}");
    }
}

/// Rust ignores SIGPIPE, so printing into a closed pipe (`sieve formats stats ... | head`) panics
/// in `println!`. A command-line tool should end quietly instead, as `cat` does: restore the
/// default action, which ends the process when the reader goes away.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: called first thing in main, before any thread exists; SIG_DFL is a valid action.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
