//! Balanced-CBC multiplied on the CPU through a **row-group-major record layout** built at load.
//!
//! The Balanced-CBC blob (512-row tiles of 32 lanes, the GPU's layout) stays what a pack stores
//! and what this layer writes back; only the in-memory copy differs. Balanced sparsity gives
//! every group of 16 output rows of one input column at most N nonzeros (N:16, N fixed for the
//! matrix), so the CPU copy needs no offsets table: column `c` of group `g` is a fixed-size
//! record at a computed position.
//!
//! Layout, one `u16` array: group `g` (rows `16 g .. 16 g + 15`) holds the K columns' records
//! one after the other, `K (N + 1)` entries, so a group is one contiguous stream (the reason
//! for rows, see [`crate::tiled_cbc::rows`]: a product reads every stored weight block after block,
//! the stream the prefetchers follow; an inactive input is skipped inside the stream). Two
//! arrangements of a group, picked at build ([`Arrangement`]):
//!
//! * interleaved (the default): record `c` = the `u16` row mask (bit `r` = row `16 g + r`
//!   stores a nonzero), then N f16 values: the nonzeros in row order, then +0 fill;
//! * split: the K masks, then the K value runs of N (aligned value loads when N is even).
//!
//! Measured on the 2-core Zen 4 (`sieve bench cpu`, SmolLM2-135M, docs/BENCHMARKS.md): split
//! decoded 44-61 tok/s against 55-123 for interleaved (sp 0.5 and 0.7, a loaded machine, but
//! split lost every alternating run), so the single-stream interleaved records are the default;
//! `SIEVE_BCBC_CPU=split` picks the other for comparison. At ~80 tok/s an sp 0.5 pack streams
//! ~12 GB/s, what dense rows reach on this machine: decode is bound by memory, not the kernel.
//! Also tried and dropped (same runs): two groups per pass over the active columns (one
//! broadcast for 32 rows, but two streams; 57-75 tok/s against 72-108) and a software prefetch
//! 1 KiB ahead at each active column (no gain, 67-91).
//!
//! The mask holds the nonzeros only (the format's padding slots are +0 and need no place): the
//! kernels load all N values with one masked load and place the first `popcount(mask)` of them.
//! Per group and ACTIVE column (active inputs listed once per call):
//! * AVX-512 + VBMI2: a masked load of the N values (mask `(1 << N) - 1`), `vpexpandw` (the
//!   register form; the memory form is microcoded on Zen 4) by the row mask, one `vcvtph2ps`,
//!   one FMA with the broadcast activation into 16 row sums in one zmm register (two registers
//!   alternating columns, for ILP);
//! * AVX-512 without VBMI2: a masked load, `vcvtph2ps`, `vexpandps` by the mask, one FMA;
//! * AVX2: per 8 rows a load, `vcvtph2ps`, `vpermps` by a rank table, a mask, one FMA;
//! * portable: a scalar walk of the set bits.
//!
//! Groups are split over the thread pool, several per task. Every path sums the same products
//! in another order only. Activations that are not finite take the portable path (the SIMD
//! paths multiply unstored weights as zeros, and `0 · inf` would put a NaN in rows that do not
//! use that input). Batched products (prefill) decode the matrix into a per-thread f16
//! row-major buffer and run the blocked GEMM, as [`crate::tiled_cbc::RowTiledCbc`] does.
//!
//! **8-bit records** ([`int8`]): when every row's stored values lie exactly on a symmetric int8
//! grid (`sieve pack --values int8`, [`sieve_formats::value_grid`]), the build keeps one `i8`
//! per value and one f32 scale per row instead of f16 values: a record is the mask then N
//! bytes, and matrix-vector products sum `q · x` and scale each row once. Batched products
//! still decode to f16 (`q · s_r`, the stored value exactly) for the GEMM, so prefill and decode
//! multiply the same weights. `SIEVE_BCBC_CPU=f16` (or `split`) keeps the f16 records.
//!
//! **4-bit records** ([`int4`]): when every row lies on 4-bit grids with one f16 scale per
//! group of 32, 64 or 128 input columns (`sieve pack --values int4[:G]`,
//! [`sieve_formats::value_grid::INT4`]), the build keeps a nibble per value: a record is the
//! mask then `ceil(N / 2)` bytes (6 at N = 8), and products scale each column group's 16 sums
//! once. Tried first at load, then int8, then f16. [`int4_quads`] lays the same values out
//! as 16 x 4 tiles for AVX-512 VNNI with 8-bit activations (`SIEVE_BCBC_CPU=int4-quads`;
//! measured slower here, kept for comparison).

use crate::gemm;
use crate::options::{BalancedCbcRecords, CpuKernelOptions};
use crate::simd::SimdLevel;
use crate::tiled_cbc::columns::active_inputs;
use half::f16;
use rayon::prelude::*;
use sieve_formats::balanced_cbc::BalancedCbc;
use sieve_formats::blob::ByteWriter;
use sieve_formats::format::{check_group_args, check_product_args};
use sieve_formats::matrix::is_zero;
use sieve_formats::{DenseMatrix, FormatError, FormatKind, Storage, Threshold, WeightFormat};

/// Rows per group: one `u16` mask per (group, column), one register of f32 sums.
pub const GROUP: usize = 16;
/// Extra `u16` entries after the last group, so that the AVX2 kernel's 8-value loads never
/// read past the array.
const TAIL: usize = 16;

mod int4;
mod int4_quads;
mod int8;
use int4::Int4Records;
use int4_quads::{Int4Quads, QuadActivations};
use int8::Int8Records;

/// How a group's masks and values are arranged (module notes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrangement {
    /// Record per column: mask, then N values.
    Interleaved,
    /// The group's K masks, then its K runs of N values.
    Split,
}

impl Arrangement {
    /// `SIEVE_BCBC_CPU=split` ([`BalancedCbcRecords::Split`]) picks [`Arrangement::Split`],
    /// anything else the default.
    pub fn of(options: &CpuKernelOptions) -> Self {
        if options.balanced_cbc == BalancedCbcRecords::Split {
            Arrangement::Split
        } else {
            Arrangement::Interleaved
        }
    }
}

/// What a record holds per stored weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Values {
    /// The f16 value.
    F16,
    /// The `i8` index on the row's int8 grid (module notes).
    Int8,
    /// The 4-bit index on the grid of its row and group of `columns` input columns, in
    /// per-column records or in quads of columns ([`Int4Layout`]).
    Int4 { columns: usize, layout: Int4Layout },
}

impl std::fmt::Display for Values {
    /// `f16`, `int8`, `int4:G` or `int4:G quads` (as `sieve pack --values` names the grids).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Values::F16 => f.write_str("f16"),
            Values::Int8 => f.write_str("int8"),
            Values::Int4 {
                columns,
                layout: Int4Layout::Columns,
            } => write!(f, "int4:{columns}"),
            Values::Int4 {
                columns,
                layout: Int4Layout::Quads,
            } => write!(f, "int4:{columns} quads"),
        }
    }
}

/// How 4-bit records are laid out (module notes of [`int4`] and [`int4_quads`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int4Layout {
    /// A record per (group of 16 rows, column), f32 FMAs.
    Columns,
    /// A record per (group of 16 rows, 4 columns), 8-bit activations and AVX-512 VNNI.
    Quads,
}

/// The 8-bit or 4-bit records of a matrix whose stored values lie on integer grids.
#[derive(Clone, Debug, PartialEq)]
enum Packed {
    Int8(Int8Records),
    Int4(Int4Records),
    Int4Quads(Int4Quads),
}

/// Whether `SIEVE_BCBC_CPU` asks for f16 records (`f16`, or `split`, which only f16 has).
fn f16_forced(options: &CpuKernelOptions) -> bool {
    matches!(
        options.balanced_cbc,
        BalancedCbcRecords::F16 | BalancedCbcRecords::Split
    )
}

/// Balanced-CBC with SIMD products over a row-group-major record layout (module notes); kind,
/// storage and blob are those of the [`BalancedCbc`] it was built from.
#[derive(Clone, Debug, PartialEq)]
pub struct FastBalancedCbc {
    rows: usize,
    cols: usize,
    /// N, the values per record.
    slots: usize,
    arrangement: Arrangement,
    /// Entries between the masks of consecutive columns of a group.
    mask_stride: usize,
    /// Entry of column 0's first value in a group, relative to the group's start.
    value_start: usize,
    /// Entries between the first values of consecutive columns of a group.
    value_stride: usize,
    /// `groups · K · (N + 1)` entries, then [`TAIL`] zeros; only the TAIL when `packed` holds
    /// the records.
    data: Vec<u16>,
    /// The 8-bit or 4-bit records, when the build found every row on integer grids.
    packed: Option<Packed>,
    /// The Balanced-CBC storage (what the blob holds).
    storage: Storage,
}

/// One token's active inputs, ready for the kernels.
struct Prepared {
    cols: Vec<u32>,
    xs: Vec<f32>,
    /// Whether every active input is finite (else the portable kernel runs, module notes).
    finite: bool,
    /// How many active inputs lie before each multiple of 32 columns (the 4-bit records'
    /// column groups, [`int4::bounds`]; empty when no 4-bit records use this preparation).
    bounds: Vec<u32>,
    /// The active inputs quantized for the 4-bit quads (when asked for and all finite).
    quads: Option<QuadActivations>,
}

impl FastBalancedCbc {
    /// Builds the CPU layout from a Balanced-CBC matrix: 8-bit records when its rows lie on
    /// int8 grids, else f16 records arranged as `SIEVE_BCBC_CPU` says (`SIEVE_BCBC_CPU=f16` or
    /// `split` forces f16 records).
    pub fn new(balanced: &BalancedCbc) -> Self {
        Self::with_options(balanced, CpuKernelOptions::global())
    }

    /// [`Self::new`] with the switches of `options` instead of the process's.
    pub fn with_options(balanced: &BalancedCbc, options: &CpuKernelOptions) -> Self {
        // Decoded once for both attempts (a load builds every linear of a pack).
        let w = balanced.decode();
        if !f16_forced(options) {
            if let Some(fast) = Self::int4_from(balanced, &w, options) {
                return fast;
            }
            if let Some(fast) = Self::int8_from(balanced, &w, 1) {
                return fast;
            }
        }
        Self::f16_from(balanced, &w, Arrangement::of(options))
    }

    /// Builds the 4-bit records (per column, or in quads as `SIEVE_BCBC_CPU=int4-quads` asks),
    /// or `None` when a row is not on 4-bit grids of 128, 64 or 32 columns.
    pub fn with_int4(balanced: &BalancedCbc) -> Option<Self> {
        Self::int4_from(balanced, &balanced.decode(), CpuKernelOptions::global())
    }

    /// [`Self::with_int4`] in the given layout; `None` also when this CPU cannot run the
    /// quads' kernel (AVX-512 VBMI2 and VNNI).
    pub fn with_int4_layout(balanced: &BalancedCbc, layout: Int4Layout) -> Option<Self> {
        Self::int4_in(balanced, &balanced.decode(), layout)
    }

    /// The 4-bit records of `balanced`, whose decoded matrix is `w`: per column, or in quads
    /// when `SIEVE_BCBC_CPU=int4-quads` asks and the CPU has AVX-512 VBMI2 and VNNI. Measured
    /// on the 2-core Zen 4 (`sieve generate --profile`, three alternating runs of an sp 0.5 /
    /// dp 0.5 pack): the per-column records decoded 215-228 tok/s, the quads 159-204; the
    /// quads' kernel runs fewer instructions, but quantizing the activations and the 512-bit
    /// tile expansions cost more than they save at this model's sizes.
    fn int4_from(
        balanced: &BalancedCbc,
        w: &DenseMatrix,
        options: &CpuKernelOptions,
    ) -> Option<Self> {
        let quads_asked = options.balanced_cbc == BalancedCbcRecords::Int4Quads;
        let layout = if int4_quads::supported() && quads_asked {
            Int4Layout::Quads
        } else {
            Int4Layout::Columns
        };
        Self::int4_in(balanced, w, layout)
    }

    fn int4_in(balanced: &BalancedCbc, w: &DenseMatrix, layout: Int4Layout) -> Option<Self> {
        let packed = match layout {
            Int4Layout::Columns => Packed::Int4(Int4Records::build(w, balanced.slots())?),
            Int4Layout::Quads if int4_quads::supported() => {
                Packed::Int4Quads(Int4Quads::build(w, balanced.slots())?)
            }
            Int4Layout::Quads => return None,
        };
        Some(Self {
            packed: Some(packed),
            ..Self::packed_shell(balanced, w)
        })
    }

    /// The fields of a layout whose records live in `packed` (filled by the caller).
    fn packed_shell(balanced: &BalancedCbc, w: &DenseMatrix) -> Self {
        Self {
            rows: w.rows(),
            cols: w.cols(),
            slots: balanced.slots(),
            arrangement: Arrangement::Interleaved,
            mask_stride: 0,
            value_start: 0,
            value_stride: 0,
            data: vec![0; TAIL],
            packed: None,
            storage: balanced.storage(),
        }
    }

    /// Builds the 8-bit records, or `None` when a row is not on an int8 grid.
    pub fn with_int8(balanced: &BalancedCbc) -> Option<Self> {
        Self::with_int8_aligned(balanced, 1)
    }

    /// [`Self::with_int8`] with records padded to a multiple of `align` bytes (the layout
    /// experiment of `examples/balanced_bench.rs`; the loader uses unpadded records).
    pub fn with_int8_aligned(balanced: &BalancedCbc, align: usize) -> Option<Self> {
        Self::int8_from(balanced, &balanced.decode(), align)
    }

    /// The 8-bit records of `balanced`, whose decoded matrix is `w`.
    fn int8_from(balanced: &BalancedCbc, w: &DenseMatrix, align: usize) -> Option<Self> {
        let records = Int8Records::build(w, balanced.slots(), align)?;
        Some(Self {
            packed: Some(Packed::Int8(records)),
            ..Self::packed_shell(balanced, w)
        })
    }

    /// Builds the CPU layout with the given arrangement of each group.
    pub fn with_arrangement(balanced: &BalancedCbc, arrangement: Arrangement) -> Self {
        Self::f16_from(balanced, &balanced.decode(), arrangement)
    }

    /// The f16 records of `balanced`, whose decoded matrix is `w`.
    fn f16_from(balanced: &BalancedCbc, w: &DenseMatrix, arrangement: Arrangement) -> Self {
        let (m, k, n) = (w.rows(), w.cols(), balanced.slots());
        let (mask_stride, value_start, value_stride) = match arrangement {
            Arrangement::Interleaved => (n + 1, 1, n + 1),
            Arrangement::Split => (1, k, n),
        };
        let group_len = k * (n + 1);
        let groups = m.div_ceil(GROUP);
        let mut data = vec![0u16; groups * group_len + TAIL];
        let src = w.data();
        data[..groups * group_len]
            .par_chunks_mut(group_len.max(1))
            .enumerate()
            .for_each(|(g, out)| {
                let rows = g * GROUP..((g + 1) * GROUP).min(m);
                for c in 0..k {
                    let mut mask = 0u16;
                    let mut at = value_start + c * value_stride;
                    for (i, r) in rows.clone().enumerate() {
                        let v = src[r * k + c];
                        // Exactly the entries Balanced-CBC reports (a negative zero is kept).
                        if !is_zero(v) {
                            mask |= 1 << i;
                            out[at] = v.to_bits();
                            at += 1;
                        }
                    }
                    debug_assert!(mask.count_ones() as usize <= n);
                    out[c * mask_stride] = mask;
                }
            });
        Self {
            rows: m,
            cols: k,
            slots: n,
            arrangement,
            mask_stride,
            value_start,
            value_stride,
            data,
            packed: None,
            storage: balanced.storage(),
        }
    }

    /// N, the values per record.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The arrangement of each group (8-bit and 4-bit records are interleaved).
    pub fn arrangement(&self) -> Arrangement {
        self.arrangement
    }

    /// What the records hold per weight.
    pub fn values(&self) -> Values {
        match &self.packed {
            Some(Packed::Int8(_)) => Values::Int8,
            Some(Packed::Int4(r)) => Values::Int4 {
                columns: r.columns(),
                layout: Int4Layout::Columns,
            },
            Some(Packed::Int4Quads(r)) => Values::Int4 {
                columns: r.columns(),
                layout: Int4Layout::Quads,
            },
            None => Values::F16,
        }
    }

    /// Bytes one matrix-vector product streams (masks + values): what decode reads per token.
    pub fn cpu_layout_bytes(&self) -> usize {
        match &self.packed {
            Some(Packed::Int8(r)) => r.layout_bytes(),
            Some(Packed::Int4(r)) => r.layout_bytes(),
            Some(Packed::Int4Quads(r)) => r.layout_bytes(),
            None => 2 * (self.data.len() - TAIL),
        }
    }

    fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    fn group_len(&self) -> usize {
        self.cols * (self.slots + 1)
    }

    /// The active inputs of `x` for the kernels of `users` (matrices of `K = self.cols`
    /// inputs); only what their records read is computed: the column-group bounds for 4-bit
    /// records, the quantized activations for 4-bit quads (when all finite).
    fn prepare(&self, x: &[f32], threshold: Threshold, users: &[&FastBalancedCbc]) -> Prepared {
        let (cols, xs) = active_inputs(x, threshold);
        let finite = xs.iter().all(|v| v.is_finite());
        let uses =
            |want: fn(&Packed) -> bool| users.iter().any(|m| m.packed.as_ref().is_some_and(want));
        let bounds = if uses(|r| matches!(r, Packed::Int4(_))) {
            int4::bounds(&cols, self.cols)
        } else {
            Vec::new()
        };
        let quads = (finite && uses(|r| matches!(r, Packed::Int4Quads(_))))
            .then(|| QuadActivations::new(self.cols, &cols, &xs));
        Prepared {
            cols,
            xs,
            finite,
            bounds,
            quads,
        }
    }

    /// `out[i] = W[16 g + i] · x` for the rows of group `g` (`out.len()` of them).
    fn group_with(&self, level: SimdLevel, g: usize, p: &Prepared, out: &mut [f32]) {
        debug_assert!(out.len() <= GROUP && g < self.groups());
        let mut sums = [0f32; GROUP];
        match &self.packed {
            Some(Packed::Int4(r)) => {
                r.group(level, self.cols, g, p, &mut sums);
                out.copy_from_slice(&sums[..out.len()]);
                return;
            }
            Some(Packed::Int4Quads(r)) => {
                r.group(level, g, p, p.quads.as_ref(), &mut sums);
                out.copy_from_slice(&sums[..out.len()]);
                return;
            }
            _ => {}
        }
        if let Some(Packed::Int8(r)) = &self.packed {
            let (k, n) = (self.cols, self.slots);
            match level {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the level is supported (callers cap it by `or_portable`); the records
                // were built by `Int8Records::build` for this matrix (K columns, N values per
                // record, TAIL bytes after the last group) and `p.cols` are its columns.
                SimdLevel::Avx512Vbmi2 if p.finite => unsafe {
                    int8::x86::group_vbmi2(r, k, n, g, p, &mut sums)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                SimdLevel::Avx512 if p.finite => unsafe {
                    int8::x86::group_avx512(r, k, n, g, p, &mut sums)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                SimdLevel::Avx2 if p.finite => unsafe {
                    int8::x86::group_avx2(r, k, g, p, &mut sums)
                },
                _ => r.group_portable(k, g, p, &mut sums),
            }
            r.scale(g, &mut sums);
            out.copy_from_slice(&sums[..out.len()]);
            return;
        }
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the level is supported (callers cap it by `or_portable`); the layout was
            // built by `with_arrangement` (every record has N values inside `data`, TAIL entries
            // follow the last group) and `p.cols` are columns of this matrix.
            SimdLevel::Avx512Vbmi2 if p.finite => unsafe {
                x86::group_vbmi2(self, g, p, &mut sums)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx512 if p.finite => unsafe { x86::group_avx512(self, g, p, &mut sums) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx2 if p.finite => unsafe { x86::group_avx2(self, g, p, &mut sums) },
            _ => self.group_portable(g, p, &mut sums),
        }
        out.copy_from_slice(&sums[..out.len()]);
    }

    fn group_portable(&self, g: usize, p: &Prepared, sums: &mut [f32; GROUP]) {
        let base = g * self.group_len();
        for (&c, &xv) in p.cols.iter().zip(&p.xs) {
            let c = c as usize;
            let mut bits = self.data[base + c * self.mask_stride];
            let mut pos = base + self.value_start + c * self.value_stride;
            while bits != 0 {
                let i = bits.trailing_zeros() as usize;
                sums[i] += f16::from_bits(self.data[pos]).to_f32() * xv;
                pos += 1;
                bits &= bits - 1;
            }
        }
    }

    /// `y = W · mask_t(x)` through the kernels of `level` (tests compare every level).
    pub fn matvec_with(
        &self,
        level: SimdLevel,
        x: &[f32],
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), FormatError> {
        check_product_args(self.rows, self.cols, x, 1, threshold, y)?;
        let level = level.or_portable();
        let p = self.prepare(x, threshold, &[self]);
        let per = GROUP * groups_per_task(self.groups());
        y.par_chunks_mut(per).enumerate().for_each(|(t, out)| {
            for (i, o) in out.chunks_mut(GROUP).enumerate() {
                self.group_with(level, t * per / GROUP + i, &p, o);
            }
        });
        Ok(())
    }

    /// `Y = mask_t(X) · Wᵀ` for `n` tokens through the kernels of `level`.
    pub fn matmul_with(
        &self,
        level: SimdLevel,
        x: &[f32],
        n: usize,
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), FormatError> {
        let (m, k) = (self.rows, self.cols);
        check_product_args(m, k, x, n, threshold, y)?;
        gemm::decoded_matmul(
            m,
            k,
            x,
            n,
            threshold,
            y,
            |xr, yr| self.matvec_with(level, xr, threshold, yr),
            |w| self.decode_into(level, w),
        )
    }

    /// Writes the dense row-major matrix into `out` (`M · K` entries), groups in parallel.
    /// (`level` picks the 8-bit records' decoder; the f16 records are copied as they are.)
    fn decode_into(&self, level: SimdLevel, out: &mut [f16]) {
        let level = level.or_portable();
        let k = self.cols;
        if k == 0 {
            return;
        }
        let len = self.group_len();
        out.par_chunks_mut(GROUP * k)
            .enumerate()
            .for_each(|(g, rows)| {
                rows.fill(f16::ZERO);
                match &self.packed {
                    Some(Packed::Int8(r)) => return r.decode_group(level, k, g, rows),
                    Some(Packed::Int4(r)) => return r.decode_group(level, k, g, rows),
                    Some(Packed::Int4Quads(r)) => return r.decode_group(k, g, rows),
                    None => {}
                }
                let base = g * len;
                for c in 0..k {
                    let mut bits = self.data[base + c * self.mask_stride];
                    let mut pos = base + self.value_start + c * self.value_stride;
                    while bits != 0 {
                        let i = bits.trailing_zeros() as usize;
                        rows[i * k + c] = f16::from_bits(self.data[pos]);
                        pos += 1;
                        bits &= bits - 1;
                    }
                }
            });
    }
}

/// `ys[i] = mats[i] · mask_t(x)` for matrices that share their input (q|k|v, gate|up): one
/// list of active inputs and one parallel pass over every matrix's row groups, instead of one
/// of each per matrix (each pass wakes the thread pool: a few microseconds on the 2-core
/// machine, where a decode step runs 210 products).
pub fn matvec_group(
    mats: &[&FastBalancedCbc],
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
    let p = first.prepare(x, threshold, mats);
    let per = GROUP * groups_per_task(mats.iter().map(|m| m.groups()).sum());
    let mut tasks: Vec<(&FastBalancedCbc, usize, &mut [f32])> = Vec::new();
    for (m, y) in mats.iter().zip(ys.iter_mut()) {
        for (t, out) in y.chunks_mut(per).enumerate() {
            tasks.push((m, t * per / GROUP, out));
        }
    }
    tasks.into_par_iter().for_each(|(m, g0, out)| {
        for (i, o) in out.chunks_mut(GROUP).enumerate() {
            m.group_with(level, g0 + i, &p, o);
        }
    });
    Ok(())
}

/// Groups per parallel task: about three tasks per thread (576 rows = 36 groups: 6 per task on
/// 2 threads), at least one group.
fn groups_per_task(groups: usize) -> usize {
    let tasks = 3 * rayon::current_num_threads().max(1);
    groups.div_ceil(tasks).max(1)
}

impl WeightFormat for FastBalancedCbc {
    fn cpu_bytes(&self) -> usize {
        self.cpu_layout_bytes()
    }
    fn kind(&self) -> FormatKind {
        FormatKind::BalancedCbc
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> Storage {
        self.storage
    }
    fn decode(&self) -> DenseMatrix {
        let mut data = vec![f16::ZERO; self.rows * self.cols];
        self.decode_into(SimdLevel::detect(), &mut data);
        DenseMatrix::new(self.rows, self.cols, data).expect("built from a validated matrix")
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
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn write_payload(&self, w: &mut ByteWriter) {
        // Balanced-CBC places its padding slots deterministically, so re-encoding with the same
        // N gives back the bytes it was read from.
        BalancedCbc::encode_with_slots(&self.decode(), self.slots)
            .expect("every group of the source matrix holds at most N nonzeros")
            .write_payload(w)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{FastBalancedCbc, Prepared, GROUP};
    use crate::tiled_cbc::columns::RANKS;
    use std::arch::x86_64::*;

    /// Pointers to the mask and the first value of column `c` of the group starting at `base`.
    #[inline(always)]
    unsafe fn record(w: &FastBalancedCbc, base: *const u16, c: u32) -> (u16, *const u16) {
        let c = c as usize;
        (
            *base.add(c * w.mask_stride),
            base.add(w.value_start + c * w.value_stride),
        )
    }

    /// Per active column: a masked load of the N values, `vpexpandw` by the row mask, one
    /// `vcvtph2ps`, one FMA with the broadcast activation; two sums for alternate columns.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL/VBMI2; `w` built by `FastBalancedCbc::with_arrangement`,
    /// `g < groups`, `p` prepared for `w`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,f16c")]
    pub unsafe fn group_vbmi2(w: &FastBalancedCbc, g: usize, p: &Prepared, out: &mut [f32; GROUP]) {
        let base = w.data.as_ptr().add(g * w.group_len());
        let load = ((1u32 << w.slots) - 1) as u16;
        #[inline(always)]
        unsafe fn one(
            w: &FastBalancedCbc,
            base: *const u16,
            load: u16,
            c: u32,
            xv: f32,
            acc: &mut __m512,
        ) {
            let (m, v) = record(w, base, c);
            let raw = _mm256_maskz_loadu_epi16(load, v as *const i16);
            let e = _mm256_maskz_expand_epi16(m, raw);
            *acc = _mm512_fmadd_ps(_mm512_cvtph_ps(e), _mm512_set1_ps(xv), *acc);
        }
        let mut a = _mm512_setzero_ps();
        let mut b = _mm512_setzero_ps();
        let pairs = p.cols.len() / 2;
        for j in 0..pairs {
            let (c0, c1) = (
                *p.cols.get_unchecked(2 * j),
                *p.cols.get_unchecked(2 * j + 1),
            );
            let (x0, x1) = (*p.xs.get_unchecked(2 * j), *p.xs.get_unchecked(2 * j + 1));
            one(w, base, load, c0, x0, &mut a);
            one(w, base, load, c1, x1, &mut b);
        }
        if p.cols.len() % 2 == 1 {
            one(w, base, load, p.cols[2 * pairs], p.xs[2 * pairs], &mut a);
        }
        _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(a, b));
    }

    /// [`group_vbmi2`] without VBMI2: a masked load, `vcvtph2ps`, `vexpandps` by the mask.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL; otherwise as for [`group_vbmi2`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    pub unsafe fn group_avx512(
        w: &FastBalancedCbc,
        g: usize,
        p: &Prepared,
        out: &mut [f32; GROUP],
    ) {
        let base = w.data.as_ptr().add(g * w.group_len());
        let load = ((1u32 << w.slots) - 1) as u16;
        let mut acc = [_mm512_setzero_ps(); 2];
        for (j, (&c, &xv)) in p.cols.iter().zip(&p.xs).enumerate() {
            let (m, v) = record(w, base, c);
            let raw = _mm256_maskz_loadu_epi16(load, v as *const i16);
            let e = _mm512_maskz_expand_ps(m, _mm512_cvtph_ps(raw));
            let a = acc.get_unchecked_mut(j & 1);
            *a = _mm512_fmadd_ps(e, _mm512_set1_ps(xv), *a);
        }
        _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(acc[0], acc[1]));
    }

    /// Per active column and 8 rows: a load, `vcvtph2ps`, `vpermps` by the rank of each set
    /// bit, a mask of the set bits, one FMA.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and POPCNT; otherwise as for [`group_vbmi2`]. Loads
    /// of 8 values may run past a record (into the next one or the TAIL entries), never past
    /// `data`.
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    pub unsafe fn group_avx2(w: &FastBalancedCbc, g: usize, p: &Prepared, out: &mut [f32; GROUP]) {
        let base = w.data.as_ptr().add(g * w.group_len());
        let lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        let mut acc = [_mm256_setzero_ps(); 2];
        for (&c, &xv) in p.cols.iter().zip(&p.xs) {
            let (m, mut v) = record(w, base, c);
            let vx = _mm256_set1_ps(xv);
            for (q, a) in acc.iter_mut().enumerate() {
                let mb = ((m >> (8 * q)) & 0xff) as usize;
                if mb == 0 {
                    continue;
                }
                let raw = _mm256_cvtph_ps(_mm_loadu_si128(v as *const __m128i));
                let idx = _mm256_loadu_si256(RANKS.as_ptr().add(mb) as *const __m256i);
                let placed = _mm256_permutevar8x32_ps(raw, idx);
                let sel = _mm256_set1_epi32(mb as i32);
                let keep = _mm256_cmpeq_epi32(_mm256_and_si256(sel, lane_bits), lane_bits);
                let placed = _mm256_and_ps(placed, _mm256_castsi256_ps(keep));
                *a = _mm256_fmadd_ps(placed, vx, *a);
                v = v.add(mb.count_ones() as usize);
            }
        }
        _mm256_storeu_ps(out.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), acc[1]);
    }
}

#[cfg(test)]
mod tests;
