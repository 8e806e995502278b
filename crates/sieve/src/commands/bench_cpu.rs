//! `sieve bench cpu`: prefill and decode tokens/s of every given model in one run
//! (the measurement itself is `sieve_model::cpu_bench`).

use anyhow::{bail, Context, Result};
use clap::Args;
use sieve_model::cpu_bench::{self, BenchTarget, CpuBenchOptions};
use sieve_model::generate::run_in_pool;
use std::path::PathBuf;

use super::report_files::ReportFiles;

#[derive(Args, Debug)]
pub struct CpuArgs {
    /// A model to measure (repeatable; `.sieve`, GGUF or safetensors). Default: the default model.
    #[arg(long = "model")]
    models: Vec<PathBuf>,
    /// A GGUF model to measure with its weights dequantized to f16 (`--f16-weights`), repeatable.
    #[arg(long = "f16-model")]
    f16_models: Vec<PathBuf>,
    /// Worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Prompt length (tokens of a fixed English text) before decoding.
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Greedy decode steps timed after the prompt.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Rounds over all models (medians reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// KV cache precisions, each model measured with each (f16, int8).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "f16")]
    kv_cache: Vec<super::device::KvCache>,
    /// Also write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(args: CpuArgs) -> Result<()> {
    if args.threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    run_in_pool(args.threads, move || run_on_pool(args))?
}

fn run_on_pool(args: CpuArgs) -> Result<()> {
    let mut targets: Vec<BenchTarget> = args
        .models
        .iter()
        .map(|p| BenchTarget {
            path: p.clone(),
            f16_weights: false,
        })
        .collect();
    targets.extend(args.f16_models.iter().map(|p| BenchTarget {
        path: p.clone(),
        f16_weights: true,
    }));
    if targets.is_empty() {
        targets.push(BenchTarget {
            path: super::model_path::resolve_model(None)?,
            f16_weights: false,
        });
    }
    for t in &targets {
        if !t.path.exists() {
            bail!("model {} does not exist", t.path.display());
        }
    }
    let inputs: Vec<&std::path::Path> = targets.iter().map(|t| t.path.as_path()).collect();
    let mut files = ReportFiles::open(args.json.as_deref(), None, &inputs)?;
    let options = CpuBenchOptions {
        prompt_tokens: args.prompt_tokens,
        decode_tokens: args.decode_tokens,
        repeats: args.repeats,
        kv_caches: args.kv_cache.iter().map(|k| k.precision()).collect(),
    };
    let report = cpu_bench::run(&targets, &options, |name, p, d| {
        eprintln!("{name}: prefill {p:.1} tok/s, decode {d:.1} tok/s")
    })
    .context("sieve bench cpu")?;
    print!("{}", report.markdown());
    files.write_json(|| Ok(serde_json::to_string_pretty(&report)?))?;
    Ok(())
}

/// `sieve bench`'s subcommands: the GPU kernel one of [`super::bench`] and `cpu`.
#[derive(clap::Subcommand, Debug)]
pub enum AnyBench {
    #[command(flatten)]
    Gpu(super::bench::BenchCommand),
    /// Prefill and decode tokens/s of CPU models in one run (see `sieve_model::cpu_bench`).
    Cpu(CpuArgs),
}

pub fn run_any(cmd: AnyBench) -> Result<()> {
    match cmd {
        AnyBench::Gpu(c) => super::bench::run(c),
        AnyBench::Cpu(a) => run(a),
    }
}
