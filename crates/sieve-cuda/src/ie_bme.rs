//! IE-BME (UnionSparse's union bitmaps, seed 003) with INT4 / INT8 values on the GPU:
//! `kernels/ie_bme_spmm.cu` multiplies N = 1..32 tokens on the tensor cores, decoding the union
//! bitmaps straight into mma fragments (read its header for the layout and thread mapping).
//!
//! [`IeBmeDevice`] is the CPU side: the device layout built from an encoded
//! [`sieve_formats::ie_bme::IeBme`] (its bitmaps, ranks, permutations and scales unchanged; the
//! Q area streams of a tile interleaved into one tuple per union position, the same bytes). The
//! reference a kernel must match is the format's own product (`WeightFormat::matvec`) on the same
//! activations rounded to f16 (the kernel's B operand).

use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{Gpu, KernelFamily};
use crate::product::{check_io, threshold_arg, DevPtr, GpuAccumulate, GpuMatVec, LaunchEpoch};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use sieve_formats::ie_bme::{
    IeBme, IeBmeOptions, Payload, Reorder, ValuesRef, TILE_COLS, TILE_ROWS,
};
use sieve_formats::{DenseMatrix, Threshold, WeightFormat};

pub const FAMILY: KernelFamily = KernelFamily {
    name: "ie_bme_spmm",
    source: include_str!("../kernels/ie_bme_spmm.cu"),
};

/// Tokens one launch takes (four 8-token mma column tiles).
pub const MAX_TOKENS: usize = 32;
/// Tile rows per block (one warp each).
const WARPS: usize = 8;
/// Largest K chunk of a block, in tiles, for `n` tokens (its shared-memory staging of X holds
/// 8 · T token rows of 32 / T tiles, T = [`token_tiles`]`(n)`: 1, 2 or 4).
fn max_chunk(n: usize) -> usize {
    32 / token_tiles(n)
}

/// 8-token mma column tiles of a launch for `n` tokens (1, 2 or 4).
fn token_tiles(n: usize) -> usize {
    match n {
        0..=8 => 1,
        9..=16 => 2,
        _ => 4,
    }
}

/// The payloads [`encode_exact`] tries, in order.
pub const INT4_PAYLOADS: [Payload; 2] = [
    Payload::Int4 { group_size: 128 },
    Payload::Int4 { group_size: 64 },
];

fn options(payload: Payload, reorder: Reorder) -> IeBmeOptions {
    IeBmeOptions {
        payload,
        reorder,
        ..IeBmeOptions::default()
    }
}

/// `m` encoded in IE-BME (2 x 2 areas, greedy row reordering) with the first INT4 payload of
/// [`INT4_PAYLOADS`] that holds it exactly, or `None`. For matrices that reach the GPU as
/// values (joined or synthetic): INT4 values `q · s` have the largest `|q|` of every (row,
/// group) at 7 (the quantizer rounds the scale up by under 1%), so encoding them again with the
/// same group gives them back bit for bit; the check makes sure of it. (INT8 scales are rounded
/// up to 4 significant bits, up to 12%: they do not come back, and packs reach the runner as
/// their encoded matrices instead.)
pub fn encode_exact(m: &DenseMatrix) -> Result<Option<IeBme>> {
    for payload in INT4_PAYLOADS {
        let enc = IeBme::encode(m, &options(payload, Reorder::Greedy))?;
        let back = enc.decode();
        let same =
            back.data().iter().zip(m.data()).all(|(a, b)| {
                a.to_bits() == b.to_bits() || (a.to_f32() == 0.0 && b.to_f32() == 0.0)
            });
        if same {
            return Ok(Some(enc));
        }
    }
    Ok(None)
}

/// `m` quantized by IE-BME's quantizer with `payload` and decoded: the values an IE-BME pack of
/// `m` holds.
pub fn snap(m: &DenseMatrix, payload: Payload) -> Result<DenseMatrix> {
    Ok(IeBme::encode(m, &options(payload, Reorder::Off))?.decode())
}

/// The shape of an IE-BME matrix as the kernels see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Geometry {
    rows: usize,
    cols: usize,
    area_rows: usize,
    area_cols: usize,
    bits: usize,
    tile_rows: usize,
    tile_cols: usize,
    /// Tiles per scale group along K (`group_size / 64`).
    group_tiles: usize,
}

/// An [`IeBme`] matrix in the device layout of `ie_bme_spmm.cu`.
#[derive(Clone, Debug, PartialEq)]
pub struct IeBmeDevice {
    geo: Geometry,
    /// `32 / Q` words per tile.
    bitmaps: Vec<u32>,
    /// Per tile: nibble `o` = the reordered row holding original row `o`.
    iperms: Vec<u64>,
    /// Per tile: byte offset of its tuples in `values`.
    tile_offsets: Vec<u32>,
    values: Vec<u8>,
    /// `[group][padded row]`, f32 of the format's f16 scales, 0 on padding rows.
    scales: Vec<f32>,
}

const NO_F16_KERNEL: &str =
    "ie-bme with f16 values has no GPU kernel: pack it with int4 or int8 values";

/// Whether the GPU kernels take `m`: int4 / int8 values, 1 or 2 areas per tile side, padded
/// dimensions within the kernels' 32-bit indices. Cheap: for refusing a model before anything
/// is uploaded.
pub fn check_supported(m: &IeBme) -> Result<()> {
    if m.payload().group_size().is_none() {
        return Err(CudaError::Option(NO_F16_KERNEL.into()));
    }
    let (ra, ca) = (m.area_rows(), m.area_cols());
    if !matches!(ra, 1 | 2) || !matches!(ca, 1 | 2) {
        return Err(CudaError::Option(format!(
            "ie-bme areas {ra} x {ca}: the GPU kernels take 1 or 2 areas per tile side"
        )));
    }
    let (rows, cols) = (m.rows(), m.cols());
    if rows.next_multiple_of(TILE_ROWS) > i32::MAX as usize
        || cols.next_multiple_of(TILE_COLS) > i32::MAX as usize
    {
        return Err(CudaError::Option(format!(
            "matrix {rows} x {cols} exceeds the kernels' 32-bit dimensions"
        )));
    }
    Ok(())
}

/// The biased code of stored value `index` (int4: `q + 8`, int8: `q + 128`).
fn code(values: &ValuesRef, index: usize) -> Result<u32> {
    match values {
        ValuesRef::Int4 { packed, .. } => {
            let byte = packed[index / 2];
            let nibble = if index.is_multiple_of(2) {
                byte & 15
            } else {
                byte >> 4
            };
            // A two's complement nibble q with its sign bit flipped is q + 8.
            Ok((nibble ^ 8) as u32)
        }
        ValuesRef::Int8(v) => Ok((v[index] as i32 + 128) as u32),
        ValuesRef::F16(_) => Err(CudaError::Option(NO_F16_KERNEL.into())),
    }
}

impl IeBmeDevice {
    /// The device layout of `m`; an error naming what the kernels do not take (the f16
    /// payload, areas other than 1 or 2 per tile side, a matrix past 32-bit offsets).
    pub fn new(m: &IeBme) -> Result<Self> {
        check_supported(m)?;
        let (bits, group) = match m.payload() {
            Payload::Int4 { group_size } => (4, group_size),
            Payload::Int8 { group_size } => (8, group_size),
            Payload::F16 => return Err(CudaError::Option(NO_F16_KERNEL.into())),
        };
        let (ra, ca) = (m.area_rows(), m.area_cols());
        let (rows, cols) = (m.rows(), m.cols());
        let q = ra * ca;
        let (tile_rows, tile_cols) = (m.tile_rows(), m.tile_cols());
        let tiles = tile_rows * tile_cols;
        let words32 = 32 / q;
        let tuple_bits = q * bits;
        let (hb, kb) = (m.logical_rows(), m.logical_cols());
        let vals = m.values();
        let mut bitmaps = Vec::with_capacity(tiles * words32);
        let mut iperms = Vec::with_capacity(tiles);
        let mut tile_offsets = Vec::with_capacity(tiles);
        let mut values = Vec::new();
        let union = m.union_bitmaps();
        let wpt = m.words_per_tile();
        for t in 0..tiles {
            let words = &union[t * wpt..(t + 1) * wpt];
            for w in 0..words32 {
                let word = words[w / 2];
                bitmaps.push(if w.is_multiple_of(2) {
                    word as u32
                } else {
                    (word >> 32) as u32
                });
            }
            let mut iperm = 0u64;
            for p in 0..TILE_ROWS {
                iperm |= (p as u64) << (4 * m.perm_row(t, p));
            }
            iperms.push(iperm);
            // Tuples start on a multiple of their size (a byte for 4-bit tuples).
            let align = (tuple_bits / 8).max(1);
            values.resize(values.len().div_ceil(align) * align, 0);
            let start = values.len();
            tile_offsets.push(u32::try_from(start).map_err(|_| {
                CudaError::Option("ie-bme values past 4 GiB: the kernels use 32-bit offsets".into())
            })?);
            let (active, stride, base) =
                (m.active_entries(t), m.stride(t), m.offsets()[t] as usize);
            let mut tuple_bytes = vec![0u8; (active * tuple_bits).div_ceil(8)];
            for rank in 0..active {
                let mut tuple = 0u64;
                for area in 0..q {
                    tuple |= (code(&vals, base + area * stride + rank)? as u64) << (bits * area);
                }
                let bit0 = rank * tuple_bits;
                for b in 0..tuple_bits.div_ceil(8).max(1) {
                    let chunk = (tuple >> (8 * b)) as u8;
                    if tuple_bits == 4 {
                        tuple_bytes[bit0 / 8] |= (chunk & 15) << (bit0 % 8);
                    } else {
                        tuple_bytes[bit0 / 8 + b] = chunk;
                    }
                }
            }
            values.extend_from_slice(&tuple_bytes);
            debug_assert_eq!(hb * kb, 1024 / q);
        }
        // Reading a tuple loads at most 4 bytes at its rank: keep the buffer non-empty.
        values.resize(values.len() + 4, 0);
        let groups = m.scale_groups();
        let mp = tile_rows * TILE_ROWS;
        let mut scales = vec![0f32; groups * mp];
        for r in 0..rows {
            for g in 0..groups {
                scales[g * mp + r] = m.scales()[r * groups + g].to_f32();
            }
        }
        Ok(Self {
            geo: Geometry {
                rows,
                cols,
                area_rows: ra,
                area_cols: ca,
                bits,
                tile_rows,
                tile_cols,
                group_tiles: group / TILE_COLS,
            },
            bitmaps,
            iperms,
            tile_offsets,
            values,
            scales,
        })
    }

    /// Device bytes: bitmaps, permutations, offsets, tuples and scales.
    pub fn device_bytes(&self) -> usize {
        4 * self.bitmaps.len()
            + 8 * self.iperms.len()
            + 4 * self.tile_offsets.len()
            + self.values.len()
            + 4 * self.scales.len()
    }

    /// The matrix as the kernel reads it (ranks, tuples, inverse permutations, scales), row-major
    /// f32: what the round-trip test holds equal to the format's own decode.
    pub fn read_back(&self) -> Vec<f32> {
        let (ra, ca) = (self.geo.area_rows, self.geo.area_cols);
        let q = ra * ca;
        let (hb, kb) = (TILE_ROWS / ra, TILE_COLS / ca);
        let words32 = 32 / q;
        let tuple_bits = q * self.geo.bits;
        let mp = self.geo.tile_rows * TILE_ROWS;
        let zero = if self.geo.bits == 4 { 8 } else { 128 };
        let mut out = vec![0f32; self.geo.rows * self.geo.cols];
        for tr in 0..self.geo.tile_rows {
            for tc in 0..self.geo.tile_cols {
                let t = tr * self.geo.tile_cols + tc;
                let words = &self.bitmaps[t * words32..(t + 1) * words32];
                let base = self.tile_offsets[t] as usize;
                let mut perm = [0usize; TILE_ROWS];
                for (o, p) in (0..TILE_ROWS).map(|o| (o, (self.iperms[t] >> (4 * o)) & 15)) {
                    perm[p as usize] = o;
                }
                let mut rank = 0;
                for b in 0..hb * kb {
                    if words[b / 32] >> (b % 32) & 1 == 0 {
                        continue;
                    }
                    let bit0 = rank * tuple_bits;
                    let mut tuple = 0u64;
                    for k in 0..tuple_bits.div_ceil(8) {
                        tuple |= (self.values[base + bit0 / 8 + k] as u64) << (8 * k);
                    }
                    tuple >>= bit0 % 8;
                    for area in 0..q {
                        let u = (tuple >> (self.geo.bits * area)) & ((1 << self.geo.bits) - 1);
                        let (a, c) = (area / ca, area % ca);
                        let (i, j) = (b / kb, b % kb);
                        let row = tr * TILE_ROWS + perm[a * hb + i];
                        let col = tc * TILE_COLS + c * kb + j;
                        let qv = u as i32 - zero;
                        if row < self.geo.rows && col < self.geo.cols {
                            let g = col / (self.geo.group_tiles * TILE_COLS);
                            out[row * self.geo.cols + col] = qv as f32 * self.scales[g * mp + row];
                        } else {
                            assert_eq!(qv, 0, "a value on padding");
                        }
                    }
                    rank += 1;
                }
            }
        }
        out
    }
}

/// An [`IeBmeDevice`] on the GPU with its kernels.
/// The kernel of a geometry's area and bits for a token variant (`n1`, `n8`, `n16`, `n32`).
fn kernel_name(geo: &Geometry, tokens: &str) -> String {
    format!(
        "ie_bme_r{}c{}_int{}_{tokens}",
        geo.area_rows, geo.area_cols, geo.bits
    )
}

pub struct GpuIeBme {
    geo: Geometry,
    device_bytes: usize,
    bitmaps: CudaSlice<u32>,
    iperms: CudaSlice<u64>,
    tile_offsets: CudaSlice<u32>,
    values: CudaSlice<u8>,
    scales: CudaSlice<f32>,
    /// Per tile row: the epoch of the launch that zeroed its rows of y (fused zeroing).
    flags: CudaSlice<u32>,
    epoch: LaunchEpoch,
    /// Blocks resident at once on the device, per kernel variant (n1, n8, n16, n32), asked at
    /// upload (never first inside a graph capture).
    wave: [usize; 4],
    /// Tiles per block along K (0: chosen from the shape and the device).
    pub chunk: usize,
}

impl GpuIeBme {
    /// The array the decode step asks L2 for ahead of this product (its largest: the
    /// weights), see [`crate::product::L2Span`].
    pub fn weight_span(&self, gpu: &Gpu) -> crate::product::L2Span {
        crate::product::L2Span::of(gpu, &self.values)
    }

    pub fn upload(gpu: &Gpu, d: &IeBmeDevice) -> Result<Self> {
        let mut wave = [0usize; 4];
        for (w, tokens) in wave.iter_mut().zip(["n1", "n8", "n16", "n32"]) {
            let name = kernel_name(&d.geo, tokens);
            *w = gpu.resident_blocks(&FAMILY, &name, 32 * WARPS as u32)? as usize;
        }
        Ok(Self {
            geo: d.geo,
            device_bytes: d.device_bytes(),
            bitmaps: gpu.upload(&d.bitmaps)?,
            iperms: gpu.upload(&d.iperms)?,
            tile_offsets: gpu.upload(&d.tile_offsets)?,
            values: gpu.upload(&d.values)?,
            scales: gpu.upload(&d.scales)?,
            flags: gpu.upload(&vec![0u32; d.geo.tile_rows.max(1)])?,
            epoch: LaunchEpoch::default(),
            wave,
            chunk: 0,
        })
    }

    /// Device bytes of the matrix.
    pub fn device_bytes(&self) -> usize {
        self.device_bytes
    }

    /// Bits per value (4 or 8).
    pub fn bits(&self) -> usize {
        self.geo.bits
    }

    /// Rows of [`Self::decode_rows_f16`]'s output: M padded to the 16-row tile.
    pub fn padded_rows(&self) -> usize {
        self.geo.tile_rows * TILE_ROWS
    }

    /// Columns of [`Self::decode_rows_f16`]'s output: K padded to the 64-column tile.
    pub fn padded_cols(&self) -> usize {
        self.geo.tile_cols * TILE_COLS
    }

    /// `out` (device, [`Self::padded_rows`] x [`Self::padded_cols`] f16, row-major) = the
    /// matrix, each value `s · q` rounded to f16 once, zeros where no tuple holds one: the
    /// batched prefill's copy for cuBLAS on long prompts (`ie_bme_r*c*_int*_to_f16`).
    pub fn decode_rows_f16(&self, gpu: &Gpu, out: DevPtr) -> Result<()> {
        let tiles = self.geo.tile_rows * self.geo.tile_cols;
        if tiles == 0 {
            return Ok(());
        }
        let name = kernel_name(&self.geo, "to_f16");
        let f = gpu.function(&FAMILY, &name)?;
        let cfg = crate::product::warp_per_item(tiles, || {
            format!("a {} x {} ie-bme matrix", self.geo.rows, self.geo.cols)
        })?;
        let (tile_rows, tile_cols) = (self.geo.tile_rows as i32, self.geo.tile_cols as i32);
        let (group_tiles, mp) = (self.geo.group_tiles as i32, self.padded_rows() as i32);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.bitmaps)
            .arg(&self.iperms)
            .arg(&self.tile_offsets)
            .arg(&self.values)
            .arg(&self.scales)
            .arg(&out)
            .arg(&tile_rows)
            .arg(&tile_cols)
            .arg(&group_tiles)
            .arg(&mp);
        unsafe { b.launch(cfg) }.during("launching an ie-bme decode to f16")?;
        Ok(())
    }

    /// Tiles per block along K: the fewest that fill one wave of blocks (short warps pay their
    /// pipeline fill and the X staging per tile), at most [`max_chunk`].
    fn effective_chunk(&self, variant: usize, n: usize) -> Result<usize> {
        let most = max_chunk(n);
        if self.chunk > 0 {
            if self.chunk > most {
                return Err(CudaError::Option(format!(
                    "ie-bme chunk must be 1..={most} tiles for {n} tokens, got {}",
                    self.chunk
                )));
            }
            return Ok(self.chunk);
        }
        let row_blocks = self.geo.tile_rows.div_ceil(WARPS);
        let wave = self.wave[variant];
        let splits = (wave / row_blocks.max(1)).max(1);
        let chunk = self.geo.tile_cols.div_ceil(splits).clamp(1, most);
        // Above 8 tokens (2 blocks per SM) one wave of long chunks measured slower than ~2.5
        // waves of chunks of at most 8 tiles (58.8 against 41.8 us at N = 16 on 11008 x 4096,
        // H200, 2026-12-04).
        Ok(if token_tiles(n) > 1 {
            chunk.min(8)
        } else {
            chunk
        })
    }

    /// `y[n · M + r] += (W · mask_t(x_n))[r]` for `n` tokens: `x` n x K f32, `y` n x M f32,
    /// both row-major.
    pub fn launch_ptr(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        n: usize,
        threshold: Threshold,
        y: DevPtr,
    ) -> Result<()> {
        self.enqueue(
            gpu,
            (x, self.geo.cols),
            n,
            threshold,
            (y, self.geo.rows),
            0,
            0,
        )
    }

    /// `Y[t][r] (+)= (W · mask_t(X[t]))[r]` for `n` tokens whose rows lie `ldx` (X, f32) and
    /// `ldy` (Y, f32) floats apart: added to `Y` when `accumulate`, else written (fused zeroing).
    /// The prefill's form.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_rows(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        ldx: usize,
        n: usize,
        threshold: Threshold,
        y: DevPtr,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        if ldx < self.geo.cols
            || ldy < self.geo.rows
            || ldx > i32::MAX as usize
            || ldy > i32::MAX as usize
        {
            return Err(CudaError::Option(format!(
                "ie-bme row strides {ldx} (x) and {ldy} (y) must cover {} x {}",
                self.geo.rows, self.geo.cols
            )));
        }
        if accumulate {
            self.enqueue(gpu, (x, ldx), n, threshold, (y, ldy), 0, 0)
        } else {
            let flags = crate::dev_ptr(gpu, &self.flags);
            self.enqueue(
                gpu,
                (x, ldx),
                n,
                threshold,
                (y, ldy),
                flags,
                self.epoch.next(),
            )
        }
    }

    /// `flags` 0: accumulate; else fused zeroing under `epoch`.
    #[allow(clippy::too_many_arguments)]
    fn enqueue(
        &self,
        gpu: &Gpu,
        (x, ldx): (DevPtr, usize),
        n: usize,
        threshold: Threshold,
        (y, ldy): (DevPtr, usize),
        flags: DevPtr,
        epoch: u32,
    ) -> Result<()> {
        if n == 0 || n > MAX_TOKENS {
            return Err(CudaError::Option(format!(
                "ie-bme kernels take 1..={MAX_TOKENS} tokens, got {n}"
            )));
        }
        if self.geo.rows == 0 || self.geo.cols == 0 {
            return Ok(());
        }
        let (variant, tokens) = match (n, token_tiles(n)) {
            (1, _) => (0, "n1"),
            (_, 1) => (1, "n8"),
            (_, 2) => (2, "n16"),
            _ => (3, "n32"),
        };
        let f = gpu.function(&FAMILY, &kernel_name(&self.geo, tokens))?;
        let chunk = self.effective_chunk(variant, n)?;
        let cfg = LaunchConfig {
            grid_dim: (
                self.geo.tile_rows.div_ceil(WARPS) as u32,
                self.geo.tile_cols.div_ceil(chunk) as u32,
                1,
            ),
            block_dim: (32 * WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (m, k, nn) = (self.geo.rows as i32, self.geo.cols as i32, n as i32);
        let (ldx, ldy) = (ldx as i32, ldy as i32);
        let (tr, tc, ch) = (
            self.geo.tile_rows as i32,
            self.geo.tile_cols as i32,
            chunk as i32,
        );
        let (gt, mp) = (
            self.geo.group_tiles as i32,
            (self.geo.tile_rows * TILE_ROWS) as i32,
        );
        let t = threshold_arg(threshold);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.bitmaps)
            .arg(&self.iperms)
            .arg(&self.tile_offsets)
            .arg(&self.values)
            .arg(&self.scales)
            .arg(&x)
            .arg(&y)
            .arg(&m)
            .arg(&k)
            .arg(&nn)
            .arg(&ldx)
            .arg(&ldy)
            .arg(&tr)
            .arg(&tc)
            .arg(&ch)
            .arg(&gt)
            .arg(&mp)
            .arg(&t)
            .arg(&flags)
            .arg(&epoch);
        unsafe { b.launch(cfg) }.during("launching the ie-bme product")?;
        Ok(())
    }

    /// `y = W · mask_t(x_n)` for `n` tokens (`x` n x K, `y` n x M, both row-major), one launch
    /// (the kernel zeroes `y` itself).
    pub fn launch_tokens(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        n: usize,
        threshold: Threshold,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if n == 0 || n > MAX_TOKENS {
            return Err(CudaError::Option(format!(
                "ie-bme kernels take 1..={MAX_TOKENS} tokens, got {n}"
            )));
        }
        crate::dense::check_len("ie-bme x (n x K)", n * self.geo.cols, x.len())?;
        crate::dense::check_len("ie-bme y (n x M)", n * self.geo.rows, y.len())?;
        let (xp, yp) = (crate::dev_ptr(gpu, x), crate::dev_ptr(gpu, y));
        let flags = crate::dev_ptr(gpu, &self.flags);
        let epoch = self.epoch.next();
        self.enqueue(
            gpu,
            (xp, self.geo.cols),
            n,
            threshold,
            (yp, self.geo.rows),
            flags,
            epoch,
        )
    }
}

impl GpuMatVec for GpuIeBme {
    fn label(&self) -> String {
        format!(
            "ie-bme/{}x{}/int{}",
            self.geo.area_rows, self.geo.area_cols, self.geo.bits
        )
    }
    fn rows(&self) -> usize {
        self.geo.rows
    }
    fn cols(&self) -> usize {
        self.geo.cols
    }
    /// Every tile is read whatever the activations (the kernel skips no tile).
    fn bytes_for(&self, _active: &[bool]) -> usize {
        self.device_bytes + self.geo.cols * 4 + self.geo.rows * 4
    }
    fn launch(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        threshold: Threshold,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_io(self, x, y)?;
        self.launch_tokens(gpu, x, 1, threshold, y)
    }
}

impl GpuAccumulate for GpuIeBme {
    fn launch_add(&self, gpu: &Gpu, x: DevPtr, threshold: Threshold, y: DevPtr) -> Result<()> {
        self.launch_ptr(gpu, x, 1, threshold, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sieve_formats::ie_bme::{IeBmeOptions, Reorder};
    use sieve_formats::random::{sparse_matrix, Pattern};

    fn encode(
        m: usize,
        k: usize,
        sp: f64,
        ra: usize,
        ca: usize,
        bits: usize,
        reorder: bool,
        seed: u64,
    ) -> IeBme {
        let w = sparse_matrix(m, k, sp, Pattern::Unstructured, seed).unwrap();
        let group_size = 64 * (1 + (seed as usize % 2));
        let opts = IeBmeOptions {
            area_rows: ra,
            area_cols: ca,
            payload: if bits == 4 {
                Payload::Int4 { group_size }
            } else {
                Payload::Int8 { group_size }
            },
            reorder: if reorder {
                Reorder::Greedy
            } else {
                Reorder::Off
            },
            stream_align: 1 + (seed as usize % 3),
        };
        IeBme::encode(&w, &opts).unwrap()
    }

    /// The proptests' matrix: `areas` picks the area split (2x2, 1x2, 2x1, 1x1), `bits8` the
    /// payload; the format and its device layout.
    fn arbitrary(
        m: usize,
        k: usize,
        sp: f64,
        areas: usize,
        bits8: bool,
        reorder: bool,
        seed: u64,
    ) -> (IeBme, IeBmeDevice) {
        let (ra, ca) = [(2, 2), (1, 2), (2, 1), (1, 1)][areas];
        let enc = encode(m, k, sp, ra, ca, if bits8 { 8 } else { 4 }, reorder, seed);
        let dev = IeBmeDevice::new(&enc).unwrap();
        (enc, dev)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// The device layout, read the way the kernel reads it, is the format's matrix exactly.
        #[test]
        fn device_layout_reads_back_as_the_format(m in 1usize..80, k in 1usize..300, sp in 0.0f64..0.95,
                                                  areas in 0usize..4, bits8 in proptest::bool::ANY,
                                                  reorder in proptest::bool::ANY, seed in 0u64..1000) {
            let (enc, dev) = arbitrary(m, k, sp, areas, bits8, reorder, seed);
            let want: Vec<f32> = enc.decode().data().iter().map(|v| v.to_f32()).collect();
            prop_assert_eq!(dev.read_back(), want);
        }
    }

    /// `ie_bme_r*c*_int*_to_f16` on the CPU, warp by warp (one per tile) and lane by lane with the
    /// kernel's index arithmetic: the words' exclusive popcount scan, reordered row from the
    /// iperm nibble, area and union position, tuple by rank. Row-major f16, padded.
    fn emulate_decode_rows(d: &IeBmeDevice) -> Vec<half::f16> {
        let g = &d.geo;
        let (ra, ca, bits) = (g.area_rows, g.area_cols, g.bits);
        let q = ra * ca;
        let (w32, kb, tuple_bits) = (32 / q, TILE_COLS / ca, q * bits);
        let zero = if bits == 4 { 8 } else { 128 };
        let (mp, kp) = (g.tile_rows * TILE_ROWS, g.tile_cols * TILE_COLS);
        let mut out = vec![half::f16::from_bits(0x7e00); mp * kp];
        for tile in 0..g.tile_rows * g.tile_cols {
            let (tr, tc) = (tile / g.tile_cols, tile % g.tile_cols);
            let words: Vec<u32> = (0..32)
                .map(|lane| {
                    if lane < w32 {
                        d.bitmaps[tile * w32 + lane]
                    } else {
                        0
                    }
                })
                .collect();
            let mut excl = [0u32; 32];
            for lane in 1..32 {
                excl[lane] = excl[lane - 1] + words[lane - 1].count_ones();
            }
            let base = d.tile_offsets[tile] as usize;
            let tuple = |r: usize| -> u32 {
                let v = &d.values;
                match tuple_bits {
                    4 => ((v[base + r / 2] >> (4 * (r % 2))) & 15) as u32,
                    8 => v[base + r] as u32,
                    16 => u16::from_le_bytes([v[base + 2 * r], v[base + 2 * r + 1]]) as u32,
                    _ => u32::from_le_bytes(v[base + 4 * r..base + 4 * r + 4].try_into().unwrap()),
                }
            };
            let ip = d.iperms[tile];
            let grp = tc / g.group_tiles;
            for lane in 0..32 {
                for o in 0..TILE_ROWS {
                    let p = ((ip >> (4 * o)) & 15) as usize;
                    let (a, i) = if ra == 2 { (p >> 3, p & 7) } else { (0, p) };
                    let s = d.scales[grp * mp + tr * TILE_ROWS + o];
                    for e in 0..2 {
                        let col = 2 * lane + e;
                        let (c, j) = if ca == 2 {
                            (col >> 5, col & 31)
                        } else {
                            (0, col)
                        };
                        let b = i * kb + j;
                        let (w, before) = (words[b >> 5], excl[b >> 5]);
                        let mut v = 0f32;
                        if (w >> (b & 31)) & 1 == 1 {
                            let r = before + (w & ((1u32 << (b & 31)) - 1)).count_ones();
                            let code =
                                (tuple(r as usize) >> (bits * (a * ca + c))) & ((1 << bits) - 1);
                            v = s * (code as i32 - zero) as f32;
                        }
                        out[(tr * TILE_ROWS + o) * kp + tc * TILE_COLS + col] =
                            half::f16::from_f32(v);
                    }
                }
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// The prefill's f16 copy, emulated, is the matrix the kernel reads (`read_back`, itself
        /// the format's decode) rounded to f16, zeros in the padding, nothing left unwritten.
        #[test]
        fn decode_rows_mapping_matches_read_back(m in 1usize..80, k in 1usize..300, sp in 0.0f64..0.95,
                                                 areas in 0usize..4, bits8 in proptest::bool::ANY,
                                                 reorder in proptest::bool::ANY, seed in 0u64..1000) {
            let (_, dev) = arbitrary(m, k, sp, areas, bits8, reorder, seed);
            let want = dev.read_back();
            let out = emulate_decode_rows(&dev);
            let kp = dev.geo.tile_cols * TILE_COLS;
            for (idx, v) in out.iter().enumerate() {
                let (r, c) = (idx / kp, idx % kp);
                prop_assert!(!v.is_nan(), "({}, {}) not written", r, c);
                let w = if r < m && c < k { want[r * k + c] } else { 0.0 };
                prop_assert_eq!(v.to_bits(), half::f16::from_f32(w).to_bits(), "({}, {})", r, c);
            }
        }
    }

    /// Lane (g, l)'s positions, as the kernel walks them, cover every (reordered row, column) of
    /// a tile exactly once for every area split; this mirrors the kernel's index arithmetic.
    #[test]
    fn fragments_cover_each_tile_once() {
        for (ra, ca) in [(2usize, 2usize), (1, 2), (2, 1), (1, 1)] {
            let q = ra * ca;
            let (hb, kb) = (TILE_ROWS / ra, TILE_COLS / ca);
            let (ni, nw) = (if ra == 2 { 1 } else { 2 }, kb / 32);
            let mut seen = vec![0u8; TILE_ROWS * TILE_COLS];
            for lane in 0..32 {
                let (g, l) = (lane / 4, lane % 4);
                for ii in 0..ni {
                    let i = if ra == 2 { g } else { g + 8 * ii };
                    for uh in 0..nw {
                        for ul in 0..2 {
                            for e in 0..2 {
                                let (u, bit) = (2 * uh + ul, 16 * ul + 8 * e + 2 * l);
                                for pair in 0..2 {
                                    // Union position (i, j) of the kernel's word i·NW + uh, bit.
                                    let j = 32 * uh + bit + pair;
                                    assert!(j < kb && i < hb);
                                    for area in 0..q {
                                        let (ar, c) = (area / ca, area % ca);
                                        let h = if ra == 2 { ar } else { ii };
                                        let kk = if ca == 2 { 2 * c + u } else { u };
                                        // The A register (kk, 2e + h) holds row g + 8h, column
                                        // 16 kk + 8 e + 2 l + pair; the format puts this value at:
                                        let (row, col) = (ar * hb + i, c * kb + j);
                                        assert_eq!(
                                            (row, col),
                                            (g + 8 * h, 16 * kk + 8 * e + 2 * l + pair)
                                        );
                                        seen[row * TILE_COLS + col] += 1;
                                    }
                                }
                            }
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "{ra} x {ca}");
        }
    }

    /// Decoded INT4 packs are found again exactly; f16 values are not.
    #[test]
    fn grids_are_detected_from_decoded_matrices() {
        let w = sparse_matrix(40, 300, 0.6, Pattern::Unstructured, 5).unwrap();
        for payload in INT4_PAYLOADS {
            let snapped = snap(&w, payload).unwrap();
            let enc = encode_exact(&snapped).unwrap().expect("on a grid");
            assert_eq!(enc.payload(), payload);
            assert_eq!(enc.decode(), snapped);
        }
        assert!(encode_exact(&w).unwrap().is_none());
    }

    #[test]
    fn f16_values_and_wide_areas_are_refused() {
        let w = sparse_matrix(32, 128, 0.5, Pattern::Unstructured, 1).unwrap();
        let f16 = IeBme::encode(
            &w,
            &IeBmeOptions {
                reorder: Reorder::Off,
                ..IeBmeOptions::lossless()
            },
        )
        .unwrap();
        let e = IeBmeDevice::new(&f16).unwrap_err().to_string();
        assert!(e.contains("int4 or int8"), "{e}");
        let wide = IeBme::encode(
            &w,
            &IeBmeOptions {
                area_rows: 4,
                reorder: Reorder::Off,
                ..IeBmeOptions::default()
            },
        )
        .unwrap();
        let e = IeBmeDevice::new(&wide).unwrap_err().to_string();
        assert!(e.contains("4 x 2"), "{e}");
    }
}
