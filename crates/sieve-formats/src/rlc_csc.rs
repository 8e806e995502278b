//! RLC-CSC (Celty): compressed sparse columns whose row indices are n-bit run lengths, laid out
//! so that a CUDA warp reads values and indices with straight vector loads.
//!
//! # Logical encoding
//!
//! `W` (M x K) is cut into **row blocks** of `B = block_rows` rows (a multiple of 256, default
//! 4096; the last block is shorter when `M % B != 0`, height `h_b = min(B, M - b B)`, nothing is
//! padded in M or K). A **segment** is one column `k` of one row block `b`, with id
//! `seg = b * K + k` (row-block-major, so the columns one CTA walks are adjacent).
//!
//! A segment is a list of entries in row order, entry `i` = (value `v_i`: f16, run `r_i`: n bits):
//!
//! ```text
//!     row_i = row_{i-1} + 1 + r_i,      row_{-1} = -1        (rows relative to the block start)
//! ```
//!
//! so `r_i` is the number of zero rows skipped before entry `i`, and `row_i` is one inclusive prefix
//! sum of `(r_i + 1)`, minus one. Every value that is not +0 is an entry (-0 included, see
//! [`crate::matrix::is_zero`]). A gap of `G` zero rows before an entry, `G > 2^n - 1`, is bridged
//! by `floor(G / 2^n)` **gap-padding entries** (value +0, run `2^n - 1`), each sitting on the last
//! zero row of its `2^n`-row stride; the entry then gets run `G mod 2^n`. Trailing zeros of a
//! segment need nothing, so a segment never ends with a gap-padding entry.
//!
//! Example (Celty's), n = 2, column `[0,0,4,0,0,0,0,2,8]`: values `[4, 0, 2, 8]`, runs
//! `[2, 3, 0, 0]`, rows `2, 6, 7, 8`. Celty's text writes runs `[2, 3, 1, 0]`, i.e. its padding
//! entry occupies no row; here a padding entry occupies a (zero) row, which keeps the decode one
//! uniform prefix sum with no special case and bridges `2^n` rows per padding entry instead of
//! `2^n - 1`. Multiplying a padding entry is harmless (`+0 * x` added to a zero row).
//!
//! A segment with `E` entries (`seg_len`, gap padding included) is stored as
//! `E' = 32 * ceil(E / 32)` entries: the `E' - E` **tail entries** have value +0 and run 0 and
//! must be masked by the kernel (logical index `>= E`); their rows may lie outside the block.
//!
//! # Slabs and lane interleaving
//!
//! The `E'` entries of a segment are cut into **slabs** of 256 logical entries (the warp's
//! 256-"row" tile of Celty: 32 lanes x 8 f16). Slab `j` has `S_j = min(8, E'/32 - 8 j)` stripes
//! (8 for every slab but possibly the last). Lane `t` (0..32) owns logical entries
//! `256 j + 32 s + t`, `s = 0..S_j` (Celty's interleave: lane 0 takes 0, 32, 64, ..., 224), and
//! its entries are contiguous:
//!
//! ```text
//!     storage position  p = slab_base_j + t * S_j + s,     slab_base_j = seg_start[seg] + 256 j
//!
//!  values (f16), one full slab (S = 8), 512 bytes, 64-byte aligned:
//!  +-------------------+-------------------+-----+-------------------+
//!  | lane 0: s=0..7    | lane 1: s=0..7    | ... | lane 31: s=0..7   |
//!  | ent 0,32,..,224   | ent 1,33,..,225   |     | ent 31,63,..,255  |
//!  +-------------------+-------------------+-----+-------------------+
//!    16 B = uint4         16 B = uint4              16 B = uint4
//!
//!  last slab with S = 3 (E' - 256 j = 96 entries): lane t's 3 values at slab_base + 3 t
//!  +---------+---------+-----+---------+
//!  | l0: 0,32,64 | l1: 1,33,65 | ... | l31: 31,63,95 |
//!  +---------+---------+-----+---------+
//! ```
//!
//! The run of storage position `p` lives at bits `[n p, n p + n)` of the index bit stream (bit
//! `q` is bit `q % 32` of `indices[q / 32]`, little-endian, LSB first), i.e. indices are parallel
//! to values. Consequences: a segment's runs start on a word boundary (word `n * seg_start / 32`);
//! in a full slab lane `t`'s 8 runs are the `n` bytes at byte `n * (slab_base + 8 t) / 8`: for the
//! default n = 4 exactly the u32 word `(slab_base / 8) + t` (run of stripe `s` in bits `4s..4s+4`).
//! In a short last slab a lane's `S n` bits may straddle two words.
//!
//! # Arrays (all exposed read-only)
//!
//! ```text
//!  values      [f16]  len V = sum of E' over segments (a multiple of 32)
//!  indices     [u32]  len n V / 32, the run bit stream described above
//!  seg_start   [u32]  len nseg + 1, storage position of each segment's first entry,
//!                     multiples of 32, seg_start[0] = 0, seg_start[nseg] = V
//!  seg_len     [u32]  len nseg, E of each segment (E' = seg_start[s+1] - seg_start[s])
//!  slab_start  [u32]  len nseg + 1, slabs of segment s are slab_start[s] .. slab_start[s+1]
//!                     (ceil(E' / 256) of them); slab_start[nseg] = number of slabs
//!  slab_row    [u16]  one per slab: the cursor row_{i-1} + 1 before the slab's first entry i
//!                     (0 for a segment's first slab), so warps can take slabs independently
//!  nseg = ceil(M / B) * K
//! ```
//!
//! # Kernel recipe (one warp, one slab of segment `seg` with activation `x_k`)
//!
//! 1. `S = min(8, (seg_start[seg+1] - slab_base) / 32)`; lane `t` loads its `S` values at
//!    `slab_base + t S` (one 128-bit load when `S = 8`) and its `S` runs (one u32 when n = 4 and
//!    `S = 8`).
//! 2. `cursor = slab_row[slab]`. For `s = 0..S`: `c = r + 1` for each lane, inclusive warp scan of
//!    `c` over lanes, `row = cursor + scan - 1`, `valid = 256 j + 32 s + t < seg_len[seg]`;
//!    if valid `acc[row] += v * x_k`; `cursor += shfl(scan, 31)`.
//! 3. `acc` is the block's `h_b`-float shared buffer; rows of valid entries are always `< h_b`.
//!
//! Storage: payload = `2 V` bytes (values incl. gap and tail padding); metadata = packed runs plus
//! `seg_start`, `seg_len`, `slab_start` (4 bytes each) and `slab_row` (2 bytes each).

use crate::blob::{ByteReader, ByteWriter};
use crate::error::{FormatError, Result};
use crate::format::{
    column_block_product, ColumnBlocks, FormatKind, Storage, Threshold, WeightFormat,
};
use crate::matrix::{is_zero, DenseMatrix};
use half::f16;
use rayon::prelude::*;

/// Lanes of a warp; entries of a segment are padded to a multiple of this.
pub const LANES: usize = 32;
/// f16 values one lane reads with a 128-bit load.
pub const LANE_VECTOR: usize = 8;
/// Logical entries per slab (32 lanes x 8).
pub const SLAB_ENTRIES: usize = LANES * LANE_VECTOR;
/// Row blocks are multiples of this (one warp-tile of Celty's kernel).
pub const BLOCK_ROWS_GRANULE: usize = 256;
/// Largest row block: slab cursors are stored as u16.
pub const MAX_BLOCK_ROWS: usize = 65536;
pub const MIN_INDEX_BITS: u32 = 2;
pub const MAX_INDEX_BITS: u32 = 8;

/// Encoding options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RlcCscOptions {
    /// n, the bits of each run-length index (2..=8). Celty uses 4.
    pub index_bits: u32,
    /// Rows per segment (a multiple of 256, at most 65536). Larger blocks pad less (one tail per
    /// segment) and need a larger shared-memory accumulator in the kernel.
    pub block_rows: usize,
}

impl Default for RlcCscOptions {
    fn default() -> Self {
        Self {
            index_bits: 4,
            block_rows: 4096,
        }
    }
}

impl RlcCscOptions {
    pub fn validate(&self) -> Result<()> {
        if !(MIN_INDEX_BITS..=MAX_INDEX_BITS).contains(&self.index_bits) {
            return Err(FormatError::Option(format!(
                "rlc-csc index bits {} outside {MIN_INDEX_BITS}..={MAX_INDEX_BITS}",
                self.index_bits
            )));
        }
        if self.block_rows == 0
            || !self.block_rows.is_multiple_of(BLOCK_ROWS_GRANULE)
            || self.block_rows > MAX_BLOCK_ROWS
        {
            return Err(FormatError::Option(format!(
                "rlc-csc block rows {} must be a positive multiple of {BLOCK_ROWS_GRANULE} \
                 and at most {MAX_BLOCK_ROWS}",
                self.block_rows
            )));
        }
        Ok(())
    }
}

/// A matrix in RLC-CSC. See the module documentation for the exact layout.
#[derive(Clone, Debug, PartialEq)]
pub struct RlcCsc {
    rows: usize,
    cols: usize,
    options: RlcCscOptions,
    values: Vec<f16>,
    indices: Vec<u32>,
    seg_start: Vec<u32>,
    seg_len: Vec<u32>,
    slab_start: Vec<u32>,
    slab_row: Vec<u16>,
}

/// One encoded segment before concatenation.
struct EncodedSegment {
    len: usize,
    values: Vec<f16>,
    words: Vec<u32>,
    slab_rows: Vec<u16>,
}

fn round_up(v: usize, to: usize) -> usize {
    v.div_ceil(to) * to
}

/// Stripes (entries per lane) of the slab starting `offset` entries into a segment padded to
/// `padded` entries.
#[inline(always)]
fn stripes(padded: usize, offset: usize) -> usize {
    ((padded - offset) / LANES).min(LANE_VECTOR)
}

#[inline(always)]
fn read_bits(words: &[u32], bit: usize, n: u32) -> u32 {
    let w = bit / 32;
    let off = (bit % 32) as u32;
    let mut v = words[w] >> off;
    if off + n > 32 {
        v |= words[w + 1] << (32 - off);
    }
    v & ((1u32 << n) - 1)
}

#[inline(always)]
fn write_bits(words: &mut [u32], bit: usize, n: u32, value: u32) {
    let w = bit / 32;
    let off = (bit % 32) as u32;
    words[w] |= value << off;
    if off + n > 32 {
        words[w + 1] |= value >> (32 - off);
    }
}

/// Encodes one segment given its column values (row order, relative to the block).
fn encode_segment(column: &[f16], n: u32) -> Result<EncodedSegment> {
    let stride = 1usize << n;
    let mut entries: Vec<(f16, u32)> = Vec::new();
    let mut last_row: isize = -1;
    for (r, &v) in column.iter().enumerate() {
        if is_zero(v) {
            continue;
        }
        let mut gap = (r as isize - last_row - 1) as usize;
        while gap >= stride {
            entries.push((f16::ZERO, (stride - 1) as u32));
            gap -= stride;
        }
        entries.push((v, gap as u32));
        last_row = r as isize;
    }
    let len = entries.len();
    let padded = round_up(len, LANES);
    let mut values = vec![f16::ZERO; padded];
    let mut words = vec![0u32; padded * n as usize / 32];
    let mut slab_rows = Vec::with_capacity(padded.div_ceil(SLAB_ENTRIES));
    let mut cursor = 0usize;
    let mut slab_base = 0;
    while slab_base < padded {
        let s_count = stripes(padded, slab_base);
        slab_rows.push(u16::try_from(cursor).map_err(|_| {
            FormatError::Option(format!("rlc-csc slab cursor {cursor} exceeds u16"))
        })?);
        for s in 0..s_count {
            for t in 0..LANES {
                let logical = slab_base + s * LANES + t;
                if logical >= len {
                    continue;
                }
                let (v, run) = entries[logical];
                let pos = slab_base + t * s_count + s;
                values[pos] = v;
                write_bits(&mut words, pos * n as usize, n, run);
                cursor += run as usize + 1;
            }
        }
        slab_base += s_count * LANES;
    }
    Ok(EncodedSegment {
        len,
        values,
        words,
        slab_rows,
    })
}

impl RlcCsc {
    pub fn encode(w: &DenseMatrix, options: &RlcCscOptions) -> Result<Self> {
        options.validate()?;
        let (m, k) = (w.rows(), w.cols());
        let n = options.index_bits;
        let b_rows = options.block_rows;
        let blocks = m.div_ceil(b_rows);
        // Columns are gathered once (a strided walk of the row-major matrix) and encoded in
        // parallel; segments are then concatenated in `b * K + k` order.
        let per_column: Vec<Vec<EncodedSegment>> = (0..k)
            .into_par_iter()
            .map(|col| {
                let column: Vec<f16> = (0..m).map(|r| w.get(r, col)).collect();
                column
                    .chunks(b_rows)
                    .map(|block| encode_segment(block, n))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        let nseg = blocks * k;
        let mut out = Self {
            rows: m,
            cols: k,
            options: *options,
            values: Vec::new(),
            indices: Vec::new(),
            seg_start: Vec::with_capacity(nseg + 1),
            seg_len: Vec::with_capacity(nseg),
            slab_start: Vec::with_capacity(nseg + 1),
            slab_row: Vec::new(),
        };
        let too_big = || FormatError::Option("rlc-csc: more than 2^32 stored entries".into());
        out.seg_start.push(0);
        out.slab_start.push(0);
        for b in 0..blocks {
            for col in &per_column {
                let seg = &col[b];
                out.values.extend_from_slice(&seg.values);
                out.indices.extend_from_slice(&seg.words);
                out.slab_row.extend_from_slice(&seg.slab_rows);
                out.seg_len
                    .push(u32::try_from(seg.len).map_err(|_| too_big())?);
                out.seg_start
                    .push(u32::try_from(out.values.len()).map_err(|_| too_big())?);
                out.slab_start
                    .push(u32::try_from(out.slab_row.len()).map_err(|_| too_big())?);
            }
        }
        Ok(out)
    }

    pub fn options(&self) -> &RlcCscOptions {
        &self.options
    }
    pub fn index_bits(&self) -> u32 {
        self.options.index_bits
    }
    pub fn block_rows(&self) -> usize {
        self.options.block_rows
    }
    /// Number of row blocks, `ceil(M / block_rows)`.
    pub fn row_blocks(&self) -> usize {
        self.rows.div_ceil(self.options.block_rows)
    }
    /// Number of segments, `row_blocks() * K`; segment id `b * K + k`.
    pub fn segments(&self) -> usize {
        self.row_blocks() * self.cols
    }
    /// Stored values, one per storage position (see the module documentation).
    pub fn values(&self) -> &[f16] {
        &self.values
    }
    /// The values as raw f16 bits, for device upload.
    pub fn value_bits(&self) -> &[u16] {
        half::slice::HalfFloatSliceExt::reinterpret_cast(self.values.as_slice())
    }
    /// The run-length bit stream, `index_bits` bits per storage position, LSB first.
    pub fn packed_indices(&self) -> &[u32] {
        &self.indices
    }
    pub fn seg_start(&self) -> &[u32] {
        &self.seg_start
    }
    pub fn seg_len(&self) -> &[u32] {
        &self.seg_len
    }
    pub fn slab_start(&self) -> &[u32] {
        &self.slab_start
    }
    pub fn slab_row(&self) -> &[u16] {
        &self.slab_row
    }
    /// The run stored at storage position `pos`.
    pub fn run_at(&self, pos: usize) -> u32 {
        read_bits(
            &self.indices,
            pos * self.options.index_bits as usize,
            self.options.index_bits,
        )
    }

    /// Rows in row block `b`.
    fn block_height(&self, b: usize) -> usize {
        self.options
            .block_rows
            .min(self.rows - b * self.options.block_rows)
    }

    /// Calls `f(row_in_block, value)` for every meaningful entry of segment `seg` (gap padding
    /// included: its value is +0), in row order.
    #[inline(always)]
    fn walk_segment<F: FnMut(usize, f16)>(&self, seg: usize, mut f: F) {
        let start = self.seg_start[seg] as usize;
        let padded = self.seg_start[seg + 1] as usize - start;
        let len = self.seg_len[seg] as usize;
        let n = self.options.index_bits;
        let mut cursor = 0usize;
        let mut offset = 0usize;
        while offset < len {
            let s_count = stripes(padded, offset);
            let base = start + offset;
            for s in 0..s_count {
                for t in 0..LANES {
                    if offset + s * LANES + t >= len {
                        return;
                    }
                    let pos = base + t * s_count + s;
                    let row = cursor + read_bits(&self.indices, pos * n as usize, n) as usize;
                    f(row, self.values[pos]);
                    cursor = row + 1;
                }
            }
            offset += s_count * LANES;
        }
    }

    pub fn read_payload(r: &mut ByteReader) -> Result<Self> {
        let corrupt = |msg: String| FormatError::Corrupt(format!("rlc-csc payload: {msg}"));
        let rows = r.usize()?;
        let cols = r.usize()?;
        let index_bits = r.u32()?;
        let block_rows = r.usize()?;
        if rows == 0 || cols == 0 {
            return Err(corrupt(format!("empty shape {rows} x {cols}")));
        }
        if rows
            .checked_mul(cols)
            .is_none_or(|e| e > isize::MAX as usize / 2)
        {
            return Err(corrupt(format!("shape {rows} x {cols} too large")));
        }
        let options = RlcCscOptions {
            index_bits,
            block_rows,
        };
        options.validate().map_err(|e| corrupt(e.to_string()))?;
        let nseg = rows
            .div_ceil(block_rows)
            .checked_mul(cols)
            .ok_or_else(|| corrupt("segment count overflows".into()))?;
        let values = r.f16s()?;
        let indices = r.u32s()?;
        let seg_start = r.u32s()?;
        let seg_len = r.u32s()?;
        let slab_start = r.u32s()?;
        let slab_row = r.u16s()?;
        let check_len = |what: &str, got: usize, want: usize| {
            if got == want {
                Ok(())
            } else {
                Err(corrupt(format!(
                    "{what} has {got} elements, expected {want}"
                )))
            }
        };
        check_len("seg_start", seg_start.len(), nseg + 1)?;
        check_len("seg_len", seg_len.len(), nseg)?;
        check_len("slab_start", slab_start.len(), nseg + 1)?;
        if !values.len().is_multiple_of(LANES) {
            return Err(corrupt(format!(
                "{} values, not a multiple of {LANES}",
                values.len()
            )));
        }
        check_len(
            "indices",
            indices.len(),
            values.len() / 32 * index_bits as usize,
        )?;
        if seg_start[0] != 0 || slab_start[0] != 0 {
            return Err(corrupt("first segment does not start at 0".into()));
        }
        for s in 0..nseg {
            let (a, b) = (seg_start[s] as usize, seg_start[s + 1] as usize);
            let len = seg_len[s] as usize;
            if b < a || b - a != round_up(len, LANES) {
                return Err(corrupt(format!(
                    "segment {s}: start {a}..{b} does not hold {len} entries padded to {LANES}"
                )));
            }
            let (sa, sb) = (slab_start[s] as usize, slab_start[s + 1] as usize);
            if sb < sa || sb - sa != (b - a).div_ceil(SLAB_ENTRIES) {
                return Err(corrupt(format!("segment {s}: bad slab range {sa}..{sb}")));
            }
        }
        check_len("values", values.len(), seg_start[nseg] as usize)?;
        check_len("slab_row", slab_row.len(), slab_start[nseg] as usize)?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(corrupt(format!("non-finite value at position {i}")));
        }
        let out = Self {
            rows,
            cols,
            options,
            values,
            indices,
            seg_start,
            seg_len,
            slab_start,
            slab_row,
        };
        out.validate_streams().map_err(corrupt)?;
        Ok(out)
    }

    /// Checks, segment by segment, what the kernel relies on: every meaningful entry lies inside
    /// its block, slab cursors match the runs, tail entries are (+0, run 0), and the encoding is
    /// canonical (a +0 entry is gap padding: maximal run, followed by another entry).
    fn validate_streams(&self) -> std::result::Result<(), String> {
        let n = self.options.index_bits;
        let max_run = (1u32 << n) - 1;
        let cols = self.cols;
        (0..self.segments()).into_par_iter().try_for_each(|seg| {
            let height = self.block_height(seg / cols);
            let start = self.seg_start[seg] as usize;
            let padded = self.seg_start[seg + 1] as usize - start;
            let len = self.seg_len[seg] as usize;
            let mut cursor = 0usize;
            let mut slab = self.slab_start[seg] as usize;
            let mut offset = 0usize;
            while offset < padded {
                let s_count = stripes(padded, offset);
                if self.slab_row[slab] as usize != cursor {
                    return Err(format!(
                        "segment {seg}: slab {slab} cursor {} should be {cursor}",
                        self.slab_row[slab]
                    ));
                }
                let base = start + offset;
                for s in 0..s_count {
                    for t in 0..LANES {
                        let logical = offset + s * LANES + t;
                        let pos = base + t * s_count + s;
                        let run = read_bits(&self.indices, pos * n as usize, n);
                        let v = self.values[pos];
                        if logical >= len {
                            if run != 0 || !is_zero(v) {
                                return Err(format!("segment {seg}: tail entry {pos} not (+0, 0)"));
                            }
                            continue;
                        }
                        let row = cursor + run as usize;
                        if row >= height {
                            return Err(format!(
                                "segment {seg}: entry {logical} at row {row} beyond block height {height}"
                            ));
                        }
                        if is_zero(v) && (run != max_run || logical + 1 == len) {
                            return Err(format!(
                                "segment {seg}: non-canonical +0 entry {logical}"
                            ));
                        }
                        cursor = row + 1;
                    }
                }
                offset += s_count * LANES;
                slab += 1;
            }
            Ok(())
        })
    }

    /// The shared column-compressed product (see [`crate::format::column_block_product`]).
    fn product(&self, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) -> Result<()> {
        column_block_product(self, (self.rows, self.cols), x, n, threshold, y)
    }
}

impl ColumnBlocks for RlcCsc {
    fn block_rows(&self) -> usize {
        self.options.block_rows
    }
    #[inline(always)]
    fn walk<F: FnMut(usize, f16)>(&self, block: usize, col: usize, f: F) {
        self.walk_segment(block * self.cols + col, f);
    }
}

impl WeightFormat for RlcCsc {
    fn kind(&self) -> FormatKind {
        FormatKind::RlcCsc
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> Storage {
        Storage {
            payload_bytes: self.values.len() * 2,
            metadata_bytes: self.indices.len() * 4
                + (self.seg_start.len() + self.seg_len.len() + self.slab_start.len()) * 4
                + self.slab_row.len() * 2,
        }
    }
    fn decode(&self) -> DenseMatrix {
        let (m, k) = (self.rows, self.cols);
        let mut data = vec![f16::ZERO; m * k];
        let b_rows = self.options.block_rows;
        for seg in 0..self.segments() {
            let (b, col) = (seg / k, seg % k);
            self.walk_segment(seg, |row, v| data[(b * b_rows + row) * k + col] = v);
        }
        DenseMatrix::new(m, k, data).expect("validated on encode/read: shape and finite values")
    }
    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<()> {
        self.product(x, 1, threshold, y)
    }
    fn matmul(&self, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) -> Result<()> {
        self.product(x, n, threshold, y)
    }
    fn write_payload(&self, w: &mut ByteWriter) {
        w.u64(self.rows as u64);
        w.u64(self.cols as u64);
        w.u32(self.options.index_bits);
        w.u64(self.options.block_rows as u64);
        w.f16s(&self.values);
        w.u32s(&self.indices);
        w.u32s(&self.seg_start);
        w.u32s(&self.seg_len);
        w.u32s(&self.slab_start);
        w.u16s(&self.slab_row);
    }
}
