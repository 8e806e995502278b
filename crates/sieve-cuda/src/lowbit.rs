//! Dense low-bit weights on the GPU: W4A16 (group 128, f16 scales, zero point 8), W8A16 (per-row
//! f32 scales), and the GGUF blocks Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K repacked at
//! upload into the same fragment layout (never dequantized to f16): 4-, 5-, 6- or 8-bit integers
//! with f16 scales per 16 or 32 columns, and an f16 min per group for the affine types; the
//! K-quants keep their two levels (f16 `d`, `dmin` per 256 columns, integer codes per group).
//! Kernels: `kernels/dense_lowbit_gemv.cu` (read its header for the layout and thread mapping):
//! `Y (N x M) = X (N x K, f16) · Wᵀ` for N = 1..32 on the tensor cores, f32 output.
//!
//! [`LowBitMatrix`] is the CPU side: the quantized integers and scales, the quantizers, the GGUF
//! block parsers, the f64 reference product the kernels must match, and the device layout.

use crate::dense::check_len;
use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{Gpu, KernelFamily};
use crate::product::DevPtr;
use cudarc::driver::{CudaSlice, LaunchArgs, LaunchConfig, PushKernelArg};
use half::f16;
use sieve_formats::DenseMatrix;
use std::sync::OnceLock;

pub const FAMILY: KernelFamily = KernelFamily {
    name: "dense_lowbit_gemv",
    source: include_str!("../kernels/dense_lowbit_gemv.cu"),
};

/// Tokens one launch takes: four 8-token n tiles.
pub const MAX_TOKENS: usize = 32;
/// Rows per row tile (one block).
const TILE_ROWS: usize = 16;
/// Columns are padded to a multiple of this (every chunk and group size divides it), or of
/// [`K_ALIGN_MAX`] for the K kinds ([`LowBitKind::col_align`]).
pub const K_ALIGN: usize = 128;
/// The largest column alignment of any kind (the K kinds' 256-column super-blocks).
pub const K_ALIGN_MAX: usize = 256;
/// GGUF block size (Q4_0, Q8_0): 32 weights.
pub const GGUF_BLOCK: usize = 32;
/// Bytes of a GGUF Q4_0 block: f16 scale, 16 bytes of nibbles.
pub const Q4_0_BYTES: usize = 18;
/// Bytes of a GGUF Q8_0 block: f16 scale, 32 `i8`.
pub const Q8_0_BYTES: usize = 34;
/// Bytes of a GGUF Q4_1 block: f16 scale and offset, 16 bytes of nibbles.
pub const Q4_1_BYTES: usize = 20;
/// Bytes of a GGUF Q5_0 block: f16 scale, u32 of fifth bits, 16 bytes of nibbles.
pub const Q5_0_BYTES: usize = 22;
/// Bytes of a GGUF Q5_1 block: f16 scale and offset, u32 of fifth bits, 16 bytes of nibbles.
pub const Q5_1_BYTES: usize = 24;
/// Weights of a GGUF K-quant super-block.
pub const K_BLOCK: usize = 256;
/// Bytes of a GGUF Q4_K super-block.
pub const Q4_K_BYTES: usize = 144;
/// Bytes of a GGUF Q5_K super-block.
pub const Q5_K_BYTES: usize = 176;
/// Bytes of a GGUF Q6_K super-block.
pub const Q6_K_BYTES: usize = 210;

/// How the weights are quantized (the kernel header's table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LowBitKind {
    /// 4-bit, zero point 8, one f16 scale per row and 128 columns (sieve's W4A16).
    W4G128,
    /// 4-bit, zero point 8, one f16 scale per row and 32 columns (GGUF Q4_0).
    W4G32,
    /// 8-bit symmetric, one f32 scale per row (sieve's W8A16).
    W8Row,
    /// 8-bit symmetric, one f16 scale per row and 32 columns (GGUF Q8_0).
    W8G32,
    /// 4-bit affine `s · u - m`, f16 `s` and `m` per row and 32 columns (GGUF Q4_1).
    W4G32Affine,
    /// 5-bit, zero point 16, one f16 scale per row and 32 columns (GGUF Q5_0).
    W5G32,
    /// 5-bit affine `s · u - m`, f16 `s` and `m` per row and 32 columns (GGUF Q5_1).
    W5G32Affine,
    /// 4-bit affine with two-level scales: `s = d · sc`, `m = dmin · mc`, f16 `d` and `dmin` per
    /// row and 256 columns, 6-bit codes `sc`, `mc` per 32 columns (GGUF Q4_K).
    W4K,
    /// [`LowBitKind::W4K`] with 5-bit integers (GGUF Q5_K).
    W5K,
    /// 6-bit, zero point 32, `s = d · sc`: f16 `d` per row and 256 columns, `i8` code `sc` per 16
    /// columns (GGUF Q6_K).
    W6K,
}

impl LowBitKind {
    pub const ALL: [LowBitKind; 10] = [
        LowBitKind::W4G128,
        LowBitKind::W4G32,
        LowBitKind::W8Row,
        LowBitKind::W8G32,
        LowBitKind::W4G32Affine,
        LowBitKind::W5G32,
        LowBitKind::W5G32Affine,
        LowBitKind::W4K,
        LowBitKind::W5K,
        LowBitKind::W6K,
    ];
    pub fn bits(self) -> usize {
        match self {
            LowBitKind::W4G128 | LowBitKind::W4G32 | LowBitKind::W4G32Affine | LowBitKind::W4K => 4,
            LowBitKind::W5G32 | LowBitKind::W5G32Affine | LowBitKind::W5K => 5,
            LowBitKind::W6K => 6,
            LowBitKind::W8Row | LowBitKind::W8G32 => 8,
        }
    }
    /// Columns per scale; 0 = one scale per row.
    pub fn group(self) -> usize {
        match self {
            LowBitKind::W4G128 => 128,
            LowBitKind::W4G32
            | LowBitKind::W8G32
            | LowBitKind::W4G32Affine
            | LowBitKind::W5G32
            | LowBitKind::W5G32Affine
            | LowBitKind::W4K
            | LowBitKind::W5K => 32,
            LowBitKind::W6K => 16,
            LowBitKind::W8Row => 0,
        }
    }
    /// Whether a weight is `s · u - m` (unsigned `u`, a min per group) rather than `s · q`.
    pub fn affine(self) -> bool {
        matches!(
            self,
            LowBitKind::W4G32Affine | LowBitKind::W5G32Affine | LowBitKind::W4K | LowBitKind::W5K
        )
    }
    /// Whether the scales (and mins) are an f16 per 256-column super-block times an integer
    /// code per group (the GGUF K-quants), multiplied in f32: exact.
    pub fn two_level(self) -> bool {
        matches!(self, LowBitKind::W4K | LowBitKind::W5K | LowBitKind::W6K)
    }
    /// The two-level kinds' code range: 6-bit unsigned (Q4_K, Q5_K, scales and mins), or `i8`
    /// (Q6_K scales).
    fn code_range(self) -> (i32, i32) {
        if self.affine() {
            (0, 63)
        } else {
            (-128, 127)
        }
    }
    /// Columns are padded to a multiple of this: whole super-blocks for the two-level kinds.
    pub fn col_align(self) -> usize {
        if self.two_level() {
            K_ALIGN_MAX
        } else {
            K_ALIGN
        }
    }
    /// What the device adds to `q` to store it unsigned (0 for the affine kinds).
    fn zero_point(self) -> i32 {
        if self.affine() {
            0
        } else {
            1 << (self.bits() - 1)
        }
    }
    /// The integer range of `q` (the value is `scale · q`, or `scale · q - min` when affine).
    pub fn q_range(self) -> (i32, i32) {
        let levels = 1i32 << self.bits();
        (-self.zero_point(), levels - 1 - self.zero_point())
    }
    /// Whether the scales are f16 values stored per group (else f32 per row, or two-level).
    pub fn f16_scales(self) -> bool {
        self.group() > 0 && !self.two_level()
    }
    /// High bits per weight stored beside the 4-bit plane (5- and 6-bit kinds).
    fn high_bits(self) -> usize {
        match self.bits() {
            5 => 1,
            6 => 2,
            _ => 0,
        }
    }
    fn kernel_prefix(self) -> &'static str {
        match self {
            LowBitKind::W4G128 => "lowbit_w4g128",
            LowBitKind::W4G32 => "lowbit_w4g32",
            LowBitKind::W8Row => "lowbit_w8row",
            LowBitKind::W8G32 => "lowbit_w8g32",
            LowBitKind::W4G32Affine => "lowbit_w4g32a",
            LowBitKind::W5G32 => "lowbit_w5g32",
            LowBitKind::W5G32Affine => "lowbit_w5g32a",
            LowBitKind::W4K => "lowbit_w4k",
            LowBitKind::W5K => "lowbit_w5k",
            LowBitKind::W6K => "lowbit_w6k",
        }
    }
    /// Columns per 512-byte chunk of the device layout.
    fn chunk_cols(self) -> usize {
        if self.bits() == 8 {
            32
        } else {
            64
        }
    }
    /// k tiles per x block: the device layout permutes the columns inside blocks of this many
    /// 16-column tiles (a scale group's, or a chunk's when groups are larger or absent), so
    /// that each lane's activations of a block are contiguous (kernel header).
    fn x_block_tiles(self) -> usize {
        let chunk_tiles = self.chunk_cols() / 16;
        if self.group() == 0 {
            chunk_tiles
        } else {
            (self.group() / 16).min(chunk_tiles)
        }
    }
    /// The column (from the chunk's first) that the device layout puts at mma k slot `slot`
    /// (0..16) of k tile `tile` of a chunk: in a block of P tiles, lane group c's four slots
    /// 2c, 2c+1, 2c+8, 2c+9 of tile j are columns 4Pc + 4j .. 4Pc + 4j + 3.
    fn fragment_column(self, tile: usize, slot: usize) -> usize {
        let p = self.x_block_tiles();
        let (block, j) = (tile / p, tile % p);
        let (c, h) = ((slot % 8) / 2, (slot / 8) * 2 + slot % 2);
        16 * p * block + 4 * p * c + 4 * j + h
    }
    pub fn name(self) -> &'static str {
        match self {
            LowBitKind::W4G128 => "w4a16-g128",
            LowBitKind::W4G32 => "w4a16-g32",
            LowBitKind::W8Row => "w8a16",
            LowBitKind::W8G32 => "w8a16-g32",
            LowBitKind::W4G32Affine => "w4a16-g32-affine",
            LowBitKind::W5G32 => "w5a16-g32",
            LowBitKind::W5G32Affine => "w5a16-g32-affine",
            LowBitKind::W4K => "w4a16-k",
            LowBitKind::W5K => "w5a16-k",
            LowBitKind::W6K => "w6a16-k",
        }
    }
}

/// A quantized matrix on the CPU: `W[r][k] = scale(r, k) · q[r][k]`, or for the affine kinds
/// `scale(r, k) · q[r][k] - min(r, k)`.
#[derive(Clone, Debug, PartialEq)]
pub struct LowBitMatrix {
    kind: LowBitKind,
    rows: usize,
    cols: usize,
    /// Row-major, within [`LowBitKind::q_range`].
    q: Vec<i8>,
    /// `rows · groups` (row-major); f16 values exactly for the f16-scale kinds.
    scales: Vec<f32>,
    /// Affine kinds: `rows · groups`, what each group subtracts (f16 values for the one-level
    /// kinds); else empty.
    mins: Vec<f32>,
    /// Two-level kinds: `rows · super-blocks` f16 values `d`, every scale of the super-block
    /// `d` times an integer code ([`LowBitKind::two_level`]); else empty.
    supers: Vec<f32>,
    /// Two-level affine kinds: `dmin` per row and super-block, every min `dmin` times a code.
    super_mins: Vec<f32>,
}

impl LowBitMatrix {
    /// Builds a symmetric matrix from its integers and scales (checked).
    pub fn new(
        kind: LowBitKind,
        rows: usize,
        cols: usize,
        q: Vec<i8>,
        scales: Vec<f32>,
    ) -> Result<Self> {
        Self::with_mins(kind, rows, cols, q, scales, Vec::new())
    }

    /// Builds a one-level matrix from its integers, scales and (affine kinds only) mins
    /// (checked).
    pub fn with_mins(
        kind: LowBitKind,
        rows: usize,
        cols: usize,
        q: Vec<i8>,
        scales: Vec<f32>,
        mins: Vec<f32>,
    ) -> Result<Self> {
        Self {
            kind,
            rows,
            cols,
            q,
            scales,
            mins,
            supers: Vec::new(),
            super_mins: Vec::new(),
        }
        .checked()
    }

    /// Builds a two-level matrix ([`LowBitKind::two_level`]) from its integers, the f16 `d` (and
    /// `dmin`) per row and super-block and the integer codes per row and group (checked).
    pub fn with_super_scales(
        kind: LowBitKind,
        rows: usize,
        cols: usize,
        q: Vec<i8>,
        supers: Vec<f32>,
        codes: &[i16],
        super_mins: Vec<f32>,
        min_codes: &[i16],
    ) -> Result<Self> {
        let (groups, per_super) = (groups_of(kind, cols), K_BLOCK / kind.group().max(1));
        let supers_per_row = cols.div_ceil(K_BLOCK);
        check_len("two-level scale codes", rows * groups, codes.len())?;
        check_len("two-level d", rows * supers_per_row, supers.len())?;
        let expand = |d: &[f32], c: &[i16]| -> Vec<f32> {
            (0..c.len())
                .map(|i| {
                    let (r, g) = (i / groups, i % groups);
                    d[r * supers_per_row + g / per_super] * c[i] as f32
                })
                .collect()
        };
        let scales = expand(&supers, codes);
        let mins = if kind.affine() {
            check_len("two-level min codes", rows * groups, min_codes.len())?;
            check_len("two-level dmin", rows * supers_per_row, super_mins.len())?;
            expand(&super_mins, min_codes)
        } else {
            Vec::new()
        };
        Self {
            kind,
            rows,
            cols,
            q,
            scales,
            mins,
            supers,
            super_mins,
        }
        .checked()
    }

    /// `self` if its lengths, ranges and values are what its kind requires.
    fn checked(self) -> Result<Self> {
        let Self {
            kind,
            rows,
            cols,
            ref q,
            ref scales,
            ref mins,
            ref supers,
            ref super_mins,
        } = self;
        let bad = |m: String| Err(CudaError::Option(m));
        let cells = rows
            .checked_mul(cols)
            .ok_or_else(|| CudaError::Option(format!("matrix {rows} x {cols} is too large")))?;
        check_len("low-bit integers", cells, q.len())?;
        let groups = groups_of(kind, cols);
        check_len("low-bit scales", rows * groups, scales.len())?;
        check_len(
            "low-bit mins",
            if kind.affine() { rows * groups } else { 0 },
            mins.len(),
        )?;
        let supers_per_row = if kind.two_level() {
            cols.div_ceil(K_BLOCK)
        } else {
            0
        };
        check_len("low-bit super-block d", rows * supers_per_row, supers.len())?;
        check_len(
            "low-bit super-block dmin",
            if kind.affine() {
                rows * supers_per_row
            } else {
                0
            },
            super_mins.len(),
        )?;
        let (lo, hi) = kind.q_range();
        if q.iter().any(|&v| (v as i32) < lo || (v as i32) > hi) {
            return bad(format!("{}: an integer outside {lo}..={hi}", kind.name()));
        }
        let all = || scales.iter().chain(mins).chain(supers).chain(super_mins);
        if all().any(|s| !s.is_finite()) {
            return bad(format!("{}: scales and mins must be finite", kind.name()));
        }
        let f16_exact = |v: &f32| f16::from_f32(*v).to_f32() == *v;
        if kind.f16_scales() && !scales.iter().chain(mins).all(f16_exact) {
            return bad(format!(
                "{}: scales and mins must be f16 values",
                kind.name()
            ));
        }
        if kind.two_level() {
            if !supers.iter().chain(super_mins).all(f16_exact) {
                return bad(format!("{}: d and dmin must be f16 values", kind.name()));
            }
            // Every scale (min) is its super-block's d (dmin) times a code in range.
            let per_super = K_BLOCK / kind.group();
            let (clo, chi) = kind.code_range();
            let code_ok = |v: f32, d: f32, lo: i32| match code_of(v, d) {
                Some(c) => (lo..=chi).contains(&c),
                None => false,
            };
            for (i, &v) in scales.iter().enumerate() {
                let d = supers[(i / groups) * supers_per_row + (i % groups) / per_super];
                if !code_ok(v, d, clo) {
                    return bad(format!(
                        "{}: scale {v} is not d = {d} times a code in {clo}..={chi}",
                        kind.name()
                    ));
                }
            }
            for (i, &v) in mins.iter().enumerate() {
                let d = super_mins[(i / groups) * supers_per_row + (i % groups) / per_super];
                if !code_ok(v, d, 0) {
                    return bad(format!(
                        "{}: min {v} is not dmin = {d} times a code in 0..={chi}",
                        kind.name()
                    ));
                }
            }
        }
        // The kernels index rows and padded columns with 32-bit integers.
        let align = kind.col_align();
        if rows > i32::MAX as usize || cols.div_ceil(align) * align > i32::MAX as usize {
            return bad(format!("matrix {rows} x {cols} exceeds 32-bit dimensions"));
        }
        Ok(self)
    }

    /// Round-to-nearest quantization of `w`. Symmetric kinds: per scale group `s = max|w| / qmax`
    /// (qmax = 7, 15, 31 or 127), `q = round(w / s)` clamped to the range. Affine kinds: `s =
    /// (max - min) / (2^bits - 1)`, `m = -min`, `u = round((w + m) / s)`. Scales and mins are
    /// rounded to f16 for the f16-scale kinds. The two-level kinds round them up to `d · code`,
    /// `d = max / code max` per super-block rounded up to f16 (mins first, then the scales of the
    /// shifted range), so that no weight is clamped.
    pub fn quantize(w: &DenseMatrix, kind: LowBitKind) -> Self {
        let (rows, cols) = (w.rows(), w.cols());
        let group = if kind.group() == 0 {
            cols.max(1)
        } else {
            kind.group()
        };
        let groups = groups_of(kind, cols);
        let (lo, hi) = kind.q_range();
        // f16 scales are rounded up, so that no weight's code passes the largest one (rounded
        // to nearest, a subnormal scale of a group of tiny weights could be 1/6 too small and
        // clamp its largest weight by many steps); mins are rounded to nearest.
        let (round, round_up) = (
            |v: f32| {
                if kind.f16_scales() {
                    f16::from_f32(v).to_f32()
                } else {
                    v
                }
            },
            |v: f32| {
                if kind.f16_scales() {
                    f16_round_up(v)
                } else {
                    v
                }
            },
        );
        let mut q = vec![0i8; rows * cols];
        let mut scales = vec![0f32; rows * groups];
        let mut mins = vec![0f32; if kind.affine() { rows * groups } else { 0 }];
        for r in 0..rows {
            let row = w.row(r);
            for gi in 0..groups {
                let span = gi * group..((gi + 1) * group).min(cols);
                let vals = row[span].iter().map(|v| v.to_f32());
                let (s, m) = if kind.affine() {
                    let (min, max) = vals.fold((0f32, 0f32), |(a, b), v| (a.min(v), b.max(v)));
                    let m = round(-min);
                    (round_up((max + m) / hi as f32), m)
                } else {
                    let max = vals.fold(0f32, |a, v| a.max(v.abs()));
                    (round_up(max / hi as f32), 0.0)
                };
                if s.is_finite() && m.is_finite() {
                    scales[r * groups + gi] = s;
                    if kind.affine() {
                        mins[r * groups + gi] = m;
                    }
                }
            }
        }
        let (mut supers, mut super_mins) = (Vec::new(), Vec::new());
        if kind.two_level() {
            let (supers_per_row, per_super) = (cols.div_ceil(K_BLOCK), K_BLOCK / group);
            let (_, chi) = kind.code_range();
            // d = the largest value / the largest code, rounded up to f16; each value becomes
            // d · ceil(value / d) <= d · code max.
            let snap = |values: &mut [f32], out: &mut Vec<f32>| {
                for r in 0..rows {
                    for sb in 0..supers_per_row {
                        let (g0, g1) = (sb * per_super, ((sb + 1) * per_super).min(groups));
                        let span = r * groups + g0..r * groups + g1;
                        let max = values[span.clone()].iter().fold(0f32, |a, v| a.max(*v));
                        let d = f16_round_up(max / chi as f32);
                        out.push(d);
                        for v in &mut values[span] {
                            *v = if d > 0.0 {
                                d * (*v / d).ceil().clamp(0.0, chi as f32)
                            } else {
                                0.0
                            };
                        }
                    }
                }
            };
            if kind.affine() {
                snap(&mut mins, &mut super_mins);
                // The scales of the range the snapped mins shift the weights into.
                for r in 0..rows {
                    let row = w.row(r);
                    for gi in 0..groups {
                        let span = gi * group..((gi + 1) * group).min(cols);
                        let max = row[span].iter().fold(0f32, |a, v| a.max(v.to_f32()));
                        let s = (max + mins[r * groups + gi]) / hi as f32;
                        scales[r * groups + gi] = if s.is_finite() { s } else { 0.0 };
                    }
                }
            }
            snap(&mut scales, &mut supers);
        }
        for r in 0..rows {
            let row = w.row(r);
            for gi in 0..groups {
                let s = scales[r * groups + gi];
                if s == 0.0 {
                    continue;
                }
                let m = if kind.affine() {
                    mins[r * groups + gi]
                } else {
                    0.0
                };
                for k in gi * group..((gi + 1) * group).min(cols) {
                    let v = ((row[k].to_f32() + m) / s).round() as i32;
                    q[r * cols + k] = v.clamp(lo, hi) as i8;
                }
            }
        }
        Self {
            kind,
            rows,
            cols,
            q,
            scales,
            mins,
            supers,
            super_mins,
        }
    }

    /// Parses GGUF Q4_0 blocks (`rows · cols / 32` blocks of 18 bytes, row-major: f16 `d`, then
    /// 16 bytes whose low nibbles are weights 0..15 and high nibbles 16..31; weight = d (u - 8)).
    pub fn from_q4_0(rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        let mut p = BlockParse::new(LowBitKind::W4G32, "Q4_0", rows, cols, blocks)?;
        for (b, blk) in blocks.chunks_exact(Q4_0_BYTES).enumerate() {
            let at = b * GGUF_BLOCK;
            p.scales[at / 32] = read_f16(blk, 0);
            for (i, &byte) in blk[2..].iter().enumerate() {
                p.q[at + i] = (byte & 15) as i8 - 8;
                p.q[at + i + 16] = (byte >> 4) as i8 - 8;
            }
        }
        p.finish()
    }

    /// Parses GGUF Q8_0 blocks (`rows · cols / 32` blocks of 34 bytes: f16 `d`, 32 `i8`;
    /// weight = d q).
    pub fn from_q8_0(rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        let mut p = BlockParse::new(LowBitKind::W8G32, "Q8_0", rows, cols, blocks)?;
        for (b, blk) in blocks.chunks_exact(Q8_0_BYTES).enumerate() {
            let at = b * GGUF_BLOCK;
            p.scales[at / 32] = read_f16(blk, 0);
            for (i, &byte) in blk[2..].iter().enumerate() {
                p.q[at + i] = byte as i8;
            }
        }
        p.finish()
    }

    /// Parses GGUF Q4_1 blocks (20 bytes: f16 `d`, f16 `m`, 16 bytes of nibbles as Q4_0;
    /// weight = d u + m, so the group's min is `-m`).
    pub fn from_q4_1(rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        let mut p = BlockParse::new(LowBitKind::W4G32Affine, "Q4_1", rows, cols, blocks)?;
        for (b, blk) in blocks.chunks_exact(Q4_1_BYTES).enumerate() {
            let at = b * GGUF_BLOCK;
            p.scales[at / 32] = read_f16(blk, 0);
            p.mins[at / 32] = -read_f16(blk, 2);
            for (i, &byte) in blk[4..].iter().enumerate() {
                p.q[at + i] = (byte & 15) as i8;
                p.q[at + i + 16] = (byte >> 4) as i8;
            }
        }
        p.finish()
    }

    /// Parses GGUF Q5_0 blocks (22 bytes: f16 `d`, u32 of fifth bits, 16 bytes of nibbles;
    /// weight i = d (u - 16), its fifth bit bit i of the u32).
    pub fn from_q5_0(rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        let mut p = BlockParse::new(LowBitKind::W5G32, "Q5_0", rows, cols, blocks)?;
        for (b, blk) in blocks.chunks_exact(Q5_0_BYTES).enumerate() {
            let at = b * GGUF_BLOCK;
            p.scales[at / 32] = read_f16(blk, 0);
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            for (i, u) in q5_codes(qh, &blk[6..22]).into_iter().enumerate() {
                p.q[at + i] = u as i8 - 16;
            }
        }
        p.finish()
    }

    /// Parses GGUF Q5_1 blocks (24 bytes: f16 `d`, f16 `m`, u32 of fifth bits, 16 bytes of
    /// nibbles; weight = d u + m).
    pub fn from_q5_1(rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        let mut p = BlockParse::new(LowBitKind::W5G32Affine, "Q5_1", rows, cols, blocks)?;
        for (b, blk) in blocks.chunks_exact(Q5_1_BYTES).enumerate() {
            let at = b * GGUF_BLOCK;
            p.scales[at / 32] = read_f16(blk, 0);
            p.mins[at / 32] = -read_f16(blk, 2);
            let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
            for (i, u) in q5_codes(qh, &blk[8..24]).into_iter().enumerate() {
                p.q[at + i] = u as i8;
            }
        }
        p.finish()
    }

    /// Parses GGUF Q4_K super-blocks (144 bytes per 256 weights: f16 `d`, f16 `dmin`, 12 bytes
    /// of 6-bit (sc, m) pairs for the 8 sub-blocks of 32, 128 bytes of nibbles: bytes 32 c ..
    /// 32 c + 31 hold sub-block 2c in their low and 2c + 1 in their high nibbles; weight = d sc
    /// u - dmin m). The two levels are kept ([`LowBitKind::W4K`]).
    pub fn from_q4_k(rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        Self::from_k_affine(LowBitKind::W4K, "Q4_K", rows, cols, blocks)
    }

    /// Parses GGUF Q5_K super-blocks (176 bytes per 256: as Q4_K with 32 bytes of fifth bits
    /// after the scales; weight 32 s + l of the super-block takes bit s of byte l).
    pub fn from_q5_k(rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        Self::from_k_affine(LowBitKind::W5K, "Q5_K", rows, cols, blocks)
    }

    /// Q4_K (`kind` 4-bit) or Q5_K (5-bit: the fifth-bit bytes sit between the scales and the
    /// nibbles).
    fn from_k_affine(
        kind: LowBitKind,
        ty: &'static str,
        rows: usize,
        cols: usize,
        blocks: &[u8],
    ) -> Result<Self> {
        let mut p = BlockParse::new(kind, ty, rows, cols, blocks)?;
        let (_, block_bytes, _) = gguf_block_geometry(ty)?;
        let fifth_bits = kind.bits() == 5;
        let nibbles = if fifth_bits { 48 } else { 16 };
        for (b, blk) in blocks.chunks_exact(block_bytes).enumerate() {
            let at = b * K_BLOCK;
            p.supers[b] = read_f16(blk, 0);
            p.super_mins[b] = read_f16(blk, 2);
            let pairs = k_scales_and_mins(&blk[4..16]);
            for c in 0..4 {
                let qs = &blk[nibbles + 32 * c..nibbles + 32 * c + 32];
                for (half, shift) in [(0, 0), (1, 4)] {
                    let sub = 2 * c + half;
                    let (sc, m) = pairs[sub];
                    let base = at + 32 * sub;
                    p.codes[base / 32] = sc as i16;
                    p.min_codes[base / 32] = m as i16;
                    for (i, &byte) in qs.iter().enumerate() {
                        let fifth = if fifth_bits {
                            (blk[16 + i] >> sub) & 1
                        } else {
                            0
                        };
                        p.q[base + i] = (((byte >> shift) & 15) | fifth << 4) as i8;
                    }
                }
            }
        }
        p.finish()
    }

    /// Parses the blocks of GGUF type `ty` (`"Q4_0"`, ..., `"Q6_K"`: the types the kernels take).
    pub fn from_gguf(ty: &str, rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        match ty {
            "Q4_0" => Self::from_q4_0(rows, cols, blocks),
            "Q4_1" => Self::from_q4_1(rows, cols, blocks),
            "Q5_0" => Self::from_q5_0(rows, cols, blocks),
            "Q5_1" => Self::from_q5_1(rows, cols, blocks),
            "Q8_0" => Self::from_q8_0(rows, cols, blocks),
            "Q4_K" => Self::from_q4_k(rows, cols, blocks),
            "Q5_K" => Self::from_q5_k(rows, cols, blocks),
            "Q6_K" => Self::from_q6_k(rows, cols, blocks),
            other => Err(CudaError::Option(format!(
                "no low-bit kernel kind for GGUF {other}"
            ))),
        }
    }

    /// Parses GGUF Q6_K super-blocks (210 bytes per 256: 128 bytes of low nibbles, 64 of high
    /// bit pairs, 16 `i8` scales (one per 16 weights), f16 `d`; weight = d sc (u - 32)). In each
    /// half of 128 weights, weight 32 j + l (j = 0..3, l = 0..31) takes its nibble from byte
    /// l + 32 (j % 2) of the half's 64 (low nibble for j < 2) and its high pair from bits 2 j
    /// of byte l of the half's 32. The two levels are kept ([`LowBitKind::W6K`]).
    pub fn from_q6_k(rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        let mut p = BlockParse::new(LowBitKind::W6K, "Q6_K", rows, cols, blocks)?;
        for (b, blk) in blocks.chunks_exact(Q6_K_BYTES).enumerate() {
            let at = b * K_BLOCK;
            p.supers[b] = read_f16(blk, 208);
            for half in 0..2 {
                let ql = &blk[64 * half..64 * half + 64];
                let qh = &blk[128 + 32 * half..160 + 32 * half];
                for j in 0..4 {
                    for l in 0..32 {
                        let nib = (ql[l + 32 * (j % 2)] >> (4 * (j / 2))) & 15;
                        let u = nib | ((qh[l] >> (2 * j)) & 3) << 4;
                        p.q[at + 128 * half + 32 * j + l] = u as i8 - 32;
                    }
                }
            }
            for (i, &sc) in blk[192..208].iter().enumerate() {
                p.codes[at / 16 + i] = sc as i8 as i16;
            }
        }
        p.finish()
    }

    /// The matrices' rows one after the other (q|k|v, gate|up as one product): same kind and
    /// column count required.
    pub fn concat_rows(parts: &[&LowBitMatrix]) -> Result<Self> {
        let Some(first) = parts.first() else {
            return Err(CudaError::Option("no matrices to join".into()));
        };
        if let Some(p) = parts
            .iter()
            .find(|p| p.kind != first.kind || p.cols != first.cols)
        {
            return Err(CudaError::Option(format!(
                "joining {} ({} columns) with {} ({} columns)",
                first.kind.name(),
                first.cols,
                p.kind.name(),
                p.cols
            )));
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let q = parts.iter().flat_map(|p| p.q.iter().copied()).collect();
        let scales = parts
            .iter()
            .flat_map(|p| p.scales.iter().copied())
            .collect();
        let mins = parts.iter().flat_map(|p| p.mins.iter().copied()).collect();
        let supers = parts
            .iter()
            .flat_map(|p| p.supers.iter().copied())
            .collect();
        let super_mins = parts
            .iter()
            .flat_map(|p| p.super_mins.iter().copied())
            .collect();
        Self {
            kind: first.kind,
            rows,
            cols: first.cols,
            q,
            scales,
            mins,
            supers,
            super_mins,
        }
        .checked()
    }

    /// `w` as a W4A16 g128 matrix when every stored value is `q · s` exactly with `|q| <= 7` and
    /// one f16 scale per row and 128 columns (what `sieve pack --values int4:128` stores): the
    /// same weights at 4 bits each, so the GPU multiplies a 4-bit pack from its integers.
    /// `None` for anything else (an f16 model fails on its first group).
    pub fn from_int4_grid(w: &DenseMatrix) -> Option<Self> {
        use crate::balanced_lowbit::{detect_grids, LowBitValues};
        let (q, scales) = detect_grids(w, LowBitValues::Int4 { group: 128 })?;
        Self::new(LowBitKind::W4G128, w.rows(), w.cols(), q, scales).ok()
    }

    pub fn kind(&self) -> LowBitKind {
        self.kind
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn q(&self) -> &[i8] {
        &self.q
    }

    fn group_index(&self, r: usize, k: usize) -> usize {
        let g = match self.kind.group() {
            0 => 0,
            n => k / n,
        };
        r * groups_of(self.kind, self.cols) + g
    }

    /// The scale of weight (r, k).
    pub fn scale(&self, r: usize, k: usize) -> f32 {
        self.scales[self.group_index(r, k)]
    }

    /// What weight (r, k) subtracts after scaling (0 for the symmetric kinds).
    pub fn min(&self, r: usize, k: usize) -> f32 {
        if self.kind.affine() {
            self.mins[self.group_index(r, k)]
        } else {
            0.0
        }
    }

    /// The weights as f32 (`scale · q - min`).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for r in 0..self.rows {
            for k in 0..self.cols {
                out[r * self.cols + k] =
                    self.scale(r, k) * self.q[r * self.cols + k] as f32 - self.min(r, k);
            }
        }
        out
    }

    /// The f64 reference product: `y[n][r] = Σ_k (scale(r, k) q[r][k] - min(r, k)) x[n][k]`,
    /// `x` n x K f16 (row-major), `y` n x M.
    pub fn reference(&self, x: &[f16], n: usize) -> Vec<f64> {
        assert_eq!(x.len(), n * self.cols, "reference: x is n x K");
        let xf: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        let mut y = vec![0f64; n * self.rows];
        for r in 0..self.rows {
            for t in 0..n {
                let xr = &xf[t * self.cols..(t + 1) * self.cols];
                let mut s = 0f64;
                for (k, xv) in xr.iter().enumerate() {
                    let w = self.scale(r, k) as f64 * self.q[r * self.cols + k] as f64
                        - self.min(r, k) as f64;
                    s += w * xv;
                }
                y[t * self.rows + r] = s;
            }
        }
        y
    }

    /// Columns of the device layout (and of the activations the kernel reads): K padded to 128
    /// (256 for the two-level kinds).
    pub fn padded_cols(&self) -> usize {
        self.cols.div_ceil(self.kind.col_align()) * self.kind.col_align()
    }

    /// Bytes the device holds: weights, high planes, scales and mins.
    pub fn device_bytes(&self) -> usize {
        self.device_layout().bytes()
    }

    /// The device layout (kernel header): fragment-ordered 512-byte chunks, the high planes of
    /// the 5- and 6-bit kinds, the group scales (and mins) as f16 pairs (row g, row g + 8) per
    /// lane group, the row scales as f32.
    pub fn device_layout(&self) -> DeviceLayout {
        let kind = self.kind;
        let mp = self.rows.div_ceil(TILE_ROWS) * TILE_ROWS;
        let kp = self.padded_cols();
        let chunks = kp / kind.chunk_cols();
        let tiles = mp / TILE_ROWS;
        let hb = kind.high_bits();
        let mut weights = vec![0u8; tiles * chunks * 512];
        let mut high = vec![0u32; tiles * chunks * 32 * hb];
        // Unsigned code of weight (r, k): q + zero point, the zero point for padding.
        let code = |r: usize, k: usize| -> u32 {
            let q = if r < self.rows && k < self.cols {
                self.q[r * self.cols + k] as i32
            } else {
                0
            };
            (q + kind.zero_point()) as u32
        };
        let ktc = kind.chunk_cols() / 16;
        for rt in 0..tiles {
            for kc in 0..chunks {
                for lane in 0..32 {
                    let (g, c) = (lane / 4, lane % 4);
                    let slot = (rt * chunks + kc) * 32 + lane;
                    let at = slot * 16;
                    for j in 0..ktc {
                        let r0 = rt * TILE_ROWS;
                        // The column at k slot s of this tile (x blocks: kernel header).
                        let col = |s: usize| kc * kind.chunk_cols() + kind.fragment_column(j, s);
                        // e0..e7 of the kernel header.
                        let e = [
                            code(r0 + g, col(2 * c)),
                            code(r0 + g, col(2 * c + 1)),
                            code(r0 + g + 8, col(2 * c)),
                            code(r0 + g + 8, col(2 * c + 1)),
                            code(r0 + g, col(2 * c + 8)),
                            code(r0 + g, col(2 * c + 9)),
                            code(r0 + g + 8, col(2 * c + 8)),
                            code(r0 + g + 8, col(2 * c + 9)),
                        ];
                        if kind.bits() == 8 {
                            for (i, v) in e.iter().enumerate() {
                                weights[at + 8 * j + i] = *v as u8;
                            }
                            continue;
                        }
                        let mut word = 0u32;
                        for i in 0..4 {
                            word |= (e[2 * i] & 15) << (4 * i);
                            word |= (e[2 * i + 1] & 15) << (16 + 4 * i);
                        }
                        weights[at + 4 * j..at + 4 * j + 4].copy_from_slice(&word.to_le_bytes());
                        if hb > 0 {
                            // The tile's field: word j / 2 at bit 8 (j % 2) (HB = 2), or bit 4 j.
                            let (w, base) = if hb == 2 {
                                (j / 2, 8 * (j % 2))
                            } else {
                                (0, 4 * j)
                            };
                            for i in 0..4 {
                                let (lo, hi) = (e[2 * i] >> 4, e[2 * i + 1] >> 4);
                                high[slot * hb + w] |= lo << (base + hb * i);
                                high[slot * hb + w] |= hi << (16 + base + hb * i);
                            }
                        }
                    }
                }
            }
        }
        let mut group_scales = Vec::new();
        let mut group_mins = Vec::new();
        let mut super_scales = Vec::new();
        let mut row_scales = Vec::new();
        if kind.two_level() {
            (group_scales, super_scales, group_mins) = self.two_level_layout(tiles, kp);
        } else if kind.f16_scales() {
            let groups = kp / kind.group();
            let real = groups_of(kind, self.cols);
            let pairs = |values: &[f32]| -> Vec<u32> {
                let v = |r: usize, gi: usize| -> u32 {
                    if r < self.rows && gi < real {
                        f16::from_f32(values[r * real + gi]).to_bits() as u32
                    } else {
                        0
                    }
                };
                let mut out = vec![0u32; tiles * groups * 8];
                for rt in 0..tiles {
                    for gi in 0..groups {
                        for g in 0..8 {
                            let r = rt * TILE_ROWS + g;
                            out[(rt * groups + gi) * 8 + g] = v(r, gi) | v(r + 8, gi) << 16;
                        }
                    }
                }
                out
            };
            group_scales = pairs(&self.scales);
            if kind.affine() {
                group_mins = pairs(&self.mins);
            }
        } else {
            row_scales = (0..mp)
                .map(|r| if r < self.rows { self.scales[r] } else { 0.0 })
                .collect();
        }
        DeviceLayout {
            weights,
            high,
            group_scales,
            group_mins,
            super_scales,
            row_scales,
            chunks,
            padded_rows: mp,
            padded_cols: kp,
        }
    }

    /// The two-level kinds' scales on the device (kernel header): code words per (row tile,
    /// super-block, word, lane group), and the f16 pairs of `d` and (affine) `dmin`.
    fn two_level_layout(&self, tiles: usize, kp: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
        let kind = self.kind;
        let supers = kp / K_BLOCK;
        let (real_supers, groups) = (self.cols.div_ceil(K_BLOCK), groups_of(kind, self.cols));
        let per_super = K_BLOCK / kind.group();
        // The code of group gi of row r (0 in the padding): `build` checked that it exists.
        let code = |values: &[f32], ds: &[f32], r: usize, gi: usize| -> u32 {
            if r >= self.rows || gi >= groups {
                return 0;
            }
            let d = ds[r * real_supers + gi / per_super];
            code_of(values[r * groups + gi], d).expect("two-level codes are checked at build") as i8
                as u8 as u32
        };
        // w6 k's i8 codes go to the device biased by 128 (the kernel converts sc + 128 and
        // takes the bias off in the same exact add); padding becomes 128, that is sc = 0.
        let bias = if kind.affine() { 0 } else { 0x80 };
        let pair = |ds: &[f32], r: usize, sb: usize| -> u32 {
            let h = |r: usize| {
                if r < self.rows && sb < real_supers {
                    f16::from_f32(ds[r * real_supers + sb]).to_bits() as u32
                } else {
                    0
                }
            };
            h(r) | h(r + 8) << 16
        };
        let mut words = vec![0u32; tiles * supers * 64];
        let mut d_pairs = vec![0u32; tiles * supers * 8];
        let mut dmin_pairs = vec![0u32; if kind.affine() { tiles * supers * 8 } else { 0 }];
        for rt in 0..tiles {
            for sb in 0..supers {
                for g in 0..8 {
                    let r = rt * TILE_ROWS + g;
                    let at = (rt * supers + sb) * 8 + g;
                    d_pairs[at] = pair(&self.supers, r, sb);
                    if kind.affine() {
                        dmin_pairs[at] = pair(&self.super_mins, r, sb);
                    }
                    for j in 0..8 {
                        let (s, d) = (&self.scales, &self.supers);
                        words[((rt * supers + sb) * 8 + j) * 8 + g] = if kind.affine() {
                            let (m, dm) = (&self.mins, &self.super_mins);
                            let gi = sb * per_super + j;
                            code(s, d, r, gi)
                                | code(s, d, r + 8, gi) << 8
                                | code(m, dm, r, gi) << 16
                                | code(m, dm, r + 8, gi) << 24
                        } else {
                            let gi = sb * per_super + 2 * j;
                            (code(s, d, r, gi) ^ bias)
                                | (code(s, d, r + 8, gi) ^ bias) << 8
                                | (code(s, d, r, gi + 1) ^ bias) << 16
                                | (code(s, d, r + 8, gi + 1) ^ bias) << 24
                        };
                    }
                }
            }
        }
        (words, d_pairs, dmin_pairs)
    }
}

/// A GGUF tensor's blocks being parsed into a [`LowBitMatrix`]: shape and length checked first.
struct BlockParse {
    kind: LowBitKind,
    rows: usize,
    cols: usize,
    q: Vec<i8>,
    /// One-level kinds: the scales and (affine) mins per group.
    scales: Vec<f32>,
    mins: Vec<f32>,
    /// Two-level kinds: `d` (and `dmin`) per super-block, codes per group.
    supers: Vec<f32>,
    super_mins: Vec<f32>,
    codes: Vec<i16>,
    min_codes: Vec<i16>,
}

impl BlockParse {
    fn new(
        kind: LowBitKind,
        ty: &'static str,
        rows: usize,
        cols: usize,
        blocks: &[u8],
    ) -> Result<Self> {
        let (elems, bytes, label) = gguf_block_geometry(ty)?;
        if !cols.is_multiple_of(elems) {
            return Err(CudaError::Option(format!(
                "{ty} blocks need K a multiple of {elems}, got {cols}"
            )));
        }
        let want = rows
            .checked_mul(cols / elems)
            .and_then(|b| b.checked_mul(bytes))
            .ok_or_else(|| {
                CudaError::Option(format!("{ty} matrix {rows} x {cols} is too large"))
            })?;
        check_len(label, want, blocks.len())?;
        let groups = rows * groups_of(kind, cols);
        let (one, two) = if kind.two_level() {
            (0, groups)
        } else {
            (groups, 0)
        };
        let affine = |n: usize| if kind.affine() { n } else { 0 };
        let supers = if kind.two_level() {
            rows * cols.div_ceil(K_BLOCK)
        } else {
            0
        };
        Ok(Self {
            kind,
            rows,
            cols,
            q: vec![0; rows * cols],
            scales: vec![0.0; one],
            mins: vec![0.0; affine(one)],
            supers: vec![0.0; supers],
            super_mins: vec![0.0; affine(supers)],
            codes: vec![0; two],
            min_codes: vec![0; affine(two)],
        })
    }

    fn finish(self) -> Result<LowBitMatrix> {
        if self.kind.two_level() {
            LowBitMatrix::with_super_scales(
                self.kind,
                self.rows,
                self.cols,
                self.q,
                self.supers,
                &self.codes,
                self.super_mins,
                &self.min_codes,
            )
        } else {
            LowBitMatrix::with_mins(
                self.kind,
                self.rows,
                self.cols,
                self.q,
                self.scales,
                self.mins,
            )
        }
    }
}

/// (weights, bytes, what the length check calls them) of one block of the GGUF types the
/// kernels take.
fn gguf_block_geometry(ty: &str) -> Result<(usize, usize, &'static str)> {
    Ok(match ty {
        "Q4_0" => (GGUF_BLOCK, Q4_0_BYTES, "Q4_0 bytes"),
        "Q4_1" => (GGUF_BLOCK, Q4_1_BYTES, "Q4_1 bytes"),
        "Q5_0" => (GGUF_BLOCK, Q5_0_BYTES, "Q5_0 bytes"),
        "Q5_1" => (GGUF_BLOCK, Q5_1_BYTES, "Q5_1 bytes"),
        "Q8_0" => (GGUF_BLOCK, Q8_0_BYTES, "Q8_0 bytes"),
        "Q4_K" => (K_BLOCK, Q4_K_BYTES, "Q4_K bytes"),
        "Q5_K" => (K_BLOCK, Q5_K_BYTES, "Q5_K bytes"),
        "Q6_K" => (K_BLOCK, Q6_K_BYTES, "Q6_K bytes"),
        other => {
            return Err(CudaError::Option(format!(
                "no low-bit kernel kind for GGUF {other}"
            )))
        }
    })
}

fn read_f16(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The smallest f16 value at or above `v` (`v` >= 0, finite; an overflow becomes infinite).
fn f16_round_up(v: f32) -> f32 {
    let h = f16::from_f32(v);
    if h.to_f32() < v {
        f16::from_bits(h.to_bits() + 1).to_f32()
    } else {
        h.to_f32()
    }
}

/// The integer `c` with `v == d · c` exactly in f32, if there is one (a two-level scale's code).
fn code_of(v: f32, d: f32) -> Option<i32> {
    if d == 0.0 {
        return (v == 0.0).then_some(0);
    }
    let c = (v / d).round();
    (c.abs() <= 255.0 && d * c == v).then_some(c as i32)
}

/// The 32 five-bit codes of a Q5_0 / Q5_1 block: nibbles as Q4_0, weight i's fifth bit bit i of
/// `qh`.
fn q5_codes(qh: u32, qs: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, &byte) in qs.iter().enumerate() {
        out[i] = (byte & 15) | (((qh >> i) & 1) as u8) << 4;
        out[i + 16] = (byte >> 4) | (((qh >> (i + 16)) & 1) as u8) << 4;
    }
    out
}

/// The 8 (scale, min) 6-bit pairs of a Q4_K / Q5_K super-block's 12 bytes: pairs 0..4 are the
/// low 6 bits of bytes 0..4 (scales) and 4..8 (mins); pairs 4..8 take their low 4 bits from the
/// nibbles of bytes 8..12 and their top 2 bits from the top bits of bytes 0..4 / 4..8.
fn k_scales_and_mins(p: &[u8]) -> [(u8, u8); 8] {
    let mut out = [(0u8, 0u8); 8];
    for (j, pair) in out.iter_mut().enumerate() {
        *pair = if j < 4 {
            (p[j] & 63, p[j + 4] & 63)
        } else {
            (
                (p[j + 4] & 15) | (p[j - 4] >> 6) << 4,
                (p[j + 4] >> 4) | (p[j] >> 6) << 4,
            )
        };
    }
    out
}

/// What [`LowBitMatrix::device_layout`] builds (kernel header).
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceLayout {
    pub weights: Vec<u8>,
    /// 5- and 6-bit kinds: the high bits, 1 or 2 u32 per lane and chunk; else empty.
    pub high: Vec<u32>,
    /// f16 scale pairs per group, or the two-level kinds' code words.
    pub group_scales: Vec<u32>,
    /// Affine kinds: the f16 min pairs, indexed as `group_scales`, or the two-level kinds' `dmin`
    /// pairs per super-block; else empty.
    pub group_mins: Vec<u32>,
    /// Two-level kinds: the f16 `d` pairs per super-block; else empty.
    pub super_scales: Vec<u32>,
    pub row_scales: Vec<f32>,
    /// 512-byte chunks per row tile.
    pub chunks: usize,
    pub padded_rows: usize,
    pub padded_cols: usize,
}

impl DeviceLayout {
    /// Bytes on the device: what one product reads.
    pub fn bytes(&self) -> usize {
        self.weights.len()
            + 4 * (self.high.len()
                + self.group_scales.len()
                + self.group_mins.len()
                + self.super_scales.len()
                + self.row_scales.len())
    }
}

fn groups_of(kind: LowBitKind, cols: usize) -> usize {
    match kind.group() {
        0 => 1,
        g => cols.div_ceil(g),
    }
}

fn gguf_shape(cols: usize) -> Result<()> {
    if !cols.is_multiple_of(GGUF_BLOCK) {
        return Err(CudaError::Option(format!(
            "GGUF blocks need K a multiple of {GGUF_BLOCK}, got {cols}"
        )));
    }
    Ok(())
}

/// GGUF Q4_0 blocks of `w` (K a multiple of 32), as ggml's reference quantizer makes them: per
/// block `d = m / -8` with `m` the weight of largest magnitude (sign kept), `u = min(15,
/// floor(w / d + 8.5))`, `d` stored as f16.
pub fn quantize_q4_0(w: &DenseMatrix) -> Result<Vec<u8>> {
    gguf_shape(w.cols())?;
    let mut out = Vec::with_capacity(w.rows() * w.cols() / GGUF_BLOCK * Q4_0_BYTES);
    for r in 0..w.rows() {
        for blk in w.row(r).chunks_exact(GGUF_BLOCK) {
            let v: Vec<f32> = blk.iter().map(|x| x.to_f32()).collect();
            let m = v
                .iter()
                .copied()
                .fold(0f32, |a, x| if x.abs() > a.abs() { x } else { a });
            let d = m / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
            for i in 0..16 {
                let u = |x: f32| ((x * id + 8.5) as i32).clamp(0, 15) as u8;
                out.push(u(v[i]) | u(v[i + 16]) << 4);
            }
        }
    }
    Ok(out)
}

/// GGUF Q8_0 blocks of `w` (K a multiple of 32): `d = max|w| / 127`, `q = round(w / d)`, `d`
/// stored as f16.
pub fn quantize_q8_0(w: &DenseMatrix) -> Result<Vec<u8>> {
    gguf_shape(w.cols())?;
    let mut out = Vec::with_capacity(w.rows() * w.cols() / GGUF_BLOCK * Q8_0_BYTES);
    for r in 0..w.rows() {
        for blk in w.row(r).chunks_exact(GGUF_BLOCK) {
            let amax = blk.iter().fold(0f32, |a, x| a.max(x.to_f32().abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
            for x in blk {
                out.push(((x.to_f32() * id).round() as i32).clamp(-128, 127) as i8 as u8);
            }
        }
    }
    Ok(out)
}

/// A [`LowBitMatrix`] on the device with its kernel.
pub struct GpuLowBit {
    kind: LowBitKind,
    rows: usize,
    cols: usize,
    padded_cols: usize,
    chunks: usize,
    tiles: usize,
    weights: CudaSlice<u8>,
    high: CudaSlice<u32>,
    group_scales: CudaSlice<u32>,
    group_mins: CudaSlice<u32>,
    super_scales: CudaSlice<u32>,
    row_scales: CudaSlice<f32>,
    bytes: usize,
    /// Resident blocks on the whole GPU per kernel instance (index nt - 1): the persistent
    /// grid's size, asked at upload (never first inside a graph capture).
    resident: [u32; 4],
}

impl GpuLowBit {
    /// The array the decode step asks L2 for ahead of this product (its largest: the
    /// weights), see [`crate::product::L2Span`].
    pub fn weight_span(&self, gpu: &Gpu) -> crate::product::L2Span {
        crate::product::L2Span::of(gpu, &self.weights)
    }

    pub fn upload(gpu: &Gpu, m: &LowBitMatrix) -> Result<Self> {
        let mut resident = [0u32; 4];
        for (i, r) in resident.iter_mut().enumerate() {
            let name = format!("{}_nt{}", m.kind.kernel_prefix(), i + 1);
            *r = gpu.resident_blocks(&FAMILY, &name, 256)?;
        }
        let l = m.device_layout();
        let bytes = l.bytes();
        // Kinds without high planes or mins still pass a (never read) one-word buffer.
        let or_one = |v: &[u32]| if v.is_empty() { vec![0u32] } else { v.to_vec() };
        Ok(Self {
            kind: m.kind,
            rows: m.rows,
            cols: m.cols,
            padded_cols: l.padded_cols,
            chunks: l.chunks,
            tiles: l.padded_rows / TILE_ROWS,
            weights: gpu.upload(&l.weights)?,
            high: gpu.upload(&or_one(&l.high))?,
            group_scales: gpu.upload(&l.group_scales)?,
            group_mins: gpu.upload(&or_one(&l.group_mins))?,
            super_scales: gpu.upload(&or_one(&l.super_scales))?,
            row_scales: gpu.upload(&l.row_scales)?,
            bytes,
            resident,
        })
    }

    /// Uploads GGUF Q4_0 blocks (repacked, not dequantized).
    pub fn upload_q4_0(gpu: &Gpu, rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        Self::upload(gpu, &LowBitMatrix::from_q4_0(rows, cols, blocks)?)
    }

    /// Uploads GGUF Q8_0 blocks (repacked, not dequantized).
    pub fn upload_q8_0(gpu: &Gpu, rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        Self::upload(gpu, &LowBitMatrix::from_q8_0(rows, cols, blocks)?)
    }

    pub fn kind(&self) -> LowBitKind {
        self.kind
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The row length of the activations the kernel reads (K padded to 128, zeros past K).
    pub fn padded_cols(&self) -> usize {
        self.padded_cols
    }
    /// Weight and scale bytes on the device (what one product reads).
    pub fn device_bytes(&self) -> usize {
        self.bytes
    }

    /// `y (n x M f32) = x (n x padded_cols f16) · Wᵀ`, or `y +=` with `accumulate`. `x` must
    /// be zero past K ([`pad_activations`], [`activations_to_f16`] make it so): an affine kind's
    /// padding columns inside a real group hold `-min`, not 0.
    pub fn launch(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f16>,
        n: usize,
        y: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        check_len("low-bit x (n x padded K)", n * self.padded_cols, x.len())?;
        check_len("low-bit y (n x M)", n * self.rows, y.len())?;
        let (xp, yp) = (crate::dev_ptr(gpu, x), crate::dev_ptr(gpu, y));
        self.launch_ptr(gpu, xp, n, yp, self.rows, accumulate)
    }

    /// [`Self::launch`] on raw device addresses: `x` n x padded_cols f16, `y` n rows of `ldy`
    /// f32 (the product's M rows at the start of each).
    pub fn launch_ptr(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        n: usize,
        y: DevPtr,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        if n == 0 || n > MAX_TOKENS {
            return Err(CudaError::Option(format!(
                "low-bit kernels take 1..={MAX_TOKENS} tokens, got {n}"
            )));
        }
        if self.rows == 0 {
            return Ok(());
        }
        let nt = n.div_ceil(8);
        let name = format!("{}_nt{nt}", self.kind.kernel_prefix());
        let f = gpu.function(&FAMILY, &name)?;
        // Persistent blocks: never more than stay resident at once (the kernel walks the row
        // tiles with a grid stride, keeping loads in flight across tile boundaries).
        let resident = self.resident[nt - 1];
        // Persistent for every kind: measured on an H200 over the products of a 7B decode step
        // in one graph (dev/lowbit-tune, 2026-12-04), 2-9% faster than one block per row tile
        // (the same for W4A16 g128). `SIEVE_LOWBIT_GRID=tiles` keeps the other for measuring.
        let grid = if persistent_override().unwrap_or(true) {
            (self.tiles as u32).min(resident)
        } else {
            self.tiles as u32
        };
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (ldx, ldy, m, n) = (
            self.padded_cols as i32,
            ldy as i32,
            self.rows as i32,
            n as i32,
        );
        let (chunks, acc) = (self.chunks as i32, accumulate as i32);
        let mut b = gpu.stream().launch_builder(&f);
        self.push_layout(&mut b);
        b.arg(&x)
            .arg(&ldx)
            .arg(&y)
            .arg(&ldy)
            .arg(&m)
            .arg(&n)
            .arg(&chunks)
            .arg(&acc);
        unsafe { b.launch(cfg) }.during("launching a low-bit GEMV")?;
        Ok(())
    }
}

impl GpuLowBit {
    /// The weights, group scale pairs, chunks per row tile and row tiles: what the W4A8
    /// kernels (`crate::w4a8`) read of the same layout.
    pub(crate) fn layout_parts(&self) -> (&CudaSlice<u8>, &CudaSlice<u32>, usize, usize) {
        (&self.weights, &self.group_scales, self.chunks, self.tiles)
    }

    /// The device layout's six arrays, the first arguments of every kernel of the family.
    fn push_layout<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.weights)
            .arg(&self.high)
            .arg(&self.group_scales)
            .arg(&self.group_mins)
            .arg(&self.super_scales)
            .arg(&self.row_scales);
    }

    /// Rows of [`Self::decode_rows_f16`]'s output: M padded to the 16-row tile.
    pub fn padded_rows(&self) -> usize {
        self.tiles * TILE_ROWS
    }

    /// `out` (device, [`Self::padded_rows`] x [`Self::padded_cols`] f16, row-major) = the
    /// matrix's values, each rounded to f16 once from the f32 value [`LowBitMatrix::dequantize`]
    /// computes: the batched prefill's copy for cuBLAS, which beats the low-bit kernel (one
    /// pass over the weights per 32 tokens) on long prompts. Padding rows are 0; padding
    /// columns are 0 or, for the affine kinds, `-min` (a GEMM over K columns never reads them).
    pub fn decode_rows_f16(&self, gpu: &Gpu, out: DevPtr) -> Result<()> {
        if self.rows == 0 {
            return Ok(());
        }
        let name = format!("{}_to_f16", self.kind.kernel_prefix());
        let f = gpu.function(&FAMILY, &name)?;
        let threads = self.tiles * self.chunks * 32;
        let blocks = u32::try_from(threads.div_ceil(256)).map_err(|_| {
            CudaError::Option(format!(
                "a {} x {} low-bit matrix is too large to decode in one launch",
                self.rows, self.cols
            ))
        })?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (tiles, chunks) = (self.tiles as i32, self.chunks as i32);
        let mut b = gpu.stream().launch_builder(&f);
        self.push_layout(&mut b);
        b.arg(&out).arg(&tiles).arg(&chunks);
        unsafe { b.launch(cfg) }.during("launching a low-bit decode to f16")?;
        Ok(())
    }
}

/// `SIEVE_LOWBIT_GRID=tiles|persistent` in the environment overrides the grid choice
/// (persistent blocks), read once: a switch for measuring that choice in a whole
/// decode step, not a setting.
fn persistent_override() -> Option<bool> {
    static CHOICE: OnceLock<Option<bool>> = OnceLock::new();
    *CHOICE.get_or_init(
        || match std::env::var("SIEVE_LOWBIT_GRID").ok().as_deref() {
            Some("tiles") => Some(false),
            Some("persistent") => Some(true),
            _ => None,
        },
    )
}

/// `x` (n x K) as the low-bit kernels read it: n x `padded` f16, zeros past K.
pub fn pad_activations(x: &[f16], n: usize, k: usize, padded: usize) -> Vec<f16> {
    let mut out = vec![f16::ZERO; n * padded];
    for t in 0..n {
        out[t * padded..t * padded + k].copy_from_slice(&x[t * k..(t + 1) * k]);
    }
    out
}

/// Converts f32 activations on the device (n rows of K, `ldin` floats apart) to the kernels'
/// f16 input (n x `ldx`, zeros past K), zeroing the inputs `threshold` marks inactive.
#[allow(clippy::too_many_arguments)]
pub fn activations_to_f16(
    gpu: &Gpu,
    x: DevPtr,
    k: usize,
    ldin: usize,
    ldx: usize,
    n: usize,
    threshold: sieve_formats::Threshold,
    out: DevPtr,
) -> Result<()> {
    if k > ldx || k > ldin {
        return Err(CudaError::Option(format!(
            "activations of {k} columns in rows of {ldin} (input) / {ldx} (output)"
        )));
    }
    let f = gpu.function(&FAMILY, "lowbit_x_to_f16")?;
    let total = (n * ldx) as u32;
    let cfg = LaunchConfig {
        grid_dim: (total.div_ceil(256).max(1), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (k, ldin, ldx, n) = (k as i32, ldin as i32, ldx as i32, n as i32);
    let t = crate::product::threshold_arg(threshold);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&x)
        .arg(&out)
        .arg(&k)
        .arg(&ldin)
        .arg(&ldx)
        .arg(&n)
        .arg(&t);
    unsafe { b.launch(cfg) }.during("launching lowbit_x_to_f16")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sieve_cpu::gguf_blocks::dequant::dequantize;
    use sieve_cpu::gguf_blocks::test_blocks::random_blocks;
    use sieve_cpu::gguf_blocks::BlockType;
    use sieve_formats::random::{sparse_matrix, Pattern};

    /// Reads the device layout back (the kernel's reading: fragment elements e0..e7 per lane
    /// and k tile, high bits from their plane, scale and min pairs per lane group) into
    /// integers, scales and mins.
    fn read_back(m: &LowBitMatrix) -> (Vec<i8>, Vec<f32>, Vec<f32>) {
        let l = m.device_layout();
        let kind = m.kind();
        let ktc = kind.chunk_cols() / 16;
        let hb = kind.high_bits();
        let tiles = l.padded_rows / 16;
        let mut q = vec![0i8; l.padded_rows * l.padded_cols];
        for rt in 0..tiles {
            for kc in 0..l.chunks {
                for lane in 0..32 {
                    let (g, c) = (lane / 4, lane % 4);
                    let slot = (rt * l.chunks + kc) * 32 + lane;
                    let at = slot * 16;
                    for j in 0..ktc {
                        let r0 = rt * 16;
                        let pos = [
                            (g, 2 * c),
                            (g, 2 * c + 1),
                            (g + 8, 2 * c),
                            (g + 8, 2 * c + 1),
                            (g, 2 * c + 8),
                            (g, 2 * c + 9),
                            (g + 8, 2 * c + 8),
                            (g + 8, 2 * c + 9),
                        ];
                        for (i, (dr, dk)) in pos.iter().enumerate() {
                            let code = if kind.bits() == 8 {
                                l.weights[at + 8 * j + i] as i32
                            } else {
                                let w = u32::from_le_bytes(
                                    l.weights[at + 4 * j..at + 4 * j + 4].try_into().unwrap(),
                                );
                                let half = if i % 2 == 0 { 0 } else { 16 };
                                let lo = (w >> (half + 4 * (i / 2))) & 15;
                                let hi = match hb {
                                    0 => 0,
                                    1 => (l.high[slot] >> (half + 4 * j + i / 2)) & 1,
                                    _ => {
                                        let w = l.high[slot * 2 + j / 2];
                                        (w >> (half + 8 * (j % 2) + 2 * (i / 2))) & 3
                                    }
                                };
                                (lo | hi << 4) as i32
                            };
                            let k = kc * kind.chunk_cols() + kind.fragment_column(j, *dk);
                            q[(r0 + dr) * l.padded_cols + k] = (code - kind.zero_point()) as i8;
                        }
                    }
                }
            }
        }
        let mut out_q = vec![0i8; m.rows() * m.cols()];
        let (mut scales, mut mins) = (Vec::new(), Vec::new());
        for r in 0..l.padded_rows {
            for k in 0..l.padded_cols {
                let v = q[r * l.padded_cols + k];
                if r < m.rows() && k < m.cols() {
                    out_q[r * m.cols() + k] = v;
                } else {
                    assert_eq!(v, 0, "padding ({r}, {k}) is not zero");
                }
            }
        }
        let half = |w: u32, hi: bool| f16::from_bits(if hi { w >> 16 } else { w & 0xffff } as u16);
        for r in 0..m.rows() {
            let (rt, g) = (r / 16, r % 8);
            let hi = r % 16 >= 8;
            if kind.two_level() {
                // Codes from their words, d (dmin) from their pairs, multiplied as the kernel does.
                let supers = l.padded_cols / K_BLOCK;
                let per_super = K_BLOCK / kind.group();
                for gi in 0..m.cols().div_ceil(kind.group()) {
                    let (sb, gs) = (gi / per_super, gi % per_super);
                    let at = (rt * supers + sb) * 8 + g;
                    let byte = |w: u32, b: usize| (w >> (8 * b)) as u8;
                    let row = if hi { 1 } else { 0 };
                    let d = half(l.super_scales[at], hi).to_f32();
                    if kind.affine() {
                        let w = l.group_scales[((rt * supers + sb) * 8 + gs) * 8 + g];
                        scales.push(d * byte(w, row) as f32);
                        let dmin = half(l.group_mins[at], hi).to_f32();
                        mins.push(dmin * byte(w, 2 + row) as f32);
                    } else {
                        let w = l.group_scales[((rt * supers + sb) * 8 + gs / 2) * 8 + g];
                        // Stored as sc + 128.
                        scales.push(d * (byte(w, 2 * (gs % 2) + row) as f32 - 128.0));
                    }
                }
            } else if kind.f16_scales() {
                let groups = l.padded_cols / kind.group();
                for gi in 0..m.cols().div_ceil(kind.group()) {
                    let at = (rt * groups + gi) * 8 + g;
                    scales.push(half(l.group_scales[at], hi).to_f32());
                    if kind.affine() {
                        mins.push(half(l.group_mins[at], hi).to_f32());
                    }
                }
            } else {
                scales.push(l.row_scales[r]);
            }
        }
        (out_q, scales, mins)
    }

    /// `lowbit_*_to_f16` (kernels/dense_lowbit_gemv.cu) on the CPU, thread by thread with the
    /// kernel's own index arithmetic (not `fragment_column`, not `read_back`), so that its
    /// mapping of fragments to rows and columns and of scales to groups is checked against the
    /// layout builder without a GPU. The fragment registers are decoded as the GEMV's
    /// `lb_frag*` define them (register i = nibble or byte pair i; its high bits at HB i).
    fn emulate_decode_to_f16(m: &LowBitMatrix) -> Vec<f16> {
        let kind = m.kind();
        let l = m.device_layout();
        let bits = kind.bits();
        let hb = kind.high_bits();
        let z = kind.zero_point();
        let ktc = if bits == 8 { 2 } else { 4 };
        let ck = 16 * ktc;
        let kpg = kind.group() / 16;
        let p = if kind.group() != 0 && kpg < ktc {
            kpg
        } else {
            ktc
        };
        let hw = hb.max(1);
        let (chunks, tiles) = (l.chunks, l.padded_rows / 16);
        let ldo = chunks * ck;
        let half = |w: u32, h: usize| f16::from_bits((w >> (16 * h)) as u16).to_f32();
        let mut out = vec![f16::from_bits(0x7e00); l.padded_rows * ldo];
        for i in 0..tiles * chunks * 32 {
            let lane = i % 32;
            let (kc, rt) = ((i / 32) % chunks, (i / 32) / chunks);
            let (g, c) = (lane / 4, lane % 4);
            let r0 = rt * 16 + g;
            let words: Vec<u32> = (0..4)
                .map(|w| {
                    u32::from_le_bytes(
                        l.weights[16 * i + 4 * w..16 * i + 4 * w + 4]
                            .try_into()
                            .unwrap(),
                    )
                })
                .collect();
            let hws: Vec<u32> = (0..hw)
                .map(|h| if hb > 0 { l.high[i * hw + h] } else { 0 })
                .collect();
            for j in 0..ktc {
                // The 8 elements e0..e7 (register r = (e2r, e2r+1)) as u - Z.
                let e = |idx: usize| -> f32 {
                    let (reg, upper) = (idx / 2, idx % 2 == 1);
                    let u = if bits == 8 {
                        let w = words[2 * j + reg / 2];
                        (w >> (8 * (2 * (reg % 2) + upper as usize))) & 0xff
                    } else {
                        let sh = 16 * upper as usize + 4 * reg;
                        let lo = (words[j] >> sh) & 15;
                        let hi = match hb {
                            0 => 0,
                            1 => (hws[0] >> (4 * j)) >> (16 * upper as usize + reg) & 1,
                            _ => {
                                (hws[(j >> 1) % hw] >> (8 * (j & 1)))
                                    >> (16 * upper as usize + 2 * reg)
                                    & 3
                            }
                        };
                        lo | hi << 4
                    };
                    (u as i32 - z) as f32
                };
                let col = kc * ck + 16 * p * (j / p) + 4 * p * c + 4 * (j % p);
                let (mut s, mut mn) = ([0f32; 2], [0f32; 2]);
                if kind.two_level() {
                    let at = rt * (ldo / 256) + col / 256;
                    let d = [
                        half(l.super_scales[at * 8 + g], 0),
                        half(l.super_scales[at * 8 + g], 1),
                    ];
                    if kind.affine() {
                        let cw = l.group_scales[(at * 8 + (col % 256) / 32) * 8 + g];
                        let dm = [
                            half(l.group_mins[at * 8 + g], 0),
                            half(l.group_mins[at * 8 + g], 1),
                        ];
                        for h in 0..2 {
                            s[h] = d[h] * ((cw >> (8 * h)) & 0xff) as f32;
                            mn[h] = dm[h] * ((cw >> (16 + 8 * h)) & 0xff) as f32;
                        }
                    } else {
                        let gl = (col % 256) / 16;
                        let cw = l.group_scales[(at * 8 + gl / 2) * 8 + g] >> (16 * (gl & 1));
                        for h in 0..2 {
                            s[h] = d[h] * (((cw >> (8 * h)) & 0xff) as i32 - 128) as f32;
                        }
                    }
                } else if kind.group() != 0 {
                    let at = (rt * (ldo / kind.group()) + col / kind.group()) * 8 + g;
                    s = [half(l.group_scales[at], 0), half(l.group_scales[at], 1)];
                    if kind.affine() {
                        mn = [half(l.group_mins[at], 0), half(l.group_mins[at], 1)];
                    }
                } else {
                    s = [l.row_scales[r0], l.row_scales[r0 + 8]];
                }
                for h in 0..2 {
                    // Registers h and h + 2: columns +0, +1 and +2, +3 of row r0 + 8h.
                    let q = [e(2 * h), e(2 * h + 1), e(2 * h + 4), e(2 * h + 5)];
                    for (o, qv) in q.iter().enumerate() {
                        out[(r0 + 8 * h) * ldo + col + o] = f16::from_f32(s[h] * qv - mn[h]);
                    }
                }
            }
        }
        out
    }

    /// [`emulate_decode_to_f16`] gives every weight its dequantized value rounded to f16, zeros
    /// in the padding rows, and leaves nothing of the padded matrix unwritten.
    fn check_emulated_decode(m: &LowBitMatrix, what: &str) {
        let out = emulate_decode_to_f16(m);
        let kp = m.padded_cols();
        let want = m.dequantize();
        for (i, v) in out.iter().enumerate() {
            let (r, k) = (i / kp, i % kp);
            assert!(!v.is_nan(), "{what}: ({r}, {k}) not written");
            if r >= m.rows() {
                assert_eq!(v.to_f32(), 0.0, "{what}: padding row {r}");
            } else if k < m.cols() {
                let w = f16::from_f32(want[r * m.cols() + k]);
                assert_eq!(
                    v.to_bits(),
                    w.to_bits(),
                    "{what}: ({r}, {k}) {v} against {w}"
                );
            }
        }
    }

    const KINDS: [LowBitKind; 10] = LowBitKind::ALL;

    /// The GGUF types the kernels take: every one the loader keeps.
    const GGUF_TYPES: [BlockType; 8] = BlockType::ALL;

    #[test]
    fn int4_grid_packs_are_detected_exactly_and_f16_matrices_are_not() {
        use crate::balanced_lowbit::{snap_row, LowBitValues};
        let w = sparse_matrix(37, 300, 0.3, Pattern::Unstructured, 5).unwrap();
        assert!(
            LowBitMatrix::from_int4_grid(&w).is_none(),
            "random f16 values"
        );
        // As `sieve pack --values int4:G` stores them: snapped per row and G columns.
        let snapped = |group: usize| {
            let mut data = Vec::new();
            for r in 0..w.rows() {
                let mut row: Vec<f32> = w.row(r).iter().map(|v| v.to_f32()).collect();
                snap_row(LowBitValues::Int4 { group }, &mut row).unwrap();
                data.extend(row);
            }
            DenseMatrix::from_f32(w.rows(), w.cols(), &data).unwrap()
        };
        let s128 = snapped(128);
        let m = LowBitMatrix::from_int4_grid(&s128).expect("a snapped matrix is on the grid");
        assert_eq!(m.kind(), LowBitKind::W4G128);
        let back = m.dequantize();
        for (i, v) in s128.data().iter().enumerate() {
            assert_eq!(back[i], v.to_f32(), "weight {i}");
        }
        // Snapped per 32 columns, the scales differ inside a 128-column group: not this kind.
        assert!(LowBitMatrix::from_int4_grid(&snapped(32)).is_none());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// The device layout holds every integer and scale where the kernel reads it, and zeros
        /// in the padding.
        #[test]
        fn device_layout_round_trips(rows in 1usize..40, cols in 1usize..300, seed in 0u64..1000, kind in 0usize..10) {
            let kind = KINDS[kind];
            let w = sparse_matrix(rows, cols, 0.0, Pattern::Unstructured, seed).unwrap();
            let m = LowBitMatrix::quantize(&w, kind);
            let (q, scales, mins) = read_back(&m);
            prop_assert_eq!(&q[..], m.q());
            prop_assert_eq!(&scales[..], &m.scales[..]);
            prop_assert_eq!(&mins[..], &m.mins[..]);
        }

        /// The prefill's f16 decode, emulated thread by thread, puts every weight where
        /// `dequantize` has it.
        #[test]
        fn decode_to_f16_mapping_matches_dequantize(rows in 1usize..40, cols in 1usize..300, seed in 0u64..1000, kind in 0usize..10) {
            let kind = KINDS[kind];
            let w = sparse_matrix(rows, cols, 0.2, Pattern::Unstructured, seed).unwrap();
            check_emulated_decode(&LowBitMatrix::quantize(&w, kind), kind.name());
        }

        /// The same for GGUF blocks of every type (random codes, real-model scales).
        #[test]
        fn decode_to_f16_mapping_matches_gguf_blocks(rows in 1usize..20, supers in 1usize..3, seed in 0u64..1000, ty in 0usize..8) {
            let ty = GGUF_TYPES[ty];
            let cols = supers * 256;
            let blocks = sieve_cpu::gguf_blocks::test_blocks::random_blocks(ty, rows, cols, seed);
            let m = LowBitMatrix::from_gguf(&format!("{ty:?}"), rows, cols, &blocks).unwrap();
            check_emulated_decode(&m, &format!("{ty:?}"));
        }

        /// Every GGUF type parses to exactly what sieve-cpu's dequantizer (an independent reading
        /// of ggml's formats) makes of the same blocks, and the parsed matrix survives the device
        /// layout.
        #[test]
        fn gguf_blocks_parse_to_the_cpu_dequantization(rows in 1usize..5, supers in 1usize..3, seed in 0u64..1000, ty in 0usize..8) {
            let ty = GGUF_TYPES[ty];
            let cols = supers * 256;
            let blocks = random_blocks(ty, rows, cols, seed);
            let m = LowBitMatrix::from_gguf(&format!("{ty:?}"), rows, cols, &blocks).unwrap();
            let want = dequantize(ty.ggml(), &blocks, rows * cols).unwrap();
            let got = m.dequantize();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let (r, k) = (i / cols, i % cols);
                // f32 roundings of the same products (d · sc · q - dmin · m) in another order.
                let tol = (m.scale(r, k) * m.q()[i] as f32).abs() * 1.0e-6 + m.min(r, k).abs() * 1.0e-6;
                prop_assert!((g - w).abs() <= tol, "{:?} ({}, {}): {} vs {}", ty, r, k, g, w);
            }
            let (q, scales, mins) = read_back(&m);
            prop_assert_eq!(&q[..], m.q());
            prop_assert_eq!(&scales[..], &m.scales[..]);
            prop_assert_eq!(&mins[..], &m.mins[..]);
        }

        /// Quantization error is at most half a step (plus the f16 rounding of the scale).
        #[test]
        fn quantization_is_within_half_a_step(rows in 1usize..8, cols in 1usize..300, seed in 0u64..1000, kind in 0usize..10) {
            let kind = KINDS[kind];
            let w = sparse_matrix(rows, cols, 0.3, Pattern::Unstructured, seed).unwrap();
            let m = LowBitMatrix::quantize(&w, kind);
            let d = m.dequantize();
            for r in 0..rows {
                for k in 0..cols {
                    let s = m.scale(r, k);
                    let err = (d[r * cols + k] - w.get(r, k).to_f32()).abs();
                    prop_assert!(err <= s * 0.5 * 1.01 + s * 0.01 + 1e-12 || (kind.bits() == 4 && err <= s * 1.01),
                        "({}, {}) err {} step {}", r, k, err, s);
                }
            }
        }

        /// GGUF blocks parse back to what the quantizer meant: the ggml dequantization formula.
        #[test]
        fn gguf_blocks_parse_to_their_dequantization(rows in 1usize..6, blocks in 1usize..8, seed in 0u64..1000) {
            let cols = blocks * GGUF_BLOCK;
            let w = sparse_matrix(rows, cols, 0.2, Pattern::Unstructured, seed).unwrap();
            let b4 = quantize_q4_0(&w).unwrap();
            let m4 = LowBitMatrix::from_q4_0(rows, cols, &b4).unwrap();
            let b8 = quantize_q8_0(&w).unwrap();
            let m8 = LowBitMatrix::from_q8_0(rows, cols, &b8).unwrap();
            for r in 0..rows {
                for j in 0..blocks {
                    let blk = &b4[(r * blocks + j) * Q4_0_BYTES..][..Q4_0_BYTES];
                    let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    for i in 0..32 {
                        let byte = blk[2 + i % 16];
                        let u = if i < 16 { byte & 15 } else { byte >> 4 };
                        let k = j * 32 + i;
                        prop_assert_eq!(m4.dequantize()[r * cols + k], d * (u as f32 - 8.0));
                        // Q4_0 is close to the weight (half a step, the clamp at 15 a full one).
                        prop_assert!((d * (u as f32 - 8.0) - w.get(r, k).to_f32()).abs() <= d.abs() * 1.01 + 1e-6);
                    }
                    let blk = &b8[(r * blocks + j) * Q8_0_BYTES..][..Q8_0_BYTES];
                    let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    for i in 0..32 {
                        let k = j * 32 + i;
                        prop_assert_eq!(m8.dequantize()[r * cols + k], d * (blk[2 + i] as i8) as f32);
                    }
                }
            }
        }
    }

    /// The columns the layout puts at each k slot are the ones the kernel's activation loads
    /// bring there: per block of P tiles, lane group c reads 4 P consecutive halves from column
    /// 16 P block + 4 P c as 2 P words, and tile j's B registers are words 2 j and 2 j + 1
    /// (slots 2c, 2c+1, then 2c+8, 2c+9). Worked out from the loads, not from
    /// `fragment_column`, so that the two are checked against each other.
    #[test]
    fn fragment_columns_are_where_the_kernel_loads_activations() {
        for kind in LowBitKind::ALL {
            let tiles = kind.chunk_cols() / 16;
            // The kernel's P: tiles per scale group when a group is smaller than the chunk.
            let group_tiles = kind.group() / 16;
            let p = if kind.group() != 0 && group_tiles < tiles {
                group_tiles
            } else {
                tiles
            };
            let mut seen = vec![false; kind.chunk_cols()];
            for j in 0..tiles {
                for c in 0..4 {
                    for (h, slot) in [2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9]
                        .into_iter()
                        .enumerate()
                    {
                        let word = 2 * j + h / 2;
                        let (block, i) = (word / (2 * p), word % (2 * p));
                        let loaded = 16 * p * block + 4 * p * c + 2 * i + h % 2;
                        assert_eq!(
                            kind.fragment_column(j, slot),
                            loaded,
                            "{kind:?} tile {j} slot {slot}"
                        );
                        assert!(!seen[loaded], "{kind:?}: column {loaded} twice");
                        seen[loaded] = true;
                        // A block stays inside one scale group.
                        if kind.group() != 0 {
                            assert_eq!(
                                loaded / kind.group().min(kind.chunk_cols()),
                                (16 * j) / kind.group().min(kind.chunk_cols()),
                                "{kind:?}"
                            );
                        }
                    }
                }
            }
            assert!(
                seen.iter().all(|&s| s),
                "{kind:?}: a column is never loaded"
            );
        }
    }

    #[test]
    fn bad_inputs_are_refused() {
        assert!(LowBitMatrix::from_q4_0(2, 33, &[]).is_err());
        assert!(LowBitMatrix::from_q8_0(1, 32, &[0u8; 33]).is_err());
        assert!(LowBitMatrix::new(LowBitKind::W4G128, 1, 1, vec![8], vec![1.0]).is_err());
        assert!(LowBitMatrix::new(LowBitKind::W4G128, 1, 1, vec![7], vec![0.1]).is_err());
        assert!(LowBitMatrix::new(LowBitKind::W8Row, 1, 1, vec![-128], vec![0.1]).is_ok());
        // Affine kinds: unsigned codes, a min per group, both checked.
        let affine = |q: i8, mins: Vec<f32>| {
            LowBitMatrix::with_mins(LowBitKind::W4G32Affine, 1, 1, vec![q], vec![0.5], mins)
        };
        assert!(affine(15, vec![0.25]).is_ok());
        assert!(affine(-1, vec![0.25]).is_err());
        assert!(affine(3, vec![]).is_err());
        assert!(affine(3, vec![f32::INFINITY]).is_err());
        // K-quant blocks: K a multiple of 256, the exact byte count.
        assert!(LowBitMatrix::from_q4_k(1, 32, &[0u8; 18]).is_err());
        assert!(LowBitMatrix::from_q6_k(1, 256, &[0u8; 209]).is_err());
        assert!(LowBitMatrix::from_q5_k(usize::MAX / 2, 256, &[]).is_err());
        // Two levels keep d · sc exact in f32, even past the f16 range.
        let mut huge = vec![0u8; Q6_K_BYTES];
        huge[208..210].copy_from_slice(&f16::MAX.to_le_bytes());
        huge[192] = 100;
        let m = LowBitMatrix::from_q6_k(1, 256, &huge).unwrap();
        assert_eq!(m.scale(0, 0), 65504.0 * 100.0);
        // Two-level kinds: d an f16 value, codes in range, the lengths.
        let two = |d: f32, code: i16| {
            LowBitMatrix::with_super_scales(
                LowBitKind::W4K,
                1,
                32,
                vec![0; 32],
                vec![d],
                &[code],
                vec![0.5],
                &[1],
            )
        };
        assert!(two(0.5, 63).is_ok());
        assert!(two(0.5, 64).is_err());
        assert!(two(0.1, 1).is_err());
        assert!(two(f32::INFINITY, 1).is_err());
        assert!(
            LowBitMatrix::with_mins(LowBitKind::W4K, 1, 32, vec![0; 32], vec![1.0], vec![0.0])
                .is_err()
        );
    }
}
