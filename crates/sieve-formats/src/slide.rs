//! SlideSparse: (2N-2):2N structured sparsity executed as 2:4 (Shao et al., 2026).
//!
//! A (2N-2):2N matrix keeps at most 2N-2 nonzeros in every aligned group ("block") of 2N
//! consecutive columns of each row (N = 4 is 6:8). Sparse tensor cores only run 2:4, so each
//! block is rewritten as N-1 overlapping windows of width 4 and stride 2: window `j` of a block
//! covers block positions `2j .. 2j+4`. Every window keeps at most 2 values (it is 2:4), so the
//! N-1 windows hold exactly the 2N-2 nonzeros a block may have.
//!
//! # Sliding-window decomposition
//! Windows are filled left to right. Window `j` takes the not-yet-assigned nonzeros of its four
//! positions in column order until it holds two; whatever it cannot take from positions
//! `2j+2, 2j+3` spills into window `j+1`, which sees them again. Positions `2j, 2j+1` are seen
//! by no later window, and taking them first (they come first in column order) is the
//! earliest-deadline rule, which never strands a nonzero when one can be placed. One can always
//! be: pairs `0` and `N-1` are covered by one window each, every inner pair by two, so any run of
//! pairs has at least as much window capacity as it can hold nonzeros, and the whole block has
//! exactly 2N-2 slots (Hall's condition holds).
//!
//! # Activation lifting
//! The windows define an expanded matrix `W'` (M x K') with K' = blocks * (N-1) * 4
//! (= K * (N-1) * 4 / (2N) = K * γ, γ = 1.5 for 6:8). Lifted column `b*(N-1)*4 + 4j + s` reads
//! original column `b*2N + 2j + s`, so with `lift(x)[k'] = x[map[k']]` every product of
//! `W'·lift(x)` is a product of `W·x` and each original product occurs exactly once:
//! `W'·lift(x) == W·x`. [`SlideGeometry::lift_map`] is that map.
//!
//! # Padding
//! K need not be a multiple of 2N: the last block is padded with zero columns up to
//! `padded_cols = blocks * 2N`. Lifted positions that read padding map to [`LIFT_PAD`] and lift
//! to `0.0`; stored values there are always `+0`.
//!
//! # Storage (what a 2:4 sparse tensor core consumes)
//! Per row, `groups_per_row = blocks * (N-1)` groups of 4 lifted columns, each holding:
//! - two kept f16 values, in increasing in-group position (`values`, row-major, 2 per group);
//! - a 4-bit metadata nibble `idx0 | idx1 << 2` with `idx0 < idx1` (the in-group positions of the
//!   two values). This is the per-group nibble encoding of PTX `mma.sp` for 16-bit types (valid
//!   nibbles 0x4, 0x8, 0xC, 0x9, 0xD, 0xE). Nibbles are packed 8 per little-endian u32, group
//!   `g` of a row in word `g / 8`, bits `4*(g % 8)..`; each row starts a new word and unused
//!   high nibbles of its last word are 0. This is the plain row-major order, *not* the
//!   per-fragment interleaving `mma.sp` registers expect: a GPU kernel reorders it when staging
//!   tiles (or feeds [`Slide::expanded`] to cuSPARSELt, which compresses on its own).
//!
//! A group with fewer than two nonzeros is filled with `+0` at the lowest unused in-group
//! positions, as 2:4 hardware needs exactly two entries per group. A stored `-0` is a real
//! value (see [`crate::matrix::is_zero`]); decode writes only values that are not `+0`.
//!
//! `storage()`: payload = kept values (2 bytes each, placeholders included), metadata = the
//! packed nibbles. The lift map is not stored: it is a function of (K, N).

use crate::blob::{ByteReader, ByteWriter};
use crate::error::{FormatError, Result};
use crate::format::{check_product_args, is_active, FormatKind, Storage, Threshold, WeightFormat};
use crate::matrix::{is_zero, DenseMatrix};
use crate::random::Pattern;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

/// Smallest and largest supported N: (2N-2):2N from 2:4 up to 14:16.
pub const MIN_N: usize = 2;
pub const MAX_N: usize = 8;
/// Lift-map entry for a lifted position that reads K-padding (lifts to 0.0).
pub const LIFT_PAD: u32 = u32::MAX;
/// Metadata nibbles packed per u32 word.
pub const GROUPS_PER_META_WORD: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlideOptions {
    /// The pattern is (2N-2):2N; N = 4 gives 6:8.
    pub n: usize,
}

impl Default for SlideOptions {
    fn default() -> Self {
        Self { n: 4 }
    }
}

impl SlideOptions {
    pub fn validate(&self) -> Result<()> {
        if !(MIN_N..=MAX_N).contains(&self.n) {
            return Err(FormatError::Option(format!(
                "slide N = {} is outside {MIN_N}..={MAX_N} (pattern (2N-2):2N)",
                self.n
            )));
        }
        Ok(())
    }

    /// The options for an N:M pattern of the form (2N-2):2N, e.g. 6:8 gives N = 4.
    pub fn from_pattern(pattern: Pattern) -> Result<Self> {
        match pattern {
            Pattern::NM { n: kept, m } if m % 2 == 0 && kept + 2 == m => {
                let opts = Self { n: m / 2 };
                opts.validate()?;
                Ok(opts)
            }
            other => Err(FormatError::Pattern(format!(
                "{other:?} is not of the form (2N-2):2N with N in {MIN_N}..={MAX_N}"
            ))),
        }
    }
}

/// The shape arithmetic shared by the encoder, the kernels and a future GPU kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlideGeometry {
    /// N of (2N-2):2N.
    pub n: usize,
    /// K, the original number of columns.
    pub cols: usize,
    /// Blocks of 2N columns per row, the last one zero-padded.
    pub blocks: usize,
    /// blocks * 2N.
    pub padded_cols: usize,
    /// 2:4 groups (windows) per row: blocks * (N-1).
    pub groups_per_row: usize,
    /// K' = groups_per_row * 4, the lifted activation length.
    pub expanded_cols: usize,
    /// u32 metadata words per row: ceil(groups_per_row / 8).
    pub meta_words_per_row: usize,
}

impl SlideGeometry {
    pub fn new(cols: usize, n: usize) -> Result<Self> {
        SlideOptions { n }.validate()?;
        if cols == 0 {
            return Err(FormatError::EmptyMatrix { rows: 0, cols });
        }
        let block = 2 * n;
        let blocks = cols.div_ceil(block);
        let overflow = || FormatError::Option(format!("slide geometry for K = {cols} overflows"));
        let padded_cols = blocks.checked_mul(block).ok_or_else(overflow)?;
        let groups_per_row = blocks.checked_mul(n - 1).ok_or_else(overflow)?;
        let expanded_cols = groups_per_row.checked_mul(4).ok_or_else(overflow)?;
        Ok(Self {
            n,
            cols,
            blocks,
            padded_cols,
            groups_per_row,
            expanded_cols,
            meta_words_per_row: groups_per_row.div_ceil(GROUPS_PER_META_WORD),
        })
    }

    /// Windows per block, N-1.
    pub fn windows_per_block(&self) -> usize {
        self.n - 1
    }

    /// The original column that lifted column `k'` reads, or `None` for K-padding.
    /// `k'` must be below `expanded_cols`.
    pub fn lifted_source(&self, lifted: usize) -> Option<usize> {
        let group = lifted / 4;
        let col = self.group_base_col(group) + lifted % 4;
        (col < self.cols).then_some(col)
    }

    /// The original column of in-group position 0 of group `g` (padding included).
    #[inline(always)]
    pub fn group_base_col(&self, group: usize) -> usize {
        let wpb = self.n - 1;
        (group / wpb) * 2 * self.n + 2 * (group % wpb)
    }

    /// The lift map: entry `k'` is the original column lifted column `k'` reads, or
    /// [`LIFT_PAD`] where it reads K-padding. Length K'.
    pub fn lift_map(&self) -> Vec<u32> {
        (0..self.expanded_cols)
            .map(|kp| match self.lifted_source(kp) {
                Some(c) => u32::try_from(c).unwrap_or(LIFT_PAD),
                None => LIFT_PAD,
            })
            .collect()
    }

    /// `lift(x)`: the K' activations the expanded matrix multiplies.
    pub fn lift(&self, x: &[f32]) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.expanded_cols];
        self.lift_into(x, &mut out)?;
        Ok(out)
    }

    /// [`Self::lift`] into a caller buffer of length K'.
    pub fn lift_into(&self, x: &[f32], out: &mut [f32]) -> Result<()> {
        if x.len() != self.cols {
            return Err(FormatError::Shape {
                what: "activation length (K) to lift",
                expected: self.cols,
                actual: x.len(),
            });
        }
        if out.len() != self.expanded_cols {
            return Err(FormatError::Shape {
                what: "lifted activation length (K')",
                expected: self.expanded_cols,
                actual: out.len(),
            });
        }
        for (g, dst) in out.chunks_exact_mut(4).enumerate() {
            let base = self.group_base_col(g);
            for (s, d) in dst.iter_mut().enumerate() {
                *d = x.get(base + s).copied().unwrap_or(0.0);
            }
        }
        Ok(())
    }
}

/// A (2N-2):2N matrix stored as 2:4 groups over lifted columns (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Slide {
    rows: usize,
    geom: SlideGeometry,
    /// rows * groups_per_row * 2 kept values.
    values: Vec<f16>,
    /// rows * meta_words_per_row packed nibbles.
    metadata: Vec<u32>,
}

impl Slide {
    /// Encodes `w`, refusing it with [`FormatError::Pattern`] (naming the first offending row and
    /// block) if some block of 2N columns holds more than 2N-2 nonzeros.
    pub fn encode(w: &DenseMatrix, opts: &SlideOptions) -> Result<Self> {
        let geom = SlideGeometry::new(w.cols(), opts.n)?;
        if let Some(violation) = find_violation(w, &geom) {
            return Err(violation);
        }
        let rows = w.rows();
        let vals_per_row = geom.groups_per_row * 2;
        let overflow = || FormatError::Option("slide storage size overflows".into());
        let mut values = vec![f16::ZERO; rows.checked_mul(vals_per_row).ok_or_else(overflow)?];
        let mut metadata = vec![
            0u32;
            rows.checked_mul(geom.meta_words_per_row)
                .ok_or_else(overflow)?
        ];
        values
            .par_chunks_mut(vals_per_row)
            .zip(metadata.par_chunks_mut(geom.meta_words_per_row))
            .enumerate()
            .try_for_each(|(r, (vals, meta))| encode_row(w.row(r), r, &geom, vals, meta))?;
        Ok(Self {
            rows,
            geom,
            values,
            metadata,
        })
    }

    pub fn geometry(&self) -> &SlideGeometry {
        &self.geom
    }
    /// N of (2N-2):2N.
    pub fn n(&self) -> usize {
        self.geom.n
    }
    /// K', the lifted activation length.
    pub fn expanded_cols(&self) -> usize {
        self.geom.expanded_cols
    }
    /// Kept values, row-major, two per group (see the module docs for the layout).
    pub fn values(&self) -> &[f16] {
        &self.values
    }
    /// Packed 2-bit index pairs, `meta_words_per_row` u32 words per row.
    pub fn metadata(&self) -> &[u32] {
        &self.metadata
    }
    /// The metadata nibble (`idx0 | idx1 << 2`) of group `group` of row `row`.
    pub fn nibble(&self, row: usize, group: usize) -> u8 {
        let word = self.metadata[row * self.geom.meta_words_per_row + group / GROUPS_PER_META_WORD];
        ((word >> (4 * (group % GROUPS_PER_META_WORD))) & 0xF) as u8
    }
    /// See [`SlideGeometry::lift_map`].
    pub fn lift_map(&self) -> Vec<u32> {
        self.geom.lift_map()
    }
    /// See [`SlideGeometry::lift`]; no threshold is applied.
    pub fn lift(&self, x: &[f32]) -> Result<Vec<f32>> {
        self.geom.lift(x)
    }

    /// The rows of `parts` one after another (q|k|v, gate|up as one matrix): every part must
    /// have the same K and N. Rows are stored independently, so this is their concatenation.
    pub fn concat_rows(parts: &[&Slide]) -> Result<Self> {
        let Some(first) = parts.first() else {
            return Err(FormatError::Option(
                "slide concat_rows of no matrices".into(),
            ));
        };
        if let Some(p) = parts.iter().find(|p| p.geom != first.geom) {
            return Err(FormatError::Option(format!(
                "slide matrices joined by rows must share K and N: {} columns at N = {} vs {} \
                 at N = {}",
                p.geom.cols, p.geom.n, first.geom.cols, first.geom.n
            )));
        }
        Ok(Self {
            rows: parts.iter().map(|p| p.rows).sum(),
            geom: first.geom,
            values: parts
                .iter()
                .flat_map(|p| p.values.iter().copied())
                .collect(),
            metadata: parts
                .iter()
                .flat_map(|p| p.metadata.iter().copied())
                .collect(),
        })
    }

    /// The expanded 2:4 matrix `W'` (M x K'), placeholders as +0. `W'·lift(x) == W·x`. This is
    /// what a cuSPARSELt path would hand to its own compressor.
    pub fn expanded(&self) -> DenseMatrix {
        let kp = self.geom.expanded_cols;
        let mut data = vec![f16::ZERO; self.rows * kp];
        data.par_chunks_mut(kp).enumerate().for_each(|(r, out)| {
            for g in 0..self.geom.groups_per_row {
                let (i0, i1) = split_nibble(self.nibble(r, g));
                let v = &self.values[(r * self.geom.groups_per_row + g) * 2..][..2];
                out[4 * g + i0] = v[0];
                out[4 * g + i1] = v[1];
            }
        });
        DenseMatrix::new(self.rows, kp, data)
            .expect("slide invariants: values finite and shape checked at encode/read")
    }

    pub fn read_payload(r: &mut ByteReader) -> Result<Self> {
        let corrupt = |msg: String| FormatError::Corrupt(format!("slide payload: {msg}"));
        let rows = r.usize()?;
        let cols = r.usize()?;
        let n = r.usize()?;
        if rows == 0 || cols == 0 {
            return Err(corrupt(format!("empty shape {rows} x {cols}")));
        }
        let geom = SlideGeometry::new(cols, n).map_err(|e| corrupt(e.to_string()))?;
        let values = r.f16s()?;
        let metadata = r.u32s()?;
        let vals_per_row = geom.groups_per_row * 2;
        let want_values = rows
            .checked_mul(vals_per_row)
            .ok_or_else(|| corrupt(format!("{rows} rows overflow the value count")))?;
        let want_meta = rows
            .checked_mul(geom.meta_words_per_row)
            .ok_or_else(|| corrupt(format!("{rows} rows overflow the metadata count")))?;
        if values.len() != want_values {
            return Err(corrupt(format!(
                "{} values, expected {want_values}",
                values.len()
            )));
        }
        if metadata.len() != want_meta {
            return Err(corrupt(format!(
                "{} metadata words, expected {want_meta}",
                metadata.len()
            )));
        }
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(corrupt(format!("non-finite value at index {i}")));
        }
        let slide = Self {
            rows,
            geom,
            values,
            metadata,
        };
        (0..rows)
            .into_par_iter()
            .try_for_each(|row| slide.check_row(row))?;
        Ok(slide)
    }

    /// Checks that every nibble is a valid 2:4 pair, tail nibbles are zero, no original column is
    /// stored twice, and padding columns hold only +0.
    fn check_row(&self, row: usize) -> Result<()> {
        let g = &self.geom;
        let wpb = g.windows_per_block();
        let words = &self.metadata[row * g.meta_words_per_row..][..g.meta_words_per_row];
        let tail_groups = g.meta_words_per_row * GROUPS_PER_META_WORD - g.groups_per_row;
        if tail_groups > 0 {
            let last = words[g.meta_words_per_row - 1];
            if last >> (4 * (GROUPS_PER_META_WORD - tail_groups)) != 0 {
                return Err(FormatError::Corrupt(format!(
                    "slide payload: row {row}: unused metadata nibbles are not zero"
                )));
            }
        }
        let vals = &self.values[row * g.groups_per_row * 2..][..g.groups_per_row * 2];
        for b in 0..g.blocks {
            let mut taken = 0u32;
            for j in 0..wpb {
                let group = b * wpb + j;
                let nib = self.nibble(row, group);
                let (i0, i1) = split_nibble(nib);
                if i0 >= i1 {
                    return Err(FormatError::Corrupt(format!(
                        "slide payload: row {row}, group {group}: metadata nibble {nib:#x} is not \
                         an increasing 2:4 index pair"
                    )));
                }
                for (slot, idx) in [i0, i1].into_iter().enumerate() {
                    if is_zero(vals[2 * group + slot]) {
                        continue;
                    }
                    let in_block = 2 * j + idx;
                    let col = b * 2 * g.n + in_block;
                    if col >= g.cols {
                        return Err(FormatError::Corrupt(format!(
                            "slide payload: row {row}: nonzero in padding column {col} (K = {})",
                            g.cols
                        )));
                    }
                    if taken & (1 << in_block) != 0 {
                        return Err(FormatError::Corrupt(format!(
                            "slide payload: row {row}: column {col} is stored by two windows"
                        )));
                    }
                    taken |= 1 << in_block;
                }
            }
        }
        Ok(())
    }

    /// Masks `x` by the threshold, then lifts it.
    fn lift_masked(&self, x: &[f32], threshold: Threshold, out: &mut [f32]) {
        for (g, dst) in out.chunks_exact_mut(4).enumerate() {
            let base = self.geom.group_base_col(g);
            for (s, d) in dst.iter_mut().enumerate() {
                *d = match x.get(base + s) {
                    Some(&v) if is_active(v, threshold) => v,
                    _ => 0.0,
                };
            }
        }
    }

    fn row_values(&self, row: usize) -> &[f16] {
        let per_row = self.geom.groups_per_row * 2;
        &self.values[row * per_row..(row + 1) * per_row]
    }

    fn row_meta(&self, row: usize) -> &[u32] {
        let per_row = self.geom.meta_words_per_row;
        &self.metadata[row * per_row..(row + 1) * per_row]
    }
}

/// The first (row, block) with more than 2N-2 nonzeros, as an error.
fn find_violation(w: &DenseMatrix, geom: &SlideGeometry) -> Option<FormatError> {
    let block = 2 * geom.n;
    let allowed = block - 2;
    (0..w.rows()).into_par_iter().find_map_first(|r| {
        w.row(r).chunks(block).enumerate().find_map(|(b, chunk)| {
            let nnz = chunk.iter().filter(|v| !is_zero(**v)).count();
            (nnz > allowed).then(|| {
                FormatError::Pattern(format!(
                    "slide needs {allowed}:{block} sparsity (N = {}): row {r}, group {b} \
                         (columns {}..{}) has {nnz} nonzeros, at most {allowed} allowed",
                    geom.n,
                    b * block,
                    b * block + chunk.len()
                ))
            })
        })
    })
}

/// The sliding-window decomposition of one row (see the module docs).
fn encode_row(
    row: &[f16],
    r: usize,
    geom: &SlideGeometry,
    vals: &mut [f16],
    meta: &mut [u32],
) -> Result<()> {
    let n = geom.n;
    let wpb = geom.windows_per_block();
    let mut block = [f16::ZERO; 2 * MAX_N];
    for b in 0..geom.blocks {
        let start = b * 2 * n;
        let end = (start + 2 * n).min(row.len());
        block[..2 * n].fill(f16::ZERO);
        block[..end - start].copy_from_slice(&row[start..end]);
        let mut taken = [false; 2 * MAX_N];
        for j in 0..wpb {
            let mut kept: [(usize, f16); 2] = [(0, f16::ZERO); 2];
            let mut used = 0;
            for i in 0..4 {
                let p = 2 * j + i;
                if used < 2 && !taken[p] && !is_zero(block[p]) {
                    kept[used] = (i, block[p]);
                    taken[p] = true;
                    used += 1;
                }
            }
            // No later window sees positions 2j and 2j+1 (nor, after the last window, the final
            // pair); the earliest-deadline order above makes this unreachable for a valid block.
            let mut leaving = if j + 1 == wpb {
                2 * j..2 * n
            } else {
                2 * j..2 * j + 2
            };
            if let Some(p) = leaving.find(|&p| !taken[p] && !is_zero(block[p])) {
                return Err(FormatError::Pattern(format!(
                    "slide: row {r}, column {} could not be placed in a 2:4 window",
                    start + p
                )));
            }
            let [(i0, v0), (i1, v1)] = match used {
                0 => [(0, f16::ZERO), (1, f16::ZERO)],
                1 => {
                    let (i, v) = kept[0];
                    let filler = if i == 0 { 1 } else { 0 };
                    if filler < i {
                        [(filler, f16::ZERO), (i, v)]
                    } else {
                        [(i, v), (filler, f16::ZERO)]
                    }
                }
                _ => kept,
            };
            let group = b * wpb + j;
            vals[2 * group] = v0;
            vals[2 * group + 1] = v1;
            let nib = (i0 | (i1 << 2)) as u32;
            meta[group / GROUPS_PER_META_WORD] |= nib << (4 * (group % GROUPS_PER_META_WORD));
        }
    }
    Ok(())
}

#[inline(always)]
fn split_nibble(nib: u8) -> (usize, usize) {
    ((nib & 3) as usize, ((nib >> 2) & 3) as usize)
}

/// One output: the 2:4 dot product of a row's kept values (already f32) with lifted `xl`.
#[inline]
fn row_dot(vals: &[f32], meta: &[u32], xl: &[f32], groups: usize) -> f32 {
    let mut acc = [0f32; 4];
    for (w, &word) in meta.iter().enumerate() {
        let first = w * GROUPS_PER_META_WORD;
        let last = (first + GROUPS_PER_META_WORD).min(groups);
        let mut bits = word;
        for g in first..last {
            let x4 = &xl[4 * g..4 * g + 4];
            acc[g & 3] += vals[2 * g] * x4[(bits & 3) as usize]
                + vals[2 * g + 1] * x4[((bits >> 2) & 3) as usize];
            bits >>= 4;
        }
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3])
}

impl WeightFormat for Slide {
    fn kind(&self) -> FormatKind {
        FormatKind::Slide
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.geom.cols
    }
    fn storage(&self) -> Storage {
        Storage {
            payload_bytes: self.values.len() * 2,
            metadata_bytes: self.metadata.len() * 4,
        }
    }

    fn decode(&self) -> DenseMatrix {
        let g = &self.geom;
        let k = g.cols;
        let mut data = vec![f16::ZERO; self.rows * k];
        data.par_chunks_mut(k).enumerate().for_each(|(r, out)| {
            let vals = self.row_values(r);
            for group in 0..g.groups_per_row {
                let (i0, i1) = split_nibble(self.nibble(r, group));
                let base = g.group_base_col(group);
                for (slot, idx) in [i0, i1].into_iter().enumerate() {
                    let v = vals[2 * group + slot];
                    if !is_zero(v) {
                        // In range: checked by read_payload, true by construction in encode.
                        out[base + idx] = v;
                    }
                }
            }
        });
        DenseMatrix::new(self.rows, k, data)
            .expect("slide invariants: values finite and shape checked at encode/read")
    }

    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<()> {
        check_product_args(self.rows, self.geom.cols, x, 1, threshold, y)?;
        // The threshold acts on the original x, so a lifted copy of an inactive element is
        // inactive too: semantics match every other format.
        let mut xl = vec![0f32; self.geom.expanded_cols];
        self.lift_masked(x, threshold, &mut xl);
        let groups = self.geom.groups_per_row;
        y.par_iter_mut().enumerate().for_each_init(
            || vec![0f32; groups * 2],
            |buf, (r, yr)| {
                self.row_values(r).convert_to_f32_slice(buf);
                *yr = row_dot(buf, self.row_meta(r), &xl, groups);
            },
        );
        Ok(())
    }

    fn matmul(&self, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) -> Result<()> {
        let (m, k) = (self.rows, self.geom.cols);
        check_product_args(m, k, x, n, threshold, y)?;
        let kp = self.geom.expanded_cols;
        let mut xl = vec![0f32; n * kp];
        xl.par_chunks_mut(kp)
            .zip(x.par_chunks(k))
            .for_each(|(dst, src)| self.lift_masked(src, threshold, dst));
        let groups = self.geom.groups_per_row;
        // Parallel over weight rows: each row's values are converted from f16 once for all tokens.
        let mut yt = vec![0f32; m * n];
        yt.par_chunks_mut(n.max(1)).enumerate().for_each_init(
            || vec![0f32; groups * 2],
            |buf, (r, out)| {
                self.row_values(r).convert_to_f32_slice(buf);
                let meta = self.row_meta(r);
                for (t, o) in out.iter_mut().enumerate() {
                    *o = row_dot(buf, meta, &xl[t * kp..(t + 1) * kp], groups);
                }
            },
        );
        for r in 0..m {
            for t in 0..n {
                y[t * m + r] = yt[r * n + t];
            }
        }
        Ok(())
    }

    fn write_payload(&self, w: &mut ByteWriter) {
        w.u64(self.rows as u64);
        w.u64(self.geom.cols as u64);
        w.u64(self.geom.n as u64);
        w.f16s(&self.values);
        w.u32s(&self.metadata);
    }
    /// The encoded matrix itself, for backends that take it as it is (the GPU upload).
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

/// Prunes `w` to (2N-2):2N by magnitude: in every block of 2N columns of each row the
/// smallest-|w| entries become +0 until at most 2N-2 remain (ties: the later column goes).
/// Blocks already within the pattern are untouched.
pub fn prune_to_pattern(w: &DenseMatrix, n: usize) -> Result<DenseMatrix> {
    SlideOptions { n }.validate()?;
    let block = 2 * n;
    let allowed = block - 2;
    let mut data = w.data().to_vec();
    data.par_chunks_mut(w.cols()).for_each(|row| {
        for chunk in row.chunks_mut(block) {
            let mut order: Vec<usize> = (0..chunk.len()).filter(|&i| !is_zero(chunk[i])).collect();
            if order.len() <= allowed {
                continue;
            }
            // Largest magnitude first, earlier column first among equals.
            order.sort_by(|&a, &b| {
                chunk[b]
                    .to_f32()
                    .abs()
                    .total_cmp(&chunk[a].to_f32().abs())
                    .then(a.cmp(&b))
            });
            for &i in &order[allowed..] {
                chunk[i] = f16::ZERO;
            }
        }
    });
    DenseMatrix::new(w.rows(), w.cols(), data)
}

/// Encodes `w` for reporting when its pattern may not fit: with the N implied by `pattern` when
/// it is (2N-2):2N, else with the default N; if `w` still violates the pattern it is first
/// pruned to (2N-2):2N by magnitude, and that pruned matrix is returned alongside.
pub fn encode_or_prune(w: &DenseMatrix, pattern: Pattern) -> Result<(Slide, Option<DenseMatrix>)> {
    let opts = SlideOptions::from_pattern(pattern).unwrap_or_default();
    match Slide::encode(w, &opts) {
        Ok(s) => Ok((s, None)),
        Err(FormatError::Pattern(_)) => {
            let pruned = prune_to_pattern(w, opts.n)?;
            Ok((Slide::encode(&pruned, &opts)?, Some(pruned)))
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(rows: usize, cols: usize, v: &[f32]) -> DenseMatrix {
        DenseMatrix::from_f32(rows, cols, v).unwrap()
    }

    #[test]
    fn geometry_of_6_8() {
        let g = SlideGeometry::new(16, 4).unwrap();
        assert_eq!(g.blocks, 2);
        assert_eq!(g.groups_per_row, 6);
        assert_eq!(g.expanded_cols, 24); // 16 * 3 * 4 / 8
        assert_eq!(g.meta_words_per_row, 1);
        // Block 0: windows start at columns 0, 2, 4; block 1 at 8, 10, 12.
        let map = g.lift_map();
        let want: Vec<u32> = [0, 2, 4, 8, 10, 12]
            .iter()
            .flat_map(|&b| (b..b + 4).collect::<Vec<u32>>())
            .collect();
        assert_eq!(map, want);
    }

    #[test]
    fn padding_lifts_to_zero() {
        let g = SlideGeometry::new(10, 4).unwrap(); // padded to 16
        assert_eq!(g.padded_cols, 16);
        let map = g.lift_map();
        assert_eq!(&map[12..16], &[8, 9, LIFT_PAD, LIFT_PAD]);
        let x: Vec<f32> = (0..10).map(|i| i as f32 + 1.0).collect();
        let xl = g.lift(&x).unwrap();
        for (kp, &src) in map.iter().enumerate() {
            let want = if src == LIFT_PAD {
                0.0
            } else {
                x[src as usize]
            };
            assert_eq!(xl[kp], want);
        }
        assert!(g.lift(&x[..9]).is_err());
    }

    #[test]
    fn greedy_spills_into_next_window() {
        // 6:8 block with nonzeros at 0, 1, 2, 3, 4, 5: window 0 takes 0, 1; 2, 3 spill into
        // window 1 (columns 2..6), which fills up, so 4, 5 spill into window 2 (4..8).
        let w = m(1, 8, &[1., 2., 3., 4., 5., 6., 0., 0.]);
        let s = Slide::encode(&w, &SlideOptions::default()).unwrap();
        let vals: Vec<f32> = s.values().iter().map(|v| v.to_f32()).collect();
        assert_eq!(vals, vec![1., 2., 3., 4., 5., 6.]);
        assert_eq!(s.nibble(0, 0), 0b0100); // (0, 1)
        assert_eq!(s.nibble(0, 1), 0b0100); // window 1 positions 0, 1 = columns 2, 3
        assert_eq!(s.nibble(0, 2), 0b0100); // window 2 positions 0, 1 = columns 4, 5
        assert_eq!(s.decode(), w);
    }

    #[test]
    fn edges_and_placeholders() {
        // Nonzeros at 0, 1 and 6, 7 only: windows 0 and 2 take them, window 1 is empty (+0s).
        let w = m(1, 8, &[1., 2., 0., 0., 0., 0., 7., 8.]);
        let s = Slide::encode(&w, &SlideOptions::default()).unwrap();
        assert_eq!(s.nibble(0, 1), 0b0100);
        assert!(is_zero(s.values()[2]) && is_zero(s.values()[3]));
        assert_eq!(s.nibble(0, 2), 0b1110); // (2, 3) = columns 6, 7
        assert_eq!(s.decode(), w);
        // One nonzero at in-window position 0 gets a filler at 1; at position 3, a filler at 0.
        let w = m(1, 8, &[0., 0., 0., 0., 0., 0., 0., 9.]);
        let s = Slide::encode(&w, &SlideOptions::default()).unwrap();
        assert_eq!(s.nibble(0, 2), 0b1100); // (0, 3)
        assert_eq!(s.values()[5].to_f32(), 9.0);
    }

    #[test]
    fn negative_zero_is_kept() {
        let mut data = vec![f16::ZERO; 8];
        data[3] = f16::NEG_ZERO;
        let w = DenseMatrix::new(1, 8, data).unwrap();
        let s = Slide::encode(&w, &SlideOptions::default()).unwrap();
        let d = s.decode();
        assert_eq!(d.get(0, 3).to_bits(), 0x8000);
        assert_eq!(d, w);
    }

    #[test]
    fn violation_names_row_and_group() {
        let mut v = vec![0f32; 3 * 16];
        for c in 8..15 {
            v[2 * 16 + c] = 1.0; // row 2, block 1: 7 nonzeros
        }
        let e = Slide::encode(&m(3, 16, &v), &SlideOptions::default()).unwrap_err();
        match e {
            FormatError::Pattern(msg) => {
                assert!(msg.contains("row 2, group 1"), "{msg}");
                assert!(msg.contains("7 nonzeros"), "{msg}");
            }
            other => panic!("unexpected error {other:?}"),
        }
    }

    #[test]
    fn bad_n_rejected() {
        let w = m(1, 4, &[1., 0., 0., 0.]);
        for n in [0, 1, 9, 100] {
            assert!(matches!(
                Slide::encode(&w, &SlideOptions { n }),
                Err(FormatError::Option(_))
            ));
        }
    }

    #[test]
    fn from_pattern() {
        let p = |n, m| Pattern::NM { n, m };
        assert_eq!(SlideOptions::from_pattern(p(6, 8)).unwrap().n, 4);
        assert_eq!(SlideOptions::from_pattern(p(2, 4)).unwrap().n, 2);
        assert_eq!(SlideOptions::from_pattern(p(14, 16)).unwrap().n, 8);
        assert!(SlideOptions::from_pattern(p(16, 18)).is_err());
        assert!(SlideOptions::from_pattern(p(4, 8)).is_err());
        assert!(SlideOptions::from_pattern(Pattern::Unstructured).is_err());
    }

    #[test]
    fn prune_keeps_largest() {
        let w = m(1, 8, &[1., -8., 3., 0.5, 7., 2., -6., 4.]);
        let p = prune_to_pattern(&w, 4).unwrap();
        let got: Vec<f32> = p.data().iter().map(|v| v.to_f32()).collect();
        assert_eq!(got, vec![0., -8., 3., 0., 7., 2., -6., 4.]);
        assert!(Slide::encode(&p, &SlideOptions::default()).is_ok());
    }

    #[test]
    fn corrupt_nibble_and_double_claim_rejected() {
        let w = m(1, 8, &[1., 2., 3., 4., 5., 6., 0., 0.]);
        let s = Slide::encode(&w, &SlideOptions::default()).unwrap();
        let read = |s: &Slide| {
            let mut bw = ByteWriter::new();
            s.write_payload(&mut bw);
            Slide::read_payload(&mut ByteReader::new(&bw.buf))
        };
        assert_eq!(read(&s).unwrap(), s);
        let mut bad = s.clone();
        bad.metadata[0] = (bad.metadata[0] & !0xF) | 0b0001; // (1, 0): not increasing
        assert!(matches!(read(&bad), Err(FormatError::Corrupt(_))));
        let mut bad = s.clone();
        // Window 1 claims columns 2, 3 (its positions 0, 1); make window 0 claim (2, 3) too.
        bad.metadata[0] = (bad.metadata[0] & !0xF) | 0b1110;
        assert!(matches!(read(&bad), Err(FormatError::Corrupt(_))));
        let mut bad = s.clone();
        bad.metadata[0] |= 1 << 28; // an unused tail nibble
        assert!(matches!(read(&bad), Err(FormatError::Corrupt(_))));
        let mut bad = s.clone();
        bad.values[0] = f16::NAN;
        assert!(matches!(read(&bad), Err(FormatError::Corrupt(_))));
    }

    #[test]
    fn nonzero_in_padding_rejected() {
        let w = m(1, 6, &[1., 0., 0., 0., 0., 2.]); // padded to 8
        let s = Slide::encode(&w, &SlideOptions::default()).unwrap();
        let mut bad = s.clone();
        // Window 2 covers columns 4..8; point its second slot at column 7 (padding), nonzero.
        bad.metadata[0] = (bad.metadata[0] & !(0xF << 8)) | (0b1100 << 8);
        bad.values[5] = f16::ONE;
        let mut bw = ByteWriter::new();
        bad.write_payload(&mut bw);
        let e = Slide::read_payload(&mut ByteReader::new(&bw.buf)).unwrap_err();
        assert!(e.to_string().contains("padding"), "{e}");
    }

    #[test]
    fn concat_rows_equals_encoding_the_joined_rows() {
        use crate::random::{sparse_matrix, Pattern};
        let a = sparse_matrix(5, 30, 0.0, Pattern::NM { n: 6, m: 8 }, 1).unwrap();
        let b = sparse_matrix(3, 30, 0.0, Pattern::NM { n: 6, m: 8 }, 2).unwrap();
        let opts = SlideOptions { n: 4 };
        let (sa, sb) = (
            Slide::encode(&a, &opts).unwrap(),
            Slide::encode(&b, &opts).unwrap(),
        );
        let mut data = a.data().to_vec();
        data.extend_from_slice(b.data());
        let joined = DenseMatrix::new(8, 30, data).unwrap();
        let want = Slide::encode(&joined, &opts).unwrap();
        assert_eq!(Slide::concat_rows(&[&sa, &sb]).unwrap(), want);
        // Another K, or another N, is refused.
        let c = Slide::encode(
            &sparse_matrix(2, 32, 0.0, Pattern::NM { n: 6, m: 8 }, 3).unwrap(),
            &opts,
        )
        .unwrap();
        assert!(Slide::concat_rows(&[&sa, &c]).is_err());
        let d = Slide::encode(&a, &SlideOptions { n: 8 }).unwrap();
        assert!(Slide::concat_rows(&[&sa, &d]).is_err());
        assert!(Slide::concat_rows(&[]).is_err());
        // The encoded matrix is reachable through the trait object.
        let f: &dyn WeightFormat = &sa;
        assert_eq!(
            f.as_any().and_then(|a| a.downcast_ref::<Slide>()),
            Some(&sa)
        );
    }
}
