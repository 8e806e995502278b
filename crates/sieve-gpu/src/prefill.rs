//! Prefill in one batch: the prompt's tokens go through every layer together, the products as
//! cuBLAS GEMMs on f16 weights, so that time to first token is a few GEMMs per layer instead of
//! one decode step per prompt token. `GpuModel::prefill` then takes the last row's logits and
//! samples with the decode step's tail; the server's slots (`extend_slot`) do the same, so their
//! answers are `generate`'s. Several slots' chunks in one pass (`extend_slots`) keep each
//! chunk's own kernels (attention per chunk, products on the kernels its length selects), so
//! theirs differ only where cuBLAS sums a GEMM of another token count in another order.
//!
//! | weights on the device | GEMM operand |
//! |---|---|
//! | dense row-major (M x K) | the weights themselves, `op = T` |
//! | dense column-major (K x ldm) | the weights themselves, `op = N`, `lda = ldm` |
//! | Tiled-CBC, up to 4 tokens (a few sequences' decode step, or a short prompt chunk) | no GEMM: the union product reads each column active in some token once (`tcbc_spmspv_union_n*`, f32 rows) |
//! | Balanced-CBC with f16 values, up to 8 tokens | no GEMM: its union product, 4 tokens a launch (`bcbc_union_n*`, `bcbc_idx_union_n*`) |
//! | Tiled-CBC, up to [`TCBC_SPMM_MAX_TOKENS`] tokens | no GEMM: the tensor-core SpMM reads the compressed tiles (`tcbc_spmm`) |
//! | Tiled-CBC, more tokens (or K not a multiple of 8) | decoded into a K x M f16 scratch (`tcbc_decode_t`), `op = N` |
//! | dense low-bit (GGUF blocks of every type, W4A16, W8A16), up to 64 tokens | no GEMM: the low-bit kernel, 32 tokens per launch |
//! | the same, more tokens ([`LOWBIT_DECODE_MIN_TOKENS`]) | decoded into an M x K f16 scratch (`lowbit_*_to_f16`), `op = T` (not the LM head: its copy would be vocabulary-sized) |
//! | IE-BME, up to 32 tokens | no GEMM: the IE-BME kernel (union bitmaps into tensor-core fragments) |
//! | IE-BME, more tokens ([`IE_BME_DECODE_MIN_TOKENS`]) | decoded into an M x K f16 scratch (`ie_bme_*_to_f16`), `op = T` |
//! | column-major 4-bit (W4A16 g128 or Q4_0 under a TEAL threshold) | decoded into a K x M f16 scratch (`lbc_w4_to_f16_t`), `op = N` |
//! | Balanced-CBC, f16 values past 8 tokens, or int8 / int4 values | decoded into a K x M f16 scratch (`bcbc_to_f16_t`, `blb_to_f16_t`), `op = N` |
//! | RLC-CSC | zeroed, its entries written into a K x M f16 scratch (`rlc_to_f16_t`), `op = N` |
//! | SlideSparse, up to 255 tokens | no GEMM: the f32 rows lifted (masked, rounded to f16) into the f16 scratch, then the 2:4 `mma.sp` product of all the chunk's tokens (`slide_spmm`) |
//! | SlideSparse, more tokens ([`sieve_cuda::slide::DECODE_MIN_TOKENS`]) | decoded into an M x K f16 scratch (`slide_to_f16_rows`, rows padded to 8), `op = T` |
//!
//! Activations enter each GEMM as f16, masked by the product's TEAL threshold per token
//! (the CPU path's `matmul` semantics); GEMMs accumulate in f32, o_proj and down_proj with
//! `beta = 1` into the residual stream. Attention is causal over the cache, which the chunk's
//! RoPE kernel fills first. Prompts longer than the model's chunk ([`chunk_setting`]) run in
//! chunks.

use crate::error::{GpuError, Result};
use crate::matrix::{DeviceLinear, DeviceMatrix};
use cudarc::driver::CudaSlice;
use half::f16;
use sieve_cuda::cusparselt::LtPrecision;
use sieve_cuda::slide_lt::SlideLt;
use sieve_cuda::{dev_ptr, DevPtr, DriverContext, Gpu};
use sieve_formats::Threshold;

/// Tokens per batched pass by default (bounds the scratch buffers; prompts longer than a
/// model's chunk run in chunks, each reading every weight again). Measured (H100, 2026-12-06,
/// dense f16 7B, 2,048-token prompt): passes of 256 took 73.98 ms to the first token, 1,024
/// 56.26 ms, 2,048 55.59 ms; 1,024 holds about 185 MB of scratch for that shape.
pub const DEFAULT_CHUNK: usize = 1024;

/// Bounds of `SIEVE_PREFILL_CHUNK`: at least the many-sequence step's largest batch (it runs
/// through the same scratch) and above [`TCBC_SPMM_MAX_TOKENS`].
pub const MIN_CHUNK: usize = 128;
pub const MAX_CHUNK: usize = 4096;

/// Tokens per batched pass: `SIEVE_PREFILL_CHUNK` in the environment (a switch for measuring
/// the chunk against the time to first token, read once; [`MIN_CHUNK`]..=[`MAX_CHUNK`]), else
/// [`DEFAULT_CHUNK`].
pub fn chunk_setting() -> Result<usize> {
    static SETTING: std::sync::OnceLock<std::result::Result<usize, String>> =
        std::sync::OnceLock::new();
    SETTING
        .get_or_init(|| parse_chunk(std::env::var("SIEVE_PREFILL_CHUNK").ok().as_deref()))
        .clone()
        .map_err(GpuError::InvalidArgument)
}

/// The chunk a `SIEVE_PREFILL_CHUNK` value asks for ([`DEFAULT_CHUNK`] when unset).
fn parse_chunk(value: Option<&str>) -> std::result::Result<usize, String> {
    let Some(v) = value else {
        return Ok(DEFAULT_CHUNK);
    };
    v.trim()
        .parse::<usize>()
        .ok()
        .filter(|n| (MIN_CHUNK..=MAX_CHUNK).contains(n))
        .ok_or_else(|| {
            format!(
                "SIEVE_PREFILL_CHUNK={v:?}: expected a token count from {MIN_CHUNK} to {MAX_CHUNK}"
            )
        })
}

/// Most tokens a Tiled-CBC product runs through the tensor-core SpMM (`tcbc_spmm`): one block
/// of 64 tokens; above, the matrix is decoded to f16 once and cuBLAS multiplies it. Measured
/// (H100, 2026-12-05, 7B shapes at sp 0.5): the SpMM decodes the weights once per 64 tokens,
/// 63.5 us for 11008 x 4096 at 32 tokens against 167 us for decode + GEMM, but a 128-token
/// prompt's q|k|v took 7.0 ms over 32 layers (two token tiles) against 1.5 ms dense.
pub const TCBC_SPMM_MAX_TOKENS: usize = 64;

/// Fewest tokens for which a Tiled-CBC matrix with a resident f16 copy
/// ([`crate::matrix::Layouts::prompt16`]) is multiplied by cuBLAS on the copy instead of the
/// SpMM: where the SpMM was measured slower than cuBLAS.
pub const RESIDENT_OVER_SPMM_TOKENS: usize = 16;

/// Fewest tokens for which a batched pass multiplies a low-bit matrix in the tensor-core layout
/// (`DeviceMatrix::LowBit`) by cuBLAS on an f16 copy ([`GpuLowBit::decode_rows_f16`]) instead
/// of its own kernel, which takes at most 32 tokens a launch and so reads every weight again
/// per 32 tokens. Measured (H200, 2026-12-04, 11008 x 4096 W4A16 g128): the kernel 42 us at 32
/// tokens against cuBLAS f16 30 us, and a decode writes ~2.5 bytes per weight (~45 us): the
/// copy pays from about 64 tokens on.
///
/// [`GpuLowBit::decode_rows_f16`]: sieve_cuda::lowbit::GpuLowBit::decode_rows_f16
pub const LOWBIT_DECODE_MIN_TOKENS: usize = 65;

/// Fewest tokens for which a batched pass multiplies an IE-BME matrix by cuBLAS on an f16 copy
/// (`GpuIeBme::decode_rows_f16`) instead of its kernel: two launches of 32 tokens. Measured for
/// the kernel (H200, 2026-12-04, 11008 x 4096 int4 sp 0.5): 82.5 us at 32 tokens, 58.8 at 16,
/// against cuBLAS f16 30 us; the copy costs about what the low-bit one does (above), not yet
/// measured.
pub const IE_BME_DECODE_MIN_TOKENS: usize = 33;

/// `SIEVE_LOWBIT_PREFILL=kernel` in the environment keeps the low-bit, IE-BME and SlideSparse
/// kernels for every batch (read once): a switch for measuring the f16 copies against them, not
/// a setting.
fn lowbit_copy_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("SIEVE_LOWBIT_PREFILL").as_deref() != Ok("kernel"))
}

/// True when `SIEVE_SLIDE_PROMPT=cusparselt` (read once): SlideSparse matrices are also
/// uploaded to cuSPARSELt, and prompt passes of [`SLIDE_LIBRARY_MIN_TOKENS`] or more multiply
/// them there ([`crate::matrix::Layouts::slide_library`]). Off by default until measured in
/// the model against the f16 copy and cuBLAS.
pub fn slide_library_requested() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SIEVE_SLIDE_PROMPT").as_deref() == Ok("cusparselt"))
}

/// Fewest tokens of a prompt pass that multiplies a SlideSparse matrix on cuSPARSELt (when it
/// was uploaded there): where the f16 copy takes over from `mma.sp` today.
pub const SLIDE_LIBRARY_MIN_TOKENS: usize = sieve_cuda::slide::DECODE_MIN_TOKENS;

/// A pass's token count is rounded up to a multiple of this for its cuSPARSELt plan, so that
/// a matrix keeps a few plans (passes are mostly whole chunks).
pub const SLIDE_LIBRARY_TOKEN_STEP: usize = 256;

/// Fewest tokens of a prompt pass that multiplies the 8-bit copies of [`Layouts::prompt8`]
/// (W8A8): where cuSPARSELt takes over for slide matrices.
///
/// [`Layouts::prompt8`]: crate::matrix::Layouts::prompt8
pub const PROMPT8_MIN_TOKENS: usize = SLIDE_LIBRARY_MIN_TOKENS;

/// Where a library product of `n` tokens keeps its buffers in the pass's f16 scratch, in
/// bytes from its start: the lifted (or quantized) rows, then the accumulators (4 bytes each,
/// whatever type the plan picked), then the per-token scales. Every offset stays a multiple of
/// 256 bytes (`np` is a multiple of 256, K and M of 64).
struct LtScratchLayout {
    /// Tokens of the plan (n padded to [`SLIDE_LIBRARY_TOKEN_STEP`]).
    np: usize,
    acc: usize,
    scales: usize,
    /// f16 elements the whole takes.
    len16: usize,
}

fn lt_scratch_layout(
    n: usize,
    (mp, kp): (usize, usize),
    precision: LtPrecision,
) -> LtScratchLayout {
    let np = n.next_multiple_of(SLIDE_LIBRARY_TOKEN_STEP);
    let acc = np * kp * precision.input_bytes();
    let scales = acc + np * mp * 4;
    LtScratchLayout {
        np,
        acc,
        scales,
        len16: (scales + np * 4).div_ceil(2),
    }
}

/// [`lt_scratch_layout`] of one library product of `n` tokens, or an error naming `what` when
/// the pass's f16 scratch (`w16_len` elements) is too short for it.
fn lt_scratch_within(
    what: &str,
    n: usize,
    shape: (usize, usize),
    precision: LtPrecision,
    w16_len: usize,
) -> Result<LtScratchLayout> {
    let l = lt_scratch_layout(n, shape, precision);
    if l.len16 > w16_len {
        return Err(GpuError::InvalidArgument(format!(
            "{n} tokens in one {what} pass: its scratch holds {w16_len} f16 values, {} needed",
            l.len16
        )));
    }
    Ok(l)
}

/// f16 elements of the scratch a cuSPARSELt slide product of `n` tokens takes from the pass's
/// f16 scratch ([`lt_scratch_layout`]), and its padded token count.
fn slide_library_scratch(s: &SlideLt, n: usize) -> (usize, usize) {
    let l = lt_scratch_layout(n, s.plan_shape(), s.precision());
    (l.np, l.len16)
}

/// False when `SIEVE_BATCH_UNION=off` (read once): a switch for measuring the union products
/// against what a batch runs without them, not a setting.
fn union_allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SIEVE_BATCH_UNION").as_deref() != Ok("off"))
}

// A graph-replayed batch runs a power-of-two bucket of rows: a batch that the union takes must
// round up to a bucket it still takes.
const _: () = assert!(sieve_cuda::tiled_cbc::UNION_MAX_TOKENS.is_power_of_two());
const _: () = assert!(sieve_cuda::balanced_cbc::UNION_MAX_TOKENS.is_power_of_two());

/// True when a batch of `n` tokens multiplies `m` by its union product (every column active in
/// some token read once, f32 sums; `union_rows` of the column formats) rather than the SpMM or
/// an f16 copy: Tiled-CBC up to [`tiled_cbc::UNION_MAX_TOKENS`] tokens, Balanced-CBC with f16
/// values up to [`balanced_cbc::UNION_MAX_TOKENS`].
///
/// [`tiled_cbc::UNION_MAX_TOKENS`]: sieve_cuda::tiled_cbc::UNION_MAX_TOKENS
/// [`balanced_cbc::UNION_MAX_TOKENS`]: sieve_cuda::balanced_cbc::UNION_MAX_TOKENS
pub fn by_union(m: &DeviceMatrix, n: usize) -> bool {
    let most = match m {
        DeviceMatrix::TiledCbc(_) => sieve_cuda::tiled_cbc::UNION_MAX_TOKENS,
        DeviceMatrix::BalancedCbc(_) => sieve_cuda::balanced_cbc::UNION_MAX_TOKENS,
        _ => return false,
    };
    n <= most && union_allowed()
}

/// True when a batch of `n` (>= 2) tokens through `linears` decodes nothing to f16 and runs
/// every column-format matrix through its union product: the batch reads each weight at most
/// once, where `n` single steps read each active one `n` times, so it runs as one pass
/// whatever [`crate::GpuModel::min_batched_sequences`] says for larger batches.
pub fn union_covers(linears: &[&DeviceLinear], n: usize) -> bool {
    n >= 2
        && linears.iter().all(|l| {
            l.parts.iter().all(|p| match &p.matrix {
                DeviceMatrix::TiledCbc(_) | DeviceMatrix::BalancedCbc(_) => by_union(&p.matrix, n),
                DeviceMatrix::BalancedLowBit(_) | DeviceMatrix::RlcCsc(_) => false,
                DeviceMatrix::LowBitCols(_, twin) => twin.is_some(),
                _ => true,
            })
        })
        && linears.iter().any(|l| {
            l.parts.iter().any(|p| {
                matches!(
                    p.matrix,
                    DeviceMatrix::TiledCbc(_) | DeviceMatrix::BalancedCbc(_)
                )
            })
        })
}

/// True when every Tiled-CBC matrix among `linears` is multiplied by the SpMM for a batch of
/// `n` tokens (none is decoded to f16 first).
pub fn tiled_cbc_by_spmm(linears: &[&DeviceLinear], n: usize) -> bool {
    linears.iter().all(|l| {
        l.parts.iter().all(|p| match &p.matrix {
            DeviceMatrix::TiledCbc(t) => n <= TCBC_SPMM_MAX_TOKENS && t.spmm_supports(l.cols),
            _ => true,
        })
    })
}

/// Scratch of the batched pass, sized for `chunk` tokens and the model's widest matrix.
pub struct PrefillBuffers {
    /// Tokens a pass holds (the model's chunk).
    pub chunk: usize,
    /// Residual stream `[n][d]`.
    pub x: CudaSlice<f32>,
    /// Normed f32 rows `[n][d]`.
    pub xn: CudaSlice<f32>,
    /// f16 GEMM input `[n][max K]`.
    pub a16: CudaSlice<f16>,
    /// Token ids of the chunk.
    pub tokens: CudaSlice<i32>,
    /// Product outputs `[n][max M]` (q|k|v, then gate|up).
    pub y: CudaSlice<f32>,
    /// Attention output `[n][H hd]`.
    pub att: CudaSlice<f32>,
    /// Attention split partials for up to `chunk` queries
    /// ([`sieve_cuda::attention::rows_partials_len`]).
    pub part: CudaSlice<f32>,
    /// f16 scratch of [`scratch16_len`] elements: a decoded K x M weight matrix (Tiled-CBC
    /// past the SpMM), or a SlideSparse matrix's lifted activations `[n][K'p]`.
    pub w16: CudaSlice<f16>,
}

impl PrefillBuffers {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        chunk: usize,
        d: usize,
        max_k: usize,
        max_m: usize,
        att: usize,
        part: usize,
        decoded: usize,
    ) -> Result<Self> {
        let s = gpu.stream();
        let f32s = |n: usize| {
            s.alloc_zeros::<f32>(n.max(1))
                .during("allocating prefill scratch")
        };
        Ok(Self {
            chunk,
            x: f32s(chunk * d)?,
            xn: f32s(chunk * d)?,
            tokens: s
                .alloc_zeros::<i32>(chunk)
                .during("allocating prefill scratch")?,
            a16: s
                .alloc_zeros::<f16>((chunk * max_k).max(1))
                .during("allocating prefill scratch")?,
            y: f32s(chunk * max_m)?,
            att: f32s(chunk * att)?,
            part: f32s(part)?,
            w16: s
                .alloc_zeros::<f16>(decoded.max(1))
                .during("allocating prefill scratch")?,
        })
    }
}

/// True when a batched pass over `linears` decodes some matrix to f16 first once it has more
/// tokens than the union products take (a Balanced-CBC one: past 8 tokens; with low-bit values
/// or an RLC-CSC one: always, their only batched product is their f16 copy).
pub fn always_decoded(linears: &[&DeviceLinear]) -> bool {
    linears.iter().any(|l| {
        l.parts.iter().any(|p| {
            matches!(
                p.matrix,
                DeviceMatrix::BalancedCbc(_)
                    | DeviceMatrix::BalancedLowBit(_)
                    | DeviceMatrix::RlcCsc(_)
            )
        })
    })
}

/// True when a Tiled-CBC matrix of `cols` columns is decoded to f16 for some pass of up to
/// `chunk` tokens rather than multiplied by the SpMM (see [`linear_rows`]).
fn decoded_in_pass(t: &sieve_cuda::tiled_cbc::GpuTiledCbc, cols: usize, chunk: usize) -> bool {
    chunk > TCBC_SPMM_MAX_TOKENS || !t.spmm_supports(cols)
}

/// Elements of the largest matrix among `linears` that a pass decodes to f16: a Tiled-CBC one
/// past the SpMM, a column-major 4-bit one, a Balanced-CBC or an RLC-CSC one (padded). 0 when
/// none is decoded.
pub fn decoded_len(linears: &[&DeviceLinear], chunk: usize) -> usize {
    decoded_len_where(linears, chunk, true, false)
}

/// [`decoded_len`] for a many-sequence step (at most [`crate::runner::MAX_SEQUENCES`] rows,
/// below [`LOWBIT_DECODE_MIN_TOKENS`]): a column-major 4-bit matrix with its batch layout
/// (`Layouts::batch`) goes through the low-bit kernel there, not an f16 copy.
pub fn step_decoded_len(linears: &[&DeviceLinear], chunk: usize) -> usize {
    decoded_len_where(linears, chunk, false, true)
}

// A many-sequence step never reaches the f16 copy of a low-bit matrix.
const _: () = assert!(crate::runner::MAX_SEQUENCES < LOWBIT_DECODE_MIN_TOKENS);

/// `with_resident`: count the matrices that keep a resident f16 copy ([`Layouts::prompt16`])
/// too. Scratch sizes leave them out (a pass multiplies their copy where it lies); the
/// many-sequence step's policy keeps them (a batched pass still reads 2 bytes a weight where
/// each sequence's own step reads the format).
///
/// [`Layouts::prompt16`]: crate::matrix::Layouts::prompt16
fn decoded_len_where(
    linears: &[&DeviceLinear],
    chunk: usize,
    with_batch_layout: bool,
    with_resident: bool,
) -> usize {
    linears
        .iter()
        .flat_map(|l| l.parts.iter().map(move |p| (p, l.cols)))
        .filter(|(p, _)| with_resident || p.resident16.is_none())
        .filter_map(|(p, k)| match &p.matrix {
            DeviceMatrix::TiledCbc(t) if decoded_in_pass(t, k, chunk) => Some(p.rows * k),
            DeviceMatrix::LowBitCols(_, Some(_)) if !with_batch_layout => None,
            DeviceMatrix::LowBitCols(c, _) => Some(c.padded_rows() * c.padded_cols()),
            DeviceMatrix::BalancedCbc(b) => Some(b.padded_rows() * k),
            DeviceMatrix::BalancedLowBit(b) => Some(b.padded_rows() * k),
            DeviceMatrix::RlcCsc(_) => Some(p.rows * k),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

/// Elements of the largest matrix among `linears` that keeps a kernel of its own for short
/// batches and is copied to f16 for long ones (padded): tensor-core-layout low-bit
/// ([`LOWBIT_DECODE_MIN_TOKENS`]), IE-BME ([`IE_BME_DECODE_MIN_TOKENS`]) and SlideSparse
/// ([`sieve_cuda::slide::DECODE_MIN_TOKENS`]; only when passes of `chunk` tokens reach it, or
/// its copy would be scratch no pass uses). The runner asks it
/// of the layers only: an LM head's copy (vocabulary x hidden) would cost more memory than the
/// few long batches through the head save, so the head keeps its kernel ([`linear_rows`]
/// copies only what its scratch holds).
pub fn long_batch_copy_len(linears: &[&DeviceLinear], chunk: usize) -> usize {
    let slide_copies = chunk >= sieve_cuda::slide::DECODE_MIN_TOKENS && lowbit_copy_allowed();
    linears
        .iter()
        .flat_map(|l| l.parts.iter())
        .filter(|p| p.resident16.is_none())
        .filter_map(|p| match &p.matrix {
            DeviceMatrix::LowBit(q) => Some(q.matrix.padded_rows() * q.matrix.padded_cols()),
            DeviceMatrix::IeBme(e) => Some(e.padded_rows() * e.padded_cols()),
            DeviceMatrix::Slide(s) if slide_copies => Some(s.matrix.rows() * s.matrix.decoded_ld()),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

/// f16 elements of the lifted activations of `chunk` tokens for the widest SlideSparse
/// matrix among `linears`, or of the W8A8 scratch of the widest 8-bit copy (0 without one).
pub fn lifted_len(linears: &[&DeviceLinear], chunk: usize) -> usize {
    let prompt8 = linears
        .iter()
        .flat_map(|l| l.parts.iter())
        .filter_map(|p| p.prompt8.as_ref())
        .filter(|_| chunk >= PROMPT8_MIN_TOKENS)
        .map(|c| lt_scratch_layout(chunk, c.matrix.plan_shape(), c.matrix.precision()).len16)
        .max()
        .unwrap_or(0);
    linears
        .iter()
        .flat_map(|l| l.parts.iter())
        .filter_map(|p| match &p.matrix {
            DeviceMatrix::Slide(s) => Some(match &s.library {
                Some(lib) if chunk >= SLIDE_LIBRARY_MIN_TOKENS => s
                    .matrix
                    .lifted_len(chunk)
                    .max(slide_library_scratch(lib, chunk).1),
                _ => s.matrix.lifted_len(chunk),
            }),
            _ => None,
        })
        .max()
        .unwrap_or(0)
        .max(prompt8)
}

/// How [`decode_f16`] lays out the f16 copy of a matrix: `len` elements, the GEMM operand
/// `transposed` (K x M, column k's rows contiguous) or not (M x K), leading dimension `ld`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyShape {
    pub len: usize,
    pub transposed: bool,
    pub ld: usize,
}

/// The f16 copy's shape of a `rows x cols` matrix in `matrix`'s format, `None` for the dense
/// formats (cuBLAS reads their own weights).
pub fn f16_copy_shape(matrix: &DeviceMatrix, rows: usize, cols: usize) -> Option<CopyShape> {
    let (len, transposed, ld) = match matrix {
        DeviceMatrix::DenseRows(_) | DeviceMatrix::DenseCols(_) => return None,
        DeviceMatrix::TiledCbc(_) | DeviceMatrix::RlcCsc(_) => (rows * cols, true, rows),
        DeviceMatrix::LowBitCols(c, _) => {
            (c.padded_rows() * c.padded_cols(), true, c.padded_rows())
        }
        DeviceMatrix::BalancedCbc(b) => (b.padded_rows() * cols, true, b.padded_rows()),
        DeviceMatrix::BalancedLowBit(b) => (b.padded_rows() * cols, true, b.padded_rows()),
        DeviceMatrix::IeBme(e) => (e.padded_rows() * e.padded_cols(), false, e.padded_cols()),
        DeviceMatrix::Slide(s) => (
            s.matrix.rows() * s.matrix.decoded_ld(),
            false,
            s.matrix.decoded_ld(),
        ),
        DeviceMatrix::LowBit(q) => (
            q.matrix.padded_rows() * q.matrix.padded_cols(),
            false,
            q.matrix.padded_cols(),
        ),
    };
    Some(CopyShape {
        len,
        transposed,
        ld,
    })
}

/// Decodes `matrix` to f16 at `dst` as [`f16_copy_shape`] lays it out (`dst` holds its `len`
/// elements); the dense formats have no copy and are refused.
pub fn decode_f16(gpu: &Gpu, matrix: &DeviceMatrix, dst: DevPtr) -> Result<()> {
    match matrix {
        DeviceMatrix::DenseRows(_) | DeviceMatrix::DenseCols(_) => {
            return Err(GpuError::InvalidArgument(
                "a dense f16 matrix has no f16 copy to decode".into(),
            ))
        }
        DeviceMatrix::TiledCbc(t) => t.decode_transposed(gpu, dst)?,
        DeviceMatrix::LowBitCols(c, _) => c.decode_transposed(gpu, dst)?,
        DeviceMatrix::RlcCsc(r) => r.decode_transposed(gpu, dst)?,
        DeviceMatrix::BalancedCbc(b) => b.decode_transposed(gpu, dst)?,
        DeviceMatrix::BalancedLowBit(b) => b.decode_transposed(gpu, dst)?,
        DeviceMatrix::IeBme(e) => e.decode_rows_f16(gpu, dst)?,
        DeviceMatrix::Slide(s) => s.matrix.decode_rows_f16(gpu, dst, s.matrix.decoded_ld())?,
        DeviceMatrix::LowBit(q) => q.matrix.decode_rows_f16(gpu, dst)?,
    }
    Ok(())
}

/// Elements of the pass's f16 scratch ([`PrefillBuffers::w16`]): the larger of
/// [`decoded_len`] and [`lifted_len`] for passes of up to `chunk` tokens.
pub fn scratch16_len(linears: &[&DeviceLinear], chunk: usize) -> usize {
    decoded_len(linears, chunk).max(lifted_len(linears, chunk))
}

/// `Y[n][row_offset ..] = beta Y + A · Wᵀ` for every part of `lin`: each part's input is
/// `x` (f32, `ldx` per row) masked by the part's threshold into `a16` first. `ldy` floats per
/// row of Y. `w16` is the f16 scratch of `w16_len` elements, at least [`scratch16_len`] (for
/// up to the pass's chunk of tokens); beta is 0 (Y written) or 1 (added to) for the parts that are not
/// GEMMs.
#[allow(clippy::too_many_arguments)]
pub fn linear_rows(
    gpu: &Gpu,
    lin: &DeviceLinear,
    x: DevPtr,
    ldx: usize,
    a16: DevPtr,
    n: usize,
    y: DevPtr,
    ldy: usize,
    beta: f32,
    w16: DevPtr,
    w16_len: usize,
) -> Result<()> {
    let k = lin.cols;
    let mut masked: Option<Threshold> = None;
    // The IE-BME kernel's own zeroing (split-K blocks wait for an epoch flag) is not safe to
    // replay from a captured graph, whose epoch is fixed: with beta = 0 the rows are zeroed
    // here and every IE-BME part accumulates.
    let ie_bme_accumulates = beta != 0.0
        || lin
            .parts
            .iter()
            .any(|p| matches!(p.matrix, DeviceMatrix::IeBme(_)));
    if beta == 0.0 && ie_bme_accumulates {
        // SAFETY: the caller's y holds n rows of ldy floats.
        unsafe { gpu.zero_bytes(y, n * ldy * 4) }?;
    }
    for p in &lin.parts {
        // Low-bit and IE-BME matrices: their own kernel for short batches, else the f16 copy.
        // A column-major 4-bit matrix uploaded with its tensor-core twin (`Layouts::batch`)
        // takes the low-bit kernel through the twin: the batch's masked rows, 32 tokens a
        // launch, 0.5 bytes a weight.
        let rows_kernel = match &p.matrix {
            DeviceMatrix::LowBit(q) | DeviceMatrix::LowBitCols(_, Some(q)) => Some(q),
            _ => None,
        };
        let (min_tokens, copy_len) = match (&p.matrix, rows_kernel) {
            (_, Some(q)) => (
                LOWBIT_DECODE_MIN_TOKENS,
                q.matrix.padded_rows() * q.matrix.padded_cols(),
            ),
            (DeviceMatrix::IeBme(e), _) => {
                (IE_BME_DECODE_MIN_TOKENS, e.padded_rows() * e.padded_cols())
            }
            _ => (0, 0),
        };
        let by_kernel = n < min_tokens
            || !lowbit_copy_allowed()
            || (p.resident16.is_none() && w16_len < copy_len);
        if let (Some(q), true) = (rows_kernel, by_kernel) {
            // The low-bit kernel reads rows padded to 128 columns (f16 in `a16`, or INT8 in
            // the product's own buffer with W4A8), at most 32 tokens a launch.
            let yp = y + (p.row_offset * 4) as u64;
            q.launch_rows(gpu, x, ldx, n, p.threshold, Some(a16), yp, ldy, beta != 0.0)?;
            if q.a8.is_none() {
                // `a16` now holds the f16 rows of this input, not the masked copy below.
                masked = None;
            }
            continue;
        }
        if let (DeviceMatrix::IeBme(e), true) = (&p.matrix, by_kernel) {
            // The IE-BME kernel reads the f32 rows and applies the threshold itself, 32 tokens
            // a launch.
            use sieve_cuda::ie_bme::MAX_TOKENS;
            let yp = y + (p.row_offset * 4) as u64;
            for t0 in (0..n).step_by(MAX_TOKENS) {
                let nt = (n - t0).min(MAX_TOKENS);
                e.launch_rows(
                    gpu,
                    x + (t0 * ldx * 4) as u64,
                    ldx,
                    nt,
                    p.threshold,
                    yp + (t0 * ldy * 4) as u64,
                    ldy,
                    ie_bme_accumulates,
                )?;
            }
            continue;
        }
        if let (Some(c), true) = (&p.prompt8, n >= PROMPT8_MIN_TOKENS) {
            // W8A8 on cuBLASLt: each token's masked row quantized into w16, the product, the
            // scaled sums into y.
            let l = lt_scratch_within(
                "8-bit prompt",
                n,
                c.matrix.plan_shape(),
                c.matrix.precision(),
                w16_len,
            )?;
            let plan = c.plan(gpu, l.np)?;
            let yp = y + (p.row_offset * 4) as u64;
            c.matrix.launch_rows_to(
                gpu,
                &plan,
                w16,
                w16 + l.acc as u64,
                w16 + l.scales as u64,
                x,
                ldx,
                n,
                p.threshold,
                yp,
                ldy,
                beta != 0.0,
            )?;
            continue;
        }
        if let DeviceMatrix::Slide(s) = &p.matrix {
            if let (Some(lib), true) = (&s.library, n >= SLIDE_LIBRARY_MIN_TOKENS) {
                // cuSPARSELt: the lifted rows (f16 or 8-bit codes), the accumulators and the
                // per-token scales, in w16.
                let l = lt_scratch_within(
                    "cuSPARSELt slide",
                    n,
                    lib.plan_shape(),
                    lib.precision(),
                    w16_len,
                )?;
                let codes = w16;
                let acc = w16 + l.acc as u64;
                let plan = s
                    .library_plan(gpu, l.np, codes, acc)?
                    .ok_or_else(|| GpuError::InvalidArgument("no cuSPARSELt copy".into()))?;
                let yp = y + (p.row_offset * 4) as u64;
                lib.launch_rows_to(
                    gpu,
                    &plan,
                    codes,
                    acc,
                    w16 + l.scales as u64,
                    x,
                    ldx,
                    n,
                    p.threshold,
                    yp,
                    ldy,
                    beta != 0.0,
                )?;
                continue;
            }
        }
        let slide_by_kernel = match &p.matrix {
            DeviceMatrix::Slide(s) => {
                n < sieve_cuda::slide::DECODE_MIN_TOKENS
                    || !lowbit_copy_allowed()
                    || (p.resident16.is_none() && w16_len < s.matrix.rows() * s.matrix.decoded_ld())
            }
            _ => false,
        };
        if let (DeviceMatrix::Slide(s), true) = (&p.matrix, slide_by_kernel) {
            // The lift reads the f32 rows and applies the threshold itself; the lifted rows
            // of all n tokens go to w16, then one product (split K adds with atomics, after
            // the kernel's own zeroing when beta = 0).
            if s.matrix.lifted_len(n) > w16_len {
                return Err(GpuError::InvalidArgument(format!(
                    "{n} tokens in one slide pass: its scratch holds {w16_len} lifted values"
                )));
            }
            let yp = y + (p.row_offset * 4) as u64;
            s.matrix
                .launch_rows(gpu, x, ldx, n, p.threshold, w16, yp, ldy, beta != 0.0)?;
            continue;
        }
        if by_union(&p.matrix, n) {
            // A few tokens (a decode step of a few sequences): the union of their active
            // columns, read once, from the f32 rows.
            let yp = y + (p.row_offset * 4) as u64;
            if beta == 0.0 {
                sieve_cuda::prefill::zero_rows(gpu, yp, ldy, n, p.rows)?;
            }
            match &p.matrix {
                DeviceMatrix::TiledCbc(t) => t.union_rows(gpu, x, ldx, n, p.threshold, yp, ldy)?,
                DeviceMatrix::BalancedCbc(b) => {
                    b.union_rows(gpu, x, ldx, n, p.threshold, yp, ldy)?
                }
                _ => unreachable!("by_union holds for the column formats only"),
            }
            continue;
        }
        if masked != Some(p.threshold) {
            sieve_cuda::prefill::rows_to_f16(gpu, x, ldx, a16, n, k, p.threshold)?;
            masked = Some(p.threshold);
        }
        let m = p.rows;
        if let DeviceMatrix::TiledCbc(t) = &p.matrix {
            // With a resident f16 copy, cuBLAS on it from 16 tokens: the SpMM runs at
            // 0.34-0.76x cuBLAS at 16-64 tokens (docs/BENCHMARKS.md "Window L1"); fewer
            // (a few sequences' decode step) keep the SpMM, which reads the format.
            let by_copy = p.resident16.is_some() && n >= RESIDENT_OVER_SPMM_TOKENS;
            if !by_copy && n <= TCBC_SPMM_MAX_TOKENS && t.spmm_supports(k) && a16.is_multiple_of(16)
            {
                let yp = y + (p.row_offset * 4) as u64;
                t.spmm_rows(gpu, a16, k, n, yp, ldy, beta != 0.0)?;
                continue;
            }
        }
        let (w, transposed, lda) = match (&p.matrix, &p.resident16) {
            (DeviceMatrix::DenseRows(d), _) => (dev_ptr(gpu, d.weights()), false, k),
            (DeviceMatrix::DenseCols(d), _) => (dev_ptr(gpu, d.weights()), true, d.ldm()),
            (_, Some(r)) => (dev_ptr(gpu, &r.values), r.transposed, r.ld),
            (matrix, None) => {
                let shape = f16_copy_shape(matrix, m, k).ok_or_else(|| {
                    GpuError::InvalidArgument("a matrix with no f16 copy reached the GEMM".into())
                })?;
                if shape.len > w16_len {
                    return Err(GpuError::InvalidArgument(format!(
                        "the f16 copy of a {m} x {k} matrix needs {} elements, the pass's scratch holds {w16_len}",
                        shape.len
                    )));
                }
                decode_f16(gpu, matrix, w16)?;
                (w16, shape.transposed, shape.ld)
            }
        };
        let yp = y + (p.row_offset * 4) as u64;
        sieve_cuda::dense::gemm_f16_rows(gpu, w, lda, transposed, m, k, a16, n, yp, ldy, beta)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_scratch_is_laid_out_apart_and_aligned() {
        for (n, mp, kp, p) in [
            (512usize, 4096usize, 4096usize, LtPrecision::Int8),
            (700, 11008, 6144, LtPrecision::E4m3),
            (1024, 64, 64, LtPrecision::F16),
        ] {
            let l = lt_scratch_layout(n, (mp, kp), p);
            assert!(l.np >= n && l.np.is_multiple_of(SLIDE_LIBRARY_TOKEN_STEP));
            assert!(l.np.is_multiple_of(p.n_multiple()));
            // codes, then 4-byte accumulators, then one f32 scale per token.
            assert_eq!(l.acc, l.np * kp * p.input_bytes());
            assert_eq!(l.scales, l.acc + l.np * mp * 4);
            assert!(2 * l.len16 >= l.scales + l.np * 4);
            assert!(l.acc.is_multiple_of(256) && l.scales.is_multiple_of(256));
            // The checked form takes exactly the layout's length and names the pass beyond it.
            assert!(lt_scratch_within("test", n, (mp, kp), p, l.len16).is_ok());
            let e = lt_scratch_within("test", n, (mp, kp), p, l.len16 - 1)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains("one test pass") && e.contains("needed"), "{e}");
        }
    }

    #[test]
    fn the_chunk_setting_is_checked() {
        assert_eq!(parse_chunk(None).unwrap(), DEFAULT_CHUNK);
        assert_eq!(parse_chunk(Some("2048")).unwrap(), 2048);
        assert_eq!(parse_chunk(Some(" 128 ")).unwrap(), MIN_CHUNK);
        for bad in ["64", "4097", "0", "-1", "lots", ""] {
            let e = parse_chunk(Some(bad)).unwrap_err();
            assert!(e.contains("SIEVE_PREFILL_CHUNK"), "{bad}: {e}");
        }
    }
}
