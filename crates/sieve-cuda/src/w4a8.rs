//! W4A8 on the GPU: 4-bit weights (sieve's W4A16 g128, GGUF Q4_0) times 8-bit activations on
//! the integer tensor cores, `Y (N x M) = X (N x K) · Wᵀ` for N = 1..32, f32 output.
//! Kernels: `kernels/w4a8_gemv.cu` (its header draws the fragments and says why): the weights
//! are a [`GpuLowBit`]'s device layout, shared with the W4A16 kernel; the activations are each
//! token's row quantized on the device by [`Int8Activations::quantize`] to INT8 with one scale
//! per 128 columns, exactly as [`sieve_formats::eight_bit::int8_groups`] does on the CPU.
//!
//! [`reference`] is the f64 product the kernels must match: the same integer codes and scales,
//! summed exactly. What W4A8 costs in accuracy against W4A16 is the activations' rounding
//! (half a step of its group's `max|x| / 127` per input), not the kernel's.

use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{Gpu, KernelFamily};
use crate::lowbit::{GpuLowBit, LowBitKind, LowBitMatrix, MAX_TOKENS};
use crate::product::{dev_ptr, DevPtr};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use sieve_formats::eight_bit::{int8_groups, GroupedRow8, INT8_ACTIVATION_GROUP};
use sieve_formats::Threshold;

pub const FAMILY: KernelFamily = KernelFamily {
    name: "w4a8_gemv",
    source: include_str!("../kernels/w4a8_gemv.cu"),
};

/// Whether a weight kind has a W4A8 kernel: the symmetric 4-bit kinds with zero point 8.
pub fn supports(kind: LowBitKind) -> bool {
    matches!(kind, LowBitKind::W4G128 | LowBitKind::W4G32)
}

fn kernel_prefix(kind: LowBitKind) -> Result<&'static str> {
    match kind {
        LowBitKind::W4G128 => Ok("w4a8_g128"),
        LowBitKind::W4G32 => Ok("w4a8_g32"),
        other => Err(CudaError::Option(format!(
            "W4A8 kernels take 4-bit weights with groups of 128 or 32 (W4A16 g128, GGUF Q4_0), not {}",
            other.name()
        ))),
    }
}

/// Each token's activations as INT8 codes (`n x ldx` bytes, every aligned group of 4 columns in
/// the byte order 0, 2, 1, 3 the kernel's fragments want; zeros past K) and one f32 scale per
/// 128 columns of each token (`ldx / 128` per token, token-major), on the device.
pub struct Int8Activations {
    codes: CudaSlice<u8>,
    scales: CudaSlice<f32>,
    tokens: usize,
    ldx: usize,
}

impl Int8Activations {
    /// Room for `tokens` rows of `ldx` columns (`ldx` a multiple of 128: every W4A8 matrix's
    /// [`GpuLowBit::padded_cols`] is).
    pub fn new(gpu: &Gpu, tokens: usize, ldx: usize) -> Result<Self> {
        if tokens == 0 || ldx == 0 || !ldx.is_multiple_of(crate::lowbit::K_ALIGN) {
            return Err(CudaError::Option(format!(
                "INT8 activations need at least one token and rows of a multiple of {} columns, got {tokens} x {ldx}",
                crate::lowbit::K_ALIGN
            )));
        }
        let len = tokens.checked_mul(ldx).ok_or_else(|| {
            CudaError::Option(format!("{tokens} x {ldx} INT8 activations overflow"))
        })?;
        Ok(Self {
            codes: gpu.upload(&vec![0u8; len])?,
            scales: gpu.upload(&vec![0f32; tokens * (ldx / INT8_ACTIVATION_GROUP)])?,
            tokens,
            ldx,
        })
    }

    pub fn ldx(&self) -> usize {
        self.ldx
    }
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Quantizes `n` rows of f32 activations at `x` (K columns, `ldin` floats apart) on the
    /// device, zeroing first the inputs `threshold` marks inactive (|x| <= t).
    pub fn quantize(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        k: usize,
        ldin: usize,
        n: usize,
        threshold: Threshold,
    ) -> Result<()> {
        if n == 0 || n > self.tokens || k > self.ldx || k > ldin {
            return Err(CudaError::Option(format!(
                "quantizing {n} tokens of {k} columns (rows {ldin} apart) into room for {} x {}",
                self.tokens, self.ldx
            )));
        }
        let f = gpu.function(&FAMILY, "w4a8_quantize_x")?;
        // One warp per (token, 128-column group), 8 warps a block.
        let warps = n * self.groups();
        let cfg = LaunchConfig {
            grid_dim: (warps.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (k, ldin, ldx, n) = (k as i32, ldin as i32, self.ldx as i32, n as i32);
        let t = crate::product::threshold_arg(threshold);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&x)
            .arg(&k)
            .arg(&ldin)
            .arg(&t)
            .arg(&self.codes)
            .arg(&ldx)
            .arg(&self.scales)
            .arg(&n);
        unsafe { b.launch(cfg) }.during("launching w4a8_quantize_x")?;
        Ok(())
    }

    /// Device address of token `t`'s codes.
    fn codes_at(&self, gpu: &Gpu, t: usize) -> DevPtr {
        dev_ptr(gpu, &self.codes) + (t * self.ldx) as u64
    }
    /// Scales per token: one per 128 columns.
    fn groups(&self) -> usize {
        self.ldx / INT8_ACTIVATION_GROUP
    }
    /// Device address of token `t`'s first scale.
    fn scale_at(&self, gpu: &Gpu, t: usize) -> DevPtr {
        dev_ptr(gpu, &self.scales) + (t * self.groups() * 4) as u64
    }

    /// The first `n` tokens' codes (first `k` columns) in column order and the scales of their
    /// groups, read back (for tests).
    pub fn download(&self, gpu: &Gpu, n: usize, k: usize) -> Result<Vec<GroupedRow8>> {
        let codes = gpu.download(&self.codes)?;
        let scales = gpu.download(&self.scales)?;
        let (k, g) = (k.min(self.ldx), self.groups());
        Ok((0..n.min(self.tokens))
            .map(|t| GroupedRow8 {
                codes: (0..k)
                    .map(|col| codes[t * self.ldx + stored_position(col)] as i8)
                    .collect(),
                scales: scales[t * g..t * g + k.div_ceil(INT8_ACTIVATION_GROUP)].to_vec(),
                group: INT8_ACTIVATION_GROUP,
            })
            .collect())
    }
}

/// Where column `col`'s code sits in a row of quantized activations: its aligned group of 4
/// stores columns +0, +2, +1, +3 (the byte order of the weights' fragments).
pub fn stored_position(col: usize) -> usize {
    let o = col % 4;
    col - o + [0, 2, 1, 3][o]
}

/// The CPU side of the activations: each token's row (K columns) masked by `threshold`, then
/// quantized in groups of 128 columns by [`int8_groups`].
pub fn quantize_reference(x: &[f32], n: usize, k: usize, threshold: Threshold) -> Vec<GroupedRow8> {
    (0..n)
        .map(|t| {
            let row: Vec<f32> = x[t * k..(t + 1) * k]
                .iter()
                .map(|&v| match threshold {
                    Some(th) if v.abs() <= th => 0.0,
                    _ => v,
                })
                .collect();
            int8_groups(&row, INT8_ACTIVATION_GROUP)
        })
        .collect()
}

/// The f64 reference of the W4A8 product: `y[n][r] = Σ_k s_n(k) scale(r, k) q[r][k] code_n[k]`
/// (`s_n(k)` token n's scale of the 128 columns holding k)
/// with the activations of [`quantize_reference`] (`x` n x K f32, row-major; `y` n x M).
pub fn reference(m: &LowBitMatrix, x: &[f32], n: usize, threshold: Threshold) -> Result<Vec<f64>> {
    kernel_prefix(m.kind())?;
    let (rows, cols) = (m.rows(), m.cols());
    if x.len() != n * cols {
        return Err(CudaError::Option(format!(
            "W4A8 reference: x has {} values, not {n} x {cols}",
            x.len()
        )));
    }
    let acts = quantize_reference(x, n, cols, threshold);
    let q = m.q();
    let mut y = vec![0f64; n * rows];
    for (t, a) in acts.iter().enumerate() {
        for r in 0..rows {
            let mut s = 0f64;
            for (k, &code) in a.codes.iter().enumerate() {
                if code != 0 {
                    s += a.scale_of(k) as f64
                        * m.scale(r, k) as f64
                        * (q[r * cols + k] as f64 * code as f64);
                }
            }
            y[t * rows + r] = s;
        }
    }
    Ok(y)
}

/// The W4A8 kernels of one weight kind, looked up (with their resident block counts, never
/// first inside a graph capture) for multiplying [`GpuLowBit`] matrices of that kind: the
/// decode step keeps one beside a matrix it also multiplies with f16 activations.
pub struct W4A8 {
    kind: LowBitKind,
    /// Resident blocks per kernel instance (index nt - 1): the persistent grid's size.
    resident: [u32; 4],
    prefix: &'static str,
}

impl W4A8 {
    pub fn prepare(gpu: &Gpu, kind: LowBitKind) -> Result<Self> {
        let prefix = kernel_prefix(kind)?;
        let mut resident = [0u32; 4];
        for (i, r) in resident.iter_mut().enumerate() {
            *r = gpu.resident_blocks(&FAMILY, &format!("{prefix}_nt{}", i + 1), 256)?;
        }
        Ok(Self {
            kind,
            resident,
            prefix,
        })
    }

    /// `y (n rows of ldy f32, the first M of each) = x · Wᵀ` (or `y +=` with `accumulate`),
    /// `x` tokens `first .. first + n` of `acts`.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_ptr(
        &self,
        gpu: &Gpu,
        matrix: &GpuLowBit,
        acts: &Int8Activations,
        first: usize,
        n: usize,
        y: DevPtr,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        let rows = matrix.rows();
        if matrix.kind() != self.kind {
            return Err(CudaError::Option(format!(
                "W4A8 kernels for {} given a {} matrix",
                self.kind.name(),
                matrix.kind().name()
            )));
        }
        if n == 0 || n > MAX_TOKENS || first + n > acts.tokens {
            return Err(CudaError::Option(format!(
                "W4A8 kernels take 1..={MAX_TOKENS} of the {} tokens quantized, got {n} from {first}",
                acts.tokens
            )));
        }
        if acts.ldx != matrix.padded_cols() || ldy < rows {
            return Err(CudaError::Option(format!(
                "W4A8 on a {rows} x {} matrix: activations of {} columns (needs {}), output rows of {ldy}",
                matrix.cols(),
                acts.ldx,
                matrix.padded_cols()
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        let nt = n.div_ceil(8);
        let f = gpu.function(&FAMILY, &format!("{}_nt{nt}", self.prefix))?;
        let (weights, scales, chunks, tiles) = matrix.layout_parts();
        let cfg = LaunchConfig {
            grid_dim: ((tiles as u32).min(self.resident[nt - 1].max(1)), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (codes, xscale) = (acts.codes_at(gpu, first), acts.scale_at(gpu, first));
        let (ldx, ldy, m, n, chunks, acc) = (
            acts.ldx as i32,
            ldy as i32,
            rows as i32,
            n as i32,
            chunks as i32,
            accumulate as i32,
        );
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(weights)
            .arg(scales)
            .arg(&codes)
            .arg(&xscale)
            .arg(&ldx)
            .arg(&y)
            .arg(&ldy)
            .arg(&m)
            .arg(&n)
            .arg(&chunks)
            .arg(&acc);
        unsafe { b.launch(cfg) }.during("launching a W4A8 GEMV")?;
        Ok(())
    }
}

/// A 4-bit matrix on the device with its W4A8 kernels.
pub struct GpuW4A8 {
    matrix: GpuLowBit,
    kernels: W4A8,
}

impl GpuW4A8 {
    pub fn upload(gpu: &Gpu, m: &LowBitMatrix) -> Result<Self> {
        let kernels = W4A8::prepare(gpu, m.kind())?;
        Ok(Self {
            matrix: GpuLowBit::upload(gpu, m)?,
            kernels,
        })
    }

    /// The same bytes as the W4A16 kernel reads them (f16 activations).
    pub fn matrix(&self) -> &GpuLowBit {
        &self.matrix
    }

    /// `y (n rows of ldy f32) = x · Wᵀ` (or `y +=`), `x` the first `n` tokens of `acts`.
    pub fn launch_ptr(
        &self,
        gpu: &Gpu,
        acts: &Int8Activations,
        n: usize,
        y: DevPtr,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.kernels
            .launch_ptr(gpu, &self.matrix, acts, 0, n, y, ldy, accumulate)
    }

    /// [`Self::launch_ptr`] on a buffer of `n x M` f32.
    pub fn launch(
        &self,
        gpu: &Gpu,
        acts: &Int8Activations,
        n: usize,
        y: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> Result<()> {
        crate::dense::check_len("W4A8 y (n x M)", n * self.matrix.rows(), y.len())?;
        let yp = dev_ptr(gpu, y);
        self.launch_ptr(gpu, acts, n, yp, self.matrix.rows(), accumulate)
    }
}

/// The kernel's `w4a8_frag`: the four s8 A registers of k tiles 2i, 2i + 1 from their 4-bit
/// words (rows g, g + 8, g, g + 8; each byte 16 (u - 8)). Here for the emulation tests.
#[cfg(test)]
fn a_registers(w0: u32, w1: u32) -> [u32; 4] {
    [
        ((w0 << 4) & 0xf0f0_f0f0) ^ 0x8080_8080,
        (w0 & 0xf0f0_f0f0) ^ 0x8080_8080,
        ((w1 << 4) & 0xf0f0_f0f0) ^ 0x8080_8080,
        (w1 & 0xf0f0_f0f0) ^ 0x8080_8080,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sieve_formats::random::{activations, sparse_matrix, Pattern};

    #[test]
    fn stored_positions_swap_the_middle_two_of_four() {
        let got: Vec<usize> = (0..8).map(stored_position).collect();
        assert_eq!(got, vec![0, 2, 1, 3, 4, 6, 5, 7]);
    }

    #[test]
    fn only_the_symmetric_four_bit_kinds_have_kernels() {
        for kind in LowBitKind::ALL {
            let want = matches!(kind, LowBitKind::W4G128 | LowBitKind::W4G32);
            assert_eq!(supports(kind), want, "{kind:?}");
            assert_eq!(kernel_prefix(kind).is_ok(), want, "{kind:?}");
        }
        let w = sparse_matrix(4, 64, 0.0, Pattern::Unstructured, 3).unwrap();
        let m = LowBitMatrix::quantize(&w, LowBitKind::W8Row);
        assert!(reference(&m, &[0.0; 64], 1, None).is_err());
        let m = LowBitMatrix::quantize(&w, LowBitKind::W4G32);
        assert!(reference(&m, &[0.0; 63], 1, None).is_err());
    }

    /// The kernel's data path run on the CPU, lane by lane, from the device layout the GPU
    /// reads: each lane's A registers made by [`a_registers`] (the kernel's `w4a8_frag`), its B
    /// registers loaded from the quantized row in the stored byte order at the kernel's offsets
    /// (P = 4 for g128: one 16-byte load; P = 2 for g32: two 8-byte loads), the m16n8k32 mma
    /// assembled from the PTX fragment layout, group sums scaled by the layout's f16 scale
    /// pairs times the token's scale of their 128 columns, then / 16. Catches a wrong nibble, byte order, offset or
    /// scale index without a GPU.
    fn emulate(m: &LowBitMatrix, x: &[f32], n: usize) -> Vec<f64> {
        let l = m.device_layout();
        let (rows, cols) = (m.rows(), m.cols());
        let group = m.kind().group();
        let p = (group / 16).min(4);
        let tiles = l.padded_rows / 16;
        let groups = l.chunks * 64 / group;
        let acts = quantize_reference(x, n, cols, None);
        // Each token's row as the device stores it.
        let x8: Vec<Vec<u8>> = acts
            .iter()
            .map(|a| {
                let mut row = vec![0u8; l.padded_cols];
                for (col, &q) in a.codes.iter().enumerate() {
                    row[stored_position(col)] = q as u8;
                }
                row
            })
            .collect();
        let word = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let byte = |w: u32, i: usize| ((w >> (8 * i)) & 0xff) as u8 as i8 as i64;
        let mut y = vec![0f64; n * rows];
        for rt in 0..tiles {
            let mut acc = vec![[0f64; 16]; n];
            for kc in 0..l.chunks {
                // D of the chunk's two mmas, by (mma, row in tile, token).
                let mut d = [[[0i64; 32]; 16]; 2];
                for lane in 0..32 {
                    let (g, c) = (lane / 4, lane % 4);
                    let base = ((rt * l.chunks + kc) * 32 + lane) * 16;
                    let words: Vec<u32> = (0..4).map(|j| word(&l.weights, base + 4 * j)).collect();
                    for h in 0..2 {
                        let a = a_registers(words[2 * h], words[2 * h + 1]);
                        // A[row][k] from this lane's registers (PTX m16n8k32 .s8 layout).
                        for i in 0..4 {
                            let ka = [4 * c + i, 4 * c + i, 16 + 4 * c + i, 16 + 4 * c + i];
                            let ra = [g, g + 8, g, g + 8];
                            for reg in 0..4 {
                                let av = byte(a[reg], i);
                                // B[k][token] held by the lanes of group g' = token % 8: the
                                // same k slots in every lane group c, so walk every token.
                                for t in 0..n {
                                    let at = kc * 64 + 4 * p * c;
                                    let bw = if p == 4 {
                                        word(&x8[t], at + 4 * (2 * h + ka[reg] / 16))
                                    } else {
                                        word(&x8[t], at + 32 * h + 4 * (ka[reg] / 16))
                                    };
                                    d[h][ra[reg]][t] += av * byte(bw, i);
                                }
                            }
                        }
                    }
                }
                // Each mma's exact integer sums times its group's scale and the token's scale of
                // its 128 columns (the kernel scales once per group, after 4 mmas for g128: the
                // same sum, the integers being exact).
                for h in 0..2 {
                    let col = kc * 64 + 32 * h;
                    let grp = col / group;
                    for r in 0..16 {
                        let pair = l.group_scales[(rt * groups + grp) * 8 + r % 8];
                        let bits = if r < 8 { pair & 0xffff } else { pair >> 16 };
                        let sc = half::f16::from_bits(bits as u16).to_f64();
                        for (t, a) in acc.iter_mut().enumerate() {
                            // Columns past K are zero codes: any scale will do.
                            let xs = acts[t].scales.get(col / 128).copied().unwrap_or(0.0);
                            a[r] += sc * xs as f64 * d[h][r][t] as f64;
                        }
                    }
                }
            }
            for (t, a) in acc.iter().enumerate() {
                for r in 0..16 {
                    let row = rt * 16 + r;
                    if row < rows {
                        y[t * rows + row] = a[r] / 16.0;
                    }
                }
            }
        }
        y
    }

    #[test]
    fn the_kernels_data_path_emulated_on_the_layout_is_the_reference() {
        for kind in [LowBitKind::W4G128, LowBitKind::W4G32] {
            for (si, &(rows, cols)) in [(1, 1), (7, 5), (17, 130), (33, 200), (20, 300)]
                .iter()
                .enumerate()
            {
                let w =
                    sparse_matrix(rows, cols, 0.0, Pattern::Unstructured, 50 + si as u64).unwrap();
                let m = LowBitMatrix::quantize(&w, kind);
                let n = 1 + si % 3;
                let x = activations(n * cols, 9 + si as u64);
                let want = reference(&m, &x, n, None).unwrap();
                let got = emulate(&m, &x, n);
                let scale = want.iter().fold(1e-9f64, |a, v| a.max(v.abs()));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-9 * scale,
                        "{kind:?} {rows}x{cols} n {n} output {i}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_registers_are_sixteen_times_the_signed_values() {
        // Word of k tile j: row g's elements at bits 0, 8, 16, 24 (e0, e4, e1, e5), row g + 8's
        // at bits 4, 12, 20, 28.
        let mut w = 0u32;
        let row_g = [0u32, 15, 8, 7];
        let row_g8 = [1u32, 9, 14, 3];
        for i in 0..4 {
            w |= row_g[i] << (8 * i);
            w |= row_g8[i] << (8 * i + 4);
        }
        let a = a_registers(w, 0);
        for i in 0..4 {
            assert_eq!(
                ((a[0] >> (8 * i)) & 0xff) as u8 as i8 as i32,
                16 * (row_g[i] as i32 - 8)
            );
            assert_eq!(
                ((a[1] >> (8 * i)) & 0xff) as u8 as i8 as i32,
                16 * (row_g8[i] as i32 - 8)
            );
            // Word 1 is all zero nibbles: u = 0, value -8.
            assert_eq!(((a[2] >> (8 * i)) & 0xff) as u8 as i8 as i32, -128);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// The W4A8 reference is the W4A16 product of the dequantized activations (exact in f64
        /// up to rounding), and within the activations' rounding of the unquantized product:
        /// |Δy| <= Σ_k |w[r][k]| · s(k) / 2 per token (s(k) its scale of column k), an
        /// independent bound.
        #[test]
        fn reference_is_the_product_of_the_quantized_activations(
            rows in 1usize..20, cols in 1usize..300, n in 1usize..4, seed in 0u64..1000,
            dp in prop_oneof![Just(None), Just(Some(0.5f32))],
        ) {
            let w = sparse_matrix(rows, cols, 0.0, Pattern::Unstructured, seed).unwrap();
            for kind in [LowBitKind::W4G128, LowBitKind::W4G32] {
                let m = LowBitMatrix::quantize(&w, kind);
                let x = activations(n * cols, seed ^ 5);
                let got = reference(&m, &x, n, dp).unwrap();
                let acts = quantize_reference(&x, n, cols, dp);
                let wq = m.dequantize();
                for t in 0..n {
                    let xq = acts[t].dequantize();
                    for r in 0..rows {
                        let wr = &wq[r * cols..(r + 1) * cols];
                        let exact: f64 = wr.iter().zip(&xq).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let y = got[t * rows + r];
                        prop_assert!((y - exact).abs() <= 1e-4 * (1.0 + exact.abs()), "{kind:?}: {y} vs {exact}");
                        // Against the masked f32 activations, unquantized.
                        let masked: f64 = wr.iter().zip(&x[t * cols..(t + 1) * cols])
                            .map(|(&a, &b)| {
                                let b = if dp.is_some_and(|th| b.abs() <= th) { 0.0 } else { b };
                                a as f64 * b as f64
                            })
                            .sum();
                        let bound: f64 = wr.iter().enumerate()
                            .map(|(k, a)| a.abs() as f64 * acts[t].scale_of(k) as f64 / 2.0)
                            .sum();
                        prop_assert!((y - masked).abs() <= bound * (1.0 + 1e-5) + 1e-6,
                            "{kind:?}: {y} vs unquantized {masked}, bound {bound}");
                    }
                }
            }
        }
    }
}
