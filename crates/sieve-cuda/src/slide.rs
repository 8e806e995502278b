//! SlideSparse (2N-2):2N weights on the 2:4 sparse tensor cores: `kernels/slide_spmm.cu` lifts
//! the activations (`slide_lift_rows`, TEAL mask and f16 rounding fused in) and multiplies them
//! by the expanded 2:4 matrix W' with `mma.sp` m16n8k32 (read its header for the device layout
//! and the thread mapping).
//!
//! [`SlideDevice`] is the CPU side: the re-layout of an encoded
//! [`sieve_formats::slide::Slide`] into mma.sp fragment order, done once on upload, and its
//! inverse ([`SlideDevice::read_back`]) for the test that the re-layout loses nothing.
//! [`reference`] is the product the GPU must match: W (the format's decode, not its lifting) times
//! the masked activations rounded to f16, in f64, with the sums of |w·x| an error bound needs.

use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{grid_cfg, grid_stride, i32_arg, Gpu, KernelFamily};
use crate::product::{threshold_arg, DevPtr};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::f16;
use rayon::prelude::*;
use sieve_formats::format::{check_threshold, is_active};
use sieve_formats::slide::{Slide, LIFT_PAD};
use sieve_formats::{Threshold, WeightFormat};

pub const FAMILY: KernelFamily = KernelFamily {
    name: "slide_spmm",
    source: include_str!("../kernels/slide_spmm.cu"),
};

/// Rows of one mma fragment (a row tile).
pub const ROW_TILE: usize = 16;
/// Rows of one warp (two row tiles); the device rows are padded to a multiple of it.
pub const WARP_ROWS: usize = 32;
/// Lifted columns of one mma (its K).
pub const FRAGMENT_K: usize = 32;
/// Lifted columns of one K pair (two fragments, one metadata word per lane).
pub const PAIR_K: usize = 64;
/// Lifted columns per pipeline stage, the kernel's K tile: K' is padded to a multiple of it.
pub const STAGE_K: usize = 128;
/// Warps per block (along M).
const WARPS: usize = 4;
/// Fewest tokens for which a prompt pass multiplies a slide matrix by cuBLAS on an f16 copy
/// ([`GpuSlide::decode_rows_f16`]) instead of `mma.sp`. Measured both ways in one run (H100,
/// 2026-12-06 window L1, `bench gemm --precision f16,slide-f16,slide-f16-copy --pattern 6:8`,
/// the copy's zeroing and write timed with its GEMM): at 256 tokens mma.sp takes 81 / 148 / 176
/// µs on the 7B's 4096², 11008 x 4096 and 4096 x 11008 against the copy's 110 / 302 / 317; at
/// 512 they tie (139 / 269 / 362 against 116 / 323 / 328, 770 µs summed each); at 2,048 the
/// copy is 2x faster. The copy costs ~300 µs at 11008 x 4096 whatever N up to 512.
pub const DECODE_MIN_TOKENS: usize = 512;
/// Rows per block.
pub const BLOCK_ROWS: usize = WARPS * WARP_ROWS;
/// Fewest pipeline stages a split-K part gets (its pipeline fill is paid per part).
const MIN_STAGES_PER_SPLIT: usize = 4;
/// Metadata nibble of a padding group: indices (0, 1) under +0 values (the all-zero nibble is
/// not a valid mma.sp index pair).
const PAD_NIBBLE: u32 = 0x4;
/// Token-tile variants: 8 · nt tokens per block.
const TOKEN_VARIANTS: [usize; 4] = [1, 2, 4, 8];

/// Stored offset, within a 32-column window of the device's lifted rows, of lifted offset `k`
/// (0..32): the window's 16 column pairs transposed 4 x 4 so that lane t's four B registers are
/// adjacent (the .cu header draws it).
pub fn stored_offset(k: usize) -> usize {
    let (pair, e) = (k / 2, k % 2);
    let (t, j) = (pair % 4, pair / 4);
    8 * t + 2 * j + e
}

/// The shape of a [`Slide`] matrix as the kernels see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Geometry {
    rows: usize,
    cols: usize,
    /// K', the lifted length.
    expanded_cols: usize,
    /// K'p: K' padded to [`STAGE_K`], the device's lifted row length.
    padded_expanded_cols: usize,
    groups_per_row: usize,
    /// Row tiles of 16, rows padded to [`WARP_ROWS`].
    row_tiles: usize,
    /// K pairs (64 lifted columns) per row: K'p / 64.
    kpairs: usize,
}

impl Geometry {
    fn new(s: &Slide) -> Result<Self> {
        let g = s.geometry();
        let (rows, cols) = (s.rows(), s.cols());
        let padded_expanded_cols = g.expanded_cols.next_multiple_of(STAGE_K);
        let row_tiles = rows.next_multiple_of(WARP_ROWS) / ROW_TILE;
        // The kernels index with 32-bit ints: rows, K'p, and a row's offset in the lifted rows.
        if rows > i32::MAX as usize - WARP_ROWS || padded_expanded_cols > i32::MAX as usize {
            return Err(CudaError::Unsupported(format!(
                "slide matrix {rows} x {cols} (lifted {padded_expanded_cols}) exceeds the \
                 kernels' 32-bit dimensions"
            )));
        }
        Ok(Self {
            rows,
            cols,
            expanded_cols: g.expanded_cols,
            padded_expanded_cols,
            groups_per_row: g.groups_per_row,
            row_tiles,
            kpairs: padded_expanded_cols / PAIR_K,
        })
    }

    /// K pipeline stages per row.
    fn stages(&self) -> usize {
        self.padded_expanded_cols / STAGE_K
    }
}

/// Where device value register `reg` (0..4) of lane `lane` of fragment `frag` of K pair `kpair`
/// of row tile `rt` reads: (row, lifted group). The .cu header's a0..a3.
fn value_source(rt: usize, kpair: usize, frag: usize, lane: usize, reg: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    let row = rt * ROW_TILE + g + 8 * (reg & 1);
    let group = 16 * kpair + 8 * frag + t + 4 * (reg >> 1);
    (row, group)
}

/// Where nibble `c` (0..8) of lane `lane`'s metadata word of K pair `kpair` of row tile `rt`
/// reads: (row, lifted group). Nibbles 0..4 are row g, 4..8 row g + 8.
fn meta_source(rt: usize, kpair: usize, lane: usize, nibble: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    let (frag, half) = (t / 2, t % 2);
    let row = rt * ROW_TILE + g + 8 * (nibble / 4);
    let group = 16 * kpair + 8 * frag + 4 * half + nibble % 4;
    (row, group)
}

/// A [`Slide`] matrix in the device layout of `slide_spmm.cu`.
#[derive(Clone, Debug, PartialEq)]
pub struct SlideDevice {
    geo: Geometry,
    /// `[row tile][K pair][fragment][lane]` x 4 words (the mma A registers), f16 pairs.
    values: Vec<u32>,
    /// `[row tile][K pair][lane]` metadata words.
    meta: Vec<u32>,
    /// The lift map (length K'), [`LIFT_PAD`] where a lifted column reads K-padding.
    lift_map: Vec<u32>,
}

/// [`SlideDevice::read_back`]: the device layout mapped back to the format's own order.
#[derive(Clone, Debug, PartialEq)]
pub struct ReadBack {
    /// Row-major, two per group, like [`Slide::values`].
    pub values: Vec<f16>,
    /// Row-major packed nibbles, like [`Slide::metadata`].
    pub metadata: Vec<u32>,
    /// Device slots that map to a real (row, group) more or fewer times than once.
    pub miscounted: usize,
    /// Padding slots that hold anything but +0 values under nibble 0x4.
    pub dirty_padding: usize,
}

impl SlideDevice {
    /// The re-layout of `s` into mma.sp fragment order.
    pub fn new(s: &Slide) -> Result<Self> {
        let geo = Geometry::new(s)?;
        let vals = s.values();
        let value_at = |row: usize, group: usize| -> u32 {
            if row >= geo.rows || group >= geo.groups_per_row {
                return 0;
            }
            let i = (row * geo.groups_per_row + group) * 2;
            vals[i].to_bits() as u32 | ((vals[i + 1].to_bits() as u32) << 16)
        };
        let nibble_at = |row: usize, group: usize| -> u32 {
            if row >= geo.rows || group >= geo.groups_per_row {
                return PAD_NIBBLE;
            }
            s.nibble(row, group) as u32
        };
        let per_tile_values = geo.kpairs * 2 * 32 * 4;
        let mut values = vec![0u32; geo.row_tiles * per_tile_values];
        values
            .par_chunks_mut(per_tile_values)
            .enumerate()
            .for_each(|(rt, out)| {
                for (i, word) in out.iter_mut().enumerate() {
                    let (reg, lane, frag, kpair) = (i % 4, (i / 4) % 32, (i / 128) % 2, i / 256);
                    let (row, group) = value_source(rt, kpair, frag, lane, reg);
                    *word = value_at(row, group);
                }
            });
        let per_tile_meta = geo.kpairs * 32;
        let mut meta = vec![0u32; geo.row_tiles * per_tile_meta];
        meta.par_chunks_mut(per_tile_meta)
            .enumerate()
            .for_each(|(rt, out)| {
                for (i, word) in out.iter_mut().enumerate() {
                    let (lane, kpair) = (i % 32, i / 32);
                    *word = (0..8)
                        .map(|c| {
                            let (row, group) = meta_source(rt, kpair, lane, c);
                            nibble_at(row, group) << (4 * c)
                        })
                        .fold(0, |a, b| a | b);
                }
            });
        Ok(Self {
            geo,
            values,
            meta,
            lift_map: s.lift_map(),
        })
    }

    /// Device bytes of the weights (values and metadata; the lift map besides).
    pub fn device_bytes(&self) -> usize {
        4 * (self.values.len() + self.meta.len())
    }

    /// The device layout read back into the format's row-major order, every device slot visited
    /// once: with `values`/`metadata` equal to the format's and nothing miscounted or dirty, the
    /// re-layout is a permutation (plus clean padding) that loses nothing.
    pub fn read_back(&self) -> ReadBack {
        let geo = &self.geo;
        let meta_words_per_row = geo.groups_per_row.div_ceil(8);
        let mut values = vec![f16::ZERO; geo.rows * geo.groups_per_row * 2];
        let mut metadata = vec![0u32; geo.rows * meta_words_per_row];
        let mut value_hits = vec![0u8; geo.rows * geo.groups_per_row];
        let mut meta_hits = vec![0u8; geo.rows * geo.groups_per_row];
        let mut dirty_padding = 0;
        let real = |row: usize, group: usize| row < geo.rows && group < geo.groups_per_row;
        for (i, &word) in self.values.iter().enumerate() {
            let (reg, lane, frag) = (i % 4, (i / 4) % 32, (i / 128) % 2);
            let (kpair, rt) = ((i / 256) % geo.kpairs, i / (256 * geo.kpairs));
            let (row, group) = value_source(rt, kpair, frag, lane, reg);
            if real(row, group) {
                let at = row * geo.groups_per_row + group;
                values[2 * at] = f16::from_bits(word as u16);
                values[2 * at + 1] = f16::from_bits((word >> 16) as u16);
                value_hits[at] = value_hits[at].saturating_add(1);
            } else if word != 0 {
                dirty_padding += 1;
            }
        }
        for (i, &word) in self.meta.iter().enumerate() {
            let (lane, kpair, rt) = (i % 32, (i / 32) % geo.kpairs, i / (32 * geo.kpairs));
            for c in 0..8 {
                let nibble = (word >> (4 * c)) & 0xF;
                let (row, group) = meta_source(rt, kpair, lane, c);
                if real(row, group) {
                    metadata[row * meta_words_per_row + group / 8] |= nibble << (4 * (group % 8));
                    let at = row * geo.groups_per_row + group;
                    meta_hits[at] = meta_hits[at].saturating_add(1);
                } else if nibble != PAD_NIBBLE {
                    dirty_padding += 1;
                }
            }
        }
        let miscounted = value_hits
            .iter()
            .chain(&meta_hits)
            .filter(|&&h| h != 1)
            .count();
        ReadBack {
            values,
            metadata,
            miscounted,
            dirty_padding,
        }
    }

    /// What `slide_to_f16_rows` writes, on the CPU, thread by thread: the original W (`rows` x
    /// K, rows `ld` apart, zero where no kept value lands) from the device layout. Tests hold
    /// it equal to the format's own decode, so that the kernel's index arithmetic (the same
    /// lines) is checked without a GPU.
    pub fn decode_rows(&self, ld: usize) -> Result<Vec<f16>> {
        let geo = &self.geo;
        check_stride("decoded W", ld, "K", geo.cols)?;
        let mut out = vec![f16::ZERO; geo.rows * ld];
        for q in 0..self.values.len() / 4 {
            let (lane, frag) = (q % 32, (q / 32) % 2);
            let tile_pair = q / 64;
            let (kp, rt) = (tile_pair % geo.kpairs, tile_pair / geo.kpairs);
            let (g, t) = (lane / 4, lane % 4);
            for reg in 0..4 {
                let row = rt * ROW_TILE + g + 8 * (reg & 1);
                let group = 16 * kp + 8 * frag + t + 4 * (reg >> 1);
                if row >= geo.rows || group >= geo.groups_per_row {
                    continue;
                }
                let word = self.values[4 * q + reg];
                let mw = self.meta[tile_pair * 32 + g * 4 + 2 * frag + (reg >> 1)];
                let nibble = (mw >> (4 * (t + 4 * (reg & 1)))) & 0xF;
                for e in 0..2 {
                    let bits = ((word >> (16 * e)) & 0xFFFF) as u16;
                    if bits == 0 {
                        continue;
                    }
                    let idx = if e == 0 { nibble & 3 } else { nibble >> 2 };
                    let col = self.lift_map[4 * group + idx as usize];
                    if col != LIFT_PAD {
                        out[row * ld + col as usize] = f16::from_bits(bits);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// `lift(mask_t(x))` for `n` rows of `x` (row stride `ldx`) in the device's lifted-row order
/// (rows of K'p f16, each 32-column window stored as [`stored_offset`] says): what
/// `slide_lift_rows` must write, bit for bit.
pub fn lifted_rows_reference(
    s: &Slide,
    x: &[f32],
    ldx: usize,
    n: usize,
    threshold: Threshold,
) -> Vec<f16> {
    let geo = s.geometry();
    let kp = geo.expanded_cols.next_multiple_of(STAGE_K);
    let map = s.lift_map();
    let mut out = vec![f16::ZERO; n * kp];
    for (row, dst) in out.chunks_exact_mut(kp).enumerate() {
        for (k, &src) in map.iter().enumerate() {
            if src == LIFT_PAD {
                continue;
            }
            let v = x[row * ldx + src as usize];
            let masked = if is_active(v, threshold) { v } else { 0.0 };
            dst[k / FRAGMENT_K * FRAGMENT_K + stored_offset(k % FRAGMENT_K)] =
                f16::from_f32(masked);
        }
    }
    out
}

/// The product a launch must match, per output `[token][row]` (n x M, row-major): `y = W ·
/// f16(mask_t(x))` in f64 from the format's decode of W, and `Σ |w · x|` over the same terms (the
/// scale of any summation error). `x` holds `n` rows, `ldx` apart.
pub fn reference(
    s: &Slide,
    x: &[f32],
    ldx: usize,
    n: usize,
    threshold: Threshold,
) -> (Vec<f64>, Vec<f64>) {
    let w = s.decode();
    let (m, k) = (s.rows(), s.cols());
    let xs: Vec<f64> = (0..n)
        .flat_map(|t| {
            x[t * ldx..t * ldx + k].iter().map(move |&v| {
                let masked = if is_active(v, threshold) { v } else { 0.0 };
                f16::from_f32(masked).to_f64()
            })
        })
        .collect();
    // Per row: the products of every token (parallel over rows), transposed at the end.
    let per_row: Vec<Vec<(f64, f64)>> = (0..m)
        .into_par_iter()
        .map(|r| {
            let nz: Vec<(usize, f64)> = w
                .row(r)
                .iter()
                .enumerate()
                .filter(|(_, v)| v.to_f32() != 0.0)
                .map(|(c, v)| (c, v.to_f64()))
                .collect();
            (0..n)
                .map(|t| {
                    let xt = &xs[t * k..(t + 1) * k];
                    nz.iter().fold((0.0, 0.0), |(y, a), &(c, wv)| {
                        (y + wv * xt[c], a + (wv * xt[c]).abs())
                    })
                })
                .collect()
        })
        .collect();
    let mut y = vec![0f64; n * m];
    let mut abs = vec![0f64; n * m];
    for (r, outs) in per_row.iter().enumerate() {
        for (t, &(v, a)) in outs.iter().enumerate() {
            y[t * m + r] = v;
            abs[t * m + r] = a;
        }
    }
    (y, abs)
}

/// 8-bit values of the tensor cores' integer and FP8 paths (`mma.sp` with s8 or e4m3 operands).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eight {
    Int8,
    E4m3,
}

/// The product an 8-bit slide launch must match (issue 29's INT8 and FP8 paths; their kernels
/// are not written yet): W quantized per row and each token's masked input per token, both by
/// [`sieve_formats::eight_bit`] (INT8: `s = max / 127`, ties to even; e4m3: `s = max / 448`,
/// saturating), then `y[t][r] = s_w[r] · s_x[t] · Σ q_w q_x` in f64. The lifting copies values,
/// so quantizing the original row equals quantizing the lifted one. Output `[token][row]`.
pub fn eight_bit_reference(
    s: &Slide,
    x: &[f32],
    ldx: usize,
    n: usize,
    threshold: Threshold,
    eight: Eight,
) -> Vec<f64> {
    use sieve_formats::eight_bit::{e4m3_row, e4m3_to_f32, int8_row};
    let w = s.decode();
    let (m, k) = (s.rows(), s.cols());
    // (codes as f64, scale) of a row of values.
    let quantize = |v: &[f32]| -> (Vec<f64>, f64) {
        match eight {
            Eight::Int8 => {
                let q = int8_row(v);
                (
                    q.codes.iter().map(|&c| f64::from(c)).collect(),
                    f64::from(q.scale),
                )
            }
            Eight::E4m3 => {
                let q = e4m3_row(v);
                let codes = q.codes.iter().map(|&c| f64::from(e4m3_to_f32(c))).collect();
                (codes, f64::from(q.scale))
            }
        }
    };
    let tokens: Vec<(Vec<f64>, f64)> = (0..n)
        .map(|t| {
            let masked: Vec<f32> = x[t * ldx..t * ldx + k]
                .iter()
                .map(|&v| if is_active(v, threshold) { v } else { 0.0 })
                .collect();
            quantize(&masked)
        })
        .collect();
    let per_row: Vec<Vec<f64>> = (0..m)
        .into_par_iter()
        .map(|r| {
            let row: Vec<f32> = w.row(r).iter().map(|v| v.to_f32()).collect();
            let (qw, sw) = quantize(&row);
            tokens
                .iter()
                .map(|(qx, sx)| {
                    let dot: f64 = qw.iter().zip(qx).map(|(a, b)| a * b).sum();
                    sw * sx * dot
                })
                .collect()
        })
        .collect();
    let mut y = vec![0f64; n * m];
    for (r, outs) in per_row.iter().enumerate() {
        for (t, &v) in outs.iter().enumerate() {
            y[t * m + r] = v;
        }
    }
    y
}

/// Worst-case error of an f32 sum of `terms` exact products (f16 · f16 is exact in f32) whose
/// absolute values add up to `abs_sum`: γ_terms · abs_sum with unit roundoff 2^-23, twice f32's
/// round-to-nearest 2^-24 so that tensor-core adders that truncate are covered too (Higham,
/// Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 4.4).
pub fn f32_sum_error_bound(terms: usize, abs_sum: f64) -> f64 {
    let u = f64::powi(2.0, -23);
    let nu = terms as f64 * u;
    nu / (1.0 - nu) * abs_sum
}

/// A [`SlideDevice`] on the GPU with its kernels.
pub struct GpuSlide {
    geo: Geometry,
    device_bytes: usize,
    values: CudaSlice<u32>,
    meta: CudaSlice<u32>,
    lift_map: CudaSlice<u32>,
    /// Blocks of each token variant resident at once on the GPU, asked at upload (never first
    /// inside a graph capture).
    resident: [usize; TOKEN_VARIANTS.len()],
    /// K splits of a launch (0: chosen from the shape and the device). Above 1 the parts add
    /// into y with atomics (after a zeroing kernel when the launch writes).
    pub split_k: usize,
}

/// The token variant (index into [`TOKEN_VARIANTS`]) for `n` tokens.
fn variant(n: usize) -> usize {
    match n {
        0..=8 => 0,
        9..=16 => 1,
        17..=32 => 2,
        _ => 3,
    }
}

impl GpuSlide {
    pub fn upload(gpu: &Gpu, s: &Slide) -> Result<Self> {
        Self::upload_device(gpu, &SlideDevice::new(s)?)
    }

    pub fn upload_device(gpu: &Gpu, d: &SlideDevice) -> Result<Self> {
        // Look every kernel up now: loading a module inside a graph capture invalidates it.
        gpu.function(&FAMILY, "slide_lift_rows")?;
        gpu.function(&FAMILY, "slide_to_f16_rows")?;
        crate::prefill::zero_rows_ready(gpu)?;
        let mut resident = [0usize; TOKEN_VARIANTS.len()];
        for (r, nt) in resident.iter_mut().zip(TOKEN_VARIANTS) {
            *r = gpu.resident_blocks(&FAMILY, &format!("slide_spmm_nt{nt}"), 32 * WARPS as u32)?
                as usize;
        }
        Ok(Self {
            geo: d.geo,
            device_bytes: d.device_bytes(),
            values: gpu.upload(&d.values)?,
            meta: gpu.upload(&d.meta)?,
            lift_map: gpu.upload(&d.lift_map)?,
            resident,
            split_k: 0,
        })
    }

    pub fn rows(&self) -> usize {
        self.geo.rows
    }
    pub fn cols(&self) -> usize {
        self.geo.cols
    }
    /// Device bytes of the weights (values and metadata).
    pub fn device_bytes(&self) -> usize {
        self.device_bytes
    }
    /// K'p, the length of one lifted row on the device.
    pub fn lifted_row_len(&self) -> usize {
        self.geo.padded_expanded_cols
    }
    /// f16 elements of the lifted activations of `n` tokens (the scratch [`Self::launch_rows`]
    /// needs).
    pub fn lifted_len(&self, n: usize) -> usize {
        n.saturating_mul(self.geo.padded_expanded_cols)
    }

    /// Writes the original W (f16, `rows` x K, rows `ld` apart, `ld >= K`) at `out`, which
    /// holds at least `rows · ld` f16: zeroed, then `slide_to_f16_rows` (its CPU mirror is
    /// [`SlideDevice::decode_rows`]). For prompts of [`DECODE_MIN_TOKENS`] or more, where cuBLAS
    /// on the copy beats `mma.sp`.
    pub fn decode_rows_f16(&self, gpu: &Gpu, out: DevPtr, ld: usize) -> Result<()> {
        check_stride("decoded W", ld, "K", self.geo.cols)?;
        let f = gpu.function(&FAMILY, "slide_to_f16_rows")?;
        let (rows, groups, kpairs) = (
            i32_arg("rows", self.geo.rows)?,
            i32_arg("groups per row", self.geo.groups_per_row)?,
            i32_arg("K pairs", self.geo.kpairs)?,
        );
        let ld_i = i32_arg("decoded W row stride", ld)?;
        let slots = self.geo.row_tiles * self.geo.kpairs * 64;
        let slots_i = slots as i64;
        // SAFETY: the caller's out holds rows · ld f16 (this function's contract).
        unsafe { gpu.zero_bytes(out, self.geo.rows * ld * 2) }?;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.values)
            .arg(&self.meta)
            .arg(&self.lift_map)
            .arg(&rows)
            .arg(&groups)
            .arg(&kpairs)
            .arg(&slots_i)
            .arg(&ld_i)
            .arg(&out);
        unsafe { b.launch(grid_cfg(grid_stride(slots), 256, 0)) }
            .during("launching slide_to_f16_rows")?;
        Ok(())
    }

    /// The row stride [`Self::decode_rows_f16`] is given by the prompt path: K rounded up to 8
    /// f16 (16 bytes), as cuBLAS's tensor-core GEMMs want their leading dimension.
    pub fn decoded_ld(&self) -> usize {
        self.geo.cols.next_multiple_of(8)
    }

    fn check_tokens(&self, n: usize) -> Result<i32> {
        if n == 0 {
            return Err(CudaError::Option(
                "slide kernels take at least one token".into(),
            ));
        }
        // The lifted rows of all tokens are indexed with 64-bit offsets, but the token count
        // and each row's length are kernel ints.
        i32_arg("tokens", n)
    }

    /// `lifted[i] = lift(f16(mask_t(x[i])))` for `n` rows of `x` (f32, `ldx` apart) into
    /// `lifted` (f16, [`Self::lifted_len`]`(n)`, 16-byte aligned), the device's lifted-row order.
    #[allow(clippy::too_many_arguments)]
    pub fn lift_rows(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        ldx: usize,
        n: usize,
        threshold: Threshold,
        lifted: DevPtr,
    ) -> Result<()> {
        check_threshold(threshold)?;
        let ni = self.check_tokens(n)?;
        check_stride("x", ldx, "K", self.geo.cols)?;
        check_lifted_aligned(lifted)?;
        let f = gpu.function(&FAMILY, "slide_lift_rows")?;
        let l = i32_arg("x row stride", ldx)?;
        let kl = i32_arg("lifted length", self.geo.expanded_cols)?;
        let kp = i32_arg("padded lifted length", self.geo.padded_expanded_cols)?;
        let t = threshold_arg(threshold);
        let chunks = self.lifted_len(n) / 8;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&x)
            .arg(&l)
            .arg(&self.lift_map)
            .arg(&kl)
            .arg(&kp)
            .arg(&lifted)
            .arg(&ni)
            .arg(&t);
        unsafe { b.launch(grid_cfg(grid_stride(chunks), 256, 0)) }
            .during("launching slide_lift_rows")?;
        Ok(())
    }

    /// K splits of a launch for `n` tokens (above 1 the parts add with atomics).
    pub fn k_splits(&self, n: usize) -> Result<usize> {
        Ok(self.splits(n)?.0)
    }

    /// K splits and stages per split of a launch for `n` tokens.
    fn splits(&self, n: usize) -> Result<(usize, usize)> {
        let stages = self.geo.stages();
        let splits = if self.split_k > 0 {
            if self.split_k > stages {
                return Err(CudaError::Option(format!(
                    "slide split_k must be 1..={stages} for K'p = {}, got {}",
                    self.geo.padded_expanded_cols, self.split_k
                )));
            }
            self.split_k
        } else {
            let v = variant(n);
            let blocks = self.geo.row_tiles.div_ceil(BLOCK_ROWS / ROW_TILE)
                * n.div_ceil(8 * TOKEN_VARIANTS[v]);
            let wave = self.resident[v];
            // Split K only while the row and token tiles leave the GPU short of one wave.
            let wanted = wave.div_ceil(blocks.max(1)).max(1);
            wanted.min((stages / MIN_STAGES_PER_SPLIT).max(1))
        };
        let per_split = stages.div_ceil(splits);
        Ok((stages.div_ceil(per_split), per_split))
    }

    /// `Y[i][r] (+)= (W' · lifted[i])[r]` for `n` tokens of lifted activations (from
    /// [`Self::lift_rows`]); `Y` f32 rows `ldy` apart, added to when `accumulate`, else written.
    pub fn spmm_lifted(
        &self,
        gpu: &Gpu,
        lifted: DevPtr,
        n: usize,
        y: DevPtr,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        let ni = self.check_tokens(n)?;
        check_stride("y", ldy, "M", self.geo.rows)?;
        check_lifted_aligned(lifted)?;
        let ldy_i = i32_arg("y row stride", ldy)?;
        let m = i32_arg("rows", self.geo.rows)?;
        let (splits, per_split) = self.splits(n)?;
        if splits > 1 && !accumulate {
            crate::prefill::zero_rows(gpu, y, ldy, n, self.geo.rows)?;
        }
        let mode: i32 = match (splits > 1, accumulate) {
            (true, _) => 2,
            (false, true) => 1,
            (false, false) => 0,
        };
        let nt = TOKEN_VARIANTS[variant(n)];
        let f = gpu.function(&FAMILY, &format!("slide_spmm_nt{nt}"))?;
        let token_tiles = n.div_ceil(8 * nt);
        if token_tiles > 65535 {
            return Err(CudaError::Unsupported(format!(
                "{n} tokens exceed one slide launch's grid"
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (
                self.geo.row_tiles.div_ceil(BLOCK_ROWS / ROW_TILE) as u32,
                token_tiles as u32,
                splits as u32,
            ),
            block_dim: (32 * WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let row_tiles = i32_arg("row tiles", self.geo.row_tiles)?;
        let kpairs = i32_arg("K pairs", self.geo.kpairs)?;
        let per_split = i32_arg("stages per split", per_split)?;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.values)
            .arg(&self.meta)
            .arg(&lifted)
            .arg(&y)
            .arg(&m)
            .arg(&row_tiles)
            .arg(&kpairs)
            .arg(&ni)
            .arg(&ldy_i)
            .arg(&per_split)
            .arg(&mode);
        unsafe { b.launch(cfg) }.during("launching the slide product")?;
        Ok(())
    }

    /// `Y[i][r] (+)= (W · f16(mask_t(X[i])))[r]` for `n` tokens: `X` f32 rows `ldx` apart,
    /// `Y` f32 rows `ldy` apart (added to when `accumulate`, else written), `lifted` a caller-owned
    /// scratch of [`Self::lifted_len`]`(n)` f16 (16-byte aligned). Two launches, lift then
    /// product (three when a split-K launch writes: the zeroing first); nothing allocated, so
    /// the sequence can be captured in a graph.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_rows(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        ldx: usize,
        n: usize,
        threshold: Threshold,
        lifted: DevPtr,
        y: DevPtr,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.lift_rows(gpu, x, ldx, n, threshold, lifted)?;
        self.spmm_lifted(gpu, lifted, n, y, ldy, accumulate)
    }
}

/// Refuses a row stride shorter than the row it must hold.
fn check_stride(what: &str, stride: usize, dim: &str, len: usize) -> Result<()> {
    if stride < len {
        return Err(CudaError::Option(format!(
            "slide {what} row stride {stride} is shorter than {dim} = {len}"
        )));
    }
    Ok(())
}

/// The lifted rows are read in 16-byte vectors.
fn check_lifted_aligned(lifted: DevPtr) -> Result<()> {
    if !lifted.is_multiple_of(16) {
        return Err(CudaError::Option(
            "slide lifted activations must be 16-byte aligned".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sieve_formats::random::{sparse_matrix, Pattern};
    use sieve_formats::slide::SlideOptions;

    /// The 8-bit reference is the f16 one up to the quantization's own error: per term at most
    /// half a step of each operand (INT8: s / 2; e4m3: 1/16 relative, or s 2^-10 near zero), so
    /// |y8 - y| <= Σ (|w| dx + |x| dw + dw dx) over a row, bounded here with the row's and
    /// token's largest magnitudes. Zero rows and quiet tokens give exact zeros.
    #[test]
    fn eight_bit_reference_is_the_product_within_quantization_error() {
        let w = sparse_matrix(37, 96, 0.0, Pattern::NM { n: 6, m: 8 }, 5).unwrap();
        let s = Slide::encode(&w, &SlideOptions { n: 4 }).unwrap();
        let (n, ldx) = (3, 100);
        let mut x: Vec<f32> = (0..n * ldx)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        x[2 * ldx..3 * ldx].iter_mut().for_each(|v| *v = 0.0); // a quiet token
        let (want, _) = reference(&s, &x, ldx, n, None);
        let dense = s.decode();
        for eight in [Eight::Int8, Eight::E4m3] {
            let got = eight_bit_reference(&s, &x, ldx, n, None, eight);
            assert_eq!(got.len(), n * 37);
            for t in 0..n {
                let xt = &x[t * ldx..t * ldx + 96];
                let xmax = xt.iter().fold(0f64, |a, v| a.max(f64::from(v.abs())));
                for r in 0..37 {
                    let row: Vec<f64> = dense.row(r).iter().map(|v| v.to_f64()).collect();
                    let wmax = row.iter().fold(0f64, |a, v| a.max(v.abs()));
                    let (dw, dx) = match eight {
                        Eight::Int8 => (wmax / 254.0, xmax / 254.0),
                        Eight::E4m3 => (wmax / 16.0, xmax / 16.0),
                    };
                    let bound: f64 = row
                        .iter()
                        .zip(xt)
                        .map(|(&a, &b)| a.abs() * dx + f64::from(b.abs()) * dw + dw * dx)
                        .sum();
                    let (g, e) = (got[t * 37 + r], want[t * 37 + r]);
                    assert!(
                        (g - e).abs() <= bound * 1.001 + 1e-12,
                        "{eight:?} t{t} r{r}: {g} vs {e} (bound {bound})"
                    );
                    if t == 2 {
                        assert_eq!(g, 0.0);
                    }
                }
            }
            // Not the f16 product: quantization moved it (the check above is not vacuous).
            assert!(got.iter().zip(&want).any(|(g, e)| g != e), "{eight:?}");
        }
    }

    #[test]
    fn stored_offset_is_a_permutation_of_a_window() {
        let mut seen = [false; FRAGMENT_K];
        for k in 0..FRAGMENT_K {
            let q = stored_offset(k);
            assert!(!seen[q], "offset {q} twice");
            seen[q] = true;
        }
        // Lane t's b_j = pair t + 4j sits at 8t + 2j.
        assert_eq!(stored_offset(2 * (1 + 4 * 3)), 8 + 6);
        assert_eq!(stored_offset(2 * (3 + 4 * 2) + 1), 24 + 4 + 1);
    }

    /// What the kernel computes, emulated on the CPU from the PTX ISA's description of
    /// `mma.sp.m16n8k32` (f16, sparsity selector 0): lane (g, t) holds A registers a0..a3 = the
    /// compressed pairs of (row g, chunk t), (g + 8, t), (g, t + 4), (g + 8, t + 4); B registers
    /// b_j = B[2t + 8j, +1][g]; with selector 0, lane (g, h), h = 0, 1, holds the metadata of
    /// rows g (bits 0..16) and g + 8 (bits 16..32) for chunks 4h .. 4h + 4, a nibble per chunk,
    /// indices idx0 | idx1 << 2 of the low and high halves of that chunk's A pair. The loads are
    /// the kernel's (device values, metadata with the odd fragment's words shuffled down by 2,
    /// lifted rows at the stored offsets), so this checks the device layout against the
    /// instruction without a GPU.
    fn emulate(d: &SlideDevice, lifted: &[f16], n: usize) -> Vec<f32> {
        let geo = &d.geo;
        let kp = geo.padded_expanded_cols;
        let mut y = vec![0f32; n * geo.rows];
        for rt in 0..geo.row_tiles {
            for kpair in 0..geo.kpairs {
                let meta_words: Vec<u32> = (0..32)
                    .map(|lane| d.meta[(rt * geo.kpairs + kpair) * 32 + lane])
                    .collect();
                for frag in 0..2 {
                    // The shuffle: for fragment 1, lane l reads lane l + 2's word (l < 30).
                    let e = |lane: usize| meta_words[if frag == 1 { lane + 2 } else { lane }];
                    let a = |lane: usize, reg: usize| {
                        d.values[((rt * geo.kpairs + kpair) * 2 + frag) * 128 + lane * 4 + reg]
                    };
                    let window = kpair * 2 + frag;
                    for tok in 0..n {
                        // B column `tok % 8`, staged from the lifted rows.
                        let b = |k: usize| -> f32 {
                            let (t, j, half) = ((k % 8) / 2, k / 8, k % 2);
                            lifted[tok * kp + window * 32 + 8 * t + 2 * j + half].to_f32()
                        };
                        for r in 0..ROW_TILE {
                            let row = rt * ROW_TILE + r;
                            let mut acc = 0f32;
                            for chunk in 0..8 {
                                let g = r % 8;
                                let word = e(g * 4 + chunk / 4);
                                let nib = (word >> (4 * (chunk % 4) + 16 * (r / 8))) & 0xF;
                                let pair = a(g * 4 + chunk % 4, (r / 8) + 2 * (chunk / 4));
                                for (s, idx) in [(0, nib & 3), (1, nib >> 2)] {
                                    let v = f16::from_bits((pair >> (16 * s)) as u16).to_f32();
                                    acc += v * b(4 * chunk + idx as usize);
                                }
                            }
                            if row < geo.rows {
                                y[tok * geo.rows + row] += acc;
                            }
                        }
                    }
                }
            }
        }
        y
    }

    #[test]
    fn emulated_mma_sp_matches_the_format() {
        for (m, k, n, tokens) in [
            (40, 300, 4, 3),
            (33, 130, 2, 2),
            (16, 100, 8, 1),
            (7, 9, 3, 2),
        ] {
            let w = sparse_matrix(
                m,
                k,
                0.0,
                Pattern::NM {
                    n: 2 * n - 2,
                    m: 2 * n,
                },
                7,
            )
            .unwrap();
            let s = Slide::encode(&w, &SlideOptions { n }).unwrap();
            let d = SlideDevice::new(&s).unwrap();
            let x = sieve_formats::random::activations(tokens * k, 3);
            let lifted = lifted_rows_reference(&s, &x, k, tokens, None);
            let got = emulate(&d, &lifted, tokens);
            let (want, abs) = reference(&s, &x, k, tokens, None);
            for (i, ((g, w), a)) in got.iter().zip(&want).zip(&abs).enumerate() {
                let bound = f32_sum_error_bound(d.geo.padded_expanded_cols, *a);
                assert!(
                    (*g as f64 - w).abs() <= bound,
                    "{m} x {k} N = {n}: y[{i}] = {g}, expected {w} (bound {bound:e})"
                );
            }
        }
    }

    #[test]
    fn decoded_rows_equal_the_format_s_decode() {
        use sieve_formats::slide::prune_to_pattern;
        use sieve_formats::WeightFormat;
        // Every pattern, rows past a warp and K past a stage, K not a multiple of 2N or of 8;
        // full blocks, and blocks pruned from a 60% sparse matrix (groups with +0 placeholders,
        // which must write nothing), one of them holding a -0 weight (which is written).
        let cases = [
            (40, 300, 4),
            (33, 130, 2),
            (16, 100, 8),
            (7, 9, 3),
            (70, 517, 5),
        ];
        for ((m, k, n), sparse) in cases.into_iter().flat_map(|c| [(c, false), (c, true)]) {
            let w = if sparse {
                let d = sparse_matrix(m, k, 0.6, Pattern::Unstructured, 12).unwrap();
                let mut values: Vec<f32> = d.data().iter().map(|v| v.to_f32()).collect();
                // A -0 where a placeholder's +0 would otherwise be: the first zero of row 0.
                if let Some(z) = values[..k].iter().position(|v| *v == 0.0) {
                    values[z] = -0.0;
                }
                let d = sieve_formats::DenseMatrix::from_f32(m, k, &values).unwrap();
                prune_to_pattern(&d, n).unwrap()
            } else {
                let pattern = Pattern::NM {
                    n: 2 * n - 2,
                    m: 2 * n,
                };
                sparse_matrix(m, k, 0.0, pattern, 11).unwrap()
            };
            let s = Slide::encode(&w, &SlideOptions { n }).unwrap();
            let placeholders = s.values().iter().filter(|v| v.to_bits() == 0).count();
            assert!(
                !sparse || placeholders > 0,
                "{m} x {k} N = {n}: no placeholder"
            );
            let d = SlideDevice::new(&s).unwrap();
            let want = s.decode();
            let ld = k.next_multiple_of(8);
            let got = d.decode_rows(ld).unwrap();
            for r in 0..m {
                for c in 0..ld {
                    let expected = if c < k { want.get(r, c) } else { f16::ZERO };
                    assert_eq!(
                        got[r * ld + c].to_bits(),
                        expected.to_bits(),
                        "{m} x {k} N = {n} (pruned: {sparse}): W[{r}][{c}]"
                    );
                }
            }
        }
        let w = sparse_matrix(8, 20, 0.0, Pattern::NM { n: 6, m: 8 }, 1).unwrap();
        let d = SlideDevice::new(&Slide::encode(&w, &SlideOptions { n: 4 }).unwrap()).unwrap();
        let err = d.decode_rows(19).unwrap_err().to_string();
        assert!(err.contains("shorter than K = 20"), "{err}");
    }

    #[test]
    fn geometry_pads_rows_to_warps_and_k_to_stages() {
        let w = sparse_matrix(33, 100, 0.0, Pattern::NM { n: 6, m: 8 }, 1).unwrap();
        let s = Slide::encode(&w, &SlideOptions { n: 4 }).unwrap();
        let d = SlideDevice::new(&s).unwrap();
        // 100 columns: 13 blocks of 8, 39 groups, K' = 156 -> 256.
        assert_eq!(d.geo.expanded_cols, 156);
        assert_eq!(d.geo.padded_expanded_cols, 256);
        assert_eq!(d.geo.row_tiles, 4);
        assert_eq!(d.geo.kpairs, 4);
        assert_eq!(d.values.len(), 4 * 4 * 2 * 32 * 4);
        assert_eq!(d.meta.len(), 4 * 4 * 32);
    }
}
