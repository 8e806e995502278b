//! `sieve`: sparse LLM inference from the command line. Each subcommand lives in `commands/`.

use clap::{Parser, Subcommand};

mod commands;

#[derive(Parser)]
#[command(
    name = "sieve",
    version,
    about = "Sparse LLM inference: skip the zeros"
)]
struct Cli {
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
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Formats { command } => commands::formats::run(command),
        Command::Bench { command } => match command {
            BenchCommand::Other(c) => commands::bench_cpu::run_any(c),
            BenchCommand::Decode(a) => commands::bench_decode::run(a),
        },
        Command::Generate(args) => commands::generate::run(args),
        Command::Eval { command } => commands::eval::run(command),
        Command::Pack(args) => commands::pack::run(args),
        Command::Sim { command } => commands::sim::run(command),
        Command::Serve(args) => commands::serve::run(args),
    }
}
