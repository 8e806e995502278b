//! [`GpuModel`]: a Llama-family decoder resident on the GPU, one token per step.
//!
//! A step is a fixed sequence of launches ([`Op`]) that reads everything that changes from
//! token to token (position, token id, sequence length) from device memory, so it is captured
//! once in a CUDA graph and replayed; the sampler at its end writes the next token where the
//! next step's embedding reads it, and the host reads one 8-byte state per token.
//!
//! ```text
//! embed(state.token) -> x
//! per layer:  norm(x) -> xn, zero qkv | qkv += Wqkv.mask(xn) | rope + KV write | attention -> att
//!             x += Wo.mask(att) | norm(x) -> xn, zero gu | gu += Wgu.mask(xn) | h = silu(g)*u
//!             x += Wdown.mask(h)
//! norm(x) -> xn, zero logits | logits += Whead.xn | sample -> state (or: forced next token)
//! ```

use crate::error::{GpuError, Result};
use crate::kv_cache::DeviceKvCache;
use crate::matrix::{DeviceLinear, HostMatrix, Layouts};
use cudarc::driver::CudaSlice;
use half::f16;
use sieve_cuda::attention::{self, AttentionShape};
use sieve_cuda::collective::Communicator;
use sieve_cuda::graph::StepGraph;
use sieve_cuda::lowbit::LowBitMatrix;
use sieve_cuda::prefill::{embed_rows, rmsnorm_rows, silu_rows, Rows};
use sieve_cuda::sampling::{self, SampleArgs};
use sieve_cuda::timing::EventPair;
use sieve_cuda::{dev_ptr, rope, step, DevPtr, DriverContext, Gpu, KvCache, KvPrecision, L2Span};
use sieve_formats::{FormatKind, Threshold};
use sieve_model::config::ModelConfig;
use sieve_model::llama::Model;
use sieve_model::plan::{self, BlockSupport, Capabilities, Group, LayerOp, Norm, Plan, StepOp};
use sieve_model::sampling::SamplingParams;

mod persistent;
pub use persistent::{stages_of, StepChoice, StepMode};

/// One decoder layer as the runner uploads it.
pub struct HostLayer {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    /// q, k, v in that order.
    pub qkv: Vec<(HostMatrix, Threshold)>,
    /// The concatenated q|k|v bias (Qwen2), if any.
    pub qkv_bias: Option<Vec<f32>>,
    pub o: (HostMatrix, Threshold),
    /// gate, up in that order.
    pub gate_up: Vec<(HostMatrix, Threshold)>,
    pub down: (HostMatrix, Threshold),
    /// The format the weights go to the device in.
    pub kind: FormatKind,
}

struct DeviceLayer {
    input_norm: CudaSlice<f32>,
    post_norm: CudaSlice<f32>,
    qkv: DeviceLinear,
    qkv_bias: Option<CudaSlice<f32>>,
    o: DeviceLinear,
    gate_up: DeviceLinear,
    down: DeviceLinear,
}

/// Where a launch's time is counted in the step breakdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Category {
    Linear,
    Attention,
    Other,
}

/// A subset of the decode step, for graph-mode breakdowns ([`GpuModel::time_step_part`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepPart {
    All,
    LinearOnly,
    NoLinear,
    NoAttention,
    /// Everything but one op of every layer: the step's time without it, so that the
    /// difference is what that op costs inside the graph, overlap with its neighbours
    /// included (a per-kernel time under a profiler is not: launches there are serialized).
    Without(LayerOp),
    /// Everything but the final RMSNorm and the LM head.
    WithoutHead,
}

impl StepPart {
    /// Whether `op` is part of this subset (the next-token op always is).
    fn keeps(self, op: Op) -> bool {
        match (self, op) {
            (_, Op::Next(_)) | (StepPart::All, _) => true,
            (StepPart::LinearOnly, op) => op.category() == Category::Linear,
            (StepPart::NoLinear, op) => op.category() != Category::Linear,
            (StepPart::NoAttention, op) => op.category() != Category::Attention,
            (StepPart::Without(left_out), Op::Plan(StepOp::Layer(_, k))) => k != left_out,
            (StepPart::Without(_), _) => true,
            (StepPart::WithoutHead, Op::Plan(StepOp::FinalNorm | StepOp::LmHead)) => false,
            (StepPart::WithoutHead, _) => true,
        }
    }
}

/// One group of launches of a decode step: an op of the model's plan
/// (`sieve_model::plan::step_ops`, whose order this runner does not restate), or the step's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    /// An op of the plan other than [`StepOp::Next`].
    Plan(StepOp),
    /// Sample the next token, or (false) take the next one from the history.
    Next(bool),
}

impl Op {
    fn category(self) -> Category {
        match self {
            Op::Plan(StepOp::Layer(_, LayerOp::Product(_)) | StepOp::LmHead) => Category::Linear,
            Op::Plan(StepOp::Layer(_, LayerOp::RopeKv | LayerOp::Attention)) => Category::Attention,
            _ => Category::Other,
        }
    }
}

/// What [`GpuModel::check_span`] checks, from the pool's shape alone (so a split model's
/// driver checks a span as each rank would): the slot, the positions, the token ids.
pub fn check_span_of(
    slots: usize,
    capacity: usize,
    vocab: usize,
    slot: usize,
    start: usize,
    tokens: &[u32],
) -> Result<()> {
    check_slot_of(slots, slot)?;
    if start + tokens.len() > capacity {
        return Err(sieve_model::ModelError::ContextOverflow {
            tokens: start + tokens.len(),
            context: capacity,
        }
        .into());
    }
    check_vocabulary(vocab, tokens)
}

fn check_slot_of(slots: usize, slot: usize) -> Result<()> {
    if slot >= slots {
        return Err(GpuError::InvalidArgument(format!(
            "slot {slot} does not exist (the pool has {slots})"
        )));
    }
    Ok(())
}

fn check_vocabulary(vocab: usize, tokens: &[u32]) -> Result<()> {
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(GpuError::InvalidArgument(format!(
            "token id {bad} is outside the vocabulary of {vocab}"
        )));
    }
    Ok(())
}

/// A GGUF matrix's blocks as the low-bit kernels' integers and scales (repacked, never
/// dequantized): every block type the CPU loads has a kernel kind.
pub fn low_bit_of_blocks(q: &sieve_cpu::gguf_blocks::QuantMatrix) -> Result<LowBitMatrix> {
    use sieve_formats::WeightFormat;
    let ty = format!("{:?}", q.block_type());
    Ok(LowBitMatrix::from_gguf(
        &ty,
        q.rows(),
        q.cols(),
        q.blocks(),
    )?)
}

/// The SlideSparse matrix behind `f`, when `f` is one (a pack's slide layers load as the
/// format's own type).
pub fn slide_source(f: &dyn sieve_formats::WeightFormat) -> Option<&sieve_formats::slide::Slide> {
    f.as_any()?.downcast_ref()
}

/// What this runner executes of a plan (checked before anything is uploaded).
pub const GPU_CAPABILITIES: Capabilities = Capabilities {
    backend: "cuda",
    formats: &[
        FormatKind::Dense,
        FormatKind::TiledCbc,
        FormatKind::RlcCsc,
        FormatKind::BalancedCbc,
        FormatKind::IeBme,
        FormatKind::Slide,
    ],
    blocks: BlockSupport::NativeFor(&[
        "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
    ]),
    bias_groups: &[Group::Qkv],
    mixed_formats_in_layer: false,
};

/// Device buffers of a step (see sieve-cuda's `kernels/step.cu` for the layouts).
struct Buffers {
    x: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    att: CudaSlice<f32>,
    gu: CudaSlice<f32>,
    h: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    part: CudaSlice<f32>,
    /// The KV cache pool (`crate::kv_cache`): every slot's, every layer's.
    kv: DeviceKvCache,
    rope_cos: CudaSlice<f32>,
    rope_sin: CudaSlice<f32>,
    /// `[position, token]`.
    state: CudaSlice<i32>,
    /// Token at every position (prompt and generated), `capacity` entries.
    history: CudaSlice<i32>,
}

/// Time and bytes of one profiled (eager, event-bracketed) step.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StepProfile {
    pub linear_us: f64,
    pub attention_us: f64,
    pub other_us: f64,
    /// Weight (and metadata) bytes the products read for this step's activations.
    pub weight_bytes: usize,
    pub launches: usize,
}

impl StepProfile {
    pub fn total_us(&self) -> f64 {
        self.linear_us + self.attention_us + self.other_us
    }
}

/// GPU time of one batched prefill by kind of work (CUDA events between the launch groups,
/// summed over layers), and of the last row's logits and sampling.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PrefillProfile {
    /// Prompt tokens in the batched pass.
    pub batched_tokens: usize,
    /// (kind of work, µs over every layer), in the layer's order.
    pub by_op: Vec<(&'static str, f64)>,
    /// The last row's logits and the sampler (final norm, LM head, sampling).
    pub head_us: f64,
}

impl PrefillProfile {
    pub fn total_us(&self) -> f64 {
        self.by_op.iter().map(|(_, us)| us).sum::<f64>() + self.head_us
    }
}

/// What the runner says about the model it uploaded (printed by the CLI).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct UploadReport {
    /// Bytes of weights (with format metadata) on the device.
    pub weight_bytes: usize,
    /// Bytes of the KV cache pool (K and V, every slot; the 8-bit cache's scales included).
    pub kv_cache_bytes: usize,
    /// How the KV cache stores keys and values.
    pub kv_precision: KvPrecision,
    /// Kernel of each projection group, e.g. `q|k|v: tiled-cbc/lane8`.
    pub kernels: Vec<String>,
    pub notes: Vec<String>,
    /// Launches of one decode step.
    pub launches_per_step: usize,
}

/// The sampler kernel's arguments for `p` (validated by `SamplingParams::validate`): greedy
/// parameters as temperature 0, the CPU loop's repetition window.
pub fn sample_args(p: &SamplingParams) -> SampleArgs {
    SampleArgs {
        temperature: if p.is_greedy() { 0.0 } else { p.temperature },
        top_k: p.top_k,
        top_p: p.top_p,
        repetition_penalty: p.repetition_penalty,
        window: sieve_model::generate::REPETITION_WINDOW,
        seed: p.seed,
    }
}

pub struct GpuModel {
    gpu: Gpu,
    config: ModelConfig,
    capacity: usize,
    layers: Vec<DeviceLayer>,
    embed: CudaSlice<f16>,
    final_norm: CudaSlice<f32>,
    lm_head: DeviceLinear,
    attention: AttentionShape,
    bufs: Buffers,
    sample: SampleArgs,
    /// Captured steps: `[forced, sampled]`, each valid for the sampling arguments it was
    /// captured with.
    graphs: [Option<(StepGraph, SampleArgs)>; 2],
    use_graphs: bool,
    /// Capture the step with programmatic edges between its kernels (sieve_cuda::graph).
    pdl: bool,
    /// Bytes of the next product's weights that RMSNorm, RoPE and SwiGLU ask L2 for (0: none;
    /// see [`Self::set_l2_prefetch`]).
    l2_prefetch: usize,
    report: UploadReport,
    /// Tokens in the cache (positions processed).
    len: usize,
    /// Scratch of the batched prefill, allocated at its first use.
    prefill_bufs: Option<crate::prefill::PrefillBuffers>,
    /// Tokens per batched pass ([`crate::prefill::chunk_setting`]).
    prefill_chunk: usize,
    /// Run prompts through cuBLAS GEMMs (else token by token through the decode step).
    batched_prefill: bool,
    /// KV cache slots (one sequence each, [`Self::with_slots`]); the generation path uses 0.
    slots: usize,
    /// The slot whose cache the launches address now.
    slot: usize,
    /// Per slot, the captured step that ends at the logits (the serving path).
    slot_graphs: Vec<Option<StepGraph>>,
    /// Scratch of the many-sequence step ([`Self::step_slots`]), allocated at its first use.
    seq_bufs: Option<SequenceBuffers>,
    /// Captured many-sequence steps by bucket (2^i rows, i = 1..=6), and which buckets have
    /// run once eagerly.
    seq_graphs: [Option<StepGraph>; 7],
    seq_warm: [bool; 7],
    /// How [`Self::run_step`] runs a step.
    step_mode: StepMode,
    /// The persistent step and the slot whose cache it addresses, built at its first use.
    persistent: Option<(sieve_cuda::persistent::PersistentStep, usize)>,
    /// Stamp the persistent step's stages ([`Self::persistent_trace`]).
    persistent_trace: bool,
    /// This model's rank when it is one shard of a tensor-parallel model
    /// ([`Self::set_tensor_parallel`]).
    tp: Option<Communicator>,
}

/// Scratch of a decode step over several sequences: their `[position, slot]` pairs and their
/// logits, [`MAX_SEQUENCES`] rows.
struct SequenceBuffers {
    seqs: CudaSlice<i32>,
    logits: CudaSlice<f32>,
    /// Each row's token ([`GpuModel::step_slots_argmax`], [`GpuModel::step_slots_sampled`]).
    chosen: CudaSlice<i32>,
    /// Each row's sampling arguments and penalty window ([`GpuModel::step_slots_sampled`]).
    sample_args: CudaSlice<sampling::SampleRowArgs>,
    recent: CudaSlice<i32>,
}

/// Where the rows of a batched pass belong ([`GpuModel::rows_through_layers`]).
#[derive(Clone, Copy, Debug)]
enum PassRows<'a> {
    /// Runs of consecutive prompt tokens, each of one slot, in row order: one prompt chunk,
    /// or the chunks of several prompts in one pass ([`GpuModel::extend_slots`]).
    Spans(&'a [PassSpan]),
    /// One next token per sequence of a decode step: `seqs` holds `[position, slot]` per row
    /// ([`Rows::Sequences`]).
    Sequences { seqs: DevPtr, slot_stride: usize },
}

/// Rows `row .. row + len` of a batched pass: slot `slot`'s tokens at positions `first ..`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PassSpan {
    slot: usize,
    first: usize,
    row: usize,
    len: usize,
}

impl PassRows<'_> {
    /// Refuses spans that do not tile rows `0..n` in order (a caller's bug, checked before a
    /// launch writes where no row belongs).
    fn check(&self, n: usize) -> Result<()> {
        let PassRows::Spans(spans) = self else {
            return Ok(());
        };
        let mut next = 0;
        for s in spans.iter() {
            if s.row != next || s.len == 0 {
                return Err(GpuError::InvalidArgument(format!(
                    "a pass's spans do not tile its {n} rows: {spans:?}"
                )));
            }
            next += s.len;
        }
        if next != n {
            return Err(GpuError::InvalidArgument(format!(
                "a pass's spans hold {next} rows, not its {n}"
            )));
        }
        Ok(())
    }
}

/// One sequence's prompt chunk of [`GpuModel::extend_slots`]: `tokens` into slot `slot` at
/// positions `start ..`, with the logits after its last token when `logits`.
#[derive(Clone, Copy, Debug)]
pub struct SlotChunk<'a> {
    pub slot: usize,
    pub start: usize,
    pub tokens: &'a [u32],
    pub logits: bool,
}

/// Tokens of a sequence's repetition-penalty window the device sampler takes (the CPU
/// sampler's window).
const SAMPLE_WINDOW: usize = sieve_model::generate::REPETITION_WINDOW;

/// Sequences one batched decode launch sequence takes (larger batches run in parts).
pub const MAX_SEQUENCES: usize = 64;
// The many-sequence step runs through the batched pass's scratch.
const _: () = assert!(MAX_SEQUENCES <= crate::prefill::MIN_CHUNK);

/// Sequences from which a step of a model with Tiled-CBC matrices runs as one batched pass,
/// measured: the pass decodes each matrix to f16 and runs cuBLAS, 23.4 ms a step for the 7B
/// shape at sp 0.5 / dp 0.5 whatever the batch (5 to 16 sequences), where one sequence's own
/// step takes 2.66 ms, so the pass pays from 9 sequences (H200, 2026-12-05, `sieve bench
/// decode --batch`; docs/BENCHMARKS.md).
pub const DECODED_MIN_BATCH: usize = 9;

/// Sequences from which a step of a model whose Tiled-CBC matrices the SpMM multiplies
/// (`tcbc_spmm`, no decoding) runs as one batched pass, measured on the 7B shape at sp 0.5 /
/// dp 0.5: one pass 7.56 ms for 2 sequences and 7.86 ms for 8, where one sequence's own step
/// takes 3.02 ms (H100, 2026-12-05, `sieve bench decode --batch`).
pub const SPMM_MIN_BATCH: usize = 3;

/// Most sequences `sieve bench decode --batch` asks for (a sanity bound on user input; the
/// memory check of [`GpuModel::set_slots`] decides what fits).
pub const MAX_BATCH_SLOTS: usize = 1024;

impl GpuModel {
    /// Uploads a model loaded by the CPU loaders (GGUF, safetensors, `.sieve` pack) with a KV
    /// cache for `capacity` positions (capped at the model's context) storing what the model is
    /// set to ([`Model::set_kv_precision`]; f16 unless set).
    pub fn from_model(gpu: Gpu, model: &Model, capacity: usize) -> Result<Self> {
        Self::from_model_with(gpu, model, capacity, model.kv_precision())
    }

    /// [`Self::from_model`] with the KV cache stored as `kv` says (f16, or i8 rows with one
    /// scale per position and KV head, quantized as they are written).
    pub fn from_model_with(
        gpu: Gpu,
        model: &Model,
        capacity: usize,
        kv: KvPrecision,
    ) -> Result<Self> {
        Self::from_model_with_layouts(gpu, model, capacity, kv, Layouts::default())
    }

    /// [`Self::from_model_with`], keeping what `layouts` asks for beside each matrix (a
    /// server: the tensor-core layout of column-major 4-bit matrices for its batches).
    pub fn from_model_with_layouts(
        gpu: Gpu,
        model: &Model,
        capacity: usize,
        kv: KvPrecision,
        layouts: Layouts,
    ) -> Result<Self> {
        let c = model.config().clone();
        // What this runner cannot execute is refused here, naming the op and the format,
        // before anything is decoded or uploaded.
        let notes = Plan::of(model).check(&GPU_CAPABILITIES)?;
        // IE-BME is on the list for its int4 / int8 packs; what its kernels do not take (f16
        // values, wider area splits) is refused here too, by layer and projection.
        let ie_bme_check = |what: String, lin: &sieve_model::linear::Linear| -> Result<()> {
            match sieve_cpu::ie_bme::ie_bme_source(lin.format()) {
                Some(e) => sieve_cuda::ie_bme::check_supported(e)
                    .map_err(|err| GpuError::Unsupported(format!("{what}: {err}"))),
                None => Ok(()),
            }
        };
        for (l, layer) in model.layers().iter().enumerate() {
            for (name, lin) in layer.linears() {
                ie_bme_check(format!("layer {l} {name}"), lin)?;
            }
        }
        ie_bme_check("lm_head".into(), model.lm_head())?;
        Self::from_layers(
            gpu,
            c,
            model.layers(),
            model.lm_head(),
            model,
            notes,
            capacity,
            kv,
            layouts,
        )
    }

    /// Uploads rank `rank` of `shards` (its layers, the whole model's embeddings, norms and LM
    /// head, replicated) for [`Self::set_tensor_parallel`]; what the runner cannot execute is
    /// refused as for the whole model.
    pub fn from_shard(
        gpu: Gpu,
        shards: &sieve_model::llama::tensor_parallel::TensorParallelModel<'_>,
        rank: usize,
        capacity: usize,
        kv: KvPrecision,
        layouts: Layouts,
    ) -> Result<Self> {
        let model = shards.model();
        let notes = Plan::of(model).check(&GPU_CAPABILITIES)?;
        let layers = shards.rank_layers(rank)?;
        if let Some(e) = sieve_cpu::ie_bme::ie_bme_source(model.lm_head().format()) {
            sieve_cuda::ie_bme::check_supported(e)
                .map_err(|err| GpuError::Unsupported(format!("lm_head: {err}")))?;
        }
        for (l, layer) in layers.iter().enumerate() {
            for (name, lin) in layer.linears() {
                if let Some(e) = sieve_cpu::ie_bme::ie_bme_source(lin.format()) {
                    sieve_cuda::ie_bme::check_supported(e).map_err(|err| {
                        GpuError::Unsupported(format!("rank {rank} layer {l} {name}: {err}"))
                    })?;
                }
            }
        }
        Self::from_layers(
            gpu,
            shards.rank_config(rank)?,
            layers,
            model.lm_head(),
            model,
            notes,
            capacity,
            kv,
            layouts,
        )
    }

    /// [`Self::build`] from the CPU model's layers (`config` says their shape), LM head, and
    /// `whole`'s embeddings and final norm.
    #[allow(clippy::too_many_arguments)]
    fn from_layers(
        gpu: Gpu,
        c: ModelConfig,
        layers: &[sieve_model::llama::Layer],
        lm_head: &sieve_model::linear::Linear,
        whole: &Model,
        notes: Vec<String>,
        capacity: usize,
        kv: KvPrecision,
        layouts: Layouts,
    ) -> Result<Self> {
        // GGUF blocks go to the device as their integers, scales and mins, IE-BME matrices with
        // integer values and SlideSparse matrices as they are encoded; every other matrix as
        // its values, encoded there in its format.
        let decode =
            |lin: &sieve_model::linear::Linear| -> Result<(HostMatrix, Threshold, FormatKind)> {
                let weights = match (
                    lin.quant_blocks(),
                    sieve_cpu::ie_bme::ie_bme_source(lin.format()),
                ) {
                    (Some(q), _) => HostMatrix::LowBit(low_bit_of_blocks(q)?),
                    // IE-BME with integer values goes as it is encoded.
                    (None, Some(e)) if e.payload().group_size().is_some() => {
                        HostMatrix::IeBme(e.clone())
                    }
                    (None, _) => match slide_source(lin.format()) {
                        Some(s) => HostMatrix::Slide(s.clone()),
                        None => HostMatrix::Values(lin.format().decode()),
                    },
                };
                Ok((weights, lin.threshold(), lin.format().kind()))
            };
        let head = decode(lm_head)?;
        Self::build(
            gpu,
            c,
            capacity,
            kv,
            whole.embed_tokens().to_vec(),
            whole.final_norm().to_vec(),
            (head.0, head.1, head.2),
            notes,
            layouts,
            |l| {
                let layer = &layers[l];
                let (q, k, v) = (
                    decode(&layer.q_proj)?,
                    decode(&layer.k_proj)?,
                    decode(&layer.v_proj)?,
                );
                let kinds = [
                    q.2,
                    k.2,
                    v.2,
                    layer.o_proj.format().kind(),
                    layer.gate_proj.format().kind(),
                    layer.up_proj.format().kind(),
                    layer.down_proj.format().kind(),
                ];
                let bias = match (
                    layer.q_proj.bias(),
                    layer.k_proj.bias(),
                    layer.v_proj.bias(),
                ) {
                    (None, None, None) => None,
                    (qb, kb, vb) => {
                        let mut b = Vec::new();
                        for (part, lin) in [
                            (qb, &layer.q_proj),
                            (kb, &layer.k_proj),
                            (vb, &layer.v_proj),
                        ] {
                            match part {
                                Some(p) => b.extend_from_slice(p),
                                None => b.extend(std::iter::repeat_n(0.0, lin.rows())),
                            }
                        }
                        Some(b)
                    }
                };
                let o = decode(&layer.o_proj)?;
                let (g, u, dn) = (
                    decode(&layer.gate_proj)?,
                    decode(&layer.up_proj)?,
                    decode(&layer.down_proj)?,
                );
                Ok(HostLayer {
                    input_norm: layer.input_norm.clone(),
                    post_norm: layer.post_attention_norm.clone(),
                    qkv: vec![(q.0, q.1), (k.0, k.1), (v.0, v.1)],
                    qkv_bias: bias,
                    o: (o.0, o.1),
                    gate_up: vec![(g.0, g.1), (u.0, u.1)],
                    down: (dn.0, dn.1),
                    kind: kinds[0],
                })
            },
        )
    }

    /// Builds the device model from its parts, with a KV cache of `capacity` positions stored
    /// as `kv` says; `layer(l)` supplies layer `l` (so that a large model is generated or
    /// decoded one layer at a time, never whole in host memory).
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        gpu: Gpu,
        config: ModelConfig,
        capacity: usize,
        kv: KvPrecision,
        embed: Vec<f16>,
        final_norm: Vec<f32>,
        lm_head: (HostMatrix, Threshold, FormatKind),
        mut notes: Vec<String>,
        layouts: Layouts,
        mut layer: impl FnMut(usize) -> Result<HostLayer>,
    ) -> Result<Self> {
        let c = &config;
        let capacity = if c.max_position_embeddings > 0 {
            capacity.min(c.max_position_embeddings)
        } else {
            capacity
        };
        if capacity == 0 {
            return Err(GpuError::InvalidArgument(
                "a KV cache of 0 positions".into(),
            ));
        }
        let (d, hd, nh, nkv, inter, vocab) = (
            c.hidden_size,
            c.head_dim,
            c.num_heads,
            c.num_kv_heads,
            c.intermediate_size,
            c.vocab_size,
        );
        if embed.len() != vocab * d || final_norm.len() != d {
            return Err(GpuError::InvalidArgument(format!(
                "embedding of {} values / final norm of {} for vocabulary {vocab} x hidden {d}",
                embed.len(),
                final_norm.len()
            )));
        }
        precompile_kernels(&gpu)?;
        let attention = AttentionShape::new(&gpu, nh, nkv, hd, capacity)?;
        let cache_rows = c
            .num_layers
            .checked_mul(capacity)
            .and_then(|r| r.checked_mul(nkv));
        let kv_cache_bytes = cache_rows
            .and_then(|rows| DeviceKvCache::bytes_for(kv, rows, hd))
            .ok_or_else(|| {
                GpuError::InvalidArgument(format!(
                    "a KV cache of {capacity} positions overflows the address space"
                ))
            })?;
        check_memory(&gpu, kv_cache_bytes.saturating_add(vocab * d * 2))?;
        let stream = gpu.stream().clone();
        let zeros_f32 = |n: usize| {
            stream
                .alloc_zeros::<f32>(n.max(1))
                .during("allocating a buffer")
        };
        let inv_freq = sieve_model::llama::rope_inv_freq(hd, c.rope_theta, c.rope_scaling.as_ref());
        let half = hd / 2;
        let mut cos = vec![0f32; capacity * half];
        let mut sin = vec![0f32; capacity * half];
        for p in 0..capacity {
            for (i, f) in inv_freq.iter().enumerate() {
                let (s, co) = (p as f64 * f).sin_cos();
                cos[p * half + i] = co as f32;
                sin[p * half + i] = s as f32;
            }
        }
        let bufs = Buffers {
            x: zeros_f32(d)?,
            xn: zeros_f32(d)?,
            qkv: zeros_f32((nh + 2 * nkv) * hd)?,
            att: zeros_f32(nh * hd)?,
            gu: zeros_f32(2 * inter)?,
            h: zeros_f32(inter)?,
            logits: zeros_f32(vocab)?,
            part: zeros_f32(attention.partials_len())?,
            kv: DeviceKvCache::allocate(&stream, kv, c.num_layers * capacity * nkv, hd)?,
            rope_cos: gpu.upload(&cos)?,
            rope_sin: gpu.upload(&sin)?,
            state: gpu.upload(&[0i32, 0])?,
            history: gpu.upload(&vec![0i32; capacity])?,
        };
        let mut report = UploadReport {
            kv_cache_bytes,
            kv_precision: kv,
            ..Default::default()
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let hl = layer(l)?;
            check_layer(c, l, &hl)?;
            let group = |mats: &[(HostMatrix, Threshold)]| -> Result<DeviceLinear> {
                let refs: Vec<(&HostMatrix, Threshold)> =
                    mats.iter().map(|(m, t)| (m, *t)).collect();
                DeviceLinear::upload_group(&gpu, hl.kind, &refs, layouts)
            };
            let dl = DeviceLayer {
                input_norm: gpu.upload(&hl.input_norm)?,
                post_norm: gpu.upload(&hl.post_norm)?,
                qkv: group(&hl.qkv)?,
                qkv_bias: match &hl.qkv_bias {
                    Some(b) => Some(gpu.upload(b)?),
                    None => None,
                },
                o: group(std::slice::from_ref(&hl.o))?,
                gate_up: group(&hl.gate_up)?,
                down: group(std::slice::from_ref(&hl.down))?,
            };
            if l == 0 {
                for (name, lin) in [
                    ("q|k|v", &dl.qkv),
                    ("o", &dl.o),
                    ("gate|up", &dl.gate_up),
                    ("down", &dl.down),
                ] {
                    report.kernels.push(format!("{name}: {}", lin.label()));
                }
            }
            for lin in [&dl.qkv, &dl.o, &dl.gate_up, &dl.down] {
                report.weight_bytes += lin.stored_bytes();
            }
            layers.push(dl);
        }
        let (head, head_t, head_kind) = lm_head;
        if head.rows() != vocab || head.cols() != d {
            return Err(GpuError::InvalidArgument(format!(
                "LM head is {}x{}, expected {vocab}x{d}",
                head.rows(),
                head.cols()
            )));
        }
        // The head's format as packed (sieve pack leaves it dense f16). A prompt pass takes
        // the head's product for its last row only: no 8-bit copy, no resident f16 copy.
        let head_layouts = Layouts {
            prompt8: None,
            prompt16: false,
            ..layouts
        };
        let lm_head =
            DeviceLinear::upload_group(&gpu, head_kind, &[(&head, head_t)], head_layouts)?;
        report.kernels.push(format!("lm_head: {}", lm_head.label()));
        report.weight_bytes += lm_head.stored_bytes() + vocab * d * 2;
        let embed_dev = gpu.upload(&embed)?;
        drop(embed);
        report.notes.append(&mut notes);
        let mut model = Self {
            gpu,
            final_norm: stream
                .clone_htod(&final_norm)
                .during("copying to the device")?,
            config,
            capacity,
            layers,
            embed: embed_dev,
            lm_head,
            attention,
            bufs,
            sample: sample_args(&SamplingParams::greedy()),
            graphs: [None, None],
            use_graphs: true,
            pdl: true,
            l2_prefetch: 0,
            report,
            len: 0,
            prefill_bufs: None,
            // No pass is longer than the cache holds: its scratch would never be filled.
            prefill_chunk: crate::prefill::chunk_setting()?
                .min(capacity.max(crate::prefill::MIN_CHUNK)),
            batched_prefill: true,
            slots: 1,
            slot: 0,
            slot_graphs: vec![None],
            seq_bufs: None,
            seq_graphs: Default::default(),
            seq_warm: [false; 7],
            step_mode: StepMode::Graph,
            persistent: None,
            persistent_trace: false,
            tp: None,
        };
        model.l2_prefetch = model.default_l2_prefetch();
        model.report.launches_per_step = model.launches_per_step();
        Ok(model)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn report(&self) -> &UploadReport {
        &self.report
    }
    /// Tokens in the KV cache.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Eager launches instead of graph replays (for comparisons and debugging).
    /// Runs every Tiled-CBC product with `kernel` (the captured graphs are dropped and
    /// captured again at the next step).
    pub fn set_tcbc_kernel(&mut self, kernel: sieve_cuda::tiled_cbc::TcbcKernel) -> Result<()> {
        for l in &mut self.layers {
            for lin in [&mut l.qkv, &mut l.o, &mut l.gate_up, &mut l.down] {
                lin.set_tcbc_kernel(kernel)?;
            }
        }
        self.lm_head.set_tcbc_kernel(kernel)?;
        self.drop_graphs();
        if let Some(l) = self.layers.first() {
            let mut kernels: Vec<String> = [
                ("q|k|v", &l.qkv),
                ("o", &l.o),
                ("gate|up", &l.gate_up),
                ("down", &l.down),
            ]
            .iter()
            .map(|(name, lin)| format!("{name}: {}", lin.label()))
            .collect();
            kernels.push(format!("lm_head: {}", self.lm_head.label()));
            self.report.kernels = kernels;
        }
        Ok(())
    }

    /// Programmatic dependent launch between the step's kernels (on by default; the graphs
    /// are captured again at the next step).
    /// (A rank of a tensor-parallel model keeps it off: [`Self::set_tensor_parallel`].)
    pub fn set_pdl(&mut self, on: bool) {
        let on = on && self.tp.is_none();
        if on != self.pdl {
            self.pdl = on;
            self.drop_graphs();
        }
    }
    pub fn pdl(&self) -> bool {
        self.pdl
    }

    /// How many bytes of each product's weights the small kernel before it (RMSNorm before
    /// q|k|v, gate|up and the LM head, RoPE before o, SwiGLU before down) asks L2 for, so that
    /// they stream from DRAM while those kernels run instead of after: in the one-token step
    /// and in the batched passes (steps of many sequences, prompts). 0: none; the graphs are
    /// captured again at the next step. The default is [`Self::default_l2_prefetch`].
    pub fn set_l2_prefetch(&mut self, bytes: usize) {
        if bytes != self.l2_prefetch {
            self.l2_prefetch = bytes;
            self.drop_graphs();
        }
    }
    pub fn l2_prefetch(&self) -> usize {
        self.l2_prefetch
    }
    /// 2 MB (10^6 bytes, as `--prefetch 2`), at most a quarter of this GPU's L2: the best of 0, 2, 4, 8 and 26 MB on a 7B
    /// step (H100, 2026-12-07, docs/BENCHMARKS.md "Window N2"): 2 MB took 3% off the 4-bit
    /// steps; larger spans slow the small kernels that issue them (DRAM queues fill while
    /// they wait on their own loads) by more than the products gain.
    pub fn default_l2_prefetch(&self) -> usize {
        default_l2_prefetch_for(self.gpu.info().l2_bytes)
    }

    pub fn set_use_graphs(&mut self, on: bool) {
        self.use_graphs = on;
    }
    pub fn set_sampling(&mut self, args: SampleArgs) {
        self.sample = args;
    }

    /// Every projection group, for threshold calibration and reports: `(layer, site, linear)`
    /// with sites 0 = q|k|v input, 1 = o input, 2 = gate|up input, 3 = down input.
    pub fn set_thresholds(&mut self, thresholds: &[[Threshold; 4]]) -> Result<()> {
        if thresholds.len() != self.layers.len() {
            return Err(GpuError::InvalidArgument(format!(
                "{} threshold rows for {} layers",
                thresholds.len(),
                self.layers.len()
            )));
        }
        for (layer, t) in self.layers.iter_mut().zip(thresholds) {
            for (lin, t) in [
                (&mut layer.qkv, t[0]),
                (&mut layer.o, t[1]),
                (&mut layer.gate_up, t[2]),
                (&mut layer.down, t[3]),
            ] {
                sieve_formats::format::check_threshold(t)?;
                for p in &mut lin.parts {
                    if t.is_some() && matches!(p.matrix, crate::matrix::DeviceMatrix::DenseRows(_))
                    {
                        return Err(GpuError::Unsupported(
                            "a threshold on a row-major dense matrix: upload it with a threshold so that it goes column-major".into(),
                        ));
                    }
                    p.threshold = t;
                }
            }
        }
        self.drop_graphs();
        Ok(())
    }

    fn ops(&self) -> Vec<Op> {
        plan::step_ops(self.layers.len())
            .into_iter()
            .filter(|op| *op != StepOp::Next)
            .map(Op::Plan)
            .collect()
    }

    fn launches_per_step(&self) -> usize {
        let mut n = 1 + 2 + 1; // embed, final norm, sample, (head counted below)
        for l in &self.layers {
            n += 2 + 1 + 2 + 1; // two norms, rope, attention split + combine, silu
            n += l.qkv.launches() + l.o.launches() + l.gate_up.launches() + l.down.launches();
        }
        n + self.lm_head.launches()
    }

    fn launch(&self, op: Op) -> Result<()> {
        let g = &self.gpu;
        let b = &self.bufs;
        let c = &self.config;
        let p = |s: &CudaSlice<f32>| dev_ptr(g, s);
        let (d, eps) = (c.hidden_size, c.rms_norm_eps);
        let state = dev_ptr(g, &b.state);
        let ahead = |next: &DeviceLinear| next.weight_span(g, self.l2_prefetch);
        match op {
            Op::Plan(StepOp::Embed) => {
                step::embed_token(g, dev_ptr(g, &self.embed), state, p(&b.x), d, c.vocab_size)?
            }
            Op::Plan(StepOp::Layer(l, LayerOp::Norm(Norm::Attention))) => step::rmsnorm_zero(
                g,
                p(&b.x),
                p(&self.layers[l].input_norm),
                p(&b.xn),
                d,
                eps,
                p(&b.qkv),
                b.qkv.len(),
                ahead(&self.layers[l].qkv),
            )?,
            Op::Plan(StepOp::Layer(l, LayerOp::Product(Group::Qkv))) => {
                self.layers[l].qkv.launch_add(g, p(&b.xn), p(&b.qkv))?
            }
            Op::Plan(StepOp::Layer(l, LayerOp::RopeKv)) => rope::rope_kv(
                g,
                p(&b.qkv),
                self.layers[l].qkv_bias.as_ref().map(p).unwrap_or(0),
                p(&b.rope_cos),
                p(&b.rope_sin),
                state,
                self.cache_view(l)?,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                ahead(&self.layers[l].o),
            )?,
            Op::Plan(StepOp::Layer(l, LayerOp::Attention)) => {
                // RoPE asked for the o weights; what the cap leaves goes to the start of
                // gate|up, the largest product, read after o and one RMSNorm.
                let layer = &self.layers[l];
                let o = ahead(&layer.o).bytes;
                let gate_up = if attention_prefetch_enabled() {
                    layer
                        .gate_up
                        .weight_span(g, self.l2_prefetch.saturating_sub(o))
                } else {
                    L2Span::NONE
                };
                attention::attention(
                    g,
                    &self.attention,
                    p(&b.qkv),
                    self.cache_view(l)?,
                    state,
                    p(&b.part),
                    p(&b.att),
                    gate_up,
                )?
            }
            Op::Plan(StepOp::Layer(l, LayerOp::Product(Group::O))) => {
                self.residual_product(p(&b.x), d, || {
                    self.layers[l].o.launch_add(g, p(&b.att), p(&b.x))
                })?
            }
            Op::Plan(StepOp::Layer(l, LayerOp::Norm(Norm::Mlp))) => step::rmsnorm_zero(
                g,
                p(&b.x),
                p(&self.layers[l].post_norm),
                p(&b.xn),
                d,
                eps,
                p(&b.gu),
                b.gu.len(),
                ahead(&self.layers[l].gate_up),
            )?,
            Op::Plan(StepOp::Layer(l, LayerOp::Product(Group::GateUp))) => {
                self.layers[l].gate_up.launch_add(g, p(&b.xn), p(&b.gu))?
            }
            Op::Plan(StepOp::Layer(l, LayerOp::SwiGlu)) => step::silu_mul(
                g,
                p(&b.gu),
                p(&b.h),
                c.intermediate_size,
                ahead(&self.layers[l].down),
            )?,
            Op::Plan(StepOp::Layer(l, LayerOp::Product(Group::Down))) => {
                self.residual_product(p(&b.x), d, || {
                    self.layers[l].down.launch_add(g, p(&b.h), p(&b.x))
                })?
            }
            Op::Plan(StepOp::FinalNorm) => step::rmsnorm_zero(
                g,
                p(&b.x),
                p(&self.final_norm),
                p(&b.xn),
                d,
                eps,
                p(&b.logits),
                b.logits.len(),
                ahead(&self.lm_head),
            )?,
            Op::Plan(StepOp::LmHead) => self.lm_head.launch_add(g, p(&b.xn), p(&b.logits))?,
            Op::Plan(StepOp::Next) | Op::Next(true) => sampling::sample_token(
                g,
                p(&b.logits),
                c.vocab_size,
                &self.sample,
                state,
                dev_ptr(g, &b.history),
                self.capacity,
            )?,
            Op::Next(false) => {
                step::advance_forced(g, state, dev_ptr(g, &b.history), self.capacity)?
            }
        }
        Ok(())
    }

    /// A product added to the residual `x` (`len` values: o and down). With tensor parallelism
    /// each rank adds its partial sums (the columns of its heads, of its intermediate slice):
    /// rank 0 onto the residual, the others onto zeros, then the all-reduce leaves the whole
    /// sum in `x` on every rank (`sieve_model::llama::tensor_parallel` is the reference).
    fn residual_product(
        &self,
        x: DevPtr,
        len: usize,
        product: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        if self.tp.as_ref().is_some_and(|tp| tp.rank() != 0) {
            // SAFETY: x holds `len` f32 on this GPU (the caller's buffer).
            unsafe { self.gpu.zero_bytes(x, len * 4) }?;
        }
        product()?;
        self.all_reduce_residual(x, len)
    }

    /// What a prompt pass's o and down products scale the residual by before adding: 1, or 0
    /// on the ranks other than 0 ([`Self::residual_product`]).
    fn residual_beta(&self) -> f32 {
        match &self.tp {
            Some(tp) if tp.rank() != 0 => 0.0,
            _ => 1.0,
        }
    }

    /// Sums `x[..len]` over the ranks in place (nothing without tensor parallelism).
    fn all_reduce_residual(&self, x: DevPtr, len: usize) -> Result<()> {
        if let Some(tp) = &self.tp {
            // SAFETY: x holds `len` f32 on this rank's GPU, and every rank runs the same ops
            // in the same order (the driver gives them the same commands).
            unsafe { tp.all_reduce_sum_f32(&self.gpu, x, x, len) }?;
        }
        Ok(())
    }

    /// Microseconds the all-reduces of one decode step take on this rank (two of the hidden
    /// size per layer, eager, back to back: the mean over `reps` steps after one
    /// warm-up step), or None without tensor parallelism. Every rank must call it together.
    pub fn time_all_reduces(&self, reps: usize) -> Result<Option<f64>> {
        let Some(tp) = &self.tp else {
            return Ok(None);
        };
        let (d, n) = (self.config.hidden_size, 2 * self.layers.len());
        let scratch = self.gpu.upload(&vec![0f32; d])?;
        let x = dev_ptr(&self.gpu, &scratch);
        let step = || -> Result<()> {
            for _ in 0..n {
                // SAFETY: `scratch` holds d f32 on this rank's GPU; every rank makes the same
                // calls (the caller's contract).
                unsafe { tp.all_reduce_sum_f32(&self.gpu, x, x, d) }?;
            }
            Ok(())
        };
        step()?;
        let events = EventPair::new(&self.gpu)?;
        events.start(&self.gpu)?;
        for _ in 0..reps.max(1) {
            step()?;
        }
        events.end(&self.gpu)?;
        self.gpu.synchronize()?;
        Ok(Some(events.elapsed_us()? / reps.max(1) as f64))
    }

    /// After a capture the driver refused: steps go on as eager launches, except on a rank of
    /// a tensor-parallel model, where the failure is returned. A rank that fell back alone
    /// would pad its sequence passes differently from its peers (their all-reduces would no
    /// longer pair up), and a failed capture with a collective in it can leave the
    /// communicator unusable.
    fn graph_capture_failed(&mut self) -> Result<()> {
        self.gpu.synchronize().ok();
        if self.tp.is_some() {
            return Err(GpuError::Unsupported(
                "a CUDA graph capture failed on a tensor-parallel rank (see the notes)".into(),
            ));
        }
        self.use_graphs = false;
        Ok(())
    }

    /// Makes this model rank `comm.rank()` of a tensor-parallel model: its layers must be that
    /// rank's shard (`sieve_model::llama::tensor_parallel`), and every rank must then be given
    /// the same calls in the same order (`crate::tensor_parallel` does). The step keeps one CUDA
    /// graph per rank, the all-reduces captured in it; programmatic dependent launch is turned
    /// off (NCCL's kernels do not wait on it: `sieve_cuda::collective`), and the persistent
    /// step is refused (it has no all-reduce).
    pub fn set_tensor_parallel(&mut self, comm: Communicator) -> Result<()> {
        if self.step_mode == StepMode::Persistent {
            return Err(GpuError::Unsupported(
                "tensor parallelism runs the graph step; the persistent step has no all-reduce"
                    .into(),
            ));
        }
        self.drop_graphs();
        self.tp = (comm.world() > 1).then_some(comm);
        if self.tp.is_some() {
            self.pdl = false;
        }
        Ok(())
    }

    fn enqueue_step(&self, sample: bool) -> Result<()> {
        if self.step_mode == StepMode::Persistent {
            let Some((step, _)) = &self.persistent else {
                return Err(GpuError::InvalidArgument(
                    "the persistent step was not built before its launch".into(),
                ));
            };
            step.launch(&self.gpu)?;
            return self.launch(Op::Next(sample));
        }
        for op in self.ops() {
            self.launch(op)?;
        }
        self.launch(Op::Next(sample))
    }

    /// Runs one step: a graph replay (captured on first use) or eager launches.
    fn run_step(&mut self, sample: bool) -> Result<()> {
        if self.step_mode == StepMode::Persistent
            && self.persistent.as_ref().map(|(_, slot)| *slot) != Some(self.slot)
        {
            self.drop_graphs();
            self.persistent = Some((self.build_persistent()?, self.slot));
        }
        if !self.use_graphs {
            return self.enqueue_step(sample);
        }
        let slot = sample as usize;
        let stale = match &self.graphs[slot] {
            Some((_, args)) => sample && *args != self.sample,
            None => true,
        };
        if stale {
            self.graphs[slot] = None;
            match self.capture(sample) {
                Ok(graph) => self.graphs[slot] = Some((graph, self.sample)),
                Err(e) => {
                    // A capture the driver refused leaves the step correct when launched
                    // eagerly: say so once and keep going.
                    self.report.notes.push(format!(
                        "CUDA graph capture failed ({e}); steps run as eager launches"
                    ));
                    self.graph_capture_failed()?;
                    return self.enqueue_step(sample);
                }
            }
        }
        if let Some((graph, _)) = &self.graphs[slot] {
            graph.launch()?;
        }
        Ok(())
    }

    fn capture(&self, sample: bool) -> Result<StepGraph> {
        if self.step_mode == StepMode::Persistent {
            // No programmatic edge: every block of the persistent kernel must be resident at
            // once, so it starts only when the previous kernel has left the GPU.
            return self.capture_with(false, |m| m.enqueue_step(sample));
        }
        let mut ops = self.ops();
        ops.push(Op::Next(sample));
        self.capture_ops(&ops)
    }

    fn capture_ops(&self, ops: &[Op]) -> Result<StepGraph> {
        self.capture_with(self.pdl, |m| ops.iter().try_for_each(|&op| m.launch(op)))
    }

    /// A graph of what `enqueue` launches on the stream, its kernel-to-kernel edges
    /// programmatic when `pdl` (only for launches of sieve's own kernels, which all wait for
    /// their predecessor before reading: see `sieve_cuda::graph`).
    fn capture_with(&self, pdl: bool, enqueue: impl Fn(&Self) -> Result<()>) -> Result<StepGraph> {
        // Compile and load every kernel before capturing (module loads cannot be captured),
        // and let earlier asynchronous work (pageable copies) finish outside the capture.
        self.warm_kernels()?;
        self.gpu.synchronize()?;
        let stream = self.gpu.stream();
        StepGraph::begin_capture(stream)?;
        let enqueued = enqueue(self);
        let graph = StepGraph::end_capture(stream, pdl);
        enqueued?;
        Ok(graph?)
    }

    /// GPU time of one replay of a graph of part of the step (median-free: total over `reps`
    /// back-to-back replays bracketed by two events), teacher-forced from the current position.
    /// Parts that leave launches out measure what the rest costs under graph replay.
    pub fn time_step_part(&mut self, part: StepPart, reps: usize) -> Result<f64> {
        if self.len + reps + 1 > self.capacity {
            return Err(GpuError::InvalidArgument(
                "not enough context left to time the step".into(),
            ));
        }
        let mut ops: Vec<Op> = self
            .ops()
            .into_iter()
            .filter(|&op| part.keeps(op))
            .collect();
        ops.push(Op::Next(false));
        let graph = self.capture_ops(&ops)?;
        graph.launch()?;
        self.gpu.synchronize()?;
        let events = EventPair::new(&self.gpu)?;
        events.start(&self.gpu)?;
        for _ in 0..reps {
            graph.launch()?;
        }
        events.end(&self.gpu)?;
        self.gpu.synchronize()?;
        self.len += reps + 1;
        Ok(events.elapsed_us()? / reps as f64)
    }

    fn warm_kernels(&self) -> Result<()> {
        for fam in sieve_cuda::gpu::families() {
            self.gpu.module(&fam)?;
        }
        Ok(())
    }

    fn prefill_scratch(&mut self) -> Result<()> {
        if self.prefill_bufs.is_some() {
            return Ok(());
        }
        let c = &self.config;
        let (d, hd) = (c.hidden_size, c.head_dim);
        let qkv_w = (c.num_heads + 2 * c.num_kv_heads) * hd;
        // Rounded up to the low-bit kernels' widest column padding (their input is padded).
        let max_k = d
            .max(c.intermediate_size)
            .max(c.num_heads * hd)
            .next_multiple_of(sieve_cuda::lowbit::K_ALIGN_MAX);
        let max_m = qkv_w.max(2 * c.intermediate_size);
        // The head too: the many-sequence step runs it through the same path.
        let mut all: Vec<&DeviceLinear> = vec![&self.lm_head];
        for l in &self.layers {
            all.extend([&l.qkv, &l.o, &l.gate_up, &l.down]);
        }
        let layers: Vec<&DeviceLinear> = all[1..].to_vec();
        let chunk = self.prefill_chunk;
        let decoded = crate::prefill::scratch16_len(&all, chunk)
            .max(crate::prefill::long_batch_copy_len(&layers, chunk));
        self.prefill_bufs = Some(crate::prefill::PrefillBuffers::new(
            &self.gpu,
            chunk,
            d,
            max_k,
            max_m,
            c.num_heads * hd,
            sieve_cuda::attention::rows_partials_len(&self.gpu, &self.attention, chunk),
            decoded,
        )?);
        Ok(())
    }

    /// Tokens `tokens` at positions `p0 ..` through every layer as one batch, filling the KV
    /// cache (no logits: the caller takes the last row's, or runs the last token through the
    /// decode step).
    fn prefill_chunk(&mut self, tokens: &[u32], p0: usize) -> Result<()> {
        self.upload_row_tokens(tokens)?;
        let span = PassSpan {
            slot: self.slot,
            first: p0,
            row: 0,
            len: tokens.len(),
        };
        self.rows_through_layers(tokens.len(), PassRows::Spans(&[span]))
    }

    /// Writes `tokens` where [`Self::rows_through_layers`] embeds them from.
    fn upload_row_tokens(&mut self, tokens: &[u32]) -> Result<()> {
        self.prefill_scratch()?;
        let Some(pb) = self.prefill_bufs.as_mut() else {
            return Err(GpuError::InvalidArgument("prefill scratch missing".into()));
        };
        if tokens.len() > pb.chunk {
            return Err(GpuError::InvalidArgument(format!(
                "{} tokens in one batched pass: its scratch holds {}",
                tokens.len(),
                pb.chunk
            )));
        }
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let stream = self.gpu.stream().clone();
        let mut view = pb.tokens.slice_mut(0..ids.len());
        stream
            .memcpy_htod(&ids, &mut view)
            .during("writing the rows' tokens")?;
        Ok(())
    }

    /// The `n` tokens in the scratch's token list through every layer, row by row (the
    /// products as GEMMs or the low-bit kernels' token batches), ending with the residual
    /// stream in the scratch's `x`. `rows` says where each row's keys and values go and what
    /// it attends to.
    fn rows_through_layers(&self, n: usize, rows: PassRows<'_>) -> Result<()> {
        self.rows_through_layers_marked(n, rows, &mut |_| Ok(()))
    }

    /// [`Self::rows_through_layers`], calling `mark(kind)` after each launch group is enqueued
    /// (for [`Self::profile_prefill`]'s events).
    fn rows_through_layers_marked(
        &self,
        n: usize,
        rows: PassRows<'_>,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<()> {
        use crate::prefill::linear_rows;
        let pb = self
            .prefill_bufs
            .as_ref()
            .ok_or_else(|| GpuError::InvalidArgument("prefill scratch missing".into()))?;
        if n > pb.chunk {
            return Err(GpuError::InvalidArgument(format!(
                "{n} rows in one batched pass: its scratch holds {}",
                pb.chunk
            )));
        }
        rows.check(n)?;
        let g = &self.gpu;
        let c = &self.config;
        let (d, hd, nh, nkv, inter) = (
            c.hidden_size,
            c.head_dim,
            c.num_heads,
            c.num_kv_heads,
            c.intermediate_size,
        );
        let qkv_w = (nh + 2 * nkv) * hd;
        let p = |s: &CudaSlice<f32>| dev_ptr(g, s);
        let (x, xn, y, att) = (p(&pb.x), p(&pb.xn), p(&pb.y), p(&pb.att));
        let (a16, w16, w16_len) = (dev_ptr(g, &pb.a16), dev_ptr(g, &pb.w16), pb.w16.len());
        embed_rows(g, dev_ptr(g, &self.embed), dev_ptr(g, &pb.tokens), x, n, d)?;
        mark("embed")?;
        // The rows' RoPE + cache write and attention, by where the rows belong: each span of
        // prompt rows over its own slot's cache, through the kernels a lone prompt chunk takes
        // (the tensor-core prompt attention from 16 rows); a decode step's rows address slot
        // 0's cache and the kernels add each row's slot.
        let (q_row, att_row) = (qkv_w * 4, nh * hd * 4);
        let ahead = |next: &DeviceLinear| next.weight_span(g, self.l2_prefetch);
        let rope_and_attention =
            |l: usize, bias: DevPtr, cos: DevPtr, sin: DevPtr, attend: bool| {
                let runs: Vec<(usize, usize, Rows, usize)> = match rows {
                    PassRows::Spans(spans) => spans
                        .iter()
                        .map(|s| (s.slot, s.row, Rows::Consecutive { first: s.first }, s.len))
                        .collect(),
                    PassRows::Sequences { seqs, slot_stride } => {
                        vec![(0, 0, Rows::Sequences { seqs, slot_stride }, n)]
                    }
                };
                for (slot, row, kind, len) in runs {
                    let cache = self.cache_view_at(slot, l)?;
                    let q = y + (row * q_row) as u64;
                    if attend {
                        let out = att + (row * att_row) as u64;
                        attention::attention_rows(
                            g,
                            &self.attention,
                            q,
                            cache,
                            p(&pb.part),
                            out,
                            &kind,
                            len,
                        )?;
                    } else {
                        let o = ahead(&self.layers[l].o);
                        rope::rope_rows(g, q, bias, cos, sin, &kind, len, cache, nh, nkv, hd, o)?;
                    }
                }
                Ok::<(), GpuError>(())
            };
        // The layer as the plan orders it (`plan::LAYER`), each op over the n rows.
        for (l, layer) in self.layers.iter().enumerate() {
            let bias = layer.qkv_bias.as_ref().map(p).unwrap_or(0);
            let (cos, sin) = (p(&self.bufs.rope_cos), p(&self.bufs.rope_sin));
            for op in plan::LAYER {
                match op {
                    LayerOp::Norm(Norm::Attention) => rmsnorm_rows(
                        g,
                        x,
                        p(&layer.input_norm),
                        xn,
                        n,
                        d,
                        c.rms_norm_eps,
                        ahead(&layer.qkv),
                    )?,
                    LayerOp::Product(Group::Qkv) => {
                        linear_rows(g, &layer.qkv, xn, d, a16, n, y, qkv_w, 0.0, w16, w16_len)?
                    }
                    LayerOp::RopeKv => rope_and_attention(l, bias, cos, sin, false)?,
                    LayerOp::Attention => rope_and_attention(l, bias, cos, sin, true)?,
                    LayerOp::Product(Group::O) => {
                        let beta = self.residual_beta();
                        linear_rows(g, &layer.o, att, nh * hd, a16, n, x, d, beta, w16, w16_len)?;
                        self.all_reduce_residual(x, n * d)?
                    }
                    LayerOp::Norm(Norm::Mlp) => rmsnorm_rows(
                        g,
                        x,
                        p(&layer.post_norm),
                        xn,
                        n,
                        d,
                        c.rms_norm_eps,
                        ahead(&layer.gate_up),
                    )?,
                    LayerOp::Product(Group::GateUp) => linear_rows(
                        g,
                        &layer.gate_up,
                        xn,
                        d,
                        a16,
                        n,
                        y,
                        2 * inter,
                        0.0,
                        w16,
                        w16_len,
                    )?,
                    LayerOp::SwiGlu => silu_rows(g, y, n, inter, ahead(&layer.down))?,
                    LayerOp::Product(Group::Down) => {
                        linear_rows(
                            g,
                            &layer.down,
                            y,
                            2 * inter,
                            a16,
                            n,
                            x,
                            d,
                            self.residual_beta(),
                            w16,
                            w16_len,
                        )?;
                        self.all_reduce_residual(x, n * d)?
                    }
                }
                mark(op.name())?;
            }
        }
        Ok(())
    }

    /// One batched prefill of `prompt` with CUDA events between its launch groups: where the
    /// time to first token goes. Fails where the prefill is not batched.
    pub fn profile_prefill(&mut self, prompt: &[u32]) -> Result<PrefillProfile> {
        let n = prompt.len();
        if !(2..=self.prefill_chunk).contains(&n) || !self.prefill_is_batched() {
            return Err(GpuError::InvalidArgument(format!(
                "a prefill profile takes one batched chunk (2..={} tokens) of a model with \
                 batched prefill",
                self.prefill_chunk
            )));
        }
        self.reset(prompt)?;
        self.upload_row_tokens(prompt)?;
        self.gpu.synchronize()?;
        // The GPU spins while the host enqueues the pass, so that the events bracket GPU work
        // and not the host's launch gaps (those are what a graph would remove).
        sieve_cuda::timing::spin(&self.gpu, 50_000_000)?;
        let mut marks: Vec<(&'static str, EventPair)> = Vec::new();
        let mut current = EventPair::new(&self.gpu)?;
        current.start(&self.gpu)?;
        let gpu = &self.gpu;
        let span = PassSpan {
            slot: self.slot,
            first: 0,
            row: 0,
            len: n,
        };
        self.rows_through_layers_marked(n, PassRows::Spans(&[span]), &mut |kind| {
            current.end(gpu)?;
            let next = EventPair::new(gpu)?;
            next.start(gpu)?;
            marks.push((kind, std::mem::replace(&mut current, next)));
            Ok(())
        })?;
        let head = EventPair::new(&self.gpu)?;
        head.start(&self.gpu)?;
        self.sample_after_batched_prompt(prompt)?;
        head.end(&self.gpu)?;
        self.len = n;
        self.gpu.synchronize()?;
        let mut prof = PrefillProfile {
            batched_tokens: n,
            head_us: head.elapsed_us()?,
            ..Default::default()
        };
        for (kind, events) in &marks {
            let us = events.elapsed_us()?;
            match prof.by_op.iter_mut().find(|(k, _)| k == kind) {
                Some((_, total)) => *total += us,
                None => prof.by_op.push((kind, us)),
            }
        }
        Ok(prof)
    }

    /// After a batched pass over the whole prompt: its last row's residual into the decode
    /// step's buffer, the state at the last token, then the step's tail alone (final norm,
    /// LM head, sampler), so the weights are not read again for one more token (that decode
    /// step was 4.2 of a 7B prompt's 21 ms: H200, 2026-12-05).
    fn sample_after_batched_prompt(&mut self, prompt: &[u32]) -> Result<()> {
        let n = prompt.len();
        self.write_state(n - 1, prompt[n - 1])?;
        self.tail_after_batched_rows(n, true)
    }

    /// The decode step's tail on the last of `rows` rows that went through the batched pass
    /// (chunk by chunk): that row's residual into the step's buffer, then final norm and LM
    /// head (the logits), and the sampler when `sample`.
    fn tail_after_batched_rows(&mut self, rows: usize, sample: bool) -> Result<()> {
        let chunk = self
            .prefill_bufs
            .as_ref()
            .map_or(self.prefill_chunk, |pb| pb.chunk);
        self.tail_after_row((rows - 1) % chunk, sample)
    }

    /// The decode step's tail on row `row` of the last batched pass: [`Self::tail_after_batched_rows`]
    /// for any row (the last of one sequence's span in a pass of several).
    fn tail_after_row(&mut self, row: usize, sample: bool) -> Result<()> {
        let d = self.config.hidden_size;
        let stream = self.gpu.stream().clone();
        let pb = self
            .prefill_bufs
            .as_ref()
            .ok_or_else(|| GpuError::InvalidArgument("prefill scratch missing".into()))?;
        let last = pb.x.slice(row * d..(row + 1) * d);
        stream
            .memcpy_dtod(&last, &mut self.bufs.x)
            .during("copying the prompt's last row")?;
        self.launch(Op::Plan(StepOp::FinalNorm))?;
        self.launch(Op::Plan(StepOp::LmHead))?;
        if sample {
            self.launch(Op::Next(true))?;
        }
        Ok(())
    }

    /// Sets the decode step's state: the position it runs and the token it takes.
    fn write_state(&mut self, position: usize, token: u32) -> Result<()> {
        let stream = self.gpu.stream().clone();
        stream
            .memcpy_htod(&[position as i32, token as i32], &mut self.bufs.state)
            .during("writing the step state")?;
        Ok(())
    }

    fn read_state(&self) -> Result<(usize, u32)> {
        let s = self.gpu.download(&self.bufs.state)?;
        self.check_step()?;
        Ok((s[0] as usize, s[1] as u32))
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        check_vocabulary(self.config.vocab_size, tokens)
    }

    /// Starts a sequence: the prompt goes into the device history, position 0.
    fn reset(&mut self, prompt: &[u32]) -> Result<()> {
        if prompt.is_empty() {
            return Err(GpuError::InvalidArgument("the prompt has no tokens".into()));
        }
        if prompt.len() > self.capacity {
            return Err(sieve_model::ModelError::ContextOverflow {
                tokens: prompt.len(),
                context: self.capacity,
            }
            .into());
        }
        self.check_tokens(prompt)?;
        let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        let stream = self.gpu.stream().clone();
        let mut view = self.bufs.history.slice_mut(0..ids.len());
        stream
            .memcpy_htod(&ids, &mut view)
            .during("writing the prompt")?;
        stream
            .memcpy_htod(&[0i32, ids[0]], &mut self.bufs.state)
            .during("writing the step state")?;
        self.len = 0;
        Ok(())
    }

    /// Prompts through cuBLAS GEMMs (the default where every format allows it) or token by
    /// token through the decode step.
    pub fn set_batched_prefill(&mut self, on: bool) {
        self.batched_prefill = on;
    }

    /// True when the prompt runs as one batch (see [`crate::prefill`]): every format has a
    /// batched product or an f16 copy, so unless [`Self::set_batched_prefill`] turned it off.
    pub fn prefill_is_batched(&self) -> bool {
        self.batched_prefill
    }

    /// Tokens per batched pass: a longer prompt runs in chunks of this many.
    pub fn prefill_chunk_tokens(&self) -> usize {
        self.prefill_chunk
    }

    /// Sets the tokens per batched pass (what `SIEVE_PREFILL_CHUNK` sets for every model):
    /// before the first batched pass, which sizes the pass's scratch.
    pub fn set_prefill_chunk_tokens(&mut self, tokens: usize) -> Result<()> {
        use crate::prefill::{MAX_CHUNK, MIN_CHUNK};
        if !(MIN_CHUNK..=MAX_CHUNK).contains(&tokens) {
            return Err(GpuError::InvalidArgument(format!(
                "a batched pass of {tokens} tokens: from {MIN_CHUNK} to {MAX_CHUNK}"
            )));
        }
        if self.prefill_bufs.is_some() && tokens != self.prefill_chunk {
            return Err(GpuError::InvalidArgument(
                "the batched pass's size is set before its first pass".into(),
            ));
        }
        self.prefill_chunk = tokens;
        Ok(())
    }

    /// Runs the prompt and returns the first generated token: every prompt token in one batch
    /// (in chunks), then the last row's logits and the sampler; or, where the prefill is not
    /// batched, one decode step per token, the last one sampling.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<u32> {
        self.reset(prompt)?;
        let n = prompt.len();
        if n > 1 && self.prefill_is_batched() {
            let size = self.prefill_chunk;
            for (c, chunk) in prompt.chunks(size).enumerate() {
                self.prefill_chunk(chunk, c * size)?;
            }
            self.sample_after_batched_prompt(prompt)?;
        } else {
            for _ in 0..n - 1 {
                self.run_step(false)?;
            }
            self.run_step(true)?;
        }
        self.len = prompt.len();
        let (_, tok) = self.read_state()?;
        Ok(tok)
    }

    /// Runs the last sampled token and returns the next one. Fails when the cache is full.
    pub fn next_token(&mut self) -> Result<u32> {
        if self.len >= self.capacity {
            return Err(sieve_model::ModelError::ContextOverflow {
                tokens: self.len + 1,
                context: self.capacity,
            }
            .into());
        }
        self.run_step(true)?;
        self.len += 1;
        let (_, tok) = self.read_state()?;
        Ok(tok)
    }

    /// Enqueues `n` decode steps without reading anything back (for timing): the tokens go to
    /// the device history only.
    pub fn enqueue_decode_steps(&mut self, n: usize) -> Result<()> {
        if self.len + n > self.capacity {
            return Err(sieve_model::ModelError::ContextOverflow {
                tokens: self.len + n,
                context: self.capacity,
            }
            .into());
        }
        for _ in 0..n {
            self.run_step(true)?;
            self.len += 1;
        }
        Ok(())
    }

    /// Logits after every token of `tokens` (teacher-forced from position 0), `[n][V]`: the
    /// perplexity path. The last row is after the last token.
    pub fn logits_all(
        &mut self,
        tokens: &[u32],
        mut each: impl FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        self.reset(tokens)?;
        for i in 0..tokens.len() {
            self.run_step(false)?;
            let logits = self.gpu.download(&self.bufs.logits)?;
            self.check_step()?;
            each(i, &logits)?;
        }
        self.len = tokens.len();
        Ok(())
    }

    /// The residual-stream input of every projection site of every layer after one eager step
    /// of `token` at the current position (for TEAL threshold calibration): `[layer][site]`,
    /// sites as in [`Self::set_thresholds`]. The step is teacher-forced.
    pub fn observe_step(&mut self, on_site: &mut dyn FnMut(usize, usize, &[f32])) -> Result<()> {
        for op in self.ops() {
            self.launch(op)?;
            let site = match op {
                Op::Plan(StepOp::Layer(l, LayerOp::Norm(Norm::Attention))) => {
                    Some((l, 0, &self.bufs.xn))
                }
                Op::Plan(StepOp::Layer(l, LayerOp::Attention)) => Some((l, 1, &self.bufs.att)),
                Op::Plan(StepOp::Layer(l, LayerOp::Norm(Norm::Mlp))) => Some((l, 2, &self.bufs.xn)),
                Op::Plan(StepOp::Layer(l, LayerOp::SwiGlu)) => Some((l, 3, &self.bufs.h)),
                _ => None,
            };
            if let Some((l, s, buf)) = site {
                let v = self.gpu.download(buf)?;
                on_site(l, s, &v);
            }
        }
        self.launch(Op::Next(false))?;
        self.len += 1;
        Ok(())
    }

    /// Starts a sequence of `tokens` for [`Self::observe_step`] / [`Self::profile_step`].
    pub fn start(&mut self, tokens: &[u32]) -> Result<()> {
        self.reset(tokens)
    }

    /// One eager step with CUDA events around every launch group: time by category and the
    /// bytes the products read. Teacher-forced (the state advances to the next history entry).
    pub fn profile_step(&mut self) -> Result<StepProfile> {
        let mut marks = Vec::new();
        let mut prof = StepProfile::default();
        let ops = self.ops();
        self.gpu.synchronize()?;
        for &op in &ops {
            let events = EventPair::new(&self.gpu)?;
            events.start(&self.gpu)?;
            self.launch(op)?;
            events.end(&self.gpu)?;
            marks.push((op.category(), events));
            let input = match op {
                Op::Plan(StepOp::Layer(l, LayerOp::Product(group))) => {
                    let layer = &self.layers[l];
                    Some(match group {
                        Group::Qkv => (&layer.qkv, &self.bufs.xn),
                        Group::O => (&layer.o, &self.bufs.att),
                        Group::GateUp => (&layer.gate_up, &self.bufs.xn),
                        Group::Down => (&layer.down, &self.bufs.h),
                    })
                }
                Op::Plan(StepOp::LmHead) => Some((&self.lm_head, &self.bufs.xn)),
                _ => None,
            };
            if let Some((lin, buf)) = input {
                let x = self.gpu.download(buf)?;
                prof.weight_bytes += lin.bytes_for_input(&x);
            }
        }
        self.launch(Op::Next(false))?;
        self.gpu.synchronize()?;
        for (cat, events) in &marks {
            let us = events.elapsed_us()?;
            match cat {
                Category::Linear => prof.linear_us += us,
                Category::Attention => prof.attention_us += us,
                Category::Other => prof.other_us += us,
            }
        }
        prof.launches = self.launches_per_step();
        self.len += 1;
        Ok(prof)
    }

    /// Moves the sequence to position `len` without running the positions before it (their
    /// cache entries keep whatever they hold): for timing decode at a long context.
    pub fn seek(&mut self, len: usize, token: u32) -> Result<()> {
        if len >= self.capacity {
            return Err(GpuError::InvalidArgument(format!(
                "position {len} is outside the context of {}",
                self.capacity
            )));
        }
        self.check_tokens(&[token])?;
        let stream = self.gpu.stream().clone();
        stream
            .memcpy_htod(&[len as i32, token as i32], &mut self.bufs.state)
            .during("writing the step state")?;
        self.len = len;
        Ok(())
    }
}

/// Serving: a pool of KV cache slots, one sequence each, and steps that end at the logits.
///
/// The serving engine (`sieve-serve`) samples on the host, so its step is the plan's ops
/// without the sampler: the host writes `[position, token]` into the step state, replays the
/// slot's graph (the slot's cache addresses are captured in it, one graph per slot) and reads
/// the `[vocab]` logits back.
impl GpuModel {
    /// Gives the model `slots` KV caches of `capacity()` positions each (replacing the one it
    /// was built with; what that cache held is gone). Fails, before allocating, when the pool
    /// does not fit in the free GPU memory.
    pub fn with_slots(mut self, slots: usize) -> Result<Self> {
        self.set_slots(slots)?;
        Ok(self)
    }

    /// [`Self::with_slots`] in place.
    pub fn set_slots(&mut self, slots: usize) -> Result<()> {
        if slots == 0 {
            return Err(GpuError::InvalidArgument(
                "the KV cache pool needs at least one slot".into(),
            ));
        }
        let c = &self.config;
        let hd = c.head_dim;
        let precision = self.bufs.kv.precision();
        let per_slot = c.num_layers * self.capacity * c.num_kv_heads;
        let rows = per_slot.checked_mul(slots);
        let bytes = rows
            .and_then(|r| DeviceKvCache::bytes_for(precision, r, hd))
            .ok_or_else(|| {
                GpuError::InvalidArgument(format!(
                    "{slots} KV cache slots overflow the address space"
                ))
            })?;
        let rows = rows.unwrap_or(0);
        // The current caches are freed first, so only the growth must fit.
        check_memory(&self.gpu, bytes.saturating_sub(self.report.kv_cache_bytes))?;
        // Nothing captured may outlive the caches it addresses, whatever happens below.
        self.drop_graphs();
        let old_rows = self.bufs.kv.rows(hd);
        let stream = self.gpu.stream().clone();
        self.bufs.kv = DeviceKvCache::allocate(&stream, precision, 1, hd)?;
        match DeviceKvCache::allocate(&stream, precision, rows, hd) {
            Ok(pool) => self.bufs.kv = pool,
            Err(e) => {
                // Back to the pool that was there (it fitted a moment ago); if even that
                // fails, no position is left, so every step is refused instead of writing
                // past a one-row cache.
                self.slot_graphs = (0..self.slots).map(|_| None).collect();
                match DeviceKvCache::allocate(&stream, precision, old_rows, hd) {
                    Ok(pool) => self.bufs.kv = pool,
                    Err(_) => {
                        self.capacity = 0;
                        self.report.kv_cache_bytes = 0;
                    }
                }
                self.len = 0;
                return Err(e);
            }
        }
        self.report.kv_cache_bytes = bytes;
        self.slots = slots;
        self.slot = 0;
        self.slot_graphs = (0..slots).map(|_| None).collect();
        self.len = 0;
        Ok(())
    }

    /// Runs decode steps as a CUDA graph of the plan's kernels or as one persistent kernel.
    /// Persistent needs a dense f16 model with the f16 cache: otherwise an error says why and
    /// the mode stays as it was.
    pub fn set_step_mode(&mut self, mode: StepMode) -> Result<()> {
        if mode == StepMode::Persistent && self.tp.is_some() {
            return Err(GpuError::Unsupported(
                "the persistent step has no all-reduce: tensor parallelism runs the graph step"
                    .into(),
            ));
        }
        if mode == StepMode::Persistent {
            let step = self.build_persistent()?;
            self.drop_graphs();
            self.persistent = Some((step, self.slot));
        } else {
            self.drop_graphs();
        }
        self.step_mode = mode;
        self.report.launches_per_step = match mode {
            StepMode::Graph => self.launches_per_step(),
            StepMode::Persistent => 2,
        };
        Ok(())
    }
    pub fn step_mode(&self) -> StepMode {
        self.step_mode
    }

    /// Stamps the persistent step's stages per block from the next step on
    /// ([`Self::last_trace`]).
    pub fn set_persistent_trace(&mut self, on: bool) {
        self.persistent_trace = on;
        self.drop_graphs();
    }

    /// The stage stamps of the last persistent step (after it finished), if traced.
    pub fn last_trace(&self) -> Result<Option<sieve_cuda::persistent::Trace>> {
        match &self.persistent {
            Some((step, _)) => {
                self.gpu.synchronize()?;
                Ok(step.trace(&self.gpu)?)
            }
            None => Ok(None),
        }
    }

    /// An error if a persistent step aborted (its watchdog fired); call after a synchronize.
    pub fn check_step(&self) -> Result<()> {
        if let Some((step, _)) = &self.persistent {
            step.check(&self.gpu)?;
        }
        Ok(())
    }

    /// Forgets every captured step (after a change to what the launches do).
    fn drop_graphs(&mut self) {
        self.persistent = None;
        self.graphs = [None, None];
        self.slot_graphs.iter_mut().for_each(|g| *g = None);
        self.seq_graphs = Default::default();
        self.seq_warm = [false; 7];
    }

    /// KV cache slots in the pool.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// How the KV cache stores keys and values.
    pub fn kv_precision(&self) -> KvPrecision {
        self.bufs.kv.precision()
    }

    /// Layer `l`'s cache of the current slot, as the kernels address it.
    fn cache_view(&self, l: usize) -> Result<KvCache> {
        self.cache_view_at(self.slot, l)
    }

    /// Layer `l`'s cache of slot `slot`: `(slot * layers + l) * capacity` positions into the
    /// pool (`crate::kv_cache`).
    fn cache_view_at(&self, slot: usize, l: usize) -> Result<KvCache> {
        let c = &self.config;
        let values = (slot * c.num_layers + l) * self.capacity * c.num_kv_heads * c.head_dim;
        self.bufs.kv.view_at(&self.gpu, values, c.head_dim)
    }

    /// Runs `prompt` into slot `slot` from position 0 (what the slot held is overwritten) and
    /// returns the logits after its last token, `[vocab]`.
    pub fn prefill_slot(&mut self, slot: usize, prompt: &[u32]) -> Result<Vec<f32>> {
        self.extend_slot(slot, 0, prompt)
    }

    /// Runs `tokens` into slot `slot` at positions `start ..` (positions before `start` must
    /// hold the sequence; from `start` on the slot is overwritten) and returns the logits after
    /// the last one, `[vocab]`: one chunk of a prompt prefilled in several.
    pub fn extend_slot(&mut self, slot: usize, start: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_span(slot, start, tokens)?;
        let Some((&last, before)) = tokens.split_last() else {
            return Err(GpuError::InvalidArgument("the prompt has no tokens".into()));
        };
        self.slot = slot;
        // Several tokens go through the batched pass whole and only the last row takes the
        // step's tail, as `prefill` does, so a slot's answer is the library's `generate`'s
        // (the decode step's products round differently from the batched pass's: H100,
        // 2026-12-05, two server tests' greedy texts parted after a token that way).
        let result = if !before.is_empty() && self.prefill_is_batched() {
            self.fill_current_slot(start, tokens)
                .and_then(|()| self.tail_after_batched_rows(tokens.len(), false))
        } else {
            self.fill_current_slot(start, before)
                .and_then(|()| self.run_logits_step(start + before.len(), last))
        }
        .and_then(|()| Ok(self.gpu.download(&self.bufs.logits)?));
        self.slot = 0;
        result
    }

    /// Runs `tokens` into slot `slot` at positions `start ..` without logits (a chunk of a
    /// prompt that is not its last), as a whole prompt's tokens before its last would go.
    pub fn fill_slot(&mut self, slot: usize, start: usize, tokens: &[u32]) -> Result<()> {
        self.check_span(slot, start, tokens)?;
        self.slot = slot;
        let result = self.fill_current_slot(start, tokens);
        self.slot = 0;
        result
    }

    /// Prompt chunks of several sequences, each into its own slot: for each, what
    /// [`Self::extend_slot`] (`logits`) or [`Self::fill_slot`] does, but the chunks share
    /// batched passes of up to [`Self::prefill_chunk_tokens`] rows, so that the weights are
    /// read once per pass and not once per prompt (a server admitting many prompts at once).
    ///
    /// Each chunk's RoPE, cache writes and attention are its own slot's, through the kernels
    /// a lone chunk of its size takes, and its logits come from the same tail (its last row's
    /// final norm and LM head). A pass holds only chunks whose products take the kernels they
    /// would take alone ([`Self::product_path_bounds`]: e.g. a low-bit model's chunks under 65
    /// rows share passes of at most 64, where its kernel multiplies each row as it would
    /// alone), so a chunk's logits can differ from its lone prefill's only where cuBLAS sums
    /// a GEMM of another token count in another order. A chunk of one token with logits (a
    /// lone one runs the decode step) or of more tokens than a pass holds, and every chunk of
    /// a model without batched prefill, runs alone. Every chunk is checked before anything
    /// runs (slots distinct, no chunk empty). Returns each chunk's logits (`None` where not
    /// asked), in order.
    pub fn extend_slots(&mut self, chunks: &[SlotChunk<'_>]) -> Result<Vec<Option<Vec<f32>>>> {
        for (i, c) in chunks.iter().enumerate() {
            self.check_span(c.slot, c.start, c.tokens)?;
            if c.tokens.is_empty() {
                return Err(GpuError::InvalidArgument(format!(
                    "the prompt chunk for slot {} has no tokens",
                    c.slot
                )));
            }
            if chunks[..i].iter().any(|o| o.slot == c.slot) {
                return Err(GpuError::InvalidArgument(format!(
                    "slot {} appears twice in one batch of prompt chunks",
                    c.slot
                )));
            }
        }
        let capacity = self.prefill_chunk;
        let batched = self.prefill_is_batched();
        let shared = |c: &SlotChunk<'_>| {
            batched && c.tokens.len() <= capacity && !(c.logits && c.tokens.len() == 1)
        };
        let (together, alone): (Vec<usize>, Vec<usize>) =
            (0..chunks.len()).partition(|&i| shared(&chunks[i]));
        let mut out: Vec<Option<Vec<f32>>> = vec![None; chunks.len()];
        for i in alone {
            let c = chunks[i];
            if c.logits {
                out[i] = Some(self.extend_slot(c.slot, c.start, c.tokens)?);
            } else {
                self.fill_slot(c.slot, c.start, c.tokens)?;
            }
        }
        for pass in pack_passes(chunks, &together, &self.product_path_bounds(), capacity) {
            self.run_chunks_pass(chunks, &pass, &mut out)?;
        }
        Ok(out)
    }

    /// Row counts at which some layer product of this model changes kernel: a low-bit matrix
    /// (tensor-core layout, or a column-major one's batch twin) from its kernel to its f16 copy
    /// at [`LOWBIT_DECODE_MIN_TOKENS`], an IE-BME one at [`IE_BME_DECODE_MIN_TOKENS`], a
    /// Tiled-CBC one from the SpMM to its f16 copy past [`TCBC_SPMM_MAX_TOKENS`], a SlideSparse
    /// one from `mma.sp` to its f16 copy at [`sieve_cuda::slide::DECODE_MIN_TOKENS`]. Sorted,
    /// distinct.
    ///
    /// [`LOWBIT_DECODE_MIN_TOKENS`]: crate::prefill::LOWBIT_DECODE_MIN_TOKENS
    /// [`IE_BME_DECODE_MIN_TOKENS`]: crate::prefill::IE_BME_DECODE_MIN_TOKENS
    /// [`TCBC_SPMM_MAX_TOKENS`]: crate::prefill::TCBC_SPMM_MAX_TOKENS
    fn product_path_bounds(&self) -> Vec<usize> {
        use crate::matrix::DeviceMatrix;
        let mut bounds: Vec<usize> = self
            .layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down])
            .flat_map(|lin| lin.parts.iter().map(move |p| (p, lin.cols)))
            .filter_map(|(p, k)| match &p.matrix {
                DeviceMatrix::LowBit(_) | DeviceMatrix::LowBitCols(_, Some(_)) => {
                    Some(crate::prefill::LOWBIT_DECODE_MIN_TOKENS)
                }
                DeviceMatrix::IeBme(_) => Some(crate::prefill::IE_BME_DECODE_MIN_TOKENS),
                DeviceMatrix::Slide(_) => Some(sieve_cuda::slide::DECODE_MIN_TOKENS),
                DeviceMatrix::TiledCbc(t) if t.spmm_supports(k) => {
                    Some(crate::prefill::TCBC_SPMM_MAX_TOKENS + 1)
                }
                _ => None,
            })
            .collect();
        bounds.sort_unstable();
        bounds.dedup();
        bounds
    }

    /// One batched pass over the checked chunks `chunks[pass]` (their rows fit the pass), then
    /// the tail of each that wants logits.
    fn run_chunks_pass(
        &mut self,
        chunks: &[SlotChunk<'_>],
        pass: &[usize],
        out: &mut [Option<Vec<f32>>],
    ) -> Result<()> {
        let mut tokens: Vec<u32> = Vec::new();
        let mut spans = Vec::with_capacity(pass.len());
        for &i in pass {
            let c = &chunks[i];
            spans.push(PassSpan {
                slot: c.slot,
                first: c.start,
                row: tokens.len(),
                len: c.tokens.len(),
            });
            tokens.extend_from_slice(c.tokens);
        }
        self.upload_row_tokens(&tokens)?;
        self.rows_through_layers(tokens.len(), PassRows::Spans(&spans))?;
        for (&i, span) in pass.iter().zip(&spans) {
            if chunks[i].logits {
                self.tail_after_row(span.row + span.len - 1, false)?;
                out[i] = Some(self.gpu.download(&self.bufs.logits)?);
            }
        }
        Ok(())
    }

    /// Refuses a slot outside the pool, positions past the context and tokens outside the
    /// vocabulary, before anything runs.
    pub fn check_span(&self, slot: usize, start: usize, tokens: &[u32]) -> Result<()> {
        check_span_of(
            self.slots,
            self.capacity,
            self.config.vocab_size,
            slot,
            start,
            tokens,
        )
    }

    /// `tokens` into the current slot's cache at positions `start ..`: through the batched
    /// prefill where the formats allow, else one decode step each.
    fn fill_current_slot(&mut self, start: usize, tokens: &[u32]) -> Result<()> {
        if !tokens.is_empty() && self.prefill_is_batched() {
            let size = self.prefill_chunk;
            for (c, chunk) in tokens.chunks(size).enumerate() {
                self.prefill_chunk(chunk, start + c * size)?;
            }
        } else {
            for (i, &token) in tokens.iter().enumerate() {
                self.run_logits_step(start + i, token)?;
            }
        }
        Ok(())
    }

    /// Runs `token` at `position` of slot `slot` (positions before it must hold the sequence)
    /// and returns the logits, `[vocab]`.
    pub fn step_slot(&mut self, slot: usize, position: usize, token: u32) -> Result<Vec<f32>> {
        self.check_span(slot, position, &[token])?;
        self.slot = slot;
        let result = self
            .run_logits_step(position, token)
            .and_then(|()| Ok(self.gpu.download(&self.bufs.logits)?));
        self.slot = 0;
        result
    }

    /// True when a decode step of several sequences may run as one batched pass (every format
    /// has a token-batch path: see [`crate::prefill`]; [`Self::batch_pays`] says from how many
    /// sequences); false when [`Self::set_batched_prefill`] turned batching off, and then
    /// [`Self::step_slots`] runs the sequences one graph replay after another.
    pub fn decode_is_batched(&self) -> bool {
        self.batched_prefill
    }

    /// The fewest sequences a decode step runs as one batched pass ([`Self::decode_is_batched`]
    /// permitting), past the few that [`Self::batch_pays`] sends through the union products.
    /// 2 when every matrix is multiplied where it lies; with Tiled-CBC matrices the SpMM
    /// multiplies, [`SPMM_MIN_BATCH`]; with one the pass decodes to f16 first (a
    /// Tiled-CBC one past the SpMM, any Balanced-CBC one: its step per sequence costs what
    /// Tiled-CBC's does, not measured in a pass yet), [`DECODED_MIN_BATCH`].
    pub fn min_batched_sequences(&self) -> usize {
        let mut all: Vec<&DeviceLinear> = vec![&self.lm_head];
        for l in &self.layers {
            all.extend([&l.qkv, &l.o, &l.gate_up, &l.down]);
        }
        if crate::prefill::step_decoded_len(&all, self.prefill_chunk) == 0 {
            2
        } else if crate::prefill::tiled_cbc_by_spmm(&all, MAX_SEQUENCES)
            && !crate::prefill::always_decoded(&all)
        {
            SPMM_MIN_BATCH
        } else {
            DECODED_MIN_BATCH
        }
    }

    /// True when a step of `n` sequences runs as one batched pass: from
    /// [`Self::min_batched_sequences`] on, and for the few sequences whose column-format
    /// matrices all go through their union products ([`crate::prefill::union_covers`]).
    pub fn batch_pays(&self, n: usize) -> bool {
        if !self.decode_is_batched() {
            return false;
        }
        if n >= self.min_batched_sequences() {
            return true;
        }
        let mut all: Vec<&DeviceLinear> = vec![&self.lm_head];
        for l in &self.layers {
            all.extend([&l.qkv, &l.o, &l.gate_up, &l.down]);
        }
        crate::prefill::union_covers(&all, n)
    }

    /// One decode step of several sequences: `(slot, position, token)` each, slots distinct.
    /// Returns `[n][vocab]` logits in the order given. Every argument is checked before
    /// anything runs. With [`Self::decode_is_batched`], the sequences go through every layer
    /// together (the products read their weights once for all of them; each row's RoPE, cache
    /// write and attention use its own slot and position); otherwise, and for one sequence,
    /// each replays its slot's captured step.
    pub fn step_slots(&mut self, batch: &[(usize, usize, u32)]) -> Result<Vec<f32>> {
        self.check_batch(batch)?;
        let v = self.config.vocab_size;
        let mut logits = Vec::with_capacity(batch.len() * v);
        if !self.batch_pays(batch.len()) {
            for &(slot, position, token) in batch {
                logits.extend(self.step_slot(slot, position, token)?);
            }
            return Ok(logits);
        }
        for part in batch.chunks(MAX_SEQUENCES) {
            self.run_sequences_step(part)?;
            let bufs = self
                .seq_bufs
                .as_ref()
                .ok_or_else(|| GpuError::InvalidArgument("sequence scratch missing".into()))?;
            let rows = self
                .gpu
                .stream()
                .clone_dtoh(&bufs.logits.slice(0..part.len() * v))
                .during("copying the batch's logits to the host")?;
            logits.extend_from_slice(&rows);
        }
        Ok(logits)
    }

    /// [`Self::step_slots`] for sequences that all decode greedily (no repetition penalty):
    /// each one's next token, the argmax of its logits chosen on the device, so the host reads
    /// one id per sequence instead of its logits (the CPU sampler's rule: ties keep the lowest
    /// id). A sequence whose logits hold NaN or +inf, or are all -inf, gets an error naming its
    /// slot in its own row; the others' tokens stand.
    pub fn step_slots_argmax(&mut self, batch: &[(usize, usize, u32)]) -> Result<Vec<Result<u32>>> {
        let v = self.config.vocab_size;
        self.step_and_choose(batch, |m, logits, rows| {
            let bufs = m
                .seq_bufs
                .as_ref()
                .ok_or_else(|| GpuError::InvalidArgument("sequence scratch missing".into()))?;
            let g = &m.gpu;
            sampling::argmax_rows(g, logits, v, rows.len(), dev_ptr(g, &bufs.chosen))?;
            Ok(g.stream()
                .clone_dtoh(&bufs.chosen.slice(0..rows.len()))
                .during("copying the batch's tokens to the host")?)
        })
    }

    /// One decode step of several sequences, each sampled on the device with its own
    /// arguments (`sampling[i]`: the kernel arguments and the sequence's recent tokens for the
    /// repetition penalty, the last [`sieve_model::generate::REPETITION_WINDOW`] used), so the
    /// host reads one id per sequence. The draw is the GPU sampler's (`sampling.cu`: the same
    /// rules as the CPU's, top-k / top-p found by bisection, a hash of seed and position), not
    /// the CPU sampler's generator. A sequence whose logits hold NaN or +inf, or are all -inf,
    /// gets its own error.
    pub fn step_slots_sampled(
        &mut self,
        batch: &[(usize, usize, u32)],
        sampling: &[(SampleArgs, &[u32])],
    ) -> Result<Vec<Result<u32>>> {
        if sampling.len() != batch.len() {
            return Err(GpuError::InvalidArgument(format!(
                "{} sampling settings for {} sequences",
                sampling.len(),
                batch.len()
            )));
        }
        self.step_and_choose(batch, |m, logits, rows| {
            m.sample_on_device(logits, &batch[rows.clone()], &sampling[rows])
        })
    }

    /// A decode step of `batch` (checked first) with each sequence's token chosen on the
    /// device: one batched pass per [`MAX_SEQUENCES`] where it pays, else each slot's own
    /// captured step; `choose(model, logits, rows)` turns the logits of `batch[rows]` (one row
    /// per sequence at `logits`) into the kernels' ids, whose codes -1 (every logit -inf) and
    /// other negatives (NaN or +inf) become that sequence's error.
    fn step_and_choose(
        &mut self,
        batch: &[(usize, usize, u32)],
        mut choose: impl FnMut(
            &mut Self,
            sieve_cuda::DevPtr,
            std::ops::Range<usize>,
        ) -> Result<Vec<i32>>,
    ) -> Result<Vec<Result<u32>>> {
        self.check_batch(batch)?;
        self.ensure_seq_bufs()?;
        let mut chosen: Vec<i32> = Vec::with_capacity(batch.len());
        if !self.batch_pays(batch.len()) {
            // Each sequence's own captured step, its token chosen where its logits are.
            for (i, &(slot, position, token)) in batch.iter().enumerate() {
                self.slot = slot;
                let ran = self.run_logits_step(position, token);
                self.slot = 0;
                ran?;
                let logits = dev_ptr(&self.gpu, &self.bufs.logits);
                chosen.extend(choose(self, logits, i..i + 1)?);
            }
        } else {
            for (c, part) in batch.chunks(MAX_SEQUENCES).enumerate() {
                self.run_sequences_step(part)?;
                let bufs = self
                    .seq_bufs
                    .as_ref()
                    .ok_or_else(|| GpuError::InvalidArgument("sequence scratch missing".into()))?;
                let logits = dev_ptr(&self.gpu, &bufs.logits);
                let first = c * MAX_SEQUENCES;
                chosen.extend(choose(self, logits, first..first + part.len())?);
            }
        }
        // The two kernels share their codes.
        const _: () = assert!(
            sampling::ARGMAX_ALL_NEG_INF == sampling::SAMPLE_ALL_NEG_INF
                && sampling::ARGMAX_NOT_FINITE == sampling::SAMPLE_NOT_FINITE
        );
        Ok(chosen
            .into_iter()
            .zip(batch)
            .map(|(id, &(slot, position, _))| match id {
                sampling::ARGMAX_ALL_NEG_INF => Err(GpuError::InvalidArgument(format!(
                    "slot {slot} at position {position}: every logit is -inf"
                ))),
                id if id < 0 => Err(GpuError::InvalidArgument(format!(
                    "slot {slot} at position {position}: the logits hold NaN or +inf"
                ))),
                id => Ok(id as u32),
            })
            .collect())
    }

    /// `sample_rows` over the `rows.len()` rows of logits at `logits` (at most
    /// [`MAX_SEQUENCES`]); returns the kernel's ids (negative: no token).
    fn sample_on_device(
        &mut self,
        logits: sieve_cuda::DevPtr,
        rows: &[(usize, usize, u32)],
        sampling: &[(SampleArgs, &[u32])],
    ) -> Result<Vec<i32>> {
        let n = rows.len();
        let mut args = Vec::with_capacity(n);
        let mut recent = vec![0i32; n * SAMPLE_WINDOW];
        for (i, (&(_, position, _), (a, tokens))) in rows.iter().zip(sampling).enumerate() {
            let window = a.window.min(SAMPLE_WINDOW);
            let tail = &tokens[tokens.len().saturating_sub(window)..];
            for (dst, &t) in recent[i * SAMPLE_WINDOW..].iter_mut().zip(tail) {
                *dst = t as i32;
            }
            args.push(sampling::SampleRowArgs::new(a, position, tail.len())?);
        }
        let stream = self.gpu.stream().clone();
        let bufs = self
            .seq_bufs
            .as_mut()
            .ok_or_else(|| GpuError::InvalidArgument("sequence scratch missing".into()))?;
        let mut view = bufs.sample_args.slice_mut(0..n);
        stream
            .memcpy_htod(&args, &mut view)
            .during("writing the batch's sampling arguments")?;
        let mut view = bufs.recent.slice_mut(0..n * SAMPLE_WINDOW);
        stream
            .memcpy_htod(&recent, &mut view)
            .during("writing the batch's penalty windows")?;
        let g = &self.gpu;
        sampling::sample_rows(
            g,
            logits,
            self.config.vocab_size,
            dev_ptr(g, &bufs.sample_args),
            dev_ptr(g, &bufs.recent),
            SAMPLE_WINDOW,
            n,
            dev_ptr(g, &bufs.chosen),
        )?;
        Ok(stream
            .clone_dtoh(&bufs.chosen.slice(0..n))
            .during("copying the batch's tokens to the host")?)
    }

    /// Refuses a batch with a slot outside the pool or twice, a position past the context or
    /// a token outside the vocabulary, before anything runs.
    fn check_batch(&self, batch: &[(usize, usize, u32)]) -> Result<()> {
        for (i, &(slot, position, token)) in batch.iter().enumerate() {
            self.check_span(slot, position, &[token])?;
            if batch[..i].iter().any(|&(s, _, _)| s == slot) {
                return Err(GpuError::InvalidArgument(format!(
                    "slot {slot} appears twice in one decode step"
                )));
            }
        }
        Ok(())
    }

    /// The batched pass of [`Self::step_slots`] for at most [`MAX_SEQUENCES`] checked rows,
    /// logits left in the sequence scratch.
    ///
    /// With graphs, the batch is rounded up to a power of two (a bucket: 2, 4, .. 64) and the
    /// bucket's pass replays a graph captured at its second use (the first runs eagerly, so
    /// that every kernel is loaded and cuBLAS has chosen its algorithms outside the capture).
    /// The extra rows run token 0 at the first sequence's position with its slot negated
    /// (`-(slot + 1)`): they attend over that slot and write no cache (`rope.cu`,
    /// `attention.cu`), and their logits are never read.
    fn run_sequences_step(&mut self, batch: &[(usize, usize, u32)]) -> Result<()> {
        self.ensure_seq_bufs()?;
        let n = batch.len();
        let rows = if self.use_graphs {
            n.next_power_of_two().clamp(2, MAX_SEQUENCES)
        } else {
            n
        };
        let (first_slot, first_position, _) = batch[0];
        let padding = -(first_slot as i32) - 1;
        // Padding rows run token 0, not the first sequence's: were one to write the cache
        // anyway, that sequence's next logits would show it.
        let tokens: Vec<u32> = batch
            .iter()
            .map(|&(_, _, t)| t)
            .chain(std::iter::repeat_n(0, rows - n))
            .collect();
        self.upload_row_tokens(&tokens)?;
        let seqs: Vec<i32> = batch
            .iter()
            .flat_map(|&(slot, position, _)| [position as i32, slot as i32])
            .chain((n..rows).flat_map(|_| [first_position as i32, padding]))
            .collect();
        let stream = self.gpu.stream().clone();
        let bufs = self
            .seq_bufs
            .as_mut()
            .ok_or_else(|| GpuError::InvalidArgument("sequence scratch missing".into()))?;
        let mut view = bufs.seqs.slice_mut(0..seqs.len());
        stream
            .memcpy_htod(&seqs, &mut view)
            .during("writing the batch's positions")?;
        if !self.use_graphs {
            return self.enqueue_sequences_pass(rows);
        }
        let bucket = rows.trailing_zeros() as usize;
        if self.seq_graphs[bucket].is_none() {
            if !self.seq_warm[bucket] {
                self.seq_warm[bucket] = true;
                return self.enqueue_sequences_pass(rows);
            }
            // Plain edges: the pass holds cuBLAS kernels and memsets, which make no promise
            // to wait for a programmatic predecessor.
            match self.capture_with(false, |m| m.enqueue_sequences_pass(rows)) {
                Ok(graph) => self.seq_graphs[bucket] = Some(graph),
                Err(e) => {
                    self.report.notes.push(format!(
                        "CUDA graph capture of a {rows}-sequence step failed ({e}); steps run as eager launches"
                    ));
                    self.graph_capture_failed()?;
                    return self.enqueue_sequences_pass(rows);
                }
            }
        }
        if let Some(graph) = &self.seq_graphs[bucket] {
            graph.launch()?;
        }
        Ok(())
    }

    /// Allocates now the scratch that batched prefill and many-sequence steps would allocate
    /// at their first use (the serving engine calls it at start-up, so that a pool that leaves
    /// too little memory fails there, not in a request).
    pub fn reserve_scratch(&mut self) -> Result<()> {
        self.prefill_scratch()?;
        self.ensure_seq_bufs()
    }

    /// Allocates the many-sequence scratch at its first use.
    fn ensure_seq_bufs(&mut self) -> Result<()> {
        if self.seq_bufs.is_some() {
            return Ok(());
        }
        let v = self.config.vocab_size;
        let stream = self.gpu.stream();
        self.seq_bufs = Some(SequenceBuffers {
            seqs: stream
                .alloc_zeros::<i32>(2 * MAX_SEQUENCES)
                .during("allocating the batch's positions")?,
            logits: stream
                .alloc_zeros::<f32>(MAX_SEQUENCES * v)
                .during("allocating the batch's logits")?,
            chosen: stream
                .alloc_zeros::<i32>(MAX_SEQUENCES)
                .during("allocating the batch's tokens")?,
            sample_args: stream
                .alloc_zeros::<sampling::SampleRowArgs>(MAX_SEQUENCES)
                .during("allocating the batch's sampling arguments")?,
            recent: stream
                .alloc_zeros::<i32>(MAX_SEQUENCES * SAMPLE_WINDOW)
                .during("allocating the batch's penalty windows")?,
        });
        Ok(())
    }

    /// The launches of a batched decode pass of `n` rows whose tokens and `[position, slot]`
    /// pairs are on the device: every layer, the final norm and the head into the sequence
    /// scratch's logits.
    fn enqueue_sequences_pass(&self, n: usize) -> Result<()> {
        let c = &self.config;
        let (d, v) = (c.hidden_size, c.vocab_size);
        let row = c.num_kv_heads * c.head_dim;
        let slot_stride = c.num_layers * self.capacity * row;
        let g = &self.gpu;
        let bufs = self
            .seq_bufs
            .as_ref()
            .ok_or_else(|| GpuError::InvalidArgument("sequence scratch missing".into()))?;
        self.rows_through_layers(
            n,
            PassRows::Sequences {
                seqs: dev_ptr(g, &bufs.seqs),
                slot_stride,
            },
        )?;
        let pb = self
            .prefill_bufs
            .as_ref()
            .ok_or_else(|| GpuError::InvalidArgument("prefill scratch missing".into()))?;
        let (x, xn) = (dev_ptr(g, &pb.x), dev_ptr(g, &pb.xn));
        rmsnorm_rows(
            g,
            x,
            dev_ptr(g, &self.final_norm),
            xn,
            n,
            d,
            c.rms_norm_eps,
            self.lm_head.weight_span(g, self.l2_prefetch),
        )?;
        crate::prefill::linear_rows(
            g,
            &self.lm_head,
            xn,
            d,
            dev_ptr(g, &pb.a16),
            n,
            dev_ptr(g, &bufs.logits),
            v,
            0.0,
            dev_ptr(g, &pb.w16),
            pb.w16.len(),
        )
    }

    /// Captures the step graph of every slot that has none yet (each holds its slot's cache
    /// addresses), so that no request pays for a capture; returns how many were captured.
    /// Nothing runs. Without graphs (or when the driver refuses a capture, noted in the report
    /// as in [`Self::prefill`]) steps run as eager launches and nothing is captured.
    pub fn capture_slots(&mut self) -> Result<usize> {
        let mut captured = 0;
        for slot in 0..self.slots {
            if !self.use_graphs || self.slot_graphs[slot].is_some() {
                continue;
            }
            self.slot = slot;
            let graph = self.capture_ops(&self.ops());
            self.slot = 0;
            match graph {
                Ok(graph) => {
                    self.slot_graphs[slot] = Some(graph);
                    captured += 1;
                }
                Err(e) => {
                    self.report.notes.push(format!(
                        "CUDA graph capture failed ({e}); steps run as eager launches"
                    ));
                    self.graph_capture_failed()?;
                }
            }
        }
        Ok(captured)
    }

    /// One step of the current slot up to the logits: a replay of the slot's graph (captured
    /// on first use) or eager launches.
    fn run_logits_step(&mut self, position: usize, token: u32) -> Result<()> {
        self.write_state(position, token)?;
        if !self.use_graphs {
            return self.ops().into_iter().try_for_each(|op| self.launch(op));
        }
        if self.slot_graphs[self.slot].is_none() {
            match self.capture_ops(&self.ops()) {
                Ok(graph) => self.slot_graphs[self.slot] = Some(graph),
                Err(e) => {
                    self.report.notes.push(format!(
                        "CUDA graph capture failed ({e}); steps run as eager launches"
                    ));
                    self.graph_capture_failed()?;
                    return self.ops().into_iter().try_for_each(|op| self.launch(op));
                }
            }
        }
        if let Some(graph) = &self.slot_graphs[self.slot] {
            graph.launch()?;
        }
        Ok(())
    }
}

/// Refuses a model whose fixed buffers do not fit in the free GPU memory.
/// The passes [`GpuModel::extend_slots`] runs `chunks[together]` in: chunks whose lengths lie
/// between the same two of `bounds` (row counts where a product changes kernel) share passes
/// whose rows stay below the next bound and within `capacity`, filled in order, each as full
/// as the next whole chunk allows; so every chunk's products take the kernels they take when
/// it runs alone. Every chunk of `together` is at most `capacity` rows.
fn pack_passes(
    chunks: &[SlotChunk<'_>],
    together: &[usize],
    bounds: &[usize],
    capacity: usize,
) -> Vec<Vec<usize>> {
    let class = |rows: usize| bounds.iter().filter(|&&b| b <= rows).count();
    let limit = |class: usize| {
        bounds
            .get(class)
            .map_or(capacity, |&b| (b - 1).min(capacity))
    };
    let mut passes: Vec<Vec<usize>> = Vec::new();
    for c in 0..=bounds.len() {
        let mut pass: Vec<usize> = Vec::new();
        let mut rows = 0;
        for &i in together {
            let len = chunks[i].tokens.len();
            if class(len) != c {
                continue;
            }
            if rows + len > limit(c) && !pass.is_empty() {
                passes.push(std::mem::take(&mut pass));
                rows = 0;
            }
            pass.push(i);
            rows += len;
        }
        if !pass.is_empty() {
            passes.push(pass);
        }
    }
    passes
}

/// An error naming the bytes needed and free when `needed` bytes do not fit the GPU's free
/// memory now (checked before an allocation, so that a model too large says so).
pub(crate) fn check_memory(gpu: &Gpu, needed: usize) -> Result<()> {
    // The query reads the calling thread's current context: bind this GPU's first, since the
    // caller may be any thread (a tensor-parallel rank's, or the server's).
    gpu.context()
        .bind_to_thread()
        .during("binding the context to read its free memory")?;
    let (free, total) =
        cudarc::driver::result::mem_get_info().during("reading the free GPU memory")?;
    if needed > free {
        return Err(GpuError::OutOfMemory {
            needed,
            free,
            total,
        });
    }
    Ok(())
}

fn check_layer(c: &ModelConfig, l: usize, hl: &HostLayer) -> Result<()> {
    let (d, hd, nh, nkv, inter) = (
        c.hidden_size,
        c.head_dim,
        c.num_heads,
        c.num_kv_heads,
        c.intermediate_size,
    );
    let want = [(nh * hd, d), (nkv * hd, d), (nkv * hd, d)];
    let shape = |m: &HostMatrix| (m.rows(), m.cols());
    let ok = hl.qkv.len() == 3
        && hl.qkv.iter().zip(want).all(|((m, _), w)| shape(m) == w)
        && shape(&hl.o.0) == (d, nh * hd)
        && hl.gate_up.len() == 2
        && hl.gate_up.iter().all(|(m, _)| shape(m) == (inter, d))
        && shape(&hl.down.0) == (d, inter)
        && hl.input_norm.len() == d
        && hl.post_norm.len() == d
        && hl
            .qkv_bias
            .as_ref()
            .is_none_or(|b| b.len() == (nh + 2 * nkv) * hd);
    if !ok {
        return Err(GpuError::InvalidArgument(format!(
            "layer {l}: projection shapes do not match the model configuration"
        )));
    }
    Ok(())
}

/// On a machine of 8 or more CPU threads, every kernel family is compiled (or read from the
/// disk cache) at once on all of them before the upload, instead of one after another at each
/// family's first launch: a fresh machine's first run then waits about as long as the slowest
/// family takes NVRTC, not the sum. With fewer threads compiling families a model may never
/// launch costs more than it saves, and they stay compiled on first use. A family that fails to
/// compile here (built for an architecture this GPU lacks) is not an error yet: only a launch of
/// one of its kernels is, with the compiler's message.
fn precompile_kernels(gpu: &Gpu) -> Result<()> {
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    if threads < 8 {
        return Ok(());
    }
    let _not_compiled = gpu.precompile(&sieve_cuda::gpu::all_families(), threads)?;
    Ok(())
}

/// `SIEVE_PREFETCH_ATTENTION=off` (read once) keeps the decode step's attention from asking L2
/// for the start of gate|up: a switch for measuring that part of the prefetch alone, not a
/// setting.
fn attention_prefetch_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SIEVE_PREFETCH_ATTENTION").as_deref() != Ok("off"))
}

/// [`GpuModel::default_l2_prefetch`] for an L2 of `l2_bytes`.
fn default_l2_prefetch_for(l2_bytes: usize) -> usize {
    2_000_000usize.min(l2_bytes / 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_left_out_op_is_left_out_of_every_layer_and_nothing_else() {
        let layers = 3;
        let ops: Vec<Op> = plan::step_ops(layers)
            .into_iter()
            .filter(|op| *op != StepOp::Next)
            .map(Op::Plan)
            .chain([Op::Next(false)])
            .collect();
        for kind in plan::LAYER {
            let kept: Vec<Op> = ops
                .iter()
                .copied()
                .filter(|&op| StepPart::Without(kind).keeps(op))
                .collect();
            assert_eq!(kept.len(), ops.len() - layers, "{}", kind.name());
            assert!(
                !kept
                    .iter()
                    .any(|op| matches!(op, Op::Plan(StepOp::Layer(_, k)) if *k == kind)),
                "{}",
                kind.name()
            );
            assert_eq!(kept.last(), Some(&Op::Next(false)));
        }
        let without_head: Vec<Op> = ops
            .iter()
            .copied()
            .filter(|&op| StepPart::WithoutHead.keeps(op))
            .collect();
        assert_eq!(without_head.len(), ops.len() - 2);
        assert!(without_head
            .iter()
            .all(|op| !matches!(op, Op::Plan(StepOp::FinalNorm | StepOp::LmHead))));
        // The older subsets still split the step as before.
        let all = ops.iter().filter(|&&op| StepPart::All.keeps(op)).count();
        let linear = ops
            .iter()
            .filter(|&&op| StepPart::LinearOnly.keeps(op))
            .count();
        let rest = ops
            .iter()
            .filter(|&&op| StepPart::NoLinear.keeps(op))
            .count();
        assert_eq!(all, ops.len());
        // Four products a layer and the head are linear; the next-token op is in both.
        assert_eq!(linear, 4 * layers + 1 + 1);
        assert_eq!(linear + rest, all + 1);
    }

    fn chunks_of(lens: &[usize], tokens: &[u32]) -> Vec<SlotChunk<'static>> {
        let tokens: &'static [u32] = Box::leak(tokens.to_vec().into_boxed_slice());
        lens.iter()
            .enumerate()
            .map(|(slot, &n)| SlotChunk {
                slot,
                start: 0,
                tokens: &tokens[..n],
                logits: true,
            })
            .collect()
    }

    #[test]
    fn passes_keep_each_chunk_on_its_own_kernels() {
        let tokens = vec![1u32; 200];
        // A low-bit model (its kernel below 65 rows, an f16 copy from 65), passes of 128.
        let chunks = chunks_of(&[20, 5, 90, 17, 2, 40, 64, 65], &tokens);
        let all: Vec<usize> = (0..chunks.len()).collect();
        let passes = pack_passes(&chunks, &all, &[65], 128);
        assert_eq!(
            passes,
            vec![vec![0, 1, 3, 4], vec![5], vec![6], vec![2], vec![7]]
        );
        // No bounds (dense f16): one class, passes as full as the capacity allows, in order.
        let passes = pack_passes(&chunks, &all, &[], 128);
        assert_eq!(passes, vec![vec![0, 1, 2], vec![3, 4, 5, 6], vec![7]]);
        // Every chunk once; every pass within its class's rows and of one class.
        let mut seed = 7u64;
        for _ in 0..200 {
            let lens: Vec<usize> = (0..12)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    1 + (seed >> 33) as usize % 128
                })
                .collect();
            let chunks = chunks_of(&lens, &tokens);
            let together: Vec<usize> = (0..lens.len()).filter(|i| i % 5 != 4).collect();
            for bounds in [vec![], vec![65], vec![33, 65]] {
                let passes = pack_passes(&chunks, &together, &bounds, 128);
                let mut seen: Vec<usize> = passes.iter().flatten().copied().collect();
                seen.sort_unstable();
                assert_eq!(seen, together, "{lens:?} {bounds:?}");
                let class = |n: usize| bounds.iter().filter(|&&b| b <= n).count();
                for pass in &passes {
                    let rows: usize = pass.iter().map(|&i| lens[i]).sum();
                    let c = class(lens[pass[0]]);
                    let limit = bounds.get(c).map_or(128, |&b| b - 1);
                    assert!(rows <= limit, "{pass:?} of {lens:?}: {rows} rows");
                    assert!(pass.iter().all(|&i| class(lens[i]) == c), "{pass:?}");
                }
            }
        }
    }
}
