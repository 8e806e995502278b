//! A cache-blocked f32 GEMM for the batched paths (prefill, calibration, attention over long
//! windows, Gram matrices): `C = A · B` (or `C += A · B`) with `A` (m x k) f32 and `B` (k x n)
//! f32 or f16, both read through arbitrary strides, `C` row-major with a leading dimension.
//!
//! Layout follows the usual GotoBLAS/BLIS scheme, written for AVX2 + FMA (16 ymm registers):
//! * `B` is packed once per call into panels of [`NR`] = 16 columns, `k` rows each, zero-padded
//!   at the right edge; f16 weights are converted to f32 while packing, so the kernel only ever
//!   sees f32 and the conversion costs `k · n` instead of `m · k · n`.
//! * `A` is packed once per call too, into panels of [`MR`] = 6 rows; a tile works through
//!   (row block of [`MC`], depth block of at most [`KC`]) pieces of it, so one `A` block (96 x 320 floats,
//!   120 KiB) stays in L2 while every `B` micro-panel (320 x 16 floats, 20 KiB) streams through
//!   L1. Packing `A` per tile instead would repeat it once per column block.
//! * The packed buffers are per-thread scratch reused across calls: calibration runs thousands
//!   of same-sized products, and fresh zeroed allocations cost page faults each time.
//! * The 6 x 16 micro-kernel keeps 12 accumulators in registers and issues 12 FMAs per 2 loads of
//!   `B` and 6 broadcasts of `A`: enough independent FMAs to hide their latency on two FMA ports.
//! * Parallel calls split the output into (row block, column block) tiles, one rayon task each;
//!   tiles are disjoint, so tasks write `C` without synchronisation.
//!
//! A portable kernel over the same packed layout runs below the AVX2 level ([`crate::simd`]: the
//! CPU lacks AVX2/FMA, or `SIEVE_CPU_SIMD=portable`).

use half::f16;
use rayon::prelude::*;

/// Rows of `A` (and of `C`) per micro-kernel call.
pub const MR: usize = 6;
/// Columns of `B` (and of `C`) per micro-kernel call.
pub const NR: usize = 16;
/// Largest depth of one block: 320 x 16 floats of `B` fill 20 KiB of L1. Depths are split into
/// equal blocks (576 = 2 x 288, not 256 + 256 + 64) so no block is a short one whose `C`
/// traffic outweighs its FMAs.
pub const KC: usize = 320;
/// Rows of `A` per packed block (a multiple of [`MR`]).
pub const MC: usize = 96;
/// Columns of `C` per parallel tile (a multiple of [`NR`]).
pub const NC: usize = 192;

/// A read-only matrix view: element `(i, j)` is `data[offset + i · row_stride + j · col_stride]`.
#[derive(Clone, Copy, Debug)]
pub struct View<'a, T> {
    pub data: &'a [T],
    pub offset: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a, T> View<'a, T> {
    /// A row-major matrix starting at `data[0]` with rows `ld` elements apart.
    pub fn row_major(data: &'a [T], ld: usize) -> Self {
        Self {
            data,
            offset: 0,
            row_stride: ld,
            col_stride: 1,
        }
    }
    /// The transpose of a row-major matrix with rows `ld` apart: element `(i, j)` is
    /// `data[j · ld + i]`.
    pub fn transposed(data: &'a [T], ld: usize) -> Self {
        Self {
            data,
            offset: 0,
            row_stride: 1,
            col_stride: ld,
        }
    }
    /// The same view moved to start at element `(i, j)`.
    pub fn at(self, i: usize, j: usize) -> Self {
        Self {
            offset: self.offset + i * self.row_stride + j * self.col_stride,
            ..self
        }
    }
    /// Whether every element of a `rows x cols` matrix lies inside `data`.
    fn covers(&self, rows: usize, cols: usize) -> bool {
        if rows == 0 || cols == 0 {
            return true;
        }
        let last = (rows - 1)
            .checked_mul(self.row_stride)
            .and_then(|r| (cols - 1).checked_mul(self.col_stride).map(|c| (r, c)))
            .and_then(|(r, c)| r.checked_add(c))
            .and_then(|rc| rc.checked_add(self.offset));
        matches!(last, Some(l) if l < self.data.len())
    }
}

/// Element types `B` may hold; both are packed to f32.
pub trait Element: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    /// Converts a contiguous run.
    fn convert(src: &[Self], dst: &mut [f32]);
}

impl Element for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn convert(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Element for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn convert(src: &[f16], dst: &mut [f32]) {
        crate::kernels::f16_to_f32(src, dst);
    }
}

/// Why a GEMM call was refused (a caller bug, not a data error: callers check shapes first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GemmShapeError(pub String);

impl std::fmt::Display for GemmShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for GemmShapeError {}

/// `C[i][j] (+)= Σ_p A(i, p) · B(p, j)` for `i < m`, `j < n`, `p < k`; `C` row-major with rows
/// `ldc` apart. With `accumulate == false` `C` is overwritten (its old contents, even NaN, are
/// never read). `parallel` spreads tiles over the rayon pool; inside an already parallel loop
/// pass `false`.
#[allow(clippy::too_many_arguments)]
pub fn gemm<B: Element>(
    m: usize,
    n: usize,
    k: usize,
    a: View<'_, f32>,
    b: View<'_, B>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) -> Result<(), GemmShapeError> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    if !b.covers(k, n) {
        return Err(GemmShapeError(format!(
            "gemm {m}x{n}x{k}: the B view is out of bounds"
        )));
    }
    let pack_b = |j0: usize, out: &mut [f32]| pack_b_panel(&b, k, n, j0, out);
    gemm_packing_b(m, n, k, a, &pack_b, c, ldc, accumulate, parallel)
}

/// [`gemm`] with `B` given by a function that writes column `j` of `B` (`k` values) into its
/// second argument: for weights stored in blocks that no strided view can address (quantized
/// rows of `W` with `B = Wᵀ`), decoded one column at a time while packing.
#[allow(clippy::too_many_arguments)]
pub fn gemm_b_columns<F: Fn(usize, &mut [f32]) + Sync>(
    m: usize,
    n: usize,
    k: usize,
    a: View<'_, f32>,
    b_column: F,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) -> Result<(), GemmShapeError> {
    let pack_b = |j0: usize, out: &mut [f32]| {
        let width = (n - j0).min(NR);
        if width < NR {
            out.fill(0.0);
        }
        let mut col = vec![0f32; k];
        for jj in 0..width {
            b_column(j0 + jj, &mut col);
            for (p, v) in col.iter().enumerate() {
                out[p * NR + jj] = *v;
            }
        }
    };
    gemm_packing_b(m, n, k, a, &pack_b, c, ldc, accumulate, parallel)
}

/// The body of [`gemm`] once `B` has a packer: `pack_b(j0, out)` fills the panel of columns
/// `j0..j0 + NR` (see [`pack_b_panel`]).
#[allow(clippy::too_many_arguments)]
fn gemm_packing_b(
    m: usize,
    n: usize,
    k: usize,
    a: View<'_, f32>,
    pack_b: &(dyn Fn(usize, &mut [f32]) + Sync),
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) -> Result<(), GemmShapeError> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    if ldc < n || !a.covers(m, k) {
        return Err(GemmShapeError(format!(
            "gemm {m}x{n}x{k}: an operand view is out of bounds or ldc {ldc} < n"
        )));
    }
    if c.len() < (m - 1) * ldc + n {
        return Err(GemmShapeError(format!(
            "gemm {m}x{n}x{k}: C has {} elements, needs {}",
            c.len(),
            (m - 1) * ldc + n
        )));
    }
    if k == 0 {
        if !accumulate {
            for row in c.chunks_mut(ldc).take(m) {
                row[..n].fill(0.0);
            }
        }
        return Ok(());
    }
    with_scratch(&SCRATCH_B, n.div_ceil(NR) * k * NR, |packed_b| {
        with_scratch(&SCRATCH_A, m.div_ceil(MR) * k * MR, |packed_a| {
            let pack_b = |(p, out): (usize, &mut [f32])| pack_b(p * NR, out);
            let pack_a = |(p, out): (usize, &mut [f32])| pack_a_panel(&a, k, m, p * MR, out);
            if parallel {
                packed_b.par_chunks_mut(k * NR).enumerate().for_each(pack_b);
                packed_a.par_chunks_mut(k * MR).enumerate().for_each(pack_a);
            } else {
                packed_b.chunks_mut(k * NR).enumerate().for_each(pack_b);
                packed_a.chunks_mut(k * MR).enumerate().for_each(pack_a);
            }
            let (packed_a, packed_b) = (&*packed_a, &*packed_b);
            let row_blocks = m.div_ceil(MC);
            let col_blocks = n.div_ceil(NC);
            let out = OutPtr(c.as_mut_ptr());
            let tile = |t: usize| {
                let (ib, jb) = (t / col_blocks, t % col_blocks);
                let (i0, j0) = (ib * MC, jb * NC);
                let (mc, nc) = ((m - i0).min(MC), (n - j0).min(NC));
                // SAFETY: tiles (i0..i0+mc, j0..j0+nc) are disjoint and inside C (checked
                // above).
                unsafe { run_tile(packed_a, packed_b, k, i0, mc, j0, nc, out, ldc, accumulate) };
            };
            if parallel {
                (0..row_blocks * col_blocks).into_par_iter().for_each(tile);
            } else {
                (0..row_blocks * col_blocks).for_each(tile);
            }
        })
    });
    Ok(())
}

thread_local! {
    static SCRATCH_A: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    static SCRATCH_B: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on `len` floats of this thread's scratch buffer (contents unspecified), or on a
/// fresh buffer when the scratch is already in use: a rayon thread waiting inside a parallel
/// GEMM may steal a task that starts another one.
fn with_scratch<R>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<Vec<f32>>>,
    len: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < len {
                buf.resize(len, 0.0);
            }
            f(&mut buf[..len])
        }
        Err(_) => f(&mut vec![0f32; len]),
    })
}

/// A raw pointer to `C` that tasks share; each writes only its own tile.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: writes through it are to disjoint tiles (see `gemm`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Packs columns `j0..j0+NR` of `B` (k x n) into `out[p · NR + jj]`, zero beyond `n`.
fn pack_b_panel<B: Element>(b: &View<'_, B>, k: usize, n: usize, j0: usize, out: &mut [f32]) {
    let width = (n - j0).min(NR);
    if width < NR {
        out.fill(0.0);
    }
    if b.row_stride == 1 {
        // Column j of B is contiguous (B is a transposed row-major matrix, e.g. weights W with
        // B = Wᵀ): convert each column at once, then scatter it into the panel.
        let mut col = vec![0f32; k];
        for jj in 0..width {
            let start = b.offset + (j0 + jj) * b.col_stride;
            B::convert(&b.data[start..start + k], &mut col);
            for (p, v) in col.iter().enumerate() {
                out[p * NR + jj] = *v;
            }
        }
    } else if b.col_stride == 1 {
        for p in 0..k {
            let start = b.offset + p * b.row_stride + j0;
            B::convert(
                &b.data[start..start + width],
                &mut out[p * NR..p * NR + width],
            );
        }
    } else {
        for p in 0..k {
            for jj in 0..width {
                out[p * NR + jj] =
                    b.data[b.offset + p * b.row_stride + (j0 + jj) * b.col_stride].to_f32();
            }
        }
    }
}

/// Packs rows `i0..i0+MR` of `A` (m x k) into `out[p · MR + ii]`, zero beyond `m`.
fn pack_a_panel(a: &View<'_, f32>, k: usize, m: usize, i0: usize, out: &mut [f32]) {
    let rows = (m - i0).min(MR);
    if rows < MR {
        out.fill(0.0);
    }
    if a.row_stride == 1 {
        // Column p of this panel is contiguous (A is a transposed row-major matrix).
        for p in 0..k {
            let start = a.offset + i0 + p * a.col_stride;
            out[p * MR..p * MR + rows].copy_from_slice(&a.data[start..start + rows]);
        }
    } else {
        for ii in 0..rows {
            let base = a.offset + (i0 + ii) * a.row_stride;
            if a.col_stride == 1 {
                for (p, v) in a.data[base..base + k].iter().enumerate() {
                    out[p * MR + ii] = *v;
                }
            } else {
                for p in 0..k {
                    out[p * MR + ii] = a.data[base + p * a.col_stride];
                }
            }
        }
    }
}

/// One output tile over every depth block, from the packed operands.
///
/// # Safety
/// Rows `i0..i0+mc` x columns `j0..j0+nc` of `C` (rows `ldc` apart) must be in bounds and
/// written by no one else during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn run_tile(
    packed_a: &[f32],
    packed_b: &[f32],
    k: usize,
    i0: usize,
    mc: usize,
    j0: usize,
    nc: usize,
    c: OutPtr,
    ldc: usize,
    accumulate: bool,
) {
    let step = k.div_ceil(k.div_ceil(KC));
    for p0 in (0..k).step_by(step) {
        let kc = (k - p0).min(step);
        let add = accumulate || p0 > 0;
        for jr in (0..nc).step_by(NR) {
            let j = j0 + jr;
            let cols = (nc - jr).min(NR);
            let bp = &packed_b[(j / NR) * k * NR + p0 * NR..][..kc * NR];
            for ir in (0..mc).step_by(MR) {
                let rows = (mc - ir).min(MR);
                let ap = &packed_a[((i0 + ir) / MR) * k * MR + p0 * MR..][..kc * MR];
                let cp = c.0.add((i0 + ir) * ldc + j);
                micro_kernel(kc, ap, bp, cp, ldc, rows, cols, add);
            }
        }
    }
}

/// `C[0..rows][0..cols] (+)= Apanel · Bpanel` over depth `kc`.
///
/// # Safety
/// `c` must point at `rows` rows of `cols` writable floats, rows `ldc` apart.
#[allow(clippy::too_many_arguments)]
unsafe fn micro_kernel(
    kc: usize,
    a: &[f32],
    b: &[f32],
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    add: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::SimdLevel::detect() >= crate::simd::SimdLevel::Avx2 {
        // SAFETY: the process's level is supported by this CPU and AVX2 or above, so the CPU
        // has AVX2 and FMA (what the kernel is compiled for); `c` as the caller guarantees.
        return x86::kernel_6x16(kc, a, b, c, ldc, rows, cols, add);
    }
    let mut acc = [[0f32; NR]; MR];
    for p in 0..kc {
        let (ap, bp) = (&a[p * MR..p * MR + MR], &b[p * NR..p * NR + NR]);
        for i in 0..MR {
            for j in 0..NR {
                acc[i][j] += ap[i] * bp[j];
            }
        }
    }
    store(&acc, c, ldc, rows, cols, add);
}

/// Writes (or adds) the valid part of an accumulator tile.
///
/// # Safety
/// As for [`micro_kernel`].
unsafe fn store(
    acc: &[[f32; NR]; MR],
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    add: bool,
) {
    for (i, row) in acc.iter().enumerate().take(rows) {
        let dst = std::slice::from_raw_parts_mut(c.add(i * ldc), cols);
        if add {
            for (d, v) in dst.iter_mut().zip(row) {
                *d += v;
            }
        } else {
            dst.copy_from_slice(&row[..cols]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{store, MR, NR};
    use std::arch::x86_64::*;

    /// The AVX2/FMA 6 x 16 micro-kernel (module docs).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `a` holds `kc · 6` and `b` `kc · 16` floats; `c` as for
    /// [`super::micro_kernel`].
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn kernel_6x16(
        kc: usize,
        a: &[f32],
        b: &[f32],
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        add: bool,
    ) {
        debug_assert!(a.len() >= kc * MR && b.len() >= kc * NR);
        let (mut ap, mut bp) = (a.as_ptr(), b.as_ptr());
        let z = _mm256_setzero_ps();
        let (mut c00, mut c01, mut c10, mut c11, mut c20, mut c21) = (z, z, z, z, z, z);
        let (mut c30, mut c31, mut c40, mut c41, mut c50, mut c51) = (z, z, z, z, z, z);
        for _ in 0..kc {
            let b0 = _mm256_loadu_ps(bp);
            let b1 = _mm256_loadu_ps(bp.add(8));
            let a0 = _mm256_broadcast_ss(&*ap);
            c00 = _mm256_fmadd_ps(a0, b0, c00);
            c01 = _mm256_fmadd_ps(a0, b1, c01);
            let a1 = _mm256_broadcast_ss(&*ap.add(1));
            c10 = _mm256_fmadd_ps(a1, b0, c10);
            c11 = _mm256_fmadd_ps(a1, b1, c11);
            let a2 = _mm256_broadcast_ss(&*ap.add(2));
            c20 = _mm256_fmadd_ps(a2, b0, c20);
            c21 = _mm256_fmadd_ps(a2, b1, c21);
            let a3 = _mm256_broadcast_ss(&*ap.add(3));
            c30 = _mm256_fmadd_ps(a3, b0, c30);
            c31 = _mm256_fmadd_ps(a3, b1, c31);
            let a4 = _mm256_broadcast_ss(&*ap.add(4));
            c40 = _mm256_fmadd_ps(a4, b0, c40);
            c41 = _mm256_fmadd_ps(a4, b1, c41);
            let a5 = _mm256_broadcast_ss(&*ap.add(5));
            c50 = _mm256_fmadd_ps(a5, b0, c50);
            c51 = _mm256_fmadd_ps(a5, b1, c51);
            ap = ap.add(MR);
            bp = bp.add(NR);
        }
        let acc = [
            [c00, c01],
            [c10, c11],
            [c20, c21],
            [c30, c31],
            [c40, c41],
            [c50, c51],
        ];
        if rows == MR && cols == NR {
            for (i, pair) in acc.iter().enumerate() {
                let dst = c.add(i * ldc);
                let (mut lo, mut hi) = (pair[0], pair[1]);
                if add {
                    lo = _mm256_add_ps(lo, _mm256_loadu_ps(dst));
                    hi = _mm256_add_ps(hi, _mm256_loadu_ps(dst.add(8)));
                }
                _mm256_storeu_ps(dst, lo);
                _mm256_storeu_ps(dst.add(8), hi);
            }
        } else {
            let mut tmp = [[0f32; NR]; MR];
            for (row, pair) in tmp.iter_mut().zip(acc.iter()) {
                _mm256_storeu_ps(row.as_mut_ptr(), pair[0]);
                _mm256_storeu_ps(row.as_mut_ptr().add(8), pair[1]);
            }
            store(&tmp, c, ldc, rows, cols, add);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg_values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            })
            .collect()
    }

    /// f64 triple loop over the same views.
    fn reference<B: Element>(
        m: usize,
        n: usize,
        k: usize,
        a: &View<'_, f32>,
        b: &View<'_, B>,
    ) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for p in 0..k {
                    let av = a.data[a.offset + i * a.row_stride + p * a.col_stride];
                    let bv = b.data[b.offset + p * b.row_stride + j * b.col_stride].to_f32();
                    s += f64::from(av) * f64::from(bv);
                }
                c[i * n + j] = s;
            }
        }
        c
    }

    fn assert_close(got: &[f32], want: &[f64], k: usize) {
        // Inputs are in [-0.5, 0.5]: f32 accumulation error grows like k · eps.
        let tol = 1e-6 * (k as f64 + 1.0);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (f64::from(*g) - w).abs() <= tol * (1.0 + w.abs()),
                "element {i}: {g} vs {w}"
            );
        }
    }

    #[test]
    fn odd_shapes_match_a_simple_reference_for_every_layout() {
        // Remainders in every blocking dimension: m % MR, m > MC, n % NR, n > NC, k > KC, k % 8.
        let shapes = [
            (1, 1, 1),
            (5, 17, 3),
            (7, 33, 300),
            (97, 200, 13),
            (13, 5, 513),
            (9, 21, 700),
            (100, 190, 260),
        ];
        for &(m, n, k) in &shapes {
            let a_rm = lcg_values(m * k, (m * 131 + k) as u64);
            let a_t = lcg_values(k * m, (m + 7 * k) as u64);
            let b_rm = lcg_values(k * n, (n * 17 + k) as u64);
            let b_t = lcg_values(n * k, (n + 3 * k) as u64);
            let a_views = [View::row_major(&a_rm, k), View::transposed(&a_t, m)];
            let b_views = [View::row_major(&b_rm, n), View::transposed(&b_t, k)];
            for a in &a_views {
                for b in &b_views {
                    let want = reference(m, n, k, a, b);
                    for parallel in [false, true] {
                        let mut c = vec![f32::NAN; m * n];
                        gemm(m, n, k, *a, *b, &mut c, n, false, parallel).unwrap();
                        assert_close(&c, &want, k);
                    }
                }
            }
        }
    }

    #[test]
    fn f16_b_strided_c_and_accumulate() {
        let (m, n, k) = (11, 37, 70);
        let a = lcg_values(m * k, 1);
        let w32 = lcg_values(n * k, 2);
        let w: Vec<f16> = w32.iter().map(|v| f16::from_f32(*v)).collect();
        let (av, bv) = (View::row_major(&a, k), View::transposed(&w, k));
        let want = reference(m, n, k, &av, &bv);
        // C lives inside a wider matrix (ldc > n) whose other columns must stay untouched.
        let ldc = n + 5;
        let mut c = vec![1.0f32; m * ldc];
        gemm(m, n, k, av, bv, &mut c, ldc, true, true).unwrap();
        for i in 0..m {
            for j in 0..ldc {
                if j < n {
                    let w = want[i * n + j] + 1.0;
                    assert!((f64::from(c[i * ldc + j]) - w).abs() < 1e-4, "{i},{j}");
                } else {
                    assert_eq!(c[i * ldc + j], 1.0);
                }
            }
        }
    }

    #[test]
    fn sub_views_and_bad_shapes() {
        let (m, n, k) = (4, 6, 5);
        let big = lcg_values(20 * 20, 9);
        let a = View::row_major(&big, 20).at(3, 2);
        let b = View::row_major(&big, 20).at(1, 7);
        let want = reference(m, n, k, &a, &b);
        let mut c = vec![0f32; m * n];
        gemm(m, n, k, a, b, &mut c, n, false, false).unwrap();
        assert_close(&c, &want, k);
        // k = 0 overwrites with zeros; out-of-bounds views and a short C are refused.
        gemm(m, n, 0, a, b, &mut c, n, false, false).unwrap();
        assert!(c.iter().all(|v| *v == 0.0));
        assert!(gemm(30, n, k, a, b, &mut c, n, false, false).is_err());
        assert!(gemm(m, n, k, a, b, &mut c[..m * n - 1], n, false, false).is_err());
        assert!(gemm(m, n, k, a, b, &mut c, n - 1, false, false).is_err());
    }
}

/// Batches of fewer tokens run a sparse layer's matrix-vector kernel once per token: below this,
/// decoding the matrix for the GEMM costs more than the GEMM saves ([`decoded_matmul`]).
pub(crate) const DECODE_GEMM_MIN_TOKENS: usize = 4;

thread_local! {
    /// The decoded matrix of a [`decoded_matmul`], reused across calls.
    static DECODED: std::cell::RefCell<Vec<half::f16>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// `Y = mask_t(X) · Wᵀ` (`X` n x K row-major, `Y` n x M) for a sparse layer that can write
/// itself as dense f16 rows: fewer than [`DECODE_GEMM_MIN_TOKENS`] tokens run `matvec` once per
/// token; more decode `W` (M x K, `decode_into` writes all `M · K` entries) into a per-thread
/// f16 panel and run the blocked GEMM on it, the call `FastDense` makes on its rows. Arguments
/// are checked by the caller.
#[allow(clippy::too_many_arguments)]
pub fn decoded_matmul(
    m: usize,
    k: usize,
    x: &[f32],
    n: usize,
    threshold: sieve_formats::Threshold,
    y: &mut [f32],
    matvec: impl Fn(&[f32], &mut [f32]) -> std::result::Result<(), sieve_formats::FormatError>,
    decode_into: impl Fn(&mut [half::f16]),
) -> std::result::Result<(), sieve_formats::FormatError> {
    use sieve_formats::format::is_active;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        y.fill(0.0);
        return Ok(());
    }
    if n < DECODE_GEMM_MIN_TOKENS {
        for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(m)) {
            matvec(xr, yr)?;
        }
        return Ok(());
    }
    let masked;
    let x = if threshold.is_some() {
        masked = x
            .iter()
            .map(|&v| if is_active(v, threshold) { v } else { 0.0 })
            .collect::<Vec<_>>();
        &masked[..]
    } else {
        x
    };
    let mut run = |w: &mut Vec<half::f16>| {
        w.resize(m * k, half::f16::ZERO);
        decode_into(&mut w[..m * k]);
        gemm(
            n,
            m,
            k,
            View::row_major(x, k),
            View::transposed(&w[..m * k], k),
            y,
            m,
            false,
            true,
        )
        .map_err(|e| sieve_formats::FormatError::Option(e.to_string()))
    };
    DECODED.with(|cell| match cell.try_borrow_mut() {
        Ok(mut w) => run(&mut w),
        // A pool thread that picked up this product while waiting inside another one.
        Err(_) => run(&mut Vec::new()),
    })
}
