//! Dense low-bit weights on the GPU: W4A16 (group 128, f16 scales, zero point 8), W8A16 (per-row
//! f32 scales), and GGUF Q4_0 / Q8_0 blocks repacked at upload into the same fragment layout
//! (Q4_0 = 4-bit with groups of 32, Q8_0 = 8-bit with groups of 32; never dequantized to f16).
//! Kernels: `kernels/dense_lowbit_gemv.cu` (read its header for the layout and thread mapping):
//! `Y (N x M) = X (N x K, f16) · Wᵀ` for N = 1..32 on the tensor cores, f32 output.
//!
//! [`LowBitMatrix`] is the CPU side: the quantized integers and scales, the quantizers, the GGUF
//! block parsers, the f64 reference product the kernels must match, and the device layout.

use crate::dense::check_len;
use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{Gpu, KernelFamily};
use crate::product::DevPtr;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::f16;
use sieve_formats::DenseMatrix;

pub const FAMILY: KernelFamily = KernelFamily {
    name: "dense_lowbit_gemv",
    source: include_str!("../kernels/dense_lowbit_gemv.cu"),
};

/// Tokens one launch takes: four 8-token n tiles.
pub const MAX_TOKENS: usize = 32;
/// Rows per row tile (one block).
const TILE_ROWS: usize = 16;
/// Columns are padded to a multiple of this (every chunk and group size divides it).
pub const K_ALIGN: usize = 128;
/// GGUF block size (Q4_0, Q8_0): 32 weights.
pub const GGUF_BLOCK: usize = 32;
/// Bytes of a GGUF Q4_0 block: f16 scale, 16 bytes of nibbles.
pub const Q4_0_BYTES: usize = 18;
/// Bytes of a GGUF Q8_0 block: f16 scale, 32 `i8`.
pub const Q8_0_BYTES: usize = 34;

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
}

impl LowBitKind {
    pub fn bits(self) -> usize {
        match self {
            LowBitKind::W4G128 | LowBitKind::W4G32 => 4,
            LowBitKind::W8Row | LowBitKind::W8G32 => 8,
        }
    }
    /// Columns per scale; 0 = one scale per row.
    pub fn group(self) -> usize {
        match self {
            LowBitKind::W4G128 => 128,
            LowBitKind::W4G32 | LowBitKind::W8G32 => 32,
            LowBitKind::W8Row => 0,
        }
    }
    /// The integer range of `q` (the value is `scale · q`).
    pub fn q_range(self) -> (i32, i32) {
        if self.bits() == 4 {
            (-8, 7)
        } else {
            (-128, 127)
        }
    }
    /// Whether the device stores the scales as f16 (else f32).
    pub fn f16_scales(self) -> bool {
        self.group() > 0
    }
    fn kernel_prefix(self) -> &'static str {
        match self {
            LowBitKind::W4G128 => "lowbit_w4g128",
            LowBitKind::W4G32 => "lowbit_w4g32",
            LowBitKind::W8Row => "lowbit_w8row",
            LowBitKind::W8G32 => "lowbit_w8g32",
        }
    }
    /// Columns per 512-byte chunk of the device layout.
    fn chunk_cols(self) -> usize {
        if self.bits() == 4 {
            64
        } else {
            32
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            LowBitKind::W4G128 => "w4a16-g128",
            LowBitKind::W4G32 => "w4a16-g32",
            LowBitKind::W8Row => "w8a16",
            LowBitKind::W8G32 => "w8a16-g32",
        }
    }
}

/// A quantized matrix on the CPU: `W[r][k] = scale(r, k) · q[r][k]`.
#[derive(Clone, Debug, PartialEq)]
pub struct LowBitMatrix {
    kind: LowBitKind,
    rows: usize,
    cols: usize,
    /// Row-major, within [`LowBitKind::q_range`].
    q: Vec<i8>,
    /// `rows · groups` (row-major); f16 values exactly for the f16-scale kinds.
    scales: Vec<f32>,
}

impl LowBitMatrix {
    /// Builds a matrix from its integers and scales (checked).
    pub fn new(
        kind: LowBitKind,
        rows: usize,
        cols: usize,
        q: Vec<i8>,
        scales: Vec<f32>,
    ) -> Result<Self> {
        let bad = |m: String| Err(CudaError::Option(m));
        check_len("low-bit integers", rows * cols, q.len())?;
        let groups = groups_of(kind, cols);
        check_len("low-bit scales", rows * groups, scales.len())?;
        let (lo, hi) = kind.q_range();
        if q.iter().any(|&v| (v as i32) < lo || (v as i32) > hi) {
            return bad(format!("{}: an integer outside {lo}..={hi}", kind.name()));
        }
        if scales.iter().any(|s| !s.is_finite()) {
            return bad("low-bit scales must be finite".into());
        }
        if kind.f16_scales() && scales.iter().any(|&s| f16::from_f32(s).to_f32() != s) {
            return bad(format!("{}: scales must be f16 values", kind.name()));
        }
        if rows > i32::MAX as usize || cols > i32::MAX as usize {
            return bad(format!("matrix {rows} x {cols} exceeds 32-bit dimensions"));
        }
        Ok(Self {
            kind,
            rows,
            cols,
            q,
            scales,
        })
    }

    /// Round-to-nearest quantization of `w`: per scale group `s = max|w| / qmax` (qmax = 7 or
    /// 127; rounded to f16 for the f16-scale kinds), `q = round(w / s)` clamped to the range.
    pub fn quantize(w: &DenseMatrix, kind: LowBitKind) -> Self {
        let (rows, cols) = (w.rows(), w.cols());
        let group = if kind.group() == 0 {
            cols.max(1)
        } else {
            kind.group()
        };
        let groups = groups_of(kind, cols);
        let (lo, hi) = kind.q_range();
        let mut q = vec![0i8; rows * cols];
        let mut scales = vec![0f32; rows * groups];
        for r in 0..rows {
            let row = w.row(r);
            for gi in 0..groups {
                let span = gi * group..((gi + 1) * group).min(cols);
                let max = row[span.clone()]
                    .iter()
                    .fold(0f32, |a, v| a.max(v.to_f32().abs()));
                let mut s = max / hi as f32;
                if kind.f16_scales() {
                    s = f16::from_f32(s).to_f32();
                }
                if !s.is_finite() || s == 0.0 {
                    continue;
                }
                scales[r * groups + gi] = s;
                for k in span {
                    let v = (row[k].to_f32() / s).round() as i32;
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
        }
    }

    /// Parses GGUF Q4_0 blocks (`rows · cols / 32` blocks of 18 bytes, row-major: f16 `d`, then
    /// 16 bytes whose low nibbles are weights 0..15 and high nibbles 16..31; weight = d (u - 8)).
    pub fn from_q4_0(rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        gguf_shape(cols)?;
        let nb = cols / GGUF_BLOCK;
        check_len("Q4_0 bytes", rows * nb * Q4_0_BYTES, blocks.len())?;
        let mut q = vec![0i8; rows * cols];
        let mut scales = vec![0f32; rows * nb];
        for (b, blk) in blocks.chunks_exact(Q4_0_BYTES).enumerate() {
            let (r, j) = (b / nb, b % nb);
            scales[r * nb + j] = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            let base = r * cols + j * GGUF_BLOCK;
            for (i, &byte) in blk[2..].iter().enumerate() {
                q[base + i] = (byte & 15) as i8 - 8;
                q[base + i + 16] = (byte >> 4) as i8 - 8;
            }
        }
        Self::new(LowBitKind::W4G32, rows, cols, q, scales)
    }

    /// Parses GGUF Q8_0 blocks (`rows · cols / 32` blocks of 34 bytes: f16 `d`, 32 `i8`;
    /// weight = d q).
    pub fn from_q8_0(rows: usize, cols: usize, blocks: &[u8]) -> Result<Self> {
        gguf_shape(cols)?;
        let nb = cols / GGUF_BLOCK;
        check_len("Q8_0 bytes", rows * nb * Q8_0_BYTES, blocks.len())?;
        let mut q = vec![0i8; rows * cols];
        let mut scales = vec![0f32; rows * nb];
        for (b, blk) in blocks.chunks_exact(Q8_0_BYTES).enumerate() {
            let (r, j) = (b / nb, b % nb);
            scales[r * nb + j] = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            let base = r * cols + j * GGUF_BLOCK;
            for (i, &byte) in blk[2..].iter().enumerate() {
                q[base + i] = byte as i8;
            }
        }
        Self::new(LowBitKind::W8G32, rows, cols, q, scales)
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
        Self::new(first.kind, rows, first.cols, q, scales)
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

    /// The scale of weight (r, k).
    pub fn scale(&self, r: usize, k: usize) -> f32 {
        let g = match self.kind.group() {
            0 => 0,
            n => k / n,
        };
        self.scales[r * groups_of(self.kind, self.cols) + g]
    }

    /// The weights as f32 (`scale · q`).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for r in 0..self.rows {
            for k in 0..self.cols {
                out[r * self.cols + k] = self.scale(r, k) * self.q[r * self.cols + k] as f32;
            }
        }
        out
    }

    /// The f64 reference product: `y[n][r] = Σ_k scale(r, k) q[r][k] x[n][k]`, `x` n x K f16
    /// (row-major), `y` n x M.
    pub fn reference(&self, x: &[f16], n: usize) -> Vec<f64> {
        assert_eq!(x.len(), n * self.cols, "reference: x is n x K");
        let xf: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
        let mut y = vec![0f64; n * self.rows];
        for r in 0..self.rows {
            for t in 0..n {
                let xr = &xf[t * self.cols..(t + 1) * self.cols];
                let mut s = 0f64;
                for (k, xv) in xr.iter().enumerate() {
                    s += self.scale(r, k) as f64 * self.q[r * self.cols + k] as f64 * xv;
                }
                y[t * self.rows + r] = s;
            }
        }
        y
    }

    /// Columns of the device layout (and of the activations the kernel reads): K padded to 128.
    pub fn padded_cols(&self) -> usize {
        self.cols.div_ceil(K_ALIGN) * K_ALIGN
    }

    /// Bytes the device holds: weights and scales.
    pub fn device_bytes(&self) -> usize {
        let l = self.device_layout();
        l.weights.len() + 4 * l.group_scales.len() + 4 * l.row_scales.len()
    }

    /// The device layout (kernel header): fragment-ordered 512-byte chunks, the group scales as
    /// f16 pairs (row g, row g + 8) per lane group, the row scales as f32.
    pub fn device_layout(&self) -> DeviceLayout {
        let kind = self.kind;
        let mp = self.rows.div_ceil(TILE_ROWS) * TILE_ROWS;
        let kp = self.padded_cols();
        let chunks = kp / kind.chunk_cols();
        let tiles = mp / TILE_ROWS;
        let mut weights = vec![0u8; tiles * chunks * 512];
        // Unsigned code of weight (r, k): q + zero point, the zero point for padding.
        let code = |r: usize, k: usize| -> u32 {
            let q = if r < self.rows && k < self.cols {
                self.q[r * self.cols + k] as i32
            } else {
                0
            };
            (q + if kind.bits() == 4 { 8 } else { 128 }) as u32
        };
        let ktc = kind.chunk_cols() / 16;
        for rt in 0..tiles {
            for kc in 0..chunks {
                for lane in 0..32 {
                    let (g, c) = (lane / 4, lane % 4);
                    let at = ((rt * chunks + kc) * 32 + lane) * 16;
                    for j in 0..ktc {
                        let r0 = rt * TILE_ROWS;
                        let k0 = (kc * ktc + j) * 16;
                        // e0..e7 of the kernel header.
                        let e = [
                            code(r0 + g, k0 + 2 * c),
                            code(r0 + g, k0 + 2 * c + 1),
                            code(r0 + g + 8, k0 + 2 * c),
                            code(r0 + g + 8, k0 + 2 * c + 1),
                            code(r0 + g, k0 + 2 * c + 8),
                            code(r0 + g, k0 + 2 * c + 9),
                            code(r0 + g + 8, k0 + 2 * c + 8),
                            code(r0 + g + 8, k0 + 2 * c + 9),
                        ];
                        if kind.bits() == 4 {
                            let mut word = 0u32;
                            for i in 0..4 {
                                word |= e[2 * i] << (4 * i);
                                word |= e[2 * i + 1] << (16 + 4 * i);
                            }
                            weights[at + 4 * j..at + 4 * j + 4]
                                .copy_from_slice(&word.to_le_bytes());
                        } else {
                            for (i, v) in e.iter().enumerate() {
                                weights[at + 8 * j + i] = *v as u8;
                            }
                        }
                    }
                }
            }
        }
        let mut group_scales = Vec::new();
        let mut row_scales = Vec::new();
        if kind.f16_scales() {
            let groups = kp / kind.group();
            let real = groups_of(kind, self.cols);
            let s = |r: usize, gi: usize| -> u32 {
                if r < self.rows && gi < real {
                    f16::from_f32(self.scales[r * real + gi]).to_bits() as u32
                } else {
                    0
                }
            };
            group_scales = vec![0u32; tiles * groups * 8];
            for rt in 0..tiles {
                for gi in 0..groups {
                    for g in 0..8 {
                        let r = rt * TILE_ROWS + g;
                        group_scales[(rt * groups + gi) * 8 + g] = s(r, gi) | s(r + 8, gi) << 16;
                    }
                }
            }
        } else {
            row_scales = (0..mp)
                .map(|r| if r < self.rows { self.scales[r] } else { 0.0 })
                .collect();
        }
        DeviceLayout {
            weights,
            group_scales,
            row_scales,
            chunks,
            padded_rows: mp,
            padded_cols: kp,
        }
    }
}

/// What [`LowBitMatrix::device_layout`] builds (kernel header).
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceLayout {
    pub weights: Vec<u8>,
    pub group_scales: Vec<u32>,
    pub row_scales: Vec<f32>,
    /// 512-byte chunks per row tile.
    pub chunks: usize,
    pub padded_rows: usize,
    pub padded_cols: usize,
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
    group_scales: CudaSlice<u32>,
    row_scales: CudaSlice<f32>,
    bytes: usize,
}

impl GpuLowBit {
    pub fn upload(gpu: &Gpu, m: &LowBitMatrix) -> Result<Self> {
        let l = m.device_layout();
        let bytes = l.weights.len() + 4 * l.group_scales.len() + 4 * l.row_scales.len();
        Ok(Self {
            kind: m.kind,
            rows: m.rows,
            cols: m.cols,
            padded_cols: l.padded_cols,
            chunks: l.chunks,
            tiles: l.padded_rows / TILE_ROWS,
            weights: gpu.upload(&l.weights)?,
            group_scales: gpu.upload(&l.group_scales)?,
            row_scales: gpu.upload(&l.row_scales)?,
            bytes,
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

    /// `y (n x M f32) = x (n x padded_cols f16) · Wᵀ`, or `y +=` with `accumulate`.
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
        let cfg = LaunchConfig {
            grid_dim: (self.tiles as u32, 1, 1),
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
        b.arg(&self.weights)
            .arg(&self.group_scales)
            .arg(&self.row_scales)
            .arg(&x)
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
    use sieve_formats::random::{sparse_matrix, Pattern};

    /// Reads the device layout back (the kernel's reading: fragment elements e0..e7 per lane
    /// and k tile, scale pairs per lane group) into integers and scales.
    fn read_back(m: &LowBitMatrix) -> (Vec<i8>, Vec<f32>) {
        let l = m.device_layout();
        let kind = m.kind();
        let ktc = kind.chunk_cols() / 16;
        let tiles = l.padded_rows / 16;
        let mut q = vec![0i8; l.padded_rows * l.padded_cols];
        for rt in 0..tiles {
            for kc in 0..l.chunks {
                for lane in 0..32 {
                    let (g, c) = (lane / 4, lane % 4);
                    let at = ((rt * l.chunks + kc) * 32 + lane) * 16;
                    for j in 0..ktc {
                        let (r0, k0) = (rt * 16, (kc * ktc + j) * 16);
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
                            let v = if kind.bits() == 4 {
                                let w = u32::from_le_bytes(
                                    l.weights[at + 4 * j..at + 4 * j + 4].try_into().unwrap(),
                                );
                                let shift = if i % 2 == 0 {
                                    4 * (i / 2)
                                } else {
                                    16 + 4 * (i / 2)
                                };
                                ((w >> shift) & 15) as i32 - 8
                            } else {
                                l.weights[at + 8 * j + i] as i32 - 128
                            };
                            q[(r0 + dr) * l.padded_cols + k0 + dk] = v as i8;
                        }
                    }
                }
            }
        }
        let mut out_q = vec![0i8; m.rows() * m.cols()];
        let mut scales = Vec::new();
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
        for r in 0..m.rows() {
            let (rt, g) = (r / 16, r % 8);
            let hi = r % 16 >= 8;
            if kind.f16_scales() {
                let groups = l.padded_cols / kind.group();
                for gi in 0..m.cols().div_ceil(kind.group()) {
                    let w = l.group_scales[(rt * groups + gi) * 8 + g];
                    let bits = if hi { w >> 16 } else { w & 0xffff } as u16;
                    scales.push(f16::from_bits(bits).to_f32());
                }
            } else {
                scales.push(l.row_scales[r]);
            }
        }
        (out_q, scales)
    }

    const KINDS: [LowBitKind; 4] = [
        LowBitKind::W4G128,
        LowBitKind::W4G32,
        LowBitKind::W8Row,
        LowBitKind::W8G32,
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// The device layout holds every integer and scale where the kernel reads it, and zeros
        /// in the padding.
        #[test]
        fn device_layout_round_trips(rows in 1usize..40, cols in 1usize..300, seed in 0u64..1000, kind in 0usize..4) {
            let kind = KINDS[kind];
            let w = sparse_matrix(rows, cols, 0.0, Pattern::Unstructured, seed).unwrap();
            let m = LowBitMatrix::quantize(&w, kind);
            let (q, scales) = read_back(&m);
            prop_assert_eq!(&q[..], m.q());
            prop_assert_eq!(&scales[..], &m.scales[..]);
        }

        /// Quantization error is at most half a step (plus the f16 rounding of the scale).
        #[test]
        fn quantization_is_within_half_a_step(rows in 1usize..8, cols in 1usize..300, seed in 0u64..1000, kind in 0usize..4) {
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

    #[test]
    fn bad_inputs_are_refused() {
        assert!(LowBitMatrix::from_q4_0(2, 33, &[]).is_err());
        assert!(LowBitMatrix::from_q8_0(1, 32, &[0u8; 33]).is_err());
        assert!(LowBitMatrix::new(LowBitKind::W4G128, 1, 1, vec![8], vec![1.0]).is_err());
        assert!(LowBitMatrix::new(LowBitKind::W4G128, 1, 1, vec![7], vec![0.1]).is_err());
        assert!(LowBitMatrix::new(LowBitKind::W8Row, 1, 1, vec![-128], vec![0.1]).is_ok());
    }
}
