//! Balanced-CBC: balanced sparsity (Yao et al. 2019, "Balanced Sparsity for Efficient DNN
//! Inference on GPU") on Celty-style column tiles. Every group of 16 consecutive output rows of
//! one input column keeps at most N nonzeros (N:16 along the outputs) and is stored in exactly N
//! slots, so a warp lane that owns 16 rows reads a fixed N f16 values per active input column
//! with fully coalesced loads and no per-column metadata (no offsets, no counts).
//!
//! # Tiling
//!
//! ```text
//!  W is M x K (rows = outputs, cols = inputs), f16
//!  lane group G = 16 rows; row tile T = 512 rows = 32 lanes x 16 rows
//!  RT = ceil(M / 512) row tiles; rows >= M of the last tile are zero rows
//!  group (k, g) = column k, rows 16 g .. 16 g + 15
//!
//!            k=0     k=1          k=K-1
//!          +-----+ +-----+      +-----+
//!  rt=0    |lane0| |lane0|      |lane0|     rows    0 ..  15
//!          |lane1| |lane1| ...  |lane1|     rows   16 ..  31
//!          | ... | | ... |      | ... |
//!          |ln 31| |ln 31|      |ln 31|     rows  496 .. 511
//!          +-----+ +-----+      +-----+
//!          blk 0   blk 1        blk K-1
//!  rt=1    blk K   blk K+1  ... blk 2K-1    rows  512 .. 1023
//!  ...
//!  block b = rt * K + k covers rows 512 rt .. 512 rt + 511 of column k
//! ```
//!
//! # Slots
//!
//! N (1..=16) is one number for the whole matrix: every group holds at most N nonzeros and is
//! stored with exactly N slots, its nonzeros plus `N - count` padding slots at the lowest-row
//! positions of the group whose weight is +0 and that are not already slots (padding value +0).
//! So every lane bitmap has exactly N bits set. Slot i of a lane is its i-th set bit in
//! ascending row order. As in every sieve format only +0 is a zero ([`crate::matrix::is_zero`]):
//! a -0 weight is a nonzero and takes a slot, so decode is bit-exact.
//!
//! # Block (block_bytes = 64 N + 64, a multiple of 64)
//!
//! ```text
//!  byte offset           size             content (lane j = 0..31: rows 512 rt + 16 j .. + 15)
//!  0                     floor(N/2) * 128 words: u32 index w * 32 + j (little-endian) holds
//!                                         slot 2w (low 16 bits) and slot 2w + 1 (high 16 bits)
//!                                         of lane j, f16 bits
//!  floor(N/2) * 128      64 (N odd only)  tail: u16 entry j = slot N - 1 of lane j
//!  64 N                  64               bitmaps: u16 entry j, bit r set <=> row
//!                                         512 rt + 16 j + r is a slot of lane j
//!
//!  +--------+--------+-----+--------------+------+--------+
//!  | w0 x32 | w1 x32 | ... | w(N/2-1) x32 | tail | bitmap |   one block, (rt, k)
//!  +--------+--------+-----+--------------+------+--------+
//!   128 B    128 B          128 B          64 B   64 B
//!
//!  N even: N/2 * 128 + 64 = 64 N + 64;  N odd: (N-1)/2 * 128 + 64 + 64 = 64 N + 64
//! ```
//!
//! Blocks are stored rt-major then k, block b at byte offset `b * block_bytes`;
//! [`BalancedCbc::blocks`] is that whole image, which a GPU uploads as-is.
//!
//! # Storage
//!
//! payload = `RT K 32 N 2` bytes (the slot values, padding included),
//! metadata = `RT K 64` bytes (the lane bitmaps).

use crate::blob::{ByteReader, ByteWriter};
use crate::error::{FormatError, Result};
use crate::format::{
    column_block_product, ColumnBlocks, FormatKind, Storage, Threshold, WeightFormat,
};
use crate::matrix::{is_zero, DenseMatrix};
use half::f16;
use rayon::prelude::*;

/// Rows a warp lane owns: one group.
pub const LANE_ROWS: usize = 16;
/// Lanes per row tile (one warp).
pub const LANES: usize = 32;
/// Rows per row tile, `LANES * LANE_ROWS`.
pub const TILE_ROWS: usize = LANES * LANE_ROWS;
/// The largest slot count N (a group has 16 rows).
pub const MAX_SLOTS: usize = LANE_ROWS;

/// Bytes of one (row tile, column) block for `n` slots: `64 n + 64`.
pub const fn block_bytes_for(n: usize) -> usize {
    64 * n + 64
}

/// Byte offset inside a block of slot `i` of lane `j` (an f16, little-endian), for `n` slots.
#[inline(always)]
fn slot_offset(n: usize, lane: usize, i: usize) -> usize {
    if i < n & !1 {
        ((i / 2) * LANES + lane) * 4 + (i % 2) * 2
    } else {
        (n / 2) * 128 + 2 * lane
    }
}

/// Byte offset inside a block of the bitmap of lane `j`, for `n` slots.
#[inline(always)]
fn bitmap_offset(n: usize, lane: usize) -> usize {
    64 * n + 2 * lane
}

#[inline(always)]
fn read_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

#[inline(always)]
fn write_u16(bytes: &mut [u8], at: usize, v: u16) {
    bytes[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

/// The lane bitmap of a group with nonzero rows `nz` stored in `n` slots: `nz` plus the
/// lowest `n - popcount(nz)` rows not in `nz`. Requires `popcount(nz) <= n <= 16`.
fn slot_bitmap(nz: u16, n: usize) -> u16 {
    let mut bitmap = nz;
    let mut free = !nz;
    for _ in nz.count_ones() as usize..n {
        bitmap |= free & free.wrapping_neg();
        free &= free - 1;
    }
    bitmap
}

/// The slot count N for a target sparsity: `round(16 (1 - sp))` clamped to `1..=16`, i.e. the
/// N of the N:16 pattern whose density is closest to `1 - sp` (sp 0.5 -> 8, 0.7 -> 5,
/// 0.75 -> 4, 0.99 -> 1). `sp` outside `[0, 1)` (or NaN) is [`FormatError::Sparsity`].
pub fn slots_for_sparsity(sp: f64) -> Result<usize> {
    if !(0.0..1.0).contains(&sp) {
        return Err(FormatError::Sparsity(sp));
    }
    Ok(((LANE_ROWS as f64 * (1.0 - sp)).round() as usize).clamp(1, MAX_SLOTS))
}

/// A matrix in Balanced-CBC. See the module documentation for the exact layout.
#[derive(Clone, Debug, PartialEq)]
pub struct BalancedCbc {
    rows: usize,
    cols: usize,
    slots: usize,
    blocks: Vec<u8>,
}

/// Nonzero masks of every group, `masks[g * K + k]` for group `g` (rows 16 g ..) of column k,
/// bit r set <=> `W[16 g + r][k]` is not +0. Groups of rows >= M are not included.
fn group_masks(w: &DenseMatrix) -> Vec<u16> {
    let (m, k) = (w.rows(), w.cols());
    let mut masks = vec![0u16; m.div_ceil(LANE_ROWS) * k];
    masks.par_chunks_mut(k).enumerate().for_each(|(g, out)| {
        for r in 0..LANE_ROWS.min(m - g * LANE_ROWS) {
            for (mask, &v) in out.iter_mut().zip(w.row(g * LANE_ROWS + r)) {
                if !is_zero(v) {
                    *mask |= 1 << r;
                }
            }
        }
    });
    masks
}

impl BalancedCbc {
    /// Encodes `w` with N = the largest nonzero count of any group (at least 1).
    pub fn encode(w: &DenseMatrix) -> Result<Self> {
        let masks = group_masks(w);
        let n = masks
            .par_iter()
            .map(|m| m.count_ones() as usize)
            .max()
            .unwrap_or(0)
            .max(1);
        Self::encode_masks(w, &masks, n)
    }

    /// Encodes `w` with `n` slots per group. `n` outside `1..=16` is [`FormatError::Option`];
    /// a group with more than `n` nonzeros is [`FormatError::Pattern`] naming the first one (in
    /// row-group then column order).
    pub fn encode_with_slots(w: &DenseMatrix, n: usize) -> Result<Self> {
        if !(1..=MAX_SLOTS).contains(&n) {
            return Err(FormatError::Option(format!(
                "balanced-cbc: {n} slots per group, expected 1..={MAX_SLOTS}"
            )));
        }
        let masks = group_masks(w);
        if let Some(i) = masks.iter().position(|m| m.count_ones() as usize > n) {
            let (g, k) = (i / w.cols(), i % w.cols());
            let r0 = g * LANE_ROWS;
            return Err(FormatError::Pattern(format!(
                "balanced-cbc with {n} slots: column {k}, group {g} (rows {r0}..{}) has {} \
                 nonzeros, more than {n} of 16",
                (r0 + LANE_ROWS).min(w.rows()),
                masks[i].count_ones()
            )));
        }
        Self::encode_masks(w, &masks, n)
    }

    fn encode_masks(w: &DenseMatrix, masks: &[u16], n: usize) -> Result<Self> {
        let (m, k) = (w.rows(), w.cols());
        let rt_count = m.div_ceil(TILE_ROWS);
        let bb = block_bytes_for(n);
        let len = crate::size::product("balanced-cbc blocks", &[rt_count, k, bb])?;
        let mut blocks = Vec::new();
        blocks.try_reserve_exact(len).map_err(|_| {
            FormatError::Size(format!("balanced-cbc: {len} bytes cannot be allocated"))
        })?;
        blocks.resize(len, 0u8);
        let groups = m.div_ceil(LANE_ROWS);
        blocks
            .par_chunks_mut(bb)
            .enumerate()
            .for_each(|(b, block)| {
                let (rt, col) = (b / k, b % k);
                for lane in 0..LANES {
                    let g = rt * LANES + lane;
                    let nz = if g < groups { masks[g * k + col] } else { 0 };
                    let bitmap = slot_bitmap(nz, n);
                    write_u16(block, bitmap_offset(n, lane), bitmap);
                    let mut bits = bitmap;
                    let mut slot = 0;
                    while bits != 0 {
                        let r = bits.trailing_zeros() as usize;
                        if nz & (1 << r) != 0 {
                            let v = w.get(g * LANE_ROWS + r, col).to_bits();
                            write_u16(block, slot_offset(n, lane, slot), v);
                        }
                        slot += 1;
                        bits &= bits - 1;
                    }
                }
            });
        Ok(Self {
            rows: m,
            cols: k,
            slots: n,
            blocks,
        })
    }

    /// N, the slots stored per group (every lane bitmap has exactly N bits set).
    pub fn slots(&self) -> usize {
        self.slots
    }
    /// Row tiles, `ceil(M / 512)`.
    pub fn row_tiles(&self) -> usize {
        self.rows.div_ceil(TILE_ROWS)
    }
    /// Bytes of one (row tile, column) block, `64 N + 64`.
    pub fn block_bytes(&self) -> usize {
        block_bytes_for(self.slots)
    }
    /// The whole device image: `row_tiles() * K` blocks, block `rt * K + k` at byte offset
    /// `(rt * K + k) * block_bytes()` (module documentation).
    pub fn blocks(&self) -> &[u8] {
        &self.blocks
    }

    fn block(&self, b: usize) -> &[u8] {
        let bb = self.block_bytes();
        &self.blocks[b * bb..(b + 1) * bb]
    }

    pub fn read_payload(r: &mut ByteReader) -> Result<Self> {
        let corrupt = |msg: String| FormatError::Corrupt(format!("balanced-cbc payload: {msg}"));
        let rows = r.usize()?;
        let cols = r.usize()?;
        let slots = r.usize()?;
        if rows == 0 || cols == 0 {
            return Err(corrupt(format!("empty shape {rows} x {cols}")));
        }
        if rows
            .checked_mul(cols)
            .is_none_or(|e| e > isize::MAX as usize / 2)
        {
            return Err(corrupt(format!("shape {rows} x {cols} too large")));
        }
        if !(1..=MAX_SLOTS).contains(&slots) {
            return Err(corrupt(format!(
                "{slots} slots per group, expected 1..={MAX_SLOTS}"
            )));
        }
        let len = rows
            .div_ceil(TILE_ROWS)
            .checked_mul(cols)
            .and_then(|b| b.checked_mul(block_bytes_for(slots)))
            .ok_or_else(|| corrupt(format!("{rows} x {cols} with {slots} slots overflows")))?;
        // `bytes` checks the length against what remains before anything is allocated.
        let blocks = r.bytes(len)?.to_vec();
        let out = Self {
            rows,
            cols,
            slots,
            blocks,
        };
        out.validate_blocks().map_err(corrupt)?;
        Ok(out)
    }

    /// Checks every lane of every block: N bits set, finite values, no nonzero at rows >= M, and
    /// padding slots (+0 values) exactly at the lowest free rows, as [`Self::encode`] places
    /// them, so that a blob that loads re-encodes to the same bytes.
    fn validate_blocks(&self) -> std::result::Result<(), String> {
        let (n, k, bb) = (self.slots, self.cols, self.block_bytes());
        self.blocks
            .par_chunks(bb)
            .enumerate()
            .try_for_each(|(b, block)| {
                let (rt, col) = (b / k, b % k);
                let at =
                    |lane: usize| format!("block {b} (row tile {rt}, column {col}) lane {lane}");
                for lane in 0..LANES {
                    let bitmap = read_u16(block, bitmap_offset(n, lane));
                    if bitmap.count_ones() as usize != n {
                        return Err(format!(
                            "{}: bitmap has {} bits set, expected {n}",
                            at(lane),
                            bitmap.count_ones()
                        ));
                    }
                    let row0 = rt * TILE_ROWS + lane * LANE_ROWS;
                    let mut nz = 0u16;
                    let mut bits = bitmap;
                    for slot in 0..n {
                        let r = bits.trailing_zeros() as usize;
                        bits &= bits - 1;
                        let v = f16::from_bits(read_u16(block, slot_offset(n, lane, slot)));
                        if !v.is_finite() {
                            return Err(format!("{}: slot {slot} is not finite", at(lane)));
                        }
                        if is_zero(v) {
                            continue;
                        }
                        if row0 + r >= self.rows {
                            return Err(format!(
                                "{}: slot {slot} at row {} (>= M = {}) is not +0",
                                at(lane),
                                row0 + r,
                                self.rows
                            ));
                        }
                        nz |= 1 << r;
                    }
                    if slot_bitmap(nz, n) != bitmap {
                        return Err(format!(
                            "{}: padding slots are not the lowest zero rows (bitmap {bitmap:#06x}, \
                             nonzeros {nz:#06x})",
                            at(lane)
                        ));
                    }
                }
                Ok(())
            })
    }
}

impl ColumnBlocks for BalancedCbc {
    fn block_rows(&self) -> usize {
        TILE_ROWS
    }
    /// Stored +0 (padding) slots are not reported: they add nothing, and those of rows >= M
    /// lie outside the block's live height.
    #[inline(always)]
    fn walk<F: FnMut(usize, f16)>(&self, block: usize, col: usize, mut f: F) {
        let n = self.slots;
        let data = self.block(block * self.cols + col);
        for lane in 0..LANES {
            let mut bits = read_u16(data, bitmap_offset(n, lane));
            for slot in 0..n {
                let r = bits.trailing_zeros() as usize;
                bits &= bits.wrapping_sub(1);
                let v = read_u16(data, slot_offset(n, lane, slot));
                if v != 0 {
                    f(lane * LANE_ROWS + r, f16::from_bits(v));
                }
            }
        }
    }
}

impl WeightFormat for BalancedCbc {
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
        let blocks = self.row_tiles() * self.cols;
        Storage {
            payload_bytes: blocks * LANES * self.slots * 2,
            metadata_bytes: blocks * LANES * 2,
        }
    }
    fn decode(&self) -> DenseMatrix {
        let (m, k) = (self.rows, self.cols);
        let mut data = vec![f16::ZERO; m * k];
        for rt in 0..self.row_tiles() {
            for col in 0..k {
                self.walk(rt, col, |row, v| {
                    data[(rt * TILE_ROWS + row) * k + col] = v;
                });
            }
        }
        DenseMatrix::new(m, k, data).expect("validated on encode/read: shape and finite values")
    }
    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<()> {
        column_block_product(self, (self.rows, self.cols), x, 1, threshold, y)
    }
    fn matmul(&self, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) -> Result<()> {
        column_block_product(self, (self.rows, self.cols), x, n, threshold, y)
    }
    fn write_payload(&self, w: &mut ByteWriter) {
        w.u64(self.rows as u64);
        w.u64(self.cols as u64);
        w.u64(self.slots as u64);
        w.buf.extend_from_slice(&self.blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_arithmetic() {
        for n in 1..=MAX_SLOTS {
            let bb = block_bytes_for(n);
            assert_eq!(bb % 64, 0);
            let values_end = (n / 2) * 128 + if n % 2 == 1 { 64 } else { 0 };
            assert_eq!(values_end, 64 * n, "values fill 0..64 N for N = {n}");
            // Every slot of every lane has its own two bytes below the bitmaps.
            let mut seen = vec![false; bb];
            for lane in 0..LANES {
                for i in 0..n {
                    let o = slot_offset(n, lane, i);
                    assert!(o + 2 <= 64 * n);
                    assert!(!seen[o] && !seen[o + 1]);
                    seen[o] = true;
                    seen[o + 1] = true;
                }
                let o = bitmap_offset(n, lane);
                assert!(!seen[o] && o + 2 <= bb);
                seen[o] = true;
                seen[o + 1] = true;
            }
            assert!(
                seen.iter().all(|&s| s),
                "N = {n}: the block is exactly covered"
            );
        }
    }

    #[test]
    fn slot_bitmap_pads_lowest_free_rows() {
        assert_eq!(slot_bitmap(0, 3), 0b111);
        assert_eq!(slot_bitmap(0b1010, 4), 0b1111);
        assert_eq!(slot_bitmap(0b1000_0000_0000_0000, 2), 0b1000_0000_0000_0001);
        assert_eq!(slot_bitmap(0b0110, 2), 0b0110);
        assert_eq!(slot_bitmap(0, 16), 0xffff);
        assert_eq!(slot_bitmap(0x00ff, 16), 0xffff);
    }

    #[test]
    fn slots_for_sparsity_rounds_and_clamps() {
        assert_eq!(slots_for_sparsity(0.0).unwrap(), 16);
        assert_eq!(slots_for_sparsity(0.5).unwrap(), 8);
        assert_eq!(slots_for_sparsity(0.7).unwrap(), 5);
        assert_eq!(slots_for_sparsity(0.75).unwrap(), 4);
        assert_eq!(slots_for_sparsity(0.99).unwrap(), 1);
        for bad in [-0.1, 1.0, 2.0, f64::NAN] {
            assert!(matches!(
                slots_for_sparsity(bad),
                Err(FormatError::Sparsity(_))
            ));
        }
    }
}
