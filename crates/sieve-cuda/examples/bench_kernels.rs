//! `sieve bench kernels` without building the whole CLI (model loading, tokenizers): the same
//! code, compiled as an example of this crate, so that a GPU run needs only this crate.
//!
//!   cargo run --release -p sieve-cuda --example bench_kernels -- kernels --shapes llama2-7b

#[path = "../../sieve/src/commands/bench.rs"]
mod bench;

use clap::Parser;

#[derive(Parser)]
#[command(name = "bench_kernels")]
struct Cli {
    #[command(subcommand)]
    command: bench::BenchCommand,
}

fn main() -> anyhow::Result<()> {
    bench::run(Cli::parse().command)
}
