//! `sieve bench kernels` without building the whole CLI (model loading, tokenizers), so that a
//! GPU run needs only this crate: the same flags, parsed into
//! [`sieve_cuda::bench::KernelBenchOptions`], and the same library run.
//!
//!   cargo run --release -p sieve-cuda --example bench_kernels -- kernels --shapes llama2-7b

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use sieve_cuda::bench::{FusedGroup, KernelBenchOptions, KernelFormat};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "bench_kernels")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Time the GPU kernels of every format against cuBLAS on LLaMA layer shapes (see
    /// `sieve bench kernels --help` for the flags).
    Kernels(Args),
}

/// The CLI's flags; each one left out takes [`KernelBenchOptions::default`]'s value, so the
/// example cannot drift from the library's (and the CLI's, which a CLI test holds to them).
#[derive(clap::Args)]
struct Args {
    #[arg(long, value_delimiter = ',')]
    shapes: Option<Vec<String>>,
    #[arg(long, value_delimiter = ',')]
    sp: Option<Vec<f64>>,
    #[arg(long, value_delimiter = ',')]
    dp: Option<Vec<f64>>,
    #[arg(long, value_delimiter = ',')]
    formats: Option<Vec<KernelFormat>>,
    #[arg(long)]
    reps: Option<usize>,
    #[arg(long)]
    stages: bool,
    #[arg(long)]
    tune: bool,
    #[arg(long)]
    rlc_block_rows: Option<usize>,
    #[arg(long)]
    rlc_cols: Option<usize>,
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long)]
    plot: Option<PathBuf>,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    graph: bool,
    #[arg(long)]
    graph_launches: Option<usize>,
    #[arg(long)]
    graph_replays: Option<usize>,
    #[arg(long, value_delimiter = ',')]
    fused: Option<Vec<FusedGroup>>,
    #[arg(long)]
    fused_only: bool,
}

fn main() -> Result<()> {
    let Command::Kernels(a) = Cli::parse().command;
    let d = KernelBenchOptions::default();
    let opts = KernelBenchOptions {
        shapes: a.shapes.unwrap_or(d.shapes),
        sp: a.sp.unwrap_or(d.sp),
        dp: a.dp.unwrap_or(d.dp),
        formats: a.formats.unwrap_or(d.formats),
        reps: a.reps.unwrap_or(d.reps),
        stages: a.stages,
        tune: a.tune,
        rlc_block_rows: a.rlc_block_rows.unwrap_or(d.rlc_block_rows),
        rlc_cols: a.rlc_cols.unwrap_or(d.rlc_cols),
        seed: a.seed.unwrap_or(d.seed),
        graph: a.graph,
        graph_launches: a.graph_launches.unwrap_or(d.graph_launches),
        graph_replays: a.graph_replays.unwrap_or(d.graph_replays),
        fused: a.fused.unwrap_or(d.fused),
        fused_only: a.fused_only,
    };
    let report = sieve_cuda::bench::run(&opts, &mut |line| eprintln!("{line}"))
        .context("bench_kernels (needs a CUDA GPU)")?;
    print!("{}", report.markdown());
    report.write_outputs(a.json.as_deref(), a.plot.as_deref())?;
    report.check_correct()?;
    Ok(())
}
