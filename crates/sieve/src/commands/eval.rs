//! `sieve eval ppl`: perplexity over a text file.

use anyhow::{Context, Result};
use clap::Subcommand;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use sieve_model::generate::{init_threads, perplexity, perplexity_per_token};
use std::path::PathBuf;

/// Evaluation text used when `--data` is not given, relative to the repository root.
/// WikiText-2's test split (`model_path::default_text` says where it is looked for).
const DEFAULT_DATA: &str = "test.txt";

#[derive(Subcommand)]
pub enum EvalCommand {
    /// Perplexity over non-overlapping windows of --ctx tokens; each window is scored on every
    /// position after its first token. Prints one JSON line.
    Ppl {
        /// Model file or directory (default: $SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Text file (default: WikiText-2 test, from $SIEVE_HOME/data/wikitext-2/).
        #[arg(long)]
        data: Option<PathBuf>,
        /// Window length in tokens.
        #[arg(long, default_value_t = 1024)]
        ctx: usize,
        /// Use only the first N tokens of the text (default: all).
        #[arg(long)]
        max_tokens: Option<usize>,
        /// Worker threads (default: one per core).
        #[arg(long)]
        threads: Option<usize>,
        /// Dequantize GGUF Q4_0/Q4_1/Q8_0 weights to f16 and multiply f32 activations (the dense
        /// model `sieve pack` prunes) instead of multiplying the blocks with 8-bit activations.
        #[arg(long)]
        f16_weights: bool,
        /// Where to run: the GPU when one is present (auto), the GPU (cuda) or the CPU.
        #[arg(long, value_enum, default_value_t = super::device::Device::Auto)]
        device: super::device::Device,
        /// What the KV cache stores: f16, or int8 (one scale per position and KV head).
        #[arg(long, value_enum, default_value_t = super::device::KvCache::F16)]
        kv_cache: super::device::KvCache,
        /// How a GPU decode step runs: persistent, graph, or auto (the faster: graph, as
        /// measured so far).
        #[arg(long, value_enum, default_value_t = super::device::Step::Auto)]
        step: super::device::Step,
        /// What 4-bit matrices multiply: f16 inputs, or int8 (each token's input quantized with
        /// one scale per 128 columns: W4A8 on the GPU; on the CPU every layer's inputs are rounded the same way,
        /// to measure what it costs).
        #[arg(long, value_enum, default_value_t = super::device::Activations::F16)]
        activations: super::device::Activations,
        /// On the CPU, run each window one token at a time (a decode step per position, as the
        /// GPU scores) instead of one batched forward per window. The GPU always does.
        #[arg(long)]
        per_token: bool,
    },
}

#[derive(Serialize)]
struct PplLine {
    model: String,
    data: String,
    /// Tokens scored (predictions), i.e. the text's tokens minus one per window.
    tokens: usize,
    ctx: usize,
    ppl: f64,
    /// What the KV cache stored.
    kv_cache: sieve_model::llama::KvPrecision,
    /// Mean negative log-likelihood per scored token, in nats.
    nll: f64,
}

pub fn run(command: EvalCommand) -> Result<()> {
    match command {
        EvalCommand::Ppl {
            model,
            data,
            ctx,
            max_tokens,
            threads,
            f16_weights,
            device,
            kv_cache,
            step,
            activations,
            per_token,
        } => {
            if let Some(n) = threads {
                init_threads(n)?;
            }
            let data = match data {
                Some(d) => d,
                None => super::model_path::default_text(DEFAULT_DATA).context("no --data given")?,
            };
            let path = super::model_path::resolve_model(model.as_deref())?;
            // `.sieve` files (by magic) and every other model layout.
            let (mut model, tokenizer) =
                sieve_model::packed::load_model_and_tokenizer_with(&path, f16_weights)
                    .with_context(|| format!("opening {}", path.display()))?;
            model.set_kv_precision(kv_cache.precision());
            sieve_model::generate::check_window(model.config(), ctx)?;
            // Read and tokenized in chunks up to --max-tokens, not the whole file first.
            let tokens = tokenizer
                .encode_file(&data, tokenizer.add_bos_by_default(), max_tokens)
                .with_context(|| format!("reading {}", data.display()))?;
            let bar = ProgressBar::new(tokens.len() as u64);
            bar.set_style(
                ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} tokens [{elapsed_precise} < {eta_precise}] {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            let progress = |done: usize, running_ppl: f64| {
                bar.set_position(done as u64);
                bar.set_message(format!("ppl {running_ppl:.3}"));
            };
            let result = match super::device::open(device)? {
                Some(gpu) => {
                    let mut gpu_model = super::device::upload(
                        gpu,
                        &model,
                        ctx,
                        activations,
                        // The GPU scores a window a decode step per position: no prompt pass.
                        super::device::PromptPrecision::F16,
                    )?;
                    drop(model);
                    super::device::apply_step(&mut gpu_model, step)?;
                    super::device::print_report(&gpu_model);
                    sieve_gpu::generate::perplexity(&mut gpu_model, &tokens, ctx, progress)?
                }
                None => {
                    // The CPU rounds the layers' inputs as the GPU's W4A8 kernels would.
                    model.set_int8_inputs(activations.int8());
                    if per_token {
                        perplexity_per_token(&model, &tokens, ctx, progress)?
                    } else {
                        perplexity(&model, &tokens, ctx, progress)?
                    }
                }
            };
            bar.finish_and_clear();
            let line = PplLine {
                model: path.display().to_string(),
                data: data.display().to_string(),
                tokens: result.scored_tokens,
                ctx,
                ppl: result.perplexity(),
                kv_cache: kv_cache.precision(),
                nll: result.mean_nll(),
            };
            println!("{}", serde_json::to_string(&line)?);
            Ok(())
        }
    }
}
