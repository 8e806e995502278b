//! The decode step as one persistent kernel (`kernels/persistent_step.cu`): every SM runs a
//! loop over an on-device list of stages derived from the model's plan, with grid-wide
//! barriers instead of kernel boundaries and the next stage's weights asked of L2 before each
//! barrier. Dense f16 weights (row-major), Tiled-CBC and Balanced-CBC products and the f16 KV
//! cache; everything else keeps the graph step, which is also this step's reference (the
//! runner's tests compare the two).
//!
//! The launcher takes raw device addresses ([`DevPtr`]) like the other model kernels, so the
//! runner points it at its own buffers and captures the launch in a graph.

use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{i32_arg, Gpu, KernelFamily};
use crate::product::DevPtr;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub const FAMILY: KernelFamily = KernelFamily {
    name: "persistent_step",
    source: include_str!("../kernels/persistent_step.cu"),
};

const THREADS: u32 = 512;
/// Positions one attention task scores at once (`PS_SCORE_CAP`).
const SCORE_CAP: usize = 4096;
/// Floats of shared memory besides the stage input: scores, value partials, q.
const SCRATCH_FLOATS: usize = SCORE_CAP + 2 * THREADS as usize + 256;
/// Words of the sync buffer before the per-head counters: the 64-bit arrival count and the
/// abort flag, each on its own 128-byte line.
const SYNC_HEADER: usize = 64;
/// A barrier wait longer than this aborts the step with an error (a dependency bug, or a grid
/// that is not all resident), instead of hanging the GPU.
const WATCHDOG_NS: u64 = 2_000_000_000;

/// What one stage of the list does (`ST_*` in the kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum StageKind {
    /// Norm, q|k|v product, RoPE and the KV-cache write.
    Qkv = 0,
    /// The same, `x` first taken from the embedding row of the step's token.
    QkvFromEmbedding = 1,
    /// Split attention, combined by the last split of each head.
    Attention = 2,
    /// `x += W_o · att`.
    O = 3,
    /// Norm, gate|up product and SwiGLU.
    GateUp = 4,
    /// `x += W_down · h`.
    Down = 5,
    /// Final norm and the LM head into the logits.
    Head = 6,
}

impl StageKind {
    pub const ALL: [StageKind; 7] = [
        StageKind::Qkv,
        StageKind::QkvFromEmbedding,
        StageKind::Attention,
        StageKind::O,
        StageKind::GateUp,
        StageKind::Down,
        StageKind::Head,
    ];
    pub fn name(self) -> &'static str {
        match self {
            StageKind::Qkv | StageKind::QkvFromEmbedding => "norm+qkv+rope",
            StageKind::Attention => "attention",
            StageKind::O => "o",
            StageKind::GateUp => "norm+gate|up+swiglu",
            StageKind::Down => "down",
            StageKind::Head => "norm+head",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stage {
    pub kind: StageKind,
    pub layer: usize,
}

/// A Tiled-CBC matrix's device arrays (`PTcbc`): the format's arrays and the rank table of
/// [`crate::tiled_cbc`]. All zero (the default): the product is dense f16 rows instead.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PersistentTcbc {
    pub tile_offset: DevPtr,
    pub col_info: DevPtr,
    pub bitmaps: DevPtr,
    pub rank: DevPtr,
    pub values: DevPtr,
    pub rows: i32,
    pub cols: i32,
    pub col_tiles: i32,
    /// Columns of one task (a multiple of 16, at most 512); [`PersistentStep::new`] sets it.
    pub cols_per_task: i32,
}
unsafe impl cudarc::driver::DeviceRepr for PersistentTcbc {}
unsafe impl cudarc::driver::ValidAsZeroBits for PersistentTcbc {}

impl PersistentTcbc {
    pub fn is_sparse(&self) -> bool {
        self.values != 0
    }
}

/// A Balanced-CBC matrix's device blocks (`PBcbc`), as
/// [`crate::balanced_cbc::GpuBalancedCbc`] uploaded them. All zero (the default): the product
/// is not Balanced-CBC.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PersistentBcbc {
    pub blocks: DevPtr,
    pub rows: i32,
    pub cols: i32,
    /// N, the slots of every 16-row group (1..=16).
    pub slots: i32,
    /// 1: the index layout ([`crate::balanced_cbc::BcbcKernel::Idx`]); 0: the blob's blocks,
    /// each lane's row mask ([`crate::balanced_cbc::BcbcKernel::Chain`]).
    pub index: i32,
    /// Lanes stored in the last 512-row tile (only those holding rows < `rows`).
    pub last_lanes: i32,
    /// Columns of one task, 16 warps' slices of at most 64; [`PersistentStep::new`] sets it.
    pub cols_per_task: i32,
}
unsafe impl cudarc::driver::DeviceRepr for PersistentBcbc {}
unsafe impl cudarc::driver::ValidAsZeroBits for PersistentBcbc {}

impl PersistentBcbc {
    pub fn is_sparse(&self) -> bool {
        self.blocks != 0
    }
}

/// Columns a warp takes of a Balanced-CBC task at most (two activations a lane).
const MAX_BCBC_WARP_COLS: usize = 64;
/// Warps of a block (`PS_WARPS`): a Balanced-CBC task has a column slice for each.
const WARPS: usize = THREADS as usize / 32;
/// A Balanced-CBC task's fixed cost in columns' worth of one warp's slice: zeroing, the ring's
/// first loads, the reduction and its two barriers.
const BCBC_TASK_COST: usize = 16;

/// Columns per Balanced-CBC task (16 warps' slices of 1..=64 columns): the split whose tasks,
/// dealt round robin to `blocks` blocks, finish first, a task costing its slice plus
/// [`BCBC_TASK_COST`].
pub fn bcbc_cols_per_task(rows: usize, cols: usize, blocks: usize) -> usize {
    let row_tiles = rows.div_ceil(512).max(1);
    let blocks = blocks.max(1);
    let widest = cols.div_ceil(WARPS).clamp(1, MAX_BCBC_WARP_COLS);
    let mut best = (usize::MAX, widest);
    for per_warp in (1..=widest).rev() {
        let waves = (row_tiles * cols.div_ceil(WARPS * per_warp)).div_ceil(blocks);
        let cost = waves * (per_warp + BCBC_TASK_COST);
        if cost < best.0 {
            best = (cost, per_warp);
        }
    }
    WARPS * best.1
}

/// Bytes of the Balanced-CBC area of shared memory: every warp's accumulators, 16 rows x 32
/// lanes of f32.
const BCBC_AREA_BYTES: usize = WARPS * 16 * 32 * 4;

/// Bytes of the area the sparse tasks share (`tcbc_at` on): the larger need of the formats the
/// model has (none: no area).
fn sparse_area_bytes(tiled: bool, balanced: bool, stages: usize) -> usize {
    let t = if tiled { tcbc_area_bytes(stages) } else { 0 };
    let b = if balanced { BCBC_AREA_BYTES } else { 0 };
    t.max(b)
}

/// Columns per Tiled-CBC task: the split of `cols` (a multiple of 16 up to 512) whose tasks,
/// dealt round robin to `blocks` blocks, finish first, a task costing its columns plus a fixed
/// 128 (the compaction's and the pipeline's first latencies, in columns' worth).
pub fn tcbc_cols_per_task(rows: usize, cols: usize, blocks: usize) -> usize {
    let row_tiles = rows.div_ceil(256).max(1);
    let blocks = blocks.max(1);
    let widest = cols.next_multiple_of(16).clamp(16, MAX_TASK_COLS);
    let mut best = (usize::MAX, widest);
    for c in (1..=widest / 16).rev().map(|t| t * 16) {
        let waves = (row_tiles * cols.div_ceil(c)).div_ceil(blocks);
        let cost = waves * (c + 128);
        if cost < best.0 {
            best = (cost, c);
        }
    }
    best.1
}

/// Columns one Tiled-CBC task takes at most (`PT_MAX_COLS`: a thread per column).
const MAX_TASK_COLS: usize = 512;
/// Bytes of one Tiled-CBC stage buffer of 32 columns (`PT_STAGE_BYTES`).
const TCBC_STAGE_BYTES: usize = 17_664;
/// Stage buffers of a Tiled-CBC task by default (`stages - 1` batches of columns in flight).
const TCBC_STAGES: usize = 4;

/// Bytes of the Tiled-CBC area of shared memory: two column lists (16 bytes a column; a
/// task's and the next one's), the 16 warps' sums of a task's 256 rows (f32) and `stages`
/// stage buffers.
fn tcbc_area_bytes(stages: usize) -> usize {
    2 * MAX_TASK_COLS * 16 + 16 * 256 * 4 + stages * TCBC_STAGE_BYTES
}

/// `SIEVE_PERSISTENT_TCBC_STAGES=2..8` (a switch for measuring the pipeline depth, not a
/// setting), else [`TCBC_STAGES`].
fn tcbc_stages_from_env() -> Result<usize> {
    parse_tcbc_stages(
        std::env::var("SIEVE_PERSISTENT_TCBC_STAGES")
            .ok()
            .as_deref(),
    )
    .map_err(CudaError::Option)
}

fn parse_tcbc_stages(v: Option<&str>) -> std::result::Result<usize, String> {
    match v {
        None => Ok(TCBC_STAGES),
        Some(text) => match text.parse::<usize>() {
            Ok(n) if (2..=8).contains(&n) => Ok(n),
            _ => Err(format!(
                "SIEVE_PERSISTENT_TCBC_STAGES={text}: expected a number of stage buffers from 2 to 8"
            )),
        },
    }
}

/// One layer's device addresses and thresholds (`PLayer`; 0 for an absent bias). Weights are
/// row-major f16: q|k|v joined (H + 2 Hkv) hd x d, o d x H hd, gate|up joined 2I x d, down d x I;
/// a group whose `s_*` is sparse is that Tiled-CBC matrix instead, one whose `b_*` is sparse that
/// Balanced-CBC matrix (its dense address unused; at most one of the two).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PersistentLayer {
    pub attn_norm: DevPtr,
    pub qkv: DevPtr,
    pub qkv_bias: DevPtr,
    pub k_cache: DevPtr,
    pub v_cache: DevPtr,
    pub o: DevPtr,
    pub mlp_norm: DevPtr,
    pub gate_up: DevPtr,
    pub down: DevPtr,
    pub t_qkv: f32,
    pub t_o: f32,
    pub t_gate_up: f32,
    pub t_down: f32,
    pub s_qkv: PersistentTcbc,
    pub s_o: PersistentTcbc,
    pub s_gate_up: PersistentTcbc,
    pub s_down: PersistentTcbc,
    pub b_qkv: PersistentBcbc,
    pub b_o: PersistentBcbc,
    pub b_gate_up: PersistentBcbc,
    pub b_down: PersistentBcbc,
}
unsafe impl cudarc::driver::DeviceRepr for PersistentLayer {}
unsafe impl cudarc::driver::ValidAsZeroBits for PersistentLayer {}

/// The model's sizes.
#[derive(Clone, Copy, Debug)]
pub struct PersistentShape {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub capacity: usize,
    pub eps: f32,
}

/// The step's buffers and model-wide weights (the layout of `kernels/step.cu`).
#[derive(Clone, Copy, Debug)]
pub struct PersistentIo {
    pub embed: DevPtr,
    pub final_norm: DevPtr,
    pub lm_head: DevPtr,
    /// The head as Tiled-CBC (sparse) instead of `lm_head`'s dense rows.
    pub s_head: PersistentTcbc,
    /// The head as Balanced-CBC (sparse) instead.
    pub b_head: PersistentBcbc,
    pub t_head: f32,
    pub x: DevPtr,
    pub qkv: DevPtr,
    pub att: DevPtr,
    pub h: DevPtr,
    pub logits: DevPtr,
    pub state: DevPtr,
    pub rope_cos: DevPtr,
    pub rope_sin: DevPtr,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct PersistentArgs {
    layers: DevPtr,
    stages: DevPtr,
    embed: DevPtr,
    final_norm: DevPtr,
    lm_head: DevPtr,
    x: DevPtr,
    qkv: DevPtr,
    att: DevPtr,
    h: DevPtr,
    logits: DevPtr,
    part: DevPtr,
    state: DevPtr,
    rope_cos: DevPtr,
    rope_sin: DevPtr,
    sync: DevPtr,
    error: DevPtr,
    trace: DevPtr,
    watchdog_ns: u64,
    n_stages: i32,
    d: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    intermediate: i32,
    vocab: i32,
    splits: i32,
    eps: f32,
    t_head: f32,
    att_scale: f32,
    xs_floats: i32,
    /// Word of `sync` where the flag barrier's per-block flags start; 0: the count barrier.
    flags_at: i32,
    /// Byte offset of the sparse tasks' area (Tiled-CBC, Balanced-CBC) in the dynamic shared
    /// memory.
    tcbc_at: i32,
    /// Its stage buffers.
    tcbc_stages: i32,
    /// Raw sums of a sparse (Tiled-CBC, Balanced-CBC) q|k|v and gate|up (0: no such product).
    acc_qkv: DevPtr,
    acc_gu: DevPtr,
    s_head: PersistentTcbc,
    b_head: PersistentBcbc,
}
unsafe impl cudarc::driver::DeviceRepr for PersistentArgs {}

/// Which grid barrier the persistent step takes between stages (`kernels/persistent_step.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Barrier {
    /// One 64-bit arrival count that every block adds to (an atomic per block on one word).
    Count,
    /// A flag per block that it raises; each block waits for all of them.
    Flags,
}

impl Barrier {
    /// `SIEVE_PERSISTENT_BARRIER=flags|count` (read once; a switch for measuring the two, not a
    /// setting), else [`Barrier::Count`]: the flag barrier measured slower
    /// (docs/BENCHMARKS.md, "Window O1").
    pub fn from_env() -> Result<Self> {
        static SETTING: std::sync::OnceLock<std::result::Result<Barrier, String>> =
            std::sync::OnceLock::new();
        SETTING
            .get_or_init(|| Self::parse(std::env::var("SIEVE_PERSISTENT_BARRIER").ok().as_deref()))
            .clone()
            .map_err(CudaError::Option)
    }

    fn parse(v: Option<&str>) -> std::result::Result<Self, String> {
        match v {
            None | Some("count") => Ok(Barrier::Count),
            Some("flags") => Ok(Barrier::Flags),
            Some(other) => Err(format!(
                "SIEVE_PERSISTENT_BARRIER={other}: expected count or flags"
            )),
        }
    }
}

/// Why a model's step cannot run persistent (None: it can), from its sizes alone.
pub fn unsupported_shape(s: &PersistentShape) -> Option<String> {
    if s.head_dim == 0 || !s.head_dim.is_multiple_of(64) || s.head_dim > 256 {
        return Some(format!(
            "head dim {} (the persistent step takes 64, 128, 192 or 256)",
            s.head_dim
        ));
    }
    if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
        return Some(format!("{} heads over {} KV heads", s.heads, s.kv_heads));
    }
    for (what, k) in [
        ("hidden size", s.hidden),
        ("attention width", s.heads * s.head_dim),
        ("intermediate size", s.intermediate),
    ] {
        if k == 0 || !k.is_multiple_of(8) {
            return Some(format!(
                "{what} {k} is not a multiple of 8 (16-byte weight rows)"
            ));
        }
    }
    None
}

/// Checks a Tiled-CBC matrix (if it is one) against the `rows` x `cols` its place needs and
/// sets its task width.
fn prepare_sparse(
    m: &mut PersistentTcbc,
    what: &str,
    rows: usize,
    cols: usize,
    blocks: u32,
) -> Result<()> {
    if !m.is_sparse() {
        return Ok(());
    }
    if m.rows as usize != rows
        || m.cols as usize != cols
        || m.col_tiles as usize != cols.div_ceil(16)
    {
        return Err(CudaError::Option(format!(
            "persistent step: {what} is a {}x{} Tiled-CBC matrix ({} column tiles), expected {rows}x{cols}",
            m.rows, m.cols, m.col_tiles
        )));
    }
    m.cols_per_task = i32_arg(
        "task columns",
        tcbc_cols_per_task(rows, cols, blocks as usize),
    )?;
    Ok(())
}

/// Checks a Balanced-CBC matrix (if it is one) against the `rows` x `cols` its place needs and
/// sets its task width; `tiled` is the same group's Tiled-CBC descriptor (not both).
fn prepare_balanced(
    m: &mut PersistentBcbc,
    tiled: &PersistentTcbc,
    what: &str,
    rows: usize,
    cols: usize,
    blocks: u32,
) -> Result<()> {
    if !m.is_sparse() {
        return Ok(());
    }
    if tiled.is_sparse() {
        return Err(CudaError::Option(format!(
            "persistent step: {what} is given as both Tiled-CBC and Balanced-CBC"
        )));
    }
    let last_lanes = (rows - 512 * rows.div_ceil(512).saturating_sub(1)).div_ceil(16);
    if m.rows as usize != rows
        || m.cols as usize != cols
        || !(1..=16).contains(&m.slots)
        || !(0..=1).contains(&m.index)
        || m.last_lanes as usize != last_lanes
    {
        return Err(CudaError::Option(format!(
            "persistent step: {what} is a {}x{} Balanced-CBC matrix ({} slots, layout {}, {} lanes \
             in the last tile), expected {rows}x{cols} with 1..=16 slots and {last_lanes} lanes",
            m.rows, m.cols, m.slots, m.index, m.last_lanes
        )));
    }
    m.cols_per_task = i32_arg(
        "task columns",
        bcbc_cols_per_task(rows, cols, blocks as usize),
    )?;
    Ok(())
}

/// A model's persistent step: the stage list, the layer table, and the kernel's scratch.
pub struct PersistentStep {
    shape: PersistentShape,
    stages: Vec<Stage>,
    /// Per stage: its product is sparse, Tiled-CBC or Balanced-CBC (the kernel counts the bytes
    /// it reads).
    sparse: Vec<bool>,
    /// acc_qkv and acc_gu (header of the kernel), when some layer needs them.
    _accumulators: [Option<CudaSlice<f32>>; 2],
    _stages_dev: CudaSlice<i32>,
    _layers_dev: CudaSlice<PersistentLayer>,
    _part: CudaSlice<f32>,
    sync: CudaSlice<u32>,
    error: CudaSlice<u32>,
    trace: Option<CudaSlice<u64>>,
    args: PersistentArgs,
    blocks: u32,
    shared_bytes: u32,
}

impl PersistentStep {
    /// Uploads the stage list and layer table. `stages` must reference layers in `layers`.
    pub fn new(
        gpu: &Gpu,
        shape: PersistentShape,
        layers: &[PersistentLayer],
        stages: &[Stage],
        io: PersistentIo,
    ) -> Result<Self> {
        if let Some(why) = unsupported_shape(&shape) {
            return Err(CudaError::Unsupported(format!("persistent step: {why}")));
        }
        if let Some(s) = stages.iter().find(|s| s.layer >= layers.len()) {
            return Err(CudaError::Option(format!(
                "persistent step: a stage names layer {} of {}",
                s.layer,
                layers.len()
            )));
        }
        let blocks = gpu.info().multiprocessors.max(1);
        // Each sparse matrix checked against its place in the model, its task width set.
        let (d, q_width) = (shape.hidden, shape.heads * shape.head_dim);
        let qkv_rows = q_width + 2 * shape.kv_heads * shape.head_dim;
        let mut layers = layers.to_vec();
        let mut io = io;
        for (l, layer) in layers.iter_mut().enumerate() {
            for (what, m, b, rows, cols) in [
                ("q|k|v", &mut layer.s_qkv, &mut layer.b_qkv, qkv_rows, d),
                ("o", &mut layer.s_o, &mut layer.b_o, d, q_width),
                (
                    "gate|up",
                    &mut layer.s_gate_up,
                    &mut layer.b_gate_up,
                    2 * shape.intermediate,
                    d,
                ),
                (
                    "down",
                    &mut layer.s_down,
                    &mut layer.b_down,
                    d,
                    shape.intermediate,
                ),
            ] {
                let what = format!("layer {l}'s {what}");
                prepare_sparse(m, &what, rows, cols, blocks)?;
                prepare_balanced(b, m, &what, rows, cols, blocks)?;
            }
        }
        prepare_sparse(&mut io.s_head, "the LM head", shape.vocab, d, blocks)?;
        prepare_balanced(
            &mut io.b_head,
            &io.s_head,
            "the LM head",
            shape.vocab,
            d,
            blocks,
        )?;
        // Any sparse q|k|v or gate|up leaves raw sums in an accumulator (the kernel's header).
        let sparse_qkv = layers
            .iter()
            .any(|l| l.s_qkv.is_sparse() || l.b_qkv.is_sparse());
        let sparse_gu = layers
            .iter()
            .any(|l| l.s_gate_up.is_sparse() || l.b_gate_up.is_sparse());
        let any_tiled = io.s_head.is_sparse()
            || layers.iter().any(|l| {
                [l.s_qkv, l.s_o, l.s_gate_up, l.s_down]
                    .iter()
                    .any(|m| m.is_sparse())
            });
        let any_balanced = io.b_head.is_sparse()
            || layers.iter().any(|l| {
                [l.b_qkv, l.b_o, l.b_gate_up, l.b_down]
                    .iter()
                    .any(|m| m.is_sparse())
            });
        let xs_floats = shape
            .hidden
            .max(shape.intermediate)
            .max(shape.heads * shape.head_dim)
            .next_multiple_of(4);
        let tcbc_at = (xs_floats + SCRATCH_FLOATS) * 4;
        let tcbc_stages = tcbc_stages_from_env()?;
        let shared_bytes = tcbc_at + sparse_area_bytes(any_tiled, any_balanced, tcbc_stages);
        let f = gpu.function(&FAMILY, "persistent_step")?;
        gpu.allow_dynamic_shared(&f, shared_bytes).map_err(|e| {
            let buffers = if any_tiled {
                format!(" ({tcbc_stages} Tiled-CBC stage buffers)")
            } else {
                String::new()
            };
            CudaError::Unsupported(format!(
                "persistent step: {shared_bytes} bytes of shared memory a block{buffers}: {e}"
            ))
        })?;
        // As many splits per head as keep every task on a block of its own (one block with two
        // tasks doubles the stage: measured, 135 tasks on 132 SMs), and few enough positions per
        // split for the score buffer.
        let splits = (blocks as usize / shape.heads.max(1))
            .max(shape.capacity.div_ceil(SCORE_CAP))
            .max(1);
        let flat: Vec<i32> = stages
            .iter()
            .flat_map(|s| [s.kind as i32, s.layer as i32])
            .collect();
        let stages_dev = gpu.upload(&flat)?;
        let layers_dev = gpu.upload(&layers)?;
        let sparse: Vec<bool> = stages
            .iter()
            .map(|s| {
                let l = &layers[s.layer];
                match s.kind {
                    StageKind::Qkv | StageKind::QkvFromEmbedding => {
                        l.s_qkv.is_sparse() || l.b_qkv.is_sparse()
                    }
                    StageKind::O => l.s_o.is_sparse() || l.b_o.is_sparse(),
                    StageKind::GateUp => l.s_gate_up.is_sparse() || l.b_gate_up.is_sparse(),
                    StageKind::Down => l.s_down.is_sparse() || l.b_down.is_sparse(),
                    StageKind::Head => io.s_head.is_sparse() || io.b_head.is_sparse(),
                    StageKind::Attention => false,
                }
            })
            .collect();
        let accumulator = |on: bool, n: usize| -> Result<Option<CudaSlice<f32>>> {
            Ok(if on {
                Some(gpu.upload(&vec![0f32; n])?)
            } else {
                None
            })
        };
        let acc_qkv = accumulator(sparse_qkv, qkv_rows)?;
        let acc_gu = accumulator(sparse_gu, 2 * shape.intermediate)?;
        let part = gpu.upload(&vec![0f32; shape.heads * splits * (shape.head_dim + 2)])?;
        // The flag barrier's words follow the per-head counters, from a 128-byte line of
        // their own; each of the first `blocks` threads of a block waits on one of them.
        let barrier = Barrier::from_env()?;
        let flags_at = match barrier {
            Barrier::Count => 0,
            Barrier::Flags => {
                if blocks > THREADS {
                    return Err(CudaError::Unsupported(format!(
                        "persistent step: the flag barrier waits with one thread per block, {blocks} blocks of {THREADS} threads"
                    )));
                }
                (SYNC_HEADER + shape.heads).next_multiple_of(32)
            }
        };
        let sync_words = if flags_at > 0 {
            flags_at + blocks as usize
        } else {
            SYNC_HEADER + shape.heads
        };
        let sync = gpu.upload(&vec![0u32; sync_words])?;
        let error = gpu.upload(&[0u32])?;
        let p = |s: &CudaSlice<f32>| crate::product::dev_ptr(gpu, s);
        let args = PersistentArgs {
            layers: crate::product::dev_ptr(gpu, &layers_dev),
            stages: crate::product::dev_ptr(gpu, &stages_dev),
            embed: io.embed,
            final_norm: io.final_norm,
            lm_head: io.lm_head,
            x: io.x,
            qkv: io.qkv,
            att: io.att,
            h: io.h,
            logits: io.logits,
            part: p(&part),
            state: io.state,
            rope_cos: io.rope_cos,
            rope_sin: io.rope_sin,
            sync: crate::product::dev_ptr(gpu, &sync),
            error: crate::product::dev_ptr(gpu, &error),
            trace: 0,
            watchdog_ns: WATCHDOG_NS,
            n_stages: i32_arg("stages", stages.len())?,
            d: i32_arg("hidden size", shape.hidden)?,
            heads: i32_arg("heads", shape.heads)?,
            kv_heads: i32_arg("KV heads", shape.kv_heads)?,
            head_dim: i32_arg("head dim", shape.head_dim)?,
            intermediate: i32_arg("intermediate size", shape.intermediate)?,
            vocab: i32_arg("vocabulary", shape.vocab)?,
            splits: i32_arg("attention splits", splits)?,
            eps: shape.eps,
            t_head: io.t_head,
            att_scale: 1.0 / (shape.head_dim as f32).sqrt(),
            xs_floats: i32_arg("stage input", xs_floats)?,
            flags_at: i32_arg("flag words", flags_at)?,
            tcbc_at: i32_arg("shared memory", tcbc_at)?,
            tcbc_stages: tcbc_stages as i32,
            acc_qkv: acc_qkv.as_ref().map(p).unwrap_or(0),
            acc_gu: acc_gu.as_ref().map(p).unwrap_or(0),
            s_head: io.s_head,
            b_head: io.b_head,
        };
        Ok(Self {
            shape,
            stages: stages.to_vec(),
            sparse,
            _accumulators: [acc_qkv, acc_gu],
            _stages_dev: stages_dev,
            _layers_dev: layers_dev,
            _part: part,
            sync,
            error,
            trace: None,
            args,
            blocks,
            shared_bytes: shared_bytes as u32,
        })
    }

    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Stamps every stage's start and end per block from now on (or stops: `false`).
    pub fn set_trace(&mut self, gpu: &Gpu, on: bool) -> Result<()> {
        if on {
            // The stamps, then the word the kernel writes its attended positions to.
            // ... and the bytes per (stage, block).
            let n = self.stages.len() * self.blocks as usize * 3 + 1;
            let t = gpu.upload(&vec![0u64; n])?;
            self.args.trace = crate::product::dev_ptr(gpu, &t);
            self.trace = Some(t);
        } else {
            self.args.trace = 0;
            self.trace = None;
        }
        Ok(())
    }

    /// Enqueues one step (capturable).
    pub fn launch(&self, gpu: &Gpu) -> Result<()> {
        let f = gpu.function(&FAMILY, "persistent_step")?;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.args);
        let cfg = LaunchConfig {
            grid_dim: (self.blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: self.shared_bytes,
        };
        unsafe { b.launch(cfg) }.during("launching persistent_step")?;
        Ok(())
    }

    /// After the stream is synchronized: an error if a barrier timed out (the sync words are
    /// reset so that the next step starts clean).
    pub fn check(&self, gpu: &Gpu) -> Result<()> {
        let e = gpu.download(&self.error)?;
        if e.first().copied().unwrap_or(0) != 0 {
            let stage = e[0] as usize - 1;
            let what = self
                .stages
                .get(stage)
                .map(|s| format!("{} of layer {}", s.kind.name(), s.layer))
                .unwrap_or_else(|| format!("stage {stage}"));
            // SAFETY: both addresses are the starts of this step's own allocations, of these
            // lengths.
            unsafe {
                gpu.zero_bytes(self.args.sync, self.sync.len() * 4)?;
                gpu.zero_bytes(self.args.error, 4)?;
                // An aborted step leaves partial sums; the kernel expects zeros at a start.
                for (ptr, acc) in [self.args.acc_qkv, self.args.acc_gu]
                    .into_iter()
                    .zip(&self._accumulators)
                {
                    if let Some(acc) = acc {
                        gpu.zero_bytes(ptr, acc.len() * 4)?;
                    }
                }
            }
            gpu.synchronize()?;
            return Err(CudaError::Option(format!(
                "persistent step: the barrier after {what} timed out after {} s (aborted)",
                WATCHDOG_NS / 1_000_000_000
            )));
        }
        Ok(())
    }

    /// The last traced step: per stage, per block, (start, end) in ns of the GPU's global timer.
    pub fn trace(&self, gpu: &Gpu) -> Result<Option<Trace>> {
        let Some(t) = &self.trace else {
            return Ok(None);
        };
        let mut stamps = gpu.download(t)?;
        let blocks = self.blocks as usize;
        let stamped = self.stages.len() * blocks * 2;
        let positions = stamps.get(stamped).copied().unwrap_or(0) as usize;
        let counted = stamps
            .get(stamped + 1..)
            .unwrap_or(&[])
            .chunks(blocks)
            .zip(&self.sparse)
            .map(|(per_block, &sparse)| sparse.then(|| per_block.iter().sum()))
            .collect();
        stamps.truncate(stamped);
        Ok(Some(Trace {
            stages: self.stages.clone(),
            blocks,
            stamps,
            shape: self.shape,
            positions,
            counted,
        }))
    }
}

/// Stage start and end stamps of one step, per block.
#[derive(Clone, Debug)]
pub struct Trace {
    pub stages: Vec<Stage>,
    pub blocks: usize,
    /// `[(stage * blocks + block) * 2 + {0: start, 1: end}]`, ns.
    pub stamps: Vec<u64>,
    /// The model's sizes, for the bytes each stage reads.
    pub shape: PersistentShape,
    /// Positions the step's attention read (its position + 1), as the kernel wrote them.
    pub positions: usize,
    /// Per stage: the bytes its sparse (Tiled-CBC, Balanced-CBC) tasks asked for, summed over
    /// the blocks (None for a dense stage, whose bytes are [`stage_read_bytes`]; empty: none
    /// counted).
    pub counted: Vec<Option<u64>>,
}

/// Bytes one stage reads per step: its f16 weights (rows x columns x 2; the first stage also
/// the embedding row of the token), and for attention the K and V rows of the `positions` it
/// attends in every KV head. Norm weights, biases, activations and the KV row written are left
/// out: kilobytes against the megabytes of a product.
pub fn stage_read_bytes(shape: &PersistentShape, kind: StageKind, positions: usize) -> u64 {
    const F16: u64 = 2;
    let q_width = shape.heads * shape.head_dim;
    let kv_width = shape.kv_heads * shape.head_dim;
    let qkv = (q_width + 2 * kv_width) * shape.hidden;
    let elements = match kind {
        StageKind::Qkv => qkv,
        StageKind::QkvFromEmbedding => qkv + shape.hidden,
        StageKind::Attention => 2 * kv_width * positions,
        StageKind::O => shape.hidden * q_width,
        StageKind::GateUp => 2 * shape.intermediate * shape.hidden,
        StageKind::Down => shape.hidden * shape.intermediate,
        StageKind::Head => shape.vocab * shape.hidden,
    };
    elements as u64 * F16
}

/// How idle time spreads over the blocks of a step (the grid is one block per SM), µs.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct IdleSpread {
    pub min_us: f64,
    pub median_us: f64,
    pub max_us: f64,
    /// The block idle longest (the first of equals).
    pub worst_block: usize,
}

impl IdleSpread {
    /// The spread of per-block idle times (`idle_us[block]`); all zero for no blocks.
    pub fn of(idle_us: &[f64]) -> Self {
        let mut sorted = idle_us.to_vec();
        sorted.sort_by(f64::total_cmp);
        let (Some(&min_us), Some(&max_us)) = (sorted.first(), sorted.last()) else {
            return Self::default();
        };
        let mid = sorted.len() / 2;
        let median_us = if sorted.len() % 2 == 1 {
            sorted[mid]
        } else {
            (sorted[mid - 1] + sorted[mid]) / 2.0
        };
        let worst_block = idle_us.iter().position(|&us| us == max_us).unwrap_or(0);
        Self {
            min_us,
            median_us,
            max_us,
            worst_block,
        }
    }
}

/// One stage class's bytes per step against the copy bandwidth.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassBandwidth {
    pub class: &'static str,
    /// The class's time, µs.
    pub us: f64,
    pub bytes: u64,
    /// Bytes over time, GB/s.
    pub gbs: f64,
    /// `gbs` over the copy bandwidth.
    pub of_copy: f64,
}

impl ClassBandwidth {
    fn new(class: &'static str, us: f64, bytes: u64, copy_gbs: f64) -> Self {
        // Bytes per ns are GB/s.
        let gbs = if us > 0.0 {
            bytes as f64 / (us * 1e3)
        } else {
            0.0
        };
        Self {
            class,
            us,
            bytes,
            gbs,
            of_copy: gbs / copy_gbs,
        }
    }
}

/// A traced step against the copy bandwidth ([`TraceSummary::against_copy`]).
#[derive(Clone, Debug, PartialEq)]
pub struct CopyComparison {
    /// Per stage class, over its work time (the slowest block's, summed over its stages).
    pub classes: Vec<ClassBandwidth>,
    /// Every byte of the step over the step time, barriers and idle blocks included.
    pub step: ClassBandwidth,
    /// Every byte of the step at the copy bandwidth, µs: the floor a step could reach.
    pub byte_floor_us: f64,
    /// The step minus its byte floor, µs: what barriers, norms, idle SMs and reads below the
    /// copy bandwidth cost (the "fixed cost").
    pub fixed_cost_us: f64,
}

/// Where the step's time goes, from a [`Trace`].
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct TraceSummary {
    /// Step time: first start to last end, µs.
    pub step_us: f64,
    /// (stage class, µs): per stage, the slowest block's work (its start to its end), summed
    /// over the stages of the class.
    pub work_us: Vec<(&'static str, f64)>,
    /// Time between the slowest block's end of a stage and the latest start of the next:
    /// the barrier, summed over the step, µs.
    pub barrier_us: f64,
    /// Mean fraction of the step a block spends waiting (at barriers, or without a task).
    pub idle_fraction: f64,
    /// Each block's waiting over the step (one block per SM): the least, median and most.
    pub idle_per_block: IdleSpread,
    /// Positions the step's attention read.
    pub positions: usize,
    /// (stage class, bytes): what the class's stages read per step ([`stage_read_bytes`]), in
    /// the order of `work_us`.
    pub read_bytes: Vec<(&'static str, u64)>,
}

impl TraceSummary {
    /// Each class's bytes over its time, and the step's, against `copy_gbs` (the GPU's measured
    /// device-to-device copy bandwidth); None when that is not a positive number.
    pub fn against_copy(&self, copy_gbs: f64) -> Option<CopyComparison> {
        if !(copy_gbs.is_finite() && copy_gbs > 0.0) {
            return None;
        }
        let bytes_of = |class: &str| {
            self.read_bytes
                .iter()
                .find(|(k, _)| *k == class)
                .map_or(0, |&(_, b)| b)
        };
        let classes = self
            .work_us
            .iter()
            .map(|&(class, us)| ClassBandwidth::new(class, us, bytes_of(class), copy_gbs))
            .collect();
        let total: u64 = self.read_bytes.iter().map(|&(_, b)| b).sum();
        // Bytes over GB/s are ns.
        let byte_floor_us = total as f64 / copy_gbs / 1e3;
        Some(CopyComparison {
            classes,
            step: ClassBandwidth::new("step", self.step_us, total, copy_gbs),
            byte_floor_us,
            fixed_cost_us: self.step_us - byte_floor_us,
        })
    }
}

impl Trace {
    fn at(&self, stage: usize, block: usize) -> (u64, u64) {
        let i = (stage * self.blocks + block) * 2;
        (self.stamps[i], self.stamps[i + 1])
    }

    /// Every stage of every block has its two stamps.
    fn complete(&self) -> bool {
        let n = self.stages.len();
        n > 0 && self.blocks > 0 && self.stamps.len() >= n * self.blocks * 2
    }

    /// Per block, the step (first start to last end over all blocks) minus the block's own
    /// stage work: its waits at barriers, before its first stage and after its last, µs.
    pub fn idle_us_per_block(&self) -> Vec<f64> {
        if !self.complete() {
            return Vec::new();
        }
        let n = self.stages.len();
        let t0 = (0..self.blocks).map(|b| self.at(0, b).0).min().unwrap_or(0);
        let t1 = (0..self.blocks)
            .map(|b| self.at(n - 1, b).1)
            .max()
            .unwrap_or(t0);
        (0..self.blocks)
            .map(|b| {
                let busy: u64 = (0..n)
                    .map(|s| {
                        let (a, e) = self.at(s, b);
                        e.saturating_sub(a)
                    })
                    .sum();
                t1.saturating_sub(t0).saturating_sub(busy) as f64 / 1e3
            })
            .collect()
    }

    pub fn summary(&self) -> TraceSummary {
        let n = self.stages.len();
        if !self.complete() {
            return TraceSummary::default();
        }
        let t0 = (0..self.blocks).map(|b| self.at(0, b).0).min().unwrap_or(0);
        let t1 = (0..self.blocks)
            .map(|b| self.at(n - 1, b).1)
            .max()
            .unwrap_or(t0);
        let mut work: Vec<(&'static str, f64)> = Vec::new();
        let mut read_bytes: Vec<(&'static str, u64)> = Vec::new();
        let mut barrier = 0.0;
        let mut busy = 0.0;
        for s in 0..n {
            let start = (0..self.blocks).map(|b| self.at(s, b).0).min().unwrap_or(0);
            let end = (0..self.blocks).map(|b| self.at(s, b).1).max().unwrap_or(0);
            let name = self.stages[s].kind.name();
            let us = end.saturating_sub(start) as f64 / 1e3;
            match work.iter_mut().find(|(k, _)| *k == name) {
                Some(w) => w.1 += us,
                None => work.push((name, us)),
            }
            let kind = self.stages[s].kind;
            let bytes = match self.counted.get(s).copied().flatten() {
                // A sparse stage reads what its active columns hold (and the first stage the
                // token's embedding row).
                Some(counted) if kind == StageKind::QkvFromEmbedding => {
                    counted + 2 * self.shape.hidden as u64
                }
                Some(counted) => counted,
                None => stage_read_bytes(&self.shape, kind, self.positions),
            };
            match read_bytes.iter_mut().find(|(k, _)| *k == name) {
                Some(r) => r.1 += bytes,
                None => read_bytes.push((name, bytes)),
            }
            busy += (0..self.blocks)
                .map(|b| {
                    let (a, e) = self.at(s, b);
                    e.saturating_sub(a) as f64
                })
                .sum::<f64>();
            if s + 1 < n {
                let next = (0..self.blocks)
                    .map(|b| self.at(s + 1, b).0)
                    .max()
                    .unwrap_or(end);
                barrier += next.saturating_sub(end) as f64 / 1e3;
            }
        }
        let span = t1.saturating_sub(t0) as f64;
        TraceSummary {
            step_us: span / 1e3,
            work_us: work,
            barrier_us: barrier,
            idle_fraction: if span > 0.0 {
                1.0 - busy / (span * self.blocks as f64)
            } else {
                0.0
            },
            idle_per_block: IdleSpread::of(&self.idle_us_per_block()),
            positions: self.positions,
            read_bytes,
        }
    }

    /// The step as an SVG timeline: a row per block, a rectangle per stage coloured by class.
    pub fn svg(&self) -> String {
        let n = self.stages.len();
        let t0 = (0..self.blocks).map(|b| self.at(0, b).0).min().unwrap_or(0);
        let t1 = (0..self.blocks)
            .map(|b| self.at(n.saturating_sub(1), b).1)
            .max()
            .unwrap_or(t0)
            .max(t0 + 1);
        let (width, row) = (1600.0, 4.0);
        let scale = width / (t1 - t0) as f64;
        let colour = |k: StageKind| match k {
            StageKind::Qkv | StageKind::QkvFromEmbedding => "#4e79a7",
            StageKind::Attention => "#f28e2b",
            StageKind::O => "#e15759",
            StageKind::GateUp => "#76b7b2",
            StageKind::Down => "#59a14f",
            StageKind::Head => "#b07aa1",
        };
        let height = row * self.blocks as f64 + 40.0;
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\">\n\
             <text x=\"4\" y=\"{}\" font-size=\"12\" font-family=\"sans-serif\">persistent step, \
             {:.1} us, {} blocks (rows), {} stages; blue qkv, orange attention, red o, teal gate|up, \
             green down, purple head; white = waiting</text>\n",
            height - 8.0,
            (t1 - t0) as f64 / 1e3,
            self.blocks,
            n
        );
        for b in 0..self.blocks {
            for (si, st) in self.stages.iter().enumerate() {
                let (a, e) = self.at(si, b);
                let x = (a.saturating_sub(t0)) as f64 * scale;
                let w = (e.saturating_sub(a) as f64 * scale).max(0.2);
                s.push_str(&format!(
                    "<rect x=\"{x:.2}\" y=\"{:.1}\" width=\"{w:.2}\" height=\"{:.1}\" fill=\"{}\"/>\n",
                    b as f64 * row,
                    row - 0.5,
                    colour(st.kind)
                ));
            }
        }
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_barrier_setting_parses_and_names_a_bad_value() {
        assert_eq!(Barrier::parse(None), Ok(Barrier::Count));
        assert_eq!(Barrier::parse(Some("count")), Ok(Barrier::Count));
        assert_eq!(Barrier::parse(Some("flags")), Ok(Barrier::Flags));
        let e = Barrier::parse(Some("flag")).unwrap_err();
        assert!(
            e.contains("SIEVE_PERSISTENT_BARRIER=flag") && e.contains("flags"),
            "{e}"
        );
    }

    fn shape(hd: usize) -> PersistentShape {
        PersistentShape {
            hidden: 576,
            heads: 9,
            kv_heads: 3,
            head_dim: hd,
            intermediate: 1536,
            vocab: 100,
            capacity: 64,
            eps: 1e-5,
        }
    }

    #[test]
    fn shapes_outside_the_kernel_are_named() {
        assert!(unsupported_shape(&shape(64)).is_none());
        assert!(unsupported_shape(&shape(128)).is_none());
        let why = unsupported_shape(&shape(96)).unwrap();
        assert!(why.contains("head dim 96"), "{why}");
        let mut s = shape(64);
        s.kv_heads = 2;
        assert!(unsupported_shape(&s).unwrap().contains("9 heads over 2"));
        s = shape(64);
        s.intermediate = 1534;
        assert!(unsupported_shape(&s)
            .unwrap()
            .contains("intermediate size 1534"));
    }

    #[test]
    fn trace_summary_separates_work_from_barriers() {
        // Two stages, two blocks: stage 0 runs 0..10 and 0..6 ns, stage 1 starts at 14 and 15.
        let t = Trace {
            stages: vec![
                Stage {
                    kind: StageKind::Qkv,
                    layer: 0,
                },
                Stage {
                    kind: StageKind::Head,
                    layer: 0,
                },
            ],
            blocks: 2,
            stamps: vec![0, 10_000, 0, 6_000, 14_000, 20_000, 15_000, 20_000],
            shape: shape(64),
            positions: 1,
            counted: Vec::new(),
        };
        let s = t.summary();
        assert!((s.step_us - 20.0).abs() < 1e-9);
        assert_eq!(s.work_us, vec![("norm+qkv+rope", 10.0), ("norm+head", 6.0)]);
        assert!((s.barrier_us - 5.0).abs() < 1e-9);
        // busy = 10 + 6 + 6 + 5 = 27 of 2 x 20.
        assert!((s.idle_fraction - (1.0 - 27.0 / 40.0)).abs() < 1e-9);
        assert!(t.svg().contains("<rect"));
    }

    #[test]
    fn idle_per_block_is_the_step_less_its_own_work() {
        // The two blocks above: block 0 works 10 + 6 of the 20 ns step, block 1 6 + 5.
        let t = Trace {
            stages: vec![
                Stage {
                    kind: StageKind::Qkv,
                    layer: 0,
                },
                Stage {
                    kind: StageKind::Head,
                    layer: 0,
                },
            ],
            blocks: 2,
            stamps: vec![0, 10_000, 0, 6_000, 14_000, 20_000, 15_000, 20_000],
            shape: shape(64),
            positions: 1,
            counted: Vec::new(),
        };
        assert_eq!(t.idle_us_per_block(), vec![4.0, 9.0]);
        let s = t.summary();
        assert_eq!(
            s.idle_per_block,
            IdleSpread {
                min_us: 4.0,
                median_us: 6.5,
                max_us: 9.0,
                worst_block: 1
            }
        );
        // The mean of the blocks' idle times is the summary's idle fraction of the step.
        assert!((s.idle_fraction - (4.0 + 9.0) / 2.0 / 20.0).abs() < 1e-9);
        // A trace missing stamps has no blocks to spread.
        let short = Trace {
            stamps: vec![0, 1],
            ..t
        };
        assert!(short.idle_us_per_block().is_empty());
        assert_eq!(short.summary().idle_per_block, IdleSpread::default());
    }

    #[test]
    fn idle_spread_takes_the_middle_and_the_first_worst_block() {
        let s = IdleSpread::of(&[3.0, 7.0, 1.0, 7.0, 2.0]);
        assert_eq!(
            s,
            IdleSpread {
                min_us: 1.0,
                median_us: 3.0,
                max_us: 7.0,
                worst_block: 1
            }
        );
        assert_eq!(IdleSpread::of(&[]), IdleSpread::default());
    }

    #[test]
    fn stages_read_their_f16_weights_and_the_attended_cache() {
        // hidden 576, 9 heads, 3 KV heads of 64, intermediate 1536, vocabulary 100.
        let s = shape(64);
        let bytes = |kind| stage_read_bytes(&s, kind, 10);
        assert_eq!(bytes(StageKind::Qkv), (576 + 2 * 192) * 576 * 2);
        assert_eq!(
            bytes(StageKind::QkvFromEmbedding),
            bytes(StageKind::Qkv) + 576 * 2
        );
        // K and V, 3 KV heads x 64, 10 positions, f16.
        assert_eq!(bytes(StageKind::Attention), 2 * 192 * 10 * 2);
        assert_eq!(bytes(StageKind::O), 576 * 576 * 2);
        assert_eq!(bytes(StageKind::GateUp), 2 * 1536 * 576 * 2);
        assert_eq!(bytes(StageKind::Down), 576 * 1536 * 2);
        assert_eq!(bytes(StageKind::Head), 100 * 576 * 2);
        assert_eq!(stage_read_bytes(&s, StageKind::Attention, 0), 0);
    }

    #[test]
    fn the_stage_buffer_count_is_checked() {
        assert_eq!(parse_tcbc_stages(None), Ok(TCBC_STAGES));
        assert_eq!(parse_tcbc_stages(Some("8")), Ok(8));
        for bad in ["1", "9", "", "four", "-2"] {
            let err = parse_tcbc_stages(Some(bad)).unwrap_err();
            assert!(err.contains("from 2 to 8"), "{bad}: {err}");
        }
        // Four buffers: 16 KB of lists, 16 KB of sums, 4 x 17,664 bytes.
        assert_eq!(tcbc_area_bytes(4), 103_424);
    }

    #[test]
    fn kernel_structs_have_the_kernels_layout() {
        use std::mem::{align_of, offset_of, size_of};
        // The kernel's static_asserts check the same sizes (PTcbc, PBcbc, PLayer, PArgs).
        assert_eq!(size_of::<PersistentTcbc>(), 56);
        assert_eq!(size_of::<PersistentBcbc>(), 32);
        assert_eq!(align_of::<PersistentBcbc>(), 8);
        assert_eq!(offset_of!(PersistentBcbc, rows), 8);
        assert_eq!(offset_of!(PersistentBcbc, cols_per_task), 28);
        // PLayer: 9 addresses, 4 thresholds, 4 PTcbc, 4 PBcbc.
        assert_eq!(offset_of!(PersistentLayer, t_qkv), 72);
        assert_eq!(offset_of!(PersistentLayer, s_qkv), 88);
        assert_eq!(offset_of!(PersistentLayer, s_down), 88 + 3 * 56);
        assert_eq!(offset_of!(PersistentLayer, b_qkv), 312);
        assert_eq!(offset_of!(PersistentLayer, b_down), 312 + 3 * 32);
        assert_eq!(size_of::<PersistentLayer>(), 440);
        // PArgs: 18 eight-byte words, 15 four-byte ones, the accumulators, s_head, b_head.
        assert_eq!(offset_of!(PersistentArgs, n_stages), 144);
        assert_eq!(offset_of!(PersistentArgs, tcbc_stages), 200);
        assert_eq!(offset_of!(PersistentArgs, acc_qkv), 208);
        assert_eq!(offset_of!(PersistentArgs, s_head), 224);
        assert_eq!(offset_of!(PersistentArgs, b_head), 280);
        assert_eq!(size_of::<PersistentArgs>(), 312);
    }

    #[test]
    fn the_sparse_area_fits_either_format() {
        // Balanced-CBC: 16 warps x 16 rows x 32 lanes of f32.
        assert_eq!(BCBC_AREA_BYTES, 32_768);
        assert_eq!(sparse_area_bytes(false, false, 4), 0);
        assert_eq!(sparse_area_bytes(false, true, 4), 32_768);
        assert_eq!(sparse_area_bytes(true, false, 4), tcbc_area_bytes(4));
        for stages in 2..=8 {
            let both = sparse_area_bytes(true, true, stages);
            assert!(both >= tcbc_area_bytes(stages) && both >= BCBC_AREA_BYTES);
        }
        // The kernel keeps a sparse q|k|v's new k and v rows (2 x 256 f16) there too.
        const { assert!(BCBC_AREA_BYTES >= 2 * 256 * 2) };
    }

    #[test]
    fn balanced_cbc_tasks_fill_whole_waves() {
        for (rows, cols) in [
            (12288, 4096),
            (22016, 4096),
            (4096, 11008),
            (4096, 4096),
            (32000, 4096),
            (301, 256),
            (50, 40),
            (7, 3),
        ] {
            let c = bcbc_cols_per_task(rows, cols, 132);
            assert!(
                c.is_multiple_of(16) && (16..=1024).contains(&c),
                "{rows}x{cols}: {c}"
            );
        }
        // Llama-2-7B on 132 SMs. q|k|v: 24 row tiles x 5 chunks of 832 = 120 tasks, one wave
        // (4 chunks of 1024 would be one wave of longer tasks).
        assert_eq!(bcbc_cols_per_task(12288, 4096, 132), 832);
        // The head: 63 row tiles x 4 chunks of 1024 = 252 tasks, two waves.
        assert_eq!(bcbc_cols_per_task(32000, 4096, 132), 1024);
        // gate|up: 43 row tiles x 6 chunks of 688 = 258 tasks, two waves.
        assert_eq!(bcbc_cols_per_task(22016, 4096, 132), 688);
        // o: 8 row tiles x 16 chunks of 256 = 128 tasks, one wave of short ones.
        assert_eq!(bcbc_cols_per_task(4096, 4096, 132), 256);
        // down: 8 row tiles x 16 chunks of 688 = 128 tasks.
        assert_eq!(bcbc_cols_per_task(4096, 11008, 132), 688);
        // A narrow matrix: one column a warp.
        assert_eq!(bcbc_cols_per_task(7, 3, 132), 16);
    }

    #[test]
    fn tiled_cbc_tasks_fill_whole_waves() {
        for (rows, cols) in [
            (12288, 4096),
            (22016, 4096),
            (4096, 11008),
            (960, 576),
            (50, 40),
        ] {
            let c = tcbc_cols_per_task(rows, cols, 132);
            assert!(
                c.is_multiple_of(16) && (16..=512).contains(&c),
                "{rows}x{cols}: {c}"
            );
        }
        // Llama-2-7B q|k|v: 48 row tiles x 8 chunks of 512 = 384 tasks, three waves of 132.
        assert_eq!(tcbc_cols_per_task(12288, 4096, 132), 512);
        // down: 16 row tiles; 24 chunks of 464 make 384 tasks (three waves), 512 would too
        // but with longer tasks.
        assert_eq!(tcbc_cols_per_task(4096, 11008, 132), 464);
        // A small matrix spreads over the blocks: 4 row tiles x 18 chunks of 32 = 72 tasks.
        assert_eq!(tcbc_cols_per_task(960, 576, 132), 32);
    }

    #[test]
    fn a_counted_stage_reads_what_the_kernel_counted() {
        let stage = |kind| Stage { kind, layer: 0 };
        let t = Trace {
            stages: vec![
                stage(StageKind::QkvFromEmbedding),
                stage(StageKind::Attention),
                stage(StageKind::Head),
            ],
            blocks: 1,
            stamps: vec![0, 1_000, 1_000, 2_000, 2_000, 3_000],
            shape: shape(64),
            positions: 1,
            counted: vec![Some(5_000), None, None],
        };
        let s = t.summary();
        // The counted q|k|v and the embedding row (576 f16); attention its one cache row
        // (2 x 192 f16) whatever q|k|v was; the dense head.
        assert_eq!(
            s.read_bytes,
            vec![
                ("norm+qkv+rope", 5_000 + 2 * 576),
                ("attention", 2 * 192 * 2),
                ("norm+head", 100 * 576 * 2)
            ]
        );
    }

    #[test]
    fn classes_are_measured_against_the_copy_bandwidth() {
        // One block: q|k|v 0..2 us, attention 2.5..2.6 us, head 3..6 us.
        let s = PersistentShape {
            hidden: 1000,
            heads: 2,
            kv_heads: 1,
            head_dim: 500,
            intermediate: 2000,
            vocab: 3000,
            capacity: 128,
            eps: 1e-5,
        };
        let stage = |kind| Stage { kind, layer: 0 };
        let t = Trace {
            stages: vec![
                stage(StageKind::Qkv),
                stage(StageKind::Attention),
                stage(StageKind::Head),
            ],
            blocks: 1,
            stamps: vec![0, 2_000, 2_500, 2_600, 3_000, 6_000],
            shape: s,
            positions: 100,
            counted: Vec::new(),
        };
        let summary = t.summary();
        // q|k|v (1000 + 2 x 500) x 1000, K and V 500 x 100 each, head 3000 x 1000; f16.
        assert_eq!(
            summary.read_bytes,
            vec![
                ("norm+qkv+rope", 4_000_000),
                ("attention", 200_000),
                ("norm+head", 6_000_000)
            ]
        );
        let c = summary.against_copy(4000.0).unwrap();
        let gbs: Vec<(&str, f64, f64)> = c
            .classes
            .iter()
            .map(|k| (k.class, k.gbs, k.of_copy))
            .collect();
        // 4 MB in 2 us, 0.2 MB in 0.1 us, 6 MB in 3 us: 2000 GB/s each, half of 4000.
        for (class, g, of) in gbs {
            assert!((g - 2000.0).abs() < 1e-6, "{class}: {g}");
            assert!((of - 0.5).abs() < 1e-9, "{class}: {of}");
        }
        // 10.2 MB over the 6 us step; at 4000 GB/s they take 2.55 us, so 3.45 us is fixed.
        assert_eq!(c.step.bytes, 10_200_000);
        assert!((c.step.gbs - 1700.0).abs() < 1e-6);
        assert!((c.step.of_copy - 0.425).abs() < 1e-9);
        assert!((c.byte_floor_us - 2.55).abs() < 1e-9);
        assert!((c.fixed_cost_us - 3.45).abs() < 1e-9);
        // No copy bandwidth measured: nothing to compare with.
        assert!(summary.against_copy(0.0).is_none());
        assert!(summary.against_copy(f64::NAN).is_none());
    }
}
