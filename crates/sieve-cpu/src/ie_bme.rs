//! IE-BME INT4 multiplied in integer SIMD against 8-bit activations, the way the Q4_1 blocks are.
//!
//! The IE-BME blob (union bitmaps over 16 x 64 tiles, four aligned area streams, row
//! permutations) is the GPU's layout: a CPU walking it per element spends its time on ranks and
//! nibble addressing. So at load the INT4 codes are rearranged into a **row-major CPU layout**
//! (the blob, and what the layer writes back, stay IE-BME):
//!
//! * per (row, 64-column block) one `u64` bitmap of the nonzero codes (bit `c` = column
//!   `64 b + c`), `rows x ceil(K / 64)` words;
//! * per row, the nonzero codes of each block in column order as offset-binary nibbles
//!   (`w + 8`, 1..15; value `2i` in the low nibble of byte `i`); each block starts on a byte (an
//!   odd count is padded with a 0 nibble), each row at `row_offsets[r]`;
//! * the IE-BME scales as f32, `rows x G` (one per row and `group_size` columns).
//!
//! At sp 0.5 that is 0.25 B of codes + 0.125 B of bitmap per weight (+ 1/32 B of scales at
//! groups of 128), against 0.5625 B for Q4_1, and every row is one sequential stream (what the
//! hardware prefetcher serves best; the union bitmap's padding zeros are not stored).
//!
//! The product `y = W · mask_t(x)`: `x` is masked by the TEAL threshold and quantized into the
//! same 8-bit blocks of 32 as the Q4_1 path ([`Q8Activations`]). Blocks whose 64 activations are
//! all zero (TEAL) are skipped without touching their codes (the offset of the next block is
//! advanced by the popcount). Kernels:
//! * AVX-512 VNNI + VBMI2, per (row, block) seven vector instructions: `vpmovzxdq` (from
//!   memory) + `vpmultishiftqb` + `vpand` turn 32 bytes of nibbles into 64 bytes `w + 8` in order,
//!   `vpexpandb` places them at the bitmap's set bits and fills the other columns with 8 (a
//!   weight of 0, offset), one `vpdpbusd` takes `Σ (w + 8) x_q` against the signed activations
//!   starting from `-8 Σ x_q` of each lane's 4 columns (a per-token table, the same for every
//!   row), so the lanes hold `Σ w x_q` exactly; one FMA scales the 16 lanes by their halves'
//!   activation scales (a per-token table) into the weight group's sum, scaled once per group.
//!   No bias dot, no sign extension and no scalar scale arithmetic per block.
//! * AVX-512 (no VBMI2) and AVX2: the codes are expanded into 64 signed bytes on the stack by a
//!   walk of the set bits, then `Σ (x_q + 128) w - Σ 128 w` with `vpmaddubsw` + `vpmaddwd`;
//! * AVX-512 (no VBMI2) and AVX2: the nibbles are expanded into 64 bytes on the stack by a walk
//!   of the set bits, then `vpmaddubsw` + `vpmaddwd` (AVX2) do the integer dot;
//! * portable: the same integers in scalar code.
//!
//! Every path computes the same integer block sums; they differ only in the order of f32
//! additions. Error against the f64 product over the original activations is the 8-bit
//! activation step (tested with the bound the Q4_1 tests use).

use crate::gguf_blocks::{Q8Activations, BLOCK};
use crate::simd::SimdLevel;
use rayon::prelude::*;
use sieve_formats::blob::ByteWriter;
use sieve_formats::format::{check_group_args, check_product_args, is_active};
use sieve_formats::ie_bme::{IeBme, Payload};
use sieve_formats::{DenseMatrix, FormatError, FormatKind, Storage, Threshold, WeightFormat};

/// The f16 column kernel over the dequantized matrix (other payloads, `SIEVE_IEBME_KERNEL=columns`),
/// which runs the whole-column kernels of [`crate::tiled_cbc::columns`].
pub use crate::tiled_cbc::columns::F16IeBme;

/// Columns per bitmap word.
const COLS: usize = 64;
/// Tokens multiplied per pass over a task's rows in a batched product (their activations,
/// a few KB each, stay in L1 while the rows are read once per pass).
const TOKEN_BLOCK: usize = 8;

/// IE-BME INT4 with the integer CPU product over a row-major layout built at load (module
/// notes). Kind, storage and blob are those of the [`IeBme`] it was built from.
#[derive(Debug)]
pub struct Int4IeBme {
    source: IeBme,
    rows: usize,
    cols: usize,
    /// `ceil(K / 64)`.
    blocks_per_row: usize,
    /// Columns per scale group (a multiple of 64).
    group_size: usize,
    /// Scale groups per row, `ceil(K / group_size)`.
    groups: usize,
    masks: Vec<u64>,
    /// Byte offset of each row's codes in `codes`, `rows + 1` entries.
    row_offsets: Vec<usize>,
    /// Packed nibbles, followed by 32 zero bytes so that a 32-byte load at any block start is in
    /// bounds.
    codes: Vec<u8>,
    scales: Vec<f32>,
}

/// One 4-bit offset-binary code (`w + 8`) as the integer weight `w`.
#[inline]
fn signed_nibble(n: u8) -> i8 {
    (n & 0x0f) as i8 - 8
}

impl Int4IeBme {
    /// Builds the CPU layout. Only the INT4 payload has one; other payloads are an error (use
    /// the column kernel of `F16IeBme` for them).
    pub fn new(source: IeBme) -> Result<Self, FormatError> {
        let group_size = match source.payload() {
            Payload::Int4 { group_size } => group_size,
            other => {
                return Err(FormatError::Option(format!(
                    "ie-bme integer kernel: payload {other:?} is not INT4"
                )))
            }
        };
        let (rows, cols) = (source.rows(), source.cols());
        let blocks_per_row = cols.div_ceil(COLS);
        let groups = source.scale_groups();
        let scales: Vec<f32> = source.scales().iter().map(|s| s.to_f32()).collect();
        if scales.len() != rows * groups || !group_size.is_multiple_of(COLS) {
            return Err(FormatError::Corrupt(format!(
                "ie-bme: {} scales for {rows} rows x {groups} groups of {group_size}",
                scales.len()
            )));
        }
        // The decoded matrix is q · scale exactly (module header of ie_bme), so the codes are
        // recovered by one division, checked.
        let dense = source.decode();
        let mut masks = vec![0u64; rows * blocks_per_row];
        let mut row_offsets = Vec::with_capacity(rows + 1);
        let mut codes: Vec<u8> = Vec::new();
        let mut block_codes = [0i8; COLS];
        for r in 0..rows {
            row_offsets.push(codes.len());
            let row = dense.row(r);
            for b in 0..blocks_per_row {
                let (lo, hi) = (b * COLS, ((b + 1) * COLS).min(cols));
                let scale = scales[r * groups + lo / group_size];
                let mut mask = 0u64;
                let mut n = 0;
                for (c, w) in row[lo..hi].iter().enumerate() {
                    let w = w.to_f32();
                    if w == 0.0 {
                        continue;
                    }
                    let q = (w / scale).round();
                    if !(-7.0..=7.0).contains(&q) || q == 0.0 || q * scale != w {
                        return Err(FormatError::Corrupt(format!(
                            "ie-bme: weight {w} at ({r}, {}) is not an INT4 code times its scale {scale}",
                            lo + c
                        )));
                    }
                    mask |= 1 << c;
                    block_codes[n] = q as i8;
                    n += 1;
                }
                masks[r * blocks_per_row + b] = mask;
                for pair in block_codes[..n].chunks(2) {
                    let lo_n = (pair[0] + 8) as u8;
                    let hi_n = pair.get(1).map_or(0, |&v| (v + 8) as u8);
                    codes.push(lo_n | (hi_n << 4));
                }
            }
        }
        row_offsets.push(codes.len());
        codes.extend_from_slice(&[0u8; 32]);
        Ok(Self {
            source,
            rows,
            cols,
            blocks_per_row,
            group_size,
            groups,
            masks,
            row_offsets,
            codes,
            scales,
        })
    }

    /// The IE-BME matrix this was built from.
    pub fn source(&self) -> &IeBme {
        &self.source
    }

    /// Bytes one product streams at most (bitmaps + codes + scales): what decode reads per token.
    pub fn cpu_layout_bytes(&self) -> usize {
        8 * self.masks.len() + self.codes.len() - 32 + 4 * self.scales.len()
    }

    /// Masks `x`, pads it to whole 64-column blocks and quantizes it to 8-bit blocks.
    fn prepare(&self, x: &[f32], threshold: Threshold) -> Prepared {
        let kp = self.blocks_per_row * COLS;
        let mut xm = vec![0f32; kp];
        for (d, &v) in xm.iter_mut().zip(x) {
            *d = if is_active(v, threshold) { v } else { 0.0 };
        }
        let mut q = Q8Activations::default();
        q.quantize(&xm);
        let xu: Vec<u8> = q.quants.iter().map(|&v| (v as u8) ^ 0x80).collect();
        // A block is skipped only when both halves are exactly zero (a NaN scale must reach
        // the output, as in f32).
        let live: Vec<bool> = q
            .scales
            .chunks_exact(2)
            .map(|d| d[0] != 0.0 || d[1] != 0.0)
            .collect();
        // Lane l of a block's 16 i32 dot lanes sums columns 4l..4l+3: half l / 8.
        let dx16: Vec<f32> = q
            .scales
            .chunks_exact(2)
            .flat_map(|d| [[d[0]; 8], [d[1]; 8]].into_iter().flatten())
            .collect();
        let offset16: Vec<i32> = q
            .quants
            .chunks_exact(4)
            .map(|c| -8 * c.iter().map(|&v| v as i32).sum::<i32>())
            .collect();
        Prepared {
            xu,
            xs: q.quants,
            dx: q.scales,
            live,
            dx16,
            offset16,
        }
    }

    /// `y[i] = W[r0 + i] · x` for the prepared activations.
    fn rows_with(&self, level: SimdLevel, r0: usize, p: &Prepared, y: &mut [f32]) {
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Vbmi2 if level.vnni() && level.vbmi() => {
                // SAFETY: the level is supported (`vnni` checks it), so the CPU has AVX-512
                // F/BW/VL and VBMI2, and VNNI and VBMI (checked); the layout was built by `new`
                // (offsets within `codes`, 32 bytes of padding after the last).
                unsafe { x86::rows_vbmi2(self, r0, p, y) }
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 | SimdLevel::Avx2 | SimdLevel::Avx512Vbmi2 => {
                // SAFETY: `level` is supported, so the CPU has AVX2 (all three imply it).
                unsafe { x86::rows_avx2(self, r0, p, y) }
            }
            _ => {
                for (i, o) in y.iter_mut().enumerate() {
                    *o = self.row_portable(r0 + i, p);
                }
            }
        }
    }

    /// The f32 factor of block `b`, half `h` of row `r`: activation scale times weight scale.
    #[inline]
    fn factor(&self, r: usize, b: usize, h: usize, p: &Prepared) -> f32 {
        p.dx[2 * b + h] * self.scales[r * self.groups + b * COLS / self.group_size]
    }

    fn row_portable(&self, r: usize, p: &Prepared) -> f32 {
        let mut off = self.row_offsets[r];
        let mut acc = 0f32;
        let mut w = [0i8; COLS];
        for b in 0..self.blocks_per_row {
            let mask = self.masks[r * self.blocks_per_row + b];
            let n = mask.count_ones() as usize;
            if p.live[b] && mask != 0 {
                expand_scalar(mask, &self.codes[off..], &mut w);
                let xs = &p.xs[b * COLS..(b + 1) * COLS];
                for h in 0..2 {
                    let isum: i32 = (0..BLOCK)
                        .map(|j| w[h * BLOCK + j] as i32 * xs[h * BLOCK + j] as i32)
                        .sum();
                    acc += self.factor(r, b, h, p) * isum as f32;
                }
            }
            off += n.div_ceil(2);
        }
        acc
    }

    /// `y = W · mask_t(x)` on one SIMD level (tests compare every level).
    pub fn matvec_with(
        &self,
        level: SimdLevel,
        x: &[f32],
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), FormatError> {
        check_product_args(self.rows, self.cols, x, 1, threshold, y)?;
        let level = level.or_portable();
        let p = self.prepare(x, threshold);
        let chunk = rows_per_task(self.rows);
        y.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(c, out)| self.rows_with(level, c * chunk, &p, out));
        Ok(())
    }

    /// `Y = X · Wᵀ` for `n` tokens: each task owns rows and runs them for blocks of
    /// [`TOKEN_BLOCK`] tokens (bit-identical to `n` matvecs).
    pub fn matmul_with(
        &self,
        level: SimdLevel,
        x: &[f32],
        n: usize,
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), FormatError> {
        check_product_args(self.rows, self.cols, x, n, threshold, y)?;
        let level = level.or_portable();
        let (m, k) = (self.rows, self.cols);
        if n == 0 || m == 0 {
            return Ok(());
        }
        if k == 0 {
            y.fill(0.0);
            return Ok(());
        }
        let prepared: Vec<Prepared> = x
            .par_chunks_exact(k)
            .map(|row| self.prepare(row, threshold))
            .collect();
        // Transposed output [row][token], so that tasks own whole weight rows.
        let mut yt = vec![0f32; m * n];
        let chunk = rows_per_task(m);
        yt.par_chunks_mut(chunk * n)
            .enumerate()
            .for_each(|(c, out)| {
                let r0 = c * chunk;
                for (tb, ps) in prepared.chunks(TOKEN_BLOCK).enumerate() {
                    for (i, o) in out.chunks_exact_mut(n).enumerate() {
                        for (j, p) in ps.iter().enumerate() {
                            let t = tb * TOKEN_BLOCK + j;
                            self.rows_with(level, r0 + i, p, std::slice::from_mut(&mut o[t]));
                        }
                    }
                }
            });
        for (r, o) in yt.chunks_exact(n).enumerate() {
            for (t, v) in o.iter().enumerate() {
                y[t * m + r] = *v;
            }
        }
        Ok(())
    }
}

/// Rows per parallel task: about four tasks per thread, never fewer than 16 rows.
fn rows_per_task(rows: usize) -> usize {
    let tasks = 4 * rayon::current_num_threads().max(1);
    rows.div_ceil(tasks).max(16)
}

/// One token's activations, ready for the kernels.
struct Prepared {
    /// 8-bit quants offset by 128 (`q ^ 0x80`), `ceil(K / 64) * 64` of them.
    xu: Vec<u8>,
    /// The same quants, signed (portable path).
    xs: Vec<i8>,
    /// Activation scale per 32-column block.
    dx: Vec<f32>,
    /// Per 64-column block: whether any of its activations is nonzero.
    live: Vec<bool>,
    /// Per 64-column block the activation scale of each of its 16 `vpdpbusd` lanes (8 lanes
    /// per 32-column half).
    dx16: Vec<f32>,
    /// Per 4 columns `-8 Σ x_q`: each `vpdpbusd` lane starts from it, which takes the codes'
    /// offset (8 per column, absent weights included) off in exact integers.
    offset16: Vec<i32>,
}

/// The codes of one block (`mask`'s popcount nibbles from the start of `packed`) placed at the
/// mask's set bits of `w`; other bytes 0.
#[inline]
fn expand_scalar(mask: u64, packed: &[u8], w: &mut [i8; COLS]) {
    *w = [0; COLS];
    let mut bits = mask;
    let mut i = 0;
    while bits != 0 {
        let c = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        w[c] = signed_nibble(packed[i / 2] >> (4 * (i & 1)));
        i += 1;
    }
}

impl WeightFormat for Int4IeBme {
    fn cpu_bytes(&self) -> usize {
        self.cpu_layout_bytes()
    }
    fn kind(&self) -> FormatKind {
        FormatKind::IeBme
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> Storage {
        self.source.storage()
    }
    fn decode(&self) -> DenseMatrix {
        self.source.decode()
    }
    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<(), FormatError> {
        self.matvec_with(SimdLevel::detect(), x, threshold, y)
    }
    fn matmul(
        &self,
        x: &[f32],
        n: usize,
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), FormatError> {
        self.matmul_with(SimdLevel::detect(), x, n, threshold, y)
    }
    fn write_payload(&self, w: &mut ByteWriter) {
        self.source.write_payload(w)
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

/// `y_i = W_i · mask_t(x)` for IE-BME INT4 matrices sharing the input `x` (q/k/v, gate/up):
/// `x` is masked and quantized once, and one parallel pass covers every matrix's rows (one
/// fork/join instead of one per matrix, which on two threads costs more than a small matrix's
/// rows). Bit-identical to one [`Int4IeBme::matvec`] per matrix.
pub fn matvec_group(
    mats: &[&Int4IeBme],
    x: &[f32],
    threshold: Threshold,
    ys: &mut [&mut [f32]],
) -> Result<(), FormatError> {
    let shapes: Vec<(usize, usize)> = mats.iter().map(|m| (m.rows, m.cols)).collect();
    check_group_args(&shapes, x, threshold, ys)?;
    let Some(first) = mats.first() else {
        return Ok(());
    };
    // Every matrix has K = x.len() columns (checked), so one preparation serves them all.
    let level = SimdLevel::detect().or_portable();
    let p = first.prepare(x, threshold);
    let chunk = rows_per_task(mats.iter().map(|m| m.rows).sum());
    let mut tasks: Vec<(&Int4IeBme, usize, &mut [f32])> = Vec::new();
    for (m, y) in mats.iter().zip(ys.iter_mut()) {
        for (c, out) in y.chunks_mut(chunk).enumerate() {
            tasks.push((m, c * chunk, out));
        }
    }
    tasks
        .into_par_iter()
        .for_each(|(m, r0, out)| m.rows_with(level, r0, &p, out));
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{expand_scalar, Int4IeBme, Prepared, COLS};
    use std::arch::x86_64::*;

    /// AVX-512 VNNI + VBMI2 rows (module notes).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL/VBMI/VBMI2/VNNI; `w` built by `Int4IeBme::new`,
    /// `r0 + y.len() <= w.rows`, `p` prepared for `w`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,avx512vnni")]
    pub unsafe fn rows_vbmi2(w: &Int4IeBme, r0: usize, p: &Prepared, y: &mut [f32]) {
        // Output byte j of qword q is code 8q + j: nibble j of input bytes 4q..4q+3, which
        // `vpmovzxdq` moves into the qword's low half and `vpmultishiftqb` extracts at bit 4j.
        let shifts = _mm512_set1_epi64(0x1c18_1410_0c08_0400);
        let mut pairs = y.chunks_exact_mut(ROWS_TOGETHER);
        let mut r = r0;
        for out in &mut pairs {
            rows_vbmi2_n::<ROWS_TOGETHER>(w, r, p, out, shifts);
            r += ROWS_TOGETHER;
        }
        for out in pairs.into_remainder().chunks_exact_mut(1) {
            rows_vbmi2_n::<1>(w, r, p, out, shifts);
            r += 1;
        }
    }

    /// How far ahead of a row's codes the kernel prefetches (`codes` is over-read by at most
    /// this much past a row's end, which only touches a cache line, never faults: prefetches
    /// do not fault).
    const PREFETCH_BYTES: usize = 1024;

    /// Rows decoded side by side by [`rows_vbmi2`]: the activation loads of a block are shared
    /// and the rows' independent chains (code offsets, sums) overlap.
    const ROWS_TOGETHER: usize = 4;

    /// `N` consecutive rows from `r0` into `y` (`y.len() == N`).
    ///
    /// # Safety
    /// As for [`rows_vbmi2`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,avx512vnni")]
    #[inline]
    unsafe fn rows_vbmi2_n<const N: usize>(
        w: &Int4IeBme,
        r0: usize,
        p: &Prepared,
        y: &mut [f32],
        shifts: __m512i,
    ) {
        let low = _mm512_set1_epi8(0x0f);
        let eight = _mm512_set1_epi8(8);
        let bpr = w.blocks_per_row;
        let per_group = w.group_size / COLS;
        let codes = w.codes.as_ptr();
        let xs = p.xs.as_ptr() as *const i32;
        let dx16 = p.dx16.as_ptr();
        let offset16 = p.offset16.as_ptr();
        let mut off = [0usize; N];
        let mut acc = [_mm512_setzero_ps(); N];
        for (j, o) in off.iter_mut().enumerate() {
            *o = *w.row_offsets.get_unchecked(r0 + j);
        }
        for g in 0..w.groups {
            let mut group_acc = [_mm512_setzero_ps(); N];
            for b in g * per_group..((g + 1) * per_group).min(bpr) {
                let live = *p.live.get_unchecked(b);
                let (xv, start, dx) = (
                    _mm512_loadu_si512(xs.add(b * COLS / 4) as *const _),
                    _mm512_loadu_si512(offset16.add(16 * b) as *const _),
                    _mm512_loadu_ps(dx16.add(16 * b)),
                );
                for j in 0..N {
                    let mask = *w.masks.get_unchecked((r0 + j) * bpr + b);
                    _mm_prefetch::<_MM_HINT_T0>(codes.add(off[j] + PREFETCH_BYTES) as *const i8);
                    if mask != 0 && live {
                        // 32 bytes of nibbles (in bounds: 32 bytes of padding follow the codes).
                        let packed = _mm512_cvtepu32_epi64(_mm256_loadu_si256(
                            codes.add(off[j]) as *const __m256i
                        ));
                        let nib =
                            _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, packed), low);
                        let wv = _mm512_mask_expand_epi8(eight, mask, nib);
                        let dot = _mm512_dpbusd_epi32(start, wv, xv);
                        group_acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dx, group_acc[j]);
                    }
                    off[j] += (mask.count_ones() as usize).div_ceil(2);
                }
            }
            for j in 0..N {
                let s = *w.scales.get_unchecked((r0 + j) * w.groups + g);
                acc[j] = _mm512_fmadd_ps(group_acc[j], _mm512_set1_ps(s), acc[j]);
            }
        }
        for j in 0..N {
            y[j] = _mm512_reduce_add_ps(acc[j]);
        }
    }

    /// AVX2 rows: codes expanded on the stack, `vpmaddubsw` + `vpmaddwd` dots.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; as for [`rows_vbmi2`] otherwise.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rows_avx2(w: &Int4IeBme, r0: usize, p: &Prepared, y: &mut [f32]) {
        let ones = _mm256_set1_epi16(1);
        let bpr = w.blocks_per_row;
        let mut wb = [0i8; COLS];
        for (i, out) in y.iter_mut().enumerate() {
            let r = r0 + i;
            let masks = &w.masks[r * bpr..(r + 1) * bpr];
            let mut off = w.row_offsets[r];
            let mut acc = _mm256_setzero_ps();
            for (b, &mask) in masks.iter().enumerate() {
                let bytes = (mask.count_ones() as usize).div_ceil(2);
                if mask != 0 && p.live[b] {
                    expand_scalar(mask, &w.codes[off..], &mut wb);
                    let s = w.scales[r * w.groups + b * COLS / w.group_size];
                    for h in 0..2 {
                        let wv = _mm256_loadu_si256(wb.as_ptr().add(32 * h) as *const __m256i);
                        let xu = _mm256_loadu_si256(
                            p.xu.as_ptr().add(b * COLS + 32 * h) as *const __m256i
                        );
                        // u8 x s8 pairs: |255 * 7 * 2| fits i16, no saturation.
                        let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(xu, wv), ones);
                        let bias = _mm256_madd_epi16(
                            _mm256_maddubs_epi16(_mm256_set1_epi8(-128), wv),
                            ones,
                        );
                        let isum = _mm256_sub_epi32(dot, bias);
                        let f = _mm256_set1_ps(p.dx[2 * b + h] * s);
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), f, acc);
                    }
                }
                off += bytes;
            }
            let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
            *out = _mm_cvtss_f32(s);
        }
    }
}

#[cfg(test)]
mod tests;

/// The IE-BME matrix behind `f` when `f` is one of the IE-BME implementations (the format's
/// own, [`Int4IeBme`], [`F16IeBme`]): for backends that take the encoded
/// matrix as it is (the GPU upload) rather than its decoded values.
pub fn ie_bme_source(f: &dyn WeightFormat) -> Option<&IeBme> {
    let any = f.as_any()?;
    any.downcast_ref::<IeBme>()
        .or_else(|| any.downcast_ref::<Int4IeBme>().map(Int4IeBme::source))
        .or_else(|| any.downcast_ref::<F16IeBme>().map(F16IeBme::source))
}
