//! [`QuantMatrix`]: weights kept in their GGUF quantized blocks (Q4_0, Q4_1, Q8_0 here; Q5_0,
//! Q5_1, Q4_K, Q5_K, Q6_K in [`offset_blocks`]) and multiplied without dequantizing them to f16
//! first.
//!
//! Decoding one token is bound by the bytes of weights it streams. The f16 copy of SmolLM2-135M's
//! Q4_1/Q8_0 file reads 268.9 MB per token; the blocks themselves are 96.4 MB (0.625 B per Q4_1
//! weight, 1.0625 B per Q8_0 weight). So a matrix-vector product here:
//!
//! 1. quantizes the activation vector once to 8-bit blocks of 32 ([`Q8Activations`]): one f32
//!    scale `dx = max|x| / 127` per block, `qx = round(x / dx)` (ties to even), and the block sum
//!    `dx · Σ qx` that Q4_1's offset term needs;
//! 2. takes integer dot products of each weight block with the matching activation block
//!    (`_mm256_maddubs_epi16` + `_mm256_madd_epi16` on AVX2, exact `i32` sums in the portable
//!    path) and scales them in f32:
//!    Q8_0 and Q4_0 `dw · dx · Σ qw qx` (Q4_0's `qw` shifted by -8), Q4_1
//!    `dw · dx · Σ qw qx + mw · dx · Σ qx`;
//! 3. splits the rows over the rayon pool.
//!
//! The 8-bit activations are the only approximation beyond the weights' own: each `x` moves by at
//! most `dx / 2 = max|x_block| / 254`, the scheme llama.cpp uses (its Q8_0/Q8_1 activation
//! blocks, there with an f16 scale).
//!
//! Batched products (prefill, perplexity windows) use the same arithmetic so that a token gives
//! the same logits whether it is decoded alone or inside a prompt: each activation row is
//! quantized and dequantized again (exact in f32: `dx · qx`), and the blocked f32 GEMM unpacks
//! weight rows straight from the blocks while packing (`gemm::gemm_b_columns`). The products
//! are then those of the integer path up to f32 summation order.
//!
//! The blocks are copied out of the file at load (not mapped): Q and K rows are reordered from
//! llama.cpp's RoPE layout, so those matrices differ from the file anyway, the copy costs about
//! 30 ms for the default model, and owning the bytes keeps a layer independent of the file's
//! lifetime like every other format.
//!
//! Serialization: there is no quantized-block format among the `.sieve` blob kinds, so
//! [`WeightFormat::write_payload`] writes the f16 dense payload of [`WeightFormat::decode`] and
//! the layer reads back as dense f16 (what loading with dequantization gives).

use crate::error::{CpuError, Result};
use crate::gemm;
use dequant::GgmlType;
use half::f16;
use rayon::prelude::*;
use sieve_formats::blob::ByteWriter;
use sieve_formats::format::{check_product_args, is_active};
use sieve_formats::{DenseMatrix, FormatError, FormatKind, Storage, Threshold, WeightFormat};

/// Elements per quantized activation block, and per weight block of the 32-element types (the
/// K types have super-blocks of 256 made of eight such sub-blocks).
pub const BLOCK: usize = 32;

pub mod dequant;
mod offset_blocks;
#[doc(hidden)]
pub mod test_blocks;
pub use offset_blocks::DotPath;

/// The GGUF block types kept quantized.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum BlockType {
    /// f16 `d`, 16 bytes of nibbles; `w = (q - 8) · d`.
    Q4_0 = 0,
    /// f16 `d`, f16 `m`, 16 bytes of nibbles; `w = q · d + m`.
    Q4_1 = 1,
    /// f16 `d`, 32 × i8; `w = q · d`.
    Q8_0 = 2,
    /// f16 `d`, u32 fifth bits, 16 bytes of nibbles; `w = (q - 16) · d`.
    Q5_0 = 3,
    /// f16 `d`, f16 `m`, u32 fifth bits, 16 bytes of nibbles; `w = q · d + m`.
    Q5_1 = 4,
    /// Super-blocks of 256: f16 `d`, f16 `dmin`, 8 packed 6-bit (scale, min), 128 bytes of
    /// nibbles; `w = d · sc · q - dmin · m` per 32.
    Q4_K = 5,
    /// As Q4_K with 32 bytes of fifth bits before the nibbles.
    Q5_K = 6,
    /// Super-blocks of 256: 6-bit quants (128 bytes low nibbles, 64 bytes high pairs), 16 i8
    /// scales, f16 `d`; `w = d · sc · (q - 32)` per 16.
    Q6_K = 7,
}

impl BlockType {
    /// Every block type, in the order of the GGUF specification's table.
    pub const ALL: [BlockType; 8] = [
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
    ];

    /// Inverse of `self as u8` (kernels take the type as a const parameter).
    const fn from_code(code: u8) -> Self {
        match code {
            0 => Self::Q4_0,
            1 => Self::Q4_1,
            3 => Self::Q5_0,
            4 => Self::Q5_1,
            5 => Self::Q4_K,
            6 => Self::Q5_K,
            7 => Self::Q6_K,
            _ => Self::Q8_0,
        }
    }

    /// The block type of a GGML tensor type, when it is one this module multiplies directly.
    pub fn from_ggml(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::Q4_0 => Some(Self::Q4_0),
            GgmlType::Q4_1 => Some(Self::Q4_1),
            GgmlType::Q8_0 => Some(Self::Q8_0),
            GgmlType::Q5_0 => Some(Self::Q5_0),
            GgmlType::Q5_1 => Some(Self::Q5_1),
            GgmlType::Q4_K => Some(Self::Q4_K),
            GgmlType::Q5_K => Some(Self::Q5_K),
            GgmlType::Q6_K => Some(Self::Q6_K),
            _ => None,
        }
    }
    pub fn ggml(self) -> GgmlType {
        match self {
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q4_1 => GgmlType::Q4_1,
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q5_0 => GgmlType::Q5_0,
            Self::Q5_1 => GgmlType::Q5_1,
            Self::Q4_K => GgmlType::Q4_K,
            Self::Q5_K => GgmlType::Q5_K,
            Self::Q6_K => GgmlType::Q6_K,
        }
    }
    pub fn block_bytes(self) -> usize {
        self.ggml().block_geometry().1
    }
    /// Weights per block (32, or 256 for the K types).
    pub fn block_elems(self) -> usize {
        self.ggml().block_geometry().0
    }
    /// Bytes of scales and offsets in each block (the rest holds the quants).
    fn header_bytes(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q8_0 | Self::Q5_0 => 2,
            Self::Q4_1 | Self::Q5_1 => 4,
            Self::Q4_K | Self::Q5_K => 16,
            Self::Q6_K => 18,
        }
    }
}

/// An M x K weight matrix as rows of GGUF quantized blocks (`K / 32` blocks per row, in file
/// order).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantMatrix {
    ty: BlockType,
    rows: usize,
    cols: usize,
    blocks: Vec<u8>,
}

fn read_f16(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

impl QuantMatrix {
    /// Wraps `blocks` (row-major, `cols / block_elems` blocks of `ty` per row). Refuses shapes
    /// that are not whole blocks, a byte count that does not match, and scales that are not
    /// finite or would dequantize beyond the f16 range (so [`WeightFormat::decode`] is always
    /// valid).
    pub fn new(ty: BlockType, rows: usize, cols: usize, blocks: Vec<u8>) -> Result<Self> {
        let elems = ty.block_elems();
        if rows == 0 || cols == 0 || !cols.is_multiple_of(elems) {
            return Err(CpuError::InvalidArgument(format!(
                "a {rows} x {cols} matrix of {ty:?} blocks needs rows > 0 and a positive \
                 multiple of {elems} columns"
            )));
        }
        let expected = rows
            .checked_mul(cols / elems)
            .and_then(|b| b.checked_mul(ty.block_bytes()));
        if expected != Some(blocks.len()) {
            return Err(CpuError::InvalidArgument(format!(
                "a {rows} x {cols} matrix of {ty:?} needs {expected:?} bytes, got {}",
                blocks.len()
            )));
        }
        let limit = f16::MAX.to_f32();
        for (i, b) in blocks.chunks_exact(ty.block_bytes()).enumerate() {
            let bound = match ty {
                BlockType::Q4_0 => 8.0 * read_f16(b, 0).abs(),
                BlockType::Q4_1 => 15.0 * read_f16(b, 0).abs() + read_f16(b, 2).abs(),
                BlockType::Q8_0 => 128.0 * read_f16(b, 0).abs(),
                _ => offset_blocks::weight_bound(ty, b),
            };
            if !bound.is_finite() || bound > limit {
                let per_row = cols / elems;
                return Err(CpuError::InvalidArgument(format!(
                    "{ty:?} block {} of row {}: its scales give weights outside the f16 range \
                     (up to {bound})",
                    i % per_row,
                    i / per_row
                )));
            }
        }
        Ok(Self {
            ty,
            rows,
            cols,
            blocks,
        })
    }

    /// Quantizes a row-major f16 matrix to Q8_0 blocks the way llama.cpp does (`d = max|w| /
    /// 127` as f16, `q = round(w / d)`). For the LM head of a pack made from a GGUF whose head
    /// was Q8_0, this recovers the file's quants: each `w` is `d·q` rounded to f16 (within
    /// 2^-11 relative), so `w / d` is within 0.07 of `q` and rounds back to it.
    pub fn quantize_q8_0(rows: usize, cols: usize, w: &[f16]) -> Result<Self> {
        check_to_quantize("Q8_0", rows, cols, w)?;
        let mut blocks = Vec::with_capacity(rows * cols / BLOCK * 34);
        for chunk in w.chunks_exact(BLOCK) {
            let amax = chunk.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
            let d = f16::from_f32(amax / 127.0);
            let inv = if d.to_f32() > 0.0 {
                1.0 / d.to_f32()
            } else {
                0.0
            };
            blocks.extend_from_slice(&d.to_bits().to_le_bytes());
            blocks.extend(
                chunk
                    .iter()
                    .map(|v| (v.to_f32() * inv).round().clamp(-127.0, 127.0) as i8 as u8),
            );
        }
        Self::new(BlockType::Q8_0, rows, cols, blocks)
    }

    /// Quantizes a row-major f16 matrix to Q4_1 blocks the way llama.cpp does: per 32 weights
    /// `d = (max - min) / 15` and `m = min` as f16, `q = min(15, trunc((w - min) / d + 0.5))`.
    /// 20 bytes per 32 weights (5 bits each) against Q8_0's 34.
    pub fn quantize_q4_1(rows: usize, cols: usize, w: &[f16]) -> Result<Self> {
        check_to_quantize("Q4_1", rows, cols, w)?;
        let mut blocks = Vec::with_capacity(rows * cols / BLOCK * 20);
        for chunk in w.chunks_exact(BLOCK) {
            let (min, max) = chunk.iter().fold((f32::MAX, f32::MIN), |(lo, hi), v| {
                (lo.min(v.to_f32()), hi.max(v.to_f32()))
            });
            let d = (max - min) / 15.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            blocks.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
            blocks.extend_from_slice(&f16::from_f32(min).to_bits().to_le_bytes());
            let q = |v: f16| (((v.to_f32() - min) * inv + 0.5) as u8).min(15);
            for j in 0..BLOCK / 2 {
                blocks.push(q(chunk[j]) | q(chunk[j + BLOCK / 2]) << 4);
            }
        }
        Self::new(BlockType::Q4_1, rows, cols, blocks)
    }

    pub fn block_type(&self) -> BlockType {
        self.ty
    }
    pub fn blocks(&self) -> &[u8] {
        &self.blocks
    }
    fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_elems() * self.ty.block_bytes()
    }
    fn row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.blocks[r * n..(r + 1) * n]
    }

    /// Row `r` dequantized to f32 (`out.len() == cols`), with the arithmetic of
    /// `crate::gguf_blocks::dequant::dequantize`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        if offset_blocks::handles(self.ty) {
            return offset_blocks::dequantize_row(self.ty, self.row(r), out);
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the level has the features (`has_avx2`); `out` holds one value per
            // element of the row.
            return unsafe { x86::dequantize_row(self.ty, self.row(r), out) };
        }
        self.dequantize_row_portable(r, out)
    }

    fn dequantize_row_portable(&self, r: usize, out: &mut [f32]) {
        if offset_blocks::handles(self.ty) {
            return offset_blocks::dequantize_row_portable(self.ty, self.row(r), out);
        }
        let bb = self.ty.block_bytes();
        for (b, o) in self
            .row(r)
            .chunks_exact(bb)
            .zip(out.chunks_exact_mut(BLOCK))
        {
            let d = read_f16(b, 0);
            match self.ty {
                BlockType::Q4_0 => {
                    for j in 0..16 {
                        o[j] = ((b[2 + j] & 0x0F) as i32 - 8) as f32 * d;
                        o[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
                    }
                }
                BlockType::Q4_1 => {
                    let m = read_f16(b, 2);
                    for j in 0..16 {
                        o[j] = (b[4 + j] & 0x0F) as f32 * d + m;
                        o[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
                    }
                }
                BlockType::Q8_0 => {
                    for j in 0..32 {
                        o[j] = (b[2 + j] as i8) as f32 * d;
                    }
                }
                _ => unreachable!("offset block types return above"),
            }
        }
    }

    /// `y[r] = W[r] · x` for rows `r0..r0 + y.len()` with `x` already quantized.
    fn rows_dot(&self, r0: usize, xq: &Q8Activations, y: &mut [f32]) {
        if offset_blocks::handles(self.ty) {
            let n = self.row_bytes();
            let blocks = &self.blocks[r0 * n..(r0 + y.len()) * n];
            return offset_blocks::rows_into(DotPath::detect(), self.ty, blocks, n, xq, y);
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            let n = self.row_bytes();
            let blocks = &self.blocks[r0 * n..(r0 + y.len()) * n];
            // SAFETY: the level has the features (`has_avx2`); `blocks` holds `y.len()` whole
            // rows whose K matches `xq`.
            return unsafe { x86::dot_rows_into(self.ty, blocks, n, xq, y) };
        }
        for (i, o) in y.iter_mut().enumerate() {
            *o = dot_row_portable(self.ty, self.row(r0 + i), xq);
        }
    }
}

/// An activation vector quantized to 8-bit blocks of [`BLOCK`]: `x ≈ scales[b] · quants[i]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Q8Activations {
    /// `max|x| / 127` of each block (0 for an all-zero block, NaN when the block holds a
    /// non-finite value, so that it propagates into every product as it would in f32).
    pub scales: Vec<f32>,
    /// `scales[b] · Σ quants` of each block (the offset terms of Q4_1, Q5_0, Q5_1, Q4_K, Q5_K).
    pub sums: Vec<f32>,
    /// The same per half block of 16 (Q6_K's offsets: it has a scale per 16 weights).
    sums16: Vec<f32>,
    /// `scales` and `sums` interleaved (`[d0, s0, d1, s1, ...]`): the AVX2 Q4_1 kernel loads a
    /// block's pair with one 8-byte load.
    pairs: Vec<f32>,
    /// One value in [-127, 127] per element.
    pub quants: Vec<i8>,
}

impl Q8Activations {
    /// Quantizes `x` (`x.len()` a multiple of [`BLOCK`]), reusing this buffer.
    pub fn quantize(&mut self, x: &[f32]) {
        debug_assert!(x.len().is_multiple_of(BLOCK));
        let nb = x.len() / BLOCK;
        self.scales.resize(nb, 0.0);
        self.sums.resize(nb, 0.0);
        self.pairs.resize(2 * nb, 0.0);
        self.sums16.resize(2 * nb, 0.0);
        self.quants.resize(x.len(), 0);
        #[cfg(target_arch = "x86_64")]
        let avx2 = has_avx2();
        for b in 0..nb {
            let (src, dst) = (
                &x[b * BLOCK..(b + 1) * BLOCK],
                &mut self.quants[b * BLOCK..(b + 1) * BLOCK],
            );
            #[cfg(target_arch = "x86_64")]
            let (d, s) = if avx2 {
                // SAFETY: the level has the features (`has_avx2`); each slice holds one whole
                // block.
                unsafe { x86::quantize_block(src, dst) }
            } else {
                quantize_block_portable(src, dst)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let (d, s) = quantize_block_portable(src, dst);
            self.scales[b] = d;
            self.sums[b] = s;
            self.pairs[2 * b] = d;
            self.pairs[2 * b + 1] = s;
            for (h, half) in dst.chunks_exact(BLOCK / 2).enumerate() {
                let sum: i32 = half.iter().map(|&q| q as i32).sum();
                self.sums16[2 * b + h] = d * sum as f32;
            }
        }
    }

    /// Blocks that every buffer holds in full (the fields are public, so the SIMD kernels never
    /// trust any single length).
    fn whole_blocks(&self) -> usize {
        self.scales
            .len()
            .min(self.sums.len())
            .min(self.quants.len() / BLOCK)
            .min(self.pairs.len() / 2)
            .min(self.sums16.len() / 2)
    }

    /// The values the quantized vector stands for, `scales[b] · quants[i]`.
    pub fn dequantize_into(&self, out: &mut [f32]) {
        for ((o, q), d) in out
            .chunks_exact_mut(BLOCK)
            .zip(self.quants.chunks_exact(BLOCK))
            .zip(&self.scales)
        {
            for (v, &qi) in o.iter_mut().zip(q) {
                *v = *d * qi as f32;
            }
        }
    }
}

/// `1 / d`, or 0 for a block whose values are all below `127 · f32::MIN_POSITIVE` (about
/// 1.5e-36; such a block quantizes to zeros, where `1 / d` could overflow to infinity).
fn inverse_scale(d: f32) -> f32 {
    if d >= f32::MIN_POSITIVE {
        1.0 / d
    } else {
        0.0
    }
}

/// One block: returns (scale, scale · Σ q). Rounds ties to even, like `vroundps`.
fn quantize_block_portable(x: &[f32], q: &mut [i8]) -> (f32, f32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let finite = x.iter().all(|v| v.is_finite());
    if !finite {
        q.fill(0);
        return (f32::NAN, f32::NAN);
    }
    let d = amax / 127.0;
    let id = inverse_scale(d);
    let mut sum = 0i32;
    for (qi, v) in q.iter_mut().zip(x) {
        let r = (v * id).round_ties_even() as i32;
        *qi = r as i8;
        sum += r;
    }
    (d, d * sum as f32)
}

/// Whether the AVX2 kernels run: the process's level ([`crate::simd::SimdLevel::detect`]) is
/// AVX2 or above. Such a level is supported by this CPU and includes AVX2, FMA and F16C, every
/// feature the `x86` functions are compiled for.
#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    use crate::simd::SimdLevel;
    SimdLevel::detect() >= SimdLevel::Avx2
}

/// `W[r] · x` for one row of blocks against quantized activations.
pub fn dot_row(ty: BlockType, row: &[u8], xq: &Q8Activations) -> f32 {
    if offset_blocks::handles(ty) {
        return offset_blocks::dot_row(DotPath::detect(), ty, row, xq);
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the level has the features (`has_avx2`); the kernel reads only the blocks
        // that both `row` and every buffer of `xq` hold in full.
        return unsafe { x86::dot_row(ty, row, xq) };
    }
    dot_row_portable(ty, row, xq)
}

/// The portable dot product: exact integer block sums, then the same f32 scaling as the AVX2
/// path (which differs only in the order of the f32 additions).
pub fn dot_row_portable(ty: BlockType, row: &[u8], xq: &Q8Activations) -> f32 {
    if offset_blocks::handles(ty) {
        return offset_blocks::dot_row_portable(ty, row, xq);
    }
    let bb = ty.block_bytes();
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(bb).enumerate() {
        let xs = &xq.quants[b * BLOCK..(b + 1) * BLOCK];
        let d = read_f16(blk, 0) * xq.scales[b];
        let qs = &blk[ty.header_bytes()..];
        let mut isum = 0i32;
        match ty {
            BlockType::Q4_0 | BlockType::Q4_1 => {
                let shift = if ty == BlockType::Q4_0 { 8 } else { 0 };
                for j in 0..16 {
                    isum += ((qs[j] & 0x0F) as i32 - shift) * xs[j] as i32;
                    isum += ((qs[j] >> 4) as i32 - shift) * xs[j + 16] as i32;
                }
            }
            BlockType::Q8_0 => {
                for j in 0..32 {
                    isum += (qs[j] as i8) as i32 * xs[j] as i32;
                }
            }
            _ => unreachable!("offset block types return above"),
        }
        acc += d * isum as f32;
        if ty == BlockType::Q4_1 {
            acc += read_f16(blk, 2) * xq.sums[b];
        }
    }
    acc
}

/// Rows per parallel task: about four tasks per thread balance the pool without paying rayon's
/// scheduling per handful of rows; never fewer than 16 rows (a few KB of blocks).
fn rows_per_task(rows: usize) -> usize {
    let tasks = 4 * rayon::current_num_threads().max(1);
    rows.div_ceil(tasks).max(16)
}

thread_local! {
    static ACTIVATIONS: std::cell::RefCell<Q8Activations> =
        std::cell::RefCell::new(Q8Activations::default());
    /// The batched product's activations after their round trip through 8-bit blocks.
    static BATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn masked_copy(x: &[f32], threshold: Threshold) -> Option<Vec<f32>> {
    threshold.map(|_| {
        x.iter()
            .map(|&v| if is_active(v, threshold) { v } else { 0.0 })
            .collect()
    })
}

/// `ys[i] = mats[i] · x` for matrices sharing the input `x`, which is masked by `threshold`
/// and quantized once; one parallel pass covers the rows of all of them (the fused q/k/v and
/// gate/up products of a decode step). Shapes must already be checked: every matrix has
/// `x.len()` columns and `ys[i].len() == mats[i].rows()`.
pub fn matvec_group(mats: &[&QuantMatrix], x: &[f32], threshold: Threshold, ys: &mut [&mut [f32]]) {
    let xm = masked_copy(x, threshold);
    let x = xm.as_deref().unwrap_or(x);
    let run = |xq: &Q8Activations, ys: &mut [&mut [f32]]| {
        let chunk = rows_per_task(mats.iter().map(|m| m.rows).sum());
        let mut tasks: Vec<(&QuantMatrix, usize, &mut [f32])> = Vec::new();
        for (m, y) in mats.iter().zip(ys.iter_mut()) {
            for (c, out) in y.chunks_mut(chunk).enumerate() {
                tasks.push((m, c * chunk, out));
            }
        }
        tasks
            .into_par_iter()
            .for_each(|(m, r0, out)| m.rows_dot(r0, xq, out));
    };
    ACTIVATIONS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut xq) => {
            xq.quantize(x);
            run(&xq, ys)
        }
        // A pool thread that steals this product while waiting inside another one.
        Err(_) => {
            let mut xq = Q8Activations::default();
            xq.quantize(x);
            run(&xq, ys)
        }
    });
}

/// `Y_i = X · W_iᵀ` for matrices sharing the input `X` (`n` rows), which is masked by
/// `threshold` and sent through 8-bit blocks once for all of them. Shapes must already be
/// checked as for [`matvec_group`], with `n` rows.
pub fn matmul_group(
    mats: &[&QuantMatrix],
    x: &[f32],
    n: usize,
    threshold: Threshold,
    ys: &mut [&mut [f32]],
) -> Result<(), FormatError> {
    if n <= SMALL_BATCH {
        for (m, y) in mats.iter().zip(ys.iter_mut()) {
            m.small_batch(x, n, threshold, y);
        }
        return Ok(());
    }
    let Some(k) = mats.first().map(|m| m.cols) else {
        return Ok(());
    };
    // Each row goes through the 8-bit activation blocks the matvec uses, so batched and
    // single-token products agree.
    let xm = masked_copy(x, threshold);
    let x = xm.as_deref().unwrap_or(x);
    let mut products = |xq: &mut [f32]| {
        xq.par_chunks_mut(k).zip(x.par_chunks(k)).for_each_init(
            Q8Activations::default,
            |q, (out, row)| {
                q.quantize(row);
                q.dequantize_into(out);
            },
        );
        for (w, y) in mats.iter().zip(ys.iter_mut()) {
            gemm::gemm_b_columns(
                n,
                w.rows,
                k,
                gemm::View::row_major(xq, k),
                |j, col| w.dequantize_row(j, col),
                y,
                w.rows,
                false,
                true,
            )
            .map_err(|e| FormatError::Option(e.to_string()))?;
        }
        Ok(())
    };
    // A per-thread buffer: a fresh multi-megabyte one per product costs page faults.
    BATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            let len = buf.len().max(n * k);
            buf.resize(len, 0.0);
            products(&mut buf[..n * k])
        }
        Err(_) => products(&mut vec![0f32; n * k]),
    })
}

/// Batches up to this many tokens run the integer kernel once per token over each weight row
/// (read from memory once, then from L1): unpacking every weight to f32 for the GEMM costs as
/// much as a few tokens of products, and short prompts (chat turns) are mostly below it.
pub const SMALL_BATCH: usize = 8;

impl QuantMatrix {
    /// `Y = X · Wᵀ` for a few tokens with the decode kernel (bit-identical to `n` matvecs).
    fn small_batch(&self, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) {
        let (m, k) = (self.rows, self.cols);
        let xm = masked_copy(x, threshold);
        let x = xm.as_deref().unwrap_or(x);
        let xqs: Vec<Q8Activations> = x
            .chunks_exact(k)
            .map(|row| {
                let mut q = Q8Activations::default();
                q.quantize(row);
                q
            })
            .collect();
        // Rows of the transposed output [row][token], so that tasks own whole weight rows.
        let mut yt = vec![0f32; m * n];
        let chunk = rows_per_task(m);
        yt.par_chunks_mut(chunk * n)
            .enumerate()
            .for_each(|(c, out)| {
                for (i, o) in out.chunks_exact_mut(n).enumerate() {
                    let row = self.row(c * chunk + i);
                    for (v, xq) in o.iter_mut().zip(&xqs) {
                        *v = dot_row(self.ty, row, xq);
                    }
                }
            });
        for (r, o) in yt.chunks_exact(n).enumerate() {
            for (t, v) in o.iter().enumerate() {
                y[t * m + r] = *v;
            }
        }
    }
}

/// Refuses a matrix that cannot be cut into `ty` blocks of 32 weights (`rows x cols` row-major
/// `w`): a wrong length, a column count that is not a multiple of 32, a weight that is not
/// finite.
fn check_to_quantize(ty: &str, rows: usize, cols: usize, w: &[f16]) -> Result<()> {
    if w.len() != rows * cols {
        return Err(CpuError::InvalidArgument(format!(
            "{} values for a {rows} x {cols} matrix",
            w.len()
        )));
    }
    if !cols.is_multiple_of(BLOCK) {
        return Err(CpuError::InvalidArgument(format!(
            "{ty} needs a multiple of {BLOCK} columns, the matrix has {cols}"
        )));
    }
    if let Some(v) = w.iter().find(|v| !v.is_finite()) {
        return Err(CpuError::InvalidArgument(format!(
            "{ty} of a matrix with the weight {v}"
        )));
    }
    Ok(())
}

impl WeightFormat for QuantMatrix {
    /// Serialized as dense f16 (see the module notes).
    fn kind(&self) -> FormatKind {
        FormatKind::Dense
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    /// The bytes held: quantized values as payload, per-block scales and offsets as metadata.
    fn storage(&self) -> Storage {
        let blocks = self.rows * self.cols / self.ty.block_elems();
        let meta = blocks * self.ty.header_bytes();
        Storage {
            payload_bytes: self.blocks.len() - meta,
            metadata_bytes: meta,
        }
    }
    fn decode(&self) -> DenseMatrix {
        let mut data = vec![f16::ZERO; self.rows * self.cols];
        data.par_chunks_mut(self.cols)
            .enumerate()
            .for_each(|(r, out)| {
                let mut row = vec![0f32; self.cols];
                self.dequantize_row(r, &mut row);
                for (o, v) in out.iter_mut().zip(&row) {
                    *o = f16::from_f32(*v);
                }
            });
        DenseMatrix::new(self.rows, self.cols, data)
            .expect("QuantMatrix::new bounds every weight inside the f16 range")
    }

    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<(), FormatError> {
        check_product_args(self.rows, self.cols, x, 1, threshold, y)?;
        matvec_group(&[self], x, threshold, &mut [y]);
        Ok(())
    }

    fn matmul(
        &self,
        x: &[f32],
        n: usize,
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), FormatError> {
        let (m, k) = (self.rows, self.cols);
        check_product_args(m, k, x, n, threshold, y)?;
        matmul_group(&[self], x, n, threshold, &mut [y])
    }

    fn write_payload(&self, w: &mut ByteWriter) {
        w.u64(self.rows as u64);
        w.u64(self.cols as u64);
        w.f16s(self.decode().data());
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BlockType, Q8Activations, BLOCK};
    use std::arch::x86_64::*;

    use crate::kernels::x86::hsum;

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// Quantizes one block of 32; see `quantize_block_portable` (same rounding, same results).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, f32) {
        debug_assert!(x.len() == BLOCK && q.len() == BLOCK);
        let p = x.as_ptr();
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let sign = _mm256_set1_ps(-0.0);
        let zero = _mm256_setzero_ps();
        let mut amax = zero;
        // x · 0 is NaN exactly for the non-finite values.
        let mut nonfinite = zero;
        for vi in v {
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, vi));
            nonfinite = _mm256_add_ps(nonfinite, _mm256_mul_ps(vi, zero));
        }
        if _mm256_movemask_ps(_mm256_cmp_ps(nonfinite, nonfinite, _CMP_UNORD_Q)) != 0 {
            q.fill(0);
            return (f32::NAN, f32::NAN);
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        let d = _mm_cvtss_f32(m) / 127.0;
        let id = _mm256_set1_ps(super::inverse_scale(d));
        let r = v.map(|vi| {
            _mm256_cvtps_epi32(_mm256_round_ps(
                _mm256_mul_ps(vi, id),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            ))
        });
        let sum = hsum_i32(_mm256_add_epi32(
            _mm256_add_epi32(r[0], r[1]),
            _mm256_add_epi32(r[2], r[3]),
        ));
        // packs interleave the 128-bit lanes: (0 1 | 2 3)(4 5 | 6 7) per pair; a final
        // permutation of 32-bit groups restores element order.
        let w01 = _mm256_packs_epi32(r[0], r[1]);
        let w23 = _mm256_packs_epi32(r[2], r[3]);
        let b = _mm256_packs_epi16(w01, w23);
        let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, b);
        (d, d * sum as f32)
    }

    /// 32 unsigned 4-bit values of a block in element order (low nibbles then high nibbles):
    /// the 16 bytes in both lanes, the upper lane shifted right by 4, masked.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        let raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
        let shifted = _mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4));
        _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
    }

    /// The f16 at `p` in lane 0 (and the f16 at `p + 2` in lane 1) of an f32 vector: one
    /// 4-byte load and one conversion for a block's scale (and Q4_1 offset).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn two_f16(p: *const u8) -> __m128 {
        _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()))
    }

    /// Σ w · x over 32 signed bytes each, as 8 partial i32 sums.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dot_i8(w: __m256i, x: __m256i) -> __m256i {
        // maddubs multiplies unsigned by signed: move w's sign onto x.
        let prod = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
        _mm256_madd_epi16(prod, _mm256_set1_epi16(1))
    }

    /// The low eight i8/u8 lanes of `v` widened to f32.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn widen(v: __m128i, signed: bool) -> __m256 {
        _mm256_cvtepi32_ps(if signed {
            _mm256_cvtepi8_epi32(v)
        } else {
            _mm256_cvtepu8_epi32(v)
        })
    }

    /// Row dequantization with the arithmetic of the portable one (a multiply, then for Q4_1
    /// an add: no fused rounding), so both give the same f32 values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequantize_row(ty: BlockType, row: &[u8], out: &mut [f32]) {
        let bb = ty.block_bytes();
        let nb = (row.len() / bb).min(out.len() / BLOCK);
        let eight = _mm256_set1_epi8(8);
        for b in 0..nb {
            let blk = row.as_ptr().add(b * bb);
            let o = out.as_mut_ptr().add(b * BLOCK);
            let dm = two_f16(blk);
            let d = _mm256_broadcastss_ps(dm);
            let (q, signed) = match ty {
                BlockType::Q4_0 => (_mm256_sub_epi8(nibbles(blk.add(2)), eight), true),
                BlockType::Q4_1 => (nibbles(blk.add(4)), false),
                BlockType::Q8_0 => (_mm256_loadu_si256(blk.add(2) as *const __m256i), true),
                _ => unreachable!("offset block types dequantize in offset_blocks"),
            };
            let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            let parts = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
            for (i, part) in parts.into_iter().enumerate() {
                let mut v = _mm256_mul_ps(widen(part, signed), d);
                if ty == BlockType::Q4_1 {
                    v = _mm256_add_ps(v, _mm256_broadcastss_ps(_mm_movehdup_ps(dm)));
                }
                _mm256_storeu_ps(o.add(8 * i), v);
            }
        }
    }

    /// `R` rows at once against the same activations: each activation block (and its scale) is
    /// loaded once for all of them, and the independent accumulators overlap their latencies.
    /// `rows[i]` points at `nb` blocks of `ty`; `xq` holds at least `nb` blocks.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_rows<const TY: u8, const R: usize>(
        rows: [*const u8; R],
        nb: usize,
        xq: &Q8Activations,
    ) -> [f32; R] {
        let ty = BlockType::from_code(TY);
        let (xp, sp, pp) = (xq.quants.as_ptr(), xq.scales.as_ptr(), xq.pairs.as_ptr());
        let bb = ty.block_bytes();
        let ones = _mm256_set1_epi16(1);
        let eight = _mm256_set1_epi8(8);
        let mut acc = [_mm256_setzero_ps(); R];
        // Q4_1: lane 1 collects Σ mw · dx Σ qx.
        let mut offsets = [_mm_setzero_ps(); R];
        for b in 0..nb {
            for row in rows {
                // Past the end of the buffer a prefetch is a no-op, and `wrapping_add` keeps the
                // address computation defined there.
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(b * bb + PREFETCH_BYTES) as *const i8);
            }
            let x = _mm256_loadu_si256(xp.add(b * BLOCK) as *const __m256i);
            match ty {
                BlockType::Q4_1 => {
                    let pair = _mm_castpd_ps(_mm_load_sd(pp.add(2 * b) as *const f64));
                    for r in 0..R {
                        let blk = rows[r].add(b * bb);
                        // Unsigned nibbles: maddubs takes them as they are.
                        let s =
                            _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles(blk.add(4)), x), ones);
                        // [dw, mw] · [dx, dx Σ qx] in one multiply.
                        let prod = _mm_mul_ps(two_f16(blk), pair);
                        acc[r] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(s),
                            _mm256_broadcastss_ps(prod),
                            acc[r],
                        );
                        offsets[r] = _mm_add_ps(offsets[r], prod);
                    }
                }
                _ => {
                    let dx = _mm_load_ss(sp.add(b));
                    for r in 0..R {
                        let blk = rows[r].add(b * bb);
                        let w = if ty == BlockType::Q8_0 {
                            _mm256_loadu_si256(blk.add(2) as *const __m256i)
                        } else {
                            _mm256_sub_epi8(nibbles(blk.add(2)), eight)
                        };
                        let s = _mm256_cvtepi32_ps(dot_i8(w, x));
                        let d = _mm_mul_ss(two_f16(blk), dx);
                        acc[r] = _mm256_fmadd_ps(s, _mm256_broadcastss_ps(d), acc[r]);
                    }
                }
            }
        }
        let mut out = [0f32; R];
        for r in 0..R {
            let o = offsets[r];
            out[r] = hsum(acc[r]) + _mm_cvtss_f32(_mm_shuffle_ps(o, o, 1));
        }
        out
    }

    /// One row of blocks of `ty` against `xq`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_row(ty: BlockType, row: &[u8], xq: &Q8Activations) -> f32 {
        let nb = xq.whole_blocks().min(row.len() / ty.block_bytes());
        let p = [row.as_ptr()];
        match ty {
            BlockType::Q4_0 => dot_rows::<Q4_0, 1>(p, nb, xq)[0],
            BlockType::Q4_1 => dot_rows::<Q4_1, 1>(p, nb, xq)[0],
            _ => dot_rows::<Q8_0, 1>(p, nb, xq)[0],
        }
    }

    /// `out[i] = row i · x` for the `out.len()` consecutive rows of `row_bytes` in `blocks`,
    /// two at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_rows_into(
        ty: BlockType,
        blocks: &[u8],
        row_bytes: usize,
        xq: &Q8Activations,
        out: &mut [f32],
    ) {
        match ty {
            BlockType::Q4_0 => rows_into::<Q4_0>(blocks, row_bytes, xq, out),
            BlockType::Q4_1 => rows_into::<Q4_1>(blocks, row_bytes, xq, out),
            _ => rows_into::<Q8_0>(blocks, row_bytes, xq, out),
        }
    }

    /// How far ahead of the block being multiplied each row stream is prefetched. The kernel
    /// spends several instructions per byte of weights (against ~0.1 for the f16 dot), so the
    /// out-of-order window alone keeps too few cache misses in flight: without prefetching the
    /// products of the default model streamed ~14 GB/s on two cores and stalled on the weight
    /// loads. 1024 bytes (`quant_bench`, 2 threads): layer products 4.65 -> ~3.4 ms, head
    /// 2.14 -> ~1.05 ms per token; 512, 1536 and 2048 were slower.
    const PREFETCH_BYTES: usize = 1024;

    const Q4_0: u8 = BlockType::Q4_0 as u8;
    const Q4_1: u8 = BlockType::Q4_1 as u8;
    const Q8_0: u8 = BlockType::Q8_0 as u8;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_into<const TY: u8>(
        blocks: &[u8],
        row_bytes: usize,
        xq: &Q8Activations,
        out: &mut [f32],
    ) {
        let ty = BlockType::from_code(TY);
        let rows = out.len().min(blocks.len() / row_bytes.max(1));
        let nb = xq.whole_blocks().min(row_bytes / ty.block_bytes());
        let p = blocks.as_ptr();
        let mut r = 0;
        while r + 2 <= rows {
            let pair =
                dot_rows::<TY, 2>([p.add(r * row_bytes), p.add((r + 1) * row_bytes)], nb, xq);
            out[r] = pair[0];
            out[r + 1] = pair[1];
            r += 2;
        }
        if r < rows {
            out[r] = dot_rows::<TY, 1>([p.add(r * row_bytes)], nb, xq)[0];
        }
    }
}

#[cfg(test)]
mod tests;
