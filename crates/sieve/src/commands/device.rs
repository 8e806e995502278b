//! `--device auto|cuda|cpu`: where a model runs.

use anyhow::{Context, Result};
use sieve_cuda::Gpu;
use sieve_model::llama::{KvPrecision, Model};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// The GPU when one is usable, else the CPU.
    Auto,
    Cuda,
    Cpu,
}

/// `--kv-cache f16|int8`: what the KV cache stores ([`sieve_formats::kv_cache`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCache {
    /// f16 keys and values.
    #[default]
    F16,
    /// i8 keys and values with one f32 scale per position and KV head: 0.53x the bytes at
    /// head_dim 64.
    Int8,
}

impl KvCache {
    pub fn precision(self) -> KvPrecision {
        match self {
            KvCache::F16 => KvPrecision::F16,
            KvCache::Int8 => KvPrecision::Int8,
        }
    }
}

/// `--activations f16|int8`: what the GPU's 4-bit products multiply their weights with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Activations {
    /// f16 inputs, the weights dequantized in registers (W4A16).
    #[default]
    F16,
    /// Each token's input quantized to INT8 with one scale per 128 columns, multiplied on the integer tensor
    /// cores (W4A8), for W4A16 g128 and GGUF Q4_0 matrices; other kinds stay on f16.
    Int8,
}

impl Activations {
    pub fn int8(self) -> bool {
        self == Activations::Int8
    }
}

/// `--prompt-precision f16|int8|fp8`: what a GPU prompt pass of 512 tokens or more multiplies
/// its dense and SlideSparse matrices in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum PromptPrecision {
    /// f16 weights and inputs (cuBLAS, or each format's own path).
    #[default]
    F16,
    /// W8A8: dense matrices also kept as INT8 codes (one scale per row, cuBLASLt), SlideSparse
    /// ones compressed by cuSPARSELt in INT8; each token's input quantized with one scale.
    Int8,
    /// The same in FP8 (e4m3).
    Fp8,
    /// f16, with the f16 copy that a prompt pass multiplies kept in GPU memory for every
    /// sparse or low-bit layer matrix (decoded once at upload, not once per pass): the dense
    /// model's time to first token, at 2 more bytes per weight.
    #[value(name = "f16-resident")]
    F16Resident,
}

impl PromptPrecision {
    /// Whether the f16 prompt copies stay resident ([`sieve_gpu::matrix::Layouts::prompt16`]).
    pub fn resident_f16(self) -> bool {
        self == PromptPrecision::F16Resident
    }
    pub fn eight_bit(self) -> Option<sieve_cuda::cusparselt::LtPrecision> {
        use sieve_cuda::cusparselt::LtPrecision;
        match self {
            PromptPrecision::F16 | PromptPrecision::F16Resident => None,
            PromptPrecision::Int8 => Some(LtPrecision::Int8),
            PromptPrecision::Fp8 => Some(LtPrecision::E4m3),
        }
    }
}

/// `--step auto|graph|persistent`: how a GPU decode step runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Step {
    /// The faster of the two, timed on the model at load (32 steps of each midway through
    /// the context: a few ms to a few hundred ms); graph where the persistent step cannot run the model.
    #[default]
    Auto,
    /// A CUDA graph of the plan's kernels (every format).
    Graph,
    /// One persistent kernel for the whole step (dense f16 weights, f16 KV cache).
    Persistent,
}

/// Sets `m`'s decode step as `step` asks; `persistent` on a model it cannot run is an error
/// naming why, `auto` says on stderr which it took.
pub fn apply_step(m: &mut sieve_gpu::GpuModel, step: Step) -> Result<()> {
    use sieve_gpu::runner::StepMode;
    match step {
        Step::Graph => m.set_step_mode(StepMode::Graph)?,
        Step::Persistent => m
            .set_step_mode(StepMode::Persistent)
            .context("--step persistent")?,
        Step::Auto => {
            let choice = m
                .choose_step(32)
                .context("--step auto: timing the two steps")?;
            eprintln!("{}", choice.describe());
        }
    }
    Ok(())
}

/// `model` on `gpu` with a KV cache of `capacity` positions storing what the model is set to
/// ([`Model::set_kv_precision`]).
pub fn upload(
    gpu: Gpu,
    model: &Model,
    capacity: usize,
    activations: Activations,
    prompt: PromptPrecision,
) -> Result<sieve_gpu::GpuModel> {
    upload_with(gpu, model, capacity, layouts(activations, prompt))
}

/// What the upload keeps beside each matrix for `--activations` and `--prompt-precision`.
pub fn layouts(activations: Activations, prompt: PromptPrecision) -> sieve_gpu::matrix::Layouts {
    sieve_gpu::matrix::Layouts {
        int8_activations: activations.int8(),
        prompt8: prompt.eight_bit(),
        prompt16: prompt.resident_f16(),
        ..Default::default()
    }
}

/// [`upload`] keeping what `layouts` asks for beside each matrix (batched steps: the
/// tensor-core layout of column-major 4-bit matrices).
pub fn upload_with(
    gpu: Gpu,
    model: &Model,
    capacity: usize,
    layouts: sieve_gpu::matrix::Layouts,
) -> Result<sieve_gpu::GpuModel> {
    Ok(sieve_gpu::GpuModel::from_model_with_layouts(
        gpu,
        model,
        capacity,
        model.kv_precision(),
        layouts,
    )?)
}

/// The GPU to run on, or `None` for the CPU. `--device cuda` without a usable GPU is an error;
/// `auto` says on stderr why it fell back.
pub fn open(device: Device) -> Result<Option<Gpu>> {
    match device {
        Device::Cpu => Ok(None),
        Device::Cuda => Gpu::new(0)
            .map(Some)
            .context("--device cuda: no usable GPU (--device cpu runs on the CPU)"),
        Device::Auto => match Gpu::new(0) {
            Ok(g) => Ok(Some(g)),
            Err(e) => {
                eprintln!("device: cpu ({e})");
                Ok(None)
            }
        },
    }
}

/// Prints the upload report of a GPU model on stderr.
pub fn print_report(model: &sieve_gpu::GpuModel) {
    let r = model.report();
    eprintln!(
        "device: {} ({:.2} GB of weights, {:.2} GB {} KV cache, {} launches per step in one CUDA graph)",
        model.gpu().info().name,
        r.weight_bytes as f64 / 1e9,
        r.kv_cache_bytes as f64 / 1e9,
        r.kv_precision,
        r.launches_per_step
    );
    for note in &r.notes {
        eprintln!("note: {note}");
    }
}

/// What a split model holds on each GPU and sends per token, on stderr.
pub fn print_split_report(split: &sieve_gpu::tensor_parallel::TensorParallelGpu) {
    let r = split.report();
    let per_rank: Vec<String> = (0..r.world)
        .map(|i| {
            format!(
                "{:.2} + {:.2}",
                r.rank_weight_bytes[i] as f64 / 1e9,
                r.rank_kv_bytes[i] as f64 / 1e9
            )
        })
        .collect();
    eprintln!(
        "tensor parallel: {} GPUs, GB of weights + KV cache per rank {}; {} all-reduces a token, \
         {} bytes sent per rank",
        r.world,
        per_rank.join(", "),
        r.volume.all_reduces,
        r.volume.bytes_sent_per_rank
    );
}
