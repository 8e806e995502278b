//! `sieve generate`: stream text from a model.

use anyhow::{Context, Result};
use clap::Args;
use sieve_model::chat::{render_chat, ChatMessage};
use sieve_model::generate::{generate, run_in_pool, GenerateOptions};
use sieve_model::sampling::SamplingParams;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args)]
pub struct GenerateArgs {
    /// Model file or directory (default: $SIEVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Render the prompt as a user turn with the model's chat template (ChatML).
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// 0 keeps every token.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Stop before this string (repeatable).
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Dequantize GGUF Q4_0/Q4_1/Q8_0 weights to f16 instead of multiplying the blocks directly.
    #[arg(long)]
    f16_weights: bool,
    /// Where to run: the GPU when one is present (auto), the GPU (cuda) or the CPU.
    #[arg(long, value_enum, default_value_t = super::device::Device::Auto)]
    device: super::device::Device,
    /// What the KV cache stores: f16, or int8 (one scale per position and KV head).
    #[arg(long, value_enum, default_value_t = super::device::KvCache::F16)]
    kv_cache: super::device::KvCache,
    /// What 4-bit matrices multiply: f16 inputs, or int8 (each token's input quantized with
    /// one scale per 128 columns: W4A8 on the GPU; on the CPU every layer's inputs are rounded the same way).
    #[arg(long, value_enum, default_value_t = super::device::Activations::F16)]
    activations: super::device::Activations,
    /// What GPU prompt passes of 512 tokens or more multiply in: f16, or W8A8 (int8 or fp8:
    /// dense and SlideSparse matrices also kept in 8 bits, each token's input quantized);
    /// f16-resident keeps the f16 copy every prompt pass of a sparse or low-bit matrix
    /// multiplies, decoded once at upload instead of once per pass (2 more bytes a weight).
    #[arg(long, value_enum, default_value_t = super::device::PromptPrecision::F16)]
    prompt_precision: super::device::PromptPrecision,
    /// How a GPU decode step runs: one persistent kernel (dense f16 and Tiled-CBC models with
    /// the f16 cache; Balanced-CBC with SIEVE_PERSISTENT_BCBC=1), a CUDA graph of kernels, or
    /// auto (the faster, if its logits agree: graph, as measured so far).
    #[arg(long, value_enum, default_value_t = super::device::Step::Auto)]
    step: super::device::Step,
    /// Split the model over N ranks (tensor parallelism: heads and MLP columns per rank, two
    /// all-reduces per layer): over N GPUs of this machine through NCCL (the LM head on every
    /// GPU), or with --device cpu the CPU reference of the split (the ranks one after another,
    /// vocabulary rows split too; for checking, not for speed).
    #[arg(long, default_value_t = 1)]
    tensor_parallel: usize,
    /// CPU: print where a decode step's time goes (wall time per phase of the forward pass).
    #[arg(long)]
    profile: bool,
    prompt: String,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    if args.tensor_parallel != 1 && args.step == super::device::Step::Persistent {
        anyhow::bail!(
            "--tensor-parallel {} runs the graph step: the persistent step has no all-reduce",
            args.tensor_parallel
        );
    }
    if args.device == super::device::Device::Cpu
        && args.prompt_precision != super::device::PromptPrecision::F16
    {
        anyhow::bail!(
            "--prompt-precision {}: the GPU's prompt passes take it, --device cpu runs the CPU's",
            clap::ValueEnum::to_possible_value(&args.prompt_precision)
                .map(|v| v.get_name().to_string())
                .unwrap_or_default()
        );
    }
    // Everything runs on a pool worker (see `run_in_pool`).
    run_in_pool(args.threads, move || run_on_pool(args))?
}

fn run_on_pool(args: GenerateArgs) -> Result<()> {
    let path = super::model_path::resolve_model(args.model.as_deref())?;
    // `.sieve` files (by magic) and every other model layout.
    let (mut model, tokenizer) =
        sieve_model::packed::load_model_and_tokenizer_with(&path, args.f16_weights)
            .with_context(|| format!("opening {}", path.display()))?;
    model.set_kv_precision(args.kv_cache.precision());

    let (text, add_bos) = if args.chat {
        let rendered = render_chat(
            tokenizer.chat_template(),
            &[ChatMessage::user(args.prompt.clone())],
            true,
        )?;
        if let Some(w) = rendered.warning {
            eprintln!("warning: {w}");
        }
        // The template writes any BOS it wants itself.
        (rendered.text, false)
    } else {
        (args.prompt.clone(), tokenizer.add_bos_by_default())
    };
    let prompt = tokenizer.encode(&text, add_bos)?;
    let options = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: sieve_model::sampling::top_p_from_f64(args.top_p),
            repetition_penalty: args.repetition_penalty,
            seed: args.seed,
        },
        stop_strings: args.stop,
        extra_eos_ids: Vec::new(),
    };
    let mut stdout = std::io::stdout();
    let split_on_gpus = args.tensor_parallel != 1
        && match args.device {
            super::device::Device::Cpu => false,
            super::device::Device::Cuda => true,
            super::device::Device::Auto => match sieve_cuda::gpu::device_count() {
                Ok(n) if n > 0 => true,
                other => {
                    eprintln!("device: cpu (no GPU: {other:?})");
                    false
                }
            },
        };
    if split_on_gpus {
        let capacity = prompt.len().saturating_add(args.max_tokens);
        let layouts = super::device::layouts(args.activations, args.prompt_precision);
        let mut split = sieve_gpu::tensor_parallel::TensorParallelGpu::new(
            &model,
            args.tensor_parallel,
            capacity,
            model.kv_precision(),
            layouts,
        )?;
        drop(model);
        super::device::print_split_report(&split);
        let result = sieve_gpu::generate::generate_split(
            &mut split,
            &tokenizer,
            &prompt,
            &options,
            |piece| gpu_print(&mut stdout, piece),
        )?;
        println!();
        eprintln!("{}", result.summary());
        return Ok(());
    }
    if let Some(gpu) = super::device::open(args.device)? {
        let capacity = prompt.len().saturating_add(args.max_tokens);
        let mut gpu_model = super::device::upload(
            gpu,
            &model,
            capacity,
            args.activations,
            args.prompt_precision,
        )?;
        drop(model);
        super::device::apply_step(&mut gpu_model, args.step)?;
        super::device::print_report(&gpu_model);
        let result = sieve_gpu::generate::generate(
            &mut gpu_model,
            &tokenizer,
            &prompt,
            &options,
            |piece| gpu_print(&mut stdout, piece),
        )?;
        println!();
        eprintln!("{}", result.summary());
        return Ok(());
    }
    // The CPU rounds the layers' inputs as the GPU's W4A8 kernels would.
    model.set_int8_inputs(args.activations.int8());
    sieve_model::llama::phases::enable(args.profile);
    let print = |piece: &str| {
        stdout
            .write_all(piece.as_bytes())
            .and_then(|_| stdout.flush())
            .map_err(|e| sieve_model::ModelError::Io {
                path: "stdout".into(),
                source: e,
            })
    };
    let result = if args.tensor_parallel != 1 {
        use sieve_model::llama::tensor_parallel::{self, CommVolume, TensorParallelModel};
        let tp = TensorParallelModel::shard(&model, args.tensor_parallel)?;
        let layout = tp.layout();
        let comm = CommVolume::per_token(model.config(), layout.world, 4);
        let mb: Vec<String> = tp
            .rank_weight_bytes()
            .iter()
            .map(|b| format!("{:.1}", *b as f64 / 1e6))
            .collect();
        eprintln!(
            "tensor parallel: {} ranks (CPU reference, run one after another), {} query heads \
             and {} KV heads each; MB per rank {}; per token {} all-reduces of {} values, {} \
             bytes sent per rank (ring, f32)",
            layout.world,
            layout.heads,
            layout.kv_heads,
            mb.join(", "),
            comm.all_reduces,
            comm.values_per_all_reduce,
            comm.bytes_sent_per_rank
        );
        tensor_parallel::generate(&tp, &tokenizer, &prompt, &options, print)?
    } else {
        generate(&model, &tokenizer, &prompt, &options, print)?
    };
    println!();
    eprintln!("{}", result.stats.summary());
    if args.profile {
        print_profile(result.stats.decode_steps, result.stats.decode_seconds);
    }
    Ok(())
}

/// Writes a piece of generated text as it comes (the GPU loops' `on_text`).
fn gpu_print(stdout: &mut std::io::Stdout, piece: &str) -> sieve_gpu::Result<()> {
    stdout
        .write_all(piece.as_bytes())
        .and_then(|_| stdout.flush())
        .map_err(|e| {
            sieve_gpu::GpuError::from(sieve_model::ModelError::Io {
                path: "stdout".into(),
                source: e,
            })
        })
}

/// The decode steps' time per phase (`--profile`), per token and as shares of the step.
fn print_profile(steps: usize, seconds: f64) {
    let steps = steps.max(1) as f64;
    let totals = sieve_model::llama::phases::totals();
    let timed: f64 = totals.iter().map(|(_, s)| s).sum();
    eprintln!("decode step, per token ({steps} tokens):");
    for (phase, s) in totals {
        eprintln!(
            "  {:16} {:8.1} us  {:5.1}%",
            phase.name(),
            s / steps * 1e6,
            100.0 * s / timed.max(1e-12)
        );
    }
    eprintln!(
        "  {:16} {:8.1} us  (forward pass; the whole step incl. sampling {:.1} us)",
        "sum",
        timed / steps * 1e6,
        seconds / steps * 1e6
    );
}
