//! Tiled-CBC (SPDP): 256 x 1 column tiles described by four u64 bitmaps, grouped into GTiles of
//! 16 columns with per-column ColInfo and a TileOffset per GTile.
//!
//! # Tiling
//!
//! ```text
//!  TILE_M = 256, TILE_K = 16
//!  RT = ceil(M / 256) row tiles, KT = ceil(K / 16) column groups, NGT = RT * KT GTiles
//!  M' = 256 RT, K' = 16 KT (the matrix is zero-padded to M' x K'; see "Padding" below)
//!
//!  GTile g = rt * KT + kt   (GTiles in row-major order) covers rows 256 rt .. 256 rt + 255
//!                                                      and columns 16 kt .. 16 kt + 15
//!  column tile (g, c), c = 0..16: column k = 16 kt + c of that row tile (256 x 1)
//!
//!           kt=0            kt=1
//!        +--+--+..+--+   +--+--+..+--+
//!  rt=0  |c0|c1|  |15|   |c0|c1|  |15|     GTile 0, GTile 1, ...
//!        |  |  |  |  |   |  |  |  |  |     each cN is a 256 x 1 column tile
//!        +--+--+..+--+   +--+--+..+--+
//!  rt=1  |  GTile KT |   | GTile KT+1|
//! ```
//!
//! # Arrays (all exposed read-only)
//!
//! ```text
//!  tile_offset [u32] NGT + 1   first value (in f16 elements) of each GTile; tile_offset[0] = 0,
//!                              tile_offset[g+1] = tile_offset[g] + sum_c round8(nnz(g, c)),
//!                              so every entry is a multiple of 8 (16 bytes)
//!  col_info    [u32] 16 NGT    col_info[16 g + c] = (off << 16) | nnz
//!                              nnz = nonzeros of column tile (g, c) (0..=256)
//!                              off = f16 offset of its first value from tile_offset[g]:
//!                              off(c = 0) = 0, off(c + 1) = off(c) + round8(nnz(c))  (<= 3840)
//!  bitmaps     [u64] 64 NGT    bitmaps[(16 g + c) * 4 + w], bit b (LSB = bit 0) set <=>
//!                              W[256 rt + 64 w + b][16 kt + c] is not +0 (-0 is a nonzero)
//!  values      [f16]           column tile (g, c): its nonzeros in row order at
//!                              tile_offset[g] + off .. + nnz, then round8(nnz) - nnz +0 values
//! ```
//!
//! Value of row `64 w + b` (bit set) of column tile (g, c):
//! `values[tile_offset[g] + off + rank]`, `rank = popcount(bits below b in word w) +
//! popcount(words 0..w)`, which is SPDP's MaskedPopcount. Each column's values start on a
//! 16-byte boundary so a warp can `cp.async` them with 128-bit transfers.
//!
//! # Padding
//!
//! Rows `M..M'` and columns `K..K'` are stored as zeros (clear bits, nnz = 0) so that every
//! GTile has the same shape; a kernel must bound its reads of `x` by `K` and its writes of `y`
//! by `M`.
//!
//! # Storage
//!
//! SPDP's formula with the padded shape, plus value padding:
//! metadata = `4 (NGT + 1) + 4 (16 NGT) + 8 (M' K' / 64)` bytes,
//! payload = `2 * values.len()` = `2 (NNZ + sum of per-column padding)` bytes.

use crate::blob::{ByteReader, ByteWriter};
use crate::error::{FormatError, Result};
use crate::format::{
    column_block_product, ColumnBlocks, FormatKind, Storage, Threshold, WeightFormat,
};
use crate::matrix::{is_zero, DenseMatrix};
use half::f16;
use rayon::prelude::*;

pub const TILE_M: usize = 256;
pub const TILE_K: usize = 16;
/// u64 bitmap words per 256 x 1 column tile.
pub const WORDS_PER_COLUMN: usize = TILE_M / 64;
/// Column values are padded to a multiple of this many f16 (16 bytes).
pub const VALUE_ALIGN: usize = 8;

/// A matrix in Tiled-CBC. See the module documentation for the exact layout.
#[derive(Clone, Debug, PartialEq)]
pub struct TiledCbc {
    rows: usize,
    cols: usize,
    tile_offset: Vec<u32>,
    col_info: Vec<u32>,
    bitmaps: Vec<u64>,
    values: Vec<f16>,
}

/// One GTile before concatenation.
struct EncodedGTile {
    col_info: [u32; TILE_K],
    bitmaps: [u64; TILE_K * WORDS_PER_COLUMN],
    values: Vec<f16>,
}

fn round_up(v: usize, to: usize) -> usize {
    v.div_ceil(to) * to
}

impl TiledCbc {
    pub fn encode(w: &DenseMatrix) -> Result<Self> {
        let (m, k) = (w.rows(), w.cols());
        let (rt_count, kt_count) = (m.div_ceil(TILE_M), k.div_ceil(TILE_K));
        let gtiles: Vec<EncodedGTile> = (0..rt_count * kt_count)
            .into_par_iter()
            .map(|g| {
                let (rt, kt) = (g / kt_count, g % kt_count);
                let mut columns: [Vec<f16>; TILE_K] = Default::default();
                let mut bitmaps = [0u64; TILE_K * WORDS_PER_COLUMN];
                let col0 = kt * TILE_K;
                let width = TILE_K.min(k - col0);
                // Row-major walk of the tile keeps the reads of W contiguous.
                for r in 0..TILE_M.min(m - rt * TILE_M) {
                    let row = &w.row(rt * TILE_M + r)[col0..col0 + width];
                    for (c, &v) in row.iter().enumerate() {
                        if !is_zero(v) {
                            bitmaps[c * WORDS_PER_COLUMN + r / 64] |= 1u64 << (r % 64);
                            columns[c].push(v);
                        }
                    }
                }
                let mut col_info = [0u32; TILE_K];
                let mut values = Vec::new();
                for (c, col) in columns.iter().enumerate() {
                    col_info[c] = ((values.len() as u32) << 16) | col.len() as u32;
                    values.extend_from_slice(col);
                    values.resize(round_up(values.len(), VALUE_ALIGN), f16::ZERO);
                }
                EncodedGTile {
                    col_info,
                    bitmaps,
                    values,
                }
            })
            .collect();
        let ngt = gtiles.len();
        let mut out = Self {
            rows: m,
            cols: k,
            tile_offset: Vec::with_capacity(ngt + 1),
            col_info: Vec::with_capacity(ngt * TILE_K),
            bitmaps: Vec::with_capacity(ngt * TILE_K * WORDS_PER_COLUMN),
            values: Vec::new(),
        };
        out.tile_offset.push(0);
        for gt in &gtiles {
            out.col_info.extend_from_slice(&gt.col_info);
            out.bitmaps.extend_from_slice(&gt.bitmaps);
            out.values.extend_from_slice(&gt.values);
            out.tile_offset
                .push(u32::try_from(out.values.len()).map_err(|_| {
                    FormatError::Option("tiled-cbc: more than 2^32 stored values".into())
                })?);
        }
        Ok(out)
    }

    /// Row tiles, `ceil(M / 256)`.
    pub fn row_tiles(&self) -> usize {
        self.rows.div_ceil(TILE_M)
    }
    /// Column groups per row tile, `ceil(K / 16)`.
    pub fn col_tiles(&self) -> usize {
        self.cols.div_ceil(TILE_K)
    }
    /// Number of GTiles, `row_tiles() * col_tiles()`.
    pub fn gtiles(&self) -> usize {
        self.row_tiles() * self.col_tiles()
    }
    pub fn tile_offset(&self) -> &[u32] {
        &self.tile_offset
    }
    pub fn col_info(&self) -> &[u32] {
        &self.col_info
    }
    pub fn bitmaps(&self) -> &[u64] {
        &self.bitmaps
    }
    pub fn values(&self) -> &[f16] {
        &self.values
    }
    /// The values as raw f16 bits, for device upload.
    pub fn value_bits(&self) -> &[u16] {
        half::slice::HalfFloatSliceExt::reinterpret_cast(self.values.as_slice())
    }

    /// Calls `f(row_in_tile, value)` for every nonzero of column tile `ct = 16 g + c`, in row
    /// order. `base` is `tile_offset[g]`.
    #[inline(always)]
    fn walk_column<F: FnMut(usize, f16)>(&self, ct: usize, base: usize, mut f: F) {
        let info = self.col_info[ct];
        if info & 0xffff == 0 {
            return;
        }
        let mut pos = base + (info >> 16) as usize;
        let words = &self.bitmaps[ct * WORDS_PER_COLUMN..(ct + 1) * WORDS_PER_COLUMN];
        for (w, &word) in words.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                f(w * 64 + b, self.values[pos]);
                pos += 1;
                bits &= bits - 1;
            }
        }
    }

    pub fn read_payload(r: &mut ByteReader) -> Result<Self> {
        let corrupt = |msg: String| FormatError::Corrupt(format!("tiled-cbc payload: {msg}"));
        let rows = r.usize()?;
        let cols = r.usize()?;
        if rows == 0 || cols == 0 {
            return Err(corrupt(format!("empty shape {rows} x {cols}")));
        }
        if rows
            .checked_mul(cols)
            .is_none_or(|e| e > isize::MAX as usize / 2)
        {
            return Err(corrupt(format!("shape {rows} x {cols} too large")));
        }
        let ngt = rows.div_ceil(TILE_M) * cols.div_ceil(TILE_K);
        let tile_offset = r.u32s()?;
        let col_info = r.u32s()?;
        let bitmaps = r.u64s()?;
        let values = r.f16s()?;
        let check_len = |what: &str, got: usize, want: usize| {
            if got == want {
                Ok(())
            } else {
                Err(corrupt(format!(
                    "{what} has {got} elements, expected {want}"
                )))
            }
        };
        check_len("tile_offset", tile_offset.len(), ngt + 1)?;
        check_len("col_info", col_info.len(), ngt * TILE_K)?;
        check_len("bitmaps", bitmaps.len(), ngt * TILE_K * WORDS_PER_COLUMN)?;
        check_len("values", values.len(), tile_offset[ngt] as usize)?;
        if tile_offset[0] != 0 {
            return Err(corrupt("tile_offset[0] is not 0".into()));
        }
        // Monotone offsets bound every GTile's range by values.len() before the parallel checks.
        if let Some(g) = tile_offset.windows(2).position(|p| p[1] < p[0]) {
            return Err(corrupt(format!("tile_offset decreases at GTile {g}")));
        }
        let out = Self {
            rows,
            cols,
            tile_offset,
            col_info,
            bitmaps,
            values,
        };
        out.validate_tiles().map_err(corrupt)?;
        Ok(out)
    }

    /// Checks every GTile: offsets consistent with ColInfo, nnz equal to the bitmap popcount,
    /// padded rows and columns empty, stored values finite and not +0, padding values +0.
    fn validate_tiles(&self) -> std::result::Result<(), String> {
        let kt_count = self.col_tiles();
        (0..self.gtiles()).into_par_iter().try_for_each(|g| {
            let (rt, kt) = (g / kt_count, g % kt_count);
            let (start, end) = (
                self.tile_offset[g] as usize,
                self.tile_offset[g + 1] as usize,
            );
            let live_rows = TILE_M.min(self.rows - rt * TILE_M);
            let mut expected_off = 0usize;
            for c in 0..TILE_K {
                let ct = g * TILE_K + c;
                let info = self.col_info[ct];
                let (off, nnz) = ((info >> 16) as usize, (info & 0xffff) as usize);
                if off != expected_off {
                    return Err(format!(
                        "GTile {g} column {c}: offset {off}, expected {expected_off}"
                    ));
                }
                let words = &self.bitmaps[ct * WORDS_PER_COLUMN..(ct + 1) * WORDS_PER_COLUMN];
                let popcount: usize = words.iter().map(|w| w.count_ones() as usize).sum();
                if popcount != nnz {
                    return Err(format!(
                        "GTile {g} column {c}: nnz {nnz}, bitmap has {popcount}"
                    ));
                }
                if nnz > 0 && kt * TILE_K + c >= self.cols {
                    return Err(format!("GTile {g} column {c}: padding column has entries"));
                }
                for (w, &word) in words.iter().enumerate() {
                    let live = live_rows.saturating_sub(w * 64).min(64);
                    if live < 64 && word >> live != 0 {
                        return Err(format!("GTile {g} column {c}: bits set in padding rows"));
                    }
                }
                let first = start + off;
                let padded = round_up(nnz, VALUE_ALIGN);
                if first + padded > end {
                    return Err(format!("GTile {g} column {c}: values overrun the GTile"));
                }
                let stored = &self.values[first..first + nnz];
                if let Some(i) = stored.iter().position(|v| !v.is_finite() || is_zero(*v)) {
                    return Err(format!(
                        "GTile {g} column {c}: value {i} is +0 or not finite"
                    ));
                }
                if self.values[first + nnz..first + padded]
                    .iter()
                    .any(|v| !is_zero(*v))
                {
                    return Err(format!("GTile {g} column {c}: padding values are not +0"));
                }
                expected_off += padded;
            }
            if end - start != expected_off {
                return Err(format!(
                    "GTile {g}: holds {} values, columns need {expected_off}",
                    end - start
                ));
            }
            Ok(())
        })
    }

    /// The shared column-compressed product (see [`crate::format::column_block_product`]).
    fn product(&self, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) -> Result<()> {
        column_block_product(self, (self.rows, self.cols), x, n, threshold, y)
    }
}

impl ColumnBlocks for TiledCbc {
    fn block_rows(&self) -> usize {
        TILE_M
    }
    #[inline(always)]
    fn walk<F: FnMut(usize, f16)>(&self, block: usize, col: usize, f: F) {
        let g = block * self.col_tiles() + col / TILE_K;
        self.walk_column(g * TILE_K + col % TILE_K, self.tile_offset[g] as usize, f);
    }
}

impl WeightFormat for TiledCbc {
    fn kind(&self) -> FormatKind {
        FormatKind::TiledCbc
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
            metadata_bytes: self.tile_offset.len() * 4
                + self.col_info.len() * 4
                + self.bitmaps.len() * 8,
        }
    }
    fn decode(&self) -> DenseMatrix {
        let (m, k) = (self.rows, self.cols);
        let kt_count = self.col_tiles();
        let mut data = vec![f16::ZERO; m * k];
        for g in 0..self.gtiles() {
            let (rt, kt) = (g / kt_count, g % kt_count);
            let base = self.tile_offset[g] as usize;
            for c in 0..TILE_K.min(k - kt * TILE_K) {
                let col = kt * TILE_K + c;
                self.walk_column(g * TILE_K + c, base, |row, v| {
                    data[(rt * TILE_M + row) * k + col] = v;
                });
            }
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
        w.u32s(&self.tile_offset);
        w.u32s(&self.col_info);
        w.u64s(&self.bitmaps);
        w.f16s(&self.values);
    }
}
